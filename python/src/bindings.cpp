// kvevict from Python: the public C++ API (include/kvevict/) as the extension module
// kvevict._kvevict. This file holds the module, the options, the scorers and the wording of
// errors; caches.cpp binds the policy and the caches, attention.cpp the rest, and bindings.hpp
// what they share. Tensors cross as the same at::Tensor (no copy); a scorer is an argument (one
// bound class per scorer type) and picks the C++ template instantiation: MlaCache(opts,
// eviction, scorer=SnapKV(32, 5)) holds a BasicMlaCache<EvictionPolicy<SnapKV>>. c10 errors
// reach Python as the exception c10 maps them to (c10::ValueError -> ValueError, IndexError,
// TypeError, NotImplementedError; any other c10::Error -> RuntimeError) with kvevict's message,
// without the C++ backtrace.
//
// Not bound (see docs/python.md): TensorParallel (tensor_parallel.hpp: from Python, the options'
// reduce_contributions property takes a callable, e.g. over torch.distributed, with total_heads),
// custom scorers written in Python, and the cache-only protocol the caches use internally (Pass,
// plan/commit, append_index, ...).

#include "bindings.hpp"

namespace kvevict_python {

// ---- tensor parallelism from Python: the reduce_contributions hook -----------------------------------
/// A Python callable `reduce(layer, sums)` as a kv::ContributionReducer: it must replace `sums`
/// ([B, S] fp64, or recall's page scores, on the cache's device; contiguous) in place by their
/// sum over the tensor-parallel ranks, e.g. torch.distributed.all_reduce(sums, group=g), and
/// return None (or `sums` itself, as an in-place op does). Called with the GIL (taken if a caller
/// released it). The callable is held by a shared_ptr whose deleter takes the GIL, so options and
/// caches may be copied and destroyed anywhere.
struct PyReducer {
  std::shared_ptr<py::object> fn;

  void operator()(int64_t layer, at::Tensor& sums) const {
    py::gil_scoped_acquire gil;
    at::Tensor t = sums.is_contiguous() ? sums : sums.contiguous();
    const auto sizes = t.sizes().vec();
    const auto dtype = t.scalar_type();
    py::object r = (*fn)(layer, t);  // a Python exception propagates as py::error_already_set
    const bool returned_sums = THPVariable_Check(r.ptr()) && THPVariable_Unpack(r.ptr()).is_same(t);  // sums.add_(x)
    KVEVICT_CHECK_TYPE(r.is_none() || returned_sums, "reduce_contributions(layer=", layer, ", sums) must reduce ",
                       "`sums` in place and return None or sums itself (torch.distributed.all_reduce(sums, group=...), ",
                       "not async_op=True), got ", std::string(py::str(py::type::of(r).attr("__name__"))));
    KVEVICT_CHECK_VALUE(t.sizes().vec() == sizes && t.scalar_type() == dtype, "reduce_contributions(layer=", layer,
                        ", sums) must keep sums' shape ", ints_repr(sizes), " and dtype ", dtype, ", got ",
                        ints_repr(t.sizes().vec()), " ", t.scalar_type());
    if (!t.is_same(sums)) sums.copy_(t);
  }
};

kv::ContributionReducer reducer_of(const py::object& fn, const char* owner) {
  if (fn.is_none()) return nullptr;
  KVEVICT_CHECK_TYPE(PyCallable_Check(fn.ptr()), owner, ".reduce_contributions must be a callable reduce(layer, sums) "
                     "or None, got ", std::string(py::str(py::type::of(fn).attr("__name__"))));
  auto held = std::shared_ptr<py::object>(new py::object(fn), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
  return PyReducer{std::move(held)};
}

/// The property's type in signatures: Optional[Callable[[int, torch.Tensor], None]].
using ReducerArg = py::typing::Optional<py::typing::Callable<void(int64_t, at::Tensor)>>;

ReducerArg reducer_object(const kv::ContributionReducer& r) {
  if (!r) return py::reinterpret_borrow<ReducerArg>(py::none());
  if (const auto* p = r.target<PyReducer>()) return py::reinterpret_borrow<ReducerArg>(*p->fn);
  return py::reinterpret_borrow<ReducerArg>(py::str("<C++ reducer>"));
}

/// The `reduce_contributions` property of an options class (EvictionPolicyOptions, MlaCacheOptions,
/// MlaLatentCacheOptions): None or a Python callable reduce(layer, sums); with total_heads (every
/// rank's heads) it makes ranks that each hold some of the heads keep the same tokens.
template <class O>
void def_reduce_contributions(py::class_<O>& c, const char* owner) {
  c.def_property(
      "reduce_contributions", [](const O& o) { return reducer_object(o.reduce_contributions()); },
      [owner](O& o, const ReducerArg& fn) { o.reduce_contributions(reducer_of(fn, owner)); },
      "None (the default: nothing reduced) or a callable reduce(layer: int, sums: torch.Tensor) -> None that "
      "replaces sums (contiguous fp64 on the cache's device: [B, S] per observation, or recall's page scores) in "
      "place by their sum over the tensor-parallel ranks, e.g. lambda layer, t: torch.distributed.all_reduce(t, "
      "group=g). With total_heads set to every rank's heads, every rank then keeps the same tokens.");
}

// ---- options ------------------------------------------------------------------------------------------
template <class O>
void def_cache_options_common(py::class_<O>& c) {
  c.def_property("num_layers", [](const O& o) { return o.num_layers(); }, [](O& o, int64_t v) { o.num_layers(v); })
      .def_property("num_heads", [](const O& o) { return o.num_heads(); }, [](O& o, int64_t v) { o.num_heads(v); })
      .def_property("batch_size", [](const O& o) { return o.batch_size(); }, [](O& o, int64_t v) { o.batch_size(v); })
      .def_property("dtype", [](const O& o) { return o.dtype(); }, [](O& o, at::ScalarType v) { o.dtype(v); })
      .def_property("device", [](const O& o) { return o.device(); },
                    [](O& o, const DeviceArg& v) { o.device(device_of(v, options_name<O>())); },
                    "Device of the cache's buffers and state: a torch.device or a name ('cpu', 'cuda:1').")
      .def_property("check_observations", [](const O& o) { return o.check_observations(); },
                    [](O& o, c10::optional<bool> v) { o.check_observations(v); })
      .def_property("layer_budgets", [](const O& o) { return o.layer_budgets(); },
                    [](O& o, std::vector<int64_t> v) { o.layer_budgets(std::move(v)); })
      .def_property("total_heads", [](const O& o) { return o.total_heads(); }, [](O& o, int64_t v) { o.total_heads(v); })
      .def_property("lazy_reduction", [](const O& o) { return o.lazy_reduction(); },
                    [](O& o, bool v) { o.lazy_reduction(v); })
      .def_property("tier_tokens", [](const O& o) { return o.tier_tokens(); }, [](O& o, int64_t v) { o.tier_tokens(v); })
      .def_property("tier_page_size", [](const O& o) { return o.tier_page_size(); },
                    [](O& o, int64_t v) { o.tier_page_size(v); })
      .def_property("tier_scoring", [](const O& o) { return o.tier_scoring(); },
                    [](O& o, kv::TierScoring v) { o.tier_scoring(v); })
      .def("validate", [](const O& o) { o.validate(); }, "Raises ValueError naming a bad value.");
  def_reduce_contributions(c, options_name<O>());
}

void def_options(py::module_& m) {
  // Enums: Python names first (what .name and repr() show), then the C++ names as aliases.
  py::enum_<kv::TierScoring>(m, "TierScoring",
                             "How recall() scores the host tier's pages: PER_HEAD (a softmax per head and query) or "
                             "HEAD_MEAN (one softmax per query of the heads' mean logit's bound: heads times cheaper "
                             "in the latent layout). kPerHead and kHeadMean are the C++ names, kept as aliases.")
      .value("PER_HEAD", kv::TierScoring::kPerHead, "A softmax over the pages per head and query (the default).")
      .value("HEAD_MEAN", kv::TierScoring::kHeadMean,
             "One softmax per query over the pages, of the heads' mean bound: heads times cheaper (latent layout).")
      .value("kPerHead", kv::TierScoring::kPerHead, "Alias of PER_HEAD (the C++ name).")
      .value("kHeadMean", kv::TierScoring::kHeadMean, "Alias of HEAD_MEAN (the C++ name).");

  py::class_<kv::EvictionOptions>(
      m, "EvictionOptions",
      "What an eviction pass keeps per layer and row (H2O, Zhang et al. 2023, Sec. 3; sinks from StreamingLLM, Xiao "
      "et al. 2023): the first n_sink positions, the `budget` highest-ranked other tokens and the n_recent newest. "
      "Checked (validate()) when a cache or policy is built.")
      .def(py::init([](int64_t budget, int64_t n_sink, int64_t n_recent, int64_t evict_every) {
             return kv::EvictionOptions(budget).n_sink(n_sink).n_recent(n_recent).evict_every(evict_every);
           }),
           py::arg("budget") = 64, py::kw_only(), py::arg("n_sink") = 4, py::arg("n_recent") = 16,
           py::arg("evict_every") = 1)
      .def_property("budget", [](const kv::EvictionOptions& o) { return o.budget(); },
                    [](kv::EvictionOptions& o, int64_t v) { o.budget(v); })
      .def_property("n_sink", [](const kv::EvictionOptions& o) { return o.n_sink(); },
                    [](kv::EvictionOptions& o, int64_t v) { o.n_sink(v); })
      .def_property("n_recent", [](const kv::EvictionOptions& o) { return o.n_recent(); },
                    [](kv::EvictionOptions& o, int64_t v) { o.n_recent(v); })
      .def_property("evict_every", [](const kv::EvictionOptions& o) { return o.evict_every(); },
                    [](kv::EvictionOptions& o, int64_t v) { o.evict_every(v); })
      .def("capacity", &kv::EvictionOptions::capacity, "n_sink + budget + n_recent.")
      .def("validate", &kv::EvictionOptions::validate,
           "Raises ValueError naming the value: a count < 0 or > 2^40, evict_every < 1, capacity < 1.")
      .def_property_readonly_static("MAX_TOKENS", [](const py::type&) { return kv::EvictionOptions::kMaxTokens; })
      .def("__repr__", [](const kv::EvictionOptions& o) {
        std::ostringstream s;
        s << "EvictionOptions(budget=" << o.budget() << ", n_sink=" << o.n_sink() << ", n_recent=" << o.n_recent()
          << ", evict_every=" << o.evict_every() << ")";
        return s.str();
      });

  py::class_<kv::EvictionPolicyOptions> po(m, "EvictionPolicyOptions",
                                           "The shape of an EvictionPolicy's state: layers, heads, rows, device, "
                                           "checks, per-layer budgets.");
  po.def(py::init([](int64_t layers, int64_t heads, int64_t batch, const DeviceArg& device, c10::optional<bool> check,
                     std::vector<int64_t> budgets, int64_t total_heads, bool lazy) {
           return kv::EvictionPolicyOptions(layers, heads)
               .batch_size(batch)
               .device(device_of(device, "EvictionPolicyOptions"))
               .check_observations(check)
               .layer_budgets(std::move(budgets))
               .total_heads(total_heads)
               .lazy_reduction(lazy);
         }),
         py::arg("num_layers"), py::arg("num_heads"), py::kw_only(), py::arg("batch_size") = 1,
         py::arg("device") = "cpu", py::arg("check_observations") = py::none(),
         py::arg("layer_budgets") = std::vector<int64_t>{}, py::arg("total_heads") = 0,
         py::arg("lazy_reduction") = false)
      .def_property("num_layers", [](const kv::EvictionPolicyOptions& o) { return o.num_layers(); },
                    [](kv::EvictionPolicyOptions& o, int64_t v) { o.num_layers(v); })
      .def_property("num_heads", [](const kv::EvictionPolicyOptions& o) { return o.num_heads(); },
                    [](kv::EvictionPolicyOptions& o, int64_t v) { o.num_heads(v); })
      .def_property("batch_size", [](const kv::EvictionPolicyOptions& o) { return o.batch_size(); },
                    [](kv::EvictionPolicyOptions& o, int64_t v) { o.batch_size(v); })
      .def_property("device", [](const kv::EvictionPolicyOptions& o) { return o.device(); },
                    [](kv::EvictionPolicyOptions& o, const DeviceArg& v) { o.device(device_of(v, "EvictionPolicyOptions")); },
                    "Device of the state: a torch.device or a name ('cpu', 'cuda:1').")
      .def_property("check_observations", [](const kv::EvictionPolicyOptions& o) { return o.check_observations(); },
                    [](kv::EvictionPolicyOptions& o, c10::optional<bool> v) { o.check_observations(v); })
      .def_property("layer_budgets", [](const kv::EvictionPolicyOptions& o) { return o.layer_budgets(); },
                    [](kv::EvictionPolicyOptions& o, std::vector<int64_t> v) { o.layer_budgets(std::move(v)); })
      .def_property("total_heads", [](const kv::EvictionPolicyOptions& o) { return o.total_heads(); },
                    [](kv::EvictionPolicyOptions& o, int64_t v) { o.total_heads(v); })
      .def_property("lazy_reduction", [](const kv::EvictionPolicyOptions& o) { return o.lazy_reduction(); },
                    [](kv::EvictionPolicyOptions& o, bool v) { o.lazy_reduction(v); })
      .def("validate", [](const kv::EvictionPolicyOptions& o) { o.validate(); }, "Raises ValueError naming a bad value.")
      .def("__repr__", [](const kv::EvictionPolicyOptions& o) {
        std::ostringstream s;
        s << "EvictionPolicyOptions(num_layers=" << o.num_layers() << ", num_heads=" << o.num_heads()
          << ", batch_size=" << o.batch_size() << ", device='" << o.device().str() << "'" << options_tail(o) << ")";
        return s.str();
      });
  def_reduce_contributions(po, "EvictionPolicyOptions");

  py::class_<kv::MlaCacheOptions> eo(m, "MlaCacheOptions",
                                     "Shape, dtype and device of an expanded-layout cache (MlaCache): per layer, keys "
                                     "[B, H, S, qk_dim] and values [B, H, S, v_dim] (DeepSeek-V3: 192 = 128 no-RoPE + "
                                     "64 RoPE, and 128).");
  eo.def(py::init([](int64_t layers, int64_t heads, int64_t qk_dim, int64_t v_dim, int64_t batch, at::ScalarType dtype,
                     const DeviceArg& device, c10::optional<bool> check, std::vector<int64_t> budgets, int64_t total_heads,
                     bool lazy, int64_t tier_tokens, int64_t tier_page_size, kv::TierScoring tier_scoring) {
           kv::MlaCacheOptions o(layers, heads);
           o.qk_dim(qk_dim).v_dim(v_dim);
           o.batch_size(batch).dtype(dtype).device(device_of(device, options_name<decltype(o)>())).check_observations(check);
           o.layer_budgets(std::move(budgets)).total_heads(total_heads).lazy_reduction(lazy);
           o.tier_tokens(tier_tokens).tier_page_size(tier_page_size).tier_scoring(tier_scoring);
           return o;
         }),
         py::arg("num_layers"), py::arg("num_heads"), py::kw_only(), py::arg("qk_dim") = 192, py::arg("v_dim") = 128,
         py::arg("batch_size") = 1, py::arg("dtype") = at::kFloat, py::arg("device") = "cpu",
         py::arg("check_observations") = py::none(), py::arg("layer_budgets") = std::vector<int64_t>{},
         py::arg("total_heads") = 0, py::arg("lazy_reduction") = false, py::arg("tier_tokens") = 0,
         py::arg("tier_page_size") = 16, py::arg("tier_scoring") = kv::TierScoring::kPerHead)
      .def_property("qk_dim", [](const kv::MlaCacheOptions& o) { return o.qk_dim(); },
                    [](kv::MlaCacheOptions& o, int64_t v) { o.qk_dim(v); })
      .def_property("v_dim", [](const kv::MlaCacheOptions& o) { return o.v_dim(); },
                    [](kv::MlaCacheOptions& o, int64_t v) { o.v_dim(v); })
      .def("__repr__", [](const kv::MlaCacheOptions& o) {
        return cache_options_repr(o, ", qk_dim=" + std::to_string(o.qk_dim()) + ", v_dim=" + std::to_string(o.v_dim()));
      });
  def_cache_options_common(eo);

  py::class_<kv::MlaLatentCacheOptions> lo(m, "MlaLatentCacheOptions",
                                           "Shape, dtype and device of a latent-layout cache (MlaLatentCache): per "
                                           "layer ckv [B, S, kv_lora_rank] and kpe [B, S, qk_rope_dim], shared by all "
                                           "heads (DeepSeek-V3: 512 and 64).");
  lo.def(py::init([](int64_t layers, int64_t heads, int64_t rank, int64_t rope, int64_t nope, int64_t batch,
                     at::ScalarType dtype, const DeviceArg& device, c10::optional<bool> check, std::vector<int64_t> budgets,
                     int64_t total_heads, bool lazy, int64_t tier_tokens, int64_t tier_page_size,
                     kv::TierScoring tier_scoring) {
           kv::MlaLatentCacheOptions o(layers, heads);
           o.kv_lora_rank(rank).qk_rope_dim(rope).qk_nope_dim(nope);
           o.batch_size(batch).dtype(dtype).device(device_of(device, options_name<decltype(o)>())).check_observations(check);
           o.layer_budgets(std::move(budgets)).total_heads(total_heads).lazy_reduction(lazy);
           o.tier_tokens(tier_tokens).tier_page_size(tier_page_size).tier_scoring(tier_scoring);
           return o;
         }),
         py::arg("num_layers"), py::arg("num_heads"), py::kw_only(), py::arg("kv_lora_rank") = 512,
         py::arg("qk_rope_dim") = 64, py::arg("qk_nope_dim") = 128, py::arg("batch_size") = 1,
         py::arg("dtype") = at::kFloat, py::arg("device") = "cpu", py::arg("check_observations") = py::none(),
         py::arg("layer_budgets") = std::vector<int64_t>{}, py::arg("total_heads") = 0,
         py::arg("lazy_reduction") = false, py::arg("tier_tokens") = 0, py::arg("tier_page_size") = 16,
         py::arg("tier_scoring") = kv::TierScoring::kPerHead)
      .def_property("kv_lora_rank", [](const kv::MlaLatentCacheOptions& o) { return o.kv_lora_rank(); },
                    [](kv::MlaLatentCacheOptions& o, int64_t v) { o.kv_lora_rank(v); })
      .def_property("qk_rope_dim", [](const kv::MlaLatentCacheOptions& o) { return o.qk_rope_dim(); },
                    [](kv::MlaLatentCacheOptions& o, int64_t v) { o.qk_rope_dim(v); })
      .def_property("qk_nope_dim", [](const kv::MlaLatentCacheOptions& o) { return o.qk_nope_dim(); },
                    [](kv::MlaLatentCacheOptions& o, int64_t v) { o.qk_nope_dim(v); })
      .def("__repr__", [](const kv::MlaLatentCacheOptions& o) {
        return cache_options_repr(o, ", kv_lora_rank=" + std::to_string(o.kv_lora_rank()) + ", qk_rope_dim=" +
                                         std::to_string(o.qk_rope_dim()) + ", qk_nope_dim=" + std::to_string(o.qk_nope_dim()));
      });
  def_cache_options_common(lo);

  py::enum_<kv::LseBase>(m, "LseBase", "The logarithm base of a kernel's LSE: E (natural log: FlashMLA, "
                                       "FlashAttention) or TWO (log2: FlashInfer's default). kE and k2 are the C++ "
                                       "names, kept as aliases.")
      .value("E", kv::LseBase::kE, "Natural log (FlashMLA, FlashAttention; the default).")
      .value("TWO", kv::LseBase::k2, "Base 2 (FlashInfer's default).")
      .value("kE", kv::LseBase::kE, "Alias of E (the C++ name).")
      .value("k2", kv::LseBase::k2, "Alias of TWO (the C++ name).");

  py::class_<kv::LseOptions>(m, "LseOptions",
                             "How observe_lse() and friends chunk their work and read the LSE. head_chunk 0 (the "
                             "default): as many heads per chunk as fit in chunk_bytes of fp32 probabilities. Peak "
                             "extra memory about 2 x chunk_bytes.")
      .def(py::init([](int64_t query_chunk, int64_t head_chunk, int64_t chunk_bytes, kv::LseBase base) {
             return kv::LseOptions().query_chunk(query_chunk).head_chunk(head_chunk).chunk_bytes(chunk_bytes).base(base);
           }),
           py::kw_only(), py::arg("query_chunk") = 64, py::arg("head_chunk") = 0,
           py::arg("chunk_bytes") = kv::LseOptions().chunk_bytes(), py::arg("base") = kv::LseBase::kE)
      .def_property("query_chunk", [](const kv::LseOptions& o) { return o.query_chunk(); },
                    [](kv::LseOptions& o, int64_t v) { o.query_chunk(v); })
      .def_property("head_chunk", [](const kv::LseOptions& o) { return o.head_chunk(); },
                    [](kv::LseOptions& o, int64_t v) { o.head_chunk(v); })
      .def_property("chunk_bytes", [](const kv::LseOptions& o) { return o.chunk_bytes(); },
                    [](kv::LseOptions& o, int64_t v) { o.chunk_bytes(v); })
      .def_property("base", [](const kv::LseOptions& o) { return o.base(); },
                    [](kv::LseOptions& o, kv::LseBase v) { o.base(v); })
      .def("validate", &kv::LseOptions::validate, "Raises ValueError naming a chunk below its minimum.")
      .def("__repr__", [](const kv::LseOptions& o) {
        std::ostringstream s;
        s << "LseOptions(query_chunk=" << o.query_chunk() << ", head_chunk=" << o.head_chunk()
          << ", chunk_bytes=" << o.chunk_bytes() << ", base=LseBase." << (o.base() == kv::LseBase::k2 ? "TWO" : "E") << ")";
        return s.str();
      });
}

void def_scorers(py::module_& m) {
  py::class_<kv::CumulativeAttention>(m, "CumulativeAttention",
                                      "H2O's accumulated attention (Zhang et al. 2023, Sec. 3.2; the default): "
                                      "score += mean over heads of the observed attention.")
      .def(py::init<>())
      .def_property_readonly_static("name", [](const py::type&) { return kv::CumulativeAttention::kName; })
      .def("__repr__", [](const kv::CumulativeAttention&) { return "CumulativeAttention()"; });
  py::class_<kv::MeanObservedAttention>(m, "MeanObservedAttention",
                                        "The cumulative sum divided by how many observed queries could see the token.")
      .def(py::init<>())
      .def_property_readonly_static("name", [](const py::type&) { return kv::MeanObservedAttention::kName; })
      .def("__repr__", [](const kv::MeanObservedAttention&) { return "MeanObservedAttention()"; });
  py::class_<kv::LatestAttention>(m, "LatestAttention",
                                  "TOVA (Oren et al. 2024, Sec. 4): the last query's attention replaces the score.")
      .def(py::init<>())
      .def_property_readonly_static("name", [](const py::type&) { return kv::LatestAttention::kName; })
      .def("__repr__", [](const kv::LatestAttention&) { return "LatestAttention()"; });
  py::class_<kv::DecayedAttention>(m, "DecayedAttention",
                                   "score = gamma * score + contribution: stale heavy hitters fade.")
      .def(py::init([](double gamma) { return kv::DecayedAttention(static_cast<float>(gamma)); }), py::arg("gamma") = 0.9,
           "Raises ValueError if gamma is outside [0, 1].")
      .def_property_readonly("gamma", &kv::DecayedAttention::gamma)
      .def_property_readonly_static("name", [](const py::type&) { return kv::DecayedAttention::kName; })
      .def("__repr__", [](const kv::DecayedAttention& s) { return "DecayedAttention(gamma=" + short_float(s.gamma()) + ")"; });
  py::class_<kv::SnapKV> snap(m, "SnapKV",
                              "SnapKV's observation window (Li et al. 2024, Sec. 4): the last `window` prompt "
                              "queries vote, heads averaged, then 1-D pooling over `kernel` tokens. For prompt "
                              "compression (compress_prompt); set n_recent >= window.");
  py::enum_<kv::SnapKV::Pooling>(snap, "Pooling",
                                 "SnapKV's 1-D pooling of the votes over `kernel` tokens: AVG (zero padding counted) or "
                                 "MAX. kAvg and kMax are the C++ names, kept as aliases.")
      .value("AVG", kv::SnapKV::Pooling::kAvg, "Mean over the kernel, zero padding counted (the default).")
      .value("MAX", kv::SnapKV::Pooling::kMax, "Max over the kernel.")
      .value("kAvg", kv::SnapKV::Pooling::kAvg, "Alias of AVG (the C++ name).")
      .value("kMax", kv::SnapKV::Pooling::kMax, "Alias of MAX (the C++ name).");
  snap.def(py::init<int64_t, int64_t, kv::SnapKV::Pooling>(), py::arg("window") = 64, py::arg("kernel") = 5,
           py::arg("pooling") = kv::SnapKV::Pooling::kAvg,
           "Raises ValueError if window < 1 or kernel is even or < 1.")
      .def_property_readonly("window", &kv::SnapKV::window)
      .def_property_readonly("kernel", &kv::SnapKV::kernel)
      .def_property_readonly("pooling", &kv::SnapKV::pooling)
      .def_property_readonly_static("name", [](const py::type&) { return kv::SnapKV::kName; })
      .def("pool", &kv::SnapKV::pool, py::arg("ranks"),
           "Pools [B, T] fp32 ranks (position order) along the token axis: mean (zero padding counted) or max over "
           "t - kernel/2 .. t + kernel/2.")
      .def("__repr__", [](const kv::SnapKV& s) {
        return "SnapKV(window=" + std::to_string(s.window()) + ", kernel=" + std::to_string(s.kernel()) +
               (s.pooling() == kv::SnapKV::Pooling::kMax ? ", pooling=SnapKV.Pooling.MAX" : "") + ")";
      });
}

// ---- Python-side wording of errors --------------------------------------------------------------------
/// kvevict's messages name C++ builder calls where a Python user writes a keyword
/// (check_observations(false) is check_observations=False from Python).
std::string pythonic(std::string msg) {
  static const std::pair<const char*, const char*> words[] = {
      {"build with check_observations(false)", "build the options with check_observations=False"},
      {"check_observations(false)", "check_observations=False"},
      {"lazy_reduction(false)", "lazy_reduction=False"},
      {"LseRing::", "LseRing."},
      {"LseOptions::base", "LseOptions.base"},
  };
  for (const auto& [cpp, python] : words) {
    for (size_t at = msg.find(cpp); at != std::string::npos; at = msg.find(cpp, at + std::strlen(python))) {
      msg.replace(at, std::strlen(cpp), python);
    }
  }
  return msg;
}

// pybind11 answers a call whose arguments no overload converts with "f(): incompatible function
// arguments", every overload and the repr() of every argument (a tensor's values: kilobytes).
// Every function this module binds (functions, methods, constructors, property setters) has its
// dispatcher wrapped, which costs nothing on a call that converts: on that TypeError,
// kvevict._errors.explain() (Python) writes kvevict's message instead, naming the function, the
// argument, the type it takes and the type it got. Anything else passes through unchanged.
namespace type_errors {
struct Site {
  std::string where;  // "attend", "MlaCache.update", "MlaCacheOptions" (a constructor), "MlaCacheOptions.dtype"
  std::string kind;   // "function", "method", "init", "getter" or "setter"
  std::string doc;    // the pybind11 docstring: its signature lines
};
std::unordered_map<PyObject*, Site>& sites() {
  static auto* s = new std::unordered_map<PyObject*, Site>();  // never destroyed: outlives the interpreter
  return *s;
}
PyCFunction dispatcher = nullptr;  // pybind11's, shared by every bound function

/// With pybind11's TypeError set: replaces it with kvevict's message if it is the
/// "incompatible arguments" one of a known site and kvevict._errors can word it.
void reword(PyObject* self, const std::function<py::tuple()>& args, const std::function<py::dict()>& kwargs) {
  auto site = sites().find(self);
  if (site == sites().end() || !PyErr_ExceptionMatches(PyExc_TypeError)) return;
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  std::string text;
  try {
    const std::string original = py::str(value ? value : Py_None).cast<std::string>();
    if (original.find("(): incompatible ") != std::string::npos) {
      py::object worded = py::module_::import("kvevict._errors")
                              .attr("explain")(site->second.where, site->second.kind, site->second.doc, args(), kwargs());
      if (!worded.is_none()) text = worded.cast<std::string>();
    }
  } catch (...) {
    text.clear();  // no kvevict._errors (or it failed): pybind11's own message
  }
  if (text.empty()) {
    PyErr_Restore(type, value, tb);
    return;
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_SetString(PyExc_TypeError, text.c_str());
}

// pybind11 >= 3: METH_FASTCALL | METH_KEYWORDS.
PyObject* fastcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  using F = PyObject* (*)(PyObject*, PyObject* const*, size_t, PyObject*);
  PyObject* result = reinterpret_cast<F>(reinterpret_cast<void (*)()>(dispatcher))(self, args, nargsf, kwnames);
  if (result == nullptr) {
    const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    reword(
        self,
        [&] {
          py::tuple t(n);
          for (Py_ssize_t i = 0; i < n; ++i) t[i] = py::reinterpret_borrow<py::object>(args[i]);
          return t;
        },
        [&] {
          py::dict d;
          for (Py_ssize_t i = 0; kwnames && i < PyTuple_GET_SIZE(kwnames); ++i) {
            d[PyTuple_GET_ITEM(kwnames, i)] = py::reinterpret_borrow<py::object>(args[n + i]);
          }
          return d;
        });
  }
  return result;
}

// pybind11 2.x: METH_VARARGS | METH_KEYWORDS.
PyObject* varargs(PyObject* self, PyObject* args, PyObject* kwargs) {
  using F = PyObject* (*)(PyObject*, PyObject*, PyObject*);
  PyObject* result = reinterpret_cast<F>(reinterpret_cast<void (*)()>(dispatcher))(self, args, kwargs);
  if (result == nullptr) {
    reword(
        self, [&] { return py::reinterpret_borrow<py::tuple>(args); },
        [&] { return kwargs ? py::reinterpret_borrow<py::dict>(kwargs) : py::dict(); });
  }
  return result;
}

void hook(py::handle f, const std::string& where, const char* kind) {
  PyObject* fn = f.ptr();
  if (fn == nullptr || fn == Py_None) return;
  if (PyInstanceMethod_Check(fn)) fn = PyInstanceMethod_GET_FUNCTION(fn);
  if (!PyCFunction_Check(fn)) return;
  PyMethodDef* def = reinterpret_cast<PyCFunctionObject*>(fn)->m_ml;
  if (def->ml_meth != dispatcher) return;  // not pybind11's (or hooked already)
  const int flags = def->ml_flags & (METH_VARARGS | METH_FASTCALL | METH_KEYWORDS);
  if (flags == (METH_FASTCALL | METH_KEYWORDS)) {
    def->ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fastcall));
  } else if (flags == (METH_VARARGS | METH_KEYWORDS)) {
    def->ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(varargs));
  } else {
    return;
  }
  const py::object doc = py::reinterpret_borrow<py::object>(fn).attr("__doc__");
  sites()[PyCFunction_GET_SELF(fn)] = Site{where, kind, doc.is_none() ? std::string() : doc.cast<std::string>()};
}

void hook_class(py::handle cls, const std::string& name) {
  for (auto item : py::dict(cls.attr("__dict__"))) {  // a copy of the class's mappingproxy
    const std::string key = item.first.cast<std::string>();
    py::handle v = item.second;
    if (PyType_Check(v.ptr())) {
      if (py::hasattr(v, "__module__") && py::str(v.attr("__module__")).cast<std::string>() == "kvevict._kvevict") {
        hook_class(v, name + "." + key);
      }
    } else if (py::isinstance(v, py::module_::import("builtins").attr("property"))) {
      hook(v.attr("fget"), name + "." + key, "getter");
      hook(v.attr("fset"), name + "." + key, "setter");
    } else if (key == "__init__") {
      hook(v, name, "init");
    } else {
      hook(v, name + "." + key, "method");
    }
  }
}

void hook_module(py::module_& m) {
  const py::cpp_function probe([] {});
  dispatcher = reinterpret_cast<PyCFunctionObject*>(probe.ptr())->m_ml->ml_meth;
  for (auto item : py::reinterpret_borrow<py::dict>(m.attr("__dict__"))) {
    const std::string key = item.first.cast<std::string>();
    py::handle v = item.second;
    if (PyType_Check(v.ptr())) {
      hook_class(v, key);
    } else {
      hook(v, key, "function");
    }
  }
}
}  // namespace type_errors

}  // namespace kvevict_python

using namespace kvevict_python;

PYBIND11_MODULE(_kvevict, m) {
  m.doc() = "kvevict's C++ API (include/kvevict/) for PyTorch: KV-cache eviction for DeepSeek-style (MLA) models.";
  m.attr("__version__") = std::to_string(KVEVICT_VERSION_MAJOR) + "." + std::to_string(KVEVICT_VERSION_MINOR) + "." +
                          std::to_string(KVEVICT_VERSION_PATCH);
  // c10's exception classes to the Python exceptions PyTorch maps them to, with kvevict's message.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, pythonic(e.what_without_backtrace()).c_str());
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, pythonic(e.what_without_backtrace()).c_str());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, pythonic(e.what_without_backtrace()).c_str());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, pythonic(e.what_without_backtrace()).c_str());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, pythonic(e.what_without_backtrace()).c_str());
    }
  });
  def_options(m);
  def_scorers(m);
  def_tools(m);
  def_policy(m);
  def_caches(m);
  def_attention(m);
  type_errors::hook_module(m);
}
