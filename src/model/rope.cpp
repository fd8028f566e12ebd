#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace moeinfer {
namespace {

// The base frequencies, computed in float32 as the reference does.
std::vector<float> base_inv_freq(double theta, int64_t dim) {
  std::vector<float> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv_freq[i] = 1.0f / std::pow(static_cast<float>(theta), exponent);
  }
  return inv_freq;
}

double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

void apply_yarn(const RopeConfig& rope, int64_t dim, int64_t max_position_embeddings,
                std::vector<float>* inv_freq, float* attention_scaling) {
  MOE_CHECK(rope.original_max_position_embeddings > 0,
            "yarn rope needs original_max_position_embeddings");
  double factor = rope.factor;
  if (factor <= 0.0) {
    factor = static_cast<double>(max_position_embeddings) / rope.original_max_position_embeddings;
  }
  if (rope.attention_factor) {
    *attention_scaling = static_cast<float>(*rope.attention_factor);
  } else if (rope.mscale != 0.0 && rope.mscale_all_dim != 0.0) {
    *attention_scaling = static_cast<float>(yarn_mscale(factor, rope.mscale) /
                                            yarn_mscale(factor, rope.mscale_all_dim));
  } else {
    *attention_scaling = static_cast<float>(yarn_mscale(factor, 1.0));
  }
  const double base = rope.theta;
  const auto correction_dim = [&](double rotations) {
    return dim * std::log(rope.original_max_position_embeddings / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(base));
  };
  double low = correction_dim(rope.beta_fast);
  double high = correction_dim(rope.beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float pos_freq =
        std::pow(static_cast<float>(base), static_cast<float>(2 * i) / static_cast<float>(dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (static_cast<float>(factor) * pos_freq);
    const float ramp = std::clamp(
        static_cast<float>((static_cast<float>(i) - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    (*inv_freq)[i] =
        interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
}

void apply_llama3(const RopeConfig& rope, std::vector<float>* inv_freq) {
  MOE_CHECK(rope.original_max_position_embeddings > 0,
            "llama3 rope needs original_max_position_embeddings");
  const double old_context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context / rope.low_freq_factor;
  const double high_freq_wavelen = old_context / rope.high_freq_factor;
  for (float& f : *inv_freq) {
    const double wavelen = 2 * std::numbers::pi / f;
    if (wavelen > low_freq_wavelen) {
      f = static_cast<float>(f / rope.factor);
    } else if (wavelen >= high_freq_wavelen && rope.high_freq_factor > rope.low_freq_factor) {
      const double smooth = (old_context / wavelen - rope.low_freq_factor) /
                            (rope.high_freq_factor - rope.low_freq_factor);
      f = static_cast<float>((1 - smooth) * f / rope.factor + smooth * f);
    }
  }
}

}  // namespace

Rope::Rope(const RopeConfig& config, int64_t rotary_dim, int64_t max_position_embeddings)
    : rotary_dim_(rotary_dim) {
  MOE_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rotary dim ", rotary_dim,
            " must be positive and even");
  inv_freq_ = base_inv_freq(config.theta, rotary_dim);
  if (config.type == "default") {
  } else if (config.type == "linear") {
    for (float& f : inv_freq_) f /= static_cast<float>(config.factor);
  } else if (config.type == "dynamic") {
    // Dynamic NTK changes nothing until the context exceeds the trained length; beyond it we
    // would need per-length frequencies, which the engine does not run.
  } else if (config.type == "yarn") {
    apply_yarn(config, rotary_dim, max_position_embeddings, &inv_freq_, &attention_scaling_);
  } else if (config.type == "llama3") {
    apply_llama3(config, &inv_freq_);
  } else {
    MOE_FAIL("unsupported rope type '", config.type, "'");
  }
}

void Rope::apply(float* x, int64_t num_heads, int64_t stride, int64_t position,
                 bool interleaved) const {
  const int64_t half = rotary_dim_ / 2;
  float cos_table[512];
  float sin_table[512];
  MOE_CHECK(half <= 512, "rotary dim ", rotary_dim_, " too large");
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(position) * inv_freq_[i];
    cos_table[i] = std::cos(angle) * attention_scaling_;
    sin_table[i] = std::sin(angle) * attention_scaling_;
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* head = x + h * stride;
    if (interleaved) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = head[2 * i];
        const float x2 = head[2 * i + 1];
        head[2 * i] = x1 * cos_table[i] - x2 * sin_table[i];
        head[2 * i + 1] = x2 * cos_table[i] + x1 * sin_table[i];
      }
      continue;
    }
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = head[i];
      const float x2 = head[i + half];
      head[i] = x1 * cos_table[i] - x2 * sin_table[i];
      head[i + half] = x2 * cos_table[i] + x1 * sin_table[i];
    }
  }
}

}  // namespace moeinfer
