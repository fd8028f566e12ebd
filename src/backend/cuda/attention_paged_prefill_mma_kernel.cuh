// Prefill attention over the paged KV cache on tensor cores: the query chunk of a sequence that
// already has cached keys (chunked prefill, a prompt extending a cached prefix, a mixed step's
// several new tokens) attends to all of its keys through the block table. Before this kernel
// such chunks took the decode kernel one query row at a time (the "per-query" route), which
// reads every key once per query and ran chunked prefill at 0.05 to 0.09 of the GEMM peak.
// Why built this way:
//
// - The tiling of the flash prefill kernel (attention_prefill_mma_kernel.cuh), whose register
//   and shared-memory layout it reuses: a block of 4 warps holds 64 rows, each warp 16 of them
//   as mma A fragments, 64-key K/V tiles double-buffered in swizzled shared memory, S = Q K^T
//   and O += P V on mma.sync m16n8k16, the online softmax in float32 in the log2 domain, P
//   rounded to bf16 for the P V product.
// - GQA packing: the 64 rows are (query, head) pairs of one KV head, row r = query q0 + r / G,
//   head r % G of the group, for floor(64 / G) queries (the rest of the rows are zero). One
//   block per (query tile, KV head, sequence) then reads each K/V tile once for all G heads,
//   and a sequence that brings one token (a mixed step's decode row) fills G rows instead of
//   one, as the decode kernel's packing does. G <= 64.
// - Work planned on the host (plan_paged_prefill_tiles): the grid is the list of every
//   sequence's query tiles, each block finding its sequence by a binary search of tile_starts,
//   so a mixed step of one long chunk and many one-token sequences launches no block that has
//   nothing to do (a grid of max tiles x sequences would launch mostly empty blocks, each
//   holding the block's shared memory while it starts and exits).
// - The addressing: query i of sequence b sits at position start + i, where start = seq_lens[b]
//   - n_b is the cached prefix, and key k is read from the cache row of block_tables[b, k /
//   block_size], slot k % block_size (the step's own keys were written there before this
//   launch). One table lookup per 16-byte chunk: it hits L1, and the loads are cp.async.
// - Keys a tile cannot see are never loaded: the key range runs from the earliest row's first
//   visible key (its window's or chunk's start, attn::first_visible_key) to the latest row's
//   position, and the rest of the first and last 64-key tiles is zero-filled; -inf masking
//   only in tiles that cross the diagonal or a window / chunk edge.
// - fp8 rows (kFp8) are decoded in registers as they load and stored where cp.async would have
//   put the bf16 rows, as the tensor-core decode kernel does, so the rest is the same code.
// - Rows past a sequence's queries (the tile's tail) have zero Q and see zero-filled keys: no
//   NaN, and they are not written.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_kernel.cuh"              // first_visible_key, sinks
#include "backend/cuda/attention_prefill_mma_kernel.cuh"  // tile sizes, ldmatrix, packing
#include "backend/cuda/grouped_gemm_kernel.cuh"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda {

namespace attn {

// Index of the (slot, KV head) row that holds key `key` of sequence b (its fp8 scale's index;
// its first element is at that index times D).
__device__ __forceinline__ int64_t paged_prefill_kv_row(const PagedPrefillParams& p, int b, int key,
                                                        int kvh) {
  const int block = __ldg(p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq +
                          key / static_cast<int>(p.block_size));
  MOE_DEVICE_CHECK(block >= 0 && block < p.num_blocks);
  const int slot = key % static_cast<int>(p.block_size);
  return (static_cast<int64_t>(block) * p.block_size + slot) * p.num_kv_heads + kvh;
}

// The window or chunk as an int, 0 when it hides nothing from any query of a sequence with
// `keys` keys (W or C >= keys).
__device__ __forceinline__ int paged_prefill_span(int64_t span, int keys) {
  return span > 0 && span < keys ? static_cast<int>(span) : 0;
}

static_assert(kMmaQ == kPagedPrefillTileRows, "the host plans tiles of kMmaQ rows");

}  // namespace attn

// grid (num_tiles, Nkv), kMmaThreads threads, prefill_mma_smem_bytes<D>() bytes.
template <int D, bool kFp8>
__global__ void __launch_bounds__(attn::kMmaThreads)
    paged_prefill_attention_mma_kernel(const __grid_constant__ PagedPrefillParams p) {
  using namespace attn;
  using gemm::cp_async_16;
  using gemm::ldmatrix_x4;
  using gemm::mma_bf16;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTileBytes = kMmaKV * D * 2;
  constexpr int kNT = kMmaKV / 8;  // 8-key score tiles per warp
  constexpr int kDT = D / 8;       // 8-wide output tiles per warp
  extern __shared__ __align__(128) uint8_t paged_prefill_smem[];
  const uint32_t s_q = gemm::smem_u32(paged_prefill_smem);
  const uint32_t s_k = s_q + kMmaQ * D * 2;
  const uint32_t s_v = s_k + 2 * kTileBytes;
  auto offset = [](int row, int chunk) {
    return static_cast<uint32_t>((row * kChunks + (chunk ^ (row & 7))) * 16);
  };

  const int kvh = blockIdx.y, tile = blockIdx.x;
  const int G = static_cast<int>(p.num_q_heads / p.num_kv_heads);
  const int tile_queries = kMmaQ / G;
  // The sequence whose tiles hold this block (one with no tiles shares its start with the
  // next, which is then the one found).
  const int b = device::last_start_at_or_before(p.tile_starts, static_cast<int>(p.num_seqs), tile);
  const int seq0 = __ldg(p.cu_seqlens + b);
  const int num_queries = __ldg(p.cu_seqlens + b + 1) - seq0;
  const int q0 = (tile - __ldg(p.tile_starts + b)) * tile_queries;
  MOE_DEVICE_CHECK(q0 >= 0 && q0 < num_queries);
  const int keys = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(keys >= num_queries && keys <= p.max_seq_len);
  const int start = keys - num_queries;  // the cached prefix: query i sits at start + i
  const int tile_end = min(num_queries, q0 + tile_queries);  // this tile's queries: [q0, end)
  const int64_t q_stride = p.num_q_heads * D;
  // Row r of the tile: query q0 + r / G, head kvh * G + r % G; rows past the tile's queries
  // (or past floor(64 / G) queries' rows) are zeros and are not written.
  auto row_query = [&](int r) { return q0 + r / G; };
  auto row_valid = [&](int r) { return r < tile_queries * G && row_query(r) < tile_end; };
  auto row_offset = [&](int r) {  // elements from p.q (and p.out) to the row's head
    return (static_cast<int64_t>(seq0) + row_query(r)) * q_stride + (kvh * G + r % G) * D;
  };
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int c = tid; c < kMmaQ * kChunks; c += kMmaThreads) {
    const int r = c / kChunks, ch = c % kChunks;
    const bool valid = row_valid(r);
    cp_async_16(s_q + offset(r, ch), p.q + (valid ? row_offset(r) : 0) + ch * 8, valid);
  }
  // Keys before a row's first_visible_key are masked; the tile's earliest row has the earliest
  // first key, its latest possible row the latest.
  const int window = paged_prefill_span(p.sliding_window, keys);
  const int chunk = paged_prefill_span(p.attention_chunk, keys);
  const int first_pos = start + q0;
  const int kv_first = first_visible_key(first_pos, window, chunk);  // no row sees keys before
  const int kv_end = start + tile_end;  // the latest query's position + 1
  const int last_first_key = first_visible_key(start + tile_end - 1, window, chunk);
  // Keys [kv0, kv0 + kMmaKV) into buffer `buffer`. Keys no row sees (before kv_first, at or
  // past kv_end) are zeros, not read: their masked scores give p = 0, and 0 times a zero row
  // stays 0 (a stale row could hold anything, and its block-table entry need not be valid).
  auto load_kv = [&](int buffer, int kv0) {
    for (int c = tid; c < kMmaKV * kChunks; c += kMmaThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = kv0 + r >= kv_first && kv0 + r < kv_end;
      const uint32_t k_dst = s_k + buffer * kTileBytes + offset(r, ch);
      const uint32_t v_dst = s_v + buffer * kTileBytes + offset(r, ch);
      if constexpr (kFp8) {
        uint4 k8 = make_uint4(0, 0, 0, 0), v8 = make_uint4(0, 0, 0, 0);
        if (valid) {
          const int64_t row = paged_prefill_kv_row(p, b, kv0 + r, kvh);
          k8 = kvfp8::decode8_bf16(__ldg(reinterpret_cast<const uint2*>(p.k_codes + row * D) + ch),
                                   __ldg(p.k_scales + row));
          v8 = kvfp8::decode8_bf16(__ldg(reinterpret_cast<const uint2*>(p.v_codes + row * D) + ch),
                                   __ldg(p.v_scales + row));
        }
        // Generic pointers to the shared-memory places of the u32 addresses.
        *reinterpret_cast<uint4*>(paged_prefill_smem + (k_dst - s_q)) = k8;
        *reinterpret_cast<uint4*>(paged_prefill_smem + (v_dst - s_q)) = v8;
      } else {
        const int64_t base = valid ? paged_prefill_kv_row(p, b, kv0 + r, kvh) * D + ch * 8 : 0;
        cp_async_16(k_dst, p.k_cache + base, valid);
        cp_async_16(v_dst, p.v_cache + base, valid);
      }
    }
  };
  const int kv_begin = kv_first / kMmaKV * kMmaKV;
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
  const float scale_log2 = p.scale * kLog2e;
  // This thread's rows of the tile, row_a and row_a + 8, and their queries' positions.
  const int row_a = warp * 16 + (lane >> 2);
  const int row_pos[2] = {start + row_query(row_a), start + row_query(row_a + 8)};

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

    // Scale, mask, online softmax. A tile needs the mask when its last key is past the earliest
    // row's position (the diagonal, and the keys past kv_end) or when the latest row's first key
    // is past its first key (a window or chunk edge).
    const int kv0 = kv_begin + t * kMmaKV;
    const bool masked_tile = kv0 + kMmaKV - 1 > first_pos || last_first_key > kv0;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * scale_log2;
        if (masked_tile) {
          const int col = kv0 + j * 8 + (lane & 3) * 2 + (e & 1);
          const int pos = row_pos[e >> 1];
          if (col > pos || col < first_visible_key(pos, window, chunk)) v = -INFINITY;
        }
        s[j][e] = v;
      }
    }
online_softmax_update(s, m, l, o);
    accumulate_pv<D>(o, s, sv, lane);
    __syncthreads();  // this buffer is reloaded two tiles from now
  }
  gemm::cp_async_wait<0>();

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_a + half * 8;
    if (!row_valid(row)) continue;
    // Every query sees at least its own key, so m is finite; log2 units, as the scores.
    const int head = kvh * G + row % G;
    const float inv = p.sinks != nullptr
                          ? sink_normaliser_log2(m[half], l[half], __ldg(p.sinks + head))
                          : 1.f / l[half];
    __nv_bfloat16* out = p.out + row_offset(row);
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      *reinterpret_cast<__nv_bfloat162*>(out + j * 8 + (lane & 3) * 2) =
          __floats2bfloat162_rn(o[j][2 * half] * inv, o[j][2 * half + 1] * inv);
    }
  }
}

}  // namespace moeinfer::cuda
