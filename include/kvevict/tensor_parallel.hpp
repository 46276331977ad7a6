#pragma once
// Tensor-parallel eviction over LibTorch's c10d: the heads of a layer are split across ranks
// (DeepSeek-V3's reference code: wq_b and wkv_b column-parallel, 128 / TP heads per rank; the
// latent cache replicated), and every rank must evict the same tokens. Each rank observes the
// probabilities of its own heads; the policy sums them into exact fixed-point sums [B, S] fp64
// (scorers.hpp), this header's reducer all-reduces them (SUM, exact and order-independent, since
// every term is an integer), and the policy divides by the global head count. Every rank then
// applies bit-identical contributions, ranks identically and plans identical slot moves, so the
// latent replicas stay bit-identical.
//
// Lazy reduction (TensorParallel::configure(options, /*lazy=*/true)): cumulative scores are
// linear in the observations, so a rank may add its local sums up and all-reduce them once per
// eviction pass (EvictionPolicyOptions::lazy_reduction): evict_every times fewer collectives.
// Exact in this sense: every rank applies the same bits, and they are the bits one process
// holding all the heads computes from the same probabilities, with lazy_reduction too (the
// pending sums are exact integers; eager and lazy differ only in when fp32 rounds, once per pass
// instead of once per observe). The probabilities themselves may differ from one process's in
// the last bit: attention over a rank's subset of heads is a matmul of another shape (measured:
// attend_absorbed with 1 head against the same head among 3, about 1 ulp), so ranks agree with
// each other bit for bit and with one process to fp32 rounding.
// Only for linear scorers (kLinear: CumulativeAttention, MeanObservedAttention). The policy
// rejects it for LatestAttention (TOVA: each observation replaces the score, so the sum of the
// observations since the last pass is not its score; deferring only the last observation would
// be exact, but it is a different mechanism from pending sums) and DecayedAttention (gamma * score + c:
// each observation's weight gamma^age depends on when it came, so the pending sums would no
// longer be sums of integers, and their all-reduce no longer exact). Those reduce eagerly, one
// all-reduce per layer and observe().
//
// Not part of the umbrella header (kvevict.hpp): it needs the c10d headers, and a group needs
// the backend's headers too (Gloo: `gloo/` from libgloo-dev on Debian, with USE_C10D_GLOO
// defined; NCCL: a CUDA build of LibTorch, with USE_C10D_NCCL defined).
//
// Works with LibTorch 1.13, where ProcessGroupGloo / ProcessGroupNCCL derive from
// c10d::ProcessGroup, and with 2.x, where they derive from c10d::Backend: TensorParallel takes
// any group type with getRank(), getSize(), allreduce() and allgather() returning a c10d::Work.

#include <kvevict/check.hpp>
#include <kvevict/options.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if defined(USE_C10D_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace kvevict {

/// Heads [begin, end) of the model's heads that one rank holds.
struct HeadRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const noexcept { return end - begin; }
};

/// The contiguous block of `total_heads` heads that `rank` of `world_size` ranks holds, as
/// column-parallel projections split them: total_heads / world_size each, the first
/// total_heads % world_size ranks one more.
/// \throws c10::ValueError unless 1 <= world_size <= total_heads and 0 <= rank < world_size.
inline HeadRange split_heads(int64_t total_heads, int64_t world_size, int64_t rank) {
  KVEVICT_CHECK_VALUE(world_size >= 1 && world_size <= total_heads, "split_heads: world_size must be in [1, total_heads = ",
                      total_heads, "], got ", world_size);
  KVEVICT_CHECK_VALUE(rank >= 0 && rank < world_size, "split_heads: rank must be in [0, world_size = ", world_size,
                      "), got ", rank);
  const int64_t base = total_heads / world_size, extra = total_heads % world_size;
  const int64_t begin = rank * base + std::min(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

namespace detail {

/// The collectives TensorParallel needs, over any c10d group type (type-erased).
struct Collectives {
  virtual ~Collectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  virtual c10::intrusive_ptr<c10d::Work> allreduce_sum(std::vector<at::Tensor>& tensors) = 0;
  virtual c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                                   std::vector<at::Tensor>& in) = 0;
};

template <class Group>
struct CollectivesOf final : Collectives {
  explicit CollectivesOf(c10::intrusive_ptr<Group> g) : group(std::move(g)) {}
  int rank() const override { return group->getRank(); }
  int size() const override { return group->getSize(); }
  std::string backend() const override { return group->getBackendName(); }
  c10::intrusive_ptr<c10d::Work> allreduce_sum(std::vector<at::Tensor>& tensors) override {
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    return group->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in) override {
    return group->allgather(out, in);
  }
  c10::intrusive_ptr<Group> group;
};

/// FNV-1a, 64 bits: a hash that is the same in every process (std::hash need not be).
inline int64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return static_cast<int64_t>(h);
}

inline std::string what_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace detail

/// One rank's share of a tensor-parallel model, for its eviction state: the process group, the
/// heads this rank holds, the model's total heads, and how long a collective may take.
///
/// What is reduced and when: every observe() (attend(), attend_absorbed()) sums this rank's
/// heads into fixed-point sums [B, S] fp64 and calls reducer(), which all-reduces them (SUM) in
/// place; the policy divides by total_heads. One all-reduce of B x S x 8 bytes per layer and
/// observe(), or, with lazy_reduction, one per layer and eviction pass (plus one early flush per
/// 2^21 / (Q x total_heads) observations, to keep the sums exact).
///
/// Failure: a collective that fails (a peer died: Gloo sees the connection close) or does not
/// complete within `timeout` (a peer hangs) throws c10::Error naming this rank, the layer and
/// the cause; the failed observation is not applied. The group cannot be used after that: end
/// the process (or rebuild the group and the caches). Ranks never go on with different states:
/// a rank either applies the same reduced values as its peers or throws.
///
/// Example (one process per rank; rank, world from the launcher):
/// \code
///   auto tp = kvevict::TensorParallel::connect(store, rank, world, /*total_heads=*/128, device);
///   auto cache = tp.make<kvevict::MlaLatentCache>(
///       kvevict::MlaLatentCacheOptions(61, /*num_heads: set by make*/ 128).device(device),
///       kvevict::EvictionOptions(4592).n_sink(4).n_recent(16).evict_every(16), /*lazy=*/true);
///   // heads [tp.heads().begin, tp.heads().end) of every layer are this rank's
/// \endcode
class TensorParallel {
 public:
  /// \param group        a c10d group over the tensor-parallel ranks: c10d::ProcessGroup (LibTorch
  ///                     1.13: ProcessGroupGloo, ProcessGroupNCCL) or c10d::Backend (2.x). Gloo:
  ///                     the state may be on CPU or CUDA; NCCL: on this rank's CUDA device.
  /// \param total_heads  attention heads of the model (DeepSeek-V3: 128), split by split_heads().
  /// \param timeout      the longest one collective may take before this rank gives up.
  /// \throws c10::ValueError if the group is null, total_heads < world size or timeout <= 0.
  template <class Group>
  TensorParallel(c10::intrusive_ptr<Group> group, int64_t total_heads,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : total_heads_(total_heads), timeout_(timeout) {
    KVEVICT_CHECK_VALUE(group, "TensorParallel: group must not be null");
    KVEVICT_CHECK_VALUE(timeout.count() > 0, "TensorParallel: timeout must be > 0 ms, got ", timeout.count());
    comm_ = std::make_shared<detail::CollectivesOf<Group>>(std::move(group));
    heads_ = split_heads(total_heads, comm_->size(), comm_->rank());
  }

#if defined(USE_C10D_GLOO) || defined(USE_C10D_NCCL)
  /// Builds the group and the TensorParallel in one call: NCCL when `device` is CUDA and this
  /// build has it (USE_C10D_NCCL), else Gloo over `hostname` (loopback by default). Every rank
  /// calls it with the same store (c10d::TCPStore or c10d::FileStore) and world size.
  /// \throws c10::Error if the group cannot be formed within `timeout` (the message names the
  ///         rank); c10::ValueError as the constructor.
  static TensorParallel connect(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                int64_t total_heads, const at::Device& device = at::Device(at::kCPU),
                                std::chrono::milliseconds timeout = std::chrono::seconds(60),
                                const std::string& hostname = "127.0.0.1") {
    try {
      store->setTimeout(timeout);  // the rendezvous, too, gives up after `timeout`
#if defined(USE_C10D_NCCL)
      if (device.is_cuda()) {
        auto opts = c10d::ProcessGroupNCCL::Options::create();
        opts->timeout = timeout;
        return TensorParallel(c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, opts), total_heads,
                              timeout);
      }
#endif
#if defined(USE_C10D_GLOO)
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
      return TensorParallel(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, opts), total_heads,
                            timeout);
#else
      KVEVICT_CHECK(false, "TensorParallel::connect: no group for device ", device,
                    " (this build has NCCL only; build with USE_C10D_GLOO for CPU)");
#endif
    } catch (const c10::ValueError&) {
      throw;
    } catch (const std::exception& e) {
      KVEVICT_CHECK(false, "TensorParallel::connect: rank ", rank, " of ", world_size,
                    " could not form the process group within ", timeout.count(), " ms: ", detail::what_of(e));
    }
    throw std::logic_error("unreachable");
  }
#endif

  int64_t rank() const { return comm_->rank(); }
  int64_t world_size() const { return comm_->size(); }
  /// The model's heads, all ranks together.
  int64_t total_heads() const noexcept { return total_heads_; }
  /// The heads this rank holds (split_heads()): its probs are [B, heads().size(), Q, S].
  HeadRange heads() const noexcept { return heads_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// The group's backend name ("gloo", "nccl").
  std::string backend() const { return comm_->backend(); }

  /// The reducer for reduce_contributions: all-reduces `sums` (contiguous fp64 on the group's
  /// device: CPU or CUDA for Gloo, CUDA for NCCL) in place, SUM, and waits at most timeout().
  /// \throws c10::Error "kvevict: tensor parallel: rank R of N: the all-reduce of layer L's
  ///         contributions failed ..." with the cause (timeout, peer gone).
  ContributionReducer reducer() const {
    auto comm = comm_;
    const auto timeout = timeout_;
    return [comm, timeout](int64_t layer, at::Tensor& sums) {
      std::vector<at::Tensor> tensors{sums};
      try {
        auto work = comm->allreduce_sum(tensors);
        work->wait(timeout);
      } catch (const std::exception& e) {
        KVEVICT_CHECK(false, "tensor parallel: rank ", comm->rank(), " of ", comm->size(), ": the all-reduce of layer ",
                      layer, "'s contributions ", sums.sizes(), " failed or did not complete within ",
                      timeout.count(), " ms (", comm->backend(), ": ", detail::what_of(e),
                      "); a peer rank died, hung or called a different collective; this observation was not "
                      "applied and the process group cannot be used again");
      }
    };
  }

  /// `options` for this rank: num_heads = heads().size(), total_heads, reduce_contributions =
  /// reducer(), lazy_reduction = `lazy`. Options: EvictionPolicyOptions, MlaCacheOptions or
  /// MlaLatentCacheOptions (the other fields are kept).
  template <class Options>
  Options configure(Options options, bool lazy = false) const {
    options.num_heads(heads_.size());
    options.total_heads(total_heads_);
    options.reduce_contributions(reducer());
    options.lazy_reduction(lazy);
    return options;
  }

  /// Builds a cache (MlaCache, MlaLatentCache, or any BasicMla*Cache<Policy>) from configure()d
  /// options, then check()s it against the other ranks. Every rank calls it, in the same order.
  /// \throws c10::ValueError on a mismatch across ranks (see check()), or what the cache throws.
  template <class Cache, class Options>
  Cache make(const Options& options, const EvictionOptions& eviction = EvictionOptions(), bool lazy = false,
             typename Cache::scorer_type scorer = typename Cache::scorer_type()) const {
    Cache cache(configure(options, lazy), eviction, std::move(scorer));
    check(cache.policy());
    return cache;
  }

  /// Checks that every rank built the same eviction state (a collective: one all-gather).
  /// Compared: num_layers, batch_size, capacity, budget, n_sink, n_recent, evict_every,
  /// layer_budgets, the scorer's kName, lazy_reduction, total_heads; and each rank's num_heads
  /// must be its heads().size(), adding up to total_heads.
  /// \param policy  an EvictionPolicy (cache.policy()), on the group's device.
  /// \throws c10::ValueError on every rank if they differ, naming the field, the rank and the
  ///         values; c10::Error if the all-gather fails or times out.
  template <class Policy>
  void check(const Policy& policy) const {
    const auto& o = policy.options();
    const auto& e = policy.eviction();
    const std::string scorer = Policy::scorer_type::kName;
    const auto& budgets = o.layer_budgets();
    const std::vector<int64_t> mine = {
        o.num_layers(), o.batch_size(), e.capacity(), e.budget(), e.n_sink(), e.n_recent(), e.evict_every(),
        detail::fnv1a(budgets.data(), budgets.size() * sizeof(int64_t)), detail::fnv1a(scorer.data(), scorer.size()),
        o.lazy_reduction() ? 1 : 0, o.total_heads(),
        // configured: built from configure() of this TensorParallel (1 on every rank, or all fail)
        o.total_heads() == total_heads_ && o.num_heads() == heads_.size() && o.reduce_contributions() ? 1 : 0,
        o.num_heads(), heads_.begin};
    static const char* const kField[] = {"num_layers", "batch_size", "capacity", "budget", "n_sink", "n_recent",
                                         "evict_every", "layer_budgets (hash)", "scorer (hash of kName)",
                                         "lazy_reduction", "total_heads", "configured"};
    constexpr int64_t kShared = 12;  // fields every rank must agree on; then num_heads, head_begin
    const int64_t K = static_cast<int64_t>(mine.size()), N = world_size();
    const auto dev = policy.device();
    std::vector<at::Tensor> in{at::tensor(mine, at::TensorOptions().dtype(at::kLong)).to(dev)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int64_t r = 0; r < N; ++r) out[0].push_back(at::empty({K}, in[0].options()));
    try {
      comm_->allgather(out, in)->wait(timeout_);
    } catch (const std::exception& ex) {
      KVEVICT_CHECK(false, "tensor parallel: rank ", rank(), " of ", N,
                    ": the configuration check (all-gather) failed or did not complete within ", timeout_.count(),
                    " ms (", backend(), "): ", detail::what_of(ex));
    }
    std::vector<std::vector<int64_t>> all;
    for (const auto& t : out[0]) {
      const auto c = t.to(at::kCPU).contiguous();
      all.emplace_back(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + K);
    }
    for (int64_t r = 0; r < N; ++r) {
      KVEVICT_CHECK_VALUE(all[r][kShared - 1] == 1, "tensor parallel: rank ", rank(), ": rank ", r,
                          "'s options were not built by TensorParallel::configure() for its group (num_heads = ",
                          all[r][kShared], ", total_heads = ", all[r][kShared - 2],
                          ", or no reduce_contributions); every rank must configure its options");
    }
    for (int64_t r = 1; r < N; ++r) {
      for (int64_t f = 0; f < kShared - 1; ++f) {
        KVEVICT_CHECK_VALUE(all[r][f] == all[0][f], "tensor parallel: rank ", rank(), ": ", kField[f],
                            " differs across ranks: ", all[0][f], " on rank 0, ", all[r][f], " on rank ", r,
                            "; every rank must build the same eviction state");
      }
    }
    int64_t sum = 0;
    for (int64_t r = 0; r < N; ++r) {
      const auto expected = split_heads(total_heads_, N, r);
      KVEVICT_CHECK_VALUE(all[r][kShared] == expected.size() && all[r][kShared + 1] == expected.begin,
                          "tensor parallel: rank ", rank(), ": rank ", r, " holds ", all[r][kShared],
                          " heads from head ", all[r][kShared + 1], ", expected num_heads = ", expected.size(),
                          " from head ", expected.begin, " (total_heads ", total_heads_, " split over ", N, " ranks)");
      sum += all[r][kShared];
    }
    KVEVICT_CHECK_VALUE(sum == total_heads_, "tensor parallel: rank ", rank(), ": num_heads over the ranks add up to ",
                        sum, ", expected total_heads = ", total_heads_);
  }

 private:
  std::shared_ptr<detail::Collectives> comm_;
  int64_t total_heads_;
  std::chrono::milliseconds timeout_;
  HeadRange heads_;
};

}  // namespace kvevict
