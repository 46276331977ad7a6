// EvictionPolicy on its own: the eviction state driving storage the caller owns.
#include "support.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

namespace {

using kvevict::EvictionOptions;
using kvevict::EvictionPolicy;
using kvevict::EvictionPolicyOptions;
using kvevict_test::on_both_paths;
using kvevict_test::oracle_keep;
using kvevict_test::to_vec;

// =============================================================================================
// Caller-owned storage: EvictionPolicy driving [B, S, H, D] buffers (flash_attn_with_kvcache)
// and a fused latent [B, S, 576] buffer (FlashMLA) through append() / write_rows() / observe()
// / evict() / apply_moves(), against MlaCache / MlaLatentCache fed the same inputs. Expected
// values come from the caches (separate owners of their own buffers), from the selection
// oracle (support.hpp) and from the documented slot mapping, never from the policy under test.
// =============================================================================================

/// Bit-for-bit equality (fp32 compared as int32: -0 != +0, NaN == NaN of the same payload).
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type()) return false;
  const auto x = a.contiguous(), y = b.contiguous();
  if (x.scalar_type() == at::kFloat) return at::equal(x.view(at::kInt), y.view(at::kInt));
  return at::equal(x, y);
}

/// Ragged appends per step and row: idle rows (0), decode steps (1-3), long chunks (9-20); T is
/// at least the largest count, sometimes more (every row then left-padded).
struct Schedule {
  std::vector<std::vector<int64_t>> counts;  // [step][row]
  std::vector<int64_t> T;                    // [step]
  int64_t max_T = 1;
};

Schedule make_schedule(int64_t batch, int64_t steps, uint32_t seed) {
  std::mt19937 rng(seed);
  Schedule s;
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<int64_t> c(static_cast<size_t>(batch));
    int64_t T = 1;
    for (auto& n : c) {
      const auto r = rng() % 10;
      n = step == 0 ? 1 + rng() % 14 : r < 2 ? 0 : r == 2 ? 9 + rng() % 12 : 1 + rng() % 3;
      T = std::max(T, n);
    }
    if (rng() % 4 == 0) T += 2;
    s.counts.push_back(c);
    s.T.push_back(T);
    s.max_T = std::max(s.max_T, T);
  }
  return s;
}

uint64_t splitmix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Probabilities [B, H, T, S] in the slot order of `positions` [B, S] (-1 dead) for a chunk of
/// T columns whose row b holds its last counts[b] (positions seen_before[b] ..): a value in
/// [0, 0.5) that depends only on (layer, row, head, query position, key position), not on the
/// slot, 0 for a key newer than its query, NaN for pad columns and dead slots (which observe()
/// must ignore). Non-dyadic, so the fixed-point reduction rounds.
at::Tensor make_probs(const at::Tensor& positions, const std::vector<int64_t>& seen_before,
                      const std::vector<int64_t>& counts, int64_t T, int64_t H, int64_t layer) {
  const auto pos = to_vec<int64_t>(positions.reshape({-1}));
  const int64_t B = positions.size(0), S = positions.size(1);
  std::vector<float> p(static_cast<size_t>(B * H * T * S), std::numeric_limits<float>::quiet_NaN());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t q = T - counts[b]; q < T; ++q) {
        const int64_t qpos = seen_before[b] + q - (T - counts[b]);
        for (int64_t s = 0; s < S; ++s) {
          const int64_t kpos = pos[b * S + s];
          if (kpos < 0) continue;
          float v = 0.f;
          if (kpos <= qpos) {
            const uint64_t key = splitmix(splitmix(splitmix(splitmix(layer * 131 + b) + h) + qpos) + kpos);
            v = static_cast<float>(static_cast<double>(key >> 11) * 0x1.0p-53) * 0.5f;
          }
          p[((b * H + h) * T + q) * S + s] = v;
        }
      }
    }
  }
  return at::tensor(p).view({B, H, T, S});
}

/// How a test moves rows of its own storage, and compares them with the cache's.
struct Storage {
  /// The cache's inputs for `T` new columns of `layer` at `step` (in the cache's layout).
  std::function<std::vector<at::Tensor>(int64_t layer, int64_t step, int64_t T)> inputs;
  /// Appends them to the cache (ragged update).
  std::function<void(int64_t layer, const std::vector<at::Tensor>&, const std::vector<int64_t>&)> update_cache;
  /// Writes them into the caller-owned buffers where the slot mapping says (write_rows).
  std::function<void(int64_t layer, const std::vector<at::Tensor>&, const at::Tensor& map)> write;
  /// Applies a pass's moves to the caller-owned buffers (apply_moves).
  std::function<void(int64_t layer, const kvevict::SlotMoves&)> move;
  /// True when row b's first `len` slots of the caller-owned buffers equal the cache's rows.
  std::function<bool(int64_t layer, int64_t b, int64_t len)> same_rows;
};

/// Runs `schedule` through `cache` and through `policy` + `storage`, checking after every
/// observe and every pass that both hold the same positions (slot order), scores and rows, that
/// the slot mapping is the documented one, and that every pass keeps what the oracle keeps.
/// Returns the tokens evicted.
template <class Cache>
int64_t run_differential(Cache& cache, EvictionPolicy<>& policy, Storage& storage, const Schedule& schedule,
                         const EvictionOptions& ev) {
  const int64_t B = policy.batch_size(), H = policy.num_heads(), L = policy.num_layers();
  std::vector<std::vector<int64_t>> seen(static_cast<size_t>(L), std::vector<int64_t>(static_cast<size_t>(B), 0));
  // Per row: appends that brought tokens since the row's last pass (a row evicts when it is over
  // capacity and has appended in evict_every appends, whatever the other rows do).
  auto appends = seen;
  int64_t evicted = 0;
  for (size_t step = 0; step < schedule.counts.size(); ++step) {
    const auto& counts = schedule.counts[step];
    const int64_t T = schedule.T[step];
    for (int64_t l = 0; l < L; ++l) {
      INFO("step " << step << ", layer " << l << ", T " << T);
      std::vector<int64_t> len_before(static_cast<size_t>(B));
      for (int64_t b = 0; b < B; ++b) len_before[b] = cache.size(l, b);
      const auto in = storage.inputs(l, static_cast<int64_t>(step), T);
      storage.update_cache(l, in, counts);
      const auto map = policy.append(l, counts, T);
      // The slot mapping: row b's last counts[b] columns go to its next free slots, pads -1.
      REQUIRE(map.size(0) == B);
      REQUIRE(map.size(1) == T);
      const auto m = to_vec<int64_t>(map.reshape({-1}));
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < T; ++t) {
          const int64_t first = T - counts[b];
          CHECK(m[b * T + t] == (t < first ? -1 : len_before[b] + t - first));
        }
      }
      storage.write(l, in, map);
      const auto& before = seen[l];
      cache.observe(l, make_probs(cache.positions(l), before, counts, T, H, l));
      policy.observe(l, make_probs(policy.positions(l), before, counts, T, H, l));
      for (int64_t b = 0; b < B; ++b) {
        seen[l][b] += counts[b];
        appends[l][b] += counts[b] > 0 ? 1 : 0;
      }
      REQUIRE(same_bits(policy.positions(l), cache.positions(l)));
      REQUIRE(same_bits(policy.scores(l), cache.scores(l)));
      const auto pre_pos = policy.positions(l), pre_scores = policy.scores(l);
      evicted += cache.evict(l);
      storage.move(l, policy.evict(l));
      REQUIRE(same_bits(policy.positions(l), cache.positions(l)));
      REQUIRE(same_bits(policy.scores(l), cache.scores(l)));
      for (int64_t b = 0; b < B; ++b) {
        INFO("row " << b);
        const int64_t len = policy.size(l, b);
        REQUIRE(len == cache.size(l, b));
        REQUIRE(policy.seen_tokens(l, b) == seen[l][b]);
        CHECK(storage.same_rows(l, b, len));
        // The pass kept what the oracle keeps from the positions and scores before it.
        const int64_t n = std::count_if(pre_pos[b].data_ptr<int64_t>(), pre_pos[b].data_ptr<int64_t>() + pre_pos.size(1),
                                        [](int64_t p) { return p >= 0; });
        auto kept = to_vec<int64_t>(policy.positions(l)[b].narrow(0, 0, len));
        std::sort(kept.begin(), kept.end());
        const auto f = to_vec<float>(pre_scores[b].narrow(0, 0, n));
        auto p = to_vec<int64_t>(pre_pos[b].narrow(0, 0, n));
        if (n > ev.capacity() && appends[l][b] >= ev.evict_every()) {
          CHECK(kept == oracle_keep(p, std::vector<double>(f.begin(), f.end()), ev.n_sink(), ev.budget(), ev.n_recent()));
          appends[l][b] = 0;
        } else {
          std::sort(p.begin(), p.end());
          CHECK(kept == p);  // not due: the row keeps everything
        }
      }
    }
  }
  return evicted;
}

TEST_CASE("EvictionPolicy drives caller-owned [B, S, H, D] buffers like MlaCache, ragged, on both paths",
          "[policy][cpu]") {
  const int64_t L = 2, B = 3, H = 2, Dk = 12, Dv = 8;
  const auto ev = EvictionOptions(/*budget=*/6).n_sink(2).n_recent(4).evict_every(1);
  const auto schedule = make_schedule(B, /*steps=*/40, /*seed=*/7);
  on_both_paths([&] {
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(L, H).qk_dim(Dk).v_dim(Dv).batch_size(B), ev);
    EvictionPolicy<> policy(EvictionPolicyOptions(L, H).batch_size(B), ev);
    REQUIRE(policy.host_path() == cache.policy().host_path());
    policy.reserve(ev.capacity() + schedule.max_T);
    // Keys contiguous (moves by memcpy); values a strided view of a wider buffer, so
    // apply_moves takes its tensor-op path (gather, then index_put_) for them.
    std::vector<at::Tensor> keys, values, values_storage;
    for (int64_t l = 0; l < L; ++l) {
      keys.push_back(at::zeros({B, policy.slots(l), H, Dk}));
      values_storage.push_back(at::zeros({B, policy.slots(l), H, Dv + 3}));
      values.push_back(values_storage.back().narrow(3, 1, Dv));
      REQUIRE_FALSE(values.back().is_contiguous());
    }
    Storage storage;
    storage.inputs = [&](int64_t l, int64_t step, int64_t T) {
      at::manual_seed(100 * step + l);
      return std::vector<at::Tensor>{at::randn({B, H, T, Dk}), at::randn({B, H, T, Dv})};
    };
    storage.update_cache = [&](int64_t l, const std::vector<at::Tensor>& in, const std::vector<int64_t>& counts) {
      cache.update(l, in[0], in[1], counts);
    };
    storage.write = [&](int64_t l, const std::vector<at::Tensor>& in, const at::Tensor& map) {
      kvevict::write_rows(keys[l], 1, in[0].transpose(1, 2).contiguous(), map);  // [B, T, H, Dk]
      kvevict::write_rows(values[l], 1, in[1].transpose(1, 2), map);             // strided rows
    };
    storage.move = [&](int64_t l, const kvevict::SlotMoves& moves) {
      kvevict::apply_moves(moves, keys[l], 1);
      kvevict::apply_moves(moves, values[l], 1);
    };
    storage.same_rows = [&](int64_t l, int64_t b, int64_t len) {
      return same_bits(keys[l][b].narrow(0, 0, len), cache.keys(l)[b].narrow(1, 0, len).transpose(0, 1)) &&
             same_bits(values[l][b].narrow(0, 0, len), cache.values(l)[b].narrow(1, 0, len).transpose(0, 1));
    };
    const int64_t evicted = run_differential(cache, policy, storage, schedule, ev);
    CHECK(evicted > 100);  // many passes, most rows over capacity
    CHECK(policy.stats(0).tokens_evicted == cache.stats(0).tokens_evicted);
  });
}

TEST_CASE("EvictionPolicy drives a caller-owned fused latent [B, S, 576] buffer like MlaLatentCache, on both paths",
          "[policy][cpu]") {
  const int64_t L = 2, B = 4, H = 3;
  const auto ev = EvictionOptions(/*budget=*/5).n_sink(1).n_recent(3).evict_every(2);
  const auto schedule = make_schedule(B, /*steps=*/30, /*seed=*/11);
  on_both_paths([&] {
    kvevict::MlaLatentCache cache(kvevict::MlaLatentCacheOptions(L, H).batch_size(B), ev);  // 512 + 64
    EvictionPolicy<> policy(EvictionPolicyOptions(L, H).batch_size(B), ev);
    policy.reserve(ev.capacity() + ev.evict_every() * schedule.max_T);
    std::vector<at::Tensor> fused;  // [B, slots, 576]: ckv 512 then kpe 64 in one row, FlashMLA style
    for (int64_t l = 0; l < L; ++l) fused.push_back(at::zeros({B, policy.slots(l), 576}));
    Storage storage;
    storage.inputs = [&](int64_t l, int64_t step, int64_t T) {
      at::manual_seed(1000 + 100 * step + l);
      return std::vector<at::Tensor>{at::randn({B, T, 512}), at::randn({B, T, 64})};
    };
    storage.update_cache = [&](int64_t l, const std::vector<at::Tensor>& in, const std::vector<int64_t>& counts) {
      cache.update(l, in[0], in[1], counts);
    };
    storage.write = [&](int64_t l, const std::vector<at::Tensor>& in, const at::Tensor& map) {
      kvevict::write_rows(fused[l], 1, at::cat({in[0], in[1]}, 2), map);
    };
    storage.move = [&](int64_t l, const kvevict::SlotMoves& moves) { kvevict::apply_moves(moves, fused[l], 1); };
    storage.same_rows = [&](int64_t l, int64_t b, int64_t len) {
      const auto row = fused[l][b].narrow(0, 0, len);
      return same_bits(row.narrow(1, 0, 512), cache.ckv(l)[b].narrow(0, 0, len)) &&
             same_bits(row.narrow(1, 512, 64), cache.kpe(l)[b].narrow(0, 0, len));
    };
    const int64_t evicted = run_differential(cache, policy, storage, schedule, ev);
    CHECK(evicted > 50);
  });
}

TEST_CASE("apply_moves and write_rows name a bad argument and change nothing", "[policy][cpu]") {
  on_both_paths([] {
    const int64_t B = 2, H = 2, D = 4;
    const auto ev = EvictionOptions(/*budget=*/1).n_sink(1).n_recent(1);
    EvictionPolicy<> policy(EvictionPolicyOptions(1, H).batch_size(B), ev);
    policy.reserve(5);
    auto buffer = at::zeros({B, policy.slots(0), H, D});
    at::manual_seed(3);
    const auto rows = at::randn({B, 5, H, D});
    const auto map = policy.append(0, std::vector<int64_t>{3, 5}, 5);  // more than capacity 3
    kvevict::write_rows(buffer, 1, rows, map);
    policy.add_scores(0, at::tensor({0.5f, 0.1f, 0.9f, 0.f, 0.f, 0.3f, 0.2f, 0.1f, 0.4f, 0.6f}).view({B, 5}));
    const auto moves = policy.evict(0);
    REQUIRE_FALSE(moves.empty());
    const auto snapshot = buffer.clone();
    auto unchanged = [&] { return same_bits(buffer, snapshot); };

    SECTION("apply_moves") {
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, buffer, 0), Catch::Contains("buffer") && Catch::Contains("token_dim"));
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, buffer, 4), Catch::Contains("buffer") && Catch::Contains("token_dim"));
      CHECK_THROWS_AS(kvevict::apply_moves(moves, buffer, -1), c10::IndexError);
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, buffer.narrow(0, 0, 1), 1),
                        Catch::Contains("buffer") && Catch::Contains("batch"));
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, at::zeros({B + 1, policy.slots(0), H, D}), 1),
                        Catch::Contains("buffer") && Catch::Contains("batch"));
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, at::empty({B, policy.slots(0), H, D}, at::Device("meta")), 1),
                        Catch::Contains("buffer") && Catch::Contains("device"));
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, buffer.narrow(1, 0, 1), 1),
                        Catch::Contains("buffer") && Catch::Contains("slots"));
      CHECK_THROWS_WITH(kvevict::apply_moves(moves, at::Tensor(), 1), Catch::Contains("buffer"));
      CHECK(unchanged());
    }
    SECTION("write_rows") {
      const auto more = at::randn({B, 2, H, D});
      const auto map2 = at::tensor(std::vector<int64_t>{0, 1, -1, 2}).view({B, 2});
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 0, more, map2), Catch::Contains("token_dim"));
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 4, more, map2), Catch::Contains("token_dim"));
      // Batch: rows or slot_mapping with another B.
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 1, at::randn({B + 1, 2, H, D}), map2), Catch::Contains("rows"));
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 1, more, map2.narrow(0, 0, 1)), Catch::Contains("slot_mapping"));
      // Device and dtype.
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 1, at::empty({B, 2, H, D}, at::Device("meta")), map2),
                        Catch::Contains("rows") && Catch::Contains("device"));
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 1, more.to(at::kDouble), map2),
                        Catch::Contains("rows") && Catch::Contains("dtype"));
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 1, more, map2.to(at::kInt)), Catch::Contains("slot_mapping"));
      // A slot past the buffer.
      const auto far = at::tensor(std::vector<int64_t>{0, policy.slots(0), -1, 2}).view({B, 2});
      CHECK_THROWS_WITH(kvevict::write_rows(buffer, 1, more, far), Catch::Contains("slot_mapping"));
      CHECK(unchanged());
    }
  });
}

}  // namespace

// =============================================================================================
// Observations in pieces and checked observations: what is rejected, and what the message says.
// =============================================================================================

namespace {

/// Causal probabilities [B, H, Q, Q] of Q queries over the Q tokens of an empty-started policy:
/// query q gives 1 / (q + 1) to each key s <= q.
at::Tensor causal_uniform(int64_t B, int64_t H, int64_t Q) {
  auto p = at::zeros({B, H, Q, Q});
  for (int64_t q = 0; q < Q; ++q) p.select(2, q).narrow(2, 0, q + 1).fill_(1.0 / static_cast<double>(q + 1));
  return p;
}

}  // namespace

TEST_CASE("observe_add rejects a (head, query column) sent twice; observe_end names one never sent",
          "[policy][errors][cpu]") {
  using Catch::Matchers::Contains;
  kvevict_test::on_both_paths([] {
    const int64_t B = 2, H = 2, Q = 3;
    kvevict::EvictionPolicy<> p(kvevict::EvictionPolicyOptions(1, H).batch_size(B), kvevict::EvictionOptions(8));
    p.append(0, std::vector<int64_t>{Q, Q}, Q);
    const auto probs = causal_uniform(B, H, Q);
    const auto before = p.scores(0);
    // Head 0 twice and head 1 never: as many cells as H x Q, but not the right ones.
    p.observe_begin(0, Q);
    p.observe_add(0, probs.narrow(1, 0, 1), 0, 0);
    CHECK_THROWS_WITH(p.observe_add(0, probs.narrow(1, 0, 1), 0, 0),
                      Contains("observe_add") && Contains("(head 0, query column 0)") && Contains("already"));
    CHECK_FALSE(p.observing(0));  // the observation is discarded, the state unchanged
    CHECK(same_bits(p.scores(0), before));
    // A piece that overlaps an earlier one in one column only: column 1 of head 1.
    p.observe_begin(0, Q);
    p.observe_add(0, probs.narrow(1, 1, 1).narrow(2, 0, 2), 0, 1);
    CHECK_THROWS_WITH(p.observe_add(0, probs.narrow(1, 1, 1).narrow(2, 1, 2), 1, 1),
                      Contains("(head 1, query column 1)") && Contains("already"));
    CHECK(same_bits(p.scores(0), before));
    // One cell never sent (head 1, column 2): named at observe_end.
    p.observe_begin(0, Q);
    p.observe_add(0, probs.narrow(1, 0, 1), 0, 0);
    p.observe_add(0, probs.narrow(1, 1, 1).narrow(2, 0, 2), 0, 1);
    CHECK_THROWS_WITH(p.observe_end(0), Contains("observe_end") && Contains("(head 1, query column 2)"));
    CHECK_FALSE(p.observing(0));
    CHECK(same_bits(p.scores(0), before));
    // Every cell once, in any order: key s gets sum over q >= s of 1 / (q + 1), the same from
    // every head (hand-worked: 11/6, 5/6, 1/3).
    p.observe_begin(0, Q);
    p.observe_add(0, probs.narrow(1, 1, 1).narrow(2, 2, 1), 2, 1);
    p.observe_add(0, probs.narrow(1, 0, 1), 0, 0);
    p.observe_add(0, probs.narrow(1, 1, 1).narrow(2, 0, 2), 0, 1);
    p.observe_end(0);
    for (int64_t b = 0; b < B; ++b) {
      const auto s = to_vec<float>(p.scores(0)[b]);
      CHECK(s[0] == Approx(11.0 / 6.0).epsilon(1e-6));
      CHECK(s[1] == Approx(5.0 / 6.0).epsilon(1e-6));
      CHECK(s[2] == Approx(1.0 / 3.0).epsilon(1e-6));
    }
    // LatestAttention counts only the newest column: the others may be left out, but no cell
    // may come twice, and the newest column of every head must come.
    kvevict::EvictionPolicy<kvevict::LatestAttention> latest(kvevict::EvictionPolicyOptions(1, H).batch_size(B),
                                                             kvevict::EvictionOptions(8));
    latest.append(0, std::vector<int64_t>{Q, Q}, Q);
    latest.observe_begin(0, Q);
    latest.observe_add(0, probs.narrow(2, Q - 1, 1).narrow(1, 0, 1), Q - 1, 0);
    CHECK_THROWS_WITH(latest.observe_end(0), Contains("(head 1, query column 2)"));
    latest.observe_begin(0, Q);
    latest.observe_add(0, probs.narrow(2, Q - 1, 1), Q - 1, 0);
    CHECK_THROWS_WITH(latest.observe_add(0, probs.narrow(2, Q - 1, 1).narrow(1, 1, 1), Q - 1, 1),
                      Contains("(head 1, query column 2)") && Contains("already"));
    latest.observe_begin(0, Q);
    latest.observe_add(0, probs.narrow(2, Q - 1, 1), Q - 1, 0);
    latest.observe_end(0);
    CHECK(to_vec<float>(latest.scores(0)[0]) == std::vector<float>(3, 1.f / 3.f));
  });
}

TEST_CASE("A rejected observation names the bad value and its [b, h, q, s] on both paths", "[policy][errors][cpu]") {
  using Catch::Matchers::Contains;
  const int64_t B = 2, H = 2, Q = 3;
  for (const bool lazy : {false, true}) {
    INFO("lazy_reduction " << lazy);
    std::vector<std::string> messages[2];  // per path: every message, in order
    for (const bool tensor_path : {false, true}) {
      kvevict_test::ForceTensorPath force(tensor_path);
      INFO("tensor path " << tensor_path);
      kvevict::EvictionPolicy<> p(kvevict::EvictionPolicyOptions(1, H).batch_size(B).lazy_reduction(lazy),
                                  kvevict::EvictionOptions(8));
      REQUIRE(p.checks_observations());
      p.append(0, std::vector<int64_t>{Q, Q}, Q);
      const auto good = causal_uniform(B, H, Q);
      p.observe(0, good);
      p.flush(0);
      const auto before = p.scores(0);
      auto& m = messages[tensor_path];
      // Out of range: the first bad value in [b, h, q, s] order is named, not the later one.
      auto range = good.clone();
      range[1][1][2][0] = 1.5f;
      range[1][1][2][1] = 2.f;
      m.push_back(kvevict_test::message_of([&] { p.observe(0, range); }));
      CHECK_THAT(m.back(), Contains("1.5 at [1, 1, 2, 0]"));
      auto nan = good.clone();
      nan[0][1][1][1] = std::numeric_limits<float>::quiet_NaN();
      m.push_back(kvevict_test::message_of([&] { p.observe(0, nan); }));
      CHECK_THAT(m.back(), Contains("nan at [0, 1, 1, 1]"));
      // Not causal: query column 0 (position 0) gives 0.25 to the key at position 2.
      auto future = good.clone();
      future[0][1][0][2] = 0.25f;
      m.push_back(kvevict_test::message_of([&] { p.observe(0, future); }));
      CHECK_THAT(m.back(), Contains("key at position 2 is newer than its query at position 0") &&
                               Contains("0.25 at [0, 1, 0, 2]"));
      // In pieces, the index is the whole observation's: head 1, query column 2.
      m.push_back(kvevict_test::message_of([&] {
        p.observe_begin(0, Q);
        p.observe_add(0, range.narrow(1, 0, 1), 0, 0);
        p.observe_add(0, range.narrow(1, 1, 1).narrow(2, 1, 2), 1, 1);
        p.observe_add(0, range.narrow(1, 1, 1).narrow(2, 0, 1), 0, 1);
        p.observe_end(0);
      }));
      CHECK_THAT(m.back(), Contains("1.5 at [1, 1, 2, 0]"));
      p.flush(0);
      CHECK(same_bits(p.scores(0), before));
      CHECK_FALSE(p.observing(0));
      if (!lazy) {
        // A non-finite rank: named by row and slot, with the contribution and the rank.
        auto scores = at::zeros({B, Q});
        scores[1][2] = std::numeric_limits<float>::infinity();
        m.push_back(kvevict_test::message_of([&] { p.add_scores(0, scores); }));
        CHECK_THAT(m.back(), Contains("at row 1, slot 2 (contribution inf, rank inf)"));
        CHECK(same_bits(p.scores(0), before));
      }
    }
    CHECK(messages[0] == messages[1]);  // the same words on both paths
  }
}
