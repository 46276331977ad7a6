#pragma once
// Memory model: bytes a KV cache holds, for any MLA config, in either layout.

#include <kvevict/check.hpp>

#include <algorithm>
#include <cstdint>

namespace kvevict {

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

/// Bytes one token takes in one layer (K/V data only; the caches' own bookkeeping adds 16 bytes
/// per slot and layer, independent of the layout: fp32 score, int64 position, fp32 scratch,
/// plus 4 for MeanObservedAttention's count; and a layer holds capacity + evict_every slots).
/// \throws c10::ValueError if a dimension is < 1.
inline int64_t bytes_per_token_per_layer(const MlaMemoryConfig& c, Layout layout) {
  KVEVICT_CHECK_VALUE(c.num_layers >= 1 && c.num_heads >= 1 && c.qk_dim >= 1 && c.v_dim >= 1 &&
                          c.kv_lora_rank >= 1 && c.qk_rope_dim >= 1 && c.bytes_per_element >= 1,
                      "MlaMemoryConfig: every dimension must be >= 1");
  return layout == Layout::kExpanded ? c.num_heads * (c.qk_dim + c.v_dim) * c.bytes_per_element
                                     : (c.kv_lora_rank + c.qk_rope_dim) * c.bytes_per_element;
}

/// Bytes one token takes across all layers (seed config, expanded, 64 heads, fp16:
/// 61 * 64 * 320 * 2 = 2,498,560).
inline int64_t bytes_per_token(const MlaMemoryConfig& c, Layout layout) {
  return c.num_layers * bytes_per_token_per_layer(c, layout);
}

/// Bytes a full cache of `seq_len` tokens takes for one sequence, all layers.
/// \throws c10::ValueError if seq_len < 0.
inline int64_t full_cache_bytes(const MlaMemoryConfig& c, Layout layout, int64_t seq_len) {
  KVEVICT_CHECK_VALUE(seq_len >= 0, "seq_len must be >= 0, got ", seq_len);
  return seq_len * bytes_per_token(c, layout);
}

/// Bytes a cache capped at `capacity` tokens (n_sink + budget + n_recent) takes after
/// `seq_len` tokens, one sequence, all layers: min(seq_len, capacity) tokens.
/// \throws c10::ValueError if seq_len < 0 or capacity < 1.
inline int64_t capped_cache_bytes(const MlaMemoryConfig& c, Layout layout, int64_t seq_len, int64_t capacity) {
  KVEVICT_CHECK_VALUE(capacity >= 1, "capacity must be >= 1, got ", capacity);
  return full_cache_bytes(c, layout, std::min(seq_len, capacity));
}

}  // namespace kvevict
