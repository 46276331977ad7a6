// Memory model: bytes per token and per cache, checked against numbers worked out by hand.
#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

using Catch::Matchers::Contains;
using kvevict::Layout;
using kvevict::MlaMemoryConfig;

namespace {

/// The 64-head table: DeepSeek-V3 dims with 64 heads, fp16/bf16.
MlaMemoryConfig seed_config() {
  MlaMemoryConfig c;
  c.num_heads = 64;
  return c;
}

}  // namespace

TEST_CASE("MlaMemoryConfig defaults are DeepSeek-V3 at 2 bytes", "[memory_model][cpu]") {
  const MlaMemoryConfig c;
  CHECK(c.num_layers == 61);
  CHECK(c.num_heads == 128);
  CHECK(c.qk_dim == 192);
  CHECK(c.v_dim == 128);
  CHECK(c.kv_lora_rank == 512);
  CHECK(c.qk_rope_dim == 64);
  CHECK(c.bytes_per_element == 2);
}

TEST_CASE("bytes per token, expanded layout", "[memory_model][cpu]") {
  // 64 heads * (192 + 128) * 2 bytes = 40,960 per layer; * 61 layers = 2,498,560.
  CHECK(kvevict::bytes_per_token_per_layer(seed_config(), Layout::kExpanded) == 40960);
  CHECK(kvevict::bytes_per_token(seed_config(), Layout::kExpanded) == 2498560);
  // 128 heads: 81,920 per layer, 4,997,120 per token.
  CHECK(kvevict::bytes_per_token_per_layer(MlaMemoryConfig{}, Layout::kExpanded) == 81920);
  CHECK(kvevict::bytes_per_token(MlaMemoryConfig{}, Layout::kExpanded) == 4997120);
  // fp32: twice as much.
  MlaMemoryConfig fp32;
  fp32.bytes_per_element = 4;
  CHECK(kvevict::bytes_per_token(fp32, Layout::kExpanded) == 9994240);
  // A toy config: 2 layers * 3 heads * (5 + 7) * 4 bytes = 288.
  MlaMemoryConfig toy;
  toy.num_layers = 2;
  toy.num_heads = 3;
  toy.qk_dim = 5;
  toy.v_dim = 7;
  toy.bytes_per_element = 4;
  CHECK(kvevict::bytes_per_token(toy, Layout::kExpanded) == 288);
}

TEST_CASE("bytes per token, latent layout", "[memory_model][cpu]") {
  // (512 + 64) * 2 = 1,152 per layer, whatever the head count; * 61 = 70,272.
  CHECK(kvevict::bytes_per_token_per_layer(MlaMemoryConfig{}, Layout::kLatent) == 1152);
  CHECK(kvevict::bytes_per_token(MlaMemoryConfig{}, Layout::kLatent) == 70272);
  CHECK(kvevict::bytes_per_token(seed_config(), Layout::kLatent) == 70272);
  MlaMemoryConfig toy;
  toy.num_layers = 3;
  toy.kv_lora_rank = 10;
  toy.qk_rope_dim = 6;
  toy.bytes_per_element = 1;
  CHECK(kvevict::bytes_per_token(toy, Layout::kLatent) == 48);
}

TEST_CASE("full and capped cache sizes", "[memory_model][cpu]") {
  const auto c = seed_config();
  // Full: seq_len tokens. 32,768 tokens * 2,498,560 = 81,872,814,080 bytes (needs 64 bits).
  CHECK(kvevict::full_cache_bytes(c, Layout::kExpanded, 0) == 0);
  CHECK(kvevict::full_cache_bytes(c, Layout::kExpanded, 1) == 2498560);
  CHECK(kvevict::full_cache_bytes(c, Layout::kExpanded, 1000) == 2498560000LL);
  CHECK(kvevict::full_cache_bytes(c, Layout::kExpanded, 32768) == 81872814080LL);
  CHECK(kvevict::full_cache_bytes(c, Layout::kLatent, 32768) == 2302672896LL);
  // Capped at capacity 4 + 64 + 16 = 84 tokens: 84 * 2,498,560 = 209,879,040 once seq_len >= 84.
  CHECK(kvevict::capped_cache_bytes(c, Layout::kExpanded, 32768, 84) == 209879040LL);
  CHECK(kvevict::capped_cache_bytes(c, Layout::kExpanded, 84, 84) == 209879040LL);
  CHECK(kvevict::capped_cache_bytes(c, Layout::kExpanded, 50, 84) == 124928000LL);  // below the cap
  CHECK(kvevict::capped_cache_bytes(c, Layout::kExpanded, 0, 84) == 0);
  // Latent, 128 heads irrelevant: 84 * 70,272 = 5,902,848.
  CHECK(kvevict::capped_cache_bytes(MlaMemoryConfig{}, Layout::kLatent, 100000, 84) == 5902848LL);
  // The ratio full / capped is seq_len / capacity: 32,768 / 84.
  CHECK(kvevict::full_cache_bytes(c, Layout::kExpanded, 84 * 390) ==
        390 * kvevict::capped_cache_bytes(c, Layout::kExpanded, 84 * 390, 84));
}

TEST_CASE("the memory model agrees with what an MlaCache holds", "[memory_model][cpu]") {
  // K/V bytes of a cache = slots * bytes_per_token_per_layer * layers * batch; the stats add
  // bookkeeping on top.
  MlaMemoryConfig c;
  c.num_layers = 2;
  c.num_heads = 3;
  c.qk_dim = 6;
  c.v_dim = 4;
  c.bytes_per_element = 2;
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(2, 3).qk_dim(6).v_dim(4).dtype(at::kHalf),
                          kvevict::EvictionOptions(5).n_sink(1).n_recent(2));
  const int64_t slots = cache.slots(0);  // capacity 8 + evict_every 1 + the trash slot
  REQUIRE(slots == 10);
  const int64_t kv = kvevict::capped_cache_bytes(c, Layout::kExpanded, 1000, slots);
  CHECK(kv == 10 * 3 * 10 * 2 * 2);
  CHECK(cache.stats().bytes_allocated >= kv + 2 * slots * 12);
}

TEST_CASE("the memory model rejects bad values, naming them", "[memory_model][errors][cpu]") {
  auto bad = [](auto edit) {
    MlaMemoryConfig c;
    edit(c);
    return c;
  };
  const std::vector<MlaMemoryConfig> configs{
      bad([](MlaMemoryConfig& c) { c.num_layers = 0; }),   bad([](MlaMemoryConfig& c) { c.num_heads = 0; }),
      bad([](MlaMemoryConfig& c) { c.qk_dim = -1; }),      bad([](MlaMemoryConfig& c) { c.v_dim = 0; }),
      bad([](MlaMemoryConfig& c) { c.kv_lora_rank = 0; }), bad([](MlaMemoryConfig& c) { c.qk_rope_dim = 0; }),
      bad([](MlaMemoryConfig& c) { c.bytes_per_element = 0; })};
  for (size_t i = 0; i < configs.size(); ++i) {
    INFO("config " << i);
    for (auto layout : {Layout::kExpanded, Layout::kLatent}) {
      CHECK_THROWS_AS(kvevict::bytes_per_token(configs[i], layout), c10::ValueError);
      CHECK_THROWS_WITH(kvevict::bytes_per_token_per_layer(configs[i], layout),
                        Contains("MlaMemoryConfig: every dimension must be >= 1"));
      CHECK_THROWS_AS(kvevict::full_cache_bytes(configs[i], layout, 10), c10::ValueError);
      CHECK_THROWS_AS(kvevict::capped_cache_bytes(configs[i], layout, 10, 5), c10::ValueError);
    }
  }
  const MlaMemoryConfig c;
  CHECK_THROWS_AS(kvevict::full_cache_bytes(c, Layout::kExpanded, -1), c10::ValueError);
  CHECK_THROWS_WITH(kvevict::full_cache_bytes(c, Layout::kExpanded, -1), Contains("seq_len must be >= 0, got -1"));
  CHECK_THROWS_WITH(kvevict::capped_cache_bytes(c, Layout::kExpanded, -3, 84), Contains("seq_len must be >= 0, got -3"));
  CHECK_THROWS_AS(kvevict::capped_cache_bytes(c, Layout::kLatent, 10, 0), c10::ValueError);
  CHECK_THROWS_WITH(kvevict::capped_cache_bytes(c, Layout::kLatent, 10, 0), Contains("capacity must be >= 1, got 0"));
}

TEST_CASE("the memory model throws on int64 overflow instead of wrapping", "[memory_model][errors][cpu]") {
  MlaMemoryConfig c;
  c.num_heads = int64_t{1} << 60;
  CHECK_THROWS_AS(kvevict::bytes_per_token_per_layer(c, Layout::kExpanded), c10::ValueError);
  CHECK_THROWS_WITH(kvevict::bytes_per_token_per_layer(c, Layout::kExpanded), Contains("overflows int64"));
  CHECK(kvevict::bytes_per_token_per_layer(c, Layout::kLatent) == (512 + 64) * 2);  // heads do not count
  const MlaMemoryConfig v3;
  CHECK_THROWS_WITH(kvevict::full_cache_bytes(v3, Layout::kExpanded, int64_t{1} << 50),
                    Contains("seq_len x bytes per token overflows int64"));
  MlaMemoryConfig layers;
  layers.num_layers = int64_t{1} << 60;
  CHECK_THROWS_WITH(kvevict::bytes_per_token(layers, Layout::kLatent), Contains("bytes per token (all layers) overflows"));
}

TEST_CASE("tier bytes: the evicted tokens the host tier keeps, with their bookkeeping", "[memory_model][cpu]") {
  const MlaMemoryConfig v3;
  // 128K tokens at capacity 4,612 with a 32K-token tier: the tier is full. Per token and
  // layer: (512 + 64) x 2 = 1,152 row bytes + 8 (position) + 4 (rank) + 4 (W = 1 state).
  // Digests: at most 131,072 / 16 = 8,192 pages, each 576 channels x (min + max) x 4 bytes.
  CHECK(kvevict::tier_bytes(v3, Layout::kLatent, 131072, 4612, 32768) ==
        (int64_t{32768} * 1168 + int64_t{8192} * 4608) * 61);
  // Fewer evicted tokens than the tier holds: only those (10,000 - 4,612 = 5,388), on at most
  // ceil(10,000 / 16) = 625 pages.
  CHECK(kvevict::tier_bytes(v3, Layout::kLatent, 10000, 4612, 32768) == (int64_t{5388} * 1168 + 625 * 4608) * 61);
  CHECK(kvevict::tier_bytes(v3, Layout::kLatent, 4000, 4612, 32768) == 0);
  // Expanded, MeanObservedAttention (W = 2): 128 x 320 x 2 + 8 + 4 + 8; 100 tokens on at most
  // 100 pages of 128 x 192 channels x 8 bytes; pages of 1,000 tokens: at most 5.
  CHECK(kvevict::tier_bytes(v3, Layout::kExpanded, 5000, 4612, 100, 2) ==
        (int64_t{100} * (81920 + 20) + int64_t{100} * 196608) * 61);
  CHECK(kvevict::tier_bytes(v3, Layout::kExpanded, 5000, 4612, 100, 2, 1000) ==
        (int64_t{100} * (81920 + 20) + int64_t{5} * 196608) * 61);
  CHECK_THROWS_WITH(kvevict::tier_bytes(v3, Layout::kLatent, 10, 4, 1, 1, 0), Contains("page_size must be >= 1, got 0"));
  CHECK_THROWS_WITH(kvevict::tier_bytes(v3, Layout::kLatent, 10, 4, -1), Contains("tier_tokens must be >= 0, got -1"));
  CHECK_THROWS_WITH(kvevict::tier_bytes(v3, Layout::kLatent, 10, 4, 1, 0), Contains("state_width must be >= 1, got 0"));
}
