// The GPU decoder with quantised routed experts (the device holds the codes and scales and the
// expert GEMM dequantises them, model/cuda/device_weights.h) against the CPU decoder on the
// same model and tokens: the fp8 (DeepSeek-V3, Kimi K2), AWQ, GPTQ and MXFP4 (GPT-OSS) fixtures
// as stored, and a bf16 fixture under --weights fp8 and int4. Both devices compute with the same
// dequantised expert values (the codes the loader kept, model/quantized_matrix.h), so the bound
// is the GPU parity bound of every other fixture (cuda_parity_test.cpp): relative logit error
// <= 2e-2 over the prompt's rows (prefill) and over greedy decode steps fed the CPU's tokens.
//
// The dense Linears the GPU holds as codes too (DeviceWeights::dense_quant: a quantised
// checkpoint's dense matrices, and every one under --weights-scope linear, which the bf16
// fixtures of standard attention, shared experts, MLA with a dense layer and Gated DeltaNet run
// here in fp8 and int4) go through the quantised skinny GEMM at decode and are dequantised into
// the decoder's scratch for the prompt's rows: the same bound holds.
//
// And the point of it: the device's weight bytes are exactly the bf16 upload's with every routed
// expert's bf16 matrices, and every dense Linear held quantised, replaced by its quantised slabs
// (backend/cuda/expert_quant.h), which are smaller. GPTQ with act-order (a permuted g_idx) keeps
// no codes and stays bf16 on the GPU.
// Registered only where a CUDA device is visible.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../support/model_fixtures.h"
#include "backend/cuda/expert_quant.h"
#include "cuda_test_util.h"
#include "model/cuda/device_weights.h"
#include "model/gpu_decoder.h"
#include "model/model.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;  // the GPU parity bound (cuda_parity_test.cpp)
constexpr int64_t kDecodeSteps = 6;
// The prompt again as this many sequences of one step: more rows per expert, so the automatic
// tile steps up from the 16-row one the single prompt takes.
constexpr int64_t kBatched = 3;

struct QuantFixture {
  const char* name;
  WeightFormat weights;      // --weights
  cuda::ExpertQuant expect;  // how the GPU must hold the routed experts
  int64_t group;             // inputs per scale of the expected codes
  WeightScope scope = WeightScope::kExperts;  // --weights-scope
  // Whether the device holds some dense Linears quantised (a quantised checkpoint's, or under
  // --weights-scope linear).
  bool dense_codes = false;
};

const QuantFixture kFixtures[] = {
    {"deepseek_v3_fp8", WeightFormat::kCheckpoint, cuda::ExpertQuant::kFp8, 8,
     WeightScope::kExperts, true},
    {"kimi_k2_fp8", WeightFormat::kCheckpoint, cuda::ExpertQuant::kFp8, 8, WeightScope::kExperts,
     true},
    {"qwen2_moe_awq", WeightFormat::kCheckpoint, cuda::ExpertQuant::kInt4, 32,
     WeightScope::kExperts, true},
    {"deepseek_v2_lite_gptq_v2", WeightFormat::kCheckpoint, cuda::ExpertQuant::kInt4, 32,
     WeightScope::kExperts, true},
    {"gpt_oss_mxfp4", WeightFormat::kCheckpoint, cuda::ExpertQuant::kMxfp4, 32},
    {"qwen3_moe_bf16", WeightFormat::kFp8, cuda::ExpertQuant::kFp8, 128},
    {"qwen3_moe_bf16", WeightFormat::kInt4, cuda::ExpertQuant::kInt4, 128},
    {"mixtral_bf16", WeightFormat::kInt4, cuda::ExpertQuant::kInt4, 128},
    {"qwen3_moe_gptq", WeightFormat::kCheckpoint, cuda::ExpertQuant::kNone, 0},  // act-order
    // --weights-scope linear: standard attention (heads padded 32 -> 64: o_proj's columns move,
    // so it stays bf16), shared experts with their gate, MLA with a dense first layer, Gated
    // DeltaNet with gated attention.
    {"qwen3_moe_bf16", WeightFormat::kFp8, cuda::ExpertQuant::kFp8, 128, WeightScope::kLinear,
     true},
    {"qwen3_moe_bf16", WeightFormat::kInt4, cuda::ExpertQuant::kInt4, 128, WeightScope::kLinear,
     true},
    {"qwen2_moe_shared96_bf16", WeightFormat::kFp8, cuda::ExpertQuant::kFp8, 128,
     WeightScope::kLinear, true},
    {"qwen2_moe_shared96_bf16", WeightFormat::kInt4, cuda::ExpertQuant::kInt4, 128,
     WeightScope::kLinear, true},
    {"deepseek_v3_q48_v560_bf16", WeightFormat::kFp8, cuda::ExpertQuant::kFp8, 128,
     WeightScope::kLinear, true},
    {"qwen3_next_bf16", WeightFormat::kInt4, cuda::ExpertQuant::kInt4, 128, WeightScope::kLinear,
     true},
    {"qwen3_next_bf16", WeightFormat::kFp8, cuda::ExpertQuant::kFp8, 128, WeightScope::kLinear,
     true},
};

std::string label(const QuantFixture& f) {
  const std::string_view flag = weight_format_name(f.weights);
  return std::string(f.name) + (flag.empty() ? "" : " --weights " + std::string(flag)) +
         (f.scope == WeightScope::kLinear ? " --weights-scope linear" : "");
}

std::unique_ptr<Model> load(const QuantFixture& f) {
  return Model::load(
      testing_support::kModelFixtures / f.name,
      LoadOptions{.prefault = false, .expert_weights = f.weights, .weight_scope = f.scope});
}

struct RelError {
  double diff = 0.0, norm = 0.0;
  void add(const float* got, const float* want, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "logit " << i << " not finite";
      diff += std::pow(double{got[i]} - want[i], 2);
      norm += std::pow(double{want[i]}, 2);
    }
  }
  double rel() const { return norm > 0 ? std::sqrt(diff / norm) : 0.0; }
};

void gpu_matches_cpu(const QuantFixture& f) {
  SCOPED_TRACE(label(f));
  const auto dir = testing_support::kModelFixtures / f.name;
  std::ifstream in(dir / "reference.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  const auto prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t n = static_cast<int64_t>(prompt.size());

  auto model = load(f);
  const ModelConfig& config = model->config();
  const int64_t V = config.vocab_size;
  auto gpu = GpuDecoder::create(config, model->decoder().weights(),
                                GpuOptions{.max_batch_tokens = 64,
                                           .max_num_seqs = 4,
                                           .max_model_len = 64,
                                           .num_kv_blocks = 4 * (1 + kBatched),
                                           .quiet = true});
  const std::vector<int32_t> table = {0, 1, 2, 3};
  // Gated DeltaNet layers: a recurrent state slot per sequence (the prompt's 0, the batched
  // copies' 1 to kBatched), as the engine hands them out; -1 without such layers.
  const bool recurrent = config.num_linear_layers() > 0;
  auto slot = [&](int64_t s) { return recurrent ? static_cast<int32_t>(s) : int32_t{-1}; };

  // Prefill: every prompt row.
  KvCache cache = model->decoder().make_cache(64);
  std::vector<float> cpu(n * V), got(n * V, NAN);
  model->decoder().forward(prompt, cache, cpu, /*all_positions=*/true);
  gpu->forward(
      {.sequences =
           {{.tokens = prompt, .position = 0, .block_table = table, .state_slot = slot(0)}},
       .all_positions = true},
      got);
  RelError prefill;
  prefill.add(got.data(), cpu.data(), n * V);

  // The same prompt as kBatched sequences in one step: each sequence's rows are the CPU's.
  {
    ForwardBatch batch{.all_positions = true};
    std::vector<std::vector<int32_t>> tables;
    for (int64_t s = 0; s < kBatched; ++s) {
      tables.push_back({static_cast<int32_t>(4 * (s + 1)), static_cast<int32_t>(4 * (s + 1) + 1),
                        static_cast<int32_t>(4 * (s + 1) + 2),
                        static_cast<int32_t>(4 * (s + 1) + 3)});
    }
    for (int64_t s = 0; s < kBatched; ++s) {
      batch.sequences.push_back(
          {.tokens = prompt, .position = 0, .block_table = tables[s], .state_slot = slot(s + 1)});
    }
    std::vector<float> batched(kBatched * n * V, NAN);
    gpu->forward(batch, batched);
    for (int64_t s = 0; s < kBatched; ++s)
      prefill.add(batched.data() + s * n * V, cpu.data(), n * V);
  }

  // Decode: one token a step (the 16-row tile of the quantised GEMM), the CPU's greedy token
  // fed to both.
  RelError decode;
  std::vector<float> cpu_row(V), gpu_row(V);
  int32_t next = static_cast<int32_t>(std::max_element(cpu.end() - V, cpu.end()) - (cpu.end() - V));
  for (int64_t step = 0; step < kDecodeSteps; ++step) {
    const std::vector<int32_t> token = {next};
    model->decoder().forward(token, cache, cpu_row, /*all_positions=*/false);
    std::fill(gpu_row.begin(), gpu_row.end(), NAN);
    gpu->forward({.sequences = {{.tokens = token,
                                 .position = n + step,
                                 .block_table = table,
                                 .state_slot = slot(0)}}},
                 gpu_row);
    decode.add(gpu_row.data(), cpu_row.data(), V);
    next = static_cast<int32_t>(std::max_element(cpu_row.begin(), cpu_row.end()) - cpu_row.begin());
  }
  EXPECT_LE(prefill.rel(), kMaxRelError) << "prefill";
  EXPECT_LE(decode.rel(), kMaxRelError) << "decode";
  std::printf("%-40s GPU vs CPU rel error: prefill %.2e  decode %.2e\n", label(f).c_str(),
              prefill.rel(), decode.rel());
}

void every_quantised_fixture_matches_the_cpu() {
  for (const QuantFixture& f : kFixtures) gpu_matches_cpu(f);
}

// The device holds the codes: weight bytes are the bf16 upload's (weights rounded to one bf16
// term, so the comparison does not depend on the checkpoint's dtype) less every routed expert's
// bf16 matrices plus its quantised slabs.
void device_holds_the_codes() {
  for (const QuantFixture& f : kFixtures) {
    SCOPED_TRACE(label(f));
    auto model = load(f);
    const ModelConfig& c = model->config();
    auto gpu = GpuDecoder::create(c, model->decoder().weights(),
                                  GpuOptions{.weight_dtype = GpuWeightDtype::kBf16,
                                             .max_batch_tokens = 16,
                                             .max_num_seqs = 2,
                                             .max_model_len = 32,
                                             .num_kv_blocks = 4,
                                             .quiet = true});
    const int64_t Hp = gpu::padded_hidden_size(c), Ip = gpu::padded_expert_width(c);
    const int64_t moe_layers = std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), true);
    const int64_t bf16_expert = (2 * Ip * Hp + Hp * Ip) * 2;
    int64_t quant_expert = bf16_expert;
    if (f.expect != cuda::ExpertQuant::kNone) {
      quant_expert = cuda::quant_matrix_layout(f.expect, 2 * Ip, Hp, f.group).bytes +
                     cuda::quant_matrix_layout(f.expect, Hp, Ip, f.group).bytes;
      // Smaller than bf16: fp8 one byte a value, 4-bit half a byte, plus a 4-byte scale per
      // group (the fixtures' fp8 blocks of 8 make that half a byte a value more).
      EXPECT_LT(quant_expert, bf16_expert) << "a quantised expert is not smaller";
    }
    const int64_t bf16_bytes = gpu::device_weight_bytes(c, 1);
    // Each stack is its own 256-byte aligned allocation, and both sizes are multiples of 256.
    int64_t want = bf16_bytes - moe_layers * c.num_experts * (bf16_expert - quant_expert);
    // Each dense Linear held quantised: its slab instead of its bf16 matrix (256-byte aligned).
    const gpu::DeviceWeights held =
        gpu::upload_weights(c, model->decoder().weights(), false, false, /*round_to_bf16=*/true);
    EXPECT_EQ(!held.dense_quant.empty(), f.dense_codes) << held.dense_quant.size();
    for (const gpu::DenseQuantMatrix& m : held.dense_quant) {
      const int64_t bf16_matrix = (m.rows * m.cols * 2 + 255) / 256 * 256;
      EXPECT_LT(m.layout.bytes, bf16_matrix) << m.rows << " x " << m.cols;
      want -= bf16_matrix - m.layout.bytes;
    }
    EXPECT_EQ(gpu->memory().dense_quant_matrices, static_cast<int64_t>(held.dense_quant.size()));
    EXPECT_EQ(gpu->memory().dense_quant_bytes, held.dense_quant_bytes);
    EXPECT_EQ(gpu->memory().weight_bytes, want)
        << "bf16 upload " << bf16_bytes << " bytes, " << moe_layers << " MoE layers of "
        << c.num_experts << " experts";
    std::printf("%-40s device weights %lld bytes, bf16 %lld\n", label(f).c_str(),
                static_cast<long long>(gpu->memory().weight_bytes),
                static_cast<long long>(bf16_bytes));
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("quantised decoder")) return false;
  cuda::testing_util::register_kernel_test("CudaQuantDecoder", "EveryQuantisedFixtureMatchesTheCpu",
                                           every_quantised_fixture_matches_the_cpu, __FILE__,
                                           __LINE__);
  cuda::testing_util::register_kernel_test("CudaQuantDecoder", "DeviceHoldsTheCodes",
                                           device_holds_the_codes, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
