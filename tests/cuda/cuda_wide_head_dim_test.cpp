// The GPU decoder held to the CPU decoder on random models whose head dim is past the fast
// attention kernels' 256: padded to a multiple of 64, decode and prompts both go through the
// wide paged decode kernel (prompts on the per-query route) and the attention inputs through
// the kernel without shared-memory staging. Families chosen for what they change around
// attention: Qwen3-MoE (per-head q/k norm, fused into attention_inputs), Mixtral (a sliding
// window), OLMoE (the norm over the whole projection and clip_qkv: the unfused chain), Qwen2-MoE
// (q/k/v biases); GQA groups 1, 2, 4 and 24; head dims 272 (padded to 320), 320, 512, 640, 1000
// (padded to 1024) and 1024; two runs in --deterministic mode (fixed attention splits through
// the workspace and the combine kernel). Each model runs tests/support/random_schedule.h's steps
// (prefill, chunked prefill in a mixed step, batched decode with graph replay) on both decoders
// (gpu_cpu_compare.h); the bounds are the sweep's (cuda_sweep_test.cpp): relative logit error
// <= 2e-2 on every route and no routing mismatch. Registered only where a CUDA device is visible.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cuda_test_util.h"
#include "gpu_cpu_compare.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;

struct WideCase {
  const char* name;
  ModelFamily family;
  nlohmann::json overrides;  // merged into the drawn config.json
  bool deterministic = false;
};

void gpu_matches_cpu(const WideCase& c, uint64_t seed) {
  const testing::RandomModel model = testing::make_random_model(c.family, seed, c.overrides);
  SCOPED_TRACE(::testing::Message() << c.name << " model seed " << seed << ", config "
                                    << model.config_json);
  // The overrides took: the head dim is past 256 and the model is what the case names.
  ASSERT_GT(model.config.head_dim, 256);
  const testing::ConfigResult r =
      testing::compare_gpu_with_cpu(model, seed ^ 0x5eed, c.deterministic);
  std::printf("%-34s head_dim %5lld: rel error prefill %.3e chunked %.3e decode %.3e, top-1 "
              "%lld/%lld, near-tie routes %lld/%lld\n",
              c.name, static_cast<long long>(model.config.head_dim), r.routes[0].rel(),
              r.routes[1].rel(), r.routes[2].rel(), static_cast<long long>(r.same_top1),
              static_cast<long long>(r.positions), static_cast<long long>(r.near_ties),
              static_cast<long long>(r.routed));
  EXPECT_GT(r.positions, 0);
  EXPECT_LE(r.worst(), kMaxRelError)
      << "rel error prefill " << r.routes[0].rel() << " chunked " << r.routes[1].rel()
      << " decode " << r.routes[2].rel();
  EXPECT_EQ(r.routing_mismatches, 0) << r.first_mismatch;
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("wide head dim")) return false;
  const WideCase cases[] = {
      {"Qwen3_D272_G1", ModelFamily::kQwen3Moe,
       {{"head_dim", 272}, {"num_attention_heads", 4}, {"num_key_value_heads", 4}}},
      {"Qwen3_D320_G4_Window9", ModelFamily::kQwen3Moe,
       {{"head_dim", 320},
        {"num_attention_heads", 8},
        {"num_key_value_heads", 2},
        {"use_sliding_window", true},
        {"sliding_window", 9}}},
      {"Mixtral_D512_G24_Window5", ModelFamily::kMixtral,
       {{"head_dim", 512},
        {"num_attention_heads", 24},
        {"num_key_value_heads", 1},
        {"sliding_window", 5}}},
      {"Mixtral_D1024_G4", ModelFamily::kMixtral,
       {{"head_dim", 1024},
        {"num_attention_heads", 4},
        {"num_key_value_heads", 1},
        {"sliding_window", nullptr}}},
      // OLMoE's head dim is hidden_size / heads: 640 / 2.
      {"Olmoe_D320_G2_Clip", ModelFamily::kOlmoe,
       {{"hidden_size", 640},
        {"num_attention_heads", 2},
        {"num_key_value_heads", 1},
        {"clip_qkv", 2.0}}},
      {"Qwen2_D1000_G2_Bias", ModelFamily::kQwen2Moe,
       {{"head_dim", 1000},
        {"num_attention_heads", 2},
        {"num_key_value_heads", 1},
        {"qkv_bias", true}}},
      {"Deterministic_Qwen3_D640_G2", ModelFamily::kQwen3Moe,
       {{"head_dim", 640}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}},
       true},
      {"Deterministic_Mixtral_D272_G24_Window7", ModelFamily::kMixtral,
       {{"head_dim", 272},
        {"num_attention_heads", 48},
        {"num_key_value_heads", 2},
        {"sliding_window", 7}},
       true},
  };
  const uint64_t base = cuda::testing_util::fresh_seed();
  uint64_t i = 0;
  for (const WideCase& c : cases) {
    const uint64_t seed = base + i++;
    cuda::testing_util::register_kernel_test(
        "CudaWideHeadDim", c.name, [c, seed] { gpu_matches_cpu(c, seed); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
