#pragma once
// The tier's tensor path (CUDA, and CPU in tests): TierTensorPath, with the steps of its twin
// TierHostPath (tier/host_path.hpp) under the same names in the same order. How tokens reach
// the host tier without a sync (HandOver: a pass's evicted tokens, gathered on the device by
// take(), and a recall's victims, copied to pinned host memory asynchronously, queued by keep()
// and swap(), taken into the tier by settle() at its next use), how recall scores the pages and
// finds its victim candidates on the device (DeviceDigests, score_on_device(),
// victims_on_device()), and how it swaps tokens with slots that live on the device
// (swap_on_device()). The tier itself is tier/tier.hpp; the steps both paths share,
// tier/scoring.hpp.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/policy/tensor_path.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/detail/tensor_undo.hpp>
#include <kvevict/detail/tier/page_digests.hpp>
#include <kvevict/detail/tier/scoring.hpp>
#include <kvevict/selection.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace kvevict {
namespace detail {

/// A copy of `t` in host memory, contiguous: from a device, a pinned host tensor filled by an
/// asynchronous copy on the current stream (complete once an event recorded after it has been
/// reached); on the CPU (the tensor path in tests) a plain copy, made by a to() that names the
/// CPU, so that an op counter sees every copy a CUDA run makes, and the copy is a snapshot as
/// there.
inline at::Tensor to_host_async(const at::Tensor& t) {
  if (t.is_cpu()) return t.to(at::kCPU, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true).contiguous();
  auto h = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  h.copy_(t, /*non_blocking=*/true);
  return h;
}

/// An event on a device's current stream that the host can wait for: after asynchronous copies
/// to pinned host memory, the point from which the host may read them.
struct DeviceWait {
  std::unique_ptr<c10::Event> done;
  bool recorded = false;

  /// Records the event after the work enqueued so far on `device`'s current stream (on the CPU
  /// only the point). Allocates.
  void record(const at::Device& device) {
    recorded = true;
    if (device.is_cpu()) return;
    done = std::make_unique<c10::Event>(device.type());
    done->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  /// Waits until that work is complete: a host wait on CUDA (a query() loop, since LibTorch
  /// 1.13's c10::Event has no synchronize()), nothing on the CPU. Either way it is recorded as
  /// the function "kvevict::host_wait" (at::RecordFunction), which profilers and the tests'
  /// op counter see, on the CPU too.
  void wait() const {
    if (!recorded) return;
    RECORD_FUNCTION("kvevict::host_wait", std::vector<c10::IValue>());
    if (!done) return;
    while (!done->query()) std::this_thread::yield();
  }
};

/// A copy of host tensor `t` on `device`: a pinned copy of it sent by an asynchronous copy on
/// the current stream (no sync; the pinned block is not reused before the copy is done: the
/// caching host allocator records the copy); for the CPU (the tensor path in tests) a plain
/// copy, made by a to() that names the CPU, so that an op counter sees it.
inline at::Tensor to_device_async(const at::Tensor& t, const at::Device& device) {
  if (device.is_cpu()) return t.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  return t.pin_memory().to(device, /*non_blocking=*/true);
}

/// The page digests of one layer's tier on the cache's device (tensor path), so that recall
/// scores them where the queries are, with tensor ops and no host sync (ArkVale, Chen et al.
/// 2024, Sec. 4.2, keeps its digests on the GPU too). A copy: the host's PageDigests (one per
/// row) stay the source, and upload() sends what changed since the last upload, O(changed page
/// slots x width) bytes. Per row b, page slots [0, count[b]) are its pages. The layout of a
/// page's digest and its bound are the digest type's (TierDigest, page_digests.hpp).
class DeviceDigests {
 public:
  /// Device bytes held: the digests (fp32) and the counts. Capacity grows
  /// geometrically, so this is at most twice the digests in use (after the largest tier so far).
  int64_t bytes() const { return digest_.defined() ? digest_.numel() * 4 + count_.numel() * 8 : 0; }
  /// Page slots per row the copy has room for.
  int64_t capacity() const { return digest_.defined() ? digest_.size(1) : 0; }

  /// Brings the copy on `device` up to date with `rows` (one PageDigests per batch row, every
  /// slot in use, groups G and width D): grows it if a row has more slots, then copies the slots
  /// changed since the last upload (take_touched()) and every row's slot count, through pinned
  /// memory without a sync. Returns the most slots any row has (the width score() reads).
  /// Allocates (device and pinned memory). A throw (c10::Error) leaves the copy marked stale:
  /// the next upload sends every slot.
  int64_t upload(std::vector<PageDigests>& rows, int64_t G, int64_t D, const at::Device& device) {
    const auto B = static_cast<int64_t>(rows.size());
    int64_t P = 0;
    for (const auto& r : rows) P = std::max(P, r.slots());
    try {
      const TierDigest digest(G, D);
      if (capacity() < std::max<int64_t>(P, 1)) grow(B, std::max<int64_t>(P, 1), digest, device);
      int64_t n = 0;
      for (const auto& r : rows) n += stale_ ? r.slots() : std::min(r.touched(), r.slots());
      auto count = at::empty({B}, at::TensorOptions().dtype(at::kLong));
      for (int64_t b = 0; b < B; ++b) count.data_ptr<int64_t>()[b] = rows[b].slots();
      if (n > 0) {
        auto index = at::empty({n}, at::TensorOptions().dtype(at::kLong));
        auto values = at::empty(with_page({n}, digest), at::TensorOptions().dtype(at::kFloat));
        int64_t* ix = index.data_ptr<int64_t>();
        float* v = values.data_ptr<float>();
        const int64_t F = digest.floats();
        const auto bytes = static_cast<size_t>(digest.bytes());
        int64_t k = 0;
        for (int64_t b = 0; b < B; ++b) {
          const auto put = [&](int64_t s, const float* block) {
            ix[k] = b * capacity() + s;
            std::memcpy(v + k * F, block, bytes);
            ++k;
          };
          if (stale_) {
            rows[b].take_touched([](int64_t, const float*) {});
            for (int64_t s = 0; s < rows[b].slots(); ++s) put(s, rows[b].block(s));
          } else {
            rows[b].take_touched(put);
          }
        }
        stale_ = true;  // until the copies below are enqueued
        const auto ix_d = to_device_async(index.narrow(0, 0, k), device);
        const auto v_d = to_device_async(values.narrow(0, 0, k), device);
        digest_.view(with_page({-1}, digest)).index_copy_(0, ix_d, v_d);
      }
      count_ = to_device_async(count, device);
      stale_ = false;
    } catch (...) {
      stale_ = true;
      throw;
    }
    return P;
  }

  /// scale * (the digest's bound) of `query` [B, H, Q, D] (fp32, on the device) on every row's
  /// first P page slots, without a sync: [B, G, M, P] fp32. Latent G = 1, M = H Q: every head's
  /// query meets the shared keys; expanded G = H, M = Q: head h's queries meet head h's keys
  /// (with one head, G = H = 1, both readings give the same product).
  at::Tensor bound(const at::Tensor& query, double scale, int64_t P) const {
    const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
    const auto q = digest_.size(2) == 1 ? query.reshape({B, 1, H * Q, D}) : query;  // [B, G, M, D]
    return TierDigest::bound(digest_.narrow(1, 0, P), q, scale);
  }

  /// Page scores from `bound` [B, G, M, P] fp32 (bound(), or a mean of bounds over heads as
  /// [B, 1, Q, P]) without a sync: per query a softmax over the row's pages, summed as
  /// fixed-point terms (fixed_terms, exact in fp64 in any order) over the queries whose `cols`
  /// [B, 1|G, M, 1] bool is set (columns()): [B, P] fp64, 0 past a row's pages and for a row
  /// without real queries.
  at::Tensor scores_of(at::Tensor bound, const at::Tensor& cols, int64_t P) const {
    const int64_t B = bound.size(0);
    const auto empty = at::arange(P, count_.options()).unsqueeze(0).ge(count_.unsqueeze(1)).view({B, 1, 1, P});
    bound.masked_fill_(empty, -std::numeric_limits<float>::infinity());
    const auto probs = at::softmax(bound, -1).masked_fill_(empty, 0);  // a row without pages: all NaN, then 0
    return at::sum(fixed_terms(probs).masked_fill_(cols.logical_not(), 0), at::IntArrayRef{1, 2}, false, at::kDouble);
  }

  /// The queries scores_of() counts for `real` [B, Q] bool (on the device; the columns observe()
  /// counts) and bounds of H heads' queries in G key groups: [B, 1|G, M, 1] bool, M = H Q for G = 1.
  static at::Tensor columns(const at::Tensor& real, int64_t H, int64_t G) {
    const int64_t B = real.size(0), Q = real.size(1);
    return (G == 1 ? real.unsqueeze(1).expand({B, H, Q}).reshape({B, 1, H * Q}) : real.unsqueeze(1)).unsqueeze(3);
  }

  /// Page scores of every row, on the device, without a sync: for the queries `query` [B, H, Q,
  /// D] (fp32, on the device; `real` [B, Q] bool there), per head and query a softmax over the
  /// row's pages of scale * (the digest's bound, bound()), summed over heads and queries
  /// (scores_of()). As PageDigests::score() row by row, up to fp32 rounding of the matmuls and
  /// the softmax (the host's are per row, these batched).
  at::Tensor score(const at::Tensor& query, const at::Tensor& real, double scale, int64_t P) const {
    return scores_of(bound(query, scale, P), columns(real, query.size(1), digest_.size(2)), P);
  }

 private:
  /// [lead..., digest.page_shape()...]: the sizes of `lead` pages' digests.
  static std::vector<int64_t> with_page(std::vector<int64_t> lead, const TierDigest& digest) {
    const auto page = digest.page_shape();
    lead.insert(lead.end(), page.begin(), page.end());
    return lead;
  }

  void grow(int64_t B, int64_t P, const TierDigest& page, const at::Device& device) {
    const int64_t cap = std::max(P, 2 * capacity());
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
    auto digest = at::zeros(with_page({B, cap}, page), opts);
    if (digest_.defined() && !stale_) {
      digest.narrow(1, 0, capacity()).copy_(digest_);
    } else {
      stale_ = true;  // nothing to keep: send every slot
    }
    digest_ = digest;
  }

  at::Tensor digest_;   // [B, capacity, TierDigest::page_shape()] fp32 on the device (Quest: [G, 2 D])
  at::Tensor count_;    // [B] int64 on the device: each row's slots in use
  bool stale_ = true;   // the copy is not current: the next upload sends every slot
};

/// Tokens on their way from the device into the tier, in host copies made without a wait:
/// columns of `position` [B, C] int64, `state` [B, C, W] fp32 and, per buffer, `rows` [B,
/// outer..., C, inner] (host tensors, contiguous). A pass's evicted tokens
/// (TierTensorPath::take(); `into` empty), row b's first n[b] columns in the order the host
/// path takes them (ascending slots), join the tier; a recall's victims
/// (TierTensorPath::swap(); `n` empty), row b's first into[b].size() columns, take the places
/// of the tier tokens `into[b]` that came back. `done`: recorded after the
/// copies (on CUDA, on the stream).
struct HandOver {
  std::vector<int64_t> n;
  std::vector<std::vector<int64_t>> into;
  at::Tensor position, state;
  std::vector<at::Tensor> rows;
  DeviceWait done;

  bool held() const noexcept { return position.defined(); }
  /// Waits until the copies are complete (a host wait on CUDA; nothing on the CPU).
  void wait() const { done.wait(); }
};

/// Slots `idx` [B, n] as a gather/scatter index of a [B, outer..., slots, inner] buffer's token
/// dim: [B, outer..., n, inner] (a view).
inline at::Tensor token_index(const at::Tensor& idx, const at::Tensor& buf) {
  std::vector<int64_t> shape(static_cast<size_t>(buf.dim()), 1), sizes = buf.sizes().vec();
  shape[0] = idx.size(0);
  shape[buf.dim() - 2] = sizes[buf.dim() - 2] = idx.size(1);
  return idx.view(shape).expand(sizes);
}

/// A tensor-path pass's hand-over: the evicted tokens `idx` [B, C] (each row's first n[b]
/// columns; ascending slots, the order the host path takes them) gathered on the device from
/// `buffers` [B, outer..., slots, inner] and L's positions and states, and copied to host
/// memory without a sync (pinned and asynchronous on CUDA; `done` recorded after the copies).
/// Allocates; changes nothing.
inline HandOver hand_over(const at::Tensor& idx, const std::vector<int64_t>& n, const LayerState& L,
                          const std::vector<at::Tensor>& buffers) {
  HandOver h;
  if (!idx.defined()) return h;
  const int64_t B = idx.size(0), C = idx.size(1), W = L.state.size(2);
  h.n = n;
  h.position = to_host_async(L.position.gather(1, idx));
  h.state = to_host_async(L.state.gather(1, idx.unsqueeze(2).expand({B, C, W})));
  for (const auto& buf : buffers) h.rows.push_back(to_host_async(buf.gather(buf.dim() - 2, token_index(idx, buf))));
  h.done.record(L.position.device());
  return h;
}

/// recall's swap step on the tensor path: gathers every row's victims (`victims[b]`, padded with the
/// trash slot to the longest row's count V) from `buffers` [B, outer..., slots, inner], L's
/// positions and states into [.., V, ..] device tensors and starts their copy to the host;
/// fetches the tier tokens `picked[b]` into host tensors of the same shape (tier.fetch(), token
/// k of row b in column k; recalled tokens get the state `top[b]`) and sends them up; then
/// writes them into the victims' slots (in place, under an undo log whose copies are the
/// victims' gathered rows: a throw among the writes puts those back; a padding column writes
/// the trash slot's own rows back). Returns the victims' copies as a HandOver `into` the picked
/// tier tokens' places: the tier takes them at its next use (settle()), when they have long
/// arrived. No host wait: on CUDA the copies go through pinned memory, both ways.
/// \throws c10::Error naming recall and `layer` on an allocation failure (before any write) or
/// a failed write (undone); the cache and the tier are unchanged then.
template <class Tier, class Exchange>
HandOver swap_on_device(Tier& tier, const RecallPlan& plan, const LayerState& L, const std::vector<at::Tensor>& buffers,
                        int64_t layer, Exchange&& exchange) {
  const auto& picked = plan.picked;
  const auto& victims = plan.victims;
  const auto& top = plan.top;
  const auto B = static_cast<int64_t>(picked.size()), W = L.state.size(2);
  int64_t V = 0;
  for (const auto& p : picked) V = std::max(V, static_cast<int64_t>(p.size()));
  const auto device = L.position.device();
  std::vector<at::Tensor> index, out_dev, in, in_dev;  // per buffer: its index; the victims' rows, the tokens' rows
  at::Tensor ix, ix_state, pos_dev, state_dev, in_pos_dev, in_state_dev;
  HandOver out;  // the victims, on their way to the tier
  TensorUndo undo;
  allocating([&] {
    std::vector<int64_t> idx(static_cast<size_t>(B * V), L.slots - 1);  // the trash slot: no token
    for (int64_t b = 0; b < B; ++b) std::copy(victims[b].begin(), victims[b].end(), idx.begin() + b * V);
    ix = to_device_async(at::tensor(idx, at::TensorOptions().dtype(at::kLong)).view({B, V}), device);
    ix_state = ix.unsqueeze(2).expand({B, V, W});
    const auto pad_dev = ix.eq(L.slots - 1);  // padding columns
    for (const auto& buf : buffers) {
      index.push_back(token_index(ix, buf));
      out_dev.push_back(buf.gather(buf.dim() - 2, index.back()));
      out.rows.push_back(to_host_async(out_dev.back()));
    }
    pos_dev = L.position.gather(1, ix);
    state_dev = L.state.gather(1, ix_state);
    out.position = to_host_async(pos_dev);
    out.state = to_host_async(state_dev);
    out.done.record(device);
    out.into = picked;
    // The tokens coming back: the tier's rows, positions and the best state, in host tensors
    // (pinned: the upload needs no other copy); a padding column keeps the trash slot's own.
    const auto host_like = [&](const at::Tensor& t) {
      return at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(!device.is_cpu()));
    };
    for (const auto& o : out_dev) in.push_back(host_like(o));
    auto in_pos = host_like(pos_dev), in_state = host_like(state_dev);
    for (int64_t b = 0; b < B; ++b) {
      tier.fetch(b, picked[b], in, V, in_pos.template data_ptr<int64_t>());
      float* st = in_state.template data_ptr<float>() + b * V * W;
      for (size_t k = 0; k < picked[b].size(); ++k) std::copy(top[b].begin(), top[b].end(), st + k * W);
    }
    for (size_t i = 0; i < in.size(); ++i) {
      const auto& buf = buffers[i];
      std::vector<int64_t> shape(static_cast<size_t>(buf.dim()), 1);
      shape[0] = B;
      shape[buf.dim() - 2] = V;
      in_dev.push_back(at::where(pad_dev.view(shape), out_dev[i], to_device_async(in[i], device)));
    }
    in_pos_dev = at::where(pad_dev, pos_dev, to_device_async(in_pos, device));
    in_state_dev = at::where(pad_dev.unsqueeze(2), state_dev, to_device_async(in_state, device));
    // The undo: the victims' rows, positions and states, gathered above, back into their slots.
    for (size_t i = 0; i < buffers.size(); ++i) {
      const auto buf = buffers[i], where = index[i], was = out_dev[i];
      undo.on_failure([buf, where, was] { buf.scatter_(buf.dim() - 2, where, was); });
    }
    undo.on_failure([&exchange, ix, pos_dev, state_dev] { exchange(ix, pos_dev, state_dev); });
  }, [&](const std::string& why) {
    KVEVICT_CHECK(false, "recall: could not allocate the swap of layer ", layer, " on ", device, ": ", why);
  });
  undo.commit("recall", [&] {
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].scatter_(buffers[i].dim() - 2, index[i], in_dev[i]);
    exchange(ix, in_pos_dev, in_state_dev);  // the policy's positions and states
  });
  return out;
}

/// recall's victim candidates on the device, without a sync, into `out` (RecallScores:
/// candidates, victims, victim_position, top; device tensors, which the caller copies to the
/// host): the candidates' mask from L's positions and each row's first position past them
/// (`window`, a mirror of victim_range()'s, uploaded only when it changes; a free row's is its
/// first, so it has none), and recall_candidates() (selection.hpp: one top-k of the `K` lowest
/// in eviction order and an argmax for the best-ranked candidate, as a pass selects). As
/// victims_on_host(), slot for slot; nothing found for K = 0 (host tensors then). Allocates.
template <class Core>
void victims_on_device(RecallScores& out, const LayerState& L, const Core& core, int64_t layer, int64_t K,
                       DeviceMirror& window) {
  const int64_t B = L.position.size(0), W = L.state.size(2);
  if (K == 0) {  // nothing to replace (a budget of 0): no candidates, no kernel
    const auto longs = at::TensorOptions().dtype(at::kLong);
    out.candidates = at::zeros({B}, longs);
    out.victims = out.victim_position = at::zeros({B, 0}, longs);
    out.top = at::zeros({B, W}, at::TensorOptions().dtype(at::kFloat));
    return;
  }
  std::vector<int64_t> to(static_cast<size_t>(B));
  int64_t max_seen = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto range = victim_range(core, L, layer, b);
    to[b] = core.active[b] ? range.second : range.first;
    max_seen = std::max(max_seen, L.seen[b]);
  }
  const auto& recent_from = window.get(to, L.position.device(), {B, 1});
  auto c = recall_candidates(core.scorer.rank(L.state), L.position, core.layer_eviction[layer].n_sink(), recent_from,
                             K, max_seen);
  out.candidates = c.count;
  out.victims = c.lowest;
  out.victim_position = L.position.gather(1, out.victims);
  out.top = L.state.gather(1, c.best.unsqueeze(2).expand({B, 1, W})).squeeze(1);
}

/// Host facts recall's score step needs on the device, uploaded only when they change: which
/// query columns are real ([B, Q] bool; the same in a steady decode) and each row's first
/// position past its victim candidates ([B, 1]; it moves with every appended token).
struct RecallMirrors {
  DeviceMirror real, window;
};

/// recall's score step on the tensor path: `device` takes what changed in `digests`
/// (one PageDigests per row, G key groups of width D), scores the pages with `query` [B, H, Q, D]
/// (fp32, on core.device) where they are, per head (reducing the scores across processes,
/// reduce_scores) or, `head_mean_scoring`, by the heads' mean logit (TierScoring::kHeadMean:
/// the mean query's bound when `shared_key`, the latent layout; the mean of the heads' bounds
/// otherwise, also when this process holds one head; reduced before the softmax), finds the
/// `K` lowest-ranked victim candidates there (victims_on_device()), the host facts both need
/// coming through `mirrors`, and copies both and, for a two-level `pool`, the queries to the
/// host: one wait, after every copy is enqueued (recall's only host wait for fresh work). An
/// allocation failure in the upload or the scoring throws c10::Error naming `layer`; nothing
/// but the device copy (then sent whole next time) and the mirrors change.
template <class Core>
RecallScores score_on_device(DeviceDigests& device, std::vector<PageDigests>& digests, int64_t G, int64_t D,
                             bool shared_key, bool head_mean_scoring, int64_t layer, const at::Tensor& query,
                             double scale, int64_t K, bool pool, RecallMirrors& mirrors, const LayerState& L,
                             const Core& core) {
  const int64_t B = query.size(0), Q = query.size(2);
  const auto fail = [&](const std::string& why) {
    KVEVICT_CHECK(false, "recall: could not score the pages of layer ", layer, " on ", core.device,
                  " (the digests' copy holds ", device.bytes(), " bytes): ", why);
  };
  at::Tensor real;
  int64_t P = 1;
  allocating([&] {
    P = std::max<int64_t>(device.upload(digests, G, D, core.device), 1);
    const auto columns = real_columns(core, L, B, Q);  // a mirror: the same in a steady decode
    const std::vector<int64_t> flags(columns.template data_ptr<bool>(), columns.template data_ptr<bool>() + B * Q);
    real = mirrors.real.get(flags, core.device, {B, Q}, at::kBool);
  }, fail);
  const auto on_device = score_pages(
      head_mean_scoring, layer, core, fail, [&] { return device.score(query, real, scale, P); },
      [&] { return shared_key ? query : device.bound(query, scale, P); },  // the mean query, or the mean bound
      [&](const at::Tensor& mean) {
        return shared_key ? device.score(mean, real, scale, P) : device.scores_of(mean, DeviceDigests::columns(real, 1, 1), P);
      });
  RecallScores out;
  allocating([&] {
    victims_on_device(out, L, core, layer, K, mirrors.window);
    out.sums = to_host_async(on_device);
    if (pool) out.query = to_host_async(query);
    for (auto* t : {&out.candidates, &out.victims, &out.victim_position, &out.top}) *t = to_host_async(*t);
  }, fail);
  DeviceWait copied;
  copied.record(core.device);
  copied.wait();
  return out;
}

/// The tier's tensor path: the tokens on their way into the tier (HandOver: a pass's evicted
/// tokens, a recall's victims), taken in at the tier's next use, and the digests' copy on the
/// device (DeviceDigests) are its own state. The host waits for the device once per recall
/// (its scores); the copies on their way are waited for a step after they were started.
class TierTensorPath {
 public:
  /// A pass's evicted tokens (the first pass.n[b] columns of its `evicted_t`), before the moves
  /// overwrite their rows: what is on its way, but for the newest, is settled first, then these
  /// are gathered on the device and copied to host memory without a sync (hand_over()), pending
  /// until keep(). Allocates; a throw leaves the tier as it was (settled as far as it got).
  template <class Tier, class Pass, class Rank>
  void take(Tier& tier, const Pass& pass, const LayerState& L, const std::vector<at::Tensor>& buffers, Rank&& rank) {
    settle(tier, rank, 1);
    allocating([&] { held_.reserve(held_.size() + 1); },
               [&](const std::string& why) { KVEVICT_CHECK(false, "evict: could not allocate room in the host tier: ", why); });
    pending_ = hand_over(pass.evicted_t, pass.n, L, buffers);
  }
  /// After the pass's commit: the pending hand-over joins those on their way (room was made by
  /// take()). Does not throw.
  void keep() noexcept {
    if (pending_.held()) held_.push_back(std::move(pending_));
    pending_ = HandOver{};
  }
  /// Takes what is on its way into the tier, oldest first, until at most `leave` remain
  /// (LayerTier::take_copies() for a pass's tokens, LayerTier::store() for a recall's victims;
  /// each waits for its copies first: a host wait on CUDA). A throw (an allocation failure,
  /// c10::Error naming the tier) keeps that one and the newer ones on their way.
  template <class Tier, class Rank>
  void settle(Tier& tier, Rank&& rank, size_t leave = 0) {
    while (held_.size() > leave) {
      const auto& h = held_.front();
      h.wait();
      if (h.into.empty()) {
        tier.take_copies(h.n, h.position, h.state, h.rows, rank);
      } else {
        const int64_t V = h.position.size(1);
        for (size_t b = 0; b < h.into.size(); ++b) {
          if (!h.into[b].empty())
            tier.store(static_cast<int64_t>(b), h.into[b], h.rows, V, h.position.template data_ptr<int64_t>(),
                       h.state.template data_ptr<float>(), rank);
        }
      }
      held_.erase(held_.begin());
    }
  }

  /// recall's score step: score_on_device(); the plan reads host copies of the `K` lowest
  /// victim candidates (and of the queries, for a two-level `pool`), made with the scores'
  /// copy (one wait).
  template <class Core>
  RecallScores score(std::vector<PageDigests>& digests, const TierKeys& keys, int64_t groups, int64_t width,
                     int64_t layer, const at::Tensor& query, double scale, int64_t K, bool pool, const LayerState& L,
                     const Core& core) {
    return score_on_device(device_, digests, groups, width, keys.shared, keys.head_mean, layer, query, scale, K, pool,
                           mirrors_, L, core);
  }

  /// recall's swap step: swap_on_device() (all or nothing); the victims' copies then join what
  /// is on its way to the tier (after the plan's reserve_recall(): store() allocates nothing).
  template <class Tier, class Rank, class Exchange>
  void swap(Tier& tier, const RecallPlan& plan, const LayerState& L, const std::vector<at::Tensor>& buffers,
            int64_t layer, Rank&& /*rank*/, Exchange&& exchange) {
    allocating([&] { held_.reserve(held_.size() + 1); }, [&](const std::string& why) {
      KVEVICT_CHECK(false, "recall: could not allocate the swap of layer ", layer, ": ", why);
    });
    held_.push_back(swap_on_device(tier, plan, L, buffers, layer, exchange));
  }

  /// Device bytes the digests' copy holds (after a recall; else 0).
  int64_t device_bytes() const { return device_.bytes(); }
  /// Frees the digests' copy (reset(): the next recall sends every page again).
  void release_device() {
    device_ = DeviceDigests{};
    mirrors_ = RecallMirrors{};
  }

 private:
  DeviceDigests device_;
  RecallMirrors mirrors_;
  HandOver pending_;            // take() -> keep()
  std::vector<HandOver> held_;  // on the way into the tier, oldest first: keep()/swap() -> settle()
};

}  // namespace detail
}  // namespace kvevict
