#pragma once
// Moving token rows in buffers the caller owns: the slot moves of an eviction pass (or a
// rollback) and the slot mapping of an append, applied to any buffer given its token dimension:
// [B, H, S, D] (token_dim 2), [B, S, H, D] (token_dim 1, flash_attn_with_kvcache), latent
// [B, S, W] or a fused latent row [B, S, 576] (token_dim 1).

#include <kvevict/check.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvevict {

/// The row moves of one pass on one layer, the same for every buffer of that layer: for each
/// batch row b and column j, slot `dst[b, j]` receives slot `src[b, j]`. All reads happen
/// before any write. Columns beyond a row's own moves, so that every row has the same number
/// of columns (static shapes on CUDA), write only slots that hold no token afterwards: on the
/// host path they repeat one of the row's moves (or copy slot 0 onto itself); on the tensor path
/// they copy the trash slot (the last) into a slot the pass freed, or onto itself.
struct SlotMoves {
  at::Tensor src;  // [B, n] int64 source slots, on the policy's device
  at::Tensor dst;  // [B, n] int64 destination slots, distinct per row but for repeats
  /// Every slot named is below this (the policy sets it from its host state, so checking a
  /// buffer against it needs no device read); 0: unknown, apply_moves() then reads the largest.
  int64_t slot_bound = 0;
  /// Columns per row (n); 0 when nothing moves.
  int64_t size() const { return src.defined() ? src.size(1) : 0; }
  bool empty() const { return size() == 0; }
};

namespace detail {

/// Checks `buffer` against `moves` and `token_dim` and returns the number of slots it holds.
inline int64_t check_moves_buffer(const SlotMoves& moves, const at::Tensor& buffer, int64_t token_dim,
                                  int64_t batch, const char* what) {
  KVEVICT_CHECK(buffer.defined(), what, " must be a defined tensor");
  KVEVICT_CHECK_INDEX(token_dim >= 1 && token_dim < buffer.dim(), what, ": token_dim must be in [1, ", buffer.dim(),
                      ") for a ", buffer.dim(), "-D buffer, got ", token_dim);
  KVEVICT_CHECK(buffer.size(0) == batch, what, ": dim 0 must be the batch (", batch, "), got ", buffer.sizes());
  if (moves.size() > 0) {
    KVEVICT_CHECK(buffer.device() == moves.src.device(), what, " must be on the moves' device ", moves.src.device(),
                  ", got ", buffer.device());
  }
  return buffer.size(token_dim);
}

/// Where the rows of a contiguous buffer [B, outer..., slots, inner...] (token dim `token_dim`)
/// lie: per batch row, `groups_per_row` groups (one per outer index), each `slots` rows of
/// `row` elements (`row_bytes` bytes). The one description of row storage that the host
/// moves, the caches' appends and the host tier's copies address rows with.
struct RowLayout {
  int64_t groups_per_row;  // product of dims (0, token_dim) excluding the batch
  int64_t slots;           // size of token_dim
  int64_t row;             // elements per token row: product of dims after token_dim
  int64_t row_bytes;       // row x the element size
  RowLayout(const at::Tensor& t, int64_t token_dim) : groups_per_row(1), slots(t.size(token_dim)), row(1) {
    for (int64_t d = 1; d < token_dim; ++d) groups_per_row *= t.size(d);
    for (int64_t d = token_dim + 1; d < t.dim(); ++d) row *= t.size(d);
    row_bytes = row * static_cast<int64_t>(t.element_size());
  }
  /// Byte offset of slot `slot` of group `g` of batch row `b`.
  int64_t offset(int64_t b, int64_t g, int64_t slot) const { return ((b * groups_per_row + g) * slots + slot) * row_bytes; }
};

/// Host moves on a contiguous CPU buffer: per batch row, per group, memcpy each moved row.
inline void apply_moves_host(const int64_t* src, const int64_t* dst, int64_t batch, int64_t n, int64_t stride,
                             const at::Tensor& buffer, int64_t token_dim) {
  const RowLayout L(buffer, token_dim);
  auto* base = static_cast<char*>(buffer.data_ptr());
  if (n > 0) buffer.unsafeGetTensorImpl()->bump_version();  // autograd sees the in-place write
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = src[b * stride + j], d = dst[b * stride + j];
      if (s == d) continue;
      for (int64_t g = 0; g < L.groups_per_row; ++g) std::memcpy(base + L.offset(b, g, d), base + L.offset(b, g, s), L.row_bytes);
    }
  }
}

/// [B, 1] int64 row indices for the tensor-op moves (made before any write, so that nothing
/// allocates between the first and the last write of a pass).
inline at::Tensor move_rows(const SlotMoves& moves) {
  return at::arange(moves.src.size(0), moves.src.options()).unsqueeze(1);
}

/// Tensor-op moves, first half: the source rows of every move, [B, n, rest...] (allocates).
inline at::Tensor gather_moves(const SlotMoves& moves, const at::Tensor& buffer, int64_t token_dim,
                               const at::Tensor& rows) {
  return buffer.transpose(1, token_dim).index({rows, moves.src});
}

/// Tensor-op moves, second half: writes what gather_moves() read into the destinations.
inline void scatter_moves(const SlotMoves& moves, const at::Tensor& buffer, int64_t token_dim,
                          const at::Tensor& gathered, const at::Tensor& rows) {
  auto v = buffer.transpose(1, token_dim);
  v.index_put_({rows, moves.dst}, gathered);
}

/// Writes rows [B, ..., T, ...] into `buffer` [B, ..., slots, ...] at the slots `map` [B, T]
/// along `token_dim` (map on the buffer's device, every entry a valid slot): one scatter_, no
/// host sync. Entries that repeat a slot (pads on the trash slot) leave it holding one of them.
inline void scatter_rows(const at::Tensor& buffer, int64_t token_dim, const at::Tensor& rows, const at::Tensor& map) {
  auto index = map;  // [B, T] -> [B, 1.., T, 1..], then broadcast over the other dims (a view)
  for (int64_t d = 1; d < token_dim; ++d) index = index.unsqueeze(1);
  for (int64_t d = token_dim + 1; d < rows.dim(); ++d) index = index.unsqueeze(-1);
  buffer.scatter_(token_dim, index.expand(rows.sizes()), rows);
}

/// Host write_rows on a contiguous CPU buffer: memcpy of each real token's rows, per
/// [b, outer...] group; `map` [B, T] checked, -1 pads skipped.
inline void write_rows_host(const at::Tensor& buffer, int64_t token_dim, const at::Tensor& rows, const int64_t* map) {
  const RowLayout L(buffer, token_dim);
  const auto src = rows.contiguous();
  const RowLayout S(src, token_dim);
  const int64_t B = rows.size(0), T = rows.size(token_dim);
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(buffer.data_ptr());
  buffer.unsafeGetTensorImpl()->bump_version();  // autograd sees the in-place write
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < L.groups_per_row; ++g) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = map[b * T + t];
        if (slot >= 0) std::memcpy(d + L.offset(b, g, slot), s + S.offset(b, g, t), L.row_bytes);
      }
    }
  }
}

/// Host append on a contiguous CPU buffer: row b's last counts[b] of the T = src.size(token_dim)
/// columns of `src` go to slots [first(b), + counts[b]) of every [b, outer...] group. `src` has
/// the buffer's dims but T tokens, and stride 1 in its last dim; it is read in place (a narrowed
/// or transposed input costs no temporary copy). Allocates nothing.
template <class FirstSlot>
void append_rows_host(const at::Tensor& buffer, int64_t token_dim, const at::Tensor& src, const int64_t* counts,
                      FirstSlot&& first) {
  const RowLayout L(buffer, token_dim);
  const auto sizes = src.sizes();
  const auto strides = src.strides();
  const int64_t T = src.size(token_dim), elem = src.element_size(), row_bytes = L.row_bytes;
  const auto* s = static_cast<const char*>(src.data_ptr());
  buffer.unsafeGetTensorImpl()->bump_version();  // autograd sees the in-place write
  auto* d = static_cast<char*>(buffer.data_ptr());
  for (int64_t b = 0; b < src.size(0); ++b) {
    const int64_t n = counts[b];
    if (n == 0) continue;
    const int64_t slot = first(b);
    for (int64_t g = 0; g < L.groups_per_row; ++g) {
      int64_t offset = b * strides[0], rest = g;  // element offset of (b, g) in src
      for (int64_t dim = token_dim - 1; dim >= 1; --dim) {
        offset += rest % sizes[dim] * strides[dim];
        rest /= sizes[dim];
      }
      offset += (T - n) * strides[token_dim];
      char* dst = d + L.offset(b, g, slot);
      if (n == 1 || strides[token_dim] == L.row) {
        std::memcpy(dst, s + offset * elem, n * row_bytes);
      } else {
        for (int64_t t = 0; t < n; ++t) std::memcpy(dst + t * row_bytes, s + (offset + t * strides[token_dim]) * elem, row_bytes);
      }
    }
  }
}

}  // namespace detail

/// Applies `moves` to one buffer the caller owns, in place. Bit-exact row copies.
///
/// \param moves      from EvictionPolicy::evict() or truncate(), for this buffer's layer.
/// \param buffer     [B, ..., slots, ...] any dtype, on the moves' device, token dim `token_dim`,
///                   with at least EvictionPolicy::slots(layer) slots. E.g. keys [B, H, S, 192]
///                   (token_dim 2), [B, S, H, D] (token_dim 1), a fused latent [B, S, 576] (1).
/// \param token_dim  the dimension that indexes slots, in [1, buffer.dim()).
/// \throws c10::Error if the buffer's batch, device or token_dim do not fit; nothing is moved.
/// \note A contiguous CPU buffer moves with memcpy, without allocating; anything else uses
///       tensor ops (gather, then index_put_), with no host sync for moves from the policy
///       (slot_bound set).
inline void apply_moves(const SlotMoves& moves, const at::Tensor& buffer, int64_t token_dim) {
  const int64_t batch = moves.size() > 0 ? moves.src.size(0) : buffer.defined() ? buffer.size(0) : 0;
  detail::check_moves_buffer(moves, buffer, token_dim, batch, "buffer");
  if (moves.empty()) return;
  // The bound the policy gives costs nothing; without it, read the largest slot (on a GPU, a sync).
  const int64_t hi = moves.slot_bound > 0 ? moves.slot_bound - 1
                                          : at::max(moves.src.max(), moves.dst.max()).item<int64_t>();
  KVEVICT_CHECK(hi < buffer.size(token_dim), "buffer: slot ", hi, " is moved but the buffer holds only ",
                buffer.size(token_dim), " slots along token_dim ", token_dim);
  at::NoGradGuard no_grad;
  if (buffer.is_cpu() && buffer.is_contiguous()) {
    const auto src = moves.src.contiguous(), dst = moves.dst.contiguous();
    detail::apply_moves_host(src.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), batch, moves.size(), moves.size(),
                             buffer, token_dim);
    return;
  }
  const auto rows = detail::move_rows(moves);
  detail::scatter_moves(moves, buffer, token_dim, detail::gather_moves(moves, buffer, token_dim, rows), rows);
}

/// Writes the new tokens of an append into one buffer the caller owns, where the slot mapping
/// of EvictionPolicy::append() says (as vLLM's reshape_and_cache does with its slot_mapping).
///
/// \param buffer        [B, ..., slots, ...] destination, token dim `token_dim`, at least
///                      EvictionPolicy::slots(layer) slots.
/// \param token_dim     the dimension of `buffer` (and of `rows`) that indexes tokens.
/// \param rows          [B, ..., T, ...] new rows, the buffer's shape with T tokens, same dtype
///                      and device.
/// \param slot_mapping  [B, T] int64 from EvictionPolicy::append(): the slot of each new token,
///                      -1 for a pad (not stored). On the buffer's device (a CPU mapping works
///                      too; for a device buffer it is then uploaded).
/// \throws c10::Error on a shape, dtype or device mismatch, or (a CPU mapping) a slot outside
///         [-1, slots - 1); nothing is written then. A device mapping's values are not read on
///         the host: slots outside the buffer are a device-side error there.
/// \note A contiguous CPU buffer is written with memcpy, without allocating. Otherwise one
///       scatter_ per call, no host sync: pads are written to the buffer's last slot, the trash
///       slot, which never holds a token (its contents are undefined).
inline void write_rows(const at::Tensor& buffer, int64_t token_dim, const at::Tensor& rows,
                       const at::Tensor& slot_mapping) {
  KVEVICT_CHECK(buffer.defined() && rows.defined() && slot_mapping.defined(),
                "write_rows: buffer, rows and slot_mapping must be defined tensors");
  KVEVICT_CHECK_INDEX(token_dim >= 1 && token_dim < buffer.dim(), "write_rows: token_dim must be in [1, ",
                      buffer.dim(), "), got ", token_dim);
  KVEVICT_CHECK(rows.dim() == buffer.dim(), "write_rows: rows must have the buffer's ", buffer.dim(),
                " dims, got ", rows.sizes());
  for (int64_t d = 0; d < buffer.dim(); ++d) {
    KVEVICT_CHECK(d == token_dim || rows.size(d) == buffer.size(d), "write_rows: rows must match the buffer ",
                  buffer.sizes(), " in every dim but token_dim ", token_dim, ", got ", rows.sizes());
  }
  KVEVICT_CHECK(slot_mapping.dim() == 2 && slot_mapping.size(0) == rows.size(0) &&
                    slot_mapping.size(1) == rows.size(token_dim),
                "write_rows: slot_mapping must be [B, T] = [", rows.size(0), ", ", rows.size(token_dim), "], got ",
                slot_mapping.sizes());
  KVEVICT_CHECK_TYPE(slot_mapping.scalar_type() == at::kLong, "write_rows: slot_mapping must be int64, got ",
                     slot_mapping.scalar_type());
  KVEVICT_CHECK_TYPE(rows.scalar_type() == buffer.scalar_type(), "write_rows: rows must have the buffer's dtype ",
                     buffer.scalar_type(), ", got ", rows.scalar_type());
  KVEVICT_CHECK(rows.device() == buffer.device(), "write_rows: rows must be on the buffer's device ",
                buffer.device(), ", got ", rows.device());
  KVEVICT_CHECK(slot_mapping.is_cpu() || slot_mapping.device() == buffer.device(),
                "write_rows: slot_mapping must be on the buffer's device ", buffer.device(), " or the CPU, got ",
                slot_mapping.device());
  const int64_t B = rows.size(0), T = rows.size(token_dim), trash = buffer.size(token_dim) - 1;
  at::NoGradGuard no_grad;
  if (slot_mapping.is_cpu()) {
    const auto map = slot_mapping.contiguous();
    const int64_t* m = map.data_ptr<int64_t>();
    for (int64_t i = 0; i < B * T; ++i) {
      KVEVICT_CHECK(m[i] >= -1 && m[i] < trash, "write_rows: slot_mapping[", i / T, ", ", i % T, "] = ", m[i],
                    " must be -1 (a pad) or a slot in [0, ", trash, ") (the buffer's last slot is the trash slot)");
    }
    if (buffer.is_cpu() && buffer.is_contiguous()) {
      detail::write_rows_host(buffer, token_dim, rows, m);
      return;
    }
  }
  const auto map = slot_mapping.device() == buffer.device() ? slot_mapping : slot_mapping.to(buffer.device());
  detail::scatter_rows(buffer, token_dim, rows, map.masked_fill(map.lt(0), trash));
}

}  // namespace kvevict
