// CI test for the shipped quality model (examples/quality/weights.pt): no corpus, no network.
//  1. cached decode (expanded and latent layouts) matches the full forward;
//  2. eviction at 100% budget leaves the logits exactly unchanged (vs never calling evict);
//  3. SnapKV's one-shot prompt compression (Model::prefill_compressed) at capacity T keeps every
//     token: the decode after it matches the full forward; at 25% it changes the logits;
//  4. full-cache passkey accuracy on a fixed synthetic set matches the value stored with the
//     weights (weights.json) within a tolerance;
//  5. the host tier and recall: at 100% budget both recall policies give logits bit-identical
//     to H2O without a tier; at 25% every-step recall brings tokens back, and every row in the
//     cache and in the tier is bit for bit the row first appended at its position (both layouts).
// Usage: test_quality <weights.pt> <weights.json>
#include "evaluate.hpp"

#include <cstdio>
#include <regex>

using namespace kvq;

namespace {
int failures = 0;
void check(bool ok, const std::string& what) {
  std::printf("%s - %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}
double json_number(const std::string& json, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(json, m, std::regex("\"" + key + "\"\\s*:\\s*([0-9.eE+-]+)")))
    throw std::runtime_error("no \"" + key + "\" in the weights' JSON");
  return std::stod(m[1]);
}
}  // namespace

int main(int argc, char** argv) try {
  if (argc != 3) throw std::runtime_error("usage: test_quality <weights.pt> <weights.json>");
  torch::set_num_threads(1);  // no threading measured here; polite on a busy machine
  Model m{Config()};
  load_weights(m, argv[1]);
  m->eval();
  const std::string json = read_file(argv[2]);
  torch::NoGradGuard g;

  // 1. One synthetic passkey document, T = 192: full forward vs token-by-token cached decode.
  auto doc = passkey_docs("", 192, {0.3}, 1, 11).tok;
  auto fed = doc.narrow(1, 0, doc.size(1) - 1);
  const int64_t T = fed.size(1);
  auto full = m->forward(fed);
  auto full_e = kvq::eviction_for(Policy::Full, T, T);
  auto exp = run_policy(m, Layout::Expanded, Policy::Full, full_e, fed, 1, 0).logits;
  auto lat = run_policy(m, Layout::Latent, Policy::Full, full_e, fed, 1, 0).logits;
  const double d_exp = (exp - full).abs().max().item<double>(), d_lat = (lat - exp).abs().max().item<double>();
  check(d_exp < 1e-3, "expanded cache decode vs full forward: max |dlogit| = " + std::to_string(d_exp));
  check(d_lat < 1e-3, "latent (absorbed) vs expanded decode: max |dlogit| = " + std::to_string(d_lat));

  // 2. Capacity exactly T (budget T - sinks - window): evict() runs every step and must change
  //    nothing, bit for bit, for every scorer and both layouts.
  for (auto layout : {Layout::Expanded, Layout::Latent})
    for (auto p : {Policy::H2O, Policy::MeanObserved, Policy::Tova, Policy::Decay, Policy::Window}) {
      auto e = eviction_for(p, T, T);
      auto with = run_policy(m, layout, p, e, fed, 1, 0).logits;
      auto without = run_policy(m, layout, p, e, fed, 1, 0, nullptr, nullptr, /*evict=*/false).logits;
      check(torch::equal(with, without), std::string("100% budget, ") + layout_name(layout) + ", " + policy_name(p) +
                                             ": logits exactly unchanged by eviction");
    }
  // ... while a 25% budget does change them (the check above can fail).
  auto small = run_policy(m, Layout::Expanded, Policy::H2O, eviction_for(Policy::H2O, T / 4, T), fed, 1, 0).logits;
  check(!torch::equal(small, exp), "25% budget changes the logits");

  // 3. SnapKV: the prompt (all but the last 3 fed tokens) attended in full and compressed once per
  //    layer, then 3 decode steps. At capacity T nothing is dropped; at 25% the logits change.
  for (auto layout : {Layout::Expanded, Layout::Latent}) {
    auto snap = run_policy(m, layout, Policy::SnapKV, eviction_for(Policy::SnapKV, T, T), fed, T - 3, 0).logits;
    const double d = (snap - full).abs().max().item<double>();
    check(d < 1e-3, std::string("SnapKV at 100% capacity, ") + layout_name(layout) +
                        ": compressed prefill + decode vs full forward: max |dlogit| = " + std::to_string(d));
  }
  auto snap_small =
      run_policy(m, Layout::Expanded, Policy::SnapKV, eviction_for(Policy::SnapKV, T / 4, T), fed, T - 3, 0).logits;
  check((snap_small - full).narrow(1, T - 3, 3).abs().max().item<double>() > 1e-3,
        "SnapKV at 25% changes the decoded logits");

  // 4. Full-cache passkey accuracy on the fixed set the JSON describes.
  const auto L = static_cast<int64_t>(json_number(json, "ci_context"));
  const auto n = static_cast<int64_t>(json_number(json, "ci_docs_per_depth"));
  const double stored = json_number(json, "ci_full_cache_passkey_accuracy");
  const double tol = json_number(json, "ci_tolerance");
  for (auto layout : {Layout::Expanded, Layout::Latent}) {
    const double acc = ci_passkey_accuracy(m, layout, L, n);
    char msg[200];
    std::snprintf(msg, sizeof msg, "%s full-cache passkey accuracy %.4f vs stored %.4f (tolerance %.3f), %lld docs at %lld tokens",
                  layout_name(layout), acc, stored, tol, (long long)(5 * n), (long long)L);
    check(std::abs(acc - stored) <= tol, msg);
  }

  // 5. Recall. At 100% nothing is evicted, so nothing is in the tier and recall changes nothing.
  for (auto layout : {Layout::Expanded, Layout::Latent}) {
    auto plain = run_policy(m, layout, Policy::H2O, eviction_for(Policy::H2O, T, T), fed, 1, 0, nullptr, nullptr, true,
                            passkey_turns(T + 1)).logits;
    for (auto p : {Policy::H2ORecall, Policy::H2ORecallTurn}) {
      auto with = run_policy(m, layout, p, eviction_for(p, T, T), fed, 1, 0, nullptr, nullptr, true, passkey_turns(T + 1)).logits;
      check(torch::equal(with, plain), std::string("100% budget with a tier, ") + layout_name(layout) + ", " +
                                           policy_name(p) + ": logits bit-identical to h2o without a tier");
    }
  }
  // At 25% with a recall every step: record each token's rows as the model appends them, then
  // compare every cached and every tier row with the record at its position.
  {
    const int64_t cap = T / 4;
    const auto e = eviction_for(Policy::H2ORecall, cap, T);
    const RecallSettings rs;
    const auto rows_check = [&](auto& cache, auto&& newest, auto&& cached_rows, auto&& tier_rows, const char* name) {
      DecodeState state;
      std::vector<std::vector<torch::Tensor>> rec(m->c.n_layers);  // per layer: per position, the rows (cat)
      for (int64_t t = 0; t < T; ++t) {
        m->step(fed.narrow(1, t, 1), cache, state, nullptr, true, true, t > 0 ? rs.recall(Policy::H2ORecall, e) : Recall{});
        for (int64_t l = 0; l < m->c.n_layers; ++l) rec[l].push_back(newest(cache, l));
      }
      bool same = true;
      for (int64_t l = 0; l < m->c.n_layers; ++l) {
        const auto all = torch::stack(rec[l]);  // [T, width]
        const auto pos = cache.positions(l)[0];
        same = same && torch::equal(cached_rows(cache, l), all.index_select(0, pos));
        same = same && torch::equal(tier_rows(cache, l), all.index_select(0, cache.tier_positions(l, 0)));
      }
      const auto st = cache.stats();
      check(st.tier_recalled > 0, std::string(name) + ": recall every step at 25% brought " +
                                      std::to_string(st.tier_recalled) + " tokens back");
      check(same, std::string(name) + ": every cached and tier row is bit for bit the row appended at its position");
    };
    kvevict::MlaLatentCache lat(m->latent_options(1).tier_tokens(T).tier_page_size(rs.step_page), e);
    rows_check(
        lat,
        [](auto& c, int64_t l) {  // the newest token: the slot with the largest position
          const auto s = c.positions(l)[0].argmax().template item<int64_t>();
          return torch::cat({c.ckv(l)[0][s], c.kpe(l)[0][s]});
        },
        [](auto& c, int64_t l) { return torch::cat({c.ckv(l)[0], c.kpe(l)[0]}, -1); },
        [](auto& c, int64_t l) {
          auto r = c.tier_rows(l, 0);
          return torch::cat({r.first, r.second}, -1);
        },
        "latent");
    kvevict::MlaCache ex(m->expanded_options(1).tier_tokens(T).tier_page_size(rs.step_page), e);
    rows_check(
        ex,
        [](auto& c, int64_t l) {
          const auto s = c.positions(l)[0].argmax().template item<int64_t>();
          return torch::cat({c.keys(l)[0].select(1, s).flatten(), c.values(l)[0].select(1, s).flatten()});
        },
        [](auto& c, int64_t l) {  // [S, H * (qk + v)]
          return torch::cat({c.keys(l)[0].transpose(0, 1).flatten(1), c.values(l)[0].transpose(0, 1).flatten(1)}, -1);
        },
        [](auto& c, int64_t l) {
          auto r = c.tier_rows(l, 0);
          return torch::cat({r.first.transpose(0, 1).flatten(1), r.second.transpose(0, 1).flatten(1)}, -1);
        },
        "expanded");
  }
  std::printf("%s\n", failures ? "FAILED" : "all passed");
  return failures ? 1 : 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
