// The sampling fields on the GPU engine (--device cuda) on the demo model: logit_bias bans and
// forces tokens (such rows bring their logits back and the host sampler applies the bias),
// prompt logprobs equal the CPU engine's within bf16 rounding, n sequences with a seed give
// what single requests with seed + i give (under --deterministic), an abort frees every block, and
// with --deterministic a seeded request's tokens do not depend on batching, chunking or preemption.
// Registered only where a CUDA device is present; run with scripts/gpu-check.sh.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../support/engine_runs.h"
#include "cuda_test_util.h"
#include "runtime/engine.h"

namespace moeinfer {
namespace {

std::unique_ptr<Engine> engine_on(const std::string& device, bool deterministic = false) {
  return Engine::load(testing::kDemoModel, EngineConfig{.max_num_seqs = 8,
                                                        .max_num_batched_tokens = 64,
                                                        .block_size = 16,
                                                        .num_kv_blocks = 64,
                                                        .max_model_len = 256,
                                                        .device = device,
                                                        .gpu_memory_fraction = 0.5,
                                                        .deterministic = deterministic});
}

void logit_bias_holds_on_the_gpu() {
  auto gpu = engine_on("cuda");
  const std::vector<int32_t> prompt = gpu->tokenizer().encode("Once upon a time there was", true);
  const GenerationParams greedy{.max_tokens = 8, .ignore_eos = true};
  // The reference runs beside a twin, so that its steps have the shapes of the checked run's
  // (two sequences): outside --deterministic the kernels of a one-row and a two-row step sum
  // in other orders, which may tip a near-tie of the greedy pick.
  const RequestId plain = gpu->add_request(prompt, greedy);
  gpu->add_request(prompt, greedy);
  const testing::SequenceRun first = testing::run_sequences(*gpu).at({plain, 0});
  ASSERT_EQ(first.tokens.size(), 8u);
  // A request the GPU sampler takes in the same batch is not disturbed (first, as the reference
  // was).
  const RequestId beside = gpu->add_request(prompt, greedy);
  GenerationParams banned = greedy;
  banned.sampling.logit_bias = {{first.tokens[0], -100.0f}};
  const RequestId b = gpu->add_request(prompt, banned);
  const auto done = testing::run_sequences(*gpu);
  for (int32_t t : done.at({b, 0}).tokens) EXPECT_NE(t, first.tokens[0]);
  EXPECT_EQ(done.at({beside, 0}).tokens, first.tokens);
  GenerationParams forced = testing::seeded_sampling(8, 11);
  forced.sampling.logit_bias = {{1234, 100.0f}};
  const RequestId f = gpu->add_request(prompt, forced);
  EXPECT_EQ(testing::run_sequences(*gpu).at({f, 0}).tokens, std::vector<int32_t>(8, 1234));
  EXPECT_EQ(gpu->stats().kv.num_used, 0);
}

void prompt_logprobs_match_the_cpu() {
  const std::string text = "Q: What is the difference between a fortune cookie and a computer?\nA:";
  GenerationParams params{.max_tokens = 0, .prompt_logprobs = 1};
  std::vector<TokenLogprob> want, got;
  for (const char* device : {"cpu", "cuda"}) {
    auto engine = engine_on(device);
    const std::vector<int32_t> prompt = engine->tokenizer().encode(text, true);
    const RequestId id = engine->add_request(prompt, params);
    (std::string(device) == "cpu" ? want : got) =
        testing::run_sequences(*engine).at({id, 0}).prompt_logprobs;
    EXPECT_EQ(engine->stats().kv.num_used, 0);
  }
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(want.empty());
  for (size_t j = 0; j < want.size(); ++j) {
    EXPECT_EQ(got[j].token, want[j].token);
    // bf16 weights and activations on the device: logprobs within a few hundredths.
    EXPECT_NEAR(got[j].logprob, want[j].logprob, 5e-2f + 2e-2f * std::fabs(want[j].logprob))
        << "position " << j + 1;
  }
}

// Under --deterministic: otherwise a decode step of one row and one of three may take other
// kernels (the skinny GEMMs at one row, cuBLAS and the tiles past it), whose last-bit
// differences can tip a sampled token.
void n_sequences_equal_single_requests() {
  auto gpu = engine_on("cuda", /*deterministic=*/true);
  const std::vector<int32_t> prompt = gpu->tokenizer().encode("A fortune cookie says:", true);
  std::vector<std::vector<int32_t>> singles;
  for (uint64_t i = 0; i < 3; ++i) {
    const RequestId id = gpu->add_request(prompt, testing::seeded_sampling(16, 77 + i));
    singles.push_back(testing::run_sequences(*gpu).at({id, 0}).tokens);
  }
  GenerationParams params = testing::seeded_sampling(16, 77);
  params.num_sequences = 3;
  const RequestId id = gpu->add_request(prompt, params);
  const auto done = testing::run_sequences(*gpu);
  for (int64_t i = 0; i < 3; ++i)
    EXPECT_EQ(done.at({id, i}).tokens, singles[i]) << "sequence " << i;
  // An abort mid-decode frees every sequence's blocks.
  params.max_tokens = 200;
  const RequestId aborted = gpu->add_request(prompt, params);
  for (int i = 0; i < 4; ++i) gpu->step();
  gpu->abort_request(aborted);
  gpu->step();
  EXPECT_FALSE(gpu->has_unfinished());
  EXPECT_EQ(gpu->stats().kv.num_used, 0);
}

// --deterministic on the GPU engine: seeded requests (top-p, one with logprobs, one greedy) give
// the same tokens alone, all together, and together with prompts chunked by 7 tokens in a KV
// pool too small for them (preempted and recomputed).
void deterministic_text_ignores_batching_and_preemption() {
  auto make = [](int64_t tokens_per_step, int64_t blocks) {
    return Engine::load(testing::kDemoModel, EngineConfig{.max_num_seqs = 8,
                                                          .max_num_batched_tokens = tokens_per_step,
                                                          .block_size = 16,
                                                          .num_kv_blocks = blocks,
                                                          .max_model_len = 128,
                                                          .device = "cuda",
                                                          .gpu_memory_fraction = 0.5,
                                                          .deterministic = true});
  };
  std::vector<std::vector<int32_t>> prompts;
  std::vector<GenerationParams> params;
  auto big = make(64, 64);
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(
        big->tokenizer().encode(std::string(i % 2 ? "A fortune cookie" : "Never trust") +
                                    " number " + std::to_string(i) + " says that",
                                true));
    GenerationParams p = testing::seeded_sampling(40, 500 + i);
    p.sampling.top_p = 0.9f;
    if (i == 4) p.logprobs = 1;
    if (i == 5) p.sampling.temperature = 0.0f;
    params.push_back(p);
  }
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < 6; ++i) {
    const RequestId id = big->add_request(prompts[i], params[i]);
    alone.push_back(testing::run_sequences(*big).at({id, 0}).tokens);
  }
  auto together = [&](Engine& engine, const char* what) {
    std::vector<RequestId> ids;
    for (int i = 0; i < 6; ++i) ids.push_back(engine.add_request(prompts[i], params[i]));
    const auto done = testing::run_sequences(engine);
    for (int i = 0; i < 6; ++i)
      EXPECT_EQ(done.at({ids[i], 0}).tokens, alone[i]) << what << ": request " << i;
    EXPECT_EQ(engine.stats().kv.num_used, 0) << what;
  };
  together(*big, "batched");
  auto small = make(7, 12);
  together(*small, "chunked by 7 and preempted");
  EXPECT_GT(small->stats().num_preemptions, 0) << "the small pool preempted nothing";
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("engine sampling")) return false;
  using cuda::testing_util::register_kernel_test;
  register_kernel_test("CudaEngineSampling", "LogitBiasHoldsOnTheGpu", logit_bias_holds_on_the_gpu,
                       __FILE__, __LINE__);
  register_kernel_test("CudaEngineSampling", "PromptLogprobsMatchTheCpu",
                       prompt_logprobs_match_the_cpu, __FILE__, __LINE__);
  register_kernel_test("CudaEngineSampling", "NSequencesEqualSingleRequests",
                       n_sequences_equal_single_requests, __FILE__, __LINE__);
  register_kernel_test("CudaEngineSampling", "DeterministicTextIgnoresBatchingAndPreemption",
                       deterministic_text_ignores_batching_and_preemption, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
