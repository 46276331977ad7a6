#pragma once
// The observation checks' messages, the one text of both policy paths (host_path.hpp and
// tensor_path.hpp, neither of which includes the other): a probability out of [0, 1] or not
// causal, and a non-finite rank.

#include <kvevict/check.hpp>

#include <cmath>
#include <cstdint>

namespace kvevict {
namespace detail {

/// The message tail of every observation check.
constexpr const char* kChecksHint =
    " (build with check_observations(false) to skip these checks; non-finite ranks then rank lowest)";

/// Throws for the bad probability `v` at [b, h, q, s] of an observation: out of [0, 1] (or not
/// finite), or else not causal (its key at key_pos is newer than its query at query_pos). The
/// one message of both paths.
[[noreturn]] inline void fail_probability(float v, int64_t key_pos, int64_t query_pos, int64_t b, int64_t h, int64_t q,
                                          int64_t s) {
  KVEVICT_CHECK(v >= 0.f && v <= 1.f, "attention probs must be in [0, 1], got a non-finite or out-of-range ", v,
                " at [", b, ", ", h, ", ", q, ", ", s, "]; the state is unchanged", kChecksHint);
  KVEVICT_CHECK(false, "attention probs must be causal: key at position ", key_pos, " is newer than its query at position ",
                query_pos, " but has probability ", v, " at [", b, ", ", h, ", ", q, ", ", s,
                "]; the state is unchanged", kChecksHint);
  throw;  // not reached
}

/// Throws unless `rank`, the rank of row b's slot s after an observation that contributed
/// `contribution`, is finite. The one message of both paths.
inline void check_rank(float rank, int64_t b, int64_t s, float contribution) {
  KVEVICT_CHECK(std::isfinite(rank), "the observation gives a non-finite rank (NaN, inf, or an fp32 overflow) at row ",
                b, ", slot ", s, " (contribution ", contribution, ", rank ", rank, "); the state is unchanged",
                kChecksHint);
}

}  // namespace detail
}  // namespace kvevict
