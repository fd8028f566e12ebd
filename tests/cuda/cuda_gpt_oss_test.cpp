// GPT-OSS's MoE pieces on the GPU against CPU references (the attention sinks and per-layer
// windows are in cuda_attention_test.cpp and cuda_kv_fp8_test.cpp, the fixtures in
// cuda_parity_test.cpp):
//   router   fused_router with RouterScore::kTopkSoftmax and the checkpoint's logit bias against
//            moe::route() over the biased logits (ScoreFunction::kTopkSoftmax): ids exact (the
//            choice is the float32 sum logit + bias on both sides, so there is nothing to round
//            differently; ties broken to the lower id, exercised with logits and biases on a
//            grid of 1/4), weights 1e-5 relative. The one-warp plain kernel (GPT-OSS's 32 and
//            128 experts, top-4), its general twin (with a selection bias), the block router past
//            1024 experts, padding tokens. bias_scale_logits against (logit + bias) * factor,
//            bit for bit.
//   experts  moe_experts with expert biases and the clamped SwiGLU (and biases under SiLU)
//            against a float64 reference of moe::run_experts' arithmetic (gate and up rows of an
//            expert as DeviceLayer holds them, bias added before the activation, the activation
//            rounded to bf16 as the GPU's grouped GEMM does): 1e-2 relative to the output's
//            natural scale; T from 1 to 989, so every tile kAuto picks runs.
// Fresh random inputs every run (seed printed on failure, MOE_TEST_SEED replays), outputs
// poisoned first. Kernel tests are registered only where a CUDA device is visible. Written
// without a GPU; not yet run on one.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/moe_stages.h"
#include "cuda_test_util.h"
#include "moe/stages.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

// ---- router ----------------------------------------------------------------------------------

struct TopkCase {
  int64_t T, E, K;
  bool grid = false;            // logits and biases on a grid of 1/4: exact ties on purpose
  bool selection_bias = false;  // the general one-warp kernel (no model has both)
  int64_t num_valid = -1;       // >= 0: tokens from here on pad a graph bucket
  float scaling = 1.0f;
};

void topk_softmax_router(const TopkCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.E * 131 + c.K * 7 + c.T));
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> step(-8, 8);
  auto draw = [&] { return c.grid ? 0.25f * static_cast<float>(step(rng)) : normal(rng); };
  std::vector<float> logits(c.T * c.E), bias(c.E), selection(c.E);
  for (float& x : logits) x = draw();
  for (float& x : bias) x = draw();
  for (float& x : selection) x = 0.125f * static_cast<float>(step(rng));
  // The CPU adds the bias in the router's product; the reference routes the biased logits.
  std::vector<float> biased(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) biased[i] = logits[i] + bias[i % c.E];
  moe::Routing want;
  moe::route(biased.data(), c.T,
             moe::RouterOptions{.num_experts = c.E,
                                .top_k = c.K,
                                .score = moe::ScoreFunction::kTopkSoftmax,
                                .routed_scaling_factor = c.scaling,
                                .selection_bias = c.selection_bias ? selection.data() : nullptr},
             &want);

  DeviceBuffer<float> d_logits(logits), d_bias(bias), d_selection(selection);
  DeviceBuffer<int32_t> d_num_valid(std::vector<int32_t>{static_cast<int32_t>(c.num_valid)});
  DeviceBuffer<int32_t> d_ids(c.T * c.K);
  DeviceBuffer<float> d_weights(c.T * c.K);
  d_ids.poison();
  d_weights.poison();
  fused_router(RouterParams{.logits = d_logits.get(),
                            .topk_ids = d_ids.get(),
                            .topk_weights = d_weights.get(),
                            .num_tokens = c.T,
                            .num_experts = c.E,
                            .top_k = c.K,
                            .score = RouterScore::kTopkSoftmax,
                            .renormalize = true,  // changes nothing under kTopkSoftmax
                            .routed_scaling_factor = c.scaling,
                            .logit_bias = d_bias.get(),
                            .selection_bias = c.selection_bias ? d_selection.get() : nullptr,
                            .num_valid_tokens = c.num_valid >= 0 ? d_num_valid.get() : nullptr},
               nullptr);
  synchronize();
  const std::vector<int32_t> ids = d_ids.download();
  const std::vector<float> weights = d_weights.download();
  int failures = 0;
  for (int64_t i = 0; i < c.T * c.K && failures < 5; ++i) {
    const bool padding = c.num_valid >= 0 && i / c.K >= c.num_valid;
    const int32_t want_id = padding ? static_cast<int32_t>(c.E) : want.topk_ids[i];
    const float want_weight = padding ? 0.0f : want.topk_weights[i];
    if (ids[i] != want_id) {
      ++failures;
      ADD_FAILURE() << "token " << i / c.K << " pick " << i % c.K << ": expert " << ids[i]
                    << ", want " << want_id << " (seed " << fresh_seed() << ")";
    }
    if (!(std::fabs(weights[i] - want_weight) <= 1e-5f * std::fabs(want_weight) + 1e-7f)) {
      ++failures;
      ADD_FAILURE() << "token " << i / c.K << " pick " << i % c.K << ": weight " << weights[i]
                    << ", want " << want_weight << " (seed " << fresh_seed() << ")";
    }
  }
}

// The router bias joins before the temperature: (logits + bias) * factor, as the CPU orders it.
void bias_then_temperature() {
  std::mt19937 rng(fresh_seed());
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t T = 37, E = 128;
  const float factor = 1.0f / 0.7f;
  std::vector<float> logits(T * E), bias(E);
  for (float& x : logits) x = normal(rng);
  for (float& x : bias) x = normal(rng);
  DeviceBuffer<float> d_logits(logits), d_bias(bias);
  bias_scale_logits(d_logits.get(), d_bias.get(), T, E, factor, nullptr);
  synchronize();
  const std::vector<float> got = d_logits.download();
  for (int64_t i = 0; i < T * E; ++i) {
    ASSERT_EQ(got[i], (logits[i] + bias[i % E]) * factor) << "logit " << i;
  }
}

// ---- experts ---------------------------------------------------------------------------------

double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct ExpertsCase {
  int64_t T, K, E, H, I;
  bool clamped = true;  // the clamped SwiGLU; false: SiLU with biases
  float alpha = 1.702f, limit = 7.0f;
};

void experts_with_biases(const ExpertsCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.T * 104729 + c.E * 31 + c.I));
  const int64_t M = c.T * c.K, E = c.E, H = c.H, I = c.I;
  // Rows spread over the experts at random, some experts empty; gathered from [T, H] by src_row
  // as the decoder's local dispatcher hands them over.
  std::vector<int32_t> expert_of(M);
  for (auto& e : expert_of)
    e = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(E) - 1)(rng);
  std::vector<int32_t> offsets(E + 1, 0), src_row(M);
  for (int32_t e : expert_of) ++offsets[e + 1];
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  {
    std::vector<int32_t> cursor(offsets.begin(), offsets.end() - 1);
    for (int64_t a = 0; a < M; ++a) src_row[cursor[expert_of[a]]++] = static_cast<int32_t>(a);
  }
  const auto x_bits = random_bf16(c.T * H, rng, 1.0f);
  const auto gu_bits = random_bf16(E * 2 * I * H, rng, 1.0f / std::sqrt(static_cast<float>(H)));
  const auto dn_bits = random_bf16(E * H * I, rng, 1.0f / std::sqrt(static_cast<float>(I)));
  std::uniform_real_distribution<float> bias_value(-1.0f, 1.0f);
  std::vector<float> gu_bias(E * 2 * I), dn_bias(E * H);
  for (float& b : gu_bias) b = bias_value(rng);
  for (float& b : dn_bias) b = 0.5f * bias_value(rng);
  const auto x = to_float(x_bits), gu = to_float(gu_bits), dn = to_float(dn_bits);
  DeviceBuffer<uint16_t> d_x(x_bits), d_gu(gu_bits), d_dn(dn_bits), d_act(M * I), d_out(M * H);
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  DeviceBuffer<float> d_gu_bias(gu_bias), d_dn_bias(dn_bias);
  d_act.poison();
  d_out.poison();
  moe_experts(MoeExpertsParams{.rows = d_x.as_bf16(),
                               .gate_up = d_gu.as_bf16(),
                               .down = d_dn.as_bf16(),
                               .expert_offsets = d_offsets.get(),
                               .activation = d_act.as_bf16(),
                               .out = d_out.as_bf16(),
                               .num_rows = M,
                               .num_experts = E,
                               .hidden_size = H,
                               .expert_width = I,
                               .src_row = d_src_row.get(),
                               .top_k = c.K,
                               .gate_up_bias = d_gu_bias.get(),
                               .down_bias = d_dn_bias.get(),
                               .gate_up_epilogue = c.clamped ? GemmEpilogue::kClampedSwiglu
                                                             : GemmEpilogue::kSiluMul,
                               .swiglu_alpha = c.alpha,
                               .swiglu_limit = c.limit},
              nullptr);
  synchronize();

  // moe::run_experts' arithmetic: g = x.gate + gate_bias, u = x.up + up_bias, the activation
  // (rounded to bf16, as the grouped GEMM writes it), then act.down + down_bias.
  std::vector<double> want(M * H), scale(M * H);
  std::vector<double> act(I);
  const double limit = c.limit, alpha = c.alpha;
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const float* xr = x.data() + (src_row[r] / c.K) * H;
      for (int64_t i = 0; i < I; ++i) {
        double g = gu_bias[e * 2 * I + i], u = gu_bias[e * 2 * I + I + i];
        for (int64_t k = 0; k < H; ++k) {
          g += static_cast<double>(xr[k]) * gu[(e * 2 * I + i) * H + k];
          u += static_cast<double>(xr[k]) * gu[(e * 2 * I + I + i) * H + k];
        }
        double a;
        if (c.clamped) {
          const double gc = std::min(g, limit), uc = std::clamp(u, -limit, limit);
          a = (uc + 1.0) * (gc / (1.0 + std::exp(-alpha * gc)));
        } else {
          a = silu(g) * u;
        }
        act[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(a)));
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = dn_bias[e * H + h], y2 = 0;
        for (int64_t i = 0; i < I; ++i) {
          const double t = act[i] * dn[(e * H + h) * I + i];
          y += t;
          y2 += t * t;
        }
        want[r * H + h] = y;
        // The activation's own bf16 rounding, and the output's.
        scale[r * H + h] = 2.0 * std::sqrt(y2) + std::fabs(y);
      }
    }
  }
  expect_bf16_near(d_out.download(), want, scale,
                   c.clamped ? "clamped SwiGLU experts out" : "SiLU experts with biases out");
}

TEST(CudaGptOssChecks, RefusesABadSwigluLimitAndEpilogue) {
  alignas(16) uint16_t buf[64] = {};
  int32_t offsets[2] = {0, 1};
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(buf);
  auto* out = reinterpret_cast<__nv_bfloat16*>(buf);
  GroupedGemmParams p{.rows = in,
                      .weights = in,
                      .expert_offsets = offsets,
                      .out = out,
                      .num_rows = 1,
                      .num_experts = 1,
                      .n = 64,
                      .k = 64,
                      .epilogue = GemmEpilogue::kClampedSwiglu,
                      .swiglu_limit = 0.0f};
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "swiglu_limit = 0");
  MoeExpertsParams e{.num_rows = 1, .gate_up_epilogue = GemmEpilogue::kNone};
  expect_error_naming([&] { moe_experts(e, nullptr); }, "gate_up_epilogue 0");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("GPT-OSS kernels")) return false;
  auto reg = [](const char* suite, const std::string& name, std::function<void()> body) {
    register_kernel_test(suite, name, std::move(body), __FILE__, __LINE__);
  };
  struct Tc {
    const char* name;
    TopkCase c;
  };
  const Tc router_cases[] = {
      {"E32_K4_T1", {1, 32, 4}},  // gpt-oss-20b at decode
      {"E32_K4_T989", {989, 32, 4}},
      {"E128_K4_T257", {257, 128, 4}},       // gpt-oss-120b
      {"E6_K2_T19_Ties", {19, 6, 2, true}},  // the fixtures' size, exact ties
      {"E128_K4_T300_Ties", {300, 128, 4, true}},
      {"E60_K5_T99_Scaled", {99, 60, 5, false, false, -1, 2.5f}},
      {"E1024_K32_T33", {33, 1024, 32}},                       // the one-warp router's edge
      {"E64_K8_T99_SelectionBias", {99, 64, 8, false, true}},  // the general kernel
      {"E64_K8_T99_SelectionBias_Ties", {99, 64, 8, true, true}},
      {"E1500_K40_T7_Block", {7, 1500, 40}},  // the block router
      {"E1500_K40_T9_Block_Ties", {9, 1500, 40, true}},
      {"E32_K4_T64_Padding", {64, 32, 4, false, false, 37}},
      {"E1500_K40_T8_Block_Padding", {8, 1500, 40, false, false, 5}},
  };
  for (const Tc& t : router_cases) {
    reg("CudaGptOssRouter", std::string("TopkSoftmax_") + t.name,
        [c = t.c] { topk_softmax_router(c); });
  }
  reg("CudaGptOssRouter", "BiasJoinsBeforeTheTemperature", bias_then_temperature);
  struct Ec {
    const char* name;
    ExpertsCase c;
  };
  const Ec expert_cases[] = {
      // Decode (the 16-row tile), prefill (64-row, 128 x 128 and 128 x 256 tiles), the fixtures'
      // small limits (most gates and ups clamped) and the published 7.
      {"ClampedSwiglu_T1_K4_E32_H128_I192", {1, 4, 32, 128, 192}},
      {"ClampedSwiglu_T99_K4_E8_H192_I128_Limit0p8", {99, 4, 8, 192, 128, true, 1.702f, 0.8f}},
      {"ClampedSwiglu_T989_K4_E8_H128_I256", {989, 4, 8, 128, 256}},
      {"ClampedSwiglu_T700_K2_E6_H64_I192_Limit1", {700, 2, 6, 64, 192, true, 1.702f, 1.0f}},
      {"ClampedSwiglu_T19_K3_E6_H64_I64_Alpha3", {19, 3, 6, 64, 64, true, 3.0f, 0.5f}},
      {"SiluWithBiases_T99_K4_E8_H192_I128", {99, 4, 8, 192, 128, false}},
      {"SiluWithBiases_T1_K4_E32_H128_I192", {1, 4, 32, 128, 192, false}},
  };
  for (const Ec& e : expert_cases) {
    reg("CudaGptOssExperts", e.name, [c = e.c] { experts_with_biases(c); });
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
