// The tier's CUDA kernels: each runs a body of include/kvevict/detail/tier/ops/bodies.hpp, the
// same code the CPU kernels run (ops.cpp registers both).

#include "launch.hpp"

#include <cuda_runtime.h>

namespace kvevict {
namespace detail {
namespace kernels {

namespace {
/// A thread per row of `Body`(args, b).
template <class Args, void (*Body)(const Args&, int64_t)>
__global__ void rows_kernel(Args args, int64_t B) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < B) Body(args, b);
}

template <class Args, void (*Body)(const Args&, int64_t)>
const char* launch_rows(const Args& args, int64_t B, void* stream) {
  constexpr int kThreads = 64;
  const auto blocks = static_cast<unsigned>((B + kThreads - 1) / kThreads);
  rows_kernel<Args, Body><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(args, B);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}
__global__ void recall_swap_kernel(RecallSwapArgs args, int64_t B) {
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) recall_swap_row(args, b);
  __syncthreads();  // every row has read seq_next
  if (threadIdx.x == 0) {
    int64_t recalled = 0;
    for (int64_t b = 0; b < B; ++b) recalled += args.count[b];
    args.seq_next[0] += args.K;
    args.recalled[0] += recalled;
  }
}
}  // namespace

const char* launch_recall_swap(const RecallSwapArgs& args, int64_t B, void* stream) {
  recall_swap_kernel<<<1, 128, 0, static_cast<cudaStream_t>(stream)>>>(args, B);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

const char* launch_pick_pages(const PickPagesArgs& args, int64_t B, void* stream) {
  return launch_rows<PickPagesArgs, pick_pages_row>(args, B, stream);
}
const char* launch_recall_victims(const RecallVictimsArgs& args, int64_t B, void* stream) {
  return launch_rows<RecallVictimsArgs, recall_victims_row>(args, B, stream);
}
const char* launch_pool_gather(const PoolGatherArgs& args, int64_t B, void* stream) {
  return launch_rows<PoolGatherArgs, pool_gather_row>(args, B, stream);
}
const char* launch_pick_tokens(const PickTokensArgs& args, int64_t B, void* stream) {
  return launch_rows<PickTokensArgs, pick_tokens_row>(args, B, stream);
}

}  // namespace kernels
}  // namespace detail
}  // namespace kvevict
