#pragma once
// The storage and bookkeeping shared by every cache layout: per-layer slot buffers, fp32
// scores, int64 positions, and the eviction pass that fills freed slots from the tail.
// A layout (MlaCache, ...) names its buffers and checks its own inputs; everything else is here.

#include <kvevict/check.hpp>
#include <kvevict/eviction_policy.hpp>

#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace kvevict {

/// Counters of one layer or, summed, of a whole cache.
struct CacheStats {
  /// Eviction passes that removed at least one token (one per pass and layer, whatever B).
  int64_t eviction_events = 0;
  /// Tokens each batch row lost (every row loses the same number per pass).
  int64_t tokens_evicted_per_row = 0;
  /// Bytes held by all buffers: K/V (or ckv/kpe) data plus fp32/int64 bookkeeping.
  int64_t bytes_allocated = 0;
};

namespace detail {

/// Test hook: when true, caches built afterwards use the tensor-op path on CPU too (the path
/// CUDA always takes), so one CPU machine can test both paths against the same oracle.
inline bool& force_tensor_path() {
  static bool force = false;
  return force;
}

/// True when `t` is defined and has exactly the sizes `expected` (-1 matches any size). The
/// allocation-free test in front of check_shape(), which builds its message arguments.
inline bool has_shape(const at::Tensor& t, std::initializer_list<int64_t> expected) {
  if (!t.defined() || t.dim() != static_cast<int64_t>(expected.size())) return false;
  int64_t d = 0;
  for (const int64_t e : expected) {
    if (e >= 0 && t.size(d) != e) return false;
    ++d;
  }
  return true;
}

/// `base.narrow(dim, 0, length)`, built directly on base's storage: no dispatcher, no autograd
/// view record. On CPU (LibTorch 1.13) a narrow() costs 1.5-3 us of dispatch, which made the
/// views update() returns most of a small decode step; this costs ~0.2 us. The result shares
/// base's storage, strides and offset; it is not registered as an autograd view of base (the
/// cache's buffers never require grad).
inline at::Tensor prefix_view(const at::Tensor& base, int64_t dim, int64_t length) {
  at::DimVector sizes(base.sizes().begin(), base.sizes().end());
  sizes[dim] = length;
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_storage_offset(base.storage_offset());
  impl->set_sizes_and_strides(sizes, base.strides());
  return at::Tensor(std::move(impl));
}

/// One per-token buffer of a layout: shape [B, outer..., slots, inner].
struct BufferSpec {
  std::string name;                    // argument name, e.g. "k_new"
  std::vector<int64_t> outer;          // dims between batch and token, e.g. {H}; {} for latent
  int64_t inner;                       // row width, e.g. 192
  std::vector<std::string> dim_names;  // for messages, e.g. {"B", "H", "T", "qk_dim"}
};

/// Per-layer slot storage plus the contract's bookkeeping; the base of every cache layout.
/// Live tokens of a layer fill slots [0, size) of every row.
///
/// CUDA graphs: with check_finite off, a steady-state step (update of one token, observe,
/// evict) has static shapes and no host sync, so it can be captured and replayed. Replays
/// advance everything on the device (rows, positions, scores; positions come from a device-side
/// counter), but not the host-side counters: seen_tokens() and stats() keep their values from
/// the capture.
template <class Policy>
class SlotCache {
 public:
  using policy_type = Policy;
  using scorer_type = typename Policy::scorer_type;

  /// A cache owns its buffers: copying would alias them, so only moves are allowed.
  SlotCache(const SlotCache&) = delete;
  SlotCache& operator=(const SlotCache&) = delete;
  SlotCache(SlotCache&&) noexcept = default;
  SlotCache& operator=(SlotCache&&) noexcept = default;

  /// Capacity n_sink + budget + n_recent: tokens per row after an eviction pass.
  int64_t capacity() const noexcept { return policy_.capacity(); }
  int64_t num_layers() const noexcept { return static_cast<int64_t>(layers_.size()); }
  int64_t batch_size() const noexcept { return batch_; }
  int64_t num_heads() const noexcept { return heads_; }
  at::ScalarType dtype() const noexcept { return dtype_; }
  at::Device device() const noexcept { return device_; }
  const Policy& policy() const noexcept { return policy_; }

  /// Live tokens per row in `layer`. \throws c10::IndexError for a bad layer.
  int64_t size(int64_t layer) const { return at(layer).size; }
  /// Tokens ever appended to `layer`: the next token's position. \throws c10::IndexError.
  int64_t seen_tokens(int64_t layer) const { return at(layer).seen; }
  /// Slots allocated per row in `layer` (capacity + evict_every, grown by long appends).
  int64_t slots(int64_t layer) const { return at(layer).slots; }

  /// [B, size] int64 original position of each live slot, a view in slot order (not sorted;
  /// see ordered()). On the cache's device. Invalidated by the next update/evict.
  at::Tensor positions(int64_t layer) const {
    const auto& L = at(layer);
    return prefix_view(L.position, 1, L.size);
  }

  /// [B, size] fp32 ranking scores in slot order (a copy): the accumulated score, or for
  /// MeanObservedAttention the sum divided by the observation count (0 if never observed).
  at::Tensor scores(int64_t layer) const {
    const auto& L = at(layer);
    return rank_scores(L).clone();
  }

  /// Feeds attention probabilities of the newest Q tokens to the scorer (docs/DESIGN.md, Scorers).
  ///
  /// \param probs  [B, H, Q, S] attention probabilities, any floating dtype, cache device;
  ///               S = size(layer), slot order (as update()/positions() return them),
  ///               1 <= Q <= S, query q at position seen_tokens - Q + q.
  /// \throws c10::Error on a bad layer, shape, dtype or device, or (with check_finite) a
  ///         non-finite score; the cache is unchanged. With check_finite on CUDA: one host sync.
  void observe(int64_t layer, const at::Tensor& probs) {
    auto& L = at(layer);
    if (!has_shape(probs, {batch_, heads_, -1, L.size})) {
      check_shape(probs, "attention probs", {batch_, heads_, -1, L.size}, {"B", "H", "Q", "S"},
                  "[B, H, Q, S] with S = live tokens of the layer");
    }
    check_floating(probs, "attention probs");
    check_device(probs, "attention probs", device_);
    const int64_t Q = probs.size(2);
    KVEVICT_CHECK(Q >= 1 && Q <= L.size, "attention probs: Q must be in [1, ", L.size, "], got ", Q);
    accumulate(L, probs, /*direct=*/false);
  }

  /// Adds caller-computed per-token importance, as if one query whose head-mean attention is
  /// `scores` had been observed (CumulativeAttention adds it, MeanObservedAttention adds it
  /// and counts one observation, LatestAttention replaces the score with it).
  ///
  /// \param scores  [B, S] any floating dtype, cache device, S = size(layer), slot order.
  /// \throws c10::Error as observe(); the cache is unchanged.
  void add_scores(int64_t layer, const at::Tensor& scores) {
    auto& L = at(layer);
    if (!has_shape(scores, {batch_, L.size})) {
      check_shape(scores, "scores", {batch_, L.size}, {"B", "S"}, "[B, S] with S = live tokens of the layer");
    }
    check_floating(scores, "scores");
    check_device(scores, "scores", device_);
    accumulate(L, scores, /*direct=*/true);
  }

  /// Runs an eviction pass on `layer` if it holds more than capacity() tokens and at least
  /// evict_every update() calls happened since the last pass (or construction); else a no-op.
  /// Keeps sinks, recent window and top-`budget` heavy hitters per row (EvictionPolicy), then
  /// moves at most one tail row into each freed slot: live tokens fill [0, capacity()).
  ///
  /// \return tokens evicted per row (0 if no pass ran).
  /// \throws c10::IndexError for a bad layer.
  /// \note CPU: no allocation. CUDA: tensor ops only, no host sync, static shapes.
  int64_t evict(int64_t layer) {
    auto& L = at(layer);
    const int64_t cap = capacity();
    if (L.size <= cap || L.updates_since_pass < policy_.options().evict_every()) return 0;
    const int64_t n = L.size - cap;
    if (fast_) {
      evict_cpu(L, n);
    } else {
      evict_tensor(L, n);
    }
    L.size = cap;
    L.updates_since_pass = 0;
    L.events += 1;
    L.evicted_per_row += n;
    return n;
  }

  /// Counters of one layer. \throws c10::IndexError for a bad layer.
  CacheStats stats(int64_t layer) const {
    const auto& L = at(layer);
    return {L.events, L.evicted_per_row, layer_bytes(L)};
  }
  /// Counters summed over layers.
  CacheStats stats() const {
    CacheStats s;
    for (const auto& L : layers_) {
      s.eviction_events += L.events;
      s.tokens_evicted_per_row += L.evicted_per_row;
      s.bytes_allocated += layer_bytes(L);
    }
    return s;
  }

  /// Empties every layer for a new sequence (positions restart at 0); keeps the buffers.
  void reset() {
    for (auto& L : layers_) {
      L.size = L.seen = L.updates_since_pass = L.events = L.evicted_per_row = 0;
      L.seen_device.zero_();
    }
  }

 protected:
  struct Layer {
    std::vector<at::Tensor> data;  // per BufferSpec: [B, outer..., slots, inner]
    at::Tensor score;              // [B, slots] fp32 accumulated score
    at::Tensor count;              // [B, slots] fp32 observed-query count (kPerObservation only)
    at::Tensor position;           // [B, slots] int64 original positions
    at::Tensor seen_device;        // [1] int64 seen tokens on the device (tensor path)
    at::Tensor contribution;       // [B, slots] fp32 scratch: one observation, before it is applied
    std::vector<Candidate> candidates;   // CPU selection scratch
    std::vector<int64_t> evicted;        // CPU selection scratch
    std::vector<uint8_t> tail_evicted;   // CPU compaction scratch
    int64_t slots = 0, size = 0, seen = 0, updates_since_pass = 0, events = 0, evicted_per_row = 0;
  };

  SlotCache(int64_t num_layers, int64_t batch, int64_t heads, std::vector<BufferSpec> specs,
            at::ScalarType dtype, at::Device device, bool check_finite, Policy policy)
      : policy_(std::move(policy)), specs_(std::move(specs)), batch_(batch), heads_(heads), dtype_(dtype),
        device_(resolved(device)), check_finite_(check_finite),
        fast_(device.is_cpu() && !force_tensor_path()), layers_(num_layers) {
    const int64_t initial = capacity() + policy_.options().evict_every();
    try {
      for (auto& L : layers_) {
        L.seen_device = at::zeros({1}, at::TensorOptions().dtype(at::kLong).device(device_));
        grow(L, initial);
      }
    } catch (const c10::Error& e) {
      KVEVICT_CHECK(false, "could not allocate ", num_layers, " layer(s) of capacity + evict_every = ", initial,
                    " slots per row (n_sink=", policy_.options().n_sink(), ", budget=", policy_.options().budget(),
                    ", n_recent=", policy_.options().n_recent(), ", evict_every=", policy_.options().evict_every(),
                    ") on ", device_, ": ", e.what_without_backtrace());
    }
  }

  /// The device tensors made on `device` report: "cuda" becomes the current "cuda:N", and
  /// "cpu:0" becomes "cpu", so device checks compare like with like.
  /// \throws c10::Error naming the device if no tensor can be made there (e.g. CUDA without a
  ///         CUDA build of LibTorch or without a GPU).
  static at::Device resolved(const at::Device& device) {
    try {
      return at::empty({0}, at::TensorOptions().device(device)).device();
    } catch (const c10::Error& e) {
      KVEVICT_CHECK(false, "options: device ", device, " is not usable here (", e.what_without_backtrace(), ")");
    }
    return device;  // not reached
  }

  /// \throws c10::IndexError unless 0 <= layer < num_layers.
  Layer& at(int64_t layer) {
    KVEVICT_CHECK_INDEX(layer >= 0 && layer < num_layers(), "layer must be in [0, ", num_layers(), "), got ", layer);
    return layers_[layer];
  }
  const Layer& at(int64_t layer) const { return const_cast<SlotCache*>(this)->at(layer); }

  /// Checks new rows against the specs (shape, same T, dtype, device); returns T.
  int64_t check_rows(const std::vector<at::Tensor>& rows) const {
    if (rows_ok(rows)) return rows[0].size(token_dim(0));  // the common case: no message built
    int64_t T = -1;
    for (size_t i = 0; i < specs_.size(); ++i) {
      const auto& spec = specs_[i];
      std::vector<int64_t> dims{batch_};
      dims.insert(dims.end(), spec.outer.begin(), spec.outer.end());
      dims.push_back(T);
      dims.push_back(spec.inner);
      std::string doc = "[";
      for (size_t d = 0; d < spec.dim_names.size(); ++d) doc += (d ? ", " : "") + spec.dim_names[d];
      doc += "]";
      auto names = spec.dim_names;
      check_shape(rows[i], spec.name.c_str(), dims, names, doc.c_str());
      const int64_t t = rows[i].size(static_cast<int64_t>(spec.outer.size()) + 1);
      KVEVICT_CHECK(t >= 1, spec.name, " must hold at least one token, got T = 0");
      if (T < 0) T = t;
      KVEVICT_CHECK_TYPE(rows[i].scalar_type() == dtype_, spec.name, " must have the cache's dtype ", dtype_,
                         ", got ", rows[i].scalar_type());
      check_device(rows[i], spec.name.c_str(), device_);
    }
    return T;
  }

  /// What check_rows() checks, without building its messages: true when it would pass.
  bool rows_ok(const std::vector<at::Tensor>& rows) const {
    int64_t T = -1;
    for (size_t i = 0; i < specs_.size(); ++i) {
      const auto& t = rows[i];
      const auto& outer = specs_[i].outer;
      const int64_t tdim = token_dim(i);
      if (!t.defined() || t.dim() != tdim + 2 || t.scalar_type() != dtype_ || t.device() != device_) return false;
      if (t.size(0) != batch_ || t.size(tdim + 1) != specs_[i].inner) return false;
      for (size_t o = 0; o < outer.size(); ++o) {
        if (t.size(static_cast<int64_t>(o) + 1) != outer[o]) return false;
      }
      if (T < 0) T = t.size(tdim);
      if (T < 1 || t.size(tdim) != T) return false;
    }
    return true;
  }

  /// Appends T checked tokens (rows as in check_rows); returns views over slots [0, size) of
  /// every buffer.
  std::vector<at::Tensor> append(int64_t layer, const std::vector<at::Tensor>& rows) {
    at::NoGradGuard no_grad;  // inputs that require grad must not tie the buffers to a graph
    auto& L = at(layer);
    const int64_t T = check_rows(rows);
    if (L.size + T > L.slots) grow(L, std::max(L.size + T, 2 * L.slots));
    if (fast_) {
      for (size_t i = 0; i < specs_.size(); ++i) copy_rows_cpu(L, i, rows[i], T);
      auto* pos = L.position.template data_ptr<int64_t>();
      auto* score = L.score.template data_ptr<float>();
      auto* count = L.count.defined() ? L.count.template data_ptr<float>() : nullptr;
      for (int64_t b = 0; b < batch_; ++b) {
        for (int64_t t = 0; t < T; ++t) {
          const int64_t slot = b * L.slots + L.size + t;
          pos[slot] = L.seen + t;
          score[slot] = 0.f;
          if (count) count[slot] = 0.f;
        }
      }
    } else {
      for (size_t i = 0; i < specs_.size(); ++i) L.data[i].narrow(token_dim(i), L.size, T).copy_(rows[i]);
      L.position.narrow(1, L.size, T)
          .copy_(at::arange(T, L.position.options()).add(L.seen_device).expand({batch_, T}));
      L.score.narrow(1, L.size, T).zero_();
      if (L.count.defined()) L.count.narrow(1, L.size, T).zero_();
      L.seen_device.add_(T);
    }
    L.size += T;
    L.seen += T;
    L.updates_since_pass += 1;
    return live(L);
  }

  /// CPU: copies the T new rows of buffer `i` (checked) into slots [size, size + T) of every
  /// [B, outer...] group. Rows are read in place whenever each is contiguous (stride 1 in the
  /// last dim), so a v_new narrowed from a wider projection or a transposed prefill chunk costs
  /// no temporary copy (and no allocation); other layouts go through contiguous() first.
  void copy_rows_cpu(Layer& L, size_t i, const at::Tensor& rows, int64_t T) {
    const int64_t tdim = token_dim(i);
    const auto src = rows.stride(tdim + 1) == 1 ? rows : rows.contiguous();
    const auto sizes = src.sizes();
    const auto strides = src.strides();
    const int64_t elem = src.element_size(), row_bytes = specs_[i].inner * elem;
    const bool packed = T == 1 || strides[tdim] == specs_[i].inner;  // the T rows are back to back
    const auto* s = static_cast<const char*>(src.data_ptr());
    auto* d = static_cast<char*>(L.data[i].data_ptr());
    const int64_t groups = batch_ * outer_numel(i);
    for (int64_t g = 0; g < groups; ++g) {
      int64_t offset = 0, rest = g;  // element offset of group g in src: g over dims [0, tdim)
      for (int64_t dim = tdim - 1; dim >= 0; --dim) {
        offset += rest % sizes[dim] * strides[dim];
        rest /= sizes[dim];
      }
      char* dst = d + (g * L.slots + L.size) * row_bytes;
      if (packed) {
        std::memcpy(dst, s + offset * elem, T * row_bytes);
      } else {
        for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * row_bytes, s + (offset + t * strides[tdim]) * elem, row_bytes);
      }
    }
  }

  /// Views over slots [0, size) of every buffer of `layer`.
  std::vector<at::Tensor> live(const Layer& L) const {
    std::vector<at::Tensor> out;
    out.reserve(specs_.size());
    for (size_t i = 0; i < specs_.size(); ++i) out.push_back(prefix_view(L.data[i], token_dim(i), L.size));
    return out;
  }

  /// Position-sorted copies of every buffer of `layer`, then the sorted positions [B, S].
  std::vector<at::Tensor> ordered_buffers(int64_t layer) const {
    const auto& L = at(layer);
    auto sorted = at::sort(positions(layer), /*dim=*/1);
    const auto& order = std::get<1>(sorted);
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < specs_.size(); ++i) {
      const auto view = L.data[i].narrow(token_dim(i), 0, L.size);
      std::vector<int64_t> shape(view.dim(), 1);
      shape[0] = batch_;
      shape[token_dim(i)] = L.size;
      out.push_back(view.gather(token_dim(i), order.view(shape).expand(view.sizes())));
    }
    out.push_back(std::get<0>(sorted));
    return out;
  }

  int64_t token_dim(size_t i) const { return static_cast<int64_t>(specs_[i].outer.size()) + 1; }
  int64_t outer_numel(size_t i) const {
    int64_t n = 1;
    for (auto d : specs_[i].outer) n *= d;
    return n;
  }

 private:
  using Scorer = scorer_type;

  /// Reallocates `L`'s buffers with `slots` slots per row, keeping the live tokens.
  void grow(Layer& L, int64_t slots) {
    at::NoGradGuard no_grad;  // inputs that require grad must not tie the buffers to a graph
    const auto fopts = at::TensorOptions().dtype(at::kFloat).device(device_);
    Layer N;
    for (size_t i = 0; i < specs_.size(); ++i) {
      std::vector<int64_t> shape{batch_};
      shape.insert(shape.end(), specs_[i].outer.begin(), specs_[i].outer.end());
      shape.push_back(slots);
      shape.push_back(specs_[i].inner);
      N.data.push_back(at::zeros(shape, fopts.dtype(dtype_)));
      if (L.size) N.data[i].narrow(token_dim(i), 0, L.size).copy_(L.data[i].narrow(token_dim(i), 0, L.size));
    }
    N.score = at::zeros({batch_, slots}, fopts);
    N.position = at::zeros({batch_, slots}, fopts.dtype(at::kLong));
    N.contribution = at::zeros({batch_, slots}, fopts);
    if (Scorer::kPerObservation) N.count = at::zeros({batch_, slots}, fopts);
    if (L.size) {
      N.score.narrow(1, 0, L.size).copy_(L.score.narrow(1, 0, L.size));
      N.position.narrow(1, 0, L.size).copy_(L.position.narrow(1, 0, L.size));
      if (N.count.defined()) N.count.narrow(1, 0, L.size).copy_(L.count.narrow(1, 0, L.size));
    }
    L.data = std::move(N.data);
    L.score = N.score;
    L.position = N.position;
    L.contribution = N.contribution;
    L.count = N.count;
    L.slots = slots;
    L.candidates.reserve(slots);
    L.evicted.resize(slots);
    L.tail_evicted.resize(slots);
  }

  int64_t layer_bytes(const Layer& L) const {
    int64_t bytes = 0;
    for (const auto& t : L.data) bytes += t.nbytes();
    for (const auto* t : {&L.score, &L.count, &L.position, &L.contribution, &L.seen_device}) {
      if (t->defined()) bytes += t->nbytes();
    }
    return bytes;
  }

  /// [B, size] fp32 ranking scores (a view for additive scorers).
  at::Tensor rank_scores(const Layer& L) const {
    const auto sum = L.score.narrow(1, 0, L.size);
    if (!Scorer::kPerObservation) return sum;
    const auto cnt = L.count.narrow(1, 0, L.size);
    return at::where(cnt.gt(0), sum.div(cnt.clamp_min(1)), at::zeros({}, sum.options()));
  }

  /// Applies one observation: `in` is probs [B, H, Q, S] or (direct) scores [B, S].
  void accumulate(Layer& L, const at::Tensor& in, bool direct) {
    at::NoGradGuard no_grad;  // inputs that require grad must not tie the buffers to a graph
    const int64_t S = L.size;
    const int64_t Q = direct ? 1 : in.size(2);
    if (fast_) {
      const bool as_is = in.scalar_type() == at::kFloat && in.is_contiguous();  // skips a dispatch
      const auto x = as_is ? in : in.to(at::kFloat).contiguous();
      const float* p = x.template data_ptr<float>();
      float* c = L.contribution.template data_ptr<float>();
      for (int64_t b = 0; b < batch_; ++b) {
        float* cb = c + b * L.slots;
        if (direct) {
          std::copy(p + b * S, p + (b + 1) * S, cb);
          continue;
        }
        std::fill(cb, cb + S, 0.f);
        for (int64_t h = 0; h < heads_; ++h) {
          for (int64_t q = Scorer::kLastQueryOnly ? Q - 1 : 0; q < Q; ++q) {
            const float* row = p + ((b * heads_ + h) * Q + q) * S;
            for (int64_t s = 0; s < S; ++s) cb[s] += row[s];
          }
        }
        const float heads = static_cast<float>(heads_);
        for (int64_t s = 0; s < S; ++s) cb[s] /= heads;
      }
      if (check_finite_) {  // the resulting score, so an overflowing sum is caught too
        const float* score = L.score.template data_ptr<float>();
        for (int64_t b = 0; b < batch_; ++b) {
          const float* cb = c + b * L.slots;
          const float* sb = score + b * L.slots;
          for (int64_t s = 0; s < S; ++s) {
            const float next = Scorer::kReplace ? cb[s] : sb[s] + cb[s];
            KVEVICT_CHECK(std::isfinite(next), non_finite_message(direct), " (row ", b, ", slot ", s,
                          ", contribution ", cb[s], ", resulting score ", next, ")");
          }
        }
      }
      float* score = L.score.template data_ptr<float>();
      float* count = L.count.defined() ? L.count.template data_ptr<float>() : nullptr;
      const int64_t* pos = L.position.template data_ptr<int64_t>();
      for (int64_t b = 0; b < batch_; ++b) {
        for (int64_t s = 0; s < S; ++s) {
          const int64_t i = b * L.slots + s;
          score[i] = Scorer::kReplace ? c[i] : score[i] + c[i];
          if (count) count[i] += static_cast<float>(std::min<int64_t>(std::max<int64_t>(L.seen - pos[i], 0), Q));
        }
      }
      return;
    }
    const auto x = in.to(at::kFloat);
    at::Tensor contribution;
    if (direct) {
      contribution = x;
    } else if (Scorer::kLastQueryOnly) {
      contribution = x.select(2, Q - 1).mean(1);
    } else {
      contribution = x.sum(2).mean(1);
    }
    auto score = L.score.narrow(1, 0, S);
    if (check_finite_) {  // the resulting score, so an overflowing sum is caught too
      const auto next = Scorer::kReplace ? contribution : score.add(contribution);
      KVEVICT_CHECK(at::isfinite(next).all().template item<bool>(), non_finite_message(direct));
    }
    if (Scorer::kReplace) {
      score.copy_(contribution);
    } else {
      score.add_(contribution);
    }
    if (L.count.defined()) {
      L.count.narrow(1, 0, S).add_(L.seen_device.sub(L.position.narrow(1, 0, S)).clamp(0, Q));
    }
  }

  static const char* non_finite_message(bool direct) {
    return direct ? "scores give a non-finite score (NaN, inf, or an fp32 overflow); the cache is unchanged "
                    "(build the cache with check_finite(false) to rank such tokens lowest instead)"
                  : "attention probs give a non-finite score (NaN, inf, or an fp32 overflow); the cache is unchanged "
                    "(build the cache with check_finite(false) to rank such tokens lowest instead)";
  }

  /// CPU pass: per row, select on the host, then move at most one tail row into each hole.
  void evict_cpu(Layer& L, int64_t n) {
    const int64_t cap = capacity();
    float* score = L.score.template data_ptr<float>();
    float* count = L.count.defined() ? L.count.template data_ptr<float>() : nullptr;
    int64_t* pos = L.position.template data_ptr<int64_t>();
    float* rank = L.contribution.template data_ptr<float>();
    for (int64_t b = 0; b < batch_; ++b) {
      const int64_t base = b * L.slots;
      const float* rank_b = score + base;
      if (count) {
        for (int64_t s = 0; s < L.size; ++s) {
          rank[base + s] = count[base + s] > 0.f ? score[base + s] / count[base + s] : 0.f;
        }
        rank_b = rank + base;
      }
      int64_t* ev = L.evicted.data();
      policy_.evict_slots_row(rank_b, pos + base, L.size, L.seen, ev, L.candidates, TrustedPositions{});
      std::fill(L.tail_evicted.begin(), L.tail_evicted.begin() + n, 0);
      for (int64_t i = 0; i < n; ++i) {
        if (ev[i] >= cap) L.tail_evicted[ev[i] - cap] = 1;
      }
      int64_t j = 0;  // next tail slot (cap + j) to examine
      for (int64_t i = 0; i < n && ev[i] < cap; ++i) {
        while (L.tail_evicted[j]) ++j;
        move_row(L, b, cap + j, ev[i]);
        ++j;
      }
    }
  }

  /// Copies slot `src` of row `b` into slot `dst` in every buffer (bit-exact).
  void move_row(Layer& L, int64_t b, int64_t src, int64_t dst) {
    for (size_t i = 0; i < specs_.size(); ++i) {
      const int64_t row_bytes = specs_[i].inner * L.data[i].element_size();
      const int64_t outer = outer_numel(i);
      auto* d = static_cast<char*>(L.data[i].data_ptr());
      for (int64_t o = 0; o < outer; ++o) {
        const int64_t g = (b * outer + o) * L.slots;
        std::memcpy(d + (g + dst) * row_bytes, d + (g + src) * row_bytes, row_bytes);
      }
    }
    const int64_t base = b * L.slots;
    L.position.template data_ptr<int64_t>()[base + dst] = L.position.template data_ptr<int64_t>()[base + src];
    L.score.template data_ptr<float>()[base + dst] = L.score.template data_ptr<float>()[base + src];
    if (L.count.defined()) L.count.template data_ptr<float>()[base + dst] = L.count.template data_ptr<float>()[base + src];
  }

  /// Tensor-op pass (CUDA): static shapes [B, n], no host sync. Evicted slots e (ascending)
  /// pair with the tail slots stable-sorted kept-first: the first pairs fill holes below
  /// capacity from kept tail rows, the rest copy dead tail rows onto dead tail rows.
  void evict_tensor(Layer& L, int64_t n) {
    at::NoGradGuard no_grad;  // inputs that require grad must not tie the buffers to a graph
    using namespace at::indexing;
    const int64_t cap = capacity();
    const auto e = policy_.evict_slots(rank_scores(L), positions_of(L));  // [B, n] ascending
    const auto is_tail = e.ge(cap).to(at::kLong);
    const auto tail_evicted = at::zeros({batch_, n}, e.options()).scatter_add_(1, (e - cap).clamp_min(0), is_tail);
    const auto src = std::get<1>(at::sort(tail_evicted, /*stable=*/true, /*dim=*/1, /*descending=*/false)).add(cap);
    const auto rows = at::arange(batch_, e.options()).unsqueeze(1);
    auto move = [&](const at::Tensor& buffer, int64_t tdim) {
      auto v = buffer.transpose(1, tdim);  // [B, slots, ...]
      v.index_put_({rows, e}, v.index({rows, src}));
    };
    for (size_t i = 0; i < specs_.size(); ++i) move(L.data[i], token_dim(i));
    move(L.position, 1);
    move(L.score, 1);
    if (L.count.defined()) move(L.count, 1);
  }

  at::Tensor positions_of(const Layer& L) const { return L.position.narrow(1, 0, L.size); }

  Policy policy_;
  std::vector<BufferSpec> specs_;
  int64_t batch_, heads_;
  at::ScalarType dtype_;
  at::Device device_;
  bool check_finite_;
  bool fast_;  // CPU host-loop path; else tensor ops
  std::vector<Layer> layers_;
};

}  // namespace detail
}  // namespace kvevict
