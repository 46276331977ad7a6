// memory_table: the seed's memory table, from kvevict's memory model. Bytes per token of the
// seed's configuration (DeepSeek-V3 expanded layout: 61 layers, 64 heads, 192 + 128 dims per
// head, fp16), then a full vs capped cache for one sequence at 8K .. 1M tokens.
//
// Usage: memory_table [--budget N] [--n-sink S] [--n-recent R]
//   capacity = n_sink + budget + n_recent (defaults 4 + 4592 + 16 = 4612 tokens).
// Exit code 0, or 2 on a bad command line.
#include <kvevict/kvevict.hpp>

#include <fmt/core.h>

#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

namespace {

constexpr int kExitUsage = 2;

constexpr const char* kUsage = R"(Usage: memory_table [--budget N] [--n-sink S] [--n-recent R]

Prints the KV-cache bytes per token of DeepSeek-V3's expanded layout as the seed sized it
(61 layers, 64 heads, 192 + 128 dims per head, fp16) and a full vs capped cache for one
sequence at 8K .. 1M tokens, capped at capacity = n_sink + budget + n_recent tokens.

Options (default in brackets):
  --budget N     heavy hitters kept per row, >= 0 [4592]
  --n-sink S     attention sinks kept, >= 0 [4]
  --n-recent R   recent window kept, >= 0 [16]
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

struct UsageError : std::exception {
  std::string message;
  explicit UsageError(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

int64_t parse_count(const std::string& flag, const std::string& text) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) throw UsageError(flag + " expects an integer, got '" + text + "'");
  if (value < 0) throw UsageError(flag + " must be >= 0, got " + text);
  // Keeps capacity * bytes per token inside int64 (3 * 2^40 tokens * 2.5 MB < 2^63 bytes).
  if (value > (int64_t{1} << 40)) throw UsageError(flag + " must be <= 2^40, got " + text);
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  auto eviction = kvevict::EvictionOptions(/*budget=*/4592).n_sink(4).n_recent(16);
  try {
    for (int i = 1; i < argc; ++i) {
      std::string flag = argv[i], value;
      if (flag == "--help" || flag == "-h") {
        fmt::print("{}", kUsage);
        return EXIT_SUCCESS;
      }
      const auto eq = flag.find('=');
      const bool inline_value = flag.rfind("--", 0) == 0 && eq != std::string::npos;
      if (inline_value) {
        value = flag.substr(eq + 1);
        flag = flag.substr(0, eq);
      }
      if (flag != "--budget" && flag != "--n-sink" && flag != "--n-recent") {
        throw UsageError("unknown argument '" + flag + "'");
      }
      if (!inline_value) {
        if (i + 1 >= argc) throw UsageError(flag + " expects a value");
        value = argv[++i];
      }
      const int64_t n = parse_count(flag, value);
      if (flag == "--budget") eviction.budget(n);
      if (flag == "--n-sink") eviction.n_sink(n);
      if (flag == "--n-recent") eviction.n_recent(n);
    }
    try {
      eviction.validate();
    } catch (const c10::Error& e) {
      throw UsageError(e.what_without_backtrace());
    }
  } catch (const UsageError& e) {
    fmt::print(stderr, "memory_table: {}\n(see memory_table --help)\n", e.what());
    return kExitUsage;
  }

  kvevict::MlaMemoryConfig seed;  // DeepSeek-V3 dims, 2 bytes per element (fp16)
  seed.num_heads = 64;            // the seed's table assumes 64 heads (DeepSeek-V3 has 128)
  const auto expanded = kvevict::Layout::kExpanded;
  const int64_t per_token = kvevict::bytes_per_token(seed, expanded);
  const int64_t capacity = eviction.capacity();

  fmt::print("KV cache, DeepSeek-V3 expanded layout as the seed sized it: {} layers x {} heads x ({} + {}) dims x "
             "{} bytes (fp16)\n",
             seed.num_layers, seed.num_heads, seed.qk_dim, seed.v_dim, seed.bytes_per_element);
  fmt::print("bytes per token: {} ({} per layer)\n", with_commas(per_token),
             with_commas(kvevict::bytes_per_token_per_layer(seed, expanded)));
  fmt::print("  (latent layout, ckv {} + kpe {}: {} bytes per token)\n", seed.kv_lora_rank, seed.qk_rope_dim,
             with_commas(kvevict::bytes_per_token(seed, kvevict::Layout::kLatent)));
  fmt::print("capacity: {} tokens = {} sinks + {} heavy hitters (budget) + {} recent; capped cache {} per sequence\n\n",
             capacity, eviction.n_sink(), eviction.budget(), eviction.n_recent(),
             human(kvevict::capped_cache_bytes(seed, expanded, capacity, capacity)));

  fmt::print("{:>24}  {:>12}  {:>12}  {:>8}\n", "tokens", "full cache", "capped", "ratio");
  for (int64_t k = 13; k <= 20; ++k) {
    const int64_t tokens = int64_t{1} << k;  // 8K .. 1M
    const int64_t full = kvevict::full_cache_bytes(seed, expanded, tokens);
    const int64_t capped = kvevict::capped_cache_bytes(seed, expanded, tokens, capacity);
    fmt::print("{:>24}  {:>12}  {:>12}  {:>7.1f}x\n",
               fmt::format("{} ({})", tokens_label(tokens), with_commas(tokens)), human(full), human(capped),
               static_cast<double>(full) / static_cast<double>(capped));
  }
  return EXIT_SUCCESS;
}
