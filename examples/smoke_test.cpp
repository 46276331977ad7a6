// The smoke test: a 20-token cache (1 row, 4 heads, DeepSeek-V3 dims), random scores,
// budget 8, n_sink 2, n_recent 2: one eviction pass must keep 2 + 8 + 2 = 12 tokens.
#include <kvevict/kvevict.hpp>

#include <fmt/format.h>

#include <cstdlib>

int main() {
  at::manual_seed(0);
  const int64_t heads = 4, tokens = 20;
  const auto eviction = kvevict::EvictionOptions(/*budget=*/8).n_sink(2).n_recent(2);
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(/*num_layers=*/1, heads), eviction);

  // Prefill 20 tokens, give each a random score, evict once.
  cache.update(0, at::randn({1, heads, tokens, 192}), at::randn({1, heads, tokens, 128}));
  cache.add_scores(0, at::rand({1, tokens}));
  cache.evict(0);

  const int64_t kept = cache.size(0);
  const auto positions = cache.ordered(0).positions[0];
  const bool sinks = positions[0].item<int64_t>() == 0 && positions[1].item<int64_t>() == 1;
  const bool recent = positions[kept - 2].item<int64_t>() == tokens - 2 && positions[kept - 1].item<int64_t>() == tokens - 1;
  if (kept != 12 || !sinks || !recent) {
    fmt::print("FAIL - kept {} tokens (expected 12), sinks kept: {}, recent kept: {}\n", kept, sinks, recent);
    return EXIT_FAILURE;
  }
  fmt::print("OK - evicted {} -> {} tokens (2 sinks + 8 heavy-hitters + 2 recent)\n", tokens, kept);

  // Usage: one decode step per layer with eviction-aware attention.
  fmt::print("\nUsage, one decode step:\n");
  const auto q = at::randn({1, heads, 1, 192});
  cache.update(0, at::randn({1, heads, 1, 192}), at::randn({1, heads, 1, 128}));
  const auto out = kvevict::attend(q, cache, 0);  // [1, 4, 1, 128]; observes the probabilities
  const int64_t evicted = cache.evict(0);
  fmt::print("  update -> {} live tokens, attend -> output [{}, {}, {}, {}], evict -> {} evicted, {} live\n",
             cache.size(0) + evicted, out.size(0), out.size(1), out.size(2), out.size(3), evicted, cache.size(0));
  return EXIT_SUCCESS;
}
