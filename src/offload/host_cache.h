// The expert cache's tables (cache_policy.h) in host memory, with the tick clock and the
// per-layer counters: what the CPU backend's simulated budget (moe/cached_experts.h) decides
// with, and what the tests drive the shared decision code through. The GPU keeps the same
// arrays in device memory.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "offload/cache_policy.h"

namespace moeinfer::offload {

// A copy into a slot that the caller makes: expert g's weights into `slot`.
struct SlotCopy {
  int32_t expert = 0;  // global id, layer * E + e
  int32_t slot = 0;
};

class HostCacheTables {
 public:
  // An empty cache of num_slots slots for num_layers x num_experts experts.
  HostCacheTables(int64_t num_layers, int64_t num_experts, int64_t num_slots, CachePolicy policy);
  HostCacheTables(const HostCacheTables&) = delete;
  HostCacheTables& operator=(const HostCacheTables&) = delete;

  int64_t num_layers() const { return num_layers_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t num_slots() const { return static_cast<int64_t>(owner_.size()); }
  CachePolicy policy() const { return policy_; }

  // Views of the arrays for the decision code; valid while this object lives.
  CacheTables tables();
  // A new tick, greater than every earlier one (the first is 1).
  int64_t next_tick() { return ++tick_; }
  int64_t tick() const { return tick_; }

  // One admission of a.layer's experts (rows [E]: the rows using each, 0 for none); writes its
  // copies to `copies` and, under a cold mode other than kGpu, the experts its rows compute on
  // the host to `on_cpu` (room for E each). Demand counters go to a.layer's row, as do a
  // prefetch's; an evicted prefetch no demand used counts as wasted in its own layer's row.
  struct Admitted {
    int64_t num_copies = 0;
    int64_t num_on_cpu = 0;
  };
  Admitted admit(const Admission& a, const int32_t* rows, const ColdCost& cold,
                 std::span<SlotCopy> copies, std::span<int32_t> on_cpu = {});

  // Warm-up: puts the ranked experts (global ids, most important first) that are not resident
  // into the free slots, lowest slot first, until the free slots run out; stamps them with new
  // ticks so that the top of the ranking is the most recently used (the last an LRU evicts).
  // Counts nothing. Returns the copies to make.
  std::vector<SlotCopy> warm(std::span<const int32_t> ranking);
  // The static policy's hot set: the first num_hot experts of the ranking (the rest of the
  // ranking, and experts outside it, stream through the other slots).
  void set_hot_set(std::span<const int32_t> ranking, int64_t num_hot);

  int32_t slot_of(int32_t expert) const { return slot_of_[expert]; }
  int32_t owner(int64_t slot) const { return owner_[slot]; }
  int64_t last_use(int64_t slot) const { return last_use_[slot]; }
  int64_t uses(int32_t expert) const { return uses_[expert]; }
  bool prefetched(int64_t slot) const { return prefetched_[slot] != 0; }
  bool hot(int32_t expert) const { return hot_[expert] != 0; }
  int64_t num_hot() const;

  // [kNumCacheCounters] of one layer, and [L, kNumCacheCounters] of all, since construction.
  std::span<const int64_t> counters(int64_t layer) const;
  std::span<const int64_t> all_counters() const { return counters_; }
  // The counters summed over layers, [kNumCacheCounters].
  std::vector<int64_t> total_counters() const;

 private:
  int64_t num_layers_, num_experts_;
  CachePolicy policy_;
  int64_t tick_ = 0;
  std::vector<int32_t> slot_of_;     // [L*E]
  std::vector<int32_t> owner_;       // [S]
  std::vector<int64_t> last_use_;    // [S]
  std::vector<int64_t> uses_;        // [L*E]
  std::vector<uint8_t> prefetched_;  // [S]
  std::vector<uint8_t> hot_;         // [L*E]
  std::vector<int64_t> counters_;    // [L, kNumCacheCounters]
};

}  // namespace moeinfer::offload
