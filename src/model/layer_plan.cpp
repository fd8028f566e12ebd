#include "model/layer_plan.h"

#include <algorithm>

#include "core/error.h"

namespace moeinfer {

std::vector<int64_t> moe_layer_indices(const ModelConfig& config) {
  std::vector<int64_t> layers;
  const int64_t known =
      std::min<int64_t>(config.num_layers, static_cast<int64_t>(config.layer_is_moe.size()));
  for (int64_t l = 0; l < known; ++l) {
    if (config.layer_is_moe[l]) layers.push_back(l);
  }
  return layers;
}

std::vector<LayerPlan> plan_layers(const ModelConfig& config) {
  MOE_CHECK(static_cast<int64_t>(config.layer_is_moe.size()) == config.num_layers, "the config marks ",
            config.layer_is_moe.size(), " layers dense or MoE, it has ", config.num_layers);
  MOE_CHECK(static_cast<int>(config.qk_norm_per_head) + static_cast<int>(config.qk_norm_full) +
                    static_cast<int>(config.qk_norm_after_rope) <=
                1,
            "a config takes at most one q/k norm (per head, whole projection, after RoPE)");
  MOE_CHECK(config.layer_uses_rope.empty() ||
                static_cast<int64_t>(config.layer_uses_rope.size()) == config.num_layers,
            "the config marks ", config.layer_uses_rope.size(), " layers RoPE or NoPE, it has ",
            config.num_layers);
  MOE_CHECK(config.layer_is_chunked.empty() ||
                static_cast<int64_t>(config.layer_is_chunked.size()) == config.num_layers,
            "the config marks ", config.layer_is_chunked.size(), " layers chunked or not, it has ",
            config.num_layers);
  LayerPlan base;
  base.attention = config.mla ? AttentionKind::kMla : AttentionKind::kGqa;
  base.qk_norm = config.qk_norm_per_head ? QkNormKind::kPerHead
                 : config.qk_norm_full   ? QkNormKind::kWholeProjection
                                         : QkNormKind::kNone;
  base.clip_qkv = config.clip_qkv.has_value();
  base.output_gate = config.attention_output_gate;
  const bool interleaved = config.mla ? config.mla->rope_interleave : config.rope_interleaved;
  base.rope = interleaved ? RopePairing::kInterleaved : RopePairing::kHalves;
  const SharedExpertKind shared = config.shared_expert_intermediate_size <= 0
                                      ? SharedExpertKind::kNone
                                  : config.shared_expert_gated ? SharedExpertKind::kSigmoidGated
                                                               : SharedExpertKind::kUngated;
  MOE_CHECK(config.layer_sliding.empty() ||
                static_cast<int64_t>(config.layer_sliding.size()) == config.num_layers,
            "the config marks ", config.layer_sliding.size(), " layers sliding or full, it has ",
            config.num_layers);
  base.attention_sinks = config.attention_sinks;
  std::vector<LayerPlan> plans(static_cast<size_t>(config.num_layers), base);
  MOE_CHECK(config.layer_is_linear.empty() ||
                static_cast<int64_t>(config.layer_is_linear.size()) == config.num_layers,
            "the config marks ", config.layer_is_linear.size(), " layers linear or full, it has ",
            config.num_layers);
  MOE_CHECK(config.num_linear_layers() == 0 || config.linear_attention,
            "the config has linear attention layers but no linear attention sizes");
  for (int64_t l = 0; l < config.num_layers; ++l) {
    if (config.is_linear_layer(l)) plans[l].attention = AttentionKind::kGatedDeltaNet;
    plans[l].sliding_window = config.window_of(l);
    const bool rope = config.uses_rope(l);
    plans[l].position = rope ? PositionEncoding::kRope : PositionEncoding::kNone;
    if (config.qk_norm_after_rope)
      plans[l].qk_norm = rope ? QkNormKind::kAfterRopeWeightless : QkNormKind::kNone;
    MOE_CHECK(!config.is_chunked(l) || config.attention_chunk_size > 0, "layer ", l,
              " is chunked but the config has no attention_chunk_size");
    plans[l].span = config.is_chunked(l) ? AttentionSpan::kChunked : AttentionSpan::kCausal;
    if (config.attention_temperature && !rope) plans[l].query_scale = QueryScale::kTemperature;
    if (!config.layer_is_moe[l]) continue;
    plans[l].feed_forward = FeedForwardKind::kMoe;
    plans[l].shared_expert = shared;
  }
  return plans;
}

}  // namespace moeinfer
