#pragma once
// The eviction state of one layer, backend-neutral, and the configuration every path reads.
// The host path (host_path.hpp) and the tensor path (tensor_path.hpp) keep their own scratch
// next to it; EvictionPolicy (eviction_policy.hpp) owns both.

#include <kvevict/detail/reduction.hpp>
#include <kvevict/options.hpp>
#include <kvevict/selection.hpp>

#include <kvevict/check.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvevict {
namespace detail {

/// One layer: positions and scorer state per slot, and the host's counters per row.
struct LayerState {
  int64_t slots = 0;
  at::Tensor position;  // [B, slots] int64 original positions, -1 in dead slots
  at::Tensor state;     // [B, slots, W] fp32 scorer state
  // lazy_reduction: [B, slots, 2] fp64 this process's fixed-point sums and observer counts not
  // yet reduced and applied (0 in dead slots), and the fixed-point terms per slot they add up
  // since the last flush (kept <= kMaxPendingTerms, so the sums stay exact integers).
  at::Tensor pending;
  int64_t pending_terms = 0;
  std::vector<int64_t> len, seen, last_new;  // [B] live tokens, tokens ever appended, latest append
  std::vector<int64_t> appends;              // [B] appends with tokens since the row's last pass
  int64_t last_T = 0, events = 0, evicted = 0;
  int64_t open_q = 0;             // an open observation's Q (0: none)
  std::vector<bool> open_cover;   // observe_begin(): [H, Q], the (head, query column) cells added
};

inline int64_t max_of(const std::vector<int64_t>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

/// What every path reads: the options, the scorer, the device, the rows' lifecycle.
template <class Scorer>
struct PolicyCore {
  static constexpr int64_t W = Scorer::kStateWidth;

  EvictionPolicyOptions options;
  EvictionOptions eviction;
  std::vector<EvictionOptions> layer_eviction;  // per layer: its budget
  std::vector<Selection> selections;            // per layer
  Scorer scorer;
  at::Device device;
  bool check;
  std::vector<uint8_t> active;  // [B] 1 while the row holds a sequence

  int64_t batch_size() const noexcept { return options.batch_size(); }
  int64_t num_heads() const noexcept { return options.num_heads(); }
  /// The divisor H of the contributions: total_heads, or num_heads when unset.
  int64_t divisor_heads() const noexcept {
    return options.total_heads() > 0 ? options.total_heads() : options.num_heads();
  }
  /// Terms per slot of an observation of Q columns: counted queries x heads of all processes.
  /// The same on every process, so every process flushes early at the same observation.
  int64_t observation_terms(int64_t Q) const { return counted_queries(scorer, Q) * divisor_heads(); }

  /// Whether row b of `L` is over `capacity` and has appended in evict_every appends since its
  /// last pass.
  bool row_due(const LayerState& L, int64_t b, int64_t capacity) const {
    return L.len[b] > capacity && L.appends[b] >= eviction.evict_every();
  }

  /// The first real column of Q query columns in row b (right-aligned: column q is position
  /// seen - Q + q). A row that appended fewer tokens than the newest chunk's T has pads before
  /// its tokens; a row that appended the whole chunk treats every column at a position >= 0 as
  /// real (so Q may reach back past the chunk); a free row has none.
  int64_t first_real(const LayerState& L, int64_t b, int64_t Q) const {
    if (!active[b]) return Q;
    if (L.last_new[b] < L.last_T) return Q - std::min(Q, L.last_new[b]);
    return std::max<int64_t>(0, Q - L.seen[b]);
  }

  /// The first query column (of Q) that the scorer counts in row b: its first real one, or
  /// later for a scorer that counts only the newest (counted_queries); Q if none.
  int64_t first_counted(const LayerState& L, int64_t b, int64_t Q) const {
    const int64_t first = first_real(L, b, Q);
    return first >= Q ? Q : std::max(first, Q - counted_queries(scorer, Q));
  }
};

/// The device `device` names, resolved ("cuda" becomes "cuda:N", "cpu:0" becomes "cpu").
/// \throws c10::Error naming the device if it is not usable here.
inline at::Device resolved_device(const at::Device& device) {
  try {
    return at::empty({0}, at::TensorOptions().device(device)).device();
  } catch (const c10::Error& e) {
    KVEVICT_CHECK(false, "options: device ", device, " is not usable here (", e.what_without_backtrace(), ")");
  }
  return device;  // not reached
}

/// Allocates L's tensors with `slots` slots, all dead; outside InferenceMode, so the state
/// stays usable whatever mode later calls run in.
template <class Scorer>
void allocate_layer(const PolicyCore<Scorer>& c, LayerState& L, int64_t slots) {
  c10::InferenceMode normal_tensors(false);
  at::NoGradGuard no_grad;
  const int64_t B = c.batch_size();
  const auto opts = at::TensorOptions().device(c.device);
  L.position = at::full({B, slots}, -1, opts.dtype(at::kLong));
  L.state = at::zeros({B, slots, Scorer::kStateWidth}, opts.dtype(at::kFloat));
  if (c.options.lazy_reduction()) L.pending = at::zeros({B, slots, 2}, opts.dtype(at::kDouble));
  L.slots = slots;
}

/// A copy of L's tensors with `slots` slots per row, its tokens kept (allocates; changes
/// nothing; the host counters are not copied).
template <class Scorer>
LayerState resized_layer(const PolicyCore<Scorer>& c, const LayerState& L, int64_t slots) {
  LayerState N;
  allocate_layer(c, N, slots);
  const int64_t S = max_of(L.len);
  if (S > 0) {
    c10::InferenceMode normal_tensors(false);
    N.position.narrow(1, 0, S).copy_(L.position.narrow(1, 0, S));
    N.state.narrow(1, 0, S).copy_(L.state.narrow(1, 0, S));
    if (L.pending.defined()) N.pending.narrow(1, 0, S).copy_(L.pending.narrow(1, 0, S));
  }
  return N;
}

}  // namespace detail
}  // namespace kvevict
