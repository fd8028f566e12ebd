// The grouped skinny kernel (GemmTile::kSkinny, grouped_gemm.h): the experts' products at
// decode, where an expert meets one row or a few and the product is a read of its weights. It is
// the skinny GEMM (skinny_gemm_kernel.cuh) per expert: no tensor cores and no shared-memory tile,
// so a quantised weight is dequantised in registers straight into the FMAs instead of being
// stored to shared memory and read back by ldmatrix.
//
// Grid: x over output columns, kGroupedSkinnyColumnsPerBlock a block; y over the M plan rows.
// Block (x, slot) works when `slot` starts a run of up to R rows of one expert (the expert's
// first row, or every R-th after it; R is kGroupedSkinnyRows, or 1 where the caller knows each
// expert has one row: a quarter of the accumulators, more blocks an SM); the others exit at once.
// A warp owns kGroupedSkinnyColumnsPerWarp output columns (with a gated epilogue, their gate and
// up weight rows): its lanes stride over K in chunks of 8 inputs, each weight chunk loaded once
// and taken against the run's rows, float32 partial sums per (row, weight row), then a butterfly.
// Each output is a float32 sum over K in an order fixed by K alone, rounded once, so a row's
// result does not depend on the rows beside it; the mma.sync tiles sum in another order, which
// is why kAuto does not take this kernel under batch_invariant (a row would differ between a
// small step and a large one).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/expert_dequant.cuh"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/gated_activation.cuh"
#include "backend/cuda/grouped_gemm.h"

namespace moeinfer::cuda {

inline constexpr int kGroupedSkinnyWarps = 8;
inline constexpr int kGroupedSkinnyThreads = kGroupedSkinnyWarps * device::kWarpSize;
inline constexpr int kGroupedSkinnyColumnsPerWarp = 2;
inline constexpr int kGroupedSkinnyColumnsPerBlock =
    kGroupedSkinnyWarps * kGroupedSkinnyColumnsPerWarp;
inline constexpr int kGroupedSkinnyRows = 4;  // rows of one expert a block takes

namespace grouped_skinny {

// Inputs k .. k + 7 of weight row `w_row` as float32: bf16 loaded, or codes dequantised to the
// bf16 value the tiles multiply (expert_dequant.cuh), so both paths use the same weights.
template <ExpertQuant Q>
__device__ __forceinline__ void load8(const uint8_t* base, const QuantMatrixLayout& layout,
                                      int group, int w_row, int k, int K, float (&w)[8]) {
  if constexpr (Q == ExpertQuant::kNone) {
    const auto* row =
        reinterpret_cast<const __nv_bfloat16*>(base) + static_cast<int64_t>(w_row) * K;
    device::bf16x8_to_float(device::load_streamed(row + k), w);
  } else {
    device::bf16x8_to_float(
        expert_dequant::dequantize_chunk<Q>(
            expert_dequant::fetch_quant_chunk<Q>(base, layout, group, w_row, k)),
        w);
  }
}

}  // namespace grouped_skinny

// R: the rows of one expert a block takes, kGroupedSkinnyRows or 1 (one_row_per_expert).
template <bool Gated, ExpertQuant Q, int R>
__global__ void __launch_bounds__(kGroupedSkinnyThreads)
    grouped_skinny_kernel(const __grid_constant__ GroupedGemmParams p) {
  constexpr int kOps = Gated ? 2 : 1;
  constexpr int C = kGroupedSkinnyColumnsPerWarp;
  constexpr int kWeightRows = kOps * C;
  const int slot = static_cast<int>(blockIdx.y);
  const int E = static_cast<int>(p.num_experts);
  // The expert whose rows hold `slot`, found by the block's threads side by side (one round of
  // independent loads for E <= 256, not a chain of dependent ones). The offsets are not written
  // by a kernel this one overlaps (GroupedGemmParams::overlap_previous), so this comes before
  // waiting for it.
  __shared__ int s_run[3];  // expert (-1: none, a bucket's padding row), first row, end row
  if (threadIdx.x == 0) s_run[0] = -1;
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < E; e += kGroupedSkinnyThreads) {
    const int begin = __ldg(p.expert_offsets + e), end = __ldg(p.expert_offsets + e + 1);
    if (begin <= slot && slot < end) {
      s_run[0] = e;
      s_run[1] = begin;
      s_run[2] = end;
    }
  }
  __syncthreads();
  const int expert = s_run[0];
  if (expert < 0 || (slot - s_run[1]) % R != 0) return;
  const int num_rows = min(R, s_run[2] - slot);

  const int N = static_cast<int>(p.n);
  const int K = static_cast<int>(p.k);
  const QuantMatrixLayout layout =
      quant_matrix_layout(Q, kOps * static_cast<int64_t>(N), K, p.quant_group);
  const int64_t term_bytes = static_cast<int64_t>(kOps) * N * K * 2;  // one bf16 term
  const uint8_t* base =
      p.expert_weights != nullptr
          ? reinterpret_cast<const uint8_t*>(p.expert_weights[expert])
          : reinterpret_cast<const uint8_t*>(p.weights) +
                expert * (Q != ExpertQuant::kNone ? layout.bytes : p.weight_terms * term_bytes);
  // A null table entry: the expert computes elsewhere (the host) and its rows are left alone.
  if (base == nullptr) return;

  const int warp = static_cast<int>(threadIdx.x) / device::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % device::kWarpSize;
  const int col0 = (static_cast<int>(blockIdx.x) * kGroupedSkinnyWarps + warp) * C;
  auto weight_row = [&](int j) { return (j / C) * N + col0 + j % C; };  // gate rows, then up
  // The warp's weight rows are read by nothing before this kernel: the first
  // prefetch_row_bytes of each may go to L2 while the previous kernel finishes.
  const int64_t row_bytes = Q == ExpertQuant::kNone ? int64_t{K} * 2 : layout.row_code_bytes;
  const int64_t ahead = min(p.prefetch_row_bytes, row_bytes);
#pragma unroll
  for (int j = 0; j < kWeightRows; ++j) {
    device::prefetch_to_l2(base + weight_row(j) * row_bytes, ahead, lane);
  }
  device::start_after_previous_grid();  // the rows may be the previous kernel's output

  const uint4* x[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = slot + min(r, num_rows - 1);
    const int source =
        p.src_row != nullptr ? __ldg(p.src_row + row) / static_cast<int>(p.top_k) : row;
    x[r] = reinterpret_cast<const uint4*>(p.rows + static_cast<int64_t>(source) * K);
  }
  float acc[R][kWeightRows];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < kWeightRows; ++j) acc[r][j] = 0.0f;

  const int group = static_cast<int>(p.quant_group);
  const int vecs = K / device::kBf16PerVec;
  const int terms = Q == ExpertQuant::kNone ? static_cast<int>(p.weight_terms) : 1;
  for (int term = 0; term < terms; ++term) {
    const uint8_t* term_base = base + term * term_bytes;
#pragma unroll 2
    for (int v = lane; v < vecs; v += device::kWarpSize) {
      float w[kWeightRows][8];
#pragma unroll
      for (int j = 0; j < kWeightRows; ++j) {
        grouped_skinny::load8<Q>(term_base, layout, group, weight_row(j), v * 8, K, w[j]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= num_rows) break;
        float xv[8];
        device::bf16x8_to_float(__ldg(x[r] + v), xv);
#pragma unroll
        for (int j = 0; j < kWeightRows; ++j)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][j] = fmaf(w[j][i], xv[i], acc[r][j]);
      }
    }
  }

  const float* bias =
      p.bias != nullptr ? p.bias + static_cast<int64_t>(expert) * kOps * N : nullptr;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= num_rows) break;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int col = col0 + c;
      float value = device::warp_sum(acc[r][c]);
      if (bias != nullptr) value += __ldg(bias + col);
      if constexpr (Gated) {
        float up = device::warp_sum(acc[r][C + c]);
        if (bias != nullptr) up += __ldg(bias + N + col);
        value = p.epilogue == GemmEpilogue::kClampedSwiglu
                    ? gated::clamped_swiglu(value, up, p.swiglu_alpha, p.swiglu_limit)
                    : gated::silu_mul(value, up);
      }
      if (lane == 0) p.out[static_cast<int64_t>(slot + r) * N + col] = __float2bfloat16_rn(value);
    }
  }
}

}  // namespace moeinfer::cuda
