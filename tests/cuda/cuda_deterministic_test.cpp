// --deterministic on the GPU (GpuOptions::deterministic): the decoder gives a token bit-identical
// logits whatever else its step carries. For random models of every family (tests/support/
// random_model.h, as the sweep draws them) one deterministic decoder runs each of three
// sequences alone, one token a step (decode route, a CUDA graph of bucket 1), and every other
// way a token can be computed must give that row bit for bit:
//   batched    the scripted steps (tests/support/random_schedule.h): two prompts prefilled
//              together, a third chunked beside the others' next tokens, decode steps of three
//              and two sequences (graph buckets of 4 and 2, with padding rows)
//   chunked    each sequence's tokens prefilled in chunks of 2, 3, 5, 8 and all at once (the
//              --max-num-batched-tokens that the scheduler would cut them by)
//   recomputed half the sequence run, then, as after a preemption, the whole prefix again as
//              one prefill in other KV blocks and the rest decoded
//   eager      decode steps beside a sequence that wants no logits, which the graphs do not
//              take, so the step runs its kernels directly
// Accuracy against the CPU is the sweep's job (cuda_sweep_test.cpp runs a deterministic sweep
// too). A failure prints the family, seed, config.json, the route, the sequence, the position
// and the first differing logit; MOE_DET_SEED=S replays, MOE_DET_CONFIGS=N sets the count
// (default 36). CudaDeterministic.WideHeadDims* does the same for two models with head dims past
// 256. Registered only where a CUDA device is visible.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>

#include "../support/random_model.h"
#include "../support/random_schedule.h"
#include "cuda_test_util.h"
#include "model/gpu_decoder.h"

namespace moeinfer {
namespace {

constexpr int64_t kDefaultConfigs = 36;
constexpr int64_t kChunkSizes[] = {2, 3, 5, 8, 1 << 20};

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value ? std::strtoll(value, nullptr, 10) : fallback;
}

struct Checker {
  int64_t V = 0;
  const std::vector<std::vector<float>>* alone = nullptr;  // [3][len * V]
  int64_t rows = 0, differing = 0;
  std::string first;  // the first difference, described

  // Logits row `got` of sequence q at `position`, computed by `route`.
  void row(const float* got, int q, int64_t position, const std::string& route) {
    ++rows;
    const float* want = &(*alone)[q][position * V];
    if (std::memcmp(got, want, static_cast<size_t>(V) * sizeof(float)) == 0) return;
    if (differing++ > 0) return;
    int64_t i = 0;
    while (std::memcmp(&got[i], &want[i], sizeof(float)) == 0) ++i;
    std::ostringstream what;
    what.precision(9);
    what << route << ": sequence " << q << " position " << position << ", logit " << i << " is "
         << got[i] << ", alone " << want[i] << " (|diff| " << std::fabs(double{got[i]} - want[i])
         << ")";
    first = what.str();
  }
};

std::vector<float> run(GpuDecoder& gpu, const ForwardBatch& batch, int64_t V) {
  std::vector<float> logits(static_cast<size_t>(Decoder::num_logit_rows(batch) * V), NAN);
  gpu.forward(batch, logits);
  return logits;
}

SequenceBatch piece(const std::vector<int32_t>& tokens, const std::vector<int32_t>& table,
                    int64_t position, int64_t count, bool want = true) {
  return SequenceBatch{.tokens = std::span<const int32_t>(tokens).subspan(position, count),
                       .position = position,
                       .block_table = table,
                       .want_logits = want};
}

// Every route against the sequences alone; the number of rows compared and what differed.
Checker check_config(const testing::RandomModel& m, uint64_t seed) {
  const ModelConfig& c = m.config;
  const int64_t V = c.vocab_size;
  std::mt19937_64 rng(seed);
  const int64_t block_size = std::vector<int64_t>{8, 16, 32}[rng() % 3];
  const testing::Schedule s = testing::make_schedule(V, seed, block_size);
  // Room for the schedule, and for the 26 tables of the other runs below.
  const int64_t per_run = (s.max_len + block_size - 1) / block_size;
  const int64_t num_blocks = s.num_blocks + 28 * per_run;
  auto gpu = GpuDecoder::create(c, m.weights,
                                GpuOptions{.max_batch_tokens = 64,
                                           .max_num_seqs = 4,
                                           .max_model_len = 64,
                                           .block_size = block_size,
                                           .num_kv_blocks = num_blocks,
                                           .quiet = true,
                                           .deterministic = true});
  // The schedule's tables use blocks [0, s.num_blocks); the other runs take disjoint shuffled
  // tables from the rest, so that no two runs share a block.
  std::vector<int32_t> rest(static_cast<size_t>(num_blocks - s.num_blocks));
  std::iota(rest.begin(), rest.end(), static_cast<int32_t>(s.num_blocks));
  std::shuffle(rest.begin(), rest.end(), rng);
  auto fresh_table = [&](int64_t tokens) {
    const int64_t n = (tokens + block_size - 1) / block_size;
    MOE_CHECK(static_cast<int64_t>(rest.size()) >= n, "test pool too small");
    std::vector<int32_t> out(rest.end() - n, rest.end());
    rest.resize(rest.size() - static_cast<size_t>(n));
    return out;
  };

  // Alone: one token a step.
  std::vector<std::vector<float>> alone(3);
  for (int q = 0; q < 3; ++q) {
    const std::vector<int32_t> table = fresh_table(static_cast<int64_t>(s.tokens[q].size()));
    for (int64_t t = 0; t < static_cast<int64_t>(s.tokens[q].size()); ++t) {
      const std::vector<float> row = run(*gpu, {.sequences = {piece(s.tokens[q], table, t, 1)}}, V);
      alone[q].insert(alone[q].end(), row.begin(), row.end());
    }
  }
  Checker check{.V = V, .alone = &alone};

  // Batched: the scripted steps.
  for (const testing::ScheduledStep& step : s.steps) {
    const std::vector<float> logits = run(*gpu, step.batch, V);
    const std::string route = std::string("batched ") + testing::route_name(step.route) +
                              " step of " + std::to_string(step.batch.sequences.size()) +
                              " sequences";
    testing::for_each_logit_row(step, [&](int64_t row, int sequence, int64_t position) {
      check.row(&logits[row * V], sequence, position, route);
    });
  }

  // Chunked prefill at several chunk sizes (one sequence at a time, all positions).
  auto prefill_in_chunks = [&](int q, const std::vector<int32_t>& table, int64_t begin, int64_t end,
                               int64_t chunk, const std::string& route) {
    for (int64_t pos = begin; pos < end; pos += chunk) {
      const int64_t n = std::min(chunk, end - pos);
      const std::vector<float> logits =
          run(*gpu, {.sequences = {piece(s.tokens[q], table, pos, n)}, .all_positions = true}, V);
      for (int64_t t = 0; t < n; ++t) check.row(&logits[t * V], q, pos + t, route);
    }
  };
  for (int q = 0; q < 3; ++q) {
    const int64_t len = static_cast<int64_t>(s.tokens[q].size());
    for (const int64_t chunk : kChunkSizes) {
      if (chunk > len && chunk != kChunkSizes[std::size(kChunkSizes) - 1]) continue;
      prefill_in_chunks(
          q, fresh_table(len), 0, len, chunk,
          chunk >= len ? "prefill in one step" : "chunked by " + std::to_string(chunk));
    }
  }

  // Recomputed after a preemption: half the sequence, then the prefix again in other blocks,
  // then the rest decoded.
  for (int q = 0; q < 3; ++q) {
    const int64_t len = static_cast<int64_t>(s.tokens[q].size());
    const int64_t half = std::max<int64_t>(1, len / 2);
    prefill_in_chunks(q, fresh_table(len), 0, half, 4, "before preemption (chunks of 4)");
    const std::vector<int32_t> table = fresh_table(len);
    const int64_t recompute = std::min(len, half + 1);
    prefill_in_chunks(q, table, 0, recompute, recompute, "recompute prefill");
    for (int64_t t = recompute; t < len; ++t) {
      const std::vector<float> row = run(*gpu, {.sequences = {piece(s.tokens[q], table, t, 1)}}, V);
      check.row(row.data(), q, t, "decode after recompute");
    }
  }

  // Eager decode: beside a sequence that wants no logits (no graph takes such a step).
  {
    const int q = 0;
    const int64_t len = static_cast<int64_t>(s.tokens[q].size());
    const std::vector<int32_t> table = fresh_table(len), other_table = fresh_table(len);
    const std::vector<int32_t>& other = s.tokens[1 + rng() % 2];
    for (int64_t t = 0; t < len; ++t) {
      ForwardBatch batch{.sequences = {piece(s.tokens[q], table, t, 1)}};
      if (t < static_cast<int64_t>(other.size()))
        batch.sequences.push_back(piece(other, other_table, t, 1, /*want=*/false));
      const std::vector<float> row = run(*gpu, batch, V);
      check.row(row.data(), q, t, "eager decode beside a sequence without logits");
    }
  }
  return check;
}

void every_family_is_batch_invariant() {
  const uint64_t base = static_cast<uint64_t>(
      env_int("MOE_DET_SEED", static_cast<int64_t>(cuda::testing_util::fresh_seed())));
  const int64_t count = env_int("MOE_DET_CONFIGS", kDefaultConfigs);
  std::printf("deterministic: %lld configurations from seed %llu (MOE_DET_SEED=%llu reruns them)\n",
              static_cast<long long>(count), static_cast<unsigned long long>(base),
              static_cast<unsigned long long>(base));
  int64_t rows = 0, failures = 0;
  for (int64_t i = 0; i < count; ++i) {
    const ModelFamily family = testing::kAllFamilies[i % 6];
    const uint64_t seed = base + static_cast<uint64_t>(i);
    std::string config_json;
    try {
      const testing::RandomModel model = testing::make_random_model(family, seed);
      config_json = model.config_json;
      const Checker r = check_config(model, seed ^ 0xde7);
      rows += r.rows;
      failures += r.differing > 0;
      EXPECT_EQ(r.differing, 0) << family_name(family) << " seed " << seed << ": " << r.differing
                                << " of " << r.rows
                                << " rows differ from the sequence alone; first: " << r.first
                                << "\n  config " << config_json;
    } catch (const std::exception& e) {
      ++failures;
      ADD_FAILURE() << family_name(family) << " seed " << seed << ": " << e.what() << "\n  config "
                    << config_json;
    }
  }
  std::printf("deterministic: %lld logits rows compared, %lld of %lld configurations differ\n",
              static_cast<long long>(rows), static_cast<long long>(failures),
              static_cast<long long>(count));
}

// The same for head dims past the fast kernels' 256 (the wide decode kernel's fixed splits): a
// Qwen3-MoE model at 320 with groups of 4, and a Mixtral model at 1000 (padded to 1024: two
// output tiles per block) with a group of 24 (two head tiles) and a sliding window.
void wide_head_dims_are_batch_invariant() {
  const uint64_t base = cuda::testing_util::fresh_seed();
  struct Case {
    ModelFamily family;
    nlohmann::json overrides;
  };
  const Case cases[] = {
      {ModelFamily::kQwen3Moe,
       {{"head_dim", 320}, {"num_attention_heads", 8}, {"num_key_value_heads", 2}}},
      {ModelFamily::kMixtral,
       {{"head_dim", 1000},
        {"num_attention_heads", 24},
        {"num_key_value_heads", 1},
        {"sliding_window", 6}}},
  };
  for (const Case& c : cases) {
    const testing::RandomModel model = testing::make_random_model(c.family, base, c.overrides);
    const Checker r = check_config(model, base ^ 0xde7);
    EXPECT_GT(r.rows, 0);
    EXPECT_EQ(r.differing, 0) << family_name(c.family) << " seed " << base << ": " << r.differing
                              << " of " << r.rows
                              << " rows differ from the sequence alone; first: " << r.first
                              << "\n  config " << model.config_json;
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("deterministic decoder")) return false;
  cuda::testing_util::register_kernel_test("CudaDeterministic",
                                           "EveryRouteGivesTheLogitsOfTheTokenAlone",
                                           every_family_is_batch_invariant, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaDeterministic",
                                           "WideHeadDimsGiveTheLogitsOfTheTokenAlone",
                                           wide_head_dims_are_batch_invariant, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
