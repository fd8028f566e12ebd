// The single-block core of the plan (plan_kernel.cuh explains the sort): a stable counting sort
// of assignments by expert id in one block, with per-warp histograms in shared memory. Kernels
// are not defined here, so that more than one translation unit may run the sort: moe_plan's
// kernels (plan_kernel.cuh, plan.cu) and the fused route-and-plan kernel (route_plan_kernel.cuh).
#pragma once

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int kPlanMaxThreads = 1024;
inline constexpr int kPlanIdsPerLaneBatch = 8;  // ids loaded ahead per lane in step 3
inline constexpr int64_t kPlanMaxBlocks = 128;  // multi-block path: histograms each block reads
inline constexpr int64_t kPlanMinChunk = 1024;  // multi-block path: assignments per block, least

// Shared memory of moe_plan_kernel for `num_warps` warps: hist [W, E], offsets [E + 1],
// earlier-block counts [E], per-warp sums [32].
inline constexpr size_t plan_shared_bytes(int64_t num_warps, int64_t num_experts) {
  return static_cast<size_t>(num_warps * num_experts + 2 * num_experts + 1 + 32) * sizeof(int32_t);
}

namespace device {

// Exclusive scan of data[0, n) in place by the whole block; returns the total to every thread.
// warp_sums: 32 ints of shared scratch. Needs blockDim.x <= 1024 and a multiple of 32.
__device__ inline int32_t block_exclusive_scan(int32_t* data, int n, int32_t* warp_sums) {
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, tid * per_thread);
  const int end = min(n, begin + per_thread);
  int32_t local = 0;
  for (int i = begin; i < end; ++i) local += data[i];
  int32_t inclusive = local;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const int32_t other = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int32_t sum = lane < num_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
      const int32_t other = __shfl_up_sync(kFullMask, sum, offset);
      if (lane >= offset) sum += other;
    }
    warp_sums[lane] = sum;  // inclusive over warps
  }
  __syncthreads();
  int32_t running = inclusive - local + (warp > 0 ? warp_sums[warp - 1] : 0);
  for (int i = begin; i < end; ++i) {
    const int32_t value = data[i];
    data[i] = running;
    running += value;
  }
  const int32_t total = warp_sums[num_warps - 1];
  __syncthreads();
  return total;
}

}  // namespace device

// Sorts block b's chunk [b*chunk, (b+1)*chunk) into place. kMultiBlock: the expert totals and
// the counts of earlier blocks come from the histograms in p.workspace; otherwise there is one
// block (b = 0) and its own counts are the totals. Block 0 writes expert_counts and
// expert_offsets. Shared memory: plan_shared_bytes(blockDim.x / 32, E) at plan_smem.
//
// moe_plan_kernel runs it as block blockIdx.x; the fused route-and-plan kernel
// (route_plan_kernel.cuh) runs it as block 0 in whichever block finishes last, over ids that
// block's threads have just written: kCoherentIds reads them with plain loads instead of the
// read-only path.
template <bool kMultiBlock, bool kCoherentIds = false>
__device__ inline void plan_sort_block(const PlanParams& p, int chunk, int block,
                                       int32_t* plan_smem) {
  const auto load_id = [&p](int i) {
    if constexpr (kCoherentIds) {
      return p.topk_ids[i];
    } else {
      return __ldg(p.topk_ids + i);
    }
  };
  const int num_experts = static_cast<int>(p.num_experts);
  const int num_assignments = static_cast<int>(p.num_assignments);
  const int num_warps = blockDim.x / device::kWarpSize;
  const int warp = threadIdx.x / device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  int32_t* hist = plan_smem;                          // [W, E]
  int32_t* offsets = hist + num_warps * num_experts;  // [E + 1]
  int32_t* earlier = offsets + num_experts + 1;       // [E] counts in blocks before this one
  int32_t* warp_sums = earlier + num_experts;         // [32]
  int32_t* my_hist = hist + warp * num_experts;       // [E]

  for (int i = threadIdx.x; i < num_warps * num_experts; i += blockDim.x) hist[i] = 0;
  __syncthreads();

  // The block's chunk, split into whole steps of 32 per warp so that only the last warp with
  // work has a partial step.
  const int chunk_begin = min(num_assignments, block * chunk);
  const int chunk_end = min(num_assignments, chunk_begin + chunk);
  const int steps_total = (chunk_end - chunk_begin + device::kWarpSize - 1) / device::kWarpSize;
  const int steps_per_warp = (steps_total + num_warps - 1) / num_warps;
  const int begin = min(chunk_end, chunk_begin + warp * steps_per_warp * device::kWarpSize);
  const int end = min(chunk_end, begin + steps_per_warp * device::kWarpSize);

  // 1. Count.
  for (int i = begin + lane; i < end; i += device::kWarpSize) {
    const int32_t expert = load_id(i);
    MOE_DEVICE_CHECK(expert >= 0 && expert < num_experts);
    atomicAdd(my_hist + expert, 1);
  }
  __syncthreads();

  // 2. Per-expert exclusive scan down the warps, then the expert totals.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int32_t count = hist[w * num_experts + e];
      hist[w * num_experts + e] = running;
      running += count;
    }
    if constexpr (kMultiBlock) {
      int32_t before = 0;
      int32_t total = 0;
      const int num_blocks = gridDim.x;
      for (int b = 0; b < num_blocks; ++b) {
        const int32_t count = p.workspace[static_cast<int64_t>(b) * num_experts + e];
        before += b < block ? count : 0;
        total += count;
      }
      earlier[e] = before;
      offsets[e] = total;
    } else {
      earlier[e] = 0;
      offsets[e] = running;
    }
    if (block == 0) p.expert_counts[e] = offsets[e];
  }
  __syncthreads();
  const int32_t total = device::block_exclusive_scan(offsets, num_experts, warp_sums);
  if (block == 0) {
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) p.expert_offsets[e] = offsets[e];
    if (threadIdx.x == 0) p.expert_offsets[num_experts] = total;
  }
  for (int i = threadIdx.x; i < num_warps * num_experts; i += blockDim.x) {
    const int e = i % num_experts;
    hist[i] += offsets[e] + earlier[e];
  }
  __syncthreads();

  // 3. Scatter in order. Ids are loaded a batch ahead so the loads overlap; the cursor update
  // of one step must land before the next step reads it, hence the __syncwarp pairs.
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = begin; base < end; base += kPlanIdsPerLaneBatch * device::kWarpSize) {
    int32_t expert[kPlanIdsPerLaneBatch];
#pragma unroll
    for (int u = 0; u < kPlanIdsPerLaneBatch; ++u) {
      const int i = base + u * device::kWarpSize + lane;
      expert[u] = i < end ? load_id(i) : -1;
    }
#pragma unroll
    for (int u = 0; u < kPlanIdsPerLaneBatch; ++u) {
      const int i = base + u * device::kWarpSize + lane;
      if (base + u * device::kWarpSize >= end) break;  // uniform across the warp
      const unsigned peers = __match_any_sync(device::kFullMask, expert[u]);
      int32_t row = 0;
      if (i < end) {
        row = my_hist[expert[u]] + __popc(peers & lanes_below);
        p.src_row[row] = i;
        p.inverse[i] = row;
      }
      __syncwarp();
      const int leader = 31 - __clz(peers);
      if (i < end && lane == leader) my_hist[expert[u]] = row + 1;
      __syncwarp();
    }
  }
}

}  // namespace moeinfer::cuda
