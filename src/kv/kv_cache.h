// Paged key/value storage. A KvBlockPool holds fixed-size blocks of cache rows for every layer;
// a sequence owns an ordered list of blocks (its block table), so sequences of any length share
// one pool without fragmentation and full blocks can be shared between sequences with the same
// prefix. Standard attention stores a key row and a value row ([Nkv*D] each) per token; MLA
// stores one row of [kv_lora_rank + rope dims] and no values.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/error.h"

namespace moeinfer {

class KvBlockPool {
 public:
  KvBlockPool(int64_t num_layers, int64_t key_width, int64_t value_width, int64_t block_size,
              int64_t num_blocks);

  int64_t num_layers() const { return num_layers_; }
  int64_t key_width() const { return key_width_; }
  int64_t value_width() const { return value_width_; }
  int64_t block_size() const { return block_size_; }
  int64_t num_blocks() const { return num_blocks_; }
  size_t bytes_per_token() const {
    return static_cast<size_t>(num_layers_ * (key_width_ + value_width_)) * sizeof(float);
  }

  // The key / value row of `slot` in `block` for `layer`.
  float* key_row(int64_t layer, int64_t block, int64_t slot) {
    return keys_[layer].get() + (block * block_size_ + slot) * key_width_;
  }
  float* value_row(int64_t layer, int64_t block, int64_t slot) {
    return values_[layer].get() + (block * block_size_ + slot) * value_width_;
  }

 private:
  int64_t num_layers_, key_width_, value_width_, block_size_, num_blocks_;
  // [num_layers] of [num_blocks, block_size, width]; pages are touched only when written.
  std::vector<std::unique_ptr<float[]>> keys_;
  std::vector<std::unique_ptr<float[]>> values_;
};

// One sequence's part of a batched forward pass.
struct SequenceBatch {
  std::span<const int32_t> tokens;       // [T_s] new tokens
  int64_t position = 0;                  // tokens of this sequence already in the cache
  std::span<const int32_t> block_table;  // blocks for positions [0, position + T_s)
  bool want_logits = true;               // logits for its last token (or all, see ForwardBatch)
};

struct ForwardBatch {
  std::vector<SequenceBatch> sequences;
  bool all_positions = false;  // logits for every new token of sequences that want logits
};

// A single sequence with a private pool: what `generate`, `logits` and the tests use.
class KvCache {
 public:
  KvCache(int64_t num_layers, int64_t key_width, int64_t value_width, int64_t max_tokens,
          int64_t block_size = 16);

  int64_t length() const { return length_; }
  int64_t max_tokens() const { return max_tokens_; }
  KvBlockPool& pool() { return pool_; }
  std::span<const int32_t> block_table() const { return block_table_; }
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
