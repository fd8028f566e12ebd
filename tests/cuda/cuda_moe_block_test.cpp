// The GPU MoE block (model/cuda/moe_block.h) held to the CPU stages (moe/stages.h) stage by
// stage, each CPU stage fed the GPU's output of the stage before it, so that a difference
// points at one stage:
//   route    the router GEMM's logits against a float64 product of the same bf16 inputs
//            (1e-5 of each logit's natural scale), then moe::route over the GPU's logits: the
//            same ids (exact) and weights (1e-5 relative); padding tokens past num_valid get the
//            null expert E and weight 0
//   plan     moe::plan of the GPU's routing over E + 1 experts: offsets, src_row and inverse
//            exact
//   experts  moe::run_experts over the dispatched rows of every real expert, against the
//            GPU's expert outputs (the bf16 contract of CONVENTIONS.md: 1e-2 of value + scale)
//   shared   the shared expert (ungated, or with its sigmoid gate) in float64
//   combine  moe::unpermute of the GPU's expert and shared outputs with its weights, against
//            the block's float32 output (1e-5 relative)
// and the whole block against the CPU's MoeBlock end to end (bf16 contract). Cases cover the
// router variants the GPU runs (softmax with and without renormalisation, DeepSeek-V3's sigmoid
// with selection bias, groups and a scaling factor, DeepSeek-V2's group max), the three shared
// expert kinds, padded graph buckets, and a step captured into a CUDA graph and replayed; and
// Llama 4's routing weights on the experts' input (Llama4_*: the dispatched rows against the
// CPU's weighted rows, the combine unweighted, the CPU MoeBlock under WeightPlacement::kInput;
// written without a GPU, not yet run on one).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/dense_gemm.h"
#include "cuda_test_util.h"
#include "model/cuda/moe_block.h"
#include "model/layer_plan.h"
#include "moe/moe_block.h"
#include "moe/stages.h"

namespace moeinfer::gpu {
namespace {

using cuda::testing_util::cuda_device_present;
using cuda::testing_util::DeviceBuffer;
using cuda::testing_util::expect_bf16_near;
using cuda::testing_util::expect_within;
using cuda::testing_util::fresh_seed;
using cuda::testing_util::random_bf16;
using cuda::testing_util::register_kernel_test;
using cuda::testing_util::synchronize;
using cuda::testing_util::to_float;

// Host-side: the block's refusals need no device.
MoeBlock block_with(const MoeBlockOptions& options, std::span<const DeviceLayer> layers,
                    std::span<const LayerPlan> plans) {
  auto linear = [](const bf16*, int64_t, const bf16*, int64_t, int64_t, void*, bool) {};
  auto mlp = [](const bf16*, const bf16*, const bf16*, int64_t, int64_t, bf16*) {};
  return MoeBlock(options, layers, plans, {},
                  std::make_unique<LocalDispatcher>(options.shape.num_experts, 64),
                  std::make_unique<ResidentExperts>(layers, options.shape, nullptr), linear, mlp);
}

TEST(CudaMoeBlockChecks, RefusesWhatItCannotRun) {
  const std::vector<DeviceLayer> layers(2);
  const std::vector<LayerPlan> plans(2);
  const MoeBlockOptions ok{.router = {.num_experts = 8, .top_k = 2},
                           .shape = {.num_experts = 8, .hidden_size = 64, .expert_width = 64},
                           .top_k = 2};
  cuda::testing_util::expect_error_naming(
      [&] { block_with(ok, layers, std::span(plans).first(1)); }, "2 layers and 1 layer plans");
  // GPT-OSS's router (softmax over the top-k logits) and clamped SwiGLU are taken.
  MoeBlockOptions gpt_oss = ok;
  gpt_oss.router.score = moe::ScoreFunction::kTopkSoftmax;
  gpt_oss.shape.activation = {.kind = moe::ActivationKind::kClampedSwiglu};
  EXPECT_NO_THROW(block_with(gpt_oss, layers, plans));
  MoeBlockOptions wide = ok;
  wide.top_k = 9;
  cuda::testing_util::expect_error_naming([&] { block_with(wide, layers, plans); },
                                          "top_k 9 must be in [1, 8]");
  // A dense layer is not a block's to run.
  MoeBlock block = block_with(ok, layers, plans);
  cuda::testing_util::expect_error_naming([&] { block.enqueue(1, {}, nullptr); },
                                          "layer 1 is dense");
}

// kLlama4: a plain sigmoid router (no renormalisation) whose weights multiply the experts'
// input (MoeBlockOptions::weights = kInput) and whose outputs are summed unweighted.
enum class RouterKind { kSoftmaxRenorm, kSoftmaxPlain, kSigmoidGroupsBias, kGroupMax, kLlama4 };

struct BlockCase {
  std::string name;
  int64_t E = 8, K = 2, H = 128, I = 64, Is = 0;
  int64_t T = 5;
  int64_t valid = -1;  // real tokens (-1: all T); the rest pad a graph bucket
  RouterKind router = RouterKind::kSoftmaxRenorm;
  SharedExpertKind shared = SharedExpertKind::kNone;
  bool graph = false;  // capture the block into a graph and replay it
};

moe::RouterOptions router_options_of(const BlockCase& c) {
  moe::RouterOptions r{.num_experts = c.E, .top_k = c.K};
  switch (c.router) {
    case RouterKind::kSoftmaxRenorm:
      r.renormalize = true;
      break;
    case RouterKind::kSoftmaxPlain:
      break;
    case RouterKind::kSigmoidGroupsBias:
      r.score = moe::ScoreFunction::kSigmoid;
      r.renormalize = true;
      r.routed_scaling_factor = 2.5f;
      r.group_score = moe::GroupScore::kTop2Sum;
      r.num_groups = 4;
      r.topk_groups = 2;
      break;
    case RouterKind::kLlama4:
      r.score = moe::ScoreFunction::kSigmoid;
      break;
    case RouterKind::kGroupMax:
      r.group_score = moe::GroupScore::kMax;
      r.num_groups = 4;
      r.topk_groups = 3;
      r.routed_scaling_factor = 1.5f;
      break;
  }
  return r;
}

// y[m, n] = sum_k x[m, k] w[n, k] in float64, and the root of the sum of its squared terms.
void reference_product(const std::vector<float>& x, const std::vector<float>& w, int64_t M,
                       int64_t N, int64_t Kd, std::vector<double>* y, std::vector<double>* scale) {
  y->assign(static_cast<size_t>(M * N), 0.0);
  scale->assign(y->size(), 0.0);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0.0, squares = 0.0;
      for (int64_t k = 0; k < Kd; ++k) {
        const double term = static_cast<double>(x[m * Kd + k]) * w[n * Kd + k];
        sum += term;
        squares += term * term;
      }
      (*y)[m * N + n] = sum;
      (*scale)[m * N + n] = std::sqrt(squares);
    }
  }
}

TensorView bf16_view(const std::vector<uint16_t>& host, int64_t offset, int64_t rows,
                     int64_t cols) {
  return {.dtype = DType::kBF16, .shape = {rows, cols}, .data = host.data() + offset};
}

void run_case(const BlockCase& c) {
  std::mt19937 rng(fresh_seed());
  const int64_t E = c.E, K = c.K, H = c.H, I = c.I, Is = c.Is, T = c.T;
  const int64_t valid = c.valid < 0 ? T : c.valid;
  const moe::RouterOptions router = router_options_of(c);
  const moe::WeightPlacement placement = c.router == RouterKind::kLlama4
                                             ? moe::WeightPlacement::kInput
                                             : moe::WeightPlacement::kOutput;
  const bool on_input = placement == moe::WeightPlacement::kInput;

  // Weights as the device layout holds them (device_weights.h): gate_up [E, 2I, H] (gate rows,
  // then up rows), down [E, H, I]; the shared expert [2 Is, H] and [H, Is].
  const std::vector<uint16_t> hidden = random_bf16(T * H, rng);
  const std::vector<uint16_t> router_w = random_bf16(E * H, rng, 0.2f);
  const std::vector<uint16_t> gate_up = random_bf16(E * 2 * I * H, rng, 0.1f);
  const std::vector<uint16_t> down = random_bf16(E * H * I, rng, 0.1f);
  const bool has_shared = c.shared != SharedExpertKind::kNone;
  const std::vector<uint16_t> shared_gate_up = random_bf16(has_shared ? 2 * Is * H : 0, rng, 0.1f);
  const std::vector<uint16_t> shared_down = random_bf16(has_shared ? H * Is : 0, rng, 0.1f);
  const bool gated = c.shared == SharedExpertKind::kSigmoidGated;
  const std::vector<uint16_t> shared_gate = random_bf16(gated ? H : 0, rng, 0.1f);
  std::vector<float> selection_bias;
  if (c.router == RouterKind::kSigmoidGroupsBias) {
    std::uniform_real_distribution<float> bias(-0.1f, 0.1f);
    for (int64_t e = 0; e < E; ++e) selection_bias.push_back(bias(rng));
  }

  DeviceBuffer<uint16_t> d_hidden(hidden), d_router(router_w), d_gate_up(gate_up), d_down(down),
      d_shared_gate_up(shared_gate_up), d_shared_down(shared_down), d_shared_gate(shared_gate);
  DeviceBuffer<float> d_selection_bias(selection_bias);
  std::vector<DeviceLayer> layers(1);
  DeviceLayer& d = layers[0];
  d.is_moe = true;
  d.router = d_router.as_bf16();
  d.selection_bias = selection_bias.empty() ? nullptr : d_selection_bias.get();
  d.experts_gate_up = d_gate_up.as_bf16();
  d.experts_down = d_down.as_bf16();
  if (has_shared) {
    d.shared_gate_up = d_shared_gate_up.as_bf16();
    d.shared_down = d_shared_down.as_bf16();
    d.shared_width = Is;
    d.shared_gate = gated ? d_shared_gate.as_bf16() : nullptr;
  }
  LayerPlan plan;
  plan.feed_forward = FeedForwardKind::kMoe;
  plan.shared_expert = c.shared;
  const std::vector<LayerPlan> plans{plan};

  // Workspace.
  DeviceBuffer<float> logits(T * E), topk_weights(T * K), out(T * H), gate_logits(T);
  DeviceBuffer<int32_t> topk_ids(T * K), offsets(E + 2), src_row(T * K), inverse(T * K),
      counts(E + 1), num_valid(std::vector<int32_t>{static_cast<int32_t>(valid)});
  DeviceBuffer<int32_t> plan_ws(std::max<int64_t>(cuda::plan_workspace_size(T * K, E + 1), 1));
  DeviceBuffer<uint16_t> weighted_rows(T * K * H);
  weighted_rows.poison();
  DeviceBuffer<uint16_t> expert_out(T * K * H), activation(T * K * I), shared_out(T * H),
      mlp_gate_up(T * 2 * std::max<int64_t>(Is, 1)), mlp_act(T * std::max<int64_t>(Is, 1));
  for (auto* b : {&logits, &topk_weights, &out}) b->poison();
  for (auto* b : {&topk_ids, &offsets, &src_row, &inverse}) b->poison();
  expert_out.poison();
  shared_out.poison();
  const MoeBlockBuffers buffers{.router_logits = logits.get(),
                                .topk_ids = topk_ids.get(),
                                .topk_weights = topk_weights.get(),
                                .expert_offsets = offsets.get(),
                                .src_row = src_row.get(),
                                .inverse = inverse.get(),
                                .plan_workspace = plan_ws.get(),
                                .expert_out = expert_out.as_bf16(),
                                .shared_out = shared_out.as_bf16(),
                                .shared_gate_logits = gate_logits.get()};
  // The products: the fixed-order dense GEMM (the decoder's --deterministic path).
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto linear = [&](const bf16* x, int64_t rows, const bf16* w, int64_t n, int64_t k, void* y,
                    bool f32_out) {
    cuda::dense_gemm({.a = x, .b = w, .c = y, .m = rows, .n = n, .k = k, .c_f32 = f32_out},
                     stream);
  };
  auto dense_mlp = [&](const bf16* x, const bf16* gu, const bf16* dn, int64_t width,
                       int64_t rows, bf16* y) {
    linear(x, rows, gu, 2 * width, H, mlp_gate_up.as_bf16(), false);
    cuda::silu_mul({.gate_up = mlp_gate_up.as_bf16(), .out = mlp_act.as_bf16(),
                    .num_tokens = rows, .width = width},
                   stream);
    linear(mlp_act.as_bf16(), rows, dn, H, width, y, false);
  };
  const ExpertShape shape{.num_experts = E, .hidden_size = H, .expert_width = I};
  MoeBlock block({.router = router, .shape = shape, .top_k = K, .weights = placement}, layers,
                 plans, buffers,
                 std::make_unique<LocalDispatcher>(E, H, on_input ? weighted_rows.as_bf16()
                                                                  : nullptr),
                 std::make_unique<ResidentExperts>(layers, shape, activation.as_bf16()), linear,
                 dense_mlp);
  const MoeLayerIo io{.hidden = d_hidden.as_bf16(), .num_tokens = T,
                      .num_valid = num_valid.get(), .expert_counts = counts.get(),
                      .out = out.get()};
  if (c.graph) {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    block.enqueue(0, io, stream);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  } else {
    block.enqueue(0, io, stream);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  synchronize();
  cudaStreamDestroy(stream);

  const std::vector<float> x = to_float(hidden);
  // route: the logits, then the choice over the GPU's logits.
  const std::vector<float> gpu_logits = logits.download();
  std::vector<double> want_logits, logit_scale;
  reference_product(x, to_float(router_w), T, E, H, &want_logits, &logit_scale);
  expect_within(gpu_logits, want_logits,
                [&](size_t i) { return 1e-5 * (std::fabs(want_logits[i]) + logit_scale[i]); },
                "router logits");
  moe::RouterOptions cpu_router = router;
  cpu_router.selection_bias = selection_bias.empty() ? nullptr : selection_bias.data();
  moe::Routing routing;
  moe::route(gpu_logits.data(), valid, cpu_router, &routing);
  const std::vector<int32_t> ids = topk_ids.download();
  const std::vector<float> weights = topk_weights.download();
  for (int64_t a = 0; a < valid * K; ++a) {
    ASSERT_EQ(ids[a], routing.topk_ids[a]) << "assignment " << a;
    EXPECT_NEAR(weights[a], routing.topk_weights[a], 1e-5 * std::fabs(routing.topk_weights[a]))
        << "assignment " << a;
  }
  for (int64_t a = valid * K; a < T * K; ++a) {
    EXPECT_EQ(ids[a], E) << "padding assignment " << a;
    EXPECT_EQ(weights[a], 0.0f) << "padding assignment " << a;
  }

  // plan: over E + 1 experts, the padding last.
  moe::Routing padded{.num_tokens = T, .top_k = K, .topk_ids = ids, .topk_weights = weights};
  moe::DispatchPlan cpu_plan;
  moe::plan(padded, E + 1, &cpu_plan);
  const std::vector<int32_t> gpu_offsets = offsets.download();
  for (int64_t e = 0; e <= E + 1; ++e) ASSERT_EQ(gpu_offsets[e], cpu_plan.expert_offsets[e]) << e;
  EXPECT_EQ(src_row.download(), cpu_plan.src_row);
  EXPECT_EQ(inverse.download(), cpu_plan.inverse);
  EXPECT_EQ(counts.download(), cpu_plan.expert_counts);

  // experts: the dispatched rows of the real experts through moe::run_experts (float32).
  const int64_t M = cpu_plan.expert_offsets[E];
  std::vector<float> rows(static_cast<size_t>(M * H));
  for (int64_t r = 0; r < M; ++r) {
    std::copy_n(x.data() + (cpu_plan.src_row[r] / K) * H, H, rows.data() + r * H);
    if (on_input) {
      // As moe::permute under kInput: the row times its weight, in float32.
      const float w = weights[cpu_plan.src_row[r]];
      for (int64_t h = 0; h < H; ++h) rows[r * H + h] *= w;
    }
  }
  if (on_input) {
    // The dispatched rows: bf16 of the weighted float32 row, the padding's rows zero.
    const std::vector<uint16_t> gpu_rows = weighted_rows.download();
    std::vector<double> want_rows(static_cast<size_t>(T * K * H), 0.0);
    std::copy(rows.begin(), rows.end(), want_rows.begin());
    expect_bf16_near(gpu_rows, want_rows, std::vector<double>(want_rows.size(), 0.0),
                     "weighted expert inputs");
  }
  std::vector<moe::ExpertWeights> experts;
  for (int64_t e = 0; e < E; ++e) {
    experts.push_back({.gate = bf16_view(gate_up, e * 2 * I * H, I, H),
                       .up = bf16_view(gate_up, e * 2 * I * H + I * H, I, H),
                       .down = bf16_view(down, e * H * I, H, I)});
  }
  std::vector<float> want_experts(rows.size());
  const std::vector<int32_t> real_offsets(cpu_plan.expert_offsets.begin(),
                                          cpu_plan.expert_offsets.begin() + E + 1);
  moe::run_experts(rows.data(), H, I, real_offsets, experts, want_experts.data());
  std::vector<uint16_t> gpu_experts = expert_out.download();
  gpu_experts.resize(static_cast<size_t>(M * H));
  // The natural scale of a row: its root mean square (the bf16 activation's rounding moves every
  // output by a share of it, however small the output itself).
  std::vector<double> want_e(want_experts.begin(), want_experts.end());
  std::vector<double> scale_e(want_e.size());
  for (int64_t r = 0; r < M; ++r) {
    double squares = 0.0;
    for (int64_t h = 0; h < H; ++h) squares += want_e[r * H + h] * want_e[r * H + h];
    const double rms = std::sqrt(squares / static_cast<double>(H));
    std::fill_n(scale_e.begin() + r * H, H, rms);
  }
  expect_bf16_near(gpu_experts, want_e, scale_e, "expert outputs");

  // shared: SiLU-gated MLP (and its gate) in float64 from the bf16 weights.
  std::vector<float> gpu_shared;
  if (has_shared) {
    const std::vector<uint16_t> shared_bits = shared_out.download();
    const std::vector<float> sgu = to_float(shared_gate_up), sdn = to_float(shared_down);
    std::vector<double> want(static_cast<size_t>(T * H)), scale(want.size());
    for (int64_t t = 0; t < valid; ++t) {
      std::vector<double> act(static_cast<size_t>(Is));
      for (int64_t i = 0; i < Is; ++i) {
        double g = 0.0, u = 0.0;
        for (int64_t h = 0; h < H; ++h) {
          g += static_cast<double>(x[t * H + h]) * sgu[i * H + h];
          u += static_cast<double>(x[t * H + h]) * sgu[(Is + i) * H + h];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      double gate = 1.0;
      if (gated) {
        double z = 0.0;
        for (int64_t h = 0; h < H; ++h) z += static_cast<double>(x[t * H + h]) * bf16_to_f32(shared_gate[h]);
        gate = 1.0 / (1.0 + std::exp(-z));
      }
      // The GPU rounds gate, up and their SiLU product to bf16 (2^-9 each, 2^-7 together at
      // worst) before the down product, so an output can move by 2^-7 of the sum of its terms'
      // magnitudes: that sum is the scale (their root sum of squares, tried first, is a typical
      // error rather than a bound, and one output in ~10^4 exceeded it).
      for (int64_t h = 0; h < H; ++h) {
        double sum = 0.0, magnitudes = 0.0;
        for (int64_t i = 0; i < Is; ++i) {
          const double term = act[i] * sdn[h * Is + i];
          sum += term;
          magnitudes += std::fabs(term);
        }
        want[t * H + h] = gate * sum;
        scale[t * H + h] = gate * magnitudes;
      }
    }
    std::vector<uint16_t> got(shared_bits.begin(), shared_bits.begin() + valid * H);
    want.resize(static_cast<size_t>(valid * H));
    scale.resize(want.size());
    expect_bf16_near(got, want, scale, "shared expert output");
    gpu_shared = to_float(shared_bits);
  }

  // combine: unpermute of the GPU's own expert and shared outputs.
  const std::vector<float> expert_f = to_float(expert_out.download());
  std::vector<float> want_out(static_cast<size_t>(T * H), 0.0f);
  moe::Routing real{.num_tokens = valid, .top_k = K,
                    .topk_ids = std::vector<int32_t>(ids.begin(), ids.begin() + valid * K),
                    .topk_weights = std::vector<float>(weights.begin(), weights.begin() + valid * K)};
  moe::DispatchPlan real_plan = cpu_plan;
  real_plan.inverse.resize(static_cast<size_t>(valid * K));
  moe::unpermute(expert_f.data(), H, real, real_plan, has_shared ? gpu_shared.data() : nullptr,
                 want_out.data(), placement);
  std::vector<float> gpu_out = out.download();
  gpu_out.resize(static_cast<size_t>(valid * H));
  want_out.resize(gpu_out.size());
  float out_scale = 0.0f;
  for (float v : want_out) out_scale = std::max(out_scale, std::fabs(v));
  expect_within(gpu_out, want_out,
                [&](size_t i) { return 1e-5f * (std::fabs(want_out[i]) + out_scale); },
                "block output against unpermute");

  // End to end: the CPU's MoeBlock on the same hidden state, choosing the GPU's experts (a
  // near-tie of two logits may tip the other way in the CPU's own product) with the weights
  // its own logits give them.
  std::vector<float> shared_f32;
  if (has_shared) {
    shared_f32.assign(gpu_shared.begin(), gpu_shared.begin() + valid * H);  // checked above
  }
  moe::MoeBlockOptions cpu_options{.router = router, .hidden_size = H, .expert_width = I,
                                   .weights = placement};
  moe::RoutedExperts cpu_weights{.router = bf16_view(router_w, 0, E, H), .experts = experts};
  moe::MoeBlock cpu_block = moe::single_layer_block(cpu_options, cpu_weights);
  std::vector<float> cpu_out(static_cast<size_t>(valid * H));
  const moe::RouteAdjust replay_gpu_choice = [&](const float* cpu_logits,
                                                   const moe::RouterOptions& options,
                                                   moe::Routing& chosen) {
    chosen.topk_ids.assign(ids.begin(), ids.begin() + valid * K);
    moe::route_weights(cpu_logits, options, &chosen);
  };
  cpu_block.forward(0, x.data(), valid, cpu_weights.router, cpu_router.selection_bias,
                    has_shared ? shared_f32.data() : nullptr, cpu_out.data(), replay_gpu_choice);
  float cpu_scale = 0.0f;
  for (float v : cpu_out) cpu_scale = std::max(cpu_scale, std::fabs(v));
  expect_within(gpu_out, std::vector<double>(cpu_out.begin(), cpu_out.end()),
                [&](size_t i) { return 2e-2f * (std::fabs(cpu_out[i]) + cpu_scale); },
                "block output against the CPU MoeBlock");
}

std::vector<BlockCase> cases() {
  return {
      {.name = "Softmax_E8_K2", .E = 8, .K = 2, .H = 128, .I = 64, .T = 5},
      {.name = "SoftmaxPlain_E60_K4_SharedGated", .E = 60, .K = 4, .H = 192, .I = 128, .Is = 64,
       .T = 19, .router = RouterKind::kSoftmaxPlain, .shared = SharedExpertKind::kSigmoidGated},
      {.name = "SigmoidGroupsBias_E64_K6_Shared", .E = 64, .K = 6, .H = 256, .I = 64, .Is = 128,
       .T = 33, .router = RouterKind::kSigmoidGroupsBias,
       .shared = SharedExpertKind::kUngated},
      {.name = "GroupMax_E16_K3_Padded", .E = 16, .K = 3, .H = 64, .I = 64, .T = 16, .valid = 11,
       .router = RouterKind::kGroupMax},
      {.name = "Softmax_E128_K8_Prefill", .E = 128, .K = 8, .H = 128, .I = 64, .T = 300},
      {.name = "Graph_E32_K4_Padded_SharedGated", .E = 32, .K = 4, .H = 128, .I = 64, .Is = 64,
       .T = 8, .valid = 6, .shared = SharedExpertKind::kSigmoidGated, .graph = true},
      // Llama 4: top-1 sigmoid weights on the experts' input, an ungated shared expert as wide as
      // a routed one; padded graph buckets (the padding's zero weight leaves its rows zero and
      // unread), a prefill-sized step, and top-2 (more than one weighted copy of a token).
      {.name = "Llama4_E16_K1_Shared", .E = 16, .K = 1, .H = 128, .I = 64, .Is = 64, .T = 19,
       .router = RouterKind::kLlama4, .shared = SharedExpertKind::kUngated},
      {.name = "Llama4_Graph_E16_K1_Padded_Shared", .E = 16, .K = 1, .H = 128, .I = 64,
       .Is = 64, .T = 8, .valid = 5, .router = RouterKind::kLlama4,
       .shared = SharedExpertKind::kUngated, .graph = true},
      {.name = "Llama4_E128_K1_Prefill", .E = 128, .K = 1, .H = 192, .I = 128, .Is = 128,
       .T = 300, .router = RouterKind::kLlama4, .shared = SharedExpertKind::kUngated},
      {.name = "Llama4_E8_K2_Padded", .E = 8, .K = 2, .H = 64, .I = 64, .T = 16, .valid = 11,
       .router = RouterKind::kLlama4},
  };
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("MoE block")) return false;
  for (const BlockCase& c : cases()) {
    register_kernel_test("CudaMoeBlock", c.name, [c] { run_case(c); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::gpu

#endif  // MOE_HAVE_CUDA
