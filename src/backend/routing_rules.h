// The per-token rules of the routing approximations that drop assignments (moe/routing_approx.h:
// --active-experts with --renorm, --drop-below, and the rescaling a capacity's drop uses), one
// copy for the CPU (moe/routing_approx.cpp) and the GPU (backend/cuda/routing_approx.cu), so
// that equal router outputs give equal approximated routings on both. A token's K assignments
// are ids and weights; `dropped` is the id that marks a dropped one (the CPU's moe::kNoExpert,
// the GPU's null expert E). Float32 sums in pick order.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moeinfer::routing_rules {

struct Token {
  int32_t* ids;
  float* weights;
  int64_t k;        // K
  int32_t dropped;  // the id of a dropped assignment

  MOE_HOST_DEVICE bool live(int64_t i) const { return ids[i] != dropped; }

  MOE_HOST_DEVICE float live_sum() const {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) {
      if (live(i)) sum += weights[i];
    }
    return sum;
  }

  // Scales the live weights so that they sum to `target` (nothing when none is left).
  MOE_HOST_DEVICE void rescale(float target) const {
    const float sum = live_sum();
    if (sum <= 0.0f) return;
    const float scale = target / sum;
    for (int64_t i = 0; i < k; ++i) {
      if (live(i)) weights[i] *= scale;
    }
  }

  MOE_HOST_DEVICE void drop(int64_t i) const {
    ids[i] = dropped;
    weights[i] = 0.0f;
  }

  // The live assignments' indices by weight, largest first, equal weights in pick order (a
  // stable insertion sort: K is small), into slots [K]; returns how many.
  MOE_HOST_DEVICE int64_t by_weight(int64_t* slots) const {
    int64_t n = 0;
    for (int64_t i = 0; i < k; ++i) {
      if (!live(i)) continue;
      int64_t j = n++;
      while (j > 0 && weights[slots[j - 1]] < weights[i]) {
        slots[j] = slots[j - 1];
        --j;
      }
      slots[j] = i;
    }
    return n;
  }

  // --active-experts: keeps the `active` largest weights; rescale_kept (--renorm kept) scales
  // them back to the sum the token had.
  MOE_HOST_DEVICE void keep_largest(int64_t active, bool rescale_kept, int64_t* slots) const {
    const float before = live_sum();
    const int64_t n = by_weight(slots);
    for (int64_t i = active; i < n; ++i) drop(slots[i]);
    if (rescale_kept) rescale(before);
  }

  // --drop-below: drops every weight under `share` of the token's sum but its largest, and
  // scales the rest back to that sum.
  MOE_HOST_DEVICE void drop_small(float share, int64_t* slots) const {
    const float before = live_sum();
    if (before <= 0.0f) return;
    const int64_t n = by_weight(slots);
    bool any = false;
    for (int64_t i = 1; i < n; ++i) {  // slots[0], the largest weight, always stays
      if (weights[slots[i]] / before < share) {
        drop(slots[i]);
        any = true;
      }
    }
    if (any) rescale(before);
  }
};

}  // namespace moeinfer::routing_rules
