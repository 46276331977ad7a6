#pragma once
// Recall as one pipeline of typed stages, the types each stage hands the next, defined once
// for both of the tier's paths (TierHostPath, tier/host_path.hpp, host tensors on the CPU;
// TierTensorPath, tier/tensor_path.hpp, tensors on the cache's device):
//
//   RecallInput --score--> PageScores --victims--> Victims --pick--> Pick --swap--> [B] recalled
//
// LayerTier::recall() (tier/tier.hpp) runs them in that order, each stage one call into the
// path with the same name on both paths; a stage reads only its arguments and the tier's own
// storage (no state kept between stages). Every type holds plain tensors whose meaning is the
// same on both paths; where one path needs a field the other does not, the field says so.

#include <ATen/ATen.h>

#include <cstdint>

namespace kvevict {
namespace detail {

/// recall's arguments, as CacheBase::check_recall() checked them at the public call (scale
/// finite and > 0; tokens and rescore in [0, 2^40]; a two-level rescore of at least one page;
/// with observation checks on, finite real queries); CacheBase::recall_rows() makes it.
struct RecallInput {
  at::Tensor query;     // [B, H, Q, key width] fp32, contiguous, on the cache's device
  double scale = 1;     // the attention's logit scale
  int64_t tokens = 0;   // at most this many tokens recalled per row
  int64_t rescore = 0;  // > tokens: two-level recall's pool per row, tokens
  int64_t K = 0;        // victims a row may need: min(tokens, the layer's slots)
  /// Two-level recall: the best whole pages up to `rescore` tokens, scored again token by token.
  bool two_level() const noexcept { return tokens > 0 && rescore > tokens; }
};

/// The score stage's output: every row's page scores and what the pick stage reuses of them.
struct PageScores {
  at::Tensor sums;        // [B, P] fp64: per page (host: page slot; tensor: page id), 0 for none
  at::Tensor mean_query;  // kHeadMean with a shared key (latent): the heads' mean query [B, 1, Q, D]
                          // fp32, reduced across processes once, which the pool's scores reuse;
                          // else undefined
  at::Tensor real;        // [B, Q] bool on the device: the real query columns the scores counted
                          // (the tensor path's mirror; undefined on the host path, whose rows
                          // take theirs from core.first_real() as they go: real_queries())
};

/// The victims stage's output: each row's victim candidates (neither sinks nor in the recent
/// window as it was before the latest append: victim_range()) on the path's device.
struct Victims {
  at::Tensor candidates;  // [B] int64: how many a row has
  at::Tensor slots;       // [B, K] int64: the cache slots of the K lowest-ranked in eviction order
                          // (drops_before()); columns past a row's candidates hold anything
  at::Tensor position;    // [B, K] int64: their positions (the host path, which sizes the swap's
                          // digests by them; undefined on the tensor path)
  at::Tensor top;         // [B, W] fp32: the best-ranked candidate's scorer state, which the
                          // recalled tokens get (anything for a row without candidates)
};

/// The pick stage's output: per row the tier tokens to recall, at most min(tokens, candidates,
/// K), in recall order; column k's token replaces Victims::slots[b, k].
struct Pick {
  at::Tensor slots;  // [B, K] int64: the tier's slots (host: token indices into the row's TierRow,
                     // -1 past the count; tensor: TierStore slots, its trash slot N past it)
  at::Tensor count;  // [B] int64: the tokens picked per row
  bool whole_pages = true;  // every page it takes from is taken whole (false: two-level recall)
};

}  // namespace detail
}  // namespace kvevict
