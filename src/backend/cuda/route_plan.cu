// Launcher of the fused route-and-plan kernel (route_plan_kernel.cuh): checks the sizes and
// pointers, then launches the instantiation whose per-lane logits cover E, plain or general
// routing as fused_router chooses, with shared memory for the larger of the router's scratch and
// the sort's histograms.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/programmatic_launch.h"
#include "backend/cuda/route_plan.h"
#include "backend/cuda/route_plan_kernel.cuh"

namespace moeinfer::cuda {

namespace {

constexpr size_t kDefaultSharedLimit = 48 * 1024;

template <int kPerLane, bool kGeneral>
void launch(const RoutePlanParams& p, cudaStream_t stream) {
  const size_t scratch =
      kGeneral ? kRoutePlanWarps * sizeof(RouterWarpScratch<kPerLane>) : size_t{0};
  const size_t sort = plan_shared_bytes(kRoutePlanWarps, p.plan.num_experts);
  const size_t bytes = std::max(scratch, sort);
  if (bytes > kDefaultSharedLimit) {
    CUDA_CHECK(cudaFuncSetAttribute(moe_route_plan_kernel<kPerLane, kGeneral>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(bytes)));
  }
  const int64_t blocks = (p.route.num_experts + kRoutePlanWarps - 1) / kRoutePlanWarps;
  launch_after_previous(moe_route_plan_kernel<kPerLane, kGeneral>, static_cast<unsigned>(blocks),
                        kRoutePlanThreads, bytes, stream, p);
  MOE_CUDA_CHECK_LAUNCH();
}

template <bool kGeneral>
void launch_for_experts(const RoutePlanParams& p, cudaStream_t stream) {
  with_router_lanes(p.route.num_experts,
                    [&](auto per_lane) { launch<decltype(per_lane)::value, kGeneral>(p, stream); });
}

}  // namespace

bool route_plan_supports(int64_t num_tokens, int64_t num_experts, int64_t top_k,
                         int64_t hidden_size) {
  return num_tokens >= 0 && num_tokens <= kRoutePlanMaxTokens && top_k >= 1 &&
         top_k <= kRouterWarpMaxTopK && num_experts >= top_k &&
         num_experts <= kRouterWarpMaxExperts && num_tokens * top_k <= kRoutePlanMaxAssignments &&
         hidden_size > 0 && hidden_size % device::kBf16PerVec == 0;
}

void moe_route_plan(const RoutePlanParams& params, cudaStream_t stream) {
  NvtxRange range("route_plan");
  const RouterParams& route = params.route;
  const int64_t T = route.num_tokens, E = route.num_experts, K = route.top_k;
  detail::check_router_params(route);
  MOE_CHECK(route_plan_supports(T, E, K, params.hidden_size),
            "the fused route and plan do not take T = ", T, ", E = ", E, ", K = ", K,
            ", hidden_size = ", params.hidden_size, " (T <= ", kRoutePlanMaxTokens,
            ", T*K <= ", kRoutePlanMaxAssignments, ", E <= ", kRouterWarpMaxExperts,
            ", K <= ", kRouterWarpMaxTopK, ", hidden_size a positive multiple of 8)");
  if (T == 0) return;
  const struct {
    const void* pointer;
    const char* name;
  } vectors[] = {{params.hidden, "hidden"}, {params.router, "router"}};
  for (const auto& v : vectors) {
    detail::check_pointer(v.pointer, v.name);
    detail::check_aligned16(v.pointer, v.name);
  }
  detail::check_pointer(route.logits, "route.logits");
  detail::check_pointer(route.topk_ids, "route.topk_ids");
  detail::check_pointer(route.topk_weights, "route.topk_weights");
  detail::check_pointer(params.plan.expert_counts, "plan.expert_counts");
  detail::check_pointer(params.plan.expert_offsets, "plan.expert_offsets");
  detail::check_pointer(params.plan.src_row, "plan.src_row");
  detail::check_pointer(params.plan.inverse, "plan.inverse");
  detail::check_pointer(params.ticket, "ticket");
  RoutePlanParams p = params;
  p.plan.topk_ids = route.topk_ids;
  p.plan.num_assignments = T * K;
  p.plan.num_experts = E + 1;  // the null expert E takes the padding tokens' picks
  const bool plain =
      route.selection_bias == nullptr && route.group_score == RouterGroupScore::kNone;
  if (plain) {
    launch_for_experts<false>(p, stream);
  } else {
    launch_for_experts<true>(p, stream);
  }
}

}  // namespace moeinfer::cuda
