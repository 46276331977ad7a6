// Field cases: faults that other KV-eviction implementations shipped (degenerate sizes, ties,
// scores summed over the batch, folded heads, K/V widths, positions, RoPE dims, the newest
// token, the window size, devices, prefill compression, non-finite scores), each as a small
// input with its hand-worked answer. The functions keep the cases' numbers (case_4b, ...). Each
// case body takes the device; CPU tests run it on the default host path and on the tensor-op
// path (ForceTensorPath), the [cuda] tests on the GPU. Capacity 0 rejected, naming the three
// values, is in test_options.cpp ("EvictionOptions rejects bad values naming them").
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

using Catch::Matchers::Contains;
using kvevict::EvictionOptions;
using kvevict::MlaCache;
using kvevict::MlaCacheOptions;
using kvevict_test::to_vec;

namespace {

using Positions = std::vector<int64_t>;
using Rows = std::vector<std::vector<float>>;  // [B][S] per-row scores

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kQk = 8, kV = 4;  // small widths where the case does not ask for 192/128

MlaCache make_cache(const EvictionOptions& e, int64_t B, int64_t H, at::Device device = at::kCPU,
                    at::ScalarType dtype = at::kFloat, bool check_finite = true, int64_t qk = kQk, int64_t vd = kV) {
  return MlaCache(MlaCacheOptions(1, H).batch_size(B).qk_dim(qk).v_dim(vd).dtype(dtype).device(device).check_observations(
                      check_finite),
                  e);
}

at::Tensor rows_tensor(const Rows& r) {
  std::vector<float> flat;
  for (const auto& row : r) flat.insert(flat.end(), row.begin(), row.end());
  return at::tensor(flat).view({static_cast<int64_t>(r.size()), static_cast<int64_t>(r[0].size())});
}

// Observes per-row scores as the attention of one query, identical on every head. Attention
// must be a probability in [0, 1], so the scores are divided by 16 (exact in binary): the
// cumulative score of each token is exactly the given value / 16, and the ranking is the same.
constexpr float kObserveScale = 16.f;
void observe_scores(MlaCache& c, const Rows& r) {
  const auto s = rows_tensor(r).div(kObserveScale);
  c.observe(0, s.view({s.size(0), 1, 1, s.size(1)}).expand({s.size(0), c.num_heads(), 1, s.size(1)}).to(c.device()));
}

void add_scores(MlaCache& c, const Rows& r) { c.add_scores(0, rows_tensor(r).to(c.device())); }

// Random fp32 K/V for `S` positions, on the CPU: k [B, H, S, kQk], v [B, H, S, kV].
std::pair<at::Tensor, at::Tensor> random_kv(int64_t B, int64_t H, int64_t S) {
  return {at::randn({B, H, S, kQk}), at::randn({B, H, S, kV})};
}

// Appends positions [from, from + T) of the full inputs.
void update(MlaCache& c, const at::Tensor& k_all, const at::Tensor& v_all, int64_t from, int64_t T) {
  c.update(0, k_all.narrow(2, from, T).to(c.device()), v_all.narrow(2, from, T).to(c.device()));
}

Positions ordered_positions(const MlaCache& c, int64_t b = 0) { return to_vec<int64_t>(c.ordered(0).positions[b]); }

// Every live slot holds a bit-exact copy of the input K/V rows of the position it reports, for
// every row and head; ordered() gives the same rows in ascending position order.
// k_all [B, H, N, qk], v_all [B, H, N, vd] on the CPU hold position p at index p.
void check_rows_exact(const MlaCache& c, const at::Tensor& k_all, const at::Tensor& v_all) {
  const auto keys = c.keys(0).cpu(), values = c.values(0).cpu();
  const auto o = c.ordered(0);
  for (int64_t b = 0; b < c.batch_size(); ++b) {
    const auto pos = to_vec<int64_t>(c.positions(0)[b]);
    for (size_t s = 0; s < pos.size(); ++s) {
      INFO("row " << b << ", slot " << s << ", position " << pos[s]);
      REQUIRE(at::equal(keys[b].select(1, s), k_all[b].select(1, pos[s])));
      REQUIRE(at::equal(values[b].select(1, s), v_all[b].select(1, pos[s])));
    }
    const auto idx = o.positions[b].cpu();
    const auto sorted = to_vec<int64_t>(idx);
    CHECK(std::is_sorted(sorted.begin(), sorted.end()));
    CHECK(at::equal(o.keys[b].cpu(), k_all[b].index_select(1, idx)));
    CHECK(at::equal(o.values[b].cpu(), v_all[b].index_select(1, idx)));
  }
}

// The whole observable state of layer 0, to check that a call that threw changed nothing.
struct Snapshot {
  int64_t size, seen, events, evicted;
  at::Tensor positions, scores, keys, values;
};

Snapshot snapshot(const MlaCache& c) {
  const auto st = c.stats(0);
  return {c.size(0),
          c.seen_tokens(0),
          st.eviction_events,
          st.tokens_evicted,
          c.positions(0).clone(),
          c.scores(0),
          c.keys(0).clone(),
          c.values(0).clone()};
}

void check_unchanged(const MlaCache& c, const Snapshot& s) {
  CHECK(c.size(0) == s.size);
  CHECK(c.seen_tokens(0) == s.seen);
  CHECK(c.stats(0).eviction_events == s.events);
  CHECK(c.stats(0).tokens_evicted == s.evicted);
  CHECK(at::equal(c.positions(0), s.positions));
  CHECK(at::equal(c.scores(0), s.scores));
  CHECK(at::equal(c.keys(0), s.keys));
  CHECK(at::equal(c.values(0), s.values));
}


Positions keep_indices_row(const EvictionOptions& e, const Rows& r, at::Device device, int64_t b = 0) {
  return to_vec<int64_t>(kvevict::Selection(e).keep_indices(rows_tensor(r).to(device))[b]);
}

// ---- case bodies ------------------------------------------------------------------------

// 1a. B=1, H=2, S=3, n_sink=4, budget=8, n_recent=4: nothing evicted; K/V bit-identical.
void case_1a(at::Device device) {
  at::manual_seed(101);
  const auto e = EvictionOptions(8).n_sink(4).n_recent(4);
  auto c = make_cache(e, 1, 2, device);
  const auto kv = random_kv(1, 2, 17);
  update(c, kv.first, kv.second, 0, 3);
  observe_scores(c, {{3, 1, 2}});
  CHECK(c.evict(0) == 0);
  CHECK(c.size(0) == 3);
  CHECK(ordered_positions(c) == Positions{0, 1, 2});
  CHECK(at::equal(c.keys(0).cpu(), kv.first.narrow(2, 0, 3)));
  CHECK(at::equal(c.values(0).cpu(), kv.second.narrow(2, 0, 3)));
  CHECK(at::equal(c.ordered(0).keys.cpu(), kv.first.narrow(2, 0, 3)));
  CHECK(c.stats().eviction_events == 0);
  CHECK(keep_indices_row(e, {{3, 1, 2}}, device) == Positions{0, 1, 2});
  // Up to capacity (16) still nothing; the 17th token is the first eviction.
  for (int64_t p = 3; p < 16; ++p) {
    update(c, kv.first, kv.second, p, 1);
    CHECK(c.evict(0) == 0);
  }
  check_rows_exact(c, kv.first, kv.second);
  update(c, kv.first, kv.second, 16, 1);
  CHECK(c.evict(0) == 1);
  CHECK(c.size(0) == 16);
}

// 1b. n_recent=0, S=10, n_sink=1, budget=2, scores [9,1,7,2,8,3,0,4,5,6]: kept [0,2,4].
void case_1b(at::Device device) {
  at::manual_seed(102);
  const auto e = EvictionOptions(2).n_sink(1).n_recent(0);
  const Rows scores = {{9, 1, 7, 2, 8, 3, 0, 4, 5, 6}};
  auto c = make_cache(e, 1, 2, device);
  const auto kv = random_kv(1, 2, 10);
  update(c, kv.first, kv.second, 0, 10);
  observe_scores(c, scores);
  CHECK(c.evict(0) == 7);
  CHECK(c.size(0) == 3);
  CHECK(ordered_positions(c) == Positions{0, 2, 4});
  check_rows_exact(c, kv.first, kv.second);
  CHECK(keep_indices_row(e, scores, device) == Positions{0, 2, 4});
}

// 2a. S=12, n_sink=2, budget=3, n_recent=2, all scores equal: kept [0,1,7,8,9,10,11].
void case_2a(at::Device device) {
  const auto e = EvictionOptions(3).n_sink(2).n_recent(2);
  const Positions expected = {0, 1, 7, 8, 9, 10, 11};
  for (int variant = 0; variant < 3; ++variant) {
    INFO("variant " << variant << " (0: never observed, 1: uniform 1/12, 2: all 1)");
    auto c = make_cache(e, 1, 2, device);
    const auto kv = random_kv(1, 2, 12);
    update(c, kv.first, kv.second, 0, 12);
    if (variant > 0) observe_scores(c, {std::vector<float>(12, variant == 1 ? 1.f / 12 : 1.f)});
    CHECK(c.evict(0) == 5);
    CHECK(ordered_positions(c) == expected);
    check_rows_exact(c, kv.first, kv.second);
  }
  CHECK(keep_indices_row(e, {std::vector<float>(12, 0.5f)}, device) == expected);
}

// 2b. S=10, n_sink=1, budget=2, n_recent=1, scores at positions 1..8 = [4,2,2,2,2,2,2,1]:
// kept [0,1,7,9], identical over 100 runs.
const Rows kScores2b = {{0, 4, 2, 2, 2, 2, 2, 2, 1, 0}};
const auto kOptions2b = EvictionOptions(2).n_sink(1).n_recent(1);

Positions run_2b(at::Device device) {
  auto c = make_cache(kOptions2b, 1, 2, device);
  const auto kv = random_kv(1, 2, 10);
  update(c, kv.first, kv.second, 0, 10);
  observe_scores(c, kScores2b);
  CHECK(c.evict(0) == 6);
  check_rows_exact(c, kv.first, kv.second);
  return ordered_positions(c);
}

void case_2b(at::Device device) {
  at::manual_seed(103);
  for (int run = 0; run < 100; ++run) {
    INFO("run " << run);
    REQUIRE(run_2b(device) == Positions{0, 1, 7, 9});
    REQUIRE(keep_indices_row(kOptions2b, kScores2b, device) == Positions{0, 1, 7, 9});
  }
}

// 3. B=2, H=2, S=8, n_sink=1, budget=1, n_recent=2. Row 0: 5 at position 3; row 1: 6 at
// position 5. Kept: row 0 [0,3,6,7], row 1 [0,5,6,7]; row 1's rows for position 5.
void case_3(at::Device device) {
  at::manual_seed(104);
  auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(2), 2, 2, device);
  const auto kv = random_kv(2, 2, 8);
  update(c, kv.first, kv.second, 0, 8);
  observe_scores(c, {{0, 0, 0, 5, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 6, 0, 0}});
  CHECK(c.evict(0) == 2 * 4);  // 4 per row
  CHECK(ordered_positions(c, 0) == Positions{0, 3, 6, 7});
  CHECK(ordered_positions(c, 1) == Positions{0, 5, 6, 7});
  check_rows_exact(c, kv.first, kv.second);
  const auto o = c.ordered(0);
  CHECK(at::equal(o.keys[1].select(1, 1).cpu(), kv.first[1].select(1, 5)));
  CHECK(at::equal(o.values[1].select(1, 1).cpu(), kv.second[1].select(1, 5)));
  CHECK_FALSE(at::equal(o.keys[1].select(1, 1).cpu(), kv.first[0].select(1, 5)));
  CHECK(keep_indices_row(EvictionOptions(1).n_sink(1).n_recent(2), {{0, 0, 0, 5, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 6, 0, 0}},
                         device, 1) == Positions{0, 5, 6, 7});
}

// 4b. H=4, S=6, n_sink=1, budget=1, n_recent=1. Heads 0-2 observe [0,1,0,1,1,0], head 3
// [0,0,10,0,0,0] (divided by 16 to be probabilities): mean over heads [0, .75, 2.5, .75, .75, 0]
// / 16; kept [0,2,5] for all heads.
void case_4b(at::Device device) {
  at::manual_seed(105);
  auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(1), 1, 4, device);
  const auto kv = random_kv(1, 4, 6);
  update(c, kv.first, kv.second, 0, 6);
  const auto head = at::tensor({0.f, 1.f, 0.f, 1.f, 1.f, 0.f}).div(kObserveScale);
  const auto head3 = at::tensor({0.f, 0.f, 10.f, 0.f, 0.f, 0.f}).div(kObserveScale);
  c.observe(0, at::stack({head, head, head, head3}).view({1, 4, 1, 6}).to(device));
  CHECK(to_vec<float>(c.scores(0)[0]) ==
        std::vector<float>{0, 0.75f / kObserveScale, 2.5f / kObserveScale, 0.75f / kObserveScale,
                           0.75f / kObserveScale, 0});
  CHECK(c.evict(0) == 3);
  CHECK(ordered_positions(c) == Positions{0, 2, 5});
  check_rows_exact(c, kv.first, kv.second);  // every head holds the rows of positions 0, 2, 5
  CHECK(c.keys(0).sizes() == at::IntArrayRef({1, 4, 3, kQk}));
}

// 5. keys[b,h,s,d] = 1000*s + d (192 wide), values = -(1000*s + d) (128 wide), H=2, S=6,
// n_sink=1, budget=1, n_recent=1, position 3 the top candidate: kept [0,3,5].
std::pair<at::Tensor, at::Tensor> case_5_kv(int64_t S) {
  const auto s = at::arange(S, at::kFloat).mul(1000).view({1, 1, S, 1});
  const auto k = s.add(at::arange(192, at::kFloat).view({1, 1, 1, 192})).expand({1, 2, S, 192}).contiguous();
  const auto v = s.add(at::arange(128, at::kFloat).view({1, 1, 1, 128})).neg().expand({1, 2, S, 128}).contiguous();
  return {k, v};
}

void case_5(at::Device device) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    INFO("dtype " << dtype);
    auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(1), 1, 2, device, dtype, true, 192, 128);
    const auto kv = case_5_kv(6);
    const auto k = kv.first.to(dtype), v = kv.second.to(dtype);
    update(c, k, v, 0, 6);
    observe_scores(c, {{0, 1, 2, 5, 3, 0}});
    CHECK(c.evict(0) == 3);
    CHECK(ordered_positions(c) == Positions{0, 3, 5});
    CHECK(c.keys(0).size(3) == 192);
    CHECK(c.values(0).size(3) == 128);
    check_rows_exact(c, k, v);
    if (dtype == at::kFloat) {
      const auto o = c.ordered(0);
      for (int64_t h = 0; h < 2; ++h) {
        CHECK(o.keys[0][h][1][191].item<float>() == 3191.f);
        CHECK(o.values[0][h][1][127].item<float>() == -3127.f);
        CHECK(o.keys[0][h][2][0].item<float>() == 5000.f);
        CHECK(o.values[0][h][0][127].item<float>() == -127.f);
      }
    }
  }
}

// 6. S=10, n_sink=2, budget=2, n_recent=3, scores at positions 2..6 = [1,8,2,9,0]:
// kept [0,1,3,5,7,8,9] ascending; each kept slot reports its original position.
void case_6(at::Device device) {
  at::manual_seed(106);
  const auto e = EvictionOptions(2).n_sink(2).n_recent(3);
  const Rows scores = {{0, 0, 1, 8, 2, 9, 0, 0, 0, 0}};
  auto c = make_cache(e, 1, 2, device);
  const auto kv = random_kv(1, 2, 11);
  update(c, kv.first, kv.second, 0, 10);
  observe_scores(c, scores);
  CHECK(c.evict(0) == 3);
  CHECK(ordered_positions(c) == Positions{0, 1, 3, 5, 7, 8, 9});
  CHECK(kvevict_test::kept_positions(c, 0) == Positions{0, 1, 3, 5, 7, 8, 9});
  check_rows_exact(c, kv.first, kv.second);
  CHECK(keep_indices_row(e, scores, device) == Positions{0, 1, 3, 5, 7, 8, 9});
  // One more step over the compacted slots: candidates 3 (8), 5 (9), 7 (0); window 8, 9, 10.
  update(c, kv.first, kv.second, 10, 1);
  observe_scores(c, {std::vector<float>(8, 0.f)});
  CHECK(c.evict(0) == 1);
  CHECK(ordered_positions(c) == Positions{0, 1, 3, 5, 8, 9, 10});
  check_rows_exact(c, kv.first, kv.second);
}

// 7. H=3, S=8, keys[..., 128:192] = s, keys[..., :128] = 100*h + s; n_sink=1, budget=1,
// n_recent=2, position 2 the top candidate: kept [0,2,6,7], bit-exact in fp32 and bf16.
void case_7(at::Device device) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    INFO("dtype " << dtype);
    const auto s = at::arange(8, at::kFloat).view({1, 1, 8, 1});
    const auto h = at::arange(3, at::kFloat).mul(100).view({1, 3, 1, 1});
    const auto k = at::cat({s.add(h).expand({1, 3, 8, 128}), s.expand({1, 3, 8, 64})}, 3).contiguous().to(dtype);
    const auto v = s.add(h).neg().expand({1, 3, 8, 128}).contiguous().to(dtype);
    auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(2), 1, 3, device, dtype, true, 192, 128);
    update(c, k, v, 0, 8);
    observe_scores(c, {{0, 1, 4, 2, 3, 0, 0, 0}});
    CHECK(c.evict(0) == 4);
    const auto kept = ordered_positions(c);
    CHECK(kept == Positions{0, 2, 6, 7});
    check_rows_exact(c, k, v);
    const auto o = c.ordered(0);
    for (int64_t hh = 0; hh < 3; ++hh) {
      for (int64_t i = 0; i < 4; ++i) {
        INFO("head " << hh << ", position " << kept[i]);
        const auto row = o.keys[0][hh][i].cpu();
        CHECK(at::equal(row.narrow(0, 128, 64), at::full({64}, static_cast<double>(kept[i]), row.options())));
        CHECK(at::equal(row.narrow(0, 0, 128), at::full({128}, static_cast<double>(100 * hh + kept[i]), row.options())));
      }
    }
  }
}

// 8. Positions 0,1,2 with scores 5,4,3; position 3 appended with score 0. Returns the cache
// after that step's pass; k/v hold the rows of positions 0..8.
struct Case8 {
  MlaCache cache;
  at::Tensor k, v;
};

Case8 run_8(const EvictionOptions& e, at::Device device) {
  auto kv = random_kv(1, 2, 9);
  Case8 r{make_cache(e, 1, 2, device), kv.first, kv.second};
  update(r.cache, r.k, r.v, 0, 3);
  add_scores(r.cache, {{5, 4, 3}});
  CHECK(r.cache.evict(0) == 0);
  update(r.cache, r.k, r.v, 3, 1);  // score 0
  CHECK(r.cache.evict(0) == 1);
  check_rows_exact(r.cache, r.k, r.v);
  return r;
}

void case_8a(at::Device device) {
  at::manual_seed(1081);
  CHECK(ordered_positions(run_8(EvictionOptions(2).n_sink(1).n_recent(0), device).cache) == Positions{0, 1, 2});
}

void case_8b(at::Device device) {
  at::manual_seed(1082);
  CHECK(ordered_positions(run_8(EvictionOptions(1).n_sink(1).n_recent(1), device).cache) == Positions{0, 1, 3});
}

// 8c. With b's options, five more appends, each new token scoring 0: the newest position is
// kept every step (position 1, score 4, stays the heavy hitter).
void case_8c(at::Device device) {
  at::manual_seed(1083);
  auto r = run_8(EvictionOptions(1).n_sink(1).n_recent(1), device);
  REQUIRE(ordered_positions(r.cache) == Positions{0, 1, 3});
  for (int64_t p = 4; p < 9; ++p) {
    INFO("appended position " << p);
    update(r.cache, r.k, r.v, p, 1);
    add_scores(r.cache, {std::vector<float>(r.cache.size(0), 0.f)});  // an observation step: the new token scores 0
    CHECK(r.cache.evict(0) == 1);
    CHECK(ordered_positions(r.cache) == Positions{0, 1, p});
    check_rows_exact(r.cache, r.k, r.v);
  }
}

// 9. n_sink=1, budget=1, n_recent=4, position 2 the top candidate.
void case_9(at::Device device) {
  at::manual_seed(109);
  const auto e = EvictionOptions(1).n_sink(1).n_recent(4);
  const auto kv = random_kv(1, 2, 15);
  const auto prefill = [&](int64_t S) {
    auto c = make_cache(e, 1, 2, device);
    update(c, kv.first, kv.second, 0, S);
    std::vector<float> s(S, 0.f);
    s[2] = 5;
    observe_scores(c, {s});
    return c;
  };
  {  // S = 10: kept [0,2,6,7,8,9]: the window is exactly 6..9.
    auto c = prefill(10);
    CHECK(c.evict(0) == 4);
    CHECK(ordered_positions(c) == Positions{0, 2, 6, 7, 8, 9});
    check_rows_exact(c, kv.first, kv.second);
    // Decode on: after each pass the window is exactly the 4 newest, newest included.
    for (int64_t p = 10; p < 15; ++p) {
      update(c, kv.first, kv.second, p, 1);
      observe_scores(c, {std::vector<float>(c.size(0), 0.f)});
      CHECK(c.evict(0) == 1);
      CHECK(ordered_positions(c) == Positions{0, 2, p - 3, p - 2, p - 1, p});
    }
    check_rows_exact(c, kv.first, kv.second);
  }
  {  // S = 6 = capacity: nothing evicted.
    auto c = prefill(6);
    CHECK(c.evict(0) == 0);
    CHECK(ordered_positions(c) == Positions{0, 1, 2, 3, 4, 5});
    CHECK(c.stats().eviction_events == 0);
  }
  {  // S = 7: exactly one token evicted (position 1).
    auto c = prefill(7);
    CHECK(c.evict(0) == 1);
    CHECK(ordered_positions(c) == Positions{0, 2, 3, 4, 5, 6});
    CHECK(c.stats().eviction_events == 1);
    CHECK(c.stats().tokens_evicted == 1);
    check_rows_exact(c, kv.first, kv.second);
  }
}

// 11a. Prefill of 16 tokens, n_sink=2, budget=2, n_recent=4, scores at positions 2..11 =
// [0,0,0,7,0,0,0,6,0,0]: kept [0,1,5,9,12,13,14,15]; the next decode query (position 16)
// attends to all 8 plus itself.
void case_11a(at::Device device) {
  at::manual_seed(111);
  const int64_t H = 2;
  const auto e = EvictionOptions(2).n_sink(2).n_recent(4);
  const Rows scores = {{0, 0, 0, 0, 0, 7, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0}};
  const Positions kept = {0, 1, 5, 9, 12, 13, 14, 15};
  CHECK(keep_indices_row(e, scores, device) == kept);

  auto c = make_cache(e, 1, H, device);
  const auto kv = random_kv(1, H, 20);
  update(c, kv.first, kv.second, 0, 16);
  add_scores(c, scores);
  CHECK(c.evict(0) == 8);
  CHECK(ordered_positions(c) == kept);
  check_rows_exact(c, kv.first, kv.second);

  // Reference attention of queries at `query_pos` over the input rows at `visible` (causal).
  const auto reference = [&](const at::Tensor& q, const Positions& visible, int64_t first_query) {
    const auto idx = at::tensor(visible);
    const auto K = kv.first.index_select(2, idx), V = kv.second.index_select(2, idx);
    auto logits = at::matmul(q, K.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(kQk)));
    const auto qpos = at::arange(first_query, first_query + q.size(2), at::kLong).view({1, 1, -1, 1});
    logits = logits.masked_fill(idx.view({1, 1, 1, -1}).gt(qpos), -std::numeric_limits<double>::infinity());
    const auto p = at::softmax(logits, -1);
    return std::make_pair(at::matmul(p, V), p);
  };
  // Probabilities [B, H, T, S] in slot order, rearranged to the order of `visible`.
  const auto to_visible_order = [&](const at::Tensor& p, const Positions& visible) {
    const auto pos = to_vec<int64_t>(c.positions(0)[0]);
    std::vector<int64_t> slot_of(visible.size());
    for (size_t j = 0; j < visible.size(); ++j) {
      slot_of[j] = std::find(pos.begin(), pos.end(), visible[j]) - pos.begin();
      REQUIRE(slot_of[j] < static_cast<int64_t>(pos.size()));
    }
    return p.cpu().index_select(3, at::tensor(slot_of));
  };

  // Decode step: position 16.
  update(c, kv.first, kv.second, 16, 1);
  const auto q = at::randn({1, H, 1, kQk});
  at::Tensor probs;
  const auto out = kvevict::attend(q.to(device), c, 0, c10::nullopt, &probs);
  REQUIRE(probs.sizes() == at::IntArrayRef({1, H, 1, 9}));
  CHECK(probs.gt(0).all().item<bool>());
  CHECK(probs.device() == device);
  Positions visible = kept;
  visible.push_back(16);
  const auto ref = reference(q, visible, 16);
  CHECK(at::allclose(out.cpu(), ref.first, 1e-5, 1e-6));
  CHECK(at::allclose(to_visible_order(probs, visible), ref.second, 1e-5, 1e-7));

  // A 3-token chunk (positions 17..19) over the scattered positions: causal by position.
  update(c, kv.first, kv.second, 17, 3);
  const auto q3 = at::randn({1, H, 3, kQk});
  const auto out3 = kvevict::attend(q3.to(device), c, 0, c10::nullopt, &probs);
  REQUIRE(probs.sizes() == at::IntArrayRef({1, H, 3, 12}));
  for (int64_t p : {17, 18, 19}) visible.push_back(p);
  const auto ref3 = reference(q3, visible, 17);
  CHECK(at::allclose(out3.cpu(), ref3.first, 1e-5, 1e-6));
  const auto p3 = to_visible_order(probs, visible);
  CHECK(at::allclose(p3, ref3.second, 1e-5, 1e-7));
  // Everything at or before a query's position is attended; the chunk's future is not.
  for (int64_t t = 0; t < 3; ++t) {
    for (size_t j = 0; j < visible.size(); ++j) {
      INFO("query position " << 17 + t << ", key position " << visible[j]);
      const bool seen = visible[j] <= 17 + t;
      CHECK(p3[0].select(1, t).select(1, static_cast<int64_t>(j)).gt(0).all().item<bool>() == seen);
    }
  }
}

// 11b. Attention observed over 16 tokens while the layer holds 17: a length-mismatch error.
void case_11b(at::Device device) {
  at::manual_seed(112);
  auto c = make_cache(EvictionOptions(2).n_sink(2).n_recent(4), 1, 2, device);
  const auto kv = random_kv(1, 2, 17);
  update(c, kv.first, kv.second, 0, 17);
  add_scores(c, {std::vector<float>(17, 1.f)});
  const auto before = snapshot(c);
  const auto opts = at::TensorOptions().device(device);
  CHECK_THROWS_WITH(c.observe(0, at::full({1, 2, 1, 16}, 1.0 / 16, opts)),
                    Contains("[1, 2, Q, 17]") && Contains("got [1, 2, 1, 16]"));
  CHECK_THROWS_WITH(c.observe(0, at::full({1, 2, 1, 18}, 1.0 / 18, opts)), Contains("got [1, 2, 1, 18]"));
  CHECK_THROWS_WITH(c.add_scores(0, at::ones({1, 16}, opts)), Contains("[1, 17]") && Contains("got [1, 16]"));
  check_unchanged(c, before);
  // Still usable: the right length is accepted.
  c.observe(0, at::full({1, 2, 1, 17}, 1.0 / 17, opts));
  CHECK(c.evict(0) == 9);
}

// 12. S=8, n_sink=1, budget=1, n_recent=2, scores [1,2,NaN,3,1,0,0,0].
const Rows kScores12 = {{1, 2, kNaN, 3, 1, 0, 0, 0}};
const auto kOptions12 = EvictionOptions(1).n_sink(1).n_recent(2);

void case_12_checked(at::Device device) {
  at::manual_seed(113);
  auto c = make_cache(kOptions12, 1, 2, device);
  const auto kv = random_kv(1, 2, 8);
  update(c, kv.first, kv.second, 0, 8);
  observe_scores(c, {{1, 2, 5, 3, 1, 0, 0, 0}});  // valid: position 2 is the top candidate
  const auto before = snapshot(c);
  for (float bad : {kNaN, kInf, -kInf}) {
    INFO("bad value " << bad);
    Rows r = kScores12;
    r[0][2] = bad;
    CHECK_THROWS_WITH(add_scores(c, r), Contains("non-finite"));
    CHECK_THROWS_WITH(observe_scores(c, r), Contains("non-finite"));
    check_unchanged(c, before);
  }
  // The rejected observations left no trace: position 2 still leads.
  CHECK(c.evict(0) == 4);
  CHECK(ordered_positions(c) == Positions{0, 2, 6, 7});
  check_rows_exact(c, kv.first, kv.second);
}

void case_12_unchecked(at::Device device) {
  at::manual_seed(114);
  for (float bad : {kNaN, kInf, -kInf}) {
    for (bool via_observe : {false, true}) {
      INFO("bad value " << bad << (via_observe ? " via observe" : " via add_scores"));
      Rows r = kScores12;
      r[0][2] = bad;
      auto c = make_cache(kOptions12, 1, 2, device, at::kFloat, /*check_finite=*/false);
      const auto kv = random_kv(1, 2, 8);
      update(c, kv.first, kv.second, 0, 8);
      if (via_observe) {
        observe_scores(c, r);
      } else {
        add_scores(c, r);
      }
      CHECK(c.evict(0) == 4);
      CHECK(ordered_positions(c) == Positions{0, 3, 6, 7});
      check_rows_exact(c, kv.first, kv.second);
      CHECK(keep_indices_row(kOptions12, r, device) == Positions{0, 3, 6, 7});
    }
  }
}

// 12, last sentence: slots that hold no token never enter selection or attention. Evicted
// tokens leave stale rows (here NaN keys/values and a NaN score) in slots past size().
void case_12_dead_slots(at::Device device) {
  at::manual_seed(115);
  auto c = make_cache(kOptions12, 1, 2, device, at::kFloat, /*check_finite=*/false);
  auto kv = random_kv(1, 2, 10);
  for (int64_t p : {1, 2, 4, 5}) {  // the positions this case evicts
    kv.first.select(2, p).fill_(kNaN);
    kv.second.select(2, p).fill_(kNaN);
  }
  update(c, kv.first, kv.second, 0, 8);
  add_scores(c, kScores12);
  CHECK(c.evict(0) == 4);
  CHECK(ordered_positions(c) == Positions{0, 3, 6, 7});
  CHECK(c.keys(0).size(2) == 4);
  CHECK(at::isfinite(c.keys(0)).all().item<bool>());
  CHECK(at::isfinite(c.values(0)).all().item<bool>());
  CHECK(at::isfinite(c.scores(0)).all().item<bool>());
  // Decode position 8: attention covers exactly the 5 live tokens and stays finite.
  update(c, kv.first, kv.second, 8, 1);
  at::Tensor probs;
  const auto out = kvevict::attend(at::randn({1, 2, 1, kQk}).to(device), c, 0, c10::nullopt, &probs);
  CHECK(probs.sizes() == at::IntArrayRef({1, 2, 1, 5}));
  CHECK(at::isfinite(out).all().item<bool>());
  CHECK(at::isfinite(probs).all().item<bool>());
  CHECK(at::isfinite(c.scores(0)).all().item<bool>());
  CHECK(to_vec<float>(c.scores(0)[0]).size() == 5);
  // Next pass: candidates 3 (score 3 + attention <= 1) and 6 (0 + attention <= 1), window 7, 8;
  // nothing stale comes back.
  CHECK(c.evict(0) == 1);
  CHECK(ordered_positions(c) == Positions{0, 3, 7, 8});
  check_rows_exact(c, kv.first, kv.second);
}

}  // namespace

// ---- CPU: every case on the default host path and on the tensor-op path -------------------

TEST_CASE("below capacity nothing is evicted and K/V stay bit-identical", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_1a(at::kCPU); });
}

TEST_CASE("n_recent 0 keeps no tail (no '-0:' slice)", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_1b(at::kCPU); });
}

// Case 1c: see test_options.cpp, "EvictionOptions rejects bad values naming them".

TEST_CASE("all scores equal degrade to sinks + the newest tokens", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_2a(at::kCPU); });
}

TEST_CASE("ties resolve to the newer position, identically over 100 runs", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_2b(at::kCPU); });
}

TEST_CASE("batch rows choose their own tokens", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_3(at::kCPU); });
}

TEST_CASE("attention with fewer heads than the cache is rejected, nothing changes",
          "[cases][errors][cpu]") {
  kvevict_test::on_both_paths([] {
    at::manual_seed(1041);
    auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(1), 1, 4);
    const auto kv = random_kv(1, 4, 6);
    update(c, kv.first, kv.second, 0, 6);
    observe_scores(c, {{0, 1, 0, 3, 2, 0}});
    const auto before = snapshot(c);
    CHECK_THROWS_WITH(c.observe(0, at::full({1, 2, 1, 6}, 0.5)),
                      Contains("[1, 4, Q, 6]") && Contains("got [1, 2, 1, 6]"));
    at::Tensor probs;
    CHECK_THROWS_WITH(kvevict::attend(at::randn({1, 2, 1, kQk}), c, 0, c10::nullopt, &probs),
                      Contains("[1, 4, T, 8]") && Contains("got [1, 2, 1, 8]"));
    CHECK_FALSE(probs.defined());
    CHECK_THROWS_WITH(c.update(0, at::zeros({1, 2, 1, kQk}), at::zeros({1, 2, 1, kV})),
                      Contains("k_new") && Contains("got [1, 2, 1, 8]"));
    check_unchanged(c, before);
    CHECK(c.evict(0) == 3);
    CHECK(ordered_positions(c) == Positions{0, 3, 5});
  });
}

TEST_CASE("all H heads count, and all heads keep the same tokens", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_4b(at::kCPU); });
}

TEST_CASE("keys 192 wide and values 128 wide move together, fp32/fp16/bf16", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_5(at::kCPU); });
}

TEST_CASE("K and V that disagree on B, H, S or width are rejected, nothing changes",
          "[cases][errors][cpu]") {
  kvevict_test::on_both_paths([] {
    auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(1), 1, 2, at::kCPU, at::kFloat, true, 192, 128);
    const auto kv = case_5_kv(7);
    update(c, kv.first, kv.second, 0, 6);
    observe_scores(c, {{0, 1, 2, 5, 3, 0}});
    const auto before = snapshot(c);
    const auto k1 = kv.first.narrow(2, 6, 1), v1 = kv.second.narrow(2, 6, 1);
    CHECK_THROWS_WITH(c.update(0, k1, at::zeros({2, 2, 1, 128})),
                      Contains("v_new must be [B, H, T, v_dim] = [1, 2, 1, 128], got [2, 2, 1, 128]"));
    CHECK_THROWS_WITH(c.update(0, k1, at::zeros({1, 1, 1, 128})), Contains("got [1, 1, 1, 128]"));
    CHECK_THROWS_WITH(c.update(0, k1, at::zeros({1, 2, 2, 128})), Contains("got [1, 2, 2, 128]"));
    CHECK_THROWS_WITH(c.update(0, at::zeros({1, 2, 1, 128}), v1),
                      Contains("k_new must be [B, H, T, qk_dim] = [1, 2, T, 192], got [1, 2, 1, 128]"));
    CHECK_THROWS_WITH(c.update(0, k1, at::zeros({1, 2, 1, 192})), Contains("got [1, 2, 1, 192]"));
    CHECK_THROWS_WITH(c.update(0, at::zeros({2, 2, 1, 192}), at::zeros({2, 2, 1, 128})),
                      Contains("got [2, 2, 1, 192]"));
    CHECK_THROWS_WITH(c.update(0, k1, v1.to(at::kHalf)), Contains("v_new must have the cache's dtype Float, got Half"));
    check_unchanged(c, before);
    // The valid pair still goes in, and the case's answer holds.
    c.update(0, k1, v1);
    CHECK(c.evict(0) == 4);
    CHECK(ordered_positions(c) == Positions{0, 3, 6});
    check_rows_exact(c, kv.first, kv.second);
  });
}

TEST_CASE("kept positions in ascending order, each slot reporting its original position",
          "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_6(at::kCPU); });
}

TEST_CASE("MLA RoPE dims travel untouched, fp32 and bf16", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_7(at::kCPU); });
}

TEST_CASE("a new zero-score token competes on score when n_recent is 0", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_8a(at::kCPU); });
}

TEST_CASE("the newest token is protected by the window, not by its score", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_8b(at::kCPU); });
}

TEST_CASE("the newest position is kept on every step", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_8c(at::kCPU); });
}

TEST_CASE("the window counts exactly n_recent tokens, newest included", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_9(at::kCPU); });
}

TEST_CASE("prefill compression keeps scattered positions and decode attends to them",
          "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_11a(at::kCPU); });
}

TEST_CASE("attention over fewer tokens than the layer holds is a length error",
          "[cases][errors][cpu]") {
  kvevict_test::on_both_paths([] { case_11b(at::kCPU); });
}

TEST_CASE("non-finite observations are rejected by default, nothing changes",
          "[cases][errors][cpu]") {
  kvevict_test::on_both_paths([] { case_12_checked(at::kCPU); });
}

TEST_CASE("with finiteness checks off, non-finite scores rank lowest", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_12_unchecked(at::kCPU); });
}

TEST_CASE("slots that hold no token never enter selection or attention", "[cases][cpu]") {
  kvevict_test::on_both_paths([] { case_12_dead_slots(at::kCPU); });
}

// ---- CUDA -----------------------------------------------------------------------------------

TEST_CASE("Ties on CUDA: the same kept tokens as on CPU, over 100 runs", "[cases][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  at::manual_seed(1031);
  const auto cpu = run_2b(at::kCPU);
  CHECK(cpu == Positions{0, 1, 7, 9});
  for (int run = 0; run < 100; ++run) {
    INFO("run " << run);
    REQUIRE(run_2b(at::Device(at::kCUDA, 0)) == cpu);
    REQUIRE(keep_indices_row(kOptions2b, kScores2b, at::Device(at::kCUDA, 0)) == cpu);
  }
}

TEST_CASE("K on CUDA with V, attention or scores on CPU is rejected naming both devices",
          "[cases][cuda][errors]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(110);
  auto c = make_cache(EvictionOptions(1).n_sink(1).n_recent(1), 1, 2, cuda);
  const auto kv = random_kv(1, 2, 5);
  update(c, kv.first, kv.second, 0, 4);
  observe_scores(c, {{0, 3, 1, 0}});
  const auto before = snapshot(c);
  const auto k1 = kv.first.narrow(2, 4, 1), v1 = kv.second.narrow(2, 4, 1);
  CHECK_THROWS_WITH(c.update(0, k1.to(cuda), v1), Contains("v_new must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(c.update(0, k1, v1.to(cuda)), Contains("k_new must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(c.observe(0, at::full({1, 2, 1, 4}, 0.25)),
                    Contains("attention probs must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(c.add_scores(0, at::ones({1, 4})), Contains("scores must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(kvevict::attend(at::randn({1, 2, 1, kQk}), c, 0), Contains("cuda:0") && Contains("got cpu"));
  check_unchanged(c, before);
  c.update(0, k1.to(cuda), v1.to(cuda));
  CHECK(c.evict(0) == 2);
  CHECK(ordered_positions(c) == Positions{0, 1, 4});

  auto host = make_cache(EvictionOptions(1).n_sink(1).n_recent(1), 1, 2);
  CHECK_THROWS_WITH(host.update(0, k1.to(cuda), v1.to(cuda)),
                    Contains("k_new must be on the cache's device cpu, got cuda:0"));
  CHECK(host.size(0) == 0);
  CHECK(host.seen_tokens(0) == 0);
}

TEST_CASE("all on one device, every output and index tensor is on that device", "[cases][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(1101);
  for (bool check_finite : {true, false}) {
    INFO("check_finite " << check_finite);
    const auto e = EvictionOptions(1).n_sink(1).n_recent(1);
    auto c = make_cache(e, 2, 2, cuda, at::kFloat, check_finite);
    const auto kv = random_kv(2, 2, 5);
    const auto views = c.update(0, kv.first.narrow(2, 0, 4).to(cuda), kv.second.narrow(2, 0, 4).to(cuda));
    CHECK(views.first.device() == cuda);
    CHECK(views.second.device() == cuda);
    at::Tensor probs;
    const auto out = kvevict::attend(at::randn({2, 2, 4, kQk}).to(cuda), c, 0, c10::nullopt, &probs);
    CHECK(out.device() == cuda);
    CHECK(probs.device() == cuda);
    CHECK(c.positions(0).device() == cuda);
    CHECK(c.scores(0).device() == cuda);
    CHECK(c.keys(0).device() == cuda);
    CHECK(c.values(0).device() == cuda);
    CHECK(c.evict(0) == 1);
    const auto o = c.ordered(0);
    CHECK(o.keys.device() == cuda);
    CHECK(o.values.device() == cuda);
    CHECK(o.positions.device() == cuda);
    check_rows_exact(c, kv.first, kv.second);
    const kvevict::Selection policy(e);
    CHECK(policy.keep_indices(c.scores(0)).device() == cuda);
    CHECK(policy.evict_slots(c.scores(0), c.positions(0)).device() == cuda);
  }
}

TEST_CASE("The field cases on CUDA give the CPU answers", "[cases][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda(at::kCUDA, 0);
  case_1a(cuda);
  case_1b(cuda);
  case_2a(cuda);
  case_3(cuda);
  case_4b(cuda);
  case_5(cuda);
  case_6(cuda);
  case_7(cuda);
  case_8a(cuda);
  case_8b(cuda);
  case_8c(cuda);
  case_9(cuda);
  case_11a(cuda);
  case_11b(cuda);
  case_12_checked(cuda);
  case_12_unchecked(cuda);
  case_12_dead_slots(cuda);
}
