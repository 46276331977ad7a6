// MlaLatentCache and attend_absorbed: the latent layout against the expanded one.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

using Catch::Matchers::Contains;

namespace {

// A random DeepSeek-V3-shaped attention layer (small heads and widths): per token a latent
// c_kv (after kv_a_layernorm) and a RoPE key k_pe, per head q_nope and q_pe; W_UK and W_UV
// from kv_b_proj decompress c_kv into per-head k_nope and v.
struct RandomMla {
  int64_t H = 4, nope = 16, rope = 8, rank = 32, v = 16;
  at::Tensor w_uk = at::randn({H, nope, rank}).div(std::sqrt(32.0));  // [H, nope, rank]
  at::Tensor w_uv = at::randn({H, v, rank}).div(std::sqrt(32.0));     // [H, v, rank]

  // Expanded keys [B, H, T, nope + rope] and values [B, H, T, v] from c_kv [B, T, rank], k_pe [B, T, rope].
  std::pair<at::Tensor, at::Tensor> expand(const at::Tensor& c_kv, const at::Tensor& k_pe) const {
    const auto k_nope = at::einsum("hnr,btr->bhtn", {w_uk, c_kv});
    const auto k_rope = k_pe.unsqueeze(1).expand({c_kv.size(0), H, c_kv.size(1), rope});
    return {at::cat({k_nope, k_rope}, -1).contiguous(), at::einsum("hvr,btr->bhtv", {w_uv, c_kv}).contiguous()};
  }
  at::Tensor absorb(const at::Tensor& q_nope) const { return at::einsum("bhtn,hnr->bhtr", {q_nope, w_uk}); }
  at::Tensor up_value(const at::Tensor& latent_out) const { return at::einsum("bhtr,hvr->bhtv", {latent_out, w_uv}); }
};

// Drives both layouts through the same token stream; checks outputs and kept positions.
void run_both_layouts(bool evicting, bool tensor_path) {
  kvevict_test::ForceTensorPath force(tensor_path);
  at::manual_seed(7);
  RandomMla m;
  const int64_t B = 2, layers = 1;
  const auto eviction = evicting ? kvevict::EvictionOptions(3).n_sink(2).n_recent(2) : kvevict::EvictionOptions(64);
  kvevict::MlaCache expanded(kvevict::MlaCacheOptions(layers, m.H).batch_size(B).qk_dim(m.nope + m.rope).v_dim(m.v),
                             eviction);
  kvevict::MlaLatentCache latent(kvevict::MlaLatentCacheOptions(layers, m.H)
                                     .batch_size(B)
                                     .kv_lora_rank(m.rank)
                                     .qk_rope_dim(m.rope)
                                     .qk_nope_dim(m.nope),
                                 eviction);
  int64_t passes = 0;
  for (int64_t step = 0; step < 24; ++step) {
    const int64_t T = step == 0 ? 6 : 1;  // a prefill chunk, then decode steps
    const auto c_kv = at::randn({B, T, m.rank}), k_pe = at::randn({B, T, m.rope});
    const auto q_nope = at::randn({B, m.H, T, m.nope}), q_pe = at::randn({B, m.H, T, m.rope});
    const auto kv = m.expand(c_kv, k_pe);
    expanded.update(0, kv.first, kv.second);
    latent.update(0, c_kv, k_pe);
    at::Tensor p_expanded, p_latent;
    const auto out_expanded = kvevict::attend(at::cat({q_nope, q_pe}, -1), expanded, 0, c10::nullopt, &p_expanded);
    const auto out_latent = m.up_value(kvevict::attend_absorbed(m.absorb(q_nope), q_pe, latent, 0, c10::nullopt, &p_latent));
    REQUIRE(at::allclose(out_expanded, out_latent, /*rtol=*/1e-4, /*atol=*/1e-5));
    REQUIRE(at::allclose(p_expanded, p_latent, 1e-4, 1e-6));
    passes += expanded.evict(0) > 0;
    latent.evict(0);
    for (int64_t b = 0; b < B; ++b) {
      REQUIRE(kvevict_test::kept_positions(expanded, 0, b) == kvevict_test::kept_positions(latent, 0, b));
    }
  }
  CHECK(expanded.size(0) == (evicting ? 7 : 29));
  CHECK(passes == (evicting ? 22 : 0));  // capacity 7: sizes 6, 7, then a pass on every step from 8
  CHECK(latent.stats().eviction_events == passes);
}

}  // namespace

TEST_CASE("Expanded attention and absorbed latent attention agree, with and without eviction", "[latent][attention][cpu]") {
  for (bool tensor_path : {false, true}) {
    for (bool evicting : {false, true}) {
      INFO("evicting=" << evicting << " tensor_path=" << tensor_path);
      run_both_layouts(evicting, tensor_path);
    }
  }
}

TEST_CASE("Latent and expanded caches evict the same positions when fed the same attention", "[latent][cpu]") {
  at::manual_seed(3);
  const int64_t B = 2, H = 2, S = 12;
  const auto eviction = kvevict::EvictionOptions(2).n_sink(1).n_recent(3);
  kvevict::MlaCache expanded(kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(8).v_dim(4), eviction);
  kvevict::MlaLatentCache latent(kvevict::MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(8).qk_rope_dim(4),
                                 eviction);
  expanded.update(0, at::randn({B, H, S, 8}), at::randn({B, H, S, 4}));
  latent.update(0, at::randn({B, S, 8}), at::randn({B, S, 4}));
  const auto probs = at::randint(0, 4, {B, H, 2, S}).to(at::kFloat).div(4).tril(S - 2);  // quarters, causal: exact sums
  expanded.observe(0, probs);
  latent.observe(0, probs);
  CHECK(expanded.evict(0) == B * 6);
  CHECK(latent.evict(0) == B * 6);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> positions(S);
    std::iota(positions.begin(), positions.end(), 0);
    const auto s = probs[b].sum(1).mean(0);  // oracle scores [S], exact
    const auto expected = kvevict_test::oracle_keep(positions, kvevict_test::to_vec<double>(s), 1, 2, 3);
    CHECK(kvevict_test::kept_positions(latent, 0, b) == expected);
    CHECK(kvevict_test::kept_positions(expanded, 0, b) == expected);
  }
}

TEST_CASE("Latent rows move bit-exactly in every dtype", "[latent][cpu]") {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (bool tensor_path : {false, true}) {
      kvevict_test::ForceTensorPath force(tensor_path);
      INFO("dtype=" << dtype << " tensor_path=" << tensor_path);
      const int64_t S = 8;
      kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, 2).dtype(dtype),
                                    kvevict::EvictionOptions(1).n_sink(1).n_recent(2));
      const auto ckv = at::randn({1, S, 512}).to(dtype), kpe = at::randn({1, S, 64}).to(dtype);
      cache.update(0, ckv, kpe);
      auto scores = at::zeros({1, S});
      scores[0][2] = 5.f;  // position 2 is the top heavy-hitter candidate
      cache.add_scores(0, scores);
      CHECK(cache.evict(0) == 4);
      const auto o = cache.ordered(0);
      CHECK(kvevict_test::to_vec<int64_t>(o.positions[0]) == std::vector<int64_t>{0, 2, 6, 7});
      const auto keep = at::tensor(std::vector<int64_t>{0, 2, 6, 7});
      CHECK(at::equal(o.ckv, ckv.index_select(1, keep)));
      CHECK(at::equal(o.kpe, kpe.index_select(1, keep)));
    }
  }
}

TEST_CASE("MlaLatentCache rejects bad input naming it and stays unchanged", "[latent][errors][cpu]") {
  kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(2, 4), kvevict::EvictionOptions(1).n_sink(1).n_recent(1));
  cache.update(0, at::randn({1, 3, 512}), at::randn({1, 3, 64}));
  const auto ckv_before = cache.ckv(0).clone();
  const auto pos_before = cache.positions(0).clone();
  CHECK_THROWS_WITH(cache.update(0, at::randn({1, 1, 256}), at::randn({1, 1, 64})),
                    Contains("ckv_new must be [B, T, kv_lora_rank] = [1, T, 512], got [1, 1, 256]"));
  CHECK_THROWS_WITH(cache.update(0, at::randn({1, 2, 512}), at::randn({1, 1, 64})),
                    Contains("kpe_new must be [B, T, qk_rope_dim] = [1, 2, 64], got [1, 1, 64]"));
  CHECK_THROWS_WITH(cache.update(0, at::randn({1, 1, 512}).to(at::kHalf), at::randn({1, 1, 64})),
                    Contains("ckv_new must have the cache's dtype Float, got Half"));
  CHECK_THROWS_AS(cache.update(2, at::randn({1, 1, 512}), at::randn({1, 1, 64})), c10::IndexError);
  CHECK_THROWS_WITH(cache.observe(0, at::rand({1, 2, 1, 3})), Contains("got [1, 2, 1, 3]"));
  CHECK_THROWS_WITH(kvevict::attend_absorbed(at::randn({1, 4, 1, 512}), at::randn({1, 4, 2, 64}), cache, 0),
                    Contains("q_pe must have the T of q_absorbed (1), got 2"));
  CHECK_THROWS_WITH(kvevict::attend_absorbed(at::randn({1, 4, 1, 500}), at::randn({1, 4, 1, 64}), cache, 0),
                    Contains("q_absorbed must be [B, H, T, kv_lora_rank] = [1, 4, T, 512], got [1, 4, 1, 500]"));
  CHECK_THROWS_WITH(kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, 4).kv_lora_rank(0)),
                    Contains("kv_lora_rank must be >= 1, got 0"));
  CHECK(cache.size(0) == 3);
  CHECK(cache.seen_tokens(0) == 3);
  CHECK(at::equal(cache.ckv(0), ckv_before));
  CHECK(at::equal(cache.positions(0), pos_before));
}

TEST_CASE("MlaLatentCache on CUDA matches CPU", "[latent][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  at::manual_seed(11);
  const auto eviction = kvevict::EvictionOptions(2).n_sink(1).n_recent(2);
  kvevict::MlaLatentCache cpu(kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(16).qk_rope_dim(8), eviction);
  kvevict::MlaLatentCache gpu(
      kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(16).qk_rope_dim(8).device(at::Device("cuda:0")), eviction);
  for (int step = 0; step < 20; ++step) {
    const auto ckv = at::randn({1, 1, 16}), kpe = at::randn({1, 1, 8});
    cpu.update(0, ckv, kpe);
    gpu.update(0, ckv.cuda(), kpe.cuda());
    const auto probs = at::randint(0, 4, {1, 2, 1, cpu.size(0)}).to(at::kFloat);
    cpu.observe(0, probs);
    gpu.observe(0, probs.cuda());
    cpu.evict(0);
    gpu.evict(0);
    REQUIRE(kvevict_test::kept_positions(cpu, 0) == kvevict_test::kept_positions(gpu, 0));
    REQUIRE(at::equal(cpu.ordered(0).ckv, gpu.ordered(0).ckv.cpu()));
  }
}
