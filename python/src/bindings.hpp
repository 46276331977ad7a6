#pragma once
// What the extension's translation units share (python/src/*.cpp): the type casters of torch.dtype,
// devices and scorers, the scorer-selected instantiations, repr() helpers and the members every
// policy and cache class binds. The module is split over a few translation units so that a
// parallel build (pip builds with Ninja) compiles them side by side.

#include <kvevict/kvevict.hpp>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/extension.h>

#include <pybind11/stl.h>
#include <pybind11/typing.h>
#include <torch/version.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace py = pybind11;
namespace kv = kvevict;

/// The scorer argument: one of the scorer classes, which picks the C++ instantiation.
using ScorerVariant =
    std::variant<kv::CumulativeAttention, kv::MeanObservedAttention, kv::LatestAttention, kv::DecayedAttention, kv::SnapKV>;

/// A device argument as Python passes it: a torch.device or a str ("cpu", "cuda:0"), resolved by
/// device_of() (which names the argument's owner when the str is not a device).
struct DeviceArg {
  std::optional<at::Device> device;  // a torch.device
  std::string name;                  // else the str
};

/// The scorer names kvevict.SCORERS (python/kvevict/config.py) gives the installers, with the
/// same default parameters: a raw cache takes them too (test_python_face.py checks both tables).
inline const std::vector<std::pair<const char*, int>>& scorer_names() {
  static const std::vector<std::pair<const char*, int>> names = {
      {"h2o", 0}, {"cumulative", 0}, {"mean", 1}, {"tova", 2}, {"latest", 2}, {"decay", 3}, {"snapkv", 4}};
  return names;
}

// ---- torch.dtype <-> at::ScalarType (torch >= 2.4 has its own, in torch/csrc/utils/pybind.h) -----
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4)
namespace pybind11::detail {
template <>
struct type_caster<at::ScalarType> {
  PYBIND11_TYPE_CASTER(at::ScalarType, _("torch.dtype"));
  bool load(handle src, bool) {
    if (!THPDtype_Check(src.ptr())) return false;
    value = reinterpret_cast<THPDtype*>(src.ptr())->scalar_type;
    return true;
  }
  static handle cast(at::ScalarType src, return_value_policy, handle) {
    return handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(src))).inc_ref();
  }
};
}  // namespace pybind11::detail
#endif

namespace pybind11::detail {
/// torch.device | str: anything else does not load (kvevict's TypeError then names it).
template <>
struct type_caster<DeviceArg> {
  PYBIND11_TYPE_CASTER(DeviceArg, const_name("torch.device | str"));
  bool load(handle src, bool) {
    if (PyUnicode_Check(src.ptr())) {
      value = DeviceArg{std::nullopt, src.cast<std::string>()};
      return true;
    }
    make_caster<at::Device> device;
    if (!device.load(src, false)) return false;
    value = DeviceArg{cast_op<at::Device>(device), {}};
    return true;
  }
  static handle cast(const DeviceArg& src, return_value_policy policy, handle parent) {
    if (src.device) return make_caster<at::Device>::cast(*src.device, policy, parent);
    return str(src.name).release();
  }
};

/// A scorer object, or one of the installers' names ("h2o", "tova", ...; case-insensitive, default
/// parameters). An unknown name is a ValueError listing the names.
template <>
struct type_caster<ScorerVariant> {
  PYBIND11_TYPE_CASTER(ScorerVariant, make_caster<kv::CumulativeAttention>::name + const_name(" | ") +
                                          make_caster<kv::MeanObservedAttention>::name + const_name(" | ") +
                                          make_caster<kv::LatestAttention>::name + const_name(" | ") +
                                          make_caster<kv::DecayedAttention>::name + const_name(" | ") +
                                          make_caster<kv::SnapKV>::name + const_name(" | str"));
  bool load(handle src, bool) {
    if (PyUnicode_Check(src.ptr())) {
      std::string name = src.cast<std::string>();
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
      for (const auto& [n, i] : scorer_names()) {
        if (name != n) continue;
        switch (i) {
          case 0: value = kv::CumulativeAttention(); break;
          case 1: value = kv::MeanObservedAttention(); break;
          case 2: value = kv::LatestAttention(); break;
          case 3: value = kv::DecayedAttention(); break;
          default: value = kv::SnapKV(); break;
        }
        return true;
      }
      std::string known;
      for (const auto& [n, i] : scorer_names()) known += std::string(known.empty() ? "'" : ", '") + n + "'";
      throw value_error("kvevict: scorer must be a scorer object or one of the names " + known + ", got '" +
                        src.cast<std::string>() + "'");
    }
    return try_load<kv::CumulativeAttention>(src) || try_load<kv::MeanObservedAttention>(src) ||
           try_load<kv::LatestAttention>(src) || try_load<kv::DecayedAttention>(src) || try_load<kv::SnapKV>(src);
  }
  static handle cast(const ScorerVariant& src, return_value_policy, handle parent) {
    return std::visit(
        [&](const auto& s) { return make_caster<std::decay_t<decltype(s)>>::cast(s, return_value_policy::copy, parent); },
        src);
  }

 private:
  template <class S>
  bool try_load(handle src) {
    make_caster<S> c;
    if (!isinstance<S>(src) || !c.load(src, false)) return false;
    value = cast_op<S&>(c);
    return true;
  }
};
}  // namespace pybind11::detail

namespace kvevict_python {


// ---- scorers and the instantiations they select ----------------------------------------------------
using Scorer = ScorerVariant;

template <template <class> class Of>
using PerScorer = std::variant<Of<kv::CumulativeAttention>, Of<kv::MeanObservedAttention>, Of<kv::LatestAttention>,
                               Of<kv::DecayedAttention>, Of<kv::SnapKV>>;

template <class S>
using PolicyOf = kv::EvictionPolicy<S>;
template <class S>
using ExpandedOf = kv::BasicMlaCache<kv::EvictionPolicy<S>>;
template <class S>
using LatentOf = kv::BasicMlaLatentCache<kv::EvictionPolicy<S>>;
template <class S>
using ExpandedRingOf = kv::LseRing<ExpandedOf<S>>;
template <class S>
using LatentRingOf = kv::LseRing<LatentOf<S>>;

/// The Python objects: one C++ instantiation per scorer behind one Python type.
struct Policy {
  PerScorer<PolicyOf> v;
};
struct Expanded {
  PerScorer<ExpandedOf> v;
};
struct Latent {
  PerScorer<LatentOf> v;
};
struct Ring {
  std::variant<PerScorer<ExpandedRingOf>, PerScorer<LatentRingOf>> v;
};

template <template <class> class Of, class... Args>
PerScorer<Of> build(const Scorer& scorer, const Args&... args) {
  return std::visit(
      [&](const auto& s) -> PerScorer<Of> {
        using S = std::decay_t<decltype(s)>;
        return PerScorer<Of>(std::in_place_type<Of<S>>, args..., s);
      },
      scorer);
}

template <class T, class F>
decltype(auto) with(T& self, F&& f) {
  return std::visit(std::forward<F>(f), self.v);
}

/// A LayerSave of a policy or cache, its C++ type erased (save_layer() / restore_layer()).
struct PyLayerSave {
  std::shared_ptr<void> save;  // the owner's LayerSave
  const std::type_info* type = nullptr;
  std::function<int64_t()> layer;
};

/// save_layer() and restore_layer() of a policy or a cache.
template <class Py>
void def_save_restore(py::class_<Py>& c, const char* what) {
  c.def(
       "save_layer",
       [](Py& s, int64_t layer) {
         return with(s, [&](auto& x) {
           using S = typename std::decay_t<decltype(x)>::LayerSave;
           auto p = std::make_shared<S>(x.save_layer(layer));
           return PyLayerSave{p, &typeid(S), [p] { return p->layer(); }};
         });
       },
       py::arg("layer"),
       (std::string("A copy of `layer` (") + what +
        ") for restore_layer(): speculative decoding that must undo everything the drafts did to a layer "
        "(their tokens, the scores their queries added, the passes and recalls they caused). Allocates the copy; "
        "changes nothing. Raises IndexError / RuntimeError (an open observation).")
           .c_str())
      .def(
          "restore_layer",
          [](Py& s, int64_t layer, PyLayerSave& save) {
            with(s, [&](auto& x) {
              using S = typename std::decay_t<decltype(x)>::LayerSave;
              KVEVICT_CHECK_TYPE(save.type && *save.type == typeid(S), "restore_layer: the save was made by another "
                                 "kind of cache or policy, or with another scorer");
              x.restore_layer(layer, std::move(*static_cast<S*>(save.save.get())));
            });
          },
          py::arg("layer"), py::arg("save"),
          "Makes `layer` as it was when `save` (from save_layer(layer)) was made; the save is used up. Allocates "
          "nothing. Raises IndexError / TypeError / RuntimeError (another layer's save, one used already, one of "
          "another cache's shapes, reset/finish/add_sequence/truncate or a reserve() since); nothing changes then.");
}

template <class P>
Scorer scorer_of(const P& p) {
  return Scorer(p.scorer());
}

/// The device a device argument of `where` names. Raises ValueError naming `where` and what it
/// takes when a str is not a device torch knows (torch's own message lists every backend).
inline at::Device device_of(const DeviceArg& d, const char* where) {
  if (d.device) return *d.device;
  try {
    return at::Device(d.name);
  } catch (const c10::Error&) {
    throw py::value_error(std::string("kvevict: ") + where + ": device must be a torch.device or a device name such "
                          "as 'cpu', 'cuda' or 'cuda:0', got '" + d.name + "'");
  }
}

/// The Python name of a cache options struct (for error messages).
template <class O>
const char* options_name() {
  if constexpr (std::is_same_v<O, kv::MlaCacheOptions>) {
    return "MlaCacheOptions";
  } else {
    return "MlaLatentCacheOptions";
  }
}

// ---- repr() ---------------------------------------------------------------------------------------
/// The shortest decimal that reads back as the same float (0.9f -> "0.9").
inline std::string short_float(float v) {
  for (int digits = 1; digits < 10; ++digits) {
    std::ostringstream s;
    s << std::setprecision(digits) << v;
    if (std::strtof(s.str().c_str(), nullptr) == v) return s.str();
  }
  return std::to_string(v);
}
inline std::string repr_of(const py::handle& h) { return py::repr(h).cast<std::string>(); }
inline std::string dtype_repr(at::ScalarType t) { return repr_of(py::cast(t)); }  // torch.float32
inline std::string ints_repr(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

/// What the options of a policy or cache set beyond their shape, only where not the default.
template <class O>
inline std::string options_tail(const O& o) {
  std::ostringstream s;
  if (o.check_observations()) s << ", check_observations=" << (*o.check_observations() ? "True" : "False");
  if (!o.layer_budgets().empty()) s << ", layer_budgets=" << ints_repr(o.layer_budgets());
  if (o.total_heads() != 0) s << ", total_heads=" << o.total_heads();
  if (o.lazy_reduction()) s << ", lazy_reduction=True";
  if (o.reduce_contributions()) s << ", reduce_contributions=<set>";
  return s.str();
}
template <class O>
inline std::string cache_options_repr(const O& o, const std::string& dims) {
  std::ostringstream s;
  s << options_name<O>() << "(num_layers=" << o.num_layers() << ", num_heads=" << o.num_heads() << dims
    << ", batch_size=" << o.batch_size() << ", dtype=" << dtype_repr(o.dtype()) << ", device='" << o.device().str()
    << "'" << options_tail(o) << ", tier_tokens=" << o.tier_tokens();
  if (o.tier_tokens() > 0) {
    s << ", tier_page_size=" << o.tier_page_size() << ", tier_scoring=TierScoring."
      << (o.tier_scoring() == kv::TierScoring::kHeadMean ? "HEAD_MEAN" : "PER_HEAD");
  }
  s << ")";
  return s.str();
}

/// A cache: its shape, capacity per layer (one number when every layer has the same), dtype,
/// device, scorer and tier.
template <class C>
inline std::string cache_repr(const char* type, const C& c, const std::string& dims) {
  std::vector<int64_t> caps;
  for (int64_t l = 0; l < c.num_layers(); ++l) caps.push_back(c.capacity(l));
  const bool same = std::all_of(caps.begin(), caps.end(), [&](int64_t x) { return x == caps.front(); });
  std::ostringstream s;
  s << type << "(layers=" << c.num_layers() << ", batch=" << c.batch_size() << ", heads=" << c.num_heads() << dims
    << ", capacity=" << (same && !caps.empty() ? std::to_string(caps.front()) : ints_repr(caps))
    << ", dtype=" << dtype_repr(c.dtype()) << ", device=" << c.device().str()
    << ", scorer=" << repr_of(py::cast(Scorer(c.policy().scorer()))) << ", tier_tokens=" << c.tier_tokens() << ")";
  return s.str();
}

/// The eviction state of a policy, or of a cache (read-only: a cache changes it itself, moving
/// its rows too).
template <class S>
const PolicyOf<S>& state_of(const PolicyOf<S>& p) {
  return p;
}
template <class C>
const typename C::policy_type& state_of(const C& c) {
  return c.policy();
}

/// What EvictionPolicy and both cache layouts share: sizes, state, observation, the pass and the
/// sequence lifecycle (a cache runs each through its policy and moves its rows to match).
template <class Py>
void def_state_common(py::class_<Py>& c) {
  c.def_property_readonly("num_layers", [](Py& s) { return with(s, [](auto& x) { return x.num_layers(); }); })
      .def_property_readonly("batch_size", [](Py& s) { return with(s, [](auto& x) { return x.batch_size(); }); })
      .def_property_readonly("num_heads", [](Py& s) { return with(s, [](auto& x) { return x.num_heads(); }); })
      .def_property_readonly("device", [](Py& s) { return with(s, [](auto& x) { return x.device(); }); },
                             "Device of the state (and of a cache's buffers); inputs must be on it.")
      .def_property_readonly("scorer", [](Py& s) { return with(s, [](auto& x) { return scorer_of(state_of(x)); }); },
                             "The scorer (a copy): which C++ instantiation this is.")
      .def_property_readonly("checks_observations",
                             [](Py& s) { return with(s, [](auto& x) { return state_of(x).checks_observations(); }); },
                             "Whether observe() checks its input (on by default on CPU, off on CUDA).")
      .def(
          "capacity",
          [](Py& s, c10::optional<int64_t> layer) {
            return with(s, [&](auto& x) { return layer ? x.capacity(*layer) : x.capacity(); });
          },
          py::arg("layer") = py::none(),
          "Tokens per row after a pass: n_sink + budget + n_recent (of `layer`'s budget when layer_budgets are "
          "set). Raises IndexError for a bad layer.")
      .def(
          "eviction",
          [](Py& s, c10::optional<int64_t> layer) {
            return with(s, [&](auto& x) { return layer ? state_of(x).eviction(*layer) : state_of(x).eviction(); });
          },
          py::arg("layer") = py::none(), "The EvictionOptions (of `layer`: its own budget). A copy.")
      .def(
          "size",
          [](Py& s, int64_t layer, c10::optional<int64_t> row) {
            return with(s, [&](auto& x) { return row ? x.size(layer, *row) : x.size(layer); });
          },
          py::arg("layer"), py::arg("row") = py::none(),
          "Live tokens of `row` in `layer`; without a row, the longest row: the token width S of views, "
          "positions and probabilities. Raises IndexError for a bad layer or row.")
      .def(
          "seen_tokens",
          [](Py& s, int64_t layer, c10::optional<int64_t> row) {
            return with(s, [&](auto& x) { return row ? x.seen_tokens(layer, *row) : x.seen_tokens(layer); });
          },
          py::arg("layer"), py::arg("row") = py::none(),
          "Tokens ever appended to `row` of `layer` (the position of its next token); without a row, the most "
          "of any row. Raises IndexError.")
      .def(
          "slots", [](Py& s, int64_t layer) { return with(s, [&](auto& x) { return x.slots(layer); }); },
          py::arg("layer"),
          "Slots per row of `layer` (buffers hold this many): room for slots - 1 tokens and the trash slot (the "
          "last, where the tensor path writes pads; it never holds a token). See reserve().")
      .def(
          "positions", [](Py& s, int64_t layer) { return with(s, [&](auto& x) { return x.positions(layer); }); },
          py::arg("layer"),
          "[B, S] int64 original position of each slot, slot order (not sorted), -1 past a row's length. A copy, "
          "on the device. Raises IndexError.")
      .def(
          "scores", [](Py& s, int64_t layer) { return with(s, [&](auto& x) { return x.scores(layer); }); },
          py::arg("layer"),
          "[B, S] fp32 rank of each slot (the scorer's rank of its state), 0 past a row's length. A copy. Raises "
          "IndexError; RuntimeError while lazy_reduction observations are pending (flush() first).")
      .def(
          "query_positions",
          [](Py& s, int64_t layer, int64_t Q) {
            return with(s, [&](auto& x) { return state_of(x).query_positions(layer, Q); });
          },
          py::arg("layer"), py::arg("Q"),
          "[B, Q] int64 positions of Q query columns right-aligned on the newest append, -1 for pads (left "
          "padding, free rows). On the device.")
      .def(
          "observe",
          [](Py& s, int64_t layer, const at::Tensor& probs) {
            with(s, [&](auto& x) { x.observe(layer, probs); });
          },
          py::arg("layer"), py::arg("probs"),
          "Feeds attention probabilities [B, H, Q, S] (any floating dtype, the device, slot order, queries "
          "right-aligned on the newest append; pads ignored) to the scorer, reduced exactly (fixed point, 32 "
          "fractional bits). Raises RuntimeError on a bad shape, dtype or device, or (checks on) a probability "
          "outside [0, 1], a non-causal one or a non-finite rank; nothing changes then. With checks on, the "
          "tensor path (CUDA) syncs once.")
      .def(
          "add_scores",
          [](Py& s, int64_t layer, const at::Tensor& scores) {
            with(s, [&](auto& x) { x.add_scores(layer, scores); });
          },
          py::arg("layer"), py::arg("scores"),
          "Adds caller-computed per-token scores [B, S] (any floating dtype, the device, slot order) as one "
          "observation with one observer. Raises as observe().")
      .def(
          "flush", [](Py& s, int64_t layer) { with(s, [&](auto& x) { x.flush(layer); }); }, py::arg("layer"),
          "lazy_reduction: applies the observations held back on `layer` (a no-op otherwise).")
      .def(
          "observe_begin",
          [](Py& s, int64_t layer, int64_t Q) { with(s, [&](auto& x) { x.observe_begin(layer, Q); }); },
          py::arg("layer"), py::arg("Q"),
          "Opens an observation of Q query columns that arrives in pieces (observe_add, then observe_end): the "
          "scorer gets exactly what observe() of the whole would give it.")
      .def(
          "observe_add",
          [](Py& s, int64_t layer, const at::Tensor& probs, int64_t q_begin, int64_t h_begin) {
            with(s, [&](auto& x) { x.observe_add(layer, probs, q_begin, h_begin); });
          },
          py::arg("layer"), py::arg("probs"), py::arg("q_begin"), py::arg("h_begin"),
          "Adds one piece [B, Hc, Qc, S] of the open observation: query columns [q_begin, q_begin + Qc), heads "
          "[h_begin, h_begin + Hc).")
      .def(
          "observe_end", [](Py& s, int64_t layer) { with(s, [&](auto& x) { x.observe_end(layer); }); },
          py::arg("layer"), "Applies the observation opened by observe_begin() to the scorer.")
      .def(
          "observe_discard", [](Py& s, int64_t layer) { with(s, [&](auto& x) { x.observe_discard(layer); }); },
          py::arg("layer"),
          "Discards the observation opened by observe_begin(), if any (e.g. after an error while computing its "
          "pieces): the scorer state is unchanged.")
      .def(
          "due", [](Py& s, int64_t layer) { return with(s, [&](auto& x) { return state_of(x).due(layer); }); },
          py::arg("layer"),
          "Whether evict(layer) would run a pass now: a row over capacity that appended in at least evict_every "
          "appends since its last pass.")
      .def(
          "active", [](Py& s, int64_t row) { return with(s, [&](auto& x) { return x.active(row); }); },
          py::arg("row"), "True while `row` holds a sequence (every row, until finish()). Raises IndexError.")
      .def(
          "add_sequence", [](Py& s) { return with(s, [&](auto& x) { return x.add_sequence(); }); },
          "Starts a new, empty sequence in the lowest free row and returns that row. Raises RuntimeError if "
          "every row holds one.")
      .def(
          "finish", [](Py& s, int64_t row) { with(s, [&](auto& x) { x.finish(row); }); }, py::arg("row"),
          "Ends the sequence in `row` (its tokens leave every layer); the row is free for add_sequence(). Raises "
          "IndexError for a bad row, RuntimeError if it is free.")
      .def(
          "reset",
          [](Py& s, c10::optional<int64_t> row) {
            with(s, [&](auto& x) {
              if (row) {
                x.reset(*row);
              } else {
                x.reset();
              }
            });
          },
          py::arg("row") = py::none(),
          "reset(row): empties one row for a new sequence (positions restart at 0). reset(): empties every layer "
          "and row, makes every row active and gives back slots grown by long appends.")
      .def(
          "reserve", [](Py& s, int64_t tokens) { with(s, [&](auto& x) { x.reserve(tokens); }); },
          py::arg("tokens"),
          "Makes room for `tokens` tokens per row in every layer (tokens + 1 slots: the last is the trash slot) "
          "and never shrinks below: appends that fit never move the buffers (CUDA graphs). Raises ValueError / "
          "RuntimeError; nothing changes then.");
}

/// What both cache layouts add: the pass moves the rows, rollback, summed stats.
template <class Py>
void def_cache_common(py::class_<Py>& c) {
  def_state_common(c);
  def_save_restore(c, "its rows, eviction state and host tier");
  c.def_property_readonly("dtype", [](Py& s) { return with(s, [](auto& x) { return x.dtype(); }); },
                          "Storage dtype of the cached rows.")
      .def(
          "evict", [](Py& s, int64_t layer) { return with(s, [&](auto& x) { return x.evict(layer); }); },
          py::arg("layer"),
          "Runs an eviction pass on `layer` if one is due and moves the rows it says (in place: the buffers are "
          "not copied); else a no-op. Returns the tokens evicted, summed over rows. Raises IndexError. CPU: no "
          "allocation in the steady state; CUDA: no host sync.")
      .def(
          "stats",
          [](Py& s, c10::optional<int64_t> layer) {
            return with(s, [&](auto& x) { return layer ? x.stats(*layer) : x.stats(); });
          },
          py::arg("layer") = py::none(), "CacheStats of one layer, or summed over layers.")
      .def(
          "evict_now", [](Py& s, int64_t layer) { return with(s, [&](auto& x) { return x.evict_now(layer); }); },
          py::arg("layer"), "evict() without waiting for evict_every: a pass now if a row is over capacity.")
      .def_property_readonly("tier_tokens", [](Py& s) { return with(s, [](auto& x) { return x.tier_tokens(); }); },
                             "Tokens a row keeps in its host tier per layer (0: no tier).")
      .def(
          "tier_size", [](Py& s, int64_t layer, int64_t row) { return with(s, [&](auto& x) { return x.tier_size(layer, row); }); },
          py::arg("layer"), py::arg("row"), "Tokens of `row` in the host tier of `layer`. Raises IndexError.")
      .def(
          "tier_positions",
          [](Py& s, int64_t layer, int64_t row) { return with(s, [&](auto& x) { return x.tier_positions(layer, row); }); },
          py::arg("layer"), py::arg("row"), "[n] int64 positions of the tier tokens of `row`, ascending (CPU, a copy).")
      .def(
          "tier_scores",
          [](Py& s, int64_t layer, int64_t row) { return with(s, [&](auto& x) { return x.tier_scores(layer, row); }); },
          py::arg("layer"), py::arg("row"), "[n] fp32 rank of each tier token when it was evicted, in tier_positions() order.")
      .def(
          "tier_rows",
          [](Py& s, int64_t layer, int64_t row) { return with(s, [&](auto& x) { return x.tier_rows(layer, row); }); },
          py::arg("layer"), py::arg("row"),
          "The rows of the tier tokens of `row`, in tier_positions() order, bit for bit as cached (CPU copies): "
          "(keys [H, n, qk_dim], values [H, n, v_dim]) or (ckv [n, kv_lora_rank], kpe [n, qk_rope_dim]).")
      .def(
          "truncate", [](Py& s, int64_t row, int64_t k) { with(s, [&](auto& x) { x.truncate(row, k); }); },
          py::arg("row"), py::arg("k"),
          "Rolls back the k newest tokens of `row` in every layer (rejected speculative drafts). Raises "
          "ValueError / RuntimeError if k is out of range, the row is free or a dropped token was already "
          "evicted; the cache is unchanged then. Syncs on the tensor path.");
}

// One per translation unit: bindings.cpp (options, scorers; the module), caches.cpp (the policy,
// the caches), attention.cpp (attention, LSE scoring, prefill, selection, moves, memory model).
void def_options(py::module_& m);
void def_scorers(py::module_& m);
void def_tools(py::module_& m);
void def_policy(py::module_& m);
void def_caches(py::module_& m);
void def_attention(py::module_& m);

}  // namespace kvevict_python
