#pragma once
// Which form of the tier's ops runs (detail/tier/ops/ops.hpp): compiled kernels, registered as
// PyTorch custom operators in the namespace `kvevict` by the kvevict::kernels CMake target or
// the Python extension, or the ATen reference forms a header-only build has. Both give the same
// results, bit for bit; the kernels make one call where the reference makes tens.

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceType.h>

#include <atomic>

namespace kvevict {
namespace detail {

/// The on/off switch of the compiled kernels (default on).
inline std::atomic<bool>& kernels_switch() {
  static std::atomic<bool> on{true};
  return on;
}

/// One compiled op by its name ("kvevict::pick_pages"), looked up once (at the first call: a
/// kernel library loaded after it is not seen).
class CompiledOp {
 public:
  explicit CompiledOp(const char* name) : handle_(c10::Dispatcher::singleton().findSchema({name, ""})) {}
  /// Registered with a kernel for devices of `type`.
  bool registered_for(c10::DeviceType type) const {
    if (!handle_) return false;
    if (type == c10::DeviceType::CPU) return handle_->hasKernelForDispatchKey(c10::DispatchKey::CPU);
    if (type == c10::DeviceType::CUDA) return handle_->hasKernelForDispatchKey(c10::DispatchKey::CUDA);
    return false;
  }
  /// registered_for(type), and the kernels are switched on.
  bool runs_on(c10::DeviceType type) const { return kernels_switch().load(std::memory_order_relaxed) && registered_for(type); }
  const c10::OperatorHandle& handle() const { return *handle_; }

 private:
  c10::optional<c10::OperatorHandle> handle_;
};

}  // namespace detail

/// Whether compiled kernels for the tier's ops are registered for devices of type `device`
/// (c10::DeviceType::CPU or CUDA): the program links kvevict::kernels, or is kvevict's Python
/// extension (`kvevict.kernels_available("cpu")`). Where they are not, the ATen reference
/// forms run, with the same results. Reads the dispatcher; does not throw.
inline bool kernels_available(c10::DeviceType device) {
  return detail::CompiledOp("kvevict::pick_pages").registered_for(device);
}

/// Switches the compiled kernels on (the default) or off for the whole process: off, the
/// reference forms run even where kernels are registered (for tests and benchmarks that
/// compare the two). Thread-safe; takes effect at the next op.
inline void set_kernels_enabled(bool enabled) { detail::kernels_switch().store(enabled); }
/// Whether the compiled kernels are switched on.
inline bool kernels_enabled() { return detail::kernels_switch().load(); }

}  // namespace kvevict
