// The decode RMSNorm folded into the skinny GEMM (SkinnyGemmParams::norm,
// backend/cuda/skinny_gemm.h) against the two launches it replaces: fused_add_rms_norm, then the
// skinny GEMM over its output. The folded kernel repeats the norm's float32 operations in the norm
// kernel's order, so:
//   - the product, the normed rows (norm.out) and the residual sum (residual_out) are the same
//     bits as the two launches', every value of them written (outputs poisoned first);
//   - over the norm kernel's layouts (rms_norm_layout: 32 to 1024 threads, 1, 2 or 4 vectors a
//     thread; more of them than the GEMM's 256 threads), 1 to 8 rows, the terms given or not
//     (residual alone, as the first layer has; a bias; a weight's lo term; a mean over fewer
//     columns than the row), one and two weight terms, float32 and bf16 outputs;
//   - two folded products in a row captured in a CUDA graph, the second reading the first's
//     residual sum and writing its own over the first's input (the ping-pong a decoder does),
//     replayed after new inputs: the same bits as the four launches run directly.
// The host-side refusals run without a device too.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <random>
#include <string>
#include <vector>

#include "backend/cuda/moe_stages.h"
#include "backend/cuda/skinny_gemm.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaSkinnyNormedChecks, RefusesWhatItDoesNotTake) {
  alignas(16) static float rows[2 * 64] = {};
  alignas(16) static uint16_t buf[4 * 64] = {};
  const auto* bits = reinterpret_cast<const __nv_bfloat16*>(buf);
  const SkinnyGemmParams p{.w = bits,
                           .y = buf,
                           .m = 2,
                           .n = 4,
                           .k = 64,
                           .norm = {.residual = rows,
                                    .residual_out = rows + 64,
                                    .weight = bits,
                                    .num_rows = 2,
                                    .hidden_size = 64}};
  SkinnyGemmParams q = p;
  q.norm.residual_out = nullptr;
  EXPECT_TRUE(skinny_gemm_supports(q));
  // residual_out's rows start inside residual's.
  expect_error_naming([&] { skinny_gemm(p, nullptr); }, "overlaps norm.residual");
  q.x = bits;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "x given with the folded norm");
  q = p;
  q.norm.residual_out = nullptr;
  q.norm.residual = nullptr;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "both null");
  q = p;
  q.norm.residual_out = nullptr;
  q.norm.mean_width = 65;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "mean_width");
  q = p;
  q.norm.residual_out = nullptr;
  q.norm.residual = rows + 1;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "16-byte aligned");
  q = p;
  q.norm.residual_out = nullptr;
  q.m = q.norm.num_rows = 8;
  q.k = q.norm.hidden_size = 2952;  // 8 x 2952 bf16 values: over 46 KiB of shared rows
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "46 KiB");
  q = p;
  q.norm.residual_out = nullptr;
  q.norm.num_rows = 3;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "not m, k");
  const QuantSkinnyGemmParams quant{.w = reinterpret_cast<const uint8_t*>(buf),
                                    .format = ExpertQuant::kFp8,
                                    .group = 32,
                                    .y = buf,
                                    .m = 1,
                                    .n = 4,
                                    .k = 64,
                                    .norm = {.weight = bits, .num_rows = 1, .hidden_size = 64}};
  expect_error_naming([&] { quant_skinny_gemm(quant, nullptr); }, "both null");
}

std::vector<float> random_floats(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (float& v : out) v = dist(rng);
  return out;
}

struct Case {
  int64_t m, n, k;
  bool add = true, residual = true, bias = false, norm_lo = false;
  int64_t mean_width = 0;
  bool two_terms = false, f32 = true;
};

std::string name_of(const Case& c) {
  return "M" + std::to_string(c.m) + "_N" + std::to_string(c.n) + "_K" + std::to_string(c.k) +
         (c.add ? "_Add" : "") + (c.residual ? "_Residual" : "") + (c.bias ? "_Bias" : "") +
         (c.norm_lo ? "_NormLo" : "") +
         (c.mean_width ? "_Mean" + std::to_string(c.mean_width) : "") +
         (c.two_terms ? "_TwoTerms" : "") + (c.f32 ? "_F32" : "_Bf16");
}

// A random instance of a case: the norm's inputs and the weights, on the device.
struct Inputs {
  DeviceBuffer<float> residual, add;
  DeviceBuffer<uint16_t> bias, weight, weight_lo, w, w_lo;
  Inputs(const Case& c, std::mt19937& rng)
      : residual(random_floats(c.m * c.k, rng, 1.0f)),
        add(random_floats(c.m * c.k, rng, 0.5f)),
        bias(random_bf16(c.k, rng, 0.1f)),
        weight(random_bf16(c.k, rng, 1.0f)),
        weight_lo(random_bf16(c.k, rng, 1.0f / 256)),
        w(random_bf16(c.n * c.k, rng, 1.0f / std::sqrt(static_cast<float>(c.k)))),
        w_lo(random_bf16(c.n * c.k, rng, 1.0f / 256 / std::sqrt(static_cast<float>(c.k)))) {}

  RmsNormParams norm(const Case& c, float* residual_out, __nv_bfloat16* out) const {
    return {.x = c.add ? add.get() : nullptr,
            .x_bias = c.bias ? bias.as_bf16() : nullptr,
            .residual = c.residual ? residual.get() : nullptr,
            .residual_out = residual_out,
            .weight = weight.as_bf16(),
            .weight_lo = c.norm_lo ? weight_lo.as_bf16() : nullptr,
            .out = out,
            .num_rows = c.m,
            .hidden_size = c.k,
            .eps = 1e-6f,
            .mean_width = c.mean_width};
  }
  SkinnyGemmParams product(const Case& c, const __nv_bfloat16* x, void* y) const {
    return {.x = x,
            .w = w.as_bf16(),
            .w_lo = c.two_terms ? w_lo.as_bf16() : nullptr,
            .y = y,
            .m = c.m,
            .n = c.n,
            .k = c.k,
            .y_f32 = c.f32};
  }
};

void run_case(const Case& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.m * 131 + c.n * 7 + c.k));
  const Inputs in(c, rng);
  const size_t y_bytes = static_cast<size_t>(c.m * c.n) * (c.f32 ? 4 : 2);
  DeviceBuffer<float> sum_want(c.m * c.k), sum_got(c.m * c.k);
  DeviceBuffer<uint16_t> normed_want(c.m * c.k), normed_got(c.m * c.k);
  DeviceBuffer<char> y_want(y_bytes), y_got(y_bytes);
  for (auto* b : {&sum_want, &sum_got}) b->poison();
  for (auto* b : {&normed_want, &normed_got}) b->poison();
  y_want.poison();
  y_got.poison();

  fused_add_rms_norm(in.norm(c, sum_want.get(), normed_want.as_bf16()), nullptr);
  skinny_gemm(in.product(c, normed_want.as_bf16(), y_want.get()), nullptr);
  SkinnyGemmParams folded = in.product(c, nullptr, y_got.get());
  folded.norm = in.norm(c, sum_got.get(), normed_got.as_bf16());
  ASSERT_TRUE(skinny_gemm_supports(folded));
  skinny_gemm(folded, nullptr);
  synchronize();
  EXPECT_EQ(y_got.download(), y_want.download()) << name_of(c) << ": the products differ";
  EXPECT_EQ(normed_got.download(), normed_want.download()) << name_of(c) << ": norm.out";
  EXPECT_EQ(sum_got.download(), sum_want.download()) << name_of(c) << ": residual_out";
}

// Two layers' worth: norm(residual + add) . W1 -> y1 (n = k), then norm(sum1 + y1) . W2 -> y2
// with the second sum written over the first's residual input, captured in a graph (the second
// a programmatic dependent of the first) and replayed after new inputs, against the four
// launches run directly.
void graph_chains_two_folded_products() {
  std::mt19937 rng(fresh_seed());
  const Case c{.m = 1, .n = 2048, .k = 2048};
  const Inputs in(c, rng);
  DeviceBuffer<uint16_t> w2(random_bf16(c.n * c.k, rng, 0.02f));
  DeviceBuffer<float> sum1(c.m * c.k), y1(c.m * c.n), y2(c.m * c.n), y2_want(c.m * c.n);
  DeviceBuffer<float> residual_want(c.m * c.k), sum1_want(c.m * c.k), y1_want(c.m * c.n);
  DeviceBuffer<uint16_t> normed(c.m * c.k);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto enqueue_folded = [&] {
    SkinnyGemmParams first = in.product(c, nullptr, y1.get());
    first.norm = in.norm(c, sum1.get(), nullptr);
    skinny_gemm(first, stream);
    SkinnyGemmParams second = first;
    second.w = w2.as_bf16();
    second.y = y2.get();
    second.norm.residual = sum1.get();
    second.norm.x = y1.get();
    second.norm.residual_out = in.residual.get();  // the first's input, read by it alone
    skinny_gemm(second, stream);
  };
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue_folded();
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    const std::vector<float> residual = random_floats(c.m * c.k, rng, 1.0f);
    const std::vector<float> add = random_floats(c.m * c.k, rng, 0.5f);
    auto upload = [&](float* to, const std::vector<float>& from) {
      CUDA_CHECK(cudaMemcpyAsync(to, from.data(), from.size() * sizeof(float),
                                 cudaMemcpyHostToDevice, stream));
    };
    // The reference: the norm and the product of each layer apart, in place.
    upload(residual_want.get(), residual);
    upload(in.add.get(), add);
    RmsNormParams norm = in.norm(c, sum1_want.get(), normed.as_bf16());
    norm.residual = residual_want.get();
    fused_add_rms_norm(norm, stream);
    skinny_gemm(in.product(c, normed.as_bf16(), y1_want.get()), stream);
    norm.residual = sum1_want.get();
    norm.x = y1_want.get();
    norm.residual_out = residual_want.get();
    fused_add_rms_norm(norm, stream);
    SkinnyGemmParams second = in.product(c, normed.as_bf16(), y2_want.get());
    second.w = w2.as_bf16();
    skinny_gemm(second, stream);

    upload(in.residual.get(), residual);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(y2.download(), y2_want.download()) << "replay " << replay << ": the second product";
    EXPECT_EQ(in.residual.download(), residual_want.download())
        << "replay " << replay << ": the second residual sum";
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("skinny GEMM with the folded norm")) return false;
  const std::vector<Case> cases = {
      {.m = 1, .n = 5120, .k = 2048},                                    // Qwen3-30B-A3B's QKV
      {.m = 1, .n = 5120, .k = 2048, .add = false},                      // its first layer
      {.m = 1, .n = 128, .k = 2048, .bias = true},                       // a router, O's bias
      {.m = 3, .n = 300, .k = 4096, .f32 = false},                       // 512 norm threads
      {.m = 8, .n = 77, .k = 2944, .two_terms = true},                   // 46 KiB of rows
      {.m = 2, .n = 129, .k = 264, .norm_lo = true, .mean_width = 260},  // 64 norm threads
      {.m = 1, .n = 1, .k = 8},                                          // one vector
      {.m = 1, .n = 40, .k = 16384, .f32 = false},                       // 2 vectors a thread
      {.m = 1, .n = 8, .k = 23552, .residual = false},                   // 4 vectors, 736 threads
      {.m = 5, .n = 1000, .k = 1024, .bias = true, .two_terms = true, .f32 = false},
  };
  for (const Case& c : cases) {
    register_kernel_test(
        "CudaSkinnyNormed", name_of(c), [c] { run_case(c); }, __FILE__, __LINE__);
  }
  register_kernel_test("CudaSkinnyNormed", "GraphChainsTwoFoldedProducts",
                       graph_chains_two_folded_products, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
