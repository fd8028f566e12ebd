// What the GPU decoder takes: every shape the CPU runs is padded to the kernels' needs at upload
// (hidden sizes to 64, head dims to 64/128/256 and above 256 to a multiple of 64, expert widths
// to 64, MLA's latent and rope key to 8) and any expert count and top-k are routed (past 1024
// experts or 32 per token by the block router): no config the CPU runs is refused when the
// weights are laid out. Host code only: runs without a GPU.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "io/model_config.h"
#include "model/cuda/device_weights.h"

namespace moeinfer {
namespace {

nlohmann::json qwen3(int64_t hidden) {
  return {{"model_type", "qwen3_moe"},
          {"vocab_size", 101},
          {"hidden_size", hidden},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 20},
          {"intermediate_size", 40},
          {"moe_intermediate_size", 24},
          {"num_experts", 6},
          {"num_experts_per_tok", 2},
          {"max_position_embeddings", 64}};
}

nlohmann::json deepseek_v3() {
  return {{"model_type", "deepseek_v3"},
          {"vocab_size", 77},
          {"hidden_size", 48},
          {"num_hidden_layers", 1},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 2},
          {"q_lora_rank", nullptr},
          {"kv_lora_rank", 24},
          {"qk_nope_head_dim", 16},
          {"qk_rope_head_dim", 8},
          {"v_head_dim", 16},
          {"n_routed_experts", 8},
          {"num_experts_per_tok", 2},
          {"n_group", 2},
          {"topk_group", 1},
          {"moe_intermediate_size", 16},
          {"intermediate_size", 32},
          {"first_k_dense_replace", 0},
          {"max_position_embeddings", 64}};
}

ModelConfig parse(const nlohmann::json& j) { return parse_model_config(j.dump(), "test config"); }

TEST(CudaSupport, OddHiddenSizesHeadDimsAndWidthsArePadded) {
  for (int64_t hidden : {16, 80, 96, 200}) {
    const ModelConfig c = parse(qwen3(hidden));
    EXPECT_EQ(gpu::padded_hidden_size(c), (hidden + 63) / 64 * 64) << hidden;
    EXPECT_EQ(gpu::padded_head_dim(c), 64);
    EXPECT_EQ(gpu::padded_expert_width(c), 64);
    EXPECT_GT(gpu::device_weight_bytes(c), 0);
  }
  EXPECT_GT(gpu::device_weight_bytes(parse(deepseek_v3())), 0);
}

TEST(CudaSupport, EveryHeadDimIsTakenPaddedPastTheFastKernels) {
  const std::pair<int64_t, int64_t> cases[] = {{20, 64},     {100, 128},   {200, 256},
                                               {256, 256},   {258, 320},   {272, 320},
                                               {320, 320},   {384, 384},   {500, 512},
                                               {640, 640},   {1000, 1024}, {1024, 1024},
                                               {4000, 4032}};
  for (const auto& [dim, padded] : cases) {
    nlohmann::json config = qwen3(64);
    config["head_dim"] = dim;
    const ModelConfig c = parse(config);
    EXPECT_EQ(gpu::padded_head_dim(c), padded) << dim;
    EXPECT_GT(gpu::device_weight_bytes(c), 0) << dim;
  }
  // Mixtral's head dim is hidden_size / heads unless given: 640 / 2.
  const ModelConfig mixtral = parse({{"model_type", "mixtral"},
                                     {"vocab_size", 101},
                                     {"hidden_size", 640},
                                     {"num_hidden_layers", 1},
                                     {"num_attention_heads", 2},
                                     {"num_key_value_heads", 1},
                                     {"intermediate_size", 32},
                                     {"num_local_experts", 4},
                                     {"num_experts_per_tok", 2},
                                     {"max_position_embeddings", 64}});
  EXPECT_EQ(mixtral.head_dim, 320);
  EXPECT_EQ(gpu::padded_head_dim(mixtral), 320);
  EXPECT_GT(gpu::device_weight_bytes(mixtral), 0);
}

TEST(CudaSupport, MlaLatentAndRopeKeyArePaddedToEight) {
  nlohmann::json config = deepseek_v3();
  config.update({{"kv_lora_rank", 20}, {"qk_rope_head_dim", 6}});
  const ModelConfig c = parse(config);
  const gpu::MlaPaddedDims dims = gpu::padded_mla_dims(c);
  EXPECT_EQ(dims.latent, 24);
  EXPECT_EQ(dims.rope, 8);
  EXPECT_EQ(dims.cache_width(), 32);
  EXPECT_GT(gpu::device_weight_bytes(c), 0);
  // A rope key wider than 64 beside a narrower latent.
  config.update({{"kv_lora_rank", 256}, {"qk_rope_head_dim", 128}});
  EXPECT_GT(gpu::device_weight_bytes(parse(config)), 0);
  EXPECT_EQ(gpu::padded_mla_dims(parse(qwen3(64))).cache_width(), 0);
}

// Latents past DeepSeek's 512 and cache rows past 512 + 64 run on the streaming MLA kernel
// (mla_attention_wide_kernel.cuh): accepted, padded as any other.
TEST(CudaSupport, MlaLatentsAndRopeKeysOfAnyWidthAreAccepted) {
  struct Case {
    int64_t kv_lora_rank, rope, latent, padded_rope;
  };
  for (const Case& c :
       {Case{520, 8, 520, 8}, Case{512, 72, 512, 72}, Case{600, 64, 600, 64},
        Case{1001, 100, 1008, 104}, Case{1024, 128, 1024, 128}, Case{1536, 64, 1536, 64}}) {
    nlohmann::json config = deepseek_v3();
    config.update({{"kv_lora_rank", c.kv_lora_rank}, {"qk_rope_head_dim", c.rope}});
    const ModelConfig parsed = parse(config);
    const gpu::MlaPaddedDims dims = gpu::padded_mla_dims(parsed);
    EXPECT_EQ(dims.latent, c.latent) << c.kv_lora_rank;
    EXPECT_EQ(dims.rope, c.padded_rope) << c.rope;
    int64_t bytes = 0;
    EXPECT_NO_THROW(bytes = gpu::device_weight_bytes(parsed)) << c.kv_lora_rank << " + " << c.rope;
    EXPECT_GT(bytes, 0) << c.kv_lora_rank << " + " << c.rope;
  }
}

TEST(CudaSupport, AnyExpertCountAndTopKIsAccepted) {
  // Past the one-warp router (1024 experts, 32 per token), K = E, and E + 1 past the
  // shared-memory plan.
  for (const auto& [experts, top_k] :
       {std::pair<int64_t, int64_t>{1100, 2}, {40, 33}, {4099, 64}, {48, 48}, {8200, 8}}) {
    nlohmann::json config = qwen3(64);
    config.update({{"num_experts", experts}, {"num_experts_per_tok", top_k}});
    EXPECT_GT(gpu::device_weight_bytes(parse(config)), 0) << experts << " x " << top_k;
  }
  nlohmann::json grouped = deepseek_v3();
  grouped.update({{"n_routed_experts", 1500},
                  {"num_experts_per_tok", 40},
                  {"n_group", 12},
                  {"topk_group", 4}});
  EXPECT_GT(gpu::device_weight_bytes(parse(grouped)), 0);
}

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
