#pragma once
// Selection: the pure selection of the contract (docs/DESIGN.md), over plain tensors. Stateless;
// EvictionPolicy (eviction_policy.hpp) holds the state and calls it.

#include <kvevict/check.hpp>
#include <kvevict/options.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

namespace kvevict {
namespace detail {

/// One heavy-hitter candidate of one row, for the CPU selection.
struct Candidate {
  float score;      // ranking score (fp32)
  int64_t position; // original position
  int64_t slot;     // slot in the layer's buffers
};

/// Contract rules 3 and 9: true when `a` is evicted before `b`. Non-finite scores rank below
/// every finite score; equal scores (and non-finite ones) evict the older position first.
inline bool evicted_before(const Candidate& a, const Candidate& b) noexcept {
  const bool fa = std::isfinite(a.score), fb = std::isfinite(b.score);
  if (fa != fb) return !fa;
  if (fa && a.score != b.score) return a.score < b.score;
  return a.position < b.position;
}

/// Tag: the caller guarantees that positions hold every sink and at least capacity - n_sink
/// heavy-hitter candidates plus the cached part of the recent window (the caches: a recent-window
/// token may be missing only where a truncate left it in the host tier, and a missing window
/// token leaves one more candidate, so a pass still keeps capacity tokens).
struct TrustedPositions {};

/// The key a score ranks by (contract rule 9): itself if finite, else -inf (NaN included).
inline float rank_key(float score) noexcept {
  return std::fabs(score) <= std::numeric_limits<float>::max() ? score : -std::numeric_limits<float>::infinity();
}

/// The lowest rank_key() of x[0, n). SSE2 (every x86-64) takes 8 floats per iteration;
/// elsewhere a scalar loop (compilers do not vectorise a float min without -ffast-math).
inline float lowest_key(const float* x, int64_t n) noexcept {
  float lowest = std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__SSE2__) || defined(_M_X64)
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  const __m128 max = _mm_set1_ps(std::numeric_limits<float>::max());
  const __m128 minus_inf = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  const auto key = [&](__m128 v) {  // rank_key of 4 floats
    const __m128 finite = _mm_cmple_ps(_mm_and_ps(v, abs_mask), max);  // false for NaN and +-inf
    return _mm_or_ps(_mm_and_ps(finite, v), _mm_andnot_ps(finite, minus_inf));
  };
  __m128 lo0 = _mm_set1_ps(lowest), lo1 = lo0;
  for (; i + 8 <= n; i += 8) {
    lo0 = _mm_min_ps(lo0, key(_mm_loadu_ps(x + i)));
    lo1 = _mm_min_ps(lo1, key(_mm_loadu_ps(x + i + 4)));
  }
  float lanes[4];
  _mm_storeu_ps(lanes, _mm_min_ps(lo0, lo1));
  for (const float l : lanes) lowest = std::min(lowest, l);
#endif
  for (; i < n; ++i) lowest = std::min(lowest, rank_key(x[i]));
  return lowest;
}

/// rank_key() on a tensor of fp32 ranks: non-finite -> -inf, and -0 -> +0 (a radix sort or
/// select on CUDA must not order -0 below +0: they tie, rule 3). A new tensor.
inline at::Tensor rank_keys(const at::Tensor& ranks) {
  const float inf = std::numeric_limits<float>::infinity();
  return at::nan_to_num(ranks, -inf, -inf, -inf).add_(0.0);
}

/// Positions below this make eviction_keys() exact (they fill the key's low 32 bits).
constexpr int64_t kKeyPositions = int64_t{1} << 32;

/// The order of evicted_before() as one int64 per slot, for a single top-k: the rank key's
/// bits mapped to an int32 that orders as the float does, times 2^32, plus the position (ties
/// evict the older). `ranks` [B, S] fp32, `positions` [B, S] int64 in [0, kKeyPositions) (dead
/// slots may hold anything: the caller masks them).
inline at::Tensor eviction_keys(const at::Tensor& ranks, const at::Tensor& positions) {
  const auto bits = rank_keys(ranks).view(at::kInt);
  // Negative floats order backwards by their bits: flip their magnitude bits.
  const auto ordered = bits.bitwise_xor(bits.__rshift__(31).bitwise_and_(0x7fffffff));
  return positions.add(ordered.to(at::kLong), /*alpha=*/kKeyPositions);
}

/// The tensor form of one pass's selection: [B, k] slots of each row's k heavy-hitter candidates
/// (n_sink <= position < recent_from) evicted first, in eviction order when `ordered` (a row
/// that evicts n < k then takes its first n), else in no particular order; a row with fewer
/// than k candidates fills its columns with non-candidates (the caller masks them).
///
/// \param ranks        [B, S] fp32 scorer ranks, slot order.
/// \param positions    [B, S] int64 positions, -1 dead.
/// \param recent_from  [B, 1] int64 first position of each row's recent window, on the device.
/// \param max_seen     the most tokens any row has seen (host): below 2^32 one top-k over
///                     eviction_keys(); else two stable sorts (by position, then by rank key).
/// No host sync.
inline at::Tensor lowest_candidates(const at::Tensor& ranks, const at::Tensor& positions, int64_t n_sink,
                                    const at::Tensor& recent_from, int64_t k, int64_t max_seen, bool ordered) {
  const auto other = positions.lt(n_sink).logical_or_(positions.ge(recent_from));  // sinks, recent, dead
  if (max_seen <= kKeyPositions) {
    const auto key = eviction_keys(ranks, positions).masked_fill_(other, std::numeric_limits<int64_t>::max());
    return std::get<1>(at::topk(key, k, /*dim=*/1, /*largest=*/false, /*sorted=*/ordered));
  }
  const auto by_position = std::get<1>(at::sort(
      positions.masked_fill(positions.lt(0), std::numeric_limits<int64_t>::max()), /*dim=*/1));  // oldest first
  const auto key = rank_keys(ranks).masked_fill_(other, std::numeric_limits<float>::infinity());
  const auto order = std::get<1>(at::sort(key.gather(1, by_position), /*stable=*/true, /*dim=*/1,
                                          /*descending=*/false)).narrow(1, 0, k);
  return by_position.gather(1, order);
}

/// Recall's victims in tensor form (tier/tensor_path.hpp): of each row's candidates (n_sink <=
/// position < recent_from), their number `count` [B] int64, the `k` lowest in eviction order
/// `lowest` [B, k] int64 slots (a row with fewer candidates fills its columns with
/// non-candidates) and the best-ranked candidate's slot `best` [B, 1] int64 (anything for a row
/// without candidates). Arguments as lowest_candidates(); k <= S. Below 2^32 positions one key
/// per slot (eviction_keys()): one top-k and one argmax; past, lowest_candidates()'s two stable
/// sorts of every slot. No host sync.
struct RecallCandidates {
  at::Tensor count, lowest, best;
};
inline RecallCandidates recall_candidates(const at::Tensor& ranks, const at::Tensor& positions, int64_t n_sink,
                                          const at::Tensor& recent_from, int64_t k, int64_t max_seen) {
  RecallCandidates out;
  const auto other = positions.lt(n_sink).logical_or_(positions.ge(recent_from));  // sinks, recent, dead
  out.count = other.logical_not().sum(1);
  if (max_seen <= kKeyPositions) {
    const auto key = eviction_keys(ranks, positions);
    out.lowest = std::get<1>(at::topk(key.masked_fill(other, std::numeric_limits<int64_t>::max()), k, /*dim=*/1,
                                      /*largest=*/false, /*sorted=*/true));
    out.best = key.masked_fill_(other, std::numeric_limits<int64_t>::min()).argmax(1, /*keepdim=*/true);
  } else {
    const auto order = lowest_candidates(ranks, positions, n_sink, recent_from, positions.size(1), max_seen, true);
    out.lowest = order.narrow(1, 0, k);
    out.best = order.gather(1, out.count.sub(1).clamp_min_(0).unsqueeze(1));
  }
  return out;
}

/// Every slot of each row in eviction order (evicted_before(): lower rank first, equal ranks
/// the older position, non-finite ranks lowest), ascending, dead slots (position -1) first:
/// [B, M] int64 slots. `ranks` [B, M] fp32, `positions` [B, M] int64; `max_position` (host) more
/// than any position: below 2^32 one sort of eviction_keys(), else two stable sorts (by
/// position, then by rank key), as lowest_candidates(). No host sync. The tier's budget
/// (TierStore::take()) keeps each row's last ones.
inline at::Tensor eviction_order(const at::Tensor& ranks, const at::Tensor& positions, int64_t max_position) {
  const auto dead = positions.lt(0);
  if (max_position <= kKeyPositions) {
    const auto key = eviction_keys(ranks, positions).masked_fill_(dead, std::numeric_limits<int64_t>::min());
    return std::get<1>(at::sort(key, 1));
  }
  const auto by_position = std::get<1>(at::sort(positions.masked_fill(dead, -1), /*stable=*/true, /*dim=*/1, false));
  const auto key = rank_keys(ranks).masked_fill_(dead, -std::numeric_limits<float>::infinity());
  return by_position.gather(1, std::get<1>(at::sort(key.gather(1, by_position), /*stable=*/true, 1, false)));
}

}  // namespace detail

/// Chooses which tokens an eviction pass removes: per batch row, keep every sink (the first
/// `n_sink` positions), every recent-window token (the `n_recent` largest positions), and the
/// `budget` other tokens with the highest score; evict the rest. Lower score is evicted first,
/// among equal scores the older position, and non-finite scores rank below all finite ones
/// (docs/DESIGN.md, contract rules 2, 3, 9). Rows never share scores. Heavy hitters as in H2O
/// (Zhang et al. 2023, Sec. 3.2), but cross-head: all heads of a row keep the same tokens.
///
/// Stateless: ranks the scores it is given. EvictionPolicy (eviction_policy.hpp) keeps the scores
/// and positions of a cache and calls it for every pass.
class Selection {
 public:
  /// \throws c10::ValueError if `options` are invalid (see EvictionOptions::validate).
  explicit Selection(EvictionOptions options = EvictionOptions()) : options_(options) {
    options_.validate();
  }

  const EvictionOptions& options() const noexcept { return options_; }
  /// n_sink + budget + n_recent tokens per row.
  int64_t capacity() const noexcept { return options_.capacity(); }

  /// One-shot selection for prefill compression: which of S prefill tokens (positions
  /// 0..S-1) to keep.
  ///
  /// \param scores  [B, S] per-token scores, any floating dtype, any device.
  /// \return [B, min(S, capacity)] int64 positions to keep, ascending per row, on scores' device.
  /// \throws c10::Error if scores is not 2-D floating.
  at::Tensor keep_indices(const at::Tensor& scores) const {
    detail::check_shape(scores, "scores", {-1, -1}, {"B", "S"}, "a 2-D tensor");
    detail::check_floating(scores, "scores");
    const int64_t B = scores.size(0), S = scores.size(1);
    auto idx = at::arange(S, scores.options().dtype(at::kLong)).expand({B, S}).contiguous();
    if (S <= capacity()) return idx;
    // fp64 ranks as given; narrower dtypes widen to fp32 exactly.
    const auto key = scores.scalar_type() == at::kDouble ? scores : scores.to(at::kFloat);
    idx.scatter_(1, evict_slots(key, idx), S);
    return std::get<0>(at::sort(idx, /*dim=*/1)).narrow(1, 0, capacity()).contiguous();
  }

  /// The selection of one eviction pass over one layer's live slots, with tensor ops (no
  /// host sync, static shapes), for prompt compression (keep_indices()). The caches' passes
  /// run detail::lowest_candidates(), which orders the same way.
  ///
  /// \param scores     [B, S] ranking scores (fp32 or fp64; ranked in their own dtype), slot order.
  /// \param positions  [B, S] int64 original positions, slot order, distinct per row, on
  ///                   scores' device; the n_sink smallest are the sinks, the n_recent largest
  ///                   the recent window.
  /// \return [B, S - capacity] int64 slots to evict, ascending per row ([B, 0] if S <= capacity).
  /// \throws c10::Error on a shape, dtype or device mismatch, naming the tensor.
  at::Tensor evict_slots(const at::Tensor& scores, const at::Tensor& positions) const {
    detail::check_shape(scores, "scores", {-1, -1}, {"B", "S"}, "a 2-D tensor");
    detail::check_floating(scores, "scores");
    const int64_t B = scores.size(0), S = scores.size(1);
    detail::check_shape(positions, "positions", {B, S}, {"B", "S"}, "[B, S] like scores");
    KVEVICT_CHECK_TYPE(positions.scalar_type() == at::kLong, "positions must be int64, got ", positions.scalar_type());
    KVEVICT_CHECK(positions.device() == scores.device(), "positions must be on scores' device ", scores.device(),
                  ", got ", positions.device());
    const int64_t n_evict = std::max<int64_t>(S - capacity(), 0);
    if (n_evict == 0) return at::empty({B, 0}, positions.options());
    const auto by_position = std::get<1>(at::sort(positions, /*dim=*/1));      // slots, oldest first
    const auto key = detail::rank_keys(scores.gather(1, by_position));
    const int64_t n_cand = S - options_.n_sink() - options_.n_recent();
    const auto cand = key.narrow(1, options_.n_sink(), n_cand);
    // Stable ascending sort: equal keys keep position order, so the older is evicted first.
    const auto lowest = std::get<1>(at::sort(cand, /*stable=*/true, /*dim=*/1, /*descending=*/false))
                            .narrow(1, 0, n_evict);
    const auto slots = by_position.gather(1, lowest.add(options_.n_sink()));
    return std::get<0>(at::sort(slots, /*dim=*/1));
  }

  /// The same selection for one row on the host (what the caches run on CPU).
  ///
  /// \param scores     [S] fp32 ranking scores, slot order.
  /// \param positions  [S] int64 positions, slot order.
  /// \param seen       tokens ever appended (positions >= seen - n_recent are the window).
  /// \param out        [S - capacity] receives the slots to evict, ascending.
  /// \param scratch    reused between calls (no allocation once it has grown to S).
  /// \throws c10::Error if the sinks or the recent window are not all among `positions`.
  void evict_slots_row(const float* scores, const int64_t* positions, int64_t S, int64_t seen,
                       int64_t* out, std::vector<detail::Candidate>& scratch) const {
    select_row(scores, positions, S, seen, out, scratch, /*check=*/true);
  }

  /// evict_slots_row() for a caller that guarantees TrustedPositions' precondition (the caches):
  /// it evicts the n_evict lowest candidates however many there are. One evicted token, the
  /// decode step, then costs a single scan that reads a slot's position only when its score
  /// could win, without first counting the candidates.
  void evict_slots_row(const float* scores, const int64_t* positions, int64_t S, int64_t seen,
                       int64_t* out, std::vector<detail::Candidate>& scratch, detail::TrustedPositions) const {
    select_row(scores, positions, S, seen, out, scratch, /*check=*/false);
  }

 private:
  void select_row(const float* scores, const int64_t* positions, int64_t S, int64_t seen, int64_t* out,
                  std::vector<detail::Candidate>& scratch, bool check) const {
    const int64_t n_evict = S - capacity();
    if (n_evict <= 0) return;
    const int64_t recent_from = seen - options_.n_recent();
    if (n_evict == 1) {
      // The decode steady state (one token in, one out): a single scan, no candidate list.
      if (check) check_candidates(count_candidates(positions, S, recent_from), n_evict);
      out[0] = lowest_candidate(scores, positions, S, recent_from);
      return;
    }
    scratch.clear();
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = positions[s];
      if (p >= options_.n_sink() && p < recent_from) scratch.push_back({scores[s], p, s});
    }
    if (check) {
      check_candidates(static_cast<int64_t>(scratch.size()), n_evict);
    } else {
      TORCH_INTERNAL_ASSERT(static_cast<int64_t>(scratch.size()) >= n_evict, "kvevict: ", scratch.size(),
                            " eviction candidates for ", n_evict, " evictions");
    }
    // A lambda, not the function pointer: std::nth_element inlines it (about 2x faster).
    std::nth_element(scratch.begin(), scratch.begin() + n_evict, scratch.end(),
                     [](const detail::Candidate& a, const detail::Candidate& b) { return detail::evicted_before(a, b); });
    for (int64_t i = 0; i < n_evict; ++i) out[i] = scratch[i].slot;
    std::sort(out, out + n_evict);
  }

  /// Slots whose position is a heavy-hitter candidate: n_sink <= position < recent_from.
  int64_t count_candidates(const int64_t* positions, int64_t S, int64_t recent_from) const {
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s) n += positions[s] >= options_.n_sink() && positions[s] < recent_from;
    return n;
  }

  void check_candidates(int64_t n_candidates, int64_t n_evict) const {
    KVEVICT_CHECK(n_candidates == n_evict + options_.budget(),
                  "evict_slots_row: positions must hold every sink (0..n_sink-1) and the whole recent window "
                  "(seen-n_recent..seen-1), leaving evicted + budget = ",
                  n_evict + options_.budget(), " heavy-hitter candidates, got ", n_candidates);
  }

  /// The slot of the candidate (n_sink <= position < recent_from) evicted first, by the order of
  /// detail::evicted_before: non-finite scores rank as -inf, equal ranks evict the older position.
  /// The O(capacity) part of a decode step, so it skips, 64 slots at a time, every block whose
  /// lowest key (detail::lowest_key, vectorised) is above the best candidate so far, and reads a
  /// slot's position only when its key could win. Blocks that hold the recent window (low
  /// scores) are still scanned one by one.
  int64_t lowest_candidate(const float* scores, const int64_t* positions, int64_t S, int64_t recent_from) const {
    constexpr int64_t kBlock = 64;
    const uint64_t first = static_cast<uint64_t>(options_.n_sink());
    const uint64_t width = static_cast<uint64_t>(recent_from) - first;  // candidate: position - first < width
    float best_key = std::numeric_limits<float>::infinity();
    int64_t best_position = std::numeric_limits<int64_t>::max(), best_slot = -1;
    for (int64_t block = 0; block < S; block += kBlock) {
      const int64_t end = std::min(S, block + kBlock);
      if (detail::lowest_key(scores + block, end - block) > best_key) continue;
      for (int64_t s = block; s < end; ++s) {
        const float key = detail::rank_key(scores[s]);
        if (key > best_key) continue;
        const int64_t p = positions[s];
        if (static_cast<uint64_t>(p) - first >= width) continue;  // a sink or in the recent window
        if (key < best_key || p < best_position) {
          best_key = key;
          best_position = p;
          best_slot = s;
        }
      }
    }
    TORCH_INTERNAL_ASSERT(best_slot >= 0, "kvevict: no eviction candidate among ", S, " slots");
    return best_slot;
  }

  EvictionOptions options_;
};

}  // namespace kvevict
