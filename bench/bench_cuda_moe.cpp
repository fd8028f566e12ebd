// How close is the grouped expert GEMM (backend/cuda/grouped_gemm.h) to its floors?
//
// Shape: the Qwen3-30B-A3B experts (H 2048, I 768, E 128, K 8), T = 1, 8, 64, 256, 4096 tokens
// routed with a zipf(1.0) preference over a shuffled expert order (trained routers are skewed;
// uniform routing would overstate the distinct experts at small T). For each T, the gate/up
// projection with SiLU*up fused, the down projection, and both (moe_experts) are timed.
//
// Floors, measured in the same run:
// - bytes: distinct experts touched x expert bytes (+ the rows read and written), over the
//   device-to-device copy bandwidth (bytes read + written, 1 GiB, median of 10). "vs floor" is
//   floor time / measured time (1.0 = at the copy bandwidth).
// - FLOPs: 2 * M * H * 3I over cuBLAS's bf16 GEMM rate at 8192^3 (median of 10); and for the
//   prefill sizes the same FLOPs as one dense cuBLAS GEMM pair ([M, H] x [2I, H]^T and
//   [M, I] x [H, I]^T), the rate a grouped GEMM could hope for if routing were free.
//
// Method: random bf16 inputs, never zeros. Three copies of the expert weights (3.6 GB) are
// rotated over successive launches so decode-size launches do not find their experts in the
// 60 MB L2 from the previous launch. 30 launches are captured in a CUDA graph; the median of
// 10 replays (after 2 warm-ups) over 30 is the time of one launch. The expert offsets live on
// the device; nothing is read back between launches.
//
// The same layer's attention is timed after the experts, as a second table: paged decode
// attention at context 1024 (Nq 32, Nkv 4, D 128, blocks of 16 tokens in a shuffled pool, table
// sets rotated so K/V do not come from L2) against its K/V bytes over the copy bandwidth, the
// same at D 512 and 1024 (the wide kernel of head dims above 256); then causal prefill
// attention of one sequence of T = 1024, 2048, 4096 and 8192 tokens at the same heads, the Hopper
// wgmma kernel (sm_90 only) beside the mma.sync kernel (and the CUDA-core one at 4096), against
// the cuBLAS rate, counting the causal half of the QK^T and PV FLOPs (2 T (T + 1) D Nq); its last
// column is the mma.sync time over the kernel's. --attention-only runs that prefill table alone.
//
// fp8 (a third table): the same experts as e4m3 codes with a float32 scale per (row, 128
// inputs), at M = 4096 and 32768 rows (T = 512 and 4096), three ways: the bf16 grouped GEMM,
// fp8 weight-only (codes widened to bf16 in registers) and fp8 x fp8 on fp8 tensor cores (the
// activations' quantisation timed with it in "experts (both)", and apart). TFLOP/s count
// 2 * M * H * 3I as above; the last column is the ratio to the bf16 kernel's time.
//
// Prefill (a fourth table, first with --prefill-only): the Hopper wgmma kernel
// (GemmTile::kHopperWgmma, sm_90 only), the mma.sync kRows128Wide kernel and cuBLAS at T = 2048,
// 4096 and 8192 (M = 8T rows, zipf routing; T = 4096 only without --prefill-only), the gate/up
// projection (SiLU*up fused; cuBLAS writes the [M, 2I] product unfused) and the down projection
// apart. cuBLAS runs two ways: one cublasGemmEx per non-empty expert with the routed counts (the
// host knows them here), and one strided batched GEMM of E equal groups of M / E rows (the same
// FLOPs, no skew: the rate a grouped GEMM could hope for). TFLOP/s count 2 * M * Kd * Nw; the
// last column is the batched cuBLAS time over the kernel's (above 1: faster than cuBLAS).
//
// Usage: bench_cuda_moe [--quick] [--fp8-only] [--prefill-only] [--attention-only]
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/device_floors.h"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/grouped_gemm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_bench_util.h"

namespace moeinfer::cuda {
namespace {

using bench_util::device_alloc;
using bench_util::fill_random;
using bench_util::median;

constexpr int64_t kH = 2048, kI = 768, kE = 128, kK = 8;
constexpr int kWeightSets = 3;
constexpr int kLaunchesPerGraph = 30;
int g_replays = 10;

using bf16 = __nv_bfloat16;




// Median milliseconds of one call of `body` (called with the call index within the graph).
double time_graph(cudaStream_t stream, const std::function<void(int)>& body) {
  return bench_util::time_graph(stream, kLaunchesPerGraph, g_replays, 2, body);
}


// y[M, N] = x[M, Kd] . w[N, Kd]^T through cuBLAS (row-major in column-major terms).
void cublas_gemm(cublasHandle_t handle, const bf16* x, const bf16* w, bf16* y, int64_t M, int64_t N,
                 int64_t Kd) {
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N),
                            static_cast<int>(M), static_cast<int>(Kd), &alpha, w, CUDA_R_16BF,
                            static_cast<int>(Kd), x, CUDA_R_16BF, static_cast<int>(Kd), &beta, y,
                            CUDA_R_16BF, static_cast<int>(N), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}


// Zipf(1.0) routing over a shuffled expert order, K distinct experts per token; returns the
// expert offsets [E + 1] of the sorted assignments.
std::vector<int32_t> zipf_offsets(int64_t T, std::mt19937& rng, int64_t* touched) {
  std::vector<int> order(kE);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<double> weight(kE);
  for (int64_t i = 0; i < kE; ++i) weight[order[i]] = 1.0 / (i + 1.0);
  std::vector<int32_t> counts(kE, 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> w = weight;
    for (int64_t k = 0; k < kK; ++k) {
      std::discrete_distribution<int> pick(w.begin(), w.end());
      const int e = pick(rng);
      ++counts[e];
      w[e] = 0.0;
    }
  }
  std::vector<int32_t> offsets(kE + 1, 0);
  *touched = 0;
  for (int64_t e = 0; e < kE; ++e) {
    offsets[e + 1] = offsets[e] + counts[e];
    *touched += counts[e] > 0;
  }
  return offsets;
}

struct Row {
  int64_t T;
  std::string what;
  double us, floor_us, ratio, tflops, flop_ratio;
};
std::vector<Row> g_rows;

const char* tile_name(GemmTile t) {
  switch (t) {
    case GemmTile::kRows16:
      return "16";
    case GemmTile::kRows64:
      return "64";
    case GemmTile::kRows128:
      return "128";
    case GemmTile::kRows128Wide:
      return "128w";
    case GemmTile::kHopperWgmma:
      return "wgmma";
    case GemmTile::kSkinny:
      return "skinny";
    default:
      return "auto";
  }
}

void bench_t(int64_t T, bf16* const* gate_up, bf16* const* down, double copy_bw, double peak,
             cublasHandle_t handle, cudaStream_t stream, std::mt19937& rng) {
  int64_t touched = 0;
  const auto offsets = zipf_offsets(T, rng, &touched);
  const int64_t M = T * kK;
  int32_t* d_offsets = device_alloc<int32_t>(kE + 1);
  CUDA_CHECK(cudaMemcpy(d_offsets, offsets.data(), (kE + 1) * 4, cudaMemcpyHostToDevice));
  bf16* rows = device_alloc<bf16>(M * kH);
  bf16* act = device_alloc<bf16>(M * kI);
  bf16* out = device_alloc<bf16>(M * kH);
  fill_random(rows, M * kH, 1.0f, rng);
  fill_random(act, M * kI, 1.0f, rng);
  const double gu_bytes = touched * 2.0 * kI * kH * 2 + M * kH * 2.0 + M * kI * 2.0;
  const double dn_bytes = touched * 1.0 * kH * kI * 2 + M * kI * 2.0 + M * kH * 2.0;
  const double gu_flops = 2.0 * M * kH * 2 * kI, dn_flops = 2.0 * M * kI * kH;

  auto gu_params = [&](int i) {
    return GroupedGemmParams{.rows = rows,
                             .weights = gate_up[i % kWeightSets],
                             .expert_offsets = d_offsets,
                             .out = act,
                             .num_rows = M,
                             .num_experts = kE,
                             .n = kI,
                             .k = kH,
                             .epilogue = GemmEpilogue::kSiluMul};
  };
  auto dn_params = [&](int i) {
    return GroupedGemmParams{.rows = act,
                             .weights = down[i % kWeightSets],
                             .expert_offsets = d_offsets,
                             .out = out,
                             .num_rows = M,
                             .num_experts = kE,
                             .n = kH,
                             .k = kI};
  };
  const double gu_ms = time_graph(stream, [&](int i) { grouped_gemm(gu_params(i), stream); });
  const double dn_ms = time_graph(stream, [&](int i) { grouped_gemm(dn_params(i), stream); });
  const double both_ms = time_graph(stream, [&](int i) {
    moe_experts(MoeExpertsParams{.rows = rows,
                                 .gate_up = gate_up[i % kWeightSets],
                                 .down = down[i % kWeightSets],
                                 .expert_offsets = d_offsets,
                                 .activation = act,
                                 .out = out,
                                 .num_rows = M,
                                 .num_experts = kE,
                                 .hidden_size = kH,
                                 .expert_width = kI},
                stream);
  });
  // Dispatch fused into the A load: rows gathered from [T, H] through a shuffled src_row.
  std::vector<int32_t> src_row(M);
  std::iota(src_row.begin(), src_row.end(), 0);
  std::shuffle(src_row.begin(), src_row.end(), rng);
  int32_t* d_src_row = device_alloc<int32_t>(M);
  CUDA_CHECK(cudaMemcpy(d_src_row, src_row.data(), M * 4, cudaMemcpyHostToDevice));
  const double gather_ms = time_graph(stream, [&](int i) {
    moe_experts(MoeExpertsParams{.rows = rows,
                                 .gate_up = gate_up[i % kWeightSets],
                                 .down = down[i % kWeightSets],
                                 .expert_offsets = d_offsets,
                                 .activation = act,
                                 .out = out,
                                 .num_rows = M,
                                 .num_experts = kE,
                                 .hidden_size = kH,
                                 .expert_width = kI,
                                 .src_row = d_src_row,
                                 .top_k = kK},
                stream);
  });
  CUDA_CHECK(cudaFree(d_src_row));
  auto add = [&](const std::string& what, double ms, double bytes, double flops) {
    const double floor_ms = bytes / copy_bw * 1e3;
    const double tflops = flops / (ms * 1e-3) / 1e12;
    g_rows.push_back(
        {T, what, ms * 1e3, floor_ms * 1e3, floor_ms / ms, tflops, tflops * 1e12 / peak});
    const Row& r = g_rows.back();
    std::printf("%5lld %5lld %4lld  %-22s %10.1f %10.1f %7.3f %9.1f %7.3f\n",
                static_cast<long long>(T), static_cast<long long>(M),
                static_cast<long long>(touched), what.c_str(), r.us, r.floor_us, r.ratio, r.tflops,
                r.flop_ratio);
  };
  const GemmTile gu_tile = grouped_gemm_tile(gu_params(0));
  const GemmTile dn_tile = grouped_gemm_tile(dn_params(0));
  add(std::string("gate_up+silu tile ") + tile_name(gu_tile), gu_ms, gu_bytes, gu_flops);
  add(std::string("down tile ") + tile_name(dn_tile), dn_ms, dn_bytes, dn_flops);
  add("experts (both)", both_ms, gu_bytes + dn_bytes, gu_flops + dn_flops);
  add("experts, rows gathered", gather_ms, gu_bytes + dn_bytes, gu_flops + dn_flops);
  if (T >= 8) {
    // The other tiles for both projections, to see where the automatic choice stands.
    for (GemmTile alt : {GemmTile::kRows16, GemmTile::kRows64, GemmTile::kRows128,
                         GemmTile::kRows128Wide, GemmTile::kHopperWgmma, GemmTile::kSkinny}) {
      if (alt == gu_tile && alt == dn_tile) continue;
      if (alt == GemmTile::kSkinny && T > 64) continue;
      if ((alt == GemmTile::kRows128 || alt == GemmTile::kRows128Wide ||
           alt == GemmTile::kHopperWgmma) &&
          T < 256) {
        continue;
      }
      if (alt == GemmTile::kHopperWgmma && !grouped_gemm_wgmma_available()) continue;
      if (alt == GemmTile::kRows16 && T >= 1024) continue;
      const double alt_ms = time_graph(stream, [&](int i) {
        GroupedGemmParams g = gu_params(i), d = dn_params(i);
        g.tile = alt;
        d.tile = alt;
        d.overlap_previous = true;
        grouped_gemm(g, stream);
        grouped_gemm(d, stream);
      });
      add(std::string("experts, tile ") + tile_name(alt), alt_ms, gu_bytes + dn_bytes,
          gu_flops + dn_flops);
    }
  }
  if (T >= 256) {
    // The same FLOPs as dense cuBLAS GEMMs over all M rows, one expert's weights for all.
    bf16* wide = device_alloc<bf16>(M * 2 * kI);
    const double dense_ms = time_graph(stream, [&](int i) {
      cublas_gemm(handle, rows, gate_up[i % kWeightSets], wide, M, 2 * kI, kH);
      cublas_gemm(handle, act, down[i % kWeightSets], out, M, kH, kI);
    });
    add("cuBLAS dense same FLOPs", dense_ms, 3.0 * kI * kH * 2 + M * kH * 4.0, gu_flops + dn_flops);
    std::printf("%27s grouped / dense cuBLAS time: %.2f\n", "", both_ms / dense_ms);
    CUDA_CHECK(cudaFree(wide));
  }
  CUDA_CHECK(cudaFree(d_offsets));
  CUDA_CHECK(cudaFree(rows));
  CUDA_CHECK(cudaFree(act));
  CUDA_CHECK(cudaFree(out));
}

// The fp8 table at T tokens (M = T * K rows): bf16, fp8 weight-only and fp8 x fp8, each
// projection and both.
void bench_fp8_t(int64_t T, bf16* const* gate_up, bf16* const* down, void* const* gate_up_fp8,
                 void* const* down_fp8, cudaStream_t stream, std::mt19937& rng,
                 std::string& line) {
  int64_t touched = 0;
  const auto offsets = zipf_offsets(T, rng, &touched);
  const int64_t M = T * kK, widest = std::max(kH, kI);
  int32_t* d_offsets = device_alloc<int32_t>(kE + 1);
  CUDA_CHECK(cudaMemcpy(d_offsets, offsets.data(), (kE + 1) * 4, cudaMemcpyHostToDevice));
  bf16* rows = device_alloc<bf16>(M * kH);
  bf16* act = device_alloc<bf16>(M * kI);
  bf16* out = device_alloc<bf16>(M * kH);
  fill_random(rows, M * kH, 1.0f, rng);
  fill_random(act, M * kI, 1.0f, rng);
  auto* codes = device_alloc<uint8_t>(M * widest);
  auto* scales = device_alloc<float>(M * (widest / kFp8ActBlock));
  // The down projection's operand quantised once, for the GEMM-only timing.
  auto* act_codes = device_alloc<uint8_t>(M * kI);
  auto* act_scales = device_alloc<float>(M * (kI / kFp8ActBlock));
  quantize_rows_fp8({.rows = act, .codes = act_codes, .scales = act_scales, .num_rows = M,
                     .k = kI},
                    stream);
  quantize_rows_fp8({.rows = rows, .codes = codes, .scales = scales, .num_rows = M, .k = kH},
                    stream);
  const double gu_flops = 2.0 * M * kH * 2 * kI, dn_flops = 2.0 * M * kI * kH;
  enum class Way { kBf16, kWeightOnly, kFp8Mma };
  auto gemm = [&](Way way, bool gate_up_proj, int i) {
    const bf16* bf16_weights = (gate_up_proj ? gate_up : down)[i % kWeightSets];
    const void* fp8_weights = (gate_up_proj ? gate_up_fp8 : down_fp8)[i % kWeightSets];
    GroupedGemmParams p{.rows = gate_up_proj ? rows : act,
                        .weights = way == Way::kBf16 ? bf16_weights
                                                     : static_cast<const bf16*>(fp8_weights),
                        .expert_offsets = d_offsets,
                        .out = gate_up_proj ? act : out,
                        .num_rows = M,
                        .num_experts = kE,
                        .n = gate_up_proj ? kI : kH,
                        .k = gate_up_proj ? kH : kI,
                        .epilogue = gate_up_proj ? GemmEpilogue::kSiluMul : GemmEpilogue::kNone};
    if (way != Way::kBf16) {
      p.quant = ExpertQuant::kFp8;
      p.quant_group = kFp8ActBlock;
    }
    if (way == Way::kFp8Mma) {
      p.act_codes = gate_up_proj ? codes : act_codes;
      p.act_scales = gate_up_proj ? scales : act_scales;
    }
    grouped_gemm(p, stream);
  };
  auto experts = [&](Way way, int i) {
    MoeExpertsParams p{.rows = rows,
                       .gate_up = way == Way::kBf16 ? gate_up[i % kWeightSets]
                                                    : static_cast<const bf16*>(
                                                          gate_up_fp8[i % kWeightSets]),
                       .down = way == Way::kBf16
                                   ? down[i % kWeightSets]
                                   : static_cast<const bf16*>(down_fp8[i % kWeightSets]),
                       .expert_offsets = d_offsets,
                       .activation = act,
                       .out = out,
                       .num_rows = M,
                       .num_experts = kE,
                       .hidden_size = kH,
                       .expert_width = kI};
    if (way != Way::kBf16) {
      p.quant = ExpertQuant::kFp8;
      p.quant_group = kFp8ActBlock;
    }
    if (way == Way::kFp8Mma) {
      p.fp8_codes = codes;
      p.fp8_scales = scales;
    }
    moe_experts(p, stream);
  };
  const bool mma_taken = fp8_tensor_core_experts(ExpertQuant::kFp8, kFp8ActBlock, M, kE);
  const char* names[] = {"bf16", "fp8 weight-only", "fp8 x fp8"};
  double bf16_ms[3] = {0, 0, 0};
  for (Way way : {Way::kBf16, Way::kWeightOnly, Way::kFp8Mma}) {
    const double gu_ms = time_graph(stream, [&](int i) { gemm(way, true, i); });
    const double dn_ms = time_graph(stream, [&](int i) { gemm(way, false, i); });
    const double both_ms = time_graph(stream, [&](int i) { experts(way, i); });
    const double ms[3] = {gu_ms, dn_ms, both_ms};
    const double flops[3] = {gu_flops, dn_flops, gu_flops + dn_flops};
    const char* parts[3] = {"gate_up+silu", "down", "experts (both)"};
    for (int k = 0; k < 3; ++k) {
      if (way == Way::kBf16) bf16_ms[k] = ms[k];
      const double tflops = flops[k] / (ms[k] * 1e-3) / 1e12;
      std::printf("%5lld %5lld %4lld  %-16s %-15s %10.1f %9.1f %7.2f\n",
                  static_cast<long long>(T), static_cast<long long>(M),
                  static_cast<long long>(touched), names[static_cast<int>(way)], parts[k],
                  ms[k] * 1e3, tflops, bf16_ms[k] / ms[k]);
      if (k == 2) {
        char part[96];
        std::snprintf(part, sizeof(part), " M=%lld %s %.0f TFLOP/s;", static_cast<long long>(M),
                      names[static_cast<int>(way)], tflops);
        line += part;
      }
    }
  }
  const double quant_ms = time_graph(stream, [&](int) {
    quantize_rows_fp8({.rows = rows, .codes = codes, .scales = scales, .num_rows = M, .k = kH},
                      stream);
  });
  std::printf("%5lld %5lld %4lld  %-32s %10.1f   (moe_experts takes fp8 x fp8 here: %s)\n",
              static_cast<long long>(T), static_cast<long long>(M),
              static_cast<long long>(touched), "quantise rows [M, H]", quant_ms * 1e3,
              mma_taken ? "yes" : "no");
  for (void* p : {static_cast<void*>(d_offsets), static_cast<void*>(rows),
                  static_cast<void*>(act), static_cast<void*>(out), static_cast<void*>(codes),
                  static_cast<void*>(scales), static_cast<void*>(act_codes),
                  static_cast<void*>(act_scales)}) {
    CUDA_CHECK(cudaFree(p));
  }
}

void bench_fp8(bf16* const* gate_up, bf16* const* down, cudaStream_t stream, std::mt19937& rng) {
  const QuantMatrixLayout gu_layout = quant_matrix_layout(ExpertQuant::kFp8, 2 * kI, kH,
                                                          kFp8ActBlock);
  const QuantMatrixLayout dn_layout = quant_matrix_layout(ExpertQuant::kFp8, kH, kI,
                                                          kFp8ActBlock);
  void* gate_up_fp8[kWeightSets];
  void* down_fp8[kWeightSets];
  for (int s = 0; s < kWeightSets; ++s) {
    gate_up_fp8[s] = device_alloc<uint8_t>(kE * gu_layout.bytes);
    down_fp8[s] = device_alloc<uint8_t>(kE * dn_layout.bytes);
    quant_random_fill({.out = gate_up_fp8[s], .num_slabs = kE, .rows = 2 * kI, .cols = kH,
                       .group = kFp8ActBlock, .seed = 100u + s,
                       .scale = 1.0f / std::sqrt(static_cast<float>(kH))},
                      stream);
    quant_random_fill({.out = down_fp8[s], .num_slabs = kE, .rows = kH, .cols = kI,
                       .group = kFp8ActBlock, .seed = 200u + s,
                       .scale = 1.0f / std::sqrt(static_cast<float>(kI))},
                      stream);
  }
  std::printf("\n%5s %5s %4s  %-16s %-15s %10s %9s %7s\n", "T", "M", "exp", "fp8 (128 blocks)",
              "kernel", "time us", "TFLOP/s", "vs bf16");
  std::string line = "bench_cuda_moe fp8 (qwen3-30b-a3b experts, T = M / 8):";
  for (int64_t T : {512, 4096}) bench_fp8_t(T, gate_up, down, gate_up_fp8, down_fp8, stream, rng,
                                            line);
  std::printf("\n%s\n", line.c_str());
  for (int s = 0; s < kWeightSets; ++s) {
    CUDA_CHECK(cudaFree(gate_up_fp8[s]));
    CUDA_CHECK(cudaFree(down_fp8[s]));
  }
}

// y[g] = x[g] . w[g]^T for E groups of `rows` rows each (strided batched, one launch).
void cublas_batched(cublasHandle_t handle, const bf16* x, const bf16* w, bf16* y, int64_t rows,
                    int64_t N, int64_t Kd, int64_t groups) {
  const float alpha = 1.0f, beta = 0.0f;
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), static_cast<int>(rows),
      static_cast<int>(Kd), &alpha, w, CUDA_R_16BF, static_cast<int>(Kd), N * Kd, x, CUDA_R_16BF,
      static_cast<int>(Kd), rows * Kd, &beta, y, CUDA_R_16BF, static_cast<int>(N), rows * N,
      static_cast<int>(groups), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The prefill table (see the file's header) at T tokens; appends to `line`.
void bench_prefill_t(int64_t T, bf16* const* gate_up, bf16* const* down, cublasHandle_t handle,
                     cudaStream_t stream, std::mt19937& rng, std::string& line) {
  int64_t touched = 0;
  const auto offsets = zipf_offsets(T, rng, &touched);
  const int64_t M = T * kK;
  int32_t* d_offsets = device_alloc<int32_t>(kE + 1);
  CUDA_CHECK(cudaMemcpy(d_offsets, offsets.data(), (kE + 1) * 4, cudaMemcpyHostToDevice));
  bf16* rows = device_alloc<bf16>(M * kH);
  bf16* act = device_alloc<bf16>(M * kI);
  bf16* out = device_alloc<bf16>(M * kH);
  bf16* wide = device_alloc<bf16>(M * 2 * kI);  // cuBLAS's unfused gate/up product
  fill_random(rows, M * kH, 1.0f, rng);
  fill_random(act, M * kI, 1.0f, rng);
  const bool wgmma = grouped_gemm_wgmma_available();
  for (bool gu : {true, false}) {
    const int64_t Kd = gu ? kH : kI, N = gu ? kI : kH, Nw = gu ? 2 * kI : kH;
    const bf16* x = gu ? rows : act;
    bf16* y = gu ? act : out;
    bf16* const* w = gu ? gate_up : down;
    const double flops = 2.0 * M * Kd * Nw;
    auto grouped = [&](GemmTile tile) {
      return time_graph(stream, [&](int i) {
        grouped_gemm(GroupedGemmParams{.rows = x,
                                       .weights = w[i % kWeightSets],
                                       .expert_offsets = d_offsets,
                                       .out = y,
                                       .num_rows = M,
                                       .num_experts = kE,
                                       .n = N,
                                       .k = Kd,
                                       .epilogue = gu ? GemmEpilogue::kSiluMul
                                                      : GemmEpilogue::kNone,
                                       .tile = tile},
                     stream);
      });
    };
    const double per_expert_ms = time_graph(stream, [&](int i) {
      for (int64_t e = 0; e < kE; ++e) {
        const int64_t count = offsets[e + 1] - offsets[e];
        if (count == 0) continue;
        cublas_gemm(handle, x + offsets[e] * Kd, w[i % kWeightSets] + e * Nw * Kd,
                    (gu ? wide : out) + offsets[e] * Nw, count, Nw, Kd);
      }
    });
    const double batched_ms = time_graph(stream, [&](int i) {
      cublas_batched(handle, x, w[i % kWeightSets], gu ? wide : out, M / kE, Nw, Kd, kE);
    });
    const double wgmma_ms = wgmma ? grouped(GemmTile::kHopperWgmma) : 0.0;
    const double mma_ms = grouped(GemmTile::kRows128Wide);
    const char* proj = gu ? "gate_up+silu" : "down";
    auto row = [&](const char* kernel, double ms) {
      const double tflops = flops / (ms * 1e-3) / 1e12;
      std::printf("%5lld %6lld  %-13s %-26s %10.1f %9.1f %8.2f\n", static_cast<long long>(T),
                  static_cast<long long>(M), proj, kernel, ms * 1e3, tflops, batched_ms / ms);
      return tflops;
    };
    const double wgmma_tflops = wgmma ? row("wgmma (kHopperWgmma)", wgmma_ms) : 0.0;
    if (!wgmma) {
      std::printf("%5lld %6lld  %-13s %-26s   (not sm_90, or no sm_90a code in this build)\n",
                  static_cast<long long>(T), static_cast<long long>(M), proj,
                  "wgmma (kHopperWgmma)");
    }
    const double mma_tflops = row("mma.sync (kRows128Wide)", mma_ms);
    row("cuBLAS per expert", per_expert_ms);
    const double cublas_tflops = row("cuBLAS batched, equal rows", batched_ms);
    char part[160];
    std::snprintf(part, sizeof(part),
                  " T=%lld %s wgmma %.0f, mma.sync %.0f, cuBLAS %.0f TFLOP/s (wgmma/cuBLAS %.2f);",
                  static_cast<long long>(T), proj, wgmma_tflops, mma_tflops, cublas_tflops,
                  wgmma_tflops / cublas_tflops);
    line += part;
  }
  for (void* p : {static_cast<void*>(d_offsets), static_cast<void*>(rows),
                  static_cast<void*>(act), static_cast<void*>(out), static_cast<void*>(wide)}) {
    CUDA_CHECK(cudaFree(p));
  }
}

void bench_prefill(const std::vector<int64_t>& sizes, bf16* const* gate_up, bf16* const* down,
                   cublasHandle_t handle, cudaStream_t stream, std::mt19937& rng) {
  std::printf("\n%5s %6s  %-13s %-26s %10s %9s %8s\n", "T", "M", "prefill", "kernel", "time us",
              "TFLOP/s", "vs cuB");
  std::string line = "bench_cuda_moe prefill (qwen3-30b-a3b experts, TFLOP/s):";
  for (int64_t T : sizes) bench_prefill_t(T, gate_up, down, handle, stream, rng, line);
  std::printf("\n%s\n", line.c_str());
}

std::string g_attention_line;

// Paged decode at context 1024 (Nq 32, Nkv 4, head dim D, blocks of 16 tokens in a shuffled
// pool of 1 GiB of K and 1 GiB of V, table sets rotated so K/V do not come from L2), against its
// K/V bytes over the copy bandwidth. "wide": D above 256, the one kernel there.
void bench_decode(int64_t D, double copy_bw, cudaStream_t stream, std::mt19937& rng) {
  constexpr int64_t kNq = 32, kNkv = 4, kBlock = 16, kCtx = 1024;
  const int64_t row_bytes = kNkv * D * 2;
  const int64_t pool_tokens = (int64_t{1} << 30) / row_bytes;  // 1 GiB of K, 1 GiB of V
  const int64_t num_blocks = pool_tokens / kBlock;
  bf16* k_cache = device_alloc<bf16>(pool_tokens * kNkv * D);
  bf16* v_cache = device_alloc<bf16>(pool_tokens * kNkv * D);
  fill_random(k_cache, pool_tokens * kNkv * D, 1.0f, rng);
  fill_random(v_cache, pool_tokens * kNkv * D, 1.0f, rng);
  std::vector<int32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  const bool wide = D > 256;
  char part[128];
  for (int64_t B : {1, 8, 64, 256})
    for (bool tc : {false, true}) {
      // The flag does not change the wide kernel; 256 sequences of 1024 keys at D 1024 would
      // not fit the pool.
      if (wide && (!tc || B > 64)) continue;
      const int64_t blocks_per_seq = kCtx / kBlock;
      const int64_t sets = std::min<int64_t>(kLaunchesPerGraph, num_blocks / (B * blocks_per_seq));
      std::vector<int32_t> tables(sets * B * blocks_per_seq);
      for (size_t i = 0; i < tables.size(); ++i) tables[i] = pool[i];
      int32_t* d_tables = device_alloc<int32_t>(tables.size());
      CUDA_CHECK(cudaMemcpy(d_tables, tables.data(), tables.size() * 4, cudaMemcpyHostToDevice));
      std::vector<int32_t> lens(B, static_cast<int32_t>(kCtx));
      int32_t* d_lens = device_alloc<int32_t>(B);
      CUDA_CHECK(cudaMemcpy(d_lens, lens.data(), B * 4, cudaMemcpyHostToDevice));
      bf16* q = device_alloc<bf16>(B * kNq * D);
      bf16* out = device_alloc<bf16>(B * kNq * D);
      fill_random(q, B * kNq * D, 1.0f, rng);
      PagedDecodeParams p{.q = q,
                          .k_cache = k_cache,
                          .v_cache = v_cache,
                          .out = out,
                          .num_seqs = B,
                          .num_q_heads = kNq,
                          .num_kv_heads = kNkv,
                          .head_dim = D,
                          .block_size = kBlock,
                          .num_blocks = num_blocks,
                          .max_blocks_per_seq = blocks_per_seq,
                          .max_seq_len = kCtx,
                          .scale = 1.0f / std::sqrt(static_cast<float>(D)),
                          .tensor_cores = tc};
      float* ws = device_alloc<float>(std::max<int64_t>(1, paged_decode_workspace_size(p)));
      p.workspace = ws;
      p.seq_lens = d_lens;
      const double ms = time_graph(stream, [&](int i) {
        PagedDecodeParams pi = p;
        pi.block_tables = d_tables + (i % sets) * B * blocks_per_seq;
        paged_decode_attention(pi, stream);
      });
      const double bytes = B * kCtx * 2.0 * row_bytes;
      const double floor_ms = bytes / copy_bw * 1e3;
      const DecodeSplit split = paged_decode_split(p);
      const char* kernel = wide ? "wide" : tc ? "mma" : "simt";
      char what[64];
      std::snprintf(what, sizeof(what), "decode %s D=%lld B=%lld (%lld splits)", kernel,
                    static_cast<long long>(D), static_cast<long long>(B),
                    static_cast<long long>(split.num_splits));
      std::printf("%-34s %10.1f %10.1f %7.3f\n", what, ms * 1e3, floor_ms * 1e3, floor_ms / ms);
      std::snprintf(part, sizeof(part), " decode %s D=%lld B=%lld %.1fus (%.2f floor);", kernel,
                    static_cast<long long>(D), static_cast<long long>(B), ms * 1e3, floor_ms / ms);
      g_attention_line += part;
      CUDA_CHECK(cudaFree(d_tables));
      CUDA_CHECK(cudaFree(d_lens));
      CUDA_CHECK(cudaFree(q));
      CUDA_CHECK(cudaFree(out));
      CUDA_CHECK(cudaFree(ws));
    }
  CUDA_CHECK(cudaFree(k_cache));
  CUDA_CHECK(cudaFree(v_cache));
}

void bench_attention(double copy_bw, cudaStream_t stream, std::mt19937& rng) {
  constexpr int64_t kD = 128;
  std::printf("\n%-34s %10s %10s %7s\n", "attention (Nq 32, Nkv 4, ctx 1024)", "time us",
              "floor us", "vs flr");
  for (const int64_t D : {kD, int64_t{512}, int64_t{1024}}) bench_decode(D, copy_bw, stream, rng);
}

// Causal prefill attention of one sequence at Qwen3-30B-A3B's heads: the Hopper wgmma kernel
// (where the device and build have it), the mma.sync kernel, and at T = 4096 the CUDA-core one.
// TFLOP/s count the causal half of QK^T and PV, 2 T (T + 1) D Nq; "vs cuB" is the ratio to the
// cuBLAS bf16 rate measured in the same run, "vs mma" the mma.sync time over the kernel's.
void bench_prefill_attention(const std::vector<int64_t>& lengths, double peak, cudaStream_t stream,
                             std::mt19937& rng) {
  constexpr int64_t kNq = 32, kNkv = 4, kD = 128;
  const int64_t max_t = *std::max_element(lengths.begin(), lengths.end());
  bf16* q = device_alloc<bf16>(max_t * kNq * kD);
  bf16* k = device_alloc<bf16>(max_t * kNkv * kD);
  bf16* v = device_alloc<bf16>(max_t * kNkv * kD);
  bf16* out = device_alloc<bf16>(max_t * kNq * kD);
  fill_random(q, max_t * kNq * kD, 1.0f, rng);
  fill_random(k, max_t * kNkv * kD, 1.0f, rng);
  fill_random(v, max_t * kNkv * kD, 1.0f, rng);
  int32_t* cu = device_alloc<int32_t>(2);
  const bool hopper = prefill_attention_hopper_available();
  std::printf("\n%-34s %10s %9s %7s %7s\n", "prefill attention (Nq 32, Nkv 4, D 128)", "time us",
              "TFLOP/s", "vs cuB", "vs mma");
  for (const int64_t T : lengths) {
    const int32_t cu_host[2] = {0, static_cast<int32_t>(T)};
    CUDA_CHECK(cudaMemcpy(cu, cu_host, 8, cudaMemcpyHostToDevice));
    const double flops = 4.0 * (T * (T + 1) / 2.0) * kD * kNq;
    auto time_kernel = [&](bool tensor_cores, bool use_hopper) {
      const PrefillParams p{.q = q,
                            .k = k,
                            .v = v,
                            .cu_seqlens = cu,
                            .out = out,
                            .num_tokens = T,
                            .num_seqs = 1,
                            .max_seq_len = T,
                            .num_q_heads = kNq,
                            .num_kv_heads = kNkv,
                            .head_dim = kD,
                            .scale = 1.0f / std::sqrt(static_cast<float>(kD)),
                            .tensor_cores = tensor_cores,
                            .hopper = use_hopper};
      return time_graph(stream, [&](int) { prefill_attention(p, stream); });
    };
    const double mma_ms = time_kernel(true, false);
    auto row = [&](const char* kernel, double ms) {
      const double tflops = flops / (ms * 1e-3) / 1e12;
      char what[64];
      std::snprintf(what, sizeof(what), "prefill T=%lld causal, %s", static_cast<long long>(T),
                    kernel);
      std::printf("%-34s %10.1f %9.1f %7.3f %7.2f\n", what, ms * 1e3, tflops, tflops * 1e12 / peak,
                  mma_ms / ms);
      char part[128];
      std::snprintf(part, sizeof(part), " prefill T=%lld %s %.0f TFLOP/s (%.2f peak);",
                    static_cast<long long>(T), kernel, tflops, tflops * 1e12 / peak);
      g_attention_line += part;
    };
    if (hopper) row("wgmma", time_kernel(true, true));
    row("mma.sync", mma_ms);
    if (T == 4096) row("CUDA cores", time_kernel(false, false));
  }
  CUDA_CHECK(cudaFree(q));
  CUDA_CHECK(cudaFree(k));
  CUDA_CHECK(cudaFree(v));
  CUDA_CHECK(cudaFree(out));
  CUDA_CHECK(cudaFree(cu));
}

int run(int argc, char** argv) {
  bool fp8_only = false, prefill_only = false, attention_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) g_replays = 3;
    if (std::strcmp(argv[i], "--fp8-only") == 0) fp8_only = true;
    if (std::strcmp(argv[i], "--prefill-only") == 0) prefill_only = true;
    if (std::strcmp(argv[i], "--attention-only") == 0) attention_only = true;
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  CUBLAS_CHECK(cublasSetStream(handle, stream));
  std::mt19937 rng(12345);
  std::printf("bench_cuda_moe on %s (%d SMs, %.0f MB L2)\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6);
  // The floors `moeinfer bench` uses, measured the same way (backend/cuda/device_floors.h).
  const double copy_bw = measure_copy_bandwidth();
  const double peak = measure_gemm_flops();
  std::printf(
      "device-to-device copy 1 GiB: %.1f GB/s (read + write); cuBLAS bf16 8192^3: %.1f "
      "TFLOP/s\n",
      copy_bw / 1e9, peak / 1e12);
  if (attention_only) {
    bench_prefill_attention({1024, 2048, 4096, 8192}, peak, stream, rng);
    CUBLAS_CHECK(cublasDestroy(handle));
    CUDA_CHECK(cudaStreamDestroy(stream));
    std::printf("\nbench_cuda_moe attention:%s\n", g_attention_line.c_str());
    return 0;
  }
  std::printf("Qwen3-30B-A3B experts: H %lld, I %lld, E %lld, K %lld, zipf(1.0) routing\n\n",
              static_cast<long long>(kH), static_cast<long long>(kI), static_cast<long long>(kE),
              static_cast<long long>(kK));
  bf16* gate_up[kWeightSets];
  bf16* down[kWeightSets];
  for (int s = 0; s < kWeightSets; ++s) {
    gate_up[s] = device_alloc<bf16>(kE * 2 * kI * kH);
    down[s] = device_alloc<bf16>(kE * kH * kI);
    fill_random(gate_up[s], kE * 2 * kI * kH, 1.0f / std::sqrt(static_cast<float>(kH)), rng);
    fill_random(down[s], kE * kH * kI, 1.0f / std::sqrt(static_cast<float>(kI)), rng);
  }
  if (fp8_only || prefill_only) {
    if (fp8_only) bench_fp8(gate_up, down, stream, rng);
    if (prefill_only) bench_prefill({2048, 4096, 8192}, gate_up, down, handle, stream, rng);
    for (int s = 0; s < kWeightSets; ++s) {
      CUDA_CHECK(cudaFree(gate_up[s]));
      CUDA_CHECK(cudaFree(down[s]));
    }
    CUBLAS_CHECK(cublasDestroy(handle));
    CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
  }
  std::printf("%5s %5s %4s  %-22s %10s %10s %7s %9s %7s\n", "T", "M", "exp", "kernel", "time us",
              "floor us", "vs flr", "TFLOP/s", "vs cuB");
  for (int64_t T : {1, 8, 64, 256, 4096})
    bench_t(T, gate_up, down, copy_bw, peak, handle, stream, rng);
  bench_fp8(gate_up, down, stream, rng);
  // T = 4096 only here (scripts/gpu-check.sh gives the whole run 180 s); --prefill-only runs
  // 2048, 4096 and 8192.
  bench_prefill({4096}, gate_up, down, handle, stream, rng);
  std::string line = "bench_cuda_moe: copy " + std::to_string(static_cast<int>(copy_bw / 1e9)) +
                     " GB/s, cuBLAS " + std::to_string(static_cast<int>(peak / 1e12)) +
                     " TFLOP/s; experts:";
  for (const Row& r : g_rows) {
    if (r.what != "experts (both)") continue;
    char part[96];
    std::snprintf(part, sizeof(part), " T=%lld %.1fus (%.2f floor, %.2f peak);",
                  static_cast<long long>(r.T), r.us, r.ratio, r.flop_ratio);
    line += part;
  }
  for (int s = 0; s < kWeightSets; ++s) {
    CUDA_CHECK(cudaFree(gate_up[s]));
    CUDA_CHECK(cudaFree(down[s]));
  }
  bench_attention(copy_bw, stream, rng);
  bench_prefill_attention({1024, 2048, 4096, 8192}, peak, stream, rng);
  CUBLAS_CHECK(cublasDestroy(handle));
  CUDA_CHECK(cudaStreamDestroy(stream));
  std::printf("\n%s attention:%s\n", line.c_str(), g_attention_line.c_str());
  return 0;
}

}  // namespace
}  // namespace moeinfer::cuda

int main(int argc, char** argv) {
  try {
    return moeinfer::cuda::run(argc, argv);
  } catch (const moeinfer::Error& error) {
    std::fprintf(stderr, "bench_cuda_moe: %s\n", error.what());
    return 1;
  }
}

#else  // !MOE_HAVE_CUDA

#include <cstdio>

int main() {
  std::printf("bench_cuda_moe: built without CUDA; nothing to measure\n");
  return 0;
}

#endif
