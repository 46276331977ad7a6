#pragma once
// EvictionPolicy: the pure selection of the contract (DESIGN.md), over plain tensors.

#include <kvevict/check.hpp>
#include <kvevict/options.hpp>
#include <kvevict/scorers.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

}  // namespace detail

/// Chooses which tokens an eviction pass removes: per batch row, keep every sink (the first
/// `n_sink` positions), every recent-window token (the `n_recent` largest positions), and the
/// `budget` other tokens with the highest score; evict the rest. Lower score is evicted first,
/// among equal scores the older position, and non-finite scores rank below all finite ones
/// (DESIGN.md, contract rules 2, 3, 9). Rows never share scores. Heavy hitters as in H2O
/// (Zhang et al. 2023, Sec. 3.2), but cross-head: all heads of a row keep the same tokens.
///
/// `Scorer` (CumulativeAttention, MeanObservedAttention or LatestAttention) says how the caches
/// turn observed attention into the scores ranked here.
///
/// \tparam Scorer a type from scorers.hpp.
template <class Scorer = CumulativeAttention>
class EvictionPolicy {
 public:
  using scorer_type = Scorer;

  /// \throws c10::ValueError if `options` are invalid (see EvictionOptions::validate).
  explicit EvictionPolicy(EvictionOptions options = EvictionOptions()) : options_(options) {
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
    detail::check_shape(scores, "scores", {-1, -1}, {"B", "S"}, "[B, S]");
    detail::check_floating(scores, "scores");
    const int64_t B = scores.size(0), S = scores.size(1);
    auto idx = at::arange(S, scores.options().dtype(at::kLong)).expand({B, S}).contiguous();
    if (S <= capacity()) return idx;
    idx.scatter_(1, evict_slots(scores.to(at::kFloat), idx), S);
    return std::get<0>(at::sort(idx, /*dim=*/1)).narrow(1, 0, capacity()).contiguous();
  }

  /// The selection of one eviction pass over one layer's live slots, with tensor ops (no
  /// host sync, static shapes: what the caches run on CUDA).
  ///
  /// \param scores     [B, S] fp32 ranking scores, slot order.
  /// \param positions  [B, S] int64 original positions, slot order, distinct per row; the
  ///                   n_sink smallest are the sinks, the n_recent largest the recent window.
  /// \return [B, S - capacity] int64 slots to evict, ascending per row ([B, 0] if S <= capacity).
  at::Tensor evict_slots(const at::Tensor& scores, const at::Tensor& positions) const {
    const int64_t B = scores.size(0), S = scores.size(1);
    const int64_t n_evict = std::max<int64_t>(S - capacity(), 0);
    if (n_evict == 0) return at::empty({B, 0}, positions.options());
    const auto by_position = std::get<1>(at::sort(positions, /*dim=*/1));      // slots, oldest first
    auto key = scores.gather(1, by_position);
    key = at::where(at::isfinite(key), key, at::full({}, -std::numeric_limits<float>::infinity(), key.options()));
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
  void evict_slots_row(const float* scores, const int64_t* positions, int64_t S, int64_t seen,
                       int64_t* out, std::vector<detail::Candidate>& scratch) const {
    const int64_t n_evict = S - capacity();
    if (n_evict <= 0) return;
    const int64_t recent_from = seen - options_.n_recent();
    scratch.clear();
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = positions[s];
      if (p >= options_.n_sink() && p < recent_from) scratch.push_back({scores[s], p, s});
    }
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(scratch.size()) == n_evict + options_.budget(),
                          "kvevict: candidates ", scratch.size(), " != evicted ", n_evict, " + budget ",
                          options_.budget());
    std::nth_element(scratch.begin(), scratch.begin() + n_evict, scratch.end(), detail::evicted_before);
    for (int64_t i = 0; i < n_evict; ++i) out[i] = scratch[i].slot;
    std::sort(out, out + n_evict);
  }

 private:
  EvictionOptions options_;
};

}  // namespace kvevict
