// kvevict from Python: attention, LSE scoring, prefill, selection, moves and the memory model
// (python/src/bindings.hpp).
#include "bindings.hpp"

namespace kvevict_python {

// ---- attention, LSE scoring, prefill ----------------------------------------------------------------------
/// attend()'s result: out, or (out, probs) with return_probs (torch.Tensor | tuple[...] in help()).
using OutAndProbs = std::variant<at::Tensor, std::tuple<at::Tensor, at::Tensor>>;
OutAndProbs out_and_probs(const at::Tensor& out, const at::Tensor& probs, bool return_probs) {
  if (return_probs) return std::make_tuple(out, probs);
  return out;
}

void def_attention(py::module_& m) {
  m.def(
      "attend",
      [](const at::Tensor& q, Expanded& c, int64_t layer, c10::optional<double> scale, bool observe,
         bool return_probs) {
        at::Tensor probs;
        auto out = with(c, [&](auto& x) { return kv::attend(q, x, layer, scale, return_probs ? &probs : nullptr, observe); });
        return out_and_probs(out, probs, return_probs);
      },
      py::arg("q"), py::arg("cache"), py::arg("layer"), py::arg("scale") = py::none(), py::kw_only(),
      py::arg("observe") = true, py::arg("return_probs") = false,
      "Attention of the newest T tokens over `layer`'s live slots (expanded layout), masked per sequence (live "
      "slots, causal by position, pads zero), then cache.observe(layer, probs) unless observe=False.\n"
      "q: [B, H, T, qk_dim], the cache's dtype and device, 1 <= T <= seen_tokens. scale: default 1/sqrt(qk_dim).\n"
      "Returns out [B, H, T, v_dim] in the cache dtype, or (out, probs [B, H, T, S] fp32, slot order) with "
      "return_probs. Raises on a bad layer, shape, dtype or device; the cache is unchanged then. fp16 on CPU "
      "computes in fp32.");
  m.def(
      "attend_absorbed",
      [](const at::Tensor& q_absorbed, const at::Tensor& q_pe, Latent& c, int64_t layer, c10::optional<double> scale,
         bool observe, bool return_probs) {
        at::Tensor probs;
        auto out = with(c, [&](auto& x) {
          return kv::attend_absorbed(q_absorbed, q_pe, x, layer, scale, return_probs ? &probs : nullptr, observe);
        });
        return out_and_probs(out, probs, return_probs);
      },
      py::arg("q_absorbed"), py::arg("q_pe"), py::arg("cache"), py::arg("layer"), py::arg("scale") = py::none(),
      py::kw_only(), py::arg("observe") = true, py::arg("return_probs") = false,
      "Absorbed MLA attention over `layer`'s latent slots (DeepSeek-V2 Sec. 2.1.2): logits q_absorbed . ckv + "
      "q_pe . kpe, output probs @ ckv (apply W_UV, then o_proj). q_absorbed [B, H, T, kv_lora_rank], q_pe [B, H, "
      "T, qk_rope_dim]. scale: default 1/sqrt(qk_nope_dim + qk_rope_dim). Returns [B, H, T, kv_lora_rank], or "
      "(out, probs) with return_probs. Raises as attend().");
  m.def(
      "observe_lse",
      [](const at::Tensor& q, Expanded& c, int64_t layer, const at::Tensor& lse, c10::optional<double> scale,
         const kv::LseOptions& opts) { with(c, [&](auto& x) { kv::observe_lse(q, x, layer, lse, scale, opts); }); },
      py::arg("q"), py::arg("cache"), py::arg("layer"), py::arg("lse"), py::arg("scale") = py::none(),
      py::arg("opts") = kv::LseOptions(),
      "Scores from a fused kernel's log-sum-exp (expanded layout): recomputes p = exp(scale * q.k - lse) in "
      "chunks with attend()'s masks and observes them, exactly as observe(probs). q [B, H, Q, qk_dim], lse "
      "[B, H, Q] fp32 (base per opts). Raises on bad shapes; with checks on (CPU default) if the lse does not "
      "match the logits (a query's probabilities must sum to 1 within 1e-3: a wrong scale or base, a NaN, infinite "
      "or shifted lse fail). The scorer state is unchanged then.");
  m.def(
      "observe_lse_absorbed",
      [](const at::Tensor& q_absorbed, const at::Tensor& q_pe, Latent& c, int64_t layer, const at::Tensor& lse,
         c10::optional<double> scale, const kv::LseOptions& opts) {
        with(c, [&](auto& x) { kv::observe_lse_absorbed(q_absorbed, q_pe, x, layer, lse, scale, opts); });
      },
      py::arg("q_absorbed"), py::arg("q_pe"), py::arg("cache"), py::arg("layer"), py::arg("lse"),
      py::arg("scale") = py::none(), py::arg("opts") = kv::LseOptions(),
      "observe_lse() for the latent layout: logits scale * (q_absorbed . ckv + q_pe . kpe).");

  const auto ring_size = [](Ring& r) {
    return std::visit([](auto& v) { return std::visit([](auto& x) { return x.ring_size(); }, v); }, r.v);
  };
  const auto buffered = [](Ring& r, int64_t layer) {
    return std::visit([&](auto& v) { return std::visit([&](auto& x) { return x.buffered(layer); }, v); }, r.v);
  };
  // A DeprecationWarning (shown once per call site by Python's default filters); raises if a
  // filter turns it into an error.
  const auto deprecated = [](const char* message) {
    if (PyErr_WarnEx(PyExc_DeprecationWarning, message, 1) != 0) throw py::error_already_set();
  };
  py::class_<Ring>(m, "LseRing",
                   "Amortised LSE scoring for one cache: buffers the queries and LSEs of up to evict_every decode "
                   "steps per layer and scores them with one batched product when full or when a pass is due. "
                   "push() after every update(); flush() before a ragged update, finish, add_sequence, reset or "
                   "truncate. Keeps the cache alive.")
      .def(py::init([](Expanded& c, c10::optional<double> scale, const kv::LseOptions& opts) {
             return with(c, [&](auto& x) {
               using C = std::decay_t<decltype(x)>;
               using V = PerScorer<ExpandedRingOf>;
               return std::make_unique<Ring>(Ring{V(std::in_place_type<kv::LseRing<C>>, x, scale, opts)});
             });
           }),
           py::arg("cache"), py::arg("scale") = py::none(), py::arg("opts") = kv::LseOptions(), py::keep_alive<1, 2>())
      .def(py::init([](Latent& c, c10::optional<double> scale, const kv::LseOptions& opts) {
             return with(c, [&](auto& x) {
               using C = std::decay_t<decltype(x)>;
               using V = PerScorer<LatentRingOf>;
               return std::make_unique<Ring>(Ring{V(std::in_place_type<kv::LseRing<C>>, x, scale, opts)});
             });
           }),
           py::arg("cache"), py::arg("scale") = py::none(), py::arg("opts") = kv::LseOptions(), py::keep_alive<1, 2>())
      .def("ring_size", ring_size, "Query columns the ring holds before it scores them: the cache's evict_every.")
      .def("buffered", buffered, py::arg("layer"), "Query columns buffered for `layer`. IndexError for a bad layer.")
      .def(
          "capacity",
          [ring_size, deprecated](Ring& r) {
            deprecated("LseRing.capacity() is deprecated: use ring_size()");
            return ring_size(r);
          },
          "Old name of ring_size() (deprecated: \"capacity\" is n_sink + budget + n_recent everywhere else).")
      .def(
          "pending",
          [buffered, deprecated](Ring& r, int64_t layer) {
            deprecated("LseRing.pending() is deprecated: use buffered()");
            return buffered(r, layer);
          },
          py::arg("layer"), "Old name of buffered() (deprecated).")
      .def(
          "push",
          [](Ring& r, int64_t layer, const at::Tensor& q, const at::Tensor& lse) {
            KVEVICT_CHECK_TYPE(r.v.index() == 0,
                               "LseRing.push: this ring scores an MlaLatentCache: push(layer, q_absorbed, q_pe, lse)");
            std::visit([&](auto& x) { x.push(layer, q, lse); }, std::get<0>(r.v));
          },
          py::arg("layer"), py::arg("q"), py::arg("lse"),
          "Expanded layout: buffers q [B, H, T, qk_dim] and lse [B, H, T] of the latest update. Raises TypeError "
          "for a latent ring.")
      .def(
          "push",
          [](Ring& r, int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& lse) {
            KVEVICT_CHECK_TYPE(r.v.index() == 1, "LseRing.push: this ring scores an MlaCache: push(layer, q, lse)");
            std::visit([&](auto& x) { x.push(layer, q_absorbed, q_pe, lse); }, std::get<1>(r.v));
          },
          py::arg("layer"), py::arg("q_absorbed"), py::arg("q_pe"), py::arg("lse"),
          "Latent layout: buffers q_absorbed [B, H, T, kv_lora_rank], q_pe [B, H, T, qk_rope_dim] and lse.")
      .def(
          "flush",
          [](Ring& r, int64_t layer) {
            std::visit([&](auto& v) { std::visit([&](auto& x) { x.flush(layer); }, v); }, r.v);
          },
          py::arg("layer"), "Scores the buffered queries of `layer` now and empties the ring.")
      .def(
          "evict",
          [](Ring& r, int64_t layer) {
            return std::visit([&](auto& v) { return std::visit([&](auto& x) { return x.evict(layer); }, v); }, r.v);
          },
          py::arg("layer"), "Flushes `layer` if a pass is due, then cache.evict(layer). Returns tokens evicted.");

  m.def(
      "prompt_scores",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse, double scale, const Scorer& scorer,
         const kv::LseOptions& opts) {
        return std::visit([&](const auto& s) { return kv::prompt_scores(q, k, lse, scale, s, opts); }, scorer);
      },
      py::arg("q"), py::arg("k"), py::arg("lse"), py::arg("scale"), py::arg("scorer") = Scorer(),
      py::arg("opts") = kv::LseOptions(),
      "Scores every prompt token by the attention the whole prompt gives it (causal), recomputed chunk by chunk "
      "from the prefill LSE (no [H, T, T] tensor), ranked by `scorer` (pooled for SnapKV). q, k [B, H, T, qk_dim], "
      "lse [B, H, T]. Returns [B, T] fp32 ranks in position order for Selection.keep_indices.");
  m.def(
      "prompt_scores_absorbed",
      [](const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& ckv, const at::Tensor& kpe,
         const at::Tensor& lse, double scale, const Scorer& scorer, const kv::LseOptions& opts) {
        return std::visit(
            [&](const auto& s) { return kv::prompt_scores_absorbed(q_absorbed, q_pe, ckv, kpe, lse, scale, s, opts); },
            scorer);
      },
      py::arg("q_absorbed"), py::arg("q_pe"), py::arg("ckv"), py::arg("kpe"), py::arg("lse"), py::arg("scale"),
      py::arg("scorer") = Scorer(), py::arg("opts") = kv::LseOptions(),
      "prompt_scores() for the latent layout: ckv [B, T, kv_lora_rank], kpe [B, T, qk_rope_dim].");
  m.def(
      "compress_prompt",
      [](Expanded& c, int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& lse, c10::optional<double> scale, const kv::LseOptions& opts) {
        return with(c, [&](auto& x) { return kv::compress_prompt(x, layer, q, k, v, lse, scale, opts); });
      },
      py::arg("cache"), py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lse"),
      py::arg("scale") = py::none(), py::arg("opts") = kv::LseOptions(),
      "One-shot prompt compression into an empty layer: prompt_scores() under the cache's scorer, then "
      "Selection.keep_indices() with the layer's capacity; the kept keys and values are appended with their prompt "
      "rank. The layer is then what appending the whole prompt and one eviction pass would leave: positions() are "
      "the kept tokens' prompt positions, seen_tokens(layer) is T, stats().tokens_evicted counts the T - n dropped "
      "tokens of each row. Returns [B, n] int64 prompt positions kept (-1 in the rows of free sequences, which stay "
      "empty). Raises if the layer holds tokens, every row "
      "is free (finish()ed: add_sequence() first), on bad shapes or non-finite scores; the cache is unchanged then "
      "(all or nothing).");
  m.def(
      "compress_prompt_absorbed",
      [](Latent& c, int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& ckv,
         const at::Tensor& kpe, const at::Tensor& lse, c10::optional<double> scale, const kv::LseOptions& opts) {
        return with(c, [&](auto& x) {
          return kv::compress_prompt_absorbed(x, layer, q_absorbed, q_pe, ckv, kpe, lse, scale, opts);
        });
      },
      py::arg("cache"), py::arg("layer"), py::arg("q_absorbed"), py::arg("q_pe"), py::arg("ckv"), py::arg("kpe"),
      py::arg("lse"), py::arg("scale") = py::none(), py::arg("opts") = kv::LseOptions(),
      "compress_prompt() for the latent layout.");
  m.def(
      "prefill_chunked",
      [](Expanded& c, int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t chunk,
         c10::optional<double> scale, bool return_output) -> c10::optional<at::Tensor> {
        at::Tensor out;
        with(c, [&](auto& x) { kv::prefill_chunked(x, layer, q, k, v, chunk, scale, return_output ? &out : nullptr); });
        if (return_output) return out;
        return c10::nullopt;
      },
      py::arg("cache"), py::arg("layer"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("chunk"),
      py::arg("scale") = py::none(), py::kw_only(), py::arg("return_output") = false,
      "Chunked prefill: update, attend (observing) and evict per chunk of `chunk` tokens, so the layer never holds "
      "much more than capacity + chunk tokens. q, k [B, H, T, qk_dim], v [B, H, T, v_dim]. Returns the attention "
      "output [B, H, T, v_dim] with return_output, else None. Raises on a bad chunk, scale or shape (before the "
      "first chunk).");
  m.def(
      "prefill_chunked_absorbed",
      [](Latent& c, int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, const at::Tensor& ckv,
         const at::Tensor& kpe, int64_t chunk, c10::optional<double> scale, bool return_output) -> c10::optional<at::Tensor> {
        at::Tensor out;
        with(c, [&](auto& x) {
          kv::prefill_chunked_absorbed(x, layer, q_absorbed, q_pe, ckv, kpe, chunk, scale, return_output ? &out : nullptr);
        });
        if (return_output) return out;
        return c10::nullopt;
      },
      py::arg("cache"), py::arg("layer"), py::arg("q_absorbed"), py::arg("q_pe"), py::arg("ckv"), py::arg("kpe"),
      py::arg("chunk"), py::arg("scale") = py::none(), py::kw_only(), py::arg("return_output") = false,
      "prefill_chunked() for the latent layout; the output is the latent [B, H, T, kv_lora_rank].");
}

// ---- selection, moves, memory model -------------------------------------------------------------------
void def_tools(py::module_& m) {
  py::class_<PyLayerSave>(m, "LayerSave",
                          "One layer of a cache or policy, copied by save_layer() for restore_layer() (used once).")
      .def_property_readonly("layer", [](const PyLayerSave& s) { return s.layer(); },
                             "The layer it was saved from; -1 once restored.")
      .def("__repr__", [](const PyLayerSave& s) { return "LayerSave(layer=" + std::to_string(s.layer()) + ")"; });
  py::class_<kv::CacheStats>(m, "CacheStats", "Counters of one layer or, summed, of a whole cache.")
      .def_readonly("eviction_events", &kv::CacheStats::eviction_events)
      .def_readonly("tokens_evicted", &kv::CacheStats::tokens_evicted)
      .def_readonly("bytes_allocated", &kv::CacheStats::bytes_allocated)
      .def_readonly("tier_tokens", &kv::CacheStats::tier_tokens)
      .def_readonly("tier_bytes", &kv::CacheStats::tier_bytes)
      .def_readonly("tier_device_bytes", &kv::CacheStats::tier_device_bytes)
      .def_readonly("tier_recalled", &kv::CacheStats::tier_recalled)
      .def("__repr__", [](const kv::CacheStats& c) {
        std::ostringstream s;
        s << "CacheStats(eviction_events=" << c.eviction_events << ", tokens_evicted=" << c.tokens_evicted
          << ", bytes_allocated=" << c.bytes_allocated;
        if (c.tier_tokens || c.tier_bytes || c.tier_device_bytes || c.tier_recalled) {
          s << ", tier_tokens=" << c.tier_tokens << ", tier_bytes=" << c.tier_bytes
            << ", tier_device_bytes=" << c.tier_device_bytes << ", tier_recalled=" << c.tier_recalled;
        }
        s << ")";
        return s.str();
      });

  py::class_<kv::SlotMoves>(m, "SlotMoves",
                            "The row moves of one pass on one layer: slot dst[b, j] receives slot src[b, j] (all reads "
                            "before any write), the same for every buffer of the layer.")
      .def(py::init([](const at::Tensor& src, const at::Tensor& dst, int64_t slot_bound) {
             return kv::SlotMoves{src, dst, slot_bound};
           }),
           py::arg("src"), py::arg("dst"), py::arg("slot_bound") = 0)
      .def_readonly("src", &kv::SlotMoves::src, "[B, n] int64 source slots")
      .def_readonly("dst", &kv::SlotMoves::dst, "[B, n] int64 destination slots")
      .def_readonly("slot_bound", &kv::SlotMoves::slot_bound, "every slot named is below this (0: unknown)")
      .def("size", &kv::SlotMoves::size, "Columns per row (n); 0 when nothing moves.")
      .def("empty", &kv::SlotMoves::empty, "True when nothing moves.")
      .def("__len__", &kv::SlotMoves::size)
      .def("__repr__", [](const kv::SlotMoves& mv) {
        std::ostringstream s;
        s << "SlotMoves(rows=" << (mv.src.defined() && mv.src.dim() > 0 ? mv.src.size(0) : 0) << ", moves_per_row="
          << mv.size() << ", slot_bound=" << mv.slot_bound << ")";
        return s.str();
      });

  m.def("apply_moves", &kv::apply_moves, py::arg("moves"), py::arg("buffer"), py::arg("token_dim"),
        "Applies `moves` to one caller-owned buffer [B, ..., slots, ...] in place (bit-exact row copies; memcpy on "
        "a contiguous CPU buffer, no allocation). Raises if the buffer's batch, device or token_dim do not fit; "
        "nothing is moved then.");
  m.def("write_rows", &kv::write_rows, py::arg("buffer"), py::arg("token_dim"), py::arg("rows"),
        py::arg("slot_mapping"),
        "Writes the new rows [B, ..., T, ...] of an append into `buffer` in place, where the slot mapping [B, T] "
        "int64 of EvictionPolicy.append() says (-1: a pad, not written; on the buffer's device or the CPU), as "
        "vLLM's reshape_and_cache. Raises on a shape, dtype or device mismatch, or (a CPU mapping) a slot "
        "outside [-1, slots - 1); nothing is written then. A contiguous CPU buffer is written with memcpy.");

  py::class_<kv::Selection>(m, "Selection",
                            "The stateless selection of the contract: per row keep every sink, the recent window and "
                            "the `budget` highest-scored other tokens; lower score evicted first, ties evict the older "
                            "position, non-finite scores lowest.")
      .def(py::init<kv::EvictionOptions>(), py::arg("options") = kv::EvictionOptions())
      .def_property_readonly("options", &kv::Selection::options)
      .def("capacity", &kv::Selection::capacity, "n_sink + budget + n_recent tokens per row.")
      .def("keep_indices", &kv::Selection::keep_indices, py::arg("scores"),
           "Prefill compression: scores [B, S] (any floating dtype and device) of positions 0..S-1 -> [B, min(S, "
           "capacity)] int64 positions to keep, ascending per row.")
      .def("evict_slots", &kv::Selection::evict_slots, py::arg("scores"), py::arg("positions"),
           "One pass with tensor ops: scores [B, S], positions [B, S] int64 (slot order, distinct) -> [B, S - "
           "capacity] int64 slots to evict, ascending per row.")
      .def("__repr__", [](const kv::Selection& sel) {
        const auto& o = sel.options();
        std::ostringstream s;
        s << "Selection(budget=" << o.budget() << ", n_sink=" << o.n_sink() << ", n_recent=" << o.n_recent() << ")";
        return s.str();
      });

  py::enum_<kv::Layout>(m, "Layout",
                        "The two ways an MLA cache can be stored, for the memory model: EXPANDED (MlaCache: keys and "
                        "values per head) or LATENT (MlaLatentCache: ckv and kpe shared by the heads). kExpanded and "
                        "kLatent are the C++ names, kept as aliases.")
      .value("EXPANDED", kv::Layout::kExpanded, "Keys [H, qk_dim] and values [H, v_dim] per token (MlaCache).")
      .value("LATENT", kv::Layout::kLatent, "ckv [kv_lora_rank] and kpe [qk_rope_dim] per token (MlaLatentCache).")
      .value("kExpanded", kv::Layout::kExpanded, "Alias of EXPANDED (the C++ name).")
      .value("kLatent", kv::Layout::kLatent, "Alias of LATENT (the C++ name).");
  py::class_<kv::MlaMemoryConfig>(m, "MlaMemoryConfig",
                                  "The dimensions that size an MLA cache; defaults: DeepSeek-V3 at 2 bytes per element.")
      .def(py::init([](int64_t layers, int64_t heads, int64_t qk, int64_t v, int64_t rank, int64_t rope, int64_t bytes) {
             kv::MlaMemoryConfig c;
             c.num_layers = layers;
             c.num_heads = heads;
             c.qk_dim = qk;
             c.v_dim = v;
             c.kv_lora_rank = rank;
             c.qk_rope_dim = rope;
             c.bytes_per_element = bytes;
             return c;
           }),
           py::kw_only(), py::arg("num_layers") = 61, py::arg("num_heads") = 128, py::arg("qk_dim") = 192,
           py::arg("v_dim") = 128, py::arg("kv_lora_rank") = 512, py::arg("qk_rope_dim") = 64,
           py::arg("bytes_per_element") = 2)
      .def_readwrite("num_layers", &kv::MlaMemoryConfig::num_layers)
      .def_readwrite("num_heads", &kv::MlaMemoryConfig::num_heads)
      .def_readwrite("qk_dim", &kv::MlaMemoryConfig::qk_dim)
      .def_readwrite("v_dim", &kv::MlaMemoryConfig::v_dim)
      .def_readwrite("kv_lora_rank", &kv::MlaMemoryConfig::kv_lora_rank)
      .def_readwrite("qk_rope_dim", &kv::MlaMemoryConfig::qk_rope_dim)
      .def_readwrite("bytes_per_element", &kv::MlaMemoryConfig::bytes_per_element)
      .def("__repr__", [](const kv::MlaMemoryConfig& c) {
        std::ostringstream s;
        s << "MlaMemoryConfig(num_layers=" << c.num_layers << ", num_heads=" << c.num_heads << ", qk_dim=" << c.qk_dim
          << ", v_dim=" << c.v_dim << ", kv_lora_rank=" << c.kv_lora_rank << ", qk_rope_dim=" << c.qk_rope_dim
          << ", bytes_per_element=" << c.bytes_per_element << ")";
        return s.str();
      });
  m.def("bytes_per_token_per_layer", &kv::bytes_per_token_per_layer, py::arg("config"), py::arg("layout"),
        "Bytes one token takes in one layer (K/V data only). Raises ValueError on a dimension < 1 or an overflow.");
  m.def("bytes_per_token", &kv::bytes_per_token, py::arg("config"), py::arg("layout"),
        "Bytes one token takes across all layers.");
  m.def("full_cache_bytes", &kv::full_cache_bytes, py::arg("config"), py::arg("layout"), py::arg("seq_len"),
        "Bytes a full cache of seq_len tokens takes for one sequence, all layers.");
  m.def("capped_cache_bytes", &kv::capped_cache_bytes, py::arg("config"), py::arg("layout"), py::arg("seq_len"),
        py::arg("capacity"), "Bytes a cache capped at `capacity` tokens takes after seq_len tokens.");
  m.def("tier_bytes", &kv::tier_bytes, py::arg("config"), py::arg("layout"), py::arg("seq_len"), py::arg("capacity"),
        py::arg("tier_tokens"), py::arg("state_width") = 1, py::arg("page_size") = 16,
        "Host bytes the host tier holds for one sequence, all layers, after seq_len tokens with device capacity "
        "`capacity` and at most `tier_tokens` per layer: the tokens' rows, 12 + 4 x state_width bytes of bookkeeping "
        "each, and the page digests (an fp32 min and max per key channel per page of page_size positions). "
        "Raises ValueError on a bad argument or an overflow.");
  m.def("kernels_available",
        [](const DeviceArg& device) { return kv::kernels_available(device_of(device, "kernels_available").type()); },
        py::arg("device") = DeviceArg{std::nullopt, "cpu"},
        "Whether the tier's compiled kernels (PyTorch custom ops torch.ops.kvevict.*) are registered for `device` "
        "('cpu', 'cuda' or a torch.device): this extension always has the CPU ones. They serve the tensor path (CUDA "
        "caches); where they are not registered it runs the ATen reference forms, with the same results and more "
        "calls. Raises ValueError on a device name torch does not know.");
  m.def("set_kernels_enabled", &kv::set_kernels_enabled, py::arg("enabled"),
        "Switches the tier's compiled kernels on (the default) or off for the whole process (off: the ATen reference "
        "forms run; for comparisons).");
  m.def("kernels_enabled", &kv::kernels_enabled, "Whether the tier's compiled kernels are switched on.");
}

}  // namespace kvevict_python
