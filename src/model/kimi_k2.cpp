// Kimi K2: DeepSeek-V3's architecture under model_type kimi_k2, published as
// DeepseekV3ForCausalLM with DeepSeek-V3's tensor names (384 routed experts, one group, one dense
// first layer, fp8 block-scaled weights). Its own part is the tokenizer (io/tiktoken.h).
#include "model/family.h"

namespace moeinfer {

DecoderWeights bind_kimi_k2(const ModelConfig& config, WeightSource& src) {
  // The same names as DeepSeek-V3, read by its binder; the config is otherwise V3's (sigmoid
  // router with e_score_correction_bias), which is what that binder keys on.
  ModelConfig as_v3 = config;
  as_v3.family = ModelFamily::kDeepseekV3;
  return bind_deepseek(as_v3, src);
}

}  // namespace moeinfer
