#pragma once
// Shared by examples/tensor_parallel.cpp, tests/tensor_parallel/ and bench/kvevict_tp_bench.cpp:
// launching N ranks of the current executable on this machine (fork + exec, with a watchdog),
// and a random-init DeepSeek-V3-style MLA attention whose heads are split across the ranks.

#include <kvevict/attention.hpp>
#include <kvevict/mla_cache.hpp>
#include <kvevict/mla_latent_cache.hpp>
#include <kvevict/tensor_parallel.hpp>

#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <csignal>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

namespace tp_harness {

/// This executable's path (/proc/self/exe), to launch ranks of it.
inline std::string self_exe() {
  std::vector<char> buf(4096);
  const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) throw std::runtime_error("tp_harness: cannot read /proc/self/exe");
  return std::string(buf.data(), static_cast<size_t>(n));
}

/// A fresh directory under $TMPDIR (or /tmp) for a FileStore and the ranks' outputs.
inline std::string make_temp_dir(const char* prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw std::runtime_error("tp_harness: mkdtemp failed for " + templ);
  return buf.data();
}

/// How a rank process ended: its exit code, or -signal, or kWatchdog if the watchdog killed it.
constexpr int kWatchdog = -1000;

/// The body of one launched rank: a watchdog of `watchdog_s` seconds, one intra-op thread, the
/// group joined over a FileStore in `dir`, then `body(tp, out)` writes the rank's result line to
/// `dir`/rank<r>.txt. Exits the process (skipping the group's teardown: the peers may have left)
/// with 0, 2 if the result file cannot be opened, or 3 after writing "error <message>" when a
/// c10::Error escapes (a peer died or hung, a configuration mismatch).
template <class Body>
[[noreturn]] void rank_process(int rank, int world, const std::string& dir, int64_t total_heads,
                               std::chrono::milliseconds timeout, unsigned watchdog_s, Body&& body) {
  ::alarm(watchdog_s);
  at::set_num_threads(1);
  FILE* out = std::fopen((dir + "/rank" + std::to_string(rank) + ".txt").c_str(), "w");
  if (!out) std::_Exit(2);
  try {
    auto store = c10::make_intrusive<c10d::FileStore>(dir + "/store", world);
    const auto tp = kvevict::TensorParallel::connect(store, rank, world, total_heads, at::kCPU, timeout);
    body(tp, out);
    std::fclose(out);
    std::_Exit(0);
  } catch (const c10::Error& e) {
    std::fprintf(out, "error %s\n", e.what_without_backtrace());
    std::fclose(out);
    std::_Exit(3);
  }
}

/// Runs `world` copies of `exe` with `args` + {"--rank", r}, waits for all of them at most
/// `deadline`, then kills (SIGKILL) any still running. Returns each rank's end (see kWatchdog).
/// Never hangs: the wait is bounded by the deadline.
inline std::vector<int> launch_ranks(const std::string& exe, const std::vector<std::string>& args, int world,
                                     std::chrono::milliseconds deadline) {
  std::vector<pid_t> pids;
  std::vector<std::vector<std::string>> argv_s(world);
  for (int r = 0; r < world; ++r) {
    argv_s[r].push_back(exe);
    argv_s[r].insert(argv_s[r].end(), args.begin(), args.end());
    argv_s[r].push_back("--rank");
    argv_s[r].push_back(std::to_string(r));
  }
  for (int r = 0; r < world; ++r) {
    std::vector<char*> argv;
    for (auto& a : argv_s[r]) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    if (pid < 0) {
      for (const pid_t p : pids) ::kill(p, SIGKILL);
      throw std::runtime_error("tp_harness: fork failed");
    }
    pids.push_back(pid);
  }
  std::vector<int> status(world, kWatchdog);
  std::vector<bool> done(world, false);
  const auto until = std::chrono::steady_clock::now() + deadline;
  int left = world;
  while (left > 0 && std::chrono::steady_clock::now() < until) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
        status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? -WTERMSIG(st) : -999;
      }
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (int r = 0; r < world; ++r) {
    if (done[r]) continue;
    ::kill(pids[r], SIGKILL);
    ::waitpid(pids[r], nullptr, 0);
  }
  return status;
}

/// A small DeepSeek-V3-style MLA attention (DeepSeek-V2 paper, Sec. 2.1): per layer, a query
/// projection to H heads of qk_nope + qk_rope, a shared compressed KV (kv_lora_rank) and RoPE
/// key (qk_rope), and per-head up-projections W_UK, W_UV. Random-init from a seed, the same on
/// every rank; a rank uses the heads [begin, end) (column-parallel, as DeepSeek's wq_b and
/// wkv_b). Every per-head product is a batched matmul over heads, so a head's numbers do not
/// depend on how many heads a rank holds.
struct Dims {
  int64_t layers = 2, heads = 8, hidden = 64, qk_nope = 16, qk_rope = 8, v_dim = 16, kv_lora = 32, batch = 2;
  int64_t qk() const { return qk_nope + qk_rope; }
};

class Model {
 public:
  Model(const Dims& d, kvevict::HeadRange heads, uint64_t seed, int64_t max_positions)
      : d_(d), heads_(heads) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto o = at::TensorOptions().dtype(at::kFloat);
    auto w = [&](at::IntArrayRef shape, int64_t fan_in) {
      return at::randn(shape, gen, o).div(std::sqrt(static_cast<double>(fan_in)));
    };
    for (int64_t l = 0; l < d.layers; ++l) {
      Layer L;
      L.wq = w({d.heads, d.hidden, d.qk()}, d.hidden).narrow(0, heads.begin, heads.size()).contiguous();
      L.wkv_a = w({d.hidden, d.kv_lora + d.qk_rope}, d.hidden);
      L.w_uk = w({d.heads, d.kv_lora, d.qk_nope}, d.kv_lora).narrow(0, heads.begin, heads.size()).contiguous();
      L.w_uv = w({d.heads, d.kv_lora, d.v_dim}, d.kv_lora).narrow(0, heads.begin, heads.size()).contiguous();
      layers_.push_back(L);
    }
    const auto inv = at::pow(10000.0, at::arange(0, d.qk_rope, 2, o).div(static_cast<double>(d.qk_rope))).reciprocal();
    const auto f = at::outer(at::arange(max_positions, o), inv);
    cos_ = at::cat({f, f}, -1).cos();
    sin_ = at::cat({f, f}, -1).sin();
  }

  /// The new token's projections at `position` for layer l, from hidden x [B, hidden].
  struct Step {
    at::Tensor q;           // [B, Hl, 1, qk] (q_pe rotated)
    at::Tensor k, v;        // [B, Hl, 1, qk], [B, Hl, 1, v_dim] expanded keys / values
    at::Tensor ckv, kpe;    // [B, 1, kv_lora], [B, 1, qk_rope] latent rows
    at::Tensor q_absorbed;  // [B, Hl, 1, kv_lora] = q_nope W_UK^T
    at::Tensor q_pe;        // [B, Hl, 1, qk_rope]
  };
  Step project(int64_t l, const at::Tensor& x, int64_t position) const {
    const auto& L = layers_[l];
    const int64_t B = x.size(0), Hl = heads_.size();
    const auto q = at::matmul(x.view({B, 1, 1, d_.hidden}), L.wq);  // [B, Hl, 1, qk]
    const auto q_nope = q.narrow(-1, 0, d_.qk_nope);
    const auto q_pe = rope(q.narrow(-1, d_.qk_nope, d_.qk_rope), position);
    const auto kv_a = at::matmul(x, L.wkv_a);  // [B, kv_lora + rope]
    const auto ckv = kv_a.narrow(-1, 0, d_.kv_lora);
    const auto kpe = rope(kv_a.narrow(-1, d_.kv_lora, d_.qk_rope), position);  // [B, rope]
    Step s;
    s.ckv = ckv.unsqueeze(1).contiguous();
    s.kpe = kpe.unsqueeze(1).contiguous();
    const auto c4 = ckv.view({B, 1, 1, d_.kv_lora});
    const auto k_nope = at::matmul(c4, L.w_uk);  // [B, Hl, 1, nope]
    s.k = at::cat({k_nope, kpe.view({B, 1, 1, d_.qk_rope}).expand({B, Hl, 1, d_.qk_rope})}, -1).contiguous();
    s.v = at::matmul(c4, L.w_uv).contiguous();
    s.q = at::cat({q_nope, q_pe}, -1).contiguous();
    s.q_absorbed = at::matmul(q_nope, L.w_uk.transpose(-1, -2)).contiguous();  // [B, Hl, 1, kv_lora]
    s.q_pe = q_pe.contiguous();
    return s;
  }

  /// The hidden state of the token at `position` in layer l: random, the same on every rank.
  at::Tensor hidden(int64_t l, int64_t position, uint64_t seed) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003u + static_cast<uint64_t>(position * 131 + l));
    return at::randn({d_.batch, d_.hidden}, gen, at::TensorOptions().dtype(at::kFloat)).mul(2.0);
  }

 private:
  at::Tensor rope(const at::Tensor& x, int64_t position) const {
    const int64_t h = d_.qk_rope / 2;
    const auto rot = at::cat({x.narrow(-1, h, h).neg(), x.narrow(-1, 0, h)}, -1);
    return x.mul(cos_[position]).add(rot.mul(sin_[position]));
  }
  struct Layer {
    at::Tensor wq, wkv_a, w_uk, w_uv;
  };
  Dims d_;
  kvevict::HeadRange heads_;
  std::vector<Layer> layers_;
  at::Tensor cos_, sin_;
};

/// FNV-1a over bytes, chained.
inline uint64_t fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* c = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  return h;
}

/// Digest of the kept positions of every layer and row (each row's positions sorted).
template <class Cache>
uint64_t positions_digest(const Cache& cache, uint64_t h = 1469598103934665603ull) {
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    const auto pos = std::get<0>(at::sort(cache.positions(l).to(at::kCPU), 1)).contiguous();
    h = fnv(pos.template data_ptr<int64_t>(), static_cast<size_t>(pos.numel()) * sizeof(int64_t), h);
  }
  return h;
}

/// Digest of the latent rows (ckv, kpe) of every layer in slot order, bit for bit.
template <class Cache>
uint64_t latent_digest(const Cache& cache) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    for (const auto& t : {cache.ckv(l), cache.kpe(l)}) {
      const auto c = t.to(at::kCPU).contiguous();
      h = fnv(c.data_ptr(), static_cast<size_t>(c.nbytes()), h);
    }
  }
  return h;
}

/// The exit code of a rank that hung (RunOptions::hang_at) and woke up.
constexpr int kHungExit = 4;

/// One run of the model: `steps` decode steps (one token per row and step, positions 0, 1,
/// ...) through an expanded cache (MlaCache, attend) and a latent cache (MlaLatentCache,
/// attend_absorbed), observe and evict in every layer.
struct RunOptions {
  Dims dims;
  int64_t steps = 1000;
  kvevict::EvictionOptions eviction = kvevict::EvictionOptions(48).n_sink(4).n_recent(8).evict_every(4);
  bool lazy = false;     // lazy_reduction
  bool reduce = true;    // false: each rank ranks by its own heads (what tensor parallelism must avoid)
  uint64_t seed = 7;
  int64_t kill_at = -1;  // this rank kills itself (SIGKILL) at the start of that step
  int64_t hang_at = -1;  // this rank stops (sleeps) at the start of that step ...
  std::chrono::milliseconds hang_for{3600000};  // ... for this long, then exits with kHungExit
  int64_t recall_every = 0;  // > 0: a host tier of 1,000 tokens (pages of 4), and every this many
                             // steps each layer recalls before its attention: whole pages, up to
                             // 8 tokens, and every other time two-level, 3 of a pool of 16
  kvevict::TierScoring scoring = kvevict::TierScoring::kPerHead;  // how the recalls score the pages
};

struct RunResult {
  std::vector<uint64_t> expanded, latent;  // per step: digest of the kept positions
  uint64_t latent_rows = 0;                // digest of the final latent rows (ckv, kpe)
  int64_t tokens_evicted = 0;              // expanded cache, all layers
  int64_t recalled = 0;                    // tokens recalled, both caches, all layers
  /// With a tier: digests of both caches' final tiers, every layer and row: {expanded
  /// positions, expanded ranks, latent positions, latent ranks, latent rows} (the expanded
  /// tier's rows are per head); else empty. The ranks are the same bits on every rank; against
  /// one process with all heads they agree to fp32 rounding (see tier_rank_sums), since the
  /// latent attention folds the heads into the rows of one product, whose rounding can depend
  /// on how many heads a process holds.
  std::vector<uint64_t> tier;
  std::vector<double> tier_rank_sums;  // {expanded, latent}: the tiers' ranks summed in fp64
  /// Per head this run held (heads [head_begin, head_begin + outputs.size())) and step: a
  /// checksum of its attention outputs over layers, rows and both layouts (attend,
  /// attend_absorbed), sum(out x w) for fixed weights w, then sum(|out|), in fp64. A head's
  /// outputs equal across head splits up to fp32 rounding (the products batch the heads).
  int64_t head_begin = 0;
  std::vector<std::vector<double>> outputs;
};

/// Digests of the host tiers of every layer and row, appended to `out`: positions, ranks, and
/// with `rows` the tier's rows (the latent layout's, the same on every rank); the ranks' fp64
/// sum appended to `rank_sums`.
template <class Cache>
void tier_digests(const Cache& cache, bool rows, std::vector<uint64_t>& out, std::vector<double>& rank_sums) {
  uint64_t pos = 1469598103934665603ull, rank = pos, data = pos;
  double rank_sum = 0;
  auto add = [](const at::Tensor& t, uint64_t& h) {
    const auto c = t.to(at::kCPU).contiguous();
    h = fnv(c.data_ptr(), static_cast<size_t>(c.nbytes()), h);
  };
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    for (int64_t b = 0; b < cache.batch_size(); ++b) {
      add(cache.tier_positions(l, b), pos);
      add(cache.tier_scores(l, b), rank);
      rank_sum += cache.tier_scores(l, b).to(at::kDouble).sum().template item<double>();
      if (rows) {
        const auto r = cache.tier_rows(l, b);
        add(r.first, data);
        add(r.second, data);
      }
    }
  }
  out.push_back(pos);
  out.push_back(rank);
  if (rows) out.push_back(data);
  rank_sums.push_back(rank_sum);
}

/// Adds each head's checksums of `out` [B, H, T, D] to the last entries of sums[h]:
/// sum(out x w), w = cos(index within the head), and sum(|out|), in fp64.
inline void checksum_heads(const at::Tensor& out, std::vector<std::vector<double>>& sums) {
  const auto c = out.to(at::kCPU).to(at::kDouble).transpose(0, 1).contiguous().view({out.size(1), -1});  // [H, n]
  const auto w = at::arange(c.size(1), c.options()).cos();
  const auto dot = c.mul(w).sum(1), abs = c.abs().sum(1);
  for (int64_t h = 0; h < c.size(0); ++h) {
    auto& v = sums[static_cast<size_t>(h)];
    v[v.size() - 2] += dot[h].item<double>();
    v[v.size() - 1] += abs[h].item<double>();
  }
}

/// Runs `o` on this rank's heads (`tp`), or on all heads in one process when `tp` is null.
/// `out` holds what was done so far if it throws; `step_start` is set at the start of each step.
inline void run(const RunOptions& o, const kvevict::TensorParallel* tp, RunResult& out,
                std::chrono::steady_clock::time_point* step_start = nullptr) {
  const auto& d = o.dims;
  const auto heads = tp ? tp->heads() : kvevict::HeadRange{0, d.heads};
  Model model(d, heads, o.seed, o.steps + 1);
  auto eopts = kvevict::MlaCacheOptions(d.layers, d.heads).batch_size(d.batch).qk_dim(d.qk()).v_dim(d.v_dim);
  auto lopts = kvevict::MlaLatentCacheOptions(d.layers, d.heads)
                   .batch_size(d.batch)
                   .kv_lora_rank(d.kv_lora)
                   .qk_rope_dim(d.qk_rope)
                   .qk_nope_dim(d.qk_nope);
  if (o.recall_every > 0) {
    eopts.tier_tokens(1000).tier_page_size(4).tier_scoring(o.scoring);
    lopts.tier_tokens(1000).tier_page_size(4).tier_scoring(o.scoring);
  }
  auto build = [&](auto opts, auto* tag) {
    using Cache = std::remove_pointer_t<decltype(tag)>;
    if (tp && o.reduce) return tp->template make<Cache>(opts, o.eviction, o.lazy);
    opts.num_heads(heads.size()).lazy_reduction(o.lazy);
    return Cache(opts, o.eviction);
  };
  auto expanded = build(eopts, static_cast<kvevict::MlaCache*>(nullptr));
  auto latent = build(lopts, static_cast<kvevict::MlaLatentCache*>(nullptr));
  out.head_begin = heads.begin;
  out.outputs.assign(static_cast<size_t>(heads.size()), {});
  for (int64_t t = 0; t < o.steps; ++t) {
    if (step_start) *step_start = std::chrono::steady_clock::now();
    if (t == o.kill_at) std::raise(SIGKILL);
    if (t == o.hang_at) {
      std::this_thread::sleep_for(o.hang_for);
      std::_Exit(kHungExit);
    }
    for (auto& v : out.outputs) v.insert(v.end(), {0.0, 0.0});
    for (int64_t l = 0; l < d.layers; ++l) {
      const auto s = model.project(l, model.hidden(l, t, o.seed), t);
      const bool recall = o.recall_every > 0 && t % o.recall_every == 0;
      const bool two_level = (t / std::max<int64_t>(1, o.recall_every)) % 2 == 1;
      const int64_t tokens = two_level ? 3 : 8, rescore = two_level ? 16 : 0;
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.qk()));
      expanded.update(l, s.k, s.v);
      if (recall) out.recalled += expanded.recall(l, s.q, scale, tokens, rescore).sum().item<int64_t>();
      checksum_heads(kvevict::attend(s.q, expanded, l), out.outputs);
      out.tokens_evicted += expanded.evict(l);
      latent.update(l, s.ckv, s.kpe);
      if (recall) out.recalled += latent.recall_absorbed(l, s.q_absorbed, s.q_pe, scale, tokens, rescore).sum().item<int64_t>();
      checksum_heads(kvevict::attend_absorbed(s.q_absorbed, s.q_pe, latent, l), out.outputs);
      latent.evict(l);
    }
    out.expanded.push_back(positions_digest(expanded));
    out.latent.push_back(positions_digest(latent));
  }
  out.latent_rows = latent_digest(latent);
  if (o.recall_every > 0) {
    tier_digests(expanded, false, out.tier, out.tier_rank_sums);
    tier_digests(latent, true, out.tier, out.tier_rank_sums);
  }
}

}  // namespace tp_harness
