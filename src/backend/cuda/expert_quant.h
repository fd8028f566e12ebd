// The device layout of a quantised expert matrix, read by the grouped expert GEMM
// (grouped_gemm_kernel.cuh), written by the weight upload (model/cuda/device_weights.cpp) and by
// tests; one function says where everything lives, so the two cannot disagree.
//
// One matrix [Nw, Kd] (Nw output rows, Kd inputs; an expert's fused gate_up or its down) is one
// slab of bytes, the experts of a layer one after another at a stride of quant_matrix_layout's
// `bytes` (or through the slot table, one pointer per expert):
//   codes     fp8:          [Nw, Kd]      uint8 e4m3
//             int4, mxfp4:  [Nw, Kd / 2]  uint8, input 2j in the low nibble of byte j
//   scales    fp8, int4:    [Nw, G]       float32, G = ceil(Kd / group)  (from scale_offset)
//             mxfp4:        [Nw, Kd / 32] uint8 E8M0 exponents
//   zeros     int4:         [Nw, G]       float32 zero points            (from zero_offset)
// Values, each rounded once to bf16 (round to nearest even) before the bf16 tensor-core product,
// the float32 products the CPU forms before its own rounding to bf16 (model/quantized_matrix.h):
//   fp8:   e4m3(code) * scale          int4: (code - zero) * scale
//   mxfp4: e2m1(code) * 2^(exponent - 127)
// group is a multiple of 8 (a 16-byte chunk of 8 bf16 values reads one scale) for fp8 and int4,
// and 32 for mxfp4. Every part starts 16-byte aligned and `bytes` is a multiple of 256.
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace moeinfer::cuda {

enum class ExpertQuant : int32_t {
  kNone,   // bf16 weights (weight_terms 1 or 2)
  kFp8,    // e4m3, a float32 scale per `group` inputs of a row
  kInt4,   // 4-bit codes, a float32 scale and zero point per `group` inputs of a row
  kMxfp4,  // e2m1, an E8M0 exponent per 32 inputs of a row
};

inline const char* expert_quant_name(ExpertQuant format) {
  switch (format) {
    case ExpertQuant::kNone:
      return "bf16";
    case ExpertQuant::kFp8:
      return "fp8";
    case ExpertQuant::kInt4:
      return "int4";
    case ExpertQuant::kMxfp4:
      return "mxfp4";
  }
  return "";  // unreachable: every enumerator returns above
}

struct QuantMatrixLayout {
  int64_t row_code_bytes = 0;  // bytes of codes per row
  int64_t groups_per_row = 0;  // scales (or exponents) per row
  int64_t scale_offset = 0;    // bytes from the slab's start
  int64_t zero_offset = 0;     // int4 only
  int64_t bytes = 0;           // the whole slab
};

MOE_HOST_DEVICE int64_t quant_round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

MOE_HOST_DEVICE QuantMatrixLayout quant_matrix_layout(ExpertQuant format, int64_t rows,
                                                      int64_t cols, int64_t group) {
  QuantMatrixLayout out;
  if (format == ExpertQuant::kNone) return out;
  out.row_code_bytes = format == ExpertQuant::kFp8 ? cols : cols / 2;
  out.groups_per_row = (cols + group - 1) / group;
  const int64_t scale_bytes = format == ExpertQuant::kMxfp4 ? 1 : 4;
  out.scale_offset = quant_round_up(rows * out.row_code_bytes, 16);
  const int64_t scales_end = out.scale_offset + rows * out.groups_per_row * scale_bytes;
  out.zero_offset = quant_round_up(scales_end, 16);
  const int64_t end =
      format == ExpertQuant::kInt4 ? out.zero_offset + rows * out.groups_per_row * 4 : scales_end;
  out.bytes = quant_round_up(end, 256);
  return out;
}

}  // namespace moeinfer::cuda
