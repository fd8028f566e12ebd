#include "kv/kv_cache.h"

#include <numeric>

namespace moeinfer {

KvBlockPool::KvBlockPool(int64_t num_layers, int64_t key_width, int64_t value_width,
                         int64_t block_size, int64_t num_blocks, KvPoolLayout layout)
    : num_layers_(num_layers),
      key_width_(key_width),
      value_width_(value_width),
      block_size_(block_size),
      num_blocks_(num_blocks) {
  MOE_CHECK(block_size > 0 && num_blocks >= 0 && key_width > 0 && value_width >= 0,
            "bad KV pool shape: block_size ", block_size, ", blocks ", num_blocks, ", widths ",
            key_width, "/", value_width);
  MOE_CHECK(
      layout.layer_has_kv.empty() || static_cast<int64_t>(layout.layer_has_kv.size()) == num_layers,
      "KV pool layout: ", layout.layer_has_kv.size(), " layer flags for ", num_layers, " layers");
  for (int64_t l = 0; l < num_layers; ++l) {
    if (!layout.layer_has_kv.empty() && !layout.layer_has_kv[l]) {
      keys_.emplace_back(nullptr);
      values_.emplace_back(nullptr);
      continue;
    }
    ++num_kv_layers_;
    // new float[] leaves the memory untouched, so unused blocks cost no resident memory.
    keys_.emplace_back(new float[static_cast<size_t>(num_blocks * block_size * key_width)]);
    values_.emplace_back(value_width > 0
                             ? new float[static_cast<size_t>(num_blocks * block_size * value_width)]
                             : nullptr);
  }
  state_ = RecurrentStatePool(std::move(layout.state), layout.num_state_slots);
}

KvCache::KvCache(int64_t num_layers, int64_t key_width, int64_t value_width, int64_t max_tokens,
                 int64_t block_size, KvPoolLayout layout)
    : max_tokens_(max_tokens),
      pool_(num_layers, key_width, value_width, block_size,
            (max_tokens + block_size - 1) / block_size, std::move(layout)),
      block_table_(static_cast<size_t>(pool_.num_blocks())) {
  std::iota(block_table_.begin(), block_table_.end(), 0);
}

}  // namespace moeinfer
