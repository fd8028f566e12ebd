// Launcher of the fused router (router_kernel.cuh): checks the arguments, picks the
// instantiation whose per-lane register array covers E, and launches one warp per token.
#include <cmath>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/router_kernel.cuh"

namespace moeinfer::cuda {

template <int kPerLane>
static void launch_router(const RouterParams& params, cudaStream_t stream) {
  const int64_t blocks = (params.num_tokens + kRouterWarpsPerBlock - 1) / kRouterWarpsPerBlock;
  fused_router_kernel<kPerLane>
      <<<static_cast<unsigned>(blocks), kRouterWarpsPerBlock * device::kWarpSize, 0, stream>>>(
          params);
  MOE_CUDA_CHECK_LAUNCH();
}

void fused_router(const RouterParams& params, cudaStream_t stream) {
  NvtxRange range("route");
  const int64_t E = params.num_experts;
  const int64_t K = params.top_k;
  MOE_CHECK(E >= 1 && E <= kRouterMaxExperts, "num_experts = ", E, " must be in [1, ",
            kRouterMaxExperts, "]");
  MOE_CHECK(K >= 1 && K <= kRouterMaxTopK && K <= E, "top_k = ", K, " must be in [1, min(",
            kRouterMaxTopK, ", num_experts = ", E, ")]");
  MOE_CHECK(params.num_tokens >= 0 && params.num_tokens <= (int64_t{1} << 31) - 1,
            "num_tokens = ", params.num_tokens, " is outside [0, 2^31)");
  MOE_CHECK(params.score == RouterScore::kSoftmax || params.score == RouterScore::kSigmoid,
            "score function ", static_cast<int>(params.score), " is not softmax or sigmoid");
  MOE_CHECK(std::isfinite(params.routed_scaling_factor),
            "routed_scaling_factor = ", params.routed_scaling_factor, " is not finite");
  if (params.num_tokens == 0) return;
  detail::check_pointer(params.logits, "logits");
  detail::check_pointer(params.topk_ids, "topk_ids");
  detail::check_pointer(params.topk_weights, "topk_weights");
  if (E <= 32) {
    launch_router<1>(params, stream);
  } else if (E <= 64) {
    launch_router<2>(params, stream);
  } else if (E <= 128) {
    launch_router<4>(params, stream);
  } else {
    launch_router<8>(params, stream);
  }
}

}  // namespace moeinfer::cuda
