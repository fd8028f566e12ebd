// The expert cache's hit rate by policy, budget and batch under Zipf routing, through the same
// admission code the GPU's kernel and the CPU's simulated budget run (offload/host_cache.h): no
// weights and no prefetch, only the decisions. Each token of each layer draws its k experts
// without replacement with probabilities proportional to (rank + 1)^-A (top-k of
// -A ln(rank + 1) plus Gumbel noise, as `--routing-skew zipf:A` does on the GPU).
//
//   bench_cache_policy [--layers 48] [--experts 128] [--top-k 8] [--skew 1.0] [--steps 120]
//                      [--warm-steps 40]
//
// Prints one row per (batch, budget): the share of a step's demanded experts found resident
// under LRU and under LFU, counted after the warm steps; and under LFU with an admission filter,
// a rule the engine does not have yet: a miss takes a slot only when it has been demanded more
// often than the expert it would evict (else it is read from host memory, unplaced).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "offload/host_cache.h"

using namespace moeinfer;

namespace {

struct Shape {
  int64_t layers = 48, experts = 128, top_k = 8, steps = 120, warm_steps = 40;
  double skew = 1.0;
};

// rows[e] = how many of `batch` tokens picked expert e.
void draw_rows(const Shape& s, int64_t batch, std::mt19937_64& rng, std::vector<int32_t>& rows) {
  std::uniform_real_distribution<double> uniform(1e-300, 1.0);
  std::vector<std::pair<double, int32_t>> keys(static_cast<size_t>(s.experts));
  std::fill(rows.begin(), rows.end(), 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t e = 0; e < s.experts; ++e) {
      const double gumbel = -std::log(-std::log(uniform(rng)));
      keys[e] = {-s.skew * std::log(static_cast<double>(e) + 1.0) + gumbel,
                 static_cast<int32_t>(e)};
    }
    std::partial_sort(keys.begin(), keys.begin() + s.top_k, keys.end(), std::greater<>());
    for (int64_t k = 0; k < s.top_k; ++k) ++rows[keys[k].second];
  }
}

double hit_rate(const Shape& s, int64_t batch, double budget, offload::CachePolicy policy) {
  const auto slots = static_cast<int64_t>(budget * static_cast<double>(s.layers * s.experts));
  offload::HostCacheTables cache(s.layers, s.experts, slots, policy);
  std::mt19937_64 rng(1);  // the same routing for every policy
  std::vector<int32_t> rows(static_cast<size_t>(s.experts));
  std::vector<offload::SlotCopy> copies(static_cast<size_t>(s.experts));
  int64_t hits = 0, demanded = 0;
  for (int64_t step = 0; step < s.steps; ++step) {
    for (int64_t l = 0; l < s.layers; ++l) {
      draw_rows(s, batch, rng, rows);
      const int64_t before = cache.counters(l)[offload::kCacheHits];
      const int64_t tick = cache.next_tick();
      cache.admit({.layer = l, .num_experts = s.experts, .tick = tick, .protect_from = tick},
                  rows.data(), offload::ColdCost{}, copies);
      if (step < s.warm_steps) continue;
      hits += cache.counters(l)[offload::kCacheHits] - before;
      demanded += std::count_if(rows.begin(), rows.end(), [](int32_t r) { return r > 0; });
    }
  }
  return demanded > 0 ? static_cast<double>(hits) / static_cast<double>(demanded) : 0.0;
}

// LFU with the admission filter, on the same tables and the same routing as hit_rate().
double filtered_lfu_hit_rate(const Shape& s, int64_t batch, double budget) {
  const auto slots = static_cast<int64_t>(budget * static_cast<double>(s.layers * s.experts));
  offload::HostCacheTables cache(s.layers, s.experts, slots, offload::CachePolicy::kLfu);
  const offload::CacheTables t = cache.tables();
  std::mt19937_64 rng(1);
  std::vector<int32_t> rows(static_cast<size_t>(s.experts));
  int64_t hits = 0, demanded = 0;
  for (int64_t step = 0; step < s.steps; ++step) {
    for (int64_t l = 0; l < s.layers; ++l) {
      draw_rows(s, batch, rng, rows);
      const int64_t tick = cache.next_tick();
      const auto base = static_cast<int32_t>(l * s.experts);
      for (int64_t e = 0; e < s.experts; ++e) {  // the resident first, as admit() does
        const int32_t g = base + static_cast<int32_t>(e);
        if (rows[e] == 0) continue;
        t.uses[g] += 1;
        const bool hit = t.slot_of[g] >= 0;
        if (hit) t.last_use[t.slot_of[g]] = tick;
        if (step >= s.warm_steps) {
          hits += hit ? 1 : 0;
          demanded += 1;
        }
      }
      for (int64_t e = 0; e < s.experts; ++e) {
        const int32_t g = base + static_cast<int32_t>(e);
        if (rows[e] == 0 || t.slot_of[g] >= 0) continue;
        const int32_t slot = offload::choose_slot(t, tick);
        if (slot < 0) continue;
        const int32_t victim = t.owner[slot];
        if (victim >= 0 && t.uses[victim] >= t.uses[g]) continue;  // the filter
        if (victim >= 0) t.slot_of[victim] = -1;
        t.owner[slot] = g;
        t.slot_of[g] = slot;
        t.last_use[slot] = tick;
      }
    }
  }
  return demanded > 0 ? static_cast<double>(hits) / static_cast<double>(demanded) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const double value = std::atof(argv[i + 1]);
    if (flag == "--layers")
      s.layers = static_cast<int64_t>(value);
    else if (flag == "--experts")
      s.experts = static_cast<int64_t>(value);
    else if (flag == "--top-k")
      s.top_k = static_cast<int64_t>(value);
    else if (flag == "--skew")
      s.skew = value;
    else if (flag == "--steps")
      s.steps = static_cast<int64_t>(value);
    else if (flag == "--warm-steps")
      s.warm_steps = static_cast<int64_t>(value);
    else {
      std::fprintf(stderr, "bench_cache_policy: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (s.layers < 1 || s.experts < 1 || s.top_k < 1 || s.top_k > s.experts ||
      s.warm_steps >= s.steps) {
    std::fprintf(stderr,
                 "bench_cache_policy: need layers, experts >= 1, 1 <= top-k <= experts, "
                 "warm-steps < steps\n");
    return 2;
  }
  std::printf("zipf:%.2f, %lld layers x %lld experts, top-%lld, %lld steps (%lld warm)\n", s.skew,
              static_cast<long long>(s.layers), static_cast<long long>(s.experts),
              static_cast<long long>(s.top_k), static_cast<long long>(s.steps),
              static_cast<long long>(s.warm_steps));
  std::printf("%6s %7s %9s %9s %17s\n", "batch", "budget", "LRU hit", "LFU hit", "LFU+filter hit");
  for (int64_t batch : {1, 16, 64}) {
    for (double budget : {0.5, 0.25, 0.1}) {
      std::printf("%6lld %6.0f%% %9.3f %9.3f %17.3f\n", static_cast<long long>(batch), budget * 100,
                  hit_rate(s, batch, budget, offload::CachePolicy::kLru),
                  hit_rate(s, batch, budget, offload::CachePolicy::kLfu),
                  filtered_lfu_hit_rate(s, batch, budget));
    }
  }
  return 0;
}
