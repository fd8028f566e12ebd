// Paged decode attention for head dims above 256 (padded to a multiple of 64). No published MoE
// model has one; this kernel exists so that every head dim the CPU decoder runs also runs on the
// GPU, and the fast kernels at 64, 128 and 256 stay as they are. Why built this way:
//
// - Nothing it holds grows with D, so no head dim is too wide for shared memory or registers:
//   q is staged 256 dims at a time and the scores are summed over those dim chunks, and a block
//   owns at most 512 output dims (kWideDimTile). A wider head takes ceil(D / 512) blocks per
//   (split, head tile, sequence), each computing the same scores, so K is read ceil(D / 512)
//   times and V once.
// - Keys stream in tiles of 64 with an online softmax (running max and sum per head in shared
//   memory), so a split may hold any number of keys: the launcher plans splits as for the
//   tensor-core kernel (only to fill the GPU), and --deterministic's fixed chunks work unchanged.
// - Scores: one warp per key row, each lane a 16-byte slice of the row's 256-dim chunk dotted
//   with the G query heads and reduced with shuffles. Values: each thread owns two adjacent
//   dims per 256-dim step for all G heads (one 4-byte load per key; a warp reads 128 contiguous
//   bytes of the row).
// - Float32 on CUDA cores throughout (P is not rounded to bf16), whatever
//   PagedDecodeParams::tensor_cores says: correct first, and it is the only kernel at these dims.
// - The split plan, the workspace layout ([B, Nq, splits, D] partial outputs, then [B, Nq,
//   splits, 2] max and sum in natural units), the head tiles of large GQA groups
//   (attn::decode_heads) and the window start (attn::decode_first_key) are the other decode
//   kernels'; the combine kernel below is the CUDA-core one with D walked in a loop.
// - A block's result depends only on its sequence's keys, its split and its chunk (the tile
//   walk starts at the split's first key), and the combine sums splits in order, so fixed
//   chunks give the same bits whatever else the batch holds.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_kernel.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"

namespace moeinfer::cuda {

namespace attn {

inline constexpr int kWideThreads = 128;
inline constexpr int kWideWarps = kWideThreads / 32;
inline constexpr int kWideKeys = 64;       // keys per tile: their scores sit in shared memory
inline constexpr int kWideQDims = 256;     // q dims staged per step: 32 lanes x 8
inline constexpr int kWideKeyBatch = 4;    // key rows a warp loads before it reduces them
inline constexpr int kWideValueBatch = 4;  // value rows a thread loads before it uses them
inline constexpr int kWideDimSteps = 2;    // 256-dim output steps per block
inline constexpr int kWideDimStep = 2 * kWideThreads;              // 256: two dims a thread
inline constexpr int kWideDimTile = kWideDimSteps * kWideDimStep;  // 512 output dims a block
inline constexpr int kWideCombineThreads = 256;
static_assert(kWideKeys <= kWideThreads, "one thread looks up each key's row");
static_assert(kMaxG % 4 == 0, "scores are read four heads at a time");

// Blocks per (split, head tile, sequence): one per 512 output dims.
__host__ __device__ inline int64_t decode_dim_tiles(int64_t head_dim) {
  return (head_dim + kWideDimTile - 1) / kWideDimTile;
}

}  // namespace attn

// grid (num_splits, Nkv * decode_head_tiles * decode_dim_tiles, B), kWideThreads threads, static
// shared memory. blockIdx.y = head tile * dim tiles + dim tile.
__global__ void __launch_bounds__(attn::kWideThreads)
    paged_decode_wide_kernel(const __grid_constant__ PagedDecodeParams p, int chunk,
                             int num_splits) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  using namespace attn;
  __shared__ __align__(16) float s_q[kMaxG][kWideQDims];  // [G, 256] a dim chunk of q, scaled
  __shared__ __align__(16) float s_p[kWideKeys][kMaxG];   // [keys, G] scores, then exp(s - m)
  __shared__ int64_t s_row[kWideKeys];  // [keys] offset of each key's row of KV head kvh
  __shared__ float s_m[kMaxG], s_l[kMaxG], s_alpha[kMaxG];  // running max, sum; this tile's rescale

  const int D = static_cast<int>(p.head_dim);
  const int dim_tiles = static_cast<int>(decode_dim_tiles(p.head_dim));
  const DecodeHeads heads = decode_heads(p, static_cast<int>(blockIdx.y) / dim_tiles);
  const int dim_tile = static_cast<int>(blockIdx.y) % dim_tiles;
  const int dim0 = dim_tile * kWideDimTile, dim_end = min(D, dim0 + kWideDimTile);
  const int G = heads.count, kvh = heads.kvh;
  const int split = blockIdx.x, b = blockIdx.z;
  const int len = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(len >= 0 && len <= p.max_seq_len);
  const int start = decode_first_key(p, len) + split * chunk;
  const int end = min(len, start + chunk);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t head0 = static_cast<int64_t>(b) * p.num_q_heads + heads.first;
  if (start >= end) {
    // A split past this sequence's keys (the combine kernel does not read it), or, unsplit, an
    // empty sequence: zeros in this block's dims.
    if (num_splits == 1) {
      for (int g = 0; g < G; ++g)
        for (int d = dim0 + tid; d < dim_end; d += kWideThreads)
          p.out[(head0 + g) * D + d] = __float2bfloat16(0.f);
    }
    return;
  }

  if (tid < kMaxG) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.f;
  }
  // Heads G..15 of s_p stay zero: step 3 reads the scores four heads at a time.
  for (int i = tid; i < kWideKeys * kMaxG; i += kWideThreads) s_p[i / kMaxG][i % kMaxG] = 0.f;
  // acc[j][g][e]: head g's unnormalised output at dim dim0 + j * 256 + 2 * tid + e.
  float acc[kWideDimSteps][kMaxG][2];
#pragma unroll
  for (int j = 0; j < kWideDimSteps; ++j)
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) acc[j][g][0] = acc[j][g][1] = 0.f;

  for (int k0 = start; k0 < end; k0 += kWideKeys) {
    const int nk = min(kWideKeys, end - k0);  // keys of this tile, 1..64
    __syncthreads();  // the previous tile's s_row, s_p and s_alpha are consumed
    if (tid < nk) s_row[tid] = kv_row(p, b, k0 + tid, kvh);

    // 1. s_p[t][g] = scale * q_g . k_t, summed over 256-dim chunks of the head.
    for (int c0 = 0; c0 < D; c0 += kWideQDims) {
      const int width = min(kWideQDims, D - c0);  // a multiple of 8
      // The previous chunk's s_q is consumed.
      __syncthreads();
      for (int i = tid; i < G * kWideQDims; i += kWideThreads) {
        const int g = i / kWideQDims, d = i % kWideQDims;
        s_q[g][d] = d < width ? __bfloat162float(p.q[(head0 + g) * D + c0 + d]) * p.scale : 0.f;
      }
      // s_q (and, on the first chunk, s_row) written.
      __syncthreads();
      const bool lane_dims = lane * 8 < width;  // this lane's 8 dims lie inside the head
      // Warp-uniform loops: every lane takes part in the shuffles.
      for (int t0 = warp * kWideKeyBatch; t0 < nk; t0 += kWideWarps * kWideKeyBatch) {
        uint4 k_vec[kWideKeyBatch];
#pragma unroll
        for (int u = 0; u < kWideKeyBatch; ++u) {
          const int t = t0 + u;
          k_vec[u] = make_uint4(0, 0, 0, 0);
          if (t < nk && lane_dims)
            k_vec[u] = __ldg(reinterpret_cast<const uint4*>(p.k_cache + s_row[t] + c0) + lane);
        }
#pragma unroll
        for (int u = 0; u < kWideKeyBatch; ++u) {
          const int t = t0 + u;
          if (t >= nk) break;
          float k[8];
          device::bf16x8_to_float(k_vec[u], k);
#pragma unroll
          for (int g = 0; g < kMaxG; ++g) {
            if (g >= G) break;
            float q[8];
            device::load_float8(&s_q[g][0], lane, q);
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) dot = fmaf(q[i], k[i], dot);
            dot = device::warp_sum(dot);
            // Key t belongs to this warp in every chunk, so only its lane 0 touches s_p[t].
            if (lane == 0) s_p[t][g] = (c0 == 0 ? 0.f : s_p[t][g]) + dot;
          }
        }
      }
    }
    __syncthreads();  // s_p holds the tile's scores

    // 2. Online softmax over the tile, one warp per head: s_p becomes exp(s - m_new), the
    // running sum takes the tile's, and s_alpha[g] = exp(m_old - m_new) rescales what the
    // accumulators hold (0 on the first tile, where m_old = -inf).
    for (int g = warp; g < G; g += kWideWarps) {
      float mx = -INFINITY;
      for (int t = lane; t < nk; t += 32) mx = fmaxf(mx, s_p[t][g]);
      mx = device::warp_max(mx);
      const float m_old = s_m[g];
      const float m_new = fmaxf(m_old, mx);  // finite: the tile has at least one key
      float sum = 0.f;
      for (int t = lane; t < nk; t += 32) {
        const float e = __expf(s_p[t][g] - m_new);
        s_p[t][g] = e;
        sum += e;
      }
      sum = device::warp_sum(sum);
      __syncwarp();  // every lane has read s_m[g] before lane 0 replaces it
      if (lane == 0) {
        const float alpha = __expf(m_old - m_new);
        s_alpha[g] = alpha;
        s_l[g] = s_l[g] * alpha + sum;
        s_m[g] = m_new;
      }
    }
    __syncthreads();  // s_p, s_alpha, s_m, s_l updated

    // 3. acc = alpha * acc + P V over this thread's dims.
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g >= G) break;
      const float alpha = s_alpha[g];
#pragma unroll
      for (int j = 0; j < kWideDimSteps; ++j) {
        acc[j][g][0] *= alpha;
        acc[j][g][1] *= alpha;
      }
    }
    for (int t0 = 0; t0 < nk; t0 += kWideValueBatch) {
      float2 v[kWideValueBatch][kWideDimSteps];
#pragma unroll
      for (int u = 0; u < kWideValueBatch; ++u) {
        const int t = t0 + u;
#pragma unroll
        for (int j = 0; j < kWideDimSteps; ++j) {
          const int d = dim0 + j * kWideDimStep + 2 * tid;  // even, and D is: d + 1 < dim_end too
          v[u][j] = make_float2(0.f, 0.f);
          if (t < nk && d < dim_end) {
            v[u][j] = __bfloat1622float2(
                __ldg(reinterpret_cast<const __nv_bfloat162*>(p.v_cache + s_row[t] + d)));
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kWideValueBatch; ++u) {
        const int t = t0 + u;
        if (t >= nk) break;
        const float4* probs = reinterpret_cast<const float4*>(&s_p[t][0]);
#pragma unroll
        for (int g4 = 0; g4 < kMaxG / 4; ++g4) {
          if (4 * g4 >= G) break;
          const float4 pr = probs[g4];
          const float pg[4] = {pr.x, pr.y, pr.z, pr.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int g = 4 * g4 + i;
#pragma unroll
            for (int j = 0; j < kWideDimSteps; ++j) {
              acc[j][g][0] = fmaf(pg[i], v[u][j].x, acc[j][g][0]);
              acc[j][g][1] = fmaf(pg[i], v[u][j].y, acc[j][g][1]);
            }
          }
        }
      }
    }
  }

  // The last tile's __syncthreads after step 2 published the final s_m and s_l.
#pragma unroll
  for (int j = 0; j < kWideDimSteps; ++j) {
    const int d = dim0 + j * kWideDimStep + 2 * tid;
    if (d >= dim_end) continue;
#pragma unroll
    for (int g = 0; g < kMaxG; ++g) {
      if (g >= G) break;
      const int64_t bh = head0 + g;
      if (num_splits == 1) {
        // A sink joins the denominator here, once (split launches: in the combine kernel).
        const float inv =
            p.sinks != nullptr
                ? sink_normaliser(s_m[g], s_l[g], __ldg(p.sinks + heads.first + g))
                : 1.f / s_l[g];
        p.out[bh * D + d] = __float2bfloat16_rn(acc[j][g][0] * inv);
        p.out[bh * D + d + 1] = __float2bfloat16_rn(acc[j][g][1] * inv);
      } else {
        float* partial = p.workspace + (bh * num_splits + split) * D;
        partial[d] = acc[j][g][0];
        partial[d + 1] = acc[j][g][1];
      }
    }
  }
  // Every dim tile computed the same max and sum; the first writes them.
  if (num_splits > 1 && dim_tile == 0 && tid < G) {
    const int64_t bh = head0 + tid;
    float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
    ml[(bh * num_splits + split) * 2] = s_m[tid];
    ml[(bh * num_splits + split) * 2 + 1] = s_l[tid];
  }
}

// grid (Nq, B), kWideCombineThreads threads: merges the splits of one (sequence, head), as
// paged_decode_combine_kernel does, each thread walking the dims d = tid + 256 i.
__global__ void __launch_bounds__(attn::kWideCombineThreads)
    paged_decode_wide_combine_kernel(const __grid_constant__ PagedDecodeParams p, int chunk,
                                     int num_splits) {
  // The combine lets the kernel after it start before it waits: that kernel (the O projection)
  // streams its weights into L2 while the attention still runs. It reads this kernel's output
  // only after its own wait, which returns once this kernel, and so the attention, is done.
  device::allow_next_grid();
  device::wait_for_previous_grid();
  const int h = blockIdx.x, b = blockIdx.y;
  const int D = static_cast<int>(p.head_dim);
  const int len = __ldg(p.seq_lens + b);
  const int splits = (len - attn::decode_first_key(p, len) + chunk - 1) / chunk;
  const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + h;
  const float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, ml[(bh * num_splits + s) * 2]);
  for (int d = threadIdx.x; d < D; d += attn::kWideCombineThreads) {
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = __expf(ml[(bh * num_splits + s) * 2] - m);
      den = fmaf(w, ml[(bh * num_splits + s) * 2 + 1], den);
      num = fmaf(w, p.workspace[(bh * num_splits + s) * D + d], num);
    }
    float o = splits > 0 ? num / den : 0.f;
    // Relative to m, the splits' max: the sink joins the denominator once, here.
    if (p.sinks != nullptr && splits > 0) {
      o = num * attn::sink_normaliser(m, den, __ldg(p.sinks + h));
    }
    p.out[bh * D + d] = __float2bfloat16_rn(o);
  }
}

}  // namespace moeinfer::cuda
