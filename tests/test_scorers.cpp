// The three scorers through an MlaCache, with hand-worked scores (docs/DESIGN.md, "Scorers"):
//   CumulativeAttention    score += mean_h sum_q p[b, h, q, s]
//   MeanObservedAttention  the cumulative sum / number of observed queries that could see s
//   LatestAttention        score  = mean_h p[b, h, Q-1, s]
// and add_scores (adds; adds and counts one observation; replaces). Every check runs on the
// default CPU path and on the tensor-op path (ForceTensorPath).
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <map>
#include <random>
#include <vector>

using Catch::Matchers::Contains;
using kvevict::CumulativeAttention;
using kvevict::EvictionOptions;
using kvevict::LatestAttention;
using kvevict::MeanObservedAttention;

namespace {

template <class Scorer>
using Cache = kvevict::BasicMlaCache<kvevict::EvictionPolicy<Scorer>>;

using Rows = std::vector<std::vector<double>>;  // [B][S]

constexpr int64_t kQk = 4, kV = 2;

template <class Scorer>
Cache<Scorer> make_cache(int64_t B, int64_t H, const EvictionOptions& e = EvictionOptions(64),
                         at::ScalarType dtype = at::kFloat) {
  return Cache<Scorer>(kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(kQk).v_dim(kV).dtype(dtype), e);
}

// Appends T tokens whose keys and values are all zero.
template <class C>
void append(C& cache, int64_t T) {
  const auto o = at::TensorOptions().dtype(cache.dtype());
  cache.update(0, at::zeros({cache.batch_size(), cache.num_heads(), T, kQk}, o),
               at::zeros({cache.batch_size(), cache.num_heads(), T, kV}, o));
}

// [B, H, Q, S] probabilities from a flat list in that order.
at::Tensor probs(std::vector<float> flat, int64_t B, int64_t H, int64_t Q, int64_t S) {
  REQUIRE(static_cast<int64_t>(flat.size()) == B * H * Q * S);
  return at::tensor(flat).view({B, H, Q, S});
}

at::Tensor rows_tensor(const Rows& r) {
  std::vector<float> flat;
  for (const auto& row : r) flat.insert(flat.end(), row.begin(), row.end());
  return at::tensor(flat).view({static_cast<int64_t>(r.size()), static_cast<int64_t>(r[0].size())});
}

void check_scores(const at::Tensor& got, const Rows& expected) {
  REQUIRE(got.scalar_type() == at::kFloat);
  REQUIRE(got.dim() == 2);
  REQUIRE(got.size(0) == static_cast<int64_t>(expected.size()));
  for (size_t b = 0; b < expected.size(); ++b) {
    const auto row = kvevict_test::to_vec<float>(got[b]);
    REQUIRE(row.size() == expected[b].size());
    for (size_t s = 0; s < row.size(); ++s) {
      INFO("row " << b << ", slot " << s);
      CHECK(row[s] == Approx(expected[b][s]).epsilon(1e-6));
    }
  }
}


// The observation script shared by the three scorer tests (B = 2, H = 2):
//   prefill 3 tokens; observe Q = 2 (queries at positions 1, 2); append position 3;
//   observe Q = 1 (query at position 3); add_scores.
// Returns scores(0) after each step (5 snapshots), and checks positions stay 0..S-1.
at::Tensor obs1() {
  return probs({// row 0, head 0: q0 (pos 1), q1 (pos 2)
                0.5f, 0.5f, 0.f, 0.25f, 0.25f, 0.5f,
                // row 0, head 1
                1.f, 0.f, 0.f, 0.f, 0.5f, 0.5f,
                // row 1, head 0
                0.f, 1.f, 0.f, 0.f, 0.f, 1.f,
                // row 1, head 1
                0.5f, 0.5f, 0.f, 0.5f, 0.25f, 0.25f},
               2, 2, 2, 3);
}
at::Tensor obs2() {
  return probs({0.25f, 0.25f, 0.25f, 0.25f,  // row 0, head 0
                0.5f, 0.f, 0.f, 0.5f,        // row 0, head 1
                0.f, 0.f, 0.f, 1.f,          // row 1, head 0
                0.f, 0.f, 0.5f, 0.5f},       // row 1, head 1
               2, 2, 1, 4);
}
const Rows kAdded = {{1, 2, 3, 4}, {4, 3, 2, 1}};

template <class Scorer>
std::vector<at::Tensor> run_script() {
  auto cache = make_cache<Scorer>(2, 2);
  std::vector<at::Tensor> out;
  append(cache, 3);
  out.push_back(cache.scores(0));
  cache.observe(0, obs1());
  out.push_back(cache.scores(0));
  append(cache, 1);
  out.push_back(cache.scores(0));
  cache.observe(0, obs2());
  out.push_back(cache.scores(0));
  cache.add_scores(0, rows_tensor(kAdded));
  out.push_back(cache.scores(0));
  CHECK(at::equal(cache.positions(0), at::arange(4, at::kLong).expand({2, 4})));
  return out;
}

// A reference model of one layer, written from docs/DESIGN.md alone: per row, position ->
// (sum, observed-query count, latest), in double. Fed the same random stream as the cache.
template <class Scorer>
struct Reference {
  struct Token {
    double sum = 0, count = 0, latest = 0;
  };
  std::vector<std::map<int64_t, Token>> rows;
  int64_t seen = 0;

  explicit Reference(int64_t B) : rows(B) {}

  void append(int64_t T) {
    for (auto& r : rows) {
      for (int64_t t = 0; t < T; ++t) r[seen + t] = Token();
    }
    seen += T;
  }
  // probs [B, H, Q, S] in the slot order of `positions` [B, S].
  void observe(const at::Tensor& probs, const at::Tensor& positions) {
    const auto p = probs.to(at::kDouble).contiguous();
    const int64_t H = p.size(1), Q = p.size(2), S = p.size(3);
    const double* pd = p.template data_ptr<double>();
    for (size_t b = 0; b < rows.size(); ++b) {
      const auto pos = kvevict_test::to_vec<int64_t>(positions[b]);
      for (int64_t s = 0; s < S; ++s) {
        double all = 0, last = 0;
        int64_t saw = 0;
        for (int64_t q = 0; q < Q; ++q) {
          double m = 0;
          for (int64_t h = 0; h < H; ++h) m += pd[((static_cast<int64_t>(b) * H + h) * Q + q) * S + s];
          m /= H;
          all += m;
          if (q == Q - 1) last = m;
          saw += pos[s] <= seen - Q + q;  // query q sits at position seen - Q + q
        }
        auto& tok = rows[b].at(pos[s]);
        tok.sum += all;
        tok.count += saw;
        tok.latest = last;
      }
    }
  }
  // scores [B, S] in the slot order of `positions`: one query whose head-mean is `scores`.
  void add(const at::Tensor& scores, const at::Tensor& positions) {
    for (size_t b = 0; b < rows.size(); ++b) {
      const auto pos = kvevict_test::to_vec<int64_t>(positions[b]);
      const auto x = kvevict_test::to_vec<double>(scores[b]);
      for (size_t s = 0; s < pos.size(); ++s) {
        auto& tok = rows[b].at(pos[s]);
        tok.sum += x[s];
        tok.count += 1;
        tok.latest = x[s];
      }
    }
  }
  static double rank(const Token& t) {
    if (std::is_same<Scorer, CumulativeAttention>::value) return t.sum;
    if (std::is_same<Scorer, MeanObservedAttention>::value) return t.count > 0 ? t.sum / t.count : 0.0;
    return t.latest;
  }
  // Keeps what the oracle keeps in every row.
  void evict(const EvictionOptions& e) {
    for (auto& r : rows) {
      std::vector<int64_t> pos;
      std::vector<double> sc;
      for (const auto& kv : r) {
        pos.push_back(kv.first);
        sc.push_back(rank(kv.second));
      }
      const auto keep = kvevict_test::oracle_keep(pos, sc, e.n_sink(), e.budget(), e.n_recent());
      std::map<int64_t, Token> kept;
      for (auto p : keep) kept[p] = r.at(p);
      r = kept;
    }
  }
};

// Random stream of appends (1-3 tokens), observations (random Q, causal probabilities in
// multiples of 1/8, so every sum is exact in fp32), add_scores (multiples of 1/4) and evicts,
// through the cache and the reference; compares kept positions and every ranking score.
template <class Scorer>
void run_random_stream(const EvictionOptions& e, uint32_t seed) {
  const int64_t B = 2, H = 4;
  auto cache = make_cache<Scorer>(B, H, e);
  Reference<Scorer> ref(B);
  std::mt19937 rng(seed);
  int64_t since_pass = 0;
  for (int step = 0; step < 40; ++step) {
    INFO("step " << step);
    const int64_t T = std::uniform_int_distribution<int64_t>(1, 3)(rng);
    append(cache, T);
    ref.append(T);
    since_pass += 1;
    const int64_t S = cache.size(0);
    const auto positions = cache.positions(0).clone();
    if (std::uniform_int_distribution<int>(0, 3)(rng) > 0) {
      const int64_t Q = std::uniform_int_distribution<int64_t>(1, S)(rng);
      std::vector<float> flat(B * H * Q * S);
      for (int64_t b = 0; b < B; ++b) {
        const auto pos = kvevict_test::to_vec<int64_t>(positions[b]);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t q = 0; q < Q; ++q) {
            for (int64_t s = 0; s < S; ++s) {
              const bool visible = pos[s] <= ref.seen - Q + q;
              flat[((b * H + h) * Q + q) * S + s] =
                  visible ? std::uniform_int_distribution<int>(0, 8)(rng) / 8.f : 0.f;
            }
          }
        }
      }
      const auto p = probs(flat, B, H, Q, S);
      cache.observe(0, p);
      ref.observe(p, positions);
    }
    if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) {
      std::vector<float> flat(B * S);
      for (auto& x : flat) x = std::uniform_int_distribution<int>(0, 8)(rng) / 4.f;
      const auto x = at::tensor(flat).view({B, S});
      cache.add_scores(0, x);
      ref.add(x, positions);
    }
    const int64_t evicted = cache.evict(0);
    if (S > e.capacity() && since_pass >= e.evict_every()) {
      CHECK(evicted == B * (S - e.capacity()));  // summed over the rows
      ref.evict(e);
      since_pass = 0;
    } else {
      CHECK(evicted == 0);
    }
    const auto pos_now = cache.positions(0);
    const auto scores_now = cache.scores(0);
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int64_t> expected;
      for (const auto& kv : ref.rows[b]) expected.push_back(kv.first);
      REQUIRE(kvevict_test::kept_positions(cache, 0, b) == expected);
      const auto pos = kvevict_test::to_vec<int64_t>(pos_now[b]);
      const auto sc = kvevict_test::to_vec<float>(scores_now[b]);
      for (size_t s = 0; s < pos.size(); ++s) {
        INFO("row " << b << ", position " << pos[s]);
        CHECK(sc[s] == Approx(Reference<Scorer>::rank(ref.rows[b].at(pos[s]))).epsilon(1e-6));
      }
    }
  }
}

}  // namespace

TEST_CASE("CumulativeAttention adds mean over heads of the sum over queries", "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    const auto s = run_script<CumulativeAttention>();
    check_scores(s[0], {{0, 0, 0}, {0, 0, 0}});
    // Row 0: sum_q h0 [.75 .75 .5], h1 [1 .5 .5] -> mean [.875 .625 .5];
    // row 1: h0 [0 1 1], h1 [1 .75 .25] -> [.5 .875 .625].
    check_scores(s[1], {{0.875, 0.625, 0.5}, {0.5, 0.875, 0.625}});
    check_scores(s[2], {{0.875, 0.625, 0.5, 0}, {0.5, 0.875, 0.625, 0}});
    // + row 0 [.375 .125 .125 .375], row 1 [0 0 .25 .75].
    check_scores(s[3], {{1.25, 0.75, 0.625, 0.375}, {0.5, 0.875, 0.875, 0.75}});
    // add_scores adds.
    check_scores(s[4], {{2.25, 2.75, 3.625, 4.375}, {4.5, 3.875, 2.875, 1.75}});
  });
}

TEST_CASE("MeanObservedAttention divides by the queries that could see each token, 0 before any",
          "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    const auto s = run_script<MeanObservedAttention>();
    check_scores(s[0], {{0, 0, 0}, {0, 0, 0}});
    // Queries at positions 1 and 2: tokens 0 and 1 seen twice, token 2 once.
    check_scores(s[1], {{0.875 / 2, 0.625 / 2, 0.5}, {0.5 / 2, 0.875 / 2, 0.625}});
    // The new token has no observation yet: 0.
    check_scores(s[2], {{0.875 / 2, 0.625 / 2, 0.5, 0}, {0.5 / 2, 0.875 / 2, 0.625, 0}});
    // One query at position 3 sees all four: counts [3, 3, 2, 1].
    check_scores(s[3], {{1.25 / 3, 0.75 / 3, 0.625 / 2, 0.375}, {0.5 / 3, 0.875 / 3, 0.875 / 2, 0.75}});
    // add_scores adds and counts one observation: counts [4, 4, 3, 2].
    check_scores(s[4], {{2.25 / 4, 2.75 / 4, 3.625 / 3, 4.375 / 2}, {4.5 / 4, 3.875 / 4, 2.875 / 3, 1.75 / 2}});
  });
}

TEST_CASE("LatestAttention replaces the score with the last query's mean over heads", "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    const auto s = run_script<LatestAttention>();
    check_scores(s[0], {{0, 0, 0}, {0, 0, 0}});
    // Last query only: row 0 mean([.25 .25 .5], [0 .5 .5]), row 1 mean([0 0 1], [.5 .25 .25]).
    check_scores(s[1], {{0.125, 0.375, 0.5}, {0.25, 0.125, 0.625}});
    check_scores(s[2], {{0.125, 0.375, 0.5, 0}, {0.25, 0.125, 0.625, 0}});
    check_scores(s[3], {{0.375, 0.125, 0.125, 0.375}, {0, 0, 0.25, 0.75}});
    // add_scores replaces.
    check_scores(s[4], kAdded);
  });
}

TEST_CASE("Scorers on a causal multi-query observation through attend", "[scorers][cpu]") {
  // Zero keys give equal logits: attend's causal mask makes query q (position q) attend
  // 1/(q+1) to each of positions 0..q. Sums over the 4 queries: [25/12, 13/12, 7/12, 1/4];
  // queries that could see each token: [4, 3, 2, 1].
  const auto run = [](auto cache) {
    append(cache, 4);
    at::Tensor p;
    kvevict::attend(at::zeros({1, 2, 4, kQk}), cache, 0, c10::nullopt, &p);
    REQUIRE(p.sizes() == at::IntArrayRef({1, 2, 4, 4}));
    CHECK(p[0][1][1][2].item<float>() == 0.f);  // position 2 is in the future of query 1
    return cache.scores(0);
  };
  kvevict_test::on_both_paths([&] {
    check_scores(run(make_cache<CumulativeAttention>(1, 2)), {{25.0 / 12, 13.0 / 12, 7.0 / 12, 0.25}});
    check_scores(run(make_cache<MeanObservedAttention>(1, 2)), {{25.0 / 48, 13.0 / 36, 7.0 / 24, 0.25}});
    check_scores(run(make_cache<LatestAttention>(1, 2)), {{0.25, 0.25, 0.25, 0.25}});
  });
}

TEST_CASE("add_scores: adds, adds and counts one observation, or replaces", "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    auto cum = make_cache<CumulativeAttention>(1, 3);
    auto mean = make_cache<MeanObservedAttention>(1, 3);
    auto latest = make_cache<LatestAttention>(1, 3);
    append(cum, 3);
    append(mean, 3);
    append(latest, 3);
    for (const Rows& r : {Rows{{1, 2, 3}}, Rows{{3, 2, 1}}, Rows{{0.5, 0, 8}}}) {
      cum.add_scores(0, rows_tensor(r));
      mean.add_scores(0, rows_tensor(r));
      latest.add_scores(0, rows_tensor(r));
    }
    check_scores(cum.scores(0), {{4.5, 4, 12}});
    check_scores(mean.scores(0), {{1.5, 4.0 / 3, 4}});
    check_scores(latest.scores(0), {{0.5, 0, 8}});
    // A new token counts observations only from its own arrival.
    append(mean, 1);
    mean.add_scores(0, rows_tensor({{1, 1, 1, 2}}));
    check_scores(mean.scores(0), {{5.5 / 4, 5.0 / 4, 13.0 / 4, 2}});
    // Any floating dtype is accepted and accumulated in fp32.
    cum.add_scores(0, rows_tensor({{0.5, 0.25, 1}}).to(at::kHalf));
    cum.add_scores(0, rows_tensor({{0.5, 0.25, 1}}).to(at::kDouble));
    check_scores(cum.scores(0), {{5.5, 4.5, 14}});
  });
}

TEST_CASE("Observed probabilities of any floating dtype give the same scores", "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    for (auto dtype : {at::kHalf, at::kBFloat16, at::kDouble}) {
      INFO("probs dtype " << dtype);
      auto cache = make_cache<CumulativeAttention>(2, 2);
      append(cache, 3);
      cache.observe(0, obs1().to(dtype));
      check_scores(cache.scores(0), {{0.875, 0.625, 0.5}, {0.5, 0.875, 0.625}});
    }
  });
}

TEST_CASE("Scores accumulate in fp32 even for a bf16 cache fed bf16 probabilities", "[scorers][cpu]") {
  // 512 observations of 2^-9: exactly 1 in fp32; a bf16 accumulator stalls at 0.5.
  kvevict_test::on_both_paths([] {
    auto cache = make_cache<CumulativeAttention>(1, 2, EvictionOptions(64), at::kBFloat16);
    append(cache, 1);
    const auto p = at::full({1, 2, 1, 1}, 1.0 / 512, at::kBFloat16);
    for (int i = 0; i < 512; ++i) cache.observe(0, p);
    const auto s = cache.scores(0);
    CHECK(s.scalar_type() == at::kFloat);
    CHECK(s.item<float>() == 1.0f);
  });
}

TEST_CASE("Eviction ranks by the scorer's score: sum, mean over observations, or latest", "[scorers][cpu]") {
  // n_sink 0, budget 1, n_recent 1. Tokens 0, 1; add [.75, 0]; token 2; add [.75, 0, 1]; token 3.
  // Sums [1.5, 0, 1, 0], observation counts [2, 2, 1, 0] -> means [.75, 0, 1, 0];
  // latest [.75, 0, 1, 0]. Cumulative keeps 0, the others keep 2; the window keeps 3.
  const auto run = [](auto cache) {
    append(cache, 2);
    cache.add_scores(0, rows_tensor({{0.75, 0}}));
    append(cache, 1);
    cache.add_scores(0, rows_tensor({{0.75, 0, 1}}));
    append(cache, 1);
    CHECK(cache.evict(0) == 2);
    return kvevict_test::kept_positions(cache, 0);
  };
  const auto e = EvictionOptions(1).n_sink(0).n_recent(1);
  kvevict_test::on_both_paths([&] {
    CHECK(run(make_cache<CumulativeAttention>(1, 2, e)) == std::vector<int64_t>{0, 3});
    CHECK(run(make_cache<MeanObservedAttention>(1, 2, e)) == std::vector<int64_t>{2, 3});
    CHECK(run(make_cache<LatestAttention>(1, 2, e)) == std::vector<int64_t>{2, 3});
  });
}

TEST_CASE("Scores travel with their tokens through eviction, and a new token starts at 0", "[scorers][cpu]") {
  // n_sink 1, budget 1, n_recent 1 (capacity 3). Prefill 5 with scores [1, 9, 8, 7, 2]:
  // keeps 0, 1 (9) and 4; the freed slots held scores 8 and 7, which must not leak into
  // the token appended next.
  const auto run = [](auto cache, const Rows& after) {
    append(cache, 5);
    cache.add_scores(0, rows_tensor({{1, 9, 8, 7, 2}}));
    CHECK(cache.evict(0) == 2);
    append(cache, 1);
    const auto pos = kvevict_test::to_vec<int64_t>(cache.positions(0)[0]);
    const auto sc = kvevict_test::to_vec<float>(cache.scores(0)[0]);
    REQUIRE(pos.size() == 4);
    for (size_t s = 0; s < pos.size(); ++s) {
      INFO("position " << pos[s]);
      const size_t k = pos[s] == 0 ? 0 : pos[s] == 1 ? 1 : pos[s] == 4 ? 2 : 3;
      REQUIRE((pos[s] == 0 || pos[s] == 1 || pos[s] == 4 || pos[s] == 5));
      CHECK(sc[s] == Approx(after[0][k]));
    }
  };
  kvevict_test::on_both_paths([&] {
    const auto e = EvictionOptions(1).n_sink(1).n_recent(1);
    run(make_cache<CumulativeAttention>(1, 2, e), {{1, 9, 2, 0}});
    run(make_cache<MeanObservedAttention>(1, 2, e), {{1, 9, 2, 0}});
    run(make_cache<LatestAttention>(1, 2, e), {{1, 9, 2, 0}});
  });
}

TEST_CASE("scores() is a copy", "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    auto cache = make_cache<CumulativeAttention>(1, 2);
    append(cache, 2);
    cache.add_scores(0, rows_tensor({{1, 2}}));
    cache.scores(0).fill_(7);
    check_scores(cache.scores(0), {{1, 2}});
  });
}

TEST_CASE("observe and add_scores reject bad Q, shape or dtype and leave scores unchanged",
          "[scorers][errors][cpu]") {
  kvevict_test::on_both_paths([] {
    auto cache = make_cache<MeanObservedAttention>(1, 2);
    append(cache, 3);
    cache.add_scores(0, rows_tensor({{1, 2, 3}}));
    CHECK_THROWS_WITH(cache.observe(0, at::zeros({1, 2, 4, 3})), Contains("Q must be in [1, 3], got 4"));
    CHECK_THROWS_WITH(cache.observe(0, at::zeros({1, 2, 0, 3})), Contains("Q must be in [1, 3], got 0"));
    CHECK_THROWS_WITH(cache.observe(0, at::zeros({1, 2, 1, 3}, at::kLong)),
                      Contains("attention probs must have a floating dtype, got Long"));
    CHECK_THROWS_WITH(cache.observe(0, at::zeros({1, 2, 3})), Contains("got [1, 2, 3]"));
    CHECK_THROWS_WITH(cache.add_scores(0, at::zeros({1, 2})), Contains("[1, 3]") && Contains("got [1, 2]"));
    CHECK_THROWS_WITH(cache.add_scores(0, at::zeros({1, 3}, at::kInt)),
                      Contains("scores must have a floating dtype, got Int"));
    CHECK_THROWS_AS(cache.observe(1, at::zeros({1, 2, 1, 3})), c10::IndexError);
    check_scores(cache.scores(0), {{1, 2, 3}});
    // The observation counts were not touched either: one more add_scores divides by 2.
    cache.add_scores(0, rows_tensor({{1, 2, 3}}));
    check_scores(cache.scores(0), {{1, 2, 3}});
    cache.add_scores(0, rows_tensor({{4, 4, 3}}));
    check_scores(cache.scores(0), {{2, 8.0 / 3, 3}});
  });
}

TEST_CASE("Scorers match a reference model over random streams of appends, observations and evictions",
          "[scorers][cpu]") {
  const std::vector<EvictionOptions> configs = {EvictionOptions(2).n_sink(1).n_recent(2),
                                                EvictionOptions(3).n_sink(0).n_recent(1).evict_every(2),
                                                EvictionOptions(1).n_sink(2).n_recent(0).evict_every(3)};
  kvevict_test::on_both_paths([&] {
    uint32_t seed = 1;
    for (const auto& e : configs) {
      INFO("n_sink=" << e.n_sink() << " budget=" << e.budget() << " n_recent=" << e.n_recent()
                     << " evict_every=" << e.evict_every());
      run_random_stream<CumulativeAttention>(e, seed++);
      run_random_stream<MeanObservedAttention>(e, seed++);
      run_random_stream<LatestAttention>(e, seed++);
    }
  });
}

TEST_CASE("check_finite rejects a score that overflows fp32, not only non-finite input", "[scorers][errors][cpu]") {
  for (bool tensor_path : {false, true}) {
    kvevict_test::ForceTensorPath force(tensor_path);
    INFO("tensor_path=" << tensor_path);
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 2).qk_dim(4).v_dim(4), EvictionOptions(1).n_sink(1).n_recent(1));
    cache.update(0, at::zeros({1, 2, 3, 4}), at::zeros({1, 2, 3, 4}));
    const auto big = at::full({1, 3}, 3e38f);  // finite; twice it is not
    cache.add_scores(0, big);
    CHECK_THROWS_WITH(cache.add_scores(0, big), Contains("fp32 overflow"));
    CHECK(at::equal(cache.scores(0), big));  // unchanged by the throw
  }
}

// ---------------------------------------------------------------------------------------------
// DecayedAttention, uniform attention, near-ties on both paths
// ---------------------------------------------------------------------------------------------

TEST_CASE("DecayedAttention: score = gamma * score + contribution, hand-worked", "[scorers][cpu]") {
  kvevict_test::on_both_paths([] {
    using kvevict::DecayedAttention;
    Cache<DecayedAttention> cache(kvevict::MlaCacheOptions(1, 2).qk_dim(kQk).v_dim(kV), EvictionOptions(64),
                                  DecayedAttention(0.5f));
    append(cache, 3);
    // Observation 1 (one query, position 2): head mean [0.5, 0.25, 0.25].
    cache.observe(0, probs({0.5f, 0.25f, 0.25f, 0.5f, 0.25f, 0.25f}, 1, 2, 1, 3));
    check_scores(cache.scores(0), {{0.5, 0.25, 0.25}});
    // Observation 2: head mean [0, 0.25, 0.75] -> 0.5 * [0.5, 0.25, 0.25] + [0, 0.25, 0.75].
    cache.observe(0, probs({0.f, 0.5f, 0.5f, 0.f, 0.f, 1.f}, 1, 2, 1, 3));
    check_scores(cache.scores(0), {{0.25, 0.375, 0.875}});
    // add_scores is one more observation: 0.5 * score + x.
    cache.add_scores(0, rows_tensor({{1, 0, 0}}));
    check_scores(cache.scores(0), {{1.125, 0.1875, 0.4375}});
    CHECK(cache.policy().scorer().gamma() == 0.5f);
  });
  CHECK_THROWS_WITH(kvevict::DecayedAttention(1.5f), Contains("gamma must be in [0, 1], got 1.5"));
  CHECK_THROWS_AS(kvevict::DecayedAttention(std::nanf("")), c10::ValueError);
}

TEST_CASE("DecayedAttention lets a stale heavy hitter go where CumulativeAttention keeps it", "[scorers][cpu]") {
  // Position 1 gets all the attention once, then never again; later tokens get a little each step.
  auto run = [](auto& cache) {
    append(cache, 3);  // positions 0, 1, 2
    cache.observe(0, probs({0.f, 1.f, 0.f}, 1, 1, 1, 3));
    for (int step = 0; step < 6; ++step) {
      append(cache, 1);
      const int64_t S = cache.size(0);
      std::vector<float> p(S, 0.f);
      const auto pos = kvevict_test::to_vec<int64_t>(cache.positions(0)[0]);
      for (int64_t s = 0; s < S; ++s) p[s] = pos[s] == 1 ? 0.f : 1.f / static_cast<float>(S - 1);
      cache.observe(0, probs(p, 1, 1, 1, S));
      cache.evict(0);
    }
    return kvevict_test::kept_positions(cache, 0);
  };
  const auto e = EvictionOptions(1).n_sink(1).n_recent(1);  // capacity 3: one heavy hitter
  auto cumulative = Cache<CumulativeAttention>(kvevict::MlaCacheOptions(1, 1).qk_dim(kQk).v_dim(kV), e);
  auto decayed = Cache<kvevict::DecayedAttention>(kvevict::MlaCacheOptions(1, 1).qk_dim(kQk).v_dim(kV), e,
                                                  kvevict::DecayedAttention(0.5f));
  CHECK(run(cumulative) == std::vector<int64_t>{0, 1, 8});  // the stale hitter stays
  const auto kept = run(decayed);
  CHECK(kept.size() == 3);
  CHECK(std::find(kept.begin(), kept.end(), 1) == kept.end());  // it faded and left
}

TEST_CASE("Uniform attention: MeanObserved and Latest keep a sliding window, Cumulative keeps the oldest",
          "[scorers][cpu]") {
  // Every query gives every token it can see the same attention, 1/8 (uniform over tokens and
  // steps; not renormalised, so that every observation of every token is equal).
  auto run = [](auto& cache) {
    for (int step = 0; step < 20; ++step) {
      append(cache, 1);
      const int64_t S = cache.size(0);
      cache.observe(0, at::full({1, 1, 1, S}, 0.125));
      cache.evict(0);
    }
    return kvevict_test::kept_positions(cache, 0);
  };
  const auto e = EvictionOptions(3).n_sink(1).n_recent(2);  // capacity 6
  const auto o = kvevict::MlaCacheOptions(1, 1).qk_dim(kQk).v_dim(kV);
  auto cumulative = Cache<CumulativeAttention>(o, e);
  auto mean = Cache<MeanObservedAttention>(o, e);
  auto latest = Cache<LatestAttention>(o, e);
  CHECK(run(cumulative) == std::vector<int64_t>{0, 1, 2, 3, 18, 19});  // older tokens were seen more
  CHECK(run(mean) == std::vector<int64_t>{0, 15, 16, 17, 18, 19});     // sinks + a sliding window
  CHECK(run(latest) == std::vector<int64_t>{0, 15, 16, 17, 18, 19});
}

TEST_CASE("Near-ties with non-dyadic probabilities: the CPU path and the tensor path keep the same tokens",
          "[scorers][cpu]") {
  // Softmax probabilities over many heads and queries: fp32 sums in different orders would
  // differ in the last bits; the exact reduction makes every path agree bit for bit.
  auto run = [](bool tensor_path, uint64_t seed) {
    kvevict_test::ForceTensorPath force(tensor_path);
    at::manual_seed(seed);
    const int64_t B = 3, H = 16;
    auto cache = Cache<MeanObservedAttention>(kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(kQk).v_dim(kV),
                                              EvictionOptions(12).n_sink(2).n_recent(3).evict_every(2));
    std::vector<at::Tensor> scores;
    for (int step = 0; step < 60; ++step) {
      const int64_t T = step % 7 == 0 ? 3 : 1;
      append(cache, T);
      const int64_t S = cache.size(0);
      // Near-ties: logits quantised to a few levels plus tiny noise.
      const auto logits = at::randint(0, 3, {B, H, T, S}).to(at::kFloat).add(at::randn({B, H, T, S}).mul(1e-6));
      const auto pos = cache.positions(0).view({B, 1, 1, S});
      const auto qpos = at::arange(cache.seen_tokens(0) - T, cache.seen_tokens(0)).view({1, 1, T, 1});
      const auto p = at::softmax(logits.masked_fill(pos.gt(qpos), -std::numeric_limits<float>::infinity()), -1);
      cache.observe(0, p);
      cache.evict(0);
      scores.push_back(cache.scores(0));
      scores.push_back(cache.positions(0));
    }
    return scores;
  };
  for (uint64_t seed : {1, 2, 3}) {
    INFO("seed " << seed);
    const auto host = run(false, seed), tensor = run(true, seed);
    REQUIRE(host.size() == tensor.size());
    for (size_t i = 0; i < host.size(); ++i) {
      INFO("snapshot " << i);
      CHECK(at::equal(host[i], tensor[i]));
    }
  }
}
