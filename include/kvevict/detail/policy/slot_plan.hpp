#pragma once
// The plan of one pass (or a rollback) as slot moves, before anything changes: what the
// caches and EvictionPolicy::evict() apply to every buffer of a layer, then commit.

#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvevict {
namespace detail {

/// A planned pass: each row's evicted count, evicted slots and new length, and the moves (host
/// arrays on the host path, device tensors on the tensor path).
struct Pass {
  std::vector<int64_t> n;        // [B] tokens evicted per row
  std::vector<int64_t> new_len;  // [B]
  std::vector<int64_t> moves;    // [B] real moves per row (host-built passes)
  int64_t columns = 0;           // move columns per row
  int64_t slot_bound = 0;        // every move's slots are below this (the longest row before)
  std::vector<int64_t> src, dst; // host-built: [B, columns]
  std::vector<int64_t> evicted;  // host-built: [B, columns], row b's first n[b]: its evicted slots, ascending
  at::Tensor src_t, dst_t;       // tensor path: [B, columns] on the device
  at::Tensor evicted_t;          // tensor path: [B, columns], row b's first n[b]: its evicted slots, ascending (the tier's take)
  at::Tensor tail_t;             // tensor path: [B, columns] slots freed (marked dead), pads on the trash slot
  at::Tensor new_len_t;          // tensor path: [B, 1] new lengths

  /// The moves as SlotMoves on `device` (uploads a host-built pass on a device: truncate()).
  SlotMoves to_moves(const at::Device& device) {
    if (columns == 0) return {};
    const auto B = static_cast<int64_t>(n.size());
    if (!src_t.defined()) {
      const auto opts = at::TensorOptions().dtype(at::kLong);
      src_t = at::tensor(src, opts).view({B, columns});
      dst_t = at::tensor(dst, opts).view({B, columns});
      if (!device.is_cpu()) {
        src_t = src_t.to(device);
        dst_t = dst_t.to(device);
      }
    }
    SlotMoves m;
    m.src = src_t;
    m.dst = dst_t;
    m.slot_bound = slot_bound;
    return m;
  }
};

/// An empty pass of `L` in `p` (its vectors keep their room).
inline void reset_pass(const LayerState& L, Pass& p) {
  const auto B = L.len.size();
  p.slot_bound = max_of(L.len);
  p.n.assign(B, 0);
  p.moves.assign(B, 0);
  p.new_len.assign(L.len.begin(), L.len.end());
  p.columns = 0;
  p.src.clear();
  p.dst.clear();
  p.evicted.clear();
  p.src_t = at::Tensor();
  p.dst_t = at::Tensor();
  p.evicted_t = at::Tensor();
  p.tail_t = at::Tensor();
  p.new_len_t = at::Tensor();
}

/// Host moves for row b of a pass whose `n` evicted slots (ascending) are given: each evicted
/// slot below the new length receives the next kept tail slot. The slots are kept in the plan
/// too (pass.evicted).
inline void fill_moves_host(Pass& pass, int64_t b, const int64_t* evicted, int64_t n,
                            std::vector<uint8_t>& tail_flags) {
  if (n <= 0) {  // nothing evicted (and GCC 14 cannot then warn of a negative fill size)
    pass.moves[b] = 0;
    return;
  }
  const int64_t new_len = pass.new_len[b];
  if (pass.columns < n) {  // truncate(): one row's moves
    pass.columns = n;
    const auto B = static_cast<int64_t>(pass.n.size());
    pass.src.assign(static_cast<size_t>(B * n), 0);
    pass.dst.assign(static_cast<size_t>(B * n), 0);
    pass.evicted.assign(static_cast<size_t>(B * n), 0);
  }
  std::copy(evicted, evicted + n, pass.evicted.begin() + b * pass.columns);
  if (static_cast<int64_t>(tail_flags.size()) < n) tail_flags.resize(static_cast<size_t>(n));
  uint8_t* tail = tail_flags.data();
  std::fill(tail, tail + n, uint8_t{0});
  for (int64_t i = 0; i < n; ++i) {
    if (evicted[i] >= new_len) tail[evicted[i] - new_len] = 1;
  }
  int64_t j = 0, k = 0;
  for (int64_t i = 0; i < n && evicted[i] < new_len; ++i, ++k) {
    while (tail[j]) ++j;
    pass.dst[b * pass.columns + k] = evicted[i];
    pass.src[b * pass.columns + k] = new_len + j;
    ++j;
  }
  pass.moves[b] = k;
}

/// Pads every row's columns past its own moves with a repeat of its first move (or slot 0 onto
/// itself), so all rows have `columns` columns.
inline void pad_moves(Pass& pass) {
  const auto B = static_cast<int64_t>(pass.n.size());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t k = pass.moves[b];
    for (int64_t j = k; j < pass.columns; ++j) {
      pass.src[b * pass.columns + j] = k > 0 ? pass.src[b * pass.columns] : 0;
      pass.dst[b * pass.columns + j] = k > 0 ? pass.dst[b * pass.columns] : 0;
    }
  }
}

}  // namespace detail
}  // namespace kvevict
