#pragma once
// A cache layer's per-token buffers, as a layout describes them: the specs (BufferSpec), the
// check of a chunk's new rows against them, new buffers of a given slot count, their bytes per
// slot, the views over their live slots (LiveViews, handed out again while the buffers and the
// width stay), and a layer's slot moves applied to every buffer under an undo log
// (LayerMoves). The cache (cache_base.hpp) owns the buffers; this file only knows their shape.

#include <kvevict/check.hpp>
#include <kvevict/detail/tensor_undo.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kvevict {
namespace detail {

/// One per-token buffer of a layout: shape [B, outer..., slots, inner].
struct BufferSpec {
  std::string name;                    // argument name, e.g. "k_new"
  std::vector<int64_t> outer;          // dims between batch and token, e.g. {H}; {} for latent
  int64_t inner;                       // row width, e.g. 192
  std::vector<std::string> dim_names;  // for messages, e.g. {"B", "H", "T", "qk_dim"}
  bool key = false;                    // part of the keys the tier's page digests bound

  /// The token (slot) dim of the buffer.
  int64_t token_dim() const { return static_cast<int64_t>(outer.size()) + 1; }
  /// One token's shape in the buffer, {outer..., inner}: its sizes without batch and token dims.
  std::vector<int64_t> token_shape() const {
    auto shape = outer;
    shape.push_back(inner);
    return shape;
  }
  /// Elements of one slot of one row.
  int64_t row_elements() const {
    int64_t n = inner;
    for (const auto o : outer) n *= o;
    return n;
  }
};

/// Bytes of one slot of one row, every buffer of `specs`.
inline int64_t bytes_per_slot(const std::vector<BufferSpec>& specs, at::ScalarType dtype) {
  int64_t bytes = 0;
  for (const auto& spec : specs) bytes += spec.row_elements() * static_cast<int64_t>(c10::elementSize(dtype));
  return bytes;
}

/// New zeroed buffers [B, outer..., slots, inner], one per spec, made outside InferenceMode (so
/// they stay usable whatever mode later calls run in). Allocates on `opts`' device.
inline std::vector<at::Tensor> allocate_buffers(const std::vector<BufferSpec>& specs, int64_t B, int64_t slots,
                                                const at::TensorOptions& opts) {
  c10::InferenceMode normal_tensors(false);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (const auto& spec : specs) {
    std::vector<int64_t> shape{B};
    shape.insert(shape.end(), spec.outer.begin(), spec.outer.end());
    shape.push_back(slots);
    shape.push_back(spec.inner);
    out.push_back(at::zeros(shape, opts));
  }
  return out;
}

/// What check_rows() checks, without building its messages: true when it would pass.
inline bool rows_ok(const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& rows, int64_t B,
                    at::ScalarType dtype, at::Device device) {
  int64_t T = -1;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& t = rows[i];
    const auto& outer = specs[i].outer;
    const int64_t tdim = specs[i].token_dim();
    if (!t.defined() || t.layout() != at::kStrided || t.dim() != tdim + 2 || t.scalar_type() != dtype ||
        t.device() != device) {
      return false;
    }
    if (t.size(0) != B || t.size(tdim + 1) != specs[i].inner) return false;
    for (size_t o = 0; o < outer.size(); ++o) {
      if (t.size(static_cast<int64_t>(o) + 1) != outer[o]) return false;
    }
    if (T < 0) T = t.size(tdim);
    if (T < 1 || t.size(tdim) != T) return false;
  }
  return true;
}

/// Checks a chunk's new rows, one per spec, against the specs, batch B, dtype and device
/// (defined, dense, shape, the same T >= 1 in every one); returns T.
/// \throws c10::Error (TypeError for the dtype) naming the spec's argument.
inline int64_t check_rows(const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& rows, int64_t B,
                          at::ScalarType dtype, at::Device device) {
  if (rows_ok(specs, rows, B, dtype, device)) return rows[0].size(specs[0].token_dim());  // no message built
  int64_t T = -1;
  for (size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    check_tensor(rows[i], spec.name.c_str(), device);
    std::vector<int64_t> dims{B};
    dims.insert(dims.end(), spec.outer.begin(), spec.outer.end());
    dims.push_back(T);
    dims.push_back(spec.inner);
    std::string doc = "[";
    for (size_t d = 0; d < spec.dim_names.size(); ++d) doc += (d ? ", " : "") + spec.dim_names[d];
    doc += "]";
    check_shape(rows[i], spec.name.c_str(), dims, spec.dim_names, doc.c_str());
    const int64_t t = rows[i].size(spec.token_dim());
    KVEVICT_CHECK(t >= 1, spec.name, " must hold at least one token, got T = 0");
    if (T < 0) T = t;
    KVEVICT_CHECK_TYPE(rows[i].scalar_type() == dtype, spec.name, " must have the cache's dtype ", dtype,
                       ", got ", rows[i].scalar_type());
  }
  return T;
}

/// Views over slots [0, width) of one layer's buffers, valid while width and buffers stay.
struct LiveViews {
  int64_t width = -1;
  const c10::TensorImpl* base = nullptr;  // the first buffer when the views were made
  std::vector<at::Tensor> views;

  /// Whether these are the views over slots [0, width) of `bufs` (a caller may have resized a
  /// view in place: strides, offset and sizes are compared too).
  bool match(const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& bufs, int64_t w) const {
    bool valid = width == w && !bufs.empty() && base == bufs[0].unsafeGetTensorImpl();
    for (size_t i = 0; valid && i < specs.size(); ++i) {
      const auto& v = views[i];
      valid = v.strides() == bufs[i].strides() && v.storage_offset() == bufs[i].storage_offset() &&
              v.dim() == bufs[i].dim() && v.size(specs[i].token_dim()) == w;
    }
    return valid;
  }

  /// New views over slots [0, w) of `bufs` (real views: they share the buffers' version counters).
  static LiveViews over(const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& bufs, int64_t w) {
    LiveViews fresh;
    fresh.views.reserve(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) fresh.views.push_back(bufs[i].narrow(specs[i].token_dim(), 0, w));
    fresh.width = w;
    fresh.base = bufs[0].unsafeGetTensorImpl();
    return fresh;
  }
};

/// One layer's slot moves applied to every buffer of it with tensor ops (the tensor path; a
/// host-path cache moves with apply_moves_host()), in the halves a commit needs: gather()
/// first (allocates: each buffer's source rows), then, under the commit's undo log, save() the
/// destinations (allocates) and scatter() (in-place writes). Empty moves do nothing.
struct LayerMoves {
  SlotMoves moves;
  at::Tensor rows;                  // [B, 1] int64 0 .. B - 1 (move_rows())
  std::vector<at::Tensor> gathered;  // per buffer: the rows each move reads

  /// `rows`: a cached move_rows() of the same batch, or undefined (then made here).
  void gather(SlotMoves m, const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& bufs, at::Tensor rows_index) {
    moves = std::move(m);
    if (moves.empty()) return;
    rows = rows_index.defined() ? std::move(rows_index) : move_rows(moves);
    for (size_t i = 0; i < specs.size(); ++i) gathered.push_back(gather_moves(moves, bufs[i], specs[i].token_dim(), rows));
  }
  void save(TensorUndo& undo, const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& bufs) const {
    for (size_t i = 0; i < gathered.size(); ++i) undo.save_slots(bufs[i], specs[i].token_dim(), moves.dst, rows);
  }
  void scatter(const std::vector<BufferSpec>& specs, const std::vector<at::Tensor>& bufs) const {
    for (size_t i = 0; i < gathered.size(); ++i) scatter_moves(moves, bufs[i], specs[i].token_dim(), gathered[i], rows);
  }
};

}  // namespace detail
}  // namespace kvevict
