// The host tier (cache options' tier_tokens): evicted tokens kept in host memory, bit for bit,
// within a per-row budget that drops the lowest-ranked first. Expected values come from an
// oracle that keeps every row the test appended, by position, and the ranks scores() gave just
// before each pass.
#include "support.hpp"

#include <kvevict/kvevict.hpp>
#include <kvevict/detail/tier/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <utility>
#include <limits>
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
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
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
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
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
  // (4 + 2) fp32 values; per layer the digests of pages 0..2 (positions 0-15, 16-31, 32-39,
  // each holding tier tokens: the cache keeps 8), an fp32 min and max of 6 channels each.
  const auto st = cache.stats();
  CHECK(st.tier_tokens == 64);
  if (!tensor_path) {
    CHECK(st.tier_bytes == 64 * (8 + 4 + 4 + 6 * 4) + 2 * (3 * 2 * 6 * 4));
    CHECK(cache.stats(1).tier_bytes == 32 * 40 + 3 * 2 * 6 * 4);
  } else {  // the store's pinned rows: its capacity (32 to 64 tokens, grown geometrically) + the trash slot
    CHECK(cache.stats(1).tier_bytes >= 33 * 6 * 4);
    CHECK(cache.stats(1).tier_bytes <= 65 * 6 * 4);
    CHECK(cache.stats(1).tier_device_bytes > 0);
  }
}

TEST_CASE("finish, reset(row) and reset() release the tier; other rows keep theirs", "[tier][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
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
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
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
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
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
  kvevict::MlaLatentCache none(kvevict::MlaLatentCacheOptions(1, 1), eviction);
  CHECK(none.tier_tokens() == 0);
  CHECK_THAT(kvevict_test::message_of([&] { none.tier_size(0, 0); }), Contains("no host tier"));
  kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, 1).tier_tokens(4), eviction);
  CHECK_THROWS_AS(cache.tier_positions(1, 0), c10::IndexError);
  CHECK_THROWS_AS(cache.tier_rows(0, 1), c10::IndexError);
  CHECK(cache.tier_size(0, 0) == 0);
}

// ---------------------------------------------------------------------------------------------
// Recall: page digests scored with the step's queries, the best pages swapped back in.

namespace {

/// The recall the library must make for one row, worked out independently from the public
/// accessors: tier_rows() and tier_positions() give the tier, positions() and scores() the
/// cache. Pages by position / page_size; per page the channel min and max of its keys; per head
/// and query, the bound sum_c max(q_c lo_c, q_c hi_c) * scale, softmax over the pages (double),
/// summed over heads and queries; pages by score (higher first, then older), each whole page
/// that fits in min(tokens, heavy-hitter candidates). Two-level (rescore > tokens): the whole
/// pages that fit in `rescore` tokens are the pool; per head and query a softmax over the pool
/// of scale * q.k (double), summed; the best min(tokens, candidates) pool tokens (higher score
/// first, then older) come back. `keys` [n, G, D] (positions ascending),
/// `query` [H, Q, D] (G == 1: every head meets the one key; G == H: head h meets group h).
/// `head_mean` (TierScoring::kHeadMean): every softmax, the pool's too, is per query over the
/// heads' mean (latent: of the mean query; expanded: of the heads' bounds, or logits).
struct RecallPlan {
  std::vector<int64_t> recalled;  // positions, ascending
  std::vector<int64_t> victims;   // positions, ascending
  float top_score = 0;            // the best heavy hitter's score before the recall
};

RecallPlan oracle_recall(const at::Tensor& keys, const at::Tensor& tier_pos, const at::Tensor& query, double scale,
                         int64_t tokens, int64_t rescore, int64_t page_size, const at::Tensor& cache_pos,
                         const at::Tensor& cache_scores,
                         int64_t n_sink, int64_t recent_from, bool head_mean = false) {
  const auto k = keys.to(at::kDouble), q = query.to(at::kDouble);
  const int64_t n = k.size(0), G = k.size(1), H = q.size(0), Q = q.size(1);
  std::map<int64_t, std::vector<int64_t>> members;  // page -> tier indices
  for (int64_t i = 0; i < n; ++i) members[tier_pos[i].item<int64_t>() / page_size].push_back(i);
  std::vector<int64_t> pages;
  std::vector<at::Tensor> lo, hi;
  for (auto& [page, idx] : members) {
    const auto rows = k.index_select(0, at::tensor(idx, at::kLong));  // [m, G, D]
    pages.push_back(page);
    lo.push_back(std::get<0>(rows.min(0)));
    hi.push_back(std::get<0>(rows.max(0)));
  }
  std::vector<double> score(pages.size(), 0.0);
  const auto add_softmax = [&](const std::vector<double>& bound) {
    const double mx = *std::max_element(bound.begin(), bound.end());
    double z = 0;
    for (double b : bound) z += std::exp(b - mx);
    for (size_t p = 0; p < pages.size(); ++p) score[p] += std::exp(bound[p] - mx) / z;
  };
  // TierScoring::kHeadMean: per query one softmax of the heads' mean bound (latent: the bound of
  // the heads' mean query; expanded: the mean of the heads' bounds).
  for (int64_t j = 0; j < Q && head_mean && !pages.empty(); ++j) {
    std::vector<double> bound(pages.size(), 0.0);
    for (size_t p = 0; p < pages.size(); ++p) {
      if (G == 1) {
        const auto qm = q.select(1, j).mean(0);
        bound[p] = at::maximum(qm * lo[p][0], qm * hi[p][0]).sum().item<double>() * scale;
      } else {
        for (int64_t h = 0; h < H; ++h)
          bound[p] += at::maximum(q[h][j] * lo[p][h], q[h][j] * hi[p][h]).sum().item<double>() * scale / H;
      }
    }
    add_softmax(bound);
  }
  for (int64_t h = 0; h < H && !pages.empty() && !head_mean; ++h) {
    const int64_t g = G == 1 ? 0 : h;
    for (int64_t j = 0; j < Q; ++j) {
      const auto qv = q[h][j];
      std::vector<double> bound;
      for (size_t p = 0; p < pages.size(); ++p) {
        bound.push_back(at::maximum(qv * lo[p][g], qv * hi[p][g]).sum().item<double>() * scale);
      }
      add_softmax(bound);
    }
  }
  struct Cand {
    double score;
    int64_t position;
  };
  std::vector<Cand> cands;
  for (int64_t s = 0; s < cache_pos.size(0); ++s) {
    const int64_t p = cache_pos[s].item<int64_t>();
    if (p >= n_sink && p < recent_from) cands.push_back({cache_scores[s].item<double>(), p});
  }
  std::sort(cands.begin(), cands.end(), [](const Cand& a, const Cand& b) {
    return a.score != b.score ? a.score < b.score : a.position < b.position;
  });
  std::vector<size_t> order(pages.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return score[a] != score[b] ? score[a] > score[b] : pages[a] < pages[b];
  });
  RecallPlan plan;
  const int64_t limit = std::min<int64_t>(tokens, static_cast<int64_t>(cands.size()));
  const bool two_level = tokens > 0 && rescore > tokens;
  int64_t left = two_level ? rescore : limit;
  std::vector<int64_t> pool;  // tier indices
  for (const size_t p : order) {
    const auto m = static_cast<int64_t>(members[pages[p]].size());
    if (m > left || left == 0) continue;
    for (const int64_t i : members[pages[p]]) pool.push_back(i);
    left -= m;
  }
  if (two_level) {
    std::sort(pool.begin(), pool.end());  // tier indices ascend with position
    std::vector<double> exact(pool.size(), 0.0);
    // kHeadMean: per query one softmax over the pool of the heads' mean exact logit.
    for (int64_t j = 0; j < Q && head_mean && !pool.empty(); ++j) {
      std::vector<double> logit(pool.size(), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        for (size_t t = 0; t < pool.size(); ++t)
          logit[t] += (q[h][j] * k[pool[t]][G == 1 ? 0 : h]).sum().item<double>() * scale / H;
      }
      const double mx = *std::max_element(logit.begin(), logit.end());
      double z = 0;
      for (double l : logit) z += std::exp(l - mx);
      for (size_t t = 0; t < pool.size(); ++t) exact[t] += std::exp(logit[t] - mx) / z;
    }
    for (int64_t h = 0; h < H && !pool.empty() && !head_mean; ++h) {
      const int64_t g = G == 1 ? 0 : h;
      for (int64_t j = 0; j < Q; ++j) {
        std::vector<double> logit;
        for (const int64_t i : pool) logit.push_back((q[h][j] * k[i][g]).sum().item<double>() * scale);
        const double mx = *std::max_element(logit.begin(), logit.end());
        double z = 0;
        for (double l : logit) z += std::exp(l - mx);
        for (size_t t = 0; t < pool.size(); ++t) exact[t] += std::exp(logit[t] - mx) / z;
      }
    }
    std::vector<size_t> by(pool.size());
    std::iota(by.begin(), by.end(), size_t{0});
    std::stable_sort(by.begin(), by.end(), [&](size_t a, size_t b) { return exact[a] > exact[b]; });
    by.resize(std::min<size_t>(by.size(), static_cast<size_t>(limit)));
    std::vector<int64_t> kept;
    for (const size_t t : by) kept.push_back(pool[t]);
    pool = kept;
  }
  for (const int64_t i : pool) plan.recalled.push_back(tier_pos[i].item<int64_t>());
  std::sort(plan.recalled.begin(), plan.recalled.end());
  for (size_t i = 0; i < plan.recalled.size(); ++i) plan.victims.push_back(cands[i].position);
  std::sort(plan.victims.begin(), plan.victims.end());
  if (!cands.empty()) plan.top_score = static_cast<float>(cands.back().score);
  return plan;
}

/// Per row, position -> the token's rows, for the bit-for-bit checks.
using RowsByPosition = std::vector<std::map<int64_t, std::pair<at::Tensor, at::Tensor>>>;

/// Slot s of row r: its rows as the oracle keeps them (latent [W], [R]; expanded [H, D]).
std::pair<at::Tensor, at::Tensor> cached_token(const kvevict::MlaLatentCache& c, int64_t r, int64_t s) {
  return {c.ckv(0)[r][s], c.kpe(0)[r][s]};
}
std::pair<at::Tensor, at::Tensor> cached_token(const kvevict::MlaCache& c, int64_t r, int64_t s) {
  return {c.keys(0)[r].select(1, s), c.values(0)[r].select(1, s)};
}

/// Checks that row r of `cache` and of its tier hold, at each position, the rows of `rows`.
template <class Cache>
void check_rows_by_position(const Cache& cache, int64_t r, const RowsByPosition& rows) {
  const auto pos = cache.positions(0);
  for (int64_t s = 0; s < cache.size(0, r); ++s) {
    const int64_t p = pos[r][s].template item<int64_t>();
    CAPTURE(r, s, p);
    const auto& want = rows[r].at(p);
    const auto got = cached_token(cache, r, s);
    CHECK(at::equal(got.first, want.first));
    CHECK(at::equal(got.second, want.second));
  }
  const auto tp = cache.tier_positions(0, r);
  const auto tr = cache.tier_rows(0, r);
  for (int64_t i = 0; i < tp.size(0); ++i) {
    const auto& want = rows[r].at(tp[i].template item<int64_t>());
    CHECK(at::equal(split_token(tr.first, i), want.first));
    CHECK(at::equal(split_token(tr.second, i), want.second));
  }
}

std::vector<int64_t> sorted_positions(const at::Tensor& pos_row, int64_t n) {
  std::vector<int64_t> v;
  for (int64_t s = 0; s < n; ++s) v.push_back(pos_row[s].item<int64_t>());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST_CASE("recall swaps the pages an oracle scores best for the lowest heavy hitters, rows bit for bit",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  at::manual_seed(11);
  const int64_t tier_budget = GENERATE(int64_t{1000}, int64_t{12});  // unbounded, and dropping (digests shrink)
  const int64_t page = GENERATE(int64_t{1}, int64_t{3});
  const int64_t tokens = GENERATE(int64_t{2}, int64_t{6});
  const int64_t rescore = GENERATE(int64_t{0}, int64_t{7});  // whole pages; two-level
  const auto scoring = GENERATE(kvevict::TierScoring::kPerHead, kvevict::TierScoring::kHeadMean);
  const bool head_mean = scoring == kvevict::TierScoring::kHeadMean;
  CAPTURE(tier_budget, page, tokens, rescore, head_mean);
  const auto eviction = EvictionOptions(5).n_sink(1).n_recent(2);
  const int64_t B = 2, H = 2;
  const std::vector<int64_t> counts{1, 2};  // ragged rows
  const double scale = 0.7;
  const auto run = [&](auto& cache, int64_t D, auto&& make_rows, auto&& split, auto&& tier_keys,
                       auto&& recall) {
    RowsByPosition rows(B);
    int64_t recalls = 0;
    for (int64_t step = 0; step < 24; ++step) {
      const int64_t T = 2;
      auto [a, b] = make_rows(T);
      std::vector<int64_t> seen{cache.seen_tokens(0, 0), cache.seen_tokens(0, 1)};
      cache.update(0, a, b, counts);
      for (int64_t r = 0; r < B; ++r)
        for (int64_t j = 0; j < counts[r]; ++j) rows[r][seen[r] + j] = split(a, b, r, T - counts[r] + j);
      if (step % 3 == 2) {
        const auto query = at::randn({B, H, T, D});
        const auto pos = cache.positions(0), sc = cache.scores(0);
        std::vector<RecallPlan> plans;
        for (int64_t r = 0; r < B; ++r) {
          const int64_t len = cache.size(0, r);
          // the row's real queries: the last counts[r] columns
          plans.push_back(oracle_recall(tier_keys(cache, r), cache.tier_positions(0, r),
                                        query[r].narrow(1, T - counts[r], counts[r]), scale, tokens, rescore, page,
                                        pos[r].narrow(0, 0, len), sc[r].narrow(0, 0, len), 1,
                                        cache.seen_tokens(0, r) - counts[r] - 2,  // the window before this append
                                        head_mean));
        }
        int64_t expected = 0;
        for (auto& p : plans) expected += static_cast<int64_t>(p.recalled.size());
        const auto tier_before0 = sorted_positions(cache.tier_positions(0, 0), cache.tier_size(0, 0));
        const auto size_before = std::vector<int64_t>{cache.size(0, 0), cache.size(0, 1)};
        CHECK(kvevict_test::total(recall(cache, query)) == expected);
        recalls += expected;
        const auto pos_after = cache.positions(0), sc_after = cache.scores(0);
        for (int64_t r = 0; r < B; ++r) {
          CAPTURE(step, r);
          CHECK(cache.size(0, r) == size_before[r]);  // capacity stays a cap
          const auto now = sorted_positions(pos_after[r], cache.size(0, r));
          for (const int64_t p : plans[r].recalled) {
            CHECK(std::binary_search(now.begin(), now.end(), p));
            for (int64_t s = 0; s < cache.size(0, r); ++s) {
              if (pos_after[r][s].template item<int64_t>() == p) CHECK(sc_after[r][s].template item<float>() == plans[r].top_score);
            }
          }
          const auto tier = sorted_positions(cache.tier_positions(0, r), cache.tier_size(0, r));
          for (const int64_t p : plans[r].victims) CHECK(std::binary_search(tier.begin(), tier.end(), p));
          check_rows_by_position(cache, r, rows);
        }
      }
      cache.observe(0, at::softmax(at::randn({B, H, T, cache.size(0)}), -1).mul(
                           cache.positions(0).ge(0).view({B, 1, 1, -1}).to(at::kFloat)));
      cache.evict(0);
    }
    CHECK(recalls > 0);  // the test saw recalls happen
  };
  SECTION("latent") {
    const int64_t W = 5, R = 3;
    kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, H)
                                      .batch_size(B)
                                      .kv_lora_rank(W)
                                      .qk_rope_dim(R)
                                      .check_observations(false)
                                      .tier_tokens(tier_budget)
                                      .tier_page_size(page)
                                      .tier_scoring(scoring),
                                  eviction);
    run(
        cache, W + R, [&](int64_t T) { return std::make_pair(at::randn({B, T, W}), at::randn({B, T, R})); },
        [](const at::Tensor& a, const at::Tensor& b, int64_t r, int64_t t) {
          return std::make_pair(a[r][t].clone(), b[r][t].clone());
        },
        [](const kvevict::MlaLatentCache& c, int64_t r) {
          auto t = c.tier_rows(0, r);
          return at::cat({t.first, t.second}, -1).unsqueeze(1);  // [n, 1, W + R]
        },
        [&](kvevict::MlaLatentCache& c, const at::Tensor& q) {
          return c.recall_absorbed(0, q.narrow(-1, 0, W), q.narrow(-1, W, R), scale, tokens, rescore);
        });
  }
  SECTION("expanded") {
    const int64_t D = 6;
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, H)
                                .batch_size(B)
                                .qk_dim(D)
                                .v_dim(4)
                                .check_observations(false)
                                .tier_tokens(tier_budget)
                                .tier_page_size(page)
                                .tier_scoring(scoring),
                            eviction);
    run(
        cache, D, [&](int64_t T) { return std::make_pair(at::randn({B, H, T, D}), at::randn({B, H, T, 4})); },
        [](const at::Tensor& a, const at::Tensor& b, int64_t r, int64_t t) {
          return std::make_pair(a[r].select(1, t).clone(), b[r].select(1, t).clone());
        },
        [](const kvevict::MlaCache& c, int64_t r) { return c.tier_rows(0, r).first.transpose(0, 1); },  // [n, H, D]
        [&](kvevict::MlaCache& c, const at::Tensor& q) { return c.recall(0, q, scale, tokens, rescore); });
  }
}

TEST_CASE("recall by hand: the Quest bound picks the page, whole pages only", "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  // One head, 2-wide keys, pages of 2. No sink, no recent window, 2 heavy hitters: tokens 0..5
  // with scores 9, 8, 0, 0, 0, 0 evict positions 2..5 into the tier as pages {2, 3} and {4, 5}.
  // Page 1 (positions 2, 3): keys (1, 0), (0, 1): lo (0, 0), hi (1, 1).
  // Page 2 (positions 4, 5): keys (2, -1), (3, -2): lo (2, -2), hi (3, -1).
  // q = (1, 0): bounds 1 (page 1) and 3 (page 2); q = (0, 1): 1 and -1. Then one more token
  // (position 6): victims come from below the window before that append, positions 0 and 1.
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 1).qk_dim(2).v_dim(1).tier_tokens(10).tier_page_size(2),
                          EvictionOptions(2).n_sink(0).n_recent(0));
  const auto keys = at::tensor({5.f, 5.f, 5.f, 5.f, 1.f, 0.f, 0.f, 1.f, 2.f, -1.f, 3.f, -2.f}).view({1, 1, 6, 2});
  cache.update(0, keys, at::arange(6, at::kFloat).view({1, 1, 6, 1}));
  cache.add_scores(0, at::tensor({9.f, 8.f, 0.f, 0.f, 0.f, 0.f}).view({1, 6}));
  cache.evict(0);
  REQUIRE(sorted_positions(cache.tier_positions(0, 0), 4) == std::vector<int64_t>{2, 3, 4, 5});
  cache.update(0, at::zeros({1, 1, 1, 2}), at::full({1, 1, 1, 1}, 6.f));
  SECTION("q = (1, 0) recalls page 2 in place of the two heavy hitters, lowest (position 1) first") {
    CHECK(kvevict_test::total(cache.recall(0, at::tensor({1.f, 0.f}).view({1, 1, 1, 2}), 1.0, 2)) == 2);
    CHECK(sorted_positions(cache.positions(0)[0], 3) == std::vector<int64_t>{4, 5, 6});
    CHECK(sorted_positions(cache.tier_positions(0, 0), 4) == std::vector<int64_t>{0, 1, 2, 3});
    // The recalled tokens take the best heavy hitter's state (9); the victims keep theirs in the tier.
    CHECK(at::equal(cache.tier_scores(0, 0), at::tensor({9.f, 8.f, 0.f, 0.f})));
    // Rows and values bit for bit at their positions (value = position).
    const auto pos = cache.positions(0);
    const auto sc = cache.scores(0);
    for (int64_t s = 0; s < 2; ++s) {
      const int64_t p = pos[0][s].item<int64_t>();
      CHECK(cache.values(0)[0][0][s][0].item<float>() == static_cast<float>(p));
      CHECK(at::equal(cache.keys(0)[0][0][s], keys[0][0][p]));
      CHECK(sc[0][s].item<float>() == 9.f);
    }
  }
  SECTION("q = (0, 1) recalls page 1; a budget of 1 token recalls nothing (whole pages only)") {
    CHECK(kvevict_test::total(cache.recall(0, at::tensor({0.f, 1.f}).view({1, 1, 1, 2}), 1.0, 1)) == 0);
    CHECK(kvevict_test::total(cache.recall(0, at::tensor({0.f, 1.f}).view({1, 1, 1, 2}), 1.0, 0)) == 0);
    CHECK(kvevict_test::total(cache.recall(0, at::tensor({0.f, 1.f}).view({1, 1, 1, 2}), 1.0, 2)) == 2);
    CHECK(sorted_positions(cache.positions(0)[0], 3) == std::vector<int64_t>{2, 3, 6});
  }
  SECTION("two-level: the best pages are the pool, and the pool's best tokens come back one by one") {
    // q = (1, 0), 1 token, a pool of 2: page 2 (bound 3) is the pool; exact logits 2 (position
    // 4) and 3 (position 5): position 5 comes back, in place of position 1 (score 8).
    CHECK(kvevict_test::total(cache.recall(0, at::tensor({1.f, 0.f}).view({1, 1, 1, 2}), 1.0, 1, 2)) == 1);
    CHECK(sorted_positions(cache.positions(0)[0], 3) == std::vector<int64_t>{0, 5, 6});
    CHECK(sorted_positions(cache.tier_positions(0, 0), 4) == std::vector<int64_t>{1, 2, 3, 4});
    // Now the cache holds 0 (score 9), 5 (9, the best heavy hitter's) and 6; the tier 1 (its key
    // (5, 5)), 2, 3, 4. q = (0, 1), 1 token, a pool of 4: page 0 = {1} (bound 5), page 1 =
    // {2, 3} (bound 1), page 2 = {4} (bound -1) all fit; exact logits 5, 0, 1, -1: position 1
    // comes back, in place of position 0 (equal scores: the older goes first).
    CHECK(kvevict_test::total(cache.recall(0, at::tensor({0.f, 1.f}).view({1, 1, 1, 2}), 1.0, 1, 4)) == 1);
    CHECK(sorted_positions(cache.positions(0)[0], 3) == std::vector<int64_t>{1, 5, 6});
    CHECK(sorted_positions(cache.tier_positions(0, 0), 4) == std::vector<int64_t>{0, 2, 3, 4});
  }
  SECTION("at a 100% budget nothing is in the tier and recall changes nothing") {
    kvevict::MlaCache full(kvevict::MlaCacheOptions(1, 1).qk_dim(2).v_dim(1).tier_tokens(10).tier_page_size(2),
                           EvictionOptions(6).n_sink(0).n_recent(0));
    full.update(0, keys, at::arange(6, at::kFloat).view({1, 1, 6, 1}));
    full.evict(0);
    const auto k = full.keys(0).clone();
    CHECK(kvevict_test::total(full.recall(0, at::tensor({1.f, 0.f}).view({1, 1, 1, 2}), 1.0, 6)) == 0);
    CHECK(at::equal(full.keys(0), k));
  }
}

TEST_CASE("recall by hand: per head, one head's sharp attention wins; by the heads' mean logit, the heads' common choice",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  const auto scoring = GENERATE(kvevict::TierScoring::kPerHead, kvevict::TierScoring::kHeadMean);
  // Whole pages, and two-level with all three tier tokens in the pool: its exact rescoring
  // follows the scoring too (per head, or by the heads' mean).
  const int64_t rescore = GENERATE(int64_t{0}, int64_t{3});
  CAPTURE(tensor_path, scoring == kvevict::TierScoring::kHeadMean, rescore);
  // Two heads, pages of 1, scale 1. Positions 0, 1 (scores 9, 8) stay as the heavy hitters;
  // positions 2, 3, 4 go to the tier. Head 0's logits on them are 10, 1, 1 and head 1's are
  // -12, 2, 1.5 (expanded: keys (10, -12), (1, 2), (1, 1.5) per head, queries 1 and 1; latent:
  // the same keys as [ckv | kpe], queries (1, 0) and (0, 1)).
  // Per head: softmaxes (0.99975, 0.00012, 0.00012) and (5e-7, 0.6225, 0.3775): position 2
  // scores 0.99975, 3 scores 0.6226, 4 scores 0.3776.
  // Heads' mean: logits -1, 1.5, 1.25: softmax (0.0441, 0.5374, 0.4185): position 3 is best.
  // One token comes back, in place of position 1 (the lowest heavy hitter).
  const int64_t want = scoring == kvevict::TierScoring::kPerHead ? 2 : 3;
  const auto eviction = EvictionOptions(2).n_sink(0).n_recent(0);
  const auto head0 = at::tensor({0.f, 0.f, 10.f, 1.f, 1.f}), head1 = at::tensor({0.f, 0.f, -12.f, 2.f, 1.5f});
  const auto check = [&](auto& cache, auto&& append, auto&& recall) {
    cache.add_scores(0, at::tensor({9.f, 8.f, 0.f, 0.f, 0.f}).view({1, 5}));
    cache.evict(0);
    REQUIRE(sorted_positions(cache.tier_positions(0, 0), 3) == std::vector<int64_t>{2, 3, 4});
    append(cache);  // position 5
    CHECK(kvevict_test::total(recall(cache)) == 1);
    CHECK(sorted_positions(cache.positions(0)[0], 3) == std::vector<int64_t>{0, want, 5});
  };
  SECTION("expanded") {
    kvevict::MlaCache cache(
        kvevict::MlaCacheOptions(1, 2).qk_dim(1).v_dim(1).tier_tokens(10).tier_page_size(1).tier_scoring(scoring),
        eviction);
    cache.update(0, at::stack({head0, head1}).view({1, 2, 5, 1}), at::zeros({1, 2, 5, 1}));
    check(cache, [](kvevict::MlaCache& c) { c.update(0, at::zeros({1, 2, 1, 1}), at::zeros({1, 2, 1, 1})); },
          [&](kvevict::MlaCache& c) { return c.recall(0, at::ones({1, 2, 1, 1}), 1.0, 1, rescore); });
  }
  SECTION("latent") {
    kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, 2)
                                      .kv_lora_rank(1)
                                      .qk_rope_dim(1)
                                      .tier_tokens(10)
                                      .tier_page_size(1)
                                      .tier_scoring(scoring),
                                  eviction);
    cache.update(0, head0.view({1, 5, 1}), head1.view({1, 5, 1}));
    check(cache, [](kvevict::MlaLatentCache& c) { c.update(0, at::zeros({1, 1, 1}), at::zeros({1, 1, 1})); },
          [&](kvevict::MlaLatentCache& c) {
      return c.recall_absorbed(0, at::tensor({1.f, 0.f}).view({1, 2, 1, 1}), at::tensor({0.f, 1.f}).view({1, 2, 1, 1}),
                               1.0, 1, rescore);
    });
  }
}

TEST_CASE("recall skips whole pages that do not fit, however many rank above the best that does", "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  // One head, 1-wide keys (key of position p: p / 10), pages of 2, 2 heavy hitters, no sink or
  // window. 84 tokens, positions 0 and 50 scored 9: the other 82 go to the tier, so page 0 =
  // {1} and page 25 = {51} hold one token each, and the other 40 pages two. q = 1: a page's
  // bound is its largest key, so pages rank by id, 41 first (page 0's softmax share, about
  // 5e-5, is well above 2^-32). With a budget of 1 token the 16 two-token pages above page 25
  // are skipped, and page 25 ({51}) comes back, not page 0 ({1}), in place of position 0 (of
  // the two heavy hitters, both 9, the older goes first; both lie below the window before the
  // latest append, position 84).
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 1).qk_dim(1).v_dim(1).tier_tokens(100).tier_page_size(2),
                          EvictionOptions(2).n_sink(0).n_recent(0));
  cache.update(0, at::arange(84, at::kFloat).div_(10).view({1, 1, 84, 1}), at::zeros({1, 1, 84, 1}));
  auto scores = at::zeros({1, 84});
  scores[0][0] = 9.f;
  scores[0][50] = 9.f;
  cache.add_scores(0, scores);
  cache.evict(0);
  REQUIRE(cache.tier_size(0, 0) == 82);
  cache.update(0, at::zeros({1, 1, 1, 1}), at::zeros({1, 1, 1, 1}));
  CHECK(kvevict_test::total(cache.recall(0, at::ones({1, 1, 1, 1}), 1.0, 1)) == 1);
  CHECK(sorted_positions(cache.positions(0)[0], 3) == std::vector<int64_t>{50, 51, 84});
  const auto tier = sorted_positions(cache.tier_positions(0, 0), cache.tier_size(0, 0));
  REQUIRE(tier.size() == 82);
  CHECK(tier[0] == 0);
  CHECK(tier[1] == 1);
  CHECK(std::find(tier.begin(), tier.end(), 51) == tier.end());
}

TEST_CASE("recall: bad input gets a clear error and changes nothing", "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  at::manual_seed(13);
  kvevict::MlaLatentCache cache(
      kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(4).qk_rope_dim(2).tier_tokens(20).tier_page_size(2),
      EvictionOptions(3).n_sink(1).n_recent(1));
  for (int i = 0; i < 12; ++i) {
    cache.update(0, at::randn({1, 1, 4}), at::randn({1, 1, 2}));
    cache.observe(0, at::softmax(at::randn({1, 2, 1, cache.size(0)}), -1));
    cache.evict(0);
  }
  const auto pos = cache.positions(0), sc = cache.scores(0), ckv = cache.ckv(0).clone();
  const auto tier = cache.tier_positions(0, 0);
  const auto qa = at::randn({1, 2, 1, 4}), qp = at::randn({1, 2, 1, 2});
  const auto msg = [&](auto&& f) { return kvevict_test::message_of(f); };
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, at::randn({1, 2, 1, 5}), qp, 1.0, 4); }),
             Contains("q_absorbed") && Contains("kv_lora_rank"));
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa, at::randn({1, 2, 2, 2}), 1.0, 4); }), Contains("q_pe"));
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa.mul(NAN), qp, 1.0, 4); }), Contains("finite"));
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa, qp, 0.0, 4); }), Contains("scale must be finite and > 0, got 0"));
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa, qp, 1.0, -1); }), Contains("tokens must be in [0, 2^40], got -1"));
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa, qp, 1.0, 4, -1); }), Contains("rescore must be in [0, 2^40], got -1"));
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa, qp, 1.0, 0, 1); }),
             Contains("rescore must be <= tokens (0, whole pages) or hold at least one page (tier_page_size 2)") &&
                 Contains("got 1"));
  CHECK_THROWS_AS(cache.recall_absorbed(1, qa, qp, 1.0, 4), c10::IndexError);
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa.to(at::kLong), qp, 1.0, 4); }), Contains("floating"));
  cache.observe_begin(0, 1);
  CHECK_THAT(msg([&] { cache.recall_absorbed(0, qa, qp, 1.0, 4); }), Contains("open observation"));
  cache.observe_discard(0);
  CHECK(at::equal(cache.positions(0), pos));
  CHECK(at::equal(cache.scores(0), sc));
  CHECK(at::equal(cache.ckv(0), ckv));
  CHECK(at::equal(cache.tier_positions(0, 0), tier));
  kvevict::MlaLatentCache none(kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(4).qk_rope_dim(2),
                               EvictionOptions(3).n_sink(1).n_recent(1));
  CHECK_THAT(msg([&] { none.recall_absorbed(0, qa, qp, 1.0, 4); }), Contains("no host tier"));
  CHECK_THAT(msg([&] { kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, 1).tier_page_size(0)); }),
             Contains("tier_page_size must be in [1, 2^20], got 0"));
  CHECK_THAT(msg([&] {
               kvevict::MlaLatentCache(
                   kvevict::MlaLatentCacheOptions(1, 1).tier_scoring(static_cast<kvevict::TierScoring>(7)));
             }),
             Contains("tier_scoring must be kPerHead or kHeadMean, got 7"));
  // A good call still works afterwards.
  CHECK(kvevict_test::total(cache.recall_absorbed(0, qa, qp, 1.0, 4)) >= 0);
}

TEST_CASE("a NaN key is left out of its page's digest, whichever member of the page it is, on both paths",
          "[tier][recall][cpu]") {
  // Page 0 holds {NaN, 1} or {1, NaN} (positions 0 and 1), page 1 {2, 3}: the NaN channel is left
  // out, so page 0's bound is its finite key's and a query recalls both pages alike. Observation
  // checks off: with them on, update refuses a non-finite key.
  const bool nan_first = GENERATE(true, false);
  CAPTURE(nan_first);
  std::vector<int64_t> recalled;
  std::vector<at::Tensor> tiers;
  for (const bool tensor_path : {false, true}) {
    CAPTURE(tensor_path);
    kvevict_test::ForceTensorPath force(tensor_path);
    kvevict::MlaLatentCache c(
        kvevict::MlaLatentCacheOptions(1, 1).kv_lora_rank(1).qk_rope_dim(1).tier_tokens(100).tier_page_size(2)
            .check_observations(false),
        EvictionOptions(3).n_sink(0).n_recent(0));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    c.update(0, at::tensor({nan_first ? nan : 1.f, nan_first ? 1.f : nan, 2.f, 3.f, 0.f, 0.f, 0.f}).view({1, 7, 1}),
             at::ones({1, 7, 1}));
    c.add_scores(0, at::tensor({0.f, 0.f, 0.f, 0.f, 1.f, 1.f, 1.f}).view({1, 7}));
    c.evict(0);  // positions 0..3 go to the tier
    REQUIRE(c.tier_size(0, 0) == 4);
    c.update(0, at::zeros({1, 1, 1}), at::zeros({1, 1, 1}));
    recalled.push_back(kvevict_test::total(c.recall_absorbed(0, at::ones({1, 1, 1, 1}), at::ones({1, 1, 1, 1}), 1.0, 8)));
    tiers.push_back(c.tier_positions(0, 0));
  }
  CHECK(recalled[0] == 2);  // whole pages: the 3 victims make room for one page of 2
  CHECK(recalled[1] == recalled[0]);
  CHECK(at::equal(tiers[0], tiers[1]));
}

TEST_CASE("recall: a reduction across processes that fails comes out as its own error and changes nothing",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  const auto scoring = GENERATE(kvevict::TierScoring::kPerHead, kvevict::TierScoring::kHeadMean);
  const int64_t rescore = GENERATE(0, 6);  // whole pages, and two-level (per head, a second reduction)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path, static_cast<int>(scoring), rescore);
  bool armed = false;  // count the reductions (the recall's), failing the one numbered fail_at
  int64_t calls = 0, fail_at = 0;
  const auto build = [&] {
    at::manual_seed(17);
    kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, 2)
                                      .kv_lora_rank(4)
                                      .qk_rope_dim(2)
                                      .tier_tokens(20)
                                      .tier_page_size(2)
                                      .tier_scoring(scoring)
                                      .reduce_contributions([&](int64_t, at::Tensor&) {
                                        KVEVICT_CHECK(!armed || ++calls != fail_at, "reducer down at call ", calls);
                                      }),
                                  EvictionOptions(3).n_sink(1).n_recent(1));
    for (int i = 0; i < 12; ++i) {
      cache.update(0, at::randn({1, 1, 4}), at::randn({1, 1, 2}));
      cache.observe(0, at::softmax(at::randn({1, 2, 1, cache.size(0)}), -1));
      cache.evict(0);
    }
    return cache;
  };
  const auto qa = at::randn({1, 2, 1, 4}), qp = at::randn({1, 2, 1, 2});
  auto good = build();
  armed = true;
  CHECK(kvevict_test::total(good.recall_absorbed(0, qa, qp, 1.0, 2, rescore)) > 0);
  const int64_t reductions = calls;
  // The page scores', and the pool's; by the heads' mean the pool reuses the pages' mean query,
  // reduced once.
  CHECK(reductions == (rescore > 0 && scoring == kvevict::TierScoring::kPerHead ? 2 : 1));
  for (fail_at = 1; fail_at <= reductions; ++fail_at) {
    CAPTURE(fail_at);
    armed = false;
    auto cache = build();
    armed = true;
    calls = 0;
    const auto pos = cache.positions(0), sc = cache.scores(0), ckv = cache.ckv(0).clone();
    const auto tier = cache.tier_positions(0, 0);
    const auto msg = kvevict_test::message_of([&] { cache.recall_absorbed(0, qa, qp, 1.0, 2, rescore); });
    CHECK_THAT(msg, Contains("reducer down at call " + std::to_string(fail_at)));
    CHECK_THAT(msg, !Contains("allocate"));
    CHECK(at::equal(cache.positions(0), pos));
    CHECK(at::equal(cache.scores(0), sc));
    CHECK(at::equal(cache.ckv(0), ckv));
    CHECK(at::equal(cache.tier_positions(0, 0), tier));
    CHECK(cache.stats(0).tier_recalled == 0);
  }
}

TEST_CASE("an allocation failure at any point of a recall changes nothing, on both paths", "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  const int64_t two_level = GENERATE(0, 8);  // whole pages, and a two-level pool of 8
  CAPTURE(two_level);
  // What a recall may change: positions, scores, rows, the tier's tokens, ranks and rows.
  const auto snapshot = [](const kvevict::MlaLatentCache& c) {
    std::vector<at::Tensor> v{c.positions(0).clone(), c.scores(0).clone(), c.ckv(0).clone(), c.kpe(0).clone()};
    for (int64_t r = 0; r < c.batch_size(); ++r) {
      v.push_back(c.tier_positions(0, r));
      v.push_back(c.tier_scores(0, r));
      v.push_back(c.tier_rows(0, r).first);
      v.push_back(c.tier_rows(0, r).second);
    }
    return v;
  };
  bool completed = false;
  for (int64_t fail_at = 1; fail_at < 400 && !completed; ++fail_at) {
    INFO("failing allocation " << fail_at);
    at::manual_seed(13);
    kvevict::MlaLatentCache c(kvevict::MlaLatentCacheOptions(1, 2).batch_size(2).kv_lora_rank(4).qk_rope_dim(2)
                                  .qk_nope_dim(2).tier_tokens(16).tier_page_size(2),
                              EvictionOptions(3).n_sink(1).n_recent(2));  // capacity 6
    c.update(0, at::randn({2, 12, 4}), at::randn({2, 12, 2}));
    c.add_scores(0, at::rand({2, 12}));
    c.evict(0);
    c.update(0, at::randn({2, 1, 4}), at::randn({2, 1, 2}));
    const auto qa = at::randn({2, 2, 1, 4}), qp = at::randn({2, 2, 1, 2});
    const auto before = snapshot(c);
    at::Tensor recalled;
    bool failed = false;
    {
      kvevict_test::CountingCpuAllocator failing;
      failing.fail_at(fail_at);
      try {
        recalled = c.recall_absorbed(0, qa, qp, 0.5, 2, two_level);
      } catch (const c10::Error&) {
        failed = true;
      }
      if (failed) CHECK(failing.failed());
    }
    const auto after = snapshot(c);
    if (failed) {
      for (size_t i = 0; i < before.size(); ++i) {
        CAPTURE(i);
        CHECK(at::equal(before[i], after[i]));
      }
    } else {
      completed = true;
      CHECK(kvevict_test::total(recalled) > 0);
      CHECK_FALSE(at::equal(before[0], after[0]));
    }
  }
  CHECK(completed);
}

namespace {

/// compress_prompt without a tier leaves a layer as with one, but for the tier: the kept tokens
/// at their prompt positions (in position order), seen tokens T, the dropped ones counted as
/// evicted in one event, the same latest append, query positions and ranks.
template <class Cache>
void same_press(const Cache& plain, const Cache& tiered) {
  CHECK(plain.stats(0).tokens_evicted == tiered.stats(0).tokens_evicted);
  CHECK(plain.stats(0).eviction_events == 1);
  CHECK(tiered.stats(0).eviction_events == 1);
  CHECK(at::equal(plain.policy().query_positions(0, 3), tiered.policy().query_positions(0, 3)));
  for (int64_t b = 0; b < plain.batch_size(); ++b) {
    CAPTURE(b);
    CHECK(plain.seen_tokens(0, b) == tiered.seen_tokens(0, b));
    CHECK(plain.policy().appended(0, b) == tiered.policy().appended(0, b));
    const int64_t n = plain.size(0, b);
    REQUIRE(tiered.size(0, b) == n);
    const auto pos = plain.positions(0)[b].narrow(0, 0, n);
    CHECK(kvevict_test::to_vec<int64_t>(pos) == sorted_positions(tiered.positions(0)[b], n));
    CHECK(kvevict_test::to_vec<int64_t>(pos) == sorted_positions(pos, n));  // position order
    // Each kept token's rank, by position.
    const auto order = std::get<1>(at::sort(tiered.positions(0)[b].narrow(0, 0, n)));
    CHECK(at::equal(plain.scores(0)[b].narrow(0, 0, n), tiered.scores(0)[b].narrow(0, 0, n).index_select(0, order)));
  }
}

}  // namespace

TEST_CASE("compress_prompt with a tier keeps the same tokens, at their prompt positions, and sends the rest to the tier",
          "[tier][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  at::manual_seed(17);
  const int64_t B = 2, H = 2, T = 40, D = 6, V = 3;
  const auto e = EvictionOptions(8).n_sink(2).n_recent(4).evict_every(3);  // evict_every waits; the pass must not
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto causal = at::ones({T, T}, at::kBool).triu(1);
  SECTION("expanded") {
    const auto q = at::randn({B, H, T, D}), k = at::randn({B, H, T, D}), v = at::randn({B, H, T, V});
    const auto lse = at::logsumexp(at::matmul(q, k.transpose(-2, -1)).mul(scale).masked_fill(causal, -INFINITY), -1);
    const auto opts = kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(D).v_dim(V);
    kvevict::MlaCache plain(opts, e), tiered(kvevict::MlaCacheOptions(opts).tier_tokens(100), e);
    const auto keep = kvevict::compress_prompt(plain, 0, q, k, v, lse);
    CHECK(at::equal(kvevict::compress_prompt(tiered, 0, q, k, v, lse), keep));
    CHECK(tiered.seen_tokens(0) == T);
    same_press(plain, tiered);
    for (int64_t b = 0; b < B; ++b) {
      CAPTURE(b);
      const auto kept = kvevict_test::to_vec<int64_t>(keep[b]);
      CHECK(sorted_positions(tiered.positions(0)[b], tiered.size(0, b)) == kept);
      const auto pos = tiered.positions(0)[b];
      for (int64_t s = 0; s < tiered.size(0, b); ++s) {
        const int64_t p = pos[s].item<int64_t>();
        CHECK(at::equal(tiered.keys(0)[b].select(1, s), k[b].select(1, p)));
        CHECK(at::equal(tiered.values(0)[b].select(1, s), v[b].select(1, p)));
      }
      std::vector<int64_t> rest;
      for (int64_t t = 0; t < T; ++t) {
        if (!std::binary_search(kept.begin(), kept.end(), t)) rest.push_back(t);
      }
      CHECK(kvevict_test::to_vec<int64_t>(tiered.tier_positions(0, b)) == rest);
      const auto idx = at::tensor(rest, at::kLong);
      CHECK(at::equal(tiered.tier_rows(0, b).first, k[b].index_select(1, idx)));
      CHECK(at::equal(tiered.tier_rows(0, b).second, v[b].index_select(1, idx)));
    }
  }
  SECTION("latent") {
    const int64_t W = 5, R = 3;
    const auto qa = at::randn({B, H, T, W}), qp = at::randn({B, H, T, R});
    const auto ckv = at::randn({B, T, W}), kpe = at::randn({B, T, R});
    const auto logits = at::matmul(qa, ckv.unsqueeze(1).transpose(-2, -1)).add(at::matmul(qp, kpe.unsqueeze(1).transpose(-2, -1)));
    const auto lse = at::logsumexp(logits.mul(scale).masked_fill(causal, -INFINITY), -1);
    const auto opts = kvevict::MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(W).qk_rope_dim(R);
    kvevict::MlaLatentCache plain(opts, e), tiered(kvevict::MlaLatentCacheOptions(opts).tier_tokens(100), e);
    const auto keep = kvevict::compress_prompt_absorbed(plain, 0, qa, qp, ckv, kpe, lse, scale);
    CHECK(at::equal(kvevict::compress_prompt_absorbed(tiered, 0, qa, qp, ckv, kpe, lse, scale), keep));
    same_press(plain, tiered);
    for (int64_t b = 0; b < B; ++b) {
      const auto kept = kvevict_test::to_vec<int64_t>(keep[b]);
      CHECK(sorted_positions(tiered.positions(0)[b], tiered.size(0, b)) == kept);
      CHECK(tiered.tier_size(0, b) == T - static_cast<int64_t>(kept.size()));
      const auto tp = tiered.tier_positions(0, b);
      CHECK(at::equal(tiered.tier_rows(0, b).first, ckv[b].index_select(0, tp)));
      CHECK(at::equal(tiered.tier_rows(0, b).second, kpe[b].index_select(0, tp)));
    }
  }
}

TEST_CASE("compress_prompt is all or nothing: an allocation failure at any step leaves the cache as it was",
          "[tier][errors][cpu]") {
  // Every allocation of the call is failed in turn, with and without a tier, on both paths:
  // those before the append (the scores), in it, and after it (the ranks, the tier's pass,
  // placing the kept tokens at their prompt positions), where the layer is emptied again.
  kvevict_test::on_both_paths([] {
    at::manual_seed(19);
    const int64_t B = 2, H = 2, T = 24, D = 6, V = 3;
    const auto q = at::randn({B, H, T, D}), k = at::randn({B, H, T, D}), v = at::randn({B, H, T, V});
    const auto causal = at::ones({T, T}, at::kBool).triu(1);
    const auto lse = at::logsumexp(at::matmul(q, k.transpose(-2, -1)).div(std::sqrt(double(D))).masked_fill(causal, -INFINITY), -1);
    const auto e = EvictionOptions(4).n_sink(1).n_recent(3);  // capacity 8
    for (const int64_t tier : {int64_t{0}, int64_t{100}}) {
      CAPTURE(tier);
      const auto opts = kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(D).v_dim(V).tier_tokens(tier);
      kvevict::MlaCache reference(opts, e);
      const auto want = kvevict::compress_prompt(reference, 0, q, k, v, lse);
      bool completed = false;
      int64_t refused = 0;
      for (int64_t fail_at = 1; fail_at < 20000 && !completed; ++fail_at) {
        CAPTURE(fail_at);
        kvevict::MlaCache cache(opts, e);
        const int64_t slots = cache.slots(0);
        const auto bytes = cache.stats().bytes_allocated;
        bool threw = false, failed = false;
        {
          kvevict_test::CountingCpuAllocator failing;
          failing.fail_at(fail_at);
          try {
            kvevict::compress_prompt(cache, 0, q, k, v, lse);
          } catch (const c10::Error&) {
            threw = true;
          }
          failed = failing.failed();
        }
        if (!threw) {
          completed = !failed;  // else the failure was a shrink after the pass, which is allowed to fail
          continue;
        }
        ++refused;
        REQUIRE(cache.size(0) == 0);
        CHECK(cache.seen_tokens(0) == 0);
        CHECK(cache.slots(0) == slots);
        CHECK(cache.positions(0).numel() == 0);
        const auto s = cache.stats();
        CHECK(s.tokens_evicted == 0);
        CHECK(s.eviction_events == 0);
        CHECK(s.bytes_allocated == bytes);
        CHECK(s.tier_tokens == 0);
        // The cache is usable: the same call now gives the reference's layer.
        REQUIRE(at::equal(kvevict::compress_prompt(cache, 0, q, k, v, lse), want));
        CHECK(at::equal(cache.positions(0), reference.positions(0)));
        CHECK(at::equal(cache.keys(0), reference.keys(0)));
        CHECK(cache.seen_tokens(0) == T);
        CHECK(cache.stats().tokens_evicted == B * (T - 8));
      }
      CHECK(completed);
      CHECK(refused > 10);
    }
  });
}

TEST_CASE("a request with a tier and recall in a shared batch equals its solo run, bit for bit", "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  // Global steps t = 0..39. Row 0 runs sequence 0 (one token a step) throughout; row 1 runs
  // sequence 2 (two tokens a step) for t < 12, is finished, and runs sequence 1 (two tokens a
  // step) from t = 15 (continuous batching; ragged appends). Every sequence's rows and queries
  // depend on (sequence, its own step), its scores on (sequence, position, t); recall every
  // third t. Each sequence also runs alone in a one-row cache over the same t.
  const int64_t W = 4, R = 2, H = 2, T = 2, steps = 40;
  const auto opts = kvevict::MlaLatentCacheOptions(1, H).kv_lora_rank(W).qk_rope_dim(R).tier_tokens(12).tier_page_size(2);
  const auto e = EvictionOptions(4).n_sink(1).n_recent(2);
  struct Work {
    int64_t seq, step, n;  // seq -1: nothing
  };
  const auto work = [](int64_t row, int64_t seq, int64_t t) -> Work {
    if (row == 0) return seq == 0 ? Work{0, t, 1} : Work{-1, 0, 0};
    if (seq == 2 && t < 12) return {2, t, 2};
    if (seq == 1 && t >= 15) return {1, t - 15, 2};
    return {-1, 0, 0};
  };
  const auto randn = [](std::vector<int64_t> shape, int64_t seq, int64_t step, int64_t what) {
    auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(seq * 100000 + step * 10 + what));
    return at::randn(shape, g);
  };
  // One global step on `c`: rows_work[r] is what row r does.
  const auto run_step = [&](kvevict::MlaLatentCache& c, const std::vector<Work>& rows_work, int64_t t) {
    const int64_t B = c.batch_size();
    auto ckv = at::zeros({B, T, W}), kpe = at::zeros({B, T, R});
    auto qa = at::zeros({B, H, T, W}), qp = at::zeros({B, H, T, R});
    std::vector<int64_t> counts(static_cast<size_t>(B), 0);
    for (int64_t r = 0; r < B; ++r) {
      const auto& w = rows_work[r];
      if (w.seq < 0) continue;
      counts[r] = w.n;
      ckv[r].narrow(0, T - w.n, w.n).copy_(randn({w.n, W}, w.seq, w.step, 0));
      kpe[r].narrow(0, T - w.n, w.n).copy_(randn({w.n, R}, w.seq, w.step, 1));
      qa[r].narrow(1, T - w.n, w.n).copy_(randn({H, w.n, W}, w.seq, w.step, 2));
      qp[r].narrow(1, T - w.n, w.n).copy_(randn({H, w.n, R}, w.seq, w.step, 3));
    }
    c.update(0, ckv, kpe, counts);
    const auto pos = c.positions(0);
    auto sc = at::zeros({B, c.size(0)});
    for (int64_t r = 0; r < B; ++r) {
      const int64_t seq = rows_work[r].seq;
      for (int64_t j = 0; j < c.size(0, r) && seq >= 0; ++j) {
        const int64_t p = pos[r][j].item<int64_t>();
        sc[r][j] = static_cast<float>(((seq + 1) * 7919 + p * 104729 + t * 31) % 1000) / 1000.0f;
      }
    }
    c.add_scores(0, sc);
    if (t % 3 == 2) c.recall_absorbed(0, qa, qp, 0.5, 4);
    c.evict(0);
  };
  kvevict::MlaLatentCache batch(kvevict::MlaLatentCacheOptions(opts).batch_size(2), e);
  std::vector<kvevict::MlaLatentCache> solo;
  for (int i = 0; i < 3; ++i) solo.emplace_back(opts, e);
  std::vector<std::vector<int64_t>> recalled_positions(3);  // some recall must happen in each
  for (int64_t t = 0; t < steps; ++t) {
    if (t == 12) batch.finish(1);
    if (t == 15) REQUIRE(batch.add_sequence() == 1);
    const int64_t seq1 = t < 12 ? 2 : 1;
    run_step(batch, {work(0, 0, t), work(1, seq1, t)}, t);
    for (int64_t q = 0; q < 3; ++q) run_step(solo[q], {work(q == 0 ? 0 : 1, q, t)}, t);
    if (t == 11 || t == steps - 1) {
      // Row r of the batch against its sequence's solo run: positions, scores, rows, tier.
      for (int64_t r = 0; r < 2; ++r) {
        const auto& s = solo[r == 0 ? 0 : seq1];
        CAPTURE(t, r);
        REQUIRE(batch.size(0, r) == s.size(0, 0));
        const int64_t n = s.size(0, 0);
        CHECK(at::equal(batch.positions(0)[r].narrow(0, 0, n), s.positions(0)[0].narrow(0, 0, n)));
        CHECK(at::equal(batch.scores(0)[r].narrow(0, 0, n), s.scores(0)[0].narrow(0, 0, n)));
        CHECK(at::equal(batch.ckv(0)[r].narrow(0, 0, n), s.ckv(0)[0].narrow(0, 0, n)));
        CHECK(at::equal(batch.kpe(0)[r].narrow(0, 0, n), s.kpe(0)[0].narrow(0, 0, n)));
        CHECK(at::equal(batch.tier_positions(0, r), s.tier_positions(0, 0)));
        CHECK(at::equal(batch.tier_rows(0, r).first, s.tier_rows(0, 0).first));
        CHECK(at::equal(batch.tier_scores(0, r), s.tier_scores(0, 0)));
      }
    }
  }
  for (int64_t q = 0; q < 3; ++q) CHECK(solo[q].stats().tier_recalled > 0);
}

TEST_CASE("recall with speculative decoding: a truncate after a recall keeps the recent window whole",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  // Four drafts a step, recall, one rejected (truncate), then the pass. Victims come from below
  // the window as it was before the drafts, so the window after the truncate is all cached.
  at::manual_seed(19);
  kvevict::MlaLatentCache c(
      kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(8).qk_rope_dim(4).qk_nope_dim(4).tier_tokens(64).tier_page_size(1),
      EvictionOptions(4).n_sink(1).n_recent(4));
  for (int step = 0; step < 40; ++step) {
    c.update(0, at::randn({1, 4, 8}), at::randn({1, 4, 4}));
    const auto qa = at::randn({1, 2, 4, 8}), qp = at::randn({1, 2, 4, 4});
    c.recall_absorbed(0, qa, qp, 0.3, 4);
    kvevict::attend_absorbed(qa, qp, c, 0, 0.3);
    c.truncate(0, 1 + step % 3);
    REQUIRE_NOTHROW(c.evict(0));
    CAPTURE(step);
    CHECK(c.size(0, 0) <= c.capacity());
    const auto now = sorted_positions(c.positions(0)[0], c.size(0, 0));
    for (int64_t p = std::max<int64_t>(0, c.seen_tokens(0) - 4); p < c.seen_tokens(0); ++p) {
      CHECK(std::binary_search(now.begin(), now.end(), p));
    }
  }
  CHECK(c.stats().tier_recalled > 0);
}

TEST_CASE("save_layer and restore_layer undo drafts whole: restored, then the accepted ones again, equals a cache that ran only those",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  const bool with_tier = GENERATE(false, true);
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path, with_tier);
  // Speculative decoding as kvevict.hf runs it: per layer, save, run K drafts token by token
  // (update, recall every third position, attend and observe, pass), restore, then run the n
  // accepted ones again. Cache A does that; cache B runs only the accepted tokens. Every input
  // depends on (position, layer) alone, so A and B see the same tokens.
  const int64_t L = 2, H = 2, W = 8, R = 4, K = 4;
  auto opts = kvevict::MlaLatentCacheOptions(L, H).kv_lora_rank(W).qk_rope_dim(R).qk_nope_dim(4);
  if (with_tier) opts.tier_tokens(16).tier_page_size(2);
  const auto e = EvictionOptions(3).n_sink(1).n_recent(3);
  kvevict::MlaLatentCache A(opts, e), B(opts, e);
  const auto randn = [](std::vector<int64_t> shape, int64_t pos, int64_t layer, int64_t what) {
    auto g = at::detail::createCPUGenerator(static_cast<uint64_t>(pos * 100 + layer * 10 + what));
    return at::randn(shape, g);
  };
  const auto step = [&](kvevict::MlaLatentCache& c, int64_t layer) {
    const int64_t pos = c.seen_tokens(layer);
    c.update(layer, randn({1, 1, W}, pos, layer, 0), randn({1, 1, R}, pos, layer, 1));
    const auto qa = randn({1, H, 1, W}, pos, layer, 2), qp = randn({1, H, 1, R}, pos, layer, 3);
    if (with_tier && pos % 3 == 0) c.recall_absorbed(layer, qa, qp, 0.4, 2);
    kvevict::attend_absorbed(qa, qp, c, layer, 0.4);
    c.evict(layer);
  };
  const auto same = [&](int64_t layer) {
    const int64_t n = B.size(layer, 0);
    REQUIRE(A.size(layer, 0) == n);
    CHECK(A.seen_tokens(layer) == B.seen_tokens(layer));
    CHECK(at::equal(A.positions(layer), B.positions(layer)));
    CHECK(at::equal(A.scores(layer), B.scores(layer)));
    CHECK(at::equal(A.ckv(layer).narrow(1, 0, n), B.ckv(layer).narrow(1, 0, n)));
    CHECK(at::equal(A.kpe(layer).narrow(1, 0, n), B.kpe(layer).narrow(1, 0, n)));
    const auto a = A.stats(layer), b = B.stats(layer);
    CHECK(a.eviction_events == b.eviction_events);
    CHECK(a.tokens_evicted == b.tokens_evicted);
    CHECK(a.tier_tokens == b.tier_tokens);
    CHECK(a.tier_recalled == b.tier_recalled);
    if (!with_tier) return;
    CHECK(at::equal(A.tier_positions(layer, 0), B.tier_positions(layer, 0)));
    CHECK(at::equal(A.tier_scores(layer, 0), B.tier_scores(layer, 0)));
    CHECK(at::equal(A.tier_rows(layer, 0).first, B.tier_rows(layer, 0).first));
    CHECK(at::equal(A.tier_rows(layer, 0).second, B.tier_rows(layer, 0).second));
  };
  for (int64_t t = 0; t < 12; ++t) {
    for (int64_t l = 0; l < L; ++l) {
      step(A, l);
      step(B, l);
    }
  }
  int64_t changed = 0;  // rounds whose rejected drafts changed the layer (else nothing is tested)
  for (int64_t round = 0; round < 10; ++round) {
    const int64_t accepted = round % (K + 1);
    CAPTURE(round, accepted);
    for (int64_t l = 0; l < L; ++l) {
      auto save = A.save_layer(l);
      CHECK(save.layer() == l);
      for (int64_t k = 0; k < K; ++k) step(A, l);
      if (A.stats(l).tokens_evicted != B.stats(l).tokens_evicted + 0 || !at::equal(A.scores(l), B.scores(l))) ++changed;
      A.restore_layer(l, std::move(save));
      CHECK(save.layer() == -1);
      for (int64_t k = 0; k < accepted; ++k) step(A, l);
      for (int64_t k = 0; k < accepted; ++k) step(B, l);
      same(l);
      step(A, l);  // the verified token after the accepted drafts
      step(B, l);
      same(l);
    }
  }
  CHECK(changed == 10 * L);
  CHECK(A.stats().tokens_evicted > 0);
  if (with_tier) CHECK(A.stats().tier_recalled > 0);

  // Bad saves: clear errors that change nothing.
  auto s0 = A.save_layer(0);
  CHECK_THROWS_WITH(A.restore_layer(1, std::move(s0)), Contains("restore_layer: the save is of layer 0, not of layer 1"));
  CHECK(s0.layer() == 0);  // not used up by the refusal
  A.restore_layer(0, std::move(s0));
  CHECK_THROWS_WITH(A.restore_layer(0, std::move(s0)), Contains("restore_layer: this save was restored already"));
  same(0);
  same(1);
  kvevict::MlaLatentCache other(kvevict::MlaLatentCacheOptions(L, H).kv_lora_rank(W).qk_rope_dim(2), e);
  auto s1 = other.save_layer(1);
  CHECK_THROWS_WITH(A.restore_layer(1, std::move(s1)), Contains("restore_layer: the save's buffer 1 is"));
  same(1);
  CHECK_THROWS_AS(A.save_layer(L), c10::IndexError);
  // A save from a cache with another host tier (or none) is refused: restoring it would leave
  // the layer's tier of another size.
  auto other_opts = kvevict::MlaLatentCacheOptions(L, H).kv_lora_rank(W).qk_rope_dim(R).qk_nope_dim(4);
  if (!with_tier) other_opts.tier_tokens(16).tier_page_size(2);
  kvevict::MlaLatentCache other_tier(other_opts, e);
  auto s2 = other_tier.save_layer(0);
  CHECK_THROWS_WITH(A.restore_layer(0, std::move(s2)), Contains("restore_layer: the save holds"));
  same(0);
  kvevict::MlaLatentCache other_capacity(opts, EvictionOptions(5).n_sink(1).n_recent(3));
  auto s3 = other_capacity.save_layer(0);
  CHECK_THROWS_WITH(A.restore_layer(0, std::move(s3)),
                    Contains("capacity 9 and evict_every 1, this one's layer 0 has batch_size 1, capacity 7 and"));
  // Calls that change every layer's rows between a save and its restore: refused (restoring one
  // layer would leave the layers disagreeing).
  auto s4 = A.save_layer(0);
  A.truncate(0, 1);
  CHECK_THROWS_WITH(A.restore_layer(0, std::move(s4)), Contains("reset, finish, add_sequence or truncate ran since"));
  auto s5 = A.save_layer(1);
  A.finish(0);
  REQUIRE(A.add_sequence() == 0);
  CHECK_THROWS_WITH(A.restore_layer(1, std::move(s5)), Contains("reset, finish, add_sequence or truncate ran since"));
  auto s6 = A.save_layer(1);
  A.reset();
  CHECK_THROWS_WITH(A.restore_layer(1, std::move(s6)), Contains("reset, finish, add_sequence or truncate ran since"));
}

TEST_CASE("a truncate past the latest append after a recall: the window keeps its cached tokens, on both paths",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  // Capacity 3 (budget 2, one recent token, no sinks), pages of one token. Worked by hand:
  //   5 tokens, pass: all ranks 0, the oldest go: cache {2,3,4}, tier {0,1}.
  //   3 tokens, then 1: cache {2..8}, seen 9. Ranks 1, but 0 for position 6.
  //   recall 1: victims lie below 9 - 1 - 1 = 7; the lowest is 6, which goes to the tier, and
  //   0 or 1 comes back with rank 1 (the best heavy hitter's).
  //   truncate 2 (positions 7, 8): seen 7, window {6}, which is in the tier. 5 tokens cached.
  //   pass: 2 go, among the candidates {0 or 1, 2, 3, 4, 5}, all ranked 1: the oldest two.
  //   So cache {3,4,5}, tier {0,1,2,6}, whichever token came back.
  at::manual_seed(5);
  kvevict::MlaLatentCache c(
      kvevict::MlaLatentCacheOptions(1, 1).kv_lora_rank(4).qk_rope_dim(2).qk_nope_dim(2).tier_tokens(10).tier_page_size(1),
      EvictionOptions(2).n_sink(0).n_recent(1));
  const auto up = [&](int64_t T) { c.update(0, at::randn({1, T, 4}), at::randn({1, T, 2})); };
  up(5);
  c.evict(0);
  up(3);
  up(1);
  c.add_scores(0, c.positions(0).ne(6).to(at::kFloat));
  REQUIRE(kvevict_test::total(c.recall_absorbed(0, at::randn({1, 1, 1, 4}), at::randn({1, 1, 1, 2}), 0.5, 1)) == 1);
  c.truncate(0, 2);
  REQUIRE(c.seen_tokens(0) == 7);
  REQUIRE(c.size(0, 0) == 5);
  REQUIRE_NOTHROW(c.evict(0));
  CHECK(sorted_positions(c.positions(0)[0], c.size(0, 0)) == std::vector<int64_t>{3, 4, 5});
  const at::Tensor tp = c.tier_positions(0, 0);
  CHECK(std::vector<int64_t>(tp.data_ptr<int64_t>(), tp.data_ptr<int64_t>() + tp.size(0)) ==
        std::vector<int64_t>{0, 1, 2, 6});
  // Position 6 leaves the window with the next token: the window is whole again.
  up(1);
  c.evict(0);
  CHECK(sorted_positions(c.positions(0)[0], c.size(0, 0)) == std::vector<int64_t>{4, 5, 7});
}

TEST_CASE("the digests hold only the pages in use, after a long append too; pads may hold anything",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);  // the host path, and the tensor path (CUDA's)
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  at::manual_seed(23);
  kvevict::MlaLatentCache c(kvevict::MlaLatentCacheOptions(1, 1).kv_lora_rank(4).qk_rope_dim(2).tier_tokens(8).tier_page_size(1),
                            EvictionOptions(4).n_sink(1).n_recent(1));
  c.update(0, at::randn({1, 512, 4}), at::randn({1, 512, 2}));
  c.evict(0);  // 506 evicted, 8 kept by the tier: 8 pages of one token
  REQUIRE(c.tier_size(0, 0) == 8);
  // Host path: per token 8 + 4 + 4 + 6 x 4 bytes, per page 2 x 6 x 4. Tensor path: the store's
  // pinned rows, 8 slots and the trash slot of 6 x 4 bytes.
  CHECK(c.stats().tier_bytes == (tensor_path ? 9 * 24 : 8 * 40 + 8 * 48));
  CHECK(c.stats().tier_bytes <= kvevict::tier_bytes(kvevict::MlaMemoryConfig{1, 1, 1, 1, 4, 2, 4}, kvevict::Layout::kLatent, 512,
                                                    6, 8, 1, 1));
  // A ragged batch's pad columns are not queries: NaN there is fine.
  kvevict::MlaLatentCache r(kvevict::MlaLatentCacheOptions(1, 1).batch_size(2).kv_lora_rank(4).qk_rope_dim(2).tier_tokens(8),
                            EvictionOptions(2).n_sink(1).n_recent(1));
  r.update(0, at::randn({2, 2, 4}), at::randn({2, 2, 2}), std::vector<int64_t>{1, 2});
  auto qa = at::randn({2, 1, 2, 4});
  qa[0][0][0].fill_(NAN);  // row 0's pad column
  CHECK_NOTHROW(r.recall_absorbed(0, qa, at::randn({2, 1, 2, 2}), 1.0, 4));
  qa[1][0][0].fill_(NAN);  // row 1's real column
  CHECK_THAT(kvevict_test::message_of([&] { r.recall_absorbed(0, qa, at::randn({2, 1, 2, 2}), 1.0, 4); }),
             Contains("queries of row 1 must be finite"));
}

TEST_CASE("with observation checks off, recall reads nothing of the queries: a row with a non-finite one recalls nothing",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  const int64_t two_level = GENERATE(0, 4);  // whole pages; a pool of 4 rescored
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path, two_level);
  at::manual_seed(41);
  const auto make = [] {
    return kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, 2).batch_size(2).kv_lora_rank(4).qk_rope_dim(2)
                                       .tier_tokens(16).tier_page_size(2).check_observations(false),
                                   EvictionOptions(3).n_sink(1).n_recent(1));
  };
  auto c = make(), twin = make();
  const auto ckv = at::randn({2, 12, 4}), kpe = at::randn({2, 12, 2}), scores = at::rand({2, 12});
  const auto ckv1 = at::randn({2, 1, 4}), kpe1 = at::randn({2, 1, 2});
  for (auto* x : {&c, &twin}) {
    x->update(0, ckv, kpe);
    x->add_scores(0, scores);
    x->evict(0);              // 7 tokens per row go to the tier
    x->update(0, ckv1, kpe1);  // one decode token: the heavy hitters below the window are victims
  }
  auto qa = at::randn({2, 2, 1, 4});
  const auto qp = at::randn({2, 2, 1, 2});
  const auto good = qa.clone();
  qa[1][1][0][2] = std::numeric_limits<float>::infinity();  // one head of row 1's query
  CHECK(c.stats().tier_tokens > 0);  // a read: the pass's evicted tokens go into the tier first
  at::Tensor recalled;
  {
    kvevict_test::OpRecorder rec;
    recalled = c.recall_absorbed(0, qa, qp, 1.0, 2, two_level);
    CHECK(rec.counts().syncs == 0);  // no item(): the queries are not checked
  }
  const int64_t n = kvevict_test::total(recalled);
  // Row 1 recalls nothing; row 0 recalls what it recalls with the same query in a twin whose
  // row 1 query is finite.
  CHECK(kvevict_test::to_vec<int64_t>(c.positions(0)[1]) == kvevict_test::to_vec<int64_t>(twin.positions(0)[1]));
  CHECK(c.tier_positions(0, 1).equal(twin.tier_positions(0, 1)));
  twin.recall_absorbed(0, good, qp, 1.0, 2, two_level);
  CHECK(kvevict_test::to_vec<int64_t>(c.positions(0)[0]) == kvevict_test::to_vec<int64_t>(twin.positions(0)[0]));
  CHECK(n == c.stats().tier_recalled);
  CHECK(n > 0);  // row 0 did recall
}

namespace {

/// Two caches fed the same inputs: one on the tensor path on `device` (the CPU: forced), one on
/// the CPU host path. A ragged batch, a tier that drops, passes every 2 steps, recall every 3
/// steps (whole pages, then two-level) scored per head or by the heads' mean, a truncate within
/// the latest append, and one that takes a token back out of the tier. After every step the caches
/// (positions, scores, rows) and the tiers (positions, ranks, rows) must be equal. The host path
/// is the one the oracles above check.
void check_tensor_path_matches_host(const at::Device& device) {
  const auto scoring = GENERATE(kvevict::TierScoring::kPerHead, kvevict::TierScoring::kHeadMean);
  CAPTURE(scoring == kvevict::TierScoring::kHeadMean);
  at::manual_seed(21);
  const int64_t B = 2, H = 2, W = 4, R = 2, T = 2, steps = 36;
  const auto options = kvevict::MlaLatentCacheOptions(1, H)
                           .batch_size(B)
                           .kv_lora_rank(W)
                           .qk_rope_dim(R)
                           .check_observations(false)
                           .tier_tokens(10)
                           .tier_page_size(2)
                           .tier_scoring(scoring);
  const auto e = EvictionOptions(5).n_sink(1).n_recent(2).evict_every(2);
  kvevict_test::ForceTensorPath to_tensor(true);
  kvevict::MlaLatentCache tensor(kvevict::MlaLatentCacheOptions(options).device(device), e);
  kvevict_test::ForceTensorPath to_host(false);
  kvevict::MlaLatentCache host(options, e);
  REQUIRE_FALSE(tensor.policy().host_path());
  REQUIRE(host.policy().host_path());
  const auto here = [&](const at::Tensor& t) { return t.to(device); };
  const auto cpu = [](const at::Tensor& t) { return t.to(at::kCPU); };
  const std::vector<int64_t> counts{1, 2};
  int64_t recalled = 0;
  for (int64_t step = 0; step < steps; ++step) {
    CAPTURE(step);
    const auto ckv = at::randn({B, T, W}), kpe = at::randn({B, T, R});
    const auto qa = at::randn({B, H, T, W}), qp = at::randn({B, H, T, R});
    tensor.update(0, here(ckv), here(kpe), counts);
    host.update(0, ckv, kpe, counts);
    if (step % 3 == 2) {
      const int64_t rescore = step % 6 == 2 ? 0 : 4;
      const int64_t n = kvevict_test::total(host.recall_absorbed(0, qa, qp, 0.5, 3, rescore));
      CHECK(kvevict_test::total(tensor.recall_absorbed(0, here(qa), here(qp), 0.5, 3, rescore)) == n);
      recalled += n;
    }
    // The same probabilities for both (attention's batched product on the tensor path may
    // round differently from the host path's row-by-row one).
    const auto live = host.positions(0).ge(0).view({B, 1, 1, -1}).to(at::kFloat);
    const auto probs = at::softmax(at::randn({B, H, T, host.size(0)}), -1).mul(live);
    host.observe(0, probs);
    tensor.observe(0, here(probs));
    host.evict(0);
    tensor.evict(0);
    if (step == 20) {  // roll back row 1's latest append (its two tokens)
      host.truncate(1, 2);
      tensor.truncate(1, 2);
    }
    if (step == 29) {  // roll back row 0's latest 4 tokens: one of them sits in the tier
      const auto rolled_back = [](kvevict::MlaLatentCache& c) {
        try {
          c.truncate(0, 4);
          return true;
        } catch (const c10::Error&) {
          return false;  // a token already dropped from the tier (not with this seed)
        }
      };
      const int64_t in_tier = host.tier_positions(0, 0).ge(host.seen_tokens(0, 0) - 4).sum().item<int64_t>();
      const int64_t tier_before = host.tier_size(0, 0);
      CHECK(in_tier > 0);
      REQUIRE(rolled_back(host));
      CHECK(rolled_back(tensor));
      CHECK(host.tier_size(0, 0) == tier_before - in_tier);
    }
    REQUIRE(at::equal(cpu(tensor.positions(0)), host.positions(0)));
    CHECK(at::equal(cpu(tensor.scores(0)), host.scores(0)));
    CHECK(at::equal(cpu(tensor.ckv(0)), host.ckv(0)));
    CHECK(at::equal(cpu(tensor.kpe(0)), host.kpe(0)));
    for (int64_t r = 0; r < B; ++r) {
      REQUIRE(tensor.tier_size(0, r) == host.tier_size(0, r));
      CHECK(at::equal(tensor.tier_positions(0, r), host.tier_positions(0, r)));
      CHECK(at::equal(tensor.tier_scores(0, r), host.tier_scores(0, r)));
      CHECK(at::equal(tensor.tier_rows(0, r).first, host.tier_rows(0, r).first));
      CHECK(at::equal(tensor.tier_rows(0, r).second, host.tier_rows(0, r).second));
    }
    const auto st = tensor.stats(), sh = host.stats();
    CHECK(st.tier_tokens == sh.tier_tokens);
    CHECK(st.tier_bytes >= st.tier_tokens * (W + R) * 4);  // the store's pinned rows, at least the tokens'
    CHECK(st.tier_recalled == sh.tier_recalled);
  }
  CHECK(recalled > 0);
  CHECK(host.tier_size(0, 1) == 10);  // the tier filled and dropped
  // The store on the device: the digests, 8 bytes a key channel (W + R of them) and page id,
  // for at least the 5 pages of row 1's 10 tokens, in every row.
  CHECK(host.stats().tier_device_bytes == 0);
  CHECK(tensor.stats().tier_device_bytes >= B * 5 * 8 * (W + R));
  tensor.reset();
  CHECK(tensor.stats().tier_device_bytes == 0);
}

}  // namespace

/// Plans a change to a TierStore with `plan(writes)` and commits it.
template <class Plan>
void commit(Plan&& plan) {
  kvevict::detail::TensorUndo undo;
  kvevict::detail::TierWrites w(undo);
  plan(w);
  w.commit("test");
}

TEST_CASE("the tier's digests by page id score as an oracle on the device, after takes and a truncate, without a sync",
          "[tier][recall][store][cpu]") {
  using kvevict::detail::TierKeys;
  using kvevict::detail::TierStore;
  using kvevict::detail::TierWrites;
  const int64_t G = GENERATE(1, 2);  // key groups: latent (every head meets one key), expanded (one per head)
  CAPTURE(G);
  const int64_t B = 2, H = 2, Q = 3, D = 3, page = 2, S = 8;
  at::manual_seed(23);
  TierKeys keys;
  keys.buffers = {0};
  keys.page_size = page;
  keys.shared = G == 1;
  TierStore store(B, /*budget=*/100, /*state_width=*/1, {G == 1 ? std::vector<int64_t>{D} : std::vector<int64_t>{G, D}},
                  at::kFloat, keys, at::kCPU);
  std::vector<std::map<int64_t, std::vector<float>>> tokens(B);  // position -> keys
  // One take of `positions[b]` per row (at most S; -1: none), with random keys.
  const auto take = [&](const std::vector<std::vector<int64_t>>& positions) {
    auto position = at::full({B, S}, -1, at::kLong);
    auto buffer = at::randn(G == 1 ? std::vector<int64_t>{B, S, D} : std::vector<int64_t>{B, G, S, D});
    for (int64_t b = 0; b < B; ++b) {
      for (size_t s = 0; s < positions[b].size(); ++s) {
        const int64_t p = positions[b][s];
        position[b][static_cast<int64_t>(s)] = p;
        std::vector<float> key;
        for (int64_t g = 0; g < G; ++g) {
          const auto k = G == 1 ? buffer[b][static_cast<int64_t>(s)] : buffer[b][g][static_cast<int64_t>(s)];
          for (int64_t c = 0; c < D; ++c) key.push_back(k[c].item<float>());
        }
        tokens[b][p] = key;
      }
    }
    const auto idx = at::arange(S, at::kLong).expand({B, S}).contiguous();
    commit([&](TierWrites& w) {
      store.take(w, idx, position, at::zeros({B, S, 1}), {buffer}, [](const at::Tensor& st) { return st.select(2, 0); },
                 64);
    });
  };
  take({{0, 3, 4, 7, 8, 11, 12, 1}, {0, 1, 2}});  // row 0: pages 0..6 (page 0 twice), row 1: pages 0, 0, 1
  const auto query = at::randn({B, H, Q, D});
  auto real = at::ones({B, Q}, at::kBool);
  real[1][0] = false;  // row 1's first column is a pad
  const double scale = 0.7;
  // The oracle, in fp64 from the tokens themselves: per page lo/hi, the Quest bound, a softmax
  // over the row's pages per head and real query, each term round(p * 2^32), summed.
  const auto check_oracle = [&](const at::Tensor& got) {
    for (int64_t b = 0; b < B; ++b) {
      std::map<int64_t, std::pair<std::vector<double>, std::vector<double>>> pages;  // page -> lo, hi
      for (const auto& [p, key] : tokens[b]) {
        auto& [lo, hi] = pages[p / page];
        if (lo.empty()) lo.assign(G * D, INFINITY), hi.assign(G * D, -INFINITY);
        for (int64_t c = 0; c < G * D; ++c) lo[c] = std::min<double>(lo[c], key[c]), hi[c] = std::max<double>(hi[c], key[c]);
      }
      std::map<int64_t, double> want;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t q = 0; q < Q; ++q) {
          if (!real[b][q].item<bool>()) continue;
          const int64_t g = G == 1 ? 0 : h;
          std::map<int64_t, double> logit;
          double top = -INFINITY, z = 0;
          for (const auto& [pg, lh] : pages) {
            double bound = 0;
            for (int64_t c = 0; c < D; ++c) {
              const double x = query[b][h][q][c].item<float>();
              bound += std::max(x * lh.first[g * D + c], x * lh.second[g * D + c]);
            }
            logit[pg] = scale * bound;
            top = std::max(top, logit[pg]);
          }
          for (const auto& [pg, l] : logit) z += std::exp(l - top);
          for (const auto& [pg, l] : logit) want[pg] += std::round(std::exp(l - top) / z * 4294967296.0);
        }
      }
      for (int64_t p = 0; p < got.size(1); ++p) {
        CAPTURE(b, p);
        const double value = got[b][p].item<double>();
        if (!want.count(p)) {
          CHECK(value == 0);  // no members: no score
          continue;
        }
        CHECK(value == Approx(want.at(p)).epsilon(1e-5));
      }
    }
  };
  const auto score = [&] {
    kvevict_test::OpRecorder rec;
    const auto out = store.scores_of(store.bound(query, scale), TierStore::columns(real, H, G));
    REQUIRE(rec.ok());
    CHECK(rec.counts().syncs == 0);
    CHECK(rec.counts().transfers == 0);
    return out;
  };
  check_oracle(score());
  // Row 0 truncated from position 7 (pages 3.. leave, page 3 partly); row 1 gains page 4.
  commit([&](TierWrites& w) { store.drop_from(w, at::tensor({int64_t{7}, std::numeric_limits<int64_t>::max()})); });
  for (auto it = tokens[0].begin(); it != tokens[0].end();) it = it->first >= 7 ? tokens[0].erase(it) : std::next(it);
  take({{}, {9}});
  check_oracle(score());
  CHECK(store.device_bytes() >= 2 * 4 * B * store.page_capacity() * G * D);
}

TEST_CASE("with a tier, the tensor path keeps, hands over and recalls what the host path does, slot for slot",
          "[tier][recall][cpu]") {
  check_tensor_path_matches_host(at::kCPU);
}

TEST_CASE("with a tier on CUDA (pinned memory, asynchronous copies), the tensor path matches the host path",
          "[tier][recall][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  check_tensor_path_matches_host(at::Device("cuda:0"));
}

TEST_CASE("with a tier, the tensor path's pass takes its evicted tokens in with no sync, no read and no transfer",
          "[tier][steady_state][cpu]") {
  // The pass's take is part of its commit: the evicted tokens go into the tier's store (rows
  // through the pinned rows' view on CUDA) and the budget's drops and page digests follow,
  // all as tensor ops. A decode step (update, observe, evict) reads nothing of the device and
  // copies nothing between host and device. The tier's contents are checked against the host
  // path above.
  const int64_t H = 4;
  const auto options = kvevict::MlaLatentCacheOptions(1, H).kv_lora_rank(8).qk_rope_dim(4).check_observations(false)
                           .tier_tokens(64);
  kvevict_test::ForceTensorPath tensor_path(true);
  kvevict::MlaLatentCache cache(options, EvictionOptions(5).n_sink(1).n_recent(2));  // capacity 8
  const auto step = [&] {
    const auto ckv = at::randn({1, 1, 8}), kpe = at::randn({1, 1, 4});
    const auto p = at::softmax(at::randn({1, H, 1, cache.size(0) + 1}), -1);
    kvevict_test::OpRecorder rec;
    cache.update(0, ckv, kpe);
    cache.observe(0, p);
    REQUIRE(cache.evict(0) == 1);
    REQUIRE(rec.ok());
    return rec.counts();
  };
  for (int i = 0; i < 8; ++i) cache.update(0, at::randn({1, 1, 8}), at::randn({1, 1, 4}));
  step();  // the first pass uploads its mirrors (once)
  for (int i = 0; i < 4; ++i) {
    const auto c = step();
    CHECK(c.syncs == 0);
    CHECK(c.transfers == 0);
  }
  CHECK(cache.tier_size(0, 0) == 5);
  CHECK(cache.stats().tier_tokens == 5);
}

TEST_CASE("on the tensor path a recall makes no sync, no read and, once its mirrors are up, no transfer",
          "[tier][recall][steady_state][cpu]") {
  // Every step of a recall runs on the device: the pages scored by page id, the victims found,
  // the pick (whole pages or a two-level pool scored again), the swap through the pinned rows'
  // view. Which query columns are real and each row's latest append reach the device through
  // mirrors, uploaded when they change: the first recall's two transfers. On the CPU the op
  // counter sees every copy (a transfer) and every read (a sync). What is recalled and kept is
  // checked against the host path above.
  const bool two_level = GENERATE(false, true);
  CAPTURE(two_level);
  const int64_t H = 2;
  kvevict_test::ForceTensorPath tensor_path(true);
  kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, H).kv_lora_rank(4).qk_rope_dim(2)
                                    .tier_tokens(32).tier_page_size(2).check_observations(false),
                                EvictionOptions(6).n_sink(1).n_recent(1));
  cache.update(0, at::randn({1, 16, 4}), at::randn({1, 16, 2}));
  cache.add_scores(0, at::rand({1, 16}));
  cache.evict(0);  // capacity 8: 8 tokens go to the tier
  const auto counted = [](auto&& call) {
    kvevict_test::OpRecorder rec;
    call();
    REQUIRE(rec.ok());
    return rec.counts();
  };
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    cache.update(0, at::randn({1, 1, 4}), at::randn({1, 1, 2}));
    const auto qa = at::randn({1, H, 1, 4}).mul(4), qp = at::randn({1, H, 1, 2});
    at::Tensor n;
    const auto recall = counted([&] { n = cache.recall_absorbed(0, qa, qp, 1.0, 2, two_level ? 6 : 0); });
    CHECK(kvevict_test::total(n) > 0);
    CHECK(recall.syncs == 0);
    CHECK(recall.transfers == (step == 0 ? 2 : 0));  // the real columns' and latest appends' mirrors, once
    const auto p = at::softmax(at::randn({1, H, 1, cache.size(0)}), -1);
    const auto pass = counted([&] {
      cache.observe(0, p);
      cache.evict(0);
    });
    CHECK(pass.syncs == 0);
    if (step > 0) CHECK(pass.transfers == 0);  // the first uploads the policy's pass mirror
    int64_t tier = 0;
    const auto read = counted([&] { tier = cache.tier_size(0, 0); });
    CHECK(tier == 8 + step + 1);
    CHECK(read.syncs > 0);  // a read of the tier reads the device
  }
}

TEST_CASE("the tier as tensors keeps what the host path's tier keeps: tokens, ranks, rows, page digests, member order, picks",
          "[tier][store][cpu]") {
  using kvevict::detail::TierHostPath;
  using kvevict::detail::TierKeys;
  using kvevict::detail::TierStore;
  using kvevict::detail::TierWrites;
  const bool latent = GENERATE(true, false);
  const at::ScalarType dtype = GENERATE(at::kFloat, at::kBFloat16);
  CAPTURE(latent, dtype);
  struct Pass {
    std::vector<int64_t> n, evicted;
    int64_t columns = 0;
  };
  const int64_t S = 10;
  std::mt19937_64 rng(7);
  const auto uniform = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int64_t checked_pages = 0, checked_tokens = 0, drops = 0, picks = 0;
  for (int config = 0; config < 24; ++config) {
    const int64_t B = uniform(1, 3), W = uniform(1, 2), ps = std::vector<int64_t>{1, 2, 3, 5, 8}[uniform(0, 4)];
    const int64_t budget = std::vector<int64_t>{0, 1, 3, 7, 20, 1000}[uniform(0, 5)];
    CAPTURE(config, B, W, ps, budget);
    // Latent: two key buffers [B, S, 5] and [B, S, 3], one group; expanded: keys [B, 2, S, 4],
    // values [B, 2, S, 3], two groups.
    const std::vector<std::vector<int64_t>> shapes = latent ? std::vector<std::vector<int64_t>>{{5}, {3}}
                                                            : std::vector<std::vector<int64_t>>{{2, 4}, {2, 3}};
    std::vector<int64_t> row_bytes, groups;
    for (const auto& s : shapes) {
      row_bytes.push_back(std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>()) *
                          static_cast<int64_t>(c10::elementSize(dtype)));
      groups.push_back(s.size() == 2 ? s[0] : 1);
    }
    TierKeys keys;
    keys.buffers = latent ? std::vector<size_t>{0, 1} : std::vector<size_t>{0};
    keys.dtype = dtype;
    keys.page_size = ps;
    keys.shared = latent;
    TierHostPath host(B, budget, W, row_bytes, groups, keys);
    TierStore store(B, budget, W, shapes, dtype, keys, at::kCPU);
    std::vector<int64_t> next(static_cast<size_t>(B), 0);
    for (int step = 0; step < 30; ++step) {
      CAPTURE(step);
      const int64_t op = uniform(0, 19);
      if (op < 16) {  // a pass's evicted tokens
        auto position = at::full({B, S}, -1, at::kLong);
        const float values[] = {0.f, 0.5f, 1.f, 2.f, INFINITY, -INFINITY, NAN};
        auto state = at::empty({B, S, W});
        for (int64_t i = 0; i < state.numel(); ++i) state.data_ptr<float>()[i] = values[uniform(0, uniform(0, 9) == 0 ? 6 : 3)];
        std::vector<at::Tensor> buffers;
        for (const auto& s : shapes) {
          std::vector<int64_t> shape{B};
          shape.insert(shape.end(), s.begin(), s.end() - 1);
          shape.push_back(S);
          shape.push_back(s.back());
          buffers.push_back(at::randn(shape).to(dtype));
        }
        Pass pass;
        std::vector<std::vector<int64_t>> slots(static_cast<size_t>(B));
        int64_t max_position = 1;
        for (int64_t b = 0; b < B; ++b) {
          std::vector<int64_t> all(S);
          std::iota(all.begin(), all.end(), int64_t{0});
          std::shuffle(all.begin(), all.end(), rng);
          auto& sl = slots[static_cast<size_t>(b)];
          sl.assign(all.begin(), all.begin() + uniform(0, 4));
          for (const int64_t s : sl) {  // new positions, in no order over the slots, some pages skipped
            next[b] += uniform(0, 3) == 0 ? uniform(1, 2 * ps) : 1;
            position[b][s] = next[b] - 1;
            max_position = std::max(max_position, next[b]);
          }
          std::sort(sl.begin(), sl.end());  // the order the host path takes them
          pass.n.push_back(static_cast<int64_t>(sl.size()));
          pass.columns = std::max(pass.columns, pass.n.back());
        }
        pass.evicted.assign(static_cast<size_t>(B * pass.columns), 0);
        auto idx = at::empty({B, pass.columns}, at::kLong);
        for (int64_t b = 0; b < B; ++b) {
          int64_t none = 0;  // a slot without a token pads the row, as the trash slot does
          while (position[b][none].item<int64_t>() >= 0) ++none;
          idx[b].fill_(none);
          for (size_t k = 0; k < slots[b].size(); ++k) {
            pass.evicted[b * pass.columns + k] = slots[b][k];
            idx[b][static_cast<int64_t>(k)] = slots[b][k];
          }
        }
        host.take_pass(pass, position, state, buffers, S, [](const float* st) { return st[0]; });
        commit([&](TierWrites& w) {
          store.take(w, idx, position, state, buffers, [](const at::Tensor& st) { return st.select(2, 0); }, max_position);
        });
      } else if (op < 19) {  // a truncate of one row
        const int64_t b = uniform(0, B - 1), from = uniform(0, next[b]);
        auto all_from = at::full({B}, std::numeric_limits<int64_t>::max(), at::kLong);
        all_from[b] = from;
        commit([&](TierWrites& w) { host.drop_from(w, b, from); });
        commit([&](TierWrites& w) { store.drop_from(w, all_from); });
        next[b] = from;
        ++drops;
      } else {
        const int64_t b = uniform(0, B - 1);
        commit([&](TierWrites& w) { host.release(w, b); });
        commit([&](TierWrites& w) { store.release(w, b); });
      }
      for (int64_t b = 0; b < B; ++b) {
        CAPTURE(b);
        const auto& r = host.row(b);
        const auto got = store.tokens(b);
        const auto want = r.positions();
        REQUIRE(at::equal(got.position, want));
        CHECK(at::equal(got.rank.view(at::kInt), r.ranks().view(at::kInt)));  // bit for bit, NaN too
        const auto rows = r.rows(shapes, dtype);
        for (size_t i = 0; i < shapes.size(); ++i) CHECK(at::equal(got.rows[i], rows[i]));
        checked_tokens += want.size(0);
        // Every page: its digest and its members, newest first (the host list's order).
        const auto& dg = host.digests(b);
        int64_t pages = 0;
        for (int64_t p = 0; p < store.page_capacity(); ++p) pages += store.page(b, p).second > 0;
        CHECK(pages == dg.pages());
        for (int64_t s = 0; s < dg.slots(); ++s) {
          const int64_t page = dg.page_of_slot(s);
          CAPTURE(page);
          const auto [digest, members] = store.page(b, page);
          REQUIRE(members == dg.members(s));
          const auto block = at::from_blob(const_cast<float*>(dg.block(s)), digest.sizes(), at::kFloat);
          CHECK(at::equal(digest, block));
          std::vector<int64_t> host_order, store_order;
          for (int64_t t = dg.head(s); t >= 0; t = dg.next(t)) host_order.push_back(r.position[t]);
          std::vector<std::pair<int64_t, int64_t>> by_seq;  // (seq, position) of the page's tokens
          for (int64_t i = 0; i < got.position.size(0); ++i) {
            const int64_t p = got.position[i].item<int64_t>();
            if (p / ps == page) by_seq.emplace_back(got.seq[i].item<int64_t>(), p);
          }
          std::sort(by_seq.rbegin(), by_seq.rend());
          for (const auto& x : by_seq) store_order.push_back(x.second);
          CHECK(store_order == host_order);
          ++checked_pages;
        }
      }
      // recall's pick: random page scores (ties, zeros) and limits, the same pages and tokens in
      // the same order as the host's.
      const int64_t P = std::max<int64_t>(store.page_capacity(), 1), K = uniform(0, 1) ? 12 : 2;  // K + 1 < a page too
      auto scores = at::empty({B, P}, at::kDouble);
      auto limit = at::empty({B}, at::kLong);
      for (int64_t i = 0; i < scores.numel(); ++i) scores.data_ptr<double>()[i] = uniform(0, 3) * 0.5;
      for (int64_t b = 0; b < B; ++b) limit[b] = uniform(0, K);  // pick() takes limit <= K
      const auto picked = store.pick(scores, limit, K);
      for (int64_t b = 0; b < B; ++b) {
        CAPTURE(b);
        const auto& dg = host.digests(b);
        std::vector<double> by_slot(static_cast<size_t>(dg.slots()));
        for (int64_t s = 0; s < dg.slots(); ++s) by_slot[s] = scores[b][dg.page_of_slot(s)].item<double>();
        std::vector<int64_t> want, got;
        std::vector<int64_t> out;
        host.pick(b, by_slot.data(), limit[b].item<int64_t>(), out);
        for (const int64_t t : out) want.push_back(host.row(b).position[t]);
        const auto tokens = store.tokens(b);
        std::map<int64_t, int64_t> position_of;
        for (int64_t i = 0; i < tokens.slot.size(0); ++i) position_of[tokens.slot[i].item<int64_t>()] = tokens.position[i].item<int64_t>();
        const int64_t count = picked.count[b].item<int64_t>();
        for (int64_t k = 0; k < count; ++k) got.push_back(position_of.at(picked.slots[b][k].item<int64_t>()));
        CHECK(got == want);
        for (int64_t k = count; k < K; ++k) CHECK(picked.slots[b][k].item<int64_t>() == store.capacity());
        picks += !want.empty();
      }
    }
  }
  CHECK(picks > 100);
  CHECK(checked_pages > 100);
  CHECK(checked_tokens > 500);
  CHECK(drops > 10);
}

TEST_CASE("the tier as tensors takes a pass in and truncates with no sync and no transfer, the same ops each time",
          "[tier][store][cpu]") {
  using kvevict::detail::TierKeys;
  using kvevict::detail::TierStore;
  using kvevict::detail::TierWrites;
  const int64_t B = 2, S = 8, W = 1, C = 3, ps = 2;
  TierKeys keys;
  keys.buffers = {0, 1};
  keys.page_size = ps;
  keys.shared = true;
  TierStore store(B, /*budget=*/6, W, {{5}, {3}}, at::kFloat, keys, at::kCPU);
  commit([&](TierWrites& w) { store.reserve(w, 6, 1000); });  // a graph's caller sizes the store first
  int64_t next = 0;
  const auto pass = [&] {
    auto position = at::full({B, S}, -1, at::kLong);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = 0; k < C; ++k) position[b][2 * k + b] = next + k;
    }
    next += C;
    const auto idx = at::tensor({0, 2, 4, 1, 3, 5}, at::kLong).view({B, C});
    const auto ranks = [](const at::Tensor& st) { return st.select(2, 0); };
    kvevict_test::OpRecorder rec;
    commit([&](TierWrites& w) {
      store.take(w, idx, position, at::rand({B, S, W}), {at::randn({B, S, 5}), at::randn({B, S, 3})}, ranks, 1000);
    });
    REQUIRE(rec.ok());
    return rec.events();
  };
  for (int i = 0; i < 3; ++i) pass();  // full: each pass drops as many as it brings
  const auto a = pass(), b = pass();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i, a[i], b[i]);
    CHECK(a[i] == b[i]);
  }
  for (const auto& e : a) {
    CAPTURE(e);
    CHECK(e.kind != kvevict_test::OpKind::transfer);
    CHECK(e.kind != kvevict_test::OpKind::sync);
    CHECK(!e.syncs);
  }
  const auto before = store.tokens(0).position;
  REQUIRE(before.size(0) == 6);
  kvevict_test::OpRecorder rec;
  commit([&](TierWrites& w) { store.drop_from(w, at::tensor({next - 4, next}, at::kLong)); });
  REQUIRE(rec.ok());
  CHECK(rec.counts().syncs == 0);
  CHECK(rec.counts().transfers == 0);
  CHECK(at::equal(store.tokens(0).position, before.masked_select(before.lt(next - 4))));
  CHECK(store.tokens(1).position.size(0) == 6);
}

TEST_CASE("reserve_tier sizes the store without making recall pay for it; a free row's finish says what is wrong",
          "[tier][recall][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  kvevict_test::ForceTensorPath force(tensor_path);
  CAPTURE(tensor_path);
  at::manual_seed(3);
  kvevict::MlaCache c(kvevict::MlaCacheOptions(1, 1).qk_dim(2).v_dim(1).tier_tokens(3).tier_page_size(int64_t{1} << 20),
                      EvictionOptions(1).n_sink(0).n_recent(1));
  for (int step = 0; step < 10; ++step) {
    c.update(0, at::randn({1, 1, 1, 2}), at::randn({1, 1, 1, 1}));
    c.observe(0, at::softmax(at::randn({1, 1, 1, c.size(0)}), -1));
    c.evict(0);
  }
  // Page ids up to 2^20 on the tensor path (16 MB of digests): the pick's scan stays as wide as
  // the pages that can hold tokens (3) and the tokens left (2), not the page ids.
  c.reserve_tier(int64_t{1} << 40);
  CHECK(c.stats().tier_device_bytes >= (int64_t{1} << 20) * 16 * (tensor_path ? 1 : 0));
  CHECK(kvevict_test::total(c.recall(0, at::ones({1, 1, 1, 2}), 1.0, 1)) >= 0);
  const auto msg = [](auto&& f) { return kvevict_test::message_of(f); };
  CHECK_THAT(msg([&] { c.reserve_tier(0); }), Contains("reserve_tier: positions must be in [1, 2^40], got 0"));
  c.finish(0);
  const auto finished = msg([&] { c.finish(0); });
  CHECK_THAT(finished, Contains("finish: row 0 holds no sequence"));
  CHECK_THAT(finished, !Contains("commit"));
  CHECK_THAT(msg([&] { c.reset(0); }), Contains("reset: row 0 holds no sequence"));
  kvevict::MlaCache none(kvevict::MlaCacheOptions(1, 1).qk_dim(2).v_dim(1), EvictionOptions(1));
  CHECK_THAT(msg([&] { none.reserve_tier(8); }), Contains("no host tier"));
}
