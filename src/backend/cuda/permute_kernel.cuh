// Dispatch (permute) and unpermute on one device: both are bandwidth-bound row moves, so both
// use one warp per row, 16-byte loads and stores (8 bf16 per lane per access), and several
// independent loads in flight per lane before the first use.
//
// permute:   rows[r]  = hidden[src_row[r] / K]                       rows [T*K, H]
// unpermute: out[t]   = (shared[t] + sum_k w[t,k] * expert_out[inverse[t*K+k]]) + residual[t]
//            float32 accumulation in that order (the CPU reference's order), one bf16 rounding.
//
// Grids come from host-known sizes (T*K rows, T tokens): nothing depends on the plan's
// counts, so these kernels can sit in a captured graph. In unpermute, lane k holds token t's
// k-th (row, weight) pair and the warp broadcasts it with a shuffle, so the per-token metadata
// is read once, coalesced.
#pragma once

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int kPermuteWarpsPerBlock = 8;
inline constexpr int kPermuteUnroll = 4;  // 16-byte loads in flight per lane

__global__ void __launch_bounds__(kPermuteWarpsPerBlock* device::kWarpSize)
    permute_kernel(const __grid_constant__ PermuteParams p) {
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kPermuteWarpsPerBlock + threadIdx.x / device::kWarpSize;
  const int64_t num_rows = p.num_tokens * p.top_k;
  if (row >= num_rows) return;
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const int64_t token = __ldg(p.src_row + row) / p.top_k;
  const uint4* src = reinterpret_cast<const uint4*>(p.hidden) + token * vecs;
  uint4* dst = reinterpret_cast<uint4*>(p.rows) + row * vecs;
  for (int v0 = lane; v0 < vecs; v0 += kPermuteUnroll * device::kWarpSize) {
    uint4 buf[kPermuteUnroll];
#pragma unroll
    for (int u = 0; u < kPermuteUnroll; ++u) {
      const int v = v0 + u * device::kWarpSize;
      if (v < vecs) buf[u] = __ldg(src + v);
    }
#pragma unroll
    for (int u = 0; u < kPermuteUnroll; ++u) {
      const int v = v0 + u * device::kWarpSize;
      if (v < vecs) dst[v] = buf[u];
    }
  }
}

inline constexpr int kUnpermuteWarpsPerBlock = 8;
inline constexpr int kUnpermuteUnroll = 2;  // vectors per lane per pass; K loads each

__global__ void __launch_bounds__(kUnpermuteWarpsPerBlock* device::kWarpSize)
    unpermute_kernel(const __grid_constant__ UnpermuteParams p) {
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t token =
      static_cast<int64_t>(blockIdx.x) * kUnpermuteWarpsPerBlock + threadIdx.x / device::kWarpSize;
  if (token >= p.num_tokens) return;
  const int top_k = static_cast<int>(p.top_k);
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);

  int32_t my_row = 0;
  float my_weight = 0.0f;
  if (lane < top_k) {
    my_row = __ldg(p.inverse + token * top_k + lane);
    my_weight = __ldg(p.topk_weights + token * top_k + lane);
  }
  const uint4* expert_out = reinterpret_cast<const uint4*>(p.expert_out);
  const uint4* shared =
      p.shared ? reinterpret_cast<const uint4*>(p.shared) + token * vecs : nullptr;
  const uint4* residual =
      p.residual ? reinterpret_cast<const uint4*>(p.residual) + token * vecs : nullptr;
  uint4* out = reinterpret_cast<uint4*>(p.out) + token * vecs;

  // The loop bound is uniform across the warp: every lane must reach the shuffles below.
  for (int base = 0; base < vecs; base += kUnpermuteUnroll * device::kWarpSize) {
    const int v0 = base + lane;
    float acc[kUnpermuteUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnpermuteUnroll; ++u) {
      const int v = v0 + u * device::kWarpSize;
      if (shared && v < vecs) {
        device::bf16x8_to_float(shared[v], acc[u]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
      }
    }
#pragma unroll 4
    for (int k = 0; k < top_k; ++k) {
      const int64_t row = __shfl_sync(device::kFullMask, my_row, k);
      const float weight = __shfl_sync(device::kFullMask, my_weight, k);
      const uint4* src = expert_out + row * vecs;
#pragma unroll
      for (int u = 0; u < kUnpermuteUnroll; ++u) {
        const int v = v0 + u * device::kWarpSize;
        if (v < vecs) {
          float x[8];
          device::bf16x8_to_float(__ldg(src + v), x);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = fmaf(weight, x[i], acc[u][i]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnpermuteUnroll; ++u) {
      const int v = v0 + u * device::kWarpSize;
      if (v < vecs) {
        if (residual) {
          float r[8];
          device::bf16x8_to_float(residual[v], r);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] += r[i];
        }
        out[v] = device::float_to_bf16x8(acc[u]);
      }
    }
  }
}

}  // namespace moeinfer::cuda
