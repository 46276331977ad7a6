#pragma once
// Eviction-aware attention: softmax(q K^T * scale) V over a cache's live slots, whose
// probabilities feed the cache's scorer.

#include <kvevict/check.hpp>
#include <kvevict/mla_cache.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace kvevict {

/// Attention of the T tokens of the latest update over `layer`'s live slots, then
/// `cache.observe(layer, probs)`. Keys carry their RoPE, so slot order does not matter; inside
/// a multi-token append the mask is causal by position (key position <= query position).
///
/// \param q          [B, H, T, qk_dim] queries of the newest T tokens (positions
///                   seen_tokens - T .. seen_tokens - 1), cache dtype and device, 1 <= T <= size.
/// \param scale      logit scale; default 1/sqrt(qk_dim). DeepSeek-V3 with YaRN multiplies it
///                   by mscale^2: pass that here.
/// \param probs_out  if given, receives the fp32 probabilities [B, H, T, S] (slot order).
/// \return [B, H, T, v_dim] attention output in the cache dtype.
/// \throws c10::Error on a bad layer, shape, dtype or device, or what observe() throws; the
///         cache is unchanged then.
/// \note fp16 on CPU is computed in fp32 (LibTorch 1.13 has no CPU fp16 matmul); softmax is
///       always taken in fp32.
template <class Policy>
at::Tensor attend(const at::Tensor& q, BasicMlaCache<Policy>& cache, int64_t layer,
                  c10::optional<double> scale = c10::nullopt, at::Tensor* probs_out = nullptr) {
  const auto k = cache.keys(layer);
  const auto v = cache.values(layer);
  const int64_t S = k.size(2);
  detail::check_shape(q, "q", {cache.batch_size(), cache.num_heads(), -1, cache.options().qk_dim()},
                      {"B", "H", "T", "qk_dim"}, "[B, H, T, qk_dim]");
  KVEVICT_CHECK_TYPE(q.scalar_type() == cache.dtype(), "q must have the cache's dtype ", cache.dtype(), ", got ",
                     q.scalar_type());
  detail::check_device(q, "q", cache.device());
  const int64_t T = q.size(2);
  KVEVICT_CHECK(T >= 1 && T <= S, "q: T must be in [1, ", S, "] (live tokens), got ", T);

  const bool upcast = cache.device().is_cpu() && cache.dtype() == at::kHalf;
  const auto compute = upcast ? at::kFloat : cache.dtype();
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(cache.options().qk_dim()));
  auto logits = at::matmul(q.to(compute), k.to(compute).transpose(-2, -1)).mul(s);  // [B, H, T, S]
  if (T > 1) {
    const int64_t seen = cache.seen_tokens(layer);
    const auto pos = cache.positions(layer);  // [B, S]
    const auto query_pos = at::arange(seen - T, seen, pos.options());
    const auto future = pos.view({pos.size(0), 1, 1, S}).gt(query_pos.view({1, 1, T, 1}));
    logits = logits.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  const auto probs = at::softmax(logits, -1, at::kFloat);
  auto out = at::matmul(probs.to(compute), v.to(compute)).to(cache.dtype());
  cache.observe(layer, probs);
  if (probs_out) *probs_out = probs;
  return out;
}

}  // namespace kvevict
