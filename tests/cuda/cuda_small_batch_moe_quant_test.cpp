// The small-batch MoE layer (backend/cuda/small_batch_moe.h) over quantised routed experts
// (expert_quant.h's slabs: fp8, int4, MXFP4), on fresh random experts every run (the seed is
// printed on failure; MOE_TEST_SEED replays one). fp8 and int4 experts are quantised from random
// float32 matrices by the project's host quantisers (model/weight_quant.h:
// fake_quantize_fp8_blocks with 1 x group blocks, fake_quantize_int4_groups); the project has no
// MXFP4 quantiser (MXFP4 only arrives in checkpoints), so MXFP4 codes and exponents are drawn at
// random, as cuda_quant_experts_test.cpp does. Every weight's value is QuantizedMatrix::value
// (model/quantized_matrix.h) rounded once to bf16: what the grouped GEMM multiplies.
//
// Each step routes T tokens through small_batch_moe and checks its block output [T, Hp]:
// - against a float64 host reference over those bf16 weights with the kernel's own picks and
//   routing weights: out[t] = sum_k w_tk down_k(SiLU(gate_k . h_t) * (up_k . h_t)), the SiLU
//   product unrounded (the kernel keeps it float32). Tolerance 1e-4 of the element's natural
//   scale, cuda_small_batch_moe_test.cpp's bound and argument: the kernel's only departures are
//   float32 summation orders (the weights are the reference's values exactly), whose linear
//   worst case (Hp + Ip) 2^-24 stays below 1e-4 at these sizes, while one wrong scale, group or
//   nibble moves an element by far more.
// - against the stage-by-stage path on the same picks (moe_plan, the grouped GEMM dequantising
//   the same slabs through moe_experts, unpermute). Tolerance 1e-2 of the natural scale, the bf16
//   contract: that path rounds the SiLU product and each expert's output to bf16 (2^-9 relative
//   each, together at most 2^-8 of the scale) and sums in float32 in other orders.
// Sizes: T = 1, 2, 3, 8, 17, 33, 64; Qwen3-30B-A3B's routing (E 128, K 8, softmax, renormalised)
// on Hp 1088, Ip 192 (smaller than its 2048 and 768 so that 128 quantised experts stay quick on
// the host, yet both several 16-byte code segments per row and partial last groups), and E 8,
// K 2 on Hp 256, Ip 64 with small groups (fp8 8, int4 24), where a lane's vector of codes spans
// several groups. Registered only when a device is present.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/small_batch_moe.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "cuda_test_util.h"
#include "model/quantized_matrix.h"
#include "model/weight_quant.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

struct QuantMoeCase {
  std::string name;
  ExpertQuant quant = ExpertQuant::kFp8;
  int64_t group = 128;
  int64_t E = 8, K = 2, Hp = 256, Ip = 64;
  std::vector<int64_t> tokens = {1, 2, 3, 8, 17, 33, 64};  // T of each step
};

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A [rows, cols] matrix of uniform values of standard deviation `spread`, quantised by the host
// quantisers (MXFP4: random codes of about that size, see the file comment).
QuantizedMatrix quantised_matrix(ExpertQuant q, int64_t group, int64_t rows, int64_t cols,
                                 float spread, uint64_t seed) {
  QuantizedMatrix m{.rows = rows, .cols = cols, .group = group};
  uint64_t state = seed;
  const int64_t n = rows * cols;
  if (q == ExpertQuant::kMxfp4) {
    m.format = CodeFormat::kMxfp4;
    m.codes.resize(n / 2);
    for (auto& c : m.codes) c = static_cast<uint8_t>(splitmix64(state));
    m.exponents.resize(n / 32);
    const int base = 127 + static_cast<int>(std::lround(std::log2(spread / 2.0f)));
    for (auto& e : m.exponents) e = static_cast<uint8_t>(base - 3 + splitmix64(state) % 6);
    return m;
  }
  std::vector<float> w(n);
  const float half_width = std::sqrt(3.0f) * spread;
  for (float& v : w) {
    const float u = static_cast<float>(splitmix64(state) >> 40) * 0x1p-24f;  // [0, 1)
    v = (2.0f * u - 1.0f) * half_width;
  }
  std::vector<float> values(n);
  if (q == ExpertQuant::kFp8) {
    m.format = CodeFormat::kFp8;
    m.codes.resize(n);
    m.scales.resize(rows * m.groups_per_row());
    fake_quantize_fp8_blocks(w.data(), rows, cols, 1, group, values.data(), m.scales.data(),
                             m.codes.data());
  } else {
    m.format = CodeFormat::kInt4;
    std::vector<uint8_t> codes(n);
    std::vector<int32_t> zeros(rows * m.groups_per_row());
    m.scales.resize(zeros.size());
    fake_quantize_int4_groups(w.data(), rows, cols, group, values.data(), m.scales.data(),
                              zeros.data(), codes.data());
    m.zeros.assign(zeros.begin(), zeros.end());
    m.codes.assign(n / 2, 0);
    for (int64_t i = 0; i < n; ++i)
      m.codes[i / 2] |= static_cast<uint8_t>(codes[i] << (4 * (i & 1)));
  }
  return m;
}

// The matrix's slab (expert_quant.h) at `slab`, and its values rounded to bf16 at `values`.
void store_matrix(ExpertQuant q, const QuantizedMatrix& m, uint8_t* slab, uint16_t* values) {
  const QuantMatrixLayout layout = quant_matrix_layout(q, m.rows, m.cols, m.group);
  std::memcpy(slab, m.codes.data(), m.codes.size());
  if (q == ExpertQuant::kMxfp4) {
    std::memcpy(slab + layout.scale_offset, m.exponents.data(), m.exponents.size());
  } else {
    std::memcpy(slab + layout.scale_offset, m.scales.data(), m.scales.size() * 4);
  }
  if (q == ExpertQuant::kInt4) {
    std::memcpy(slab + layout.zero_offset, m.zeros.data(), m.zeros.size() * 4);
  }
  for (int64_t r = 0; r < m.rows; ++r) {
    for (int64_t c = 0; c < m.cols; ++c) values[r * m.cols + c] = f32_to_bf16(m.value(r, c));
  }
}

// One layer on the host: the router, each expert's slabs, and their values.
struct HostLayer {
  std::vector<uint16_t> router;        // [E, Hp]
  std::vector<uint8_t> gate_up_slabs;  // E slabs of [2 Ip, Hp]
  std::vector<uint8_t> down_slabs;     // E slabs of [Hp, Ip]
  std::vector<uint16_t> gate_up;       // [E, 2 Ip, Hp] the slabs' values in bf16
  std::vector<uint16_t> down;          // [E, Hp, Ip]
};

HostLayer make_layer(const QuantMoeCase& c, std::mt19937& rng) {
  HostLayer L;
  const QuantMatrixLayout gu = quant_matrix_layout(c.quant, 2 * c.Ip, c.Hp, c.group);
  const QuantMatrixLayout dn = quant_matrix_layout(c.quant, c.Hp, c.Ip, c.group);
  L.gate_up_slabs.assign(c.E * gu.bytes, 0);
  L.down_slabs.assign(c.E * dn.bytes, 0);
  L.gate_up.resize(c.E * 2 * c.Ip * c.Hp);
  L.down.resize(c.E * c.Hp * c.Ip);
  const uint64_t seed = (static_cast<uint64_t>(rng()) << 32) | rng();
  const float gate_up_spread = 1.0f / std::sqrt(static_cast<float>(c.Hp));
  const float down_spread = 1.0f / std::sqrt(static_cast<float>(c.Ip));
  parallel_for(c.E, [&](int64_t begin, int64_t end) {
    for (int64_t e = begin; e < end; ++e) {
      const QuantizedMatrix g = quantised_matrix(c.quant, c.group, 2 * c.Ip, c.Hp, gate_up_spread,
                                                 seed ^ (0xD1B54A32D192ED03ull * (2 * e + 1)));
      const QuantizedMatrix d = quantised_matrix(c.quant, c.group, c.Hp, c.Ip, down_spread,
                                                 seed ^ (0xD1B54A32D192ED03ull * (2 * e + 2)));
      store_matrix(c.quant, g, &L.gate_up_slabs[e * gu.bytes], &L.gate_up[e * 2 * c.Ip * c.Hp]);
      store_matrix(c.quant, d, &L.down_slabs[e * dn.bytes], &L.down[e * c.Hp * c.Ip]);
    }
  });
  L.router = random_bf16(c.E * c.Hp, rng, gate_up_spread);  // logits ~ N(0, 1)
  return L;
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

// One expert's output for one row in float64 over the bf16 values, and each element's natural
// scale (cuda_small_batch_moe_test.cpp's expert_reference).
void expert_reference(const uint16_t* x, const uint16_t* gate_up, const uint16_t* down, int64_t Hp,
                      int64_t width, double* y, double* scale) {
  std::vector<double> act(width), act_scale(width);
  for (int64_t i = 0; i < width; ++i) {
    double g = 0, gm = 0, u = 0, um = 0;
    for (int64_t h = 0; h < Hp; ++h) {
      const double xh = bf16_to_f32(x[h]);
      const double tg = xh * bf16_to_f32(gate_up[i * Hp + h]);
      const double tu = xh * bf16_to_f32(gate_up[(width + i) * Hp + h]);
      g += tg, gm += std::fabs(tg), u += tu, um += std::fabs(tu);
    }
    act[i] = silu(g) * u;
    act_scale[i] = std::fabs(silu(g)) * um + 1.1 * gm * std::fabs(u);
  }
  for (int64_t h = 0; h < Hp; ++h) {
    double v = 0, s = 0;
    for (int64_t i = 0; i < width; ++i) {
      const double w = bf16_to_f32(down[h * width + i]);
      v += w * act[i];
      s += std::fabs(w) * act_scale[i];
    }
    y[h] = v;
    scale[h] = s;
  }
}

// The stage-by-stage path on the small path's picks: plan, grouped GEMMs that dequantise the
// slabs, unpermute. Returns its block output [T, Hp].
std::vector<float> stage_path(const QuantMoeCase& c, int64_t T,
                              const DeviceBuffer<uint16_t>& hidden,
                              const DeviceBuffer<int32_t>& ids, const DeviceBuffer<float>& weights,
                              const DeviceBuffer<uint8_t>& gate_up,
                              const DeviceBuffer<uint8_t>& down) {
  const int64_t M = T * c.K;
  DeviceBuffer<int32_t> counts(c.E), offsets(c.E + 1), src_row(M), inverse(M);
  DeviceBuffer<int32_t> plan_workspace(std::max<int64_t>(plan_workspace_size(M, c.E), 1));
  DeviceBuffer<uint16_t> activation(M * c.Ip), expert_out(M * c.Hp);
  DeviceBuffer<float> out(T * c.Hp);
  out.poison();
  moe_plan({.topk_ids = ids.get(),
            .expert_counts = counts.get(),
            .expert_offsets = offsets.get(),
            .src_row = src_row.get(),
            .inverse = inverse.get(),
            .workspace = plan_workspace_size(M, c.E) > 0 ? plan_workspace.get() : nullptr,
            .num_assignments = M,
            .num_experts = c.E},
           nullptr);
  moe_experts({.rows = hidden.as_bf16(),
               .gate_up = reinterpret_cast<const __nv_bfloat16*>(gate_up.get()),
               .down = reinterpret_cast<const __nv_bfloat16*>(down.get()),
               .quant = c.quant,
               .quant_group = c.group,
               .expert_offsets = offsets.get(),
               .activation = activation.as_bf16(),
               .out = expert_out.as_bf16(),
               .num_rows = M,
               .num_experts = c.E,
               .hidden_size = c.Hp,
               .expert_width = c.Ip,
               .src_row = src_row.get(),
               .top_k = c.K},
              nullptr);
  unpermute({.expert_out = expert_out.as_bf16(),
             .topk_weights = weights.get(),
             .inverse = inverse.get(),
             .out = out.get(),
             .num_tokens = T,
             .top_k = c.K,
             .hidden_size = c.Hp},
            nullptr);
  synchronize();
  return out.download();
}

void run_case(const QuantMoeCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(std::hash<std::string>{}(c.name)));
  ASSERT_TRUE(small_moe_supports_quant(c.quant, c.group, c.Hp, c.Ip));
  const HostLayer L = make_layer(c, rng);
  const DeviceBuffer<uint16_t> router(L.router);
  const DeviceBuffer<uint8_t> gate_up(L.gate_up_slabs), down(L.down_slabs);
  const int64_t max_t = *std::max_element(c.tokens.begin(), c.tokens.end());
  const int64_t bytes = small_moe_workspace_bytes(max_t, c.E, c.K, c.Hp, c.Ip, 0);
  DeviceBuffer<unsigned char> workspace(bytes);
  CUDA_CHECK(cudaMemset(workspace.get(), 0, bytes));
  for (const int64_t T : c.tokens) {
    SCOPED_TRACE("T=" + std::to_string(T));
    ASSERT_TRUE(small_moe_supports(T, c.E, c.K, c.Hp, c.Ip, 0));
    const std::vector<uint16_t> hidden_bits = random_bf16(T * c.Hp, rng, 1.0f);
    const DeviceBuffer<uint16_t> hidden(hidden_bits);
    DeviceBuffer<float> logits(T * c.E), weights(T * c.K), out(T * c.Hp);
    DeviceBuffer<int32_t> ids(T * c.K);
    logits.poison();
    weights.poison();
    out.poison();
    ids.poison();
    small_batch_moe({.hidden = hidden.as_bf16(),
                     .router = router.as_bf16(),
                     .route = RouterParams{.logits = logits.get(),
                                           .topk_ids = ids.get(),
                                           .topk_weights = weights.get(),
                                           .num_tokens = T,
                                           .num_experts = c.E,
                                           .top_k = c.K,
                                           .score = RouterScore::kSoftmax,
                                           .renormalize = true},
                     .gate_up = reinterpret_cast<const bf16*>(gate_up.get()),
                     .down = reinterpret_cast<const bf16*>(down.get()),
                     .quant = c.quant,
                     .quant_group = c.group,
                     .expert_width = c.Ip,
                     .out = out.get(),
                     .workspace = workspace.get(),
                     .hidden_size = c.Hp},
                    nullptr);
    synchronize();
    const std::vector<float> got = out.download();
    const std::vector<int32_t> got_ids = ids.download();
    const std::vector<float> got_weights = weights.download();
    for (int32_t e : got_ids) ASSERT_TRUE(e >= 0 && e < c.E) << "expert id " << e;

    // float64 reference on the kernel's picks.
    const int64_t tasks = T * c.K;
    std::vector<double> y(tasks * c.Hp), y_scale(tasks * c.Hp);
    parallel_for(tasks, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t e = got_ids[task];
        expert_reference(&hidden_bits[(task / c.K) * c.Hp], &L.gate_up[e * 2 * c.Ip * c.Hp],
                         &L.down[e * c.Hp * c.Ip], c.Hp, c.Ip, &y[task * c.Hp],
                         &y_scale[task * c.Hp]);
      }
    });
    std::vector<double> want(T * c.Hp, 0.0), scale(T * c.Hp, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < c.K; ++k) {
        const double w = got_weights[t * c.K + k];
        for (int64_t h = 0; h < c.Hp; ++h) {
          want[t * c.Hp + h] += w * y[(t * c.K + k) * c.Hp + h];
          scale[t * c.Hp + h] += std::fabs(w) * y_scale[(t * c.K + k) * c.Hp + h];
        }
      }
    }
    expect_within(
        got, want, [&](size_t i) { return 1e-4 * scale[i]; }, "out against float64");

    const std::vector<float> staged = stage_path(c, T, hidden, ids, weights, gate_up, down);
    const std::vector<double> staged_wide(staged.begin(), staged.end());
    expect_within(
        got, staged_wide, [&](size_t i) { return 1e-2 * scale[i]; },
        "out against the stage-by-stage path");
  }
}

std::vector<QuantMoeCase> cases() {
  std::vector<QuantMoeCase> out;
  // Qwen3-30B-A3B's routing with the groups --weights gives (MXFP4: 32 always).
  for (const auto& [quant, group] :
       {std::pair{ExpertQuant::kFp8, int64_t{128}}, std::pair{ExpertQuant::kInt4, int64_t{128}},
        std::pair{ExpertQuant::kMxfp4, int64_t{32}}}) {
    out.push_back({.name = std::string("Qwen3_") + expert_quant_name(quant) + "_E128_K8_H1088_I192",
                   .quant = quant,
                   .group = group,
                   .E = 128,
                   .K = 8,
                   .Hp = 1088,
                   .Ip = 192});
  }
  // Small groups: a lane's 16 bytes of codes span 2 fp8 groups, or int4 groups that straddle
  // vectors (24 inputs against 32 per vector).
  out.push_back(
      {.name = "Small_fp8_group8_E8_K2_H256_I64", .quant = ExpertQuant::kFp8, .group = 8});
  out.push_back(
      {.name = "Small_int4_group24_E8_K2_H256_I64", .quant = ExpertQuant::kInt4, .group = 24});
  out.push_back({.name = "Small_mxfp4_E8_K2_H256_I64", .quant = ExpertQuant::kMxfp4, .group = 32});
  return out;
}

TEST(CudaSmallMoeQuantChecks, SupportsTheReadableFormats) {
  EXPECT_TRUE(small_moe_supports_quant(ExpertQuant::kNone, 0, 2048, 768));
  EXPECT_TRUE(small_moe_supports_quant(ExpertQuant::kFp8, 128, 2048, 768));  // --weights fp8
  EXPECT_TRUE(small_moe_supports_quant(ExpertQuant::kFp8, 8, 2048, 784));    // Ip 16 x 49
  EXPECT_TRUE(small_moe_supports_quant(ExpertQuant::kInt4, 128, 2048, 768));
  EXPECT_TRUE(small_moe_supports_quant(ExpertQuant::kInt4, 24, 2048, 768));
  EXPECT_TRUE(small_moe_supports_quant(ExpertQuant::kMxfp4, 32, 2880, 2880));  // GPT-OSS
  EXPECT_FALSE(small_moe_supports_quant(ExpertQuant::kFp8, 12, 2048, 768));    // group
  EXPECT_FALSE(small_moe_supports_quant(ExpertQuant::kFp8, 128, 2048, 200));   // Ip % 16
  EXPECT_FALSE(small_moe_supports_quant(ExpertQuant::kInt4, 128, 2048, 784));  // Ip % 32
  EXPECT_FALSE(small_moe_supports_quant(ExpertQuant::kMxfp4, 16, 2048, 768));  // group 32 only
  EXPECT_FALSE(small_moe_supports_quant(static_cast<ExpertQuant>(9), 32, 2048, 768));
}

TEST(CudaSmallMoeQuantChecks, LauncherNamesTheBadGroup) {
  alignas(256) uint16_t bf16_buf[256] = {};
  alignas(16) float float_buf[64] = {};
  alignas(16) int32_t int_buf[64] = {};
  alignas(16) unsigned char workspace[64] = {};
  const auto* in = reinterpret_cast<const bf16*>(bf16_buf);
  SmallMoeParams p{.hidden = in,
                   .router = in,
                   .route = RouterParams{.logits = float_buf,
                                         .topk_ids = int_buf,
                                         .topk_weights = float_buf,
                                         .num_tokens = 2,
                                         .num_experts = 8,
                                         .top_k = 2},
                   .gate_up = in,
                   .down = in,
                   .quant = ExpertQuant::kInt4,
                   .quant_group = 12,
                   .expert_width = 64,
                   .out = float_buf,
                   .workspace = workspace,
                   .hidden_size = 64};
  expect_error_naming([&] { small_batch_moe(p, nullptr); }, "quant_group = 12");
  p.quant = ExpertQuant::kMxfp4;
  p.quant_group = 32;
  p.expert_width = 48;
  expect_error_naming([&] { small_batch_moe(p, nullptr); }, "expert_width = 48");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("small-batch MoE over quantised experts")) return false;
  for (const QuantMoeCase& c : cases()) {
    register_kernel_test(
        "CudaSmallBatchMoeQuant", c.name, [c] { run_case(c); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
