#pragma once
// MlaLatentCache: the compressed MLA layout (ckv + kpe per token, shared by all heads), the
// layout production MLA engines store, held at a fixed size by the same eviction contract.

#include <kvevict/cache_base.hpp>
#include <kvevict/eviction_policy.hpp>
#include <kvevict/options.hpp>

#include <ATen/ATen.h>

#include <utility>

namespace kvevict {

/// A latent layer's live tokens sorted by position (copies).
struct OrderedLatentLayer {
  at::Tensor ckv;        // [B, S, kv_lora_rank]
  at::Tensor kpe;        // [B, S, qk_rope_dim]
  at::Tensor positions;  // [B, S] int64, ascending per row
};

/// A KV cache in the latent MLA layout (DeepSeek-V2 paper, Sec. 2.1.2; what vLLM, SGLang,
/// FlashInfer and llama.cpp store): per layer, `ckv [B, slots, kv_lora_rank]` (the compressed
/// KV after kv_a_layernorm) and `kpe [B, slots, qk_rope_dim]` (the shared RoPE key, RoPE
/// applied), fp32/fp16/bf16, on CPU or CUDA. DeepSeek-V3 at fp16: 576 * 2 = 1,152 bytes per
/// token and layer, against 128 * 320 * 2 = 81,920 in the expanded layout.
///
/// Same contract, storage, positions, stats and scorers as MlaCache (both derive from
/// detail::SlotCache): eviction is per token and cross-head, so all heads share the kept
/// tokens, as the latent layout needs. Attention goes through attend_absorbed().
///
/// Not thread-safe; one cache per sequence batch.
///
/// \tparam Policy EvictionPolicy<Scorer>.
template <class Policy = EvictionPolicy<CumulativeAttention>>
class BasicMlaLatentCache : public detail::CacheBase<Policy> {
  using Base = detail::CacheBase<Policy>;

 public:
  /// Allocates capacity + evict_every slots per row for every layer.
  /// \throws c10::ValueError if `options` or `eviction` are invalid, naming the value.
  BasicMlaLatentCache(const MlaLatentCacheOptions& options, const EvictionOptions& eviction = EvictionOptions(),
                      typename Policy::scorer_type scorer = typename Policy::scorer_type())
      : Base(Policy((options.validate(),
                     detail::check_cache_bytes("MlaLatentCache", options.policy_options(), eviction,
                                               (options.kv_lora_rank() + options.qk_rope_dim()) *
                                                   static_cast<int64_t>(c10::elementSize(options.dtype())),
                                               Policy::W, options.device()),
                     options.policy_options()),
                    eviction, std::move(scorer)),
             {{"ckv_new", {}, options.kv_lora_rank(), {"B", "T", "kv_lora_rank"}, true},
              {"kpe_new", {}, options.qk_rope_dim(), {"B", "T", "qk_rope_dim"}, true}},
             options.dtype(), options.tier_tokens(), options.tier_page_size(), options.tier_scoring()),
        options_(options) {}

  const MlaLatentCacheOptions& options() const noexcept { return options_; }

  /// Appends the latent rows of T new tokens to `layer`, at positions seen_tokens(layer) ..
  /// + T - 1, with score 0.
  ///
  /// \param ckv_new  [B, T, kv_lora_rank] compressed KV after kv_a_layernorm, cache dtype/device.
  /// \param kpe_new  [B, T, qk_rope_dim] RoPE key (RoPE applied), same B and T.
  /// \return {ckv [B, S, kv_lora_rank], kpe [B, S, qk_rope_dim]}: views over slots [0, S),
  ///         slot order (see positions()); invalidated by the next update() or evict().
  /// \throws c10::Error (IndexError/TypeError) on a bad layer, shape, dtype or device, or if
  ///         every row is free (finish(): add_sequence() first); the cache is unchanged.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& ckv_new, const at::Tensor& kpe_new) {
    return detail::host_heap("update", [&]() -> std::pair<at::Tensor, at::Tensor> {
      auto views = Base::append(layer, {ckv_new, kpe_new}, {});
      return {views[0], views[1]};
    });
  }

  /// update() for a ragged chunk: row b appends only its last counts[b] columns of the T
  /// (left padding); see BasicMlaCache::update(layer, k_new, v_new, counts).
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& ckv_new, const at::Tensor& kpe_new,
                                           at::IntArrayRef counts) {
    return detail::host_heap("update", [&]() -> std::pair<at::Tensor, at::Tensor> {
      auto views = Base::append(layer, {ckv_new, kpe_new}, counts);
      return {views[0], views[1]};
    });
  }

  /// [B, S, kv_lora_rank] live compressed KV (a view, slot order, cache device); invalidated
  /// by the next update() or evict() of the layer. \throws c10::IndexError.
  at::Tensor ckv(int64_t layer) const { return Base::live(layer)[0]; }
  /// [B, S, qk_rope_dim] live RoPE keys (a view, slot order, cache device); invalidated by
  /// the next update() or evict() of the layer. \throws c10::IndexError.
  at::Tensor kpe(int64_t layer) const { return Base::live(layer)[1]; }

  /// Copies of the live ckv, kpe and positions of `layer`, sorted by position per row.
  /// \throws c10::IndexError for a bad layer.
  OrderedLatentLayer ordered(int64_t layer) const {
    auto b = Base::ordered_buffers(layer);
    return {b[0], b[1], b[2]};
  }

  /// Brings tokens back from the host tier: BasicMlaCache::recall() for the latent layout,
  /// with the absorbed queries attend_absorbed() takes. A page's digest is the per-channel
  /// min and max of its tokens' [ckv | kpe] (kv_lora_rank + qk_rope_dim wide, shared by all
  /// heads); each head's query [q_absorbed | q_pe] is bounded against it.
  ///
  /// \param q_absorbed [B, H, Q, kv_lora_rank] q_nope times W_UK, any floating dtype, cache device.
  /// \param q_pe       [B, H, Q, qk_rope_dim] the RoPE queries, same B, H, Q.
  /// \param scale      the attention's logit scale, finite and > 0.
  /// \param tokens     the recall budget per row, >= 0.
  /// \param rescore    0, or the two-level recall's pool per row (BasicMlaCache::recall()).
  /// \return the tokens recalled per row: [B] int64 on the cache's device (BasicMlaCache::recall()).
  /// \throws c10::Error as BasicMlaCache::recall(); nothing changes then.
  at::Tensor recall_absorbed(int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, double scale,
                          int64_t tokens, int64_t rescore = 0) {
    return detail::host_heap("recall_absorbed",
                             [&] { return recall_checked(layer, q_absorbed, q_pe, scale, tokens, rescore); });
  }

 private:
  at::Tensor recall_checked(int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, double scale,
                         int64_t tokens, int64_t rescore) {
    Base::policy().size(layer);
    detail::check_tensor(q_absorbed, "q_absorbed", Base::device());
    detail::check_tensor(q_pe, "q_pe", Base::device());
    detail::check_shape(q_absorbed, "q_absorbed", {Base::batch_size(), Base::num_heads(), -1, options_.kv_lora_rank()},
                {"B", "H", "Q", "kv_lora_rank"}, "[B, H, Q, kv_lora_rank]");
    KVEVICT_CHECK_VALUE(q_absorbed.size(2) >= 1, "q_absorbed must hold at least one query, got Q = 0");
    detail::check_shape(q_pe, "q_pe", {Base::batch_size(), Base::num_heads(), q_absorbed.size(2), options_.qk_rope_dim()},
                {"B", "H", "Q", "qk_rope_dim"}, "[B, H, Q, qk_rope_dim]");
    KVEVICT_CHECK_TYPE(at::isFloatingType(q_absorbed.scalar_type()) && at::isFloatingType(q_pe.scalar_type()),
                       "q_absorbed and q_pe must be floating, got ", q_absorbed.scalar_type(), " and ", q_pe.scalar_type());
    const auto query = at::cat({q_absorbed.to(at::kFloat), q_pe.to(at::kFloat)}, -1).contiguous();
    Base::check_recall("recall_absorbed", layer, query, scale, tokens, rescore);
    return Base::recall_rows(layer, query, scale, tokens, rescore);
  }

 public:
  /// The rows of the host tier's tokens of `row` in `layer` ({ckv [n, kv_lora_rank], kpe [n, qk_rope_dim]}), in the order of
  /// tier_positions(), bit for bit as they were cached; CPU copies.
  /// \throws c10::IndexError for a bad layer or row; c10::Error without a tier.
  std::pair<at::Tensor, at::Tensor> tier_rows(int64_t layer, int64_t row) const {
    auto b = Base::tier_buffers(layer, row);
    return {b[0], b[1]};
  }

 private:
  MlaLatentCacheOptions options_;
};

/// The latent-layout cache with the H2O default policy (CumulativeAttention).
using MlaLatentCache = BasicMlaLatentCache<>;

}  // namespace kvevict
