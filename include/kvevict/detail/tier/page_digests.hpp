#pragma once
// The page digests of the host tier: the digest its page tables keep (TierDigest, Quest's
// per-page min/max of the keys, quest_digest.hpp) and one row's pages (PageDigests, a
// PageTable over it, page_table.hpp). Another digest is a file of its own implementing the
// interface quest_digest.hpp describes, named here.
//
// The keys of a token are `groups` vectors of `width` floats: one per head in the expanded
// layout (keys [H, qk_dim]), one shared by every head in the latent layout ([ckv | kpe]).

#include <kvevict/check.hpp>
#include <kvevict/detail/tier/page_table.hpp>
#include <kvevict/detail/tier/quest_digest.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace kvevict {
namespace detail {

/// The digest the tier's pages keep: PageDigests' on the host path, TierStore's by page id on
/// the tensor path (and tier_bytes()).
using TierDigest = QuestDigest;
/// One row's page digests.
using PageDigests = PageTable<TierDigest>;

/// `n` values of dtype `t` at `src` as floats in `dst` (fp32, fp64, fp16 or bf16): a tier
/// token's keys as the digests take them.
inline void to_floats(const uint8_t* src, at::ScalarType t, int64_t n, float* dst) {
  switch (t) {
    case at::kFloat: std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float)); return;
    case at::kDouble:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(reinterpret_cast<const double*>(src)[i]);
      return;
    case at::kHalf:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(reinterpret_cast<const c10::Half*>(src)[i]);
      return;
    case at::kBFloat16:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(reinterpret_cast<const c10::BFloat16*>(src)[i]);
      return;
    default: KVEVICT_CHECK(false, "tier digests: unsupported dtype ", t);
  }
}

}  // namespace detail
}  // namespace kvevict
