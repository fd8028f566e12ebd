// The quantised skinny GEMM (backend/cuda/skinny_gemm.h: quant_skinny_gemm, a dense Linear held
// as fp8 or int4 codes at decode) and the dequantisation of such a matrix into bf16
// (dequantize_matrix, the other steps' path) against float64 references of the dequantised
// values, on fresh random codes, scales and zero points in expert_quant.h's layout, outputs
// poisoned first:
//   - fp8 and int4, M from 1 to 8 rows, odd N (a partial last block, a warp with one column),
//     K from one 16-byte load a row to several strides of a warp, groups of 8, 32 and 128 (a
//     group smaller than a load: several scales in one 16-byte chunk), strided x and y, float32
//     and bf16 outputs;
//   - each weight the bf16 value the expert GEMM forms (e4m3(code) * scale or (code - zero) *
//     scale in float32, rounded once to bf16), so the reference is exact in its weights: float32
//     outputs within 1e-4 of the natural scale, bf16 within the bf16 contract; the columns past
//     N and the row past M are not written;
//   - dequantize_matrix's values equal those bf16 values bit for bit;
//   - the launchers' refusals, which run without a device too.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/expert_quant.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/skinny_gemm.h"
#include "core/dtype.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaQuantSkinnyGemmChecks, RefusesWhatItDoesNotTake) {
  alignas(16) uint8_t buf[4096] = {};
  const auto* x = reinterpret_cast<const __nv_bfloat16*>(buf);
  const QuantSkinnyGemmParams p{.x = x,
                                .w = buf,
                                .format = ExpertQuant::kFp8,
                                .group = 128,
                                .y = buf,
                                .m = 2,
                                .n = 4,
                                .k = 32};
  EXPECT_TRUE(quant_skinny_gemm_supports(p));
  QuantSkinnyGemmParams q = p;
  q.m = 9;
  EXPECT_FALSE(quant_skinny_gemm_supports(q));
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "m outside [1, 8]");
  q = p;
  q.k = 24;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "multiple of 16 (fp8)");
  q = p;
  q.format = ExpertQuant::kInt4;
  q.k = 48;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "multiple of 32 (int4)");
  q = p;
  q.format = ExpertQuant::kMxfp4;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "format not fp8 or int4");
  q = p;
  q.group = 12;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "group");
  q = p;
  q.ldx = 36;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "ldx");
  q = p;
  q.w = buf + 8;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "16-byte aligned");
  q = p;
  q.ldy = 3;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "ldy < n");
  q = p;
  q.y = nullptr;
  expect_error_naming([&] { quant_skinny_gemm(q, nullptr); }, "y null");
  expect_error_naming(
      [&] {
        dequantize_matrix({.w = buf,
                           .format = ExpertQuant::kMxfp4,
                           .group = 32,
                           .n = 4,
                           .k = 32,
                           .out = reinterpret_cast<__nv_bfloat16*>(buf)},
                          nullptr);
      },
      "is not fp8 or int4");
  expect_error_naming(
      [&] {
        dequantize_matrix({.w = buf,
                           .format = ExpertQuant::kInt4,
                           .group = 128,
                           .n = 4,
                           .k = 12,
                           .out = reinterpret_cast<__nv_bfloat16*>(buf)},
                          nullptr);
      },
      "multiple of 8");
}

// A random slab of `format` [n, k] in groups of `group`, and the bf16 bits of its values.
struct Slab {
  std::vector<uint8_t> bytes;
  std::vector<uint16_t> values;  // [n, k] bf16
};

Slab random_slab(ExpertQuant format, int64_t n, int64_t k, int64_t group, float spread,
                 std::mt19937& rng) {
  const QuantMatrixLayout layout = quant_matrix_layout(format, n, k, group);
  Slab s;
  s.bytes.assign(static_cast<size_t>(layout.bytes), 0);
  s.values.resize(static_cast<size_t>(n * k));
  std::uniform_int_distribution<int> byte(0, 255), nibble(0, 15);
  std::uniform_real_distribution<float> scale_of(0.25f, 1.0f);
  auto* scales = reinterpret_cast<float*>(s.bytes.data() + layout.scale_offset);
  auto* zeros = reinterpret_cast<float*>(s.bytes.data() + layout.zero_offset);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < layout.groups_per_row; ++g) {
      // fp8 codes reach 448: scales of spread / 448; int4 (q - zero) reaches 15.
      const float unit = format == ExpertQuant::kFp8 ? spread / 448.0f : spread / 8.0f;
      scales[r * layout.groups_per_row + g] = unit * scale_of(rng);
      if (format == ExpertQuant::kInt4) zeros[r * layout.groups_per_row + g] = nibble(rng);
    }
    uint8_t* row = s.bytes.data() + r * layout.row_code_bytes;
    for (int64_t c = 0; c < k; ++c) {
      const int64_t g = r * layout.groups_per_row + c / group;
      float value = 0.0f;
      if (format == ExpertQuant::kFp8) {
        uint8_t code = static_cast<uint8_t>(byte(rng));
        if ((code & 0x7f) == 0x7f) code &= 0xfe;  // not NaN
        row[c] = code;
        value = f8e4m3_to_f32(code) * scales[g];
      } else {
        const int code = nibble(rng);
        row[c / 2] |= static_cast<uint8_t>(code << (4 * (c & 1)));
        value = (static_cast<float>(code) - zeros[g]) * scales[g];
      }
      s.values[r * k + c] = f32_to_bf16(value);
    }
  }
  return s;
}

struct Case {
  ExpertQuant format;
  int64_t m, n, k, group;
  int64_t x_pad = 0, y_pad = 0;  // row strides k + x_pad, n + y_pad
  bool f32 = true;
};

std::string name_of(const Case& c) {
  return std::string(expert_quant_name(c.format)) + "_M" + std::to_string(c.m) + "_N" +
         std::to_string(c.n) + "_K" + std::to_string(c.k) + "_G" + std::to_string(c.group) +
         (c.x_pad || c.y_pad ? "_Strided" : "") + (c.f32 ? "_F32" : "_Bf16");
}

void run_case(const Case& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.m * 131 + c.n * 7 + c.k + c.group));
  const int64_t ldx = c.k + c.x_pad, ldy = c.n + c.y_pad;
  const int64_t y_rows = c.m + 1;  // one row past M, to see it untouched
  const auto x_bits = random_bf16(static_cast<size_t>(c.m * ldx), rng);
  const Slab slab =
      random_slab(c.format, c.n, c.k, c.group, 1.0f / std::sqrt(static_cast<float>(c.k)), rng);
  const DeviceBuffer<uint16_t> x(x_bits);
  const DeviceBuffer<uint8_t> w(slab.bytes);
  const std::vector<float> xf = to_float(x_bits), wf = to_float(slab.values);

  // dequantize_matrix: the same bf16 values, bit for bit.
  {
    DeviceBuffer<uint16_t> out(static_cast<size_t>(c.n * c.k));
    out.poison();
    dequantize_matrix({.w = w.get(),
                       .format = c.format,
                       .group = c.group,
                       .n = c.n,
                       .k = c.k,
                       .out = out.as_bf16()},
                      nullptr);
    synchronize();
    const std::vector<uint16_t> got = out.download();
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += got[i] != slab.values[i];
    EXPECT_EQ(differ, 0u) << "dequantize_matrix: " << differ << " of " << got.size() << " values";
  }

  std::vector<double> want(static_cast<size_t>(c.m * c.n)), scale(want.size());
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.n; ++col) {
      double sum = 0, sum2 = 0;
      for (int64_t i = 0; i < c.k; ++i) {
        const double term = double{xf[r * ldx + i]} * wf[col * c.k + i];
        sum += term;
        sum2 += term * term;
      }
      want[r * c.n + col] = sum;
      scale[r * c.n + col] = std::sqrt(sum2);
    }
  }
  const QuantSkinnyGemmParams p{.x = x.as_bf16(),
                                .w = w.get(),
                                .format = c.format,
                                .group = c.group,
                                .m = c.m,
                                .n = c.n,
                                .k = c.k,
                                .ldx = ldx,
                                .ldy = ldy,
                                .y_f32 = c.f32};
  ASSERT_TRUE(quant_skinny_gemm_supports([&] {
    QuantSkinnyGemmParams q = p;
    q.y = x.get();
    return q;
  }()));
  if (c.f32) {
    DeviceBuffer<float> y(static_cast<size_t>(y_rows * ldy));
    y.poison();
    QuantSkinnyGemmParams run = p;
    run.y = y.get();
    quant_skinny_gemm(run, nullptr);
    synchronize();
    const std::vector<float> all = y.download();
    std::vector<float> got(want.size());
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t col = 0; col < c.n; ++col) got[r * c.n + col] = all[r * ldy + col];
      for (int64_t col = c.n; col < ldy; ++col) {
        ASSERT_TRUE(std::isnan(all[r * ldy + col])) << "row " << r << " stride column " << col;
      }
    }
    for (int64_t col = 0; col < ldy; ++col) {
      ASSERT_TRUE(std::isnan(all[c.m * ldy + col])) << "the row past M, column " << col;
    }
    expect_within(
        got, want, [&](size_t i) { return 1e-4 * scale[i] + 1e-30; }, name_of(c).c_str());
  } else {
    DeviceBuffer<uint16_t> y(static_cast<size_t>(y_rows * ldy));
    y.poison();
    QuantSkinnyGemmParams run = p;
    run.y = y.get();
    quant_skinny_gemm(run, nullptr);
    synchronize();
    const std::vector<uint16_t> all = y.download();
    std::vector<uint16_t> got(want.size());
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t col = 0; col < c.n; ++col) got[r * c.n + col] = all[r * ldy + col];
      for (int64_t col = c.n; col < ldy; ++col) {
        ASSERT_EQ(all[r * ldy + col], 0xFFFF) << "row " << r << " stride column " << col;
      }
    }
    for (int64_t col = 0; col < ldy; ++col) {
      ASSERT_EQ(all[c.m * ldy + col], 0xFFFF) << "the row past M, column " << col;
    }
    expect_bf16_near(got, want, scale, name_of(c).c_str());
  }
}

// The decode RMSNorm folded in (QuantSkinnyGemmParams::norm): the same bits as fused_add_rms_norm
// followed by the product over its output, the normed rows and the residual sum included.
void folded_norm_matches_two_launches(ExpertQuant format, int64_t m, int64_t n, int64_t k) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(m * 131 + n * 7 + k));
  const Slab slab = random_slab(format, n, k, 128, 1.0f / std::sqrt(static_cast<float>(k)), rng);
  const DeviceBuffer<uint8_t> w(slab.bytes);
  auto floats = [&](float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(static_cast<size_t>(m * k));
    for (float& x : v) x = dist(rng);
    return v;
  };
  const DeviceBuffer<float> residual(floats(1.0f)), add(floats(0.5f));
  const DeviceBuffer<uint16_t> weight(random_bf16(static_cast<size_t>(k), rng));
  DeviceBuffer<float> sum_want(m * k), sum_got(m * k), y_want(m * n), y_got(m * n);
  DeviceBuffer<uint16_t> normed_want(m * k), normed_got(m * k);
  for (auto* b : {&sum_want, &sum_got, &y_want, &y_got}) b->poison();
  normed_want.poison();
  normed_got.poison();
  fused_add_rms_norm({.x = add.get(),
                      .residual = residual.get(),
                      .residual_out = sum_want.get(),
                      .weight = weight.as_bf16(),
                      .out = normed_want.as_bf16(),
                      .num_rows = m,
                      .hidden_size = k},
                     nullptr);
  QuantSkinnyGemmParams p{.x = normed_want.as_bf16(),
                          .w = w.get(),
                          .format = format,
                          .group = 128,
                          .y = y_want.get(),
                          .m = m,
                          .n = n,
                          .k = k,
                          .y_f32 = true};
  quant_skinny_gemm(p, nullptr);
  p.x = nullptr;
  p.y = y_got.get();
  p.norm = {.x = add.get(),
            .residual = residual.get(),
            .residual_out = sum_got.get(),
            .weight = weight.as_bf16(),
            .out = normed_got.as_bf16(),
            .num_rows = m,
            .hidden_size = k};
  quant_skinny_gemm(p, nullptr);
  synchronize();
  const std::string name = std::string(expert_quant_name(format)) + " M" + std::to_string(m);
  EXPECT_EQ(y_got.download(), y_want.download()) << name << ": the products differ";
  EXPECT_EQ(normed_got.download(), normed_want.download()) << name << ": norm.out";
  EXPECT_EQ(sum_got.download(), sum_want.download()) << name << ": residual_out";
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("quantised skinny GEMM")) return false;
  for (const ExpertQuant f : {ExpertQuant::kFp8, ExpertQuant::kInt4}) {
    for (const int64_t m : {1, 6}) {
      register_kernel_test(
          "CudaQuantSkinnyGemm",
          std::string("FoldedNorm_") + expert_quant_name(f) + "_M" + std::to_string(m),
          [f, m] { folded_norm_matches_two_launches(f, m, 2048 + 3, 2048); }, __FILE__, __LINE__);
    }
  }
  std::vector<Case> cases;
  for (const ExpertQuant f : {ExpertQuant::kFp8, ExpertQuant::kInt4}) {
    for (const int64_t m : {1, 2, 3, 4, 5, 6, 7, 8}) {
      cases.push_back({.format = f, .m = m, .n = 5120, .k = 2048, .group = 128});  // QKV
      cases.push_back({.format = f, .m = m, .n = 129, .k = 288, .group = 32, .f32 = false});
      cases.push_back({.format = f, .m = m, .n = 33, .k = 1056, .group = 8});
    }
    cases.push_back({.format = f, .m = 1, .n = 1, .k = 32, .group = 128});  // a partial group
    cases.push_back(
        {.format = f, .m = 8, .n = 17, .k = 2080, .group = 128, .x_pad = 24, .y_pad = 5});
    cases.push_back({.format = f,
                     .m = 4,
                     .n = 2047,
                     .k = 4096,
                     .group = 128,
                     .x_pad = 8,
                     .y_pad = 3,
                     .f32 = false});  // Qwen3-30B-A3B's O projection, N odd
    cases.push_back({.format = f, .m = 3, .n = 101, .k = 96, .group = 16});
  }
  for (const Case& c : cases) {
    register_kernel_test(
        "CudaQuantSkinnyGemm", name_of(c), [c] { run_case(c); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
