// The route and plan stages of a small decode step in one launch: the router's logits, the
// top-k of fused_router and the stable sort of moe_plan.
//
// Why: at batch 1 the three stages are a router GEMV of E x H (256 KB for Qwen3-30B-A3B), a
// top-k over E logits and a sort of K assignments: each is a few microseconds of launch, ramp
// and tail around well under a microsecond of work, three times per MoE layer. Here the router
// rows spread over every block (a warp per row, dotting it with the T token rows), the block that
// finishes last (a ticket counter) routes the tokens with router_kernel.cuh's own per-token
// functions and then sorts the assignments with moe_plan's single-block sort (plan_sort.cuh).
// Its outputs are those of router GEMM + fused_router + moe_plan: the same picks, weights and
// plan for the same logits; the logits are float32 dot products of the bf16 rows, summed in
// another order than cuBLAS's (within float32 rounding of it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

// At most this many tokens and T*K assignments: the routing is one warp per token in one block,
// and the sort one block's.
inline constexpr int64_t kRoutePlanMaxTokens = 64;
inline constexpr int64_t kRoutePlanMaxAssignments = 1024;

struct RoutePlanParams {
  const bf16* hidden = nullptr;  // [T, H] the normed rows
  const bf16* router = nullptr;  // [E, H] one bf16 term
  int64_t hidden_size = 0;       // H, a multiple of 8
  // route.logits is written here ([T, E] float32: the products, before any bias), then routed as
  // fused_router routes (num_tokens, num_experts, top_k, num_valid_tokens, noise and biases from
  // here).
  RouterParams route;
  // The plan over E + 1 experts (padding tokens sort past every real expert): expert_counts
  // [E + 1], expert_offsets [E + 2], src_row and inverse [T*K]. Its topk_ids, num_assignments and
  // num_experts are set by the launcher from route; workspace is unused.
  PlanParams plan;
  // One int32 in device memory, zero before the first launch; each launch leaves it zero.
  int32_t* ticket = nullptr;
};

// Whether one launch takes these sizes: T <= kRoutePlanMaxTokens, T*K <=
// kRoutePlanMaxAssignments, E within the one-warp router's range (E <= kRouterWarpMaxExperts,
// K <= kRouterWarpMaxTopK), H a positive multiple of 8.
bool route_plan_supports(int64_t num_tokens, int64_t num_experts, int64_t top_k,
                         int64_t hidden_size);

// route + plan in one launch, a programmatic dependent of the kernel before it (hidden is its
// output); graph-capturable, nothing read back. Refuses (MOE_CHECK) sizes route_plan_supports
// rejects, and the checks of fused_router.
void moe_route_plan(const RoutePlanParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
