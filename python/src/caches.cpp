// kvevict from Python: the caller-owned-storage policy and the caches (python/src/bindings.hpp).
#include "bindings.hpp"

namespace kvevict_python {

// ---- the caller-owned-storage policy ----------------------------------------------------------------
void def_policy(py::module_& m) {
  py::class_<Policy> c(m, "EvictionPolicy",
                       "The eviction state of a cache, for storage the caller owns (C++ kvevict::EvictionPolicy<Scorer>).\n"
                       "Per layer and batch row it keeps each live token's position, slot and scorer state. append() "
                       "gives the\nslot mapping of new tokens (write them with write_rows()), observe()/add_scores() "
                       "feed the scorer, and\nevict() plans a pass as SlotMoves that apply_moves() carries out on any "
                       "buffer ([B, H, S, D], [B, S, H, D],\nlatent [B, S, W], ...). Not thread-safe.");
  c.def(py::init([](const kv::EvictionPolicyOptions& o, const kv::EvictionOptions& e, const Scorer& s) {
         return std::make_unique<Policy>(Policy{build<PolicyOf>(s, o, e)});
       }),
       py::arg("options"), py::arg("eviction") = kv::EvictionOptions(), py::arg("scorer") = Scorer(),
       "Builds empty state for every layer and row (capacity + evict_every slots per row). Raises ValueError "
       "naming a bad option.")
      .def_property_readonly("host_path", [](Policy& s) { return with(s, [](auto& x) { return x.host_path(); }); },
                             "True when the state lives in host loops (CPU); False for the tensor-op path (CUDA).")
      .def(
          "appended",
          [](Policy& s, int64_t layer, int64_t row) { return with(s, [&](auto& x) { return x.appended(layer, row); }); },
          py::arg("layer"), py::arg("row"), "Tokens `row` appended to `layer` in its latest append.")
      .def(
          "base_slots", [](Policy& s, int64_t layer) { return with(s, [&](auto& x) { return x.base_slots(layer); }); },
          py::arg("layer"),
          "The slots per row `layer` returns to after a pass or reset(): max(capacity + evict_every, reserved) + "
          "1, the trash slot.")
      .def(
          "dense",
          [](Policy& s, int64_t layer, int64_t Q) { return with(s, [&](auto& x) { return x.dense(layer, Q); }); },
          py::arg("layer"), py::arg("Q"),
          "True when Q query columns have no pad and every row is active and as long as the longest.")
      .def(
          "stats", [](Policy& s, int64_t layer) { return with(s, [&](auto& x) { return x.stats(layer); }); },
          py::arg("layer"), "CacheStats of `layer` (bytes: the eviction state only).")
      .def(
          "append",
          [](Policy& s, int64_t layer, std::vector<int64_t> counts, int64_t T) {
            return with(s, [&](auto& x) { return x.append(layer, counts, T); });
          },
          py::arg("layer"), py::arg("counts"), py::arg("T"),
          "Appends counts[b] tokens to row b of `layer` (row b's tokens are its last counts[b] of T columns). "
          "Returns the [B, T] int64 slot mapping on the policy's device: the slot of each new token, -1 for a "
          "pad (slots < slots(layer) - 1); write the rows with write_rows(). Raises RuntimeError / ValueError on a bad count or T, or if a row would "
          "exceed slots(layer) (reserve() first); nothing changes then.")
      .def(
          "evict", [](Policy& s, int64_t layer) { return with(s, [&](auto& x) { return x.evict(layer); }); },
          py::arg("layer"),
          "Runs a pass on `layer` if due(); returns the SlotMoves to apply to every buffer of the layer (empty if "
          "no pass ran). Raises IndexError.")
      .def(
          "truncate",
          [](Policy& s, int64_t row, int64_t k) { return with(s, [&](auto& x) { return x.truncate(row, k); }); },
          py::arg("row"), py::arg("k"),
          "Rolls back the k newest tokens of `row` in every layer. Returns one SlotMoves per layer, to apply to "
          "that layer's buffers (apply_moves). Raises and changes nothing if a dropped token was evicted.");
  c.def("__repr__", [](Policy& s) {
    return with(s, [](auto& x) {
      std::vector<int64_t> caps;
      for (int64_t l = 0; l < x.num_layers(); ++l) caps.push_back(x.capacity(l));
      const bool same = std::all_of(caps.begin(), caps.end(), [&](int64_t v) { return v == caps.front(); });
      std::ostringstream o;
      o << "EvictionPolicy(layers=" << x.num_layers() << ", batch=" << x.batch_size() << ", heads=" << x.num_heads()
        << ", capacity=" << (same && !caps.empty() ? std::to_string(caps.front()) : ints_repr(caps))
        << ", device=" << x.device().str() << ", scorer=" << repr_of(py::cast(Scorer(x.scorer()))) << ")";
      return o.str();
    });
  });
  def_state_common(c);
  def_save_restore(c, "its eviction state; your buffers are yours to copy");
}

// ---- caches -------------------------------------------------------------------------------------------
void def_caches(py::module_& m) {
  py::class_<kv::OrderedLayer>(m, "OrderedLayer", "A layer's live tokens sorted by position (copies).")
      .def_readonly("keys", &kv::OrderedLayer::keys, "[B, H, S, qk_dim]")
      .def_readonly("values", &kv::OrderedLayer::values, "[B, H, S, v_dim]")
      .def_readonly("positions", &kv::OrderedLayer::positions, "[B, S] int64, ascending per row");
  py::class_<kv::OrderedLatentLayer>(m, "OrderedLatentLayer", "A latent layer's live tokens sorted by position (copies).")
      .def_readonly("ckv", &kv::OrderedLatentLayer::ckv, "[B, S, kv_lora_rank]")
      .def_readonly("kpe", &kv::OrderedLatentLayer::kpe, "[B, S, qk_rope_dim]")
      .def_readonly("positions", &kv::OrderedLatentLayer::positions, "[B, S] int64, ascending per row");

  py::class_<Expanded> e(m, "MlaCache",
                         "A KV cache in the expanded MLA layout (C++ kvevict::BasicMlaCache<EvictionPolicy<Scorer>>): "
                         "per layer keys [B, H, slots, qk_dim] (RoPE applied) and values [B, H, slots, v_dim], kept at "
                         "capacity() tokens per row. Live tokens fill slots [0, size); slot order is not position "
                         "order (positions(), ordered()). Not thread-safe.");
  e.def(py::init([](const kv::MlaCacheOptions& o, const kv::EvictionOptions& ev, const Scorer& s) {
          return std::make_unique<Expanded>(Expanded{build<ExpandedOf>(s, o, ev)});
        }),
        py::arg("options"), py::arg("eviction") = kv::EvictionOptions(), py::arg("scorer") = Scorer(),
        "Allocates capacity + evict_every slots per row for every layer. Raises ValueError naming a bad option.")
      .def_property_readonly("options",
                             [](Expanded& s) { return with(s, [](auto& x) { return x.options(); }); })
      .def(
          "update",
          [](Expanded& s, int64_t layer, const at::Tensor& k, const at::Tensor& v,
             c10::optional<std::vector<int64_t>> counts) {
            return with(s, [&](auto& x) {
              return counts ? x.update(layer, k, v, *counts) : x.update(layer, k, v);
            });
          },
          py::arg("layer"), py::arg("k_new"), py::arg("v_new"), py::arg("counts") = py::none(),
          "Appends T new tokens: k_new [B, H, T, qk_dim] (RoPE applied), v_new [B, H, T, v_dim], the cache's "
          "dtype and device, at positions seen_tokens .. + T - 1 with score 0. counts (B ints in [0, T]): a ragged "
          "chunk, row b appends its last counts[b] columns (left padding; free rows 0). Returns (keys, values): "
          "views [B, H, S, .] over slots [0, S) of the cache's own buffers (no copy), invalidated by the next "
          "update() or evict(). Copies T rows per head; grows the buffers only when an append exceeds the slots. "
          "Raises IndexError / TypeError / RuntimeError on a bad layer, shape, dtype or device, and RuntimeError "
          "when every row is free (finish()ed: add_sequence() first); the cache is unchanged then.")
      .def(
          "keys", [](Expanded& s, int64_t layer) { return with(s, [&](auto& x) { return x.keys(layer); }); },
          py::arg("layer"), "[B, H, S, qk_dim] live keys: a view of the buffer, slot order.")
      .def(
          "values", [](Expanded& s, int64_t layer) { return with(s, [&](auto& x) { return x.values(layer); }); },
          py::arg("layer"), "[B, H, S, v_dim] live values: a view of the buffer, slot order.")
      .def(
          "ordered", [](Expanded& s, int64_t layer) { return with(s, [&](auto& x) { return x.ordered(layer); }); },
          py::arg("layer"), "Copies of the live keys, values and positions sorted by position per row.")
      .def(
          "recall",
          [](Expanded& s, int64_t layer, const at::Tensor& query, double scale, int64_t tokens, int64_t rescore) {
            return with(s, [&](auto& x) { return x.recall(layer, query, scale, tokens, rescore); });
          },
          py::arg("layer"), py::arg("query"), py::arg("scale"), py::arg("tokens"), py::arg("rescore") = 0,
          "Brings tokens back from the host tier (C++ BasicMlaCache::recall; ArkVale with Quest's page digests): "
          "query [B, H, Q, qk_dim] this step's queries; the best tier pages, at most `tokens` tokens per row in whole "
          "pages, take the slots of the lowest-ranked heavy hitters. rescore > tokens (at least tier_page_size): "
          "two-level, the best pages up to `rescore` tokens are scored again token by token with their exact keys "
          "and the best `tokens` of them come back. Call after update() and before attend(). "
          "Returns the tokens recalled per row, a [B] int64 tensor on the cache's device (not read: on CUDA no sync). "
          "Raises IndexError for a bad layer; RuntimeError without a tier, with an open "
          "observation or on a bad query shape or device (as every shape error); TypeError for a query that is not "
          "floating (other floating dtypes are converted to fp32); ValueError for a bad scale, "
          "tokens or rescore or a non-finite query; nothing changes then.");
  e.def("__repr__", [](Expanded& s) {
    return with(s, [](auto& x) {
      const auto& o = x.options();
      return cache_repr("MlaCache", x, ", qk_dim=" + std::to_string(o.qk_dim()) + ", v_dim=" + std::to_string(o.v_dim()));
    });
  });
  def_cache_common(e);

  py::class_<Latent> l(m, "MlaLatentCache",
                       "A KV cache in the latent MLA layout (DeepSeek-V2 Sec. 2.1.2; C++ "
                       "kvevict::BasicMlaLatentCache<EvictionPolicy<Scorer>>): per layer ckv [B, slots, kv_lora_rank] "
                       "and kpe [B, slots, qk_rope_dim], shared by all heads. Same contract as MlaCache; attention "
                       "through attend_absorbed(). Not thread-safe.");
  l.def(py::init([](const kv::MlaLatentCacheOptions& o, const kv::EvictionOptions& ev, const Scorer& s) {
          return std::make_unique<Latent>(Latent{build<LatentOf>(s, o, ev)});
        }),
        py::arg("options"), py::arg("eviction") = kv::EvictionOptions(), py::arg("scorer") = Scorer(),
        "Allocates capacity + evict_every slots per row for every layer. Raises ValueError naming a bad option.")
      .def_property_readonly("options", [](Latent& s) { return with(s, [](auto& x) { return x.options(); }); })
      .def(
          "update",
          [](Latent& s, int64_t layer, const at::Tensor& ckv, const at::Tensor& kpe,
             c10::optional<std::vector<int64_t>> counts) {
            return with(s, [&](auto& x) {
              return counts ? x.update(layer, ckv, kpe, *counts) : x.update(layer, ckv, kpe);
            });
          },
          py::arg("layer"), py::arg("ckv_new"), py::arg("kpe_new"), py::arg("counts") = py::none(),
          "Appends T new tokens: ckv_new [B, T, kv_lora_rank] (after kv_a_layernorm), kpe_new [B, T, qk_rope_dim] "
          "(RoPE applied); counts as MlaCache.update(). Returns (ckv, kpe): views [B, S, .] of the cache's "
          "buffers. Raises as MlaCache.update().")
      .def(
          "ckv", [](Latent& s, int64_t layer) { return with(s, [&](auto& x) { return x.ckv(layer); }); },
          py::arg("layer"), "[B, S, kv_lora_rank] live compressed KV: a view of the buffer, slot order.")
      .def(
          "kpe", [](Latent& s, int64_t layer) { return with(s, [&](auto& x) { return x.kpe(layer); }); },
          py::arg("layer"), "[B, S, qk_rope_dim] live RoPE keys: a view of the buffer, slot order.")
      .def(
          "ordered", [](Latent& s, int64_t layer) { return with(s, [&](auto& x) { return x.ordered(layer); }); },
          py::arg("layer"), "Copies of the live ckv, kpe and positions sorted by position per row.")
      .def(
          "recall_absorbed",
          [](Latent& s, int64_t layer, const at::Tensor& q_absorbed, const at::Tensor& q_pe, double scale,
             int64_t tokens, int64_t rescore) {
            return with(s, [&](auto& x) { return x.recall_absorbed(layer, q_absorbed, q_pe, scale, tokens, rescore); });
          },
          py::arg("layer"), py::arg("q_absorbed"), py::arg("q_pe"), py::arg("scale"), py::arg("tokens"),
          py::arg("rescore") = 0,
          "MlaCache.recall() for the latent layout, with the absorbed queries attend_absorbed() takes: q_absorbed "
          "[B, H, Q, kv_lora_rank], q_pe [B, H, Q, qk_rope_dim]. Returns the tokens recalled per row ([B] int64, "
          "cache device). Raises as "
          "MlaCache.recall().");
  l.def("__repr__", [](Latent& s) {
    return with(s, [](auto& x) {
      const auto& o = x.options();
      return cache_repr("MlaLatentCache", x, ", kv_lora_rank=" + std::to_string(o.kv_lora_rank()) +
                                                 ", qk_rope_dim=" + std::to_string(o.qk_rope_dim()));
    });
  });
  def_cache_common(l);
}

}  // namespace kvevict_python
