// The expert cache's decisions: which of a layer's experts are resident, which slot a missing one
// takes, which expert leaves. Plain functions over plain arrays, compiled for the host and for
// the device, so that one piece of code decides on both: on the host for the CPU backend's
// simulated budget (moe/cached_experts.h) and the tests, inside the GPU's admission
// kernel (offload/cuda/expert_cache.cu) where the tables live in device memory and decode stays
// graph-captured.
//
// Experts are numbered globally, g = layer * E + e; a slot holds one expert's weights. Every
// admission (a layer's demand, or a prefetch of a predicted layer) takes a new tick, and a slot's
// last_use is the tick of the last admission that wanted its expert. Slots used at or after an
// admission's protect_from are never evicted by it: a demand protects the experts it has just
// placed or found; a prefetch for layer l+1, which runs while layer l computes, protects layer
// l's experts too (protect_from = layer l's tick).
//
// An admission first touches the needed experts that are resident (in expert order), then
// places the missing ones (in expert order), each in the slot of the lowest eviction key (ties
// to the lower slot): a free slot first, then by policy. A missing expert that finds no evictable
// slot is "unplaced": the experts stage reads its weights from host memory where they live.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moeinfer::offload {

enum class CachePolicy : int32_t {
  kLru,     // evict the least recently used
  kLfu,     // evict the least often demanded (ties: least recently used)
  kStatic,  // a hot set that is never evicted; the other slots stream the rest, LRU
};

// Per-layer counters an admission adds to ([L, kNumCacheCounters] int64).
enum CacheCounter : int32_t {
  kCacheHits,          // demanded experts found resident
  kCacheMisses,        // demanded experts copied into a slot
  kCacheUnplaced,      // demanded experts read from host memory (no evictable slot)
  kCachePrefetched,    // experts a prefetch copied into a slot
  kCachePrefetchUsed,  // demands that hit a slot a prefetch filled (and no demand had used)
  kCacheOnCpu,         // demanded experts computed on the host (--cold-experts cpu|auto)
  kCacheRowsOnCpu,     // the rows those experts computed there
  kCachePrefetchWasted,  // prefetched experts evicted before any demand used them
  kNumCacheCounters,
};

// Where a demanded expert that is not resident computes (--cold-experts). kGpu: it is copied
// into a slot (with no evictable slot its weights are read from home over PCIe). kCpu: its rows
// are computed on the host where its weights live, and nothing is evicted on demand (a miss
// still fills a free slot, so the budget holds the first experts touched, or a trace's warm or
// static set). kAuto: per
// miss, whichever of the two finishes first (ColdCost).
enum class ColdExperts : int32_t { kGpu, kCpu, kAuto };

// Whether a layer's predicted experts are prefetched (--expert-prefetch). kAuto: while the
// layer's prefetches pay (prefetch_pays).
enum class PrefetchMode : int32_t { kOff, kOn, kAuto };

// kAuto's rule, from the layer's counters before a prefetch admission: a prefetch pays when at
// least half of the layer's resolved prefetches were used. A wrong one takes the link for a
// copy the next layer's demand then waits behind (at small batch a copy outlasts the layer it
// overlaps) and evicts an expert; a right one saves a demand copy. Until kPrefetchTrial have
// resolved the layer prefetches to learn; after it stops, the admissions whose demand tick is a
// multiple of kPrefetchProbeTicks still prefetch, so that a change in the traffic is seen. One
// function for the host and the GPU's admission, so both decide alike.
inline constexpr int64_t kPrefetchTrial = 32;
inline constexpr int64_t kPrefetchProbeTicks = 64;
MOE_HOST_DEVICE bool prefetch_pays(const int64_t* layer_counters, int64_t demand_tick) {
  const int64_t used = layer_counters[kCachePrefetchUsed];
  const int64_t resolved = used + layer_counters[kCachePrefetchWasted];
  return resolved < kPrefetchTrial || 2 * used >= resolved ||
         demand_tick % kPrefetchProbeTicks == 0;
}

// The cost model of kAuto, in integer nanoseconds so that the host and the device decide alike:
// a copy takes copy_ns on the link; computing r rows on the host takes host_ns + r * host_row_ns
// (the weights read once, then each row's arithmetic). Copies and host work of one admission
// run side by side, each queue in expert order.
struct ColdCost {
  ColdExperts mode = ColdExperts::kGpu;
  int64_t copy_ns = 0;
  int64_t host_ns = 0;
  int64_t host_row_ns = 0;
};

// The two queues' busy time within one admission.
struct ColdQueues {
  int64_t copy_ns = 0;
  int64_t host_ns = 0;
};

inline constexpr int64_t kNotEvictable = INT64_MAX;
inline constexpr int64_t kFreeSlot = INT64_MIN;

// The cache's state. The arrays are host or device memory, as the caller runs.
struct CacheTables {
  int32_t* slot_of = nullptr;     // [L*E] slot holding expert g, or -1
  int32_t* owner = nullptr;       // [S] expert in slot s, or -1
  int64_t* last_use = nullptr;    // [S] tick of the last admission that wanted its expert
  int64_t* uses = nullptr;        // [L*E] demands that needed expert g (kept across evictions)
  uint8_t* prefetched = nullptr;  // [S] 1 while a prefetch's expert waits for its first demand
  const uint8_t* hot = nullptr;   // [L*E] the static policy's hot set, or null
  int64_t num_slots = 0;          // S
  CachePolicy policy = CachePolicy::kLru;
};

struct Admission {
  int64_t layer = 0;
  int64_t num_experts = 0;   // E
  int64_t tick = 0;          // this admission's, greater than every earlier one
  int64_t protect_from = 0;  // <= tick: slots used at or after it stay
  bool prefetch = false;     // a prediction: counts as prefetched, not as a demand
};

// Lower keys are evicted first; kFreeSlot for an empty slot, kNotEvictable for one in use.
MOE_HOST_DEVICE int64_t eviction_key(const CacheTables& t, int64_t slot, int64_t protect_from) {
  const int32_t g = t.owner[slot];
  if (g < 0) return kFreeSlot;
  const int64_t last = t.last_use[slot];
  if (last >= protect_from) return kNotEvictable;
  switch (t.policy) {
    case CachePolicy::kLru:
      return last;
    case CachePolicy::kLfu: {
      const int64_t uses = t.uses[g] < (int64_t{1} << 30) ? t.uses[g] : (int64_t{1} << 30);
      return (uses << 32) | (last & 0xffffffff);
    }
    case CachePolicy::kStatic:
      return t.hot != nullptr && t.hot[g] ? kNotEvictable : last;
  }
  return last;
}

// A needed expert found resident. Resident experts are stamped before any miss is placed, so
// that no miss evicts an expert its own layer needs.
MOE_HOST_DEVICE void touch_resident(const CacheTables& t, const Admission& a, int32_t slot,
                                    int64_t* counters) {
  t.last_use[slot] = a.tick;
  if (a.prefetch) return;
  counters[kCacheHits] += 1;
  if (t.prefetched[slot]) {
    t.prefetched[slot] = 0;
    counters[kCachePrefetchUsed] += 1;
  }
}

// Puts expert g in `slot` (evicting its owner), stamped with the admission's tick. counters:
// the whole [L, kNumCacheCounters]; an evicted prefetch that no demand used counts as wasted in
// its own layer, so that used + wasted are the prefetches resolved, whatever window is read.
MOE_HOST_DEVICE void place(const CacheTables& t, const Admission& a, int32_t g, int32_t slot,
                           int64_t* counters) {
  const int32_t old = t.owner[slot];
  if (old >= 0) {
    t.slot_of[old] = -1;
    if (t.prefetched[slot]) {
      counters[(old / a.num_experts) * kNumCacheCounters + kCachePrefetchWasted] += 1;
    }
  }
  counters += a.layer * kNumCacheCounters;
  t.owner[slot] = g;
  t.slot_of[g] = slot;
  t.last_use[slot] = a.tick;
  t.prefetched[slot] = a.prefetch ? 1 : 0;
  counters[a.prefetch ? kCachePrefetched : kCacheMisses] += 1;
}

// The slot a miss goes to, or -1 when every slot is in use (sequential scan; the GPU kernel
// reduces the same keys over a block, with the same tie rule).
MOE_HOST_DEVICE int32_t choose_slot(const CacheTables& t, int64_t protect_from) {
  int32_t best = -1;
  int64_t best_key = kNotEvictable;
  for (int64_t s = 0; s < t.num_slots; ++s) {
    const int64_t key = eviction_key(t, s, protect_from);
    if (key < best_key) {
      best_key = key;
      best = static_cast<int32_t>(s);
    }
  }
  return best;
}

// kCpu evicts nothing on demand: a miss takes `slot` only while it is free (the budget's first
// experts, filled by the first touches), else it computes on the host (-1).
MOE_HOST_DEVICE int32_t free_slot_or_none(const CacheTables& t, int32_t slot) {
  return slot >= 0 && t.owner[slot] < 0 ? slot : -1;
}

// Whether a miss of `rows` rows computes on the host (else it is copied), adding it to its
// queue. A placement that finds no evictable slot moves to the host too (kCpu and kAuto). Under
// kCpu every miss is the host's; admit() first gives it a free slot if one is left.
MOE_HOST_DEVICE bool miss_on_host(const ColdCost& c, int64_t rows, ColdQueues& q) {
  if (c.mode == ColdExperts::kGpu) return false;
  const int64_t host_done = q.host_ns + c.host_ns + rows * c.host_row_ns;
  if (c.mode == ColdExperts::kCpu || host_done <= q.copy_ns + c.copy_ns) {
    q.host_ns = host_done;
    return true;
  }
  q.copy_ns += c.copy_ns;
  return false;
}

MOE_HOST_DEVICE void count_on_host(int64_t rows, int64_t* counters) {
  counters[kCacheOnCpu] += 1;
  counters[kCacheRowsOnCpu] += rows;
}

// What an admission hands its caller: the copies to start (global expert, slot) and the
// experts to compute on the host (global ids), each list with room for E.
struct AdmissionLists {
  int32_t* copy_experts = nullptr;
  int32_t* copy_slots = nullptr;
  int64_t num_copies = 0;
  int32_t* host_experts = nullptr;  // may be null for ColdExperts::kGpu
  int64_t num_host = 0;
};

// One whole admission on the host. rows[e] is the number of rows of this step that use expert
// e of the layer (0: not needed); all_counters is [L, kNumCacheCounters]. A prefetch only
// copies (it computes nothing), whatever the cold mode.
MOE_HOST_DEVICE void admit(const CacheTables& t, const Admission& a, const int32_t* rows,
                           const ColdCost& cold, AdmissionLists& out, int64_t* all_counters) {
  const int32_t base = static_cast<int32_t>(a.layer * a.num_experts);
  int64_t* const counters = all_counters + a.layer * kNumCacheCounters;
  for (int64_t e = 0; e < a.num_experts; ++e) {
    if (rows[e] == 0) continue;
    const int32_t g = base + static_cast<int32_t>(e);
    if (!a.prefetch) t.uses[g] += 1;
    if (t.slot_of[g] >= 0) touch_resident(t, a, t.slot_of[g], counters);
  }
  out.num_copies = 0;
  out.num_host = 0;
  const bool host_allowed = !a.prefetch && cold.mode != ColdExperts::kGpu;
  ColdQueues queues;
  for (int64_t e = 0; e < a.num_experts; ++e) {
    const int32_t g = base + static_cast<int32_t>(e);
    if (rows[e] == 0 || t.slot_of[g] >= 0) continue;
    const int32_t slot = host_allowed && cold.mode == ColdExperts::kCpu
                             ? free_slot_or_none(t, choose_slot(t, a.protect_from))
                         : host_allowed && miss_on_host(cold, rows[e], queues)
                             ? -1
                             : choose_slot(t, a.protect_from);
    if (slot < 0) {
      if (host_allowed) {
        count_on_host(rows[e], counters);
        out.host_experts[out.num_host++] = g;
      } else if (!a.prefetch) {
        counters[kCacheUnplaced] += 1;
      }
      continue;
    }
    place(t, a, g, slot, all_counters);
    out.copy_experts[out.num_copies] = g;
    out.copy_slots[out.num_copies] = slot;
    ++out.num_copies;
  }
}

}  // namespace moeinfer::offload
