// GPTQ and AWQ 4-bit linears (io/model_config.h's PackedInt4Quantization) unpacked into the
// [N, K] bf16 matrix the CPU products take. The arithmetic only: which tensors a module has, and
// whether their shapes agree, is WeightSource's to check.
#pragma once

#include <cstdint>

#include "io/model_config.h"
#include "model/quantized_matrix.h"

namespace moeinfer {

// AWQ packs eight outputs a word in the order 0, 2, 4, 6, 1, 3, 5, 7: output j of a word sits in
// nibble kAwqNibble[j].
inline constexpr int kAwqNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

// The 4-bit code of output n in a word packed along the outputs (qzeros of both layouts, AWQ's
// qweight): GPTQ keeps output 8i + j in nibble j, AWQ in nibble kAwqNibble[j].
inline uint32_t output_code(int32_t word, int64_t n, Int4Packing packing) {
  const int j = static_cast<int>(n % 8);
  const int nibble = packing == Int4Packing::kAwq ? kAwqNibble[j] : j;
  return (static_cast<uint32_t>(word) >> (4 * nibble)) & 0xfu;
}

// One linear's stored tensors, N outputs and K inputs in G groups.
struct PackedInt4Linear {
  const int32_t* qweight = nullptr;  // GPTQ [K / 8, N]; AWQ [K, N / 8]
  const int32_t* qzeros = nullptr;   // [G, N / 8]
  const float* scales = nullptr;     // [G, N], widened from the stored float16
  const int32_t* g_idx = nullptr;    // [K] each input's group in [0, G); null: k / group_size
  int64_t num_rows = 0;              // N
  int64_t num_cols = 0;              // K
  int64_t group_size = 0;            // inputs per group when g_idx is null
};

// out_bf16[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n], rounded to bf16 once. With
// `zero_minus_one` (GPTQ's first format) the stored zero is one less than the zero point; a
// stored 15 then means 16, as AutoGPTQ's and vLLM's kernels read it.
void dequantize_packed_int4(const PackedInt4Linear& linear, Int4Packing packing,
                            bool zero_minus_one, uint16_t* out_bf16);

// The same linear as codes and per-group scales and zero points (the GPU's int4 layout, model/
// quantized_matrix.h): value(n, k) is the float product dequantize_packed_int4 rounds. Needs
// contiguous groups (g_idx null or k / group_size for every k: no act-order).
QuantizedMatrix packed_int4_codes(const PackedInt4Linear& linear, Int4Packing packing,
                                  bool zero_minus_one);

// Whether g_idx (K entries) is k / group_size for every input: the groups are contiguous.
bool packed_int4_groups_contiguous(const int32_t* g_idx, int64_t num_cols, int64_t group_size);

}  // namespace moeinfer
