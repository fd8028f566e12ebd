// The GPU decoder refuses at load, by name, the models it does not compute (check_gpu_support
// runs before any device work, so this holds on machines without a GPU too): Llama 4, and the
// linear attention of Qwen3-Next and Qwen3.5-MoE.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "io/model_config.h"
#include "model/gpu_decoder.h"
#include "model/synthetic.h"

namespace moeinfer {
namespace {

const std::filesystem::path kModels = std::filesystem::path(MOE_FIXTURES_DIR) / "models";

std::string refusal_of(const ModelConfig& config) {
  try {
    check_gpu_support(config);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GpuSupport, RefusesLlama4NamingWhatItLacks) {
  for (const char* fixture : {"llama4_text_f32", "llama4_vision_bf16"}) {
    const std::string error = refusal_of(load_model_config(kModels / fixture));
    EXPECT_NE(error.find("chunked local attention"), std::string::npos) << fixture << ": " << error;
    EXPECT_NE(error.find("experts' input"), std::string::npos) << fixture << ": " << error;
    EXPECT_NE(error.find("--device cpu"), std::string::npos) << fixture << ": " << error;
  }
  EXPECT_NE(refusal_of(synthetic_model_config("llama4-scout")).find("llama4:"), std::string::npos);
}

TEST(GpuSupport, RefusesLinearAttentionNamingTheLayers) {
  const std::string message = refusal_of(synthetic_model_config("qwen3-next-80b-a3b"));
  EXPECT_NE(message.find("qwen3_next: the Gated DeltaNet linear-attention layers (0, 1, 2, 4"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("36 of 48"), std::string::npos) << message;
  EXPECT_NE(message.find("--device cpu"), std::string::npos) << message;
  for (const char* fixture : {"qwen3_next_f32", "qwen3_next_bf16", "qwen3_5_moe_f32"}) {
    EXPECT_NE(refusal_of(load_model_config(kModels / fixture)).find("Gated DeltaNet"),
              std::string::npos)
        << fixture;
  }
}

TEST(GpuSupport, RefusesQwen3NextsGatedAttentionAlone) {
  // A Qwen3-Next config of full-attention layers only still has the output gate.
  ModelConfig config = synthetic_model_config("qwen3-next-80b-a3b", 4);
  config.layer_is_linear.assign(4, false);
  config.linear_attention.reset();
  EXPECT_NE(refusal_of(config).find("attention output gate"), std::string::npos);
}

TEST(GpuSupport, AcceptsTheFamiliesItComputes) {
  for (const char* fixture : {"qwen3_moe_f32", "deepseek_v3_f32", "glm4_moe_f32"}) {
    EXPECT_EQ(refusal_of(load_model_config(kModels / fixture)), "") << fixture;
  }
}

}  // namespace
}  // namespace moeinfer
