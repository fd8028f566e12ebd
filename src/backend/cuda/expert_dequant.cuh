// Dequantisation of quantised expert weights (expert_quant.h's layout) in registers, 8 inputs
// (one 16-byte chunk of bf16) at a time: what the grouped expert GEMM stores to shared memory
// (grouped_gemm_kernel.cuh) and what the small-batch MoE kernel multiplies
// (small_batch_moe_kernel.cuh). One definition, so a weight has the same bf16 value on both
// paths: the float32 value the CPU forms (model/quantized_matrix.h) rounded once to bf16.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda::expert_dequant {

// One 16-byte chunk of a quantised weight tile in flight: 8 codes and their scale (and zero
// point, or E8M0 exponent in codes.y for MXFP4).
struct QuantChunk {
  uint2 codes;
  float scale;
  float zero;
};

// e2m1: sign in bit 3, two exponent bits, one mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6).
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t mag = code & 7u;
  // 0 or 0.5 by a select, not an int-to-float conversion (a quarter-rate instruction).
  const float v = mag < 2 ? (mag != 0 ? 0.5f : 0.0f)
                          : __uint_as_float((((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22));
  return (code & 8u) ? -v : v;
}

// float(code) for a 4-bit code, exactly: 2^23 + code has code in its mantissa. Two simple
// instructions instead of the int-to-float conversion, which runs at a quarter of the FMA rate
// and would bound the small-batch MoE kernel's int4 products at decode.
__device__ __forceinline__ float code_as_float(uint32_t code) {
  return __uint_as_float(0x4B000000u | code) - 8388608.0f;
}

// Loads the codes and scale of chunk (w_row, inputs k .. k + 7) of a quantised slab.
template <ExpertQuant Q>
__device__ __forceinline__ QuantChunk fetch_quant_chunk(const uint8_t* slab,
                                                        const QuantMatrixLayout& layout, int group,
                                                        int w_row, int k) {
  QuantChunk c{};
  const int64_t g = static_cast<int64_t>(w_row) * layout.groups_per_row + k / group;
  const uint8_t* row = slab + static_cast<int64_t>(w_row) * layout.row_code_bytes;
  if constexpr (Q == ExpertQuant::kFp8) {
    c.codes = __ldg(reinterpret_cast<const uint2*>(row + k));
    c.scale = __ldg(reinterpret_cast<const float*>(slab + layout.scale_offset) + g);
  } else if constexpr (Q == ExpertQuant::kInt4) {
    c.codes.x = __ldg(reinterpret_cast<const unsigned int*>(row + k / 2));
    c.scale = __ldg(reinterpret_cast<const float*>(slab + layout.scale_offset) + g);
    c.zero = __ldg(reinterpret_cast<const float*>(slab + layout.zero_offset) + g);
  } else {
    c.codes.x = __ldg(reinterpret_cast<const unsigned int*>(row + k / 2));
    c.codes.y = __ldg(slab + layout.scale_offset + g);
  }
  return c;
}

// The chunk's 8 values as 8 bf16 (round to nearest even of the float32 value the CPU forms).
template <ExpertQuant Q>
__device__ __forceinline__ uint4 dequantize_chunk(const QuantChunk& c) {
  if constexpr (Q == ExpertQuant::kFp8) {
    return kvfp8::decode8_bf16(c.codes, c.scale);
  } else {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t code = (c.codes.x >> (4 * j)) & 0xfu;
      if constexpr (Q == ExpertQuant::kInt4) {
        v[j] = (code_as_float(code) - c.zero) * c.scale;
      } else {
        // value * 2^(e - 127): a multiply by the power of two where it is a normal float,
        // ldexpf at the two ends (e = 0: 2^-127 is subnormal; e = 255 overflows), as the CPU's
        // ldexp; both are exact.
        const int e = static_cast<int>(c.codes.y);
        const float x = e2m1_value(code);
        v[j] = (e >= 1 && e <= 254) ? x * __uint_as_float(static_cast<uint32_t>(e) << 23)
                                    : ldexpf(x, e - 127);
      }
    }
    return device::float_to_bf16x8(v);
  }
}

}  // namespace moeinfer::cuda::expert_dequant
