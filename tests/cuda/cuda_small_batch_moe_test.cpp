// The small-batch MoE layer (backend/cuda/small_batch_moe.h: router logits, routing, plan and
// the routed and shared experts in two launches) against float64 CPU references, on fresh random
// inputs every run (the seed is printed on failure; MOE_TEST_SEED replays one). Every output is
// poisoned with 0xFF bytes first (NaN for float32, -1 for int32), so an unwritten element fails.
//
// What is checked, each step:
// - route.logits (float32 [T, E], written by the kernel) against a float64 dot of the bf16
//   hidden and router values: within 1e-5 of the sum of the magnitudes of the terms (float32
//   accumulation in any order, CONVENTIONS.md's float32 contract).
// - topk_ids exactly, against moe::route() applied to the logits the kernel wrote (so the
//   logits' own float32 rounding cannot flip a near tie), with the same options. A pick that
//   differs from the reference is excused only when the two experts' choice values (score plus
//   selection bias, float64 from the same logits) are within 1e-5 relative of each other: the
//   GPU's expf differs from the CPU's by an ulp or two, so such a tie may go either way. Excused
//   tokens are printed; in practice there are none.
// - topk_weights within 1e-5 relative (float32) of moe::route_weights() for the kernel's picks.
// - expert_counts [E + 1] equal to the histogram of the kernel's ids (padding at E, K per
//   padding token).
// - out [T, Hp] float32 against a float64 reference from the bf16 inputs and the kernel's own
//   ids and weights: out[t] = gate_t * shared(h_t) + sum_k w_tk * expert_k(h_t), where
//   expert(h) = down . (SiLU(gate . h) * (up . h)) with the SiLU product NOT rounded (the kernel
//   keeps it float32) and gate_t = sigmoid(shared_gate . h_t) (1 without a shared gate).
//   Tolerance: 1e-4 of the element's natural scale, sum_k |w_k| sum_i |down_hi| A_i (+ the
//   shared expert's, times gate_t), where A_i = |SiLU(g_i)| S(u_i) + 1.1 S(g_i) |u_i| bounds how
//   the float32 errors of the two Hp-term dots g_i, u_i (S: their sums of magnitudes; 1.1 bounds
//   SiLU') reach the product. Why 1e-4 and not 1e-5: the output is two chained float32
//   reductions (Hp terms, then Ip terms) with an expf between them, in an order the reference
//   does not reproduce; the typical error is a few 1e-6 of the scale, the linear worst case
//   (Hp + Ip) 2^-24 about 2e-4. One wrong activation element or one missing pick still moves an
//   element by about 1/(3 Ip) of the scale or more, above 1e-4 for every Ip here.
// - padding: with route.num_valid_tokens pointing at V < T, tokens t >= V get id E, weight 0
//   and out rows of exactly 0 (their logits are not looked at).
//
// Each test builds one layer's weights and one workspace (zero-filled once, sized for the
// largest T of its steps) and then runs several steps on them with fresh hidden states, other T,
// V and experts_blocks (0: the default grid, 3: a persistent grid far smaller than the work), so
// every step after the first proves that the kernels left their counters ready for the next.
// One test runs the layer captured in a CUDA graph and replays it twice with new inputs and a
// new V. Sizes: T in 1, 2, 3, 8, 17, 64 (T*K = 512, the limit), E in 8, 60, 64, 128, 256, Hp in
// 64, 2048, 2112, Ip in 64, 200, 768, shared experts of width 64, 96 and 128 with and without
// their sigmoid gate, DeepSeek-V2 (group max) and -V3 (sigmoid, top-2 group sums, selection
// bias) routing, and a skewed router with which every token picks the same K experts (T rows
// per expert). The synthetic models' uniform router (route.noise_keys) gives the same picks and
// weights here as fused_router does with the same keys and seed (Qwen3 and DeepSeek-V3 routing).
//
// Without a device only the host-side checks (small_moe_supports, the launcher's refusals)
// exist; the kernel tests are registered only when a device is present (cuda_test_util.h,
// cuda_stages_test.cpp). The large weights are drawn with a counter-based generator in
// parallel, and the reference runs on the thread pool, to keep the whole file to seconds.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/small_batch_moe.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "cuda_test_util.h"
#include "moe/stages.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

// ---------------------------------------------------------------------------------------------
// Host-side checks: always registered, need no device.

TEST(CudaSmallMoeChecks, SupportsTheDecodeSizesOnly) {
  // Qwen3-30B-A3B at the limit (T*K = 512), DeepSeek-V3 with its shared expert.
  EXPECT_TRUE(small_moe_supports(64, 128, 8, 2048, 768, 0));
  EXPECT_TRUE(small_moe_supports(1, 256, 8, 7168, 2048, 2048));
  EXPECT_TRUE(small_moe_supports(3, 8, 2, 64, 64, 0));
  EXPECT_TRUE(small_moe_supports(2, 1024, 32, 64, 8, 8));
  EXPECT_FALSE(small_moe_supports(65, 8, 2, 64, 64, 0));        // T > 64
  EXPECT_FALSE(small_moe_supports(64, 128, 9, 2048, 768, 0));   // T*K = 576
  EXPECT_FALSE(small_moe_supports(33, 256, 16, 2048, 768, 0));  // T*K = 528
  EXPECT_FALSE(small_moe_supports(1, 1025, 8, 2048, 768, 0));   // E > 1024
  EXPECT_FALSE(small_moe_supports(1, 64, 33, 2048, 768, 0));    // K > 32
  EXPECT_FALSE(small_moe_supports(1, 4, 8, 2048, 768, 0));      // K > E
  EXPECT_FALSE(small_moe_supports(1, 128, 8, 2080, 768, 0));    // Hp a multiple of 32, not 64
  EXPECT_FALSE(small_moe_supports(1, 128, 8, 2048, 764, 0));    // Ip not a multiple of 8
  EXPECT_FALSE(small_moe_supports(1, 128, 8, 2048, 768, 100));  // Is not a multiple of 8
}

TEST(CudaSmallMoeChecks, LauncherNamesTheBadValue) {
  // Valid sizes on host pointers: every case below must be refused before any CUDA call.
  alignas(16) uint16_t bf16_buf[64] = {};
  alignas(16) float float_buf[64] = {};
  alignas(16) int32_t int_buf[64] = {};
  alignas(16) unsigned char workspace[64] = {};
  const auto* in = reinterpret_cast<const bf16*>(bf16_buf);
  const SmallMoeParams base{.hidden = in,
                            .router = in,
                            .route = RouterParams{.logits = float_buf,
                                                  .topk_ids = int_buf,
                                                  .topk_weights = float_buf,
                                                  .num_tokens = 2,
                                                  .num_experts = 8,
                                                  .top_k = 2},
                            .gate_up = in,
                            .down = in,
                            .expert_width = 64,
                            .expert_counts = int_buf,
                            .out = float_buf,
                            .workspace = workspace,
                            .hidden_size = 64};
  auto expect_refused = [&](auto edit, const std::string& needle) {
    SmallMoeParams p = base;
    edit(p);
    expect_error_naming([&] { small_batch_moe(p, nullptr); }, needle);
  };
  expect_refused([&](SmallMoeParams& p) { p.route.num_tokens = 65; }, "T = 65");
  expect_refused(
      [&](SmallMoeParams& p) {
        p.route.num_tokens = 64;
        p.route.num_experts = 128;
        p.route.top_k = 9;
      },
      "K = 9");
  // Past the one-warp router's range: the router takes it, this path does not.
  expect_refused([&](SmallMoeParams& p) { p.route.num_experts = 1025; }, "E = 1025");
  expect_refused(
      [&](SmallMoeParams& p) {
        p.route.num_experts = 40;
        p.route.top_k = 33;
      },
      "K = 33");
  expect_refused([&](SmallMoeParams& p) { p.route.top_k = 9; }, "top_k = 9");
  expect_refused([&](SmallMoeParams& p) { p.hidden_size = 2080; }, "hidden_size = 2080");
  expect_refused([&](SmallMoeParams& p) { p.expert_width = 764; }, "expert_width = 764");
  expect_refused(
      [&](SmallMoeParams& p) {
        p.shared_width = 100;
        p.shared_gate_up = in;
        p.shared_down = in;
      },
      "shared_width = 100");
  expect_refused([&](SmallMoeParams& p) { p.experts_blocks = -1; }, "experts_blocks = -1");
  expect_refused([&](SmallMoeParams& p) { p.hidden = nullptr; }, "hidden is null");
  expect_refused([&](SmallMoeParams& p) { p.router = nullptr; }, "router is null");
  expect_refused([&](SmallMoeParams& p) { p.gate_up = nullptr; }, "gate_up is null");
  expect_refused([&](SmallMoeParams& p) { p.down = nullptr; }, "down is null");
  expect_refused([&](SmallMoeParams& p) { p.route.logits = nullptr; }, "logits is null");
  expect_refused([&](SmallMoeParams& p) { p.route.topk_ids = nullptr; }, "topk_ids is null");
  expect_refused([&](SmallMoeParams& p) { p.out = nullptr; }, "out is null");
  expect_refused([&](SmallMoeParams& p) { p.workspace = nullptr; }, "workspace is null");
  expect_refused([&](SmallMoeParams& p) { p.workspace = workspace + 4; }, "workspace (");
  expect_refused([&](SmallMoeParams& p) { p.hidden = in + 1; }, "hidden (");
  expect_refused([&](SmallMoeParams& p) { p.shared_width = 64; }, "shared_gate_up is null");
  expect_refused([&](SmallMoeParams& p) { p.shared_gate = in; }, "shared_gate");
  // The two launches check the same way.
  SmallMoeParams p = base;
  p.route.num_tokens = 65;
  expect_error_naming([&] { small_batch_moe_route_plan(p, nullptr); }, "T = 65");
  expect_error_naming([&] { small_batch_moe_experts(p, nullptr); }, "T = 65");
}

// ---------------------------------------------------------------------------------------------
// Kernel tests: registered only when a device is present (see the file comment).

RouterScore to_cuda(moe::ScoreFunction score) {
  switch (score) {
    case moe::ScoreFunction::kSoftmax:
      return RouterScore::kSoftmax;
    case moe::ScoreFunction::kSigmoid:
      return RouterScore::kSigmoid;
  }
  return RouterScore::kSoftmax;
}

RouterGroupScore to_cuda(moe::GroupScore group) {
  switch (group) {
    case moe::GroupScore::kNone:
      return RouterGroupScore::kNone;
    case moe::GroupScore::kMax:
      return RouterGroupScore::kMax;
    case moe::GroupScore::kTop2Sum:
      return RouterGroupScore::kTop2Sum;
  }
  return RouterGroupScore::kNone;
}

// One call of the layer on the test's weights and workspace.
struct Step {
  int64_t T = 1;
  int64_t valid = -1;  // V through route.num_valid_tokens, or -1: no pointer (V = T)
  int64_t blocks = 0;  // experts_blocks
  bool split = false;  // the two launches separately instead of small_batch_moe
  bool counts = true;  // expert_counts given
};

struct MoeCase {
  std::string name;
  int64_t E = 8, K = 2, Hp = 64, Ip = 64;
  int64_t Is = 0;            // shared expert width, 0: none
  bool shared_gate = false;  // sigmoid gate on the shared expert
  moe::ScoreFunction score = moe::ScoreFunction::kSoftmax;
  bool renormalize = true;
  float scaling = 1.0f;
  bool selection_bias = false;
  moe::GroupScore group = moe::GroupScore::kNone;
  int64_t num_groups = 1, topk_groups = 1;
  bool skewed = false;  // every token picks the same K experts
  std::vector<Step> steps;
};

moe::RouterOptions router_options(const MoeCase& c, const float* bias) {
  return moe::RouterOptions{.num_experts = c.E,
                            .top_k = c.K,
                            .score = c.score,
                            .renormalize = c.renormalize,
                            .routed_scaling_factor = c.scaling,
                            .group_score = c.group,
                            .num_groups = c.num_groups,
                            .topk_groups = c.topk_groups,
                            .selection_bias = c.selection_bias ? bias : nullptr};
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// bf16 values of standard deviation `scale` (uniform on +-sqrt(3) scale) from a counter-based
// generator: the expert tensors (up to 3 x 10^8 elements) fill in parallel, and one seed gives
// the same values whatever the number of threads.
std::vector<uint16_t> fast_random_bf16(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> out(n);
  constexpr size_t kChunk = size_t{1} << 16;
  const float half_width = std::sqrt(3.0f) * scale;
  parallel_for(static_cast<int64_t>((n + kChunk - 1) / kChunk), [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      uint64_t state = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(c + 1));
      const size_t last = std::min(n, (c + 1) * kChunk);
      for (size_t i = c * kChunk; i < last; ++i) {
        const float u = static_cast<float>(splitmix64(state) >> 40) * 0x1p-24f;  // [0, 1)
        out[i] = f32_to_bf16((2.0f * u - 1.0f) * half_width);
      }
    }
  });
  return out;
}

// One layer's weights on the host, as the kernels read them.
struct HostLayer {
  std::vector<uint16_t> router;          // [E, Hp]
  std::vector<uint16_t> gate_up;         // [E, 2 Ip, Hp] gate rows then up rows
  std::vector<uint16_t> down;            // [E, Hp, Ip]
  std::vector<uint16_t> shared_gate_up;  // [2 Is, Hp] or empty
  std::vector<uint16_t> shared_down;     // [Hp, Is] or empty
  std::vector<uint16_t> shared_gate;     // [1, Hp] or empty
  std::vector<float> bias;               // [E] selection bias, or empty
  std::vector<float> direction;          // [Hp] skewed case: the hidden states' common part
};

HostLayer make_layer(const MoeCase& c, std::mt19937& rng) {
  HostLayer L;
  const float inv_sqrt_h = 1.0f / std::sqrt(static_cast<float>(c.Hp));
  auto seed = [&] { return (static_cast<uint64_t>(rng()) << 32) | rng(); };
  L.gate_up = fast_random_bf16(c.E * 2 * c.Ip * c.Hp, seed(), inv_sqrt_h);
  L.down = fast_random_bf16(c.E * c.Hp * c.Ip, seed(), 1.0f / std::sqrt(static_cast<float>(c.Ip)));
  if (c.Is > 0) {
    L.shared_gate_up = random_bf16(2 * c.Is * c.Hp, rng, inv_sqrt_h);
    L.shared_down = random_bf16(c.Hp * c.Is, rng, 1.0f / std::sqrt(static_cast<float>(c.Is)));
  }
  if (c.shared_gate) L.shared_gate = random_bf16(c.Hp, rng, inv_sqrt_h);
  // Router logits ~ N(0, 1) for hidden states ~ N(0, 1).
  L.router = random_bf16(c.E * c.Hp, rng, inv_sqrt_h);
  if (c.selection_bias) {
    std::normal_distribution<float> dist(0.0f, 0.05f);
    L.bias.resize(c.E);
    for (float& b : L.bias) b = dist(rng);
  }
  if (c.skewed) {
    // Hidden states h = 0.5 noise + d; router row of the j-th dominant expert a_j d / |d|^2, so
    // its logit is about a_j = 8 + 2 (K - 1 - j), far above the others' N(0, 1.2), in a fixed
    // order: every token picks the same K experts, spread over the ids.
    const std::vector<uint16_t> d = random_bf16(c.Hp, rng, 1.0f);
    L.direction = to_float(d);
    double norm2 = 0;
    for (float v : L.direction) norm2 += static_cast<double>(v) * v;
    for (int64_t j = 0; j < c.K; ++j) {
      const int64_t e = (7 + 13 * j) % c.E;
      const double a = 8.0 + 2.0 * static_cast<double>(c.K - 1 - j);
      for (int64_t h = 0; h < c.Hp; ++h)
        L.router[e * c.Hp + h] = f32_to_bf16(static_cast<float>(a * L.direction[h] / norm2));
    }
  }
  return L;
}

std::vector<uint16_t> make_hidden(const MoeCase& c, const HostLayer& L, int64_t T,
                                  std::mt19937& rng) {
  if (!c.skewed) return random_bf16(T * c.Hp, rng, 1.0f);
  std::normal_distribution<float> dist(0.0f, 0.5f);
  std::vector<uint16_t> hidden(T * c.Hp);
  for (int64_t i = 0; i < T * c.Hp; ++i) hidden[i] = f32_to_bf16(dist(rng) + L.direction[i % c.Hp]);
  return hidden;
}

// The layer's weights on the device.
struct DeviceLayer {
  explicit DeviceLayer(const HostLayer& L)
      : router(L.router),
        gate_up(L.gate_up),
        down(L.down),
        shared_gate_up(L.shared_gate_up),
        shared_down(L.shared_down),
        shared_gate(L.shared_gate),
        bias(L.bias) {}
  DeviceBuffer<uint16_t> router, gate_up, down, shared_gate_up, shared_down, shared_gate;
  DeviceBuffer<float> bias;
};

// One step's inputs and outputs on the device.
struct StepBuffers {
  StepBuffers(const MoeCase& c, int64_t T)
      : hidden(T * c.Hp),
        logits(T * c.E),
        ids(T * c.K),
        weights(T * c.K),
        counts(c.E + 1),
        out(T * c.Hp),
        valid(1) {}
  void poison() {
    logits.poison();
    ids.poison();
    weights.poison();
    counts.poison();
    out.poison();
  }
  DeviceBuffer<uint16_t> hidden;  // [T, Hp]
  DeviceBuffer<float> logits;     // [T, E]
  DeviceBuffer<int32_t> ids;      // [T, K]
  DeviceBuffer<float> weights;    // [T, K]
  DeviceBuffer<int32_t> counts;   // [E + 1]
  DeviceBuffer<float> out;        // [T, Hp]
  DeviceBuffer<int32_t> valid;    // [1] num_valid_tokens
};

SmallMoeParams layer_params(const MoeCase& c, const DeviceLayer& d, const StepBuffers& b,
                            const Step& s, void* workspace) {
  return SmallMoeParams{
      .hidden = b.hidden.as_bf16(),
      .router = d.router.as_bf16(),
      .route = RouterParams{.logits = b.logits.get(),
                            .topk_ids = b.ids.get(),
                            .topk_weights = b.weights.get(),
                            .num_tokens = s.T,
                            .num_experts = c.E,
                            .top_k = c.K,
                            .score = to_cuda(c.score),
                            .renormalize = c.renormalize,
                            .routed_scaling_factor = c.scaling,
                            .selection_bias = c.selection_bias ? d.bias.get() : nullptr,
                            .group_score = to_cuda(c.group),
                            .num_groups = c.num_groups,
                            .topk_groups = c.topk_groups,
                            .num_valid_tokens = s.valid >= 0 ? b.valid.get() : nullptr},
      .gate_up = d.gate_up.as_bf16(),
      .down = d.down.as_bf16(),
      .expert_width = c.Ip,
      .shared_gate_up = c.Is > 0 ? d.shared_gate_up.as_bf16() : nullptr,
      .shared_down = c.Is > 0 ? d.shared_down.as_bf16() : nullptr,
      .shared_width = c.Is,
      .shared_gate = c.shared_gate ? d.shared_gate.as_bf16() : nullptr,
      .expert_counts = s.counts ? b.counts.get() : nullptr,
      .out = b.out.get(),
      .workspace = workspace,
      .hidden_size = c.Hp,
      .experts_blocks = s.blocks};
}

// Uploads the hidden state and V, poisons the outputs.
void prepare(StepBuffers& b, const std::vector<uint16_t>& hidden, const Step& s) {
  CUDA_CHECK(cudaMemcpy(b.hidden.get(), hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice));
  const int32_t valid = static_cast<int32_t>(s.valid);
  CUDA_CHECK(cudaMemcpy(b.valid.get(), &valid, 4, cudaMemcpyHostToDevice));
  b.poison();
}

struct StepResult {
  std::vector<float> logits, weights, out;
  std::vector<int32_t> ids, counts;
};

StepResult download(const StepBuffers& b) {
  return StepResult{.logits = b.logits.download(),
                    .weights = b.weights.download(),
                    .out = b.out.download(),
                    .ids = b.ids.download(),
                    .counts = b.counts.download()};
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// A dot of bf16 rows in float64 and the sum of the magnitudes of its terms.
struct Dot {
  double value = 0, magnitude = 0;
};
Dot dot_bf16(const uint16_t* a, const uint16_t* b, int64_t n) {
  Dot d;
  for (int64_t i = 0; i < n; ++i) {
    const double t = static_cast<double>(bf16_to_f32(a[i])) * bf16_to_f32(b[i]);
    d.value += t;
    d.magnitude += std::fabs(t);
  }
  return d;
}

// One expert's output for one hidden row in float64 (the SiLU product unrounded), and the
// error scale of each output element (see the file comment).
void expert_reference(const uint16_t* x, const uint16_t* gate_up, const uint16_t* down, int64_t Hp,
                      int64_t width, double* y, double* scale) {
  std::vector<double> act(width), act_scale(width);
  for (int64_t i = 0; i < width; ++i) {
    const Dot g = dot_bf16(gate_up + i * Hp, x, Hp);
    const Dot u = dot_bf16(gate_up + (width + i) * Hp, x, Hp);
    act[i] = silu(g.value) * u.value;
    act_scale[i] = std::fabs(silu(g.value)) * u.magnitude + 1.1 * g.magnitude * std::fabs(u.value);
  }
  for (int64_t h = 0; h < Hp; ++h) {
    const uint16_t* row = down + h * width;
    double v = 0, s = 0;
    for (int64_t i = 0; i < width; ++i) {
      const double w = bf16_to_f32(row[i]);
      v += w * act[i];
      s += std::fabs(w) * act_scale[i];
    }
    y[h] = v;
    scale[h] = s;
  }
}

// Choice values (score + selection bias) of one token's experts in float64, from the logits the
// kernel wrote: what decides a near tie.
std::vector<double> choice_values(const float* logits, const MoeCase& c,
                                  const std::vector<float>& bias) {
  std::vector<double> choice(c.E);
  if (c.score == moe::ScoreFunction::kSoftmax) {
    const double max_logit = *std::max_element(logits, logits + c.E);
    double sum = 0;
    for (int64_t e = 0; e < c.E; ++e) sum += choice[e] = std::exp(logits[e] - max_logit);
    for (double& v : choice) v /= sum;
  } else {
    for (int64_t e = 0; e < c.E; ++e) choice[e] = 1.0 / (1.0 + std::exp(-logits[e]));
  }
  if (c.selection_bias)
    for (int64_t e = 0; e < c.E; ++e) choice[e] += bias[e];
  return choice;
}

void check_step(const MoeCase& c, const HostLayer& L, const std::vector<uint16_t>& hidden,
                const Step& s, const StepResult& got) {
  const int64_t T = s.T, E = c.E, K = c.K, Hp = c.Hp;
  const int64_t V = s.valid >= 0 ? std::min(s.valid, T) : T;

  // Logits of the real tokens.
  {
    std::vector<float> got_valid(got.logits.begin(), got.logits.begin() + V * E);
    std::vector<double> want(V * E), scale(V * E);
    for (int64_t t = 0; t < V; ++t)
      for (int64_t e = 0; e < E; ++e) {
        const Dot d = dot_bf16(&hidden[t * Hp], &L.router[e * Hp], Hp);
        want[t * E + e] = d.value;
        scale[t * E + e] = d.magnitude;
      }
    expect_within(
        got_valid, want, [&](size_t i) { return 1e-5 * scale[i] + 1e-30; }, "logits");
  }

  // Routing of the real tokens against moe::route() on the kernel's logits; padding tokens.
  const moe::RouterOptions options = router_options(c, L.bias.data());
  moe::Routing want;
  moe::route(got.logits.data(), V, options, &want);
  int excused = 0;
  size_t id_mismatches = 0;
  bool ids_in_range = true;
  for (int64_t t = 0; t < V; ++t) {
    bool token_excused = false;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t g = got.ids[t * K + k], w = want.topk_ids[t * K + k];
      if (g == w) continue;
      if (g < 0 || g >= E) {
        ids_in_range = false;
      } else {
        const std::vector<double> choice = choice_values(&got.logits[t * E], c, L.bias);
        const double a = choice[g], b = choice[w];
        if (std::fabs(a - b) <= 1e-5 * std::max(std::fabs(a), std::fabs(b))) {
          token_excused = true;
          continue;
        }
      }
      if (id_mismatches++ < 5)
        ADD_FAILURE() << "topk_ids[" << t << ", " << k << "] = " << g << ", want " << w;
    }
    excused += token_excused;
  }
  EXPECT_EQ(id_mismatches, 0u) << "topk_ids";
  if (excused > 0)
    std::printf("note: %d of %lld tokens took another pick at a float64 near tie\n", excused,
                static_cast<long long>(V));
  size_t padding_mismatches = 0;
  for (int64_t i = V * K; i < T * K; ++i) {
    if ((got.ids[i] != E || got.weights[i] != 0.0f) && padding_mismatches++ < 5)
      ADD_FAILURE() << "padding token " << i / K << " pick " << i % K << ": id " << got.ids[i]
                    << " weight " << got.weights[i] << ", want id " << E << " weight 0";
  }
  EXPECT_EQ(padding_mismatches, 0u) << "padding picks";
  if (!ids_in_range) {
    ADD_FAILURE() << "expert ids out of [0, " << E << "): the weights and outputs are not checked";
    return;
  }

  // Weights of the kernel's picks.
  moe::Routing picked;
  picked.num_tokens = V;
  picked.top_k = K;
  picked.topk_ids.assign(got.ids.begin(), got.ids.begin() + V * K);
  moe::route_weights(got.logits.data(), options, &picked);
  {
    std::vector<float> got_valid(got.weights.begin(), got.weights.begin() + V * K);
    std::vector<double> want_weights(picked.topk_weights.begin(), picked.topk_weights.end());
    expect_within(
        got_valid, want_weights,
        [&](size_t i) { return 1e-5 * std::fabs(want_weights[i]) + 1e-30; }, "topk_weights");
  }

  // Counts: the histogram of the ids, padding at E.
  if (s.counts) {
    std::vector<int32_t> histogram(E + 1, 0);
    for (int64_t i = 0; i < T * K; ++i) ++histogram[std::clamp<int64_t>(got.ids[i], 0, E)];
    EXPECT_EQ(got.counts, histogram) << "expert_counts";
  }

  // Block output: each (token, pick) and each token's shared expert in parallel.
  const int64_t routed_tasks = V * K, tasks = routed_tasks + (c.Is > 0 ? V : 0);
  std::vector<double> y(tasks * Hp), y_scale(tasks * Hp);
  parallel_for(tasks, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      double* out_y = &y[task * Hp];
      double* out_scale = &y_scale[task * Hp];
      if (task < routed_tasks) {
        const int64_t e = got.ids[task];
        expert_reference(&hidden[(task / K) * Hp], &L.gate_up[e * 2 * c.Ip * Hp],
                         &L.down[e * Hp * c.Ip], Hp, c.Ip, out_y, out_scale);
      } else {
        expert_reference(&hidden[(task - routed_tasks) * Hp], L.shared_gate_up.data(),
                         L.shared_down.data(), Hp, c.Is, out_y, out_scale);
      }
    }
  });
  std::vector<double> want_out(T * Hp, 0.0), scale(T * Hp, 0.0);
  for (int64_t t = 0; t < V; ++t) {
    const double gate =
        c.shared_gate
            ? 1.0 / (1.0 + std::exp(-dot_bf16(&hidden[t * Hp], L.shared_gate.data(), Hp).value))
            : 1.0;
    for (int64_t h = 0; h < Hp; ++h) {
      double v = 0, sc = 0;
      if (c.Is > 0) {
        v = gate * y[(routed_tasks + t) * Hp + h];
        sc = gate * y_scale[(routed_tasks + t) * Hp + h];
      }
      for (int64_t k = 0; k < K; ++k) {
        const double w = got.weights[t * K + k];
        v += w * y[(t * K + k) * Hp + h];
        sc += std::fabs(w) * y_scale[(t * K + k) * Hp + h];
      }
      want_out[t * Hp + h] = v;
      scale[t * Hp + h] = sc;
    }
  }
  // Padding rows: exactly 0 (the bound 0 for them).
  expect_within(
      got.out, want_out, [&](size_t i) { return 1e-4 * scale[i]; }, "out");
}

std::string describe(const Step& s) {
  return "T=" + std::to_string(s.T) + " V=" + (s.valid >= 0 ? std::to_string(s.valid) : "T") +
         " blocks=" + std::to_string(s.blocks) + (s.split ? " split" : "") +
         (s.counts ? "" : " no-counts");
}

// One layer, one workspace zero-filled once, the case's steps in order.
void run_case(const MoeCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
  const HostLayer L = make_layer(c, rng);
  const DeviceLayer d(L);
  int64_t max_t = 0;
  for (const Step& s : c.steps) {
    ASSERT_TRUE(small_moe_supports(s.T, c.E, c.K, c.Hp, c.Ip, c.Is)) << describe(s);
    max_t = std::max(max_t, s.T);
  }
  DeviceBuffer<unsigned char> workspace(
      small_moe_workspace_bytes(max_t, c.E, c.K, c.Hp, c.Ip, c.Is));
  CUDA_CHECK(
      cudaMemset(workspace.get(), 0, small_moe_workspace_bytes(max_t, c.E, c.K, c.Hp, c.Ip, c.Is)));
  for (const Step& s : c.steps) {
    SCOPED_TRACE(describe(s));
    StepBuffers b(c, s.T);
    const std::vector<uint16_t> hidden = make_hidden(c, L, s.T, rng);
    prepare(b, hidden, s);
    const SmallMoeParams p = layer_params(c, d, b, s, workspace.get());
    if (s.split) {
      small_batch_moe_route_plan(p, nullptr);
      small_batch_moe_experts(p, nullptr);
    } else {
      small_batch_moe(p, nullptr);
    }
    synchronize();
    const StepResult got = download(b);
    check_step(c, L, hidden, s, got);
    if (c.skewed) {
      // The case does what it claims: every real token picked the dominant experts in order.
      const int64_t V = s.valid >= 0 ? s.valid : s.T;
      size_t off = 0;
      for (int64_t i = 0; i < V * c.K; ++i)
        off += got.ids[i] != static_cast<int32_t>((7 + 13 * (i % c.K)) % c.E);
      EXPECT_EQ(off, 0u) << "picks of the skewed router off the dominant experts";
    }
  }
}

// The layer captured in a CUDA graph (global capture mode: any call that would synchronise with
// the host fails the capture), replayed with new hidden states and a new V written into the
// same device buffers, as the decoder's graph buckets do. An eager step first, as the decoder
// runs one before it captures; it shares the workspace, so the replays also show the counters
// reset after an eager call and after each replay.
void run_graph(const MoeCase& c) {
  std::mt19937 rng(fresh_seed() ^ 0x5bd1e995u);
  const HostLayer L = make_layer(c, rng);
  const DeviceLayer d(L);
  const int64_t T = 8;
  const int64_t bytes = small_moe_workspace_bytes(T, c.E, c.K, c.Hp, c.Ip, c.Is);
  DeviceBuffer<unsigned char> workspace(bytes);
  CUDA_CHECK(cudaMemset(workspace.get(), 0, bytes));
  StepBuffers b(c, T);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // The params hold pointers only, so one capture serves every replay; V is read on the device.
  const Step eager{.T = T, .valid = T, .blocks = 3};
  {
    SCOPED_TRACE("eager before capture");
    const std::vector<uint16_t> hidden = make_hidden(c, L, T, rng);
    prepare(b, hidden, eager);
    small_batch_moe(layer_params(c, d, b, eager, workspace.get()), stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    check_step(c, L, hidden, eager, download(b));
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  small_batch_moe(layer_params(c, d, b, eager, workspace.get()), stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int64_t valid : {T, int64_t{5}, int64_t{1}}) {
    const Step s{.T = T, .valid = valid, .blocks = 3};
    SCOPED_TRACE("replay with V=" + std::to_string(valid));
    const std::vector<uint16_t> hidden = make_hidden(c, L, T, rng);
    prepare(b, hidden, s);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    check_step(c, L, hidden, s, download(b));
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// The synthetic models' uniform router (route.noise_keys) through the small-batch path: the same
// picks and weights as fused_router given the same keys and seed (both route with
// router_kernel.cuh's functions, which replace the logits they read), padding rows included.
void run_noise(const MoeCase& c) {
  std::mt19937 rng(fresh_seed() ^ 0x9e3779b9u);
  const HostLayer L = make_layer(c, rng);
  const DeviceLayer d(L);
  const int64_t T = 64;
  const Step s{.T = T, .valid = 40};
  const int64_t bytes = small_moe_workspace_bytes(T, c.E, c.K, c.Hp, c.Ip, c.Is);
  DeviceBuffer<unsigned char> workspace(bytes);
  CUDA_CHECK(cudaMemset(workspace.get(), 0, bytes));
  StepBuffers b(c, T);
  prepare(b, make_hidden(c, L, T, rng), s);
  std::vector<int32_t> keys(T);
  std::iota(keys.begin(), keys.end(), static_cast<int32_t>(rng() % 100000));
  std::shuffle(keys.begin(), keys.end(), rng);
  DeviceBuffer<int32_t> d_keys(keys);
  SmallMoeParams p = layer_params(c, d, b, s, workspace.get());
  p.route.noise_keys = d_keys.get();
  p.route.noise_seed = (static_cast<uint64_t>(rng()) << 32) | rng();
  small_batch_moe(p, nullptr);
  synchronize();
  const StepResult got = download(b);

  DeviceBuffer<int32_t> ids(T * c.K);
  DeviceBuffer<float> weights(T * c.K);
  ids.poison();
  weights.poison();
  RouterParams route = p.route;
  route.topk_ids = ids.get();
  route.topk_weights = weights.get();
  fused_router(route, nullptr);
  synchronize();
  EXPECT_EQ(got.ids, ids.download());
  EXPECT_EQ(got.weights, weights.download());
  for (int64_t i = s.valid * c.K; i < T * c.K; ++i)
    EXPECT_EQ(got.ids[i], static_cast<int32_t>(c.E)) << "padding token " << i / c.K;
}

std::vector<MoeCase> cases() {
  using moe::GroupScore;
  using moe::ScoreFunction;
  return {
      // Every T on the smallest layer: one partial 1024-element segment per row, E = 8.
      {.name = "Small_E8_K2_H64_I64",
       .renormalize = false,
       .steps = {{.T = 1},
                 {.T = 2, .blocks = 3},
                 {.T = 3, .valid = 0},
                 {.T = 8, .split = true},
                 {.T = 17, .valid = 11, .blocks = 3},
                 {.T = 64, .valid = 64},
                 {.T = 3, .blocks = 3, .counts = false}}},
      // A wide layer (Qwen1.5-MoE's E = 60, K = 4) at full hidden size and expert width.
      {.name = "Wide_E60_K4_H2048_I768",
       .E = 60,
       .K = 4,
       .Hp = 2048,
       .Ip = 768,
       .steps = {{.T = 1}, {.T = 17, .blocks = 3}, {.T = 3, .valid = 2}}},
      // Qwen3-30B-A3B routing on an awkward shape, up to T*K = 512.
      {.name = "Qwen3_E128_K8_H2112_I200",
       .E = 128,
       .K = 8,
       .Hp = 2112,
       .Ip = 200,
       .steps = {{.T = 2},
                 {.T = 8, .valid = 5, .blocks = 3},
                 {.T = 64},
                 {.T = 1, .blocks = 3, .split = true}}},
      // DeepSeek-V3 routing (sigmoid, top-2 group sums, selection bias, renormalised, scaled)
      // with its ungated shared expert.
      {.name = "DeepSeekV3_E256_K8_H2112_I64_S64",
       .E = 256,
       .K = 8,
       .Hp = 2112,
       .Ip = 64,
       .Is = 64,
       .score = ScoreFunction::kSigmoid,
       .scaling = 2.5f,
       .selection_bias = true,
       .group = GroupScore::kTop2Sum,
       .num_groups = 8,
       .topk_groups = 4,
       .steps = {{.T = 3}, {.T = 17, .valid = 9, .blocks = 3}, {.T = 64}}},
      // DeepSeek-V2 routing (softmax, group max, no renormalisation, scale 16), shared expert.
      {.name = "DeepSeekV2_E64_K6_H64_I64_S128",
       .E = 64,
       .K = 6,
       .Ip = 64,
       .Is = 128,
       .renormalize = false,
       .scaling = 16.0f,
       .group = GroupScore::kMax,
       .num_groups = 8,
       .topk_groups = 3,
       .steps = {{.T = 2}, {.T = 17, .blocks = 3}}},
      // A gated shared expert narrower than the routed ones (Qwen2-MoE style).
      {.name = "GatedShared_E64_K6_H2112_I200_S96",
       .E = 64,
       .K = 6,
       .Hp = 2112,
       .Ip = 200,
       .Is = 96,
       .shared_gate = true,
       .renormalize = false,
       .steps = {{.T = 1},
                 {.T = 8, .blocks = 3},
                 {.T = 17, .valid = 13},
                 {.T = 64, .blocks = 3, .split = true}}},
      // Every token picks the same K experts: slots of T rows, most experts idle.
      {.name = "Skewed_E128_K8_H2112_I64",
       .E = 128,
       .K = 8,
       .Hp = 2112,
       .Ip = 64,
       .skewed = true,
       .steps = {{.T = 64}, {.T = 17, .blocks = 3}, {.T = 64, .valid = 40, .blocks = 3}}},
  };
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("small-batch MoE")) return false;
  for (const MoeCase& c : cases()) {
    register_kernel_test(
        "CudaSmallBatchMoe", c.name, [c] { run_case(c); }, __FILE__, __LINE__);
  }
  const MoeCase graph_case{.name = "CapturedInGraph_E64_K6_H2112_I200_S96",
                           .E = 64,
                           .K = 6,
                           .Hp = 2112,
                           .Ip = 200,
                           .Is = 96,
                           .shared_gate = true,
                           .steps = {}};  // run_graph's own steps
  register_kernel_test(
      "CudaSmallBatchMoe", graph_case.name, [graph_case] { run_graph(graph_case); }, __FILE__,
      __LINE__);
  for (const MoeCase& c : cases()) {
    if (c.name != "Qwen3_E128_K8_H2112_I200" && c.name != "DeepSeekV3_E256_K8_H2112_I64_S64")
      continue;
    register_kernel_test(
        "CudaSmallBatchMoe", "RouterNoise_" + c.name, [c] { run_noise(c); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
