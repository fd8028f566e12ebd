// Launcher of the plan kernels (plan_kernel.cuh). Up to kPlanSingleBlockMax assignments: one
// block. Above: a counting kernel and a scatter kernel over B blocks of at least kPlanMinChunk
// assignments each, B <= kPlanMaxBlocks, their histograms in the caller's workspace. Each
// block gets as many warps as leave its per-warp histogram rows in the shared-memory budget.
// Past kPlanMaxSharedExperts: the large-E kernels over B blocks (B >= 1, fewer when B * E ints
// would pass kPlanLargeWorkspaceInts), their histograms in the workspace.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/plan_kernel.cuh"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {

namespace {

// Shared memory above the 48 KB default needs an opt-in; 96 KB leaves room for two blocks per
// SM on any sm_80+ part.
constexpr size_t kPlanSharedBudget = 96 * 1024;
constexpr size_t kDefaultSharedLimit = 48 * 1024;
static_assert(plan_shared_bytes(1, kPlanMaxSharedExperts) <= kPlanSharedBudget &&
                  plan_shared_bytes(1, kPlanMaxSharedExperts + 1) > kPlanSharedBudget,
              "kPlanMaxSharedExperts is the most experts one warp's histogram leaves room for");
// The large-E path's workspace: fewer blocks (longer chunks per warp) rather than more than
// 64 MiB of histograms.
constexpr int64_t kPlanLargeWorkspaceInts = int64_t{16} << 20;

bool plan_is_large(int64_t num_experts) { return num_experts > kPlanMaxSharedExperts; }

int64_t plan_chunk(int64_t num_assignments) {
  const int64_t per_block = (num_assignments + kPlanMaxBlocks - 1) / kPlanMaxBlocks;
  const int64_t chunk = std::max(kPlanMinChunk, per_block);
  return (chunk + device::kWarpSize - 1) / device::kWarpSize * device::kWarpSize;
}

int64_t plan_blocks(int64_t num_assignments) {
  if (num_assignments <= kPlanSingleBlockMax) return 1;
  const int64_t chunk = plan_chunk(num_assignments);
  return (num_assignments + chunk - 1) / chunk;
}

// The large-E path's chunk: kPlanMinChunk or more per block, as on the shared path, and at
// most kPlanLargeWorkspaceInts / E blocks (at least one).
int64_t plan_large_chunk(int64_t num_assignments, int64_t num_experts) {
  const int64_t max_blocks =
      std::clamp<int64_t>(kPlanLargeWorkspaceInts / num_experts, 1, kPlanMaxBlocks);
  const int64_t per_block = (num_assignments + max_blocks - 1) / max_blocks;
  const int64_t chunk = std::max(kPlanMinChunk, per_block);
  return (chunk + device::kWarpSize - 1) / device::kWarpSize * device::kWarpSize;
}

int64_t plan_large_blocks(int64_t num_assignments, int64_t num_experts) {
  const int64_t chunk = plan_large_chunk(num_assignments, num_experts);
  return std::max<int64_t>(1, (num_assignments + chunk - 1) / chunk);
}

int plan_warps(int64_t num_experts, int64_t chunk) {
  int warps = kPlanMaxThreads / device::kWarpSize;
  while (warps > 1 && plan_shared_bytes(warps, num_experts) > kPlanSharedBudget) warps /= 2;
  // No more warps than steps of 32 assignments: idle warps only cost the histogram scan.
  const int64_t steps = (chunk + device::kWarpSize - 1) / device::kWarpSize;
  while (warps > 1 && warps / 2 >= steps) warps /= 2;
  return warps;
}

template <typename Kernel>
void raise_shared_limit(Kernel kernel, size_t bytes) {
  if (bytes > kDefaultSharedLimit) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
  }
}

// Every kernel of the large-E path, in order. The per-expert kernels stride over E with at
// most 1024 blocks.
void launch_large_plan(const PlanParams& params, cudaStream_t stream) {
  const int64_t E = params.num_experts, N = params.num_assignments;
  const int64_t chunk = plan_large_chunk(N, E);
  const int blocks = static_cast<int>(plan_large_blocks(N, E));
  const unsigned expert_blocks = static_cast<unsigned>(
      std::min<int64_t>(1024, (E + kPlanLargeThreads - 1) / kPlanLargeThreads));
  launch_after_previous(moe_plan_large_count_kernel, blocks, kPlanLargeThreads, 0, stream, params,
                        static_cast<int>(chunk));
  MOE_CUDA_CHECK_LAUNCH();
  launch_after_previous(moe_plan_large_totals_kernel, expert_blocks, kPlanLargeThreads, 0, stream,
                        params, blocks);
  MOE_CUDA_CHECK_LAUNCH();
  launch_after_previous(moe_plan_large_scan_kernel, 1, kPlanMaxThreads, 0, stream, params);
  MOE_CUDA_CHECK_LAUNCH();
  launch_after_previous(moe_plan_large_cursors_kernel, expert_blocks, kPlanLargeThreads, 0, stream,
                        params, blocks);
  MOE_CUDA_CHECK_LAUNCH();
  launch_after_previous(moe_plan_large_scatter_kernel, blocks, device::kWarpSize, 0, stream, params,
                        static_cast<int>(chunk));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

// The block counts above are not monotone in the number of assignments (150000 assignments
// take 127 blocks of 1184, 131072 take 128 of 1024), and a caller sizes the workspace once for
// its largest step. So the size is a bound for every count up to num_assignments: no path runs
// more blocks than ceil(n / kPlanMinChunk) (chunks are at least that long) or than its cap.
int64_t plan_workspace_size(int64_t num_assignments, int64_t num_experts) {
  const int64_t most_blocks = (num_assignments + kPlanMinChunk - 1) / kPlanMinChunk;
  if (plan_is_large(num_experts)) {
    const int64_t cap =
        std::clamp<int64_t>(kPlanLargeWorkspaceInts / num_experts, 1, kPlanMaxBlocks);
    return std::clamp<int64_t>(most_blocks, 1, cap) * num_experts;
  }
  if (num_assignments <= kPlanSingleBlockMax) return 0;
  return std::min(most_blocks, kPlanMaxBlocks) * num_experts;
}

void moe_plan(const PlanParams& params, cudaStream_t stream) {
  NvtxRange range("plan");
  const int64_t E = params.num_experts;
  const int64_t N = params.num_assignments;
  MOE_CHECK(E >= 1 && E <= kMaxExperts, "num_experts = ", E, " must be in [1, ", kMaxExperts,
            "] (int32 expert ids)");
  detail::check_int32_range(N, "num_assignments");
  detail::check_pointer(params.expert_counts, "expert_counts");
  detail::check_pointer(params.expert_offsets, "expert_offsets");
  if (N > 0) {
    detail::check_pointer(params.topk_ids, "topk_ids");
    detail::check_pointer(params.src_row, "src_row");
    detail::check_pointer(params.inverse, "inverse");
  }
  if (plan_is_large(E)) {
    MOE_CHECK(params.workspace != nullptr, "workspace is null but ", E,
              " experts (past the shared-memory plan's ", kPlanMaxSharedExperts,
              ") need plan_workspace_size() = ", plan_workspace_size(N, E), " ints");
    launch_large_plan(params, stream);
    return;
  }
  const int64_t blocks = plan_blocks(N);
  const int64_t chunk = blocks > 1 ? plan_chunk(N) : std::max<int64_t>(N, 1);
  const int warps = plan_warps(E, chunk);
  const size_t shared_bytes = plan_shared_bytes(warps, E);
  MOE_CHECK(shared_bytes <= kPlanSharedBudget, "num_experts = ", E, " needs ", shared_bytes,
            " bytes of shared memory, over the plan's budget of ", kPlanSharedBudget);
  if (blocks == 1) {
    raise_shared_limit(moe_plan_kernel<false>, shared_bytes);
    launch_after_previous(moe_plan_kernel<false>, 1, warps * device::kWarpSize, shared_bytes,
                          stream, params, static_cast<int>(chunk));
    MOE_CUDA_CHECK_LAUNCH();
    return;
  }
  MOE_CHECK(params.workspace != nullptr, "workspace is null but ", N, " assignments over ", E,
            " experts need plan_workspace_size() = ", plan_workspace_size(N, E), " ints");
  const size_t count_bytes = static_cast<size_t>(E) * sizeof(int32_t);
  raise_shared_limit(moe_plan_count_kernel, count_bytes);
  launch_after_previous(moe_plan_count_kernel, static_cast<unsigned>(blocks), kPlanMaxThreads,
                        count_bytes, stream, params, static_cast<int>(chunk));
  MOE_CUDA_CHECK_LAUNCH();
  raise_shared_limit(moe_plan_kernel<true>, shared_bytes);
  launch_after_previous(moe_plan_kernel<true>, static_cast<unsigned>(blocks),
                        warps * device::kWarpSize, shared_bytes, stream, params,
                        static_cast<int>(chunk));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
