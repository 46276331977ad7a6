#pragma once
// The host tier: where a cache's evicted tokens go instead of being dropped (ArkVale, Chen et
// al. 2024, Sec. 4: evicted pages backed up in host memory). Per layer and batch row it keeps
// each evicted token's rows (every buffer of the layout, bit for bit), its position, its rank
// at eviction and its scorer state, within a budget of tokens per row: past it the lowest-
// ranked tier tokens are dropped, with the eviction order (lower rank first, equal ranks the
// older position first, non-finite ranks lowest). On the host path a pass hands its evicted
// tokens over at once, into TierRows and PageDigests; on the tensor path the tier is a TierStore
// (tier/store.hpp) and its changes join the commit of the call that makes them (TierWrites).

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/tier/host_path.hpp>
#include <kvevict/detail/tier/page_digests.hpp>
#include <kvevict/detail/tier/recall_stages.hpp>
#include <kvevict/detail/tier/row.hpp>
#include <kvevict/detail/tier/scoring.hpp>
#include <kvevict/detail/tier/store.hpp>
#include <kvevict/detail/tier/tensor_path.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace kvevict {
namespace detail {

/// The tiers of one layer, the facade over the tier's two paths as EvictionPolicy is over the
/// policy's: TierHostPath (tier/host_path.hpp: per row a TierRow and its PageDigests, on the
/// CPU) or TierTensorPath (tier/tensor_path.hpp: a TierStore, tensor ops on the cache's
/// device), which have the same steps. Each public call is one call per step into the path:
/// take() plans a pass's evicted tokens into the pass's commit; recall() runs recall's stages
/// (score, victims, pick, swap), the same on both paths with the same types
/// (tier/recall_stages.hpp); release(), drop_from() and reserve() plan into the commit of
/// finish, reset, truncate and reserve_tier; the reads read the path's storage.
class LayerTier {
  /// Calls `f(path)` with the path of this tier.
  template <class F>
  decltype(auto) on_path(F&& f) {
    return host_ ? f(host_path_) : f(tensor_path_);
  }
  template <class F>
  decltype(auto) on_path(F&& f) const {
    return host_ ? f(host_path_) : f(tensor_path_);
  }

 public:
  LayerTier() = default;
  /// `row_bytes[i]`: one token's bytes in buffer i, `groups[i]` pieces of it (one per outer
  /// index of a [B, outer..., slots, inner] buffer); `keys`: what the page digests bound.
  /// `host`: the cache's policy takes the host path (TierHostPath), else the tensor path, whose
  /// TierStore holds rows of `shapes[i]` = {outer..., inner} per buffer, with its tensors on
  /// `device`.
  LayerTier(int64_t batch, int64_t budget, int64_t state_width, std::vector<int64_t> row_bytes,
            std::vector<int64_t> groups, TierKeys keys, bool host, std::vector<std::vector<int64_t>> shapes,
            at::Device device)
      : host_(host),
        budget_(budget),
        keys_(keys),
        tensor_path_(host ? TierTensorPath()
                          : TierTensorPath(TierStore(batch, budget, state_width, std::move(shapes), keys.dtype, keys, device))) {
    if (host)
      host_path_ = TierHostPath(batch, budget, state_width, std::move(row_bytes), std::move(groups), std::move(keys));
  }

  /// A copy with its own tokens, rows and digests (allocates; a sync on a GPU: the tensor path
  /// waits for its kernels before it copies the pinned rows). For CacheBase::save_layer().
  LayerTier copied() const {
    LayerTier c;
    c.host_ = host_;
    c.budget_ = budget_;
    c.keys_ = keys_;
    if (host_) {
      c.host_path_ = host_path_;  // host vectors: a deep copy
    } else {
      auto t = tensor_path_.copied();
      c.tensor_path_.swap(t);
    }
    return c;
  }

  /// Whether `o` is a tier of the same kind: path, budget and page size (an empty LayerTier:
  /// budget 0). For CacheBase::restore_layer()'s check.
  bool same_kind(const LayerTier& o) const noexcept {
    return host_ == o.host_ && budget_ == o.budget_ && keys_.page_size == o.keys_.page_size &&
           keys_.shared == o.keys_.shared && keys_.head_mean == o.keys_.head_mean;
  }
  int64_t budget() const noexcept { return budget_; }
  /// "no host tier", or "a host tier of N tokens per row, pages of P, scored per head" (or "by
  /// the heads' mean"), for messages.
  std::string describe() const {
    if (budget_ == 0) return "no host tier";
    return c10::str("a host tier of ", budget_, " tokens per row, pages of ", keys_.page_size, ", scored ",
                    keys_.head_mean ? "by the heads' mean" : "per head", host_ ? "" : " (tensor path)");
  }

  /// Exchanges everything with `o` (a copied() of this tier). Allocates nothing, does not throw.
  void swap(LayerTier& o) noexcept {
    std::swap(host_, o.host_);
    std::swap(budget_, o.budget_);
    std::swap(keys_, o.keys_);
    std::swap(host_path_, o.host_path_);
    tensor_path_.swap(o.tensor_path_);
  }

  /// The digests' page size, tokens (cache options' tier_page_size).
  int64_t page_size() const noexcept { return keys_.page_size; }

  /// Adds this layer's tier counters to `s` (CacheStats: tier_tokens, tier_bytes, tier_device_bytes,
  /// tier_recalled). On the tensor path reads the device.
  template <class Stats>
  void add_stats(Stats& s) const {
    on_path([&](const auto& p) {
      s.tier_tokens += p.tokens();
      s.tier_bytes += p.bytes();
      s.tier_device_bytes += p.device_bytes();
      s.tier_recalled += p.recalled();
    });
  }

  /// Recall (CacheBase::recall_rows(), after the checks and the flush): recall's stages, each
  /// every row at once, each one call into the path (tier/recall_stages.hpp):
  ///   - score: PageScores, every active row's pages scored with `in.query` [B, H, Q, key
  ///     width] (fp32, the row's real columns as observe(), reduced across processes like
  ///     observations: core's reduce_contributions; kHeadMean, keys_.head_mean: the heads'
  ///     sums before the softmax, head_sum() / head_mean());
  ///   - victims: Victims, each row's `in.K` lowest-ranked heavy hitters (victim_range()'s
  ///     candidates in eviction order) and the best one's state;
  ///   - pick: Pick, the best pages' tokens, at most `in.tokens` per row and no more than the
  ///     row's candidates, whole pages; two-level (in.two_level()): the best whole pages up
  ///     to `in.rescore` tokens per row are the pool, each pool token is scored again with its
  ///     own keys (the exact logits, the same softmax and fixed-point sum over the pool,
  ///     reduced the same way), and the best `in.tokens` of the pool come back one by one
  ///     (higher score first, equal scores the older position; never a score of 0);
  ///   - swap: the picked tokens and the victims exchange places in `L` and `buffers`.
  /// Returns the tokens recalled per row: [B] int64, on the cache's device.
  ///
  /// Host path (TierHostPath; everything on the CPU, the stages' tensors host tensors):
  /// score_on_host() scores the pages, victims_on_host() finds the victims with a loop, pick
  /// picks on the host and swap exchanges the tokens with the slots in place; every allocation
  /// before the first write. Tensor path (TierTensorPath; the cache's tensors and the query on
  /// its device): every stage tensor ops there (TierStore: the pages scored by page id, the
  /// victims by one op among the candidates, whose end comes from the policy's device
  /// `counters` [B, 3], the pick as one op or a scan, the swap as one op or through the rows'
  /// view under one undo log): no host sync, no host read, no copy between host and device in
  /// the steady state. The victims stage is the one whose inputs differ: the host path reads
  /// L's host counters, the tensor path the policy's device `counters`.
  ///
  /// The tier writes rows of `buffers` and its own storage; the policy's positions and states
  /// change only through `exchange(slots, positions, states)` (PolicyState::exchange()).
  template <class Core, class Exchange>
  at::Tensor recall(int64_t layer, const RecallInput& in, const LayerState& L, const Core& core,
                    const std::vector<at::Tensor>& buffers, const at::Tensor& counters, Exchange&& exchange) {
    const auto rank = [&](const auto& state) { return core.scorer.rank(state); };
    return on_path([&](auto& p) {
      const PageScores scores = p.score(layer, in, L, core);
      const Victims victims = host_ ? host_path_.victims(layer, in, L, core)
                                    : tensor_path_.victims(layer, in, L, core, counters);
      const Pick pick = p.pick(layer, in, scores, victims, L, core);
      return p.swap(layer, pick, victims, L, buffers, rank, exchange);
    });
  }

  /// A pass's evicted tokens into the tier (`pass`, before the moves overwrite their rows in
  /// `buffers` [B, outer..., slots, inner]; L's positions and states; rank(state) a token's
  /// rank, host or tensor form). The host path takes them at once (every allocation first, a
  /// throw changes nothing); the tensor path plans them into `w`, which the pass's commit runs
  /// (TierStore::take()).
  template <class Pass, class Rank>
  void take(const Pass& pass, const LayerState& L, const std::vector<at::Tensor>& buffers, Rank&& rank, TierWrites& w) {
    on_path([&](auto& p) { p.take(w, pass, L, buffers, rank, max_position(L)); });
  }
  /// Row b emptied and its memory given back (finish, reset(row)), planned into `w`.
  void release(int64_t b, TierWrites& w) {
    on_path([&](auto& p) { p.release(w, b); });
  }
  /// Row b's tokens at positions >= `from` leave (a truncate), planned into `w`.
  void drop_from(int64_t b, int64_t from, TierWrites& w) {
    on_path([&](auto& p) { p.drop_from(w, b, from); });
  }
  /// Room for the whole budget and positions below `positions` (tensor path; the host path's
  /// tier grows as it fills), joining `w`: kept when it runs.
  void reserve(int64_t positions, TierWrites& w) {
    on_path([&](auto& p) { p.reserve(w, budget_, positions); });
  }
  /// Every row empty, the memory given back and the recalled counter cleared (reset()).
  /// Allocates nothing; does not throw.
  void clear() noexcept {
    on_path([](auto& p) noexcept { p.clear(); });
  }

  /// Tokens of row b at positions >= `from` (the tensor path reads the device).
  int64_t count_from(int64_t b, int64_t from) const {
    return on_path([&](const auto& p) { return p.count_from(b, from); });
  }
  /// Row b's tokens by ascending position, as host tensors (CPU copies): positions [n] int64,
  /// ranks at eviction [n] fp32, and per buffer its rows [outer..., n, inner] (`shapes[i]`:
  /// buffer i's {outer..., inner}; the cache's `dtype`). The tensor path reads the device.
  at::Tensor positions(int64_t b) const {
    return on_path([&](const auto& p) { return p.positions(b); });
  }
  at::Tensor ranks(int64_t b) const {
    return on_path([&](const auto& p) { return p.ranks(b); });
  }
  std::vector<at::Tensor> rows(int64_t b, const std::vector<std::vector<int64_t>>& shapes, at::ScalarType dtype) const {
    return on_path([&](const auto& p) { return p.rows(b, shapes, dtype); });
  }
  int64_t size(int64_t b) const {
    return on_path([&](const auto& p) { return p.size(b); });
  }

 private:
  bool host_ = true;
  int64_t budget_ = 0;
  TierKeys keys_;
  TierHostPath host_path_;
  TierTensorPath tensor_path_;
};

}  // namespace detail
}  // namespace kvevict
