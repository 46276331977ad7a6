// The decode steady state (docs/DESIGN.md, "Performance principles"): update + observe +
// evict allocate nothing on CPU, a CUDA graph of the step replays like eager, and a long run
// holds the cache's memory flat.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <c10/core/CPUAllocator.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

// CUDA graphs need the CUDA headers and libtorch_cuda. A CPU-only LibTorch may still ship
// ATen/cuda headers (Debian's does) without the CUDA runtime headers or library, so the build
// can say for sure (-DKVEVICT_CUDA_GRAPHS=0/1, from TORCH_CUDA_LIBRARIES); otherwise guess
// from the headers that CUDAGraph.h itself needs.
#ifndef KVEVICT_CUDA_GRAPHS
#if __has_include(<ATen/cuda/CUDAGraph.h>) && __has_include(<cuda_runtime_api.h>)
#define KVEVICT_CUDA_GRAPHS 1
#else
#define KVEVICT_CUDA_GRAPHS 0
#endif
#endif
#if KVEVICT_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using kvevict_test::CountingCpuAllocator;

/// Drives one layer of `Cache` (MlaCache or MlaLatentCache shapes) in the decode steady state:
/// full at capacity, each step appends 1 token, observes [B, H, 1, capacity + 1] and evicts 1.
template <class Cache>
struct SteadyState {
  Cache cache;
  std::vector<at::Tensor> rows;  // one token's rows, as update() takes them
  at::Tensor probs;              // [B, H, 1, capacity + 1] fp32, allocated once

  SteadyState(Cache c, std::vector<std::vector<int64_t>> token_shapes, std::vector<std::vector<int64_t>> fill_shapes)
      : cache(std::move(c)) {
    const int64_t B = cache.batch_size(), H = cache.num_heads(), cap = cache.capacity();
    const auto filled = [&](const std::vector<int64_t>& shape) { return at::randn(shape); };
    for (const auto& s : token_shapes) rows.push_back(filled(s));
    std::vector<at::Tensor> prefill;
    for (const auto& s : fill_shapes) prefill.push_back(filled(s));
    cache.update(0, prefill[0], prefill[1]);  // capacity tokens at once: no pass yet
    probs = at::softmax(at::randn({B, H, 1, cap + 1}), -1);
  }

  /// One decode step; returns the tokens evicted per row.
  int64_t step() {
    cache.update(0, rows[0], rows[1]);
    cache.observe(0, probs);
    return cache.evict(0);
  }
};

template <class Policy>
SteadyState<kvevict::BasicMlaCache<Policy>> expanded(int64_t B, int64_t H, int64_t cap, bool check_finite) {
  const int64_t qk = 24, v = 16;
  kvevict::BasicMlaCache<Policy> cache(
      kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(qk).v_dim(v).check_observations(check_finite),
      kvevict::EvictionOptions(cap - 6).n_sink(2).n_recent(4));
  return {std::move(cache), {{B, H, 1, qk}, {B, H, 1, v}}, {{B, H, cap, qk}, {B, H, cap, v}}};
}

template <class Policy>
SteadyState<kvevict::BasicMlaLatentCache<Policy>> latent(int64_t B, int64_t H, int64_t cap, bool check_finite) {
  const int64_t rank = 32, rope = 8;
  kvevict::BasicMlaLatentCache<Policy> cache(
      kvevict::MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(rank).qk_rope_dim(rope).check_observations(check_finite),
      kvevict::EvictionOptions(cap - 6).n_sink(2).n_recent(4));
  return {std::move(cache), {{B, 1, rank}, {B, 1, rope}}, {{B, cap, rank}, {B, cap, rope}}};
}

/// The first buffer of layer 0 (keys or ckv), to check that the buffers never move.
template <class P>
const void* first_buffer(const kvevict::BasicMlaCache<P>& c) { return c.keys(0).data_ptr(); }
template <class P>
const void* first_buffer(const kvevict::BasicMlaLatentCache<P>& c) { return c.ckv(0).data_ptr(); }

/// Runs `steps` steady-state steps under the counting allocator; checks that every step evicted
/// one token, that no CPU allocation happened and that the buffers never moved.
template <class State>
void require_no_allocation(State& s, int64_t steps) {
  for (int i = 0; i < 8; ++i) s.step();  // warm-up: the first pass and scratch have run
  const auto storage = first_buffer(s.cache);
  const auto bytes = s.cache.stats().bytes_allocated;
  int64_t evicted = 0, allocations = 0;
  {
    CountingCpuAllocator counting;
    for (int64_t i = 0; i < steps; ++i) evicted += s.step();
    allocations = counting.count();
  }
  CHECK(evicted == s.cache.batch_size() * steps);  // one token per row and step
  CHECK(allocations == 0);
  CHECK(first_buffer(s.cache) == storage);
  CHECK(s.cache.stats().bytes_allocated == bytes);
  CHECK(s.cache.size(0) == s.cache.capacity());
}

}  // namespace

TEST_CASE("the counting allocator sees CPU tensor storage but not views", "[steady_state][cpu]") {
  const auto base = at::zeros({4, 8});
  CountingCpuAllocator counting;
  auto view = base.narrow(1, 0, 4);
  CHECK(counting.count() == 0);
  auto fresh = at::empty({16});
  CHECK(counting.count() == 1);
  auto copy = view.contiguous();  // not contiguous: a copy
  CHECK(counting.count() == 2);
}

TEMPLATE_TEST_CASE("1,000 steady-state decode steps allocate nothing on CPU", "[steady_state][cpu]",
                   kvevict::CumulativeAttention, kvevict::MeanObservedAttention, kvevict::LatestAttention) {
  using Policy = kvevict::EvictionPolicy<TestType>;
  const bool check_finite = GENERATE(true, false);
  CAPTURE(check_finite);
  SECTION("expanded layout, batch 1") {
    auto s = expanded<Policy>(1, 4, 84, check_finite);
    require_no_allocation(s, 1000);
  }
  SECTION("expanded layout, batch 3") {
    auto s = expanded<Policy>(3, 2, 40, check_finite);
    require_no_allocation(s, 1000);
  }
  SECTION("latent layout, batch 2") {
    auto s = latent<Policy>(2, 4, 84, check_finite);
    require_no_allocation(s, 1000);
  }
}

TEST_CASE("update returns views over the cache's buffers, without allocating", "[steady_state][cpu]") {
  auto s = expanded<kvevict::EvictionPolicy<>>(2, 4, 20, true);
  s.step();
  CountingCpuAllocator counting;
  const auto kv = s.cache.update(0, s.rows[0], s.rows[1]);
  CHECK(counting.count() == 0);
  CHECK(kv.first.sizes() == at::IntArrayRef({2, 4, 21, 24}));
  CHECK(kv.second.sizes() == at::IntArrayRef({2, 4, 21, 16}));
  CHECK(kv.first.data_ptr() == s.cache.keys(0).data_ptr());
  CHECK(kv.second.data_ptr() == s.cache.values(0).data_ptr());
  // The newest token is in the last live slot, as the views show it.
  CHECK(at::equal(kv.first.select(2, 20), s.rows[0].select(2, 0)));
  CHECK(at::equal(kv.second.select(2, 20), s.rows[1].select(2, 0)));
}

TEST_CASE("update reads strided rows in place: no copy, the same values", "[steady_state][cpu]") {
  const int64_t B = 2, H = 3, qk = 24, v = 16, T = 5;
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(qk).v_dim(v),
                          kvevict::EvictionOptions(8).n_sink(1).n_recent(2));
  // A prefill chunk as models produce it: keys transposed from [B, T, H, qk], values narrowed
  // from a wider per-head projection (and, for the rows of one decode token, the same).
  const auto k = at::randn({B, T, H, qk}).transpose(1, 2);
  const auto v_wide = at::randn({B, H, T, 40});
  const auto v_new = v_wide.narrow(-1, 8, v);
  const auto k1 = at::randn({B, 1, H, qk}).transpose(1, 2);
  const auto v1 = at::randn({B, H, 1, 3 * v}).narrow(-1, v, v);
  REQUIRE_FALSE(k.is_contiguous());
  REQUIRE_FALSE(v_new.is_contiguous());
  REQUIRE_FALSE(v1.is_contiguous());
  {
    CountingCpuAllocator counting;
    cache.update(0, k, v_new);
    cache.update(0, k1, v1);
    CHECK(counting.count() == 0);
  }
  CHECK(at::equal(cache.keys(0), at::cat({k, k1}, 2)));
  CHECK(at::equal(cache.values(0), at::cat({v_new, v1}, 2)));
  // Rows that are not contiguous themselves (stride 2 in the last dim) are copied first.
  const auto k2 = at::randn({B, H, 1, 2 * qk}).slice(-1, 0, 2 * qk, 2);
  const auto v2 = at::randn({B, H, 1, v});
  cache.update(0, k2, v2);
  CHECK(at::equal(cache.keys(0).narrow(2, T + 1, 1), k2));
  CHECK(at::equal(cache.values(0).narrow(2, T + 1, 1), v2));
}

TEST_CASE("prefill_chunked grows the buffers once, not at every chunk, and gives the growth back", "[steady_state][cpu]") {
  // 1 head x 256 dims: a K or V buffer of 65+ slots is >= 65 KiB, while attention's temporaries
  // over 16 queries stay under 8 KiB, so allocations >= 60 KiB are K/V buffer moves.
  const auto e = kvevict::EvictionOptions(48).n_sink(4).n_recent(12);  // capacity 64, 66 base slots (trash)
  const int64_t T = 320, chunk = 16;
  at::manual_seed(5);
  const auto q = at::randn({1, 1, T, 256}), k = at::randn({1, 1, T, 256}), v = at::randn({1, 1, T, 256});
  const auto o = kvevict::MlaCacheOptions(1, 1).qk_dim(256).v_dim(256);
  kvevict_test::on_both_paths([&] {
    kvevict::MlaCache cache(o, e);
    REQUIRE(cache.slots(0) == 66);
    int64_t moves = 0;
    {
      CountingCpuAllocator counting(60 * 1024);
      kvevict::prefill_chunked(cache, 0, q, k, v, chunk);
      moves = counting.count();
    }
    // K and V grow to capacity + chunk = 80 tokens once, up front (2), and go back to 66 at the
    // end (2); growing and shrinking at each of the 16 chunks over capacity would be 64.
    CHECK(moves == 4);
    CHECK(cache.slots(0) == 66);
    CHECK(cache.size(0) == 64);
    // A prompt shorter than a chunk grows the layer only to what it holds (an empty layer, 40
    // tokens: they fit in the 66 slots, nothing moves); a huge chunk is not a size.
    kvevict::MlaCache small(o, e);
    CountingCpuAllocator counting(60 * 1024);
    kvevict::prefill_chunked(small, 0, q.narrow(2, 0, 40), k.narrow(2, 0, 40), v.narrow(2, 0, 40), int64_t{1} << 40);
    CHECK(counting.count() == 0);
    CHECK(small.slots(0) == 66);
    CHECK(small.size(0) == 40);
  });
}

TEST_CASE("a CUDA graph of the steady-state step replays like eager", "[steady_state][cuda]") {
  KVEVICT_REQUIRE_CUDA_OR_RETURN();
#if !KVEVICT_CUDA_GRAPHS
  WARN("built without CUDA graph support (KVEVICT_CUDA_GRAPHS=0): this CUDA test did not run");
#else
  // With a host tier and a two-level recall every step (`tier`): the tier's rows in pinned host
  // memory, read and written by the graph's kernels through their device view.
  const bool tier = GENERATE(false, true);
  CAPTURE(tier);
  const at::Device cuda("cuda:0");
  const int64_t B = 2, H = 4, qk = 24, v = 16, cap = 40, steps = 50;
  const auto eviction = kvevict::EvictionOptions(cap - 6).n_sink(2).n_recent(4);
  const auto options = kvevict::MlaCacheOptions(1, H).batch_size(B).qk_dim(qk).v_dim(v).device(cuda).check_observations(false)
                           .tier_tokens(tier ? 32 : 0).tier_page_size(4);
  kvevict::MlaCache eager(options, eviction), graphed(options, eviction);
  if (tier) {
    eager.reserve_tier(cap + steps + 8);
    graphed.reserve_tier(cap + steps + 8);
  }

  const auto fopts = at::TensorOptions().device(cuda);
  const auto k0 = at::randn({B, H, cap, qk}, fopts), v0 = at::randn({B, H, cap, v}, fopts);
  eager.update(0, k0, v0);
  graphed.update(0, k0, v0);
  // Per-step inputs, prepared up front; the graph reads them from static tensors.
  std::vector<at::Tensor> ks, vs, ps, qs;
  for (int64_t i = 0; i < steps + 1; ++i) {
    ks.push_back(at::randn({B, H, 1, qk}, fopts));
    vs.push_back(at::randn({B, H, 1, v}, fopts));
    ps.push_back(at::softmax(at::randn({B, H, 1, cap + 1}, fopts), -1));
    qs.push_back(at::randn({B, H, 1, qk}, fopts).mul(3));
  }
  auto k_in = ks[0].clone(), v_in = vs[0].clone(), p_in = ps[0].clone(), q_in = qs[0].clone();
  const auto step = [&](kvevict::MlaCache& c, const at::Tensor& k, const at::Tensor& vv, const at::Tensor& p,
                        const at::Tensor& q) {
    c.update(0, k, vv);
    if (tier) c.recall(0, q, 0.2, 2, 8);
    c.observe(0, p);
    c.evict(0);
  };

  // Capture on a side stream (capture is illegal on the default stream). The first step runs
  // eagerly there as warm-up (lazy library initialisation must not happen inside a capture).
  auto stream = c10::cuda::getStreamFromPool();
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    step(graphed, k_in, v_in, p_in, q_in);  // warm-up: step 0
    k_in.copy_(ks[1]);
    v_in.copy_(vs[1]);
    p_in.copy_(ps[1]);
    q_in.copy_(qs[1]);
    graph.capture_begin();
    step(graphed, k_in, v_in, p_in, q_in);  // captured: records step 1 but runs nothing
    graph.capture_end();
  }
  stream.synchronize();
  step(eager, ks[0], vs[0], ps[0], qs[0]);
  for (int64_t i = 1; i <= steps; ++i) {
    step(eager, ks[i], vs[i], ps[i], qs[i]);
    k_in.copy_(ks[i]);
    v_in.copy_(vs[i]);
    p_in.copy_(ps[i]);
    q_in.copy_(qs[i]);
    graph.replay();
  }
  c10::cuda::getCurrentCUDAStream().synchronize();
  // Host-side counters advanced once during capture, the device-side ones on every replay: the
  // tensors are what must agree.
  CHECK(at::equal(graphed.positions(0), eager.positions(0)));
  CHECK(at::equal(graphed.scores(0), eager.scores(0)));
  CHECK(at::equal(graphed.keys(0), eager.keys(0)));
  CHECK(at::equal(graphed.values(0), eager.values(0)));
  const auto pos = eager.positions(0).to(at::kCPU);
  CHECK(pos.max().item<int64_t>() == cap + steps);  // the newest token, at its true position
  if (tier) {
    for (int64_t r = 0; r < B; ++r) {
      CHECK(at::equal(graphed.tier_positions(0, r), eager.tier_positions(0, r)));
      CHECK(at::equal(graphed.tier_rows(0, r).first, eager.tier_rows(0, r).first));
    }
    CHECK(eager.stats().tier_recalled > 0);
  }
#endif
}

TEST_CASE("100,000 decode steps hold the cache's memory flat", "[long_run][cpu][.slow]") {
  const int64_t layers = 2, B = 2, H = 2, qk = 8, v = 8, steps = 100000;
  kvevict::MlaCache cache(kvevict::MlaCacheOptions(layers, H).batch_size(B).qk_dim(qk).v_dim(v),
                          kvevict::EvictionOptions(32).n_sink(4).n_recent(8));
  const auto k = at::randn({B, H, 1, qk}), vv = at::randn({B, H, 1, v});
  std::vector<at::Tensor> probs;  // one per live size: [B, H, 1, S], S = 1 .. capacity + 1
  for (int64_t S = 1; S <= cache.capacity() + 1; ++S) probs.push_back(at::softmax(at::randn({B, H, 1, S}), -1));
  const auto step = [&] {
    for (int64_t l = 0; l < layers; ++l) {
      cache.update(l, k, vv);
      cache.observe(l, probs[cache.size(l) - 1]);
      cache.evict(l);
    }
  };
  const int64_t warm_up = 2 * cache.capacity();
  for (int64_t i = 0; i < warm_up; ++i) step();
  const auto bytes = cache.stats().bytes_allocated;
  CountingCpuAllocator counting;
  for (int64_t i = warm_up; i < steps; ++i) {
    step();
    if (i % 10000 == 0) REQUIRE(cache.stats().bytes_allocated == bytes);
  }
  CHECK(counting.count() == 0);
  CHECK(cache.stats().bytes_allocated == bytes);
  CHECK(cache.stats().eviction_events == layers * (steps - cache.capacity()));
  CHECK(cache.seen_tokens(0) == steps);
  CHECK(cache.size(0) == cache.capacity());
}

namespace {

/// Records the storage ranges the CPU allocator hands out while installed, to tell tensors made
/// inside a stretch of code (temporaries) from those that outlive it.
class AddressRecordingAllocator final : public c10::Allocator {
 public:
  AddressRecordingAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~AddressRecordingAllocator() override { c10::SetCPUAllocator(inner_, kPriority); }
  AddressRecordingAllocator(const AddressRecordingAllocator&) = delete;
  AddressRecordingAllocator& operator=(const AddressRecordingAllocator&) = delete;
  c10::DataPtr allocate(size_t n) const { return recorded(n); }
  c10::DataPtr allocate(size_t n) { return recorded(n); }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t bytes) const { std::memcpy(dest, src, bytes); }
  /// Whether `p` lies in storage allocated while this allocator was installed.
  bool made_here(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    for (const auto& r : ranges_) {
      if (a >= r.first && a < r.first + std::max<size_t>(r.second, 1)) return true;
    }
    return false;
  }

 private:
  static constexpr uint8_t kPriority = 255;
  c10::DataPtr recorded(size_t n) const {
    auto p = inner_->allocate(n);
    ranges_.emplace_back(reinterpret_cast<uintptr_t>(p.get()), n);
    return p;
  }
  c10::Allocator* inner_;
  mutable std::vector<std::pair<uintptr_t, size_t>> ranges_;
};

/// The ops of one step (tests/op_counter.hpp) and the storage allocated during it.
struct RecordedStep {
  std::vector<kvevict_test::OpEvent> ops;
  std::unique_ptr<AddressRecordingAllocator> allocations;
};

template <class F>
RecordedStep record_step(F&& step) {
  RecordedStep r;
  r.allocations = std::make_unique<AddressRecordingAllocator>();
  {
    kvevict_test::OpRecorder rec;
    step();
    REQUIRE(rec.ok());
    r.ops = rec.events();
  }
  return r;
}

/// Checks that two steps can be one CUDA graph replayed: the same ops on the same shapes and
/// integers, no transfer or host read, and every tensor that outlives the step (made before it)
/// at the same data pointer in both.
void require_replayable(const RecordedStep& a, const RecordedStep& b) {
  REQUIRE(a.ops.size() == b.ops.size());
  for (size_t i = 0; i < a.ops.size(); ++i) {
    const auto& x = a.ops[i];
    const auto& y = b.ops[i];
    INFO("op " << i << ": " << x << " / " << y);
    REQUIRE(x == y);  // name, kind, shapes, integer arguments
    CHECK(x.kind != kvevict_test::OpKind::transfer);  // a copy to or from a device (mirrors upload so)
    CHECK(x.kind != kvevict_test::OpKind::sync);      // item, nonzero, ...: the host reads the device
    CHECK_FALSE(x.syncs);
    REQUIRE(x.data.size() == y.data.size());
    for (size_t j = 0; j < x.data.size(); ++j) {
      if (x.data[j] == y.data[j]) continue;
      INFO("argument " << j);
      // Different storage: allowed only for temporaries, made inside their own step (a graph's
      // private pool gives them the same addresses on every replay).
      CHECK(a.allocations->made_here(x.data[j]));
      CHECK(b.allocations->made_here(y.data[j]));
    }
  }
}

}  // namespace

TEST_CASE("the tensor path's steady-state step replays as a graph: same ops, shapes and storage, no sync",
          "[steady_state][cpu]") {
  const int64_t H = 8, rank = 32, rope = 8, cap = 40;
  const int64_t ee = GENERATE(1, 4);
  const bool ragged = GENERATE(false, true);
  // With a host tier and a recall every step (whole pages, or two-level), before the observation.
  const int64_t recall = GENERATE(-1, 0, 16);  // -1: no tier; else the rescore
  CAPTURE(ee, ragged, recall);
  const int64_t B = ragged ? 3 : 1;
  const auto eviction = kvevict::EvictionOptions(cap - 6).n_sink(2).n_recent(4).evict_every(ee);
  const auto options = kvevict::MlaLatentCacheOptions(1, H).batch_size(B).kv_lora_rank(rank).qk_rope_dim(rope)
                           .check_observations(false).tier_tokens(recall >= 0 ? 24 : 0).tier_page_size(4);
  kvevict_test::ForceTensorPath tensor_path(true);
  kvevict::MlaLatentCache cache(options, eviction);
  kvevict_test::ForceTensorPath host_path(false);
  kvevict::MlaLatentCache host(options, eviction);
  REQUIRE_FALSE(cache.policy().host_path());
  REQUIRE(host.policy().host_path());
  cache.reserve(cap + ee);
  host.reserve(cap + ee);
  if (recall >= 0) cache.reserve_tier(1000);  // the tier's store at its full size: no growth between the steps
  at::manual_seed(11);
  // Prompts: full rows, and (ragged) one row far below capacity and one free row. A decode step
  // then appends one token to every active row.
  std::vector<int64_t> prompt{cap, ragged ? 5 : cap, cap};
  prompt.resize(B);
  const auto first = at::randn({B, cap, rank}), first_pe = at::randn({B, cap, rope});
  cache.update(0, first, first_pe, prompt);
  host.update(0, first, first_pe, prompt);
  if (ragged) {
    cache.finish(2);
    host.finish(2);
  }
  std::vector<int64_t> counts(B, 1);
  if (ragged) counts[2] = 0;
  // A graph reads its inputs from static tensors: each step's values are copied into them first.
  // One probability tensor per place in the pass schedule (the width S differs between them).
  const auto ckv_in = at::zeros({B, 1, rank}), kpe_in = at::zeros({B, 1, rope});
  const auto qa_in = at::zeros({B, H, 1, rank}), qp_in = at::zeros({B, H, 1, rope});
  std::vector<at::Tensor> probs_in;
  for (int64_t i = 0; i < ee; ++i) probs_in.push_back(at::zeros({B, H, 1, cap + 1 + i}));
  const auto next_inputs = [&] {
    ckv_in.copy_(at::randn({B, 1, rank}));
    kpe_in.copy_(at::randn({B, 1, rope}));
    qa_in.copy_(at::randn({B, H, 1, rank}).mul(3));
    qp_in.copy_(at::randn({B, H, 1, rope}));
    const int64_t S = host.size(0) + 1;  // after the coming update
    auto& p = probs_in.at(static_cast<size_t>(S - cap - 1));
    p.copy_(at::softmax(at::randn({B, H, 1, S}), -1));
    return p;
  };
  const auto step = [&](kvevict::MlaLatentCache& c, const at::Tensor& p) {
    c.update(0, ckv_in, kpe_in, counts);
    if (recall >= 0) c.recall_absorbed(0, qa_in, qp_in, 0.2, 3, recall);
    c.observe(0, p);
    c.evict(0);
  };
  const auto both = [&] {
    const auto p = next_inputs();
    step(cache, p);
    step(host, p);
  };
  for (int i = 0; i < 3 * ee + 2; ++i) both();  // warm-up: passes have run, scratch is made
  // Two steps at the same place in the pass schedule: ee steps apart.
  const auto p0 = next_inputs();
  auto a = record_step([&] { step(cache, p0); });
  step(host, p0);
  for (int64_t i = 1; i < ee; ++i) both();
  const auto p1 = next_inputs();
  auto b = record_step([&] { step(cache, p1); });
  step(host, p1);
  require_replayable(a, b);
  // The same tokens in the same slots, with the same scores, as the host path.
  CHECK(at::equal(cache.positions(0), host.positions(0)));
  CHECK(at::equal(cache.scores(0), host.scores(0)));
  CHECK(at::equal(cache.ckv(0), host.ckv(0)));
  CHECK(at::equal(cache.kpe(0), host.kpe(0)));
  if (recall >= 0) {
    CHECK(cache.stats().tier_recalled > 0);
    CHECK(cache.stats().tier_recalled == host.stats().tier_recalled);
    for (int64_t r = 0; r < B; ++r) CHECK(at::equal(cache.tier_positions(0, r), host.tier_positions(0, r)));
  }
}
