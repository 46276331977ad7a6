// Continuous batching: 16 requests through ONE cache of batch 4, rows reused (finish, then
// add_sequence). Requests have different prompt lengths, arrive and finish at different steps;
// the prompts admitted at one step share one left-padded prefill chunk (update with counts,
// T = the longest of them), in which the rows that are decoding append 1 column and idle rows
// append 0. Eviction is real (n_sink 2, budget 6, n_recent 4: a pass on almost every step).
//
// The check: each request is also run alone, in its own batch-1 cache, with the same inputs
// (q/k/v drawn per request, layer and position, so they do not depend on the batch). After
// every step and layer, the request's row of the shared cache must match its solo cache: kept
// positions (slot order) and K/V rows (ckv/kpe for the latent layout) bit for bit, scores and
// attention outputs bit for bit on the CPU host path (attention runs row by row, each row with
// its own shapes) and to fp32 rounding on the tensor-op path that CUDA runs (one batched
// product over the padded batch, whose reductions round differently: relative 1e-5); pad
// query columns must give zero output. Both layouts (MlaCache with attend, MlaLatentCache with
// attend_absorbed), both paths (the tensor path forced on CPU), and the two paths must keep
// the same tokens.
//
// `--device cuda` adds a run of the tensor path on that device (its kept tokens must match the
// CPU host path's too). Prints one line per request and run, then PASS (exit 0) or FAIL (exit 1).
#include <kvevict/kvevict.hpp>

#include <fmt/format.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t kLayers = 3, kHeads = 4, kBatch = 4;
const auto kEviction = kvevict::EvictionOptions(/*budget=*/6).n_sink(2).n_recent(4).evict_every(2);
/// Device of the caches (--device): CPU by default; a CUDA run adds one pass over the schedule.
at::Device g_device = at::kCPU;

struct Request {
  int id;
  int64_t arrival;  // first step it may be admitted
  int64_t prompt;   // prompt tokens (one prefill chunk)
  int64_t decode;   // decode steps after the prefill
  int64_t tokens() const { return prompt + decode; }
  /// Whether the request sits out `step` (its row active, 0 columns appended): some requests
  /// pause now and then while decoding, as a scheduler may do under load.
  bool idles(int64_t step) const { return id % 5 == 2 && step % 3 == 0; }
};

// Prompt lengths from 1 to 30 (several above the capacity of 12, so the prefill itself grows
// the buffers and is evicted), arrivals spread out, so that rows free up at different steps.
const std::vector<Request> kRequests = {
    {0, 0, 5, 6},   {1, 0, 17, 3},  {2, 0, 1, 10},  {3, 1, 9, 5},   {4, 1, 30, 4},  {5, 2, 3, 12},
    {6, 3, 12, 2},  {7, 5, 25, 7},  {8, 5, 7, 9},   {9, 6, 2, 5},   {10, 8, 14, 3}, {11, 9, 20, 8},
    {12, 9, 4, 11}, {13, 12, 11, 4}, {14, 13, 8, 6}, {15, 15, 16, 3},
};

bool bits_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const auto x = a.contiguous(), y = b.contiguous();
  if (x.scalar_type() == at::kFloat) return at::equal(x.view(at::kInt), y.view(at::kInt));
  return at::equal(x, y);
}

/// What the path promises for scores and attention outputs: bit-identical on the host path,
/// equal to fp32 rounding (relative 1e-5, absolute 1e-6) on the tensor path.
bool path_equal(const at::Tensor& a, const at::Tensor& b, bool host_path) {
  if (host_path) return bits_equal(a, b);
  return a.sizes() == b.sizes() && at::allclose(a.to(at::kCPU), b.to(at::kCPU), 1e-5, 1e-6);
}

/// A layout: how to build its cache, the per-token inputs of a request, update, attend.
struct Expanded {
  using Cache = kvevict::MlaCache;
  static constexpr const char* kName = "MlaCache + attend";
  static constexpr int64_t kQk = 48, kV = 32;
  static std::unique_ptr<Cache> make(int64_t batch) {
    return std::make_unique<Cache>(kvevict::MlaCacheOptions(kLayers, kHeads).qk_dim(kQk).v_dim(kV).batch_size(batch).device(g_device),
                                   kEviction);
  }
  /// Cached inputs (k, v) and queries (q) of every layer and position: [L, H, N, width].
  static std::vector<at::Tensor> cached(int64_t n) {
    return {at::randn({kLayers, kHeads, n, kQk}), at::randn({kLayers, kHeads, n, kV})};
  }
  static std::vector<at::Tensor> queries(int64_t n) { return {at::randn({kLayers, kHeads, n, kQk}).mul(2)}; }
  static int64_t token_dim(size_t) { return 2; }  // of [B, H, T, w]
  static void update(Cache& c, int64_t l, const std::vector<at::Tensor>& in, const std::vector<int64_t>* counts) {
    if (counts) {
      c.update(l, in[0], in[1], *counts);
    } else {
      c.update(l, in[0], in[1]);
    }
  }
  static at::Tensor attend(Cache& c, int64_t l, const std::vector<at::Tensor>& q) { return kvevict::attend(q[0], c, l); }
  static std::vector<at::Tensor> buffers(const Cache& c, int64_t l) { return {c.keys(l), c.values(l)}; }
};

struct Latent {
  using Cache = kvevict::MlaLatentCache;
  static constexpr const char* kName = "MlaLatentCache + attend_absorbed";
  static constexpr int64_t kRank = 64, kRope = 16;
  static std::unique_ptr<Cache> make(int64_t batch) {
    const auto options =
        kvevict::MlaLatentCacheOptions(kLayers, kHeads).kv_lora_rank(kRank).qk_rope_dim(kRope).qk_nope_dim(32);
    return std::make_unique<Cache>(kvevict::MlaLatentCacheOptions(options).batch_size(batch).device(g_device), kEviction);
  }
  /// ckv, kpe: [L, N, width]; queries q_absorbed, q_pe: [L, H, N, width].
  static std::vector<at::Tensor> cached(int64_t n) {
    return {at::randn({kLayers, n, kRank}), at::randn({kLayers, n, kRope})};
  }
  static std::vector<at::Tensor> queries(int64_t n) {
    return {at::randn({kLayers, kHeads, n, kRank}).mul(0.5), at::randn({kLayers, kHeads, n, kRope})};
  }
  static int64_t token_dim(size_t) { return 1; }  // of [B, T, w]
  static void update(Cache& c, int64_t l, const std::vector<at::Tensor>& in, const std::vector<int64_t>* counts) {
    if (counts) {
      c.update(l, in[0], in[1], *counts);
    } else {
      c.update(l, in[0], in[1]);
    }
  }
  static at::Tensor attend(Cache& c, int64_t l, const std::vector<at::Tensor>& q) {
    return kvevict::attend_absorbed(q[0], q[1], c, l);
  }
  static std::vector<at::Tensor> buffers(const Cache& c, int64_t l) { return {c.ckv(l), c.kpe(l)}; }
};

/// Columns [from, from + n) of layer l of a request's input `all` ([L, outer..., N, w]) as a
/// batch-1 chunk of T columns [1, outer..., T, w]: the tokens right-aligned, pads NaN (the
/// library must never store, attend to or score them).
at::Tensor chunk_of(const at::Tensor& all, int64_t l, int64_t from, int64_t n, int64_t T, int64_t tdim) {
  const auto tokens = all[l].narrow(tdim - 1, from, n);
  auto sizes = tokens.sizes().vec();
  sizes[tdim - 1] = T;
  auto out = at::full(sizes, std::numeric_limits<float>::quiet_NaN());
  out.narrow(tdim - 1, T - n, n).copy_(tokens);
  return out.unsqueeze(0);
}

uint64_t fnv(uint64_t h, int64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
    h *= 1099511628211ull;
  }
  return h;
}

struct Outcome {
  int64_t steps = 0;
  int row = -1;                    // the shared cache's row it ran in
  int64_t first = -1, last = -1;   // the steps it ran
  /// Shared facts of the run (the same in every Outcome): steps where prefill and decode rows
  /// shared a chunk, chunks with two or more prompts, tokens evicted from the shared cache.
  int64_t mixed_steps = 0, shared_prefills = 0, evicted = 0;
  std::string kept;         // final kept positions of layer 0, ascending
  uint64_t digest = 14695981039346656037ull;  // final kept positions of every layer (slot order)
  std::vector<std::string> failures;
};

/// Runs the 16 requests through one batch-4 cache and each alone; returns one Outcome per id.
template <class Layout>
std::map<int, Outcome> run() {
  using Cache = typename Layout::Cache;
  // Inputs per request, drawn from its own seed: independent of the batch and of the schedule.
  std::map<int, std::vector<at::Tensor>> kv, qs;
  for (const auto& r : kRequests) {
    at::manual_seed(1000 + r.id);
    kv[r.id] = Layout::cached(r.tokens());
    qs[r.id] = Layout::queries(r.tokens());
  }
  auto shared = Layout::make(kBatch);
  const bool host_path = shared->policy().host_path();
  std::map<int, std::unique_ptr<Cache>> solo;  // per running request: its own batch-1 cache
  std::map<int, Outcome> out;
  std::vector<int> in_row(kBatch, -1);       // request id per row, -1 when free
  std::vector<int64_t> done(kRequests.size(), 0);  // tokens appended so far, per request
  for (int b = 0; b < kBatch; ++b) shared->finish(b);  // every row starts active: free them all
  std::deque<int> waiting;
  size_t next_arrival = 0, finished = 0;
  int64_t mixed_steps = 0, shared_prefills = 0;
  for (int64_t step = 0; finished < kRequests.size(); ++step) {
    // Requests whose last decode step ran leave; new arrivals queue; free rows are filled.
    for (int b = 0; b < kBatch; ++b) {
      const int id = in_row[b];
      if (id >= 0 && done[id] == kRequests[id].tokens()) {
        shared->finish(b);
        in_row[b] = -1;
        ++finished;
        const at::Tensor pos = solo[id]->positions(0)[0];
        const at::Tensor sorted = std::get<0>(pos.sort());
        std::string s;
        for (int64_t i = 0; i < sorted.size(0); ++i) s += (i ? "," : "") + std::to_string(sorted[i].item<int64_t>());
        out[id].kept = s;
        for (int64_t l = 0; l < kLayers; ++l) {
          const at::Tensor p = solo[id]->positions(l)[0];
          for (int64_t i = 0; i < p.size(0); ++i) out[id].digest = fnv(out[id].digest, p[i].item<int64_t>());
        }
        solo.erase(id);
      }
    }
    while (next_arrival < kRequests.size() && kRequests[next_arrival].arrival <= step) {
      waiting.push_back(kRequests[next_arrival++].id);
    }
    while (!waiting.empty()) {
      bool free_row = false;
      for (int b = 0; b < kBatch; ++b) free_row = free_row || in_row[b] < 0;
      if (!free_row) break;
      const int id = waiting.front();
      waiting.pop_front();
      const int b = static_cast<int>(shared->add_sequence());
      in_row[b] = id;
      solo[id] = Layout::make(1);
    }
    // This step's counts: a new request its whole prompt, a decoding one 1, an idle one 0.
    std::vector<int64_t> counts(kBatch, 0);
    int64_t T = 0;
    for (int b = 0; b < kBatch; ++b) {
      const int id = in_row[b];
      if (id < 0) continue;
      const auto& r = kRequests[id];
      counts[b] = done[id] == 0 ? r.prompt : r.idles(step) ? 0 : 1;
      T = std::max(T, counts[b]);
    }
    if (T == 0) continue;  // nothing to run (every row idle or free)
    int64_t prompts = 0, decodes = 0;
    for (int b = 0; b < kBatch; ++b) {
      if (in_row[b] >= 0 && counts[b] > 0) (done[in_row[b]] == 0 ? prompts : decodes) += 1;
    }
    mixed_steps += prompts > 0 && decodes > 0;
    shared_prefills += prompts > 1;
    for (int64_t l = 0; l < kLayers; ++l) {
      // The shared chunk: each row's tokens right-aligned in T columns, pads NaN.
      std::vector<at::Tensor> in, q;
      for (size_t i = 0; i < kv[0].size(); ++i) {
        std::vector<at::Tensor> rows;
        for (int b = 0; b < kBatch; ++b) {
          const int id = in_row[b];
          const int64_t tdim = Layout::token_dim(i);
          rows.push_back(id < 0 ? chunk_of(kv[0][i], l, 0, 0, T, tdim)  // a free row: all pads
                                : chunk_of(kv[id][i], l, done[id], counts[b], T, tdim));
        }
        in.push_back(at::cat(rows).to(g_device));
      }
      for (size_t i = 0; i < qs[0].size(); ++i) {
        std::vector<at::Tensor> rows;
        for (int b = 0; b < kBatch; ++b) {
          const int id = in_row[b];
          rows.push_back(id < 0 ? chunk_of(qs[0][i], l, 0, 0, T, 2)
                                : chunk_of(qs[id][i], l, done[id], counts[b], T, 2));
        }
        q.push_back(at::cat(rows).to(g_device));
      }
      Layout::update(*shared, l, in, &counts);
      const auto attn = Layout::attend(*shared, l, q);
      std::vector<at::Tensor> solo_attn(kBatch);
      for (int b = 0; b < kBatch; ++b) {
        const int id = in_row[b];
        if (id < 0 || counts[b] == 0) continue;
        std::vector<at::Tensor> own_in, own_q;
        for (size_t i = 0; i < kv[id].size(); ++i) {
          own_in.push_back(kv[id][i][l].narrow(Layout::token_dim(i) - 1, done[id], counts[b]).unsqueeze(0).to(g_device));
        }
        for (size_t i = 0; i < qs[id].size(); ++i) {
          own_q.push_back(qs[id][i][l].narrow(1, done[id], counts[b]).unsqueeze(0).to(g_device));
        }
        Layout::update(*solo[id], l, own_in, nullptr);
        solo_attn[b] = Layout::attend(*solo[id], l, own_q);
      }
      // Compares row b of the shared cache with request id's solo cache, after `phase`.
      auto compare = [&](const char* phase) {
        for (int b = 0; b < kBatch; ++b) {
          const int id = in_row[b];
          if (id < 0) continue;
          auto& fails = out[id].failures;
          auto fail = [&](const std::string& what) {
            fails.push_back(fmt::format("step {} layer {} {}: {}", step, l, phase, what));
          };
          const Cache& mine = *solo[id];
          const int64_t n = shared->size(l, b);
          if (n != mine.size(l, 0)) {
            fail(fmt::format("{} live tokens, alone {}", n, mine.size(l, 0)));
            continue;
          }
          if (shared->seen_tokens(l, b) != mine.seen_tokens(l, 0)) fail("seen tokens differ");
          if (!bits_equal(shared->positions(l)[b].narrow(0, 0, n), mine.positions(l)[0])) fail("positions differ");
          if (!path_equal(shared->scores(l)[b].narrow(0, 0, n), mine.scores(l)[0], host_path)) fail("scores differ");
          const auto bufs = Layout::buffers(*shared, l), own = Layout::buffers(mine, l);
          for (size_t i = 0; i < bufs.size(); ++i) {
            const int64_t tdim = Layout::token_dim(i) - 1;  // in a row, without the batch dim
            if (!bits_equal(bufs[i][b].narrow(tdim, 0, n), own[i][0])) fail(fmt::format("buffer {} rows differ", i));
          }
        }
      };
      // Attention outputs: the row's real columns equal the solo output; pads give zeros.
      for (int b = 0; b < kBatch; ++b) {
        const int id = in_row[b];
        if (id < 0) continue;
        const auto row = attn[b];  // [H, T, w]
        const int64_t c = counts[b];
        if (c > 0 && !path_equal(row.narrow(1, T - c, c), solo_attn[b][0], host_path)) {
          out[id].failures.push_back(fmt::format("step {} layer {}: attention output differs", step, l));
        }
        if (c < T && !at::equal(row.narrow(1, 0, T - c), at::zeros_like(row.narrow(1, 0, T - c)))) {
          out[id].failures.push_back(fmt::format("step {} layer {}: pad query columns give non-zero output", step, l));
        }
      }
      compare("after attend");
      shared->evict(l);
      for (int b = 0; b < kBatch; ++b) {
        const int id = in_row[b];
        if (id >= 0 && counts[b] > 0) solo[id]->evict(l);
      }
      compare("after evict");
    }
    for (int b = 0; b < kBatch; ++b) {
      const int id = in_row[b];
      if (id < 0) continue;
      done[id] += counts[b];
      if (counts[b] > 0) ++out[id].steps;
      out[id].row = b;
      if (out[id].first < 0) out[id].first = step;
      out[id].last = step;
    }
  }
  for (auto& o : out) {
    o.second.mixed_steps = mixed_steps;
    o.second.shared_prefills = shared_prefills;
    o.second.evicted = shared->stats().tokens_evicted;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);  // deterministic and polite on a shared machine
  // Runs: the CPU host path, the tensor path forced on CPU, and with `--device cuda[:N]` the
  // tensor path on that device too (its kept tokens must also match the CPU host path's).
  std::vector<std::string> runs = {"cpu", "tensor"};
  if (argc == 3 && std::string(argv[1]) == "--device") {
    runs.push_back(argv[2]);
  } else if (argc != 1) {
    fmt::print(stderr, "usage: {} [--device DEVICE]\n", argv[0]);
    return 2;
  }
  bool ok = true;
  std::map<std::string, std::map<int, Outcome>> digests;  // layout -> path -> outcomes
  for (const auto& run_name : runs) {
    const bool tensor_path = run_name == "tensor";
    g_device = run_name == "tensor" ? at::Device(at::kCPU) : at::Device(run_name);
    kvevict::detail::force_tensor_path() = tensor_path;  // caches built now take this path
    const std::string path = run_name == "cpu"      ? "CPU host path"
                             : run_name == "tensor" ? "tensor path (what CUDA runs), forced on CPU"
                                                    : "tensor path on " + run_name;
    for (int layout = 0; layout < 2; ++layout) {
      std::map<int, Outcome> outcomes;
      try {
        outcomes = layout == 0 ? run<Expanded>() : run<Latent>();
      } catch (const c10::Error& e) {  // e.g. --device names a device this machine lacks
        const std::string why = e.what_without_backtrace();
        fmt::print("{} on the {}: FAIL, {}\n", layout == 0 ? Expanded::kName : Latent::kName, path,
                   why.substr(0, why.find('\n')));
        ok = false;
        continue;
      }
      const auto& any = outcomes.begin()->second;
      fmt::print("{} on the {}: {} steps mixed prefill and decode rows, {} chunks held several prompts, {} tokens "
                 "evicted\n",
                 layout == 0 ? Expanded::kName : Latent::kName, path, any.mixed_steps, any.shared_prefills, any.evicted);
      const std::string key = std::to_string(layout);
      const bool first = digests.count(key) == 0;
      for (const auto& r : kRequests) {
        const auto& o = outcomes.at(r.id);
        bool good = o.failures.empty() && o.steps == 1 + r.decode;
        std::string why = o.failures.empty() ? "" : o.failures.front();
        if (o.steps != 1 + r.decode) why = fmt::format("ran {} steps, expected {}", o.steps, 1 + r.decode);
        if (!first && digests[key].at(r.id).digest != o.digest) {
          good = false;
          why = "kept positions differ from the CPU host path";
        }
        fmt::print("  request {:2} prompt {:2} row {} steps {:2} ({:2}-{:2}) kept L0 [{}] digest {:016x} {}{}\n", r.id,
                   r.prompt, o.row, o.steps, o.first, o.last, o.kept, o.digest, good ? "OK" : "FAIL",
                   good ? "" : " (" + why + fmt::format(", {} mismatches)", o.failures.size()));
        ok = ok && good;
        if (std::getenv("KVEVICT_VERBOSE")) {
          for (const auto& f : o.failures) fmt::print("    {}\n", f);
        }
      }
      if (first) digests[key] = outcomes;
    }
  }
  kvevict::detail::force_tensor_path() = false;
  fmt::print("{}\n", ok ? "PASS" : "FAIL");
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
