#pragma once
// Whether a cache fits in the machine's memory, checked before its constructor allocates
// anything (the layouts' constructors call check_cache_bytes).

#include <kvevict/check.hpp>
#include <kvevict/options.hpp>

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // sysconf: the machine's physical memory
#endif

namespace kvevict {
namespace detail {

/// Bytes of physical memory on this machine, or -1 where unknown.
inline long double physical_memory_bytes() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return static_cast<long double>(pages) * static_cast<long double>(page);
#endif
  return -1;
}

/// Checks, before a cache's constructor allocates anything, that what it allocates and writes
/// on the CPU fits in the machine's physical memory: every layer's buffers (`row_bytes` per slot
/// and row) and eviction state (scorer state width `state_width`) at capacity + evict_every + 1 slots per row. A
/// legal but huge budget otherwise filled the eviction state (tens of GB) before the far larger
/// buffers were even tried, and the process was killed. Nothing is checked off the CPU (a
/// device's allocator refuses what it cannot give, before anything is written).
/// \throws c10::Error ("could not allocate", as the allocation would) naming `cls`, the sizes and the bytes.
inline void check_cache_bytes(const char* cls, const EvictionPolicyOptions& p, const EvictionOptions& e,
                              int64_t row_bytes, int64_t state_width, at::Device device) {
  if (!device.is_cpu()) return;
  p.check_layer_budgets(e);
  const int64_t state_bytes = 8 + 4 * state_width + (p.lazy_reduction() ? 16 : 0);  // PolicyState's
  const auto& budgets = p.layer_budgets();  // empty: every layer e's budget (no vector of num_layers made)
  const auto layer_bytes = [&](int64_t budget) {
    const long double slots = static_cast<long double>(e.n_sink()) + budget + e.n_recent() + e.evict_every() + 1;
    return slots * p.batch_size() * (static_cast<long double>(row_bytes) + state_bytes);
  };
  long double total = 0, largest = 0;
  int64_t largest_layer = 0, largest_budget = e.budget();
  if (budgets.empty()) {
    largest = layer_bytes(e.budget());
    total = largest * p.num_layers();
  } else {
    for (size_t l = 0; l < budgets.size(); ++l) {
      const long double bytes = layer_bytes(budgets[l]);
      total += bytes;
      if (bytes > largest) {
        largest = bytes;
        largest_layer = static_cast<int64_t>(l);
        largest_budget = budgets[l];
      }
    }
  }
  const long double memory = physical_memory_bytes();
  if (memory < 0 || total <= memory) return;
  KVEVICT_CHECK(false, cls, ": could not allocate the cache buffers and eviction state: num_layers=", p.num_layers(),
                ", batch_size=", p.batch_size(), ", num_heads=", p.num_heads(), " would take ",
                static_cast<double>(total), " bytes on the CPU (", static_cast<double>(largest), " in layer ",
                largest_layer, ": n_sink=", e.n_sink(), ", budget=", largest_budget, ", n_recent=", e.n_recent(),
                ", evict_every=", e.evict_every(), " + 1 slots per row, ", row_bytes, " bytes of rows and ",
                state_bytes, " of eviction state per slot and row), more than this machine's ",
                static_cast<double>(memory), " bytes of memory; nothing was allocated. Lower the budget (or "
                "layer_budgets), batch_size or num_layers");
}

}  // namespace detail
}  // namespace kvevict
