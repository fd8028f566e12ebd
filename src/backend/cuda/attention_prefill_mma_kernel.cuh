// Causal prefill attention on tensor cores (mma.sync m16n8k16, bf16 in, float32 softmax and
// accumulators), flash-attention style. Why built this way:
//
// - One block of 4 warps per (64-query tile, query head, sequence); each warp owns 16 query
//   rows, so the online softmax (running max and sum per row) never leaves the warp: a row's
//   scores live in the 4 lanes of one quad and reduce with two shuffles.
// - Q is loaded once into registers as mma A fragments. K and V tiles of 64 keys are double-
//   buffered in shared memory with cp.async (the next tile loads while this one is used), rows
//   of D bf16 with 16-byte chunks XOR-swizzled by (row & 7) so every ldmatrix is conflict-free.
// - S = Q K^T takes K as the col-major B operand straight from its [key, D] rows (ldmatrix);
//   P V takes V through ldmatrix.trans; P never touches shared memory: the S accumulator
//   fragment of two adjacent 8-key tiles is exactly the A fragment of one 16-key step.
// - exp2 with the scale folded into log2(e); -inf masking only on the diagonal, tail and
//   window-edge tiles; tiles past the diagonal, and under a sliding window W the tiles wholly
//   before the first query's window (key q0 - W + 1), are never loaded. A row wholly masked in
//   a tile (past the sequence, or a later row of the query tile whose window starts further on)
//   keeps max -inf, sum 0 and a zero accumulator (no NaN: the max used falls back to 0, so
//   alpha = exp2(-inf) = 0 and every p = 0); rows past the sequence are not written.
#pragma once

#include <cuda_bf16.h>

#include <climits>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_kernel.cuh"  // attn::first_visible_key
#include "backend/cuda/grouped_gemm_kernel.cuh"

namespace moeinfer::cuda {

namespace attn {

inline constexpr int kMmaQ = 64;   // queries per block
inline constexpr int kMmaKV = 64;  // keys per tile
inline constexpr int kMmaThreads = 128;

template <int D>
constexpr int prefill_mma_smem_bytes() {
  return (kMmaQ + 4 * kMmaKV) * D * 2;  // Q, two K and two V buffers
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The byte offset of 16-byte chunk `chunk` of tile row `row` (rows of D bf16), the chunks
// XOR-swizzled by (row & 7) so that ldmatrix of 8 rows at one chunk hits 8 bank groups.
template <int D>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  return static_cast<uint32_t>((row * (D / 8) + (chunk ^ (row & 7))) * 16);
}

// Online softmax over one key tile of a warp's 16 rows (mma.sync accumulator layout: this
// thread's rows lane / 4 and lane / 4 + 8 are halves 0 and 1, four lanes share a row). The
// scores `s`, already in log2 units and masked to -inf, become exp2(s - running max); each row's
// running max `m` and sum `l` are updated, and its output accumulators `o` rescaled.
template <int kNT, int kDT>
__device__ __forceinline__ void online_softmax_update(float (&s)[kNT][4], float (&m)[2],
                                                      float (&l)[2], float (&o)[kDT][4]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[half], mx);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2f(m[half] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      s[j][2 * half] = exp2f(s[j][2 * half] - m_use);
      s[j][2 * half + 1] = exp2f(s[j][2 * half + 1] - m_use);
      sum += s[j][2 * half] + s[j][2 * half + 1];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l[half] = l[half] * alpha + sum;
    m[half] = m_new;
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      o[j][2 * half] *= alpha;
      o[j][2 * half + 1] *= alpha;
    }
  }
}

// O += P V for one key tile: P is the warp's probabilities `s` (two adjacent 8-key score tiles
// form the A fragment of one 16-key step, rounded to bf16), V the tile at shared address `sv`.
template <int D>
__device__ __forceinline__ void accumulate_pv(float (&o)[D / 8][4], const float (&s)[kMmaKV / 8][4],
                                              uint32_t sv, int lane) {
#pragma unroll
  for (int kk = 0; kk < kMmaKV / 16; ++kk) {
    const uint32_t a[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                           pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                           pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int j = 0; j < D / 8; j += 2) {
      uint32_t bv[4];
      ldmatrix_x4_trans(
          bv, sv + tile_offset<D>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, j + (lane >> 4)));
      gemm::mma_bf16(o[j], a, bv[0], bv[1]);
      gemm::mma_bf16(o[j + 1], a, bv[2], bv[3]);
    }
  }
}

}  // namespace attn

template <int D>
__global__ void __launch_bounds__(attn::kMmaThreads)
    prefill_attention_mma_kernel(const __grid_constant__ PrefillParams p) {
  using namespace attn;
  using gemm::cp_async_16;
  using gemm::ldmatrix_x4;
  using gemm::mma_bf16;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTileBytes = kMmaKV * D * 2;
  constexpr int kNT = kMmaKV / 8;  // 8-key score tiles per warp
  constexpr int kDT = D / 8;       // 8-wide output tiles per warp
  extern __shared__ __align__(128) uint8_t prefill_smem[];
  const uint32_t s_q = gemm::smem_u32(prefill_smem);
  const uint32_t s_k = s_q + kMmaQ * D * 2;
  const uint32_t s_v = s_k + 2 * kTileBytes;
  auto offset = [](int row, int chunk) {
    return static_cast<uint32_t>((row * kChunks + (chunk ^ (row & 7))) * 16);
  };

  const int b = blockIdx.z, h = blockIdx.y;
  const int seq0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - seq0;
  const int q0 = blockIdx.x * kMmaQ;
  if (q0 >= len) return;
  const int G = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int kvh = h / G;
  const int64_t q_stride = p.num_q_heads * D, kv_stride = p.num_kv_heads * D;
  const __nv_bfloat16* q_base = p.q + (static_cast<int64_t>(seq0) + q0) * q_stride + h * D;
  const __nv_bfloat16* k_base = p.k + static_cast<int64_t>(seq0) * kv_stride + kvh * D;
  const __nv_bfloat16* v_base = p.v + static_cast<int64_t>(seq0) * kv_stride + kvh * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int c = tid; c < kMmaQ * kChunks; c += kMmaThreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = q0 + r < len;
    cp_async_16(s_q + offset(r, ch), q_base + (valid ? r : 0) * q_stride + ch * 8, valid);
  }
  auto load_kv = [&](int buffer, int kv0) {
    for (int c = tid; c < kMmaKV * kChunks; c += kMmaThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = kv0 + r < len;
      const int64_t row = valid ? kv0 + r : 0;
      cp_async_16(s_k + buffer * kTileBytes + offset(r, ch), k_base + row * kv_stride + ch * 8,
                  valid);
      cp_async_16(s_v + buffer * kTileBytes + offset(r, ch), v_base + row * kv_stride + ch * 8,
                  valid);
    }
  };
  const int kv_end = min(len, q0 + kMmaQ);
  // Keys before a row's first_visible_key are masked (a window's start, a chunk's start); the
  // tile's earliest row q0 has the earliest first key, its latest row the latest.
  const int window = prefill_window(p, len), chunk = prefill_chunk(p, len);
  const int kv_begin = first_visible_key(q0, window, chunk) / kMmaKV * kMmaKV;
  const int last_first_key = first_visible_key(q0 + kMmaQ - 1, window, chunk);
  const int num_tiles = (kv_end - kv_begin + kMmaKV - 1) / kMmaKV;
  load_kv(0, kv_begin);
  gemm::cp_async_commit();

  uint32_t qf[D / 16][4];
  float o[kDT][4];
#pragma unroll
  for (int j = 0; j < kDT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int row_a = q0 + warp * 16 + (lane >> 2);  // this thread's rows: row_a, row_a + 8

  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) load_kv((t + 1) & 1, kv_begin + (t + 1) * kMmaKV);
    gemm::cp_async_commit();
    gemm::cp_async_wait<1>();
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], s_q + offset(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }
    const uint32_t sk = s_k + (t & 1) * kTileBytes, sv = s_v + (t & 1) * kTileBytes;

    // S = Q K^T for this warp's 16 rows and the tile's 64 keys.
    float s[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < kNT; j += 2) {
        uint32_t bk[4];
        ldmatrix_x4(
            bk, sk + offset(j * 8 + ((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
        mma_bf16(s[j], qf[kk], bk[0], bk[1]);
        mma_bf16(s[j + 1], qf[kk], bk[2], bk[3]);
      }
    }

    // Scale, mask, online softmax.
    const int kv0 = kv_begin + t * kMmaKV;
    // Diagonal, tail, or window / chunk edge (the latest row's first key is past the tile's
    // first key; under a window W: the latest row minus the earliest key reaches W).
    const bool masked_tile = kv0 + kMmaKV > q0 || kv0 + kMmaKV > len || last_first_key > kv0;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * scale_log2;
        if (masked_tile) {
          const int col = kv0 + j * 8 + (lane & 3) * 2 + (e & 1);
          const int row = row_a + (e >> 1) * 8;
          if (col > row || col >= len || col < first_visible_key(row, window, chunk)) {
            v = -INFINITY;
          }
        }
        s[j][e] = v;
      }
    }
online_softmax_update(s, m, l, o);
    accumulate_pv<D>(o, s, sv, lane);
    __syncthreads();  // this buffer is reloaded two tiles from now
  }

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_a + half * 8;
    if (row >= len) continue;
    // Row `row` sees at least key `row`, so m is finite; log2 units, as the scores.
    const float inv = p.sinks != nullptr
                          ? sink_normaliser_log2(m[half], l[half], __ldg(p.sinks + h))
                          : 1.f / l[half];
    __nv_bfloat16* out = p.out + (static_cast<int64_t>(seq0) + row) * q_stride + h * D;
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(out + j * 8 + (lane & 3) * 2) =
          __floats2bfloat162_rn(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
    }
  }
}

}  // namespace moeinfer::cuda
