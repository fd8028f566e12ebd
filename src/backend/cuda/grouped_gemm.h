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
// narrow blocks), up to 160 the 64-row tile, above that the 128 x 256 tile (kRows128Wide:
// 128 x 128 outputs with gate/up, 64 x 64 warp tiles) where N allows it, else 128 x 128.
enum class GemmTile : int32_t { kAuto, kRows16, kRows64, kRows128, kRows128Wide };

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
  // Launch as a programmatic dependent of the previous kernel on the stream: the tile scan and
  // the first weight tiles overlap that kernel's tail; rows and src_row are read only after it
  // has finished. Only for a previous kernel that writes neither the weights nor
  // expert_offsets.
  bool overlap_previous = false;
};

// Validates and enqueues one grouped GEMM.
void grouped_gemm(const GroupedGemmParams& params, cudaStream_t stream);

// The tile kAuto resolves to for these sizes (for benchmarks and tests).
GemmTile grouped_gemm_auto_tile(int64_t num_rows, int64_t num_experts, int64_t n,
                                GemmEpilogue epilogue);

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
};

// The experts stage: activation = SiLU(rows . gate^T) * (rows . up^T) (or the clamped SwiGLU,
// biases added first where given), out = activation . down^T (+ down_bias), two launches, the
// second a programmatic dependent of the first.
void moe_experts(const MoeExpertsParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
