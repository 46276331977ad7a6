// Selection on plain tensors: keep_indices (prefill compression), evict_slots (the tensor
// path the caches run on CUDA) and evict_slots_row (the host path the caches run on CPU),
// against the brute-force oracle and the contract rules one by one (docs/DESIGN.md, "The contract").
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

using Catch::Matchers::Contains;
using kvevict::EvictionOptions;
using Policy = kvevict::Selection;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// One batch row of a selection input: positions in slot order and their scores.
struct Row {
  std::vector<int64_t> positions;  // [S] distinct, slot order
  std::vector<double> scores;      // [S] integer-valued, some non-finite
  int64_t seen = 0;                // tokens ever appended: the window is [seen - n_recent, seen)
};

// Integer scores in [0, 3] (so many exact ties), each non-finite with probability
// `non_finite` (NaN, +inf, -inf equally often).
std::vector<double> random_scores(std::mt19937& rng, int64_t S, double non_finite) {
  std::uniform_int_distribution<int> level(0, 3);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> s(S);
  for (auto& x : s) {
    const double r = u(rng);
    if (r < non_finite / 3) {
      x = kNaN;
    } else if (r < 2 * non_finite / 3) {
      x = kInf;
    } else if (r < non_finite) {
      x = -kInf;
    } else {
      x = level(rng);
    }
  }
  return s;
}

// A row as a cache holds it: sinks 0..n_sink-1 and window seen-n_recent..seen-1 present, the
// rest a random sample of the positions between, all in a random slot order.
Row random_cache_row(std::mt19937& rng, const EvictionOptions& o, int64_t S, double non_finite) {
  std::uniform_int_distribution<int64_t> gap_dist(0, S);
  Row r;
  r.seen = S + gap_dist(rng);
  for (int64_t p = 0; p < o.n_sink(); ++p) r.positions.push_back(p);
  for (int64_t p = r.seen - o.n_recent(); p < r.seen; ++p) r.positions.push_back(p);
  std::vector<int64_t> middle(r.seen - o.n_sink() - o.n_recent());
  std::iota(middle.begin(), middle.end(), o.n_sink());
  std::shuffle(middle.begin(), middle.end(), rng);
  middle.resize(S - o.n_sink() - o.n_recent());
  r.positions.insert(r.positions.end(), middle.begin(), middle.end());
  std::shuffle(r.positions.begin(), r.positions.end(), rng);
  r.scores = random_scores(rng, S, non_finite);
  return r;
}

// S distinct positions drawn from [0, 3S), in a random slot order (evict_slots takes the
// n_sink smallest as sinks and the n_recent largest as the window).
Row random_position_row(std::mt19937& rng, int64_t S, double non_finite) {
  std::vector<int64_t> all(3 * S);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  Row r;
  r.positions.assign(all.begin(), all.begin() + S);
  r.scores = random_scores(rng, S, non_finite);
  return r;
}

at::Tensor scores_tensor(const std::vector<Row>& rows, at::ScalarType dtype = at::kFloat) {
  const int64_t B = static_cast<int64_t>(rows.size()), S = static_cast<int64_t>(rows[0].scores.size());
  auto t = at::empty({B, S}, at::kDouble);
  auto* p = t.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) std::copy(rows[b].scores.begin(), rows[b].scores.end(), p + b * S);
  return t.to(dtype);
}

at::Tensor positions_tensor(const std::vector<Row>& rows) {
  const int64_t B = static_cast<int64_t>(rows.size()), S = static_cast<int64_t>(rows[0].positions.size());
  auto t = at::empty({B, S}, at::kLong);
  auto* p = t.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) std::copy(rows[b].positions.begin(), rows[b].positions.end(), p + b * S);
  return t;
}

// Kept positions (ascending) of a row, given its evicted slots.
std::vector<int64_t> kept_after(const Row& r, const std::vector<int64_t>& evicted_slots) {
  std::vector<bool> gone(r.positions.size(), false);
  for (auto s : evicted_slots) {
    REQUIRE(s >= 0);
    REQUIRE(s < static_cast<int64_t>(r.positions.size()));
    REQUIRE_FALSE(gone[s]);
    gone[s] = true;
  }
  std::vector<int64_t> kept;
  for (size_t s = 0; s < r.positions.size(); ++s) {
    if (!gone[s]) kept.push_back(r.positions[s]);
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

bool ascending(const std::vector<int64_t>& v) { return std::is_sorted(v.begin(), v.end()); }

// evict_slots on B rows at once, checked against the oracle row by row.
void check_evict_slots(const Policy& policy, const std::vector<Row>& rows, at::Device device = at::kCPU) {
  const auto& o = policy.options();
  const int64_t B = static_cast<int64_t>(rows.size()), S = static_cast<int64_t>(rows[0].positions.size());
  const auto ev = policy.evict_slots(scores_tensor(rows).to(device), positions_tensor(rows).to(device));
  REQUIRE(ev.dim() == 2);
  REQUIRE(ev.size(0) == B);
  REQUIRE(ev.size(1) == std::max<int64_t>(S - policy.capacity(), 0));
  CHECK(ev.scalar_type() == at::kLong);
  CHECK(ev.device() == device);
  for (int64_t b = 0; b < B; ++b) {
    const auto slots = kvevict_test::to_vec<int64_t>(ev[b]);
    CHECK(ascending(slots));
    CHECK(kept_after(rows[b], slots) ==
          kvevict_test::oracle_keep(rows[b].positions, rows[b].scores, o.n_sink(), o.budget(), o.n_recent()));
  }
}

// evict_slots_row on one row, checked against the oracle.
void check_evict_slots_row(const Policy& policy, const Row& r, std::vector<kvevict::detail::Candidate>& scratch) {
  const auto& o = policy.options();
  const int64_t S = static_cast<int64_t>(r.positions.size());
  const int64_t n = std::max<int64_t>(S - policy.capacity(), 0);
  std::vector<float> scores(r.scores.begin(), r.scores.end());
  std::vector<int64_t> out(n + 1, -7);  // one guard element past the end
  policy.evict_slots_row(scores.data(), r.positions.data(), S, r.seen, out.data(), scratch);
  CHECK(out[n] == -7);
  out.resize(n);
  CHECK(ascending(out));
  CHECK(kept_after(r, out) == kvevict_test::oracle_keep(r.positions, r.scores, o.n_sink(), o.budget(), o.n_recent()));
}

// keep_indices on rows whose positions are 0..S-1 in slot order.
void check_keep_indices(const Policy& policy, const std::vector<Row>& rows, at::ScalarType dtype,
                        at::Device device = at::kCPU) {
  const auto& o = policy.options();
  const int64_t B = static_cast<int64_t>(rows.size()), S = static_cast<int64_t>(rows[0].scores.size());
  const auto keep = policy.keep_indices(scores_tensor(rows, dtype).to(device));
  REQUIRE(keep.dim() == 2);
  REQUIRE(keep.size(0) == B);
  REQUIRE(keep.size(1) == std::min(S, policy.capacity()));
  CHECK(keep.scalar_type() == at::kLong);
  CHECK(keep.device() == device);
  for (int64_t b = 0; b < B; ++b) {
    CHECK(kvevict_test::to_vec<int64_t>(keep[b]) ==
          kvevict_test::oracle_keep(rows[b].positions, rows[b].scores, o.n_sink(), o.budget(), o.n_recent()));
  }
}

// Rows with positions 0..S-1 in slot order (as in a prefill).
std::vector<Row> prefill_rows(std::mt19937& rng, int64_t B, int64_t S, double non_finite) {
  std::vector<Row> rows(B);
  for (auto& r : rows) {
    r.positions.resize(S);
    std::iota(r.positions.begin(), r.positions.end(), 0);
    r.scores = random_scores(rng, S, non_finite);
    r.seen = S;
  }
  return rows;
}

const std::vector<EvictionOptions>& configs() {
  static const std::vector<EvictionOptions> c = {
      EvictionOptions(0).n_sink(0).n_recent(1), EvictionOptions(1).n_sink(0).n_recent(0),
      EvictionOptions(0).n_sink(1).n_recent(0), EvictionOptions(3).n_sink(0).n_recent(0),
      EvictionOptions(0).n_sink(2).n_recent(3), EvictionOptions(1).n_sink(1).n_recent(1),
      EvictionOptions(3).n_sink(2).n_recent(2), EvictionOptions(8).n_sink(4).n_recent(4),
      EvictionOptions(5).n_sink(0).n_recent(3), EvictionOptions(4).n_sink(3).n_recent(0),
  };
  return c;
}

// One hand-worked row through all three entry points: positions 0..S-1, in slot order for
// keep_indices and evict_slots_row, reversed for evict_slots.
void check_hand_row(const EvictionOptions& o, const std::vector<double>& scores, const std::vector<int64_t>& kept) {
  const Policy policy(o);
  const int64_t S = static_cast<int64_t>(scores.size());
  Row r;
  r.scores = scores;
  r.seen = S;
  r.positions.resize(S);
  std::iota(r.positions.begin(), r.positions.end(), 0);
  INFO("n_sink=" << o.n_sink() << " budget=" << o.budget() << " n_recent=" << o.n_recent() << " S=" << S);

  CHECK(kvevict_test::to_vec<int64_t>(policy.keep_indices(scores_tensor({r}))[0]) == kept);

  std::vector<kvevict::detail::Candidate> scratch;
  const int64_t n = std::max<int64_t>(S - policy.capacity(), 0);
  std::vector<float> f(scores.begin(), scores.end());
  std::vector<int64_t> out(n);
  policy.evict_slots_row(f.data(), r.positions.data(), S, S, out.data(), scratch);
  CHECK(kept_after(r, out) == kept);

  Row reversed = r;
  std::reverse(reversed.positions.begin(), reversed.positions.end());
  std::reverse(reversed.scores.begin(), reversed.scores.end());
  const auto ev = policy.evict_slots(scores_tensor({reversed}), positions_tensor({reversed}));
  CHECK(kept_after(reversed, kvevict_test::to_vec<int64_t>(ev[0])) == kept);
}

}  // namespace

TEST_CASE("keep_indices returns [B, min(S, capacity)] int64 positions, ascending, on the scores' device",
          "[selection][cpu]") {
  const Policy policy(EvictionOptions(3).n_sink(2).n_recent(2));  // capacity 7
  std::mt19937 rng(11);
  for (int64_t S : {1, 4, 6, 7, 8, 9, 20}) {
    INFO("S=" << S);
    const auto keep = policy.keep_indices(scores_tensor(prefill_rows(rng, 3, S, 0.0)));
    REQUIRE(keep.sizes() == at::IntArrayRef({3, std::min<int64_t>(S, 7)}));
    CHECK(keep.scalar_type() == at::kLong);
    CHECK(keep.device().is_cpu());
    CHECK(keep.is_contiguous());
    for (int64_t b = 0; b < 3; ++b) {
      const auto v = kvevict_test::to_vec<int64_t>(keep[b]);
      CHECK(std::adjacent_find(v.begin(), v.end(), [](int64_t a, int64_t c) { return a >= c; }) == v.end());
      CHECK(v.front() >= 0);
      CHECK(v.back() < S);
    }
  }
  // S <= capacity: every position, in order.
  const auto all = policy.keep_indices(at::zeros({2, 5}));
  CHECK(at::equal(all, at::arange(5, at::kLong).expand({2, 5})));
}

TEST_CASE("keep_indices matches the oracle on random integer scores with NaN and inf, any floating dtype",
          "[selection][cpu]") {
  std::mt19937 rng(1234);
  for (const auto& o : configs()) {
    const Policy policy(o);
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
      for (int64_t S : {policy.capacity() - 1, policy.capacity(), policy.capacity() + 1, policy.capacity() + 2,
                        2 * policy.capacity() + 3, 3 * policy.capacity() + 9}) {
        if (S < 1) continue;
        for (double non_finite : {0.0, 0.25}) {
          INFO("n_sink=" << o.n_sink() << " budget=" << o.budget() << " n_recent=" << o.n_recent() << " S=" << S
                         << " dtype=" << dtype << " non_finite=" << non_finite);
          check_keep_indices(policy, prefill_rows(rng, 3, S, non_finite), dtype);
        }
      }
    }
  }
}

TEST_CASE("evict_slots (tensor path) matches the oracle on random rows with permuted positions",
          "[selection][cpu]") {
  std::mt19937 rng(99);
  for (const auto& o : configs()) {
    const Policy policy(o);
    for (int trial = 0; trial < 12; ++trial) {
      std::uniform_int_distribution<int64_t> extra(-2, 2 * policy.capacity() + 4);
      const int64_t S = std::max<int64_t>(1, policy.capacity() + extra(rng));
      const double non_finite = trial % 3 == 0 ? 0.0 : 0.2;
      std::vector<Row> rows;
      for (int b = 0; b < 3; ++b) rows.push_back(random_position_row(rng, S, non_finite));
      INFO("n_sink=" << o.n_sink() << " budget=" << o.budget() << " n_recent=" << o.n_recent() << " S=" << S
                     << " trial=" << trial);
      check_evict_slots(policy, rows);
    }
  }
}

TEST_CASE("evict_slots_row (host path) matches the oracle on random cache rows", "[selection][cpu]") {
  std::mt19937 rng(4321);
  std::vector<kvevict::detail::Candidate> scratch;  // reused across rows of every size, as the caches do
  for (const auto& o : configs()) {
    const Policy policy(o);
    for (int trial = 0; trial < 30; ++trial) {
      // Every third row evicts exactly one token (the decode steady state).
      std::uniform_int_distribution<int64_t> extra(1, 2 * policy.capacity() + 4);
      const int64_t S = policy.capacity() + (trial % 3 == 1 ? 1 : extra(rng));
      const double non_finite = trial % 3 == 0 ? 0.0 : 0.2;
      const Row r = random_cache_row(rng, o, S, non_finite);
      INFO("n_sink=" << o.n_sink() << " budget=" << o.budget() << " n_recent=" << o.n_recent() << " S=" << S
                     << " seen=" << r.seen << " trial=" << trial);
      check_evict_slots_row(policy, r, scratch);
    }
  }
}

TEST_CASE("evict_slots and evict_slots_row agree slot for slot on cache rows", "[selection][cpu]") {
  std::mt19937 rng(5);
  std::vector<kvevict::detail::Candidate> scratch;
  for (const auto& o : configs()) {
    const Policy policy(o);
    for (int trial = 0; trial < 6; ++trial) {
      const int64_t S = policy.capacity() + 1 + trial;
      std::vector<Row> rows;
      for (int b = 0; b < 2; ++b) rows.push_back(random_cache_row(rng, o, S, 0.2));
      const auto ev = policy.evict_slots(scores_tensor(rows), positions_tensor(rows));
      for (int b = 0; b < 2; ++b) {
        std::vector<float> f(rows[b].scores.begin(), rows[b].scores.end());
        std::vector<int64_t> out(S - policy.capacity());
        policy.evict_slots_row(f.data(), rows[b].positions.data(), S, rows[b].seen, out.data(), scratch);
        CHECK(kvevict_test::to_vec<int64_t>(ev[b]) == out);
      }
    }
  }
}

TEST_CASE("recall_candidates (recall's victims on the device) and eviction_order match the oracle, with one key or two sorts",
          "[selection][cpu]") {
  // Per row: random scores (ties, NaN, +-inf), distinct positions in a random slot order, some
  // slots dead (-1), a window start. The oracle sorts the candidates (n_sink <= position <
  // recent_from) by the contract's order: non-finite lowest, then score, then the older position.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t B = 3, S = 6 + trial % 11, n_sink = trial % 3, k = 1 + trial % S;
    std::vector<float> ranks;
    std::vector<int64_t> positions, recent_from;
    std::vector<std::vector<int64_t>> want(B);  // per row: candidate slots, lowest first
    for (int64_t b = 0; b < B; ++b) {
      const auto scores = random_scores(rng, S, trial % 2 ? 0.3 : 0.0);
      std::vector<int64_t> pos(static_cast<size_t>(S));
      std::iota(pos.begin(), pos.end(), int64_t{0});
      std::shuffle(pos.begin(), pos.end(), rng);
      for (int64_t s = 0; s < S; ++s) {
        if (std::uniform_int_distribution<int>(0, 5)(rng) == 0) pos[s] = -1;  // a dead slot
        ranks.push_back(static_cast<float>(scores[s]));
        positions.push_back(pos[s]);
      }
      const int64_t from = std::uniform_int_distribution<int64_t>(0, S)(rng);
      recent_from.push_back(from);
      for (int64_t s = 0; s < S; ++s) {
        if (pos[s] >= n_sink && pos[s] < from) want[b].push_back(s);
      }
      const auto lower = [&](int64_t x, int64_t y) {
        const double sx = scores[x], sy = scores[y];
        const bool fx = std::isfinite(sx), fy = std::isfinite(sy);
        if (fx != fy) return !fx;
        if (fx && sx != sy) return sx < sy;
        return pos[x] < pos[y];
      };
      std::sort(want[b].begin(), want[b].end(), lower);
    }
    const auto r = at::tensor(ranks).view({B, S});
    const auto p = at::tensor(positions).view({B, S});
    const auto w = at::tensor(recent_from).view({B, 1});
    CAPTURE(trial, S, n_sink, k);
    for (const int64_t max_seen : {S, kvevict::detail::kKeyPositions + 1}) {  // one key; two stable sorts
      CAPTURE(max_seen);
      const auto c = kvevict::detail::recall_candidates(r, p, n_sink, w, k, max_seen);
      REQUIRE(c.lowest.sizes() == at::IntArrayRef({B, k}));
      for (int64_t b = 0; b < B; ++b) {
        CAPTURE(b);
        const auto n = static_cast<int64_t>(want[b].size());
        CHECK(c.count[b].item<int64_t>() == n);
        for (int64_t j = 0; j < std::min(k, n); ++j) CHECK(c.lowest[b][j].item<int64_t>() == want[b][j]);
        if (n > 0) CHECK(c.best[b][0].item<int64_t>() == want[b].back());
      }
      // eviction_order(): every slot, the dead first, then the live ones as the oracle sorts them.
      const auto order = kvevict::detail::eviction_order(r, p, max_seen);
      for (int64_t b = 0; b < B; ++b) {
        std::vector<int64_t> live;
        for (int64_t s = 0; s < S; ++s) {
          if (positions[b * S + s] >= 0) live.push_back(s);
        }
        std::sort(live.begin(), live.end(), [&](int64_t x, int64_t y) {
          const float sx = ranks[b * S + x], sy = ranks[b * S + y];
          const bool fx = std::isfinite(sx), fy = std::isfinite(sy);
          if (fx != fy) return !fx;
          if (fx && sx != sy) return sx < sy;
          return positions[b * S + x] < positions[b * S + y];
        });
        const auto dead = S - static_cast<int64_t>(live.size());
        CAPTURE(b);
        for (int64_t j = 0; j < dead; ++j) CHECK(positions[b * S + order[b][j].item<int64_t>()] < 0);
        for (size_t j = 0; j < live.size(); ++j) CHECK(order[b][dead + static_cast<int64_t>(j)].item<int64_t>() == live[j]);
      }
    }
  }
}

TEST_CASE("evict_slots returns [B, 0] while S <= capacity", "[selection][cpu]") {
  const Policy policy(EvictionOptions(2).n_sink(1).n_recent(1));  // capacity 4
  for (int64_t S : {1, 3, 4}) {
    const auto ev = policy.evict_slots(at::zeros({2, S}), at::arange(S, at::kLong).expand({2, S}).contiguous());
    CHECK(ev.sizes() == at::IntArrayRef({2, 0}));
    CHECK(ev.scalar_type() == at::kLong);
  }
}

TEST_CASE("Contract: sinks are kept whatever their score, non-finite included", "[selection][cpu]") {
  // Sinks 0, 1 score lowest (and NaN); window 5; candidates 2..4 keep the best one, 4.
  check_hand_row(EvictionOptions(1).n_sink(2).n_recent(1), {-5, kNaN, 1, 2, 3, -7}, {0, 1, 4, 5});
  check_hand_row(EvictionOptions(0).n_sink(3).n_recent(0), {-kInf, -1, kNaN, 9, 9, 9}, {0, 1, 2});
}

TEST_CASE("Contract: the recent window is exactly n_recent tokens, the newest included", "[selection][cpu]") {
  // Old tokens all outscore the window; only the three newest survive.
  check_hand_row(EvictionOptions(0).n_sink(0).n_recent(3), {9, 9, 9, 9, 9, 9, 0, 0}, {5, 6, 7});
  // Window 2 + one heavy hitter: position 5 (score 0) is just outside the window and evicted.
  check_hand_row(EvictionOptions(1).n_sink(1).n_recent(2), {0, 1, 0, 4, 0, 0, 0, 0}, {0, 3, 6, 7});
  // Non-finite window tokens stay.
  check_hand_row(EvictionOptions(1).n_sink(0).n_recent(2), {1, 2, 3, kNaN, kInf}, {2, 3, 4});
}

TEST_CASE("Contract: among equal scores the older token is evicted first", "[selection][cpu]") {
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {1, 1, 1, 1, 1, 1}, {4, 5});
  check_hand_row(EvictionOptions(3).n_sink(0).n_recent(0), {3, 1, 1, 1, 3, 0}, {0, 3, 4});
  // Negative zero ties with zero.
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {0.0, -0.0, 0.0, -0.0}, {2, 3});
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {-0.0, 0.0, -0.0, 0.0, -1}, {2, 3});
  // One eviction (the decode steady state).
  check_hand_row(EvictionOptions(3).n_sink(0).n_recent(0), {2, 2, 2, 2}, {1, 2, 3});
  check_hand_row(EvictionOptions(2).n_sink(1).n_recent(1), {0, 2, 1, 1, 0}, {0, 1, 3, 4});
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {0.0, -0.0, 1}, {1, 2});
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {-0.0, 0.0, 1}, {1, 2});
}

TEST_CASE("Contract: non-finite scores rank below every finite score, ties by position", "[selection][cpu]") {
  // +inf is not "most attended": every finite candidate outranks it.
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {kNaN, kInf, -kInf, -1e30, 0}, {3, 4});
  // Finite candidates run out: the newest non-finite fills the budget.
  check_hand_row(EvictionOptions(3).n_sink(0).n_recent(0), {kNaN, kInf, -kInf, -1e30, 0}, {2, 3, 4});
  check_hand_row(EvictionOptions(4).n_sink(0).n_recent(0), {kNaN, kInf, -kInf, -1e30, 0}, {1, 2, 3, 4});
  check_hand_row(EvictionOptions(1).n_sink(0).n_recent(0), {kInf, kNaN, kNaN}, {2});
  // -FLT_MAX is finite and outranks every non-finite score.
  const double lowest = std::numeric_limits<float>::lowest();
  check_hand_row(EvictionOptions(1).n_sink(0).n_recent(0), {lowest, -kInf, kNaN, kInf}, {0});
  // One eviction (the decode steady state).
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(0), {lowest, -kInf, 0}, {0, 2});
  check_hand_row(EvictionOptions(3).n_sink(0).n_recent(0), {1, kNaN, 2, kInf}, {0, 2, 3});
  check_hand_row(EvictionOptions(3).n_sink(0).n_recent(0), {kNaN, 5, -kInf, 6}, {1, 2, 3});
  check_hand_row(EvictionOptions(3).n_sink(0).n_recent(0), {kInf, 5, kNaN, 6}, {1, 2, 3});
  check_hand_row(EvictionOptions(2).n_sink(1).n_recent(1), {kNaN, kInf, 3, kNaN, kNaN}, {0, 2, 3, 4});
}

TEST_CASE("Contract: rows of a batch choose independently", "[selection][cpu]") {
  const Policy policy(EvictionOptions(1).n_sink(1).n_recent(1));
  // Row 0 favours position 2, row 1 position 4; summed over rows, 4 (1+5) would beat 2 (5+0).
  const auto scores = at::tensor({0.f, 0.f, 5.f, 0.f, 1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 5.f, 0.f}).view({2, 6});
  const auto keep = policy.keep_indices(scores);
  CHECK(kvevict_test::to_vec<int64_t>(keep[0]) == std::vector<int64_t>{0, 2, 5});
  CHECK(kvevict_test::to_vec<int64_t>(keep[1]) == std::vector<int64_t>{0, 4, 5});
  const auto pos = at::arange(6, at::kLong).expand({2, 6}).contiguous();
  const auto ev = policy.evict_slots(scores, pos);
  CHECK(kvevict_test::to_vec<int64_t>(ev[0]) == std::vector<int64_t>{1, 3, 4});
  CHECK(kvevict_test::to_vec<int64_t>(ev[1]) == std::vector<int64_t>{1, 2, 3});
  // Changing row 1 leaves row 0's choice alone.
  auto changed = scores.clone();
  changed[1].fill_(kNaN);
  CHECK(at::equal(policy.keep_indices(changed)[0], keep[0]));
  CHECK(at::equal(policy.evict_slots(changed, pos)[0], ev[0]));
}

TEST_CASE("Contract: budget 0 keeps exactly sinks and window", "[selection][cpu]") {
  check_hand_row(EvictionOptions(0).n_sink(1).n_recent(2), {0, 9, 9, 9, 9, 0, 0}, {0, 5, 6});
  check_hand_row(EvictionOptions(0).n_sink(2).n_recent(0), {0, 0, 9, 9}, {0, 1});
}

TEST_CASE("Contract: n_sink 0 lets position 0 be evicted", "[selection][cpu]") {
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(1), {0, 3, 1, 2, 0}, {1, 3, 4});
  check_hand_row(EvictionOptions(2).n_sink(0).n_recent(1), {5, 3, 1, 2, 0}, {0, 1, 4});
}

TEST_CASE("Contract: n_recent 0 lets the newest token be evicted", "[selection][cpu]") {
  check_hand_row(EvictionOptions(2).n_sink(1).n_recent(0), {0, 3, 1, 2, 0}, {0, 1, 3});
  check_hand_row(EvictionOptions(1).n_sink(0).n_recent(0), {1, 2, 3}, {2});
}

TEST_CASE("Selection is deterministic over repeated calls", "[selection][cpu]") {
  const Policy policy(EvictionOptions(3).n_sink(1).n_recent(2));
  std::mt19937 rng(3);
  const auto rows = prefill_rows(rng, 4, 30, 0.2);
  const auto scores = scores_tensor(rows);
  const auto first = policy.keep_indices(scores);
  const auto pos = positions_tensor(rows);
  const auto first_ev = policy.evict_slots(scores, pos);
  for (int i = 0; i < 20; ++i) {
    CHECK(at::equal(policy.keep_indices(scores), first));
    CHECK(at::equal(policy.evict_slots(scores, pos), first_ev));
  }
}

TEST_CASE("keep_indices rejects scores that are not 2-D floating", "[selection][errors][cpu]") {
  const Policy policy(EvictionOptions(1).n_sink(1).n_recent(1));
  CHECK_THROWS_WITH(policy.keep_indices(at::zeros({5})), Contains("scores must be a 2-D tensor = [B, S], got [5]"));
  CHECK_THROWS_WITH(policy.keep_indices(at::zeros({1, 2, 5})), Contains("got [1, 2, 5]"));
  CHECK_THROWS_WITH(policy.keep_indices(at::zeros({1, 5}, at::kLong)),
                    Contains("scores must have a floating dtype, got Long"));
  CHECK_THROWS_WITH(policy.keep_indices(at::Tensor()), Contains("scores must be a defined tensor"));
}

// Known bug (reported to the lead, failing until fixed): keep_indices converts the scores to
// fp32 before ranking, so double scores that differ below fp32 resolution tie (and the older
// is evicted although it scores higher), and finite doubles above FLT_MAX become +inf and rank
// below every finite score.
TEST_CASE("keep_indices ranks double scores by their value", "[selection][cpu]") {
  const Policy policy(EvictionOptions(1).n_sink(0).n_recent(0));
  CHECK(kvevict_test::to_vec<int64_t>(policy.keep_indices(at::tensor({1.0 + 1e-12, 1.0}, at::kDouble).view({1, 2}))) ==
        std::vector<int64_t>{0});
  CHECK(kvevict_test::to_vec<int64_t>(policy.keep_indices(at::tensor({1e39, 0.0, 1.0}, at::kDouble).view({1, 3}))) ==
        std::vector<int64_t>{0});
}

// Known bug (reported to the lead, failing until fixed): evict_slots checks nothing, so a
// caller's shape mistake surfaces as a raw ATen narrow/gather error (contract rule 8).
TEST_CASE("evict_slots rejects mismatched or non-2-D scores and positions, naming them", "[selection][errors][cpu]") {
  const Policy policy(EvictionOptions(1).n_sink(0).n_recent(0));
  CHECK_THROWS_WITH(policy.evict_slots(at::zeros({1, 4}), at::arange(3, at::kLong).view({1, 3})),
                    Contains("kvevict") && Contains("positions"));
  CHECK_THROWS_WITH(policy.evict_slots(at::zeros({1, 3}), at::arange(4, at::kLong).view({1, 4})),
                    Contains("kvevict") && Contains("positions"));
  CHECK_THROWS_WITH(policy.evict_slots(at::zeros({4}), at::arange(4, at::kLong)), Contains("kvevict") && Contains("scores"));
}

TEST_CASE("keep_indices and evict_slots match the oracle on CUDA, outputs on the device", "[selection][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda(at::kCUDA, 0);
  std::mt19937 rng(77);
  for (const auto& o : configs()) {
    const Policy policy(o);
    for (int trial = 0; trial < 4; ++trial) {
      const int64_t S = policy.capacity() + 1 + 3 * trial;
      INFO("n_sink=" << o.n_sink() << " budget=" << o.budget() << " n_recent=" << o.n_recent() << " S=" << S);
      for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
        check_keep_indices(policy, prefill_rows(rng, 3, S, 0.2), dtype, cuda);
      }
      std::vector<Row> rows;
      for (int b = 0; b < 3; ++b) rows.push_back(random_position_row(rng, S, 0.2));
      check_evict_slots(policy, rows, cuda);
    }
  }
  // Negative zero ties with zero on the device too (a radix sort on bit patterns would not).
  check_keep_indices(Policy(EvictionOptions(2).n_sink(0).n_recent(0)),
                     {Row{{0, 1, 2, 3}, {-0.0, 0.0, -0.0, 0.0}, 4}, Row{{0, 1, 2, 3}, {0.0, -0.0, 0.0, -0.0}, 4}},
                     at::kFloat, cuda);
}
