#pragma once
// Quest's page digest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient
// Long-Context LLM Inference", Sec. 3.2; ArkVale, Chen et al. 2024, Sec. 4.2): per page, the
// per-channel maximum and minimum of its tokens' keys. For any query q,
// sum_c max(q_c min_c, q_c max_c) bounds q.k from above for every key of the page, so scoring
// the digests finds the pages a query would attend without reading their rows.
//
// A digest type is what a page table (PageTable, page_table.hpp) keeps per page slot, and the
// tensor path's TierStore and the memory model read. Its interface, which a new
// digest implements in a file of its own (then named in page_digests.hpp):
//   Digest(groups, width)     a token's keys are `groups` vectors of `width` floats
//   groups(), width()
//   floats()                  fp32 values in one page's digest (a block); bytes(): their bytes
//   page_shape()              a block as a tensor's trailing dims, key groups first
//   kBytesPerKeyChannel       bytes of a page's digest per key channel (groups x width of them)
//   start(d, key)             block d := the digest of a page whose only key is `key`
//   insert(d, key)            adds `key` [groups, width] to block d
//   rebuild(d, members)       block d := the digest of the keys members(add) passes to add()
//   bound(pages, q, scale)    scale * the bound of queries q [..., groups, M, width] on blocks
//                             `pages` [..., P, page_shape()]: [..., groups, M, P] fp32

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvevict {
namespace detail {

/// Queries q [..., width] as [..., 2 width]: [max(q, 0) | min(q, 0)]. Against a digest [max |
/// min] of a page, one product gives the Quest bound sum_c max(q_c min_c, q_c max_c).
inline at::Tensor bound_query(const at::Tensor& q) {
  const auto pos = q.clamp_min(0);
  return at::cat({pos, q - pos}, -1);
}

/// Quest's digest of a page: [groups, 2, width] fp32, per key group its per-channel maximum,
/// then its minimum (so that one matmul of [max(q, 0) | min(q, 0)] against it gives the bound).
class QuestDigest {
 public:
  /// fp32 max and min per key channel.
  static constexpr int64_t kBytesPerKeyChannel = 2 * static_cast<int64_t>(sizeof(float));

  QuestDigest() = default;
  QuestDigest(int64_t groups, int64_t width) : G_(groups), D_(width) {}

  int64_t groups() const noexcept { return G_; }
  int64_t width() const noexcept { return D_; }
  /// fp32 values in one page's digest, and their bytes.
  int64_t floats() const noexcept { return 2 * G_ * D_; }
  int64_t bytes() const noexcept { return floats() * static_cast<int64_t>(sizeof(float)); }
  /// One page's digest as a tensor's trailing dims: [groups, 2 width] (max, then min).
  std::vector<int64_t> page_shape() const { return {G_, 2 * D_}; }

  /// Digest `d` of a page whose only key is `key` [groups, width] (a NaN channel left out, as
  /// insert() leaves it: -inf max, +inf min).
  void start(float* d, const float* key) const {
    rebuild(d, [&](auto&& add) { add(key); });
  }

  /// Folds keys `key` [groups, width] into digest `d`. A NaN channel of `key` is left out
  /// (std::max(hi, NaN) keeps hi), so the digest does not depend on the order keys come in.
  void insert(float* d, const float* key) const {
    for (int64_t g = 0; g < G_; ++g) {
      float* hi = d + 2 * g * D_;
      float* lo = hi + D_;
      const float* k = key + g * D_;
      for (int64_t c = 0; c < D_; ++c) {
        hi[c] = std::max(hi[c], k[c]);
        lo[c] = std::min(lo[c], k[c]);
      }
    }
  }

  /// Digest `d` of the keys members(add) passes, one [groups, width] at a time, to add(key).
  template <class Members>
  void rebuild(float* d, Members&& members) const {
    for (int64_t g = 0; g < G_; ++g) {
      std::fill(d + 2 * g * D_, d + (2 * g + 1) * D_, -std::numeric_limits<float>::infinity());
      std::fill(d + (2 * g + 1) * D_, d + (2 * g + 2) * D_, std::numeric_limits<float>::infinity());
    }
    members([&](const float* key) { insert(d, key); });
  }

  /// scale * (the Quest bound) of queries q [..., groups, M, width] (fp32) on the digests
  /// `pages` [..., P, groups, 2 width] (same device): [..., groups, M, P] fp32. Allocates.
  static at::Tensor bound(const at::Tensor& pages, const at::Tensor& q, double scale) {
    // [..., P, G, 2 width] as [..., G, 2 width, P] for the matmul.
    const int64_t n = pages.dim();
    std::vector<int64_t> dims;
    for (int64_t i = 0; i < n - 3; ++i) dims.push_back(i);
    dims.insert(dims.end(), {n - 2, n - 1, n - 3});
    return at::matmul(bound_query(q), pages.permute(dims)).mul_(scale);
  }

 private:
  int64_t G_ = 1, D_ = 1;
};

}  // namespace detail
}  // namespace kvevict
