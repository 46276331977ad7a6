// MlaCache (expanded layout): update / observe / evict bookkeeping against hand-worked
// examples, every error path (the cache is unchanged after a throw), and a randomized
// differential test against a brute-force reference cache written here.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <c10/core/InferenceMode.h>
#include <c10/util/Optional.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

using Catch::Matchers::Contains;

namespace {

using kvevict::BasicMlaCache;
using kvevict::CumulativeAttention;
using kvevict::EvictionOptions;
using kvevict::EvictionPolicy;
using kvevict::LatestAttention;
using kvevict::MeanObservedAttention;
using kvevict::MlaCache;
using kvevict::MlaCacheOptions;
using kvevict_test::ForceTensorPath;
using kvevict_test::kept_positions;
using kvevict_test::oracle_keep;
using kvevict_test::to_vec;

constexpr int64_t kQk = 6;  // small qk_dim for the hand-worked tests
constexpr int64_t kV = 4;   // small v_dim
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

MlaCacheOptions small_options(int64_t layers, int64_t batch, int64_t heads, at::ScalarType dtype = at::kFloat) {
  return MlaCacheOptions(layers, heads).batch_size(batch).qk_dim(kQk).v_dim(kV).dtype(dtype);
}

/// True when both tensors have the same dtype and shape and identical bytes.
bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto x = a.to(at::kCPU).contiguous(), y = b.to(at::kCPU).contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

/// A float tensor of `shape` holding `values` (row-major).
at::Tensor tensor_of(std::vector<float> values, std::vector<int64_t> shape) {
  return at::from_blob(values.data(), shape, at::kFloat).clone();
}

/// Everything appended to one layer since construction or reset, indexed by position.
struct Appended {
  at::Tensor k, v;  // [B, H, seen, qk_dim], [B, H, seen, v_dim]
  void add(const at::Tensor& k_new, const at::Tensor& v_new) {
    k = k.defined() ? at::cat({k, k_new.cpu()}, 2) : k_new.cpu().clone();
    v = v.defined() ? at::cat({v, v_new.cpu()}, 2) : v_new.cpu().clone();
  }
};

/// Each live slot holds exactly the rows of the position positions() gives it, and ordered()
/// is the position-sorted copy of those rows.
template <class Cache>
void check_rows(const Cache& cache, int64_t layer, const Appended& a) {
  const at::Tensor pos = cache.positions(layer).cpu();
  const auto k = cache.keys(layer).cpu(), v = cache.values(layer).cpu();
  const kvevict::OrderedLayer o = cache.ordered(layer);
  for (int64_t b = 0; b < cache.batch_size(); ++b) {
    INFO("row " << b);
    CHECK(bit_equal(k[b], a.k[b].index_select(1, pos[b])));
    CHECK(bit_equal(v[b], a.v[b].index_select(1, pos[b])));
    CHECK(to_vec<int64_t>(o.positions[b]) == kept_positions(cache, layer, b));
    CHECK(bit_equal(o.keys[b], a.k[b].index_select(1, o.positions[b].cpu())));
    CHECK(bit_equal(o.values[b], a.v[b].index_select(1, o.positions[b].cpu())));
  }
}

/// Probabilities carry scores in sixteenths (probs_with_mean), so every hand-worked score up
/// to 16 is a probability; exact in binary.
constexpr double kSixteenths = 16.0;

/// Per-row score of each live position, read from scores() via positions(), in units of 1/16
/// (the scale probs_with_mean() divides by).
template <class Cache>
std::vector<std::map<int64_t, float>> scores_by_position(const Cache& cache, int64_t layer) {
  const at::Tensor pos = cache.positions(layer).cpu().contiguous();
  const at::Tensor sc = cache.scores(layer).cpu().contiguous();
  const int64_t S = cache.size(layer);
  std::vector<std::map<int64_t, float>> out(cache.batch_size());
  for (int64_t b = 0; b < cache.batch_size(); ++b) {
    for (int64_t s = 0; s < S; ++s) {
      out[b][pos.data_ptr<int64_t>()[b * S + s]] = sc.data_ptr<float>()[b * S + s] * static_cast<float>(kSixteenths);
    }
  }
  return out;
}

/// [B, S] tensor in slot order from per-row {position: value} maps (positions not listed: 0).
template <class Cache>
at::Tensor by_slot(const Cache& cache, int64_t layer, const std::vector<std::map<int64_t, double>>& rows) {
  const at::Tensor pos = cache.positions(layer).cpu().contiguous();
  const int64_t B = cache.batch_size(), S = cache.size(layer);
  std::vector<float> v(B * S, 0.f);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      const auto it = rows[b].find(pos.data_ptr<int64_t>()[b * S + s]);
      if (it != rows[b].end()) v[b * S + s] = static_cast<float>(it->second);
    }
  }
  return tensor_of(v, {B, S});
}

/// Probabilities [B, H, 1, S] whose head mean is `rows` / 16 (every head carries it), slot order.
template <class Cache>
at::Tensor probs_with_mean(const Cache& cache, int64_t layer, const std::vector<std::map<int64_t, double>>& rows) {
  const int64_t H = cache.num_heads();
  const auto mean = by_slot(cache, layer, rows).div(kSixteenths);  // [B, S], in sixteenths
  return mean.view({cache.batch_size(), 1, 1, cache.size(layer)}).expand({cache.batch_size(), H, 1, cache.size(layer)}).contiguous();
}

/// A copy of everything observable about a cache, to check that a throwing call changed nothing.
struct LayerState {
  int64_t size, seen, slots;
  at::Tensor positions, scores, keys, values;
  kvevict::CacheStats stats;
};

template <class Cache>
std::vector<LayerState> snapshot(const Cache& c) {
  std::vector<LayerState> out;
  for (int64_t l = 0; l < c.num_layers(); ++l) {
    out.push_back({c.size(l), c.seen_tokens(l), c.slots(l), c.positions(l).clone(), c.scores(l).clone(),
                   c.keys(l).clone(), c.values(l).clone(), c.stats(l)});
  }
  return out;
}

bool same_state(const std::vector<LayerState>& a, const std::vector<LayerState>& b) {
  if (a.size() != b.size()) return false;
  for (size_t l = 0; l < a.size(); ++l) {
    const auto &x = a[l], &y = b[l];
    if (x.size != y.size || x.seen != y.seen || x.slots != y.slots) return false;
    if (x.stats.eviction_events != y.stats.eviction_events ||
        x.stats.tokens_evicted != y.stats.tokens_evicted ||
        x.stats.bytes_allocated != y.stats.bytes_allocated) {
      return false;
    }
    if (!bit_equal(x.positions, y.positions) || !bit_equal(x.scores, y.scores) || !bit_equal(x.keys, y.keys) ||
        !bit_equal(x.values, y.values)) {
      return false;
    }
  }
  return true;
}

const char* path_name(bool tensor_path) { return tensor_path ? "tensor-op path" : "CPU host path"; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// update, views, positions, growth
// ---------------------------------------------------------------------------------------------

TEST_CASE("update appends a prefill chunk and decode steps at consecutive positions", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(1);
    const int64_t B = 2, H = 3;
    // capacity 1 + 4 + 2 = 7, evict_every 1: 8 slots per row, and the trash slot.
    MlaCache cache(small_options(2, B, H), EvictionOptions(4).n_sink(1).n_recent(2));
    CHECK(cache.capacity() == 7);
    CHECK(cache.num_layers() == 2);
    CHECK(cache.batch_size() == B);
    CHECK(cache.num_heads() == H);
    CHECK(cache.slots(0) == 9);
    CHECK(cache.size(0) == 0);
    CHECK(cache.seen_tokens(0) == 0);
    CHECK(cache.positions(0).sizes() == at::IntArrayRef{B, 0});

    Appended a;
    const auto k0 = at::randn({B, H, 5, kQk}), v0 = at::randn({B, H, 5, kV});
    a.add(k0, v0);
    auto kv = cache.update(0, k0, v0);
    CHECK(kv.first.sizes() == at::IntArrayRef{B, H, 5, kQk});
    CHECK(kv.second.sizes() == at::IntArrayRef{B, H, 5, kV});
    CHECK(bit_equal(kv.first, k0));  // nothing evicted yet: slot order is position order
    CHECK(bit_equal(kv.second, v0));
    CHECK(cache.size(0) == 5);
    CHECK(cache.seen_tokens(0) == 5);
    CHECK(to_vec<int64_t>(cache.positions(0)[0]) == std::vector<int64_t>{0, 1, 2, 3, 4});
    CHECK(to_vec<int64_t>(cache.positions(0)[1]) == std::vector<int64_t>{0, 1, 2, 3, 4});
    CHECK(to_vec<float>(cache.scores(0).flatten()) == std::vector<float>(B * 5, 0.f));
    // The other layer is untouched.
    CHECK(cache.size(1) == 0);
    CHECK(cache.seen_tokens(1) == 0);

    for (int step = 0; step < 2; ++step) {
      const auto k1 = at::randn({B, H, 1, kQk}), v1 = at::randn({B, H, 1, kV});
      a.add(k1, v1);
      kv = cache.update(0, k1, v1);
      CHECK(kv.first.sizes() == at::IntArrayRef{B, H, 6 + step, kQk});
      CHECK(kv.second.sizes() == at::IntArrayRef{B, H, 6 + step, kV});
    }
    CHECK(cache.size(0) == 7);
    CHECK(cache.seen_tokens(0) == 7);
    CHECK(bit_equal(kv.first, a.k));
    CHECK(bit_equal(kv.second, a.v));
    CHECK(bit_equal(cache.keys(0), a.k));
    CHECK(bit_equal(cache.values(0), a.v));
    CHECK(to_vec<int64_t>(cache.positions(0)[1]) == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6});
    CHECK(cache.positions(0).scalar_type() == at::kLong);
    CHECK(cache.scores(0).scalar_type() == at::kFloat);
    CHECK(cache.scores(0).sizes() == at::IntArrayRef{B, 7});
    check_rows(cache, 0, a);

    // At capacity: evict is a no-op.
    CHECK(cache.evict(0) == 0);
    CHECK(cache.size(0) == 7);
    CHECK(cache.stats(0).eviction_events == 0);
  }
}

TEST_CASE("a long append grows the buffers and keeps the data", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(2);
    const int64_t B = 2, H = 2;
    // capacity 1 + 1 + 1 = 3, evict_every 1: 4 slots and the trash slot.
    MlaCache cache(small_options(1, B, H), EvictionOptions(1).n_sink(1).n_recent(1));
    REQUIRE(cache.slots(0) == 5);
    const int64_t bytes_before = cache.stats().bytes_allocated;
    Appended a;
    auto append = [&](int64_t T) {
      const auto k = at::randn({B, H, T, kQk}), v = at::randn({B, H, T, kV});
      a.add(k, v);
      return cache.update(0, k, v);
    };
    append(3);
    auto kv = append(6);  // 9 tokens > 4
    CHECK(cache.slots(0) >= 10);
    CHECK(cache.size(0) == 9);
    CHECK(cache.seen_tokens(0) == 9);
    CHECK(bit_equal(kv.first, a.k));
    CHECK(bit_equal(kv.second, a.v));
    CHECK(cache.stats().bytes_allocated > bytes_before);
    check_rows(cache, 0, a);

    // One pass (all scores 0): sink 0, heavy hitter = the newest candidate 7, recent 8.
    CHECK(cache.evict(0) == B * 6);
    CHECK(cache.size(0) == 3);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 7, 8});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 7, 8});
    check_rows(cache, 0, a);

    // A very long prefill-like append after that, then decode on top of it.
    append(40);
    CHECK(cache.slots(0) >= 44);
    CHECK(cache.size(0) == 43);
    check_rows(cache, 0, a);
    append(1);
    CHECK(cache.evict(0) == B * 41);
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 48, 49});
    check_rows(cache, 0, a);
  }
}

TEST_CASE("evict is a no-op at and below capacity", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(3);
    const int64_t B = 2, H = 2;
    MlaCache cache(small_options(1, B, H), EvictionOptions(2).n_sink(1).n_recent(1));  // capacity 4
    Appended a;
    for (int64_t t = 1; t <= 4; ++t) {
      const auto k = at::randn({B, H, 1, kQk}), v = at::randn({B, H, 1, kV});
      a.add(k, v);
      cache.update(0, k, v);
      cache.add_scores(0, at::rand({B, t}));
      const auto before = snapshot(cache);
      CHECK(cache.evict(0) == 0);
      CHECK(cache.evict(0) == 0);
      CHECK(same_state(before, snapshot(cache)));
      CHECK(cache.size(0) == t);
    }
    CHECK(cache.stats(0).eviction_events == 0);
    CHECK(cache.stats(0).tokens_evicted == 0);
    const auto k = at::randn({B, H, 1, kQk}), v = at::randn({B, H, 1, kV});
    a.add(k, v);
    cache.update(0, k, v);
    CHECK(cache.evict(0) == B * 1);
    CHECK(cache.size(0) == 4);
    CHECK(cache.evict(0) == 0);  // back at capacity
    check_rows(cache, 0, a);
  }
}

TEST_CASE("evict_every: a pass runs only when over capacity and due", "[mla_cache][cpu]") {
  const int64_t B = 2, H = 2;
  SECTION("decode steps, evict_every 3, capacity 4") {
    for (bool tensor_path : {false, true}) {
      INFO(path_name(tensor_path));
      ForceTensorPath guard(tensor_path);
      at::manual_seed(4);
      MlaCache cache(small_options(1, B, H), EvictionOptions(1).n_sink(1).n_recent(2).evict_every(3));
      REQUIRE(cache.capacity() == 4);
      CHECK(cache.slots(0) == 8);  // capacity + evict_every + the trash slot
      // Hand-worked (contract rule 6): step 5 is the first over capacity and 5 >= 3 updates
      // have happened since construction: pass. Then every third update.
      const std::vector<int64_t> after_update{1, 2, 3, 4, 5, 5, 6, 7, 5, 6, 7, 5, 6, 7};
      const std::vector<int64_t> evicted{0, 0, 0, 0, 1, 0, 0, 3, 0, 0, 3, 0, 0, 3};
      const std::vector<int64_t> after_evict{1, 2, 3, 4, 4, 5, 6, 4, 5, 6, 4, 5, 6, 4};
      Appended a;
      for (size_t i = 0; i < after_update.size(); ++i) {
        INFO("step " << i + 1);
        const auto k = at::randn({B, H, 1, kQk}), v = at::randn({B, H, 1, kV});
        a.add(k, v);
        cache.update(0, k, v);
        CHECK(cache.size(0) == after_update[i]);
        CHECK(cache.size(0) <= cache.capacity() + 3);
        cache.add_scores(0, at::rand({B, cache.size(0)}));
        CHECK(cache.evict(0) == B * evicted[i]);
        CHECK(cache.size(0) == after_evict[i]);
        CHECK(cache.size(0) <= cache.capacity() + 3 - 1);
        CHECK(cache.evict(0) == 0);  // a second call in the same step never runs a pass
        check_rows(cache, 0, a);
      }
      CHECK(cache.stats(0).eviction_events == 4);
      CHECK(cache.stats(0).tokens_evicted == B * 10);
      CHECK(cache.slots(0) == 8);  // never grew
    }
  }
  SECTION("a prefill counts as one update") {
    for (bool tensor_path : {false, true}) {
      INFO(path_name(tensor_path));
      ForceTensorPath guard(tensor_path);
      MlaCache cache(small_options(1, B, H), EvictionOptions(1).n_sink(1).n_recent(2).evict_every(3));
      cache.update(0, at::randn({B, H, 6, kQk}), at::randn({B, H, 6, kV}));  // 1 update
      CHECK(cache.evict(0) == 0);
      CHECK(cache.size(0) == 6);
      cache.update(0, at::randn({B, H, 1, kQk}), at::randn({B, H, 1, kV}));  // 2
      CHECK(cache.evict(0) == 0);
      CHECK(cache.size(0) == 7);
      cache.update(0, at::randn({B, H, 1, kQk}), at::randn({B, H, 1, kV}));  // 3: due
      CHECK(cache.evict(0) == B * 4);
      CHECK(cache.size(0) == 4);
      CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 5, 6, 7});  // scores all 0
      CHECK(cache.stats(0).eviction_events == 1);
    }
  }
  SECTION("evict_every 1 runs a pass after every update over capacity") {
    for (bool tensor_path : {false, true}) {
      INFO(path_name(tensor_path));
      ForceTensorPath guard(tensor_path);
      MlaCache cache(small_options(1, B, H), EvictionOptions(1).n_sink(1).n_recent(1));  // capacity 3
      for (int64_t t = 0; t < 10; ++t) {
        cache.update(0, at::randn({B, H, 1, kQk}), at::randn({B, H, 1, kV}));
        CHECK(cache.evict(0) == B * (t >= 3 ? 1 : 0));
        CHECK(cache.size(0) == std::min<int64_t>(t + 1, 3));
      }
      CHECK(cache.stats(0).eviction_events == 7);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// observe, scores, selection, ordered()
// ---------------------------------------------------------------------------------------------

TEST_CASE("observed attention picks each row's heavy hitters (hand-worked)", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(5);
    const int64_t B = 2, H = 2;
    // capacity 1 sink + 2 heavy hitters + 1 recent = 4.
    MlaCache cache(small_options(1, B, H), EvictionOptions(2).n_sink(1).n_recent(1));
    Appended a;
    auto k = at::randn({B, H, 6, kQk}), v = at::randn({B, H, 6, kV});
    a.add(k, v);
    cache.update(0, k, v);
    // Step 1, head-mean attention per position. Row 0: candidates 1..4 score 3, 1, 2, 0 ->
    // keep 1 and 3. Row 1: candidates 1..4 score 1, 4, 1, 1 -> keep 2, then the tie at 1 goes
    // to the newest, 4.
    cache.observe(0, probs_with_mean(cache, 0, {{{0, 9}, {1, 3}, {2, 1}, {3, 2}, {4, 0}, {5, 0}},
                                                {{0, 0}, {1, 1}, {2, 4}, {3, 1}, {4, 1}, {5, 7}}}));
    auto sc = scores_by_position(cache, 0);
    CHECK(sc[0] == std::map<int64_t, float>{{0, 9.f}, {1, 3.f}, {2, 1.f}, {3, 2.f}, {4, 0.f}, {5, 0.f}});
    CHECK(cache.evict(0) == B * 2);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 1, 3, 5});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 2, 4, 5});
    // Scores travel with their tokens.
    sc = scores_by_position(cache, 0);
    CHECK(sc[0] == std::map<int64_t, float>{{0, 9.f}, {1, 3.f}, {3, 2.f}, {5, 0.f}});
    CHECK(sc[1] == std::map<int64_t, float>{{0, 0.f}, {2, 4.f}, {4, 1.f}, {5, 7.f}});
    check_rows(cache, 0, a);

    // Step 2: position 6 arrives (score 0). Row 0 adds 2 to position 3 and 1 to position 6:
    // candidates 1 (3), 3 (4), 5 (0) -> evict 5. Row 1 adds 3 to position 4: candidates
    // 2 (4), 4 (4), 5 (7) -> keep 5, tie 2/4 keeps the newer 4 -> evict 2.
    k = at::randn({B, H, 1, kQk});
    v = at::randn({B, H, 1, kV});
    a.add(k, v);
    cache.update(0, k, v);
    cache.observe(0, probs_with_mean(cache, 0, {{{3, 2}, {6, 1}}, {{4, 3}}}));
    CHECK(cache.evict(0) == B * 1);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 1, 3, 6});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 4, 5, 6});
    sc = scores_by_position(cache, 0);
    CHECK(sc[0] == std::map<int64_t, float>{{0, 9.f}, {1, 3.f}, {3, 4.f}, {6, 1.f}});
    CHECK(sc[1] == std::map<int64_t, float>{{0, 0.f}, {4, 4.f}, {5, 7.f}, {6, 0.f}});
    check_rows(cache, 0, a);
    CHECK(cache.stats(0).eviction_events == 2);
    CHECK(cache.stats(0).tokens_evicted == B * 3);
  }
}

TEST_CASE("observe reduces probabilities: mean over heads of the sum over queries", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    // B = 1, H = 2, 3 tokens; Q = 2 queries (positions 1 and 2).
    MlaCache cache(small_options(1, 1, 2), EvictionOptions(8));
    cache.update(0, at::zeros({1, 2, 3, kQk}), at::zeros({1, 2, 3, kV}));
    // head 0: q0 = [.5, .5, 0], q1 = [.25, .25, .5]; head 1: q0 = [1, 0, 0], q1 = [0, .5, .5]
    // sum over q: head 0 [.75, .75, .5], head 1 [1, .5, .5]; mean: [.875, .625, .5].
    const auto probs = tensor_of({.5f, .5f, 0.f, .25f, .25f, .5f, 1.f, 0.f, 0.f, 0.f, .5f, .5f}, {1, 2, 2, 3});
    cache.observe(0, probs);
    CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{.875f, .625f, .5f});
    cache.observe(0, probs.to(at::kDouble));  // any floating dtype
    CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{1.75f, 1.25f, 1.f});
    cache.observe(0, probs.to(at::kHalf));
    CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{2.625f, 1.875f, 1.5f});
    // A new token starts at 0; earlier scores keep accumulating.
    cache.update(0, at::zeros({1, 2, 1, kQk}), at::zeros({1, 2, 1, kV}));
    CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{2.625f, 1.875f, 1.5f, 0.f});
    cache.add_scores(0, tensor_of({1.f, 2.f, 3.f, 4.f}, {1, 4}));
    CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{3.625f, 3.875f, 4.5f, 4.f});
  }
}

TEST_CASE("MeanObservedAttention and LatestAttention scores follow docs/DESIGN.md", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    // Same probabilities as above: 3 tokens at positions 0..2, queries at positions 1 and 2.
    const auto probs = tensor_of({.5f, .5f, 0.f, .25f, .25f, .5f, 1.f, 0.f, 0.f, 0.f, .5f, .5f}, {1, 2, 2, 3});
    {
      BasicMlaCache<EvictionPolicy<MeanObservedAttention>> cache(small_options(1, 1, 2), EvictionOptions(8));
      cache.update(0, at::zeros({1, 2, 3, kQk}), at::zeros({1, 2, 3, kV}));
      CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{0.f, 0.f, 0.f});
      // sums [.875, .625, .5]; queries that can see position 0: 2, position 1: 2, position 2: 1.
      cache.observe(0, probs);
      CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{.875f / 2, .625f / 2, .5f});
      // A new token (position 3), observed by one query (position 3) with mean [.5, 0, .25, .25].
      cache.update(0, at::zeros({1, 2, 1, kQk}), at::zeros({1, 2, 1, kV}));
      CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{.875f / 2, .625f / 2, .5f, 0.f});
      cache.observe(0, tensor_of({.5f, 0.f, .5f, 0.f, .5f, 0.f, 0.f, .5f}, {1, 2, 1, 4}));
      CHECK(to_vec<float>(cache.scores(0)[0]) ==
            std::vector<float>{1.375f / 3, .625f / 3, .75f / 2, .25f / 1});
    }
    {
      BasicMlaCache<EvictionPolicy<LatestAttention>> cache(small_options(1, 1, 2), EvictionOptions(8));
      cache.update(0, at::zeros({1, 2, 3, kQk}), at::zeros({1, 2, 3, kV}));
      // Last query only: head 0 [.25, .25, .5], head 1 [0, .5, .5] -> mean [.125, .375, .5].
      cache.observe(0, probs);
      CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{.125f, .375f, .5f});
      cache.observe(0, probs);  // replaces, does not add
      CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{.125f, .375f, .5f});
      cache.add_scores(0, tensor_of({3.f, 2.f, 1.f}, {1, 3}));
      CHECK(to_vec<float>(cache.scores(0)[0]) == std::vector<float>{3.f, 2.f, 1.f});
    }
  }
}

TEST_CASE("ordered() is a position-sorted copy of the live slots", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(6);
    const int64_t B = 2, H = 2;
    MlaCache cache(small_options(1, B, H), EvictionOptions(2).n_sink(1).n_recent(1));
    Appended a;
    const auto k = at::randn({B, H, 6, kQk}), v = at::randn({B, H, 6, kV});
    a.add(k, v);
    cache.update(0, k, v);
    // Row 0 keeps 1 and 3 (scores 5, 4), row 1 keeps 3 and 4. In row 0 the pass frees slot
    // 2 (below capacity) and slot 4 (tail); kept slots below capacity stay where they are and
    // the one kept tail row (position 5) moves into slot 2, so slot order is not position order.
    cache.add_scores(0, by_slot(cache, 0, {{{1, 5}, {3, 4}}, {{3, 5}, {4, 4}}}));
    REQUIRE(cache.evict(0) == B * 2);
    CHECK(to_vec<int64_t>(cache.positions(0)[0]) == std::vector<int64_t>{0, 1, 5, 3});
    CHECK(cache.positions(0)[1][3].item<int64_t>() == 3);  // a kept slot below capacity stays
    const auto o = cache.ordered(0);
    CHECK(o.keys.sizes() == at::IntArrayRef{B, H, 4, kQk});
    CHECK(o.values.sizes() == at::IntArrayRef{B, H, 4, kV});
    CHECK(to_vec<int64_t>(o.positions[0]) == std::vector<int64_t>{0, 1, 3, 5});
    CHECK(to_vec<int64_t>(o.positions[1]) == std::vector<int64_t>{0, 3, 4, 5});
    check_rows(cache, 0, a);
    // A copy: writing into it leaves the cache alone.
    const auto before = snapshot(cache);
    o.keys.fill_(7.f);
    o.values.fill_(7.f);
    o.positions.fill_(7);
    CHECK(same_state(before, snapshot(cache)));
  }
}

TEST_CASE("K/V rows move bit-exactly for fp32, fp16 and bf16", "[mla_cache][cpu]") {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (bool tensor_path : {false, true}) {
      INFO(path_name(tensor_path) << ", dtype " << dtype);
      ForceTensorPath guard(tensor_path);
      at::manual_seed(7);
      const int64_t B = 3, H = 2;
      // Unchecked observations: random, not causal; this test is about the rows.
      MlaCache cache(small_options(2, B, H, dtype).check_observations(false),
                     EvictionOptions(3).n_sink(2).n_recent(2).evict_every(2));
      CHECK(cache.dtype() == dtype);
      Appended a;
      auto k = at::randn({B, H, 9, kQk}).to(dtype), v = at::randn({B, H, 9, kV}).to(dtype);
      a.add(k, v);
      auto kv = cache.update(1, k, v);
      CHECK(kv.first.scalar_type() == dtype);
      CHECK(kv.second.scalar_type() == dtype);
      for (int step = 0; step < 25; ++step) {
        const int64_t T = step % 4 == 3 ? 3 : 1;
        k = at::randn({B, H, T, kQk}).to(dtype);
        v = at::randn({B, H, T, kV}).to(dtype);
        a.add(k, v);
        cache.update(1, k, v);
        cache.observe(1, at::rand({B, H, T, cache.size(1)}).to(dtype));
        cache.evict(1);
        check_rows(cache, 1, a);
      }
      CHECK(cache.stats(1).eviction_events > 5);
      CHECK(cache.ordered(1).keys.scalar_type() == dtype);
      CHECK(cache.size(0) == 0);
    }
  }
}

namespace {

/// Contract rule 3 with signed zeros: -0 and +0 are equal scores, so the older token goes.
template <class Cache>
void check_signed_zero_ties(Cache& cache) {
  const auto dev = cache.device();
  const int64_t H = cache.num_heads();
  // Row 0: position 0 has +0, position 1 has -0. Row 1: the other way round.
  cache.update(0, at::randn({2, H, 2, kQk}).to(dev), at::randn({2, H, 2, kV}).to(dev));
  cache.add_scores(0, by_slot(cache, 0, {{{0, 0.0}, {1, -0.0}}, {{0, -0.0}, {1, 0.0}}}).to(dev));
  CHECK(cache.evict(0) == 2 * 1);
  CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{1});
  CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{1});
  // Again with three candidates: -0, +0, -0 -> the newest stays.
  cache.update(0, at::randn({2, H, 2, kQk}).to(dev), at::randn({2, H, 2, kV}).to(dev));
  cache.add_scores(0, by_slot(cache, 0, {{{1, -0.0}, {2, 0.0}, {3, -0.0}}, {{1, 0.0}, {2, -0.0}, {3, 0.0}}}).to(dev));
  CHECK(cache.evict(0) == 2 * 2);
  CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{3});
  CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{3});
}

}  // namespace

TEST_CASE("-0 and +0 are equal scores: the older token is evicted", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    MlaCache cache(small_options(1, 2, 2), EvictionOptions(1).n_sink(0).n_recent(0));
    check_signed_zero_ties(cache);
  }
}

// ---------------------------------------------------------------------------------------------
// stats, reset
// ---------------------------------------------------------------------------------------------

TEST_CASE("stats count passes per layer and bytes of every buffer", "[mla_cache][cpu]") {
  for (auto dtype : {at::kFloat, at::kHalf}) {
    INFO("dtype " << dtype);
    const int64_t B = 3, H = 2, L = 2;
    const int64_t elem = dtype == at::kFloat ? 4 : 2;
    // capacity 2 + 2 + 1 = 5, evict_every 2: 7 slots per row and the trash slot.
    MlaCache cache(small_options(L, B, H, dtype), EvictionOptions(2).n_sink(2).n_recent(1).evict_every(2));
    REQUIRE(cache.slots(0) == 8);
    // K/V data: B * H * slots * (qk_dim + v_dim) elements; bookkeeping: at least an fp32
    // score and an int64 position per slot and row (12 bytes), at most twice that plus a
    // few scalars.
    auto check_bytes = [&](int64_t layer) {
      const int64_t slots = cache.slots(layer);
      const int64_t kv_bytes = B * H * slots * (kQk + kV) * elem;
      const int64_t bytes = cache.stats(layer).bytes_allocated;
      CHECK(bytes >= kv_bytes + B * slots * 12);
      CHECK(bytes <= kv_bytes + B * slots * 24 + 64);
    };
    check_bytes(0);
    check_bytes(1);
    const int64_t initial = cache.stats(0).bytes_allocated;
    CHECK(cache.stats(1).bytes_allocated == initial);
    CHECK(cache.stats().bytes_allocated == 2 * initial);

    auto step = [&](int64_t layer, int64_t T) {
      cache.update(layer, at::randn({B, H, T, kQk}).to(dtype), at::randn({B, H, T, kV}).to(dtype));
      return cache.evict(layer);
    };
    // Layer 0: 4 tokens (1 update), then 6 (2 updates: due) -> a pass of 1.
    CHECK(step(0, 4) == 0);
    CHECK(step(0, 2) == B * 1);  // summed over rows
    CHECK(step(0, 1) == 0);      // 6 tokens, 1 update
    CHECK(step(0, 1) == B * 2);  // 7 tokens, 2 updates
    const auto s0 = cache.stats(0);
    CHECK(s0.eviction_events == 2);      // one per pass, whatever B
    CHECK(s0.tokens_evicted == B * 3);   // summed over rows
    CHECK(s0.bytes_allocated == initial);   // no growth
    CHECK(cache.stats(1).eviction_events == 0);
    // Layer 1: a 20-token append grows it; the pass gives the growth back.
    cache.update(1, at::randn({B, H, 20, kQk}).to(dtype), at::randn({B, H, 20, kV}).to(dtype));
    CHECK(cache.slots(1) >= 21);
    check_bytes(1);
    CHECK(cache.stats(1).bytes_allocated > initial);
    CHECK(cache.evict(1) == 0);  // 1 update since construction: not due
    CHECK(step(1, 1) == B * 16);
    CHECK(cache.slots(1) == 8);  // capacity 5 + evict_every 2 + the trash slot
    check_bytes(1);
    CHECK(cache.stats(1).bytes_allocated == initial);
    const auto total = cache.stats();
    CHECK(total.eviction_events == 3);
    CHECK(total.tokens_evicted == B * 19);
    CHECK(total.bytes_allocated == cache.stats(0).bytes_allocated + cache.stats(1).bytes_allocated);
  }
}

TEST_CASE("reset empties every layer and restarts positions, keeping the buffers", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    at::manual_seed(8);
    const int64_t B = 2, H = 2;
    MlaCache cache(small_options(2, B, H), EvictionOptions(2).n_sink(1).n_recent(1).evict_every(2));
    for (int64_t layer = 0; layer < 2; ++layer) {
      cache.update(layer, at::randn({B, H, 12, kQk}), at::randn({B, H, 12, kV}));
      cache.add_scores(layer, at::rand({B, 12}));
      cache.update(layer, at::randn({B, H, 1, kQk}), at::randn({B, H, 1, kV}));
      REQUIRE(cache.evict(layer) == B * 9);
    }
    const int64_t slots = cache.slots(0);
    const int64_t bytes = cache.stats().bytes_allocated;
    cache.reset();
    for (int64_t layer = 0; layer < 2; ++layer) {
      CHECK(cache.size(layer) == 0);
      CHECK(cache.seen_tokens(layer) == 0);
      CHECK(cache.positions(layer).sizes() == at::IntArrayRef{B, 0});
      CHECK(cache.scores(layer).sizes() == at::IntArrayRef{B, 0});
      CHECK(cache.stats(layer).eviction_events == 0);
      CHECK(cache.stats(layer).tokens_evicted == 0);
    }
    CHECK(cache.slots(0) == slots);
    CHECK(cache.stats().bytes_allocated == bytes);

    // A new sequence: positions from 0, scores from 0, and evict_every counts from the reset.
    Appended a;
    auto k = at::randn({B, H, 5, kQk}), v = at::randn({B, H, 5, kV});
    a.add(k, v);
    cache.update(0, k, v);
    CHECK(to_vec<int64_t>(cache.positions(0)[1]) == std::vector<int64_t>{0, 1, 2, 3, 4});
    CHECK(to_vec<float>(cache.scores(0).flatten()) == std::vector<float>(B * 5, 0.f));
    check_rows(cache, 0, a);
    CHECK(cache.evict(0) == 0);  // 1 update since reset < evict_every 2
    k = at::randn({B, H, 1, kQk});
    v = at::randn({B, H, 1, kV});
    a.add(k, v);
    cache.update(0, k, v);
    CHECK(cache.evict(0) == B * 2);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{0, 3, 4, 5});
    check_rows(cache, 0, a);
    CHECK(cache.size(1) == 0);
  }
}

// ---------------------------------------------------------------------------------------------
// errors: the message names the argument, expected and got; the cache is unchanged
// ---------------------------------------------------------------------------------------------

namespace {

/// Two layers, B = 2, H = 2, capacity 4, evict_every 2. Layer 0: 5 tokens with non-zero scores
/// after one pass, 1 update since it (so evict(0) is not due); layer 1: empty.
MlaCache error_fixture(bool check_finite = true) {
  at::manual_seed(9);
  MlaCache cache(small_options(2, 2, 2).check_observations(check_finite),
                 EvictionOptions(2).n_sink(1).n_recent(1).evict_every(2));
  cache.update(0, at::randn({2, 2, 6, kQk}), at::randn({2, 2, 6, kV}));
  cache.observe(0, at::rand({2, 2, 6, 6}).tril().div(6));  // causal: query t sees positions <= t
  cache.update(0, at::randn({2, 2, 1, kQk}), at::randn({2, 2, 1, kV}));
  cache.observe(0, at::rand({2, 2, 1, 7}));
  REQUIRE(cache.evict(0) == 2 * 3);
  cache.update(0, at::randn({2, 2, 1, kQk}), at::randn({2, 2, 1, kV}));
  cache.observe(0, at::rand({2, 2, 1, 5}));
  return cache;
}

}  // namespace

TEST_CASE("a bad layer index throws IndexError", "[mla_cache][errors][cpu]") {
  auto cache = error_fixture();
  const auto before = snapshot(cache);
  const auto k = at::randn({2, 2, 1, kQk}), v = at::randn({2, 2, 1, kV});
  for (int64_t layer : {int64_t{-1}, int64_t{2}}) {
    INFO("layer " << layer);
    const std::string msg = "layer must be in [0, 2), got " + std::to_string(layer);
    CHECK_THROWS_AS(cache.update(layer, k, v), c10::IndexError);
    CHECK_THROWS_WITH(cache.update(layer, k, v), Contains(msg));
    CHECK_THROWS_AS(cache.evict(layer), c10::IndexError);
    CHECK_THROWS_WITH(cache.evict(layer), Contains(msg));
    CHECK_THROWS_AS(cache.observe(layer, at::rand({2, 2, 1, 5})), c10::IndexError);
    CHECK_THROWS_AS(cache.add_scores(layer, at::rand({2, 5})), c10::IndexError);
    CHECK_THROWS_AS(cache.size(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.seen_tokens(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.slots(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.positions(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.scores(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.keys(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.values(layer), c10::IndexError);
    CHECK_THROWS_AS(cache.ordered(layer), c10::IndexError);
    CHECK_THROWS_WITH(cache.stats(layer), Contains(msg));
  }
  CHECK(same_state(before, snapshot(cache)));
  CHECK(cache.evict(0) == 0);  // the update counter did not move either
}

TEST_CASE("update rejects bad keys and values, naming expected and got", "[mla_cache][errors][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    auto cache = error_fixture();
    const auto before = snapshot(cache);
    const auto k = at::randn({2, 2, 1, kQk}), v = at::randn({2, 2, 1, kV});
    auto throws_with = [&](const at::Tensor& kn, const at::Tensor& vn, const std::string& text) {
      CHECK_THROWS_WITH(cache.update(0, kn, vn), Contains(text));
      CHECK(same_state(before, snapshot(cache)));
    };
    // Wrong rank / sizes of k_new.
    throws_with(at::randn({2, 2, kQk}), v, "k_new must be [B, H, T, qk_dim] = [2, 2, T, 6], got [2, 2, 6]");
    throws_with(at::randn({2, 3, 1, kQk}), v, "k_new must be [B, H, T, qk_dim] = [2, 2, T, 6], got [2, 3, 1, 6]");
    throws_with(at::randn({1, 2, 1, kQk}), v, "got [1, 2, 1, 6]");
    throws_with(at::randn({2, 2, 1, kQk + 1}), v, "got [2, 2, 1, 7]");
    throws_with(at::randn({2, 2, 1, 1, kQk}), v, "got [2, 2, 1, 1, 6]");
    // Wrong v_new, and K/V disagreeing on B, H or T.
    throws_with(k, at::randn({2, 2, 1, kV + 1}), "v_new must be [B, H, T, v_dim] = [2, 2, 1, 4], got [2, 2, 1, 5]");
    throws_with(k, at::randn({3, 2, 1, kV}), "v_new must be [B, H, T, v_dim] = [2, 2, 1, 4], got [3, 2, 1, 4]");
    throws_with(k, at::randn({2, 1, 1, kV}), "got [2, 1, 1, 4]");
    throws_with(at::randn({2, 2, 3, kQk}), at::randn({2, 2, 2, kV}),
                "v_new must be [B, H, T, v_dim] = [2, 2, 3, 4], got [2, 2, 2, 4]");
    throws_with(k, at::randn({2, 2, 4, kV}), "got [2, 2, 4, 4]");
    // T = 0.
    throws_with(at::randn({2, 2, 0, kQk}), at::randn({2, 2, 0, kV}), "k_new must hold at least one token, got T = 0");
    throws_with(k, at::randn({2, 2, 0, kV}), "v_new must be");
    // Undefined tensors.
    throws_with(at::Tensor(), v, "k_new must be a defined tensor");
    throws_with(k, at::Tensor(), "v_new must be a defined tensor");
    // Wrong dtype (TypeError).
    CHECK_THROWS_AS(cache.update(0, k.to(at::kDouble), v), c10::TypeError);
    throws_with(k.to(at::kDouble), v, "k_new must have the cache's dtype Float, got Double");
    throws_with(k, v.to(at::kHalf), "v_new must have the cache's dtype Float, got Half");
    throws_with(k.to(at::kLong), v.to(at::kLong), "got Long");
    CHECK(cache.evict(0) == 0);  // no failed update counted toward evict_every
    CHECK(same_state(before, snapshot(cache)));
  }
}

TEST_CASE("observe and add_scores reject bad probabilities", "[mla_cache][errors][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    auto cache = error_fixture();
    const auto before = snapshot(cache);
    auto throws_with = [&](const at::Tensor& p, const std::string& text) {
      CHECK_THROWS_WITH(cache.observe(0, p), Contains(text));
      CHECK(same_state(before, snapshot(cache)));
    };
    const std::string expected = "attention probs must be [B, H, Q, S] with S = size(layer), the longest row = [2, 2, Q, 5]";
    throws_with(at::rand({2, 3, 1, 5}), expected + ", got [2, 3, 1, 5]");  // wrong H
    throws_with(at::rand({1, 2, 1, 5}), expected + ", got [1, 2, 1, 5]");  // wrong B
    throws_with(at::rand({2, 2, 1, 4}), expected + ", got [2, 2, 1, 4]");  // wrong S
    throws_with(at::rand({2, 2, 1, 6}), expected + ", got [2, 2, 1, 6]");
    throws_with(at::rand({2, 2, 5}), expected + ", got [2, 2, 5]");
    throws_with(at::Tensor(), "attention probs must be a defined tensor");
    throws_with(at::rand({2, 2, 0, 5}), "attention probs: Q must be in [1, 8], got 0");  // 8 seen tokens
    throws_with(at::rand({2, 2, 9, 5}), "attention probs: Q must be in [1, 8], got 9");
    CHECK_THROWS_AS(cache.observe(0, at::ones({2, 2, 1, 5}, at::kLong)), c10::TypeError);
    throws_with(at::ones({2, 2, 1, 5}, at::kLong), "attention probs must have a floating dtype, got Long");
    throws_with(at::ones({2, 2, 1, 5}, at::kBool), "attention probs must have a floating dtype, got Bool");
    // The empty layer: no Q fits.
    CHECK_THROWS_WITH(cache.observe(1, at::rand({2, 2, 1, 0})), Contains("the layer holds no token"));
    // add_scores.
    CHECK_THROWS_WITH(cache.add_scores(0, at::rand({2, 4})),
                      Contains("scores must be [B, S] with S = size(layer) = [2, 5], got [2, 4]"));
    CHECK_THROWS_WITH(cache.add_scores(0, at::rand({2, 1, 5})), Contains("got [2, 1, 5]"));
    CHECK_THROWS_WITH(cache.add_scores(0, at::ones({2, 5}, at::kInt)),
                      Contains("scores must have a floating dtype, got Int"));
    CHECK(same_state(before, snapshot(cache)));
    CHECK(cache.evict(0) == 0);
  }
}

TEST_CASE("a non-finite observation throws with check_finite and changes nothing", "[mla_cache][errors][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    auto cache = error_fixture(/*check_finite=*/true);
    const auto before = snapshot(cache);
    for (double bad : {kNaN, kInf, -kInf}) {
      INFO("value " << bad);
      auto p = at::rand({2, 2, 1, 5});
      p[1][0][0][3] = bad;
      CHECK_THROWS_WITH(cache.observe(0, p), Contains("non-finite") && Contains("unchanged"));
      CHECK(same_state(before, snapshot(cache)));
      auto s = at::rand({2, 5});
      s[0][4] = bad;
      CHECK_THROWS_WITH(cache.add_scores(0, s), Contains("non-finite"));
      CHECK(same_state(before, snapshot(cache)));
    }
    // Finite values that overflow fp32 when converted are non-finite too.
    auto big = at::rand({2, 2, 1, 5}, at::kDouble);
    big[0][1][0][0] = 1e300;
    CHECK_THROWS_WITH(cache.observe(0, big), Contains("non-finite"));
    CHECK(same_state(before, snapshot(cache)));
    CHECK(cache.evict(0) == 0);
  }
}

TEST_CASE("with check_finite off non-finite scores are accepted and rank lowest", "[mla_cache][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    // No sinks, no recent window, 2 heavy hitters: every token is a candidate.
    MlaCache cache(small_options(1, 2, 2).check_observations(false), EvictionOptions(2).n_sink(0).n_recent(0));
    cache.update(0, at::randn({2, 2, 5, kQk}), at::randn({2, 2, 5, kV}));
    auto p = at::zeros({2, 2, 1, 5});
    p[0][0][0][2] = kNaN;
    cache.observe(0, p);  // accepted
    auto sc = cache.scores(0);
    CHECK(std::isnan(sc[0][2].item<float>()));
    CHECK(sc[1][2].item<float>() == 0.f);
    // Row 0 by position: +inf, 0.5, NaN, -inf, -7 -> the finite ones (1 and 4) survive, -7
    // included. Row 1: 1, +inf, 2, NaN, -inf -> 0 and 2 survive.
    cache.add_scores(0, by_slot(cache, 0, {{{0, kInf}, {1, .5}, {3, -kInf}, {4, -7}},
                                           {{0, 1}, {1, kInf}, {2, 2}, {3, kNaN}, {4, -kInf}}}));
    CHECK(cache.evict(0) == 2 * 3);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{1, 4});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{0, 2});
    // When finite candidates run out, the newest non-finite ones are kept.
    cache.update(0, at::randn({2, 2, 2, kQk}), at::randn({2, 2, 2, kV}));  // positions 5, 6
    cache.add_scores(0, by_slot(cache, 0, {{{1, kNaN}, {4, kNaN}, {5, kNaN}, {6, kInf}},
                                           {{0, kNaN}, {2, 3}, {5, -kInf}, {6, kNaN}}}));
    CHECK(cache.evict(0) == 2 * 2);
    CHECK(kept_positions(cache, 0, 0) == std::vector<int64_t>{5, 6});
    CHECK(kept_positions(cache, 0, 1) == std::vector<int64_t>{2, 6});
  }
}

// ---------------------------------------------------------------------------------------------
// differential test against a brute-force reference cache
// ---------------------------------------------------------------------------------------------

namespace {

/// The reference: one layer, per batch row a list of tokens sorted by position, each with its
/// own copy of its K/V bytes, its score (double) and observation count. Written from the
/// contract in docs/DESIGN.md; the selection is support.hpp's oracle_keep (a full sort).
template <class Scorer>
class ReferenceLayer {
 public:
  struct Token {
    int64_t position;
    double sum = 0;    // accumulated (or, LatestAttention, latest) head-mean attention
    double count = 0;  // observed queries that could see the token (MeanObservedAttention)
    std::vector<uint8_t> k, v;  // H rows of qk_dim / v_dim elements, head-major
  };

  ReferenceLayer(int64_t batch, int64_t heads, const EvictionOptions& o) : rows(batch), heads_(heads), opts_(o) {}

  /// k_new, v_new: [B, H, T, D] on the CPU, cache dtype.
  void append(const at::Tensor& k_new, const at::Tensor& v_new) {
    const auto k = k_new.contiguous(), v = v_new.contiguous();
    const int64_t T = k.size(2);
    const int64_t k_row = k.size(3) * k.element_size(), v_row = v.size(3) * v.element_size();
    const auto* kp = static_cast<const uint8_t*>(k.data_ptr());
    const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
    for (size_t b = 0; b < rows.size(); ++b) {
      for (int64_t t = 0; t < T; ++t) {
        Token tok;
        tok.position = seen + t;
        for (int64_t h = 0; h < heads_; ++h) {
          const int64_t row = (static_cast<int64_t>(b) * heads_ + h) * T + t;
          tok.k.insert(tok.k.end(), kp + row * k_row, kp + (row + 1) * k_row);
          tok.v.insert(tok.v.end(), vp + row * v_row, vp + (row + 1) * v_row);
        }
        rows[b].push_back(std::move(tok));
      }
    }
    seen += T;
    updates += 1;
  }

  /// p[b][h][q][i]: probability of query q (position seen - Q + q) for the i-th token of row b
  /// (position order).
  void observe(const std::vector<std::vector<std::vector<std::vector<double>>>>& p) {
    const int64_t Q = static_cast<int64_t>(p[0][0].size());
    for (size_t b = 0; b < rows.size(); ++b) {
      for (size_t i = 0; i < rows[b].size(); ++i) {
        auto& tok = rows[b][i];
        double all = 0, last = 0;
        for (int64_t h = 0; h < heads_; ++h) {
          for (int64_t q = 0; q < Q; ++q) all += p[b][h][q][i];
          last += p[b][h][Q - 1][i];
        }
        all /= static_cast<double>(heads_);
        last /= static_cast<double>(heads_);
        if (std::is_same<Scorer, LatestAttention>::value) {
          tok.sum = last;
        } else {
          tok.sum += all;
        }
        // Queries at positions seen - Q .. seen - 1 that can see the token: position <= query.
        tok.count += static_cast<double>(std::min<int64_t>(std::max<int64_t>(seen - tok.position, 0), Q));
      }
    }
  }

  /// s[b][i]: caller scores, as one observed query whose head mean is s.
  void add_scores(const std::vector<std::vector<double>>& s) {
    for (size_t b = 0; b < rows.size(); ++b) {
      for (size_t i = 0; i < rows[b].size(); ++i) {
        auto& tok = rows[b][i];
        tok.sum = std::is_same<Scorer, LatestAttention>::value ? s[b][i] : tok.sum + s[b][i];
        tok.count += 1;
      }
    }
  }

  /// The ranking score (fp32, as the contract keeps scores): the sum, or for
  /// MeanObservedAttention the sum divided by the count (0 before any observation).
  static float rank(const Token& t) {
    if (std::is_same<Scorer, MeanObservedAttention>::value) {
      return t.count > 0 ? static_cast<float>(t.sum) / static_cast<float>(t.count) : 0.f;
    }
    return static_cast<float>(t.sum);
  }

  /// Contract rule 6, then rule 2 per row with oracle_keep. Returns tokens evicted per row.
  int64_t evict() {
    const int64_t cap = opts_.capacity();
    const int64_t S = size();
    if (S <= cap || updates < opts_.evict_every()) return 0;
    for (auto& row : rows) {
      std::vector<int64_t> pos;
      std::vector<double> sc;
      for (const auto& t : row) {
        pos.push_back(t.position);
        sc.push_back(rank(t));
      }
      const auto keep = oracle_keep(pos, sc, opts_.n_sink(), opts_.budget(), opts_.n_recent());
      std::vector<Token> kept;
      for (auto& t : row) {
        if (std::binary_search(keep.begin(), keep.end(), t.position)) kept.push_back(std::move(t));
      }
      row = std::move(kept);
    }
    updates = 0;
    events += 1;
    evicted += S - cap;
    return S - cap;
  }

  void reset() {
    for (auto& row : rows) row.clear();
    seen = updates = events = evicted = 0;
  }

  int64_t size() const { return rows.empty() ? 0 : static_cast<int64_t>(rows[0].size()); }

  /// Index of `position` in row b, or -1.
  int64_t index_of(size_t b, int64_t position) const {
    const auto& row = rows[b];
    const auto it = std::lower_bound(row.begin(), row.end(), position,
                                     [](const Token& t, int64_t p) { return t.position < p; });
    return it != row.end() && it->position == position ? it - row.begin() : -1;
  }

  std::vector<std::vector<Token>> rows;
  int64_t seen = 0, updates = 0, events = 0, evicted = 0;

 private:
  int64_t heads_;
  EvictionOptions opts_;
};

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

/// "" when the cache's layer equals the reference: sizes, counters, kept positions per row,
/// scores by position, and K/V rows of ordered() byte for byte.
template <class Cache, class Ref>
std::string compare(const Cache& cache, int64_t layer, const Ref& ref) {
  std::ostringstream d;
  if (cache.size(layer) != ref.size()) d << "size " << cache.size(layer) << " != " << ref.size() << "; ";
  if (cache.seen_tokens(layer) != ref.seen) d << "seen " << cache.seen_tokens(layer) << " != " << ref.seen << "; ";
  const auto st = cache.stats(layer);
  if (st.eviction_events != ref.events) d << "events " << st.eviction_events << " != " << ref.events << "; ";
  if (st.tokens_evicted != ref.evicted * static_cast<int64_t>(ref.rows.size())) d << "evicted " << st.tokens_evicted << "; ";
  if (!d.str().empty()) return d.str();
  const int64_t S = ref.size();
  const kvevict::OrderedLayer o = cache.ordered(layer);
  const at::Tensor keys = o.keys.cpu().contiguous(), values = o.values.cpu().contiguous();
  const at::Tensor pos_t = cache.positions(layer).cpu().contiguous();
  const at::Tensor scores_t = cache.scores(layer).cpu().contiguous();
  const int64_t* pos = pos_t.data_ptr<int64_t>();
  const float* scores = scores_t.data_ptr<float>();
  const int64_t H = cache.num_heads();
  const int64_t k_row = keys.size(3) * keys.element_size(), v_row = values.size(3) * values.element_size();
  for (size_t b = 0; b < ref.rows.size(); ++b) {
    const auto& row = ref.rows[b];
    std::vector<int64_t> want;
    for (const auto& t : row) want.push_back(t.position);
    const auto got = kept_positions(cache, layer, static_cast<int64_t>(b));
    if (got != want) {
      d << "row " << b << " positions:";
      for (auto p : got) d << ' ' << p;
      d << " want";
      for (auto p : want) d << ' ' << p;
      return d.str();
    }
    for (int64_t s = 0; s < S; ++s) {
      const int64_t p = pos[b * S + s];
      const auto& tok = row[ref.index_of(b, p)];
      const float got_score = scores[b * S + s];
      if (!same_float(got_score, Ref::rank(tok))) {
        d << "row " << b << " position " << p << " score " << got_score << " want " << Ref::rank(tok);
        return d.str();
      }
    }
    const auto* kp = static_cast<const uint8_t*>(keys.data_ptr());
    const auto* vp = static_cast<const uint8_t*>(values.data_ptr());
    for (int64_t i = 0; i < S; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = (static_cast<int64_t>(b) * H + h) * S + i;
        if (std::memcmp(kp + r * k_row, row[i].k.data() + h * k_row, k_row) != 0 ||
            std::memcmp(vp + r * v_row, row[i].v.data() + h * v_row, v_row) != 0) {
          d << "row " << b << " position " << row[i].position << " head " << h << ": K/V bytes differ";
          return d.str();
        }
      }
    }
  }
  return "";
}

struct DiffConfig {
  uint32_t seed;
  int steps;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::Device(at::kCPU);
  bool nonfinite = false;  // check_finite off and non-finite caller scores injected
};

/// Drives random append / observe / add_scores / evict / (rarely) reset sequences through a
/// cache and the reference, comparing after every evict.
template <class Scorer>
void run_differential(const DiffConfig& cfg) {
  std::mt19937 rng(cfg.seed);
  auto uni = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const int64_t B = uni(2, 3), H = uni(0, 1) ? 4 : 2, L = 2, qk = 3, vd = 2;
  int64_t n_sink, budget, n_recent;
  do {
    n_sink = uni(0, 3);
    budget = uni(0, 4);
    n_recent = uni(0, 3);
  } while (n_sink + budget + n_recent < 1);
  const auto eo = EvictionOptions(budget).n_sink(n_sink).n_recent(n_recent).evict_every(uni(1, 3));
  INFO("seed " << cfg.seed << ": B " << B << " H " << H << " n_sink " << n_sink << " budget " << budget
               << " n_recent " << n_recent << " evict_every " << eo.evict_every() << " dtype " << cfg.dtype
               << " device " << cfg.device);
  BasicMlaCache<EvictionPolicy<Scorer>> cache(MlaCacheOptions(L, H)
                                                  .batch_size(B)
                                                  .qk_dim(qk)
                                                  .v_dim(vd)
                                                  .dtype(cfg.dtype)
                                                  .device(cfg.device)
                                                  .check_observations(!cfg.nonfinite),
                                              eo);
  std::vector<ReferenceLayer<Scorer>> ref(L, ReferenceLayer<Scorer>(B, H, eo));
  std::uniform_real_distribution<float> value(-2.f, 2.f);
  auto random_rows = [&](int64_t T, int64_t D) {
    std::vector<float> x(B * H * T * D);
    for (auto& e : x) e = value(rng);
    return tensor_of(x, {B, H, T, D}).to(cfg.dtype);
  };
  int64_t passes = 0;
  for (int step = 0; step < cfg.steps; ++step) {
    INFO("step " << step);
    const int64_t l = uni(0, L - 1);
    auto& r = ref[l];
    if (uni(0, 99) == 0) {
      cache.reset();
      for (auto& x : ref) x.reset();
    }
    const int64_t T = uni(1, 5);
    const auto k = random_rows(T, qk), v = random_rows(T, vd);
    cache.update(l, k.to(cfg.device), v.to(cfg.device));
    r.append(k, v);
    const int64_t S = r.size();
    const at::Tensor pos_t = cache.positions(l).cpu().contiguous();
    REQUIRE(pos_t.size(1) == S);
    const int64_t* pos = pos_t.data_ptr<int64_t>();
    // Index in the reference row of the token in slot s of row b.
    auto ref_index = [&](int64_t b, int64_t s) {
      const int64_t i = r.index_of(b, pos[b * S + s]);
      if (i < 0) FAIL("slot " << s << " of row " << b << " holds position " << pos[b * S + s] << ", unknown");
      return i;
    };
    const int64_t what = uni(0, 9);
    if (what < 6) {
      // Probabilities in quarters, causal (0 where the token is newer than the query), so
      // every fp32 sum is exact.
      const int64_t Q = uni(1, std::min<int64_t>(S, 6));
      std::vector<std::vector<std::vector<std::vector<double>>>> p(
          B, std::vector<std::vector<std::vector<double>>>(H, std::vector<std::vector<double>>(Q, std::vector<double>(S))));
      std::vector<float> slot_order(B * H * Q * S);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t q = 0; q < Q; ++q) {
            for (int64_t i = 0; i < S; ++i) {
              const bool visible = r.rows[b][i].position <= r.seen - Q + q;
              p[b][h][q][i] = visible ? static_cast<double>(uni(0, 3)) / 4 : 0.0;
            }
            for (int64_t s = 0; s < S; ++s) {
              slot_order[((b * H + h) * Q + q) * S + s] = static_cast<float>(p[b][h][q][ref_index(b, s)]);
            }
          }
        }
      }
      cache.observe(l, tensor_of(slot_order, {B, H, Q, S}).to(cfg.device));
      r.observe(p);
    } else if (what < 8) {
      std::vector<std::vector<double>> sc(B, std::vector<double>(S));
      std::vector<float> slot_order(B * S);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < S; ++i) {
          sc[b][i] = static_cast<double>(uni(0, 8)) / 4;
          if (sc[b][i] == 0 && uni(0, 1) == 0) sc[b][i] = -0.0;  // equal to +0 (rule 3 tie)
          if (cfg.nonfinite && uni(0, 7) == 0) sc[b][i] = std::vector<double>{kInf, -kInf, kNaN}[uni(0, 2)];
        }
        for (int64_t s = 0; s < S; ++s) slot_order[b * S + s] = static_cast<float>(sc[b][ref_index(b, s)]);
      }
      cache.add_scores(l, tensor_of(slot_order, {B, S}).to(cfg.device));
      r.add_scores(sc);
    }
    const int64_t n = cache.evict(l);
    CHECK(n == B * r.evict());
    if (n > 0) ++passes;
    const auto diff = compare(cache, l, r);
    REQUIRE(diff == "");
  }
  for (int64_t l = 0; l < L; ++l) REQUIRE(compare(cache, l, ref[l]) == "");
  CHECK(passes > cfg.steps / 10);  // the sequence did exercise eviction
}

template <class Scorer>
void run_seeds(uint32_t first, uint32_t count, int steps, at::ScalarType dtype = at::kFloat, bool nonfinite = false) {
  for (uint32_t seed = first; seed < first + count; ++seed) {
    DiffConfig cfg{seed, steps};
    cfg.dtype = dtype;
    cfg.nonfinite = nonfinite;
    run_differential<Scorer>(cfg);
  }
}

}  // namespace

TEST_CASE("differential: CumulativeAttention, CPU host path", "[mla_cache][differential][cpu]") {
  ForceTensorPath guard(false);
  run_seeds<CumulativeAttention>(100, 8, 300);
}

TEST_CASE("differential: CumulativeAttention, tensor-op path", "[mla_cache][differential][cpu]") {
  ForceTensorPath guard(true);
  run_seeds<CumulativeAttention>(100, 8, 300);
}

TEST_CASE("differential: MeanObservedAttention and LatestAttention, both paths", "[mla_cache][differential][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    run_seeds<MeanObservedAttention>(200, 4, 200);
    run_seeds<LatestAttention>(300, 4, 200);
  }
}

TEST_CASE("differential: fp16 and bf16 rows, non-finite caller scores", "[mla_cache][differential][cpu]") {
  for (bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    run_seeds<CumulativeAttention>(400, 2, 150, at::kHalf);
    run_seeds<CumulativeAttention>(500, 2, 150, at::kBFloat16);
    run_seeds<CumulativeAttention>(600, 3, 200, at::kFloat, /*nonfinite=*/true);
    run_seeds<MeanObservedAttention>(700, 2, 150, at::kFloat, /*nonfinite=*/true);
    run_seeds<LatestAttention>(800, 2, 150, at::kFloat, /*nonfinite=*/true);
  }
}

// ---------------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------------

TEST_CASE("differential on CUDA: the device path equals the reference", "[mla_cache][differential][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda("cuda:0");
  for (uint32_t seed = 900; seed < 903; ++seed) {
    DiffConfig cfg{seed, 150};
    cfg.device = cuda;
    run_differential<CumulativeAttention>(cfg);
    run_differential<MeanObservedAttention>(cfg);
    run_differential<LatestAttention>(cfg);
    cfg.dtype = at::kBFloat16;
    cfg.nonfinite = true;
    run_differential<CumulativeAttention>(cfg);
  }
}

TEST_CASE("CUDA: a small scenario gives the CPU's results", "[mla_cache][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda("cuda:0");
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    INFO("dtype " << dtype);
    at::manual_seed(10);
    const int64_t B = 2, H = 2;
    const auto eo = EvictionOptions(3).n_sink(1).n_recent(2).evict_every(2);
    MlaCache cpu(small_options(1, B, H, dtype), eo);
    MlaCache gpu(small_options(1, B, H, dtype).device(cuda), eo);
    CHECK(gpu.device() == cuda);
    for (int step = 0; step < 30; ++step) {
      const int64_t T = step == 0 ? 8 : 1 + step % 2;
      const auto k = at::randn({B, H, T, kQk}).to(dtype), v = at::randn({B, H, T, kV}).to(dtype);
      auto kv_cpu = cpu.update(0, k, v);
      auto kv_gpu = gpu.update(0, k.to(cuda), v.to(cuda));
      CHECK(kv_gpu.first.device() == cuda);
      CHECK(kv_gpu.first.sizes() == kv_cpu.first.sizes());
      // Integer-valued attention, the same per position on both (slot orders may differ).
      std::vector<std::map<int64_t, double>> w(B);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t p = 0; p < cpu.seen_tokens(0); ++p) w[b][p] = static_cast<double>((p * 7 + b * 3 + step) % 5);
      }
      cpu.observe(0, probs_with_mean(cpu, 0, w));
      gpu.observe(0, probs_with_mean(gpu, 0, w).to(cuda));
      CHECK(cpu.evict(0) == gpu.evict(0));
      for (int64_t b = 0; b < B; ++b) CHECK(kept_positions(cpu, 0, b) == kept_positions(gpu, 0, b));
      CHECK(scores_by_position(cpu, 0) == scores_by_position(gpu, 0));
      const auto oc = cpu.ordered(0), og = gpu.ordered(0);
      CHECK(og.keys.device() == cuda);
      CHECK(bit_equal(oc.keys, og.keys));
      CHECK(bit_equal(oc.values, og.values));
      CHECK(bit_equal(oc.positions, og.positions));
    }
    CHECK(cpu.stats(0).eviction_events == gpu.stats(0).eviction_events);
    CHECK(cpu.stats(0).bytes_allocated == gpu.stats(0).bytes_allocated);
  }
}

TEST_CASE("CUDA: -0 and +0 are equal scores: the older token is evicted", "[mla_cache][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  MlaCache cache(small_options(1, 2, 2).device(at::Device("cuda:0")), EvictionOptions(1).n_sink(0).n_recent(0));
  check_signed_zero_ties(cache);
}

TEST_CASE("CUDA: inputs on the wrong device are rejected naming both devices", "[mla_cache][errors][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  const at::Device cuda("cuda:0");
  MlaCache gpu(small_options(1, 2, 2).device(cuda).check_observations(true), EvictionOptions(2).n_sink(1).n_recent(1));
  gpu.update(0, at::randn({2, 2, 3, kQk}, cuda), at::randn({2, 2, 3, kV}, cuda));
  const auto before = snapshot(gpu);
  const auto k = at::randn({2, 2, 1, kQk}), v = at::randn({2, 2, 1, kV});
  CHECK_THROWS_WITH(gpu.update(0, k, v.to(cuda)),
                    Contains("k_new must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(gpu.update(0, k.to(cuda), v), Contains("v_new must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(gpu.observe(0, at::rand({2, 2, 1, 3})),
                    Contains("attention probs must be on the cache's device cuda:0, got cpu"));
  CHECK_THROWS_WITH(gpu.add_scores(0, at::rand({2, 3})), Contains("cuda:0") && Contains("cpu"));
  CHECK(same_state(before, snapshot(gpu)));

  MlaCache cpu(small_options(1, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
  cpu.update(0, at::randn({2, 2, 3, kQk}), at::randn({2, 2, 3, kV}));
  const auto before_cpu = snapshot(cpu);
  CHECK_THROWS_WITH(cpu.update(0, k.to(cuda), v), Contains("k_new must be on the cache's device cpu, got cuda:0"));
  CHECK_THROWS_WITH(cpu.observe(0, at::rand({2, 2, 1, 3}, cuda)),
                    Contains("attention probs must be on the cache's device cpu, got cuda:0"));
  CHECK(same_state(before_cpu, snapshot(cpu)));

  // Checked observations on CUDA (opt-in there: one host sync): a NaN throws, nothing changes.
  auto p = at::rand({2, 2, 1, 3}, cuda);
  p[0][1][0][2] = kNaN;
  CHECK_THROWS_WITH(gpu.observe(0, p), Contains("non-finite"));
  CHECK(same_state(before, snapshot(gpu)));
}

TEST_CASE("Inputs that require grad leave the cache's buffers out of any autograd graph", "[mla_cache][cpu]") {
  kvevict_test::on_both_paths([] {
    const auto w = at::ones({1}).requires_grad_();
    kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, 2).qk_dim(4).v_dim(4), kvevict::EvictionOptions(1).n_sink(1).n_recent(1));
    for (int step = 0; step < 6; ++step) {
      cache.update(0, at::randn({1, 2, 1, 4}).mul(w), at::randn({1, 2, 1, 4}).mul(w));
      cache.observe(0, at::rand({1, 2, 1, cache.size(0)}).mul(w));
      cache.evict(0);
    }
    CHECK_FALSE(cache.keys(0).requires_grad());
    CHECK_FALSE(cache.values(0).requires_grad());
    CHECK_FALSE(cache.scores(0).requires_grad());
    CHECK_FALSE(cache.ordered(0).keys.requires_grad());
  });
}

// ---------------------------------------------------------------------------------------------
// Modes, aliasing, views, failures half-way, odd inputs
// ---------------------------------------------------------------------------------------------

TEST_CASE("A cache built under InferenceMode resets and steps outside it, and the other way round", "[mla_cache][cpu]") {
  kvevict_test::on_both_paths([] {
    auto step = [](MlaCache& c) {
      c.update(0, at::randn({1, 2, 1, kQk}), at::randn({1, 2, 1, kV}));
      c.observe(0, at::full({1, 2, 1, c.size(0)}, 1.0 / static_cast<double>(c.size(0))));
      c.evict(0);
    };
    c10::optional<MlaCache> built_inside;
    {
      c10::InferenceMode guard;
      built_inside.emplace(small_options(2, 1, 2), EvictionOptions(2).n_sink(1).n_recent(1));
      for (int i = 0; i < 6; ++i) step(*built_inside);
    }
    built_inside->reset();  // every layer, outside InferenceMode
    CHECK(built_inside->size(0) == 0);
    for (int i = 0; i < 6; ++i) step(*built_inside);
    CHECK(built_inside->size(0) == 4);
    CHECK(kept_positions(*built_inside, 0)[0] == 0);

    MlaCache built_outside(small_options(2, 1, 2), EvictionOptions(2).n_sink(1).n_recent(1));
    for (int i = 0; i < 6; ++i) step(built_outside);
    {
      c10::InferenceMode guard;
      built_outside.reset();
      for (int i = 0; i < 6; ++i) step(built_outside);
      const auto k = built_outside.keys(0);
      CHECK(k.is_view());
    }
    CHECK(built_outside.size(0) == 4);
  });
}

TEST_CASE("update copies an input that aliases the cache's own slots as it was", "[mla_cache][cpu]") {
  kvevict_test::on_both_paths([] {
    MlaCache cache(small_options(1, 1, 2), EvictionOptions(8));
    const auto k0 = at::randn({1, 2, 4, kQk}), v0 = at::randn({1, 2, 4, kV});
    auto kv = cache.update(0, k0, v0);
    cache.reset();
    // Slots 1..3 of the old views go into slots 0..2: source and destination overlap.
    const auto k_in = kv.first.narrow(2, 1, 3), v_in = kv.second.narrow(2, 1, 3);
    const auto k_expected = k0.narrow(2, 1, 3).clone(), v_expected = v0.narrow(2, 1, 3).clone();
    cache.update(0, k_in, v_in);
    CHECK(bit_equal(cache.keys(0), k_expected));
    CHECK(bit_equal(cache.values(0), v_expected));
  });
}

TEST_CASE("update and keys return real views: autograd sees a later in-place eviction", "[mla_cache][cpu]") {
  kvevict_test::on_both_paths([] {
    MlaCache cache(small_options(1, 1, 1), EvictionOptions(1).n_sink(1).n_recent(1));
    const auto kv = cache.update(0, at::randn({1, 1, 3, kQk}), at::randn({1, 1, 3, kV}));
    CHECK(kv.first.is_view());
    CHECK(cache.keys(0).is_view());
    const auto q = at::randn({1, 1, 1, kQk}).requires_grad_();
    const auto k = cache.keys(0);
    const auto loss = at::matmul(q, k.transpose(-2, -1)).sum();  // saves k for backward
    cache.add_scores(0, at::tensor({0.f, 0.f, 5.f}).view({1, 3}));
    cache.update(0, at::randn({1, 1, 1, kQk}), at::randn({1, 1, 1, kV}));
    REQUIRE(cache.evict(0) > 0);  // moves a row into a slot k covers
    CHECK_THROWS_WITH(loss.backward(), Contains("modified by an inplace operation"));
  });
}

TEST_CASE("An allocation failure at any point of a tensor-path pass leaves the cache as it was", "[mla_cache][cpu]") {
  ForceTensorPath guard(true);
  bool completed = false;
  for (int64_t fail_at = 1; fail_at < 400 && !completed; ++fail_at) {
    INFO("failing allocation " << fail_at);
    at::manual_seed(11);
    MlaCache cache(small_options(1, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));  // capacity 4
    cache.update(0, at::randn({2, 2, 7, kQk}), at::randn({2, 2, 7, kV}));
    cache.add_scores(0, at::rand({2, 7}));
    const auto before = snapshot(cache);
    int64_t evicted = -1;
    bool failed = false;
    {
      kvevict_test::CountingCpuAllocator failing;
      failing.fail_at(fail_at);
      try {
        evicted = cache.evict(0);
      } catch (const c10::Error&) {
        failed = true;
      }
      if (failed) CHECK(failing.failed());  // (a failed shrink after a completed pass is not an error)
    }
    if (failed) {
      CHECK(same_state(before, snapshot(cache)));
    } else {
      completed = true;
      CHECK(evicted == 2 * 3);
      CHECK(cache.size(0) == 4);
    }
  }
  CHECK(completed);
}

TEST_CASE("Sparse, meta and undefined inputs get a message naming the argument", "[mla_cache][errors][cpu]") {
  MlaCache cache(small_options(1, 1, 2), EvictionOptions(2));
  cache.update(0, at::randn({1, 2, 2, kQk}), at::randn({1, 2, 2, kV}));
  const auto before = snapshot(cache);
  const auto k = at::randn({1, 2, 1, kQk}), v = at::randn({1, 2, 1, kV});
  CHECK_THROWS_WITH(cache.update(0, k.to_sparse(), v), Contains("k_new must be a dense (strided) tensor"));
  CHECK_THROWS_WITH(cache.update(0, k, v.to_sparse()), Contains("v_new must be a dense (strided) tensor"));
  CHECK_THROWS_WITH(cache.update(0, at::empty({1, 2, 1, kQk}, at::Device(at::kMeta)), v),
                    Contains("k_new must have data") && Contains("meta"));
  CHECK_THROWS_WITH(cache.observe(0, at::rand({1, 2, 1, 2}).to_sparse()),
                    Contains("attention probs must be a dense (strided) tensor"));
  CHECK_THROWS_WITH(cache.add_scores(0, at::rand({1, 2}).to_sparse()), Contains("scores must be a dense (strided) tensor"));
  CHECK_THROWS_WITH(kvevict::attend(at::randn({1, 2, 1, kQk}).to_sparse(), cache, 0),
                    Contains("q must be a dense (strided) tensor"));
  CHECK(same_state(before, snapshot(cache)));
}

TEST_CASE("positions() and scores() are copies: writing into them leaves the cache alone", "[mla_cache][cpu]") {
  kvevict_test::on_both_paths([] {
    MlaCache cache(small_options(1, 1, 2), EvictionOptions(1).n_sink(1).n_recent(1));
    cache.update(0, at::randn({1, 2, 4, kQk}), at::randn({1, 2, 4, kV}));
    const auto before = snapshot(cache);
    const MlaCache& view = cache;
    view.positions(0).fill_(0);
    view.scores(0).fill_(9);
    CHECK(same_state(before, snapshot(cache)));
    CHECK(cache.evict(0) == 1);
    CHECK(kept_positions(cache, 0) == std::vector<int64_t>{0, 2, 3});
  });
}

TEST_CASE("Observations are checked by default on CPU (range, causality), off by default on CUDA",
          "[mla_cache][errors][cpu]") {
  CHECK(kvevict::EvictionPolicyOptions(1, 1).checks_observations(at::Device(at::kCPU)));
  CHECK_FALSE(kvevict::EvictionPolicyOptions(1, 1).checks_observations(at::Device(at::kCUDA)));
  CHECK(kvevict::EvictionPolicyOptions(1, 1).check_observations(true).checks_observations(at::Device(at::kCUDA)));
  kvevict_test::on_both_paths([] {
    MlaCache cache(small_options(1, 1, 2), EvictionOptions(1).n_sink(1).n_recent(1));
    CHECK(cache.policy().checks_observations());
    cache.update(0, at::randn({1, 2, 3, kQk}), at::randn({1, 2, 3, kV}));
    const auto before = snapshot(cache);
    // Query 0 (position 0) gives mass to position 2: not causal.
    auto p = at::zeros({1, 2, 3, 3});
    p.select(2, 0).select(2, 2).fill_(0.5);
    CHECK_THROWS_WITH(cache.observe(0, p), Contains("causal"));
    CHECK_THROWS_WITH(cache.observe(0, at::full({1, 2, 1, 3}, -0.25)), Contains("[0, 1]"));
    CHECK_THROWS_WITH(cache.observe(0, at::full({1, 2, 1, 3}, 1.5)), Contains("[0, 1]"));
    CHECK(same_state(before, snapshot(cache)));
    // Unchecked, the same inputs are accepted; out-of-range values are clamped to [0, 1].
    MlaCache unchecked(small_options(1, 1, 2).check_observations(false), EvictionOptions(1).n_sink(1).n_recent(1));
    unchecked.update(0, at::randn({1, 2, 3, kQk}), at::randn({1, 2, 3, kV}));
    unchecked.observe(0, at::full({1, 2, 1, 3}, 1.5));
    CHECK(to_vec<float>(unchecked.scores(0)[0]) == std::vector<float>{1.f, 1.f, 1.f});
  });
}

TEST_CASE("reserve is all or nothing: an allocation failure in any layer changes no layer", "[mla_cache][cpu]") {
  kvevict_test::on_both_paths([] {
    bool completed = false;
    for (int64_t fail_at = 1; fail_at < 200 && !completed; ++fail_at) {
      INFO("failing allocation " << fail_at);
      MlaCache cache(small_options(3, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
      cache.update(1, at::randn({2, 2, 3, kQk}), at::randn({2, 2, 3, kV}));
      const auto before = snapshot(cache);
      bool failed = false;
      {
        kvevict_test::CountingCpuAllocator failing;
        failing.fail_at(fail_at);
        try {
          cache.reserve(64);
        } catch (const c10::Error&) {
          failed = true;
        }
      }
      if (failed) {
        CHECK(same_state(before, snapshot(cache)));
      } else {
        completed = true;
        for (int64_t l = 0; l < 3; ++l) CHECK(cache.slots(l) == 65);  // 64 tokens + the trash slot
      }
    }
    CHECK(completed);
  });
}

TEST_CASE("An update that throws does not grow the buffers first", "[mla_cache][errors][cpu]") {
  kvevict_test::on_both_paths([] {
    MlaCache cache(small_options(1, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
    cache.finish(1);
    const auto before = snapshot(cache);
    CHECK_THROWS_WITH(cache.update(0, at::zeros({2, 2, 20, kQk}), at::zeros({2, 2, 20, kV}), {0, 20}),
                      Contains("row 1 holds no sequence"));
    CHECK(same_state(before, snapshot(cache)));
    CHECK(cache.slots(0) == 6);
  });
}

TEST_CASE("An allocation failure at any point of an update leaves the cache as it was", "[mla_cache][errors][cpu]") {
  // Three updates, each with every one of its allocations failed in turn: a long one that
  // grows the buffers (6 slots to 33: room for 32 tokens and the trash slot), a ragged one that
  // grows them, and a ragged one that fits (rows of unequal lengths, so a slot written past a
  // shorter row's length would show).
  struct Case {
    const char* name;
    std::vector<int64_t> before_counts;  // an update before, T = max (empty: none)
    std::vector<int64_t> counts;         // the update under test, T = max
    int64_t slots_after;
  };
  const std::vector<Case> cases = {{"growing", {}, {32, 32}, 33},
                                   {"growing, ragged", {}, {32, 7}, 33},
                                   {"ragged, fits", {4, 2}, {0, 1}, 6}};
  kvevict_test::on_both_paths([&] {
    for (const auto& c : cases) {
      INFO(c.name);
      bool completed = false;
      for (int64_t fail_at = 1; fail_at < 400 && !completed; ++fail_at) {
        INFO("failing allocation " << fail_at);
        at::manual_seed(12);
        MlaCache cache(small_options(1, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));  // capacity 4, 6 slots
        if (!c.before_counts.empty()) {
          const int64_t T = *std::max_element(c.before_counts.begin(), c.before_counts.end());
          cache.update(0, at::randn({2, 2, T, kQk}), at::randn({2, 2, T, kV}), c.before_counts);
        }
        const int64_t T = *std::max_element(c.counts.begin(), c.counts.end());
        const auto k = at::randn({2, 2, T, kQk}), v = at::randn({2, 2, T, kV});
        const auto before = snapshot(cache);
        REQUIRE(cache.slots(0) == 6);
        bool failed = false;
        {
          kvevict_test::CountingCpuAllocator failing;
          failing.fail_at(fail_at);
          try {
            cache.update(0, k, v, c.counts);
          } catch (const c10::Error&) {
            failed = true;
          }
        }
        if (failed) {
          CHECK(same_state(before, snapshot(cache)));
          CHECK(cache.slots(0) == 6);
        } else {
          completed = true;
          CHECK(cache.slots(0) == c.slots_after);
          for (int64_t b = 0; b < 2; ++b) {
            const int64_t had = c.before_counts.empty() ? 0 : c.before_counts[b];
            CHECK(cache.size(0, b) == had + c.counts[b]);
          }
        }
      }
      CHECK(completed);
    }
  });
}

TEST_CASE("An allocation failure in reserve() or in growth names the call and the sizes", "[mla_cache][errors][cpu]") {
  kvevict_test::on_both_paths([] {
    // reserve: every allocation it makes, failed in turn, gives a message naming reserve and
    // the slots asked for (room for 64 tokens and the trash slot).
    bool completed = false;
    for (int64_t fail_at = 1; fail_at < 200 && !completed; ++fail_at) {
      INFO("failing allocation " << fail_at);
      MlaCache cache(small_options(2, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
      std::string what;
      {
        kvevict_test::CountingCpuAllocator failing;
        failing.fail_at(fail_at);
        try {
          cache.reserve(64);
        } catch (const c10::Error& e) {
          what = e.what_without_backtrace();
        }
      }
      completed = what.empty();
      if (!completed) {
        CHECK_THAT(what, Contains("reserve") && Contains("to 65 slots per row") && Contains("layer") &&
                             Contains("injected allocation failure"));
      }
    }
    CHECK(completed);
    // Too large for any machine (2^40 slots of 64 heads x 320 floats: 2^56 bytes, past the
    // address space): the allocator's own failure.
    MlaCache cache(MlaCacheOptions(1, 64), EvictionOptions(2).n_sink(1).n_recent(1));
    CHECK_THROWS_WITH(cache.reserve(int64_t{1} << 40),
                      Contains("reserve") && Contains("1099511627777 slots per row") && Contains("num_heads=64"));
    CHECK(cache.slots(0) == 6);
    // Growth by a long update (6 slots to 33): every failure names update, the layer and, for the
    // growth itself, the slots.
    completed = false;
    bool growth_named = false;
    for (int64_t fail_at = 1; fail_at < 200 && !completed; ++fail_at) {
      INFO("failing allocation " << fail_at);
      MlaCache c(small_options(1, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
      const auto k = at::randn({2, 2, 32, kQk}), v = at::randn({2, 2, 32, kV});
      std::string what;
      {
        kvevict_test::CountingCpuAllocator failing;
        failing.fail_at(fail_at);
        try {
          c.update(0, k, v);
        } catch (const c10::Error& e) {
          what = e.what_without_backtrace();
        }
      }
      completed = what.empty();
      if (!completed) {
        CHECK_THAT(what, Contains("update") && Contains("layer 0") && Contains("injected allocation failure"));
        growth_named = growth_named || what.find("from 6 to 33 slots per row") != std::string::npos;
      }
    }
    CHECK(completed);
    CHECK(growth_named);
  });
}

// Issue 38 item 5 (a break-it round), D5: a moved-from cache holds no buffers; reset() on it
// segfaulted on both paths. Every call now throws or returns cleanly, reset() included.
TEST_CASE("a moved-from cache refuses reset() with a clear error, on both paths", "[mla_cache][errors][cpu]") {
  for (const bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    MlaCache from(small_options(2, 2, 2).tier_tokens(8).tier_page_size(2), EvictionOptions(2).n_sink(1).n_recent(1));
    from.update(0, at::randn({2, 2, 3, kQk}), at::randn({2, 2, 3, kV}));
    MlaCache to(std::move(from));
    CHECK(to.size(0) == 3);
    CHECK_THROWS_WITH(from.reset(), Contains("kvevict: ") && Contains("reset") && Contains("moved from"));
    CHECK_THROWS_WITH(from.reset(0), Contains("kvevict: ") && Contains("moved from"));
    // Every other call throws (or returns) cleanly.
    const std::vector<std::function<void()>> calls = {
        [&] { from.update(0, at::randn({2, 2, 1, kQk}), at::randn({2, 2, 1, kV})); },
        [&] { from.evict(0); },
        [&] { from.evict_now(0); },
        [&] { from.truncate(0, 1); },
        [&] { from.finish(0); },
        [&] { from.reserve(8); },
        [&] { from.reserve_tier(8); },
        [&] { from.add_sequence(); },
        [&] { from.positions(0); },
        [&] { from.tier_size(0, 0); },
        [&] { from.stats(); },
        [&] { from.recall(0, at::randn({2, 2, 1, kQk}), 0.5, 2); },
        [&] { kvevict::attend(at::randn({2, 2, 1, kQk}), from, 0); },
    };
    for (size_t i = 0; i < calls.size(); ++i) {
      CAPTURE(i);
      try {
        calls[i]();
      } catch (const c10::Error& e) {
        CHECK_THAT(e.what_without_backtrace(), Contains("kvevict: "));
      }
    }
    // And a cache assigned to it works.
    from = MlaCache(small_options(2, 2, 2), EvictionOptions(2).n_sink(1).n_recent(1));
    CHECK_NOTHROW(from.reset());
    CHECK(from.size(0) == 0);
  }
}

// The break-it round: a NaN key made every attend on its layer throw (with checks on), and
// neither that error nor the README named the key. With checks on, update refuses it.
TEST_CASE("with checks on, update refuses a non-finite key naming the layer, row and position, and changes nothing",
          "[mla_cache][errors][cpu]") {
  for (const bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    MlaCache cache(small_options(2, 2, 2), EvictionOptions(4).n_sink(1).n_recent(1));
    cache.update(1, at::randn({2, 2, 3, kQk}), at::randn({2, 2, 3, kV}));
    const auto pos = cache.positions(1);
    auto k = at::randn({2, 2, 2, kQk});
    k[1][0][1][5] = kNaN;  // row 1, head 0, the chunk's second token: position 4
    const auto m = kvevict_test::message_of([&] { cache.update(1, k, at::randn({2, 2, 2, kV})); });
    CHECK_THAT(m, Contains("kvevict: ") && Contains("k_new") && Contains("layer 1") && Contains("row 1") &&
                      Contains("position 4") && Contains("nan"));
    CHECK(cache.seen_tokens(1) == 3);
    CHECK(at::equal(cache.positions(1), pos));
    k[1][0][1][5] = kInf;
    CHECK_THAT(kvevict_test::message_of([&] { cache.update(1, k, at::randn({2, 2, 2, kV})); }), Contains("inf"));
    // A NaN value is the caller's business (it never reaches a probability); a pad's key is never stored.
    auto v = at::randn({2, 2, 2, kV});
    v[0][1][0][0] = kNaN;
    CHECK_NOTHROW(cache.update(1, at::randn({2, 2, 2, kQk}), v));
    auto kp = at::randn({2, 2, 2, kQk});
    kp[1][0][0][0] = kNaN;  // row 1 appends one token: column 0 is its pad
    CHECK_NOTHROW(cache.update(1, kp, at::randn({2, 2, 2, kV}), {2, 1}));
    // With checks off, accepted as before.
    MlaCache off(small_options(1, 2, 2).check_observations(false), EvictionOptions(4).n_sink(1).n_recent(1));
    k[1][0][1][5] = kNaN;
    CHECK_NOTHROW(off.update(0, k, at::randn({2, 2, 2, kV})));
  }
}

// The break-it round, D3: a legal but huge budget (2^31 - 4, 128 heads) filled the eviction state
// (~24 GB) before it tried the far larger buffers; the process was OOM-killed. The constructor
// now checks what it would allocate first: nothing large is allocated before the error.
TEST_CASE("a cache too large for the machine is refused before anything large is allocated", "[mla_cache][errors][cpu]") {
  for (const bool tensor_path : {false, true}) {
    INFO(path_name(tensor_path));
    ForceTensorPath guard(tensor_path);
    kvevict_test::CountingCpuAllocator counting;
    const int64_t budget = (int64_t{1} << 31) - 4;
    const auto m = kvevict_test::message_of([&] {
      MlaCache c(MlaCacheOptions(1, 128), EvictionOptions(budget));
    });
    CHECK_THAT(m, Contains("kvevict: ") && Contains("budget=2147483644") && Contains("bytes"));
    CHECK(counting.largest() < (size_t{1} << 20));  // nothing large was asked for
    const auto ml = kvevict_test::message_of([&] {
      kvevict::MlaLatentCache c(kvevict::MlaLatentCacheOptions(1, 128), EvictionOptions(budget));
    });
    CHECK_THAT(ml, Contains("kvevict: ") && Contains("budget=2147483644"));
    CHECK(counting.largest() < (size_t{1} << 20));
  }
}
