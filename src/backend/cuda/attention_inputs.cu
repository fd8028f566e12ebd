// The fused attention-input pass (decoder_ops.h, attention_inputs): a grid of (token, group of
// kWarps heads), one warp per head, so even a single decode token spreads over
// (Nq + 2 Nkv) / kWarps blocks. A head is staged in shared memory as float so the rotation can pair
// any two of its elements whatever the head dim, then written once to each destination.
// Heads wider than kMaxHeadDim (padded head dims above 256) take a kernel without the staging,
// so that nothing it holds grows with the head: each lane computes its own elements, reading a
// rotated element's partner again from the projection row. Both round as the unfused chain
// does (the normed head to bf16, then the rotated pair to bf16), in the same order.
// Under --kv-dtype fp8 (kv_fp8.cuh) the staged kernel's warp quantises each k and v head it has
// just rounded to bf16: the warp's amax, the scale, the codes (heads up to kMaxHeadDim).
#include <cuda_bf16.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kv_fp8.cuh"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;

// The factor of AttentionInputsParams::temperature_*, 1 when off. The division correctly
// rounded (floor of an exact quotient must not fall one short) and multiply and add rounded
// apart (no fma), as the CPU's float32 expression.
__device__ __forceinline__ float query_temperature(const AttentionInputsParams& p,
                                                   int32_t position) {
  if (p.temperature_floor_scale <= 0) return 1.0f;
  const float steps = floorf(__fdiv_rn(static_cast<float>(position) + 1.0f,
                                      static_cast<float>(p.temperature_floor_scale)));
  return __fadd_rn(__fmul_rn(log1pf(steps), p.temperature_scale), 1.0f);
}

__global__ void __launch_bounds__(kWarps* device::kWarpSize)
    attention_inputs_kernel(const __grid_constant__ AttentionInputsParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  __shared__ float staged[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x / device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t t = blockIdx.x;
  const int Nq = static_cast<int>(p.num_q_heads), Nkv = static_cast<int>(p.num_kv_heads);
  const int D = static_cast<int>(p.head_dim), Dp = static_cast<int>(p.padded_head_dim);
  const int half = static_cast<int>(p.rotary_dim / 2);
  const int32_t slot = __ldg(p.slots + t);
  if (slot >= 0) MOE_DEVICE_CHECK(slot < p.num_slots);
  const float position = static_cast<float>(__ldg(p.positions + t));
  const __nv_bfloat16* row = p.qkv + t * p.qkv_stride;
  float* s = staged[warp];
  const bool fp8 = p.k_codes != nullptr;
  const float temperature = query_temperature(p, __ldg(p.positions + t));

  for (int h = blockIdx.y * kWarps + warp; h < Nq + 2 * Nkv; h += kWarps * gridDim.y) {
    const __nv_bfloat16* in = row + static_cast<int64_t>(h) * Dp;
    const bool is_q = h < Nq, is_v = h >= Nq + Nkv;
    for (int d = lane; d < Dp; d += device::kWarpSize) s[d] = __bfloat162float(in[d]);
    __syncwarp();
    if (!is_v && p.q_norm) {
      float sum_sq = 0.0f;
      for (int d = lane; d < D; d += device::kWarpSize) sum_sq = fmaf(s[d], s[d], sum_sq);
      sum_sq = device::warp_sum(sum_sq);
      const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(D) + p.eps);
      const __nv_bfloat16* weight = is_q ? p.q_norm : p.k_norm;
      for (int d = lane; d < D; d += device::kWarpSize) {
        s[d] = __bfloat162float(
            __float2bfloat16_rn(__bfloat162float(__ldg(weight + d)) * (s[d] * inv_rms)));
      }
      __syncwarp();
    }
    if (!is_v && p.rope) {
      for (int i = lane; i < half; i += device::kWarpSize) {
        const float angle = position * __ldg(p.inv_freq + i);
        float sn, cs;
        sincosf(angle, &sn, &cs);
        cs *= p.attention_scaling;
        sn *= p.attention_scaling;
        const int i1 = p.interleaved ? 2 * i : i;
        const int i2 = p.interleaved ? 2 * i + 1 : i + half;
        const float x1 = s[i1], x2 = s[i2];
        s[i1] = x1 * cs - x2 * sn;
        s[i2] = x2 * cs + x1 * sn;
      }
      __syncwarp();
    }
    if (!is_v && p.norm_after_rope) {
      // Warp-uniform: the whole warp holds this head.
      float sum_sq = 0.0f;
      for (int d = lane; d < D; d += device::kWarpSize) sum_sq = fmaf(s[d], s[d], sum_sq);
      sum_sq = device::warp_sum(sum_sq);
      const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(D) + p.eps);
      for (int d = lane; d < D; d += device::kWarpSize) s[d] *= inv_rms;
      __syncwarp();
    }
    if (is_q && temperature != 1.0f) {
      for (int d = lane; d < D; d += device::kWarpSize) s[d] *= temperature;
      __syncwarp();
    }
    // Destinations: q -> q_out; k -> cache (and k_out); v -> cache (and v_out).
    __nv_bfloat16* out0 = nullptr;
    __nv_bfloat16* out1 = nullptr;
    if (is_q) {
      out0 = p.q_out + t * Nq * Dp + static_cast<int64_t>(h) * Dp;
    } else {
      const int kv = is_v ? h - Nq - Nkv : h - Nq;
      __nv_bfloat16* copy = is_v ? p.v_out : p.k_out;
      if (copy) out1 = copy + t * Nkv * Dp + kv * Dp;
      if (fp8) {
        // The head's bf16 values as e4m3 codes and a scale (kv_fp8.cuh); the copy gets what
        // the cache decodes to. Warp-uniform branch: is_q, fp8 and the head are the warp's.
        float amax = 0.0f;
        for (int d = lane; d < D; d += device::kWarpSize)
          amax = fmaxf(amax, fabsf(__bfloat162float(__float2bfloat16_rn(s[d]))));
        const float scale = kvfp8::scale_for(device::warp_max(amax));
        const int64_t row = static_cast<int64_t>(slot) * Nkv + kv;
        uint8_t* codes = slot >= 0 ? (is_v ? p.v_codes : p.k_codes) + row * Dp : nullptr;
        if (codes && lane == 0) (is_v ? p.v_scales : p.k_scales)[row] = scale;
        for (int d = lane; d < Dp; d += device::kWarpSize) {
          const float value = __bfloat162float(__float2bfloat16_rn(d < D ? s[d] : 0.0f));
          const uint8_t code = kvfp8::encode(value, scale);
          if (codes) codes[d] = code;
          if (out1) out1[d] = __float2bfloat16_rn(kvfp8::decode(code) * scale);
        }
        __syncwarp();  // s is reused by this warp's next head
        continue;
      }
      __nv_bfloat16* cache = is_v ? p.v_cache : p.k_cache;
      if (slot >= 0) out0 = cache + static_cast<int64_t>(slot) * Nkv * Dp + kv * Dp;
    }
    for (int d = lane; d < Dp; d += device::kWarpSize) {
      const __nv_bfloat16 value = __float2bfloat16_rn(d < D ? s[d] : 0.0f);
      if (out0) out0[d] = value;
      if (out1) out1[d] = value;
    }
    __syncwarp();  // s is reused by this warp's next head
  }
}

// One warp per head, as above, for Dp > kMaxHeadDim: no staging, so any head dim.
__global__ void __launch_bounds__(kWarps* device::kWarpSize)
    attention_inputs_wide_kernel(const __grid_constant__ AttentionInputsParams p) {
  device::start_after_previous_grid();  // launched by launch_after_previous()
  const int warp = threadIdx.x / device::kWarpSize;
  const int lane = threadIdx.x % device::kWarpSize;
  const int64_t t = blockIdx.x;
  const int Nq = static_cast<int>(p.num_q_heads), Nkv = static_cast<int>(p.num_kv_heads);
  const int D = static_cast<int>(p.head_dim), Dp = static_cast<int>(p.padded_head_dim);
  const int half = static_cast<int>(p.rotary_dim / 2);
  const int32_t slot = __ldg(p.slots + t);
  if (slot >= 0) MOE_DEVICE_CHECK(slot < p.num_slots);
  const float position = static_cast<float>(__ldg(p.positions + t));
  const __nv_bfloat16* row = p.qkv + t * p.qkv_stride;

  for (int h = blockIdx.y * kWarps + warp; h < Nq + 2 * Nkv; h += kWarps * gridDim.y) {
    const __nv_bfloat16* in = row + static_cast<int64_t>(h) * Dp;
    const bool is_q = h < Nq, is_v = h >= Nq + Nkv;
    const __nv_bfloat16* weight = !is_v && p.q_norm ? (is_q ? p.q_norm : p.k_norm) : nullptr;
    float inv_rms = 1.0f;
    if (weight) {
      float sum_sq = 0.0f;
      for (int d = lane; d < D; d += device::kWarpSize) {
        const float x = __bfloat162float(in[d]);
        sum_sq = fmaf(x, x, sum_sq);
      }
      sum_sq = device::warp_sum(sum_sq);
      inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(D) + p.eps);
    }
    // Element d of the head after the norm (rounded to bf16 as the norm kernel stores it).
    auto normed = [&](int d) {
      const float x = __bfloat162float(in[d]);
      if (!weight) return x;
      return __bfloat162float(
          __float2bfloat16_rn(__bfloat162float(__ldg(weight + d)) * (x * inv_rms)));
    };
    __nv_bfloat16* out0 = nullptr;
    __nv_bfloat16* out1 = nullptr;
    if (is_q) {
      out0 = p.q_out + t * Nq * Dp + static_cast<int64_t>(h) * Dp;
    } else {
      const int kv = is_v ? h - Nq - Nkv : h - Nq;
      __nv_bfloat16* cache = is_v ? p.v_cache : p.k_cache;
      __nv_bfloat16* copy = is_v ? p.v_out : p.k_out;
      if (slot >= 0) out0 = cache + static_cast<int64_t>(slot) * Nkv * Dp + kv * Dp;
      if (copy) out1 = copy + t * Nkv * Dp + kv * Dp;
    }
    for (int d = lane; d < Dp; d += device::kWarpSize) {
      float value = 0.0f;  // the padding stays zero
      if (d < D) value = normed(d);
      if (!is_v && p.rope && d < p.rotary_dim) {
        // The pair (i1, i2) turns as in the staged kernel: i1 <- x1 cos - x2 sin,
        // i2 <- x2 cos + x1 sin; this lane computes element d, of either role.
        const bool first = p.interleaved ? d % 2 == 0 : d < half;
        const int i = p.interleaved ? d / 2 : (first ? d : d - half);
        const int partner = p.interleaved ? (d ^ 1) : (first ? d + half : d - half);
        const float angle = position * __ldg(p.inv_freq + i);
        float sn, cs;
        sincosf(angle, &sn, &cs);
        cs *= p.attention_scaling;
        sn *= p.attention_scaling;
        const float other = normed(partner);
        value = first ? value * cs - other * sn : value * cs + other * sn;
      }
      const __nv_bfloat16 out = __float2bfloat16_rn(value);
      if (out0) out0[d] = out;
      if (out1) out1[d] = out;
    }
  }
}

}  // namespace

void attention_inputs(const AttentionInputsParams& p, cudaStream_t stream) {
  NvtxRange range("attention_inputs");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.num_q_heads >= 1 && p.num_kv_heads >= 1, "num_q_heads = ", p.num_q_heads,
            " and num_kv_heads = ", p.num_kv_heads, " must be at least 1");
  MOE_CHECK(p.head_dim >= 2 && p.head_dim <= p.padded_head_dim, "head_dim = ", p.head_dim,
            " and padded_head_dim = ", p.padded_head_dim, " must satisfy 2 <= D <= Dp");
  detail::check_int32_range(p.padded_head_dim, "padded_head_dim");
  MOE_CHECK(p.rotary_dim >= 2 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
            "rotary_dim = ", p.rotary_dim, " must be even and in [2, head_dim]");
  MOE_CHECK(p.qkv_stride >= (p.num_q_heads + 2 * p.num_kv_heads) * p.padded_head_dim,
            "qkv_stride = ", p.qkv_stride, " is shorter than the q, k and v heads");
  MOE_CHECK((p.q_norm == nullptr) == (p.k_norm == nullptr), "q_norm and k_norm come together");
  MOE_CHECK(!p.norm_after_rope || p.q_norm == nullptr,
            "norm_after_rope (a weightless norm after RoPE) and q_norm / k_norm (a weighted one "
            "before it) are exclusive");
  MOE_CHECK(p.temperature_floor_scale >= 0, "temperature_floor_scale = ",
            p.temperature_floor_scale, " must be 0 (off) or positive");
  MOE_CHECK((!p.norm_after_rope && p.temperature_floor_scale == 0) ||
                p.padded_head_dim <= kMaxHeadDim,
            "padded_head_dim = ", p.padded_head_dim,
            ": the norm after RoPE and the query temperature run for head dims up to ",
            kMaxHeadDim, " only");
  MOE_CHECK(p.num_slots >= 0, "num_slots = ", p.num_slots, " is negative");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.qkv, "qkv");
  detail::check_pointer(p.positions, "positions");
  if (p.rope) detail::check_pointer(p.inv_freq, "inv_freq");
  detail::check_pointer(p.slots, "slots");
  const bool fp8 = p.k_codes || p.v_codes || p.k_scales || p.v_scales;
  if (fp8) {
    MOE_CHECK(!p.k_cache && !p.v_cache,
              "k_cache / v_cache (bf16 rows) and k_codes / v_codes (fp8 rows) are exclusive");
    detail::check_pointer(p.k_codes, "k_codes");
    detail::check_pointer(p.v_codes, "v_codes");
    detail::check_pointer(p.k_scales, "k_scales");
    detail::check_pointer(p.v_scales, "v_scales");
    MOE_CHECK(p.padded_head_dim <= kMaxHeadDim, "padded_head_dim = ", p.padded_head_dim,
              ": fp8 KV rows are written for head dims up to ", kMaxHeadDim, " only");
  } else {
    detail::check_pointer(p.k_cache, "k_cache");
    detail::check_pointer(p.v_cache, "v_cache");
  }
  detail::check_pointer(p.q_out, "q_out");
  const int64_t heads = p.num_q_heads + 2 * p.num_kv_heads;
  MOE_CHECK(heads <= 65535 * kWarps, "too many heads: ", heads);
  const dim3 grid(static_cast<unsigned>(p.num_tokens),
                  static_cast<unsigned>((heads + kWarps - 1) / kWarps));
  if (p.padded_head_dim <= kMaxHeadDim) {
    launch_after_previous(attention_inputs_kernel, grid, kWarps * device::kWarpSize, 0, stream, p);
  } else {
    launch_after_previous(attention_inputs_wide_kernel, grid, kWarps * device::kWarpSize, 0, stream,
                          p);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
