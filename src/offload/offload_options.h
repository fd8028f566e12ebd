// What the user asked of expert offloading (--expert-budget, --expert-cache), one value shared
// by both decoders. With no budget every expert is resident and nothing here runs.
#pragma once

#include <cstdint>
#include <string>

#include "offload/cache_policy.h"

namespace moeinfer::offload {

struct OffloadOptions {
  // The routed experts' bytes the cache may hold: a byte count, or a fraction of all routed
  // expert bytes. Neither set: no offloading.
  int64_t budget_bytes = -1;      // >= 0 when given in bytes
  double budget_fraction = -1.0;  // in [0, 1] when given as a percentage
  // LFU by default: under skewed routing it keeps the popular experts where LRU, once a step's
  // experts outnumber the slots, evicts each before its next use (bench/RESULTS.md, 2026-12-07).
  CachePolicy policy = CachePolicy::kLfu;
  std::string hot_set_file;  // kStatic: a routing trace (--trace-routing) ranking the experts
  ColdExperts cold = ColdExperts::kGpu;  // where a miss computes (--cold-experts)
  // Predict layer l+1's experts at layer l through l+1's router and copy the missing ones while
  // l computes (--expert-prefetch on|off|auto). Off, every miss waits for its demand copy; on,
  // a wrong prediction's copy delays the next layer's demand when it outlasts the layer; auto,
  // per layer, while its predictions pay (cache_policy.h's prefetch_pays).
  PrefetchMode prefetch = PrefetchMode::kAuto;

  bool enabled() const { return budget_bytes >= 0 || budget_fraction >= 0.0; }
  // Slots of expert_bytes each that the budget holds, out of num_experts_total experts.
  int64_t num_slots(int64_t expert_bytes, int64_t num_experts_total) const {
    const int64_t all = expert_bytes * num_experts_total;
    const int64_t bytes = budget_bytes >= 0 ? budget_bytes
                                            : static_cast<int64_t>(budget_fraction * all);
    const int64_t slots = expert_bytes > 0 ? bytes / expert_bytes : 0;
    return slots < num_experts_total ? slots : num_experts_total;
  }
};

}  // namespace moeinfer::offload
