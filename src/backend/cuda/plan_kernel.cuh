// Plan: a stable counting sort of the T*K expert assignments by expert id, producing
// expert_counts [E], expert_offsets [E+1], src_row [T*K] and inverse [T*K] exactly as the CPU
// reference plan() does, in one kernel of one block, with nothing read back by the host.
//
// Why one block: T*K is at most tens of thousands (4096 tokens x 8 = 32768 assignments), a
// single block streams that in a few microseconds, and one block needs no grid-wide exchange of
// histograms (no second kernel, no atomics between blocks, no workspace in global memory).
//
// How it stays stable: warp w owns the contiguous chunk of assignments
// [w*chunk, (w+1)*chunk) and keeps its own histogram row hist[w][E] in shared memory.
//   1. Each warp counts its chunk into its row (shared atomics, no order needed).
//   2. For each expert, an exclusive scan down the warps turns the rows into per-warp starts;
//      the column totals are the expert counts, and a block scan over them gives the offsets.
//      hist[w][e] becomes offsets[e] + (assignments of e in warps before w): warp w's cursor.
//   3. Each warp walks its chunk again, 32 assignments per step in order. __match_any_sync
//      groups the lanes holding the same expert; a lane's rank is the number of its peers at
//      lower lanes, its sorted row cursor + rank, and the group's highest lane advances the
//      cursor by the group's size. Order within the chunk, then chunk order, then expert order:
//      the stable order of the reference.
#pragma once

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int kPlanMaxThreads = 1024;
inline constexpr int kPlanIdsPerLaneBatch = 8;  // ids loaded ahead per lane in step 3

// Shared memory of the plan kernel for `num_warps` warps: hist [W, E] then scan scratch
// [E + 1] then per-warp sums [32].
inline constexpr size_t plan_shared_bytes(int64_t num_warps, int64_t num_experts) {
  return static_cast<size_t>(num_warps * num_experts + num_experts + 1 + 32) * sizeof(int32_t);
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

__global__ void __launch_bounds__(kPlanMaxThreads)
    moe_plan_kernel(const __grid_constant__ PlanParams p) {
  extern __shared__ int32_t plan_smem[];
  const int num_experts = static_cast<int>(p.num_experts);
  const int num_assignments = static_cast<int>(p.num_assignments);
  const int num_warps = blockDim.x / device::kWarpSize;
  const int warp = threadIdx.x / device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  int32_t* hist = plan_smem;                          // [W, E]
  int32_t* offsets = hist + num_warps * num_experts;  // [E + 1]
  int32_t* warp_sums = offsets + num_experts + 1;     // [32]
  int32_t* my_hist = hist + warp * num_experts;       // [E]

  for (int i = threadIdx.x; i < num_warps * num_experts; i += blockDim.x) hist[i] = 0;
  __syncthreads();

  // Chunks are whole steps of 32 so that only the last chunk has a partial step.
  const int steps_total = (num_assignments + device::kWarpSize - 1) / device::kWarpSize;
  const int steps_per_warp = (steps_total + num_warps - 1) / num_warps;
  const int begin = min(num_assignments, warp * steps_per_warp * device::kWarpSize);
  const int end = min(num_assignments, begin + steps_per_warp * device::kWarpSize);

  // 1. Count.
  for (int i = begin + lane; i < end; i += device::kWarpSize) {
    const int32_t expert = __ldg(p.topk_ids + i);
    MOE_DEVICE_CHECK(expert >= 0 && expert < num_experts);
    atomicAdd(my_hist + expert, 1);
  }
  __syncthreads();

  // 2. Per-expert exclusive scan down the warps; totals are the counts.
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < num_warps; ++w) {
      const int32_t count = hist[w * num_experts + e];
      hist[w * num_experts + e] = running;
      running += count;
    }
    offsets[e] = running;
    p.expert_counts[e] = running;
  }
  __syncthreads();
  const int32_t total = device::block_exclusive_scan(offsets, num_experts, warp_sums);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) p.expert_offsets[e] = offsets[e];
  if (threadIdx.x == 0) p.expert_offsets[num_experts] = total;
  for (int i = threadIdx.x; i < num_warps * num_experts; i += blockDim.x)
    hist[i] += offsets[i % num_experts];
  __syncthreads();

  // 3. Scatter in order. Ids are loaded a batch ahead so the loads overlap; the cursor update
  // of one step must land before the next step reads it, hence the __syncwarp pairs.
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = begin; base < end; base += kPlanIdsPerLaneBatch * device::kWarpSize) {
    int32_t expert[kPlanIdsPerLaneBatch];
#pragma unroll
    for (int u = 0; u < kPlanIdsPerLaneBatch; ++u) {
      const int i = base + u * device::kWarpSize + lane;
      expert[u] = i < end ? __ldg(p.topk_ids + i) : -1;
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
