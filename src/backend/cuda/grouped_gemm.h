// Host interface of the grouped expert GEMM: the `experts` stage of the MoE layer on the GPU.
//
// The rows arrive in expert order (the output of `permute`), and the per-expert row ranges are
// the plan's expert_offsets, which stay in device memory: the kernel reads them, so nothing here
// synchronises with the host and the launch can sit in a CUDA graph. One launch serves all
// experts; the grid is sized from host-known worst cases (T*K rows, E experts) and blocks whose
// tile slot no expert claims exit at once, so an empty expert costs nothing but a scan of E
// offsets in one block.
//
// Layouts (glossary letters: T tokens, K experts per token, E experts, H hidden, I expert width;
// M = T*K rows; y = x W^T with W row-major):
//   rows            [M, Kd]     bf16, expert-ordered, Kd the reduction dim (H for gate/up, I for
//                               down)
//   weights         [E, Nw, Kd] bf16 per expert; plain: Nw = N; kSiluMul: Nw = 2N, gate rows
//                               [0, N) then up rows [N, 2N) (the fused `gate_up_proj` layout;
//                               a checkpoint with separate gate and up tensors is concatenated
//                               at load time)
//                               With weight_terms = 2 each expert's matrix is followed by a
//                               second one of the same shape (weights [E, 2, Nw, Kd]): a
//                               float32 weight held as hi = bf16(w) and lo = bf16(w - hi), and
//                               the product takes both terms' partial sums in the same float32
//                               accumulators (gpu/device_weights.h)
//   expert_offsets  [E + 1]     int32 on the device, offsets[0] = 0, offsets[E] <= M
//   out             [M, N]      bf16; rows past offsets[E] are not written
//
// Epilogues: kNone writes bf16(acc); kSiluMul writes bf16(silu(gate) * up) with gate and up the
// float32 accumulators of the same output column (SiLU(x) = x / (1 + exp(-x))); kClampedSwiglu
// (GPT-OSS) writes bf16((u + 1) * g * sigmoid(alpha * g)) with g = min(gate, limit) and
// u = clamp(up, -limit, limit). An optional float32 bias per expert joins the accumulators
// before any of them (gate and up columns alike).
//
// Quantised weights (fp8, int4, MXFP4 codes with their scales, expert_quant.h) are dequantised
// to bf16 on their way into shared memory: see GroupedGemmParams::quant.
//
// fp8 x fp8 (act_codes set, quant kFp8 with 128-input scale blocks): the rows arrive as e4m3
// codes and a float32 scale per (row, 128 inputs), written by quantize_rows_fp8 (DeepSeek-V3's
// activation recipe), and both operands meet in Hopper's fp8 tensor cores (sm_89 and later):
// out = epilogue(sum over k blocks kb of act_scale[r, kb] * weight_scale[c, kb] *
// sum_{k in kb} e4m3(a[r, k]) * e4m3(w[c, k])), each block's sum in float32.
//
// Requirements (the launcher names the offending value): Kd a positive multiple of 64, N a
// positive multiple of 32 (64 and 128 for the larger tiles, see grouped_gemm.cu), all three
// matrices 16-byte aligned (cp.async moves 16-byte chunks), M < 2^31.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/expert_quant.h"

namespace moeinfer::cuda {

enum class GemmEpilogue : int32_t { kNone, kSiluMul, kClampedSwiglu };

// Tile shapes. kAuto picks from the mean rows per expert, M / min(E, M), which the host knows
// without reading the device: up to 8 rows the 16-row tile (decode: weights streamed by many
// narrow blocks), up to 160 the 64-row tile, above that the Hopper kernel (kHopperWgmma) on a
// device of compute capability 9.0 when the build has it and the parameters allow it (see
// grouped_gemm_wgmma_supported), else the 128 x 256 tile (kRows128Wide: 128 x 128 outputs with
// gate/up, 64 x 64 warp tiles) where N allows it, else 128 x 128.
//
// kHopperWgmma (grouped_gemm_wgmma_kernel.cuh): sm_90a wgmma on TMA-loaded, 128B-swizzled
// shared memory, a producer warp and two consumer warpgroups over an mbarrier pipeline, and a
// persistent grid walking the (expert, row tile, column tile) list read from expert_offsets on
// the device. 128 rows x 256 weight rows per tile (BNW 128 or 64 where N needs it). Plain bf16
// weights only: `weights` (no expert_weights table), weight_terms 1, no quant, no act_codes, no
// src_row gather, E <= 1024, N a multiple of 32 gated or 64 plain; never for kAuto under
// batch_invariant (--deterministic). Forcing it (tile = kHopperWgmma) where the device or the
// parameters do not allow it is refused by name; setting any other tile explicitly is the A/B
// switch that keeps it off.
//
// kSkinny (grouped_skinny_kernel.cuh): no tile at all, the weights streamed through registers
// as the skinny GEMM does for dense projections, each expert's weight row read once for its up
// to 4 rows a block (more rows take more blocks, each reading the weights again; one row a
// block, with fewer registers, where one_row_per_expert says each expert has one). kAuto takes it
// at decode's smallest steps (M <= E and M <= 16, or 64 for quantised
// weights) and not under batch_invariant; every weight format, both epilogues, biases, the slot
// table and the gather; not fp8 x fp8 (act_codes).
enum class GemmTile : int32_t {
  kAuto,
  kRows16,
  kRows64,
  kRows128,
  kRows128Wide,
  kHopperWgmma,
  kSkinny
};

struct GroupedGemmParams {
  const __nv_bfloat16* rows = nullptr;      // [M, Kd]
  const __nv_bfloat16* weights = nullptr;   // [E, Nw, Kd], or null with expert_weights
  // Or [E] device pointers, one [Nw, Kd] matrix per expert (the expert cache's slot table:
  // device slots or pinned host memory, rewritten between launches without a new graph). A null
  // entry skips its expert: its output rows are not written.
  const __nv_bfloat16* const* expert_weights = nullptr;
  const int32_t* expert_offsets = nullptr;  // [E + 1] device
  __nv_bfloat16* out = nullptr;             // [M, N]
  int64_t num_rows = 0;                     // M = T*K, the grid's worst case
  int64_t num_experts = 0;                  // E
  int64_t n = 0;                            // N output columns
  int64_t k = 0;                            // Kd
  int64_t weight_terms = 1;                 // 1, or 2: a lo matrix after each expert's matrix
  // Quantised weights (expert_quant.h): `weights` then points at E slabs of
  // quant_matrix_layout(quant, Nw, Kd, quant_group).bytes each (and each expert_weights entry at
  // one slab), read as bytes despite the pointer type; each 16-byte chunk of a weight tile is
  // loaded as codes and its scale, dequantised to bf16 in registers and stored to shared memory
  // where cp.async would have put the bf16 weights, so the product is the bf16 product over the
  // dequantised values. weight_terms must be 1. The 16- and 64-row tiles only (kRows128 and
  // kRows128Wide run as kRows64).
  ExpertQuant quant = ExpertQuant::kNone;
  int64_t quant_group = 0;  // inputs per scale: a multiple of 8 (fp8, int4), 32 (mxfp4)
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  // [E, Nw] float32, or null: expert e's bias, added to the float32 accumulators of output
  // column c (and, with a gated epilogue, of up column N + c) before the epilogue. Indexed by
  // expert like expert_weights, so it stays put when a cache moves an expert's weights.
  const float* bias = nullptr;
  float swiglu_alpha = 1.702f;  // kClampedSwiglu
  float swiglu_limit = 7.0f;    // kClampedSwiglu
  GemmTile tile = GemmTile::kAuto;
  // Optional gather (dispatch fused into the A-tile load): row r of the operand is
  // rows[src_row[r] / top_k], so `rows` is the un-permuted hidden state [T, Kd] and the
  // permuted copy is never written. src_row is the plan's [M] array.
  const int32_t* src_row = nullptr;
  int64_t top_k = 1;  // K, with src_row
  // fp8 x fp8 (quant kFp8, quant_group a multiple of 128, a device of compute capability 8.9 or
  // later): the operand rows as quantize_rows_fp8 wrote them, read in place of `rows` (through
  // src_row like them when gathering). codes [rows, Kd] e4m3, scales [rows, ceil(Kd / 128)].
  const uint8_t* act_codes = nullptr;
  const float* act_scales = nullptr;
  // Launch as a programmatic dependent of the previous kernel on the stream: the tile scan and
  // the first weight tiles overlap that kernel's tail; rows and src_row are read only after it
  // has finished. Only for a previous kernel that writes neither the weights nor
  // expert_offsets.
  bool overlap_previous = false;
  // --deterministic: kAuto never takes kHopperWgmma. Every mma.sync tile sums an element in
  // the same order, so a row's result does not depend on the rows beside it; wgmma sums in its
  // own order and kAuto takes it by the launch's rows, so the same row could differ between a
  // large step and a small one.
  bool batch_invariant = false;
  // The caller knows that no expert has more than one row (the rows of one token, whose K
  // experts are distinct). The skinny kernel then takes one row a block instead of up to
  // kGroupedSkinnyRows: a quarter of its accumulators, so more of its blocks fit an SM and a
  // batch-1 step's blocks run in one wave. Only a hint: any rows still come out right (an expert
  // with several rows then has its weights read once for each).
  bool one_row_per_expert = false;
  // Bytes of each weight row the skinny kernel asks of L2 before its wait: set by the launcher
  // from weight_prefetch_bytes() (programmatic_launch.h), not by callers.
  int64_t prefetch_row_bytes = 0;
};

// Validates and enqueues one grouped GEMM.
void grouped_gemm(const GroupedGemmParams& params, cudaStream_t stream);

// The mma.sync tile kAuto resolves to for these sizes (for benchmarks and tests); kAuto runs
// kHopperWgmma instead where grouped_gemm_tile says so.
GemmTile grouped_gemm_auto_tile(int64_t num_rows, int64_t num_experts, int64_t n,
                                GemmEpilogue epilogue);

// The tile grouped_gemm runs for these parameters on the current device: params.tile when set,
// else kAuto's choice, kHopperWgmma included.
GemmTile grouped_gemm_tile(const GroupedGemmParams& params);

// Whether the current device can run kHopperWgmma at all: a build for CUDA architecture 90
// (the kernel is compiled for sm_90a) and a device of compute capability 9.0 exactly.
bool grouped_gemm_wgmma_available();

// Whether kHopperWgmma runs these parameters on the current device (available, and the shapes
// and options the kernel supports).
bool grouped_gemm_wgmma_supported(const GroupedGemmParams& params);

// Activations for fp8 x fp8, DeepSeek-V3's recipe: each row's inputs in blocks of 128 (the last
// block may be short), each block as the e4m3 codes of x / scale, scale = amax / 448 (1 for an
// all-zero block), rounded to nearest even and saturated: core/dtype's encode_f8e4m3_scaled over
// the block's values, byte for byte. One warp per (row, block).
struct Fp8RowsParams {
  const __nv_bfloat16* rows = nullptr;  // [M, Kd]
  uint8_t* codes = nullptr;             // [M, Kd] e4m3
  float* scales = nullptr;              // [M, ceil(Kd / 128)]
  int64_t num_rows = 0;                 // M, the grid's worst case
  int64_t k = 0;                        // Kd, a positive multiple of 64
  // Device scalar, or null: rows at and past it are left alone (the plan's expert_offsets[E],
  // where the rows of a bucket's padding start).
  const int32_t* num_valid_rows = nullptr;
};
void quantize_rows_fp8(const Fp8RowsParams& params, cudaStream_t stream);

// Inputs per activation scale block of fp8 x fp8, and the fewest mean rows per expert at which
// the experts stage takes it (see fp8_tensor_core_experts).
inline constexpr int64_t kFp8ActBlock = 128;
inline constexpr int64_t kFp8MmaMinMeanRows = 32;

// Whether this device and these weights can run fp8 x fp8: fp8 codes whose scale groups cover
// whole 128-input blocks (DeepSeek-V3's and Qwen3-FP8's 128 x 128 blocks; --weights fp8) and a
// device of compute capability 8.9 or later. The checkpoint fixtures' 8 x 8 blocks cannot: a
// weight scale must be constant over each 32-input mma step, and over the whole 128-input block
// the activation scale covers.
bool fp8_tensor_cores_supported(ExpertQuant quant, int64_t quant_group);

// The one predicate of the experts stage: fp8 x fp8 where supported and the GEMM has rows enough
// per expert to be compute-bound (mean rows = M / min(E, M) >= kFp8MmaMinMeanRows: prefill and
// large batches). Below that the weight bytes bound the time (decode reads each expert's weights
// for a handful of rows) and both paths read the same fp8 bytes, so weight-only dequantisation
// is as fast, needs no activation pass and keeps the activations exact.
bool fp8_tensor_core_experts(ExpertQuant quant, int64_t quant_group, int64_t num_rows,
                             int64_t num_experts);

struct MoeExpertsParams {
  const __nv_bfloat16* rows = nullptr;      // [M, H] expert-ordered, or [T, H] with src_row
  const __nv_bfloat16* gate_up = nullptr;   // [E, terms, 2I, H], or null with the tables
  const __nv_bfloat16* down = nullptr;      // [E, terms, H, I]
  int64_t weight_terms = 1;                 // terms: 1, or 2 (hi and lo bf16 matrices)
  // Quantised experts (GroupedGemmParams::quant): gate_up and down are then E slabs each.
  ExpertQuant quant = ExpertQuant::kNone;
  int64_t quant_group = 0;
  const __nv_bfloat16* const* gate_up_table = nullptr;  // [E] -> [terms, 2I, H]
  const __nv_bfloat16* const* down_table = nullptr;     // [E] -> [terms, H, I]
  const int32_t* expert_offsets = nullptr;  // [E + 1] device
  __nv_bfloat16* activation = nullptr;      // [M, I] workspace
  __nv_bfloat16* out = nullptr;             // [M, H]
  int64_t num_rows = 0;                     // M
  int64_t num_experts = 0;                  // E
  int64_t hidden_size = 0;                  // H
  int64_t expert_width = 0;                 // I
  const int32_t* src_row = nullptr;         // [M] optional: gather rows[src_row[r] / top_k]
  int64_t top_k = 1;                        // K, with src_row
  // GPT-OSS's experts: float32 biases [E, 2I] (gate then up, as the weights' rows) and [E, H],
  // or null; and the gate/up projection's epilogue, kSiluMul or kClampedSwiglu (its alpha and
  // limit below).
  const float* gate_up_bias = nullptr;
  const float* down_bias = nullptr;
  GemmEpilogue gate_up_epilogue = GemmEpilogue::kSiluMul;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  // Workspaces of fp8 x fp8 (taken where fp8_tensor_core_experts says so; null: never):
  // codes [M, max(H, I)] e4m3 and scales [M, ceil(max(H, I) / 128)] float32, holding the
  // gate/up projection's operand rows and then the down projection's.
  uint8_t* fp8_codes = nullptr;
  float* fp8_scales = nullptr;
  // GroupedGemmParams::batch_invariant for both products (--deterministic).
  bool batch_invariant = false;
  // Where the rows are one token's (gathered, num_rows <= top_k: K distinct experts, one row
  // each), both products run the skinny kernel one row a block
  // (GroupedGemmParams::one_row_per_expert). Off: up to kGroupedSkinnyRows a block.
  bool one_row_blocks = false;
  // GroupedGemmParams::tile for both products (benchmarks and tests; kAuto in the engine).
  GemmTile tile = GemmTile::kAuto;
};

// The experts stage: activation = SiLU(rows . gate^T) * (rows . up^T) (or the clamped SwiGLU,
// biases added first where given), out = activation . down^T (+ down_bias), two launches, the
// second a programmatic dependent of the first. Where fp8_tensor_core_experts holds (and the
// workspaces are given) both products run fp8 x fp8, each after a quantize_rows_fp8 of its rows.
void moe_experts(const MoeExpertsParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
