// What the GPU decoder refuses at load, checked without a GPU: Qwen3-Next's linear-attention
// layers (named, with the way out), while the families it runs pass.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "model/gpu_decoder.h"
#include "model/synthetic.h"

namespace moeinfer {
namespace {

std::string refusal(const ModelConfig& config) {
  try {
    check_gpu_supports(config);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GpuSupport, RefusesLinearAttentionNamingTheLayers) {
  const std::string message = refusal(synthetic_model_config("qwen3-next-80b-a3b"));
  EXPECT_NE(message.find("qwen3_next: the Gated DeltaNet linear-attention layers (0, 1, 2, 4"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("36 of 48"), std::string::npos) << message;
  EXPECT_NE(message.find("--device cpu"), std::string::npos) << message;
  // create() says the same before it looks for a device.
  try {
    GpuDecoder::create(synthetic_model_config("qwen3-next-80b-a3b", 4), DecoderWeights{}, {});
    ADD_FAILURE() << "create did not refuse";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Gated DeltaNet"), std::string::npos) << e.what();
  }
}

TEST(GpuSupport, TheGatedAttentionAloneIsRefusedToo) {
  // A Qwen3-Next config of full-attention layers only still has the output gate.
  ModelConfig config = synthetic_model_config("qwen3-next-80b-a3b", 4);
  config.layer_is_linear.assign(4, false);
  config.linear_attention.reset();
  EXPECT_NE(refusal(config).find("attention output gate"), std::string::npos);
}

TEST(GpuSupport, PassesTheFamiliesItRuns) {
  for (const std::string& name : synthetic_model_names()) {
    if (name == "qwen3-next-80b-a3b") continue;
    EXPECT_EQ(refusal(synthetic_model_config(name)), "") << name;
  }
}

}  // namespace
}  // namespace moeinfer
