// kvevict_lse_bench: what scoring from a fused kernel's LSE costs (issue 8), next to the
// attention it serves, measured side by side in one run. A timing CLI of our own (std::chrono,
// printf), like kvevict_bench.
//
// --mode decode: one expanded-layout layer (H heads, qk 192, v 128, fp32, CPU) filled to
//   capacity; then each decode step appends one token (untimed), runs attention over the live
//   slots (`attend(..., observe = false)`: the attention a fused kernel would do), and scores
//   from the LSE through LseRing: push() every step, the flush when the ring is full or a pass
//   is due. The LSE itself comes from the same logits, untimed (the kernel returns it for free).
//   Reported per step, means over --steps steps (a multiple of 16, so whole ring cycles):
//   attend ms, LSE-scoring ms, LSE / attend, for each --every (evict_every = ring size).
//
// --mode prompt: a T-token prompt (H heads, qk 192, v 128, fp32) compressed to --capacity
//   tokens in both long-prompt modes, each against a fresh cache:
//     attention   causal attention over the whole prompt, in query chunks of 64 (what a fused
//                 prefill kernel computes; it also yields the LSE one-shot needs)
//     one-shot    compress_prompt(): scores from the LSE, chunk by chunk, then keep capacity
//     chunked     prefill_chunked() with --chunk tokens per chunk (update, attend, evict)
//   with wall time, time / attention, and peak extra memory: the peak RSS during the call
//   (VmHWM after resetting it through /proc/self/clear_refs) minus the RSS before it (after
//   malloc_trim, with glibc's mmap threshold fixed at 1 MiB so freed blocks leave the RSS); the
//   prompt's own q, k, v and the caches are allocated before and not counted. Also how much the two kept
//   sets overlap.
//
// Op counts of the LseRing loop: kvevict_bench --count-ops, loop (c).
#include "cli.hpp"

#include <kvevict/kvevict.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <malloc.h>
#include <iterator>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// A field of /proc/self/status in bytes (VmRSS, VmHWM); -1 where unavailable.
int64_t proc_status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

/// Resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0). False where not allowed.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

/// Runs f() and returns {seconds, peak extra bytes (peak RSS during f - RSS before), valid}.
/// Memory freed by earlier phases goes back to the OS first (malloc_trim), so that f's own
/// allocations show in the RSS.
template <class F>
std::tuple<double, int64_t, bool> measure(F&& f) {
  malloc_trim(0);
  const bool ok = reset_peak_rss();
  const int64_t before = proc_status_bytes("VmRSS");
  const auto t0 = Clock::now();
  f();
  const double s = seconds_since(t0);
  return {s, proc_status_bytes("VmHWM") - before, ok};
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

struct Args {
  std::string mode = "decode";
  int64_t heads = 64, capacity = 4612, steps = 48, tokens = 32768, chunk = 64, threads = 1;
  std::vector<int64_t> every = {1, 4, 8, 16};
};

kvevict::EvictionOptions eviction_for(int64_t capacity, int64_t every) {
  return kvevict::EvictionOptions(capacity - 20).n_sink(4).n_recent(16).evict_every(every);
}

void run_decode(const Args& a) {
  const int64_t H = a.heads, D = 192, V = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::printf("decode: expanded layout, %lld heads, capacity %lld, fp32, CPU, %lld thread(s), %lld steps per "
              "configuration\n",
              static_cast<long long>(H), static_cast<long long>(a.capacity), static_cast<long long>(a.threads),
              static_cast<long long>(a.steps));
  std::printf("%12s %12s %14s %12s\n", "evict_every", "attend ms", "lse-score ms", "lse/attend");
  for (const int64_t every : a.every) {
    at::manual_seed(1);
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, H), eviction_for(a.capacity, every));
    kvevict::LseRing<kvevict::MlaCache> ring(cache);
    cache.update(0, at::randn({1, H, a.capacity, D}), at::randn({1, H, a.capacity, V}));
    double t_att = 0, t_lse = 0;
    const int64_t warmup = 16;
    for (int64_t step = 0; step < warmup + a.steps; ++step) {
      const auto k = at::randn({1, H, 1, D}), v = at::randn({1, H, 1, V}), q = at::randn({1, H, 1, D});
      cache.update(0, k, v);
      auto t0 = Clock::now();
      const auto out = kvevict::attend(q, cache, 0, scale, nullptr, /*observe=*/false);
      const double att = seconds_since(t0);
      // The LSE the fused kernel would have returned (untimed).
      const auto lse = at::logsumexp(at::matmul(q.mul(scale), cache.keys(0).transpose(-2, -1)), -1);
      t0 = Clock::now();
      ring.push(0, q, lse);
      if (cache.policy().due(0)) ring.flush(0);
      const double sc = seconds_since(t0);
      ring.evict(0);
      if (step >= warmup) {
        t_att += att;
        t_lse += sc;
      }
    }
    std::printf("%12lld %12.3f %14.3f %11.1f%%\n", static_cast<long long>(every), 1e3 * t_att / a.steps,
                1e3 * t_lse / a.steps, 100.0 * t_lse / t_att);
    std::fflush(stdout);
  }
}

/// Causal attention over the whole prompt in query chunks (what a fused prefill kernel
/// computes); returns the LSE [B, H, T] fp32.
at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), qc = 64;
  auto lse = at::empty({B, H, T});
  for (int64_t t0 = 0; t0 < T; t0 += qc) {
    const int64_t n = std::min(qc, T - t0), keys = t0 + n;
    auto logits = at::matmul(q.narrow(2, t0, n).mul(scale), k.narrow(2, 0, keys).transpose(-2, -1));  // [B, H, n, keys]
    const auto kpos = at::arange(keys, at::kLong).view({1, keys}), qpos = at::arange(t0, keys, at::kLong).view({n, 1});
    logits.masked_fill_(kpos.gt(qpos), -INFINITY);
    lse.narrow(2, t0, n).copy_(at::logsumexp(logits, -1));
    const auto out = at::matmul(at::softmax(logits, -1), v.narrow(2, 0, keys));  // [B, H, n, 128]
    (void)out;
  }
  return lse;
}

void run_prompt(const Args& a) {
  const int64_t H = a.heads, T = a.tokens, D = 192, V = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::printf("prompt: %lld tokens -> capacity %lld, expanded layout, %lld heads, fp32, CPU, %lld thread(s), "
              "chunked prefill chunk %lld, LseOptions defaults (heads within 64 MiB x 64 queries per chunk)\n",
              static_cast<long long>(T), static_cast<long long>(a.capacity), static_cast<long long>(H),
              static_cast<long long>(a.threads), static_cast<long long>(a.chunk));
  at::manual_seed(2);
  const auto q = at::randn({1, H, T, D}), k = at::randn({1, H, T, D}), v = at::randn({1, H, T, V});
  // Each line is printed as soon as its mode is measured (a 32K-token run takes long).
  std::printf("%-24s %10s %12s %16s\n", "mode", "seconds", "x attention", "peak extra MiB");
  std::fflush(stdout);
  auto report = [](const char* mode, double t, double t_att, int64_t peak, bool ok) {
    std::printf("%-24s %10.2f %12.2f %16.1f%s\n", mode, t, t / t_att, mib(peak),
                ok ? "" : "  (peak RSS not reset: includes earlier phases)");
    std::fflush(stdout);
  };
  at::Tensor lse;
  const auto [t_att, m_att, ok] = measure([&] { lse = prompt_attention(q, k, v, scale); });
  report("attention (+LSE)", t_att, t_att, m_att, ok);
  const auto opts = kvevict::MlaCacheOptions(1, H);
  kvevict::MlaCache one(opts, eviction_for(a.capacity, 1)), chunked(opts, eviction_for(a.capacity, 1));
  at::Tensor keep;
  const auto [t_one, m_one, ok1] = measure([&] { keep = kvevict::compress_prompt(one, 0, q, k, v, lse, scale); });
  report("one-shot (from LSE)", t_one, t_att, m_one, ok1);
  const auto [t_chk, m_chk, ok2] = measure([&] { kvevict::prefill_chunked(chunked, 0, q, k, v, a.chunk, scale); });
  report("chunked prefill", t_chk, t_att, m_chk, ok2);
  // keep: prompt positions kept by one-shot; chunked's cache positions are prompt positions.
  auto x = keep[0].contiguous(), y = std::get<0>(at::sort(chunked.positions(0)[0])).contiguous();
  const auto* xa = x.data_ptr<int64_t>();
  const auto* ya = y.data_ptr<int64_t>();
  std::vector<int64_t> common;
  std::set_intersection(xa, xa + x.numel(), ya, ya + y.numel(), std::back_inserter(common));
  std::printf("kept by both modes: %zu of %lld (one-shot kept %lld, chunked %lld)\n", common.size(),
              static_cast<long long>(a.capacity), static_cast<long long>(x.numel()),
              static_cast<long long>(y.numel()));
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    const bool go = kvevict_cli::parse_flags(
        argc, argv,
        {{"--mode", [&](auto& f, auto& v) { a.mode = kvevict_cli::parse_choice(f, v, {"decode", "prompt"}); }},
         {"--heads", [&](auto& f, auto& v) { a.heads = kvevict_cli::parse_int(f, v, 1, 1024); }},
         {"--capacity", [&](auto& f, auto& v) { a.capacity = kvevict_cli::parse_int(f, v, 21, int64_t{1} << 24); }},
         {"--steps", [&](auto& f, auto& v) { a.steps = kvevict_cli::parse_int(f, v, 1, 100000); }},
         {"--tokens", [&](auto& f, auto& v) { a.tokens = kvevict_cli::parse_int(f, v, 1, int64_t{1} << 24); }},
         {"--chunk", [&](auto& f, auto& v) { a.chunk = kvevict_cli::parse_int(f, v, 1, int64_t{1} << 24); }},
         {"--threads", [&](auto& f, auto& v) { a.threads = kvevict_cli::parse_int(f, v, 1, 1024); }},
         {"--every", [&](auto& f, auto& v) { a.every = kvevict_cli::parse_int_list(f, v, 1, 1 << 20); }}});
    if (!go) {
      std::printf(
          "usage: kvevict_lse_bench [--mode decode|prompt] [--heads N] [--capacity N] [--threads N]\n"
          "         decode: [--every 1,4,8,16] [--steps N]     prompt: [--tokens N] [--chunk N]\n"
          "Defaults: decode, 64 heads, capacity 4612, 1 thread, 48 steps, prompt 32768 tokens, chunk 64.\n");
      return 0;
    }
  } catch (const kvevict_cli::UsageError& e) {
    std::fprintf(stderr, "kvevict_lse_bench: %s (see --help)\n", e.what());
    return 2;
  }
  at::set_num_threads(static_cast<int>(a.threads));
  at::NoGradGuard no_grad;
  if (a.mode == "decode") {
    run_decode(a);
  } else {
    // Fixed for the peak-memory readings: blocks of 1 MiB and more are mapped and unmapped, not
    // kept. Not in decode mode, which times steps: there every large temporary would fault in
    // fresh pages (glibc's default keeps such blocks after their first use).
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
    run_prompt(a);
  }
  return 0;
}
