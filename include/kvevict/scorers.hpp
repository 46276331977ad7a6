#pragma once
// Scorers: how observed attention becomes the per-token state that ranks heavy hitters.
//
// A Scorer is the template argument of EvictionPolicy (and of the caches through it), and an
// object the policy holds (so it may carry parameters, e.g. DecayedAttention's gamma). The
// policy does the reduction of the probabilities; the scorer only says which queries count,
// how much state a token keeps, how an observation changes it, and how the state ranks.
//
// What a scorer receives, per batch row b and live token s, for one observe() call:
//   contribution  fp32: the mean over heads of the attention that the observed queries gave the
//                 token, c = float(sum_h sum_q round(p[b, h, q, s] * 2^32)) * 2^-32 / H.
//                 Each term is an integer (fixed point, 32 fractional bits: a probability
//                 below 2^-33 counts as 0), summed in double: exact, so the sum has one value
//                 whatever the order of the reduction, on the CPU loops, on the tensor path
//                 (CUDA) and across tensor-parallel ranks. Probabilities outside [0, 1] are
//                 clamped (observe() rejects them when checks are on); a non-finite one makes
//                 the contribution NaN, which ranks lowest. Queries: every real query of the
//                 newest append, or only its last one when kLastQueryOnly. Pads never count.
//   observers     fp32: how many of those queries could see the token (query position >=
//                 token position).
// add_scores() passes the caller's score as the contribution and 1 as observers.
// A scorer may also have `int64_t last_queries() const`: only the newest last_queries() real
// queries of each observation count (an observation window, e.g. SnapKV), and
// `at::Tensor pool(const at::Tensor& ranks) const`: a smoothing of [B, T] ranks in position
// order, applied by prompt_scores() (lse_scores.hpp) where positions are contiguous.
//
// The interface (host and tensor forms must perform the same fp32 operations in the same order,
// so both paths keep the same tokens):
//   static constexpr const char* kName;
//   static constexpr bool kLastQueryOnly;     // reduce only the last real query of a row
//   static constexpr int64_t kStateWidth;     // fp32 values per token, all 0 when it is appended
//   void apply(float* state, float contribution, float observers) const;        // one token
//   float rank(const float* state) const;                                       // one token
//   void apply(const at::Tensor& state, const at::Tensor& contribution,
//              const at::Tensor& observers) const;  // state [B, S, W] in place; others [B, S]
//   at::Tensor rank(const at::Tensor& state) const; // [B, S, W] -> [B, S] fp32
// Lower rank is evicted first (ties: the older position; non-finite ranks lowest).
// Optional: `static constexpr bool kLinear = true;` when two observations equal one with their
// contributions and observers summed (apply(apply(s, c1, o1), c2, o2) == apply(s, c1 + c2,
// o1 + o2) up to fp32 rounding). EvictionPolicyOptions::lazy_reduction needs it.
// Optional: `static constexpr bool kUsesObservers = false;` when apply() ignores the observer
// counts: the tensor path then does not compute them (fewer kernels per observation).

#include <kvevict/check.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace kvevict {

/// H2O's accumulated attention (Zhang et al. 2023, "H2O", Sec. 3.2 and 4; the default):
/// `score += contribution`, i.e. `score[b, s] += mean_h sum_q p[b, h, q, s]`. Older tokens have
/// been observed more often, so under uniform attention they score higher than newer ones.
struct CumulativeAttention {
  static constexpr const char* kName = "CumulativeAttention";
  static constexpr bool kUsesObservers = false;
  static constexpr bool kLastQueryOnly = false;
  static constexpr bool kLinear = true;  // lazy_reduction applies
  static constexpr int64_t kStateWidth = 1;  // {score}
  void apply(float* state, float c, float /*observers*/) const noexcept { state[0] += c; }
  float rank(const float* state) const noexcept { return state[0]; }
  void apply(const at::Tensor& state, const at::Tensor& c, const at::Tensor& /*observers*/) const {
    state.select(2, 0).add_(c);
  }
  at::Tensor rank(const at::Tensor& state) const { return state.select(2, 0); }
};

/// The cumulative sum divided by how many observed queries could see the token (causally:
/// query position >= token position); 0 before any observation. Removes H2O's bias toward old
/// tokens (as in Keyformer / NACL-style averages): under uniform attention (the same
/// probability for every token from every query) all ranks tie, so it keeps a sliding window.
/// Counts are fp32, exact up to 2^24 observations of one token.
struct MeanObservedAttention {
  static constexpr const char* kName = "MeanObservedAttention";
  static constexpr bool kLastQueryOnly = false;
  static constexpr bool kLinear = true;  // lazy_reduction applies
  static constexpr int64_t kStateWidth = 2;  // {sum, observers}
  void apply(float* state, float c, float observers) const noexcept {
    state[0] += c;
    state[1] += observers;
  }
  float rank(const float* state) const noexcept { return state[1] > 0.f ? state[0] / state[1] : 0.f; }
  void apply(const at::Tensor& state, const at::Tensor& c, const at::Tensor& observers) const {
    state.select(2, 0).add_(c);
    state.select(2, 1).add_(observers);
  }
  at::Tensor rank(const at::Tensor& state) const {
    const auto sum = state.select(2, 0), n = state.select(2, 1);
    return at::where(n.gt(0), sum.div(n), at::zeros({}, sum.options()));
  }
};

/// TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", Sec. 4): the last query's
/// attention only, `score[b, s] = mean_h p[b, h, Q-1, s]`, replacing the previous score.
struct LatestAttention {
  static constexpr const char* kName = "LatestAttention";
  static constexpr bool kUsesObservers = false;
  static constexpr bool kLastQueryOnly = true;
  static constexpr int64_t kStateWidth = 1;  // {score}
  void apply(float* state, float c, float /*observers*/) const noexcept { state[0] = c; }
  float rank(const float* state) const noexcept { return state[0]; }
  void apply(const at::Tensor& state, const at::Tensor& c, const at::Tensor& /*observers*/) const {
    state.select(2, 0).copy_(c);
  }
  at::Tensor rank(const at::Tensor& state) const { return state.select(2, 0); }
};

/// H2O with exponential decay, the worked example of a scorer with a parameter: each
/// observation multiplies the score by `gamma` before adding its contribution,
/// `score = gamma * score + contribution`, so a heavy hitter that attention stopped visiting
/// fades: H2O's accumulation (Zhang et al. 2023, Sec. 3.2) turned into an exponential moving
/// sum, the usual remedy for stale heavy hitters. gamma = 1 is CumulativeAttention; gamma = 0
/// ranks by the latest observation summed over its queries.
///
/// Bit-identical paths need the host's `score * gamma` and `+ c` rounded apart, as the tensor
/// path's two kernels are: builds that contract them into one FMA (e.g. -march with FMA and
/// -ffp-contract=fast) may differ from the tensor path in the last bit.
struct DecayedAttention {
  static constexpr const char* kName = "DecayedAttention";
  static constexpr bool kUsesObservers = false;
  static constexpr bool kLastQueryOnly = false;
  static constexpr int64_t kStateWidth = 1;  // {score}

  /// \param gamma  decay per observation, in [0, 1]. Default 0.9.
  /// \throws c10::ValueError if gamma is outside [0, 1] or NaN.
  explicit DecayedAttention(float gamma = 0.9f) : gamma_(gamma) {
    KVEVICT_CHECK_VALUE(gamma >= 0.f && gamma <= 1.f, "DecayedAttention: gamma must be in [0, 1], got ", gamma);
  }
  float gamma() const noexcept { return gamma_; }

  void apply(float* state, float c, float /*observers*/) const noexcept {
    volatile float decayed = state[0] * gamma_;  // rounded on its own, as the tensor path's mul_
    state[0] = decayed + c;
  }
  float rank(const float* state) const noexcept { return state[0]; }
  void apply(const at::Tensor& state, const at::Tensor& c, const at::Tensor& /*observers*/) const {
    state.select(2, 0).mul_(gamma_).add_(c);
  }
  at::Tensor rank(const at::Tensor& state) const { return state.select(2, 0); }

 private:
  float gamma_;
};

/// SnapKV's observation window (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for
/// Before Generation", Sec. 4.1 "voting" and 4.2 "clustering via pooling"), a scorer for
/// prompt compression: a token's score is the attention that the last `window` queries of the
/// prompt give it, averaged over heads (mean_h sum_{q in window} p[b, h, q, s]: the paper's
/// sum over heads divided by H, the same order), then pooled along the token axis with a 1-D
/// kernel of `kernel` tokens (stride 1, zero padding of kernel / 2 on each side; average
/// pooling counts the padding, as `avg_pool1d(count_include_pad = true)` does), so that
/// neighbours of a heavy hitter survive with it.
///
/// Use it through prompt_scores() / compress_prompt() (lse_scores.hpp), which observe the
/// whole prompt and pool in position order. In a cache it is a plain scorer (each observation
/// replaces the score by the last `window` queries' attention) and does not pool: slot order
/// is not position order there. SnapKV keeps the window itself: set n_recent >= window.
/// Defaults follow the authors' reference code (window 64, kernel 5, average pooling).
struct SnapKV {
  enum class Pooling { kAvg, kMax };
  static constexpr const char* kName = "SnapKV";
  static constexpr bool kUsesObservers = false;
  static constexpr bool kLastQueryOnly = false;
  static constexpr int64_t kStateWidth = 1;  // {window score}

  /// \param window   prompt queries that vote (the newest), >= 1. Default 64.
  /// \param kernel   pooling width in tokens, odd, >= 1 (1: no pooling). Default 5.
  /// \param pooling  kAvg (default) or kMax.
  /// \throws c10::ValueError if window < 1 or kernel is even or < 1.
  explicit SnapKV(int64_t window = 64, int64_t kernel = 5, Pooling pooling = Pooling::kAvg)
      : window_(window), kernel_(kernel), pooling_(pooling) {
    KVEVICT_CHECK_VALUE(window >= 1, "SnapKV: window must be >= 1, got ", window);
    KVEVICT_CHECK_VALUE(kernel >= 1 && kernel % 2 == 1, "SnapKV: kernel must be odd and >= 1, got ", kernel);
  }
  int64_t window() const noexcept { return window_; }
  int64_t kernel() const noexcept { return kernel_; }
  Pooling pooling() const noexcept { return pooling_; }
  /// Only the newest `window` real queries of an observation count.
  int64_t last_queries() const noexcept { return window_; }

  void apply(float* state, float c, float /*observers*/) const noexcept { state[0] = c; }
  float rank(const float* state) const noexcept { return state[0]; }
  void apply(const at::Tensor& state, const at::Tensor& c, const at::Tensor& /*observers*/) const {
    state.select(2, 0).copy_(c);
  }
  at::Tensor rank(const at::Tensor& state) const { return state.select(2, 0); }

  /// Pools ranks along the token axis.
  /// \param ranks  [B, T] fp32, position order (column t is the token at position t).
  /// \return [B, T] fp32: max or mean over tokens t - kernel/2 .. t + kernel/2 (zeros
  ///         outside [0, T) count in the mean; they never win the max, ranks being >= 0).
  at::Tensor pool(const at::Tensor& ranks) const {
    if (kernel_ == 1) return ranks;
    const auto x = ranks.to(at::kFloat).unsqueeze(1);  // [B, 1, T]
    const int64_t pad = kernel_ / 2;
    if (pooling_ == Pooling::kMax) {
      return at::constant_pad_nd(x, {pad, pad}, 0.0).unfold(2, kernel_, 1).amax(-1).squeeze(1);
    }
    return at::constant_pad_nd(x, {pad, pad}, 0.0).unfold(2, kernel_, 1).sum(-1).div(static_cast<double>(kernel_)).squeeze(1);
  }

 private:
  int64_t window_;
  int64_t kernel_;
  Pooling pooling_;
};

}  // namespace kvevict
