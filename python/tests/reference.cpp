// The C++ side of the Python tests (python/tests): runs the library, and the quality model of
// examples/quality/model.hpp, on a request the tests write with torch.save, without the Python
// binding, and writes the reply for torch.load. So a test compares what the binding does with
// what the C++ library does on the same inputs.
//
//   kvevict_reference REQUEST.pt REPLY.pt
//
// A request is a dict with "op" and its arguments (python/tests/reference.py writes them):
//   trace         a cache (layout, scorer, eviction options, dims) driven by a list of steps:
//                 update / attend / observe / add_scores / evict / truncate / finish /
//                 add_sequence / reset; each step with "record" adds every layer's positions
//                 and scores to the reply; attend adds its output.
//   keep_indices  Selection(eviction).keep_indices(scores).
//   compress      compress_prompt(_absorbed) into layer 0 of an empty cache: kept positions,
//                 then the cache's positions and scores.
//   model         the quality model with the given weights: "forward" (full attention), or
//                 "step" / "compressed" (the prompt through a cache, appended or compressed,
//                 then one token per step): the logits [B, T, vocab] and every layer's
//                 positions at the end.
#include "model.hpp"

#include <kvevict/kvevict.hpp>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Dict = c10::impl::GenericDict;

Dict new_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

/// The elements of a list or a tuple (the tests send tuples: see conftest.py).
std::vector<at::IValue> items(const at::IValue& v) {
  if (v.isTuple()) return v.toTupleRef().elements().vec();
  const auto list = v.toListRef();
  return std::vector<at::IValue>(list.begin(), list.end());
}

bool has(const Dict& d, const char* key) {
  auto it = d.find(at::IValue(std::string(key)));
  return it != d.end() && !it->value().isNone();
}
at::IValue get(const Dict& d, const char* key) {
  if (!has(d, key)) throw std::runtime_error(std::string("request: missing '") + key + "'");
  return d.at(at::IValue(std::string(key)));
}
int64_t get_int(const Dict& d, const char* key, int64_t fallback) { return has(d, key) ? get(d, key).toInt() : fallback; }
double get_double(const Dict& d, const char* key, double fallback) {
  return has(d, key) ? get(d, key).toDouble() : fallback;
}
std::string get_str(const Dict& d, const char* key, const std::string& fallback) {
  return has(d, key) ? get(d, key).toStringRef() : fallback;
}
at::Tensor get_tensor(const Dict& d, const char* key) { return get(d, key).toTensor(); }
std::vector<int64_t> get_ints(const Dict& d, const char* key) {
  std::vector<int64_t> out;
  if (!has(d, key)) return out;
  for (const auto& v : items(get(d, key))) out.push_back(v.toInt());
  return out;
}
std::vector<at::Tensor> get_tensors(const Dict& d, const char* key) {
  std::vector<at::Tensor> out;
  for (const auto& v : items(get(d, key))) out.push_back(v.toTensor());
  return out;
}
c10::optional<double> get_scale(const Dict& d) {
  return has(d, "scale") ? c10::optional<double>(get(d, "scale").toDouble()) : c10::nullopt;
}

kvevict::EvictionOptions eviction_of(const Dict& r) {
  return kvevict::EvictionOptions(get_int(r, "budget", 64))
      .n_sink(get_int(r, "n_sink", 4))
      .n_recent(get_int(r, "n_recent", 16))
      .evict_every(get_int(r, "evict_every", 1));
}

template <class F>
void with_scorer(const Dict& r, F&& f) {
  const auto name = get_str(r, "scorer", "CumulativeAttention");
  if (name == "CumulativeAttention") return f(kvevict::CumulativeAttention());
  if (name == "MeanObservedAttention") return f(kvevict::MeanObservedAttention());
  if (name == "LatestAttention") return f(kvevict::LatestAttention());
  if (name == "DecayedAttention") return f(kvevict::DecayedAttention(static_cast<float>(get_double(r, "gamma", 0.9))));
  if (name == "SnapKV") return f(kvevict::SnapKV(get_int(r, "window", 64), get_int(r, "kernel", 5)));
  throw std::runtime_error("request: unknown scorer '" + name + "'");
}

template <class Options>
Options common_options(Options o, const Dict& r) {
  if (has(r, "batch_size")) o.batch_size(get_int(r, "batch_size", 1));
  o.layer_budgets(get_ints(r, "layer_budgets"));
  if (has(r, "check_observations")) o.check_observations(get(r, "check_observations").toBool());
  return o;
}
kvevict::MlaCacheOptions expanded_options(const Dict& r) {
  kvevict::MlaCacheOptions o(get_int(r, "num_layers", 1), get_int(r, "num_heads", 1));
  o.qk_dim(get_int(r, "qk_dim", 192)).v_dim(get_int(r, "v_dim", 128));
  return common_options(o, r);
}
kvevict::MlaLatentCacheOptions latent_options(const Dict& r) {
  kvevict::MlaLatentCacheOptions o(get_int(r, "num_layers", 1), get_int(r, "num_heads", 1));
  o.kv_lora_rank(get_int(r, "kv_lora_rank", 512)).qk_rope_dim(get_int(r, "qk_rope_dim", 64));
  o.qk_nope_dim(get_int(r, "qk_nope_dim", 128));
  return common_options(o, r);
}

template <class Cache>
constexpr bool kExpanded = std::is_same_v<Cache, kvevict::BasicMlaCache<typename Cache::policy_type>>;

template <class Cache>
Cache make_cache(const Dict& r, const typename Cache::scorer_type& scorer) {
  if constexpr (kExpanded<Cache>) {
    return Cache(expanded_options(r), eviction_of(r), scorer);
  } else {
    return Cache(latent_options(r), eviction_of(r), scorer);
  }
}

/// Every layer's positions and scores, appended to the reply's lists.
template <class Cache>
void record(const Cache& cache, c10::List<at::Tensor>& positions, c10::List<at::Tensor>& scores) {
  for (int64_t l = 0; l < cache.num_layers(); ++l) {
    positions.push_back(cache.positions(l));
    scores.push_back(cache.scores(l));
  }
}

template <class Cache>
void trace(const Dict& r, const typename Cache::scorer_type& scorer, Dict& reply) {
  auto cache = make_cache<Cache>(r, scorer);
  c10::List<at::Tensor> positions, scores, outputs;
  c10::List<int64_t> evicted;
  for (const auto& step_value : items(get(r, "steps"))) {
    const auto s = step_value.toGenericDict();
    const auto op = get_str(s, "op", "");
    const int64_t layer = get_int(s, "layer", 0);
    if (op == "update") {
      const auto rows = get_tensors(s, "rows");
      if (has(s, "counts")) {
        cache.update(layer, rows.at(0), rows.at(1), get_ints(s, "counts"));
      } else {
        cache.update(layer, rows.at(0), rows.at(1));
      }
    } else if (op == "attend") {
      const auto q = get_tensors(s, "q");
      if constexpr (kExpanded<Cache>) {
        outputs.push_back(kvevict::attend(q.at(0), cache, layer, get_scale(s)));
      } else {
        outputs.push_back(kvevict::attend_absorbed(q.at(0), q.at(1), cache, layer, get_scale(s)));
      }
    } else if (op == "observe") {
      cache.observe(layer, get_tensor(s, "probs"));
    } else if (op == "add_scores") {
      cache.add_scores(layer, get_tensor(s, "scores"));
    } else if (op == "evict") {
      evicted.push_back(cache.evict(layer));
    } else if (op == "truncate") {
      cache.truncate(get_int(s, "row", 0), get_int(s, "k", 0));
    } else if (op == "finish") {
      cache.finish(get_int(s, "row", 0));
    } else if (op == "add_sequence") {
      cache.add_sequence();
    } else if (op == "reset") {
      if (has(s, "row")) {
        cache.reset(get_int(s, "row", 0));
      } else {
        cache.reset();
      }
    } else {
      throw std::runtime_error("request: unknown step '" + op + "'");
    }
    if (has(s, "record") && get(s, "record").toBool()) record(cache, positions, scores);
  }
  reply.insert("positions", positions);
  reply.insert("scores", scores);
  reply.insert("outputs", outputs);
  reply.insert("evicted", evicted);
}

template <class Cache>
void compress(const Dict& r, const typename Cache::scorer_type& scorer, Dict& reply) {
  auto cache = make_cache<Cache>(r, scorer);
  at::Tensor keep;
  if constexpr (kExpanded<Cache>) {
    keep = kvevict::compress_prompt(cache, 0, get_tensor(r, "q"), get_tensor(r, "k"), get_tensor(r, "v"),
                                    get_tensor(r, "lse"), get_scale(r));
  } else {
    keep = kvevict::compress_prompt_absorbed(cache, 0, get_tensor(r, "q_absorbed"), get_tensor(r, "q_pe"),
                                             get_tensor(r, "ckv"), get_tensor(r, "kpe"), get_tensor(r, "lse"),
                                             get_scale(r));
  }
  reply.insert("keep", keep);
  reply.insert("positions", cache.positions(0));
  reply.insert("scores", cache.scores(0));
}

template <class Cache>
void model_through_cache(const Dict& r, const typename Cache::scorer_type& scorer, kvq::Model& model,
                         const at::Tensor& tokens, Dict& reply) {
  const int64_t B = tokens.size(0), T = tokens.size(1), P = get_int(r, "prompt_len", T);
  Cache cache = [&] {
    if constexpr (kExpanded<Cache>) {
      return Cache(common_options(model->expanded_options(B), r), eviction_of(r), scorer);
    } else {
      return Cache(common_options(model->latent_options(B), r), eviction_of(r), scorer);
    }
  }();
  kvq::DecodeState state;
  std::vector<at::Tensor> logits;
  const auto prompt = tokens.narrow(1, 0, P);
  logits.push_back(get_str(r, "mode", "step") == "compressed" ? model->prefill_compressed(prompt, cache, state)
                                                              : model->step(prompt, cache, state));
  for (int64_t t = P; t < T; ++t) logits.push_back(model->step(tokens.narrow(1, t, 1), cache, state));
  reply.insert("logits", torch::cat(logits, 1));
  c10::List<at::Tensor> positions, scores;
  record(cache, positions, scores);
  reply.insert("positions", positions);
  reply.insert("scores", scores);
}

void run_model(const Dict& r, Dict& reply) {
  kvq::Model model;
  kvq::load_weights(model, get_str(r, "weights", ""));
  model->eval();
  torch::NoGradGuard no_grad;
  const auto tokens = get_tensor(r, "tokens");
  if (get_str(r, "mode", "step") == "forward") {
    reply.insert("logits", model->forward(tokens));
    return;
  }
  with_scorer(r, [&](auto scorer) {
    using S = decltype(scorer);
    if (get_str(r, "layout", "expanded") == "expanded") {
      model_through_cache<kvevict::BasicMlaCache<kvevict::EvictionPolicy<S>>>(r, scorer, model, tokens, reply);
    } else {
      model_through_cache<kvevict::BasicMlaLatentCache<kvevict::EvictionPolicy<S>>>(r, scorer, model, tokens, reply);
    }
  });
}

template <template <class> class Run>
void by_layout(const Dict& r, Dict& reply) {
  with_scorer(r, [&](auto scorer) {
    using S = decltype(scorer);
    if (get_str(r, "layout", "expanded") == "expanded") {
      Run<kvevict::BasicMlaCache<kvevict::EvictionPolicy<S>>>::run(r, scorer, reply);
    } else {
      Run<kvevict::BasicMlaLatentCache<kvevict::EvictionPolicy<S>>>::run(r, scorer, reply);
    }
  });
}
template <class Cache>
struct Trace {
  static void run(const Dict& r, const typename Cache::scorer_type& s, Dict& reply) { trace<Cache>(r, s, reply); }
};
template <class Cache>
struct Compress {
  static void run(const Dict& r, const typename Cache::scorer_type& s, Dict& reply) { compress<Cache>(r, s, reply); }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s REQUEST.pt REPLY.pt\n", argv[0]);
    return 2;
  }
  try {
    std::ifstream in(argv[1], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot read ") + argv[1]);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto request = torch::pickle_load(bytes).toGenericDict();
    auto reply = new_dict();
    const auto op = get_str(request, "op", "");
    if (op == "trace") {
      by_layout<Trace>(request, reply);
    } else if (op == "compress") {
      by_layout<Compress>(request, reply);
    } else if (op == "keep_indices") {
      reply.insert("keep", kvevict::Selection(eviction_of(request)).keep_indices(get_tensor(request, "scores")));
    } else if (op == "model") {
      run_model(request, reply);
    } else {
      throw std::runtime_error("request: unknown op '" + op + "'");
    }
    const auto out = torch::pickle_save(at::IValue(reply));
    std::ofstream f(argv[2], std::ios::binary);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f) throw std::runtime_error(std::string("cannot write ") + argv[2]);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "kvevict_reference: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvevict_reference: %s\n", e.what());
    return 1;
  }
  return 0;
}
