#include "model/model_facts.h"

#include "core/error.h"

namespace moeinfer {
namespace {

int64_t mlp_params(int64_t hidden, int64_t width) { return 3 * hidden * width; }

int64_t attention_params(const ModelConfig& c) {
  if (c.mla) {
    const MlaConfig& m = *c.mla;
    const int64_t H = c.hidden_size, Nh = c.num_heads;
    const int64_t q = m.q_lora_rank > 0
                          ? H * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * Nh * m.qk_head_dim()
                          : H * Nh * m.qk_head_dim();
    return q + H * m.cache_width() + m.kv_lora_rank +
           m.kv_lora_rank * Nh * (m.qk_nope_head_dim + m.v_head_dim) + Nh * m.v_head_dim * H;
  }
  const int64_t q_rows = c.attention_output_gate ? 2 * c.q_dim() : c.q_dim();
  int64_t n = c.hidden_size * q_rows + 2 * c.hidden_size * c.kv_dim() + c.q_dim() * c.hidden_size;
  if (c.attention_bias) n += c.q_dim() + 2 * c.kv_dim();
  if (c.attention_out_bias) n += c.hidden_size;
  if (c.qk_norm_per_head) n += 2 * c.head_dim;
  if (c.qk_norm_full) n += c.q_dim() + c.kv_dim();
  if (c.attention_sinks) n += c.num_heads;
  return n;
}

// Gated DeltaNet: in_proj_qkvz, in_proj_ba, the conv taps, dt_bias, A_log, the gated norm and
// out_proj.
int64_t linear_attention_params(const ModelConfig& c) {
  const LinearAttentionConfig& lin = *c.linear_attention;
  const int64_t H = c.hidden_size;
  return H * (2 * lin.key_dim() + 2 * lin.value_dim()) + H * 2 * lin.num_value_heads +
         lin.conv_dim() * lin.conv_kernel + 2 * lin.num_value_heads + lin.value_head_dim +
         lin.value_dim() * H;
}

// One routed expert: three matrices, and GPT-OSS's biases on gate, up and down.
int64_t expert_params(const ModelConfig& c) {
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size;
  return mlp_params(H, I) + (c.expert_bias ? 2 * I + H : 0);
}

struct Counter {
  PartCounts* parts;
  int64_t PartCounts::*field;
  void add(const TensorView& view) const {
    if (!view.empty()) (*parts).*field += static_cast<int64_t>(view.nbytes());
  }
};

}  // namespace

int64_t kv_values_per_token(const ModelConfig& config) {
  const int64_t per_layer = config.mla ? config.mla->cache_width() : 2 * config.kv_dim();
  return config.num_kv_layers() * per_layer;
}

KvRowGroups kv_row_groups(const ModelConfig& config) {
  if (config.mla) return {.key = {config.mla->kv_lora_rank, config.mla->qk_rope_head_dim}};
  const std::vector<int64_t> heads(static_cast<size_t>(config.num_kv_heads), config.head_dim);
  return {.key = heads, .value = heads};
}

int64_t kv_bytes_per_token(const ModelConfig& config, KvDType dtype) {
  const KvRowGroups groups = kv_row_groups(config);
  return config.num_kv_layers() *
         (kv_row_bytes(dtype, groups.key) + kv_row_bytes(dtype, groups.value));
}

int64_t state_values_per_sequence(const ModelConfig& config) {
  if (!config.linear_attention) return 0;
  const LinearAttentionConfig& lin = *config.linear_attention;
  return config.num_linear_layers() * (lin.conv_state_values() + lin.recurrent_state_values());
}

PartCounts count_params(const ModelConfig& c, bool active_only) {
  PartCounts p;
  const int64_t H = c.hidden_size;
  p.embeddings = c.vocab_size * H * (c.tie_word_embeddings ? 1 : 2);
  p.other = H;  // final norm
  for (int64_t l = 0; l < c.num_layers; ++l) {
    p.attention += c.is_linear_layer(l) ? linear_attention_params(c) : attention_params(c);
    p.other += 2 * H;  // the layer's two norms
    if (!c.layer_is_moe[l]) {
      p.other += mlp_params(H, c.intermediate_size);
      continue;
    }
    p.other += c.num_experts * H;  // router
    if (c.router_selection_bias) p.other += c.num_experts;  // its selection bias
    if (c.router_bias) p.other += c.num_experts;            // its logit bias
    const int64_t experts = active_only ? c.num_experts_per_tok : c.num_experts;
    p.routed_experts += experts * expert_params(c);
    if (c.shared_expert_intermediate_size > 0) {
      p.shared_experts += mlp_params(H, c.shared_expert_intermediate_size) +
                          (c.shared_expert_gated ? H : 0);
    }
  }
  return p;
}

ModelFacts model_facts(const ModelConfig& config, const DecoderWeights& w,
                       int64_t checkpoint_tensor_bytes) {
  ModelFacts facts;
  facts.total_params = count_params(config, false);
  facts.active_params = count_params(config, true);
  facts.checkpoint_tensor_bytes = checkpoint_tensor_bytes;
  PartCounts& bytes = facts.resident_bytes;
  const Counter attention{&bytes, &PartCounts::attention};
  const Counter routed{&bytes, &PartCounts::routed_experts};
  const Counter shared{&bytes, &PartCounts::shared_experts};
  const Counter embeddings{&bytes, &PartCounts::embeddings};
  const Counter other{&bytes, &PartCounts::other};
  int64_t bound_params = 0;
  const auto count = [&](const Counter& counter, const TensorView& view) {
    counter.add(view);
    if (!view.empty()) bound_params += view.numel();
  };
  count(embeddings, w.embed_tokens);
  if (!config.tie_word_embeddings) count(embeddings, w.lm_head);
  count(other, w.final_norm);
  for (const LayerWeights& layer : w.layers) {
    count(other, layer.input_norm);
    count(other, layer.post_attention_norm);
    const AttentionWeights& a = layer.attention;
    for (const TensorView* v : {&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj, &a.q_bias, &a.k_bias,
                                &a.v_bias, &a.o_bias, &a.q_norm, &a.k_norm, &a.sinks}) {
      count(attention, *v);
    }
    const MlaWeights& m = layer.mla;
    for (const TensorView* v : {&m.q_proj, &m.q_a_proj, &m.q_a_norm, &m.q_b_proj, &m.kv_a_proj,
                                &m.kv_a_norm, &m.kv_b_proj, &m.o_proj}) {
      count(attention, *v);
    }
    const LinearAttentionWeights& lin = layer.linear_attention;
    for (const TensorView* v :
         {&lin.in_proj_qkvz, &lin.in_proj_ba, &lin.in_proj_qkv, &lin.in_proj_z, &lin.in_proj_b,
          &lin.in_proj_a, &lin.conv1d, &lin.dt_bias, &lin.a_log, &lin.norm, &lin.out_proj}) {
      count(attention, *v);
    }
    if (!layer.is_moe) {
      for (const TensorView* v : {&layer.mlp.gate_proj, &layer.mlp.up_proj, &layer.mlp.down_proj}) {
        count(other, *v);
      }
      continue;
    }
    count(other, layer.moe.routed.router);
    count(other, layer.moe.selection_bias);
    count(other, layer.moe.router_bias);
    for (const moe::ExpertWeights& e : layer.moe.routed.experts) {
      for (const TensorView* v : {&e.gate, &e.up, &e.down, &e.gate_bias, &e.up_bias, &e.down_bias})
        count(routed, *v);
    }
    const MlpWeights& s = layer.moe.shared_expert;
    for (const TensorView* v : {&s.gate_proj, &s.up_proj, &s.down_proj,
                                &layer.moe.shared_expert_gate}) {
      count(shared, *v);
    }
  }
  MOE_CHECK(bound_params == facts.total_params.total(), config.source, ": the config implies ",
            facts.total_params.total(), " parameters but the bound tensors hold ", bound_params);
  facts.kv_bytes_per_token_f32 = kv_bytes_per_token(config, KvDType::kF32);
  facts.kv_bytes_per_token_bf16 = kv_bytes_per_token(config, KvDType::kBF16);
  facts.kv_bytes_per_token_fp8 = kv_bytes_per_token(config, KvDType::kFP8);
  facts.state_bytes_per_sequence_f32 = state_values_per_sequence(config) * 4;
  return facts;
}

nlohmann::ordered_json facts_to_json(const ModelConfig& config, const ModelFacts& facts) {
  const auto parts = [](const PartCounts& p) {
    return nlohmann::ordered_json{{"total", p.total()},
                                  {"attention", p.attention},
                                  {"routed_experts", p.routed_experts},
                                  {"shared_experts", p.shared_experts},
                                  {"embeddings", p.embeddings},
                                  {"other", p.other}};
  };
  int64_t num_moe_layers = 0;
  for (bool is_moe : config.layer_is_moe) num_moe_layers += is_moe;
  nlohmann::ordered_json out = {
      {"model_type", config.model_type},
      {"layers", config.num_layers},
      {"moe_layers", num_moe_layers},
      {"experts", config.num_experts},
      {"experts_per_token", config.num_experts_per_tok},
      {"hidden_size", config.hidden_size},
      {"vocab_size", config.vocab_size},
      {"params_total", parts(facts.total_params)},
      {"params_active_per_token", parts(facts.active_params)},
      {"resident_bytes", parts(facts.resident_bytes)},
      {"checkpoint_tensor_bytes", facts.checkpoint_tensor_bytes},
      {"kv_bytes_per_token",
       {{"f32", facts.kv_bytes_per_token_f32},
        {"bf16", facts.kv_bytes_per_token_bf16},
        {"fp8", facts.kv_bytes_per_token_fp8}}},
      {"recurrent_state_bytes_per_sequence", facts.state_bytes_per_sequence_f32}};
  // Llama 4's and Qwen3.5's published checkpoints carry a vision tower whose tensors stay unread.
  if (config.has_vision_tower) out["vision_tower"] = "not loaded";
  return out;
}

}  // namespace moeinfer
