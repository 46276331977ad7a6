// kvevict_tier_bench: what the host tier and recall cost next to the attention they serve
// (issue 15), measured side by side in one run. A timing CLI of our own (std::chrono, printf),
// like kvevict_bench.
//
// One latent-layout layer (H heads, kv_lora_rank 512, qk_rope_dim 64, fp32, CPU; the host path
// unless --paths says otherwise) at --capacity tokens with a host tier of --tier tokens, filled
// first: capacity + tier tokens appended in chunks of 512 with random scores, each chunk's pass
// sending 512 tokens to the tier (untimed). Then per configuration (page size x when):
//   every step   each decode step appends one token, recalls up to --recall-tokens tokens with
//                its queries (Q = 1), attends (attend_absorbed, observing) and evicts;
//   per question a --question-tokens append (a new user turn) recalls once with its Q queries,
//                then attends; the decode steps between questions do not recall.
// Reported, medians over --steps steps (or questions): attend ms (of the same Q), score ms (a
// recall with a budget of 0: the checks and the digest scoring alone), recall ms (digest
// scoring + the swap), each as a share of attend, tokens recalled per call (the recall budget is
// max(--recall-tokens, page): at least one whole page), bytes moved from
// host to device per call (recalled rows, fp32 here; bf16 halves it) and the host memory the
// tier holds (rows, bookkeeping and digests, CacheStats::tier_bytes).
// --rescore N adds, per page size, the two-level recall (recall's rescore): the best pages up
// to N tokens scored again token by token, --recall-tokens of them back. Its scoring cannot be
// timed apart from the swap (a budget of 0 rescores nothing), so those rows give recall ms
// only: an upper bound on their scoring.
// --scoring per_head,head_mean gives each row under each TierScoring (cache option tier_scoring):
// per head, or by the heads' mean logit (one query per column instead of one per head and
// column). Default: per_head only.
// --paths host,tensor,reference gives each row on the host path (the CPU's default: loops over the host
// tier) and on the tensor path (what a GPU runs: the tier's state in tensors, no host sync; here
// its ops run on the CPU, so its times say what the ops cost on this CPU, not on a GPU), with
// the tier's compiled kernels where this build has them (kvevict::kernels); `reference` is the
// tensor path with their ATen reference forms instead. Default: host only.
#include "cli.hpp"

#include <kvevict/kvevict.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Args {
  int64_t heads = 64, capacity = 4612, tier = 32768, steps = 20, threads = 1, recall_tokens = 64, question = 16,
          rescore = 0;
  std::vector<int64_t> pages = {1, 16, 64, 256};
  std::vector<kvevict::TierScoring> scorings = {kvevict::TierScoring::kPerHead};
  std::vector<std::string> paths = {"host"};
};

const char* scoring_name(kvevict::TierScoring s) { return s == kvevict::TierScoring::kHeadMean ? "head_mean" : "per_head"; }

constexpr int64_t kW = 512, kR = 64;

/// A latent cache at capacity with `a.tier` tokens in its tier, on the tensor path if
/// `tensor_path`.
kvevict::MlaLatentCache filled(const Args& a, int64_t page, kvevict::TierScoring scoring, bool tensor_path) {
  kvevict::detail::force_tensor_path() = tensor_path;  // read when the cache's policy is built
  kvevict::MlaLatentCache cache(
      kvevict::MlaLatentCacheOptions(1, a.heads).kv_lora_rank(kW).qk_rope_dim(kR).tier_tokens(a.tier).tier_page_size(page)
          .tier_scoring(scoring),
      kvevict::EvictionOptions(a.capacity - 20).n_sink(4).n_recent(16));
  kvevict::detail::force_tensor_path() = false;
  at::manual_seed(3);
  const int64_t chunk = 512;
  for (int64_t done = 0; done < a.capacity + a.tier; done += chunk) {
    cache.update(0, at::randn({1, chunk, kW}), at::randn({1, chunk, kR}));
    cache.add_scores(0, at::rand({1, cache.size(0)}));
    cache.evict_now(0);
  }
  return cache;
}

struct Row {
  double attend_ms = 0, score_ms = 0, recall_ms = 0, recalled = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Median attend and recall time over `n` appends of `q_len` tokens (medians: one slow call, a
/// page fault storm or a preemption, moves a mean by 2x here), recalling up to `budget` tokens
/// at every one (two-level with a pool of `rescore` tokens when rescore > budget); tokens
/// recalled: the mean.
Row measure(kvevict::MlaLatentCache& cache, const Args& a, int64_t q_len, int64_t n, int64_t budget,
            int64_t rescore) {
  const double scale = 1.0 / std::sqrt(192.0);
  Row r;
  std::vector<double> att_ms, score_ms, rec_ms;
  const int64_t warmup = 2;
  for (int64_t i = 0; i < warmup + n; ++i) {
    cache.update(0, at::randn({1, q_len, kW}), at::randn({1, q_len, kR}));
    const auto qa = at::randn({1, a.heads, q_len, kW}), qp = at::randn({1, a.heads, q_len, kR});
    const int64_t before = cache.stats(0).tier_recalled;
    auto t0 = Clock::now();
    cache.recall_absorbed(0, qa, qp, scale, 0);  // a budget of 0: the checks and the digest scoring only
    const double score = seconds_since(t0);
    t0 = Clock::now();
    cache.recall_absorbed(0, qa, qp, scale, budget, rescore);
    const double rec = seconds_since(t0);
    t0 = Clock::now();
    kvevict::attend_absorbed(qa, qp, cache, 0, scale);
    const double att = seconds_since(t0);
    cache.evict_now(0);
    if (i >= warmup) {
      att_ms.push_back(1e3 * att);
      rec_ms.push_back(1e3 * rec);
      score_ms.push_back(1e3 * score);
      r.recalled += static_cast<double>(cache.stats(0).tier_recalled - before) / n;
    }
  }
  r.attend_ms = median(att_ms);
  r.score_ms = median(score_ms);
  r.recall_ms = median(rec_ms);
  return r;
}

void run(const Args& a) {
  std::printf("latent layout, %lld heads, capacity %lld, tier %lld tokens, fp32, CPU, %lld thread(s); recall budget "
              "max(%lld, page) tokens per call; question appends of %lld tokens; medians over %lld calls\n",
              static_cast<long long>(a.heads), static_cast<long long>(a.capacity), static_cast<long long>(a.tier),
              static_cast<long long>(a.threads), static_cast<long long>(a.recall_tokens),
              static_cast<long long>(a.question), static_cast<long long>(a.steps));
  std::printf("%9s %6s %10s %13s %10s %7s %10s %10s %10s %10s %11s %12s %15s %9s\n", "path", "page", "scoring", "when", "recall", "pages",
              "attend ms", "score ms", "score/att", "recall ms", "recall/att", "tokens/call", "H2D bytes/call",
              "host MiB");
  const double row_bytes = (kW + kR) * 4.0;
  for (const int64_t page : a.pages)
  for (const auto scoring : a.scorings)
  for (const auto& path : a.paths) {
    const bool tensor_path = path != "host";
    kvevict::set_kernels_enabled(path != "reference");
    auto cache = filled(a, page, scoring, tensor_path);
    const auto pages = static_cast<long long>(a.tier / page + (a.tier % page != 0));
    const int64_t pool = std::max(a.rescore, page);
    for (const bool two_level : {false, true}) {
      if (two_level && (a.rescore == 0 || pool <= a.recall_tokens)) continue;
      for (const bool question : {false, true}) {
        const int64_t budget = two_level ? a.recall_tokens : std::max(a.recall_tokens, page);
        const Row r = measure(cache, a, question ? a.question : 1, a.steps, budget, two_level ? pool : 0);
        char score[2][16];
        std::snprintf(score[0], sizeof score[0], "%.3f", r.score_ms);
        std::snprintf(score[1], sizeof score[1], "%.1f%%", 100.0 * r.score_ms / r.attend_ms);
        std::printf("%9s %6lld %10s %13s %10s %7lld %10.3f %10s %10s %10.3f %10.1f%% %12.1f %15.0f %9.1f\n",
                    path.c_str(), static_cast<long long>(page), scoring_name(scoring), question ? "per question" : "every step",
                    two_level ? "two-level" : "pages", pages, r.attend_ms, two_level ? "-" : score[0],
                    two_level ? "-" : score[1], r.recall_ms, 100.0 * r.recall_ms / r.attend_ms, r.recalled,
                    r.recalled * row_bytes, static_cast<double>(cache.stats(0).tier_bytes) / (1024.0 * 1024.0));
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  try {
    const bool go = kvevict_cli::parse_flags(
        argc, argv,
        {{"--heads", [&](auto& f, auto& v) { a.heads = kvevict_cli::parse_int(f, v, 1, 1024); }},
         {"--capacity", [&](auto& f, auto& v) { a.capacity = kvevict_cli::parse_int(f, v, 21, int64_t{1} << 24); }},
         {"--tier", [&](auto& f, auto& v) { a.tier = kvevict_cli::parse_int(f, v, 512, int64_t{1} << 24); }},
         {"--steps", [&](auto& f, auto& v) { a.steps = kvevict_cli::parse_int(f, v, 1, 100000); }},
         {"--threads", [&](auto& f, auto& v) { a.threads = kvevict_cli::parse_int(f, v, 1, 1024); }},
         {"--recall-tokens", [&](auto& f, auto& v) { a.recall_tokens = kvevict_cli::parse_int(f, v, 0, 1 << 20); }},
         {"--question-tokens", [&](auto& f, auto& v) { a.question = kvevict_cli::parse_int(f, v, 1, 4096); }},
         {"--rescore", [&](auto& f, auto& v) { a.rescore = kvevict_cli::parse_int(f, v, 0, 1 << 20); }},
         {"--pages", [&](auto& f, auto& v) { a.pages = kvevict_cli::parse_int_list(f, v, 1, 1 << 20); }},
         {"--scoring", [&](auto& f, auto& v) {
            a.scorings.clear();
            for (const auto& s : kvevict_cli::parse_choice_list(f, v, {"per_head", "head_mean"}))
              a.scorings.push_back(s == "head_mean" ? kvevict::TierScoring::kHeadMean : kvevict::TierScoring::kPerHead);
          }},
         {"--paths", [&](auto& f, auto& v) {
            a.paths = kvevict_cli::parse_choice_list(f, v, {"host", "tensor", "reference"});
          }}});
    if (!go) {
      std::printf(
          "usage: kvevict_tier_bench [--heads N] [--capacity N] [--tier N] [--pages 1,16,64,256] [--steps N]\n"
          "                          [--recall-tokens N] [--question-tokens N] [--rescore N] [--threads N]\n"
          "                          [--scoring per_head,head_mean] [--paths host,tensor,reference]\n"
          "Defaults: 64 heads, capacity 4612, tier 32768, pages 1,16,64,256, 20 calls, recall 64 tokens, questions of\n"
          "16 tokens, no two-level rows (--rescore 0), 1 thread, per_head scoring, host path.\n");
      return 0;
    }
  } catch (const kvevict_cli::UsageError& e) {
    std::fprintf(stderr, "kvevict_tier_bench: %s (see --help)\n", e.what());
    return 2;
  }
  at::set_num_threads(static_cast<int>(a.threads));
  at::NoGradGuard no_grad;
  run(a);
  return 0;
}
