// Fixed-order dense GEMM on tensor cores (mma.sync m16n8k16, bf16 in, float32 accumulators),
// the product of --deterministic mode (dense_gemm.h says what it guarantees). Why built so:
//
// - The reduction order of an element is fixed by K alone: one accumulator per element, one
//   mma per 16 values of K in increasing order, ceil(K / 16) of them whatever BK is (a k-tile
//   past K runs only the steps that hold some of K, so tiles with other BK give the same chain),
//   no split of K over warps or blocks. M, the tile and the element's place in it only decide
//   which thread holds the accumulator.
// - Tiles: 16 x 32 (4 warps side by side, 8 columns each) for decode, where the weights must be
//   streamed by many blocks; 64 x 128 (2 x 2 warps of 32 x 64) for prefill. Both stage their
//   tiles in shared memory through a cp.async pipeline, rows padded by 8 bf16 (16 bytes) so
//   that the fragment reads (8 rows x 4 words per instruction) fall in 32 different banks.
// - Fragments are read from shared memory as 32-bit words in the mma's register layout
//   (A: rows g and g + 8, k pairs 2t and 2t + 8; B: column g, k pairs 2t and 2t + 8, for lane =
//   4 g + t), so the weights sit in shared memory as [n][k] whatever their layout in memory:
//   kKN tiles are transposed on the way in (element stores, MLA's small per-head products).
// - Any shape and alignment: a 16-byte chunk is copied with cp.async when the rows allow it
//   (K, the stride and the base a multiple of 8 elements), chunks past M, N or K are zeros
//   stored directly, and other chunks are loaded element by element.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/dense_gemm.h"
#include "backend/cuda/grouped_gemm_kernel.cuh"  // cp.async and mma.sync helpers

namespace moeinfer::cuda {

namespace dense {

template <int BM_, int BN_, int WarpsM_, int WarpsN_, int BK_, int Stages_>
struct TileConfig {
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;
  static constexpr int kWarpsM = WarpsM_;
  static constexpr int kWarpsN = WarpsN_;
  static constexpr int BK = BK_;
  static constexpr int kStages = Stages_;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kWM = BM / kWarpsM;
  static constexpr int kWN = BN / kWarpsN;
  static constexpr int kMTiles = kWM / 16;
  static constexpr int kNTiles = kWN / 8;
  static constexpr int kStride = BK + 8;  // bf16 per shared-memory row
  static constexpr int kStageElems = (BM + BN) * kStride;
  static constexpr int kSmemBytes = kStages * kStageElems * 2;
  static_assert(kWM % 16 == 0 && kWN % 8 == 0, "warp tiles are whole mma tiles");
  static_assert(BK % 16 == 0 && BN % 8 == 0, "k-tiles are whole mma steps; kKN chunks whole");
  static_assert((kStride * 2) % 16 == 0, "cp.async needs 16-byte aligned shared rows");
};

// Rows of a [rows, K] operand with row stride ld move as 16-byte chunks when every row starts
// on 16 bytes and K fills whole chunks.
__device__ __forceinline__ bool rows_vectorizable(const __nv_bfloat16* base, int64_t ld,
                                                  int64_t batch_stride, int k) {
  return k % 8 == 0 && ld % 8 == 0 && batch_stride % 8 == 0 &&
         reinterpret_cast<uintptr_t>(base) % 16 == 0;
}

// Values k .. k + 7 of row `row` of a k-contiguous operand (rows past `rows` and values past K
// are zeros) into shared memory at dst.
__device__ __forceinline__ void load_k_chunk(__nv_bfloat16* dst, const __nv_bfloat16* base,
                                             int64_t ld, int row, int rows, int k, int K,
                                             bool vec) {
  if (row >= rows || k >= K) {
    // Zeros stored directly: a zero-filling cp.async would still need an aligned source.
    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  if (vec) {  // K % 8 == 0: the chunk lies wholly inside K
    gemm::cp_async_16(gemm::smem_u32(dst), base + static_cast<int64_t>(row) * ld + k, true);
    return;
  }
  const __nv_bfloat16* src = base + static_cast<int64_t>(row) * ld;
#pragma unroll
  for (int e = 0; e < 8; ++e) dst[e] = k + e < K ? src[k + e] : __float2bfloat16(0.0f);
}

}  // namespace dense

// grid (ceil(N / BN), ceil(M / BM), batch), Cfg::kThreads threads, Cfg::kSmemBytes dynamic
// shared memory. p is normalised by the launcher (lda, ldb, ldc set).
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    dense_gemm_kernel(const __grid_constant__ DenseGemmParams p) {
  using namespace dense;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStride = Cfg::kStride;
  constexpr int kThreads = Cfg::kThreads;
  extern __shared__ __align__(16) uint8_t dense_smem[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(dense_smem);

  const int M = static_cast<int>(p.m), N = static_cast<int>(p.n), K = static_cast<int>(p.k);
  const int m0 = static_cast<int>(blockIdx.y) * BM;
  const int n0 = static_cast<int>(blockIdx.x) * BN;
  const int64_t batch = blockIdx.z;
  const __nv_bfloat16* a = p.a + batch * p.batch_stride_a;
  const __nv_bfloat16* b_hi = p.b + batch * p.batch_stride_b;
  const __nv_bfloat16* b_lo = p.b_lo ? p.b_lo + batch * p.batch_stride_b : nullptr;
  const bool kn = p.b_layout == DenseLayout::kKN;
  const bool vec_a = rows_vectorizable(p.a, p.lda, p.batch_stride_a, K);
  const bool vec_b = !kn && rows_vectorizable(p.b, p.ldb, p.batch_stride_b, K) &&
                     (!p.b_lo || rows_vectorizable(p.b_lo, p.ldb, p.batch_stride_b, K));
  // kKN rows (one k each) hold N contiguous values: 8 of them move at once when aligned.
  const bool vec_kn = kn && N % 8 == 0 && p.ldb % 8 == 0 && p.batch_stride_b % 8 == 0 &&
                      reinterpret_cast<uintptr_t>(p.b) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(p.b_lo) % 16 == 0;
  // k-tiles [0, K_tiles) read b, [K_tiles, 2 K_tiles) read b_lo with the same a tiles.
  const int term_k_tiles = (K + BK - 1) / BK;
  // The operands' rows from this block's first row on.
  const __nv_bfloat16* a_rows = a + static_cast<int64_t>(m0) * p.lda;

  auto load_stage = [&](int stage, int tile) {
    const bool lo = tile >= term_k_tiles;
    const int k_tile = lo ? tile - term_k_tiles : tile;
    const __nv_bfloat16* b = lo ? b_lo : b_hi;
    const int k0 = k_tile * BK;
    __nv_bfloat16* s_a = smem + stage * Cfg::kStageElems;  // [BM][kStride]
    __nv_bfloat16* s_b = s_a + BM * kStride;               // [BN][kStride], k contiguous
    for (int c = threadIdx.x; c < BM * (BK / 8); c += kThreads) {
      const int r = c / (BK / 8), ch = c % (BK / 8);
      load_k_chunk(s_a + r * kStride + ch * 8, a_rows, p.lda, r, M - m0, k0 + ch * 8, K, vec_a);
    }
    if (!kn) {
      const __nv_bfloat16* b_rows = b + static_cast<int64_t>(n0) * p.ldb;
      for (int c = threadIdx.x; c < BN * (BK / 8); c += kThreads) {
        const int r = c / (BK / 8), ch = c % (BK / 8);
        load_k_chunk(s_b + r * kStride + ch * 8, b_rows, p.ldb, r, N - n0, k0 + ch * 8, K, vec_b);
      }
      return;
    }
    // kKN: chunk = 8 consecutive columns of one k row, transposed into [n][k].
    for (int c = threadIdx.x; c < BK * (BN / 8); c += kThreads) {
      const int kr = c / (BN / 8), nc = (c % (BN / 8)) * 8;
      const int k = k0 + kr, n = n0 + nc;
      __nv_bfloat16 v[8];
      const __nv_bfloat16* src = b + static_cast<int64_t>(k) * p.ldb + n;
      if (k < K && vec_kn && n + 8 <= N) {
        const uint4 word = *reinterpret_cast<const uint4*>(src);
        const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(&word);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = w[e];
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = k < K && n + e < N ? src[e] : __float2bfloat16(0.0f);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) s_b[(nc + e) * kStride + kr] = v[e];
    }
  };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;

  float acc[Cfg::kMTiles][Cfg::kNTiles][4];
#pragma unroll
  for (int i = 0; i < Cfg::kMTiles; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kNTiles; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.0f;

  const int num_k_tiles = term_k_tiles * (p.b_lo ? 2 : 1);
  const int k_steps = (K + 15) / 16;  // the mma steps of every element's chain, per term
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < num_k_tiles) load_stage(s, s);
    gemm::cp_async_commit();
  }
  auto word = [](const __nv_bfloat16* at) { return *reinterpret_cast<const uint32_t*>(at); };
  for (int kt = 0; kt < num_k_tiles; ++kt) {
    gemm::cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free to refill
    const int next = kt + Cfg::kStages - 1;
    if (next < num_k_tiles) load_stage(next % Cfg::kStages, next);
    gemm::cp_async_commit();

    const __nv_bfloat16* s_a = smem + (kt % Cfg::kStages) * Cfg::kStageElems;
    const __nv_bfloat16* s_b = s_a + BM * kStride;
    const int steps = min(BK / 16, k_steps - (kt % term_k_tiles) * (BK / 16));
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      if (kk >= steps) break;  // uniform: past K in this tile
      const int col = kk * 16 + 2 * t;
      uint32_t af[Cfg::kMTiles][4];
#pragma unroll
      for (int i = 0; i < Cfg::kMTiles; ++i) {
        const __nv_bfloat16* row = s_a + (warp_m * Cfg::kWM + i * 16 + g) * kStride + col;
        af[i][0] = word(row);
        af[i][1] = word(row + 8 * kStride);
        af[i][2] = word(row + 8);
        af[i][3] = word(row + 8 * kStride + 8);
      }
#pragma unroll
      for (int j = 0; j < Cfg::kNTiles; ++j) {
        const __nv_bfloat16* column = s_b + (warp_n * Cfg::kWN + j * 8 + g) * kStride + col;
        const uint32_t b0 = word(column), b1 = word(column + 8);
#pragma unroll
        for (int i = 0; i < Cfg::kMTiles; ++i) gemm::mma_bf16(acc[i][j], af[i], b0, b1);
      }
    }
  }
  gemm::cp_async_wait<0>();

  // c0, c1 at (g, 2t + {0, 1}); c2, c3 eight rows further down.
#pragma unroll
  for (int i = 0; i < Cfg::kMTiles; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + warp_m * Cfg::kWM + i * 16 + g + half * 8;
      if (row >= M) continue;
      const int64_t out_row = batch * p.batch_stride_c + static_cast<int64_t>(row) * p.ldc;
#pragma unroll
      for (int j = 0; j < Cfg::kNTiles; ++j) {
        const int col = n0 + warp_n * Cfg::kWN + j * 8 + 2 * t;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (col + e >= N) continue;
          const float v = acc[i][j][half * 2 + e];
          if (p.c_f32) {
            static_cast<float*>(p.c)[out_row + col + e] = v;
          } else {
            static_cast<__nv_bfloat16*>(p.c)[out_row + col + e] = __float2bfloat16_rn(v);
          }
        }
      }
    }
  }
}

}  // namespace moeinfer::cuda
