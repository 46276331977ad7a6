#pragma once
// Memory model: bytes a KV cache holds, for any MLA config, in either layout.

#include <kvevict/check.hpp>
#include <kvevict/detail/tier/page_digests.hpp>

#include <algorithm>
#include <cstdint>

namespace kvevict {
namespace detail {

/// a * b, or a c10::ValueError naming `what` if the product does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  KVEVICT_CHECK_VALUE(!__builtin_mul_overflow(a, b, &out), "memory model: ", what, " overflows int64 (", a, " x ", b,
                      ")");
  return out;
}

/// a + b, or a c10::ValueError naming `what` on int64 overflow.
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  KVEVICT_CHECK_VALUE(!__builtin_add_overflow(a, b, &out), "memory model: ", what, " overflows int64 (", a, " + ", b,
                      ")");
  return out;
}

}  // namespace detail

/// The two ways an MLA model's cache can be stored.
enum class Layout {
  /// Per-head keys [H, qk_dim] and values [H, v_dim] per token and layer (MlaCache).
  kExpanded,
  /// One compressed ckv [kv_lora_rank] plus RoPE key kpe [qk_rope_dim] per token and layer,
  /// shared by all heads (what production MLA engines store).
  kLatent,
};

/// The dimensions that size an MLA cache. Defaults: DeepSeek-V3 (61 layers, 128 heads,
/// 192 + 128 per head, kv_lora_rank 512, RoPE 64), 2 bytes per element (fp16/bf16).
struct MlaMemoryConfig {
  int64_t num_layers = 61;
  int64_t num_heads = 128;
  int64_t qk_dim = 192;
  int64_t v_dim = 128;
  int64_t kv_lora_rank = 512;
  int64_t qk_rope_dim = 64;
  int64_t bytes_per_element = 2;
};

/// Bytes one token takes in one layer (K/V data only; the eviction state adds 8 + 4 x W bytes
/// per slot and layer, independent of the layout: the int64 position and W fp32 values of
/// scorer state (W = 1, or 2 for MeanObservedAttention); and a layer holds capacity +
/// evict_every slots per row, see docs/cpp-guide.md, "Memory: the growth rule").
/// \throws c10::ValueError if a dimension is < 1, or the result overflows int64.
inline int64_t bytes_per_token_per_layer(const MlaMemoryConfig& c, Layout layout) {
  KVEVICT_CHECK_VALUE(c.num_layers >= 1 && c.num_heads >= 1 && c.qk_dim >= 1 && c.v_dim >= 1 &&
                          c.kv_lora_rank >= 1 && c.qk_rope_dim >= 1 && c.bytes_per_element >= 1,
                      "MlaMemoryConfig: every dimension must be >= 1, got num_layers=", c.num_layers,
                      ", num_heads=", c.num_heads, ", qk_dim=", c.qk_dim, ", v_dim=", c.v_dim,
                      ", kv_lora_rank=", c.kv_lora_rank, ", qk_rope_dim=", c.qk_rope_dim,
                      ", bytes_per_element=", c.bytes_per_element);
  using detail::checked_add;
  using detail::checked_mul;
  return layout == Layout::kExpanded
             ? checked_mul(checked_mul(c.num_heads, checked_add(c.qk_dim, c.v_dim, "qk_dim + v_dim"),
                                       "num_heads x (qk_dim + v_dim)"),
                           c.bytes_per_element, "bytes per token and layer")
             : checked_mul(checked_add(c.kv_lora_rank, c.qk_rope_dim, "kv_lora_rank + qk_rope_dim"),
                           c.bytes_per_element, "bytes per token and layer");
}

/// Bytes one token takes across all layers (seed config, expanded, 64 heads, fp16:
/// 61 * 64 * 320 * 2 = 2,498,560).
/// \throws c10::ValueError if a dimension is < 1, or the result overflows int64.
inline int64_t bytes_per_token(const MlaMemoryConfig& c, Layout layout) {
  return detail::checked_mul(c.num_layers, bytes_per_token_per_layer(c, layout), "bytes per token (all layers)");
}

/// Bytes a full cache of `seq_len` tokens takes for one sequence, all layers.
/// \throws c10::ValueError if seq_len < 0, or the result overflows int64.
inline int64_t full_cache_bytes(const MlaMemoryConfig& c, Layout layout, int64_t seq_len) {
  KVEVICT_CHECK_VALUE(seq_len >= 0, "seq_len must be >= 0, got ", seq_len);
  return detail::checked_mul(seq_len, bytes_per_token(c, layout), "seq_len x bytes per token");
}

/// Bytes a cache capped at `capacity` tokens (n_sink + budget + n_recent) takes after
/// `seq_len` tokens, one sequence, all layers: min(seq_len, capacity) tokens.
/// \throws c10::ValueError if seq_len < 0, capacity < 1, or the result overflows int64.
inline int64_t capped_cache_bytes(const MlaMemoryConfig& c, Layout layout, int64_t seq_len, int64_t capacity) {
  KVEVICT_CHECK_VALUE(capacity >= 1, "capacity must be >= 1, got ", capacity);
  return full_cache_bytes(c, layout, std::min(seq_len, capacity));
}

/// Host bytes the host tier (cache options' tier_tokens) holds for one sequence, all layers,
/// after `seq_len` tokens with device capacity `capacity` and a tier of `tier_tokens` per
/// layer, at most: min(max(seq_len - capacity, 0), tier_tokens) tokens per layer (exact with
/// evict_every 1; with more, up to evict_every - 1 of them still wait in the cache), each its K/V rows
/// (as in the cache's dtype) plus 8 + 4 + 4 x state_width bytes (position, rank at eviction,
/// scorer state). DeepSeek-V3 latent fp16 with W = 1: 61 x (1,152 + 16) = 71,248 bytes a token.
/// Plus the page digests (cache options' tier_page_size; the tier's digest, detail::TierDigest):
/// an fp32 min and max per key channel (latent: kv_lora_rank + qk_rope_dim; expanded:
/// num_heads x qk_dim) for at most min(tier tokens, ceil(seq_len / page_size)) pages per
/// layer: the host path's. The tensor path (CUDA) keeps the rows in pinned host memory,
/// reserved in steps up to tier_tokens per row, and the digests on the device by page id
/// instead (CacheStats::tier_bytes and tier_device_bytes): per row and layer one digest for
/// every page up to the largest position seen (ceil(seq_len / page_size)), however many
/// tokens the tier holds, plus 20 + 4 x state_width device bytes per store slot (position,
/// rank, insertion number, scorer state).
/// \throws c10::ValueError if seq_len < 0, capacity < 1, tier_tokens < 0, state_width < 1,
///         page_size < 1, or the result overflows int64.
inline int64_t tier_bytes(const MlaMemoryConfig& c, Layout layout, int64_t seq_len, int64_t capacity,
                          int64_t tier_tokens, int64_t state_width = 1, int64_t page_size = 16) {
  KVEVICT_CHECK_VALUE(seq_len >= 0, "seq_len must be >= 0, got ", seq_len);
  KVEVICT_CHECK_VALUE(capacity >= 1, "capacity must be >= 1, got ", capacity);
  KVEVICT_CHECK_VALUE(tier_tokens >= 0, "tier_tokens must be >= 0, got ", tier_tokens);
  KVEVICT_CHECK_VALUE(state_width >= 1, "state_width must be >= 1, got ", state_width);
  KVEVICT_CHECK_VALUE(page_size >= 1, "page_size must be >= 1, got ", page_size);
  using detail::checked_add;
  using detail::checked_mul;
  const int64_t tokens = std::min(std::max<int64_t>(seq_len - capacity, 0), tier_tokens);
  const int64_t per_token = checked_add(bytes_per_token_per_layer(c, layout),
                                        checked_add(12, checked_mul(4, state_width, "state bytes"), "tier bookkeeping"),
                                        "tier bytes per token and layer");
  const int64_t pages = std::min(tokens, seq_len / page_size + (seq_len % page_size != 0));
  const int64_t key_floats = layout == Layout::kLatent ? checked_add(c.kv_lora_rank, c.qk_rope_dim, "key width")
                                                       : checked_mul(c.num_heads, c.qk_dim, "key width");
  const int64_t page_bytes = checked_mul(detail::TierDigest::kBytesPerKeyChannel, key_floats, "digest bytes per page");
  const int64_t digest = checked_mul(pages, page_bytes, "digest bytes");
  return checked_mul(checked_add(checked_mul(tokens, per_token, "tier tokens x bytes"), digest, "tier bytes"),
                     c.num_layers, "tier bytes (all layers)");
}

}  // namespace kvevict
