// Fused router: softmax or sigmoid over a token's E logits, top-k, renormalisation and the
// routed scaling factor, in one kernel with one warp per token.
//
// Why this shape: a token's E <= 256 logits fit in one warp's registers (kPerLane = E/32
// rounded up, a compile-time count so the array stays in registers), the softmax needs only two
// warp reductions, and top-k is K rounds of a warp arg-max over (score, id) pairs ordered by
// score descending then id ascending, a strict total order, so every lane agrees on the winner
// and ties go to the lower expert id as the CPU reference's partial_sort does. Lane k keeps the
// k-th pick, so the K outputs are written by K lanes at once. Selection is by score, not logit,
// exactly like the reference: logits far below the maximum whose softmax underflows to 0 tie,
// and go to the lower id there too.
//
// Loads: lane l reads experts l, l + 32, ... so each round of loads is one coalesced 128-byte
// segment per warp; any E works, including ones whose rows are not 16-byte aligned (E = 60).
#pragma once

#include <climits>
#include <cmath>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int kRouterWarpsPerBlock = 4;

template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarpsPerBlock* device::kWarpSize)
    fused_router_kernel(const __grid_constant__ RouterParams p) {
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * kRouterWarpsPerBlock + threadIdx.x / device::kWarpSize;
  if (token >= p.num_tokens) return;  // whole warps leave together
  const int num_experts = static_cast<int>(p.num_experts);
  const int top_k = static_cast<int>(p.top_k);
  const float* row = p.logits + token * p.num_experts;  // [E]

  // Slots past E, and experts already picked, hold -inf: never chosen since scores are >= 0.
  float score[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = j * device::kWarpSize + lane;
    score[j] = e < num_experts ? __ldg(row + e) : -INFINITY;
  }

  if (p.score == RouterScore::kSoftmax) {
    float local_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) local_max = fmaxf(local_max, score[j]);
    const float max_logit = device::warp_max(local_max);
    float local_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * device::kWarpSize + lane;
      if (e < num_experts) {
        score[j] = expf(score[j] - max_logit);
        local_sum += score[j];
      }
    }
    const float sum = device::warp_sum(local_sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * device::kWarpSize + lane;
      if (e < num_experts) score[j] = score[j] / sum;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * device::kWarpSize + lane;
      if (e < num_experts) score[j] = 1.0f / (1.0f + expf(-score[j]));
    }
  }

  float my_score = 0.0f;  // lane k: the k-th pick
  int32_t my_id = 0;
  float picked_sum = 0.0f;  // summed in pick order, as the reference does
  for (int k = 0; k < top_k; ++k) {
    // Best of this lane: slots are in ascending id order, so '>' keeps the lower id on ties.
    float best = -INFINITY;
    int32_t best_id = INT_MAX;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (score[j] > best) {
        best = score[j];
        best_id = j * device::kWarpSize + lane;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other = __shfl_xor_sync(device::kFullMask, best, offset);
      const int32_t other_id = __shfl_xor_sync(device::kFullMask, best_id, offset);
      if (other > best || (other == best && other_id < best_id)) {
        best = other;
        best_id = other_id;
      }
    }
    if (lane == k) {
      my_score = best;
      my_id = best_id;
    }
    picked_sum += best;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (j * device::kWarpSize + lane == best_id) score[j] = -INFINITY;
    }
  }

  const float scale = (p.renormalize ? 1.0f / picked_sum : 1.0f) * p.routed_scaling_factor;
  if (lane < top_k) {
    p.topk_ids[token * p.top_k + lane] = my_id;
    p.topk_weights[token * p.top_k + lane] = my_score * scale;
  }
}

}  // namespace moeinfer::cuda
