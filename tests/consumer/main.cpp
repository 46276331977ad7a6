// find_package consumer: builds an MlaCache from the installed headers, runs a prefill and a
// few decode steps with eviction, and exits 0 only if every size is what the contract says.
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <cstdlib>

int main() {
  static_assert(KVEVICT_VERSION_MAJOR >= 0, "version.hpp is installed");
  at::manual_seed(0);
  const int64_t B = 2, H = 2, qk = 8, v = 4;
  // capacity 2 + 4 + 2 = 8 tokens per row after a pass.
  const auto eviction = kvevict::EvictionOptions(/*budget=*/4).n_sink(2).n_recent(2);
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(/*num_layers=*/2, H).batch_size(B).qk_dim(qk).v_dim(v), eviction);

  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "consumer: FAILED %s\n", what);
      ++failures;
    }
  };
  for (int64_t layer = 0; layer < 2; ++layer) {
    cache.update(layer, at::randn({B, H, 12, qk}), at::randn({B, H, 12, v}));  // prefill
    kvevict::attend(at::randn({B, H, 12, qk}), cache, layer);
    expect(cache.evict(layer) == B * 4, "prefill pass evicts 12 - 8 = 4 per row");
    for (int step = 0; step < 5; ++step) {
      cache.update(layer, at::randn({B, H, 1, qk}), at::randn({B, H, 1, v}));
      const auto out = kvevict::attend(at::randn({B, H, 1, qk}), cache, layer);
      expect(out.size(0) == B && out.size(1) == H && out.size(2) == 1 && out.size(3) == v, "attend output [B, H, 1, v]");
      expect(cache.evict(layer) == B * 1, "one token per row evicted per decode step");
      expect(cache.size(layer) == 8, "size back at capacity");
    }
    expect(cache.seen_tokens(layer) == 17, "17 tokens seen");
    expect(cache.ordered(layer).positions[0][0].item<int64_t>() == 0, "sink kept");
  }
  const auto stats = cache.stats();
  expect(stats.eviction_events == 12, "6 passes per layer");
  expect(stats.tokens_evicted == B * 18, "9 tokens per row per layer");
  expect(kvevict::bytes_per_token(kvevict::MlaMemoryConfig{}, kvevict::Layout::kLatent) == 70272, "memory model");
  if (failures == 0) std::printf("consumer: OK (kvevict %d.%d.%d)\n", KVEVICT_VERSION_MAJOR, KVEVICT_VERSION_MINOR, KVEVICT_VERSION_PATCH);
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
