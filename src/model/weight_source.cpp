#include "model/weight_source.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/packed_int4.h"

namespace moeinfer {

TensorView WeightSource::tensor(const std::string& name, const Shape& shape) const {
  return store_.require(name, shape);
}

TensorView WeightSource::matrix(const std::string& name, const Shape& shape) {
  if (packed_int4_ && name.ends_with(".weight")) {
    const std::string module = name.substr(0, name.size() - std::string_view(".weight").size());
    if (store_.has(module + ".qweight")) return packed_int4_matrix(module, shape);
    MOE_CHECK(store_.has(name), store_.dir().string(), ": linear '", module, "' has neither '",
              name, "' nor the quantised '", module, ".qweight'");
  }
  const TensorEntry& entry = store_.entry(name);
  if (entry.dtype != DType::kF8E4M3) return store_.require(name, shape);
  MOE_CHECK(fp8_.has_value(), store_.file_of(name), ": tensor '", name,
            "' is F8_E4M3 but config.json has no fp8 quantization_config");
  static constexpr DType kFp8[] = {DType::kF8E4M3};
  const TensorView q = store_.require(name, shape, kFp8);
  const int64_t rows = shape[0], cols = shape[1];
  const int64_t scale_rows = (rows + fp8_->block_rows - 1) / fp8_->block_rows;
  const int64_t scale_cols = (cols + fp8_->block_cols - 1) / fp8_->block_cols;
  static constexpr DType kF32[] = {DType::kF32};
  const std::string scale_name = name + "_scale_inv";
  MOE_CHECK(store_.has(scale_name), store_.dir().string(), ": fp8 tensor '", name,
            "' has no scale tensor '", scale_name, "'");
  const TensorView scale = store_.require(scale_name, {scale_rows, scale_cols}, kF32);
  std::vector<uint16_t>& out = dequantized_.emplace_back(static_cast<size_t>(rows * cols));
  dequantize_fp8_blocks(static_cast<const uint8_t*>(q.data), static_cast<const float*>(scale.data),
                        rows, cols, fp8_->block_rows, fp8_->block_cols, out.data());
  // The codes as stored (in the map), each block's scale repeated on its rows
  // (model/quantized_matrix.h).
  QuantizedMatrix record{.format = CodeFormat::kFp8, .rows = rows, .cols = cols,
                         .group = fp8_->block_cols};
  record.mapped_codes = static_cast<const uint8_t*>(q.data);
  record.scales.resize(static_cast<size_t>(rows * scale_cols));
  const auto* scale_inv = static_cast<const float*>(scale.data);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(scale_inv + (r / fp8_->block_rows) * scale_cols, scale_cols,
                record.scales.begin() + r * scale_cols);
  }
  quantized_.add(out.data(), sizeof(uint16_t), std::move(record));
  return TensorView{.dtype = DType::kBF16, .shape = shape, .data = out.data()};
}

TensorView WeightSource::packed_int4_matrix(const std::string& module, const Shape& shape) {
  const PackedInt4Quantization& quant = *packed_int4_;
  const bool gptq = quant.packing == Int4Packing::kGptq;
  const std::string where = store_.dir().string() + ": " +
                            std::string(quant_method_name(quant.packing)) + " linear '" + module +
                            "'";
  MOE_CHECK(shape.rank() == 2, where, ": expected a matrix, the binder asked for ", shape.str());
  const int64_t N = shape[0], K = shape[1];
  MOE_CHECK(N % 8 == 0, where, ": ", N, " outputs do not pack into whole int32 words of qzeros",
            gptq ? "" : " and qweight");
  MOE_CHECK(!gptq || K % 8 == 0, where, ": ", K,
            " inputs do not pack into whole int32 words of qweight");
  const int64_t group_size = quant.group_size == 0 ? K : quant.group_size;
  MOE_CHECK(K % group_size == 0, where, ": group_size ", group_size, " does not divide its ", K,
            " inputs");
  const int64_t G = K / group_size;
  static constexpr DType kI32[] = {DType::kI32};
  for (const char* part : {".qzeros", ".scales"}) {
    MOE_CHECK(store_.has(module + part), where, " has a qweight but no '", module, part, "'");
  }
  const TensorView qweight =
      store_.require(module + ".qweight", gptq ? Shape{K / 8, N} : Shape{K, N / 8}, kI32);
  const TensorView qzeros = store_.require(module + ".qzeros", {G, N / 8}, kI32);
  const TensorView scales = store_.require(module + ".scales", {G, N});
  std::vector<float> scales_f32(static_cast<size_t>(G * N));
  convert_to_f32(scales.dtype, scales.data, scales_f32.data(), scales_f32.size());

  const int32_t* g_idx = nullptr;
  const std::string g_idx_name = module + ".g_idx";
  if (gptq && store_.has(g_idx_name)) {
    g_idx = static_cast<const int32_t*>(store_.require(g_idx_name, {K}, kI32).data);
    for (int64_t k = 0; k < K; ++k) {
      MOE_CHECK(g_idx[k] >= 0 && g_idx[k] < G, where, ": '", g_idx_name, "' puts input ", k,
                " in group ", g_idx[k], ", outside the ", G, " groups of its scales");
    }
  } else {
    MOE_CHECK(!quant.desc_act || !gptq, where, ": desc_act is true but the checkpoint has no '",
              g_idx_name, "'");
  }
  std::vector<uint16_t>& out = dequantized_.emplace_back(static_cast<size_t>(N * K));
  const PackedInt4Linear linear{.qweight = static_cast<const int32_t*>(qweight.data),
                                .qzeros = static_cast<const int32_t*>(qzeros.data),
                                .scales = scales_f32.data(),
                                .g_idx = g_idx,
                                .num_rows = N,
                                .num_cols = K,
                                .group_size = group_size};
  dequantize_packed_int4(linear, quant.packing, quant.zero_minus_one, out.data());
  // Act-order (a permuted g_idx) has no per-row group layout: such a linear keeps no codes, and
  // the GPU holds its experts in bf16 (model/cuda/device_weights.cpp).
  if (packed_int4_groups_contiguous(g_idx, K, group_size) && K % 2 == 0) {
    quantized_.add(out.data(), sizeof(uint16_t),
                   packed_int4_codes(linear, quant.packing, quant.zero_minus_one));
  }
  return TensorView{.dtype = DType::kBF16, .shape = shape, .data = out.data()};
}

TensorView WeightSource::mxfp4_experts(const std::string& name, const Shape& shape,
                                       std::span<const int64_t> destination_row) {
  MOE_CHECK(shape.rank() == 3, "mxfp4 experts of '", name, "' need an [E, N, K] shape");
  const int64_t E = shape[0], N = shape[1], K = shape[2];
  MOE_CHECK(K % 32 == 0, store_.dir().string(), ": mxfp4 tensor '", name, "' has rows of ", K,
            " values, not a multiple of the 32-value block");
  MOE_CHECK(destination_row.empty() || static_cast<int64_t>(destination_row.size()) == N,
            "a row order of ", destination_row.size(), " entries for ", N, " rows");
  static constexpr DType kBytes[] = {DType::kU8};
  const TensorView blocks = store_.require(name + "_blocks", {E, N, K / 32, 16}, kBytes);
  const TensorView scales = store_.require(name + "_scales", {E, N, K / 32}, kBytes);
  std::vector<uint16_t>& out = dequantized_.emplace_back(static_cast<size_t>(E * N * K));
  const auto* block_bytes = static_cast<const uint8_t*>(blocks.data);
  const auto* scale_bytes = static_cast<const uint8_t*>(scales.data);
  for (int64_t e = 0; e < E; ++e) {
    dequantize_mxfp4_rows(block_bytes + e * N * (K / 2), scale_bytes + e * N * (K / 32), N, K,
                          destination_row, out.data() + e * N * K);
  }
  // The codes and exponents, rows in the same order as the values: [E * N, K / 2], [E * N, K / 32].
  QuantizedMatrix record{.format = CodeFormat::kMxfp4, .rows = E * N, .cols = K, .group = 32};
  // In order, the codes are the map's own bytes; reordered rows take a copy.
  if (destination_row.empty()) {
    record.mapped_codes = block_bytes;
  } else {
    record.codes.resize(static_cast<size_t>(E * N * K / 2));
  }
  record.exponents.resize(static_cast<size_t>(E * N * K / 32));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t at = e * N + (destination_row.empty() ? n : destination_row[n]);
      if (!destination_row.empty()) {
        std::copy_n(block_bytes + (e * N + n) * (K / 2), K / 2,
                    record.codes.begin() + at * (K / 2));
      }
      std::copy_n(scale_bytes + (e * N + n) * (K / 32), K / 32,
                  record.exponents.begin() + at * (K / 32));
    }
  }
  quantized_.add(out.data(), sizeof(uint16_t), std::move(record));
  return TensorView{.dtype = DType::kBF16, .shape = shape, .data = out.data()};
}

void* WeightSource::allocate(size_t bytes) { return allocated_.emplace_back(bytes).data(); }

size_t WeightSource::dequantized_bytes() const {
  size_t bytes = 0;
  for (const auto& buffer : dequantized_) bytes += buffer.size() * sizeof(uint16_t);
  for (const auto& buffer : allocated_) bytes += buffer.size();
  return bytes;
}

TensorView WeightSource::transposed_columns(const TensorView& matrix, int64_t first_col,
                                            int64_t num_cols) {
  MOE_CHECK(matrix.shape.rank() == 2, "transposing a tensor of rank ", matrix.shape.rank());
  const int64_t rows = matrix.shape[0], cols = matrix.shape[1];
  MOE_CHECK(first_col >= 0 && num_cols > 0 && first_col + num_cols <= cols, "columns [", first_col,
            ", ", first_col + num_cols, ") outside a matrix of ", cols);
  const int64_t elem = static_cast<int64_t>(dtype_size(matrix.dtype));
  std::vector<std::byte>& out =
      transposed_.emplace_back(static_cast<size_t>(rows * num_cols * elem));
  const auto* in = static_cast<const std::byte*>(matrix.data);
  // Each output row is one input column: gather it down the input's rows.
  parallel_for(
      num_cols,
      [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
          std::byte* dst = out.data() + c * rows * elem;
          for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(dst + r * elem, in + (r * cols + first_col + c) * elem,
                        static_cast<size_t>(elem));
          }
        }
      },
      16);
  return TensorView{.dtype = matrix.dtype, .shape = {num_cols, rows}, .data = out.data()};
}

size_t WeightSource::transposed_bytes() const {
  size_t bytes = 0;
  for (const auto& buffer : transposed_) bytes += buffer.size();
  return bytes;
}

void dequantize_fp8_blocks(const uint8_t* q, const float* scale_inv, int64_t num_rows,
                           int64_t num_cols, int64_t block_rows, int64_t block_cols,
                           uint16_t* out_bf16) {
  const int64_t scale_cols = (num_cols + block_cols - 1) / block_cols;
  // Each e4m3 byte has 256 values: decode through a table.
  float table[256];
  for (int i = 0; i < 256; ++i) table[i] = f8e4m3_to_f32(static_cast<uint8_t>(i));
  parallel_for(num_rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* scales = scale_inv + (r / block_rows) * scale_cols;
      for (int64_t c = 0; c < num_cols; ++c) {
        out_bf16[r * num_cols + c] = f32_to_bf16(table[q[r * num_cols + c]] * scales[c / block_cols]);
      }
    }
  }, 16);
}

int64_t WeightSource::count_with_prefix(std::string_view prefix) const {
  int64_t count = 0;
  for (const std::string& name : store_.names()) count += name.starts_with(prefix);
  return count;
}

void dequantize_mxfp4_rows(const uint8_t* blocks, const uint8_t* scales, int64_t num_rows,
                           int64_t num_cols, std::span<const int64_t> destination_row,
                           uint16_t* out_bf16) {
  // The 16 e2m1 codes: sign bit 3, two exponent bits and one mantissa bit.
  static constexpr float kCodes[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                       -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const int64_t num_blocks = num_cols / 32;
  parallel_for(
      num_rows,
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const int64_t at = destination_row.empty() ? r : destination_row[r];
          uint16_t* row = out_bf16 + at * num_cols;
          for (int64_t b = 0; b < num_blocks; ++b) {
            const int exponent = static_cast<int>(scales[r * num_blocks + b]) - 127;
            const uint8_t* bytes = blocks + (r * num_blocks + b) * 16;
            uint16_t* out = row + b * 32;
            for (int j = 0; j < 16; ++j) {
              out[2 * j] = f32_to_bf16(std::ldexp(kCodes[bytes[j] & 0x0f], exponent));
              out[2 * j + 1] = f32_to_bf16(std::ldexp(kCodes[bytes[j] >> 4], exponent));
            }
          }
        }
      },
      16);
}

}  // namespace moeinfer
