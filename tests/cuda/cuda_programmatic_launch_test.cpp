// Programmatic dependent launch (GpuOptions::programmatic_launch, backend/cuda/
// programmatic_launch.h) changes when kernels start, never what they compute: for a random model
// of every family, the scripted steps of tests/support/random_schedule.h (prompts prefilled
// together, a chunk beside decode steps, graph-captured decode buckets with padding rows) give
// bit-identical logits on a decoder with it and one without, each over its own KV pool, in the
// default and the --deterministic kernels. A kernel that read its predecessor's output before
// waiting for it would show here as a differing row. Registered only where a CUDA device is
// visible; its seed is printed (MOE_PDL_SEED=S replays).
// The same holds for the decode norms folded into the projections after them
// (GpuOptions::fold_norms, backend/cuda/skinny_gemm.h's SkinnyGemmParams::norm), which repeat the
// norm kernel's operations in its order: CudaFoldNorms.SameLogitsWithAndWithout runs the same
// comparison with the fold on and off, with the skinny GEMM taking steps of up to 8 rows (the
// default is 1) so that the decode steps of two and three sequences and the short prompts fold,
// and a prompt step of more rows may follow a folded one (whose folds leave the residual
// stream on the spare buffer's few rows until the next step starts).
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../support/random_model.h"
#include "../support/random_schedule.h"
#include "cuda_test_util.h"
#include "model/gpu_decoder.h"

namespace moeinfer {
namespace {

// The option a comparison turns off in its second decoder.
using Switch = bool GpuOptions::*;

std::unique_ptr<GpuDecoder> make_decoder(const testing::RandomModel& m, const testing::Schedule& s,
                                         int64_t block_size, Switch option, bool on,
                                         bool deterministic, int64_t skinny_gemm_rows) {
  GpuOptions options{.max_batch_tokens = 64,
                     .max_num_seqs = 4,
                     .max_model_len = 64,
                     .block_size = block_size,
                     .num_kv_blocks = s.num_blocks,
                     .cuda_graphs = true,
                     .quiet = true,
                     .deterministic = deterministic,
                     .skinny_gemm_rows = deterministic ? -1 : skinny_gemm_rows};
  options.*option = on;
  return GpuDecoder::create(m.config, m.weights, options);
}

// The number of logits rows compared, and a description of the first that differed ("" if none).
struct Comparison {
  int64_t rows = 0;
  std::string first_difference;
};

Comparison compare_schedule(const testing::RandomModel& m, uint64_t seed, Switch option,
                            bool deterministic, int64_t skinny_gemm_rows) {
  const int64_t V = m.config.vocab_size;
  const int64_t block_size = 16;
  const testing::Schedule s = testing::make_schedule(V, seed, block_size);
  auto with = make_decoder(m, s, block_size, option, /*on=*/true, deterministic, skinny_gemm_rows);
  auto without =
      make_decoder(m, s, block_size, option, /*on=*/false, deterministic, skinny_gemm_rows);
  Comparison result;
  // Twice through the steps' shapes is not possible (the KV positions move on), but every decode
  // bucket replays its graph from its second step on, and the two decoders alternate, so each
  // step runs after the other decoder switched the process-wide setting.
  for (const testing::ScheduledStep& step : s.steps) {
    const size_t n = static_cast<size_t>(Decoder::num_logit_rows(step.batch) * V);
    std::vector<float> a(n, NAN), b(n, NAN);
    with->forward(step.batch, a);
    without->forward(step.batch, b);
    testing::for_each_logit_row(step, [&](int64_t row, int sequence, int64_t position) {
      ++result.rows;
      const float* x = &a[static_cast<size_t>(row * V)];
      const float* y = &b[static_cast<size_t>(row * V)];
      if (!result.first_difference.empty() ||
          std::memcmp(x, y, static_cast<size_t>(V) * sizeof(float)) == 0) {
        return;
      }
      int64_t i = 0;
      while (std::memcmp(&x[i], &y[i], sizeof(float)) == 0) ++i;
      result.first_difference = std::string(testing::route_name(step.route)) + " step, sequence " +
                                std::to_string(sequence) + " position " +
                                std::to_string(position) + ": logit " + std::to_string(i) + " is " +
                                std::to_string(x[i]) + " with, " + std::to_string(y[i]) +
                                " without";
    });
  }
  return result;
}

// Every family's random model, with and without `option` (named `what`), in the default and the
// --deterministic kernels; skinny_gemm_rows: GpuOptions' (-1: its default).
void same_logits_with_and_without(Switch option, const char* what, int64_t skinny_gemm_rows) {
  const char* replay = std::getenv("MOE_PDL_SEED");
  const uint64_t base =
      replay ? std::strtoull(replay, nullptr, 10) : cuda::testing_util::fresh_seed();
  std::printf("%s: seed %llu (MOE_PDL_SEED reruns it)\n", what,
              static_cast<unsigned long long>(base));
  int64_t rows = 0;
  int i = 0;
  for (const ModelFamily family : testing::kAllFamilies) {
    const uint64_t seed = base + static_cast<uint64_t>(i++);
    const testing::RandomModel model = testing::make_random_model(family, seed);
    for (const bool deterministic : {false, true}) {
      const Comparison c =
          compare_schedule(model, seed ^ 0x9d1, option, deterministic, skinny_gemm_rows);
      rows += c.rows;
      EXPECT_GT(c.rows, 0);
      EXPECT_TRUE(c.first_difference.empty())
          << family_name(family) << " seed " << seed
          << (deterministic ? " (--deterministic)" : "") << ": " << c.first_difference
          << "\n  config " << model.config_json;
    }
  }
  std::printf("%s: %lld logits rows compared\n", what, static_cast<long long>(rows));
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("programmatic launch")) return false;
  cuda::testing_util::register_kernel_test(
      "CudaProgrammaticLaunch", "SameLogitsWithAndWithout",
      [] {
        same_logits_with_and_without(&GpuOptions::programmatic_launch, "programmatic launch", -1);
      },
      __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test(
      "CudaFoldNorms", "SameLogitsWithAndWithout",
      [] { same_logits_with_and_without(&GpuOptions::fold_norms, "folded norms", 8); }, __FILE__,
      __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
