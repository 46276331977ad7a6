#pragma once
// Options for eviction (EvictionOptions) and for the expanded-layout cache (MlaCacheOptions).

#include <kvevict/check.hpp>

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace kvevict {

/// What an eviction pass keeps, per layer and batch row (H2O, Zhang et al. 2023, "H2O:
/// Heavy-Hitter Oracle", Sec. 3; sinks from Xiao et al. 2023, "StreamingLLM", Sec. 3.2):
/// the first `n_sink` positions, the `budget` highest-scoring other tokens (heavy hitters)
/// and the `n_recent` newest tokens. `capacity() = n_sink + budget + n_recent` tokens remain
/// after a pass. Checked by validate(), which EvictionPolicy and the caches call when built.
///
/// Example:
/// \code
///   auto opts = kvevict::EvictionOptions(64).n_sink(4).n_recent(16).evict_every(1);
/// \endcode
struct EvictionOptions {
  EvictionOptions() = default;
  /// \param budget  heavy hitters kept per row, >= 0.
  explicit EvictionOptions(int64_t budget) : budget_(budget) {}

  /// The largest value any count may take (2^40 tokens), so sums of them never overflow.
  static constexpr int64_t kMaxTokens = int64_t{1} << 40;

  /// Tokens per row a layer holds after an eviction pass: n_sink + budget + n_recent.
  int64_t capacity() const noexcept { return n_sink_ + budget_ + n_recent_; }

  /// Throws c10::ValueError naming the offending value(s): any count < 0 or > 2^40,
  /// evict_every < 1, or capacity < 1.
  void validate() const {
    validate_counts();
    KVEVICT_CHECK_VALUE(capacity() >= 1,
                        "EvictionOptions: capacity = n_sink + budget + n_recent must be >= 1, got n_sink=",
                        n_sink_, ", budget=", budget_, ", n_recent=", n_recent_);
  }

  /// validate() without the capacity check: what a policy checks of these options when
  /// EvictionPolicyOptions::layer_budgets replace the budget (it checks each layer's capacity).
  /// Throws c10::ValueError naming the offending value: any count < 0 or > 2^40, evict_every < 1.
  void validate_counts() const {
    KVEVICT_CHECK_VALUE(budget_ >= 0 && budget_ <= kMaxTokens, "EvictionOptions: budget must be in [0, 2^40], got ",
                        budget_);
    KVEVICT_CHECK_VALUE(n_sink_ >= 0 && n_sink_ <= kMaxTokens, "EvictionOptions: n_sink must be in [0, 2^40], got ",
                        n_sink_);
    KVEVICT_CHECK_VALUE(n_recent_ >= 0 && n_recent_ <= kMaxTokens,
                        "EvictionOptions: n_recent must be in [0, 2^40], got ", n_recent_);
    KVEVICT_CHECK_VALUE(evict_every_ >= 1 && evict_every_ <= kMaxTokens,
                        "EvictionOptions: evict_every must be in [1, 2^40], got ", evict_every_);
  }

  /// Heavy hitters kept per row by a pass. Default: 64.
  KVEVICT_ARG(int64_t, budget) = 64;
  /// First positions of the sequence that are never evicted (attention sinks). Default: 4.
  KVEVICT_ARG(int64_t, n_sink) = 4;
  /// Newest tokens that are never evicted (the recent window). Default: 16.
  KVEVICT_ARG(int64_t, n_recent) = 16;
  /// A row is evicted at most once per this many appends that gave it tokens (per row: rows
  /// of a ragged batch count their own appends). Default: 1 (every step).
  KVEVICT_ARG(int64_t, evict_every) = 1;
};

/// A hook that reduces the contributions of one observe() call across processes:
/// `reduce(layer, sums)` with sums [B, S] fp64 (see EvictionPolicyOptions::reduce_contributions).
using ContributionReducer = std::function<void(int64_t layer, at::Tensor& sums)>;

/// The shape of the eviction state EvictionPolicy keeps: layers, heads, batch rows, device, and
/// whether observations are checked. The caches build one from their own options.
///
/// Example:
/// \code
///   auto opts = kvevict::EvictionPolicyOptions(/*num_layers=*/61, /*num_heads=*/128)
///                   .batch_size(8).device(at::Device("cuda:0"));
/// \endcode
struct EvictionPolicyOptions {
  EvictionPolicyOptions(int64_t num_layers, int64_t num_heads) : num_layers_(num_layers), num_heads_(num_heads) {}

  /// Whether observations are checked on `device` when check_observations is unset: on for CPU
  /// (the check runs inside the reduction's own loop), off for every other device (there each
  /// check costs one host sync, which a GPU decode loop and CUDA-graph capture cannot afford).
  bool checks_observations(const at::Device& device) const noexcept {
    return check_observations_.has_value() ? *check_observations_ : device.is_cpu();
  }

  /// Throws c10::ValueError naming the offending value: a size < 1 or above 2^40, layers x
  /// rows above 2^40 (the host state would not fit), or a device that is neither CPU nor CUDA
  /// (meta has no data to evict; other backends are not supported).
  void validate(const char* type = "EvictionPolicyOptions") const {
    constexpr int64_t kMax = EvictionOptions::kMaxTokens;
    KVEVICT_CHECK_VALUE(device_.is_cpu() || device_.is_cuda(), type, ": device must be a CPU or CUDA device, got ",
                        device_);
    KVEVICT_CHECK_VALUE(num_layers_ >= 1 && num_layers_ <= kMax, type, ": num_layers must be in [1, 2^40], got ",
                        num_layers_);
    KVEVICT_CHECK_VALUE(batch_size_ >= 1 && batch_size_ <= kMax, type, ": batch_size must be in [1, 2^40], got ",
                        batch_size_);
    KVEVICT_CHECK_VALUE(num_heads_ >= 1 && num_heads_ <= kMax, type, ": num_heads must be in [1, 2^40], got ",
                        num_heads_);
    KVEVICT_CHECK_VALUE(num_layers_ <= kMax / batch_size_, type, ": num_layers x batch_size must be <= 2^40, got ",
                        num_layers_, " x ", batch_size_);
    KVEVICT_CHECK_VALUE(total_heads_ == 0 || (total_heads_ >= num_heads_ && total_heads_ <= kMax), type,
                        ": total_heads must be 0 (= num_heads) or in [num_heads = ", num_heads_, ", 2^40], got ",
                        total_heads_);
  }

  /// Checks layer_budgets against `e` without allocating. \throws c10::ValueError naming a
  /// layer whose budget is out of range or gives a capacity < 1, or a layer_budgets of the
  /// wrong length.
  void check_layer_budgets(const EvictionOptions& e) const {
    const auto& budgets = layer_budgets_;
    if (budgets.empty()) return;
    KVEVICT_CHECK_VALUE(static_cast<int64_t>(budgets.size()) == num_layers_,
                        "layer_budgets must have one entry per layer (num_layers = ", num_layers_, "), got ",
                        budgets.size());
    for (size_t l = 0; l < budgets.size(); ++l) {
      KVEVICT_CHECK_VALUE(budgets[l] >= 0 && budgets[l] <= EvictionOptions::kMaxTokens, "layer_budgets[", l,
                          "] must be in [0, 2^40], got ", budgets[l]);
      KVEVICT_CHECK_VALUE(e.n_sink() + budgets[l] + e.n_recent() >= 1, "layer ", l,
                          ": capacity = n_sink + budget + n_recent must be >= 1, got n_sink=", e.n_sink(),
                          ", layer_budgets[", l, "]=", budgets[l], ", n_recent=", e.n_recent());
    }
  }

  /// The eviction options of every layer: `e`, with its budget from layer_budgets if set
  /// (checked by check_layer_budgets()).
  std::vector<EvictionOptions> layer_eviction(const EvictionOptions& e) const {
    if (layer_budgets_.empty()) return std::vector<EvictionOptions>(static_cast<size_t>(num_layers_), e);
    std::vector<EvictionOptions> out;
    for (const auto budget : layer_budgets_) out.push_back(EvictionOptions(e).budget(budget));
    return out;
  }

  /// Decoder layers, each with its own eviction state.
  KVEVICT_ARG(int64_t, num_layers);
  /// Attention heads whose probabilities observe() receives: probs are [B, num_heads, Q, S].
  KVEVICT_ARG(int64_t, num_heads);
  /// Batch rows (B): each row holds one sequence at a time. Default: 1.
  KVEVICT_ARG(int64_t, batch_size) = 1;
  /// Device of the state (positions, scores): CPU or CUDA; inputs must be on it. Default: CPU.
  KVEVICT_ARG(at::Device, device) = at::Device(at::kCPU);
  /// Check every observation: probabilities finite and in [0, 1], zero where a key is newer than
  /// its query (causal), and the resulting rank finite; a failed check throws and changes
  /// nothing. Unset (the default): on for CPU, off for CUDA, where each check costs a host sync.
  KVEVICT_ARG(c10::optional<bool>, check_observations) = c10::nullopt;
  /// Heavy hitters kept per layer (per-layer capacities, e.g. a pyramid: PyramidKV, Cai et al.
  /// 2024, Sec. 3), one entry per layer; n_sink and n_recent stay shared. Empty (the default):
  /// every layer keeps EvictionOptions::budget. Set, they replace that budget, which is then
  /// ignored (its capacity may be 0). Checked when the policy is built: every layer's capacity
  /// n_sink + budget + n_recent must be >= 1; a bad entry is named by its layer.
  KVEVICT_ARG(std::vector<int64_t>, layer_budgets) = {};
  /// Heads the contributions are averaged over (the divisor H in scorers.hpp). 0 (the default):
  /// num_heads. Tensor parallelism: the model's total heads, while num_heads counts this
  /// rank's own.
  KVEVICT_ARG(int64_t, total_heads) = 0;
  /// Called by observe() with `sums` [B, S] fp64 on the policy's device: the exact fixed-point
  /// sums over this process's heads and queries (scorers.hpp), before they are divided and
  /// applied. It must replace them in place, e.g. by their sum over tensor-parallel ranks
  /// (tensor_parallel.hpp); every rank then applies the same values. Empty (the default):
  /// nothing is reduced.
  KVEVICT_ARG(ContributionReducer, reduce_contributions) = nullptr;
  /// Defer the reduction: observe() adds this process's fixed-point sums (and observer counts)
  /// to per-layer pending sums [B, slots] fp64 instead of reducing and applying them; a pass
  /// (plan(), evict()) or flush() first reduces the pending sums once (reduce_contributions)
  /// and applies them as one observation. Under tensor parallelism: one all-reduce per pass
  /// instead of one per observe(). Only for scorers whose update is linear (Scorer::kLinear:
  /// CumulativeAttention, MeanObservedAttention); the policy rejects it for others. Changes
  /// the rounding (fp32 adds once per pass, not per observation), so compare lazy with lazy.
  /// Default: false.
  KVEVICT_ARG(bool, lazy_reduction) = false;
};

/// How recall() scores the host tier's pages (cache options' tier_scoring). Both bound q.k over a
/// page's keys from its digest (Quest, Tang et al. 2024, Sec. 3.2), and both give each page a
/// score per query that is a softmax over the row's pages, summed over the queries.
enum class TierScoring {
  /// Per head and query, a softmax over the pages of scale * (the Quest bound of that head's
  /// query), summed over heads and queries. Costs pages x heads x Q x 2 x width multiply-adds.
  kPerHead,
  /// Per query, one softmax over the pages of scale * (a bound of the heads' mean logit): in the
  /// latent layout the Quest bound of the heads' mean query, pages x Q x 2 x width
  /// multiply-adds, heads times fewer than kPerHead; in the expanded layout (a key per head) the
  /// mean of the heads' Quest bounds, the same matmul as kPerHead with heads times fewer
  /// softmaxes. With pages of 1 token both layouts give the mean logit itself. A page's score
  /// then counts how strongly the heads together attend to it, not how many heads do. Two-level
  /// recall (rescore) rescores its pool the same way: per query one softmax over the pool of the
  /// heads' mean exact logit.
  kHeadMean,
};

namespace detail {

/// Options every cache layout shares; `Derived` is the layout's options type, so chained
/// setters return it.
template <class Derived>
struct CacheOptionsBase {
  CacheOptionsBase(int64_t num_layers, int64_t num_heads) : num_layers_(num_layers), num_heads_(num_heads) {}

  /// Throws c10::ValueError naming the offending value: a size < 1 or > 2^40, a device that is
  /// neither CPU nor CUDA, or a non-floating dtype.
  void validate() const {
    const char* type = Derived::kName;
    policy_options().validate(type);
    KVEVICT_CHECK_VALUE(at::isFloatingType(dtype_), type,
                        ": dtype must be a floating type (float32, float16, bfloat16, float64), got ", dtype_);
    KVEVICT_CHECK_VALUE(tier_tokens_ >= 0 && tier_tokens_ <= EvictionOptions::kMaxTokens, type,
                        ": tier_tokens must be in [0, 2^40], got ", tier_tokens_);
    KVEVICT_CHECK_VALUE(tier_page_size_ >= 1 && tier_page_size_ <= (int64_t{1} << 20), type,
                        ": tier_page_size must be in [1, 2^20], got ", tier_page_size_);
    KVEVICT_CHECK_VALUE(tier_scoring_ == TierScoring::kPerHead || tier_scoring_ == TierScoring::kHeadMean, type,
                        ": tier_scoring must be kPerHead or kHeadMean, got ", static_cast<int>(tier_scoring_));
    static_cast<const Derived&>(*this).validate_layout();
  }

  /// The eviction state's shape for these options.
  EvictionPolicyOptions policy_options() const {
    return EvictionPolicyOptions(num_layers_, num_heads_)
        .batch_size(batch_size_)
        .device(device_)
        .check_observations(check_observations_)
        .layer_budgets(layer_budgets_)
        .total_heads(total_heads_)
        .reduce_contributions(reduce_contributions_)
        .lazy_reduction(lazy_reduction_);
  }

  /// Decoder layers, each with its own buffers and eviction state.
  KVEVICT_ARG_AS(Derived, int64_t, num_layers);
  /// Attention heads per layer (DeepSeek-V3: 128); observed probabilities are [B, H, Q, S].
  KVEVICT_ARG_AS(Derived, int64_t, num_heads);
  /// Batch rows (B), each holding one sequence at a time. Default: 1.
  KVEVICT_ARG_AS(Derived, int64_t, batch_size) = 1;
  /// Storage dtype of the cached rows. Default: at::kFloat.
  KVEVICT_ARG_AS(Derived, at::ScalarType, dtype) = at::kFloat;
  /// Device of every buffer: CPU or CUDA; inputs must be on it. Default: CPU.
  KVEVICT_ARG_AS(Derived, at::Device, device) = at::Device(at::kCPU);
  /// See EvictionPolicyOptions::check_observations. Default: unset (on for CPU, off for CUDA).
  KVEVICT_ARG_AS(Derived, c10::optional<bool>, check_observations) = c10::nullopt;
  /// See EvictionPolicyOptions::layer_budgets. Default: empty (EvictionOptions::budget everywhere).
  KVEVICT_ARG_AS(Derived, std::vector<int64_t>, layer_budgets) = {};
  /// See EvictionPolicyOptions::total_heads. Default: 0 (num_heads).
  KVEVICT_ARG_AS(Derived, int64_t, total_heads) = 0;
  /// See EvictionPolicyOptions::reduce_contributions. Default: none.
  KVEVICT_ARG_AS(Derived, ContributionReducer, reduce_contributions) = nullptr;
  /// See EvictionPolicyOptions::lazy_reduction. Default: false.
  KVEVICT_ARG_AS(Derived, bool, lazy_reduction) = false;
  /// The host tier: evicted tokens a row keeps in host memory per layer (its rows bit for bit,
  /// position, rank and scorer state) instead of dropping them; past this many the lowest-
  /// ranked tier tokens are dropped, in the eviction order. 0: no tier. Both paths: on the
  /// tensor path (CUDA) the rows sit in pinned host memory and everything else on the device,
  /// and a pass writes its evicted tokens there inside its own commit, with no host sync.
  /// Default: 0.
  KVEVICT_ARG_AS(Derived, int64_t, tier_tokens) = 0;
  /// Tokens per page of the host tier's digests: tier tokens at positions [k * tier_page_size,
  /// (k + 1) * tier_page_size) share page k, whose digest (per-channel key min and max, Quest)
  /// recall() scores and whose tokens come back together. Default: 16.
  KVEVICT_ARG_AS(Derived, int64_t, tier_page_size) = 16;
  /// How recall() scores the pages (TierScoring): per head, or by the heads' mean logit, which
  /// in the latent layout costs heads times less. Default: TierScoring::kPerHead.
  KVEVICT_ARG_AS(Derived, TierScoring, tier_scoring) = TierScoring::kPerHead;
};

}  // namespace detail

/// Shape, dtype and device of an expanded-layout cache (MlaCache): per layer, keys
/// `[batch_size, num_heads, S, qk_dim]` and values `[batch_size, num_heads, S, v_dim]`
/// (DeepSeek-V3: qk_dim = 128 no-RoPE + 64 RoPE = 192, v_dim = 128). Also: num_layers,
/// num_heads, batch_size, dtype, device, check_observations (detail::CacheOptionsBase). Checked by
/// validate(), which the cache calls when built.
///
/// Example:
/// \code
///   auto opts = kvevict::MlaCacheOptions(/*num_layers=*/61, /*num_heads=*/128)
///                   .dtype(at::kBFloat16).device(at::Device("cuda:0"));
/// \endcode
struct MlaCacheOptions : detail::CacheOptionsBase<MlaCacheOptions> {
  static constexpr const char* kName = "MlaCacheOptions";
  MlaCacheOptions(int64_t num_layers, int64_t num_heads) : CacheOptionsBase(num_layers, num_heads) {}
  void validate_layout() const {
    KVEVICT_CHECK_VALUE(qk_dim_ >= 1, kName, ": qk_dim must be >= 1, got ", qk_dim_);
    KVEVICT_CHECK_VALUE(v_dim_ >= 1, kName, ": v_dim must be >= 1, got ", v_dim_);
  }

  /// Key width per head: qk_nope + qk_rope. Default: 192 (128 + 64).
  KVEVICT_ARG(int64_t, qk_dim) = 192;
  /// Value width per head. Default: 128.
  KVEVICT_ARG(int64_t, v_dim) = 128;
};

/// Shape, dtype and device of a latent-layout cache (MlaLatentCache): per layer, the
/// compressed KV `ckv [batch_size, S, kv_lora_rank]` (after kv_a_layernorm) and the RoPE key
/// `kpe [batch_size, S, qk_rope_dim]` (after RoPE), shared by all heads (DeepSeek-V3: 512 and
/// 64). Also: num_layers, num_heads, batch_size, dtype, device, check_observations. Checked by
/// validate(), which the cache calls when built.
///
/// Example:
/// \code
///   auto opts = kvevict::MlaLatentCacheOptions(/*num_layers=*/61, /*num_heads=*/128).dtype(at::kBFloat16);
/// \endcode
struct MlaLatentCacheOptions : detail::CacheOptionsBase<MlaLatentCacheOptions> {
  static constexpr const char* kName = "MlaLatentCacheOptions";
  MlaLatentCacheOptions(int64_t num_layers, int64_t num_heads) : CacheOptionsBase(num_layers, num_heads) {}
  void validate_layout() const {
    KVEVICT_CHECK_VALUE(kv_lora_rank_ >= 1, kName, ": kv_lora_rank must be >= 1, got ", kv_lora_rank_);
    KVEVICT_CHECK_VALUE(qk_rope_dim_ >= 1, kName, ": qk_rope_dim must be >= 1, got ", qk_rope_dim_);
    KVEVICT_CHECK_VALUE(qk_nope_dim_ >= 0, kName, ": qk_nope_dim must be >= 0, got ", qk_nope_dim_);
  }

  /// Width of the compressed KV (ckv). Default: 512.
  KVEVICT_ARG(int64_t, kv_lora_rank) = 512;
  /// Width of the shared RoPE key (kpe). Default: 64.
  KVEVICT_ARG(int64_t, qk_rope_dim) = 64;
  /// No-RoPE query/key width per head; only sets the default attention scale
  /// 1/sqrt(qk_nope_dim + qk_rope_dim). Default: 128.
  KVEVICT_ARG(int64_t, qk_nope_dim) = 128;
};

}  // namespace kvevict
