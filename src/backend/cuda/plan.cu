// Launcher of the plan kernel (plan_kernel.cuh): one block of up to 1024 threads, with as many
// warps as leave each warp's histogram row in the shared-memory budget.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/plan_kernel.cuh"

namespace moeinfer::cuda {

namespace {

// Shared memory above the 48 KB default needs an opt-in; 96 KB keeps two such blocks' worth
// free on any sm_80+ part.
constexpr size_t kPlanSharedBudget = 96 * 1024;
constexpr size_t kDefaultSharedLimit = 48 * 1024;

int plan_warps(int64_t num_experts, int64_t num_assignments) {
  int warps = kPlanMaxThreads / device::kWarpSize;
  while (warps > 1 && plan_shared_bytes(warps, num_experts) > kPlanSharedBudget) warps /= 2;
  // No more warps than steps of 32 assignments: idle warps only cost the histogram scan.
  const int64_t steps = (num_assignments + device::kWarpSize - 1) / device::kWarpSize;
  while (warps > 1 && warps / 2 >= steps) warps /= 2;
  return warps;
}

}  // namespace

void moe_plan(const PlanParams& params, cudaStream_t stream) {
  NvtxRange range("plan");
  const int64_t E = params.num_experts;
  MOE_CHECK(E >= 1 && E <= kPlanMaxExperts, "num_experts = ", E, " must be in [1, ",
            kPlanMaxExperts, "]");
  detail::check_int32_range(params.num_assignments, "num_assignments");
  detail::check_pointer(params.expert_counts, "expert_counts");
  detail::check_pointer(params.expert_offsets, "expert_offsets");
  if (params.num_assignments > 0) {
    detail::check_pointer(params.topk_ids, "topk_ids");
    detail::check_pointer(params.src_row, "src_row");
    detail::check_pointer(params.inverse, "inverse");
  }
  const int warps = plan_warps(E, params.num_assignments);
  const size_t shared_bytes = plan_shared_bytes(warps, E);
  MOE_CHECK(shared_bytes <= kPlanSharedBudget, "num_experts = ", E, " needs ", shared_bytes,
            " bytes of shared memory, over the plan's budget of ", kPlanSharedBudget);
  if (shared_bytes > kDefaultSharedLimit) {
    CUDA_CHECK(cudaFuncSetAttribute(moe_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(shared_bytes)));
  }
  moe_plan_kernel<<<1, warps * device::kWarpSize, shared_bytes, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
