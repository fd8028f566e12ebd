// The fused attention-input kernel (decoder_ops.h attention_inputs) against the unfused chain it
// replaces in the decoder (strided_rms_norm on q and k heads, rope, kv_cache_write for k and v,
// copies of q, k, v): same inputs, outputs within a bf16 rounding (the two sum the norm in a
// different order), the padding of each head zero, and cache rows of skipped slots untouched.
// Head dims up to 256 and past it (272 padded to 320, 320, 512, 640, 1000 padded to 1024).
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/decoder_ops.h"
#include "cuda_test_util.h"

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
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
