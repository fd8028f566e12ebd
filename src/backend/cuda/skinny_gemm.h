// Host interface of the skinny GEMM: y = x . w^T for a handful of rows (decode's dense
// projections at batch <= kSkinnyGemmMaxRows: QKV, O, the router, the LM head), where the
// product is a read of the weights and nothing else. It streams each weight row once for all the
// rows of x, as a bandwidth-bound matrix-vector product, in one kernel that is a programmatic
// dependent of the kernel before it (programmatic_launch.h): its blocks start while that kernel
// finishes, prefetch their weight rows into L2, and wait for it only before reading x.
//
// Layouts (glossary: M rows, N output columns, K reduction dim):
//   x     [M, K]  bf16, row stride ldx
//   w     [N, K]  bf16, row-major (a Linear's weight)
//   w_lo  [N, K]  bf16 or null: a second weight term (a float32 checkpoint held as hi + lo);
//                 both terms' products are summed in the same float32 accumulators
//   y     [M, N]  float32 (y_f32) or bf16, row stride ldy
// Each output is a float32 sum over K in an order fixed by K alone (a lane's strided partial
// sums, then a warp's butterfly), rounded once.
//
// Requirements (the launcher names the offending value): 1 <= M <= kSkinnyGemmMaxRows,
// N >= 1, K a positive multiple of 8, ldx a multiple of 8 and x, w, w_lo 16-byte aligned
// (16-byte loads), N * K < 2^31. The weights must not be written by the kernels before it on the
// stream: the kernel loads its first weight vectors before it waits for them (a model's weights
// are written once, at load).
//
// The decode RMSNorm folded in: x null and `norm` (fused_add_rms_norm's own RmsNormParams, M rows
// of K) set, the kernel forms the M rows of x itself from the residual stream with that norm's
// float32 operations in its order (its bits), in shared memory, and the launch that would have
// run that norm alone is saved. norm.residual_out must not overlap norm.residual or norm.x:
// every block reads all of them while the blocks write it. Every block forms
// all M rows (a few KB read from L2, while its first weight vectors are already in flight); the
// blocks together write the normed rows and the residual sum out for the kernels after it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/expert_quant.h"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

inline constexpr int64_t kSkinnyGemmMaxRows = 8;
// The shared memory the folded norm's rows may take (M * K bf16 values): within the 48 KiB a
// block has without opting in, beside the norm's own sums.
inline constexpr int64_t kSkinnyNormedInputBytes = 46 * 1024;

struct SkinnyGemmParams {
  const __nv_bfloat16* x = nullptr;     // [M, K], or null with norm.weight set
  const __nv_bfloat16* w = nullptr;     // [N, K]
  const __nv_bfloat16* w_lo = nullptr;  // [N, K] or null
  void* y = nullptr;                    // [M, N]
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t ldx = 0;  // elements; 0: k
  int64_t ldy = 0;  // elements; 0: n
  bool y_f32 = false;
  RmsNormParams norm;  // x formed in the kernel (norm.out written too) where norm.weight is set
  // Bytes of each weight row asked of L2 before the wait: set by the launcher from
  // weight_prefetch_bytes() (programmatic_launch.h), not by callers.
  int64_t prefetch_row_bytes = 0;
};

// Whether skinny_gemm takes these sizes and pointers (everything the launcher checks).
bool skinny_gemm_supports(const SkinnyGemmParams& params);

// Validates and enqueues y = x . (w + w_lo)^T.
void skinny_gemm(const SkinnyGemmParams& params, cudaStream_t stream);

// The same product with w a quantised matrix (a dense Linear held as codes and scales,
// --weights-scope linear or a block-scaled fp8 / GPTQ / AWQ checkpoint's dense matrices): one
// slab in expert_quant.h's layout, fp8 or int4 with a scale (and zero point) per `group` inputs
// of a row. Each lane loads 16 bytes of a weight row's codes at a time (16 fp8 or 32 int4
// values) and dequantises them 8 at a time in registers with the expert GEMM's own functions
// (expert_dequant.cuh: the same bf16 value as everywhere else), then takes them against the
// same 8 values of every row of x in float32, as the bf16 kernel: each weight row streamed once
// for all rows of x, each output a sum in an order fixed by K (a lane's chunks in order, a
// warp's butterfly), rounded once; launched as a programmatic dependent that prefetches its
// weight rows into L2 first.
//
// Requirements (the launcher names the offending value): 1 <= M <= kSkinnyGemmMaxRows, N >= 1,
// format kFp8 or kInt4, group a positive multiple of 8, K a positive multiple of 16 (fp8) or
// 32 (int4) so that every row's codes start 16-byte aligned, ldx a multiple of 8, x and w
// 16-byte aligned, N * K < 2^31.
struct QuantSkinnyGemmParams {
  const __nv_bfloat16* x = nullptr;  // [M, K], or null with norm.weight set
  const uint8_t* w = nullptr;        // one slab: quant_matrix_layout(format, N, K, group)
  ExpertQuant format = ExpertQuant::kFp8;
  int64_t group = 0;
  void* y = nullptr;  // [M, N]
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t ldx = 0;  // elements; 0: k
  int64_t ldy = 0;  // elements; 0: n
  bool y_f32 = false;
  RmsNormParams norm;  // x formed in the kernel (norm.out written too) where norm.weight is set
  // Bytes of each weight row asked of L2 before the wait: set by the launcher from
  // weight_prefetch_bytes() (programmatic_launch.h), not by callers.
  int64_t prefetch_row_bytes = 0;
};

// Whether quant_skinny_gemm takes these sizes, pointers and format.
bool quant_skinny_gemm_supports(const QuantSkinnyGemmParams& params);

// Validates and enqueues y = x . dequant(w)^T.
void quant_skinny_gemm(const QuantSkinnyGemmParams& params, cudaStream_t stream);

// The other path of a quantised dense matrix (prefill, larger batches, --deterministic): its
// values as a bf16 [N, K] matrix, each the bf16 value the skinny kernel and the expert GEMM form,
// for the bf16 GEMMs to read. A bandwidth-bound kernel, one 8-value chunk a thread.
// Requirements: format kFp8 or kInt4, group a positive multiple of 8, K a positive multiple of
// 8, w and out 16-byte aligned, N * K < 2^40.
struct DequantizeMatrixParams {
  const uint8_t* w = nullptr;  // one slab: quant_matrix_layout(format, N, K, group)
  ExpertQuant format = ExpertQuant::kFp8;
  int64_t group = 0;
  int64_t n = 0;
  int64_t k = 0;
  __nv_bfloat16* out = nullptr;  // [N, K]
};
void dequantize_matrix(const DequantizeMatrixParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
