// validate_eviction: the 1000-step validation of the eviction contract (docs/DESIGN.md),
// driven either by a real DeepSeek-V3 MLA attention forward (--scores attention, the default)
// or by a mock (--scores random: random cached rows, softmax(randn) as the attention),
// in either cache layout: --layout expanded (kvevict::MlaCache, per-head K/V decompressed by
// kv_b_proj, the default) or --layout latent (kvevict::MlaLatentCache, ckv + kpe cached, the
// attention absorbed: W_UK folded into the query, W_UV applied to the latent output).
//
// Per step and layer: append one token, observe attention over the live slots, evict. Checks
// linear warm-up growth, exact stabilisation at capacity, one pass per due step and layer,
// and that sinks and the recent window survive every pass. Exit code 0: all PASS; 1: a FAIL
// or a runtime error; 2: a bad command line.
//
// Usage: validate_eviction [--steps N] [--budget N] [--n-sink N] [--n-recent N] [--layers N]
//          [--heads N] [--evict-every N] [--dtype fp32|fp16|bf16] [--device D]
//          [--scores random|attention] [--layout expanded|latent] [--out-csv PATH] [--threads N]
#include "cli.hpp"

#include <kvevict/kvevict.hpp>

#include <ATen/Parallel.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int kExitFail = 1;
constexpr int kExitUsage = 2;

// ---------------------------------------------------------------------------------------------
// Command line

struct Args {
  int64_t steps = 1000;
  int64_t budget = 64;
  int64_t n_sink = 4;
  int64_t n_recent = 16;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t evict_every = 1;
  std::string dtype = "fp32";
  std::string device = "cpu";
  std::string scores = "attention";
  std::string layout = "expanded";
  std::string out_csv;  // empty: no CSV
  int64_t threads = 1;
};

constexpr const char* kUsage = R"(Usage: validate_eviction [options]

Runs STEPS decode steps (batch 1) through a kvevict::MlaCache (--layout expanded) or a
kvevict::MlaLatentCache (--layout latent) and checks the eviction contract.

Options (default in brackets):
  --steps N          decode steps [1000]
  --budget N         heavy hitters kept per row, >= 0 [64]
  --n-sink N         attention sinks kept, >= 0 [4]
  --n-recent N       recent window kept, >= 0 [16]
  --layers N         decoder layers, >= 1 [4]
  --heads N          attention heads, >= 1 [4]
  --evict-every N    a pass at most every N updates, >= 1 [1]
  --dtype T          cache dtype: fp32, fp16 or bf16 [fp32]
  --device D         an at::Device: cpu, cpu:0, cuda or cuda:N [cpu]
  --scores S         attention: a random-init DeepSeek-V3 MLA attention forward per layer and
                     step feeds its probabilities; random: a mock, random cached rows
                     and softmax(randn [B, H, 1, S]) [attention]
  --layout L         expanded: per-head keys [B, H, S, 192] and values [B, H, S, 128]
                     (MlaCache, kvevict::attend); latent: ckv [B, S, 512] + kpe [B, S, 64]
                     shared by the heads (MlaLatentCache, absorbed attention through
                     kvevict::attend_absorbed) [expanded]
  --out-csv PATH     write step,max,avg,events per step to PATH [none]
  --threads N        intra-op threads (at::set_num_threads), >= 1 [1]
  --help             print this and exit
)";

using kvevict_cli::parse_choice;
using kvevict_cli::parse_int;
using kvevict_cli::UsageError;

/// Parses argv; throws UsageError on an unknown flag, a missing value or a bad value.
/// Accepts `--flag value` and `--flag=value`. Returns false for --help.
bool parse_args(int argc, char** argv, Args& a) {
  return kvevict_cli::parse_flags(
      argc, argv,
      {
          {"--steps", [&](auto& f, auto& v) { a.steps = parse_int(f, v, 1); }},
          {"--budget", [&](auto& f, auto& v) { a.budget = parse_int(f, v, 0); }},
          {"--n-sink", [&](auto& f, auto& v) { a.n_sink = parse_int(f, v, 0); }},
          {"--n-recent", [&](auto& f, auto& v) { a.n_recent = parse_int(f, v, 0); }},
          {"--layers", [&](auto& f, auto& v) { a.layers = parse_int(f, v, 1); }},
          {"--heads", [&](auto& f, auto& v) { a.heads = parse_int(f, v, 1); }},
          {"--evict-every", [&](auto& f, auto& v) { a.evict_every = parse_int(f, v, 1); }},
          {"--threads", [&](auto& f, auto& v) { a.threads = parse_int(f, v, 1); }},
          {"--dtype", [&](auto& f, auto& v) { a.dtype = parse_choice(f, v, {"fp32", "fp16", "bf16"}); }},
          {"--scores", [&](auto& f, auto& v) { a.scores = parse_choice(f, v, {"random", "attention"}); }},
          {"--layout", [&](auto& f, auto& v) { a.layout = parse_choice(f, v, {"expanded", "latent"}); }},
          {"--device", [&](auto&, auto& v) { a.device = v; }},  // checked in kvevict_cli::make_device()
          {"--out-csv",
           [&](auto& f, auto& v) {
             kvevict_cli::check_writable(f, v);
             a.out_csv = v;
           }},
      });
}

// ---------------------------------------------------------------------------------------------
// A small random-init DeepSeek-V3 decoder (attention only; the MLP is left out: it does not
// touch the cache). Dimensions as DeepSeek-V3 except hidden size and q_lora_rank.

struct MlaDims {
  int64_t hidden = 256;        // DeepSeek-V3: 7168
  int64_t q_lora_rank = 64;    // DeepSeek-V3: 1536
  int64_t kv_lora_rank = 512;  // as DeepSeek-V3
  int64_t qk_nope = 128;
  int64_t qk_rope = 64;
  int64_t v_head = 128;
  int64_t heads = 4;
  int64_t qk_dim() const { return qk_nope + qk_rope; }
};

/// x [B, n] * rsqrt(mean(x^2) + eps) * weight [n] (DeepseekV3RMSNorm), fp32.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) {
  return x.mul(x.pow(2).mean(-1, /*keepdim=*/true).add(1e-6).rsqrt()).mul(weight);
}

/// [in, out] weights, randn / sqrt(in): unit-variance inputs give unit-variance outputs.
at::Tensor linear_weight(int64_t in, int64_t out, const at::TensorOptions& opts) {
  return at::randn({in, out}, opts).div(std::sqrt(static_cast<double>(in)));
}

/// Rotary embedding tables for positions [0, max_positions): cos and sin [P, rope_dim]
/// (HF's layout: the rope_dim/2 frequencies repeated twice, theta 10000).
struct Rope {
  at::Tensor cos, sin;
  Rope(int64_t max_positions, int64_t rope_dim, const at::TensorOptions& opts) {
    const auto inv_freq = at::pow(10000.0, at::arange(0, rope_dim, 2, opts).div(static_cast<double>(rope_dim))).reciprocal();
    const auto freqs = at::outer(at::arange(max_positions, opts), inv_freq);  // [P, rope_dim / 2]
    const auto emb = at::cat({freqs, freqs}, -1);                            // [P, rope_dim]
    cos = emb.cos();
    sin = emb.sin();
  }
  /// x [..., rope_dim] rotated to `position`: x * cos + rotate_half(x) * sin.
  at::Tensor apply(const at::Tensor& x, int64_t position) const {
    const int64_t half = x.size(-1) / 2;
    const auto rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
    return x.mul(cos[position]).add(rotated.mul(sin[position]));
  }
};

/// One DeepSeek-V3 MLA attention layer (DeepseekV3Attention, q_lora_rank set), random init,
/// with both ways to attend: expanded (kv_b_proj decompresses per-head keys and values) and
/// absorbed (DeepSeek-V2 paper, Sec. 2.1.2: the k_nope half of kv_b_proj, W_UK, folded into
/// the query; the v half, W_UV, applied to the latent output). All fp32.
class MlaLayer {
 public:
  /// One token's projections, before any layout-specific step.
  struct Projected {
    at::Tensor q_nope;  // [B, H, qk_nope]
    at::Tensor q_pe;    // [B, H, qk_rope], RoPE applied at the token's position
    at::Tensor ckv;     // [B, kv_lora_rank], after kv_a_layernorm
    at::Tensor kpe;     // [B, qk_rope], RoPE applied, shared by the heads
  };

  MlaLayer(const MlaDims& d, const at::TensorOptions& opts) : d_(d) {
    const auto ones = [&](int64_t n) { return at::ones({n}, opts); };
    input_norm_ = ones(d.hidden);
    q_a_proj_ = linear_weight(d.hidden, d.q_lora_rank, opts);
    q_a_norm_ = ones(d.q_lora_rank);
    q_b_proj_ = linear_weight(d.q_lora_rank, d.heads * d.qk_dim(), opts);
    kv_a_proj_ = linear_weight(d.hidden, d.kv_lora_rank + d.qk_rope, opts);
    kv_a_norm_ = ones(d.kv_lora_rank);
    kv_b_proj_ = linear_weight(d.kv_lora_rank, d.heads * (d.qk_nope + d.v_head), opts);
    o_proj_ = linear_weight(d.heads * d.v_head, d.hidden, opts);
    // kv_b_proj's columns per head: (k_nope 128, v 128).
    const auto kv_b = kv_b_proj_.view({d.kv_lora_rank, d.heads, d.qk_nope + d.v_head});
    w_uk_ = kv_b.narrow(-1, 0, d.qk_nope).permute({1, 2, 0}).contiguous();
    w_uv_ = kv_b.narrow(-1, d.qk_nope, d.v_head).permute({1, 0, 2}).contiguous();
  }

  /// Projections of one token at `position`: x [B, hidden] fp32 (the residual stream).
  Projected project(const at::Tensor& x, int64_t position, const Rope& rope) const {
    const int64_t B = x.size(0), H = d_.heads;
    const auto h = rms_norm(x, input_norm_);
    // q: hidden -> q_lora_rank -> RMSNorm -> per head (q_nope 128, q_pe 64).
    const auto q = rms_norm(h.matmul(q_a_proj_), q_a_norm_).matmul(q_b_proj_).view({B, H, d_.qk_dim()});
    // kv: hidden -> (ckv 512, k_pe 64); RMSNorm (kv_a_layernorm) on ckv.
    const auto kv_a = h.matmul(kv_a_proj_);
    return {q.narrow(-1, 0, d_.qk_nope), rope.apply(q.narrow(-1, d_.qk_nope, d_.qk_rope), position),
            rms_norm(kv_a.narrow(-1, 0, d_.kv_lora_rank), kv_a_norm_),
            rope.apply(kv_a.narrow(-1, d_.kv_lora_rank, d_.qk_rope), position)};
  }

  /// Expanded layout: ckv [B, kv_lora_rank] -> per-head {k_nope [B, H, qk_nope], v [B, H, v_head]}.
  std::pair<at::Tensor, at::Tensor> decompress(const at::Tensor& ckv) const {
    const auto kv = ckv.matmul(kv_b_proj_).view({ckv.size(0), d_.heads, d_.qk_nope + d_.v_head});
    return {kv.narrow(-1, 0, d_.qk_nope), kv.narrow(-1, d_.qk_nope, d_.v_head)};
  }

  /// Absorbed layout: q_nope [B, H, qk_nope] -> q_nope W_UK [B, H, 1, kv_lora_rank].
  at::Tensor absorb_query(const at::Tensor& q_nope) const { return at::matmul(q_nope.unsqueeze(2), w_uk_); }

  /// Absorbed layout: latent output [B, H, 1, kv_lora_rank] (probs @ ckv) -> W_UV [B, H, 1, v_head].
  at::Tensor up_value(const at::Tensor& latent) const { return at::matmul(latent.to(at::kFloat), w_uv_); }

  /// The residual stream after this layer: x + o_proj(attn), attn [B, H, 1, v_head].
  at::Tensor output(const at::Tensor& x, const at::Tensor& attn) const {
    return x.add(attn.to(at::kFloat).reshape({x.size(0), d_.heads * d_.v_head}).matmul(o_proj_));
  }

 private:
  MlaDims d_;
  at::Tensor input_norm_;  // [hidden]
  at::Tensor q_a_proj_;    // [hidden, q_lora_rank]
  at::Tensor q_a_norm_;    // [q_lora_rank]
  at::Tensor q_b_proj_;    // [q_lora_rank, H * 192]
  at::Tensor kv_a_proj_;   // [hidden, kv_lora_rank + 64]
  at::Tensor kv_a_norm_;   // [kv_lora_rank]
  at::Tensor kv_b_proj_;   // [kv_lora_rank, H * (128 + 128)]
  at::Tensor w_uk_;        // [H, qk_nope, kv_lora_rank]: kv_b_proj's k_nope columns per head
  at::Tensor w_uv_;        // [H, kv_lora_rank, v_head]: kv_b_proj's v columns per head
  at::Tensor o_proj_;      // [H * 128, hidden]
};

// ---------------------------------------------------------------------------------------------
// The two cache layouts: what a step caches and how it attends. run<Layout>() drives either.

/// Expanded layout: kvevict::MlaCache of per-head keys cat(k_nope, k_pe) and values from
/// kv_b_proj; kvevict::attend.
struct ExpandedLayout {
  using Cache = kvevict::MlaCache;
  static constexpr const char* kCache = "kvevict::MlaCache";
  static constexpr const char* kRandomRows = "randn K/V rows [B, H, 1, 192] and [B, H, 1, 128]";
  static constexpr const char* kAttention = "expanded: kv_b_proj decompresses per-head k_nope and v, kvevict::attend";

  /// What one layer caches and attends with for one new token (cache dtype).
  struct Token {
    at::Tensor q;  // [B, H, 1, qk_dim], RoPE applied to the last qk_rope dims (attention mode)
    at::Tensor k;  // [B, H, 1, qk_dim]: cat(k_nope, k_pe), k_pe shared by the heads
    at::Tensor v;  // [B, H, 1, v_head]
  };

  static Cache make_cache(const MlaDims& d, int64_t layers, int64_t B, at::ScalarType dtype, at::Device device,
                          const kvevict::EvictionOptions& eviction) {
    return Cache(kvevict::MlaCacheOptions(layers, d.heads)
                     .qk_dim(d.qk_dim())
                     .v_dim(d.v_head)
                     .batch_size(B)
                     .dtype(dtype)
                     .device(device),
                 eviction);
  }
  static Token random(const MlaDims& d, int64_t B, const at::TensorOptions& opts) {
    return {at::Tensor(), at::randn({B, d.heads, 1, d.qk_dim()}, opts), at::randn({B, d.heads, 1, d.v_head}, opts)};
  }
  static Token project(const MlaLayer& layer, const MlaLayer::Projected& p, const MlaDims& d, at::ScalarType dtype) {
    const auto kv = layer.decompress(p.ckv);
    const auto k_pe = p.kpe.unsqueeze(1).expand({p.kpe.size(0), d.heads, d.qk_rope});
    return {at::cat({p.q_nope, p.q_pe}, -1).unsqueeze(2).to(dtype),
            at::cat({kv.first, k_pe}, -1).unsqueeze(2).to(dtype), kv.second.unsqueeze(2).to(dtype).contiguous()};
  }
  static void update(Cache& cache, int64_t l, const Token& t) { cache.update(l, t.k, t.v); }
  /// Attention without observing: output [B, H, 1, v_head], fp32 probabilities [B, H, 1, S] in *probs.
  static at::Tensor attend(Cache& cache, int64_t l, const Token& t, const MlaLayer&, at::Tensor* probs) {
    return kvevict::attend(t.q, cache, l, c10::nullopt, probs, /*observe=*/false);
  }
};

/// Latent layout: kvevict::MlaLatentCache of ckv (after kv_a_layernorm) and kpe (after RoPE);
/// the query absorbed through W_UK, kvevict::attend_absorbed, W_UV on its latent output.
struct LatentLayout {
  using Cache = kvevict::MlaLatentCache;
  static constexpr const char* kCache = "kvevict::MlaLatentCache";
  static constexpr const char* kRandomRows = "randn ckv/kpe rows [B, 1, 512] and [B, 1, 64]";
  static constexpr const char* kAttention =
      "absorbed: ckv + kpe cached, q_nope W_UK, kvevict::attend_absorbed, W_UV on the latent output";

  /// What one layer caches and attends with for one new token (cache dtype).
  struct Token {
    at::Tensor q_absorbed;  // [B, H, 1, kv_lora_rank]: q_nope W_UK (attention mode)
    at::Tensor q_pe;        // [B, H, 1, qk_rope], RoPE applied (attention mode)
    at::Tensor ckv;         // [B, 1, kv_lora_rank], after kv_a_layernorm
    at::Tensor kpe;         // [B, 1, qk_rope], RoPE applied
  };

  static Cache make_cache(const MlaDims& d, int64_t layers, int64_t B, at::ScalarType dtype, at::Device device,
                          const kvevict::EvictionOptions& eviction) {
    return Cache(kvevict::MlaLatentCacheOptions(layers, d.heads)
                     .kv_lora_rank(d.kv_lora_rank)
                     .qk_rope_dim(d.qk_rope)
                     .qk_nope_dim(d.qk_nope)
                     .batch_size(B)
                     .dtype(dtype)
                     .device(device),
                 eviction);
  }
  static Token random(const MlaDims& d, int64_t B, const at::TensorOptions& opts) {
    return {at::Tensor(), at::Tensor(), at::randn({B, 1, d.kv_lora_rank}, opts), at::randn({B, 1, d.qk_rope}, opts)};
  }
  static Token project(const MlaLayer& layer, const MlaLayer::Projected& p, const MlaDims&, at::ScalarType dtype) {
    return {layer.absorb_query(p.q_nope).to(dtype), p.q_pe.unsqueeze(2).to(dtype), p.ckv.unsqueeze(1).to(dtype),
            p.kpe.unsqueeze(1).to(dtype)};
  }
  static void update(Cache& cache, int64_t l, const Token& t) { cache.update(l, t.ckv, t.kpe); }
  /// Attention without observing: output [B, H, 1, v_head] fp32 (W_UV applied), fp32
  /// probabilities [B, H, 1, S] in *probs.
  static at::Tensor attend(Cache& cache, int64_t l, const Token& t, const MlaLayer& layer, at::Tensor* probs) {
    return layer.up_value(kvevict::attend_absorbed(t.q_absorbed, t.q_pe, cache, l, c10::nullopt, probs,
                                                   /*observe=*/false));
  }
};

// ---------------------------------------------------------------------------------------------
// Checks

/// The contract's schedule: a pass runs when a layer holds more than `capacity` tokens and
/// `evict_every` updates happened since the last pass (or construction). With one token per
/// step the first pass is at step max(capacity, evict_every - 1) (0-based), then every
/// `evict_every` steps.
struct Schedule {
  int64_t capacity, evict_every, first_pass;
  Schedule(int64_t cap, int64_t every) : capacity(cap), evict_every(every), first_pass(std::max(cap, every - 1)) {}
  bool due(int64_t step) const { return step >= first_pass && (step - first_pass) % evict_every == 0; }
  int64_t passes(int64_t steps) const { return steps > first_pass ? (steps - 1 - first_pass) / evict_every + 1 : 0; }
};

/// A named check: passes until the first failure, whose message it keeps.
struct Check {
  std::string name;
  bool ok = true;
  std::string first_failure;
  void expect(bool cond, const std::function<std::string()>& what) {
    if (!cond && ok) {
      ok = false;
      first_failure = what();
    }
  }
};

/// True when every row of positions [B, S] (int64, CPU) holds S distinct positions in [0, seen),
/// including the sinks 0 .. n_sink - 1 and the recent window seen - n_recent .. seen - 1.
/// On failure writes a description to `why`.
bool sinks_and_recent_present(const at::Tensor& positions, int64_t seen, int64_t n_sink, int64_t n_recent,
                              std::vector<int64_t>& row, std::string& why) {
  const auto pos = positions.to(at::kCPU).contiguous();
  const int64_t B = pos.size(0), S = pos.size(1);
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    row.assign(p + b * S, p + (b + 1) * S);
    std::sort(row.begin(), row.end());
    if (std::adjacent_find(row.begin(), row.end()) != row.end() || (S > 0 && (row.front() < 0 || row.back() >= seen))) {
      why = fmt::format("row {}: positions not distinct or outside [0, {})", b, seen);
      return false;
    }
    const auto has = [&](int64_t x) { return std::binary_search(row.begin(), row.end(), x); };
    for (int64_t x = 0; x < std::min(n_sink, seen); ++x) {
      if (!has(x)) {
        why = fmt::format("row {}: sink position {} missing", b, x);
        return false;
      }
    }
    for (int64_t x = std::max<int64_t>(seen - n_recent, 0); x < seen; ++x) {
      if (!has(x)) {
        why = fmt::format("row {}: recent position {} missing (seen {})", b, x, seen);
        return false;
      }
    }
  }
  return true;
}

struct CsvRow {
  int64_t step, max;
  double avg;
  int64_t events;
};

template <class Layout>
int run(const Args& a) {
  const auto dtype = kvevict_cli::make_dtype(a.dtype);
  const auto device = kvevict_cli::make_device(a.device);
  const bool use_attention = a.scores == "attention";
  at::set_num_threads(static_cast<int>(a.threads));
  at::manual_seed(0);

  const auto eviction =
      kvevict::EvictionOptions(a.budget).n_sink(a.n_sink).n_recent(a.n_recent).evict_every(a.evict_every);
  try {
    eviction.validate();
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
  // Open the CSV first: a path that cannot be written is a usage error, found before the run.
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> csv(nullptr, &std::fclose);
  if (!a.out_csv.empty()) {
    csv.reset(std::fopen(a.out_csv.c_str(), "w"));
    if (!csv) throw UsageError("--out-csv: cannot open '" + a.out_csv + "' for writing");
  }

  const int64_t B = 1;
  MlaDims dims;
  dims.heads = a.heads;
  auto cache = Layout::make_cache(dims, a.layers, B, dtype, device, eviction);
  const int64_t cap = cache.capacity();
  const Schedule schedule(cap, a.evict_every);

  // The decoder (attention mode): weights, RoPE tables and token embeddings, fp32 on the device.
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(device);
  const int64_t vocab = 1024;
  std::vector<MlaLayer> decoder;
  at::Tensor embedding;  // [vocab, hidden]
  std::unique_ptr<Rope> rope;
  if (use_attention) {
    for (int64_t l = 0; l < a.layers; ++l) decoder.emplace_back(dims, fopts);
    embedding = at::randn({vocab, dims.hidden}, fopts);
    rope = std::make_unique<Rope>(a.steps, dims.qk_rope, fopts);
  }
  const auto kv_opts = at::TensorOptions().dtype(dtype).device(device);

  // On CUDA the timer brackets device work: wait for the stream before and after (a 1-element
  // device-to-host copy); on CPU this is a no-op.
  const auto sync_probe = at::zeros({1}, fopts);
  const auto sync = [&] {
    if (device.is_cuda()) (void)sync_probe.item<float>();
  };

  fmt::print("validate_eviction: {} layout ({}), {} steps, {} layers, {} heads, capacity {} = n_sink {} + budget {} + "
             "n_recent {}, evict_every {}, {} on {}, {} thread(s)\n",
             a.layout, Layout::kCache, a.steps, a.layers, a.heads, cap, a.n_sink, a.budget, a.n_recent, a.evict_every,
             a.dtype, device.str(), a.threads);
  if (use_attention) {
    fmt::print("scores: attention of a random-init DeepSeek-V3 MLA decoder (hidden {}, q_lora_rank {}, "
               "kv_lora_rank {}, qk {} + {}, v {}, RoPE at the true position), {}\n",
               dims.hidden, dims.q_lora_rank, dims.kv_lora_rank, dims.qk_nope, dims.qk_rope, dims.v_head,
               Layout::kAttention);
  } else {
    fmt::print("scores: random (a mock: {}, softmax(randn [B, H, 1, S]) observed)\n", Layout::kRandomRows);
  }

  Check warmup{"linear warm-up growth"};
  Check stable{"exact stabilisation at capacity"};
  Check passes{"one pass per post-cap step per layer"};
  Check kept{"sinks and recent window present after every pass"};
  Check finite{"decoder stays finite"};
  const int64_t bound = cap + a.evict_every - 1;  // most tokens a layer holds after evict()

  std::vector<CsvRow> rows;
  rows.reserve(a.steps);
  std::vector<int64_t> sizes(a.layers), scratch;
  int64_t events = 0, max_cache = 0;
  double cache_seconds = 0;
  using clock = std::chrono::steady_clock;
  const auto seconds_since = [](clock::time_point t0) {
    return std::chrono::duration<double>(clock::now() - t0).count();
  };

  const auto t_start = clock::now();
  for (int64_t step = 0; step < a.steps; ++step) {
    at::Tensor x;  // [B, hidden] residual stream of this step's token
    if (use_attention) x = embedding.index_select(0, at::randint(vocab, {B}, fopts.dtype(at::kLong)));
    for (int64_t l = 0; l < a.layers; ++l) {
      const int64_t position = cache.seen_tokens(l);
      const auto in = use_attention
                          ? Layout::project(decoder[l], decoder[l].project(x, position, *rope), dims, dtype)
                          : Layout::random(dims, B, kv_opts);

      sync();
      auto t0 = clock::now();
      Layout::update(cache, l, in);
      sync();
      cache_seconds += seconds_since(t0);
      const int64_t size_before = cache.size(l);

      at::Tensor probs, attn;  // [B, H, 1, S] fp32; [B, H, 1, v_head]
      if (use_attention) {
        // The attention math stays outside the timer: attend without observing, then
        // observe() is timed with evict() below.
        attn = Layout::attend(cache, l, in, decoder[l], &probs);
      } else {
        probs = at::softmax(at::randn({B, a.heads, 1, size_before}, fopts), -1);
      }

      sync();
      t0 = clock::now();
      cache.observe(l, probs);
      const int64_t evicted = cache.evict(l);
      sync();
      cache_seconds += seconds_since(t0);

      if (use_attention) x = decoder[l].output(x, attn);
      const int64_t size = cache.size(l);
      sizes[l] = size;
      events += evicted > 0;

      if (step < schedule.first_pass) {
        warmup.expect(size == step + 1, [&] {
          return fmt::format("layer {} step {}: size {} != {}", l, step, size, step + 1);
        });
      } else {
        const bool exact = a.evict_every == 1 || evicted > 0;
        stable.expect(exact ? size == cap : (size >= cap && size <= bound), [&] {
          return exact ? fmt::format("layer {} step {}: size {} != capacity {}", l, step, size, cap)
                       : fmt::format("layer {} step {}: size {} outside [{}, {}]", l, step, size, cap, bound);
        });
      }
      passes.expect((evicted > 0) == schedule.due(step) && (evicted == 0 || evicted == size_before - cap), [&] {
        return fmt::format("layer {} step {}: evicted {} tokens, expected {}", l, step, evicted,
                           schedule.due(step) ? size_before - cap : 0);
      });
      if (evicted > 0 && kept.ok) {
        std::string why;
        const bool ok =
            sinks_and_recent_present(cache.positions(l), cache.seen_tokens(l), a.n_sink, a.n_recent, scratch, why);
        kept.expect(ok, [&] { return fmt::format("layer {} step {}: {}", l, step, why); });
      }
    }
    if (use_attention && finite.ok) {
      const bool ok = at::isfinite(x).all().item<bool>();
      finite.expect(ok, [&] { return fmt::format("step {}: the residual stream holds a NaN or inf", step); });
    }

    const int64_t step_max = *std::max_element(sizes.begin(), sizes.end());
    double avg = 0;
    for (auto s : sizes) avg += static_cast<double>(s);
    avg /= static_cast<double>(a.layers);
    max_cache = std::max(max_cache, step_max);
    rows.push_back({step, step_max, avg, events});
    if ((step + 1) % 50 == 0 || step + 1 == a.steps) {
      fmt::print("[step {}/{}] max={} avg={:.2f} events={}\n", step + 1, a.steps, step_max, avg, events);
    }
  }
  const double elapsed = seconds_since(t_start);

  // The totals must agree with the schedule and with the cache's own counters.
  const int64_t expected_events = schedule.passes(a.steps) * a.layers;
  const auto stats = cache.stats();
  passes.expect(events == expected_events && stats.eviction_events == events, [&] {
    return fmt::format("{} events counted, cache stats say {}, expected {}", events, stats.eviction_events,
                       expected_events);
  });

  fmt::print("max_cache={} expected_cap={} over_cap={}{}\n", max_cache, bound, max_cache > bound ? 1 : 0,
             a.evict_every > 1 ? fmt::format(" (capacity {} + evict_every {} - 1)", cap, a.evict_every) : "");
  fmt::print("events={} expected_events={} ({} per layer)\n", events, expected_events, schedule.passes(a.steps));
  fmt::print("steps/sec: {:.1f}\n", static_cast<double>(a.steps) / elapsed);
  fmt::print("cache_us_per_step: {:.1f}\n", 1e6 * cache_seconds / static_cast<double>(a.steps));
  fmt::print("bytes_held: {}\n", stats.bytes_allocated);

  const auto report = [](const Check& c, const std::string& detail) {
    if (c.ok) {
      fmt::print("PASS {}: {}\n", c.name, detail);
    } else {
      fmt::print("FAIL {}: {}\n", c.name, c.first_failure);
    }
    return c.ok;
  };
  const bool reached = a.steps > schedule.first_pass;
  bool all = true;
  all &= report(warmup, fmt::format("size after step i == i + 1 for i < {}", std::min(schedule.first_pass, a.steps)));
  all &= report(stable, !reached ? std::string("capacity not reached")
                        : a.evict_every == 1
                            ? fmt::format("size == {} after every step from step {} on", cap, schedule.first_pass)
                            : fmt::format("size == {} after every pass, within [{}, {}] between passes", cap, cap, bound));
  all &= report(passes, fmt::format("{} events == expected {} ({} layer(s) x {} pass(es), one every {} step(s) from step {})",
                                    events, expected_events, a.layers, schedule.passes(a.steps), a.evict_every,
                                    schedule.first_pass));
  const auto sinks = a.n_sink > 0 ? fmt::format("positions 0..{}", a.n_sink - 1) : std::string("no sinks");
  const auto recent = a.n_recent > 0 ? fmt::format("seen-{}..seen-1", a.n_recent) : std::string("no recent window");
  all &= report(kept, !reached ? std::string("no pass ran")
                               : fmt::format("{} and {} in every row after {} passes", sinks, recent, events));
  if (use_attention) all &= report(finite, "residual stream finite after every step");

  if (csv) {
    std::FILE* f = csv.get();
    fmt::print(f, "step,max,avg,events\n");
    for (const auto& r : rows) fmt::print(f, "{},{},{:.2f},{}\n", r.step, r.max, r.avg, r.events);
    csv.reset();
    fmt::print("wrote {} ({} rows)\n", a.out_csv, rows.size());
  }
  return all ? EXIT_SUCCESS : kExitFail;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    if (!parse_args(argc, argv, args)) {
      fmt::print("{}", kUsage);
      return EXIT_SUCCESS;
    }
    return args.layout == "latent" ? run<LatentLayout>(args) : run<ExpandedLayout>(args);
  } catch (const UsageError& e) {
    fmt::print(stderr, "validate_eviction: {}\n(see validate_eviction --help)\n", e.what());
    return kExitUsage;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "validate_eviction: error: {}\n", e.what_without_backtrace());
    return kExitFail;
  }
}
