// Host interface of the small kernels that glue the decoder's big stages together on the GPU:
// writing new key/value rows into the paged cache, bias add and clipping of projections, RMSNorm
// over strided sub-rows (per-head q/k norms, MLA's latent norm), SiLU(gate) * up for dense MLPs,
// the sigmoid gate of a shared expert, and random weights for synthetic models.
//
// Same contract as moe_stages.h: params structs of raw device pointers, host-side checks that
// name the offending value, no host synchronisation, so every launcher can be captured in a
// CUDA graph. bf16 storage, float32 math, one rounding per output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/expert_quant.h"

namespace moeinfer::cuda {

struct KvWriteParams {
  const __nv_bfloat16* src = nullptr;  // row t at src + t * src_stride, `width` elements;
                                       // 16-byte aligned
  __nv_bfloat16* cache = nullptr;      // [num_slots, width]: slot s at cache + s * width;
                                       // 16-byte aligned
  const int32_t* slots = nullptr;      // [T] destination slot (block * block_size + offset);
                                       // a negative slot skips the row (padding)
  int64_t num_tokens = 0;              // T
  int64_t width = 0;                   // elements per row, a multiple of 8
  int64_t src_stride = 0;              // elements, a multiple of 8
  int64_t num_slots = 0;               // for the device range check: a slot >= num_slots
                                       // traps (MOE_DEVICE_CHECK)
};

// cache[slots[t]] = src[t] for every t.
void kv_cache_write(const KvWriteParams& params, cudaStream_t stream);

// The fp8 twin of kv_cache_write (--kv-dtype fp8, backend/cuda/kv_fp8.cuh): each head of a row
// becomes e4m3 codes and one float32 scale, amax / 448, as kv/kv_format.h encodes it on the CPU.
// One warp per (token, head), any head width.
struct KvWriteFp8Params {
  __nv_bfloat16* src = nullptr;   // row t at src + t * src_stride: num_heads heads of head_width
  uint8_t* codes = nullptr;       // [num_slots, num_heads * head_width] e4m3
  float* scales = nullptr;        // [num_slots, num_heads]
  const int32_t* slots = nullptr;  // [T] destination slot; a negative slot skips the row
  int64_t num_tokens = 0;          // T
  int64_t num_heads = 0;           // scale groups per row (Nkv)
  int64_t head_width = 0;          // values per group (the padded head dim: padding is zero)
  int64_t src_stride = 0;          // elements from one row of src to the next
  int64_t num_slots = 0;           // for the device range check
  // Rewrite src in place with the rows as the cache decodes them (bf16 of code * scale), so
  // that a prefill attending over copies of src sees what later steps read from the cache.
  bool write_back = false;
};

void kv_cache_write_fp8(const KvWriteFp8Params& params, cudaStream_t stream);

// Any width, stride and alignment; 16-byte vectors where width, stride and pointers allow.
struct BiasClipParams {
  __nv_bfloat16* x = nullptr;           // [rows, width] in place, row stride `stride`
  const __nv_bfloat16* bias = nullptr;  // [width] or null
  int64_t rows = 0;
  int64_t width = 0;
  int64_t stride = 0;  // elements from one row to the next, >= width
  float clip = 0.0f;   // > 0: clamp to [-clip, clip] after the bias
};

// x[r, c] = clamp(x[r, c] + bias[c], -clip, clip) (in float32, one bf16 rounding).
void bias_clip(const BiasClipParams& params, cudaStream_t stream);

struct StridedRmsNormParams {
  __nv_bfloat16* x = nullptr;             // rows in place: row r at x + (r / rows_per_token) *
                                          // token_stride + (r % rows_per_token) * stride
  const __nv_bfloat16* weight = nullptr;  // [width]
  const __nv_bfloat16* weight_lo = nullptr;  // [width] the weight's second bf16 term (float32
                                             // checkpoints), or null
  int64_t rows = 0;                       // a multiple of rows_per_token
  int64_t width = 0;   // elements normalised per row (>= 1; up to 1024 a warp per row, above a
                       // block per row)
  int64_t stride = 0;  // >= width: from one row of a token to the next
  float eps = 1e-6f;   // >= 0
  int64_t rows_per_token = 1;  // rows in one token's group (heads), >= 1
  int64_t token_stride = 0;    // from one token's group to the next; 0: rows_per_token * stride.
                               // >= (rows_per_token - 1) * stride + width (groups do not overlap)
  int64_t mean_width = 0;      // divisor of the mean, in [1, width]; 0: width. The sum of squares
                               // runs over all `width` elements, so columns past mean_width
                               // (head padding) must be zero to leave it unchanged.
};

// Each row's first `width` elements: x = weight * (x / sqrt(sum(x^2) / mean_width + eps)) (weight
// taken as weight + weight_lo in float32 when weight_lo is given),
// rounded as fused_add_rms_norm does: bf16(weight * (x * inv_rms)). Per-head q/k norms (rows =
// T * heads, stride = head stride, rows_per_token = heads, token_stride = the projection's row
// width), the whole-projection q/k norm over padded heads (mean_width = heads * head_dim), MLA's
// latent norm (stride = cache width).
void strided_rms_norm(const StridedRmsNormParams& params, cudaStream_t stream);

struct SiluMulParams {
  const __nv_bfloat16* gate_up = nullptr;  // [T, 2I]: gate columns [0, I), up columns [I, 2I)
  __nv_bfloat16* out = nullptr;            // [T, I]
  int64_t num_tokens = 0;
  int64_t width = 0;  // I
};

// out[t, i] = silu(gate[t, i]) * up[t, i], SiLU(x) = x / (1 + exp(-x)).
void silu_mul(const SiluMulParams& params, cudaStream_t stream);

struct SigmoidScaleParams {
  __nv_bfloat16* x = nullptr;     // [T, H] in place
  const float* logits = nullptr;  // [T]
  int64_t num_tokens = 0;
  int64_t hidden_size = 0;
};

// x[t] *= sigmoid(logits[t]): Qwen2-MoE's gate on the shared expert's output.
void sigmoid_scale_rows(const SigmoidScaleParams& params, cudaStream_t stream);

// Everything between the q/k/v projection and attention, for standard (GQA) attention, in one
// launch: per-head RMSNorm of q and k (when the model has it), RoPE on q and k, the new key and
// value rows written to the paged cache, and q (and, for prefill, k and v) copied out as the
// contiguous [T, heads, Dp] arrays the attention kernels read.
struct AttentionInputsParams {
  const __nv_bfloat16* qkv = nullptr;  // [T, qkv_stride]: q heads, k heads, v heads, Dp apart
  int64_t qkv_stride = 0;              // >= (Nq + 2 Nkv) * Dp
  const int32_t* positions = nullptr;  // [T]
  const float* inv_freq = nullptr;     // [rotary_dim / 2]
  const __nv_bfloat16* q_norm = nullptr;  // [D] per-head weight, or null: no q/k norm
  const __nv_bfloat16* k_norm = nullptr;  // [D], with q_norm
  float eps = 1e-6f;
  const int32_t* slots = nullptr;      // [T] cache slot, negative: skip the cache write
  __nv_bfloat16* k_cache = nullptr;    // [num_slots, Nkv * Dp] bf16 rows, or null under fp8
  __nv_bfloat16* v_cache = nullptr;    // [num_slots, Nkv * Dp]
  // --kv-dtype fp8 (backend/cuda/kv_fp8.cuh), instead of k_cache / v_cache: each k and v head
  // stored as e4m3 codes of its bf16-rounded values and one float32 scale (amax / 448); k_out
  // and v_out then get the heads as the cache decodes them (bf16 of code * scale), so a prefill
  // attends over the rows later steps read. Dp <= 256 only.
  uint8_t* k_codes = nullptr;          // [num_slots, Nkv * Dp]
  uint8_t* v_codes = nullptr;          // [num_slots, Nkv * Dp]
  float* k_scales = nullptr;           // [num_slots, Nkv]
  float* v_scales = nullptr;           // [num_slots, Nkv]
  int64_t num_slots = 0;
  __nv_bfloat16* q_out = nullptr;      // [T, Nq * Dp]
  __nv_bfloat16* k_out = nullptr;      // [T, Nkv * Dp] or null
  __nv_bfloat16* v_out = nullptr;      // [T, Nkv * Dp] or null
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;         // D: the norm's width
  int64_t padded_head_dim = 0;  // Dp >= D: the head stride (padding stays zero)
  int64_t rotary_dim = 0;       // even, <= D
  float attention_scaling = 1.0f;
  bool interleaved = false;
  // false: a NoPE layer (Llama 4), q and k keep their values (inv_freq is not read).
  bool rope = true;
  // Llama 4's use_qk_norm: each q and k head divided by sqrt(mean(x^2) + eps) over its D values,
  // without a weight, after RoPE (q_norm / k_norm must then be null). Dp <= 256 only.
  bool norm_after_rope = false;
  // Llama 4's attn_temperature_tuning on NoPE layers: > 0 multiplies each q head of the token
  // at position p by log1p(floor((p + 1) / temperature_floor_scale)) * temperature_scale + 1,
  // in float32 as the CPU; 0: off. Dp <= 256 only.
  int64_t temperature_floor_scale = 0;
  float temperature_scale = 0.0f;
};

// Rounds as the separate kernels do: the normed head to bf16, then the rotated pair to bf16.
// Under norm_after_rope or the temperature the head stays float32 from the rotation to the one
// bf16 rounding of its destination, as the CPU's float32 chain.
void attention_inputs(const AttentionInputsParams& params, cudaStream_t stream);

struct RoundRowsParams {
  const float* src = nullptr;    // [rows, src_stride]
  __nv_bfloat16* dst = nullptr;  // [rows, dst_stride]; only the first `width` of a row written
  int64_t rows = 0;
  int64_t width = 0;
  int64_t src_stride = 0;  // >= width
  int64_t dst_stride = 0;  // >= width
};

// dst[r, c] = bf16(src[r, c]), c < width: a product summed in float32 (a float32 checkpoint's two
// weight terms) rounded once into the bf16 activation its consumer reads.
void round_rows_to_bf16(const RoundRowsParams& params, cudaStream_t stream);

struct RandomFillParams {
  __nv_bfloat16* out = nullptr;  // [count], any alignment
  int64_t count = 0;
  uint64_t seed = 0;
  float scale = 1.0f;   // values uniform in [-scale, scale)
  float offset = 0.0f;  // added after scaling (1.0 for norm weights)
  // out[i] takes the value of index first_index + i: a matrix filled in pieces (a staging
  // buffer at a time) gets the values of one fill of the whole.
  int64_t first_index = 0;
};

// Deterministic (seed, index) -> value, for synthetic weights built on the device: out[i] depends
// only on (seed, i, scale, offset), not on the launch or the pointer's alignment. The formula
// (splitmix64, two 32-bit halves per hash) is written out in decoder_ops_kernel.cuh.
void random_fill(const RandomFillParams& params, cudaStream_t stream);

// Random codes and scales for quantised synthetic experts (--weights fp8|int4 on synthetic:NAME).
struct QuantRandomFillParams {
  void* out = nullptr;  // [num_slabs] slabs of quant_matrix_layout(format, rows, cols, group),
                        // one after another; 16-byte aligned
  int64_t num_slabs = 0;
  int64_t rows = 0, cols = 0;  // each slab's matrix [Nw, Kd]; the codes of a row a multiple of 4
                               // bytes (cols a multiple of 4 for fp8, of 8 for int4)
  ExpertQuant format = ExpertQuant::kFp8;  // kFp8 or kInt4
  int64_t group = 0;
  uint64_t seed = 0;
  float scale = 1.0f;  // the dequantised values lie in [-scale, scale]
};

// Fills every code and scale (and int4 zero point) of the slabs; the bytes between the parts
// are left alone. Dequantised values (backend/cuda/expert_quant.h) are about uniform in
// [-scale, scale], with nearly the spread of random_fill's bf16 values of that scale:
//   fp8:  code = e4m3((2u - 1) * 448) with u uniform in [0, 1) (16 random bits, saturating
//         round to nearest), every scale scale / 448;
//   int4: each 4-bit code uniform in [0, 15], every scale scale / 8, the zero point 8 or 7 by
//         the parity of row + group (values (q - 8) or (q - 7) times scale / 8: no net bias).
// Each 32-bit word of codes w (over all slabs, in order) takes the low 32 bits of
// splitmix64_mix(splitmix64_mix(seed + kGolden) + (w + 1) * kGolden): the codes depend only on
// (seed, format, slab shape, w), not on the launch.
void quant_random_fill(const QuantRandomFillParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
