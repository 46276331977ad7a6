// A small decoder with DeepSeek-V3 attention, for measuring what eviction does to a model's
// answers: MLA with low-rank q and kv compression and the decoupled RoPE split (a no-RoPE part
// per head plus one RoPE key shared by all heads), RMSNorm, SwiGLU MLP, tied embeddings.
//
// Three ways to run it, one set of weights:
//  - forward(tokens): full causal attention over the whole sequence (training, reference);
//  - step(tokens, MlaCache): keys/values decompressed per head, kvevict::attend;
//  - step(tokens, MlaLatentCache): W_UK absorbed into the query, W_UV applied after
//    kvevict::attend_absorbed, only ckv + kpe cached.
// The tokenizer is byte-level (0..255) plus special tokens for the retrieval tasks.
#pragma once

#include <kvevict/kvevict.hpp>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvq {

// ---- vocabulary -----------------------------------------------------------------------------
constexpr int64_t kBos = 256;     // start of every row
constexpr int64_t kQuery = 257;   // "what was stored under the next key?"
constexpr int64_t kPass = 258;    // passkey marker
constexpr int64_t kCopy = 259;    // copy delimiter
constexpr int64_t kKey0 = 264;    // 64 key symbols
constexpr int64_t kVal0 = 328;    // 64 value symbols
constexpr int64_t kNumSym = 64;
constexpr int64_t kVocab = 392;

struct Config {
  int64_t vocab = kVocab, dim = 128, n_layers = 4, n_heads = 4;
  int64_t q_lora = 64, kv_lora = 64, qk_nope = 32, qk_rope = 16, v_dim = 32, ffn = 352;
  double rope_theta = 10000.0, eps = 1e-6;
  // Smeared keys, in the token-shift form (cf. Olsson et al. 2022, "In-context learning and
  // induction heads", Sec. 6): the raw kv latent of token t gets W_s times token t-1's
  // attention input added before its norm, so one attention layer can match "the token after
  // an earlier copy of mine" (induction) without first learning a previous-token head. The
  // one addition to DeepSeek-V3's MLA here: without it no copying or recall formed in the
  // CPU-minutes this model trains for.
  bool smear = true;
  int64_t qk_dim() const { return qk_nope + qk_rope; }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(qk_dim())); }
};

// Optional per-layer tap on the attention output [B, H, T, v_dim] (before the output
// projection), for measuring the attention-output error of an evicting cache.
using AttnTap = std::function<void(int64_t layer, const torch::Tensor& out)>;

// A recall before a layer's attention: up to `tokens` tokens per row from the host tier
// (none at 0), two-level with a pool of `rescore` tokens when rescore > tokens.
struct Recall {
  int64_t tokens = 0, rescore = 0;
};

// Per-sequence decode state outside the KV cache: each layer's last attention input
// [B, 1, dim] (for the smeared keys of the next token). The RoPE position of the next token is
// the cache's seen tokens (a compressed prompt counts whole). One per cache; empty at position 0.
struct DecodeState {
  std::vector<torch::Tensor> last;
};

struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t d, double eps) : eps(eps) { weight = register_parameter("weight", torch::ones({d})); }
  torch::Tensor forward(const torch::Tensor& x) {
    return x * torch::rsqrt(x.pow(2).mean(-1, true) + eps) * weight;
  }
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Rotate-half RoPE on x [..., T, d] at positions pos [T] (int64).
inline torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& pos, double theta) {
  const int64_t d = x.size(-1), half = d / 2;
  auto inv = torch::pow(theta, -torch::arange(0, half, torch::kFloat) * 2.0 / static_cast<double>(d));
  auto ang = pos.to(torch::kFloat).unsqueeze(1) * inv.unsqueeze(0);  // [T, half]
  auto cos = torch::cat({ang.cos(), ang.cos()}, -1).to(x.dtype());
  auto sin = torch::cat({ang.sin(), ang.sin()}, -1).to(x.dtype());
  auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  auto rot = torch::cat({-x2, x1}, -1);
  return x * cos + rot * sin;
}

struct MLAImpl : torch::nn::Module {
  explicit MLAImpl(const Config& c) : c(c) {
    auto lin = [](int64_t i, int64_t o) { return torch::nn::Linear(torch::nn::LinearOptions(i, o).bias(false)); };
    wq_a = register_module("wq_a", lin(c.dim, c.q_lora));
    q_norm = register_module("q_norm", RMSNorm(c.q_lora, c.eps));
    wq_b = register_module("wq_b", lin(c.q_lora, c.n_heads * c.qk_dim()));
    wkv_a = register_module("wkv_a", lin(c.dim, c.kv_lora + c.qk_rope));
    kv_norm = register_module("kv_norm", RMSNorm(c.kv_lora, c.eps));
    wkv_b = register_module("wkv_b", lin(c.kv_lora, c.n_heads * (c.qk_nope + c.v_dim)));
    wo = register_module("wo", lin(c.n_heads * c.v_dim, c.dim));
    if (c.smear) wkv_s = register_module("wkv_s", lin(c.dim, c.kv_lora));
  }

  struct Proj {
    torch::Tensor q_nope, q_pe;  // [B, H, T, nope], [B, H, T, rope] (RoPE applied)
    torch::Tensor ckv, kpe;      // [B, T, r] (normed), [B, T, rope] (RoPE applied)
  };
  // last: this layer's DecodeState entry (nullptr: the sequence starts at x[:, 0]).
  Proj project(const torch::Tensor& x, const torch::Tensor& pos, torch::Tensor* last = nullptr) {
    const int64_t B = x.size(0), T = x.size(1), H = c.n_heads;
    auto q = wq_b(q_norm(wq_a(x))).view({B, T, H, c.qk_dim()}).transpose(1, 2);
    Proj p;
    p.q_nope = q.narrow(-1, 0, c.qk_nope);
    p.q_pe = rope(q.narrow(-1, c.qk_nope, c.qk_rope), pos, c.rope_theta);
    auto kv = wkv_a(x);
    auto raw = kv.narrow(-1, 0, c.kv_lora);
    if (c.smear) {
      auto first = last && last->defined() ? *last : torch::zeros({B, 1, c.dim}, x.options());
      auto prev = torch::cat({first, x.narrow(1, 0, T - 1)}, 1);
      if (last) *last = x.narrow(1, T - 1, 1).detach();
      raw = raw + wkv_s(prev);
    }
    p.ckv = kv_norm(raw);
    p.kpe = rope(kv.narrow(-1, c.kv_lora, c.qk_rope), pos, c.rope_theta);
    return p;
  }
  // Per-head keys [B, H, T, qk_dim] and values [B, H, T, v_dim] from the latent rows.
  std::pair<torch::Tensor, torch::Tensor> expand(const torch::Tensor& ckv, const torch::Tensor& kpe) {
    const int64_t B = ckv.size(0), T = ckv.size(1), H = c.n_heads;
    auto kvb = wkv_b(ckv).view({B, T, H, c.qk_nope + c.v_dim}).transpose(1, 2);
    auto k = torch::cat({kvb.narrow(-1, 0, c.qk_nope), kpe.unsqueeze(1).expand({B, H, T, c.qk_rope})}, -1);
    return {k, kvb.narrow(-1, c.qk_nope, c.v_dim)};
  }
  torch::Tensor out(const torch::Tensor& o) {  // [B, H, T, v_dim] -> [B, T, dim]
    return wo(o.transpose(1, 2).reshape({o.size(0), o.size(2), c.n_heads * c.v_dim}));
  }

  // Full causal attention (positions 0..T-1).
  torch::Tensor full(const torch::Tensor& x, const torch::Tensor& pos, const torch::Tensor& mask) {
    auto p = project(x, pos);
    auto [k, v] = expand(p.ckv, p.kpe);
    auto q = torch::cat({p.q_nope, p.q_pe}, -1);
    auto logits = torch::matmul(q, k.transpose(-2, -1)).mul(c.scale()).masked_fill(mask, -INFINITY);
    return out(torch::matmul(torch::softmax(logits, -1), v));
  }

  // Expanded layout: keys/values decompressed per head, attention by the library. recall.tokens
  // > 0: first up to that many tokens come back from the cache's host tier (cache.recall with
  // this step's queries and recall.rescore).
  template <class P>
  torch::Tensor cached(const torch::Tensor& x, const torch::Tensor& pos, kvevict::BasicMlaCache<P>& cache,
                        int64_t layer, const AttnTap& tap, bool observe, torch::Tensor* last, const Recall& recall = {}) {
    auto p = project(x, pos, last);
    auto [k, v] = expand(p.ckv, p.kpe);
    cache.update(layer, k.contiguous(), v.contiguous());
    auto q = torch::cat({p.q_nope, p.q_pe}, -1).contiguous();
    if (recall.tokens > 0) cache.recall(layer, q, c.scale(), recall.tokens, recall.rescore);
    auto o = kvevict::attend(q, cache, layer, c.scale(), nullptr, observe);
    if (tap) tap(layer, o);
    return out(o);
  }

  // Full causal attention over a whole prompt x [B, T, dim] at positions 0..T-1, and the layer's
  // cache filled by one-shot compression (kvevict::compress_prompt under the cache's scorer,
  // from the prompt's LSE) instead of appending every token. -> the attention output.
  template <class P>
  torch::Tensor compressed(const torch::Tensor& x, const torch::Tensor& pos, kvevict::BasicMlaCache<P>& cache,
                           int64_t layer, torch::Tensor* last) {
    auto p = project(x, pos, last);
    auto [k, v] = expand(p.ckv, p.kpe);
    auto q = torch::cat({p.q_nope, p.q_pe}, -1).contiguous();
    const int64_t T = x.size(1);
    auto logits = torch::matmul(q, k.transpose(-2, -1)).mul(c.scale()).masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -INFINITY);
    kvevict::compress_prompt(cache, layer, q, k.contiguous(), v.contiguous(), torch::logsumexp(logits, -1), c.scale());
    return out(torch::matmul(torch::softmax(logits, -1), v));
  }
  template <class P>
  torch::Tensor compressed(const torch::Tensor& x, const torch::Tensor& pos, kvevict::BasicMlaLatentCache<P>& cache,
                           int64_t layer, torch::Tensor* last) {
    auto p = project(x, pos, last);
    auto w = wkv_b->weight.view({c.n_heads, c.qk_nope + c.v_dim, c.kv_lora});
    auto q_abs = torch::matmul(p.q_nope, w.narrow(1, 0, c.qk_nope).unsqueeze(0)).contiguous();  // [B, H, T, r]
    const int64_t T = x.size(1);
    auto logits = (torch::matmul(q_abs, p.ckv.unsqueeze(1).transpose(-2, -1)) +
                   torch::matmul(p.q_pe, p.kpe.unsqueeze(1).transpose(-2, -1)))
                      .mul(c.scale())
                      .masked_fill(torch::ones({T, T}, torch::kBool).triu(1), -INFINITY);
    kvevict::compress_prompt_absorbed(cache, layer, q_abs, p.q_pe.contiguous(), p.ckv.contiguous(), p.kpe.contiguous(),
                                      torch::logsumexp(logits, -1), c.scale());
    auto lat = torch::matmul(torch::softmax(logits, -1), p.ckv.unsqueeze(1));                 // [B, H, T, r]
    return out(torch::matmul(lat, w.narrow(1, c.qk_nope, c.v_dim).transpose(1, 2).unsqueeze(0)));  // [B, H, T, v]
  }

  // Latent layout: q_absorbed = q_nope W_UK, output = (probs ckv) W_UV^T.
  template <class P>
  torch::Tensor cached(const torch::Tensor& x, const torch::Tensor& pos, kvevict::BasicMlaLatentCache<P>& cache,
                        int64_t layer, const AttnTap& tap, bool observe, torch::Tensor* last, const Recall& recall = {}) {
    auto p = project(x, pos, last);
    auto w = wkv_b->weight.view({c.n_heads, c.qk_nope + c.v_dim, c.kv_lora});
    auto w_uk = w.narrow(1, 0, c.qk_nope);       // [H, nope, r]
    auto w_uv = w.narrow(1, c.qk_nope, c.v_dim);  // [H, v, r]
    cache.update(layer, p.ckv.contiguous(), p.kpe.contiguous());
    auto q_abs = torch::matmul(p.q_nope, w_uk.unsqueeze(0));  // [B, H, T, r]
    if (recall.tokens > 0) cache.recall_absorbed(layer, q_abs, p.q_pe, c.scale(), recall.tokens, recall.rescore);
    auto lat = kvevict::attend_absorbed(q_abs.contiguous(), p.q_pe.contiguous(), cache, layer, c.scale(), nullptr, observe);
    auto o = torch::matmul(lat, w_uv.transpose(1, 2).unsqueeze(0));  // [B, H, T, v]
    if (tap) tap(layer, o);
    return out(o);
  }

  Config c;
  torch::nn::Linear wq_a{nullptr}, wq_b{nullptr}, wkv_a{nullptr}, wkv_b{nullptr}, wo{nullptr}, wkv_s{nullptr};
  RMSNorm q_norm{nullptr}, kv_norm{nullptr};
};
TORCH_MODULE(MLA);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const Config& c) {
    auto lin = [](int64_t i, int64_t o) { return torch::nn::Linear(torch::nn::LinearOptions(i, o).bias(false)); };
    w1 = register_module("w1", lin(c.dim, c.ffn));
    w3 = register_module("w3", lin(c.dim, c.ffn));
    w2 = register_module("w2", lin(c.ffn, c.dim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return w2(torch::silu(w1(x)) * w3(x)); }
  torch::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(MLP);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const Config& c) {
    attn_norm = register_module("attn_norm", RMSNorm(c.dim, c.eps));
    attn = register_module("attn", MLA(c));
    ffn_norm = register_module("ffn_norm", RMSNorm(c.dim, c.eps));
    mlp = register_module("mlp", MLP(c));
  }
  RMSNorm attn_norm{nullptr}, ffn_norm{nullptr};
  MLA attn{nullptr};
  MLP mlp{nullptr};
};
TORCH_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  explicit ModelImpl(const Config& c = Config()) : c(c) {
    embed = register_module("embed", torch::nn::Embedding(c.vocab, c.dim));
    for (int64_t l = 0; l < c.n_layers; ++l) blocks.push_back(register_module("block" + std::to_string(l), Block(c)));
    norm = register_module("norm", RMSNorm(c.dim, c.eps));
    torch::NoGradGuard g;
    for (auto& p : named_parameters()) {
      if (p.key().find("norm") != std::string::npos) continue;
      const bool resid_out = p.key().find("wo.") != std::string::npos || p.key().find("w2.") != std::string::npos;
      p.value().normal_(0.0, resid_out ? 0.02 / std::sqrt(2.0 * c.n_layers) : 0.02);
    }
  }

  torch::Tensor head(const torch::Tensor& x) { return torch::matmul(norm(x), embed->weight.t()); }

  // tokens [B, T] int64 -> logits [B, T, vocab], full causal attention.
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t T = tokens.size(1);
    auto pos = torch::arange(T, torch::kLong);
    auto mask = torch::ones({T, T}, torch::kBool).triu(1);
    auto x = embed(tokens);
    for (auto& b : blocks) {
      x = x + b->attn->full(b->attn_norm(x), pos, mask);
      x = x + b->mlp(b->ffn_norm(x));
    }
    return head(x);
  }

  // tokens [B, T] appended to `cache` (either layout) at positions seen_tokens(0) ..; each
  // layer attends through the cache, calls `tap` (if any; it may add scores), then
  // cache.evict(layer) (unless `evict` is false). `observe` false: attention is not fed to the
  // scorer (scores come only from add_scores). recall.tokens > 0: each layer first recalls up
  // to that many tokens from the cache's host tier with this append's queries. -> logits [B, T, vocab].
  // `state` belongs to this cache's sequence (a fresh DecodeState with a fresh cache).
  template <class Cache>
  torch::Tensor step(const torch::Tensor& tokens, Cache& cache, DecodeState& state, const AttnTap& tap = nullptr,
                     bool observe = true, bool evict = true, const Recall& recall = {}) {
    const int64_t start = cache.seen_tokens(0), T = tokens.size(1);
    if (static_cast<int64_t>(state.last.size()) != c.n_layers) state.last.assign(c.n_layers, torch::Tensor());
    if (start == 0) state.last.assign(c.n_layers, torch::Tensor());
    auto pos = torch::arange(start, start + T, torch::kLong);
    auto x = embed(tokens);
    for (int64_t l = 0; l < c.n_layers; ++l) {
      auto& b = blocks[l];
      x = x + b->attn->cached(b->attn_norm(x), pos, cache, l, tap, observe, &state.last[l], recall);
      if (evict) cache.evict(l);
      x = x + b->mlp(b->ffn_norm(x));
    }
    return head(x);
  }

  // A prompt tokens [B, T] into an empty cache (either layout), each layer compressed once to its
  // capacity by kvevict::compress_prompt under the cache's scorer (SnapKV's setting: the whole
  // prompt's attention, from its LSE, then keep the best). Later step() calls continue at RoPE
  // position T. -> logits [B, T, vocab] (exact: the prompt itself attends to every token).
  template <class Cache>
  torch::Tensor prefill_compressed(const torch::Tensor& tokens, Cache& cache, DecodeState& state) {
    const int64_t T = tokens.size(1);
    state.last.assign(c.n_layers, torch::Tensor());
    auto pos = torch::arange(T, torch::kLong);
    auto x = embed(tokens);
    for (int64_t l = 0; l < c.n_layers; ++l) {
      auto& b = blocks[l];
      x = x + b->attn->compressed(b->attn_norm(x), pos, cache, l, &state.last[l]);
      x = x + b->mlp(b->ffn_norm(x));
    }
    return head(x);
  }

  kvevict::MlaCacheOptions expanded_options(int64_t batch) const {
    return kvevict::MlaCacheOptions(c.n_layers, c.n_heads).qk_dim(c.qk_dim()).v_dim(c.v_dim).batch_size(batch);
  }
  kvevict::MlaLatentCacheOptions latent_options(int64_t batch) const {
    return kvevict::MlaLatentCacheOptions(c.n_layers, c.n_heads)
        .kv_lora_rank(c.kv_lora)
        .qk_rope_dim(c.qk_rope)
        .qk_nope_dim(c.qk_nope)
        .batch_size(batch);
  }

  Config c;
  torch::nn::Embedding embed{nullptr};
  std::vector<Block> blocks;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Model);

// Weights as a list of fp16 tensors in named_parameters() order (the shipped format: small,
// and loadable without the module's archive layout).
inline void save_weights(Model& m, const std::string& path) {
  std::vector<torch::Tensor> ts;
  for (auto& p : m->named_parameters()) ts.push_back(p.value().detach().to(torch::kHalf).contiguous());
  torch::save(ts, path);
}
inline void load_weights(Model& m, const std::string& path) {
  std::vector<torch::Tensor> ts;
  torch::load(ts, path);
  auto params = m->named_parameters();
  if (ts.size() != params.size())
    throw std::runtime_error(path + ": " + std::to_string(ts.size()) + " tensors, the model has " +
                             std::to_string(params.size()));
  torch::NoGradGuard g;
  for (size_t i = 0; i < ts.size(); ++i) {
    if (ts[i].sizes() != params[i].value().sizes())
      throw std::runtime_error(path + ": tensor " + params[i].key() + " has the wrong shape");
    params[i].value().copy_(ts[i].to(torch::kFloat));
  }
}

inline int64_t count_params(Model& m, bool with_embedding) {
  int64_t n = 0;
  for (auto& p : m->named_parameters())
    if (with_embedding || p.key().find("embed") == std::string::npos) n += p.value().numel();
  return n;
}

}  // namespace kvq
