#pragma once
// The host tier: where a cache's evicted tokens go instead of being dropped (ArkVale, Chen et
// al. 2024, Sec. 4: evicted pages backed up in host memory). Per layer and batch row it keeps
// each evicted token's rows (every buffer of the layout, bit for bit), its position, its rank
// at eviction and its scorer state, within a budget of tokens per row: past it the lowest-
// ranked tier tokens are dropped, with the eviction order (lower rank first, equal ranks the
// older position first, non-finite ranks lowest). CPU host path only, for now.

#include <kvevict/check.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace kvevict {
namespace detail {

/// One row's tier in one layer: n tokens in arrival order (swap-removed when dropped).
struct TierRow {
  std::vector<int64_t> position;            // [n]
  std::vector<float> rank;                  // [n] Scorer::rank at eviction
  std::vector<float> state;                 // [n, W] scorer state at eviction
  std::vector<std::vector<uint8_t>> bytes;  // per buffer: [n, row_bytes[i]]

  int64_t size() const { return static_cast<int64_t>(position.size()); }
  void clear() {
    position.clear();
    rank.clear();
    state.clear();
    for (auto& b : bytes) b.clear();
  }
};

/// True when tier token a goes before tier token b (the eviction order: lower rank first,
/// equal ranks the older position first; NaN and -inf below every finite rank, +inf above).
inline bool drops_before(float ra, int64_t pa, float rb, int64_t pb) {
  const bool fa = std::isfinite(ra), fb = std::isfinite(rb);
  const float ka = fa ? ra : (ra > 0 ? INFINITY : -INFINITY);
  const float kb = fb ? rb : (rb > 0 ? INFINITY : -INFINITY);
  const int ca = fa ? 1 : (ka > 0 ? 2 : 0), cb = fb ? 1 : (kb > 0 ? 2 : 0);  // NaN/-inf, finite, +inf
  if (ca != cb) return ca < cb;
  if (ca == 1 && ka != kb) return ka < kb;
  return pa < pb;
}

/// The tiers of one layer: one TierRow per batch row, a token budget per row, and the byte
/// size of one token's row in each buffer.
class LayerTier {
 public:
  LayerTier() = default;
  LayerTier(int64_t batch, int64_t budget, int64_t state_width, std::vector<int64_t> row_bytes)
      : rows_(static_cast<size_t>(batch)), budget_(budget), W_(state_width), row_bytes_(std::move(row_bytes)) {
    for (auto& r : rows_) r.bytes.resize(row_bytes_.size());
  }

  int64_t budget() const { return budget_; }
  const TierRow& row(int64_t b) const { return rows_[static_cast<size_t>(b)]; }
  TierRow& row(int64_t b) { return rows_[static_cast<size_t>(b)]; }
  int64_t row_bytes(size_t buffer) const { return row_bytes_[buffer]; }
  int64_t num_buffers() const { return static_cast<int64_t>(row_bytes_.size()); }

  /// Appends one token to row b (after reserve(): allocates nothing): its position, rank, state [W] and, per buffer, a pointer to
  /// `groups` pieces of row_bytes / groups bytes each, `stride` bytes apart (the token's rows
  /// in a [B, outer..., slots, inner] buffer: one piece per outer index).
  void add(int64_t b, int64_t position, float rank, const float* state,
           const std::vector<const uint8_t*>& src, const std::vector<int64_t>& groups,
           const std::vector<int64_t>& stride) {
    auto& r = row(b);
    r.position.push_back(position);
    r.rank.push_back(rank);
    r.state.insert(r.state.end(), state, state + W_);
    for (size_t i = 0; i < row_bytes_.size(); ++i) {
      const int64_t piece = row_bytes_[i] / groups[i];
      auto& out = r.bytes[i];
      const size_t at = out.size();
      out.resize(at + static_cast<size_t>(row_bytes_[i]));
      for (int64_t g = 0; g < groups[i]; ++g) {
        std::memcpy(out.data() + at + g * piece, src[i] + g * stride[i], static_cast<size_t>(piece));
      }
    }
  }

  /// Makes room in row b for `extra` more tokens and in the scratch of enforce_budget(), so
  /// that add() and enforce_budget() then allocate nothing and do not throw. Changes no token.
  void reserve(int64_t b, int64_t extra) {
    auto& r = row(b);
    const auto n = static_cast<size_t>(r.size() + extra);
    r.position.reserve(n);
    r.rank.reserve(n);
    r.state.reserve(n * static_cast<size_t>(W_));
    for (size_t i = 0; i < row_bytes_.size(); ++i) r.bytes[i].reserve(n * static_cast<size_t>(row_bytes_[i]));
    order_.reserve(n);
    drop_.reserve(n);
  }

  /// Drops the lowest-ranked tokens of row b until it holds at most budget() tokens. Allocates
  /// nothing after reserve() for the tokens added.
  void enforce_budget(int64_t b) {
    auto& r = row(b);
    const int64_t over = r.size() - budget_;
    if (over <= 0) return;
    order_.resize(static_cast<size_t>(r.size()));
    std::iota(order_.begin(), order_.end(), int64_t{0});
    const auto before = [&](int64_t x, int64_t y) { return drops_before(r.rank[x], r.position[x], r.rank[y], r.position[y]); };
    std::nth_element(order_.begin(), order_.begin() + (over - 1), order_.end(), before);
    drop_.assign(static_cast<size_t>(r.size()), 0);
    for (int64_t i = 0; i < over; ++i) drop_[static_cast<size_t>(order_[i])] = 1;
    remove_if(r, [&](int64_t i) { return drop_[static_cast<size_t>(i)] != 0; });
  }

  /// Drops the tokens of row b at positions >= `from` (a truncate). Allocates nothing.
  void drop_from(int64_t b, int64_t from) {
    auto& r = row(b);
    remove_if(r, [&](int64_t i) { return r.position[i] >= from; });
  }

  /// Tokens of row b at positions >= `from`.
  int64_t count_from(int64_t b, int64_t from) const {
    const auto& p = row(b).position;
    return std::count_if(p.begin(), p.end(), [&](int64_t x) { return x >= from; });
  }

  /// Host bytes held by every row's tokens (positions, ranks, states and rows).
  int64_t bytes() const {
    int64_t per_token = 8 + 4 + 4 * W_;
    for (auto x : row_bytes_) per_token += x;
    int64_t n = 0;
    for (const auto& r : rows_) n += r.size();
    return n * per_token;
  }
  int64_t tokens() const {
    int64_t n = 0;
    for (const auto& r : rows_) n += r.size();
    return n;
  }

 private:
  /// Removes the tokens i with drop(i), keeping the order of the others (stable compaction,
  /// in place: allocates nothing).
  template <class Drop>
  void remove_if(TierRow& r, Drop&& drop) {
    int64_t k = 0;
    const int64_t n = r.size();
    for (int64_t i = 0; i < n; ++i) {
      if (drop(i)) continue;
      if (k != i) {
        r.position[k] = r.position[i];
        r.rank[k] = r.rank[i];
        std::copy(r.state.begin() + i * W_, r.state.begin() + (i + 1) * W_, r.state.begin() + k * W_);
        for (size_t j = 0; j < row_bytes_.size(); ++j) {
          const int64_t rb = row_bytes_[j];
          std::memmove(r.bytes[j].data() + k * rb, r.bytes[j].data() + i * rb, static_cast<size_t>(rb));
        }
      }
      ++k;
    }
    r.position.resize(static_cast<size_t>(k));
    r.rank.resize(static_cast<size_t>(k));
    r.state.resize(static_cast<size_t>(k * W_));
    for (size_t j = 0; j < row_bytes_.size(); ++j) r.bytes[j].resize(static_cast<size_t>(k * row_bytes_[j]));
  }

  std::vector<TierRow> rows_;
  int64_t budget_ = 0;
  int64_t W_ = 1;
  std::vector<int64_t> row_bytes_;
  std::vector<int64_t> order_;  // enforce_budget() scratch
  std::vector<uint8_t> drop_;
};

}  // namespace detail
}  // namespace kvevict
