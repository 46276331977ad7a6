#pragma once
// Eviction-aware attention over a cache's live slots, whose probabilities feed the cache's
// scorer: attend() for the expanded layout, attend_absorbed() for the latent layout.

#include <kvevict/check.hpp>
#include <kvevict/mla_cache.hpp>
#include <kvevict/mla_latent_cache.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <utility>

namespace kvevict {
namespace detail {

/// Checks a query tensor [B, H, T, width] against `cache` (dtype, device) and returns T,
/// which must be in [1, seen_tokens(layer)] on a layer that holds a token.
template <class Cache>
int64_t check_query(const at::Tensor& q, const char* name, const Cache& cache, int64_t layer, int64_t width,
                    const char* width_name) {
  const std::string doc = std::string("[B, H, T, ") + width_name + "]";
  check_tensor(q, name, cache.device());
  check_shape(q, name, {cache.batch_size(), cache.num_heads(), -1, width}, {"B", "H", "T", width_name}, doc.c_str());
  KVEVICT_CHECK_TYPE(q.scalar_type() == cache.dtype(), name, " must have the cache's dtype ", cache.dtype(), ", got ",
                     q.scalar_type());
  check_device(q, name, cache.device());
  const int64_t T = q.size(2), seen = cache.seen_tokens(layer);
  KVEVICT_CHECK(cache.size(layer) >= 1, name, ": the layer holds no token (update() it first)");
  KVEVICT_CHECK(T >= 1 && T <= seen, name, ": T must be in [1, ", seen, "] (seen tokens), got ", T);
  return T;
}

/// The dtype attention is computed in: the cache's, except fp16 on CPU (no fp16 matmul in
/// LibTorch 1.13), which is computed in fp32.
template <class Cache>
at::ScalarType compute_dtype(const Cache& cache) {
  return cache.device().is_cpu() && cache.dtype() == at::kHalf ? at::kFloat : cache.dtype();
}

/// Softmax over scaled logits [B, H, T, S] (slot order) of the newest T tokens of a dense batch
/// (every row as long as S, no pad: see attend_rows() for the others), causal by position
/// inside a multi-token append. Observes the fp32 probabilities (if `observe`) and returns them.
template <class Cache>
at::Tensor observed_softmax(at::Tensor logits, Cache& cache, int64_t layer, bool observe) {
  const int64_t B = logits.size(0), T = logits.size(2), S = logits.size(3);
  if (T > 1) {
    const auto pos = cache.positions(layer);                           // [B, S]
    const auto query_pos = cache.policy().query_positions(layer, T);  // [B, T]
    const auto future = pos.view({B, 1, 1, S}).gt(query_pos.view({B, 1, T, 1}));
    logits = logits.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  auto probs = at::softmax(logits, -1, at::kFloat);
  if (observe) cache.observe(layer, probs);
  return probs;
}

/// Attention row by row, for a batch that is not dense (rows of different lengths, pad query
/// columns, idle or free rows): row b runs on its own real query columns [q0, T) and live
/// slots [0, len) only, so every matmul and softmax has exactly the shapes the request has
/// alone in a batch-1 cache. Batched kernels round differently for different shapes (their
/// reductions block by T and S), so one batched product over the padded [B, H, T, S] would
/// make a request's outputs and scores depend on the other rows. `row(b, q0, c, len)` returns
/// {logits [1, H, c, len], values [1, H or 1, len, w]} in the compute dtype `dt`. Pad columns
/// and free rows get zero output and probabilities. Observes the probabilities [B, H, T, S]
/// once (if `observe`). \note Reads the query positions on the host (a sync on CUDA).
template <class Cache, class Row>
at::Tensor attend_rows(Cache& cache, int64_t layer, int64_t T, int64_t width, at::ScalarType dt, bool observe,
                       at::Tensor* probs_out, Row&& row) {
  const int64_t B = cache.batch_size(), H = cache.num_heads(), S = cache.size(layer);
  const auto pos = cache.positions(layer);                                // [B, S], -1 dead
  const auto query_pos = cache.policy().query_positions(layer, T);       // [B, T], -1 pad
  const auto host_qpos = query_pos.to(at::kCPU).contiguous();
  const int64_t* qp = host_qpos.template data_ptr<int64_t>();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(cache.device());
  auto probs = at::zeros({B, H, T, S}, f32);
  auto out = at::zeros({B, H, T, width}, f32.dtype(dt));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = cache.size(layer, b);
    int64_t q0 = 0;  // pads lead: real columns are [q0, T)
    while (q0 < T && qp[b * T + q0] < 0) ++q0;
    const int64_t c = T - q0;
    if (c == 0 || len == 0) continue;
    const auto lv = row(b, q0, c, len);
    const auto seen = pos.select(0, b).narrow(0, 0, len).view({1, 1, 1, len}).le(
        query_pos.select(0, b).narrow(0, q0, c).view({1, 1, c, 1}));
    const auto p = at::softmax(lv.first.masked_fill(seen.logical_not(), -std::numeric_limits<double>::infinity()), -1,
                               at::kFloat);  // [1, H, c, len]
    probs.select(0, b).narrow(1, q0, c).narrow(2, 0, len).copy_(p.select(0, 0));
    out.select(0, b).narrow(1, q0, c).copy_(at::matmul(p.to(dt), lv.second).select(0, 0));
  }
  if (observe) cache.observe(layer, probs);
  if (probs_out) *probs_out = probs;
  return out.to(cache.dtype());
}

}  // namespace detail

/// Attention of the T tokens of the latest update over `layer`'s live slots (expanded layout),
/// then `cache.observe(layer, probs)`. Keys carry their RoPE, so slot order does not matter;
/// inside a multi-token append the mask is causal by position (key position <= query position).
///
/// \param q          [B, H, T, qk_dim] queries of the newest T tokens (positions
///                   seen_tokens - T .. seen_tokens - 1, right-aligned per row as
///                   EvictionPolicy::query_positions() says: a row that appended fewer tokens
///                   than the chunk has pads before its own, which get zero output), cache
///                   dtype and device, 1 <= T <= seen_tokens(layer).
/// \param scale      logit scale; default 1/sqrt(qk_dim). DeepSeek-V3 with YaRN multiplies it
///                   by mscale^2: pass that here.
/// \param probs_out  if given, receives the fp32 probabilities [B, H, T, S] (slot order).
/// \param observe    false: do not feed the probabilities to the scorer (the caller calls
///                   cache.observe(layer, *probs_out) itself, e.g. to time it apart).
/// \return [B, H, T, v_dim] attention output in the cache dtype, on the cache device.
/// \throws c10::Error on a bad layer, shape, dtype or device, or what observe() throws; the
///         cache is unchanged then.
/// \note fp16 on CPU is computed in fp32 (LibTorch 1.13 has no CPU fp16 matmul); softmax is
///       always taken in fp32.
template <class Policy>
at::Tensor attend(const at::Tensor& q, BasicMlaCache<Policy>& cache, int64_t layer,
                  c10::optional<double> scale = c10::nullopt, at::Tensor* probs_out = nullptr,
                  bool observe = true) {
  const auto k = cache.keys(layer);  // [B, H, S, qk_dim]
  const auto v = cache.values(layer);
  const int64_t T = detail::check_query(q, "q", cache, layer, cache.options().qk_dim(), "qk_dim");
  const auto dt = detail::compute_dtype(cache);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(cache.options().qk_dim())));
  if (!cache.policy().dense(layer, T)) {  // ragged: row by row, each with its own shapes
    return detail::attend_rows(cache, layer, T, cache.options().v_dim(), dt, observe, probs_out,
                               [&](int64_t b, int64_t q0, int64_t c, int64_t len) {
                                 return std::make_pair(
                                     at::matmul(q.narrow(0, b, 1).narrow(2, q0, c).to(dt).mul(s),
                                                k.narrow(0, b, 1).narrow(2, 0, len).to(dt).transpose(-2, -1)),
                                     v.narrow(0, b, 1).narrow(2, 0, len).to(dt));
                               });
  }
  // Scaled before the product, so an fp16 logit overflows only if the scaled one would.
  const auto logits = at::matmul(q.to(dt).mul(s), k.to(dt).transpose(-2, -1));  // [B, H, T, S]
  const auto probs = detail::observed_softmax(logits, cache, layer, observe);
  if (probs_out) *probs_out = probs;
  return at::matmul(probs.to(dt), v.to(dt)).to(cache.dtype());
}

/// Absorbed MLA attention over `layer`'s latent slots (DeepSeek-V2 paper, Sec. 2.1.2, "weight
/// absorption"): the no-RoPE query is already multiplied by W_UK, so logits are
/// `q_absorbed . ckv + q_pe . kpe` and the output `probs @ ckv` is still in the latent space
/// (the caller applies W_UV, then o_proj). Then `cache.observe(layer, probs)`.
///
/// \param q_absorbed  [B, H, T, kv_lora_rank] no-RoPE queries times W_UK, cache dtype/device.
/// \param q_pe        [B, H, T, qk_rope_dim] RoPE queries (RoPE applied at their positions).
/// \param scale       logit scale; default 1/sqrt(qk_nope_dim + qk_rope_dim) = 1/sqrt(192)
///                    for DeepSeek-V3 (pass the YaRN-adjusted scale where the model uses one).
/// \param probs_out   if given, receives the fp32 probabilities [B, H, T, S] (slot order).
/// \param observe     false: do not feed the probabilities to the scorer (see attend()).
/// \return [B, H, T, kv_lora_rank] latent output in the cache dtype.
/// \throws c10::Error on a bad layer, shape, dtype or device, or what observe() throws; the
///         cache is unchanged then.
template <class Policy>
at::Tensor attend_absorbed(const at::Tensor& q_absorbed, const at::Tensor& q_pe, BasicMlaLatentCache<Policy>& cache,
                           int64_t layer, c10::optional<double> scale = c10::nullopt,
                           at::Tensor* probs_out = nullptr, bool observe = true) {
  const auto& o = cache.options();
  const auto ckv = cache.ckv(layer).unsqueeze(1);  // [B, 1, S, kv_lora_rank]
  const auto kpe = cache.kpe(layer).unsqueeze(1);  // [B, 1, S, qk_rope_dim]
  const int64_t T = detail::check_query(q_absorbed, "q_absorbed", cache, layer, o.kv_lora_rank(), "kv_lora_rank");
  detail::check_query(q_pe, "q_pe", cache, layer, o.qk_rope_dim(), "qk_rope_dim");
  KVEVICT_CHECK(q_pe.size(2) == T, "q_pe must have the T of q_absorbed (", T, "), got ", q_pe.size(2));
  const auto dt = detail::compute_dtype(cache);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(o.qk_nope_dim() + o.qk_rope_dim())));
  if (!cache.policy().dense(layer, T)) {  // ragged: row by row, each with its own shapes
    return detail::attend_rows(
        cache, layer, T, o.kv_lora_rank(), dt, observe, probs_out, [&](int64_t b, int64_t q0, int64_t c, int64_t len) {
          const auto row_latent = ckv.narrow(0, b, 1).narrow(2, 0, len).to(dt);
          const auto logits =
              at::matmul(q_absorbed.narrow(0, b, 1).narrow(2, q0, c).to(dt).mul(s), row_latent.transpose(-2, -1))
                  .add(at::matmul(q_pe.narrow(0, b, 1).narrow(2, q0, c).to(dt).mul(s),
                                  kpe.narrow(0, b, 1).narrow(2, 0, len).to(dt).transpose(-2, -1)));
          return std::make_pair(logits, row_latent);
        });
  }
  const auto latent = ckv.to(dt);
  // Scaled before the products, so an fp16 logit overflows only if the scaled one would.
  const auto logits = at::matmul(q_absorbed.to(dt).mul(s), latent.transpose(-2, -1))
                          .add(at::matmul(q_pe.to(dt).mul(s), kpe.to(dt).transpose(-2, -1)));  // [B, H, T, S]
  const auto probs = detail::observed_softmax(logits, cache, layer, observe);
  if (probs_out) *probs_out = probs;
  return at::matmul(probs.to(dt), latent).to(cache.dtype());
}

}  // namespace kvevict
