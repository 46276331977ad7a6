// Sequences in a cache (docs/DESIGN.md, "Per sequence"): rows that join and leave (finish,
// add_sequence, reset(row)), ragged and left-padded appends, rollback (truncate), and memory
// that stays capped (growth given back after a pass, reset(), reserve()). Expected values are
// hand-worked or come from separate batch-1 caches fed the same inputs.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

using Catch::Matchers::Contains;

namespace {

using kvevict::EvictionOptions;
using kvevict::MlaCache;
using kvevict::MlaCacheOptions;
using kvevict_test::kept_positions;
using kvevict_test::on_both_paths;
using kvevict_test::to_vec;

constexpr int64_t kQk = 6, kV = 4;

MlaCacheOptions options(int64_t B, int64_t H = 2, int64_t layers = 1) {
  return MlaCacheOptions(layers, H).batch_size(B).qk_dim(kQk).v_dim(kV);
}

bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto x = a.to(at::kCPU).contiguous(), y = b.to(at::kCPU).contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// Keys of one token: every element equals 100 * id + position (so rows are recognisable).
at::Tensor key_rows(int64_t B, int64_t H, int64_t T, float id, int64_t first_position, int64_t width) {
  auto t = at::arange(first_position, first_position + T, at::kFloat).add(100 * id);
  return t.view({1, 1, T, 1}).expand({B, H, T, width}).contiguous();
}

/// Row b's live keys in position order, as [H, S_b, qk].
at::Tensor ordered_keys(const MlaCache& c, int64_t layer, int64_t b) {
  const auto o = c.ordered(layer);
  const int64_t n = c.size(layer, b);
  return o.keys[b].narrow(1, 0, n);
}

}  // namespace

TEST_CASE("finish frees a row, add_sequence reuses it, the other rows go on", "[sequences][cpu]") {
  on_both_paths([] {
    MlaCache cache(options(3), EvictionOptions(2).n_sink(1).n_recent(1));  // capacity 4
    for (int64_t l = 0; l < 6; ++l) {
      cache.update(0, at::randn({3, 2, 1, kQk}), at::randn({3, 2, 1, kV}));
      cache.evict(0);
    }
    CHECK(cache.size(0, 1) == 4);
    cache.finish(1);
    CHECK_FALSE(cache.active(1));
    CHECK(cache.size(0, 1) == 0);
    CHECK(cache.seen_tokens(0, 1) == 0);
    CHECK(cache.size(0, 0) == 4);
    CHECK(cache.seen_tokens(0, 0) == 6);
    // A plain update appends to the active rows only.
    cache.update(0, at::randn({3, 2, 1, kQk}), at::randn({3, 2, 1, kV}));
    CHECK(cache.size(0, 0) == 5);
    CHECK(cache.size(0, 1) == 0);
    CHECK(to_vec<int64_t>(cache.positions(0)[1]) == std::vector<int64_t>(5, -1));
    // A count for a free row is an error naming the row; nothing changes.
    CHECK_THROWS_WITH(cache.update(0, at::randn({3, 2, 1, kQk}), at::randn({3, 2, 1, kV}), {1, 1, 1}),
                      Contains("row 1 holds no sequence"));
    CHECK(cache.size(0, 0) == 5);
    CHECK_THROWS_WITH(cache.finish(1), Contains("finish: row 1 holds no sequence"));
    // add_sequence takes the lowest free row; positions restart at 0.
    CHECK(cache.add_sequence() == 1);
    cache.update(0, at::randn({3, 2, 2, kQk}), at::randn({3, 2, 2, kV}), {0, 2, 1});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 1});
    CHECK(cache.seen_tokens(0, 2) == 8);
    CHECK_THROWS_WITH(cache.add_sequence(), Contains("all 3 rows hold a sequence"));
    // reset(row) empties one row, which stays active.
    cache.reset(2);
    CHECK(cache.active(2));
    CHECK(cache.size(0, 2) == 0);
    CHECK(cache.size(0, 0) == 5);
  });
}

TEST_CASE("left padding: pads are never stored, scored or attended; a padded row equals its own cache",
          "[sequences][cpu]") {
  on_both_paths([] {
    at::manual_seed(3);
    const int64_t H = 2, T = 5;
    // Row 0: a 5-token prompt; row 1: a 2-token prompt, left-padded by 3.
    MlaCache batch(options(2, H), EvictionOptions(1).n_sink(1).n_recent(1));  // capacity 3
    MlaCache alone(options(1, H), EvictionOptions(1).n_sink(1).n_recent(1));
    const auto k = at::randn({2, H, T, kQk}), v = at::randn({2, H, T, kV}), q = at::randn({2, H, T, kQk});
    // Pads hold NaN: if a pad were stored or attended, NaN would show.
    k[1].narrow(1, 0, 3).fill_(std::numeric_limits<float>::quiet_NaN());
    v[1].narrow(1, 0, 3).fill_(std::numeric_limits<float>::quiet_NaN());
    batch.update(0, k, v, {5, 2});
    alone.update(0, k[1].narrow(1, 3, 2).unsqueeze(0).contiguous(), v[1].narrow(1, 3, 2).unsqueeze(0).contiguous());
    CHECK(batch.size(0, 1) == 2);
    CHECK(to_vec<int64_t>(batch.positions(0)[1]) == std::vector<int64_t>{0, 1, -1, -1, -1});
    at::Tensor probs, probs_alone;
    const auto out = kvevict::attend(q, batch, 0, c10::nullopt, &probs);
    const auto out_alone =
        kvevict::attend(q[1].narrow(1, 3, 2).unsqueeze(0).contiguous(), alone, 0, c10::nullopt, &probs_alone);
    // Pad queries: zero output and zero probabilities.
    CHECK(out[1].narrow(1, 0, 3).abs().max().item<float>() == 0.f);
    CHECK(probs[1].narrow(1, 0, 3).abs().max().item<float>() == 0.f);
    CHECK(bit_equal(out[1].narrow(1, 3, 2), out_alone[0]));
    CHECK(bit_equal(probs[1].narrow(1, 3, 2).narrow(2, 0, 2), probs_alone[0]));
    CHECK(at::isfinite(out).all().item<bool>());
    CHECK(bit_equal(batch.scores(0)[1].narrow(0, 0, 2), alone.scores(0)[0]));
    // Decode both rows; rows of different lengths evict on their own.
    for (int step = 0; step < 4; ++step) {
      const auto k1 = at::randn({2, H, 1, kQk}), v1 = at::randn({2, H, 1, kV}), q1 = at::randn({2, H, 1, kQk});
      batch.update(0, k1, v1);
      alone.update(0, k1[1].unsqueeze(0).contiguous(), v1[1].unsqueeze(0).contiguous());
      const auto o = kvevict::attend(q1, batch, 0);
      const auto oa = kvevict::attend(q1[1].unsqueeze(0).contiguous(), alone, 0);
      CHECK(bit_equal(o[1], oa[0]));
      batch.evict(0);
      alone.evict(0);
      CHECK(kept_positions(batch, 0, 1) == std::vector<int64_t>(kept_positions(alone, 0, 0)));
      CHECK(bit_equal(ordered_keys(batch, 0, 1), ordered_keys(alone, 0, 0)));
    }
    CHECK(batch.size(0, 0) == 3);
    CHECK(batch.size(0, 1) == 3);
  });
}

TEST_CASE("a ragged append gives each row its own length; 0 appends nothing", "[sequences][cpu]") {
  on_both_paths([] {
    MlaCache cache(options(3, 1), EvictionOptions(8));
    cache.update(0, key_rows(3, 1, 3, 0, 0, kQk), at::zeros({3, 1, 3, kV}), {3, 0, 1});
    CHECK(cache.size(0) == 3);  // the longest row
    CHECK(cache.size(0, 0) == 3);
    CHECK(cache.size(0, 1) == 0);
    CHECK(cache.size(0, 2) == 1);
    CHECK(to_vec<int64_t>(cache.positions(0)[2]) == std::vector<int64_t>{0, -1, -1});
    // Row 2's token is its last column (left padding): key 2 (100 * 0 + column 2).
    CHECK(cache.keys(0)[2][0][0][0].item<float>() == 2.f);
    CHECK_THROWS_WITH(cache.update(0, at::zeros({3, 1, 2, kQk}), at::zeros({3, 1, 2, kV}), {3, 0, 0}),
                      Contains("counts[0] must be in [0, T = 2], got 3"));
    CHECK_THROWS_WITH(cache.update(0, at::zeros({3, 1, 2, kQk}), at::zeros({3, 1, 2, kV}), {1, 1}),
                      Contains("counts must have B = 3 entries, got 2"));
    CHECK(cache.size(0, 0) == 3);
  });
}

TEST_CASE("truncate rolls back the newest tokens; evicted ones cannot be rolled back", "[sequences][cpu]") {
  on_both_paths([] {
    // capacity 1 + 2 + 2 = 5, evict_every 1.
    MlaCache cache(options(2, 2, /*layers=*/2), EvictionOptions(2).n_sink(1).n_recent(2));
    MlaCache reference(options(2, 2, 2), EvictionOptions(2).n_sink(1).n_recent(2));
    // 7 tokens with scores, one pass to capacity, identical in both caches.
    for (int64_t l = 0; l < 2; ++l) {
      for (auto* c : {&cache, &reference}) {
        c->update(l, key_rows(2, 2, 7, 1, 0, kQk), key_rows(2, 2, 7, 1, 0, kV));
        c->add_scores(l, at::tensor({0.f, 5.f, 1.f, 4.f, 2.f, 0.f, 0.f}).expand({2, 7}).contiguous());
        CHECK(c->evict(l) == 2 * 2);  // keeps 0, 1, 3, 5, 6
      }
    }
    // Three drafts (positions 7, 8, 9) join `cache` only; then two are rejected.
    for (int64_t l = 0; l < 2; ++l) cache.update(l, key_rows(2, 2, 3, 9, 7, kQk), key_rows(2, 2, 3, 9, 7, kV));
    cache.truncate(0, 2);
    CHECK(cache.seen_tokens(0, 0) == 8);
    CHECK(cache.seen_tokens(0, 1) == 10);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 1, 3, 5, 6, 7});
    CHECK(kept_positions(cache, 1, 0) == std::vector<int64_t>{0, 1, 3, 5, 6, 7});
    // The next token takes position 8 again; after it, row 0 equals a cache that only ever saw
    // the accepted token.
    for (int64_t l = 0; l < 2; ++l) {
      const auto k = at::cat({key_rows(1, 2, 1, 9, 7, kQk), key_rows(1, 2, 1, 3, 8, kQk)}, 2);
      const auto v = at::cat({key_rows(1, 2, 1, 9, 7, kV), key_rows(1, 2, 1, 3, 8, kV)}, 2);
      reference.update(l, at::cat({k, k}, 0), at::cat({v, v}, 0));
      cache.update(l, at::cat({key_rows(1, 2, 1, 3, 8, kQk), key_rows(1, 2, 1, 3, 10, kQk)}, 0),
                   at::cat({key_rows(1, 2, 1, 3, 8, kV), key_rows(1, 2, 1, 3, 10, kV)}, 0));
      cache.evict(l);
      reference.evict(l);
      CHECK(kept_positions(cache, l, 0) == kept_positions(reference, l, 0));
      CHECK(bit_equal(ordered_keys(cache, l, 0), ordered_keys(reference, l, 0)));
      CHECK(bit_equal(cache.ordered(l).values[0], reference.ordered(l).values[0]));
    }
    // Rolling back past an evicted token fails in every layer and changes nothing.
    const auto before = cache.positions(0);
    CHECK_THROWS_WITH(cache.truncate(0, 4), Contains("already evicted"));
    CHECK(bit_equal(cache.positions(0), before));
    CHECK(cache.seen_tokens(0, 0) == 9);
    CHECK_THROWS_WITH(cache.truncate(0, 10), Contains("k must be <= seen tokens"));
    CHECK_THROWS_WITH(cache.truncate(0, -1), Contains("k must be >= 0, got -1"));
    CHECK_THROWS_AS(cache.truncate(2, 1), c10::IndexError);
  });
}

TEST_CASE("the cap is a cap: a long append's growth is given back by the next pass and by reset()",
          "[sequences][cpu]") {
  on_both_paths([] {
    MlaCache cache(options(1, 2), EvictionOptions(4).n_sink(2).n_recent(2));  // capacity 8, 9 + the trash slot
    const int64_t initial = cache.stats().bytes_allocated;
    CHECK(cache.slots(0) == 10);
    cache.update(0, at::randn({1, 2, 2000, kQk}), at::randn({1, 2, 2000, kV}));  // a long prefill
    CHECK(cache.slots(0) >= 2001);
    CHECK(cache.stats().bytes_allocated > 100 * initial);
    cache.add_scores(0, at::rand({1, 2000}));
    CHECK(cache.evict(0) == 1992);
    CHECK(cache.slots(0) == 10);
    CHECK(cache.stats().bytes_allocated == initial);
    cache.update(0, at::randn({1, 2, 500, kQk}), at::randn({1, 2, 500, kV}));
    CHECK(cache.slots(0) >= 509);
    cache.reset();
    CHECK(cache.slots(0) == 10);
    CHECK(cache.stats().bytes_allocated == initial);
    CHECK(cache.size(0) == 0);
  });
}

TEST_CASE("reserve pre-sizes the buffers: appends that fit never move them", "[sequences][cpu]") {
  on_both_paths([] {
    MlaCache cache(options(2, 2), EvictionOptions(4).n_sink(2).n_recent(2));  // capacity 8
    cache.reserve(64);  // room for 64 tokens: 65 slots with the trash slot
    CHECK(cache.slots(0) == 65);
    cache.update(0, at::randn({2, 2, 60, kQk}), at::randn({2, 2, 60, kV}));
    const void* keys = cache.keys(0).data_ptr();
    cache.add_scores(0, at::rand({2, 60}));
    cache.evict(0);
    for (int i = 0; i < 30; ++i) {
      cache.update(0, at::randn({2, 2, 1, kQk}), at::randn({2, 2, 1, kV}));
      cache.evict(0);
    }
    CHECK(cache.slots(0) == 65);  // not shrunk below the reservation
    CHECK(cache.keys(0).data_ptr() == keys);
    cache.reset();
    CHECK(cache.slots(0) == 65);
    CHECK_THROWS_WITH(cache.reserve(0), Contains("reserve: tokens must be in [1, 2^40], got 0"));
  });
}

TEST_CASE("truncate moves rows when a rolled-back token sits below the tail", "[sequences][cpu]") {
  on_both_paths([] {
    MlaCache cache(options(2, 2), EvictionOptions(2).n_sink(1).n_recent(2));  // capacity 5
    cache.update(0, key_rows(2, 2, 7, 1, 0, kQk), key_rows(2, 2, 7, 1, 0, kV));
    cache.add_scores(0, at::tensor({0.f, 5.f, 1.f, 0.5f, 4.f, 0.f, 0.f}).expand({2, 7}).contiguous());
    REQUIRE(cache.evict(0) == 2 * 2);  // keeps 0, 1, 4, 5, 6: slots 2, 3 take the tail rows 5, 6
    const auto pos = to_vec<int64_t>(cache.positions(0)[0]);
    const auto slot_of_6 = std::find(pos.begin(), pos.end(), 6) - pos.begin();
    REQUIRE(slot_of_6 < 4);  // position 6 no longer sits in the last slot
    cache.truncate(0, 1);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 1, 4, 5});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 1, 4, 5, 6});
    // Every live slot still holds its own position's rows: key = 100 + position.
    const auto keys = cache.keys(0).cpu();
    for (int64_t b = 0; b < 2; ++b) {
      const auto p = to_vec<int64_t>(cache.positions(0)[b]);
      for (int64_t s = 0; s < cache.size(0, b); ++s) {
        INFO("row " << b << ", slot " << s);
        CHECK(keys[b][1][s][0].item<float>() == 100.f + static_cast<float>(p[s]));
      }
    }
    CHECK(cache.seen_tokens(0, 0) == 6);
  });
}

TEST_CASE("truncate is all or nothing: an allocation failure at any point changes no layer", "[sequences][cpu]") {
  // Two layers with the same history; rolling back 1 token of row 0 moves a row in each (see
  // the test above). Every allocation truncate makes is failed in turn: each failure must leave
  // every layer's positions, seen tokens and K/V rows as they were.
  on_both_paths([] {
    bool completed = false;
    for (int64_t fail_at = 1; fail_at < 200 && !completed; ++fail_at) {
      INFO("failing allocation " << fail_at);
      MlaCache cache(options(2, 2, /*layers=*/2), EvictionOptions(2).n_sink(1).n_recent(2));  // capacity 5
      for (int64_t l = 0; l < 2; ++l) {
        cache.update(l, key_rows(2, 2, 7, 1, 0, kQk), key_rows(2, 2, 7, 1, 0, kV));
        cache.add_scores(l, at::tensor({0.f, 5.f, 1.f, 0.5f, 4.f, 0.f, 0.f}).expand({2, 7}).contiguous());
        REQUIRE(cache.evict(l) == 2 * 2);  // keeps 0, 1, 4, 5, 6: slots 2, 3 take the tail rows 5, 6
      }
      std::vector<at::Tensor> positions, keys, values;
      for (int64_t l = 0; l < 2; ++l) {
        positions.push_back(cache.positions(l).clone());
        keys.push_back(cache.keys(l).clone());
        values.push_back(cache.values(l).clone());
      }
      bool failed = false;
      {
        kvevict_test::CountingCpuAllocator failing;
        failing.fail_at(fail_at);
        try {
          cache.truncate(0, 1);
        } catch (const c10::Error&) {
          failed = true;
        }
      }
      for (int64_t l = 0; l < 2; ++l) {
        INFO("layer " << l);
        if (failed) {
          CHECK(cache.seen_tokens(l, 0) == 7);
          CHECK(cache.size(l, 0) == 5);
          CHECK(bit_equal(cache.positions(l), positions[l]));
          CHECK(bit_equal(cache.keys(l), keys[l]));
          CHECK(bit_equal(cache.values(l), values[l]));
        } else {
          CHECK(cache.seen_tokens(l, 0) == 6);
          CHECK(kept_positions(cache, l, 0) == std::vector<int64_t>{0, 1, 4, 5});
          // Every live slot holds its own position's rows: key = value = 100 + position.
          const auto k = cache.keys(l).cpu(), v = cache.values(l).cpu();
          const auto p = to_vec<int64_t>(cache.positions(l)[0]);
          for (int64_t s = 0; s < cache.size(l, 0); ++s) {
            INFO("slot " << s);
            CHECK(k[0][1][s][0].item<float>() == 100.f + static_cast<float>(p[s]));
            CHECK(v[0][1][s][0].item<float>() == 100.f + static_cast<float>(p[s]));
          }
        }
      }
      completed = !failed;
    }
    CHECK(completed);
  });
}

TEST_CASE("an update when every row is free is refused, naming the row; the cache is unchanged", "[sequences][cpu]") {
  // finish(row) then update: the tokens would go nowhere (a free row in a batch with active rows
  // appends nothing, by design; with no active row the whole update would be dropped).
  on_both_paths([] {
    MlaCache one(options(1), EvictionOptions(2).n_sink(1).n_recent(1));
    one.update(0, at::randn({1, 2, 3, kQk}), at::randn({1, 2, 3, kV}));
    one.finish(0);
    const int64_t slots = one.slots(0);
    CHECK_THROWS_WITH(one.update(0, at::randn({1, 2, 2, kQk}), at::randn({1, 2, 2, kV})),
                      Contains("update: no row holds a sequence (row 0 is free: finish()ed)") &&
                          Contains("the 2 new tokens would be dropped") && Contains("add_sequence() first") &&
                          Contains("the cache is unchanged"));
    CHECK(one.size(0) == 0);
    CHECK(one.seen_tokens(0) == 0);
    CHECK(one.slots(0) == slots);
    CHECK(one.stats().tokens_evicted == 0);
    CHECK(one.add_sequence() == 0);
    one.update(0, key_rows(1, 2, 2, 1, 0, kQk), at::zeros({1, 2, 2, kV}));
    CHECK(kept_positions(one, 0, 0) == std::vector<int64_t>{0, 1});

    kvevict::MlaLatentCache latent(kvevict::MlaLatentCacheOptions(1, 2).batch_size(3).kv_lora_rank(4).qk_rope_dim(2),
                                   EvictionOptions(2).n_sink(1).n_recent(1));
    for (int64_t r = 0; r < 3; ++r) latent.finish(r);
    CHECK_THROWS_WITH(latent.update(0, at::randn({3, 1, 4}), at::randn({3, 1, 2})),
                      Contains("no row holds a sequence (all 3 rows are free: finish()ed)"));
    CHECK(latent.seen_tokens(0) == 0);
    // Counts given explicitly: all zero is an idle step, accepted as before.
    latent.update(0, at::randn({3, 1, 4}), at::randn({3, 1, 2}), {0, 0, 0});
    CHECK(latent.size(0) == 0);
    CHECK(latent.add_sequence() == 0);
    latent.update(0, at::randn({3, 1, 4}), at::randn({3, 1, 2}));  // row 0 only
    CHECK(latent.size(0, 0) == 1);
    CHECK(latent.size(0, 1) == 0);
  });
}

namespace {

/// A prompt of T tokens for an expanded cache of B rows, H heads, with its causal LSE.
struct Prompt {
  at::Tensor q, k, v, lse;
};
Prompt expanded_prompt(int64_t B, int64_t H, int64_t T) {
  const auto q = at::randn({B, H, T, kQk}), k = at::randn({B, H, T, kQk}), v = at::randn({B, H, T, kV});
  const auto logits = at::matmul(q, k.transpose(-2, -1)).div(std::sqrt(static_cast<double>(kQk)));
  return {q, k, v, at::logsumexp(logits.masked_fill(at::ones({T, T}, at::kBool).triu(1), -INFINITY), -1)};
}

}  // namespace

TEST_CASE("compress_prompt into a cache whose every row is free is refused up front; the cache is unchanged",
          "[sequences][lse][cpu]") {
  on_both_paths([] {
    at::manual_seed(5);
    const auto p = expanded_prompt(1, 2, 12);
    for (const int64_t tier : {0, 50}) {
      INFO("tier_tokens " << tier);
      MlaCache cache(options(1).tier_tokens(tier), EvictionOptions(2).n_sink(1).n_recent(2));
      cache.update(0, p.k, p.v);
      cache.finish(0);
      const int64_t slots = cache.slots(0);
      CHECK_THROWS_WITH(kvevict::compress_prompt(cache, 0, p.q, p.k, p.v, p.lse),
                        Contains("compress_prompt: no row of cache holds a sequence (row 0 is free: finish()ed)") &&
                            Contains("add_sequence() first") && Contains("the cache is unchanged"));
      CHECK(cache.size(0) == 0);
      CHECK(cache.seen_tokens(0) == 0);
      CHECK(cache.slots(0) == slots);
      CHECK(cache.stats().tokens_evicted == 0);
      CHECK(cache.stats().eviction_events == 0);
      // After add_sequence() the same call works.
      REQUIRE(cache.add_sequence() == 0);
      CHECK(kvevict::compress_prompt(cache, 0, p.q, p.k, p.v, p.lse).size(1) == 5);
      CHECK(cache.seen_tokens(0) == 12);
    }
    kvevict::MlaLatentCache latent(kvevict::MlaLatentCacheOptions(1, 2).batch_size(2).kv_lora_rank(4).qk_rope_dim(2),
                                   EvictionOptions(2).n_sink(1).n_recent(2));
    latent.finish(0);
    latent.finish(1);
    const auto ckv = at::randn({2, 6, 4}), kpe = at::randn({2, 6, 2});
    CHECK_THROWS_WITH(kvevict::compress_prompt_absorbed(latent, 0, at::randn({2, 2, 6, 4}), at::randn({2, 2, 6, 2}), ckv,
                                                         kpe, at::zeros({2, 2, 6})),
                      Contains("compress_prompt_absorbed: no row of cache holds a sequence (all 2 rows are free"));
    CHECK(latent.seen_tokens(0) == 0);
  });
}

TEST_CASE("compress_prompt with a free row: the active rows as alone, the free row stays empty",
          "[sequences][lse][cpu]") {
  on_both_paths([] {
    at::manual_seed(6);
    const int64_t T = 20;
    const auto p = expanded_prompt(2, 2, T);
    const auto e = EvictionOptions(3).n_sink(1).n_recent(2);  // capacity 6
    for (const int64_t tier : {0, 50}) {
      INFO("tier_tokens " << tier);
      MlaCache batch(options(2).tier_tokens(tier), e), alone(options(1).tier_tokens(tier), e);
      batch.finish(1);
      const auto keep = kvevict::compress_prompt(batch, 0, p.q, p.k, p.v, p.lse);
      const auto row0 = [](const at::Tensor& t) { return t.narrow(0, 0, 1).contiguous(); };
      const auto keep_alone = kvevict::compress_prompt(alone, 0, row0(p.q), row0(p.k), row0(p.v), row0(p.lse));
      CHECK(at::equal(keep[0], keep_alone[0]));
      CHECK(kept_positions(batch, 0, 0) == kept_positions(alone, 0, 0));
      CHECK(kept_positions(batch, 0, 0) == to_vec<int64_t>(keep[0]));
      CHECK(to_vec<int64_t>(keep[1]) == std::vector<int64_t>(6, -1));  // the free row receives nothing
      CHECK(batch.seen_tokens(0, 0) == T);
      CHECK(batch.size(0, 1) == 0);
      CHECK(batch.seen_tokens(0, 1) == 0);
      CHECK(batch.stats().tokens_evicted == T - 6);  // row 0's dropped prompt tokens only
      CHECK(batch.stats().tokens_evicted == alone.stats().tokens_evicted);
      CHECK_FALSE(batch.active(1));
    }
  });
}
