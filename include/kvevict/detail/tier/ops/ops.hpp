#pragma once
// The tier's kernel boundary: pure ops on plain tensors that the tensor path's recall calls.
// Each op has two forms with the same results, bit for bit:
//   - compiled kernels, PyTorch custom operators in the namespace `kvevict` (TORCH_LIBRARY,
//     src/kernels/), a CPU and a CUDA implementation over one C10_HOST_DEVICE body
//     (tier/ops/bodies.hpp). They are there when the program links kvevict::kernels (CMake)
//     or is the Python extension (pip install .);
//   - the reference form (tier/ops/reference.hpp), ATen composites: the test oracle, and what
//     runs where no kernel is registered for the tensors' device, or kernels are switched off
//     (kvevict::set_kernels_enabled(false), kvevict/kernels.hpp).
// A kernel allocates its outputs and scratch first, then runs code that cannot fail.

#include <kvevict/detail/tier/ops/reference.hpp>
#include <kvevict/kernels.hpp>

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {
namespace ops {

/// recall's page pick, every row at once: per row the pages by `scores` [B, P] fp64 (per page
/// id), higher first, equal scores the smaller page id, a score of 0 (or NaN) or a page without
/// members (`members` [B, >= P] int64) never; each whole page that still fits in `limit` [B]
/// int64 tokens is taken (a greedy fill with skips). Returns the taken pages' tokens as store
/// slots [B, K] int64 in recall order (page by page, a page's tokens newest first by insertion
/// number `seq` [B, N + 1] int64), columns past a row's count holding the trash slot N, and the
/// count [B] int64 (every token of the taken pages). `position` [B, N + 1] int64: each store
/// slot's position (-1: free), its page position / `page_size`. All on one device. Allocates
/// the outputs (and the kernel's scratch, [B, 3 P + N] int64); no host sync, no host read.
/// The kernel: one op; the reference: about 40 + 2 log2 min(P, N) ATen calls.
inline std::tuple<at::Tensor, at::Tensor> pick_pages(const at::Tensor& scores, const at::Tensor& members,
                                                     const at::Tensor& position, const at::Tensor& seq,
                                                     const at::Tensor& limit, int64_t K, int64_t page_size) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, int64_t, int64_t);
  static const CompiledOp op("kvevict::pick_pages");
  if (op.runs_on(scores.device().type()))
    return op.handle().typed<Sig>().call(scores, members, position, seq, limit, K, page_size);
  return reference::pick_pages(scores, members, position, seq, limit, K, page_size);
}

/// Whether the compiled kernels reach these tier rows: at most 4 buffers of 3 to 9 dims, the
/// key buffers fp32, fp16 or bf16.
inline bool compiled_keys(const std::vector<at::Tensor>& buffers, const std::vector<size_t>& key_buffers) {
  if (buffers.empty() || buffers.size() > 4) return false;
  for (const auto& b : buffers) {
    if (b.dim() < 3 || b.dim() > 9) return false;
  }
  for (const auto i : key_buffers) {
    const auto t = buffers.at(i).scalar_type();
    if (t != at::kFloat && t != at::kHalf && t != at::kBFloat16) return false;
  }
  return true;
}

/// recall's victims, every row at once: of each row's candidates (n_sink <= position <
/// recent_from, where recent_from is the recent window's start before the latest append:
/// `counters` [B, 3] int64 column 2 (the policy's device counters: seen - n_recent) minus
/// `latest` [B, 1] int64 (the row's latest append; -1: a free row, which has none)), the `K`
/// lowest in eviction order (`slot_ranks` [B, S] fp32 each slot's rank; lower first, equal ranks
/// the older position, non-finite ranks lowest): victims [B, K] int64 (columns past a row's
/// candidates: anything), their number [B] int64, and the best-ranked candidate's scorer state
/// top [B, W] fp32 (`state` [B, S, W]; anything for a row without). `max_seen`: the most tokens a
/// row has seen (host; the reference's key is exact below 2^32 positions, else it sorts twice).
/// Allocates the outputs; no host sync.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> recall_victims(const at::Tensor& slot_ranks,
                                                                     const at::Tensor& position,
                                                                     const at::Tensor& state,
                                                                     const at::Tensor& counters,
                                                                     const at::Tensor& latest, int64_t n_sink,
                                                                     int64_t K, int64_t max_seen) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, const at::Tensor&, int64_t, int64_t);
  static const CompiledOp op("kvevict::recall_victims");
  if (op.runs_on(position.device().type()))
    return op.handle().typed<Sig>().call(slot_ranks, position, state, counters, latest, n_sink, K);
  return reference::recall_victims(slot_ranks, position, state, counters, latest, n_sink, K, max_seen);
}

/// Two-level recall's pool, every row at once: the pool's store slots `slots` [B, R] int64
/// (`count` [B] int64 of them a row, the trash slot N past it) sorted by position
/// (`store_position` [B, N + 1] int64): by_position [B, R] int64 (N past the count), their keys
/// [B, R, groups, width] fp32 (the key buffers' rows, read through `views` [B, outer..., N + 1,
/// inner] with `groups` outer elements, channels side by side; the trash slot's past the count)
/// and valid [B, R] bool (the columns below the count). `keys_of(slots)`: the reference's key
/// gather (TierStore::keys()). Allocates the outputs; no host sync.
template <class KeysOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pool_gather(const at::Tensor& slots, const at::Tensor& count,
                                                           const at::Tensor& store_position,
                                                           const std::vector<at::Tensor>& views,
                                                           const std::vector<size_t>& key_buffers, int64_t groups,
                                                           KeysOf&& keys_of) {
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                             at::TensorList, c10::IntArrayRef, int64_t);
  static const CompiledOp op("kvevict::pool_gather");
  if (op.runs_on(store_position.device().type()) && compiled_keys(views, key_buffers)) {
    const std::vector<int64_t> keys(key_buffers.begin(), key_buffers.end());
    return op.handle().typed<Sig>().call(slots, count, store_position, views, keys, groups);
  }
  return reference::pool_gather(slots, count, store_position, std::forward<KeysOf>(keys_of));
}

/// Two-level recall's token pick, every row at once: of the pool `by_position` [B, R] int64
/// (store slots by position) with exact scores `exact` [B, R] fp64 and `valid` [B, R] bool, the
/// best min(K, R) in a stable descending order of the scores (a score <= 0 or an invalid column
/// as -1; equal scores the older position), of which a row keeps count = its scores > 0, at
/// most `limit` [B] int64: slots [B, K] int64 (the trash slot N past the count) and the count
/// [B] int64. Allocates the outputs; no host sync.
inline std::tuple<at::Tensor, at::Tensor> pick_tokens(const at::Tensor& exact, const at::Tensor& valid,
                                                      const at::Tensor& by_position, const at::Tensor& limit, int64_t K,
                                                      int64_t N) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, int64_t, int64_t);
  static const CompiledOp op("kvevict::pick_tokens");
  if (op.runs_on(exact.device().type())) return op.handle().typed<Sig>().call(exact, valid, by_position, limit, K, N);
  return reference::pick_tokens(exact, valid, by_position, limit, K, N);
}

/// Whether recall_swap() has a compiled kernel to run on these tensors: registered for their
/// device, switched on, and the tensors in reach of its body (at most 4 buffers of at most 6
/// outer dims, fp32, fp16 or bf16 keys, the policy's position and state contiguous). Where it
/// has not, the caller runs recall_swap()'s reference form: TierStore::swap()'s tensor ops under
/// the commit's undo log.
inline bool recall_swap_compiled(const at::Tensor& position, const at::Tensor& state,
                                 const std::vector<at::Tensor>& buffers, const std::vector<size_t>& key_buffers) {
  static const CompiledOp op("kvevict::recall_swap");
  if (!op.runs_on(position.device().type()) || !position.is_contiguous() || !state.is_contiguous()) return false;
  if (!compiled_keys(buffers, key_buffers)) return false;
  for (const auto& b : buffers) {
    if (b.size(-2) != position.size(1)) return false;
  }
  return true;
}

/// recall's swap, every row at once, in one compiled op (where recall_swap_compiled()): the
/// tier tokens `picked` [B, K] int64 (store slots; N past a row's `count` [B] int64) and the
/// cache slots `victims` [B, K] int64 exchange places. Into the victims' slots of `buffers`
/// (each [B, outer..., S, inner], any dtype) go the tokens' rows from `views` (the tier's rows
/// [B, outer..., N + 1, inner], read and written through their device view), and back the
/// victims' rows; the policy's `position` [B, S] int64 and `state` [B, S, W] fp32 take the
/// tokens' positions and `top` [B, W] fp32; the store slots take the victims' positions, states,
/// ranks (`slot_ranks` [B, S] fp32: every cache slot's, computed before) and insertion numbers
/// seq_next + k; `seq_next` [1] += K and `recalled` [1] += the counts. Then the page digests
/// `digest` [B, P + 1, groups, 2 width] fp32 and `members` [B, P + 1] int64: the recalled
/// tokens' pages emptied (`whole_pages`) or rebuilt from their members, and the victims join
/// theirs (the keys: the `key_buffers`' channels side by side, as fp32). Columns past a row's
/// count write the trash slots and page as TierStore's reference does. Allocates its scratch
/// first, then writes; does not fail after. No host sync.
inline void recall_swap(const at::Tensor& picked, const at::Tensor& count, const at::Tensor& victims,
                        const at::Tensor& top, const at::Tensor& slot_ranks, bool whole_pages, int64_t page_size,
                        const std::vector<size_t>& key_buffers, const at::Tensor& position, const at::Tensor& state,
                        const std::vector<at::Tensor>& buffers, const std::vector<at::Tensor>& views,
                        const at::Tensor& store_position, const at::Tensor& store_rank, const at::Tensor& store_state,
                        const at::Tensor& store_seq, const at::Tensor& seq_next, const at::Tensor& digest,
                        const at::Tensor& members, const at::Tensor& recalled) {
  using Sig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool,
                   int64_t, c10::IntArrayRef, const at::Tensor&, const at::Tensor&, at::TensorList, at::TensorList,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const at::Tensor&, const at::Tensor&, const at::Tensor&);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvevict::recall_swap", "").typed<Sig>();
  const std::vector<int64_t> keys(key_buffers.begin(), key_buffers.end());
  op.call(picked, count, victims, top, slot_ranks, whole_pages, page_size, keys, position, state, buffers, views,
          store_position, store_rank, store_state, store_seq, seq_next, digest, members, recalled);
}

}  // namespace ops
}  // namespace detail
}  // namespace kvevict
