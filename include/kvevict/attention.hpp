#pragma once
// Eviction-aware attention over a cache's live slots, whose probabilities feed the cache's
// scorer: attend() for the expanded layout, attend_absorbed() for the latent layout.

#include <kvevict/check.hpp>
#include <kvevict/mla_cache.hpp>
#include <kvevict/mla_latent_cache.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

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

/// Keys hidden from the queries, [B, 1, T, S] bool, from slot positions `pos` [B, S] (-1 dead)
/// and query positions `qpos` [B, T] (-1 pad): true where the key is newer than the query or,
/// with `dead_slots`, where the slot is dead (a pad column, position -1, then sees nothing).
/// Device tensors only: no sync.
inline at::Tensor hidden_keys(const at::Tensor& pos, const at::Tensor& qpos, bool dead_slots) {
  const int64_t B = pos.size(0), S = pos.size(1), T = qpos.size(1);
  const auto p = pos.view({B, 1, 1, S});
  auto hidden = p.gt(qpos.view({B, 1, T, 1}));
  return dead_slots ? hidden.logical_or_(p.lt(0)) : hidden;
}

/// Softmax in fp32 over the last dim of `logits` [B, H, T, S], without the keys `hidden`
/// [B, 1, T, S] (undefined: none hidden). A row whose every key is hidden (a pad column, a free
/// row, a query whose visible keys were all evicted) gets zero probabilities, not NaN; NaN
/// logits of visible keys stay NaN. No sync.
inline at::Tensor masked_softmax(const at::Tensor& logits, const at::Tensor& hidden) {
  if (!hidden.defined()) return at::softmax(logits, -1, at::kFloat);
  auto probs = at::softmax(logits.masked_fill(hidden, -std::numeric_limits<double>::infinity()), -1, at::kFloat);
  return probs.masked_fill_(hidden.all(-1, /*keepdim=*/true), 0.0);
}

/// Scaled absorbed-MLA logits `scale * (q_absorbed . ckv + q_pe . kpe)`, [B, H, T, S] in `dt`,
/// of q_absorbed [B, H, T, W], q_pe [B, H, T, R] over ckv [B, S, W], kpe [B, S, R] (views of a
/// cache's buffers). The heads are folded into the rows of one batched product per term,
/// [B, H*T, W] x [B, W, S]: the latent rows, shared by the heads, are read in place (a
/// transposed view, which BLAS and cuBLAS take without a copy), never copied per head.
/// Allocates the scaled queries and the [B, H, T, S] logits only.
inline at::Tensor absorbed_logits(const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& ckv,
                                  const at::Tensor& kpe, double scale, at::ScalarType dt) {
  const int64_t B = q_absorbed.size(0), H = q_absorbed.size(1), T = q_absorbed.size(2), S = ckv.size(1);
  // Scaled before the products, so an fp16 logit overflows only if the scaled one would.
  const auto fold = [&](const at::Tensor& x) { return x.to(dt).mul(scale).reshape({B, H * T, x.size(3)}); };
  auto logits = at::bmm(fold(q_absorbed), ckv.to(dt).transpose(1, 2));  // [B, H*T, S]
  logits.baddbmm_(fold(q_pe), kpe.to(dt).transpose(1, 2));
  return logits.view({B, H, T, S});
}

/// Attention of the T newest tokens' queries over `layer`'s live slots, for either layout:
///   logits(b0, nb, q0, c, len) -> [nb, H, c, len] scaled logits (compute dtype) of rows
///                                 [b0, b0 + nb), query columns [q0, q0 + c), slots [0, len);
///   output(b0, nb, probs, len) -> [nb, H, c, width] from probs [nb, H, c, len], both in the
///                                 compute dtype `dt`.
/// Dense batches and the tensor path: one batched product over [B, H, T, S], masked with
/// device tensors only (causal by position, dead slots, pad columns). Host path, ragged batch:
/// row by row over its real query columns and live slots only, so each row has exactly the
/// shapes it has alone in a batch-1 cache and its outputs and scores are bit-identical to that
/// run (batched kernels round differently for other shapes). Rows with no visible key get zero
/// probabilities and output. Everything that can throw (allocations included) runs before
/// `cache.observe(layer, probs)` (if `observe`), so a throw leaves the cache as it was.
template <class Cache, class Logits, class Output>
at::Tensor attend_layer(Cache& cache, int64_t layer, int64_t T, int64_t width, at::ScalarType dt, bool observe,
                        at::Tensor* probs_out, Logits&& logits, Output&& output) {
  const auto& policy = cache.policy();
  const int64_t B = cache.batch_size(), S = cache.size(layer);
  at::Tensor probs, out;
  const bool dense = policy.dense(layer, T);
  if (dense || !policy.host_path()) {
    at::Tensor hidden;  // a dense decode step (T = 1) hides nothing
    if (!dense || T > 1) hidden = hidden_keys(cache.positions(layer), policy.query_positions(layer, T), !dense);
    probs = masked_softmax(logits(0, B, 0, T, S), hidden);
    out = output(0, B, probs.to(dt), S);
  } else {
    const auto pos = cache.positions(layer);                        // [B, S], -1 dead (host)
    const auto query_pos = policy.query_positions(layer, T);       // [B, T], -1 pad (host)
    const int64_t* qp = query_pos.template data_ptr<int64_t>();
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    probs = at::zeros({B, cache.num_heads(), T, S}, f32);
    out = at::zeros({B, cache.num_heads(), T, width}, f32.dtype(dt));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = cache.size(layer, b);
      int64_t q0 = 0;  // pads lead: real columns are [q0, T)
      while (q0 < T && qp[b * T + q0] < 0) ++q0;
      const int64_t c = T - q0;
      if (c == 0 || len == 0) continue;
      const auto hidden = hidden_keys(pos.narrow(0, b, 1).narrow(1, 0, len), query_pos.narrow(0, b, 1).narrow(1, q0, c),
                                      true);
      const auto p = masked_softmax(logits(b, 1, q0, c, len), hidden);  // [1, H, c, len]
      const auto o = output(b, 1, p.to(dt), len);                       // [1, H, c, width]
      probs.select(0, b).narrow(1, q0, c).narrow(2, 0, len).copy_(p.select(0, 0));
      out.select(0, b).narrow(1, q0, c).copy_(o.select(0, 0));
    }
  }
  out = out.to(cache.dtype());
  if (observe) cache.observe(layer, probs);
  if (probs_out) *probs_out = probs;
  return out;
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
/// \throws c10::Error on a bad layer, shape, dtype or device, an allocation failure, or what
///         observe() throws. Everything that can throw runs before the observation, so the
///         cache is unchanged then and a retry observes once.
///
/// A query column that sees no key gets zero probabilities and a zero output row: a pad
/// column, a free or idle row, and a real query whose every visible key was evicted (e.g.
/// budget 0, n_sink 0, n_recent 1, then T = 2 after a pass: the older query's only key is
/// gone). No sync decides it: the masks are device tensors.
///
/// Ragged batches (rows of other lengths, pads): on the host path (CPU) row by row over each
/// row's own query columns and live slots, so a request's outputs and scores are bit-identical
/// to running it alone in a batch-1 cache. On the tensor path (CUDA) one batched, masked
/// product over the padded [B, H, T, S], no host loop or read: equal to running alone up to
/// fp32 rounding (reductions over a wider S round differently), so scores differ in their
/// last bits and the kept tokens are the same unless two candidates tie within that rounding.
/// Slots past a row's length enter that product with probability 0, so they must be finite:
/// the cache's are (zero-filled when allocated, then rows the same row held before).
///
/// \note Allocates the logits, the fp32 probabilities [B, H, T, S] and the output; the keys
///       and values are read in place. A dense decode step (T = 1) reads nothing from the
///       host; a multi-token or ragged step also reads positions() and query_positions().
///       fp16 on CPU is computed in fp32 (LibTorch 1.13 has no CPU fp16 matmul); softmax is
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
  // Per-head keys: the batched product runs over B x H matrices of the buffer views, no copy.
  return detail::attend_layer(
      cache, layer, T, cache.options().v_dim(), dt, observe, probs_out,
      [&](int64_t b0, int64_t nb, int64_t q0, int64_t c, int64_t len) {
        // Scaled before the product, so an fp16 logit overflows only if the scaled one would.
        return at::matmul(q.narrow(0, b0, nb).narrow(2, q0, c).to(dt).mul(s),
                          k.narrow(0, b0, nb).narrow(2, 0, len).to(dt).transpose(-2, -1));
      },
      [&](int64_t b0, int64_t nb, const at::Tensor& p, int64_t len) {
        return at::matmul(p, v.narrow(0, b0, nb).narrow(2, 0, len).to(dt));
      });
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
/// \throws c10::Error as attend(); the cache is unchanged then.
///
/// Pads, free rows, queries without a visible key and ragged batches as attend(). The heads
/// are folded into the rows of one batched product per term, [B, H*T, kv_lora_rank] x
/// [B, kv_lora_rank, S]: the latent rows shared by the heads are read in place, never copied
/// per head (temporaries: the scaled queries, logits and fp32 probabilities [B, H, T, S], the
/// output).
template <class Policy>
at::Tensor attend_absorbed(const at::Tensor& q_absorbed, const at::Tensor& q_pe, BasicMlaLatentCache<Policy>& cache,
                           int64_t layer, c10::optional<double> scale = c10::nullopt,
                           at::Tensor* probs_out = nullptr, bool observe = true) {
  const auto& o = cache.options();
  const auto ckv = cache.ckv(layer);  // [B, S, kv_lora_rank]
  const auto kpe = cache.kpe(layer);  // [B, S, qk_rope_dim]
  const int64_t T = detail::check_query(q_absorbed, "q_absorbed", cache, layer, o.kv_lora_rank(), "kv_lora_rank");
  detail::check_query(q_pe, "q_pe", cache, layer, o.qk_rope_dim(), "qk_rope_dim");
  KVEVICT_CHECK(q_pe.size(2) == T, "q_pe must have the T of q_absorbed (", T, "), got ", q_pe.size(2));
  const auto dt = detail::compute_dtype(cache);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(o.qk_nope_dim() + o.qk_rope_dim())));
  const int64_t H = cache.num_heads();
  return detail::attend_layer(
      cache, layer, T, o.kv_lora_rank(), dt, observe, probs_out,
      [&](int64_t b0, int64_t nb, int64_t q0, int64_t c, int64_t len) {
        return detail::absorbed_logits(q_absorbed.narrow(0, b0, nb).narrow(2, q0, c),
                                       q_pe.narrow(0, b0, nb).narrow(2, q0, c), ckv.narrow(0, b0, nb).narrow(1, 0, len),
                                       kpe.narrow(0, b0, nb).narrow(1, 0, len), s, dt);
      },
      [&](int64_t b0, int64_t nb, const at::Tensor& p, int64_t len) {  // heads folded into rows, as the logits
        const int64_t c = p.size(2);
        return at::bmm(p.reshape({nb, H * c, len}), ckv.narrow(0, b0, nb).narrow(1, 0, len).to(dt))
            .view({nb, H, c, o.kv_lora_rank()});
      });
}

}  // namespace kvevict
