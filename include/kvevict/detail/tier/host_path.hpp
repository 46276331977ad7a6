#pragma once
// The tier's host path (a cache whose policy takes the host path: everything on the CPU):
// TierHostPath, per batch row a TierRow and its PageDigests, with the steps of its twin
// TierTensorPath (tier/tensor_path.hpp): take, recall's stages score, victims, pick and swap
// (the same types on both paths: tier/recall_stages.hpp; host tensors here, read with
// data_ptr), drop_from, release, reserve, clear, and the reads. Its scoring (the pages',
// score_on_host(); two-level recall's pool; the victims, victims_on_host()) is
// tier/host_scoring.hpp; what both paths' scoring shares (the reduction, the heads' mean, their
// order) is tier/scoring.hpp.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/detail/tier/host_scoring.hpp>
#include <kvevict/detail/tier/page_digests.hpp>
#include <kvevict/detail/tier/recall_stages.hpp>
#include <kvevict/detail/tier/row.hpp>
#include <kvevict/detail/tier/scoring.hpp>
#include <kvevict/detail/tier/writes.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// The tier's host path: per batch row a TierRow (its tokens, within a token budget per row)
/// and that row's PageDigests; each step runs at once, in place, on the CPU (the cache's
/// contiguous CPU buffers), with the names and the order of its twin TierTensorPath
/// (tier/tensor_path.hpp): take, recall's stages (score, victims, pick, swap), drop_from,
/// release, reserve, clear and the reads. Its writes allocate nothing and do not throw once their room is made, so the steps
/// that join a call's commit (release, drop_from) run as plain steps of it.
class TierHostPath {
 public:
  TierHostPath() = default;
  /// `row_bytes[i]`: one token's bytes in buffer i, `groups[i]` pieces of it (one per outer
  /// index of a [B, outer..., slots, inner] buffer); `keys`: what the page digests bound.
  TierHostPath(int64_t batch, int64_t budget, int64_t state_width, std::vector<int64_t> row_bytes,
               std::vector<int64_t> groups, TierKeys keys)
      : rows_(static_cast<size_t>(batch)), budget_(budget), W_(state_width), row_bytes_(std::move(row_bytes)),
        groups_(std::move(groups)), keys_(std::move(keys)), evicted_(static_cast<size_t>(batch)),
        src_(row_bytes_.size()), stride_(row_bytes_.size()) {
    for (auto& r : rows_) r.bytes.resize(row_bytes_.size());
    key_groups_ = groups_[keys_.buffers.at(0)];
    const int64_t elem = static_cast<int64_t>(c10::elementSize(keys_.dtype));
    for (const auto i : keys_.buffers) {
      KVEVICT_CHECK(groups_[i] == key_groups_, "tier: every key buffer must have the same groups");
      key_width_ += row_bytes_[i] / groups_[i] / elem;
    }
    key_.resize(static_cast<size_t>(key_groups_ * key_width_));
    for (size_t b = 0; b < rows_.size(); ++b) digests_.emplace_back(keys_.page_size, key_groups_, key_width_);
  }

  const PageDigests& digests(int64_t b) const { return digests_[static_cast<size_t>(b)]; }
  const TierRow& row(int64_t b) const { return rows_[static_cast<size_t>(b)]; }
  TierRow& row(int64_t b) { return rows_[static_cast<size_t>(b)]; }

  /// Token i of row b's keys as floats [groups, width] in `out`.
  void key_of(int64_t b, int64_t i, float* out) const {
    const auto& r = row(b);
    const int64_t elem = static_cast<int64_t>(c10::elementSize(keys_.dtype));
    for (int64_t g = 0; g < key_groups_; ++g) {
      float* o = out + g * key_width_;
      for (const auto j : keys_.buffers) {
        const int64_t piece = row_bytes_[j] / groups_[j], n = piece / elem;
        to_floats(r.bytes[j].data() + i * row_bytes_[j] + g * piece, keys_.dtype, n, o);
        o += n;
      }
    }
  }

  /// A pass's evicted tokens (its plan `pass`), before the moves overwrite their rows in
  /// `buffers`: into the tier at once (take_pass(); `w` and `max_position` are the tensor
  /// path's). Every allocation first: a throw (c10::Error naming the tier) changes nothing.
  template <class Pass, class Rank>
  void take(TierWrites& /*w*/, const Pass& pass, const LayerState& L, const std::vector<at::Tensor>& buffers,
            Rank&& rank, int64_t /*max_position*/) {
    take_pass(pass, L.position, L.state, buffers, L.slots, rank);
  }

  /// recall's score stage: score_on_host() of every row's pages with `in.query`. Throws
  /// c10::Error naming `layer` when an allocation fails or as the reducer does.
  template <class Core>
  PageScores score(int64_t layer, const RecallInput& in, const LayerState& L, const Core& core) const {
    return score_on_host(digests_, keys_.shared, keys_.head_mean, layer, in.query, in.scale, L, core);
  }

  /// recall's victims stage: victims_on_host() of the `in.K` lowest-ranked candidates. Throws
  /// c10::Error naming `layer` when an allocation fails; changes nothing.
  template <class Core>
  Victims victims(int64_t layer, const RecallInput& in, const LayerState& L, const Core& core) const {
    Victims out;
    allocating([&] { out = victims_on_host(L, core, layer, in.K); },
               [&](const std::string& why) { KVEVICT_CHECK(false, "recall: could not allocate its plan for layer ", layer, ": ", why); });
    return out;
  }

  /// recall's pick stage, from the score stage's `scores` and the victims stage's `victims`
  /// (host tensors): per active row with pages, the tier tokens to recall (the best whole
  /// pages, or two-level recall's best pool tokens), at most min(tokens, the row's
  /// candidates, K): Pick (CPU) of token indices. Allocates; changes nothing the caller sees.
  template <class Core>
  Pick pick(int64_t layer, const RecallInput& in, const PageScores& scores, const Victims& victims,
            const LayerState& L, const Core& core) {
    const int64_t B = static_cast<int64_t>(rows_.size()), K = in.K;
    const auto row_queries = [&](int64_t b) { return real_queries(core, L, in.query, b, keys_.shared); };
    const at::Tensor& sums = scores.sums;
    const int64_t P = sums.size(1);
    const double* sum = sums.template data_ptr<double>();
    // Two-level recall: the pool of every row (tokens of its best pages, by position) and the
    // pool's exact scores, reduced like the page scores (every process holds the same pools).
    const bool two_level = in.two_level();
    std::vector<std::vector<int64_t>> pool(static_cast<size_t>(two_level ? B : 0));
    at::Tensor exact;
    if (two_level) {
      int64_t N = 1;
      for (int64_t b = 0; b < B; ++b) {
        if (!core.active[b] || digests(b).pages() == 0) continue;
        auto& pb = pool[static_cast<size_t>(b)];
        pick(b, sum + b * P, in.rescore, pb);
        const auto& r = row(b);
        std::sort(pb.begin(), pb.end(), [&](int64_t x, int64_t y) { return r.position[x] < r.position[y]; });
        N = std::max(N, static_cast<int64_t>(pb.size()));
      }
      if (keys_.head_mean) {
        std::vector<at::Tensor> keys;  // per row: its pool's keys
        for (int64_t b = 0; b < B; ++b) keys.push_back(pool_keys(b, pool[static_cast<size_t>(b)]));
        if (keys_.shared && scores.mean_query.defined()) {  // the page scoring's mean query, reduced once
          exact = score_pools_of_mean(
              keys, [&](int64_t b) { return real_queries(core, L, scores.mean_query, b, true); }, N, in.scale);
        } else {
          exact = score_pools_head_mean(layer, keys, row_queries, keys_.shared, in.query.size(1), in.query.size(2), N,
                                        in.scale, core);
        }
      } else {
        exact = at::zeros({B, N}, at::TensorOptions().dtype(at::kDouble));
        for (int64_t b = 0; b < B; ++b) {
          const auto& pb = pool[static_cast<size_t>(b)];
          const auto q = row_queries(b);
          if (q.defined() && !pb.empty()) score_pool(pool_keys(b, pb), q, in.scale, exact.select(0, b));
        }
        reduce_scores(layer, core, exact);
      }
    }
    // Per row the tier tokens to recall.
    const int64_t* n_cand = victims.candidates.template data_ptr<int64_t>();
    const auto longs = at::TensorOptions().dtype(at::kLong);
    Pick out;
    out.whole_pages = !two_level;
    allocating([&] {
      out.slots = at::full({B, K}, -1, longs);
      out.count = at::zeros({B}, longs);
      std::vector<int64_t> picked;
      for (int64_t b = 0; b < B; ++b) {
        if (!core.active[b] || digests(b).pages() == 0) continue;
        const int64_t limit = std::min({in.tokens, n_cand[b], K});
        if (limit == 0) continue;
        if (two_level)
          pick_tokens(pool[static_cast<size_t>(b)], exact.template data_ptr<double>() + b * exact.size(1), limit, picked);
        else
          pick(b, sum + b * P, limit, picked);
        std::copy(picked.begin(), picked.end(), out.slots.template data_ptr<int64_t>() + b * K);
        out.count.template data_ptr<int64_t>()[b] = static_cast<int64_t>(picked.size());
      }
    }, [&](const std::string& why) { KVEVICT_CHECK(false, "recall: could not allocate its plan for layer ", layer, ": ", why); });
    return out;
  }

  /// Row b's tier tokens to recall, by page: the pages in order of `scores` (per page slot,
  /// higher first; equal scores the older page first; a score of 0 never), each whole page
  /// that still fits in `limit` tokens. Their token indices go to `out` (cleared first).
  void pick(int64_t b, const double* scores, int64_t limit, std::vector<int64_t>& out) {
    const auto& dg = digests_[static_cast<size_t>(b)];
    out.clear();
    order_.clear();
    for (int64_t s = 0; s < dg.slots(); ++s) {
      if (dg.members(s) > 0 && scores[s] > 0) order_.push_back(s);
    }
    const auto better = [&](int64_t x, int64_t y) {
      return scores[x] != scores[y] ? scores[x] > scores[y] : dg.page_of_slot(x) < dg.page_of_slot(y);
    };
    // Only the pages the fill reaches need their order: a sorted prefix, first the pages that
    // `limit` tokens fill when full, grown geometrically (O(pages log pages) at worst) when
    // pages are partly full or too large to fit are skipped. `better` is a strict total order
    // (page ids differ), so each prefix is the full sort's.
    int64_t left = limit;
    size_t sorted = 0;
    for (size_t i = 0; i < order_.size() && left > 0; ++i) {
      if (i == sorted) {
        const auto full_pages = static_cast<size_t>(left / dg.page_size() + 1);
        const size_t grow_by = std::max<size_t>({full_pages, sorted, size_t{16}});
        const size_t upto = std::min(order_.size(), sorted + grow_by);
        std::partial_sort(order_.begin() + static_cast<std::ptrdiff_t>(sorted),
                          order_.begin() + static_cast<std::ptrdiff_t>(upto), order_.end(), better);
        sorted = upto;
      }
      const int64_t s = order_[i];
      if (dg.members(s) > left) continue;
      for (int64_t t = dg.head(s); t >= 0; t = dg.next(t)) out.push_back(t);
      left -= dg.members(s);
    }
  }

  /// Row b's tier tokens `pool` (indices) as keys [n, G, key width] fp32 on the CPU. Allocates.
  at::Tensor pool_keys(int64_t b, const std::vector<int64_t>& pool) const {
    const auto n = static_cast<int64_t>(pool.size());
    auto keys = at::empty({n, key_groups_, key_width_});
    float* k = keys.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) key_of(b, pool[static_cast<size_t>(j)], k + j * key_groups_ * key_width_);
    return keys;
  }

  /// Two-level recall's pick: of `pool` (tier token indices by ascending position, `scores[j]`
  /// pool token j's exact score), the best `limit` (higher score first, equal scores the older
  /// position; never a score of 0) go to `out` (cleared first).
  static void pick_tokens(const std::vector<int64_t>& pool, const double* scores, int64_t limit,
                          std::vector<int64_t>& out) {
    std::vector<int64_t> order;
    for (size_t j = 0; j < pool.size(); ++j) {
      if (scores[j] > 0) order.push_back(static_cast<int64_t>(j));
    }
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return scores[x] > scores[y]; });
    out.clear();
    for (size_t k = 0; k < order.size() && static_cast<int64_t>(k) < limit; ++k) out.push_back(pool[order[k]]);
  }

  /// Exchanges the rows of row b's `n` tier tokens `tokens[k]` with those of the cache slots
  /// `victims[k]`, bit for bit in every buffer (`buffers` [B, outer..., slots, inner],
  /// contiguous); each victim enters the tier with its position and scorer state from the
  /// policy's `position` [B, slots] and `state` [B, slots, W] (read only; rank(state) its rank)
  /// and `recalled[k]` gets token k's position: the policy then gives the slots their new
  /// positions and states (PolicyState::exchange()). The digests follow. Allocates nothing
  /// after reserve_recall().
  template <class Rank>
  void swap_row(int64_t b, int64_t n, const int64_t* tokens, const int64_t* victims,
                const std::vector<at::Tensor>& buffers, int64_t slots, const int64_t* position, const float* state,
                Rank&& rank, int64_t* recalled) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = tokens[k], s = victims[k];
      for_each_piece(b, i, buffers, s, [&](uint8_t* t, uint8_t* c, size_t piece) {
        std::memcpy(swap_.data(), c, piece);
        std::memcpy(c, t, piece);
        std::memcpy(t, swap_.data(), piece);
      });
      recalled[k] = row(b).position[i];
      replace(b, i, position[b * slots + s], state + (b * slots + s) * W_, rank);
    }
    refresh(b);
  }

  /// What swap() of row b needs, with victims up to `max_position`. Changes nothing.
  void reserve_recall(int64_t b, int64_t max_position) {
    digests_[static_cast<size_t>(b)].reserve(row(b).size(), max_position);
    int64_t piece = 0;
    for (size_t j = 0; j < row_bytes_.size(); ++j) piece = std::max(piece, row_bytes_[j] / groups_[j]);
    swap_.resize(static_cast<size_t>(piece));
    order_.reserve(static_cast<size_t>(digests_[static_cast<size_t>(b)].slots()));
  }

  /// recall's swap stage: swap_row() of each row's picked tokens (`pick`) with its victims (the
  /// first of `victims`' slots), in place, then `exchange(slots, positions, states)` gives the
  /// victims' slots the recalled tokens' positions and the victims' top state ([B, V] int64,
  /// [B, V] int64, [B, V, W] fp32, CPU; the trash slot where a row has fewer). Returns the
  /// tokens recalled per row (pick.count: [B] int64, CPU). Allocates first (those three and
  /// the room the swap needs, reserve_recall(); a throw there changes nothing); nothing after,
  /// and does not throw then.
  template <class Rank, class Exchange>
  at::Tensor swap(int64_t layer, const Pick& pick, const Victims& victims, const LayerState& L,
                  const std::vector<at::Tensor>& buffers, Rank&& rank, Exchange&& exchange) {
    const auto B = static_cast<int64_t>(rows_.size()), W = L.state.size(2), K = pick.slots.size(1);
    const int64_t* count = pick.count.template data_ptr<int64_t>();
    const int64_t* victim = victims.slots.template data_ptr<int64_t>();
    const int64_t* victim_position = victims.position.template data_ptr<int64_t>();
    int64_t V = 0, recalled = 0;
    for (int64_t b = 0; b < B; ++b) {
      V = std::max(V, count[b]);
      recalled += count[b];
    }
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor slots, positions, states;
    allocating([&] {
      slots = at::full({B, V}, L.slots - 1, i64);
      positions = at::full({B, V}, -1, i64);
      states = at::zeros({B, V, W}, at::TensorOptions().dtype(at::kFloat));
      for (int64_t b = 0; b < B; ++b) {
        if (count[b] > 0) reserve_recall(b, *std::max_element(victim_position + b * K, victim_position + b * K + count[b]));
      }
    }, [&](const std::string& why) { KVEVICT_CHECK(false, "recall: could not allocate the swap of layer ", layer, ": ", why); });
    if (recalled == 0) return pick.count;
    auto* s = slots.template data_ptr<int64_t>();
    auto* st = states.template data_ptr<float>();
    const float* top = victims.top.template data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t k = count[b];
      if (k == 0) continue;
      swap_row(b, k, pick.slots.template data_ptr<int64_t>() + b * K, victim + b * K, buffers, L.slots,
               L.position.template data_ptr<int64_t>(), L.state.template data_ptr<float>(), rank,
               positions.template data_ptr<int64_t>() + b * V);
      for (int64_t j = 0; j < k; ++j) {
        s[b * V + j] = victim[b * K + j];
        std::copy(top + b * W, top + (b + 1) * W, st + (b * V + j) * W);
      }
    }
    exchange(slots, positions, states);
    recalled_ += recalled;
    return pick.count;
  }

  /// Row b's tokens at positions >= `from` leave (a truncate), as a step of `w`'s commit
  /// (allocates nothing, does not throw).
  void drop_from(TierWrites& w, int64_t b, int64_t from) {
    w.then([this, b, from] {
      const auto& r = row(b);
      remove_if(b, [&](int64_t i) { return r.position[i] >= from; });
    });
  }
  /// Row b emptied (tokens and digests) and its memory given back, as a step of `w`'s commit.
  void release(TierWrites& w, int64_t b) {
    w.then([this, b] {
      row(b).release();
      digests_[static_cast<size_t>(b)].release();
    });
  }
  /// Nothing: the host tier grows as it fills.
  void reserve(TierWrites& /*w*/, int64_t /*tokens*/, int64_t /*max_position*/) noexcept {}
  /// Every row empty, its memory given back, the recalled counter cleared. Does not throw.
  void clear() noexcept {
    for (auto& r : rows_) r.release();
    for (auto& d : digests_) d.release();
    recalled_ = 0;
  }

  /// Tokens of row b at positions >= `from`.
  int64_t count_from(int64_t b, int64_t from) const {
    const auto& p = row(b).position;
    return std::count_if(p.begin(), p.end(), [&](int64_t x) { return x >= from; });
  }
  /// Tokens held, summed over rows.
  int64_t tokens() const {
    int64_t n = 0;
    for (const auto& r : rows_) n += r.size();
    return n;
  }
  /// Host bytes: every row's tokens (positions, ranks, states and rows) and the digests of
  /// their pages (fp32 min and max per page slot).
  int64_t bytes() const {
    int64_t per_token = 8 + 4 + 4 * W_;
    for (auto x : row_bytes_) per_token += x;
    int64_t digest = 0;
    for (const auto& d : digests_) digest += d.bytes();
    return tokens() * per_token + digest;
  }
  /// Device bytes held: none.
  int64_t device_bytes() const noexcept { return 0; }
  /// Tokens recalled since the last clear().
  int64_t recalled() const noexcept { return recalled_; }
  /// Row b's tokens by ascending position (CPU copies): positions, ranks at eviction, rows.
  at::Tensor positions(int64_t b) const { return row(b).positions(); }
  at::Tensor ranks(int64_t b) const { return row(b).ranks(); }
  std::vector<at::Tensor> rows(int64_t b, const std::vector<std::vector<int64_t>>& shapes, at::ScalarType dtype) const {
    return row(b).rows(shapes, dtype);
  }
  int64_t size(int64_t b) const { return row(b).size(); }

  /// take()'s work: adds each evicted token of `pass` (its
  /// rows in `buffers` [B, outer..., slots, inner], contiguous; its position and scorer state
  /// from `position` [B, slots] and `state` [B, slots, W]; rank(state) its rank) to its row,
  /// then drops what is over the budget. Every allocation first: a throw (c10::Error naming the
  /// tier) changes nothing; once the tier is full, nothing allocates.
  template <class Pass, class Rank>
  void take_pass(const Pass& pass, const at::Tensor& position, const at::Tensor& state,
                 const std::vector<at::Tensor>& buffers, int64_t slots, Rank&& rank) {
    const auto B = static_cast<int64_t>(rows_.size());
    allocating([&] {
      for (int64_t b = 0; b < B; ++b) {
        const auto* first = pass.evicted.data() + b * pass.columns;  // the plan names them, ascending
        evicted_[b].assign(first, first + pass.n[b]);
      }
    }, [&](const std::string& why) { KVEVICT_CHECK(false, "evict: could not allocate room in the host tier: ", why); });
    take_slots(position, state, buffers, slots, rank);
  }

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
    key_of(b, r.size() - 1, key_.data());
    digests_[static_cast<size_t>(b)].insert(r.size() - 1, position, key_.data());
  }

  /// Makes room in row b for `extra` more tokens and in the scratch of enforce_budget(), so
  /// that add() and enforce_budget() then allocate nothing and do not throw. Changes no token.
  /// Grows geometrically (at most to budget + extra tokens), so filling a tier costs amortized
  /// O(tokens added).
  void reserve(int64_t b, int64_t extra) {
    auto& r = row(b);
    const auto n = static_cast<size_t>(r.size() + extra);
    const auto cap = static_cast<size_t>(std::max(r.size() + extra, budget_ + extra));
    const auto grow = [&](auto& v, size_t per) {
      if (v.capacity() < n * per) v.reserve(std::min(std::max(n, 2 * v.capacity() / per), cap) * per);
    };
    grow(r.position, 1);
    grow(r.rank, 1);
    grow(r.state, static_cast<size_t>(W_));
    for (size_t i = 0; i < row_bytes_.size(); ++i) grow(r.bytes[i], static_cast<size_t>(row_bytes_[i]));
    grow(order_, 1);
    grow(drop_, 1);
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
    // order_[0, over) are the tokens to drop: sort them so a lookup is a binary search.
    std::sort(order_.begin(), order_.begin() + over);
    remove_if(b, [&](int64_t i) { return std::binary_search(order_.begin(), order_.begin() + over, i); });
  }

 private:
  /// Calls f(tier, cache, bytes) for each piece (a buffer's row of one group, RowLayout) of row
  /// b's tier token i and of slot s of `buffers` [B, outer..., slots, inner] (contiguous; a
  /// tier token holds its groups' pieces side by side).
  template <class F>
  void for_each_piece(int64_t b, int64_t i, const std::vector<at::Tensor>& buffers, int64_t s, F&& f) {
    auto& r = row(b);
    for (size_t j = 0; j < row_bytes_.size(); ++j) {
      const RowLayout R(buffers[j], buffers[j].dim() - 2);
      auto* base = static_cast<uint8_t*>(buffers[j].data_ptr());
      uint8_t* t = r.bytes[j].data() + i * row_bytes_[j];
      for (int64_t g = 0; g < R.groups_per_row; ++g) f(t + g * R.row_bytes, base + R.offset(b, g, s), static_cast<size_t>(R.row_bytes));
    }
  }

  /// Row b's tier token i, whose rows were just replaced, becomes the token at `position`
  /// with scorer state `state` (rank(state) its rank); its digest follows (refresh() after the
  /// last). Allocates nothing after reserve_recall().
  template <class Rank>
  void replace(int64_t b, int64_t i, int64_t position, const float* state, Rank&& rank) {
    auto& r = row(b);
    auto& dg = digests_[static_cast<size_t>(b)];
    dg.erase(i, r.position[i]);
    r.position[i] = position;
    float* ts = r.state.data() + i * W_;
    std::copy(state, state + W_, ts);
    r.rank[i] = rank(ts);
    key_of(b, i, key_.data());
    dg.insert(i, position, key_.data());
  }
  void refresh(int64_t b) {
    digests_[static_cast<size_t>(b)].refresh([&](int64_t t, float* out) { key_of(b, t, out); });
  }

  /// Adds the tokens in slots evicted_[b] of every row b (rows in `buffers` [B, outer...,
  /// slots, inner], contiguous; positions `position` [B, slots], states `state` [B, slots, W],
  /// all on the CPU), then drops what is over the budget. Every allocation first.
  template <class Rank>
  void take_slots(const at::Tensor& position, const at::Tensor& state, const std::vector<at::Tensor>& buffers,
                  int64_t slots, Rank&& rank) {
    const auto B = static_cast<int64_t>(rows_.size());
    const auto* pos = position.data_ptr<int64_t>();
    const auto* st = state.data_ptr<float>();
    allocating([&] {
      for (int64_t b = 0; b < B; ++b) {
        const auto n = static_cast<int64_t>(evicted_[b].size());
        if (n == 0) continue;
        reserve(b, n);
        int64_t max_position = 0;
        for (const int64_t s : evicted_[b]) max_position = std::max(max_position, pos[b * slots + s]);
        digests_[b].reserve(row(b).size() + n, max_position);
      }
    }, [&](const std::string& why) { KVEVICT_CHECK(false, "evict: could not allocate room in the host tier: ", why); });
    for (size_t i = 0; i < row_bytes_.size(); ++i) stride_[i] = RowLayout(buffers[i], buffers[i].dim() - 2).offset(0, 1, 0);
    for (int64_t b = 0; b < B; ++b) {
      for (const int64_t s : evicted_[b]) {
        const float* token_state = st + (b * slots + s) * W_;
        for (size_t i = 0; i < row_bytes_.size(); ++i) {
          const auto* base = static_cast<const uint8_t*>(buffers[i].data_ptr());
          src_[i] = base + RowLayout(buffers[i], buffers[i].dim() - 2).offset(b, 0, s);
        }
        add(b, pos[b * slots + s], rank(token_state), token_state, src_, groups_, stride_);
      }
      if (!evicted_[b].empty()) enforce_budget(b);
    }
  }

  /// Removes the tokens i with drop(i): each one's place takes the last kept token, so a pass
  /// moves O(dropped) rows, not the whole tier (in place: allocates nothing). drop() is asked
  /// about every token once, by its index before any move.
  template <class Drop>
  void remove_if(int64_t b, Drop&& drop) {
    auto& r = row(b);
    auto& dg = digests_[static_cast<size_t>(b)];
    const int64_t n = r.size();
    drop_.assign(static_cast<size_t>(n), 0);  // within the capacity reserve() made: no allocation
    for (int64_t i = 0; i < n; ++i) {
      drop_[static_cast<size_t>(i)] = drop(i) ? 1 : 0;
      if (drop_[static_cast<size_t>(i)]) dg.erase(i, r.position[i]);
    }
    int64_t last = n;  // tokens [0, last) are still candidates
    for (int64_t i = 0; i < last; ++i) {
      if (!drop_[static_cast<size_t>(i)]) continue;
      while (last > i + 1 && drop_[static_cast<size_t>(last - 1)]) --last;  // the last token that stays
      --last;
      if (last == i) break;  // i itself was the last one
      move_token(r, last, i);
      dg.moved(last, i, r.position[i]);
      drop_[static_cast<size_t>(i)] = 0;
    }
    r.position.resize(static_cast<size_t>(last));
    r.rank.resize(static_cast<size_t>(last));
    r.state.resize(static_cast<size_t>(last * W_));
    for (size_t j = 0; j < row_bytes_.size(); ++j) r.bytes[j].resize(static_cast<size_t>(last * row_bytes_[j]));
    dg.refresh([&](int64_t t, float* out) { key_of(b, t, out); });
  }

  void move_token(TierRow& r, int64_t from, int64_t to) {
    r.position[to] = r.position[from];
    r.rank[to] = r.rank[from];
    std::copy(r.state.begin() + from * W_, r.state.begin() + (from + 1) * W_, r.state.begin() + to * W_);
    for (size_t j = 0; j < row_bytes_.size(); ++j) {
      const int64_t rb = row_bytes_[j];
      std::memcpy(r.bytes[j].data() + to * rb, r.bytes[j].data() + from * rb, static_cast<size_t>(rb));
    }
  }

  std::vector<TierRow> rows_;
  int64_t budget_ = 0;
  int64_t W_ = 1;
  std::vector<int64_t> row_bytes_, groups_;
  TierKeys keys_;
  int64_t key_groups_ = 1, key_width_ = 0;
  int64_t recalled_ = 0;
  std::vector<PageDigests> digests_;  // per row
  std::vector<float> key_;            // one token's keys (scratch)
  std::vector<uint8_t> swap_;         // swap_row() scratch: one piece of a row
  std::vector<std::vector<int64_t>> evicted_;  // take() scratch: per row, the evicted slots
  std::vector<const uint8_t*> src_;
  std::vector<int64_t> stride_;
  std::vector<int64_t> order_;  // scratch: enforce_budget()'s token order, pick()'s page order
  std::vector<uint8_t> drop_;
};

}  // namespace detail
}  // namespace kvevict
