// Causal prefill attention for Hopper (sm_90a), flash-attention style on warpgroup MMA: the
// route prefill_attention() takes on compute capability 9.0 for the common case (no sliding
// window, no attention chunk, no sinks; attention_prefill_mma_kernel.cuh's mma.sync kernel
// serves the rest and every other GPU). Why it is built this way:
//
// - One CTA per (query head, 128-query tile, sequence), 384 threads: warpgroup 0 produces,
//   warpgroups 1 and 2 consume, each owning 64 query rows, so a row's online softmax never
//   leaves its warp (a row's scores sit in the 4 lanes of one quad, as in mma.sync).
// - Operands come by TMA into 128-byte-swizzled shared memory, in column blocks of 64 bf16
//   (one 128-byte row per token, wgmma_primitives.cuh): Q once ([128, D]), then K and V tiles of
//   128 keys, double-buffered. Each stage has a `k_full` and a `v_full` mbarrier (so S = Q K^T
//   starts before V lands) and one `empty` (an arrival from each of the 8 consumer warps once its
//   P V wgmmas are done). The tensor maps see q, k, v as [T, N D] matrices: a head is a column
//   offset, a sequence's first token a row offset; rows past T read zeros.
// - S = Q K^T: m64n128k16, both operands K-major from shared memory (the grouped GEMM's
//   descriptors). Softmax in float32 registers with exp2 and the scale folded into log2(e); each
//   thread keeps its own partial row sums, summed over the quad once at the end.
// - O += P V: P is rounded to bf16 in registers and is wgmma's A operand from registers: the
//   accumulator fragment of keys 16 k .. 16 k + 15 is exactly the A fragment of that k16 step.
//   V stays [key, D] as TMA wrote it and is read MN-major (imm-trans-b, make_descriptor_mn).
// - The two consumer warpgroups take turns at the tensor cores (two named barriers): a turn
//   issues P V of the previous tile and Q K^T of the next together, and the softmax that follows
//   runs while the other warpgroup has its turn, so the exponentials hide behind wgmma.
// - Key tiles run from the diagonal down: the first holds the only mask (key > query, which also
//   covers keys past the sequence for every stored row), and after it every row has a finite
//   max (its own key), so the later tiles need no -inf care. Tiles wholly above the diagonal are
//   never loaded. Query rows past the sequence are computed (on the next sequence's or zero rows)
//   and not stored.
// - The grid puts heads in x and query tiles in y, latest tile first: the CTAs of the longest
//   rows start in the first wave, and CTAs of one KV head run side by side sharing its tiles in L2.
// - Registers (setmaxnreg): a consumer thread holds S (64 floats), O (D / 2), P (32 words) and
//   the row state; 232 a consumer thread, 40 a producer thread.
// - Shared memory at D = 128: Q 32 KB + 2 stages x (K 32 KB + V 32 KB) = 160 KB; at D = 64 half.
//
// Written without a GPU (its tiling, masks, softmax and register layouts were emulated in numpy
// against a float64 reference); not yet run on one: tests/cuda/cuda_prefill_wgmma_test.cpp.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct: nothing here links the driver library)
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/wgmma_primitives.cuh"

namespace moeinfer::cuda {

namespace attn_wgmma {

inline constexpr int kBM = 128;  // queries per CTA: two consumer warpgroups of 64 rows
inline constexpr int kBN = 128;  // keys per tile
inline constexpr int kStages = 2;
inline constexpr int kThreads = 384;  // warpgroup 0 produces, warpgroups 1 and 2 consume
inline constexpr int kConsumerWarps = 8;
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;
inline constexpr int kColumnBlockBytesPerRow = 128;  // 64 bf16: one TMA box row, one swizzle span
// Named barriers 1 and 2 (0 is __syncthreads): the consumer warpgroups' turns at the tensor
// cores. kAlternateWarpgroups = false leaves the turns unordered (the same loop, for comparison).
inline constexpr int kTurnBarrier0 = 1;
inline constexpr bool kAlternateWarpgroups = true;

// Everything the kernel reads. The tensor maps are built on the host
// (sm90/attention_prefill_wgmma.cu) and passed by value: a __grid_constant__ parameter whose
// address the TMA instructions take.
struct Params {
  CUtensorMap q_map;  // q as [T, Nq D] bf16: dims {Nq D, T}, box {64, kBM}, 128B swizzle
  CUtensorMap k_map;  // k as [T, Nkv D]: dims {Nkv D, T}, box {64, kBN}
  CUtensorMap v_map;  // v as [T, Nkv D]: likewise
  const int32_t* cu_seqlens = nullptr;  // [B + 1] device
  __nv_bfloat16* out = nullptr;         // [T, Nq, D]
  int32_t num_q_heads = 0;              // Nq
  int32_t group = 0;                    // G = Nq / Nkv
  float scale_log2 = 0.0f;              // softmax scale times log2(e)
};

template <int D_>
struct Config {
  static constexpr int D = D_;
  static constexpr int kColumnBlocks = D / 64;
  static constexpr int kQBytes = kBM * D * 2;
  static constexpr int kTileBytes = kBN * D * 2;                       // one K or V tile
  static constexpr int kQBlockBytes = kBM * kColumnBlockBytesPerRow;   // a column block of Q
  static constexpr int kKvBlockBytes = kBN * kColumnBlockBytesPerRow;  // of a K or V tile
  static constexpr int kORegs = D / 2;    // 64 x D float32 over the 128 threads
  static constexpr int kSRegs = kBN / 2;  // 64 x kBN
  // Q, K stages, V stages (each 1024-byte aligned), then the barriers q_full, k_full[kStages],
  // v_full[kStages], empty[kStages]; plus 1024 bytes to align the base.
  static constexpr int kBarriers = 1 + 3 * kStages;
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kTileBytes + kBarriers * 8;
  static_assert(D == 64 || D == 128, "head dims 64 and 128");
  static_assert(kQBytes % 1024 == 0 && kTileBytes % 1024 == 0 && kQBlockBytes % 1024 == 0 &&
                    kKvBlockBytes % 1024 == 0,
                "every operand starts on a swizzle atom");
};

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Named barrier `id` among `threads` threads: sync waits for all of them, arrive counts this
// warp's threads and goes on.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// 2^x on the special-function unit (inputs here are <= 0 or -inf, which gives 0).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax over one key tile of this thread's two rows (accumulator layout: register
// 4 j + 2 h + b holds row lane / 4 + 8 h of the warp's 16, key 8 j + 2 (lane % 4) + b). The raw
// scores `s` (masked to -inf) become p = 2^(s scale_log2 - running max); the running max `m`
// (raw units), this thread's partial sums `l` and the output accumulators `o` are updated.
template <int kSRegs, int kORegs>
__device__ __forceinline__ void online_softmax(float (&s)[kSRegs], float (&m)[2], float (&l)[2],
                                               float (&o)[kORegs], float scale_log2) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kSRegs / 4; ++j)
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m[h], mx);
    // A row with nothing visible yet keeps max -inf: subtract 0 instead, so every p is 0.
    const float m_scaled = (m_new == -INFINITY ? 0.0f : m_new) * scale_log2;
    const float alpha = exp2_approx(m[h] * scale_log2 - m_scaled);  // 0 while m[h] is -inf
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const float p = exp2_approx(fmaf(s[4 * j + 2 * h + b], scale_log2, -m_scaled));
        s[4 * j + 2 * h + b] = p;
        sum += p;
      }
    }
    l[h] = l[h] * alpha + sum;
    m[h] = m_new;
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      o[4 * j + 2 * h] *= alpha;
      o[4 * j + 2 * h + 1] *= alpha;
    }
  }
}

}  // namespace attn_wgmma

template <int D>
__global__ void __launch_bounds__(attn_wgmma::kThreads, 1)
    prefill_attention_wgmma_kernel(const __grid_constant__ attn_wgmma::Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace attn_wgmma;
  using namespace wgmma;
  using Cfg = Config<D>;
  extern __shared__ uint8_t prefill_wgmma_smem[];
  // The swizzle atoms need 1024-byte alignment, which dynamic shared memory does not promise.
  const uint32_t raw_address = smem_addr(prefill_wgmma_smem);
  const uint32_t s_q = (raw_address + 1023u) & ~1023u;
  const uint32_t s_k = s_q + Cfg::kQBytes;               // stage s at s_k + s kTileBytes
  const uint32_t s_v = s_k + kStages * Cfg::kTileBytes;  // stage s at s_v + s kTileBytes
  const uint32_t q_full = s_v + kStages * Cfg::kTileBytes;
  const uint32_t k_full0 = q_full + 8;  // k_full[s] at k_full0 + 8 s
  const uint32_t v_full0 = k_full0 + 8 * kStages;
  const uint32_t empty0 = v_full0 + 8 * kStages;

  const int h = static_cast<int>(blockIdx.x);
  const int q_tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);  // latest tiles first
  const int b = static_cast<int>(blockIdx.z);
  const int seq0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - seq0;
  const int q0 = q_tile * kBM;
  if (q0 >= len) return;  // the whole CTA, before any barrier exists
  const int kvh = h / p.group;
  // Keys [0, min(len, q0 + kBM)): the tiles up to the one holding the tile's last query.
  const int num_kv_tiles = (min(len, q0 + kBM) + kBN - 1) / kBN;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  if (tid == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(k_full0 + 8 * s, 1);  // the producer's arrive.expect_tx
      mbar_init(v_full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, kConsumerWarps);  // lane 0 of each consumer warp
    }
    // Make the initialised barriers visible to the other threads and to the async proxy (TMA).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.q_map))
                 : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.k_map))
                 : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.v_map))
                 : "memory");
  }
  __syncthreads();

  // The two roles are the two branches of one if/else, so that setmaxnreg applies.
  if (warp < 4) {
    // Producer warpgroup: all four warps give registers back, then all but one thread are done.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (tid != 0) return;
    const int q_column = h * D;
    const int kv_column = kvh * D;
    mbar_arrive_expect_tx(q_full, Cfg::kQBytes);
#pragma unroll
    for (int c = 0; c < Cfg::kColumnBlocks; ++c) {
      tma_load_2d(s_q + c * Cfg::kQBlockBytes, &p.q_map, q_column + 64 * c, seq0 + q0, q_full);
    }
    for (int i = 0; i < num_kv_tiles; ++i) {
      const int key_row = seq0 + (num_kv_tiles - 1 - i) * kBN;  // from the diagonal down
      const int s = i % kStages;
      const int round = i / kStages;
      // Round r reuses the slot the consumers released in round r - 1, whose empty phase has
      // parity (r - 1) & 1.
      if (round > 0) mbar_wait(empty0 + 8 * s, (round - 1) & 1);
      const uint32_t k_full = k_full0 + 8 * s, v_full = v_full0 + 8 * s;
      const uint32_t k_tile = s_k + s * Cfg::kTileBytes, v_tile = s_v + s * Cfg::kTileBytes;
      mbar_arrive_expect_tx(k_full, Cfg::kTileBytes);
#pragma unroll
      for (int c = 0; c < Cfg::kColumnBlocks; ++c) {
        tma_load_2d(k_tile + c * Cfg::kKvBlockBytes, &p.k_map, kv_column + 64 * c, key_row, k_full);
      }
      mbar_arrive_expect_tx(v_full, Cfg::kTileBytes);
#pragma unroll
      for (int c = 0; c < Cfg::kColumnBlocks; ++c) {
        tma_load_2d(v_tile + c * Cfg::kKvBlockBytes, &p.v_map, kv_column + 64 * c, key_row, v_full);
      }
    }
  } else {
    // Consumer warpgroups 1 and 2: query rows [q0 + 64 cw, q0 + 64 cw + 64).
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    const int cw = warp / 4 - 1;
    const int warp_in_group = warp & 3;
    // This thread's rows (within the sequence): row0 (h = 0) and row0 + 8 (h = 1).
    const int row0 = q0 + cw * 64 + warp_in_group * 16 + (lane >> 2);
    const int key_in_block = 2 * (lane & 3);  // column of register 4 j + 2 h + b: 8 j + this + b
    const float scale_log2 = p.scale_log2;

    float o[Cfg::kORegs];
    float s[Cfg::kSRegs];
    uint32_t pa[kBN / 16][4];  // P as bf16 pairs, the A operand of each k16 step of P V
#pragma unroll
    for (int i = 0; i < Cfg::kORegs; ++i) o[i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};

    // Turn t of this warpgroup issues O += P V of tile t - 1 and S = Q K^T of tile t, waits for
    // both, then (t < num_kv_tiles) forms P of tile t: num_kv_tiles + 1 turns. The two consumer
    // warpgroups take turns at the tensor cores (cw 0 first), so one's softmax runs while the
    // other's wgmmas do: barrier kTurnBarrier0 + cw is consumer cw's go, given by the other
    // consumer after each of its turns, and once at the start by cw 1 for cw 0. A go can only
    // come after the previous one was taken (the giver's own turn waited for it), and each
    // barrier sees as many arrivals as syncs: cw 1 gives no go after its last turn.
    if (kAlternateWarpgroups && cw == 1) named_barrier_arrive(kTurnBarrier0, 256);
    mbar_wait(q_full, 0);
    for (int t = 0; t <= num_kv_tiles; ++t) {
      if (kAlternateWarpgroups) named_barrier_sync(kTurnBarrier0 + cw, 256);
      const int previous = (t + kStages - 1) % kStages;  // tile t - 1's stage
      if (t > 0) {
        // O += P V of tile t - 1: k16 step kk takes keys 16 kk .. 16 kk + 15, V rows 2048 bytes
        // further per step.
        mbar_wait(v_full0 + 8 * previous, ((t - 1) / kStages) & 1);
        __syncwarp();  // the wgmma instructions below are .aligned: the warp reconverged
        const uint32_t v_tile = s_v + previous * Cfg::kTileBytes;
        fence_registers(o);
        wgmma_fence();  // orders the registers' earlier writes (P, the rescaled O) before them
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          const uint64_t desc_v =
              make_descriptor_mn(v_tile + kk * 16 * kColumnBlockBytesPerRow, Cfg::kKvBlockBytes);
          if constexpr (D == 128) {
            wgmma_m64n128k16_rs(o, pa[kk], desc_v);
          } else {
            wgmma_m64n64k16_rs(o, pa[kk], desc_v);
          }
        }
        wgmma_commit();
      }
      if (t < num_kv_tiles) {
        // S = Q K^T over D: k16 step kk reads column block kk / 4, 32 bytes further per step.
        const int st = t % kStages;
        mbar_wait(k_full0 + 8 * st, (t / kStages) & 1);
        __syncwarp();
        const uint32_t k_tile = s_k + st * Cfg::kTileBytes;
#pragma unroll
        for (int r = 0; r < Cfg::kSRegs; ++r) s[r] = 0.0f;
        fence_registers(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const int c = kk / 4;
          const uint64_t step = 2 * static_cast<uint64_t>(kk % 4);  // +32 bytes: +2 in bytes >> 4
          const uint64_t desc_q =
              make_descriptor(s_q + c * Cfg::kQBlockBytes + cw * 64 * kColumnBlockBytesPerRow) +
              step;
          const uint64_t desc_k = make_descriptor(k_tile + c * Cfg::kKvBlockBytes) + step;
          wgmma_m64n128k16(s, desc_q, desc_k);
        }
        wgmma_commit();
      }
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(s);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) fence_registers(pa[kk]);
      // Tile t - 1's K and V are both read: hand its stage back.
      if (t > 0 && lane == 0) mbar_arrive(empty0 + 8 * previous);
      if (kAlternateWarpgroups && (cw == 0 || t < num_kv_tiles)) {
        named_barrier_arrive(kTurnBarrier0 + 1 - cw, 256);
      }
      if (t == num_kv_tiles) break;

      // Only the tile reaching past the CTA's first query has keys after some row's own.
      const int kv0 = (num_kv_tiles - 1 - t) * kBN;  // the tile's first key, in the sequence
      if (kv0 + kBN > q0) {
#pragma unroll
        for (int j = 0; j < Cfg::kSRegs / 4; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = kv0 + 8 * j + key_in_block + (e & 1);
            const int row = row0 + 8 * (e >> 1);
            if (key > row) s[4 * j + e] = -INFINITY;
          }
        }
      }
      // O was last written by tile t - 1's P V, finished above: the rescale sees all of it.
      online_softmax(s, m, l, o, scale_log2);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pa[kk][r] = pack_bf16x2(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        }
      }
    }

    // Epilogue: the quad's partial sums make the row's; bf16 pairs straight from registers.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
      l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    }
    const int64_t row_stride = static_cast<int64_t>(p.num_q_heads) * D;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = row0 + 8 * hh;
      if (row >= len) continue;
      // Row `row` sees at least key `row`, so its sum is at least 1.
      const float inv = 1.0f / l[hh];
      __nv_bfloat16* out = p.out + (static_cast<int64_t>(seq0) + row) * row_stride + h * D;
#pragma unroll
      for (int j = 0; j < Cfg::kORegs / 4; ++j) {
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * j + key_in_block) =
            __floats2bfloat162_rn(o[4 * j + 2 * hh] * inv, o[4 * j + 2 * hh + 1] * inv);
      }
    }
  }
#elif defined(__CUDA_ARCH__)
  // Built for another architecture (or plain sm_90): the launcher never starts it there.
  (void)p;
  __trap();
#else
  (void)p;
#endif
}

}  // namespace moeinfer::cuda
