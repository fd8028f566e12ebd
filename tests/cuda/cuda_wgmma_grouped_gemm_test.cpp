// The Hopper grouped GEMM (GemmTile::kHopperWgmma, grouped_gemm_wgmma_kernel.cuh) against a
// float64 CPU reference on fresh random inputs, outputs poisoned first (0xFF bytes, NaN in bf16)
// so every unwritten element fails and rows past offsets[E] must stay poisoned. Cases: uneven
// experts with empty ones and one of a single row, row counts that are not multiples of 64 or
// 128, one expert of fewer rows than a tile, every epilogue (kNone, kSiluMul, kClampedSwiglu)
// with and without a float32 bias, Kd from 64 to 2048, N from 64 to 1536 (and 96, gated), which
// selects each of the three weight-tile widths, E from 1 to 128. At the Qwen3-30B-A3B prefill
// shape (too large for the CPU) it is compared with the mma.sync kRows128Wide kernel, which the
// CPU reference verifies in cuda_grouped_gemm_test.cpp. A CUDA graph captured once is replayed
// after expert_offsets changes in device memory. The launcher's refusals run without a GPU.
//
// Tolerance: the bf16 contract of CONVENTIONS.md, |got - want| <= 1e-2 (|want| + scale), scale
// the output's natural size (cuda_test_util.h). Against the other kernel (both bf16 roundings
// of float32 sums in different orders): |a - b| <= 2e-2 |b| + 1e-2 rms(b).
//
// Skipped where the device is not compute capability 9.0 or the build is not for architecture
// 90 (grouped_gemm_wgmma_available).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/grouped_gemm_wgmma.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

constexpr float kAlpha = 1.702f, kLimit = 7.0f;

TEST(CudaWgmmaGroupedGemmChecks, RefusesWhatItDoesNotSupport) {
  alignas(16) uint16_t buf[64] = {};
  int32_t offsets[3] = {0, 1, 2};
  int32_t src_row[2] = {0, 1};
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(buf);
  const __nv_bfloat16* table[2] = {in, in};
  GroupedGemmParams p{.rows = in,
                      .weights = in,
                      .expert_offsets = offsets,
                      .out = reinterpret_cast<__nv_bfloat16*>(buf),
                      .num_rows = 2,
                      .num_experts = 2,
                      .n = 64,
                      .k = 64,
                      .tile = GemmTile::kHopperWgmma};
  GroupedGemmParams q = p;
  q.src_row = src_row;
  expect_error_naming([&] { grouped_gemm(q, nullptr); }, "src_row");
  q = p;
  q.weights = nullptr;
  q.expert_weights = table;
  expect_error_naming([&] { grouped_gemm(q, nullptr); }, "expert_weights");
  q = p;
  q.weight_terms = 2;
  expect_error_naming([&] { grouped_gemm(q, nullptr); }, "two weight terms");
  q = p;
  q.quant = ExpertQuant::kFp8;
  q.quant_group = 128;
  expect_error_naming([&] { grouped_gemm(q, nullptr); }, "quantised");
  q = p;
  q.n = 96;  // plain: a multiple of 64
  expect_error_naming([&] { grouped_gemm(q, nullptr); }, "n not a multiple of 64");
  q.epilogue = GemmEpilogue::kSiluMul;  // gated: 96 = 3 x 32 is fine for the shapes
  EXPECT_EQ(grouped_gemm_wgmma_unsupported(q), nullptr);
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct WgmmaCase {
  std::vector<int32_t> counts;  // rows per expert, E = counts.size()
  int64_t kd = 0;               // reduction dim
  int64_t n = 0;                // output columns
  GemmEpilogue epilogue = GemmEpilogue::kNone;
  bool bias = false;
  int64_t spare_rows = 0;  // rows past offsets[E] that must stay untouched
};

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> offsets(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

// Zipf-skewed counts summing to `rows` (some experts empty at small rows per expert).
std::vector<int32_t> zipf_counts(int64_t rows, int64_t E, std::mt19937& rng) {
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<double> weight(E);
  for (int64_t i = 0; i < E; ++i) weight[order[i]] = 1.0 / std::pow(i + 1.0, 1.1);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> counts(E, 0);
  for (int64_t r = 0; r < rows; ++r) ++counts[pick(rng)];
  return counts;
}

// The CPU's value and natural scale of one output, from the float64 sums of gate (g, g2: sum of
// squared terms) and up (u, u2).
void reference_value(GemmEpilogue epilogue, double g, double g2, double u, double u2, double* want,
                     double* scale) {
  switch (epilogue) {
    case GemmEpilogue::kNone:
      *want = g;
      *scale = std::sqrt(g2);
      return;
    case GemmEpilogue::kSiluMul:
      *want = silu(g) * u;
      *scale = 1.1 * std::sqrt(g2) * std::fabs(u) + std::fabs(silu(g)) * std::sqrt(u2);
      return;
    case GemmEpilogue::kClampedSwiglu: {
      const double gc = std::min(g, static_cast<double>(kLimit));
      const double uc = std::clamp(u, -static_cast<double>(kLimit), static_cast<double>(kLimit));
      const double glu = gc * sigmoid(kAlpha * gc);
      *want = (uc + 1.0) * glu;
      // d/dg is at most (|u| + 1) (1 + alpha |g| / 4); d/du is glu.
      *scale = (std::fabs(uc) + 1.0) * (1.1 + 0.25 * kAlpha * std::fabs(gc)) * std::sqrt(g2) +
               std::fabs(glu) * std::sqrt(u2);
      return;
    }
  }
}

struct Problem {
  std::vector<int32_t> offsets;
  int64_t E = 0, M = 0, used = 0, kd = 0, n = 0, nw = 0;
  std::vector<uint16_t> x_bits, w_bits;
  std::vector<float> bias;
};

// Uniform bf16 values of standard deviation `scale` from splitmix64: the Qwen3-shaped cases need
// 400M weights, too many for std::normal_distribution in a test.
std::vector<uint16_t> fast_random_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> out(n);
  const float half_width = scale * std::sqrt(3.0f);
  uint64_t state = seed;
  for (auto& v : out) {
    state += 0x9e3779b97f4a7c15ull;
    uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float unit = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    v = f32_to_bf16((2.0f * unit - 1.0f) * half_width);
  }
  return out;
}

Problem make_problem(const WgmmaCase& c, std::mt19937& rng, bool fast = false) {
  Problem pr;
  pr.offsets = offsets_of(c.counts);
  pr.E = static_cast<int64_t>(c.counts.size());
  pr.used = pr.offsets.back();
  pr.M = pr.used + c.spare_rows;
  pr.kd = c.kd;
  pr.n = c.n;
  pr.nw = c.epilogue == GemmEpilogue::kNone ? c.n : 2 * c.n;
  pr.x_bits =
      fast ? fast_random_bf16(pr.M * c.kd, rng(), 1.0f) : random_bf16(pr.M * c.kd, rng, 1.0f);
  // Gated: weights of scale 2 / sqrt(Kd), so the clamped SwiGLU's limit is reached now and then.
  const float w_scale =
      (c.epilogue == GemmEpilogue::kNone ? 1.0f : 2.0f) / std::sqrt(static_cast<float>(c.kd));
  pr.w_bits = fast ? fast_random_bf16(pr.E * pr.nw * c.kd, rng(), w_scale)
                   : random_bf16(pr.E * pr.nw * c.kd, rng, w_scale);
  if (c.bias) {
    std::normal_distribution<float> dist(0.0f, 0.5f);
    pr.bias.resize(pr.E * pr.nw);
    for (auto& b : pr.bias) b = dist(rng);
  }
  return pr;
}

GroupedGemmParams params_for(const WgmmaCase& c, const Problem& pr, const DeviceBuffer<uint16_t>& x,
                             const DeviceBuffer<uint16_t>& w, const DeviceBuffer<int32_t>& offsets,
                             const DeviceBuffer<float>& bias, DeviceBuffer<uint16_t>& out,
                             GemmTile tile) {
  return GroupedGemmParams{.rows = x.as_bf16(),
                           .weights = w.as_bf16(),
                           .expert_offsets = offsets.get(),
                           .out = out.as_bf16(),
                           .num_rows = pr.M,
                           .num_experts = pr.E,
                           .n = pr.n,
                           .k = pr.kd,
                           .epilogue = c.epilogue,
                           .bias = c.bias ? bias.get() : nullptr,
                           .swiglu_alpha = kAlpha,
                           .swiglu_limit = kLimit,
                           .tile = tile};
}

// Checks the [used, N] rows of `got` against the CPU for these offsets, and that the rows after
// them are still poisoned.
void check_against_cpu(const WgmmaCase& c, const Problem& pr, const std::vector<int32_t>& offsets,
                       const std::vector<uint16_t>& got) {
  const auto x = to_float(pr.x_bits);
  const auto w = to_float(pr.w_bits);
  const int64_t used = offsets.back();
  const int64_t N = pr.n, Kd = pr.kd;
  const bool gated = c.epilogue != GemmEpilogue::kNone;
  std::vector<double> want(used * N), scale(used * N);
  for (int64_t e = 0; e < pr.E; ++e) {
    const float* we = w.data() + e * pr.nw * Kd;
    const float* be = c.bias ? pr.bias.data() + e * pr.nw : nullptr;
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const float* xr = x.data() + r * Kd;
      for (int64_t col = 0; col < N; ++col) {
        double g = 0, g2 = 0, u = 0, u2 = 0;
        const float* wg = we + col * Kd;
        const float* wu = we + (N + col) * Kd;
        for (int64_t k = 0; k < Kd; ++k) {
          const double t = static_cast<double>(xr[k]) * wg[k];
          g += t;
          g2 += t * t;
          if (gated) {
            const double s = static_cast<double>(xr[k]) * wu[k];
            u += s;
            u2 += s * s;
          }
        }
        if (be != nullptr) {
          g += be[col];
          if (gated) u += be[N + col];
        }
        reference_value(c.epilogue, g, g2, u, u2, &want[r * N + col], &scale[r * N + col]);
      }
    }
  }
  const std::vector<uint16_t> got_used(got.begin(), got.begin() + used * N);
  expect_bf16_near(got_used, want, scale, "wgmma grouped GEMM");
  for (size_t i = used * N; i < got.size(); ++i) {
    if (got[i] != 0xFFFF) {
      ADD_FAILURE() << "row " << i / N << " past offsets[E] = " << used << " was written";
      break;
    }
  }
}

bool skip_unless_available() {
  if (grouped_gemm_wgmma_available()) return false;
  std::fprintf(stderr,
               "skipped: the device is not compute capability 9.0 or the build has no "
               "sm_90a code\n");
  return true;
}

void run_case(const WgmmaCase& c) {
  if (skip_unless_available()) GTEST_SKIP() << "needs sm_90 and a build for architecture 90";
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.kd * 7919 + c.n * 31 + c.counts.size() * 131 +
                                         static_cast<int>(c.epilogue)));
  const Problem pr = make_problem(c, rng);
  DeviceBuffer<uint16_t> d_x(pr.x_bits), d_w(pr.w_bits), d_out(pr.M * pr.n);
  DeviceBuffer<int32_t> d_offsets(pr.offsets);
  DeviceBuffer<float> d_bias(c.bias ? pr.bias : std::vector<float>(1));
  d_out.poison();
  const GroupedGemmParams p =
      params_for(c, pr, d_x, d_w, d_offsets, d_bias, d_out, GemmTile::kHopperWgmma);
  grouped_gemm(p, nullptr);
  synchronize();
  check_against_cpu(c, pr, pr.offsets, d_out.download());
}

// Captured once with one set of offsets, replayed after other offsets are copied into the same
// device buffer (more rows in some experts, none in others): the kernel must follow them.
void run_graph_case(GemmEpilogue epilogue) {
  if (skip_unless_available()) GTEST_SKIP() << "needs sm_90 and a build for architecture 90";
  std::mt19937 rng(fresh_seed() ^ 0x9e3779b9u ^ static_cast<uint32_t>(epilogue));
  // 3057 rows over 16 experts: mean 191, so kAuto takes the Hopper kernel.
  const WgmmaCase c{.counts = {300, 0, 1, 129, 640, 77, 0, 255, 64, 130, 3, 0, 511, 2, 900, 45},
                    .kd = 128,
                    .n = 256,
                    .epilogue = epilogue,
                    .bias = true};
  const int64_t used = std::accumulate(c.counts.begin(), c.counts.end(), int64_t{0});
  const Problem pr = make_problem(c, rng);
  // The second offsets use fewer of the M rows, in other experts.
  const std::vector<int32_t> counts2 = {0, 850, 0, 0, 1, 128, 129, 0, 0, 400, 0, 777, 0, 63, 0, 5};
  const auto offsets2 = offsets_of(counts2);
  ASSERT_LE(offsets2.back(), used);
  DeviceBuffer<uint16_t> d_x(pr.x_bits), d_w(pr.w_bits), d_out(pr.M * pr.n);
  DeviceBuffer<int32_t> d_offsets(pr.offsets);
  DeviceBuffer<float> d_bias(pr.bias);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const GroupedGemmParams p =
      params_for(c, pr, d_x, d_w, d_offsets, d_bias, d_out, GemmTile::kAuto);
  ASSERT_EQ(grouped_gemm_tile(p), GemmTile::kHopperWgmma) << "mean rows " << pr.M / pr.E;
  // One eager launch first (the first launch sets the kernel's shared-memory limit).
  d_out.poison();
  grouped_gemm(p, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  check_against_cpu(c, pr, pr.offsets, d_out.download());

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  grouped_gemm(p, stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 3; ++round) {
    const auto& offsets = round == 1 ? offsets2 : pr.offsets;
    CUDA_CHECK(cudaMemcpyAsync(d_offsets.get(), offsets.data(), offsets.size() * 4,
                               cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemsetAsync(d_out.get(), 0xFF, pr.M * pr.n * 2, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    SCOPED_TRACE(::testing::Message() << "graph replay " << round);
    check_against_cpu(c, pr, offsets, d_out.download());
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// Two kernels' bf16 outputs on the same inputs (two roundings of float32 sums taken in
// different orders): |a - b| <= 2e-2 |b| + 1e-2 rms(b), b the reference kernel's.
void expect_close_to_other_kernel(const DeviceBuffer<uint16_t>& out,
                                  const DeviceBuffer<uint16_t>& reference, const char* what) {
  const auto got = to_float(out.download());
  const auto want = to_float(reference.download());
  double sum2 = 0;
  for (float v : want) sum2 += static_cast<double>(v) * v;
  const double rms = std::sqrt(sum2 / static_cast<double>(want.size()));
  ASSERT_GT(rms, 0.0);
  expect_within(
      got, want, [&](size_t i) { return 2e-2 * std::fabs(want[i]) + 1e-2 * rms; }, what);
}

// Qwen3-30B-A3B's experts at T tokens (E 128, K 8, H 2048, I 768, zipf routing): the gate/up
// projection with SiLU*up and the down projection, against kRows128Wide on the same inputs.
void run_against_mma(int64_t T, bool gate_up) {
  if (skip_unless_available()) GTEST_SKIP() << "needs sm_90 and a build for architecture 90";
  constexpr int64_t kE = 128, kK = 8, kH = 2048, kI = 768;
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 104729 + gate_up));
  const WgmmaCase c{.counts = zipf_counts(T * kK, kE, rng),
                    .kd = gate_up ? kH : kI,
                    .n = gate_up ? kI : kH,
                    .epilogue = gate_up ? GemmEpilogue::kSiluMul : GemmEpilogue::kNone};
  const Problem pr = make_problem(c, rng, /*fast=*/true);
  DeviceBuffer<uint16_t> d_x(pr.x_bits), d_w(pr.w_bits), d_out(pr.M * pr.n), d_ref(pr.M * pr.n);
  DeviceBuffer<int32_t> d_offsets(pr.offsets);
  DeviceBuffer<float> d_bias(std::vector<float>(1));
  d_out.poison();
  d_ref.poison();
  // Forced: at T = 2048 the mean rows (128) are below kAuto's threshold.
  const GroupedGemmParams p =
      params_for(c, pr, d_x, d_w, d_offsets, d_bias, d_out, GemmTile::kHopperWgmma);
  grouped_gemm(p, nullptr);
  GroupedGemmParams ref = p;
  ref.out = d_ref.as_bf16();
  ref.tile = GemmTile::kRows128Wide;
  grouped_gemm(ref, nullptr);
  synchronize();
  expect_close_to_other_kernel(d_out, d_ref,
                               gate_up ? "gate_up vs kRows128Wide" : "down vs kRows128Wide");
}

// The experts stage with the plan's src_row gather (the engine's prefill): kAuto takes the
// Hopper kernel for both products, the gate/up operand gathered into `out` first (moe_experts);
// --deterministic's path (batch_invariant: the mma.sync tiles, gathering in their A-tile load)
// on the same inputs is the reference, within the bound of run_against_mma.
void run_moe_experts_gathered(int64_t T) {
  if (skip_unless_available()) GTEST_SKIP() << "needs sm_90 and a build for architecture 90";
  constexpr int64_t kE = 128, kK = 8, kH = 2048, kI = 768;
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7919));
  const int64_t M = T * kK;
  const std::vector<int32_t> offsets = offsets_of(zipf_counts(M, kE, rng));
  // A random plan: row r of expert order takes assignment src_row[r] = t*K + k.
  std::vector<int32_t> src_row(static_cast<size_t>(M));
  std::iota(src_row.begin(), src_row.end(), 0);
  std::shuffle(src_row.begin(), src_row.end(), rng);
  DeviceBuffer<uint16_t> d_hidden(fast_random_bf16(T * kH, rng(), 1.0f));
  DeviceBuffer<uint16_t> d_gate_up(
      fast_random_bf16(kE * 2 * kI * kH, rng(), 2.0f / std::sqrt(static_cast<float>(kH))));
  DeviceBuffer<uint16_t> d_down(
      fast_random_bf16(kE * kH * kI, rng(), 1.0f / std::sqrt(static_cast<float>(kI))));
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  DeviceBuffer<uint16_t> d_act(M * kI), d_out(M * kH), d_ref(M * kH);
  d_out.poison();
  d_ref.poison();
  MoeExpertsParams p{.rows = d_hidden.as_bf16(),
                     .gate_up = d_gate_up.as_bf16(),
                     .down = d_down.as_bf16(),
                     .expert_offsets = d_offsets.get(),
                     .activation = d_act.as_bf16(),
                     .out = d_out.as_bf16(),
                     .num_rows = M,
                     .num_experts = kE,
                     .hidden_size = kH,
                     .expert_width = kI,
                     .src_row = d_src_row.get(),
                     .top_k = kK};
  moe_experts(p, nullptr);
  MoeExpertsParams ref = p;
  ref.out = d_ref.as_bf16();
  ref.batch_invariant = true;
  moe_experts(ref, nullptr);
  synchronize();
  expect_close_to_other_kernel(d_out, d_ref,
                               "moe_experts gathered for wgmma vs the mma.sync gather");
}

const char* epilogue_name(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kNone:
      return "Plain";
    case GemmEpilogue::kSiluMul:
      return "SiluMul";
    case GemmEpilogue::kClampedSwiglu:
      return "ClampedSwiglu";
  }
  return "?";
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("Hopper grouped GEMM")) return false;
  struct Shape {
    const char* name;
    std::vector<int32_t> counts;
    int64_t kd, n;
  };
  std::mt19937 shape_rng(20261206);
  const std::vector<Shape> shapes = {
      // Empty experts, one of a single row, counts not multiples of 64 or 128, one over 4 tiles.
      {"Uneven_E8_Kd192_N320", {0, 1, 300, 0, 129, 64, 0, 517}, 192, 320},
      // One expert of fewer rows than a tile (and than the TMA box).
      {"E1_Rows77_Kd64_N64", {77}, 64, 64},
      {"E1_Rows1000_Kd768_N128", {1000}, 768, 128},
      {"E3_Kd2048_N64", {250, 0, 131}, 2048, 64},
      {"E5_Kd64_N1536", {1, 190, 0, 257, 66}, 64, 1536},
      {"E60_Zipf_Kd128_N256", zipf_counts(3000, 60, shape_rng), 128, 256},
      {"E128_Zipf_Kd128_N768", zipf_counts(2600, 128, shape_rng), 128, 768},
      // N = 96: gated only (the 64-row weight tile of 32 output columns; plain needs N % 64).
      {"E4_Kd320_N96", {33, 0, 150, 97}, 320, 96},
  };
  for (const Shape& s : shapes) {
    for (GemmEpilogue epilogue :
         {GemmEpilogue::kNone, GemmEpilogue::kSiluMul, GemmEpilogue::kClampedSwiglu}) {
      if (epilogue == GemmEpilogue::kNone && s.n % 64 != 0) continue;
      for (bool bias : {false, true}) {
        const WgmmaCase c{.counts = s.counts,
                          .kd = s.kd,
                          .n = s.n,
                          .epilogue = epilogue,
                          .bias = bias,
                          .spare_rows = 5};
        register_kernel_test(
            "CudaWgmmaGroupedGemm",
            std::string(epilogue_name(epilogue)) + (bias ? "Bias_" : "_") + s.name,
            [c] { run_case(c); }, __FILE__, __LINE__);
      }
    }
  }
  for (GemmEpilogue epilogue : {GemmEpilogue::kNone, GemmEpilogue::kSiluMul}) {
    register_kernel_test(
        "CudaWgmmaGroupedGemm", std::string("GraphReplayNewOffsets_") + epilogue_name(epilogue),
        [epilogue] { run_graph_case(epilogue); }, __FILE__, __LINE__);
  }
  for (int64_t T : {int64_t{2048}, int64_t{4096}}) {
    for (bool gate_up : {true, false}) {
      register_kernel_test(
          "CudaWgmmaGroupedGemm",
          std::string("Qwen3Experts_") + (gate_up ? "GateUp" : "Down") + "_T" + std::to_string(T) +
              "_VsRows128Wide",
          [T, gate_up] { run_against_mma(T, gate_up); }, __FILE__, __LINE__);
    }
  }
  register_kernel_test(
      "CudaWgmmaGroupedGemm", "MoeExpertsGathered_T4096_VsMmaSync",
      [] { run_moe_experts_gathered(4096); }, __FILE__, __LINE__);
  register_kernel_test(
      "CudaWgmmaGroupedGemm", "AutoChoice",
      [] {
        if (skip_unless_available()) GTEST_SKIP() << "needs sm_90";
        GroupedGemmParams p{.num_rows = 4096 * 8,
                            .num_experts = 128,
                            .n = 768,
                            .k = 2048,
                            .epilogue = GemmEpilogue::kSiluMul};
        int dummy = 0;
        p.rows = reinterpret_cast<const __nv_bfloat16*>(&dummy);
        p.weights = p.rows;
        EXPECT_EQ(grouped_gemm_tile(p), GemmTile::kHopperWgmma);
        p.num_rows = 160 * 128;  // mean rows 160: the 64-row tile's region
        EXPECT_EQ(grouped_gemm_tile(p), GemmTile::kRows64);
        p.num_rows = 4096 * 8;
        p.tile = GemmTile::kRows128Wide;  // an explicit tile turns it off
        EXPECT_EQ(grouped_gemm_tile(p), GemmTile::kRows128Wide);
        p.tile = GemmTile::kAuto;
        p.batch_invariant = true;  // --deterministic keeps to the mma.sync tiles
        EXPECT_EQ(grouped_gemm_tile(p), GemmTile::kRows128Wide);
        p.batch_invariant = false;
        const int32_t src_row = 0;
        p.src_row = &src_row;  // a gather: the mma.sync kernels
        EXPECT_EQ(grouped_gemm_tile(p), GemmTile::kRows128Wide);
      },
      __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
