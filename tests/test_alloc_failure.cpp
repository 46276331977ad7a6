// Host-heap allocation failures (issue 29: N2, N4, N5). This file replaces the global
// operator new / operator new[] (and their deletes) for the whole test executable: a counter on
// the calling thread makes the k-th allocation throw std::bad_alloc while armed (AllocFault), and
// does nothing otherwise. LibTorch's own tensor storage comes from c10's CPU allocator
// (posix_memalign), not from here; its TensorImpls, c10::Lists and small vectors do, as do
// kvevict's std::vectors. CountingCpuAllocator (op_counter.hpp) injects failures of the other
// kind; CpuToo (below) makes c10's CPU allocator count and fail in operator new's sequence.
//
// The contract checked: every public call of a cache that an injected host-heap failure
// interrupts throws c10::Error (never a raw std::bad_alloc) and leaves the cache's observable
// state (positions, scores, sizes, seen tokens, slots, stats, the live rows of every buffer,
// active rows, the tier's tokens, ranks and rows) as it was; the same call then succeeds and
// gives the state the uninterrupted call gives. On both paths, both layouts, with a tier.
#include "support.hpp"

#include <kvevict/kvevict.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <vector>

using Catch::Matchers::Contains;

namespace alloc_fault {

// Per thread: only the thread that armed the counter fails (LibTorch's pools go on).
thread_local int64_t t_fail_at = 0;  // 0: disarmed; else the first allocation number that fails
thread_local int64_t t_window = 1;   // how many allocations fail from there
thread_local int64_t t_count = 0;    // allocations counted since armed
thread_local bool t_fired = false;   // an armed allocation failed
thread_local bool t_cpu_too = false; // c10's CPU allocator counts (and fails) as well (CpuToo)

/// Counts one allocation; true when it is to fail.
inline bool take() {
  if (t_fail_at > 0 && ++t_count >= t_fail_at) {
    if (t_count - t_fail_at >= t_window - 1) t_fail_at = 0;  // the window's last failure
    t_fired = true;
    return true;
  }
  return false;
}

inline void* allocate(std::size_t n) {
  if (take()) throw std::bad_alloc();
  void* p = std::malloc(n == 0 ? 1 : n);
  if (!p) throw std::bad_alloc();
  return p;
}

/// While alive, the k-th operator new on this thread throws std::bad_alloc, and so do the
/// `window` - 1 after it (1: once; a huge window: a heap that stays exhausted).
struct AllocFault {
  explicit AllocFault(int64_t k, int64_t window = 1) {
    t_count = 0;
    t_fired = false;
    t_window = window;
    t_fail_at = k;
  }
  ~AllocFault() { t_fail_at = 0; }
  AllocFault(const AllocFault&) = delete;
  AllocFault& operator=(const AllocFault&) = delete;
  static bool fired() { return t_fired; }
  /// Allocations counted since armed (an AllocFault(kNever) counts without failing).
  static int64_t count() { return t_count; }
  static constexpr int64_t kNever = INT64_MAX;
};

/// While alive, c10's CPU allocator (LibTorch's tensor storage, posix_memalign) counts in the
/// same sequence as operator new on this thread, and fails as it does (with the c10::Error that
/// LibTorch's own allocator raises when posix_memalign fails): every host allocation is armed.
class CpuToo final : public c10::Allocator {
 public:
  CpuToo() : inner_(c10::GetCPUAllocator()) {
    c10::SetCPUAllocator(this, kPriority);
    t_cpu_too = true;
  }
  ~CpuToo() override {
    t_cpu_too = false;
    c10::SetCPUAllocator(inner_, kPriority);
  }
  CpuToo(const CpuToo&) = delete;
  CpuToo& operator=(const CpuToo&) = delete;
  // LibTorch 1.13 declares `allocate(size_t) const`, 2.3+ `allocate(size_t)`: both, no override.
  c10::DataPtr allocate(size_t n) const { return counted(n); }
  c10::DataPtr allocate(size_t n) { return counted(n); }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t bytes) const { std::memcpy(dest, src, bytes); }

 private:
  static constexpr uint8_t kPriority = 255;
  c10::DataPtr counted(size_t n) const {
    TORCH_CHECK(!(t_cpu_too && take()), "DefaultCPUAllocator: can't allocate memory: you tried to allocate ", n,
                " bytes (injected)");
    return inner_->allocate(n);
  }
  c10::Allocator* inner_;
};

}  // namespace alloc_fault

void* operator new(std::size_t n) { return alloc_fault::allocate(n); }
void* operator new[](std::size_t n) { return alloc_fault::allocate(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
// The nothrow forms as libstdc++ defines them (through the throwing form), so that every
// allocation pairs with the free above: AddressSanitizer replaces them with its own, and
// reported std::stable_sort's get_temporary_buffer (nothrow new) freed by our delete as an
// alloc-dealloc mismatch (scripts/test_sanitizers.sh).
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return alloc_fault::allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return alloc_fault::allocate(n);
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace {

using alloc_fault::AllocFault;
using kvevict::EvictionOptions;

/// Everything a caller can observe of a cache (with a tier), as tensors.
template <class Cache>
std::vector<at::Tensor> snapshot(const Cache& c) {
  std::vector<at::Tensor> v;
  const auto num = [](int64_t x) { return at::tensor(x); };
  for (int64_t l = 0; l < c.num_layers(); ++l) {
    v.push_back(c.positions(l).clone());
    v.push_back(c.scores(l).clone());
    v.push_back(num(c.slots(l)));
    const auto s = c.stats(l);
    for (const int64_t x : {s.eviction_events, s.tokens_evicted, s.bytes_allocated, s.tier_tokens, s.tier_bytes,
                            s.tier_recalled}) {
      v.push_back(num(x));
    }
    const auto o = c.ordered(l);  // the live rows by position
    v.push_back(o.positions.clone());
    for (int64_t b = 0; b < c.batch_size(); ++b) {
      v.push_back(num(c.size(l, b)));
      v.push_back(num(c.seen_tokens(l, b)));
      v.push_back(c.tier_positions(l, b));
      v.push_back(c.tier_scores(l, b));
      const auto rows = c.tier_rows(l, b);
      v.push_back(rows.first);
      v.push_back(rows.second);
    }
  }
  for (int64_t b = 0; b < c.batch_size(); ++b) v.push_back(num(static_cast<int64_t>(c.active(b))));
  return v;
}

/// The live rows of a layer by position, both layouts.
at::Tensor live_rows(const kvevict::MlaCache& c, int64_t l) {
  const auto o = c.ordered(l);
  return at::cat({o.keys.flatten(), o.values.flatten()});
}
at::Tensor live_rows(const kvevict::MlaLatentCache& c, int64_t l) {
  const auto o = c.ordered(l);
  return at::cat({o.ckv.flatten(), o.kpe.flatten()});
}

template <class Cache>
std::vector<at::Tensor> full_snapshot(const Cache& c) {
  auto v = snapshot(c);
  for (int64_t l = 0; l < c.num_layers(); ++l) v.push_back(live_rows(c, l));
  return v;
}

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

constexpr int64_t kLayers = 2, kB = 2, kH = 2;
int64_t g_tier_tokens = 16;  // the caches' tier_tokens (the D1 test sets 6)
bool g_all_points = false;   // failure_points(): every point, as in the long run

/// A cache on `tensor_path`, with a tier, capacity 6 (1 sink, 3 heavy hitters, 2 recent), a
/// pass every 2 appends: 9 slots per row (8 tokens and the trash slot).
template <class Cache>
Cache make_cache(bool tensor_path);
template <>
kvevict::MlaCache make_cache<kvevict::MlaCache>(bool tensor_path) {
  kvevict_test::ForceTensorPath force(tensor_path);
  return kvevict::MlaCache(kvevict::MlaCacheOptions(kLayers, kH).batch_size(kB).qk_dim(4).v_dim(3).tier_tokens(g_tier_tokens)
                               .tier_page_size(2),
                           EvictionOptions(3).n_sink(1).n_recent(2).evict_every(2));
}
template <>
kvevict::MlaLatentCache make_cache<kvevict::MlaLatentCache>(bool tensor_path) {
  kvevict_test::ForceTensorPath force(tensor_path);
  return kvevict::MlaLatentCache(kvevict::MlaLatentCacheOptions(kLayers, kH).batch_size(kB).kv_lora_rank(4)
                                     .qk_rope_dim(2).qk_nope_dim(2).tier_tokens(g_tier_tokens).tier_page_size(2),
                                 EvictionOptions(3).n_sink(1).n_recent(2).evict_every(2));
}

/// New rows of T tokens for either layout.
std::pair<at::Tensor, at::Tensor> new_rows(const kvevict::MlaCache&, int64_t T) {
  return {at::randn({kB, kH, T, 4}), at::randn({kB, kH, T, 3})};
}
std::pair<at::Tensor, at::Tensor> new_rows(const kvevict::MlaLatentCache&, int64_t T) {
  return {at::randn({kB, T, 4}), at::randn({kB, T, 2})};
}

/// Every layer: 12 tokens, scores, a pass (the tier fills), one more token: 7 tokens per row.
template <class Cache>
void warm(Cache& c) {
  for (int64_t l = 0; l < c.num_layers(); ++l) {
    auto r = new_rows(c, 12);
    c.update(l, r.first, r.second);
    c.add_scores(l, at::rand({kB, 12}));
    c.evict_now(l);
    r = new_rows(c, 1);
    c.update(l, r.first, r.second);
  }
}

/// recall() / recall_absorbed() with fresh queries, as a call.
std::function<void()> recall_call(kvevict::MlaCache& c, int64_t rescore) {
  const auto q = at::randn({kB, kH, 1, 4});
  return [&c, q, rescore] { c.recall(0, q, 0.5, 2, rescore); };
}
std::function<void()> recall_call(kvevict::MlaLatentCache& c, int64_t rescore) {
  const auto qa = at::randn({kB, kH, 1, 4}), qp = at::randn({kB, kH, 1, 2});
  return [&c, qa, qp, rescore] { c.recall_absorbed(0, qa, qp, 0.5, 2, rescore); };
}

/// A whole-page recall now, which must bring tokens back (on the tensor path its victims then
/// wait in the tier's queue until its next use).
void recall_now(kvevict::MlaCache& c) { REQUIRE(kvevict_test::total(c.recall(0, at::randn({kB, kH, 1, 4}), 0.5, 2)) > 0); }
void recall_now(kvevict::MlaLatentCache& c) {
  REQUIRE(kvevict_test::total(c.recall_absorbed(0, at::randn({kB, kH, 1, 4}), at::randn({kB, kH, 1, 2}), 0.5, 2)) > 0);
}

/// compress_prompt() / compress_prompt_absorbed() of an 10-token prompt into layer 1, as a call.
std::function<void()> compress_call(kvevict::MlaCache& c) {
  const int64_t T = 10;
  const auto q = at::randn({kB, kH, T, 4}), k = at::randn({kB, kH, T, 4}), v = at::randn({kB, kH, T, 3});
  const auto lse = at::logsumexp(at::matmul(q, k.transpose(-2, -1)).mul(0.5).masked_fill(
                                     at::ones({T, T}, at::kBool).triu(1), -INFINITY), -1);
  return [&c, q, k, v, lse] { kvevict::compress_prompt(c, 1, q, k, v, lse, 0.5); };
}
std::function<void()> compress_call(kvevict::MlaLatentCache& c) {
  const int64_t T = 10;
  const auto qa = at::randn({kB, kH, T, 4}), qp = at::randn({kB, kH, T, 2});
  const auto ckv = at::randn({kB, T, 4}), kpe = at::randn({kB, T, 2});
  const auto logits = at::matmul(qa, ckv.unsqueeze(1).transpose(-2, -1)).add(at::matmul(qp, kpe.unsqueeze(1).transpose(-2, -1)));
  const auto lse = at::logsumexp(logits.mul(0.5).masked_fill(at::ones({T, T}, at::kBool).triu(1), -INFINITY), -1);
  return [&c, qa, qp, ckv, kpe, lse] { kvevict::compress_prompt_absorbed(c, 1, qa, qp, ckv, kpe, lse, 0.5); };
}

/// One scenario: brings a fresh cache to its state before the call (seeded: every run the same)
/// and returns the call.
template <class Cache>
struct Scenario {
  std::string name;
  std::function<std::function<void()>(Cache&)> setup;
  /// Tensor path: the call commits with a sequence of LibTorch in-place writes that allocate
  /// small host objects, so some failure points fall among them and are undone (TensorUndo).
  /// False where the commit is swaps only, or (recall) its scatter_s may allocate nothing.
  bool undone_on_tensor_path = true;
};

template <class Cache>
std::vector<Scenario<Cache>> scenarios() {
  using S = Scenario<Cache>;
  return {
      S{"update, one token", [](Cache& c) -> std::function<void()> {
          warm(c);
          const auto r = new_rows(c, 1);
          return [&c, r] { c.update(0, r.first, r.second); };
        }},
      S{"update that grows the buffers", [](Cache& c) -> std::function<void()> {
          warm(c);
          const auto r = new_rows(c, 5);
          return [&c, r] { c.update(0, r.first, r.second); };
        }},
      S{"evict (a pass that shrinks the buffers)", [](Cache& c) -> std::function<void()> {
          warm(c);
          const auto r = new_rows(c, 5);
          c.update(0, r.first, r.second);
          c.add_scores(0, at::rand({kB, c.size(0)}));
          return [&c] { c.evict(0); };
        }},
      S{"evict_now", [](Cache& c) -> std::function<void()> {
          warm(c);
          c.add_scores(0, at::rand({kB, c.size(0)}));
          return [&c] { c.evict_now(0); };
        }},
      S{"truncate", [](Cache& c) -> std::function<void()> {
          warm(c);
          for (int64_t l = 0; l < c.num_layers(); ++l) {
            const auto r = new_rows(c, 2);
            c.update(l, r.first, r.second);
          }
          return [&c] { c.truncate(0, 3); };
        }},
      S{"finish", [](Cache& c) -> std::function<void()> {
          warm(c);
          return [&c] { c.finish(1); };
        }},
      S{"reset(row)", [](Cache& c) -> std::function<void()> {
          warm(c);
          return [&c] { c.reset(0); };
        }},
      S{"reset() after a grown layer", [](Cache& c) -> std::function<void()> {
          warm(c);
          const auto r = new_rows(c, 5);
          c.update(1, r.first, r.second);
          return [&c] { c.reset(); };
        }, false},
      S{"reserve", [](Cache& c) -> std::function<void()> {
          warm(c);
          return [&c] { c.reserve(12); };
        }, false},
      S{"recall, whole pages", [](Cache& c) -> std::function<void()> {
          warm(c);
          return recall_call(c, 0);
        }, false},
      S{"recall, two-level", [](Cache& c) -> std::function<void()> {
          warm(c);
          return recall_call(c, 4);
        }, false},
      // After a recall the tier holds its victims: the calls below change the tier (on the
      // tensor path its store, inside their commits), and a failure changes nothing either.
      S{"finish, after a recall", [](Cache& c) -> std::function<void()> {
          warm(c);
          recall_now(c);
          return [&c] { c.finish(1); };
        }},
      S{"truncate, after a recall", [](Cache& c) -> std::function<void()> {
          warm(c);
          recall_now(c);
          return [&c] { c.truncate(0, 1); };
        }},
      S{"evict_now, after a recall", [](Cache& c) -> std::function<void()> {
          warm(c);
          recall_now(c);
          c.add_scores(0, at::rand({kB, c.size(0)}));
          return [&c] { c.evict_now(0); };
        }},
      S{"recall, two-level, after a recall", [](Cache& c) -> std::function<void()> {
          warm(c);
          recall_now(c);
          return recall_call(c, 4);
        }, false},
  };
}

/// compress_prompt() with a tier (prefill.hpp): its own checks and scoring allocate before the
/// cache's calls, and its append, add_scores and evict_now commit one by one.
template <class Cache>
std::vector<Scenario<Cache>> compress_scenarios() {
  return {Scenario<Cache>{"compress_prompt with a tier", [](Cache& c) -> std::function<void()> {
            auto r = new_rows(c, 3);
            c.update(0, r.first, r.second);
            return compress_call(c);
          }}};
}

/// Scenario `s` brought about in cache `c` from the same seed every time; returns its call.
template <class Cache>
std::function<void()> prepared(const Scenario<Cache>& s, Cache& c) {
  at::manual_seed(29);
  return s.setup(c);
}

/// What a call did under an AllocFault(k, window): the c10::Error's message, a raw
/// std::bad_alloc (and whether restore_failed() was set then), whether any allocation failed.
struct Outcome {
  bool error = false, bad_alloc = false, restore_failed = false, fired = false;
  std::string what;
};
inline Outcome run_with_fault(const std::function<void()>& call, int64_t k, int64_t window = 1, bool cpu_too = false) {
  Outcome o;
  std::optional<alloc_fault::CpuToo> cpu;
  if (cpu_too) cpu.emplace();
  AllocFault fault(k, window);
  try {
    call();
  } catch (const c10::Error& e) {
    o.error = true;
    o.what = e.what_without_backtrace();
  } catch (const std::bad_alloc&) {
    o.bad_alloc = true;
    o.restore_failed = kvevict::detail::restore_failed();
  }
  o.fired = AllocFault::fired();
  return o;
}

/// How many host allocations `call` makes when none fails.
inline int64_t allocations_of(const std::function<void()>& call, bool cpu_too = false) {
  std::optional<alloc_fault::CpuToo> cpu;
  if (cpu_too) cpu.emplace();
  AllocFault counting(AllocFault::kNever);
  call();
  return AllocFault::count();
}

/// The failure points a run checks, of a call that makes `n` allocations: every one in the long
/// run (KVEVICT_LONG_TESTS=1, the ctest alloc_failure_long) and where n <= 48; else the first 8,
/// the last 8 and one drawn (fixed seed) from each stretch of kStride: every run of kStride x 2 - 1
/// or more consecutive points (e.g. a commit's writes, undone by TensorUndo) is met.
inline std::vector<int64_t> failure_points(int64_t n) {
  constexpr int64_t kStride = 8, kEdge = 8;
  std::vector<int64_t> ks;
  if (kvevict_test::long_run() || g_all_points || n <= 6 * kEdge) {
    for (int64_t k = 1; k <= n; ++k) ks.push_back(k);
    return ks;
  }
  std::mt19937_64 rng(38 + static_cast<uint64_t>(n));
  for (int64_t k = 1; k <= kEdge; ++k) ks.push_back(k);
  for (int64_t lo = kEdge + 1; lo <= n - kEdge; lo += kStride) {
    const int64_t width = std::min(kStride, n - kEdge - lo + 1);
    ks.push_back(lo + static_cast<int64_t>(rng() % static_cast<uint64_t>(width)));
  }
  for (int64_t k = n - kEdge + 1; k <= n; ++k) ks.push_back(k);
  return ks;
}

/// The points of failure_points(n), then n + 1, n + 2, ...: the loops below go on until the
/// call succeeds, should it make more allocations than counted.
struct FailurePoints {
  explicit FailurePoints(int64_t n) : ks(failure_points(n)), n(n) {}
  int64_t at(size_t i) const { return i < ks.size() ? ks[i] : n + 1 + static_cast<int64_t>(i - ks.size()); }
  std::vector<int64_t> ks;
  int64_t n;
};

/// For k = 1, 2, ... until the call succeeds: the k-th host allocation of the call fails; the
/// call must throw c10::Error and leave the cache as it was, and then succeed, giving what the
/// uninterrupted call gives. Returns the allocations the call makes (k where it first succeeded).
/// k runs over failure_points(): a fixed-seed sample in the default run, every k in the long run.
template <class Cache>
int64_t check_scenario(const Scenario<Cache>& s, bool tensor_path, int64_t& restored, int64_t& checked) {
  constexpr int64_t kMaxAllocations = 4000;  // a bound on the loop, far above what any call makes
  auto ref = make_cache<Cache>(tensor_path);
  auto ref_call = prepared(s, ref);
  const auto before = full_snapshot(ref);
  const FailurePoints points(allocations_of(ref_call));
  const auto after = full_snapshot(ref);
  for (size_t i = 0; points.at(i) <= kMaxAllocations; ++i) {
    const int64_t k = points.at(i);
    ++checked;
    auto c = make_cache<Cache>(tensor_path);
    const auto call = prepared(s, c);
    const auto o = run_with_fault(call, k);
    const bool error = o.error, bad_alloc = o.bad_alloc, fired = o.fired;
    const std::string& what = o.what;
    if (!fired) {
      INFO(s.name << ": succeeded at allocation " << k);
      CHECK_FALSE(error);
      CHECK(same(full_snapshot(c), after));
      return k;
    }
    INFO(s.name << ": allocation " << k << " failed (" << what << ")");
    CHECK_FALSE(bad_alloc);  // N5: a c10::Error, never a raw std::bad_alloc
    if (!error && !bad_alloc) {
      // The failure was absorbed (a shrink that keeps the larger buffers): the call did its work.
      CHECK(kvevict_test::to_vec<int64_t>(c.positions(0)) == kvevict_test::to_vec<int64_t>(ref.positions(0)));
      continue;
    }
    // Every message is kvevict's, naming the call (on the tensor path LibTorch's own c10::Error,
    // e.g. its indexing reporting a failed allocation as a shape mismatch, is wrapped in it).
    CHECK_THAT(what, Contains("kvevict: "));
    if (what.find("what it had written was restored") != std::string::npos) ++restored;
    const bool unchanged = same(full_snapshot(c), before);
    // N4: all or nothing, also when the failure stops the tensor path's in-place writes half-way
    // (detail::TensorUndo puts back what they had written).
    CHECK(unchanged);
    if (!unchanged) return -k;
    call();  // the same call again succeeds and gives what it gives uninterrupted
    CHECK(same(full_snapshot(c), after));
  }
  FAIL(s.name << ": no success within " << kMaxAllocations << " allocations");
  return -1;
}

template <class Cache>
void check_all(bool tensor_path, const std::vector<Scenario<Cache>>& all) {
  for (const auto& s : all) {
    CAPTURE(s.name);
    int64_t restored = 0, checked = 0;
    const int64_t n = check_scenario(s, tensor_path, restored, checked);
    INFO(s.name << ": " << n - 1 << " allocation points, " << restored << " of them among the tensor path's writes");
    CHECK(n >= 1);
    // The undo log is exercised where the tensor path writes in place, and only there.
    if (!tensor_path) {
      CHECK(restored == 0);
    } else if (s.undone_on_tensor_path) {
      CHECK(restored > 0);
    }
    WARN(s.name << (tensor_path ? " (tensor path)" : " (host path)") << ": " << n - 1 << " allocation points, "
                << checked - 1 << " of them failed, " << restored << " undone");
  }
}

}  // namespace

/// The heap stays exhausted: allocations k .. k + window - 1 of the call fail, so restoring
/// and making the error's message may fail too. The call must leave the cache as it was, or
/// say that the state is partly changed (in its message, or, when not even that could be
/// made, through restore_failed() behind a raw std::bad_alloc); reset() then recovers it.
/// `restores_on_cpu`: every write of the call's commit is put back with memcpy on the CPU,
/// which cannot fail: the cache must then be unchanged at every k. A c10::Error names kvevict's
/// call ("kvevict: ..."). The tests below run it with the compiled kernels on (one op writes
/// what recall swaps) and off (the reference form: ATen writes under the undo log).
template <class Cache>
void check_exhausted(const Scenario<Cache>& s, bool tensor_path, int64_t window, bool restores_on_cpu,
                     bool cpu_too = false) {
  constexpr int64_t kMaxAllocations = 4000;
  auto ref = make_cache<Cache>(tensor_path);
  auto ref_call = prepared(s, ref);
  const auto before = full_snapshot(ref);
  const FailurePoints points(allocations_of(ref_call, cpu_too));
  for (size_t i = 0; points.at(i) <= kMaxAllocations; ++i) {
    const int64_t k = points.at(i);
    auto c = make_cache<Cache>(tensor_path);
    const auto o = run_with_fault(prepared(s, c), k, window, cpu_too);
    if (!o.fired) return;
    INFO(s.name << ": allocations " << k << " .. " << k + window - 1 << " failed (" << o.what << ")");
    const bool said_partly = o.what.find("partly changed") != std::string::npos || o.restore_failed;
    if (o.error) CHECK_THAT(o.what, Catch::Matchers::StartsWith("kvevict: "));  // named, never LibTorch's own
    if (said_partly) {
      CHECK_FALSE(restores_on_cpu);
      CHECK_NOTHROW(c.reset());
      CHECK(c.size(0) == 0);
      continue;
    }
    if (!o.bad_alloc && o.what.empty()) continue;  // absorbed (a shrink that keeps the larger buffers)
    CHECK(same(full_snapshot(c), before));
  }
  FAIL(s.name << ": no success within " << kMaxAllocations << " allocations");
}

TEST_CASE("the injected allocation failure fires at the k-th operator new of its thread only",
          "[alloc_failure][cpu]") {
  {
    AllocFault fault(2);
    auto* a = new int(1);
    CHECK_THROWS_AS(new int(2), std::bad_alloc);
    CHECK(AllocFault::fired());
    auto* c = new int(3);  // one failure per arming
    delete a;
    delete c;
  }
  AllocFault none(0);
  std::vector<int> v(100);
  CHECK_FALSE(AllocFault::fired());
}

TEST_CASE("with CpuToo, c10's CPU allocator counts and fails in the same sequence as operator new",
          "[alloc_failure][cpu]") {
  const auto allocations = [](bool cpu_too) {
    std::optional<alloc_fault::CpuToo> cpu;
    if (cpu_too) cpu.emplace();
    AllocFault counting(AllocFault::kNever);
    auto t = at::empty({64});
    return AllocFault::count();
  };
  at::empty({64});  // LibTorch's first-use allocations
  const int64_t heap = allocations(false);
  CHECK(allocations(true) == heap + 1);  // and the storage
  alloc_fault::CpuToo cpu;
  for (int64_t k = 1;; ++k) {
    AllocFault fault(k);  // once: under a lasting failure, c10's message itself fails (std::bad_alloc)
    std::string what;
    try {
      at::empty({64});
    } catch (const c10::Error& e) {
      what = e.what_without_backtrace();
    } catch (const std::bad_alloc&) {
      what = "bad_alloc";
    }
    if (!AllocFault::fired()) break;
    if (what.find("DefaultCPUAllocator") != std::string::npos) {
      SUCCEED("the storage allocation failed at " << k);
      return;
    }
  }
  FAIL("the storage allocation never failed");
}

TEST_CASE("a host-heap failure at any allocation of a cache call throws c10::Error and changes nothing",
          "[alloc_failure][tier][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  CAPTURE(tensor_path);
  SECTION("expanded") { check_all(tensor_path, scenarios<kvevict::MlaCache>()); }
  SECTION("latent") { check_all(tensor_path, scenarios<kvevict::MlaLatentCache>()); }
}

// compress_prompt() names its host-heap failures (host_heap) and undoes its steps after the
// append (detail::PromptPress empties the layer again).
TEST_CASE("a host-heap failure at any allocation of compress_prompt with a tier throws c10::Error and changes nothing",
          "[alloc_failure][alloc_failure_compress][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  CAPTURE(tensor_path);
  SECTION("expanded") { check_all(tensor_path, compress_scenarios<kvevict::MlaCache>()); }
  SECTION("latent") { check_all(tensor_path, compress_scenarios<kvevict::MlaLatentCache>()); }
}

namespace {

/// What a caller sees of an EvictionPolicy (caller-owned storage): per layer its positions,
/// scores, sizes and seen tokens, and the active rows.
std::vector<at::Tensor> policy_snapshot(const kvevict::EvictionPolicy<>& p) {
  std::vector<at::Tensor> v;
  for (int64_t l = 0; l < p.num_layers(); ++l) {
    v.push_back(p.positions(l).clone());
    v.push_back(p.scores(l).clone());
    for (int64_t b = 0; b < p.batch_size(); ++b) {
      v.push_back(at::tensor(p.size(l, b)));
      v.push_back(at::tensor(p.seen_tokens(l, b)));
    }
  }
  for (int64_t b = 0; b < p.batch_size(); ++b) v.push_back(at::tensor(static_cast<int64_t>(p.active(b))));
  return v;
}

}  // namespace

// EvictionPolicy's own calls on the tensor path commit under the same undo log as the caches.
TEST_CASE("a host-heap failure among EvictionPolicy's tensor-path writes changes nothing",
          "[alloc_failure][policy][cpu]") {
  using Policy = kvevict::EvictionPolicy<>;
  const auto make = [] {
    kvevict_test::ForceTensorPath force(true);
    Policy p(kvevict::EvictionPolicyOptions(kLayers, kH).batch_size(kB), EvictionOptions(3).n_sink(1).n_recent(2));
    at::manual_seed(29);
    for (int64_t l = 0; l < kLayers; ++l) {
      p.append(l, {7, 7}, 7);
      p.add_scores(l, at::rand({kB, 7}));
    }
    p.evict(1);  // layer 1 at capacity (6 tokens), layer 0 over it
    return p;
  };
  const std::vector<std::pair<std::string, std::function<void(Policy&)>>> calls = {
      {"append", [](Policy& p) { p.append(1, {1, 1}, 1); }},
      {"evict", [](Policy& p) { p.evict(0); }},
      {"truncate", [](Policy& p) { p.truncate(1, 2); }},
      {"finish", [](Policy& p) { p.finish(0); }},
      {"reset", [](Policy& p) { p.reset(1); }},
  };
  for (const auto& [name, call] : calls) {
    CAPTURE(name);
    auto ref = make();
    const auto before = policy_snapshot(ref);
    call(ref);
    const auto after = policy_snapshot(ref);
    int64_t restored = 0, k = 1;
    for (; k <= 4000; ++k) {
      auto p = make();
      std::string what;
      bool fired = false;
      {
        AllocFault fault(k);
        what = kvevict_test::message_of([&] { call(p); });
        fired = AllocFault::fired();
      }
      if (!fired) {
        CHECK(what.empty());
        CHECK(same(policy_snapshot(p), after));
        break;
      }
      if (what.empty()) continue;  // absorbed: checked by the caches' scenarios
      if (what.find("what it had written was restored") != std::string::npos) ++restored;
      CHECK(same(policy_snapshot(p), before));
    }
    CHECK(k < 4000);
    CHECK(restored > 0);  // the undo log ran
  }
}

// A heap that stays exhausted (issue 29's break-it round): restoring must not need the heap
// where it can be helped (on the CPU the undo log writes back with memcpy), and where it does,
// the caller is told that the state is partly changed, never that nothing changed.
TEST_CASE("a host-heap failure that lasts leaves the cache as it was, or says it is partly changed",
          "[alloc_failure][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  const int64_t window = GENERATE(int64_t{4}, int64_t{1} << 40);
  const bool kernels = GENERATE(true, false);  // the tensor path's compiled ops, or the reference forms
  if (!tensor_path && !kernels) return;        // the host path runs no compiled op
  CAPTURE(tensor_path, window, kernels);
  const kvevict_test::KernelsEnabled use(kernels);
  const std::vector<std::string> restores_on_cpu = {"update, one token", "evict (a pass that shrinks the buffers)",
                                                    "evict_now", "truncate", "finish", "reset(row)"};
  const auto run = [&](auto all) {
    for (const auto& s : all) {
      CAPTURE(s.name);
      const bool memcpy_only =
          std::find(restores_on_cpu.begin(), restores_on_cpu.end(), s.name) != restores_on_cpu.end();
      check_exhausted(s, tensor_path, window, memcpy_only);
    }
  };
  SECTION("expanded") { run(scenarios<kvevict::MlaCache>()); }
  SECTION("latent") { run(scenarios<kvevict::MlaLatentCache>()); }
}

// Issue 38 item 5 (a break-it round), D4: the tier's reads threw LibTorch's raw allocation error
// (no "kvevict: ", no call) when a host allocation failed. Both kinds of failure (the host heap,
// c10's CPU allocator) at every allocation of each read: a c10::Error naming the read, or success.
TEST_CASE("the tier's reads name themselves when a host allocation fails", "[alloc_failure][tier][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  CAPTURE(tensor_path);
  auto c = make_cache<kvevict::MlaLatentCache>(tensor_path);
  at::manual_seed(29);
  warm(c);
  REQUIRE(c.tier_size(0, 0) > 0);
  const std::vector<std::pair<std::string, std::function<void()>>> reads = {
      {"tier_size", [&] { c.tier_size(0, 0); }},
      {"tier_positions", [&] { c.tier_positions(0, 0); }},
      {"tier_scores", [&] { c.tier_scores(0, 0); }},
      {"tier_rows", [&] { c.tier_rows(0, 0); }},
  };
  for (const auto& [name, read] : reads) {
    CAPTURE(name);
    for (int64_t k = 1; k < 200; ++k) {
      CAPTURE(k);
      const auto o = run_with_fault(read, k);
      CHECK_FALSE(o.bad_alloc);
      if (o.error) CHECK_THAT(o.what, Contains("kvevict: " + name + ": "));
      if (!o.fired) break;
    }
    for (int64_t k = 1; k < 50; ++k) {
      CAPTURE(k);
      kvevict_test::CountingCpuAllocator failing;
      failing.fail_at(k);
      const auto what = kvevict_test::message_of(read);
      if (!failing.failed()) break;
      CHECK_THAT(what, Contains("kvevict: " + name + ": "));
    }
  }
}

// D2: under a lasting host allocation failure, compress_prompt with a tier left the layer empty
// but kept its grown buffers (its doc: they go back to their usual size). A failed call changes
// nothing, slots included.
TEST_CASE("compress_prompt with a tier under a lasting host-heap failure gives back the slots it grew",
          "[alloc_failure][alloc_failure_compress][cpu]") {
  const bool tensor_path = GENERATE(false, true);
  const int64_t window = GENERATE(int64_t{4}, int64_t{1} << 40);
  CAPTURE(tensor_path, window);
  SECTION("expanded") {
    for (const auto& s : compress_scenarios<kvevict::MlaCache>()) check_exhausted(s, tensor_path, window, false);
  }
  SECTION("latent") {
    for (const auto& s : compress_scenarios<kvevict::MlaLatentCache>()) check_exhausted(s, tensor_path, window, false);
  }
}

// D1 (issue 38, a break-it round): on the tensor path, when every host allocation from some
// point on failed, recall changed the layer's scores and threw a raw std::bad_alloc (49 points in
// whole-page recall, 123 in two-level recall; 2 layers, H 2, B 2, tier 6, page 2). Every point,
// on both paths, with the host heap alone failing and with c10's CPU allocator (the tensors'
// storage) failing in the same sequence: the cache is as it was, or the error says it is partly
// changed and reset() recovers it. With the compiled kernels off (the reference form, whose writes
// run under the undo log) the points are sampled. The long run (alloc_failure_long) does every
// point and every scenario so.
TEST_CASE("a recall under a lasting host allocation failure leaves the cache as it was, or says so",
          "[alloc_failure][tier][cpu]") {
  const bool tensor_path = GENERATE(true, false);
  const bool cpu_too = GENERATE(false, true);
  const bool kernels = GENERATE(true, false);  // recall's swap as one compiled op, or the reference form's writes
  if (!tensor_path && !kernels) return;        // the host path runs no compiled op
  CAPTURE(tensor_path, cpu_too, kernels);
  const kvevict_test::KernelsEnabled use(kernels);
  g_tier_tokens = 6;
  g_all_points = kernels;  // the reference forms make ~6x the allocations: a fixed-seed sample (all in the long run)
  struct Restore {
    ~Restore() {
      g_tier_tokens = 16;
      g_all_points = false;
    }
  } restore;
  const auto run = [&](auto all) {
    for (const auto& s : all) {
      if (!kvevict_test::long_run() && s.name.rfind("recall", 0) != 0) continue;  // the long run: every call
      CAPTURE(s.name);
      check_exhausted(s, tensor_path, int64_t{1} << 40, false, cpu_too);
    }
  };
  SECTION("expanded") { run(scenarios<kvevict::MlaCache>()); }
  SECTION("latent") { run(scenarios<kvevict::MlaLatentCache>()); }
}
