// The key/value cache of one sequence on the CPU: per layer, what attention needs of every past
// position, so that decoding a token never recomputes the prefix. Standard attention stores keys
// and values ([Nkv*D] each); MLA stores one row of [kv_lora_rank + rope dims] and no values.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace moeinfer {

class KvCache {
 public:
  KvCache(int64_t num_layers, int64_t key_width, int64_t value_width, int64_t max_tokens)
      : key_width_(key_width),
        value_width_(value_width),
        max_tokens_(max_tokens),
        keys_(num_layers),
        values_(num_layers) {}

  int64_t length() const { return length_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t key_width() const { return key_width_; }
  int64_t value_width() const { return value_width_; }

  // Makes room for positions [length, length + count) in every layer.
  void reserve_append(int64_t count) {
    MOE_CHECK(length_ + count <= max_tokens_, "sequence of ", length_ + count,
              " tokens exceeds the context limit of ", max_tokens_);
    const auto grow = [&](std::vector<std::vector<float>>& side, int64_t width) {
      const size_t needed = static_cast<size_t>((length_ + count) * width);
      for (auto& layer : side) {
        if (layer.size() < needed) layer.resize(std::max(needed, layer.size() * 2));
      }
    };
    grow(keys_, key_width_);
    grow(values_, value_width_);
  }
  // [tokens, key_width] and [tokens, value_width] of one layer.
  float* keys(int64_t layer) { return keys_[layer].data(); }
  float* values(int64_t layer) { return values_[layer].data(); }
  void advance(int64_t count) { length_ += count; }
  void clear() { length_ = 0; }
  size_t bytes_per_token() const {
    return keys_.size() * static_cast<size_t>(key_width_ + value_width_) * sizeof(float);
  }

 private:
  int64_t key_width_;
  int64_t value_width_;
  int64_t max_tokens_;
  int64_t length_ = 0;
  std::vector<std::vector<float>> keys_;
  std::vector<std::vector<float>> values_;
};

}  // namespace moeinfer
