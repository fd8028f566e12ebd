// MLA decode attention for latents and cache rows wider than mla_decode_kernel holds
// (L > kMlaMaxLatentDim or W > kMlaMaxCacheWidth): any L and R, multiples of 8. Same math, same
// split plan, workspace and combine kernel; only the way a block walks a row changes. Why built
// this way:
//
// - mla_decode_kernel keeps a whole 32-key tile of rows in shared memory, each warp's k-steps of
//   Q in registers and all L output dims in registers; all three grow with the row. Here every
//   resource is bounded whatever L and R are: a block owns one slice of at most 512 output dims
//   (kSliceCols: the same 32 float accumulators per thread as mla_decode_kernel at L = 512), and
//   the rows stream through shared memory in panels of 256 columns (kPanelCols).
// - Grid (num_splits x slices, ceil(Nh / 16), B). For each 32-key tile a block runs the score
//   steps (panel c: cache columns [256 c, 256 c + 256) of the tile's keys and the same columns of
//   Q; warp w takes the panel's k-steps w and w + 8 into its partial scores), then the online
//   softmax (shared with mla_decode_kernel: online_softmax_tile), then the value steps (panel v:
//   latent columns [c0 + 256 v, c0 + 256 v + 256) of the keys, c0 the slice's first; warp w
//   takes the panel's 16-dim groups w and w + 8). Every step goes through one double-buffered
//   cp.async pipeline (the next step's panel loads while this one computes), one barrier a step.
// - Each slice computes the full scores again (slices x the score work, and the value columns
//   are read twice, the second time mostly from L2): simple, and no published model is past 512.
//   The slices of a (row, head) run the same instructions on the same data, so their maxima and
//   sums are bit-identical; slice 0 writes them to the workspace for the combine kernel.
// - Masking as in mla_decode_kernel: rows past the split's keys, columns past W (score panels)
//   or past L (value panels) and Q rows past Nh are zero-filled by cp.async without a global
//   read, so padded k-steps and dropped output groups multiply zeros, never stale data.
// - fp8 rows (kFp8, --kv-dtype fp8): a step's key panel is read synchronously, 8 codes a chunk
//   decoded to bf16 and stored at the chunk's swizzled offset, zeros where cp.async would
//   zero-fill (mla::fp8_chunk, as in mla_decode_kernel); Q still goes through cp.async.
// - About 70 KB of shared memory (two buffers of a 32 x 256 cache panel and a 16 x 256 Q panel,
//   the partial scores, P) and <= 128 registers (at most 80, for three blocks an SM, spills),
//   so two blocks share an SM, as with mla_decode_kernel.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/mla_attention_kernel.cuh"

namespace moeinfer::cuda {

namespace mla {

inline constexpr int kPanelCols = 256;                        // columns per streamed panel
inline constexpr int kPanelChunks = kPanelCols / 8;           // 16-byte chunks per panel row (32)
inline constexpr int kPanelKSteps = kPanelCols / 16;          // mma k-steps per score panel (16)
inline constexpr int kSliceCols = 512;                        // output dims per block
inline constexpr int kSlicePanels = kSliceCols / kPanelCols;  // value panels per slice (2)
inline constexpr int kPanelKStepsPerWarp = kPanelKSteps / kWarps;     // 2
inline constexpr int kPanelGroupsPerWarp = kPanelCols / 16 / kWarps;  // 2
inline constexpr int kWideKeyBytes = kKeys * kPanelChunks * 16;       // [kKeys, 32 chunks]: 16 KB
inline constexpr int kWideQBytes = kHeads * kPanelChunks * 16;        // [kHeads, 32 chunks]: 8 KB
inline constexpr int kWideBufferBytes = kWideKeyBytes + kWideQBytes;
inline constexpr int kWideRedBytes = kWarps * kHeads * kRedStride * 4;
// Two buffers, the partial scores, then P [kHeads, kPStride] bf16.
inline constexpr int kWideSmemBytes = 2 * kWideBufferBytes + kWideRedBytes + kHeads * kPStride * 2;
static_assert(kPanelKSteps % kWarps == 0 && (kPanelCols / 16) % kWarps == 0,
              "every warp takes the same number of k-steps and groups of a panel");
static_assert(kSliceCols % kPanelCols == 0, "a slice is whole panels");
static_assert(kPanelChunks % 8 == 0, "the swizzle permutes chunks within groups of 8");
static_assert(kThreads / 8 == kKeys, "the panel loader gives each row 8 threads");

// Output slices of kSliceCols dims for a latent of L dims.
__host__ __device__ constexpr int wide_slices(int latent) {
  return (latent + kSliceCols - 1) / kSliceCols;
}

}  // namespace mla

// grid (num_splits * wide_slices(L), ceil(Nh / 16), B), mla::kThreads threads,
// mla::kWideSmemBytes of dynamic shared memory. Block x covers split x / slices, output dims
// [512 (x % slices), + 512) of L; split s of row b covers keys [s * chunk, min(len, (s + 1) *
// chunk)). kFp8: the cache is the fp8 planes (p.latent_codes ...), else p.cache's bf16 rows.
template <bool kFp8>
__global__ void __launch_bounds__(mla::kThreads, 2)
    mla_decode_wide_kernel(const __grid_constant__ MlaDecodeParams p, int chunk, int num_splits) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  using namespace mla;
  using attn::ldmatrix_x4_trans;
  using gemm::cp_async_16;
  using gemm::ldmatrix_x4;
  using gemm::mma_bf16;
  extern __shared__ __align__(128) uint8_t mla_wide_smem[];
  __shared__ float s_alpha[kHeads], s_l[kHeads];

  const int L = static_cast<int>(p.latent_dim);
  const int width = L + static_cast<int>(p.rope_dim);
  const int slices = wide_slices(L);
  const int split = blockIdx.x / slices, slice = blockIdx.x % slices;
  const int h0 = blockIdx.y * kHeads, b = blockIdx.z;
  const int c0 = slice * kSliceCols;               // the slice's first output dim
  const int slice_cols = min(kSliceCols, L - c0);  // a positive multiple of 8
  const int w_chunks = width / 8, l_chunks = L / 8;
  const int k_steps = (width + 15) / 16;
  const int score_steps = (w_chunks + kPanelChunks - 1) / kPanelChunks;
  const int value_steps = (slice_cols + kPanelCols - 1) / kPanelCols;  // 1 or 2
  const int steps = score_steps + value_steps;                         // per tile
  const int heads = min(kHeads, static_cast<int>(p.num_heads) - h0);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t bh0 = static_cast<int64_t>(b) * p.num_heads + h0;

  const int len = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(len >= 0 && len <= p.max_seq_len);
  const int start = split * chunk;
  const int end = min(len, start + chunk);
  if (start >= end) {
    // A split past this row's keys (the combine kernel does not read it), or, unsplit, an
    // empty row: zeros in this slice's dims.
    if (num_splits == 1) {
      for (int i = tid; i < heads * slice_cols; i += kThreads) {
        p.out[(bh0 + i / slice_cols) * L + c0 + i % slice_cols] = __float2bfloat16(0.f);
      }
    }
    return;
  }
  const int n = end - start;
  const int num_tiles = (n + kKeys - 1) / kKeys;

  const uint32_t s_buffers = gemm::smem_u32(mla_wide_smem);  // [2] x (keys, then Q) panels
  float* s_red = reinterpret_cast<float*>(mla_wide_smem + 2 * kWideBufferBytes);
  __nv_bfloat16* s_p =
      reinterpret_cast<__nv_bfloat16*>(mla_wide_smem + 2 * kWideBufferBytes + kWideRedBytes);
  const uint32_t s_p_u32 = gemm::smem_u32(s_p);
  // Chunk c of panel row `row`, XOR-swizzled by (row & 7) within its group of 8 chunks, so the 8
  // rows an ldmatrix reads at one chunk fall in 8 different bank groups.
  auto offset = [](int row, int c) {
    return static_cast<uint32_t>((row * kPanelChunks + (c ^ (row & 7))) * 16);
  };

  // Step `step` of tile `tile` into buffer `buffer`: score steps [0, score_steps) bring cache
  // columns [256 step, 256 step + 256) of the tile's keys (none past W) and the same columns of
  // Q (none past W, no rows past Nh); value step score_steps + v brings latent columns
  // [c0 + 256 v, c0 + 256 v + 256) of the keys (none past L). 8 threads per key row, one
  // block-table lookup each.
  auto load_step = [&](int buffer, int tile, int step) {
    const bool score = step < score_steps;
    const int first_chunk =
        score ? step * kPanelChunks : (c0 + (step - score_steps) * kPanelCols) / 8;
    const int row_chunks = score ? w_chunks : l_chunks;  // chunks of a row this step may read
    const uint32_t dst = s_buffers + buffer * kWideBufferBytes;
    const int r = tid >> 3, sub = tid & 7;
    const int key = tile * kKeys + r;
    if constexpr (kFp8) {
      const bool has_row = key < n;
      Fp8Row row;
      if (has_row) {
        const int token = start + key;
        const int block = __ldg(p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq +
                                token / static_cast<int>(p.block_size));
        MOE_DEVICE_CHECK(block >= 0 && block < p.num_blocks);
        row = fp8_row(
            p, static_cast<int64_t>(block) * p.block_size + token % static_cast<int>(p.block_size));
      }
      uint8_t* keys = mla_wide_smem + buffer * kWideBufferBytes;
      for (int c = sub; c < kPanelChunks; c += 8) {
        const bool valid = has_row && first_chunk + c < row_chunks;
        *reinterpret_cast<uint4*>(keys + offset(r, c)) =
            valid ? fp8_chunk(row, first_chunk + c, l_chunks) : uint4{0, 0, 0, 0};
      }
    } else {
      const __nv_bfloat16* row = nullptr;
      if (key < n) {
        const int token = start + key;
        const int block = __ldg(p.block_tables + static_cast<int64_t>(b) * p.max_blocks_per_seq +
                                token / static_cast<int>(p.block_size));
        MOE_DEVICE_CHECK(block >= 0 && block < p.num_blocks);
        row = p.cache + (static_cast<int64_t>(block) * p.block_size +
                         token % static_cast<int>(p.block_size)) *
                            width;
      }
      for (int c = sub; c < kPanelChunks; c += 8) {
        const bool valid = row != nullptr && first_chunk + c < row_chunks;
        cp_async_16(dst + offset(r, c), valid ? row + (first_chunk + c) * 8 : p.cache, valid);
      }
    }
    if (score) {
      const __nv_bfloat16* q = p.q + bh0 * width;
      for (int i = tid; i < kHeads * kPanelChunks; i += kThreads) {
        const int hr = i / kPanelChunks, c = i % kPanelChunks;
        const bool valid = hr < heads && first_chunk + c < w_chunks;
        cp_async_16(dst + kWideKeyBytes + offset(hr, c),
                    valid ? q + static_cast<int64_t>(hr) * width + (first_chunk + c) * 8 : p.q,
                    valid);
      }
    }
  };
  // Opens step `step` of tile `tile`, the flat step `flat` of the block's sequence (its parity
  // picks the buffer): waits for its panel, then starts loading the next step's.
  int flat = 0;
  auto begin_step = [&](int tile, int step) {
    // This step's panel has landed; every warp is done with the previous step, whose buffer
    // is refilled next (and, at a tile's first step, with the previous tile's P and alpha).
    gemm::cp_async_wait<0>();
    __syncthreads();
    if (step + 1 < steps) {
      load_step((flat + 1) & 1, tile, step + 1);
    } else if (tile + 1 < num_tiles) {
      load_step((flat + 1) & 1, tile + 1, 0);
    }
    gemm::cp_async_commit();
    return s_buffers + (flat++ & 1) * kWideBufferBytes;
  };
  load_step(0, 0, 0);
  gemm::cp_async_commit();

  float o[kSlicePanels][kPanelGroupsPerWarp][2][4];
#pragma unroll
  for (int v = 0; v < kSlicePanels; ++v)
#pragma unroll
    for (int i = 0; i < kPanelGroupsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[v][i][j][e] = 0.f;
  // Online softmax state of head row r_soft, held (identically) by its 16 threads.
  const int r_soft = tid >> 4;
  float m = -INFINITY, l = 0.f;
  const float scale_log2 = p.scale * 1.4426950408889634f;

  for (int t = 0; t < num_tiles; ++t) {
    // 1. Partial scores over this warp's k-steps of every panel: [16 heads, 32 keys] as 4
    // n-tiles.
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
    for (int step = 0; step < score_steps; ++step) {
      const uint32_t keys = begin_step(t, step);
      const uint32_t q = keys + kWideKeyBytes;
#pragma unroll
      for (int i = 0; i < kPanelKStepsPerWarp; ++i) {
        const int ks = warp + i * kWarps;                   // the panel's k-step
        if (step * kPanelKSteps + ks >= k_steps) continue;  // wholly past W (warp-uniform)
        uint32_t qa[4];
        ldmatrix_x4(qa, q + offset(lane & 15, ks * 2 + (lane >> 4)));
#pragma unroll
        for (int kp = 0; kp < 2; ++kp) {
          uint32_t bk[4];
          ldmatrix_x4(bk, keys + offset(kp * 16 + ((lane >> 4) << 3) + (lane & 7),
                                        ks * 2 + ((lane >> 3) & 1)));
          mma_bf16(s[2 * kp], qa, bk[0], bk[1]);
          mma_bf16(s[2 * kp + 1], qa, bk[2], bk[3]);
        }
      }
    }
    {
      float* red = s_red + warp * kHeads * kRedStride;
      const int row = lane >> 2;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = j * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(red + row * kRedStride + col) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(red + (row + 8) * kRedStride + col) =
            make_float2(s[j][2], s[j][3]);
      }
    }
    __syncthreads();

    // 2. Online softmax over all 8 warps' partials (a warp with no k-step wrote zeros). Its
    // reads of s_red and writes of P and alpha are ordered against the other steps by their
    // barriers: the next value step's, and the next tile's first score step's.
    online_softmax_tile(s_red, kWarps, t * kKeys, n, scale_log2, s_p, s_alpha, m, l);

    // 3. Values: rescale, then o += P V over this warp's groups of each value panel.
#pragma unroll
    for (int v = 0; v < kSlicePanels; ++v) {
      if (v >= value_steps) continue;  // block-uniform
      const uint32_t values = begin_step(t, score_steps + v);
      if (v == 0) {
        const float a_lo = s_alpha[lane >> 2], a_hi = s_alpha[(lane >> 2) + 8];
#pragma unroll
        for (int u = 0; u < kSlicePanels; ++u)
#pragma unroll
          for (int i = 0; i < kPanelGroupsPerWarp; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              o[u][i][j][0] *= a_lo;
              o[u][i][j][1] *= a_lo;
              o[u][i][j][2] *= a_hi;
              o[u][i][j][3] *= a_hi;
            }
      }
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t pa[4];
        ldmatrix_x4(pa, s_p_u32 + ((lane & 15) * kPStride + kk * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
        for (int i = 0; i < kPanelGroupsPerWarp; ++i) {
          const int g = warp + i * kWarps;                  // the panel's group of 16 dims
          if (c0 + v * kPanelCols + g * 16 >= L) continue;  // wholly past L (warp-uniform)
          // Chunks 2g and 2g + 1; when L / 8 is odd the second may lie past L, zero-filled,
          // its products computed and dropped.
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, values + offset(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                2 * g + (lane >> 4)));
          mma_bf16(o[v][i][0], pa, bv[0], bv[1]);
          mma_bf16(o[v][i][1], pa, bv[2], bv[3]);
        }
      }
    }
  }
  gemm::cp_async_wait<0>();  // the last (empty) group

  if ((tid & 15) == 0) s_l[r_soft] = l;
  __syncthreads();
#pragma unroll
  for (int v = 0; v < kSlicePanels; ++v) {
#pragma unroll
    for (int i = 0; i < kPanelGroupsPerWarp; ++i) {
      const int g = warp + i * kWarps;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // d < c0 + 512 by construction; d < L keeps d + 1 < L too (L and d even).
        const int d = c0 + v * kPanelCols + (2 * g + j) * 8 + (lane & 3) * 2;
        if (d >= L) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = (lane >> 2) + half * 8;
          if (row >= heads) continue;
          const int64_t bh = bh0 + row;
          const float v0 = o[v][i][j][2 * half], v1 = o[v][i][j][2 * half + 1];
          if (num_splits == 1) {
            const float inv = 1.f / s_l[row];
            *reinterpret_cast<__nv_bfloat162*>(p.out + bh * L + d) =
                __floats2bfloat162_rn(v0 * inv, v1 * inv);
          } else {
            *reinterpret_cast<float2*>(p.workspace + (bh * num_splits + split) * L + d) =
                make_float2(v0, v1);
          }
        }
      }
    }
  }
  if (num_splits > 1 && slice == 0 && (tid & 15) == 0 && r_soft < heads) {
    float* ml = p.workspace + p.num_seqs * p.num_heads * num_splits * L;  // [B, Nh, splits, 2]
    *reinterpret_cast<float2*>(ml + ((bh0 + r_soft) * num_splits + split) * 2) = make_float2(m, l);
  }
}

}  // namespace moeinfer::cuda
