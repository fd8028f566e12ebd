// The grouped expert GEMM over quantised weights (backend/cuda/expert_quant.h: fp8 with a scale
// per group of a row, int4 with a scale and zero point, MXFP4 with an E8M0 exponent per 32) on
// fresh random codes and scales, the experts' rows uneven (zipf-skewed, with empty experts, and
// T = 1), the gate/up projection with SiLU(gate) * up fused and the plain down projection:
//
// - against the bf16 grouped GEMM on the dequantised weights (each value the host's
//   QuantizedMatrix::value, model/quantized_matrix.h, the CPU engine's oracle, rounded to bf16
//   once) with the same tile forced: the quantised kernel stores exactly those bf16 values in
//   shared memory and runs the same mma sequence, so the outputs must be equal bit for bit (the
//   skinny kernel, GemmTile::kSkinny, likewise: the same bf16 values into the same FMA order);
// - against a float64 host product over the same dequantised weights, within the bf16 contract
//   (1e-2 relative to the output's natural scale: bf16 rounding of the output and float32
//   accumulation order), with the automatic tile too;
// - rows past offsets[E] stay poisoned, and a null slot-table entry leaves its expert's rows.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/expert_quant.h"
#include "backend/cuda/grouped_gemm.h"
#include "cuda_test_util.h"
#include "model/quantized_matrix.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

CodeFormat code_format(ExpertQuant q) {
  return q == ExpertQuant::kFp8    ? CodeFormat::kFp8
         : q == ExpertQuant::kInt4 ? CodeFormat::kInt4
                                   : CodeFormat::kMxfp4;
}

// A random [rows, cols] matrix of codes and scales whose values are about `spread` in size.
QuantizedMatrix random_matrix(ExpertQuant q, int64_t rows, int64_t cols, int64_t group,
                              float spread, std::mt19937& rng) {
  QuantizedMatrix m{.format = code_format(q), .rows = rows, .cols = cols, .group = group};
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> unit(0.5f, 1.5f);
  const int64_t groups = m.groups_per_row();
  if (q == ExpertQuant::kFp8) {
    m.codes.resize(rows * cols);
    for (auto& c : m.codes) {
      do {
        c = static_cast<uint8_t>(byte(rng));
      } while ((c & 0x7f) == 0x7f);  // not the NaN codes
    }
    m.scales.resize(rows * groups);
    for (auto& s : m.scales) s = unit(rng) * spread / 64.0f;  // e4m3 magnitudes reach 448
  } else {
    m.codes.resize(rows * cols / 2);
    for (auto& c : m.codes) c = static_cast<uint8_t>(byte(rng));
    if (q == ExpertQuant::kInt4) {
      m.scales.resize(rows * groups);
      m.zeros.resize(rows * groups);
      for (auto& s : m.scales) s = unit(rng) * spread / 4.0f;
      // 0 to 16: GPTQ's first format stores zero - 1, so a zero point of 16 occurs.
      for (auto& z : m.zeros)
        z = static_cast<float>(std::uniform_int_distribution<int>(0, 16)(rng));
    } else {
      m.exponents.resize(rows * cols / 32);
      const int base = 127 + static_cast<int>(std::lround(std::log2(spread / 2.0f)));
      for (auto& e : m.exponents)
        e = static_cast<uint8_t>(base + std::uniform_int_distribution<int>(-3, 2)(rng));
    }
  }
  return m;
}

// The matrix in the device slab layout (what model/cuda/device_weights.cpp writes).
std::vector<uint8_t> slab_of(ExpertQuant q, const QuantizedMatrix& m) {
  const QuantMatrixLayout layout = quant_matrix_layout(q, m.rows, m.cols, m.group);
  std::vector<uint8_t> slab(layout.bytes, 0);
  std::memcpy(slab.data(), m.codes.data(), m.codes.size());
  if (q == ExpertQuant::kMxfp4) {
    std::memcpy(slab.data() + layout.scale_offset, m.exponents.data(), m.exponents.size());
  } else {
    std::memcpy(slab.data() + layout.scale_offset, m.scales.data(), m.scales.size() * 4);
  }
  if (q == ExpertQuant::kInt4) {
    std::memcpy(slab.data() + layout.zero_offset, m.zeros.data(), m.zeros.size() * 4);
  }
  return slab;
}

// Per-expert row counts summing to `rows`, zipf-skewed over a shuffled order, with experts 0
// and E / 2 forced empty.
std::vector<int32_t> skewed_offsets(int64_t rows, int64_t E, std::mt19937& rng) {
  std::vector<double> weight(E);
  std::vector<int64_t> order(E);
  for (int64_t i = 0; i < E; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t i = 0; i < E; ++i) weight[order[i]] = 1.0 / std::pow(i + 1.0, 1.1);
  weight[0] = weight[E / 2] = 0.0;
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> counts(E, 0);
  for (int64_t r = 0; r < rows; ++r) ++counts[pick(rng)];
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct QuantCase {
  ExpertQuant quant;
  int64_t group;
  int64_t T, K, E, H, I;
  bool table = false;   // slabs through a device table of per-expert pointers (one null entry)
  bool gather = false;  // rows gathered from [T, Kd] through a random src_row (the decoder's way)
};

std::string describe(const QuantCase& c, bool gate_up, GemmTile tile) {
  return std::string(expert_quant_name(c.quant)) + " group " + std::to_string(c.group) +
         " T=" + std::to_string(c.T) + " K=" + std::to_string(c.K) + " E=" + std::to_string(c.E) +
         " H=" + std::to_string(c.H) + " I=" + std::to_string(c.I) +
         (gate_up ? " gate_up" : " down") + " tile " + std::to_string(static_cast<int>(tile)) +
         (c.table ? " table" : "") + (c.gather ? " gather" : "");
}

void run_quant_case(const QuantCase& c, bool gate_up) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.T * 7919 + c.E * 31 + c.H + gate_up +
                                                        static_cast<int>(c.quant) * 131));
  const int64_t M = c.T * c.K, spare = 5;
  const int64_t Kd = gate_up ? c.H : c.I, N = gate_up ? c.I : c.H, Nw = gate_up ? 2 * N : N;
  const auto offsets = skewed_offsets(M, c.E, rng);
  // With a gather the operand is [T, Kd] and row r reads token src_row[r] / K.
  std::vector<int32_t> src_row(M + spare);
  for (auto& v : src_row) v = std::uniform_int_distribution<int32_t>(0, M - 1)(rng);
  auto x_row = [&](int64_t r) { return c.gather ? src_row[r] / c.K : r; };
  const auto x_bits = random_bf16((c.gather ? c.T : M + spare) * Kd, rng, 1.0f);
  const auto x = to_float(x_bits);
  const float spread = 1.0f / std::sqrt(static_cast<float>(Kd));

  // Codes, their slabs, and the dequantised weights as bf16 (the oracle's values).
  const QuantMatrixLayout layout = quant_matrix_layout(c.quant, Nw, Kd, c.group);
  std::vector<uint8_t> slabs(c.E * layout.bytes);
  std::vector<uint16_t> w_bits(c.E * Nw * Kd);
  for (int64_t e = 0; e < c.E; ++e) {
    const QuantizedMatrix m = random_matrix(c.quant, Nw, Kd, c.group, spread, rng);
    const auto slab = slab_of(c.quant, m);
    std::copy(slab.begin(), slab.end(), slabs.begin() + e * layout.bytes);
    for (int64_t r = 0; r < Nw; ++r) {
      for (int64_t k = 0; k < Kd; ++k) w_bits[(e * Nw + r) * Kd + k] = f32_to_bf16(m.value(r, k));
    }
  }
  const auto w = to_float(w_bits);
  // With the table, the last expert's entry is null: its rows must stay poisoned.
  const int64_t skipped = c.table ? c.E - 1 : -1;

  DeviceBuffer<uint8_t> d_slabs(slabs);
  DeviceBuffer<uint16_t> d_x(x_bits), d_w(w_bits);
  DeviceBuffer<uint16_t> d_out_q((M + spare) * N), d_out_b((M + spare) * N);
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  std::vector<const __nv_bfloat16*> table(c.E), bf16_table(c.E);
  for (int64_t e = 0; e < c.E; ++e) {
    table[e] = e == skipped
                   ? nullptr
                   : reinterpret_cast<const __nv_bfloat16*>(d_slabs.get() + e * layout.bytes);
    bf16_table[e] = e == skipped ? nullptr : d_w.as_bf16() + e * Nw * Kd;
  }
  DeviceBuffer<const __nv_bfloat16*> d_table(table), d_bf16_table(bf16_table);

  for (GemmTile tile : {GemmTile::kRows16, GemmTile::kRows64, GemmTile::kSkinny, GemmTile::kAuto}) {
    SCOPED_TRACE(describe(c, gate_up, tile));
    if (tile == GemmTile::kRows64 && N % 64 != 0) continue;
    GroupedGemmParams p{
        .rows = d_x.as_bf16(),
        .weights = c.table ? nullptr : reinterpret_cast<const __nv_bfloat16*>(d_slabs.get()),
        .expert_weights = c.table ? d_table.get() : nullptr,
        .expert_offsets = d_offsets.get(),
        .out = d_out_q.as_bf16(),
        .num_rows = M,
        .num_experts = c.E,
        .n = N,
        .k = Kd,
        .quant = c.quant,
        .quant_group = c.group,
        .epilogue = gate_up ? GemmEpilogue::kSiluMul : GemmEpilogue::kNone,
        .tile = tile,
        .src_row = c.gather ? d_src_row.get() : nullptr,
        .top_k = c.K,
        // Forced tiles also go through the programmatic-dependent launch.
        .overlap_previous = tile != GemmTile::kAuto};
    d_out_q.poison();
    grouped_gemm(p, nullptr);
    synchronize();
    const auto got = d_out_q.download();

    if (tile != GemmTile::kAuto) {  // the bf16 kernel on the dequantised weights, same tile
      GroupedGemmParams b = p;
      b.weights = c.table ? nullptr : d_w.as_bf16();
      b.expert_weights = c.table ? d_bf16_table.get() : nullptr;
      b.out = d_out_b.as_bf16();
      b.quant = ExpertQuant::kNone;
      b.quant_group = 0;
      d_out_b.poison();
      grouped_gemm(b, nullptr);
      synchronize();
      const auto want_bits = d_out_b.download();
      size_t differ = 0;
      for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want_bits[i];
      EXPECT_EQ(differ, 0u) << "elements that differ from the bf16 kernel's";
    }

    // float64 reference over the rows the kernel must write.
    std::vector<uint16_t> got_written;
    std::vector<double> want, scale;
    for (int64_t e = 0; e < c.E; ++e) {
      const float* we = w.data() + e * Nw * Kd;
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        const float* xr = x.data() + x_row(r) * Kd;
        for (int64_t n = 0; n < N; ++n) {
          if (e == skipped) {
            if (got[r * N + n] != 0xFFFF) ADD_FAILURE() << "row " << r << " of a null expert";
            continue;
          }
          double g = 0, g2 = 0, u = 0, u2 = 0;
          for (int64_t k = 0; k < Kd; ++k) {
            const double t = static_cast<double>(xr[k]) * we[n * Kd + k];
            g += t;
            g2 += t * t;
            if (gate_up) {
              const double s = static_cast<double>(xr[k]) * we[(N + n) * Kd + k];
              u += s;
              u2 += s * s;
            }
          }
          got_written.push_back(got[r * N + n]);
          if (gate_up) {
            want.push_back(silu(g) * u);
            scale.push_back(1.1 * std::sqrt(g2) * std::fabs(u) +
                            std::fabs(silu(g)) * std::sqrt(u2));
          } else {
            want.push_back(g);
            scale.push_back(std::sqrt(g2));
          }
        }
      }
    }
    expect_bf16_near(got_written, want, scale, gate_up ? "silu(gate)*up" : "down");
    for (int64_t i = M * N; i < (M + spare) * N; ++i) {
      if (got[i] != 0xFFFF) {
        ADD_FAILURE() << "row " << i / N << " past offsets[E] was written";
        break;
      }
    }
  }
}

void every_format_matches_the_bf16_kernel() {
  for (ExpertQuant q : {ExpertQuant::kFp8, ExpertQuant::kInt4, ExpertQuant::kMxfp4}) {
    // fp8: DeepSeek-V3's 128-input blocks and the fixtures' 8; int4: 128 (--weights int4) and
    // GPTQ's 32; MXFP4: 32 always.
    const int64_t groups[2] = {q == ExpertQuant::kMxfp4 ? 32 : 128,
                               q == ExpertQuant::kFp8 ? 8 : 32};
    for (const int64_t group : groups) {
      for (const QuantCase& c : {
               QuantCase{q, group, 1, 4, 8, 192, 128},        // decode, T = 1
               QuantCase{q, group, 37, 3, 12, 320, 192},      // uneven, empty experts
               QuantCase{q, group, 9, 2, 6, 256, 128, true},  // slot table, one null entry
               QuantCase{q, group, 300, 2, 4, 128, 64},       // the 64-row tile's territory
               QuantCase{q, group, 21, 4, 16, 192, 128, false, true},  // gathered rows
           }) {
        run_quant_case(c, /*gate_up=*/true);
        run_quant_case(c, /*gate_up=*/false);
      }
    }
  }
}

TEST(CudaQuantExpertsChecks, RefusesWhatTheLayoutCannotRead) {
  alignas(256) uint16_t buf[256] = {};
  int32_t offsets[3] = {0, 1, 2};
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(buf);
  auto* out = reinterpret_cast<__nv_bfloat16*>(buf);
  GroupedGemmParams p{.rows = in,
                      .weights = in,
                      .expert_offsets = offsets,
                      .out = out,
                      .num_rows = 2,
                      .num_experts = 2,
                      .n = 64,
                      .k = 64,
                      .weight_terms = 2,
                      .quant = ExpertQuant::kFp8,
                      .quant_group = 128};
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "weight_terms = 2");
  p.weight_terms = 1;
  p.quant_group = 12;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "quant_group = 12");
  p.quant = ExpertQuant::kMxfp4;
  p.quant_group = 16;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "quant_group = 16");
  p.quant = static_cast<ExpertQuant>(9);
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "quant 9");
}

TEST(CudaQuantExpertsChecks, LayoutPartsAreAlignedAndDisjoint) {
  for (ExpertQuant q : {ExpertQuant::kFp8, ExpertQuant::kInt4, ExpertQuant::kMxfp4}) {
    for (int64_t rows : {1, 24, 768}) {
      for (int64_t cols : {64, 192, 2048}) {
        const int64_t group = 32;
        const QuantMatrixLayout l = quant_matrix_layout(q, rows, cols, group);
        const int64_t code_bytes = rows * (q == ExpertQuant::kFp8 ? cols : cols / 2);
        const int64_t scale_bytes =
            rows * ((cols + group - 1) / group) * (q == ExpertQuant::kMxfp4 ? 1 : 4);
        EXPECT_EQ(l.scale_offset % 16, 0);
        EXPECT_GE(l.scale_offset, code_bytes);
        EXPECT_EQ(l.bytes % 256, 0);
        if (q == ExpertQuant::kInt4) {
          EXPECT_EQ(l.zero_offset % 16, 0);
          EXPECT_GE(l.zero_offset, l.scale_offset + scale_bytes);
          EXPECT_GE(l.bytes, l.zero_offset + scale_bytes);
        } else {
          EXPECT_GE(l.bytes, l.scale_offset + scale_bytes);
        }
        // The point: fewer bytes than bf16 (fp8 about half, 4-bit about a quarter).
        EXPECT_LT(l.bytes, rows * cols * 2 * (q == ExpertQuant::kFp8 ? 3 : 2) / 4 + 256);
      }
    }
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!testing_util::cuda_device_present("quantised experts")) return false;
  testing_util::register_kernel_test("CudaQuantExperts", "EveryFormatMatchesTheBf16Kernel",
                                     every_format_matches_the_bf16_kernel, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
