// Random model configurations of every supported family, with random weights, for sweeps that
// hold one decoder to another where no reference fixture exists: the CPU decoder matches
// transformers on the fixtures, so it is the oracle for the GPU decoder on shapes the fixtures
// never had (hidden sizes that are not multiples of 64, odd vocabularies, any expert count,
// MLA ranks, rope variants, ...).
//
// A configuration is drawn as config.json text and parsed by the engine's own parser, so every
// model is one the loader accepts; the weights are host buffers in the config's dtype (float32
// or bfloat16) bound straight into DecoderWeights, in the shapes the family files bind from a
// checkpoint. Weight scales keep every layer's output near unit variance, the router's logits
// spread (std ~1.5) as a trained router's are, and the LM head rows of log-normal norm, so that
// the next token has a clear winner more often than a flat random head would give.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/model_config.h"
#include "model/weights.h"

namespace moeinfer::testing {

inline constexpr ModelFamily kAllFamilies[] = {ModelFamily::kQwen3Moe,   ModelFamily::kMixtral,
                                               ModelFamily::kOlmoe,      ModelFamily::kQwen2Moe,
                                               ModelFamily::kDeepseekV2, ModelFamily::kDeepseekV3};

struct RandomModel {
  uint64_t seed = 0;
  std::string config_json;  // what was drawn, for failure messages
  ModelConfig config;
  DecoderWeights weights;  // views into storage
  std::vector<std::unique_ptr<uint8_t[]>> storage;
};

namespace random_model_detail {

using nlohmann::json;

class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  int64_t between(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  int64_t multiple_of(int64_t step, int64_t lo, int64_t hi) {  // a multiple of step in [lo, hi]
    return step * between((lo + step - 1) / step, hi / step);
  }
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  bool chance(double p) { return real(0.0, 1.0) < p; }
  template <typename T>
  T pick(const std::vector<T>& options) {
    return options[static_cast<size_t>(between(0, static_cast<int64_t>(options.size()) - 1))];
  }
  float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng_); }
  float uniform(float scale) { return std::uniform_real_distribution<float>(-scale, scale)(rng_); }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

inline std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// A rope configuration of any supported type; `original` bounds the scaled types' training
// length.
inline json random_rope(Draw& d, int64_t max_positions, bool deepseek) {
  const int64_t original = std::max<int64_t>(16, max_positions / d.pick<int64_t>({1, 2, 4, 8}));
  const double factor = d.pick<double>({1.5, 2.0, 4.0, 8.0, 40.0});
  switch (d.between(0, deepseek ? 3 : 5)) {
    case 0:
      return nullptr;
    case 1:
    case 2: {  // yarn, with and without the DeepSeek mscale pair or an attention_factor
      json r = {{"rope_type", "yarn"},
                {"factor", factor},
                {"original_max_position_embeddings", original},
                {"beta_fast", d.pick<double>({32.0, 16.0})},
                {"beta_slow", d.pick<double>({1.0, 2.0})}};
      const int64_t variant = d.between(0, 3);
      if (variant == 1) {
        r["mscale"] = d.pick<double>({1.0, 0.707});
        r["mscale_all_dim"] = d.pick<double>({1.0, 0.707, 0.5});
      } else if (variant == 2) {
        r["mscale"] = d.pick<double>({1.0, 0.707});  // without mscale_all_dim
      } else if (variant == 3 && !deepseek) {
        r["attention_factor"] = d.real(0.8, 1.3);
      }
      return r;
    }
    case 3:
      return {{"rope_type", "linear"}, {"factor", factor}};
    case 4:
      return {{"rope_type", "llama3"},
              {"factor", factor},
              {"low_freq_factor", 1.0},
              {"high_freq_factor", 4.0},
              {"original_max_position_embeddings", original}};
    default:
      return {{"rope_type", "dynamic"}, {"factor", factor}};
  }
}

// Expert counts from 2 to 64 (powers of two and not), top-k 1 to 8.
inline void random_experts(Draw& d, int64_t* num_experts, int64_t* top_k) {
  *num_experts = d.chance(0.3) ? d.pick<int64_t>({2, 4, 8, 16, 32, 64}) : d.between(2, 64);
  *top_k = d.between(1, std::min<int64_t>(8, *num_experts));
}

// Attention heads for standard attention: Nkv | Nq, GQA groups up to 32 (past the 16 heads one
// decode block packs), head dims 8 to 256
// (mostly multiples of 8, sometimes any even size).
inline void random_heads(Draw& d, json& c) {
  const int64_t kv = d.between(1, 4);
  const int64_t group = d.pick<int64_t>({1, 1, 2, 3, 4, 8, 8, 20, 32});
  int64_t head_dim = d.chance(0.75) ? d.multiple_of(8, 8, 256) : d.multiple_of(2, 8, 256);
  while ((kv * group) * head_dim > 2048) head_dim = std::max<int64_t>(8, head_dim / 2 / 2 * 2);
  c["num_attention_heads"] = kv * group;
  c["num_key_value_heads"] = kv;
  c["head_dim"] = head_dim;
}

inline json random_config(ModelFamily family, Draw& d) {
  json c;
  c["model_type"] = std::string(family_name(family));
  const int64_t H = d.multiple_of(16, 16, 320);
  c["hidden_size"] = H;
  c["vocab_size"] = d.chance(0.2) ? d.between(32, 300) : d.between(300, 4096);
  const int64_t layers = d.between(1, 3);
  c["num_hidden_layers"] = layers;
  c["rms_norm_eps"] = d.pick<double>({1e-6, 1e-5});
  const int64_t max_positions = d.pick<int64_t>({128, 256, 1024, 4096, 32768});
  c["max_position_embeddings"] = max_positions;
  c["tie_word_embeddings"] = d.chance(0.3);
  c["rope_theta"] = d.pick<double>({10000.0, 500000.0, 1000000.0});
  c["bos_token_id"] = nullptr;
  c["eos_token_id"] = nullptr;
  c["hidden_act"] = "silu";
  const bool deepseek = family == ModelFamily::kDeepseekV2 || family == ModelFamily::kDeepseekV3;
  if (json rope = random_rope(d, max_positions, deepseek); !rope.is_null())
    c["rope_scaling"] = rope;
  int64_t E = 0, K = 0;
  random_experts(d, &E, &K);
  c["num_experts_per_tok"] = K;
  const int64_t expert_width = d.multiple_of(8, 8, 320);
  const int64_t dense_width = d.multiple_of(8, 8, 512);
  auto sparse_layers = [&] {
    c["decoder_sparse_step"] = d.pick<int64_t>({1, 1, 2});
    json only = json::array();
    for (int64_t l = 0; l < layers; ++l)
      if (d.chance(0.2)) only.push_back(l);
    c["mlp_only_layers"] = only;
  };
  switch (family) {
    case ModelFamily::kQwen3Moe:
      random_heads(d, c);
      c["num_experts"] = E;
      c["moe_intermediate_size"] = expert_width;
      c["intermediate_size"] = dense_width;
      c["norm_topk_prob"] = d.chance(0.5);
      c["attention_bias"] = d.chance(0.3);
      sparse_layers();
      if (d.chance(0.3)) {
        c["use_sliding_window"] = true;
        c["sliding_window"] = d.between(2, 40);
      }
      break;
    case ModelFamily::kMixtral:
      random_heads(d, c);
      c["num_local_experts"] = E;
      c["intermediate_size"] = expert_width;
      c["sliding_window"] = d.chance(0.4) ? json(d.between(2, 40)) : json(nullptr);
      break;
    case ModelFamily::kOlmoe: {
      // q_norm spans hidden_size: Nq * D == H, D even.
      std::vector<int64_t> heads;
      for (int64_t n : divisors(H))
        if ((H / n) % 2 == 0 && H / n <= 256 && n <= 16) heads.push_back(n);
      const int64_t nq = d.pick(heads);
      std::vector<int64_t> kv_options = divisors(nq);
      c["num_attention_heads"] = nq;
      c["num_key_value_heads"] = d.pick(kv_options);
      c["num_experts"] = E;
      c["intermediate_size"] = expert_width;
      c["norm_topk_prob"] = d.chance(0.5);
      c["clip_qkv"] = d.chance(0.5) ? json(d.real(0.3, 3.0)) : json(nullptr);
      break;
    }
    case ModelFamily::kQwen2Moe:
      random_heads(d, c);
      c["num_experts"] = E;
      c["moe_intermediate_size"] = expert_width;
      c["intermediate_size"] = dense_width;
      c["shared_expert_intermediate_size"] = d.multiple_of(8, 8, 512);
      c["norm_topk_prob"] = d.chance(0.5);
      c["qkv_bias"] = d.chance(0.7);
      sparse_layers();
      break;
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3: {
      const bool v3 = family == ModelFamily::kDeepseekV3;
      const int64_t heads = d.between(1, 8);
      c["num_attention_heads"] = heads;
      c["num_key_value_heads"] = heads;
      c["q_lora_rank"] = d.chance(0.3) ? json(nullptr) : json(d.multiple_of(8, 8, 256));
      // Mostly multiples of 8 as published; the rest any size (the GPU pads the latent and the
      // rope key), and now and then a rope key wider than DeepSeek's 64.
      c["kv_lora_rank"] = d.chance(0.7) ? d.multiple_of(8, 8, 256) : d.between(1, 256);
      c["qk_nope_head_dim"] = d.chance(0.7) ? d.multiple_of(8, 8, 128) : d.between(1, 128);
      c["qk_rope_head_dim"] = d.chance(0.6)    ? d.multiple_of(8, 8, 64)
                              : d.chance(0.6) ? d.multiple_of(2, 2, 64)
                                              : d.multiple_of(8, 72, 128);
      c["v_head_dim"] = d.chance(0.7) ? d.multiple_of(8, 8, 128) : d.between(1, 128);
      c["n_routed_experts"] = E;
      c["moe_intermediate_size"] = expert_width;
      c["intermediate_size"] = dense_width;
      c["n_shared_experts"] = d.between(0, 2);
      c["first_k_dense_replace"] = d.between(0, layers - 1);
      c["routed_scaling_factor"] = d.pick<double>({1.0, 2.0, 2.5, 16.0});
      std::vector<int64_t> groups;
      for (int64_t g : divisors(E))
        if (!v3 || E / g >= 2) groups.push_back(g);
      const int64_t num_groups = d.pick(groups);
      std::vector<int64_t> topk_groups;
      for (int64_t t = 1; t <= num_groups; ++t)
        if (t * (E / num_groups) >= K) topk_groups.push_back(t);
      if (v3) {
        c["topk_method"] = "noaux_tc";
        c["norm_topk_prob"] = d.chance(0.7);
        c["rope_interleave"] = d.chance(0.7);
        c["n_group"] = num_groups;
        c["topk_group"] = d.pick(topk_groups);
      } else if (d.chance(0.5)) {
        c["topk_method"] = "group_limited_greedy";
        c["n_group"] = num_groups;
        c["topk_group"] = d.pick(topk_groups);
      } else {
        c["topk_method"] = "greedy";
      }
      break;
    }
  }
  c["torch_dtype"] = d.chance(0.5) ? "bfloat16" : "float32";
  return c;
}

// Binds random tensors of the config's shapes, in its dtype (the router bias in float32).
class WeightMaker {
 public:
  WeightMaker(RandomModel& model, Draw& draw, bool bf16)
      : model_(model), draw_(draw), bf16_(bf16) {}

  // Uniform with std `scale` times a per-row factor (1 unless row_sigma > 0: log-normal).
  TensorView matrix(int64_t rows, int64_t cols, float scale, float row_sigma = 0.0f) {
    const float half_width = scale * std::sqrt(3.0f);
    std::vector<float> values(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      const float row_scale = row_sigma > 0 ? std::exp(row_sigma * draw_.normal()) : 1.0f;
      for (int64_t i = 0; i < cols; ++i)
        values[r * cols + i] = row_scale * draw_.uniform(half_width);
    }
    return store(values, Shape{rows, cols}, bf16_);
  }
  TensorView linear(int64_t out, int64_t in, float gain = 1.0f) {
    return matrix(out, in, gain / std::sqrt(static_cast<float>(in)));
  }
  TensorView norm(int64_t width) {  // RMSNorm weights near 1
    std::vector<float> values(static_cast<size_t>(width));
    for (float& v : values) v = 1.0f + draw_.uniform(0.25f);
    return store(values, Shape{width}, bf16_);
  }
  TensorView bias(int64_t width, float scale, bool f32) {
    std::vector<float> values(static_cast<size_t>(width));
    for (float& v : values) v = draw_.uniform(scale);
    return store(values, Shape{width}, !f32 && bf16_);
  }

 private:
  TensorView store(const std::vector<float>& values, Shape shape, bool bf16) {
    const size_t n = values.size();
    auto bytes = std::make_unique<uint8_t[]>(n * (bf16 ? 2 : 4));
    if (bf16) {
      auto* out = reinterpret_cast<uint16_t*>(bytes.get());
      for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(values[i]);
    } else {
      std::copy(values.begin(), values.end(), reinterpret_cast<float*>(bytes.get()));
    }
    TensorView view{
        .dtype = bf16 ? DType::kBF16 : DType::kF32, .shape = shape, .data = bytes.get()};
    model_.storage.push_back(std::move(bytes));
    return view;
  }

  RandomModel& model_;
  Draw& draw_;
  bool bf16_;
};

inline MlpWeights random_mlp(WeightMaker& w, int64_t H, int64_t width) {
  return {.gate_proj = w.linear(width, H),
          .up_proj = w.linear(width, H),
          .down_proj = w.linear(H, width)};
}

inline void random_weights(RandomModel& m, Draw& d) {
  const ModelConfig& c = m.config;
  WeightMaker w(m, d, c.dtype == "bfloat16");
  const int64_t H = c.hidden_size, V = c.vocab_size;
  DecoderWeights& out = m.weights;
  out.embed_tokens = w.matrix(V, H, 1.0f, c.tie_word_embeddings ? 0.5f : 0.0f);
  out.final_norm = w.norm(H);
  out.lm_head =
      c.tie_word_embeddings ? out.embed_tokens : w.matrix(V, H, 3.0f / std::sqrt(float(H)), 0.7f);
  out.layers.resize(static_cast<size_t>(c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    LayerWeights& lw = out.layers[l];
    lw.input_norm = w.norm(H);
    lw.post_attention_norm = w.norm(H);
    if (c.mla) {
      const MlaConfig& a = *c.mla;
      const int64_t Nh = c.num_heads, qk = a.qk_head_dim();
      if (a.q_lora_rank > 0) {
        lw.mla.q_a_proj = w.linear(a.q_lora_rank, H);
        lw.mla.q_a_norm = w.norm(a.q_lora_rank);
        lw.mla.q_b_proj = w.linear(Nh * qk, a.q_lora_rank);
      } else {
        lw.mla.q_proj = w.linear(Nh * qk, H);
      }
      lw.mla.kv_a_proj = w.linear(a.kv_lora_rank + a.qk_rope_head_dim, H);
      lw.mla.kv_a_norm = w.norm(a.kv_lora_rank);
      lw.mla.kv_b_proj = w.linear(Nh * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank);
      lw.mla.o_proj = w.linear(H, Nh * a.v_head_dim);
    } else {
      AttentionWeights& at = lw.attention;
      at.q_proj = w.linear(c.q_dim(), H);
      at.k_proj = w.linear(c.kv_dim(), H);
      at.v_proj = w.linear(c.kv_dim(), H);
      at.o_proj = w.linear(H, c.q_dim());
      if (c.attention_bias) {
        at.q_bias = w.bias(c.q_dim(), 0.2f, false);
        at.k_bias = w.bias(c.kv_dim(), 0.2f, false);
        at.v_bias = w.bias(c.kv_dim(), 0.2f, false);
      }
      if (c.attention_out_bias) at.o_bias = w.bias(H, 0.2f, false);
      if (c.qk_norm_per_head) {
        at.q_norm = w.norm(c.head_dim);
        at.k_norm = w.norm(c.head_dim);
      } else if (c.qk_norm_full) {
        at.q_norm = w.norm(c.q_dim());
        at.k_norm = w.norm(c.kv_dim());
      }
    }
    lw.is_moe = c.layer_is_moe[l];
    if (!lw.is_moe) {
      lw.mlp = random_mlp(w, H, c.intermediate_size);
      continue;
    }
    MoeWeights& moe = lw.moe;
    moe.routed.router = w.linear(c.num_experts, H, 1.5f);
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const MlpWeights mlp = random_mlp(w, H, c.moe_intermediate_size);
      moe.routed.experts.push_back(
          {.gate = mlp.gate_proj, .up = mlp.up_proj, .down = mlp.down_proj});
    }
    if (c.shared_expert_intermediate_size > 0) {
      moe.shared_expert = random_mlp(w, H, c.shared_expert_intermediate_size);
      if (c.shared_expert_gated) moe.shared_expert_gate = w.linear(1, H, 2.0f);
    }
    if (c.topk_method == TopkMethod::kNoauxTc) {
      moe.selection_bias = w.bias(c.num_experts, 0.2f, /*f32=*/true);
    }
  }
}

}  // namespace random_model_detail

// A random model of `family`, the same for the same seed; `overrides` replace drawn config fields
// (a shape past what the sweep draws, say), and the weights follow the resulting config.
inline RandomModel make_random_model(ModelFamily family, uint64_t seed,
                                     const nlohmann::json& overrides = nlohmann::json::object()) {
  random_model_detail::Draw draw(seed);
  RandomModel m;
  m.seed = seed;
  nlohmann::json config = random_model_detail::random_config(family, draw);
  config.update(overrides);
  m.config_json = config.dump();
  m.config = parse_model_config(m.config_json, "random config (seed " + std::to_string(seed) + ")");
  random_model_detail::random_weights(m, draw);
  return m;
}

}  // namespace moeinfer::testing
