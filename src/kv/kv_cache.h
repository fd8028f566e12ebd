// The key/value cache of one sequence on the CPU: per layer, keys and values of every past
// position, so that decoding a token never recomputes the prefix.
#pragma once

#include <cstdint>
#include <vector>

#include "core/error.h"

namespace moeinfer {

class KvCache {
 public:
  KvCache(int64_t num_layers, int64_t kv_dim, int64_t max_tokens)
      : kv_dim_(kv_dim), max_tokens_(max_tokens), keys_(num_layers), values_(num_layers) {}

  int64_t length() const { return length_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t kv_dim() const { return kv_dim_; }

  // Makes room for positions [length, length + count) in every layer.
  void reserve_append(int64_t count) {
    MOE_CHECK(length_ + count <= max_tokens_, "sequence of ", length_ + count,
              " tokens exceeds the context limit of ", max_tokens_);
    const size_t needed = static_cast<size_t>((length_ + count) * kv_dim_);
    for (auto* side : {&keys_, &values_}) {
      for (auto& layer : *side) {
        if (layer.size() < needed) layer.resize(std::max(needed, layer.size() * 2));
      }
    }
  }
  // [max_tokens, Nkv, D] keys / values of one layer.
  float* keys(int64_t layer) { return keys_[layer].data(); }
  float* values(int64_t layer) { return values_[layer].data(); }
  void advance(int64_t count) { length_ += count; }
  void clear() { length_ = 0; }
  size_t bytes_per_token() const { return 2 * keys_.size() * kv_dim_ * sizeof(float); }

 private:
  int64_t kv_dim_;
  int64_t max_tokens_;
  int64_t length_ = 0;
  std::vector<std::vector<float>> keys_;
  std::vector<std::vector<float>> values_;
};

}  // namespace moeinfer
