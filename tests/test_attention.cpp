// kvevict::attend against a naive oracle: softmax(q K^T * scale) V in double, by loops over the
// position-sorted keys and values of ordered(), causal by position for multi-token appends.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using Catch::Matchers::Contains;

namespace {

using kvevict::BasicMlaCache;
using kvevict::EvictionOptions;
using kvevict::EvictionPolicy;
using kvevict::MlaCache;
using kvevict::MlaCacheOptions;
using kvevict_test::ForceTensorPath;

constexpr int64_t kQk = 8, kV = 5;

MlaCacheOptions options(int64_t batch, int64_t heads, at::ScalarType dtype = at::kFloat) {
  return MlaCacheOptions(1, heads).batch_size(batch).qk_dim(kQk).v_dim(kV).dtype(dtype);
}

/// The oracle's answer for the T newest tokens' queries.
struct Naive {
  int64_t B, H, T, S, D;
  std::vector<double> out;          // [B, H, T, v_dim]
  std::vector<double> probs;        // [B, H, T, S], S in position order
  std::vector<int64_t> positions;   // [B, S] ascending
  double out_at(int64_t b, int64_t h, int64_t t, int64_t d) const { return out[((b * H + h) * T + t) * D + d]; }
  double prob_at(int64_t b, int64_t h, int64_t t, int64_t i) const { return probs[((b * H + h) * T + t) * S + i]; }
  /// Index of `position` in row b (position order).
  int64_t index_of(int64_t b, int64_t position) const {
    const auto first = positions.begin() + b * S, last = first + S;
    const auto it = std::lower_bound(first, last, position);
    REQUIRE((it != last && *it == position));
    return it - first;
  }
};

std::vector<double> doubles(const at::Tensor& t) {
  const auto c = t.to(at::kCPU).to(at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

/// softmax(q K^T * scale) V over the live tokens, with query t at position seen - T + t seeing
/// the keys at positions <= its own; plain loops in double over ordered() data.
template <class Cache>
Naive naive_attention(const at::Tensor& q, const Cache& cache, int64_t layer, double scale) {
  const kvevict::OrderedLayer o = cache.ordered(layer);
  Naive n;
  n.B = q.size(0);
  n.H = q.size(1);
  n.T = q.size(2);
  n.S = o.keys.size(2);
  n.D = o.values.size(3);
  const auto qd = doubles(q), kd = doubles(o.keys), vd = doubles(o.values);
  const at::Tensor pos = o.positions.to(at::kCPU).contiguous();
  n.positions.assign(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + pos.numel());
  const int64_t seen = cache.seen_tokens(layer), Dk = q.size(3);
  n.out.assign(n.B * n.H * n.T * n.D, 0.0);
  n.probs.assign(n.B * n.H * n.T * n.S, 0.0);
  for (int64_t b = 0; b < n.B; ++b) {
    for (int64_t h = 0; h < n.H; ++h) {
      for (int64_t t = 0; t < n.T; ++t) {
        const int64_t query_position = seen - n.T + t;
        std::vector<double> logit(n.S, -std::numeric_limits<double>::infinity());
        double max_logit = -std::numeric_limits<double>::infinity();
        for (int64_t i = 0; i < n.S; ++i) {
          if (n.positions[b * n.S + i] > query_position) continue;  // a future token
          double dot = 0;
          for (int64_t d = 0; d < Dk; ++d) dot += qd[((b * n.H + h) * n.T + t) * Dk + d] * kd[((b * n.H + h) * n.S + i) * Dk + d];
          logit[i] = dot * scale;
          max_logit = std::max(max_logit, logit[i]);
        }
        double total = 0;
        for (int64_t i = 0; i < n.S; ++i) total += std::exp(logit[i] - max_logit);
        for (int64_t i = 0; i < n.S; ++i) {
          const double p = std::exp(logit[i] - max_logit) / total;
          n.probs[((b * n.H + h) * n.T + t) * n.S + i] = p;
          for (int64_t d = 0; d < n.D; ++d) {
            n.out[((b * n.H + h) * n.T + t) * n.D + d] += p * vd[((b * n.H + h) * n.S + i) * n.D + d];
          }
        }
      }
    }
  }
  return n;
}

/// Largest |attend - oracle| over the output, and over the probabilities (mapped from slot
/// order to position order with positions()).
struct Errors {
  double out = 0, probs = 0, row_sum = 0;
};

template <class Cache>
Errors compare(const at::Tensor& out, const at::Tensor& probs, const Cache& cache, int64_t layer, const Naive& n) {
  Errors e;
  const auto od = doubles(out), pd = doubles(probs);
  const at::Tensor pos = cache.positions(layer).to(at::kCPU).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < n.B; ++b) {
    for (int64_t h = 0; h < n.H; ++h) {
      for (int64_t t = 0; t < n.T; ++t) {
        for (int64_t d = 0; d < n.D; ++d) {
          e.out = std::max(e.out, std::abs(od[((b * n.H + h) * n.T + t) * n.D + d] - n.out_at(b, h, t, d)));
        }
        double sum = 0;
        for (int64_t s = 0; s < n.S; ++s) {
          const double p = pd[((b * n.H + h) * n.T + t) * n.S + s];
          sum += p;
          e.probs = std::max(e.probs, std::abs(p - n.prob_at(b, h, t, n.index_of(b, pp[b * n.S + s]))));
        }
        e.row_sum = std::max(e.row_sum, std::abs(sum - 1.0));
      }
    }
  }
  return e;
}

/// One attend call checked against the oracle (computed before the call, from the same data).
template <class Cache>
void check_attend(Cache& cache, const at::Tensor& q, c10::optional<double> scale, double tol_out, double tol_probs) {
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(kQk)));
  const auto n = naive_attention(q, cache, 0, s);
  at::Tensor probs;
  const auto out = kvevict::attend(q, cache, 0, scale, &probs);
  CHECK(out.sizes() == at::IntArrayRef{q.size(0), q.size(1), q.size(2), kV});
  CHECK(out.scalar_type() == cache.dtype());
  REQUIRE(probs.defined());
  CHECK(probs.sizes() == at::IntArrayRef{q.size(0), q.size(1), q.size(2), cache.size(0)});
  CHECK(probs.scalar_type() == at::kFloat);
  const auto e = compare(out, probs, cache, 0, n);
  CHECK(e.out <= tol_out);
  CHECK(e.probs <= tol_probs);
  CHECK(e.row_sum <= 1e-5);
}

void append(MlaCache& cache, int64_t T, at::ScalarType dtype = at::kFloat) {
  const int64_t B = cache.batch_size(), H = cache.num_heads();
  cache.update(0, at::randn({B, H, T, kQk}).to(dtype), at::randn({B, H, T, kV}).to(dtype));
}

at::Tensor query(const MlaCache& cache, int64_t T, at::ScalarType dtype = at::kFloat) {
  return at::randn({cache.batch_size(), cache.num_heads(), T, kQk}).mul(2).to(dtype);
}

const char* path_name(bool tensor_path) { return tensor_path ? "tensor-op path" : "CPU host path"; }

bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto x = a.to(at::kCPU).contiguous(), y = b.to(at::kCPU).contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

}  // namespace

TEST_CASE("attend over decode steps equals the naive oracle", "[attention][cpu]") {
  at::manual_seed(20);
  MlaCache cache(options(2, 3), EvictionOptions(64));  // no eviction here
  append(cache, 6);
  for (int step = 0; step < 5; ++step) {
    append(cache, 1);
    check_attend(cache, query(cache, 1), c10::nullopt, 1e-5, 1e-6);
  }
  // Without probs_out the output is the same (attend observes, but scores do not change it).
  append(cache, 1);
  const auto q = query(cache, 1);
  const auto out = kvevict::attend(q, cache, 0);
  at::Tensor probs;
  const auto again = kvevict::attend(q, cache, 0, c10::nullopt, &probs);
  CHECK(bit_equal(out, again));
  CHECK(probs.sizes() == at::IntArrayRef{2, 3, 1, 12});
}

TEST_CASE("attend is causal by position inside a multi-token append", "[attention][cpu]") {
  at::manual_seed(21);
  MlaCache cache(options(2, 2), EvictionOptions(64));
  append(cache, 5);  // a prefill of 5 attends to itself, causally
  const auto q = query(cache, 5);
  at::Tensor probs;
  kvevict::attend(q, cache, 0, c10::nullopt, &probs);
  // The first query (position 0) sees only position 0; the third sees positions 0..2.
  CHECK(probs[1][1][0][0].item<float>() == Approx(1.f).margin(1e-6));
  CHECK(probs.select(2, 0).narrow(2, 1, 4).abs().max().item<float>() == 0.f);
  CHECK(probs.select(2, 2).narrow(2, 3, 2).abs().max().item<float>() == 0.f);
  CHECK(probs.select(2, 2).narrow(2, 0, 3).min().item<float>() > 0.f);

  append(cache, 5);
  check_attend(cache, query(cache, 5), c10::nullopt, 1e-5, 1e-6);
  append(cache, 3);
  check_attend(cache, query(cache, 3), c10::nullopt, 1e-5, 1e-6);
  // Fewer queries than the last append: the newest T tokens are the queries.
  append(cache, 4);
  check_attend(cache, query(cache, 2), c10::nullopt, 1e-5, 1e-6);
  // As many queries as live tokens.
  check_attend(cache, query(cache, cache.size(0)), c10::nullopt, 1e-5, 1e-6);
}

TEST_CASE("attend after evictions (slot order is not position order) equals the oracle", "[attention][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(22);
    // capacity 1 + 3 + 2 = 6, evict_every 2; rows of the batch keep different tokens.
    MlaCache cache(options(3, 2), EvictionOptions(3).n_sink(1).n_recent(2).evict_every(2));
    append(cache, 7);
    check_attend(cache, query(cache, 7), c10::nullopt, 1e-5, 1e-6);
    int64_t passes = 0;
    for (int step = 0; step < 30; ++step) {
      INFO("step " << step);
      const int64_t T = step % 5 == 4 ? 3 : 1;
      append(cache, T);
      check_attend(cache, query(cache, T), c10::nullopt, 1e-5, 1e-6);
      passes += cache.evict(0) > 0;
    }
    CHECK(passes >= 10);
    // The rows really kept different tokens.
    CHECK(kvevict_test::kept_positions(cache, 0, 0) != kvevict_test::kept_positions(cache, 0, 1));
  }
}

TEST_CASE("attend uses the given scale", "[attention][cpu]") {
  at::manual_seed(23);
  MlaCache cache(options(2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
  append(cache, 6);
  cache.add_scores(0, at::rand({2, 6}));
  cache.evict(0);
  for (double scale : {0.37, 1.0, 2.5}) {
    INFO("scale " << scale);
    append(cache, 2);
    check_attend(cache, query(cache, 2), scale, 1e-5, 1e-6);
    cache.evict(0);
  }
  // Scale 0: every visible token gets the same probability, the output is the mean of the
  // visible values (hand-worked: 4 + 1 live tokens; of the 2 queries, the first (the previous
  // newest token, kept as the recent window) sees 4 of them, the second all 5).
  append(cache, 1);
  REQUIRE(cache.size(0) == 5);
  at::Tensor probs;
  const auto out = kvevict::attend(query(cache, 2), cache, 0, 0.0, &probs);
  const auto pos = cache.positions(0);
  const int64_t newest = cache.seen_tokens(0) - 1;
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s < 5; ++s) {
      const bool future = pos[b][s].item<int64_t>() == newest;
      CHECK(probs[b][1][0][s].item<float>() == Approx(future ? 0.f : 0.25f).margin(1e-7));
      CHECK(probs[b][1][1][s].item<float>() == Approx(0.2f).margin(1e-7));
    }
    const auto mean_all = cache.values(0)[b].mean(1);  // [H, v_dim]
    CHECK(out[b].select(1, 1).sub(mean_all).abs().max().item<float>() < 1e-6);
  }
}

TEST_CASE("attend feeds its probabilities to the scorer", "[attention][cpu]") {
  SECTION("CumulativeAttention adds the head mean of the sum over queries") {
    for (bool tensor_path : {false, true}) {
      INFO(path_name(tensor_path));
      ForceTensorPath guard(tensor_path);
      at::manual_seed(24);
      MlaCache cache(options(2, 4), EvictionOptions(2).n_sink(1).n_recent(1));
      append(cache, 5);
      cache.add_scores(0, at::rand({2, 5}));
      cache.evict(0);
      append(cache, 3);
      const auto before = cache.scores(0);
      const auto q = query(cache, 3);
      const auto n = naive_attention(q, cache, 0, 1.0 / std::sqrt(static_cast<double>(kQk)));
      kvevict::attend(q, cache, 0);
      const auto after = cache.scores(0);
      const auto pos = cache.positions(0);
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t s = 0; s < cache.size(0); ++s) {
          const int64_t i = n.index_of(b, pos[b][s].item<int64_t>());
          double expected = 0;
          for (int64_t h = 0; h < 4; ++h) {
            for (int64_t t = 0; t < 3; ++t) expected += n.prob_at(b, h, t, i);
          }
          expected /= 4;
          CHECK(after[b][s].item<float>() - before[b][s].item<float>() == Approx(expected).margin(1e-5));
        }
      }
    }
  }
  SECTION("LatestAttention takes the head mean of the last query") {
    for (bool tensor_path : {false, true}) {
      INFO(path_name(tensor_path));
      ForceTensorPath guard(tensor_path);
      at::manual_seed(24);
      BasicMlaCache<EvictionPolicy<kvevict::LatestAttention>> cache(options(2, 4), EvictionOptions(8));
      cache.update(0, at::randn({2, 4, 4, kQk}), at::randn({2, 4, 4, kV}));
      const auto q = at::randn({2, 4, 2, kQk});
      const auto n = naive_attention(q, cache, 0, 0.5);
      kvevict::attend(q, cache, 0, 0.5);
      const auto sc = cache.scores(0);
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t s = 0; s < 4; ++s) {
          double expected = 0;
          for (int64_t h = 0; h < 4; ++h) expected += n.prob_at(b, h, 1, s) / 4;  // no eviction: slot = position
          CHECK(sc[b][s].item<float>() == Approx(expected).margin(1e-6));
        }
      }
    }
  }
}

TEST_CASE("attend on fp16 and bf16 caches on CPU", "[attention][cpu]") {
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    INFO("dtype " << dtype);
    at::manual_seed(25);
    MlaCache cache(options(2, 2, dtype), EvictionOptions(3).n_sink(1).n_recent(2));
    // fp16 is computed in fp32: only the output is rounded to fp16. bf16 is computed in bf16.
    const double tol_out = dtype == at::kHalf ? 4e-3 : 6e-2;
    const double tol_probs = dtype == at::kHalf ? 1e-5 : 3e-2;
    append(cache, 6, dtype);
    check_attend(cache, query(cache, 6, dtype), c10::nullopt, tol_out, tol_probs);
    for (int step = 0; step < 8; ++step) {
      const int64_t T = step % 3 == 2 ? 2 : 1;
      append(cache, T, dtype);
      check_attend(cache, query(cache, T, dtype), c10::nullopt, tol_out, tol_probs);
      cache.evict(0);
    }
    CHECK(cache.stats(0).eviction_events > 0);
  }
}

TEST_CASE("attend rejects bad queries and leaves the cache unchanged", "[attention][errors][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(26);
    MlaCache cache(options(2, 2), EvictionOptions(2).n_sink(1).n_recent(1).evict_every(2));
    append(cache, 6);
    cache.add_scores(0, at::rand({2, 6}));
    append(cache, 1);
    cache.evict(0);
    append(cache, 1);  // 5 live tokens, 1 update since the pass
    REQUIRE(cache.size(0) == 5);
    const auto keys = cache.keys(0).clone(), values = cache.values(0).clone();
    const auto positions = cache.positions(0).clone(), scores = cache.scores(0);
    auto unchanged = [&] {
      CHECK(cache.size(0) == 5);
      CHECK(cache.seen_tokens(0) == 8);
      CHECK(bit_equal(cache.keys(0), keys));
      CHECK(bit_equal(cache.values(0), values));
      CHECK(bit_equal(cache.positions(0), positions));
      CHECK(bit_equal(cache.scores(0), scores));
      CHECK(cache.stats(0).eviction_events == 1);
    };
    at::Tensor probs;
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, kQk}), cache, 0),
                      Contains("q must be [B, H, T, qk_dim] = [2, 2, T, 8], got [2, 2, 8]"));
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 3, 1, kQk}), cache, 0), Contains("got [2, 3, 1, 8]"));
    CHECK_THROWS_WITH(kvevict::attend(at::randn({1, 2, 1, kQk}), cache, 0), Contains("got [1, 2, 1, 8]"));
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 1, kQk + 1}), cache, 0), Contains("got [2, 2, 1, 9]"));
    CHECK_THROWS_WITH(kvevict::attend(at::Tensor(), cache, 0), Contains("q must be a defined tensor"));
    CHECK_THROWS_AS(kvevict::attend(at::randn({2, 2, 1, kQk}, at::kDouble), cache, 0), c10::TypeError);
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 1, kQk}).to(at::kHalf), cache, 0),
                      Contains("q must have the cache's dtype Float, got Half"));
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 9, kQk}), cache, 0),
                      Contains("T must be in [1, 8] (seen tokens), got 9"));
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 0, kQk}), cache, 0, c10::nullopt, &probs),
                      Contains("T must be in [1, 8] (seen tokens), got 0"));
    CHECK_FALSE(probs.defined());
    CHECK_THROWS_AS(kvevict::attend(at::randn({2, 2, 1, kQk}), cache, 1), c10::IndexError);
    CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 1, kQk}), cache, -1), Contains("layer must be in [0, 1), got -1"));
    unchanged();
    // A NaN query makes non-finite probabilities: observe throws (check_finite on), nothing changes.
    auto q = at::randn({2, 2, 1, kQk});
    q[1][0][0][3] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH(kvevict::attend(q, cache, 0, c10::nullopt, &probs), Contains("non-finite"));
    CHECK_FALSE(probs.defined());
    unchanged();
    CHECK(cache.evict(0) == 0);  // still 1 update since the pass
    // The cache still works.
    check_attend(cache, query(cache, 1), c10::nullopt, 1e-5, 1e-6);
  }
}

TEST_CASE("attend on an empty layer throws", "[attention][errors][cpu]") {
  MlaCache cache(options(1, 2), EvictionOptions(4));
  CHECK_THROWS_WITH(kvevict::attend(at::randn({1, 2, 1, kQk}), cache, 0),
                    Contains("the layer holds no token"));
  CHECK(cache.size(0) == 0);
  CHECK(cache.seen_tokens(0) == 0);
}

TEST_CASE("CUDA: attend equals the CPU result; a CPU query is rejected", "[attention][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda("cuda:0");
  at::manual_seed(27);
  // No eviction (capacity 84): slot order is position order on both devices, and scores from
  // softmax rounding cannot pick different tokens.
  MlaCache cpu(options(2, 2), EvictionOptions());
  MlaCache gpu(options(2, 2).device(cuda), EvictionOptions());
  for (int step = 0; step < 12; ++step) {
    const int64_t T = step == 0 ? 6 : 1 + step % 2;
    const auto k = at::randn({2, 2, T, kQk}), v = at::randn({2, 2, T, kV}), q = at::randn({2, 2, T, kQk});
    cpu.update(0, k, v);
    gpu.update(0, k.to(cuda), v.to(cuda));
    at::Tensor pc, pg;
    const auto oc = kvevict::attend(q, cpu, 0, c10::nullopt, &pc);
    const auto og = kvevict::attend(q.to(cuda), gpu, 0, c10::nullopt, &pg);
    CHECK(og.device() == cuda);
    CHECK(pg.device() == cuda);
    CHECK(oc.sub(og.cpu()).abs().max().item<float>() < 1e-4);
    CHECK(pc.sub(pg.cpu()).abs().max().item<float>() < 1e-5);
    CHECK(cpu.scores(0).sub(gpu.scores(0).cpu()).abs().max().item<float>() < 1e-4);
  }
  CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 1, kQk}), gpu, 0),
                    Contains("q must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(kvevict::attend(at::randn({2, 2, 1, kQk}, cuda), cpu, 0),
                    Contains("q must be on the cache's device cpu, got cuda:0"));
}

namespace {

/// Bit-for-bit equality of two fp32 tensors (as int32: -0 != +0).
bool same_bits_f32(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::equal(a.contiguous().view(at::kInt), b.contiguous().view(at::kInt));
}

}  // namespace

TEST_CASE("attend and attend_absorbed give each row of a ragged batch what it gets alone: bit for bit on the "
          "host path, to fp32 rounding on the tensor path",
          "[attention][cpu]") {
  // Batched matmuls and softmaxes round differently for other shapes (T, S): the host path runs
  // row by row (each row's own shapes, bit-identical to the row alone); the tensor path runs one
  // masked product over the padded [B, H, T, S] (no host loop), equal to fp32 rounding, with
  // the same kept tokens. Rows: a long prompt, a short left-padded one, a row that joins later,
  // and one left free.
  const int64_t B = 4, H = 3;
  const auto ev = EvictionOptions(/*budget=*/3).n_sink(1).n_recent(2);
  const std::vector<std::vector<int64_t>> steps = {{9, 4, 0, 0}, {1, 1, 6, 0}, {1, 0, 1, 0}, {1, 1, 1, 0}};
  kvevict_test::on_both_paths([&] {
    const bool tensor_path = kvevict::detail::force_tensor_path();
    for (const bool latent : {false, true}) {
      INFO("latent " << latent);
      const int64_t Dk = latent ? 40 : 24, Dr = 8, Dv = 16;
      auto make = [&](int64_t batch) {
        return std::make_pair(
            MlaCache(MlaCacheOptions(1, H).batch_size(batch).qk_dim(Dk).v_dim(Dv), ev),
            kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, H).batch_size(batch).kv_lora_rank(Dk).qk_rope_dim(Dr), ev));
      };
      auto shared = make(B);
      shared.first.finish(3);
      shared.second.finish(3);
      std::vector<std::pair<MlaCache, kvevict::MlaLatentCache>> alone;
      for (int64_t b = 0; b < B - 1; ++b) alone.push_back(make(1));
      std::vector<int64_t> seen(B, 0);
      for (size_t step = 0; step < steps.size(); ++step) {
        INFO("step " << step);
        const auto& counts = steps[step];
        const int64_t T = *std::max_element(counts.begin(), counts.end());
        at::manual_seed(static_cast<uint64_t>(step));
        // Per row: its own tokens, right-aligned in T columns (pads hold other random values).
        const auto k = at::randn({B, H, T, Dk}), v = at::randn({B, H, T, Dv}), q = at::randn({B, H, T, Dk}).mul(2);
        const auto ckv = at::randn({B, T, Dk}), kpe = at::randn({B, T, Dr}), qpe = at::randn({B, H, T, Dr});
        at::Tensor out, probs;
        if (latent) {
          shared.second.update(0, ckv, kpe, counts);
          out = kvevict::attend_absorbed(q, qpe, shared.second, 0, c10::nullopt, &probs);
        } else {
          shared.first.update(0, k, v, counts);
          out = kvevict::attend(q, shared.first, 0, c10::nullopt, &probs);
        }
        for (int64_t b = 0; b < B - 1; ++b) {
          INFO("row " << b);
          const int64_t c = counts[b];
          if (c > 0) {
            auto cols = [&](const at::Tensor& t, int64_t dim) { return t.narrow(0, b, 1).narrow(dim, T - c, c); };
            at::Tensor own_out, own_probs;
            if (latent) {
              alone[b].second.update(0, cols(ckv, 1), cols(kpe, 1));
              own_out = kvevict::attend_absorbed(cols(q, 2), cols(qpe, 2), alone[b].second, 0, c10::nullopt, &own_probs);
            } else {
              alone[b].first.update(0, cols(k, 2), cols(v, 2));
              own_out = kvevict::attend(cols(q, 2), alone[b].first, 0, c10::nullopt, &own_probs);
            }
            const int64_t len = own_probs.size(3);
            const auto mine_out = out[b].narrow(1, T - c, c), mine_probs = probs[b].narrow(1, T - c, c);
            if (tensor_path) {
              CHECK(at::allclose(mine_out, own_out[0], 1e-5, 1e-6));
              CHECK(at::allclose(mine_probs.narrow(2, 0, len), own_probs[0], 1e-5, 1e-7));
            } else {
              CHECK(same_bits_f32(mine_out, own_out[0]));
              CHECK(same_bits_f32(mine_probs.narrow(2, 0, len), own_probs[0]));
            }
            // Slots past the row's own length: probability 0 exactly.
            CHECK(at::equal(mine_probs.narrow(2, len, probs.size(3) - len), at::zeros({H, c, probs.size(3) - len})));
          }
          // Pad columns and idle rows: zero output and probabilities.
          CHECK(at::equal(out[b].narrow(1, 0, T - c), at::zeros({H, T - c, out.size(3)})));
          CHECK(at::equal(probs[b].narrow(1, 0, T - c), at::zeros({H, T - c, probs.size(3)})));
          const auto& mine = latent ? shared.second.scores(0) : shared.first.scores(0);
          const auto& own = latent ? alone[b].second.scores(0) : alone[b].first.scores(0);
          if (tensor_path) {
            CHECK(at::allclose(mine[b].narrow(0, 0, own.size(1)), own[0], 1e-5, 1e-7));
            const auto& cache_pos = latent ? shared.second.positions(0) : shared.first.positions(0);
            const auto& own_pos = latent ? alone[b].second.positions(0) : alone[b].first.positions(0);
            CHECK(at::equal(cache_pos[b].narrow(0, 0, own_pos.size(1)), own_pos[0]));  // the same kept tokens
          } else {
            CHECK(same_bits_f32(mine[b].narrow(0, 0, own.size(1)), own[0]));
          }
        }
        CHECK(at::equal(probs[B - 1], at::zeros_like(probs[B - 1])));  // the free row
        CHECK(at::equal(out[B - 1], at::zeros_like(out[B - 1])));  // the free row
        for (int64_t b = 0; b < B - 1; ++b) {
          if (latent) {
            alone[b].second.evict(0);
          } else {
            alone[b].first.evict(0);
          }
        }
        if (latent) {
          shared.second.evict(0);
        } else {
          shared.first.evict(0);
        }
      }
    }
  });
}

namespace {

using kvevict::MlaLatentCache;
using kvevict::MlaLatentCacheOptions;
using kvevict_test::CountingCpuAllocator;

/// Calls `call(cache)` on fresh caches from `make()` with the n-th allocation failing, for every
/// n until a call completes: a call that throws must leave the scores as they were (nothing
/// observed), and a retry must then end where one call without a failure ends (observed once).
template <class Make, class Call>
void throws_before_observing(Make&& make, Call&& call) {
  auto twin = make();
  call(twin);
  const auto once = twin.scores(0);
  bool completed = false;
  int64_t failures = 0;
  for (int64_t fail_at = 1; fail_at < 300 && !completed; ++fail_at) {
    INFO("failing allocation " << fail_at);
    auto cache = make();
    const auto before = cache.scores(0);
    bool failed = false;
    {
      CountingCpuAllocator failing;
      failing.fail_at(fail_at);
      try {
        call(cache);
      } catch (const c10::Error&) {
        failed = true;
      }
    }
    if (!failed) {
      completed = true;
      CHECK(same_bits_f32(cache.scores(0), once));
      continue;
    }
    ++failures;
    REQUIRE(same_bits_f32(cache.scores(0), before));  // a throw observed nothing
    call(cache);
    CHECK(same_bits_f32(cache.scores(0), once));  // the retry observes once
  }
  CHECK(completed);
  CHECK(failures >= 5);
}

/// The ragged chunk of the tests below: row b appends counts[b] of T = 3 columns (3, 2, 1, 3, ...).
std::vector<int64_t> ragged_counts(int64_t B) {
  std::vector<int64_t> c;
  for (int64_t b = 0; b < B; ++b) c.push_back(3 - b % 3);
  return c;
}

}  // namespace

TEST_CASE("attend and attend_absorbed throw before they observe: an allocation failure changes no score",
          "[attention][errors][cpu]") {
  const int64_t B = 3, H = 2, W = 16, R = 4;
  const auto ev = EvictionOptions(4).n_sink(1).n_recent(2);  // capacity 7
  kvevict_test::on_both_paths([&] {
    for (const bool ragged : {false, true}) {
      INFO("ragged " << ragged);
      const int64_t T = ragged ? 3 : 1;
      const auto counts = ragged ? ragged_counts(B) : std::vector<int64_t>(B, 1);
      at::manual_seed(51);
      const auto k0 = at::randn({B, H, 9, kQk}), v0 = at::randn({B, H, 9, kV}), k1 = at::randn({B, H, T, kQk}),
                 v1 = at::randn({B, H, T, kV}), q = at::randn({B, H, T, kQk});
      const auto c0 = at::randn({B, 9, W}), r0 = at::randn({B, 9, R}), c1 = at::randn({B, T, W}),
                 r1 = at::randn({B, T, R}), qa = at::randn({B, H, T, W}), qr = at::randn({B, H, T, R});
      throws_before_observing(
          [&] {
            MlaCache c(options(B, H), ev);
            c.update(0, k0, v0);
            c.evict(0);
            c.update(0, k1, v1, counts);
            return c;
          },
          [&](MlaCache& c) { kvevict::attend(q, c, 0); });
      throws_before_observing(
          [&] {
            MlaLatentCache c(MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(W).qk_rope_dim(R), ev);
            c.update(0, c0, r0);
            c.evict(0);
            c.update(0, c1, r1, counts);
            return c;
          },
          [&](MlaLatentCache& c) { kvevict::attend_absorbed(qa, qr, c, 0); });
    }
  });
}

TEST_CASE("a query whose every visible key was evicted gets zero probabilities and a zero output row",
          "[attention][cpu]") {
  // Budget 0, no sinks, recent window 1: a pass keeps only the newest token (position 1). Then
  // T = 2 queries (positions 0 and 1): query 0 sees no key (position 0 is gone, 1 is newer).
  // Hand-worked: query 0 gets probabilities 0 and output 0; query 1 sees one key, probability 1,
  // output that key's value; CumulativeAttention adds (0 + 1) x H / H = 1 to the kept token.
  const int64_t B = 2, H = 3, W = 16, R = 4;
  const auto ev = EvictionOptions(0).n_sink(0).n_recent(1);
  kvevict_test::on_both_paths([&] {
    for (const bool latent : {false, true}) {
      INFO("latent " << latent);
      at::manual_seed(52);
      at::Tensor out, probs, value;
      double score = -1;
      if (latent) {
        MlaLatentCache c(MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(W).qk_rope_dim(R), ev);
        c.update(0, at::randn({B, 2, W}), at::randn({B, 2, R}));
        REQUIRE(c.evict(0) == B);
        REQUIRE(c.policy().checks_observations());
        out = kvevict::attend_absorbed(at::randn({B, H, 2, W}), at::randn({B, H, 2, R}), c, 0, c10::nullopt, &probs);
        value = c.ckv(0).unsqueeze(1).expand({B, H, 1, W});
        score = c.scores(0)[1][0].item<float>();
      } else {
        MlaCache c(options(B, H), ev);
        c.update(0, at::randn({B, H, 2, kQk}), at::randn({B, H, 2, kV}));
        REQUIRE(c.evict(0) == B);
        out = kvevict::attend(at::randn({B, H, 2, kQk}), c, 0, c10::nullopt, &probs);
        value = c.values(0);
        score = c.scores(0)[1][0].item<float>();
      }
      REQUIRE(probs.sizes() == at::IntArrayRef{B, H, 2, 1});
      CHECK(at::equal(probs.select(2, 0), at::zeros({B, H, 1})));
      CHECK(at::equal(out.select(2, 0), at::zeros({B, H, out.size(3)})));
      CHECK(at::equal(probs.select(2, 1), at::ones({B, H, 1})));
      CHECK(at::equal(out.narrow(2, 1, 1), value));
      CHECK(score == 1.0);
    }
  });
}

TEST_CASE("attend_absorbed reads the latent rows in place: no per-head copy of the cache", "[attention][cpu]") {
  // A per-head copy of ckv would be B x H x S x W fp32 (here 3 x 16 x 100 x 64 x 4 = 1.2 MB);
  // the temporaries of attention (observed apart) are the scaled queries, logits,
  // probabilities and output: at most 4 x B x H x T x max(S, W) bytes.
  const int64_t B = 3, H = 16, W = 64, R = 16;
  kvevict_test::on_both_paths([&] {
    MlaLatentCache c(MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(W).qk_rope_dim(R), EvictionOptions(200));
    c.update(0, at::randn({B, 99, W}), at::randn({B, 99, R}));
    for (const int64_t T : {1, 3}) {
      INFO("T " << T);
      c.update(0, at::randn({B, T, W}), at::randn({B, T, R}));
      const int64_t S = c.size(0);
      const auto qa = at::randn({B, H, T, W}), qr = at::randn({B, H, T, R});
      CountingCpuAllocator recording;
      kvevict::attend_absorbed(qa, qr, c, 0, c10::nullopt, nullptr, /*observe=*/false);
      CHECK(recording.largest() <= static_cast<size_t>(4 * B * H * T * std::max(S, W)));
      CHECK(recording.largest() < static_cast<size_t>(4 * B * H * S * W));
    }
  });
}

TEST_CASE("tensor path: a ragged batch is one batched product, no per-row loop (allocations do not grow with B)",
          "[attention][cpu]") {
  ForceTensorPath guard(true);
  const int64_t H = 2, W = 16, R = 4;
  std::vector<int64_t> allocations;
  for (const int64_t B : {2, 5}) {
    INFO("B " << B);
    at::manual_seed(53);
    MlaCache expanded(options(B, H), EvictionOptions(64));
    MlaLatentCache latent(MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(W).qk_rope_dim(R), EvictionOptions(64));
    expanded.update(0, at::randn({B, H, 3, kQk}), at::randn({B, H, 3, kV}), ragged_counts(B));
    latent.update(0, at::randn({B, 3, W}), at::randn({B, 3, R}), ragged_counts(B));
    REQUIRE_FALSE(expanded.policy().dense(0, 3));
    const auto q = at::randn({B, H, 3, kQk}), qa = at::randn({B, H, 3, W}), qr = at::randn({B, H, 3, R});
    CountingCpuAllocator counting;
    kvevict::attend(q, expanded, 0, c10::nullopt, nullptr, /*observe=*/false);
    kvevict::attend_absorbed(qa, qr, latent, 0, c10::nullopt, nullptr, /*observe=*/false);
    allocations.push_back(counting.count());
  }
  CHECK(allocations[0] == allocations[1]);
}
