// MLA prefill attention (absorbed form) over the paged latent cache, on tensor cores (mma.sync
// m16n8k16, bf16 in, float32 scores, softmax and accumulators). Before this kernel every prompt
// token was its own query row through the decode kernel (the per-query route), so a prompt of
// T tokens read O(T^2) cache rows once per 16 heads. Why built this way:
//
// - MQA over one latent "head": every head scores against the same row [c | k_rope] (W = L + R)
//   and takes its output from the row's first L values. A block's 64 mma rows are (query, head)
//   pairs, row r = query q0 + r / Gt, head h0 + r % Gt, for Gt = min(Nh, 64) heads (Nh > 64 is
//   split into even head tiles, the grid's y) and floor(64 / Gt) queries, as the paged GQA
//   prefill kernel packs a KV head's group. Each 32-key tile of the cache is brought into
//   shared memory once (cp.async, double-buffered, one block-table lookup per row) and used for
//   both products: S = Q K^T over all W columns, O += P V over its first L columns.
// - The [64, L] float32 output does not fit one warp per 16 rows (L = 512 would be 256
//   accumulators a thread). 8 warps: warp w owns rows [16 (w % 4), +16) and output half
//   w / 4, i.e. 16-column groups [gh (w / 4), gh (w / 4 + 1)) of the ceil(L / 16) groups, so at
//   most 16 groups x 2 n-tiles x 4 = 128 accumulators a thread at L = 512.
// - The two warps of a row group split the score product along W instead of both computing
//   it: warp half 0 takes k-steps [0, ceil(k / 2)), half 1 the rest; each writes its partial
//   [16, 32] scores (in the mma accumulator layout, so lane i reads lane i's values back) to
//   shared memory and adds its partner's. Float addition commutes, so both warps hold the same
//   scores bit for bit and run the same online softmax; P never leaves registers (two adjacent
//   8-key score tiles are the A fragment of one 16-key step), V comes through ldmatrix.trans.
// - Q stays in shared memory ([64, W], 72 KB at W = 576) and is read per k-step with ldmatrix:
//   in registers it would be 144 more a thread. Shared memory at W = 576: Q 72 KB, two key tiles
//   72 KB, the score exchange 16 KB: one block of 8 warps an SM.
// - Rows are W bf16 as 16-byte chunks padded to a multiple of 8 chunks and XOR-swizzled by
//   (row & 7) (the decode kernel's layout); padding chunks, Q rows past the tile's queries and
//   keys at or past the tile's last query's position + 1 are zero-filled, never read from
//   global memory (a slot past a sequence's keys need not hold anything finite). Keys between a
//   row's own position and that bound are real rows masked to -inf, only in the tiles that
//   cross the tile's first query's position.
// - fp8 rows (kFp8): each thread reads 8 codes and its row's scale, decodes them to bf16 and
//   stores them where cp.async would have put the bf16 chunk (as mla_decode_kernel), so an fp8
//   cache gives the outputs of a bf16 cache holding the decoded values; the load is synchronous.
// - Work planned on the host (plan_mla_prefill_tiles): blockIdx.x walks the list of every
//   sequence's query tiles backwards, so the latest queries of the longest sequences (the
//   longest key ranges) start first and the short ones fill the tail.
//
// Written without a GPU: 239 registers and no spills at L 512 + R 64 (nvcc -Xptxas -v, sm_90);
// its indexing checked only by a host emulation of the ldmatrix / mma fragments (not kept), not
// yet run on a GPU.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "backend/cuda/attention_prefill_mma_kernel.cuh"  // attn::ldmatrix_x4_trans, pack_bf16x2
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/grouped_gemm_kernel.cuh"  // cp.async, ldmatrix, mma.sync helpers
#include "backend/cuda/kv_fp8.cuh"
#include "backend/cuda/mla_attention.h"
#include "backend/cuda/mla_rows.cuh"

namespace moeinfer::cuda {

namespace mla {

inline constexpr int kPrefillWarps = 8;
inline constexpr int kPrefillThreads = kPrefillWarps * 32;
inline constexpr int kPrefillRows = static_cast<int>(kMlaPrefillTileRows);
inline constexpr int kPrefillRowGroups = kPrefillRows / 16;  // 4 warps' rows
inline constexpr int kPrefillKeys = 32;                      // keys per tile
inline constexpr int kPrefillScoreTiles = kPrefillKeys / 8;  // 4 n-tiles of S
inline constexpr int kPrefillMaxKSteps = (static_cast<int>(kMlaPrefillMaxCacheWidth) + 15) / 16;
inline constexpr int kPrefillKStepsPerHalf = (kPrefillMaxKSteps + 1) / 2;  // 18
inline constexpr int kPrefillMaxOutGroups = (static_cast<int>(kMlaPrefillMaxLatentDim) + 15) / 16;
inline constexpr int kPrefillGroupsPerHalf = (kPrefillMaxOutGroups + 1) / 2;  // 16
static_assert(kPrefillWarps == 2 * kPrefillRowGroups, "two warps (output halves) per row group");
static_assert(kPrefillThreads / 8 == kPrefillKeys, "the tile loader gives each key row 8 threads");

// Bytes of the score exchange: per warp, per score n-tile, per lane a float4.
inline constexpr int kPrefillExchangeBytes = kPrefillWarps * kPrefillScoreTiles * 32 * 16;

__host__ __device__ constexpr int prefill_q_bytes(int width) {
  return kPrefillRows * row_chunks(width) * 16;
}
__host__ __device__ constexpr int prefill_tile_bytes(int width) {
  return kPrefillKeys * row_chunks(width) * 16;
}
// Q [64, chunks], two key tiles [32, chunks] (bf16 chunks), the exchange.
__host__ __device__ constexpr int prefill_smem_bytes(int width) {
  return prefill_q_bytes(width) + 2 * prefill_tile_bytes(width) + kPrefillExchangeBytes;
}

}  // namespace mla

// grid (num_tiles, head_tiles), mla::kPrefillThreads threads, mla::prefill_smem_bytes(W) bytes
// of dynamic shared memory. heads_per_tile: mla_prefill_tiling's Gt.
template <bool kFp8>
__global__ void __launch_bounds__(mla::kPrefillThreads, 1)
    mla_prefill_kernel(const __grid_constant__ MlaPrefillParams p, int heads_per_tile) {
  using namespace mla;
  using attn::ldmatrix_x4_trans;
  using attn::pack_bf16x2;
  using gemm::cp_async_16;
  using gemm::ldmatrix_x4;
  using gemm::mma_bf16;
  extern __shared__ __align__(128) uint8_t mla_prefill_smem[];

  const int L = static_cast<int>(p.latent_dim);
  const int width = L + static_cast<int>(p.rope_dim);
  const int w_chunks = width / 8;
  const int chunks = row_chunks(width);
  const int k_steps = (width + 15) / 16;
  const int out_groups = (L + 15) / 16;
  const int Nh = static_cast<int>(p.num_heads);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int row_group = warp % kPrefillRowGroups, half = warp / kPrefillRowGroups;

  // The block's work: query tile `tile` of sequence b, heads [h0, h0 + heads).
  const int tile = static_cast<int>(p.num_tiles) - 1 - static_cast<int>(blockIdx.x);
  const int Gt = heads_per_tile;
  const int h0 = static_cast<int>(blockIdx.y) * Gt;
  const int heads = min(Gt, Nh - h0);
  const int tile_queries = kPrefillRows / Gt;
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
  const int tile_end = min(num_queries, q0 + tile_queries);
  // Row r: query q0 + r / Gt, head h0 + r % Gt; rows past the tile's queries or heads are zero
  // and are not written.
  auto row_query = [&](int r) { return q0 + r / Gt; };
  auto row_valid = [&](int r) {
    return r < tile_queries * Gt && row_query(r) < tile_end && r % Gt < heads;
  };
  auto row_index = [&](int r) {  // (token, head) row of q and out
    return (static_cast<int64_t>(seq0) + row_query(r)) * Nh + h0 + r % Gt;
  };

  const uint32_t s_q = gemm::smem_u32(mla_prefill_smem);
  const uint32_t s_tiles = s_q + prefill_q_bytes(width);
  const int t_bytes = prefill_tile_bytes(width);
  float4* s_exchange = reinterpret_cast<float4*>(mla_prefill_smem + prefill_q_bytes(width) +
                                                 2 * t_bytes);  // [warps, n-tiles, 32]
  auto offset = [chunks](int row, int c) {
    return static_cast<uint32_t>((row * chunks + (c ^ (row & 7))) * 16);
  };

  for (int i = tid; i < kPrefillRows * chunks; i += kPrefillThreads) {
    const int r = i / chunks, c = i % chunks;
    const bool valid = row_valid(r) && c < w_chunks;
    cp_async_16(s_q + offset(r, c), valid ? p.q + row_index(r) * width + c * 8 : p.q, valid);
  }
  // Keys [kv0, kv0 + 32) into buffer `buffer`; keys at or past kv_end (no row of the tile sees
  // them) are zeros.
  const int first_pos = start + q0;     // the tile's earliest query's position
  const int kv_end = start + tile_end;  // the latest query's position + 1
  const int num_kv_tiles = (kv_end + kPrefillKeys - 1) / kPrefillKeys;
  auto load_tile = [&](int buffer, int kv0) {
    const int r = tid >> 3, sub = tid & 7;
    const int key = kv0 + r;
    const bool has_row = key < kv_end;
    int64_t slot = 0;
    if (has_row) {
      const int block = __ldg(p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq +
                              key / static_cast<int>(p.block_size));
      MOE_DEVICE_CHECK(block >= 0 && block < p.num_blocks);
      slot = static_cast<int64_t>(block) * p.block_size + key % static_cast<int>(p.block_size);
    }
    if constexpr (kFp8) {
      Fp8Row row;
      if (has_row) {
        row = Fp8Row{.latent = p.latent_codes + slot * p.latent_dim,
                     .rope = p.rope_codes + slot * p.rope_dim,
                     .latent_scale = __ldg(p.latent_scales + slot),
                     .rope_scale = __ldg(p.rope_scales + slot)};
      }
      uint8_t* dst = mla_prefill_smem + (s_tiles - s_q) + buffer * t_bytes;
      const int l_chunks = L / 8;
      for (int c = sub; c < chunks; c += 8) {
        const uint4 v = has_row && c < w_chunks ? fp8_chunk(row, c, l_chunks) : uint4{0, 0, 0, 0};
        *reinterpret_cast<uint4*>(dst + offset(r, c)) = v;
      }
    } else {
      const __nv_bfloat16* row = p.cache + slot * width;
      const uint32_t dst = s_tiles + buffer * t_bytes;
      for (int c = sub; c < chunks; c += 8) {
        const bool valid = has_row && c < w_chunks;
        cp_async_16(dst + offset(r, c), valid ? row + c * 8 : p.cache, valid);
      }
    }
  };
  load_tile(0, 0);
  gemm::cp_async_commit();

  // This warp's k-steps of the scores and 16-column groups of the output.
  const int ks_split = (k_steps + 1) / 2;
  const int ks_begin = half == 0 ? 0 : ks_split, ks_end = half == 0 ? ks_split : k_steps;
  const int groups_per_half = (out_groups + 1) / 2;
  const int g_begin = half * groups_per_half;
  const int g_end = min(out_groups, g_begin + groups_per_half);
  const int q_row = row_group * 16;

  float o[kPrefillGroupsPerHalf][2][4];
#pragma unroll
  for (int i = 0; i < kPrefillGroupsPerHalf; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][j][e] = 0.f;
  // Online softmax state of this thread's rows q_row + lane / 4 and that + 8 (log2 domain),
  // identical in the row's quad and in the partner warp.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int row_a = q_row + (lane >> 2);
  const int row_pos[2] = {start + row_query(row_a), start + row_query(row_a + 8)};

  for (int t = 0; t < num_kv_tiles; ++t) {
    // Tile t (and, at t = 0, Q) has landed; every warp is done with tile t - 1, whose buffer
    // is refilled next, and with reading its partner's scores of tile t - 1.
    gemm::cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < num_kv_tiles) load_tile((t + 1) & 1, (t + 1) * kPrefillKeys);
    gemm::cp_async_commit();
    const uint32_t kv = s_tiles + (t & 1) * t_bytes;

    // 1. Partial scores over this warp's k-steps: [16 rows, 32 keys] as 4 n-tiles.
    float s[kPrefillScoreTiles][4];
#pragma unroll
    for (int j = 0; j < kPrefillScoreTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
        // Unrolled by 2 only: fully unrolled, the compiler keeps every k-step's shared-memory
        // addresses live across the tile loop and the output accumulators spill (255 registers,
        // 176 bytes of spills); by 2 it can issue the next k-step's loads early (239, none).
#pragma unroll 2
    for (int ks = ks_begin; ks < ks_end; ++ks) {
      uint32_t qa[4];
      ldmatrix_x4(qa, s_q + offset(q_row + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int kp = 0; kp < 2; ++kp) {
        uint32_t bk[4];
        ldmatrix_x4(
            bk, kv + offset(kp * 16 + ((lane >> 4) << 3) + (lane & 7), ks * 2 + ((lane >> 3) & 1)));
        mma_bf16(s[2 * kp], qa, bk[0], bk[1]);
        mma_bf16(s[2 * kp + 1], qa, bk[2], bk[3]);
      }
    }
    // 2. The partner warp's partial: the same lane of the same fragment.
#pragma unroll
    for (int j = 0; j < kPrefillScoreTiles; ++j) {
      s_exchange[(warp * kPrefillScoreTiles + j) * 32 + lane] =
          make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
    }
    __syncthreads();
    const int partner = warp ^ kPrefillRowGroups;
#pragma unroll
    for (int j = 0; j < kPrefillScoreTiles; ++j) {
      const float4 other = s_exchange[(partner * kPrefillScoreTiles + j) * 32 + lane];
      s[j][0] += other.x;
      s[j][1] += other.y;
      s[j][2] += other.z;
      s[j][3] += other.w;
    }

    // 3. Scale, causal mask (only tiles that reach past the earliest query's position), online
    // softmax; the rows' quads reduce with two shuffles.
    const int kv0 = t * kPrefillKeys;
    const bool masked_tile = kv0 + kPrefillKeys - 1 > first_pos;
#pragma unroll
    for (int j = 0; j < kPrefillScoreTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * scale_log2;
        if (masked_tile && kv0 + j * 8 + (lane & 3) * 2 + (e & 1) > row_pos[e >> 1]) v = -INFINITY;
        s[j][e] = v;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kPrefillScoreTiles; ++j) {
        mx = fmaxf(mx, fmaxf(s[j][2 * hr], s[j][2 * hr + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[hr], mx);
      // Every row sees key 0 (tile 0), so m_new is finite; the guard keeps a fully masked row
      // at p = 0 rather than NaN should that ever change.
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[hr] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kPrefillScoreTiles; ++j) {
        // P as bf16 (the value product's A operand); the sum is of the rounded weights.
        const __nv_bfloat162 pb =
            __floats2bfloat162_rn(exp2f(s[j][2 * hr] - m_use), exp2f(s[j][2 * hr + 1] - m_use));
        const float2 pf = __bfloat1622float2(pb);
        s[j][2 * hr] = pf.x;
        s[j][2 * hr + 1] = pf.y;
        sum += pf.x + pf.y;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l[hr] = l[hr] * alpha + sum;
      m[hr] = m_new;
#pragma unroll
      for (int i = 0; i < kPrefillGroupsPerHalf; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          o[i][j][2 * hr] *= alpha;
          o[i][j][2 * hr + 1] *= alpha;
        }
    }

    // 4. O += P V over this warp's column groups: V is the tile's latent columns. The lane
    // goes through an empty asm each tile so that its addresses are recomputed (a few integer
    // ops) rather than 32 of them held in registers across the tile loop.
    int v_lane = lane;
    asm volatile("" : "+r"(v_lane));
#pragma unroll
    for (int kk = 0; kk < kPrefillKeys / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                              pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int i = 0; i < kPrefillGroupsPerHalf; ++i) {
        const int g = g_begin + i;
        if (g < g_end) {
          // Chunks 2g and 2g + 1; when L / 8 is odd the second is a rope chunk whose products
          // are computed and dropped.
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, kv + offset(kk * 16 + (v_lane & 7) + ((v_lane >> 3) & 1) * 8,
                                            2 * g + (v_lane >> 4)));
          mma_bf16(o[i][0], pa, bv[0], bv[1]);
          mma_bf16(o[i][1], pa, bv[2], bv[3]);
        }
      }
    }
  }
  gemm::cp_async_wait<0>();  // the last (empty) group

#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = row_a + hr * 8;
    if (!row_valid(row)) continue;
    const float inv = 1.f / l[hr];
    __nv_bfloat16* out = p.out + row_index(row) * L;
#pragma unroll
    for (int i = 0; i < kPrefillGroupsPerHalf; ++i) {
      const int g = g_begin + i;
      if (g >= g_end) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int d = (2 * g + j) * 8 + (lane & 3) * 2;
        if (d < L) {
          *reinterpret_cast<__nv_bfloat162*>(out + d) =
              __floats2bfloat162_rn(o[i][j][2 * hr] * inv, o[i][j][2 * hr + 1] * inv);
        }
      }
    }
  }
}

}  // namespace moeinfer::cuda
