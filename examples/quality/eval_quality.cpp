// What eviction does to the quality model's answers. For every policy and budget (a fraction
// of the context), in both cache layouts:
//  - passkey retrieval accuracy (all 4 values right), by needle depth and context length,
//    on held-out Brown filler;
//  - the questions protocol: one document with 4 (key, value) needles, then 4 questions in
//    turn (each one append, its answer fed before the next), accuracy per question;
//  - held-out text bits per byte (and perplexity per byte) on 1,024-byte windows;
//  - attention-output error against the full cache (relative L2 over all layers and the
//    decoded positions).
// Each document is prefilled up to the cache's capacity in one chunk (no eviction can happen
// before), then decoded one token per step with evict() after each layer's attention.
// Writes <out>/quality.csv (long format), gnuplot data and PNG plots.
//
//   eval_quality --weights examples/quality/weights.pt --data build-quality/data --out build-quality/eval
#include "cli.hpp"
#include "evaluate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

using namespace kvq;

namespace {

constexpr const char* kUsage = R"(Usage: eval_quality [options]

Runs every policy at every budget in each cache layout over passkey documents and held-out
text; writes OUT/quality.csv, gnuplot data and plots, and prints a summary table.

Options (default in brackets):
  --weights PATH         the model's weights [examples/quality/weights.pt]
  --data DIR             brown_heldout.txt [build-quality/data]
  --out DIR              results [build-quality/eval]
  --contexts L,...       passkey document lengths, 12 .. 2^20 [256,512,1024]
  --budgets P,...        cache capacities, percent of the context, 1 .. 100 [10,25,50]
  --depths D,...         needle depths, fractions of the filler, 0 .. 1 [0.1,0.3,0.5,0.7,0.9]
  --policies P,...       eviction policies (full, h2o, mean_observed, tova, decay, h2o_pyramid,
                         sinks_window, random, snapkv, h2o_recall, h2o_recall_paged,
                         h2o_recall_mean, h2o_recall_turn, snapkv_recall_turn; snapkv and
                         the _turn ones: retrieval only)
                         [h2o,mean_observed,tova,decay,h2o_pyramid,sinks_window,random,snapkv,
                          h2o_recall,h2o_recall_paged,h2o_recall_mean,h2o_recall_turn,
                          snapkv_recall_turn]
  --recall-page N        h2o_recall's tier page size, tokens, 1 .. 4096 [1]
  --recall-tokens N      the recall budget per step of h2o_recall, h2o_recall_paged and
                         h2o_recall_mean, tokens, 1 .. 2^20 [3]
  --paged-page N         h2o_recall_paged's tier page size (pages scored by the heads' mean
                         logit), tokens, 1 .. 4096 [64]
  --paged-rescore N      h2o_recall_paged's two-level pool (recall's rescore), tokens, more
                         than --recall-tokens and at least --paged-page, up to 2^20 [256]
  --mean-page N          h2o_recall_mean's tier page size (pages scored by the heads' mean
                         logit, TierScoring::kHeadMean), tokens, 1 .. 4096 [1]
  --mean-rescore N       its two-level pool, tokens: 0 .. --recall-tokens (none: whole
                         pages), or at least --mean-page, up to 2^20 [0]
  --turn-page N          the _turn policies' tier page size, tokens, 1 .. 4096 [4]
  --turn-share X         their recall budget per question, a share of the heavy-hitter
                         budget, 0 .. 1 [0.25]
  --layouts L,...        expanded, latent [expanded,latent]
  --docs N               passkey documents per context and depth, >= 1 [4]
  --text-windows N       held-out text windows, >= 1 [8]
  --text-len N           tokens per text window, 2 .. 2^20 [1024]
  --threads N            intra-op threads per job, 1 .. 1024 [1]
  --jobs N               (policy, budget) runs at a time, 1 .. 1024 [2]
  --heat-budget P        the retrieval heatmap's budget (one of --budgets), percent
                         [25, or the budget closest to it]
  --no-plots             no gnuplot run (data files only)
  --write-ci-json PATH   write the CI test's reference values (tests/quality) to PATH and exit
  --ci-context L         its document length, 12 .. 2^20 [512]
  --ci-docs N            its documents per depth, >= 1 [8]
  --help                 print this and exit
)";

struct Args {
  std::string weights = "examples/quality/weights.pt", data = "build-quality/data", out = "build-quality/eval";
  std::vector<int64_t> contexts{256, 512, 1024}, budgets{10, 25, 50};
  std::vector<double> depths{0.1, 0.3, 0.5, 0.7, 0.9};
  std::vector<std::string> policies{"h2o",          "mean_observed", "tova",   "decay",      "h2o_pyramid",
                                    "sinks_window", "random",        "snapkv", "h2o_recall", "h2o_recall_paged",
                                    "h2o_recall_mean", "h2o_recall_turn", "snapkv_recall_turn"};
  RecallSettings recall;
  std::vector<std::string> layouts{"expanded", "latent"};
  int64_t docs = 4, text_windows = 8, text_len = 1024, threads = 1, jobs = 2, heat_budget = 25;
  bool heat_given = false;  // --heat-budget given: it must be one of --budgets; else the closest to 25
  bool plots = true;
  std::string ci_json;  // --write-ci-json: write the CI test's reference values and exit
  int64_t ci_context = 512, ci_docs = 8;
};

using kvevict_cli::parse_int;
using kvevict_cli::parse_int_list;

// Parses argv (`--flag value` or `--flag=value`); throws kvevict_cli::UsageError on a bad
// command line, returns false for --help. A passkey document is 2 * kPassLen + 4 tokens
// before any filler (BOS, PASS v1..v4, QRY PASS v1..v4).
bool parse(int argc, char** argv, Args& a) {
  constexpr int64_t kMinDoc = 2 * kPassLen + 4, kMaxLen = int64_t{1} << 20;
  const auto policy = [](const std::string& f, const std::string& item) {
    return kvevict_cli::parse_as(f, item, [](const std::string& name) {
      policy_from(name);  // throws on an unknown name
      return name;
    });
  };
  const auto depth = [](const std::string& f, const std::string& item) {
    return kvevict_cli::parse_double(f, item, 0, 1);
  };
  const bool help = !kvevict_cli::parse_flags(
      argc, argv,
      {
          {"--weights", [&](auto&, auto& v) { a.weights = v; }},
          {"--data", [&](auto&, auto& v) { a.data = v; }},
          {"--out", [&](auto&, auto& v) { a.out = v; }},
          {"--contexts", [&](auto& f, auto& v) { a.contexts = parse_int_list(f, v, kMinDoc, kMaxLen); }},
          {"--budgets", [&](auto& f, auto& v) { a.budgets = parse_int_list(f, v, 1, 100); }},
          {"--depths", [&](auto& f, auto& v) { a.depths = kvevict_cli::parse_list(f, v, depth); }},
          {"--policies", [&](auto& f, auto& v) { a.policies = kvevict_cli::parse_list(f, v, policy); }},
          {"--layouts",
           [&](auto& f, auto& v) { a.layouts = kvevict_cli::parse_choice_list(f, v, {"expanded", "latent"}); }},
          {"--docs", [&](auto& f, auto& v) { a.docs = parse_int(f, v, 1); }},
          {"--text-windows", [&](auto& f, auto& v) { a.text_windows = parse_int(f, v, 1); }},
          {"--text-len", [&](auto& f, auto& v) { a.text_len = parse_int(f, v, 2, kMaxLen); }},
          {"--threads", [&](auto& f, auto& v) { a.threads = parse_int(f, v, 1, 1024); }},
          {"--jobs", [&](auto& f, auto& v) { a.jobs = parse_int(f, v, 1, 1024); }},
          {"--heat-budget",
           [&](auto& f, auto& v) {
             a.heat_budget = parse_int(f, v, 1, 100);
             a.heat_given = true;
           }},
          {"--write-ci-json",
           [&](auto& f, auto& v) {
             kvevict_cli::check_writable(f, v);
             a.ci_json = v;
           }},
          {"--ci-context", [&](auto& f, auto& v) { a.ci_context = parse_int(f, v, kMinDoc, kMaxLen); }},
          {"--ci-docs", [&](auto& f, auto& v) { a.ci_docs = parse_int(f, v, 1); }},
          {"--recall-page", [&](auto& f, auto& v) { a.recall.step_page = parse_int(f, v, 1, 4096); }},
          {"--recall-tokens", [&](auto& f, auto& v) { a.recall.step_tokens = parse_int(f, v, 1, 1 << 20); }},
          {"--paged-page", [&](auto& f, auto& v) { a.recall.paged_page = parse_int(f, v, 1, 4096); }},
          {"--paged-rescore", [&](auto& f, auto& v) { a.recall.paged_rescore = parse_int(f, v, 1, 1 << 20); }},
          {"--mean-page", [&](auto& f, auto& v) { a.recall.mean_page = parse_int(f, v, 1, 4096); }},
          {"--mean-rescore", [&](auto& f, auto& v) { a.recall.mean_rescore = parse_int(f, v, 0, 1 << 20); }},
          {"--turn-page", [&](auto& f, auto& v) { a.recall.turn_page = parse_int(f, v, 1, 4096); }},
          {"--turn-share", [&](auto& f, auto& v) { a.recall.turn_share = kvevict_cli::parse_double(f, v, 0, 1); }},
      },
      {{"--no-plots", [&] { a.plots = false; }}});
  if (help) return false;
  // The pools against the pages and the recall budget (recall() would throw mid-run otherwise).
  const auto uses = [&](const char* name) { return std::find(a.policies.begin(), a.policies.end(), name) != a.policies.end(); };
  const auto& r = a.recall;
  if (uses("h2o_recall_paged") && (r.paged_rescore <= r.step_tokens || r.paged_rescore < r.paged_page))
    throw kvevict_cli::UsageError("--paged-rescore must be more than --recall-tokens (" + std::to_string(r.step_tokens) +
                                  ") and at least --paged-page (" + std::to_string(r.paged_page) +
                                  ") for h2o_recall_paged's two-level recall, got " + std::to_string(r.paged_rescore));
  if (uses("h2o_recall_mean") && r.mean_rescore > r.step_tokens && r.mean_rescore < r.mean_page)
    throw kvevict_cli::UsageError("--mean-rescore must be at most --recall-tokens (" + std::to_string(r.step_tokens) +
                                  ", whole pages) or at least --mean-page (" + std::to_string(r.mean_page) + "), got " +
                                  std::to_string(r.mean_rescore));
  return true;
}

struct Csv {
  std::ofstream f;
  explicit Csv(const std::string& path) : f(path) {
    if (!f) throw std::runtime_error("cannot write " + path);
    f << "layout,policy,budget_pct,context,depth,metric,value,n\n";
  }
  void row(const std::string& layout, const std::string& policy, int64_t budget, int64_t context, const std::string& depth,
           const std::string& metric, double value, int64_t n) {
    f << layout << ',' << policy << ',' << budget << ',' << context << ',' << depth << ',' << metric << ',' << value << ','
      << n << '\n';
    f.flush();
  }
};

std::string fmt_depth(double d) {
  char b[16];
  std::snprintf(b, sizeof b, "%.2f", d);
  return b;
}

}  // namespace

int main(int argc, char** argv) try {
  Args a;
  if (!parse(argc, argv, a)) {
    std::printf("%s", kUsage);
    return 0;
  }
  torch::set_num_threads(static_cast<int>(a.threads));
  std::filesystem::create_directories(a.out);
  Model m{Config()};
  kvevict_cli::check_readable("--weights", a.weights);
  if (std::find(a.budgets.begin(), a.budgets.end(), a.heat_budget) == a.budgets.end()) {
    if (a.heat_given)
      throw kvevict_cli::UsageError("--heat-budget " + std::to_string(a.heat_budget) + " is not one of --budgets");
    a.heat_budget = *std::min_element(a.budgets.begin(), a.budgets.end(), [](int64_t x, int64_t y) {
      return std::abs(x - 25) < std::abs(y - 25);
    });
  }
  load_weights(m, a.weights);
  m->eval();
  if (!a.ci_json.empty()) {
    // The value tests/quality checks against, measured here on the shipped weights.
    const double e = ci_passkey_accuracy(m, Layout::Expanded, a.ci_context, a.ci_docs);
    const double l = ci_passkey_accuracy(m, Layout::Latent, a.ci_context, a.ci_docs);
    std::ofstream j(a.ci_json);
    j << "{\n  \"weights\": \"weights.pt\",\n  \"ci_context\": " << a.ci_context << ",\n  \"ci_docs_per_depth\": " << a.ci_docs
      << ",\n  \"ci_depths\": [0.1, 0.3, 0.5, 0.7, 0.9],\n  \"ci_filler\": \"synthetic pseudo-words (tasks.hpp), seed 2024\",\n"
      << "  \"ci_full_cache_passkey_accuracy\": " << e << ",\n  \"ci_full_cache_passkey_accuracy_latent\": " << l
      << ",\n  \"ci_tolerance\": 0.05\n}\n";
    std::printf("wrote %s: full-cache passkey accuracy %.4f (expanded), %.4f (latent), %lld docs at %lld tokens\n",
                a.ci_json.c_str(), e, l, (long long)(5 * a.ci_docs), (long long)a.ci_context);
    return 0;
  }
  const std::string held = read_file(a.data + "/brown_heldout.txt");
  Csv csv(a.out + "/quality.csv");

  // SnapKV compresses a prompt once, at its end (Model::prefill_compressed): a passkey
  // document's prompt is everything before the first answer token (the question included), a
  // questions document's everything before the first answer. Held-out text has no prompt/answer
  // split and no question, so SnapKV and h2o_recall_turn are measured on retrieval only.
  const auto text_policy = [](const std::string& pname) {
    const Policy p = policy_from(pname);
    return p != Policy::SnapKV && p != Policy::H2ORecallTurn && p != Policy::SnapKVRecallTurn;
  };
  const int64_t n_text_policies = std::count_if(a.policies.begin(), a.policies.end(), text_policy);
  // Work items, for progress: per layout, per context (two retrieval tasks) + text, per policy x budget.
  const int64_t units_per_layout =
      2 * static_cast<int64_t>(a.contexts.size()) * (1 + a.policies.size() * a.budgets.size()) + 1 +
      n_text_policies * static_cast<int64_t>(a.budgets.size());
  const int64_t total = units_per_layout * a.layouts.size();
  int64_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  auto progress = [&](const std::string& what) {
    ++done;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "[%3lld/%3lld] %6.0f s elapsed, ~%4.0f s left  %s\n", (long long)done, (long long)total, s,
                 s / done * (total - done), what.c_str());
  };

  // results[layout][policy][budget][context] = accuracy per depth (passkey), mean (questions)
  std::map<std::string, std::map<std::string, std::map<int64_t, std::map<int64_t, std::vector<double>>>>> acc;
  std::map<std::string, std::map<std::string, std::map<int64_t, double>>> bpb, err_text;
  std::map<std::string, std::map<std::string, std::map<int64_t, std::map<int64_t, double>>>> tok_acc, q_acc;

  enum class Kind { Passkey, Questions, Text };
  const int64_t question_docs = a.docs * static_cast<int64_t>(a.depths.size());  // as many as passkey documents
  for (const auto& lname : a.layouts) {
    const Layout layout = lname == "latent" ? Layout::Latent : Layout::Expanded;
    // Tasks: per context length the passkey and the questions documents, then the text windows.
    struct Task {
      std::string name;
      torch::Tensor tok;  // [B, T] incl. the answers
      Kind kind;
      int64_t context;
    };
    std::vector<Task> tasks;
    for (auto L : a.contexts) {
      tasks.push_back({"passkey@" + std::to_string(L), passkey_docs(held, L, a.depths, a.docs, 1000 + L).tok, Kind::Passkey, L});
      tasks.push_back({"questions@" + std::to_string(L), questions_docs(held, L, question_docs, 3000 + L), Kind::Questions, L});
    }
    tasks.push_back({"text@" + std::to_string(a.text_len), text_windows(held, a.text_len, a.text_windows), Kind::Text, a.text_len});

    for (auto& task : tasks) {
      const int64_t T = task.tok.size(1);
      auto fed = task.tok.narrow(1, 0, T - 1);
      const int64_t context = task.context;
      const std::vector<Turn> turns = task.kind == Kind::Passkey     ? passkey_turns(T)
                                      : task.kind == Kind::Questions ? question_turns(T)
                                                                     : std::vector<Turn>{};
      std::vector<torch::Tensor> ref_attn;
      auto full = run_policy(m, layout, Policy::Full, eviction_for(Policy::Full, T, T), fed, T, 0, nullptr, &ref_attn,
                             true, turns);
      auto record = [&](const std::string& pname, int64_t budget, const RunResult& r) {
        const double err = r.ref_sq > 0 ? std::sqrt(r.err_sq / r.ref_sq) : 0.0;
        if (task.kind == Kind::Passkey) {
          auto ok = passkey_correct(r.logits, task.tok);
          std::vector<double> per_depth;
          for (size_t d = 0; d < a.depths.size(); ++d) {
            const double v = ok.narrow(0, d * a.docs, a.docs).mean().item<double>();
            per_depth.push_back(v);
            csv.row(lname, pname, budget, context, fmt_depth(a.depths[d]), "passkey_acc", v, a.docs);
          }
          csv.row(lname, pname, budget, context, "all", "passkey_acc", ok.mean().item<double>(), ok.size(0));
          const double tacc = passkey_token_acc(r.logits, task.tok).mean().item<double>();
          csv.row(lname, pname, budget, context, "all", "passkey_token_acc", tacc, ok.size(0) * kPassLen);
          tok_acc[lname][pname][budget][context] = tacc;
          csv.row(lname, pname, budget, context, "all", "attn_rel_err_passkey", err, ok.size(0));
          acc[lname][pname][budget][context] = per_depth;
        } else if (task.kind == Kind::Questions) {
          auto ok = questions_correct(r.logits, task.tok);  // [B, kQuestions]
          for (int64_t k = 0; k < kQuestions; ++k)
            csv.row(lname, pname, budget, context, "q" + std::to_string(k + 1), "question_acc",
                    ok.select(1, k).mean().item<double>(), ok.size(0));
          csv.row(lname, pname, budget, context, "all", "question_acc", ok.mean().item<double>(), ok.numel());
          q_acc[lname][pname][budget][context] = ok.mean().item<double>();
        } else {
          const double b = bits_per_token(r.logits, task.tok);
          csv.row(lname, pname, budget, context, "all", "text_bits_per_byte", b, fed.numel());
          csv.row(lname, pname, budget, context, "all", "text_ppl_per_byte", std::pow(2.0, b), fed.numel());
          csv.row(lname, pname, budget, context, "all", "attn_rel_err_text", err, fed.numel());
          bpb[lname][pname][budget] = b;
          err_text[lname][pname][budget] = err;
        }
      };
      record("full", 100, full);
      progress(lname + " " + task.name + " full cache");
      // (policy, budget) runs are independent: --jobs worker threads, one intra-op thread each.
      std::vector<std::pair<std::string, int64_t>> jobs;
      for (const auto& pname : a.policies)
        if (task.kind != Kind::Text || text_policy(pname))
          for (auto budget : a.budgets) jobs.emplace_back(pname, budget);
      std::mutex mu;
      size_t next = 0;
      std::exception_ptr failed;  // the first job that threw: the others stop, main rethrows it
      auto worker = [&] {
        for (;;) try {
          size_t j;
          {
            std::lock_guard<std::mutex> lk(mu);
            if (next == jobs.size() || failed) return;
            j = next++;
          }
          const auto& [pname, budget] = jobs[j];
          const Policy p = policy_from(pname);
          const int64_t cap = std::max<int64_t>(1, (budget * context + 50) / 100);
          auto e = eviction_for(p, cap, T);
          // SnapKV: the prompt, then compress
          const int64_t prefill = !compresses_prompt(p)        ? cap
                                  : task.kind == Kind::Passkey ? T - kPassLen
                                                               : questions_prompt(T);
          auto r = run_policy(m, layout, p, e, fed, prefill, 77 + budget, &ref_attn, nullptr, true, turns, a.recall);
          std::lock_guard<std::mutex> lk(mu);
          record(pname, budget, r);
          progress(lname + " " + task.name + " " + pname + " " + std::to_string(budget) + "% (capacity " +
                   std::to_string(cap) + ")");
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu);
          if (!failed) failed = std::current_exception();
          return;
        }
      };
      std::vector<std::thread> pool;
      for (int64_t i = 0; i < a.jobs; ++i) pool.emplace_back(worker);
      for (auto& t : pool) t.join();
      if (failed) std::rethrow_exception(failed);
    }
  }

  // Layouts must agree: same accuracy, bits per byte within 1e-3. Where a recall policy
  // differs, the layouts' digests bound different keys (per head vs the shared latent): reported.
  if (a.layouts.size() == 2) {
    double max_acc = 0, max_bpb = 0, max_q = 0;
    for (auto& [p, byb] : acc["expanded"])
      for (auto& [b, byc] : byb)
        for (auto& [c, v] : byc)
          for (size_t d = 0; d < v.size(); ++d) max_acc = std::max(max_acc, std::abs(v[d] - acc["latent"][p][b][c][d]));
    for (auto& [p, byb] : q_acc["expanded"])
      for (auto& [b, byc] : byb)
        for (auto& [c, v] : byc) max_q = std::max(max_q, std::abs(v - q_acc["latent"][p][b][c]));
    for (auto& [p, byb] : bpb["expanded"])
      for (auto& [b, v] : byb) max_bpb = std::max(max_bpb, std::abs(v - bpb["latent"][p][b]));
    std::printf("layouts: max |passkey accuracy difference| %.4f, max |questions accuracy difference| %.4f, "
                "max |bits-per-byte difference| %.2e -> %s\n",
                max_acc, max_q, max_bpb,
                max_acc <= 1.0 / (a.docs * 2) + 1e-9 && max_q <= 0.05 + 1e-9 && max_bpb < 1e-3 ? "agree" : "DISAGREE");
  }

  // Summary table and gnuplot data (first layout).
  const std::string L0 = a.layouts.front();
  std::vector<std::string> names{"full"};
  for (auto& p : a.policies) names.push_back(p);
  auto mean_tok = [&](const std::string& p, int64_t b) {
    double s = 0;
    int n = 0;
    for (auto& [c, v] : tok_acc[L0][p][b]) s += v, ++n;
    return n ? s / n : 0.0;
  };
  auto mean_acc = [&](const std::string& p, int64_t b, int64_t ctx) {  // ctx < 0: all contexts
    double s = 0;
    int n = 0;
    for (auto& [c, v] : acc[L0][p][b])
      if (ctx < 0 || c == ctx)
        for (double x : v) s += x, ++n;
    return n ? s / n : 0.0;
  };
  auto mean_q = [&](const std::string& p, int64_t b) {  // the questions protocol, all contexts
    double s = 0;
    int n = 0;
    for (auto& [c, v] : q_acc[L0][p][b]) s += v, ++n;
    return n ? s / n : 0.0;
  };
  // A text metric of (policy, budget), NaN where it was not measured (SnapKV).
  auto text_metric = [&](std::map<std::string, std::map<std::string, std::map<int64_t, double>>>& m, const std::string& p,
                         int64_t b) {
    const auto& byb = m[L0][p];
    const auto it = byb.find(b);
    return it == byb.end() ? NAN : it->second;
  };
  std::printf("\n%s layout: passkey accuracy, exact (all contexts and depths) | per answer token | 4 questions in "
              "turn, accuracy | text bits/byte | attention rel. error (text)\n", L0.c_str());
  std::printf("%-16s", "policy");
  for (auto b : a.budgets) std::printf(" | %5lld%%                          ", (long long)b);
  std::printf("\n");
  for (auto& p : a.policies) {
    std::printf("%-16s", p.c_str());
    for (auto b : a.budgets)
      std::printf(" | %5.3f %5.3f %5.3f %5.3f %6.4f", mean_acc(p, b, -1), mean_tok(p, b), mean_q(p, b),
                  text_metric(bpb, p, b), text_metric(err_text, p, b));
    std::printf("\n");
  }
  std::printf("%-16s | %5.3f %5.3f %5.3f %5.3f (100%%, no eviction)\n", "full", mean_acc("full", 100, -1),
              mean_tok("full", 100), mean_q("full", 100), bpb[L0]["full"][100]);

  {
    std::ofstream d(a.out + "/by_budget.dat");
    d << "# policy blocks: budget_pct passkey_acc_all passkey_acc_ctx" << a.contexts.back()
      << " text_bpb text_ppl attn_err_text passkey_token_acc question_acc\n";
    for (auto& p : a.policies) {
      d << "# " << p << "\n";
      for (auto b : a.budgets)
        d << b << ' ' << mean_acc(p, b, -1) << ' ' << mean_acc(p, b, a.contexts.back()) << ' ' << text_metric(bpb, p, b)
          << ' ' << std::pow(2.0, text_metric(bpb, p, b)) << ' ' << text_metric(err_text, p, b) << ' ' << mean_tok(p, b)
          << ' ' << mean_q(p, b) << "\n";  // NaN: not measured (gnuplot skips the point)
      d << "\n\n";
    }
    std::ofstream h(a.out + "/heatmap.dat");  // per policy block: depth_index context_index acc
    for (auto& p : names) {
      const int64_t b = p == "full" ? 100 : a.heat_budget;
      h << "# " << p << " at " << b << "%\n";
      for (size_t ci = 0; ci < a.contexts.size(); ++ci) {
        auto& v = acc[L0][p][b][a.contexts[ci]];
        for (size_t di = 0; di < a.depths.size(); ++di) h << di << ' ' << ci << ' ' << (di < v.size() ? v[di] : 0) << "\n";
        h << "\n";
      }
      h << "\n";
    }
  }
  if (a.plots) {
    std::ofstream gp(a.out + "/plots.gp");
    std::string titles;
    for (size_t i = 0; i < a.policies.size(); ++i) titles += (i ? " " : "") + a.policies[i];
    std::string xt, yt;
    for (size_t i = 0; i < a.depths.size(); ++i) xt += (i ? ", " : "") + std::string("\"") + fmt_depth(a.depths[i]) + "\" " + std::to_string(i);
    for (size_t i = 0; i < a.contexts.size(); ++i) yt += (i ? ", " : "") + std::string("\"") + std::to_string(a.contexts[i]) + "\" " + std::to_string(i);
    gp << "set terminal pngcairo size 900,560 font ',11' noenhanced\nset datafile commentschars '#'\n"
       << "names = '" << titles << "'\nset key outside right\nset grid\nset xlabel 'budget (% of context)'\n"
       << "set logscale x\nset xtics (5, 10, 25, 50, 75, 100)\n"
       << "set output '" << a.out << "/retrieval_vs_budget.png'\nset ylabel 'passkey accuracy (all contexts, depths)'\n"
       << "set yrange [0:1.05]\nset title 'Retrieval vs KV budget (" << L0 << " layout; full cache = " << mean_acc("full", 100, -1) << ")'\n"
       << "plot for [i=0:words(names)-1] '" << a.out << "/by_budget.dat' index i using 1:2 with linespoints lw 2 title word(names, i+1)\n"
       << "set output '" << a.out << "/retrieval_tokens_vs_budget.png'\nset ylabel 'passkey answer tokens right (of 4)'\n"
       << "set title 'Retrieval per answer token vs KV budget (" << L0 << " layout; full cache = " << mean_tok("full", 100) << ")'\n"
       << "plot for [i=0:words(names)-1] '" << a.out << "/by_budget.dat' index i using 1:7 with linespoints lw 2 title word(names, i+1)\n"
       << "set output '" << a.out << "/questions_vs_budget.png'\nset ylabel 'accuracy, 4 questions in turn'\n"
       << "set title 'Questions in turn vs KV budget (" << L0 << " layout; full cache = " << mean_q("full", 100) << ")'\n"
       << "plot for [i=0:words(names)-1] '" << a.out << "/by_budget.dat' index i using 1:8 with linespoints lw 2 title word(names, i+1)\n"
       << "set output '" << a.out << "/perplexity_vs_budget.png'\nset ylabel 'held-out perplexity per byte'\nset autoscale y\n"
       << "set title 'Held-out text perplexity vs KV budget (" << a.text_len << "-byte windows; full cache = " << std::pow(2.0, bpb[L0]["full"][100]) << ")'\n"
       << "plot for [i=0:words(names)-1] '" << a.out << "/by_budget.dat' index i using 1:5 with linespoints lw 2 title word(names, i+1)\n"
       << "set output '" << a.out << "/attn_error_vs_budget.png'\nset ylabel 'attention output relative L2 error'\n"
       << "set title 'Attention-output error vs full cache (text)'\n"
       << "plot for [i=0:words(names)-1] '" << a.out << "/by_budget.dat' index i using 1:6 with linespoints lw 2 title word(names, i+1)\n"
       << "unset logscale x\nunset grid\nset terminal pngcairo size " << 300 * names.size() << ",360 font ',10' noenhanced\n"
       << "set output '" << a.out << "/retrieval_heatmap.png'\nset multiplot layout 1," << names.size()
       << " title 'Passkey accuracy by needle depth (x) and context length (y); policies at " << a.heat_budget << "% budget'\n"
       << "set xtics (" << xt << ")\nset ytics (" << yt << ")\nset xlabel 'depth'\nset ylabel 'context'\nset cbrange [0:1]\n"
       << "set palette defined (0 '#b2182b', 0.5 '#f7f7f7', 1 '#2166ac')\nunset colorbox\n"
       << "set xrange [-0.5:" << a.depths.size() - 0.5 << "]\nset yrange [-0.5:" << a.contexts.size() - 0.5 << "]\n";
    for (size_t i = 0; i < names.size(); ++i)
      gp << "set title '" << names[i] << "'\nplot '" << a.out << "/heatmap.dat' index " << i
         << " using 1:2:3 with image notitle, '' index " << i << " using 1:2:(sprintf('%.2f',$3)) with labels notitle\n";
    gp << "unset multiplot\n";
    gp.close();
    const int rc = std::system(("gnuplot '" + a.out + "/plots.gp'").c_str());
    std::printf("plots (%s): %s/{retrieval_vs_budget,retrieval_tokens_vs_budget,questions_vs_budget,perplexity_vs_budget,attn_error_vs_budget,retrieval_heatmap}.png\n",
                rc == 0 ? "gnuplot ok" : "gnuplot FAILED", a.out.c_str());
  }
  std::printf("csv: %s/quality.csv\n", a.out.c_str());
  return 0;
} catch (const kvevict_cli::UsageError& e) {
  std::fprintf(stderr, "eval_quality: %s (see --help)\n", e.what());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
