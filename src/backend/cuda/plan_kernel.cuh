// Plan: a stable counting sort of the T*K expert assignments by expert id, producing
// expert_counts [E], expert_offsets [E+1], src_row [T*K] and inverse [T*K] exactly as the CPU
// reference plan() does, with nothing read back by the host.
//
// Two paths, one kernel template:
// - up to kPlanSingleBlockMax assignments (decode), one kernel of one block: no grid-wide
//   exchange, no workspace, one launch;
// - above it (prefill), moe_plan_count_kernel writes each block's histogram of its chunk to the
//   workspace [B, E], then moe_plan_kernel<true> runs B blocks, each reading the B histograms
//   to get the expert totals (hence the offsets) and the counts of the blocks before it.
//   One block streaming 32768 assignments took 43 us on an H200 (its scattered stores all go
//   through one SM); B blocks share that.
//
// How a block stays stable: warp w owns the contiguous sub-chunk [w*sub, (w+1)*sub) of the
// block's chunk and keeps its own histogram row hist[w][E] in shared memory.
//   1. Each warp counts its sub-chunk into its row (shared atomics, no order needed).
//   2. For each expert, an exclusive scan down the warps turns the rows into per-warp starts;
//      the column totals (single block) or the sums over all blocks' histograms (multi-block)
//      are the expert counts, and a block scan over them gives the offsets. hist[w][e] becomes
//      offsets[e] + (assignments of e in earlier blocks) + (in earlier warps): warp w's cursor.
//   3. Each warp walks its sub-chunk again, 32 assignments per step in order.
//      __match_any_sync groups the lanes holding the same expert; a lane's rank is the number
//      of its peers at lower lanes, its sorted row cursor + rank, and the group's highest lane
//      advances the cursor by the group's size. Order within a sub-chunk, then sub-chunk order,
//      then block order, then expert order: the stable order of the reference.
//
// Past kPlanMaxSharedExperts the per-warp rows no longer fit in shared memory, so the same sort
// runs with one histogram row per block in the workspace [B, E] and one warp per block walking
// its chunk (an order kept by one warp needs no per-warp rows), in five kernels of plain loops:
//   moe_plan_large_count_kernel    block b zeroes row b and counts its chunk into it (atomics:
//                                  counts need no order);
//   moe_plan_large_totals_kernel   per expert: the sum of the B rows -> expert_counts, and
//                                  expert_offsets as the scan's input;
//   moe_plan_large_scan_kernel     one block: exclusive scan of expert_offsets in place, the
//                                  total at expert_offsets[E];
//   moe_plan_large_cursors_kernel  per expert: row b becomes offsets[e] + the counts of the
//                                  blocks before b, block b's cursor of expert e;
//   moe_plan_large_scatter_kernel  block b, one warp, walks its chunk 32 assignments at a time as
//                                  step 3 does, its cursors in row b.
// These shapes are rare (no published model has more than 512 experts): plain loops, correct
// first.
#pragma once

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/plan_sort.cuh"

namespace moeinfer::cuda {

// Multi-block path, first kernel: block b counts assignments [b*chunk, (b+1)*chunk) into
// block_hist[b][E]. Shared memory: E ints.
__global__ void __launch_bounds__(kPlanMaxThreads)
    moe_plan_count_kernel(const __grid_constant__ PlanParams p, int chunk) {
  device::start_after_previous_grid();     // launched by launch_after_previous()
  extern __shared__ int32_t count_smem[];  // [E]
  const int num_experts = static_cast<int>(p.num_experts);
  const int num_assignments = static_cast<int>(p.num_assignments);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count_smem[e] = 0;
  __syncthreads();
  const int begin = min(num_assignments, static_cast<int>(blockIdx.x) * chunk);
  const int end = min(num_assignments, begin + chunk);
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t expert = __ldg(p.topk_ids + i);
    MOE_DEVICE_CHECK(expert >= 0 && expert < num_experts);
    atomicAdd(count_smem + expert, 1);
  }
  __syncthreads();
  int32_t* block_hist = p.workspace + static_cast<int64_t>(blockIdx.x) * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) block_hist[e] = count_smem[e];
}

template <bool kMultiBlock>
__global__ void __launch_bounds__(kPlanMaxThreads)
    moe_plan_kernel(const __grid_constant__ PlanParams p, int chunk) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  extern __shared__ int32_t plan_smem[];
  plan_sort_block<kMultiBlock>(p, chunk, static_cast<int>(blockIdx.x), plan_smem);
}

// Large-E path (see the file comment). E <= kMaxExperts and B <= kPlanMaxBlocks: the workspace
// indices b * E + e are int64, everything else fits int.
inline constexpr int kPlanLargeThreads = 256;

__global__ void __launch_bounds__(kPlanLargeThreads)
    moe_plan_large_count_kernel(const __grid_constant__ PlanParams p, int chunk) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int num_experts = static_cast<int>(p.num_experts);
  const int num_assignments = static_cast<int>(p.num_assignments);
  int32_t* const hist = p.workspace + static_cast<int64_t>(blockIdx.x) * num_experts;  // [E]
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();  // zeroed before any thread of the block counts
  const int begin = min(num_assignments, static_cast<int>(blockIdx.x) * chunk);
  const int end = min(num_assignments, begin + chunk);
  for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const int32_t expert = __ldg(p.topk_ids + i);
    MOE_DEVICE_CHECK(expert >= 0 && expert < num_experts);
    atomicAdd(hist + expert, 1);
  }
}

__global__ void __launch_bounds__(kPlanLargeThreads)
    moe_plan_large_totals_kernel(const __grid_constant__ PlanParams p, int num_blocks) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int64_t E = p.num_experts;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < E;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t total = 0;
    for (int b = 0; b < num_blocks; ++b) total += p.workspace[b * E + e];
    p.expert_counts[e] = total;
    p.expert_offsets[e] = total;
  }
}

// One block of kPlanMaxThreads.
__global__ void __launch_bounds__(kPlanMaxThreads)
    moe_plan_large_scan_kernel(const __grid_constant__ PlanParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  __shared__ int32_t warp_sums[32];
  const int num_experts = static_cast<int>(p.num_experts);
  const int32_t total = device::block_exclusive_scan(p.expert_offsets, num_experts, warp_sums);
  if (threadIdx.x == 0) p.expert_offsets[num_experts] = total;
}

__global__ void __launch_bounds__(kPlanLargeThreads)
    moe_plan_large_cursors_kernel(const __grid_constant__ PlanParams p, int num_blocks) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int64_t E = p.num_experts;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < E;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int32_t running = p.expert_offsets[e];
    for (int b = 0; b < num_blocks; ++b) {
      const int32_t count = p.workspace[b * E + e];
      p.workspace[b * E + e] = running;
      running += count;
    }
  }
}

// One warp per block: block b sorts its chunk [b*chunk, (b+1)*chunk) into place, in order.
__global__ void __launch_bounds__(device::kWarpSize)
    moe_plan_large_scatter_kernel(const __grid_constant__ PlanParams p, int chunk) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int num_assignments = static_cast<int>(p.num_assignments);
  const int lane = threadIdx.x;
  int32_t* const cursor = p.workspace + static_cast<int64_t>(blockIdx.x) * p.num_experts;  // [E]
  const int begin = min(num_assignments, static_cast<int>(blockIdx.x) * chunk);
  const int end = min(num_assignments, begin + chunk);
  const unsigned lanes_below = (1u << lane) - 1u;
  for (int base = begin; base < end; base += device::kWarpSize) {
    const int i = base + lane;
    const int32_t expert = i < end ? __ldg(p.topk_ids + i) : -1;
    // Lanes holding the same expert take consecutive rows in lane order, and the group's highest
    // lane advances the cursor past them. The count kernel range-checked the ids.
    const unsigned peers = __match_any_sync(device::kFullMask, expert);
    int32_t row = 0;
    if (i < end) {
      row = cursor[expert] + __popc(peers & lanes_below);
      p.src_row[row] = i;
      p.inverse[i] = row;
    }
    __syncwarp();  // every peer has read the cursor
    if (i < end && lane == 31 - __clz(peers)) cursor[expert] = row + 1;
    __syncwarp();  // the next step reads the advanced cursors
  }
}

}  // namespace moeinfer::cuda
