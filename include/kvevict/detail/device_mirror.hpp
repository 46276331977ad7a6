#pragma once
// DeviceMirror: a host fact the tensor path's kernels read, kept on the device and uploaded
// only when it changes. Both owners use it: the policy's tensor path (policy/tensor_path.hpp)
// and the tier's (tier/tensor_path.hpp).

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// A host vector mirrored on a device: uploaded only when its values change, so a steady-state
/// step (same values every time) makes no copy and keeps the same device tensor (CUDA graphs).
struct DeviceMirror {
  std::vector<int64_t> host;
  at::Tensor device;
  const at::Tensor& get(const std::vector<int64_t>& values, const at::Device& dev, at::IntArrayRef shape,
                        at::ScalarType dtype = at::kLong) {
    if (!device.defined() || values != host || device.sizes() != shape || device.scalar_type() != dtype) {
      // A copy even to the CPU, so that an op counter sees every upload (aten::to with a device).
      auto t = at::tensor(values, at::TensorOptions().dtype(at::kLong)).view(shape).to(dev, dtype, false, /*copy=*/true);
      host = values;  // after the copy: a throw above leaves the mirror as it was
      device = std::move(t);
    }
    return device;
  }
};

}  // namespace detail
}  // namespace kvevict
