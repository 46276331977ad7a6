#pragma once
// The host path of EvictionPolicy: the state lives in CPU tensors and every step is a plain
// loop over it, with no allocation in the steady state. Its twin, tensor_path.hpp, has the same
// steps under the same names in the same order; both keep the same tokens, bit for bit
// (docs/DESIGN.md, contract rule 5).

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/checks.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/policy/slot_plan.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/selection.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvevict {
namespace detail {

template <class Scorer>
class HostPath {
 public:
  using Core = PolicyCore<Scorer>;
  static constexpr int64_t W = Scorer::kStateWidth;

  /// Per-layer scratch, sized for the layer's slots.
  struct Scratch {
    std::vector<double> fixed;            // [B, slots] fixed-point sums
    std::vector<double> reduced;          // [B, slots] lazy_reduction: pending sums being reduced
    std::vector<float> rank;              // [slots]
    std::vector<Candidate> candidates;
    std::vector<int64_t> evicted;         // [slots]
    std::vector<uint8_t> tail_flags;      // [slots]
  };

  /// Scratch for `slots` slots per row (allocates; changes nothing).
  Scratch resized(const Core& c, int64_t /*layer*/, int64_t slots) const {
    Scratch H;
    const int64_t B = c.batch_size();
    H.fixed.resize(static_cast<size_t>(B * slots));
    if (c.options.lazy_reduction()) H.reduced.resize(static_cast<size_t>(B * slots));
    H.rank.resize(slots);
    H.candidates.reserve(slots);
    H.evicted.resize(slots);
    H.tail_flags.resize(slots);
    return H;
  }

  /// Makes room for the scratch of `layers` layers (allocates: before any swap_in()).
  void size_layers(int64_t layers) { scratch_.resize(static_cast<size_t>(layers)); }

  /// Takes `H` (from resized()) as the scratch of `layer`, which size_layers() made room for.
  /// Allocates nothing, does not throw.
  void swap_in(int64_t layer, Scratch& H) noexcept { std::swap(scratch_[static_cast<size_t>(layer)], H); }

  /// Empties `row` of `L` (positions -1, pending sums 0).
  void clear_row(const Core& /*c*/, LayerState& L, int64_t /*layer*/, int64_t row) {
    auto* p = L.position.template data_ptr<int64_t>() + row * L.slots;
    std::fill(p, p + L.slots, int64_t{-1});
    if (L.pending.defined()) {
      auto* q = L.pending.template data_ptr<double>() + row * L.slots * 2;
      std::fill(q, q + L.slots * 2, 0.0);
    }
  }

  /// Recall's exchange: slot slots[b, k] of row b (the trash slot where a row has fewer) takes
  /// the token at positions[b, k] with scorer state states[b, k] ([B, V] int64, [B, V] int64,
  /// [B, V, W] fp32, CPU, contiguous). Allocates nothing, does not throw.
  void exchange(const Core& /*c*/, LayerState& L, int64_t /*layer*/, const at::Tensor& slots, const at::Tensor& positions,
                const at::Tensor& states) {
    const int64_t B = slots.size(0), V = slots.size(1);
    const auto* s = slots.template data_ptr<int64_t>();
    const auto* p = positions.template data_ptr<int64_t>();
    const auto* st = states.template data_ptr<float>();
    auto* pos = L.position.template data_ptr<int64_t>();
    auto* state = L.state.template data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < V; ++k) {
        const int64_t slot = s[b * V + k];
        pos[b * L.slots + slot] = p[b * V + k];
        std::copy(st + (b * V + k) * W, st + (b * V + k + 1) * W, state + (b * L.slots + slot) * W);
      }
    }
  }

  /// The state of the new tokens (before the host counters advance): positions seen.., state 0.
  void append(const Core& c, LayerState& L, int64_t /*layer*/, const int64_t* counts, int64_t /*T*/) {
    auto* pos = L.position.template data_ptr<int64_t>();
    auto* st = L.state.template data_ptr<float>();
    for (int64_t b = 0; b < c.batch_size(); ++b) {
      for (int64_t j = 0; j < counts[b]; ++j) {
        const int64_t slot = b * L.slots + L.len[b] + j;
        pos[slot] = L.seen[b] + j;
        std::fill(st + slot * W, st + (slot + 1) * W, 0.f);
      }
    }
  }

  /// [B, Q] int64 query positions (see EvictionPolicy::query_positions), a CPU tensor.
  at::Tensor query_positions(const Core& c, const LayerState& L, int64_t /*layer*/, int64_t Q) const {
    auto t = at::empty({c.batch_size(), Q}, at::TensorOptions().dtype(at::kLong));
    auto* qp = t.template data_ptr<int64_t>();
    for (int64_t b = 0; b < c.batch_size(); ++b) {
      const int64_t first = c.first_real(L, b, Q);
      for (int64_t q = 0; q < Q; ++q) qp[b * Q + q] = q >= first ? L.seen[b] - Q + q : -1;
    }
    return t;
  }

  /// Opens an observation: every row's fixed-point sums at 0.
  void begin_observation(const Core& c, LayerState& L, int64_t layer, int64_t /*Q*/) {
    auto& fixed = scratch_[layer].fixed;
    std::fill(fixed.begin(), fixed.begin() + c.batch_size() * L.slots, 0.0);
  }

  /// Per active row, the fixed-point sums over the piece's heads and counted queries (checking
  /// the probabilities on the way).
  void add_observation(const Core& c, LayerState& L, int64_t layer, const at::Tensor& in, int64_t q_begin,
                       int64_t h_begin) {
    const bool as_is = in.scalar_type() == at::kFloat && in.is_contiguous();  // skips a dispatch
    const auto x = as_is ? in : in.to(at::kFloat).contiguous();
    const float* p = x.template data_ptr<float>();
    const int64_t B = c.batch_size(), Hc = x.size(1), Qc = x.size(2), S = x.size(3), Q = L.open_q;
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    auto& HS = scratch_[layer];
    for (int64_t b = 0; b < B; ++b) {
      const int64_t q0 = c.first_counted(L, b, Q);  // counted queries: columns [q0, Q)
      if (q0 >= Q) continue;
      const int64_t len = L.len[b], seen = L.seen[b];
      double* fx = HS.fixed.data() + b * L.slots;
      const int64_t* pb = pos + b * L.slots;
      for (int64_t h = 0; h < Hc; ++h) {
        for (int64_t q = std::max<int64_t>(q0 - q_begin, 0); q < Qc; ++q) {
          const float* row = p + ((b * Hc + h) * Qc + q) * S;
          const int64_t query_pos = seen - Q + q_begin + q;
          const bool in_range = add_fixed_row(row, fx, len);
          // Causality needs a look only where some key could be newer than the query (inside a
          // multi-token append); the message comes from the scalar check.
          if (c.check && (!in_range || query_pos < seen - 1)) {
            check_row_probs(row, pb, len, query_pos, b, h_begin + h, q_begin + q);
          }
        }
      }
    }
  }

  /// The reducer, then the observer counts, the rank check and the scorer's update (or, with
  /// lazy_reduction, the sums into pending).
  void end_observation(const Core& c, LayerState& L, int64_t layer) {
    if (c.options.lazy_reduction()) {
      defer(c, L, layer);
      return;
    }
    const int64_t B = c.batch_size(), Q = L.open_q;
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    float* st = L.state.template data_ptr<float>();
    auto& HS = scratch_[layer];
    if (c.options.reduce_contributions()) {
      auto sums = at::from_blob(HS.fixed.data(), {B, L.slots}, at::TensorOptions().dtype(at::kDouble));
      c.options.reduce_contributions()(layer, sums);
    }
    const float heads = static_cast<float>(c.divisor_heads());
    // Two rounds: check every row first (nothing changes on a throw), then apply.
    for (int round = c.check ? 0 : 1; round < 2; ++round) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t q0 = c.first_counted(L, b, Q);
        if (q0 >= Q) continue;
        const int64_t len = L.len[b], seen = L.seen[b];
        const int64_t* pb = pos + b * L.slots;
        const double* fx = HS.fixed.data() + b * L.slots;
        float* sb = st + b * L.slots * W;
        const int64_t first_q_pos = seen - Q + q0;  // counted queries: positions first_q_pos .. seen - 1
        for (int64_t s = 0; s < len; ++s) {
          const float c_s = from_fixed(fx[s], heads);
          apply_token(c, sb + s * W, c_s, observers(pb[s], first_q_pos, seen, Q - q0), /*check_only=*/round == 0, b, s);
        }
      }
    }
  }

  /// observe(probs) in one piece: begin + add + end.
  void observe(const Core& c, LayerState& L, int64_t layer, const at::Tensor& probs) {
    begin_observation(c, L, layer, L.open_q);
    add_observation(c, L, layer, probs, 0, 0);
    end_observation(c, L, layer);
  }

  /// The caller's scores [B, S] as one observation with one observer.
  void add_scores(const Core& c, LayerState& L, int64_t /*layer*/, const at::Tensor& in) {
    const bool as_is = in.scalar_type() == at::kFloat && in.is_contiguous();
    const auto x = as_is ? in : in.to(at::kFloat).contiguous();
    const float* p = x.template data_ptr<float>();
    const int64_t S = x.size(1);
    float* st = L.state.template data_ptr<float>();
    for (int round = c.check ? 0 : 1; round < 2; ++round) {
      for (int64_t b = 0; b < c.batch_size(); ++b) {
        if (!c.active[b]) continue;
        float* sb = st + b * L.slots * W;
        for (int64_t s = 0; s < L.len[b]; ++s) {
          apply_token(c, sb + s * W, p[b * S + s], 1.f, /*check_only=*/round == 0, b, s);
        }
      }
    }
  }

  /// lazy_reduction: reduces the pending sums once and applies them, with the pending observer
  /// counts, to every live slot of every active row as one observation; then zeroes them.
  /// Throws before changing anything (the reduction runs on a copy).
  void flush(const Core& c, LayerState& L, int64_t layer) {
    const int64_t B = c.batch_size();
    auto& HS = scratch_[layer];
    double* pd = L.pending.template data_ptr<double>();
    for (int64_t i = 0; i < B * L.slots; ++i) HS.reduced[i] = pd[2 * i];
    if (c.options.reduce_contributions()) {
      auto sums = at::from_blob(HS.reduced.data(), {B, L.slots}, at::TensorOptions().dtype(at::kDouble));
      c.options.reduce_contributions()(layer, sums);
    }
    const float heads = static_cast<float>(c.divisor_heads());
    float* st = L.state.template data_ptr<float>();
    for (int round = c.check ? 0 : 1; round < 2; ++round) {  // check every row first, then apply
      for (int64_t b = 0; b < B; ++b) {
        if (!c.active[b]) continue;
        float* sb = st + b * L.slots * W;
        for (int64_t s = 0; s < L.len[b]; ++s) {
          const float c_s = from_fixed(HS.reduced[b * L.slots + s], heads);
          const auto obs = static_cast<float>(pd[2 * (b * L.slots + s) + 1]);
          apply_token(c, sb + s * W, c_s, obs, /*check_only=*/round == 0, b, s);
        }
      }
    }
    std::fill(pd, pd + B * L.slots * 2, 0.0);
  }

  /// Plans a pass (pass.n and new_len set by the caller): per row over capacity, select
  /// (Selection::evict_slots_row, trusted), then pair the freed slots below the new length with
  /// the kept tail slots.
  void plan(const Core& c, LayerState& L, int64_t layer, Pass& pass) {
    const int64_t B = c.batch_size();
    int64_t columns = 0;
    for (int64_t b = 0; b < B; ++b) columns = std::max(columns, pass.n[b]);
    pass.columns = columns;
    pass.src.assign(static_cast<size_t>(B * columns), 0);
    pass.dst.assign(static_cast<size_t>(B * columns), 0);
    pass.evicted.assign(static_cast<size_t>(B * columns), 0);
    if (columns == 0) return;
    auto& HS = scratch_[layer];
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    const float* st = L.state.template data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      if (pass.n[b] == 0) continue;
      const int64_t len = L.len[b];
      const float* sb = st + b * L.slots * W;
      const float* rank = sb;
      if (!(W == 1 && RankIsState<Scorer>::value)) {
        for (int64_t s = 0; s < len; ++s) HS.rank[s] = c.scorer.rank(sb + s * W);
        rank = HS.rank.data();
      }
      c.selections[layer].evict_slots_row(rank, pos + b * L.slots, len, L.seen[b], HS.evicted.data(), HS.candidates,
                                          TrustedPositions{});
      fill_moves_host(pass, b, HS.evicted.data(), pass.n[b], HS.tail_flags);
    }
    pad_moves(pass);
  }

  /// Moves the state rows (and pending sums) of a pass and marks the freed tail dead; L.len
  /// still holds the lengths before it. Does not throw.
  void commit(const Core& c, LayerState& L, int64_t /*layer*/, Pass& pass) {
    const int64_t B = c.batch_size();
    if (pass.columns > 0) {
      apply_moves_host(pass.src.data(), pass.dst.data(), B, pass.columns, pass.columns, L.position, 1);
      apply_moves_host(pass.src.data(), pass.dst.data(), B, pass.columns, pass.columns, L.state, 1);
      if (L.pending_terms > 0) {
        apply_moves_host(pass.src.data(), pass.dst.data(), B, pass.columns, pass.columns, L.pending, 1);
      }
    }
    auto* pos = L.position.template data_ptr<int64_t>();
    double* pd = L.pending_terms > 0 ? L.pending.template data_ptr<double>() : nullptr;
    for (int64_t b = 0; b < B; ++b) {
      std::fill(pos + b * L.slots + pass.new_len[b], pos + b * L.slots + L.len[b], int64_t{-1});
      if (pd) std::fill(pd + (b * L.slots + pass.new_len[b]) * 2, pd + (b * L.slots + L.len[b]) * 2, 0.0);
    }
  }

 private:
  /// Observers of the token at position `p`: counted queries (positions first_q_pos .. seen - 1,
  /// `counted` of them) at or after it.
  static float observers(int64_t p, int64_t first_q_pos, int64_t seen, int64_t counted) {
    return static_cast<float>(std::max<int64_t>(std::min<int64_t>(seen - std::max(p, first_q_pos), counted), 0));
  }

  /// lazy_reduction: adds the open observation's sums and observer counts to pending.
  void defer(const Core& c, LayerState& L, int64_t layer) {
    const int64_t Q = L.open_q, terms = c.observation_terms(Q);
    if (L.pending_terms > 0 && L.pending_terms + terms > kMaxPendingTerms) {
      flush(c, L, layer);
      L.pending_terms = 0;
    }
    const int64_t* pos = L.position.template data_ptr<int64_t>();
    double* pd = L.pending.template data_ptr<double>();
    const auto& fixed = scratch_[layer].fixed;
    for (int64_t b = 0; b < c.batch_size(); ++b) {
      const int64_t q0 = c.first_counted(L, b, Q);
      if (q0 >= Q) continue;
      const int64_t len = L.len[b], seen = L.seen[b], first_q_pos = seen - Q + q0;
      const int64_t* pb = pos + b * L.slots;
      const double* fx = fixed.data() + b * L.slots;
      double* pe = pd + b * L.slots * 2;
      for (int64_t s = 0; s < len; ++s) {
        pe[2 * s] += fx[s];
        pe[2 * s + 1] += static_cast<double>(observers(pb[s], first_q_pos, seen, Q - q0));
      }
    }
    L.pending_terms += terms;
  }

  static void check_row_probs(const float* row, const int64_t* pos, int64_t len, int64_t query_pos, int64_t b,
                              int64_t h, int64_t q) {
    for (int64_t s = 0; s < len; ++s) {
      const float v = row[s];
      if (!(v >= 0.f && v <= 1.f) || (v != 0.f && pos[s] > query_pos)) fail_probability(v, pos[s], query_pos, b, h, q, s);
    }
  }

  /// One token's observation: with `check_only`, applies it to a copy of the state and checks
  /// the resulting rank (throws, changing nothing); else applies it in place.
  static void apply_token(const Core& c, float* state, float contribution, float observers, bool check_only,
                          int64_t b, int64_t s) {
    if (!check_only) {
      c.scorer.apply(state, contribution, observers);
      return;
    }
    float next[W];
    std::copy(state, state + W, next);
    c.scorer.apply(next, contribution, observers);
    check_rank(c.scorer.rank(next), b, s, contribution);
  }

  std::vector<Scratch> scratch_;  // per layer
};

}  // namespace detail
}  // namespace kvevict
