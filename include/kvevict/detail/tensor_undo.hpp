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
// not at all, and then nothing after it runs). On the CPU, copies of contiguous tensors are
// written back with memcpy, which cannot fail; elsewhere restoring writes in place through
// LibTorch too, and should a restoring write fail as well (the heap still exhausted), the error
// says that the state is partly changed (restore_failed() keeps that known to host_heap() when
// even that message cannot be made).

#include <kvevict/check.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

class TensorUndo {
 public:
  /// Keeps a copy of `t` (allocates: a clone), written back on failure (a contiguous CPU
  /// tensor: with memcpy, which allocates nothing). Undefined: nothing.
  void save(const at::Tensor& t) {
    if (!t.defined()) return;
    auto copy = t.clone(at::MemoryFormat::Contiguous);
    if (t.is_cpu() && t.is_contiguous()) {
      steps_.emplace_back([t, copy] { std::memcpy(t.data_ptr(), copy.data_ptr(), t.nbytes()); });
    } else {
      steps_.emplace_back([t, copy] { t.copy_(copy); });
    }
  }

  /// Keeps a copy of the slots `slots` [B, n] (int64, t's device) of `t` [B, ..., slots, ...]
  /// along `token_dim` (allocates: a gather), written back on failure: the destinations of a
  /// pass's moves. `rows`: [B, 1] int64 0 .. B - 1 on t's device (move_rows()).
  void save_slots(const at::Tensor& t, int64_t token_dim, const at::Tensor& slots, const at::Tensor& rows) {
    if (!slots.defined() || slots.size(1) == 0) return;
    auto view = t.transpose(1, token_dim);
    auto copy = view.index({rows, slots}).contiguous();  // [B, n, groups..., inner...]
    if (t.is_cpu() && t.is_contiguous() && token_dim <= 2 && slots.is_cpu() && slots.is_contiguous()) {
      // memcpy back, row by row (RowLayout); with token_dim <= 2 the gathered copy holds each
      // (b, k)'s groups in the buffer's order.
      steps_.emplace_back([t, token_dim, slots, copy] {
        const RowLayout R(t, token_dim);
        const int64_t B = slots.size(0), n = slots.size(1);
        const auto* s = slots.data_ptr<int64_t>();
        auto* dst = static_cast<char*>(t.data_ptr());
        const auto* src = static_cast<const char*>(copy.data_ptr());
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t k = 0; k < n; ++k) {
            for (int64_t g = 0; g < R.groups_per_row; ++g) {
              std::memcpy(dst + R.offset(b, g, s[b * n + k]), src + ((b * n + k) * R.groups_per_row + g) * R.row_bytes,
                          static_cast<size_t>(R.row_bytes));
            }
          }
        }
      });
    } else {
      steps_.emplace_back([view, rows, slots, copy]() mutable { view.index_put_({rows, slots}, copy); });
    }
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
    if (lost) restore_failed() = true;  // before any message is made: that may fail too
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
