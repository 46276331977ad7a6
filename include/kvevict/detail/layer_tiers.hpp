#pragma once
// The host tier of every layer of a cache, described from the layout's buffers (BufferSpec): which
// buffers are keys, how a token's rows are laid out, and which path the tier takes.

#include <kvevict/detail/layer_buffers.hpp>
#include <kvevict/detail/tier/tier.hpp>
#include <kvevict/options.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace kvevict {
namespace detail {

/// One LayerTier per layer (`layers` of them) for buffers `specs` in `dtype`: `batch` rows of
/// at most `tier_tokens` tokens, scorer states of `state_width` floats, digests of
/// `page_size`-token pages over the key buffers scored by `scoring`; the host path's (`host`) or
/// the tensor path's with its tensors on `device`. Allocates nothing on the device until the
/// first take.
inline std::vector<LayerTier> layer_tiers(const std::vector<BufferSpec>& specs, at::ScalarType dtype, int64_t layers,
                                          int64_t batch, int64_t tier_tokens, int64_t state_width, int64_t page_size,
                                          TierScoring scoring, bool host, const at::Device& device) {
  std::vector<int64_t> row_bytes, groups;
  std::vector<std::vector<int64_t>> shapes;
  TierKeys keys;
  keys.dtype = dtype;
  keys.page_size = page_size;
  keys.head_mean = scoring == TierScoring::kHeadMean;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    int64_t g = 1;  // a token's rows: one per outer index
    for (const auto o : spec.outer) g *= o;
    groups.push_back(g);
    row_bytes.push_back(spec.row_elements() * static_cast<int64_t>(c10::elementSize(dtype)));
    shapes.push_back(spec.token_shape());
    if (spec.key) {
      keys.buffers.push_back(i);
      keys.shared = spec.outer.empty();  // latent: no head dim, every head meets the key
    }
  }
  std::vector<LayerTier> tiers;
  tiers.reserve(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l)
    tiers.emplace_back(batch, tier_tokens, state_width, row_bytes, groups, keys, host, shapes, device);
  return tiers;
}

}  // namespace detail
}  // namespace kvevict
