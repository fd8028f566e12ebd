// Grouped expert GEMM on tensor cores (mma.sync m16n8k16, bf16 in, float32 accumulators),
// with cp.async multi-stage pipelining. Why it is built this way:
//
// - One launch for all experts, no host read. The grid is (N / BN) x (worst-case number of
//   row tiles), the worst case being sum_e ceil(count_e / BM) <= (M + min(E, M) * (BM - 1)) / BM,
//   those slots over gridDim.y and, past its 65535 (many experts at many rows), gridDim.z.
//   Each block first scans the E row counts from expert_offsets (device memory) to learn which
//   (expert, row tile) its y index names; blocks past the last tile exit before loading
//   anything. blockIdx.x (the column tile) varies fastest, so consecutive blocks stream
//   different slices of the same expert's weights and every SM has weights to read even at one
//   token (8 experts x 24 column tiles for the gate/up projection of Qwen3-30B-A3B).
// - Decode is memory-bound: a 16-row tile keeps the tensor cores busy on rows that are mostly
//   zero-filled (cp.async with a source size of 0 reads no memory), and the weight slice of a
//   block is read exactly once. Prefill uses 64- and 128-row tiles so each weight tile is
//   reused across many rows.
// - Shared memory rows are 64 bf16 (128 bytes, the k-tile) with their 16-byte chunks XOR-
//   swizzled by (row & 7), so both the cp.async stores and the ldmatrix reads of 8 rows at one
//   chunk touch 8 different bank groups.
// - SiLU(gate) * up is fused: the weight tile holds BN gate rows and the BN matching up rows, a
//   warp's gate and up accumulators have identical fragment layouts, and the epilogue combines
//   them in registers, so the [M, 2I] intermediate never exists.
// - Programmatic dependent launch: every block signals griddepcontrol.launch_dependents at once,
//   and waits (griddepcontrol.wait) only after requesting its first weight tiles, so in
//   moe_experts the down projection's tile scan and weight prefetch overlap the tail of the
//   gate/up projection (at decode the kernels are a few microseconds each and the tail is a
//   large part of that).
// - Two weight terms (weight_terms = 2, float32 checkpoints held as hi + lo bf16): the k-tile
//   loop runs twice as long, the second half over the lo matrix with the same row tiles, so
//   both terms land in the same accumulators before the epilogue (SiLU is not linear).
// - Quantised weights (Q != kNone, expert_quant.h): cp.async cannot convert, so a weight tile
//   travels through registers: each thread loads its chunks' codes and scales for k-tile
//   kt + Stages - 1 before the tensor-core work on tile kt, and dequantises and stores them to
//   shared memory after it, so the global loads are in flight during the mma (the stage it
//   writes was freed by the __syncthreads that opened the iteration, and the one that opens
//   the iteration consuming it makes the stores visible). The shared-memory tile is then
//   exactly the bf16 tile the plain kernel reads, so everything after the load is shared and a
//   quantised product equals the bf16 product over the dequantised weights bit for bit (same
//   tile). Only the codes and scales cross the memory bus: at decode that is the point.
// - fp8 x fp8 (Fp8Mma, block-scaled fp8 weights and activations quantised by
//   quantize_rows_fp8, DeepSeek-V3's recipe): both operands stay e4m3 bytes and meet in
//   mma.m16n8k32.e4m3 (sm_89 and later). A shared-memory row is still 128 bytes, now 128 inputs,
//   and the e4m3 fragments of m16n8k32 hold the same bytes at the same places as the bf16
//   fragments of m16n8k16 (A: rows g and g + 8, bytes 4t..4t+3 and 16+4t..; B likewise per
//   column), so cp.async, the swizzle and ldmatrix are shared unchanged. One k-tile is one
//   128-input scale block: its products gather in a float32 partial sum, which joins the
//   running accumulator times act_scale[row, kb] * weight_scale[column, kb] (both scales staged
//   in shared memory with the tile's codes). K need only be a multiple of 64: the last k-tile's
//   missing half is zero-filled.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/expert_dequant.cuh"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/gated_activation.cuh"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda {

namespace gemm {

inline constexpr int kBK = 64;  // k-tile: one 128-byte shared-memory row
// fp8 x fp8: a k-tile is 128 e4m3 inputs (the same 128-byte row) and one scale block.
inline constexpr int kFp8BlockK = static_cast<int>(kFp8ActBlock);
static_assert(kFp8BlockK == kBK * 2, "an fp8 k-tile fills the bf16 tile's 128-byte rows");

template <int BM_, int BN_, int WarpsM_, int WarpsN_, int Stages_, bool GateUp_>
struct TileConfig {
  static constexpr int BM = BM_;  // rows per tile
  static constexpr int BN = BN_;  // output columns per tile
  static constexpr int kWarpsM = WarpsM_;
  static constexpr int kWarpsN = WarpsN_;
  static constexpr int kStages = Stages_;
  static constexpr bool kGateUp = GateUp_;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kWM = BM / kWarpsM;  // rows per warp
  static constexpr int kWN = BN / kWarpsN;  // output columns per warp
  static constexpr int kMTiles = kWM / 16;
  static constexpr int kNTiles = kWN / 8;  // per operand (gate or up)
  static constexpr int kOps = kGateUp ? 2 : 1;
  static constexpr int kBRows = BN * kOps;  // weight rows per tile
  static constexpr int kStageBytes = (BM + kBRows) * kBK * 2;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  // fp8 x fp8 also stages each k-tile's scales after the tiles: BM act scales, then one per
  // weight row.
  static constexpr int kScaleFloats = BM + kBRows;
  static constexpr int kFp8SmemBytes = kSmemBytes + kStages * kScaleFloats * 4;
  static_assert(kWM % 16 == 0 && kWN % 8 == 0, "warp tile must be whole mma tiles");
  static_assert(kNTiles == 1 || kNTiles % 2 == 0, "B fragments load in pairs");
};

__device__ __forceinline__ uint32_t smem_u32(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows][64] bf16 tile.
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return static_cast<uint32_t>((row * 8 + (chunk ^ (row & 7))) * 16);
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, no global read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(address));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D = A . B + C over 16 x 8 outputs and 32 inputs of e4m3 (4 codes a register). Only sm_89 and
// later have it: elsewhere the kernel traps, and the launcher refuses such a device first.
__device__ __forceinline__ void mma_fp8(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)c, (void)a, (void)b0, (void)b1;
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// Inclusive block-wide sum of one int per thread; *total gets the block's sum.
template <int kThreads>
__device__ __forceinline__ int block_inclusive_scan(int value, int* s_warp, int* total) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  if (lane == 31) s_warp[warp] = value;
  __syncthreads();
  int prefix = 0, sum = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int x = s_warp[w];
    if (w < warp) prefix += x;
    sum += x;
  }
  __syncthreads();  // s_warp is reused by the next call
  *total = sum;
  return value + prefix;
}

// The per-chunk dequantisation (QuantChunk, fetch_quant_chunk, dequantize_chunk) lives in
// expert_dequant.cuh, shared with the small-batch MoE kernel so both read the same values.
using expert_dequant::dequantize_chunk;
using expert_dequant::fetch_quant_chunk;
using expert_dequant::QuantChunk;

}  // namespace gemm

template <class Cfg, ExpertQuant Q = ExpertQuant::kNone, bool Fp8Mma = false>
__global__ void __launch_bounds__(Cfg::kThreads)
    grouped_gemm_kernel(const __grid_constant__ GroupedGemmParams p) {
  using namespace gemm;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, kThreads = Cfg::kThreads;
  static_assert(!Fp8Mma || Q == ExpertQuant::kFp8, "fp8 x fp8 needs fp8 weights");
  // Weights dequantised through registers (every quantised format but fp8 x fp8).
  constexpr bool kRegisterStagedB = Q != ExpertQuant::kNone && !Fp8Mma;
  extern __shared__ __align__(128) uint8_t gemm_smem[];
  __shared__ int s_warp[kThreads / 32];
  __shared__ int s_tile[3];   // expert's first row of this tile, rows in this tile, expert
  __shared__ int s_arow[BM];  // source row of each tile row in `rows`

  // A kernel launched after this one as a programmatic dependent may start its own prologue
  // once every block of this grid has started; it still waits for this grid to finish before
  // reading anything this grid writes.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // Which (expert, row tile) does the slot (y, then z past 65535 slots) name? Scan the
  // per-expert tile counts.
  const int slot = static_cast<int>(blockIdx.z * gridDim.y + blockIdx.y);
  const int num_experts = static_cast<int>(p.num_experts);
  if (threadIdx.x == 0) s_tile[2] = -1;
  int tiles_before = 0;
  for (int e0 = 0; e0 < num_experts; e0 += kThreads) {
    const int e = e0 + static_cast<int>(threadIdx.x);
    int row0 = 0, count = 0, tiles = 0;
    if (e < num_experts) {
      row0 = __ldg(p.expert_offsets + e);
      count = __ldg(p.expert_offsets + e + 1) - row0;
      tiles = (count + BM - 1) / BM;
    }
    int chunk_total;
    const int inclusive = block_inclusive_scan<kThreads>(tiles, s_warp, &chunk_total);
    const int first = tiles_before + inclusive - tiles;
    if (tiles > 0 && slot >= first && slot < first + tiles) {
      const int m_tile = slot - first;
      s_tile[0] = row0 + m_tile * BM;
      s_tile[1] = min(BM, count - m_tile * BM);
      s_tile[2] = e;
    }
    tiles_before += chunk_total;
    if (tiles_before > slot) break;  // uniform: every thread has the same tiles_before
  }
  __syncthreads();
  const int expert = s_tile[2];
  if (expert < 0) return;  // a slot past the last tile: nothing to do
  const int row_begin = s_tile[0];
  const int rows_valid = s_tile[1];

  const int K = static_cast<int>(p.k);
  const int N = static_cast<int>(p.n);
  const int n0 = static_cast<int>(blockIdx.x) * BN;
  const int64_t term_elems = Cfg::kOps * static_cast<int64_t>(N) * K;  // one term's matrix
  // Quantised: the expert's slab of codes and scales (expert_quant.h).
  const QuantMatrixLayout q_layout =
      quant_matrix_layout(Q, Cfg::kOps * static_cast<int64_t>(N), K, p.quant_group);
  const __nv_bfloat16* b_base =
      p.expert_weights != nullptr ? p.expert_weights[expert]
      : Q != ExpertQuant::kNone
          ? reinterpret_cast<const __nv_bfloat16*>(reinterpret_cast<const uint8_t*>(p.weights) +
                                                   static_cast<int64_t>(expert) * q_layout.bytes)
          : p.weights + static_cast<int64_t>(expert) * p.weight_terms * term_elems;
  // A null table entry: the expert computes elsewhere (the host) and its rows are left alone.
  if (b_base == nullptr) return;
  const auto* q_slab = reinterpret_cast<const uint8_t*>(b_base);
  const int q_group = static_cast<int>(p.quant_group);

  const uint32_t smem_base = smem_u32(gemm_smem);
  auto stage_a = [&](int stage) { return smem_base + stage * Cfg::kStageBytes; };
  auto stage_b = [&](int stage) { return smem_base + stage * Cfg::kStageBytes + BM * kBK * 2; };

  // k-tiles [0, K / kBK) read the hi matrix, [K / kBK, 2 K / kBK) the lo one with the same rows.
  // fp8 x fp8: ceil(K / 128) tiles of 128 inputs, one term.
  const int term_k_tiles = Fp8Mma ? (K + kFp8BlockK - 1) / kFp8BlockK : K / kBK;
  const int num_k_tiles = term_k_tiles * static_cast<int>(p.weight_terms);
  // fp8 x fp8: a stage's scales, [BM] of the rows then [kBRows] of the weight rows.
  auto stage_scales = [&](int stage) {
    return smem_base + Cfg::kStages * Cfg::kStageBytes + stage * Cfg::kScaleFloats * 4;
  };
  auto weight_row = [&](int r) {  // gate rows n0.. then (fused) up rows N + n0..
    return (Cfg::kGateUp && r >= BN) ? N + n0 + (r - BN) : n0 + r;
  };
  // The codes and scales of k-tile k_tile of the rows (A) and of the weights (B). Chunks past
  // K (K a multiple of 64, not of 128) and rows past the tile's count are zero-filled.
  auto load_a_fp8 = [&](int stage, int k_tile) {
    const int k0 = k_tile * kFp8BlockK;
    const int64_t scales_per_row = term_k_tiles;
    const uint32_t sa = stage_a(stage);
#pragma unroll
    for (int c = threadIdx.x; c < BM * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool valid = r < rows_valid && k0 + ch * 16 < K;
      const uint8_t* src = p.act_codes + static_cast<int64_t>(s_arow[r]) * K + k0 + ch * 16;
      cp_async_16(sa + swizzle(r, ch), valid ? src : p.act_codes, valid);
    }
    for (int r = threadIdx.x; r < BM; r += kThreads) {
      cp_async_4(stage_scales(stage) + r * 4,
                 p.act_scales + static_cast<int64_t>(s_arow[r]) * scales_per_row + k_tile,
                 r < rows_valid);
    }
  };
  auto load_b_fp8 = [&](int stage, int k_tile) {
    const int k0 = k_tile * kFp8BlockK;
    const uint32_t sb = stage_b(stage);
#pragma unroll
    for (int c = threadIdx.x; c < Cfg::kBRows * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool valid = k0 + ch * 16 < K;
      const uint8_t* src = q_slab + static_cast<int64_t>(weight_row(r)) * K + k0 + ch * 16;
      cp_async_16(sb + swizzle(r, ch), valid ? src : q_slab, valid);
    }
    const auto* w_scales = reinterpret_cast<const float*>(q_slab + q_layout.scale_offset);
    for (int r = threadIdx.x; r < Cfg::kBRows; r += kThreads) {
      cp_async_4(stage_scales(stage) + (BM + r) * 4,
                 w_scales + static_cast<int64_t>(weight_row(r)) * q_layout.groups_per_row +
                     k0 / q_group,
                 true);
    }
  };
  auto load_a = [&](int stage, int k_tile) {
    if constexpr (Fp8Mma) return load_a_fp8(stage, k_tile);
    const int k0 = (k_tile >= term_k_tiles ? k_tile - term_k_tiles : k_tile) * kBK;
    const uint32_t sa = stage_a(stage);
#pragma unroll
    for (int c = threadIdx.x; c < BM * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool valid = r < rows_valid;
      const __nv_bfloat16* src = p.rows + static_cast<int64_t>(s_arow[r]) * K + k0 + ch * 8;
      cp_async_16(sa + swizzle(r, ch), src, valid);
    }
  };
  auto load_b = [&](int stage, int k_tile) {
    if constexpr (Fp8Mma) return load_b_fp8(stage, k_tile);
    const bool lo = k_tile >= term_k_tiles;
    const int k0 = (lo ? k_tile - term_k_tiles : k_tile) * kBK;
    const __nv_bfloat16* b_term = lo ? b_base + term_elems : b_base;
    const uint32_t sb = stage_b(stage);
#pragma unroll
    for (int c = threadIdx.x; c < Cfg::kBRows * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      // Gate rows n0.. then (fused) up rows N + n0..
      const int w_row = (Cfg::kGateUp && r >= BN) ? N + n0 + (r - BN) : n0 + r;
      const __nv_bfloat16* src = b_term + static_cast<int64_t>(w_row) * K + k0 + ch * 8;
      cp_async_16(sb + swizzle(r, ch), src, true);
    }
  };

  // Quantised weight tiles: each thread's chunks of a tile, fetched into registers, then
  // dequantised into the stage (see the file's header).
  constexpr int kQuantChunks = Cfg::kBRows * 8 / kThreads;
  static_assert(!kRegisterStagedB || Cfg::kBRows * 8 % kThreads == 0,
                "quantised tiles split evenly over the threads");
  auto fetch_b = [&](int k_tile, QuantChunk (&chunks)[kQuantChunks]) {
    const int k0 = k_tile * kBK;
#pragma unroll
    for (int i = 0; i < kQuantChunks; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = c >> 3, ch = c & 7;
      const int w_row = (Cfg::kGateUp && r >= BN) ? N + n0 + (r - BN) : n0 + r;
      chunks[i] = fetch_quant_chunk<Q>(q_slab, q_layout, q_group, w_row, k0 + ch * 8);
    }
  };
  auto store_b = [&](int stage, const QuantChunk (&chunks)[kQuantChunks]) {
    uint8_t* sb = gemm_smem + stage * Cfg::kStageBytes + BM * kBK * 2;
#pragma unroll
    for (int i = 0; i < kQuantChunks; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = c >> 3, ch = c & 7;
      *reinterpret_cast<uint4*>(sb + swizzle(r, ch)) = dequantize_chunk<Q>(chunks[i]);
    }
  };

  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int warp_m = warp / Cfg::kWarpsN;
  const int warp_n = warp % Cfg::kWarpsN;

  float acc[Cfg::kOps][Cfg::kMTiles][Cfg::kNTiles][4];
#pragma unroll
  for (int o = 0; o < Cfg::kOps; ++o) {
#pragma unroll
    for (int i = 0; i < Cfg::kMTiles; ++i) {
#pragma unroll
      for (int j = 0; j < Cfg::kNTiles; ++j) {
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[o][i][j][v] = 0.0f;
      }
    }
  }

  // Prologue. The weights and offsets were written long before this kernel, so the first
  // stages of weights are requested before waiting for the previous kernel on the stream (a
  // no-op unless launched as a programmatic dependent, see overlap_previous); the rows, which
  // the previous kernel may have written, only after. The weight loads all land in the first
  // commit group, which only makes the first wait a little stricter.
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s >= num_k_tiles) continue;
    if constexpr (!kRegisterStagedB) {
      load_b(s, s);
    } else {
      QuantChunk chunks[kQuantChunks];
      fetch_b(s, chunks);
      store_b(s, chunks);  // visible after the __syncthreads below
    }
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  // Source rows: the expert-ordered row itself, or the gathered token's row.
  for (int r = threadIdx.x; r < BM; r += kThreads) {
    int source = 0;  // rows past the count load nothing, but need a valid address
    if (r < rows_valid) {
      source = row_begin + r;
      if (p.src_row) {
        source = __ldg(p.src_row + row_begin + r) / static_cast<int>(p.top_k);
        MOE_DEVICE_CHECK(source >= 0 && source < p.num_rows / p.top_k);
      }
    }
    s_arow[r] = source;
  }
  __syncthreads();
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < num_k_tiles) load_a(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt-1 is free to overwrite
    const int next = kt + Cfg::kStages - 1;
    QuantChunk next_chunks[kRegisterStagedB ? kQuantChunks : 1];
    if (next < num_k_tiles) {
      load_a(next % Cfg::kStages, next);
      if constexpr (!kRegisterStagedB) {
        load_b(next % Cfg::kStages, next);
      } else {
        fetch_b(next, next_chunks);
      }
    }
    cp_async_commit();

    const int stage = kt % Cfg::kStages;
    const uint32_t sa = stage_a(stage);
    const uint32_t sb = stage_b(stage);
    // fp8 x fp8: this k-tile's (scale block's) products, before its scales.
    float part[Fp8Mma ? Cfg::kOps : 1][Fp8Mma ? Cfg::kMTiles : 1][Fp8Mma ? Cfg::kNTiles : 1][4];
    if constexpr (Fp8Mma) {
#pragma unroll
      for (int o = 0; o < Cfg::kOps; ++o)
#pragma unroll
        for (int i = 0; i < Cfg::kMTiles; ++i)
#pragma unroll
          for (int j = 0; j < Cfg::kNTiles; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) part[o][i][j][v] = 0.0f;
    }
    // 16 bf16 or 32 e4m3 inputs per step: 32 bytes of each row either way. fp8 x fp8 holds a
    // second set of accumulators (part): unrolled less, so fewer fragments are loaded ahead.
    constexpr int kStepUnroll = Fp8Mma ? 1 : kBK / 16;
#pragma unroll kStepUnroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t a[Cfg::kMTiles][4];
#pragma unroll
      for (int i = 0; i < Cfg::kMTiles; ++i) {
        const int r = warp_m * Cfg::kWM + i * 16 + (lane & 15);
        ldmatrix_x4(a[i], sa + swizzle(r, kk * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int o = 0; o < Cfg::kOps; ++o) {
        uint32_t b[Cfg::kNTiles][2];
        if constexpr (Cfg::kNTiles == 1) {
          const int r = o * BN + warp_n * Cfg::kWN + (lane & 7);
          ldmatrix_x2(b[0][0], b[0][1], sb + swizzle(r, kk * 2 + ((lane >> 3) & 1)));
        } else {
#pragma unroll
          for (int j = 0; j < Cfg::kNTiles; j += 2) {
            const int r = o * BN + warp_n * Cfg::kWN + j * 8 + ((lane >> 4) << 3) + (lane & 7);
            uint32_t t[4];
            ldmatrix_x4(t, sb + swizzle(r, kk * 2 + ((lane >> 3) & 1)));
            b[j][0] = t[0];
            b[j][1] = t[1];
            b[j + 1][0] = t[2];
            b[j + 1][1] = t[3];
          }
        }
#pragma unroll
        for (int i = 0; i < Cfg::kMTiles; ++i)
#pragma unroll
          for (int j = 0; j < Cfg::kNTiles; ++j) {
            if constexpr (Fp8Mma) {
              mma_fp8(part[o][i][j], a[i], b[j][0], b[j][1]);
            } else {
              mma_bf16(acc[o][i][j], a[i], b[j][0], b[j][1]);
            }
          }
      }
    }
    if constexpr (Fp8Mma) {
      // acc += part * act_scale[row] * weight_scale[column], the scales of this k block.
      const auto* scales = reinterpret_cast<const float*>(gemm_smem + Cfg::kStages *
                                                          Cfg::kStageBytes) +
                           stage * Cfg::kScaleFloats;
#pragma unroll
      for (int i = 0; i < Cfg::kMTiles; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float a_scale = scales[warp_m * Cfg::kWM + i * 16 + (lane >> 2) + half * 8];
#pragma unroll
          for (int o = 0; o < Cfg::kOps; ++o) {
#pragma unroll
            for (int j = 0; j < Cfg::kNTiles; ++j) {
              const int col = o * BN + warp_n * Cfg::kWN + j * 8 + (lane & 3) * 2;
              acc[o][i][j][half * 2] += part[o][i][j][half * 2] * (a_scale * scales[BM + col]);
              acc[o][i][j][half * 2 + 1] +=
                  part[o][i][j][half * 2 + 1] * (a_scale * scales[BM + col + 1]);
            }
          }
        }
      }
    }
    if constexpr (kRegisterStagedB) {
      if (next < num_k_tiles) store_b(next % Cfg::kStages, next_chunks);
    }
  }
  cp_async_wait<0>();

  // Epilogue: c0,c1 at (lane/4, 2*(lane%4) + {0,1}), c2,c3 eight rows further down. The
  // expert's bias row, if any: [Nw] float32, gate columns then up columns.
  const float* bias_row =
      p.bias != nullptr ? p.bias + static_cast<int64_t>(expert) * Cfg::kOps * N : nullptr;
  const bool clamped_swiglu = p.epilogue == GemmEpilogue::kClampedSwiglu;
#pragma unroll
  for (int i = 0; i < Cfg::kMTiles; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * Cfg::kWM + i * 16 + (lane >> 2) + half * 8;
      if (r >= rows_valid) continue;
      __nv_bfloat16* out_row = p.out + static_cast<int64_t>(row_begin + r) * N;
#pragma unroll
      for (int j = 0; j < Cfg::kNTiles; ++j) {
        const int col = n0 + warp_n * Cfg::kWN + j * 8 + (lane & 3) * 2;
        float v0 = acc[0][i][j][half * 2];
        float v1 = acc[0][i][j][half * 2 + 1];
        if (bias_row != nullptr) {
          v0 += __ldg(bias_row + col);
          v1 += __ldg(bias_row + col + 1);
        }
        if constexpr (Cfg::kGateUp) {
          float u0 = acc[Cfg::kOps - 1][i][j][half * 2];
          float u1 = acc[Cfg::kOps - 1][i][j][half * 2 + 1];
          if (bias_row != nullptr) {
            u0 += __ldg(bias_row + N + col);
            u1 += __ldg(bias_row + N + col + 1);
          }
          if (clamped_swiglu) {
            v0 = gated::clamped_swiglu(v0, u0, p.swiglu_alpha, p.swiglu_limit);
            v1 = gated::clamped_swiglu(v1, u1, p.swiglu_alpha, p.swiglu_limit);
          } else {
            v0 = gated::silu_mul(v0, u0);
            v1 = gated::silu_mul(v1, u1);
          }
        }
        *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}

}  // namespace moeinfer::cuda
