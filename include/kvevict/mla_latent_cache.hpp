#pragma once
// MlaLatentCache: the compressed MLA layout (ckv + kpe per token, shared by all heads), the
// layout production MLA engines store, held at a fixed size by the same eviction contract.

#include <kvevict/detail/cache_base.hpp>
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
      : Base(Policy((options.validate(), options.policy_options()), eviction, std::move(scorer)),
             {{"ckv_new", {}, options.kv_lora_rank(), {"B", "T", "kv_lora_rank"}},
              {"kpe_new", {}, options.qk_rope_dim(), {"B", "T", "qk_rope_dim"}}},
             options.dtype(), options.tier_tokens()),
        options_(options) {}

  const MlaLatentCacheOptions& options() const noexcept { return options_; }

  /// Appends the latent rows of T new tokens to `layer`, at positions seen_tokens(layer) ..
  /// + T - 1, with score 0.
  ///
  /// \param ckv_new  [B, T, kv_lora_rank] compressed KV after kv_a_layernorm, cache dtype/device.
  /// \param kpe_new  [B, T, qk_rope_dim] RoPE key (RoPE applied), same B and T.
  /// \return {ckv [B, S, kv_lora_rank], kpe [B, S, qk_rope_dim]}: views over slots [0, S),
  ///         slot order (see positions()); invalidated by the next update() or evict().
  /// \throws c10::Error (IndexError/TypeError) on a bad layer, shape, dtype or device; the
  ///         cache is unchanged.
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& ckv_new, const at::Tensor& kpe_new) {
    auto views = Base::append(layer, {ckv_new, kpe_new}, {});
    return {views[0], views[1]};
  }

  /// update() for a ragged chunk: row b appends only its last counts[b] columns of the T
  /// (left padding); see BasicMlaCache::update(layer, k_new, v_new, counts).
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& ckv_new, const at::Tensor& kpe_new,
                                           at::IntArrayRef counts) {
    auto views = Base::append(layer, {ckv_new, kpe_new}, counts);
    return {views[0], views[1]};
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
