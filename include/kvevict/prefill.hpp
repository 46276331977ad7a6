#pragma once
// Long prompts in bounded memory, two ways:
//
// Chunked prefill (prefill_chunked, prefill_chunked_absorbed): the prompt goes through the
// cache in chunks of C tokens: update, attention over the live slots, observe, evict. Peak extra
// memory O(C x (capacity + C) x H): the [B, H, C, S] probabilities of one chunk. Tokens are
// evicted while the prompt is read, on the attention of the queries seen so far: a token that
// only later queries would have found important may already be gone, and the recent window
// protects the tokens of the last chunks whatever their score.
//
// One-shot compression (prompt_scores, compress_prompt, and the _absorbed forms): every prompt
// token is scored by the attention of the whole prompt (every query, causal), recomputed from
// the LSE of the fused prefill kernel in query and head chunks (lse_scores.hpp); no [H, T, T]
// tensor is ever built. Then the best `capacity` tokens are kept (Selection::keep_indices:
// sinks, recent window, heavy hitters). It needs the prompt's keys at once (the caller holds
// them after prefill anyway) and one q . k product over the causal half of the prompt per head,
// as much as attention's first half. Its selection sees every query, so under
// CumulativeAttention old tokens gather attention from more queries than in chunked prefill
// (H2O's bias toward old tokens is stronger); with SnapKV only the last `window` queries vote
// (the paper's setting), which needs the whole prompt and cannot be done chunk by chunk.

#include <kvevict/attention.hpp>
#include <kvevict/eviction_policy.hpp>
#include <kvevict/lse_scores.hpp>
#include <kvevict/mla_cache.hpp>
#include <kvevict/mla_latent_cache.hpp>
#include <kvevict/selection.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvevict {
namespace detail {

/// Prompt scores must be finite before a compression changes the cache (a NaN or inf LSE, or
/// non-finite queries or keys, would otherwise fail half-way, after the append).
inline void check_prompt_scores(const at::Tensor& scores, const char* what) {
  KVEVICT_CHECK(at::isfinite(scores).all().template item<bool>(), what,
                ": the prompt scores are not finite (a NaN or inf in lse, q or k); the cache is unchanged");
}

/// A prompt holds at least one token: `what` names the function, `arg` the prompt tensor and
/// its shape (e.g. "k [B, H, T, qk_dim]").
inline void check_prompt_tokens(int64_t T, const char* what, const char* arg) {
  KVEVICT_CHECK_VALUE(T >= 1, what, ": the prompt must hold at least one token (", arg, " with T >= 1), got T = ", T);
}

/// Slots a chunked prefill of T tokens in chunks of `chunk` needs at most: the tokens held now
/// plus the prompt, or capacity plus the chunks appended between two passes, whichever is less,
/// plus the trash slot.
template <class Cache>
int64_t chunked_slots(const Cache& cache, int64_t layer, int64_t T, int64_t chunk) {
  const int64_t between_passes = std::min(chunk, T) * cache.policy().eviction(layer).evict_every();
  return std::min(cache.size(layer) + T, cache.capacity(layer) + between_passes) + 1;
}

/// Whether Scorer has `at::Tensor pool(const at::Tensor&) const` (SnapKV).
template <class S, class = void>
struct HasPool : std::false_type {};
template <class S>
struct HasPool<S, std::void_t<decltype(std::declval<const S&>().pool(std::declval<const at::Tensor&>()))>>
    : std::true_type {};

/// Scores of T prompt tokens (B rows of T, no padding) under `scorer`, from the whole prompt's
/// attention recomputed from LSE: a one-layer EvictionPolicy holding the T tokens observes all T
/// queries in chunks, then ranks (and pools, for scorers that pool).
template <class Scorer, class LogitsFn>
at::Tensor prompt_scores_impl(int64_t B, int64_t H, int64_t T, const at::Device& device, const at::Tensor& lse,
                              const Scorer& scorer, const LseOptions& opts, at::ScalarType dt, LogitsFn&& logits) {
  opts.validate();
  check_lse(lse, B, H, T, device);
  at::NoGradGuard no_grad;
  // The probabilities are clamped to [0, 1] and masked causally here, so the policy's own checks
  // of them are skipped; the LSE is checked against the logits on CPU (each query's probability sum, one read per chunk).
  EvictionPolicy<Scorer> policy(EvictionPolicyOptions(1, H).batch_size(B).device(device).check_observations(false),
                                EvictionOptions(0).n_sink(0).n_recent(1), scorer);
  policy.reserve(T);
  const std::vector<int64_t> counts(static_cast<size_t>(B), T);
  policy.append(0, counts, T);  // slot t holds position t
  observe_lse_chunks(policy, 0, policy.positions(0), policy.query_positions(0, T), lse, H,
                     counted_queries(scorer, T), device.is_cpu() ? lse_sum_tolerance(dt) : 0.0, opts, logits);
  auto ranks = policy.scores(0);  // [B, T], position order
  if constexpr (HasPool<Scorer>::value) ranks = scorer.pool(ranks);
  return ranks;
}

/// Gathers the kept token rows `keep` [B, n] along dim `dim` of x ([B, H, T, D] or [B, T, D]).
inline at::Tensor gather_tokens(const at::Tensor& x, const at::Tensor& keep, int64_t dim) {
  std::vector<int64_t> view(static_cast<size_t>(x.dim()), 1), size = x.sizes().vec();
  view[0] = keep.size(0);
  view[static_cast<size_t>(dim)] = keep.size(1);
  size[static_cast<size_t>(dim)] = keep.size(1);
  return x.gather(dim, keep.view(view).expand(size));
}

/// Grows `layer` to exactly `slots` slots per row now (where it has fewer) and, while alive,
/// keeps evict() from shrinking it below that (instead of base_slots): a loop that appends
/// `chunk` > evict_every tokens per pass (chunked prefill: slots from chunked_slots()) then never
/// moves the buffers, and never grows them geometrically past what it needs. On destruction the
/// hold ends and the layer shrinks back to base_slots if every row fits (never throws).
/// \throws c10::Error naming `what`, the layer and the sizes if the growth cannot be allocated;
///         nothing changed then.
template <class Cache>
class GrowthHold {
 public:
  /// `what` names the public call (e.g. "prefill_chunked") in an allocation failure's message.
  GrowthHold(Cache& cache, int64_t layer, int64_t slots, const char* what) : cache_(cache), layer_(layer) {
    cache_.prefill_steps().hold(layer, slots, what);  // all or nothing
  }
  ~GrowthHold() { cache_.prefill_steps().release_hold(layer_); }
  GrowthHold(const GrowthHold&) = delete;
  GrowthHold& operator=(const GrowthHold&) = delete;

 private:
  Cache& cache_;
  int64_t layer_;
};

/// A prompt compression needs a row that holds a sequence: with every row free (finish()) the
/// prompt would go nowhere. `what` names the function.
template <class Cache>
void check_prompt_rows(const Cache& cache, const char* what) {
  bool any = false;
  for (int64_t b = 0; b < cache.batch_size(); ++b) any = any || cache.active(b);
  KVEVICT_CHECK(any, what, ": no row of cache holds a sequence (",
                cache.batch_size() == 1 ? "row 0 is" : c10::str("all ", cache.batch_size(), " rows are"),
                " free: finish()ed), so the prompt has nowhere to go; call cache.add_sequence() first (or "
                "reset()); the cache is unchanged");
}

/// What compress_prompt() returns: `keep` [B, n] with -1 in the rows of free sequences
/// (finish()), which receive nothing (as positions() marks dead slots). Allocates only when a
/// row is free; changes nothing.
template <class Cache>
at::Tensor kept_or_free(const Cache& cache, const at::Tensor& keep) {
  std::vector<uint8_t> free(static_cast<size_t>(cache.batch_size()));
  bool any = false;
  for (int64_t b = 0; b < cache.batch_size(); ++b) any = (free[b] = !cache.active(b)) || any;
  if (!any) return keep;
  const auto rows = at::tensor(at::ArrayRef<uint8_t>(free)).to(at::kBool).view({cache.batch_size(), 1});
  return keep.masked_fill(rows.to(keep.device()), -1);
}

/// compress_prompt()'s steps on the cache (CacheBase::prefill_steps()), all or nothing: `a`, `b` the
/// prompt's two buffers (k, v or ckv, kpe) with tokens along `dim`, `scores` [B, T] its ranks,
/// `keep` [B, n] the kept positions. Without a tier the n kept rows are appended, ranked, and
/// given their prompt positions (place_prompt()); with one all T rows are appended, ranked, and
/// one pass sends the others to the tier. A throw after the append empties the layer again
/// (it was empty before).
template <class Cache>
struct PromptPress {
  static void run(Cache& cache, int64_t layer, const at::Tensor& a, const at::Tensor& b, int64_t dim,
                  const at::Tensor& scores, const at::Tensor& keep) {
    at::NoGradGuard no_grad;
    const bool tier = cache.tier_tokens() > 0;
    auto steps = cache.prefill_steps();
    auto before = steps.layer_before(layer);  // for the undo below; a throw here changes nothing
    if (tier) {
      cache.update(layer, a, b);  // a throw changes nothing
    } else {
      cache.update(layer, gather_tokens(a, keep, dim), gather_tokens(b, keep, dim));
    }
    try {
      if (tier) {
        cache.add_scores(layer, scores);
        cache.evict_now(layer);
      } else {
        cache.add_scores(layer, scores.gather(1, keep));
        steps.place_prompt(layer, keep, scores.size(1));
      }
    } catch (...) {
      try {
        steps.clear_layer(layer, before);
      } catch (...) {  // the tensor path's fills (a heap that stays exhausted): say so
        restore_failed() = true;
        KVEVICT_CHECK(false, "compress_prompt: a step after its append failed, and emptying layer ", layer,
                      " again failed too: the state is partly changed; reset() it");
      }
      throw;
    }
  }
};

}  // namespace detail

/// Scores every token of a prompt by the attention the whole prompt gives it (every query,
/// causal: query t sees keys 0..t), recomputed chunk by chunk from the prefill kernel's LSE,
/// reduced as observe() would reduce the full [B, H, T, T] probabilities and ranked by `scorer`
/// (pooled for SnapKV). The [H, T, T] tensor is never built.
///
/// \param q      [B, H, T, qk_dim] prompt queries (RoPE applied), any floating dtype, k's device.
/// \param k      [B, H, T, qk_dim] prompt keys, q's dtype and device. Rows are full prompts of T
///               tokens (no padding).
/// \param lse    [B, H, T] fp32 log-sum-exp of the scaled causal logits (base per opts).
/// \param scale  logit scale the kernel used (DeepSeek-V3: 1/sqrt(192), times mscale^2 with YaRN).
/// \param scorer how observations become ranks; default CumulativeAttention (H2O).
/// \param opts   chunking, LSE base; peak extra memory as LseOptions says (by default about
///               2 x 64 MiB of chunks) plus under 100 x B x T bytes of eviction state.
/// \return [B, T] fp32 ranks in position order, on k's device, for Selection::keep_indices.
/// \throws c10::Error on bad shapes, dtypes or devices, a prompt of 0 tokens, or (on CPU) an lse
///         that does not match the logits (a logit above its lse by more than 1e-3).
/// \note Cost: q . k over the causal half, T^2 / 2 x H x qk_dim multiply-adds, plus one exp and
///       one fixed-point add per (head, query, key).
template <class Scorer = CumulativeAttention>
at::Tensor prompt_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse, double scale,
                         const Scorer& scorer = Scorer(), const LseOptions& opts = LseOptions()) {
  detail::check_shape(k, "k", {-1, -1, -1, -1}, {"B", "H", "T", "qk_dim"}, "[B, H, T, qk_dim]");
  detail::check_floating(k, "k");
  const int64_t B = k.size(0), H = k.size(1), T = k.size(2), D = k.size(3);
  detail::check_prompt_tokens(T, "prompt_scores", "k [B, H, T, qk_dim]");
  detail::check_shape(q, "q", {B, H, T, D}, {"B", "H", "T", "qk_dim"}, "[B, H, T, qk_dim] as k");
  detail::check_device(q, "q", k.device());
  KVEVICT_CHECK_TYPE(q.scalar_type() == k.scalar_type(), "q must have k's dtype ", k.scalar_type(), ", got ",
                     q.scalar_type());
  const auto dt = k.device().is_cpu() && k.scalar_type() == at::kHalf ? at::kFloat : k.scalar_type();
  return detail::prompt_scores_impl(B, H, T, k.device(), lse, scorer, opts, dt,
                                    [&](int64_t h0, int64_t hc, int64_t q0, int64_t qc) {
                                      const int64_t keys = q0 + qc;  // causal: later keys unseen
                                      return at::matmul(q.narrow(1, h0, hc).narrow(2, q0, qc).to(dt).mul(scale),
                                                        k.narrow(1, h0, hc).narrow(2, 0, keys).to(dt).transpose(-2, -1))
                                          .to(at::kFloat);
                                    });
}

/// prompt_scores() for the latent layout (absorbed queries, DeepSeek-V2 Sec. 2.1.2): logits
/// `scale * (q_absorbed . ckv + q_pe . kpe)`.
///
/// \param q_absorbed  [B, H, T, kv_lora_rank]; q_pe [B, H, T, qk_rope_dim];
/// \param ckv         [B, T, kv_lora_rank]; kpe [B, T, qk_rope_dim]; one dtype and device.
/// \param lse         [B, H, T] as in prompt_scores().
template <class Scorer = CumulativeAttention>
at::Tensor prompt_scores_absorbed(const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& ckv,
                                  const at::Tensor& kpe, const at::Tensor& lse, double scale,
                                  const Scorer& scorer = Scorer(), const LseOptions& opts = LseOptions()) {
  detail::check_shape(ckv, "ckv", {-1, -1, -1}, {"B", "T", "kv_lora_rank"}, "[B, T, kv_lora_rank]");
  detail::check_floating(ckv, "ckv");
  const int64_t B = ckv.size(0), T = ckv.size(1), W = ckv.size(2);
  detail::check_prompt_tokens(T, "prompt_scores_absorbed", "ckv [B, T, kv_lora_rank]");
  detail::check_shape(kpe, "kpe", {B, T, -1}, {"B", "T", "qk_rope_dim"}, "[B, T, qk_rope_dim]");
  const int64_t R = kpe.size(2);
  detail::check_shape(q_absorbed, "q_absorbed", {B, -1, T, W}, {"B", "H", "T", "kv_lora_rank"},
                      "[B, H, T, kv_lora_rank]");
  const int64_t H = q_absorbed.size(1);
  detail::check_shape(q_pe, "q_pe", {B, H, T, R}, {"B", "H", "T", "qk_rope_dim"}, "[B, H, T, qk_rope_dim]");
  for (const auto* t : {&kpe, &q_absorbed, &q_pe}) {
    detail::check_device(*t, "prompt tensors", ckv.device());
    KVEVICT_CHECK_TYPE(t->scalar_type() == ckv.scalar_type(), "q_absorbed, q_pe, ckv and kpe must share one dtype");
  }
  const auto dt = ckv.device().is_cpu() && ckv.scalar_type() == at::kHalf ? at::kFloat : ckv.scalar_type();
  const auto c = ckv.unsqueeze(1).to(dt), r = kpe.unsqueeze(1).to(dt);  // [B, 1, T, W], [B, 1, T, R]
  return detail::prompt_scores_impl(
      B, H, T, ckv.device(), lse, scorer, opts, dt, [&](int64_t h0, int64_t hc, int64_t q0, int64_t qc) {
        const int64_t keys = q0 + qc;
        return at::matmul(q_absorbed.narrow(1, h0, hc).narrow(2, q0, qc).to(dt).mul(scale),
                          c.narrow(2, 0, keys).transpose(-2, -1))
            .add(at::matmul(q_pe.narrow(1, h0, hc).narrow(2, q0, qc).to(dt).mul(scale),
                            r.narrow(2, 0, keys).transpose(-2, -1)))
            .to(at::kFloat);
      });
}

/// One-shot prompt compression into an empty layer: prompt_scores() under the cache's scorer,
/// Selection::keep_indices() with the layer's options (its capacity), then the kept keys and
/// values are appended to the layer and start with their prompt rank (one add_scores()
/// observation: CumulativeAttention keeps the accumulated prompt attention). The layer then is
/// what appending all T tokens and one eviction pass would leave: positions() are the kept
/// tokens' prompt positions, seen_tokens(layer) is T (the next token's position, as RoPE
/// counts), and stats() counts each row's T - n dropped tokens in tokens_evicted (one eviction
/// event). Without a host tier only the n kept rows are copied into the cache. With one (cache
/// options' tier_tokens > 0) the dropped tokens go to the tier: every prompt token is appended
/// with its rank and one pass (evict_now()) keeps the same tokens and sends the rest to the
/// tier; the layer holds all T rows until that pass (as the caller's k and v do). A row that is
/// free (finish()) stays empty. All or nothing: a throw at any step, an allocation failure in
/// the pass included, leaves the cache unchanged (the layer is emptied again and its buffers
/// go back to their usual size).
///
/// \param q, k  [B, H, T, qk_dim], v [B, H, T, v_dim]: the prompt, cache dtype and device.
/// \param lse   [B, H, T] LSE of the prefill kernel (see prompt_scores()).
/// \param scale default 1/sqrt(qk_dim), as attend().
/// \return [B, n] int64 prompt positions kept, ascending, n = min(T, capacity(layer)); -1 in
///         the rows of free sequences (finish()), which stay empty.
/// \throws c10::Error if the layer already holds tokens, every row of the cache is free, k does
///         not match the cache, the prompt holds 0 tokens, v does not match k, the scores are
///         not finite, or as prompt_scores() / update() / evict(), and on an allocation failure
///         (host heap too: "compress_prompt: out of host memory"); the cache is unchanged then.
template <class Policy>
at::Tensor compress_prompt(BasicMlaCache<Policy>& cache, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& lse, c10::optional<double> scale = c10::nullopt,
                           const LseOptions& opts = LseOptions()) {
  return detail::host_heap("compress_prompt", [&] {  // a host-heap failure: a c10::Error naming the call
    KVEVICT_CHECK(cache.seen_tokens(layer) == 0, "compress_prompt: layer ", layer, " already holds ",
                  cache.seen_tokens(layer), " seen tokens; compress a prompt into an empty layer (reset() first)");
    detail::check_prompt_rows(cache, "compress_prompt");
    const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(cache.options().qk_dim())));
    detail::check_shape(k, "k", {cache.batch_size(), cache.num_heads(), -1, cache.options().qk_dim()},
                        {"B", "H", "T", "qk_dim"}, "[B, H, T, qk_dim] with the cache's B, H, qk_dim");
    detail::check_prompt_tokens(k.size(2), "compress_prompt", "k [B, H, T, qk_dim]");
    detail::check_shape(v, "v", {k.size(0), k.size(1), k.size(2), cache.options().v_dim()}, {"B", "H", "T", "v_dim"},
                        "[B, H, T, v_dim] with k's B, H, T");
    const auto scores = prompt_scores(q, k, lse, s, cache.policy().scorer(), opts);
    detail::check_prompt_scores(scores, "compress_prompt");  // before the cache changes
    const auto keep = Selection(cache.policy().eviction(layer)).keep_indices(scores);
    auto out = detail::kept_or_free(cache, keep);  // before the cache changes
    detail::PromptPress<BasicMlaCache<Policy>>::run(cache, layer, k, v, 2, scores, keep);
    return out;
  });
}

/// compress_prompt() for the latent layout: ckv [B, T, kv_lora_rank] and kpe [B, T,
/// qk_rope_dim] are the prompt's rows, q_absorbed / q_pe its absorbed queries.
/// \return [B, n] int64 prompt positions kept. Positions, seen tokens, stats and the tier as
///         compress_prompt(). \throws as compress_prompt(); all or nothing.
template <class Policy>
at::Tensor compress_prompt_absorbed(BasicMlaLatentCache<Policy>& cache, int64_t layer, const at::Tensor& q_absorbed,
                                    const at::Tensor& q_pe, const at::Tensor& ckv, const at::Tensor& kpe,
                                    const at::Tensor& lse, c10::optional<double> scale = c10::nullopt,
                                    const LseOptions& opts = LseOptions()) {
  return detail::host_heap("compress_prompt_absorbed", [&] {  // a host-heap failure: a c10::Error naming the call
    KVEVICT_CHECK(cache.seen_tokens(layer) == 0, "compress_prompt_absorbed: layer ", layer, " already holds ",
                  cache.seen_tokens(layer), " seen tokens; compress a prompt into an empty layer (reset() first)");
    detail::check_prompt_rows(cache, "compress_prompt_absorbed");
    const auto& o = cache.options();
    detail::check_shape(ckv, "ckv", {cache.batch_size(), -1, o.kv_lora_rank()}, {"B", "T", "kv_lora_rank"},
                        "[B, T, kv_lora_rank] with the cache's B, kv_lora_rank");
    detail::check_prompt_tokens(ckv.size(1), "compress_prompt_absorbed", "ckv [B, T, kv_lora_rank]");
    const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(o.qk_nope_dim() + o.qk_rope_dim())));
    const auto scores = prompt_scores_absorbed(q_absorbed, q_pe, ckv, kpe, lse, s, cache.policy().scorer(), opts);
    detail::check_prompt_scores(scores, "compress_prompt_absorbed");  // before the cache changes
    const auto keep = Selection(cache.policy().eviction(layer)).keep_indices(scores);
    auto out = detail::kept_or_free(cache, keep);  // before the cache changes
    detail::PromptPress<BasicMlaLatentCache<Policy>>::run(cache, layer, ckv, kpe, 1, scores, keep);
    return out;
  });
}

/// Chunked prefill: feeds a prompt through `layer` in chunks of `chunk` tokens (update, attend
/// with its observe, evict), so the cache never holds more than about capacity + chunk tokens
/// (plus evict_every - 1 chunks when evict_every > 1) and the probabilities of one chunk,
/// [B, H, chunk, S], are the largest temporary: peak extra O(chunk x (capacity + chunk) x H).
/// The layer's buffers grow once, up front, to min(tokens held + T, capacity + chunk x
/// evict_every) slots where they have fewer, and go back to their usual size at the end
/// (without that they would grow and shrink at every chunk). A throw midway (from update() or
/// attend(), e.g. a NaN that the observation check rejects) leaves the chunks before it
/// appended: the cache stays consistent and usable, with fewer prompt tokens.
///
/// \param q, k  [B, H, T, qk_dim]; v [B, H, T, v_dim]: the prompt, cache dtype and device.
/// \param chunk tokens per chunk, >= 1.
/// \param out   if given, receives the attention output [B, H, T, v_dim] (cache dtype).
/// \throws c10::Error on a bad chunk or scale, a prompt of 0 tokens, or q, k, v that do not match
///         the cache or each other (checked before the first chunk), or what update() / attend()
///         throw.
template <class Policy>
void prefill_chunked(BasicMlaCache<Policy>& cache, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, int64_t chunk, c10::optional<double> scale = c10::nullopt,
                     at::Tensor* out = nullptr) {
  KVEVICT_CHECK_VALUE(chunk >= 1, "prefill_chunked: chunk must be >= 1, got ", chunk);
  KVEVICT_CHECK_VALUE(!scale || (std::isfinite(*scale) && *scale > 0), "prefill_chunked: scale must be finite and > 0, got ",
                      scale.value_or(0.0));
  // Every shape first: a mismatch found half-way would leave the prompt half appended.
  const int64_t B = cache.batch_size(), H = cache.num_heads();
  detail::check_tensor(k, "k", cache.device());
  detail::check_shape(k, "k", {B, H, -1, cache.options().qk_dim()}, {"B", "H", "T", "qk_dim"}, "[B, H, T, qk_dim]");
  const int64_t T = k.size(2);
  detail::check_prompt_tokens(T, "prefill_chunked", "k [B, H, T, qk_dim]");
  detail::check_tensor(q, "q", cache.device());
  detail::check_shape(q, "q", {B, H, T, cache.options().qk_dim()}, {"B", "H", "T", "qk_dim"}, "[B, H, T, qk_dim] as k");
  detail::check_tensor(v, "v", cache.device());
  detail::check_shape(v, "v", {B, H, T, cache.options().v_dim()}, {"B", "H", "T", "v_dim"}, "[B, H, T, v_dim] as k");
  if (out) *out = at::empty({k.size(0), k.size(1), T, v.size(-1)}, v.options());
  // The buffers grow once, to what the chunks between passes need; back to base at the end.
  detail::GrowthHold<detail::CacheBase<Policy>> hold(cache, layer, detail::chunked_slots(cache, layer, T, chunk),
                                                     "prefill_chunked");
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    cache.update(layer, k.narrow(2, t0, n), v.narrow(2, t0, n));
    const auto o = attend(q.narrow(2, t0, n), cache, layer, scale);
    if (out) out->narrow(2, t0, n).copy_(o);
    cache.evict(layer);
  }
}

/// prefill_chunked() for the latent layout: ckv [B, T, kv_lora_rank], kpe [B, T, qk_rope_dim],
/// q_absorbed [B, H, T, kv_lora_rank], q_pe [B, H, T, qk_rope_dim]; `out` receives the latent
/// output [B, H, T, kv_lora_rank].
template <class Policy>
void prefill_chunked_absorbed(BasicMlaLatentCache<Policy>& cache, int64_t layer, const at::Tensor& q_absorbed,
                              const at::Tensor& q_pe, const at::Tensor& ckv, const at::Tensor& kpe, int64_t chunk,
                              c10::optional<double> scale = c10::nullopt, at::Tensor* out = nullptr) {
  KVEVICT_CHECK_VALUE(chunk >= 1, "prefill_chunked_absorbed: chunk must be >= 1, got ", chunk);
  KVEVICT_CHECK_VALUE(!scale || (std::isfinite(*scale) && *scale > 0), "prefill_chunked_absorbed: scale must be finite and > 0, got ",
                      scale.value_or(0.0));
  // Every shape first: a mismatch found half-way would leave the prompt half appended.
  const auto& o = cache.options();
  const int64_t B = cache.batch_size(), H = cache.num_heads();
  detail::check_tensor(ckv, "ckv", cache.device());
  detail::check_shape(ckv, "ckv", {B, -1, o.kv_lora_rank()}, {"B", "T", "kv_lora_rank"}, "[B, T, kv_lora_rank]");
  const int64_t T = ckv.size(1);
  detail::check_prompt_tokens(T, "prefill_chunked_absorbed", "ckv [B, T, kv_lora_rank]");
  detail::check_tensor(kpe, "kpe", cache.device());
  detail::check_shape(kpe, "kpe", {B, T, o.qk_rope_dim()}, {"B", "T", "qk_rope_dim"}, "[B, T, qk_rope_dim] as ckv");
  detail::check_tensor(q_absorbed, "q_absorbed", cache.device());
  detail::check_shape(q_absorbed, "q_absorbed", {B, H, T, o.kv_lora_rank()}, {"B", "H", "T", "kv_lora_rank"},
                      "[B, H, T, kv_lora_rank] as ckv");
  detail::check_tensor(q_pe, "q_pe", cache.device());
  detail::check_shape(q_pe, "q_pe", {B, H, T, o.qk_rope_dim()}, {"B", "H", "T", "qk_rope_dim"},
                      "[B, H, T, qk_rope_dim] as ckv");
  if (out) *out = at::empty({q_absorbed.size(0), q_absorbed.size(1), T, ckv.size(2)}, ckv.options());
  // The buffers grow once, to what the chunks between passes need; back to base at the end.
  detail::GrowthHold<detail::CacheBase<Policy>> hold(cache, layer, detail::chunked_slots(cache, layer, T, chunk),
                                                     "prefill_chunked_absorbed");
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    cache.update(layer, ckv.narrow(1, t0, n), kpe.narrow(1, t0, n));
    const auto o = attend_absorbed(q_absorbed.narrow(2, t0, n), q_pe.narrow(2, t0, n), cache, layer, scale);
    if (out) out->narrow(2, t0, n).copy_(o);
    cache.evict(layer);
  }
}

}  // namespace kvevict
