// The GPU decoder's prompt steps after a cached prefix, on every model fixture the GPU runs:
//   chunked  the prompt in three steps of uneven size (5, 4, then the rest) over blocks of 8
//            tokens (the smallest the decoder takes) interleaved with other sequences'
//            blocks, so that the second and third steps start mid-block, the third after a
//            prefix of more than one block;
//   mixed    one step where a sequence with a cached prefix brings one token and another
//            brings its whole prompt from position 0 (neither a decode nor a prefill step).
// Their logits are held to the same prompt run in one step (the flash prefill route) within
// the GPU parity bound (relative error <= 2e-2, tests/cuda/cuda_parity_test.cpp), and
// GpuDecoder::attention_route_counts shows which route ran them: the paged prefill kernel where
// the GQA flash kernels apply (model/attention_route.h), the MLA prefill kernel on MLA models
// (DeepSeek-V2/V3, Kimi K2: the one-step prompt too, which is then also held to a
// --deterministic decoder's, whose prompts take the per-query route through the MLA decode
// kernel), else the per-query route (heads past 128). The reference-parity side of chunking is
// in cuda_parity_test.cpp's chunked route.
// Written without a GPU; not yet run on one.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "../support/model_fixtures.h"
#include "backend/cuda/attention.h"
#include "cuda_test_util.h"
#include "model/attention_route.h"
#include "model/cuda/device_weights.h"
#include "model/gpu_decoder.h"
#include "model/model.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;  // the GPU parity bound
constexpr int64_t kBlockSize = 8;
constexpr int32_t kSeqs = 4;
constexpr int32_t kBlocksPerSeq = 8;  // 64 tokens

// Relative error of rows of logits against rows of the whole-prompt run.
struct RowError {
  double diff = 0.0, norm = 0.0;
  void add(const float* ours, const float* ref, int64_t V) {
    for (int64_t i = 0; i < V; ++i) {
      ASSERT_TRUE(std::isfinite(ours[i])) << "logit " << i << " not finite";
      diff += std::pow(double{ours[i]} - ref[i], 2);
      norm += std::pow(double{ref[i]}, 2);
    }
  }
  double rel() const { return norm > 0 ? std::sqrt(diff / norm) : 0.0; }
};

// Sequence s's blocks interleaved with the others' (s, s + kSeqs, ...), so that consecutive
// blocks of one sequence are never neighbours in the pool.
std::vector<int32_t> interleaved_blocks(int32_t s) {
  std::vector<int32_t> table(kBlocksPerSeq);
  for (int32_t i = 0; i < kBlocksPerSeq; ++i) table[i] = s + i * kSeqs;
  return table;
}

// The route the decoder takes for a prompt chunk after a cached prefix and a mixed step, or
// (from_position_0) for fresh prompts.
AttentionRoute chunk_route(const ModelConfig& config, bool from_position_0 = false) {
  const gpu::MlaPaddedDims mla = gpu::padded_mla_dims(config);
  const AttentionModelFacts facts{
      .mla = config.mla.has_value(),
      .padded_head_dim = config.mla ? 0 : cuda::decode_padded_head_dim(config.head_dim),
      .gqa_group = config.num_kv_heads > 0 ? config.num_heads / config.num_kv_heads : 1,
      .mla_latent_dim = mla.latent,
      .mla_rope_dim = mla.rope};
  return choose_attention_route({.one_token_each = false, .all_from_position_0 = from_position_0},
                                facts);
}

// Steps a route ran between two readings of the counters.
int64_t steps_on(AttentionRoute route, const AttentionRouteCounts& before,
                 const AttentionRouteCounts& after) {
  switch (route) {
    case AttentionRoute::kDecode:
      return after.decode - before.decode;
    case AttentionRoute::kPrefill:
      return after.prefill - before.prefill;
    case AttentionRoute::kPagedPrefill:
      return after.paged_prefill - before.paged_prefill;
    case AttentionRoute::kMlaPrefill:
      return after.mla_prefill - before.mla_prefill;
    case AttentionRoute::kPerQuery:
      return after.per_query - before.per_query;
  }
  return -1;
}

const char* route_name(AttentionRoute route) {
  switch (route) {
    case AttentionRoute::kDecode:
      return "decode";
    case AttentionRoute::kPrefill:
      return "prefill";
    case AttentionRoute::kPagedPrefill:
      return "paged prefill";
    case AttentionRoute::kMlaPrefill:
      return "MLA prefill";
    case AttentionRoute::kPerQuery:
      return "per-query";
  }
  return "?";
}

// The steps a counter reading saw in all (each step takes exactly one route).
int64_t all_steps(const AttentionRouteCounts& c) {
  return c.decode + c.prefill + c.paged_prefill + c.mla_prefill + c.per_query;
}

void chunked_and_mixed_steps_match_one_step(const std::string& name) {
  const auto dir = testing_support::kModelFixtures / name;
  std::ifstream in(dir / "reference.json");
  const auto prompt =
      nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t n = static_cast<int64_t>(prompt.size());
  ASSERT_GE(n, 11) << "the fixture's prompt is too short for the chunks below";
  auto model = Model::load(dir, LoadOptions{.prefault = false});
  const ModelConfig& config = model->config();
  const int64_t V = config.vocab_size;
  const GpuOptions options{.max_batch_tokens = 64,
                           .max_num_seqs = kSeqs,
                           .max_model_len = kBlocksPerSeq * kBlockSize,
                           .block_size = kBlockSize,
                           .num_kv_blocks = kSeqs * kBlocksPerSeq,
                           .quiet = true};
  auto gpu = GpuDecoder::create(config, model->decoder().weights(), options);
  const auto slot = [&](int32_t s) { return config.linear_attention ? s : -1; };
  const AttentionRoute route = chunk_route(config);
  const AttentionRoute fresh_route = chunk_route(config, /*from_position_0=*/true);
  const bool mla_prefill = route == AttentionRoute::kMlaPrefill;
  const std::span<const int32_t> all(prompt);

  // The whole prompt in one step (sequence 0): on MLA models the MLA prefill kernel too.
  std::vector<float> whole(n * V, NAN);
  const auto table0 = interleaved_blocks(0);
  const auto one_step = [&](GpuDecoder& decoder, std::span<float> logits) {
    decoder.forward(
        {.sequences =
             {{.tokens = all, .position = 0, .block_table = table0, .state_slot = slot(0)}},
         .all_positions = true},
        logits);
  };
  const AttentionRouteCounts before_whole = gpu->attention_route_counts();
  one_step(*gpu, whole);
  const AttentionRouteCounts after_whole = gpu->attention_route_counts();
  EXPECT_EQ(steps_on(fresh_route, before_whole, after_whole), 1) << name;
  EXPECT_EQ(all_steps(after_whole) - all_steps(before_whole), 1) << name;

  // MLA prefill against the kernel it replaces: the same prompt on a --deterministic decoder,
  // whose prompts take the per-query route (its products are the fixed-order GEMM instead of
  // cuBLAS, within the same parity bound).
  RowError per_query;
  if (mla_prefill) {
    GpuOptions deterministic = options;
    deterministic.deterministic = true;
    auto oracle = GpuDecoder::create(config, model->decoder().weights(), deterministic);
    std::vector<float> reference(n * V, NAN);
    const AttentionRouteCounts before = oracle->attention_route_counts();
    one_step(*oracle, reference);
    EXPECT_EQ(steps_on(AttentionRoute::kPerQuery, before, oracle->attention_route_counts()), 1);
    for (int64_t t = 0; t < n; ++t) per_query.add(&whole[t * V], &reference[t * V], V);
    EXPECT_LE(per_query.rel(), kMaxRelError) << name << ": MLA prefill vs per-query";
  }

  // chunked (sequence 1): 5, 4, then the rest.
  RowError chunked;
  const AttentionRouteCounts before_chunks = gpu->attention_route_counts();
  {
    const auto table = interleaved_blocks(1);
    const int64_t cuts[] = {0, 5, 9, n};
    for (int c = 0; c < 3; ++c) {
      const int64_t begin = cuts[c], count = cuts[c + 1] - cuts[c];
      std::vector<float> logits(count * V, NAN);
      gpu->forward({.sequences = {{.tokens = all.subspan(begin, count), .position = begin,
                                   .block_table = table, .state_slot = slot(1)}},
                    .all_positions = true},
                   logits);
      for (int64_t t = 0; t < count; ++t) chunked.add(&logits[t * V], &whole[(begin + t) * V], V);
    }
  }
  const AttentionRouteCounts after_chunks = gpu->attention_route_counts();
  // The first chunk starts at position 0 (fresh_route); the two after it take `route`.
  EXPECT_EQ(steps_on(route, before_chunks, after_chunks), fresh_route == route ? 3 : 2) << name;
  EXPECT_EQ(all_steps(after_chunks) - all_steps(before_chunks), 3) << name;

  // mixed: sequence 2 holds the first 9 tokens, then brings the 10th while sequence 3 brings
  // the first 10 from position 0, in one step.
  RowError mixed;
  {
    const auto table2 = interleaved_blocks(2), table3 = interleaved_blocks(3);
    std::vector<float> first(9 * V, NAN);
    gpu->forward({.sequences = {{.tokens = all.first(9), .position = 0, .block_table = table2,
                                 .state_slot = slot(2)}},
                  .all_positions = true},
                 first);
    const AttentionRouteCounts before = gpu->attention_route_counts();
    std::vector<float> logits(11 * V, NAN);
    gpu->forward({.sequences = {{.tokens = all.subspan(9, 1), .position = 9,
                                 .block_table = table2, .state_slot = slot(2)},
                                {.tokens = all.first(10), .position = 0, .block_table = table3,
                                 .state_slot = slot(3)}},
                  .all_positions = true},
                 logits);
    const AttentionRouteCounts after = gpu->attention_route_counts();
    EXPECT_EQ(steps_on(route, before, after), 1) << name;
    mixed.add(&logits[0], &whole[9 * V], V);
    for (int64_t t = 0; t < 10; ++t) mixed.add(&logits[(1 + t) * V], &whole[t * V], V);
  }
  EXPECT_LE(chunked.rel(), kMaxRelError) << name;
  EXPECT_LE(mixed.rel(), kMaxRelError) << name;
  std::printf("%-26s %-13s rel error to the one-step prompt: chunked %.2e  mixed %.2e",
              name.c_str(), route_name(route), chunked.rel(), mixed.rel());
  if (mla_prefill) std::printf("  one step vs per-query %.2e", per_query.rel());
  std::printf("\n");
}

void every_fixture() {
  int64_t paged_fixtures = 0, mla_fixtures = 0;
  for (const std::string& name : testing_support::model_fixture_names()) {
    SCOPED_TRACE(name);
    const ModelConfig config =
        load_model_config(testing_support::kModelFixtures / name / "config.json");
    if (gpu_unsupported(config).has_value()) continue;
    chunked_and_mixed_steps_match_one_step(name);
    if (chunk_route(config) == AttentionRoute::kPagedPrefill) ++paged_fixtures;
    if (chunk_route(config) == AttentionRoute::kMlaPrefill) ++mla_fixtures;
  }
  // GPT-OSS (sinks, sliding layers), Llama 4 (chunked layers, temperature), Qwen3 and more.
  EXPECT_GE(paged_fixtures, 10) << "fixtures missing under " << testing_support::kModelFixtures;
  // deepseek_v2*, deepseek_v3*, kimi_k2* (9 today, among them the 36 + 12 latent padded to
  // 40 + 16, and fp8 checkpoints).
  EXPECT_GE(mla_fixtures, 8) << "MLA fixtures missing under " << testing_support::kModelFixtures;
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("chunked prefill")) return false;
  cuda::testing_util::register_kernel_test("CudaChunkedPrefill",
                                           "EveryFixtureChunkedAndMixedMatchOneStep",
                                           every_fixture, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
