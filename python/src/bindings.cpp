// kvevict from Python: the public C++ API (include/kvevict/) as the extension module
// kvevict._kvevict, one translation unit. Tensors cross as the same at::Tensor (no copy); a
// scorer is an argument (one bound class per scorer type) and picks the C++ template
// instantiation: MlaCache(opts, eviction, scorer=SnapKV(32, 5)) holds a
// BasicMlaCache<EvictionPolicy<SnapKV>>. c10 errors reach Python as the exception c10 maps them
// to (c10::ValueError -> ValueError, IndexError, TypeError, NotImplementedError; any other
// c10::Error -> RuntimeError) with kvevict's message, without the C++ backtrace.
//
// Not bound (see docs/python.md): TensorParallel (tensor_parallel.hpp: from Python, the options'
// reduce_contributions property takes a callable, e.g. over torch.distributed, with total_heads),
// custom scorers written in Python, and the cache-only protocol the caches use internally (Pass,
// plan/commit, append_index, ...).

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

namespace {

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
at::Device device_of(const DeviceArg& d, const char* where) {
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
std::string short_float(float v) {
  for (int digits = 1; digits < 10; ++digits) {
    std::ostringstream s;
    s << std::setprecision(digits) << v;
    if (std::strtof(s.str().c_str(), nullptr) == v) return s.str();
  }
  return std::to_string(v);
}
std::string repr_of(const py::handle& h) { return py::repr(h).cast<std::string>(); }
std::string dtype_repr(at::ScalarType t) { return repr_of(py::cast(t)); }  // torch.float32
std::string ints_repr(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

/// What the options of a policy or cache set beyond their shape, only where not the default.
template <class O>
std::string options_tail(const O& o) {
  std::ostringstream s;
  if (o.check_observations()) s << ", check_observations=" << (*o.check_observations() ? "True" : "False");
  if (!o.layer_budgets().empty()) s << ", layer_budgets=" << ints_repr(o.layer_budgets());
  if (o.total_heads() != 0) s << ", total_heads=" << o.total_heads();
  if (o.lazy_reduction()) s << ", lazy_reduction=True";
  if (o.reduce_contributions()) s << ", reduce_contributions=<set>";
  return s.str();
}
template <class O>
std::string cache_options_repr(const O& o, const std::string& dims) {
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
std::string cache_repr(const char* type, const C& c, const std::string& dims) {
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

}  // namespace

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
