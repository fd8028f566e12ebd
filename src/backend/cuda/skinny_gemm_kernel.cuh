// The skinny GEMM kernel (skinny_gemm.h). A warp owns C output columns (1 or 2, the launcher's
// choice: enough blocks to give every SM two): its lanes stride over K in 16-byte vectors (8
// values), each vector of a weight row loaded once and taken against the same vector of all M
// rows of x (which the M rows' reads share through L1), float32 partial sums per (row, column) in
// registers, then one butterfly per sum. A lane loads a batch of kSkinnyVectorsInFlight weight
// vectors before it multiplies any: at decode a warp's few kilobytes of weights are otherwise a
// chain of dependent round trips to HBM, one per vector of K, and the kernel is bound by their
// latency instead of the bandwidth. The batch changes no sum's order.
// The quantised variant (quant_skinny_gemm_kernel) keeps the grid (1 or 2 columns a warp, the
// same choice), the warps, the batch of loads in flight and the order of the sums; a lane's 16-byte
// load then holds 16 fp8 or 32 int4 codes of a weight row, dequantised 8 at a time in registers
// (expert_dequant.cuh) into the bf16 values the expert GEMM forms, so it streams half or a quarter
// of the bytes for the same products. dequantize_matrix_kernel writes those bf16 values out for the
// GEMMs of larger steps.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/expert_dequant.cuh"
#include "backend/cuda/skinny_gemm.h"

namespace moeinfer::cuda {

inline constexpr int kSkinnyWarps = 8;
inline constexpr int kSkinnyThreads = kSkinnyWarps * device::kWarpSize;
inline constexpr int kSkinnyColumnsPerWarp = 2;  // at most; the launcher takes 1 for small N
// 16-byte weight vectors a lane has in flight (over its columns and weight terms).
inline constexpr int kSkinnyVectorsInFlight = 8;

namespace skinny {

__device__ __forceinline__ void fma8(const uint4& w, const uint4& x, float& acc) {
  float a[8], b[8];
  device::bf16x8_to_float(w, a);
  device::bf16x8_to_float(x, b);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(a[i], b[i], acc);
}

// One lane's part of the warp's C columns against every row: vectors v = lane, lane + 32, ...,
// loaded kSkinnyVectorsInFlight at a time and summed in that order.
template <int M, bool TwoTerms, int C>
__device__ __forceinline__ void partial_sums(const SkinnyGemmParams& p, int col0, int lane,
                                             float (&acc)[M][C]) {
  constexpr int kBatch = kSkinnyVectorsInFlight / (C * (TwoTerms ? 2 : 1));
  const int vecs = static_cast<int>(p.k / device::kBf16PerVec);
  const int x_vecs = static_cast<int>(p.ldx / device::kBf16PerVec);
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  const uint4* w[C];
  const uint4* w_lo[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    // A column past N reads column N - 1 again and is not stored.
    const int64_t col = min(col0 + c, static_cast<int>(p.n) - 1);
    w[c] = reinterpret_cast<const uint4*>(p.w) + col * vecs;
    w_lo[c] = TwoTerms ? reinterpret_cast<const uint4*>(p.w_lo) + col * vecs : nullptr;
  }
  for (int v0 = lane; v0 < vecs; v0 += device::kWarpSize * kBatch) {
    uint4 wv[kBatch][C], lo[kBatch][C];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int v = v0 + b * device::kWarpSize;
      if (v >= vecs) break;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        wv[b][c] = __ldg(w[c] + v);
        if constexpr (TwoTerms) lo[b][c] = __ldg(w_lo[c] + v);
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int v = v0 + b * device::kWarpSize;
      if (v >= vecs) break;
#pragma unroll
      for (int r = 0; r < M; ++r) {
        const uint4 xv = __ldg(x + static_cast<int64_t>(r) * x_vecs + v);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          fma8(wv[b][c], xv, acc[r][c]);
          if constexpr (TwoTerms) fma8(lo[b][c], xv, acc[r][c]);
        }
      }
    }
  }
}

// Word i of a 16-byte vector (i a constant once unrolled: a register, not a local array).
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The scale group of input k: k / group, by a shift where group is a power of two (every group
// the loaders make: 128, GPTQ's 32 to 128, the fixtures' 8), a division otherwise (a uniform
// branch). A 32-bit division is some twenty instructions, once per 8 values.
struct GroupIndex {
  int group = 0;
  int shift = -1;  // log2(group), or -1
  __device__ __forceinline__ explicit GroupIndex(int g) : group(g) {
    if ((g & (g - 1)) != 0) return;
    shift = 0;
    while ((1 << shift) < g) ++shift;
  }
  __device__ __forceinline__ int of(int k) const { return shift >= 0 ? k >> shift : k / group; }
};

// Values a lane's 16-byte load of quantised codes holds: 16 fp8 codes, 32 int4 ones.
template <ExpertQuant Q>
inline constexpr int kQuantValuesPerLoad = Q == ExpertQuant::kFp8 ? 16 : 32;

// The quantised kernel's part of a lane: 16-byte code loads l = lane, lane + 32, ... of each of
// the warp's C weight rows, kSkinnyVectorsInFlight of them in flight at a time as the bf16
// kernel's, each split in chunks of 8 values, dequantised to bf16 in registers
// (expert_dequant.cuh) and taken against the same 8 values of every row of x, in that order.
template <int M, ExpertQuant Q, int C>
__device__ __forceinline__ void quant_partial_sums(const QuantSkinnyGemmParams& p,
                                                   const QuantMatrixLayout& layout, int col0,
                                                   int lane, float (&acc)[M][C]) {
  constexpr int kValues = kQuantValuesPerLoad<Q>;
  constexpr int kChunks = kValues / device::kBf16PerVec;
  // Past 4 rows a load carries more than twice the work and the accumulators crowd the registers
  // (128 a thread): half the batch, no spills.
  constexpr int kBatch = kSkinnyVectorsInFlight / C / (M > 4 ? 2 : 1);
  const int loads = static_cast<int>(p.k / kValues);
  const int x_vecs = static_cast<int>(p.ldx / device::kBf16PerVec);
  const GroupIndex group(static_cast<int>(p.group));
  const uint4* x = reinterpret_cast<const uint4*>(p.x);
  const float* scales = reinterpret_cast<const float*>(p.w + layout.scale_offset);
  const float* zeros = reinterpret_cast<const float*>(p.w + layout.zero_offset);
  int col[C];
  const uint4* w[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    // A column past N reads column N - 1 again and is not stored.
    col[c] = min(col0 + c, static_cast<int>(p.n) - 1);
    w[c] =
        reinterpret_cast<const uint4*>(p.w + static_cast<int64_t>(col[c]) * layout.row_code_bytes);
  }
  for (int l0 = lane; l0 < loads; l0 += device::kWarpSize * kBatch) {
    uint4 codes[kBatch][C];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int l = l0 + b * device::kWarpSize;
      if (l >= loads) break;
#pragma unroll
      for (int c = 0; c < C; ++c) codes[b][c] = __ldg(w[c] + l);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int l = l0 + b * device::kWarpSize;
      if (l >= loads) break;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int k = l * kValues + j * device::kBf16PerVec;
        uint4 wv[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const int64_t g = static_cast<int64_t>(col[c]) * layout.groups_per_row + group.of(k);
          expert_dequant::QuantChunk chunk{};
          if constexpr (Q == ExpertQuant::kFp8) {
            chunk.codes = make_uint2(word_of(codes[b][c], 2 * j), word_of(codes[b][c], 2 * j + 1));
          } else {
            chunk.codes.x = word_of(codes[b][c], j);
            chunk.zero = __ldg(zeros + g);
          }
          chunk.scale = __ldg(scales + g);
          wv[c] = expert_dequant::dequantize_chunk<Q>(chunk);
        }
#pragma unroll
        for (int r = 0; r < M; ++r) {
          const uint4 xv = __ldg(x + static_cast<int64_t>(r) * x_vecs + k / device::kBf16PerVec);
#pragma unroll
          for (int c = 0; c < C; ++c) fma8(wv[c], xv, acc[r][c]);
        }
      }
    }
  }
}

// The first `bytes` of each of the warp's weight rows [col0, col0 + C) (past n: none), row_bytes
// each, asked of L2 one 128-byte line a prefetch.
template <int C>
__device__ __forceinline__ void prefetch_rows(const uint8_t* w, int64_t row_bytes, int64_t bytes,
                                              int col0, int64_t n, int lane) {
  const int rows = min(col0 + C, static_cast<int>(n)) - col0;
  const int64_t ahead = min(bytes, row_bytes);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = w + static_cast<int64_t>(col0 + r) * row_bytes;
    for (int64_t b = int64_t{lane} * 128; b < ahead; b += device::kWarpSize * 128) {
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + b));
    }
  }
}

// The butterfly of each (row, column) sum; every lane ends with every sum, and lane r * C + c
// stores (row r, column c) as float32 or bf16.
template <int M, int C>
__device__ __forceinline__ void store_sums(void* y, int64_t ldy, int64_t n, bool y_f32, int col0,
                                           int lane, float (&acc)[M][C]) {
#pragma unroll
  for (int r = 0; r < M; ++r) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float sum = device::warp_sum(acc[r][c]);
      const int col = col0 + c;
      if (lane == r * C + c && col < n) {
        const int64_t at = static_cast<int64_t>(r) * ldy + col;
        if (y_f32) {
          static_cast<float*>(y)[at] = sum;
        } else {
          static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(sum);
        }
      }
    }
  }
}

}  // namespace skinny

template <int M, bool TwoTerms, int C>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    skinny_gemm_kernel(const __grid_constant__ SkinnyGemmParams p) {
  const int warp = static_cast<int>(threadIdx.x) / device::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % device::kWarpSize;
  const int col0 = (static_cast<int>(blockIdx.x) * kSkinnyWarps + warp) * C;
  // The weights are not written by the kernels before this one: their first vectors go to L2
  // while that kernel finishes (launched as a programmatic dependent; otherwise at once).
  if (p.prefetch_row_bytes > 0 && col0 < p.n) {
    skinny::prefetch_rows<C>(reinterpret_cast<const uint8_t*>(p.w), p.k * 2, p.prefetch_row_bytes,
                             col0, p.n, lane);
  }
  device::start_after_previous_grid();  // x may be the previous kernel's output
  if (col0 >= p.n) return;

  float acc[M][C] = {};
  skinny::partial_sums<M, TwoTerms, C>(p, col0, lane, acc);
  skinny::store_sums<M, C>(p.y, p.ldy, p.n, p.y_f32, col0, lane, acc);
}

// y = x . dequant(w)^T (QuantSkinnyGemmParams): the bf16 kernel's grid, warps and stores; the
// weights are a quantised slab whose code rows the warp prefetches into L2 before it waits.
template <int M, ExpertQuant Q, int C>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    quant_skinny_gemm_kernel(const __grid_constant__ QuantSkinnyGemmParams p) {
  const int warp = static_cast<int>(threadIdx.x) / device::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % device::kWarpSize;
  const int col0 = (static_cast<int>(blockIdx.x) * kSkinnyWarps + warp) * C;
  const QuantMatrixLayout layout = quant_matrix_layout(Q, p.n, p.k, p.group);
  if (p.prefetch_row_bytes > 0 && col0 < p.n) {
    skinny::prefetch_rows<C>(p.w, layout.row_code_bytes, p.prefetch_row_bytes, col0, p.n, lane);
  }
  device::start_after_previous_grid();  // x may be the previous kernel's output
  if (col0 >= p.n) return;

  float acc[M][C] = {};
  skinny::quant_partial_sums<M, Q, C>(p, layout, col0, lane, acc);
  skinny::store_sums<M, C>(p.y, p.ldy, p.n, p.y_f32, col0, lane, acc);
}

// dequant(w) as bf16 [N, K] (DequantizeMatrixParams): a block per row at a time, a thread per
// 8-value chunk of it (no division by the row length); the codes and the scale of a chunk read
// as fetch_quant_chunk reads them, the values formed by dequantize_chunk.
template <ExpertQuant Q>
__global__ void dequantize_matrix_kernel(const __grid_constant__ DequantizeMatrixParams p) {
  const QuantMatrixLayout layout = quant_matrix_layout(Q, p.n, p.k, p.group);
  const int chunks_per_row = static_cast<int>(p.k / device::kBf16PerVec);
  const skinny::GroupIndex group(static_cast<int>(p.group));
  const float* scales = reinterpret_cast<const float*>(p.w + layout.scale_offset);
  const float* zeros = reinterpret_cast<const float*>(p.w + layout.zero_offset);
  device::start_after_previous_grid();  // the scratch may still be read by the kernel before
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const uint8_t* codes = p.w + row * layout.row_code_bytes;
    uint4* out = reinterpret_cast<uint4*>(p.out) + row * chunks_per_row;
    for (int c = static_cast<int>(threadIdx.x); c < chunks_per_row;
         c += static_cast<int>(blockDim.x)) {
      const int k = c * device::kBf16PerVec;
      const int64_t g = row * layout.groups_per_row + group.of(k);
      expert_dequant::QuantChunk chunk{};
      if constexpr (Q == ExpertQuant::kFp8) {
        chunk.codes = __ldg(reinterpret_cast<const uint2*>(codes + k));
      } else {
        chunk.codes.x = __ldg(reinterpret_cast<const unsigned int*>(codes + k / 2));
        chunk.zero = __ldg(zeros + g);
      }
      chunk.scale = __ldg(scales + g);
      out[c] = expert_dequant::dequantize_chunk<Q>(chunk);
    }
  }
}

}  // namespace moeinfer::cuda
