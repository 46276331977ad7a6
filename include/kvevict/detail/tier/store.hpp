#pragma once
// The tier as tensors (TierStore): one layer's host tier, every batch row at once, in tensors of
// fixed shape, so that taking a pass's evicted tokens in, dropping what is over the budget, a
// truncate and the upkeep of the page digests are tensor ops: no host sync, no host read, no
// copy between host and device. It is the tensor path's tier (TierTensorPath); the host path's
// (TierHostPath over TierRow and PageDigests, tier/host_path.hpp) is its reference, token for
// token and page for page.
//
// Per row b, store slots [0, N) hold its tokens in no particular order (position -1: free) and
// slot N is a trash slot that writes of nothing go to. A token's rows sit in host memory (pinned
// on CUDA) and device kernels reach them through a view of that memory (device_view()); its
// position, rank, scorer state and insertion number live on the cache's device. The digests are
// indexed by page id (page = position / page_size), so a page needs no slot of its own: the
// digest memory on the device is (largest position / page_size) x the digest's bytes per row.

#include <kvevict/check.hpp>
#include <kvevict/detail/tier/device_view.hpp>
#include <kvevict/detail/tier/ops/ops.hpp>
#include <kvevict/detail/tier/page_digests.hpp>
#include <kvevict/detail/tier/recall_stages.hpp>
#include <kvevict/detail/tier/writes.hpp>
#include <kvevict/detail/tier/scoring.hpp>
#include <kvevict/selection.hpp>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <limits>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// One layer's tier as tensors, every row at once: the same tokens, ranks, states, rows and page
/// digests as TierHostPath gives for the same calls (test: "the tier as tensors keeps
/// what the host tier keeps").
class TierStore {
 public:
  TierStore() = default;
  /// `batch` rows of at most `budget` tokens each, scorer states of `state_width` floats; per
  /// buffer, `shapes[i]` = {outer..., inner} of one token's rows (a [B, outer..., slots, inner]
  /// buffer's sizes without batch and token dims) in `dtype`; `keys`: which buffers the digests
  /// bound and their page size. Tensors on `device` (the rows in pinned host memory there).
  /// Allocates nothing until the first take().
  TierStore(int64_t batch, int64_t budget, int64_t state_width, std::vector<std::vector<int64_t>> shapes,
            at::ScalarType dtype, TierKeys keys, at::Device device)
      : B_(batch), budget_(budget), W_(state_width), shapes_(std::move(shapes)), dtype_(dtype), keys_(std::move(keys)),
        device_(device), host_(shapes_.size()), view_(shapes_.size()) {
    const auto& first = shapes_.at(keys_.buffers.at(0));
    groups_ = 1;
    for (size_t d = 0; d + 1 < first.size(); ++d) groups_ *= first[d];
    for (const auto i : keys_.buffers) width_ += shapes_.at(i).back();
  }
  // Moved, never assigned: a store lets its pinned rows go only through let_go().
  TierStore(TierStore&&) noexcept = default;
  TierStore& operator=(TierStore&&) = delete;
  TierStore(const TierStore&) = delete;
  TierStore& operator=(const TierStore&) = delete;
  ~TierStore() { let_go(); }

  /// A copy with its own tensors: the device ones cloned, the rows in new (pinned) host memory
  /// with their own device views (allocates; changes nothing). On a GPU it waits for the device
  /// first (a sync: kernels may still write the rows).
  TierStore copied() const {
    wait_for_device();
    TierStore c(B_, budget_, W_, shapes_, dtype_, keys_, device_);
    c.groups_ = groups_;
    c.width_ = width_;
    c.N_ = N_;
    c.P_ = P_;
    c.bound_ = bound_;
    c10::InferenceMode normal_tensors(false);
    const auto clone = [](const at::Tensor& t) { return t.defined() ? t.clone() : t; };
    c.seq_next_ = clone(seq_next_);
    c.pos_ = clone(pos_);
    c.rank_ = clone(rank_);
    c.state_ = clone(state_);
    c.seq_ = clone(seq_);
    c.digest_ = clone(digest_);
    c.members_ = clone(members_);
    for (size_t i = 0; i < host_.size(); ++i) {
      if (!host_[i].defined()) continue;
      c.host_[i] = at::empty_like(host_[i], host_[i].options().pinned_memory(!device_.is_cpu()));
      c.host_[i].copy_(host_[i]);
      c.view_[i] = device_view(c.host_[i], device_);
    }
    return c;
  }

  /// Exchanges everything with `o` (same batch, budget and layout: two copies of one store).
  /// Allocates nothing, does not throw.
  void swap(TierStore& o) noexcept {
    Tensors t;     // empty: the swaps below allocate nothing
    restore(t);    // t: this store's
    o.restore(t);  // o: this store's; t: o's
    restore(t);    // this: o's
  }

  /// Store slots per row (N; the trash slot is one more). Grows geometrically up to the budget.
  int64_t capacity() const noexcept { return N_; }
  /// Page ids the digests have room for per row (the trash page is one more).
  int64_t page_capacity() const noexcept { return P_; }
  const at::Device& device() const noexcept { return device_; }
  int64_t batch() const noexcept { return B_; }
  const TierKeys& keys() const noexcept { return keys_; }
  int64_t key_groups() const noexcept { return groups_; }

  /// A pass's evicted tokens into the tier: of every row b, the cache slots `idx` [B, C] int64
  /// (each row's in the order the host path takes them, which gives their insertion order; a
  /// slot at position -1, the trash slot's, is none), with their positions `position` [B, S]
  /// int64, scorer states `state` [B, S, W] fp32 and rows in `buffers` [B, outer..., S, inner]
  /// (all on the device); `ranks(states)` maps [B, C, W] states to [B, C] fp32 ranks (the
  /// scorer's tensor form). Then each row drops what is over the budget, lowest first in the
  /// eviction order (eviction_order(): lower rank first, equal ranks the older position,
  /// non-finite ranks lowest), its new tokens among the candidates. `max_position`: more than
  /// any position taken (host; sizes the page ids). No host sync, no host read; the shapes of
  /// the ops depend on B, C, the capacity and the page capacity only. Allocates (device; pinned
  /// host memory when it grows), every allocation before the first write but the page
  /// digests' (under the undo log).
  /// Plans the writes into `w` (the pass's commit runs them).
  template <class Ranks>
  void take(TierWrites& w, const at::Tensor& idx, const at::Tensor& position, const at::Tensor& state,
            const std::vector<at::Tensor>& buffers, Ranks&& ranks, int64_t max_position) {
    const int64_t C = idx.size(1);
    if (budget_ == 0 || C == 0) return;
    growing(w, std::min(budget_, bound_ + C), max_position, [&] {
      const int64_t N = N_;
      const auto longs = pos_.options();
      const auto new_pos = position.gather(1, idx);
      const auto new_state = state.gather(1, idx.unsqueeze(2).expand({B_, C, W_}));
      const auto new_rank = ranks(new_state);
      // Candidates: the stored tokens and the new ones; each row keeps its best min(live, budget).
      const auto old_pos = pos_.narrow(1, 0, N);
      const auto cand_pos = at::cat({old_pos, new_pos}, 1);
      const auto live = cand_pos.ge(0);
      const auto kept = live.sum(1).clamp_max_(budget_).unsqueeze(1);  // [B, 1]
      const auto order = eviction_order(at::cat({rank_.narrow(1, 0, N), new_rank}, 1), cand_pos, max_position);
      const auto place = at::empty_like(order).scatter_(1, order, at::arange(N + C, longs).expand({B_, N + C}));
      const auto keep = place.ge(kept.neg().add_(N + C)).logical_and_(live);
      const auto drop_old = keep.narrow(1, 0, N).logical_not().logical_and_(live.narrow(1, 0, N));
      const auto keep_new = keep.narrow(1, N, C);
      // The dropped stored tokens: at most C a row.
      const int64_t k = std::min(N, C);
      const auto dropped = std::get<1>(at::topk(drop_old.to(at::kInt), k, 1));
      const auto is_dropped = drop_old.gather(1, dropped);
      // The kept new tokens go to the free slots after the drops, in order (free slots ascending).
      const auto free_first = std::get<1>(at::sort(old_pos.masked_fill(drop_old, -1).ge(0).to(at::kByte),
                                                   /*stable=*/true, /*dim=*/1, false));
      const auto nth = keep_new.to(at::kLong).cumsum(1).sub_(1).clamp_(0, N - 1);
      const auto slot = free_first.gather(1, nth).masked_fill_(keep_new.logical_not(), N);  // else the trash slot
      // A dropped slot that takes a new token is written once, with the token.
      const auto taken = at::zeros({B_, N + 1}, live.options()).scatter_(1, slot, true);
      const auto freed = dropped.masked_fill(is_dropped.logical_not().logical_or_(taken.gather(1, dropped)), N);
      w.scatter(pos_, 1, at::cat({freed, slot}, 1),
                at::cat({at::full({B_, k}, -1, longs), new_pos.masked_fill(keep_new.logical_not(), -1)}, 1));
      w.scatter(rank_, 1, slot, new_rank);
      w.scatter(state_, 1, slot.unsqueeze(2).expand({B_, C, W_}), new_state);
      w.scatter(seq_, 1, slot, at::arange(C, longs).add_(seq_next_).expand({B_, C}));
      std::vector<at::Tensor> rows(buffers.size());
      for (size_t i = 0; i < buffers.size(); ++i) {
        const auto& buf = buffers[i];
        const int64_t dim = buf.dim() - 2;
        rows[i] = buf.gather(dim, store_index(idx, buf));
        w.scatter(view_[i], dim, store_index(slot, rows[i]), rows[i]);
      }
      w.add(seq_next_, at::full({1}, C, longs));
      // The pages that change: the kept new tokens join theirs; those the dropped ones leave
      // are rebuilt.
      plan_gains(w, page_of(new_pos.masked_fill(keep_new.logical_not(), -1)), keys_of(rows));
      plan_pages(w, page_of(old_pos.gather(1, dropped).masked_fill_(is_dropped.logical_not(), -1)));
      const int64_t bound = std::min(budget_, bound_ + C), before = bound_;
      w.then([this, bound] { bound_ = bound; });
      w.undo([this, before] { bound_ = before; });
    });
  }

  /// A truncate: every row b drops its tokens at positions >= `from`[b] ([B] int64 on the
  /// device; a row not truncated: a position past its tokens). Pages past from's own are left
  /// without members, from's own is rebuilt. No host sync, no host read. Plans the writes into
  /// `w` (the truncate's commit runs them).
  void drop_from(TierWrites& w, const at::Tensor& from) {
    if (N_ == 0) return;
    {
      const auto first = from.div(keys_.page_size, "floor").unsqueeze(1);  // [B, 1]
      const auto gone = pos_.ge(from.unsqueeze(1));
      const auto empty = at::arange(P_ + 1, members_.options()).unsqueeze(0).gt(first);
      w.save(pos_);
      w.save(members_);
      w.then([this, gone] { pos_.masked_fill_(gone, -1); });
      w.then([this, empty] { members_.masked_fill_(empty, 0); });
      plan_pages(w, first.masked_fill(first.ge(P_), -1));
    }
  }

  /// Empties row b (host index) and its pages. Plans the writes into `w`.
  void release(TierWrites& w, int64_t b) {
    if (N_ == 0) return;
    const auto pos = pos_.select(0, b), members = members_.select(0, b);
    w.save(pos);
    w.save(members);
    w.then([pos, members]() mutable {
      pos.fill_(-1);
      members.zero_();
    });
  }

  /// Row b's tokens as host tensors, by ascending position: positions [n] int64, ranks [n]
  /// fp32, states [n, W] fp32 and, per buffer, rows [outer..., n, inner] (`with_rows`; else
  /// none). Reads the device (a sync). For tests and the tier's reads.
  struct Tokens {
    at::Tensor slot, position, rank, state, seq;  // slot: each token's store slot
    std::vector<at::Tensor> rows;
  };
  Tokens tokens(int64_t b, bool with_rows = true) const {
    Tokens t;
    if (N_ == 0) {
      t.slot = t.position = t.seq = at::zeros({0}, at::TensorOptions().dtype(at::kLong));
      t.rank = at::zeros({0});
      t.state = at::zeros({0, W_});
      for (const auto& s : shapes_) {
        if (with_rows) t.rows.push_back(at::zeros(row_shape(s, 0), at::TensorOptions().dtype(dtype_)));
      }
      return t;
    }
    const auto pos = pos_.select(0, b).narrow(0, 0, N_).cpu();
    const auto live = at::nonzero(pos.ge(0)).squeeze(1);
    const auto by_pos = std::get<1>(at::sort(pos.index_select(0, live)));
    const auto slots = live.index_select(0, by_pos);
    const auto on = slots.to(device_);
    t.slot = slots;
    t.position = pos.index_select(0, slots);
    t.rank = rank_.select(0, b).index_select(0, on).cpu();
    t.state = state_.select(0, b).index_select(0, on).cpu();
    t.seq = seq_.select(0, b).index_select(0, on).cpu();
    for (size_t i = 0; i < shapes_.size() && with_rows; ++i) {
      const auto row = host_[i].select(0, b);
      t.rows.push_back(row.index_select(row.dim() - 2, slots));
    }
    return t;
  }

  /// Row b's digest of page `page` ([groups, 2 width] fp32: per group its channels' max, then
  /// min, TierDigest's block) and its members (how many tokens; 0: none, the digest means
  /// nothing) as host tensors. Reads the device.
  std::pair<at::Tensor, int64_t> page(int64_t b, int64_t page) const {
    if (page >= P_) return {at::Tensor(), 0};
    return {digest_[b][page].cpu(), members_[b][page].item<int64_t>()};
  }

  /// recall's pick (TierHostPath::pick()'s, every row at once): per row the pages by `scores`
  /// [B, P] fp64 (per page id, P <= page_capacity(); on the device), higher first, equal
  /// scores the smaller page id, a score of 0 or a page without members never; each whole page
  /// that still fits in `limit` [B] int64 (device) tokens is taken (limit <= K, or K >=
  /// capacity()). Returns Pick: the taken pages' tokens as store slots [B, K] int64 in recall
  /// order (page by page, a page's tokens newest first: the host list's order), columns past
  /// `count` [B] int64 holding the trash slot: ops::pick_pages(), one compiled op or its
  /// reference. No host sync.
  Pick pick(const at::Tensor& scores, const at::Tensor& limit, int64_t K) const {
    if (N_ == 0 || scores.size(1) == 0 || K == 0) return picked(at::Tensor(), at::Tensor(), K, true);
    auto out = ops::pick_pages(scores, members_, pos_, seq_, limit, K, keys_.page_size);
    return {std::move(std::get<0>(out)), std::move(std::get<1>(out)), true};
  }

  /// Two-level recall's pool (pick()'s `pool`, R columns) by ascending position, with its keys
  /// and valid columns (ops::pool_gather(): by_position [B, R] int64, keys [B, R, groups, width]
  /// fp32, valid [B, R] bool). No host sync.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> pool(const Pick& pool) const {
    return ops::pool_gather(pool.slots, pool.count, pos_, view_, keys_.buffers, groups_,
                            [this](const at::Tensor& slots) { return keys(slots); });
  }

  /// A pick of the store slots `slots` [B, k] int64 in recall order (k <= K), `count` [B] int64
  /// of them a row (device): as [B, K], columns past a row's count on the trash slot.
  /// `whole_pages`: every page it takes from is taken whole. Undefined slots: nothing taken.
  Pick picked(at::Tensor slots, at::Tensor count, int64_t K, bool whole_pages) const {
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device_);
    Pick out;
    out.whole_pages = whole_pages;
    if (!slots.defined()) {
      out.slots = at::full({B_, K}, N_, longs);
      out.count = at::zeros({B_}, longs);
      return out;
    }
    const int64_t k = slots.size(1);
    slots.masked_fill_(at::arange(k, longs).unsqueeze(0).ge(count.unsqueeze(1)), N_);
    out.slots = k == K ? slots : at::cat({slots, at::full({B_, K - k}, N_, longs)}, 1);
    out.count = std::move(count);
    return out;
  }

  /// scale * (the digest's bound) of `query` [B, H, Q, D] (fp32, on the device) on every page
  /// id: [B, G, M, P] fp32 (P = page_capacity()). Latent G = 1, M = H Q: every head's query
  /// meets the shared keys; expanded G = H, M = Q: head h's queries meet head h's keys. No sync.
  at::Tensor bound(const at::Tensor& query, double scale) const {
    const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
    const auto q = groups_ == 1 ? query.reshape({B, 1, H * Q, D}) : query;  // [B, G, M, D]
    return TierDigest::bound(digest_.narrow(1, 0, P_), q, scale);
  }

  /// Page scores from `bound` [B, G, M, P] fp32 (bound(), or a mean of bounds over heads):
  /// per query a softmax over the row's pages with members, summed as fixed-point terms
  /// (fixed_terms, exact in fp64 in any order) over the queries whose `cols` [B, 1|G, M, 1]
  /// bool is set (columns()): [B, P] fp64 by page id, 0 for a page without members and for a
  /// row without real queries. No sync.
  at::Tensor scores_of(at::Tensor bound, const at::Tensor& cols) const {
    return softmax_sums(std::move(bound), members_.narrow(1, 0, P_).eq(0).view({B_, 1, 1, P_}), cols);
  }

  /// The query columns scores_of() counts for `real` [B, Q] bool (on the device; the columns
  /// observe() counts) and bounds of H heads' queries in G key groups: [B, 1|G, M, 1] bool, M =
  /// H Q for G = 1.
  static at::Tensor columns(const at::Tensor& real, int64_t H, int64_t G) {
    const int64_t B = real.size(0), Q = real.size(1);
    return (G == 1 ? real.unsqueeze(1).expand({B, H, Q}).reshape({B, 1, H * Q}) : real.unsqueeze(1)).unsqueeze(3);
  }

  /// recall's swap: the tier tokens `picked` (pick(): store slots [B, K], `count` of them a row)
  /// and the cache slots `victims` [B, K] int64 (the lowest-ranked candidates in eviction
  /// order: column k's victim makes room for column k's token) exchange places. Into the
  /// victims' slots of `buffers` [B, outer..., S, inner] go the tokens' rows, read through the
  /// view; the policy's positions and states (`position` [B, S], `state` [B, S, W], read)
  /// change through `exchange(slots, positions, states)` only, the recalled tokens getting
  /// `top` [B, W] fp32 (the best-ranked candidate's state); the victims take the tokens' store
  /// slots with their positions, states, ranks (`ranks`) and rows, newest in insertion order,
  /// and the pages on both sides are rebuilt. Columns past a row's count write the trash slots
  /// (the cache's S - 1, the store's N) with what they hold. `max_position`: more than any
  /// position of the cache (host). No host sync, no host read; every allocation but the page
  /// digests' before the first write, and a throw puts back what was written (the policy's
  /// side through exchange()).
  /// Plans the writes into `w`; its commit runs them.
  template <class Ranks, class Exchange>
  void swap(TierWrites& w, const Pick& picked, const at::Tensor& victims, const at::Tensor& top, const at::Tensor& position,
            const at::Tensor& state, const std::vector<at::Tensor>& buffers, Ranks&& ranks, Exchange&& exchange,
            int64_t max_position, const at::Tensor& recalled) {
    const int64_t K = victims.size(1), S = position.size(1);
    if (K == 0 || N_ == 0) return;
    growing(w, N_, max_position, [&] {
      if (ops::recall_swap_compiled(position, state, buffers, keys_.buffers)) {
        // One compiled op, which writes now (it cannot fail once its scratch is allocated):
        // nothing joins the undo log but the store's growth.
        const auto slot_ranks = ranks(state);
        ops::recall_swap(picked.slots, picked.count, victims, top, slot_ranks, picked.whole_pages, keys_.page_size,
                         keys_.buffers, position, state, buffers, view_, pos_, rank_, state_, seq_, seq_next_, digest_,
                         members_, recalled);
        return;
      }
      // The reference form: tensor ops planned into `w`.
      w.add(recalled, picked.count.sum().view({1}));
      const auto longs = pos_.options();
      const auto pad = at::arange(K, longs).unsqueeze(0).ge(picked.count.unsqueeze(1));  // [B, K]
      const auto ix = victims.masked_fill(pad, S - 1);
      const auto ts = picked.slots;
      const auto ix_state = ix.unsqueeze(2).expand({B_, K, W_});
      const auto out_pos = position.gather(1, ix), out_state = state.gather(1, ix_state);
      const auto in_pos = at::where(pad, out_pos, pos_.gather(1, ts));
      const auto in_state = at::where(pad.unsqueeze(2), out_state, top.unsqueeze(1).expand({B_, K, W_}));
      std::vector<at::Tensor> out_rows(buffers.size());
      for (size_t i = 0; i < buffers.size(); ++i) {
        const auto& buf = buffers[i];
        const int64_t dim = buf.dim() - 2;
        const auto index = store_index(ix, buf);
        const auto out = out_rows[i] = buf.gather(dim, index);
        std::vector<int64_t> shape(static_cast<size_t>(buf.dim()), 1);
        shape[0] = B_;
        shape[static_cast<size_t>(dim)] = K;
        const auto in = at::where(pad.view(shape), out, view_[i].gather(dim, store_index(ts, view_[i], K)));
        w.scatter(buf, dim, index, in);
        w.scatter(view_[i], dim, store_index(ts, out), out);
      }
      const auto exchange_back = [&exchange, ix, out_pos, out_state] { exchange(ix, out_pos, out_state); };
      w.undo(exchange_back);
      w.then([&exchange, ix, in_pos, in_state] { exchange(ix, in_pos, in_state); });
      w.scatter(pos_, 1, ts, out_pos.masked_fill(pad, -1));
      w.scatter(rank_, 1, ts, ranks(out_state));
      w.scatter(state_, 1, ts.unsqueeze(2).expand({B_, K, W_}), out_state);
      w.scatter(seq_, 1, ts, at::arange(K, longs).add_(seq_next_).expand({B_, K}));
      w.add(seq_next_, at::full({1}, K, longs));
      // The pages that change: those the recalled tokens leave are emptied (whole pages) or
      // rebuilt after the victims join theirs (some pages in part).
      const auto left = page_of(in_pos.masked_fill(pad, -1)), joined = page_of(out_pos.masked_fill(pad, -1));
      if (picked.whole_pages) plan_emptied(w, left);
      plan_gains(w, joined, keys_of(out_rows));
      if (!picked.whole_pages) plan_pages(w, left);
    });
  }

  /// Every row empty and the store's memory given back (reset()): the tensors let go, so the
  /// next take() allocates afresh. Allocates nothing; does not throw. On a GPU it waits for the
  /// device first (a sync: kernels may still use the pinned rows).
  void clear() noexcept {
    let_go();
    N_ = P_ = bound_ = 0;
    pos_ = rank_ = state_ = seq_ = seq_next_ = digest_ = members_ = at::Tensor();
    for (auto& t : host_) t = at::Tensor();
    for (auto& t : view_) t = at::Tensor();
  }

  /// Tokens held, summed over rows (reads the device).
  int64_t tokens() const { return N_ == 0 ? 0 : pos_.narrow(1, 0, N_).ge(0).sum().item<int64_t>(); }
  /// Row b's tokens at positions >= `from` (reads the device).
  int64_t count_from(int64_t b, int64_t from) const {
    return N_ == 0 ? 0 : pos_.select(0, b).narrow(0, 0, N_).ge(from).sum().item<int64_t>();
  }
  /// Host bytes the store holds: every buffer's rows, pinned (N + 1 slots a row, held or not).
  int64_t host_bytes() const {
    int64_t n = 0;
    for (const auto& t : host_) n += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
    return n;
  }
  /// Device bytes the store holds: positions, ranks, states, insertion numbers, page digests
  /// and members.
  int64_t device_bytes() const {
    int64_t n = 0;
    for (const auto* t : {&pos_, &rank_, &state_, &seq_, &seq_next_, &digest_, &members_})
      n += t->defined() ? static_cast<int64_t>(t->nbytes()) : 0;
    return n;
  }

  /// Keys of the store slots `slots` [B, n] int64 (device): [B, n, groups, width] fp32, the
  /// key buffers' rows side by side, read through the view. Allocates.
  at::Tensor keys(const at::Tensor& slots) const {
    std::vector<at::Tensor> rows(view_.size());
    for (const auto i : keys_.buffers) rows[i] = view_[i].gather(view_[i].dim() - 2, store_index(slots, view_[i], slots.size(1)));
    return keys_of(rows);
  }

  /// The keys of `rows` (per buffer [B, outer..., n, inner], defined for the key buffers):
  /// [B, n, groups, width] fp32, the key buffers' rows side by side. Allocates.
  at::Tensor keys_of(const std::vector<at::Tensor>& rows) const {
    std::vector<at::Tensor> parts;
    for (const auto i : keys_.buffers) {
      const int64_t dim = rows[i].dim() - 2, n = rows[i].size(dim);
      parts.push_back(rows[i].movedim(dim, 1).reshape({B_, n, groups_, -1}).to(at::kFloat));  // [B, n, outer..., inner]
    }
    return parts.size() == 1 ? parts[0] : at::cat(parts, -1);
  }

  /// Makes room for `tokens` a row (at most the budget) and positions below `max_position`, so
  /// that take() and swap() allocate no store until then: a graph captured afterwards stays
  /// valid. Joins `w`: kept when w runs, given back when it does not or its commit fails.
  /// Allocates (device, pinned host memory).
  void reserve(TierWrites& w, int64_t tokens, int64_t max_position) {
    growing(w, tokens, max_position, [] {});
  }

 private:
  /// Makes room for `tokens` a row (at most the budget) and positions below `max_position`,
  /// growing geometrically into new tensors with the old ones copied in (a graph captured before
  /// must be captured again). Allocates (device, pinned host memory).
  void grow_to(int64_t tokens, int64_t max_position) {
    tokens = std::min(tokens, budget_);
    const int64_t pages = (max_position - 1) / keys_.page_size + 1;
    if (tokens <= N_ && pages <= P_ && seq_next_.defined()) return;
    if (tokens > N_) wait_for_device();  // the old pinned rows are copied on the host, then let go
    const auto opts = at::TensorOptions().device(device_);
    // Every allocation and copy into new tensors first, then the swap (which cannot throw).
    const int64_t N = tokens > N_ ? std::min(budget_, std::max(tokens, 2 * N_)) : N_;
    const int64_t P = pages > P_ ? std::max(pages, 2 * P_) : P_;
    const auto widen = [&](const at::Tensor& old, at::Tensor fresh, int64_t dim, int64_t n) {
      if (n > 0) fresh.narrow(dim, 0, n).copy_(old.narrow(dim, 0, n));
      return fresh;
    };
    auto seq_next = seq_next_.defined() ? seq_next_ : at::zeros({1}, opts.dtype(at::kLong));
    auto pos = pos_, rank = rank_, state = state_, seq = seq_, digest = digest_, members = members_;
    auto host = host_, view = view_;
    if (N > N_) {
      pos = widen(pos_, at::full({B_, N + 1}, -1, opts.dtype(at::kLong)), 1, N_);
      rank = widen(rank_, at::zeros({B_, N + 1}, opts.dtype(at::kFloat)), 1, N_);
      state = widen(state_, at::zeros({B_, N + 1, W_}, opts.dtype(at::kFloat)), 1, N_);
      seq = widen(seq_, at::zeros({B_, N + 1}, opts.dtype(at::kLong)), 1, N_);
      for (size_t i = 0; i < shapes_.size(); ++i) {
        auto shape = row_shape(shapes_[i], N + 1);
        shape.insert(shape.begin(), B_);
        const auto h = at::zeros(shape, at::TensorOptions().dtype(dtype_).pinned_memory(!device_.is_cpu()));
        host[i] = widen(host_[i], h, h.dim() - 2, N_);
        view[i] = device_view(host[i], device_);
      }
    }
    if (P > P_) {
      digest = widen(digest_, at::zeros({B_, P + 1, groups_, 2 * width_}, opts.dtype(at::kFloat)), 1, P_);
      members = widen(members_, at::zeros({B_, P + 1}, opts.dtype(at::kLong)), 1, P_);
    }
    seq_next_ = std::move(seq_next);
    pos_ = std::move(pos);
    rank_ = std::move(rank);
    state_ = std::move(state);
    seq_ = std::move(seq);
    digest_ = std::move(digest);
    members_ = std::move(members);
    host_.swap(host);
    view_.swap(view);
    N_ = N;
    P_ = P;
  }
  /// Waits for the work queued on the device's current stream (a sync; on the CPU, or with no
  /// rows yet, nothing): kernels write the pinned rows through their views, so the host must
  /// not read them, nor let the host allocator hand them on, before those kernels are done.
  /// Throws what the device reports.
  void wait_for_device() const {
    if (!device_.is_cpu() && seq_next_.defined() && !host_.empty() && host_[0].defined()) (void)seq_next_.item<int64_t>();
  }
  /// wait_for_device() before the pinned rows go (clear(), the destructor); a failure to wait
  /// is let pass (the device is then lost anyway). Does not throw.
  void let_go() noexcept {
    try {
      wait_for_device();
    } catch (...) {
    }
  }

  /// {outer..., n, inner}.
  static std::vector<int64_t> row_shape(const std::vector<int64_t>& s, int64_t n) {
    std::vector<int64_t> out(s.begin(), s.end() - 1);
    out.push_back(n);
    out.push_back(s.back());
    return out;
  }

  /// `slots` [B, n] as a gather/scatter index of `buf`'s token dim (the second to last), for
  /// [B, outer..., n, inner]: a view.
  static at::Tensor store_index(const at::Tensor& slots, const at::Tensor& buf, int64_t n = -1) {
    std::vector<int64_t> shape(static_cast<size_t>(buf.dim()), 1), sizes = buf.sizes().vec();
    shape[0] = slots.size(0);
    shape[buf.dim() - 2] = sizes[buf.dim() - 2] = n < 0 ? slots.size(1) : n;
    return slots.view(shape).expand(sizes);
  }

  /// Page ids of positions `pos` (-1, none: -1).
  at::Tensor page_of(const at::Tensor& pos) const {
    return pos.div(keys_.page_size, "floor").masked_fill_(pos.lt(0), -1);
  }

  /// What reserve() replaces: the tensors, their sizes and the bound.
  struct Tensors {
    int64_t N = 0, P = 0, bound = 0;
    at::Tensor pos, rank, state, seq, seq_next, digest, members;
    std::vector<at::Tensor> host, view;
  };
  Tensors tensors() const {
    return {N_, P_, bound_, pos_, rank_, state_, seq_, seq_next_, digest_, members_, host_, view_};
  }
  /// Puts `t` back (swaps: allocates nothing, does not throw).
  void restore(Tensors& t) noexcept {
    std::swap(N_, t.N);
    std::swap(P_, t.P);
    std::swap(bound_, t.bound);
    std::swap(pos_, t.pos);
    std::swap(rank_, t.rank);
    std::swap(state_, t.state);
    std::swap(seq_, t.seq);
    std::swap(seq_next_, t.seq_next);
    std::swap(digest_, t.digest);
    std::swap(members_, t.members);
    host_.swap(t.host);
    view_.swap(t.view);
  }

  /// grow_to(tokens, max_position), then `plan()` of writes into `w`, all or nothing: a throw
  /// of either, or of w's commit, puts the store's tensors back as they were (a grown store is
  /// not kept, as a cache's grown buffers are not).
  template <class Plan>
  void growing(TierWrites& w, int64_t tokens, int64_t max_position, Plan&& plan) {
    auto before = tensors();  // allocates (the buffers' lists)
    try {
      grow_to(tokens, max_position);
      if (N_ != before.N || P_ != before.P || !before.seq_next.defined()) {
        // Put back once: on a failed commit (the undo log), or when the writes never run.
        auto grown = std::make_shared<std::pair<Tensors, bool>>(before, false);
        const auto put_back = [this, grown]() noexcept {
          if (grown->second) return;
          grown->second = true;
          restore(grown->first);
        };
        w.undo(put_back);
        w.abandon(put_back);
      }
      plan();
    } catch (...) {
      restore(before);
      throw;
    }
  }

  /// Plans into `w`, after its writes so far: the tokens of `pages` [B, T] (-1: none; duplicates
  /// allowed), whose keys are `keys` [B, T, groups, width] fp32, join their pages: members + 1,
  /// and per channel the max with the digest's max and the min with its min, NaN keys left
  /// out (a page without members starts from none). Exact: what rebuild() would give. Keeps
  /// their old values.
  void plan_gains(TierWrites& w, const at::Tensor& pages, const at::Tensor& keys) {
    const auto at_page = flat_page_ids(pages);
    const int64_t n = at_page.size(0);
    const auto digest = digest_.view({-1, groups_, 2 * width_}), members = members_.view(-1);
    const auto ix = at_page.view({-1, 1, 1}).expand({n, groups_, width_});
    w.keep(digest, 0, at_page.view({-1, 1, 1}).expand({n, groups_, 2 * width_}));
    w.keep(members, 0, at_page);
    const auto k = keys.reshape({n, groups_, width_});
    const auto nan = at::isnan(k);
    const float inf = std::numeric_limits<float>::infinity();
    const auto hi = k.masked_fill(nan, -inf), lo = k.masked_fill(nan, inf);
    const auto none = at::cat({at::full({1, groups_, width_}, -inf, hi.options()), at::full({1, groups_, width_}, inf, hi.options())}, -1);
    const auto one = pages.ge(0).to(at::kLong).view(-1);
    w.then([this, at_page, ix, hi, lo, none, one] {
      auto digest = digest_.view({-1, groups_, 2 * width_});
      auto members = members_.view(-1);
      const auto was_empty = members.index_select(0, at_page).eq(0).view({-1, 1, 1});
      digest.index_copy_(0, at_page, at::where(was_empty, none, digest.index_select(0, at_page)));
      digest.narrow(2, 0, width_).scatter_reduce_(0, ix, hi, "amax");
      digest.narrow(2, width_, width_).scatter_reduce_(0, ix, lo, "amin");
      members.scatter_add_(0, at_page, one);
    });
  }

  /// Plans into `w`: the pages `pages` [B, T] (-1: none; duplicates allowed), every token of
  /// which has left, without members (their digests mean nothing). Keeps their old values.
  void plan_emptied(TierWrites& w, const at::Tensor& pages) {
    const auto at_page = flat_page_ids(pages);
    w.scatter(members_.view(-1), 0, at_page, at::zeros_like(at_page));
  }

  /// `pages` [B, T] (-1: none; duplicates allowed) as indices into the rows of the digests
  /// flattened to [B (P + 1), ...]: [B T] int64, duplicates kept, none on its row's trash page.
  at::Tensor flat_page_ids(const at::Tensor& pages) const {
    return pages.masked_fill(pages.lt(0).logical_or_(pages.ge(P_)), P_).add_(at::arange(B_, pages.options()).mul_(P_ + 1).unsqueeze(1)).view(-1);
  }

  /// Plans into `w`, after its writes so far: the digests and members of the pages `pages` [B,
  /// T] (-1: none; duplicates allowed) rebuilt from their members (rebuild(), which allocates
  /// inside the commit); keeps their old values.
  void plan_pages(TierWrites& w, const at::Tensor& pages) {
    const auto at_page = flat_pages(pages);
    const auto digest = digest_.view({-1, groups_, 2 * width_}), members = members_.view(-1);
    w.keep(digest, 0, at_page.view({-1, 1, 1}).expand({at_page.size(0), groups_, 2 * width_}));  // rebuild() writes them
    w.keep(members, 0, at_page);
    w.then([this, pages, at_page] { rebuild(pages, at_page); });
  }

  /// `pages` [B, T] (-1: none; duplicates allowed) as indices into the rows of the digests
  /// flattened to [B (P + 1), ...]: [B T] int64, each page once, the others on their row's trash
  /// page. Allocates.
  at::Tensor flat_pages(const at::Tensor& pages) const {
    const int64_t T = pages.size(1);
    auto page = std::get<0>(at::sort(pages, 1));
    if (T > 1) page.narrow(1, 1, T - 1).masked_fill_(page.narrow(1, 1, T - 1).eq(page.narrow(1, 0, T - 1)), -1);
    return flat_page_ids(page);
  }

  /// Rebuilds the digests and members of the pages `at_page` (flat_pages() of `pages`) from
  /// their members: a sort of the store by position, each page's members at most page_size in
  /// a row from its first (searchsorted), their keys read through the view, max and min per
  /// channel (NaN keys left out, as the host's rebuild does). No host sync.
  void rebuild(const at::Tensor& pages, const at::Tensor& at_page) {
    const int64_t T = pages.size(1), ps = keys_.page_size, N = N_, S = std::min(ps, N);
    const auto longs = pos_.options();
    const auto page = at_page.view({B_, T}).sub(at::arange(B_, longs).mul_(P_ + 1).unsqueeze(1));  // P_: none
    const auto pos = pos_.narrow(1, 0, N);
    const auto by_pos = at::sort(pos.masked_fill(pos.lt(0), std::numeric_limits<int64_t>::max()), 1);
    const auto& sorted = std::get<0>(by_pos);
    const auto first = at::searchsorted(sorted, page.mul(ps));  // [B, T]
    const auto j = first.unsqueeze(2).add(at::arange(S, longs)).view({B_, T * S});
    const auto jc = j.clamp_max(N - 1);
    const auto member_pos = sorted.gather(1, jc).view({B_, T, S});
    const auto member = j.view({B_, T, S}).lt(N)
                            .logical_and_(member_pos.lt(page.add(1).mul_(ps).unsqueeze(2)))
                            .logical_and_(page.lt(P_).unsqueeze(2));
    const auto keys = this->keys(std::get<1>(by_pos).gather(1, jc)).view({B_, T, S, groups_, width_});
    const auto out = member.logical_not().view({B_, T, S, 1, 1}).logical_or(at::isnan(keys));
    const float inf = std::numeric_limits<float>::infinity();
    const auto hi = keys.masked_fill(out, -inf).amax(2), lo = keys.masked_fill(out, inf).amin(2);
    digest_.view({B_ * (P_ + 1), groups_, 2 * width_}).index_copy_(0, at_page, at::cat({hi, lo}, -1).view({B_ * T, groups_, 2 * width_}));
    members_.view(-1).index_copy_(0, at_page, member.sum(2).view(-1));
  }

  int64_t B_ = 0, budget_ = 0, W_ = 1;
  std::vector<std::vector<int64_t>> shapes_;
  at::ScalarType dtype_ = at::kFloat;
  TierKeys keys_;
  at::Device device_ = at::kCPU;
  int64_t groups_ = 1, width_ = 0;
  int64_t N_ = 0, P_ = 0;      // store slots and page ids per row (each + 1: the trash)
  int64_t bound_ = 0;          // at most this many tokens in any row (host; sizes the store)
  at::Tensor seq_next_;        // [1] int64 on the device: the next token's insertion number
  at::Tensor pos_, rank_, state_, seq_;  // [B, N + 1] (state: [B, N + 1, W]) on the device; pos -1: free
  std::vector<at::Tensor> host_, view_;  // per buffer: [B, outer..., N + 1, inner] rows (pinned), its device view
  at::Tensor digest_, members_;          // [B, P + 1, groups, 2 width] fp32, [B, P + 1] int64, by page id
};

}  // namespace detail
}  // namespace kvevict
