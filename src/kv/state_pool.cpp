#include "kv/state_pool.h"

#include <algorithm>

#include "core/error.h"

namespace moeinfer {

int64_t RecurrentStateShape::num_stateful_layers() const {
  return std::count(layer_has_state.begin(), layer_has_state.end(), true);
}

size_t RecurrentStateShape::bytes_per_slot() const {
  return static_cast<size_t>(num_stateful_layers() * (conv_values + recurrent_values)) *
         sizeof(float);
}

RecurrentStatePool::RecurrentStatePool(RecurrentStateShape shape, int64_t num_slots)
    : shape_(std::move(shape)), num_slots_(num_slots) {
  MOE_CHECK(num_slots >= 0 && shape_.conv_values >= 0 && shape_.recurrent_values >= 0,
            "bad recurrent state pool: ", num_slots, " slots of ", shape_.conv_values, " + ",
            shape_.recurrent_values, " values");
  const size_t L = shape_.layer_has_state.size();
  conv_.resize(L);
  recurrent_.resize(L);
  for (size_t l = 0; l < L; ++l) {
    if (!shape_.layer_has_state[l] || num_slots == 0) continue;
    conv_[l].reset(new float[static_cast<size_t>(num_slots * shape_.conv_values)]);
    recurrent_[l].reset(new float[static_cast<size_t>(num_slots * shape_.recurrent_values)]);
  }
}

void RecurrentStatePool::reset(int64_t slot) {
  MOE_CHECK(slot >= 0 && slot < num_slots_, "recurrent state slot ", slot, " outside the pool of ",
            num_slots_);
  for (size_t l = 0; l < conv_.size(); ++l) {
    if (!conv_[l]) continue;
    std::fill_n(conv(static_cast<int64_t>(l), slot), shape_.conv_values, 0.0f);
    std::fill_n(recurrent(static_cast<int64_t>(l), slot), shape_.recurrent_values, 0.0f);
  }
}

StateSlots::StateSlots(int64_t num_slots)
    : taken_(static_cast<size_t>(num_slots), false), num_free_(num_slots) {
  MOE_CHECK(num_slots >= 0, "state slots: a negative count ", num_slots);
}

std::optional<int32_t> StateSlots::acquire() {
  const auto it = std::find(taken_.begin(), taken_.end(), false);
  if (it == taken_.end()) return std::nullopt;
  *it = true;
  --num_free_;
  return static_cast<int32_t>(it - taken_.begin());
}

void StateSlots::release(int32_t slot) {
  MOE_CHECK(slot >= 0 && slot < num_slots() && taken_[slot], "state slot ", slot, " is not held (",
            num_slots(), " slots)");
  taken_[slot] = false;
  ++num_free_;
}

}  // namespace moeinfer
