#pragma once
// key_basis(): the principal directions of a layer's keys, for the host tier's low-rank digests
// (cache options' tier_key_basis).

#include <kvevict/check.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace kvevict {

/// The `dims` principal directions of `keys` (PCA, as Loki, Singhania et al. 2024, Sec. 3,
/// computes offline per layer from calibration data): the eigenvectors of the centred keys'
/// covariance Ck with the largest eigenvalues, for a layer's tier_key_basis.
///
/// \param keys  [..., D] keys of one layer as the tier sees them, any floating dtype and device:
///              latent [ckv | kpe] rows (D = kv_lora_rank + qk_rope_dim), or expanded keys of
///              every head (D = qk_dim; heads share the basis). Every row is one sample.
/// \param dims  r, in [1, D].
/// \return [D, r] fp32 on the CPU: orthonormal columns by descending variance, each signed so
///         that its entry of largest magnitude (the first, on a tie) is positive. Computed in
///         fp64; directions of equal variance are not unique, and which ones come back then
///         depends on LAPACK.
/// \throws c10::ValueError naming the argument: keys not floating, without rows or with fewer
///         than 1 column, not finite; dims outside [1, D]. Allocates; copies keys to the CPU (a
///         sync on CUDA).
inline at::Tensor key_basis(const at::Tensor& keys, int64_t dims) {
  KVEVICT_CHECK_VALUE(keys.defined() && keys.dim() >= 1 && at::isFloatingType(keys.scalar_type()),
                      "key_basis: keys must be a floating tensor [..., D], got ",
                      keys.defined() ? keys.sizes() : at::IntArrayRef{}, keys.defined() ? " of " : "",
                      keys.defined() ? c10::toString(keys.scalar_type()) : "an undefined tensor");
  const int64_t D = keys.size(-1);
  KVEVICT_CHECK_VALUE(D >= 1 && keys.numel() >= D, "key_basis: keys must hold at least one row of D >= 1 values, got ",
                      keys.sizes());
  KVEVICT_CHECK_VALUE(dims >= 1 && dims <= D, "key_basis: dims must be in [1, ", D, "] (the key width), got ", dims);
  auto x = keys.reshape({-1, D}).to(at::kCPU, at::kDouble);
  KVEVICT_CHECK_VALUE(at::isfinite(x).all().item<bool>(), "key_basis: keys must be finite, got a NaN or an infinity");
  x = x - x.mean(0, /*keepdim=*/true);
  const auto cov = at::mm(x.t(), x);
  // eigh: eigenvalues ascending, so the last `dims` columns, reversed, go by descending variance.
  auto basis = std::get<1>(at::linalg_eigh(cov)).flip({1}).narrow(1, 0, dims).contiguous();
  const auto largest = basis.abs().argmax(0);  // the first of equal magnitudes
  const auto sign = basis.gather(0, largest.unsqueeze(0)).sign();
  return basis.mul_(at::where(sign.lt(0), at::full_like(sign, -1.0), at::ones_like(sign))).to(at::kFloat);
}

}  // namespace kvevict
