// The GPU decoder refuses at load, by name, the models it does not compute (check_gpu_support
// runs before any device work, so this holds on machines without a GPU too).
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

TEST(GpuSupport, AcceptsTheFamiliesItComputes) {
  for (const char* fixture : {"qwen3_moe_f32", "deepseek_v3_f32", "glm4_moe_f32"}) {
    EXPECT_EQ(refusal_of(load_model_config(kModels / fixture)), "") << fixture;
  }
}

}  // namespace
}  // namespace moeinfer
