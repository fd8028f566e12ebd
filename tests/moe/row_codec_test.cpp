// The encodings of expert parallelism's dispatched rows (moe/row_codec.h, --dispatch-dtype) and
// the float8_e4m3fn rounding under them (core/dtype.h): values each format holds come back
// exactly, the rest within the stated bound (bf16: half an ulp, |x| * 2^-8; fp8: |x| * 2^-4 or
// scale * 2^-10 in the subnormals), rows of zeros, and rows of huge and tiny magnitudes. Random
// rows at awkward sizes, with the seed printed.
#include "moe/row_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer::moe {
namespace {

constexpr DispatchDtype kAll[] = {DispatchDtype::kF32, DispatchDtype::kBF16, DispatchDtype::kFp8};

// decode(encode(row)), the encoded bytes poisoned first.
std::vector<float> round_trip(DispatchDtype dtype, const std::vector<float>& row) {
  const int64_t H = static_cast<int64_t>(row.size());
  std::vector<std::byte> wire(static_cast<size_t>(encoded_row_bytes(dtype, H)), std::byte{0xa5});
  encode_row(dtype, row.data(), H, wire.data());
  std::vector<float> back(row.size(), std::numeric_limits<float>::quiet_NaN());
  decode_row(dtype, wire.data(), H, back.data());
  return back;
}

float fp8_scale(const std::vector<float>& row) {
  std::vector<std::byte> wire(static_cast<size_t>(
      encoded_row_bytes(DispatchDtype::kFp8, static_cast<int64_t>(row.size()))));
  encode_row(DispatchDtype::kFp8, row.data(), static_cast<int64_t>(row.size()), wire.data());
  float scale;
  std::memcpy(&scale, wire.data(), sizeof(scale));
  return scale;
}

TEST(F32ToF8E4M3, EveryFiniteValueComesBackToItsOwnBits) {
  for (int bits = 0; bits < 256; ++bits) {
    if ((bits & 0x7f) == 0x7f) continue;  // NaN
    const float value = f8e4m3_to_f32(static_cast<uint8_t>(bits));
    const uint8_t again = f32_to_f8e4m3(value);
    if (bits == 0x80) {  // -0 keeps its sign
      EXPECT_EQ(again, 0x80);
      continue;
    }
    EXPECT_EQ(again, bits) << value;
  }
}

TEST(F32ToF8E4M3, RoundsToNearestEvenAndSaturates) {
  // Between neighbours a < b (normal and subnormal), the midpoint goes to the one with an even
  // mantissa, and anything off the midpoint to the nearer.
  for (int bits = 1; bits < 0x7e; ++bits) {
    const float a = f8e4m3_to_f32(static_cast<uint8_t>(bits));
    const float b = f8e4m3_to_f32(static_cast<uint8_t>(bits + 1));
    const float mid = 0.5f * (a + b);
    EXPECT_EQ(f32_to_f8e4m3(mid), (bits & 1) == 0 ? bits : bits + 1) << a << " .. " << b;
    EXPECT_EQ(f32_to_f8e4m3(std::nextafter(mid, a)), bits) << mid;
    EXPECT_EQ(f32_to_f8e4m3(std::nextafter(mid, b)), bits + 1) << mid;
    EXPECT_EQ(f32_to_f8e4m3(-mid), 0x80 | ((bits & 1) == 0 ? bits : bits + 1));
  }
  EXPECT_EQ(f32_to_f8e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(460.0f), 0x7e);  // beyond the largest finite: saturates, not NaN
  EXPECT_EQ(f32_to_f8e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(f32_to_f8e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(f32_to_f8e4m3(std::nanf("")))));
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: even
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(f32_to_f8e4m3(1e-30f), 0x00);
}

TEST(RowCodec, BytesPerRow) {
  for (const int64_t H : {1, 19, 99, 989}) {
    EXPECT_EQ(encoded_row_bytes(DispatchDtype::kF32, H), 4 * H);
    EXPECT_EQ(encoded_row_bytes(DispatchDtype::kBF16, H), 2 * H);
    EXPECT_EQ(encoded_row_bytes(DispatchDtype::kFp8, H), 4 + H);
  }
}

TEST(RowCodec, ParsesTheFlagsValuesAndNamesTheFlagOtherwise) {
  for (const DispatchDtype dtype : kAll) {
    EXPECT_EQ(parse_dispatch_dtype(dispatch_dtype_name(dtype)), dtype);
  }
  try {
    parse_dispatch_dtype("fp16");
    ADD_FAILURE() << "fp16 was accepted";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("--dispatch-dtype 'fp16'"), std::string::npos) << message;
    EXPECT_NE(message.find("f32, bf16 or fp8"), std::string::npos) << message;
  }
}

TEST(RowCodec, ValuesEachFormatHoldsComeBackExactly) {
  // Any float32 through f32; bf16's values through bf16.
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> row(99);
  for (float& v : row) v = normal(rng);
  std::vector<float> back = round_trip(DispatchDtype::kF32, row);
  EXPECT_EQ(0, std::memcmp(back.data(), row.data(), row.size() * sizeof(float)));
  for (float& v : row) v = bf16_to_f32(f32_to_bf16(v));
  EXPECT_EQ(round_trip(DispatchDtype::kBF16, row), row);
  // fp8: a row whose largest magnitude is 448 * 2^k has the scale 2^k exactly, and then every
  // value of the e4m3 grid times 2^k comes back (k = 0, and far out both ways).
  for (const int k : {0, -100, 90}) {
    std::vector<float> grid;
    for (int bits = 0; bits < 256; ++bits) {
      if ((bits & 0x7f) == 0x7f) continue;
      grid.push_back(std::ldexp(f8e4m3_to_f32(static_cast<uint8_t>(bits)), k));
    }
    EXPECT_EQ(fp8_scale(grid), std::ldexp(1.0f, k)) << k;
    EXPECT_EQ(round_trip(DispatchDtype::kFp8, grid), grid) << "k = " << k;
  }
}

TEST(RowCodec, ZeroRowsStayZeroWithScaleOne) {
  for (const int64_t H : {1, 19}) {
    const std::vector<float> zeros(static_cast<size_t>(H), 0.0f);
    for (const DispatchDtype dtype : kAll) {
      EXPECT_EQ(round_trip(dtype, zeros), zeros) << dispatch_dtype_name(dtype);
    }
    EXPECT_EQ(fp8_scale(zeros), 1.0f);
  }
}

// Random rows whose magnitudes span many octaves (some tiny beside their row's largest value,
// which puts them in e4m3's subnormals), times an overall magnitude from 1e-30 to 1e30: each
// value within its bound.
TEST(RowCodec, LossyFormatsStayWithinTheirBounds) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> octaves(-12.0f, 4.0f);
  for (const float magnitude : {1e-30f, 1e-6f, 1.0f, 3.0e4f, 1e30f}) {
    for (const int64_t H : {1, 19, 99, 989}) {
      std::vector<float> row(static_cast<size_t>(H));
      for (float& v : row) v = magnitude * normal(rng) * std::exp2(octaves(rng));
      float amax = 0.0f;
      for (const float v : row) amax = std::max(amax, std::fabs(v));

      const std::vector<float> bf16 = round_trip(DispatchDtype::kBF16, row);
      for (int64_t h = 0; h < H; ++h) {
        EXPECT_LE(std::fabs(bf16[h] - row[h]), std::ldexp(std::fabs(row[h]), -8))
            << "bf16 H " << H << " value " << row[h];
      }

      const float scale = fp8_scale(row);
      EXPECT_FLOAT_EQ(scale, amax / 448.0f);
      const std::vector<float> fp8 = round_trip(DispatchDtype::kFp8, row);
      float worst = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        // Half an e4m3 ulp relative (3 mantissa bits) or absolute in the subnormals, with 1e-5
        // of slack for the float32 division and product around it.
        const float bound =
            std::max(std::ldexp(std::fabs(row[h]), -4), std::ldexp(scale, -10)) * (1.0f + 1e-5f);
        const float err = std::fabs(fp8[h] - row[h]);
        EXPECT_LE(err, bound) << "fp8 H " << H << " value " << row[h] << " scale " << scale;
        worst = std::max(worst, err);
      }
      // Per row: no value off by more than 1/16 of the row's largest.
      EXPECT_LE(worst, amax * (0.0625f + 1e-5f)) << "H " << H;
    }
  }
}

}  // namespace
}  // namespace moeinfer::moe
