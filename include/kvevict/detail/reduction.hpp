#pragma once
// The exact reduction of attention probabilities into per-token contributions (docs/DESIGN.md,
// Scorers): fixed point with 32 fractional bits, summed in fp64, so any order gives the same
// bits. The host form (one probability, one row) and the tensor form side by side, and the
// scorer traits both paths read.

#include <ATen/ATen.h>

#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace kvevict {
namespace detail {

/// Whether Scorer declares `kRankIsState = true` (its rank is state[0]): the host pass then
/// ranks the state in place instead of copying ranks out.
template <class S, class = void>
struct RankIsState : std::false_type {};
template <class S>
struct RankIsState<S, std::void_t<decltype(S::kRankIsState)>> : std::bool_constant<S::kRankIsState> {};

/// Whether Scorer declares `kLinear = true` (scorers.hpp): EvictionPolicyOptions::lazy_reduction
/// may then apply many observations as one.
template <class S, class = void>
struct IsLinear : std::false_type {};
template <class S>
struct IsLinear<S, std::void_t<decltype(S::kLinear)>> : std::bool_constant<S::kLinear> {};

/// How many of the newest real query columns of an observation a scorer counts: all of them,
/// 1 for `kLastQueryOnly`, or `scorer.last_queries()` when the scorer has that member (an
/// observation window, e.g. SnapKV).
template <class S, class = void>
struct HasLastQueries : std::false_type {};
template <class S>
struct HasLastQueries<S, std::void_t<decltype(std::declval<const S&>().last_queries())>> : std::true_type {};
template <class S>
int64_t counted_queries(const S& scorer, int64_t Q) {
  if constexpr (S::kLastQueryOnly) {
    return std::min<int64_t>(Q, 1);
  } else if constexpr (HasLastQueries<S>::value) {
    return std::min<int64_t>(Q, scorer.last_queries());
  } else {
    return Q;
  }
}

/// The fixed-point unit of a probability in the reduction (scorers.hpp): 2^32.
constexpr double kFixedOne = 4294967296.0;
/// 1.5 * 2^52: adding and subtracting it rounds a double below 2^51 to an integer, half to even.
constexpr double kRound = 6755399441055744.0;
/// Fixed-point terms per slot that keep a sum an exact integer in fp64 (2^53 / 2^32).
constexpr int64_t kMaxPendingTerms = int64_t{1} << 21;

/// One probability as a fixed-point term, in double: round(clamp(p, 0, 1) * 2^32), or NaN if p
/// is not finite (p - p is 0 for a finite p, NaN otherwise). Rounding is half to even, which
/// matches at::round on the tensor path. A sum of up to 2^21 such terms is an integer below
/// 2^53: exact in double, whatever the order.
inline double fixed_term(float p) noexcept {
  const float clamped = (p < 0.f ? 0.f : (p > 1.f ? 1.f : p)) + (p - p);
  return (static_cast<double>(clamped) * kFixedOne + kRound) - kRound;
}

/// fx[s] += fixed_term(row[s]) for s in [0, n); returns whether every row[s] was in [0, 1].
/// SSE2 (every x86-64) takes 4 probabilities per iteration, bit-identical to the scalar form;
/// elsewhere the scalar loop.
inline bool add_fixed_row(const float* row, double* fx, int64_t n) noexcept {
  int64_t s = 0;
  bool in_range = true;
#if defined(__SSE2__) || defined(_M_X64)
  const __m128 zero = _mm_setzero_ps(), one = _mm_set1_ps(1.f);
  const __m128d scale = _mm_set1_pd(kFixedOne), round = _mm_set1_pd(kRound);
  int ok = 0xF;
  for (; s + 4 <= n; s += 4) {
    const __m128 raw = _mm_loadu_ps(row + s);
    ok &= _mm_movemask_ps(_mm_and_ps(_mm_cmpge_ps(raw, zero), _mm_cmple_ps(raw, one)));  // false for NaN
    const __m128 v = _mm_add_ps(_mm_min_ps(one, _mm_max_ps(zero, raw)), _mm_sub_ps(raw, raw));  // as fixed_term
    const __m128d lo = _mm_sub_pd(_mm_add_pd(_mm_mul_pd(_mm_cvtps_pd(v), scale), round), round);
    const __m128d hi = _mm_sub_pd(_mm_add_pd(_mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(v, v)), scale), round), round);
    _mm_storeu_pd(fx + s, _mm_add_pd(_mm_loadu_pd(fx + s), lo));
    _mm_storeu_pd(fx + s + 2, _mm_add_pd(_mm_loadu_pd(fx + s + 2), hi));
  }
  in_range = ok == 0xF;
#endif
  for (; s < n; ++s) {
    in_range = in_range && row[s] >= 0.f && row[s] <= 1.f;
    fx[s] += fixed_term(row[s]);
  }
  return in_range;
}

/// The contribution of a fixed-point sum over `heads` heads: float(sum) * 2^-32 / heads.
inline float from_fixed(double sum, float heads) noexcept {
  return static_cast<float>(sum) * static_cast<float>(1.0 / kFixedOne) / heads;
}

/// fixed_term() on a tensor of probabilities (any floating dtype): fp32 terms, each an integer
/// (p * 2^32 is exact in fp32 and at::round rounds half to even, as the host form), NaN for a
/// non-finite p. Summed with dtype kDouble they are exact in any order.
inline at::Tensor fixed_terms(const at::Tensor& p) {
  auto t = p.to(at::kFloat).clamp(0.0, 1.0);
  t.add_(p, 0);  // + 0 * p: NaN where p is not finite, as the host's + (p - p)
  return t.mul_(kFixedOne).round_();
}

/// from_fixed() on a tensor of fp64 sums: fp32 sum / (heads * 2^32), one rounding, equal to the
/// host's float(sum) * 2^-32 / heads (the power-of-two scale is exact). `divisor` is a [1] fp32
/// tensor holding heads * 2^32: a tensor, not a scalar, because a scalar divisor may become a
/// multiply by its reciprocal on CUDA, which rounds differently.
inline at::Tensor from_fixed(const at::Tensor& sums, const at::Tensor& divisor) {
  return sums.to(at::kFloat).div_(divisor);
}

}  // namespace detail
}  // namespace kvevict
