#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
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
  MOE_CHECK(params.min_p >= 0.0f && params.min_p <= 1.0f, "min_p must be in [0, 1], got ",
            params.min_p);
  MOE_CHECK(std::isfinite(params.repetition_penalty) && params.repetition_penalty > 0.0f,
            "repetition_penalty must be > 0, got ", params.repetition_penalty);
  MOE_CHECK(params.presence_penalty >= -2.0f && params.presence_penalty <= 2.0f,
            "presence_penalty must be in [-2, 2], got ", params.presence_penalty);
  MOE_CHECK(params.frequency_penalty >= -2.0f && params.frequency_penalty <= 2.0f,
            "frequency_penalty must be in [-2, 2], got ", params.frequency_penalty);
}

bool Sampler::has_penalties() const {
  return params_.repetition_penalty != 1.0f || params_.presence_penalty != 0.0f ||
         params_.frequency_penalty != 0.0f;
}

void Sampler::apply_penalties(std::span<float> logits, const SamplingHistory& history) {
  const int64_t n = static_cast<int64_t>(logits.size());
  const auto in_range = [n](int32_t t) { return t >= 0 && t < n; };
  if (params_.repetition_penalty != 1.0f) {
    // As in transformers and vLLM: divide positive logits, multiply negative ones, once per
    // distinct token of the prompt or the output.
    const float p = params_.repetition_penalty;
    counts_.assign(n, 0);
    for (auto part : {history.prompt, history.output}) {
      for (int32_t t : part) {
        if (!in_range(t) || counts_[t]) continue;
        counts_[t] = 1;
        logits[t] = logits[t] > 0.0f ? logits[t] / p : logits[t] * p;
      }
    }
  }
  if (params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) {
    counts_.assign(n, 0);
    for (int32_t t : history.output) {
      if (in_range(t)) ++counts_[t];
    }
    for (int32_t t : history.output) {
      if (!in_range(t) || counts_[t] == 0) continue;
      logits[t] -= params_.presence_penalty + params_.frequency_penalty * counts_[t];
      counts_[t] = 0;  // once per distinct token
    }
  }
}

int32_t Sampler::sample(std::span<const float> raw_logits, const SamplingHistory& history) {
  const int64_t n = static_cast<int64_t>(raw_logits.size());
  MOE_CHECK(n > 0, "cannot sample from empty logits");
  std::span<const float> logits = raw_logits;
  if (has_penalties()) {
    penalised_.assign(raw_logits.begin(), raw_logits.end());
    apply_penalties(penalised_, history);
    logits = penalised_;
  }
  if (params_.temperature == 0.0f) {
    // Greedy; the first maximum wins, as argmax does.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  const auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  order_.resize(n);
  std::iota(order_.begin(), order_.end(), 0);
  // How many candidates to sort. With top_k, exactly those. Without it, the nucleus (top-p) or
  // the min-p set is usually a few tokens of a large vocabulary: sort a growing prefix until it
  // holds the cut, instead of sorting every token for every sample.
  int64_t keep = params_.top_k > 0 ? std::min(params_.top_k, n) : n;
  // Normaliser of the probabilities over all tokens, when no top_k cut applies.
  double full_total = 0.0;
  if (params_.top_k == 0 && (params_.top_p < 1.0f || params_.min_p > 0.0f)) {
    const float max_logit = *std::max_element(logits.begin(), logits.end());
    for (float l : logits) full_total += std::exp((l - max_logit) / params_.temperature);
    for (int64_t k = std::min<int64_t>(64, n);; k = std::min(n, 4 * k)) {
      std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), by_logit);
      double prefix = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        prefix += std::exp((logits[order_[i]] - max_logit) / params_.temperature);
      }
      const double last = std::exp((logits[order_[k - 1]] - max_logit) / params_.temperature);
      // min-p is applied first and renormalises, so its whole set must be in the prefix;
      // otherwise the prefix must reach top_p of the total mass.
      const bool done = params_.min_p > 0.0f ? last < params_.min_p
                                             : prefix >= params_.top_p * full_total;
      if (done || k == n) {
        keep = k;
        break;
      }
    }
  } else {
    std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), by_logit);
  }
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
  // The probabilities are shares of every token's mass unless top_k cut the candidates.
  if (full_total > 0.0) total = full_total;
  int64_t cut = keep;
  // min-p: keep tokens whose probability is at least min_p times the largest (probs_[0] = 1).
  if (params_.min_p > 0.0f) {
    for (int64_t i = 1; i < cut; ++i) {
      if (probs_[i] < params_.min_p * probs_[0]) {
        cut = i;
        break;
      }
    }
    total = 0.0;
    for (int64_t i = 0; i < cut; ++i) total += probs_[i];
  }
  // top-p: the smallest prefix whose probability reaches top_p (at least one token).
  if (params_.top_p < 1.0f) {
    double cumulative = 0.0;
    for (int64_t i = 0; i < cut; ++i) {
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

TokenLogprob Sampler::logprobs(std::span<const float> logits, int32_t token, int64_t num_top) {
  const int64_t n = static_cast<int64_t>(logits.size());
  MOE_CHECK(token >= 0 && token < n, "token ", token, " outside the logits row of ", n);
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (float l : logits) total += std::exp(static_cast<double>(l) - max_logit);
  const double log_total = std::log(total) + max_logit;
  TokenLogprob out{.token = token, .logprob = static_cast<float>(logits[token] - log_total)};
  num_top = std::clamp<int64_t>(num_top, 0, n);
  if (num_top > 0) {
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + num_top, order.end(),
                      [&](int32_t a, int32_t b) {
                        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                      });
    for (int64_t i = 0; i < num_top; ++i) {
      out.top.emplace_back(order[i], static_cast<float>(logits[order[i]] - log_total));
    }
  }
  return out;
}

}  // namespace moeinfer
