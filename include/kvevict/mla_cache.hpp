#pragma once
// MlaCache: the expanded DeepSeek-V3 layout (per-head keys and values), held at a fixed size.

#include <kvevict/cache_base.hpp>
#include <kvevict/eviction_policy.hpp>
#include <kvevict/options.hpp>

#include <ATen/ATen.h>

#include <utility>

namespace kvevict {

/// A layer's live tokens sorted by position (copies).
struct OrderedLayer {
  at::Tensor keys;       // [B, H, S, qk_dim]
  at::Tensor values;     // [B, H, S, v_dim]
  at::Tensor positions;  // [B, S] int64, ascending per row
};

/// A KV cache in the expanded MLA layout (as HF DeepseekV3 decompresses it): per layer, keys
/// [B, H, slots, qk_dim] (RoPE already applied to the last 64 dims) and values
/// [B, H, slots, v_dim], fp32/fp16/bf16, on CPU or CUDA, kept at capacity() tokens per row by
/// `Policy` (docs/DESIGN.md, "The contract"). Live tokens fill slots [0, size) of each row; slot
/// order is not position order (see positions(), ordered()).
///
/// One decode step for layer l:
/// \code
///   auto [k, v] = cache.update(l, k_new, v_new);  // append T tokens
///   auto out = kvevict::attend(q, cache, l);      // attention over the live slots; observes
///   cache.evict(l);                               // a pass when over capacity and due
/// \endcode
///
/// Not thread-safe; one cache per sequence batch.
///
/// \tparam Policy EvictionPolicy<Scorer>.
template <class Policy = EvictionPolicy<CumulativeAttention>>
class BasicMlaCache : public detail::CacheBase<Policy> {
  using Base = detail::CacheBase<Policy>;

 public:
  /// Allocates capacity + evict_every slots per row for every layer.
  /// \throws c10::ValueError if `options` or `eviction` are invalid, naming the value.
  BasicMlaCache(const MlaCacheOptions& options, const EvictionOptions& eviction = EvictionOptions(),
                typename Policy::scorer_type scorer = typename Policy::scorer_type())
      : Base(Policy((options.validate(),
                     detail::check_cache_bytes("MlaCache", options.policy_options(), eviction,
                                               options.num_heads() * (options.qk_dim() + options.v_dim()) *
                                                   static_cast<int64_t>(c10::elementSize(options.dtype())),
                                               Policy::W, options.device()),
                     options.policy_options()),
                    eviction, std::move(scorer)),
             {{"k_new", {options.num_heads()}, options.qk_dim(), {"B", "H", "T", "qk_dim"}, true},
              {"v_new", {options.num_heads()}, options.v_dim(), {"B", "H", "T", "v_dim"}}},
             options.dtype(), options.tier_tokens(), options.tier_page_size(), options.tier_scoring()),
        options_(options) {}

  const MlaCacheOptions& options() const noexcept { return options_; }

  /// Appends the keys and values of T new tokens (a prefill chunk or one decode step) to
  /// `layer`, at positions seen_tokens(layer) .. + T - 1, with score 0.
  ///
  /// \param k_new  [B, H, T, qk_dim] new keys (RoPE already applied), cache dtype and device.
  /// \param v_new  [B, H, T, v_dim] new values, same B, H, T.
  /// \return {keys [B, H, S, qk_dim], values [B, H, S, v_dim]}: views over slots [0, S),
  ///         S = live tokens after the append; slot order (see positions()). Invalidated by
  ///         the next update() or evict() of the layer.
  /// \throws c10::Error (IndexError/TypeError) on a bad layer, shape, dtype or device, or if
  ///         every row is free (finish(): add_sequence() first; a free row among active ones
  ///         appends nothing); the cache is unchanged.
  /// \note Copies T rows per head; grows the buffers (geometrically) only when an append
  ///       exceeds the slots. Never synchronises with the host.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& k_new, const at::Tensor& v_new) {
    return detail::host_heap("update", [&]() -> std::pair<at::Tensor, at::Tensor> {
      auto views = Base::append(layer, {k_new, v_new}, {});
      return {views[0], views[1]};
    });
  }

  /// update() for a ragged chunk (continuous batching, left-padded prompts): row b appends
  /// only its last counts[b] columns of the T; the other columns are pads, never stored. A
  /// decode row in a prefill chunk appends 1, an idle or free row 0.
  ///
  /// \param counts  [B] host counts, each in [0, T]; a free row must have 0.
  /// \return as update(): views [B, H, S, ...] with S = size(layer), the longest row.
  /// \throws c10::Error as update(), or on a bad count; the cache is unchanged then.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& k_new, const at::Tensor& v_new,
                                           at::IntArrayRef counts) {
    return detail::host_heap("update", [&]() -> std::pair<at::Tensor, at::Tensor> {
      auto views = Base::append(layer, {k_new, v_new}, counts);
      return {views[0], views[1]};
    });
  }

  /// [B, H, S, qk_dim] keys of the live slots (a view, slot order, cache device); invalidated
  /// by the next update() or evict() of the layer. \throws c10::IndexError.
  at::Tensor keys(int64_t layer) const { return Base::live(layer)[0]; }
  /// [B, H, S, v_dim] values of the live slots (a view, slot order, cache device); invalidated
  /// by the next update() or evict() of the layer. \throws c10::IndexError.
  at::Tensor values(int64_t layer) const { return Base::live(layer)[1]; }

  /// Copies of the live keys, values and positions of `layer` sorted by position per row.
  /// \throws c10::IndexError for a bad layer.
  OrderedLayer ordered(int64_t layer) const {
    auto b = Base::ordered_buffers(layer);
    return {b[0], b[1], b[2]};
  }

  /// Brings tokens back from the host tier (recall; ArkVale, Chen et al. 2024, Sec. 4, with
  /// Quest's page digests, Tang et al. 2024, Sec. 3.2). Call it after update() and before the
  /// attention of `layer`, with that attention's queries, whenever you want recall: every
  /// step, every r steps, or once per multi-token append such as a new user turn.
  ///
  /// Per row: every tier page (tier_page_size tokens by position) is scored with the row's
  /// real queries (right-aligned, as observe()): per head h and query, a softmax over the
  /// pages of scale * (Quest's bound on q.k from the page's per-channel key min and max, head
  /// h's keys), summed over heads and queries as exact fixed-point terms and, under tensor
  /// parallelism, reduced across processes like observations (reduce_contributions), so every
  /// process recalls the same pages. With tier_scoring TierScoring::kHeadMean instead, per
  /// query one softmax over the pages of scale * (the mean over heads of their Quest bounds;
  /// latent layout: the Quest bound of the heads' mean query), summed over the queries; under
  /// tensor parallelism the heads' fp64 sums are reduced before the softmax. The best pages (higher score first, equal scores the
  /// older page; never a page scored 0), each whole page that still fits, come back, at most
  /// `tokens` tokens and at most as many as the row has heavy-hitter candidates. They take
  /// the slots of the lowest-ranked heavy hitters (eviction order) below the recent window as
  /// it was before the latest append (so that a truncate of that append, rejected drafts,
  /// keeps its window whole), which go to the tier with their rank. Rows come back bit for
  /// bit, at their own positions (RoPE is untouched), so capacity stays a cap: the cache holds
  /// no more tokens than before.
  ///
  /// Two-level recall (rescore > tokens): the pages are only a first cut. The best whole pages
  /// up to `rescore` tokens per row form a pool; every pool token is scored again with its own
  /// keys (the same softmax, over the pool, of scale * q.k, per head or, with kHeadMean, of
  /// the heads' mean q.k; summed the same way and reduced the same way), and the best `tokens`
  /// come back one by one (higher score first, equal
  /// scores the older position; never a score of 0). Large pages keep scoring cheap, and the
  /// tokens that come back are chosen by their exact logits, not by their page's bound:
  /// scoring costs O(pages x width) plus O(rescore x width) per head and query, instead of
  /// O(tier tokens x width) for pages of one token. A token outside the pool is never
  /// considered, so the pool, not the pages, bounds what one call can find.
  ///
  /// A recalled token's scorer state is the state of the row's best-ranked heavy hitter before
  /// the recall (its own state at eviction would rank it lowest, and the next pass would send it
  /// straight back). With lazy_reduction, pending observations are applied first (flush(), a
  /// collective under tensor parallelism). With an LseRing, flush() it first: its buffered
  /// queries were scored against the rows recall replaces.
  ///
  /// \param query  [B, H, Q, qk_dim] the attention's queries (RoPE applied), any floating
  ///               dtype, cache device.
  /// \param scale  the attention's logit scale, finite and > 0 (e.g. 1 / sqrt(qk_dim)).
  /// \param tokens the recall budget per row, >= 0.
  /// \param rescore 0 (or <= tokens): whole pages come back; > tokens: the two-level recall's
  ///               pool per row, in tokens, at least tier_page_size.
  /// \return the tokens recalled per row: [B] int64 on the cache's device (not read by the
  ///         call: on CUDA, reading it is a sync, e.g. `.sum().item<int64_t>()`).
  /// \throws c10::Error without a tier, for a bad layer, shape, dtype, device, a non-finite
  ///         real query (pads and free rows may hold anything; checked with observation checks
  ///         on, the CPU's default: one read of the device; with them off, CUDA's default, a row
  ///         whose real queries are not finite recalls nothing) or scale, a negative budget or
  ///         rescore, a two-level rescore smaller than a page, an open observation, or when an
  ///         allocation fails (the scoring's on the device names it); nothing changes then.
  /// \note Allocates its scoring temporaries (one [B, pages] fp64 tensor and the matmul, O(H x
  ///       Q x pages x qk_dim), kHeadMean in the latent layout O(Q x pages x width); with
  ///       rescore, one [B, rescore] fp64 tensor, with kHeadMean one [B, Q, rescore] fp64 more, and O(H x Q x
  ///       rescore x qk_dim) more), and the swap's [B, tokens] slots and positions and [B, tokens,
  ///       W] states. CPU host path: syncs nothing. Tensor path (CUDA): every step runs on the
  ///       device (the tier's TierStore: digests by page id scored there, the victims and
  ///       the pick found there, the rows swapped through the pinned rows' device view,
  ///       2 x tokens rows per row over the bus); no host sync, no host read and, in a steady
  ///       decode (the same real query columns and appends as the step before), no copy
  ///       between host and device, so a step with recall can be captured in a CUDA graph.
  ///       With observation checks on, the query check reads the device once. A growing tier
  ///       or context reallocates the store (geometrically): capture graphs after the tier is
  ///       full. Keys views stay valid: rows change in place.
  at::Tensor recall(int64_t layer, const at::Tensor& query, double scale, int64_t tokens, int64_t rescore = 0) {
    return detail::host_heap("recall", [&] { return recall_checked(layer, query, scale, tokens, rescore); });
  }

 private:
  at::Tensor recall_checked(int64_t layer, const at::Tensor& query, double scale, int64_t tokens, int64_t rescore) {
    Base::policy().size(layer);
    detail::check_tensor(query, "query", Base::device());
    detail::check_shape(query, "query", {Base::batch_size(), Base::num_heads(), -1, options_.qk_dim()},
                {"B", "H", "Q", "qk_dim"}, "[B, H, Q, qk_dim]");
    KVEVICT_CHECK_TYPE(at::isFloatingType(query.scalar_type()), "query must be floating, got ", query.scalar_type());
    KVEVICT_CHECK_VALUE(query.size(2) >= 1, "query must hold at least one query, got Q = 0");
    const auto q = query.to(at::kFloat).contiguous();  // checked as it is scored: a query finite only in fp64 is not
    Base::check_recall("recall", layer, q, scale, tokens, rescore);
    return Base::recall_rows(layer, q, scale, tokens, rescore);
  }

 public:
  /// The rows of the host tier's tokens of `row` in `layer` ({keys [H, n, qk_dim], values [H, n, v_dim]}), in the order of
  /// tier_positions(), bit for bit as they were cached; CPU copies.
  /// \throws c10::IndexError for a bad layer or row; c10::Error without a tier.
  std::pair<at::Tensor, at::Tensor> tier_rows(int64_t layer, int64_t row) const {
    auto b = Base::tier_buffers(layer, row);
    return {b[0], b[1]};
  }

 private:
  MlaCacheOptions options_;
};

/// The expanded-layout cache with the H2O default policy (CumulativeAttention).
using MlaCache = BasicMlaCache<>;

}  // namespace kvevict
