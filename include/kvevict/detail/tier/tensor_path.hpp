#pragma once
// The tier's tensor path (CUDA, and CPU in tests): TierTensorPath, with the steps of its twin
// TierHostPath (tier/host_path.hpp), recall's stages with the same types (score, victims,
// pick, swap: tier/recall_stages.hpp); recall's selection and swap are compiled ops where
// they are registered (tier/ops/ops.hpp), their ATen reference forms elsewhere. Its tier is a
// TierStore (tier/store.hpp): every row's tokens in fixed-shape tensors, their rows in pinned
// host memory that device kernels reach through a view. A pass's evicted tokens join the tier
// inside the pass's commit, and recall scores the pages, finds its victims, picks the tokens
// (whole pages, or a two-level pool scored again) and swaps them, all as tensor ops on the
// cache's device: no host sync, no host read, and no copy between host and device once the
// host facts the kernels read (which query columns are real, each row's latest append) have
// reached the device, which they do only when they change (DeviceMirror). A step with a tier
// and recall can then be replayed as a CUDA graph. The tier itself is tier/tier.hpp; the
// scoring both paths share, tier/scoring.hpp.

#include <kvevict/check.hpp>
#include <kvevict/detail/device_mirror.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/detail/tensor_undo.hpp>
#include <kvevict/detail/tier/ops/ops.hpp>
#include <kvevict/detail/tier/recall_stages.hpp>
#include <kvevict/detail/tier/scoring.hpp>
#include <kvevict/detail/tier/store.hpp>
#include <kvevict/selection.hpp>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// Host facts recall needs on the device, uploaded only when they change: which query columns
/// are real ([B, Q] bool; the same in a steady decode) and, per row, its latest append's tokens
/// (-1: a free row; [B, 1]: the same in a steady decode), from which and the policy's device
/// counters each row's victim candidates' end follows.
struct RecallMirrors {
  DeviceMirror real, last_new;
};

/// recall's victims stage on the device, without a sync: Victims, the `K` lowest-ranked
/// candidates in eviction order (slots [B, K] int64), their number (candidates [B] int64) and
/// the best-ranked one's scorer state (top [B, W] fp32), as victims_on_host() finds them, slot
/// for slot (no positions: the swap needs none). The candidates lie in victim_range(): from n_sink to the recent window as it was before
/// the latest append, = `counters` [B, 3] (the policy's device counters: length, seen, seen -
/// n_recent) column 2 minus the latest append (`mirrors`); a free row has none:
/// ops::recall_victims(), one compiled op or its reference. Allocates.
template <class Core>
Victims victims_on_device(const LayerState& L, const Core& core, const at::Tensor& counters, int64_t layer,
                          int64_t K, RecallMirrors& mirrors) {
  const int64_t B = L.position.size(0), W = L.state.size(2);
  Victims out;
  const auto longs = L.position.options();
  if (K == 0 || !counters.defined()) {  // nothing to replace (a budget of 0, or nothing appended yet)
    out.candidates = at::zeros({B}, longs);
    out.slots = at::zeros({B, 0}, longs);
    out.top = at::zeros({B, W}, L.state.options());
    return out;
  }
  std::vector<int64_t> last_new(static_cast<size_t>(B));
  int64_t max_seen = 0;
  for (int64_t b = 0; b < B; ++b) {
    last_new[b] = core.active[b] ? L.last_new[b] : -1;
    max_seen = std::max(max_seen, L.seen[b]);
  }
  const auto& latest = mirrors.last_new.get(last_new, core.device, {B, 1});
  auto v = ops::recall_victims(core.scorer.rank(L.state), L.position, L.state, counters, latest,
                               core.layer_eviction[layer].n_sink(), K, max_seen);
  out.slots = std::move(std::get<0>(v));
  out.candidates = std::move(std::get<1>(v));
  out.top = std::move(std::get<2>(v));
  return out;
}

/// Two-level recall's exact scores on the device: the pool's keys `keys` [B, R, G, D] fp32
/// (tier tokens by ascending position, `valid` [B, R] bool), scored with `query` [B, H, Q, D]
/// whose real columns are `real` [B, Q] bool: per head, per query a softmax over the row's
/// pool of scale * q.k (score_pool()'s, every row at once), or by the heads' mean
/// (`head_mean`: of the queries with one `shared_key`, else of the logits; reduced across
/// processes before the softmax, as score_pools_head_mean()); summed over the real columns as
/// fixed-point terms: [B, R] fp64, 0 past a row's pool. No sync. Runs inside
/// allocating_with_reductions(): a reduction's error leaves as ReductionFailed.
/// `mean_query` [B, 1, Q, D] fp32: the heads' mean query the score stage computed and reduced
/// (kHeadMean with a shared key), used as it is: neither computed nor reduced again.
template <class Core>
at::Tensor score_pools_on_device(int64_t layer, const at::Tensor& keys, const at::Tensor& valid, const at::Tensor& query,
                                 const at::Tensor& mean_query, const at::Tensor& real, bool shared_key,
                                 bool head_mean_scoring, double scale, const Core& core) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3), R = keys.size(1);
  const auto k = keys.permute({0, 2, 3, 1});  // [B, G, D, R]
  const auto none = valid.logical_not().view({B, 1, 1, R});
  const auto sums = [&](at::Tensor logits, const at::Tensor& cols) { return softmax_sums(std::move(logits), none, cols); };
  at::Tensor out;
  if (!head_mean_scoring) {
    const auto q = shared_key ? query.reshape({B, 1, H * Q, D}) : query;
    out = sums(at::matmul(q, k).mul_(scale), TierStore::columns(real, H, shared_key ? 1 : H));
    reduce_scores_within(layer, core, out);
    return out;
  }
  if (shared_key && mean_query.defined()) return sums(at::matmul(mean_query, k).mul_(scale), TierStore::columns(real, 1, 1));
  auto sum = head_sum(shared_key ? query : at::matmul(query, k).mul_(scale));  // [B, 1, Q, D | R] fp64
  reduce_scores_within(layer, core, sum);
  const auto mean = head_mean(sum, core);
  return sums(shared_key ? at::matmul(mean, k).mul_(scale) : mean, TierStore::columns(real, 1, 1));
}

/// The tier's tensor path: its tokens in a TierStore, every step tensor ops on the cache's
/// device, none of which reads the device or copies between host and device in the steady
/// state; the tokens recalled so far as a device counter.
class TierTensorPath {
 public:
  TierTensorPath() = default;
  explicit TierTensorPath(TierStore store) : keys_(store.keys()), store_(std::move(store)) {}

  /// A copy with its own store and counter (allocates; a sync on a GPU: TierStore::copied()).
  TierTensorPath copied() const {
    TierTensorPath c(store_.copied());
    c.mirrors_ = mirrors_;  // replaced on change, never written in place: shared safely
    c10::InferenceMode normal_tensors(false);
    if (recalled_.defined()) c.recalled_ = recalled_.clone();
    return c;
  }

  /// Exchanges everything with `o` (two copies of one tier). Allocates nothing, does not throw.
  void swap(TierTensorPath& o) noexcept {
    std::swap(keys_, o.keys_);
    store_.swap(o.store_);
    std::swap(mirrors_, o.mirrors_);
    std::swap(recalled_, o.recalled_);
  }

  /// A pass's evicted tokens (its plan's `evicted_t` [B, columns], pads on the trash slot),
  /// before the moves overwrite their rows: planned into `w`, the pass's commit runs it
  /// (TierStore::take(): in, then the budget's drops). `max_position`: more than any position.
  template <class Pass, class Ranks>
  void take(TierWrites& w, const Pass& pass, const LayerState& L, const std::vector<at::Tensor>& buffers, Ranks&& ranks,
            int64_t max_position) {
    if (!pass.evicted_t.defined()) return;
    store_.take(w, pass.evicted_t, L.position, L.state, buffers, ranks, max_position);
  }

  /// recall's score stage: every row's pages by page id, scored on the device with `in.query`
  /// [B, H, Q, D] (fp32, on core.device) per head (reduced across processes) or by the heads'
  /// mean (the mean query's bound with one shared key, the latent layout; the mean of the
  /// heads' bounds otherwise; reduced before the softmax): PageScores' sums [B, P] fp64
  /// (score_pages()), the real query columns they counted (`real`, through `mirrors_`: the same
  /// in a steady decode) and, by the heads' mean with a shared key, the mean query
  /// (mean_query), which a two-level pool's scoring takes as it is (one reduction, not two).
  /// No sync. Throws c10::Error naming `layer` when an allocation fails (nothing changed but
  /// the mirror) or as the reducer does.
  template <class Core>
  PageScores score(int64_t layer, const RecallInput& in, const LayerState& L, const Core& core) {
    const auto& keys = keys_;
    const auto& query = in.query;
    const double scale = in.scale;
    const int64_t B = query.size(0), H = query.size(1), Q = query.size(2);
    const auto fail = [&](const std::string& why) {
      KVEVICT_CHECK(false, "recall: could not score the pages of layer ", layer, " on ", core.device, ": ", why);
    };
    PageScores out;
    allocating([&] {
      // A mirror: the same in a steady decode.
      out.real = mirrors_.real.get(real_flags(core, L, B, Q), core.device, {B, Q}, at::kBool);
    }, fail);
    const auto& real = out.real;
    const int64_t G = store_.key_groups();
    // An empty tier (nothing taken yet) scores one page 0, through the same steps (and the same
    // collectives under tensor parallelism).
    const bool empty = store_.page_capacity() == 0;
    const auto zeros = [&](at::IntArrayRef shape, at::ScalarType dtype) {
      return at::zeros(shape, query.options().dtype(dtype));
    };
    out.sums = score_pages(
        keys.head_mean, layer, core, fail,
        [&] {
          return empty ? zeros({B, 1}, at::kDouble)
                       : store_.scores_of(store_.bound(query, scale), TierStore::columns(real, H, G));
        },
        [&] {  // the mean query, or the mean bound
          return keys.shared ? query : empty ? zeros({B, H, Q, 1}, at::kFloat) : store_.bound(query, scale);
        },
        [&](const at::Tensor& mean) {
          if (keys.shared) out.mean_query = mean;  // the pool's scoring takes it as it is
          if (empty) return zeros({B, 1}, at::kDouble);
          return store_.scores_of(keys.shared ? store_.bound(mean, scale) : mean, TierStore::columns(real, 1, 1));
        });
    return out;
  }

  /// recall's victims stage: victims_on_device() of the `in.K` lowest-ranked candidates, whose
  /// end comes from the policy's device `counters` [B, 3] (undefined: nothing appended yet) and
  /// each row's latest append (`mirrors_`). No sync. Throws c10::Error naming `layer` when an
  /// allocation fails (nothing changed but the mirror).
  template <class Core>
  Victims victims(int64_t layer, const RecallInput& in, const LayerState& L, const Core& core,
                  const at::Tensor& counters) {
    Victims out;
    allocating([&] { out = victims_on_device(L, core, counters, layer, in.K, mirrors_); },
               [&](const std::string& why) {
                 KVEVICT_CHECK(false, "recall: could not allocate its plan for layer ", layer, ": ", why);
               });
    return out;
  }

  /// recall's pick stage: the tier tokens that replace `victims`, at most min(tokens,
  /// candidates) a row: TierStore::pick() of the best whole pages by `scores`, or, two-level,
  /// the pool of the best whole pages up to `rescore` tokens sorted by position, scored again
  /// with its keys (score_pools_on_device(), with the score stage's real columns and mean
  /// query) and its best tokens (higher score first, equal scores the older position, never a
  /// score of 0): Pick of store slots on the device. No sync. Allocates; throws c10::Error
  /// naming `layer` when an allocation fails, or as the reducer does.
  template <class Core>
  Pick pick(int64_t layer, const RecallInput& in, const PageScores& scores, const Victims& victims,
            const LayerState& L, const Core& core) {
    Pick out;
    allocating_with_reductions([&] { out = pick_on_device(layer, in, scores, victims, L, core); },
               [&](const std::string& why) {
                 KVEVICT_CHECK(false, "recall: could not allocate its plan for layer ", layer, ": ", why);
               });
    return out;
  }

  /// recall's swap stage: TierStore::swap() of the picked tokens (`pick`) with the victims, the
  /// policy's side through `exchange`, and the tokens recalled counted; one commit (a throw puts
  /// back what was written: c10::Error naming recall). Returns the tokens recalled per row
  /// (pick.count: [B] int64 on the device). No sync.
  template <class Ranks, class Exchange>
  at::Tensor swap(int64_t layer, const Pick& pick, const Victims& victims, const LayerState& L,
                  const std::vector<at::Tensor>& buffers, Ranks&& ranks, Exchange&& exchange) {
    TensorUndo undo;
    TierWrites w(undo);
    allocating([&] {
      if (!recalled_.defined()) recalled_ = at::zeros({1}, pick.count.options());
      store_.swap(w, pick, victims.slots, victims.top, L.position, L.state, buffers, ranks, exchange,
                  max_position(L), recalled_);
    }, [&](const std::string& why) {
      KVEVICT_CHECK(false, "recall: could not allocate the swap of layer ", layer, ": ", why);
    });
    w.commit("recall");
    return pick.count;
  }

  /// Plans into `w`: row b's tokens at positions >= `from` leave (a truncate; one upload of the
  /// rows' limits, a position past every token for the other rows).
  void drop_from(TierWrites& w, int64_t b, int64_t from) {
    std::vector<int64_t> limits(static_cast<size_t>(store_.batch()), std::numeric_limits<int64_t>::max());
    limits[static_cast<size_t>(b)] = from;
    store_.drop_from(w, at::tensor(limits, at::TensorOptions().dtype(at::kLong)).to(store_.device()));
  }
  /// Plans into `w`: row b empty.
  void release(TierWrites& w, int64_t b) { store_.release(w, b); }
  /// Room for `tokens` a row and positions below `max_position` (TierStore::reserve()).
  void reserve(TierWrites& w, int64_t tokens, int64_t max_position) { store_.reserve(w, tokens, max_position); }
  /// Every row empty, the store's memory given back, the recalled counter cleared. Does not
  /// throw.
  void clear() noexcept {
    store_.clear();
    recalled_ = at::Tensor();
    mirrors_ = RecallMirrors{};
  }

  /// The reads (each reads the device: a sync on CUDA).
  int64_t count_from(int64_t b, int64_t from) const { return store_.count_from(b, from); }
  int64_t tokens() const { return store_.tokens(); }
  int64_t bytes() const { return store_.host_bytes(); }
  int64_t device_bytes() const { return store_.device_bytes(); }
  int64_t recalled() const { return recalled_.defined() ? recalled_.item<int64_t>() : 0; }
  at::Tensor positions(int64_t b) const { return store_.tokens(b, false).position; }
  at::Tensor ranks(int64_t b) const { return store_.tokens(b, false).rank; }
  std::vector<at::Tensor> rows(int64_t b, const std::vector<std::vector<int64_t>>& /*shapes*/,
                               at::ScalarType /*dtype*/) const {
    return store_.tokens(b).rows;
  }
  int64_t size(int64_t b) const { return store_.count_from(b, 0); }

 private:
  /// pick()'s work.
  template <class Core>
  Pick pick_on_device(int64_t layer, const RecallInput& in, const PageScores& scores, const Victims& victims,
                      const LayerState& L, const Core& core) {
    const auto& keys = keys_;
    const int64_t tokens = in.tokens, rescore = in.rescore, K = in.K;
    const auto limit = victims.candidates.clamp_max(std::min(tokens, K));
    if (!in.two_level()) return store_.pick(scores.sums, limit, K);
    const int64_t B = L.position.size(0), R = std::min(rescore, store_.capacity());
    const auto longs = L.position.options();
    const auto pool = store_.pick(scores.sums, at::full({B}, rescore, longs), R);
    if (R == 0) return store_.picked(at::Tensor(), at::Tensor(), K, false);
    const auto sorted = store_.pool(pool);  // by position, their keys, valid columns
    const auto& by_position = std::get<0>(sorted);
    const auto& valid = std::get<2>(sorted);
    const auto exact = score_pools_on_device(layer, std::get<1>(sorted), valid, in.query, scores.mean_query,
                                             scores.real, keys.shared, keys.head_mean, in.scale, core);
    // The best tokens of the pool's pages (not whole pages): higher score first, equal scores
    // the older position.
    auto best = ops::pick_tokens(exact, valid, by_position, limit, K, store_.capacity());
    return Pick{std::move(std::get<0>(best)), std::move(std::get<1>(best)), false};
  }

  TierKeys keys_;
  TierStore store_;
  RecallMirrors mirrors_;
  at::Tensor recalled_;  // [1] int64 on the device: tokens recalled since the last reset()
};

}  // namespace detail
}  // namespace kvevict
