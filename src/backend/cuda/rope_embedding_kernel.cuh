// Embedding gather and rotary position embeddings. Both are tiny, bandwidth-bound passes:
//
// - embedding: one thread per 16-byte vector of an output row over a flat grid of T * H/8
//   threads, so even one token spreads over H/8 threads and every load is coalesced.
// - rope: one thread per rotated pair (token, head, i) over q and k together, so the two
//   projections rotate in one launch. cos/sin are computed in float32 from float(position) *
//   inv_freq[i] with the accurate sincosf (positions reach 10^5 radians and more), which is
//   what the CPU's Rope::apply does with std::cos/std::sin; the inverse frequencies come from
//   the host (yarn, linear, llama3 ramps are computed once there).
#pragma once

#include <cuda_bf16.h>

#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"

namespace moeinfer::cuda {

inline constexpr int kRopeThreads = 256;
inline constexpr int kEmbeddingThreads = 256;

__global__ void __launch_bounds__(kEmbeddingThreads)
    embedding_kernel(const __grid_constant__ EmbeddingParams p) {
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kEmbeddingThreads + threadIdx.x;
  if (idx >= p.num_tokens * vecs) return;
  const int64_t token = idx / vecs;
  const int v = static_cast<int>(idx - token * vecs);
  const int32_t id = __ldg(p.token_ids + token);
  MOE_DEVICE_CHECK(id >= 0 && id < p.vocab_size);
  const uint4 value =
      __ldg(reinterpret_cast<const uint4*>(p.table) + static_cast<int64_t>(id) * vecs + v);
  if (p.out_f32) {
    float wide[8];
    device::bf16x8_to_float(value, wide);
    if (p.table_lo) {  // a float32 checkpoint's row: hi + lo
      float lo[8];
      device::bf16x8_to_float(
          __ldg(reinterpret_cast<const uint4*>(p.table_lo) + static_cast<int64_t>(id) * vecs + v),
          lo);
#pragma unroll
      for (int i = 0; i < 8; ++i) wide[i] += lo[i];
    }
    device::store_float8(p.out_f32, idx, wide);
  } else {
    reinterpret_cast<uint4*>(p.out)[idx] = value;
  }
}

__global__ void __launch_bounds__(kRopeThreads) rope_kernel(const __grid_constant__ RopeParams p) {
  const int half = static_cast<int>(p.rotary_dim / 2);
  const int heads = static_cast<int>(p.num_q_heads + (p.k ? p.num_kv_heads : 0));
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kRopeThreads + threadIdx.x;
  if (idx >= p.num_tokens * heads * half) return;
  const int i = static_cast<int>(idx % half);
  const int64_t th = idx / half;
  const int h = static_cast<int>(th % heads);
  const int64_t t = th / heads;
  __nv_bfloat16* head = h < p.num_q_heads ? p.q + t * p.q_stride + h * p.head_dim
                                          : p.k + t * p.k_stride + (h - p.num_q_heads) * p.head_dim;
  const float angle = static_cast<float>(__ldg(p.positions + t)) * __ldg(p.inv_freq + i);
  float s, c;
  sincosf(angle, &s, &c);
  c *= p.attention_scaling;
  s *= p.attention_scaling;
  const int i1 = p.interleaved ? 2 * i : i;
  const int i2 = p.interleaved ? 2 * i + 1 : i + half;
  const float x1 = __bfloat162float(head[i1]);
  const float x2 = __bfloat162float(head[i2]);
  head[i1] = __float2bfloat16_rn(x1 * c - x2 * s);
  head[i2] = __float2bfloat16_rn(x2 * c + x1 * s);
}

}  // namespace moeinfer::cuda
