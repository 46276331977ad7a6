// EvictionPolicyOptions::lazy_reduction: observations held back as exact fixed-point sums,
// reduced once and applied as one observation when a pass is due (or on flush()).

#include "support.hpp"

#include <kvevict/eviction_policy.hpp>
#include <kvevict/mla_cache.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <catch2/catch.hpp>

#include <random>
#include <vector>

namespace {

using kvevict::EvictionOptions;
using kvevict::EvictionPolicy;
using kvevict::EvictionPolicyOptions;

/// Causal probabilities [B, H, Q, S] whose values are multiples of 1/16: every sum and mean the
/// policy forms is exact in fp32, so applying observations one by one (eager) or summed (lazy)
/// gives the same bits, and the eager policy is the expected value of the lazy one.
template <class Policy>
at::Tensor dyadic_probs(const Policy& p, int64_t layer, int64_t Q, std::mt19937& rng) {
  const int64_t B = p.batch_size(), H = p.num_heads(), S = p.size(layer);
  const auto pos = p.positions(layer);            // [B, S]
  const auto qpos = p.query_positions(layer, Q);  // [B, Q]
  std::uniform_int_distribution<int> d(0, 16);
  auto probs = at::zeros({B, H, Q, S});
  auto a = probs.template accessor<float, 4>();
  const auto pa = pos.template accessor<int64_t, 2>();
  const auto qa = qpos.template accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < Q; ++q)
        for (int64_t s = 0; s < S; ++s)
          if (pa[b][s] >= 0 && qa[b][q] >= 0 && pa[b][s] <= qa[b][q]) a[b][h][q][s] = d(rng) / 16.f;
  return probs;
}

/// Drives an eager and a lazy policy through the same random steps (chunks of 1 or 3 tokens,
/// observe, evict, sometimes a rollback) and checks that they keep the same positions after
/// every step and end with the same scores.
template <class Scorer>
void lazy_matches_eager(bool tensor_path) {
  kvevict_test::ForceTensorPath force(tensor_path);
  const auto eviction = EvictionOptions(6).n_sink(1).n_recent(2).evict_every(3);
  const auto opts = EvictionPolicyOptions(2, 4).batch_size(2);
  EvictionPolicy<Scorer> eager(opts, eviction), lazy(EvictionPolicyOptions(opts).lazy_reduction(true), eviction);
  REQUIRE(lazy.host_path() == !tensor_path);
  eager.reserve(16);  // 3-token chunks between passes
  lazy.reserve(16);
  std::mt19937 rng(5);
  for (int step = 0; step < 120; ++step) {
    const int64_t T = step % 7 == 3 ? 3 : 1;
    for (int64_t l = 0; l < 2; ++l) {
      const std::vector<int64_t> counts = {T, T};
      eager.append(l, counts, T);
      lazy.append(l, counts, T);
      const auto probs = dyadic_probs(eager, l, T, rng);
      eager.observe(l, probs);
      lazy.observe(l, probs);
      CHECK(lazy.pending(l));
      eager.evict(l);
      lazy.evict(l);
    }
    if (step % 11 == 10) {  // speculative rollback: pending sums follow the slot moves
      eager.truncate(1, 2);
      lazy.truncate(1, 2);
    }
    for (int64_t l = 0; l < 2; ++l) {
      INFO("step " << step << ", layer " << l);
      REQUIRE(at::equal(eager.positions(l), lazy.positions(l)));
    }
  }
  for (int64_t l = 0; l < 2; ++l) {
    CHECK_THROWS_WITH(lazy.scores(l), Catch::Contains("call flush(" + std::to_string(l) + ") first"));
    lazy.flush(l);
    CHECK_FALSE(lazy.pending(l));
    CHECK(at::equal(eager.scores(l), lazy.scores(l)));
    CHECK(eager.stats(l).tokens_evicted == lazy.stats(l).tokens_evicted);
  }
}

}  // namespace

TEST_CASE("lazy_reduction keeps what eager keeps when the sums are exact in fp32 (both paths)", "[policy][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO("tensor path: " << tensor_path);
    lazy_matches_eager<kvevict::CumulativeAttention>(tensor_path);
    lazy_matches_eager<kvevict::MeanObservedAttention>(tensor_path);
  }
}

TEST_CASE("lazy_reduction: one reduction per pass, of the summed fixed-point sums (hand-worked)", "[policy][cpu]") {
  kvevict_test::on_both_paths([] {
    int calls = 0;
    // Two ranks' worth: this process holds 2 of 4 heads; the reducer adds an identical peer.
    const auto opts = EvictionPolicyOptions(1, 2).total_heads(4).lazy_reduction(true).reduce_contributions(
        [&calls](int64_t layer, at::Tensor& sums) {
          CHECK(layer == 0);
          CHECK(sums.scalar_type() == at::kDouble);
          sums.mul_(2);
          ++calls;
        });
    EvictionPolicy<kvevict::MeanObservedAttention> p(opts, EvictionOptions(1).n_sink(0).n_recent(1).evict_every(2));
    p.append(0, std::vector<int64_t>{1}, 1);
    p.observe(0, at::ones({1, 2, 1, 1}));  // token 0: 1 + 1
    p.append(0, std::vector<int64_t>{1}, 1);
    p.observe(0, at::tensor({0.5f, 0.5f, 0.25f, 0.75f}).view({1, 2, 1, 2}));  // token 0: +0.75, token 1: 1.25
    CHECK(calls == 0);
    CHECK(p.pending(0));
    p.flush(0);
    CHECK(calls == 1);
    // token 0: (2 + 0.75) x 2 / 4 = 1.375 over 2 observers; token 1: 1.25 x 2 / 4 = 0.625 over 1.
    const auto s = p.scores(0).to(at::kCPU);
    CHECK(s[0][0].item<float>() == 1.375f / 2);
    CHECK(s[0][1].item<float>() == 0.625f);
    p.flush(0);  // nothing pending: no collective
    CHECK(calls == 1);
    p.append(0, std::vector<int64_t>{1}, 1);
    p.observe(0, at::zeros({1, 2, 1, 3}));
    CHECK(calls == 1);
    REQUIRE(p.due(0));  // 3 tokens > capacity 2, 3 appends >= evict_every 2
    p.evict(0);         // the pass reduces the pending observation first
    CHECK(calls == 2);
    CHECK_FALSE(p.pending(0));
  });
}

TEST_CASE("lazy_reduction flushes early so that a pending sum stays exact (at most 2^21 terms)", "[policy][cpu]") {
  kvevict_test::on_both_paths([] {
    int calls = 0;
    // 2^20 heads in all x Q = 2 columns: one observation is 2^21 terms, two would pass the bound.
    const auto opts = EvictionPolicyOptions(1, 1).total_heads(int64_t{1} << 20).lazy_reduction(true).reduce_contributions(
        [&calls](int64_t, at::Tensor&) { ++calls; });
    EvictionPolicy<> p(opts, EvictionOptions(8).n_sink(0).n_recent(0));
    p.append(0, std::vector<int64_t>{2}, 2);
    const auto probs = at::full({1, 1, 2, 2}, 0.5f).tril();
    p.observe(0, probs);
    CHECK(calls == 0);
    p.observe(0, probs);  // flushes the first before adding the second
    CHECK(calls == 1);
    p.observe(0, probs);
    CHECK(calls == 2);
    p.flush(0);
    CHECK(calls == 3);
  });
}

TEST_CASE("lazy_reduction needs a linear scorer", "[policy][cpu][errors]") {
  const auto opts = EvictionPolicyOptions(1, 2).lazy_reduction(true);
  CHECK_THROWS_AS(EvictionPolicy<kvevict::LatestAttention>(opts), c10::ValueError);
  CHECK_THROWS_WITH(EvictionPolicy<kvevict::LatestAttention>(opts),
                    Catch::Contains("lazy_reduction needs a linear scorer") && Catch::Contains("got LatestAttention"));
  CHECK_THROWS_WITH(EvictionPolicy<kvevict::DecayedAttention>(opts), Catch::Contains("got DecayedAttention"));
  CHECK_NOTHROW(EvictionPolicy<kvevict::CumulativeAttention>(opts));
}

TEST_CASE("lazy_reduction with a host tier and recall keeps, recalls and tiers what eager does (both paths, both "
          "recall kinds)",
          "[tier][recall][lazy]") {
  // Recall picks its victims by rank: with observations pending (recall every 3 steps, passes
  // every 4) it must apply them first (recall flushes), or its victims, the tier and every
  // later pass would differ from the eager cache's, which observes the same exact (dyadic)
  // probabilities one by one.
  kvevict_test::on_both_paths([] {
    const auto eviction = EvictionOptions(6).n_sink(1).n_recent(2).evict_every(4);
    const auto opts = kvevict::MlaCacheOptions(2, 2).batch_size(2).qk_dim(6).v_dim(4).tier_tokens(40).tier_page_size(2);
    kvevict::MlaCache eager(opts, eviction), lazy(kvevict::MlaCacheOptions(opts).lazy_reduction(true), eviction);
    REQUIRE(lazy.policy().options().lazy_reduction());
    std::mt19937 rng(11);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    int64_t recalled = 0, recalled_pending = 0;
    for (int step = 0; step < 90; ++step) {
      for (int64_t l = 0; l < 2; ++l) {
        const auto k = at::randn({2, 2, 1, 6}, gen), v = at::randn({2, 2, 1, 4}, gen), q = at::randn({2, 2, 1, 6}, gen);
        eager.update(l, k, v);
        lazy.update(l, k, v);
        if (step % 3 == 2) {
          const bool two_level = step % 6 == 5;
          const bool pending = lazy.policy().pending(l);
          const int64_t e = kvevict_test::total(eager.recall(l, q, 0.5, two_level ? 2 : 4, two_level ? 6 : 0));
          const int64_t z = kvevict_test::total(lazy.recall(l, q, 0.5, two_level ? 2 : 4, two_level ? 6 : 0));
          CHECK_FALSE(lazy.policy().pending(l));  // recall applied them
          REQUIRE(e == z);
          recalled += z;
          if (pending) recalled_pending += z;
        }
        const auto probs = dyadic_probs(eager.policy(), l, 1, rng);
        eager.observe(l, probs);
        lazy.observe(l, probs);
        eager.evict(l);
        lazy.evict(l);
        INFO("step " << step << ", layer " << l);
        REQUIRE(at::equal(eager.positions(l), lazy.positions(l)));
        for (int64_t b = 0; b < 2; ++b) {
          REQUIRE(at::equal(eager.tier_positions(l, b), lazy.tier_positions(l, b)));
          REQUIRE(at::equal(eager.tier_scores(l, b), lazy.tier_scores(l, b)));
        }
      }
    }
    CHECK(recalled_pending > 0);  // recalls that had observations to apply first, and brought tokens back
    CHECK(recalled > recalled_pending / 2);
    for (int64_t l = 0; l < 2; ++l) {
      lazy.flush(l);
      CHECK(at::equal(eager.scores(l), lazy.scores(l)));
      CHECK(at::equal(eager.keys(l), lazy.keys(l)));
      for (int64_t b = 0; b < 2; ++b) {
        CHECK(at::equal(eager.tier_rows(l, b).first, lazy.tier_rows(l, b).first));
        CHECK(at::equal(eager.tier_rows(l, b).second, lazy.tier_rows(l, b).second));
      }
    }
    CHECK(eager.stats().tier_recalled == lazy.stats().tier_recalled);
  });
}
