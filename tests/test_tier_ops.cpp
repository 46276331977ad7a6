// The tier's ops (include/kvevict/detail/tier/ops/): each compiled kernel (src/kernels/, linked
// into this executable through kvevict::kernels) against its ATen reference form, bit for bit,
// on random stores shaped as TierStore keeps them; on CUDA too where a device is usable. The
// differential tests of test_tier.cpp (host path against tensor path) run the kernels as well.
#include "op_counter.hpp"
#include "support.hpp"

#include <kvevict/kvevict.hpp>
#include <kvevict/detail/tier/ops/ops.hpp>
#include <kvevict/kernels.hpp>

#include <ATen/core/dispatch/Dispatcher.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace {

using PickSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                   const at::Tensor&, const at::Tensor&, int64_t, int64_t);

/// The compiled op itself, through the dispatcher (whatever kvevict::set_kernels_enabled() says).
std::tuple<at::Tensor, at::Tensor> pick_pages_kernel(const at::Tensor& scores, const at::Tensor& members,
                                                     const at::Tensor& position, const at::Tensor& seq,
                                                     const at::Tensor& limit, int64_t K, int64_t page_size) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kvevict::pick_pages", "").typed<PickSig>();
  return op.call(scores, members, position, seq, limit, K, page_size);
}

/// A random store as TierStore keeps it: B rows of N slots and the trash slot, each slot free
/// (-1) or holding a distinct position below `max_position`, distinct insertion numbers, each
/// page id's members counted from the positions ([B, P + 1], the trash page last), and page
/// scores [B, P] with zeros, ties, NaNs and infinities.
struct Store {
  at::Tensor scores, members, position, seq, limit;
  int64_t K = 0, page_size = 1;
};

Store random_store(std::mt19937& rng, int64_t B, int64_t N, int64_t page_size, int64_t max_position, int64_t K) {
  const int64_t P = (max_position - 1) / page_size + 1;
  Store s;
  s.K = K;
  s.page_size = page_size;
  s.position = at::full({B, N + 1}, -1, at::kLong);
  s.seq = at::zeros({B, N + 1}, at::kLong);
  s.members = at::zeros({B, P + 1}, at::kLong);
  s.scores = at::zeros({B, P}, at::kDouble);
  s.limit = at::zeros({B}, at::kLong);
  auto pos = s.position.accessor<int64_t, 2>();
  auto seq = s.seq.accessor<int64_t, 2>();
  auto members = s.members.accessor<int64_t, 2>();
  auto scores = s.scores.accessor<double, 2>();
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> positions(static_cast<size_t>(max_position));
    std::iota(positions.begin(), positions.end(), 0);
    std::shuffle(positions.begin(), positions.end(), rng);
    std::vector<int64_t> order(static_cast<size_t>(N));
    std::iota(order.begin(), order.end(), 1000);
    std::shuffle(order.begin(), order.end(), rng);
    const double free = u(rng) * 0.5;
    for (int64_t n = 0; n < N && n < max_position; ++n) {
      seq[b][n] = order[static_cast<size_t>(n)];
      if (u(rng) < free) continue;
      pos[b][n] = positions[static_cast<size_t>(n)];
      ++members[b][pos[b][n] / page_size];
    }
    for (int64_t p = 0; p < P; ++p) {
      const double r = u(rng);
      scores[b][p] = r < 0.15 ? 0.0 : r < 0.2 ? std::numeric_limits<double>::quiet_NaN()
                   : r < 0.22 ? std::numeric_limits<double>::infinity() : r < 0.35 ? 0.5 : std::floor(u(rng) * 8) / 8;
    }
    s.limit[b] = static_cast<int64_t>(u(rng) * static_cast<double>(K + 1));
  }
  return s;
}

void require_same(const std::tuple<at::Tensor, at::Tensor>& got, const std::tuple<at::Tensor, at::Tensor>& want) {
  REQUIRE(std::get<0>(got).sizes() == std::get<0>(want).sizes());
  REQUIRE(at::equal(std::get<0>(got).cpu(), std::get<0>(want).cpu()));
  REQUIRE(at::equal(std::get<1>(got).cpu(), std::get<1>(want).cpu()));
}

}  // namespace

TEST_CASE("ops: the kernels are registered for the CPU, and the switch selects the form that runs", "[tier][ops]") {
  REQUIRE(kvevict::kernels_available(c10::DeviceType::CPU));
  REQUIRE(kvevict::kernels_enabled());
  kvevict::set_kernels_enabled(false);
  CHECK_FALSE(kvevict::kernels_enabled());
  kvevict::set_kernels_enabled(true);
  CHECK(kvevict::kernels_enabled());
}

TEST_CASE("ops: pick_pages' kernel equals its reference form, slot for slot", "[tier][ops]") {
  std::mt19937 rng(20261206);
  int64_t picked = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int64_t B = 1 + trial % 3, page_size = std::vector<int64_t>{1, 2, 3, 4, 8, 64}[trial % 6];
    const int64_t N = std::vector<int64_t>{0, 1, 5, 16, 40, 130}[(trial / 6) % 6];
    const int64_t max_position = std::max<int64_t>(1, N + (trial % 7) * 9);
    const int64_t K = std::vector<int64_t>{0, 1, 3, 7, 64, 256}[(trial / 36) % 6];
    INFO("trial " << trial << ": B " << B << ", N " << N << ", page_size " << page_size << ", K " << K);
    const auto s = random_store(rng, B, N, page_size, max_position, K);
    const auto want = kvevict::detail::reference::pick_pages(s.scores, s.members, s.position, s.seq, s.limit, K, page_size);
    require_same(pick_pages_kernel(s.scores, s.members, s.position, s.seq, s.limit, K, page_size), want);
    // Fewer page ids scored than the digests hold (scores [B, P'] with P' < P), and a limit of K.
    const int64_t P = s.scores.size(1);
    if (P > 1) {
      const auto fewer = s.scores.narrow(1, 0, P - 1);
      require_same(pick_pages_kernel(fewer, s.members, s.position, s.seq, s.limit, K, page_size),
                   kvevict::detail::reference::pick_pages(fewer, s.members, s.position, s.seq, s.limit, K, page_size));
    }
    const auto all = at::full({B}, K, at::kLong);
    require_same(pick_pages_kernel(s.scores, s.members, s.position, s.seq, all, K, page_size),
                 kvevict::detail::reference::pick_pages(s.scores, s.members, s.position, s.seq, all, K, page_size));
    picked += std::get<1>(want).sum().item<int64_t>();
  }
  CHECK(picked > 1000);  // the draws take pages, not only nothing
}

TEST_CASE("ops: pick_pages refuses arguments of the wrong dtype or shape, naming them", "[tier][ops]") {
  std::mt19937 rng(7);
  const auto s = random_store(rng, 2, 8, 2, 12, 4);
  using Catch::Matchers::Contains;
  CHECK_THAT(kvevict_test::message_of([&] {
               pick_pages_kernel(s.scores.to(at::kFloat), s.members, s.position, s.seq, s.limit, 4, 2);
             }),
             Contains("scores must be Double"));
  CHECK_THAT(kvevict_test::message_of([&] {
               pick_pages_kernel(s.scores, s.members, s.position, s.seq.narrow(1, 0, 3), s.limit, 4, 2);
             }),
             Contains("seq must be"));
  CHECK_THAT(kvevict_test::message_of([&] {
               pick_pages_kernel(s.scores, s.members, s.position, s.seq, s.limit, 4, 0);
             }),
             Contains("page_size must be > 0, got 0"));
}

TEST_CASE("ops: pick_pages' CUDA kernel equals its reference form on the CPU", "[tier][ops][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
  REQUIRE(kvevict::kernels_available(c10::DeviceType::CUDA));
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t B = 1 + trial % 4, page_size = std::vector<int64_t>{1, 4, 64}[trial % 3];
    const int64_t N = std::vector<int64_t>{0, 7, 64, 300}[(trial / 3) % 4], K = std::vector<int64_t>{1, 3, 256}[trial % 3];
    const auto s = random_store(rng, B, N, page_size, std::max<int64_t>(1, 2 * N), K);
    const auto want = kvevict::detail::reference::pick_pages(s.scores, s.members, s.position, s.seq, s.limit, K, page_size);
    const at::Device cuda(at::kCUDA);
    require_same(pick_pages_kernel(s.scores.to(cuda), s.members.to(cuda), s.position.to(cuda), s.seq.to(cuda),
                                   s.limit.to(cuda), K, page_size),
                 want);
  }
}

namespace {

using kvevict_test::KernelsEnabled;

/// Three caches fed the same calls: the host path, and the tensor path with the compiled
/// kernels and with the reference forms. After every call all three hold the same positions,
/// scores, rows and tier (positions, ranks, rows), and recall the same tokens: the kernels
/// equal the reference and the host path, pick for pick and bit for bit. `make(tensor_path)`
/// builds a cache; `update(cache)`, `recall(cache)` (tokens recalled), `observe(cache)`;
/// `two_level`: the recalls rescore a pool. The kernel cache's recalls must run every compiled
/// op they have a use for, the reference cache's none.
template <class Make, class Update, class Recall, class Observe>
void check_kernels_match(Make&& make, Update&& update, Recall&& recall, Observe&& observe, int64_t steps,
                         bool two_level) {
  kvevict_test::ForceTensorPath to_host(false);
  auto host = make();
  kvevict_test::ForceTensorPath to_tensor(true);
  auto kernel = make(), reference = make();
  REQUIRE(host.policy().host_path());
  REQUIRE_FALSE(kernel.policy().host_path());
  const auto on = [&](bool kernels, auto&& f) {
    KernelsEnabled k(kernels);
    return f();
  };
  int64_t recalled = 0;
  std::set<std::string> ran;  // the compiled ops the kernel cache's recalls ran
  for (int64_t step = 0; step < steps; ++step) {
    CAPTURE(step);
    update(host, step);
    on(true, [&] { update(kernel, step); return 0; });
    on(false, [&] { update(reference, step); return 0; });
    if (step % 2 == 1) {
      const int64_t n = recall(host, step);
      // The kernel cache's recall runs the compiled ops; the reference cache's runs none.
      const auto compiled = [&](auto& cache, bool kernels) {
        kvevict_test::OpRecorder rec;
        CHECK(on(kernels, [&] { return recall(cache, step); }) == n);
        REQUIRE(rec.ok());
        std::set<std::string> ops;
        for (const auto& e : rec.events()) {
          if (e.name.rfind("kvevict::", 0) == 0) ops.insert(e.name);
        }
        return ops;
      };
      for (const auto& op : compiled(kernel, true)) ran.insert(op);
      CHECK(compiled(reference, false).empty());
      recalled += n;
    }
    observe(host, step);
    host.evict(0);
    on(true, [&] { observe(kernel, step); kernel.evict(0); return 0; });
    on(false, [&] { observe(reference, step); reference.evict(0); return 0; });
    for (auto* c : {&kernel, &reference}) {
      REQUIRE(at::equal(c->positions(0), host.positions(0)));
      CHECK(at::equal(c->scores(0), host.scores(0)));
      for (int64_t r = 0; r < host.batch_size(); ++r) {
        REQUIRE(c->tier_size(0, r) == host.tier_size(0, r));
        CHECK(at::equal(c->tier_positions(0, r), host.tier_positions(0, r)));
        CHECK(at::equal(c->tier_scores(0, r), host.tier_scores(0, r)));
        CHECK(at::equal(c->tier_rows(0, r).first, host.tier_rows(0, r).first));
        CHECK(at::equal(c->tier_rows(0, r).second, host.tier_rows(0, r).second));
      }
    }
  }
  CHECK(recalled > 0);
  CHECK(ran.count("kvevict::pick_pages") == 1);
  CHECK(ran.count("kvevict::recall_victims") == 1);
  CHECK(ran.count("kvevict::recall_swap") == 1);
  if (two_level) {
    CHECK(ran.count("kvevict::pool_gather") == 1);
    CHECK(ran.count("kvevict::pick_tokens") == 1);
  }
}

}  // namespace

TEST_CASE("ops: recall with the compiled kernels equals the reference forms and the host path, both layouts",
          "[tier][ops][recall]") {
  const auto scoring = GENERATE(kvevict::TierScoring::kPerHead, kvevict::TierScoring::kHeadMean);
  const int64_t page = GENERATE(int64_t{1}, int64_t{2}, int64_t{3});
  const int64_t rescore = GENERATE(int64_t{0}, int64_t{6});  // whole pages; two-level
  const auto dtype = GENERATE(at::kFloat, at::kBFloat16);
  CAPTURE(scoring == kvevict::TierScoring::kHeadMean, page, rescore, dtype);
  const int64_t B = 2, H = 2, T = 2, steps = 24;
  const std::vector<int64_t> counts{1, 2};  // ragged rows
  const auto e = kvevict::EvictionOptions(5).n_sink(1).n_recent(2).evict_every(2);
  const auto probs = [&](auto& cache, int64_t step) {
    at::manual_seed(1000 + step);
    const auto live = cache.positions(0).ge(0).view({B, 1, 1, -1}).to(at::kFloat);
    return at::softmax(at::randn({B, H, T, cache.size(0)}), -1).mul(live);
  };
  SECTION("latent") {
    const int64_t W = 4, R = 2;
    check_kernels_match(
        [&] {
          return kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(1, H)
                                             .batch_size(B).kv_lora_rank(W).qk_rope_dim(R).dtype(dtype)
                                             .check_observations(false).tier_tokens(9).tier_page_size(page)
                                             .tier_scoring(scoring),
                                         e);
        },
        [&](auto& c, int64_t step) {
          at::manual_seed(step);
          c.update(0, at::randn({B, T, W}).to(dtype), at::randn({B, T, R}).to(dtype), counts);
        },
        [&](auto& c, int64_t step) {
          at::manual_seed(500 + step);
          const auto qa = at::randn({B, H, T, W}), qp = at::randn({B, H, T, R});
          return kvevict_test::total(c.recall_absorbed(0, qa, qp, 0.5, 3, rescore));
        },
        [&](auto& c, int64_t step) { c.observe(0, probs(c, step)); }, steps, rescore > 0);
  }
  SECTION("expanded") {
    const int64_t D = 3, V = 2;
    check_kernels_match(
        [&] {
          return kvevict::MlaCache(kvevict::MlaCacheOptions(1, H)
                                       .batch_size(B).qk_dim(D).v_dim(V).dtype(dtype).check_observations(false)
                                       .tier_tokens(9).tier_page_size(page).tier_scoring(scoring),
                                   e);
        },
        [&](auto& c, int64_t step) {
          at::manual_seed(step);
          c.update(0, at::randn({B, H, T, D}).to(dtype), at::randn({B, H, T, V}).to(dtype), counts);
        },
        [&](auto& c, int64_t step) {
          at::manual_seed(500 + step);
          return kvevict_test::total(c.recall(0, at::randn({B, H, T, D}), 0.5, 3, rescore));
        },
        [&](auto& c, int64_t step) { c.observe(0, probs(c, step)); }, steps, rescore > 0);
  }
}

TEST_CASE("ops: indices out of range and empty stores are refused on the CPU, naming the argument", "[tier][ops]") {
  using Catch::Matchers::Contains;
  using PoolSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                                 at::TensorList, c10::IntArrayRef, int64_t);
  using TokensSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, int64_t, int64_t);
  using VictimsSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, int64_t, int64_t);
  auto& d = c10::Dispatcher::singleton();
  const auto pool = d.findSchemaOrThrow("kvevict::pool_gather", "").typed<PoolSig>();
  const auto tokens = d.findSchemaOrThrow("kvevict::pick_tokens", "").typed<TokensSig>();
  const auto victims = d.findSchemaOrThrow("kvevict::recall_victims", "").typed<VictimsSig>();
  const auto longs = at::TensorOptions().dtype(at::kLong);
  const auto store_position = at::tensor(std::vector<int64_t>{0, 1, 2, -1}, longs).view({1, 4});  // N = 3
  const std::vector<at::Tensor> views{at::zeros({1, 4, 2})};
  CHECK_THAT(kvevict_test::message_of([&] {
               pool.call(at::tensor(std::vector<int64_t>{0, 7}, longs).view({1, 2}), at::full({1}, 2, longs), store_position,
                         views, {0}, 1);
             }),
             Contains("slots must hold values in [0, 3], got 7"));
  CHECK_THAT(kvevict_test::message_of([&] {
               pool.call(at::zeros({1, 2}, longs), at::ones({1}, longs), at::zeros({1, 0}, longs), views, {0}, 1);
             }),
             Contains("trash slot"));
  CHECK_THAT(kvevict_test::message_of([&] {
               pool.call(at::zeros({1, 2}, longs), at::ones({1}, longs), store_position, views, {0}, 0);
             }),
             Contains("groups must be >= 1, got 0"));
  // K below the count of positive scores: the columns past K are not written.
  const auto exact = at::ones({1, 4}, at::kDouble);
  const auto picked = tokens.call(exact, at::ones({1, 4}, at::kBool), at::arange(4, longs).view({1, 4}),
                                  at::full({1}, 4, longs), 1, 3);
  CHECK(std::get<0>(picked).sizes() == at::IntArrayRef{1, 1});
  // A cache of no slots: no candidates, a zero state.
  const auto none = victims.call(at::zeros({1, 0}), at::zeros({1, 0}, longs), at::zeros({1, 0, 2}),
                                 at::zeros({1, 3}, longs), at::zeros({1}, longs), 0, 0);
  CHECK(std::get<1>(none).item<int64_t>() == 0);
  CHECK(at::equal(std::get<2>(none), at::zeros({1, 2})));
}
