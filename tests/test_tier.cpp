// The host tier (cache options' tier_tokens): evicted tokens kept in host memory, bit for bit,
// within a per-row budget that drops the lowest-ranked first. Expected values come from an
// oracle that keeps every row the test appended, by position, and the ranks scores() gave just
// before each pass.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

using Catch::Matchers::Contains;

namespace {

using kvevict::EvictionOptions;

/// What the test appended: per row, position -> the token's rows (per buffer, the buffer's
/// shape without batch and token dims), and each evicted token's rank at its pass.
struct Oracle {
  std::vector<std::map<int64_t, std::pair<at::Tensor, at::Tensor>>> rows;
  std::vector<std::map<int64_t, float>> rank_at_eviction;
  std::vector<std::set<int64_t>> tier;  // the tier as the budget rule keeps it
};

/// The eviction order of the tier's drops: lower rank first, equal ranks the older position,
/// non-finite ranks lowest (here: NaN never occurs; -inf/+inf are not produced either).
bool drops_first(float ra, int64_t pa, float rb, int64_t pb) { return ra != rb ? ra < rb : pa < pb; }

/// Token i of a tier buffer [outer..., n, inner] (its token dim is the second to last).
at::Tensor split_token(const at::Tensor& t, int64_t i) { return t.select(t.dim() - 2, i); }

/// Runs `steps` decode steps on `cache` (layer 0, rows with `counts` tokens per step) with
/// random rows and probabilities, checking after each pass that the tier holds what the
/// oracle says. Latent or expanded: `rows(T)` makes the two buffers' new rows.
template <class Cache, class Rows, class Split>
void run_and_check(Cache& cache, Oracle& o, int64_t steps, const std::vector<int64_t>& counts, Rows&& rows,
                   Split&& split, int64_t budget) {
  const int64_t B = cache.batch_size(), H = cache.num_heads();
  o.rows.resize(B);
  o.rank_at_eviction.resize(B);
  o.tier.resize(B);
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t T = *std::max_element(counts.begin(), counts.end());
    auto [a, b] = rows(T);
    std::vector<int64_t> seen(B);
    for (int64_t r = 0; r < B; ++r) seen[r] = cache.seen_tokens(0, r);
    cache.update(0, a, b, counts);
    for (int64_t r = 0; r < B; ++r) {
      for (int64_t j = 0; j < counts[r]; ++j) {
        o.rows[r][seen[r] + j] = split(a, b, r, T - counts[r] + j);
      }
    }
    const int64_t S = cache.size(0);
    cache.observe(0, at::softmax(at::randn({B, H, 1, S}), -1));
    const at::Tensor pos_before = cache.positions(0), scores_before = cache.scores(0);
    const bool due = cache.policy().due(0);
    cache.evict(0);
    if (!due) continue;
    const at::Tensor pos_after = cache.positions(0);
    for (int64_t r = 0; r < B; ++r) {
      std::set<int64_t> kept;
      for (int64_t s = 0; s < cache.size(0, r); ++s) kept.insert(pos_after[r][s].item<int64_t>());
      for (int64_t s = 0; s < pos_before.size(1); ++s) {
        const int64_t p = pos_before[r][s].item<int64_t>();
        if (p < 0 || kept.count(p)) continue;
        o.rank_at_eviction[r][p] = scores_before[r][s].item<float>();
        o.tier[r].insert(p);
      }
      while (static_cast<int64_t>(o.tier[r].size()) > budget) {  // drop the first in eviction order
        auto worst = o.tier[r].begin();
        for (auto it = o.tier[r].begin(); it != o.tier[r].end(); ++it) {
          if (drops_first(o.rank_at_eviction[r][*it], *it, o.rank_at_eviction[r][*worst], *worst)) worst = it;
        }
        o.tier[r].erase(worst);
      }
      // The tier holds exactly the oracle's tokens, with their rows and ranks.
      const at::Tensor tp = cache.tier_positions(0, r);
      REQUIRE(tp.size(0) == static_cast<int64_t>(o.tier[r].size()));
      REQUIRE(cache.tier_size(0, r) == tp.size(0));
      const at::Tensor ts = cache.tier_scores(0, r);
      const std::pair<at::Tensor, at::Tensor> tr = cache.tier_rows(0, r);
      int64_t i = 0;
      for (const int64_t p : o.tier[r]) {
        CAPTURE(step, r, p);
        REQUIRE(tp[i].item<int64_t>() == p);
        CHECK(ts[i].item<float>() == o.rank_at_eviction[r][p]);
        const auto& want = o.rows[r].at(p);
        CHECK(at::equal(split_token(tr.first, i), want.first));
        CHECK(at::equal(split_token(tr.second, i), want.second));
        ++i;
      }
    }
  }
}

}  // namespace

TEST_CASE("a pass sends its evicted tokens to the host tier, rows bit for bit, with their rank", "[tier][cpu]") {
  at::manual_seed(3);
  const int64_t budget = GENERATE(int64_t{1000}, int64_t{5});  // unbounded here, and tight
  const int64_t ee = GENERATE(int64_t{1}, int64_t{3});
  CAPTURE(budget, ee);
  const auto eviction = EvictionOptions(3).n_sink(1).n_recent(2).evict_every(ee);
  const std::vector<int64_t> counts{1, 2};  // ragged rows: one and two tokens per step
  SECTION("latent") {
    kvevict::MlaLatentCache cache(
        kvevict::MlaLatentCacheOptions(1, 2).batch_size(2).kv_lora_rank(8).qk_rope_dim(4).tier_tokens(budget),
        eviction);
    Oracle o;
    run_and_check(
        cache, o, 30, counts, [](int64_t T) { return std::make_pair(at::randn({2, T, 8}), at::randn({2, T, 4})); },
        [](const at::Tensor& a, const at::Tensor& b, int64_t r, int64_t t) {
          return std::make_pair(a[r][t].clone(), b[r][t].clone());
        },
        budget);
  }
  SECTION("expanded") {
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 2).batch_size(2).qk_dim(6).v_dim(4).tier_tokens(budget),
                            eviction);
    Oracle o;
    run_and_check(
        cache, o, 30, counts, [](int64_t T) { return std::make_pair(at::randn({2, 2, T, 6}), at::randn({2, 2, T, 4})); },
        [](const at::Tensor& a, const at::Tensor& b, int64_t r, int64_t t) {
          return std::make_pair(a[r].select(1, t).clone(), b[r].select(1, t).clone());  // [H, D]
        },
        budget);
  }
}

TEST_CASE("with an unbounded tier nothing is lost: cache and tier hold every position once", "[tier][cpu]") {
  at::manual_seed(5);
  kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(2, 2).kv_lora_rank(4).qk_rope_dim(2).tier_tokens(1000),
                                EvictionOptions(4).n_sink(2).n_recent(2));
  for (int64_t step = 0; step < 40; ++step) {
    for (int64_t l = 0; l < 2; ++l) {
      cache.update(l, at::randn({1, 1, 4}), at::randn({1, 1, 2}));
      cache.observe(l, at::softmax(at::randn({1, 2, 1, cache.size(l)}), -1));
      cache.evict(l);
    }
  }
  for (int64_t l = 0; l < 2; ++l) {
    std::vector<int64_t> all;
    const auto pos = cache.positions(0);
    for (int64_t s = 0; s < cache.size(l); ++s) all.push_back(cache.positions(l)[0][s].item<int64_t>());
    const auto tp = cache.tier_positions(l, 0);
    for (int64_t i = 0; i < tp.size(0); ++i) all.push_back(tp[i].item<int64_t>());
    std::sort(all.begin(), all.end());
    std::vector<int64_t> expected(40);
    for (int64_t i = 0; i < 40; ++i) expected[i] = i;
    CHECK(all == expected);
    CHECK(cache.size(l) == 8);
    CHECK(cache.tier_size(l, 0) == 32);
  }
  // Bytes: per token 8 (position) + 4 (rank) + 4 (CumulativeAttention's state) + the rows,
  // (4 + 2) fp32 values.
  const auto st = cache.stats();
  CHECK(st.tier_tokens == 64);
  CHECK(st.tier_bytes == 64 * (8 + 4 + 4 + 6 * 4));
  CHECK(cache.stats(1).tier_bytes == 32 * 40);
}

TEST_CASE("finish, reset(row) and reset() release the tier; other rows keep theirs", "[tier][cpu]") {
  at::manual_seed(7);
  kvevict::MlaLatentCache cache(
      kvevict::MlaLatentCacheOptions(1, 1).batch_size(3).kv_lora_rank(4).qk_rope_dim(2).tier_tokens(100),
      EvictionOptions(2).n_sink(1).n_recent(1));
  const auto fill = [&] {
    for (int i = 0; i < 10; ++i) {
      cache.update(0, at::randn({3, 1, 4}), at::randn({3, 1, 2}));
      cache.observe(0, at::softmax(at::randn({3, 1, 1, cache.size(0)}), -1));
      cache.evict(0);
    }
  };
  fill();
  REQUIRE(cache.tier_size(0, 0) == 6);  // 10 tokens, capacity 4
  cache.finish(1);
  CHECK(cache.tier_size(0, 1) == 0);
  CHECK(cache.tier_size(0, 0) == 6);
  cache.reset(2);
  CHECK(cache.tier_size(0, 2) == 0);
  CHECK(cache.tier_size(0, 0) == 6);
  CHECK(cache.stats().tier_tokens == 6);
  cache.reset();
  for (int64_t r = 0; r < 3; ++r) CHECK(cache.tier_size(0, r) == 0);
  CHECK(cache.stats().tier_bytes == 0);
}

TEST_CASE("truncate rolls back tokens that sit in the tier too", "[tier][cpu]") {
  at::manual_seed(9);
  auto options = kvevict::MlaLatentCacheOptions(1, 1).kv_lora_rank(4).qk_rope_dim(2);
  const auto eviction = EvictionOptions(2).n_sink(1).n_recent(1);
  // 12 tokens at capacity 4 with a flat score: the pass evicts the older candidates, so the
  // newest tokens below the recent window went to the tier.
  const auto fill = [&](kvevict::MlaLatentCache& c) {
    for (int i = 0; i < 12; ++i) {
      c.update(0, at::randn({1, 1, 4}), at::randn({1, 1, 2}));
      c.evict(0);
    }
  };
  SECTION("with a tier") {
    kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(options).tier_tokens(100), eviction);
    fill(cache);
    REQUIRE(cache.size(0) == 4);
    REQUIRE(cache.tier_size(0, 0) == 8);
    cache.truncate(0, 5);  // positions 7..11, some cached, some in the tier
    CHECK(cache.seen_tokens(0) == 7);
    const auto tp = cache.tier_positions(0, 0);
    for (int64_t i = 0; i < tp.size(0); ++i) CHECK(tp[i].item<int64_t>() < 7);
    const auto pos = cache.positions(0);
    for (int64_t s = 0; s < cache.size(0); ++s) CHECK(pos[0][s].item<int64_t>() < 7);
    CHECK(cache.size(0) + cache.tier_size(0, 0) == 7);
  }
  SECTION("tokens dropped past the tier's budget cannot be rolled back; nothing changes") {
    kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(options).tier_tokens(1), eviction);
    fill(cache);
    const auto pos = cache.positions(0);
    const auto tp = cache.tier_positions(0, 0);
    // Every rank ties at 0: the tier drops the older positions first and keeps the newest
    // evicted one (1..8 were evicted; 0 is the sink, 9, 10, 11 stay cached).
    REQUIRE(tp.size(0) == 1);
    CHECK(tp[0].item<int64_t>() == 8);
    CHECK_THAT(kvevict_test::message_of([&] { cache.truncate(0, 11); }), Contains("not in the host tier"));
    CHECK(at::equal(cache.positions(0), pos));
    CHECK(at::equal(cache.tier_positions(0, 0), tp));
    CHECK(cache.seen_tokens(0) == 12);
  }
}

TEST_CASE("the tier drops a non-finite rank first, as a pass does (+inf included)", "[tier][cpu]") {
  // Capacity 1 (no sink, no recent window), a tier of 1. Two tokens with ranks +inf and 5: the
  // pass evicts position 0 (non-finite ranks lowest). A third token, rank 0 against 5: the pass
  // evicts position 2; the tier, over its budget, drops the +inf token and keeps position 2.
  kvevict::MlaLatentCache cache(
      kvevict::MlaLatentCacheOptions(1, 1).kv_lora_rank(4).qk_rope_dim(2).check_observations(false).tier_tokens(1),
      EvictionOptions(1).n_sink(0).n_recent(0));
  cache.update(0, at::randn({1, 2, 4}), at::randn({1, 2, 2}));
  cache.add_scores(0, at::tensor({INFINITY, 5.0f}).view({1, 2}));
  cache.evict(0);
  REQUIRE(cache.tier_size(0, 0) == 1);
  CHECK(cache.tier_positions(0, 0)[0].item<int64_t>() == 0);
  cache.update(0, at::randn({1, 1, 4}), at::randn({1, 1, 2}));
  cache.evict(0);  // slots: position 1 (rank 5), position 2 (rank 0)
  REQUIRE(cache.tier_size(0, 0) == 1);
  CHECK(cache.tier_positions(0, 0)[0].item<int64_t>() == 2);
  CHECK(cache.tier_scores(0, 0)[0].item<float>() == 0.0f);
}

TEST_CASE("tier options and accessors: clear errors that change nothing", "[tier][cpu]") {
  const auto eviction = EvictionOptions(2).n_sink(1).n_recent(1);
  CHECK_THROWS_AS(kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, 1).tier_tokens(-1), eviction),
                  c10::ValueError);
  CHECK_THAT(kvevict_test::message_of([&] {
               kvevict::MlaCache(kvevict::MlaCacheOptions(1, 1).tier_tokens(-1), eviction);
             }),
             Contains("tier_tokens must be in [0, 2^40], got -1"));
  {
    kvevict_test::ForceTensorPath tensor_path(true);
    CHECK_THAT(kvevict_test::message_of([&] {
                 kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, 1).tier_tokens(4), eviction);
               }),
               Contains("CPU host path only") && Contains("forced for tests"));
  }
  kvevict::MlaLatentCache none(kvevict::MlaLatentCacheOptions(1, 1), eviction);
  CHECK(none.tier_tokens() == 0);
  CHECK_THAT(kvevict_test::message_of([&] { none.tier_size(0, 0); }), Contains("no host tier"));
  kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, 1).tier_tokens(4), eviction);
  CHECK_THROWS_AS(cache.tier_positions(1, 0), c10::IndexError);
  CHECK_THROWS_AS(cache.tier_rows(0, 1), c10::IndexError);
  CHECK(cache.tier_size(0, 0) == 0);
}
