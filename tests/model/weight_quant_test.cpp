// --weights fp8 / int4: the two quantisers on their own (block and group edges, zero and constant
// blocks, saturation, exact values, the half-step error bounds) and a fixture loaded with each
// format, whose routed experts alone change and whose logits stay near the checkpoint's.
#include "model/weight_quant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kv/kv_cache.h"
#include "model/model.h"

namespace moeinfer {
namespace {

std::vector<float> random_values(int64_t n, float spread, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, spread);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

uint32_t fresh_seed() {
  const uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  return seed;
}

// Half the spacing of e4m3 values around x (|x| <= 448): 2^-10 among the subnormals, else half
// of 2^(floor(log2 |x|) - 3).
float e4m3_half_ulp(float x) {
  const float m = std::fabs(x);
  if (m < 0.015625f) return std::ldexp(1.0f, -10);
  int e = 0;
  std::frexp(m, &e);
  return std::ldexp(1.0f, e - 1 - 4);
}

TEST(E4m3Encode, EveryFiniteCodeRoundTrips) {
  for (int i = 0; i < 256; ++i) {
    const uint8_t code = static_cast<uint8_t>(i);
    const float value = f8e4m3_to_f32(code);
    if (std::isnan(value)) continue;
    const uint8_t back = f32_to_f8e4m3(value);
    if (value == 0.0f) {
      EXPECT_EQ(f8e4m3_to_f32(back), 0.0f);
      EXPECT_EQ(std::signbit(f8e4m3_to_f32(back)), std::signbit(value));
    } else {
      EXPECT_EQ(back, code) << value;
    }
  }
}

TEST(E4m3Encode, RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1.0625f)), 1.0f);   // halfway 1 and 1.125: even (1)
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1.1875f)), 1.25f);  // halfway 1.125 and 1.25: even
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1.07f)), 1.125f);
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(15.5f)), 16.0f);  // rounds up into the next binade
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(std::ldexp(3.0f, -11))), std::ldexp(1.0f, -9));
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(std::ldexp(1.0f, -10))), 0.0f);  // tie to even (0)
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(std::ldexp(15.5f, -10))), std::ldexp(1.0f, -6));
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(447.0f)), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(460.0f)), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1e9f)), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(-INFINITY)), -448.0f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(f32_to_f8e4m3(NAN))));
}

TEST(Fp8Blocks, PartialBlocksScaleByTheirOwnMaximum) {
  // 130 x 257 in blocks of 128: a 2 x 3 grid, the last row and column of blocks partial; each
  // block's values spread by its own factor so that a shared scale would show.
  const uint32_t seed = fresh_seed();
  const int64_t rows = 130, cols = 257;
  std::vector<float> w = random_values(rows * cols, 1.0f, seed);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] *= std::ldexp(1.0f, (r / 128) * 3 + c / 128);
  }
  std::vector<float> out(w.size(), NAN), scales(2 * 3, NAN);
  fake_quantize_fp8_blocks(w.data(), rows, cols, 128, 128, out.data(), scales.data());
  for (int64_t br = 0; br < 2; ++br) {
    for (int64_t bc = 0; bc < 3; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r) {
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          amax = std::max(amax, std::fabs(w[r * cols + c]));
        }
      }
      EXPECT_EQ(scales[br * 3 + bc], amax / 448.0f) << br << "," << bc;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float scale = scales[(r / 128) * 3 + c / 128];
      const float x = w[r * cols + c] / scale;
      const float q = out[r * cols + c] / scale;
      // The value is an e4m3 value times the scale (up to the float rounding of the product and
      // of this division), within half an e4m3 step of w / scale.
      EXPECT_NEAR(f8e4m3_to_f32(f32_to_f8e4m3(q)), q, 1e-6f * std::fabs(q)) << r << "," << c;
      EXPECT_LE(std::fabs(x - q), e4m3_half_ulp(x) * (1 + 1e-5f)) << r << "," << c;
    }
  }
}

TEST(Fp8Blocks, ZeroBlocksAndExactValues) {
  // 3 x 5 in blocks of 2 x 2: block (0, 0) all zero (scale 1), block (0, 1) holds e4m3 values
  // times a power of two with 448 x that power as its maximum, which come back exactly.
  const int64_t rows = 3, cols = 5;
  std::vector<float> w(rows * cols, 0.0f);
  const float exact[] = {448.0f, -1.5f, 0.875f, std::ldexp(3.0f, -9)};
  w[0 * cols + 2] = exact[0] / 64;
  w[0 * cols + 3] = exact[1] / 64;
  w[1 * cols + 2] = exact[2] / 64;
  w[1 * cols + 3] = exact[3] / 64;
  w[2 * cols + 4] = -3.0f;  // a block of one value: -448 x (3 / 448)
  std::vector<float> out(w.size(), NAN), scales(2 * 3, NAN);
  fake_quantize_fp8_blocks(w.data(), rows, cols, 2, 2, out.data(), scales.data());
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(scales[1], 1.0f / 64);
  for (size_t i = 0; i < w.size(); ++i) EXPECT_EQ(out[i], w[i]) << i;
}

TEST(Fp8Blocks, InPlace) {
  std::vector<float> w = random_values(40 * 9, 0.1f, fresh_seed());
  std::vector<float> out(w.size());
  fake_quantize_fp8_blocks(w.data(), 40, 9, 16, 4, out.data());
  fake_quantize_fp8_blocks(w.data(), 40, 9, 16, 4, w.data());
  EXPECT_EQ(w, out);
}

TEST(Int4Groups, WithinHalfAStepAndShortGroups) {
  // Rows of 301: groups of 128, 128 and 45; values all of one sign in some rows (the range then
  // takes in 0), spread per group.
  const uint32_t seed = fresh_seed();
  const int64_t rows = 7, cols = 301, groups = 3;
  std::vector<float> w = random_values(rows * cols, 0.02f, seed);
  for (int64_t c = 0; c < cols; ++c) {
    w[2 * cols + c] = std::fabs(w[2 * cols + c]) + 0.5f;
    w[3 * cols + c] = -std::fabs(w[3 * cols + c]) - 0.01f;
  }
  std::vector<float> out(w.size(), NAN), scales(rows * groups, NAN);
  std::vector<int32_t> zeros(rows * groups, -1);
  fake_quantize_int4_groups(w.data(), rows, cols, 128, out.data(), scales.data(), zeros.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * 128, c1 = std::min(cols, c0 + 128);
      float lo = 0.0f, hi = 0.0f;
      for (int64_t c = c0; c < c1; ++c) {
        lo = std::min(lo, w[r * cols + c]);
        hi = std::max(hi, w[r * cols + c]);
      }
      const float scale = scales[r * groups + g];
      const int32_t zero = zeros[r * groups + g];
      EXPECT_EQ(scale, (hi - lo) / 15.0f) << r << "," << g;
      EXPECT_GE(zero, 0);
      EXPECT_LE(zero, 15);
      for (int64_t c = c0; c < c1; ++c) {
        const float v = out[r * cols + c];
        const float code = v / scale + static_cast<float>(zero);
        EXPECT_NEAR(code, std::nearbyint(code), 1e-3f) << r << "," << c;
        EXPECT_GE(std::nearbyint(code), 0.0f);
        EXPECT_LE(std::nearbyint(code), 15.0f);
        EXPECT_LE(std::fabs(w[r * cols + c] - v), scale / 2 * (1 + 1e-5f)) << r << "," << c;
      }
    }
  }
}

TEST(Int4Groups, ConstantGroupsAndGridValuesComeBackExactly) {
  // Row 0: four groups of 4, each constant (positive, negative, zero, a subnormal-free tiny);
  // row 1: values on the grid of scale 1/8 from -1 to 14/8 (15 steps), which are exact.
  const int64_t cols = 16;
  std::vector<float> w(2 * cols);
  for (int c = 0; c < 4; ++c) {
    w[c] = 0.3f;
    w[4 + c] = -1.7f;
    w[8 + c] = 0.0f;
    w[12 + c] = 1e-7f;
  }
  for (int c = 0; c < cols; ++c) w[cols + c] = static_cast<float>(std::min(c, 15) - 8) / 8.0f;
  w[cols + 15] = 7.0f / 8.0f;
  std::vector<float> out(w.size(), NAN);
  fake_quantize_int4_groups(w.data(), 1, cols, 4, out.data());
  for (int c = 0; c < cols; ++c) EXPECT_EQ(out[c], w[c]) << c;
  fake_quantize_int4_groups(w.data() + cols, 1, cols, cols, out.data() + cols);
  for (int c = 0; c < cols; ++c) EXPECT_EQ(out[cols + c], w[cols + c]) << c;
}

TEST(WeightFormat, ParsesItsNames) {
  EXPECT_EQ(parse_weight_format(""), WeightFormat::kCheckpoint);
  EXPECT_EQ(parse_weight_format("fp8"), WeightFormat::kFp8);
  EXPECT_EQ(parse_weight_format("int4"), WeightFormat::kInt4);
  EXPECT_EQ(parse_weight_format("bf16"), WeightFormat::kBf16);
  EXPECT_THROW(parse_weight_format("int8"), Error);
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kFp8, WeightFormat::kInt4}) {
    EXPECT_EQ(parse_weight_format(weight_format_name(f)), f);
  }
}

// ---- a fixture loaded with --weights ----

std::filesystem::path fixture(const char* name) {
  return std::filesystem::path(MOE_FIXTURES_DIR) / "models" / name;
}

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape &&
         (a.data == b.data ||
          (a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0));
}

std::vector<float> to_f32(const TensorView& v) {
  std::vector<float> out(v.numel());
  convert_to_f32(v.dtype, v.data, out.data(), out.size());
  return out;
}

std::vector<float> logits_of(Model& model, std::span<const int32_t> tokens) {
  Decoder& decoder = model.decoder();
  KvCache cache = decoder.make_cache(64);
  std::vector<float> logits(tokens.size() * model.config().vocab_size);
  decoder.forward(tokens, cache, logits, /*all_positions=*/true);
  return logits;
}

void expect_only_routed_experts_change(const char* name, WeightFormat format,
                                       double logit_tolerance) {
  SCOPED_TRACE(name);
  auto base = Model::load(fixture(name), LoadOptions{.prefault = false});
  auto quant = Model::load(fixture(name), LoadOptions{.prefault = false, .expert_weights = format});
  const DecoderWeights& a = base->decoder().weights();
  const DecoderWeights& b = quant->decoder().weights();
  EXPECT_TRUE(same_bytes(a.embed_tokens, b.embed_tokens));
  EXPECT_TRUE(same_bytes(a.lm_head, b.lm_head));
  ASSERT_EQ(a.layers.size(), b.layers.size());
  int64_t moe_layers = 0, dense_layers = 0, shared = 0;
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerWeights& x = a.layers[l];
    const LayerWeights& y = b.layers[l];
    for (auto member : {&AttentionWeights::q_proj, &AttentionWeights::k_proj,
                        &AttentionWeights::v_proj, &AttentionWeights::o_proj}) {
      EXPECT_TRUE(same_bytes(x.attention.*member, y.attention.*member)) << l;
    }
    for (auto member : {&MlpWeights::gate_proj, &MlpWeights::up_proj, &MlpWeights::down_proj}) {
      EXPECT_TRUE(same_bytes(x.mlp.*member, y.mlp.*member)) << l;
      EXPECT_TRUE(same_bytes(x.moe.shared_expert.*member, y.moe.shared_expert.*member)) << l;
    }
    if (!x.is_moe) {
      ++dense_layers;
      continue;
    }
    ++moe_layers;
    shared += !x.moe.shared_expert.gate_proj.empty();
    EXPECT_TRUE(same_bytes(x.moe.routed.router, y.moe.routed.router)) << l;
    ASSERT_EQ(x.moe.routed.experts.size(), y.moe.routed.experts.size());
    for (size_t e = 0; e < x.moe.routed.experts.size(); ++e) {
      const moe::ExpertWeights& ex = x.moe.routed.experts[e];
      const moe::ExpertWeights& ey = y.moe.routed.experts[e];
      for (auto member :
           {&moe::ExpertWeights::gate, &moe::ExpertWeights::up, &moe::ExpertWeights::down}) {
        const TensorView& before = ex.*member;
        const TensorView& after = ey.*member;
        ASSERT_EQ(before.shape, after.shape);
        std::vector<float> expected = to_f32(before);
        const int64_t rows = before.shape[0], cols = before.shape[1];
        if (format == WeightFormat::kFp8) {
          fake_quantize_fp8_blocks(expected.data(), rows, cols, 128, 128, expected.data());
        } else {
          fake_quantize_int4_groups(expected.data(), rows, cols, 128, expected.data());
        }
        const std::vector<float> got = to_f32(after);
        EXPECT_NE(got, to_f32(before)) << "layer " << l << " expert " << e;
        if (after.dtype == DType::kF32) {
          EXPECT_EQ(got, expected) << "layer " << l << " expert " << e;
        }
      }
    }
  }
  EXPECT_GT(moe_layers, 0);
  const int32_t tokens[] = {1, 17, 42, 99, 7, 250, 3, 11, 64, 128, 5, 300};
  const std::vector<float> x = logits_of(*base, tokens);
  const std::vector<float> y = logits_of(*quant, tokens);
  double norm = 0.0, diff = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    norm += double{x[i]} * x[i];
    diff += (double{x[i]} - y[i]) * (double{x[i]} - y[i]);
  }
  const double relative = std::sqrt(diff / norm);
  std::printf(
      "%s %s: ||quantised - checkpoint|| / ||checkpoint|| of the logits %.4f (%lld dense "
      "layers, %lld with shared experts)\n",
      name, std::string(weight_format_name(format)).c_str(), relative,
      static_cast<long long>(dense_layers), static_cast<long long>(shared));
  EXPECT_GT(relative, 0.0);
  EXPECT_LE(relative, logit_tolerance);
}

// Loose bounds on the relative L2 difference of all 12 positions' logits (random-weight
// fixtures, where a routing choice may flip at a near tie): fp8 keeps 3 mantissa bits (half-step
// 1/16 relative), int4 16 levels a group.
TEST(WeightQuantModel, Fp8ChangesOnlyTheRoutedExperts) {
  expect_only_routed_experts_change("qwen3_moe_f32", WeightFormat::kFp8, 0.1);
  expect_only_routed_experts_change("qwen2_moe_f32", WeightFormat::kFp8, 0.1);
}

TEST(WeightQuantModel, Int4ChangesOnlyTheRoutedExperts) {
  expect_only_routed_experts_change("qwen3_moe_f32", WeightFormat::kInt4, 0.2);
  expect_only_routed_experts_change("qwen2_moe_f32", WeightFormat::kInt4, 0.2);
}

TEST(WeightQuantModel, QuantisedCheckpointsAreRefused) {
  for (const char* name : {"deepseek_v3_fp8", "gpt_oss_mxfp4"}) {
    for (WeightFormat f : {WeightFormat::kFp8, WeightFormat::kInt4}) {
      try {
        Model::load(fixture(name), LoadOptions{.prefault = false, .expert_weights = f});
        ADD_FAILURE() << name << " accepted --weights " << weight_format_name(f);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("--weights " + std::string(weight_format_name(f))),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find(name[0] == 'd' ? "fp8" : "MXFP4"), std::string::npos)
            << e.what();
      }
    }
    // bf16 is what such a checkpoint is dequantised to anyway: accepted.
    EXPECT_NO_THROW(Model::load(
        fixture(name), LoadOptions{.prefault = false, .expert_weights = WeightFormat::kBf16}));
  }
}

// A synthetic model takes --weights fp8|int4 (random codes on the GPU) unless its experts are
// offloaded (the expert cache holds bf16), and refuses --weights bf16 as cuda does for a
// checkpoint; each refusal names the flag.
TEST(SyntheticWeightFormat, TakesFp8AndInt4RefusesBf16AndOffloadedCodes) {
  for (WeightFormat format : {WeightFormat::kCheckpoint, WeightFormat::kFp8, WeightFormat::kInt4}) {
    EXPECT_NO_THROW(check_synthetic_weight_format(format, "qwen3-30b-a3b", false))
        << weight_format_name(format);
  }
  EXPECT_NO_THROW(check_synthetic_weight_format(WeightFormat::kCheckpoint, "qwen3-30b-a3b", true));
  auto message = [](WeightFormat format, bool offload) {
    try {
      check_synthetic_weight_format(format, "qwen3-30b-a3b", offload);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  for (WeightFormat format : {WeightFormat::kFp8, WeightFormat::kInt4}) {
    const std::string flag = "--weights " + std::string(weight_format_name(format));
    EXPECT_NE(message(format, true).find(flag + " with --expert-budget"), std::string::npos)
        << message(format, true);
  }
  for (bool offload : {false, true}) {
    EXPECT_NE(message(WeightFormat::kBf16, offload).find("--weights bf16 applies to the CPU"),
              std::string::npos)
        << message(WeightFormat::kBf16, offload);
  }
}

}  // namespace
}  // namespace moeinfer
