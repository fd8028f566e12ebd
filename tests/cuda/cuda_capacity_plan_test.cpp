// `moeinfer plan`'s numbers against what the GPU decoder really allocates (issue 4, item 4), for
// the demo checkpoint (GpuDecoder::create), synthetic:qwen3-30b-a3b and synthetic:deepseek-v3 cut
// to 4 layers (GpuDecoder::create_synthetic), each with gpu_memory_fraction 0.9:
//   weights    GpuMemoryReport::weight_bytes (bf16 device weights, 256-byte aligned, heads and
//              expert widths padded only when the dims are not kernel-friendly)
//   KV/token   GpuMemoryReport::kv_bytes_per_token (bf16 pool; MLA: the latent row only; and
//              deepseek-v3 again with --kv-dtype fp8: the latent's and the rope key's codes and
//              their two scales, exactly the planner's count, 512 + 64 needing no padding)
//   tokens     num_kv_blocks x block_size against the plan's kv_tokens_fit
// all within 5%. A first test needs no device: device_weight_bytes (what the decoder will
// allocate for weights) against the plan for the demo and every synthetic shape.
//
// How "tokens that fit" is compared. The decoder's policy (model/cuda/gpu_decoder.cpp,
// allocate_kv_pool): KV = gpu_memory_fraction x the card - everything in use on the device when
// the pool is sized (this process's CUDA context and cuBLAS handle, the weights, the workspace,
// which is at most 2 GiB, and whatever other processes hold). The planner's: KV =
// gpu_mem x memory_fraction - workspace_gib (2 GiB, the workspace's cap standing in for
// workspace + context) - weights. So the test holds the plan two ways:
//   - told the reserve the decoder really had (the memory in use on the device before it was
//     made, which includes this process's context and whatever parallel ctest processes hold,
//     plus its workspace), the plan's tokens are within 5% of the pool's: the weights, the bytes
//     per token and the arithmetic are right;
//   - as `moeinfer plan --gpu-mem <card>` prints it (on an idle card), the plan never promises
//     more tokens than the pool holds (0.5% slack for the weights' alignment) and falls short by
//     at most its 2 GiB reserve's worth of tokens. That shortfall is 1-2% of the KV pool on an
//     H200 but 8% on an 80 GB H100 holding 57 GiB of weights (bench/RESULTS.md, 2026-12-06),
//     which is why a 5% bound on the printed plan held on one card and not the other. The three
//     models run one after another in one registered test, so they never hold the
// card at the same time. While one holds 0.9 of the card (from sizing its pool until it is
// freed, a moment), a GpuDecoder made by another process finds little of its own 0.9 left.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../model/capacity_plan_checks.h"
#include "backend/cuda/cuda_check.h"
#include "cuda_test_util.h"
#include "model/capacity_plan.h"
#include "model/cuda/device_weights.h"
#include "model/gpu_decoder.h"
#include "model/model.h"
#include "model/model_facts.h"
#include "model/synthetic.h"

namespace moeinfer {
namespace {

const std::filesystem::path kDemo =
    std::filesystem::path(MOE_FIXTURES_DIR) / ".." / ".." / "models" / "demo";
constexpr double kMemoryFraction = 0.9;
// In use before the decoder, up to which the device counts as idle (a CUDA context is ~0.5 GiB).
constexpr int64_t kIdleDeviceBytes = int64_t{1} << 30;

using testing_util::expect_within;
using testing_util::kGiB;
using testing_util::rel_diff;

// No device needed: the bytes upload_weights / synthetic_weights allocate, from the config.
TEST(CudaCapacityPlan, DeviceWeightBytesMatchThePlan) {
  struct Named {
    std::string name;
    ModelConfig config;
  };
  std::vector<Named> models = {
      {"demo", load_model_config(kDemo / "config.json")},
      {"deepseek-v3 (4 layers)", synthetic_model_config("deepseek-v3", 4)}};
  for (const std::string& name : synthetic_model_names()) {
    // qwen3-next-80b-a3b too: its Gated DeltaNet layers have a device layout now.
    models.push_back({name, synthetic_model_config(name)});
  }
  for (const Named& m : models) {
    // A context the KV of one sequence fits at (Llama 4 Scout's 10M tokens would not); the
    // weights do not depend on it.
    const CapacityPlan plan = plan_capacity(m.config, PlanOptions{.max_seq_len = 4096});
    const int64_t device = gpu::device_weight_bytes(m.config);
    expect_within(plan.weight_bytes.total(), device, m.name + " weights");
    std::printf("%-24s weights: plan %lld B, device_weight_bytes %lld B (%+.4f%%)\n",
                m.name.c_str(), static_cast<long long>(plan.weight_bytes.total()),
                static_cast<long long>(device), 100 * rel_diff(plan.weight_bytes.total(), device));
  }
}

// No device needed: `plan --dtype fp8` counts every Linear matrix at fp8 with a scale per 128
// inputs of a row, what the GPU holds under --weights fp8 --weights-scope linear (MLA's kv_b
// stays bf16 there, and padding differs: within the same 5%).
TEST(CudaCapacityPlan, Fp8PlanMatchesTheLinearScope) {
  for (const std::string& name : synthetic_model_names()) {
    const ModelConfig config = synthetic_model_config(name);
    const CapacityPlan plan =
        plan_capacity(config, PlanOptions{.weight_dtype = WeightDType::kFP8, .max_seq_len = 4096});
    const int64_t device =
        gpu::device_weight_bytes(config, 1, WeightFormat::kFp8, WeightScope::kLinear);
    expect_within(plan.weight_bytes.total(), device, name + " fp8 weights");
    std::printf("%-24s fp8 weights: plan %lld B, device (linear scope) %lld B (%+.4f%%)\n",
                name.c_str(), static_cast<long long>(plan.weight_bytes.total()),
                static_cast<long long>(device), 100 * rel_diff(plan.weight_bytes.total(), device));
  }
}

int64_t device_bytes_in_use() {
  CUDA_CHECK(cudaFree(nullptr));  // makes the context, so it is counted
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(total_bytes - free_bytes);
}

void check_model(const std::string& name, const ModelConfig& config,
                 const std::function<std::unique_ptr<GpuDecoder>(const GpuOptions&)>& make,
                 KvDType kv_dtype = KvDType::kBF16) {
  SCOPED_TRACE(name);
  const int64_t in_use_before = device_bytes_in_use();
  const auto decoder =
      make(GpuOptions{.gpu_memory_fraction = kMemoryFraction, .quiet = true, .kv_dtype = kv_dtype});
  const GpuMemoryReport& r = decoder->memory();
  const int64_t engine_tokens = r.num_kv_blocks * r.block_size;
  const double card_gib = static_cast<double>(r.device_bytes) / kGiB;

  const PlanOptions as_printed{.num_gpus = 1,
                               .gpu_mem_gib = card_gib,
                               .weight_dtype = WeightDType::kBF16,
                               .kv_dtype = kv_dtype,
                               .memory_fraction = kMemoryFraction};
  PlanOptions shared = as_printed;
  shared.workspace_gib = static_cast<double>(in_use_before + r.workspace_bytes) / kGiB;
  const CapacityPlan plan = plan_capacity(config, as_printed);
  const CapacityPlan plan_shared = plan_capacity(config, shared);

  expect_within(plan.weight_bytes.total(), r.weight_bytes, "weight bytes");
  EXPECT_EQ(r.weight_bytes, gpu::device_weight_bytes(config));
  expect_within(plan.kv_bytes_per_token, r.kv_bytes_per_token, "KV bytes per token");
  EXPECT_EQ(plan_shared.layout, Layout::kSingleGpu);
  expect_within(plan_shared.kv_tokens_fit, engine_tokens,
                "tokens of KV that fit (the reserve the decoder had: memory in use before + "
                "its workspace)");
  if (in_use_before <= kIdleDeviceBytes) {
    const double reserve_tokens =
        as_printed.workspace_gib * kGiB / static_cast<double>(r.kv_bytes_per_token);
    EXPECT_LE(static_cast<double>(plan.kv_tokens_fit), 1.005 * static_cast<double>(engine_tokens))
        << "the printed plan promises more tokens than the pool holds";
    EXPECT_GE(static_cast<double>(plan.kv_tokens_fit),
              static_cast<double>(engine_tokens) - 1.005 * reserve_tokens)
        << "the printed plan falls short by more than its " << as_printed.workspace_gib
        << " GiB reserve";
  } else {
    std::printf(
        "%s: %.2f GiB in use on the device before the decoder; the as-printed plan's "
        "tokens are not checked\n",
        name.c_str(), static_cast<double>(in_use_before) / kGiB);
  }
  std::printf(
      "%-24s %s %.1f GiB x %.2f, %.2f GiB in use before | weights plan %.3f GiB, "
      "device %.3f GiB (%+.3f%%) | workspace %.3f GiB | KV/token plan %lld B, device "
      "%lld B | tokens: device %lld, plan %lld (%+.2f%%), plan with the real reserve %lld "
      "(%+.2f%%)\n",
      name.c_str(), r.device_name.c_str(), card_gib, kMemoryFraction,
      static_cast<double>(in_use_before) / kGiB, plan.weight_bytes.total() / kGiB,
      r.weight_bytes / kGiB, 100 * rel_diff(plan.weight_bytes.total(), r.weight_bytes),
      r.workspace_bytes / kGiB, static_cast<long long>(plan.kv_bytes_per_token),
      static_cast<long long>(r.kv_bytes_per_token), static_cast<long long>(engine_tokens),
      static_cast<long long>(plan.kv_tokens_fit), 100 * rel_diff(plan.kv_tokens_fit, engine_tokens),
      static_cast<long long>(plan_shared.kv_tokens_fit),
      100 * rel_diff(plan_shared.kv_tokens_fit, engine_tokens));
}

void plan_matches_the_decoder() {
  {
    auto model = Model::load(kDemo, LoadOptions{.prefault = false});
    const ModelConfig& config = model->config();
    check_model("demo", config, [&](const GpuOptions& options) {
      return GpuDecoder::create(config, model->decoder().weights(), options);
    });
  }
  struct Synthetic {
    const char* name;
    int64_t num_layers;  // 0: all
  };
  for (const Synthetic& s : {Synthetic{"qwen3-30b-a3b", 0}, Synthetic{"deepseek-v3", 4}}) {
    const ModelConfig config = synthetic_model_config(s.name, s.num_layers);
    const std::string label =
        s.num_layers > 0 ? std::string(s.name) + " (" + std::to_string(s.num_layers) + " layers)"
                         : std::string(s.name);
    check_model(label, config, [&](const GpuOptions& options) {
      return GpuDecoder::create_synthetic(config, options, SyntheticGpuOptions{.seed = 1});
    });
  }
  // MLA's fp8 pool: the bytes per token are the planner's exactly.
  const ModelConfig v3 = synthetic_model_config("deepseek-v3", 4);
  check_model(
      "deepseek-v3 (4 layers) fp8", v3,
      [&](const GpuOptions& options) {
        std::unique_ptr<GpuDecoder> decoder =
            GpuDecoder::create_synthetic(v3, options, SyntheticGpuOptions{.seed = 1});
        EXPECT_EQ(decoder->memory().kv_bytes_per_token, kv_bytes_per_token(v3, KvDType::kFP8));
        return decoder;
      },
      KvDType::kFP8);
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("capacity plan")) return false;
  cuda::testing_util::register_kernel_test("CudaCapacityPlan", "PlanMatchesTheDecoderAllocations",
                                           plan_matches_the_decoder, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
