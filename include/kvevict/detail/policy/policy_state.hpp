#pragma once
// The private half of EvictionPolicy (eviction_policy.hpp): the state of every layer and the
// steps that the public calls are checked into. Growth and shrinking of the slots, the two
// halves of a truncate and of an append, pass planning and commit, and the observation
// plumbing. The path is chosen in one place, on_path() (a step both paths have) or
// on_tensor_path() (a step only the tensor path needs: undo copies, device tensors made
// ahead): host_path.hpp (CPU loops) or tensor_path.hpp (ATen ops). Its public steps are the
// cache protocol: EvictionPolicy::steps() hands them to detail::CacheBase (cache_base.hpp),
// and nothing else calls them. Nothing here validates user input: the facade has done that.

#include <kvevict/check.hpp>
#include <kvevict/detail/policy/host_path.hpp>
#include <kvevict/detail/policy/layer_state.hpp>
#include <kvevict/detail/policy/slot_plan.hpp>
#include <kvevict/detail/policy/tensor_path.hpp>
#include <kvevict/detail/reduction.hpp>
#include <kvevict/options.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvevict {
namespace detail {

/// EvictionPolicy's state and internal steps. The facade inherits them privately; its public
/// steps are the cache protocol, which CacheBase, the caches' common half, reaches through
/// EvictionPolicy::steps() (not for users: they skip the facade's checks). The state itself
/// stays protected: a cache reads the configuration through core() and a layer through at().
template <class Scorer>
class PolicyState {
 public:
  using HostPath = detail::HostPath<Scorer>;
  using TensorPath = detail::TensorPath<Scorer>;
  static constexpr int64_t W = Scorer::kStateWidth;

  /// See EvictionPolicy's constructor.
  PolicyState(const EvictionPolicyOptions& options, const EvictionOptions& eviction, Scorer scorer)
      : core_{(options.validate(),
               options.layer_budgets().empty() ? eviction.validate() : eviction.validate_counts(), options),
              eviction, {}, {}, std::move(scorer),
              resolved_device(options.device()), false, {}},
        host_(core_.device.is_cpu() && !force_tensor_path()) {
    core_.check = options.checks_observations(core_.device);
    core_.options.check_layer_budgets(core_.eviction);
    KVEVICT_CHECK_VALUE(!core_.options.lazy_reduction() || IsLinear<Scorer>::value,
                        "EvictionPolicyOptions: lazy_reduction needs a linear scorer (Scorer::kLinear: one observation "
                        "of summed contributions equals the observations one by one), got ", Scorer::kName,
                        "; use lazy_reduction(false)");
    const int64_t B = core_.options.batch_size();
    allocating([&] {
      core_.layer_eviction = core_.options.layer_eviction(core_.eviction);
      for (const auto& e : core_.layer_eviction) core_.selections.emplace_back(e);
      core_.active.assign(static_cast<size_t>(B), 1);
      auto fresh = prepare_fresh(nullptr);
      commit_fresh(fresh);
    }, [&](const std::string& why) { fail_allocation(why); });
  }

  int64_t rows() const noexcept { return core_.options.batch_size(); }

  /// The configuration every path reads (read-only: the steps below change it).
  const PolicyCore<Scorer>& core() const noexcept { return core_; }

  /// Makes every row active (reset()'s last step, after commit_fresh()). Does not throw.
  void activate_all() noexcept { std::fill(core_.active.begin(), core_.active.end(), 1); }

  /// Calls `f(path)` with the path of this policy: one call per step into a path.
  template <class F>
  decltype(auto) on_path(F&& f) {
    return host_ ? f(host_path_) : f(tensor_path_);
  }
  template <class F>
  decltype(auto) on_path(F&& f) const {
    return host_ ? f(host_path_) : f(tensor_path_);
  }
  /// Calls `f(tensor_path)` on the tensor path only: a step the host path has no need of (undo
  /// copies, device tensors made ahead, device counters).
  template <class F>
  void on_tensor_path(F&& f) {
    if (!host_) f(tensor_path_);
  }
  template <class F>
  void on_tensor_path(F&& f) const {
    if (!host_) f(tensor_path_);
  }

  /// A rollback planned by plan_truncate(): per layer its pass, its moves and what the tensor
  /// path's commit writes, all allocated; commit_truncate() then writes every layer.
  struct Truncation {
    int64_t row = 0, k = 0;
    std::vector<Pass> passes;
    std::vector<SlotMoves> moves;  // per layer, for its buffers (apply_moves)
    std::vector<typename TensorPath::Commit> writes;  // tensor path, per layer
    at::Tensor k_device;  // tensor path: k, taken off the seen counters without allocating
  };

  /// truncate(), first half: checks every layer and allocates everything the rollback needs;
  /// changes nothing. \throws as truncate().
  /// `in_tier`: per layer, how many of the k newest tokens of the row sit in the cache's host
  /// tier (empty: none); those count as present and are not planned here.
  Truncation plan_truncate(int64_t row, int64_t k, const std::vector<int64_t>& in_tier = {}) {
    KVEVICT_CHECK(core_.active[check_row(row)] != 0, "truncate: row ", row, " holds no sequence");
    KVEVICT_CHECK_VALUE(k >= 0, "truncate: k must be >= 0, got ", k);
    std::vector<std::vector<int64_t>> slots_of(layers_.size());  // per layer: slots of the k tokens
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto& L = layers_[l];
      KVEVICT_CHECK_VALUE(k <= L.seen[row], "truncate: k must be <= seen tokens of row ", row, " in layer ", l,
                          " (", L.seen[row], "), got ", k);
      const auto pos = L.position.select(0, row).narrow(0, 0, L.len[row]).to(at::kCPU).contiguous();
      const int64_t* p = pos.template data_ptr<int64_t>();
      for (int64_t s = 0; s < L.len[row]; ++s) {
        if (p[s] >= L.seen[row] - k) slots_of[l].push_back(s);
      }
      const int64_t tiered = in_tier.empty() ? 0 : in_tier[l];
      const int64_t found = static_cast<int64_t>(slots_of[l].size()) + tiered;
      KVEVICT_CHECK(found == k, "truncate: ", k - found, " of the ", k, " newest tokens of row ", row,
                    " were already evicted in layer ", l,
                    tiered > 0 || !in_tier.empty() ? " (and are not in the host tier)" : "",
                    "; only tokens still cached", in_tier.empty() ? "" : " or in the tier", " can be rolled back");
    }
    Truncation t;
    t.row = row;
    t.k = k;
    for (size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      Pass pass;
      reset_pass(L, pass);
      const auto cached = static_cast<int64_t>(slots_of[l].size());
      pass.n[row] = cached;
      pass.new_len[row] = L.len[row] - cached;
      std::vector<uint8_t> tail_flags;
      fill_moves_host(pass, row, slots_of[l].data(), cached, tail_flags);
      pad_moves(pass);
      t.moves.push_back(pass.to_moves(core_.device));
      on_tensor_path([&](auto& p) { t.writes.push_back(p.prepare_commit(core_, L, static_cast<int64_t>(l), pass)); });
      t.passes.push_back(std::move(pass));
    }
    on_tensor_path([&](auto&) { t.k_device = at::full({}, k, at::TensorOptions().dtype(at::kLong).device(core_.device)); });
    return t;
  }

  /// truncate(), second half: applies a plan_truncate() to every layer. Allocates nothing on
  /// the host path; on the tensor path its device writes (every layer's) come before any host
  /// counter changes, under the caller's undo log (save() of every layer).
  void commit_truncate(Truncation& t) {
    ++epoch_;
    on_tensor_path([&](auto& p) {
      for (size_t l = 0; l < layers_.size(); ++l) {
        const auto layer = static_cast<int64_t>(l);
        p.commit(core_, layers_[l], layer, t.passes[l], t.writes[l]);
        p.rewind(core_, layers_[l], layer, t.row, t.k_device);
      }
    });
    for (size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      L.open_q = 0;  // slots move: an observation in pieces no longer matches them
      if (host_) host_path_.commit(core_, L, static_cast<int64_t>(l), t.passes[l]);
      for (int64_t b = 0; b < rows(); ++b) L.len[b] = t.passes[l].new_len[b];
      L.seen[t.row] -= t.k;
    }
  }

  /// Tensor path: copies into `undo` what a commit on `layer` may write (its device state:
  /// positions, scorer states, pending sums and, unless `counters` is false, the counters),
  /// so that a throw among the writes can be undone (detail::TensorUndo). A pass's last write
  /// is the counters' (commit()): when nothing comes after it, they need no copy. Nothing on
  /// the host path, whose commits do not throw.
  void save(TensorUndo& undo, int64_t layer, bool counters = true) const {
    on_tensor_path([&](const auto& p) { p.save(undo, at(layer), layer, counters); });
  }
  /// Tensor path: `layer`'s device counters ([B, 3] int64: length, seen, seen - n_recent); the
  /// host path: undefined.
  at::Tensor device_counters(int64_t layer) const {
    at::Tensor counters;
    on_tensor_path([&](const auto& p) { counters = p.counters(layer); });
    return counters;
  }

  /// Recall's exchange step (the tier's swap calls it): in `layer`, slot slots[b, k] of each
  /// row b takes the token at positions[b, k] with scorer state states[b, k] ([B, V] int64,
  /// [B, V] int64, [B, V, W] fp32, on the policy's device, CPU contiguous on the host path; the
  /// trash slot where a row has fewer). The tier keeps the tokens' rows; the policy keeps
  /// their positions and states, and only it writes them. Host path: allocates nothing, does
  /// not throw; tensor path: two scatter_s, under the caller's undo log.
  void exchange(int64_t layer, const at::Tensor& slots, const at::Tensor& positions, const at::Tensor& states) {
    auto& L = at(layer);
    on_path([&](auto& p) { p.exchange(core_, L, layer, slots, positions, states); });
  }

  /// Tensor path: what undoes append_prepared() of `map` on `layer` (TensorPath::save_append).
  void save_append(TensorUndo& undo, int64_t layer, const at::Tensor& map) {
    on_tensor_path([&](auto& p) { p.save_append(undo, core_, at(layer), map); });
  }

  /// Plans a pass on `layer` into `pass` (the caller checked due()), reusing its vectors' room;
  /// changes nothing but, with lazy_reduction, first applies the pending observations (flush():
  /// may throw as it does).
  /// `now`: every row over capacity, whatever evict_every says (CacheBase::evict_now()).
  void plan(int64_t layer, Pass& pass, bool now = false) {
    auto& L = at(layer);
    flush_layer(L, layer);
    reset_pass(L, pass);
    const int64_t cap = core_.layer_eviction[layer].capacity();
    for (int64_t b = 0; b < rows(); ++b) {
      pass.n[b] = (now ? L.len[b] > cap : core_.row_due(L, b, cap)) ? L.len[b] - cap : 0;
      pass.new_len[b] = L.len[b] - pass.n[b];
    }
    on_path([&](auto& p) { p.plan(core_, L, layer, pass); });
  }

  /// Applies a planned pass to the state of `layer`. \throws only on a host-heap failure among
  /// the tensor path's writes (the caller's undo log, save(), puts them back); the host
  /// counters change after them.
  void commit(int64_t layer, Pass& pass) {
    auto& L = at(layer);
    commit_state(L, layer, pass);
    int64_t evicted = 0;
    for (int64_t b = 0; b < rows(); ++b) {
      evicted += pass.n[b];
      if (pass.n[b] > 0) L.appends[b] = 0;
    }
    if (evicted > 0) L.events += 1;
    L.evicted += evicted;
  }

  /// Moves the state rows of a pass, marks the freed tail dead and sets the new lengths.
  /// \throws as commit(), before any host counter changed.
  void commit_state(LayerState& L, int64_t layer, Pass& pass) {
    if (host_) {
      host_path_.commit(core_, L, layer, pass);
    } else {
      auto w = tensor_path_.prepare_commit(core_, L, layer, pass);  // every allocation first
      tensor_path_.commit(core_, L, layer, pass, w);
    }
    L.open_q = 0;  // slots moved: an observation in pieces no longer matches them
    for (int64_t b = 0; b < rows(); ++b) L.len[b] = pass.new_len[b];
  }

  /// An append without checks (the caller ran check_append()) in two halves, so that a cache
  /// can allocate everything, then grow, then write: prepare_append() makes the tensor path's
  /// device tensors (throws only on an allocation failure; changes nothing), append_prepared()
  /// writes them and advances the counters (allocates nothing, does not throw). The same
  /// counts, T and map to both; a resize_slots() in between is allowed. The caches write their
  /// rows from the lengths before the append. `map`: tensor path, slot_map() with pads on the
  /// trash slot (of the slots when append_prepared() runs).
  void prepare_append(int64_t layer, const int64_t* counts, int64_t T, const at::Tensor& map) {
    auto& L = at(layer);
    on_tensor_path([&](auto& p) { p.prepare_append(core_, L, layer, counts, T, map); });
  }
  void append_prepared(int64_t layer, const int64_t* counts, int64_t T, const at::Tensor& map) {
    auto& L = at(layer);
    if (host_) {
      host_path_.append(core_, L, layer, counts, T);
    } else {
      tensor_path_.append(core_, L, layer, counts, T, map);
    }
    for (int64_t b = 0; b < rows(); ++b) {
      L.len[b] += counts[b];
      L.seen[b] += counts[b];
      L.last_new[b] = counts[b];
      L.appends[b] += counts[b] > 0 ? 1 : 0;
    }
    L.last_T = T;
    L.open_q = 0;
  }

  /// Tensor path: the [B, T] slot of each column of an append (before it), pads on slot `trash`
  /// (the trash slot of the slots the append will have: TensorPath::slot_map).
  at::Tensor slot_map(int64_t layer, const int64_t* counts, int64_t T, int64_t trash) {
    auto& L = at(layer);
    return tensor_path_.slot_map(core_, L, layer, counts, T, trash);
  }

  /// compress_prompt() without a host tier, after the n kept tokens of a prompt of T tokens were
  /// appended to the empty `layer` (positions 0 .. n-1 in every active row): gives them their
  /// prompt positions `keep` [B, n] int64 (ascending, the policy's device), and leaves each
  /// active row as the tier's evict_now() pass over all T tokens would: seen tokens T, latest
  /// append T tokens, the T - n dropped tokens counted as evicted (one eviction event if any).
  /// Free rows stay empty. The device writes come first (copies into the state and the tensor
  /// path's counters, nothing allocated on the host path); a throw there leaves the host
  /// counters as they were (the caller then empties the layer: clear_layer()).
  void place_prompt(int64_t layer, const at::Tensor& keep, int64_t T) {
    auto& L = at(layer);
    const int64_t n = keep.size(1), dropped = T - n;
    for (int64_t b = 0; b < rows(); ++b) {
      if (!core_.active[b] || dropped == 0) continue;
      L.position.select(0, b).narrow(0, 0, n).copy_(keep.select(0, b));
      on_tensor_path([&](auto& p) { p.rewind(core_, L, layer, b, at::full({}, -dropped, L.position.options())); });
    }
    int64_t evicted = 0;
    for (int64_t b = 0; b < rows(); ++b) {
      if (!core_.active[b]) continue;
      L.seen[b] = T;
      L.last_new[b] = T;
      if (dropped > 0) L.appends[b] = 0;  // as after a pass
      evicted += dropped;
    }
    L.last_T = T;
    L.open_q = 0;
    if (evicted > 0) L.events += 1;
    L.evicted += evicted;
  }

  /// Empties every row of `layer` (positions -1, lengths, seen tokens and latest appends 0), the
  /// other layers and the counters of stats() untouched: compress_prompt()'s undo of its append
  /// into a layer that was empty. Allocates nothing on the host path; fills on the tensor path.
  void clear_layer(int64_t layer) {
    auto& L = at(layer);
    for (int64_t b = 0; b < rows(); ++b) {
      on_path([&](auto& p) { p.clear_row(core_, L, layer, b); });
      L.len[b] = L.seen[b] = L.last_new[b] = L.appends[b] = 0;
    }
    L.last_T = 0;
    L.open_q = 0;
  }

  /// A layer's state and its path's scratch, made apart before they replace the layer's.
  struct Grown {
    LayerState state;
    typename HostPath::Scratch host;
    typename TensorPath::Scratch tensor;
  };
  /// The scratch of `N` that path `p` takes (an overload per path, for on_path()).
  static typename HostPath::Scratch& scratch(Grown& N, const HostPath&) noexcept { return N.host; }
  static typename TensorPath::Scratch& scratch(Grown& N, const TensorPath&) noexcept { return N.tensor; }

  /// A copy of L's state with `slots` slots per row, its tokens kept (allocates; changes
  /// nothing). \throws c10::ValueError if slots < the longest row + 1; c10::Error naming `what`,
  /// the layer and the sizes on an allocation failure.
  Grown resized(const LayerState& L, int64_t layer, int64_t slots, const char* what) const {
    KVEVICT_CHECK_VALUE(slots >= max_of(L.len) + 1 && slots >= 2 && slots <= EvictionOptions::kMaxTokens + 1,
                        what, ": slots must be in [max(2, size(layer) + 1 = ", max_of(L.len) + 1,
                        ") (the tokens and the trash slot), 2^40 + 1], got ", slots);
    Grown N;
    named_allocation(layer, L.slots, slots, what, [&] {
      N.state = resized_layer(core_, L, slots);
      on_path([&](const auto& p) { scratch(N, p) = p.resized(core_, layer, slots); });
    });
    return N;
  }

  /// Runs `allocate()`; an allocation failure becomes a c10::Error "<what>: could not allocate
  /// the eviction state of layer <layer> resized from <from> to <slots> slots per row (sizes)".
  /// A null `what`: no renaming (the constructor names its own).
  template <class F>
  void named_allocation(int64_t layer, int64_t from, int64_t slots, const char* what, F&& allocate) const {
    if (!what) return allocate();
    allocating(allocate, [&](const std::string& why) {
      const int64_t bytes = 8 + 4 * W + (core_.options.lazy_reduction() ? 16 : 0);  // per slot and row
      KVEVICT_CHECK(false, what, ": could not allocate the eviction state of layer ", layer, " resized from ", from,
                    " to ", slots, " slots per row (batch_size=", rows(), ", ", bytes,
                    " bytes per slot and row on ", core_.device, "): ", why);
    });
  }

  /// L's own state and scratch as a Grown (handles, no device copy; allocates host vectors):
  /// swap_in() of it undoes a swap_in() of a resized() one.
  Grown current(const LayerState& L, int64_t layer) const {
    Grown N;
    N.state = L;
    on_path([&](const auto& p) { scratch(N, p) = p.resized(core_, layer, L.slots); });
    return N;
  }

  /// A copy of `layer`'s whole state (its tensors cloned, its host counters copied) and of its
  /// path's lasting scratch (allocates; changes nothing): what save_layer() keeps.
  Grown copied(int64_t layer) const {
    const auto& L = at(layer);
    Grown N;
    N.state = L;  // the host counters and vectors; the tensors are cloned below
    c10::InferenceMode normal_tensors(false);
    N.state.position = L.position.clone();
    N.state.state = L.state.clone();
    if (L.pending.defined()) N.state.pending = L.pending.clone();
    if (host_) {
      N.host = host_path_.resized(core_, layer, L.slots);  // scratch of one call: a fresh one
    } else {
      N.tensor = tensor_path_.copied(layer);
    }
    return N;
  }

  /// Makes `N` (a copied() of `layer`) the layer's state, and `N` the state it replaces.
  /// Allocates nothing, does not throw.
  void restore(int64_t layer, Grown& N) noexcept {
    std::swap(layers_[static_cast<size_t>(layer)], N.state);
    on_path([&](auto& p) { p.swap_in(layer, scratch(N, p)); });
  }

  /// Swaps the tensors of `N` (from resized()) into `L`. Does not throw.
  void swap_in(LayerState& L, int64_t layer, Grown& N) noexcept {
    L.slots = N.state.slots;
    L.position = std::move(N.state.position);
    L.state = std::move(N.state.state);
    L.pending = std::move(N.state.pending);
    L.open_q = 0;
    on_path([&](auto& p) { p.swap_in(layer, scratch(N, p)); });
  }

  /// compress_prompt()'s undo (CacheBase::clear_layer()): gives `layer` back its own state `N`
  /// (current(), taken before an append grew it): on the host path with its scratch, which is
  /// sized by the slots; the tensor path keeps its scratch (counters, mirrors), which a resize
  /// keeps. Does not throw.
  void swap_back(int64_t layer, Grown& N) noexcept {
    auto& L = layers_[static_cast<size_t>(layer)];
    if (host_) return swap_in(L, layer, N);
    L.slots = N.state.slots;
    std::swap(L.position, N.state.position);
    std::swap(L.state, N.state.state);
    std::swap(L.pending, N.state.pending);
    L.open_q = 0;
  }

  int64_t base_slots_unchecked(int64_t layer) const {
    return std::max(core_.layer_eviction[layer].capacity() + core_.eviction.evict_every(), reserved_) + 1;
  }

  /// Empty state for every layer at base_slots() and the paths' scratch for it: what
  /// prepare_fresh() makes and commit_fresh() takes.
  struct Fresh {
    std::vector<LayerState> layers;
    HostPath host;
    TensorPath tensor;
  };

  /// Empty state for every layer at base_slots(), with its path's scratch (allocates; changes
  /// nothing). `what` names the public call in an allocation failure's message (null: not
  /// renamed).
  Fresh prepare_fresh(const char* what) const {
    const int64_t B = rows();
    Fresh f;
    const auto n = static_cast<size_t>(core_.options.num_layers());
    named_allocation(0, n > 0 && !layers_.empty() ? layers_[0].slots : 0, base_slots_unchecked(0), what, [&] {
      f.layers.resize(n);
      if (host_) {
        f.host.size_layers(static_cast<int64_t>(n));
      } else {
        f.tensor.size_layers(static_cast<int64_t>(n));
      }
    });
    for (size_t l = 0; l < n; ++l) {
      auto& L = f.layers[l];
      const int64_t slots = base_slots_unchecked(static_cast<int64_t>(l));
      const int64_t from = l < layers_.size() ? layers_[l].slots : 0;
      named_allocation(static_cast<int64_t>(l), from, slots, what, [&] {
        L.len.assign(B, 0);
        L.appends.assign(B, 0);
        L.seen.assign(B, 0);
        L.last_new.assign(B, 0);
        allocate_layer(core_, L, slots);
        if (host_) {
          auto scratch = HostPath().resized(core_, static_cast<int64_t>(l), slots);
          f.host.swap_in(static_cast<int64_t>(l), scratch);
        } else {
          auto scratch = f.tensor.resized(core_, static_cast<int64_t>(l), slots);
          f.tensor.swap_in(static_cast<int64_t>(l), scratch);
        }
      });
    }
    return f;
  }

  /// Makes a prepare_fresh() current: every layer empty. Allocates nothing, does not throw.
  void commit_fresh(Fresh& f) noexcept {
    ++epoch_;
    // Moves of vectors and tensors (reference-counted handles): nothing allocates.
    static_assert(std::is_nothrow_move_assignable<HostPath>::value, "commit_fresh() swaps without allocating");
    layers_.swap(f.layers);
    std::swap(host_path_, f.host);
    std::swap(tensor_path_, f.tensor);
  }

  [[noreturn]] void fail_allocation(const std::string& why) const {
    KVEVICT_CHECK(false, "could not allocate the eviction state: num_layers=", core_.options.num_layers(),
                  ", batch_size=", core_.options.batch_size(), ", num_heads=", core_.options.num_heads(),
                  ", capacity + evict_every = ", core_.eviction.capacity() + core_.eviction.evict_every(),
                  " slots per row (n_sink=", core_.eviction.n_sink(), ", budget=", core_.eviction.budget(),
                  ", n_recent=", core_.eviction.n_recent(), ", evict_every=", core_.eviction.evict_every(), ") on ",
                  core_.device, ": ", why);
    throw;  // not reached
  }

  int64_t check_row(int64_t row) const {
    KVEVICT_CHECK_INDEX(row >= 0 && row < rows(), "row must be in [0, ", rows(), "), got ", row);
    return row;
  }
  LayerState& at(int64_t layer) {
    KVEVICT_CHECK_INDEX(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "layer must be in [0, ", static_cast<int64_t>(layers_.size()), "), got ", layer);
    return layers_[layer];
  }
  const LayerState& at(int64_t layer) const { return const_cast<PolicyState*>(this)->at(layer); }

  /// Empties `row` in every layer (positions -1, lengths and seen 0). No allocation on the host
  /// path; on the tensor path fills per layer, under an undo log (a throw among them, named
  /// `call`, changes nothing), then the host counters.
  void clear_row(int64_t row, const char* call) {
    ++epoch_;
    TensorUndo undo;
    on_tensor_path([&](auto& p) {
      for (size_t l = 0; l < layers_.size(); ++l) p.save_row(undo, layers_[l], static_cast<int64_t>(l), row);
    });
    undo.commit(call, [&] {
      for (size_t l = 0; l < layers_.size(); ++l) {
        on_path([&](auto& p) { p.clear_row(core_, layers_[l], static_cast<int64_t>(l), row); });
      }
    });
    for (auto& L : layers_) {
      L.len[row] = L.seen[row] = L.last_new[row] = L.appends[row] = 0;
      L.open_q = 0;
    }
  }

  /// Opens an observation of Q columns.
  void begin_observation(LayerState& L, int64_t layer, int64_t Q) {
    on_path([&](auto& p) { p.begin_observation(core_, L, layer, Q); });
    L.open_q = Q;
  }

  /// Adds the fixed-point terms of probs [B, Hc, Qc, S] (query columns from q_begin, heads from
  /// h_begin) to the open observation, checking them on the way when checks are on.
  void add_observation(LayerState& L, int64_t layer, const at::Tensor& in, int64_t q_begin, int64_t h_begin) {
    on_path([&](auto& p) { p.add_observation(core_, L, layer, in, q_begin, h_begin); });
  }

  /// Applies the open observation (reducer, observers, rank check, scorer) and closes it.
  void end_observation(LayerState& L, int64_t layer) {
    on_path([&](auto& p) { p.end_observation(core_, L, layer); });
    L.open_q = 0;
  }

  /// lazy_reduction: applies the pending observations of `layer` (see flush()).
  void flush_layer(LayerState& L, int64_t layer) {
    if (L.pending_terms == 0) return;
    at::NoGradGuard no_grad;
    on_path([&](auto& p) { p.flush(core_, L, layer); });
    L.pending_terms = 0;
  }

  // The facade's and the steps' own: a cache reads them through core() and at().
 protected:
  PolicyCore<Scorer> core_;
  bool host_;
  int64_t reserved_ = 0;  // slots asked for by reserve()
  // Calls that change every layer's rows at once (reset, reset(row), finish, add_sequence,
  // truncate) so far: a layer's save may be restored only while it is unchanged.
  int64_t epoch_ = 0;
  std::vector<LayerState> layers_;
  HostPath host_path_;
  TensorPath tensor_path_;
};

}  // namespace detail
}  // namespace kvevict
