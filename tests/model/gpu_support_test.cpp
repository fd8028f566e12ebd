// The GPU decoder refuses at load, by name, the models it does not compute (check_gpu_support
// runs before any device work, so this holds on machines without a GPU too): Llama 4's and
// Qwen3-Next's --expert-budget (both models themselves run). Also the KV row types it keeps
// (gpu_kv_unsupported: bf16 and fp8, MLA's too, not f32, fp8 not for heads past 256) and the pool's
// bytes per token under each (gpu_kv_bytes_per_token), which are the planner's.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/error.h"
#include "io/model_config.h"
#include "model/capacity_plan.h"
#include "model/gpu_decoder.h"
#include "model/model_facts.h"
#include "model/synthetic.h"
#include "offload/parse_options.h"

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

TEST(GpuSupport, TakesLlama4ButNotItsExpertBudget) {
  for (const char* fixture : {"llama4_text_f32", "llama4_vision_bf16"}) {
    const ModelConfig config = load_model_config(kModels / fixture);
    EXPECT_EQ(refusal_of(config), "") << fixture;
    // The expert cache's host compute reads unweighted rows: --expert-budget is refused by name.
    try {
      check_gpu_offload(config, offload::parse_offload_flags("25%", "lru"));
      ADD_FAILURE() << fixture << ": its experts were offloaded on the GPU";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(": --expert-budget on cuda"), std::string::npos) << message;
      EXPECT_NE(message.find("experts' input"), std::string::npos) << message;
      EXPECT_NE(message.find("run without --expert-budget"), std::string::npos) << message;
    }
    EXPECT_NO_THROW(check_gpu_offload(config, offload::OffloadOptions{})) << fixture;
  }
  EXPECT_EQ(refusal_of(synthetic_model_config("llama4-scout")), "");
}

// Gated DeltaNet layers, the attention output gate and zero-centred norms run on the GPU; the
// expert cache has not been held to the CPU with a recurrent state, so --expert-budget is
// refused by name.
TEST(GpuSupport, TakesQwen3NextButNotItsExpertBudget) {
  for (const char* fixture :
       {"qwen3_next_f32", "qwen3_next_bf16", "qwen3_5_moe_f32", "qwen3_5_moe_bf16"}) {
    const ModelConfig config = load_model_config(kModels / fixture);
    EXPECT_EQ(refusal_of(config), "") << fixture;
    try {
      check_gpu_offload(config, offload::parse_offload_flags("25%", "lru"));
      ADD_FAILURE() << fixture << ": its experts were offloaded on the GPU";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(": --expert-budget on cuda is not supported yet for models with "
                             "Gated DeltaNet layers"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("run without --expert-budget"), std::string::npos) << message;
    }
    EXPECT_NO_THROW(check_gpu_offload(config, offload::OffloadOptions{})) << fixture;
  }
  EXPECT_EQ(refusal_of(synthetic_model_config("qwen3-next-80b-a3b")), "");
  // The GPU needs some layer with a KV cache: a config of linear layers only is refused.
  ModelConfig all_linear = synthetic_model_config("qwen3-next-80b-a3b", 4);
  all_linear.layer_is_linear.assign(4, true);
  EXPECT_NE(refusal_of(all_linear).find("every layer is linear attention"), std::string::npos);
}

TEST(GpuSupport, AcceptsTheFamiliesItComputes) {
  for (const char* fixture : {"qwen3_moe_f32", "deepseek_v3_f32", "glm4_moe_f32"}) {
    EXPECT_EQ(refusal_of(load_model_config(kModels / fixture)), "") << fixture;
  }
}

std::string kv_refusal_of(const ModelConfig& config, KvDType dtype) {
  try {
    check_gpu_kv_dtype(config, dtype);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GpuSupport, KeepsBf16AndFp8KvRowsAndRefusesTheRestByName) {
  const ModelConfig gqa = load_model_config(kModels / "qwen3_moe_f32");
  EXPECT_EQ(kv_refusal_of(gqa, KvDType::kBF16), "");
  EXPECT_EQ(kv_refusal_of(gqa, KvDType::kFP8), "");
  EXPECT_NE(kv_refusal_of(gqa, KvDType::kF32).find("--kv-dtype f32 applies to --device cpu"),
            std::string::npos);
  // MLA's latent cache keeps bf16 and fp8 rows (the latent and the rope key, a scale each).
  for (const char* fixture : {"deepseek_v2_lite_f32", "deepseek_v3_f32", "kimi_k2_f32"}) {
    const ModelConfig mla = load_model_config(kModels / fixture);
    EXPECT_EQ(kv_refusal_of(mla, KvDType::kBF16), "") << fixture;
    EXPECT_EQ(kv_refusal_of(mla, KvDType::kFP8), "") << fixture;
    EXPECT_NE(kv_refusal_of(mla, KvDType::kF32).find("--kv-dtype f32 applies to --device cpu"),
              std::string::npos)
        << fixture;
  }
  // Heads past 256 (the wide decode kernel) read bf16 rows only.
  ModelConfig wide = gqa;
  wide.head_dim = 320;
  EXPECT_NE(kv_refusal_of(wide, KvDType::kFP8).find("does not support head_dim 320"),
            std::string::npos);
  EXPECT_EQ(kv_refusal_of(wide, KvDType::kBF16), "");
}

TEST(GpuSupport, KvBytesPerTokenAreThePlannersAtThePaddedHeadDim) {
  for (const char* name : {"qwen3-30b-a3b", "mixtral-8x7b"}) {
    const ModelConfig c = synthetic_model_config(name);
    ASSERT_EQ(c.head_dim, 128) << name;
    const int64_t L = c.num_layers, Nkv = c.num_kv_heads;
    for (KvDType dtype : {KvDType::kBF16, KvDType::kFP8}) {
      // No padding: exactly what `moeinfer plan --kv-dtype` counts.
      const PlanOptions options{.kv_dtype = dtype};
      EXPECT_EQ(gpu_kv_bytes_per_token(c, 128, 0, dtype), kv_bytes_per_token(c, dtype)) << name;
      EXPECT_EQ(gpu_kv_bytes_per_token(c, 128, 0, dtype),
                plan_capacity(c, options).kv_bytes_per_token)
          << name;
    }
    // bf16: keys and values, 2 bytes a value; fp8: a byte a value and a float32 scale per head.
    EXPECT_EQ(gpu_kv_bytes_per_token(c, 128, 0, KvDType::kBF16), L * 2 * Nkv * 128 * 2);
    EXPECT_EQ(gpu_kv_bytes_per_token(c, 128, 0, KvDType::kFP8), L * 2 * Nkv * (128 + 4));
    // About twice the tokens in the same bytes: 2 * 128 / (128 + 4).
    const double ratio = static_cast<double>(gpu_kv_bytes_per_token(c, 128, 0, KvDType::kBF16)) /
                         static_cast<double>(gpu_kv_bytes_per_token(c, 128, 0, KvDType::kFP8));
    EXPECT_NEAR(ratio, 256.0 / 132.0, 1e-12) << name;
  }
  // A head of 80 is padded to the decode kernels' 128: the pool counts the padding.
  ModelConfig c = synthetic_model_config("qwen3-30b-a3b");
  c.head_dim = 80;
  EXPECT_EQ(gpu_kv_bytes_per_token(c, 128, 0, KvDType::kFP8),
            c.num_layers * 2 * c.num_kv_heads * (128 + 4));
  // MLA: the latent row; bf16, or fp8 codes and two float32 scales (latent, rope key), as the
  // planner counts them when L and R need no padding (DeepSeek's 512 + 64).
  const ModelConfig mla = load_model_config(kModels / "deepseek_v3_f32");
  const int64_t width = mla.mla->cache_width();
  EXPECT_EQ(gpu_kv_bytes_per_token(mla, 0, width, KvDType::kBF16), mla.num_layers * width * 2);
  EXPECT_EQ(gpu_kv_bytes_per_token(mla, 0, width, KvDType::kBF16),
            kv_bytes_per_token(mla, KvDType::kBF16));
  EXPECT_EQ(gpu_kv_bytes_per_token(mla, 0, width, KvDType::kFP8), mla.num_layers * (width + 8));
  EXPECT_EQ(gpu_kv_bytes_per_token(mla, 0, width, KvDType::kFP8),
            kv_bytes_per_token(mla, KvDType::kFP8));
  const ModelConfig v3 = synthetic_model_config("deepseek-v3");
  ASSERT_EQ(v3.mla->cache_width(), 512 + 64);
  EXPECT_EQ(gpu_kv_bytes_per_token(v3, 0, 576, KvDType::kFP8),
            kv_bytes_per_token(v3, KvDType::kFP8));
  EXPECT_EQ(gpu_kv_bytes_per_token(v3, 0, 576, KvDType::kFP8),
            plan_capacity(v3, PlanOptions{.kv_dtype = KvDType::kFP8}).kv_bytes_per_token);
  // A latent of 36 and a rope key of 12 are padded to 40 + 16 on the GPU: its pool counts the
  // padding's codes, the planner (the CPU's rows) does not.
  ModelConfig odd = mla;
  odd.mla->kv_lora_rank = 36;
  odd.mla->qk_rope_head_dim = 12;
  EXPECT_EQ(gpu_kv_bytes_per_token(odd, 0, 40 + 16, KvDType::kFP8),
            odd.num_kv_layers() * (40 + 16 + 8));
  EXPECT_EQ(kv_bytes_per_token(odd, KvDType::kFP8), odd.num_kv_layers() * (36 + 12 + 8));
}

}  // namespace
}  // namespace moeinfer
