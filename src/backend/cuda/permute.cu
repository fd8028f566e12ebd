// Launchers of permute (dispatch on one device) and unpermute (permute_kernel.cuh): one thread
// per 16-byte vector of a token's row, grids from the host-known T and H.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/permute_kernel.cuh"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {

namespace {

// The kernels index vectors with 32-bit ints: T * H/8 must fit, and so must T*K (row ids).
void check_row_sizes(int64_t num_tokens, int64_t top_k, int64_t hidden_size) {
  detail::check_int32_range(num_tokens, "num_tokens");
  detail::check_hidden_size(hidden_size);
  detail::check_int32_range(num_tokens * top_k, "num_tokens * top_k");
  detail::check_int32_range(num_tokens * (hidden_size / device::kBf16PerVec),
                            "num_tokens * hidden_size / 8");
}

unsigned row_kernel_blocks(int64_t num_tokens, int64_t hidden_size) {
  const int64_t threads = num_tokens * (hidden_size / device::kBf16PerVec);
  return static_cast<unsigned>((threads + kRowKernelThreads - 1) / kRowKernelThreads);
}

}  // namespace

void permute(const PermuteParams& params, cudaStream_t stream) {
  NvtxRange range("dispatch");
  MOE_CHECK(params.top_k >= 1, "top_k = ", params.top_k, " must be at least 1");
  check_row_sizes(params.num_tokens, params.top_k, params.hidden_size);
  if (params.num_tokens == 0) return;
  detail::check_pointer(params.hidden, "hidden");
  detail::check_pointer(params.inverse, "inverse");
  detail::check_pointer(params.rows, "rows");
  detail::check_aligned16(params.hidden, "hidden");
  detail::check_aligned16(params.rows, "rows");
  launch_after_previous(permute_kernel, row_kernel_blocks(params.num_tokens, params.hidden_size),
                        kRowKernelThreads, 0, stream, params);
  MOE_CUDA_CHECK_LAUNCH();
}

void gather_rows(const GatherRowsParams& params, cudaStream_t stream) {
  NvtxRange range("dispatch");
  MOE_CHECK(params.top_k >= 1, "top_k = ", params.top_k, " must be at least 1");
  // Rows stand where check_row_sizes has tokens: M rows of H, M row ids.
  check_row_sizes(params.num_rows, 1, params.hidden_size);
  if (params.num_rows == 0) return;
  detail::check_pointer(params.hidden, "hidden");
  detail::check_pointer(params.src_row, "src_row");
  detail::check_pointer(params.rows, "rows");
  detail::check_aligned16(params.hidden, "hidden");
  detail::check_aligned16(params.rows, "rows");
  launch_after_previous(gather_rows_kernel,
                        row_kernel_blocks(params.num_rows, params.hidden_size),
                        kRowKernelThreads, 0, stream, params);
  MOE_CUDA_CHECK_LAUNCH();
}

void unpermute(const UnpermuteParams& params, cudaStream_t stream) {
  NvtxRange range("unpermute");
  MOE_CHECK(params.top_k >= 1, "top_k = ", params.top_k, " must be at least 1");
  check_row_sizes(params.num_tokens, params.top_k, params.hidden_size);
  if (params.num_tokens == 0) return;
  detail::check_pointer(params.expert_out, "expert_out");
  detail::check_pointer(params.topk_weights, "topk_weights");
  detail::check_pointer(params.inverse, "inverse");
  detail::check_pointer(params.out, "out");
  detail::check_aligned16(params.expert_out, "expert_out");
  detail::check_aligned16(params.out, "out");
  if (params.shared) detail::check_aligned16(params.shared, "shared");
  if (params.residual) detail::check_aligned16(params.residual, "residual");
  launch_after_previous(unpermute_kernel, row_kernel_blocks(params.num_tokens, params.hidden_size),
                        kRowKernelThreads, 0, stream, params);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
