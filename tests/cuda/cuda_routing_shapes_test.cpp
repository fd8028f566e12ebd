// The GPU decoder held to the CPU decoder (compare_gpu_with_cpu, gpu_cpu_compare.h) on random
// models whose routing is past the kernels' fast paths: more than 1024 experts or more than 32
// per token (the block router), K = E, E + 1 past the shared-memory plan (its histograms in the
// workspace) and E past the block router's shared-memory cache, with the grouped routers of
// DeepSeek-V2 (group_limited_greedy) and V3 (noaux_tc with e_score_correction_bias), softmax and
// sigmoid scores, shared experts, and the padded decode buckets of CUDA graphs (their rows route
// to the null expert E of a plan over E + 1). The rest of each config is drawn as the sweep draws
// it (tests/support/random_model.h), with hidden size 64, two layers, both MoE, and experts 8
// wide, so that thousands of experts stay small on the host.
//
// Bounds as in the sweep (cuda_sweep_test.cpp): relative logit error <= 2e-2 per route and no
// routing mismatch (near-ties, where the CPU replays the GPU's experts, are counted, not
// failed). Registered only where a CUDA device is visible; MOE_TEST_SEED=S replays.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "cuda_test_util.h"
#include "gpu_cpu_compare.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;

struct ShapeCase {
  const char* name;
  ModelFamily family;
  nlohmann::json overrides;  // merged into the drawn config.json
  bool deterministic = false;
};

// Two MoE layers of small experts at hidden size 64, whatever the family calls the fields.
nlohmann::json small_moe_layers(ModelFamily family) {
  nlohmann::json j = {{"hidden_size", 64}, {"num_hidden_layers", 2}};
  switch (family) {
    case ModelFamily::kQwen3Moe:
    case ModelFamily::kQwen2Moe:
      j.update({{"moe_intermediate_size", 8},
                {"mlp_only_layers", nlohmann::json::array()},
                {"decoder_sparse_step", 1}});
      break;
    case ModelFamily::kMixtral:
      j.update({{"intermediate_size", 8}});
      break;
    case ModelFamily::kOlmoe:  // q/k norms span the hidden size: 4 heads of 16
      j.update({{"intermediate_size", 8}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}});
      break;
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3:
      j.update({{"moe_intermediate_size", 8}, {"first_k_dense_replace", 0}});
      break;
  }
  return j;
}

ShapeCase shape(const char* name, ModelFamily family, nlohmann::json routing,
                bool deterministic = false) {
  nlohmann::json overrides = small_moe_layers(family);
  overrides.update(routing);
  return {name, family, overrides, deterministic};
}

const ShapeCase kCases[] = {
    shape("Qwen3Moe_E1100_K40", ModelFamily::kQwen3Moe,
          {{"num_experts", 1100}, {"num_experts_per_tok", 40}}),
    shape("Qwen3Moe_E1100_K40_Deterministic", ModelFamily::kQwen3Moe,
          {{"num_experts", 1100}, {"num_experts_per_tok", 40}}, true),
    shape("Mixtral_E1500_K33", ModelFamily::kMixtral,
          {{"num_local_experts", 1500}, {"num_experts_per_tok", 33}}),
    shape("Olmoe_E4099_K64", ModelFamily::kOlmoe,
          {{"num_experts", 4099}, {"num_experts_per_tok", 64}, {"norm_topk_prob", false}}),
    shape("Olmoe_E1025_K1", ModelFamily::kOlmoe,
          {{"num_experts", 1025}, {"num_experts_per_tok", 1}}),
    shape("Qwen2Moe_E48_K48_SharedExpert", ModelFamily::kQwen2Moe,
          {{"num_experts", 48}, {"num_experts_per_tok", 48}, {"norm_topk_prob", true}}),
    shape("DeepseekV2_E1500_G12_Top4_K40_GroupLimitedGreedy", ModelFamily::kDeepseekV2,
          {{"n_routed_experts", 1500},
           {"num_experts_per_tok", 40},
           {"topk_method", "group_limited_greedy"},
           {"n_group", 12},
           {"topk_group", 4}}),
    shape("DeepseekV3_E1056_G8_Top3_K34_NoauxTc", ModelFamily::kDeepseekV3,
          {{"n_routed_experts", 1056},
           {"num_experts_per_tok", 34},
           {"n_group", 8},
           {"topk_group", 3},
           {"norm_topk_prob", true},
           {"routed_scaling_factor", 2.5}}),
    shape("DeepseekV3_E4099_G1_K64_NoauxTc", ModelFamily::kDeepseekV3,
          {{"n_routed_experts", 4099},
           {"num_experts_per_tok", 64},
           {"n_group", 1},
           {"topk_group", 1}}),
    // E + 1 = 12001 past the shared-memory plan, E past the block router's shared-memory cache.
    shape("Qwen3Moe_E12000_K36", ModelFamily::kQwen3Moe,
          {{"num_experts", 12000}, {"num_experts_per_tok", 36}}),
};

void gpu_matches_cpu(const ShapeCase& c) {
  const uint64_t seed = cuda::testing_util::fresh_seed();
  const testing::RandomModel model = testing::make_random_model(c.family, seed, c.overrides);
  SCOPED_TRACE(::testing::Message() << c.name << " config " << model.config_json);
  const testing::ConfigResult r =
      testing::compare_gpu_with_cpu(model, seed ^ 0x5eed, c.deterministic);
  std::printf(
      "%s: rel error prefill %.3e chunked %.3e decode %.3e, top-1 %lld/%lld, "
      "near-tie routes %lld/%lld\n",
      c.name, r.routes[0].rel(), r.routes[1].rel(), r.routes[2].rel(),
      static_cast<long long>(r.same_top1), static_cast<long long>(r.positions),
      static_cast<long long>(r.near_ties), static_cast<long long>(r.routed));
  EXPECT_GT(r.routed, 0) << "no MoE layer routed anything";
  EXPECT_LE(r.worst(), kMaxRelError) << "prefill " << r.routes[0].rel() << " chunked "
                                     << r.routes[1].rel() << " decode " << r.routes[2].rel();
  EXPECT_EQ(r.routing_mismatches, 0) << r.first_mismatch;
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("routing shapes")) return false;
  for (const ShapeCase& c : kCases) {
    cuda::testing_util::register_kernel_test(
        "CudaRoutingShapes", c.name, [&c] { gpu_matches_cpu(c); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
