#pragma once
// The host tier's page scoring that both paths share (score_on_host() in tier/host_scoring.hpp,
// TierTensorPath::score() in tier/tensor_path.hpp): which query columns count, the reduction of
// scores across processes, TierScoring::kHeadMean's mean over heads around it, and the order
// of those steps (score_pages()). What recall's stages hand each other is
// tier/recall_stages.hpp. Neither path file includes the other.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/reduction.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <limits>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// What a tier's digests are made of: the buffers that hold the keys (their pieces, per key
/// group, side by side: the latent [ckv | kpe], or the expanded keys of one head), the cached
/// dtype and the page size.
struct TierKeys {
  std::vector<size_t> buffers;  // indices of the key buffers, each with `groups` pieces per token
  at::ScalarType dtype = at::kFloat;
  int64_t page_size = 16;
  bool shared = false;     // one key shared by every head (the latent layout), else one per head
  bool head_mean = false;  // TierScoring::kHeadMean
};

/// The candidates' first position and the first of the recent window as it was before the
/// latest append, of row b of `L` at `layer`: victims lie in [from, to). A truncate of that
/// append (rejected drafts) then never finds a tier token inside its window.
template <class Core>
std::pair<int64_t, int64_t> victim_range(const Core& core, const LayerState& L, int64_t layer, int64_t b) {
  const auto& e = core.layer_eviction[layer];
  return {e.n_sink(), L.seen[b] - L.last_new[b] - e.n_recent()};
}

/// More than any position of `L` (its rows' seen tokens, at least 1; host): what sizes the
/// tensor path's page ids.
inline int64_t max_position(const LayerState& L) { return std::max<int64_t>(max_of(L.seen), 1); }

/// Row b's real query columns (core.first_real(), as observe()) of `q` [B, Hq, Q, W] (CPU):
/// [1, Hq x Qr, W] when every head meets one shared key (`shared_key`, the latent layout), else
/// [Hq, Qr, W] (head h meets key group h); contiguous. Undefined when the row has none.
template <class Core>
at::Tensor real_queries(const Core& core, const LayerState& L, const at::Tensor& q, int64_t b, bool shared_key) {
  const int64_t Q = q.size(2), first = core.first_real(L, b, Q), Hq = q.size(1);
  if (first >= Q) return at::Tensor();
  auto r = q.select(0, b).narrow(1, first, Q - first);  // [Hq, Qr, W]
  return (shared_key ? r.reshape({1, Hq * (Q - first), q.size(3)}) : r).contiguous();
}

/// Which of `Q` query columns are real, per row of `L` (core.first_real(): pads and free rows
/// are not), as B x Q flags (1: real) in a host vector: no ATen call (the tensor path's mirror
/// of them is uploaded only when they change).
template <class Core>
std::vector<int64_t> real_flags(const Core& core, const LayerState& L, int64_t B, int64_t Q) {
  std::vector<int64_t> flags(static_cast<size_t>(B * Q), 0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t q = core.first_real(L, b, Q); q < Q; ++q) flags[static_cast<size_t>(b * Q + q)] = 1;
  }
  return flags;
}

/// Which of `Q` query columns are real, per row of `L` (core.first_real(): pads and free rows
/// are not): [B, Q] bool, on the CPU.
template <class Core>
at::Tensor real_columns(const Core& core, const LayerState& L, int64_t B, int64_t Q) {
  auto real = at::zeros({B, Q}, at::TensorOptions().dtype(at::kBool));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = core.first_real(L, b, Q);
    if (first < Q) real.select(0, b).narrow(0, first, Q - first).fill_(true);
  }
  return real;
}

/// Reduces recall's scores `sums` (fp64, on the CPU or the cache's device) across processes
/// like observations (core's reduce_contributions, if any), on the cache's device (NCCL reduces
/// only there); `sums` stays where it was.
template <class Core>
void reduce_scores(int64_t layer, const Core& core, at::Tensor& sums) {
  const auto& reducer = core.options.reduce_contributions();
  if (!reducer) return;
  if (sums.device() == core.device) {
    reducer(layer, sums);
    return;
  }
  auto on_device = sums.to(core.device);
  reducer(layer, on_device);
  sums = on_device.to(sums.device());
}

/// Per query a softmax of `logits` [B, G, M, P] fp32 over the columns `none` [B, 1, 1, P] bool
/// leaves out, summed as fixed-point terms (fixed_terms, exact in fp64 in any order) over the
/// queries whose `cols` [B, 1|G, M, 1] bool is set: [B, P] fp64, 0 where `none` is set and in a
/// row with no columns left or no queries. Writes `logits`. No sync. Pages' scores and
/// two-level recall's pool scores.
inline at::Tensor softmax_sums(at::Tensor logits, const at::Tensor& none, const at::Tensor& cols) {
  logits.masked_fill_(none, -std::numeric_limits<float>::infinity());
  const auto probs = at::softmax(logits, -1).masked_fill_(none, 0);  // a row with none left: all NaN, then 0
  return at::sum(fixed_terms(probs).masked_fill_(cols.logical_not(), 0), at::IntArrayRef{1, 2}, false, at::kDouble);
}

/// An error of reduce_scores() on its way out of allocating(), which would call any c10::Error
/// an allocation failure: reduce_scores_within() throws it, allocating_with_reductions()
/// rethrows the error it holds.
struct ReductionFailed {
  std::exception_ptr error;
};

/// reduce_scores() inside allocating_with_reductions(): its error leaves as ReductionFailed.
template <class Core>
void reduce_scores_within(int64_t layer, const Core& core, at::Tensor& sums) {
  try {
    reduce_scores(layer, core, sums);
  } catch (...) {
    throw ReductionFailed{std::current_exception()};
  }
}

/// allocating(allocate, fail) around work that reduces with reduce_scores_within(): the
/// reduction's own error comes out as it was thrown.
template <class Allocate, class Fail>
void allocating_with_reductions(Allocate&& allocate, Fail&& fail) {
  try {
    allocating(std::forward<Allocate>(allocate), std::forward<Fail>(fail));
  } catch (const ReductionFailed& r) {
    std::rethrow_exception(r.error);
  }
}

/// TierScoring::kHeadMean's mean over the heads, in two steps around the reduction across
/// processes (reduce_scores, not an allocation: it throws its own error): head_sum() of
/// `per_head` [B, H, ...] fp32 (queries, or Quest bounds) is their sum over dim 1 in fp64,
/// [B, 1, ...]; once reduced, every process holds the sum over every process's heads, and
/// head_mean() divides it by core.divisor_heads() and rounds it to fp32 once. Equal on every
/// process; equal to one process with every head whenever the fp64 sums are exact, which they
/// are unless one channel's values across the H heads differ in magnitude by more than
/// 2^(29 - log2 H) (2^22 at 128 heads); even then they differ from it by fp64 rounding before
/// the one rounding to fp32. Both allocate.
inline at::Tensor head_sum(const at::Tensor& per_head) { return per_head.sum(1, /*keepdim=*/true, at::kDouble); }
template <class Core>
at::Tensor head_mean(const at::Tensor& sum, const Core& core) {
  return sum.div(static_cast<double>(core.divisor_heads())).to(at::kFloat);
}

/// LayerTier::recall()'s page scoring, in the order both paths keep: per head, `per_head()`
/// scores every row's pages ([B, P] fp64) and the scores are reduced across processes
/// (reduce_scores); by the heads' mean (`head_mean_scoring`, TierScoring::kHeadMean),
/// head_sum() of `summand()` ([B, H, ...] fp32: the queries, or every row's bounds) is reduced
/// before the softmax and `of_mean(head_mean())` scores the pages with the mean ([B, P] fp64).
/// Returns the scores where the callbacks put them. The callbacks run inside
/// allocating(..., `fail`), the reductions outside it (they throw their own errors).
template <class Core, class Fail, class PerHead, class Summand, class OfMean>
at::Tensor score_pages(bool head_mean_scoring, int64_t layer, const Core& core, Fail&& fail, PerHead&& per_head,
                       Summand&& summand, OfMean&& of_mean) {
  at::Tensor scores, sum;  // sum: kHeadMean's sum over this process's heads (queries, or bounds)
  allocating([&] {
    if (head_mean_scoring)
      sum = head_sum(summand());
    else
      scores = per_head();
  }, fail);
  if (!head_mean_scoring) {
    reduce_scores(layer, core, scores);
    return scores;
  }
  reduce_scores(layer, core, sum);  // the sums over every process's heads, then the softmax
  allocating([&] { scores = of_mean(head_mean(sum, core)); }, fail);
  return scores;
}

}  // namespace detail
}  // namespace kvevict
