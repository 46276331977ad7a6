#pragma once
// The CUDA kernels' launchers (cuda.cu), called by the CUDA implementations in ops.cpp. Plain
// types only, so that nvcc compiles cuda.cu without LibTorch's headers.

#include <kvevict/detail/tier/ops/bodies.hpp>

#include <cstdint>

namespace kvevict {
namespace detail {
namespace kernels {

/// pick_pages_row() for rows [0, B), a thread per row, on `stream` (a cudaStream_t) of the
/// current device. Returns the launch's error message, or nullptr.
const char* launch_pick_pages(const PickPagesArgs& args, int64_t B, void* stream);

/// recall_swap_row() for rows [0, B), one block whose threads stride over the rows, then
/// seq_next += K and recalled += the rows' counts; on `stream`. Returns the launch's error
/// message, or nullptr.
const char* launch_recall_swap(const RecallSwapArgs& args, int64_t B, void* stream);

/// recall_victims_row(), pool_gather_row(), pick_tokens_row() for rows [0, B), a thread per
/// row, on `stream`. Each returns the launch's error message, or nullptr.
const char* launch_recall_victims(const RecallVictimsArgs& args, int64_t B, void* stream);
const char* launch_pool_gather(const PoolGatherArgs& args, int64_t B, void* stream);
const char* launch_pick_tokens(const PickTokensArgs& args, int64_t B, void* stream);

}  // namespace kernels
}  // namespace detail
}  // namespace kvevict
