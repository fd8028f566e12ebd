#include "model/decoder.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/family.h"

namespace moeinfer {
namespace {

std::vector<float> to_f32(const TensorView& view) {
  if (view.empty()) return {};
  std::vector<float> out(view.numel());
  convert_to_f32(view.dtype, view.data, out.data(), out.size());
  return out;
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows of `width`.
void rms_norm(const float* x, int64_t num_rows, int64_t width, const float* weight, float eps,
              float* y) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* in = x + r * width;
    float* out = y + r * width;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum_sq += in[i] * in[i];
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (in[i] * inv_rms);
  }
}

void silu_mul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

const float* data_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

}  // namespace

Decoder::Decoder(const ModelConfig& config, DecoderWeights weights)
    : config_(config),
      weights_(std::move(weights)),
      rope_(config.rope, config.head_dim, config.max_position_embeddings) {
  params_.resize(config_.num_layers);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    LayerParams& p = params_[l];
    p.input_norm = to_f32(lw.input_norm);
    p.post_attention_norm = to_f32(lw.post_attention_norm);
    p.q_bias = to_f32(lw.attention.q_bias);
    p.k_bias = to_f32(lw.attention.k_bias);
    p.v_bias = to_f32(lw.attention.v_bias);
    p.o_bias = to_f32(lw.attention.o_bias);
    p.q_norm = to_f32(lw.attention.q_norm);
    p.k_norm = to_f32(lw.attention.k_norm);
  }
  final_norm_ = to_f32(weights_.final_norm);
  moe_options_ = moe::MoeLayerOptions{.router = router_options(config_),
                                      .hidden_size = config_.hidden_size,
                                      .expert_width = config_.moe_intermediate_size};
}

KvCache Decoder::make_cache(int64_t max_tokens) const {
  const int64_t limit = config_.max_position_embeddings > 0
                            ? std::min(max_tokens, config_.max_position_embeddings)
                            : max_tokens;
  return KvCache(config_.num_layers, config_.kv_dim(), limit);
}

void Decoder::forward(std::span<const int32_t> tokens, KvCache& cache, std::span<float> logits,
                      bool all_positions) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t H = config_.hidden_size;
  const int64_t V = config_.vocab_size;
  MOE_CHECK(T > 0, "forward needs at least one token");
  const int64_t out_rows = all_positions ? T : 1;
  MOE_CHECK(static_cast<int64_t>(logits.size()) == out_rows * V, "logits buffer holds ",
            logits.size(), " floats, needs ", out_rows * V);
  for (int32_t id : tokens) {
    MOE_CHECK(id >= 0 && id < V, "token id ", id, " out of range [0, ", V, ")");
  }
  const int64_t start = cache.length();
  cache.reserve_append(T);

  ws_.x.resize(T * H);
  ws_.normed.resize(T * H);
  ws_.block_out.resize(T * H);
  const TensorView& embed = weights_.embed_tokens;
  for (int64_t t = 0; t < T; ++t) {
    convert_to_f32(embed.dtype, embed.row(tokens[t]), ws_.x.data() + t * H, H);
  }

  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const float eps = static_cast<float>(config_.rms_norm_eps);
    rms_norm(ws_.x.data(), T, H, params_[l].input_norm.data(), eps, ws_.normed.data());
    attention(l, T, start, cache);
    add_into(ws_.x.data(), ws_.block_out.data(), T * H);
    rms_norm(ws_.x.data(), T, H, params_[l].post_attention_norm.data(), eps, ws_.normed.data());
    feed_forward(l, T);
    add_into(ws_.x.data(), ws_.block_out.data(), T * H);
  }
  cache.advance(T);

  const int64_t first = all_positions ? 0 : T - 1;
  rms_norm(ws_.x.data() + first * H, out_rows, H, final_norm_.data(),
           static_cast<float>(config_.rms_norm_eps), ws_.normed.data());
  cpu::linear(ws_.normed.data(), out_rows, weights_.lm_head, nullptr, logits.data());
}

void Decoder::attention(int64_t layer, int64_t T, int64_t start, KvCache& cache) {
  const AttentionWeights& w = weights_.layers[layer].attention;
  const LayerParams& p = params_[layer];
  const int64_t D = config_.head_dim;
  const int64_t Nq = config_.num_heads;
  const int64_t Nkv = config_.num_kv_heads;
  const int64_t q_dim = config_.q_dim();
  const int64_t kv_dim = config_.kv_dim();
  const float eps = static_cast<float>(config_.rms_norm_eps);
  ws_.q.resize(T * q_dim);
  ws_.k.resize(T * kv_dim);
  ws_.v.resize(T * kv_dim);
  ws_.attn.resize(T * q_dim);

  cpu::linear(ws_.normed.data(), T, w.q_proj, data_or_null(p.q_bias), ws_.q.data());
  cpu::linear(ws_.normed.data(), T, w.k_proj, data_or_null(p.k_bias), ws_.k.data());
  cpu::linear(ws_.normed.data(), T, w.v_proj, data_or_null(p.v_bias), ws_.v.data());

  if (config_.qk_norm_per_head) {
    rms_norm(ws_.q.data(), T * Nq, D, p.q_norm.data(), eps, ws_.q.data());
    rms_norm(ws_.k.data(), T * Nkv, D, p.k_norm.data(), eps, ws_.k.data());
  } else if (config_.qk_norm_full) {
    rms_norm(ws_.q.data(), T, q_dim, p.q_norm.data(), eps, ws_.q.data());
    rms_norm(ws_.k.data(), T, kv_dim, p.k_norm.data(), eps, ws_.k.data());
  }
  if (config_.clip_qkv) {
    const float c = static_cast<float>(*config_.clip_qkv);
    for (auto* buf : {&ws_.q, &ws_.k, &ws_.v}) {
      for (float& value : *buf) value = std::clamp(value, -c, c);
    }
  }

  float* keys = cache.keys(layer);      // [max_tokens, Nkv, D]
  float* values = cache.values(layer);  // [max_tokens, Nkv, D]
  for (int64_t t = 0; t < T; ++t) {
    rope_.apply(ws_.q.data() + t * q_dim, Nq, D, start + t);
    rope_.apply(ws_.k.data() + t * kv_dim, Nkv, D, start + t);
    std::copy_n(ws_.k.data() + t * kv_dim, kv_dim, keys + (start + t) * kv_dim);
    std::copy_n(ws_.v.data() + t * kv_dim, kv_dim, values + (start + t) * kv_dim);
  }

  const int64_t group = Nq / Nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t window = config_.sliding_window.value_or(0);
  // One task per (token, query head): scores over the visible keys, softmax, weighted values.
  parallel_for(T * Nq, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Nq;
      const int64_t h = task % Nq;
      const int64_t kv_head = h / group;
      const int64_t position = start + t;
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      const int64_t count = position - first + 1;
      const float* q = ws_.q.data() + t * q_dim + h * D;
      scores.resize(count);
      float max_score = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        const float* k = keys + (first + j) * kv_dim + kv_head * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < count; ++j) sum += scores[j] = std::exp(scores[j] - max_score);
      float* out = ws_.attn.data() + t * q_dim + h * D;
      std::fill_n(out, D, 0.0f);
      for (int64_t j = 0; j < count; ++j) {
        const float weight = scores[j] / sum;
        const float* v = values + (first + j) * kv_dim + kv_head * D;
        for (int64_t d = 0; d < D; ++d) out[d] += weight * v[d];
      }
    }
  });
  cpu::linear(ws_.attn.data(), T, w.o_proj, data_or_null(p.o_bias), ws_.block_out.data());
}

void Decoder::dense_mlp(const MlpWeights& mlp, int64_t T, const float* in, float* out) {
  const int64_t width = mlp.gate_proj.shape[0];
  ws_.gate.resize(T * width);
  ws_.up.resize(T * width);
  cpu::linear(in, T, mlp.gate_proj, nullptr, ws_.gate.data());
  cpu::linear(in, T, mlp.up_proj, nullptr, ws_.up.data());
  silu_mul(ws_.gate.data(), ws_.up.data(), T * width);
  cpu::linear(ws_.gate.data(), T, mlp.down_proj, nullptr, out);
}

void Decoder::feed_forward(int64_t layer, int64_t T) {
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t H = config_.hidden_size;
  if (!lw.is_moe) {
    dense_mlp(lw.mlp, T, ws_.normed.data(), ws_.block_out.data());
    return;
  }
  const float* shared = nullptr;
  if (!lw.moe.shared_expert.gate_proj.empty()) {
    ws_.shared.resize(T * H);
    dense_mlp(lw.moe.shared_expert, T, ws_.normed.data(), ws_.shared.data());
    if (!lw.moe.shared_expert_gate.empty()) {
      std::vector<float> gate_logit(T);
      cpu::linear(ws_.normed.data(), T, lw.moe.shared_expert_gate, nullptr, gate_logit.data());
      for (int64_t t = 0; t < T; ++t) {
        const float g = 1.0f / (1.0f + std::exp(-gate_logit[t]));
        for (int64_t h = 0; h < H; ++h) ws_.shared[t * H + h] *= g;
      }
    }
    shared = ws_.shared.data();
  }
  moe::moe_layer_forward(ws_.normed.data(), T, lw.moe.routed, moe_options_, shared,
                         ws_.block_out.data(), &ws_.moe);
  if (routing_observer_) routing_observer_(layer, ws_.moe.routing);
}

}  // namespace moeinfer
