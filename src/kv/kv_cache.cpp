#include "kv/kv_cache.h"

#include <numeric>

namespace moeinfer {

KvBlockPool::KvBlockPool(int64_t num_layers, int64_t key_width, int64_t value_width,
                         int64_t block_size, int64_t num_blocks, KvPoolLayout layout)
    : num_layers_(num_layers),
      key_width_(key_width),
      value_width_(value_width),
      block_size_(block_size),
      num_blocks_(num_blocks),
      dtype_(layout.dtype),
      key_groups_(layout.key_groups.empty() ? std::vector<int64_t>{key_width}
                                            : std::move(layout.key_groups)),
      value_groups_(layout.value_groups.empty() && value_width > 0
                        ? std::vector<int64_t>{value_width}
                        : std::move(layout.value_groups)) {
  MOE_CHECK(block_size > 0 && num_blocks >= 0 && key_width > 0 && value_width >= 0,
            "bad KV pool shape: block_size ", block_size, ", blocks ", num_blocks, ", widths ",
            key_width, "/", value_width);
  MOE_CHECK(
      layout.layer_has_kv.empty() || static_cast<int64_t>(layout.layer_has_kv.size()) == num_layers,
      "KV pool layout: ", layout.layer_has_kv.size(), " layer flags for ", num_layers, " layers");
  const auto sum = [](const std::vector<int64_t>& groups) {
    return std::accumulate(groups.begin(), groups.end(), int64_t{0});
  };
  MOE_CHECK(sum(key_groups_) == key_width && sum(value_groups_) == value_width,
            "KV pool layout: scale groups of ", sum(key_groups_), "/", sum(value_groups_),
            " values for rows of ", key_width, "/", value_width);
  key_row_bytes_ = kv_row_bytes(dtype_, key_groups_);
  value_row_bytes_ = kv_row_bytes(dtype_, value_groups_);
  // Whole floats per layer's plane, rounded up: an fp8 row need not be a multiple of 4 bytes.
  const auto floats = [&](int64_t row_bytes) {
    return static_cast<size_t>((num_blocks * block_size * row_bytes + 3) / 4);
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    if (!layout.layer_has_kv.empty() && !layout.layer_has_kv[l]) {
      keys_.emplace_back(nullptr);
      values_.emplace_back(nullptr);
      continue;
    }
    ++num_kv_layers_;
    // new float[] leaves the memory untouched, so unused blocks cost no resident memory.
    keys_.emplace_back(new float[floats(key_row_bytes_)]);
    values_.emplace_back(value_width > 0 ? new float[floats(value_row_bytes_)] : nullptr);
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
