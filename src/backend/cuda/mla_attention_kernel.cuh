// MLA decode attention (absorbed form) over the paged latent cache, on tensor cores
// (mma.sync m16n8k16, bf16 in, float32 accumulators and softmax). Why built this way:
//
// - All heads read the same cache rows (MQA with key width W = L + R, value width L, the value
//   being the key's latent prefix). One block per (split, tile of 16 heads, sequence): the 16
//   heads are the 16 rows of the mma tiles (rows past Nh are zero and never written), and each
//   32-row tile of the cache is brought into shared memory once (cp.async, double-buffered, the
//   page of each row looked up in the block table) and used for both products. At W = 576 a
//   32-key step costs 36 k-steps x 4 n-tiles of mma for the scores and 2 x 64 for the values.
// - The 8 warps split the score product along W: warp w owns k-steps w, w + 8, ... (at most 5
//   for W = 576), so its slice of Q stays in registers for the whole chunk and each K byte is
//   read from shared memory once. The partial scores go through shared memory ([8, 16, 32]
//   float32), where 16 threads per head sum them, run the online softmax (running max and sum
//   in registers, the max in the log2 domain with scale * log2(e) folded in), and write P as
//   bf16 with the per-head rescale factor. Then the warps split the value product along L:
//   warp w owns output dims [16 g, 16 g + 16) for g = w, w + 8, ... (at most 4 groups for
//   L = 512), P as the A operand (ldmatrix) and the tile's latent columns as B (ldmatrix.trans).
//   Three barriers per 32-key tile; about 93 KB of shared memory and <= 128 registers, so two
//   blocks share an SM.
// - Rows are W bf16 held as 16-byte chunks, the row padded to a multiple of 8 chunks and the
//   chunks XOR-swizzled by (row & 7), so ldmatrix is conflict-free; padding chunks, rows past
//   the chunk's keys and Q rows past Nh are zero-filled by cp.async (no global read), so the
//   padded k-step (W not a multiple of 16) and masked keys multiply zeros, never stale data.
// - fp8 rows (kFp8, --kv-dtype fp8: a latent code plane, a rope code plane and a float32 scale
//   of each per slot, backend/cuda/kv_fp8.cuh) are loaded synchronously instead: each thread
//   reads 8 codes (a uint2) and its group's scale, decodes them to 8 bf16 and stores the uint4
//   at the chunk's swizzled offset, zeros where cp.async would zero-fill. The store lands in the
//   buffer not being read, before the barrier that opens its tile, as cp.async's would; the
//   rest of the kernel cannot tell the two apart, so an fp8 cache gives exactly the outputs of
//   a bf16 cache holding the decoded values. Half the cache bytes read; the next tile's load is
//   no longer in flight while this one computes (each thread waits for its codes before its
//   mma work), so only the other resident block hides that latency. Not measured yet.
// - The host plans the splits from max_seq_len (graph-safe); a block whose split starts past
//   its sequence's length exits at once. With one split the block normalises and writes bf16;
//   with several it writes its unnormalised output and (max, sum) to the workspace and
//   mla_decode_combine_kernel merges them in float32, spreading each row's splits over
//   threads (a long context at batch 1 has up to 264 splits).
// - Its maxima (kMaxLatent output dims in registers, a 576-wide tile and Q slice) cover DeepSeek's
//   512 + 64; wider latents and rows go to mla_decode_wide_kernel (mla_attention_wide_kernel.cuh),
//   which shares the softmax step, the workspace and the combine kernel below.
//
// Measured on an H200 (a throwaway timing loop, not yet a bench/ program; L 512, R 64, block
// size 64): with 16 heads, batch 128 to 256 at 2048 to 4096 keys reads the cache at 2.6 to 3.2
// TB/s; with 128 heads the work is 242 FLOP per cache byte, so it is compute-bound, and this
// kernel reaches about 117 TFLOP/s at batch 64 x 4096 keys (0.48 TB/s). Larger head tiles (each
// K/V fragment used by several mma rows) or wgmma would be the next step there.
#pragma once

#include <cuda_bf16.h>

#include <cmath>

#include "backend/cuda/attention_prefill_mma_kernel.cuh"  // attn::ldmatrix_x4_trans
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/grouped_gemm_kernel.cuh"  // cp.async, ldmatrix, mma.sync helpers
#include "backend/cuda/kv_fp8.cuh"
#include "backend/cuda/mla_attention.h"
#include "backend/cuda/mla_rows.cuh"

namespace moeinfer::cuda {

namespace mla {

inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kHeads = 16;  // heads per block: the rows of the mma tile
inline constexpr int kKeys = 32;   // cache rows per shared-memory tile
inline constexpr int kMaxLatent = static_cast<int>(kMlaMaxLatentDim);
inline constexpr int kMaxWidth = static_cast<int>(kMlaMaxCacheWidth);
inline constexpr int kMaxKSteps = (kMaxWidth + 15) / 16;                   // 36
inline constexpr int kKStepsPerWarp = (kMaxKSteps + kWarps - 1) / kWarps;  // 5
inline constexpr int kMaxOutGroups = (kMaxLatent + 15) / 16;               // 32 groups of 16 dims
inline constexpr int kGroupsPerWarp = (kMaxOutGroups + kWarps - 1) / kWarps;  // 4
inline constexpr int kRedStride = kKeys + 8;  // floats per head row of partial scores
inline constexpr int kPStride = kKeys + 8;    // bf16 per head row of P (80 bytes: no conflicts)
// Splits the host plans at most (mla_decode_split), and the combine kernel's shape: 256 threads
// over 32 pairs of latent dims.
inline constexpr int kMaxSplits = 264;
inline constexpr int kCombineThreads = 256;
inline constexpr int kCombinePairs = 32;
static_assert(kThreads / 8 == kKeys, "the tile loader gives each row 8 threads");
static_assert(kThreads == kHeads * (kKeys / 2), "the softmax gives each thread 2 keys of a head");

__host__ __device__ constexpr int tile_bytes(int width) { return kKeys * row_chunks(width) * 16; }

// The partial scores [kWarps, kHeads, kRedStride] float32; before the first tile the same
// bytes stage Q [kHeads, row_chunks] as swizzled bf16 chunks.
__host__ __device__ constexpr int red_bytes(int width) {
  return kWarps * kHeads * kRedStride * 4 > kHeads * row_chunks(width) * 16
             ? kWarps * kHeads * kRedStride * 4
             : kHeads * row_chunks(width) * 16;
}

// Two tiles, the partial scores (or Q), then P [kHeads, kPStride] bf16.
__host__ __device__ constexpr int smem_bytes(int width) {
  return 2 * tile_bytes(width) + red_bytes(width) + kHeads * kPStride * 2;
}

// Step 2 of each 32-key tile, shared by the MLA decode kernels: thread (r_soft, c_soft) =
// (tid / 16, 2 (tid % 16)) sums keys c_soft, c_soft + 1 of head r_soft over the partial scores of
// warps [0, red_warps) ([kWarps, kHeads, kRedStride] float32), masks keys at or past n
// (first_key: the tile's first key, below n), and runs the online softmax: P as bf16 into s_p
// [kHeads, kPStride], the head's rescale factor into s_alpha, its running max m (log2 domain)
// and sum l in registers, identical in the head's 16 threads (one half-warp, shuffles).
__device__ __forceinline__ void online_softmax_tile(const float* s_red, int red_warps,
                                                    int first_key, int n, float scale_log2,
                                                    __nv_bfloat16* s_p, float* s_alpha, float& m,
                                                    float& l) {
  const int tid = threadIdx.x;
  const int r_soft = tid >> 4, c_soft = (tid & 15) * 2;
  float2 acc = make_float2(0.f, 0.f);
  for (int w = 0; w < red_warps; ++w) {
    const float2 v =
        *reinterpret_cast<const float2*>(s_red + (w * kHeads + r_soft) * kRedStride + c_soft);
    acc.x += v.x;
    acc.y += v.y;
  }
  const int key = first_key + c_soft;
  const float s0 = key < n ? acc.x * scale_log2 : -INFINITY;
  const float s1 = key + 1 < n ? acc.y * scale_log2 : -INFINITY;
  float mx = fmaxf(s0, s1);
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  // Key first_key < n is in this tile, so m_new is finite and alpha = 0 on the first tile.
  const float m_new = fmaxf(m, mx);
  const float alpha = exp2f(m - m_new);
  const __nv_bfloat162 pb = __floats2bfloat162_rn(exp2f(s0 - m_new), exp2f(s1 - m_new));
  *reinterpret_cast<__nv_bfloat162*>(s_p + r_soft * kPStride + c_soft) = pb;
  // The sum is of the rounded weights the value product uses.
  const float2 pf = __bfloat1622float2(pb);
  float sum = pf.x + pf.y;
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  l = l * alpha + sum;
  m = m_new;
  if ((tid & 15) == 0) s_alpha[r_soft] = alpha;
}

__device__ __forceinline__ Fp8Row fp8_row(const MlaDecodeParams& p, int64_t slot) {
  return Fp8Row{.latent = p.latent_codes + slot * p.latent_dim,
                .rope = p.rope_codes + slot * p.rope_dim,
                .latent_scale = __ldg(p.latent_scales + slot),
                .rope_scale = __ldg(p.rope_scales + slot)};
}

}  // namespace mla

// grid (num_splits, ceil(Nh / 16), B), mla::kThreads threads, mla::smem_bytes(W) bytes of
// dynamic shared memory. Split s of row b covers keys [s * chunk, min(len, (s + 1) * chunk)).
// kFp8: the cache is the fp8 planes (p.latent_codes ...), else p.cache's bf16 rows.
template <bool kFp8>
__global__ void __launch_bounds__(mla::kThreads, 2)
    mla_decode_kernel(const __grid_constant__ MlaDecodeParams p, int chunk, int num_splits) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  using namespace mla;
  using attn::ldmatrix_x4_trans;
  using gemm::cp_async_16;
  using gemm::ldmatrix_x4;
  using gemm::mma_bf16;
  extern __shared__ __align__(128) uint8_t mla_smem[];
  __shared__ float s_alpha[kHeads], s_l[kHeads];

  const int split = blockIdx.x, h0 = blockIdx.y * kHeads, b = blockIdx.z;
  const int L = static_cast<int>(p.latent_dim);
  const int width = L + static_cast<int>(p.rope_dim);
  const int w_chunks = width / 8;
  const int chunks = row_chunks(width);
  const int k_steps = (width + 15) / 16;
  const int out_groups = (L + 15) / 16;
  const int heads = min(kHeads, static_cast<int>(p.num_heads) - h0);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t bh0 = static_cast<int64_t>(b) * p.num_heads + h0;

  const int len = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(len >= 0 && len <= p.max_seq_len);
  const int start = split * chunk;
  const int end = min(len, start + chunk);
  if (start >= end) {
    // A split past this row's keys (the combine kernel does not read it), or, unsplit, an
    // empty row: zeros.
    if (num_splits == 1) {
      for (int i = tid; i < heads * L; i += kThreads) p.out[bh0 * L + i] = __float2bfloat16(0.f);
    }
    return;
  }
  const int n = end - start;
  const int num_tiles = (n + kKeys - 1) / kKeys;

  const int t_bytes = tile_bytes(width);
  const uint32_t s_tiles = gemm::smem_u32(mla_smem);      // [2][kKeys, chunks] bf16 chunks
  const uint32_t s_red_u32 = s_tiles + 2 * t_bytes;       // Q first, then partial scores
  const uint32_t s_p_u32 = s_red_u32 + red_bytes(width);  // P [kHeads, kPStride] bf16
  float* s_red = reinterpret_cast<float*>(mla_smem + 2 * t_bytes);
  __nv_bfloat16* s_p = reinterpret_cast<__nv_bfloat16*>(mla_smem + 2 * t_bytes + red_bytes(width));
  auto offset = [chunks](int row, int c) {
    return static_cast<uint32_t>((row * chunks + (c ^ (row & 7))) * 16);
  };

  // Q of the block's heads; rows past Nh and the padding chunks are zero.
  {
    const __nv_bfloat16* q = p.q + bh0 * width;
    for (int i = tid; i < kHeads * chunks; i += kThreads) {
      const int r = i / chunks, c = i % chunks;
      const bool valid = r < heads && c < w_chunks;
      cp_async_16(s_red_u32 + offset(r, c), valid ? q + r * width + c * 8 : p.q, valid);
    }
  }
  // Tile `tile` of the chunk into buffer `buffer`: 8 threads per row, one block-table lookup
  // each; rows past the chunk's keys and the padding chunks are zero.
  auto load_tile = [&](int buffer, int tile) {
    const int r = tid >> 3, sub = tid & 7;
    const int key = tile * kKeys + r;
    if constexpr (kFp8) {
      // Synchronous: decoded in registers, stored where cp.async would have put the bf16 row.
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
      uint8_t* dst = mla_smem + buffer * t_bytes;
      const int l_chunks = L / 8;
      for (int c = sub; c < chunks; c += 8) {
        const uint4 v = has_row && c < w_chunks ? fp8_chunk(row, c, l_chunks) : uint4{0, 0, 0, 0};
        *reinterpret_cast<uint4*>(dst + offset(r, c)) = v;
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
      const uint32_t dst = s_tiles + buffer * t_bytes;
      for (int c = sub; c < chunks; c += 8) {
        const bool valid = row != nullptr && c < w_chunks;
        cp_async_16(dst + offset(r, c), valid ? row + c * 8 : p.cache, valid);
      }
    }
  };
  load_tile(0, 0);
  gemm::cp_async_commit();
  gemm::cp_async_wait<0>();
  __syncthreads();

  // This warp's k-steps of Q as A fragments.
  uint32_t qf[kKStepsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kKStepsPerWarp; ++i) {
    const int ks = warp + i * kWarps;
    if (ks < k_steps) {
      ldmatrix_x4(qf[i], s_red_u32 + offset(lane & 15, ks * 2 + (lane >> 4)));
    } else {
      qf[i][0] = qf[i][1] = qf[i][2] = qf[i][3] = 0u;
    }
  }

  float o[kGroupsPerWarp][2][4];
#pragma unroll
  for (int i = 0; i < kGroupsPerWarp; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][j][e] = 0.f;
  // Online softmax state of head row r_soft, held (identically) by its 16 threads.
  const int r_soft = tid >> 4;
  float m = -INFINITY, l = 0.f;
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int red_warps = min(kWarps, k_steps);  // warps that own at least one k-step

  for (int t = 0; t < num_tiles; ++t) {
    // Tile t has landed; every warp is done with tile t - 1 (whose buffer is refilled next),
    // with the previous softmax's reads of s_red, and (t = 0) with reading Q out of s_red.
    gemm::cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < num_tiles) load_tile((t + 1) & 1, t + 1);
    gemm::cp_async_commit();
    const uint32_t tile = s_tiles + (t & 1) * t_bytes;

    // 1. Partial scores over this warp's k-steps: [16 heads, 32 keys] as 4 n-tiles.
    float s[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int i = 0; i < kKStepsPerWarp; ++i) {
      const int ks = warp + i * kWarps;
      if (ks < k_steps) {
#pragma unroll
        for (int kp = 0; kp < 2; ++kp) {
          uint32_t bk[4];
          ldmatrix_x4(bk, tile + offset(kp * 16 + ((lane >> 4) << 3) + (lane & 7),
                                        ks * 2 + ((lane >> 3) & 1)));
          mma_bf16(s[2 * kp], qf[i], bk[0], bk[1]);
          mma_bf16(s[2 * kp + 1], qf[i], bk[2], bk[3]);
        }
      }
    }
    if (warp < red_warps) {
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

    // 2. Online softmax over the warps' partials.
    online_softmax_tile(s_red, red_warps, t * kKeys, n, scale_log2, s_p, s_alpha, m, l);
    __syncthreads();

    // 3. Values: rescale, then o += P V over this warp's groups of 16 latent dims.
    {
      const float a_lo = s_alpha[lane >> 2], a_hi = s_alpha[(lane >> 2) + 8];
#pragma unroll
      for (int i = 0; i < kGroupsPerWarp; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          o[i][j][0] *= a_lo;
          o[i][j][1] *= a_lo;
          o[i][j][2] *= a_hi;
          o[i][j][3] *= a_hi;
        }
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t pa[4];
        ldmatrix_x4(pa, s_p_u32 + ((lane & 15) * kPStride + kk * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
        for (int i = 0; i < kGroupsPerWarp; ++i) {
          const int g = warp + i * kWarps;
          if (g < out_groups) {
            // Chunks 2g and 2g + 1; when L / 8 is odd the second is a rope (or zero padding)
            // chunk whose products are computed and dropped.
            uint32_t bv[4];
            ldmatrix_x4_trans(bv, tile + offset(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                2 * g + (lane >> 4)));
            mma_bf16(o[i][0], pa, bv[0], bv[1]);
            mma_bf16(o[i][1], pa, bv[2], bv[3]);
          }
        }
      }
    }
  }
  gemm::cp_async_wait<0>();  // the last (empty) group

  if ((tid & 15) == 0) s_l[r_soft] = l;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kGroupsPerWarp; ++i) {
    const int g = warp + i * kWarps;
    if (g >= out_groups) continue;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int d = (2 * g + j) * 8 + (lane & 3) * 2;
      if (d >= L) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = (lane >> 2) + half * 8;
        if (row >= heads) continue;
        const int64_t bh = bh0 + row;
        const float v0 = o[i][j][2 * half], v1 = o[i][j][2 * half + 1];
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
  if (num_splits > 1 && (tid & 15) == 0 && r_soft < heads) {
    float* ml = p.workspace + p.num_seqs * p.num_heads * num_splits * L;  // [B, Nh, splits, 2]
    *reinterpret_cast<float2*>(ml + ((bh0 + r_soft) * num_splits + split) * 2) = make_float2(m, l);
  }
}

// grid (dim_blocks, Nh, B), mla::kCombineThreads threads: merges the splits of one (row, head);
// block x takes the 64-dim slices x, x + dim_blocks, ... of the latent dims (the host gives few
// rows several dim blocks, many rows one). A row of at most 8 splits is summed by each thread
// for its dim pair directly; a row of more has its split weights exp2(m_s - max) computed once
// into shared memory, then 8 groups of 32 threads each sum every 8th split over 32 dim pairs
// (coalesced 256-byte rows), so hundreds of splits are not one long serial chain.
// The max is in the log2 domain, as the split kernel keeps it.
__global__ void __launch_bounds__(mla::kCombineThreads)
    mla_decode_combine_kernel(const __grid_constant__ MlaDecodeParams p, int chunk,
                              int num_splits) {
  // The combine lets the kernel after it start before it waits: that kernel (the absorbed value
  // projection) streams its weights into L2 while the attention still runs. It reads this kernel's
  // output only after its own wait, which returns once this kernel, and so the attention, is done.
  device::allow_next_grid();
  device::wait_for_previous_grid();
  using namespace mla;
  constexpr int kGroups = kCombineThreads / kCombinePairs;
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_red[kCombineThreads / 32];
  __shared__ float2 s_part[kGroups][kCombinePairs];
  const int h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int L = static_cast<int>(p.latent_dim);
  const int len = __ldg(p.seq_lens + b);
  MOE_DEVICE_CHECK(len >= 0 && len <= p.max_seq_len);
  const int splits = (len + chunk - 1) / chunk;  // the splits that wrote, <= num_splits
  const int64_t bh = static_cast<int64_t>(b) * p.num_heads + h;
  const float* o = p.workspace + bh * num_splits * L;
  const float* ml = p.workspace + p.num_seqs * p.num_heads * num_splits * L + bh * num_splits * 2;
  const int pair = tid % kCombinePairs, group = tid / kCombinePairs;

  if (splits <= kGroups) {
    // Few splits (many rows): each thread reads the (max, sum) pairs itself, no barriers, and
    // the 8 thread groups take 8 of the block's 64-dim slices at a time.
    float mx = -INFINITY;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ml[2 * s]);
    float w[kGroups], den = 0.f;
#pragma unroll
    for (int s = 0; s < kGroups; ++s) {
      w[s] = s < splits ? exp2f(ml[2 * s] - mx) : 0.f;
      if (s < splits) den = fmaf(w[s], ml[2 * s + 1], den);
    }
    const float inv = splits > 0 ? 1.f / den : 0.f;  // an empty row: zeros
    for (int k = group;; k += kGroups) {
      const int d = (blockIdx.x + k * gridDim.x) * 2 * kCombinePairs + 2 * pair;
      if (d - 2 * pair >= L) break;
      if (d >= L) continue;
      float2 acc = make_float2(0.f, 0.f);
#pragma unroll
      for (int s = 0; s < kGroups; ++s) {
        if (s < splits) {
          const float2 v = *reinterpret_cast<const float2*>(o + static_cast<int64_t>(s) * L + d);
          acc.x = fmaf(w[s], v.x, acc.x);
          acc.y = fmaf(w[s], v.y, acc.y);
        }
      }
      *reinterpret_cast<__nv_bfloat162*>(p.out + bh * L + d) =
          __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    }
    return;
  }

  // Many splits (few rows, long contexts): the weights once into shared memory, then group g
  // sums splits g, g + 8, ... for 32 dim pairs of one slice, and group 0 adds the groups up.
  auto block_reduce = [&](float v, bool is_max) {
    v = is_max ? device::warp_max(v) : device::warp_sum(v);
    if (lane == 0) s_red[warp] = v;
    __syncthreads();
    float r = s_red[0];
#pragma unroll
    for (int w = 1; w < kCombineThreads / 32; ++w) r = is_max ? fmaxf(r, s_red[w]) : r + s_red[w];
    __syncthreads();  // s_red is reused
    return r;
  };
  float mx = -INFINITY;
  for (int s = tid; s < splits; s += kCombineThreads) mx = fmaxf(mx, ml[2 * s]);
  mx = block_reduce(mx, true);
  float den = 0.f;
  for (int s = tid; s < splits; s += kCombineThreads) {
    const float w = exp2f(ml[2 * s] - mx);
    s_w[s] = w;
    den = fmaf(w, ml[2 * s + 1], den);
  }
  den = block_reduce(den, false);  // its barriers also publish s_w
  const float inv = 1.f / den;
  for (int d0 = blockIdx.x * 2 * kCombinePairs; d0 < L; d0 += gridDim.x * 2 * kCombinePairs) {
    const int d = d0 + 2 * pair;
    float2 acc = make_float2(0.f, 0.f);
    if (d < L) {
#pragma unroll 4
      for (int s = group; s < splits; s += kGroups) {
        const float2 v = *reinterpret_cast<const float2*>(o + static_cast<int64_t>(s) * L + d);
        acc.x = fmaf(s_w[s], v.x, acc.x);
        acc.y = fmaf(s_w[s], v.y, acc.y);
      }
    }
    s_part[group][pair] = acc;
    __syncthreads();
    if (group == 0 && d < L) {
#pragma unroll
      for (int g = 1; g < kGroups; ++g) {
        acc.x += s_part[g][pair].x;
        acc.y += s_part[g][pair].y;
      }
      *reinterpret_cast<__nv_bfloat162*>(p.out + bh * L + d) =
          __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    }
    __syncthreads();  // s_part is rewritten by the next dims
  }
}

}  // namespace moeinfer::cuda
