#pragma once
// Pinned host memory seen from the device: the tensor path's tier keeps its rows in host memory
// and device kernels gather and scatter them through this view (TierStore, tier/store.hpp).

#include <kvevict/check.hpp>

#include <ATen/ATen.h>

namespace kvevict {
namespace detail {

/// A view on `device` of host tensor `host`, pinned when `device` is a CUDA device: device
/// kernels read and write the host memory through it, over the bus, with no copy. Under CUDA's
/// unified addressing (every 64-bit platform CUDA supports) a pinned block's host address is
/// its device address, as cudaHostGetDevicePointer() returns it (vLLM's
/// get_cuda_view_from_cpu_tensor makes the same view). On the CPU: `host` itself. The view keeps
/// `host` alive. Allocates a TensorImpl; no sync.
/// \throws c10::Error when `device` is not the CPU and `host` is not pinned.
inline at::Tensor device_view(const at::Tensor& host, const at::Device& device) {
  if (device.is_cpu()) return host;
  KVEVICT_CHECK(host.is_pinned(), "device_view: the host tensor must be pinned to be seen from ", device);
  const auto keep = host;
  return at::for_blob(host.data_ptr(), host.sizes())
      .strides(host.strides())
      .deleter([keep](void*) {})
      .target_device(device)
      .options(host.options().device(device))
      .make_tensor();
}

}  // namespace detail
}  // namespace kvevict
