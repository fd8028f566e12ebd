// fp8 x fp8 on tensor cores (backend/cuda/grouped_gemm.h: act_codes, quantize_rows_fp8), on fresh
// random e4m3 weights with a float32 scale per (weight row, 128 or 256 inputs) and experts of
// 0, 1, 15, 16, 17, 100, 300 and 1 rows (none a multiple of the 64- or 128-row tile but 16):
//
// - the activation quantiser against core/dtype's encode_f8e4m3_scaled over each (row, 128
//   inputs) block: codes and scales equal byte for byte; rows at and past the device count are
//   left alone;
// - the GEMM against a float64 host emulation of the same arithmetic (the same codes, each
//   block's exact sum of code products times act_scale * weight_scale, the epilogue in
//   float64). Only the float32 accumulation differs (Hopper's fp8 mma keeps fewer bits than
//   float32 within one 32-input step, hence the block-wise promotion) and the output's bf16
//   rounding: |got - want| <= 2^-8 |want| + 2e-3 scale, scale the output's natural size (the
//   root of the sum of squared products). A wrong scale index (row, column or block) moves an
//   output by tens of percent of scale;
// - against the weight-only fp8 kernel (the same weights dequantised to bf16, the activations
//   unquantised): e4m3 rounds each activation by up to 2^-4 of its value, so the outputs differ
//   by ||diff|| / ||weight-only|| <= 6e-2 (a numpy model of these inputs gives 2.6e-2 plain and
//   3.6e-2 through SiLU(gate) * up; a scale from the wrong row or block, spread over a factor of
//   4, gives tens of percent), and no element by more than 0.25 (|want| + scale);
// - K 192 and 320 (multiples of 64, not of 128: a short last block), the gathered rows of the
//   decoder (src_row), every tile, rows past offsets[E] poisoned;
// - moe_experts end to end with its fp8 workspaces (both projections, the gather, the
//   activation's quantisation up to offsets[E]) against the same stage weight-only;
// - the launcher's refusals, and the experts stage's predicate (weight-only at decode).
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/expert_quant.h"
#include "backend/cuda/grouped_gemm.h"
#include "core/dtype.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

constexpr int64_t kBlock = kFp8ActBlock;
constexpr double kActivationRoundingBound = 6e-2;
// Uneven experts: empty, one row, around the 16-row tile, and many tiles' worth.
const std::vector<int32_t> kExpertRows = {0, 1, 15, 16, 17, 100, 300, 1};

int64_t blocks_of(int64_t k) { return (k + kBlock - 1) / kBlock; }

// Host twin of quantize_rows_fp8: rows [M, K] float (bf16 values) -> codes [M, K], scales
// [M, ceil(K / 128)].
void quantize_rows_host(const std::vector<float>& x, int64_t rows, int64_t K,
                        std::vector<uint8_t>& codes, std::vector<float>& scales) {
  const int64_t B = blocks_of(K);
  codes.assign(rows * K, 0);
  scales.assign(rows * B, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t k0 = b * kBlock, n = std::min(kBlock, K - k0);
      scales[r * B + b] = encode_f8e4m3_scaled(x.data() + r * K + k0, n, codes.data() + r * K + k0);
    }
  }
}

// One expert stack of fp8 weights [E, Nw, K] in the device slab layout (expert_quant.h), with
// random codes (no NaN) and a random scale per (row, group).
struct Fp8Experts {
  int64_t num_experts = 0, rows = 0, cols = 0, group = 0;
  QuantMatrixLayout layout;
  std::vector<uint8_t> slabs;  // E slabs
  std::vector<uint8_t> codes;  // [E, Nw, K]
  std::vector<float> scales;   // [E, Nw, G]
  float value(int64_t e, int64_t r, int64_t k) const {
    return f8e4m3_to_f32(codes[(e * rows + r) * cols + k]) *
           scales[(e * rows + r) * layout.groups_per_row + k / group];
  }
  float scale(int64_t e, int64_t r, int64_t k) const {
    return scales[(e * rows + r) * layout.groups_per_row + k / group];
  }
};

Fp8Experts random_experts(int64_t E, int64_t Nw, int64_t K, int64_t group, std::mt19937& rng) {
  Fp8Experts w{.num_experts = E, .rows = Nw, .cols = K, .group = group};
  w.layout = quant_matrix_layout(ExpertQuant::kFp8, Nw, K, group);
  w.codes.resize(E * Nw * K);
  w.scales.resize(E * Nw * w.layout.groups_per_row);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& c : w.codes) {
    do {
      c = static_cast<uint8_t>(byte(rng));
    } while ((c & 0x7f) == 0x7f);
  }
  // Values about 1 / sqrt(K) (codes reach 448); scales spread over a factor of 4 so that a
  // scale read from the wrong row or block shows.
  std::uniform_real_distribution<float> unit(0.5f, 2.0f);
  for (auto& s : w.scales) s = unit(rng) / (64.0f * std::sqrt(static_cast<float>(K)));
  w.slabs.assign(E * w.layout.bytes, 0);
  for (int64_t e = 0; e < E; ++e) {
    uint8_t* slab = w.slabs.data() + e * w.layout.bytes;
    std::memcpy(slab, w.codes.data() + e * Nw * K, Nw * K);
    std::memcpy(slab + w.layout.scale_offset, w.scales.data() + e * Nw * w.layout.groups_per_row,
                Nw * w.layout.groups_per_row * 4);
  }
  return w;
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& counts) {
  std::vector<int32_t> offsets(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct Fp8Case {
  int64_t K, N;  // reduction dim, output columns
  int64_t group = 128;
  bool gate_up = false;
  bool gather = false;  // rows gathered from [T, K] through src_row (top_k 2)
  bool table = false;   // slabs through a slot table (the expert cache's), expert 6's entry null
};

std::string describe(const Fp8Case& c, GemmTile tile) {
  return "K=" + std::to_string(c.K) + " N=" + std::to_string(c.N) + " group " +
         std::to_string(c.group) + (c.gate_up ? " gate_up" : " plain") +
         (c.gather ? " gather" : "") + (c.table ? " table" : "") + " tile " +
         std::to_string(static_cast<int>(tile));
}

// One output (row r's source row src, column n of expert e) three ways: the emulation of the
// fp8 arithmetic (blocks of exact code products, each scaled), the unquantised activations'
// product with the dequantised weights, and the natural size sqrt(sum of squared products).
struct Dot {
  double fp8 = 0, exact = 0, size = 0;
};

Dot dot(const Fp8Experts& w, int64_t e, int64_t w_row, const float* x, const uint8_t* codes,
        const float* scales, int64_t K) {
  Dot d;
  double squares = 0;
  for (int64_t b = 0; b < blocks_of(K); ++b) {
    double block = 0;
    for (int64_t k = b * kBlock; k < std::min(K, (b + 1) * kBlock); ++k) {
      const double wq = f8e4m3_to_f32(w.codes[(e * w.rows + w_row) * K + k]);
      block += static_cast<double>(f8e4m3_to_f32(codes[k])) * wq;
      const double t = static_cast<double>(x[k]) * w.value(e, w_row, k);
      d.exact += t;
      squares += t * t;
    }
    // The weight scale of this block: constant over it (group a multiple of 128).
    d.fp8 += block * scales[b] * w.scale(e, w_row, b * kBlock);
  }
  d.size = std::sqrt(squares);
  return d;
}

void run_fp8_case(const Fp8Case& c) {
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.K * 131 + c.N * 7 + c.gate_up * 3 + c.gather + c.group));
  const auto counts = kExpertRows;
  const int64_t E = static_cast<int64_t>(counts.size());
  const auto offsets = offsets_of(counts);
  const int64_t M = offsets[E], spare = 3, top_k = 2;
  const int64_t K = c.K, N = c.N, Nw = c.gate_up ? 2 * N : N;
  // The operand: [M + spare, K] expert-ordered rows, or [T, K] gathered through src_row.
  const int64_t operand_rows = c.gather ? M / top_k : M + spare;
  std::vector<int32_t> src_row(M);
  for (auto& v : src_row) v = std::uniform_int_distribution<int32_t>(0, M - 1)(rng);
  auto source = [&](int64_t r) { return c.gather ? src_row[r] / top_k : r; };
  const auto x_bits = random_bf16(operand_rows * K, rng, 1.0f);
  const auto x = to_float(x_bits);
  const Fp8Experts w = random_experts(E, Nw, K, c.group, rng);

  // The quantiser, against the host encoder byte for byte.
  std::vector<uint8_t> want_codes;
  std::vector<float> want_scales;
  quantize_rows_host(x, operand_rows, K, want_codes, want_scales);
  DeviceBuffer<uint16_t> d_x(x_bits);
  DeviceBuffer<uint8_t> d_codes(operand_rows * K);
  DeviceBuffer<float> d_scales(operand_rows * blocks_of(K));
  d_codes.poison();
  d_scales.poison();
  quantize_rows_fp8({.rows = d_x.as_bf16(),
                     .codes = d_codes.get(),
                     .scales = d_scales.get(),
                     .num_rows = operand_rows,
                     .k = K},
                    nullptr);
  synchronize();
  {
    const auto got_codes = d_codes.download();
    const auto got_scales = d_scales.download();
    size_t differ = 0;
    for (size_t i = 0; i < got_codes.size(); ++i) differ += got_codes[i] != want_codes[i];
    EXPECT_EQ(differ, 0u) << "activation codes that differ from encode_f8e4m3_scaled's";
    differ = 0;
    for (size_t i = 0; i < got_scales.size(); ++i) {
      differ += std::memcmp(&got_scales[i], &want_scales[i], 4) != 0;
    }
    EXPECT_EQ(differ, 0u) << "activation scales that differ from encode_f8e4m3_scaled's";
  }

  DeviceBuffer<uint8_t> d_slabs(w.slabs);
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  DeviceBuffer<uint16_t> d_out((M + spare) * N), d_ref((M + spare) * N);
  const GemmEpilogue epilogue = c.gate_up ? GemmEpilogue::kSiluMul : GemmEpilogue::kNone;
  const auto* weights = reinterpret_cast<const __nv_bfloat16*>(d_slabs.get());
  // With the table, expert 6 (300 rows) has a null entry: its rows must stay poisoned.
  const int64_t skipped = c.table ? 6 : -1;
  std::vector<const __nv_bfloat16*> table(E);
  for (int64_t e = 0; e < E; ++e) {
    table[e] = e == skipped
                   ? nullptr
                   : reinterpret_cast<const __nv_bfloat16*>(d_slabs.get() + e * w.layout.bytes);
  }
  DeviceBuffer<const __nv_bfloat16*> d_table(table);

  // The weight-only fp8 kernel on the bf16 rows: the looser comparison's reference.
  GroupedGemmParams weight_only{.rows = d_x.as_bf16(),
                                .weights = c.table ? nullptr : weights,
                                .expert_weights = c.table ? d_table.get() : nullptr,
                                .expert_offsets = d_offsets.get(),
                                .out = d_ref.as_bf16(),
                                .num_rows = M,
                                .num_experts = E,
                                .n = N,
                                .k = K,
                                .quant = ExpertQuant::kFp8,
                                .quant_group = c.group,
                                .epilogue = epilogue,
                                .src_row = c.gather ? d_src_row.get() : nullptr,
                                .top_k = c.gather ? top_k : 1};
  d_ref.poison();
  grouped_gemm(weight_only, nullptr);
  synchronize();
  const auto ref = to_float(d_ref.download());

  for (GemmTile tile :
       {GemmTile::kRows16, GemmTile::kRows64, GemmTile::kRows128, GemmTile::kAuto}) {
    if (tile == GemmTile::kRows64 && N % 64 != 0) continue;
    if (tile == GemmTile::kRows128 && N % (c.gate_up ? 64 : 128) != 0) continue;
    SCOPED_TRACE(describe(c, tile));
    GroupedGemmParams p = weight_only;
    p.rows = nullptr;  // fp8 x fp8 reads only the codes
    p.act_codes = d_codes.get();
    p.act_scales = d_scales.get();
    p.out = d_out.as_bf16();
    p.tile = tile;
    p.overlap_previous = tile != GemmTile::kAuto;
    d_out.poison();
    grouped_gemm(p, nullptr);
    synchronize();
    const auto got_bits = d_out.download();

    std::vector<float> got, got_ref;
    std::vector<double> want_fp8, want_exact, bound_fp8, size;
    for (int64_t e = 0; e < E; ++e) {
      if (e == skipped) {
        for (int64_t i = offsets[e] * N; i < offsets[e + 1] * N; ++i) {
          if (got_bits[i] != 0xFFFF) {
            ADD_FAILURE() << "row " << i / N << " of a null table entry was written";
            break;
          }
        }
        continue;
      }
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        const int64_t s = source(r);
        const float* xr = x.data() + s * K;
        const uint8_t* cr = want_codes.data() + s * K;
        const float* sr = want_scales.data() + s * blocks_of(K);
        for (int64_t n = 0; n < N; ++n) {
          const Dot g = dot(w, e, n, xr, cr, sr, K);
          got.push_back(bf16_to_f32(got_bits[r * N + n]));
          got_ref.push_back(ref[r * N + n]);
          if (c.gate_up) {
            const Dot u = dot(w, e, N + n, xr, cr, sr, K);
            const double sz = 1.1 * g.size * std::fabs(u.fp8) + std::fabs(silu(g.fp8)) * u.size;
            want_fp8.push_back(silu(g.fp8) * u.fp8);
            want_exact.push_back(silu(g.exact) * u.exact);
            bound_fp8.push_back(std::ldexp(std::fabs(want_fp8.back()), -8) + 2e-3 * sz);
            size.push_back(sz);
          } else {
            want_fp8.push_back(g.fp8);
            want_exact.push_back(g.exact);
            bound_fp8.push_back(std::ldexp(std::fabs(g.fp8), -8) + 2e-3 * g.size);
            size.push_back(g.size);
          }
        }
      }
    }
    expect_within(
        got, want_fp8, [&](size_t i) { return bound_fp8[i]; },
        "fp8 x fp8 vs its float64 emulation");
    // Against the weight-only kernel: the activation quantisation's error, and no more.
    double diff = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      diff += std::pow(static_cast<double>(got[i]) - got_ref[i], 2);
      norm += std::pow(static_cast<double>(got_ref[i]), 2);
    }
    const double rel = norm > 0 ? std::sqrt(diff / norm) : 0.0;
    EXPECT_LE(rel, kActivationRoundingBound) << "fp8 x fp8 vs weight-only fp8: relative error";
    expect_within(
        got, want_exact, [&](size_t i) { return 0.25 * (std::fabs(want_exact[i]) + size[i]); },
        "fp8 x fp8 vs the unquantised activations' float64 product");
    for (int64_t i = M * N; i < (M + spare) * N; ++i) {
      if (got_bits[i] != 0xFFFF) {
        ADD_FAILURE() << "row " << i / N << " past offsets[E] was written";
        break;
      }
    }
    std::printf("fp8 x fp8 %-40s vs weight-only fp8: relative error %.2e\n",
                describe(c, tile).c_str(), rel);
  }
}

void fp8_mma_matches_its_emulation() {
  for (const Fp8Case& c : {
           Fp8Case{.K = 256, .N = 128},                                   // plain, 2 blocks
           Fp8Case{.K = 256, .N = 128, .gate_up = true},                  // SiLU(gate) * up
           Fp8Case{.K = 192, .N = 64, .gate_up = true},                   // a short last block
           Fp8Case{.K = 320, .N = 256},                                   // short block, wide N
           Fp8Case{.K = 512, .N = 128, .group = 256},                     // scale groups of 256
           Fp8Case{.K = 384, .N = 128, .gate_up = true, .gather = true},  // the decoder's gather
           Fp8Case{.K = 128, .N = 32},                                    // one block, narrow N
           Fp8Case{.K = 256, .N = 64, .gate_up = true, .table = true},    // the slot table
       }) {
    run_fp8_case(c);
  }
}

// The quantiser leaves rows at and past the device count alone (a bucket's padding).
void quantiser_stops_at_the_device_count() {
  std::mt19937 rng(fresh_seed());
  const int64_t rows = 37, K = 448, valid = 29;
  const auto x_bits = random_bf16(rows * K, rng, 3.0f);
  DeviceBuffer<uint16_t> d_x(x_bits);
  DeviceBuffer<uint8_t> d_codes(rows * K);
  DeviceBuffer<float> d_scales(rows * blocks_of(K));
  DeviceBuffer<int32_t> d_valid(std::vector<int32_t>{static_cast<int32_t>(valid)});
  d_codes.poison();
  d_scales.poison();
  quantize_rows_fp8({.rows = d_x.as_bf16(),
                     .codes = d_codes.get(),
                     .scales = d_scales.get(),
                     .num_rows = rows,
                     .k = K,
                     .num_valid_rows = d_valid.get()},
                    nullptr);
  synchronize();
  std::vector<uint8_t> want_codes;
  std::vector<float> want_scales;
  quantize_rows_host(to_float(x_bits), rows, K, want_codes, want_scales);
  const auto codes = d_codes.download();
  const auto scales = d_scales.download();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t want = r < valid ? want_codes[r * K + k] : 0xFF;
      if (codes[r * K + k] != want) {
        ADD_FAILURE() << "code (" << r << ", " << k << ") = " << int{codes[r * K + k]} << ", want "
                      << int{want};
        return;
      }
    }
    for (int64_t b = 0; b < blocks_of(K); ++b) {
      uint32_t bits = 0;
      std::memcpy(&bits, &scales[r * blocks_of(K) + b], 4);
      if (r >= valid) {
        EXPECT_EQ(bits, 0xFFFFFFFFu) << "scale of row " << r << " past the count was written";
      } else {
        EXPECT_EQ(scales[r * blocks_of(K) + b], want_scales[r * blocks_of(K) + b]);
      }
    }
  }
}

// The experts stage end to end (moe_experts: quantise the gathered token rows, gate/up with
// SiLU(gate) * up, quantise the activation up to offsets[E], down) with the fp8 workspaces,
// against the same stage weight-only. Both layers' activations are rounded to e4m3, so the
// outputs differ by about 4.5e-2 (the two errors above in quadrature): at least 1e-3 (the path
// was taken) and at most 8e-2; rows past offsets[E] stay poisoned.
void experts_stage_runs_fp8_mma() {
  std::mt19937 rng(fresh_seed() ^ 0x5eedu);
  const int64_t E = 8, top_k = 2, T = 160, H = 256, I = 192, spare = 3;
  const int64_t M = T * top_k;  // 40 mean rows per expert: the predicate's side
  ASSERT_TRUE(fp8_tensor_core_experts(ExpertQuant::kFp8, 128, M, E));
  std::vector<int32_t> counts(E, 0);
  std::uniform_int_distribution<int64_t> pick(1, E - 1);  // expert 0 stays empty
  for (int64_t r = 0; r < M; ++r) ++counts[pick(rng)];
  const auto offsets = offsets_of(counts);
  std::vector<int32_t> src_row(M);  // every assignment once, in a shuffled order (a plan's)
  for (int64_t r = 0; r < M; ++r) src_row[r] = static_cast<int32_t>(r);
  std::shuffle(src_row.begin(), src_row.end(), rng);
  const Fp8Experts gate_up = random_experts(E, 2 * I, H, 128, rng);
  const Fp8Experts down = random_experts(E, H, I, 128, rng);
  const auto x_bits = random_bf16(T * H, rng, 1.0f);

  DeviceBuffer<uint16_t> d_x(x_bits), d_act(M * I), d_out((M + spare) * H),
      d_ref((M + spare) * H);
  DeviceBuffer<uint8_t> d_gate_up(gate_up.slabs), d_down(down.slabs);
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  DeviceBuffer<uint8_t> d_codes(M * H);
  DeviceBuffer<float> d_scales(M * blocks_of(H));
  MoeExpertsParams p{.rows = d_x.as_bf16(),
                     .gate_up = reinterpret_cast<const __nv_bfloat16*>(d_gate_up.get()),
                     .down = reinterpret_cast<const __nv_bfloat16*>(d_down.get()),
                     .quant = ExpertQuant::kFp8,
                     .quant_group = 128,
                     .expert_offsets = d_offsets.get(),
                     .activation = d_act.as_bf16(),
                     .out = d_ref.as_bf16(),
                     .num_rows = M,
                     .num_experts = E,
                     .hidden_size = H,
                     .expert_width = I,
                     .src_row = d_src_row.get(),
                     .top_k = top_k};
  d_ref.poison();
  d_act.poison();
  moe_experts(p, nullptr);  // weight-only: no workspaces
  synchronize();
  p.out = d_out.as_bf16();
  p.fp8_codes = d_codes.get();
  p.fp8_scales = d_scales.get();
  d_out.poison();
  d_act.poison();
  moe_experts(p, nullptr);
  synchronize();
  const auto got = to_float(d_out.download());
  const auto ref = to_float(d_ref.download());
  double diff = 0, norm = 0;
  size_t not_finite = 0;
  for (int64_t i = 0; i < M * H; ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) {
      ++not_finite;
      continue;
    }
    diff += std::pow(static_cast<double>(got[i]) - ref[i], 2);
    norm += std::pow(static_cast<double>(ref[i]), 2);
  }
  EXPECT_EQ(not_finite, 0u) << "outputs not written or not finite";
  const double rel = norm > 0 ? std::sqrt(diff / norm) : 0.0;
  EXPECT_GE(rel, 1e-3) << "moe_experts did not take fp8 x fp8";
  EXPECT_LE(rel, 8e-2) << "moe_experts fp8 x fp8 vs weight-only";
  const auto got_bits = d_out.download();
  for (int64_t i = M * H; i < (M + spare) * H; ++i) {
    if (got_bits[i] != 0xFFFF) {
      ADD_FAILURE() << "row " << i / H << " past offsets[E] was written";
      break;
    }
  }
  std::printf("moe_experts fp8 x fp8 vs weight-only: relative error %.2e\n", rel);
}

TEST(CudaFp8MmaChecks, RefusesWhatItCannotRun) {
  alignas(256) uint16_t buf[256] = {};
  alignas(16) uint8_t codes[256] = {};
  float scales[4] = {};
  int32_t offsets[3] = {0, 1, 2};
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(buf);
  GroupedGemmParams p{.weights = in,
                      .expert_offsets = offsets,
                      .out = reinterpret_cast<__nv_bfloat16*>(buf),
                      .num_rows = 2,
                      .num_experts = 2,
                      .n = 64,
                      .k = 64,
                      .quant = ExpertQuant::kFp8,
                      .quant_group = 8,
                      .act_codes = codes,
                      .act_scales = scales};
  // The checkpoint fixtures' 8 x 8 blocks: a weight scale changes inside one mma step.
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "quant_group = 8");
  p.quant = ExpertQuant::kInt4;
  p.quant_group = 128;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "needs fp8 weights, not int4");
  p.quant = ExpertQuant::kFp8;
  p.act_scales = nullptr;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "act_scales is null");
  expect_error_naming(
      [&] {
        quantize_rows_fp8({.rows = in, .codes = codes, .scales = scales, .num_rows = 1, .k = 96},
                          nullptr);
      },
      "k = 96");
}

// The one predicate: never at decode sizes, never for scale groups that do not cover whole
// 128-input blocks, whatever the device.
TEST(CudaFp8MmaChecks, PredicateKeepsDecodeWeightOnly) {
  // Qwen3-30B-A3B: 128 experts, top 8. T = 8 decode: 64 rows over 64 experts at most.
  EXPECT_FALSE(fp8_tensor_core_experts(ExpertQuant::kFp8, 128, 8 * 8, 128));
  EXPECT_FALSE(fp8_tensor_core_experts(ExpertQuant::kFp8, 128, 256 * 8, 128));  // 16 rows each
  EXPECT_FALSE(fp8_tensor_core_experts(ExpertQuant::kFp8, 8, 4096 * 8, 128));   // 8 x 8 blocks
  EXPECT_FALSE(fp8_tensor_core_experts(ExpertQuant::kInt4, 128, 4096 * 8, 128));
  EXPECT_FALSE(fp8_tensor_core_experts(ExpertQuant::kNone, 0, 4096 * 8, 128));
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!testing_util::cuda_device_present("fp8 x fp8")) return false;
  int device = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major * 10 + minor < 89) {
    std::fprintf(stderr,
                 "test_cuda: compute capability %d.%d has no fp8 mma; the fp8 x fp8 "
                 "kernel tests are not registered\n",
                 major, minor);
    return false;
  }
  testing_util::register_kernel_test("CudaFp8Mma", "MatchesItsEmulation",
                                     fp8_mma_matches_its_emulation, __FILE__, __LINE__);
  testing_util::register_kernel_test("CudaFp8Mma", "QuantiserStopsAtTheDeviceCount",
                                     quantiser_stops_at_the_device_count, __FILE__, __LINE__);
  testing_util::register_kernel_test("CudaFp8Mma", "ExpertsStageRunsFp8Mma",
                                     experts_stage_runs_fp8_mma, __FILE__, __LINE__);
  testing_util::register_kernel_test(
      "CudaFp8Mma", "PrefillShapesTakeThePath",
      [] {
        EXPECT_TRUE(fp8_tensor_core_experts(ExpertQuant::kFp8, 128, 4096 * 8, 128));
        EXPECT_TRUE(fp8_tensor_cores_supported(ExpertQuant::kFp8, 128));
      },
      __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
