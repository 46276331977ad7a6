// EvictionOptions and MlaCacheOptions: defaults, capacity, and rejection of bad values.
#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <string>

using Catch::Matchers::Contains;

TEST_CASE("EvictionOptions defaults are the seed's and capacity adds the three parts", "[options][cpu]") {
  const kvevict::EvictionOptions o;
  CHECK(o.budget() == 64);
  CHECK(o.n_sink() == 4);
  CHECK(o.n_recent() == 16);
  CHECK(o.evict_every() == 1);
  CHECK(o.capacity() == 84);
  CHECK(kvevict::EvictionOptions(8).n_sink(2).n_recent(2).capacity() == 12);
}

TEST_CASE("EvictionOptions rejects bad values naming them", "[options][errors][cpu]") {
  using kvevict::EvictionOptions;
  using kvevict::Selection;
  CHECK_THROWS_WITH(Selection(EvictionOptions(-1)), Contains("budget must be in [0, 2^40], got -1"));
  CHECK_THROWS_WITH(Selection(EvictionOptions(1).n_sink(-2)), Contains("n_sink must be in [0, 2^40], got -2"));
  CHECK_THROWS_WITH(Selection(EvictionOptions(1).n_recent(-3)), Contains("n_recent must be in [0, 2^40], got -3"));
  CHECK_THROWS_WITH(Selection(EvictionOptions(1).evict_every(0)), Contains("evict_every must be in [1, 2^40], got 0"));
  // Case 1c: capacity 0 is rejected, naming the three values.
  CHECK_THROWS_WITH(Selection(EvictionOptions(0).n_sink(0).n_recent(0)),
                    Contains("n_sink=0, budget=0, n_recent=0"));
  CHECK_THROWS_AS(Selection(EvictionOptions(0).n_sink(0).n_recent(0)), c10::ValueError);
}

TEST_CASE("MlaCacheOptions rejects bad values naming them", "[options][errors][cpu]") {
  using kvevict::MlaCacheOptions;
  CHECK_THROWS_WITH(kvevict::MlaCache(MlaCacheOptions(0, 4)), Contains("num_layers must be in [1, 2^40], got 0"));
  CHECK_THROWS_WITH(kvevict::MlaCache(MlaCacheOptions(1, 0)), Contains("num_heads must be in [1, 2^40], got 0"));
  CHECK_THROWS_WITH(kvevict::MlaCache(MlaCacheOptions(1, 4).batch_size(0)), Contains("batch_size must be in [1, 2^40], got 0"));
  CHECK_THROWS_WITH(kvevict::MlaCache(MlaCacheOptions(1, 4).qk_dim(-1)), Contains("qk_dim must be >= 1, got -1"));
  CHECK_THROWS_WITH(kvevict::MlaCache(MlaCacheOptions(1, 4).dtype(at::kLong)), Contains("got Long"));
  CHECK_THROWS_WITH(kvevict::MlaCache(MlaCacheOptions(1, 4), kvevict::EvictionOptions(-5)),
                    Contains("budget must be in [0, 2^40], got -5"));
}

TEST_CASE("Counts so large that capacity would overflow are rejected, naming them", "[options][errors][cpu]") {
  using kvevict::EvictionOptions;
  const int64_t huge = std::numeric_limits<int64_t>::max();
  CHECK_THROWS_WITH(kvevict::Selection(EvictionOptions(huge)), Contains("budget must be in [0, 2^40], got " + std::to_string(huge)));
  CHECK_THROWS_WITH(kvevict::Selection(EvictionOptions(1).n_recent(huge)), Contains("n_recent must be in [0, 2^40]"));
  CHECK_THROWS_WITH(kvevict::Selection(EvictionOptions(1).evict_every(huge)), Contains("evict_every must be in [1, 2^40]"));
  // Valid but too large to allocate: the error names the options, not only the allocator.
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(1, 64), EvictionOptions(int64_t{1} << 40)),
                    Contains("budget=1099511627776"));
}

TEST_CASE("A cache built on \"cpu:0\" accepts tensors that report \"cpu\"", "[options][cpu]") {
  // The same normalisation turns "cuda" into the current "cuda:N" on a GPU machine.
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 2).qk_dim(4).v_dim(4).device(at::Device(at::kCPU, 0)));
  CHECK(cache.device() == at::Device(at::kCPU));
  cache.update(0, at::zeros({1, 2, 1, 4}), at::zeros({1, 2, 1, 4}));
  CHECK(cache.size(0) == 1);
}

TEST_CASE("A cache on a device this build cannot use fails when built, naming the device", "[options][errors][cpu]") {
  if (at::hasCUDA()) {
    WARN("CUDA is usable here: nothing to check");
    return;
  }
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(1, 2).device(at::kCUDA)),
                    Contains("options: device cuda is not usable here"));
}

TEST_CASE("Sizes too large to allocate throw c10::Error naming every size, not std::bad_alloc", "[options][errors][cpu]") {
  const int64_t huge = int64_t{1} << 39;
  for (auto opts : {kvevict::MlaCacheOptions(huge, 1), kvevict::MlaCacheOptions(1, 1).batch_size(huge), kvevict::MlaCacheOptions(1, huge)}) {
    INFO("num_layers " << opts.num_layers() << ", batch_size " << opts.batch_size() << ", num_heads " << opts.num_heads());
    try {
      kvevict::MlaCache cache(opts, kvevict::EvictionOptions(4));
      FAIL("allocated " << opts.num_layers() << " layers");
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Contains("could not allocate"));
      CHECK_THAT(what, Contains("num_layers=" + std::to_string(opts.num_layers())));
      CHECK_THAT(what, Contains("batch_size=" + std::to_string(opts.batch_size())));
      CHECK_THAT(what, Contains("num_heads=" + std::to_string(opts.num_heads())));
    }
  }
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(huge, 1).batch_size(huge), kvevict::EvictionOptions(4)),
                    Contains("num_layers x batch_size must be <= 2^40"));
}

TEST_CASE("With layer_budgets set, the base budget is ignored, so its capacity may be 0", "[options][cpu]") {
  // n_sink and n_recent stay shared; each layer's capacity comes from its own budget.
  const auto base = kvevict::EvictionOptions(0).n_sink(0).n_recent(0);
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(2, 2).qk_dim(4).v_dim(4).layer_budgets({3, 5}), base);
  CHECK(cache.capacity(0) == 3);
  CHECK(cache.capacity(1) == 5);
  kvevict::EvictionPolicy<> policy(kvevict::EvictionPolicyOptions(2, 2).layer_budgets({1, 2}), base);
  CHECK(policy.capacity(0) == 1);
  CHECK(policy.capacity(1) == 2);
  kvevict::MlaLatentCache latent(kvevict::MlaLatentCacheOptions(1, 2).kv_lora_rank(8).qk_rope_dim(4).layer_budgets({4}),
                                 base);
  CHECK(latent.capacity(0) == 4);
  // The other counts are still checked, and a layer's own capacity must still be >= 1.
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(1, 2).layer_budgets({3}), kvevict::EvictionOptions(base).n_sink(-1)),
                    Contains("n_sink must be in [0, 2^40], got -1"));
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(2, 2).layer_budgets({3, 0}), base),
                    Contains("layer 1: capacity = n_sink + budget + n_recent must be >= 1"));
  // Without layer_budgets the base capacity is every layer's, and 0 is still rejected.
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(1, 2), base), Contains("n_sink=0, budget=0, n_recent=0"));
}

TEST_CASE("A device kvevict cannot run on (meta, or anything but CPU and CUDA) is rejected when built, naming it",
          "[options][errors][cpu]") {
  const at::Device meta(at::kMeta);
  CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(1, 2).device(meta)),
                    Contains("MlaCacheOptions: device must be a CPU or CUDA device, got meta"));
  CHECK_THROWS_WITH(kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, 2).device(meta)),
                    Contains("MlaLatentCacheOptions: device must be a CPU or CUDA device, got meta"));
  CHECK_THROWS_WITH(kvevict::EvictionPolicy<>(kvevict::EvictionPolicyOptions(1, 2).device(meta)),
                    Contains("EvictionPolicyOptions: device must be a CPU or CUDA device, got meta"));
  CHECK_THROWS_AS(kvevict::EvictionPolicy<>(kvevict::EvictionPolicyOptions(1, 2).device(meta)), c10::ValueError);
  // Other device types, whatever this build has of them.
  for (const auto type : {at::kXLA, at::kVulkan, at::kMPS, at::kHIP}) {
    const at::Device d(type);
    INFO(d);
    CHECK_THROWS_WITH(kvevict::MlaCache(kvevict::MlaCacheOptions(1, 2).device(d)),
                      Contains("device must be a CPU or CUDA device, got " + d.str()));
  }
}
