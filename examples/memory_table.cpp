// memory_table: bytes per token and cache sizes, from kvevict's memory model, for both layouts.
// Bytes per token (61 layers, fp16) of the expanded layout at 64 heads and at
// DeepSeek-V3's 128 heads (192 + 128 dims per head), and of the latent layout (ckv 512 + kpe
// 64, shared by the heads); then a full vs capped cache for one sequence at 8K .. 1M tokens in
// each, so the table shows what eviction buys on top of the latent layout.
//
// Usage: memory_table [--budget N] [--n-sink S] [--n-recent R]
//   capacity = n_sink + budget + n_recent (defaults 4 + 4592 + 16 = 4612 tokens).
// Exit code 0, or 2 on a bad command line.
#include "cli.hpp"

#include <kvevict/kvevict.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int kExitUsage = 2;

constexpr const char* kUsage = R"(Usage: memory_table [--budget N] [--n-sink S] [--n-recent R]

Prints the KV-cache bytes per token of DeepSeek-V3 (61 layers, fp16) in the expanded layout
(per-head keys 192 + values 128) at 64 heads and at the model's 128 heads, and in
the latent layout (ckv 512 + kpe 64, shared by the heads), then a full vs capped cache for
one sequence at 8K .. 1M tokens in each layout, capped at capacity = n_sink + budget + n_recent
tokens.

Options (default in brackets):
  --budget N     heavy hitters kept per row, in [0, 2^40] [4592]
  --n-sink S     attention sinks kept, in [0, 2^40] [4]
  --n-recent R   recent window kept, in [0, 2^40] [16]
                 (capacity at most 1,845,737,552,201 tokens: the expanded 128-head cache's bytes
                 at capacity must fit in int64)
  --help         print this and exit
)";

/// 2498560 -> "2,498,560".
std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

/// Bytes in GiB when at least 1 GiB, else MiB: "19.06 GiB", "512.00 MiB".
std::string human(int64_t bytes) {
  const double gib = static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
  if (gib >= 1.0) return fmt::format("{:.2f} GiB", gib);
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

/// 8192 -> "8K", 1048576 -> "1M".
std::string tokens_label(int64_t n) {
  if (n >= (1 << 20) && n % (1 << 20) == 0) return fmt::format("{}M", n >> 20);
  if (n >= (1 << 10) && n % (1 << 10) == 0) return fmt::format("{}K", n >> 10);
  return std::to_string(n);
}

}  // namespace

int main(int argc, char** argv) {
  auto eviction = kvevict::EvictionOptions(/*budget=*/4592).n_sink(4).n_recent(16);
  // DeepSeek-V3 dims, 2 bytes per element (fp16), at 64 heads and at the model's 128.
  kvevict::MlaMemoryConfig heads64, v3;
  heads64.num_heads = 64;
  try {
    // Counts >= 0 here; eviction.validate() below holds each to the library's bound, 2^40.
    const auto count = [](const std::string& flag, const std::string& value) {
      return kvevict_cli::parse_int(flag, value, 0);
    };
    const bool run = kvevict_cli::parse_flags(
        argc, argv,
        {
            {"--budget", [&](auto& f, auto& v) { eviction.budget(count(f, v)); }},
            {"--n-sink", [&](auto& f, auto& v) { eviction.n_sink(count(f, v)); }},
            {"--n-recent", [&](auto& f, auto& v) { eviction.n_recent(count(f, v)); }},
        });
    if (!run) {
      fmt::print("{}", kUsage);
      return EXIT_SUCCESS;
    }
    try {
      eviction.validate();
    } catch (const c10::Error& e) {
      throw kvevict_cli::UsageError(e.what_without_backtrace());
    }
    // The capped column at full capacity is capacity x bytes per token, in int64: the largest
    // per-token size (expanded, 128 heads) bounds the capacity this table can print.
    const int64_t max_capacity =
        std::numeric_limits<int64_t>::max() / kvevict::bytes_per_token(v3, kvevict::Layout::kExpanded);
    if (eviction.capacity() > max_capacity) {
      throw kvevict_cli::UsageError(fmt::format(
          "capacity n_sink + budget + n_recent = {} is above {}: its expanded 128-head cache ({} bytes per token) "
          "would overflow int64 bytes",
          eviction.capacity(), max_capacity, with_commas(kvevict::bytes_per_token(v3, kvevict::Layout::kExpanded))));
    }
  } catch (const kvevict_cli::UsageError& e) {
    fmt::print(stderr, "memory_table: {}\n(see memory_table --help)\n", e.what());
    return kExitUsage;
  }

  struct Column {
    std::string name;         // table heading
    std::string description;  // bytes-per-token line
    kvevict::MlaMemoryConfig config;
    kvevict::Layout layout;
  };
  const std::vector<Column> columns{
      {"expanded, 64 heads",
       fmt::format("expanded, {} heads x ({} + {}) dims", heads64.num_heads, heads64.qk_dim, heads64.v_dim),
       heads64, kvevict::Layout::kExpanded},
      {"expanded, 128 heads",
       fmt::format("expanded, {} heads x ({} + {}) dims (DeepSeek-V3)", v3.num_heads, v3.qk_dim, v3.v_dim), v3,
       kvevict::Layout::kExpanded},
      {"latent", fmt::format("latent, ckv {} + kpe {}, shared by the heads", v3.kv_lora_rank, v3.qk_rope_dim), v3,
       kvevict::Layout::kLatent},
  };
  const int64_t capacity = eviction.capacity();

  fmt::print("KV cache bytes per token, DeepSeek-V3: {} layers, fp16 ({} bytes per element), K/V data only\n",
             v3.num_layers, v3.bytes_per_element);
  std::string capped;  // "10.73 GiB / 21.46 GiB / 309.08 MiB"
  for (const auto& c : columns) {
    fmt::print("  {:<58} {:>9} ({} per layer)\n", c.description + ":",
               with_commas(kvevict::bytes_per_token(c.config, c.layout)),
               with_commas(kvevict::bytes_per_token_per_layer(c.config, c.layout)));
    if (!capped.empty()) capped += " / ";
    capped += human(kvevict::capped_cache_bytes(c.config, c.layout, capacity, capacity));
  }
  fmt::print("capacity: {} tokens = {} sinks + {} heavy hitters (budget) + {} recent; capped cache {} per sequence "
             "(expanded 64 / expanded 128 / latent)\n\n",
             capacity, eviction.n_sink(), eviction.budget(), eviction.n_recent(), capped);

  // One sequence: full and capped cache per layout; full / capped is the same in every layout.
  fmt::print("{:>16}", "");
  for (const auto& c : columns) fmt::print("    {:^24}", c.name);
  fmt::print("  {:>11}\n{:>16}", "full/capped", "tokens");
  for (size_t i = 0; i < columns.size(); ++i) fmt::print("    {:>11}  {:>11}", "full", "capped");
  fmt::print("  {:>11}\n", "(any)");
  for (int64_t k = 13; k <= 20; ++k) {
    const int64_t tokens = int64_t{1} << k;  // 8K .. 1M
    fmt::print("{:>16}", fmt::format("{} ({})", tokens_label(tokens), with_commas(tokens)));
    for (const auto& c : columns) {
      fmt::print("    {:>11}  {:>11}", human(kvevict::full_cache_bytes(c.config, c.layout, tokens)),
                 human(kvevict::capped_cache_bytes(c.config, c.layout, tokens, capacity)));
    }
    fmt::print("  {:>10.1f}x\n", static_cast<double>(tokens) / static_cast<double>(std::min(tokens, capacity)));
  }

  // What each step buys at the longest length: the latent layout, then eviction on top of it.
  const int64_t longest = int64_t{1} << 20;
  const int64_t expanded_full = kvevict::full_cache_bytes(v3, kvevict::Layout::kExpanded, longest);
  const int64_t latent_full = kvevict::full_cache_bytes(v3, kvevict::Layout::kLatent, longest);
  const int64_t latent_capped = kvevict::capped_cache_bytes(v3, kvevict::Layout::kLatent, longest, capacity);
  fmt::print("\nat {} tokens: expanded ({} heads) {} -> latent {} ({:.1f}x less) -> latent capped at {} tokens {} "
             "({:.1f}x less again; {:.0f}x less than expanded)\n",
             tokens_label(longest), v3.num_heads, human(expanded_full), human(latent_full),
             static_cast<double>(expanded_full) / static_cast<double>(latent_full), capacity, human(latent_capped),
             static_cast<double>(latent_full) / static_cast<double>(latent_capped),
             static_cast<double>(expanded_full) / static_cast<double>(latent_capped));
  return EXIT_SUCCESS;
}
