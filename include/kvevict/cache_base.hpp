#pragma once
// What every cache layout shares: per-layer buffers in the layout's shape, owned next to one
// EvictionPolicy that decides where rows go, and with tier_tokens one host tier per layer
// (LayerTier, detail/tier/tier.hpp). A layout (MlaCache, MlaLatentCache) names its buffers and their
// token dims; the rest is here: append, evict (plan the pass, hand the evicted rows to the
// tier, move every buffer, commit), grow and shrink, reserve, truncate (tier tokens included),
// sequences (add, finish, reset), and recall (check, score every row's pages, swap). The class
// declares every member; the longer ones are defined in detail/cache/ (append.hpp, recall.hpp,
// sequences.hpp), included at the end.

#include <kvevict/check.hpp>
#include <kvevict/detail/cache/cache_bytes.hpp>
#include <kvevict/detail/layer_buffers.hpp>
#include <kvevict/detail/layer_tiers.hpp>
#include <kvevict/detail/tensor_undo.hpp>
#include <kvevict/detail/tier/tier.hpp>
#include <kvevict/eviction_policy.hpp>
#include <kvevict/slot_moves.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (<ATen/ATen.h> lacks it in LibTorch 2.6)
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>


namespace kvevict {
namespace detail {

/// Buffers of every layer over one EvictionPolicy; the base of every cache layout. Live tokens
/// of row b fill slots [0, size(layer, b)); views are [.., size(layer), ..] wide (the longest
/// row), and slots past a row's own length hold stale rows that positions() marks -1.
///
/// Failures: every public call allocates first and commits last, so that a throw leaves the
/// cache as it was (docs/DESIGN.md, rule 9); a host-heap failure (std::bad_alloc) leaves it
/// as a c10::Error naming the call (host_heap()). On the tensor path a commit is a few
/// LibTorch in-place writes, which allocate small host objects themselves: they run under an
/// undo log (TensorUndo) that puts back what they wrote if one of them throws.
///
/// CUDA graphs: with observation checks off, a steady-state step (one token per row, observe,
/// evict) has static shapes and no host sync, so it can be captured and replayed once the
/// buffers stop moving (reserve() pins them). Replays advance what lives on the device (rows,
/// positions, scores; positions come from a device-side counter), not the host counters:
/// seen_tokens() and stats() keep their values from the capture.
template <class Policy>
class CacheBase {
 public:
  using policy_type = Policy;
  using scorer_type = typename Policy::scorer_type;

  /// A cache owns its buffers: copying would alias them, so only moves are allowed. A moved-from
  /// cache holds nothing: its calls throw a c10::Error saying so (assigning a cache to it makes it
  /// usable again).
  CacheBase(const CacheBase&) = delete;
  CacheBase& operator=(const CacheBase&) = delete;
  CacheBase(CacheBase&&) noexcept = default;
  CacheBase& operator=(CacheBase&&) noexcept = default;

  /// Capacity n_sink + budget + n_recent: tokens per row after an eviction pass (every layer,
  /// unless layer_budgets are set: then capacity(layer)).
  int64_t capacity() const noexcept { return policy_.capacity(); }
  /// Tokens per row of `layer` after a pass. \throws c10::IndexError for a bad layer.
  int64_t capacity(int64_t layer) const { return policy_.capacity(layer); }
  int64_t num_layers() const noexcept { return policy_.num_layers(); }
  int64_t batch_size() const noexcept { return policy_.batch_size(); }
  int64_t num_heads() const noexcept { return policy_.num_heads(); }
  at::ScalarType dtype() const noexcept { return dtype_; }
  at::Device device() const noexcept { return policy_.device(); }
  /// The eviction state (read-only: change it through the cache, which moves the rows too).
  const Policy& policy() const noexcept { return policy_; }

 private:
  // The cache protocol: the policy's unchecked steps (EvictionPolicy::steps()), which this class
  // runs in its all-or-nothing order.
  using Steps = PolicyState<typename Policy::scorer_type>;
  Steps& steps() noexcept { return policy_.steps(); }
  const Steps& steps() const noexcept { return policy_.steps(); }

 public:

  /// The longest row of `layer`: the token width S of views, positions and probabilities.
  /// \throws c10::IndexError for a bad layer.
  int64_t size(int64_t layer) const { return policy_.size(layer); }
  /// Live tokens of `row` in `layer`. \throws c10::IndexError.
  int64_t size(int64_t layer, int64_t row) const { return policy_.size(layer, row); }
  /// The most tokens ever appended to a row of `layer` (equal rows: their seen tokens).
  int64_t seen_tokens(int64_t layer) const { return policy_.seen_tokens(layer); }
  /// Tokens ever appended to `row` of `layer`: the position of its next token.
  int64_t seen_tokens(int64_t layer, int64_t row) const { return policy_.seen_tokens(layer, row); }
  /// Slots allocated per row in `layer` (see reserve() and docs/cpp-guide.md, "Memory: the growth rule").
  int64_t slots(int64_t layer) const { return policy_.slots(layer); }

  /// [B, size] int64 original position of each slot, slot order (not sorted; see ordered()),
  /// -1 past a row's length. A copy, on the cache's device.
  at::Tensor positions(int64_t layer) const { return policy_.positions(layer); }
  /// [B, size] fp32 rank of each slot (the accumulated score, or for MeanObservedAttention the
  /// sum divided by its observers), 0 past a row's length. A copy.
  at::Tensor scores(int64_t layer) const { return policy_.scores(layer); }

  /// Feeds attention probabilities to the scorer: EvictionPolicy::observe() (shape
  /// [B, H, Q, S], queries right-aligned on the newest append, pads ignored).
  /// \throws c10::Error as EvictionPolicy::observe(); the cache is unchanged then.
  void observe(int64_t layer, const at::Tensor& probs) {
    host_heap("observe", [&] { check_not_moved("observe"); policy_.observe(layer, probs); });
  }
  /// Adds caller-computed scores [B, S]: EvictionPolicy::add_scores().
  void add_scores(int64_t layer, const at::Tensor& scores) {
    host_heap("add_scores", [&] { check_not_moved("add_scores"); policy_.add_scores(layer, scores); });
  }
  /// Applies the observations lazy_reduction holds back on `layer`: EvictionPolicy::flush() (a
  /// collective under tensor parallelism; evict() calls it when a pass is due).
  void flush(int64_t layer) { policy_.flush(layer); }
  /// An observation in pieces (query and head chunks), exactly as observe() of the whole:
  /// EvictionPolicy::observe_begin(), observe_add() per piece [B, Hc, Qc, S], observe_end().
  void observe_begin(int64_t layer, int64_t Q) { policy_.observe_begin(layer, Q); }
  void observe_add(int64_t layer, const at::Tensor& probs, int64_t q_begin, int64_t h_begin) {
    policy_.observe_add(layer, probs, q_begin, h_begin);
  }
  void observe_end(int64_t layer) { policy_.observe_end(layer); }
  /// Discards the open observation of `layer`: EvictionPolicy::observe_discard().
  void observe_discard(int64_t layer) { policy_.observe_discard(layer); }

  /// Runs an eviction pass on `layer` if one is due (EvictionPolicy::due: a row over capacity
  /// and evict_every updates since the last pass) and moves the K/V rows the pass says; else a
  /// no-op. Buffers grown by a long append shrink back to max(capacity + evict_every, reserved)
  /// slots after the pass.
  ///
  /// \return tokens evicted, summed over rows (0 if no pass ran).
  /// \throws c10::IndexError for a bad layer; c10::Error naming evict on an allocation failure
  ///         (the device's or the host heap's). A throw leaves the cache as it was, but for
  ///         one thing: with lazy_reduction the pending observations were applied first (EvictionPolicy::flush(), a collective under
  ///         tensor parallelism) and stay applied, so that every process stays in step.
  /// \note CPU: no allocation in the steady state (with a host tier: once the tier is full;
  ///       while it fills it grows geometrically). CUDA: tensor ops only, no host sync, static
  ///       shapes in the steady state. With a host tier (tensor path) the pass's evicted tokens
  ///       join the tier's store inside the pass's commit, as tensor ops (their rows written to
  ///       pinned host memory through its device view): still no sync and no copy, so a step
  ///       with a tier replays as a CUDA graph once the store has stopped growing
  ///       (reserve_tier()).
  int64_t evict(int64_t layer) {
    return host_heap("evict", [&] { check_not_moved("evict"); return run_pass(layer, false); });
  }

  /// evict() without waiting for evict_every: a pass on `layer` now if any row is over its
  /// capacity (compress_prompt() with a host tier uses it). Same returns and guarantees.
  int64_t evict_now(int64_t layer) {
    return host_heap("evict_now", [&] { check_not_moved("evict_now"); return run_pass(layer, true); });
  }

 private:
  int64_t run_pass(int64_t layer, bool now) {
    if (now) {
      bool over = false;
      for (int64_t b = 0; b < batch_size(); ++b) over = over || size(layer, b) > capacity(layer);
      if (!over) return 0;
    } else if (!policy_.due(layer)) {
      return 0;
    }
    auto& pass = pass_;
    steps().plan(layer, pass, now);
    auto& bufs = buffers_[layer];
    int64_t evicted = 0;
    for (const auto n : pass.n) evicted += n;
    // The evicted tokens to the tier, before the moves overwrite their rows (LayerTier::take():
    // the host path stores them at once, the tensor path plans them into the pass's commit).
    TensorUndo undo;  // what the tensor path's writes below change, put back if one of them throws
    TierWrites tier_writes(undo);
    if (tier_tokens_ > 0) {
      tiers_[layer].take(pass, steps().at(layer), bufs, [&](const auto& state) { return policy_.scorer().rank(state); },
                         tier_writes);
    }
    if (policy_.host_path()) {
      for (size_t i = 0; i < specs_.size(); ++i) {
        apply_moves_host(pass.src.data(), pass.dst.data(), batch_size(), pass.columns, pass.columns,
                         bufs[i], token_dim(i));
      }
      steps().commit(layer, pass);
    } else {
      LayerMoves moves;
      moves.gather(pass.to_moves(device()), specs_, bufs, move_rows_);
      if (!moves.moves.empty()) move_rows_ = moves.rows;  // made once: no kernel per pass
      if (!moves.moves.empty()) steps().save(undo, layer, /*counters=*/false);  // the last write
      moves.save(undo, specs_, bufs);
      undo.commit(now ? "evict_now" : "evict", [&] {
        tier_writes.run();  // the tier's, from the rows as they were
        moves.scatter(specs_, bufs);
        steps().commit(layer, pass);  // its device writes, then the host counters
      });
    }
    shrink_if_fits(layer);
    return evicted;
  }

 public:
  /// Counters of one layer. \throws c10::IndexError for a bad layer.
  CacheStats stats(int64_t layer) const {
    auto s = policy_.stats(layer);
    for (const auto& t : buffers_.at(layer)) s.bytes_allocated += t.nbytes();
    if (tier_tokens_ > 0) tiers_[layer].add_stats(s);
    return s;
  }
  /// Counters summed over layers.
  CacheStats stats() const {
    CacheStats total;
    for (int64_t l = 0; l < num_layers(); ++l) total += stats(l);
    return total;
  }

  // -------------------------------------------------------------------------------------------
  // The host tier (cache options' tier_tokens > 0): evicted tokens kept in host memory. On the
  // tensor path every read below reads the device (a sync on CUDA).

  /// Tokens a row keeps in its tier per layer (0: no tier; the cache options' tier_tokens).
  int64_t tier_tokens() const noexcept { return tier_tokens_; }
  /// Tokens of `row` in the tier of `layer`. \throws c10::IndexError for a bad layer or row.
  int64_t tier_size(int64_t layer, int64_t row) const {
    return host_heap("tier_size", [&] { return tier("tier_size", layer, row).size(row); });
  }
  /// [n] int64 positions of the tier tokens of `row` in `layer`, ascending (CPU, a copy).
  at::Tensor tier_positions(int64_t layer, int64_t row) const {
    return host_heap("tier_positions", [&] { return tier("tier_positions", layer, row).positions(row); });
  }
  /// [n] fp32 rank (Scorer::rank) of each tier token of `row` in `layer` when it was evicted,
  /// in the order of tier_positions() (CPU, a copy).
  at::Tensor tier_scores(int64_t layer, int64_t row) const {
    return host_heap("tier_scores", [&] { return tier("tier_scores", layer, row).ranks(row); });
  }

 protected:
  /// Per buffer of the layout (MlaCache: keys, values; MlaLatentCache: ckv, kpe), the rows of
  /// the tier tokens of `row` in `layer` as [outer..., n, inner] (the buffer's shape without
  /// the batch), in the order of tier_positions(), bit for bit as they were cached (CPU,
  /// copies). A host allocation failure is a c10::Error naming tier_rows (the layouts' read).
  std::vector<at::Tensor> tier_buffers(int64_t layer, int64_t row) const {
    return host_heap("tier_rows", [&] {
      std::vector<std::vector<int64_t>> shapes;
      for (const auto& spec : specs_) shapes.push_back(spec.token_shape());
      return tier("tier_rows", layer, row).rows(row, shapes, dtype_);
    });
  }

 public:
  // -------------------------------------------------------------------------------------------
  // Sequences (continuous batching): EvictionPolicy's lifecycle, with the rows moved too.

  /// True while `row` holds a sequence. \throws c10::IndexError.
  bool active(int64_t row) const { return policy_.active(row); }
  /// Starts a new, empty sequence in the lowest free row and returns that row.
  /// \throws c10::Error if every row holds a sequence.
  int64_t add_sequence() {
    check_not_moved("add_sequence");
    return policy_.add_sequence();
  }
  /// Ends the sequence in `row`; the row is free for add_sequence(). Other rows go on.
  /// With a tier, its tokens of the row are released too.
  void finish(int64_t row) {
    host_heap("finish", [&] { check_not_moved("finish"); end_row(row, "finish", [&] { policy_.finish(row); }); });
  }
  /// Empties `row` for a new sequence (positions restart at 0), its tier tokens too.
  void reset(int64_t row) {
    host_heap("reset", [&] { check_not_moved("reset"); end_row(row, "reset", [&] { policy_.reset(row); }); });
  }

  /// Empties every layer and row for new sequences (positions restart at 0), makes every row
  /// active, and gives back the slots grown by long appends.
  /// \throws c10::Error naming reset, the layer and the sizes if the smaller buffers cannot be
  ///         allocated; the cache is unchanged then.
  void reset();

  /// Rolls back the `k` newest tokens of `row` in every layer (EvictionPolicy::truncate: the
  /// rejected drafts of speculative decoding) and moves the rows to match.
  /// \throws c10::Error if a dropped token was already evicted, k is out of range or the row is
  ///         free, or on an allocation failure; the cache (every layer) is unchanged then.
  void truncate(int64_t row, int64_t k) {
    host_heap("truncate", [&] { check_not_moved("truncate"); truncate_rows(row, k); });
  }

  /// One layer's rows, eviction state and host tier, copied by save_layer(). Move-only;
  /// restore_layer() takes it.
  class LayerSave {
   public:
    LayerSave() = default;
    /// The layer it was saved from; -1 once restored (or default-made).
    int64_t layer() const noexcept { return policy_.layer(); }

   private:
    friend class CacheBase;
    typename Policy::LayerSave policy_;
    std::vector<at::Tensor> buffers_;
    LayerTier tier_;
  };

  /// A copy of `layer`: its rows, its eviction state (EvictionPolicy::save_layer()) and its host
  /// tier, for restore_layer(). Speculative decoding that must undo everything a draft did to a
  /// layer (its tokens, its queries' scores, the passes and recalls it caused), where
  /// truncate() keeps the scores: save, run the drafts, restore, run the accepted ones again.
  ///
  /// Allocates a copy of the layer (its buffers, state and tier: about the layer's share of
  /// CacheStats::bytes_allocated, and the tier's); changes nothing. No host sync, except with a
  /// tier on a GPU (the copy waits for the kernels that write its pinned rows).
  /// \throws c10::IndexError for a bad layer; c10::Error while an observation is open on it, on
  ///         a moved-from cache, or on an allocation failure.
  LayerSave save_layer(int64_t layer) const;

  /// Makes `layer` as it was when `save` was made from it (rows, eviction state, tier); `save`
  /// is used up. Allocates nothing; no host sync.
  /// \throws c10::IndexError for a bad layer; c10::Error, changing nothing, if `save` was not
  ///         made from this layer of a cache like this one (buffers, batch size, capacity, host
  ///         tier), or was used already, an observation is open on the layer, reset(), finish(),
  ///         add_sequence() or truncate() ran since the save, or reserve() raised the slots since
  ///         (EvictionPolicy::restore_layer()).
  void restore_layer(int64_t layer, LayerSave&& save);

  /// Makes room for `tokens` tokens per row in every layer (tokens + 1 slots: the last is the
  /// trash slot), and never shrinks below that afterwards: appends that fit never move the
  /// buffers, so CUDA graphs captured after this call stay valid.
  /// \throws c10::ValueError if tokens is out of range; c10::Error naming reserve, the layer and
  ///         the sizes if they cannot be allocated. Nothing changes then.
  void reserve(int64_t tokens) {
    host_heap("reserve", [&] { check_not_moved("reserve"); reserve_slots(tokens); });
  }

  /// Makes the host tier hold its whole budget (tier_tokens per row) and page digests for
  /// positions below `positions` in every layer, so that passes and recall allocate no tier
  /// storage until a position reaches it: CUDA graphs captured after this call (and reserve())
  /// stay valid. The tensor path only (pinned host rows, device metadata: CacheStats'
  /// tier_bytes and tier_device_bytes show them); nothing on the host path, whose tier grows
  /// as it fills. Otherwise the tier grows geometrically as it fills and as positions grow.
  /// \throws c10::ValueError if positions is out of range; c10::Error if there is no tier or
  ///         the memory cannot be allocated. Nothing changes then.
  void reserve_tier(int64_t positions);

 private:
  void truncate_rows(int64_t row, int64_t k);

  /// finish(row) or reset(row) (`end`: the policy's, which checks the row), the row's tier
  /// tokens released in every layer in the same commit: on the tensor path before the policy's
  /// step, so that a throw of it puts them back; on the host path after it (its release
  /// allocates nothing and does not throw).
  template <class End>
  void end_row(int64_t row, const char* call, End&& end);

  void reserve_slots(int64_t tokens);

 protected:
  /// `tier_tokens`: the host tier's budget per row and layer (0: no tier);
  /// `tier_page_size`: its digests' page size; `tier_scoring`: how recall() scores the pages.
  CacheBase(Policy policy, std::vector<BufferSpec> specs, at::ScalarType dtype, int64_t tier_tokens = 0,
            int64_t tier_page_size = 16, TierScoring tier_scoring = TierScoring::kPerHead)
      : policy_(std::move(policy)), specs_(std::move(specs)), dtype_(dtype), tier_tokens_(tier_tokens) {
    allocating([&] {
      for (int64_t l = 0; l < num_layers(); ++l) buffers_.push_back(allocate(policy_.base_slots(l)));
      live_views_.resize(buffers_.size());
      if (tier_tokens_ > 0) {
        tiers_ = layer_tiers(specs_, dtype_, num_layers(), batch_size(), tier_tokens_, Policy::W, tier_page_size,
                             tier_scoring, policy_.host_path(), device());
      }
    }, [&](const std::string& why) { fail_allocation(why); });
  }


  /// Appends the rows of a chunk: row b's tokens are its last counts[b] columns (all T when
  /// `counts` is empty: every active row appends T, free rows 0). Returns views over slots
  /// [0, size(layer)) of every buffer. All or nothing, in four steps: plan_append() checks,
  /// allocate_append() allocates (the growth last), write_append() writes the rows where no
  /// caller looks yet, commit_append() commits under its undo.
  std::vector<at::Tensor> append(int64_t layer, std::vector<at::Tensor> rows, at::IntArrayRef counts);

  /// An append as its steps see it: plan_append() fills the sizes, allocate_append() the rest.
  struct AppendPlan {
    int64_t T = 0;                       // columns of the chunk
    bool grow = false;                   // a row needs more slots: new buffers and state
    int64_t slots = 0;                   // slots per row after the append
    int64_t width = 0;                   // size(layer) after the append
    std::vector<at::Tensor> src;         // what the writes read
    at::Tensor map;                      // tensor path: [B, T] slots on the device, pads on the (new) trash slot
    std::vector<at::Tensor> grown_bufs;  // grow: the layer's new buffers
    typename Steps::Grown grown_state;   // grow: the layer's new eviction state
  };

  /// append(), its checks: the rows, the counts (into counts_), the room, the keys. Changes
  /// nothing but counts_.
  AppendPlan plan_append(int64_t layer, const std::vector<at::Tensor>& rows, at::IntArrayRef counts);

  /// append(), everything that allocates: the rows to read, the tensor path's slot map and
  /// device tensors, then the growth last (buffers and state made apart). A throw changes
  /// nothing; the steps after it allocate nothing on the host path.
  void allocate_append(int64_t layer, std::vector<at::Tensor>& rows, AppendPlan& u);

  /// append(), the path's write: the rows go to slots past each row's length of `target` (the
  /// layer's buffers, or the grown ones): nothing a caller sees changes.
  void write_append(int64_t layer, std::vector<at::Tensor>& target, const AppendPlan& u);

  /// append(), the commit: swaps and host counters (the host path allocates nothing here); the
  /// tensor path's state writes are LibTorch in-place ops under an undo log (see the class
  /// comment): a grown layer swaps back, else the new slots' positions go back to -1.
  void commit_append(int64_t layer, AppendPlan& u);

  /// An allocation failure of append() (`why`), named. \throws c10::Error.
  [[noreturn]] void fail_append(int64_t layer, int64_t T, const std::string& why) const;

  /// With observation checks on (check_observations; default on CPU): every real (not pad) key
  /// column of an append must be finite, or every later attend on the layer would fail its
  /// checks. \throws c10::ValueError naming the buffer, the index, the layer, the row and the
  /// position of the first non-finite key. The host's loop allocates nothing; a device's rows
  /// are reduced to [B, T] on the device and read (one sync, as every check there).
  void check_finite_keys(int64_t layer, const std::vector<at::Tensor>& rows, int64_t T) const;

  /// The views over slots [0, width) of `bufs` (the buffers of `layer`, or the ones replacing
  /// them): the cached ones while they still match, else new ones. Allocates; changes nothing.
  LiveViews views_over(int64_t layer, const std::vector<at::Tensor>& bufs, int64_t width) const {
    if (live_views_[layer].match(specs_, bufs, width)) return live_views_[layer];
    return LiveViews::over(specs_, bufs, width);
  }

  /// Views over slots [0, size(layer)) of every buffer of `layer` (real views: they share the
  /// buffer's version counter, so autograd sees a later in-place move).
  /// The views are made once per (layer, width, buffers) and handed out again while those stay:
  /// in the decode steady state every step asks for the same width, and a narrow() costs a few
  /// microseconds of dispatch on CPU.
  std::vector<at::Tensor> live(int64_t layer) const {
    const int64_t S = size(layer);
    auto& cached = live_views_[layer];
    if (!cached.match(specs_, buffers_[layer], S)) cached = LiveViews::over(specs_, buffers_[layer], S);
    return cached.views;
  }

  /// Position-sorted copies of every buffer of `layer`, then the sorted positions [B, S]
  /// (slots past a row's length last, position -1).
  std::vector<at::Tensor> ordered_buffers(int64_t layer) const {
    const auto pos = positions(layer);
    const auto key = at::where(pos.ge(0), pos, at::full({}, std::numeric_limits<int64_t>::max(), pos.options()));
    const auto order = std::get<1>(at::sort(key, /*dim=*/1));
    std::vector<at::Tensor> out;
    const auto views = live(layer);
    for (size_t i = 0; i < specs_.size(); ++i) {
      const auto& view = views[i];
      std::vector<int64_t> shape(view.dim(), 1);
      shape[0] = batch_size();
      shape[token_dim(i)] = view.size(token_dim(i));
      out.push_back(view.gather(token_dim(i), order.view(shape).expand(view.sizes())));
    }
    out.push_back(pos.gather(1, order));
    return out;
  }

  int64_t token_dim(size_t i) const { return specs_[i].token_dim(); }

  /// What every layout's recall checks at its public call past the layout's shapes, naming
  /// `call` (e.g. "recall"), once (recall's stages trust what it checked: RecallInput): a tier,
  /// the layer, no open observation, scale finite and > 0, tokens and rescore in [0, 2^40], a
  /// two-level rescore (> tokens) of at least one page (tier_page_size), and, with observation
  /// checks on (core.check: the CPU's default), every row's real query columns of `query` [B,
  /// H, Q, D] finite (as in observe(), pads and free rows may hold anything): one read of the
  /// device. With checks off (CUDA's default) the queries are not read: a row whose real
  /// queries are not finite gets NaN page scores and recalls nothing (the picks take only
  /// scores > 0). Throws c10::Error.
  void check_recall(const char* call, int64_t layer, const at::Tensor& query, double scale, int64_t tokens,
                    int64_t rescore) const;

  /// Recall (the layouts' recall()): scores every row's tier pages with `query` [B, H, Q,
  /// key width] (fp32, contiguous, on the cache's device; checked by check_recall() and the
  /// layout, as are the other arguments: they become recall's RecallInput), reduces the
  /// scores across processes like observations, and swaps the best pages' tokens (at most
  /// `tokens` per row: whole pages, or with rescore > tokens the best tokens of the best pages
  /// up to `rescore` tokens, scored again exactly) with the row's lowest-ranked heavy hitters.
  /// Returns the tokens recalled per row ([B] int64 on the cache's device). On the host path
  /// everything that allocates or throws comes before the first swap; on the tensor path the
  /// swap's writes run under an undo log.
  at::Tensor recall_rows(int64_t layer, const at::Tensor& query, double scale, int64_t tokens, int64_t rescore);

 private:
  /// The tier of `layer`, after checking `layer` and `row` and that there is a tier (`call`: the read).
  const LayerTier& tier(const char* call, int64_t layer, int64_t row) const {
    check_not_moved(call);
    policy_.size(layer, row);  // checks both
    KVEVICT_CHECK(tier_tokens_ > 0, call, ": this cache has no host tier (tier_tokens is 0 in its options)");
    return tiers_[layer];
  }

  /// Set in a cache moved from (its move leaves it holding nothing); false in one moved to.
  struct MovedFrom {
    bool value = false;
    MovedFrom() = default;
    MovedFrom(MovedFrom&& o) noexcept : value(o.value) { o.value = true; }
    MovedFrom& operator=(MovedFrom&& o) noexcept {
      if (this != &o) {
        value = o.value;
        o.value = true;
      }
      return *this;
    }
  };

  /// \throws c10::Error naming `call` if this cache was moved from.
  void check_not_moved(const char* call) const {
    KVEVICT_CHECK(!moved_.value, call, ": this cache was moved from (its buffers and eviction state went to the cache "
                  "it was moved to); use that one, or assign a new cache to this one");
  }

  [[noreturn]] void fail_allocation(const std::string& why) const {
    KVEVICT_CHECK(false, "could not allocate the cache buffers: num_layers=", num_layers(), ", batch_size=",
                  batch_size(), ", num_heads=", num_heads(), ", ", policy_.base_slots(0),
                  " slots per row in layer 0 (capacity + evict_every), dtype ", dtype_, " on ", device(), ": ", why);
    throw;  // not reached
  }

  /// New buffers of one layer with `slots` slots per row (allocate_buffers()).
  std::vector<at::Tensor> allocate(int64_t slots) const {
    return allocate_buffers(specs_, batch_size(), slots, at::TensorOptions().dtype(dtype_).device(device()));
  }

  /// "batch_size=B, num_heads=H, <bytes> bytes per slot and row, dtype D on device", for messages.
  std::string sizes_str() const {
    return c10::str("batch_size=", batch_size(), ", num_heads=", num_heads(), ", ", bytes_per_slot(specs_, dtype_),
                    " bytes per slot and row, dtype ", dtype_, " on ", device());
  }

  /// allocate(), an allocation failure named: "<what>: could not allocate the buffers of layer
  /// <layer> ... from <slots(layer)> to <slots> slots per row (sizes)".
  std::vector<at::Tensor> allocate_named(int64_t layer, int64_t slots, const char* what) const {
    std::vector<at::Tensor> out;
    allocating([&] { out = allocate(slots); }, [&](const std::string& why) {
      KVEVICT_CHECK(false, what, ": could not allocate the buffers of layer ", layer, " resized from ",
                    this->slots(layer), " to ", slots, " slots per row (", sizes_str(), "): ", why);
    });
    return out;
  }

  /// New buffers of `layer` with `slots` slots per row holding its live rows (allocates; changes
  /// nothing). `what` names the public call in an allocation failure's message.
  std::vector<at::Tensor> resized_buffers(int64_t layer, int64_t slots, const char* what) const {
    auto fresh = allocate_named(layer, slots, what);
    const int64_t S = size(layer);
    if (S > 0) {
      c10::InferenceMode normal_tensors(false);
      for (size_t i = 0; i < specs_.size(); ++i) {
        fresh[i].narrow(token_dim(i), 0, S).copy_(buffers_[layer][i].narrow(token_dim(i), 0, S));
      }
    }
    return fresh;
  }

  /// Gives `layer` `slots` slots per row, keeping the live rows; all or nothing. `what` names
  /// the public call in an allocation failure's message.
  void resize(int64_t layer, int64_t slots, const char* what) {
    auto fresh = resized_buffers(layer, slots, what);
    policy_.resize_slots(layer, slots, what);  // may throw: then the fresh buffers are dropped
    buffers_[layer] = std::move(fresh);
    live_views_[layer] = LiveViews{};
  }

  /// compress_prompt() without a tier, after appending the kept tokens to the empty `layer`:
  /// EvictionPolicy's place_prompt() (prompt positions `keep` [B, n], seen tokens T, the T - n
  /// dropped tokens counted as evicted).
  void place_prompt(int64_t layer, const at::Tensor& keep, int64_t T) { steps().place_prompt(layer, keep, T); }

  /// What compress_prompt() takes before its append into the empty `layer`: the layer's buffers
  /// and eviction state as they are (handles, no copy; allocates host vectors), which
  /// clear_layer() puts back if the append grew them.
  struct LayerBefore {
    std::vector<at::Tensor> buffers;
    typename Steps::Grown state;
  };
  LayerBefore layer_before(int64_t layer) const {
    return {buffers_.at(layer), steps().current(steps().at(layer), layer)};
  }

  /// compress_prompt()'s undo when a step after its append throws: empties `layer` (empty before
  /// that append) and gives back the slots the append grew, by swapping the layer's own buffers
  /// and state back (`before`, from layer_before()): no allocation, so even a heap that stays
  /// exhausted leaves the layer at its usual size.
  /// The tensor path's clear (fills) may throw: the layer then keeps its grown buffers, consistent.
  void clear_layer(int64_t layer, LayerBefore& before) {
    steps().clear_layer(layer);
    auto& L = steps().at(layer);
    if (L.slots != before.state.state.slots) {  // the append grew the layer: its own buffers and state back
      buffers_[layer].swap(before.buffers);
      steps().swap_back(layer, before.state);
      live_views_[layer] = LiveViews{};
    }
    shrink_if_fits(layer);
  }

  /// Gives back the slots grown by long appends once every row of `layer` fits in
  /// base_slots(layer): shrinks to max(base_slots, the layer's hold) slots. Never throws: keeping
  /// the larger buffers is correct too (the next pass tries again).
  void shrink_if_fits(int64_t layer) {
    const int64_t base = policy_.base_slots(layer);
    const int64_t floor = std::max(base, hold_.empty() ? int64_t{0} : hold_[layer]);
    if (slots(layer) > floor && size(layer) <= base - 1) {  // rows fit next to the trash slot
      try {
        resize(layer, floor, "evict");
      } catch (const c10::Error&) {
      } catch (const std::exception&) {  // a host-heap failure (std::bad_alloc): the same
      }
    }
  }

  /// hold() for GrowthHold: grows `layer` to `slots` slots per row now where it has fewer (all or
  /// nothing, `what` naming the call) and keeps shrink_if_fits() from going below them.
  void hold(int64_t layer, int64_t slots, const char* what) {
    if (this->slots(layer) < slots) resize(layer, slots, what);  // all or nothing
    if (hold_.empty()) hold_.assign(static_cast<size_t>(num_layers()), 0);
    hold_.at(static_cast<size_t>(layer)) = slots;
  }
  /// Ends hold(): the layer shrinks back to base_slots if every row fits. Never throws.
  void release_hold(int64_t layer) noexcept {
    hold_[static_cast<size_t>(layer)] = 0;
    shrink_if_fits(layer);
  }

 public:
  /// What prefill.hpp runs on a cache beyond its public calls (GrowthHold, compress_prompt()'s
  /// PromptPress), by name: internal, not for users. Each forwards to the cache's private step
  /// of the same name (see there).
  class PrefillSteps {
   public:
    explicit PrefillSteps(CacheBase& cache) noexcept : cache_(cache) {}
    void hold(int64_t layer, int64_t slots, const char* what) { cache_.hold(layer, slots, what); }
    void release_hold(int64_t layer) noexcept { cache_.release_hold(layer); }
    LayerBefore layer_before(int64_t layer) const { return cache_.layer_before(layer); }
    void place_prompt(int64_t layer, const at::Tensor& keep, int64_t T) { cache_.place_prompt(layer, keep, T); }
    void clear_layer(int64_t layer, LayerBefore& before) { cache_.clear_layer(layer, before); }

   private:
    CacheBase& cache_;
  };
  /// The steps prefill.hpp runs (PrefillSteps): internal, not for users.
  PrefillSteps prefill_steps() noexcept { return PrefillSteps(*this); }

 private:
  Policy policy_;
  std::vector<BufferSpec> specs_;
  at::ScalarType dtype_;
  int64_t tier_tokens_ = 0;
  std::vector<LayerTier> tiers_;  // per layer, with a tier
  std::vector<std::vector<at::Tensor>> buffers_;  // [layer][spec]: [B, outer..., slots, inner]
  mutable std::vector<LiveViews> live_views_;  // per layer: the views live() handed out last
  std::vector<int64_t> hold_;                     // per layer: shrink no lower (GrowthHold); empty: none
  at::Tensor move_rows_;                          // tensor path: [B, 1] row indices of the moves (made once)
  Pass pass_;                                     // the pass being applied (scratch, reused)
  std::vector<int64_t> counts_;                   // the current append's counts (scratch)
  MovedFrom moved_;                               // set by a move out of this cache
};

}  // namespace detail
}  // namespace kvevict

// The longer members, defined out of the class.
#include <kvevict/detail/cache/append.hpp>
#include <kvevict/detail/cache/recall.hpp>
#include <kvevict/detail/cache/sequences.hpp>
