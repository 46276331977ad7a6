// The tier's ops as PyTorch custom operators (TORCH_LIBRARY namespace `kvevict`): the schema, a
// CPU implementation and, with KVEVICT_KERNELS_CUDA, a CUDA one (cuda.cu), both running the
// bodies of include/kvevict/detail/tier/ops/bodies.hpp. Linked into a program by the
// kvevict::kernels CMake target, or into the Python extension; include/kvevict/detail/tier/ops/
// ops.hpp calls them where they are registered, and their ATen reference forms elsewhere.
// Each implementation checks its arguments, allocates its outputs and scratch, then runs a
// body that cannot fail.

#include <kvevict/detail/tier/ops/bodies.hpp>

#include <ATen/ATen.h>
#include <torch/library.h>

#if KVEVICT_KERNELS_CUDA
#include "launch.hpp"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>

namespace kvevict {
namespace detail {
namespace kernels {
namespace {

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const at::Tensor& like) {
  TORCH_CHECK(t.defined(), "kvevict::pick_pages: ", name, " must be defined");
  TORCH_CHECK(t.scalar_type() == dtype, "kvevict::pick_pages: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "kvevict::pick_pages: ", name, " must have ", dim, " dims, got ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), "kvevict::pick_pages: ", name, " must be on ", like.device(), ", got ",
              t.device());
}

/// pick_pages()'s checks, outputs and scratch, as the body's arguments.
struct PickPages {
  at::Tensor slots, count, scratch;
  PickPagesArgs args{};
  int64_t B = 0;
};
PickPages prepare_pick_pages(const at::Tensor& scores, const at::Tensor& members, const at::Tensor& position,
                             const at::Tensor& seq, const at::Tensor& limit, int64_t K, int64_t page_size) {
  check_tensor(scores, "scores", at::kDouble, 2, scores);
  check_tensor(members, "members", at::kLong, 2, scores);
  check_tensor(position, "position", at::kLong, 2, scores);
  check_tensor(seq, "seq", at::kLong, 2, scores);
  check_tensor(limit, "limit", at::kLong, 1, scores);
  const int64_t B = position.size(0), N = position.size(1) - 1, P = scores.size(1);
  TORCH_CHECK(N >= 0, "kvevict::pick_pages: position must have the trash slot, got ", position.sizes());
  TORCH_CHECK(scores.size(0) == B && members.size(0) == B && seq.size(0) == B && limit.size(0) == B,
              "kvevict::pick_pages: every argument must have ", B, " rows (position's), got scores ", scores.sizes(),
              ", members ", members.sizes(), ", seq ", seq.sizes(), ", limit ", limit.sizes());
  TORCH_CHECK(members.size(1) >= P, "kvevict::pick_pages: members must have at least ", P, " pages (scores'), got ",
              members.sizes());
  TORCH_CHECK(seq.size(1) == N + 1, "kvevict::pick_pages: seq must be ", position.sizes(), " (position's), got ",
              seq.sizes());
  TORCH_CHECK(K >= 0 && K <= (int64_t{1} << 31), "kvevict::pick_pages: K must be in [0, 2^31], got ", K);
  TORCH_CHECK(page_size > 0, "kvevict::pick_pages: page_size must be > 0, got ", page_size);
  PickPages out;
  const auto longs = position.options();
  out.B = B;
  out.slots = at::empty({B, K}, longs);
  out.count = at::empty({B}, longs);
  out.scratch = at::empty({B, 3 * P + N}, longs);
  auto& a = out.args;
  a.scores = scores.data_ptr<double>();
  a.scores_row = scores.stride(0);
  a.scores_col = scores.stride(1);
  a.members = members.data_ptr<int64_t>();
  a.members_row = members.stride(0);
  a.members_col = members.stride(1);
  a.position = position.data_ptr<int64_t>();
  a.position_row = position.stride(0);
  a.position_col = position.stride(1);
  a.seq = seq.data_ptr<int64_t>();
  a.seq_row = seq.stride(0);
  a.seq_col = seq.stride(1);
  a.limit = limit.data_ptr<int64_t>();
  a.limit_row = limit.stride(0);
  a.P = P;
  a.N = N;
  a.K = K;
  a.page_size = page_size;
  a.slots = out.slots.data_ptr<int64_t>();
  a.count = out.count.data_ptr<int64_t>();
  a.scratch = out.scratch.data_ptr<int64_t>();
  return out;
}

std::tuple<at::Tensor, at::Tensor> pick_pages_cpu(const at::Tensor& scores, const at::Tensor& members,
                                                  const at::Tensor& position, const at::Tensor& seq,
                                                  const at::Tensor& limit, int64_t K, int64_t page_size) {
  auto p = prepare_pick_pages(scores, members, position, seq, limit, K, page_size);
  for (int64_t b = 0; b < p.B; ++b) pick_pages_row(p.args, b);
  return {p.slots, p.count};
}

/// On the CPU, that every value of the int64 tensor `t` lies in [lo, hi] (on CUDA the bodies
/// send an index out of range to the trash slot instead: checking would read the device).
void check_values(const at::Tensor& t, const char* op, const char* name, int64_t lo, int64_t hi) {
  if (!t.is_cpu()) return;
  const auto c = t.contiguous();
  const int64_t* v = c.data_ptr<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    TORCH_CHECK(v[i] >= lo && v[i] <= hi, op, ": ", name, " must hold values in [", lo, ", ", hi, "], got ", v[i],
                " at flat index ", i);
  }
}

/// A [B, outer..., slots, inner] tensor as the kernels see it (`op`, `name` for errors).
RowBuffer row_buffer(const at::Tensor& t, const char* op, const char* name, bool key) {
  TORCH_CHECK(t.dim() >= 3 && t.dim() - 3 <= kMaxRowDims, op, ": ", name,
              " must be [B, outer..., slots, inner] with at most ", kMaxRowDims, " outer dims, got ", t.sizes());
  RowBuffer r;
  r.data = static_cast<char*>(t.data_ptr());
  r.element = static_cast<int64_t>(t.element_size());
  if (t.scalar_type() == at::kHalf) {
    r.type = RowType::kHalf;
  } else if (t.scalar_type() == at::kBFloat16) {
    r.type = RowType::kBFloat16;
  } else {
    TORCH_CHECK(!key || t.scalar_type() == at::kFloat, op, ": the key buffer ", name,
                " must be Float, Half or BFloat16, got ", t.scalar_type());
  }
  const int64_t n = t.dim();
  r.outer_dims = static_cast<int>(n - 3);
  for (int64_t d = 1; d + 2 < n; ++d) {
    r.outer_size[d - 1] = t.size(d);
    r.outer_stride[d - 1] = t.stride(d);
    r.outer *= t.size(d);
  }
  r.batch_stride = t.stride(0);
  r.slot_stride = t.stride(n - 2);
  r.inner = t.size(n - 1);
  r.inner_stride = t.stride(n - 1);
  return r;
}

void check_contiguous(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef sizes,
                      const at::Tensor& like) {
  TORCH_CHECK(t.defined() && t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous() &&
                  t.device() == like.device(),
              "kvevict::recall_swap: ", name, " must be a contiguous ", dtype, " tensor of sizes ", sizes, " on ",
              like.device(), ", got ", t.defined() ? t.toString() : std::string("undefined"), " of sizes ",
              t.defined() ? t.sizes() : at::IntArrayRef{}, t.defined() && !t.is_contiguous() ? " (not contiguous)" : "");
}

/// recall_swap()'s checks, scratch and the body's arguments (and the inputs made contiguous,
/// kept alive).
struct RecallSwap {
  at::Tensor picked, count, victims, top, slot_ranks, scratch;
  RecallSwapArgs args{};
  int64_t B = 0;
};
RecallSwap prepare_recall_swap(const at::Tensor& picked, const at::Tensor& count, const at::Tensor& victims,
                               const at::Tensor& top, const at::Tensor& slot_ranks, bool whole_pages,
                               int64_t page_size, at::IntArrayRef key_buffers, const at::Tensor& position,
                               const at::Tensor& state, at::TensorList buffers, at::TensorList views,
                               const at::Tensor& store_position, const at::Tensor& store_rank,
                               const at::Tensor& store_state, const at::Tensor& store_seq, const at::Tensor& seq_next,
                               const at::Tensor& digest, const at::Tensor& members, const at::Tensor& recalled) {
  RecallSwap out;
  TORCH_CHECK(position.dim() == 2 && state.dim() == 3 && store_position.dim() == 2 && picked.dim() == 2,
              "kvevict::recall_swap: position [B, S], state [B, S, W], store_position [B, N + 1] and picked [B, K], got ",
              position.sizes(), ", ", state.sizes(), ", ", store_position.sizes(), ", ", picked.sizes());
  const int64_t B = position.size(0), S = position.size(1), W = state.size(2), N1 = store_position.size(1);
  const int64_t K = picked.size(1), P1 = members.dim() == 2 ? members.size(1) : 0;
  TORCH_CHECK(digest.dim() == 4, "kvevict::recall_swap: digest must be [B, P + 1, groups, 2 width], got ", digest.sizes());
  const int64_t G = digest.size(2), width = digest.size(3) / 2;
  check_contiguous(position, "position", at::kLong, {B, S}, position);
  check_contiguous(state, "state", at::kFloat, {B, S, W}, position);
  check_contiguous(store_position, "store_position", at::kLong, {B, N1}, position);
  check_contiguous(store_rank, "store_rank", at::kFloat, {B, N1}, position);
  check_contiguous(store_state, "store_state", at::kFloat, {B, N1, W}, position);
  check_contiguous(store_seq, "store_seq", at::kLong, {B, N1}, position);
  check_contiguous(seq_next, "seq_next", at::kLong, {1}, position);
  check_contiguous(members, "members", at::kLong, {B, P1}, position);
  check_contiguous(digest, "digest", at::kFloat, {B, P1, G, 2 * width}, position);
  check_contiguous(recalled, "recalled", at::kLong, {1}, position);
  TORCH_CHECK(page_size > 0, "kvevict::recall_swap: page_size must be > 0, got ", page_size);
  TORCH_CHECK(buffers.size() == views.size() && !buffers.empty() && buffers.size() <= kMaxRowBuffers,
              "kvevict::recall_swap: buffers and views must be as many, 1 to ", kMaxRowBuffers, ", got ", buffers.size(),
              " and ", views.size());
  TORCH_CHECK(!key_buffers.empty() && key_buffers.size() <= buffers.size(),
              "kvevict::recall_swap: key_buffers must name 1 to ", buffers.size(), " buffers, got ", key_buffers.size());
  out.B = B;
  out.picked = picked.contiguous();
  out.count = count.contiguous();
  out.victims = victims.contiguous();
  out.top = top.contiguous();
  out.slot_ranks = slot_ranks.contiguous();
  check_contiguous(out.picked, "picked", at::kLong, {B, K}, position);
  check_contiguous(out.count, "count", at::kLong, {B}, position);
  check_contiguous(out.victims, "victims", at::kLong, {B, K}, position);
  check_contiguous(out.top, "top", at::kFloat, {B, W}, position);
  check_contiguous(out.slot_ranks, "slot_ranks", at::kFloat, {B, S}, position);
  for (size_t i = 0; i < key_buffers.size(); ++i) {
    TORCH_CHECK(key_buffers[i] >= 0 && key_buffers[i] < static_cast<int64_t>(buffers.size()),
                "kvevict::recall_swap: key_buffers[", i, "] must name a buffer in [0, ", buffers.size(), "), got ",
                key_buffers[i]);
  }
  TORCH_CHECK(S >= 1 && N1 >= 1, "kvevict::recall_swap: position and store_position must have a trash slot (S >= 1, "
              "N + 1 >= 1), got ", position.sizes(), " and ", store_position.sizes());
  check_values(out.victims, "kvevict::recall_swap", "victims", 0, S - 1);
  check_values(out.picked, "kvevict::recall_swap", "picked", 0, N1 - 1);
  auto& a = out.args;
  int64_t key_width = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& buf = buffers[i];
    const auto& view = views[i];
    const bool key = std::find(key_buffers.begin(), key_buffers.end(), static_cast<int64_t>(i)) != key_buffers.end();
    TORCH_CHECK(buf.device() == position.device() && view.device() == position.device() &&
                    buf.scalar_type() == view.scalar_type() && buf.dim() == view.dim() && buf.size(0) == B &&
                    view.size(0) == B && buf.size(-2) == S && view.size(-2) == N1 && buf.size(-1) == view.size(-1),
                "kvevict::recall_swap: buffer ", i, " must be [B, outer..., S, inner] and its view [B, outer..., N + 1, "
                "inner] of one dtype on ", position.device(), ", got ", buf.sizes(), " ", buf.scalar_type(), " and ",
                view.sizes(), " ", view.scalar_type());
    a.buffers[i] = row_buffer(buf, "kvevict::recall_swap", "buffer", key);
    a.views[i] = row_buffer(view, "kvevict::recall_swap", "view", key);
    TORCH_CHECK(!key || a.buffers[i].outer == G, "kvevict::recall_swap: the key buffer ", i, " must have ", G,
                " key groups (digest's), got ", buf.sizes());
    if (key) key_width += a.buffers[i].inner;
  }
  TORCH_CHECK(key_width == width, "kvevict::recall_swap: the key buffers' channels (", key_width,
              ") must be the digest's width (", width, ")");
  a.n_buffers = static_cast<int>(buffers.size());
  for (size_t i = 0; i < key_buffers.size(); ++i) {
    TORCH_CHECK(key_buffers[i] >= 0 && key_buffers[i] < static_cast<int64_t>(buffers.size()),
                "kvevict::recall_swap: key_buffers[", i, "] must name a buffer, got ", key_buffers[i]);
    a.key_buffers[i] = static_cast<int>(key_buffers[i]);
  }
  a.n_keys = static_cast<int>(key_buffers.size());
  out.scratch = at::empty({B, K}, position.options());
  a.picked = out.picked.data_ptr<int64_t>();
  a.count = out.count.data_ptr<int64_t>();
  a.victims = out.victims.data_ptr<int64_t>();
  a.top = out.top.data_ptr<float>();
  a.slot_ranks = out.slot_ranks.data_ptr<float>();
  a.K = K;
  a.S = S;
  a.N = N1 - 1;
  a.W = W;
  a.P = P1 - 1;
  a.page_size = page_size;
  a.groups = G;
  a.width = width;
  a.whole_pages = whole_pages;
  a.position = position.data_ptr<int64_t>();
  a.state = state.data_ptr<float>();
  a.store_position = store_position.data_ptr<int64_t>();
  a.store_rank = store_rank.data_ptr<float>();
  a.store_state = store_state.data_ptr<float>();
  a.store_seq = store_seq.data_ptr<int64_t>();
  a.seq_next = seq_next.data_ptr<int64_t>();
  a.digest = digest.data_ptr<float>();
  a.members = members.data_ptr<int64_t>();
  a.recalled = recalled.data_ptr<int64_t>();
  a.scratch = out.scratch.data_ptr<int64_t>();
  return out;
}

#define KVEVICT_RECALL_SWAP_PARAMS                                                                                   \
  const at::Tensor &picked, const at::Tensor &count, const at::Tensor &victims, const at::Tensor &top,                \
      const at::Tensor &slot_ranks, bool whole_pages, int64_t page_size, at::IntArrayRef key_buffers,                \
      const at::Tensor &position, const at::Tensor &state, at::TensorList buffers, at::TensorList views,              \
      const at::Tensor &store_position, const at::Tensor &store_rank, const at::Tensor &store_state,                 \
      const at::Tensor &store_seq, const at::Tensor &seq_next, const at::Tensor &digest, const at::Tensor &members,   \
      const at::Tensor &recalled
#define KVEVICT_RECALL_SWAP_ARGS                                                                                     \
  picked, count, victims, top, slot_ranks, whole_pages, page_size, key_buffers, position, state, buffers, views,     \
      store_position, store_rank, store_state, store_seq, seq_next, digest, members, recalled

void recall_swap_cpu(KVEVICT_RECALL_SWAP_PARAMS) {
  auto p = prepare_recall_swap(KVEVICT_RECALL_SWAP_ARGS);
  for (int64_t b = 0; b < p.B; ++b) recall_swap_row(p.args, b);
  int64_t n = 0;
  for (int64_t b = 0; b < p.B; ++b) n += p.args.count[b];
  p.args.seq_next[0] += p.args.K;
  p.args.recalled[0] += n;
}

at::Tensor contiguous_checked(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
                              at::IntArrayRef sizes, const at::Tensor& like) {
  TORCH_CHECK(t.defined() && t.scalar_type() == dtype && t.sizes() == sizes && t.device() == like.device(), op, ": ",
              name, " must be a ", dtype, " tensor of sizes ", sizes, " on ", like.device(), ", got ",
              t.defined() ? t.toString() : std::string("undefined"), " of sizes ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
  return t.contiguous();
}

/// recall_victims()'s checks, outputs and the body's arguments.
struct RecallVictims {
  at::Tensor slot_ranks, position, state, latest, victims, count, top;
  RecallVictimsArgs args{};
  int64_t B = 0;
};
RecallVictims prepare_recall_victims(const at::Tensor& slot_ranks, const at::Tensor& position, const at::Tensor& state,
                                     const at::Tensor& counters, const at::Tensor& latest, int64_t n_sink, int64_t K) {
  constexpr const char* op = "kvevict::recall_victims";
  TORCH_CHECK(position.dim() == 2 && state.dim() == 3, op, ": position [B, S] and state [B, S, W], got ",
              position.sizes(), " and ", state.sizes());
  const int64_t B = position.size(0), S = position.size(1), W = state.size(2);
  TORCH_CHECK(K >= 0 && K <= S, op, ": K must be in [0, ", S, "], got ", K);
  TORCH_CHECK(n_sink >= 0, op, ": n_sink must be >= 0, got ", n_sink);
  TORCH_CHECK(counters.defined() && counters.scalar_type() == at::kLong && counters.dim() == 2 &&
                  counters.size(0) == B && counters.size(1) >= 3 && counters.device() == position.device(),
              op, ": counters must be [B, 3] Long on ", position.device(), ", got ",
              counters.defined() ? counters.toString() : std::string("undefined"), " of sizes ",
              counters.defined() ? counters.sizes() : at::IntArrayRef{});
  TORCH_CHECK(latest.defined() && latest.numel() == B, op, ": latest must hold ", B, " values ([B] or [B, 1]), got ",
              latest.defined() ? latest.sizes() : at::IntArrayRef{});
  RecallVictims out;
  out.B = B;
  out.slot_ranks = contiguous_checked(slot_ranks, op, "slot_ranks", at::kFloat, {B, S}, position);
  out.position = contiguous_checked(position, op, "position", at::kLong, {B, S}, position);
  out.state = contiguous_checked(state, op, "state", at::kFloat, {B, S, W}, position);
  out.latest = contiguous_checked(latest.reshape({-1}), op, "latest", at::kLong, {B}, position);
  out.victims = at::empty({B, K}, position.options());
  out.count = at::empty({B}, position.options());
  out.top = at::empty({B, W}, state.options());
  auto& a = out.args;
  a.slot_ranks = out.slot_ranks.data_ptr<float>();
  a.position = out.position.data_ptr<int64_t>();
  a.state = out.state.data_ptr<float>();
  a.counters = counters.data_ptr<int64_t>();
  a.counters_row = counters.stride(0);
  a.counters_col = counters.stride(1);
  a.latest = out.latest.data_ptr<int64_t>();
  a.S = S;
  a.W = W;
  a.K = K;
  a.n_sink = n_sink;
  a.victims = out.victims.data_ptr<int64_t>();
  a.count = out.count.data_ptr<int64_t>();
  a.top = out.top.data_ptr<float>();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> recall_victims_cpu(const at::Tensor& slot_ranks,
                                                                  const at::Tensor& position, const at::Tensor& state,
                                                                  const at::Tensor& counters, const at::Tensor& latest,
                                                                  int64_t n_sink, int64_t K) {
  auto p = prepare_recall_victims(slot_ranks, position, state, counters, latest, n_sink, K);
  for (int64_t b = 0; b < p.B; ++b) recall_victims_row(p.args, b);
  return {p.victims, p.count, p.top};
}

/// pool_gather()'s checks, outputs and the body's arguments.
struct PoolGather {
  at::Tensor slots, count, by_position, keys, valid;
  PoolGatherArgs args{};
  int64_t B = 0;
};
PoolGather prepare_pool_gather(const at::Tensor& slots, const at::Tensor& count, const at::Tensor& store_position,
                               at::TensorList views, at::IntArrayRef key_buffers, int64_t groups) {
  constexpr const char* op = "kvevict::pool_gather";
  TORCH_CHECK(slots.dim() == 2 && store_position.dim() == 2, op, ": slots [B, R] and store_position [B, N + 1], got ",
              slots.sizes(), " and ", store_position.sizes());
  const int64_t B = store_position.size(0), N1 = store_position.size(1), R = slots.size(1);
  TORCH_CHECK(N1 >= 1, op, ": store_position must have the trash slot ([B, N + 1], N + 1 >= 1), got ",
              store_position.sizes());
  TORCH_CHECK(groups >= 1, op, ": groups must be >= 1, got ", groups);
  TORCH_CHECK(!views.empty() && views.size() <= kMaxRowBuffers && !key_buffers.empty() &&
                  key_buffers.size() <= views.size(),
              op, ": 1 to ", kMaxRowBuffers, " views and 1 to as many key buffers, got ", views.size(), " and ",
              key_buffers.size());
  PoolGather out;
  out.B = B;
  out.slots = contiguous_checked(slots, op, "slots", at::kLong, {B, R}, store_position);
  out.count = contiguous_checked(count, op, "count", at::kLong, {B}, store_position);
  TORCH_CHECK(store_position.is_contiguous() && store_position.scalar_type() == at::kLong, op,
              ": store_position must be a contiguous Long tensor, got ", store_position.toString());
  check_values(out.slots, op, "slots", 0, N1 - 1);
  auto& a = out.args;
  int64_t width = 0;
  for (size_t i = 0; i < key_buffers.size(); ++i) {
    const int64_t k = key_buffers[i];
    TORCH_CHECK(k >= 0 && k < static_cast<int64_t>(views.size()), op, ": key_buffers[", i, "] must name a view, got ", k);
    const auto& v = views[static_cast<size_t>(k)];
    TORCH_CHECK(v.device() == store_position.device() && v.size(0) == B && v.size(-2) == N1, op, ": view ", k,
                " must be [B, outer..., N + 1, inner] on ", store_position.device(), ", got ", v.sizes());
    a.views[k] = row_buffer(v, op, "view", true);
    TORCH_CHECK(a.views[k].outer == groups, op, ": view ", k, " must have ", groups, " key groups, got ", v.sizes());
    a.key_buffers[i] = static_cast<int>(k);
    width += a.views[k].inner;
  }
  a.n_keys = static_cast<int>(key_buffers.size());
  out.by_position = at::empty({B, R}, store_position.options());
  out.keys = at::empty({B, R, groups, width}, store_position.options().dtype(at::kFloat));
  out.valid = at::empty({B, R}, store_position.options().dtype(at::kBool));
  a.slots = out.slots.data_ptr<int64_t>();
  a.count = out.count.data_ptr<int64_t>();
  a.store_position = store_position.data_ptr<int64_t>();
  a.R = R;
  a.N = N1 - 1;
  a.groups = groups;
  a.width = width;
  a.by_position = out.by_position.data_ptr<int64_t>();
  a.keys = out.keys.data_ptr<float>();
  a.valid = out.valid.data_ptr<bool>();
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pool_gather_cpu(const at::Tensor& slots, const at::Tensor& count,
                                                               const at::Tensor& store_position, at::TensorList views,
                                                               at::IntArrayRef key_buffers, int64_t groups) {
  auto p = prepare_pool_gather(slots, count, store_position, views, key_buffers, groups);
  for (int64_t b = 0; b < p.B; ++b) pool_gather_row(p.args, b);
  return {p.by_position, p.keys, p.valid};
}

/// pick_tokens()'s checks, outputs and the body's arguments.
struct PickTokens {
  at::Tensor exact, valid, by_position, limit, slots, count, scratch;
  PickTokensArgs args{};
  int64_t B = 0;
};
PickTokens prepare_pick_tokens(const at::Tensor& exact, const at::Tensor& valid, const at::Tensor& by_position,
                               const at::Tensor& limit, int64_t K, int64_t N) {
  constexpr const char* op = "kvevict::pick_tokens";
  TORCH_CHECK(exact.dim() == 2, op, ": exact must be [B, R], got ", exact.sizes());
  TORCH_CHECK(K >= 0 && K <= (int64_t{1} << 31) && N >= 0, op, ": K must be in [0, 2^31] and N >= 0, got ", K,
              " and ", N);
  const int64_t B = exact.size(0), R = exact.size(1);
  PickTokens out;
  out.B = B;
  out.exact = contiguous_checked(exact, op, "exact", at::kDouble, {B, R}, exact);
  out.valid = contiguous_checked(valid, op, "valid", at::kBool, {B, R}, exact);
  out.by_position = contiguous_checked(by_position, op, "by_position", at::kLong, {B, R}, exact);
  out.limit = contiguous_checked(limit, op, "limit", at::kLong, {B}, exact);
  out.slots = at::empty({B, K}, by_position.options());
  out.count = at::empty({B}, by_position.options());
  out.scratch = at::empty({B, R}, by_position.options());
  auto& a = out.args;
  a.exact = out.exact.data_ptr<double>();
  a.valid = out.valid.data_ptr<bool>();
  a.by_position = out.by_position.data_ptr<int64_t>();
  a.limit = out.limit.data_ptr<int64_t>();
  a.R = R;
  a.K = K;
  a.N = N;
  a.slots = out.slots.data_ptr<int64_t>();
  a.count = out.count.data_ptr<int64_t>();
  a.scratch = out.scratch.data_ptr<int64_t>();
  return out;
}

std::tuple<at::Tensor, at::Tensor> pick_tokens_cpu(const at::Tensor& exact, const at::Tensor& valid,
                                                   const at::Tensor& by_position, const at::Tensor& limit, int64_t K,
                                                   int64_t N) {
  auto p = prepare_pick_tokens(exact, valid, by_position, limit, K, N);
  for (int64_t b = 0; b < p.B; ++b) pick_tokens_row(p.args, b);
  return {p.slots, p.count};
}

#if KVEVICT_KERNELS_CUDA
std::tuple<at::Tensor, at::Tensor> pick_pages_cuda(const at::Tensor& scores, const at::Tensor& members,
                                                   const at::Tensor& position, const at::Tensor& seq,
                                                   const at::Tensor& limit, int64_t K, int64_t page_size) {
  const c10::cuda::CUDAGuard guard(scores.device());
  auto p = prepare_pick_pages(scores, members, position, seq, limit, K, page_size);
  if (p.B > 0) {
    const char* error = launch_pick_pages(p.args, p.B, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == nullptr, "kvevict::pick_pages: the CUDA launch failed: ", error);
  }
  return {p.slots, p.count};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> recall_victims_cuda(const at::Tensor& slot_ranks,
                                                                   const at::Tensor& position, const at::Tensor& state,
                                                                   const at::Tensor& counters, const at::Tensor& latest,
                                                                   int64_t n_sink, int64_t K) {
  const c10::cuda::CUDAGuard guard(position.device());
  auto p = prepare_recall_victims(slot_ranks, position, state, counters, latest, n_sink, K);
  if (p.B > 0) {
    const char* error = launch_recall_victims(p.args, p.B, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == nullptr, "kvevict::recall_victims: the CUDA launch failed: ", error);
  }
  return {p.victims, p.count, p.top};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pool_gather_cuda(const at::Tensor& slots, const at::Tensor& count,
                                                                const at::Tensor& store_position, at::TensorList views,
                                                                at::IntArrayRef key_buffers, int64_t groups) {
  const c10::cuda::CUDAGuard guard(store_position.device());
  auto p = prepare_pool_gather(slots, count, store_position, views, key_buffers, groups);
  if (p.B > 0) {
    const char* error = launch_pool_gather(p.args, p.B, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == nullptr, "kvevict::pool_gather: the CUDA launch failed: ", error);
  }
  return {p.by_position, p.keys, p.valid};
}

std::tuple<at::Tensor, at::Tensor> pick_tokens_cuda(const at::Tensor& exact, const at::Tensor& valid,
                                                    const at::Tensor& by_position, const at::Tensor& limit, int64_t K,
                                                    int64_t N) {
  const c10::cuda::CUDAGuard guard(exact.device());
  auto p = prepare_pick_tokens(exact, valid, by_position, limit, K, N);
  if (p.B > 0) {
    const char* error = launch_pick_tokens(p.args, p.B, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == nullptr, "kvevict::pick_tokens: the CUDA launch failed: ", error);
  }
  return {p.slots, p.count};
}

void recall_swap_cuda(KVEVICT_RECALL_SWAP_PARAMS) {
  const c10::cuda::CUDAGuard guard(position.device());
  auto p = prepare_recall_swap(KVEVICT_RECALL_SWAP_ARGS);
  const char* error = launch_recall_swap(p.args, p.B, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == nullptr, "kvevict::recall_swap: the CUDA launch failed: ", error);
}
#endif

}  // namespace
}  // namespace kernels
}  // namespace detail
}  // namespace kvevict

TORCH_LIBRARY(kvevict, m) {
  m.def("pick_pages(Tensor scores, Tensor members, Tensor position, Tensor seq, Tensor limit, int K, int page_size) "
        "-> (Tensor, Tensor)");
  m.def("recall_swap(Tensor picked, Tensor count, Tensor victims, Tensor top, Tensor slot_ranks, bool whole_pages, "
        "int page_size, int[] key_buffers, Tensor(a!) position, Tensor(b!) state, Tensor(c!)[] buffers, "
        "Tensor(d!)[] views, Tensor(e!) store_position, Tensor(f!) store_rank, Tensor(g!) store_state, "
        "Tensor(h!) store_seq, Tensor(i!) seq_next, Tensor(j!) digest, Tensor(k!) members, Tensor(l!) recalled) -> ()");
  m.def("recall_victims(Tensor slot_ranks, Tensor position, Tensor state, Tensor counters, Tensor latest, int n_sink, "
        "int K) -> (Tensor, Tensor, Tensor)");
  m.def("pool_gather(Tensor slots, Tensor count, Tensor store_position, Tensor[] views, int[] key_buffers, int groups) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("pick_tokens(Tensor exact, Tensor valid, Tensor by_position, Tensor limit, int K, int N) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvevict, CPU, m) {
  m.impl("pick_pages", &kvevict::detail::kernels::pick_pages_cpu);
  m.impl("recall_swap", &kvevict::detail::kernels::recall_swap_cpu);
  m.impl("recall_victims", &kvevict::detail::kernels::recall_victims_cpu);
  m.impl("pool_gather", &kvevict::detail::kernels::pool_gather_cpu);
  m.impl("pick_tokens", &kvevict::detail::kernels::pick_tokens_cpu);
}

#if KVEVICT_KERNELS_CUDA
TORCH_LIBRARY_IMPL(kvevict, CUDA, m) {
  m.impl("pick_pages", &kvevict::detail::kernels::pick_pages_cuda);
  m.impl("recall_swap", &kvevict::detail::kernels::recall_swap_cuda);
  m.impl("recall_victims", &kvevict::detail::kernels::recall_victims_cuda);
  m.impl("pool_gather", &kvevict::detail::kernels::pool_gather_cuda);
  m.impl("pick_tokens", &kvevict::detail::kernels::pick_tokens_cuda);
}
#endif
