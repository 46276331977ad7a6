#pragma once
// What a stretch of code asks of LibTorch, counted exactly: the ATen operators it calls on this
// thread, by kind, from LibTorch's RecordFunction observers (at::addGlobalCallback), and the CPU
// allocations it makes, from a counting allocator (c10::SetCPUAllocator). For the tensor path's
// op budget (bench/kvevict_bench --count-ops) and for tests that pin a sequence of ops (graph
// replay: the same ops on the same shapes every step). Header-only; LibTorch 1.13 and 2.x.
//
// Every operator call the dispatcher records is a node of a call tree (an op called by another
// is its child). A tree is counted once it returns, from its root down:
//   transfer    a host<->device copy (blocking from pageable memory: also a host sync): with
//               a CUDA tensor or device involved, a to() or copy_ between two devices; with
//               everything on the CPU (the tensor path run on CPU), every to() that names a
//               device, since on CUDA such a call is an upload (`.to(device_)` of host data)
//               or a download (`.to(at::kCPU)`). An upper bound there: on CUDA, `.to(device)`
//               of data already on it copies nothing.
//   sync        aten::item / _local_scalar_dense / is_nonzero (the host reads a value), and the
//               ops whose output shape depends on the data (nonzero, masked_select, unique, ...:
//               kernels that also sync on CUDA), wherever they run in a tree.
//   kernel      the outermost operator of a tree that is not a view, allocation or transfer
//               (its callees are part of it: at::zeros is one kernel, not empty + fill_). A
//               lower bound on CUDA launches: some ops (a long sort) launch several.
//   view        an outermost operator that launches nothing and returns a view: view ops and
//               metadata ops (view, narrow, select, as_strided, expand, ...) and composites
//               that only called such ops (a reshape that did not copy).
//   no-op       an outermost call that returned its input, calling nothing (a to() of the
//               tensor's own dtype, ...): launches nothing either, costs a dispatch.
//   allocation  an outermost empty / empty_like / empty_strided / resize_ (listed as an event;
//               the allocation count comes from the allocator, which sees every allocation,
//               those inside kernels included).
// Blind spots of an all-CPU run (the tensor path on CPU): a copy_ between two CPU tensors is a
// kernel even where on CUDA it would be an upload (`dev.copy_(host)`): the tensor path uploads
// only through to(device), which is counted; and a host read through data_ptr() calls no
// operator: the path must not read its tensors' data on the host, which only the CUDA run
// (scripts/gpu_check.sh, graph capture) proves.
// Operators LibTorch calls without the dispatcher (a kernel's own output allocation) are not
// operators here; their allocations are counted. CPU allocations only: on CUDA the device's
// caching allocator is not seen.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace kvevict_test {

/// Counts the allocations of the CPU allocator it wraps while installed (c10::SetCPUAllocator),
/// on every thread; restores the previous allocator when destroyed. Tensor storage on CPU comes
/// from here; views share their base's storage and do not. With fail_at(n), the n-th counted
/// allocation throws c10::Error instead, as an exhausted allocator does (fault injection).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  /// Counts allocations of at least `min_bytes` (0: all, empty tensors' 0-byte requests too).
  explicit CountingCpuAllocator(size_t min_bytes = 0) : inner_(c10::GetCPUAllocator()), min_bytes_(min_bytes) {
    c10::SetCPUAllocator(this, kPriority);
  }
  ~CountingCpuAllocator() override { c10::SetCPUAllocator(inner_, kPriority); }
  CountingCpuAllocator(const CountingCpuAllocator&) = delete;
  CountingCpuAllocator& operator=(const CountingCpuAllocator&) = delete;

  /// Allocations since construction or the last reset().
  int64_t count() const { return count_.load(); }
  /// Their bytes.
  int64_t bytes() const { return bytes_.load(); }
  void reset() {
    count_ = 0;
    bytes_ = 0;
  }
  /// Makes the n-th counted allocation (as count() numbers them) throw; 0: none.
  CountingCpuAllocator& fail_at(int64_t n) {
    fail_at_ = n;
    return *this;
  }
  /// Whether the allocation fail_at() names was asked for (and failed).
  bool failed() const { return failed_.load(); }
  /// Bytes of the largest allocation since construction (counted or not).
  size_t largest() const { return largest_.load(); }

  // LibTorch 1.13 declares `allocate(size_t) const`, 2.3+ `allocate(size_t)`: define both, no
  // `override`, so whichever the base declares is overridden and the other is a plain overload.
  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  // Pure virtual in LibTorch 2.x only: no `override`, so it compiles against 1.13 too.
  void copy_data(void* dest, const void* src, std::size_t bytes) const { std::memcpy(dest, src, bytes); }

 private:
  static constexpr uint8_t kPriority = 255;  // above the default allocator's registration
  c10::DataPtr counted(size_t n) const {
    if (n > largest_.load()) largest_ = n;
    if (n >= min_bytes_) {
      bytes_ += static_cast<int64_t>(n);
      if (++count_ == fail_at_) {
        failed_ = true;
        TORCH_CHECK(false, "injected allocation failure (allocation ", fail_at_, ", ", n, " bytes)");
      }
    }
    return inner_->allocate(n);
  }
  c10::Allocator* inner_;
  size_t min_bytes_;
  int64_t fail_at_ = 0;
  mutable std::atomic<int64_t> count_{0}, bytes_{0};
  mutable std::atomic<bool> failed_{false};
  mutable std::atomic<size_t> largest_{0};
};

enum class OpKind { kernel, view, noop, transfer, sync, allocation };

inline const char* to_string(OpKind k) {
  switch (k) {
    case OpKind::kernel: return "kernel";
    case OpKind::view: return "view";
    case OpKind::noop: return "no-op";
    case OpKind::transfer: return "transfer";
    case OpKind::sync: return "sync";
    case OpKind::allocation: return "allocation";
  }
  return "?";
}

/// One counted operator call.
struct OpEvent {
  std::string name;                          // e.g. "aten::add"
  OpKind kind;
  bool syncs;                                // the host waits for the device: transfers, syncs,
                                             // kernels with a data-dependent output shape
  std::vector<std::vector<int64_t>> shapes;  // sizes of the tensor arguments, in order ({} for
                                             // an undefined one; lists flattened)
  std::vector<int64_t> ints;                 // the integer arguments, in order (lists flattened)
  std::vector<double> scalars;               // the floating-point arguments, in order
  std::vector<const void*> data;             // data_ptr() of the tensor arguments, as `shapes`
                                             // (nullptr: undefined or without storage); not
                                             // compared by ==
  bool operator==(const OpEvent& o) const {
    // Scalars bit for bit (a graph bakes them in); NaN equals NaN here.
    const auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; };
    return name == o.name && kind == o.kind && syncs == o.syncs && shapes == o.shapes && ints == o.ints &&
           std::equal(scalars.begin(), scalars.end(), o.scalars.begin(), o.scalars.end(), same);
  }
  bool operator!=(const OpEvent& o) const { return !(*this == o); }
};

/// e.g. "aten::narrow view [4, 6] ints 0 1 2" (for test messages).
inline std::ostream& operator<<(std::ostream& os, const OpEvent& e) {
  os << e.name << ' ' << to_string(e.kind) << (e.syncs && e.kind == OpKind::kernel ? " (syncs)" : "");
  for (const auto& s : e.shapes) os << ' ' << c10::IntArrayRef(s);
  if (!e.ints.empty()) os << " ints";
  for (auto x : e.ints) os << ' ' << x;
  if (!e.scalars.empty()) os << " scalars";
  for (auto x : e.scalars) os << ' ' << x;
  return os;
}

/// Totals of a recording.
struct OpCounts {
  int64_t kernels = 0, views = 0, noops = 0, transfers = 0;
  int64_t syncs = 0;                   // the events with kind sync plus kernels that sync (not transfers)
  int64_t allocations = 0, bytes = 0;  // CPU allocator
  OpCounts& operator+=(const OpCounts& o) {
    kernels += o.kernels;
    views += o.views;
    noops += o.noops;
    transfers += o.transfers;
    syncs += o.syncs;
    allocations += o.allocations;
    bytes += o.bytes;
    return *this;
  }
};

namespace op_counter_detail {

inline bool one_of(const std::string& name, std::initializer_list<const char*> names) {
  return std::any_of(names.begin(), names.end(), [&](const char* n) { return name == n; });
}

// Launch nothing by themselves: views, metadata, and composites that may only return a view.
inline bool no_work_op(const std::string& n) {
  return one_of(n, {"aten::alias", "aten::as_strided", "aten::as_strided_", "aten::_reshape_alias", "aten::diagonal",
                    "aten::expand", "aten::expand_as", "aten::broadcast_to", "aten::broadcast_tensors", "aten::narrow",
                    "aten::permute", "aten::movedim", "aten::swapaxes", "aten::swapdims", "aten::reshape",
                    "aten::reshape_as", "aten::flatten", "aten::unflatten", "aten::ravel", "aten::select",
                    "aten::slice", "aten::split", "aten::split_with_sizes", "aten::tensor_split", "aten::chunk",
                    "aten::unbind", "aten::squeeze", "aten::squeeze_", "aten::unsqueeze", "aten::unsqueeze_",
                    "aten::t", "aten::t_", "aten::transpose", "aten::transpose_", "aten::numpy_T", "aten::mT",
                    "aten::mH", "aten::adjoint", "aten::view", "aten::view_as", "aten::_unsafe_view",
                    "aten::unfold", "aten::contiguous", "aten::to", "aten::type_as", "aten::detach",
                    "aten::detach_", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::_conj",
                    "aten::conj", "aten::real", "aten::imag", "aten::view_as_real", "aten::view_as_complex",
                    "aten::atleast_1d", "aten::atleast_2d", "aten::atleast_3d", "aten::size", "aten::sym_size",
                    "aten::stride", "aten::sym_stride", "aten::numel", "aten::sym_numel", "aten::dim",
                    "aten::is_contiguous", "aten::is_floating_point", "aten::is_complex", "aten::is_same_size",
                    "aten::result_type", "aten::can_cast", "aten::promote_types", "aten::_has_compatible_shallow_copy_type",
                    "aten::record_stream", "aten::set_", "aten::is_set_to", "aten::storage_offset",
                    "aten::sym_storage_offset"});
}
inline bool allocation_op(const std::string& n) {
  return one_of(n, {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::empty_permuted",
                    "aten::new_empty", "aten::new_empty_strided", "aten::resize_", "aten::resize_as_"});
}
// The host reads a value back.
inline bool scalar_sync_op(const std::string& n) {
  return one_of(n, {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"});
}
// Composites that return their input itself when there is nothing to do (a to() of its own
// dtype, contiguous() of a contiguous tensor, flatten() of a 1-d one): a call without callees.
inline bool may_return_self_op(const std::string& n) {
  return one_of(n, {"aten::to", "aten::contiguous", "aten::type_as", "aten::flatten", "aten::ravel",
                    "aten::reshape", "aten::reshape_as", "aten::resolve_conj", "aten::resolve_neg", "aten::conj",
                    "aten::lift_fresh"});
}
// Kernels whose output shape (or result) depends on the data: the host waits for it on CUDA.
inline bool data_dependent_op(const std::string& n) {
  return one_of(n, {"aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select",
                    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
                    "aten::unique_dim_consecutive", "aten::repeat_interleave", "aten::equal", "aten::bincount"});
}

enum class Class { transfer, scalar_sync, data_dependent, compute, no_work, allocation };

struct Node {
  std::string name;
  Class cls;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> ints;
  std::vector<double> scalars;
  std::vector<const void*> data;
  std::vector<size_t> children;
};

inline void add_argument(const c10::IValue& v, Node& n, std::vector<at::Device>& tensor_devices,
                         std::vector<at::Device>& named_devices) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    n.shapes.push_back(t.defined() ? t.sizes().vec() : std::vector<int64_t>{});
    n.data.push_back(t.defined() && t.has_storage() ? t.data_ptr() : nullptr);
    if (t.defined()) tensor_devices.push_back(t.device());
  } else if (v.isTensorList()) {
    for (const auto& t : v.toTensorVector()) add_argument(c10::IValue(t), n, tensor_devices, named_devices);
  } else if (v.isList()) {  // e.g. List[Optional[Tensor]] (index, index_put_)
    const auto list = v.toList();
    for (size_t i = 0; i < list.size(); ++i) add_argument(list.get(i), n, tensor_devices, named_devices);
  } else if (v.isDouble()) {
    n.scalars.push_back(v.toDouble());
  } else if (v.isScalar() && v.toScalar().isFloatingPoint()) {
    n.scalars.push_back(v.toScalar().toDouble());
  } else if (v.isInt()) {
    n.ints.push_back(v.toInt());
  } else if (v.isIntList()) {
    for (auto x : v.toIntVector()) n.ints.push_back(x);
  } else if (v.isDevice()) {
    named_devices.push_back(v.toDevice());
  }
}

/// Whether a call moves data between the host and a device. Where a device other than the CPU
/// takes part (a CUDA run), a copy between two different devices. Where all is CPU (the tensor
/// path run on CPU), any to() that names a device: on CUDA that is an upload or a download
/// (`.to(device_)` of host data, `.to(at::kCPU)` of device data); an internal _to_copy of a
/// to() that names none is not one.
inline bool is_transfer(const std::string& name, const std::vector<at::Device>& tensors,
                        const std::vector<at::Device>& named, bool top_level) {
  const bool to = one_of(name, {"aten::to", "aten::_to_copy"});
  const bool copy = one_of(name, {"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"});
  if (!(to && !named.empty()) && !(copy && tensors.size() >= 2)) return false;
  std::vector<at::Device> all = tensors;
  all.insert(all.end(), named.begin(), named.end());
  const bool cpu_only = std::all_of(all.begin(), all.end(), [](const at::Device& d) { return d.is_cpu(); });
  // All on the CPU: a to() naming a device called by the code under test (a call made inside
  // an operator, e.g. softmax's x.to(x.options().dtype(...)), stays where its input is).
  if (cpu_only) return to && top_level;
  // "cuda" names the current device: the same place as "cuda:0" there.
  const auto same_place = [](const at::Device& a, const at::Device& b) {
    return a.type() == b.type() && (a.index() == b.index() || a.index() < 0 || b.index() < 0);
  };
  return std::any_of(all.begin(), all.end(), [&](const at::Device& d) { return !same_place(d, all[0]); });
}

inline Node make_node(const at::RecordFunction& fn, bool top_level) {
  Node n{fn.name(), Class::compute, {}, {}, {}, {}, {}};
  std::vector<at::Device> tensors, named;
  for (const auto& v : fn.inputs()) add_argument(v, n, tensors, named);
  if (is_transfer(n.name, tensors, named, top_level)) {
    n.cls = Class::transfer;
  } else if (scalar_sync_op(n.name)) {
    n.cls = Class::scalar_sync;
  } else if (data_dependent_op(n.name)) {
    n.cls = Class::data_dependent;
  } else if (allocation_op(n.name)) {
    n.cls = Class::allocation;
  } else if (no_work_op(n.name)) {
    n.cls = Class::no_work;
  }
  return n;
}

}  // namespace op_counter_detail

/// Records the operators this thread calls (see the top of this file) and the CPU allocations
/// of at least 1 byte of every thread while it is alive. One at a time per process.
///
///   kvevict_test::OpRecorder rec;
///   cache.update(0, ckv, kpe);
///   rec.counts().kernels;   // ... and rec.events(): name, kind, shapes, ints per counted op
///
/// Not thread-safe itself: create, read and destroy it on the thread whose ops it counts.
class OpRecorder {
 public:
  OpRecorder() : owner_(std::this_thread::get_id()) {
    if (active() != nullptr) throw std::logic_error("OpRecorder: another recorder is active");
    active() = this;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&OpRecorder::enter, &OpRecorder::leave)
                                        .needsInputs(true)
                                        .scopes({at::RecordScope::FUNCTION}));
  }
  ~OpRecorder() {
    at::removeCallback(handle_);
    active() = nullptr;
  }
  OpRecorder(const OpRecorder&) = delete;
  OpRecorder& operator=(const OpRecorder&) = delete;

  /// Totals so far (allocations: the allocator's count since construction).
  OpCounts counts() const {
    OpCounts c;
    for (const auto& e : events_) {
      if (e.kind == OpKind::kernel) ++c.kernels;
      if (e.kind == OpKind::view) ++c.views;
      if (e.kind == OpKind::noop) ++c.noops;
      if (e.kind == OpKind::transfer) ++c.transfers;
      if (e.kind == OpKind::sync || (e.kind == OpKind::kernel && e.syncs)) ++c.syncs;
    }
    c.allocations = allocator_.count();
    c.bytes = allocator_.bytes();
    return c;
  }
  /// False if some call's arguments could not be read (the counts may then be wrong).
  bool ok() const { return !failed_; }
  /// The counted operators in call order.
  const std::vector<OpEvent>& events() const { return events_; }
  /// (name, calls) of the events of `kind`, in first-call order.
  std::vector<std::pair<std::string, int64_t>> by_name(OpKind kind) const {
    std::vector<std::pair<std::string, int64_t>> out;
    for (const auto& e : events_) {
      if (e.kind != kind) continue;
      auto it = std::find_if(out.begin(), out.end(), [&](const auto& x) { return x.first == e.name; });
      if (it == out.end()) {
        out.emplace_back(e.name, 1);
      } else {
        ++it->second;
      }
    }
    return out;
  }

 private:
  using Node = op_counter_detail::Node;
  using Class = op_counter_detail::Class;

  static OpRecorder*& active() {
    static OpRecorder* r = nullptr;
    return r;
  }
  static OpRecorder* mine() {
    OpRecorder* r = active();
    return r != nullptr && r->owner_ == std::this_thread::get_id() ? r : nullptr;
  }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (OpRecorder* r = mine()) {
      try {
        r->nodes_.push_back(op_counter_detail::make_node(fn, r->stack_.empty()));
      } catch (...) {  // a node for every call, or leave() would pop the wrong one
        r->nodes_.push_back({fn.name(), Class::compute, {}, {}, {}, {}, {}});
        r->failed_ = true;
      }
      const size_t i = r->nodes_.size() - 1;
      if (!r->stack_.empty()) r->nodes_[r->stack_.back()].children.push_back(i);
      r->stack_.push_back(i);
    }
    return nullptr;
  }
  static void leave(const at::RecordFunction&, at::ObserverContext*) {
    OpRecorder* r = mine();
    if (r == nullptr || r->stack_.empty()) return;
    r->stack_.pop_back();
    if (r->stack_.empty()) {  // a whole tree returned
      r->count(0, false);
      r->nodes_.clear();
    }
  }

  // Whether a node launches anything (views and allocations only through their callees;
  // transfers and reads are not kernels).
  bool works(size_t i) const {
    const auto& n = nodes_[i];
    switch (n.cls) {
      case Class::transfer:
      case Class::scalar_sync: return false;
      case Class::data_dependent:
      case Class::compute: return true;
      case Class::no_work:
      case Class::allocation:
        return std::any_of(n.children.begin(), n.children.end(), [&](size_t c) { return works(c); });
    }
    return false;
  }
  void emit(const Node& n, OpKind kind, bool syncs) {
    events_.push_back({n.name, kind, syncs, n.shapes, n.ints, n.scalars, n.data});
  }
  /// Counts node i; `in_kernel`: an ancestor was counted as a kernel (only transfers and syncs
  /// inside it count then).
  void count(size_t i, bool in_kernel) {
    const auto& n = nodes_[i];
    bool child_in_kernel = in_kernel;
    switch (n.cls) {
      case Class::transfer: emit(n, OpKind::transfer, true); return;
      case Class::scalar_sync: emit(n, OpKind::sync, true); return;
      case Class::data_dependent:
      case Class::compute:
        if (in_kernel) {
          if (n.cls == Class::data_dependent) emit(n, OpKind::sync, true);
        } else {
          emit(n, OpKind::kernel, n.cls == Class::data_dependent);
          child_in_kernel = true;
        }
        break;
      case Class::no_work:
      case Class::allocation:
        if (!in_kernel && !works(i)) {
          const bool noop = n.children.empty() && op_counter_detail::may_return_self_op(n.name);
          emit(n, n.cls == Class::allocation ? OpKind::allocation : noop ? OpKind::noop : OpKind::view, false);
          return;
        }
        break;
    }
    for (size_t c : n.children) count(c, child_in_kernel);
  }

  std::thread::id owner_;
  CountingCpuAllocator allocator_{1};  // 0-byte requests (empty tensors) allocate nothing
  at::CallbackHandle handle_;
  std::vector<Node> nodes_;   // the call tree being recorded
  std::vector<size_t> stack_; // open calls (indices into nodes_)
  std::vector<OpEvent> events_;
  bool failed_ = false;
};

}  // namespace kvevict_test
