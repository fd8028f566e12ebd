// Picks the next token from a row of logits: greedy, or temperature with top-k and top-p
// filtering, from a seeded generator so the same seed gives the same text.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace moeinfer {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // 1: no limit
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Validates ranges; throws moeinfer::Error naming the bad parameter.
  static void validate(const SamplingParams& params);

  int32_t sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<float> probs_;
};

}  // namespace moeinfer
