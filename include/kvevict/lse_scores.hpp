#pragma once
// Scores without the probability matrix: the attention probabilities that a fused kernel
// (FlashMLA, FlashAttention, FlashInfer) never returns, recomputed from the log-sum-exp it does
// return, in query and head chunks, and fed to the cache's scorer through its chunked observe
// path (EvictionPolicy::observe_begin / observe_add / observe_end): every scorer, the users'
// own included, gets exactly the observation observe(probs) would give it.
//
//   observe_lse()           expanded layout (MlaCache): q . k
//   observe_lse_absorbed()  latent layout (MlaLatentCache): q_absorbed . ckv + q_pe . kpe
//   LseRing                 amortised scoring: the last evict_every queries and LSEs of each
//                           layer, scored by one batched product over the keys per pass

#include <kvevict/attention.hpp>
#include <kvevict/check.hpp>
#include <kvevict/eviction_policy.hpp>
#include <kvevict/mla_cache.hpp>
#include <kvevict/mla_latent_cache.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvevict {

/// The logarithm base of the LSE a kernel returns.
///  - kE: natural log, `lse = log(sum_s exp(scale * q . k_s))`, as FlashMLA
///    (`flash_mla_with_kvcache` returns `(out, lse)`, lse fp32 [b, h_q, s_q]), FlashAttention 2/3
///    and `torch.logsumexp` of the scaled logits.
///  - k2: base 2, `lse2 = log2(sum_s 2^(scale * log2(e) * q . k_s)) = lse / ln 2`, what FlashInfer's
///    MLA and prefill kernels return by default (flashinfer issue #2113; newer versions take
///    `return_lse_base_on_e=True` / `lse_base="ln"` for natural log).
enum class LseBase { kE, k2 };

/// How observe_lse() and friends chunk their work and read the LSE.
///
/// Work is done per chunk of [B, head_chunk, query_chunk, S] probabilities (S keys), each a
/// few large tensor ops (the product, exp, clamp, mask, the scorer's reduction); by default a
/// chunk holds as many heads as fit in `chunk_bytes`, so a decode-time scoring (LseRing: up to
/// evict_every queries) is one chunk of all heads.
///
/// Peak extra memory of one call: one chunk's fp32 probabilities (at most chunk_bytes with the
/// default head_chunk, else 4 x B x head_chunk x query_chunk x S bytes), as much again for its
/// logits where the compute dtype is not fp32 and for the zero padding of prompt_scores(),
/// plus bool masks of B x query_chunk x S; the tensor path adds [B, S] fp64 sums. Defaults:
/// at most about 2 x 64 MiB; measured 49.6 MiB for an 8,192-token prompt
/// (kvevict_lse_bench --mode prompt --heads 8 --tokens 8192: all 8 heads in one chunk, as
/// before).
///
/// Example:
/// \code
///   auto o = kvevict::LseOptions().head_chunk(16).query_chunk(128).base(kvevict::LseBase::k2);
/// \endcode
struct LseOptions {
  /// Throws c10::ValueError naming a chunk below its minimum.
  void validate() const {
    KVEVICT_CHECK_VALUE(query_chunk_ >= 1, "LseOptions: query_chunk must be >= 1, got ", query_chunk_);
    KVEVICT_CHECK_VALUE(head_chunk_ >= 0, "LseOptions: head_chunk must be >= 0 (0: from chunk_bytes), got ",
                        head_chunk_);
    KVEVICT_CHECK_VALUE(chunk_bytes_ >= 1, "LseOptions: chunk_bytes must be >= 1, got ", chunk_bytes_);
  }

  /// Heads of a chunk for `B` rows, `H` heads, `Q` query columns per chunk and `S` keys: head_chunk,
  /// or with head_chunk 0 the most heads (at least 1, at most H) whose fp32 chunk fits chunk_bytes.
  int64_t heads_per_chunk(int64_t B, int64_t H, int64_t Q, int64_t S) const {
    if (head_chunk_ > 0) return std::min(head_chunk_, H);
    const int64_t per_head = std::max<int64_t>(1, 4 * B * Q * S);
    return std::max<int64_t>(1, std::min(H, chunk_bytes_ / per_head));
  }

  /// Query columns per chunk. Default: 64.
  KVEVICT_ARG(int64_t, query_chunk) = 64;
  /// Heads per chunk; 0: as many as fit in chunk_bytes. Default: 0.
  KVEVICT_ARG(int64_t, head_chunk) = 0;
  /// With head_chunk 0: the most bytes of one chunk's fp32 probabilities. Default: 64 MiB.
  KVEVICT_ARG(int64_t, chunk_bytes) = int64_t{64} << 20;
  /// Base of the given LSE. Default: LseBase::kE (natural log, FlashMLA / FlashAttention).
  KVEVICT_ARG(LseBase, base) = LseBase::kE;
};

namespace detail {

/// The chunked observation from LSE over any target with observe_begin / observe_add /
/// observe_end / observe_discard (a cache or an EvictionPolicy), layer `layer`:
///   pos      [B, S] int64 slot positions (-1 dead),
///   qpos     [B, Q] int64 query positions (-1 pad),
///   lse      [B, H, Q] (natural log after `base`),
///   logits(h0, hc, q0, qc) -> [B, hc, qc, S'] fp32 scaled logits (fresh: changed in place) of
///   keys [0, S'), S' <= S (keys past S' are treated as unseen: prompt_scores() uses it to
///   skip keys newer than the chunk).
/// Only the query columns the scorer counts (the last `counted`) are computed. With `check`,
/// one host read per chunk (the largest probability; a sync on CUDA). A throw discards the
/// open observation: the target is as it was.
template <class Target, class LogitsFn>
void observe_lse_chunks(Target& target, int64_t layer, const at::Tensor& pos, const at::Tensor& qpos,
                        const at::Tensor& lse, int64_t H, int64_t counted, double check, const LseOptions& o,
                        LogitsFn&& logits) {
  const int64_t B = pos.size(0), S = pos.size(1), Q = qpos.size(1), first = Q - counted;
  const int64_t qc_max = std::min(o.query_chunk(), counted), hc_max = o.heads_per_chunk(B, H, qc_max, S);
  auto l = lse.narrow(2, first, counted).to(at::kFloat);  // [B, H, counted], natural log
  if (o.base() == LseBase::k2) l = l.mul(0.69314718055994530942);  // ln 2
  l = l.unsqueeze(-1);
  target.observe_begin(layer, Q);
  try {
    for (int64_t q0 = 0; q0 < counted; q0 += qc_max) {
      const int64_t qc = std::min(qc_max, counted - q0);
      const auto hidden = hidden_keys(pos, qpos.narrow(1, first + q0, qc), true);  // [B, 1, qc, S]
      for (int64_t h0 = 0; h0 < H; h0 += hc_max) {
        const int64_t hc = std::min(hc_max, H - h0);
        auto p = logits(h0, hc, first + q0, qc);  // [B, hc, qc, S'] fp32, fresh
        const int64_t Sp = p.size(3);
        p.sub_(l.narrow(1, h0, hc).narrow(2, q0, qc)).exp_().masked_fill_(hidden.narrow(3, 0, Sp), 0.0);
        if (check) {
          // A matching LSE makes each real query's probabilities over its visible keys sum to 1
          // (fp32 rounding of both allowed); a NaN, an infinite or a shifted LSE, a wrong scale
          // or base do not. Pad columns see no key: they sum to 0 and are not checked. Keys
          // past S' (prompt_scores) are newer than every query of the chunk: none is visible.
          // A real query that sees no key (all evicted) has no LSE to check either.
          const auto sees = hidden.narrow(3, 0, Sp).logical_not().any(-1);  // [B, 1, qc]
          const double worst = p.sum(-1).sub_(1.0).abs_().masked_fill_(sees.logical_not(), 0.0).max().template item<float>();
          KVEVICT_CHECK(worst <= check, "lse does not match the logits: a query's probabilities exp(logit - lse) over its "
                        "visible keys sum to a value ", worst, " away from 1 (at most ", check, " expected) in heads [",
                        h0, ", ", h0 + hc, "), query columns [", first + q0, ", ", first + q0 + qc,
                        "); check the scale and the LSE base (LseOptions::base)");
        }
        p.clamp_max_(1.0);
        if (Sp < S) p = at::constant_pad_nd(p, {0, S - Sp}, 0.0);
        target.observe_add(layer, p, first + q0, h0);
      }
    }
    target.observe_end(layer);
  } catch (...) {
    target.observe_discard(layer);
    throw;
  }
}

/// The LSE check's tolerance on a query's probability sum for logits computed in `dt`: fp32
/// rounding of the logits and the LSE for fp32 and fp64; fp16 and bf16 logits (8 or 11 bits)
/// move a sum by far more.
inline double lse_sum_tolerance(at::ScalarType dt) {
  return dt == at::kFloat || dt == at::kDouble ? 1e-3 : 5e-2;
}

/// Checks lse [B, H, Q] (floating, on `device`).
inline void check_lse(const at::Tensor& lse, int64_t B, int64_t H, int64_t Q, const at::Device& device) {
  check_tensor(lse, "lse", device);
  check_shape(lse, "lse", {B, H, Q}, {"B", "H", "Q"}, "[B, H, Q] fp32 log-sum-exp of the scaled logits");
  check_floating(lse, "lse");
  check_device(lse, "lse", device);
}

}  // namespace detail

/// Feeds `layer`'s scorer the attention that queries `q` gave the live keys, recomputed from the
/// log-sum-exp `lse` a fused kernel returned, `p = exp(scale * q . k - lse)`, with the masks of
/// attend(): a query sees a key when the key is live and not newer (by position); pad columns
/// (left padding, idle rows) see nothing. The scorer gets what `observe(probs)` of attend()'s
/// probabilities would give it (equal to fp32 rounding of the probabilities: within 1e-6
/// relative, or 2^-32 per counted query, the fixed-point unit, for tiny scores).
///
/// \param q      [B, H, Q, qk_dim] queries of the newest Q tokens (right-aligned on the newest
///               append, as attend()), cache dtype and device; 1 <= Q <= seen_tokens(layer).
/// \param cache  the expanded-layout cache, holding the keys the kernel attended to (call this
///               after update() and before evict()).
/// \param lse    [B, H, Q] floating (fp32 from the kernels), cache device: the log-sum-exp of
///               the scaled, masked logits, `logsumexp_s(scale * q . k_s)`, base per
///               `opts.base()` (FlashMLA / FlashAttention: natural log; FlashInfer: base 2).
///               Pad columns may hold anything.
/// \param scale  logit scale the kernel used; default 1/sqrt(qk_dim) (as attend()).
/// \param opts   chunking and LSE base; peak extra memory in LseOptions.
/// \throws c10::Error on a bad layer, shape, dtype or device; with observation checks on (CPU
///         default), if the lse does not match the logits: a real query's probabilities over
///         its visible keys must sum to 1 within 1e-3 (fp16/bf16 logits: 5e-2), which a NaN,
///         infinite or shifted lse, a wrong scale or base fail; on an
///         allocation failure, or what observe() throws. The scorer state is unchanged then
///         and no observation is left open (observing(layer) is false).
/// \note Computes only the query columns the scorer counts (LatestAttention: the last one).
///       Cost: one q . k product per counted query, as attention's first half, in chunks of
///       LseOptions (by default all heads of a decode step in one). Host reads: with
///       observation checks on, one per chunk (the LSE check); else none of its own (the masks
///       come from positions() and query_positions()).
template <class Policy>
void observe_lse(const at::Tensor& q, BasicMlaCache<Policy>& cache, int64_t layer, const at::Tensor& lse,
                 c10::optional<double> scale = c10::nullopt, const LseOptions& opts = LseOptions()) {
  opts.validate();
  const int64_t Q = detail::check_query(q, "q", cache, layer, cache.options().qk_dim(), "qk_dim");
  detail::check_lse(lse, cache.batch_size(), cache.num_heads(), Q, cache.device());
  const auto k = cache.keys(layer);  // [B, H, S, qk_dim]
  const auto dt = detail::compute_dtype(cache);
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(cache.options().qk_dim())));
  at::NoGradGuard no_grad;
  const auto& policy = cache.policy();
  detail::observe_lse_chunks(cache, layer, cache.positions(layer), policy.query_positions(layer, Q), lse,
                             cache.num_heads(), detail::counted_queries(policy.scorer(), Q),
                             policy.checks_observations() ? detail::lse_sum_tolerance(dt) : 0.0, opts, [&](int64_t h0, int64_t hc, int64_t q0, int64_t qc) {
                               // Scaled before the product, as attend(): the same logits.
                               return at::matmul(q.narrow(1, h0, hc).narrow(2, q0, qc).to(dt).mul(s),
                                                 k.narrow(1, h0, hc).to(dt).transpose(-2, -1))
                                   .to(at::kFloat);
                             });
}

/// observe_lse() for the latent layout, with absorbed queries (DeepSeek-V2 paper, Sec. 2.1.2):
/// logits `scale * (q_absorbed . ckv + q_pe . kpe)`, as attend_absorbed().
///
/// \param q_absorbed  [B, H, Q, kv_lora_rank] no-RoPE queries times W_UK, cache dtype/device.
/// \param q_pe        [B, H, Q, qk_rope_dim] RoPE queries.
/// \param lse         [B, H, Q] log-sum-exp of the scaled logits (FlashMLA's second output).
/// \param scale       default 1/sqrt(qk_nope_dim + qk_rope_dim), as attend_absorbed().
/// \throws c10::Error as observe_lse().
/// \note The latent rows shared by the heads are read in place, as in attend_absorbed(): no
///       per-head copy of the cache.
template <class Policy>
void observe_lse_absorbed(const at::Tensor& q_absorbed, const at::Tensor& q_pe, BasicMlaLatentCache<Policy>& cache,
                          int64_t layer, const at::Tensor& lse, c10::optional<double> scale = c10::nullopt,
                          const LseOptions& opts = LseOptions()) {
  opts.validate();
  const auto& o = cache.options();
  const int64_t Q = detail::check_query(q_absorbed, "q_absorbed", cache, layer, o.kv_lora_rank(), "kv_lora_rank");
  detail::check_query(q_pe, "q_pe", cache, layer, o.qk_rope_dim(), "qk_rope_dim");
  KVEVICT_CHECK(q_pe.size(2) == Q, "q_pe must have the Q of q_absorbed (", Q, "), got ", q_pe.size(2));
  detail::check_lse(lse, cache.batch_size(), cache.num_heads(), Q, cache.device());
  const auto dt = detail::compute_dtype(cache);
  const auto ckv = cache.ckv(layer);  // [B, S, kv_lora_rank]
  const auto kpe = cache.kpe(layer);  // [B, S, qk_rope_dim]
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(o.qk_nope_dim() + o.qk_rope_dim())));
  at::NoGradGuard no_grad;
  const auto& policy = cache.policy();
  detail::observe_lse_chunks(cache, layer, cache.positions(layer), policy.query_positions(layer, Q), lse,
                             cache.num_heads(), detail::counted_queries(policy.scorer(), Q),
                             policy.checks_observations() ? detail::lse_sum_tolerance(dt) : 0.0, opts, [&](int64_t h0, int64_t hc, int64_t q0, int64_t qc) {
                               // As attend_absorbed(): the same logits, heads folded into rows.
                               return detail::absorbed_logits(q_absorbed.narrow(1, h0, hc).narrow(2, q0, qc),
                                                              q_pe.narrow(1, h0, hc).narrow(2, q0, qc), ckv, kpe, s, dt)
                                   .to(at::kFloat);
                             });
}

/// Amortised LSE scoring (one ring per cache): keeps the queries and LSEs of the last decode
/// steps of each layer, up to `evict_every` query columns, and scores them together, with one
/// batched product over the keys, when the ring is full or a pass is due: the cache is read
/// once per pass instead of once per step. The buffered queries are observed as one
/// observation of Q = buffered columns (as a Q-token chunk would be): CumulativeAttention and
/// MeanObservedAttention end with the same scores as per-step observe() (up to fp32 rounding of
/// the sum), LatestAttention uses the newest query (as per-step), DecayedAttention decays once
/// per pass instead of once per step.
///
/// Contract: push() right after each update() of the layer; every active row must have
/// appended the same T tokens in that update (a dense decode step or chunk), since buffered
/// columns are matched to the newest positions. A ragged update with queries still buffered
/// throws (flush() before it); with an empty ring, a ragged push is observed at once. Call
/// flush() before finish(), add_sequence(), reset() or truncate(); evict through evict(), which
/// flushes first when a pass is due. The ring checks each row's seen tokens at every push
/// (against its last push plus the latest update) and whenever it scores buffered queries
/// (flush(), a full ring, a due pass: against its last push), and throws, naming the layer and
/// row, where they differ: an update without a push, or a truncate, reset, finish or
/// add_sequence without a flush. flush() forgets the record, so rows may change after it. A
/// flush cannot see a truncate of k tokens followed by an unpushed update of k tokens.
///
/// With a host tier (tier_tokens): a recall exchanges cached rows, and the buffered columns'
/// LSEs were computed over the rows it replaced, so they can no longer be scored. At a step
/// that recalls, flush() the ring before the layer's update (update, recall, attend, push as
/// usual after it); a flush after the update but before the push throws (the row check above).
/// The ring counts the layer's recalled tokens (CacheStats::tier_recalled) and throws, naming
/// the layer, at the next push or scoring after a recall that brought tokens back while columns
/// were buffered; those columns are dropped.
///
/// Memory: per layer [B, H, evict_every, width] queries in the cache dtype (both query tensors
/// in the latent layout) and [B, H, evict_every] fp32 LSEs; allocated on a layer's first push.
///
/// \tparam Cache MlaCache / BasicMlaCache<P> (push(layer, q, lse)) or MlaLatentCache /
///         BasicMlaLatentCache<P> (push(layer, q_absorbed, q_pe, lse)).
template <class Cache>
class LseRing {
 public:
  /// \param cache  the cache scored; must outlive the ring.
  /// \param scale  logit scale (default: the cache layout's default, as attend()).
  /// \throws c10::ValueError on bad options.
  explicit LseRing(Cache& cache, c10::optional<double> scale = c10::nullopt, LseOptions opts = LseOptions())
      : cache_(&cache), scale_(scale), opts_((opts.validate(), opts)), layers_(cache.num_layers()) {}

  /// Query columns the ring holds before it scores them: the cache's evict_every.
  int64_t ring_size() const noexcept { return cache_->policy().eviction().evict_every(); }
  /// Query columns buffered for `layer`. \throws c10::IndexError for a bad layer.
  int64_t buffered(int64_t layer) const { return ring(layer).n; }
  /// Old name of ring_size() ("capacity" is n_sink + budget + n_recent everywhere else).
  [[deprecated("use ring_size()")]] int64_t capacity() const noexcept { return ring_size(); }
  /// Old name of buffered().
  [[deprecated("use buffered()")]] int64_t pending(int64_t layer) const { return buffered(layer); }

  /// Expanded layout: buffers q [B, H, T, qk_dim] and lse [B, H, T] of the latest update; a
  /// push that fills the ring scores it (as flush()).
  /// \throws c10::Error on bad shapes (as observe_lse), changing nothing; after a ragged update
  ///         with queries buffered, which can no longer be scored: the ring drops them and
  ///         starts over; or as flush() when this push fills the ring (its columns are dropped).
  void push(int64_t layer, const at::Tensor& q, const at::Tensor& lse) { push_impl(layer, {q}, lse); }
  /// Latent layout: buffers q_absorbed [B, H, T, kv_lora_rank], q_pe [B, H, T, qk_rope_dim], lse.
  void push(int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& lse) {
    push_impl(layer, {q_absorbed, q_pe}, lse);
  }

  /// Scores the buffered queries of `layer` now (one observe_lse over them) and empties the ring.
  /// \throws c10::Error if the layer's rows changed since the last push (a truncate, reset,
  ///         finish or add_sequence without a flush first: the buffered queries no longer
  ///         match the newest positions), naming the layer and row; or as observe_lse. The
  ///         buffered columns are dropped either way (a throw must not replay them).
  /// After it, rows may change (truncate, reset, finish, add_sequence) before the next push.
  void flush(int64_t layer) {
    struct Forget {  // thrown or not: the columns are gone and rows may change after a flush
      Ring& r;
      ~Forget() { r.seen.clear(); }
    } forget{ring(layer)};
    score(layer, "flush");
  }

  /// Flushes `layer` if a pass is due, then cache.evict(layer). \return tokens evicted.
  int64_t evict(int64_t layer) {
    if (cache_->policy().due(layer)) score(layer, "evict");
    return cache_->evict(layer);
  }

 private:
  struct Ring {
    std::vector<at::Tensor> q;  // [B, H, cap, width] each
    at::Tensor lse;             // [B, H, cap] fp32
    int64_t n = 0;
    int64_t recalled = 0;  // the layer's tier_recalled when the first buffered column came
    // Per row: the layer's seen tokens at the last push (-1: inactive); kept through the ring's
    // own scoring (full ring, due pass), cleared by flush(): the user may change rows then.
    std::vector<int64_t> seen;
  };

  Ring& ring(int64_t layer) {
    KVEVICT_CHECK_INDEX(layer >= 0 && layer < cache_->num_layers(), "LseRing: layer must be in [0, ",
                        cache_->num_layers(), "), got ", layer);
    return layers_[static_cast<size_t>(layer)];
  }
  const Ring& ring(int64_t layer) const { return const_cast<LseRing*>(this)->ring(layer); }

  /// Scores the buffered columns of `layer` (one observation) and empties the ring.
  void score(int64_t layer, const char* what) {
    auto& R = ring(layer);
    if (R.n == 0) return;
    std::vector<at::Tensor> q;
    for (const auto& t : R.q) q.push_back(t.narrow(2, 0, R.n));
    const auto lse = R.lse.narrow(2, 0, R.n);
    const int64_t lost = R.n;
    R.n = 0;  // scored or not, these columns are gone: a throw must not replay them
    check_rows_unchanged(layer, R, false, what);
    check_no_recall(layer, R, lost, what);
    observe(layer, q, lse);
  }

  /// Row b's seen tokens in `layer`, -1 where the row is inactive.
  int64_t row_seen(int64_t layer, int64_t b) const {
    return cache_->policy().active(b) ? cache_->policy().seen_tokens(layer, b) : -1;
  }
  /// Records every row's seen tokens (in place: no allocation after the first push).
  void record_rows(int64_t layer, Ring& R) const {
    R.seen.resize(static_cast<size_t>(cache_->batch_size()));
    for (int64_t b = 0; b < cache_->batch_size(); ++b) R.seen[static_cast<size_t>(b)] = row_seen(layer, b);
  }

  /// Buffered columns are matched to each row's newest positions: since the last push, each
  /// active row must have had exactly one update (a push: its latest append; a scoring: none)
  /// and no row may have been truncated, reset, finished or added. Empty record: no check.
  void check_rows_unchanged(int64_t layer, const Ring& R, bool after_update, const char* what) const {
    if (R.seen.empty()) return;
    for (size_t b = 0; b < R.seen.size(); ++b) {
      const auto row = static_cast<int64_t>(b);
      const int64_t now = row_seen(layer, row);
      const char* fix = "; push() after every update, flush() before truncate, reset, finish, add_sequence or restore_layer";
      KVEVICT_CHECK((now < 0) == (R.seen[b] < 0), "LseRing::", what, ": layer ", layer, " row ", b, " was ",
                    R.seen[b] < 0 ? "free" : "active", " at the last push and is ", now < 0 ? "free" : "active",
                    " now", fix);
      if (now < 0) continue;
      const int64_t expected = R.seen[b] + (after_update ? cache_->policy().appended(layer, row) : 0);
      KVEVICT_CHECK(now == expected, "LseRing::", what, ": layer ", layer, " row ", b, " has ", now,
                    " seen tokens, expected ", expected, " (", R.seen[b], " at the last push",
                    after_update ? " plus the latest update" : "", ")", fix);
    }
  }

  /// Tokens recalled into `layer` so far (0 without a host tier).
  int64_t tier_recalled(int64_t layer) const {
    return cache_->tier_tokens() > 0 ? cache_->stats(layer).tier_recalled : 0;
  }

  /// Buffered columns were attended over the rows cached when they were pushed: a recall since
  /// the first of them (`lost` columns) replaced some, so they cannot be scored.
  void check_no_recall(int64_t layer, const Ring& R, int64_t lost, const char* what) const {
    if (cache_->tier_tokens() == 0) return;
    const int64_t recalled = tier_recalled(layer) - R.recalled;
    KVEVICT_CHECK(recalled == 0, "LseRing::", what, ": layer ", layer, " recalled ", recalled,
                  " tokens from its host tier (tier_tokens) while ", lost,
                  " query columns were buffered; their LSEs were computed over the rows the recall replaced, so "
                  "they can no longer be scored and were dropped; flush() the ring before the update of a step "
                  "that recalls");
  }

  void observe(int64_t layer, const std::vector<at::Tensor>& q, const at::Tensor& lse) {
    if constexpr (std::is_same_v<Cache, BasicMlaCache<typename Cache::policy_type>>) {
      observe_lse(q[0], *cache_, layer, lse, scale_, opts_);
    } else {
      observe_lse_absorbed(q[0], q[1], *cache_, layer, lse, scale_, opts_);
    }
  }

  void push_impl(int64_t layer, std::vector<at::Tensor> q, const at::Tensor& lse) {
    auto& R = ring(layer);
    const auto& policy = cache_->policy();
    // Every input, every push (as observe_lse would): a buffered column must be a valid one.
    int64_t T = 0;
    if constexpr (std::is_same_v<Cache, BasicMlaCache<typename Cache::policy_type>>) {
      T = detail::check_query(q[0], "q", *cache_, layer, cache_->options().qk_dim(), "qk_dim");
    } else {
      T = detail::check_query(q[0], "q_absorbed", *cache_, layer, cache_->options().kv_lora_rank(), "kv_lora_rank");
      detail::check_query(q[1], "q_pe", *cache_, layer, cache_->options().qk_rope_dim(), "qk_rope_dim");
      KVEVICT_CHECK(q[1].size(2) == T, "LseRing::push: q_pe has T = ", q[1].size(2), ", q_absorbed ", T);
    }
    detail::check_lse(lse, cache_->batch_size(), cache_->num_heads(), T, cache_->device());
    check_rows_unchanged(layer, R, true, "push");
    if (R.n > 0 && cache_->tier_tokens() > 0 && tier_recalled(layer) != R.recalled) {
      const int64_t lost = R.n;  // a recall since the first buffered column: drop them, start over
      R.n = 0;
      R.seen.clear();
      check_no_recall(layer, R, lost, "push");
    }
    bool dense = true, same = true;
    int64_t count = -1;  // what every active row appended, if they agree
    for (int64_t b = 0; b < cache_->batch_size(); ++b) {
      if (!policy.active(b)) continue;
      if (policy.appended(layer, b) != T) dense = false;
      if (count >= 0 && policy.appended(layer, b) != count) same = false;
      count = policy.appended(layer, b);
    }
    KVEVICT_CHECK(dense || !same, "LseRing::push: layer ", layer, ": q has T = ", T,
                  " query columns, but the latest update appended ", count, " tokens to every row");
    if (!dense) {
      if (R.n > 0) {  // they can no longer be scored (the ragged update moved the newest positions)
        const int64_t lost = R.n;
        R.n = 0;
        R.seen.clear();  // the ring starts over: the next push is checked against nothing
        KVEVICT_CHECK(false, "LseRing::push: layer ", layer, " had ", lost,
                      " query columns buffered but the latest update was ragged (rows appended different counts): "
                      "they can no longer be scored and were dropped; flush() before a ragged update");
      }
      observe(layer, q, lse);
      record_rows(layer, R);
      return;
    }
    const int64_t cap = std::max(ring_size(), R.n + T);
    if (R.q.empty() || R.q[0].size(2) < cap) {
      std::vector<at::Tensor> grown;
      for (const auto& t : q) {
        auto g = at::empty({t.size(0), t.size(1), cap, t.size(3)}, t.options());
        if (R.n > 0) g.narrow(2, 0, R.n).copy_(R.q[grown.size()].narrow(2, 0, R.n));
        grown.push_back(g);
      }
      auto lse_g = at::empty({lse.size(0), lse.size(1), cap}, lse.options().dtype(at::kFloat));
      if (R.n > 0) lse_g.narrow(2, 0, R.n).copy_(R.lse.narrow(2, 0, R.n));
      R.q = std::move(grown);
      R.lse = lse_g;
    }
    KVEVICT_CHECK(q.size() == R.q.size() && lse.dim() == 3 && lse.size(2) == T, "LseRing::push: lse must be [B, H, T = ",
                  T, "]");
    for (size_t i = 0; i < q.size(); ++i) R.q[i].narrow(2, R.n, T).copy_(q[i]);
    R.lse.narrow(2, R.n, T).copy_(lse);
    if (R.n == 0) R.recalled = tier_recalled(layer);
    R.n += T;
    record_rows(layer, R);
    if (R.n >= ring_size()) score(layer, "push");
  }

  Cache* cache_;
  c10::optional<double> scale_;
  LseOptions opts_;
  std::vector<Ring> layers_;
};

}  // namespace kvevict
