// The codes and scales the loader keeps for the GPU (model/quantized_matrix.h): for every
// quantised checkpoint format and for --weights fp8 / int4, every routed expert's gate, up and
// down view finds its record, and each record's values are exactly the values the CPU computes
// with (rounded to the view's dtype), so the GPU's dequantised experts are the CPU's oracle.
#include "model/quantized_matrix.h"

#include <gtest/gtest.h>

#include <string>

#include "../support/model_fixtures.h"
#include "core/dtype.h"
#include "model/model.h"

namespace moeinfer {
namespace {

struct Case {
  std::string fixture;
  WeightFormat weights = WeightFormat::kCheckpoint;
  CodeFormat format = CodeFormat::kFp8;
};

// The view's value (r, c) as float32.
float view_value(const TensorView& v, int64_t r, int64_t c) {
  const int64_t i = r * v.shape[1] + c;
  if (v.dtype == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(v.data)[i]);
  return static_cast<const float*>(v.data)[i];
}

void check_case(const Case& c) {
  SCOPED_TRACE(c.fixture + " " + std::string(weight_format_name(c.weights)));
  auto model = Model::load(testing_support::kModelFixtures / c.fixture,
                           LoadOptions{.prefault = false, .expert_weights = c.weights});
  const DecoderWeights& w = model->decoder().weights();
  ASSERT_NE(w.quantized, nullptr);
  int64_t matrices = 0;
  for (const LayerWeights& layer : w.layers) {
    if (!layer.is_moe) continue;
    for (const moe::ExpertWeights& expert : layer.moe.routed.experts) {
      for (const TensorView* view : {&expert.gate, &expert.up, &expert.down}) {
        int64_t first_row = -1;
        const QuantizedMatrix* m = w.quantized->find(*view, &first_row);
        ASSERT_NE(m, nullptr) << "a routed expert matrix has no codes";
        EXPECT_EQ(m->format, c.format);
        ASSERT_GE(first_row, 0);
        for (int64_t r = 0; r < view->shape[0]; ++r) {
          for (int64_t k = 0; k < view->shape[1]; ++k) {
            float expected = m->value(first_row + r, k);
            if (view->dtype == DType::kBF16) expected = bf16_to_f32(f32_to_bf16(expected));
            ASSERT_EQ(view_value(*view, r, k), expected) << "row " << r << " input " << k;
          }
        }
        ++matrices;
      }
    }
  }
  EXPECT_GT(matrices, 0);
}

TEST(QuantizedMatrix, EveryRoutedExpertOfAQuantisedCheckpointHasItsCodes) {
  for (const Case& c :
       {Case{"deepseek_v3_fp8", WeightFormat::kCheckpoint, CodeFormat::kFp8},
        Case{"kimi_k2_fp8", WeightFormat::kCheckpoint, CodeFormat::kFp8},
        Case{"qwen2_moe_awq", WeightFormat::kCheckpoint, CodeFormat::kInt4},
        Case{"deepseek_v2_lite_gptq_v2", WeightFormat::kCheckpoint, CodeFormat::kInt4},
        Case{"gpt_oss_mxfp4", WeightFormat::kCheckpoint, CodeFormat::kMxfp4}}) {
    check_case(c);
  }
}

TEST(QuantizedMatrix, WeightsFlagKeepsTheCodesItQuantisedTo) {
  check_case({"qwen3_moe_bf16", WeightFormat::kFp8, CodeFormat::kFp8});
  check_case({"qwen3_moe_bf16", WeightFormat::kInt4, CodeFormat::kInt4});
  check_case({"qwen3_moe_f32", WeightFormat::kFp8, CodeFormat::kFp8});  // f32 values
}

// GPTQ with act-order (a permuted g_idx) has no per-row groups: no codes are kept, and the GPU
// holds those experts in bf16.
TEST(QuantizedMatrix, ActOrderGptqKeepsNoCodes) {
  auto model = Model::load(testing_support::kModelFixtures / "qwen3_moe_gptq",
                           LoadOptions{.prefault = false});
  const DecoderWeights& w = model->decoder().weights();
  ASSERT_NE(w.quantized, nullptr);
  for (const LayerWeights& layer : w.layers) {
    if (!layer.is_moe) continue;
    int64_t first_row = 0;
    EXPECT_EQ(w.quantized->find(layer.moe.routed.experts[0].gate, &first_row), nullptr);
  }
}

TEST(QuantizedMatrix, FindTakesRowRangesOnly) {
  QuantizedMatrices all;
  std::vector<uint16_t> values(16 * 32);
  QuantizedMatrix m{.format = CodeFormat::kInt4, .rows = 16, .cols = 32, .group = 32};
  m.codes.assign(16 * 16, 0x21);
  m.scales.assign(16, 0.5f);
  m.zeros.assign(16, 1.0f);
  all.add(values.data(), 2, m);
  int64_t first_row = -1;
  const TensorView rows{.dtype = DType::kBF16, .shape = {4, 32}, .data = values.data() + 8 * 32};
  ASSERT_NE(all.find(rows, &first_row), nullptr);
  EXPECT_EQ(first_row, 8);
  EXPECT_EQ(all.find(rows, &first_row)->value(8, 0), 0.0f);  // (1 - 1) * 0.5
  EXPECT_EQ(all.find(rows, &first_row)->value(8, 1), 0.5f);  // (2 - 1) * 0.5
  const TensorView past{.dtype = DType::kBF16, .shape = {9, 32}, .data = values.data() + 8 * 32};
  EXPECT_EQ(all.find(past, &first_row), nullptr);
  const TensorView columns{.dtype = DType::kBF16, .shape = {4, 16}, .data = values.data()};
  EXPECT_EQ(all.find(columns, &first_row), nullptr);
  const TensorView wider{.dtype = DType::kF32, .shape = {4, 32}, .data = values.data()};
  EXPECT_EQ(all.find(wider, &first_row), nullptr);
}

}  // namespace
}  // namespace moeinfer
