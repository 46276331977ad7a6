#pragma once
// EvictionPolicy: the eviction state of every layer and sequence (positions, lengths, scorer
// state), the slot mapping of each append, and each pass planned as slot moves that apply to any
// storage (slot_moves.hpp). MlaCache and MlaLatentCache own DeepSeek-V3-layout buffers over one.
//
// This file is the facade: it validates every call and hands it to its private base,
// detail/policy/policy_state.hpp (the layers, growth, plan and commit), which chooses the path
// in one place (on_path) for each step: detail/policy/host_path.hpp (CPU loops) or
// detail/policy/tensor_path.hpp (ATen ops: CUDA, and CPU in tests), which have the same steps in
// the same order. The state they share is detail/policy/layer_state.hpp; the exact reduction
// detail/reduction.hpp; the plan of a pass detail/policy/slot_plan.hpp; the selection rules
// selection.hpp. The caches (detail::CacheBase, cache_base.hpp) run the cache protocol, the
// base's public steps, through steps(): each sees only the other's public members.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/policy/policy_state.hpp>
#include <kvevict/detail/policy/slot_plan.hpp>
#include <kvevict/options.hpp>
#include <kvevict/scorers.hpp>
#include <kvevict/selection.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <tuple>
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
  /// Tokens in the caches' host tier (evicted, kept in host memory), summed over rows.
  int64_t tier_tokens = 0;
  /// Host bytes the tier holds: host path, its tokens' rows, position, rank and scorer state,
  /// and the page digests; tensor path, its store's pinned rows (the store's capacity, grown
  /// geometrically up to tier_tokens per row).
  int64_t tier_bytes = 0;
  /// Bytes the tier holds on the cache's device (tensor path: its tokens' positions, ranks,
  /// states and insertion numbers, and the page digests by page id; grown geometrically with
  /// the tier and the context, freed by reset(); 0 on the host path).
  int64_t tier_device_bytes = 0;
  /// Tokens recall() brought back from the tier, summed over rows and calls (each moved one
  /// token's rows from the tier into the cache, and a heavy hitter's the other way).
  int64_t tier_recalled = 0;

  /// Adds every counter of `o` (stats summed over layers).
  CacheStats& operator+=(const CacheStats& o) noexcept {
    eviction_events += o.eviction_events;
    tokens_evicted += o.tokens_evicted;
    bytes_allocated += o.bytes_allocated;
    tier_tokens += o.tier_tokens;
    tier_bytes += o.tier_bytes;
    tier_device_bytes += o.tier_device_bytes;
    tier_recalled += o.tier_recalled;
    return *this;
  }
};

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
class EvictionPolicy : private detail::PolicyState<Scorer> {
 public:
  using scorer_type = Scorer;
  static constexpr int64_t W = Scorer::kStateWidth;
  static_assert(Scorer::kStateWidth >= 1, "Scorer::kStateWidth must be >= 1");

  /// Builds empty state for every layer and row, with capacity + evict_every slots per row.
  /// With layer_budgets set, `eviction`'s budget is ignored (its capacity may be 0).
  /// \throws c10::ValueError if `options` or `eviction` are invalid, naming the value;
  ///         c10::Error naming the sizes if the state cannot be allocated or `device` is unusable.
  explicit EvictionPolicy(const EvictionPolicyOptions& options, const EvictionOptions& eviction = EvictionOptions(),
                          Scorer scorer = Scorer())
      : detail::PolicyState<Scorer>(options, eviction, std::move(scorer)) {}

  EvictionPolicy(const EvictionPolicy&) = delete;
  EvictionPolicy& operator=(const EvictionPolicy&) = delete;
  EvictionPolicy(EvictionPolicy&&) noexcept = default;
  EvictionPolicy& operator=(EvictionPolicy&&) noexcept = default;

  // -------------------------------------------------------------------------------------------
  // Configuration

  const EvictionPolicyOptions& options() const noexcept { return core_.options; }
  const EvictionOptions& eviction() const noexcept { return core_.eviction; }
  const Scorer& scorer() const noexcept { return core_.scorer; }
  /// n_sink + budget + n_recent of the EvictionOptions: tokens a row holds after a pass, in
  /// every layer unless layer_budgets are set (then see capacity(layer)).
  int64_t capacity() const noexcept { return core_.eviction.capacity(); }
  /// Tokens a row of `layer` holds after a pass. \throws c10::IndexError for a bad layer.
  int64_t capacity(int64_t layer) const { return eviction(layer).capacity(); }
  /// The eviction options of `layer` (its budget from layer_budgets, if set).
  const EvictionOptions& eviction(int64_t layer) const {
    at(layer);
    return core_.layer_eviction[layer];
  }
  int64_t num_layers() const noexcept { return static_cast<int64_t>(layers_.size()); }
  int64_t batch_size() const noexcept { return core_.options.batch_size(); }
  int64_t num_heads() const noexcept { return core_.options.num_heads(); }
  /// The device of the state, resolved ("cuda" becomes "cuda:N", "cpu:0" becomes "cpu").
  at::Device device() const noexcept { return core_.device; }
  /// True when the state lives in host loops (CPU); false for the tensor-op path (CUDA).
  bool host_path() const noexcept { return host_; }
  /// Whether observe() checks its input (EvictionPolicyOptions::check_observations, resolved).
  bool checks_observations() const noexcept { return core_.check; }

  /// The cache protocol: the unchecked steps (the halves of an append, of a pass, of a
  /// truncate and of a reset; exchange; save/undo; growth) that the caches that own buffers
  /// (detail::CacheBase) run in their all-or-nothing order. Internal: not for users, who call
  /// the checked calls of this class (evict(), truncate(), ...) instead.
  detail::PolicyState<Scorer>& steps() noexcept { return *this; }
  const detail::PolicyState<Scorer>& steps() const noexcept { return *this; }

  // -------------------------------------------------------------------------------------------
  // Sequences

  /// True while `row` holds a sequence (every row, until finish()). \throws c10::IndexError.
  bool active(int64_t row) const { return core_.active[check_row(row)] != 0; }

  /// Starts a new, empty sequence in the lowest free row and returns that row.
  /// \throws c10::Error if every row is active (finish one first); nothing changes.
  int64_t add_sequence() {
    for (int64_t b = 0; b < batch_size(); ++b) {
      if (!core_.active[b]) {
        core_.active[b] = 1;
        ++epoch_;
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
    detail::host_heap("finish", [&] { clear_row(row, "finish"); });
    core_.active[row] = 0;
  }

  /// Empties `row` for a new sequence (positions restart at 0); the row stays active.
  /// \throws c10::IndexError for a bad row; c10::Error if the row is free.
  void reset(int64_t row) {
    KVEVICT_CHECK(active(row), "reset: row ", row, " holds no sequence (add_sequence() starts one)");
    detail::host_heap("reset", [&] { clear_row(row, "reset"); });
  }

  /// Empties every row of every layer, makes every row active, and gives back the slots grown
  /// by long appends (slots return to max(capacity + evict_every, reserved)).
  /// \throws c10::Error naming reset, the layer and the sizes only if the smaller state cannot be
  ///         allocated; nothing changes then.
  void reset() {
    detail::host_heap("reset", [&] {
      auto fresh = prepare_fresh("reset");  // every allocation first
      commit_fresh(fresh);
      activate_all();
    });
  }

  /// Rolls back the `k` newest tokens of `row` in every layer (rejected speculative-decoding
  /// drafts): they leave the cache, seen tokens go back by k, the next append takes their
  /// positions. Scores that the dropped tokens' queries added to older tokens stay: undoing
  /// them would mean keeping every query's contribution, a cost on every step. Call observe()
  /// only for accepted tokens (attend(..., observe = false), then observe) to avoid them.
  ///
  /// \return one SlotMoves per layer, to apply to that layer's buffers (apply_moves).
  /// \throws c10::Error if k < 0, k exceeds a layer's seen tokens, the row is free, or one of
  ///         the k tokens was already evicted in some layer, or on an allocation failure;
  ///         nothing changes then, in any layer.
  /// \note Syncs with the host on the tensor path (it reads positions back).
  std::vector<SlotMoves> truncate(int64_t row, int64_t k) {
    return detail::host_heap("truncate", [&] {
      auto t = plan_truncate(row, k);
      detail::TensorUndo undo;  // the tensor path's writes, put back if one of them throws
      for (int64_t l = 0; l < num_layers(); ++l) save(undo, l);
      undo.commit("truncate", [&] { commit_truncate(t); });
      return std::move(t.moves);
    });
  }

  // -------------------------------------------------------------------------------------------
  // Save and restore one layer

  /// One layer's eviction state, copied by save_layer(): positions, scorer state, pending sums,
  /// lengths, seen tokens and pass counters. Move-only; restore_layer() takes it.
  class LayerSave {
   public:
    LayerSave() = default;
    /// The layer it was saved from; -1 once restored (or default-made).
    int64_t layer() const noexcept { return layer_; }

   private:
    friend class EvictionPolicy;
    int64_t layer_ = -1;
    int64_t epoch_ = 0;     // the policy's epoch when saved: restore_layer() needs the same
    int64_t capacity_ = 0;  // the layer's capacity
    int64_t evict_every_ = 0;
    typename detail::PolicyState<Scorer>::Grown state_;
  };

  /// A copy of `layer`'s eviction state, for restore_layer(): speculative decoding that must
  /// undo everything a draft did to a layer (its tokens, its queries' scores, the passes it
  /// caused), where truncate() keeps the scores the dropped tokens' queries added. Save before
  /// the drafts, run them, restore, then run the accepted ones again: the layer is then as if
  /// only those had run. Your buffers are yours to save and restore with it (the caches do it
  /// for theirs: MlaCache::save_layer()).
  ///
  /// Allocates a copy of the layer's state (O(slots) per row on the policy's device); changes
  /// nothing; no host sync.
  /// \throws c10::IndexError for a bad layer; c10::Error while an observation is open on it
  ///         (observe_begin() without observe_end()) or on an allocation failure.
  LayerSave save_layer(int64_t layer) const;

  /// Makes `layer` as it was when `save` was made from it; `save` is used up (its layer() becomes
  /// -1). Only the policy's state: the buffers are the caller's.
  ///
  /// Allocates nothing; no host sync.
  /// \throws c10::IndexError for a bad layer; c10::Error, changing nothing, if `save` was not
  ///         made from `layer` of a policy of this batch size and capacity (or was used already),
  ///         an observation is open on the layer, reset(), reset(row), finish(), add_sequence()
  ///         or truncate() ran since the save, or reserve() raised the slots since.
  void restore_layer(int64_t layer, LayerSave&& save) {
    check_restore(layer, save, "restore_layer");
    restore(layer, save.state_);
    save.layer_ = -1;
  }

  /// restore_layer()'s checks, naming `call`. \throws as restore_layer(); changes nothing.
  void check_restore(int64_t layer, const LayerSave& save, const char* call) const;

  // -------------------------------------------------------------------------------------------
  // Per-layer state

  /// The longest row of `layer`: the width S of the views and probabilities. \throws IndexError.
  int64_t size(int64_t layer) const { return detail::max_of(at(layer).len); }
  /// Live tokens of `row` in `layer`. \throws c10::IndexError.
  int64_t size(int64_t layer, int64_t row) const { return at(layer).len[check_row(row)]; }
  /// The most tokens ever appended to a row of `layer` (equal rows: their seen tokens).
  int64_t seen_tokens(int64_t layer) const { return detail::max_of(at(layer).seen); }
  /// Tokens ever appended to `row` of `layer`: the position of its next token.
  int64_t seen_tokens(int64_t layer, int64_t row) const { return at(layer).seen[check_row(row)]; }
  /// Tokens `row` appended to `layer` in its latest append (0 for a pad or idle row).
  int64_t appended(int64_t layer, int64_t row) const { return at(layer).last_new[check_row(row)]; }
  /// Slots per row that buffers of `layer` must hold: room for slots - 1 tokens, and the trash
  /// slot (the last), where the tensor path writes pads and padding moves; it never holds a
  /// token.
  int64_t slots(int64_t layer) const { return at(layer).slots; }

  /// [B, size(layer)] int64 original position of each slot (slot order, not sorted), -1 past a
  /// row's length. A copy, on the policy's device.
  at::Tensor positions(int64_t layer) const {
    const auto& L = at(layer);
    return L.position.narrow(1, 0, detail::max_of(L.len)).clone();
  }

  /// [B, size(layer)] fp32 rank of each slot (Scorer::rank of its state), 0 past a row's length.
  /// A copy, on the policy's device. \throws c10::Error while lazy_reduction observations are
  /// pending on `layer` (flush() first).
  at::Tensor scores(int64_t layer) const {
    const auto& L = at(layer);
    KVEVICT_CHECK(L.pending_terms == 0, "scores: layer ", layer,
                  " holds observations not yet applied (lazy_reduction); call flush(", layer,
                  ") first (a collective under tensor parallelism)");
    const int64_t S = detail::max_of(L.len);
    const auto rank = core_.scorer.rank(L.state.narrow(1, 0, S));
    return at::where(L.position.narrow(1, 0, S).ge(0), rank, at::zeros({}, rank.options()));
  }

  /// [B, Q] int64 positions of Q query columns, right-aligned on the newest append (column q of
  /// row b is position seen - Q + q), -1 where the column is a pad: before a row's own tokens
  /// when it appended fewer than the chunk's T (left padding), at a position < 0, or in a free
  /// row. A new tensor on the policy's device; the tensor path computes it from the device's
  /// seen counter (no upload, no sync in the steady state).
  /// \throws c10::IndexError for a bad layer; c10::ValueError unless 1 <= Q.
  at::Tensor query_positions(int64_t layer, int64_t Q) const {
    at(layer);
    KVEVICT_CHECK_VALUE(Q >= 1, "query_positions: Q must be >= 1, got ", Q);
    // The tensor path keeps device constants and mirrors for it: logically const.
    auto& self = const_cast<EvictionPolicy&>(*this);
    return self.on_path([&](auto& p) { return p.query_positions(self.core_, self.at(layer), layer, Q); });
  }

  /// True when Q query columns of `layer` have no pad and every row is active and as long as
  /// the longest: attention then needs no per-sequence mask beyond causality.
  bool dense(int64_t layer, int64_t Q) const {
    const auto& L = at(layer);
    const int64_t S = detail::max_of(L.len);
    for (int64_t b = 0; b < batch_size(); ++b) {
      if (L.len[b] != S || core_.first_real(L, b, Q) != 0) return false;
    }
    return true;
  }

  /// Counters of one layer (bytes: the state only; caches add their buffers).
  CacheStats stats(int64_t layer) const {
    const auto& L = at(layer);
    return {L.events, L.evicted, state_bytes(layer)};
  }

  // -------------------------------------------------------------------------------------------
  // Steps

  /// Appends `counts[b]` tokens to row b of `layer` (ragged: 0 included), at positions
  /// seen .. seen + counts[b] - 1, rank state 0. In a chunk of T columns, row b's tokens are
  /// its last counts[b] columns (left padding); the other columns are pads and are not stored.
  ///
  /// \param counts  [B] host counts, each in [0, T]; a free row must append 0.
  /// \param T       columns of the chunk (the new rows' token dim), >= 1.
  /// \return [B, T] int64 slot mapping on the policy's device: the slot of each new token, -1
  ///         for a pad. Write the rows with write_rows(); slots are < slots(layer) - 1 (the last
  ///         slot of every row is the trash slot, which never holds a token).
  /// \throws c10::Error on a bad layer, count or T, or if a row would exceed slots(layer)
  ///         (reserve() first); nothing changes then.
  at::Tensor append(int64_t layer, at::IntArrayRef counts, int64_t T) {
    return detail::host_heap("append", [&] { return append_checked(layer, counts, T); });
  }

 private:
  at::Tensor append_checked(int64_t layer, at::IntArrayRef counts, int64_t T) {
    check_append(layer, counts, T);
    auto& L = at(layer);
    if (!host_) {
      auto map = tensor_path_.slot_map(core_, L, layer, counts.data(), T, -1).clone();  // the counters move on
      const auto pads_on_trash = map.masked_fill(map.lt(0), L.slots - 1);
      prepare_append(layer, counts.data(), T, pads_on_trash);  // every allocation before any write
      detail::TensorUndo undo;
      save_append(undo, layer, pads_on_trash);
      undo.commit("append", [&] { append_prepared(layer, counts.data(), T, pads_on_trash); });
      return map;
    }
    auto map = at::full({batch_size(), T}, -1, at::TensorOptions().dtype(at::kLong));
    auto* m = map.template data_ptr<int64_t>();
    for (int64_t b = 0; b < batch_size(); ++b) {
      for (int64_t j = 0; j < counts[b]; ++j) m[b * T + T - counts[b] + j] = L.len[b] + j;
    }
    prepare_append(layer, counts.data(), T, at::Tensor());
    append_prepared(layer, counts.data(), T, at::Tensor());
    return map;
  }

 public:
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
      KVEVICT_CHECK_VALUE(core_.active[b] || counts[b] == 0, "append: row ", b,
                          " holds no sequence (finished or never added), so counts[", b, "] must be 0, got ",
                          counts[b]);
      KVEVICT_CHECK_VALUE(L.seen[b] + counts[b] <= EvictionOptions::kMaxTokens, "append: row ", b,
                          " would pass 2^40 seen tokens");
      KVEVICT_CHECK(!check_room || L.len[b] + counts[b] <= L.slots - 1, "append: row ", b, " of layer ", layer,
                    " would hold ", L.len[b] + counts[b], " tokens but the layer has room for ", L.slots - 1,
                    " (slots(layer) - 1: the last slot is the trash slot); reserve() more slots first");
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
  /// \note With checks on, the tensor path syncs with the host twice (the input check, the
  ///       rank check).
  void observe(int64_t layer, const at::Tensor& probs) {
    detail::host_heap("observe", [&] {
      auto& L = at(layer);
      const int64_t S = detail::max_of(L.len);
      if (!detail::has_shape(probs, {batch_size(), num_heads(), -1, S}) || probs.layout() != at::kStrided) {
        detail::check_tensor(probs, "attention probs", core_.device);
        detail::check_shape(probs, "attention probs", {batch_size(), num_heads(), -1, S}, {"B", "H", "Q", "S"},
                            "[B, H, Q, S] with S = size(layer), the longest row");
      }
      detail::check_floating(probs, "attention probs");
      detail::check_device(probs, "attention probs", core_.device);
      KVEVICT_CHECK(S >= 1, "attention probs: the layer holds no token (append first)");
      KVEVICT_CHECK(probs.size(2) >= 1 && probs.size(2) <= detail::max_of(L.seen), "attention probs: Q must be in [1, ",
                    detail::max_of(L.seen), "], got ", probs.size(2), " (at most the seen tokens)");
      at::NoGradGuard no_grad;
      const int64_t Q = probs.size(2);
      L.open_q = Q;  // one piece: the path's observe() is begin + add + end
      try {
        on_path([&](auto& p) { p.observe(core_, L, layer, probs); });
      } catch (...) {
        L.open_q = 0;
        throw;
      }
      L.open_q = 0;
    });
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
  /// \note An H x Q bit map of the cells added (allocated only when it grows). Tensor path: also
  ///       one [B, S] fp64 buffer until observe_end().
  void observe_begin(int64_t layer, int64_t Q) {
    detail::host_heap("observe_begin", [&] {
      auto& L = at(layer);
      L.open_q = 0;
      KVEVICT_CHECK(detail::max_of(L.len) >= 1, "observe_begin: the layer holds no token (append first)");
      KVEVICT_CHECK_VALUE(Q >= 1 && Q <= detail::max_of(L.seen), "observe_begin: Q must be in [1, ", detail::max_of(L.seen), "], got ",
                          Q, " (at most the seen tokens)");
      at::NoGradGuard no_grad;
      L.open_cover.assign(static_cast<size_t>(num_heads() * Q), false);
      begin_observation(L, layer, Q);
    });
  }

  /// Adds one piece of the observation opened by observe_begin(): the probabilities of query
  /// columns [q_begin, q_begin + Qc) and heads [h_begin, h_begin + Hc). Pieces may come in any
  /// order; each (head, query column) must come exactly once. Columns a scorer does not count
  /// (LatestAttention counts only column Q - 1) may be left out.
  ///
  /// \param probs  [B, Hc, Qc, S] probabilities, any floating dtype, the policy's device,
  ///               S = size(layer), slot order; pads and dead slots may hold anything.
  /// \throws c10::Error if no observation is open, on a bad shape, range, dtype or device, if a
  ///         (head, query column) of the piece was already added (named), or (checks on) as
  ///         observe(); the open observation is discarded then and the state is unchanged.
  void observe_add(int64_t layer, const at::Tensor& probs, int64_t q_begin, int64_t h_begin) {
    detail::host_heap("observe_add", [&] {
      auto& L = at(layer);
      KVEVICT_CHECK(L.open_q > 0, "observe_add: no observation is open on layer ", layer,
                    " (observe_begin() first; an append, pass or reset in between discards it)");
      try {
        const int64_t S = detail::max_of(L.len), Q = L.open_q;
        detail::check_tensor(probs, "attention probs", core_.device);
        detail::check_shape(probs, "attention probs", {batch_size(), -1, -1, S}, {"B", "Hc", "Qc", "S"},
                            "[B, Hc, Qc, S] with S = size(layer)");
        detail::check_floating(probs, "attention probs");
        detail::check_device(probs, "attention probs", core_.device);
        const int64_t Hc = probs.size(1), Qc = probs.size(2);
        KVEVICT_CHECK_VALUE(h_begin >= 0 && Hc >= 1 && h_begin + Hc <= num_heads(), "observe_add: heads [", h_begin,
                            ", ", h_begin + Hc, ") must lie in [0, H = ", num_heads(), ")");
        KVEVICT_CHECK_VALUE(q_begin >= 0 && Qc >= 1 && q_begin + Qc <= Q, "observe_add: query columns [", q_begin, ", ",
                            q_begin + Qc, ") must lie in [0, Q = ", Q, ")");
        for (int64_t h = h_begin; h < h_begin + Hc; ++h) {
          for (int64_t q = q_begin; q < q_begin + Qc; ++q) {
            KVEVICT_CHECK(!L.open_cover[h * Q + q], "observe_add: (head ", h, ", query column ", q,
                          ") was already added to this observation; each (head, query column) must come once");
          }
        }
        at::NoGradGuard no_grad;
        add_observation(L, layer, probs, q_begin, h_begin);
        for (int64_t h = h_begin; h < h_begin + Hc; ++h) {
          for (int64_t q = q_begin; q < q_begin + Qc; ++q) L.open_cover[h * Q + q] = true;
        }
      } catch (...) {
        L.open_q = 0;
        throw;
      }
    });
  }

  /// Applies the observation opened by observe_begin() to the scorer, as observe() does.
  /// \throws c10::Error if no observation is open, if a counted (head, query column) never came
  ///         (named), or (checks on) as observe(); the observation is closed and the state
  ///         unchanged then.
  void observe_end(int64_t layer) {
    detail::host_heap("observe_end", [&] {
      auto& L = at(layer);
      KVEVICT_CHECK(L.open_q > 0, "observe_end: no observation is open on layer ", layer,
                    " (observe_begin() first; an append, pass or reset in between discards it)");
      try {
        const int64_t Q = L.open_q, from = Q - detail::counted_queries(core_.scorer, Q);
        int64_t covered = 0, missing = -1;  // counted cells added; the first missing one (h * Q + q)
        for (int64_t h = 0; h < num_heads(); ++h) {
          for (int64_t q = from; q < Q; ++q) {
            if (L.open_cover[h * Q + q]) {
              ++covered;
            } else if (missing < 0) {
              missing = h * Q + q;
            }
          }
        }
        KVEVICT_CHECK(missing < 0, "observe_end: (head ", missing / Q, ", query column ", missing % Q,
                      ") was never added: the pieces covered ", covered,
                      " (head, counted query column) cells, expected H x counted columns = ", num_heads() * (Q - from),
                      "; the state is unchanged");
        at::NoGradGuard no_grad;
        end_observation(L, layer);
      } catch (...) {
        L.open_q = 0;
        throw;
      }
    });
  }

  /// True while an observation opened by observe_begin() on `layer` waits for observe_end().
  bool observing(int64_t layer) const { return at(layer).open_q > 0; }
  /// Discards the observation opened by observe_begin() on `layer`, if any (e.g. after a
  /// throw while computing its pieces): the scorer state is unchanged, observing(layer) is
  /// false after it. No sync. \throws c10::IndexError for a bad layer.
  void observe_discard(int64_t layer) { at(layer).open_q = 0; }

  /// Adds caller-computed per-token scores, as one observation with contribution `scores` and
  /// one observer (CumulativeAttention adds them, LatestAttention replaces, ...). Every live
  /// token of every active row is observed.
  ///
  /// \param scores  [B, S] any floating dtype, the policy's device, S = size(layer), slot order.
  /// \throws c10::Error on a bad layer, shape, dtype or device, or (checks on) a non-finite
  ///         resulting rank; nothing changes then.
  void add_scores(int64_t layer, const at::Tensor& scores) {
    detail::host_heap("add_scores", [&] {
      auto& L = at(layer);
      const int64_t S = detail::max_of(L.len);
      if (!detail::has_shape(scores, {batch_size(), S}) || scores.layout() != at::kStrided) {
        detail::check_tensor(scores, "scores", core_.device);
        detail::check_shape(scores, "scores", {batch_size(), S}, {"B", "S"}, "[B, S] with S = size(layer)");
      }
      detail::check_floating(scores, "scores");
      detail::check_device(scores, "scores", core_.device);
      at::NoGradGuard no_grad;
      on_path([&](auto& p) { p.add_scores(core_, L, layer, scores); });
    });
  }

  /// lazy_reduction: reduces the observations of `layer` not yet applied (reduce_contributions,
  /// once, on the summed fixed-point sums) and applies them as one observation. A no-op without
  /// lazy_reduction or when nothing is pending; plan() and evict() call it. With a reducer across
  /// processes it is a collective: every process calls it for the same layers in the same order
  /// (plan() and evict() do, as every process sees the same due()).
  /// \throws c10::IndexError for a bad layer; what the reducer throws; with checks on,
  ///         c10::Error on a non-finite resulting rank. The state and the pending sums are then
  ///         unchanged.
  void flush(int64_t layer) {
    detail::host_heap("flush", [&] { flush_layer(at(layer), layer); });
  }

  /// lazy_reduction: true while `layer` holds observations that flush() has yet to apply.
  bool pending(int64_t layer) const { return at(layer).pending_terms > 0; }

  /// Whether a pass on `layer` would run now: some row holds more than capacity(layer) tokens
  /// and appended tokens in at least evict_every appends since its last pass (or since it
  /// started). Per row, so a sequence evicts when it would alone, whatever the other rows do.
  bool due(int64_t layer) const {
    const auto& L = at(layer);
    for (int64_t b = 0; b < batch_size(); ++b) {
      if (core_.row_due(L, b, capacity(layer))) return true;
    }
    return false;
  }

  /// Runs a pass on `layer` if due(): each row over capacity drops its lowest-ranked heavy-hitter
  /// candidates back to capacity() tokens, and its kept tail rows move into the freed slots.
  ///
  /// \return the moves to apply to every buffer of the layer (empty if no pass ran).
  /// \throws c10::IndexError for a bad layer; c10::Error on an allocation failure (or what
  ///         flush() throws), before anything changed but this: with lazy_reduction, the
  ///         pending observations were applied first (flush(), a collective under tensor
  ///         parallelism) and stay applied, so that every process stays in step.
  /// \note Host path: no allocation but the returned tensors. Tensor path: static shapes in the
  ///       steady state, no host sync.
  SlotMoves evict(int64_t layer) {
    return detail::host_heap("evict", [&] { return evict_due(layer); });
  }

 private:
  SlotMoves evict_due(int64_t layer) {
    if (!due(layer)) return {};
    detail::Pass pass;
    plan(layer, pass);
    auto moves = pass.to_moves(core_.device);  // allocates: before the state changes
    detail::TensorUndo undo;                    // the tensor path's writes, put back if one throws
    if (!moves.empty()) save(undo, layer, /*counters=*/false);  // the last write
    undo.commit("evict", [&] { commit(layer, pass); });
    return moves;
  }

 public:
  /// Gives `layer` `slots` slots per row (growing or shrinking), keeping its tokens; buffers of
  /// the layer must then hold that many. Caches call it as their buffers change, with `what`
  /// naming their public call (e.g. "update") in the messages.
  /// \throws c10::ValueError if slots < size(layer) + 1 (the trash slot); c10::Error naming
  ///         `what`, the layer and the sizes if the state cannot be allocated. Nothing changes then.
  void resize_slots(int64_t layer, int64_t slots, const char* what = "resize_slots") {
    auto& L = at(layer);
    Grown N = resized(L, layer, slots, what);
    swap_in(L, layer, N);
  }

  /// The slots per row `layer` returns to after a pass or reset(): max(capacity(layer) +
  /// evict_every, what reserve() asked for) + 1, the trash slot. \throws c10::IndexError for a
  /// bad layer.
  int64_t base_slots(int64_t layer) const {
    at(layer);
    return base_slots_unchecked(layer);
  }

  /// Makes room for `tokens` tokens per row: raises base_slots() to tokens + 1 (the trash slot)
  /// and never lowers it; layers with fewer slots are resized.
  /// \throws c10::ValueError if tokens is out of range; c10::Error naming reserve, the layer and
  ///         the sizes if the state cannot be allocated. Nothing changes then.
  void reserve(int64_t tokens) {
    detail::host_heap("reserve", [&] {
      KVEVICT_CHECK_VALUE(tokens >= 1 && tokens <= EvictionOptions::kMaxTokens, "reserve: tokens must be in [1, 2^40], got ",
                          tokens);
      const int64_t slots = tokens + 1;
      std::vector<Grown> grown(layers_.size());  // every allocation first: all layers or none
      for (size_t l = 0; l < layers_.size(); ++l) {
        if (layers_[l].slots < slots) grown[l] = resized(layers_[l], static_cast<int64_t>(l), slots, "reserve");
      }
      for (size_t l = 0; l < layers_.size(); ++l) {
        if (layers_[l].slots < slots) swap_in(layers_[l], static_cast<int64_t>(l), grown[l]);
      }
      reserved_ = std::max(reserved_, tokens);
    });
  }

  /// Bytes of the state of `layer` on the device (positions, scorer state, seen counters).
  int64_t state_bytes(int64_t layer) const {
    const auto& L = at(layer);
    // The tensor path's device counters: length, seen tokens, recent-window start per row.
    int64_t bytes = L.position.nbytes() + L.state.nbytes() + (host_ ? 0 : batch_size() * 3 * 8);
    if (L.pending.defined()) bytes += L.pending.nbytes();
    return bytes;
  }

 private:
  // The base's steps the facade itself runs (the caches reach all of them through steps()).
  using Base = detail::PolicyState<Scorer>;
  using typename Base::Grown;
  using Base::activate_all, Base::append_prepared, Base::at, Base::base_slots_unchecked, Base::begin_observation,
      Base::check_row, Base::clear_row, Base::commit, Base::commit_truncate, Base::add_observation,
      Base::end_observation, Base::flush_layer, Base::prepare_fresh, Base::commit_fresh, Base::on_path, Base::plan,
      Base::plan_truncate, Base::prepare_append, Base::resized, Base::slot_map, Base::swap_in, Base::save,
      Base::save_append, Base::current, Base::exchange, Base::copied, Base::restore;
  using Base::epoch_;
  using Base::core_, Base::host_, Base::host_path_, Base::layers_, Base::reserved_, Base::tensor_path_;
};

}  // namespace kvevict

// save_layer() and check_restore(), defined out of the class.
#include <kvevict/detail/policy/layer_save.hpp>
