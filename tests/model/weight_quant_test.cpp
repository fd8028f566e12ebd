// --weights fp8 / int4: the two quantisers on their own (block and group edges, zero and constant
// blocks, saturation, exact values, the half-step error bounds) and a fixture loaded with each
// format, whose routed experts alone change and whose logits stay near the checkpoint's; with
// --weights-scope linear, exactly the dense Linears change too (not the embeddings, the LM head,
// norms, routers or gates), each one to its own quantise-dequantise, and the logits are those of
// a decoder built from those values directly.
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
#include "model/quantized_matrix.h"

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

// ---- --weights-scope ----

TEST(WeightScope, ParsesItsNames) {
  EXPECT_EQ(parse_weight_scope(""), WeightScope::kExperts);
  EXPECT_EQ(parse_weight_scope("experts"), WeightScope::kExperts);
  EXPECT_EQ(parse_weight_scope("linear"), WeightScope::kLinear);
  for (WeightScope scope : {WeightScope::kExperts, WeightScope::kLinear}) {
    EXPECT_EQ(parse_weight_scope(weight_scope_name(scope)), scope);
  }
  try {
    parse_weight_scope("all");
    ADD_FAILURE() << "--weights-scope all accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--weights-scope all"), std::string::npos) << e.what();
  }
}

TEST(WeightScope, LinearNeedsFp8OrInt4NamingBothFlags) {
  for (WeightFormat f :
       {WeightFormat::kCheckpoint, WeightFormat::kBf16, WeightFormat::kFp8, WeightFormat::kInt4}) {
    EXPECT_NO_THROW(check_weight_scope(f, WeightScope::kExperts)) << weight_format_name(f);
  }
  EXPECT_NO_THROW(check_weight_scope(WeightFormat::kFp8, WeightScope::kLinear));
  EXPECT_NO_THROW(check_weight_scope(WeightFormat::kInt4, WeightScope::kLinear));
  for (WeightFormat f : {WeightFormat::kCheckpoint, WeightFormat::kBf16}) {
    try {
      check_weight_scope(f, WeightScope::kLinear);
      ADD_FAILURE() << "--weights-scope linear accepted with '" << weight_format_name(f) << "'";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("--weights-scope linear"), std::string::npos) << message;
      EXPECT_NE(message.find("--weights fp8"), std::string::npos) << message;
    }
  }
  // The load refuses it too, before binding anything.
  EXPECT_THROW(Model::load(fixture("qwen3_moe_bf16"),
                           LoadOptions{.prefault = false, .weight_scope = WeightScope::kLinear}),
               Error);
}

// The reference: `values` of a [rows, cols] matrix quantised and dequantised as the format's
// loader does, each matrix on its own.
void fake_quantize(WeightFormat format, std::vector<float>& values, int64_t rows, int64_t cols) {
  if (format == WeightFormat::kFp8) {
    fake_quantize_fp8_blocks(values.data(), rows, cols, 128, 128, values.data());
  } else {
    fake_quantize_int4_groups(values.data(), rows, cols, 128, values.data());
  }
}

// The views a linear scope must leave alone, in both models' weights, as pairs.
std::vector<std::pair<const TensorView*, const TensorView*>> untouched_views(
    const DecoderWeights& a, const DecoderWeights& b) {
  std::vector<std::pair<const TensorView*, const TensorView*>> out = {
      {&a.embed_tokens, &b.embed_tokens}, {&a.lm_head, &b.lm_head}, {&a.final_norm, &b.final_norm}};
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerWeights& x = a.layers[l];
    const LayerWeights& y = b.layers[l];
    for (auto m : {&LayerWeights::input_norm, &LayerWeights::post_attention_norm}) {
      out.push_back({&(x.*m), &(y.*m)});
    }
    for (auto m : {&AttentionWeights::q_norm, &AttentionWeights::k_norm, &AttentionWeights::q_bias,
                   &AttentionWeights::k_bias, &AttentionWeights::v_bias, &AttentionWeights::o_bias,
                   &AttentionWeights::sinks}) {
      out.push_back({&(x.attention.*m), &(y.attention.*m)});
    }
    for (auto m : {&MlaWeights::q_a_norm, &MlaWeights::kv_a_norm}) {
      out.push_back({&(x.mla.*m), &(y.mla.*m)});
    }
    for (auto m : {&LinearAttentionWeights::conv1d, &LinearAttentionWeights::dt_bias,
                   &LinearAttentionWeights::a_log, &LinearAttentionWeights::norm}) {
      out.push_back({&(x.linear_attention.*m), &(y.linear_attention.*m)});
    }
    out.push_back({&x.moe.routed.router, &y.moe.routed.router});
    out.push_back({&x.moe.shared_expert_gate, &y.moe.shared_expert_gate});
    out.push_back({&x.moe.selection_bias, &y.moe.selection_bias});
    out.push_back({&x.moe.router_bias, &y.moe.router_bias});
  }
  return out;
}

// Loads `name` with --weights `format` --weights-scope linear and holds it to the checkpoint:
// every dense Linear view (dense_linear_views) changed to its own quantise-dequantise (exactly,
// for a float32 fixture) with a record of its codes, the routed experts quantised as under the
// experts scope, everything else the same bytes; and its logits to a decoder built from the
// checkpoint's weights quantised here, directly.
void expect_linear_scope(const char* name, WeightFormat format, double logit_tolerance) {
  SCOPED_TRACE(std::string(name) + " " + std::string(weight_format_name(format)));
  auto base = Model::load(fixture(name), LoadOptions{.prefault = false});
  auto quant = Model::load(fixture(name), LoadOptions{.prefault = false,
                                                      .expert_weights = format,
                                                      .weight_scope = WeightScope::kLinear});
  DecoderWeights a = base->decoder().weights();
  DecoderWeights b = quant->decoder().weights();
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (const auto& [x, y] : untouched_views(a, b)) EXPECT_TRUE(same_bytes(*x, *y));

  // The reference decoder's weights: the checkpoint's, each dense Linear and routed expert
  // replaced by float32 values quantised here.
  DecoderWeights reference = a;
  // Values held in the dtype the loader gives them (bf16 for a bf16 checkpoint: rounded once).
  std::vector<std::vector<float>> owned;
  std::vector<std::vector<uint16_t>> owned_bf16;
  auto held_as = [&](DType dtype, std::vector<float> values, const Shape& shape) {
    if (dtype == DType::kBF16) {
      std::vector<uint16_t> rounded(values.size());
      for (size_t j = 0; j < values.size(); ++j) rounded[j] = f32_to_bf16(values[j]);
      owned_bf16.push_back(std::move(rounded));
      return TensorView{.dtype = dtype, .shape = shape, .data = owned_bf16.back().data()};
    }
    owned.push_back(std::move(values));
    return TensorView{.dtype = DType::kF32, .shape = shape, .data = owned.back().data()};
  };
  const std::vector<TensorView*> before = dense_linear_views(a);
  const std::vector<TensorView*> after = dense_linear_views(b);
  const std::vector<TensorView*> ref_views = dense_linear_views(reference);
  ASSERT_EQ(before.size(), after.size());
  ASSERT_GT(before.size(), 0u);
  for (size_t i = 0; i < before.size(); ++i) {
    const TensorView& x = *before[i];
    const TensorView& y = *after[i];
    ASSERT_EQ(x.shape, y.shape) << i;
    const int64_t rows = x.shape[0], cols = x.shape[1];
    std::vector<float> expected = to_f32(x);
    fake_quantize(format, expected, rows, cols);
    const std::vector<float> got = to_f32(y);
    EXPECT_NE(got, to_f32(x)) << "dense view " << i;
    if (y.dtype == DType::kF32) {
      EXPECT_EQ(got, expected) << "dense view " << i;
    } else {
      for (size_t j = 0; j < got.size(); ++j) {
        EXPECT_EQ(got[j], bf16_to_f32(f32_to_bf16(expected[j]))) << "dense view " << i << " " << j;
      }
    }
    int64_t first_row = -1;
    ASSERT_NE(b.quantized, nullptr);
    const QuantizedMatrix* record = b.quantized->find(y, &first_row);
    ASSERT_NE(record, nullptr) << "dense view " << i << " has no codes";
    EXPECT_EQ(first_row, 0);
    EXPECT_EQ(record->format, format == WeightFormat::kFp8 ? CodeFormat::kFp8 : CodeFormat::kInt4);
    EXPECT_FLOAT_EQ(record->value(rows - 1, cols - 1), expected.back());
    *ref_views[i] = held_as(y.dtype, std::move(expected), x.shape);
  }
  for (size_t l = 0; l < a.layers.size(); ++l) {
    if (!a.layers[l].is_moe) continue;
    auto& experts = reference.layers[l].moe.routed.experts;
    for (size_t e = 0; e < experts.size(); ++e) {
      for (auto member :
           {&moe::ExpertWeights::gate, &moe::ExpertWeights::up, &moe::ExpertWeights::down}) {
        TensorView& view = experts[e].*member;
        if (view.empty()) continue;
        std::vector<float> values = to_f32(view);
        fake_quantize(format, values, view.shape[0], view.shape[1]);
        const TensorView& loaded = b.layers[l].moe.routed.experts[e].*member;
        if (loaded.dtype == DType::kF32) EXPECT_EQ(to_f32(loaded), values);
        view = held_as(loaded.dtype, std::move(values), view.shape);
      }
    }
  }
  Decoder direct(base->config(), reference);
  const int32_t tokens[] = {1, 17, 42, 99, 7, 250, 3, 11, 64, 128, 5, 300};
  KvCache cache = direct.make_cache(64);
  std::vector<float> want(std::size(tokens) * base->config().vocab_size);
  direct.forward(tokens, cache, want, /*all_positions=*/true);
  const std::vector<float> got = logits_of(*quant, tokens);
  const std::vector<float> checkpoint = logits_of(*base, tokens);
  double norm = 0.0, diff = 0.0, drift = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    norm += double{want[i]} * want[i];
    diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    drift += (double{checkpoint[i]} - want[i]) * (double{checkpoint[i]} - want[i]);
  }
  std::printf(
      "%s %s --weights-scope linear: %zu dense matrices; logits vs direct %.3e, vs the "
      "checkpoint %.4f (relative L2)\n",
      name, std::string(weight_format_name(format)).c_str(), before.size(), std::sqrt(diff / norm),
      std::sqrt(drift / norm));
  EXPECT_LE(std::sqrt(diff / norm), 1e-5);  // the same values in float32: the same products
  EXPECT_GT(std::sqrt(drift / norm), 0.0);
  EXPECT_LE(std::sqrt(drift / norm), logit_tolerance);
}

// Standard attention without and with shared experts (and Qwen2-MoE's shared_expert_gate), MLA
// with dense layers, Gated DeltaNet layers. The drift from the checkpoint is bounded loosely
// (random-weight fixtures whose every matrix is now quantised: measured 0.08-0.15 for fp8,
// 0.23-0.33 for int4); the match to the direct reference is the test.
TEST(WeightScopeLinear, Fp8QuantisesEveryDenseLinear) {
  for (const char* name : {"qwen3_moe_f32", "qwen2_moe_f32", "deepseek_v3_f32", "qwen3_next_f32"}) {
    expect_linear_scope(name, WeightFormat::kFp8, 0.25);
  }
}

TEST(WeightScopeLinear, Int4QuantisesEveryDenseLinear) {
  for (const char* name : {"qwen3_moe_f32", "qwen2_moe_f32", "deepseek_v3_f32", "qwen3_next_f32"}) {
    expect_linear_scope(name, WeightFormat::kInt4, 0.5);
  }
}

// A bf16 checkpoint's dense Linears stay bf16 views (of the quantised values, rounded once).
TEST(WeightScopeLinear, Bf16CheckpointKeepsBf16Views) {
  expect_linear_scope("qwen3_moe_bf16", WeightFormat::kFp8, 0.25);
}

// The listed views, and no others: q/k/v/o of every attention layer, the shared experts' three
// matrices, and not the router's or the shared expert gate's.
TEST(WeightScopeLinear, ListsTheDenseLinearsOnly) {
  auto model = Model::load(fixture("qwen2_moe_f32"), LoadOptions{.prefault = false});
  DecoderWeights w = model->decoder().weights();
  const std::vector<TensorView*> views = dense_linear_views(w);
  int64_t expected = 0;
  for (LayerWeights& layer : w.layers) {
    expected += 4 + (layer.is_moe ? 0 : 3) + (layer.moe.shared_expert.gate_proj.empty() ? 0 : 3);
    for (TensorView* excluded : {&layer.moe.routed.router, &layer.moe.shared_expert_gate,
                                 &layer.input_norm, &layer.post_attention_norm}) {
      EXPECT_EQ(std::find(views.begin(), views.end(), excluded), views.end());
    }
  }
  EXPECT_EQ(static_cast<int64_t>(views.size()), expected);
  EXPECT_EQ(std::find(views.begin(), views.end(), &w.lm_head), views.end());
  EXPECT_EQ(std::find(views.begin(), views.end(), &w.embed_tokens), views.end());
}

}  // namespace
}  // namespace moeinfer
