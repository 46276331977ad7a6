#pragma once
// CacheBase's sequences and layer copies (cache_base.hpp declares them): reset(), truncate (its
// rows, state and tier tokens in one commit), finish/reset of a row with its tier tokens,
// save_layer() / restore_layer(), reserve() and reserve_tier().

#include <kvevict/cache_base.hpp>

namespace kvevict {
namespace detail {

template <class Policy>
void CacheBase<Policy>::reset() {
  host_heap("reset", [&] { check_not_moved("reset");
    std::vector<std::vector<at::Tensor>> fresh;  // every allocation first
    for (int64_t l = 0; l < num_layers(); ++l) {
      const int64_t base = policy_.base_slots(l);
      fresh.push_back(slots(l) == base ? buffers_[l] : allocate_named(l, base, "reset"));
    }
    auto state = steps().prepare_fresh("reset");
    std::vector<LiveViews> no_views(live_views_.size());
    // The commit: swaps, and the tiers' clear(), which allocate nothing.
    steps().commit_fresh(state);
    steps().activate_all();
    buffers_.swap(fresh);
    live_views_.swap(no_views);
    for (auto& t : tiers_) t.clear();
  });
}

template <class Policy>
typename CacheBase<Policy>::LayerSave CacheBase<Policy>::save_layer(int64_t layer) const {
  return host_heap("save_layer", [&] {
    check_not_moved("save_layer");
    LayerSave s;
    s.policy_ = policy_.save_layer(layer);
    c10::InferenceMode normal_tensors(false);
    for (const auto& b : buffers_[layer]) s.buffers_.push_back(b.clone());
    if (tier_tokens_ > 0) {
      auto t = tiers_[layer].copied();
      s.tier_.swap(t);
    }
    return s;
  });
}

template <class Policy>
void CacheBase<Policy>::restore_layer(int64_t layer, LayerSave&& save) {
  host_heap("restore_layer", [&] {
    check_not_moved("restore_layer");
    policy_.check_restore(layer, save.policy_, "restore_layer");
    const auto& bufs = buffers_[layer];
    KVEVICT_CHECK(save.buffers_.size() == bufs.size(), "restore_layer: the save holds ", save.buffers_.size(),
                  " buffers per layer, this cache ", bufs.size(), ": it was made from another kind of cache");
    for (size_t i = 0; i < bufs.size(); ++i) {
      const auto& a = save.buffers_[i];
      bool same = a.dim() == bufs[i].dim() && a.scalar_type() == bufs[i].scalar_type() && a.device() == bufs[i].device();
      for (int64_t d = 0; same && d < a.dim(); ++d) same = d == token_dim(i) || a.size(d) == bufs[i].size(d);
      KVEVICT_CHECK(same, "restore_layer: the save's buffer ", i, " is ", a.sizes(), " ", a.scalar_type(), " on ",
                    a.device(), ", this cache's layer ", layer, " holds ", bufs[i].sizes(), " ",
                    bufs[i].scalar_type(), " on ", bufs[i].device(), ": it was made from another cache");
    }
    const LayerTier none;
    const LayerTier& mine = tier_tokens_ > 0 ? tiers_[layer] : none;
    KVEVICT_CHECK(mine.same_kind(save.tier_), "restore_layer: the save holds ", save.tier_.describe(),
                  ", this cache's layer ", layer, " ", mine.describe(), ": it was made from another cache");
    // The commit: swaps, which allocate nothing and cannot throw.
    policy_.restore_layer(layer, std::move(save.policy_));
    buffers_[layer].swap(save.buffers_);
    if (tier_tokens_ > 0) tiers_[layer].swap(save.tier_);
    live_views_[layer] = LiveViews{};
  });
}

template <class Policy>
void CacheBase<Policy>::reserve_tier(int64_t positions) {
  host_heap("reserve_tier", [&] { check_not_moved("reserve_tier");
    KVEVICT_CHECK(tier_tokens_ > 0, "reserve_tier: this cache has no host tier (tier_tokens is 0 in its options)");
    KVEVICT_CHECK_VALUE(positions >= 1 && positions <= EvictionOptions::kMaxTokens,
                        "reserve_tier: positions must be in [1, 2^40], got ", positions);
    TensorUndo undo;
    TierWrites tier_writes(undo);
    allocating([&] {
      for (auto& t : tiers_) t.reserve(positions, tier_writes);
    }, [&](const std::string& why) {
      KVEVICT_CHECK(false, "reserve_tier: could not allocate the host tier of ", tier_tokens_, " tokens per row and ",
                    "the digests of ", positions, " positions on ", device(), ": ", why);
    });
    tier_writes.run();  // nothing to write: keeps what was grown
  });
}

template <class Policy>
void CacheBase<Policy>::truncate_rows(int64_t row, int64_t k) {
  // Tier tokens among the k newest leave the tier: the policy plans only the cached ones.
  std::vector<int64_t> in_tier(static_cast<size_t>(num_layers()), 0);
  if (tier_tokens_ > 0 && policy_.active(row) && k >= 0) {
    for (int64_t l = 0; l < num_layers(); ++l) {
      in_tier[l] = tiers_[l].count_from(row, policy_.seen_tokens(l, row) - k);
    }
  }
  auto t = steps().plan_truncate(row, k, in_tier);  // every check, every allocation of the state
  // The host path moves with memcpy; the tensor path gathers every layer's moved rows first.
  const bool host = policy_.host_path();
  std::vector<LayerMoves> moves(static_cast<size_t>(num_layers()));
  for (int64_t l = 0; l < num_layers() && !host; ++l) moves[l].gather(t.moves[l], specs_, buffers_[l], at::Tensor());
  // The tensor path's writes (the moves, then every layer's state, then its tier's) under an
  // undo log, then the host counters; the host path's tier steps allocate nothing.
  TensorUndo undo;
  TierWrites tier_writes(undo);
  for (int64_t l = 0; l < num_layers(); ++l) {  // a layer with no tier token among them: nothing to drop
    if (in_tier[l] > 0) tiers_[l].drop_from(row, policy_.seen_tokens(l, row) - k, tier_writes);
  }
  for (int64_t l = 0; l < num_layers() && !host; ++l) {
    steps().save(undo, l);
    moves[l].save(undo, specs_, buffers_[l]);
  }
  undo.commit("truncate", [&] {
    for (int64_t l = 0; l < num_layers(); ++l) {
      const auto& m = t.moves[l];
      for (size_t i = 0; i < specs_.size() && host && !m.empty(); ++i) {
        apply_moves_host(m.src.template data_ptr<int64_t>(), m.dst.template data_ptr<int64_t>(), batch_size(), m.size(),
                         m.size(), buffers_[l][i], token_dim(i));
      }
      moves[l].scatter(specs_, buffers_[l]);
    }
    tier_writes.run();
    steps().commit_truncate(t);
  });
}

template <class Policy>
template <class End>
void CacheBase<Policy>::end_row(int64_t row, const char* call, End&& end) {
  if (tier_tokens_ == 0 || row < 0 || row >= batch_size() || !policy_.active(row)) return end();  // its checks
  TensorUndo undo;
  TierWrites tier_writes(undo);
  for (auto& t : tiers_) t.release(row, tier_writes);
  const bool host = policy_.host_path();
  undo.commit(call, [&] {
    if (!host) tier_writes.run();
    end();
    if (host) tier_writes.run();
  });
}

template <class Policy>
void CacheBase<Policy>::reserve_slots(int64_t tokens) {
  KVEVICT_CHECK_VALUE(tokens >= 1 && tokens <= EvictionOptions::kMaxTokens, "reserve: tokens must be in [1, 2^40], got ",
                      tokens);
  std::vector<std::vector<at::Tensor>> grown(buffers_.size());  // every allocation first
  for (int64_t l = 0; l < num_layers(); ++l) {
    if (slots(l) < tokens + 1) grown[l] = resized_buffers(l, tokens + 1, "reserve");
  }
  policy_.reserve(tokens);  // all layers or none
  for (int64_t l = 0; l < num_layers(); ++l) {
    if (!grown[l].empty()) {
      buffers_[l] = std::move(grown[l]);
      live_views_[l] = LiveViews{};
    }
  }
}

}  // namespace detail
}  // namespace kvevict
