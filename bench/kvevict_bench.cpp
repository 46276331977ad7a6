// kvevict_bench: what eviction costs per layer and decode step, next to the attention it serves
// and to the naive gather, measured side by side in one run (DESIGN.md, "Performance
// principles"; issue 4). A timing CLI of our own (std::chrono, printf): it builds wherever
// LibTorch does, offline GPU machines included.
//
// Per configuration (layout, heads, dims, dtype, device, capacity, batch) one layer is filled
// to capacity; from then on every decode step appends one token, observes [B, H, 1, S]
// probabilities and evicts one token (the steady state). Per step, each the median over --reps
// repetitions after a warm-up:
//   update+evict  cache.update + cache.evict: the bookkeeping without the probabilities
//   observe       cache.observe of fp32 probabilities [B, H, 1, capacity + 1]
//   u+o+e         update + observe + evict: the whole bookkeeping of a step
//   attend        kvevict::attend (expanded) or attend_absorbed (latent) over capacity + 1 slots
//                 (its observe included): the attention decode step the bookkeeping serves
//   u+o+e graph   (CUDA only) one replay of a CUDA graph of update + observe + evict, captured
//                 on a second cache with observation checks off: the step without launch overhead
//   naive         the same bookkeeping done by gathering (as bench/gather_baseline.py, in
//                 LibTorch): cat the new token onto every buffer and a 0 onto the scores, add
//                 the head-mean probabilities, top-k the middle, gather the kept rows into new
//                 tensors
// and the ratios ue/attend, uoe/attend, naive/attend, naive/ue.
//
// A layout is a small traits struct (Expanded, Latent below): its cache type, the shapes of
// one token's rows, the queries and the attention call. Everything else is layout-generic.
#include "cli.hpp"
#include "op_counter.hpp"  // tests/

#include <kvevict/kvevict.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

// CUDA graphs need the CUDA headers and libtorch_cuda: bench/CMakeLists.txt says whether this
// LibTorch has them (from TORCH_CUDA_LIBRARIES); otherwise guess from the headers.
#ifndef KVEVICT_CUDA_GRAPHS
#if __has_include(<ATen/cuda/CUDAGraph.h>) && __has_include(<cuda_runtime_api.h>)
#define KVEVICT_CUDA_GRAPHS 1
#else
#define KVEVICT_CUDA_GRAPHS 0
#endif
#endif
#if KVEVICT_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

constexpr int kExitUsage = 2;

// ---------------------------------------------------------------------------------------------
// Command line

struct Args {
  std::vector<std::string> layouts{"expanded"};
  std::vector<int64_t> heads{64};
  int64_t qk_dim = 192, v_dim = 128;              // expanded
  int64_t kv_lora_rank = 512, qk_rope_dim = 64;   // latent
  std::vector<std::string> dtypes{"fp32"};
  std::string device = "cpu";
  std::vector<int64_t> capacities{1024, 4612, 16384};
  std::vector<int64_t> batches{1};
  int64_t n_sink = 4, n_recent = 16;
  int64_t threads = 1;
  bool check_observations = true;
  int64_t reps = 5;
  double min_time = 0.2;  // seconds per repetition, when --iters is not given
  int64_t iters = 0;      // steps per repetition; 0: from --min-time
  bool naive = true;
  bool tensor_path = false;  // CPU: time the tensor-op path CUDA takes instead of the host loops
  int64_t evict_every = 1;   // timing: passes every N steps
  bool recall = false;       // timing: also a step with a host tier and a recall every step
  bool reference = false;    // the tier's ATen reference forms instead of its compiled kernels
  bool count_ops = false;    // count the ATen ops of the decode loops instead of timing
  bool list_ops = false;     // with count_ops: also print every counted op
  std::string out_csv, out_json;
};

constexpr const char* kUsage = R"(Usage: kvevict_bench [options]

Times the eviction bookkeeping of one layer per decode step (update+evict, observe, all three),
the attention decode step over the same cache, and the naive gather, side by side. One line per
configuration; LIST options take comma-separated values and run every combination.

Options (default in brackets):
  --layout LIST        expanded (MlaCache) or latent (MlaLatentCache) [expanded]
  --heads LIST         attention heads [64]
  --qk-dim N           expanded key width per head [192]
  --v-dim N            expanded value width per head [128]
  --kv-lora-rank N     latent ckv width [512]
  --qk-rope-dim N      latent kpe width [64]
  --dtype LIST         fp32, fp16, bf16 [fp32]
  --device D           an at::Device: cpu, cpu:0, cuda or cuda:N [cpu]
  --capacity LIST      tokens per row after a pass (n_sink + budget + n_recent) [1024,4612,16384]
  --batch LIST         batch rows [1]
  --n-sink N           sinks [4]
  --n-recent N         recent window [16]
  --threads N          intra-op threads (at::set_num_threads) [1]
  --check-observations B  on or off: the cache's observation checks [on]
  --reps N             repetitions; the median is reported [5]
  --min-time SEC       seconds per repetition, > 0 (sets the steps per repetition) [0.2]
  --iters N            steps per repetition (overrides --min-time) [from --min-time]
  --no-naive           skip the naive gather (it needs 3x the cache's memory); its columns print '-'
  --evict-every N      timing: a pass every N steps (EvictionOptions::evict_every) [1]
  --recall             timing: also time update + observe + evict with a recall before each
                       step ("u+o+e+recall"), on a cache with a host tier of 4 x capacity tokens
                       per row, filled first, and kvevict.hf's default recall (3 tokens, a pool
                       of 256, pages of 64 scored by the heads' mean)
  --reference          the tier's ops in their ATen reference forms, not the compiled kernels
                       (kvevict::kernels) this build links: for side-by-side runs
  --tensor-path        on CPU, time the tensor-op path (the one CUDA takes) instead of the
                       host loops
  --count-ops          instead of timing: count what the decode loops (a)-(g) ask of LibTorch per
                       step and layer on the tensor path (the path CUDA takes, run on CPU): kernels,
                       views, host<->device copies, syncs, allocations, split into update / observe
                       / evict, amortized over one evict_every window holding one pass. (a) cache +
                       attention (apart, observe=false), evict_every 1; (b) the same at 16; (c)
                       LseRing at 16; (d) observe_lse(_absorbed) every step, evict_every 1; (e) a
                       ragged batch of 8, evict_every 1 and 16; (f) EvictionPolicy + write_rows +
                       apply_moves on a buffer of one's own, evict_every 1; (g) (b) with a host
                       tier and a recall every step, with the compiled kernels and beside it
                       with the reference forms. Per layout,
                       heads, dtype and capacity; docs/performance.md: --layout latent --heads 128
                       --dtype bf16 --capacity 4612 --check-observations off
  --list-ops           with --count-ops: also print every counted op of each window (part, name,
                       kind, input shapes, int arguments)
  --out-csv PATH       also write the results as CSV
  --out-json PATH      also write the results as JSON
  --help               print this and exit
)";

using kvevict_cli::parse_choice;
using kvevict_cli::parse_choice_list;
using kvevict_cli::parse_int;
using kvevict_cli::parse_int_list;
using kvevict_cli::UsageError;

/// Parses argv (`--flag value` or `--flag=value`); returns false for --help.
bool parse_args(int argc, char** argv, Args& a) {
  const auto writable = [](std::string& path) {
    return [&path](const std::string& f, const std::string& v) {
      kvevict_cli::check_writable(f, v);  // before the run, not after it
      path = v;
    };
  };
  const bool run = kvevict_cli::parse_flags(
      argc, argv,
      {
          {"--layout", [&](auto& f, auto& v) { a.layouts = parse_choice_list(f, v, {"expanded", "latent"}); }},
          {"--heads", [&](auto& f, auto& v) { a.heads = parse_int_list(f, v, 1); }},
          {"--qk-dim", [&](auto& f, auto& v) { a.qk_dim = parse_int(f, v, 1); }},
          {"--v-dim", [&](auto& f, auto& v) { a.v_dim = parse_int(f, v, 1); }},
          {"--kv-lora-rank", [&](auto& f, auto& v) { a.kv_lora_rank = parse_int(f, v, 1); }},
          {"--qk-rope-dim", [&](auto& f, auto& v) { a.qk_rope_dim = parse_int(f, v, 1); }},
          {"--dtype", [&](auto& f, auto& v) { a.dtypes = parse_choice_list(f, v, {"fp32", "fp16", "bf16"}); }},
          {"--device", [&](auto&, auto& v) { a.device = v; }},  // checked in kvevict_cli::make_device()
          {"--capacity", [&](auto& f, auto& v) { a.capacities = parse_int_list(f, v, 1); }},
          {"--batch", [&](auto& f, auto& v) { a.batches = parse_int_list(f, v, 1); }},
          {"--n-sink", [&](auto& f, auto& v) { a.n_sink = parse_int(f, v, 0); }},
          {"--n-recent", [&](auto& f, auto& v) { a.n_recent = parse_int(f, v, 0); }},
          {"--threads", [&](auto& f, auto& v) { a.threads = parse_int(f, v, 1); }},
          {"--check-observations",
           [&](auto& f, auto& v) { a.check_observations = parse_choice(f, v, {"on", "off"}) == "on"; }},
          {"--reps", [&](auto& f, auto& v) { a.reps = parse_int(f, v, 1); }},
          {"--iters", [&](auto& f, auto& v) { a.iters = parse_int(f, v, 1); }},
          {"--min-time", [&](auto& f, auto& v) { a.min_time = kvevict_cli::parse_seconds(f, v); }},
          {"--evict-every", [&](auto& f, auto& v) { a.evict_every = parse_int(f, v, 1); }},
          {"--out-csv", writable(a.out_csv)},
          {"--out-json", writable(a.out_json)},
      },
      {
          {"--no-naive", [&] { a.naive = false; }},
          {"--tensor-path", [&] { a.tensor_path = true; }},
          {"--count-ops", [&] { a.count_ops = true; }},
          {"--list-ops", [&] { a.list_ops = true; }},
          {"--recall", [&] { a.recall = true; }},
          {"--reference", [&] { a.reference = true; }},
      });
  if (!run) return false;
  if (a.list_ops && !a.count_ops) throw UsageError("--list-ops needs --count-ops");
  if (a.count_ops && (a.recall || a.evict_every != 1)) {
    throw UsageError("--count-ops sets its own evict_every and recall loops (a)-(g): drop --evict-every and --recall");
  }
  if (a.count_ops && a.batches != std::vector<int64_t>{1}) {
    throw UsageError("--count-ops sets its own batches (1, and a ragged batch of 8): drop --batch");
  }
  for (auto cap : a.capacities) {
    if (cap < a.n_sink + a.n_recent) {
      throw UsageError("--capacity " + std::to_string(cap) + " is below n_sink + n_recent = " +
                       std::to_string(a.n_sink + a.n_recent));
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Layouts: what differs between the expanded and the latent cache

/// One benchmark configuration.
struct Config {
  std::string layout, dtype_name;
  int64_t heads, batch, capacity;
  at::ScalarType dtype;
  at::Device device{at::kCPU};
};

/// The expanded layout: MlaCache, keys [B, H, S, qk_dim] and values [B, H, S, v_dim];
/// attention is kvevict::attend.
struct Expanded {
  using Cache = kvevict::MlaCache;
  static constexpr int64_t kTokenDim = 2;  // of every buffer

  /// `tier_tokens` > 0: with a host tier (pages of 64 tokens, scored by the heads' mean).
  static std::unique_ptr<Cache> make_cache(const Config& c, const Args& a, const kvevict::EvictionOptions& e,
                                           int64_t tier_tokens = 0) {
    return std::make_unique<Cache>(kvevict::MlaCacheOptions(1, c.heads)
                                       .batch_size(c.batch)
                                       .qk_dim(a.qk_dim)
                                       .v_dim(a.v_dim)
                                       .dtype(c.dtype)
                                       .device(c.device)
                                       .check_observations(a.check_observations)
                                       .tier_tokens(tier_tokens)
                                       .tier_page_size(64)
                                       .tier_scoring(kvevict::TierScoring::kHeadMean),
                                   e);
  }
  /// Brings back up to `tokens` tier tokens for one step's queries (two-level: a pool of `rescore`).
  static at::Tensor recall(Cache& cache, const std::vector<at::Tensor>& q, double scale, int64_t tokens, int64_t rescore) {
    return cache.recall(0, q[0], scale, tokens, rescore);
  }
  /// Shapes of T tokens' rows as update() takes them: {k_new, v_new}.
  static std::vector<std::vector<int64_t>> row_shapes(const Config& c, const Args& a, int64_t T) {
    return {{c.batch, c.heads, T, a.qk_dim}, {c.batch, c.heads, T, a.v_dim}};
  }
  /// Shapes of one step's queries: {q [B, H, 1, qk_dim]}.
  static std::vector<std::vector<int64_t>> query_shapes(const Config& c, const Args& a) {
    return {{c.batch, c.heads, 1, a.qk_dim}};
  }
  static at::Tensor attend(Cache& cache, const std::vector<at::Tensor>& q) { return kvevict::attend(q[0], cache, 0); }
  /// Copies of the buffers in position order, as update() takes them.
  static std::vector<at::Tensor> ordered(const Cache& cache) {
    auto o = cache.ordered(0);
    return {o.keys, o.values};
  }
  static std::string dims(const Args& a) {
    return "qk=" + std::to_string(a.qk_dim) + " v=" + std::to_string(a.v_dim);
  }
};

/// The latent layout: MlaLatentCache, ckv [B, S, kv_lora_rank] and kpe [B, S, qk_rope_dim]
/// shared by the heads; attention is kvevict::attend_absorbed.
struct Latent {
  using Cache = kvevict::MlaLatentCache;
  static constexpr int64_t kTokenDim = 1;

  static std::unique_ptr<Cache> make_cache(const Config& c, const Args& a, const kvevict::EvictionOptions& e,
                                           int64_t tier_tokens = 0) {
    return std::make_unique<Cache>(kvevict::MlaLatentCacheOptions(1, c.heads)
                                       .batch_size(c.batch)
                                       .kv_lora_rank(a.kv_lora_rank)
                                       .qk_rope_dim(a.qk_rope_dim)
                                       .dtype(c.dtype)
                                       .device(c.device)
                                       .check_observations(a.check_observations)
                                       .tier_tokens(tier_tokens)
                                       .tier_page_size(64)
                                       .tier_scoring(kvevict::TierScoring::kHeadMean),
                                   e);
  }
  static at::Tensor recall(Cache& cache, const std::vector<at::Tensor>& q, double scale, int64_t tokens, int64_t rescore) {
    return cache.recall_absorbed(0, q[0], q[1], scale, tokens, rescore);
  }
  /// {ckv_new [B, T, kv_lora_rank], kpe_new [B, T, qk_rope_dim]}.
  static std::vector<std::vector<int64_t>> row_shapes(const Config& c, const Args& a, int64_t T) {
    return {{c.batch, T, a.kv_lora_rank}, {c.batch, T, a.qk_rope_dim}};
  }
  /// {q_absorbed [B, H, 1, kv_lora_rank], q_pe [B, H, 1, qk_rope_dim]}.
  static std::vector<std::vector<int64_t>> query_shapes(const Config& c, const Args& a) {
    return {{c.batch, c.heads, 1, a.kv_lora_rank}, {c.batch, c.heads, 1, a.qk_rope_dim}};
  }
  static at::Tensor attend(Cache& cache, const std::vector<at::Tensor>& q) {
    return kvevict::attend_absorbed(q[0], q[1], cache, 0);
  }
  static std::vector<at::Tensor> ordered(const Cache& cache) {
    auto o = cache.ordered(0);
    return {o.ckv, o.kpe};
  }
  static std::string dims(const Args& a) {
    return "ckv=" + std::to_string(a.kv_lora_rank) + " kpe=" + std::to_string(a.qk_rope_dim);
  }
};

// ---------------------------------------------------------------------------------------------
// The naive baseline

/// The gather-per-step eviction (bench/gather_baseline.py) in LibTorch: buffers in position order,
/// a new tensor per buffer per step.
class NaiveCache {
 public:
  /// `buffers`: per buffer [B, ..., S, width] in position order, token dim `token_dim`.
  NaiveCache(std::vector<at::Tensor> buffers, int64_t token_dim, const kvevict::EvictionOptions& e)
      : buffers_(std::move(buffers)), token_dim_(token_dim), e_(e) {
    const int64_t B = buffers_[0].size(0), S = buffers_[0].size(token_dim);
    score_ = at::rand({B, S}, buffers_[0].options().dtype(at::kFloat));
  }

  /// Tokens held per row (S).
  int64_t size() const { return score_.size(1); }

  /// One decode step, a pass at every one: rows as the cache's update() takes them, probs
  /// [B, H, 1, S + 1].
  void step(const std::vector<at::Tensor>& rows, const at::Tensor& probs) {
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i] = at::cat({buffers_[i], rows[i]}, token_dim_);
    const int64_t B = score_.size(0), S = buffers_[0].size(token_dim_);
    score_ = at::cat({score_, at::zeros({B, 1}, score_.options())}, 1).add(probs.sum(2).mean(1));
    if (S <= e_.capacity()) return;
    const auto lopts = score_.options().dtype(at::kLong);
    const auto middle = score_.narrow(1, e_.n_sink(), S - e_.n_sink() - e_.n_recent());
    const auto top = std::get<1>(at::topk(middle, e_.budget(), -1)).add(e_.n_sink());
    auto keep = at::cat({at::arange(e_.n_sink(), lopts).expand({B, e_.n_sink()}), top,
                         at::arange(S - e_.n_recent(), S, lopts).expand({B, e_.n_recent()})},
                        1);
    keep = std::get<0>(at::sort(keep, 1));  // [B, capacity]
    for (auto& buffer : buffers_) {
      std::vector<int64_t> shape(buffer.dim(), 1);
      shape[0] = B;
      shape[token_dim_] = keep.size(1);
      auto sizes = buffer.sizes().vec();
      sizes[token_dim_] = keep.size(1);
      buffer = buffer.gather(token_dim_, keep.view(shape).expand(sizes));
    }
    score_ = score_.gather(1, keep);
  }

 private:
  std::vector<at::Tensor> buffers_;
  at::Tensor score_;  // [B, S] fp32
  int64_t token_dim_;
  kvevict::EvictionOptions e_;
};

// ---------------------------------------------------------------------------------------------
// Timing

using Clock = std::chrono::steady_clock;

/// Waits for the device (CUDA: a 1-element copy to the host); a no-op on CPU.
struct DeviceSync {
  at::Tensor probe;  // [1] on the device
  bool cuda;
  explicit DeviceSync(const at::Device& d) : probe(at::zeros({1}, at::TensorOptions().device(d))), cuda(d.is_cuda()) {}
  void operator()() const {
    if (cuda) (void)probe.item<float>();
  }
};

/// Seconds for `n` calls of body(i), the device waited for before and after.
template <class Body>
double time_loop(int64_t n, Body& body, const DeviceSync& sync) {
  sync();
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < n; ++i) body(i);
  sync();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// Microseconds per call of body(i): warm-up and calibration (calls until --min-time/4 passes,
/// growing x4), then --reps repetitions of n calls; the median repetition.
template <class Body>
double measure(Body body, const Args& a, const DeviceSync& sync) {
  int64_t n = a.iters;
  if (n == 0) {
    n = 1;
    double t = time_loop(1, body, sync);  // first call: warm-up
    while (true) {
      t = time_loop(n, body, sync);
      if (t >= a.min_time / 4 || n >= (int64_t{1} << 24)) break;
      n *= 4;
    }
    n = std::max<int64_t>(3, static_cast<int64_t>(std::ceil(n * a.min_time / std::max(t, 1e-9))));
  } else {
    time_loop(std::max<int64_t>(1, n / 10), body, sync);  // warm-up
  }
  std::vector<double> us;
  for (int64_t r = 0; r < a.reps; ++r) us.push_back(1e6 * time_loop(n, body, sync) / static_cast<double>(n));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

struct Result {
  Config config;
  std::string dims;
  double update_evict = 0, observe = 0, uoe = 0, attend = 0, naive = NAN, uoe_graph = NAN;  // us per step
  double uoe_recall = NAN;  // us per step: update + observe + evict with a recall (--recall)
  int64_t bytes_held = 0;
};

/// Random tensor of `dtype` (fp16/bf16 drawn in fp32: not every LibTorch samples them on CPU).
at::Tensor random(const std::vector<int64_t>& shape, at::ScalarType dtype, const at::Device& device) {
  return at::randn(shape, at::TensorOptions().device(device)).to(dtype);
}

/// Fills layer 0 of `cache` to capacity in chunks of one random block (values do not matter for
/// the timing), then observes random probabilities once so the scores are not all 0.
template <class Layout>
void fill_to_capacity(typename Layout::Cache& cache, const Config& c, const Args& a) {
  const int64_t chunk = std::min<int64_t>(c.capacity, 256);
  std::vector<at::Tensor> block;
  for (const auto& shape : Layout::row_shapes(c, a, chunk)) block.push_back(random(shape, c.dtype, c.device));
  for (int64_t filled = 0; filled < c.capacity; filled += chunk) {
    const int64_t t = std::min(chunk, c.capacity - filled);
    cache.update(0, block[0].narrow(Layout::kTokenDim, 0, t), block[1].narrow(Layout::kTokenDim, 0, t));
  }
  cache.observe(0, at::softmax(at::randn({c.batch, c.heads, 1, c.capacity}, at::TensorOptions().device(c.device)), -1));
}

/// One steady-state step: update + observe + evict of layer 0.
template <class Cache>
void bookkeeping_step(Cache& cache, const std::vector<at::Tensor>& row, const at::Tensor& probs) {
  cache.update(0, row[0], row[1]);
  cache.observe(0, probs);
  cache.evict(0);
}

#if KVEVICT_CUDA_GRAPHS
/// Microseconds per step of a CUDA graph of one evict_every window of steady-state steps (one
/// step at evict_every 1), on a second cache built with observation checks off (a capture
/// cannot wait for the host): a replay's time over the window's steps. The replay reads `row`
/// and `probs` (narrowed to each step's tokens: views) where they are; it shows the steps' GPU
/// time without the per-op launch cost.
template <class Layout>
double graph_step_us(const Config& c, Args a, const kvevict::EvictionOptions& e, const std::vector<at::Tensor>& row,
                     const at::Tensor& probs, const DeviceSync& sync) {
  a.check_observations = false;
  auto cache = Layout::make_cache(c, a, e);
  fill_to_capacity<Layout>(*cache, c, a);
  cache->reserve(c.capacity + e.evict_every());
  const auto window = [&] {
    for (int64_t j = 0; j < e.evict_every(); ++j) bookkeeping_step(*cache, row, probs.narrow(3, 0, cache->size(0) + 1));
  };
  at::cuda::CUDAGraph graph;
  auto stream = c10::cuda::getStreamFromPool();
  {
    c10::cuda::CUDAStreamGuard guard(stream);  // capture is illegal on the default stream
    for (int i = 0; i < 3; ++i) window();      // warm-up on the capture stream
    graph.capture_begin();
    window();
    graph.capture_end();
  }
  stream.synchronize();
  return measure([&](int64_t) { graph.replay(); }, a, sync) / static_cast<double>(e.evict_every());
}
#endif

/// Microseconds per step of update + observe + evict with a recall before it (kvevict.hf's
/// default: 3 tokens, a pool of 256, pages of 64 by the heads' mean), on a cache whose host
/// tier (4 x capacity tokens per row) earlier passes filled. Eager: a step with a tier is not
/// replayable as a CUDA graph.
template <class Layout>
double recall_step_us(const Config& c, const Args& a, const kvevict::EvictionOptions& e,
                      const std::vector<std::vector<at::Tensor>>& rows, const std::vector<at::Tensor>& probs,
                      const std::vector<at::Tensor>& queries, const DeviceSync& sync) {
  const int64_t tier = 4 * c.capacity;
  auto cache = Layout::make_cache(c, a, e, tier);
  const int64_t chunk = std::min<int64_t>(c.capacity, 256);
  std::vector<at::Tensor> block;
  for (const auto& shape : Layout::row_shapes(c, a, chunk)) block.push_back(random(shape, c.dtype, c.device));
  for (int64_t filled = 0; filled < c.capacity + tier; filled += chunk) {  // the passes fill the tier
    cache->update(0, block[0], block[1]);
    cache->observe(0, at::softmax(at::randn({c.batch, c.heads, 1, cache->size(0)}, at::TensorOptions().device(c.device)), -1));
    cache->evict_now(0);
  }
  const int64_t kPool = static_cast<int64_t>(rows.size());
  return measure(
      [&](int64_t i) {
        Layout::recall(*cache, queries, 0.1, 3, 256);
        bookkeeping_step(*cache, rows[i % kPool], probs[i % kPool].narrow(3, 0, cache->size(0) + 1));
      },
      a, sync);
}

template <class Layout>
Result run_config(const Config& c, const Args& a) {
  const auto e = kvevict::EvictionOptions(c.capacity - a.n_sink - a.n_recent)
                     .n_sink(a.n_sink)
                     .n_recent(a.n_recent)
                     .evict_every(a.evict_every);
  const DeviceSync sync(c.device);
  auto cache = Layout::make_cache(c, a, e);
  fill_to_capacity<Layout>(*cache, c, a);

  // A few different new tokens and probabilities, cycled through.
  constexpr int64_t kPool = 4;
  std::vector<std::vector<at::Tensor>> rows(kPool);
  std::vector<at::Tensor> probs(kPool);
  for (int64_t i = 0; i < kPool; ++i) {
    for (const auto& shape : Layout::row_shapes(c, a, 1)) rows[i].push_back(random(shape, c.dtype, c.device));
    // Wide enough for the most tokens a layer holds between passes; each step observes the
    // columns of the tokens it holds (a view).
    probs[i] = at::softmax(at::randn({c.batch, c.heads, 1, c.capacity + a.evict_every}, at::TensorOptions().device(c.device)), -1);
  }
  std::vector<at::Tensor> queries;
  for (const auto& shape : Layout::query_shapes(c, a)) queries.push_back(random(shape, c.dtype, c.device));
  auto& C = *cache;

  Result r{c, Layout::dims(a)};
  r.update_evict = measure(
      [&](int64_t i) {
        const auto& x = rows[i % kPool];
        C.update(0, x[0], x[1]);
        C.evict(0);
      },
      a, sync);
  r.uoe = measure(
      [&](int64_t i) { bookkeeping_step(C, rows[i % kPool], probs[i % kPool].narrow(3, 0, C.size(0) + 1)); }, a, sync);
  // observe and attend are repeatable on a layer holding one token more than after a pass.
  C.update(0, rows[0][0], rows[0][1]);
  r.observe = measure([&](int64_t i) { C.observe(0, probs[i % kPool].narrow(3, 0, C.size(0))); }, a, sync);
  r.attend = measure([&](int64_t) { Layout::attend(C, queries); }, a, sync);
  C.evict(0);
  r.bytes_held = C.stats().bytes_allocated;

#if KVEVICT_CUDA_GRAPHS
  if (c.device.is_cuda()) r.uoe_graph = graph_step_us<Layout>(c, a, e, rows[0], probs[0], sync);
#endif
  if (a.recall) r.uoe_recall = recall_step_us<Layout>(c, a, e, rows, probs, queries, sync);
  if (a.naive) {
    // The naive cache starts from the same tokens, copied into position order.
    NaiveCache naive(Layout::ordered(C), Layout::kTokenDim, e);
    r.naive = measure([&](int64_t i) { naive.step(rows[i % kPool], probs[i % kPool].narrow(3, 0, naive.size() + 1)); }, a, sync);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Output

std::string config_label(const Result& r) {
  const auto& c = r.config;
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-8s H=%-3lld %s %s %s B=%lld cap=%lld", c.layout.c_str(),
                static_cast<long long>(c.heads), r.dims.c_str(), c.dtype_name.c_str(), c.device.str().c_str(),
                static_cast<long long>(c.batch), static_cast<long long>(c.capacity));
  return buf;
}

/// `x` with `format` (a single %f-style conversion), or "-" right-aligned to `width` when `x` is
/// not finite (a measurement skipped, e.g. --no-naive).
std::string cell(const char* format, double x, int width) {
  char buf[64];
  if (std::isfinite(x)) {
    std::snprintf(buf, sizeof buf, format, x);
  } else {
    std::snprintf(buf, sizeof buf, "%*s", width, "-");
  }
  return buf;
}

void print_line(const Result& r) {
  char graph[128] = "";
  if (std::isfinite(r.uoe_graph)) std::snprintf(graph, sizeof graph, " | u+o+e graph %9.2f us", r.uoe_graph);
  if (std::isfinite(r.uoe_recall)) {
    const auto n = std::strlen(graph);
    std::snprintf(graph + n, sizeof graph - n, " | u+o+e+recall %9.2f us", r.uoe_recall);
  }
  std::printf("%s | update+evict %9.2f us | observe %9.2f us | u+o+e %9.2f us%s | attend %11.1f us | naive %s"
              " | ue/attend %7.4f%% | uoe/attend %7.4f%% | naive/attend %s | naive/ue %s\n",
              config_label(r).c_str(), r.update_evict, r.observe, r.uoe, graph, r.attend,
              cell("%11.1f us", r.naive, 14).c_str(), 100 * r.update_evict / r.attend, 100 * r.uoe / r.attend,
              cell("%6.2fx", r.naive / r.attend, 7).c_str(), cell("%8.0fx", r.naive / r.update_evict, 9).c_str());
  std::fflush(stdout);
}

void write_csv(const std::string& path, const std::vector<Result>& results, const Args& a) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f,
               "layout,heads,dims,dtype,device,batch,capacity,threads,check_observations,update_evict_us,observe_us,"
               "uoe_us,uoe_graph_us,uoe_recall_us,evict_every,attend_us,naive_us,ue_over_attend,uoe_over_attend,naive_over_attend,"
               "naive_over_ue,bytes_held\n");
  for (const auto& r : results) {
    const auto& c = r.config;
    std::fprintf(f, "%s,%lld,%s,%s,%s,%lld,%lld,%lld,%d,%.3f,%.3f,%.3f,%.3f,%.3f,%lld,%.3f,%.3f,%.6g,%.6g,%.6g,%.6g,%lld\n",
                 c.layout.c_str(), static_cast<long long>(c.heads), r.dims.c_str(), c.dtype_name.c_str(),
                 c.device.str().c_str(), static_cast<long long>(c.batch), static_cast<long long>(c.capacity),
                 static_cast<long long>(a.threads), a.check_observations ? 1 : 0, r.update_evict, r.observe, r.uoe,
                 r.uoe_graph, r.uoe_recall, static_cast<long long>(a.evict_every), r.attend, r.naive, r.update_evict / r.attend, r.uoe / r.attend, r.naive / r.attend,
                 r.naive / r.update_evict, static_cast<long long>(r.bytes_held));
  }
  std::fclose(f);
}

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

void write_json(const std::string& path, const std::vector<Result>& results, const Args& a) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f, "[\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const auto& c = r.config;
    std::fprintf(f,
                 "  {\"layout\": \"%s\", \"heads\": %lld, \"dims\": \"%s\", \"dtype\": \"%s\", \"device\": \"%s\", "
                 "\"batch\": %lld, \"capacity\": %lld, \"threads\": %lld, \"check_observations\": %s, "
                 "\"update_evict_us\": %s, \"observe_us\": %s, \"uoe_us\": %s, \"uoe_graph_us\": %s, \"uoe_recall_us\": %s, "
                 "\"evict_every\": %lld, \"attend_us\": %s, \"naive_us\": %s, "
                 "\"ue_over_attend\": %s, \"uoe_over_attend\": %s, \"naive_over_attend\": %s, \"naive_over_ue\": %s, "
                 "\"bytes_held\": %lld}%s\n",
                 c.layout.c_str(), static_cast<long long>(c.heads), r.dims.c_str(), c.dtype_name.c_str(),
                 c.device.str().c_str(), static_cast<long long>(c.batch), static_cast<long long>(c.capacity),
                 static_cast<long long>(a.threads), a.check_observations ? "true" : "false",
                 json_number(r.update_evict).c_str(), json_number(r.observe).c_str(), json_number(r.uoe).c_str(),
                 json_number(r.uoe_graph).c_str(), json_number(r.uoe_recall).c_str(),
                 static_cast<long long>(a.evict_every), json_number(r.attend).c_str(), json_number(r.naive).c_str(),
                 json_number(r.update_evict / r.attend).c_str(), json_number(r.uoe / r.attend).c_str(),
                 json_number(r.naive / r.attend).c_str(), json_number(r.naive / r.update_evict).c_str(),
                 static_cast<long long>(r.bytes_held), i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "]\n");
  std::fclose(f);
}

/// For each group of results that differ only in capacity: update+evict at the largest capacity
/// over update+evict at the smallest (the "nearly flat" figure).
void print_scaling(const std::vector<Result>& results) {
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& lo = results[i];
    const Result* hi = nullptr;
    bool first = true;
    for (size_t j = 0; j < results.size(); ++j) {
      const auto& o = results[j];
      const bool same = o.config.layout == lo.config.layout && o.config.heads == lo.config.heads &&
                        o.config.dtype == lo.config.dtype && o.config.batch == lo.config.batch;
      if (!same) continue;
      if (o.config.capacity < lo.config.capacity) first = false;
      if (!hi || o.config.capacity > hi->config.capacity) hi = &o;
    }
    if (!first || hi == &lo) continue;
    std::printf("scaling %s H=%lld %s B=%lld: update+evict x%.2f, observe x%.2f, attend x%.2f, naive %s "
                "from capacity %lld to %lld\n",
                lo.config.layout.c_str(), static_cast<long long>(lo.config.heads), lo.config.dtype_name.c_str(),
                static_cast<long long>(lo.config.batch), hi->update_evict / lo.update_evict,
                hi->observe / lo.observe, hi->attend / lo.attend, cell("x%.2f", hi->naive / lo.naive, 1).c_str(),
                static_cast<long long>(lo.config.capacity), static_cast<long long>(hi->config.capacity));
  }
}

// ---------------------------------------------------------------------------------------------
// Op counts (--count-ops)

using kvevict_test::OpCounts;
using kvevict_test::OpKind;
using kvevict_test::OpRecorder;

/// The parts of a decode step counted apart.
enum Part { kUpdate, kObserve, kEvict, kAttention, kRecall, kParts };
constexpr const char* kPartNames[kParts] = {"update", "observe", "evict", "attention", "recall"};

/// What one decode loop asked of LibTorch over its counted window, per part.
struct LoopCounts {
  std::string loop;  // "(a) latent + attend_absorbed", ...
  int64_t heads = 0, batch = 1, evict_every = 1, steps = 0, passes = 0;
  bool attention = false;  // attention counted (apart)
  bool recall = false;     // recall counted (apart)
  OpCounts part[kParts];
  std::vector<std::pair<std::string, int64_t>> kernels[kParts];  // by name, over the window
  std::vector<std::pair<Part, kvevict_test::OpEvent>> events;     // every counted op, in order

  /// Runs body() under a recorder and adds what it did to `p`.
  template <class Body>
  void count(Part p, Body&& body) {
    OpRecorder rec;
    body();
    part[p] += rec.counts();
    for (const auto& e : rec.events()) events.emplace_back(p, e);
    for (const auto& k : rec.by_name(OpKind::kernel)) {
      auto it = std::find_if(kernels[p].begin(), kernels[p].end(), [&](const auto& x) { return x.first == k.first; });
      if (it == kernels[p].end()) {
        kernels[p].push_back(k);
      } else {
        it->second += k.second;
      }
    }
  }
  OpCounts bookkeeping() const {
    OpCounts c = part[kUpdate];
    c += part[kObserve];
    c += part[kEvict];
    return c;
  }
};

/// Drives one decode loop: warm-up past the first passes, then one evict_every window that holds
/// exactly one pass, counted. `step(counts, counting)` runs one decode step (counting its parts
/// into `counts` when `counting`); `passes()` reads the eviction passes so far.
template <class Step, class Passes>
void run_window(LoopCounts& out, Step&& step, Passes&& passes) {
  LoopCounts scratch;
  for (int64_t i = 0; i < out.evict_every + 2; ++i) step(scratch, false);
  // Align on the cycle: the window starts right after a step that ran a pass.
  for (int64_t i = 0; i <= out.evict_every; ++i) {
    const int64_t before = passes();
    step(scratch, false);
    if (passes() > before) break;
  }
  const int64_t before = passes();
  for (int64_t i = 0; i < out.evict_every; ++i) step(out, true);
  out.steps = out.evict_every;
  out.passes = passes() - before;
}

/// Per-layout pieces of the counted loops.
at::Tensor attend_apart(Expanded::Cache& cache, const std::vector<at::Tensor>& q, at::Tensor* probs) {
  return kvevict::attend(q[0], cache, 0, c10::nullopt, probs, /*observe=*/false);
}
at::Tensor attend_apart(Latent::Cache& cache, const std::vector<at::Tensor>& q, at::Tensor* probs) {
  return kvevict::attend_absorbed(q[0], q[1], cache, 0, c10::nullopt, probs, /*observe=*/false);
}
/// lse [B, H, T] fp32 of the newest T tokens' queries over layer 0 (no pads, T = 1 decode).
at::Tensor decode_lse(Expanded::Cache& cache, const std::vector<at::Tensor>& q, double scale) {
  return at::matmul(q[0].to(at::kFloat).mul(scale), cache.keys(0).to(at::kFloat).transpose(-2, -1)).logsumexp(-1);
}
at::Tensor decode_lse(Latent::Cache& cache, const std::vector<at::Tensor>& q, double scale) {
  const auto ckv = cache.ckv(0).unsqueeze(1).to(at::kFloat), kpe = cache.kpe(0).unsqueeze(1).to(at::kFloat);
  return at::matmul(q[0].to(at::kFloat).mul(scale), ckv.transpose(-2, -1))
      .add(at::matmul(q[1].to(at::kFloat).mul(scale), kpe.transpose(-2, -1)))
      .logsumexp(-1);
}
void push(kvevict::LseRing<Expanded::Cache>& ring, const std::vector<at::Tensor>& q, const at::Tensor& lse) {
  ring.push(0, q[0], lse);
}
void push(kvevict::LseRing<Latent::Cache>& ring, const std::vector<at::Tensor>& q, const at::Tensor& lse) {
  ring.push(0, q[0], q[1], lse);
}

kvevict::EvictionOptions eviction_options(const Config& c, const Args& a, int64_t evict_every) {
  return kvevict::EvictionOptions(c.capacity - a.n_sink - a.n_recent)
      .n_sink(a.n_sink)
      .n_recent(a.n_recent)
      .evict_every(evict_every);
}

/// (a), (b), (e): update, attention (apart, observe = false), observe(probs), evict. `lengths`:
/// each row's tokens before decoding (a ragged batch; empty: one row at capacity).
/// `tier_tokens` > 0 (g): with a host tier that the passes fill, and a recall before every
/// step's attention (3 tokens from a pool of 256, pages of 64, scored by the heads' mean:
/// kvevict.hf's default recall), counted apart.
template <class Layout>
LoopCounts count_attend_loop(const std::string& name, Config c, const Args& a, int64_t evict_every,
                             const std::vector<int64_t>& lengths, int64_t tier_tokens = 0) {
  LoopCounts out;
  out.loop = name;
  out.heads = c.heads;
  out.evict_every = evict_every;
  out.attention = true;
  out.recall = tier_tokens > 0;
  c.batch = lengths.empty() ? 1 : static_cast<int64_t>(lengths.size());
  out.batch = c.batch;
  auto cache = Layout::make_cache(c, a, eviction_options(c, a, evict_every), tier_tokens);
  cache->reserve(c.capacity + evict_every);
  if (lengths.empty()) {
    fill_to_capacity<Layout>(*cache, c, a);
  } else {  // one ragged chunk: row b appends its last lengths[b] columns
    const int64_t T = *std::max_element(lengths.begin(), lengths.end());
    std::vector<at::Tensor> block;
    for (const auto& shape : Layout::row_shapes(c, a, T)) block.push_back(random(shape, c.dtype, c.device));
    cache->update(0, block[0], block[1], lengths);
  }
  std::vector<at::Tensor> row, q;
  for (const auto& shape : Layout::row_shapes(c, a, 1)) row.push_back(random(shape, c.dtype, c.device));
  for (const auto& shape : Layout::query_shapes(c, a)) q.push_back(random(shape, c.dtype, c.device));
  auto& C = *cache;
  run_window(
      out,
      [&](LoopCounts& n, bool on) {
        at::Tensor probs;
        const auto part = [&](Part p, auto&& body) {
          if (on) {
            n.count(p, body);
          } else {
            body();
          }
        };
        part(kUpdate, [&] { C.update(0, row[0], row[1]); });
        if (tier_tokens > 0) {
          const auto recall = [&] { Layout::recall(C, q, 0.1, 3, 256); };
          if (on) {
            n.count(kRecall, recall);
          } else {
            recall();
          }
        }
        if (on) {
          n.count(kAttention, [&] { attend_apart(C, q, &probs); });
        } else {  // warm-up: random probabilities of the same shape (attention copies the cache per head)
          probs = at::softmax(at::randn({c.batch, c.heads, 1, C.size(0)}, at::TensorOptions().device(c.device)), -1);
        }
        part(kObserve, [&] { C.observe(0, probs); });
        part(kEvict, [&] { C.evict(0); });
      },
      [&] { return C.stats(0).eviction_events; });
  return out;
}

void observe_lse_now(Expanded::Cache& cache, const std::vector<at::Tensor>& q, const at::Tensor& lse, double scale) {
  kvevict::observe_lse(q[0], cache, 0, lse, scale);
}
void observe_lse_now(Latent::Cache& cache, const std::vector<at::Tensor>& q, const at::Tensor& lse, double scale) {
  kvevict::observe_lse_absorbed(q[0], q[1], cache, 0, lse, scale);
}

/// (c) with `ring`: update, then LseRing push (scores the ring when it is full), then
/// ring.evict. (d) without: update, then observe_lse / observe_lse_absorbed of the step's
/// queries, then evict: scoring every step. The LSE (a fused kernel's output) is computed
/// outside the counters.
template <class Layout>
LoopCounts count_lse_loop(const std::string& name, const Config& c, const Args& a, int64_t evict_every, bool ring) {
  LoopCounts out;
  out.loop = name;
  out.heads = c.heads;
  out.evict_every = evict_every;
  auto cache = Layout::make_cache(c, a, eviction_options(c, a, evict_every));
  cache->reserve(c.capacity + evict_every);
  fill_to_capacity<Layout>(*cache, c, a);
  const double scale = 1.0 / std::sqrt(192.0);
  kvevict::LseRing<typename Layout::Cache> lse_ring(*cache, scale);
  std::vector<at::Tensor> row, q;
  for (const auto& shape : Layout::row_shapes(c, a, 1)) row.push_back(random(shape, c.dtype, c.device));
  for (const auto& shape : Layout::query_shapes(c, a)) q.push_back(random(shape, c.dtype, c.device));
  auto& C = *cache;
  run_window(
      out,
      [&](LoopCounts& n, bool on) {
        const auto part = [&](Part p, auto&& body) {
          if (on) {
            n.count(p, body);
          } else {
            body();
          }
        };
        part(kUpdate, [&] { C.update(0, row[0], row[1]); });
        const auto lse = decode_lse(C, q, scale);
        if (ring) {
          part(kObserve, [&] { push(lse_ring, q, lse); });
          part(kEvict, [&] { lse_ring.evict(0); });
        } else {
          part(kObserve, [&] { observe_lse_now(C, q, lse, scale); });
          part(kEvict, [&] { C.evict(0); });
        }
      },
      [&] { return C.stats(0).eviction_events; });
  return out;
}

/// (f): caller-owned storage, as docs/cpp-guide.md's "Your own storage" loop: an EvictionPolicy
/// and one fused latent buffer [1, slots, kv_lora_rank + qk_rope_dim]; append + write_rows,
/// observe of fixed probabilities, evict + apply_moves.
LoopCounts count_own_storage_loop(const std::string& name, const Config& c, const Args& a, int64_t evict_every) {
  LoopCounts out;
  out.loop = name;
  out.heads = c.heads;
  out.evict_every = evict_every;
  kvevict::EvictionPolicy<> policy(kvevict::EvictionPolicyOptions(1, c.heads)
                                       .batch_size(1)
                                       .device(c.device)
                                       .check_observations(a.check_observations),
                                   eviction_options(c, a, evict_every));
  policy.reserve(c.capacity + evict_every);
  const int64_t width = a.kv_lora_rank + a.qk_rope_dim;
  // A strided buffer (a narrowed view): on CPU a contiguous one would take write_rows' and
  // apply_moves' memcpy branches, which CUDA never runs and the observers cannot see.
  const auto buffer = at::zeros({1, policy.slots(0), width + 1}, at::TensorOptions().dtype(c.dtype).device(c.device))
                          .narrow(2, 0, width);
  const auto prompt = random({1, c.capacity, width}, c.dtype, c.device);
  kvevict::write_rows(buffer, 1, prompt, policy.append(0, std::vector<int64_t>{c.capacity}, c.capacity));
  policy.observe(0, at::softmax(at::randn({1, c.heads, 1, c.capacity}, at::TensorOptions().device(c.device)), -1));
  const auto row = random({1, 1, width}, c.dtype, c.device);
  std::vector<at::Tensor> probs;  // [1, H, 1, S] for each S of the cycle
  for (int64_t s = c.capacity + 1; s <= c.capacity + evict_every; ++s) {
    probs.push_back(at::softmax(at::randn({1, c.heads, 1, s}, at::TensorOptions().device(c.device)), -1));
  }
  run_window(
      out,
      [&](LoopCounts& n, bool on) {
        const auto part = [&](Part p, auto&& body) {
          if (on) {
            n.count(p, body);
          } else {
            body();
          }
        };
        part(kUpdate, [&] { kvevict::write_rows(buffer, 1, row, policy.append(0, std::vector<int64_t>{1}, 1)); });
        const int64_t S = policy.size(0);
        part(kObserve, [&] { policy.observe(0, probs[static_cast<size_t>(S - c.capacity - 1)]); });
        part(kEvict, [&] { kvevict::apply_moves(policy.evict(0), buffer, 1); });
      },
      [&] { return policy.stats(0).eviction_events; });
  return out;
}

/// `x` per step: an integer as such, else two decimals.
std::string per_step(int64_t total, int64_t steps) {
  char buf[32];
  if (total % steps == 0) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(total / steps));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f", static_cast<double>(total) / static_cast<double>(steps));
  }
  return buf;
}

void print_count_row(const std::string& loop, const LoopCounts& r, const OpCounts& c, const std::string& split) {
  const int64_t n = r.steps;
  std::printf("| %s | %lld | %lld | %lld | **%s** | %s | %s | %s | %s | %s | %s | %.2f |\n", loop.c_str(),
              static_cast<long long>(r.heads), static_cast<long long>(r.batch), static_cast<long long>(r.evict_every),
              per_step(c.kernels, n).c_str(), split.c_str(), per_step(c.views, n).c_str(),
              per_step(c.noops, n).c_str(), per_step(c.transfers, n).c_str(), per_step(c.syncs, n).c_str(), per_step(c.allocations, n).c_str(),
              static_cast<double>(c.bytes) / static_cast<double>(n) / (1024.0 * 1024.0));
}

void print_counts(const std::vector<LoopCounts>& loops, const Args& a) {
  std::printf("\nkvevict_bench --count-ops: the tensor path (the one CUDA takes) run on CPU, one layer; per decode "
              "step, amortized over one evict_every window holding one pass, after reserve(capacity + evict_every) "
              "and a warm-up; observation checks %s; LibTorch %s.\n"
              "kernels: outermost ATen ops that are not views, allocations or copies; views: ops that launch "
              "nothing and return a view; no-ops: calls that returned their input (a to() of its own dtype); "
              "copies: to() naming a device (host<->device on CUDA); syncs: item, nonzero and other reads of device "
              "data; allocs: CPU allocations of at least 1 byte (tests/op_counter.hpp).\n\n",
              a.check_observations ? "on" : "off", TORCH_VERSION);
  std::printf("| loop | H | B | evict_every | kernels | update / observe / evict | views | no-ops | copies | syncs | "
              "allocs | alloc MiB |\n| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const auto& r : loops) {
    const std::string split = per_step(r.part[kUpdate].kernels, r.steps) + " / " +
                              per_step(r.part[kObserve].kernels, r.steps) + " / " +
                              per_step(r.part[kEvict].kernels, r.steps);
    print_count_row(r.loop, r, r.bookkeeping(), split);
    if (r.attention) print_count_row(r.loop + ": its attention (apart)", r, r.part[kAttention], "");
    if (r.recall) print_count_row(r.loop + ": its recall (apart)", r, r.part[kRecall], "");
  }
  std::printf("\nKernels by name, summed over the window (steps / passes counted):\n");
  for (const auto& r : loops) {
    std::printf("%s H=%lld B=%lld evict_every %lld (%lld steps, %lld pass%s):\n", r.loop.c_str(),
                static_cast<long long>(r.heads), static_cast<long long>(r.batch),
                static_cast<long long>(r.evict_every), static_cast<long long>(r.steps),
                static_cast<long long>(r.passes), r.passes == 1 ? "" : "es");
    for (int p = 0; p < kParts; ++p) {
      if ((p == kAttention && !r.attention) || (p == kRecall && !r.recall)) continue;
      std::string names;
      for (const auto& k : r.kernels[p]) {
        names += " " + k.first.substr(k.first.rfind(':') + 1) + (k.second > 1 ? "x" + std::to_string(k.second) : "");
      }
      std::printf("  %-9s%s\n", kPartNames[p], names.c_str());
    }
  }
  if (a.list_ops) {
    std::printf("\nEvery counted op of each window (part, name, kind, input shapes, int arguments):\n");
    for (const auto& r : loops) {
      std::printf("%s H=%lld B=%lld evict_every %lld:\n", r.loop.c_str(), static_cast<long long>(r.heads),
                  static_cast<long long>(r.batch), static_cast<long long>(r.evict_every));
      for (const auto& pe : r.events) {
        std::ostringstream line;
        line << pe.second;
        std::printf("  %-9s %s\n", kPartNames[pe.first], line.str().c_str());
      }
    }
  }
  std::fflush(stdout);
}

/// --count-ops: the loops (a)-(g) of one layout, heads, dtype and capacity.
template <class Layout>
std::vector<LoopCounts> count_ops(const Config& c, const Args& a) {
  kvevict::detail::force_tensor_path() = true;  // read when a policy is built
  std::vector<int64_t> ragged;
  for (int64_t len : {c.capacity, int64_t{4000}, c.capacity, int64_t{2500}, c.capacity, int64_t{1200}, c.capacity,
                      int64_t{300}}) {
    ragged.push_back(std::min(len, c.capacity));
  }
  const std::string layout = c.layout == "latent" ? "latent + attend_absorbed" : "expanded + attend";
  std::vector<LoopCounts> loops;
  loops.push_back(count_attend_loop<Layout>("(a) " + layout, c, a, 1, {}));
  loops.push_back(count_attend_loop<Layout>("(b) " + layout, c, a, 16, {}));
  loops.push_back(count_lse_loop<Layout>("(c) " + c.layout + " + LseRing", c, a, 16, /*ring=*/true));
  loops.push_back(count_lse_loop<Layout>(
      "(d) " + c.layout + (c.layout == "latent" ? " + observe_lse_absorbed" : " + observe_lse") + " every step", c, a, 1,
      /*ring=*/false));
  loops.push_back(count_attend_loop<Layout>("(e) " + layout + ", ragged", c, a, 1, ragged));
  loops.push_back(count_attend_loop<Layout>("(e) " + layout + ", ragged", c, a, 16, ragged));
  loops.push_back(count_own_storage_loop("(f) EvictionPolicy + write_rows + apply_moves", c, a, 1));
  // (g) with the tier's compiled kernels where this build has them (kvevict::kernels), and
  // beside it with their ATen reference forms.
  const bool kernels = kvevict::kernels_available(c.device.type()) && kvevict::kernels_enabled();
  loops.push_back(count_attend_loop<Layout>("(g) " + layout + " + recall every step" +
                                                (kernels ? ", compiled kernels" : ", no compiled kernels here"),
                                            c, a, 16, {}, 4 * c.capacity));
  if (kernels) {
    kvevict::set_kernels_enabled(false);
    loops.push_back(count_attend_loop<Layout>("(g) " + layout + " + recall every step, reference forms", c, a, 16, {},
                                              4 * c.capacity));
    kvevict::set_kernels_enabled(true);
  }
  kvevict::detail::force_tensor_path() = a.tensor_path;
  return loops;
}

int run(const Args& a) {
  at::set_num_threads(static_cast<int>(a.threads));
  kvevict::set_kernels_enabled(!a.reference);
  at::manual_seed(0);
  kvevict::detail::force_tensor_path() = a.tensor_path;
  const auto device = kvevict_cli::make_device(a.device);
  char reps[96];
  if (a.iters) {
    std::snprintf(reps, sizeof reps, "%lld steps each", static_cast<long long>(a.iters));
  } else {
    std::snprintf(reps, sizeof reps, "~%.2f s each", a.min_time);
  }
  std::printf("kvevict_bench: one layer, per decode step in the steady state (a pass every %lld step(s) back to "
              "capacity), median of %lld reps (%s); %lld intra-op thread(s), %u hardware threads; check_observations "
              "%s; n_sink %lld, n_recent %lld%s\n",
              static_cast<long long>(a.evict_every), static_cast<long long>(a.reps), reps,
              static_cast<long long>(a.threads), std::thread::hardware_concurrency(), a.check_observations ? "on" : "off",
              static_cast<long long>(a.n_sink), static_cast<long long>(a.n_recent),
              a.tensor_path ? "; tensor-op path" : "");
  std::vector<Result> results;
  std::vector<LoopCounts> counted;
  for (const auto& layout : a.layouts) {
    for (auto heads : a.heads) {
      for (const auto& dtype : a.dtypes) {
        for (auto batch : a.batches) {
          for (auto cap : a.capacities) {
            Config c{layout, dtype, heads, batch, cap, kvevict_cli::make_dtype(dtype), device};
            if (a.count_ops) {
              const auto loops = layout == "latent" ? count_ops<Latent>(c, a) : count_ops<Expanded>(c, a);
              counted.insert(counted.end(), loops.begin(), loops.end());
              continue;
            }
            results.push_back(layout == "latent" ? run_config<Latent>(c, a) : run_config<Expanded>(c, a));
            print_line(results.back());
          }
        }
      }
    }
  }
  if (a.count_ops) print_counts(counted, a);
  print_scaling(results);
  if (!a.out_csv.empty()) write_csv(a.out_csv, results, a);
  if (!a.out_json.empty()) write_json(a.out_json, results, a);
  return EXIT_SUCCESS;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    if (!parse_args(argc, argv, args)) {
      std::printf("%s", kUsage);
      return EXIT_SUCCESS;
    }
    return run(args);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "kvevict_bench: %s\n(see kvevict_bench --help)\n", e.what());
    return kExitUsage;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kvevict_bench: error: %s\n", e.what_without_backtrace());
    return EXIT_FAILURE;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvevict_bench: error: %s\n", e.what());
    return EXIT_FAILURE;
  }
}
