#pragma once
// CacheBase's append (cache_base.hpp declares it): plan_append() checks, allocate_append()
// allocates (the growth last), write_append() writes where no caller looks yet, commit_append()
// commits under its undo; check_finite_keys(), the key check with observation checks on.

#include <kvevict/cache_base.hpp>

namespace kvevict {
namespace detail {

template <class Policy>
std::vector<at::Tensor> CacheBase<Policy>::append(int64_t layer, std::vector<at::Tensor> rows, at::IntArrayRef counts) {
  check_not_moved("update");
  at::NoGradGuard no_grad;  // inputs that require grad must not tie the buffers to a graph
  policy_.size(layer);      // checks the layer
  AppendPlan u = plan_append(layer, rows, counts);
  allocate_append(layer, rows, u);
  // The views handed back, made before the commit: every host allocation before it.
  auto& target = u.grow ? u.grown_bufs : buffers_[layer];
  const bool same_views = live_views_[layer].match(specs_, target, u.width);  // the decode steady state
  LiveViews views;
  std::vector<at::Tensor> out;
  allocating([&] {
    if (!same_views) views = views_over(layer, target, u.width);
    out = same_views ? live_views_[layer].views : views.views;
  }, [&](const std::string& why) {
    KVEVICT_CHECK(false, "update: could not allocate the views of layer ", layer, " (", sizes_str(), "): ", why);
  });
  write_append(layer, target, u);
  commit_append(layer, u);
  if (!same_views) live_views_[layer] = std::move(views);
  return out;
}

template <class Policy>
auto CacheBase<Policy>::plan_append(int64_t layer, const std::vector<at::Tensor>& rows, at::IntArrayRef counts)
    -> AppendPlan {
  AppendPlan u;
  const int64_t T = u.T = check_rows(specs_, rows, batch_size(), dtype_, device());
  const int64_t B = batch_size();
  if (counts.empty()) {
    counts_.resize(B);
    bool any = false;
    for (int64_t b = 0; b < B; ++b) {
      counts_[b] = policy_.active(b) ? T : 0;
      any = any || counts_[b] > 0;
    }
    // Every row free: the tokens would go nowhere. (A free row in a batch with active rows
    // appends nothing, by design: continuous batching.)
    KVEVICT_CHECK(any, "update: no row holds a sequence (", B == 1 ? "row 0 is" : c10::str("all ", B, " rows are"),
                  " free: finish()ed), so the ", T, " new tokens would be dropped; call add_sequence() first (it "
                  "starts a new sequence in a free row) or reset(); the cache is unchanged");
  } else {
    KVEVICT_CHECK_VALUE(static_cast<int64_t>(counts.size()) == B, "counts must have B = ", B, " entries, got ",
                        counts.size());
    counts_.assign(counts.begin(), counts.end());
  }
  int64_t needed = 0;  // size(layer) after the append
  for (int64_t b = 0; b < B; ++b) {
    KVEVICT_CHECK_VALUE(counts_[b] >= 0 && counts_[b] <= T, "counts[", b, "] must be in [0, T = ", T, "], got ",
                        counts_[b]);
    needed = std::max(needed, policy_.size(layer, b) + counts_[b]);
  }
  u.grow = needed > slots(layer) - 1;  // the last slot is the trash slot
  if (u.grow) KVEVICT_CHECK_VALUE(needed <= EvictionOptions::kMaxTokens, "a row would hold more than 2^40 tokens");
  policy_.check_append(layer, counts_, T, /*check_room=*/!u.grow);  // everything else, before growing
  if (policy_.checks_observations()) check_finite_keys(layer, rows, T);
  u.slots = u.grow ? std::max(needed + 1, std::min<int64_t>(2 * slots(layer), EvictionOptions::kMaxTokens + 1))
                   : slots(layer);
  u.width = needed;
  return u;
}

template <class Policy>
void CacheBase<Policy>::allocate_append(int64_t layer, std::vector<at::Tensor>& rows, AppendPlan& u) {
  const auto& bufs = buffers_[layer];
  const bool host = policy_.host_path();
  u.src.resize(specs_.size());
  allocating([&] {
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (rows[i].is_alias_of(bufs[i])) rows[i] = rows[i].clone();  // e.g. views from an earlier update
      const int64_t tdim = token_dim(i);
      u.src[i] = !host || rows[i].stride(tdim + 1) == 1 ? rows[i] : rows[i].contiguous();  // host: read in place
    }
    if (!host) u.map = steps().slot_map(layer, counts_.data(), u.T, u.slots - 1);
    steps().prepare_append(layer, counts_.data(), u.T, u.map);
  }, [&](const std::string& why) { fail_append(layer, u.T, why); });
  if (u.grow) {
    u.grown_bufs = resized_buffers(layer, u.slots, "update");
    u.grown_state = steps().resized(steps().at(layer), layer, u.slots, "update");
  }
}

template <class Policy>
void CacheBase<Policy>::write_append(int64_t layer, std::vector<at::Tensor>& target, const AppendPlan& u) {
  const bool host = policy_.host_path();
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (host) {
      append_rows_host(target[i], token_dim(i), u.src[i], counts_.data(), [&](int64_t b) { return size(layer, b); });
    } else {
      scatter_rows(target[i], token_dim(i), u.src[i], u.map);
    }
  }
}

template <class Policy>
void CacheBase<Policy>::commit_append(int64_t layer, AppendPlan& u) {
  TensorUndo undo;
  if (!policy_.host_path()) {
    allocating([&] {
      if (u.grow) {
        auto old = steps().current(steps().at(layer), layer);
        const int64_t open_q = steps().at(layer).open_q;
        auto& grown_bufs = u.grown_bufs;
        undo.on_failure([this, layer, old, open_q, &grown_bufs]() mutable {
          buffers_[layer].swap(grown_bufs);
          steps().swap_in(steps().at(layer), layer, old);
          steps().at(layer).open_q = open_q;
        });
      } else {
        steps().save_append(undo, layer, u.map);
      }
    }, [&](const std::string& why) { fail_append(layer, u.T, why); });
  }
  undo.commit("update", [&] {
    if (u.grow) {
      buffers_[layer].swap(u.grown_bufs);
      steps().swap_in(steps().at(layer), layer, u.grown_state);
    }
    steps().append_prepared(layer, counts_.data(), u.T, u.map);
  });
}

template <class Policy>
[[noreturn]] void CacheBase<Policy>::fail_append(int64_t layer, int64_t T, const std::string& why) const {
  KVEVICT_CHECK(false, "update: could not allocate the append of T = ", T, " tokens to layer ", layer, " (",
                sizes_str(), "): ", why);
  throw;  // not reached
}

template <class Policy>
void CacheBase<Policy>::check_finite_keys(int64_t layer, const std::vector<at::Tensor>& rows, int64_t T) const {
  const int64_t B = batch_size();
  for (size_t i = 0; i < specs_.size(); ++i) {
    if (!specs_[i].key) continue;
    const auto& x = rows[i];
    const int64_t tdim = token_dim(i), inner = specs_[i].inner, outer = specs_[i].row_elements() / inner;
    // The first non-finite element of row b, column t (-1: none), as a flat index over [outer..., inner].
    const auto first_bad = [&](int64_t b, int64_t t) -> int64_t {
      int64_t found = -1;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "check_finite_keys", [&] {
        const scalar_t* p = x.data_ptr<scalar_t>() + b * x.stride(0) + t * x.stride(tdim);
        for (int64_t o = 0; o < outer && found < 0; ++o) {
          int64_t off = 0, rest = o;  // o over the outer dims, row-major
          for (int64_t d = tdim - 1; d >= 1; --d) {
            off += (rest % x.size(d)) * x.stride(d);
            rest /= x.size(d);
          }
          for (int64_t j = 0; j < inner; ++j) {
            if (!std::isfinite(static_cast<float>(p[off + j * x.stride(tdim + 1)]))) {
              found = o * inner + j;
              break;
            }
          }
        }
      });
      return found;
    };
    at::Tensor bad_cols;  // a device's rows: [B, T] whether a column holds a non-finite key
    if (!x.is_cpu()) {
      bad_cols = at::isfinite(x).logical_not().movedim(tdim, 1).reshape({B, T, -1}).any(-1).cpu();
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = T - counts_[b]; t < T; ++t) {
        if (bad_cols.defined() && !bad_cols[b][t].item<bool>()) continue;
        const int64_t found = x.is_cpu() ? first_bad(b, t) : [&] {  // [outer..., inner], flat
          const auto bad = at::isfinite(x[b].select(tdim - 1, t).cpu().reshape({-1})).logical_not().nonzero();
          return bad.numel() > 0 ? bad[0][0].item<int64_t>() : int64_t{-1};
        }();
        if (found < 0) continue;
        std::vector<int64_t> index{b};  // [b, outer..., t, j]
        std::vector<int64_t> outer_index;
        for (int64_t d = tdim - 1, rest = found / inner; d >= 1; --d) {
          outer_index.insert(outer_index.begin(), rest % x.size(d));
          rest /= x.size(d);
        }
        index.insert(index.end(), outer_index.begin(), outer_index.end());
        index.push_back(t);
        index.push_back(found % inner);
        float value = 0;
        {
          auto e = x;
          for (const auto k : index) e = e.select(0, k);
          value = e.to(at::kFloat).item<float>();
        }
        KVEVICT_CHECK_VALUE(false, "update: ", specs_[i].name, " must be finite while observations are checked "
                            "(check_observations), got ", value, " at ", at::IntArrayRef(index), ": layer ", layer,
                            ", row ", b, ", position ", policy_.seen_tokens(layer, b) + t - (T - counts_[b]),
                            " (a non-finite key makes every attend on the layer fail its checks); the cache is "
                            "unchanged");
      }
    }
  }
}

}  // namespace detail
}  // namespace kvevict
