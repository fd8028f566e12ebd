// Launcher of the residual-fused RMSNorm (rms_norm_kernel.cuh): one block per row, sized so
// that each thread holds at most 1, 2 or 4 groups of 8 floats in registers; longer rows take the
// two-pass kernel.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/programmatic_launch.h"
#include "backend/cuda/rms_norm_kernel.cuh"

namespace moeinfer::cuda {

template <int kVecs>
static void launch_rms_norm(const RmsNormParams& params, int64_t vecs, cudaStream_t stream) {
  const RmsNormLayout layout = rms_norm_layout(vecs);
  launch_after_previous(fused_add_rms_norm_kernel<kVecs>, static_cast<unsigned>(params.num_rows),
                        static_cast<unsigned>(layout.threads), 0, stream, params);
  MOE_CUDA_CHECK_LAUNCH();
}

void fused_add_rms_norm(const RmsNormParams& args, cudaStream_t stream) {
  NvtxRange range("rms_norm");
  detail::check_int32_range(args.num_rows, "num_rows");
  detail::check_hidden_size(args.hidden_size);
  MOE_CHECK(args.eps >= 0.0f, "eps = ", args.eps, " must not be negative");
  MOE_CHECK(args.mean_width >= 0 && args.mean_width <= args.hidden_size, "mean_width = ",
            args.mean_width, " must be in [0, hidden_size = ", args.hidden_size, "]");
  RmsNormParams params = args;
  if (params.mean_width == 0) params.mean_width = params.hidden_size;
  if (params.num_rows == 0) return;
  MOE_CHECK(params.x || params.residual, "rms_norm: x and residual are both null");
  detail::check_pointer(params.weight, "weight");
  detail::check_pointer(params.out, "out");
  if (params.x) detail::check_aligned16(params.x, "x");
  if (params.x_bias) detail::check_aligned16(params.x_bias, "x_bias");
  detail::check_aligned16(params.weight, "weight");
  if (params.weight_lo) detail::check_aligned16(params.weight_lo, "weight_lo");
  detail::check_aligned16(params.out, "out");
  if (params.residual) detail::check_aligned16(params.residual, "residual");
  if (params.residual_out) detail::check_aligned16(params.residual_out, "residual_out");
  const int64_t vecs = params.hidden_size / device::kBf16PerVec;
  switch (vecs <= kRmsNormMaxHidden / device::kBf16PerVec ? rms_norm_layout(vecs).groups : 0) {
    case 1:
      launch_rms_norm<1>(params, vecs, stream);
      break;
    case 2:
      launch_rms_norm<2>(params, vecs, stream);
      break;
    case 4:
      launch_rms_norm<4>(params, vecs, stream);
      break;
    default:
      launch_after_previous(fused_add_rms_norm_long_kernel, static_cast<unsigned>(params.num_rows),
                            1024, 0, stream, params);
      MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moeinfer::cuda
