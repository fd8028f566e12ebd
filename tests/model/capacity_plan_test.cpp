// The capacity planner against what the engine really allocates for real checkpoints (weights
// as stored, KV bytes per token of the cache it builds), and its layouts on published shapes.
#include "model/capacity_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/error.h"
#include "model/model.h"
#include "model/synthetic.h"
#include "offload/parse_options.h"

namespace moeinfer {
namespace {

const std::filesystem::path kRepo = std::filesystem::path(MOE_FIXTURES_DIR) / ".." / "..";

void expect_within(double planned, double actual, double fraction, const std::string& what) {
  EXPECT_LE(std::fabs(planned - actual), fraction * actual)
      << what << ": planned " << planned << ", actual " << actual;
}

TEST(CapacityPlan, MatchesWhatTheEngineAllocatesForBf16Checkpoints) {
  for (const auto& dir :
       {kRepo / "models" / "demo", kRepo / "tests" / "fixtures" / "models" / "qwen3_moe_bf16",
        kRepo / "tests" / "fixtures" / "models" / "mixtral_bf16"}) {
    auto model = Model::load(dir, LoadOptions{.prefault = false});
    const ModelConfig& config = model->config();
    const CapacityPlan plan = plan_capacity(config, PlanOptions{.kv_dtype = KvDType::kF32});
    expect_within(static_cast<double>(plan.weight_bytes.total()),
                  static_cast<double>(model->store().total_bytes()), 0.05, dir.string());
    const KvCache cache = model->decoder().make_cache(8);
    EXPECT_EQ(static_cast<size_t>(plan.kv_bytes_per_token), cache.bytes_per_token()) << dir;
  }
}

TEST(CapacityPlan, PublishedShapesPickTheExpectedLayout) {
  // Qwen3-30B-A3B in bf16 (61 GB) fits one 141 GB H200.
  const CapacityPlan small =
      plan_capacity(synthetic_model_config("qwen3-30b-a3b"), PlanOptions{.gpu_mem_gib = 139});
  EXPECT_EQ(small.layout, Layout::kSingleGpu);
  EXPECT_EQ(small.run_flags, "--device cuda");
  EXPECT_NEAR(small.weight_bytes.total() / 1e9, 61.1, 0.5);
  // Qwen3-235B-A22B (470 GB) would be expert parallel over 8 GPUs, which the GPU path does not
  // run yet: the plan shows that layout and recommends offloading on one GPU, as for one GPU.
  const ModelConfig big = synthetic_model_config("qwen3-235b-a22b");
  const CapacityPlan eight = plan_capacity(big, PlanOptions{.num_gpus = 8, .gpu_mem_gib = 139});
  EXPECT_EQ(eight.layout, Layout::kOffload);
  EXPECT_EQ(eight.gpus_used, 1);
  EXPECT_EQ(eight.run_flags, "--device cuda --expert-budget " + eight.expert_budget_flag);
  EXPECT_TRUE(
      std::any_of(eight.arithmetic.begin(), eight.arithmetic.end(), [](const std::string& l) {
        return l.starts_with("expert parallel over 8 GPUs") &&
               l.find("planning for one GPU") != std::string::npos;
      }));
  const CapacityPlan offload =
      plan_capacity(big, PlanOptions{.gpu_mem_gib = 139, .max_seq_len = 8192});
  EXPECT_EQ(offload.layout, Layout::kOffload);
  EXPECT_GT(offload.gpu_experts_per_layer, big.num_experts_per_tok);
  EXPECT_LT(offload.gpu_experts_per_layer, big.num_experts);
  // The budget to pass is the experts counted in the GPU's weights, in whole MiB, and parses
  // back to the same bytes.
  int64_t moe_layers = 0;
  for (bool m : big.layer_is_moe) moe_layers += m;
  const double expert_bytes = static_cast<double>(offload.weight_bytes.routed_experts) /
                              static_cast<double>(moe_layers * big.num_experts);
  EXPECT_NEAR(static_cast<double>(offload.expert_budget_bytes),
              offload.gpu_experts_per_layer * moe_layers * expert_bytes, 1024.0 * 1024.0);
  EXPECT_EQ(offload.expert_budget_bytes % (1 << 20), 0);
  offload::OffloadOptions parsed;
  offload::parse_expert_budget(offload.expert_budget_flag, &parsed);
  EXPECT_EQ(parsed.budget_bytes, offload.expert_budget_bytes);
  EXPECT_EQ(small.expert_budget_bytes, 0);  // nothing to offload when it fits
  // DeepSeek-V3's KV per token is its latent: 61 layers x 576 values x 2 bytes.
  const CapacityPlan v3 = plan_capacity(
      synthetic_model_config("deepseek-v3"),
      PlanOptions{.num_gpus = 8, .gpu_mem_gib = 139, .weight_dtype = WeightDType::kFP8});
  EXPECT_EQ(v3.kv_bytes_per_token, 61 * 576 * 2);
  EXPECT_NEAR(v3.weight_bytes.total() / 1e9, 690.0, 30.0);
}

}  // namespace
}  // namespace moeinfer

namespace moeinfer {
namespace {

// Qwen3-Next: KV rows only in the full-attention layers and the linear layers' recurrent state per
// sequence, both as the engine's pool (Decoder::make_pool, the layout Engine uses) allocates them;
// the fixtures fit one GPU whole, so the plan runs them there.
TEST(CapacityPlan, LinearAttentionKvAndStateMatchThePool) {
  for (const char* name : {"qwen3_next_f32", "qwen3_next_bf16", "qwen3_5_moe_f32"}) {
    auto model =
        Model::load(kRepo / "tests" / "fixtures" / "models" / name, LoadOptions{.prefault = false});
    const ModelConfig& config = model->config();
    const CapacityPlan plan = plan_capacity(config, PlanOptions{.kv_dtype = KvDType::kF32});
    const KvBlockPool pool = model->decoder().make_pool(16, 4, 3);
    EXPECT_EQ(static_cast<size_t>(plan.kv_bytes_per_token), pool.bytes_per_token()) << name;
    EXPECT_EQ(static_cast<size_t>(plan.state_bytes_per_sequence),
              pool.recurrent_state().shape().bytes_per_slot())
        << name;
    EXPECT_EQ(plan.run_flags, "--device cuda") << name;
  }
}

TEST(CapacityPlan, Qwen3Next80BA3BCountsTwelveKvLayersAndTheState) {
  const CapacityPlan plan = plan_capacity(synthetic_model_config("qwen3-next-80b-a3b"),
                                          PlanOptions{.gpu_mem_gib = 139, .max_seq_len = 32768});
  EXPECT_EQ(plan.kv_bytes_per_token, 12 * 2 * 2 * 256 * 2);  // bf16 keys and values
  EXPECT_EQ(plan.state_bytes_per_sequence, 36 * (8192 * 3 + 32 * 128 * 128) * 4);
  EXPECT_NEAR(plan.weight_bytes.total() / 1e9, 159.3, 1.0);
  EXPECT_EQ(plan.layout, Layout::kOffload);
  EXPECT_EQ(plan.run_flags, "--device cpu");
  EXPECT_TRUE(std::any_of(plan.arithmetic.begin(), plan.arithmetic.end(), [](const std::string& l) {
    return l.starts_with("recurrent state per sequence: 36 linear layers");
  }));
}

TEST(CapacityPlan, AContextWhoseKvDoesNotFitNamesTheFlag) {
  // Llama 4 Scout publishes a 10M-token context: one sequence's KV alone is about 1.8 TiB.
  const ModelConfig scout = synthetic_model_config("llama4-scout");
  try {
    plan_capacity(scout, PlanOptions{});
    FAIL() << "a plan whose one sequence cannot fit was made";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one sequence of 10485760 tokens"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("--max-seq-len"), std::string::npos) << e.what();
  }
  EXPECT_GT(plan_capacity(scout, PlanOptions{.max_seq_len = 8192}).kv_tokens_fit, 8192);
}

// Out-of-range options are refused naming the flag: an infinite --gpu-mem printed a negative
// token count, a negative --max-seq-len was taken as the model's context.
TEST(CapacityPlan, OutOfRangeOptionsNameTheFlag) {
  const ModelConfig config = synthetic_model_config("qwen3-30b-a3b");
  const auto expect_refused = [&](const PlanOptions& options, const std::string& flag) {
    try {
      plan_capacity(config, options);
      FAIL() << "a plan was made with a bad " << flag;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  };
  expect_refused(PlanOptions{.gpu_mem_gib = INFINITY}, "--gpu-mem");
  expect_refused(PlanOptions{.gpu_mem_gib = NAN}, "--gpu-mem");
  expect_refused(PlanOptions{.gpu_mem_gib = 1e30}, "--gpu-mem");
  expect_refused(PlanOptions{.num_gpus = int64_t{1} << 40}, "--gpus");
  expect_refused(PlanOptions{.max_seq_len = -5}, "--max-seq-len");
  expect_refused(PlanOptions{.memory_fraction = 1.5}, "--gpu-memory-fraction");
  // The bounds still take any real machine.
  EXPECT_GT(plan_capacity(config, PlanOptions{.num_gpus = 8, .gpu_mem_gib = 192}).kv_tokens_fit, 0);
}

}  // namespace
}  // namespace moeinfer
