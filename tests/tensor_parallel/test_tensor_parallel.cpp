// Tensor-parallel eviction (tensor_parallel.hpp) across real processes: ranks of this executable
// (launched with --tp-worker) form a Gloo group over loopback through a FileStore, split the
// heads of a random-init DeepSeek-V3-style attention (examples/tp_harness.hpp) and run 250
// decode steps (1,000 in the long run, KVEVICT_LONG_TESTS=1: the ctest tensor_parallel_agree_long). Expected values come from one process holding all the heads, with no reducer
// and no c10d (tp_harness::run with no TensorParallel), computed in this test process.
//
// Bounded: every launch has a watchdog (the test kills every rank past its deadline), every
// rank has its own (alarm), and every collective a timeout.

#include "tp_harness.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>

// c10d brings glog, whose CHECK would shadow Catch's: Catch comes last and takes the name.
#undef CHECK
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kRankError = 3;       // a rank caught a c10::Error (and wrote it to its file)
constexpr int64_t kTimeoutMs = 3000;  // collectives' timeout in the failure tests
/// Decode steps of an agreement run: 250 (capacity 60, a pass every 4 steps: ~48 passes, ~83
/// recalls), 1,000 in the long run (KVEVICT_LONG_TESTS=1). The ranks are told (--steps).
int64_t agree_steps() {
  const char* on = std::getenv("KVEVICT_LONG_TESTS");
  return on != nullptr && std::strcmp(on, "1") == 0 ? 1000 : 250;
}

struct Args {
  int rank = -1, world = 0;
  std::string dir, mode = "agree";
  bool lazy = false;
  int64_t steps = 250, timeout_ms = 60000;
};

constexpr int64_t kRecallEvery = 3;  // modes "recall*": a host tier, recall every 3 steps

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; ++i) {
    const std::string k = argv[i];
    const std::string v = argv[i + 1];
    if (k == "--rank") a.rank = std::stoi(v);
    else if (k == "--world") a.world = std::stoi(v);
    else if (k == "--dir") a.dir = v;
    else if (k == "--mode") a.mode = v;
    else if (k == "--lazy") a.lazy = v == "1";
    else if (k == "--steps") a.steps = std::stoll(v);
    else if (k == "--timeout-ms") a.timeout_ms = std::stoll(v);
    else continue;
    ++i;
  }
  return a;
}

/// A recall run: how the pages are scored (per head, or by the heads' mean logit), on which
/// path, with how many heads in all (0: the harness's 8).
struct RecallRun {
  bool on = false, head_mean = false, tensor_path = false;
  int64_t heads = 0;
  /// The worker's --mode for it.
  std::string mode() const {
    return std::string(head_mean ? "recall_mean" : "recall") + (tensor_path ? "_tensor" : "") +
           (heads > 0 ? "_heads" + std::to_string(heads) : "");
  }
  bool operator<(const RecallRun& o) const {
    return std::tie(on, head_mean, tensor_path, heads) < std::tie(o.on, o.head_mean, o.tensor_path, o.heads);
  }
};

tp_harness::RunOptions run_options(bool lazy, int64_t steps, const RecallRun& recall = {}) {
  tp_harness::RunOptions o;
  o.lazy = lazy;
  o.steps = steps;
  o.recall_every = recall.on ? kRecallEvery : 0;
  o.scoring = recall.head_mean ? kvevict::TierScoring::kHeadMean : kvevict::TierScoring::kPerHead;
  if (recall.heads > 0) o.dims.heads = recall.heads;
  return o;
}

/// One rank: connect, run, write "ok" and the digests (or "error <ms> <message>") to
/// <dir>/rank<R>.txt.
int worker_main(const Args& a) {
  ::alarm(240);  // the rank's own watchdog: SIGALRM ends it whatever happens
  ::signal(SIGPIPE, SIG_IGN);  // a peer that died: writes fail with EPIPE (an error), not a silent death
  at::set_num_threads(1);
  std::ofstream out(a.dir + "/rank" + std::to_string(a.rank) + ".txt");
  tp_harness::RunResult result;
  auto step_start = Clock::now();
  try {
    auto store = c10::make_intrusive<c10d::FileStore>(a.dir + "/store", a.world);
    RecallRun recall;
    for (const bool mean : {false, true})
      for (const bool tensor : {false, true})
        for (const int64_t heads : {int64_t{0}, int64_t{3}})
          if (a.mode == RecallRun{true, mean, tensor, heads}.mode()) recall = {true, mean, tensor, heads};
    auto o = run_options(a.lazy, a.steps, recall);
    const auto tp = kvevict::TensorParallel::connect(store, a.rank, a.world, o.dims.heads, at::kCPU,
                                                     std::chrono::milliseconds(a.timeout_ms));
    // The tensor path (what CUDA runs) on the CPU: the tier as tensors, recall scored by page id.
    kvevict::detail::force_tensor_path() = recall.tensor_path;
    const bool last = a.rank == a.world - 1;
    if (a.mode == "noreduce") o.reduce = false;
    if (a.mode == "kill" && last) o.kill_at = 50;
    if (a.mode == "hang" && last) {
      o.hang_at = 50;
      o.hang_for = std::chrono::milliseconds(3 * a.timeout_ms);
    }
    if (a.mode == "mismatch_budget" && a.rank == 1) o.eviction.budget(o.eviction.budget() + 1);
    if (a.mode == "mismatch_batch" && a.rank == 1) o.dims.batch += 1;
    if (a.mode == "mismatch_lazy" && a.rank == 1) o.lazy = !o.lazy;
    tp_harness::run(o, &tp, result, &step_start);
    out << "ok\n";
    for (const auto* v : {&result.expanded, &result.latent}) {
      for (const auto d : *v) out << d << ' ';
      out << '\n';
    }
    out << result.latent_rows << '\n' << result.tokens_evicted << '\n' << result.recalled << '\n';
    out << result.tier.size();
    for (const auto d : result.tier) out << ' ' << d;
    out.precision(17);
    for (const auto x : result.tier_rank_sums) out << ' ' << x;
    out << '\n' << result.head_begin << ' ' << result.outputs.size() << ' ' << (a.steps * 2) << '\n';
    for (const auto& v : result.outputs) {
      for (const auto x : v) out << x << ' ';
      out << '\n';
    }
    out.flush();
    ::_exit(0);  // skip the group's teardown: the peers may be gone already
  } catch (const c10::Error& e) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - step_start).count();
    std::string msg = e.what_without_backtrace();
    for (auto& c : msg) c = c == '\n' ? ' ' : c;
    out << "error " << ms << ' ' << result.expanded.size() << ' ' << msg << '\n';
    out.flush();
    ::_exit(kRankError);
  }
}

struct RankOutput {
  bool ok = false;
  std::vector<uint64_t> expanded, latent;
  uint64_t latent_rows = 0;
  int64_t tokens_evicted = 0, recalled = 0;
  std::vector<uint64_t> tier;
  std::vector<double> tier_rank_sums;
  int64_t head_begin = -1;
  std::vector<std::vector<double>> outputs;
  int64_t error_ms = -1, error_step = -1;
  std::string error;
};

RankOutput read_rank(const std::string& dir, int rank) {
  RankOutput r;
  std::ifstream in(dir + "/rank" + std::to_string(rank) + ".txt");
  std::string head;
  in >> head;
  if (head == "ok") {
    r.ok = true;
    std::string line;
    std::getline(in, line);
    for (auto* v : {&r.expanded, &r.latent}) {
      std::getline(in, line);
      std::istringstream ls(line);
      uint64_t d;
      while (ls >> d) v->push_back(d);
    }
    in >> r.latent_rows >> r.tokens_evicted >> r.recalled;
    size_t n = 0, m = 0;
    in >> n;
    r.tier.resize(n);
    for (auto& d : r.tier) in >> d;
    r.tier_rank_sums.resize(n == 0 ? 0 : 2);
    for (auto& x : r.tier_rank_sums) in >> x;
    in >> r.head_begin >> n >> m;
    r.outputs.assign(n, std::vector<double>(m));
    for (auto& v : r.outputs)
      for (auto& x : v) in >> x;
  } else if (head == "error") {
    in >> r.error_ms >> r.error_step;
    std::getline(in, r.error);
  }
  return r;
}

struct Launch {
  std::vector<int> status;
  std::vector<RankOutput> ranks;
  double seconds = 0;
};

Launch launch(int world, const std::string& mode, bool lazy, int64_t timeout_ms = 60000, int64_t steps = agree_steps()) {
  const auto dir = tp_harness::make_temp_dir("kvevict_tp_");
  const auto t0 = Clock::now();
  Launch l;
  l.status = tp_harness::launch_ranks(tp_harness::self_exe(),
                                      {"--tp-worker", "--world", std::to_string(world), "--dir", dir, "--mode", mode,
                                       "--lazy", lazy ? "1" : "0", "--steps", std::to_string(steps), "--timeout-ms",
                                       std::to_string(timeout_ms)},
                                      world, 180s);
  l.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (int r = 0; r < world; ++r) l.ranks.push_back(read_rank(dir, r));
  return l;
}

/// The expected run: one process, all heads, no reducer, on the host path or the tensor path
/// (memoised per lazy and recall run).
const tp_harness::RunResult& reference(bool lazy, const RecallRun& recall = {}) {
  static std::map<std::pair<bool, RecallRun>, tp_harness::RunResult> memo;
  auto it = memo.find({lazy, recall});
  if (it == memo.end()) {
    at::set_num_threads(1);
    tp_harness::RunResult r;
    auto& force = kvevict::detail::force_tensor_path();
    const bool before = force;
    force = recall.tensor_path;
    tp_harness::run(run_options(lazy, agree_steps(), recall), nullptr, r);
    force = before;
    it = memo.emplace(std::make_pair(lazy, recall), std::move(r)).first;
  }
  return it->second;
}

/// The first step whose digest differs, or -1.
int64_t first_difference(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return a.size() == b.size() ? -1 : static_cast<int64_t>(std::min(a.size(), b.size()));
}

/// The first step at which one of `rank`'s heads' output checksums differs from the single
/// process's beyond fp32 rounding (|d sum(out x w)| > 1e-5 sum(|out|) + 1e-6), or -1.
int64_t first_output_difference(const RankOutput& rank, const tp_harness::RunResult& ref) {
  int64_t first = -1;
  for (size_t h = 0; h < rank.outputs.size(); ++h) {
    const auto& got = rank.outputs[h];
    const auto& want = ref.outputs.at(static_cast<size_t>(rank.head_begin) + h);
    if (got.size() != want.size()) return 0;
    for (size_t i = 0; i + 1 < got.size(); i += 2) {
      const bool close = std::fabs(got[i] - want[i]) <= 1e-5 * want[i + 1] + 1e-6 && std::fabs(got[i + 1] - want[i + 1]) <= 1e-5 * want[i + 1] + 1e-6;
      if (!close) {
        const auto step = static_cast<int64_t>(i / 2);
        if (first < 0 || step < first) first = step;
        break;
      }
    }
  }
  return first;
}

void check_agreement(int world, bool lazy, const RecallRun& recall = {}) {
  const auto& ref = reference(lazy, recall);
  REQUIRE(ref.tokens_evicted > 0);  // the run evicts: capacity 60, 1,000 tokens
  if (recall.on) REQUIRE(ref.recalled > 0);  // and recalls
  const auto l = launch(world, recall.on ? recall.mode() : "agree", lazy);
  INFO("world " << world << (lazy ? " lazy" : " eager") << ", " << l.seconds << " s");
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": status " << l.status[r] << ", error: " << l.ranks[r].error);
    REQUIRE(l.status[r] == 0);
    REQUIRE(l.ranks[r].ok);
    REQUIRE(l.ranks[r].expanded.size() == static_cast<size_t>(agree_steps()));
    // Every step, every layer and row: the positions one process with all heads keeps.
    CHECK(first_difference(l.ranks[r].expanded, ref.expanded) == -1);
    CHECK(first_difference(l.ranks[r].latent, ref.latent) == -1);
    // Latent replicas bit-identical across ranks (and to the single process's).
    CHECK(l.ranks[r].latent_rows == l.ranks[0].latent_rows);
    CHECK(l.ranks[r].latent_rows == ref.latent_rows);
    CHECK(l.ranks[r].tokens_evicted == ref.tokens_evicted);
    CHECK(l.ranks[r].recalled == ref.recalled);
    // The tiers: {expanded positions, ranks, latent positions, ranks, rows} bit for bit across
    // ranks; against the single process, all but the ranks bit for bit, the ranks to fp32
    // rounding (RunResult::tier).
    CHECK(l.ranks[r].tier == l.ranks[0].tier);
    REQUIRE(l.ranks[r].tier.size() == ref.tier.size());
    if (!ref.tier.empty()) {
      CHECK(l.ranks[r].tier[0] == ref.tier[0]);
      CHECK(l.ranks[r].tier[2] == ref.tier[2]);
      CHECK(l.ranks[r].tier[4] == ref.tier[4]);
      for (size_t i = 0; i < 2; ++i) {
        CHECK(l.ranks[r].tier_rank_sums[i] == Approx(ref.tier_rank_sums[i]).epsilon(1e-6));
      }
    }
    // Each head's attention outputs at every step: rank r's heads are the single process's
    // heads [begin, end), to fp32 rounding.
    const auto heads = kvevict::split_heads(static_cast<int64_t>(ref.outputs.size()), world, r);
    REQUIRE(l.ranks[r].head_begin == heads.begin);
    REQUIRE(static_cast<int64_t>(l.ranks[r].outputs.size()) == heads.size());
    CHECK(first_output_difference(l.ranks[r], ref) == -1);
  }
}

void check_failure(int world, const std::string& mode, bool lazy) {
  const auto l = launch(world, mode, lazy, kTimeoutMs);
  INFO("world " << world << ", " << mode << (lazy ? " lazy" : " eager") << ", " << l.seconds << " s");
  const int victim = world - 1;
  if (mode == "kill") {
    CHECK(l.status[victim] == -SIGKILL);
  } else {
    CHECK(l.status[victim] == tp_harness::kHungExit);  // slept past the others' timeout, then left
  }
  for (int r = 0; r < victim; ++r) {
    const auto& o = l.ranks[r];
    INFO("rank " << r << ": status " << l.status[r] << ", after " << o.error_ms << " ms in step " << o.error_step
                 << ": " << o.error);
    REQUIRE(l.status[r] == kRankError);  // ended by itself, with an error: no hang, no silent success
    CHECK_THAT(o.error, Catch::Contains("tensor parallel: rank " + std::to_string(r) + " of " + std::to_string(world)));
    CHECK_THAT(o.error, Catch::Contains("the all-reduce of layer "));
    CHECK(o.error_step >= 50);
    CHECK(o.error_ms <= kTimeoutMs + 2000);  // within the timeout (plus scheduling slack)
  }
  CHECK(l.seconds < 60);
}

}  // namespace

TEST_CASE("2 ranks, eager: every rank keeps what one process with all heads keeps", "[tensor_parallel][agree]") {
  check_agreement(2, false);
}

TEST_CASE("4 ranks, eager: every rank keeps what one process with all heads keeps", "[tensor_parallel][agree]") {
  check_agreement(4, false);
}

TEST_CASE("2 ranks, lazy: every rank keeps what one lazy process with all heads keeps", "[tensor_parallel][agree]") {
  check_agreement(2, true);
}

TEST_CASE("4 ranks, lazy: every rank keeps what one lazy process with all heads keeps", "[tensor_parallel][agree]") {
  check_agreement(4, true);
}

TEST_CASE("2 ranks, a host tier, recall every 3 steps: every rank recalls what one process with all heads recalls",
          "[tensor_parallel][agree][tier]") {
  check_agreement(2, false, {true, false, false});
}

TEST_CASE("2 ranks, a host tier on the tensor path (pages scored on the device): every rank recalls what one "
          "tensor-path process with all heads recalls",
          "[tensor_parallel][agree][tier]") {
  check_agreement(2, false, {true, false, true});
}

TEST_CASE("2 ranks, a host tier, pages scored by the heads' mean logit (reduced before the softmax), on both paths: "
          "every rank recalls what one process with all heads recalls",
          "[tensor_parallel][agree][tier]") {
  const bool tensor_path = GENERATE(false, true);
  CAPTURE(tensor_path);
  check_agreement(2, false, {true, true, tensor_path});
  // And the scoring is not the per-head one: the runs keep different tokens.
  CHECK(reference(false, {true, true, tensor_path}).latent != reference(false, {true, false, tensor_path}).latent);
}

TEST_CASE("2 ranks holding 2 heads and 1 (3 in all), pages scored by the heads' mean logit, on both paths: every rank "
          "recalls what one process with all heads recalls, the expanded layout's one-head rank included",
          "[tensor_parallel][agree][tier]") {
  const bool tensor_path = GENERATE(false, true);
  CAPTURE(tensor_path);
  check_agreement(2, false, {true, true, tensor_path, 3});
}

TEST_CASE("2 ranks, lazy_reduction, a host tier, recall every 3 steps (whole pages and two-level), on both paths: "
          "every rank keeps, tiers, recalls and outputs what one lazy process with all heads does",
          "[tensor_parallel][agree][tier]") {
  // Passes every 4 steps, recalls every 3: most recalls find observations pending, which they
  // apply (one collective) before picking victims.
  const bool tensor_path = GENERATE(false, true);
  CAPTURE(tensor_path);
  check_agreement(2, true, {true, false, tensor_path});
}

TEST_CASE("Without the reduction, ranks keep different tokens (the test can fail)", "[tensor_parallel][agree]") {
  const auto& ref = reference(false);
  const auto l = launch(2, "noreduce", false);
  REQUIRE(l.status[0] == 0);
  REQUIRE(l.status[1] == 0);
  CHECK(first_difference(l.ranks[0].expanded, ref.expanded) >= 0);
  CHECK(first_difference(l.ranks[0].expanded, l.ranks[1].expanded) >= 0);
  CHECK(l.ranks[0].latent_rows != l.ranks[1].latent_rows);  // the latent replicas diverge
  // So do the outputs of rank 0's heads, which check_agreement compares to fp32 rounding.
  REQUIRE(l.ranks[0].outputs.size() == 4);
  CHECK(first_output_difference(l.ranks[0], ref) >= 0);
}

TEST_CASE("A killed rank gives the others a clear error within the timeout", "[tensor_parallel][failure]") {
  SECTION("2 ranks, eager") { check_failure(2, "kill", false); }
  SECTION("2 ranks, lazy") { check_failure(2, "kill", true); }
  SECTION("4 ranks, eager") { check_failure(4, "kill", false); }
  SECTION("4 ranks, lazy") { check_failure(4, "kill", true); }
}

TEST_CASE("A hung rank gives the others a clear error within the timeout", "[tensor_parallel][failure]") {
  SECTION("2 ranks, eager") { check_failure(2, "hang", false); }
  SECTION("2 ranks, lazy") { check_failure(2, "hang", true); }
}

TEST_CASE("Mismatched configurations fail at construction on every rank", "[tensor_parallel][config]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"mismatch_budget", "capacity differs across ranks: 60 on rank 0, 61 on rank 1"},
      {"mismatch_batch", "batch_size differs across ranks: 2 on rank 0, 3 on rank 1"},
      {"mismatch_lazy", "lazy_reduction differs across ranks: 0 on rank 0, 1 on rank 1"},
  };
  for (const auto& [mode, message] : cases) {
    const auto l = launch(2, mode, false, kTimeoutMs, 5);
    for (int r = 0; r < 2; ++r) {
      INFO(mode << ", rank " << r << ": status " << l.status[r] << ": " << l.ranks[r].error);
      CHECK(l.status[r] == kRankError);
      CHECK(l.ranks[r].error_step == 0);  // before the first step
      CHECK_THAT(l.ranks[r].error, Catch::Contains(message));
    }
  }
}

TEST_CASE("Options and checks without a group", "[tensor_parallel][config]") {
  CHECK(kvevict::split_heads(128, 4, 1).begin == 32);
  CHECK(kvevict::split_heads(128, 4, 1).size() == 32);
  CHECK(kvevict::split_heads(10, 4, 0).size() == 3);
  CHECK(kvevict::split_heads(10, 4, 3).begin == 8);
  CHECK(kvevict::split_heads(10, 4, 3).size() == 2);
  CHECK_THROWS_WITH(kvevict::split_heads(2, 4, 0), Catch::Contains("world_size must be in [1, total_heads = 2], got 4"));
  // lazy_reduction is exact only for linear scorers.
  using Latest = kvevict::EvictionPolicy<kvevict::LatestAttention>;
  using Decayed = kvevict::EvictionPolicy<kvevict::DecayedAttention>;
  const auto opts = kvevict::EvictionPolicyOptions(1, 2).lazy_reduction(true);
  CHECK_THROWS_WITH(Latest(opts), Catch::Contains("lazy_reduction needs a linear scorer") &&
                                      Catch::Contains("got LatestAttention"));
  CHECK_THROWS_WITH(Decayed(opts), Catch::Contains("got DecayedAttention"));
  CHECK_NOTHROW(kvevict::EvictionPolicy<kvevict::MeanObservedAttention>(opts));
}

// kvevict_tp_tests [--long-or-skip] [catch args]: --long-or-skip exits 77 (ctest: Skipped)
// unless KVEVICT_LONG_TESTS=1.
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--tp-worker") == 0) return worker_main(parse(argc, argv));
  }
  if (argc > 1 && std::strcmp(argv[1], "--long-or-skip") == 0) {
    const char* on = std::getenv("KVEVICT_LONG_TESTS");
    if (on == nullptr || std::strcmp(on, "1") != 0) {
      std::printf("KVEVICT_LONG_TESTS is not 1: the long run is skipped\n");
      return 77;
    }
    argv[1] = argv[0];
    return Catch::Session().run(argc - 1, argv + 1);
  }
  return Catch::Session().run(argc, argv);
}
