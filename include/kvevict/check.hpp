#pragma once
// Argument checks at the public boundary. Caller mistakes throw c10::Error (or the matching
// c10 subclass); our own invariants use TORCH_INTERNAL_ASSERT. Messages name the argument,
// what was expected, then what was got.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <typeinfo>
#include <vector>

/// Throws c10::Error("kvevict: " + message) when `cond` is false.
#define KVEVICT_CHECK(cond, ...) TORCH_CHECK(cond, "kvevict: ", __VA_ARGS__)
/// Throws c10::ValueError (a bad option or value).
#define KVEVICT_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, "kvevict: ", __VA_ARGS__)
/// Throws c10::IndexError (an index out of range, e.g. a layer).
#define KVEVICT_CHECK_INDEX(cond, ...) TORCH_CHECK_INDEX(cond, "kvevict: ", __VA_ARGS__)
/// Throws c10::TypeError (a wrong dtype).
#define KVEVICT_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, "kvevict: ", __VA_ARGS__)

/// Declares an option the way TORCH_ARG does: `name(value)` sets and returns *this,
/// `name()` reads. Like TORCH_ARG it ends in `private:`, so declare methods before it.
#define KVEVICT_ARG(T, name)                                               \
 public:                                                                    \
  inline auto name(const T& new_##name)->decltype(*this) {                 \
    this->name##_ = new_##name;                                            \
    return *this;                                                          \
  }                                                                        \
  inline const T& name() const noexcept { return this->name##_; }          \
                                                                           \
 private:                                                                  \
  T name##_

/// KVEVICT_ARG for an options base class: the setter returns `Derived&` so chains keep the
/// derived type.
#define KVEVICT_ARG_AS(Derived, T, name)                                    \
 public:                                                                    \
  inline Derived& name(const T& new_##name) {                              \
    this->name##_ = new_##name;                                            \
    return static_cast<Derived&>(*this);                                   \
  }                                                                        \
  inline const T& name() const noexcept { return this->name##_; }          \
                                                                           \
 private:                                                                  \
  T name##_

namespace kvevict::detail {

/// "[d0, d1, ...]" with `-1` printed as the given symbol, for messages about expected shapes.
inline std::string shape_str(const std::vector<int64_t>& dims, const std::vector<std::string>& names) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += dims[i] < 0 ? names[i] : std::to_string(dims[i]);
  }
  return s + "]";
}

/// Checks that `t` has shape `expected`, where -1 matches any size; `doc` names the dims
/// ("[B, H, T, qk_dim]"). Message: "<what> must be <doc> = [1, 4, T, 192], got [1, 2, 1, 192]".
inline void check_shape(const at::Tensor& t, const char* what, const std::vector<int64_t>& expected,
                        const std::vector<std::string>& names, const char* doc) {
  KVEVICT_CHECK(t.defined(), what, " must be a defined tensor ", doc);
  bool ok = t.dim() == static_cast<int64_t>(expected.size());
  for (size_t i = 0; ok && i < expected.size(); ++i) ok = expected[i] < 0 || t.size(i) == expected[i];
  KVEVICT_CHECK(ok, what, " must be ", doc, " = ", shape_str(expected, names), ", got ", t.sizes());
}

/// True when `t` is defined and has exactly the sizes `expected` (-1 matches any size). The
/// allocation-free test in front of check_shape(), which builds its message arguments.
inline bool has_shape(const at::Tensor& t, std::initializer_list<int64_t> expected) {
  if (!t.defined() || t.dim() != static_cast<int64_t>(expected.size())) return false;
  int64_t d = 0;
  for (const int64_t e : expected) {
    if (e >= 0 && t.size(d) != e) return false;
    ++d;
  }
  return true;
}

/// Checks that `t` is a defined dense (strided) tensor with storage, on `device`: sparse,
/// MKLDNN and meta tensors get a message naming the argument, not LibTorch's own.
inline void check_tensor(const at::Tensor& t, const char* what, const at::Device& device) {
  KVEVICT_CHECK(t.defined(), what, " must be a defined tensor");
  KVEVICT_CHECK(t.layout() == at::kStrided, what, " must be a dense (strided) tensor, got layout ", t.layout());
  KVEVICT_CHECK(!t.is_meta(), what, " must have data on the device ", device, ", got a meta tensor");
  KVEVICT_CHECK(t.device() == device, what, " must be on the device ", device, ", got ", t.device());
}

/// Runs `allocate()`; an allocation failure of any kind (c10::Error from an allocator,
/// std::bad_alloc, std::length_error) becomes `fail(why)`, which throws a c10::Error naming the
/// sizes asked for.
template <class Allocate, class Fail>
void allocating(Allocate&& allocate, Fail&& fail) {
  try {
    allocate();
  } catch (const c10::Error& e) {
    fail(std::string(e.what_without_backtrace()));
  } catch (const std::bad_alloc& e) {
    fail(std::string(e.what()));
  } catch (const std::length_error& e) {
    fail(std::string(e.what()));
  }
}

/// Set (on this thread) when a TensorUndo (tensor_undo.hpp) could not restore what its commit
/// had written; host_heap() clears it when a call starts and reads it when a host-heap failure
/// escapes, so that a failure to make even the "partly changed" message is not reported as
/// "nothing changed".
inline bool& restore_failed() {
  static thread_local bool failed = false;
  return failed;
}

/// Runs the body `f` of the public call `call` (e.g. "update") and returns what it returns; a
/// host-heap failure that escapes it (std::bad_alloc, std::length_error: a std::vector, a
/// LibTorch TensorImpl or c10::List) becomes the documented c10::Error, "kvevict: <call>: out
/// of host memory (<what>)". A plain c10::Error or c10::IndexError of LibTorch's own from
/// inside the body, after kvevict's checks (its indexing reports a failed host allocation as
/// an IndexError "shape mismatch"), becomes a c10::Error "kvevict: <call>: <its message>". The
/// body keeps its own all-or-nothing guarantee: this only renames the failure. kvevict's own
/// errors, LibTorch's other typed errors and everything else pass through unchanged. When the
/// heap is so exhausted that not even this message can be made, std::bad_alloc escapes.
template <class F>
decltype(auto) host_heap(const char* call, F&& f) {
  restore_failed() = false;
  try {
    return f();
  } catch (const std::bad_alloc& e) {
    KVEVICT_CHECK(!restore_failed(), call, ": out of host memory (", e.what(), "), and restoring what its commit had "
                  "written failed too: the state is partly changed; reset() it");
    KVEVICT_CHECK(false, call, ": out of host memory (", e.what(), ")");
  } catch (const std::length_error& e) {
    KVEVICT_CHECK(false, call, ": out of host memory (", e.what(), ")");
  } catch (const c10::Error& e) {
    // Only the two types that LibTorch's kernels raise for a failed host allocation inside them;
    // typed errors a caller may catch by type (a device's OutOfMemoryError, a collective's
    // DistError, ValueError, ...) keep their type and message.
    if (typeid(e) != typeid(c10::Error) && typeid(e) != typeid(c10::IndexError)) throw;
    const std::string what = e.what_without_backtrace();
    if (what.rfind("kvevict: ", 0) == 0) throw;
    KVEVICT_CHECK(false, call, ": ", what);
  }
  throw;  // not reached
}

/// Checks that `t` lives on `device` (the cache's), naming both devices.
inline void check_device(const at::Tensor& t, const char* what, const at::Device& device) {
  KVEVICT_CHECK(t.device() == device, what, " must be on the cache's device ", device, ", got ",
                t.device());
}

/// Checks that `t` has floating dtype.
inline void check_floating(const at::Tensor& t, const char* what) {
  KVEVICT_CHECK_TYPE(at::isFloatingType(t.scalar_type()), what,
                     " must have a floating dtype, got ", t.scalar_type());
}

}  // namespace kvevict::detail
