// The fused route-and-plan kernel (route_plan.h says what it computes and why).
//
// Grid: ceil(E / 8) blocks of 8 warps; warp w of block b owns router row 8 b + w. Before waiting
// for the previous kernel (programmatic launch) each warp prefetches its router row into L2: the
// weights are never written by a step. Then it dots the row with each real token's hidden row
// (lanes stride over H in 16-byte vectors, float32, a butterfly sum) and lane 0 stores the logit.
// The last block to take a ticket (after a __threadfence, so every logit is visible to it) routes
// token t with warp t % 8 and sorts the assignments; its shared memory serves the general
// router's per-warp scratch first and the sort's histograms after.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/plan_sort.cuh"
#include "backend/cuda/route_plan.h"
#include "backend/cuda/router_kernel.cuh"

namespace moeinfer::cuda {

inline constexpr int kRoutePlanWarps = 8;
inline constexpr int kRoutePlanThreads = kRoutePlanWarps * device::kWarpSize;

namespace route_plan {

__device__ __forceinline__ int valid_tokens(const RouterParams& r) {
  const int T = static_cast<int>(r.num_tokens);
  return r.num_valid_tokens == nullptr ? T : min(max(*r.num_valid_tokens, 0), T);
}

}  // namespace route_plan

template <int kPerLane, bool kGeneral>
__global__ void __launch_bounds__(kRoutePlanThreads)
    moe_route_plan_kernel(const __grid_constant__ RoutePlanParams p) {
  extern __shared__ __align__(16) int32_t route_plan_smem[];
  __shared__ bool last_block;
  const int lane = threadIdx.x % device::kWarpSize, warp = threadIdx.x / device::kWarpSize;
  const int E = static_cast<int>(p.route.num_experts);
  const int row = static_cast<int>(blockIdx.x) * kRoutePlanWarps + warp;
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const uint4* w = reinterpret_cast<const uint4*>(p.router) + static_cast<int64_t>(row) * vecs;
  if (row < E) device::prefetch_to_l2(w, int64_t{vecs} * 16, lane);
  device::start_after_previous_grid();  // hidden and num_valid_tokens: earlier kernels' output
  // Tokens past num_valid_tokens pad a graph bucket: no logits (the router gives them the null
  // expert without reading any).
  const int num_valid = route_plan::valid_tokens(p.route);
  if (row < E) {
    for (int t = 0; t < num_valid; ++t) {
      const uint4* x = reinterpret_cast<const uint4*>(p.hidden) + static_cast<int64_t>(t) * vecs;
      float partial = 0.0f;
      for (int v = lane; v < vecs; v += device::kWarpSize) {
        partial += device::bf16x8_dot(__ldg(w + v), x[v]);
      }
      const float logit = device::warp_sum(partial);
      if (lane == 0) const_cast<float*>(p.route.logits)[static_cast<int64_t>(t) * E + row] = logit;
    }
  }

  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last_block = atomicAdd(p.ticket, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();  // the other blocks' logits, seen through their fences

  const int T = static_cast<int>(p.route.num_tokens);
  for (int t = warp; t < T; t += kRoutePlanWarps) {
    if constexpr (kGeneral) {
      auto* scratch = reinterpret_cast<RouterWarpScratch<kPerLane>*>(route_plan_smem);
      route_token_general<kPerLane, true>(p.route, t, lane, scratch[warp]);
    } else {
      route_token_plain<kPerLane, true>(p.route, t, lane);
    }
  }
  __syncthreads();  // the ids, written by this block, are visible to all of its threads
  plan_sort_block</*kMultiBlock=*/false, /*kCoherentIds=*/true>(
      p.plan, static_cast<int>(p.plan.num_assignments), /*block=*/0, route_plan_smem);
  if (threadIdx.x == 0) *p.ticket = 0;
}

}  // namespace moeinfer::cuda
