#pragma once
// All or nothing on the tensor path (docs/DESIGN.md, contract rule 9).
//
// A commit on the tensor path is a sequence of LibTorch in-place writes (index_put_, scatter_,
// fills, copies). Each of them allocates small host objects (TensorImpls, TensorIterator's
// operands) before it writes anything, so a host-heap failure (std::bad_alloc) can stop a commit
// between two writes, never inside one. An undo log, filled before the commit (every
// allocation first), holds what the commit's writes may change: copies of whole tensors or of
// the slots a pass overwrites, or steps that put a known value back. When a write throws, the
// log runs its steps, newest first, and the call throws a c10::Error naming it: the state is as
// it was before the call. The last write of a commit needs no step (it either happened whole or
// not at all, and then nothing after it runs). Restoring writes in place too; should a
// restoring write fail as well (the heap still exhausted), the error says that the state could
// not be restored.

#include <kvevict/check.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

class TensorUndo {
 public:
  /// Keeps a copy of `t` (allocates: a clone), written back on failure. Undefined: nothing.
  void save(const at::Tensor& t) {
    if (!t.defined()) return;
    auto copy = t.clone();
    steps_.emplace_back([t, copy] { t.copy_(copy); });
  }

  /// Keeps a copy of the slots `slots` [B, n] (int64, t's device) of `t` [B, ..., slots, ...]
  /// along `token_dim` (allocates: a gather), written back on failure: the destinations of a
  /// pass's moves. `rows`: [B, 1] int64 0 .. B - 1 on t's device (move_rows()).
  void save_slots(const at::Tensor& t, int64_t token_dim, const at::Tensor& slots, const at::Tensor& rows) {
    if (!slots.defined() || slots.size(1) == 0) return;
    auto view = t.transpose(1, token_dim);
    auto copy = view.index({rows, slots});
    steps_.emplace_back([view, rows, slots, copy]() mutable { view.index_put_({rows, slots}, copy); });
  }

  /// A step of its own, run on failure (after the steps added later): writes back what it
  /// captured, or swaps back what the commit swapped. Must be idempotent: it runs whether or
  /// not the write it undoes happened.
  void on_failure(std::function<void()> step) { steps_.push_back(std::move(step)); }

  bool empty() const noexcept { return steps_.empty(); }

  /// Runs `commit`; if it throws, runs the steps (newest first) and throws c10::Error naming
  /// `call`, with the first failure's message.
  template <class F>
  void commit(const char* call, F&& f) {
    std::exception_ptr failure, lost;  // no allocation until the steps have run
    try {
      f();
      return;
    } catch (...) {
      failure = std::current_exception();
    }
    for (auto it = steps_.rbegin(); it != steps_.rend(); ++it) {
      try {
        (*it)();
      } catch (...) {
        if (!lost) lost = std::current_exception();
      }
    }
    KVEVICT_CHECK(!lost, call, ": a write of its commit failed (", message(failure), ") and so did restoring what it "
                  "had written (", message(lost), "): the state is partly changed; reset() it");
    KVEVICT_CHECK(false, call, ": a write of its commit failed (", message(failure), "); what it had written was "
                  "restored: nothing changed");
  }

 private:
  static std::string message(const std::exception_ptr& p) {
    try {
      std::rethrow_exception(p);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "an unknown exception";
    }
  }

  std::vector<std::function<void()>> steps_;
};

}  // namespace detail
}  // namespace kvevict
