// Small device helpers shared by the MoE-stage kernels: warp reductions and 16-byte bf16
// vectors (8 values) converted to and from float32.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moeinfer::cuda::device {

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarpSize = 32;
inline constexpr int kBf16PerVec = 8;  // one uint4 holds 8 bf16

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& packed, float (&out)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 float_to_bf16x8(const float (&in)[8]) {
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return packed;
}

// Rounds to bf16 and back, as a bf16 store followed by a load would.
__device__ __forceinline__ float round_bf16(float value) {
  return __bfloat162float(__float2bfloat16_rn(value));
}

}  // namespace moeinfer::cuda::device
