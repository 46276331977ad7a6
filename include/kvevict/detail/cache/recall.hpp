#pragma once
// CacheBase's recall (cache_base.hpp declares it): check_recall() at the public call, then
// recall_rows() runs the layer's tier through recall's stages (detail/tier/recall_stages.hpp).

#include <kvevict/cache_base.hpp>

namespace kvevict {
namespace detail {

template <class Policy>
void CacheBase<Policy>::check_recall(const char* call, int64_t layer, const at::Tensor& query, double scale,
                                     int64_t tokens, int64_t rescore) const {
  check_not_moved(call);
  policy_.size(layer);  // checks the layer
  KVEVICT_CHECK(tier_tokens_ > 0, call, ": this cache has no host tier (tier_tokens is 0 in its options)");
  const auto& L = steps().at(layer);
  const auto& core = steps().core();
  KVEVICT_CHECK(L.open_q == 0, call, ": layer ", layer,
                " has an open observation (observe_begin without observe_end); end or discard it first");
  const int64_t page_size = tiers_[layer].page_size();
  KVEVICT_CHECK_VALUE(std::isfinite(scale) && scale > 0, call, ": scale must be finite and > 0, got ", scale);
  KVEVICT_CHECK_VALUE(tokens >= 0 && tokens <= EvictionOptions::kMaxTokens, call,
                      ": tokens must be in [0, 2^40], got ", tokens);
  KVEVICT_CHECK_VALUE(rescore >= 0 && rescore <= EvictionOptions::kMaxTokens, call,
                      ": rescore must be in [0, 2^40], got ", rescore);
  KVEVICT_CHECK_VALUE(rescore <= tokens || rescore >= page_size, call, ": rescore must be <= tokens (", tokens,
                      ", whole pages) or hold at least one page (tier_page_size ", page_size,
                      ") for two-level recall, got ", rescore);
  if (!core.check) return;
  // One read of the device for every row: per row, whether a real column is not finite.
  const int64_t B = query.size(0), Q = query.size(2);
  bool all_real = true;
  for (int64_t b = 0; b < B; ++b) all_real = all_real && core.first_real(L, b, Q) == 0;
  // The common case: every column real, and a finite sum (a NaN or an infinity anywhere makes
  // the sum non-finite; an overflow of finite values only sends it to the exact check below).
  if (all_real && std::isfinite(query.sum(at::kDouble).template item<double>())) return;
  const auto real = real_columns(core, L, B, Q).view({B, 1, Q, 1}).to(query.device());
  const auto bad = at::isfinite(query).logical_not_().logical_and_(real).flatten(1).any(1).cpu();
  for (int64_t b = 0; b < B; ++b) {
    KVEVICT_CHECK_VALUE(!bad[b].template item<bool>(), call, ": the queries of row ", b,
                        " must be finite, got a NaN or an infinity");
  }
}

template <class Policy>
at::Tensor CacheBase<Policy>::recall_rows(int64_t layer, const at::Tensor& query, double scale, int64_t tokens,
                                          int64_t rescore) {
  auto& L = steps().at(layer);
  policy_.flush(layer);  // lazy_reduction: the victims leave the cache with every observation applied
  const RecallInput in{query, scale, tokens, rescore, std::min(tokens, L.slots)};
  auto recalled = tiers_[layer].recall(
      layer, in, L, steps().core(), buffers_[layer], steps().device_counters(layer),
      [&](const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& states) {
        steps().exchange(layer, slots, positions, states);
      });
  if (policy_.host_path()) {  // the host path wrote the buffers with memcpy
    for (auto& buf : buffers_[layer]) buf.unsafeGetTensorImpl()->bump_version();
  }
  return recalled;
}

}  // namespace detail
}  // namespace kvevict
