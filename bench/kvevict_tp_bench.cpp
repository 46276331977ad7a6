// kvevict_tp_bench: the cost of tensor-parallel eviction per decode step. Launches --world ranks
// of itself (Gloo over loopback, a FileStore in a temporary directory); each holds heads / world
// of the seed dims (64 heads, keys 192, values 128, fp32, CPU, one thread per rank, B = 1, one
// layer, capacity 4,612 = 4 sinks + 4,592 + 16 recent), fills its cache to capacity, then times
// --steps decode steps in the steady state (capacity + 1 -> capacity). Per step, in
// microseconds: the all-reduce (time inside the reducer, waiting for slower peers included, and
// calls per step), the eviction step (update + evict, the reducer's share taken out) and the
// attention step (attend with its observe, the reducer's share taken out); and one all-reduce
// of the same sums timed alone, back to back (transfers only; median of 64). Configurations:
// eager with evict_every 1, eager and lazy with --evict-every. Each figure is the mean over the
// timed steps (the median for the all-reduce alone), the largest over ranks.
//
// With --recall-every R (> 0): a host tier (16,384 tokens per row, pages of 16), filled before
// the timed steps by one pass over a prompt 2,048 tokens past capacity (evict_now), and every
// R steps a recall of --recall-tokens tokens (whole pages; per head) between update and
// attend, with this rank's heads' random queries: the page scores are all-reduced like
// observations. The recall column is the mean time of one recall call, its all-reduces
// included; the all-reduce column then counts recall's all-reduces too; update+evict includes
// the passes' take into the tier.

#include "cli.hpp"
#include "tp_harness.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: kvevict_tp_bench [--world N[,N...]] [--steps S] [--evict-every E] [--layout expanded|latent]\n"
    "                        [--recall-every R] [--recall-tokens K]\n"
    "  --world        rank counts to measure, each in 2 .. 8 [2,4]\n"
    "  --steps        timed decode steps per configuration, a multiple of --evict-every [64]\n"
    "  --evict-every  evict_every of the eager and lazy runs compared (eager also runs with 1) [16]\n"
    "  --layout       expanded (MlaCache, attend) or latent (MlaLatentCache, attend_absorbed) [expanded]\n"
    "  --recall-every with a host tier, recall every R timed steps; 0: no tier [0]\n"
    "  --recall-tokens tokens each recall brings back per row (whole pages of 16) [64]\n";

struct Recall {
  int64_t every = 0, tokens = 64;
};

struct Config {
  const char* name;
  int64_t evict_every;
  bool lazy;
};

struct Figures {
  double allreduce_us = 0, calls = 0, evict_us = 0, attend_us = 0, isolated_us = 0, recall_us = 0, recalled = 0;
};

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

template <class Cache>
Figures measure(const kvevict::TensorParallel& tp, const Config& c, int64_t steps, bool latent, const Recall& rc) {
  constexpr int64_t kHeads = 64, kQk = 192, kV = 128, kLora = 512, kRope = 64;
  const auto eviction = kvevict::EvictionOptions(4592).n_sink(4).n_recent(16).evict_every(c.evict_every);
  const int64_t H = tp.heads().size(), C = eviction.capacity();
  // The reducer, timed: the library's all-reduce inside a stopwatch.
  double reducer_us = 0;
  int64_t reducer_calls = 0;
  auto timed = [inner = tp.reducer(), &reducer_us, &reducer_calls](int64_t layer, at::Tensor& sums) {
    const auto t0 = Clock::now();
    inner(layer, sums);
    reducer_us += us(Clock::now() - t0);
    ++reducer_calls;
  };
  const int64_t tier = rc.every > 0 ? 16384 : 0, page = 16, extra = rc.every > 0 ? 2048 : 0;
  auto make = [&]() {
    if constexpr (std::is_same_v<Cache, kvevict::MlaLatentCache>) {
      return tp.configure(kvevict::MlaLatentCacheOptions(1, kHeads).tier_tokens(tier).tier_page_size(page), c.lazy)
          .reduce_contributions(timed);
    } else {
      return tp.configure(kvevict::MlaCacheOptions(1, kHeads).tier_tokens(tier).tier_page_size(page), c.lazy)
          .reduce_contributions(timed);
    }
  };
  Cache cache(make(), eviction);
  tp.check(cache.policy());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + tp.rank());
  const auto o = at::TensorOptions().dtype(at::kFloat);
  auto append = [&](int64_t T) {
    if constexpr (std::is_same_v<Cache, kvevict::MlaLatentCache>) {
      cache.update(0, at::randn({1, T, kLora}, gen, o), at::randn({1, T, kRope}, gen, o));
    } else {
      cache.update(0, at::randn({1, H, T, kQk}, gen, o), at::randn({1, H, T, kV}, gen, o));
    }
  };
  append(C + extra);  // prefill to capacity (not observed); with a tier, 2,048 more go to it
  if (extra > 0) cache.evict_now(0);
  Figures f;
  int64_t recalls = 0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(latent ? 128 + kRope : kQk));  // qk_nope 128 + qk_rope
  const int64_t warmup = 2 * c.evict_every;
  for (int64_t t = 0; t < warmup + steps; ++t) {
    const bool timed_step = t >= warmup;
    if (t == warmup) reducer_us = 0, reducer_calls = 0;
    const bool recall = rc.every > 0 && t % rc.every == 0;
    // Inputs made before the clock starts.
    at::Tensor k, v, q, q_pe;
    if (latent) {
      k = at::randn({1, 1, kLora}, gen, o), v = at::randn({1, 1, kRope}, gen, o);
      q = at::randn({1, H, 1, kLora}, gen, o), q_pe = at::randn({1, H, 1, kRope}, gen, o);
    } else {
      k = at::randn({1, H, 1, kQk}, gen, o), v = at::randn({1, H, 1, kV}, gen, o), q = at::randn({1, H, 1, kQk}, gen, o);
    }
    const auto t0 = Clock::now();
    cache.update(0, k, v);
    const auto t1 = Clock::now();
    if (recall) {  // its all-reduces stay in the all-reduce column, and in this one
      at::Tensor n;  // tokens recalled per row
      if constexpr (std::is_same_v<Cache, kvevict::MlaLatentCache>) {
        n = cache.recall_absorbed(0, q, q_pe, scale, rc.tokens);
      } else {
        n = cache.recall(0, q, scale, rc.tokens);
      }
      if (timed_step) {
        f.recall_us += us(Clock::now() - t1);
        f.recalled += static_cast<double>(n.sum().item<int64_t>());
        ++recalls;
      }
    }
    const double r0 = reducer_us;
    const auto ta = Clock::now();
    if constexpr (std::is_same_v<Cache, kvevict::MlaLatentCache>) {
      kvevict::attend_absorbed(q, q_pe, cache, 0);
    } else {
      kvevict::attend(q, cache, 0);
    }
    const auto t2 = Clock::now();
    const double r1 = reducer_us;
    cache.evict(0);
    const auto t3 = Clock::now();
    const double r2 = reducer_us;
    if (timed_step) {
      f.attend_us += us(t2 - ta) - (r1 - r0);
      f.evict_us += us(t1 - t0) + us(t3 - t2) - (r2 - r1);
    }
  }
  // The all-reduce alone: the host path's [B, slots] fp64 sums, back to back (the ranks wait for
  // each other once, then only the transfers count), median of 64.
  auto sums = at::zeros({1, cache.slots(0)}, at::TensorOptions().dtype(at::kDouble));
  auto reduce = tp.reducer();
  for (int i = 0; i < 8; ++i) reduce(0, sums);
  std::vector<double> alone;
  for (int i = 0; i < 64; ++i) {
    const auto i0 = Clock::now();
    reduce(0, sums);
    alone.push_back(us(Clock::now() - i0));
  }
  std::nth_element(alone.begin(), alone.begin() + 32, alone.end());
  f.isolated_us = alone[32];
  f.allreduce_us = reducer_us / steps;
  f.calls = static_cast<double>(reducer_calls) / steps;
  f.attend_us /= steps;
  f.evict_us /= steps;
  if (recalls > 0) f.recall_us /= static_cast<double>(recalls), f.recalled /= static_cast<double>(recalls);
  return f;
}

const std::vector<Config> configs(int64_t every) {
  return {{"eager, evict_every 1", 1, false}, {"eager", every, false}, {"lazy", every, true}};
}

int rank_main(int rank, int world, const std::string& dir, int64_t steps, int64_t every, bool latent, const Recall& rc) {
  tp_harness::rank_process(rank, world, dir, 64, std::chrono::seconds(120), 1800,
                           [&](const kvevict::TensorParallel& tp, FILE* out) {
                             for (const auto& c : configs(every)) {
                               const auto f = latent ? measure<kvevict::MlaLatentCache>(tp, c, steps, true, rc)
                                                     : measure<kvevict::MlaCache>(tp, c, steps, false, rc);
                               std::fprintf(out, "%.3f %.4f %.3f %.3f %.3f %.3f %.3f\n", f.allreduce_us, f.calls,
                                            f.evict_us, f.attend_us, f.isolated_us, f.recall_us, f.recalled);
                             }
                           });
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> worlds = {2, 4};
  int64_t steps = 64, every = 16, rank = -1, world = 0;
  std::string layout = "expanded", dir;
  Recall rc;
  try {
    const bool run = kvevict_cli::parse_flags(
        argc, argv,
        {
            {"--world", [&](auto& f, auto& v) { worlds = kvevict_cli::parse_int_list(f, v, 2, 8); }},
            {"--steps", [&](auto& f, auto& v) { steps = kvevict_cli::parse_int(f, v, 1, 1000000); }},
            {"--evict-every", [&](auto& f, auto& v) { every = kvevict_cli::parse_int(f, v, 1, 4096); }},
            {"--layout", [&](auto& f, auto& v) { layout = kvevict_cli::parse_choice(f, v, {"expanded", "latent"}); }},
            {"--rank", [&](auto& f, auto& v) { rank = kvevict_cli::parse_int(f, v, 0, 7); }},
            {"--ranks", [&](auto& f, auto& v) { world = kvevict_cli::parse_int(f, v, 1, 8); }},
            {"--dir", [&](auto&, auto& v) { dir = v; }},
            {"--recall-every", [&](auto& f, auto& v) { rc.every = kvevict_cli::parse_int(f, v, 0, 1000000); }},
            {"--recall-tokens", [&](auto& f, auto& v) { rc.tokens = kvevict_cli::parse_int(f, v, 1, 4592); }},
        });
    if (!run) {
      std::printf("%s", kUsage);
      return EXIT_SUCCESS;
    }
    if (steps % every != 0) throw kvevict_cli::UsageError("--steps must be a multiple of --evict-every");
  } catch (const kvevict_cli::UsageError& e) {
    std::fprintf(stderr, "kvevict_tp_bench: %s\n%s", e.what(), kUsage);
    return 2;
  }
  const bool latent = layout == "latent";
  if (rank >= 0) return rank_main(static_cast<int>(rank), static_cast<int>(world), dir, steps, every, latent, rc);

  std::printf("kvevict_tp_bench: %s layout, 64 heads split across the ranks, capacity 4,612 (budget 4592, n_sink 4, "
              "n_recent 16), fp32, CPU, B = 1, one layer, one thread per rank, Gloo over loopback, %" PRId64
              " timed steps; us per decode step, mean over steps, max over ranks\n",
              layout.c_str(), steps);
  if (rc.every > 0) {
    std::printf("host tier of 16,384 tokens (pages of 16, 2,048 tokens in it at the start), a recall of %" PRId64
                " tokens (whole pages, per head) every %" PRId64 " steps between update and attend\n",
                rc.tokens, rc.every);
  }
  std::printf("\n| ranks | configuration | all-reduces/step | one all-reduce, alone | all-reduce in the step "
              "(incl. waiting for peers) | update+evict | attend (+observe) |%s\n",
              rc.every > 0 ? " one recall (incl. its all-reduces) | tokens per recall |" : "");
  std::printf("| ---: | --- | ---: | ---: | ---: | ---: | ---: |%s\n", rc.every > 0 ? " ---: | ---: |" : "");
  bool ok = true;
  for (const auto w : worlds) {
    const auto d = tp_harness::make_temp_dir("kvevict_tp_bench_");
    const auto status = tp_harness::launch_ranks(
        tp_harness::self_exe(),
        {"--ranks", std::to_string(w), "--dir", d, "--steps", std::to_string(steps), "--evict-every",
         std::to_string(every), "--layout", layout, "--recall-every", std::to_string(rc.every), "--recall-tokens",
         std::to_string(rc.tokens)},
        static_cast<int>(w), std::chrono::minutes(30));
    std::vector<std::vector<Figures>> per_rank;
    for (int64_t r = 0; r < w; ++r) {
      std::ifstream in(d + "/rank" + std::to_string(r) + ".txt");
      std::vector<Figures> figs;
      Figures f;
      while (in >> f.allreduce_us >> f.calls >> f.evict_us >> f.attend_us >> f.isolated_us >> f.recall_us >> f.recalled) {
        figs.push_back(f);
      }
      if (status[r] != 0 || figs.size() != configs(every).size()) {
        std::fprintf(stderr, "rank %" PRId64 " of %" PRId64 " failed (exit %d)\n", r, w, status[r]);
        ok = false;
      }
      per_rank.push_back(figs);
    }
    if (!ok) break;
    const auto cs = configs(every);
    for (size_t c = 0; c < cs.size(); ++c) {
      Figures m;
      for (const auto& figs : per_rank) {
        m.allreduce_us = std::max(m.allreduce_us, figs[c].allreduce_us);
        m.calls = std::max(m.calls, figs[c].calls);
        m.evict_us = std::max(m.evict_us, figs[c].evict_us);
        m.attend_us = std::max(m.attend_us, figs[c].attend_us);
        m.isolated_us = std::max(m.isolated_us, figs[c].isolated_us);
        m.recall_us = std::max(m.recall_us, figs[c].recall_us);
        m.recalled = std::max(m.recalled, figs[c].recalled);
      }
      std::printf("| %" PRId64 " | %s%s | %.3f | %.0f | %.0f | %.1f | %.0f |", w, cs[c].name,
                  cs[c].evict_every == 1 ? "" : (", evict_every " + std::to_string(cs[c].evict_every)).c_str(),
                  m.calls, m.isolated_us, m.allreduce_us, m.evict_us, m.attend_us);
      if (rc.every > 0) std::printf(" %.0f | %.1f |", m.recall_us, m.recalled);
      std::printf("\n");
    }
  }
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
