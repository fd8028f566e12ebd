// Synthetic models under --weights fp8|int4 (gpu::synthetic_weights): every routed expert's
// gate_up and down are quantised slabs (backend/cuda/expert_quant.h) of random codes and scales
// drawn on the device (cuda::quant_random_fill), everything else the bf16 weights of the same
// seed. Checked here:
// - without a device: the planned bytes (device_weight_bytes) are the bf16 plan's with every
//   routed expert replaced by its slabs, at the full qwen3-30b-a3b shape (fp8 about half, int4
//   about a quarter of the experts' bf16 bytes); the fill's launcher refuses what it cannot draw;
// - on a device (registered only with one): the decoder holds and reports those bytes and takes
//   the quantised expert path; two builds of one seed are the same bytes, the non-expert
//   matrices equal the bf16 build's, and the dequantised expert values lie in
//   [-1/sqrt(fan-in), 1/sqrt(fan-in)] with the bf16 values' spread; scripted prefill and decode
//   steps through 48 layers give finite logits of about the bf16 model's size; a one-token step
//   takes the small-batch MoE path (its profile has no plan or unpermute stage) with logits
//   within 2e-2 relative of the stage-by-stage path's.
// Under --weights-scope linear the attention's QKV and O projections are slabs of random codes
// too: the planned and held bytes are the experts-only plan's with each replaced by its slab;
// scripted steps give finite logits of about the bf16 model's size; a one-token step's logits
// through the quantised skinny GEMM agree with the dequantise-then-cuBLAS path's (skinny rows 0)
// within 2e-2 relative.
// The logits are not compared with a bf16 model built from the dequantised values: the decoder
// has no way in for device weights other than the two builders. No timing here (bench does it).
// Compiled only with the CUDA toolkit (the no-device checks need its launchers).
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../support/random_schedule.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/expert_quant.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "model/cuda/device_weights.h"
#include "model/gpu_decoder.h"
#include "model/synthetic.h"
#include "model/weight_quant.h"
#include "profile/profiler.h"

namespace moeinfer {
namespace {

constexpr WeightFormat kFormats[] = {WeightFormat::kFp8, WeightFormat::kInt4};

// qwen3-30b-a3b's layer shapes (H 2048, I 768, 32 + 4 heads of 128) with fewer layers and
// experts and a small vocabulary, so that a test's model is a few hundred MiB.
ModelConfig cut_qwen3(int64_t num_layers, int64_t num_experts) {
  nlohmann::json j = nlohmann::json::parse(synthetic_config_json("qwen3-30b-a3b"));
  j["num_hidden_layers"] = num_layers;
  j["num_experts"] = num_experts;
  j["vocab_size"] = 4096;
  return parse_model_config(j.dump(), "synthetic:qwen3-30b-a3b (cut)");
}

int64_t moe_layers(const ModelConfig& c) {
  return std::count(c.layer_is_moe.begin(), c.layer_is_moe.end(), true);
}

// One expert's gate_up and down slabs in `format` (the groups --weights gives), and in bf16.
int64_t quant_expert_bytes(const ModelConfig& c, WeightFormat format) {
  const gpu::ExpertCodes codes = gpu::expert_codes_for(format);
  const int64_t Hp = gpu::padded_hidden_size(c), Ip = gpu::padded_expert_width(c);
  return cuda::quant_matrix_layout(codes.format, 2 * Ip, Hp, codes.group).bytes +
         cuda::quant_matrix_layout(codes.format, Hp, Ip, codes.group).bytes;
}
int64_t bf16_expert_bytes(const ModelConfig& c) {
  const int64_t Hp = gpu::padded_hidden_size(c), Ip = gpu::padded_expert_width(c);
  return (2 * Ip * Hp + Hp * Ip) * 2;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

// No device needed: the plan of the full model.
TEST(SyntheticQuant, PlannedBytesReplaceEachExpertBySlabs) {
  const ModelConfig c = synthetic_model_config("qwen3-30b-a3b");
  const int64_t bf16 = gpu::device_weight_bytes(c, 1);
  EXPECT_EQ(gpu::device_weight_bytes(c, 1, WeightFormat::kCheckpoint), bf16);
  EXPECT_EQ(gpu::device_weight_bytes(c, 1, WeightFormat::kBf16), bf16);
  const int64_t experts = moe_layers(c) * c.num_experts;
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    const int64_t quant = quant_expert_bytes(c, format);
    const int64_t want = bf16 - experts * (bf16_expert_bytes(c) - quant);
    EXPECT_EQ(gpu::device_weight_bytes(c, 1, format), want);
    // fp8: a byte a value and a 4-byte scale per 128; int4: half a byte, scale and zero point.
    const double ratio = static_cast<double>(quant) / static_cast<double>(bf16_expert_bytes(c));
    if (format == WeightFormat::kFp8) {
      EXPECT_GT(ratio, 0.5);
      EXPECT_LT(ratio, 0.52);
    } else {
      EXPECT_GT(ratio, 0.25);
      EXPECT_LT(ratio, 0.29);
    }
    std::printf(
        "synthetic:qwen3-30b-a3b --weights %s: %.2f GiB (bf16 %.2f GiB), %.3f MiB an "
        "expert (bf16 %.3f)\n",
        std::string(weight_format_name(format)).c_str(), want / 1073741824.0, bf16 / 1073741824.0,
        quant / 1048576.0, bf16_expert_bytes(c) / 1048576.0);
  }
  const gpu::ExpertCodes fp8 = gpu::expert_codes_for(WeightFormat::kFp8);
  const gpu::ExpertCodes int4 = gpu::expert_codes_for(WeightFormat::kInt4);
  EXPECT_EQ(fp8.format, cuda::ExpertQuant::kFp8);
  EXPECT_EQ(fp8.group, kFp8BlockSize);
  EXPECT_EQ(int4.format, cuda::ExpertQuant::kInt4);
  EXPECT_EQ(int4.group, kInt4GroupSize);
  EXPECT_EQ(gpu::expert_codes_for(WeightFormat::kBf16).format, cuda::ExpertQuant::kNone);
}

// The QKV and O projections of every layer of a qwen3-30b-a3b-shaped config: [rows, cols] each.
std::vector<std::pair<int64_t, int64_t>> dense_linears(const ModelConfig& c) {
  const int64_t Dp = gpu::padded_head_dim(c), Hp = gpu::padded_hidden_size(c);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    out.push_back({(c.num_heads + 2 * c.num_kv_heads) * Dp, Hp});
    out.push_back({Hp, c.num_heads * Dp});
  }
  return out;
}

int64_t round_up_256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// No device needed: --weights-scope linear's plan.
TEST(SyntheticQuant, PlannedBytesUnderLinearScopeReplaceTheDenseLinearsBySlabs) {
  const ModelConfig c = synthetic_model_config("qwen3-30b-a3b");
  const int64_t bf16 = gpu::device_weight_bytes(c, 1);
  EXPECT_EQ(gpu::device_weight_bytes(c, 1, WeightFormat::kCheckpoint, WeightScope::kLinear), bf16);
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    const gpu::ExpertCodes codes = gpu::expert_codes_for(format);
    const int64_t experts_only = gpu::device_weight_bytes(c, 1, format);
    int64_t dense_bf16 = 0, dense_quant = 0;
    for (const auto& [rows, cols] : dense_linears(c)) {
      dense_bf16 += round_up_256(rows * cols * 2);
      dense_quant += cuda::quant_matrix_layout(codes.format, rows, cols, codes.group).bytes;
    }
    EXPECT_EQ(gpu::device_weight_bytes(c, 1, format, WeightScope::kLinear),
              experts_only - dense_bf16 + dense_quant);
    // What a batch-1 decode step reads per layer: the dense projections and 8 experts.
    const double layer_bf16 =
        static_cast<double>(dense_bf16 / c.num_layers + 8 * bf16_expert_bytes(c));
    const double layer_quant =
        static_cast<double>(dense_quant / c.num_layers + 8 * quant_expert_bytes(c, format));
    std::printf(
        "synthetic:qwen3-30b-a3b --weights %s --weights-scope linear: %.2f GiB; a layer's decode "
        "bytes at batch 1: %.1f MB (bf16 %.1f MB, %.2fx fewer)\n",
        std::string(weight_format_name(format)).c_str(),
        gpu::device_weight_bytes(c, 1, format, WeightScope::kLinear) / 1073741824.0,
        layer_quant / 1e6, layer_bf16 / 1e6, layer_bf16 / layer_quant);
  }
  // The scope needs codes to draw: refused before any device work.
  EXPECT_NE(error_of([&] {
              gpu::synthetic_weights(c, 1, {}, false, WeightFormat::kCheckpoint,
                                     WeightScope::kLinear);
            }).find("--weights-scope linear"),
            std::string::npos);
}

// No device needed: the launcher refuses before it touches one.
TEST(SyntheticQuant, FillRefusesWhatItCannotDraw) {
  EXPECT_NE(error_of([] {
              cuda::quant_random_fill({.num_slabs = 1,
                                       .rows = 8,
                                       .cols = 64,
                                       .format = cuda::ExpertQuant::kMxfp4,
                                       .group = 32},
                                      nullptr);
            }).find("format mxfp4"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              cuda::quant_random_fill({.num_slabs = 1,
                                       .rows = 8,
                                       .cols = 66,
                                       .format = cuda::ExpertQuant::kFp8,
                                       .group = 128},
                                      nullptr);
            }).find("cols = 66"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              cuda::quant_random_fill({.num_slabs = 1,
                                       .rows = 8,
                                       .cols = 64,
                                       .format = cuda::ExpertQuant::kInt4,
                                       .group = 12},
                                      nullptr);
            }).find("group = 12"),
            std::string::npos);
}

// The decoder holds the slabs, reports them, and takes the quantised path.
void synthetic_holds_the_codes() {
  const ModelConfig c = cut_qwen3(2, 16);
  const GpuOptions options{.max_batch_tokens = 16,
                           .max_num_seqs = 2,
                           .max_model_len = 32,
                           .num_kv_blocks = 4,
                           .quiet = true};
  const auto bf16 = GpuDecoder::create_synthetic(c, options, {.seed = 1});
  EXPECT_EQ(bf16->memory().weight_bytes, gpu::device_weight_bytes(c, 1));
  EXPECT_EQ(bf16->memory().expert_format, "bf16");
  EXPECT_EQ(bf16->memory().expert_bytes, bf16_expert_bytes(c));
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    const auto gpu =
        GpuDecoder::create_synthetic(c, options, {.seed = 1, .expert_weights = format});
    const GpuMemoryReport& mem = gpu->memory();
    const int64_t quant = quant_expert_bytes(c, format);
    EXPECT_EQ(mem.weight_bytes, gpu::device_weight_bytes(c, 1, format));
    EXPECT_EQ(mem.weight_bytes, bf16->memory().weight_bytes -
                                    moe_layers(c) * c.num_experts * (bf16_expert_bytes(c) - quant));
    EXPECT_EQ(mem.expert_format, weight_format_name(format));
    EXPECT_EQ(mem.expert_bytes, quant);
    EXPECT_EQ(mem.routed_expert_bytes, moe_layers(c) * c.num_experts * quant);
  }
  // --expert-budget with quantised synthetic experts is refused naming both flags.
  GpuOptions offloaded = options;
  offloaded.offload = {.budget_fraction = 0.25};
  const std::string message = error_of([&] {
    GpuDecoder::create_synthetic(c, offloaded, {.seed = 1, .expert_weights = WeightFormat::kInt4});
  });
  EXPECT_NE(message.find("--weights int4 with --expert-budget"), std::string::npos) << message;
}

std::vector<char> to_host(const void* p, size_t bytes) {
  std::vector<char> out(bytes);
  CUDA_CHECK(cudaMemcpy(out.data(), p, bytes, cudaMemcpyDeviceToHost));
  return out;
}

// One expert's dequantised [rows, cols] matrix (expert_quant.h's formulas), from its slab.
std::vector<float> dequantise(const std::vector<char>& slab, cuda::ExpertQuant format, int64_t rows,
                              int64_t cols, int64_t group) {
  const cuda::QuantMatrixLayout l = cuda::quant_matrix_layout(format, rows, cols, group);
  const auto* codes = reinterpret_cast<const uint8_t*>(slab.data());
  const auto* scales = reinterpret_cast<const float*>(slab.data() + l.scale_offset);
  const auto* zeros = reinterpret_cast<const float*>(slab.data() + l.zero_offset);
  const std::array<float, 256>& e4m3 = f8e4m3_values();
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols; ++k) {
      const int64_t g = r * l.groups_per_row + k / group;
      if (format == cuda::ExpertQuant::kFp8) {
        out[r * cols + k] = e4m3[codes[r * l.row_code_bytes + k]] * scales[g];
      } else {
        const uint32_t q = (codes[r * l.row_code_bytes + k / 2] >> (4 * (k & 1))) & 0xfu;
        out[r * cols + k] = (static_cast<float>(q) - zeros[g]) * scales[g];
      }
    }
  }
  return out;
}

struct Spread {
  double mean = 0.0, mean_square = 0.0, max_abs = 0.0;
};
Spread spread_of(const std::vector<float>& v) {
  Spread s;
  for (float x : v) {
    s.mean += x;
    s.mean_square += static_cast<double>(x) * x;
    s.max_abs = std::max(s.max_abs, static_cast<double>(std::fabs(x)));
  }
  s.mean /= static_cast<double>(v.size());
  s.mean_square /= static_cast<double>(v.size());
  return s;
}

// Same seed, same bytes; the non-expert matrices are the bf16 build's; the experts' values have
// the bf16 experts' range and spread (uniform in [-s, s): mean 0, mean square s^2 / 3).
void synthetic_codes_are_deterministic_and_spread_like_bf16() {
  const ModelConfig c = cut_qwen3(2, 16);
  const int64_t H = c.hidden_size, I = c.moe_intermediate_size, V = c.vocab_size;
  const gpu::DeviceWeights plain = gpu::synthetic_weights(c, 5, {});
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    const gpu::ExpertCodes codes = gpu::expert_codes_for(format);
    const gpu::DeviceWeights a = gpu::synthetic_weights(c, 5, {}, false, format);
    const gpu::DeviceWeights b = gpu::synthetic_weights(c, 5, {}, false, format);
    const gpu::DeviceWeights other = gpu::synthetic_weights(c, 6, {}, false, format);
    ASSERT_EQ(a.expert_quant, codes.format);
    ASSERT_EQ(a.expert_quant_group, codes.group);
    ASSERT_EQ(a.bytes, b.bytes);
    EXPECT_TRUE(to_host(a.allocation.get(), a.bytes) == to_host(b.allocation.get(), b.bytes))
        << "two builds of seed 5 differ";
    const cuda::QuantMatrixLayout gu = cuda::quant_matrix_layout(codes.format, 2 * I, H, 128);
    const cuda::QuantMatrixLayout down = cuda::quant_matrix_layout(codes.format, H, I, 128);
    EXPECT_FALSE(to_host(a.layers[1].experts_down, down.bytes) ==
                 to_host(other.layers[1].experts_down, down.bytes))
        << "seeds 5 and 6 give the same codes";
    // The other matrices: the bf16 build's values (the same jobs draw them).
    EXPECT_TRUE(to_host(a.embed, V * H * 2) == to_host(plain.embed, V * H * 2));
    EXPECT_TRUE(to_host(a.lm_head, V * H * 2) == to_host(plain.lm_head, V * H * 2));
    const int64_t qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    EXPECT_TRUE(to_host(a.layers[1].qkv, qkv_rows * H * 2) ==
                to_host(plain.layers[1].qkv, qkv_rows * H * 2));
    EXPECT_TRUE(to_host(a.layers[0].router, c.num_experts * H * 2) ==
                to_host(plain.layers[0].router, c.num_experts * H * 2));

    // Expert 3 of layer 0 (gate_up, fan-in H) and of layer 1 (down, fan-in I), against the
    // bf16 build's same matrices.
    struct Matrix {
      const char* name;
      const void* quant;
      const gpu::bf16* values;
      int64_t rows, cols, slab_bytes;
    };
    const Matrix matrices[] = {
        {"gate_up", a.layers[0].experts_gate_up, plain.layers[0].experts_gate_up, 2 * I, H,
         gu.bytes},
        {"down", a.layers[1].experts_down, plain.layers[1].experts_down, H, I, down.bytes}};
    constexpr int64_t kExpert = 3;
    for (const Matrix& m : matrices) {
      SCOPED_TRACE(m.name);
      const std::vector<char> slab =
          to_host(static_cast<const char*>(m.quant) + kExpert * m.slab_bytes, m.slab_bytes);
      const std::vector<float> values = dequantise(slab, codes.format, m.rows, m.cols, 128);
      const std::vector<char> raw =
          to_host(m.values + kExpert * m.rows * m.cols, m.rows * m.cols * 2);
      std::vector<float> want(static_cast<size_t>(m.rows * m.cols));
      for (size_t i = 0; i < want.size(); ++i) {
        uint16_t bits;
        std::memcpy(&bits, raw.data() + 2 * i, 2);
        want[i] = bf16_to_f32(bits);
      }
      const double s = 1.0 / std::sqrt(static_cast<double>(m.cols));
      const Spread got = spread_of(values), ref = spread_of(want);
      EXPECT_LE(got.max_abs, s * (1.0 + 1e-6));
      EXPECT_GT(got.max_abs, 0.8 * s);
      EXPECT_LT(std::fabs(got.mean), 0.01 * s);
      EXPECT_NEAR(got.mean_square / (s * s), 1.0 / 3.0, 0.03);
      EXPECT_NEAR(got.mean_square / ref.mean_square, 1.0, 0.1);
      std::printf("%s %s: max %.4g s, mean %.3g s, mean square %.4f s^2 (bf16 %.4f s^2)\n",
                  std::string(weight_format_name(format)).c_str(), m.name, got.max_abs / s,
                  got.mean / s, got.mean_square / (s * s), ref.mean_square / (s * s));
    }
  }
}

// Prefill and decode steps through qwen3-30b-a3b's 48 layers (16 experts each): finite logits
// of about the bf16 model's size under both formats.
void synthetic_quant_decodes_finite_logits() {
  const ModelConfig c = cut_qwen3(48, 16);
  const testing::Schedule s = testing::make_schedule(c.vocab_size, 11, 16);
  const GpuOptions options{.max_batch_tokens = 64,
                           .max_num_seqs = 4,
                           .max_model_len = 64,
                           .block_size = 16,
                           .num_kv_blocks = s.num_blocks,
                           .quiet = true};
  auto rms_of_run = [&](WeightFormat format) {
    const auto gpu =
        GpuDecoder::create_synthetic(c, options, {.seed = 2, .expert_weights = format});
    double sum_sq = 0.0;
    int64_t count = 0;
    for (size_t i = 0; i < s.steps.size(); ++i) {
      const testing::ScheduledStep& step = s.steps[i];
      std::vector<float> logits(
          static_cast<size_t>(Decoder::num_logit_rows(step.batch) * c.vocab_size));
      gpu->forward(step.batch, logits);
      for (float x : logits) {
        EXPECT_TRUE(std::isfinite(x)) << "step " << i;
        if (!std::isfinite(x)) return -1.0;
        sum_sq += static_cast<double>(x) * x;
      }
      count += static_cast<int64_t>(logits.size());
    }
    return std::sqrt(sum_sq / static_cast<double>(std::max<int64_t>(count, 1)));
  };
  const double bf16 = rms_of_run(WeightFormat::kCheckpoint);
  ASSERT_GT(bf16, 0.0);
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    const double rms = rms_of_run(format);
    std::printf("48 layers, %s experts: logit rms %.4g (bf16 %.4g)\n",
                std::string(weight_format_name(format)).c_str(), rms, bf16);
    EXPECT_GT(rms, 0.5 * bf16);
    EXPECT_LT(rms, 2.0 * bf16);
  }
}

// A one-token step with quantised experts takes the small-batch MoE path where it is on
// (small_batch_moe_rows; it reads the codes itself since it learnt the formats): the profiler sees
// each MoE layer's route and experts stages and no plan or unpermute, which only the stage-by-stage
// path closes. Its logits agree with the stage-by-stage path's (small_batch_moe_rows = 0) within
// the GPU parity bound of 2e-2 relative (cuda_parity_test.cpp): both multiply the same dequantised
// bf16 weights, the stage path rounding the SiLU product and the expert outputs to bf16 on the way.
void synthetic_quant_decode_takes_the_small_batch_path() {
  const ModelConfig c = cut_qwen3(2, 16);
  const std::vector<int32_t> table = {0, 1};
  const std::vector<int32_t> token = {17};
  auto logits_of = [&](WeightFormat format, int64_t small_batch_rows, profile::Profiler* profiler) {
    const GpuOptions options{.max_batch_tokens = 16,
                             .max_num_seqs = 2,
                             .max_model_len = 32,
                             .num_kv_blocks = 4,
                             .quiet = true,
                             .small_batch_moe_rows = small_batch_rows};
    const auto gpu =
        GpuDecoder::create_synthetic(c, options, {.seed = 3, .expert_weights = format});
    std::vector<float> logits(static_cast<size_t>(c.vocab_size));
    profile::ActiveProfiler on(profiler);
    if (profiler) profiler->begin_step(1);
    gpu->forward({.sequences = {{.tokens = token, .position = 0, .block_table = table}}}, logits);
    if (profiler) profiler->end_step();
    return logits;
  };
  // The path is opt-in (--fused-moe-rows, off by default): on up to 64 rows here.
  constexpr int64_t kFusedRows = 64;
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    profile::Profiler profiler({.num_layers = c.num_layers, .num_experts = c.num_experts});
    const std::vector<float> fused = logits_of(format, kFusedRows, &profiler);
    const profile::StepRecord& r = profiler.steps().back();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      if (!c.layer_is_moe[l]) continue;
      EXPECT_GT(r.ns(l, profile::Stage::kExperts), 0) << "layer " << l;
      EXPECT_EQ(r.ns(l, profile::Stage::kPlan), 0)
          << "layer " << l << " ran the stage-by-stage path (its plan stage was timed)";
      EXPECT_EQ(r.ns(l, profile::Stage::kUnpermute), 0) << "layer " << l;
    }
    const std::vector<float> staged = logits_of(format, 0, nullptr);
    double max_error = 0.0, max_logit = 0.0;
    for (size_t i = 0; i < staged.size(); ++i) {
      ASSERT_TRUE(std::isfinite(fused[i])) << "logit " << i;
      max_error = std::max(max_error, std::fabs(static_cast<double>(fused[i]) - staged[i]));
      max_logit = std::max(max_logit, std::fabs(static_cast<double>(staged[i])));
    }
    ASSERT_GT(max_logit, 0.0);
    EXPECT_LE(max_error / max_logit, 2e-2) << "max |fused - staged| " << max_error;
  }
}

// --weights-scope linear on a device: the held bytes are the plan's, the QKV and O projections
// of every layer are reported as quantised; scripted steps (prefill through the dequantised
// scratch, decode through the quantised skinny GEMM) give finite logits of about the bf16
// model's size; a one-token step through the quantised skinny GEMM agrees with the same step
// through the scratch and cuBLAS (skinny_gemm_rows 0), within 2e-2 of the largest logit.
void synthetic_linear_scope_decodes() {
  const ModelConfig c = cut_qwen3(8, 16);
  const testing::Schedule s = testing::make_schedule(c.vocab_size, 11, 16);
  GpuOptions options{.max_batch_tokens = 64,
                     .max_num_seqs = 4,
                     .max_model_len = 64,
                     .block_size = 16,
                     .num_kv_blocks = s.num_blocks,
                     .quiet = true};
  auto rms_of_run = [&](WeightFormat format, WeightScope scope) {
    const auto gpu = GpuDecoder::create_synthetic(
        c, options, {.seed = 2, .expert_weights = format, .weight_scope = scope});
    if (scope == WeightScope::kLinear) {
      EXPECT_EQ(gpu->memory().weight_bytes, gpu::device_weight_bytes(c, 1, format, scope));
      EXPECT_EQ(gpu->memory().dense_quant_matrices, 2 * c.num_layers);
      EXPECT_EQ(gpu->memory().dense_format, weight_format_name(format));
    } else {
      EXPECT_EQ(gpu->memory().dense_quant_matrices, 0);
    }
    double sum_sq = 0.0;
    int64_t count = 0;
    for (size_t i = 0; i < s.steps.size(); ++i) {
      const testing::ScheduledStep& step = s.steps[i];
      std::vector<float> logits(
          static_cast<size_t>(Decoder::num_logit_rows(step.batch) * c.vocab_size));
      gpu->forward(step.batch, logits);
      for (float x : logits) {
        EXPECT_TRUE(std::isfinite(x)) << "step " << i;
        if (!std::isfinite(x)) return -1.0;
        sum_sq += static_cast<double>(x) * x;
      }
      count += static_cast<int64_t>(logits.size());
    }
    return std::sqrt(sum_sq / static_cast<double>(std::max<int64_t>(count, 1)));
  };
  const double bf16 = rms_of_run(WeightFormat::kCheckpoint, WeightScope::kExperts);
  ASSERT_GT(bf16, 0.0);
  for (WeightFormat format : kFormats) {
    SCOPED_TRACE(weight_format_name(format));
    const double rms = rms_of_run(format, WeightScope::kLinear);
    std::printf("8 layers, %s --weights-scope linear: logit rms %.4g (bf16 %.4g)\n",
                std::string(weight_format_name(format)).c_str(), rms, bf16);
    EXPECT_GT(rms, 0.5 * bf16);
    EXPECT_LT(rms, 2.0 * bf16);

    // One token, quantised skinny GEMM (1 row) against dequantise + cuBLAS (0 rows).
    const std::vector<int32_t> table = {0, 1};
    const std::vector<int32_t> token = {17};
    auto one_token = [&](int64_t skinny_rows) {
      GpuOptions o{.max_batch_tokens = 16,
                   .max_num_seqs = 2,
                   .max_model_len = 32,
                   .num_kv_blocks = 4,
                   .quiet = true,
                   .skinny_gemm_rows = skinny_rows};
      const auto gpu = GpuDecoder::create_synthetic(
          c, o, {.seed = 3, .expert_weights = format, .weight_scope = WeightScope::kLinear});
      std::vector<float> logits(static_cast<size_t>(c.vocab_size));
      gpu->forward({.sequences = {{.tokens = token, .position = 0, .block_table = table}}}, logits);
      return logits;
    };
    const std::vector<float> skinny = one_token(1), cublas = one_token(0);
    double max_error = 0.0, max_logit = 0.0;
    for (size_t i = 0; i < skinny.size(); ++i) {
      ASSERT_TRUE(std::isfinite(skinny[i])) << "logit " << i;
      max_error = std::max(max_error, std::fabs(static_cast<double>(skinny[i]) - cublas[i]));
      max_logit = std::max(max_logit, std::fabs(static_cast<double>(cublas[i])));
    }
    ASSERT_GT(max_logit, 0.0);
    EXPECT_LE(max_error / max_logit, 2e-2) << "max |skinny - cublas| " << max_error;
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("synthetic quantised experts")) return false;
  cuda::testing_util::register_kernel_test("CudaSyntheticQuant", "LinearScopeDecodes",
                                           synthetic_linear_scope_decodes, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaSyntheticQuant", "HoldsTheCodes",
                                           synthetic_holds_the_codes, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test(
      "CudaSyntheticQuant", "CodesAreDeterministicAndSpreadLikeBf16",
      synthetic_codes_are_deterministic_and_spread_like_bf16, __FILE__, __LINE__);
  cuda::testing_util::register_kernel_test("CudaSyntheticQuant", "DecodesFiniteLogits",
                                           synthetic_quant_decodes_finite_logits, __FILE__,
                                           __LINE__);
  cuda::testing_util::register_kernel_test("CudaSyntheticQuant", "DecodeTakesTheSmallBatchPath",
                                           synthetic_quant_decode_takes_the_small_batch_path,
                                           __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
