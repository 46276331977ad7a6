#pragma once
// Scorers: how observed attention becomes the per-token score that ranks heavy hitters.
// A Scorer is the template argument of EvictionPolicy. It is a description, not code: the
// cache reads its three flags and runs one reduction for all of them, on CPU or CUDA.
//
// Input: attention probabilities p [B, H, Q, S] (any floating dtype; the Q newest tokens as
// queries, S = the layer's live tokens in slot order). State: fp32 [B, S] per layer.

namespace kvevict {

/// H2O's accumulated attention (Zhang et al. 2023, "H2O", Sec. 3.2 and 4; the default):
/// `score[b, s] += mean_h sum_q p[b, h, q, s]`.
struct CumulativeAttention {
  static constexpr const char* kName = "CumulativeAttention";
  /// Reduce only the last query (else sum over all Q queries).
  static constexpr bool kLastQueryOnly = false;
  /// Replace the score with each observation (else add to it).
  static constexpr bool kReplace = false;
  /// Rank by the sum divided by the number of observed queries that could see the token.
  static constexpr bool kPerObservation = false;
};

/// The cumulative sum divided by how many observed queries could see token s (causally:
/// query position >= token position); 0 before any observation. Removes H2O's bias toward
/// old tokens, which have been observed more often (as in Keyformer / NACL-style averages).
struct MeanObservedAttention {
  static constexpr const char* kName = "MeanObservedAttention";
  static constexpr bool kLastQueryOnly = false;
  static constexpr bool kReplace = false;
  static constexpr bool kPerObservation = true;
};

/// TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs", Sec. 4): the last query's
/// attention only, `score[b, s] = mean_h p[b, h, Q-1, s]`.
struct LatestAttention {
  static constexpr const char* kName = "LatestAttention";
  static constexpr bool kLastQueryOnly = true;
  static constexpr bool kReplace = true;
  static constexpr bool kPerObservation = false;
};

}  // namespace kvevict
