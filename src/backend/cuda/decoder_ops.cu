// Launchers of the decoder's glue kernels (decoder_ops_kernel.cuh): argument checks that name the
// offending value, then the 16-byte-vector instantiation when widths, strides and pointers allow
// it and the element-wise one otherwise. No launcher reads anything back from the device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/decoder_ops_kernel.cuh"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {

namespace {

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

// The element-wise kernels index their threads with a 32-bit int.
void check_work_items(int64_t rows, int64_t width, const char* name) {
  MOE_CHECK(rows <= std::numeric_limits<int32_t>::max() / std::max<int64_t>(width, 1), name, " = ",
            rows, " * ", width, " does not fit in 32 bits");
}

unsigned flat_blocks(int64_t threads) {
  return static_cast<unsigned>((threads + kDecoderOpsThreads - 1) / kDecoderOpsThreads);
}

}  // namespace

void kv_cache_write(const KvWriteParams& p, cudaStream_t stream) {
  NvtxRange range("kv_cache_write");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.width > 0 && p.width % device::kBf16PerVec == 0, "width = ", p.width,
            " must be a positive multiple of 8 (rows move as 16-byte vectors)");
  MOE_CHECK(p.src_stride >= p.width && p.src_stride % device::kBf16PerVec == 0,
            "src_stride = ", p.src_stride,
            " must be a multiple of 8 and at least width = ", p.width);
  MOE_CHECK(p.num_slots >= 0, "num_slots = ", p.num_slots, " is negative");
  check_work_items(p.num_tokens, p.width / device::kBf16PerVec, "num_tokens * width / 8");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.src, "src");
  detail::check_pointer(p.cache, "cache");
  detail::check_pointer(p.slots, "slots");
  detail::check_aligned16(p.src, "src");
  detail::check_aligned16(p.cache, "cache");
  const int64_t threads = p.num_tokens * (p.width / device::kBf16PerVec);
  launch_after_previous(kv_cache_write_kernel, flat_blocks(threads), kDecoderOpsThreads, 0, stream,
                        p);
  MOE_CUDA_CHECK_LAUNCH();
}

void kv_cache_write_fp8(const KvWriteFp8Params& p, cudaStream_t stream) {
  NvtxRange range("kv_cache_write_fp8");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.num_heads >= 1 && p.head_width >= 1, "num_heads = ", p.num_heads,
            " and head_width = ", p.head_width, " must be at least 1");
  detail::check_int32_range(p.head_width, "head_width");
  MOE_CHECK(p.src_stride >= p.num_heads * p.head_width, "src_stride = ", p.src_stride,
            " is shorter than num_heads * head_width = ", p.num_heads * p.head_width);
  MOE_CHECK(p.num_slots >= 0, "num_slots = ", p.num_slots, " is negative");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.src, "src");
  detail::check_pointer(p.codes, "codes");
  detail::check_pointer(p.scales, "scales");
  detail::check_pointer(p.slots, "slots");
  const int64_t blocks = (p.num_tokens * p.num_heads + kKvFp8Warps - 1) / kKvFp8Warps;
  MOE_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "num_tokens * num_heads = ",
            p.num_tokens * p.num_heads, " is too many rows");
  launch_after_previous(kv_cache_write_fp8_kernel, static_cast<unsigned>(blocks),
                        kKvFp8Warps * device::kWarpSize, 0, stream, p);
  MOE_CUDA_CHECK_LAUNCH();
}

void bias_clip(const BiasClipParams& p, cudaStream_t stream) {
  NvtxRange range("bias_clip");
  detail::check_int32_range(p.rows, "rows");
  MOE_CHECK(p.width >= 1 && p.width <= std::numeric_limits<int32_t>::max(), "width = ", p.width,
            " is outside [1, 2^31)");
  MOE_CHECK(p.stride >= p.width, "stride = ", p.stride, " is shorter than width = ", p.width);
  MOE_CHECK(!std::isnan(p.clip), "clip is NaN");
  check_work_items(p.rows, p.width, "rows * width");
  if (p.rows == 0) return;
  detail::check_pointer(p.x, "x");
  if (!p.bias && !(p.clip > 0.0f)) return;  // nothing to add, nothing to clip
  const bool vec =
      p.width % 8 == 0 && p.stride % 8 == 0 && aligned16(p.x) && (!p.bias || aligned16(p.bias));
  if (vec) {
    launch_after_previous(bias_clip_kernel<8>, flat_blocks(p.rows * (p.width / 8)),
                          kDecoderOpsThreads, 0, stream, p);
  } else {
    launch_after_previous(bias_clip_kernel<1>, flat_blocks(p.rows * p.width), kDecoderOpsThreads, 0,
                          stream, p);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void strided_rms_norm(const StridedRmsNormParams& params, cudaStream_t stream) {
  NvtxRange range("strided_rms_norm");
  StridedRmsNormParams p = params;
  detail::check_int32_range(p.rows, "rows");
  MOE_CHECK(p.width >= 1 && p.width <= std::numeric_limits<int32_t>::max(), "width = ", p.width,
            " is outside [1, 2^31)");
  MOE_CHECK(p.stride >= p.width, "stride = ", p.stride, " is shorter than width = ", p.width);
  MOE_CHECK(p.eps >= 0.0f, "eps = ", p.eps, " must not be negative");
  MOE_CHECK(p.rows_per_token >= 1, "rows_per_token = ", p.rows_per_token, " must be at least 1");
  MOE_CHECK(p.rows % p.rows_per_token == 0, "rows = ", p.rows,
            " is not a multiple of rows_per_token = ", p.rows_per_token);
  if (p.token_stride == 0) p.token_stride = p.rows_per_token * p.stride;
  MOE_CHECK(p.token_stride >= (p.rows_per_token - 1) * p.stride + p.width,
            "token_stride = ", p.token_stride,
            " makes token groups overlap (rows_per_token = ", p.rows_per_token,
            ", stride = ", p.stride, ", width = ", p.width, ")");
  if (p.mean_width == 0) p.mean_width = p.width;
  MOE_CHECK(p.mean_width >= 1 && p.mean_width <= p.width, "mean_width = ", p.mean_width,
            " is outside [1, width = ", p.width, "]");
  if (p.rows == 0) return;
  detail::check_pointer(p.x, "x");
  detail::check_pointer(p.weight, "weight");
  const bool vec = p.width % 8 == 0 && p.stride % 8 == 0 && p.token_stride % 8 == 0 &&
                   aligned16(p.x) && aligned16(p.weight) &&
                   (p.weight_lo == nullptr || aligned16(p.weight_lo));
  if (p.width <= kRmsNormWarpMaxWidth) {
    const unsigned blocks =
        static_cast<unsigned>((p.rows + kRmsNormRowsPerBlock - 1) / kRmsNormRowsPerBlock);
    if (vec) {
      launch_after_previous(strided_rms_norm_warp_kernel<8>, blocks, kDecoderOpsThreads, 0, stream,
                            p);
    } else {
      launch_after_previous(strided_rms_norm_warp_kernel<1>, blocks, kDecoderOpsThreads, 0, stream,
                            p);
    }
  } else {
    // As many threads as vectors in the row (one pass each), up to 1024, whole warps.
    const int64_t vecs = vec ? p.width / 8 : p.width;
    const int64_t threads =
        std::min<int64_t>(kRmsNormBlockMaxThreads,
                          (vecs + device::kWarpSize - 1) / device::kWarpSize * device::kWarpSize);
    const unsigned blocks = static_cast<unsigned>(p.rows);
    if (vec) {
      launch_after_previous(strided_rms_norm_block_kernel<8>, blocks,
                            static_cast<unsigned>(threads), 0, stream, p);
    } else {
      launch_after_previous(strided_rms_norm_block_kernel<1>, blocks,
                            static_cast<unsigned>(threads), 0, stream, p);
    }
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void silu_mul(const SiluMulParams& p, cudaStream_t stream) {
  NvtxRange range("silu_mul");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.width >= 1 && p.width <= std::numeric_limits<int32_t>::max() / 2, "width = ", p.width,
            " is outside [1, 2^30)");
  check_work_items(p.num_tokens, p.width, "num_tokens * width");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.gate_up, "gate_up");
  detail::check_pointer(p.out, "out");
  const bool vec = p.width % 8 == 0 && aligned16(p.gate_up) && aligned16(p.out);
  if (vec) {
    launch_after_previous(silu_mul_kernel<8>, flat_blocks(p.num_tokens * (p.width / 8)),
                          kDecoderOpsThreads, 0, stream, p);
  } else {
    launch_after_previous(silu_mul_kernel<1>, flat_blocks(p.num_tokens * p.width),
                          kDecoderOpsThreads, 0, stream, p);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void sigmoid_scale_rows(const SigmoidScaleParams& p, cudaStream_t stream) {
  NvtxRange range("sigmoid_scale_rows");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.hidden_size >= 1 && p.hidden_size <= std::numeric_limits<int32_t>::max(),
            "hidden_size = ", p.hidden_size, " is outside [1, 2^31)");
  check_work_items(p.num_tokens, p.hidden_size, "num_tokens * hidden_size");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.x, "x");
  detail::check_pointer(p.logits, "logits");
  const bool vec = p.hidden_size % 8 == 0 && aligned16(p.x);
  if (vec) {
    launch_after_previous(sigmoid_scale_rows_kernel<8>,
                          flat_blocks(p.num_tokens * (p.hidden_size / 8)), kDecoderOpsThreads, 0,
                          stream, p);
  } else {
    launch_after_previous(sigmoid_scale_rows_kernel<1>, flat_blocks(p.num_tokens * p.hidden_size),
                          kDecoderOpsThreads, 0, stream, p);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void round_rows_to_bf16(const RoundRowsParams& p, cudaStream_t stream) {
  NvtxRange range("round_rows_to_bf16");
  detail::check_int32_range(p.rows, "rows");
  MOE_CHECK(p.width >= 1 && p.width <= std::numeric_limits<int32_t>::max(), "width = ", p.width,
            " is outside [1, 2^31)");
  MOE_CHECK(p.src_stride >= p.width, "src_stride = ", p.src_stride, " is shorter than width = ",
            p.width);
  MOE_CHECK(p.dst_stride >= p.width, "dst_stride = ", p.dst_stride, " is shorter than width = ",
            p.width);
  check_work_items(p.rows, p.width, "rows * width");
  if (p.rows == 0) return;
  detail::check_pointer(p.src, "src");
  detail::check_pointer(p.dst, "dst");
  launch_after_previous(round_rows_to_bf16_kernel, flat_blocks(p.rows * p.width),
                        kDecoderOpsThreads, 0, stream, p);
  MOE_CUDA_CHECK_LAUNCH();
}

void random_fill(const RandomFillParams& p, cudaStream_t stream) {
  NvtxRange range("random_fill");
  MOE_CHECK(p.count >= 0, "count = ", p.count, " is negative");
  MOE_CHECK(std::isfinite(p.scale) && p.scale >= 0.0f, "scale = ", p.scale,
            " must be finite and not negative");
  MOE_CHECK(std::isfinite(p.offset), "offset = ", p.offset, " is not finite");
  MOE_CHECK(p.first_index >= 0, "first_index = ", p.first_index, " is negative");
  if (p.count == 0) return;
  detail::check_pointer(p.out, "out");
  MOE_CHECK(reinterpret_cast<uintptr_t>(p.out) % 2 == 0, "out (", static_cast<void*>(p.out),
            ") is not 2-byte aligned");
  // One thread per 16-byte vector up to kRandomFillMaxBlocks blocks, grid-stride beyond; at
  // least one block for the unaligned head and the tail (under 8 elements each).
  const int64_t vecs = p.count / 8 + 1;
  const int64_t blocks =
      std::min<int64_t>(kRandomFillMaxBlocks, (vecs + kDecoderOpsThreads - 1) / kDecoderOpsThreads);
  random_fill_kernel<<<static_cast<unsigned>(blocks), kDecoderOpsThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void quant_random_fill(const QuantRandomFillParams& p, cudaStream_t stream) {
  NvtxRange range("quant_random_fill");
  MOE_CHECK(p.format == ExpertQuant::kFp8 || p.format == ExpertQuant::kInt4, "format ",
            expert_quant_name(p.format), ": random codes are drawn for fp8 and int4 only");
  MOE_CHECK(p.num_slabs >= 0 && p.rows >= 0 && p.cols >= 0, "num_slabs = ", p.num_slabs,
            ", rows = ", p.rows, ", cols = ", p.cols, ": none may be negative");
  MOE_CHECK(p.group > 0 && p.group % 8 == 0, "group = ", p.group,
            " is not a positive multiple of 8");
  MOE_CHECK(std::isfinite(p.scale) && p.scale >= 0.0f, "scale = ", p.scale,
            " must be finite and not negative");
  const QuantMatrixLayout slab = quant_matrix_layout(p.format, p.rows, p.cols, p.group);
  MOE_CHECK(slab.row_code_bytes % 4 == 0, "cols = ", p.cols, " gives ", slab.row_code_bytes,
            " bytes of codes a row, not a multiple of 4");
  if (p.num_slabs == 0 || p.rows == 0 || p.cols == 0) return;
  detail::check_pointer(p.out, "out");
  MOE_CHECK(aligned16(p.out), "out (", p.out, ") is not 16-byte aligned");
  const int64_t total = p.num_slabs * p.rows * (slab.row_code_bytes / 4 + slab.groups_per_row);
  const int64_t blocks = std::min<int64_t>(kRandomFillMaxBlocks,
                                           (total + kDecoderOpsThreads - 1) / kDecoderOpsThreads);
  quant_random_fill_kernel<<<static_cast<unsigned>(blocks), kDecoderOpsThreads, 0, stream>>>(p,
                                                                                             slab);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
