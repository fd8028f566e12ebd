// Launchers of the Gated DeltaNet kernels (gated_delta_net_kernel.cuh): shape checks that name
// the offending value, then one launch each.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gated_delta_net.h"
#include "backend/cuda/gated_delta_net_kernel.cuh"
#include "backend/cuda/launch_checks.h"

namespace moeinfer::cuda {
namespace {

void check_sequences(const DeltaNetSequences& s) {
  detail::check_int32_range(s.num_seqs, "num_seqs");
  MOE_CHECK(s.num_seqs <= 65535, "num_seqs = ", s.num_seqs, " exceeds the grid's 65535");
  MOE_CHECK(s.num_slots >= 1, "num_slots = ", s.num_slots, " must be >= 1");
  detail::check_pointer(s.cu_seqlens, "cu_seqlens");
  detail::check_pointer(s.state_slots, "state_slots");
  detail::check_pointer(s.positions, "positions");
}

}  // namespace

void delta_net_conv(const DeltaNetConvParams& p, cudaStream_t stream) {
  NvtxRange range("delta_net_conv");
  check_sequences(p.seqs);
  MOE_CHECK(p.taps >= 2 && p.taps <= kDeltaNetMaxConvTaps, "conv taps = ", p.taps,
            " must be in [2, ", kDeltaNetMaxConvTaps, "]");
  MOE_CHECK(p.num_channels >= 1, "num_channels = ", p.num_channels, " must be >= 1");
  MOE_CHECK(p.x_stride >= p.num_channels, "x_stride = ", p.x_stride, " is below num_channels = ",
            p.num_channels);
  detail::check_pointer(p.x, "x");
  detail::check_pointer(p.weight, "weight");
  detail::check_pointer(p.conv_state, "conv_state");
  detail::check_pointer(p.out, "out");
  if (p.seqs.num_seqs == 0) return;
  const dim3 grid(static_cast<unsigned>((p.num_channels + delta_net::kConvThreads - 1) /
                                        delta_net::kConvThreads),
                  static_cast<unsigned>(p.seqs.num_seqs));
  delta_net_conv_kernel<<<grid, delta_net::kConvThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void delta_net_recurrence(const DeltaNetRecurrenceParams& p, cudaStream_t stream) {
  NvtxRange range("delta_net_recurrence");
  check_sequences(p.seqs);
  MOE_CHECK(p.key_dim >= 1 && p.key_dim <= kDeltaNetMaxKeyDim, "key_dim = ", p.key_dim,
            " must be in [1, ", kDeltaNetMaxKeyDim, "]");
  MOE_CHECK(p.value_dim >= 1, "value_dim = ", p.value_dim, " must be >= 1");
  MOE_CHECK(p.num_key_heads >= 1 && p.num_value_heads >= p.num_key_heads &&
                p.num_value_heads % p.num_key_heads == 0,
            "num_value_heads = ", p.num_value_heads, " must be a positive multiple of "
            "num_key_heads = ", p.num_key_heads);
  MOE_CHECK(p.num_value_heads <= 65535, "num_value_heads = ", p.num_value_heads,
            " exceeds the grid's 65535");
  MOE_CHECK(p.qkv_stride >= 2 * p.num_key_heads * p.key_dim + p.num_value_heads * p.value_dim,
            "qkv_stride = ", p.qkv_stride, " is narrower than the q, k and v heads");
  MOE_CHECK(p.ba_stride >= p.num_value_heads, "ba_stride = ", p.ba_stride,
            " is below num_value_heads = ", p.num_value_heads);
  MOE_CHECK(p.l2_eps >= 0.0f, "l2_eps = ", p.l2_eps, " must not be negative");
  detail::check_pointer(p.qkv, "qkv");
  detail::check_pointer(p.b, "b");
  detail::check_pointer(p.a, "a");
  detail::check_pointer(p.a_log, "a_log");
  detail::check_pointer(p.dt_bias, "dt_bias");
  detail::check_pointer(p.state, "state");
  detail::check_pointer(p.out, "out");
  if (p.seqs.num_seqs == 0) return;
  const int64_t warps = (p.key_dim + delta_net::kTile - 1) / delta_net::kTile;
  const dim3 grid(static_cast<unsigned>((p.value_dim + delta_net::kTile - 1) / delta_net::kTile),
                  static_cast<unsigned>(p.num_value_heads),
                  static_cast<unsigned>(p.seqs.num_seqs));
  delta_net_recurrence_kernel<<<grid, static_cast<unsigned>(warps * delta_net::kTile), 0,
                                stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void gated_rms_norm(const GatedRmsNormParams& p, cudaStream_t stream) {
  NvtxRange range("gated_rms_norm");
  MOE_CHECK(p.width >= 1 && p.width <= 1024, "width = ", p.width, " must be in [1, 1024]");
  MOE_CHECK(p.heads >= 1, "heads = ", p.heads, " must be >= 1");
  MOE_CHECK(p.rows % p.heads == 0, "rows = ", p.rows, " is not a multiple of heads = ", p.heads);
  MOE_CHECK(p.z_stride >= p.heads * p.width, "z_stride = ", p.z_stride,
            " is narrower than heads * width = ", p.heads * p.width);
  MOE_CHECK(p.eps >= 0.0f, "eps = ", p.eps, " must not be negative");
  detail::check_int32_range(p.rows, "rows");
  detail::check_pointer(p.x, "x");
  detail::check_pointer(p.z, "z");
  detail::check_pointer(p.weight, "weight");
  detail::check_pointer(p.out, "out");
  if (p.rows == 0) return;
  constexpr int kThreads = 256;
  constexpr int64_t kRowsPerBlock = kThreads / device::kWarpSize;
  const auto blocks = static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  gated_rms_norm_kernel<<<blocks, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void attention_output_gate(const OutputGateParams& p, cudaStream_t stream) {
  NvtxRange range("attention_output_gate");
  MOE_CHECK(p.width >= 1, "width = ", p.width, " must be >= 1");
  MOE_CHECK(p.gate_stride >= p.width, "gate_stride = ", p.gate_stride, " is shorter than width = ",
            p.width);
  detail::check_int32_range(p.rows, "rows");
  detail::check_int32_range(p.rows * p.width, "rows * width");
  detail::check_pointer(p.x, "x");
  detail::check_pointer(p.gate, "gate");
  if (p.rows == 0) return;
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>((p.rows * p.width + kThreads - 1) / kThreads);
  attention_output_gate_kernel<<<blocks, kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
