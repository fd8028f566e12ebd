// Per-sequence recurrent state of linear-attention layers (Qwen3-Next's Gated DeltaNet). Unlike
// keys and values it does not grow with the sequence: each running sequence holds one fixed slot,
// which has, per stateful layer, the causal conv's window (the last conv_kernel - 1 inputs of
// every channel) and the recurrent state. The decoder resets a sequence's slot when the sequence
// runs from position 0, so a sequence that restarts (preemption by recompute) starts from zeros.
//
// RecurrentStatePool owns the memory (it lives in the KvBlockPool beside the blocks);
// StateSlots only counts which slots are taken, as the BlockManager does for blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace moeinfer {

struct RecurrentStateShape {
  std::vector<bool> layer_has_state;  // [num_layers]; empty: no layer has state
  int64_t conv_values = 0;            // per layer and slot
  int64_t recurrent_values = 0;       // per layer and slot
  int64_t num_stateful_layers() const;
  // Bytes one slot takes over all stateful layers (float32).
  size_t bytes_per_slot() const;
};

class RecurrentStatePool {
 public:
  RecurrentStatePool() = default;
  RecurrentStatePool(RecurrentStateShape shape, int64_t num_slots);

  int64_t num_slots() const { return num_slots_; }
  const RecurrentStateShape& shape() const { return shape_; }
  bool has_state(int64_t layer) const {
    return layer < static_cast<int64_t>(conv_.size()) && conv_[layer] != nullptr;
  }
  // [conv_dim, conv_kernel - 1] and [Nv, Dk, Dv] of `slot` in `layer`.
  float* conv(int64_t layer, int64_t slot) {
    return conv_[layer].get() + slot * shape_.conv_values;
  }
  float* recurrent(int64_t layer, int64_t slot) {
    return recurrent_[layer].get() + slot * shape_.recurrent_values;
  }
  // Zeros every layer's state of `slot`: the state before a sequence's first token.
  void reset(int64_t slot);

 private:
  RecurrentStateShape shape_;
  int64_t num_slots_ = 0;
  std::vector<std::unique_ptr<float[]>> conv_;       // [num_layers], null where no state
  std::vector<std::unique_ptr<float[]>> recurrent_;  // [num_layers], null where no state
};

// Which slots of a RecurrentStatePool running sequences hold; the lowest free slot is taken first.
class StateSlots {
 public:
  explicit StateSlots(int64_t num_slots = 0);
  int64_t num_slots() const { return static_cast<int64_t>(taken_.size()); }
  int64_t num_free() const { return num_free_; }
  // A free slot, or nullopt when every slot is taken.
  std::optional<int32_t> acquire();
  // Gives back a slot from acquire(); releasing a free slot or one out of range throws.
  void release(int32_t slot);

 private:
  std::vector<bool> taken_;
  int64_t num_free_ = 0;
};

}  // namespace moeinfer
