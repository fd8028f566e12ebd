// The skinny GEMM kernel (skinny_gemm.h). A warp owns C output columns (1 or 2, the launcher's
// choice: enough blocks to give every SM two): its lanes stride over K in 16-byte vectors (8
// values), each vector of a weight row loaded once and taken against the same vector of all M
// rows of x (which the M rows' reads share through L1), float32 partial sums per (row, column) in
// registers, then one butterfly per sum. A lane loads a batch of kSkinnyVectorsInFlight weight
// vectors before it multiplies any: at decode a warp's few kilobytes of weights are otherwise a
// chain of dependent round trips to HBM, one per vector of K, and the kernel is bound by their
// latency instead of the bandwidth. The batch changes no sum's order.
// A lane's first batch is loaded before the kernel waits for the one before it (the weights are
// not that kernel's output), so at decode the first bytes' round trip overlaps that kernel's tail
// instead of following it.
// With the decode RMSNorm folded in (SkinnyGemmParams::norm), each block first forms the M rows of
// x in shared memory (form_normed_rows: fused_add_rms_norm's operations in its order, so its bits)
// while that first batch is in flight, and the lanes read x from there.
// The quantised variant (quant_skinny_gemm_kernel) keeps the grid (1 or 2 columns a warp, the
// same choice), the warps, the batch of loads in flight and the order of the sums; a lane's 16-byte
// load then holds 16 fp8 or 32 int4 codes of a weight row, dequantised 8 at a time in registers
// (expert_dequant.cuh) into the bf16 values the expert GEMM forms, so it streams half or a quarter
// of the bytes for the same products. dequantize_matrix_kernel writes those bf16 values out for the
// GEMMs of larger steps.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/expert_dequant.cuh"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/skinny_gemm.h"

namespace moeinfer::cuda {

inline constexpr int kSkinnyWarps = 8;
inline constexpr int kSkinnyThreads = kSkinnyWarps * device::kWarpSize;
inline constexpr int kSkinnyColumnsPerWarp = 2;  // at most; the launcher takes 1 for small N
// 16-byte weight vectors a lane has in flight (over its columns and weight terms).
inline constexpr int kSkinnyVectorsInFlight = 8;

namespace skinny {

__device__ __forceinline__ void fma8(const uint4& w, const uint4& x, float& acc) {
  float a[8], b[8];
  device::bf16x8_to_float(w, a);
  device::bf16x8_to_float(x, b);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = fmaf(a[i], b[i], acc);
}

// A row of x's 16-byte vector: through the read-only path from global memory, or from the rows
// the block formed in shared memory.
template <bool XShared>
__device__ __forceinline__ uint4 load_x(const uint4* x) {
  if constexpr (XShared) {
    return *x;
  } else {
    return __ldg(x);
  }
}

// Where x's rows are: global memory (ldx apart) or the block's shared rows (K apart).
struct XRows {
  const uint4* base = nullptr;
  int vecs_apart = 0;  // 16-byte vectors from one row to the next
};

// The warp's C weight rows (and their lo terms), and the batch of vectors a lane loads at once.
template <bool TwoTerms, int C>
struct WeightRows {
  static constexpr int kBatch = kSkinnyVectorsInFlight / (C * (TwoTerms ? 2 : 1));
  const uint4* w[C];
  const uint4* w_lo[C];
  int vecs = 0;

  __device__ __forceinline__ WeightRows(const SkinnyGemmParams& p, int col0) {
    vecs = static_cast<int>(p.k / device::kBf16PerVec);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      // A column past N reads column N - 1 again and is not stored.
      const int64_t col = min(col0 + c, static_cast<int>(p.n) - 1);
      w[c] = reinterpret_cast<const uint4*>(p.w) + col * vecs;
      w_lo[c] = TwoTerms ? reinterpret_cast<const uint4*>(p.w_lo) + col * vecs : nullptr;
    }
  }

  // Vectors v0, v0 + 32, ... (kBatch of them, those below vecs) of each row.
  __device__ __forceinline__ void load(int v0, uint4 (&wv)[kBatch][C],
                                       uint4 (&lo)[kBatch][C]) const {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int v = v0 + b * device::kWarpSize;
      if (v >= vecs) break;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        wv[b][c] = device::load_streamed(w[c] + v);
        if constexpr (TwoTerms) lo[b][c] = device::load_streamed(w_lo[c] + v);
      }
    }
  }
};

// One lane's part of the warp's C columns against every row: vectors v = lane, lane + 32, ...,
// kBatch at a time and summed in that order; the batch at v = lane is in wv / lo already (loaded
// before the kernel's wait), each later one is loaded when the one before it is summed.
template <int M, bool TwoTerms, int C, bool XShared>
__device__ __forceinline__ void partial_sums(const WeightRows<TwoTerms, C>& rows, const XRows& x,
                                             int lane,
                                             uint4 (&wv)[WeightRows<TwoTerms, C>::kBatch][C],
                                             uint4 (&lo)[WeightRows<TwoTerms, C>::kBatch][C],
                                             float (&acc)[M][C]) {
  constexpr int kBatch = WeightRows<TwoTerms, C>::kBatch;
  for (int v0 = lane; v0 < rows.vecs; v0 += device::kWarpSize * kBatch) {
    if (v0 != lane) rows.load(v0, wv, lo);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int v = v0 + b * device::kWarpSize;
      if (v >= rows.vecs) break;
#pragma unroll
      for (int r = 0; r < M; ++r) {
        const uint4 xv = load_x<XShared>(x.base + static_cast<int64_t>(r) * x.vecs_apart + v);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          fma8(wv[b][c], xv, acc[r][c]);
          if constexpr (TwoTerms) fma8(lo[b][c], xv, acc[r][c]);
        }
      }
    }
  }
}

// The M rows of x formed from `n` into `rows` (shared memory, M x vecs 16-byte vectors), with
// fused_add_rms_norm_kernel's float32 operations in its order: that kernel's thread t
// (rms_norm_layout: `threads` of them) sums the squares of its vectors t + j * threads in j
// order, its warps' sums are butterflies and the block's total is warp 0's butterfly over the
// warps' sums. Here thread t takes that kernel's threads t, t + 256, ... (the same lanes, so the
// same butterflies), warp r totals row r, and the rows come out bit for bit as that kernel's.
// Each block writes residual_out and out at the vectors v with v % gridDim.x equal to its
// index. Every thread of the block must call it; it ends with the rows visible to all of them.
template <int M>
__device__ __forceinline__ void form_normed_rows(const RmsNormParams& n, int64_t k, uint4* rows) {
  static_assert(M <= kSkinnyWarps, "a warp totals each row");
  __shared__ float partials[M][device::kWarpSize];
  __shared__ float inv_rms[M];
  const int vecs = static_cast<int>(k / device::kBf16PerVec);
  const RmsNormLayout layout = rms_norm_layout(vecs);
  const int warp = static_cast<int>(threadIdx.x) / device::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % device::kWarpSize;
  auto form_sum = [&](int r, int v, float(&s)[8]) {
    if (n.x != nullptr) {
      device::load_float8(n.x + r * k, v, s);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = 0.0f;
    }
    if (n.residual != nullptr) {
      float t[8];
      device::load_float8(n.residual + r * k, v, t);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += t[i];
    }
    if (n.x_bias != nullptr) {
      float b[8];
      device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(n.x_bias) + v), b);
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] += b[i];
    }
  };
#pragma unroll
  for (int r = 0; r < M; ++r) {
    // Whole warps of the norm kernel's threads at a time (its count is a multiple of 32).
    for (int t = static_cast<int>(threadIdx.x); t - lane < layout.threads; t += kSkinnyThreads) {
      float sum_sq = 0.0f;
      for (int j = 0; j < layout.groups; ++j) {
        const int v = t + j * layout.threads;
        if (v >= vecs) break;
        float s[8];
        form_sum(r, v, s);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum_sq = fmaf(s[i], s[i], sum_sq);
      }
      sum_sq = device::warp_sum(sum_sq);
      if (lane == 0) partials[r][t / device::kWarpSize] = sum_sq;
    }
  }
  __syncthreads();
  if (warp < M) {
    float total = lane < layout.threads / device::kWarpSize ? partials[warp][lane] : 0.0f;
    total = device::warp_sum(total);
    const float mean_width = static_cast<float>(n.mean_width > 0 ? n.mean_width : k);
    if (lane == 0) inv_rms[warp] = 1.0f / sqrtf(total / mean_width + n.eps);
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < M; ++r) {
    for (int v = static_cast<int>(threadIdx.x); v < vecs; v += kSkinnyThreads) {
      float s[8], w[8];
      form_sum(r, v, s);
      const bool mine = v % static_cast<int>(gridDim.x) == static_cast<int>(blockIdx.x);
      if (mine && n.residual_out != nullptr) device::store_float8(n.residual_out + r * k, v, s);
      device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(n.weight) + v), w);
      if (n.weight_lo != nullptr) {
        float w_lo[8];
        device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(n.weight_lo) + v), w_lo);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] += w_lo[i];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = w[i] * (s[i] * inv_rms[r]);
      const uint4 x = device::float_to_bf16x8(s);
      rows[r * vecs + v] = x;
      if (mine && n.out != nullptr) reinterpret_cast<uint4*>(n.out + r * k)[v] = x;
    }
  }
  __syncthreads();
}

// Word i of a 16-byte vector (i a constant once unrolled: a register, not a local array).
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// The scale group of input k: k / group, by a shift where group is a power of two (every group
// the loaders make: 128, GPTQ's 32 to 128, the fixtures' 8), a division otherwise (a uniform
// branch). A 32-bit division is some twenty instructions, once per 8 values.
struct GroupIndex {
  int group = 0;
  int shift = -1;  // log2(group), or -1
  __device__ __forceinline__ explicit GroupIndex(int g) : group(g) {
    if ((g & (g - 1)) != 0) return;
    shift = 0;
    while ((1 << shift) < g) ++shift;
  }
  __device__ __forceinline__ int of(int k) const { return shift >= 0 ? k >> shift : k / group; }
};

// Values a lane's 16-byte load of quantised codes holds: 16 fp8 codes, 32 int4 ones.
template <ExpertQuant Q>
inline constexpr int kQuantValuesPerLoad = Q == ExpertQuant::kFp8 ? 16 : 32;

// The warp's C rows of quantised codes, and the batch of 16-byte code loads a lane has in flight
// (kSkinnyVectorsInFlight over its columns, as the bf16 kernel's).
template <int M, ExpertQuant Q, int C>
struct QuantRows {
  static constexpr int kValues = kQuantValuesPerLoad<Q>;
  // Past 4 rows a load carries more than twice the work and the accumulators crowd the registers
  // (128 a thread): half the batch, no spills.
  static constexpr int kBatch = kSkinnyVectorsInFlight / C / (M > 4 ? 2 : 1);
  int col[C];
  const uint4* w[C];
  int loads = 0;

  __device__ __forceinline__ QuantRows(const QuantSkinnyGemmParams& p,
                                       const QuantMatrixLayout& layout, int col0) {
    loads = static_cast<int>(p.k / kValues);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      // A column past N reads column N - 1 again and is not stored.
      col[c] = min(col0 + c, static_cast<int>(p.n) - 1);
      w[c] = reinterpret_cast<const uint4*>(p.w +
                                            static_cast<int64_t>(col[c]) * layout.row_code_bytes);
    }
  }

  // Loads l0, l0 + 32, ... (kBatch of them, those below loads) of each row.
  __device__ __forceinline__ void load(int l0, uint4 (&codes)[kBatch][C]) const {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int l = l0 + b * device::kWarpSize;
      if (l >= loads) break;
#pragma unroll
      for (int c = 0; c < C; ++c) codes[b][c] = device::load_streamed(w[c] + l);
    }
  }
};

// The quantised kernel's part of a lane: 16-byte code loads l = lane, lane + 32, ... of each of
// the warp's C weight rows, a batch in flight at a time (the one at l = lane in `codes` already,
// loaded before the kernel's wait), each split in chunks of 8 values, dequantised to bf16 in
// registers (expert_dequant.cuh) and taken against the same 8 values of every row of x, in that
// order.
template <int M, ExpertQuant Q, int C, bool XShared>
__device__ __forceinline__ void quant_partial_sums(
    const QuantSkinnyGemmParams& p, const QuantMatrixLayout& layout, const QuantRows<M, Q, C>& rows,
    const XRows& x, int lane, uint4 (&codes)[QuantRows<M, Q, C>::kBatch][C], float (&acc)[M][C]) {
  using Rows = QuantRows<M, Q, C>;
  constexpr int kChunks = Rows::kValues / device::kBf16PerVec;
  const GroupIndex group(static_cast<int>(p.group));
  const float* scales = reinterpret_cast<const float*>(p.w + layout.scale_offset);
  const float* zeros = reinterpret_cast<const float*>(p.w + layout.zero_offset);
  for (int l0 = lane; l0 < rows.loads; l0 += device::kWarpSize * Rows::kBatch) {
    if (l0 != lane) rows.load(l0, codes);
#pragma unroll
    for (int b = 0; b < Rows::kBatch; ++b) {
      const int l = l0 + b * device::kWarpSize;
      if (l >= rows.loads) break;
#pragma unroll
      for (int j = 0; j < kChunks; ++j) {
        const int k = l * Rows::kValues + j * device::kBf16PerVec;
        uint4 wv[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const int64_t g = static_cast<int64_t>(rows.col[c]) * layout.groups_per_row + group.of(k);
          expert_dequant::QuantChunk chunk{};
          if constexpr (Q == ExpertQuant::kFp8) {
            chunk.codes = make_uint2(word_of(codes[b][c], 2 * j), word_of(codes[b][c], 2 * j + 1));
          } else {
            chunk.codes.x = word_of(codes[b][c], j);
            chunk.zero = __ldg(zeros + g);
          }
          chunk.scale = __ldg(scales + g);
          wv[c] = expert_dequant::dequantize_chunk<Q>(chunk);
        }
#pragma unroll
        for (int r = 0; r < M; ++r) {
          const uint4 xv = load_x<XShared>(x.base + static_cast<int64_t>(r) * x.vecs_apart +
                                           k / device::kBf16PerVec);
#pragma unroll
          for (int c = 0; c < C; ++c) fma8(wv[c], xv, acc[r][c]);
        }
      }
    }
  }
}

// The first `bytes` of each of the warp's weight rows [col0, col0 + C) (past n: none), row_bytes
// each, asked of L2 one 128-byte line a prefetch.
template <int C>
__device__ __forceinline__ void prefetch_rows(const uint8_t* w, int64_t row_bytes, int64_t bytes,
                                              int col0, int64_t n, int lane) {
  const int rows = min(col0 + C, static_cast<int>(n)) - col0;
  const int64_t ahead = min(bytes, row_bytes);
  for (int r = 0; r < rows; ++r)
    device::prefetch_to_l2(w + static_cast<int64_t>(col0 + r) * row_bytes, ahead, lane);
}

// The butterfly of each (row, column) sum; every lane ends with every sum, and lane r * C + c
// stores (row r, column c) as float32 or bf16.
template <int M, int C>
__device__ __forceinline__ void store_sums(void* y, int64_t ldy, int64_t n, bool y_f32, int col0,
                                           int lane, float (&acc)[M][C]) {
#pragma unroll
  for (int r = 0; r < M; ++r) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const float sum = device::warp_sum(acc[r][c]);
      const int col = col0 + c;
      if (lane == r * C + c && col < n) {
        const int64_t at = static_cast<int64_t>(r) * ldy + col;
        if (y_f32) {
          static_cast<float*>(y)[at] = sum;
        } else {
          static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(sum);
        }
      }
    }
  }
}

}  // namespace skinny

// Where the lanes read x: the rows in memory, or (Normed) the block's dynamic shared memory after
// form_normed_rows has filled it.
template <int M, bool Normed, typename Params>
__device__ __forceinline__ skinny::XRows x_rows(const Params& p, uint4* shared_rows) {
  if constexpr (Normed) {
    skinny::form_normed_rows<M>(p.norm, p.k, shared_rows);
    return {shared_rows, static_cast<int>(p.k / device::kBf16PerVec)};
  } else {
    return {reinterpret_cast<const uint4*>(p.x), static_cast<int>(p.ldx / device::kBf16PerVec)};
  }
}

template <int M, bool TwoTerms, int C, bool Normed>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    skinny_gemm_kernel(const __grid_constant__ SkinnyGemmParams p) {
  extern __shared__ uint4 shared_rows[];  // [M, K / 8] when Normed
  using Rows = skinny::WeightRows<TwoTerms, C>;
  const int warp = static_cast<int>(threadIdx.x) / device::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % device::kWarpSize;
  const int col0 = (static_cast<int>(blockIdx.x) * kSkinnyWarps + warp) * C;
  const bool has_columns = col0 < p.n;
  // The weights are not written by the kernels before this one: their first vectors load (and,
  // with prefetch_row_bytes, more of each row goes to L2) while that kernel finishes (launched as
  // a programmatic dependent; otherwise at once).
  const Rows rows(p, col0);
  uint4 wv[Rows::kBatch][C], lo[Rows::kBatch][C];
  if (has_columns) {
    rows.load(lane, wv, lo);
    if (p.prefetch_row_bytes > 0) {
      skinny::prefetch_rows<C>(reinterpret_cast<const uint8_t*>(p.w), p.k * 2, p.prefetch_row_bytes,
                               col0, p.n, lane);
    }
  }
  device::start_after_previous_grid();  // x (or the norm's inputs) may be its output
  const skinny::XRows x = x_rows<M, Normed>(p, shared_rows);
  if (!has_columns) return;

  float acc[M][C] = {};
  skinny::partial_sums<M, TwoTerms, C, Normed>(rows, x, lane, wv, lo, acc);
  skinny::store_sums<M, C>(p.y, p.ldy, p.n, p.y_f32, col0, lane, acc);
}

// y = x . dequant(w)^T (QuantSkinnyGemmParams): the bf16 kernel's grid, warps, first loads before
// the wait, folded norm and stores; the weights are a quantised slab of codes and scales.
template <int M, ExpertQuant Q, int C, bool Normed>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    quant_skinny_gemm_kernel(const __grid_constant__ QuantSkinnyGemmParams p) {
  extern __shared__ uint4 shared_rows[];  // [M, K / 8] when Normed
  using Rows = skinny::QuantRows<M, Q, C>;
  const int warp = static_cast<int>(threadIdx.x) / device::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % device::kWarpSize;
  const int col0 = (static_cast<int>(blockIdx.x) * kSkinnyWarps + warp) * C;
  const bool has_columns = col0 < p.n;
  const QuantMatrixLayout layout = quant_matrix_layout(Q, p.n, p.k, p.group);
  const Rows rows(p, layout, col0);
  uint4 codes[Rows::kBatch][C];
  if (has_columns) {
    rows.load(lane, codes);
    if (p.prefetch_row_bytes > 0) {
      skinny::prefetch_rows<C>(p.w, layout.row_code_bytes, p.prefetch_row_bytes, col0, p.n, lane);
    }
  }
  device::start_after_previous_grid();  // x (or the norm's inputs) may be its output
  const skinny::XRows x = x_rows<M, Normed>(p, shared_rows);
  if (!has_columns) return;

  float acc[M][C] = {};
  skinny::quant_partial_sums<M, Q, C, Normed>(p, layout, rows, x, lane, codes, acc);
  skinny::store_sums<M, C>(p.y, p.ldy, p.n, p.y_f32, col0, lane, acc);
}

// dequant(w) as bf16 [N, K] (DequantizeMatrixParams): a block per row at a time, a thread per
// 8-value chunk of it (no division by the row length); the codes and the scale of a chunk read
// as fetch_quant_chunk reads them, the values formed by dequantize_chunk.
template <ExpertQuant Q>
__global__ void dequantize_matrix_kernel(const __grid_constant__ DequantizeMatrixParams p) {
  const QuantMatrixLayout layout = quant_matrix_layout(Q, p.n, p.k, p.group);
  const int chunks_per_row = static_cast<int>(p.k / device::kBf16PerVec);
  const skinny::GroupIndex group(static_cast<int>(p.group));
  const float* scales = reinterpret_cast<const float*>(p.w + layout.scale_offset);
  const float* zeros = reinterpret_cast<const float*>(p.w + layout.zero_offset);
  device::start_after_previous_grid();  // the scratch may still be read by the kernel before
  for (int64_t row = blockIdx.x; row < p.n; row += gridDim.x) {
    const uint8_t* codes = p.w + row * layout.row_code_bytes;
    uint4* out = reinterpret_cast<uint4*>(p.out) + row * chunks_per_row;
    for (int c = static_cast<int>(threadIdx.x); c < chunks_per_row;
         c += static_cast<int>(blockDim.x)) {
      const int k = c * device::kBf16PerVec;
      const int64_t g = row * layout.groups_per_row + group.of(k);
      expert_dequant::QuantChunk chunk{};
      if constexpr (Q == ExpertQuant::kFp8) {
        chunk.codes = __ldg(reinterpret_cast<const uint2*>(codes + k));
      } else {
        chunk.codes.x = __ldg(reinterpret_cast<const unsigned int*>(codes + k / 2));
        chunk.zero = __ldg(zeros + g);
      }
      chunk.scale = __ldg(scales + g);
      out[c] = expert_dequant::dequantize_chunk<Q>(chunk);
    }
  }
}

}  // namespace moeinfer::cuda
