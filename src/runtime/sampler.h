// Picks the next token from a row of logits. In order: the request's logit bias added to the raw
// logits, then repetition / presence / frequency penalties (vLLM's order), then greedy
// (temperature 0) or temperature with top-k, min-p and top-p filtering, drawn from a seeded
// generator so the same seed gives the same text. Log probabilities, when asked for, are those
// of the model's own distribution (log-softmax of the raw logits, before bias, penalties and
// temperature), as vLLM reports them.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace moeinfer {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int64_t top_k = 0;         // 0: no limit
  float top_p = 1.0f;        // 1: no limit
  float min_p = 0.0f;        // drop tokens below min_p times the most likely one's probability
  float repetition_penalty = 1.0f;  // > 1 discourages tokens seen in the prompt or the output
  float presence_penalty = 0.0f;    // subtracted once from tokens in the output
  float frequency_penalty = 0.0f;   // subtracted per occurrence in the output
  // [num_biased] (token, bias in [-100, 100]) added to the logits before everything else, as
  // OpenAI's logit_bias: -100 bans a token in practice, +100 forces it. A token listed twice
  // gets both biases.
  std::vector<std::pair<int32_t, float>> logit_bias;
  uint64_t seed = 0;
};

// The chosen token with its log probability and the most likely alternatives.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  int64_t rank = 1;  // 1 + the tokens strictly more likely (vLLM's rank)
  std::vector<std::pair<int32_t, float>> top;  // [num_top] (token, logprob), most likely first
};

// What came before the token being sampled, for the penalties.
struct SamplingHistory {
  std::span<const int32_t> prompt;
  std::span<const int32_t> output;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Validates ranges; throws moeinfer::Error naming the bad parameter.
  static void validate(const SamplingParams& params);

  int32_t sample(std::span<const float> logits) { return sample(logits, {}); }
  int32_t sample(std::span<const float> logits, const SamplingHistory& history);
  // Log probability of `token` and the `num_top` most likely tokens under the raw logits.
  static TokenLogprob logprobs(std::span<const float> logits, int32_t token, int64_t num_top);

 private:
  bool has_penalties() const;
  void apply_logit_bias(std::span<float> logits) const;
  int32_t sample_top_k(std::span<const float> logits);
  int32_t sample_without_top_k(std::span<const float> logits);
  std::pair<float, int64_t> nucleus_threshold(std::span<const float> weights, double target);
  void apply_penalties(std::span<float> logits, const SamplingHistory& history);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> penalised_;
  std::vector<int32_t> order_;
  std::vector<float> probs_;
  std::vector<int32_t> counts_;  // [V] occurrences in the output, reset after use
};

}  // namespace moeinfer
