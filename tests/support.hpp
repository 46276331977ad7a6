#pragma once
// Test support: the brute-force selection oracle and small tensor helpers.
// The oracle is written independently of the library: a full sort of all candidates.

#include "op_counter.hpp"  // CountingCpuAllocator, OpRecorder

#include <kvevict/kvevict.hpp>

#include <c10/core/CPUAllocator.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace kvevict_test {

/// The tokens recall() / recall_absorbed() brought back ([B] int64 per row), summed.
inline int64_t total(const at::Tensor& recalled) { return recalled.sum().item<int64_t>(); }

/// Positions one row keeps under the contract: the n_sink smallest positions, the n_recent
/// largest, and the `budget` other tokens with the highest score (non-finite lowest, ties to
/// the newer position). Returns them ascending. `positions` and `scores` are in any order.
inline std::vector<int64_t> oracle_keep(std::vector<int64_t> positions, const std::vector<double>& scores,
                                        int64_t n_sink, int64_t budget, int64_t n_recent) {
  const int64_t S = static_cast<int64_t>(positions.size());
  std::vector<std::pair<int64_t, double>> tokens;  // (position, score)
  for (int64_t i = 0; i < S; ++i) tokens.push_back({positions[i], scores[i]});
  std::sort(tokens.begin(), tokens.end(), [](auto& a, auto& b) { return a.first < b.first; });
  std::vector<int64_t> kept;
  if (S <= n_sink + budget + n_recent) {
    for (auto& t : tokens) kept.push_back(t.first);
    return kept;
  }
  std::vector<std::pair<int64_t, double>> candidates;
  for (int64_t i = 0; i < S; ++i) {
    if (i < n_sink || i >= S - n_recent) {
      kept.push_back(tokens[i].first);
    } else {
      candidates.push_back(tokens[i]);
    }
  }
  // Best first: finite before non-finite, higher score first, newer position first.
  std::sort(candidates.begin(), candidates.end(), [](auto& a, auto& b) {
    const bool fa = std::isfinite(a.second), fb = std::isfinite(b.second);
    if (fa != fb) return fa;
    if (fa && a.second != b.second) return a.second > b.second;
    return a.first > b.first;
  });
  for (int64_t i = 0; i < budget; ++i) kept.push_back(candidates[i].first);
  std::sort(kept.begin(), kept.end());
  return kept;
}

/// Elements of a 1-D tensor (any device, converted) as a vector.
template <class T>
std::vector<T> to_vec(const at::Tensor& t) {
  const auto c = t.to(at::kCPU).to(c10::CppTypeToScalarType<T>::value).contiguous();
  const T* data = c.template data_ptr<T>();
  return std::vector<T>(data, data + c.numel());
}

/// Positions of row `b` of a layer, ascending (slots past the row's length, -1, left out).
template <class Cache>
std::vector<int64_t> kept_positions(const Cache& cache, int64_t layer, int64_t b = 0) {
  auto p = to_vec<int64_t>(cache.positions(layer)[b]);
  p.erase(std::remove(p.begin(), p.end(), int64_t{-1}), p.end());
  std::sort(p.begin(), p.end());
  return p;
}

/// True where a CUDA device is usable. CUDA tests (tag [cuda]) call this first and, where it
/// is false, WARN and return (Catch2 v2 has no SKIP). ctest never counts them as passed there:
/// the component ctests exclude [cuda], and the `cuda` ctest runs them through
/// `--cuda-or-skip` (main.cpp), which reports Skipped without a device.
inline bool cuda_available() { return at::hasCUDA(); }

#define KVEVICT_REQUIRE_CUDA_OR_RETURN()                                   \
  do {                                                                     \
    if (!kvevict_test::cuda_available()) {                                 \
      WARN("no CUDA device: this CUDA test did not run");                  \
      return;                                                              \
    }                                                                      \
  } while (0)

/// The long run (KVEVICT_LONG_TESTS=1; the ctests labelled `long`): tests that sample a space in
/// the default run (allocation-failure points) cover all of it.
inline bool long_run() {
  const char* on = std::getenv("KVEVICT_LONG_TESTS");
  return on != nullptr && std::strcmp(on, "1") == 0;
}

/// Restores the default CPU path on scope exit; while alive, caches built use the tensor path.
struct ForceTensorPath {
  explicit ForceTensorPath(bool on) : previous(kvevict::detail::force_tensor_path()) {
    kvevict::detail::force_tensor_path() = on;
  }
  ~ForceTensorPath() { kvevict::detail::force_tensor_path() = previous; }
  bool previous;
};

/// The message (without the backtrace) of the c10::Error that `f` throws; empty if it throws none.
template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return {};
}

/// Runs `f` twice: on the default CPU path and on the tensor-op (CUDA) path.
template <class F>
void on_both_paths(F&& f) {
  for (bool tensor_path : {false, true}) {
    INFO("tensor path: " << tensor_path);
    ForceTensorPath force(tensor_path);
    f();
  }
}

/// Switches the tier's compiled kernels (kvevict::set_kernels_enabled) for its lifetime;
/// restores the previous setting.
struct KernelsEnabled {
  explicit KernelsEnabled(bool on) : previous(kvevict::kernels_enabled()) { kvevict::set_kernels_enabled(on); }
  ~KernelsEnabled() { kvevict::set_kernels_enabled(previous); }
  KernelsEnabled(const KernelsEnabled&) = delete;
  KernelsEnabled& operator=(const KernelsEnabled&) = delete;
  bool previous;
};

}  // namespace kvevict_test
