// The persistent decode-layers kernel (decode_layers.h says what it computes and why).
//
// Shape: one block of kDecodeLayersThreads per SM, launched cooperatively so that every block is
// resident and the grid barrier cannot deadlock. Global warp g of G takes rows g, g + G, ... of
// each GEMV ("tasks"); a task is one or more weight rows (gate/up: the gate and the up row of one
// column; down: one output column's row in each of the token's experts), each dotted with its
// input in shared memory. A warp streams its rows in chunks of kChunkVecs 16-byte vectors a lane
// (1024 bf16), with the two chunks after the current one in flight, and issues its first chunks
// between the two halves of the barrier that releases the stage's inputs.
//
// The grid barrier is one word whose top bit flips when every block has arrived (grid_arrive,
// grid_wait); it returns to its state, so it needs no reset between launches or graph replays. The
// attention tickets likewise return to zero.
#pragma once

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decode_layers.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/gated_activation.cuh"
#include "backend/cuda/grouped_gemm_kernel.cuh"
#include "backend/cuda/router_kernel.cuh"

namespace moeinfer::cuda {

inline constexpr int kDecodeLayersWarps = 16;
inline constexpr int kDecodeLayersThreads = kDecodeLayersWarps * device::kWarpSize;

namespace persistent_layers {

inline constexpr int kChunkVecs = 4;  // 16-byte weight vectors a lane holds per chunk
inline constexpr int kChunkElems = kChunkVecs * device::kWarpSize * device::kBf16PerVec;
inline constexpr int kKeyTile = 64;  // cached positions a block stages at a time
// Pairs of adjacent attention outputs (query head, two dims) a thread accumulates.
inline constexpr int kMaxOutputPairsPerThread =
    (static_cast<int>(kDecodeLayersMaxGroup * kDecodeLayersMaxHeadDim) / 2 + kDecodeLayersThreads -
     1) /
    kDecodeLayersThreads;
inline constexpr int kMinKeysPerSplit = 64;
// Vectors of 8 a thread holds while it forms a norm: hidden sizes up to 2 * 8 * 512 = 8192.
inline constexpr int kNormVecs = 2;
static_assert(kNormVecs * kDecodeLayersThreads * device::kBf16PerVec >= kDecodeLayersMaxHidden);
// Splits of a KV head the merge takes, 32 a lane at a time: up to 128 (the launcher's cap).
inline constexpr int kMergeSplitsPerLane = 4;
// Splits whose partial sums a thread of the merge holds at once (more spilled registers).
inline constexpr int kMergeBatch = 8;

__device__ __forceinline__ unsigned long long global_nanoseconds() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// Adds the nanoseconds since `start` to the stage clock's slot (thread 0, when clocked).
__device__ __forceinline__ void clock_since(const DecodeLayersParams& p, int slot,
                                            unsigned long long start) {
  if (p.stage_clock != nullptr && threadIdx.x == 0)
    atomicAdd(p.stage_clock + slot, global_nanoseconds() - start);
}

// The scratch words and buffers (decode_layers.cu carves them in this order).
struct Scratch {
  unsigned* barrier = nullptr;     // [1] the grid barrier's arrival word
  int32_t* tickets = nullptr;      // [Nkv]
  __nv_bfloat16* qkv = nullptr;    // [(Nq + 2 Nkv) Dp]
  float* partial_stats = nullptr;  // [Nkv, S, G, 2] max, sum
  float* partial_out = nullptr;    // [Nkv, S, G, Dp]
  __nv_bfloat16* attn = nullptr;   // [Nq Dp]
  float* logits = nullptr;         // [E]
  __nv_bfloat16* act = nullptr;    // [K, Ip]
  int max_splits = 1;              // S
};

// Loads of what other blocks of this launch wrote: through L2, never a stale L1 line.
__device__ __forceinline__ uint4 load_from_l2(const void* address) {
  return __ldcg(reinterpret_cast<const uint4*>(address));
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* address) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// The grid barrier is one arrival word (decode_layers_barrier_add): one atomic a block, then polls
// for the flip of its top bit.
//
// It comes in two halves so that a block can issue its next stage's weight loads between them:
// the arrival releases the block's writes before any of those loads is in flight (a release
// waits for the thread's outstanding loads), and the wait acquires the other blocks' writes.
// Every thread of the block calls it once the block's writes of the stage are issued; thread 0's
// result (the word before its arrival) goes to grid_wait.
__device__ __forceinline__ unsigned grid_arrive(unsigned* barrier) {
  __syncthreads();
  unsigned before = 0;
  if (threadIdx.x == 0) {
    const unsigned add = decode_layers_barrier_add(blockIdx.x, gridDim.x);
    asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;\n"
                 : "=r"(before)
                 : "l"(barrier), "r"(add)
                 : "memory");
  }
  return before;
}

// Returns, to every thread of the block, once every block has arrived. stage_clock
// (DecodeLayersParams::stage_clock): block 0 adds the time since its previous wait to slot
// `stage`, so slot s sums the stage that this barrier closes.
__device__ __forceinline__ void grid_wait(const unsigned* barrier, unsigned before,
                                          unsigned long long* stage_clock, int stage) {
  if (threadIdx.x == 0) {
    while (((load_acquire(barrier) ^ before) & kDecodeLayersBarrierFlip) == 0) {
    }
    if (stage_clock != nullptr && blockIdx.x == 0) {
      const unsigned long long now = global_nanoseconds();
      stage_clock[stage] += now - stage_clock[kDecodeLayersClockLast];
      stage_clock[kDecodeLayersClockLast] = now;
    }
  }
  __syncthreads();
}

// The first element of lane `lane`'s vector j of chunk `chunk` of a weight row.
__device__ __forceinline__ int chunk_element(int chunk, int j, int lane) {
  return chunk * kChunkElems + (j * device::kWarpSize + lane) * device::kBf16PerVec;
}

// One warp's chunk of a weight row: lane l holds vectors l, l + 32, ... of the chunk.
struct Chunk {
  uint4 w[kChunkVecs];
};

__device__ __forceinline__ void load_chunk(Chunk& c, const __nv_bfloat16* row, int k, int chunk,
                                           int lane) {
#pragma unroll
  for (int j = 0; j < kChunkVecs; ++j) {
    const int e = chunk_element(chunk, j, lane);
    if (e < k) c.w[j] = device::load_streamed(row + e);
  }
}

__device__ __forceinline__ float dot_chunk(const Chunk& c, const __nv_bfloat16* x, int k, int chunk,
                                           int lane) {
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kChunkVecs; ++j) {
    const int e = chunk_element(chunk, j, lane);
    if (e < k) sum += device::bf16x8_dot(c.w[j], *reinterpret_cast<const uint4*>(x + e));
  }
  return sum;
}

// Where a warp is in its share of a GEMV: its task, the row of the task, the chunk of the row.
struct Cursor {
  int task, row, chunk;
};

__device__ __forceinline__ Cursor advance(Cursor c, int rows, int chunks, int stride) {
  if (++c.chunk == chunks) {
    c.chunk = 0;
    if (++c.row == rows) {
      c.row = 0;
      c.task += stride;
    }
  }
  return c;
}

// This warp's share of a GEMV: tasks g, g + G, ... of num_tasks, each `rows` weight rows of k
// elements: row_of(task, r) and its input input_of(r) (shared memory). finish(task, r, value)
// gets each row's dot on every lane. before_loads() and after_loads() are called once by every
// thread of the block (barriers inside), around this warp's first loads: a stage whose rows are
// known ahead issues them while it waits for its inputs.
//
// Three chunk buffers turn in a fixed order: a buffer is refilled with the chunk three ahead as
// soon as it is taken, so two chunks stay in flight while one is summed. The turn is unrolled so
// that each buffer keeps its registers: moving a chunk whose loads are in flight from one
// register to another would wait for them.
template <typename RowOf, typename InputOf, typename Finish, typename BeforeLoads,
          typename AfterLoads>
__device__ __forceinline__ void warp_gemv(int num_tasks, int rows, int k, RowOf row_of,
                                          InputOf input_of, Finish finish, BeforeLoads before_loads,
                                          AfterLoads after_loads) {
  constexpr int kBuffers = 3;
  const int lane = threadIdx.x % device::kWarpSize;
  const int stride = gridDim.x * kDecodeLayersWarps;
  const int chunks = (k + kChunkElems - 1) / kChunkElems;
  Cursor at[kBuffers];
  at[0] = Cursor{
      static_cast<int>(blockIdx.x * kDecodeLayersWarps + threadIdx.x / device::kWarpSize), 0, 0};
#pragma unroll
  for (int b = 1; b < kBuffers; ++b) at[b] = advance(at[b - 1], rows, chunks, stride);
  Cursor ahead = advance(at[kBuffers - 1], rows, chunks, stride);
  Chunk w[kBuffers];
  auto load = [&](Chunk& chunk, const Cursor& c) {
    if (c.task < num_tasks) load_chunk(chunk, row_of(c.task, c.row), k, c.chunk, lane);
  };
  before_loads();
#pragma unroll
  for (int b = 0; b < kBuffers; ++b) load(w[b], at[b]);
  after_loads();
  float sum = 0.0f;
  while (at[0].task < num_tasks) {
#pragma unroll
    for (int b = 0; b < kBuffers; ++b) {
      // Chunks come in order: once one is past the tasks, so is every later one (and at[0]).
      if (at[b].task >= num_tasks) break;
      sum += dot_chunk(w[b], input_of(at[b].row), k, at[b].chunk, lane);
      if (at[b].chunk == chunks - 1) {
        finish(at[b].task, at[b].row, device::warp_sum(sum));
        sum = 0.0f;
      }
      at[b] = ahead;
      load(w[b], at[b]);
      ahead = advance(ahead, rows, chunks, stride);
    }
  }
}

// x (shared, bf16 [Hp]) = RMSNorm(hidden + block_out) with `weight`, every block for itself:
// one pass over L2, the sum held in registers (kNormVecs vectors of 8 a thread).
__device__ __forceinline__ void form_norm(const DecodeLayersParams& p, bool with_block_out,
                                          const __nv_bfloat16* weight, __nv_bfloat16* x,
                                          float* partials) {
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  float s[kNormVecs][8];
  uint4 w[kNormVecs];
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int v = threadIdx.x + j * kDecodeLayersThreads;
    if (v < vecs) {
      const float4* h = reinterpret_cast<const float4*>(p.hidden) + 2 * v;
      const float4 h0 = __ldcg(h), h1 = __ldcg(h + 1);
      s[j][0] = h0.x, s[j][1] = h0.y, s[j][2] = h0.z, s[j][3] = h0.w;
      s[j][4] = h1.x, s[j][5] = h1.y, s[j][6] = h1.z, s[j][7] = h1.w;
      if (with_block_out) {
        const float4* b = reinterpret_cast<const float4*>(p.block_out) + 2 * v;
        const float4 b0 = __ldcg(b), b1 = __ldcg(b + 1);
        const float bo[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) s[j][i] = bo[i] + s[j][i];
      }
      w[j] = __ldg(reinterpret_cast<const uint4*>(weight) + v);
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int v = threadIdx.x + j * kDecodeLayersThreads;
    if (v < vecs) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sum_sq = fmaf(s[j][i], s[j][i], sum_sq);
    }
  }
  const float total = device::block_sum(sum_sq, partials);
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(p.norm_width) + p.eps);
#pragma unroll
  for (int j = 0; j < kNormVecs; ++j) {
    const int v = threadIdx.x + j * kDecodeLayersThreads;
    if (v < vecs) {
      float wf[8];
      device::bf16x8_to_float(w[j], wf);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[j][i] = wf[i] * (s[j][i] * inv_rms);
      reinterpret_cast<uint4*>(x)[v] = device::float_to_bf16x8(s[j]);
    }
  }
}

// Copies n bf16 (a multiple of 8) that other blocks wrote into shared memory.
__device__ __forceinline__ void stage_from_l2(const __nv_bfloat16* src, __nv_bfloat16* dst, int n) {
  for (int v = threadIdx.x; v < n / device::kBf16PerVec; v += blockDim.x)
    reinterpret_cast<uint4*>(dst)[v] = load_from_l2(src + v * device::kBf16PerVec);
}

// One head of the projection (bf16 at `in`, read through L2) normed with `norm` (or not) and
// rotated at `position` (or not), rounded as the stage path rounds (after the norm, after the
// rotation), into `out` (float, Dp wide, zero past D). One warp. Every load a lane makes is
// issued before the first is used (the head as 16-byte vectors, the norm weights and
// frequencies unrolled to their bounds): one round trip to L2, not one per element.
__device__ __forceinline__ void prepare_head(const DecodeLayersParams& p, const __nv_bfloat16* in,
                                             const __nv_bfloat16* norm, bool rotate,
                                             bool interleaved, float position, float* out) {
  constexpr int kPerLane = static_cast<int>(kDecodeLayersMaxHeadDim) / device::kWarpSize;  // 8
  constexpr int kPairsPerLane = kPerLane / 2;
  const int lane = threadIdx.x % device::kWarpSize;
  const int D = static_cast<int>(p.head_dim), Dp = static_cast<int>(p.padded_head_dim);
  const int half = static_cast<int>(p.rotary_dim / 2);
  float weight[kPerLane], freq[kPairsPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * device::kWarpSize;
    weight[j] = norm != nullptr && d < D ? __bfloat162float(__ldg(norm + d)) : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    const int i = lane + j * device::kWarpSize;
    freq[j] = rotate && i < half ? __ldg(p.inv_freq + i) : 0.0f;
  }
  if (lane * device::kBf16PerVec < Dp) {  // Dp <= 256: one vector a lane at most
    float v[8];
    device::bf16x8_to_float(load_from_l2(in + lane * device::kBf16PerVec), v);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int d = lane * device::kBf16PerVec + i;
      out[d] = d < D ? v[i] : 0.0f;
    }
  }
  __syncwarp();
  if (norm != nullptr) {
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * device::kWarpSize;
      if (d < D) sum_sq = fmaf(out[d], out[d], sum_sq);
    }
    sum_sq = device::warp_sum(sum_sq);
    const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(D) + p.eps);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int d = lane + j * device::kWarpSize;
      if (d < D) out[d] = device::round_bf16(weight[j] * (out[d] * inv_rms));
    }
    __syncwarp();
  }
  if (rotate) {
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
      const int i = lane + j * device::kWarpSize;
      if (i < half) {
        float sn, cs;
        sincosf(position * freq[j], &sn, &cs);
        cs *= p.rope_scaling;
        sn *= p.rope_scaling;
        const int i1 = interleaved ? 2 * i : i;
        const int i2 = interleaved ? 2 * i + 1 : i + half;
        const float x1 = out[i1], x2 = out[i2];
        out[i1] = x1 * cs - x2 * sn;
        out[i2] = x2 * cs + x1 * sn;
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int d = lane + j * device::kWarpSize;
    if (d < D) out[d] = device::round_bf16(out[d]);
  }
  __syncwarp();
}

// Shared memory of the attention stage, carved from the kernel's dynamic shared memory.
struct AttentionShared {
  float* q;             // [G, Dp] normed, rotated queries
  float* new_key;       // [Dp]
  float* new_value;     // [Dp]
  __nv_bfloat16* keys;  // [kKeyTile, Dp], each row's 16-byte vectors rotated (tile_slot)
  __nv_bfloat16* values;
  float* probs;  // [G, kKeyTile]
  float* stats;  // [G, 3] running max, running sum, this tile's correction
  int* flag;     // [1]
};

__host__ __device__ inline int64_t attention_shared_floats(int64_t group, int64_t dp) {
  return group * dp + 2 * dp + 2 * kKeyTile * dp / 2 + group * kKeyTile + group * 3 + 4;
}

__device__ inline AttentionShared carve_attention(float* base, int group, int dp) {
  AttentionShared s;
  s.q = base;
  s.new_key = s.q + group * dp;
  s.new_value = s.new_key + dp;
  s.keys = reinterpret_cast<__nv_bfloat16*>(s.new_value + dp);
  s.values = s.keys + kKeyTile * dp;
  s.probs = reinterpret_cast<float*>(s.values + kKeyTile * dp);
  s.stats = s.probs + group * kKeyTile;
  s.flag = reinterpret_cast<int*>(s.stats + group * 3);
  return s;
}

// Where vector v of a staged key or value row t sits in the row: rotated by t, so that the 32
// rows a warp scores at one v fall in different banks, and a row stays 16-byte aligned for
// cp.async.
__device__ __forceinline__ int tile_slot(int t, int v, int vecs_per_row) {
  return (v + t) % vecs_per_row;
}

// Starts the copies of a key tile's cached keys and values (positions tile .. tile + n - 1 of KV
// head h) into shared memory, through L2 and no registers; the caller waits for them
// (cp_async_wait). The step's own position is not in the cache yet: store_new_position puts it.
__device__ __forceinline__ void load_tile(const DecodeLayersParams& p, const DecodeLayerWeights& lw,
                                          const AttentionShared& s, int h, int tile, int n,
                                          int seq_len) {
  const int Nkv = static_cast<int>(p.num_kv_heads), Dp = static_cast<int>(p.padded_head_dim);
  const int vecs_per_row = Dp / device::kBf16PerVec;
  const int bs = static_cast<int>(p.block_size);
  const uint32_t keys = static_cast<uint32_t>(__cvta_generic_to_shared(s.keys));
  const uint32_t values = static_cast<uint32_t>(__cvta_generic_to_shared(s.values));
  for (int idx = threadIdx.x; idx < n * vecs_per_row; idx += kDecodeLayersThreads) {
    const int t = idx / vecs_per_row, v = idx % vecs_per_row;
    const int pos = tile + t;
    if (pos == seq_len - 1) continue;
    const int32_t block = __ldg(p.block_table + pos / bs);
    MOE_DEVICE_CHECK(block >= 0 && block < p.num_cache_blocks);
    const int64_t at =
        ((static_cast<int64_t>(block) * bs + pos % bs) * Nkv + h) * Dp + v * device::kBf16PerVec;
    const uint32_t offset =
        static_cast<uint32_t>((t * vecs_per_row + tile_slot(t, v, vecs_per_row)) * sizeof(uint4));
    gemm::cp_async_16(keys + offset, lw.k_cache + at, true);
    gemm::cp_async_16(values + offset, lw.v_cache + at, true);
  }
  gemm::cp_async_commit();
}

// The step's own key and value (s.new_key, s.new_value) into the staged tile at row t.
__device__ __forceinline__ void store_new_position(const AttentionShared& s, int dp, int t) {
  const int vecs_per_row = dp / device::kBf16PerVec;
  for (int v = threadIdx.x; v < vecs_per_row; v += kDecodeLayersThreads) {
    float kf[8], vf[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      kf[i] = s.new_key[v * 8 + i];
      vf[i] = s.new_value[v * 8 + i];
    }
    const int at = t * vecs_per_row + tile_slot(t, v, vecs_per_row);
    reinterpret_cast<uint4*>(s.keys)[at] = device::float_to_bf16x8(kf);
    reinterpret_cast<uint4*>(s.values)[at] = device::float_to_bf16x8(vf);
  }
}

// The cached positions [first, last) of split `split` of `splits` over [begin, seq_len).
struct SplitRange {
  int first, last;
};

__device__ __forceinline__ SplitRange split_range(int split, int splits, int begin, int seq_len) {
  const int per_split = (seq_len - begin + splits - 1) / splits;
  const int first = begin + split * per_split;
  return {first, min(seq_len, first + per_split)};
}

// Starts the copies of the first key tile of an attention item (attention_item waits for them):
// issued before the queries are ready, since the cache's earlier positions do not depend on them.
__device__ __forceinline__ void issue_first_tile(const DecodeLayersParams& p,
                                                 const DecodeLayerWeights& lw,
                                                 const AttentionShared& s, int h, int split,
                                                 int splits, int begin, int seq_len) {
  const SplitRange range = split_range(split, splits, begin, seq_len);
  load_tile(p, lw, s, h, range.first, min(kKeyTile, range.last - range.first), seq_len);
}

// Takes a ticket of an attention head: the count before this arrival. Release and acquire: see
// attention_item.
__device__ __forceinline__ unsigned ticket_arrive(int32_t* ticket) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n"
               : "=r"(before)
               : "l"(ticket)
               : "memory");
  return before;
}

// Loads the partial sums of output pair `pair` of splits from .. from + kMergeBatch - 1 (those
// below `splits`; zero past them) through L2, every load issued before the first is used.
__device__ __forceinline__ void load_partials(const Scratch& scratch, int64_t first_item,
                                              int outputs, int pair, int from, int splits,
                                              float2 (&held)[kMergeBatch]) {
#pragma unroll
  for (int j = 0; j < kMergeBatch; ++j) {
    const int sp = from + j;
    held[j] = make_float2(0.0f, 0.0f);
    if (sp < splits)
      held[j] = __ldcg(
          reinterpret_cast<const float2*>(scratch.partial_out + (first_item + sp) * outputs) +
          pair);
  }
}

// Attention of the step's token for KV head h over split `split` of `splits` (the cached
// positions [begin, seq_len)), its first key tile's copies issued (issue_first_tile), leaving the
// split's partial softmax in scratch; the block that finishes a head's last split merges them into
// scratch.attn.
__device__ inline void attention_item(const DecodeLayersParams& p, const DecodeLayerWeights& lw,
                                      const Scratch& scratch, const AttentionShared& s, int h,
                                      int split, int splits, int begin, int seq_len,
                                      unsigned long long clock_start) {
  const int warp = threadIdx.x / device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  const int Nq = static_cast<int>(p.num_q_heads), Nkv = static_cast<int>(p.num_kv_heads);
  const int G = Nq / Nkv;
  const int Dp = static_cast<int>(p.padded_head_dim);
  const int vecs_per_row = Dp / device::kBf16PerVec;
  const float position = static_cast<float>(__ldg(p.position));
  const bool rotate = lw.rope && p.rotary_dim > 0;
  const SplitRange range = split_range(split, splits, begin, seq_len);
  const int first = range.first, last = range.last;
  const bool has_new = first <= seq_len - 1 && seq_len - 1 < last;

  // Queries (and the new key and value where this split holds the new position).
  for (int i = warp; i < G; i += kDecodeLayersWarps)
    prepare_head(p, scratch.qkv + static_cast<int64_t>(h * G + i) * Dp, lw.q_norm, rotate,
                 lw.interleaved_rope, position, s.q + i * Dp);
  if (has_new) {
    const __nv_bfloat16* k_in = scratch.qkv + static_cast<int64_t>(Nq + h) * Dp;
    const __nv_bfloat16* v_in = scratch.qkv + static_cast<int64_t>(Nq + Nkv + h) * Dp;
    if (warp == kDecodeLayersWarps - 1)
      prepare_head(p, k_in, lw.k_norm, rotate, lw.interleaved_rope, position, s.new_key);
    if (warp == kDecodeLayersWarps - 2)
      prepare_head(p, v_in, nullptr, false, false, 0.0f, s.new_value);
  }
  if (threadIdx.x < G) {
    s.stats[threadIdx.x * 3 + 0] = -INFINITY;
    s.stats[threadIdx.x * 3 + 1] = 0.0f;
  }
  __syncthreads();
  clock_since(p, kDecodeLayersClockItemPhases + 0, clock_start);
  if (has_new) {
    // The new key and value into the cache, for the steps after this one (this step reads them
    // from shared memory).
    const int32_t slot = __ldg(p.slot);
    MOE_DEVICE_CHECK(slot >= 0 && slot < p.num_cache_blocks * p.block_size);
    const int64_t at = (static_cast<int64_t>(slot) * Nkv + h) * Dp;
    for (int d = threadIdx.x; d < Dp; d += blockDim.x) {
      lw.k_cache[at + d] = __float2bfloat16_rn(s.new_key[d]);
      lw.v_cache[at + d] = __float2bfloat16_rn(s.new_value[d]);
    }
  }

  float2 acc[kMaxOutputPairsPerThread];
#pragma unroll
  for (int j = 0; j < kMaxOutputPairsPerThread; ++j) acc[j] = make_float2(0.0f, 0.0f);
  const int outputs = G * Dp;

  for (int tile = first; tile < last; tile += kKeyTile) {
    const int n = min(kKeyTile, last - tile);
    if (tile != first) load_tile(p, lw, s, h, tile, n, seq_len);
    if (tile <= seq_len - 1 && seq_len - 1 < tile + n)
      store_new_position(s, Dp, seq_len - 1 - tile);
    gemm::cp_async_wait<0>();
    __syncthreads();
    if (tile == first) clock_since(p, kDecodeLayersClockItemPhases + 1, clock_start);
    // Scores: thread (head i, position t).
    for (int idx = threadIdx.x; idx < G * kKeyTile; idx += blockDim.x) {
      const int i = idx / kKeyTile, t = idx % kKeyTile;
      float score = -INFINITY;
      if (t < n) {
        const float* q = s.q + i * Dp;
        const uint4* key = reinterpret_cast<const uint4*>(s.keys) + t * vecs_per_row;
        float dot = 0.0f;
        for (int v = 0, slot = tile_slot(t, 0, vecs_per_row); v < vecs_per_row; ++v) {
          float kf[8];
          device::bf16x8_to_float(key[slot], kf);
          slot = slot + 1 == vecs_per_row ? 0 : slot + 1;
          const float4 q0 = reinterpret_cast<const float4*>(q)[2 * v];
          const float4 q1 = reinterpret_cast<const float4*>(q)[2 * v + 1];
          dot = fmaf(q0.x, kf[0], dot);
          dot = fmaf(q0.y, kf[1], dot);
          dot = fmaf(q0.z, kf[2], dot);
          dot = fmaf(q0.w, kf[3], dot);
          dot = fmaf(q1.x, kf[4], dot);
          dot = fmaf(q1.y, kf[5], dot);
          dot = fmaf(q1.z, kf[6], dot);
          dot = fmaf(q1.w, kf[7], dot);
        }
        score = dot * p.attention_scale;
      }
      s.probs[i * kKeyTile + t] = score;
    }
    __syncthreads();
    // Online softmax per head: warp i.
    for (int i = warp; i < G; i += kDecodeLayersWarps) {
      float* row = s.probs + i * kKeyTile;
      float tile_max = -INFINITY;
      for (int t = lane; t < kKeyTile; t += device::kWarpSize) tile_max = fmaxf(tile_max, row[t]);
      tile_max = device::warp_max(tile_max);
      const float old_max = s.stats[i * 3 + 0];
      const float new_max = fmaxf(old_max, tile_max);
      float sum = 0.0f;
      for (int t = lane; t < kKeyTile; t += device::kWarpSize) {
        const float e = row[t] == -INFINITY ? 0.0f : __expf(row[t] - new_max);
        row[t] = e;
        sum += e;
      }
      sum = device::warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const float correction = old_max == -INFINITY ? 0.0f : __expf(old_max - new_max);
        s.stats[i * 3 + 0] = new_max;
        s.stats[i * 3 + 1] = s.stats[i * 3 + 1] * correction + sum;
        s.stats[i * 3 + 2] = correction;
      }
    }
    __syncthreads();
    // Outputs: thread owns the pairs of dims threadIdx.x + j * blockDim.x of the G x Dp outputs.
#pragma unroll
    for (int j = 0; j < kMaxOutputPairsPerThread; ++j) {
      const int pair = threadIdx.x + j * kDecodeLayersThreads;
      if (2 * pair < outputs) {
        const int i = 2 * pair / Dp, d = 2 * pair % Dp;
        const float* pr = s.probs + i * kKeyTile;
        const float correction = s.stats[i * 3 + 2];
        float2 sum = make_float2(acc[j].x * correction, acc[j].y * correction);
        // Row t's copy of d and d + 1: their vector rotated by t (tile_slot).
#pragma unroll 4
        for (int t = 0, slot = d / device::kBf16PerVec; t < n; ++t) {
          const int at = (t * vecs_per_row + slot) * device::kBf16PerVec + d % device::kBf16PerVec;
          const float2 v =
              __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s.values + at));
          sum.x = fmaf(pr[t], v.x, sum.x);
          sum.y = fmaf(pr[t], v.y, sum.y);
          slot = slot + 1 == vecs_per_row ? 0 : slot + 1;
        }
        acc[j] = sum;
      }
    }
    __syncthreads();
  }

  clock_since(p, kDecodeLayersClockItemPhases + 2, clock_start);
  // The split's partial result.
  const int64_t item = static_cast<int64_t>(h) * scratch.max_splits + split;
  if (threadIdx.x < G) {
    scratch.partial_stats[(item * G + threadIdx.x) * 2 + 0] = s.stats[threadIdx.x * 3 + 0];
    scratch.partial_stats[(item * G + threadIdx.x) * 2 + 1] = s.stats[threadIdx.x * 3 + 1];
  }
#pragma unroll
  for (int j = 0; j < kMaxOutputPairsPerThread; ++j) {
    const int pair = threadIdx.x + j * kDecodeLayersThreads;
    if (2 * pair < outputs)
      reinterpret_cast<float2*>(scratch.partial_out + item * outputs)[pair] = acc[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The block's partial (ordered before by the barrier above) is released, and the last
    // arrival acquires every other split's, by the one atomic. The ticket's next use comes after
    // a grid barrier, which publishes its reset.
    const bool last = ticket_arrive(scratch.tickets + h) == static_cast<unsigned>(splits - 1);
    if (last) scratch.tickets[h] = 0;
    *s.flag = last;
  }
  __syncthreads();
  clock_since(p, kDecodeLayersClockItemPhases + 3, clock_start);
  if (!*s.flag) return;
  // The last split of head h merges the head's splits, reading them through L2. Each thread
  // first issues the loads of its first pair of outputs' partial sums (up to kMergeBatch splits);
  // meanwhile a warp per query head forms each split's share exp(max_s - max) / sum, every load
  // issued at once, into shared memory (over the key tile, done with). So the two round trips to
  // L2 overlap. Then each output's weighted sum of its splits, in split order.
  float* share = reinterpret_cast<float*>(s.keys);  // [splits, G]
  const int64_t first_item = static_cast<int64_t>(h) * scratch.max_splits;
  const int pairs = outputs / 2;
  float2 held[kMergeBatch];
  if (static_cast<int>(threadIdx.x) < pairs)
    load_partials(scratch, first_item, outputs, threadIdx.x, 0, splits, held);
  for (int i = warp; i < G; i += kDecodeLayersWarps) {
    float m[kMergeSplitsPerLane], l[kMergeSplitsPerLane];
#pragma unroll
    for (int j = 0; j < kMergeSplitsPerLane; ++j) {
      const int sp = lane + j * device::kWarpSize;
      m[j] = -INFINITY;
      l[j] = 0.0f;
      if (sp < splits) {
        const float* stats = scratch.partial_stats + ((first_item + sp) * G + i) * 2;
        m[j] = __ldcg(stats);
        l[j] = __ldcg(stats + 1);
      }
    }
    float max_all = -INFINITY;
#pragma unroll
    for (int j = 0; j < kMergeSplitsPerLane; ++j) max_all = fmaxf(max_all, m[j]);
    max_all = device::warp_max(max_all);
    float den = 0.0f;
#pragma unroll
    for (int j = 0; j < kMergeSplitsPerLane; ++j) {
      m[j] = m[j] == -INFINITY ? 0.0f : __expf(m[j] - max_all);
      den = fmaf(l[j], m[j], den);
    }
    den = device::warp_sum(den);
#pragma unroll
    for (int j = 0; j < kMergeSplitsPerLane; ++j) {
      const int sp = lane + j * device::kWarpSize;
      if (sp < splits) share[sp * G + i] = den > 0.0f ? m[j] / den : 0.0f;
    }
  }
  __syncthreads();
  for (int pair = threadIdx.x; pair < pairs; pair += kDecodeLayersThreads) {
    const int i = 2 * pair / Dp;
    float2 sum = make_float2(0.0f, 0.0f);
    for (int from = 0; from < splits; from += kMergeBatch) {
      if (pair != static_cast<int>(threadIdx.x) || from != 0)
        load_partials(scratch, first_item, outputs, pair, from, splits, held);
#pragma unroll
      for (int j = 0; j < kMergeBatch; ++j) {
        if (from + j < splits) {
          const float weight = share[(from + j) * G + i];
          sum.x = fmaf(weight, held[j].x, sum.x);
          sum.y = fmaf(weight, held[j].y, sum.y);
        }
      }
    }
    reinterpret_cast<__nv_bfloat162*>(scratch.attn + static_cast<int64_t>(h) * outputs)[pair] =
        __floats2bfloat162_rn(sum.x, sum.y);
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(kDecodeLayersThreads, 1)
    decode_layers_kernel(const __grid_constant__ DecodeLayersParams p,
                         const __grid_constant__ Scratch scratch) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  __shared__ float partials[32];
  __shared__ int32_t route_ids[64];
  __shared__ float route_weights[64];
  const int warp = threadIdx.x / device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  const int Hp = static_cast<int>(p.hidden_size);
  const int Nq = static_cast<int>(p.num_q_heads), Nkv = static_cast<int>(p.num_kv_heads);
  const int Dp = static_cast<int>(p.padded_head_dim);
  const int G = Nq / Nkv;
  const int E = static_cast<int>(p.num_experts), K = static_cast<int>(p.top_k);
  const int Ip = static_cast<int>(p.expert_width);
  __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(shared_raw);
  const int seq_len = __ldg(p.seq_len);
  if (p.stage_clock != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    p.stage_clock[kDecodeLayersClockLast] = global_nanoseconds();
    p.stage_clock[kDecodeLayersClockLayers] += static_cast<unsigned long long>(p.num_layers);
  }

  unsigned arrival = 0;  // thread 0's grid_arrive, for its grid_wait
  for (int l = 0; l < p.num_layers; ++l) {
    const DecodeLayerWeights& lw = p.layers[l];
    const bool with_block_out = l > 0 || p.block_out_valid;

    // The rows of each GEMV.
    const int attn_width = Nq * Dp;
    auto o_row = [&](int c, int) { return lw.o_proj + static_cast<int64_t>(c) * attn_width; };
    auto router_row = [&](int e, int) { return lw.router + static_cast<int64_t>(e) * Hp; };
    auto down_row = [&](int c, int pick) {
      return lw.down + (static_cast<int64_t>(route_ids[pick]) * Hp + c) * Ip;
    };

    // 1. Input norm and QKV.
    warp_gemv((Nq + 2 * Nkv) * Dp, 1, Hp,
              [&](int n, int) { return lw.qkv + static_cast<int64_t>(n) * Hp; },
              [&](int) { return x; },
              [&](int n, int, float value) {
                if (lane == 0) scratch.qkv[n] = __float2bfloat16_rn(value);
              },
              [&] {
                if (l > 0) arrival = grid_arrive(scratch.barrier);
              },
              [&] {
                if (l > 0) grid_wait(scratch.barrier, arrival, p.stage_clock, 5);
                form_norm(p, with_block_out, lw.input_norm, x, partials);
                __syncthreads();
              });

    // 2. Attention over (KV head, split) items; a block's first key tile is copied while it
    // waits for the queries.
    {
      const int begin =
          lw.sliding_window > 0 ? max(0, seq_len - static_cast<int>(lw.sliding_window)) : 0;
      const int span = seq_len - begin;
      const int splits =
          max(1, min(scratch.max_splits, (span + kMinKeysPerSplit - 1) / kMinKeysPerSplit));
      const AttentionShared attention_shared =
          carve_attention(reinterpret_cast<float*>(shared_raw), G, Dp);
      arrival = grid_arrive(scratch.barrier);
      const int first_item = blockIdx.x;
      if (first_item < Nkv * splits)
        issue_first_tile(p, lw, attention_shared, first_item / splits, first_item % splits, splits,
                         begin, seq_len);
      grid_wait(scratch.barrier, arrival, p.stage_clock, 0);
      const unsigned long long items_start =
          p.stage_clock != nullptr && threadIdx.x == 0 ? global_nanoseconds() : 0;
      for (int item = first_item; item < Nkv * splits; item += gridDim.x) {
        if (item != first_item)
          issue_first_tile(p, lw, attention_shared, item / splits, item % splits, splits, begin,
                           seq_len);
        attention_item(p, lw, scratch, attention_shared, item / splits, item % splits, splits,
                       begin, seq_len, items_start);
        __syncthreads();
        clock_since(p, kDecodeLayersClockItemPhases + 4, items_start);
        if (p.stage_clock != nullptr && threadIdx.x == 0)
          atomicAdd(p.stage_clock + kDecodeLayersClockItemCount, 1ull);
      }
    }

    // 3. O, added into the residual stream by the warp of each column.
    warp_gemv(
        Hp, 1, attn_width, o_row, [&](int) { return x; },
        [&](int c, int, float value) {
          if (lane == 0) {
            float r = __ldcg(p.hidden + c);
            if (with_block_out) r = __ldcg(p.block_out + c) + r;
            p.hidden[c] = value + r;
          }
        },
        [&] { arrival = grid_arrive(scratch.barrier); },
        [&] {
          grid_wait(scratch.barrier, arrival, p.stage_clock, 1);
          stage_from_l2(scratch.attn, x, attn_width);
          __syncthreads();
        });

    // 4. Post-attention norm and the router.
    warp_gemv(
        E, 1, Hp, router_row, [&](int) { return x; },
        [&](int e, int, float value) {
          if (lane == 0) scratch.logits[e] = value;
        },
        [&] { arrival = grid_arrive(scratch.barrier); },
        [&] {
          grid_wait(scratch.barrier, arrival, p.stage_clock, 2);
          form_norm(p, /*with_block_out=*/false, lw.post_norm, x, partials);
          __syncthreads();
        });

    // 5. Route (each block for itself), then the experts' gate/up with SiLU.
    float gate = 0.0f;
    warp_gemv(
        K * Ip, 2, Hp,
        [&](int task, int r) {
          const int pick = task / Ip, j = task % Ip;
          return lw.gate_up + (static_cast<int64_t>(route_ids[pick]) * 2 * Ip + r * Ip + j) * Hp;
        },
        [&](int) { return x; },
        [&](int task, int r, float value) {
          if (r == 0) {
            gate = value;
          } else if (lane == 0) {
            scratch.act[task] = __float2bfloat16_rn(gated::silu_mul(gate, value));
          }
        },
        [&] {
          grid_wait(scratch.barrier, grid_arrive(scratch.barrier), p.stage_clock, 3);
          if (warp == 0) {
            RouterParams route{.logits = scratch.logits,
                               .topk_ids = route_ids,
                               .topk_weights = route_weights,
                               .num_tokens = 1,
                               .num_experts = E,
                               .top_k = K,
                               .score = p.router_score,
                               .renormalize = p.renormalize,
                               .routed_scaling_factor = p.routed_scaling_factor,
                               .logit_bias = lw.logit_bias};
            if (lw.router_noise && p.route_key != nullptr) {
              route.noise_keys = p.route_key;
              route.noise_seed = lw.noise_seed;
            }
            route_token_plain<kPerLane, /*kLogitsWrittenHere=*/true>(route, 0, lane);
          }
          __syncthreads();
          if (blockIdx.x == 0) {
            if (p.routing_ids != nullptr && static_cast<int>(threadIdx.x) < K) {
              p.routing_ids[l * p.routing_stride + threadIdx.x] = route_ids[threadIdx.x];
              p.routing_weights[l * p.routing_stride + threadIdx.x] = route_weights[threadIdx.x];
            }
            if (lw.expert_counts != nullptr) {
              for (int e = threadIdx.x; e <= E; e += blockDim.x) {
                int count = 0;
                for (int k = 0; k < K; ++k) count += route_ids[k] == e;
                lw.expert_counts[e] = count;
              }
            }
          }
        },
        [] {});

    // 6. Down: each output column through the token's experts, weighted, in pick order.
    float moe_sum = 0.0f;
    warp_gemv(
        Hp, K, Ip, down_row, [&](int pick) { return x + pick * Ip; },
        [&](int c, int pick, float value) {
          moe_sum = fmaf(route_weights[pick], device::round_bf16(value), moe_sum);
          if (pick == K - 1) {
            if (lane == 0) p.block_out[c] = moe_sum;
            moe_sum = 0.0f;
          }
        },
        [&] { arrival = grid_arrive(scratch.barrier); },
        [&] {
          grid_wait(scratch.barrier, arrival, p.stage_clock, 4);
          stage_from_l2(scratch.act, x, K * Ip);
          __syncthreads();
        });
  }
}

}  // namespace persistent_layers
}  // namespace moeinfer::cuda
