// The GPU decoder on MLA latents and cache rows past DeepSeek's 512 + 64 (kv_lora_rank 600, 1001
// and 1024, rope keys of 64 and 128: the streaming attention kernel, mla_attention_wide_kernel.cuh)
// held to the CPU decoder, which matches transformers on every fixture. Each case is a random
// DeepSeek-V2 or -V3 model (tests/support/random_model.h) with the latent, the rope key and
// sometimes the head count overridden, run through the sweep's scripted steps
// (gpu_cpu_compare.h: prefill, chunked prefill in a mixed step, batched decode over the paged
// cache with CUDA-graph replay); two cases in --deterministic mode (fixed attention splits
// through the workspace and the combine kernel). Bounds as the sweep's: relative logit error
// <= 2e-2 per route, no routing mismatch (near-ties replayed). The model seed is fresh each run
// and printed with the config on failure. Registered only where a CUDA device is visible.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/cuda/mla_attention.h"
#include "cuda_test_util.h"
#include "gpu_cpu_compare.h"
#include "model/cuda/device_weights.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;

struct WideCase {
  const char* name;
  ModelFamily family;
  nlohmann::json overrides;
  bool deterministic = false;
};

void gpu_matches_cpu(const WideCase& c, uint64_t seed) {
  const testing::RandomModel model = testing::make_random_model(c.family, seed, c.overrides);
  SCOPED_TRACE(::testing::Message()
               << family_name(c.family) << " seed " << seed << "\n  config " << model.config_json);
  // The case runs the streaming kernel, as it claims.
  const gpu::MlaPaddedDims dims = gpu::padded_mla_dims(model.config);
  ASSERT_TRUE(cuda::mla_decode_is_wide({.latent_dim = dims.latent, .rope_dim = dims.rope}))
      << "padded latent " << dims.latent << " + rope " << dims.rope;
  const testing::ConfigResult r =
      testing::compare_gpu_with_cpu(model, seed ^ 0x5eed, c.deterministic);
  ASSERT_GT(r.positions, 0) << "no logits rows compared";
  std::printf(
      "%s: %lld positions, rel error prefill %.3e chunked %.3e decode %.3e, top-1 "
      "%lld/%lld, near-tie routes %lld/%lld\n",
      c.name, static_cast<long long>(r.positions), r.routes[0].rel(), r.routes[1].rel(),
      r.routes[2].rel(), static_cast<long long>(r.same_top1), static_cast<long long>(r.positions),
      static_cast<long long>(r.near_ties), static_cast<long long>(r.routed));
  EXPECT_LE(r.worst(), kMaxRelError) << "rel error prefill " << r.routes[0].rel() << " chunked "
                                     << r.routes[1].rel() << " decode " << r.routes[2].rel();
  EXPECT_EQ(r.routing_mismatches, 0) << r.first_mismatch;
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("MLA wide decoder")) return false;
  using nlohmann::json;
  const WideCase cases[] = {
      {"DeepseekV2_L600_R64", ModelFamily::kDeepseekV2,
       json{{"kv_lora_rank", 600}, {"qk_rope_head_dim", 64}}},
      {"DeepseekV3_L600_R128_H20", ModelFamily::kDeepseekV3,
       json{{"kv_lora_rank", 600},
            {"qk_rope_head_dim", 128},
            {"num_attention_heads", 20},
            {"num_key_value_heads", 20}}},
      {"DeepseekV2_L1024_R64_H16", ModelFamily::kDeepseekV2,
       json{{"kv_lora_rank", 1024},
            {"qk_rope_head_dim", 64},
            {"num_attention_heads", 16},
            {"num_key_value_heads", 16}}},
      {"DeepseekV3_L1024_R64", ModelFamily::kDeepseekV3,
       json{{"kv_lora_rank", 1024}, {"qk_rope_head_dim", 64}}},
      // Neither multiple of 8: padded to 1008 + 64 at upload.
      {"DeepseekV2_L1001_R62", ModelFamily::kDeepseekV2,
       json{{"kv_lora_rank", 1001}, {"qk_rope_head_dim", 62}}},
      {"DeepseekV3_L1024_R64_Deterministic", ModelFamily::kDeepseekV3,
       json{{"kv_lora_rank", 1024}, {"qk_rope_head_dim", 64}}, true},
      {"DeepseekV2_L600_R128_Deterministic", ModelFamily::kDeepseekV2,
       json{{"kv_lora_rank", 600}, {"qk_rope_head_dim", 128}}, true},
  };
  uint64_t index = 0;
  for (const WideCase& c : cases) {
    const uint64_t seed = cuda::testing_util::fresh_seed() + 1000003 * ++index;
    cuda::testing_util::register_kernel_test(
        "CudaMlaWideDecoder", c.name, [c, seed] { gpu_matches_cpu(c, seed); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
