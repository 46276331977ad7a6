#pragma once
// EvictionPolicy's save_layer() and check_restore() (eviction_policy.hpp declares them, with
// LayerSave and restore_layer()): a copy of one layer's eviction state, and the checks a restore
// runs before it swaps the copy back.

#include <kvevict/eviction_policy.hpp>

namespace kvevict {

template <class Scorer>
typename EvictionPolicy<Scorer>::LayerSave EvictionPolicy<Scorer>::save_layer(int64_t layer) const {
  return detail::host_heap("save_layer", [&] {
    KVEVICT_CHECK(at(layer).open_q == 0, "save_layer: layer ", layer, " has an open observation (observe_begin() ",
                  "without observe_end()); end it first");
    LayerSave s;
    s.state_ = copied(layer);
    s.epoch_ = epoch_;
    s.capacity_ = capacity(layer);
    s.evict_every_ = core_.eviction.evict_every();
    s.layer_ = layer;
    return s;
  });
}

template <class Scorer>
void EvictionPolicy<Scorer>::check_restore(int64_t layer, const LayerSave& save, const char* call) const {
  const auto& L = at(layer);
  KVEVICT_CHECK(save.layer_ >= 0, call, ": this save was restored already (a save is used once) or is empty");
  KVEVICT_CHECK(save.layer_ == layer, call, ": the save is of layer ", save.layer_, ", not of layer ", layer);
  KVEVICT_CHECK(L.open_q == 0, call, ": layer ", layer, " has an open observation (observe_begin() without ",
                "observe_end()); end it first");
  const int64_t B = save.state_.state.position.size(0);
  const int64_t ee = core_.eviction.evict_every();
  KVEVICT_CHECK(B == batch_size() && save.capacity_ == capacity(layer) && save.evict_every_ == ee, call,
                ": the save is of a layer of batch_size ", B, ", capacity ", save.capacity_, " and evict_every ",
                save.evict_every_, ", this one's layer ", layer, " has batch_size ", batch_size(), ", capacity ",
                capacity(layer), " and evict_every ", ee, ": it was made from another cache or policy");
  KVEVICT_CHECK(save.epoch_ == epoch_, call, ": reset, finish, add_sequence or truncate ran since the save of layer ",
                layer, "; they change every layer's rows, and restoring one layer would leave the layers disagreeing");
  KVEVICT_CHECK(save.state_.state.slots >= base_slots_unchecked(layer), call, ": reserve() raised layer ", layer,
                "'s slots to ", base_slots_unchecked(layer), " since the save, which has ", save.state_.state.slots);
}

}  // namespace kvevict
