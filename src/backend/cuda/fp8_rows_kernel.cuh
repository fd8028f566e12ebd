// The activation quantiser of the fp8 x fp8 grouped GEMM (grouped_gemm.h, quantize_rows_fp8):
// bf16 rows [M, Kd] become e4m3 codes and one float32 scale per (row, 128 inputs). Why it is built
// this way:
//
// - One warp per (row, block): a lane holds 4 of the block's 128 values (one 8-byte load), the
//   block's max of |x| is a butterfly of 5 shuffles, and each lane stores its 4 codes as one
//   word. The rows are read once and half their bytes written back as codes: the pass is
//   bandwidth-bound and small beside the GEMM it feeds (prefill only, fp8_tensor_core_experts).
// - Encoding is kvfp8's (kv_fp8.cuh): IEEE division by amax / 448 and cvt.rn.satfinite, the
//   rounding of core/dtype's f32_to_f8e4m3, so the host encoder is the test's oracle byte for
//   byte.
// - Rows at and past a device-side count (the plan's expert_offsets[E]) exit at once: the rows of
//   a graph bucket's padding are never read by the GEMM.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda {

inline constexpr int kFp8RowsThreads = 256;

__global__ void __launch_bounds__(kFp8RowsThreads)
    quantize_rows_fp8_kernel(const __grid_constant__ Fp8RowsParams p) {
  // The grouped GEMM that reads these codes may start its weight prefetch now (it waits for
  // this grid before reading the codes).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  constexpr int kBlock = static_cast<int>(kFp8ActBlock);
  const int K = static_cast<int>(p.k);
  const int blocks_per_row = (K + kBlock - 1) / kBlock;
  const int64_t warp_index =
      static_cast<int64_t>(blockIdx.x) * (kFp8RowsThreads / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (warp_index >= p.num_rows * blocks_per_row) return;
  const int64_t row = warp_index / blocks_per_row;
  const int block = static_cast<int>(warp_index - row * blocks_per_row);
  if (p.num_valid_rows != nullptr && row >= __ldg(p.num_valid_rows)) return;

  const int k = block * kBlock + lane * 4;
  const bool valid = k < K;  // a short last block (K a multiple of 64)
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (valid) {
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p.rows + row * K + k));
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float scale = kvfp8::scale_for(amax);
  if (valid) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      word |= static_cast<uint32_t>(kvfp8::encode(v[i], scale)) << (8 * i);
    *reinterpret_cast<uint32_t*>(p.codes + row * K + k) = word;
  }
  if (lane == 0) p.scales[row * blocks_per_row + block] = scale;
}

}  // namespace moeinfer::cuda
