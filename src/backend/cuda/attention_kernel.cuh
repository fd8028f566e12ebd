// Decode attention over the paged KV cache, and causal prefill attention. Why built this way:
//
// Decode (paged_decode_kernel): memory-bound on the K/V bytes. One block per (split, KV head,
// sequence) holds the G query heads that share the KV head (GQA packing), so every K/V byte is
// read from memory once per KV head. A block covers `chunk` tokens (a multiple of 32, at most
// 512): the host picks the chunk so that B * Nkv * splits fills the 132 SMs even at batch 1, and
// the combine kernel merges the splits' partial softmaxes (max, sum, unnormalised output) in
// float32. Under a sliding window of W keys (or chunked attention of C keys) the splits start at
// the window's (chunk's) first key (decode_first_key), so keys before it are never read and the
// host plans the splits over at most W (C) keys. Inside a block:
//   1. scores: D/8 lanes share a key row, each loading one 16-byte slice (coalesced through the
//      page), dotting it with the G query slices from shared memory and reducing with shuffles;
//      scores for the whole chunk stay in shared memory ([G, chunk] float32);
//   2. softmax over the chunk, one warp per head;
//   3. values: 64-token tiles of V are staged in shared memory with 16-byte loads, then each
//      thread accumulates its dims for its heads in registers.
// Prefill (prefill_attention_kernel): flash-style, one block per (32-query tile, head,
// sequence), 32-key tiles of K and V staged in shared memory as float32, the online softmax
// (running max, running sum, rescaled accumulator) kept per query row in float32, tiles past
// the causal diagonal and, under a sliding window, tiles wholly before the query tile's first
// window never loaded. CUDA-core FMAs: the reference the tensor-core version
// (attention_prefill_mma_kernel.cuh) is tested beside.
#pragma once

#include <cuda_bf16.h>

#include <cfloat>

#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda {

namespace attn {

inline constexpr int kDecodeThreads = 128;
inline constexpr int kDecodeVTile = 64;  // V rows staged per step
inline constexpr int kMaxG = static_cast<int>(kAttentionMaxGroup);

template <int D>
constexpr int decode_smem_bytes(int group, int chunk) {
  return group * chunk * 4 + group * D * 4 + kDecodeVTile * D * 2;
}

// The query heads one decode block serves: a KV head's group, cut into tiles of at most kMaxG
// heads when it is larger (grid.y = Nkv * decode_head_tiles); each tile reads the KV head's keys.
struct DecodeHeads {
  int kvh;                // the KV head
  int count;              // query heads in this tile, 1..kMaxG
  int first;              // the first one's index within the sequence's Nq heads
};

__host__ __device__ inline int64_t decode_head_tiles(const PagedDecodeParams& p) {
  const int64_t group = p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 1;
  return group > kMaxG ? (group + kMaxG - 1) / kMaxG : 1;
}

__device__ __forceinline__ DecodeHeads decode_heads(const PagedDecodeParams& p, int tile) {
  const int group = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int tiles = static_cast<int>(decode_head_tiles(p));
  const int kvh = tile / tiles, sub = tile % tiles;
  return DecodeHeads{.kvh = kvh,
                     .count = min(kMaxG, group - sub * kMaxG),
                     .first = kvh * group + sub * kMaxG};
}

// Index of the (slot, KV head) row holding `token` of sequence b: its scale under fp8; its
// first element is at kv_head_row * D.
__device__ __forceinline__ int64_t kv_head_row(const PagedDecodeParams& p, int b, int token,
                                               int kvh) {
  const int block = __ldg(p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq +
                          token / static_cast<int>(p.block_size));
  MOE_DEVICE_CHECK(block >= 0 && block < p.num_blocks);
  const int slot = token % static_cast<int>(p.block_size);
  return (static_cast<int64_t>(block) * p.block_size + slot) * p.num_kv_heads + kvh;
}

__device__ __forceinline__ int64_t kv_row(const PagedDecodeParams& p, int b, int token, int kvh) {
  return kv_head_row(p, b, token, kvh) * p.head_dim;
}

// The one rule of which keys a query sees, for every kernel here: the query at position
// pos >= 0 sees keys [first_visible_key(pos, ...), pos]. Under chunked local attention of C
// keys (Llama 4's chunked layers) the start of pos's block of C positions; under a sliding
// window of W keys pos - W + 1 (at least 0); else 0. It never decreases as pos grows, so the
// earliest query of a tile has the tile's earliest first key.
__device__ __forceinline__ int first_visible_key(int pos, int window, int chunk) {
  if (chunk > 0) return pos / chunk * chunk;
  if (window > 0) return max(0, pos - window + 1);
  return 0;
}

// First key the decode query (position len - 1) sees: first_visible_key, max(0, len - W) under
// a sliding window of W keys, 0 for an empty sequence. Splits of a sequence cover
// [first + s * chunk, ...) up to len; the decode kernels and the combine kernel derive the same
// split count from it.
__device__ __forceinline__ int decode_first_key(const PagedDecodeParams& p, int len) {
  if (p.attention_chunk > 0) {
    return len > 0 ? first_visible_key(len - 1, 0, static_cast<int>(p.attention_chunk)) : 0;
  }
  return p.sliding_window > 0 && p.sliding_window < len ? len - static_cast<int>(p.sliding_window)
                                                        : 0;
}

// Sliding window of a prefill sequence of len tokens as an int, 0 when it hides nothing
// (W >= len: every query i < len sees all of [0, i] anyway).
__device__ __forceinline__ int prefill_window(const PrefillParams& p, int len) {
  return p.sliding_window > 0 && p.sliding_window < len ? static_cast<int>(p.sliding_window) : 0;
}

// Attention chunk of a prefill sequence of len tokens as an int, 0 when it hides nothing
// (C >= len: every query lies in the first chunk).
__device__ __forceinline__ int prefill_chunk(const PrefillParams& p, int len) {
  return p.attention_chunk > 0 && p.attention_chunk < len ? static_cast<int>(p.attention_chunk)
                                                          : 0;
}

inline constexpr float kLog2e = 1.4426950408889634f;

// Attention sinks (PagedDecodeParams::sinks): where a query's softmax is finished, with m the
// keys' max and l their sum of exp(s - m), the factor that normalises the unnormalised output
// when the sink's logit joins the denominator: exp(m - M) / (l exp(m - M) + exp(sink - M)),
// M = max(m, sink), so neither term overflows whichever is larger. m = -inf (no key) gives 0.
__device__ __forceinline__ float sink_normaliser(float m, float l, float sink) {
  const float top = fmaxf(m, sink);
  const float keys = __expf(m - top);
  return keys / fmaf(l, keys, __expf(sink - top));
}
// The same with m in log2 units (the tensor-core kernels' exp2 domain); sink in natural units.
__device__ __forceinline__ float sink_normaliser_log2(float m, float l, float sink) {
  const float sink_log2 = sink * kLog2e;
  const float top = fmaxf(m, sink_log2);
  const float keys = exp2f(m - top);
  return keys / fmaf(l, keys, exp2f(sink_log2 - top));
}

}  // namespace attn

// grid (num_splits, Nkv * decode_head_tiles, B), kDecodeThreads threads, dynamic shared memory
// decode_smem_bytes<D>(min(group, kMaxG), chunk).
// kFp8: the cache is e4m3 codes and scales (kv_fp8.cuh): keys decode in registers after their
// 8-byte loads; a V tile is staged as codes [kDecodeVTile, D] and its row scales [kDecodeVTile]
// (within the bf16 tile's bytes) and decoded where step 3 reads it.
template <int D, bool kFp8>
__global__ void __launch_bounds__(attn::kDecodeThreads)
    paged_decode_kernel(const __grid_constant__ PagedDecodeParams p, int chunk, int num_splits) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  using namespace attn;
  constexpr int kLanes = D / 8;  // lanes per key row
  constexpr int kRowsPerPass = kDecodeThreads / kLanes;
  constexpr int kDimThreads = D < kDecodeThreads ? D : kDecodeThreads;
  constexpr int kDimsPerThread = D / kDimThreads;            // 1 or 2
  constexpr int kHeadStride = kDecodeThreads / kDimThreads;  // heads apart per thread: 1 or 2
  constexpr int kHeadsPerThread = (kMaxG + kHeadStride - 1) / kHeadStride;

  extern __shared__ __align__(16) uint8_t smem[];
  const DecodeHeads heads = decode_heads(p, blockIdx.y);
  const int G = heads.count, kvh = heads.kvh;
  float* s_score = reinterpret_cast<float*>(smem);                     // [G, chunk]
  float* s_q = s_score + G * chunk;                                    // [G, D], pre-scaled
  __nv_bfloat16* s_v = reinterpret_cast<__nv_bfloat16*>(s_q + G * D);  // [kDecodeVTile, D]
  uint8_t* s_v8 = reinterpret_cast<uint8_t*>(s_v);                        // fp8: [kDecodeVTile, D]
  float* s_v_scale = reinterpret_cast<float*>(s_v8 + kDecodeVTile * D);   // fp8: [kDecodeVTile]
  __shared__ float s_max[kMaxG], s_sum[kMaxG];

  const int split = blockIdx.x, b = blockIdx.z;
  const int len = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(len >= 0 && len <= p.max_seq_len);
  const int start = attn::decode_first_key(p, len) + split * chunk;
  const int end = min(len, start + chunk);
  const int tid = threadIdx.x;
  const int q_head0 = heads.first;
  if (start >= end) {
    // A split past this sequence's keys: the combine kernel does not read it. Only a direct
    // (unsplit) launch writes here: zeros for an empty sequence.
    if (num_splits == 1) {
      for (int i = tid; i < G * D; i += kDecodeThreads)
        p.out[(static_cast<int64_t>(b) * p.num_q_heads + q_head0) * D + i] = __float2bfloat16(0.f);
    }
    return;
  }
  const int n = end - start;

  for (int i = tid; i < G * D; i += kDecodeThreads)
    s_q[i] = __bfloat162float(p.q[(static_cast<int64_t>(b) * p.num_q_heads + q_head0) * D + i]) *
             p.scale;
  __syncthreads();

  // 1. scores.
  {
    const int lane_in_row = tid % kLanes;
    const int row = tid / kLanes;
    constexpr int kBatch = 4;
    // The loop bound is warp-uniform (a warp may hold several rows): the shuffles below need
    // every lane.
    for (int base = 0; base < n; base += kRowsPerPass * kBatch) {
      const int t0 = base + row;
      uint4 k_vec[kBatch];  // 8 bf16, or under fp8 8 codes in .x and .y and the scale in .z
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int t = t0 + u * kRowsPerPass;
        k_vec[u] = make_uint4(0, 0, 0, 0);
        if (t < n) {
          const int64_t head_row = attn::kv_head_row(p, b, start + t, kvh);
          if constexpr (kFp8) {
            const uint2 codes =
                __ldg(reinterpret_cast<const uint2*>(p.k_codes + head_row * D) + lane_in_row);
            k_vec[u] =
                make_uint4(codes.x, codes.y, __float_as_uint(__ldg(p.k_scales + head_row)), 0);
          } else {
            k_vec[u] =
                __ldg(reinterpret_cast<const uint4*>(p.k_cache + head_row * D) + lane_in_row);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int t = t0 + u * kRowsPerPass;
        float k[8];
        if constexpr (kFp8) {
          kvfp8::decode8(make_uint2(k_vec[u].x, k_vec[u].y), __uint_as_float(k_vec[u].z), k);
        } else {
          device::bf16x8_to_float(k_vec[u], k);
        }
        for (int g = 0; g < G; ++g) {
          const float* q = s_q + g * D + lane_in_row * 8;
          float dot = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) dot = fmaf(q[i], k[i], dot);
#pragma unroll
          for (int offset = kLanes / 2; offset > 0; offset >>= 1)
            dot += __shfl_xor_sync(device::kFullMask, dot, offset);
          if (lane_in_row == 0 && t < n) s_score[g * chunk + t] = dot;
        }
      }
    }
  }
  __syncthreads();

  // 2. softmax over the chunk, one warp per head.
  {
    const int warp = tid / 32, lane = tid % 32;
    for (int g = warp; g < G; g += kDecodeThreads / 32) {
      float m = -FLT_MAX;
      for (int t = lane; t < n; t += 32) m = fmaxf(m, s_score[g * chunk + t]);
      m = device::warp_max(m);
      float sum = 0.f;
      for (int t = lane; t < n; t += 32) {
        const float e = __expf(s_score[g * chunk + t] - m);
        s_score[g * chunk + t] = e;
        sum += e;
      }
      sum = device::warp_sum(sum);
      if (lane == 0) {
        s_max[g] = m;
        s_sum[g] = sum;
      }
    }
  }
  __syncthreads();

  // 3. values.
  const int dim0 = tid % kDimThreads;
  const int head0 = tid / kDimThreads;
  float acc[kDimsPerThread][kHeadsPerThread];
#pragma unroll
  for (int j = 0; j < kDimsPerThread; ++j)
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) acc[j][i] = 0.f;
  for (int v0 = 0; v0 < n; v0 += kDecodeVTile) {
    const int rows = min(kDecodeVTile, n - v0);
    for (int c = tid; c < rows * kLanes; c += kDecodeThreads) {
      const int r = c / kLanes, ch = c % kLanes;
      const int64_t head_row = attn::kv_head_row(p, b, start + v0 + r, kvh);
      if constexpr (kFp8) {
        reinterpret_cast<uint2*>(s_v8 + r * D)[ch] =
            __ldg(reinterpret_cast<const uint2*>(p.v_codes + head_row * D) + ch);
        if (ch == 0) s_v_scale[r] = __ldg(p.v_scales + head_row);
      } else {
        reinterpret_cast<uint4*>(s_v + r * D)[ch] =
            __ldg(reinterpret_cast<const uint4*>(p.v_cache + head_row * D) + ch);
      }
    }
    __syncthreads();
    for (int r = 0; r < rows; ++r) {
#pragma unroll
      for (int j = 0; j < kDimsPerThread; ++j) {
        float v;
        if constexpr (kFp8) {
          v = kvfp8::decode(s_v8[r * D + dim0 + j * kDimThreads]) * s_v_scale[r];
        } else {
          v = __bfloat162float(s_v[r * D + dim0 + j * kDimThreads]);
        }
#pragma unroll
        for (int i = 0; i < kHeadsPerThread; ++i) {
          const int g = head0 + i * kHeadStride;
          if (g < G) acc[j][i] = fmaf(s_score[g * chunk + v0 + r], v, acc[j][i]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < kHeadsPerThread; ++i) {
    const int g = head0 + i * kHeadStride;
    if (g >= G) continue;
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + q_head0 + g;
#pragma unroll
    for (int j = 0; j < kDimsPerThread; ++j) {
      const int d = dim0 + j * kDimThreads;
      if (num_splits == 1) {
        // A sink joins the denominator here, once (split launches: in the combine kernel).
        const float o = p.sinks != nullptr ? acc[j][i] * attn::sink_normaliser(
                                                             s_max[g], s_sum[g],
                                                             __ldg(p.sinks + q_head0 + g))
                                           : acc[j][i] / s_sum[g];
        p.out[bh * D + d] = __float2bfloat16_rn(o);
      } else {
        p.workspace[(bh * num_splits + split) * D + d] = acc[j][i];
      }
    }
    if (num_splits > 1 && tid % kDimThreads == 0) {
      float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
      ml[(bh * num_splits + split) * 2] = s_max[g];
      ml[(bh * num_splits + split) * 2 + 1] = s_sum[g];
    }
  }
}

namespace attn {

// The live splits of sequence b (of length len): those whose keys start before len.
__device__ __forceinline__ int live_splits(const PagedDecodeParams& p, int len, int chunk) {
  return (len - decode_first_key(p, len) + chunk - 1) / chunk;
}

// Query head bh's output at dim d merged from its `splits` partials (the workspace's outputs and
// (max, sum) pairs, num_splits apart), m their max: the weighted sums in split order, then the
// division (or, with a sink, the sink's normaliser). Load reads the workspace (the combine
// kernel's plain loads; the in-kernel merge's L2 loads, for partials other blocks wrote).
template <typename Load>
__device__ __forceinline__ float merge_split_outputs(const PagedDecodeParams& p, int64_t bh, int h,
                                                     int d, int D, int splits, int num_splits,
                                                     float m, Load load) {
  const float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
  float num = 0.f, den = 0.f;
  // The loads of eight splits in flight at once; the sums keep their order.
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float w = __expf(load(ml + (bh * num_splits + s) * 2) - m);
    den = fmaf(w, load(ml + (bh * num_splits + s) * 2 + 1), den);
    num = fmaf(w, load(p.workspace + (bh * num_splits + s) * D + d), num);
  }
  float o = splits > 0 ? num / den : 0.f;
  // num and den are relative to m, the splits' max: the sink joins the denominator once, here.
  if (p.sinks != nullptr && splits > 0) o = num * sink_normaliser(m, den, __ldg(p.sinks + h));
  return o;
}

}  // namespace attn

// grid (Nq, B), D threads: merges the splits of one (sequence, head).
template <int D>
__global__ void __launch_bounds__(D)
    paged_decode_combine_kernel(const __grid_constant__ PagedDecodeParams p, int chunk,
                                int num_splits) {
  // The combine lets the kernel after it start before it waits: that kernel (the O projection)
  // streams its weights into L2 while the attention still runs. It reads this kernel's output
  // only after its own wait, which returns once this kernel, and so the attention, is done.
  device::allow_next_grid();
  device::wait_for_previous_grid();
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int len = __ldg(p.seq_lens + b);
  const int splits = attn::live_splits(p, len, chunk);
  const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + h;
  const float* ml = p.workspace + p.num_seqs * p.num_q_heads * num_splits * D;
  // The splits' max with each thread taking splits d, d + D, ...: one round of loads, where a
  // loop over the splits in every thread was a chain of them (a third of a decode layer's
  // attention at batch 1).
  float m = -FLT_MAX;
  for (int s = d; s < splits; s += D) m = fmaxf(m, ml[(bh * num_splits + s) * 2]);
  m = device::warp_max(m);
  __shared__ float s_max[D / device::kWarpSize];
  if (d % device::kWarpSize == 0) s_max[d / device::kWarpSize] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < D / device::kWarpSize; ++w) m = fmaxf(m, s_max[w]);
  const float o = attn::merge_split_outputs(p, bh, h, d, D, splits, num_splits, m,
                                            [](const float* at) { return *at; });
  p.out[bh * D + d] = __float2bfloat16_rn(o);
}

namespace attn {
inline constexpr int kPrefillThreads = 128;
inline constexpr int kPrefillTile = 32;
template <int D>
constexpr int prefill_smem_bytes() {
  return (2 * kPrefillTile * (D + 1) + kPrefillTile * D + kPrefillTile * (kPrefillTile + 1)) * 4;
}
}  // namespace attn

// grid (ceil(max_seq_len / 32), Nq, B), 128 threads: thread t owns query row t/4 of the tile,
// score columns t%4 + 4j and output dims t%4 + 4j.
template <int D>
__global__ void __launch_bounds__(attn::kPrefillThreads)
    prefill_attention_kernel(const __grid_constant__ PrefillParams p) {
  using namespace attn;
  constexpr int kT = kPrefillTile;
  constexpr int kCols = kT / 4;
  constexpr int kDims = D / 4;
  extern __shared__ __align__(16) uint8_t smem[];
  float* s_q = reinterpret_cast<float*>(smem);  // [kT, D + 1], pre-scaled
  float* s_k = s_q + kT * (D + 1);              // [kT, D + 1]
  float* s_v = s_k + kT * (D + 1);              // [kT, D]
  float* s_p = s_v + kT * D;                    // [kT, kT + 1]

  const int b = blockIdx.z, h = blockIdx.y;
  const int seq0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - seq0;
  const int q0 = blockIdx.x * kT;
  if (q0 >= len) return;
  const int G = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int kvh = h / G;
  const int tid = threadIdx.x;
  const int r = tid / 4, sub = tid % 4;
  const int64_t q_stride = p.num_q_heads * D, kv_stride = p.num_kv_heads * D;

  for (int i = tid; i < kT * D; i += kPrefillThreads) {
    const int row = i / D, d = i % D;
    const int t = q0 + row;
    s_q[row * (D + 1) + d] =
        t < len ? __bfloat162float(p.q[(seq0 + t) * q_stride + h * D + d]) * p.scale : 0.f;
  }

  float acc[kDims];
#pragma unroll
  for (int j = 0; j < kDims; ++j) acc[j] = 0.f;
  float m = -FLT_MAX, l = 0.f;
  const int qi = q0 + r;
  const int kv_end = min(len, q0 + kT);
  // Query q0 (the tile's earliest first key) sees keys from first_visible_key(q0) on: under a
  // window W from q0 - W + 1, under chunks of C from its chunk's start.
  const int window = prefill_window(p, len), chunk = prefill_chunk(p, len);
  const int kv_begin = first_visible_key(q0, window, chunk) / kT * kT;
  const int first_key = first_visible_key(qi, window, chunk);  // this thread's row
  for (int kv0 = kv_begin; kv0 < kv_end; kv0 += kT) {
    __syncthreads();  // the previous tile's s_k, s_v, s_p are consumed (and s_q written)
    for (int i = tid; i < kT * D; i += kPrefillThreads) {
      const int row = i / D, d = i % D;
      const int t = kv0 + row;
      float kx = 0.f, vx = 0.f;
      if (t < len) {
        kx = __bfloat162float(p.k[(seq0 + t) * kv_stride + kvh * D + d]);
        vx = __bfloat162float(p.v[(seq0 + t) * kv_stride + kvh * D + d]);
      }
      s_k[row * (D + 1) + d] = kx;
      s_v[row * D + d] = vx;
    }
    __syncthreads();
    float s[kCols];
#pragma unroll
    for (int j = 0; j < kCols; ++j) s[j] = 0.f;
    for (int d = 0; d < D; ++d) {
      const float q = s_q[r * (D + 1) + d];
#pragma unroll
      for (int j = 0; j < kCols; ++j) s[j] = fmaf(q, s_k[(sub + 4 * j) * (D + 1) + d], s[j]);
    }
    float tile_max = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int kj = kv0 + sub + 4 * j;
      // A row may be wholly masked in a tile (before its window): its max stays -FLT_MAX,
      // alpha = exp(0) = 1 on a zero accumulator and every e is 0 below, so no NaN.
      if (kj > qi || kj >= len || kj < first_key) s[j] = -FLT_MAX;
      tile_max = fmaxf(tile_max, s[j]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(device::kFullMask, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(device::kFullMask, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const float alpha = __expf(m - m_new);
    float row_sum = 0.f;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const float e = s[j] == -FLT_MAX ? 0.f : __expf(s[j] - m_new);
      s_p[r * (kT + 1) + sub + 4 * j] = e;
      row_sum += e;
    }
    row_sum += __shfl_xor_sync(device::kFullMask, row_sum, 1);
    row_sum += __shfl_xor_sync(device::kFullMask, row_sum, 2);
    l = l * alpha + row_sum;
    m = m_new;
#pragma unroll
    for (int j = 0; j < kDims; ++j) acc[j] *= alpha;
    __syncthreads();
    for (int c = 0; c < kT; ++c) {
      const float pc = s_p[r * (kT + 1) + c];
#pragma unroll
      for (int j = 0; j < kDims; ++j) acc[j] = fmaf(pc, s_v[c * D + sub + 4 * j], acc[j]);
    }
  }
  if (qi < len) {
    __nv_bfloat16* out = p.out + (seq0 + qi) * q_stride + h * D;
    // Row qi sees at least key qi, so m is finite.
    const float inv = p.sinks != nullptr ? sink_normaliser(m, l, __ldg(p.sinks + h)) : 1.f / l;
#pragma unroll
    for (int j = 0; j < kDims; ++j) out[sub + 4 * j] = __float2bfloat16_rn(acc[j] * inv);
  }
}

}  // namespace moeinfer::cuda
