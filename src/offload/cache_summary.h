// The expert cache's counters summed over layers, and the two ratios every report of them
// gives (the profile report, /metrics and the dashboard, `moeinfer bench`): one definition.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "offload/cache_policy.h"

namespace moeinfer::offload {

// The counters' names (by CacheCounter) in /metrics, /dashboard/data and the Python API's stats.
inline constexpr const char* kCacheCounterNames[kNumCacheCounters] = {
    "hits",        "misses",      "unplaced", "prefetched", "prefetch_used",
    "cpu_experts", "cpu_rows",    "prefetch_wasted"};

struct CacheSummary {
  int64_t counts[kNumCacheCounters] = {};  // by CacheCounter, over all layers
  int64_t host_to_device_bytes = 0;
  double stall_seconds = 0.0;

  int64_t demands() const {
    return counts[kCacheHits] + counts[kCacheMisses] + counts[kCacheUnplaced] +
           counts[kCacheOnCpu];
  }
  // Demands found resident, of all demands; 0 without demands.
  double hit_rate() const {
    return demands() ? static_cast<double>(counts[kCacheHits]) / static_cast<double>(demands())
                     : 0.0;
  }
  // Of the prefetches resolved (a demand used the expert, or it was evicted unused), the share
  // used; 0 with none resolved. Counted at resolution, so that a window of the counters (a
  // bench's timed steps) holds no uses of prefetches from before it: prefetched / used over a
  // window can pass 1 when earlier prefetches are used in it.
  double prefetch_accuracy() const {
    const int64_t resolved = counts[kCachePrefetchUsed] + counts[kCachePrefetchWasted];
    return resolved ? static_cast<double>(counts[kCachePrefetchUsed]) /
                          static_cast<double>(resolved)
                    : 0.0;
  }
};

// counters: [L, kNumCacheCounters]; bytes and stall_seconds: [L] (either may be empty).
inline CacheSummary summarize_cache(std::span<const int64_t> counters,
                                    std::span<const int64_t> bytes,
                                    std::span<const double> stall_seconds) {
  CacheSummary s;
  for (size_t i = 0; i < counters.size(); ++i) s.counts[i % kNumCacheCounters] += counters[i];
  for (int64_t b : bytes) s.host_to_device_bytes += b;
  for (double t : stall_seconds) s.stall_seconds += t;
  return s;
}

}  // namespace moeinfer::offload
