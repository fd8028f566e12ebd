// GPT-OSS's pieces one at a time, beside the parity fixtures (gpt_oss_*): the published
// parameter counts, the KV the plan counts against the engine's pool, MXFP4 dequantisation by
// block and nibble, the router's top-k-then-softmax, the experts' biases and clamped SwiGLU, and
// the refusals (the GPU decoder, blocks without their quantization_config).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "../support/temp_path.h"
#include "core/error.h"
#include "model/capacity_plan.h"
#include "model/gpu_decoder.h"
#include "model/model.h"
#include "model/model_facts.h"
#include "model/synthetic.h"
#include "model/weight_source.h"
#include "moe/stages.h"
#include "offload/parse_options.h"
#include "parallel/communicator.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

TEST(GptOss, PublishedParameterCounts) {
  // OpenAI's model card: gpt-oss-120b 116.83B parameters, 5.13B active per token without the
  // embedding (the LM head counted); gpt-oss-20b 20.91B and 3.61B.
  const ModelConfig big = synthetic_model_config("gpt-oss-120b");
  const PartCounts total = count_params(big, /*active_only=*/false);
  const PartCounts active = count_params(big, /*active_only=*/true);
  // Per layer: q/k/v/o with biases and 64 sinks; 128 experts of 3 * 2880 * 2880 weights and
  // 2 * 2880 + 2880 biases; the router and its bias; two norms.
  EXPECT_EQ(total.attention, 36 * (2 * 2880 * 4096 + 2 * 2880 * 512 + 4096 + 2 * 512 + 2880 + 64));
  EXPECT_EQ(total.routed_experts, int64_t{36} * 128 * (3 * 2880 * 2880 + 3 * 2880));
  EXPECT_EQ(total.other, 36 * (128 * 2880 + 128 + 2 * 2880) + 2880);
  EXPECT_EQ(total.embeddings, 2 * int64_t{201088} * 2880);
  EXPECT_EQ(total.total(), 116'829'156'672);
  EXPECT_EQ(active.total() - active.embeddings / 2, 5'132'849'472);

  const ModelConfig small = synthetic_model_config("gpt-oss-20b");
  EXPECT_EQ(count_params(small, false).total(), 20'914'757'184);
  const PartCounts small_active = count_params(small, true);
  EXPECT_EQ(small_active.total() - small_active.embeddings / 2, 3'608'307'264);

  // --layers keeps the alternation (layer_types is the default one, left out of the config).
  const ModelConfig cut = synthetic_model_config("gpt-oss-120b", 3);
  EXPECT_EQ(cut.window_of(0), 128);
  EXPECT_EQ(cut.window_of(1), 0);
  EXPECT_EQ(cut.window_of(2), 128);
  EXPECT_TRUE(cut.mxfp4);
}

TEST(GptOss, PlanKvBytesPerTokenAreTheEnginePool) {
  // The CPU pool keeps every position of every layer (a sliding layer's window bounds what it
  // reads, not what it stores), keys and values in float32.
  for (const char* name : {"gpt_oss_f32", "gpt_oss_mxfp4"}) {
    const auto dir = kModels / name;
    constexpr int64_t kKvCacheMb = 16;
    auto engine =
        Engine::load(dir, EngineConfig{.kv_cache_mb = kKvCacheMb}, LoadOptions{.prefault = false});
    const ModelConfig& config = engine->model_config();
    const CapacityPlan plan = plan_capacity(config, PlanOptions{.kv_dtype = KvDType::kF32});
    EXPECT_EQ(plan.kv_bytes_per_token, config.num_layers * 2 * config.kv_dim() * 4) << name;
    const int64_t block_bytes = plan.kv_bytes_per_token * engine->config().block_size;
    EXPECT_EQ(engine->num_kv_blocks(), (kKvCacheMb << 20) / block_bytes) << name;
  }
}

TEST(GptOss, PlanWeightBytesAreTheBoundTensors) {
  // The MXFP4 fixture's experts are bound as their bf16 dequantisation, as the plan counts them
  // at --dtype bf16; only the biases differ (float32 in the engine, 2 bytes in the plan).
  auto model = Model::load(kModels / "gpt_oss_mxfp4", LoadOptions{.prefault = false});
  const ModelConfig& config = model->config();
  const ModelFacts facts = model_facts(config, model->decoder().weights(),
                                       static_cast<int64_t>(model->store().total_bytes()));
  const CapacityPlan plan = plan_capacity(config, PlanOptions{});
  const int64_t E = config.num_experts, H = config.hidden_size, I = config.moe_intermediate_size;
  const int64_t bias_values = config.num_layers * E * (2 * I + H);
  EXPECT_EQ(plan.weight_bytes.routed_experts + 2 * bias_values,
            facts.resident_bytes.routed_experts);
  EXPECT_EQ(plan.weight_bytes.attention, facts.resident_bytes.attention);
  EXPECT_EQ(plan.weight_bytes.embeddings, facts.resident_bytes.embeddings);
  EXPECT_EQ(plan.weight_bytes.other, facts.resident_bytes.other);
}

TEST(GptOss, Mxfp4DequantisesByBlockAndNibble) {
  // Two rows of one 32-value block each. Row 0: scale byte 129 (x4), bytes 0x71 (0.5 then 6),
  // 0xF8 (-0 then -6), 0x2A (-1 then 1). Row 1: scale byte 125 (x0.25), last byte 0x53 (1.5 then
  // 3). Row 0 goes to output row 1 and row 1 to row 0.
  std::vector<uint8_t> blocks(32, 0);
  blocks[0] = 0x71;
  blocks[1] = 0xF8;
  blocks[2] = 0x2A;
  blocks[16 + 15] = 0x53;
  const std::vector<uint8_t> scales = {129, 125};
  const std::vector<int64_t> destination = {1, 0};
  std::vector<uint16_t> out(64, 0xFFFF);
  dequantize_mxfp4_rows(blocks.data(), scales.data(), 2, 32, destination, out.data());
  std::vector<float> got(64);
  for (int i = 0; i < 64; ++i) got[i] = bf16_to_f32(out[i]);
  std::vector<float> want(64, 0.0f);
  want[32 + 0] = 2.0f;
  want[32 + 1] = 24.0f;
  want[32 + 2] = -0.0f;
  want[32 + 3] = -24.0f;
  want[32 + 4] = -4.0f;
  want[32 + 5] = 4.0f;
  want[30] = 0.375f;
  want[31] = 0.75f;
  EXPECT_EQ(got, want);
  EXPECT_TRUE(std::signbit(got[32 + 2]));  // the code for -0 keeps its sign
}

TEST(GptOss, RouterPicksTopLogitsThenSoftmaxesThem) {
  // Two tokens, four experts; the second token's best logits tie at 2, the lower id first.
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.5f, 2.0f, -1.0f, 0.0f, 2.0f};
  moe::Routing routing;
  moe::route(logits.data(), 2,
             moe::RouterOptions{.num_experts = 4,
                                .top_k = 2,
                                .score = moe::ScoreFunction::kTopkSoftmax,
                                .renormalize = true},
             &routing);
  EXPECT_EQ(routing.topk_ids, (std::vector<int32_t>{1, 2, 0, 3}));
  const float e = std::exp(1.0f);
  EXPECT_FLOAT_EQ(routing.topk_weights[0], e / (e + 1.0f));
  EXPECT_FLOAT_EQ(routing.topk_weights[1], 1.0f / (e + 1.0f));
  EXPECT_FLOAT_EQ(routing.topk_weights[2], 0.5f);
  EXPECT_FLOAT_EQ(routing.topk_weights[3], 0.5f);
}

TEST(GptOss, ExpertBiasesAndClampedSwiglu) {
  // One expert, H = I = 2, identity matrices: gate = x + gate_bias, up = x + up_bias; the gate
  // is clamped above only, the up projection on both sides.
  const std::vector<float> eye = {1.0f, 0.0f, 0.0f, 1.0f};
  const std::vector<float> gate_bias = {0.5f, 0.0f}, up_bias = {0.0f, -0.25f};
  const std::vector<float> down_bias = {0.1f, -0.1f};
  const auto view = [](const std::vector<float>& v, Shape shape) {
    return TensorView{.dtype = DType::kF32, .shape = shape, .data = v.data()};
  };
  const moe::ExpertWeights expert{.gate = view(eye, {2, 2}),
                                  .up = view(eye, {2, 2}),
                                  .down = view(eye, {2, 2}),
                                  .gate_bias = view(gate_bias, {2}),
                                  .up_bias = view(up_bias, {2}),
                                  .down_bias = view(down_bias, {2})};
  const std::vector<float> rows = {10.0f, 2.0f, -10.0f, -9.0f};
  const std::vector<int32_t> offsets = {0, 2};
  std::vector<float> out(4, NAN);
  const moe::ExpertActivation act{
      .kind = moe::ActivationKind::kClampedSwiglu, .alpha = 1.702f, .limit = 7.0f};
  moe::run_experts(rows.data(), 2, 2, offsets, std::span<const moe::ExpertWeights>(&expert, 1),
                   out.data(), act);
  const auto swiglu = [](float g, float u) {
    return (u + 1.0f) * g / (1.0f + std::exp(-1.702f * g));
  };
  // Row 0: gate (10.5, 2) -> (7, 2), up (10, 1.75) -> (7, 1.75).
  // Row 1: gate (-9.5, -9) unclamped, up (-10, -9.25) -> (-7, -7).
  const std::vector<float> want = {swiglu(7.0f, 7.0f) + 0.1f, swiglu(2.0f, 1.75f) - 0.1f,
                                   swiglu(-9.5f, -7.0f) + 0.1f, swiglu(-9.0f, -7.0f) - 0.1f};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], want[i], 1e-5f * std::fabs(want[i])) << i;
}

// Every way the decoder rebuilds its MoE block keeps the experts' activation and biases: expert
// parallelism over one rank, a simulated expert budget, and back to resident experts.
TEST(GptOss, ExpertParallelAndOffloadKeepTheLogits) {
  auto model = Model::load(kModels / "gpt_oss_f32", LoadOptions{.prefault = false});
  Decoder& decoder = model->decoder();
  const std::vector<int32_t> prompt = {7, 300, 42, 11, 500, 3, 99, 250};
  const int64_t V = decoder.config().vocab_size;
  const auto logits = [&] {
    KvCache cache = decoder.make_cache(16);
    std::vector<float> out(prompt.size() * V);
    decoder.forward(prompt, cache, out, /*all_positions=*/true);
    return out;
  };
  const std::vector<float> resident = logits();
  parallel::SelfCommunicator self;
  decoder.set_expert_parallel(&self);
  EXPECT_EQ(logits(), resident) << "expert parallel over one rank";
  decoder.set_expert_parallel(nullptr);
  EXPECT_EQ(logits(), resident) << "back to resident experts";
  decoder.set_offload(offload::parse_offload_flags("25%", "lru"));
  EXPECT_EQ(logits(), resident) << "a 25% expert budget";
  decoder.set_offload(offload::OffloadOptions{});
  EXPECT_EQ(logits(), resident) << "offload turned off";
}

TEST(GptOss, GpuDecoderTakesItButNotItsExpertBudget) {
  const ModelConfig config = synthetic_model_config("gpt-oss-20b");
  EXPECT_NO_THROW(check_gpu_support(config));
  EXPECT_FALSE(gpu_unsupported(config).has_value());
  EXPECT_NO_THROW(check_gpu_offload(config, offload::OffloadOptions{}));
  try {
    check_gpu_offload(config, offload::parse_offload_flags("25%", "lru"));
    FAIL() << "gpt_oss's experts were offloaded on the GPU";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("gpt_oss: --expert-budget on cuda"), std::string::npos) << message;
    EXPECT_NE(message.find("run without --expert-budget"), std::string::npos) << message;
  }
  EXPECT_FALSE(gpu_offload_unsupported(synthetic_model_config("qwen3-30b-a3b")).has_value());
}

TEST(GptOss, PlanRunsItOnTheGpuWhereItFitsWithoutAnExpertBudget) {
  // 20b's bf16 weights (about 42 GB) fit 80 GB: the GPU, every expert resident.
  EXPECT_EQ(plan_capacity(synthetic_model_config("gpt-oss-20b"), PlanOptions{.gpu_mem_gib = 80})
                .run_flags,
            "--device cuda");
  // 120b's do not, and the GPU's expert cache cannot take its experts: the CPU, saying why.
  const CapacityPlan plan =
      plan_capacity(synthetic_model_config("gpt-oss-120b"), PlanOptions{.gpu_mem_gib = 80});
  EXPECT_EQ(plan.run_flags, "--device cpu");
  ASSERT_FALSE(plan.arithmetic.empty());
  EXPECT_EQ(plan.arithmetic.front().rfind("note: gpt_oss: --expert-budget on cuda", 0), 0u)
      << plan.arithmetic.front();
  EXPECT_EQ(plan_capacity(synthetic_model_config("qwen3-30b-a3b"), PlanOptions{}).run_flags,
            "--device cuda");
}

TEST(GptOss, Mxfp4BlocksWithoutTheirQuantizationConfigAreRefused) {
  const auto dir = testing::unique_temp_path("gpt_oss_no_qconfig");
  std::filesystem::create_directories(dir);
  for (const char* file : {"model.safetensors", "tokenizer.json"}) {
    std::filesystem::copy_file(kModels / "gpt_oss_mxfp4" / file, dir / file,
                               std::filesystem::copy_options::overwrite_existing);
  }
  nlohmann::json config;
  std::ifstream(kModels / "gpt_oss_mxfp4" / "config.json") >> config;
  config.erase("quantization_config");
  std::ofstream(dir / "config.json") << config.dump();
  try {
    Model::load(dir, LoadOptions{.prefault = false});
    ADD_FAILURE() << "MXFP4 blocks were read without a quantization_config";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("mlp.experts.gate_up_proj_blocks' is MXFP4"), std::string::npos)
        << message;
    EXPECT_NE(message.find("quant_method mxfp4"), std::string::npos) << message;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moeinfer
