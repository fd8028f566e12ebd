// The persistent decode-layers kernel (GpuOptions::persistent_layers, backend/cuda/
// decode_layers.h) held to the CPU decoder on random models of every family with bf16 weights:
// one sequence's prompt in pieces of 64, then one-token decode steps (the kernel's route, a
// CUDA-graph bucket of one row) at contexts of up to 300 positions, so that the attention takes
// up to five splits and their merge, across KV blocks of 8 to 32 slots. The bounds are the
// random-configuration sweep's (cuda_sweep_test.cpp): relative logit error <= 2e-2 per route,
// no routing mismatch beyond near-ties (the CPU replays the GPU's picks there, which the kernel
// keeps for the routing capture), top-1 agreement >= 99%. The families whose layers the kernel
// takes (Qwen3-MoE and Mixtral) must have run it in some configuration
// (GpuMemoryReport::persistent_layers); the rest run the stage path, which must hold as well.
// MOE_PERSISTENT_SEED=S reruns a draw. Registered only where a CUDA device is visible.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/decode_layers.h"
#include "cuda_test_util.h"
#include "gpu_cpu_compare.h"

namespace moeinfer {
namespace {

constexpr double kMaxRelError = 2e-2;
constexpr double kMinTop1Agreement = 0.99;
// Most configurations of the two families whose layers the kernel takes (a random Qwen3-MoE or
// Mixtral still often has a GQA group past 16, attention biases or dense layers, which take the
// stage path); two of each other family, which run the stage path beside the option.
constexpr int64_t kConfigsOfKernelFamilies = 8;
constexpr int64_t kConfigsOfOtherFamilies = 2;
constexpr int64_t kLongestPrompt = 300;
constexpr int64_t kDecodes = 8;
constexpr int64_t kPiece = 64;

void persistent_layers_match_the_cpu() {
  const char* replay = std::getenv("MOE_PERSISTENT_SEED");
  const uint64_t base =
      replay ? std::strtoull(replay, nullptr, 10) : cuda::testing_util::fresh_seed();
  std::printf("persistent layers: seed %llu (MOE_PERSISTENT_SEED reruns it)\n",
              static_cast<unsigned long long>(base));
  int64_t positions = 0, same_top1 = 0, ran = 0, decode_rows = 0;
  int i = 0;
  for (const ModelFamily family : testing::kAllFamilies) {
    const bool kernel_family = family == ModelFamily::kQwen3Moe || family == ModelFamily::kMixtral;
    const int64_t configs = kernel_family ? kConfigsOfKernelFamilies : kConfigsOfOtherFamilies;
    for (int64_t n = 0; n < configs; ++n, ++i) {
      const uint64_t seed = base + static_cast<uint64_t>(i);
      const testing::RandomModel model =
          testing::make_random_model(family, seed, {{"torch_dtype", "bfloat16"}});
      std::mt19937_64 rng(seed ^ 0x7e55);
      const int64_t longest =
          std::min(kLongestPrompt, model.config.max_position_embeddings - kDecodes);
      const int64_t prompt = std::uniform_int_distribution<int64_t>(1, longest)(rng);
      const int64_t block_size = std::vector<int64_t>{8, 16, 32}[rng() % 3];
      const testing::Schedule schedule = testing::make_lone_schedule(
          model.config.vocab_size, seed, block_size, prompt, kDecodes, kPiece);
      const int64_t max_model_len = std::max<int64_t>(64, prompt + kDecodes);
      // The pool holds at least one sequence of max_model_len (the decoder's own floor), more
      // than a short prompt's schedule uses.
      const int64_t num_kv_blocks =
          std::max(schedule.num_blocks, (max_model_len + block_size - 1) / block_size);
      GpuOptions options{.max_batch_tokens = kPiece,
                         .max_num_seqs = 4,
                         .max_model_len = max_model_len,
                         .block_size = block_size,
                         .num_kv_blocks = num_kv_blocks,
                         .quiet = true};
      options.persistent_layers = true;
      const testing::ConfigResult r =
          testing::compare_on_schedule(model.config, model.weights, schedule, options);
      const int64_t persistent = r.persistent_layers;
      if (persistent == 0) {
        std::printf("  %s seed %llu: stage path (%s)\n", std::string(family_name(family)).c_str(),
                    static_cast<unsigned long long>(seed), r.persistent_refusal.c_str());
      }
      positions += r.positions;
      same_top1 += r.same_top1;
      if (persistent > 0) {
        ++ran;
        decode_rows += kDecodes;
      }
      const bool ok = r.worst() <= kMaxRelError && r.routing_mismatches == 0;
      EXPECT_TRUE(ok) << family_name(family) << " seed " << seed << " (prompt " << prompt << ", "
                      << persistent << " persistent layers): rel error prefill "
                      << r.routes[0].rel() << " chunked " << r.routes[1].rel() << " decode "
                      << r.routes[2].rel() << " (bound " << kMaxRelError << "), top-1 "
                      << r.same_top1 << "/" << r.positions << ", routing mismatches "
                      << r.routing_mismatches << " (" << r.first_mismatch << ")\n  config "
                      << model.config_json;
    }
  }
  const double agreement = positions > 0 ? static_cast<double>(same_top1) / positions : 0.0;
  std::printf(
      "persistent layers: %lld of %lld configurations ran the kernel (%lld decode rows); top-1 "
      "%lld/%lld = %.4f\n",
      static_cast<long long>(ran), static_cast<long long>(i), static_cast<long long>(decode_rows),
      static_cast<long long>(same_top1), static_cast<long long>(positions), agreement);
  EXPECT_GT(ran, 0) << "no configuration ran the persistent kernel";
  EXPECT_GE(agreement, kMinTop1Agreement);
}

// The launcher refuses what the kernel does not take before it touches the device, naming the
// value (so this runs without a GPU).
TEST(CudaDecodeLayersChecks, RefuseBadShapes) {
  const cuda::DecodeLayersParams good{.num_layers = 1,
                                      .hidden_size = 64,
                                      .norm_width = 64,
                                      .num_q_heads = 8,
                                      .num_kv_heads = 2,
                                      .head_dim = 64,
                                      .padded_head_dim = 64,
                                      .rotary_dim = 64,
                                      .block_size = 16,
                                      .num_cache_blocks = 4,
                                      .max_blocks_per_seq = 4,
                                      .num_experts = 8,
                                      .top_k = 2,
                                      .expert_width = 32};
  auto refused = [&](auto change, const std::string& named) {
    cuda::DecodeLayersParams p = good;
    change(p);
    cuda::testing_util::expect_error_naming([&] { cuda::decode_layers(p, nullptr); }, named);
  };
  refused([](auto& p) { p.num_kv_heads = 3; }, "num_kv_heads = 3");
  refused([](auto& p) { p.num_q_heads = 34, p.num_kv_heads = 2; }, "17 query heads a KV head");
  refused([](auto& p) { p.head_dim = 320, p.padded_head_dim = 320; }, "padded to 320");
  refused([](auto& p) { p.rotary_dim = 63; }, "rotary_dim = 63");
  refused([](auto& p) { p.hidden_size = 8200, p.norm_width = 8200; }, "hidden_size = 8200");
  refused([](auto& p) { p.expert_width = 36; }, "expert_width = 36");
  refused([](auto& p) { p.top_k = 9, p.num_experts = 8; }, "top_k = 9");
  refused([](auto& p) { p.block_size = 0; }, "block_size = 0");
  // Every shape right: the first missing pointer is named.
  refused([](auto&) {}, "layers is null");
}

// The grid barrier's word: whatever order the blocks arrive in, its top bit flips only with the
// last arrival, and its low bits are back at zero for the next barrier (the kernel never resets
// it), over many barriers in a row and grids of 1 to 160 blocks.
TEST(CudaDecodeLayersChecks, BarrierWordFlipsOnTheLastArrivalOnly) {
  std::mt19937 rng(7);
  for (const uint32_t blocks : {1u, 2u, 3u, 78u, 132u, 160u}) {
    std::vector<uint32_t> order(blocks);
    std::iota(order.begin(), order.end(), 0u);
    uint32_t word = 0;
    for (int barrier = 0; barrier < 5; ++barrier) {
      std::shuffle(order.begin(), order.end(), rng);
      const uint32_t start = word;
      for (uint32_t i = 0; i < blocks; ++i) {
        const uint32_t before = word;
        word += cuda::decode_layers_barrier_add(order[i], blocks);
        EXPECT_EQ(before & cuda::kDecodeLayersBarrierFlip, start & cuda::kDecodeLayersBarrierFlip)
            << blocks << " blocks, barrier " << barrier << ": flipped before arrival " << i;
      }
      EXPECT_NE(word & cuda::kDecodeLayersBarrierFlip, start & cuda::kDecodeLayersBarrierFlip)
          << blocks << " blocks, barrier " << barrier << ": no flip after every arrival";
      EXPECT_EQ(word & ~cuda::kDecodeLayersBarrierFlip, 0u) << blocks << " blocks";
    }
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("persistent layers")) return false;
  cuda::testing_util::register_kernel_test("CudaPersistentLayers", "RandomModelsMatchTheCpu",
                                           persistent_layers_match_the_cpu, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
