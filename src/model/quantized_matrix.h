// The codes and scales behind a quantised weight matrix, kept beside the dequantised values the
// CPU computes with, so that the GPU can hold the codes instead of bf16 copies (docs/
// ARCHITECTURE.md, weight-only quantisation of the routed experts). The WeightSource records one
// for every block-scaled fp8 matrix, GPTQ / AWQ linear without act-order and MXFP4 expert stack
// it dequantises, and quantize_routed_experts one for every matrix it quantises; each record is
// keyed by the dequantised buffer it stands behind, so a family binder's views (an expert of a
// stack, the gate half of a fused gate_up) find their rows without knowing any of this.
//
// One normal form for the three formats: a scale per `group` consecutive inputs of an output
// row. An fp8 block's scale is repeated on each of the block's rows (4 bytes per group of 128
// values, 3% of the codes, for one layout the kernel reads like the others).
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "core/tensor.h"

namespace moeinfer {

enum class CodeFormat : uint8_t {
  kFp8,    // e4m3 codes, value = e4m3(code) * scale
  kInt4,   // 4-bit codes, value = (code - zero) * scale
  kMxfp4,  // e2m1 codes, value = e2m1(code) * 2^(exponent - 127)
};

const char* code_format_name(CodeFormat format);

struct QuantizedMatrix {
  CodeFormat format = CodeFormat::kFp8;
  int64_t rows = 0, cols = 0;  // [N, K]
  int64_t group = 0;           // consecutive inputs of a row under one scale (a multiple of 8)
  // fp8 [N, K] one byte a value; int4 and MXFP4 [N, K / 2], input 2j in the low nibble of byte j.
  std::vector<uint8_t> codes;
  // Or the checkpoint's own bytes in that layout (memory-mapped, fp8 and an MXFP4 stack in
  // order), not copied: `codes` then stays empty.
  const uint8_t* mapped_codes = nullptr;
  std::vector<float> scales;       // fp8, int4 [N, groups_per_row()]
  std::vector<float> zeros;        // int4 [N, groups_per_row()]: the zero point (integral)
  std::vector<uint8_t> exponents;  // MXFP4 [N, K / 32]: E8M0 bytes

  int64_t groups_per_row() const { return (cols + group - 1) / group; }
  const uint8_t* code_data() const { return mapped_codes ? mapped_codes : codes.data(); }
  uint32_t code(int64_t r, int64_t c) const {
    if (format == CodeFormat::kFp8) return code_data()[r * cols + c];
    return (code_data()[(r * cols + c) / 2] >> (4 * (c & 1))) & 0xfu;
  }
  // The dequantised value in float32, the product the CPU forms before rounding it to its
  // compute dtype (bf16 for every checkpoint format, f32 for --weights on a float32 one).
  float value(int64_t r, int64_t c) const;
};

// Records keyed by the dequantised buffer each stands behind.
class QuantizedMatrices {
 public:
  // `data` holds the record's rows * cols values of `elem_bytes` each (2 for bf16, 4 for f32).
  void add(const void* data, size_t elem_bytes, QuantizedMatrix matrix);
  // The record behind a 2-D view that is rows [*first_row, *first_row + view rows) of one (same
  // columns, same element size), or null.
  const QuantizedMatrix* find(const TensorView& view, int64_t* first_row) const;
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    size_t elem_bytes = 0;
    QuantizedMatrix matrix;
  };
  std::map<const char*, Entry> entries_;  // by the buffer's first byte
};

// The e2m1 value of a 4-bit code (sign in bit 3).
float e2m1_value(uint32_t code);

}  // namespace moeinfer
