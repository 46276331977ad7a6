// Trains the quality model (model.hpp) on Brown text mixed with retrieval rows (tasks.hpp),
// with a curriculum (step_len below): short copying rows first (forms induction), then a
// geometric ramp of the context length up to --max-len. Rows and schedule are functions of
// (--seed, step) alone; --minutes only stops a run early (the log says so). Writes checkpoints
// (LibTorch serialization) every --eval-every steps and, at the end, the shipped fp16 weights.
//
//   train_quality --data build-quality/data --out build-quality/run --steps 3600 --threads 2
#include "cli.hpp"
#include "model.hpp"
#include "tasks.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <tuple>
#include <string>

using namespace kvq;

namespace {

constexpr const char* kUsage = R"(Usage: train_quality [options]

Trains the quality model; writes checkpoints to OUT/ckpt and the fp16 weights to OUT/weights.pt.

Options (default in brackets):
  --data DIR              brown_train.txt and brown_heldout.txt [build-quality/data]
  --out DIR               checkpoints and weights [build-quality/run]
  --resume DIR            continue from the checkpoint in DIR (model.pt, optim.pt, step.txt)
  --steps N               optimizer steps, >= 1 [4000]
  --tokens-per-step N     tokens per step, at least one row, 1 .. 2^24 [2048]
  --max-len N             longest row, --warm-len .. 2^20 [1024]
  --warm N                steps of the induction phase, >= 0 [300]
  --warm-len N            row length in the induction phase, 16 .. 2^20 [24]
  --eval-every N          evaluate and save every N steps, >= 1 [100]
  --threads N             intra-op threads, 1 .. 1024 [2]
  --seed N                rows and initialization, >= 0 [1234]
  --lr X                  peak AdamW learning rate, 0 .. 1 [5e-3]
  --minutes X             stop early after X minutes (plus 30 s), >= 0 [no limit]
  --stop-step N           stop at step N, the schedule still that of --steps, >= 0 [none]
  --dry-run               build every step's rows (checks them), print the schedule, exit
  --help                  print this and exit
)";

struct Args {
  std::string data = "build-quality/data", out = "build-quality/run", resume;
  int64_t steps = 4000, tokens_per_step = 2048, max_len = 1024, warm = 300, warm_len = 24, eval_every = 100, threads = 2;
  int64_t seed = 1234, stop_step = -1;
  bool dry_run = false;  // --dry-run: build every step's rows (checks them), print the schedule, exit
  double lr = 5e-3, minutes = 1e9;
};

using kvevict_cli::parse_double;
using kvevict_cli::parse_int;

// Parses argv (`--flag value` or `--flag=value`); throws kvevict_cli::UsageError on a bad
// command line, returns false for --help. Rows are 16 tokens at least: make_row gives an
// MQAR row at most (T - 8) / 8 (key, value) pairs, none below 16 (below 12 a passkey row does
// not fit at all).
bool parse(int argc, char** argv, Args& a) {
  constexpr int64_t kMaxRow = int64_t{1} << 20;
  const bool run = kvevict_cli::parse_flags(
      argc, argv,
      {
          {"--data", [&](auto&, auto& v) { a.data = v; }},
          {"--out", [&](auto&, auto& v) { a.out = v; }},
          {"--resume", [&](auto&, auto& v) { a.resume = v; }},
          {"--steps", [&](auto& f, auto& v) { a.steps = parse_int(f, v, 1); }},
          {"--tokens-per-step", [&](auto& f, auto& v) { a.tokens_per_step = parse_int(f, v, 1, int64_t{1} << 24); }},
          {"--max-len", [&](auto& f, auto& v) { a.max_len = parse_int(f, v, 16, kMaxRow); }},
          {"--warm", [&](auto& f, auto& v) { a.warm = parse_int(f, v, 0); }},
          {"--warm-len", [&](auto& f, auto& v) { a.warm_len = parse_int(f, v, 16, kMaxRow); }},
          {"--eval-every", [&](auto& f, auto& v) { a.eval_every = parse_int(f, v, 1); }},
          {"--threads", [&](auto& f, auto& v) { a.threads = parse_int(f, v, 1, 1024); }},
          {"--seed", [&](auto& f, auto& v) { a.seed = parse_int(f, v, 0); }},
          {"--lr", [&](auto& f, auto& v) { a.lr = parse_double(f, v, 0, 1); }},
          {"--minutes", [&](auto& f, auto& v) { a.minutes = parse_double(f, v, 0); }},
          {"--stop-step", [&](auto& f, auto& v) { a.stop_step = parse_int(f, v, 0); }},
      },
      {{"--dry-run", [&] { a.dry_run = true; }}});
  if (!run) return false;
  if (a.max_len < a.warm_len) {
    throw kvevict_cli::UsageError("--max-len " + std::to_string(a.max_len) + " is below --warm-len " +
                                  std::to_string(a.warm_len));
  }
  return true;
}

// The curriculum, a function of the step alone (so a rerun with the same flags gives the same
// rows and the same schedule):
//  - induction phase, steps [0, --warm): rows of --warm-len tokens, 70% copying. Short rows
//    matter: at 24 tokens copying forms in ~200 steps; at 48 and 128 tokens it had not formed
//    after 320-480 (the induction circuit starts from a near-uniform softmax, whose signal falls
//    with the row length);
//  - ramp, to 50% of --steps: the longest row length grows geometrically from --warm-len to
//    --max-len; each step draws the longest length (half the time) or a shorter power of two;
//  - then: rows of max/4, max/2 and max (twice as often).
int64_t step_len(Rng& r, const Args& a, int64_t step) {
  if (step < a.warm) return a.warm_len;
  const double f = std::min(1.0, static_cast<double>(step - a.warm) / std::max<int64_t>(1, a.steps / 2 - a.warm));
  if (f >= 1.0) {
    const int64_t m = a.max_len;
    const int64_t lens[4] = {std::max(a.warm_len, m / 4), std::max(a.warm_len, m / 2), m, m};
    return lens[r.uniform(4)];
  }
  const int64_t top = static_cast<int64_t>(
      std::llround(a.warm_len * std::pow(static_cast<double>(a.max_len) / a.warm_len, f)));
  if (r.uniform(2) == 0) return top;
  std::vector<int64_t> lower;
  for (int64_t t = 32; t < top; t *= 2) lower.push_back(t);
  return lower.empty() ? top : lower[r.uniform(static_cast<int64_t>(lower.size()))];
}

Row make_row(Rng& r, const std::string& text, int64_t T, int64_t step, const Args& a) {
  // Half of the retrieval rows use synthetic filler, so the CI test can run without the corpus.
  const std::string empty;
  const std::string& fill = r.uniform(2) ? text : empty;
  const double u = r.unit();
  const int64_t pairs = std::min<int64_t>(2 + r.uniform(7), (T - 8) / 8), queries = std::min<int64_t>(4 + r.uniform(8), (T - 8) / 8);
  if (step < a.warm) {
    if (u < 0.70) return copy_row(r, fill, T, T / 8 + r.uniform(T / 4));
    if (u < 0.85) return mqar_row(r, fill, T, pairs, queries);
    return passkey_row(r, fill, T, -1);
  }
  if (u < 0.25) return text_row(r, text, T);
  if (u < 0.50) return mqar_row(r, fill, T, pairs, queries);
  if (u < 0.80) return passkey_row(r, fill, T, -1);
  return copy_row(r, fill, T, std::min<int64_t>(8 + r.uniform(std::min<int64_t>(56, T / 4)), (T - 4) / 2));
}

// Passkey accuracy (all four values right) on held-out filler, full forward; n docs per length.
double passkey_eval(Model& m, const std::string& text, int64_t T, int64_t n, uint64_t seed) {
  torch::NoGradGuard g;
  Rng r(seed);
  std::vector<int64_t> buf;
  for (int64_t i = 0; i < n; ++i) {
    auto row = passkey_row(r, text, T, (i + 0.5) / n);
    buf.insert(buf.end(), row.tok.begin(), row.tok.end());
  }
  auto tok = torch::tensor(buf, torch::kLong).view({n, T});
  auto logits = m->forward(tok.narrow(1, 0, T - 1));
  auto pred = logits.narrow(1, T - 1 - kPassLen, kPassLen).argmax(-1);
  auto ok = pred.eq(tok.narrow(1, T - kPassLen, kPassLen)).all(1);
  return ok.to(torch::kFloat).mean().item<double>();
}

double text_bpb(Model& m, const std::string& text, int64_t T, int64_t n) {
  torch::NoGradGuard g;
  std::vector<int64_t> buf;
  const int64_t stride = (static_cast<int64_t>(text.size()) - T) / n;
  for (int64_t i = 0; i < n; ++i) {
    buf.push_back(kBos);
    for (int64_t j = 0; j < T - 1; ++j) buf.push_back(static_cast<unsigned char>(text[i * stride + j]));
  }
  auto tok = torch::tensor(buf, torch::kLong).view({n, T});
  auto logits = m->forward(tok.narrow(1, 0, T - 1));
  auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}),
                                                   tok.narrow(1, 1, T - 1).reshape({-1}));
  return loss.item<double>() / std::log(2.0);
}

// The rows of step `step`: {T, B * T tokens, their categories}. They depend only on
// (--seed, step): resuming reproduces the same run.
std::tuple<int64_t, std::vector<int64_t>, std::vector<int8_t>> make_batch(const std::string& text, const Args& a,
                                                                          int64_t step) {
  Rng r(static_cast<uint64_t>(a.seed) * 1000003ull + static_cast<uint64_t>(step));
  const int64_t T = step_len(r, a, step), B = std::max<int64_t>(1, a.tokens_per_step / T);
  std::vector<int64_t> buf;
  std::vector<int8_t> cats;
  for (int64_t b = 0; b < B; ++b) {
    Row row = make_row(r, text, T, step, a);
    if (static_cast<int64_t>(row.tok.size()) != T)
      throw std::logic_error("step " + std::to_string(step) + ": a row of " + std::to_string(row.tok.size()) +
                             " tokens, expected " + std::to_string(T));
    buf.insert(buf.end(), row.tok.begin(), row.tok.end());
    cats.insert(cats.end(), row.cat.begin(), row.cat.end());
  }
  return {T, std::move(buf), std::move(cats)};
}

}  // namespace

int main(int argc, char** argv) try {
  Args a;
  if (!parse(argc, argv, a)) {
    std::printf("%s", kUsage);
    return 0;
  }
  torch::set_num_threads(static_cast<int>(a.threads));
  torch::manual_seed(a.seed);
  const std::string text = read_file(a.data + "/brown_train.txt");
  const std::string held = read_file(a.data + "/brown_heldout.txt");
  if (a.dry_run) {
    std::map<int64_t, int64_t> tokens_at;  // row length, rounded up to a power of two -> tokens
    for (int64_t step = 0; step < a.steps; ++step) {
      const auto [T, buf, cats] = make_batch(text, a, step);
      int64_t bucket = 32;
      while (bucket < T) bucket *= 2;
      tokens_at[bucket] += static_cast<int64_t>(buf.size());
    }
    int64_t total = 0;
    for (auto [T, n] : tokens_at) total += n;
    std::printf("%lld steps, %lld tokens; by row length (up to):", (long long)a.steps, (long long)total);
    for (auto [T, n] : tokens_at) std::printf(" %lld:%lld", (long long)T, (long long)n);
    std::printf("\n");
    return 0;
  }
  std::filesystem::create_directories(a.out);

  Model model{Config()};
  std::printf("params: %lld (%lld without the embedding)\n", (long long)count_params(model, true),
              (long long)count_params(model, false));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(a.lr).betas({0.9, 0.95}).weight_decay(0.1));
  int64_t start = 0;
  if (!a.resume.empty()) {
    for (const char* f : {"/model.pt", "/optim.pt", "/step.txt"}) kvevict_cli::check_readable("--resume", a.resume + f);
    torch::load(model, a.resume + "/model.pt");
    torch::load(opt, a.resume + "/optim.pt");
    std::ifstream(a.resume + "/step.txt") >> start;
    std::printf("resumed at step %lld\n", (long long)start);
  }
  auto save = [&](const std::string& dir, int64_t step) {
    std::filesystem::create_directories(dir);
    torch::save(model, dir + "/model.pt");
    torch::save(opt, dir + "/optim.pt");
    std::ofstream(dir + "/step.txt") << step << "\n";
  };

  const auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  double cat_loss[kNumCats] = {}, cat_hit[kNumCats] = {}, cat_n[kNumCats] = {};
  int64_t tokens = 0, step = start;
  for (; step < a.steps; ++step) {
    if (step == a.stop_step) break;
    if (elapsed() > a.minutes * 60 + 30) {
      std::printf("--minutes reached at step %lld of %lld: the schedule did not finish\n", (long long)step,
                  (long long)a.steps);
      break;
    }
    const double progress = static_cast<double>(step) / a.steps;
    auto [T, buf, cats] = make_batch(text, a, step);
    const int64_t B = static_cast<int64_t>(buf.size()) / T;
    auto tok = torch::tensor(buf, torch::kLong).view({B, T});
    auto cat = torch::tensor(std::vector<int64_t>(cats.begin(), cats.end()), torch::kLong).view({B, T}).narrow(1, 1, T - 1);
    // Warm-up 50 steps, constant, then linear decay to 10% over the last 30% of the steps.
    double lr = a.lr * std::min(1.0, (step + 1) / 50.0);
    if (progress > 0.7) lr *= 1.0 - 0.9 * (progress - 0.7) / 0.3;
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);

    auto logits = model->forward(tok.narrow(1, 0, T - 1));
    auto target = tok.narrow(1, 1, T - 1);
    auto ce = torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape({-1}),
                                                   torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
                  .view({B, T - 1});
    auto w = cat.gt(0).to(torch::kFloat) + cat.ge(kMqar).to(torch::kFloat);  // retrieval targets count twice
    auto loss = (ce * w).sum() / w.sum();
    opt.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    opt.step();
    tokens += B * T;
    {
      torch::NoGradGuard g;
      auto hit = logits.argmax(-1).eq(target);
      for (int c = 1; c < kNumCats; ++c) {
        auto m = cat.eq(c);
        const double n = m.sum().item<double>();
        if (n == 0) continue;
        cat_n[c] += n;
        cat_loss[c] += (ce * m).sum().item<double>();
        cat_hit[c] += (hit & m).sum().item<double>();
      }
    }
    if ((step + 1) % 20 == 0) {
      std::printf("step %5lld progress %.3f T %4lld lr %.2e tok/s %5.0f | text %.3f bpb | acc mqar %.2f passkey %.2f copy %.2f (loss %.2f) | %.1f min\n",
                  (long long)(step + 1), progress, (long long)T, lr, tokens / elapsed(),
                  cat_n[kText] ? cat_loss[kText] / cat_n[kText] / std::log(2.0) : 0.0,
                  cat_n[kMqar] ? cat_hit[kMqar] / cat_n[kMqar] : 0.0,
                  cat_n[kPasskey] ? cat_hit[kPasskey] / cat_n[kPasskey] : 0.0,
                  cat_n[kCopyAns] ? cat_hit[kCopyAns] / cat_n[kCopyAns] : 0.0,
                  cat_n[kCopyAns] ? cat_loss[kCopyAns] / cat_n[kCopyAns] : 0.0, elapsed() / 60);
      std::fflush(stdout);
      for (int c = 0; c < kNumCats; ++c) cat_loss[c] = cat_hit[c] = cat_n[c] = 0;
    }
    if ((step + 1) % a.eval_every == 0) {
      model->eval();
      std::printf("eval step %lld: held-out %.3f bpb (T=512) | passkey full forward: T=256 %.2f T=512 %.2f T=1024 %.2f\n",
                  (long long)(step + 1), text_bpb(model, held, 512, 4), passkey_eval(model, held, 256, 8, 7),
                  passkey_eval(model, held, 512, 8, 8), passkey_eval(model, held, 1024, 8, 9));
      std::fflush(stdout);
      model->train();
      save(a.out + "/ckpt", step + 1);
      save_weights(model, a.out + "/weights.pt");
    }
  }
  save(a.out + "/ckpt", step);
  save_weights(model, a.out + "/weights.pt");
  std::printf("done: %lld steps, %lld tokens, %.1f min\n", (long long)step, (long long)tokens, elapsed() / 60);
  return 0;
} catch (const kvevict_cli::UsageError& e) {
  std::fprintf(stderr, "train_quality: %s (see --help)\n", e.what());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
