// The grouped expert GEMM (backend/cuda/grouped_gemm.h) against a float64 CPU reference on
// fresh random inputs: outputs poisoned first (0xFF bytes, NaN in bf16) so every unwritten
// element fails, and rows past offsets[E] must stay poisoned. Sizes cover decode (T = 1, 3) to
// prefill (T = 4096 with K = 2), E in 8, 60, 128, routing uniform, zipf-skewed (many empty
// experts) and all-to-one-expert, H and I multiples of 64 that are not powers of two, every tile
// forced as well as the automatic choice. Many experts too: E = 4099 at K = 64, and 70000
// experts of one row each, whose 70000 row tiles pass gridDim.y's 65535 (the slots continue in
// gridDim.z). The skinny kernel (kSkinny, kAuto's choice at decode's smallest steps) runs every
// case the tiles run, its blocks of up to 4 rows of an expert past 4 rows too. Tolerance: the bf16
// contract, 1e-2 relative to the output's natural scale (see cuda_test_util.h).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cuda/grouped_gemm.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaGroupedGemmChecks, RefusesBadShapes) {
  alignas(16) uint16_t buf[64] = {};
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
                      .k = 96};
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "k = 96");
  p.k = 64;
  p.n = 48;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "n = 48");
  p.n = 64;
  p.num_experts = 0;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "num_experts = 0");
  p.num_experts = 2;
  p.rows = reinterpret_cast<const __nv_bfloat16*>(buf + 1);
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "rows (");
  p.rows = in;
  p.expert_offsets = nullptr;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "expert_offsets is null");
  p.expert_offsets = offsets;
  p.n = 96;
  p.tile = GemmTile::kRows64;
  expect_error_naming([&] { grouped_gemm(p, nullptr); }, "n = 96");
  // No rows: nothing to do, no pointer looked at.
  grouped_gemm(GroupedGemmParams{.num_rows = 0, .num_experts = 4, .n = 64, .k = 64}, nullptr);
}

enum class Routing { kUniform, kZipf, kOneExpert, kRoundRobin };

// Per-expert row counts summing to `rows`; kRoundRobin: as even as they can be (every expert
// gets a row when rows >= E).
std::vector<int32_t> make_offsets(int64_t rows, int64_t E, Routing routing, std::mt19937& rng) {
  if (routing == Routing::kRoundRobin) {
    std::vector<int32_t> offsets(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + (rows / E + (e < rows % E));
    return offsets;
  }
  std::vector<double> weight(E, 1.0);
  if (routing == Routing::kZipf) {
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t i = 0; i < E; ++i) weight[order[i]] = 1.0 / std::pow(i + 1.0, 1.2);
  } else if (routing == Routing::kOneExpert) {
    std::fill(weight.begin(), weight.end(), 0.0);
    weight[std::uniform_int_distribution<int64_t>(0, E - 1)(rng)] = 1.0;
  }
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> counts(E, 0);
  for (int64_t r = 0; r < rows; ++r) ++counts[pick(rng)];
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct GemmCase {
  int64_t T, K, E, H, I;
  Routing routing;
  GemmTile tile;
  int64_t spare_rows = 0;  // rows past offsets[E] that must stay untouched
  bool gather = false;     // A rows gathered from [T, Kd] through a random src_row
  // 2: each expert's matrix is followed by a second term of its own random values ([E, 2, Nw,
  // Kd]) and the product is x . (w0 + w1)^T; any term read at the wrong place is far off.
  int64_t weight_terms = 1;
  bool table = false;  // experts through a device table of per-expert pointers
  // GroupedGemmParams::one_row_per_expert: true for one token's rows, and (a wrong hint) for
  // experts with several rows, which must still come out right.
  bool one_row_per_expert = false;
};

// One grouped GEMM of either kind; returns false when the launcher refused the forced tile
// (n not a multiple of its width), which the caller expects for those shapes.
void run_case(const GemmCase& c, bool gate_up) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.T * 7919 + c.E * 31 + c.H + gate_up));
  const int64_t used = c.T * c.K;
  const int64_t M = used + c.spare_rows;
  const int64_t Kd = gate_up ? c.H : c.I;
  const int64_t N = gate_up ? c.I : c.H;
  const int64_t Nw = gate_up ? 2 * N : N;
  const auto offsets = make_offsets(used, c.E, c.routing, rng);
  // With a gather the operand is [T, Kd] and row r reads token src_row[r] / K.
  const int64_t x_rows = c.gather ? c.T : M;
  std::vector<int32_t> src_row(M);
  for (auto& v : src_row) v = std::uniform_int_distribution<int32_t>(0, c.T * c.K - 1)(rng);
  auto x_row = [&](int64_t r) { return c.gather ? src_row[r] / c.K : r; };
  const auto x_bits = random_bf16(x_rows * Kd, rng, 1.0f);
  const int64_t terms = c.weight_terms, term_elems = Nw * Kd;
  const auto w_bits =
      random_bf16(c.E * terms * term_elems, rng, 1.0f / std::sqrt(static_cast<float>(Kd)));
  const auto x = to_float(x_bits);
  const auto w_terms = to_float(w_bits);
  std::vector<float> w(c.E * term_elems);  // the weights the terms add up to
  for (int64_t e = 0; e < c.E; ++e) {
    for (int64_t i = 0; i < term_elems; ++i) {
      for (int64_t t = 0; t < terms; ++t)
        w[e * term_elems + i] += w_terms[(e * terms + t) * term_elems + i];
    }
  }

  DeviceBuffer<uint16_t> d_x(x_bits), d_w(w_bits), d_out(M * N);
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  std::vector<const __nv_bfloat16*> table(c.E);
  for (int64_t e = 0; e < c.E; ++e) table[e] = d_w.as_bf16() + e * terms * term_elems;
  DeviceBuffer<const __nv_bfloat16*> d_table(table);
  d_out.poison();
  GroupedGemmParams p{.rows = d_x.as_bf16(),
                      .weights = c.table ? nullptr : d_w.as_bf16(),
                      .expert_weights = c.table ? d_table.get() : nullptr,
                      .expert_offsets = d_offsets.get(),
                      .out = d_out.as_bf16(),
                      .num_rows = M,
                      .num_experts = c.E,
                      .n = N,
                      .k = Kd,
                      .weight_terms = terms,
                      .epilogue = gate_up ? GemmEpilogue::kSiluMul : GemmEpilogue::kNone,
                      .tile = c.tile,
                      .src_row = c.gather ? d_src_row.get() : nullptr,
                      .top_k = c.K,
                      // Forced tiles also go through the programmatic-dependent launch.
                      .overlap_previous = c.tile != GemmTile::kAuto,
                      .one_row_per_expert = c.one_row_per_expert};
  const int width = c.tile == GemmTile::kRows16        ? 32
                    : c.tile == GemmTile::kRows64      ? 64
                    : c.tile == GemmTile::kRows128     ? (gate_up ? 64 : 128)
                    : c.tile == GemmTile::kRows128Wide ? (gate_up ? 128 : 256)
                                                       : 32;
  if (N % width != 0) {
    expect_error_naming([&] { grouped_gemm(p, nullptr); }, "n = " + std::to_string(N));
    return;
  }
  grouped_gemm(p, nullptr);
  synchronize();
  const auto got = d_out.download();

  std::vector<double> want(used * N), scale(used * N);
  for (int64_t e = 0; e < c.E; ++e) {
    const float* we = w.data() + e * Nw * Kd;
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const float* xr = x.data() + x_row(r) * Kd;
      for (int64_t n = 0; n < N; ++n) {
        double g = 0, g2 = 0, u = 0, u2 = 0;
        const float* wg = we + n * Kd;
        const float* wu = we + (N + n) * Kd;
        for (int64_t k = 0; k < Kd; ++k) {
          const double t = static_cast<double>(xr[k]) * wg[k];
          g += t;
          g2 += t * t;
          if (gate_up) {
            const double s = static_cast<double>(xr[k]) * wu[k];
            u += s;
            u2 += s * s;
          }
        }
        if (gate_up) {
          want[r * N + n] = silu(g) * u;
          scale[r * N + n] =
              1.1 * std::sqrt(g2) * std::fabs(u) + std::fabs(silu(g)) * std::sqrt(u2);
        } else {
          want[r * N + n] = g;
          scale[r * N + n] = std::sqrt(g2);
        }
      }
    }
  }
  const std::vector<uint16_t> got_used(got.begin(), got.begin() + used * N);
  expect_bf16_near(got_used, want, scale, gate_up ? "silu(gate)*up" : "down");
  for (int64_t i = used * N; i < M * N; ++i) {
    if (got[i] != 0xFFFF) {
      ADD_FAILURE() << "row " << i / N << " past offsets[E] was written";
      break;
    }
  }
}

// moe_experts: both projections through the [M, I] activation workspace.
void run_experts(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I, bool gather) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 104729 + E + gather));
  const int64_t M = T * K;
  const auto offsets = make_offsets(M, E, Routing::kZipf, rng);
  std::vector<int32_t> src_row(M);
  std::iota(src_row.begin(), src_row.end(), 0);
  std::shuffle(src_row.begin(), src_row.end(), rng);
  auto x_row = [&](int64_t r) { return gather ? src_row[r] / K : r; };
  const auto x_bits = random_bf16((gather ? T : M) * H, rng, 1.0f);
  const auto gu_bits = random_bf16(E * 2 * I * H, rng, 1.0f / std::sqrt(static_cast<float>(H)));
  const auto dn_bits = random_bf16(E * H * I, rng, 1.0f / std::sqrt(static_cast<float>(I)));
  const auto x = to_float(x_bits), gu = to_float(gu_bits), dn = to_float(dn_bits);
  DeviceBuffer<uint16_t> d_x(x_bits), d_gu(gu_bits), d_dn(dn_bits), d_act(M * I), d_out(M * H);
  DeviceBuffer<int32_t> d_offsets(offsets), d_src_row(src_row);
  d_act.poison();
  d_out.poison();
  moe_experts(MoeExpertsParams{.rows = d_x.as_bf16(),
                               .gate_up = d_gu.as_bf16(),
                               .down = d_dn.as_bf16(),
                               .expert_offsets = d_offsets.get(),
                               .activation = d_act.as_bf16(),
                               .out = d_out.as_bf16(),
                               .num_rows = M,
                               .num_experts = E,
                               .hidden_size = H,
                               .expert_width = I,
                               .src_row = gather ? d_src_row.get() : nullptr,
                               .top_k = K},
              nullptr);
  synchronize();
  std::vector<double> want(M * H), scale(M * H);
  std::vector<double> act(I);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t k = 0; k < H; ++k) {
          g += static_cast<double>(x[x_row(r) * H + k]) * gu[(e * 2 * I + i) * H + k];
          u += static_cast<double>(x[x_row(r) * H + k]) * gu[(e * 2 * I + I + i) * H + k];
        }
        act[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(silu(g) * u)));
      }
      for (int64_t h = 0; h < H; ++h) {
        double y = 0, y2 = 0;
        for (int64_t i = 0; i < I; ++i) {
          const double t = act[i] * dn[(e * H + h) * I + i];
          y += t;
          y2 += t * t;
        }
        want[r * H + h] = y;
        scale[r * H + h] = 2.0 * std::sqrt(y2);  // the activation's own bf16 rounding too
      }
    }
  }
  expect_bf16_near(d_out.download(), want, scale, "experts out");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("grouped GEMM")) return false;
  const GemmTile tiles[] = {GemmTile::kAuto,    GemmTile::kRows16,      GemmTile::kRows64,
                            GemmTile::kRows128, GemmTile::kRows128Wide, GemmTile::kSkinny};
  // By GemmTile's value.
  const char* tile_names[] = {"Auto",        "Rows16",      "Rows64", "Rows128",
                              "Rows128Wide", "HopperWgmma", "Skinny"};
  constexpr int kTiles = 6;
  const Routing routings[] = {Routing::kUniform, Routing::kZipf, Routing::kOneExpert};
  const char* routing_names[] = {"Uniform", "Zipf", "OneExpert"};
  struct Shape {
    int64_t T, K, E, H, I;
  };
  const Shape shapes[] = {{1, 8, 128, 256, 192}, {3, 8, 128, 256, 192},   {19, 2, 8, 192, 320},
                          {99, 8, 60, 320, 128}, {989, 8, 128, 256, 128}, {4096, 2, 60, 128, 192},
                          {300, 8, 16, 256, 256}};
  for (const Shape& s : shapes) {
    for (int t = 0; t < kTiles; ++t) {
      for (int r = 0; r < 3; ++r) {
        // The one-expert and uniform routings only with the automatic tile, to bound run time.
        if (r != 1 && t != 0) continue;
        for (bool gate_up : {true, false}) {
          const GemmCase c{.T = s.T,
                           .K = s.K,
                           .E = s.E,
                           .H = s.H,
                           .I = s.I,
                           .routing = routings[r],
                           .tile = tiles[t],
                           .spare_rows = s.T % 5};
          const std::string name = std::string(gate_up ? "SiluMul" : "Plain") + "_T" +
                                   std::to_string(s.T) + "_K" + std::to_string(s.K) + "_E" +
                                   std::to_string(s.E) + "_H" + std::to_string(s.H) + "_I" +
                                   std::to_string(s.I) + "_" + routing_names[r] + "_" +
                                   tile_names[static_cast<int>(tiles[t])];
          register_kernel_test(
              "CudaGroupedGemm", name, [c, gate_up] { run_case(c, gate_up); }, __FILE__, __LINE__);
        }
      }
    }
  }
  for (const Shape& s :
       {Shape{1, 8, 128, 256, 192}, Shape{99, 8, 60, 320, 128}, Shape{989, 8, 128, 256, 128}}) {
    for (GemmTile tile :
         {GemmTile::kAuto, GemmTile::kRows64, GemmTile::kRows128, GemmTile::kSkinny}) {
      const GemmCase c{.T = s.T,
                       .K = s.K,
                       .E = s.E,
                       .H = s.H,
                       .I = s.I,
                       .routing = Routing::kZipf,
                       .tile = tile,
                       .gather = true};
      const std::string name =
          "Gather_T" + std::to_string(s.T) + "_" + tile_names[static_cast<int>(tile)];
      register_kernel_test(
          "CudaGroupedGemm", name, [c] { run_case(c, true); }, __FILE__, __LINE__);
    }
  }
  // The skinny kernel at one row a block: one token's rows (each expert one row), and Zipf rows
  // of 3 and 19 tokens (experts with several rows: the hint is wrong, the results must not be),
  // gathered and not, one and two weight terms.
  for (const Shape& s :
       {Shape{1, 8, 128, 256, 192}, Shape{3, 8, 128, 256, 192}, Shape{19, 2, 8, 192, 320}}) {
    for (bool gate_up : {true, false}) {
      for (bool gather : {false, true}) {
        const GemmCase c{.T = s.T,
                         .K = s.K,
                         .E = s.E,
                         .H = s.H,
                         .I = s.I,
                         .routing = s.T == 1 ? Routing::kRoundRobin : Routing::kZipf,
                         .tile = GemmTile::kSkinny,
                         .gather = gather,
                         .weight_terms = gather ? 2 : 1,
                         .one_row_per_expert = true};
        register_kernel_test(
            "CudaGroupedGemm",
            std::string("OneRowABlock") + (gate_up ? "SiluMul" : "Plain") + "_T" +
                std::to_string(s.T) + (gather ? "_Gather_TwoTerms" : ""),
            [c, gate_up] { run_case(c, gate_up); }, __FILE__, __LINE__);
      }
    }
  }
  // Two weight terms (float32 checkpoints held as hi + lo), under every tile, gathered and
  // through an expert table (the skinny kernel both ways).
  for (int t = 0; t < kTiles; ++t) {
    for (bool gate_up : {true, false}) {
      for (const Shape& s : {Shape{3, 8, 60, 320, 256}, Shape{300, 8, 16, 256, 256}}) {
        const bool skinny = tiles[t] == GemmTile::kSkinny;
        // A gather reads M / K token rows, so M has no spare rows there.
        const GemmCase c{.T = s.T,
                         .K = s.K,
                         .E = s.E,
                         .H = s.H,
                         .I = s.I,
                         .routing = Routing::kZipf,
                         .tile = tiles[t],
                         .spare_rows = t == 0 || skinny ? 0 : 2,
                         .gather = t == 0 || skinny,
                         .weight_terms = 2,
                         .table = t == 1 || skinny};
        register_kernel_test(
            "CudaGroupedGemm",
            std::string("TwoTerms") + (gate_up ? "SiluMul" : "Plain") + "_T" + std::to_string(s.T) +
                "_" + tile_names[static_cast<int>(tiles[t])],
            [c, gate_up] { run_case(c, gate_up); }, __FILE__, __LINE__);
      }
    }
  }
  // Many experts: past the one-warp router's 1024 with K = 64 (decode-sized: the 16-row tile),
  // and one row for each of 70000 experts, 70000 row tiles of the 16-row tile.
  for (bool gate_up : {true, false}) {
    const GemmCase c{.T = 40,
                     .K = 64,
                     .E = 4099,
                     .H = 128,
                     .I = 64,
                     .routing = Routing::kUniform,
                     .tile = GemmTile::kAuto,
                     .spare_rows = 3};
    register_kernel_test(
        "CudaGroupedGemm",
        std::string(gate_up ? "SiluMul" : "Plain") + "_T40_K64_E4099_H128_I64_Uniform_Auto",
        [c, gate_up] { run_case(c, gate_up); }, __FILE__, __LINE__);
  }
  register_kernel_test(
      "CudaGroupedGemm", "Plain_E70000_OneRowEach_Rows16_SlotsPastGridY",
      [] {
        run_case({.T = 70000,
                  .K = 1,
                  .E = 70000,
                  .H = 32,
                  .I = 64,
                  .routing = Routing::kRoundRobin,
                  .tile = GemmTile::kRows16},
                 false);
      },
      __FILE__, __LINE__);
  for (int64_t T : {int64_t{1}, int64_t{19}, int64_t{256}}) {
    register_kernel_test(
        "CudaMoeExperts", "GateUpThenDown_T" + std::to_string(T),
        [T] { run_experts(T, 8, 64, 256, 192, false); }, __FILE__, __LINE__);
    register_kernel_test(
        "CudaMoeExperts", "GatherGateUpThenDown_T" + std::to_string(T),
        [T] { run_experts(T, 8, 64, 256, 192, true); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
