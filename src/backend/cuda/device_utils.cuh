// Small device helpers shared by the MoE-stage kernels: warp reductions and 16-byte bf16
// vectors (8 values) converted to and from float32.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace moeinfer::cuda::device {

// The device side of programmatic dependent launch (programmatic_launch.h): a kernel launched
// by launch_after_previous() calls wait_for_previous_grid() before it touches global memory,
// then allow_next_grid(). No-ops before Hopper and in a kernel launched normally.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// A 16-byte load of data read once by the whole grid (a decode GEMV's weights): through the
// read-only path, not kept in L1, with L2 asked to fetch the 256-byte block around it from HBM
// at once. On an H100 the decode GEMVs of Qwen3-30B-A3B's shapes stream 5-12% faster so than
// with __ldg (bench/RESULTS.md, 2026-12-07).
__device__ __forceinline__ uint4 load_streamed(const void* address) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(address));
  return v;
}

// A warp asks L2 for the first `bytes` at `base`, one 128-byte line a lane at a time; nothing
// waits for them (weights a kernel reads next, fetched while it waits for something else).
__device__ __forceinline__ void prefetch_to_l2(const void* base, int64_t bytes, int lane) {
  constexpr int kLine = 128;
  const char* at = static_cast<const char*>(base);
  for (int64_t b = static_cast<int64_t>(lane) * kLine; b < bytes; b += 32 * kLine) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(at + b));
  }
}

// The two together, first thing in a kernel launched by launch_after_previous().
__device__ __forceinline__ void start_after_previous_grid() {
  wait_for_previous_grid();
  allow_next_grid();
}

// The last i in [0, count) with starts[i] <= value, for a non-decreasing `starts` whose first
// entry is at most `value` (a host-planned work list: the item that block `value` belongs to).
// Among equal starts (items with no work) the last one is found.
__device__ __forceinline__ int last_start_at_or_before(const int32_t* starts, int count,
                                                       int value) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(starts + mid) <= value) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

inline constexpr unsigned kFullMask = 0xffffffffu;
inline constexpr int kWarpSize = 32;
inline constexpr int kBf16PerVec = 8;  // one uint4 holds 8 bf16

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

// The sum of one float per thread over the block, returned to every thread: a warp reduction,
// the warps' partials through `partials` (32 floats of shared memory), a second warp reduction.
// Every thread of the block must call it.
__device__ __forceinline__ float block_sum(float value, float* partials) {
  value = warp_sum(value);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  if (lane == 0) partials[warp] = value;
  __syncthreads();
  if (warp == 0) {
    float total = lane < num_warps ? partials[lane] : 0.0f;
    total = warp_sum(total);
    if (lane == 0) partials[0] = total;
  }
  __syncthreads();
  return partials[0];
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& packed, float (&out)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// The float32 dot product of two vectors of 8 bf16, summed in element order.
__device__ __forceinline__ float bf16x8_dot(const uint4& a, const uint4& b) {
  float x[8], y[8];
  bf16x8_to_float(a, x);
  bf16x8_to_float(b, y);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum = fmaf(x[i], y[i], sum);
  return sum;
}

__device__ __forceinline__ uint4 float_to_bf16x8(const float (&in)[8]) {
  uint4 packed;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return packed;
}

// Eight floats at vector index v (32 bytes at a 16-byte aligned base): two 16-byte accesses.
__device__ __forceinline__ void load_float8(const float* base, int64_t v, float (&out)[8]) {
  const float4* p = reinterpret_cast<const float4*>(base) + 2 * v;
  const float4 a = p[0], b = p[1];
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ void store_float8(float* base, int64_t v, const float (&in)[8]) {
  float4* p = reinterpret_cast<float4*>(base) + 2 * v;
  p[0] = make_float4(in[0], in[1], in[2], in[3]);
  p[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// Rounds to bf16 and back, as a bf16 store followed by a load would.
__device__ __forceinline__ float round_bf16(float value) {
  return __bfloat162float(__float2bfloat16_rn(value));
}

}  // namespace moeinfer::cuda::device
