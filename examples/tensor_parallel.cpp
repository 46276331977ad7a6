// tensor_parallel: tensor-parallel eviction from one command. Launches --world ranks of itself on
// this machine (Gloo over loopback, a FileStore in a temporary directory); each rank holds
// heads / world of a random-init DeepSeek-V3-style attention (examples/tp_harness.hpp), keeps an
// expanded cache (its heads) and a latent cache (replicated), and runs --steps decode steps
// with kvevict::TensorParallel reducing the scores across the ranks. Prints each rank's digest
// of the kept positions (every step, every layer and row, both layouts) and of its latent rows,
// then the same digests from one process holding all the heads; exits 0 if all are equal.

#include "cli.hpp"
#include "tp_harness.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: tensor_parallel [--world N] [--steps S] [--lazy] [--timeout SECONDS]\n"
    "  --world N        ranks (processes), 1 .. 8; the 8 heads are split across them [2]\n"
    "  --steps S        decode steps, 1 .. 100000 [1000]\n"
    "  --lazy           lazy_reduction: one all-reduce per eviction pass instead of per observe\n"
    "  --timeout T      seconds a collective may take before the ranks give up [60]\n";

struct Digests {
  uint64_t positions = 0, latent_rows = 0;
  int64_t evicted = 0;
};

Digests digests(const tp_harness::RunResult& r) {
  Digests d;
  d.positions = tp_harness::fnv(r.expanded.data(), r.expanded.size() * sizeof(uint64_t));
  d.positions = tp_harness::fnv(r.latent.data(), r.latent.size() * sizeof(uint64_t), d.positions);
  d.latent_rows = r.latent_rows;
  d.evicted = r.tokens_evicted;
  return d;
}

int rank_main(int rank, int world, const std::string& dir, const tp_harness::RunOptions& o, double timeout_s) {
  tp_harness::rank_process(rank, world, dir, o.dims.heads,
                           std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)), 3600,
                           [&](const kvevict::TensorParallel& tp, FILE* out) {
                             tp_harness::RunResult r;
                             tp_harness::run(o, &tp, r);
                             const auto d = digests(r);
                             std::fprintf(out, "ok %" PRId64 " %" PRId64 " %" PRIu64 " %" PRIu64 " %" PRId64 "\n",
                                          tp.heads().begin, tp.heads().end, d.positions, d.latent_rows, d.evicted);
                           });
}

}  // namespace

int main(int argc, char** argv) {
  int world = 2, rank = -1;
  int64_t steps = 1000;
  bool lazy = false;
  double timeout_s = 60;
  std::string dir;
  try {
    const bool run = kvevict_cli::parse_flags(
        argc, argv,
        {
            {"--world", [&](auto& f, auto& v) { world = static_cast<int>(kvevict_cli::parse_int(f, v, 1, 8)); }},
            {"--steps", [&](auto& f, auto& v) { steps = kvevict_cli::parse_int(f, v, 1, 100000); }},
            {"--timeout", [&](auto& f, auto& v) { timeout_s = kvevict_cli::parse_seconds(f, v); }},
            {"--rank", [&](auto& f, auto& v) { rank = static_cast<int>(kvevict_cli::parse_int(f, v, 0, 7)); }},
            {"--dir", [&](auto&, auto& v) { dir = v; }},
        },
        {{"--lazy", [&] { lazy = true; }}});
    if (!run) {
      std::printf("%s", kUsage);
      return EXIT_SUCCESS;
    }
  } catch (const kvevict_cli::UsageError& e) {
    std::fprintf(stderr, "tensor_parallel: %s\n%s", e.what(), kUsage);
    return 2;
  }
  tp_harness::RunOptions o;
  o.steps = steps;
  o.lazy = lazy;
  if (rank >= 0) return rank_main(rank, world, dir, o, timeout_s);  // launched by the command below

  dir = tp_harness::make_temp_dir("kvevict_tensor_parallel_");
  std::vector<std::string> args = {"--world", std::to_string(world), "--steps", std::to_string(steps), "--dir", dir,
                                   "--timeout", std::to_string(timeout_s)};
  if (lazy) args.push_back("--lazy");
  std::printf("%d ranks, %d heads split across them, %" PRId64 " decode steps, %s reduction, Gloo over loopback\n",
              world, static_cast<int>(o.dims.heads), steps, lazy ? "lazy" : "eager");
  const auto status = tp_harness::launch_ranks(tp_harness::self_exe(), args, world,
                                               std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000) + 600000));
  at::set_num_threads(1);
  tp_harness::RunResult single;
  tp_harness::run(o, nullptr, single);
  const auto expected = digests(single);
  bool all_equal = true;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(dir + "/rank" + std::to_string(r) + ".txt");
    std::string head;
    int64_t begin = 0, end = 0;
    Digests d;
    in >> head >> begin >> end >> d.positions >> d.latent_rows >> d.evicted;
    if (status[r] != 0 || head != "ok") {
      std::string rest;
      std::getline(in, rest);
      std::printf("rank %d: FAILED (exit %d) %s\n", r, status[r], rest.c_str());
      all_equal = false;
      continue;
    }
    std::printf("rank %d: heads [%" PRId64 ", %" PRId64 "), kept-positions digest %016" PRIx64
                ", latent-rows digest %016" PRIx64 ", %" PRId64 " tokens evicted\n",
                r, begin, end, d.positions, d.latent_rows, d.evicted);
    all_equal = all_equal && d.positions == expected.positions && d.latent_rows == expected.latent_rows;
  }
  std::printf("one process, all heads:  kept-positions digest %016" PRIx64 ", latent-rows digest %016" PRIx64
              ", %" PRId64 " tokens evicted\n",
              expected.positions, expected.latent_rows, expected.evicted);
  std::printf("%s\n", all_equal ? "OK - every rank kept the same positions as one process with all heads"
                                : "FAIL - the digests differ");
  return all_equal ? EXIT_SUCCESS : EXIT_FAILURE;
}
