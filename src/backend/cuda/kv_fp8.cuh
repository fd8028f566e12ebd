// The GPU's fp8 KV rows (--kv-dtype fp8 on cuda): the CPU pool's format (kv/kv_format.h), one
// e4m3 code per value and one float32 scale per (token, KV head), scale = amax / 448 (1 for an
// all-zero head), code = e4m3(x / scale) rounded to nearest even and saturated to +-448, so the
// CPU encoder is the oracle byte for byte. Why these helpers look as they do:
//
// - Encoding is a warp per head: the warp's max of |x| (a butterfly, every lane gets it), then
//   each lane encodes its own elements. The quotient x / scale is IEEE division (no fast-math in
//   this build), as core/dtype's encode_f8e4m3_scaled computes it, and cvt.rn.satfinite is the
//   same rounding as f32_to_f8e4m3 (NaN stays the NaN code 0x7f).
// - Decoding happens in registers where a kernel loads a row: 8 codes (8 bytes) become 8 floats
//   through the packed e4m3 -> half conversion (exact: every e4m3 value is a half) and one
//   multiply by the row's scale, the same float product the CPU's decode_kv_row forms.
// - The scale of the row at element offset `e` of a [slots, Nkv, Dp] code plane is at e / Dp of
//   its [slots, Nkv] scale plane.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "core/dtype.h"

namespace moeinfer::cuda::kvfp8 {

// scale for a head whose largest magnitude is amax (core/dtype's f8e4m3_scale).
__device__ __forceinline__ float scale_for(float amax) {
  return amax > 0.0f ? amax / kF8E4M3Max : 1.0f;
}

__device__ __forceinline__ uint8_t encode(float x, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float decode(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// 8 codes packed little-endian in a uint2 (element i in byte i) times scale.
__device__ __forceinline__ void decode8(const uint2& packed, float scale, float (&out)[8]) {
  const uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const auto two = static_cast<__nv_fp8x2_storage_t>(words[w] >> (16 * pair));
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
      const float2 f = __half22float2(__half2(h));
      out[4 * w + 2 * pair] = f.x * scale;
      out[4 * w + 2 * pair + 1] = f.y * scale;
    }
  }
}

// 8 decoded values as 8 bf16 in a uint4 (for the tensor-core kernel's shared-memory tiles).
__device__ __forceinline__ uint4 decode8_bf16(const uint2& packed, float scale) {
  float f[8];
  decode8(packed, scale, f);
  return device::float_to_bf16x8(f);
}

}  // namespace moeinfer::cuda::kvfp8
