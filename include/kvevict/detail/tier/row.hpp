#pragma once
// One row's tier in one layer (TierRow): its tokens' positions, ranks, scorer states and rows,
// in no particular order, and the eviction order the tier drops them in (drops_before()).
// LayerTier (tier.hpp) keeps one per batch row and does the bookkeeping around it.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace kvevict {
namespace detail {

/// One row's tier in one layer: n tokens in no particular order (a dropped token's place takes
/// the last one; the accessors sort by position).
struct TierRow {
  std::vector<int64_t> position;            // [n]
  std::vector<float> rank;                  // [n] Scorer::rank at eviction
  std::vector<float> state;                 // [n, W] scorer state at eviction
  std::vector<std::vector<uint8_t>> bytes;  // per buffer: [n, row_bytes[i]]

  int64_t size() const { return static_cast<int64_t>(position.size()); }
  /// Indices of the tokens by ascending position.
  std::vector<int64_t> order() const {
    std::vector<int64_t> o(static_cast<size_t>(size()));
    std::iota(o.begin(), o.end(), int64_t{0});
    std::sort(o.begin(), o.end(), [&](int64_t a, int64_t b) { return position[a] < position[b]; });
    return o;
  }
  /// [n] int64 positions, ascending (CPU).
  at::Tensor positions() const {
    const auto o = order();
    auto out = at::empty({static_cast<int64_t>(o.size())}, at::TensorOptions().dtype(at::kLong));
    for (size_t i = 0; i < o.size(); ++i) out.data_ptr<int64_t>()[i] = position[o[i]];
    return out;
  }
  /// [n] fp32 ranks at eviction, in the order of positions() (CPU).
  at::Tensor ranks() const {
    const auto o = order();
    auto out = at::empty({static_cast<int64_t>(o.size())});
    for (size_t i = 0; i < o.size(); ++i) out.data_ptr<float>()[i] = rank[o[i]];
    return out;
  }
  /// Per buffer, the rows as [outer..., n, inner] in the order of positions() (CPU, `dtype`);
  /// `shapes[i]`: buffer i's {outer..., inner}.
  std::vector<at::Tensor> rows(const std::vector<std::vector<int64_t>>& shapes, at::ScalarType dtype) const {
    const auto o = order();
    const auto n = static_cast<int64_t>(o.size());
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < shapes.size(); ++i) {
      std::vector<int64_t> shape(shapes[i].begin(), shapes[i].end() - 1);
      int64_t groups = 1;
      for (auto x : shape) groups *= x;
      const int64_t piece = shapes[i].back() * static_cast<int64_t>(c10::elementSize(dtype)), rb = groups * piece;
      shape.push_back(n);
      shape.push_back(shapes[i].back());
      auto t = at::empty(shape, at::TensorOptions().dtype(dtype));
      auto* dst = static_cast<uint8_t*>(t.data_ptr());
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t* src = bytes[i].data() + o[j] * rb;
        for (int64_t g = 0; g < groups; ++g) std::memcpy(dst + (g * n + j) * piece, src + g * piece, piece);
      }
      out.push_back(t);
    }
    return out;
  }

  /// Empties the row and gives its memory back.
  void release() {
    std::vector<int64_t>().swap(position);
    std::vector<float>().swap(rank);
    std::vector<float>().swap(state);
    for (auto& b : bytes) std::vector<uint8_t>().swap(b);
  }
};

/// True when tier token a goes before tier token b: the eviction order of a pass (selection.hpp:
/// lower rank first, equal ranks the older position first, every non-finite rank, NaN and
/// +-inf, below every finite one).
inline bool drops_before(float ra, int64_t pa, float rb, int64_t pb) {
  const bool fa = std::isfinite(ra), fb = std::isfinite(rb);
  if (fa != fb) return !fa;
  if (fa && ra != rb) return ra < rb;
  return pa < pb;
}

}  // namespace detail
}  // namespace kvevict
