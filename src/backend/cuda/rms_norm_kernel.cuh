// RMSNorm fused with the residual add, one block per row, in float32:
//   s = x + x_bias + residual         (the terms that are given)
//   residual_out = s
//   out = bf16((weight + weight_lo) * (s / sqrt(sum(s^2) / mean_width + eps)))
// The residual stream is float32 and is normalised unrounded, as the float32 reference does; only
// the normalised row, the next GEMM's input, is rounded to bf16.
//
// Why this shape: the row is read once and kept in registers (kVecs groups of 8 floats per
// thread, a compile-time count so the array is not spilled to local memory), all of a thread's
// loads are issued in one loop before the first store (none waits behind a residual_out store
// that the compiler must assume could alias it), the sum of squares is one warp reduction plus
// one across warps through shared memory, and the row is written once. Each thread reads and
// writes only its own elements, so residual_out may alias residual or x.
#pragma once

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

template <int kVecs>
__global__ void __launch_bounds__(1024)
    fused_add_rms_norm_kernel(const __grid_constant__ RmsNormParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  __shared__ float warp_partials[32];
  const int64_t row = blockIdx.x;
  if (row >= p.num_rows) return;
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const float* x = p.x ? p.x + row * p.hidden_size : nullptr;
  const float* residual = p.residual ? p.residual + row * p.hidden_size : nullptr;

  // At 4 groups per thread (H > 16384) an early weight would not fit the 64 registers that 1024
  // threads leave each, so there it is loaded after the reduction.
  constexpr bool kEarlyWeight = kVecs <= 2;
  uint4 weight_raw[kVecs];
  float s[kVecs][8];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) {
      if (x) {
        device::load_float8(x, v, s[j]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) s[j][i] = 0.0f;
      }
      if (residual) {
        float r[8];
        device::load_float8(residual, v, r);
#pragma unroll
        for (int i = 0; i < 8; ++i) s[j][i] += r[i];
      }
      if (p.x_bias) {
        float b[8];
        device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p.x_bias) + v), b);
#pragma unroll
        for (int i = 0; i < 8; ++i) s[j][i] += b[i];
      }
      if constexpr (kEarlyWeight)
        weight_raw[j] = __ldg(reinterpret_cast<const uint4*>(p.weight) + v);
    }
  }

  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) {
      if (p.residual_out) device::store_float8(p.residual_out + row * p.hidden_size, v, s[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum_sq = fmaf(s[j][i], s[j][i], sum_sq);
    }
  }

  const float total = device::block_sum(sum_sq, warp_partials);
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(p.mean_width) + p.eps);

  uint4* out = reinterpret_cast<uint4*>(p.out) + row * vecs;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = threadIdx.x + j * blockDim.x;
    if (v < vecs) {
      float w[8];
      if constexpr (!kEarlyWeight)
        weight_raw[j] = __ldg(reinterpret_cast<const uint4*>(p.weight) + v);
      device::bf16x8_to_float(weight_raw[j], w);
      if (p.weight_lo) {  // a float32 checkpoint's weight: hi + lo, summed in float32
        float lo[8];
        device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p.weight_lo) + v), lo);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] += lo[i];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) s[j][i] = w[i] * (s[j][i] * inv_rms);
      out[v] = device::float_to_bf16x8(s[j]);
    }
  }
}

// Rows longer than the register kernel holds (H > kRmsNormMaxHidden): two passes over memory,
// 1024 threads, thread t taking vectors t, t + 1024, ... in both (the register kernel's mapping
// and order). The second pass reads s back from residual_out where it was written (which may
// alias x or residual, so those no longer hold the inputs), else forms it again from the same
// inputs with the same float32 operations, which gives the same bits.
__global__ void __launch_bounds__(1024)
    fused_add_rms_norm_long_kernel(const __grid_constant__ RmsNormParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  __shared__ float warp_partials[32];
  const int64_t row = blockIdx.x;
  if (row >= p.num_rows) return;
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const float* x = p.x ? p.x + row * p.hidden_size : nullptr;
  const float* residual = p.residual ? p.residual + row * p.hidden_size : nullptr;
  float* residual_out = p.residual_out ? p.residual_out + row * p.hidden_size : nullptr;
  auto form_sum = [&](int v, float (&s)[8]) {
    if (x) {
      device::load_float8(x, v, s);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = 0.0f;
    }
    if (residual) {
      float r[8];
      device::load_float8(residual, v, r);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += r[i];
    }
    if (p.x_bias) {
      float b[8];
      device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p.x_bias) + v), b);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += b[i];
    }
  };

  float sum_sq = 0.0f;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float s[8];
    form_sum(v, s);
    if (residual_out) device::store_float8(residual_out, v, s);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum_sq = fmaf(s[i], s[i], sum_sq);
  }
  const float total = device::block_sum(sum_sq, warp_partials);
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(p.mean_width) + p.eps);

  uint4* out = reinterpret_cast<uint4*>(p.out) + row * vecs;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float s[8], w[8];
    if (residual_out) {
      device::load_float8(residual_out, v, s);
    } else {
      form_sum(v, s);
    }
    device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p.weight) + v), w);
    if (p.weight_lo) {
      float lo[8];
      device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p.weight_lo) + v), lo);
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] += lo[i];
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) s[i] = w[i] * (s[i] * inv_rms);
    out[v] = device::float_to_bf16x8(s);
  }
}

}  // namespace moeinfer::cuda
