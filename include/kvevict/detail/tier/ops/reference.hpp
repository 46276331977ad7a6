#pragma once
// The reference forms of the tier's ops (tier/ops/ops.hpp): ATen composites, the test oracle
// for the compiled kernels (src/kernels/, bodies in tier/ops/bodies.hpp) and what runs where no
// kernel is registered (a header-only build). Same inputs, same outputs, bit for bit.

#include <kvevict/selection.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>

namespace kvevict {
namespace detail {
namespace reference {

/// pick_pages() (tier/ops/ops.hpp has the contract) as tensor ops: the greedy fill with skips
/// as a prefix (a cumsum) up to the first page that does not fit, then, with fewer than a page
/// of tokens left, an automaton over those states composed over the pages by a Hillis-Steele
/// scan (log2 P' gathers of [B, P', min(page_size, K + 1)], P' = min(P, N): only pages with
/// members can be taken, at most one per stored token); the taken pages' tokens by one top-k of
/// (place in pick order, newest first). About 40 + 2 log2 P' ATen calls. No host sync.
inline std::tuple<at::Tensor, at::Tensor> pick_pages(const at::Tensor& scores, const at::Tensor& members_all,
                                                     const at::Tensor& position, const at::Tensor& seq,
                                                     const at::Tensor& limit, int64_t K, int64_t page_size) {
  const int64_t B = position.size(0), N = position.size(1) - 1, P = scores.size(1);
  const int64_t A = std::min(page_size, K + 1), Pm = std::min(P, N);
  const auto longs = position.options();
  auto slots = at::full({B, K}, N, longs);
  if (N == 0 || P == 0 || K == 0) return {slots, at::zeros({B}, longs)};
  const auto members = members_all.narrow(1, 0, P);
  const auto eligible = members.gt(0).logical_and_(scores.gt(0));
  // Pages in pick order; past the first Pm none has members.
  const auto order = std::get<1>(at::sort(scores.masked_fill(eligible.logical_not(), -1.0), /*stable=*/true, 1,
                                          /*descending=*/true)).narrow(1, 0, Pm);
  const auto m = members.gather(1, order).masked_fill_(eligible.gather(1, order).logical_not(), 0);  // pick order
  const auto total = m.cumsum(1);
  const auto lim = limit.unsqueeze(1);
  const auto prefix = total.le(lim);  // a prefix: total only grows
  const auto f = prefix.sum(1, /*keepdim=*/true);  // the first page that does not fit (P: none)
  const auto before_f = total.gather(1, f.sub(1).clamp_min_(0)).masked_fill_(f.eq(0), 0);
  const auto left_f = lim.sub(before_f).clamp_(0, A - 1);  // < A when a page did not fit
  // After f: page p maps the tokens left l to l - m_p if it fits, else l; the pages up to f
  // map l to l. E[p]: the composition of the maps before p, by doubling.
  const auto pages = at::arange(Pm, longs).unsqueeze(0);
  const auto after = pages.gt(f);
  const auto l = at::arange(A, longs).view({1, 1, A});
  const auto mm = m.unsqueeze(2);
  auto F = at::where(after.unsqueeze(2).logical_and(mm.le(l)), l.sub(mm), l.expand({B, Pm, A}));
  const auto identity = l.expand({B, Pm, A});
  for (int64_t d = 1; d < Pm; d *= 2) {
    const auto prev = at::cat({identity.narrow(1, 0, d), F.narrow(1, 0, Pm - d)}, 1);
    F = F.gather(2, prev);
  }
  const auto E = at::cat({identity.narrow(1, 0, 1), F.narrow(1, 0, Pm - 1)}, 1);
  const auto left = E.gather(2, left_f.unsqueeze(2).expand({B, Pm, 1})).squeeze(2);
  const auto taken = prefix.logical_or(after.logical_and(m.le(left))).logical_and_(m.gt(0));
  // Per page id: taken, and its place in the pick order (pages past Pm: never taken).
  const auto taken_id = at::zeros({B, P}, taken.options()).scatter_(1, order, taken);
  const auto place_id = at::full({B, P}, Pm, longs).scatter_(1, order, pages.expand({B, Pm}));
  const auto pos = position.narrow(1, 0, N);
  const auto page = pos.div(page_size, "floor").clamp_(0, P - 1);
  const auto in = taken_id.gather(1, page).logical_and_(pos.ge(0)).logical_and_(pos.lt(P * page_size));
  constexpr int64_t kSeq = int64_t{1} << 40;
  const auto key = place_id.gather(1, page).mul_(kSeq).add_(seq.narrow(1, 0, N).neg().add_(kSeq - 1))
                       .masked_fill_(in.logical_not(), std::numeric_limits<int64_t>::max());
  auto count = in.sum(1);
  const int64_t k = std::min(K, N);
  auto best = std::get<1>(at::topk(key, k, 1, /*largest=*/false, /*sorted=*/true));
  best.masked_fill_(at::arange(k, longs).unsqueeze(0).ge(count.unsqueeze(1)), N);
  slots.narrow(1, 0, k).copy_(best);
  return {slots, count};
}

/// recall_victims() (tier/ops/ops.hpp has the contract) as tensor ops: the candidates' end,
/// then recall_candidates() (one top-k of eviction_keys() and an argmax below 2^32 positions)
/// and a gather of the best one's state.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> recall_victims(const at::Tensor& slot_ranks,
                                                                     const at::Tensor& position,
                                                                     const at::Tensor& state,
                                                                     const at::Tensor& counters,
                                                                     const at::Tensor& latest, int64_t n_sink,
                                                                     int64_t K, int64_t max_seen) {
  const int64_t B = position.size(0), W = state.size(2);
  const auto last = latest.view({B, 1});
  const auto recent_from =
      at::where(last.ge(0), counters.narrow(1, 2, 1).sub(last), at::full({B, 1}, n_sink, position.options()));
  auto c = recall_candidates(slot_ranks, position, n_sink, recent_from, K, max_seen);
  auto top = state.gather(1, c.best.unsqueeze(2).expand({B, 1, W})).squeeze(1);
  return {std::move(c.lowest), std::move(c.count), std::move(top)};
}

/// pool_gather() as tensor ops: the pool's positions, a sort, the keys through the views.
/// `keys_of(slots)`: the keys of store slots [B, R] as [B, R, groups, width] fp32.
template <class KeysOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor> pool_gather(const at::Tensor& slots, const at::Tensor& count,
                                                           const at::Tensor& store_position, KeysOf&& keys_of) {
  const int64_t R = slots.size(1);
  const auto valid = at::arange(R, slots.options()).unsqueeze(0).lt(count.unsqueeze(1));
  const auto position =
      store_position.gather(1, slots).masked_fill_(valid.logical_not(), std::numeric_limits<int64_t>::max());
  const auto by_position = slots.gather(1, std::get<1>(at::sort(position, 1)));
  return {by_position, keys_of(by_position), valid};
}

/// pick_tokens() as tensor ops: a stable sort by score, descending, the count of positive
/// scores up to the limit, the trash slot past it.
inline std::tuple<at::Tensor, at::Tensor> pick_tokens(const at::Tensor& exact, const at::Tensor& valid,
                                                      const at::Tensor& by_position, const at::Tensor& limit, int64_t K,
                                                      int64_t N) {
  const int64_t B = exact.size(0), R = exact.size(1), k = std::min(K, R);
  const auto order = std::get<1>(at::sort(exact.masked_fill(exact.le(0).logical_or_(valid.logical_not()), -1.0),
                                          /*stable=*/true, 1, /*descending=*/true));
  auto count = exact.gt(0).logical_and_(valid).sum(1).minimum(limit);
  auto slots = at::full({B, K}, N, by_position.options());
  auto best = by_position.gather(1, order.narrow(1, 0, k));
  best.masked_fill_(at::arange(k, best.options()).unsqueeze(0).ge(count.unsqueeze(1)), N);
  slots.narrow(1, 0, k).copy_(best);
  return {slots, count};
}

}  // namespace reference
}  // namespace detail
}  // namespace kvevict
