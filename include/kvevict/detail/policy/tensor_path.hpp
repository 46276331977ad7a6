#pragma once
// The tensor path of EvictionPolicy: every step is ATen ops on the policy's device (CUDA; CPU
// in tests, through force_tensor_path()). Its twin, host_path.hpp, has the same steps under the
// same names in the same order; both keep the same tokens, bit for bit (docs/DESIGN.md,
// contract rule 5).
//
// Built for replay in a CUDA graph: each row's length, seen tokens and recent-window start live
// on the device (`counters`) and the kernels read them there; the host keeps its own copies
// (LayerState) for its decisions and never reads the device. Host facts that the kernels need
// and that stay the same in the steady state (how many tokens each row appends or a pass
// evicts, which query columns count) reach the device through DeviceMirrors, uploaded only when
// they change. Pads (of an append, of a pass's move columns) go to the trash slot, the last
// slot of every row, which never holds a token. With checks off, the steady state makes no
// host sync and no host-to-device copy.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/checks.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/device_mirror.hpp>
#include <kvevict/detail/policy/slot_plan.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/detail/tensor_undo.hpp>
#include <kvevict/selection.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace kvevict {
namespace detail {

/// Test hook: while true, policies built afterwards use the tensor path on CPU too (the path
/// CUDA always takes), so one CPU machine can test both paths against the same oracle. Read
/// once, at construction.
inline bool& force_tensor_path() {
  static thread_local bool force = false;
  return force;
}

/// Whether Scorer declares `kUsesObservers = false` (scorers.hpp): its apply() ignores the
/// observer counts, so the tensor path need not compute them.
template <class S, class = void>
struct UsesObservers : std::true_type {};
template <class S>
struct UsesObservers<S, std::void_t<decltype(S::kUsesObservers)>> : std::bool_constant<S::kUsesObservers> {};

template <class Scorer>
class TensorPath {
 public:
  using Core = PolicyCore<Scorer>;
  static constexpr int64_t W = Scorer::kStateWidth;

  /// Checks on: where the first bad probability of one piece of an observation is, found with
  /// no host sync (read only when the observation is rejected).
  struct PieceCheck {
    int64_t q_begin, h_begin, Hc, Qc, S;
    at::Tensor first;  // [3] fp64: any bad (0/1), flat [b, h, q, s] index of the first, its value
  };

  /// What commit() writes, made by prepare_commit() before any write.
  struct Commit {
    at::Tensor position, state, pending;  // the moved rows, gathered
    at::Tensor new_len;                   // [B, 1]
    at::Tensor dead, pending_dead;        // a host-built pass: [B, slots] slots left dead; pending: [B, slots, 1]
  };

  /// Per-layer device state next to LayerState.
  struct Scratch {
    at::Tensor counters;            // [B, 3] int64: length, seen tokens, seen - n_recent
    at::Tensor open_sum, open_bad;  // an observation in pieces: [B, S] fp64 sums, [] bool "a check failed"
    DeviceMirror step;              // [B, 3] what an append adds to counters: counts x 3
    DeviceMirror start;             // [B, 1] T - counts: each row's first real column of an append
    DeviceMirror first;             // [B, 1] each row's first real query column (query_positions)
    DeviceMirror tail;              // [B, 1 + columns] a pass's offsets from the lengths (plan())
    DeviceMirror past;              // [B, columns] bool: a pass's columns past a row's own n
    at::Tensor marks;               // [B, slots] bool scratch of plan()
    DeviceMirror counted;           // [B, Q] 1 where a query column counts (when some do not)
    DeviceMirror rows;              // [B, 1] 1 for the rows an observation applies to (when some do not)
    std::vector<PieceCheck> open_checks;  // checks on: per piece of the open observation
    at::Tensor next_position, next_step;  // prepare_append() -> append(): positions to write, counter step
  };

  /// The scratch of `layer` (nothing in it depends on the slots: a resize keeps it).
  Scratch resized(const Core& c, int64_t layer, int64_t /*slots*/) const {
    if (static_cast<size_t>(layer) < scratch_.size() && scratch_[layer].counters.defined()) return scratch_[layer];
    Scratch D;
    D.counters = at::zeros({c.batch_size(), 3}, at::TensorOptions().dtype(at::kLong).device(c.device));
    D.counters.select(1, 2).fill_(-c.layer_eviction[layer].n_recent());
    return D;
  }

  /// A copy of `layer`'s scratch that a later step of the live one cannot change: the counters
  /// cloned (they last between calls); the mirrors are replaced on change, never written in
  /// place, and the rest is scratch of one call (allocates). For save_layer(), with no open
  /// observation.
  Scratch copied(int64_t layer) const {
    Scratch D = scratch_[static_cast<size_t>(layer)];
    c10::InferenceMode normal_tensors(false);
    D.counters = D.counters.clone();
    D.open_sum = D.open_bad = at::Tensor();
    D.open_checks.clear();
    return D;
  }

  /// `layer`'s counters on the device: [B, 3] int64 length, seen tokens, seen - n_recent
  /// (undefined before the layer's first use). Recall reads its victims' window from them.
  const at::Tensor& counters(int64_t layer) const {
    static const at::Tensor none;
    return static_cast<size_t>(layer) < scratch_.size() ? scratch_[layer].counters : none;
  }

  /// Makes room for the scratch of `layers` layers (allocates: before any swap_in()).
  void size_layers(int64_t layers) { scratch_.resize(static_cast<size_t>(layers)); }

  /// Takes `D` (from resized()) as the scratch of `layer`, which size_layers() made room for.
  /// Allocates nothing, does not throw.
  void swap_in(int64_t layer, Scratch& D) noexcept { std::swap(scratch_[static_cast<size_t>(layer)], D); }

  /// What a pass or a truncate may write on `layer` (L's positions, states and pending sums;
  /// the counters too unless `counters` is false: a pass's last write), copied into `undo`
  /// (allocates).
  void save(TensorUndo& undo, const LayerState& L, int64_t layer, bool counters) const {
    undo.save(L.position);
    undo.save(L.state);
    undo.save(L.pending);
    if (counters) undo.save(scratch_[layer].counters);
  }

  /// What clear_row() writes, copied into `undo` (allocates).
  void save_row(TensorUndo& undo, const LayerState& L, int64_t layer, int64_t row) const {
    undo.save(L.position.select(0, row));
    undo.save(scratch_[layer].counters.select(0, row));
    if (L.pending.defined()) undo.save(L.pending.select(0, row));
  }

  /// What undoes append() of a prepared `map` on L: its slots were dead (position -1) and go
  /// back to -1; the states written there are not read while dead; the counters' step is
  /// append()'s last write, so it never needs undoing. Allocates a step, no tensor.
  void save_append(TensorUndo& undo, const Core& c, const LayerState& L, const at::Tensor& map) {
    auto position = L.position;
    if (position.is_cpu() && position.is_contiguous() && map.is_cpu()) {  // a loop: allocates nothing
      undo.on_failure([position, map] {
        auto* p = position.template data_ptr<int64_t>();
        const auto m = map.template accessor<int64_t, 2>();  // map may be a view of the counters
        for (int64_t b = 0; b < m.size(0); ++b) {
          for (int64_t t = 0; t < m.size(1); ++t) p[b * position.size(1) + m[b][t]] = -1;
        }
      });
      return;
    }
    const auto& r = rows_index(c);
    undo.on_failure([position, r, map]() mutable { position.index_put_({r, map}, -1); });
  }

  void clear_row(const Core& c, LayerState& L, int64_t layer, int64_t row) {
    L.position.select(0, row).fill_(-1);
    const auto counters = scratch_[layer].counters.select(0, row);
    counters.narrow(0, 0, 2).zero_();
    counters.select(0, 2).fill_(-c.layer_eviction[layer].n_recent());
    if (L.pending.defined()) L.pending.select(0, row).zero_();
  }

  /// [B, T] int64 slot of each column of an append of `counts` (before it), on the device: the
  /// row's length plus the column's offset in the row's tokens; pads get `pad`. A view of the
  /// counters when every row appends one token (then valid only until append()).
  at::Tensor slot_map(const Core& c, const LayerState& /*L*/, int64_t layer, const int64_t* counts, int64_t T, int64_t pad) {
    auto& D = scratch_[layer];
    const auto len = D.counters.narrow(1, 0, 1);  // [B, 1]
    if (whole_chunk(c, counts, T)) return T == 1 ? len : len.add(iota(c, T));
    const auto off = offsets(c, layer, counts, T);
    return len.add(off).masked_fill_(off.lt(0), pad);
  }

  /// append(), first half: the new tokens' positions (from the device's seen counter) and the
  /// counters' step, made before anything changes (allocates; changes nothing).
  void prepare_append(const Core& c, LayerState& /*L*/, int64_t layer, const int64_t* counts, int64_t T,
                      const at::Tensor& /*map*/) {
    auto& D = scratch_[layer];
    const int64_t B = c.batch_size();
    const auto seen = D.counters.narrow(1, 1, 1);  // [B, 1]
    at::Tensor position;
    if (whole_chunk(c, counts, T)) {
      position = T == 1 ? seen : seen.add(iota(c, T));
    } else {
      const auto off = offsets(c, layer, counts, T);
      position = seen.add(off).masked_fill_(off.lt(0), -1);  // the trash slot stays dead
    }
    rows_index(c);  // made once: before any write
    zero(c);
    std::vector<int64_t> step(static_cast<size_t>(3 * B));
    for (int64_t b = 0; b < B; ++b) step[3 * b] = step[3 * b + 1] = step[3 * b + 2] = counts[b];
    D.next_step = D.step.get(step, c.device, {B, 3});
    D.next_position = std::move(position);
  }

  /// Writes the new tokens' state (what prepare_append() made; scorer state 0) and advances the
  /// counters. `map` from slot_map() with pads on the trash slot. Allocates nothing.
  void append(const Core& c, LayerState& L, int64_t layer, const int64_t* /*counts*/, int64_t /*T*/,
              const at::Tensor& map) {
    auto& D = scratch_[layer];
    const auto& r = rows_index(c);
    L.position.index_put_({r, map}, D.next_position);
    L.state.index_put_({r, map}, zero(c));
    D.counters.add_(D.next_step);
    D.next_position = at::Tensor();
    D.next_step = at::Tensor();
  }

  /// [B, Q] int64 query positions (see EvictionPolicy::query_positions), a new device tensor
  /// computed from the seen counter: no upload in the steady state.
  at::Tensor query_positions(const Core& c, const LayerState& L, int64_t layer, int64_t Q) {
    const auto seen = scratch_[layer].counters.narrow(1, 1, 1);
    bool all_real = true;
    for (int64_t b = 0; b < c.batch_size(); ++b) all_real = all_real && c.first_real(L, b, Q) == 0;
    if (all_real) return Q == 1 ? seen.sub(1) : seen.add(iota(c, Q).sub(Q));
    std::vector<int64_t> first(static_cast<size_t>(c.batch_size()));
    for (int64_t b = 0; b < c.batch_size(); ++b) first[b] = c.first_real(L, b, Q);
    const auto& f = scratch_[layer].first.get(first, c.device, {c.batch_size(), 1});
    const auto q = iota(c, Q);
    return seen.add(q).sub_(Q).masked_fill_(q.lt(f), -1);
  }

  void begin_observation(const Core& c, LayerState& L, int64_t layer, int64_t /*Q*/) {
    auto& D = scratch_[layer];
    D.open_sum = at::zeros({c.batch_size(), max_of(L.len)}, L.position.options().dtype(at::kDouble));
    D.open_bad = at::Tensor();
    D.open_checks.clear();
  }

  /// Adds the fixed-point sums of probs [B, Hc, Qc, S] (query columns from q_begin) to the open
  /// observation: exact integers, so pieces add up to the whole in any order.
  void add_observation(const Core& c, LayerState& L, int64_t layer, const at::Tensor& in, int64_t q_begin,
                       int64_t h_begin) {
    auto& D = scratch_[layer];
    if (c.check) check_probs(c, L, layer, in, q_begin, h_begin);
    D.open_sum.add_(fixed_sums(c, L, layer, in, q_begin));
  }

  /// The reducer, the contributions and observers, and the scorer's update (or, with
  /// lazy_reduction, the sums into pending).
  void end_observation(const Core& c, LayerState& L, int64_t layer) {
    auto& D = scratch_[layer];
    auto sum = std::move(D.open_sum);
    const auto bad = std::move(D.open_bad);
    D.open_sum = at::Tensor();
    D.open_bad = at::Tensor();
    apply_observation(c, L, layer, sum, bad);
    D.open_checks.clear();
  }

  /// observe(probs) in one piece: begin + add + end without the open [B, S] buffer.
  void observe(const Core& c, LayerState& L, int64_t layer, const at::Tensor& probs) {
    at::Tensor bad;
    if (c.check) {
      scratch_[layer].open_checks.clear();
      check_probs(c, L, layer, probs, 0, 0);
      bad = std::move(scratch_[layer].open_bad);
      scratch_[layer].open_bad = at::Tensor();
    }
    apply_observation(c, L, layer, fixed_sums(c, L, layer, probs, 0), bad);
    scratch_[layer].open_checks.clear();
  }

  void add_scores(const Core& c, LayerState& L, int64_t layer, const at::Tensor& in) {
    const int64_t B = c.batch_size(), S = max_of(L.len);
    const auto contribution = in.to(at::kFloat);
    const auto observers = at::ones({B, S}, contribution.options());
    apply(c, L, layer, S, contribution, observers, keep_mask(c, L, layer, c.active), at::Tensor());
  }

  void flush(const Core& c, LayerState& L, int64_t layer) {
    const int64_t S = max_of(L.len);
    if (S > 0) {
      const auto pend = L.pending.narrow(1, 0, S);
      auto sum = pend.select(2, 0).clone();  // [B, S] fp64
      if (c.options.reduce_contributions()) c.options.reduce_contributions()(layer, sum);
      const auto contribution = from_fixed(sum, heads_divisor(c));
      const auto observers = pend.select(2, 1).to(at::kFloat);
      apply(c, L, layer, S, contribution, observers, keep_mask(c, L, layer, c.active), at::Tensor());
    }
    L.pending.zero_();
  }

  /// Plans a pass (pass.n and new_len set by the caller): one top-k over a key that orders by
  /// rank, then position (selection.hpp), picks each row's evicted slots; holes below the new
  /// length receive the kept tail slots in order, as the host path pairs them. No host read.
  void plan(const Core& c, LayerState& L, int64_t layer, Pass& pass) {
    const auto& eviction = c.layer_eviction[layer];
    auto& D = scratch_[layer];
    const int64_t B = c.batch_size(), S = max_of(L.len);
    int64_t columns = 0;
    bool uniform = true;  // every row evicts `columns`
    for (int64_t b = 0; b < B; ++b) columns = std::max(columns, pass.n[b]);
    for (int64_t b = 0; b < B; ++b) uniform = uniform && pass.n[b] == columns;
    pass.columns = columns;
    if (columns == 0) return;
    const auto pos = L.position.narrow(1, 0, S);
    const auto len = D.counters.narrow(1, 0, 1), recent_from = D.counters.narrow(1, 2, 1);
    const auto chosen = lowest_candidates(c.scorer.rank(L.state.narrow(1, 0, S)), pos, eviction.n_sink(), recent_from,
                                          columns, max_of(L.seen), /*ordered=*/!uniform);  // [B, columns] slots
    const int64_t trash = L.slots - 1;
    // One add from a mirror gives the new lengths and the tail slots: column 0 holds -n, column
    // 1 + j holds j - n for j < n (slot new_len + j), and a huge offset past a row's n (clamped
    // to the trash slot).
    std::vector<int64_t> offsets(static_cast<size_t>(B * (columns + 1)));
    for (int64_t b = 0; b < B; ++b) {
      offsets[b * (columns + 1)] = -pass.n[b];
      for (int64_t j = 0; j < columns; ++j) offsets[b * (columns + 1) + 1 + j] = j < pass.n[b] ? j - pass.n[b] : kFar;
    }
    const auto ends = len.add(D.tail.get(offsets, c.device, {B, columns + 1}));
    const auto new_len = ends.narrow(1, 0, 1);  // [B, 1]
    auto tail = ends.narrow(1, 1, columns);     // [B, columns]
    auto evicted = chosen;
    if (!uniform) {
      tail.clamp_max_(trash);
      std::vector<int64_t> past(static_cast<size_t>(B * columns));
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t j = 0; j < columns; ++j) past[b * columns + j] = j >= pass.n[b];
      }
      evicted = chosen.masked_fill(D.past.get(past, c.device, {B, columns}, at::kBool), trash);
    }
    if (columns == 1) {
      // At most one token per row: the last live slot (the tail) moves into the evicted one,
      // onto itself when it is the evicted one; rows that evict nothing move the trash slot
      // onto itself.
      pass.dst_t = evicted;
      pass.src_t = tail;
    } else {
      // Ascending: the holes (below the new length) first, then the evicted tail slots, then the
      // trash. Column k < holes moves the k-th kept tail slot into the k-th hole; the columns
      // after it move the trash slot into an evicted tail slot (or onto itself): they write only
      // slots that hold no token after the pass, and every read comes before every write.
      evicted = std::get<0>(at::sort(evicted, /*dim=*/1));
      pass.dst_t = evicted;
      // A tail slot moves unless it is evicted itself: mark the evicted slots, look the tail up.
      auto& mark = marks(c, L, layer);
      mark.zero_();
      mark.scatter_(1, evicted, true);
      pass.src_t = std::get<0>(at::sort(tail.masked_fill(mark.gather(1, tail), trash), /*dim=*/1));  // kept, ascending
    }
    pass.evicted_t = pass.dst_t;  // ascending, pads on the trash slot
    pass.tail_t = tail;
    pass.slot_bound = L.slots;  // the moves name the trash slot
    pass.new_len_t = new_len;
  }

  /// commit(), first half: everything it allocates (the moved rows, gathered; the new lengths
  /// and dead slots of a host-built pass); changes nothing.
  Commit prepare_commit(const Core& c, const LayerState& L, int64_t /*layer*/, Pass& pass) {
    Commit w;
    if (pass.columns == 0) return w;
    const SlotMoves m = pass.to_moves(c.device);
    const auto& r = rows_index(c);
    w.position = L.position.index({r, m.src});
    w.state = L.state.index({r, m.src});
    if (L.pending_terms > 0) w.pending = L.pending.index({r, m.src});
    if (!pass.tail_t.defined()) {  // built on the host (truncate(), which syncs anyway)
      w.new_len = at::tensor(pass.new_len, at::TensorOptions().dtype(at::kLong)).view({c.batch_size(), 1}).to(c.device);
      w.dead = iota(c, L.slots).ge(w.new_len).logical_and_(L.position.ge(0));
    } else {
      w.new_len = pass.new_len_t;
    }
    if (w.pending.defined()) w.pending_dead = iota(c, L.slots).ge(w.new_len).unsqueeze(2);
    return w;
  }

  /// Moves the state rows (and pending sums) of a pass and marks the freed tail dead, with what
  /// prepare_commit() made; L.len still holds the lengths before it. Allocates nothing.
  void commit(const Core& c, LayerState& L, int64_t layer, Pass& pass, const Commit& w) {
    if (pass.columns == 0) return;
    const SlotMoves m = pass.to_moves(c.device);  // the pass's tensors: nothing to make
    const auto& r = rows_index(c);
    L.position.index_put_({r, m.dst}, w.position);
    L.state.index_put_({r, m.dst}, w.state);
    if (w.dead.defined()) {
      L.position.masked_fill_(w.dead, -1);
    } else {
      L.position.scatter_(1, pass.tail_t, -1);
    }
    if (w.pending.defined()) {
      L.pending.index_put_({r, m.dst}, w.pending);
      L.pending.masked_fill_(w.pending_dead, 0.0);
    }
    scratch_[layer].counters.narrow(1, 0, 1).copy_(w.new_len);
  }

  /// Recall's exchange: slot slots[b, k] of row b (the trash slot where a row has fewer) takes
  /// the token at positions[b, k] with scorer state states[b, k] ([B, V] int64, [B, V] int64,
  /// [B, V, W] fp32, the policy's device): two scatter_s, no sync. A host-heap failure between
  /// them is undone by the caller's log.
  void exchange(const Core& /*c*/, LayerState& L, int64_t /*layer*/, const at::Tensor& slots, const at::Tensor& positions,
                const at::Tensor& states) {
    L.position.scatter_(1, slots, positions);
    L.state.scatter_(1, slots.unsqueeze(2).expand({slots.size(0), slots.size(1), W}), states);
  }

  /// Truncate: seen tokens (and the recent window's start) of `row` go back by `k` (a 0-d int64
  /// on the device, made beforehand: no allocation).
  void rewind(const Core& /*c*/, LayerState& /*L*/, int64_t layer, int64_t row, const at::Tensor& k) {
    scratch_[layer].counters.select(0, row).narrow(0, 1, 2).sub_(k);
  }

 private:
  /// Whether every row appends the whole chunk of T columns (no pad, no idle row).
  static bool whole_chunk(const Core& c, const int64_t* counts, int64_t T) {
    for (int64_t b = 0; b < c.batch_size(); ++b) {
      if (counts[b] != T) return false;
    }
    return true;
  }

  /// [B, T] int64 offset of each column in its row's new tokens (negative: a pad).
  at::Tensor offsets(const Core& c, int64_t layer, const int64_t* counts, int64_t T) {
    std::vector<int64_t> start(static_cast<size_t>(c.batch_size()));
    for (int64_t b = 0; b < c.batch_size(); ++b) start[b] = T - counts[b];
    return iota(c, T).sub(scratch_[layer].start.get(start, c.device, {c.batch_size(), 1}));
  }

  /// [1, n] int64 0 .. n - 1 on the device: a view of one tensor made once (and when a longer
  /// one is needed).
  const at::Tensor iota(const Core& c, int64_t n) {
    if (!iota_.defined() || iota_.size(1) < n) {
      iota_ = at::arange(std::max<int64_t>(n, 2 * (iota_.defined() ? iota_.size(1) : 0)),
                         at::TensorOptions().dtype(at::kLong).device(c.device))
                  .unsqueeze(0);
    }
    return iota_.narrow(1, 0, n);
  }

  /// [B, 1] int64 row indices 0 .. B - 1 (made once).
  const at::Tensor& rows_index(const Core& c) {
    if (!rows_.defined()) rows_ = at::arange(c.batch_size(), at::TensorOptions().dtype(at::kLong).device(c.device)).unsqueeze(1);
    return rows_;
  }

  /// A 0-d fp32 zero on the device (made once).
  const at::Tensor& zero(const Core& c) {
    if (!zero_.defined()) zero_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(c.device));
    return zero_;
  }

  /// An offset past any slot (plan()'s mirror of a pass's columns past a row's own n).
  static constexpr int64_t kFar = int64_t{1} << 60;

  /// [B, slots] bool scratch of layer `layer`'s slots (made when its slots change).
  at::Tensor& marks(const Core& c, const LayerState& L, int64_t layer) {
    auto& m = scratch_[layer].marks;
    if (!m.defined() || m.size(1) != L.slots) {
      m = at::zeros({c.batch_size(), L.slots}, at::TensorOptions().dtype(at::kBool).device(c.device));
    }
    return m;
  }

  /// [1] fp32 tensor holding divisor_heads() * 2^32, on the device (see from_fixed()).
  const at::Tensor& heads_divisor(const Core& c) {
    if (!heads_t_.defined()) {
      heads_t_ = at::full({1}, static_cast<float>(c.divisor_heads()) * static_cast<float>(kFixedOne),
                          at::TensorOptions().dtype(at::kFloat).device(c.device));
    }
    return heads_t_;
  }

  /// Whether every query column of Q counts in every row (no pad, no idle row, the scorer
  /// counts all Q).
  static bool all_counted(const Core& c, const LayerState& L, int64_t Q) {
    for (int64_t b = 0; b < c.batch_size(); ++b) {
      if (c.first_counted(L, b, Q) != 0) return false;
    }
    return true;
  }

  /// [B, Qc] bool: the counted columns among [q_begin, q_begin + Qc) of the open observation
  /// (a view of a mirror, uploaded when it changes); undefined when all count.
  at::Tensor counted_mask(const Core& c, const LayerState& L, int64_t layer, int64_t Q, int64_t q_begin, int64_t Qc) {
    if (all_counted(c, L, Q)) return at::Tensor();
    const int64_t B = c.batch_size();
    std::vector<int64_t> mask(static_cast<size_t>(B * Q), 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t q = c.first_counted(L, b, Q); q < Q; ++q) mask[b * Q + q] = 1;
    }
    return scratch_[layer].counted.get(mask, c.device, {B, Q}).narrow(1, q_begin, Qc).gt(0);
  }

  /// [B, S] fp64 fixed-point sums of probs [B, Hc, Qc, S] over heads and the counted columns.
  at::Tensor fixed_sums(const Core& c, const LayerState& L, int64_t layer, const at::Tensor& in, int64_t q_begin) {
    const int64_t B = c.batch_size(), Qc = in.size(2);
    auto term = fixed_terms(in);  // [B, Hc, Qc, S] fp32 integers
    const auto counted = counted_mask(c, L, layer, L.open_q, q_begin, Qc);
    if (counted.defined()) term.masked_fill_(counted.logical_not().view({B, 1, Qc, 1}), 0.0);
    return term.sum({1, 2}, /*keepdim=*/false, at::kDouble);
  }

  /// Checks probs [B, Hc, Qc, S] (checks on; syncs at the end of the observation): in [0, 1]
  /// and causal on the live slots of the counted columns. Records the verdict in open_bad, and
  /// where the piece's first bad value is in open_checks (no sync).
  void check_probs(const Core& c, const LayerState& L, int64_t layer, const at::Tensor& in, int64_t q_begin,
                   int64_t h_begin) {
    auto& D = scratch_[layer];
    const int64_t B = c.batch_size(), Q = L.open_q, Qc = in.size(2), S = max_of(L.len);
    const auto pos = L.position.narrow(1, 0, S);
    const auto live = pos.ge(0);
    auto counted = counted_mask(c, L, layer, Q, q_begin, Qc);
    if (!counted.defined()) counted = at::ones({B, Qc}, live.options());
    const auto qpos = D.counters.narrow(1, 1, 1).sub(Q).add(iota(c, Qc).add(q_begin));  // [B, Qc]
    const auto x = in.to(at::kFloat);
    const auto real = counted.view({B, 1, Qc, 1}).logical_and(live.view({B, 1, 1, S}));
    const auto out_of_range = x.lt(0).logical_or(x.gt(1)).logical_or(x.isnan());
    const auto future = pos.view({B, 1, 1, S}).gt(qpos.view({B, 1, Qc, 1})).logical_and(x.ne(0));
    const auto flat = out_of_range.logical_or(future).logical_and(real).reshape({-1});  // [b, h, q, s] order
    const auto bad = flat.any();
    D.open_bad = D.open_bad.defined() ? D.open_bad.logical_or(bad) : bad;
    const auto first = flat.to(at::kByte).argmax().view({1});  // the first bad value (0 if none)
    const auto value = x.reshape({-1}).index_select(0, first).to(at::kDouble);
    D.open_checks.push_back({q_begin, h_begin, x.size(1), Qc, S,
                             at::cat({bad.to(at::kDouble).view({1}), first.to(at::kDouble), value})});
  }

  /// Checks on: if `bad` ([] bool on the device; undefined: none) says a piece of the open
  /// observation held a bad probability, throws naming the first one (pieces in the order they
  /// came, each in [b, h, q, s] order) as the host path does. One host sync; a few more on failure.
  void check_pieces(const LayerState& L, int64_t layer, const at::Tensor& bad) const {
    if (!bad.defined() || !bad.template item<bool>()) return;
    for (const auto& p : scratch_[layer].open_checks) {
      const auto f = p.first.to(at::kCPU);
      const double* d = f.template data_ptr<double>();
      if (d[0] == 0) continue;
      const auto i = static_cast<int64_t>(d[1]);
      const int64_t s = i % p.S, q = i / p.S % p.Qc, h = i / (p.S * p.Qc) % p.Hc, b = i / (p.S * p.Qc * p.Hc);
      fail_probability(static_cast<float>(d[2]), L.position[b][s].template item<int64_t>(),
                       L.seen[b] - L.open_q + p.q_begin + q, b, p.h_begin + h, p.q_begin + q, s);
    }
    TORCH_INTERNAL_ASSERT(false, "kvevict: a bad probability was flagged but not found");
  }

  /// [B, S] bool: live slots of the rows whose `flags` are set; undefined when every row is set
  /// (then dead slots may take the update too: an append resets their state).
  at::Tensor keep_mask(const Core& c, const LayerState& L, int64_t layer, const std::vector<uint8_t>& flags) {
    const int64_t B = c.batch_size(), S = max_of(L.len);
    bool all = true;
    for (int64_t b = 0; b < B; ++b) all = all && flags[b];
    if (all && !c.check && !c.options.lazy_reduction()) return at::Tensor();
    std::vector<int64_t> f(flags.begin(), flags.end());
    return scratch_[layer].rows.get(f, c.device, {B, 1}).gt(0).logical_and(L.position.narrow(1, 0, S).ge(0));
  }

  /// Applies an observation's fp64 sums [B, S]: the reducer, contributions, observers, then the
  /// scorer (or pending, with lazy_reduction).
  void apply_observation(const Core& c, LayerState& L, int64_t layer, at::Tensor sum, const at::Tensor& bad) {
    const int64_t B = c.batch_size(), Q = L.open_q, S = max_of(L.len);
    if (c.options.reduce_contributions() && !c.options.lazy_reduction()) c.options.reduce_contributions()(layer, sum);
    // Rows with no real query contribute nothing, and a scorer that replaces (LatestAttention)
    // must not see them at all.
    std::vector<uint8_t> observed(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) observed[b] = c.first_real(L, b, Q) < Q ? 1 : 0;
    const auto keep = keep_mask(c, L, layer, observed);
    at::Tensor observers;
    if (UsesObservers<Scorer>::value || c.options.lazy_reduction()) {
      const int64_t q0 = Q - counted_queries(c.scorer, Q);  // counted columns [q0, Q) (pads: not counted)
      const auto pos = L.position.narrow(1, 0, S);
      const auto qpos = query_positions(c, L, layer, Q).narrow(1, q0, Q - q0);  // [B, Qn], -1 pads
      observers = qpos.unsqueeze(1).ge(pos.unsqueeze(2)).sum(2).to(at::kFloat);  // [B, S]
    }
    if (c.options.lazy_reduction()) {
      defer(c, L, layer, sum, observers, keep, bad);
      return;
    }
    apply(c, L, layer, S, from_fixed(sum, heads_divisor(c)), observers, keep, bad);
  }

  /// Checks the open observation's probabilities (checks on), then adds its sums [B, S] fp64 and
  /// observers [B, S] fp32 to pending where `keep` [B, S].
  void defer(const Core& c, LayerState& L, int64_t layer, const at::Tensor& sum, const at::Tensor& observers,
             const at::Tensor& keep, const at::Tensor& bad) {
    if (c.check) check_pieces(L, layer, bad);
    const int64_t terms = c.observation_terms(L.open_q);
    if (L.pending_terms > 0 && L.pending_terms + terms > kMaxPendingTerms) {
      flush(c, L, layer);
      L.pending_terms = 0;
    }
    const auto pend = L.pending.narrow(1, 0, keep.size(1));
    const auto zero = at::zeros({}, pend.options());
    pend.select(2, 0).add_(at::where(keep, sum, zero));
    pend.select(2, 1).add_(at::where(keep, observers.to(at::kDouble), zero));
    L.pending_terms += terms;
  }

  /// Applies contribution/observers [B, S] to the slots `keep` [B, S] (all when undefined); with
  /// checks, computes the next state apart and throws (changing nothing) if `bad` or any next
  /// rank is non-finite.
  void apply(const Core& c, LayerState& L, int64_t layer, int64_t S, const at::Tensor& contribution,
             const at::Tensor& observers, const at::Tensor& keep, const at::Tensor& bad) {
    const auto state = L.state.narrow(1, 0, S);
    if (!keep.defined()) {  // every row, checks off: in place
      c.scorer.apply(state, contribution, observers);
      return;
    }
    const auto next = state.clone();
    c.scorer.apply(next, contribution, observers);
    const auto merged = at::where(keep.unsqueeze(2), next, state);
    if (c.check) {
      const auto rank = c.scorer.rank(merged);
      const auto fail = at::isfinite(rank).logical_not().logical_and(keep);
      const auto any = fail.any();
      check_pieces(L, layer, bad);
      if (any.template item<bool>()) {  // name the first such slot, as the host path does
        const auto where = fail.nonzero();  // [n, 2] (row, slot), row-major
        const int64_t b = where[0][0].template item<int64_t>(), s = where[0][1].template item<int64_t>();
        check_rank(rank[b][s].template item<float>(), b, s, contribution[b][s].template item<float>());
      }
    }
    state.copy_(merged);
  }

  std::vector<Scratch> scratch_;  // per layer
  at::Tensor iota_, rows_, zero_, heads_t_;
};

}  // namespace detail
}  // namespace kvevict
