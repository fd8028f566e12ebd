// Block-scaled fp8 (e4m3) dequantisation: the e4m3 decoding itself and the block scales at
// shapes that do not divide into whole blocks (DeepSeek-V3's kv_a_proj is 576 rows of 128).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/dtype.h"
#include "model/weight_source.h"

namespace moeinfer {
namespace {

TEST(Fp8, E4m3DecodesKnownValues) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);         // exponent 7 (bias 7), mantissa 0
  EXPECT_EQ(f8e4m3_to_f32(0xB8), -1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7E), 448.0f);       // the largest finite value
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0x3C), 1.5f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7F)));
  EXPECT_EQ(f8e4m3_to_f32(0x00), 0.0f);
}

TEST(Fp8, DequantizesPartialBlocksWithTheirOwnScale) {
  // 5 x 7 weights in 2 x 3 blocks: a 3 x 3 grid of scales, the last row and column partial.
  const int64_t rows = 5, cols = 7, br = 2, bc = 3;
  std::vector<uint8_t> q(rows * cols, 0x38);  // every element 1.0
  std::vector<float> scales(3 * 3);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.5f * static_cast<float>(i + 1);
  std::vector<uint16_t> out(rows * cols, 0xFFFF);
  dequantize_fp8_blocks(q.data(), scales.data(), rows, cols, br, bc, out.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float expected = scales[(r / br) * 3 + c / bc];
      EXPECT_EQ(bf16_to_f32(out[r * cols + c]), expected) << r << "," << c;
    }
  }
}

}  // namespace
}  // namespace moeinfer
