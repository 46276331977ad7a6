// Scores from a fused kernel's LSE (lse_scores.hpp), observation in pieces, one-shot prompt
// compression and chunked prefill (prefill.hpp), SnapKV, per-layer capacities, fp16 logits.
//
// Oracles: probabilities and LSEs are computed here in double precision (softmax and
// logsumexp of the scaled, masked logits, with the masks written out in loops), never by the
// code under test. "observe(probs)" below means a twin cache fed those oracle probabilities.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

using Catch::Matchers::Contains;
using kvevict::EvictionOptions;

namespace {

constexpr int64_t kB = 2, kH = 4, kQk = 16, kV = 8, kLora = 12, kRope = 4;

/// A user scorer: the largest single observation a token ever got.
struct MaxObserved {
  static constexpr const char* kName = "MaxObserved";
  static constexpr bool kLastQueryOnly = false;
  static constexpr int64_t kStateWidth = 1;
  void apply(float* state, float c, float /*observers*/) const noexcept { state[0] = std::max(state[0], c); }
  float rank(const float* state) const noexcept { return state[0]; }
  void apply(const at::Tensor& state, const at::Tensor& c, const at::Tensor& /*observers*/) const {
    state.select(2, 0).copy_(at::maximum(state.select(2, 0), c));
  }
  at::Tensor rank(const at::Tensor& state) const { return state.select(2, 0); }
};

/// Oracle probabilities [B, H, Q, S] (fp32, from double) and LSE [B, H, Q] (fp32) of double
/// logits [B, H, Q, S]: key s is seen by column q of row b when pos[b][s] >= 0 and pos[b][s] <=
/// seen[b] - Q + q, and column q is real (q >= Q - counts[b]). Pads: probabilities 0, lse 0.
struct Oracle {
  at::Tensor probs, lse;
};

Oracle oracle(const at::Tensor& logits, const at::Tensor& positions, const std::vector<int64_t>& seen,
              const std::vector<int64_t>& counts) {
  const int64_t B = logits.size(0), H = logits.size(1), Q = logits.size(2), S = logits.size(3);
  const auto lg = logits.to(at::kDouble).contiguous();
  const auto pos = positions.to(at::kCPU).contiguous();
  auto probs = at::zeros({B, H, Q, S}, at::kDouble);
  auto lse = at::zeros({B, H, Q}, at::kDouble);
  const double* x = lg.data_ptr<double>();
  const int64_t* p = pos.data_ptr<int64_t>();
  double* pr = probs.data_ptr<double>();
  double* ls = lse.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t q = 0; q < Q; ++q) {
        if (q < Q - counts[b]) continue;  // pad column
        const int64_t qpos = seen[b] - Q + q;
        const double* row = x + ((b * H + h) * Q + q) * S;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t s = 0; s < S; ++s) {
          if (p[b * S + s] >= 0 && p[b * S + s] <= qpos) m = std::max(m, row[s]);
        }
        double sum = 0;
        for (int64_t s = 0; s < S; ++s) {
          if (p[b * S + s] >= 0 && p[b * S + s] <= qpos) sum += std::exp(row[s] - m);
        }
        for (int64_t s = 0; s < S; ++s) {
          if (p[b * S + s] >= 0 && p[b * S + s] <= qpos) pr[((b * H + h) * Q + q) * S + s] = std::exp(row[s] - m) / sum;
        }
        ls[(b * H + h) * Q + q] = m + std::log(sum);
      }
    }
  }
  return {probs.to(at::kFloat), lse.to(at::kFloat)};
}

/// |got - expected| <= 1e-6 |expected| + abs_floor, element by element, over live slots.
void check_close(const at::Tensor& got, const at::Tensor& expected, double abs_floor) {
  REQUIRE(got.sizes() == expected.sizes());
  const auto g = kvevict_test::to_vec<double>(got.flatten()), e = kvevict_test::to_vec<double>(expected.flatten());
  int64_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(g[i] - e[i]), tol = 1e-6 * std::fabs(e[i]) + abs_floor;
    if (!(err <= tol)) ++bad;
    worst = std::max(worst, err / (std::fabs(e[i]) + 1e-30));
  }
  INFO("worst relative error " << worst << ", abs floor " << abs_floor);
  CHECK(bad == 0);
}

template <class Cache>
std::vector<int64_t> seen_rows(const Cache& c) {
  std::vector<int64_t> s;
  for (int64_t b = 0; b < c.batch_size(); ++b) s.push_back(c.seen_tokens(0, b));
  return s;
}

template <class Cache>
void check_same_positions(const Cache& a, const Cache& b) {
  for (int64_t r = 0; r < a.batch_size(); ++r) {
    INFO("row " << r);
    CHECK(kvevict_test::kept_positions(a, 0, r) == kvevict_test::kept_positions(b, 0, r));
  }
}

// The script both layouts run: a ragged prefill chunk (Q = 512, left padding: row 1 appends
// 300), a pass (slot order then differs from position order), dense decode steps (Q = 1) with
// passes, and a ragged decode step (row 1 idle). Twin caches: `ref` observes the oracle
// probabilities, `lse` recomputes them from the oracle LSE.
struct Step {
  int64_t T;
  std::vector<int64_t> counts;
};
const std::vector<Step> kScript = {{512, {512, 300}}, {1, {1, 1}}, {1, {1, 1}}, {1, {1, 0}}, {1, {1, 1}}};

template <class Scorer>
using Expanded = kvevict::BasicMlaCache<kvevict::EvictionPolicy<Scorer>>;
template <class Scorer>
using Latent = kvevict::BasicMlaLatentCache<kvevict::EvictionPolicy<Scorer>>;

EvictionOptions script_eviction() { return EvictionOptions(40).n_sink(2).n_recent(8); }

template <class Scorer>
void run_expanded(kvevict::LseBase base) {
  const auto o = kvevict::MlaCacheOptions(1, kH).batch_size(kB).qk_dim(kQk).v_dim(kV);
  Expanded<Scorer> ref(o, script_eviction()), lse(o, script_eviction());
  at::manual_seed(7);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kQk));
  int64_t queries = 0;
  for (const auto& st : kScript) {
    INFO("step T = " << st.T);
    const auto k = at::randn({kB, kH, st.T, kQk}), v = at::randn({kB, kH, st.T, kV});
    const auto q = at::randn({kB, kH, st.T, kQk}).mul(1.5);
    ref.update(0, k, v, st.counts);
    lse.update(0, k, v, st.counts);
    const auto logits = at::matmul(q.to(at::kDouble).mul(scale), ref.keys(0).to(at::kDouble).transpose(-2, -1));
    const auto orc = oracle(logits, ref.positions(0), seen_rows(ref), st.counts);
    ref.observe(0, orc.probs);
    const auto l = base == kvevict::LseBase::kE ? orc.lse : orc.lse.div(std::log(2.0));
    kvevict::observe_lse(q, lse, 0, l, scale, kvevict::LseOptions().query_chunk(100).head_chunk(3).base(base));
    queries += st.T;
    check_close(lse.scores(0), ref.scores(0), static_cast<double>(queries) / 4294967296.0);
    ref.evict(0);
    lse.evict(0);
    check_same_positions(ref, lse);
  }
}

template <class Scorer>
void run_latent() {
  const auto o = kvevict::MlaLatentCacheOptions(1, kH).batch_size(kB).kv_lora_rank(kLora).qk_rope_dim(kRope);
  Latent<Scorer> ref(o, script_eviction()), lse(o, script_eviction());
  at::manual_seed(8);
  const double scale = 0.2;
  int64_t queries = 0;
  for (const auto& st : kScript) {
    INFO("step T = " << st.T);
    const auto ckv = at::randn({kB, st.T, kLora}), kpe = at::randn({kB, st.T, kRope});
    const auto qa = at::randn({kB, kH, st.T, kLora}), qpe = at::randn({kB, kH, st.T, kRope});
    ref.update(0, ckv, kpe, st.counts);
    lse.update(0, ckv, kpe, st.counts);
    const auto logits = at::matmul(qa.to(at::kDouble), ref.ckv(0).to(at::kDouble).unsqueeze(1).transpose(-2, -1))
                            .add(at::matmul(qpe.to(at::kDouble), ref.kpe(0).to(at::kDouble).unsqueeze(1).transpose(-2, -1)))
                            .mul(scale);
    const auto orc = oracle(logits, ref.positions(0), seen_rows(ref), st.counts);
    ref.observe(0, orc.probs);
    kvevict::observe_lse_absorbed(qa, qpe, lse, 0, orc.lse, scale, kvevict::LseOptions().query_chunk(64).head_chunk(2));
    queries += st.T;
    check_close(lse.scores(0), ref.scores(0), static_cast<double>(queries) / 4294967296.0);
    ref.evict(0);
    lse.evict(0);
    check_same_positions(ref, lse);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("observe_lse gives every scorer what observe(probs) gives it (expanded, ragged, Q = 512 and 1)",
                   "[lse][cpu]", kvevict::CumulativeAttention, kvevict::MeanObservedAttention,
                   kvevict::LatestAttention, kvevict::DecayedAttention, kvevict::SnapKV, MaxObserved) {
  kvevict_test::on_both_paths([] { run_expanded<TestType>(kvevict::LseBase::kE); });
}

TEMPLATE_TEST_CASE("observe_lse_absorbed gives every scorer what observe(probs) gives it (latent)", "[lse][cpu]",
                   kvevict::CumulativeAttention, kvevict::MeanObservedAttention, kvevict::LatestAttention,
                   kvevict::DecayedAttention, kvevict::SnapKV, MaxObserved) {
  kvevict_test::on_both_paths([] { run_latent<TestType>(); });
}

TEST_CASE("observe_lse reads a base-2 LSE (FlashInfer) when told", "[lse][cpu]") {
  run_expanded<kvevict::CumulativeAttention>(kvevict::LseBase::k2);
}

TEST_CASE("observe_lse rejects an LSE that does not match the logits and changes nothing", "[lse][errors][cpu]") {
  const auto o = kvevict::MlaCacheOptions(1, kH).batch_size(1).qk_dim(kQk).v_dim(kV);
  kvevict::MlaCache cache(o, EvictionOptions(8).n_sink(1).n_recent(1));
  at::manual_seed(3);
  cache.update(0, at::randn({1, kH, 6, kQk}), at::randn({1, kH, 6, kV}));
  const auto q = at::randn({1, kH, 6, kQk});
  const auto before = cache.scores(0);
  // An LSE far below the logits (e.g. from another scale): probabilities above 1.
  const auto wrong = at::zeros({1, kH, 6}).sub(5.0);
  CHECK_THROWS_WITH(kvevict::observe_lse(q, cache, 0, wrong, 1.0), Contains("lse does not match the logits"));
  CHECK(at::equal(cache.scores(0), before));
  CHECK_THROWS_WITH(kvevict::observe_lse(q, cache, 0, at::zeros({1, kH, 5}), 1.0), Contains("lse"));
  CHECK_THROWS_WITH(kvevict::observe_lse(q, cache, 0, wrong, 1.0, kvevict::LseOptions().query_chunk(0)),
                    Contains("query_chunk must be >= 1"));
  // LSEs that never put a probability above 1, yet do not match: the probability sums catch
  // them. The true LSE (the masked logits' logsumexp) passes.
  const auto pos = cache.positions(0), qpos = cache.policy().query_positions(0, 6);
  const auto logits = at::matmul(q, cache.keys(0).transpose(-2, -1));  // scale 1
  const auto hidden = pos.unsqueeze(1).gt(qpos.unsqueeze(2)).unsqueeze(1);  // [1, 1, 6, S]: keys newer than the query
  const auto lse = logits.masked_fill(hidden, -INFINITY).logsumexp(-1);
  for (const auto& bad : {lse.add(5.0), lse.div(0.6931471805599453), at::full_like(lse, INFINITY), at::full_like(lse, NAN)}) {
    CHECK_THROWS_WITH(kvevict::observe_lse(q, cache, 0, bad, 1.0), Contains("sum to a value"));
    CHECK(at::equal(cache.scores(0), before));
  }
  CHECK_NOTHROW(kvevict::observe_lse(q, cache, 0, lse, 1.0));
}

TEST_CASE("an observation in pieces is bit-identical to observe() of the whole", "[lse][policy][cpu]") {
  kvevict_test::on_both_paths([] {
    const auto opts = kvevict::EvictionPolicyOptions(1, kH).batch_size(kB);
    kvevict::EvictionPolicy<kvevict::MeanObservedAttention> whole(opts, EvictionOptions(64)),
        pieces(opts, EvictionOptions(64));
    const std::vector<int64_t> counts{9, 5};
    whole.append(0, counts, 9);
    pieces.append(0, counts, 9);
    at::manual_seed(11);
    // Causal probabilities over the 9 slots (row 1 holds 5 tokens; its pads are ignored).
    const auto pos = whole.positions(0);
    auto probs = at::softmax(at::randn({kB, kH, 9, 9}), -1);
    const auto qpos = whole.query_positions(0, 9);
    const auto seen = pos.ge(0).view({kB, 1, 1, 9}).logical_and(pos.view({kB, 1, 1, 9}).le(qpos.view({kB, 1, 9, 1})));
    probs = probs.mul(seen);
    probs = probs.div(probs.sum(-1, true).clamp_min(1e-30));
    whole.observe(0, probs);
    pieces.observe_begin(0, 9);
    for (int64_t q0 : {6, 0, 3}) {
      for (int64_t h0 : {2, 0}) pieces.observe_add(0, probs.narrow(1, h0, 2).narrow(2, q0, 3), q0, h0);
    }
    CHECK(pieces.observing(0));
    pieces.observe_end(0);
    CHECK(at::equal(pieces.scores(0), whole.scores(0)));

    // A missing piece is caught, and changes nothing.
    const auto before = pieces.scores(0);
    pieces.observe_begin(0, 9);
    pieces.observe_add(0, probs.narrow(1, 0, 2), 0, 0);
    CHECK_THROWS_WITH(pieces.observe_end(0), Contains("expected H x counted columns = 36"));
    CHECK(at::equal(pieces.scores(0), before));
    CHECK_FALSE(pieces.observing(0));
    // An append in between discards the open observation.
    pieces.observe_begin(0, 9);
    pieces.append(0, std::vector<int64_t>{1, 1}, 1);
    CHECK_THROWS_WITH(pieces.observe_add(0, probs.narrow(1, 0, 2).narrow(2, 0, 1), 0, 0),
                      Contains("no observation is open"));
    CHECK_THROWS_WITH(pieces.observe_begin(0, 0), Contains("Q must be in [1, 10]"));
  });
}

TEST_CASE("SnapKV: the last window queries vote, heads are averaged, then 1-D pooling (hand-worked)",
          "[lse][scorers][cpu]") {
  // One row, 2 heads, 4 tokens observed by 4 queries (positions 0..3); window 2: only the
  // queries at positions 2 and 3 count.
  //   head 0: q2 = [.5 .25 .25 0]   q3 = [.25 .25 .25 .25]
  //   head 1: q2 = [.75 0 .25 0]    q3 = [.5 0 0 .5]
  //   votes = mean over heads of the window sum = [1.0, 0.25, 0.375, 0.375]
  // Kernel 3, zero padding: avg = [1.25/3, 1.625/3, 1/3, 0.75/3]; max = [1, 1, .375, .375].
  const std::vector<float> flat = {// head 0: q0, q1 (ignored), q2, q3
                                   1, 0, 0, 0, .5f, .5f, 0, 0, .5f, .25f, .25f, 0, .25f, .25f, .25f, .25f,
                                   // head 1
                                   1, 0, 0, 0, 0, 1, 0, 0, .75f, 0, .25f, 0, .5f, 0, 0, .5f};
  const auto probs = at::tensor(flat).view({1, 2, 4, 4});
  kvevict_test::on_both_paths([&] {
    for (auto pooling : {kvevict::SnapKV::Pooling::kAvg, kvevict::SnapKV::Pooling::kMax}) {
      const kvevict::SnapKV snap(2, 3, pooling);
      kvevict::EvictionPolicy<kvevict::SnapKV> p(kvevict::EvictionPolicyOptions(1, 2), EvictionOptions(8), snap);
      p.append(0, std::vector<int64_t>{4}, 4);
      p.observe(0, probs);
      const auto votes = kvevict_test::to_vec<float>(p.scores(0)[0]);
      CHECK(votes == std::vector<float>{1.f, .25f, .375f, .375f});
      const auto pooled = kvevict_test::to_vec<float>(snap.pool(p.scores(0))[0]);
      const std::vector<double> expected = pooling == kvevict::SnapKV::Pooling::kAvg
                                               ? std::vector<double>{1.25 / 3, 1.625 / 3, 1.0 / 3, 0.75 / 3}
                                               : std::vector<double>{1.0, 1.0, 0.375, 0.375};
      for (size_t i = 0; i < 4; ++i) CHECK(pooled[i] == Approx(expected[i]).epsilon(1e-6));
    }
  });
  CHECK_THROWS_WITH(kvevict::SnapKV(32, 4), Contains("kernel must be odd"));
  CHECK_THROWS_WITH(kvevict::SnapKV(0), Contains("window must be >= 1"));
}

namespace {

/// Double oracle of prompt scores: mean over heads of the causal attention that the counted
/// queries (all, or the last `window`) give each token; [B, T] double.
at::Tensor prompt_oracle(const at::Tensor& logits, int64_t window) {
  const int64_t B = logits.size(0), H = logits.size(1), T = logits.size(2);
  const auto pos = at::arange(T, at::kLong).unsqueeze(0).expand({B, T});
  const std::vector<int64_t> seen(static_cast<size_t>(B), T), counts(static_cast<size_t>(B), T);
  const auto orc = oracle(logits, pos, seen, counts);
  // Recompute the probabilities in double for the sum (the oracle's fp32 is only for feeding).
  const auto p = orc.probs.to(at::kDouble);
  return p.narrow(2, T - window, window).sum({1, 2}).div(static_cast<double>(H));
}

}  // namespace

TEST_CASE("prompt_scores equals the double-precision oracle, for H2O and SnapKV, both layouts", "[lse][cpu]") {
  at::manual_seed(21);
  const int64_t T = 300;
  const double scale = 0.25;
  const auto q = at::randn({kB, kH, T, kQk}), k = at::randn({kB, kH, T, kQk});
  const auto logits = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)).mul(scale);
  const auto orc = oracle(logits, at::arange(T, at::kLong).unsqueeze(0).expand({kB, T}),
                          std::vector<int64_t>(kB, T), std::vector<int64_t>(kB, T));
  const auto opts = kvevict::LseOptions().query_chunk(37).head_chunk(3);
  kvevict_test::on_both_paths([&] {
    check_close(kvevict::prompt_scores(q, k, orc.lse, scale, kvevict::CumulativeAttention(), opts),
                prompt_oracle(logits, T), T / 4294967296.0);
    const kvevict::SnapKV snap(16, 5);
    const auto votes = prompt_oracle(logits, 16);
    const auto pooled = at::constant_pad_nd(votes.unsqueeze(1), {2, 2}, 0.0).unfold(2, 5, 1).mean(-1).squeeze(1);
    check_close(kvevict::prompt_scores(q, k, orc.lse, scale, snap, opts), pooled, 16 / 4294967296.0);
  });
  // Latent: ckv/kpe shared by heads.
  const auto qa = at::randn({kB, kH, T, kLora}), qpe = at::randn({kB, kH, T, kRope});
  const auto ckv = at::randn({kB, T, kLora}), kpe = at::randn({kB, T, kRope});
  const auto lat = at::matmul(qa.to(at::kDouble), ckv.to(at::kDouble).unsqueeze(1).transpose(-2, -1))
                       .add(at::matmul(qpe.to(at::kDouble), kpe.to(at::kDouble).unsqueeze(1).transpose(-2, -1)))
                       .mul(scale);
  const auto lorc = oracle(lat, at::arange(T, at::kLong).unsqueeze(0).expand({kB, T}), std::vector<int64_t>(kB, T),
                           std::vector<int64_t>(kB, T));
  check_close(kvevict::prompt_scores_absorbed(qa, qpe, ckv, kpe, lorc.lse, scale, kvevict::CumulativeAttention(), opts),
              prompt_oracle(lat, T), T / 4294967296.0);
}

TEST_CASE("compress_prompt keeps the oracle's tokens and their K/V rows bit-exactly", "[lse][cpu]") {
  at::manual_seed(22);
  const int64_t T = 200;
  const auto e = EvictionOptions(30).n_sink(2).n_recent(6);
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, kH).batch_size(kB).qk_dim(kQk).v_dim(kV), e);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kQk));
  const auto q = at::randn({kB, kH, T, kQk}), k = at::randn({kB, kH, T, kQk}), v = at::randn({kB, kH, T, kV});
  const auto logits = at::matmul(q.to(at::kDouble), k.to(at::kDouble).transpose(-2, -1)).mul(scale);
  const auto orc = oracle(logits, at::arange(T, at::kLong).unsqueeze(0).expand({kB, T}), std::vector<int64_t>(kB, T),
                          std::vector<int64_t>(kB, T));
  const auto keep = kvevict::compress_prompt(cache, 0, q, k, v, orc.lse);
  const auto expected_scores = prompt_oracle(logits, T);
  std::vector<int64_t> all(T);
  for (int64_t t = 0; t < T; ++t) all[t] = t;
  for (int64_t b = 0; b < kB; ++b) {
    INFO("row " << b);
    const auto want = kvevict_test::oracle_keep(all, kvevict_test::to_vec<double>(expected_scores[b]), 2, 30, 6);
    CHECK(kvevict_test::to_vec<int64_t>(keep[b]) == want);
    CHECK(cache.size(0, b) == 38);
    const auto idx = at::tensor(want, at::kLong);
    CHECK(at::equal(cache.keys(0)[b], k[b].index_select(1, idx)));
    CHECK(at::equal(cache.values(0)[b], v[b].index_select(1, idx)));
    // The kept tokens keep their prompt positions (slot order = position order here); the row
    // has seen the whole prompt, and the dropped tokens count as evicted.
    CHECK(kvevict_test::to_vec<int64_t>(cache.positions(0)[b]) == want);
    CHECK(cache.seen_tokens(0, b) == T);
    CHECK(cache.policy().appended(0, b) == T);
  }
  CHECK(cache.stats().tokens_evicted == kB * (T - 38));
  CHECK(cache.stats().eviction_events == 1);
  CHECK_THROWS_WITH(kvevict::compress_prompt(cache, 0, q, k, v, orc.lse), Contains("empty layer"));
  // Decoding goes on at position T; the recent window is the prompt's last tokens, then the new.
  cache.update(0, at::randn({kB, kH, 1, kQk}), at::randn({kB, kH, 1, kV}));
  CHECK(kvevict_test::to_vec<int64_t>(cache.positions(0)[0]).back() == T);
  CHECK(kvevict_test::to_vec<int64_t>(cache.policy().query_positions(0, 1)[0]) == std::vector<int64_t>{T});
  cache.add_scores(0, at::zeros({kB, 39}));
  CHECK(cache.evict(0) == kB);
  for (int64_t b = 0; b < kB; ++b) {
    const auto kept = kvevict_test::kept_positions(cache, 0, b);
    CHECK(std::vector<int64_t>(kept.end() - 6, kept.end()) == std::vector<int64_t>{T - 5, T - 4, T - 3, T - 2, T - 1, T});
  }
  CHECK(cache.stats().tokens_evicted == kB * (T - 38) + kB);
}

TEST_CASE("chunked prefill holds at most capacity + chunk tokens and matches attend over the same chunks",
          "[lse][cpu]") {
  at::manual_seed(23);
  const int64_t T = 100, chunk = 16;
  const auto e = EvictionOptions(20).n_sink(2).n_recent(4);
  const auto o = kvevict::MlaCacheOptions(1, kH).qk_dim(kQk).v_dim(kV);
  kvevict::MlaCache a(o, e), b(o, e);
  const auto q = at::randn({1, kH, T, kQk}), k = at::randn({1, kH, T, kQk}), v = at::randn({1, kH, T, kV});
  at::Tensor out;
  kvevict::prefill_chunked(a, 0, q, k, v, chunk, c10::nullopt, &out);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {  // the loop it documents
    const int64_t n = std::min(chunk, T - t0);
    b.update(0, k.narrow(2, t0, n), v.narrow(2, t0, n));
    CHECK(b.size(0) <= 26 + chunk);
    CHECK(at::equal(kvevict::attend(q.narrow(2, t0, n), b, 0), out.narrow(2, t0, n)));
    b.evict(0);
  }
  CHECK(a.size(0) == 26);
  CHECK(kvevict_test::kept_positions(a, 0) == kvevict_test::kept_positions(b, 0));
}

TEST_CASE("LseRing scores buffered decode queries in one product, as per-step observe_lse", "[lse][cpu]") {
  kvevict_test::on_both_paths([] {
    at::manual_seed(31);
    const auto o = kvevict::MlaCacheOptions(1, kH).batch_size(kB).qk_dim(kQk).v_dim(kV);
    const auto e = EvictionOptions(24).n_sink(2).n_recent(4).evict_every(4);
    kvevict::MlaCache step(o, e), ring_cache(o, e);
    kvevict::LseRing<kvevict::MlaCache> ring(ring_cache);
    CHECK(ring.ring_size() == 4);
    const double scale = 1.0 / std::sqrt(static_cast<double>(kQk));
    for (int64_t t = 0; t < 50; ++t) {
      const auto k = at::randn({kB, kH, 1, kQk}), v = at::randn({kB, kH, 1, kV}), q = at::randn({kB, kH, 1, kQk});
      step.update(0, k, v);
      ring_cache.update(0, k, v);
      const auto logits = at::matmul(q.to(at::kDouble).mul(scale), step.keys(0).to(at::kDouble).transpose(-2, -1));
      const auto orc = oracle(logits, step.positions(0), seen_rows(step), {1, 1});
      kvevict::observe_lse(q, step, 0, orc.lse);
      ring.push(0, q, orc.lse);
      CHECK(ring.buffered(0) < 4);
      if (ring.buffered(0) == 0) check_close(ring_cache.scores(0), step.scores(0), 50 / 4294967296.0);
      step.evict(0);
      ring.evict(0);
      check_same_positions(step, ring_cache);
    }
    // A ragged update with queries buffered is refused; they are dropped.
    ring.flush(0);
    CHECK(ring.buffered(0) == 0);
    const auto k = at::randn({kB, kH, 1, kQk}), v = at::randn({kB, kH, 1, kV});
    ring_cache.update(0, k, v);
    ring.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, kH, 1}).add(10.0));
    ring_cache.update(0, k, v, std::vector<int64_t>{1, 0});
    CHECK_THROWS_WITH(ring.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, kH, 1}).add(10.0)),
                      Contains("flush() before a ragged update"));
    // The buffered column could no longer be scored: the ring dropped it and starts over.
    CHECK(ring.buffered(0) == 0);
    CHECK_NOTHROW(ring.flush(0));
  });
}

TEST_CASE("LseRing with a host tier and recall, flushed before the update of a recall step: as per-step "
          "observe_lse with the same recalls (both paths, both recall kinds)",
          "[lse][tier][recall][cpu]") {
  kvevict_test::on_both_paths([] {
    at::manual_seed(41);
    const auto o = kvevict::MlaCacheOptions(1, kH).batch_size(kB).qk_dim(kQk).v_dim(kV).tier_tokens(64).tier_page_size(2);
    const auto e = EvictionOptions(12).n_sink(2).n_recent(4).evict_every(4);
    kvevict::MlaCache step(o, e), ring_cache(o, e);
    kvevict::LseRing<kvevict::MlaCache> ring(ring_cache);
    const double scale = 1.0 / std::sqrt(static_cast<double>(kQk));
    int64_t recalled = 0, recalled_buffered = 0;
    for (int64_t t = 0; t < 80; ++t) {
      const auto k = at::randn({kB, kH, 1, kQk}), v = at::randn({kB, kH, 1, kV}), q = at::randn({kB, kH, 1, kQk});
      const bool recall = t % 5 == 4;  // not in step with the passes (every 4): columns are buffered
      if (recall) {
        recalled_buffered += ring.buffered(0) > 0 ? 1 : 0;
        ring.flush(0);  // before the update
      }
      step.update(0, k, v);
      ring_cache.update(0, k, v);
      if (recall) {
        const bool two_level = t % 10 == 9;
        const int64_t a = kvevict_test::total(step.recall(0, q, scale, two_level ? 2 : 4, two_level ? 8 : 0));
        const int64_t b = kvevict_test::total(ring_cache.recall(0, q, scale, two_level ? 2 : 4, two_level ? 8 : 0));
        REQUIRE(a == b);
        recalled += a;
      }
      const auto logits = at::matmul(q.to(at::kDouble).mul(scale), step.keys(0).to(at::kDouble).transpose(-2, -1));
      const auto orc = oracle(logits, step.positions(0), seen_rows(step), {1, 1});
      kvevict::observe_lse(q, step, 0, orc.lse);
      ring.push(0, q, orc.lse);
      step.evict(0);
      ring.evict(0);
      INFO("step " << t);
      check_same_positions(step, ring_cache);
      for (int64_t r = 0; r < kB; ++r) CHECK(at::equal(step.tier_positions(0, r), ring_cache.tier_positions(0, r)));
    }
    CHECK(recalled > 0);
    CHECK(recalled_buffered > 0);  // flushes that had columns to score
    ring.flush(0);
    check_close(ring_cache.scores(0), step.scores(0), 50 / 4294967296.0);
  });
}

TEST_CASE("LseRing refuses buffered queries across a recall that brought tokens back, and drops them",
          "[lse][tier][recall][errors][cpu]") {
  // Checks off: the pushes' LSE (10) is not the logits' logsumexp; the ring's checks do not use it.
  const auto o = kvevict::MlaCacheOptions(1, kH)
                     .batch_size(kB)
                     .qk_dim(kQk)
                     .v_dim(kV)
                     .check_observations(false)
                     .tier_tokens(64)
                     .tier_page_size(2);
  kvevict_test::on_both_paths([&] {
    at::manual_seed(43);
    kvevict::MlaCache cache(o, EvictionOptions(8).n_sink(2).n_recent(2).evict_every(8));
    kvevict::LseRing<kvevict::MlaCache> ring(cache);
    const auto step = [&] { cache.update(0, at::randn({kB, kH, 1, kQk}), at::randn({kB, kH, 1, kV})); };
    const auto push = [&] { ring.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, kH, 1}).add(10.0)); };
    const auto recall = [&] { return cache.recall(0, at::randn({kB, kH, 1, kQk}), 0.25, 2); };
    for (int i = 0; i < 40; ++i) step(), push(), ring.evict(0);  // the tier fills
    REQUIRE(cache.stats().tier_tokens > 0);
    ring.flush(0);
    // update, recall, push with two columns buffered from before the recall: the push refuses.
    step(), push();
    step(), push();
    step();
    REQUIRE(kvevict_test::total(recall()) > 0);
    const auto msg = kvevict_test::message_of(push);
    CHECK_THAT(msg, Contains("LseRing::push: layer 0 recalled ") &&
                        Contains(" tokens from its host tier (tier_tokens) while 2 query columns were buffered") &&
                        Contains("flush() the ring before the update of a step that recalls"));
    CHECK(ring.buffered(0) == 0);  // dropped, and the ring starts over
    // A recall after the last push: the scoring (flush, a full ring, a due pass) refuses.
    step(), push();
    REQUIRE(kvevict_test::total(recall()) > 0);
    CHECK_THROWS_WITH(ring.flush(0), Contains("LseRing::flush: layer 0 recalled ") &&
                                         Contains("while 1 query columns were buffered"));
    CHECK(ring.buffered(0) == 0);
    // Used as documented: flush, update, recall, push goes through, and so does its scoring.
    ring.flush(0);
    step();
    REQUIRE(kvevict_test::total(recall()) > 0);
    push();
    step(), push();
    CHECK(ring.buffered(0) == 2);
    CHECK_NOTHROW(ring.flush(0));
    // Without a tier nothing changes: no recall, no count.
    kvevict::MlaCache plain(kvevict::MlaCacheOptions(o).tier_tokens(0), EvictionOptions(8).n_sink(2).n_recent(2));
    kvevict::LseRing<kvevict::MlaCache> r2(plain);
    plain.update(0, at::randn({kB, kH, 1, kQk}), at::randn({kB, kH, 1, kV}));
    r2.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, kH, 1}).add(10.0));
    CHECK_NOTHROW(r2.flush(0));
  });
}

TEST_CASE("LseRing refuses buffered queries whose rows changed: truncate, reset or an unpushed update", "[lse][cpu]") {
  // Checks off: the pushes' LSE (10, above every logit) is not the logits' logsumexp; the ring's
  // row checks do not depend on them.
  const auto o = kvevict::MlaCacheOptions(1, kH).batch_size(kB).qk_dim(kQk).v_dim(kV).check_observations(false);
  const auto e = EvictionOptions(24).n_sink(2).n_recent(4).evict_every(8);
  at::manual_seed(37);
  kvevict::MlaCache cache(o, e);
  kvevict::LseRing<kvevict::MlaCache> ring(cache);
  const auto step = [&] { cache.update(0, at::randn({kB, kH, 1, kQk}), at::randn({kB, kH, 1, kV})); };
  const auto push = [&] { ring.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, kH, 1}).add(10.0)); };
  for (int i = 0; i < 3; ++i) step(), push();
  REQUIRE(ring.buffered(0) == 3);
  // A draft rolled back with queries buffered: the flush names the row and drops the columns.
  cache.truncate(1, 1);
  CHECK_THROWS_WITH(ring.flush(0), Contains("LseRing::flush: layer 0 row 1 has 2 seen tokens, expected 3"));
  CHECK(ring.buffered(0) == 0);
  ring.flush(0);  // nothing left to replay
  // An update without its push: the next push names the row and leaves the ring as it was.
  step(), push();
  step();
  step();
  CHECK_THROWS_WITH(ring.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, kH, 1}).add(10.0)),
                    Contains("LseRing::push: layer 0 row 0 has 6 seen tokens, expected 5"));
  CHECK(ring.buffered(0) == 1);
  // A row reset with queries buffered.
  cache.reset(0);
  CHECK_THROWS_WITH(ring.flush(0), Contains("row 0 has 0 seen tokens, expected 4"));
  // Every push is checked, also with an empty ring: evict_every 1 scores at each push.
  {
    kvevict::MlaCache one(o, EvictionOptions(24).n_sink(2).n_recent(4).evict_every(1));
    kvevict::LseRing<kvevict::MlaCache> r1(one);
    const auto up = [&](int64_t T) { one.update(0, at::randn({kB, kH, T, kQk}), at::randn({kB, kH, T, kV})); };
    const auto lse = [](int64_t T) { return at::zeros({kB, kH, T}).add(10.0); };
    up(1), r1.push(0, at::randn({kB, kH, 1, kQk}), lse(1));
    CHECK(r1.buffered(0) == 0);
    up(1), up(1);
    CHECK_THROWS_WITH(r1.push(0, at::randn({kB, kH, 1, kQk}), lse(1)),
                      Contains("LseRing::push: layer 0 row 0 has 3 seen tokens, expected 2"));
    // q's T must be what the update appended; its shape, the cache's; the layer, one of its.
    r1.flush(0);
    up(1);
    CHECK_THROWS_WITH(r1.push(0, at::randn({kB, kH, 2, kQk}), lse(2)),
                      Contains("q has T = 2 query columns, but the latest update appended 1 tokens to every row"));
    CHECK_THROWS_WITH(r1.push(0, at::randn({kB, 1, 1, kQk}), lse(1)), Contains("q") && Contains("H"));
    CHECK_THROWS_WITH(r1.push(0, at::randn({kB, kH, 1, kQk}), at::zeros({kB, 1, 1})), Contains("lse"));
    CHECK_THROWS_AS(r1.push(3, at::randn({kB, kH, 1, kQk}), lse(1)), c10::IndexError);
    CHECK_THROWS_AS(r1.buffered(-1), c10::IndexError);
    r1.push(0, at::randn({kB, kH, 1, kQk}), lse(1));  // the right push still goes through
  }
  // Used as documented, the same sequence of calls goes through.
  step(), push();
  ring.flush(0);
  cache.truncate(1, 1);
  step(), push();
  ring.flush(0);
  CHECK(ring.buffered(0) == 0);
}

TEST_CASE("per-layer capacities: a pyramid keeps each layer's own budget, a bad layer is named", "[lse][options][cpu]") {
  const std::vector<int64_t> budgets{12, 8, 4, 1};
  const auto e = EvictionOptions(64).n_sink(2).n_recent(3);
  kvevict_test::on_both_paths([&] {
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(4, 2).qk_dim(4).v_dim(2).layer_budgets(budgets), e);
    at::manual_seed(41);
    const auto scores = at::rand({1, 40});
    for (int64_t l = 0; l < 4; ++l) {
      INFO("layer " << l);
      CHECK(cache.capacity(l) == 2 + budgets[l] + 3);
      cache.update(l, at::zeros({1, 2, 40, 4}), at::zeros({1, 2, 40, 2}));
      cache.add_scores(l, scores);
      cache.evict(l);
      CHECK(cache.size(l) == 5 + budgets[l]);
      std::vector<int64_t> all(40);
      for (int64_t t = 0; t < 40; ++t) all[t] = t;
      CHECK(kvevict_test::kept_positions(cache, l) ==
            kvevict_test::oracle_keep(all, kvevict_test::to_vec<double>(scores[0]), 2, budgets[l], 3));
    }
  });
  // Layer 2 ends below capacity 1 (no sinks, no recent window, budget 0): named.
  const auto none = EvictionOptions(4).n_sink(0).n_recent(0);
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(3, 2).layer_budgets({4, 2, 0}), none),
                    Contains("layer 2: capacity") && Contains("layer_budgets[2]=0"));
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(3, 2).layer_budgets({4, -1, 2}), e),
                    Contains("layer_budgets[1] must be in [0, 2^40], got -1"));
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(3, 2).layer_budgets({4, 2}), e),
                    Contains("one entry per layer (num_layers = 3), got 2"));
}

namespace {

/// fp16 queries and keys whose unscaled logits reach 3 x 65,504 while the scaled ones stay near
/// 2,000 (scale 1/96): one key per query gets all the attention.
void fp16_big_logits(const at::Device& device) {
  const int64_t D = 192;
  const double scale = 1.0 / 96.0;
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 1).qk_dim(D).v_dim(4).dtype(at::kHalf).device(device),
                          EvictionOptions(16));
  // Key t is 32 * e_t (fp16-exact); the query of token 3 is 32 * (e_0 + 3 e_3) * ... scaled so
  // that q . k_3 = 196,608 > 65,504 (unscaled), q . k_3 * scale = 2,048.
  auto k = at::zeros({1, 1, 4, D});
  for (int64_t t = 0; t < 4; ++t) k[0][0][t][t] = 32.0;
  auto q = at::zeros({1, 1, 1, D});
  q[0][0][0][3] = 6144.0;  // 6144 * 32 = 196,608
  q[0][0][0][0] = 3072.0;  // 98,304 for key 0
  const auto v = at::arange(16, at::kFloat).view({1, 1, 4, 4});
  cache.update(0, k.to(at::kHalf).to(device), v.to(at::kHalf).to(device));
  at::Tensor probs;
  const auto out = kvevict::attend(q.to(at::kHalf).to(device), cache, 0, scale, &probs);
  REQUIRE(at::isfinite(out.to(at::kFloat)).all().item<bool>());
  REQUIRE(at::isfinite(probs).all().item<bool>());
  // Double oracle: logits 2048 and 1024 (others 0): key 3 takes everything; out = v[3].
  CHECK(probs.to(at::kCPU)[0][0][0][3].item<float>() == 1.0f);
  CHECK(at::equal(out.to(at::kCPU).to(at::kFloat), v[0][0][3].view({1, 1, 1, 4})));
  // And from the LSE a fused kernel would return (2048 for the scaled logits).
  kvevict::MlaCache twin(kvevict::MlaCacheOptions(1, 1).qk_dim(D).v_dim(4).dtype(at::kHalf).device(device),
                         EvictionOptions(16));
  twin.update(0, k.to(at::kHalf).to(device), v.to(at::kHalf).to(device));
  kvevict::observe_lse(q.to(at::kHalf).to(device), twin, 0, at::full({1, 1, 1}, 2048.0, at::kFloat).to(device), scale);
  CHECK(at::equal(twin.scores(0).to(at::kCPU), cache.scores(0).to(at::kCPU)));
}

}  // namespace

TEST_CASE("fp16 logits above 65,504 unscaled stay finite: q is scaled before the product (CPU)",
          "[lse][attention][cpu]") {
  // On CPU fp16 is computed in fp32 (no CPU fp16 matmul in LibTorch 1.13), so this half checks the
  // values; the order that matters for overflow is checked in fp16 here, on the inputs attend()
  // builds: the scaled query times a key is representable, the unscaled product is not.
  const auto q = at::full({1, 192}, 6144.0 / 192.0, at::kHalf), k = at::full({192, 1}, 32.0, at::kHalf);
  const double scale = 1.0 / 64.0;
  const auto unscaled = at::matmul(q.to(at::kFloat), k.to(at::kFloat)).to(at::kHalf);  // 196,608 -> inf in fp16
  const auto scaled = at::matmul(q.to(at::kFloat).mul(scale).to(at::kHalf).to(at::kFloat), k.to(at::kFloat)).to(at::kHalf);
  CHECK(std::isinf(unscaled.item<float>()));
  CHECK(scaled.item<float>() == 3072.0f);
  kvevict_test::on_both_paths([] { fp16_big_logits(at::kCPU); });
}

TEST_CASE("fp16 logits above 65,504 unscaled stay finite on CUDA (fp16 matmul)", "[lse][attention][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  fp16_big_logits(at::Device(at::kCUDA));
}

TEST_CASE("compress_prompt and prefill_chunked reject bad inputs before changing the cache", "[lse][errors][cpu]") {
  kvevict_test::on_both_paths([] {
    kvevict::MlaCache c(kvevict::MlaCacheOptions(1, 2).qk_dim(4).v_dim(3),
                        kvevict::EvictionOptions(3).n_sink(1).n_recent(2));
    const auto q = at::randn({1, 2, 10, 4}), k = at::randn({1, 2, 10, 4}), v = at::randn({1, 2, 10, 3});
    CHECK_THROWS_WITH(kvevict::compress_prompt(c, 0, q, k, v, at::full({1, 2, 10}, NAN)),
                      Catch::Matchers::Contains("lse does not match the logits") && Catch::Matchers::Contains("nan"));
    CHECK(c.seen_tokens(0) == 0);
    CHECK_THROWS_WITH(kvevict::compress_prompt(c, 0, q, k, at::randn({1, 2, 15, 3}), at::zeros({1, 2, 10})),
                      Catch::Matchers::Contains("v must be"));
    CHECK(c.seen_tokens(0) == 0);
    CHECK_THROWS_WITH(kvevict::prefill_chunked(c, 0, at::randn({1, 2, 9, 4}), k, v, 4),
                      Catch::Matchers::Contains("q must be") && Catch::Matchers::Contains("got [1, 2, 9, 4]"));
    CHECK_THROWS_WITH(kvevict::prefill_chunked(c, 0, q, k, at::randn({1, 2, 9, 3}), 4),
                      Catch::Matchers::Contains("v must be"));
    CHECK(c.seen_tokens(0) == 0);
    for (const double bad : {double(NAN), double(INFINITY), 0.0, -1.0}) {
      CHECK_THROWS_WITH(kvevict::prefill_chunked(c, 0, q, k, v, 4, bad),
                        Catch::Matchers::Contains("prefill_chunked: scale must be finite and > 0"));
    }
    CHECK(c.seen_tokens(0) == 0);
    kvevict::prefill_chunked(c, 0, q, k, v, 4);  // the good inputs still work
    CHECK(c.seen_tokens(0) == 10);
  });
}

TEST_CASE("A prompt of 0 tokens is rejected naming the prompt, by every prompt function", "[lse][errors][cpu]") {
  using kvevict_test::message_of;
  kvevict_test::on_both_paths([] {
    kvevict::MlaCache c(kvevict::MlaCacheOptions(1, 2).qk_dim(4).v_dim(3), EvictionOptions(3).n_sink(1).n_recent(2));
    const auto q = at::randn({1, 2, 0, 4}), k = at::randn({1, 2, 0, 4}), v = at::randn({1, 2, 0, 3});
    const auto lse = at::zeros({1, 2, 0});
    const int64_t slots = c.slots(0);
    kvevict::MlaLatentCache lc(kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(4).qk_rope_dim(2),
                               EvictionOptions(3).n_sink(1).n_recent(2));
    const auto qa = at::randn({1, 2, 0, 4}), qpe = at::randn({1, 2, 0, 2});
    const auto ckv = at::randn({1, 0, 4}), kpe = at::randn({1, 0, 2});
    const std::vector<std::pair<std::string, std::string>> got = {
        {"compress_prompt", message_of([&] { kvevict::compress_prompt(c, 0, q, k, v, lse); })},
        {"prompt_scores", message_of([&] { kvevict::prompt_scores(q, k, lse, 0.5); })},
        {"prefill_chunked", message_of([&] { kvevict::prefill_chunked(c, 0, q, k, v, 4); })},
        {"compress_prompt_absorbed", message_of([&] { kvevict::compress_prompt_absorbed(lc, 0, qa, qpe, ckv, kpe, lse); })},
        {"prompt_scores_absorbed", message_of([&] { kvevict::prompt_scores_absorbed(qa, qpe, ckv, kpe, lse, 0.5); })},
        {"prefill_chunked_absorbed", message_of([&] { kvevict::prefill_chunked_absorbed(lc, 0, qa, qpe, ckv, kpe, 4); })}};
    for (const auto& [what, message] : got) {
      INFO(what);
      const bool latent = what.find("absorbed") != std::string::npos;
      CHECK_THAT(message, Contains(what + ": the prompt must hold at least one token") && Contains("got T = 0") &&
                              Contains(latent ? "ckv [B, T, kv_lora_rank]" : "k [B, H, T, qk_dim]"));
    }
    CHECK(c.seen_tokens(0) == 0);
    CHECK(c.slots(0) == slots);
    CHECK(lc.seen_tokens(0) == 0);
  });
}

TEST_CASE("observe_lse and observe_lse_absorbed leave no observation open when they throw", "[lse][errors][cpu]") {
  using kvevict_test::CountingCpuAllocator;
  kvevict_test::on_both_paths([] {
    at::manual_seed(61);
    const auto e = EvictionOptions(8).n_sink(1).n_recent(1);
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, kH).batch_size(kB).qk_dim(kQk).v_dim(kV), e);
    kvevict::MlaLatentCache latent(kvevict::MlaLatentCacheOptions(1, kH).batch_size(kB).kv_lora_rank(kLora).qk_rope_dim(kRope), e);
    cache.update(0, at::randn({kB, kH, 6, kQk}), at::randn({kB, kH, 6, kV}));
    latent.update(0, at::randn({kB, 6, kLora}), at::randn({kB, 6, kRope}));
    const auto q = at::randn({kB, kH, 6, kQk}), qa = at::randn({kB, kH, 6, kLora}), qr = at::randn({kB, kH, 6, kRope});
    const double scale = 0.25;
    // The matching LSEs, from double logits (an oracle independent of the code under test).
    const auto lk = at::matmul(q.to(at::kDouble), cache.keys(0).to(at::kDouble).transpose(-2, -1)).mul(scale);
    const auto ll = at::matmul(qa.to(at::kDouble), latent.ckv(0).to(at::kDouble).unsqueeze(1).transpose(-2, -1))
                        .add(at::matmul(qr.to(at::kDouble), latent.kpe(0).to(at::kDouble).unsqueeze(1).transpose(-2, -1)))
                        .mul(scale);
    const std::vector<int64_t> six(kB, 6);
    const auto lse = oracle(lk, cache.positions(0), six, six).lse, lse_latent = oracle(ll, latent.positions(0), six, six).lse;
    const auto wrong = at::zeros({kB, kH, 6}).sub(5.0);  // far below the logits: probabilities above 1
    const auto before = cache.scores(0), before_latent = latent.scores(0);
    CHECK_THROWS_WITH(kvevict::observe_lse(q, cache, 0, wrong, scale), Contains("lse does not match the logits"));
    CHECK_FALSE(cache.policy().observing(0));
    CHECK(at::equal(cache.scores(0), before));
    CHECK_THROWS_WITH(kvevict::observe_lse_absorbed(qa, qr, latent, 0, wrong, scale), Contains("lse does not match"));
    CHECK_FALSE(latent.policy().observing(0));
    CHECK(at::equal(latent.scores(0), before_latent));
    // An allocation failure at any point: the same.
    for (const bool is_latent : {false, true}) {
      INFO("latent " << is_latent);
      bool completed = false;
      for (int64_t fail_at = 1; fail_at < 200 && !completed; ++fail_at) {
        INFO("failing allocation " << fail_at);
        bool failed = false;
        {
          CountingCpuAllocator failing;
          failing.fail_at(fail_at);
          try {
            if (is_latent) {
              kvevict::observe_lse_absorbed(qa, qr, latent, 0, lse_latent, scale);
            } else {
              kvevict::observe_lse(q, cache, 0, lse, scale);
            }
          } catch (const c10::Error&) {
            failed = true;
          }
        }
        completed = !failed;
        CHECK_FALSE((is_latent ? latent.policy().observing(0) : cache.policy().observing(0)));
        if (failed) CHECK(at::equal(is_latent ? latent.scores(0) : cache.scores(0), is_latent ? before_latent : before));
      }
      CHECK(completed);
    }
  });
}

TEST_CASE("LseOptions: by default a chunk holds every head that fits in chunk_bytes", "[lse][options][cpu]") {
  const kvevict::LseOptions o;
  CHECK(o.head_chunk() == 0);
  CHECK(o.chunk_bytes() == 64 * 1024 * 1024);
  // Decode scoring, 8 buffered queries over 4,612 keys: 4 x 8 x 4,612 = 147,584 bytes a head,
  // 454 heads fit in 64 MiB: all 64 (or 128) in one chunk.
  CHECK(o.heads_per_chunk(1, 64, 8, 4612) == 64);
  CHECK(o.heads_per_chunk(1, 128, 16, 4612) == 128);  // 16 queries: 295,168 bytes a head, 227 fit
  CHECK(o.heads_per_chunk(8, 128, 16, 4612) == 28);   // batch 8: 67,108,864 / 2,361,344 = 28.4
  // A 32K-token prompt in chunks of 64 queries: 8 MiB a head, 8 heads.
  CHECK(o.heads_per_chunk(1, 64, 64, 32768) == 8);
  CHECK(o.heads_per_chunk(2, 64, 64, 1 << 20) == 1);  // at least one head
  CHECK(kvevict::LseOptions().head_chunk(3).heads_per_chunk(1, 64, 8, 4612) == 3);
  CHECK(kvevict::LseOptions().head_chunk(100).heads_per_chunk(1, 64, 8, 4612) == 64);
  CHECK(kvevict::LseOptions().chunk_bytes(1).heads_per_chunk(1, 64, 8, 4612) == 1);
  CHECK_THROWS_WITH(kvevict::LseOptions().head_chunk(-1).validate(), Contains("head_chunk must be >= 0"));
  CHECK_THROWS_WITH(kvevict::LseOptions().chunk_bytes(0).validate(), Contains("chunk_bytes must be >= 1, got 0"));
}

TEST_CASE("observe_lse_absorbed reads the latent rows in place: its largest temporary is one chunk",
          "[lse][cpu]") {
  // Per-head copies of ckv would be B x H x W x S fp32 (2 x 16 x 64 x 100 x 4 = 819,200 bytes);
  // one chunk of probabilities is 4 x B x heads x Q x S bytes (the tensor path's reduction
  // turns it into fixed-point terms in fp64: twice that).
  using kvevict_test::CountingCpuAllocator;
  const int64_t B = 2, H = 16, W = 64, R = 8, Q = 4;
  kvevict_test::on_both_paths([&] {
    at::manual_seed(62);
    // Checks off: the LSE below is above every logit but not the logits' logsumexp.
    kvevict::MlaLatentCache c(kvevict::MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(W).qk_rope_dim(R)
                                  .check_observations(false),
                              EvictionOptions(200));
    c.update(0, at::randn({B, 100, W}), at::randn({B, 100, R}));
    const int64_t S = c.size(0);
    const auto qa = at::randn({B, H, Q, W}).div(8), qr = at::randn({B, H, Q, R}).div(8);
    const auto lse = at::full({B, H, Q}, 50.0);  // above every logit: probabilities in [0, 1]
    for (const int64_t heads : {H, int64_t{1}}) {
      INFO("heads per chunk " << heads);
      CountingCpuAllocator recording;
      kvevict::observe_lse_absorbed(qa, qr, c, 0, lse, 1.0, kvevict::LseOptions().head_chunk(heads == H ? 0 : 1));
      CHECK(recording.largest() <= static_cast<size_t>((kvevict::detail::force_tensor_path() ? 8 : 4) * B * heads * Q * S));
    }
  });
}
