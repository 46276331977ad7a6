// Running the quality model through kvevict caches: policies, budgets, both layouts, and the
// measurements (retrieval, text bits per byte, attention-output error vs the full cache).
// Shared by eval_quality and the CI test.
#pragma once

#include "model.hpp"
#include "tasks.hpp"

#include <string>
#include <vector>

namespace kvq {

enum class Layout { Expanded, Latent };
inline const char* layout_name(Layout l) { return l == Layout::Expanded ? "expanded" : "latent"; }

// Eviction policies compared. To add a scorer: an enumerator, its name, and one line in
// with_cache() below. h2o_recall and h2o_recall_turn: H2O with a host tier that keeps every
// evicted token, recalled (cache.recall) every step (h2o_recall_mean: its pages scored by the
// heads' mean logit), or once per question (each question is one
// multi-token append, as a new user turn would be). snapkv_recall_turn: SnapKV's prompt
// compression sends the prompt tokens it drops to the tier, and each question recalls.
enum class Policy {
  Full, H2O, MeanObserved, Tova, Decay, Window, Random, Pyramid, SnapKV, H2ORecall, H2ORecallPaged, H2ORecallMean,
  H2ORecallTurn, SnapKVRecallTurn
};
inline const char* policy_name(Policy p) {
  switch (p) {
    case Policy::Full: return "full";
    case Policy::H2O: return "h2o";
    case Policy::MeanObserved: return "mean_observed";
    case Policy::Tova: return "tova";
    case Policy::Decay: return "decay";
    case Policy::Window: return "sinks_window";
    case Policy::Random: return "random";
    case Policy::Pyramid: return "h2o_pyramid";
    case Policy::SnapKV: return "snapkv";
    case Policy::H2ORecall: return "h2o_recall";
    case Policy::H2ORecallPaged: return "h2o_recall_paged";
    case Policy::H2ORecallMean: return "h2o_recall_mean";
    case Policy::H2ORecallTurn: return "h2o_recall_turn";
    case Policy::SnapKVRecallTurn: return "snapkv_recall_turn";
  }
  return "?";
}
// The recall policies that recall at every append after the prefill (the others: at questions).
inline bool recalls_every_step(Policy p) {
  return p == Policy::H2ORecall || p == Policy::H2ORecallPaged || p == Policy::H2ORecallMean;
}
inline bool recalls(Policy p) {
  return recalls_every_step(p) || p == Policy::H2ORecallTurn || p == Policy::SnapKVRecallTurn;
}
// SnapKV's prompt compression (Model::prefill_compressed) instead of a prefill chunk.
inline bool compresses_prompt(Policy p) { return p == Policy::SnapKV || p == Policy::SnapKVRecallTurn; }
inline Policy policy_from(const std::string& s) {
  for (auto p : {Policy::Full, Policy::H2O, Policy::MeanObserved, Policy::Tova, Policy::Decay, Policy::Window,
                 Policy::Random, Policy::Pyramid, Policy::SnapKV, Policy::H2ORecall, Policy::H2ORecallPaged,
                 Policy::H2ORecallMean, Policy::H2ORecallTurn, Policy::SnapKVRecallTurn})
    if (s == policy_name(p)) return p;
  throw std::runtime_error("unknown policy " + s);
}

constexpr int64_t kSinks = 4;

// A cache of `capacity` tokens per row: 4 sinks; sinks+window gives the rest to the recent
// window (budget 0); every other policy splits the rest evenly between heavy hitters and the
// recent window (H2O's 50/50). Full: never evicts (budget = context).
inline kvevict::EvictionOptions eviction_for(Policy p, int64_t capacity, int64_t context) {
  if (p == Policy::Full) return kvevict::EvictionOptions(context).n_sink(kSinks).n_recent(0);
  const int64_t sinks = std::min(kSinks, capacity), rest = capacity - sinks;
  if (p == Policy::Window) return kvevict::EvictionOptions(0).n_sink(sinks).n_recent(rest);
  const int64_t recent = std::max<int64_t>(1, rest / 2);
  return kvevict::EvictionOptions(std::max<int64_t>(0, rest - recent)).n_sink(sinks).n_recent(std::min(recent, rest));
}

// SnapKV's observation window here: the newest min(32, n_recent) prompt queries vote (the
// scorer needs n_recent >= window); pooling over 5 tokens (the authors' default).
inline kvevict::SnapKV snapkv_for(const kvevict::EvictionOptions& e) {
  return kvevict::SnapKV(std::max<int64_t>(1, std::min<int64_t>(32, e.n_recent())), 5);
}

// Builds the cache type that `p` names for `layout` and calls f(cache).
// h2o_pyramid: H2O with per-layer budgets (PyramidKV-style): layer l of n keeps
// budget * (1.5 - l / (n - 1)) heavy hitters (1.5x at the bottom, 0.5x at the top; same total).
inline std::vector<int64_t> pyramid_budgets(int64_t budget, int64_t n_layers) {
  std::vector<int64_t> b;
  for (int64_t l = 0; l < n_layers; ++l)
    b.push_back(static_cast<int64_t>(std::llround(budget * (1.5 - static_cast<double>(l) / std::max<int64_t>(1, n_layers - 1)))));
  return b;
}

// Recall settings of the recall policies. The tier keeps every evicted token (tier_tokens = the
// document length). h2o_recall: pages of `step_page` tokens, at most `step_tokens` back per step.
// h2o_recall_paged: the same every step, scored by the heads' mean logit (TierScoring::kHeadMean),
// two-level (recall's rescore): pages of `paged_page`, the best pages up to `paged_rescore`
// tokens scored again token by token with their exact keys, `step_tokens` of them back.
// h2o_recall_mean: every step, pages of `mean_page` scored by the heads' mean logit,
// `step_tokens` back (two-level with a pool of `mean_rescore` tokens when it is > step_tokens). h2o_recall_turn: pages of `turn_page`, at most `turn_share` of the heavy-hitter budget
// back per question (whole pages, at least one). The defaults are the best of small sweeps
// (examples/quality/README.md): a recall every step wants exact, small recalls (it comes back
// for the next answer token); a recall once per question wants pages, so that the tokens after
// the one the question finds come too.
struct RecallSettings {
  int64_t step_page = 1, step_tokens = 3, paged_page = 64, paged_rescore = 256, mean_page = 1, mean_rescore = 0,
          turn_page = 4;
  double turn_share = 0.25;
  int64_t page(Policy p) const {
    return p == Policy::H2ORecall        ? step_page
           : p == Policy::H2ORecallPaged ? paged_page
           : p == Policy::H2ORecallMean  ? mean_page
                                         : turn_page;
  }
  Recall recall(Policy p, const kvevict::EvictionOptions& e) const {
    if (p == Policy::H2ORecall) return {step_tokens, 0};
    if (p == Policy::H2ORecallPaged) return {step_tokens, paged_rescore};
    if (p == Policy::H2ORecallMean) return {step_tokens, mean_rescore};
    return {std::max<int64_t>(turn_page, static_cast<int64_t>(turn_share * static_cast<double>(e.budget()))), 0};
  }
};

// tier > 0: the cache keeps a host tier of that many tokens per row, pages of tier_page.
template <class F>
void with_cache(Model& m, Layout layout, Policy p, const kvevict::EvictionOptions& e, int64_t batch, F&& f,
                int64_t tier = 0, int64_t tier_page = 16) {
  const auto scoring = p == Policy::H2ORecallMean || p == Policy::H2ORecallPaged ? kvevict::TierScoring::kHeadMean
                                                                                 : kvevict::TierScoring::kPerHead;
  std::vector<int64_t> layer_budgets;
  if (p == Policy::Pyramid) layer_budgets = pyramid_budgets(e.budget(), m->c.n_layers);
  auto run = [&](auto scorer) {
    using Scorer = decltype(scorer);
    if (layout == Layout::Expanded) {
      kvevict::BasicMlaCache<kvevict::EvictionPolicy<Scorer>> cache(
          m->expanded_options(batch).layer_budgets(layer_budgets).tier_tokens(tier).tier_page_size(tier_page).tier_scoring(scoring),
          e, scorer);
      f(cache);
    } else {
      kvevict::BasicMlaLatentCache<kvevict::EvictionPolicy<Scorer>> cache(
          m->latent_options(batch).layer_budgets(layer_budgets).tier_tokens(tier).tier_page_size(tier_page).tier_scoring(scoring),
          e, scorer);
      f(cache);
    }
  };
  switch (p) {
    case Policy::MeanObserved: run(kvevict::MeanObservedAttention{}); break;
    case Policy::Tova: run(kvevict::LatestAttention{}); break;
    case Policy::Decay: run(kvevict::DecayedAttention{}); break;  // the library's default gamma (0.9)
    case Policy::SnapKV:
    case Policy::SnapKVRecallTurn: run(snapkv_for(e)); break;
    default: run(kvevict::CumulativeAttention{}); break;  // Full, H2O, Window, Random, the recall policies
  }
}

// A multi-token append inside a document: `len` fed tokens from index `start` (a question).
struct Turn {
  int64_t start, len;
};

struct RunResult {
  torch::Tensor logits;     // [B, T, vocab] (T = fed tokens)
  double err_sq = 0, ref_sq = 0;  // attention-output error vs `ref_attn` (if given), summed
};

// Feeds tokens [B, T] through a fresh cache: one prefill chunk of min(prefill, T) tokens, then
// one token per step (decode), except that each of `turns` after the prefill is one append.
// The recall policies recall before each layer's attention: h2o_recall at every append after
// the prefill, h2o_recall_turn at the turns only. Random: attention is not observed; every new token gets a
// uniform random score once, when it arrives (so eviction picks uniformly among candidates).
// SnapKV: the prefill chunk is the prompt, attended in full and compressed once per layer
// (Model::prefill_compressed), so `prefill` may exceed the capacity; decode as the others.
// ref_attn (optional): per layer [B, H, T, v_dim] attention outputs of the full cache; the
// squared error of this run's outputs against them is summed over positions >= prefill.
inline RunResult run_policy(Model& m, Layout layout, Policy p, const kvevict::EvictionOptions& e,
                            const torch::Tensor& tok, int64_t prefill, uint64_t seed,
                            const std::vector<torch::Tensor>* ref_attn = nullptr,
                            std::vector<torch::Tensor>* attn_out = nullptr, bool evict = true,
                            const std::vector<Turn>& turns = {}, const RecallSettings& rs = {}) {
  torch::NoGradGuard g;
  const int64_t B = tok.size(0), T = tok.size(1);
  RunResult res;
  std::vector<torch::Tensor> chunks;
  if (attn_out) attn_out->assign(m->c.n_layers, torch::Tensor());
  std::vector<std::vector<torch::Tensor>> attn_parts(m->c.n_layers);
  auto gen = at::detail::createCPUGenerator(seed);
  with_cache(m, layout, p, e, B, [&](auto& cache) {
    DecodeState state;
    int64_t t = 0;
    while (t < T) {
      int64_t n = t == 0 ? std::min(std::max<int64_t>(1, prefill), T) : 1;
      bool turn = false;
      for (const auto& u : turns) {
        if (t > 0 && u.start == t) n = u.len, turn = true;
      }
      const Recall recall = recalls(p) && t > 0 && (recalls_every_step(p) || turn) ? rs.recall(p, e) : Recall{};
      const int64_t t0 = t;
      AttnTap tap = [&](int64_t layer, const torch::Tensor& o) {
        if (p == Policy::Random) {
          const int64_t seen = cache.seen_tokens(layer);
          auto fresh = cache.positions(layer).ge(seen - n).to(torch::kFloat);
          cache.add_scores(layer, fresh * at::rand(fresh.sizes(), gen));
        }
        if (attn_out) attn_parts[layer].push_back(o);
        if (ref_attn && t0 >= prefill) {
          auto r = (*ref_attn)[layer].narrow(2, t0, n);
          res.err_sq += (o - r).pow(2).sum().item<double>();
          res.ref_sq += r.pow(2).sum().item<double>();
        }
      };
      if (t == 0 && compresses_prompt(p))
        chunks.push_back(m->prefill_compressed(tok.narrow(1, 0, n), cache, state));
      else
        chunks.push_back(m->step(tok.narrow(1, t, n), cache, state, tap, p != Policy::Random, evict, recall));
      t += n;
    }
  }, recalls(p) ? T : 0, rs.page(p));
  res.logits = torch::cat(chunks, 1);
  if (attn_out)
    for (int64_t l = 0; l < m->c.n_layers; ++l) (*attn_out)[l] = torch::cat(attn_parts[l], 2);
  return res;
}

// Retrieval documents: n passkey rows per depth, all of length T (context T - kPassLen).
struct DocSet {
  torch::Tensor tok;            // [B, T]
  std::vector<double> depth;    // per row
};
inline DocSet passkey_docs(const std::string& filler_text, int64_t T, const std::vector<double>& depths, int64_t n,
                           uint64_t seed) {
  Rng r(seed);
  DocSet d;
  std::vector<int64_t> buf;
  for (double dep : depths)
    for (int64_t i = 0; i < n; ++i) {
      auto row = passkey_row(r, filler_text, T, dep);
      buf.insert(buf.end(), row.tok.begin(), row.tok.end());
      d.depth.push_back(dep);
    }
  d.tok = torch::tensor(buf, torch::kLong).view({static_cast<int64_t>(d.depth.size()), T});
  return d;
}

// Per row: 1 if all kPassLen answer tokens are the argmax (teacher-forced), from logits of the
// fed tokens tok[:, :T-1].
inline torch::Tensor passkey_correct(const torch::Tensor& logits, const torch::Tensor& tok) {
  const int64_t T = tok.size(1);
  auto pred = logits.narrow(1, T - 1 - kPassLen, kPassLen).argmax(-1);
  return pred.eq(tok.narrow(1, T - kPassLen, kPassLen)).all(1).to(torch::kFloat);
}

// Per row: the fraction of the kPassLen answer tokens that are the argmax (teacher-forced).
inline torch::Tensor passkey_token_acc(const torch::Tensor& logits, const torch::Tensor& tok) {
  const int64_t T = tok.size(1);
  auto pred = logits.narrow(1, T - 1 - kPassLen, kPassLen).argmax(-1);
  return pred.eq(tok.narrow(1, T - kPassLen, kPassLen)).to(torch::kFloat).mean(1);
}

// A passkey document's question as fed (tok[:, :T-1]): QRY PASS, one append.
inline std::vector<Turn> passkey_turns(int64_t T) { return {{T - kPassLen - 2, 2}}; }

// The second protocol: one document, then kQuestions questions in turn (questions_row), each
// QRY KEY one append, its answer VAL fed after it (teacher forcing) before the next question.
constexpr int64_t kQuestions = 4;
inline torch::Tensor questions_docs(const std::string& filler_text, int64_t T, int64_t n, uint64_t seed) {
  Rng r(seed);
  std::vector<int64_t> buf;
  for (int64_t i = 0; i < n; ++i) {
    auto row = questions_row(r, filler_text, T, kQuestions);
    buf.insert(buf.end(), row.tok.begin(), row.tok.end());
  }
  return torch::tensor(buf, torch::kLong).view({n, T});
}
inline std::vector<Turn> question_turns(int64_t T) {
  std::vector<Turn> t;
  for (int64_t k = 0; k < kQuestions; ++k) t.push_back({T - 3 * (kQuestions - k), 2});
  return t;
}
// The prompt SnapKV compresses in the questions protocol: everything before the first answer.
inline int64_t questions_prompt(int64_t T) { return T - 3 * kQuestions + 2; }
// [B, kQuestions]: 1 where question k's answer is the argmax (from the logits of the fed
// tokens tok[:, :T-1]).
inline torch::Tensor questions_correct(const torch::Tensor& logits, const torch::Tensor& tok) {
  const int64_t T = tok.size(1);
  std::vector<torch::Tensor> ok;
  for (int64_t k = 0; k < kQuestions; ++k) {
    const int64_t a = T - 3 * (kQuestions - k) + 2;  // the answer's index
    ok.push_back(logits.select(1, a - 1).argmax(-1).eq(tok.select(1, a)).to(torch::kFloat));
  }
  return torch::stack(ok, 1);
}

// Held-out text windows: BOS + T-1 bytes, n windows evenly spaced.
inline torch::Tensor text_windows(const std::string& text, int64_t T, int64_t n) {
  std::vector<int64_t> buf;
  const int64_t stride = (static_cast<int64_t>(text.size()) - T) / n;
  for (int64_t i = 0; i < n; ++i) {
    buf.push_back(kBos);
    for (int64_t j = 0; j < T - 1; ++j) buf.push_back(static_cast<unsigned char>(text[i * stride + j]));
  }
  return torch::tensor(buf, torch::kLong).view({n, T});
}

// Mean cross-entropy in bits of tok[:, 1:] given logits of tok[:, :-1].
inline double bits_per_token(const torch::Tensor& logits, const torch::Tensor& tok) {
  const int64_t T = tok.size(1);
  auto l = logits.narrow(1, 0, T - 1).reshape({-1, logits.size(-1)});
  return torch::nn::functional::cross_entropy(l, tok.narrow(1, 1, T - 1).reshape({-1})).item<double>() / std::log(2.0);
}

// The CI set: n synthetic-filler passkey documents per depth (0.1 .. 0.9) of L tokens, full
// cache, one prefill chunk. Returns the fraction answered exactly.
inline double ci_passkey_accuracy(Model& m, Layout layout, int64_t L, int64_t n) {
  auto set = passkey_docs("", L, {0.1, 0.3, 0.5, 0.7, 0.9}, n, 2024);
  auto fed = set.tok.narrow(1, 0, L - 1);
  auto lg = run_policy(m, layout, Policy::Full, eviction_for(Policy::Full, L, L), fed, L, 0).logits;
  return passkey_correct(lg, set.tok).mean().item<double>();
}

}  // namespace kvq
