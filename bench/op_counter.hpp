#pragma once
// The benchmarks' ATen operator counter (kvevict_bench --count-ops, kvevict_lse_bench
// --count-ops): top-level operator calls of this thread, by name, through RecordFunction.

#include <ATen/record_function.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kvevict_bench {

/// Counts the top-level ATen operator calls (RecordFunction, FUNCTION scope) of this thread
/// while alive; an operator called by another one is not counted again.
class OpCounter {
 public:
  OpCounter() {
    counts().clear();
    depth() = 0;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&OpCounter::enter, &OpCounter::leave)
                                             .scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;
  /// (operator name, calls), in first-call order.
  static std::vector<std::pair<std::string, int64_t>>& counts() {
    static thread_local std::vector<std::pair<std::string, int64_t>> c;
    return c;
  }

 private:
  static int& depth() {
    static thread_local int d = 0;
    return d;
  }
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (depth()++ == 0) {
      const std::string name = fn.name();
      auto& c = counts();
      auto it = std::find_if(c.begin(), c.end(), [&](const auto& x) { return x.first == name; });
      if (it == c.end()) {
        c.emplace_back(name, 1);
      } else {
        ++it->second;
      }
    }
    return nullptr;
  }
  static void leave(const at::RecordFunction&, at::ObserverContext*) { --depth(); }
  at::CallbackHandle handle_;
};

/// True for the operators that only make a view (no kernel, no allocation).
inline bool is_view_op(const std::string& name) {
  static const std::vector<std::string> views{"aten::narrow", "aten::unsqueeze", "aten::select", "aten::transpose",
                                              "aten::view", "aten::expand", "aten::squeeze", "aten::slice",
                                              "aten::as_strided", "aten::alias", "aten::permute"};
  return std::find(views.begin(), views.end(), name) != views.end();
}

}  // namespace kvevict_bench
