#pragma once
// TierWrites: the in-place writes of one change to the tensor path's tier (TierStore,
// tier/store.hpp), planned into the undo log of the commit they join (TensorUndo).

#include <kvevict/detail/tensor_undo.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// The in-place writes of one change to a TierStore, planned before the commit they join:
/// each write keeps what it overwrites (allocated at planning, before the commit) in the
/// commit's undo log (TensorUndo), which puts it back, newest first, if a later write of the
/// commit throws. A pass's take joins the pass's commit, a truncate's drop the truncate's, so
/// that the cache and its tier change together or not at all.
class TierWrites {
 public:
  explicit TierWrites(TensorUndo& undo) : undo_(undo) {}
  TierWrites(const TierWrites&) = delete;
  TierWrites& operator=(const TierWrites&) = delete;
  /// Planned but never run to its end (a throw before the commit, or in it): runs the
  /// abandon() steps, which put back what planning changed (a grown store).
  ~TierWrites() {
    if (ran_) return;
    for (auto it = abandon_.rbegin(); it != abandon_.rend(); ++it) (*it)();
  }

  /// Keeps target.gather(dim, index), written back on failure (a contiguous CPU target: with
  /// memcpy, which allocates nothing; put_back()): what a write of the commit may change there.
  void keep(const at::Tensor& target, int64_t dim, const at::Tensor& index) {
    const auto old = target.gather(dim, index);
    if (target.is_cpu() && target.is_contiguous() && index.is_cpu()) {
      const auto sizes = index.sizes().vec(), index_strides = index.strides().vec(), strides = target.strides().vec();
      std::vector<int64_t> at(sizes.size());
      undo_.on_failure([target, dim, index, old, sizes, index_strides, strides, at]() mutable {
        put_back(target, dim, index, old, sizes, index_strides, strides, at);
      });
    } else {
      undo_.on_failure([target, dim, index, old]() mutable { target.scatter_(dim, index, old); });
    }
  }
  /// target.scatter_(dim, index, values), keep()ing what it overwrites.
  void scatter(const at::Tensor& target, int64_t dim, const at::Tensor& index, const at::Tensor& values) {
    keep(target, dim, index);
    steps_.emplace_back([target, dim, index, values]() mutable { target.scatter_(dim, index, values); });
  }
  /// target.add_(n) (a counter, [1] or as n); keeps a copy.
  void add(const at::Tensor& target, const at::Tensor& n) {
    undo_.save(target);
    steps_.emplace_back([target, n]() mutable { target.add_(n); });
  }
  /// Keeps a copy of `t` (a write of then() changes it).
  void save(const at::Tensor& t) { undo_.save(t); }
  /// A step of the undo log of its own (runs before those planned earlier).
  void undo(std::function<void()> step) { undo_.on_failure(std::move(step)); }
  /// A step run if the writes never run to their end, after the undo log's (must not throw).
  void abandon(std::function<void()> step) { abandon_.push_back(std::move(step)); }
  /// A write of its own, after those planned before.
  void then(std::function<void()> step) { steps_.push_back(std::move(step)); }

  /// The writes, in order (inside the commit of the undo log).
  void run() {
    for (auto& s : steps_) s();
    ran_ = true;
  }
  /// run() as a commit of its own: a throw puts back what was written and throws c10::Error
  /// naming `call`.
  void commit(const char* call) {
    undo_.commit(call, [&] { run(); });
  }

 private:
  /// target (contiguous, CPU)[..., index[i], ...] = old[i] along `dim` for every element i of
  /// `index` (`sizes`, `index_strides`; `old` contiguous as index's sizes), with memcpy and the
  /// preallocated `at`: allocates nothing, does not throw.
  static void put_back(const at::Tensor& target, int64_t dim, const at::Tensor& index, const at::Tensor& old,
                       const std::vector<int64_t>& sizes, const std::vector<int64_t>& index_strides,
                       const std::vector<int64_t>& strides, std::vector<int64_t>& at) noexcept {
    const auto elem = static_cast<int64_t>(target.element_size());
    auto* dst = static_cast<char*>(target.data_ptr());
    const auto* src = static_cast<const char*>(old.data_ptr());
    const auto* ix = index.data_ptr<int64_t>();
    const int64_t n = old.numel(), d = static_cast<int64_t>(sizes.size());
    std::fill(at.begin(), at.end(), 0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t io = 0, to = 0;
      for (int64_t k = 0; k < d; ++k) io += at[k] * index_strides[k];
      for (int64_t k = 0; k < d; ++k) to += (k == dim ? ix[io] : at[k]) * strides[k];
      std::memcpy(dst + to * elem, src + i * elem, static_cast<size_t>(elem));
      for (int64_t k = d - 1; k >= 0 && ++at[k] == sizes[k]; --k) at[k] = 0;
    }
  }

  TensorUndo& undo_;
  std::vector<std::function<void()>> steps_, abandon_;
  bool ran_ = false;
};

}  // namespace detail
}  // namespace kvevict
