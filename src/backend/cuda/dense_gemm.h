// Host interface of the fixed-order dense GEMM: the matrix products of `--deterministic` on the
// GPU (the dense projections, the LM head, MLA's absorbed per-head products), in place of
// cuBLAS, whose heuristics pick another kernel, tile or split-K for another row count, so that
// a row's result there depends on how many rows share its product.
//
// Here every output element is the same chain whatever M, the tile and the other rows: one
// float32 accumulator, zero at the start, takes one mma.sync m16n8k16 per 16 values of the
// reduction dim, in increasing order, ceil(K / 16) of them (the tail zero-filled). Nothing
// splits K, between blocks or warps. A row's values therefore depend on its own inputs and the
// weights alone, which tests/cuda/cuda_dense_gemm_test.cpp checks bit for bit (a row alone, in
// batches of other sizes, at other positions, under every tile). The tile only changes which
// block computes an element, so the launcher may pick it by M.
//
// Layouts (glossary: M rows, N output columns, K reduction dim; one batch entry shown):
//   a  [M, K]   bf16, row stride lda
//   b  kNK: [N, K] bf16, row stride ldb (y = a b^T, a Linear's weight)
//      kKN: [K, N] bf16, row stride ldb (y = a b)
//   c  [M, N]   float32 or bf16, row stride ldc; only [M, N] is written
// Batches (MLA's per-head products) add batch_stride_{a,b,c} elements per entry.
//   b_lo        as b (same layout and strides), or null: a second weight term (a float32
//               checkpoint held as hi + lo bf16); each element's chain runs on over the same K
//               with b_lo after b, in the same order whatever M.
//
// Any M, N, K >= 1 and any strides and alignments: 16-byte loads where the rows allow them,
// element loads elsewhere. Nothing is read back from the device, so a launch can be captured.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeinfer::cuda {

enum class DenseLayout : int32_t { kNK, kKN };

// kAuto: the 16-row tile up to 16 rows (decode: many narrow blocks stream the weights), the
// 64 x 128 tile above. Every tile gives the same bits (see above); the choice is speed only.
enum class DenseTile : int32_t { kAuto, kRows16, kRows64 };

struct DenseGemmParams {
  const __nv_bfloat16* a = nullptr;  // [batch][M, K]
  const __nv_bfloat16* b = nullptr;  // [batch][N, K] (kNK) or [batch][K, N] (kKN)
  const __nv_bfloat16* b_lo = nullptr;  // as b, or null
  void* c = nullptr;                 // [batch][M, N] float32 (c_f32) or bf16
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  int64_t lda = 0;  // elements; 0: k
  int64_t ldb = 0;  // 0: k (kNK) or n (kKN)
  int64_t ldc = 0;  // 0: n
  DenseLayout b_layout = DenseLayout::kNK;
  bool c_f32 = false;
  int64_t batch = 1;
  int64_t batch_stride_a = 0;
  int64_t batch_stride_b = 0;
  int64_t batch_stride_c = 0;
  DenseTile tile = DenseTile::kAuto;
};

// Validates and enqueues c = a . b^T (kNK) or a . b (kKN) for every batch entry.
void dense_gemm(const DenseGemmParams& params, cudaStream_t stream);

// The tile kAuto resolves to for m rows.
DenseTile dense_gemm_auto_tile(int64_t m);

}  // namespace moeinfer::cuda
