// The skinny GEMM of decode's dense projections (backend/cuda/skinny_gemm.h) against a float64
// CPU reference on fresh random inputs, outputs poisoned first:
//   - M from 1 to 8 rows; N from 1 to 5120 (a partial last block, a warp with one column);
//     K from 8 to 2056 (one vector a lane or several, a tail short of a warp's stride); row
//     strides of x and y wider than the matrices; float32 and bf16 outputs; one and two weight
//     terms (w + w_lo, a float32 checkpoint's);
//   - float32 outputs within 1e-4 of the natural scale (the root of the sum of the squared
//     products: a float32 accumulation of K bf16 products), bf16 within the bf16 contract;
//   - the columns of y past N and the rows past M are not written;
//   - captured in a CUDA graph after another kernel (as a programmatic dependent of it) and
//     replayed after new x: the new products.
// The host-side refusals run without a device too.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/skinny_gemm.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaSkinnyGemmChecks, RefusesWhatItDoesNotTake) {
  alignas(16) uint16_t buf[128] = {};
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(buf);
  const SkinnyGemmParams p{.x = in, .w = in, .y = buf, .m = 2, .n = 4, .k = 16};
  EXPECT_TRUE(skinny_gemm_supports(p));
  SkinnyGemmParams q = p;
  q.m = 9;
  EXPECT_FALSE(skinny_gemm_supports(q));
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "m outside [1, 8]");
  q = p;
  q.k = 12;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "k not a positive multiple of 8");
  q = p;
  q.ldx = 20;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "ldx");
  q = p;
  q.x = in + 1;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "16-byte aligned");
  q = p;
  q.ldy = 3;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "ldy < n");
  q = p;
  q.y = nullptr;
  expect_error_naming([&] { skinny_gemm(q, nullptr); }, "y null");
}

struct Case {
  int64_t m, n, k;
  int64_t x_pad = 0, y_pad = 0;  // row strides k + x_pad, n + y_pad
  bool f32 = true;
  bool two_terms = false;
};

std::string name_of(const Case& c) {
  return "M" + std::to_string(c.m) + "_N" + std::to_string(c.n) + "_K" + std::to_string(c.k) +
         (c.x_pad || c.y_pad ? "_Strided" : "") + (c.f32 ? "_F32" : "_Bf16") +
         (c.two_terms ? "_TwoTerms" : "");
}

void run_case(const Case& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.m * 131 + c.n * 7 + c.k));
  const int64_t ldx = c.k + c.x_pad, ldy = c.n + c.y_pad;
  // One row of y past M, to see it untouched.
  const int64_t y_rows = c.m + 1;
  const auto x_bits = random_bf16(static_cast<size_t>(c.m * ldx), rng);
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(c.k));
  const auto w_bits = random_bf16(static_cast<size_t>(c.n * c.k), rng, w_scale);
  const auto lo_bits = c.two_terms ? random_bf16(static_cast<size_t>(c.n * c.k), rng, w_scale / 256)
                                   : std::vector<uint16_t>(8);
  const DeviceBuffer<uint16_t> x(x_bits), w(w_bits), w_lo(lo_bits);
  const std::vector<float> xf = to_float(x_bits), wf = to_float(w_bits), lof = to_float(lo_bits);
  std::vector<double> want(static_cast<size_t>(c.m * c.n)), scale(want.size());
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.n; ++col) {
      double sum = 0, sum2 = 0;
      for (int64_t i = 0; i < c.k; ++i) {
        double wv = wf[col * c.k + i];
        if (c.two_terms) wv += lof[col * c.k + i];
        const double term = double{xf[r * ldx + i]} * wv;
        sum += term;
        sum2 += term * term;
      }
      want[r * c.n + col] = sum;
      scale[r * c.n + col] = std::sqrt(sum2);
    }
  }
  const SkinnyGemmParams p{.x = x.as_bf16(),
                           .w = w.as_bf16(),
                           .w_lo = c.two_terms ? w_lo.as_bf16() : nullptr,
                           .m = c.m,
                           .n = c.n,
                           .k = c.k,
                           .ldx = ldx,
                           .ldy = ldy,
                           .y_f32 = c.f32};
  if (c.f32) {
    DeviceBuffer<float> y(static_cast<size_t>(y_rows * ldy));
    y.poison();
    SkinnyGemmParams run = p;
    run.y = y.get();
    skinny_gemm(run, nullptr);
    synchronize();
    const std::vector<float> all = y.download();
    std::vector<float> got(want.size());
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t col = 0; col < c.n; ++col) got[r * c.n + col] = all[r * ldy + col];
      for (int64_t col = c.n; col < ldy; ++col) {
        ASSERT_TRUE(std::isnan(all[r * ldy + col])) << "row " << r << " stride column " << col;
      }
    }
    for (int64_t col = 0; col < ldy; ++col) {
      ASSERT_TRUE(std::isnan(all[c.m * ldy + col])) << "the row past M, column " << col;
    }
    expect_within(
        got, want, [&](size_t i) { return 1e-4 * scale[i] + 1e-30; }, name_of(c).c_str());
  } else {
    DeviceBuffer<uint16_t> y(static_cast<size_t>(y_rows * ldy));
    y.poison();
    SkinnyGemmParams run = p;
    run.y = y.get();
    skinny_gemm(run, nullptr);
    synchronize();
    const std::vector<uint16_t> all = y.download();
    std::vector<uint16_t> got(want.size());
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t col = 0; col < c.n; ++col) got[r * c.n + col] = all[r * ldy + col];
      for (int64_t col = c.n; col < ldy; ++col) {
        ASSERT_EQ(all[r * ldy + col], 0xFFFF) << "row " << r << " stride column " << col;
      }
    }
    expect_bf16_near(got, want, scale, name_of(c).c_str());
  }
}

// Captured after a kernel that writes x (a memset node would keep a plain edge, so the writer
// is a kernel: a skinny GEMM of its own), replayed after x changes.
void graph_replays_with_new_inputs() {
  std::mt19937 rng(fresh_seed());
  constexpr int64_t kM = 3, kN = 300, kK = 512;
  DeviceBuffer<uint16_t> x0(random_bf16(kM * kK, rng));
  const DeviceBuffer<uint16_t> w0(random_bf16(kK * kK, rng, 0.05f));
  const DeviceBuffer<uint16_t> w1(random_bf16(kN * kK, rng, 0.05f));
  DeviceBuffer<uint16_t> x1(kM * kK);  // written by the first product
  DeviceBuffer<float> y(kM * kN), y_direct(kM * kN);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const SkinnyGemmParams first{
      .x = x0.as_bf16(), .w = w0.as_bf16(), .y = x1.get(), .m = kM, .n = kK, .k = kK};
  const SkinnyGemmParams second{
      .x = x1.as_bf16(), .w = w1.as_bf16(), .y = y.get(), .m = kM, .n = kN, .k = kK, .y_f32 = true};
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  skinny_gemm(first, stream);
  skinny_gemm(second, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    const auto bits = random_bf16(kM * kK, rng);
    CUDA_CHECK(
        cudaMemcpyAsync(x0.get(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    // The same two products launched directly, in order, as the reference.
    skinny_gemm(first, stream);
    SkinnyGemmParams direct = second;
    direct.y = y_direct.get();
    skinny_gemm(direct, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(y.download(), y_direct.download()) << "replay " << replay;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("skinny GEMM")) return false;
  std::vector<Case> cases;
  for (const int64_t m : {1, 2, 3, 4, 5, 6, 7, 8}) {
    cases.push_back({.m = m, .n = 5120, .k = 2048});              // Qwen3-30B-A3B's QKV
    cases.push_back({.m = m, .n = 129, .k = 264, .f32 = false});  // a partial block and warp
    cases.push_back({.m = m, .n = 33, .k = 1024, .two_terms = true});
  }
  cases.push_back({.m = 1, .n = 1, .k = 8});
  cases.push_back({.m = 8, .n = 17, .k = 2056, .x_pad = 24, .y_pad = 5});
  cases.push_back({.m = 4, .n = 2048, .k = 4096, .x_pad = 8, .y_pad = 3, .f32 = false});
  cases.push_back({.m = 8, .n = 640, .k = 768, .f32 = false, .two_terms = true});
  for (const Case& c : cases) {
    register_kernel_test(
        "CudaSkinnyGemm", name_of(c), [c] { run_case(c); }, __FILE__, __LINE__);
  }
  register_kernel_test("CudaSkinnyGemm", "GraphReplaysWithNewInputs", graph_replays_with_new_inputs,
                       __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif
