#pragma once
// EvictionPolicy: the eviction state of every layer and sequence (positions, lengths, scorer
// state), the slot mapping of each append, and each pass planned as slot moves that apply to any
// storage (slot_moves.hpp). MlaCache and MlaLatentCache own DeepSeek-V3-layout buffers over one.

#include <kvevict/check.hpp>
#include <kvevict/options.hpp>
#include <kvevict/scorers.hpp>
#include <kvevict/selection.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvevict {

/// Counters of one layer or, summed, of a whole cache.
struct CacheStats {
  /// Eviction passes that removed at least one token (one per pass and layer, whatever B).
  int64_t eviction_events = 0;
  /// Tokens evicted, summed over batch rows.
  int64_t tokens_evicted = 0;
  /// Bytes held by all buffers: K/V (or ckv/kpe) data plus the eviction state.
  int64_t bytes_allocated = 0;
};

namespace detail {

/// Test hook: while true, policies built afterwards use the tensor-op path on CPU too (the path
/// CUDA always takes), so one CPU machine can test both paths against the same oracle. Read once,
/// at construction.
inline bool& force_tensor_path() {
  static thread_local bool force = false;
  return force;
}

/// Whether Scorer declares `kRankIsState = true` (its rank is state[0]): the host pass then
/// ranks the state in place instead of copying ranks out.
template <class S, class = void>
struct RankIsState : std::false_type {};
template <class S>
struct RankIsState<S, std::void_t<decltype(S::kRankIsState)>> : std::bool_constant<S::kRankIsState> {};

/// Whether Scorer declares `kLinear = true` (scorers.hpp): EvictionPolicyOptions::lazy_reduction
/// may then apply many observations as one.
template <class S, class = void>
struct IsLinear : std::false_type {};
template <class S>
struct IsLinear<S, std::void_t<decltype(S::kLinear)>> : std::bool_constant<S::kLinear> {};

/// How many of the newest real query columns of an observation a scorer counts: all of them,
/// 1 for `kLastQueryOnly`, or `scorer.last_queries()` when the scorer has that member (an
/// observation window, e.g. SnapKV).
template <class S, class = void>
struct HasLastQueries : std::false_type {};
template <class S>
struct HasLastQueries<S, std::void_t<decltype(std::declval<const S&>().last_queries())>> : std::true_type {};
template <class S>
int64_t counted_queries(const S& scorer, int64_t Q) {
  if constexpr (S::kLastQueryOnly) {
    return std::min<int64_t>(Q, 1);
  } else if constexpr (HasLastQueries<S>::value) {
    return std::min<int64_t>(Q, scorer.last_queries());
  } else {
    return Q;
  }
}

/// A host vector mirrored on a device: uploaded only when its values change, so a steady-state
/// step (same values every time) makes no copy and keeps the same device tensor (CUDA graphs).
struct DeviceMirror {
  std::vector<int64_t> host;
  at::Tensor device;
  const at::Tensor& get(const std::vector<int64_t>& values, const at::Device& dev, at::IntArrayRef shape) {
    if (!device.defined() || values != host || device.sizes() != shape) {
      auto t = at::from_blob(const_cast<int64_t*>(values.data()), shape, at::TensorOptions().dtype(at::kLong))
                   .to(dev, /*non_blocking=*/false, /*copy=*/true);
      host = values;  // after the copy: a throw above leaves the mirror as it was
      device = std::move(t);
    }
    return device;
  }
};

/// The fixed-point unit of a probability in the reduction (scorers.hpp): 2^32.
constexpr double kFixedOne = 4294967296.0;

/// One probability as a fixed-point term, in double: round(clamp(p, 0, 1) * 2^32), or NaN if p
/// is not finite (p - p is 0 for a finite p, NaN otherwise). Rounding is half to even, by the
/// 1.5 * 2^52 trick (exact for |x| < 2^51), which matches at::round on the tensor path. A sum of
/// up to 2^21 such terms is an integer below 2^53: exact in double, whatever the order.
inline double fixed_term(float p) noexcept {
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  const float clamped = (p < 0.f ? 0.f : (p > 1.f ? 1.f : p)) + (p - p);
  return (static_cast<double>(clamped) * kFixedOne + kRound) - kRound;
}

/// fx[s] += fixed_term(row[s]) for s in [0, n); returns whether every row[s] was in [0, 1]. SSE2 (every x86-64) takes 4 probabilities per iteration, bit-identical to the scalar
/// form; elsewhere the scalar loop.
inline bool add_fixed_row(const float* row, double* fx, int64_t n) noexcept {
  int64_t s = 0;
  bool in_range = true;
#if defined(__SSE2__) || defined(_M_X64)
  const __m128 zero = _mm_setzero_ps(), one = _mm_set1_ps(1.f);
  const __m128d scale = _mm_set1_pd(kFixedOne), round = _mm_set1_pd(6755399441055744.0);
  int ok = 0xF;
  for (; s + 4 <= n; s += 4) {
    const __m128 raw = _mm_loadu_ps(row + s);
    ok &= _mm_movemask_ps(_mm_and_ps(_mm_cmpge_ps(raw, zero), _mm_cmple_ps(raw, one)));  // false for NaN
    const __m128 v = _mm_add_ps(_mm_min_ps(one, _mm_max_ps(zero, raw)), _mm_sub_ps(raw, raw));  // as fixed_term
    const __m128d lo = _mm_sub_pd(_mm_add_pd(_mm_mul_pd(_mm_cvtps_pd(v), scale), round), round);
    const __m128d hi = _mm_sub_pd(_mm_add_pd(_mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(v, v)), scale), round), round);
    _mm_storeu_pd(fx + s, _mm_add_pd(_mm_loadu_pd(fx + s), lo));
    _mm_storeu_pd(fx + s + 2, _mm_add_pd(_mm_loadu_pd(fx + s + 2), hi));
  }
  in_range = ok == 0xF;
#endif
  for (; s < n; ++s) {
    in_range = in_range && row[s] >= 0.f && row[s] <= 1.f;
    fx[s] += fixed_term(row[s]);
  }
  return in_range;
}

/// The contribution of a fixed-point sum over `heads` heads: float(sum) * 2^-32 / heads.
inline float from_fixed(double sum, float heads) noexcept {
  return static_cast<float>(sum) * static_cast<float>(1.0 / kFixedOne) / heads;
}

}  // namespace detail

/// The eviction state of a cache, for storage it does not own. Per layer and batch row (one
/// sequence per row), it keeps each live token's position, slot and scorer state, and each
/// row's length and seen tokens. It says where new tokens go (append() returns a slot mapping,
/// like vLLM's `slot_mapping`), feeds observations to `Scorer`, and plans each eviction pass as
/// SlotMoves that apply_moves() carries out on any buffer: [B, H, S, D], [B, S, H, D], latent
/// [B, S, W], a fused latent row [B, S, 576].
///
/// The contract (docs/DESIGN.md): a pass keeps, per row, the sinks (positions < n_sink), the
/// recent window (positions >= seen - n_recent) and the `budget` other tokens of highest rank
/// (H2O, Zhang et al. 2023, Sec. 3.2, cross-head: every head keeps the same tokens); lower
/// rank goes first, equal ranks evict the older position, non-finite ranks lowest. Live tokens
/// of a row fill slots [0, length): a pass moves at most one tail row into each freed slot.
///
/// Sequences: every row starts active (a fixed batch needs nothing more). For continuous
/// batching, finish(row) frees a row, add_sequence() takes the lowest free one, reset(row)
/// empties one, truncate(row, k) rolls back its k newest tokens (speculative decoding).
///
/// Paths: on CPU the state lives in host loops (no allocation in the steady state); elsewhere
/// (CUDA) every step is tensor ops with static shapes in the steady state and no host sync
/// unless observations are checked. Both paths keep the same tokens, bit for bit.
///
/// Not thread-safe.
///
/// \tparam Scorer CumulativeAttention (default), MeanObservedAttention, LatestAttention,
///         DecayedAttention or your own (interface in scorers.hpp).
template <class Scorer = CumulativeAttention>
class EvictionPolicy {
 public:
  using scorer_type = Scorer;
  static constexpr int64_t W = Scorer::kStateWidth;
  static_assert(Scorer::kStateWidth >= 1, "Scorer::kStateWidth must be >= 1");

  /// Builds empty state for every layer and row, with capacity + evict_every slots per row.
  /// \throws c10::ValueError if `options` or `eviction` are invalid, naming the value;
  ///         c10::Error naming the sizes if the state cannot be allocated or `device` is unusable.
  explicit EvictionPolicy(const EvictionPolicyOptions& options, const EvictionOptions& eviction = EvictionOptions(),
                          Scorer scorer = Scorer())
      : options_((options.validate(), eviction.validate(), options)),
        eviction_(eviction),
        scorer_(std::move(scorer)),
        device_(resolved(options.device())),
        host_(device_.is_cpu() && !detail::force_tensor_path()),
        check_(options.checks_observations(device_)) {
    check_layer_budgets(options_, eviction_);
    KVEVICT_CHECK_VALUE(!options_.lazy_reduction() || detail::IsLinear<Scorer>::value,
                        "EvictionPolicyOptions: lazy_reduction needs a linear scorer (Scorer::kLinear: one observation "
                        "of summed contributions equals the observations one by one), got ", Scorer::kName,
                        "; use lazy_reduction(false)");
    const int64_t B = options_.batch_size();
    detail::allocating([&] {
      layer_eviction_ = per_layer(options_, eviction_);
      selections_ = make_selections(layer_eviction_);
      active_.assign(static_cast<size_t>(B), 1);
      layers_.resize(static_cast<size_t>(options_.num_layers()));
      for (size_t l = 0; l < layers_.size(); ++l) {
        auto& L = layers_[l];
        L.len.assign(B, 0);
        L.appends.assign(B, 0);
        L.seen.assign(B, 0);
        L.last_new.assign(B, 0);
        allocate(L, base_slots(static_cast<int64_t>(l)));
      }
    }, [&](const std::string& why) { fail_allocation(why); });
  }

  EvictionPolicy(const EvictionPolicy&) = delete;
  EvictionPolicy& operator=(const EvictionPolicy&) = delete;
  EvictionPolicy(EvictionPolicy&&) noexcept = default;
  EvictionPolicy& operator=(EvictionPolicy&&) noexcept = default;

  // -------------------------------------------------------------------------------------------
  // Configuration

  const EvictionPolicyOptions& options() const noexcept { return options_; }
  const EvictionOptions& eviction() const noexcept { return eviction_; }
  const Scorer& scorer() const noexcept { return scorer_; }
  /// n_sink + budget + n_recent of the EvictionOptions: tokens a row holds after a pass, in
  /// every layer unless layer_budgets are set (then see capacity(layer)).
  int64_t capacity() const noexcept { return eviction_.capacity(); }
  /// Tokens a row of `layer` holds after a pass. \throws c10::IndexError for a bad layer.
  int64_t capacity(int64_t layer) const { return eviction(layer).capacity(); }
  /// The eviction options of `layer` (its budget from layer_budgets, if set).
  const EvictionOptions& eviction(int64_t layer) const {
    at(layer);
    return layer_eviction_[layer];
  }
  int64_t num_layers() const noexcept { return static_cast<int64_t>(layers_.size()); }
  int64_t batch_size() const noexcept { return options_.batch_size(); }
  int64_t num_heads() const noexcept { return options_.num_heads(); }
  /// The device of the state, resolved ("cuda" becomes "cuda:N", "cpu:0" becomes "cpu").
  at::Device device() const noexcept { return device_; }
  /// True when the state lives in host loops (CPU); false for the tensor-op path (CUDA).
  bool host_path() const noexcept { return host_; }
  /// Whether observe() checks its input (EvictionPolicyOptions::check_observations, resolved).
  bool checks_observations() const noexcept { return check_; }

  // -------------------------------------------------------------------------------------------
  // Sequences

  /// True while `row` holds a sequence (every row, until finish()). \throws c10::IndexError.
  bool active(int64_t row) const { return active_[check_row(row)] != 0; }

  /// Starts a new, empty sequence in the lowest free row and returns that row.
  /// \throws c10::Error if every row is active (finish one first); nothing changes.
  int64_t add_sequence() {
    for (int64_t b = 0; b < batch_size(); ++b) {
      if (!active_[b]) {
        active_[b] = 1;
        return b;
      }
    }
    KVEVICT_CHECK(false, "add_sequence: all ", batch_size(), " rows hold a sequence; finish(row) one first");
    return -1;
  }

  /// Ends the sequence in `row` and frees the row: its tokens leave every layer; the other rows
  /// go on. \throws c10::IndexError for a bad row; c10::Error if the row is already free.
  void finish(int64_t row) {
    KVEVICT_CHECK(active(row), "finish: row ", row, " holds no sequence");
    clear_row(row);
    active_[row] = 0;
  }

  /// Empties `row` for a new sequence (positions restart at 0); the row stays active.
  /// \throws c10::IndexError for a bad row; c10::Error if the row is free.
  void reset(int64_t row) {
    KVEVICT_CHECK(active(row), "reset: row ", row, " holds no sequence (add_sequence() starts one)");
    clear_row(row);
  }

  /// Empties every row of every layer, makes every row active, and gives back the slots grown
  /// by long appends (slots return to max(capacity + evict_every, reserved)).
  /// \throws c10::Error only if the smaller state cannot be allocated; nothing changes then.
  void reset() {
    std::vector<Layer> fresh(layers_.size());
    for (size_t l = 0; l < fresh.size(); ++l) {
      auto& L = fresh[l];
      L.len.assign(batch_size(), 0);
      L.appends.assign(batch_size(), 0);
      L.seen.assign(batch_size(), 0);
      L.last_new.assign(batch_size(), 0);
      allocate(L, base_slots(static_cast<int64_t>(l)));
    }
    layers_ = std::move(fresh);
    std::fill(active_.begin(), active_.end(), 1);
  }

  /// Rolls back the `k` newest tokens of `row` in every layer (rejected speculative-decoding
  /// drafts): they leave the cache, seen tokens go back by k, the next append takes their
  /// positions. Scores that the dropped tokens' queries added to older tokens stay: undoing
  /// them would mean keeping every query's contribution, a cost on every step. Call observe()
  /// only for accepted tokens (attend(..., observe = false), then observe) to avoid them.
  ///
  /// \return one SlotMoves per layer, to apply to that layer's buffers (apply_moves).
  /// \throws c10::Error if k < 0, k exceeds a layer's seen tokens, the row is free, or one of
  ///         the k tokens was already evicted in some layer; nothing changes then.
  /// \note Syncs with the host on the tensor path (it reads positions back).
  std::vector<SlotMoves> truncate(int64_t row, int64_t k) {
    KVEVICT_CHECK(active(row), "truncate: row ", row, " holds no sequence");
    KVEVICT_CHECK_VALUE(k >= 0, "truncate: k must be >= 0, got ", k);
    std::vector<std::vector<int64_t>> slots_of(layers_.size());  // per layer: slots of the k tokens
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      KVEVICT_CHECK_VALUE(k <= L.seen[row], "truncate: k must be <= seen tokens of row ", row, " in layer ", l,
                          " (", L.seen[row], "), got ", k);
      const auto pos = L.position.select(0, row).narrow(0, 0, L.len[row]).to(at::kCPU).contiguous();
      const int64_t* p = pos.template data_ptr<int64_t>();
      for (int64_t s = 0; s < L.len[row]; ++s) {
        if (p[s] >= L.seen[row] - k) slots_of[l].push_back(s);
      }
      KVEVICT_CHECK(static_cast<int64_t>(slots_of[l].size()) == k, "truncate: ", k - static_cast<int64_t>(slots_of[l].size()),
                    " of the ", k, " newest tokens of row ", row, " were already evicted in layer ", l,
                    "; only tokens still cached can be rolled back");
    }
    std::vector<SlotMoves> out;
    for (size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      Pass pass = empty_pass(L);
      pass.n[row] = k;
      pass.new_len[row] = L.len[row] - k;
      std::vector<uint8_t> tail_flags;
      fill_moves_host(pass, row, slots_of[l].data(), k, tail_flags);
      pad_moves(pass);
      out.push_back(to_moves(pass));
      commit_state(L, pass);
      L.seen[row] -= k;
      if (!host_) L.seen_device.select(0, row).sub_(k);
    }
    return out;
  }

  // -------------------------------------------------------------------------------------------
  // Per-layer state

  /// The longest row of `layer`: the width S of the views and probabilities. \throws IndexError.
  int64_t size(int64_t layer) const { return max_of(at(layer).len); }
  /// Live tokens of `row` in `layer`. \throws c10::IndexError.
  int64_t size(int64_t layer, int64_t row) const { return at(layer).len[check_row(row)]; }
  /// The most tokens ever appended to a row of `layer` (equal rows: their seen tokens).
  int64_t seen_tokens(int64_t layer) const { return max_of(at(layer).seen); }
  /// Tokens ever appended to `row` of `layer`: the position of its next token.
  int64_t seen_tokens(int64_t layer, int64_t row) const { return at(layer).seen[check_row(row)]; }
  /// Tokens `row` appended to `layer` in its latest append (0 for a pad or idle row).
  int64_t appended(int64_t layer, int64_t row) const { return at(layer).last_new[check_row(row)]; }
  /// Slots per row that buffers of `layer` must hold.
  int64_t slots(int64_t layer) const { return at(layer).slots; }

  /// [B, size(layer)] int64 original position of each slot (slot order, not sorted), -1 past a
  /// row's length. A copy, on the policy's device.
  at::Tensor positions(int64_t layer) const {
    const auto& L = at(layer);
    return L.position.narrow(1, 0, max_of(L.len)).clone();
  }

  /// [B, size(layer)] fp32 rank of each slot (Scorer::rank of its state), 0 past a row's length.
  /// A copy, on the policy's device. \throws c10::Error while lazy_reduction observations are
  /// pending on `layer` (flush() first).
  at::Tensor scores(int64_t layer) const {
    const auto& L = at(layer);
    KVEVICT_CHECK(L.pending_terms == 0, "scores: layer ", layer,
                  " holds observations not yet applied (lazy_reduction); call flush(", layer,
                  ") first (a collective under tensor parallelism)");
    const int64_t S = max_of(L.len);
    const auto rank = scorer_.rank(L.state.narrow(1, 0, S));
    return at::where(L.position.narrow(1, 0, S).ge(0), rank, at::zeros({}, rank.options()));
  }

  /// [B, Q] int64 positions of Q query columns, right-aligned on the newest append (column q of
  /// row b is position seen - Q + q), -1 where the column is a pad: before a row's own tokens
  /// when it appended fewer than the chunk's T (left padding), at a position < 0, or in a free
  /// row. On the policy's device. \throws c10::Error unless 1 <= Q.
  at::Tensor query_positions(int64_t layer, int64_t Q) const {
    const auto& L = at(layer);
    KVEVICT_CHECK_VALUE(Q >= 1, "query_positions: Q must be >= 1, got ", Q);
    std::vector<int64_t> qp(static_cast<size_t>(batch_size() * Q));
    for (int64_t b = 0; b < batch_size(); ++b) {
      const int64_t first = first_real(L, b, Q);
      for (int64_t q = 0; q < Q; ++q) qp[b * Q + q] = q >= first ? L.seen[b] - Q + q : -1;
    }
    auto t = at::tensor(qp, at::TensorOptions().dtype(at::kLong)).view({batch_size(), Q});
    return host_ ? t : t.to(device_);
  }

  /// True when Q query columns of `layer` have no pad and every row is active and as long as
  /// the longest: attention then needs no per-sequence mask beyond causality.
  bool dense(int64_t layer, int64_t Q) const {
    const auto& L = at(layer);
    const int64_t S = max_of(L.len);
    for (int64_t b = 0; b < batch_size(); ++b) {
      if (L.len[b] != S || first_real(L, b, Q) != 0) return false;
    }
    return true;
  }

  /// Counters of one layer (bytes: the state only; caches add their buffers).
  CacheStats stats(int64_t layer) const {
    const auto& L = at(layer);
    return {L.events, L.evicted, state_bytes(L)};
  }

  // -------------------------------------------------------------------------------------------
  // Steps

  /// Appends `counts[b]` tokens to row b of `layer` (ragged: 0 included), at positions
  /// seen .. seen + counts[b] - 1, rank state 0. In a chunk of T columns, row b's tokens are
  /// its last counts[b] columns (left padding); the other columns are pads and are not stored.
  ///
  /// \param counts  [B] host counts, each in [0, T]; a free row must append 0.
  /// \param T       columns of the chunk (the new rows' token dim), >= 1.
  /// \return [B, T] int64 slot mapping on CPU: the slot of each new token, -1 for a pad. Write
  ///         the rows with write_rows(); slots are < slots(layer).
  /// \throws c10::Error on a bad layer, count or T, or if a row would exceed slots(layer)
  ///         (reserve() first); nothing changes then.
  at::Tensor append(int64_t layer, at::IntArrayRef counts, int64_t T) {
    check_append(layer, counts, T);
    auto& L = at(layer);
    auto map = at::full({batch_size(), T}, -1, at::TensorOptions().dtype(at::kLong));
    auto* m = map.template data_ptr<int64_t>();
    for (int64_t b = 0; b < batch_size(); ++b) {
      for (int64_t j = 0; j < counts[b]; ++j) m[b * T + T - counts[b] + j] = L.len[b] + j;
    }
    append_unchecked(L, counts.data(), T);
    return map;
  }

  /// Checks an append (see append()) without changing anything; `check_room` false leaves out
  /// the room check (a cache grows its buffers first). \throws c10::Error as append().
  void check_append(int64_t layer, at::IntArrayRef counts, int64_t T, bool check_room = true) const {
    const auto& L = at(layer);
    KVEVICT_CHECK_VALUE(T >= 1 && T <= EvictionOptions::kMaxTokens, "append: T must be in [1, 2^40], got ", T);
    KVEVICT_CHECK_VALUE(static_cast<int64_t>(counts.size()) == batch_size(), "append: counts must have B = ",
                        batch_size(), " entries, got ", counts.size());
    for (int64_t b = 0; b < batch_size(); ++b) {
      KVEVICT_CHECK_VALUE(counts[b] >= 0 && counts[b] <= T, "append: counts[", b, "] must be in [0, T = ", T,
                          "], got ", counts[b]);
      KVEVICT_CHECK_VALUE(active_[b] || counts[b] == 0, "append: row ", b,
                          " holds no sequence (finished or never added), so counts[", b, "] must be 0, got ",
                          counts[b]);
      KVEVICT_CHECK_VALUE(L.seen[b] + counts[b] <= EvictionOptions::kMaxTokens, "append: row ", b,
                          " would pass 2^40 seen tokens");
      KVEVICT_CHECK(!check_room || L.len[b] + counts[b] <= L.slots, "append: row ", b, " of layer ", layer, " would hold ",
                    L.len[b] + counts[b], " tokens but the layer has ", L.slots,
                    " slots per row; reserve() more slots first");
    }
  }

  /// Feeds attention probabilities to the scorer (scorers.hpp: the exact reduction).
  ///
  /// \param probs  [B, H, Q, S] probabilities, any floating dtype, the policy's device, strided;
  ///               S = size(layer) in slot order; the Q query columns are right-aligned on the
  ///               newest append (column q of row b is position seen - Q + q; pads as in
  ///               query_positions()); 1 <= Q. Pads and slots past a row's length are ignored,
  ///               so they may hold anything. 1 <= Q <= seen_tokens(layer).
  /// \throws c10::Error on a bad layer, shape, dtype or device; with checks on, on a
  ///         probability outside [0, 1] or non-finite, one above 0 for a key newer than its
  ///         query, or a non-finite resulting rank. Nothing changes then.
  /// \note With checks on, the tensor path syncs with the host once.
  void observe(int64_t layer, const at::Tensor& probs) {
    auto& L = at(layer);
    const int64_t S = max_of(L.len);
    if (!detail::has_shape(probs, {batch_size(), num_heads(), -1, S}) || probs.layout() != at::kStrided) {
      detail::check_tensor(probs, "attention probs", device_);
      detail::check_shape(probs, "attention probs", {batch_size(), num_heads(), -1, S}, {"B", "H", "Q", "S"},
                          "[B, H, Q, S] with S = size(layer), the longest row");
    }
    detail::check_floating(probs, "attention probs");
    detail::check_device(probs, "attention probs", device_);
    KVEVICT_CHECK(S >= 1, "attention probs: the layer holds no token (append first)");
    KVEVICT_CHECK(probs.size(2) >= 1 && probs.size(2) <= max_of(L.seen), "attention probs: Q must be in [1, ",
                  max_of(L.seen), "], got ", probs.size(2), " (at most the seen tokens)");
    at::NoGradGuard no_grad;
    const int64_t Q = probs.size(2);
    begin_observation(L, Q);
    try {
      add_observation(L, probs, 0, 0);
      end_observation(L, layer);
    } catch (...) {
      L.open_q = 0;
      throw;
    }
  }

  /// Starts an observation of Q query columns that arrives in pieces: observe_add() each
  /// [query chunk x head chunk] of the probabilities, then observe_end(). The scorer then gets
  /// exactly what observe(probs [B, H, Q, S]) would give it, bit for bit (the fixed-point sums
  /// of scorers.hpp are exact in any order), without the whole tensor ever existing, e.g.
  /// probabilities recomputed from a fused kernel's LSE (lse_scores.hpp). Discards an
  /// observation still open on `layer`. An append, pass, reset or resize of the layer before
  /// observe_end() also discards it.
  ///
  /// \param Q  query columns of the whole observation, right-aligned on the newest append as
  ///           in observe(); 1 <= Q <= seen_tokens(layer).
  /// \throws c10::Error on a bad layer or Q, or if the layer holds no token.
  /// \note Host path: no allocation. Tensor path: one [B, S] fp64 buffer until observe_end().
  void observe_begin(int64_t layer, int64_t Q) {
    auto& L = at(layer);
    L.open_q = 0;
    KVEVICT_CHECK(max_of(L.len) >= 1, "observe_begin: the layer holds no token (append first)");
    KVEVICT_CHECK_VALUE(Q >= 1 && Q <= max_of(L.seen), "observe_begin: Q must be in [1, ", max_of(L.seen), "], got ",
                        Q, " (at most the seen tokens)");
    at::NoGradGuard no_grad;
    begin_observation(L, Q);
  }

  /// Adds one piece of the observation opened by observe_begin(): the probabilities of query
  /// columns [q_begin, q_begin + Qc) and heads [h_begin, h_begin + Hc). Pieces may come in any
  /// order; each (head, query column) must come exactly once. Columns a scorer does not count
  /// (LatestAttention counts only column Q - 1) may be left out.
  ///
  /// \param probs  [B, Hc, Qc, S] probabilities, any floating dtype, the policy's device,
  ///               S = size(layer), slot order; pads and dead slots may hold anything.
  /// \throws c10::Error if no observation is open, on a bad shape, range, dtype or device, or
  ///         (checks on) as observe(); the open observation is discarded then and the state is
  ///         unchanged.
  void observe_add(int64_t layer, const at::Tensor& probs, int64_t q_begin, int64_t h_begin) {
    auto& L = at(layer);
    KVEVICT_CHECK(L.open_q > 0, "observe_add: no observation is open on layer ", layer,
                  " (observe_begin() first; an append, pass or reset in between discards it)");
    try {
      const int64_t S = max_of(L.len), Q = L.open_q;
      detail::check_tensor(probs, "attention probs", device_);
      detail::check_shape(probs, "attention probs", {batch_size(), -1, -1, S}, {"B", "Hc", "Qc", "S"},
                          "[B, Hc, Qc, S] with S = size(layer)");
      detail::check_floating(probs, "attention probs");
      detail::check_device(probs, "attention probs", device_);
      const int64_t Hc = probs.size(1), Qc = probs.size(2);
      KVEVICT_CHECK_VALUE(h_begin >= 0 && Hc >= 1 && h_begin + Hc <= num_heads(), "observe_add: heads [", h_begin,
                          ", ", h_begin + Hc, ") must lie in [0, H = ", num_heads(), ")");
      KVEVICT_CHECK_VALUE(q_begin >= 0 && Qc >= 1 && q_begin + Qc <= Q, "observe_add: query columns [", q_begin, ", ",
                          q_begin + Qc, ") must lie in [0, Q = ", Q, ")");
      at::NoGradGuard no_grad;
      add_observation(L, probs, q_begin, h_begin);
    } catch (...) {
      L.open_q = 0;
      throw;
    }
  }

  /// Applies the observation opened by observe_begin() to the scorer, as observe() does.
  /// \throws c10::Error if no observation is open, if the pieces did not cover every counted
  ///         (head, query column) exactly as often as H x counted columns, or (checks on) on a
  ///         non-finite resulting rank; the observation is closed and the state unchanged then.
  void observe_end(int64_t layer) {
    auto& L = at(layer);
    KVEVICT_CHECK(L.open_q > 0, "observe_end: no observation is open on layer ", layer,
                  " (observe_begin() first; an append, pass or reset in between discards it)");
    try {
      const int64_t expected = num_heads() * detail::counted_queries(scorer_, L.open_q);
      KVEVICT_CHECK(L.open_cells == expected, "observe_end: the pieces covered ", L.open_cells,
                    " (head, counted query column) cells, expected H x counted columns = ", expected,
                    "; the state is unchanged");
      at::NoGradGuard no_grad;
      end_observation(L, layer);
    } catch (...) {
      L.open_q = 0;
      throw;
    }
  }

  /// True while an observation opened by observe_begin() on `layer` waits for observe_end().
  bool observing(int64_t layer) const { return at(layer).open_q > 0; }

  /// Adds caller-computed per-token scores, as one observation with contribution `scores` and
  /// one observer (CumulativeAttention adds them, LatestAttention replaces, ...). Every live
  /// token of every active row is observed.
  ///
  /// \param scores  [B, S] any floating dtype, the policy's device, S = size(layer), slot order.
  /// \throws c10::Error on a bad layer, shape, dtype or device, or (checks on) a non-finite
  ///         resulting rank; nothing changes then.
  void add_scores(int64_t layer, const at::Tensor& scores) {
    auto& L = at(layer);
    const int64_t S = max_of(L.len);
    if (!detail::has_shape(scores, {batch_size(), S}) || scores.layout() != at::kStrided) {
      detail::check_tensor(scores, "scores", device_);
      detail::check_shape(scores, "scores", {batch_size(), S}, {"B", "S"}, "[B, S] with S = size(layer)");
    }
    detail::check_floating(scores, "scores");
    detail::check_device(scores, "scores", device_);
    at::NoGradGuard no_grad;
    if (host_) {
      add_scores_host(L, scores);
    } else {
      observe_tensor(L, layer, scores, /*direct=*/true);
    }
  }

  /// lazy_reduction: reduces the observations of `layer` not yet applied (reduce_contributions,
  /// once, on the summed fixed-point sums) and applies them as one observation. A no-op without
  /// lazy_reduction or when nothing is pending; plan() and evict() call it. With a reducer across
  /// processes it is a collective: every process calls it for the same layers in the same order
  /// (plan() and evict() do, as every process sees the same due()).
  /// \throws c10::IndexError for a bad layer; what the reducer throws; with checks on,
  ///         c10::Error on a non-finite resulting rank. The state and the pending sums are then
  ///         unchanged.
  void flush(int64_t layer) { flush_layer(at(layer), layer); }

  /// lazy_reduction: true while `layer` holds observations that flush() has yet to apply.
  bool pending(int64_t layer) const { return at(layer).pending_terms > 0; }

  /// Whether a pass on `layer` would run now: some row holds more than capacity(layer) tokens
  /// and appended tokens in at least evict_every appends since its last pass (or since it
  /// started). Per row, so a sequence evicts when it would alone, whatever the other rows do.
  bool due(int64_t layer) const {
    const auto& L = at(layer);
    for (int64_t b = 0; b < batch_size(); ++b) {
      if (row_due(L, b, capacity(layer))) return true;
    }
    return false;
  }

  /// Runs a pass on `layer` if due(): each row over capacity drops its lowest-ranked heavy-hitter
  /// candidates back to capacity() tokens, and its kept tail rows move into the freed slots.
  ///
  /// \return the moves to apply to every buffer of the layer (empty if no pass ran).
  /// \throws c10::IndexError for a bad layer.
  /// \note Host path: no allocation but the returned tensors. Tensor path: static shapes in the
  ///       steady state, no host sync.
  SlotMoves evict(int64_t layer) {
    if (!due(layer)) return {};
    Pass pass = plan(layer);
    commit(layer, pass);
    return to_moves(pass);
  }

  /// Gives `layer` `slots` slots per row (growing or shrinking), keeping its tokens; buffers of
  /// the layer must then hold that many. Caches call it as their buffers change.
  /// \throws c10::Error if slots < size(layer) or the state cannot be allocated; nothing
  ///         changes then.
  void resize_slots(int64_t layer, int64_t slots) {
    auto& L = at(layer);
    Layer N = resized(L, slots);
    swap_in(L, N);
  }

  /// The slots per row `layer` returns to after a pass or reset(): max(capacity(layer) +
  /// evict_every, what reserve() asked for). \throws c10::IndexError for a bad layer.
  int64_t base_slots(int64_t layer) const {
    return std::max(capacity(layer) + eviction_.evict_every(), reserved_);
  }

  /// Raises base_slots() to `slots` (never lowers it); layers with fewer slots are resized.
  /// \throws c10::Error if slots is out of range or the state cannot be allocated.
  void reserve(int64_t slots) {
    KVEVICT_CHECK_VALUE(slots >= 1 && slots <= EvictionOptions::kMaxTokens, "reserve: slots must be in [1, 2^40], got ",
                        slots);
    std::vector<Layer> grown(layers_.size());  // every allocation first: all layers or none
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (layers_[l].slots < slots) grown[l] = resized(layers_[l], slots);
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (layers_[l].slots < slots) swap_in(layers_[l], grown[l]);
    }
    reserved_ = std::max(reserved_, slots);
  }

  // -------------------------------------------------------------------------------------------
  // Building blocks for caches that own buffers (exception safety: plan, move the buffers,
  // commit). Users of caller-owned storage call evict() instead.

  /// A planned pass: the moves and each row's evicted count and new length.
  struct Pass {
    std::vector<int64_t> n;        // [B] tokens evicted per row
    std::vector<int64_t> new_len;  // [B]
    std::vector<int64_t> moves;    // [B] real moves per row (host-built passes)
    int64_t columns = 0;           // move columns per row
    int64_t slot_bound = 0;        // every move's slots are below this (the longest row before)
    std::vector<int64_t> src, dst; // host path: [B, columns]
    at::Tensor src_t, dst_t;       // tensor path: [B, columns] on the device
  };

  /// Plans a pass on `layer` (the caller checked due()); changes nothing but, with
  /// lazy_reduction, first applies the pending observations (flush(): may throw as it does).
  Pass plan(int64_t layer) {
    Pass pass;
    plan(layer, pass);
    return pass;
  }

  /// plan() into `pass`, reusing its vectors' room (no allocation once it has seen a pass of
  /// this size: the caches keep one Pass for their whole life).
  void plan(int64_t layer, Pass& pass) {
    auto& L = at(layer);
    flush_layer(L, layer);
    reset_pass(L, pass);
    for (int64_t b = 0; b < batch_size(); ++b) {
      pass.n[b] = row_due(L, b, capacity(layer)) ? L.len[b] - capacity(layer) : 0;
      pass.new_len[b] = L.len[b] - pass.n[b];
    }
    if (host_) {
      plan_host(L, pass, layer);
    } else {
      plan_tensor(L, pass, layer);
    }
  }

  /// Applies a planned pass to the state of `layer`. \throws only on an allocation failure of
  /// the tensor path, before anything changed.
  void commit(int64_t layer, Pass& pass) {
    auto& L = at(layer);
    commit_state(L, pass);
    int64_t evicted = 0;
    for (int64_t b = 0; b < batch_size(); ++b) {
      evicted += pass.n[b];
      if (pass.n[b] > 0) L.appends[b] = 0;
    }
    if (evicted > 0) L.events += 1;
    L.evicted += evicted;
  }

  /// The moves of a planned pass as tensors on the policy's device.
  SlotMoves to_moves(Pass& pass) const {
    if (pass.columns == 0) return {};
    SlotMoves m;
    m.slot_bound = pass.slot_bound;
    if (!host_) {
      device_moves(pass);
      m.src = pass.src_t;
      m.dst = pass.dst_t;
      return m;
    }
    const auto opts = at::TensorOptions().dtype(at::kLong);
    m.src = at::tensor(pass.src, opts).view({batch_size(), pass.columns});
    m.dst = at::tensor(pass.dst, opts).view({batch_size(), pass.columns});
    return m;
  }

  /// Tensor path: the device tensors of a pass built on the host (truncate()).
  void device_moves(Pass& pass) const {
    if (pass.src_t.defined() || pass.columns == 0) return;
    const auto opts = at::TensorOptions().dtype(at::kLong);
    pass.src_t = at::tensor(pass.src, opts).view({batch_size(), pass.columns}).to(device_);
    pass.dst_t = at::tensor(pass.dst, opts).view({batch_size(), pass.columns}).to(device_);
  }

  /// Host path only: the moves of a planned pass as [B, columns] host arrays.
  const int64_t* host_src(const Pass& p) const noexcept { return p.src.data(); }
  const int64_t* host_dst(const Pass& p) const noexcept { return p.dst.data(); }

  /// Appends without checks (the caller ran check_append()); used by the caches, which write
  /// their rows from the lengths before the append.
  void append_unchecked(int64_t layer, const int64_t* counts, int64_t T) { append_unchecked(at(layer), counts, T); }

  /// Device index tensors of the latest append's tokens (tensor path): {rows, columns, slots},
  /// each [M] int64, M = the tokens appended; uploaded only when they change.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> append_index(int64_t layer, const int64_t* counts, int64_t T) {
    auto& L = at(layer);
    std::vector<int64_t> idx;
    int64_t M = 0;
    for (int64_t b = 0; b < batch_size(); ++b) M += counts[b];
    idx.resize(static_cast<size_t>(3 * M));
    int64_t i = 0;
    for (int64_t b = 0; b < batch_size(); ++b) {
      for (int64_t j = 0; j < counts[b]; ++j, ++i) {
        idx[i] = b;
        idx[M + i] = T - counts[b] + j;
        idx[2 * M + i] = L.len[b] + j;
      }
    }
    const auto& t = L.append_mirror.get(idx, device_, {3, M});
    return {t.select(0, 0), t.select(0, 1), t.select(0, 2)};
  }

  /// Bytes of the state of `layer` on the device (positions, scorer state, seen counters).
  int64_t state_bytes(int64_t layer) const { return state_bytes(at(layer)); }

 private:
  struct HostScratch {
    std::vector<double> fixed;            // [B, slots] fixed-point sums
    std::vector<double> reduced;          // [B, slots] lazy_reduction: pending sums being reduced
    std::vector<float> observers;         // [slots]
    std::vector<float> rank;              // [slots]
    std::vector<detail::Candidate> candidates;
    std::vector<int64_t> evicted;         // [slots]
    std::vector<uint8_t> tail_flags;      // [slots]
    std::vector<float> next;              // [slots * W] checked next state
  };

  struct Layer {
    int64_t slots = 0;
    at::Tensor position;     // [B, slots] int64 original positions, -1 in dead slots
    at::Tensor state;        // [B, slots, W] fp32 scorer state
    at::Tensor seen_device;  // [B] int64 seen tokens (tensor path: positions come from it)
    std::vector<int64_t> len, seen, last_new;  // [B] host
    std::vector<int64_t> appends;  // [B] appends with tokens since the row's last pass
    int64_t last_T = 0, events = 0, evicted = 0;
    int64_t open_q = 0, open_cells = 0;  // an observation in pieces: its Q (0: none), cells added
    at::Tensor open_sum, open_bad;       // tensor path: [B, S] fp64 sums, [] bool "a check failed"
    // lazy_reduction: [B, slots, 2] fp64 this process's fixed-point sums and observer counts
    // not yet reduced and applied (0 in dead slots), and the fixed-point terms per slot they add
    // up since the last flush (kept <= 2^21, so the sums stay exact integers).
    at::Tensor pending;
    int64_t pending_terms = 0;
    HostScratch host;
    // Device copies of host facts, one per use so that each stays unchanged in the steady state.
    detail::DeviceMirror append_mirror, index_mirror, qmask_mirror, rows_mirror, pass_mirror, counts_mirror;
  };

  /// A copy of L's tensors with `slots` slots per row, its tokens kept (allocates; changes
  /// nothing). \throws c10::Error if slots < the longest row or on an allocation failure.
  Layer resized(const Layer& L, int64_t slots) const {
    KVEVICT_CHECK_VALUE(slots >= max_of(L.len) && slots >= 1 && slots <= EvictionOptions::kMaxTokens,
                        "resize_slots: slots must be in [max(1, size(layer) = ", max_of(L.len), "), 2^40], got ",
                        slots);
    Layer N;
    allocate(N, slots);
    const int64_t S = max_of(L.len);
    if (S > 0) {
      N.position.narrow(1, 0, S).copy_(L.position.narrow(1, 0, S));
      N.state.narrow(1, 0, S).copy_(L.state.narrow(1, 0, S));
      if (L.pending.defined()) N.pending.narrow(1, 0, S).copy_(L.pending.narrow(1, 0, S));
    }
    return N;
  }

  /// Swaps the tensors of `N` (from resized()) into `L`. Does not throw.
  static void swap_in(Layer& L, Layer& N) noexcept {
    L.slots = N.slots;
    L.position = std::move(N.position);
    L.state = std::move(N.state);
    L.pending = std::move(N.pending);
    std::swap(L.host, N.host);
    L.open_q = 0;
  }

  /// Checks layer_budgets without allocating. \throws c10::ValueError naming a layer whose
  /// budget is out of range or gives a capacity < 1, or a layer_budgets of the wrong length.
  static void check_layer_budgets(const EvictionPolicyOptions& o, const EvictionOptions& e) {
    const auto& budgets = o.layer_budgets();
    if (budgets.empty()) return;
    KVEVICT_CHECK_VALUE(static_cast<int64_t>(budgets.size()) == o.num_layers(),
                        "layer_budgets must have one entry per layer (num_layers = ", o.num_layers(), "), got ",
                        budgets.size());
    for (size_t l = 0; l < budgets.size(); ++l) {
      KVEVICT_CHECK_VALUE(budgets[l] >= 0 && budgets[l] <= EvictionOptions::kMaxTokens, "layer_budgets[", l,
                          "] must be in [0, 2^40], got ", budgets[l]);
      KVEVICT_CHECK_VALUE(e.n_sink() + budgets[l] + e.n_recent() >= 1, "layer ", l,
                          ": capacity = n_sink + budget + n_recent must be >= 1, got n_sink=", e.n_sink(),
                          ", layer_budgets[", l, "]=", budgets[l], ", n_recent=", e.n_recent());
    }
  }

  /// The eviction options of every layer (checked by check_layer_budgets()).
  static std::vector<EvictionOptions> per_layer(const EvictionPolicyOptions& o, const EvictionOptions& e) {
    const auto& budgets = o.layer_budgets();
    if (budgets.empty()) return std::vector<EvictionOptions>(static_cast<size_t>(o.num_layers()), e);
    std::vector<EvictionOptions> out;
    for (const auto budget : budgets) out.push_back(EvictionOptions(e).budget(budget));
    return out;
  }

  static std::vector<Selection> make_selections(const std::vector<EvictionOptions>& e) {
    std::vector<Selection> out;
    for (const auto& x : e) out.emplace_back(x);
    return out;
  }

  static at::Device resolved(const at::Device& device) {
    try {
      return at::empty({0}, at::TensorOptions().device(device)).device();
    } catch (const c10::Error& e) {
      KVEVICT_CHECK(false, "options: device ", device, " is not usable here (", e.what_without_backtrace(), ")");
    }
    return device;  // not reached
  }

  [[noreturn]] void fail_allocation(const std::string& why) const {
    KVEVICT_CHECK(false, "could not allocate the eviction state: num_layers=", options_.num_layers(),
                  ", batch_size=", options_.batch_size(), ", num_heads=", options_.num_heads(),
                  ", capacity + evict_every = ", eviction_.capacity() + eviction_.evict_every(),
                  " slots per row (n_sink=", eviction_.n_sink(),
                  ", budget=", eviction_.budget(), ", n_recent=", eviction_.n_recent(),
                  ", evict_every=", eviction_.evict_every(), ") on ", device_, ": ", why);
    throw;  // not reached
  }

  /// Allocates L's tensors with `slots` slots, all dead; outside InferenceMode, so the state
  /// stays usable whatever mode later calls run in.
  void allocate(Layer& L, int64_t slots) const {
    c10::InferenceMode normal_tensors(false);
    at::NoGradGuard no_grad;
    const int64_t B = batch_size();
    const auto opts = at::TensorOptions().device(device_);
    L.position = at::full({B, slots}, -1, opts.dtype(at::kLong));
    L.state = at::zeros({B, slots, W}, opts.dtype(at::kFloat));
    if (options_.lazy_reduction()) L.pending = at::zeros({B, slots, 2}, opts.dtype(at::kDouble));
    if (!host_ && !L.seen_device.defined()) {
      L.seen_device = at::tensor(L.seen.empty() ? std::vector<int64_t>(B, 0) : L.seen, at::TensorOptions().dtype(at::kLong)).to(device_);
    }
    if (host_) {
      auto& H = L.host;
      H.fixed.resize(static_cast<size_t>(B * slots));
      if (options_.lazy_reduction()) H.reduced.resize(static_cast<size_t>(B * slots));
      H.observers.resize(slots);
      H.rank.resize(slots);
      H.candidates.reserve(slots);
      H.evicted.resize(slots);
      H.tail_flags.resize(slots);
      H.next.resize(static_cast<size_t>(slots * W));
    }
    L.slots = slots;
  }

  int64_t check_row(int64_t row) const {
    KVEVICT_CHECK_INDEX(row >= 0 && row < batch_size(), "row must be in [0, ", batch_size(), "), got ", row);
    return row;
  }
  Layer& at(int64_t layer) {
    KVEVICT_CHECK_INDEX(layer >= 0 && layer < num_layers(), "layer must be in [0, ", num_layers(), "), got ", layer);
    return layers_[layer];
  }
  const Layer& at(int64_t layer) const { return const_cast<EvictionPolicy*>(this)->at(layer); }
  /// Whether row b of a layer is over `capacity` and has appended in evict_every appends since
  /// its last pass.
  bool row_due(const Layer& L, int64_t b, int64_t capacity) const {
    return L.len[b] > capacity && L.appends[b] >= eviction_.evict_every();
  }

  /// The first real column of Q query columns in row b (right-aligned: column q is position
  /// seen - Q + q). A row that appended fewer tokens than the newest chunk's T has pads before
  /// its tokens; a row that appended the whole chunk treats every column at a position >= 0 as
  /// real (so Q may reach back past the chunk); a free row has none.
  int64_t first_real(const Layer& L, int64_t b, int64_t Q) const {
    if (!active_[b]) return Q;
    if (L.last_new[b] < L.last_T) return Q - std::min(Q, L.last_new[b]);
    return std::max<int64_t>(0, Q - L.seen[b]);
  }

  /// [1] fp32 tensor holding divisor_heads(), on the device (see observe_tensor()).
  const at::Tensor& heads_divisor() {
    if (!heads_t_.defined()) {
      heads_t_ = at::full({1}, static_cast<float>(divisor_heads()), at::TensorOptions().dtype(at::kFloat).device(device_));
    }
    return heads_t_;
  }

  static int64_t max_of(const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

  int64_t state_bytes(const Layer& L) const {
    int64_t bytes = L.position.nbytes() + L.state.nbytes();
    if (L.seen_device.defined()) bytes += L.seen_device.nbytes();
    if (L.pending.defined()) bytes += L.pending.nbytes();
    return bytes;
  }

  /// Empties `row` in every layer (positions -1, lengths and seen 0). No allocation on the host
  /// path; on the tensor path a fill per layer.
  void clear_row(int64_t row) {
    for (auto& L : layers_) {
      if (host_) {
        auto* p = L.position.template data_ptr<int64_t>() + row * L.slots;
        std::fill(p, p + L.slots, int64_t{-1});
        if (L.pending.defined()) {
          auto* q = L.pending.template data_ptr<double>() + row * L.slots * 2;
          std::fill(q, q + L.slots * 2, 0.0);
        }
      } else {
        L.position.select(0, row).fill_(-1);
        L.seen_device.select(0, row).zero_();
        if (L.pending.defined()) L.pending.select(0, row).zero_();
      }
      L.len[row] = L.seen[row] = L.last_new[row] = L.appends[row] = 0;
      L.open_q = 0;
    }
  }

  void append_unchecked(Layer& L, const int64_t* counts, int64_t T) {
    const int64_t B = batch_size();
    if (host_) {
      auto* pos = L.position.template data_ptr<int64_t>();
      auto* st = L.state.template data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < counts[b]; ++j) {
          const int64_t slot = b * L.slots + L.len[b] + j;
          pos[slot] = L.seen[b] + j;
          std::fill(st + slot * W, st + (slot + 1) * W, 0.f);
        }
      }
    } else {
      append_tensor(L, counts, T);
    }
    for (int64_t b = 0; b < B; ++b) {
      L.len[b] += counts[b];
      L.seen[b] += counts[b];
      L.last_new[b] = counts[b];
      L.appends[b] += counts[b] > 0 ? 1 : 0;
    }
    L.last_T = T;
    L.open_q = 0;
  }

  void append_tensor(Layer& L, const int64_t* counts, int64_t T) {
    const int64_t B = batch_size();
    bool uniform = true;  // every row appends T at the same length: plain narrow + copy
    for (int64_t b = 0; b < B; ++b) uniform = uniform && counts[b] == T && L.len[b] == L.len[0];
    std::vector<int64_t> c(counts, counts + B);
    const auto& counts_dev = L.counts_mirror.get(c, device_, {B});
    if (uniform) {
      const auto offs = at::arange(T, L.position.options());
      L.position.narrow(1, L.len[0], T).copy_(offs.unsqueeze(0).add(L.seen_device.unsqueeze(1)));
      L.state.narrow(1, L.len[0], T).zero_();
    } else {
      std::vector<int64_t> idx;
      int64_t M = 0;
      for (int64_t b = 0; b < B; ++b) M += counts[b];
      if (M > 0) {
        idx.resize(static_cast<size_t>(3 * M));
        int64_t i = 0;
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t j = 0; j < counts[b]; ++j, ++i) {
            idx[i] = b;
            idx[M + i] = L.len[b] + j;
            idx[2 * M + i] = j;
          }
        }
        const auto& t = L.index_mirror.get(idx, device_, {3, M});
        const auto rows = t.select(0, 0), slots = t.select(0, 1), offs = t.select(0, 2);
        L.position.index_put_({rows, slots}, L.seen_device.index_select(0, rows).add(offs));
        L.state.index_put_({rows, slots}, at::zeros({}, L.state.options()));
      }
    }
    L.seen_device.add_(counts_dev);
  }

  /// The first query column (of Q) that the scorer counts in row b: its first real one, or
  /// later for a scorer that counts only the newest (detail::counted_queries); Q if none.
  int64_t first_counted(const Layer& L, int64_t b, int64_t Q) const {
    const int64_t first = first_real(L, b, Q);
    return first >= Q ? Q : std::max(first, Q - detail::counted_queries(scorer_, Q));
  }

  /// Opens an observation of Q columns: host path, every row's fixed-point sums at 0; tensor
  /// path, a [B, S] fp64 buffer.
  void begin_observation(Layer& L, int64_t Q) {
    if (host_) {
      std::fill(L.host.fixed.begin(), L.host.fixed.begin() + batch_size() * L.slots, 0.0);
    } else {
      L.open_sum = at::zeros({batch_size(), max_of(L.len)}, L.position.options().dtype(at::kDouble));
      L.open_bad = at::Tensor();
    }
    L.open_q = Q;
    L.open_cells = 0;
  }

  /// Adds the fixed-point terms of probs [B, Hc, Qc, S] (query columns from q_begin, heads from
  /// h_begin) to the open observation, checking them on the way when checks are on.
  void add_observation(Layer& L, const at::Tensor& in, int64_t q_begin, int64_t h_begin) {
    const int64_t Q = L.open_q, Hc = in.size(1), Qc = in.size(2);
    const int64_t from = Q - detail::counted_queries(scorer_, Q);
    if (host_) {
      add_host(L, in, q_begin, h_begin);
    } else {
      add_tensor(L, in, q_begin);
    }
    L.open_cells += Hc * std::max<int64_t>(0, std::min(q_begin + Qc, Q) - std::max(q_begin, from));
  }

  /// Applies the open observation (reducer, observers, rank check, scorer) and closes it.
  void end_observation(Layer& L, int64_t layer) {
    if (host_) {
      end_host(L, layer);
    } else {
      end_tensor(L, layer);
    }
    L.open_q = 0;
  }

  /// Host path: per active row, the fixed-point sums over the piece's heads and counted
  /// queries (checking the probabilities on the way).
  void add_host(Layer& L, const at::Tensor& in, int64_t q_begin, int64_t h_begin) {
    const bool as_is = in.scalar_type() == at::kFloat && in.is_contiguous();  // skips a dispatch
    const auto x = as_is ? in : in.to(at::kFloat).contiguous();
    const float* p = x.template data_ptr<float>();
    const int64_t B = batch_size(), Hc = x.size(1), Qc = x.size(2), S = x.size(3), Q = L.open_q;
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    auto& HS = L.host;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q0 = first_counted(L, b, Q);  // counted queries: columns [q0, Q)
      if (q0 >= Q) continue;
      const int64_t len = L.len[b], seen = L.seen[b];
      double* fx = HS.fixed.data() + b * L.slots;
      const int64_t* pb = pos + b * L.slots;
      for (int64_t h = 0; h < Hc; ++h) {
        for (int64_t q = std::max<int64_t>(q0 - q_begin, 0); q < Qc; ++q) {
          const float* row = p + ((b * Hc + h) * Qc + q) * S;
          const int64_t query_pos = seen - Q + q_begin + q;
          const bool in_range = detail::add_fixed_row(row, fx, len);
          // Causality needs a look only where some key could be newer than the query (inside a
          // multi-token append); the message comes from the scalar check.
          if (check_ && (!in_range || query_pos < seen - 1)) {
            check_row_probs(row, pb, len, query_pos, b, h_begin + h, q_begin + q);
          }
        }
      }
    }
  }

  /// Host path: the reducer, then the observer counts, the rank check and the scorer's update.
  void end_host(Layer& L, int64_t layer) {
    if (options_.lazy_reduction()) {
      defer_host(L, layer);
      return;
    }
    const int64_t B = batch_size(), Q = L.open_q;
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    float* st = L.state.template data_ptr<float>();
    auto& HS = L.host;
    if (options_.reduce_contributions()) {
      auto sums = at::from_blob(HS.fixed.data(), {B, L.slots}, at::TensorOptions().dtype(at::kDouble));
      options_.reduce_contributions()(layer, sums);
    }
    const float heads = static_cast<float>(divisor_heads());
    // Two rounds: check every row first (nothing changes on a throw), then apply.
    for (int round = check_ ? 0 : 1; round < 2; ++round) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t q0 = first_counted(L, b, Q);
        if (q0 >= Q) continue;
        const int64_t len = L.len[b], seen = L.seen[b];
        const int64_t* pb = pos + b * L.slots;
        const double* fx = HS.fixed.data() + b * L.slots;
        float* sb = st + b * L.slots * W;
        const int64_t first_q_pos = seen - Q + q0;  // counted queries: positions first_q_pos .. seen - 1
        for (int64_t s = 0; s < len; ++s) {
          // Observers: counted queries at or after the token's position.
          const float observers =
              static_cast<float>(std::max<int64_t>(std::min<int64_t>(seen - std::max(pb[s], first_q_pos), Q - q0), 0));
          const float c = detail::from_fixed(fx[s], heads);
          apply_token(sb + s * W, c, observers, /*check_only=*/round == 0, b, s);
        }
      }
    }
  }

  /// The divisor H of the contributions: total_heads, or num_heads when unset.
  int64_t divisor_heads() const noexcept {
    return options_.total_heads() > 0 ? options_.total_heads() : options_.num_heads();
  }

  // lazy_reduction: observations add to L.pending; flush_layer() reduces and applies them.

  /// Fixed-point terms per slot that keep a pending sum an exact integer in fp64 (2^53 / 2^32).
  static constexpr int64_t kMaxPendingTerms = int64_t{1} << 21;

  /// Terms per slot of an observation of Q columns: counted queries x heads of all processes.
  /// The same on every process, so every process flushes early at the same observation.
  int64_t observation_terms(int64_t Q) const { return detail::counted_queries(scorer_, Q) * divisor_heads(); }

  /// Host path: adds the open observation's sums (L.host.fixed) and observer counts to pending.
  void defer_host(Layer& L, int64_t layer) {
    const int64_t Q = L.open_q, terms = observation_terms(Q);
    if (L.pending_terms > 0 && L.pending_terms + terms > kMaxPendingTerms) flush_layer(L, layer);
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    double* pd = L.pending.template data_ptr<double>();
    for (int64_t b = 0; b < batch_size(); ++b) {
      const int64_t q0 = first_counted(L, b, Q);
      if (q0 >= Q) continue;
      const int64_t len = L.len[b], seen = L.seen[b], first_q_pos = seen - Q + q0;
      const int64_t* pb = pos + b * L.slots;
      const double* fx = L.host.fixed.data() + b * L.slots;
      double* pe = pd + b * L.slots * 2;
      for (int64_t s = 0; s < len; ++s) {
        pe[2 * s] += fx[s];
        pe[2 * s + 1] += static_cast<double>(
            std::max<int64_t>(std::min<int64_t>(seen - std::max(pb[s], first_q_pos), Q - q0), 0));
      }
    }
    L.pending_terms += terms;
  }

  /// Tensor path: checks the open observation's probabilities (checks on), then adds its sums
  /// [B, S] fp64 and observers [B, S] fp32 to pending where `keep` [B, S].
  void defer_tensor(Layer& L, int64_t layer, const at::Tensor& sum, const at::Tensor& observers,
                    const at::Tensor& keep, const at::Tensor& bad) {
    if (check_ && bad.defined()) {
      KVEVICT_CHECK(!bad.template item<bool>(),
                    "attention probs must be in [0, 1] and causal (0 for keys newer than their query), got a "
                    "non-finite, out-of-range or non-causal value; the state is unchanged",
                    kChecksHint);
    }
    const int64_t terms = observation_terms(L.open_q);
    if (L.pending_terms > 0 && L.pending_terms + terms > kMaxPendingTerms) flush_layer(L, layer);
    const auto pend = L.pending.narrow(1, 0, keep.size(1));
    const auto zero = at::zeros({}, pend.options());
    pend.select(2, 0).add_(at::where(keep, sum, zero));
    pend.select(2, 1).add_(at::where(keep, observers.to(at::kDouble), zero));
    L.pending_terms += terms;
  }

  /// Reduces the pending sums once and applies them, with the pending observer counts, to every
  /// live slot of every active row as one observation; then zeroes them. Throws before changing
  /// anything (the reduction runs on a copy).
  void flush_layer(Layer& L, int64_t layer) {
    if (L.pending_terms == 0) return;
    at::NoGradGuard no_grad;
    const int64_t B = batch_size();
    if (host_) {
      auto& HS = L.host;
      double* pd = L.pending.template data_ptr<double>();
      for (int64_t i = 0; i < B * L.slots; ++i) HS.reduced[i] = pd[2 * i];
      if (options_.reduce_contributions()) {
        auto sums = at::from_blob(HS.reduced.data(), {B, L.slots}, at::TensorOptions().dtype(at::kDouble));
        options_.reduce_contributions()(layer, sums);
      }
      const float heads = static_cast<float>(divisor_heads());
      float* st = L.state.template data_ptr<float>();
      for (int round = check_ ? 0 : 1; round < 2; ++round) {  // check every row first, then apply
        for (int64_t b = 0; b < B; ++b) {
          if (!active_[b]) continue;
          float* sb = st + b * L.slots * W;
          for (int64_t s = 0; s < L.len[b]; ++s) {
            const float c = detail::from_fixed(HS.reduced[b * L.slots + s], heads);
            const auto observers = static_cast<float>(pd[2 * (b * L.slots + s) + 1]);
            apply_token(sb + s * W, c, observers, /*check_only=*/round == 0, b, s);
          }
        }
      }
      std::fill(pd, pd + B * L.slots * 2, 0.0);
    } else {
      const int64_t S = max_of(L.len);
      if (S > 0) {
        const auto pend = L.pending.narrow(1, 0, S);
        auto sum = pend.select(2, 0).clone();  // [B, S] fp64
        if (options_.reduce_contributions()) options_.reduce_contributions()(layer, sum);
        const auto c = sum.to(at::kFloat).mul(static_cast<float>(1.0 / detail::kFixedOne)).div(heads_divisor());
        const auto observers = pend.select(2, 1).to(at::kFloat);
        std::vector<int64_t> act(active_.begin(), active_.end());
        const auto& rows = L.rows_mirror.get(act, device_, {B});
        const auto keep = rows.gt(0).unsqueeze(1).logical_and(L.position.narrow(1, 0, S).ge(0));
        apply_tensor(L, S, c, observers, keep, at::Tensor());
      }
      L.pending.zero_();
    }
    L.pending_terms = 0;
  }

  /// Moves the pending sums with the slot moves of `pass` (L.len: the lengths before it) and
  /// zeroes the slots it frees.
  void move_pending(Layer& L, Pass& pass) {
    const int64_t B = batch_size();
    if (host_) {
      if (pass.columns > 0) {
        detail::apply_moves_host(pass.src.data(), pass.dst.data(), B, pass.columns, pass.columns, L.pending, 1);
      }
      double* pd = L.pending.template data_ptr<double>();
      for (int64_t b = 0; b < B; ++b) {
        std::fill(pd + (b * L.slots + pass.new_len[b]) * 2, pd + (b * L.slots + L.len[b]) * 2, 0.0);
      }
      return;
    }
    if (pass.columns > 0) {
      const auto opts = at::TensorOptions().dtype(at::kLong);
      const auto src = pass.src_t.defined() ? pass.src_t : at::tensor(pass.src, opts).view({B, pass.columns}).to(device_);
      const auto dst = pass.dst_t.defined() ? pass.dst_t : at::tensor(pass.dst, opts).view({B, pass.columns}).to(device_);
      const auto rows = at::arange(B, src.options()).unsqueeze(1);
      const auto moved = L.pending.index({rows, src});  // all reads before any write
      L.pending.index_put_({rows, dst}, moved);
    }
    const auto nl = at::tensor(pass.new_len, at::TensorOptions().dtype(at::kLong)).to(device_).unsqueeze(1);
    L.pending.masked_fill_(at::arange(L.slots, nl.options()).unsqueeze(0).ge(nl).unsqueeze(2), 0.0);
  }

  void check_row_probs(const float* row, const int64_t* pos, int64_t len, int64_t query_pos, int64_t b, int64_t h,
                       int64_t q) const {
    for (int64_t s = 0; s < len; ++s) {
      const float v = row[s];
      KVEVICT_CHECK(v >= 0.f && v <= 1.f, "attention probs must be in [0, 1], got a non-finite or out-of-range ", v, " at [", b, ", ",
                    h, ", ", q, ", ", s, "]; the state is unchanged", kChecksHint);
      KVEVICT_CHECK(v == 0.f || pos[s] <= query_pos, "attention probs must be causal: key at position ", pos[s],
                    " is newer than its query at position ", query_pos, " but has probability ", v, " at [", b, ", ",
                    h, ", ", q, ", ", s, "]; the state is unchanged", kChecksHint);
    }
  }

  /// One token's observation: with `check_only`, applies it to a copy of the state and checks
  /// the resulting rank (throws, changing nothing); else applies it in place.
  void apply_token(float* state, float c, float observers, bool check_only, int64_t b, int64_t s) const {
    if (!check_only) {
      scorer_.apply(state, c, observers);
      return;
    }
    float next[W];
    std::copy(state, state + W, next);
    scorer_.apply(next, c, observers);
    check_rank(scorer_.rank(next), b, s, c);
  }

  void check_rank(float rank, int64_t b, int64_t s, float c) const {
    KVEVICT_CHECK(std::isfinite(rank), "the observation gives a non-finite rank (NaN, inf, or an fp32 overflow) at row ",
                  b, ", slot ", s, " (contribution ", c, ", rank ", rank, "); the state is unchanged", kChecksHint);
  }

  static constexpr const char* kChecksHint =
      " (build with check_observations(false) to skip these checks; non-finite ranks then rank lowest)";

  void add_scores_host(Layer& L, const at::Tensor& in) {
    const bool as_is = in.scalar_type() == at::kFloat && in.is_contiguous();
    const auto x = as_is ? in : in.to(at::kFloat).contiguous();
    const float* p = x.template data_ptr<float>();
    const int64_t S = x.size(1);
    float* st = L.state.template data_ptr<float>();
    for (int round = check_ ? 0 : 1; round < 2; ++round) {
      for (int64_t b = 0; b < batch_size(); ++b) {
        if (!active_[b]) continue;
        float* sb = st + b * L.slots * W;
        for (int64_t s = 0; s < L.len[b]; ++s) {
          const float c = p[b * S + s];
          apply_token(sb + s * W, c, 1.f, /*check_only=*/round == 0, b, s);
        }
      }
    }
  }

  /// Tensor path: the counted query columns of Q as a [B, Q] int64 0/1 mask on the device,
  /// uploaded only when it changes.
  const at::Tensor& counted_mask(Layer& L, int64_t Q) {
    const int64_t B = batch_size();
    std::vector<int64_t> mask(static_cast<size_t>(B * Q), 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t q = first_counted(L, b, Q); q < Q; ++q) mask[b * Q + q] = 1;
    }
    return L.qmask_mirror.get(mask, device_, {B, Q});
  }

  /// Tensor path: the same reduction with tensor ops ([B, Hc, Qc, S] fixed point -> fp64 sums,
  /// exact integers, so pieces add up to the whole in any order).
  void add_tensor(Layer& L, const at::Tensor& in, int64_t q_begin) {
    const int64_t B = batch_size(), Q = L.open_q, Qc = in.size(2), S = max_of(L.len);
    const auto pos = L.position.narrow(1, 0, S);
    const auto live = pos.ge(0);  // [B, S]
    const auto qmask = counted_mask(L, Q).narrow(1, q_begin, Qc);  // [B, Qc]
    const auto x = in.to(at::kFloat);
    if (check_) {
      const auto qpos =
          L.seen_device.unsqueeze(1).sub(Q).add(at::arange(q_begin, q_begin + Qc, pos.options()).unsqueeze(0));
      const auto real = qmask.gt(0).view({B, 1, Qc, 1}).logical_and(live.view({B, 1, 1, S}));
      const auto out_of_range = x.lt(0).logical_or(x.gt(1)).logical_or(x.isnan());
      const auto future = pos.view({B, 1, 1, S}).gt(qpos.view({B, 1, Qc, 1})).logical_and(x.ne(0));
      const auto bad = out_of_range.logical_or(future).logical_and(real).any();
      L.open_bad = L.open_bad.defined() ? L.open_bad.logical_or(bad) : bad;
    }
    // detail::fixed_term on tensors; pads and other rows' columns count 0.
    const auto term = x.clamp(0.0, 1.0).add(x.sub(x)).to(at::kDouble).mul(detail::kFixedOne).round();
    L.open_sum.add_(at::where(qmask.gt(0).view({B, 1, Qc, 1}), term, at::zeros({}, term.options())).sum({1, 2}));
  }

  /// Tensor path: the reducer, contributions, observers and the scorer's update.
  void end_tensor(Layer& L, int64_t layer) {
    const int64_t B = batch_size(), Q = L.open_q, S = max_of(L.len);
    const auto pos = L.position.narrow(1, 0, S);
    const auto live = pos.ge(0);  // [B, S]
    auto sum = L.open_sum;
    if (options_.reduce_contributions() && !options_.lazy_reduction()) options_.reduce_contributions()(layer, sum);
    // Divided by a [1] tensor, not a scalar: a scalar divisor may become a multiply by its
    // reciprocal on CUDA, which rounds differently from the host's division.
    const auto c = sum.to(at::kFloat).mul(static_cast<float>(1.0 / detail::kFixedOne)).div(heads_divisor());
    const auto& qmask = counted_mask(L, Q);
    const auto qpos = L.seen_device.unsqueeze(1).sub(Q).add(at::arange(Q, pos.options()).unsqueeze(0));
    auto observers = qpos.unsqueeze(1).ge(pos.unsqueeze(2)).logical_and(qmask.gt(0).unsqueeze(1)).sum(2).to(at::kFloat);
    observers = observers.mul(live.to(at::kFloat));
    // Rows with no real query contribute nothing: their sums are 0 and observers 0, but a
    // scorer that replaces (LatestAttention) must not see them at all.
    std::vector<int64_t> observed(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) observed[b] = first_real(L, b, Q) < Q ? 1 : 0;
    const auto& obs_rows = L.rows_mirror.get(observed, device_, {B});
    const auto keep = obs_rows.gt(0).unsqueeze(1).logical_and(live);  // [B, S]
    const auto bad = L.open_bad;
    L.open_sum = at::Tensor();
    L.open_bad = at::Tensor();
    if (options_.lazy_reduction()) {
      defer_tensor(L, layer, sum, observers, keep, bad);
      return;
    }
    apply_tensor(L, S, c, observers, keep, bad);
  }

  /// Tensor add_scores: the caller's scores as one observation with one observer.
  void observe_tensor(Layer& L, int64_t /*layer*/, const at::Tensor& in, bool /*direct*/) {
    const int64_t B = batch_size(), S = max_of(L.len);
    const auto live = L.position.narrow(1, 0, S).ge(0);  // [B, S]
    const auto c = in.to(at::kFloat);
    const auto observers = at::ones({B, S}, c.options());
    std::vector<int64_t> act(active_.begin(), active_.end());
    const auto& act_rows = L.rows_mirror.get(act, device_, {B});
    apply_tensor(L, S, c, observers, act_rows.gt(0).unsqueeze(1).logical_and(live), at::Tensor());
  }

  /// Applies contribution/observers to the live slots `keep` [B, S]; with checks, computes the
  /// next state apart and throws (changing nothing) if `bad` or any next rank is non-finite.
  void apply_tensor(Layer& L, int64_t S, const at::Tensor& c, const at::Tensor& observers, const at::Tensor& keep,
                    const at::Tensor& bad) {
    const auto state = L.state.narrow(1, 0, S);
    const auto next = state.clone();
    scorer_.apply(next, c, observers);
    const auto merged = at::where(keep.unsqueeze(2), next, state);
    if (check_) {
      auto fail = at::isfinite(scorer_.rank(merged)).logical_not().logical_and(keep).any();
      if (bad.defined()) {
        KVEVICT_CHECK(!bad.template item<bool>(),
                      "attention probs must be in [0, 1] and causal (0 for keys newer than their query), got a "
                      "non-finite, out-of-range or non-causal value; the state is unchanged",
                      kChecksHint);
      }
      KVEVICT_CHECK(!fail.template item<bool>(),
                    "the observation gives a non-finite rank (NaN, inf, or an fp32 overflow); the state is unchanged",
                    kChecksHint);
    }
    state.copy_(merged);
  }

  Pass empty_pass(const Layer& L) const {
    Pass p;
    reset_pass(L, p);
    return p;
  }

  /// An empty pass of `L` in `p` (its vectors keep their room).
  void reset_pass(const Layer& L, Pass& p) const {
    p.slot_bound = max_of(L.len);
    p.n.assign(batch_size(), 0);
    p.moves.assign(batch_size(), 0);
    p.new_len.assign(L.len.begin(), L.len.end());
    p.columns = 0;
    p.src.clear();
    p.dst.clear();
    p.src_t = at::Tensor();
    p.dst_t = at::Tensor();
  }

  /// Host plan: per row over capacity, select (Selection::evict_slots_row, trusted), then pair
  /// the freed slots below the new length with the kept tail slots.
  void plan_host(Layer& L, Pass& pass, int64_t layer) {
    const int64_t B = batch_size();
    int64_t columns = 0;
    for (int64_t b = 0; b < B; ++b) columns = std::max(columns, pass.n[b]);
    pass.columns = columns;
    pass.src.assign(static_cast<size_t>(B * columns), 0);
    pass.dst.assign(static_cast<size_t>(B * columns), 0);
    if (columns == 0) return;
    auto& HS = L.host;
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    const float* st = L.state.template data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      if (pass.n[b] == 0) continue;
      const int64_t len = L.len[b];
      const float* sb = st + b * L.slots * W;
      const float* rank = sb;
      if (!(W == 1 && detail::RankIsState<Scorer>::value)) {
        for (int64_t s = 0; s < len; ++s) HS.rank[s] = scorer_.rank(sb + s * W);
        rank = HS.rank.data();
      }
      selections_[layer].evict_slots_row(rank, pos + b * L.slots, len, L.seen[b], HS.evicted.data(), HS.candidates,
                                 detail::TrustedPositions{});
      fill_moves_host(pass, b, HS.evicted.data(), pass.n[b], HS.tail_flags);
    }
    pad_moves(pass);
  }

  /// Moves for row b of a pass whose `n` evicted slots (ascending) are given: each evicted slot
  /// below the new length receives the next kept tail slot.
  static void fill_moves_host(Pass& pass, int64_t b, const int64_t* evicted, int64_t n,
                              std::vector<uint8_t>& tail_flags) {
    const int64_t new_len = pass.new_len[b];
    if (pass.columns < n) {  // truncate(): one row's moves
      pass.columns = n;
      const auto B = static_cast<int64_t>(pass.n.size());
      pass.src.assign(static_cast<size_t>(B * n), 0);
      pass.dst.assign(static_cast<size_t>(B * n), 0);
    }
    if (static_cast<int64_t>(tail_flags.size()) < n) tail_flags.resize(static_cast<size_t>(n));
    uint8_t* tail = tail_flags.data();
    std::fill(tail, tail + n, uint8_t{0});
    for (int64_t i = 0; i < n; ++i) {
      if (evicted[i] >= new_len) tail[evicted[i] - new_len] = 1;
    }
    int64_t j = 0, k = 0;
    for (int64_t i = 0; i < n && evicted[i] < new_len; ++i, ++k) {
      while (tail[j]) ++j;
      pass.dst[b * pass.columns + k] = evicted[i];
      pass.src[b * pass.columns + k] = new_len + j;
      ++j;
    }
    pass.moves[b] = k;
  }

  /// Pads every row's columns past its own moves with a repeat of its first move (or slot 0
  /// onto itself), so all rows have `columns` columns.
  void pad_moves(Pass& pass) const {
    for (int64_t b = 0; b < batch_size(); ++b) {
      const int64_t k = pass.moves[b];
      for (int64_t j = k; j < pass.columns; ++j) {
        pass.src[b * pass.columns + j] = k > 0 ? pass.src[b * pass.columns] : 0;
        pass.dst[b * pass.columns + j] = k > 0 ? pass.dst[b * pass.columns] : 0;
      }
    }
  }

  void plan_tensor(Layer& L, Pass& pass, int64_t layer) {
    const auto& eviction = layer_eviction_[layer];
    const int64_t B = batch_size(), S = max_of(L.len);
    int64_t columns = 0;
    for (int64_t b = 0; b < B; ++b) columns = std::max(columns, pass.n[b]);
    pass.columns = columns;
    if (columns == 0) return;
    const auto pos = L.position.narrow(1, 0, S);
    const auto live = pos.ge(0);
    // Row facts, uploaded when they change: n (evicted) and the new length.
    std::vector<int64_t> facts(static_cast<size_t>(2 * B));
    for (int64_t b = 0; b < B; ++b) {
      facts[b] = pass.n[b];
      facts[B + b] = pass.new_len[b];
    }
    const auto& f = L.pass_mirror.get(facts, device_, {2, B});
    const auto n = f.select(0, 0).unsqueeze(1), new_len = f.select(0, 1).unsqueeze(1);  // [B, 1]
    const auto recent_from = L.seen_device.unsqueeze(1).sub(eviction.n_recent());
    const auto cand = live.logical_and(pos.ge(eviction.n_sink())).logical_and(pos.lt(recent_from));
    auto key = scorer_.rank(L.state.narrow(1, 0, S));
    const float inf = std::numeric_limits<float>::infinity();
    key = at::where(at::isfinite(key), key, at::full({}, -inf, key.options())).add(0.0);  // -0 -> +0
    key = at::where(cand, key, at::full({}, inf, key.options()));
    const auto by_position =
        std::get<1>(at::sort(at::where(live, pos, at::full({}, std::numeric_limits<int64_t>::max(), pos.options())),
                             /*dim=*/1));  // slots, oldest first, dead last
    const auto order = std::get<1>(at::sort(key.gather(1, by_position), /*stable=*/true, /*dim=*/1,
                                            /*descending=*/false))
                           .narrow(1, 0, columns);
    const auto col = at::arange(columns, pos.options()).unsqueeze(0);  // [1, columns]
    const auto valid = col.lt(n);
    const int64_t big = std::numeric_limits<int64_t>::max();
    const auto e = std::get<0>(at::sort(at::where(valid, by_position.gather(1, order), at::full({}, big, pos.options())), 1));
    const auto is_hole = e.lt(new_len);                        // valid evicted slots below new_len
    const auto holes = is_hole.sum(1, /*keepdim=*/true);       // [B, 1]
    // Tail slots new_len + j, j < n: flag the evicted ones, then kept ones first (stable).
    const auto tail_idx = e.sub(new_len).clamp(0, columns);    // invalid/holes -> clamped
    const auto hit = valid.logical_and(e.ge(new_len)).to(at::kLong);
    auto flags = at::zeros({B, columns + 1}, pos.options()).scatter_add_(1, tail_idx, hit).narrow(1, 0, columns);
    flags = at::where(col.lt(n), flags, at::full({}, 2, flags.options()));
    const auto kept_tail = std::get<1>(at::sort(flags, /*stable=*/true, /*dim=*/1, /*descending=*/false)).add(new_len);
    const auto real = col.lt(holes);
    const auto first_dst = at::where(holes.gt(0), e.narrow(1, 0, 1), at::zeros({}, e.options()));
    const auto first_src = at::where(holes.gt(0), kept_tail.narrow(1, 0, 1), at::zeros({}, e.options()));
    pass.dst_t = at::where(real, e, first_dst);
    pass.src_t = at::where(real, kept_tail, first_src);
  }

  /// Moves the state rows of a pass and marks the freed tail dead.
  void commit_state(Layer& L, Pass& pass) {
    if (L.pending_terms > 0) move_pending(L, pass);  // lazy_reduction, after truncate() (a pass flushed first)
    const int64_t B = batch_size();
    L.open_q = 0;  // slots move: an observation in pieces no longer matches them
    if (host_) {
      if (pass.columns > 0) {
        detail::apply_moves_host(pass.src.data(), pass.dst.data(), B, pass.columns, pass.columns, L.position, 1);
        detail::apply_moves_host(pass.src.data(), pass.dst.data(), B, pass.columns, pass.columns, L.state, 1);
      }
      auto* pos = L.position.template data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) {
        std::fill(pos + b * L.slots + pass.new_len[b], pos + b * L.slots + L.len[b], int64_t{-1});
        L.len[b] = pass.new_len[b];
      }
      return;
    }
    if (pass.columns > 0) {
      device_moves(pass);  // a host-built pass (truncate) on the tensor path
      const SlotMoves m{pass.src_t, pass.dst_t};
      const auto rows = detail::move_rows(m);  // everything that allocates comes before any write
      auto gp = detail::gather_moves(m, L.position, 1, rows);
      auto gs = detail::gather_moves(m, L.state, 1, rows);
      const auto nl = at::tensor(pass.new_len, at::TensorOptions().dtype(at::kLong)).to(device_).unsqueeze(1);
      const auto dead = at::arange(L.slots, L.position.options()).unsqueeze(0).ge(nl);
      detail::scatter_moves(m, L.position, 1, gp, rows);
      detail::scatter_moves(m, L.state, 1, gs, rows);
      L.position.masked_fill_(dead, -1);
    }
    for (int64_t b = 0; b < B; ++b) L.len[b] = pass.new_len[b];
  }

  EvictionPolicyOptions options_;
  EvictionOptions eviction_;
  std::vector<EvictionOptions> layer_eviction_;  // per layer: its budget
  std::vector<Selection> selections_;            // per layer
  Scorer scorer_;
  at::Device device_;
  bool host_;
  bool check_;
  int64_t reserved_ = 0;  // slots asked for by reserve()
  std::vector<uint8_t> active_;
  std::vector<Layer> layers_;
  at::Tensor heads_t_;  // [1] fp32 num_heads on the device (tensor path)
};

}  // namespace kvevict
