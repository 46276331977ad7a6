#pragma once
// The tier's host path (a cache whose policy takes the host path: everything on the CPU):
// TierHostPath, with the steps of its twin TierTensorPath (tier/tensor_path.hpp) under the same
// names in the same order: take and keep a pass's evicted tokens, settle, and recall's score
// and swap. The page scoring, score_on_host(): per head, or by the heads' mean logit
// (TierScoring::kHeadMean), reduced across processes like observations. Also two-level
// recall's pool scoring, per head or by the heads' mean, which both paths run on the host.
// The steps both paths share (the reduction, the heads' mean, their order) are tier/scoring.hpp;
// the plan between score and swap is the tier's own (LayerTier::plan_recall()).

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/detail/tier/page_digests.hpp>
#include <kvevict/detail/tier/scoring.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kvevict {
namespace detail {

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
  at::Tensor sums;
  allocating([&] { sums = at::zeros({B, P}, at::TensorOptions().dtype(at::kDouble)); }, fail);
  double* const out = sums.template data_ptr<double>();
  const auto per_head = [&] {
    for (int64_t b = 0; b < B; ++b) {
      const auto& dg = digests[static_cast<size_t>(b)];
      const auto q = real_queries(core, L, query, b, shared_key);
      if (q.defined() && dg.pages() > 0) dg.score(q, scale, out + b * P);
    }
    return sums;
  };
  const auto summand = [&] {  // [B, H, ...]: the queries (latent) or every row's bounds [H, Q, P]
    if (shared_key) return query;
    auto bounds = at::zeros({B, H, Q, P}, at::TensorOptions().dtype(at::kFloat));  // 0 where no query or page
    for (int64_t b = 0; b < B; ++b) {
      const auto& dg = digests[static_cast<size_t>(b)];
      const auto q = real_queries(core, L, query, b, shared_key);
      if (q.defined() && dg.pages() > 0)
        bounds.select(0, b).narrow(1, Q - q.size(1), q.size(1)).narrow(2, 0, dg.slots()).copy_(dg.bound(q, scale));
    }
    return bounds;
  };
  const auto of_mean = [&](const at::Tensor& mean) {  // latent [B, 1, Q, D], expanded [B, 1, Q, P]
    for (int64_t b = 0; b < B; ++b) {
      const auto& dg = digests[static_cast<size_t>(b)];
      const auto m = real_queries(core, L, mean, b, shared_key);  // latent [1, Qr, D], expanded [1, Qr, P]
      if (!m.defined() || dg.pages() == 0) continue;
      if (shared_key)
        dg.score(m, scale, out + b * P);
      else
        dg.score_bounds(m.narrow(2, 0, dg.slots()), out + b * P);
    }
    return sums;
  };
  return score_pages(head_mean_scoring, layer, core, fail, per_head, summand, of_mean);
}

/// Two-level recall's exact scores per head of a row's pool keys `keys` [n, G, width] (fp32,
/// CPU) for its queries q [G, M, width] (as PageDigests::score()): per query a softmax over the
/// pool of scale * q.k, summed over the queries as fixed-point terms (fixed_terms) into out[j]
/// (fp64, for the pool's token j). Allocates its temporaries.
inline void score_pool(const at::Tensor& keys, const at::Tensor& q, double scale, const at::Tensor& out) {
  const auto logits = at::matmul(q, keys.permute({1, 2, 0})).mul_(scale);  // [G, M, n]
  out.narrow(0, 0, keys.size(0))
      .copy_(at::sum(fixed_terms(at::softmax(logits, -1)), at::IntArrayRef{0, 1}, false, at::kDouble));
}

/// Two-level recall's exact scores under TierScoring::kHeadMean: per row b and real query
/// column, the heads' mean of scale * q.k over the row's pool keys `keys[b]` [n_b, G, width]
/// (fp32, CPU; tier token j of the pool at j), then one softmax over the pool, summed over the
/// columns as fixed-point terms (fixed_terms): [B, N] fp64 (0 past a row's pool and for a row
/// without real queries). `row_queries(b)`: row b's real queries (real_queries()) of `H` heads
/// and `Q` columns. The heads' fp64 sums of the logits are reduced across processes before the
/// softmax (head_sum() / head_mean()), as the pages' are. Allocates its temporaries; syncs
/// nothing; throws as the reducer does.
template <class RowQueries, class Core>
at::Tensor score_pools_head_mean(int64_t layer, const std::vector<at::Tensor>& keys, RowQueries&& row_queries,
                                 int64_t H, int64_t Q, int64_t N, double scale, const Core& core) {
  const auto B = static_cast<int64_t>(keys.size());
  auto sums = at::zeros({B, Q, N}, at::TensorOptions().dtype(at::kDouble));  // per column: the heads' sum
  std::vector<int64_t> columns(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const auto& k = keys[static_cast<size_t>(b)];
    const auto q = row_queries(b);
    if (!q.defined() || k.size(0) == 0) continue;
    const int64_t n = k.size(0), G = k.size(1), W = k.size(2), qr = q.numel() / (H * W);
    // [H, Qr, n]. One key group (latent, or a process holding one head): one plain matmul, not
    // a broadcast over heads, which would copy the pool's keys once per head.
    const auto logits = (G == 1 ? at::matmul(q.view({H * qr, W}), k.view({n, W}).t())
                                : at::matmul(q.view({H, qr, W}), k.permute({1, 2, 0})))
                            .view({H, qr, n})
                            .mul_(scale);
    sums.select(0, b).narrow(0, Q - qr, qr).narrow(1, 0, n).copy_(head_sum(logits.unsqueeze(0)).view({qr, n}));
    columns[static_cast<size_t>(b)] = qr;
  }
  reduce_scores(layer, core, sums);  // the sums over every process's heads, then the softmax
  auto exact = at::zeros({B, N}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qr = columns[static_cast<size_t>(b)], n = keys[static_cast<size_t>(b)].size(0);
    if (qr == 0) continue;
    const auto mean = head_mean(sums.select(0, b).narrow(0, Q - qr, qr).narrow(1, 0, n).unsqueeze(0), core)[0];
    exact.select(0, b).narrow(0, 0, n).copy_(at::sum(fixed_terms(at::softmax(mean, -1)), at::IntArrayRef{0}, false, at::kDouble));
  }
  return exact;
}

/// The tier's host path: each step runs at once, in place, on the CPU (LayerTier's storage and
/// the cache's contiguous CPU buffers). Holds nothing between steps.
class TierHostPath {
 public:
  /// A pass's evicted tokens (its plan `pass`: n, new lengths, moves), before the moves
  /// overwrite their rows in `buffers`: into the tier at once (LayerTier::take_pass()). Every
  /// allocation first: a throw (c10::Error naming the tier) changes nothing.
  template <class Tier, class Pass, class Rank>
  void take(Tier& tier, const Pass& pass, const LayerState& L, const std::vector<at::Tensor>& buffers, Rank&& rank) {
    tier.take_pass(pass, L.position, L.state, buffers, L.slots, rank);
  }
  /// After the pass's commit: nothing is pending here.
  void keep() noexcept {}
  /// Before every read of the tier: nothing is held here.
  template <class Tier, class Rank>
  void settle(Tier& /*tier*/, Rank&& /*rank*/) {}

  /// recall's score step: score_on_host(); the plan reads L's own positions and states and,
  /// for a two-level `pool`, the query itself.
  template <class Core>
  RecallScores score(std::vector<PageDigests>& digests, const TierKeys& keys, int64_t /*groups*/, int64_t /*width*/,
                     int64_t layer, const at::Tensor& query, double scale, bool pool, const LayerState& L,
                     const Core& core) {
    return {score_on_host(digests, keys.shared, keys.head_mean, layer, query, scale, L, core), L.position, L.state,
            pool ? query.contiguous() : at::Tensor()};
  }

  /// recall's swap step: LayerTier::swap() of each row's picked tokens with its victims, in
  /// place, then `exchange(slots, positions, states)` gives the victims' slots the recalled
  /// tokens' positions and the plan's state ([B, V] int64, [B, V] int64, [B, V, W] fp32, CPU;
  /// the trash slot where a row has fewer). Allocates those three first (a throw there changes
  /// nothing); nothing after, and does not throw then.
  template <class Tier, class Rank, class Exchange>
  void swap(Tier& tier, const RecallPlan& plan, const LayerState& L, const std::vector<at::Tensor>& buffers,
            int64_t /*layer*/, Rank&& rank, Exchange&& exchange) {
    const auto B = static_cast<int64_t>(plan.picked.size()), W = L.state.size(2);
    int64_t V = 0;
    for (const auto& p : plan.picked) V = std::max(V, static_cast<int64_t>(p.size()));
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    const auto slots = at::full({B, V}, L.slots - 1, i64), positions = at::full({B, V}, -1, i64);
    const auto states = at::zeros({B, V, W}, at::TensorOptions().dtype(at::kFloat));
    auto* s = slots.template data_ptr<int64_t>();
    auto* st = states.template data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const auto& picked = plan.picked[static_cast<size_t>(b)];
      if (picked.empty()) continue;
      const auto& victims = plan.victims[static_cast<size_t>(b)];
      const auto& top = plan.top[static_cast<size_t>(b)];
      tier.swap(b, picked, victims, buffers, L.slots, L.position.template data_ptr<int64_t>(),
                L.state.template data_ptr<float>(), rank, positions.template data_ptr<int64_t>() + b * V);
      for (size_t k = 0; k < victims.size(); ++k) {
        s[b * V + static_cast<int64_t>(k)] = victims[k];
        std::copy(top.begin(), top.end(), st + (b * V + static_cast<int64_t>(k)) * W);
      }
    }
    exchange(slots, positions, states);
  }

  /// Device bytes held: none.
  int64_t device_bytes() const noexcept { return 0; }
  void release_device() noexcept {}
};

}  // namespace detail
}  // namespace kvevict
