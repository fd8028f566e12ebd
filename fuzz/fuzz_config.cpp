// libFuzzer target: parse_model_config on arbitrary text. A moeinfer::Error is the expected
// answer to a bad config; any other exception, a sanitizer report, or an accepted config that
// breaks ModelConfig's invariants is a bug.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "io/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  try {
    const ModelConfig c =
        parse_model_config(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    const bool ok =
        c.vocab_size > 0 && c.hidden_size > 0 && c.num_layers > 0 && c.num_heads > 0 &&
        c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0 && c.head_dim > 0 &&
        c.head_dim % 2 == 0 && c.num_experts > 0 && c.num_experts_per_tok > 0 &&
        c.num_experts_per_tok <= c.num_experts &&
        // Qwen3.5-MoE has no dense layer, and no dense width (0).
        (c.intermediate_size > 0 ||
         std::all_of(c.layer_is_moe.begin(), c.layer_is_moe.end(), [](bool moe) { return moe; })) &&
        c.moe_intermediate_size > 0 &&
        static_cast<int64_t>(c.layer_is_moe.size()) == c.num_layers && c.rope.theta > 0 &&
        c.rope.factor > 0 && c.rms_norm_eps > 0 && c.max_position_embeddings > 0 && c.q_dim() > 0 &&
        c.kv_dim() > 0;
    if (!ok) __builtin_trap();
  } catch (const Error&) {
  }
  return 0;
}
