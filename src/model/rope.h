// Rotary position embeddings in the rotate-half layout: for i < D/2 the pair (x[i], x[i + D/2])
// turns by position * inv_freq[i]. The inverse frequencies follow the checkpoint's rope type.
#pragma once

#include <cstdint>
#include <vector>

#include "io/model_config.h"

namespace moeinfer {

class Rope {
 public:
  // rotary_dim: how many leading dims of each head rotate (D for the families here).
  Rope(const RopeConfig& config, int64_t rotary_dim, int64_t max_position_embeddings);

  int64_t rotary_dim() const { return rotary_dim_; }
  // Scales cos/sin (yarn's attention factor); 1 for the other types.
  float attention_scaling() const { return attention_scaling_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }

  // Rotates the first rotary_dim dims of each of num_heads heads at x ([num_heads, head_dim]),
  // head rows `stride` floats apart (head_dim when packed). Rotate-half pairs (i, i + D/2), or
  // with `interleaved` adjacent pairs (2i, 2i + 1) as DeepSeek lays them out.
  void apply(float* x, int64_t num_heads, int64_t stride, int64_t position,
             bool interleaved = false) const;

 private:
  int64_t rotary_dim_;
  float attention_scaling_ = 1.0f;
  std::vector<float> inv_freq_;  // [rotary_dim / 2]
};

}  // namespace moeinfer
