// Dispatch (permute) and unpermute on one device. Both are bandwidth-bound row moves, so both
// give one thread one 16-byte vector (8 bf16) of one token's row, over a flat grid of T * H/8
// threads: loads and stores are coalesced for any H that is a multiple of 8, every SM has work
// even at T = 1 (H/8 threads, not one warp), and each thread has all its loads in flight at
// once.
//
// permute (token-major scatter): rows[inverse[t*K+k]] = hidden[t] for k < K. Each hidden
//   vector is read once and stored K times, so the traffic is the floor (T*H read, T*K*H
//   written) even when hidden is larger than L2, where an expert-major gather would read each
//   token's row K times in a scattered order.
// unpermute: out[t] = (shared[t] + sum_k w[t,k] * expert_out[inverse[t*K+k]]) + residual[t],
//   float32 accumulation in that order (the CPU reference's order), written in float32. The K
//   source vectors are loaded in batches of kUnpermuteBatch before the first multiply.
//
// Per-token metadata (K row indices, K weights) is read by every thread of the token; those
// reads hit the same addresses across a warp and are served as broadcasts from L1.
// Grids come from host-known sizes (T tokens, H), never from the plan's counts, so both
// kernels can sit in a captured graph.
#pragma once

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int kRowKernelThreads = 256;
inline constexpr int kPermuteBatch = 8;    // destination indices loaded ahead
inline constexpr int kUnpermuteBatch = 8;  // source vectors in flight per thread

__global__ void __launch_bounds__(kRowKernelThreads)
    permute_kernel(const __grid_constant__ PermuteParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const int top_k = static_cast<int>(p.top_k);
  const int idx = blockIdx.x * kRowKernelThreads + threadIdx.x;  // token * vecs + v
  if (idx >= static_cast<int>(p.num_tokens) * vecs) return;
  const int token = idx / vecs;
  const int v = idx - token * vecs;
  const uint4 value = __ldg(reinterpret_cast<const uint4*>(p.hidden) + idx);
  uint4* rows = reinterpret_cast<uint4*>(p.rows);
  const int32_t* inverse = p.inverse + static_cast<int64_t>(token) * top_k;
  if (p.topk_weights != nullptr) {
    // Weighted copies (routing weights on the input): one row at a time, rounded once.
    float x[8];
    device::bf16x8_to_float(value, x);
    const float* weights = p.topk_weights + static_cast<int64_t>(token) * top_k;
    for (int k = 0; k < top_k; ++k) {
      const float w = __ldg(weights + k);
      float y[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = x[i] * w;
      rows[static_cast<int64_t>(__ldg(inverse + k)) * vecs + v] = device::float_to_bf16x8(y);
    }
    return;
  }
  for (int k0 = 0; k0 < top_k; k0 += kPermuteBatch) {
    int32_t row[kPermuteBatch];
#pragma unroll
    for (int u = 0; u < kPermuteBatch; ++u) row[u] = k0 + u < top_k ? __ldg(inverse + k0 + u) : 0;
#pragma unroll
    for (int u = 0; u < kPermuteBatch; ++u)
      if (k0 + u < top_k) rows[static_cast<int64_t>(row[u]) * vecs + v] = value;
  }
}

// gather_rows: one thread per 16-byte vector of an expert-ordered row (M * H/8 threads); a
// token's row is read K times, from L2 when the step's hidden state fits there (prefill chunks).
__global__ void __launch_bounds__(kRowKernelThreads)
    gather_rows_kernel(const __grid_constant__ GatherRowsParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const int idx = blockIdx.x * kRowKernelThreads + threadIdx.x;  // row * vecs + v
  if (idx >= static_cast<int>(p.num_rows) * vecs) return;
  const int row = idx / vecs;
  const int v = idx - row * vecs;
  const int token = __ldg(p.src_row + row) / static_cast<int>(p.top_k);
  reinterpret_cast<uint4*>(p.rows)[idx] =
      __ldg(reinterpret_cast<const uint4*>(p.hidden) + static_cast<int64_t>(token) * vecs + v);
}

__global__ void __launch_bounds__(kRowKernelThreads)
    unpermute_kernel(const __grid_constant__ UnpermuteParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const int top_k = static_cast<int>(p.top_k);
  const int idx = blockIdx.x * kRowKernelThreads + threadIdx.x;  // token * vecs + v
  if (idx >= static_cast<int>(p.num_tokens) * vecs) return;
  const int token = idx / vecs;
  const int v = idx - token * vecs;

  float acc[8];
  if (p.shared) {
    device::bf16x8_to_float(reinterpret_cast<const uint4*>(p.shared)[idx], acc);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  }
  const uint4* expert_out = reinterpret_cast<const uint4*>(p.expert_out);
  const int32_t* inverse = p.inverse + static_cast<int64_t>(token) * top_k;
  const float* weights = p.topk_weights + static_cast<int64_t>(token) * top_k;
  for (int k0 = 0; k0 < top_k; k0 += kUnpermuteBatch) {
    uint4 x[kUnpermuteBatch];
    float w[kUnpermuteBatch];
#pragma unroll
    for (int u = 0; u < kUnpermuteBatch; ++u) {
      w[u] = k0 + u < top_k ? __ldg(weights + k0 + u) : 0.0f;
      if (w[u] != 0.0f) {
        x[u] = __ldg(expert_out + static_cast<int64_t>(__ldg(inverse + k0 + u)) * vecs + v);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnpermuteBatch; ++u) {
      if (w[u] != 0.0f) {
        float f[8];
        device::bf16x8_to_float(x[u], f);
        if (p.weights_on_input) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += f[i];
        } else {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(w[u], f[i], acc[i]);
        }
      }
    }
  }
  if (p.residual) {
    float r[8];
    device::load_float8(p.residual, idx, r);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += r[i];
  }
  device::store_float8(p.out, idx, acc);
}

}  // namespace moeinfer::cuda
