// Grouped expert GEMM for Hopper (sm_90a): warpgroup MMA (wgmma) on operands that the bulk tensor
// copy engine (TMA) writes into 128-byte-swizzled shared memory, an mbarrier pipeline between a
// producer warp and two consumer warpgroups, and a persistent grid walking a tile list over
// experts of uneven row counts. The prefill path of the experts stage; grouped_gemm_kernel.cuh's
// mma.sync kernels serve everything else. Why it is built this way:
//
// - The tile is 128 rows x BNW weight rows (BNW = 256 where N allows it): consumer warpgroup w
//   computes rows [64 w, 64 w + 64) against all BNW weight rows with m64nBNWk16, the largest
//   wgmma, so each byte of B read from shared memory feeds 64 rows and each byte of A feeds 256
//   columns. Its float32 accumulators are 64 * 256 / 128 = 128 registers a thread, which with
//   addressing fits the 232 that setmaxnreg gives a consumer (the producer warpgroup drops to
//   40; 128 * 40 + 256 * 232 <= 64K). A 128 x 256 tile of bf16 at k = 64 is 48 KB a stage, so
//   four stages fill 192 KB of the 227 KB. Narrower N (not a multiple of the width) takes
//   BNW = 128 (6 stages) or 64 (8 stages).
// - Gated epilogues (kSiluMul, kClampedSwiglu): the B tile's first BNW / 2 rows are gate rows
//   n0.. and the next BNW / 2 the matching up rows N + n0.., loaded by two TMA boxes into one
//   stage. In wgmma's accumulator layout a thread holding column c also holds column
//   BNW / 2 + c (register 4 j + i and 4 (j + BNW / 16) + i), so silu(gate) * up is formed in
//   registers and the [M, 2N] intermediate never exists. Plain: the two boxes are simply the
//   two halves of BNW consecutive weight rows.
// - Shared memory: every operand tile is rows of 64 bf16 = 128 bytes (the k-tile), written by
//   TMA with CU_TENSOR_MAP_SWIZZLE_128B: the 16-byte chunk j of row r lands at chunk j ^ (r % 8)
//   of the row, the pattern wgmma's 128B-swizzle mode reads, so neither side has bank conflicts.
//   The swizzle is a function of the address bits, so each tile starts on a 1024-byte boundary
//   (8 rows x 128 bytes, one swizzle atom).
// - Pipeline: kStages slots, each with a `full` mbarrier (the producer's expect_tx of the
//   stage's bytes, completed by the TMA engine) and an `empty` one (one arrival from each of the
//   8 consumer warps once its wgmmas that read the slot are done). One thread of the producer
//   warpgroup issues everything; the other three producer warps exit at once.
// - Consumers: per k-tile, wait `full`, wgmma.fence, four m64nBNWk16 (k = 0, 16, 32, 48: the
//   descriptor's start address moves 32 bytes inside the swizzled row), commit_group, then
//   wait_group 1 (the previous k-tile's group is done, so its slot is released while this one
//   runs). After the last k-tile wait_group 0, release, and the epilogue stores bf16 pairs
//   straight from registers; the producer is meanwhile filling the next tile's stages.
// - Scheduler: persistent, one CTA per SM (the shared memory allows no more). Every CTA reads
//   expert_offsets (device memory, after griddepcontrol.wait), and warp 0 turns the counts into
//   a prefix sum of row tiles per expert in shared memory; tile t of the list is row slot
//   t / n_tiles (found by binary search in the prefix sums) and column tile t % n_tiles, and
//   CTA b takes tiles b, b + gridDim.x, ... . Producer and consumers walk the same list
//   independently. Nothing reads the host: the launch is graph-capturable and replays right
//   after expert_offsets changes. Column tiles vary fastest, so CTAs running at once share row
//   tiles (A) in L2 and neighbouring row slots of one expert share its weights.
// - Rows of a tile past its expert's end are computed (TMA loads the next expert's rows, or
//   zeros past M) and not stored.
// - Only the plain bf16 case: weights [E, Nw, Kd] contiguous, one term, no gather (a gathered
//   A tile is not a box), E <= kMaxExperts. grouped_gemm() takes the mma.sync kernels for the
//   rest.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct: nothing here links the driver library)
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/grouped_gemm.h"

namespace moeinfer::cuda {

namespace wgmma {

inline constexpr int kBM = 128;       // rows per tile: two consumer warpgroups of 64 rows
inline constexpr int kBK = 64;        // k-tile: 64 bf16 = 128 bytes, the swizzle span
inline constexpr int kThreads = 384;  // warpgroup 0 produces, warpgroups 1 and 2 consume
inline constexpr int kConsumerWarps = 8;
inline constexpr int kMaxExperts = 1024;        // the offsets and prefix sums live in shared memory
inline constexpr int kTileBudget = 192 * 1024;  // shared memory for the pipeline's stages
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;

// Everything the kernel reads. The two tensor maps are built on the host (grouped_gemm_wgmma.cu)
// and passed by value: a __grid_constant__ parameter whose address the TMA instructions take.
struct Params {
  CUtensorMap rows_map;     // rows [M, Kd] bf16: dims {Kd, M}, box {64, 128}, 128B swizzle
  CUtensorMap weights_map;  // weights [E * Nw, Kd] bf16: dims {Kd, E Nw}, box {64, BNW / 2}
  const int32_t* expert_offsets = nullptr;  // [E + 1] device
  __nv_bfloat16* out = nullptr;             // [M, N]
  const float* bias = nullptr;              // [E, Nw] float32, or null
  int32_t num_experts = 0;                  // E
  int32_t n = 0;                            // N output columns
  int32_t nw = 0;                           // Nw weight rows per expert (N, or 2N gated)
  int32_t k = 0;                            // Kd
  int32_t num_n_tiles = 0;                  // N / BN
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
};

template <int BNW_, bool Gated_>
struct Config {
  static constexpr int BNW = BNW_;  // weight rows per tile (gate half, then up half, if gated)
  static constexpr bool kGated = Gated_;
  static constexpr int BN = kGated ? BNW / 2 : BNW;  // output columns per tile
  static constexpr int kHalfRows = BNW / 2;          // rows of one TMA box of B
  static constexpr int kABytes = kBM * kBK * 2;
  static constexpr int kBBytes = BNW * kBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = kTileBudget / kStageBytes < 8 ? kTileBudget / kStageBytes : 8;
  static constexpr int kAccRegs = BNW / 2;  // 64 x BNW float32 over the 128 threads
  // Stages (each tile 1024-byte aligned), then offsets [kMaxExperts + 1], prefix sums
  // [kMaxExperts + 1], full[kStages], empty[kStages]; plus 1024 bytes to align the base.
  static constexpr int kSmemBytes =
      1024 + kStages * kStageBytes + 2 * (kMaxExperts + 1) * 4 + 2 * kStages * 8;
  static_assert(BNW == 64 || BNW == 128 || BNW == 256, "wgmma N is 64, 128 or 256 here");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0 && (kHalfRows * 128) % 1024 == 0,
                "every tile starts on a swizzle atom");
  static_assert(kStages >= 3, "at least three stages");
};

__device__ __forceinline__ uint32_t smem_addr(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The shared-memory matrix descriptor of wgmma (PTX ISA, "Matrix Descriptor Format") for a
// K-major tile of 128-byte rows in the 128B swizzle mode:
//   bits  0-13  start address >> 4 (shared addresses are below 256 KB, so 14 bits hold them)
//   bits 16-29  leading dimension byte offset >> 4: the distance between core matrices along K.
//               A swizzled K-major tile's k16 slice lies inside one 128-byte row, so the field
//               is not used; 1 (16 bytes) by convention
//   bits 32-45  stride dimension byte offset >> 4: from one group of 8 rows (M or N) to the
//               next, 8 x 128 bytes = 1024 -> 64
//   bits 49-51  base offset: 0, every tile starts on a 1024-byte boundary
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle (2 = 64B, 3 = 32B, 0 = none)
// Stepping k by 16 within the 64-wide row adds 32 bytes to the start address: the hardware
// applies the XOR of the swizzle to the address it forms, as TMA did when writing.
__device__ __forceinline__ uint64_t make_descriptor(uint32_t smem_address) {
  return static_cast<uint64_t>((smem_address & 0x3FFFFu) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (done == 0);
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also tells the barrier to expect `bytes` more of transaction count (the
// stage's TMA boxes, which complete it).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// TMA: the box at (c0 inner, c1 outer) of the tensor map into shared memory at dst, counted on
// the mbarrier. Out-of-bounds elements are written as zeros and still count.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of this warpgroup's committed wgmma groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Ties the accumulators to the surrounding asm statements, so the compiler neither moves their
// reads (the epilogue) above a wgmma.wait_group nor their writes (the zeroing) below a wgmma.
template <int R>
__device__ __forceinline__ void fence_registers(float (&acc)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// D[64 x N] += A[64 x 16] . B[N x 16]^T, both operands K-major in shared memory through their
// descriptors; D float32 in registers in the accumulator layout (register 4 j + 2 h + b of a
// thread of warp w, lane l: row 16 w + l / 4 + 8 h, column 8 j + 2 (l % 4) + b). scale-d is the
// predicate p = 1 (accumulate), imm-scale-a/b = 1 (no negation), imm-trans-a/b = 0 (both
// K-major, no transpose).

__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"  // scale-d = 1: D = A . B + D
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b)
      : "memory");
#else
  (void)d, (void)desc_a, (void)desc_b;
#endif
}

__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"  // scale-d = 1: D = A . B + D
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
      "%60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b)
      : "memory");
#else
  (void)d, (void)desc_a, (void)desc_b;
#endif
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a,
                                                 uint64_t desc_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"  // scale-d = 1: D = A . B + D
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
      "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
      "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b)
      : "memory");
#else
  (void)d, (void)desc_a, (void)desc_b;
#endif
}

template <int BNW>
__device__ __forceinline__ void wgmma_tile(float (&d)[BNW / 2], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (BNW == 256) {
    wgmma_m64n256k16(d, desc_a, desc_b);
  } else if constexpr (BNW == 128) {
    wgmma_m64n128k16(d, desc_a, desc_b);
  } else {
    wgmma_m64n64k16(d, desc_a, desc_b);
  }
}

// The (expert, rows, column tile) of tile `tile` of the list: row slot tile / n_tiles is the
// expert's slot s_prefix[e] + m_tile for the largest e with s_prefix[e] <= slot (experts with
// no rows have no slots and are skipped by the search).
struct TileCoord {
  int expert, row_begin, rows, n_tile;
};
__device__ __forceinline__ TileCoord locate_tile(int tile, int num_n_tiles, int num_experts,
                                                 const int32_t* s_offsets,
                                                 const int32_t* s_prefix) {
  const int slot = tile / num_n_tiles;
  TileCoord t;
  t.n_tile = tile - slot * num_n_tiles;
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (s_prefix[mid] <= slot) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  t.expert = lo;
  t.row_begin = s_offsets[lo] + (slot - s_prefix[lo]) * kBM;
  t.rows = min(kBM, s_offsets[lo + 1] - t.row_begin);
  return t;
}

__device__ __forceinline__ float silu_mul(float gate, float up) {
  return gate / (1.0f + __expf(-gate)) * up;
}

// GPT-OSS's clamped SwiGLU, as grouped_gemm_kernel.cuh's clamped_swiglu_value.
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float alpha, float limit) {
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  return (u + 1.0f) * (g / (1.0f + __expf(-alpha * g)));
}

}  // namespace wgmma

template <class Cfg>
__global__ void __launch_bounds__(wgmma::kThreads, 1)
    grouped_gemm_wgmma_kernel(const __grid_constant__ wgmma::Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace wgmma;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ uint8_t wgmma_smem_raw[];
  // The swizzle atoms need 1024-byte alignment, which dynamic shared memory does not promise.
  const uint32_t raw_address = smem_addr(wgmma_smem_raw);
  const uint32_t tiles_address = (raw_address + 1023u) & ~1023u;
  uint8_t* smem = wgmma_smem_raw + (tiles_address - raw_address);
  auto* s_offsets = reinterpret_cast<int32_t*>(smem + kStages * Cfg::kStageBytes);
  int32_t* s_prefix = s_offsets + kMaxExperts + 1;
  auto* barriers = reinterpret_cast<uint64_t*>(s_prefix + kMaxExperts + 1);
  const uint32_t full0 = smem_addr(barriers);             // full[s] at full0 + 8 s
  const uint32_t empty0 = smem_addr(barriers + kStages);  // empty[s] at empty0 + 8 s
  auto stage_a = [&](int s) { return tiles_address + s * Cfg::kStageBytes; };
  auto stage_b = [&](int s) { return tiles_address + s * Cfg::kStageBytes + Cfg::kABytes; };

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  // A kernel launched after this one as a programmatic dependent may start its prologue now;
  // it still waits for this grid to finish before reading what this grid writes.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 1);                // the producer's arrive.expect_tx
      mbar_init(empty0 + 8 * s, kConsumerWarps);  // lane 0 of each consumer warp
    }
    // Make the initialised barriers visible to the other threads and to the async proxy (TMA).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.rows_map))
                 : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&p.weights_map))
                 : "memory");
  }
  // The previous kernel on the stream (under programmatic dependent launch) may have written
  // the rows and the offsets: wait for it before reading either. A no-op otherwise.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int num_experts = p.num_experts;
  for (int i = tid; i <= num_experts; i += kThreads) s_offsets[i] = p.expert_offsets[i];
  __syncthreads();
  if (warp == 0) {  // s_prefix[e] = row tiles of experts before e
    int running = 0;
    for (int e0 = 0; e0 < num_experts; e0 += 32) {
      const int e = e0 + lane;
      int tiles = 0;
      if (e < num_experts) tiles = max(0, s_offsets[e + 1] - s_offsets[e] + kBM - 1) / kBM;
      int inclusive = tiles;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      if (e < num_experts) s_prefix[e + 1] = running + inclusive;
      running += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) s_prefix[0] = 0;
  }
  __syncthreads();  // also publishes the barriers' initialisation
  const int num_n_tiles = p.num_n_tiles;
  const int total_tiles = s_prefix[num_experts] * num_n_tiles;
  const int num_k_tiles = p.k / kBK;

  // The two roles are the two branches of one if/else, so that setmaxnreg applies (HOPPER.md).
  if (warp < 4) {
    // Producer warpgroup. setmaxnreg is warpgroup-wide: all four warps give registers back,
    // then all but one thread are done.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (tid != 0) return;
    int it = 0;  // k-tiles issued so far over all tiles: stage it % kStages, round it / kStages
    for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles;
         tile += static_cast<int>(gridDim.x)) {
      const TileCoord t = locate_tile(tile, num_n_tiles, num_experts, s_offsets, s_prefix);
      // Weight rows of the two boxes: gate rows n0.. and up rows N + n0.. (gated), or the two
      // halves of BNW consecutive rows (plain), in the [E * Nw, Kd] view.
      const int w0 = t.expert * p.nw + t.n_tile * Cfg::BN;
      const int w1 = Cfg::kGated ? w0 + p.n : w0 + Cfg::kHalfRows;
      for (int kt = 0; kt < num_k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        const int round = it / kStages;
        // Round r reuses the slot the consumers released in round r - 1, whose empty phase
        // has parity (r - 1) & 1.
        if (round > 0) mbar_wait(empty0 + 8 * s, (round - 1) & 1);
        const uint32_t full = full0 + 8 * s;
        mbar_arrive_expect_tx(full, Cfg::kStageBytes);
        tma_load_2d(stage_a(s), &p.rows_map, kt * kBK, t.row_begin, full);
        tma_load_2d(stage_b(s), &p.weights_map, kt * kBK, w0, full);
        tma_load_2d(stage_b(s) + Cfg::kHalfRows * 128, &p.weights_map, kt * kBK, w1, full);
      }
    }
  } else {
    // Consumer warpgroups 1 and 2: rows [64 cw, 64 cw + 64) of each tile.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    const int cw = warp / 4 - 1;
    const int warp_in_group = warp & 3;
    float acc[Cfg::kAccRegs];
    const bool clamped = p.epilogue == GemmEpilogue::kClampedSwiglu;
    int it = 0;
    for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles;
         tile += static_cast<int>(gridDim.x)) {
      const TileCoord t = locate_tile(tile, num_n_tiles, num_experts, s_offsets, s_prefix);
#pragma unroll
      for (int i = 0; i < Cfg::kAccRegs; ++i) acc[i] = 0.0f;
      int previous = 0;
      for (int kt = 0; kt < num_k_tiles; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(full0 + 8 * s, (it / kStages) & 1);
        __syncwarp();  // the wgmma instructions below are .aligned: the warp reconverged
        // This warpgroup's 64 rows of A (64 x 128 bytes = 8 atoms) and all BNW rows of B.
        const uint64_t desc_a = make_descriptor(stage_a(s) + cw * 64 * 128);
        const uint64_t desc_b = make_descriptor(stage_b(s));
        fence_registers(acc);
        wgmma_fence();  // orders the accumulators' earlier register writes before the wgmmas
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          // +32 bytes per k16 step: +2 in the address field (bytes >> 4).
          wgmma_tile<Cfg::BNW>(acc, desc_a + 2 * kk, desc_b + 2 * kk);
        }
        wgmma_commit();
        fence_registers(acc);
        // The previous k-tile's group has finished reading its slot: hand the slot back.
        wgmma_wait<1>();
        fence_registers(acc);
        if (kt > 0 && lane == 0) mbar_arrive(empty0 + 8 * previous);
        previous = s;
      }
      wgmma_wait<0>();
      fence_registers(acc);
      if (lane == 0) mbar_arrive(empty0 + 8 * previous);

      // Epilogue: register 4 j + 2 h + b is (row 16 w + l / 4 + 8 h, column 8 j + 2 (l % 4) + b)
      // of this warpgroup's 64 x BNW block; gated, the up value of column c is column BN + c.
      const float* bias_row =
          p.bias != nullptr ? p.bias + static_cast<int64_t>(t.expert) * p.nw : nullptr;
      const int col0 = t.n_tile * Cfg::BN + 2 * (lane & 3);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = cw * 64 + warp_in_group * 16 + (lane >> 2) + 8 * h;
        if (r >= t.rows) continue;
        __nv_bfloat16* out_row = p.out + static_cast<int64_t>(t.row_begin + r) * p.n;
#pragma unroll
        for (int j = 0; j < Cfg::BN / 8; ++j) {
          const int col = col0 + 8 * j;
          float v0 = acc[4 * j + 2 * h];
          float v1 = acc[4 * j + 2 * h + 1];
          if (bias_row != nullptr) {
            v0 += __ldg(bias_row + col);
            v1 += __ldg(bias_row + col + 1);
          }
          if constexpr (Cfg::kGated) {
            float u0 = acc[4 * (j + Cfg::BN / 8) + 2 * h];
            float u1 = acc[4 * (j + Cfg::BN / 8) + 2 * h + 1];
            if (bias_row != nullptr) {
              u0 += __ldg(bias_row + p.n + col);
              u1 += __ldg(bias_row + p.n + col + 1);
            }
            if (clamped) {
              v0 = clamped_swiglu(v0, u0, p.swiglu_alpha, p.swiglu_limit);
              v1 = clamped_swiglu(v1, u1, p.swiglu_alpha, p.swiglu_limit);
            } else {
              v0 = silu_mul(v0, u0);
              v1 = silu_mul(v1, u1);
            }
          }
          *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __floats2bfloat162_rn(v0, v1);
        }
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
