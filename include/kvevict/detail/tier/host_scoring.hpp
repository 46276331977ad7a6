#pragma once
// The host path's work in recall's stages (TierHostPath, tier/host_path.hpp): the score stage,
// score_on_host(); two-level recall's pool scores in the pick stage, score_pool() per head and
// score_pools_head_mean(); the victims stage, victims_on_host(). Its twin's are in
// tier/tensor_path.hpp; the stages' types, tier/recall_stages.hpp; the scoring order both keep,
// tier/scoring.hpp.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/detail/tier/page_digests.hpp>
#include <kvevict/detail/tier/recall_stages.hpp>
#include <kvevict/detail/tier/row.hpp>
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
/// bound, or the mean bound, PageDigests::score_bounds()). Returns PageScores: sums [B, P]
/// fp64, P the most page slots of any row (at least 1), 0 past a row's pages and for a row
/// without real queries; mean_query, the heads' mean query [B, 1, Q, D] fp32 (reduced across
/// processes) when it scores by the heads' mean with a shared key, for the pool's scores
/// (score_pools_of_mean()). Throws c10::Error naming `layer` when an allocation fails (nothing
/// has changed then) or as the reducer does. Allocates its temporaries; syncs nothing.
template <class Core>
PageScores score_on_host(const std::vector<PageDigests>& digests, bool shared_key, bool head_mean_scoring,
                         int64_t layer, const at::Tensor& query, double scale, const LayerState& L, const Core& core) {
  PageScores scores;
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
    if (shared_key) scores.mean_query = mean;
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
  scores.sums = score_pages(head_mean_scoring, layer, core, fail, per_head, summand, of_mean);
  return scores;
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

/// Two-level recall's exact scores under TierScoring::kHeadMean with one shared key (the latent
/// layout), from the heads' mean query the page scoring computed and reduced: `row_mean(b)`
/// row b's real columns of it ([1, Qr, width] fp32, undefined for none; real_queries()), per
/// row its logits over the pool keys `keys[b]` [n_b, 1, width], one softmax, summed over the
/// columns as fixed-point terms: [B, N] fp64, what score_pools_head_mean() gives, without
/// computing or reducing the mean again. Allocates its temporaries; syncs nothing.
template <class RowMean>
at::Tensor score_pools_of_mean(const std::vector<at::Tensor>& keys, RowMean&& row_mean, int64_t N, double scale) {
  const auto B = static_cast<int64_t>(keys.size());
  auto exact = at::zeros({B, N}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t b = 0; b < B; ++b) {
    const auto& k = keys[static_cast<size_t>(b)];
    const auto m = row_mean(b);
    const int64_t n = k.size(0);
    if (!m.defined() || n == 0) continue;
    const auto logits = at::matmul(m[0], k.view({n, k.size(2)}).t()).mul_(scale);  // [Qr, n]
    exact.select(0, b).narrow(0, 0, n).copy_(at::sum(fixed_terms(at::softmax(logits, -1)), at::IntArrayRef{0}, false, at::kDouble));
  }
  return exact;
}

/// Two-level recall's exact scores under TierScoring::kHeadMean: per row b and real query
/// column, the heads' mean of scale * q.k over the row's pool keys `keys[b]` [n_b, G, width]
/// (fp32, CPU; tier token j of the pool at j), then one softmax over the pool, summed over the
/// columns as fixed-point terms (fixed_terms): [B, N] fp64 (0 past a row's pool and for a row
/// without real queries). `row_queries(b)`: row b's real queries (real_queries()) of `H` heads
/// and `Q` columns. With one key shared by every head (`shared_key`, the latent layout) the
/// heads' mean logit is the logit of the heads' mean query, as the pages are scored: the
/// queries' fp64 sum over the heads is reduced across processes, then one product per column
/// (H times fewer than per head). Otherwise (one key per head) the heads' fp64 sums of the
/// logits are reduced before the softmax (head_sum() / head_mean()), as the pages' bounds are.
/// Allocates its temporaries; syncs nothing; throws as the reducer does.
template <class RowQueries, class Core>
at::Tensor score_pools_head_mean(int64_t layer, const std::vector<at::Tensor>& keys, RowQueries&& row_queries,
                                 bool shared_key, int64_t H, int64_t Q, int64_t N, double scale, const Core& core) {
  const auto B = static_cast<int64_t>(keys.size());
  const int64_t width = shared_key ? keys.at(0).size(2) : N;  // per column: key channels, or pool tokens
  auto sums = at::zeros({B, Q, width}, at::TensorOptions().dtype(at::kDouble));  // per column: the heads' sum
  std::vector<int64_t> columns(static_cast<size_t>(B), 0);
  for (int64_t b = 0; b < B; ++b) {
    const auto& k = keys[static_cast<size_t>(b)];
    const auto q = row_queries(b);
    if (!q.defined() || k.size(0) == 0) continue;
    const int64_t n = k.size(0), G = k.size(1), W = k.size(2), qr = q.numel() / (H * W);
    auto column_sums = sums.select(0, b).narrow(0, Q - qr, qr);
    if (shared_key) {  // the queries' sum over the heads: [Qr, W]
      column_sums.copy_(head_sum(q.view({1, H, qr, W})).view({qr, W}));
    } else {  // the logits' sum over the heads: [H, Qr, n] summed. One key group (a process
              // holding one head): one plain matmul, not a broadcast over heads.
      const auto logits = (G == 1 ? at::matmul(q.view({H * qr, W}), k.view({n, W}).t())
                                  : at::matmul(q.view({H, qr, W}), k.permute({1, 2, 0})))
                              .view({H, qr, n})
                              .mul_(scale);
      column_sums.narrow(1, 0, n).copy_(head_sum(logits.unsqueeze(0)).view({qr, n}));
    }
    columns[static_cast<size_t>(b)] = qr;
  }
  reduce_scores(layer, core, sums);  // the sums over every process's heads, then the softmax
  auto exact = at::zeros({B, N}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qr = columns[static_cast<size_t>(b)], n = keys[static_cast<size_t>(b)].size(0);
    if (qr == 0) continue;
    const auto column_sums = sums.select(0, b).narrow(0, Q - qr, qr).unsqueeze(0);
    const auto& k = keys[static_cast<size_t>(b)];
    const auto mean = shared_key
                          ? at::matmul(head_mean(column_sums, core)[0], k.view({n, k.size(2)}).t()).mul_(scale)  // [Qr, n]
                          : head_mean(column_sums.narrow(2, 0, n), core)[0];
    exact.select(0, b).narrow(0, 0, n).copy_(at::sum(fixed_terms(at::softmax(mean, -1)), at::IntArrayRef{0}, false, at::kDouble));
  }
  return exact;
}

/// recall's victims stage on the host: Victims (candidates, slots, position, top; CPU), per
/// active row a loop over L's live slots (positions, scorer ranks) and a partial sort of the
/// `K` lowest in eviction order (drops_before()), O(capacity + K log K); nothing found for
/// K = 0. Allocates.
template <class Core>
Victims victims_on_host(const LayerState& L, const Core& core, int64_t layer, int64_t K) {
  const int64_t B = L.position.size(0), W = L.state.size(2);
  const auto longs = at::TensorOptions().dtype(at::kLong);
  Victims out;
  out.candidates = at::zeros({B}, longs);
  out.slots = at::zeros({B, K}, longs);
  out.position = at::zeros({B, K}, longs);
  out.top = at::zeros({B, W}, at::TensorOptions().dtype(at::kFloat));
  if (K == 0) return out;  // nothing to replace (a budget of 0)
  const int64_t* pos = L.position.template data_ptr<int64_t>();
  const float* st = L.state.template data_ptr<float>();
  struct Cand {
    float rank;
    int64_t position, slot;
  };
  std::vector<Cand> cands;
  for (int64_t b = 0; b < B; ++b) {
    if (!core.active[b]) continue;
    const auto [from, to] = victim_range(core, L, layer, b);
    cands.clear();
    for (int64_t s = 0; s < L.len[b]; ++s) {
      const int64_t p = pos[b * L.slots + s];
      if (p >= from && p < to) cands.push_back({core.scorer.rank(st + (b * L.slots + s) * W), p, s});
    }
    out.candidates.template data_ptr<int64_t>()[b] = static_cast<int64_t>(cands.size());
    if (cands.empty()) continue;
    const auto before = [](const Cand& x, const Cand& y) { return drops_before(x.rank, x.position, y.rank, y.position); };
    const int64_t best = std::max_element(cands.begin(), cands.end(), before)->slot;
    std::copy(st + (b * L.slots + best) * W, st + (b * L.slots + best + 1) * W, out.top.template data_ptr<float>() + b * W);
    const auto k = std::min<std::ptrdiff_t>(K, static_cast<std::ptrdiff_t>(cands.size()));
    std::partial_sort(cands.begin(), cands.begin() + k, cands.end(), before);
    for (std::ptrdiff_t j = 0; j < k; ++j) {
      out.slots.template data_ptr<int64_t>()[b * K + j] = cands[j].slot;
      out.position.template data_ptr<int64_t>()[b * K + j] = cands[j].position;
    }
  }
  return out;
}

}  // namespace detail
}  // namespace kvevict
