#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace moeinfer {

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  validate(params);
}

void Sampler::validate(const SamplingParams& params) {
  MOE_CHECK(std::isfinite(params.temperature) && params.temperature >= 0.0f,
            "temperature must be >= 0, got ", params.temperature);
  MOE_CHECK(params.top_k >= 0, "top_k must be >= 0, got ", params.top_k);
  MOE_CHECK(params.top_p > 0.0f && params.top_p <= 1.0f, "top_p must be in (0, 1], got ",
            params.top_p);
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int64_t n = static_cast<int64_t>(logits.size());
  MOE_CHECK(n > 0, "cannot sample from empty logits");
  if (params_.temperature == 0.0f) {
    // Greedy; the first maximum wins, as argmax does.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Candidates sorted by logit (ties to the lower id), cut to top_k.
  order_.resize(n);
  std::iota(order_.begin(), order_.end(), 0);
  const int64_t keep = params_.top_k > 0 ? std::min(params_.top_k, n) : n;
  const auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
  order_.resize(keep);

  // Softmax at the temperature over the kept candidates, in double for a stable sum.
  probs_.resize(keep);
  const double max_logit = logits[order_[0]];
  double total = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    const double p = std::exp((logits[order_[i]] - max_logit) / params_.temperature);
    probs_[i] = static_cast<float>(p);
    total += p;
  }
  // top-p: the smallest prefix whose probability reaches top_p (at least one token).
  int64_t cut = keep;
  if (params_.top_p < 1.0f) {
    double cumulative = 0.0;
    for (int64_t i = 0; i < keep; ++i) {
      cumulative += probs_[i] / total;
      if (cumulative >= params_.top_p) {
        cut = i + 1;
        break;
      }
    }
  }
  double kept_total = 0.0;
  for (int64_t i = 0; i < cut; ++i) kept_total += probs_[i];
  std::uniform_real_distribution<double> uniform(0.0, kept_total);
  const double target = uniform(rng_);
  double cumulative = 0.0;
  for (int64_t i = 0; i < cut; ++i) {
    cumulative += probs_[i];
    if (target < cumulative) return order_[i];
  }
  return order_[cut - 1];
}

}  // namespace moeinfer
