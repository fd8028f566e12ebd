// Hands checkpoint tensors to the family binders. Tensors are views into the memory map, except
// block-scaled fp8 matrices (DeepSeek-V3's format), MXFP4 experts (GPT-OSS's) and GPTQ / AWQ
// 4-bit linears, which are dequantised once at load into bf16 buffers owned here (the CPU matrix
// products take f32, bf16 or f16 weights); matrices stored [in, out] (Llama 4's stacked experts),
// copied once at load to the [out, in] the products take; and weights a binder lays out anew in
// buffers of allocate().
#pragma once

#include <cstddef>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/quantized_matrix.h"

namespace moeinfer {

class WeightSource {
 public:
  WeightSource(const WeightStore& store, const ModelConfig& config)
      : store_(store), fp8_(config.fp8), packed_int4_(config.packed_int4) {}
  WeightSource(const WeightSource&) = delete;
  WeightSource& operator=(const WeightSource&) = delete;

  bool has(const std::string& name) const { return store_.has(name); }
  // Stored tensors whose names start with `prefix` (a part of the checkpoint left unread).
  int64_t count_with_prefix(std::string_view prefix) const;
  // A tensor used as stored (norm weights, biases, embeddings, routers).
  TensorView tensor(const std::string& name, const Shape& shape) const;
  // A linear layer's [N, K] weight. With fp8 quantization a F8_E4M3 weight and its
  // `<name>_scale_inv` [ceil(N/rows), ceil(K/cols)] are dequantised to bf16. With GPTQ or AWQ
  // quantization a `<module>.weight` stored as `<module>.qweight`, `.qzeros`, `.scales` (and
  // GPTQ's `.g_idx`) is dequantised to bf16; one stored as `.weight` is used as stored.
  TensorView matrix(const std::string& name, const Shape& shape);
  // MXFP4 matrices stacked per expert, [E, N, K] in bf16, from `<name>_blocks` (uint8
  // [E, N, K / 32, 16]) and `<name>_scales` (uint8 [E, N, K / 32]). Row n of each expert lands
  // at row destination_row[n] (a permutation of [0, N); empty: in place).
  TensorView mxfp4_experts(const std::string& name, const Shape& shape,
                           std::span<const int64_t> destination_row = {});
  // Zeroed bytes owned by this source, for weights a binder lays out anew at load.
  void* allocate(size_t bytes);
  size_t dequantized_bytes() const;
  // Columns [first_col, first_col + num_cols) of a 2-D view [R, C] as a [num_cols, R] matrix in
  // the same dtype, owned here: a weight stored [in, out] turned into the products' [out, in].
  TensorView transposed_columns(const TensorView& matrix, int64_t first_col, int64_t num_cols);
  size_t transposed_bytes() const;
  // The codes and scales behind every matrix dequantised here (block-scaled fp8, GPTQ / AWQ
  // without act-order, MXFP4) and every one quantize_routed_experts quantised, for the GPU.
  const QuantizedMatrices& quantized() const { return quantized_; }
  QuantizedMatrices& quantized() { return quantized_; }

 private:
  // `<module>.weight` [N, K] from the module's GPTQ or AWQ tensors, their shapes checked.
  TensorView packed_int4_matrix(const std::string& module, const Shape& shape);

  const WeightStore& store_;
  std::optional<Fp8Quantization> fp8_;
  std::optional<PackedInt4Quantization> packed_int4_;
  std::deque<std::vector<uint16_t>> dequantized_;  // stable addresses for the views
  std::deque<std::vector<std::byte>> allocated_;
  std::deque<std::vector<std::byte>> transposed_;
  QuantizedMatrices quantized_;
};

// w[r, c] = q[r, c] * scale_inv[r / rows, c / cols], rounded to bf16. Exposed for tests.
void dequantize_fp8_blocks(const uint8_t* q, const float* scale_inv, int64_t num_rows,
                           int64_t num_cols, int64_t block_rows, int64_t block_cols,
                           uint16_t* out_bf16);

// MXFP4 (OCP microscaling, as GPT-OSS stores its experts): each row of num_cols values is
// num_cols / 32 blocks of 16 bytes, two e2m1 codes a byte (the earlier value in the low
// nibble), each block scaled by 2^(scale - 127) from its E8M0 byte. Row r of the input is
// written at row destination_row[r] of out_bf16 [num_rows, num_cols] (empty: row r). Every
// value is exact in bf16. Exposed for tests.
void dequantize_mxfp4_rows(const uint8_t* blocks, const uint8_t* scales, int64_t num_rows,
                           int64_t num_cols, std::span<const int64_t> destination_row,
                           uint16_t* out_bf16);

}  // namespace moeinfer
