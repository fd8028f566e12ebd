#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>

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
  for (const auto& [token, bias] : params.logit_bias) {
    MOE_CHECK(token >= 0, "logit_bias token id must be >= 0, got ", token);
    MOE_CHECK(bias >= -100.0f && bias <= 100.0f, "logit_bias of token ", token,
              " must be in [-100, 100], got ", bias);
  }
}

void Sampler::apply_logit_bias(std::span<float> logits) const {
  const int64_t n = static_cast<int64_t>(logits.size());
  for (const auto& [token, bias] : params_.logit_bias) {
    MOE_CHECK(token < n, "logit_bias token id ", token, " is outside the vocabulary of ", n);
    logits[token] += bias;
  }
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
  if (has_penalties() || !params_.logit_bias.empty()) {
    penalised_.assign(raw_logits.begin(), raw_logits.end());
    apply_logit_bias(penalised_);
    if (has_penalties()) apply_penalties(penalised_, history);
    logits = penalised_;
  }
  if (params_.temperature == 0.0f) {
    // Greedy; the first maximum wins, as argmax does.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  return params_.top_k > 0 ? sample_top_k(logits) : sample_without_top_k(logits);
}

// top_k: sort the k best (ties to the lower id), then min-p and top-p over them.
int32_t Sampler::sample_top_k(std::span<const float> logits) {
  const int64_t n = static_cast<int64_t>(logits.size());
  const int64_t keep = std::min(params_.top_k, n);
  order_.resize(n);
  std::iota(order_.begin(), order_.end(), 0);
  std::partial_sort(order_.begin(), order_.begin() + keep, order_.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
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

// No top_k: the same distribution in time linear in the vocabulary, without sorting it. The
// kept set is every token heavier than a threshold plus the tokens at the threshold up to an id;
// the threshold comes from min-p directly and from top-p by selection (quickselect on
// probability mass), and the draw walks the vocabulary in id order.
int32_t Sampler::sample_without_top_k(std::span<const float> logits) {
  const int64_t n = static_cast<int64_t>(logits.size());
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  // Weights relative to the most likely token (which weighs 1).
  probs_.resize(n);
  for (int64_t i = 0; i < n; ++i) probs_[i] = std::exp((logits[i] - max_logit) / params_.temperature);
  const std::span<const float> w = probs_;

  // min-p: the candidates weigh at least min_p (min-p renormalises over them before top-p).
  float threshold = params_.min_p;
  int64_t last_tie = n - 1;  // tokens at the threshold are kept up to this id
  if (params_.top_p < 1.0f) {
    order_.clear();
    double candidate_mass = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (w[i] >= params_.min_p) {
        order_.push_back(static_cast<int32_t>(i));
        candidate_mass += w[i];
      }
    }
    std::tie(threshold, last_tie) = nucleus_threshold(w, params_.top_p * candidate_mass);
  }
  const auto kept = [&](int64_t i) {
    return w[i] > threshold || (w[i] == threshold && i <= last_tie);
  };
  double kept_total = 0.0;
  int64_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (kept(i)) {
      kept_total += w[i];
      last = i;
    }
  }
  std::uniform_real_distribution<double> uniform(0.0, kept_total);
  const double target = uniform(rng_);
  double cumulative = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (!kept(i)) continue;
    cumulative += w[i];
    if (target < cumulative) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);
}

// Among the candidates in order_ (token ids, any order), the smallest set of the heaviest ones,
// ties going to the lower id, whose weight reaches `target`: returned as the weight of its
// lightest member and the highest id it takes among the candidates of that weight. Three-way
// partitions around a pivot, keeping whole groups that fall short of the target and descending
// into the one that reaches it: expected linear time.
std::pair<float, int64_t> Sampler::nucleus_threshold(std::span<const float> w, double target) {
  const int64_t all = static_cast<int64_t>(w.size()) - 1;
  auto begin = order_.begin(), end = order_.end();
  double taken = 0.0;  // weight of the candidates already in the set
  float lightest = w[*begin];
  while (begin != end) {
    const float a = w[*begin], b = w[*(begin + (end - begin) / 2)], c = w[*(end - 1)];
    const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of 3
    // [begin, heavy_end): heavier than the pivot; [heavy_end, equal_end): equal; then lighter.
    const auto heavy_end = std::partition(begin, end, [&](int32_t t) { return w[t] > pivot; });
    const auto equal_end = std::partition(heavy_end, end, [&](int32_t t) { return w[t] == pivot; });
    double heavy = 0.0;
    for (auto it = begin; it != heavy_end; ++it) heavy += w[*it];
    if (taken + heavy >= target && heavy_end != begin) {
      end = heavy_end;  // the set ends among the heavier ones
      continue;
    }
    taken += heavy;
    // The pivot's group, lowest ids first: the set ends inside it, or takes it whole.
    std::sort(heavy_end, equal_end);
    for (auto it = heavy_end; it != equal_end; ++it) {
      taken += pivot;
      if (taken >= target) return {pivot, *it};
    }
    lightest = pivot;
    begin = equal_end;
  }
  // Rounding left the target just out of reach: every candidate is in.
  return {lightest, all};
}

TokenLogprob Sampler::logprobs(std::span<const float> logits, int32_t token, int64_t num_top) {
  const int64_t n = static_cast<int64_t>(logits.size());
  MOE_CHECK(token >= 0 && token < n, "token ", token, " outside the logits row of ", n);
  const float max_logit = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (float l : logits) total += std::exp(static_cast<double>(l) - max_logit);
  const double log_total = std::log(total) + max_logit;
  TokenLogprob out{.token = token, .logprob = static_cast<float>(logits[token] - log_total)};
  out.rank = 1 + std::count_if(logits.begin(), logits.end(),
                               [&](float l) { return l > logits[token]; });
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
