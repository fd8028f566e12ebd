// Paged decode attention on tensor cores (mma.sync m16n8k16), the default decode kernel since
// it measured 2.4x to 9x faster than the CUDA-core one (bench/RESULTS.md), whose time is bound
// by instruction latency (per key, G dependent dot products ending in shuffle reductions), not
// by the K/V bytes. Why built this way:
//
// - The G query heads that share a KV head are the 16 rows of one mma tile (rows G..15 are
//   zero), so one block per (split, KV head, sequence) reads each K/V byte once and a 16-key
//   step is two mma for the scores and D/8 for the values, whatever G is.
// - The block's chunk of keys is cut into 4 contiguous ranges, one per warp. Each warp streams
//   its keys in 16-key tiles through its own double-buffered shared memory (cp.async, the page
//   of each key looked up in the block table), keeps its own online softmax in the accumulator
//   fragments' quads, and the 4 warps' (max, sum, output) are merged through shared memory at
//   the end; the merged result is written directly or, with several splits, to the workspace
//   for paged_decode_combine_kernel.
// - A sliding window moves the start of the split range to the window's first key
//   (attn::decode_first_key), so every key a block loads is visible: no per-key window mask,
//   and blocks whose split lies past the window's keys exit at once.
// - Scores are in the log2 domain (the scale folded with log2(e)); the workspace takes the max
//   back in natural units, as the CUDA-core kernel writes it.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_kernel.cuh"
#include "backend/cuda/attention_prefill_mma_kernel.cuh"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/grouped_gemm_kernel.cuh"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda {

namespace attn {

inline constexpr int kDecodeMmaWarps = 4;
inline constexpr int kDecodeMmaThreads = kDecodeMmaWarps * 32;
inline constexpr int kDecodeMmaKeys = 16;  // keys per warp step

template <int D>
constexpr int decode_mma_smem_bytes() {
  // Q [16, D] bf16, then per warp two buffers of K and V [16, D] bf16; the merge at the end
  // reuses the warp buffers for [warps, 16, D] float32 outputs.
  constexpr int q = 16 * D * 2;
  constexpr int buffers = kDecodeMmaWarps * 2 * 2 * kDecodeMmaKeys * D * 2;
  constexpr int merge = kDecodeMmaWarps * 16 * D * 4;
  return q + (buffers > merge ? buffers : merge);
}

}  // namespace attn

// grid (num_splits, Nkv, B), kDecodeMmaThreads threads, decode_mma_smem_bytes<D>() bytes.
// kFp8: the cache is e4m3 codes and scales (kv_fp8.cuh); a tile's rows are loaded into registers
// (8 codes a lane-chunk), decoded to bf16 and stored at the same swizzled places the bf16 path's
// cp.async fills, so everything after the load is the same code.
template <int D, bool kFp8>
__global__ void __launch_bounds__(attn::kDecodeMmaThreads)
    paged_decode_mma_kernel(const __grid_constant__ PagedDecodeParams p, int chunk,
                            int num_splits) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  using namespace attn;
  using gemm::cp_async_16;
  using gemm::ldmatrix_x4;
  using gemm::mma_bf16;
  constexpr int kChunks = D / 8;
  constexpr int kTileBytes = kDecodeMmaKeys * D * 2;
  constexpr int kDT = D / 8;
  extern __shared__ __align__(128) uint8_t decode_smem[];
  __shared__ float s_m[kDecodeMmaWarps][16], s_l[kDecodeMmaWarps][16];
  const uint32_t s_q = gemm::smem_u32(decode_smem);
  auto offset = [](int row, int c) {
    return static_cast<uint32_t>((row * kChunks + (c ^ (row & 7))) * 16);
  };

  const DecodeHeads heads = decode_heads(p, blockIdx.y);
  const int split = blockIdx.x, kvh = heads.kvh, b = blockIdx.z;
  const int G = heads.count;  // query heads of this block: rows of the mma tile
  const int len = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(len >= 0 && len <= p.max_seq_len);
  const int start = attn::decode_first_key(p, len) + split * chunk;
  const int end = min(len, start + chunk);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t head0 = static_cast<int64_t>(b) * p.num_q_heads + heads.first;
  // With tickets (merge_in_kernel), the splits that have keys merge here, the last to finish.
  const bool merge_in_kernel = num_splits > 1 && p.split_tickets != nullptr;
  const int live = attn::live_splits(p, len, chunk);
  if (start >= end) {
    // A split past this sequence's keys (the combine does not read it), or an empty sequence:
    // zeros, written by the one block (unsplit) or by split 0 where no split merges.
    if (num_splits == 1 || (merge_in_kernel && split == 0 && live <= 0)) {
      for (int i = tid; i < G * D; i += kDecodeMmaThreads)
        p.out[head0 * D + i] = __float2bfloat16(0.f);
    }
    return;
  }
  const int n = end - start;

  // Q: rows g < G from the G heads, the rest zero.
  for (int c = tid; c < 16 * kChunks; c += kDecodeMmaThreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = r < G;
    cp_async_16(s_q + offset(r, ch), p.q + (head0 + (valid ? r : 0)) * D + ch * 8, valid);
  }
  gemm::cp_async_commit();
  gemm::cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qf[kk], s_q + offset(lane & 15, kk * 2 + (lane >> 4)));

  // This warp's keys: [ws, we) of the chunk.
  const int per_warp = (n + kDecodeMmaWarps * kDecodeMmaKeys - 1) /
                       (kDecodeMmaWarps * kDecodeMmaKeys) * kDecodeMmaKeys;
  const int ws = min(n, warp * per_warp), we = min(n, ws + per_warp);
  const int num_tiles = (we - ws + kDecodeMmaKeys - 1) / kDecodeMmaKeys;
  const uint32_t s_k = s_q + 16 * D * 2 + warp * 4 * kTileBytes;  // [2] K then [2] V
  const uint32_t s_v = s_k + 2 * kTileBytes;
  auto load_tile = [&](int buffer, int key0) {
    for (int c = lane; c < kDecodeMmaKeys * kChunks; c += 32) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = key0 + r < we;
      const int64_t row = attn::kv_head_row(p, b, start + (valid ? key0 + r : ws), kvh);
      const int64_t base = row * D;
      if constexpr (kFp8) {
        // Rows past the warp's keys are zeros, as cp.async's zero fill leaves them: their
        // scores are masked, but a NaN value row would still poison P.V.
        uint4 k8 = make_uint4(0, 0, 0, 0), v8 = make_uint4(0, 0, 0, 0);
        if (valid) {
          k8 = kvfp8::decode8_bf16(__ldg(reinterpret_cast<const uint2*>(p.k_codes + base) + ch),
                                   __ldg(p.k_scales + row));
          v8 = kvfp8::decode8_bf16(__ldg(reinterpret_cast<const uint2*>(p.v_codes + base) + ch),
                                   __ldg(p.v_scales + row));
        }
        // Generic pointers to the shared-memory places of the u32 addresses below.
        *reinterpret_cast<uint4*>(decode_smem + (s_k + buffer * kTileBytes + offset(r, ch) - s_q)) =
            k8;
        *reinterpret_cast<uint4*>(decode_smem + (s_v + buffer * kTileBytes + offset(r, ch) - s_q)) =
            v8;
      } else {
        cp_async_16(s_k + buffer * kTileBytes + offset(r, ch), p.k_cache + base + ch * 8, valid);
        cp_async_16(s_v + buffer * kTileBytes + offset(r, ch), p.v_cache + base + ch * 8, valid);
      }
    }
  };

  float o[kDT][4];
#pragma unroll
  for (int j = 0; j < kDT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * 1.4426950408889634f;

  if (num_tiles > 0) load_tile(0, ws);
  gemm::cp_async_commit();
  for (int t = 0; t < num_tiles; ++t) {
    if (t + 1 < num_tiles) load_tile((t + 1) & 1, ws + (t + 1) * kDecodeMmaKeys);
    gemm::cp_async_commit();
    gemm::cp_async_wait<1>();
    __syncwarp();
    const uint32_t sk = s_k + (t & 1) * kTileBytes, sv = s_v + (t & 1) * kTileBytes;
    float s[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t bk[4];
      ldmatrix_x4(bk, sk + offset(((lane >> 4) << 3) + (lane & 7), kk * 2 + ((lane >> 3) & 1)));
      mma_bf16(s[0], qf[kk], bk[0], bk[1]);
      mma_bf16(s[1], qf[kk], bk[2], bk[3]);
    }
    const int key0 = ws + t * kDecodeMmaKeys;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + j * 8 + (lane & 3) * 2 + (e & 1);
        s[j][e] = key < we ? s[j][e] * scale_log2 : -INFINITY;
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = fmaxf(fmaxf(s[0][2 * half], s[0][2 * half + 1]),
                       fmaxf(s[1][2 * half], s[1][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[half], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[half] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
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
    const uint32_t a[4] = {pack_bf16x2(s[0][0], s[0][1]), pack_bf16x2(s[0][2], s[0][3]),
                           pack_bf16x2(s[1][0], s[1][1]), pack_bf16x2(s[1][2], s[1][3])};
#pragma unroll
    for (int j = 0; j < kDT; j += 2) {
      uint32_t bv[4];
      ldmatrix_x4_trans(bv, sv + offset((lane & 7) + ((lane >> 3) & 1) * 8, j + (lane >> 4)));
      mma_bf16(o[j], a, bv[0], bv[1]);
      mma_bf16(o[j + 1], a, bv[2], bv[3]);
    }
    __syncwarp();  // this buffer is reloaded two tiles from now
  }
  gemm::cp_async_wait<0>();

  // Merge the warps: every warp's rows lane/4 and lane/4 + 8 into shared memory.
  __syncthreads();  // all warps are done with their K/V buffers
  float* s_o = reinterpret_cast<float*>(decode_smem + 16 * D * 2);  // [warps, 16, D]
  const int r0 = lane >> 2;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r0 + half * 8;
    if ((lane & 3) == 0) {
      s_m[warp][r] = m[half];
      s_l[warp][r] = l[half];
    }
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      const int d = j * 8 + (lane & 3) * 2;
      s_o[(warp * 16 + r) * D + d] = o[j][2 * half];
      s_o[(warp * 16 + r) * D + d + 1] = o[j][2 * half + 1];
    }
  }
  __syncthreads();
  for (int i = tid; i < G * D; i += kDecodeMmaThreads) {
    const int g = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeMmaWarps; ++w) mx = fmaxf(mx, s_m[w][g]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeMmaWarps; ++w) {
      const float weight = s_m[w][g] == -INFINITY ? 0.f : exp2f(s_m[w][g] - mx);
      num = fmaf(weight, s_o[(w * 16 + g) * D + d], num);
      den = fmaf(weight, s_l[w][g], den);
    }
    const int64_t bh = head0 + g;
    if (num_splits == 1) {
      // A sink joins the denominator here, once (split launches: in the combine kernel).
      const float o = p.sinks != nullptr
                          ? num * sink_normaliser_log2(mx, den, __ldg(p.sinks + heads.first + g))
                          : num / den;
      p.out[bh * D + d] = __float2bfloat16_rn(o);
    } else {
      p.workspace[(bh * num_splits + split) * D + d] = num;
      if (d == 0) {
        float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
        ml[(bh * num_splits + split) * 2] = mx * 0.6931471805599453f;  // back to natural units
        ml[(bh * num_splits + split) * 2 + 1] = den;
      }
    }
  }
  if (!merge_in_kernel) return;
  // This block's partials reach L2 before its ticket; the last block reads them all after its.
  __threadfence();
  __syncthreads();
  __shared__ int s_last;
  if (tid == 0) {
    int32_t* ticket = p.split_tickets + static_cast<int64_t>(b) * gridDim.y + blockIdx.y;
    s_last = atomicAdd(ticket, 1) == live - 1;
    if (s_last) *ticket = 0;  // every live split has taken its ticket: zero for the next launch
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // The combine kernel's merge, in its order (merge_split_outputs), over L2: the other blocks'
  // partials were never in this SM's L1, and must not be read through it.
  const float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
  for (int i = tid; i < G * D; i += kDecodeMmaThreads) {
    const int g = i / D, d = i % D;
    const int64_t bh = head0 + g;
    float m = -FLT_MAX;
    for (int s = 0; s < live; ++s) m = fmaxf(m, __ldcg(ml + (bh * num_splits + s) * 2));
    const float o = attn::merge_split_outputs(p, bh, heads.first + g, d, D, live, num_splits, m,
                                              [](const float* at) { return __ldcg(at); });
    p.out[bh * D + d] = __float2bfloat16_rn(o);
  }
}

}  // namespace moeinfer::cuda
