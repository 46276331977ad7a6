#pragma once
// The host tier's tensor path (CUDA, and CPU in tests): how a pass's evicted tokens reach the
// host without a sync (gathered on the device, copied to pinned host memory asynchronously,
// taken into the tier at its next use: LayerTier::settle()), and how recall swaps tokens with
// slots that live on the device. The host tier itself, and its host path, are host_tier.hpp.

#include <kvevict/detail/layer_state.hpp>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

namespace kvevict {
namespace detail {

/// A copy of `t` in host memory: `t` itself (contiguous) on the CPU; from another device, a
/// pinned host tensor filled by an asynchronous copy on the current stream (complete once an
/// event recorded after it has been reached).
inline at::Tensor to_host_async(const at::Tensor& t) {
  if (t.is_cpu()) return t.contiguous();
  auto h = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  h.copy_(t, /*non_blocking=*/true);
  return h;
}

/// A tensor-path pass's evicted tokens on their way to the tier (LayerTier::hold()): row b's
/// first n[b] columns of `position` [B, C] int64, `state` [B, C, W] fp32 and, per buffer,
/// `rows` [B, outer..., C, inner] (host tensors, contiguous), in the order the host path takes
/// them (ascending slots). `done`: on CUDA, recorded on the stream after the copies.
struct HandOver {
  std::vector<int64_t> n;
  at::Tensor position, state;
  std::vector<at::Tensor> rows;
  std::unique_ptr<c10::Event> done;

  bool held() const noexcept { return position.defined(); }
  /// Records `done` after the copies enqueued so far on `device`'s current stream (not on the CPU).
  void record(const at::Device& device) {
    if (device.is_cpu()) return;
    done = std::make_unique<c10::Event>(device.type());
    done->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  /// Waits until the copies are complete (a host wait on CUDA; nothing on the CPU).
  void wait() const {
    if (!done) return;
    while (!done->query()) std::this_thread::yield();
  }
};

/// Slots `idx` [B, n] as a gather/scatter index of a [B, outer..., slots, inner] buffer's token
/// dim: [B, outer..., n, inner] (a view).
inline at::Tensor token_index(const at::Tensor& idx, const at::Tensor& buf) {
  std::vector<int64_t> shape(static_cast<size_t>(buf.dim()), 1), sizes = buf.sizes().vec();
  shape[0] = idx.size(0);
  shape[buf.dim() - 2] = sizes[buf.dim() - 2] = idx.size(1);
  return idx.view(shape).expand(sizes);
}

/// A tensor-path pass's hand-over: the evicted tokens `idx` [B, C] (each row's first n[b]
/// columns; ascending slots, the order the host path takes them) gathered on the device from
/// `buffers` [B, outer..., slots, inner] and L's positions and states, and copied to host
/// memory without a sync (pinned and asynchronous on CUDA; `done` recorded after the copies).
/// Allocates; changes nothing.
inline HandOver hand_over(const at::Tensor& idx, const std::vector<int64_t>& n, const LayerState& L,
                          const std::vector<at::Tensor>& buffers) {
  HandOver h;
  if (!idx.defined()) return h;
  const int64_t B = idx.size(0), C = idx.size(1), W = L.state.size(2);
  h.n = n;
  h.position = to_host_async(L.position.gather(1, idx));
  h.state = to_host_async(L.state.gather(1, idx.unsqueeze(2).expand({B, C, W})));
  for (const auto& buf : buffers) h.rows.push_back(to_host_async(buf.gather(buf.dim() - 2, token_index(idx, buf))));
  h.record(L.position.device());
  return h;
}

/// LayerTier::recall() on the tensor path: gathers every row's victims (`victims[b]`, padded with the
/// trash slot to the longest row's count V) from `buffers` [B, outer..., slots, inner], L's
/// positions and states into [.., V, ..] device tensors, swaps host copies of them with the
/// tier tokens `picked[b]` (tier.swap(), victim k of row b in column k), and writes them back
/// into the same slots: the device tensors (allocated before the first swap) take the
/// swapped copies, then scatter in place.
template <class Tier, class Rank>
void swap_on_device(Tier& tier, const std::vector<std::vector<int64_t>>& picked, const std::vector<std::vector<int64_t>>& victims,
                    const std::vector<std::vector<float>>& top, LayerState& L, const std::vector<at::Tensor>& buffers,
                    Rank&& rank) {
  const auto B = static_cast<int64_t>(picked.size()), W = L.state.size(2);
  int64_t V = 0;
  for (const auto& p : picked) V = std::max(V, static_cast<int64_t>(p.size()));
  std::vector<int64_t> idx(static_cast<size_t>(B * V), L.slots - 1);  // the trash slot: no token
  for (int64_t b = 0; b < B; ++b) std::copy(victims[b].begin(), victims[b].end(), idx.begin() + b * V);
  const auto device = L.position.device();
  const auto ix = at::tensor(idx, at::TensorOptions().dtype(at::kLong)).view({B, V}).to(device);
  const auto ix_state = ix.unsqueeze(2).expand({B, V, W});
  std::vector<at::Tensor> index, dev, rows;  // per buffer: its index, the victims' rows there and here
  for (const auto& buf : buffers) {
    index.push_back(token_index(ix, buf));
    dev.push_back(buf.gather(buf.dim() - 2, index.back()));
    rows.push_back(dev.back().to(at::kCPU).contiguous());
  }
  auto pos_dev = L.position.gather(1, ix), state_dev = L.state.gather(1, ix_state);
  auto pos = pos_dev.to(at::kCPU).contiguous(), state = state_dev.to(at::kCPU).contiguous();
  std::vector<std::vector<int64_t>> columns(static_cast<size_t>(B));  // victim k of row b: column k
  for (int64_t b = 0; b < B; ++b) {
    columns[b].resize(picked[b].size());
    std::iota(columns[b].begin(), columns[b].end(), int64_t{0});
  }
  for (int64_t b = 0; b < B; ++b) {
    if (!picked[b].empty())
      tier.swap(b, picked[b], columns[b], rows, V, pos.template data_ptr<int64_t>(), state.template data_ptr<float>(),
           top[b].data(), rank);
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    dev[i].copy_(rows[i]);
    buffers[i].scatter_(buffers[i].dim() - 2, index[i], dev[i]);
  }
  pos_dev.copy_(pos);
  state_dev.copy_(state);
  L.position.scatter_(1, ix, pos_dev);
  L.state.scatter_(1, ix_state, state_dev);
}

/// Reduces recall's scores `sums` (fp64, CPU) across processes like observations (core's
/// reduce_contributions, if any), on the cache's device (NCCL reduces only there).
template <class Core>
void reduce_scores(int64_t layer, const Core& core, at::Tensor& sums) {
  const auto& reducer = core.options.reduce_contributions();
  if (!reducer) return;
  if (core.device.is_cpu()) {
    reducer(layer, sums);
    return;
  }
  auto on_device = sums.to(core.device);
  reducer(layer, on_device);
  sums = on_device.to(at::kCPU);
}

}  // namespace detail
}  // namespace kvevict
