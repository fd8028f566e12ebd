// Launchers of permute (dispatch on one device) and unpermute (permute_kernel.cuh): one warp
// per row, grids from the host-known row counts.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/permute_kernel.cuh"

namespace moeinfer::cuda {

void permute(const PermuteParams& params, cudaStream_t stream) {
  NvtxRange range("dispatch");
  detail::check_int32_range(params.num_tokens, "num_tokens");
  MOE_CHECK(params.top_k >= 1, "top_k = ", params.top_k, " must be at least 1");
  detail::check_int32_range(params.num_tokens * params.top_k, "num_tokens * top_k");
  detail::check_hidden_size(params.hidden_size);
  if (params.num_tokens == 0) return;
  detail::check_pointer(params.hidden, "hidden");
  detail::check_pointer(params.src_row, "src_row");
  detail::check_pointer(params.rows, "rows");
  detail::check_aligned16(params.hidden, "hidden");
  detail::check_aligned16(params.rows, "rows");
  const int64_t num_rows = params.num_tokens * params.top_k;
  const int64_t blocks = (num_rows + kPermuteWarpsPerBlock - 1) / kPermuteWarpsPerBlock;
  permute_kernel<<<static_cast<unsigned>(blocks), kPermuteWarpsPerBlock * device::kWarpSize, 0,
                   stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH();
}

void unpermute(const UnpermuteParams& params, cudaStream_t stream) {
  NvtxRange range("unpermute");
  detail::check_int32_range(params.num_tokens, "num_tokens");
  MOE_CHECK(params.top_k >= 1 && params.top_k <= kUnpermuteMaxTopK, "top_k = ", params.top_k,
            " must be in [1, ", kUnpermuteMaxTopK, "]");
  detail::check_int32_range(params.num_tokens * params.top_k, "num_tokens * top_k");
  detail::check_hidden_size(params.hidden_size);
  if (params.num_tokens == 0) return;
  detail::check_pointer(params.expert_out, "expert_out");
  detail::check_pointer(params.topk_weights, "topk_weights");
  detail::check_pointer(params.inverse, "inverse");
  detail::check_pointer(params.out, "out");
  detail::check_aligned16(params.expert_out, "expert_out");
  detail::check_aligned16(params.out, "out");
  if (params.shared) detail::check_aligned16(params.shared, "shared");
  if (params.residual) detail::check_aligned16(params.residual, "residual");
  const int64_t blocks =
      (params.num_tokens + kUnpermuteWarpsPerBlock - 1) / kUnpermuteWarpsPerBlock;
  unpermute_kernel<<<static_cast<unsigned>(blocks), kUnpermuteWarpsPerBlock * device::kWarpSize, 0,
                     stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
