// Device code of the decoder's glue kernels (decoder_ops.h). All of them move little data per
// token, so each is shaped for bandwidth and for many short rows:
//
// - Element-wise row kernels (kv_cache_write, bias_clip, silu_mul, sigmoid_scale_rows): one
//   thread per kVec consecutive elements of one row over a flat grid of rows * width / kVec
//   threads, so even one token spreads over the whole row and every access is coalesced. kVec is
//   8 (one 16-byte vector) when the launcher has seen that widths, strides and pointers allow it,
//   1 otherwise (odd widths, misaligned sub-rows); the math is the same code for both. The flat
//   index is a 32-bit int (the launchers check that rows * width fits), so the row/column split
//   is a 32-bit division; pointer offsets are 64-bit.
// - strided_rms_norm: rows up to kRmsNormWarpMaxWidth elements get one warp each (8 rows per
//   256-thread block; per-head q/k norms have T * heads rows of 64..256 elements), held in
//   registers between the reduction and the write. Longer rows get one block each and are read
//   twice (sum of squares, then normalise), the second read served from L1/L2, so any width
//   works without a register array sized for the worst case. Rounding as fused_add_rms_norm:
//   inv_rms = 1 / sqrtf(sum / mean_width + eps), out = bf16(w * (x * inv_rms)).
// - random_fill: grid-stride over 16-byte vectors, with the few elements before the first
//   16-byte boundary and after the last whole vector done one by one, so any pointer works.
//   out[i] = bf16(fmaf(2u - 1, scale, offset)), u = (bits >> 8) * 2^-24 in [0, 1), where bits is
//   the low (i even) or high (i odd) 32-bit half of
//     splitmix64_mix(splitmix64_mix(seed + kGolden) + (i / 2 + 1) * kGolden),
//   i.e. the (i / 2)-th output of a splitmix64 stream whose state starts at a mixed seed. One
//   64-bit hash per two elements; the value depends only on (seed, i, scale, offset).
// - quant_random_fill: grid-stride over the 32-bit words of codes of every slab (one hash each),
//   then over the scale entries; slabs are small against the grid, so no slab-level blocking.
//
// Every launch comes from host-known sizes, nothing is read back: all of it can be captured in a
// CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda {

inline constexpr int kDecoderOpsThreads = 256;
inline constexpr int kRmsNormWarpMaxWidth = 1024;  // widest row a single warp normalises
inline constexpr int kRmsNormRowsPerBlock = kDecoderOpsThreads / device::kWarpSize;
inline constexpr int kRmsNormBlockMaxThreads = 1024;
inline constexpr int kRandomFillMaxBlocks = 4096;  // grid-stride beyond ~1M threads
inline constexpr uint64_t kSplitmixGolden = 0x9E3779B97F4A7C15ull;

namespace decoder_ops {

// kVec consecutive bf16 as float32: one 16-byte access for kVec = 8 (p 16-byte aligned), one
// 2-byte access for kVec = 1.
template <int kVec>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float (&out)[kVec]) {
  static_assert(kVec == 8 || kVec == 1);
  if constexpr (kVec == 8) {
    device::bf16x8_to_float(*reinterpret_cast<const uint4*>(p), out);
  } else {
    out[0] = __bfloat162float(*p);
  }
}

// The same through the read-only path, for inputs no thread of the kernel writes.
template <int kVec>
__device__ __forceinline__ void load_ro(const __nv_bfloat16* p, float (&out)[kVec]) {
  static_assert(kVec == 8 || kVec == 1);
  if constexpr (kVec == 8) {
    device::bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(p)), out);
  } else {
    out[0] = __bfloat162float(__ldg(p));
  }
}

template <int kVec>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float (&in)[kVec]) {
  static_assert(kVec == 8 || kVec == 1);
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(p) = device::float_to_bf16x8(in);
  } else {
    *p = __float2bfloat16_rn(in[0]);
  }
}

// The flat thread index, or -1 past `total` (which the launchers keep below 2^31).
__device__ __forceinline__ int flat_index(int64_t total) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kDecoderOpsThreads + threadIdx.x;
  return idx < total ? static_cast<int>(idx) : -1;
}

__host__ __device__ __forceinline__ uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 32 random bits -> uniform in [-scale, scale) + offset, rounded once (to float) by the fma.
__device__ __forceinline__ float uniform_value(uint32_t bits, float scale, float offset) {
  const float u = static_cast<float>(bits >> 8) * 0x1p-24f;  // [0, 1), exact
  return fmaf(2.0f * u - 1.0f, scale, offset);               // 2u - 1 is exact too
}

// Start of row `row` of a strided norm: token groups of rows_per_token rows.
// w += the weight's second bf16 term (a float32 checkpoint's weight is hi + lo).
template <int kVec>
__device__ __forceinline__ void add_weight_lo(const __nv_bfloat16* lo, float (&w)[kVec]) {
  float l[kVec];
  load_ro<kVec>(lo, l);
#pragma unroll
  for (int i = 0; i < kVec; ++i) w[i] += l[i];
}

__device__ __forceinline__ int64_t norm_row_offset(const StridedRmsNormParams& p, int64_t row) {
  const int64_t token = row / p.rows_per_token;
  return token * p.token_stride + (row - token * p.rows_per_token) * p.stride;
}

}  // namespace decoder_ops

// cache[slots[t]] = src[t]; one thread per 16-byte vector of a row.
__global__ void __launch_bounds__(kDecoderOpsThreads)
    kv_cache_write_kernel(const __grid_constant__ KvWriteParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.width / device::kBf16PerVec);
  const int idx = decoder_ops::flat_index(p.num_tokens * vecs);  // token * vecs + v
  if (idx < 0) return;
  const int token = idx / vecs;
  const int v = idx - token * vecs;
  const int32_t slot = __ldg(p.slots + token);
  if (slot < 0) return;  // padding row
  MOE_DEVICE_CHECK(slot < p.num_slots);
  const uint4 value = __ldg(reinterpret_cast<const uint4*>(p.src + token * p.src_stride) + v);
  reinterpret_cast<uint4*>(p.cache + slot * p.width)[v] = value;
}

inline constexpr int kKvFp8Warps = 4;  // (token, head) rows per block of kv_cache_write_fp8

// codes[slots[t], head], scales[slots[t], head] = the e4m3 encoding of src[t, head]
// (kv_fp8.cuh); one warp per (token, head), reading the head twice (its amax, then its codes),
// so any head width. With write_back, src gets the decoded values in place: each lane rewrites
// only the elements it has itself read, after the warp's amax is known.
__global__ void __launch_bounds__(kKvFp8Warps* device::kWarpSize)
    kv_cache_write_fp8_kernel(const __grid_constant__ KvWriteFp8Params p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kKvFp8Warps +
                       threadIdx.x / device::kWarpSize;  // token * num_heads + head
  if (item >= p.num_tokens * p.num_heads) return;  // warp-uniform
  const int64_t token = item / p.num_heads, head = item % p.num_heads;
  const int width = static_cast<int>(p.head_width);
  __nv_bfloat16* src = p.src + token * p.src_stride + head * p.head_width;
  const int32_t slot = __ldg(p.slots + token);
  if (slot >= 0) MOE_DEVICE_CHECK(slot < p.num_slots);
  float amax = 0.0f;
  for (int d = lane; d < width; d += device::kWarpSize)
    amax = fmaxf(amax, fabsf(__bfloat162float(src[d])));
  const float scale = kvfp8::scale_for(device::warp_max(amax));
  const int64_t row = static_cast<int64_t>(slot) * p.num_heads + head;
  uint8_t* codes = slot >= 0 ? p.codes + row * p.head_width : nullptr;
  if (codes && lane == 0) p.scales[row] = scale;
  for (int d = lane; d < width; d += device::kWarpSize) {
    const uint8_t code = kvfp8::encode(__bfloat162float(src[d]), scale);
    if (codes) codes[d] = code;
    if (p.write_back) src[d] = __float2bfloat16_rn(kvfp8::decode(code) * scale);
  }
}

// x = clamp(x + bias, -clip, clip) in place, with std::clamp's comparisons (a NaN stays NaN).
template <int kVec>
__global__ void __launch_bounds__(kDecoderOpsThreads)
    bias_clip_kernel(const __grid_constant__ BiasClipParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.width / kVec);
  const int idx = decoder_ops::flat_index(p.rows * vecs);  // row * vecs + v
  if (idx < 0) return;
  const int row = idx / vecs;
  const int v = idx - row * vecs;
  __nv_bfloat16* x = p.x + row * p.stride + static_cast<int64_t>(v) * kVec;
  float f[kVec];
  decoder_ops::load<kVec>(x, f);
  if (p.bias) {
    float b[kVec];
    decoder_ops::load_ro<kVec>(p.bias + static_cast<int64_t>(v) * kVec, b);
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] += b[i];
  }
  if (p.clip > 0.0f) {
    const float c = p.clip;
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] = f[i] < -c ? -c : (c < f[i] ? c : f[i]);
  }
  decoder_ops::store<kVec>(x, f);
}

// out[t, i] = silu(gate[t, i]) * up[t, i], in the CPU decoder's order: g / (1 + exp(-g)) * u.
template <int kVec>
__global__ void __launch_bounds__(kDecoderOpsThreads)
    silu_mul_kernel(const __grid_constant__ SiluMulParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.width / kVec);
  const int idx = decoder_ops::flat_index(p.num_tokens * vecs);  // token * vecs + v
  if (idx < 0) return;
  const int token = idx / vecs;
  const int v = idx - token * vecs;
  const int64_t col = static_cast<int64_t>(v) * kVec;
  const __nv_bfloat16* gate = p.gate_up + token * (2 * p.width) + col;
  float g[kVec], u[kVec];
  decoder_ops::load_ro<kVec>(gate, g);
  decoder_ops::load_ro<kVec>(gate + p.width, u);
#pragma unroll
  for (int i = 0; i < kVec; ++i) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  decoder_ops::store<kVec>(p.out + token * p.width + col, g);
}

// dst[r, c] = bf16(src[r, c]): one thread per element of the rows' first `width` columns.
__global__ void __launch_bounds__(kDecoderOpsThreads)
    round_rows_to_bf16_kernel(const __grid_constant__ RoundRowsParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int width = static_cast<int>(p.width);
  const int idx = decoder_ops::flat_index(p.rows * p.width);  // row * width + c
  if (idx < 0) return;
  const int row = idx / width;
  const int c = idx - row * width;
  p.dst[row * p.dst_stride + c] = __float2bfloat16_rn(__ldg(p.src + row * p.src_stride + c));
}

// x[t, :] *= sigmoid(logits[t]) in place.
template <int kVec>
__global__ void __launch_bounds__(kDecoderOpsThreads)
    sigmoid_scale_rows_kernel(const __grid_constant__ SigmoidScaleParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int vecs = static_cast<int>(p.hidden_size / kVec);
  const int idx = decoder_ops::flat_index(p.num_tokens * vecs);  // token * vecs + v
  if (idx < 0) return;
  const int token = idx / vecs;
  const int v = idx - token * vecs;
  const float gate = 1.0f / (1.0f + expf(-__ldg(p.logits + token)));
  __nv_bfloat16* x = p.x + token * p.hidden_size + static_cast<int64_t>(v) * kVec;
  float f[kVec];
  decoder_ops::load<kVec>(x, f);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] *= gate;
  decoder_ops::store<kVec>(x, f);
}

// One warp per row of at most kRmsNormWarpMaxWidth elements, kept in registers. The params come
// from the launcher with token_stride and mean_width resolved (never 0).
template <int kVec>
__global__ void __launch_bounds__(kDecoderOpsThreads)
    strided_rms_norm_warp_kernel(const __grid_constant__ StridedRmsNormParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  constexpr int kIters = kRmsNormWarpMaxWidth / (device::kWarpSize * kVec);
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kRmsNormRowsPerBlock + threadIdx.x / device::kWarpSize;
  if (row >= p.rows) return;  // the whole warp leaves together: the shuffles below see 32 lanes
  const int vecs = static_cast<int>(p.width / kVec);
  __nv_bfloat16* x = p.x + decoder_ops::norm_row_offset(p, row);

  float v[kIters][kVec], w[kIters][kVec];
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int c = lane + j * device::kWarpSize;
    if (c < vecs) {
      decoder_ops::load<kVec>(x + c * kVec, v[j]);
      decoder_ops::load_ro<kVec>(p.weight + c * kVec, w[j]);
      if (p.weight_lo) decoder_ops::add_weight_lo<kVec>(p.weight_lo + c * kVec, w[j]);
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    if (lane + j * device::kWarpSize < vecs) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum_sq = fmaf(v[j][i], v[j][i], sum_sq);
    }
  }
  sum_sq = device::warp_sum(sum_sq);
  const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(p.mean_width) + p.eps);
#pragma unroll
  for (int j = 0; j < kIters; ++j) {
    const int c = lane + j * device::kWarpSize;
    if (c < vecs) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[j][i] = w[j][i] * (v[j][i] * inv_rms);
      decoder_ops::store<kVec>(x + c * kVec, v[j]);
    }
  }
}

// One block per row of any width: the sum of squares, then a second pass that normalises. Each
// element is read and written by the same thread, and every first-pass read precedes the
// barrier, so the in-place update is safe.
template <int kVec>
__global__ void __launch_bounds__(kRmsNormBlockMaxThreads)
    strided_rms_norm_block_kernel(const __grid_constant__ StridedRmsNormParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  __shared__ float warp_partials[32];
  const int64_t row = blockIdx.x;
  if (row >= p.rows) return;
  const int vecs = static_cast<int>(p.width / kVec);
  __nv_bfloat16* x = p.x + decoder_ops::norm_row_offset(p, row);

  float sum_sq = 0.0f;
  for (int c = threadIdx.x; c < vecs; c += blockDim.x) {
    float f[kVec];
    decoder_ops::load<kVec>(x + static_cast<int64_t>(c) * kVec, f);
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum_sq = fmaf(f[i], f[i], sum_sq);
  }
  const float total = device::block_sum(sum_sq, warp_partials);
  const float inv_rms = 1.0f / sqrtf(total / static_cast<float>(p.mean_width) + p.eps);

  for (int c = threadIdx.x; c < vecs; c += blockDim.x) {
    const int64_t col = static_cast<int64_t>(c) * kVec;
    float f[kVec], w[kVec];
    decoder_ops::load<kVec>(x + col, f);
    decoder_ops::load_ro<kVec>(p.weight + col, w);
    if (p.weight_lo) decoder_ops::add_weight_lo<kVec>(p.weight_lo + col, w);
#pragma unroll
    for (int i = 0; i < kVec; ++i) f[i] = w[i] * (f[i] * inv_rms);
    decoder_ops::store<kVec>(x + col, f);
  }
}

// One element of random_fill, computed alone (the unaligned head and the tail).
__device__ __forceinline__ float random_fill_value(uint64_t key, int64_t i, float scale,
                                                   float offset) {
  const uint64_t h =
      decoder_ops::splitmix64_mix(key + (static_cast<uint64_t>(i >> 1) + 1) * kSplitmixGolden);
  const uint32_t bits = (i & 1) ? static_cast<uint32_t>(h >> 32) : static_cast<uint32_t>(h);
  return decoder_ops::uniform_value(bits, scale, offset);
}

// The 16-byte vectors of random_fill: elements first + 8 v .. first + 8 v + 7 (of index
// first_index + first + 8 v ..). kOdd says that first_index + first is odd, so a vector
// straddles five hashes rather than four; it is the same for every
// vector of a launch, so the branch between the two instantiations is uniform.
template <bool kOdd>
__device__ __forceinline__ void random_fill_vectors(const RandomFillParams& p, uint64_t key,
                                                    int64_t first, int64_t vecs) {
  uint4* out = reinterpret_cast<uint4*>(p.out + first);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += step) {
    const int64_t i0 = p.first_index + first + v * 8;
    const uint64_t pair0 = static_cast<uint64_t>(i0 >> 1);  // i0 = 2 pair0 + kOdd
    constexpr int kPairs = kOdd ? 5 : 4;
    uint32_t bits[2 * kPairs];
#pragma unroll
    for (int q = 0; q < kPairs; ++q) {
      const uint64_t h = decoder_ops::splitmix64_mix(key + (pair0 + q + 1) * kSplitmixGolden);
      bits[2 * q] = static_cast<uint32_t>(h);
      bits[2 * q + 1] = static_cast<uint32_t>(h >> 32);
    }
    // Element i0 + k is half (i0 + k) % 2 of pair (i0 + k) / 2, i.e. bits[k + kOdd]; with kOdd
    // the low half of pair0 (element i0 - 1) and the high half of the last pair go unused.
    float f[8];
#pragma unroll
    for (int k = 0; k < 8; ++k)
      f[k] = decoder_ops::uniform_value(bits[k + (kOdd ? 1 : 0)], p.scale, p.offset);
    out[v] = device::float_to_bf16x8(f);
  }
}

__global__ void __launch_bounds__(kDecoderOpsThreads)
    random_fill_kernel(const __grid_constant__ RandomFillParams p) {
  const uint64_t key = decoder_ops::splitmix64_mix(p.seed + kSplitmixGolden);
  // Elements before the first 16-byte boundary (bf16 pointers are 2-byte aligned).
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p.out) % 16) / 2;
  const int64_t head = misalign == 0 ? 0 : (8 - misalign < p.count ? 8 - misalign : p.count);
  const int64_t vecs = (p.count - head) / 8;
  const int64_t tail_start = head + vecs * 8;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t base = p.first_index;
  if (thread < head) {
    p.out[thread] =
        __float2bfloat16_rn(random_fill_value(key, base + thread, p.scale, p.offset));
  }
  if (thread < p.count - tail_start) {
    const int64_t i = tail_start + thread;
    p.out[i] = __float2bfloat16_rn(random_fill_value(key, base + i, p.scale, p.offset));
  }
  if ((base + head) & 1) {
    random_fill_vectors<true>(p, key, head, vecs);
  } else {
    random_fill_vectors<false>(p, key, head, vecs);
  }
}

// Thread i of the grid-stride range: code words first (every slab's, in order), then the scale
// entries (and int4 zero points) of every slab.
__global__ void __launch_bounds__(kDecoderOpsThreads)
    quant_random_fill_kernel(const __grid_constant__ QuantRandomFillParams p,
                             const __grid_constant__ QuantMatrixLayout slab) {
  const uint64_t key = decoder_ops::splitmix64_mix(p.seed + kSplitmixGolden);
  const bool fp8 = p.format == ExpertQuant::kFp8;
  const int64_t words_per_slab = p.rows * slab.row_code_bytes / 4;
  const int64_t scales_per_slab = p.rows * slab.groups_per_row;
  const int64_t num_words = p.num_slabs * words_per_slab;
  const int64_t total = num_words + p.num_slabs * scales_per_slab;
  const float scale = fp8 ? p.scale / 448.0f : p.scale / 8.0f;
  char* out = static_cast<char*>(p.out);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    if (i < num_words) {
      const uint64_t h =
          decoder_ops::splitmix64_mix(key + (static_cast<uint64_t>(i) + 1) * kSplitmixGolden);
      uint32_t word = static_cast<uint32_t>(h);  // int4: eight uniform 4-bit codes
      if (fp8) {
        word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const uint32_t bits = static_cast<uint32_t>(h >> (16 * b)) & 0xffffu;
          const float v = (static_cast<float>(bits) * 0x1p-15f - 1.0f) * 448.0f;  // [-448, 448)
          const uint32_t code = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
          word |= (code & 0xffu) << (8 * b);
        }
      }
      const int64_t s = i / words_per_slab, w = i % words_per_slab;
      reinterpret_cast<uint32_t*>(out + s * slab.bytes)[w] = word;
      continue;
    }
    const int64_t j = i - num_words;
    const int64_t s = j / scales_per_slab, k = j % scales_per_slab;
    char* base = out + s * slab.bytes;
    reinterpret_cast<float*>(base + slab.scale_offset)[k] = scale;
    if (!fp8) {
      const int64_t row = k / slab.groups_per_row, group = k % slab.groups_per_row;
      reinterpret_cast<float*>(base + slab.zero_offset)[k] = ((row + group) & 1) ? 7.0f : 8.0f;
    }
  }
}

}  // namespace moeinfer::cuda
