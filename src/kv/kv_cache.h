// Paged key/value storage. A KvBlockPool holds fixed-size blocks of cache rows for every layer;
// a sequence owns an ordered list of blocks (its block table), so sequences of any length share
// one pool without fragmentation and full blocks can be shared between sequences with the same
// prefix. Standard attention stores a key row and a value row ([Nkv*D] each) per token; MLA
// stores one row of [kv_lora_rank + rope dims] and no values. Rows are kept at the layout's
// KvDType (kv/kv_format.h): written once from float32 (write_key / write_value) and read back as
// float32 (read_key / read_value), so attention never sees the stored format.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "kv/kv_format.h"
#include "kv/state_pool.h"

namespace moeinfer {

// What a model keeps per sequence beyond one key/value row shape: which layers have rows at all
// (linear-attention layers have none) and the recurrent state of those that carry one.
struct KvPoolLayout {
  std::vector<bool> layer_has_kv;  // [num_layers]; empty: every layer
  RecurrentStateShape state;
  int64_t num_state_slots = 0;  // sequences whose recurrent state the pool holds at once
  // How rows are stored (--kv-dtype), and the groups of a key / value row that share one fp8
  // scale (a GQA head; MLA's latent and rope key). Empty groups: the whole row is one group.
  KvDType dtype = KvDType::kF32;
  std::vector<int64_t> key_groups;
  std::vector<int64_t> value_groups;
};

class KvBlockPool {
 public:
  KvBlockPool(int64_t num_layers, int64_t key_width, int64_t value_width, int64_t block_size,
              int64_t num_blocks, KvPoolLayout layout = {});

  int64_t num_layers() const { return num_layers_; }
  int64_t key_width() const { return key_width_; }
  int64_t value_width() const { return value_width_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_kv_layers() const { return num_kv_layers_; }
  bool has_kv(int64_t layer) const { return keys_[layer] != nullptr; }
  KvDType dtype() const { return dtype_; }
  // KV bytes one token takes over every layer with rows, fp8's scales included.
  size_t bytes_per_token() const {
    return static_cast<size_t>(num_kv_layers_ * (key_row_bytes_ + value_row_bytes_));
  }
  // The recurrent state of the model's linear layers (no slots when it has none).
  RecurrentStatePool& recurrent_state() { return state_; }
  const RecurrentStatePool& recurrent_state() const { return state_; }

  // Stores the key / value row ([key_width] / [value_width] floats) of `slot` in `block` for
  // `layer`, rounded to the pool's dtype.
  void write_key(int64_t layer, int64_t block, int64_t slot, const float* row) {
    encode_kv_row(dtype_, key_groups_, row, key_bytes(layer, block, slot));
  }
  void write_value(int64_t layer, int64_t block, int64_t slot, const float* row) {
    encode_kv_row(dtype_, value_groups_, row, value_bytes(layer, block, slot));
  }
  // Values [offset, offset + count) of a stored key / value row as float32: a pointer into the
  // pool for f32 rows, else decoded into `scratch` ([count]) and `scratch` returned.
  const float* read_key(int64_t layer, int64_t block, int64_t slot, int64_t offset, int64_t count,
                        float* scratch) const {
    return read(dtype_, key_groups_, key_bytes(layer, block, slot), offset, count, scratch);
  }
  const float* read_value(int64_t layer, int64_t block, int64_t slot, int64_t offset, int64_t count,
                          float* scratch) const {
    return read(dtype_, value_groups_, value_bytes(layer, block, slot), offset, count, scratch);
  }

 private:
  int64_t num_layers_, key_width_, value_width_, block_size_, num_blocks_;
  int64_t num_kv_layers_ = 0;
  KvDType dtype_;
  std::vector<int64_t> key_groups_, value_groups_;  // each sums to its row's width
  int64_t key_row_bytes_ = 0, value_row_bytes_ = 0;
  // [num_layers] of [num_blocks, block_size, row bytes], null for layers without rows; pages are
  // touched only when written. Held as float so that f32 rows are read in place.
  std::vector<std::unique_ptr<float[]>> keys_;
  std::vector<std::unique_ptr<float[]>> values_;

  std::byte* key_bytes(int64_t layer, int64_t block, int64_t slot) const {
    return reinterpret_cast<std::byte*>(keys_[layer].get()) +
           (block * block_size_ + slot) * key_row_bytes_;
  }
  std::byte* value_bytes(int64_t layer, int64_t block, int64_t slot) const {
    return reinterpret_cast<std::byte*>(values_[layer].get()) +
           (block * block_size_ + slot) * value_row_bytes_;
  }
  static const float* read(KvDType dtype, const std::vector<int64_t>& groups, const std::byte* row,
                           int64_t offset, int64_t count, float* scratch) {
    if (dtype == KvDType::kF32) return reinterpret_cast<const float*>(row) + offset;
    decode_kv_row(dtype, groups, row, offset, count, scratch);
    return scratch;
  }
  RecurrentStatePool state_;
};

// One sequence's part of a batched forward pass.
struct SequenceBatch {
  std::span<const int32_t> tokens;       // [T_s] new tokens
  int64_t position = 0;                  // tokens of this sequence already in the cache
  std::span<const int32_t> block_table;  // blocks for positions [0, position + T_s)
  bool want_logits = true;               // logits for its last token (or all, see ForwardBatch)
  // Its slot in the pool's recurrent state (models with linear-attention layers; -1 otherwise).
  // A sequence at position 0 starts from a zeroed state.
  int32_t state_slot = -1;
};

struct ForwardBatch {
  std::vector<SequenceBatch> sequences;
  bool all_positions = false;  // logits for every new token of sequences that want logits
};

// A single sequence with a private pool: what `generate`, `logits` and the tests use.
class KvCache {
 public:
  // layout.num_state_slots: 1 for a model with recurrent state (the sequence's slot 0), else 0.
  KvCache(int64_t num_layers, int64_t key_width, int64_t value_width, int64_t max_tokens,
          int64_t block_size = 16, KvPoolLayout layout = {});

  int64_t length() const { return length_; }
  int64_t max_tokens() const { return max_tokens_; }
  KvBlockPool& pool() { return pool_; }
  const KvBlockPool& pool() const { return pool_; }
  std::span<const int32_t> block_table() const { return block_table_; }
  // The sequence's recurrent state slot, or -1 for a model without one.
  int32_t state_slot() const { return pool_.recurrent_state().num_slots() > 0 ? 0 : -1; }
  // Checks that `count` more tokens fit.
  void reserve_append(int64_t count) const {
    MOE_CHECK(length_ + count <= max_tokens_, "sequence of ", length_ + count,
              " tokens exceeds the context limit of ", max_tokens_);
  }
  void advance(int64_t count) { length_ += count; }
  void clear() { length_ = 0; }
  size_t bytes_per_token() const { return pool_.bytes_per_token(); }

 private:
  int64_t max_tokens_;
  int64_t length_ = 0;
  KvBlockPool pool_;
  std::vector<int32_t> block_table_;
};

}  // namespace moeinfer
