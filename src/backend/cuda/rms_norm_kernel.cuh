// RMSNorm fused with the residual add, one block per row:
//   s = bf16(x + residual)            (s = x when there is no residual)
//   residual_out = s
//   out = bf16(weight * (s / sqrt(sum(s^2) / mean_width + eps)))
// The sum is rounded to bf16 before it is normalised, so the fused kernel computes exactly what
// the unfused pair (a bf16 residual add, then a norm of the stored bf16 stream) would.
//
// Why this shape: the row is read once and kept in registers (kVecs 16-byte vectors of 8 bf16
// per thread, a compile-time count so the array is not spilled to local memory), all of a
// thread's loads (x, residual, weight) are issued before the first use, the sum of
// squares is one warp reduction plus one across warps through shared memory, and the row is
// written once. Each thread reads and writes only its own elements, so out may alias x and
// residual_out may alias residual.
#pragma once

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

template <int kVecs>
__global__ void __launch_bounds__(1024)
    fused_add_rms_norm_kernel(const __grid_constant__ RmsNormParams p) {
  __shared__ float warp_partials[32];
  const int64_t row = blockIdx.x;
  if (row >= p.num_rows) return;
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const uint4* x = reinterpret_cast<const uint4*>(p.x) + row * vecs;
  const uint4* residual =
      p.residual ? reinterpret_cast<const uint4*>(p.residual) + row * vecs : nullptr;

  // Every load first (x, residual and the weight, which is needed only after the reduction):
  // all of a thread's loads are in flight together, and none waits behind a residual_out store
  // that the compiler must assume could alias it. At 4 vectors per thread (H > 16384) the
  // early weight would not fit the 64 registers that 1024 threads leave each, so there it is
  // loaded after the reduction.
  constexpr bool kEarlyWeight = kVecs <= 2;
  uint4 x_raw[kVecs], residual_raw[kVecs], weight_raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) {
      x_raw[j] = x[v];
      if (residual) residual_raw[j] = residual[v];
      if constexpr (kEarlyWeight)
        weight_raw[j] = __ldg(reinterpret_cast<const uint4*>(p.weight) + v);
    }
  }

  float s[kVecs][8];
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) {
      device::bf16x8_to_float(x_raw[j], s[j]);
      if (residual) {
        float r[8];
        device::bf16x8_to_float(residual_raw[j], r);
#pragma unroll
        for (int i = 0; i < 8; ++i) s[j][i] = device::round_bf16(s[j][i] + r[i]);
      }
      // residual_out always holds the normalised stream (s = x without a residual).
      if (p.residual_out) {
        reinterpret_cast<uint4*>(p.residual_out)[row * vecs + v] =
            residual ? device::float_to_bf16x8(s[j]) : x_raw[j];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) sum_sq = fmaf(s[j][i], s[j][i], sum_sq);
    }
  }

  sum_sq = device::warp_sum(sum_sq);
  const int lane = threadIdx.x % device::kWarpSize;
  const int warp = threadIdx.x / device::kWarpSize;
  const int num_warps = blockDim.x / device::kWarpSize;
  if (lane == 0) warp_partials[warp] = sum_sq;
  __syncthreads();
  if (warp == 0) {
    float total = lane < num_warps ? warp_partials[lane] : 0.0f;
    total = device::warp_sum(total);
    if (lane == 0) warp_partials[0] = total;
  }
  __syncthreads();
  const float inv_rms = 1.0f / sqrtf(warp_partials[0] / static_cast<float>(p.mean_width) + p.eps);

  uint4* out = reinterpret_cast<uint4*>(p.out) + row * vecs;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) {
      float w[8];
      if constexpr (!kEarlyWeight)
        weight_raw[j] = __ldg(reinterpret_cast<const uint4*>(p.weight) + v);
      device::bf16x8_to_float(weight_raw[j], w);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[j][i] = w[i] * (s[j][i] * inv_rms);
      out[v] = device::float_to_bf16x8(s[j]);
    }
  }
}

}  // namespace moeinfer::cuda
