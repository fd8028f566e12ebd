// Device code of the Gated DeltaNet kernels (gated_delta_net.h).
//
// Why this shape: the recurrence is sequential in the tokens of a sequence but independent
// across sequences, value heads and value columns of the state (each column j of S [Dk, Dv]
// evolves on its own given k, q, beta and the decay). So a block takes 32 columns of one
// (sequence, value head), each lane one column, each warp 32 rows of Dk, and keeps that tile of
// the state in registers over all of the sequence's tokens: the state is read once and written
// once per step, however long the prompt. The only cross-thread sums are the two reductions
// over Dk (S^T k and S^T q), through shared memory across the warps. Prefill thus runs token by
// token, as the CPU does; a chunked (WY) form would trade this simplicity for tensor cores.
// The conv is a thread per (sequence, channel) with its window in registers.
#pragma once

#include <cuda_bf16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/gated_delta_net.h"

namespace moeinfer::cuda {

namespace delta_net {

inline constexpr int kConvThreads = 128;
inline constexpr int kTile = 32;  // value columns per block, one per lane
inline constexpr int kMaxWarps = static_cast<int>(kDeltaNetMaxKeyDim) / kTile;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// torch's softplus (beta 1, threshold 20).
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

}  // namespace delta_net

__global__ void __launch_bounds__(delta_net::kConvThreads)
    delta_net_conv_kernel(const __grid_constant__ DeltaNetConvParams p) {
  constexpr int kHistory = static_cast<int>(kDeltaNetMaxConvTaps) - 1;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t seq = blockIdx.y;
  if (c >= p.num_channels) return;
  const int32_t slot = p.seqs.state_slots[seq];
  if (slot < 0) return;  // padding
  MOE_DEVICE_CHECK(slot < p.seqs.num_slots);
  const int32_t begin = p.seqs.cu_seqlens[seq], end = p.seqs.cu_seqlens[seq + 1];
  if (begin >= end) return;
  const int history = static_cast<int>(p.taps) - 1;
  const bool fresh = p.seqs.positions[begin] == 0;
  float* state = p.conv_state + (static_cast<int64_t>(slot) * p.num_channels + c) * history;
  float tap[kHistory + 1];
  float window[kHistory];  // the last `history` inputs, oldest first
#pragma unroll
  for (int j = 0; j < kHistory + 1; ++j) {
    tap[j] = j <= history ? p.weight[c * p.taps + j] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kHistory; ++j) window[j] = j < history && !fresh ? state[j] : 0.0f;
  float newest_tap = 0.0f;  // tap[history], selected without a dynamic register index
#pragma unroll
  for (int j = 0; j < kHistory + 1; ++j) {
    if (j == history) newest_tap = tap[j];
  }
  for (int32_t t = begin; t < end; ++t) {
    const float x = p.x[static_cast<int64_t>(t) * p.x_stride + c];
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kHistory; ++j) {
      if (j < history) acc += tap[j] * window[j];
    }
    acc += newest_tap * x;
    p.out[static_cast<int64_t>(t) * p.num_channels + c] = acc * delta_net::sigmoid(acc);
#pragma unroll
    for (int j = 0; j < kHistory; ++j) {
      if (j + 1 < history) {
        window[j] = window[j + 1];
      } else if (j + 1 == history) {
        window[j] = x;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kHistory; ++j) {
    if (j < history) state[j] = window[j];
  }
}

// grid (ceil(Dv / 32), Nv, S), block 32 * ceil(Dk / 32).
__global__ void __launch_bounds__(delta_net::kTile * delta_net::kMaxWarps)
    delta_net_recurrence_kernel(const __grid_constant__ DeltaNetRecurrenceParams p) {
  using namespace delta_net;
  __shared__ float q[kDeltaNetMaxKeyDim];
  __shared__ float k[kDeltaNetMaxKeyDim];
  __shared__ float partial_kv[kMaxWarps][kTile];
  __shared__ float partial_out[kMaxWarps][kTile];
  __shared__ float scalars[4];  // q scale, k scale, beta, decay

  const int lane = threadIdx.x % kTile;
  const int warp = threadIdx.x / kTile;
  const int num_warps = blockDim.x / kTile;
  const int64_t Dk = p.key_dim, Dv = p.value_dim, Nv = p.num_value_heads;
  const int64_t h = blockIdx.y;
  const int64_t seq = blockIdx.z;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTile + lane;  // this lane's column
  const bool column = j < Dv;
  const int32_t begin = p.seqs.cu_seqlens[seq], end = p.seqs.cu_seqlens[seq + 1];
  const int64_t out_stride = Nv * Dv;
  const int32_t slot = p.seqs.state_slots[seq];
  if (slot < 0) {  // padding: its output rows are zeros, so the norm after it stays finite
    if (warp == 0 && column) {
      for (int32_t t = begin; t < end; ++t) p.out[t * out_stride + h * Dv + j] = 0.0f;
    }
    return;
  }
  MOE_DEVICE_CHECK(slot < p.seqs.num_slots);
  if (begin >= end) return;
  const bool fresh = p.seqs.positions[begin] == 0;
  const int64_t g = h / (Nv / p.num_key_heads);  // the key head this value head reads
  const int64_t key_total = p.num_key_heads * Dk;
  float* S = p.state + (static_cast<int64_t>(slot) * Nv + h) * Dk * Dv;

  float s[kTile];  // S[warp * 32 + r, j]
#pragma unroll
  for (int r = 0; r < kTile; ++r) {
    const int64_t i = static_cast<int64_t>(warp) * kTile + r;
    s[r] = !fresh && column && i < Dk ? S[i * Dv + j] : 0.0f;
  }
  const float q_scale = rsqrtf(static_cast<float>(Dk));
  const float neg_a = -expf(p.a_log[h]);
  for (int32_t t = begin; t < end; ++t) {
    const float* row = p.qkv + static_cast<int64_t>(t) * p.qkv_stride;
    if (threadIdx.x < Dk) {
      q[threadIdx.x] = row[g * Dk + threadIdx.x];
      k[threadIdx.x] = row[key_total + g * Dk + threadIdx.x];
    }
    __syncthreads();
    if (warp == 0) {
      float q_sq = 0.0f, k_sq = 0.0f;
      for (int64_t i = lane; i < Dk; i += kTile) {
        q_sq += q[i] * q[i];
        k_sq += k[i] * k[i];
      }
      q_sq = device::warp_sum(q_sq);
      k_sq = device::warp_sum(k_sq);
      if (lane == 0) {
        scalars[0] = q_scale / sqrtf(q_sq + p.l2_eps);
        scalars[1] = 1.0f / sqrtf(k_sq + p.l2_eps);
        scalars[2] = sigmoid(p.b[static_cast<int64_t>(t) * p.ba_stride + h]);
        scalars[3] =
            expf(neg_a * softplus(p.a[static_cast<int64_t>(t) * p.ba_stride + h] + p.dt_bias[h]));
      }
    }
    __syncthreads();
    const float q_norm = scalars[0], k_norm = scalars[1], beta = scalars[2], decay = scalars[3];
    // kv_mem_j = sum_i (decay S[i, j]) k_i over this warp's rows, then over the warps.
    float kv = 0.0f;
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const int64_t i = static_cast<int64_t>(warp) * kTile + r;
      s[r] *= decay;
      if (i < Dk) kv += s[r] * (k[i] * k_norm);
    }
    partial_kv[warp][lane] = kv;
    __syncthreads();
    float kv_mem = 0.0f;
    for (int w = 0; w < num_warps; ++w) kv_mem += partial_kv[w][lane];
    const float v = column ? row[2 * key_total + h * Dv + j] : 0.0f;
    const float delta = (v - kv_mem) * beta;
    float o = 0.0f;
#pragma unroll
    for (int r = 0; r < kTile; ++r) {
      const int64_t i = static_cast<int64_t>(warp) * kTile + r;
      if (i < Dk) {
        s[r] += (k[i] * k_norm) * delta;
        o += s[r] * (q[i] * q_norm);
      }
    }
    partial_out[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && column) {
      float sum = 0.0f;
      for (int w = 0; w < num_warps; ++w) sum += partial_out[w][lane];
      p.out[static_cast<int64_t>(t) * out_stride + h * Dv + j] = sum;
    }
    // The next token overwrites q, k and the partials only after every warp has read them.
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < kTile; ++r) {
    const int64_t i = static_cast<int64_t>(warp) * kTile + r;
    if (column && i < Dk) S[i * Dv + j] = s[r];
  }
}

// A warp per row of `width` values.
__global__ void gated_rms_norm_kernel(const __grid_constant__ GatedRmsNormParams p) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) /
                      device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  if (row >= p.rows) return;
  const float* x = p.x + row * p.width;
  const float* z = p.z + (row / p.heads) * p.z_stride + (row % p.heads) * p.width;
  float sum_sq = 0.0f;
  for (int64_t i = lane; i < p.width; i += device::kWarpSize) sum_sq += x[i] * x[i];
  sum_sq = device::warp_sum(sum_sq);
  const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(p.width) + p.eps);
  __nv_bfloat16* out = p.out + row * p.width;
  for (int64_t i = lane; i < p.width; i += device::kWarpSize) {
    const float gate = z[i] * delta_net::sigmoid(z[i]);
    out[i] = __float2bfloat16(p.weight[i] * (x[i] * inv_rms) * gate);
  }
}

// One thread per element of x.
__global__ void attention_output_gate_kernel(const __grid_constant__ OutputGateParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.rows * p.width) return;
  const int64_t row = idx / p.width, col = idx - row * p.width;
  const float gate = delta_net::sigmoid(__bfloat162float(p.gate[row * p.gate_stride + col]));
  p.x[idx] = __float2bfloat16(__bfloat162float(p.x[idx]) * gate);
}

}  // namespace moeinfer::cuda
