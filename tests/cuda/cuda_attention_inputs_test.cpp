// The fused attention-input kernel (decoder_ops.h attention_inputs) against the unfused chain it
// replaces in the decoder (strided_rms_norm on q and k heads, rope, kv_cache_write for k and v,
// copies of q, k, v): same inputs, outputs within a bf16 rounding (the two sum the norm in a
// different order), the padding of each head zero, and cache rows of skipped slots untouched.
// Head dims up to 256 and past it (272 padded to 320, 320, 512, 640, 1000 padded to 1024).
// Llama 4's layers (CudaAttentionInputs.Llama4_*) against the CPU decoder's float32 chain: RoPE
// layers rotate adjacent pairs and then divide each q and k head by its RMS without a weight;
// NoPE layers do not rotate and multiply q by the query temperature of its position (floor
// scale 8 here, so positions 0..7, 8..15 and far ones get different factors). Written without a
// GPU; not yet run on one.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/decoder_ops.h"
#include "cuda_test_util.h"
#include "model/rope.h"

namespace moeinfer::cuda {
namespace {

using testing_util::DeviceBuffer;

struct Shape {
  int64_t T, Nq, Nkv, D, Dp;
  bool norm, interleaved;
};

// Each element within 1% of itself plus its head's mean magnitude: RoPE mixes two elements of
// a head, so where a*cos - b*sin cancels, the chain's rounding of a and b to bf16 before the
// rotation (the fused kernel keeps them in float) shows against a small result.
void compare(const std::vector<uint16_t>& fused, const std::vector<uint16_t>& chain,
             int64_t head_width, const char* what) {
  std::vector<double> want(chain.size()), scale(chain.size(), 1e-3);
  for (size_t i = 0; i < chain.size(); ++i) want[i] = bf16_to_f32(chain[i]);
  for (size_t head = 0; head < chain.size(); head += head_width) {
    double sum = 0.0;
    for (int64_t i = 0; i < head_width; ++i) sum += std::fabs(want[head + i]);
    for (int64_t i = 0; i < head_width; ++i) scale[head + i] += sum / head_width;
  }
  testing_util::expect_bf16_near(fused, want, scale, what);
}

void fused_matches_chain(const Shape& s) {
  std::mt19937 rng(testing_util::fresh_seed());
  const int64_t Nqkv = (s.Nq + 2 * s.Nkv) * s.Dp, num_slots = 4 * s.T + 8;
  // Projection output with zero padding in every head, as the padded weights produce.
  std::vector<uint16_t> qkv = testing_util::random_bf16(s.T * Nqkv, rng);
  for (int64_t i = 0; i < s.T * Nqkv; ++i) {
    if ((i % Nqkv) % s.Dp >= s.D) qkv[i] = 0;
  }
  std::vector<int32_t> positions(s.T), slots(s.T);
  std::uniform_int_distribution<int32_t> pos(0, 100000);
  for (int64_t t = 0; t < s.T; ++t) {
    positions[t] = pos(rng);
    slots[t] = t % 5 == 3 ? -1 : static_cast<int32_t>(4 * t + 1);  // some skipped
  }
  std::vector<float> inv_freq(s.D / 2);
  for (int64_t i = 0; i < s.D / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / s.D);
  const auto q_norm = testing_util::random_bf16(s.D, rng, 0.5f);
  const auto k_norm = testing_util::random_bf16(s.D, rng, 0.5f);

  DeviceBuffer<uint16_t> d_qkv(qkv), d_chain(qkv), d_qn(q_norm), d_kn(k_norm);
  DeviceBuffer<int32_t> d_pos(positions), d_slots(slots);
  DeviceBuffer<float> d_freq(inv_freq);
  const int64_t q_elems = s.T * s.Nq * s.Dp, kv_elems = s.T * s.Nkv * s.Dp;
  const int64_t cache_elems = num_slots * s.Nkv * s.Dp;
  DeviceBuffer<uint16_t> q1(q_elems), k1(kv_elems), v1(kv_elems), kc1(cache_elems),
      vc1(cache_elems);
  DeviceBuffer<uint16_t> q2(q_elems), k2(kv_elems), v2(kv_elems), kc2(cache_elems),
      vc2(cache_elems);
  for (auto* b : {&q1, &k1, &v1, &kc1, &vc1, &q2, &k2, &v2, &kc2, &vc2}) b->poison();

  attention_inputs({.qkv = d_qkv.as_bf16(), .qkv_stride = Nqkv, .positions = d_pos.get(),
                    .inv_freq = d_freq.get(), .q_norm = s.norm ? d_qn.as_bf16() : nullptr,
                    .k_norm = s.norm ? d_kn.as_bf16() : nullptr, .eps = 1e-6f,
                    .slots = d_slots.get(), .k_cache = kc1.as_bf16(), .v_cache = vc1.as_bf16(),
                    .num_slots = num_slots, .q_out = q1.as_bf16(), .k_out = k1.as_bf16(),
                    .v_out = v1.as_bf16(), .num_tokens = s.T, .num_q_heads = s.Nq,
                    .num_kv_heads = s.Nkv, .head_dim = s.D, .padded_head_dim = s.Dp,
                    .rotary_dim = s.D, .attention_scaling = 0.9f, .interleaved = s.interleaved},
                   nullptr);

  __nv_bfloat16* x = d_chain.as_bf16();
  if (s.norm) {
    strided_rms_norm({.x = x, .weight = d_qn.as_bf16(), .rows = s.T * s.Nq, .width = s.D,
                      .stride = s.Dp, .eps = 1e-6f, .rows_per_token = s.Nq, .token_stride = Nqkv},
                     nullptr);
    strided_rms_norm({.x = x + s.Nq * s.Dp, .weight = d_kn.as_bf16(), .rows = s.T * s.Nkv,
                      .width = s.D, .stride = s.Dp, .eps = 1e-6f, .rows_per_token = s.Nkv,
                      .token_stride = Nqkv},
                     nullptr);
  }
  rope({.q = x, .k = x + s.Nq * s.Dp, .positions = d_pos.get(), .inv_freq = d_freq.get(),
        .num_tokens = s.T, .num_q_heads = s.Nq, .num_kv_heads = s.Nkv, .head_dim = s.Dp,
        .rotary_dim = s.D, .q_stride = Nqkv, .k_stride = Nqkv, .attention_scaling = 0.9f,
        .interleaved = s.interleaved},
       nullptr);
  kv_cache_write({.src = x + s.Nq * s.Dp, .cache = kc2.as_bf16(), .slots = d_slots.get(),
                  .num_tokens = s.T, .width = s.Nkv * s.Dp, .src_stride = Nqkv,
                  .num_slots = num_slots},
                 nullptr);
  kv_cache_write({.src = x + (s.Nq + s.Nkv) * s.Dp, .cache = vc2.as_bf16(),
                  .slots = d_slots.get(), .num_tokens = s.T, .width = s.Nkv * s.Dp,
                  .src_stride = Nqkv, .num_slots = num_slots},
                 nullptr);
  auto copy = [&](DeviceBuffer<uint16_t>& dst, int64_t offset, int64_t width) {
    CUDA_CHECK(cudaMemcpy2D(dst.get(), width * 2, d_chain.as_bf16() + offset, Nqkv * 2, width * 2,
                            s.T, cudaMemcpyDeviceToDevice));
  };
  copy(q2, 0, s.Nq * s.Dp);
  copy(k2, s.Nq * s.Dp, s.Nkv * s.Dp);
  copy(v2, (s.Nq + s.Nkv) * s.Dp, s.Nkv * s.Dp);
  testing_util::synchronize();

  compare(q1.download(), q2.download(), s.Dp, "q");
  compare(k1.download(), k2.download(), s.Dp, "k");
  compare(v1.download(), v2.download(), s.Dp, "v");
  // Caches: written rows must agree, untouched rows stay poisoned in both.
  const auto kc_f = kc1.download(), kc_c = kc2.download(), vc_f = vc1.download(),
             vc_c = vc2.download();
  EXPECT_EQ(kc_f.size(), kc_c.size());
  size_t differ = 0;
  for (size_t i = 0; i < kc_f.size(); ++i) {
    const bool poisoned_f = kc_f[i] == 0xFFFF, poisoned_c = kc_c[i] == 0xFFFF;
    if (poisoned_f != poisoned_c) ++differ;
    const bool vpoisoned_f = vc_f[i] == 0xFFFF, vpoisoned_c = vc_c[i] == 0xFFFF;
    if (vpoisoned_f != vpoisoned_c) ++differ;
    if (!poisoned_f && !poisoned_c) {
      const double a = bf16_to_f32(kc_f[i]), b = bf16_to_f32(kc_c[i]);
      if (std::fabs(a - b) > 1e-2 * std::fabs(b) + 1e-3) ++differ;
    }
    if (!vpoisoned_f && !vpoisoned_c && vc_f[i] != vc_c[i]) ++differ;
  }
  EXPECT_EQ(differ, 0u) << "cache elements that differ between the fused kernel and the chain";
}

// The CPU decoder's order for one Llama 4 layer (decoder.cpp, Decoder::attention): RoPE, the
// weightless norm after it (RoPE layers), the query temperature (NoPE layers), in float32.
void llama4_inputs_match_cpu(int64_t T, int64_t Nq, int64_t Nkv, int64_t D, int64_t Dp,
                             bool rope_layer) {
  std::mt19937 rng(testing_util::fresh_seed() ^ static_cast<uint32_t>(T * 31 + rope_layer));
  const int64_t Nqkv = (Nq + 2 * Nkv) * Dp, num_slots = 2 * T + 3;
  const float eps = 1e-5f, attn_scale = 0.1f;
  const int64_t floor_scale = 8;
  std::vector<uint16_t> qkv = testing_util::random_bf16(T * Nqkv, rng);
  for (int64_t i = 0; i < T * Nqkv; ++i) {
    if ((i % Nqkv) % Dp >= D) qkv[i] = 0;
  }
  std::vector<int32_t> positions(T), slots(T);
  const int32_t fixed[] = {0, 6, 7, 8, 15, 16, 100000};
  for (int64_t t = 0; t < T; ++t) {
    positions[t] = t < 7 ? fixed[t] : std::uniform_int_distribution<int32_t>(0, 300000)(rng);
    slots[t] = static_cast<int32_t>(2 * t + 1);
  }
  RopeConfig config;
  config.theta = 500000.0;
  const Rope reference(config, D, 1 << 20);

  DeviceBuffer<uint16_t> d_qkv(qkv);
  DeviceBuffer<int32_t> d_pos(positions), d_slots(slots);
  DeviceBuffer<float> d_freq(reference.inv_freq());
  DeviceBuffer<uint16_t> q_out(T * Nq * Dp), k_out(T * Nkv * Dp), v_out(T * Nkv * Dp),
      k_cache(num_slots * Nkv * Dp), v_cache(num_slots * Nkv * Dp);
  for (auto* b : {&q_out, &k_out, &v_out, &k_cache, &v_cache}) b->poison();
  attention_inputs({.qkv = d_qkv.as_bf16(), .qkv_stride = Nqkv, .positions = d_pos.get(),
                    .inv_freq = d_freq.get(), .eps = eps, .slots = d_slots.get(),
                    .k_cache = k_cache.as_bf16(), .v_cache = v_cache.as_bf16(),
                    .num_slots = num_slots, .q_out = q_out.as_bf16(), .k_out = k_out.as_bf16(),
                    .v_out = v_out.as_bf16(), .num_tokens = T, .num_q_heads = Nq,
                    .num_kv_heads = Nkv, .head_dim = D, .padded_head_dim = Dp, .rotary_dim = D,
                    .interleaved = true, .rope = rope_layer, .norm_after_rope = rope_layer,
                    .temperature_floor_scale = rope_layer ? 0 : floor_scale,
                    .temperature_scale = rope_layer ? 0.0f : attn_scale},
                   nullptr);
  testing_util::synchronize();

  std::vector<double> want_q(T * Nq * Dp, 0.0), want_k(T * Nkv * Dp, 0.0),
      want_v(T * Nkv * Dp, 0.0);
  std::vector<double> scale_q(want_q.size(), 1e-3), scale_k(want_k.size(), 1e-3),
      scale_v(want_v.size(), 1e-3);
  std::vector<float> head(D);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Nq + 2 * Nkv; ++h) {
      const bool is_q = h < Nq, is_v = h >= Nq + Nkv;
      for (int64_t d = 0; d < D; ++d) head[d] = bf16_to_f32(qkv[t * Nqkv + h * Dp + d]);
      if (!is_v && rope_layer) {
        reference.apply(head.data(), 1, D, positions[t], /*interleaved=*/true);
        float sum_sq = 0.0f;
        for (int64_t d = 0; d < D; ++d) sum_sq += head[d] * head[d];
        const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(D) + eps);
        for (int64_t d = 0; d < D; ++d) head[d] *= inv_rms;
      }
      if (is_q && !rope_layer) {
        const float steps = std::floor((static_cast<float>(positions[t]) + 1.0f) /
                                       static_cast<float>(floor_scale));
        const float factor = std::log1p(steps) * attn_scale + 1.0f;
        for (int64_t d = 0; d < D; ++d) head[d] *= factor;
      }
      std::vector<double>& want = is_q ? want_q : is_v ? want_v : want_k;
      std::vector<double>& scale = is_q ? scale_q : is_v ? scale_v : scale_k;
      const int64_t heads = is_q ? Nq : Nkv;
      const int64_t index = is_q ? h : is_v ? h - Nq - Nkv : h - Nq;
      double mean = 0.0;
      for (int64_t d = 0; d < D; ++d) mean += std::fabs(head[d]) / static_cast<double>(D);
      for (int64_t d = 0; d < D; ++d) {
        want[(t * heads + index) * Dp + d] = head[d];
        // The rotation's pair mixes two inputs: 1e-2 of the head's mean magnitude on top.
        scale[(t * heads + index) * Dp + d] += mean;
      }
    }
  }
  testing_util::expect_bf16_near(q_out.download(), want_q, scale_q, "q");
  testing_util::expect_bf16_near(k_out.download(), want_k, scale_k, "k");
  testing_util::expect_bf16_near(v_out.download(), want_v, scale_v, "v");
  // The cache rows hold what k_out and v_out hold; the slots between stay poisoned.
  const auto kc = k_cache.download(), vc = v_cache.download();
  const auto ko = k_out.download(), vo = v_out.download();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < Nkv * Dp; ++i) {
      ASSERT_EQ(kc[slots[t] * Nkv * Dp + i], ko[t * Nkv * Dp + i]) << "token " << t;
      ASSERT_EQ(vc[slots[t] * Nkv * Dp + i], vo[t * Nkv * Dp + i]) << "token " << t;
      ASSERT_EQ(kc[2 * t * Nkv * Dp + i], 0xFFFF) << "slot " << 2 * t << " was written";
    }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!testing_util::cuda_device_present("attention inputs")) return false;
  const Shape shapes[] = {{1, 32, 4, 128, 128, true, false},  {37, 32, 4, 128, 128, true, false},
                          {19, 4, 2, 16, 64, true, false},    {19, 4, 4, 8, 64, false, false},
                          {5, 16, 16, 64, 64, false, true},   {3, 8, 2, 256, 256, true, false},
                          // Heads past 256 dims (the kernel without shared-memory staging):
                          // the model's 272 padded to 320, and 320 to 1024 unpadded and padded.
                          {19, 4, 2, 272, 320, true, false},  {1, 8, 2, 320, 320, true, true},
                          {99, 4, 4, 512, 512, false, false}, {19, 2, 1, 640, 640, false, true},
                          {3, 24, 1, 1000, 1024, true, false}};
  for (const Shape& s : shapes) {
    const std::string name = "T" + std::to_string(s.T) + "_Nq" + std::to_string(s.Nq) + "_Nkv" +
                             std::to_string(s.Nkv) + "_D" + std::to_string(s.D) + "_Dp" +
                             std::to_string(s.Dp) + (s.norm ? "_Norm" : "") +
                             (s.interleaved ? "_Interleaved" : "");
    testing_util::register_kernel_test("CudaAttentionInputs", name,
                                       [s] { fused_matches_chain(s); }, __FILE__, __LINE__);
  }
  // Llama 4's shapes (40 query heads over 8 KV heads of 128) and an odd one with padded heads.
  for (bool rope_layer : {true, false}) {
    const std::string kind = rope_layer ? "Llama4_RopeNormAfter_" : "Llama4_NopeTemperature_";
    testing_util::register_kernel_test(
        "CudaAttentionInputs", kind + "T19_Nq40_Nkv8_D128",
        [rope_layer] { llama4_inputs_match_cpu(19, 40, 8, 128, 128, rope_layer); }, __FILE__,
        __LINE__);
    testing_util::register_kernel_test(
        "CudaAttentionInputs", kind + "T7_Nq6_Nkv2_D72_Dp128",
        [rope_layer] { llama4_inputs_match_cpu(7, 6, 2, 72, 128, rope_layer); }, __FILE__,
        __LINE__);
  }
  // The norm after RoPE runs in the staged kernel only: wider heads are refused by name.
  testing_util::register_kernel_test(
      "CudaAttentionInputs", "Llama4_NormAfterRopeRefusesWideHeads",
      [] {
        testing_util::expect_error_naming(
            [] {
              attention_inputs({.qkv_stride = 3 * 320, .num_tokens = 1, .num_q_heads = 1,
                                .num_kv_heads = 1, .head_dim = 320, .padded_head_dim = 320,
                                .rotary_dim = 320, .norm_after_rope = true},
                               nullptr);
            },
            "padded_head_dim = 320");
      },
      __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
