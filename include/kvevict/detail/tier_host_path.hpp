#pragma once
// The host tier's page scoring on the host path (LayerTier::recall() on the CPU), beside
// score_on_device() in tier_tensor_path.hpp: per head, or by the heads' mean logit
// (TierScoring::kHeadMean), reduced across processes like observations.

#include <kvevict/check.hpp>
#include <kvevict/detail/layer_state.hpp>
#include <kvevict/detail/page_digests.hpp>
#include <kvevict/detail/tier_tensor_path.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kvevict {
namespace detail {

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

/// LayerTier::recall()'s scoring on the host path: every row's pages (`digests`, one
/// PageDigests per row) scored with `query` [B, H, Q, D] (fp32, CPU, contiguous): per head
/// (PageDigests::score(), then reduce_scores()) or, `head_mean`, by the heads' mean
/// (head_sum() of the queries when `shared_key`, the latent layout, else of every row's
/// bounds; reduced across processes before the softmax; head_mean(); then the mean query's
/// bound, or the mean bound, PageDigests::score_bounds()). Returns [B, P] fp64, P the most page
/// slots of any row (at least 1), 0 past a row's pages and for a row without real queries.
/// Throws c10::Error naming `layer` when an allocation fails (nothing has changed then) or as
/// the reducer does. Allocates its temporaries; syncs nothing.
template <class Core>
at::Tensor score_on_host(const std::vector<PageDigests>& digests, bool shared_key, bool head_mean_scoring,
                         int64_t layer, const at::Tensor& query, double scale, const LayerState& L, const Core& core) {
  const auto B = static_cast<int64_t>(digests.size());
  const int64_t H = query.size(1), Q = query.size(2);
  const auto fail = [&](const std::string& why) {
    KVEVICT_CHECK(false, "recall: could not score the pages of layer ", layer, ": ", why);
  };
  int64_t P = 1;
  for (const auto& dg : digests) P = std::max(P, dg.slots());
  at::Tensor sums, sum;  // sum: kHeadMean's sum over this process's heads (queries, or bounds)
  allocating([&] {
    sums = at::zeros({B, P}, at::TensorOptions().dtype(at::kDouble));
    if (head_mean_scoring && shared_key) {
      sum = head_sum(query);  // [B, 1, Q, D]
      return;
    }
    // Per head: the scores. kHeadMean, a key per head: every row's bounds [H, Q, P] side by
    // side, 0 where it has no query or page.
    const auto bounds = head_mean_scoring ? at::zeros({B, H, Q, P}, at::TensorOptions().dtype(at::kFloat)) : at::Tensor();
    for (int64_t b = 0; b < B; ++b) {
      const auto& dg = digests[static_cast<size_t>(b)];
      const auto q = real_queries(core, L, query, b, shared_key);
      if (!q.defined() || dg.pages() == 0) continue;
      if (head_mean_scoring)
        bounds.select(0, b).narrow(1, Q - q.size(1), q.size(1)).narrow(2, 0, dg.slots()).copy_(dg.bound(q, scale));
      else
        dg.score(q, scale, sums.template data_ptr<double>() + b * P);
    }
    if (head_mean_scoring) sum = head_sum(bounds);  // [B, 1, Q, P]
  }, fail);
  if (!head_mean_scoring) {
    reduce_scores(layer, core, sums);
    return sums;
  }
  reduce_scores(layer, core, sum);  // the sums over every process's heads, then the softmax
  allocating([&] {
    const auto mean = head_mean(sum, core);
    for (int64_t b = 0; b < B; ++b) {
      const auto& dg = digests[static_cast<size_t>(b)];
      const auto m = real_queries(core, L, mean, b, shared_key);  // latent [1, Qr, D], expanded [1, Qr, P]
      if (!m.defined() || dg.pages() == 0) continue;
      double* out = sums.template data_ptr<double>() + b * P;
      if (shared_key)
        dg.score(m, scale, out);
      else
        dg.score_bounds(m.narrow(2, 0, dg.slots()), out);
    }
  }, fail);
  return sums;
}

}  // namespace detail
}  // namespace kvevict
