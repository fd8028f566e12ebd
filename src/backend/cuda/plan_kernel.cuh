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
