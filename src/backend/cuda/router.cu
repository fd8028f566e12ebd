// Launcher of the fused router: checks the arguments (the grouping ones as moe::validate()
// does). Within the one-warp router's range (router_kernel.cuh) it picks the plain kernel when
// there is neither a selection bias nor grouping and the general one otherwise, with the
// instantiation whose per-lane register array covers E, and launches one warp per token; past
// it, the block router (router_block_kernel.cuh), one block per token, with the group scores and
// choices in shared memory as far as they fit.
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/programmatic_launch.h"
#include "backend/cuda/router_block_kernel.cuh"
#include "backend/cuda/router_kernel.cuh"

namespace moeinfer::cuda {

template <int kPerLane>
static void launch_router(const RouterParams& params, bool plain, cudaStream_t stream) {
  const int64_t blocks = (params.num_tokens + kRouterWarpsPerBlock - 1) / kRouterWarpsPerBlock;
  const unsigned threads = kRouterWarpsPerBlock * device::kWarpSize;
  if (plain) {
    launch_after_previous(fused_router_kernel<kPerLane>, static_cast<unsigned>(blocks), threads, 0,
                          stream, params);
  } else {
    launch_after_previous(fused_router_general_kernel<kPerLane>, static_cast<unsigned>(blocks),
                          threads, 0, stream, params);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

// One block per token. The group scores are cached first (every group-kept test reads them),
// then the choices if they fit beside them.
static void launch_router_block(const RouterParams& params, cudaStream_t stream) {
  const int64_t G = params.group_score == RouterGroupScore::kNone ? 0 : params.num_groups;
  RouterBlockCache cache;
  int64_t bytes = 0;
  if (G > 0 && G * static_cast<int64_t>(sizeof(float)) <= kRouterBlockCacheBytes) {
    cache.group_scores = true;
    bytes += G * static_cast<int64_t>(sizeof(float));
  }
  const int64_t choice_bytes = params.num_experts * static_cast<int64_t>(sizeof(float));
  if (bytes + choice_bytes <= kRouterBlockCacheBytes) {
    cache.choices = true;
    bytes += choice_bytes;
  }
  launch_after_previous(fused_router_block_kernel<kRouterBlockThreads>,
                        static_cast<unsigned>(params.num_tokens), kRouterBlockThreads,
                        static_cast<size_t>(bytes), stream, params, cache);
  MOE_CUDA_CHECK_LAUNCH();
}

// The grouping invariants of moe::validate(), naming the RouterParams field.
static void check_groups(const RouterParams& params) {
  const int64_t E = params.num_experts;
  const int64_t K = params.top_k;
  MOE_CHECK(params.group_score == RouterGroupScore::kNone ||
                params.group_score == RouterGroupScore::kMax ||
                params.group_score == RouterGroupScore::kTop2Sum,
            "group_score = ", static_cast<int>(params.group_score),
            " is not kNone, kMax or kTop2Sum");
  if (params.group_score == RouterGroupScore::kNone) return;  // the group sizes are unused
  const int64_t G = params.num_groups;
  MOE_CHECK(G >= 1 && G <= E && E % G == 0, "num_groups = ", G, " must divide num_experts = ", E);
  MOE_CHECK(params.topk_groups >= 1 && params.topk_groups <= G,
            "topk_groups = ", params.topk_groups, " must be in [1, num_groups = ", G, "]");
  MOE_CHECK(params.topk_groups * (E / G) >= K, "topk_groups = ", params.topk_groups, " groups of ",
            E / G, " experts cannot supply top_k = ", K, " experts");
  MOE_CHECK(params.group_score != RouterGroupScore::kTop2Sum || E / G >= 2,
            "group_score kTop2Sum needs at least 2 experts per group; num_groups = ", G, " leaves ",
            E / G, " of num_experts = ", E);
}

namespace detail {

void check_router_params(const RouterParams& params) {
  const int64_t E = params.num_experts;
  const int64_t K = params.top_k;
  MOE_CHECK(E >= 1 && E <= kMaxExperts, "num_experts = ", E, " must be in [1, ", kMaxExperts,
            "] (int32 expert ids)");
  MOE_CHECK(K >= 1 && K <= E, "top_k = ", K, " must be in [1, num_experts = ", E, "]");
  MOE_CHECK(params.num_tokens >= 0 && params.num_tokens <= (int64_t{1} << 31) - 1,
            "num_tokens = ", params.num_tokens, " is outside [0, 2^31)");
  MOE_CHECK(params.score == RouterScore::kSoftmax || params.score == RouterScore::kSigmoid ||
                params.score == RouterScore::kTopkSoftmax,
            "score function ", static_cast<int>(params.score),
            " is not softmax, sigmoid or top-k softmax");
  MOE_CHECK(std::isfinite(params.routed_scaling_factor),
            "routed_scaling_factor = ", params.routed_scaling_factor, " is not finite");
  check_groups(params);
}

}  // namespace detail

void fused_router(const RouterParams& params, cudaStream_t stream) {
  NvtxRange range("route");
  const int64_t E = params.num_experts;
  detail::check_router_params(params);
  if (params.num_tokens == 0) return;
  detail::check_pointer(params.logits, "logits");
  detail::check_pointer(params.topk_ids, "topk_ids");
  detail::check_pointer(params.topk_weights, "topk_weights");
  if (E > kRouterWarpMaxExperts || params.top_k > kRouterWarpMaxTopK) {
    launch_router_block(params, stream);
    return;
  }
  const bool plain =
      params.selection_bias == nullptr && params.group_score == RouterGroupScore::kNone;
  with_router_lanes(
      E, [&](auto per_lane) { launch_router<decltype(per_lane)::value>(params, plain, stream); });
}

}  // namespace moeinfer::cuda
