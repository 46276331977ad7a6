// Where users feel eviction: one decode step with an evicting cache held at capacity C, against
// the full cache at context 4C and 8C (what the same conversation costs without eviction).
//  - the quality model (4 layers, whole step: projections, attention, MLP, head), both layouts;
//  - one DeepSeek-V3-sized attention layer (128 heads; expanded keys 192 / values 128, latent
//    ckv 512 + kpe 64), cache work only: update + attend (+ evict), fp32 on CPU.
// Median time per token over --steps decode steps, and the cache's K/V bytes.
//   speed_quality [--weights examples/quality/weights.pt] [--capacity 256] [--ds-capacity 512] [--steps 40]
#include "cli.hpp"
#include "evaluate.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>

using namespace kvq;

namespace {

constexpr const char* kUsage = R"(Usage: speed_quality [options]

Times one decode step with an evicting cache at capacity C against the full cache at 4C and
8C: the quality model (--capacity) and one DeepSeek-V3-sized attention layer (--ds-capacity).
Prints a markdown table.

Options (default in brackets):
  --weights PATH       the quality model's weights [examples/quality/weights.pt]
  --capacity C         the quality model's evicting capacity, 1 .. 2^20 [256]
  --ds-capacity C      the DeepSeek-V3 layer's: 4 sinks, 16 recent and C - 20 heavy
                       hitters, 20 .. 2^20 [512]
  --steps N            timed decode steps (the median is reported), 1 .. 100000 [40]
  --threads N          intra-op threads, 1 .. 1024 [2]
  --help               print this and exit
)";

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Fills `cache` to `context` tokens with random tokens (one prefill chunk), then times `steps`
// one-token decode steps (with evict when the cache is over capacity).
template <class Cache>
double time_model(Model& m, Cache& cache, int64_t context, int64_t steps) {
  torch::NoGradGuard g;
  DecodeState state;
  m->step(torch::randint(256, {1, context}, torch::kLong), cache, state);
  std::vector<double> t;
  for (int64_t i = 0; i < steps + 3; ++i) {
    auto tok = torch::randint(256, {1, 1}, torch::kLong);
    const double t0 = now();
    m->step(tok, cache, state);
    if (i >= 3) t.push_back(now() - t0);
  }
  return median(t);
}

struct Ds {
  int64_t H = 128, qk = 192, v = 128, r = 512, rope = 64, nope = 128;
};

template <class Cache>
double time_ds_expanded(Cache& cache, const Ds& d, int64_t context, int64_t steps) {
  cache.update(0, at::randn({1, d.H, context, d.qk}), at::randn({1, d.H, context, d.v}));
  cache.evict(0);
  std::vector<double> t;
  for (int64_t i = 0; i < steps + 3; ++i) {
    auto k = at::randn({1, d.H, 1, d.qk}), v = at::randn({1, d.H, 1, d.v}), q = at::randn({1, d.H, 1, d.qk});
    const double t0 = now();
    cache.update(0, k, v);
    auto o = kvevict::attend(q, cache, 0);
    cache.evict(0);
    if (i >= 3) t.push_back(now() - t0);
  }
  return median(t);
}
template <class Cache>
double time_ds_latent(Cache& cache, const Ds& d, int64_t context, int64_t steps) {
  cache.update(0, at::randn({1, context, d.r}), at::randn({1, context, d.rope}));
  cache.evict(0);
  std::vector<double> t;
  for (int64_t i = 0; i < steps + 3; ++i) {
    auto c = at::randn({1, 1, d.r}), k = at::randn({1, 1, d.rope});
    auto qa = at::randn({1, d.H, 1, d.r}), qp = at::randn({1, d.H, 1, d.rope});
    const double t0 = now();
    cache.update(0, c, k);
    auto o = kvevict::attend_absorbed(qa, qp, cache, 0);
    cache.evict(0);
    if (i >= 3) t.push_back(now() - t0);
  }
  return median(t);
}
}  // namespace

int main(int argc, char** argv) try {
  std::string weights = "examples/quality/weights.pt";
  int64_t C = 256, DC = 512, steps = 40, threads = 2;
  using kvevict_cli::parse_int;
  constexpr int64_t kMaxCapacity = int64_t{1} << 20;
  const bool run = kvevict_cli::parse_flags(
      argc, argv,
      {
          {"--weights", [&](auto&, auto& v) { weights = v; }},
          {"--capacity", [&](auto& f, auto& v) { C = parse_int(f, v, 1, kMaxCapacity); }},
          {"--ds-capacity", [&](auto& f, auto& v) { DC = parse_int(f, v, 20, kMaxCapacity); }},
          {"--steps", [&](auto& f, auto& v) { steps = parse_int(f, v, 1, 100000); }},
          {"--threads", [&](auto& f, auto& v) { threads = parse_int(f, v, 1, 1024); }},
      });
  if (!run) {
    std::printf("%s", kUsage);
    return 0;
  }
  torch::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(0);
  Model m{Config()};
  kvevict_cli::check_readable("--weights", weights);
  load_weights(m, weights);
  m->eval();
  const auto& c = m->c;
  std::printf("| setup | layout | cache | tokens held | K/V bytes | ms/token | vs evicting |\n|---|---|---|---|---|---|---|\n");
  for (auto layout : {Layout::Expanded, Layout::Latent}) {
    const int64_t per_tok = layout == Layout::Expanded ? c.n_layers * c.n_heads * (c.qk_dim() + c.v_dim) * 4
                                                       : c.n_layers * (c.kv_lora + c.qk_rope) * 4;
    double base = 0;
    for (int64_t mult : {1, 4, 8}) {
      const int64_t ctx = mult * C;
      double ms = 0;
      // mult 1: H2O at capacity C, fed 8C tokens first so it decodes at capacity, evicting.
      auto e = mult == 1 ? eviction_for(Policy::H2O, C, 0) : eviction_for(Policy::Full, ctx + steps + 8, ctx + steps + 8);
      with_cache(m, layout, Policy::H2O, e, 1, [&](auto& cache) { ms = 1e3 * time_model(m, cache, mult == 1 ? 8 * C : ctx, steps); });
      if (mult == 1) base = ms;
      std::printf("| quality model (4 layers) | %s | %s | %lld | %lld | %.3f | %.2fx |\n", layout_name(layout),
                  mult == 1 ? "H2O, capacity C" : (mult == 4 ? "full, 4C" : "full, 8C"), (long long)ctx,
                  (long long)(ctx * per_tok), ms, ms / base);
    }
  }
  Ds d;
  for (auto layout : {Layout::Expanded, Layout::Latent}) {
    const int64_t per_tok = layout == Layout::Expanded ? d.H * (d.qk + d.v) * 4 : (d.r + d.rope) * 4;
    double base = 0;
    for (int64_t mult : {1, 4, 8}) {
      const int64_t ctx = mult * DC;
      auto e = mult == 1 ? kvevict::EvictionOptions(DC - 20).n_sink(4).n_recent(16)
                         : kvevict::EvictionOptions(ctx + steps + 8).n_sink(4).n_recent(16);
      double ms;
      if (layout == Layout::Expanded) {
        kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, d.H).qk_dim(d.qk).v_dim(d.v), e);
        ms = 1e3 * time_ds_expanded(cache, d, mult == 1 ? 8 * DC : ctx, steps);
      } else {
        kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(1, d.H).kv_lora_rank(d.r).qk_rope_dim(d.rope).qk_nope_dim(d.nope), e);
        ms = 1e3 * time_ds_latent(cache, d, mult == 1 ? 8 * DC : ctx, steps);
      }
      if (mult == 1) base = ms;
      std::printf("| DeepSeek-V3 layer, cache+attention, fp32 | %s | %s | %lld | %lld | %.3f | %.2fx |\n", layout_name(layout),
                  mult == 1 ? "H2O, capacity C" : (mult == 4 ? "full, 4C" : "full, 8C"), (long long)ctx,
                  (long long)(ctx * per_tok), ms, ms / base);
    }
  }
  return 0;
} catch (const kvevict_cli::UsageError& e) {
  std::fprintf(stderr, "speed_quality: %s (see --help)\n", e.what());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
