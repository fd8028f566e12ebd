// How fast is our whole MoE layer on the GPU? The moeinfer half of the side-by-side benchmark
// against a PyTorch layer built on torch._grouped_mm (bench/torch_moe_reference.py runs this
// program and the PyTorch layer in one invocation and prints the ratio).
//
// Shape: the Qwen3-30B-A3B MoE layer (H 2048, E 128, K 8, I 768), softmax top-k with the K
// weights renormalised (norm_topk_prob), bf16 weights and activations, float32 router logits,
// no shared experts. The layer is what the CUDA decoder enqueues for it (model/cuda/
// gpu_decoder.cpp, feed_forward), nothing more and nothing less:
//   router GEMM   cuBLAS, x [T, H] . Wr [E, H]^T -> logits [T, E] float32
//   route         cuda::fused_router (softmax, top-K, renormalise)
//   plan          cuda::moe_plan (counting sort of the T*K assignments by expert)
//   experts       cuda::moe_experts with the src_row gather (no separate permute)
//   unpermute     cuda::unpermute (weighted sum of the K rows of each token, float32, to bf16)
//
// Method: random inputs, never zeros (x ~ N(0, 1); Wr, gate_up ~ N(0, 1/H); down ~ N(0, 1/I)),
// so the routing is that of an untrained router: near-uniform, the same distribution the
// PyTorch script draws. Three copies of the layer's weights (3 x 1.2 GB) are rotated over
// successive layer calls so a decode-size call does not find its experts in L2 from the call
// before (in a real model the previous call was another layer with other weights). 20 layer
// calls are captured in a CUDA graph; the median of 10 replays (after 2 warm-ups), over 20, is
// the time of one layer. Routing metadata stays on the device; nothing is read back between
// calls. Each stage is then timed alone the same way (for the breakdown only: alone, a stage
// loses the overlap with its predecessor that the experts' programmatic launch gives it).
//
// Fused columns (T*K <= 512 only): the same layer through cuda::small_batch_moe (router logits,
// routing, plan, experts and weighted sum in two launches), timed the same way: "fused us", its
// "vs flr", and "gen/fus", the general layer's time over the fused one. Its output is checked
// against the general layer's on weight copy 0 (max |fused - general| over max |general| must
// stay within 2e-2: the general path rounds the SiLU product and the expert outputs to bf16);
// the program fails if it does not.
//
// Floor column: the bytes the layer must move at least (the distinct experts the routing of
// weight copy 0 touched, column "exp", x 3*I*H*2 bytes; the router weights; x read once and
// the output written once) over the device-to-device copy bandwidth measured in the same run;
// "vs flr" = floor time / measured time.
//
// --weights fp8|int4: the routed experts are quantised slabs (backend/cuda/expert_quant.h,
// random codes from cuda::quant_random_fill, a scale (and int4 zero point) per 128 inputs of a
// row, as --weights gives), read by both paths: the general layer's grouped GEMM dequantises
// them into shared memory, the fused layer in registers. An expert's floor bytes are then the
// codes and scales both paths read (expert_quant_read_bytes), not 3*I*H*2.
//
// Usage: bench_cuda_moe_layer [--tokens 1,2,4,...] [--json FILE] [--quick] [--no-stages]
//                             [--weights bf16|fp8|int4] [--tile auto|rows16|skinny]
//                             [--dump DIR [--dump-tokens N]]
//   --tile        forces the experts stage's grouped GEMM tile (grouped_gemm.h's GemmTile:
//                 the 16-row mma.sync tile or the skinny kernel); auto is the engine's choice
//   --json FILE   writes {"T": microseconds per layer, ...}
//   --dump DIR    runs the layer once at T = N (default 37) with weight copy 0 and writes its
//                 inputs, weights, routing and output as raw little-endian arrays plus
//                 meta.json, for the PyTorch script to recompute the same layer and compare
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/device_floors.h"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/small_batch_moe.h"
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
constexpr int kLaunchesPerGraph = 20;
constexpr int kWarmupReplays = 2;
// The decoder's cuBLAS workspace, set explicitly so captured GEMMs never allocate.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
int g_replays = 10;
// --weights: the routed experts' format, and the inputs per scale --weights fp8 and int4 give
// (model/weight_quant.h).
ExpertQuant g_quant = ExpertQuant::kNone;
GemmTile g_tile = GemmTile::kAuto;  // --tile: the experts stage's grouped GEMM
constexpr int64_t kQuantGroup = 128;

// Bytes of one [rows, cols] expert matrix that a product reads: bf16 values, or the codes and
// scales (and int4 zero points) of its slab, without the slab's alignment padding.
double expert_matrix_read_bytes(int64_t rows, int64_t cols) {
  if (g_quant == ExpertQuant::kNone) return 2.0 * rows * cols;
  const QuantMatrixLayout l = quant_matrix_layout(g_quant, rows, cols, kQuantGroup);
  const double per_group = g_quant == ExpertQuant::kInt4 ? 8.0 : 4.0;
  return static_cast<double>(rows) * (l.row_code_bytes + l.groups_per_row * per_group);
}

// Bytes of one [rows, cols] expert matrix in memory (a quantised slab with its padding).
int64_t expert_matrix_bytes(int64_t rows, int64_t cols) {
  if (g_quant == ExpertQuant::kNone) return 2 * rows * cols;
  return quant_matrix_layout(g_quant, rows, cols, kQuantGroup).bytes;
}

// Median milliseconds of one call of `body` (called with the call index within the graph).
double time_graph(cudaStream_t stream, const std::function<void(int)>& body) {
  return bench_util::time_graph(stream, kLaunchesPerGraph, g_replays, kWarmupReplays, body);
}


// One copy of the layer's weights.
struct LayerWeights {
  bf16* router = nullptr;   // [E, H]
  bf16* gate_up = nullptr;  // [E, 2I, H], gate rows [0, I) then up rows [I, 2I); or E slabs
  bf16* down = nullptr;     // [E, H, I]; or E slabs
};

// Activations and routing metadata, sized for the largest T.
struct LayerBuffers {
  bf16* x = nullptr;                  // [T, H] the layer's input (the normed hidden state)
  float* logits = nullptr;            // [T, E]
  int32_t* topk_ids = nullptr;        // [T, K]
  float* topk_weights = nullptr;      // [T, K]
  int32_t* expert_counts = nullptr;   // [E]
  int32_t* expert_offsets = nullptr;  // [E + 1]
  int32_t* src_row = nullptr;         // [T*K]
  int32_t* inverse = nullptr;         // [T*K]
  int32_t* plan_workspace = nullptr;  // [plan_workspace_size(T*K, E)] or null
  bf16* activation = nullptr;         // [T*K, I]
  bf16* expert_out = nullptr;         // [T*K, H]
  float* out = nullptr;               // [T, H], float32 as the decoder's block output
};

// y[T, E] float32 = x[T, H] . w[E, H]^T, as the decoder's linear(..., f32_out = true).
void router_gemm(cublasHandle_t handle, const bf16* x, const bf16* w, float* y, int64_t T) {
  const float one = 1.0f, zero = 0.0f;
  CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(kE),
                            static_cast<int>(T), static_cast<int>(kH), &one, w, CUDA_R_16BF,
                            static_cast<int>(kH), x, CUDA_R_16BF, static_cast<int>(kH), &zero, y,
                            CUDA_R_32F, static_cast<int>(kE), CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

RouterParams route_params(const LayerBuffers& b, int64_t T) {
  return RouterParams{.logits = b.logits,
                      .topk_ids = b.topk_ids,
                      .topk_weights = b.topk_weights,
                      .num_tokens = T,
                      .num_experts = kE,
                      .top_k = kK,
                      .score = RouterScore::kSoftmax,
                      .renormalize = true};
}

PlanParams plan_params(const LayerBuffers& b, int64_t T) {
  return PlanParams{.topk_ids = b.topk_ids,
                    .expert_counts = b.expert_counts,
                    .expert_offsets = b.expert_offsets,
                    .src_row = b.src_row,
                    .inverse = b.inverse,
                    .workspace = b.plan_workspace,
                    .num_assignments = T * kK,
                    .num_experts = kE};
}

MoeExpertsParams experts_params(const LayerBuffers& b, const LayerWeights& w, int64_t T) {
  return MoeExpertsParams{.rows = b.x,
                          .gate_up = w.gate_up,
                          .down = w.down,
                          .quant = g_quant,
                          .quant_group = g_quant == ExpertQuant::kNone ? 0 : kQuantGroup,
                          .expert_offsets = b.expert_offsets,
                          .activation = b.activation,
                          .out = b.expert_out,
                          .num_rows = T * kK,
                          .num_experts = kE,
                          .hidden_size = kH,
                          .expert_width = kI,
                          .src_row = b.src_row,
                          .top_k = kK,
                          .tile = g_tile};
}

UnpermuteParams unpermute_params(const LayerBuffers& b, int64_t T) {
  return UnpermuteParams{.expert_out = b.expert_out,
                         .topk_weights = b.topk_weights,
                         .inverse = b.inverse,
                         .out = b.out,
                         .num_tokens = T,
                         .top_k = kK,
                         .hidden_size = kH};
}

SmallMoeParams small_moe_params(const LayerBuffers& b, const LayerWeights& w, int64_t T,
                                int32_t* counts, float* out, void* workspace) {
  return SmallMoeParams{.hidden = b.x,
                        .router = w.router,
                        .route = route_params(b, T),
                        .gate_up = w.gate_up,
                        .down = w.down,
                        .quant = g_quant,
                        .quant_group = g_quant == ExpertQuant::kNone ? 0 : kQuantGroup,
                        .expert_width = kI,
                        .expert_counts = counts,
                        .out = out,
                        .workspace = workspace,
                        .hidden_size = kH};
}

// max |a - b| / max |b| over n float32 device values.
double relative_max_difference(const float* a, const float* b, int64_t n) {
  std::vector<float> ha(n), hb(n);
  CUDA_CHECK(cudaMemcpy(ha.data(), a, n * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(hb.data(), b, n * 4, cudaMemcpyDeviceToHost));
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(ha[i]) - hb[i]));
    scale = std::max(scale, std::abs(static_cast<double>(hb[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// The whole layer: out[T, H] = MoE(x[T, H]) with the weights `w`.
void moe_layer(const LayerBuffers& b, const LayerWeights& w, int64_t T, cublasHandle_t handle,
               cudaStream_t stream) {
  router_gemm(handle, b.x, w.router, b.logits, T);
  fused_router(route_params(b, T), stream);
  moe_plan(plan_params(b, T), stream);
  moe_experts(experts_params(b, w, T), stream);
  unpermute(unpermute_params(b, T), stream);
}

template <typename T>
void write_raw(const std::string& path, const T* device, size_t count) {
  std::vector<T> host(count);
  CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
  std::ofstream f(path, std::ios::binary);
  MOE_CHECK(f.good(), "cannot open ", path, " for writing");
  f.write(reinterpret_cast<const char*>(host.data()),
          static_cast<std::streamsize>(count * sizeof(T)));
  MOE_CHECK(f.good(), "short write to ", path);
}

// Runs the layer once at T tokens with weight copy 0 and writes everything the PyTorch script
// needs to recompute it (see the header comment).
void dump_layer(const std::string& dir, int64_t T, const LayerBuffers& b, const LayerWeights& w,
                cublasHandle_t handle, cudaStream_t stream) {
  CUDA_CHECK(cudaMemsetAsync(b.out, 0xff, T * kH * 4, stream));  // poison: NaN if not written
  moe_layer(b, w, T, handle, stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  write_raw(dir + "/x.bin", b.x, T * kH);
  write_raw(dir + "/router.bin", w.router, kE * kH);
  write_raw(dir + "/gate_up.bin", w.gate_up, kE * 2 * kI * kH);
  write_raw(dir + "/down.bin", w.down, kE * kH * kI);
  write_raw(dir + "/topk_ids.bin", b.topk_ids, T * kK);
  write_raw(dir + "/topk_weights.bin", b.topk_weights, T * kK);
  write_raw(dir + "/out.bin", b.out, T * kH);
  std::ofstream meta(dir + "/meta.json");
  MOE_CHECK(meta.good(), "cannot open ", dir, "/meta.json for writing");
  meta << "{\"T\": " << T << ", \"H\": " << kH << ", \"I\": " << kI << ", \"E\": " << kE
       << ", \"K\": " << kK
       << ", \"files\": {\"x\": \"bf16 [T, H]\", \"router\": \"bf16 [E, H]\", \"gate_up\": "
          "\"bf16 [E, 2I, H]\", \"down\": \"bf16 [E, H, I]\", \"topk_ids\": \"int32 [T, K]\", "
          "\"topk_weights\": \"float32 [T, K]\", \"out\": \"bf16 [T, H]\"}}\n";
  MOE_CHECK(meta.good(), "short write to ", dir, "/meta.json");
  std::printf("dumped the layer at T=%lld to %s\n", static_cast<long long>(T), dir.c_str());
}

std::vector<int64_t> parse_tokens(const char* text) {
  std::vector<int64_t> out;
  std::string s(text);
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, comma - pos);
    MOE_CHECK(!item.empty(), "empty token count in --tokens ", s);
    size_t used = 0;
    const long long v = std::stoll(item, &used);
    MOE_CHECK(used == item.size() && v >= 1 && v <= 65536, "bad token count '", item,
              "' in --tokens (1..65536)");
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

int run(int argc, char** argv) {
  std::vector<int64_t> tokens = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192};
  std::string json_path, dump_dir;
  int64_t dump_tokens = 37;
  bool stages = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      MOE_CHECK(i + 1 < argc, a, " needs a value");
      return argv[++i];
    };
    if (a == "--quick") {
      g_replays = 3;
    } else if (a == "--no-stages") {
      stages = false;
    } else if (a == "--json") {
      json_path = value();
    } else if (a == "--tokens") {
      tokens = parse_tokens(value());
    } else if (a == "--dump") {
      dump_dir = value();
    } else if (a == "--weights") {
      const std::string format = value();
      MOE_CHECK(format == "bf16" || format == "fp8" || format == "int4", "--weights ", format,
                ": bf16, fp8 or int4");
      g_quant = format == "fp8"    ? ExpertQuant::kFp8
                : format == "int4" ? ExpertQuant::kInt4
                                   : ExpertQuant::kNone;
    } else if (a == "--tile") {
      const std::string tile = value();
      MOE_CHECK(tile == "auto" || tile == "rows16" || tile == "skinny", "--tile ", tile,
                ": auto, rows16 or skinny");
      g_tile = tile == "rows16"   ? GemmTile::kRows16
               : tile == "skinny" ? GemmTile::kSkinny
                                  : GemmTile::kAuto;
    } else if (a == "--dump-tokens") {
      dump_tokens = parse_tokens(value()).at(0);
    } else {
      MOE_CHECK(false, "unknown argument ", a,
                " (usage: bench_cuda_moe_layer [--tokens 1,2,...] [--json FILE] [--quick] "
                "[--no-stages] [--weights bf16|fp8|int4] [--tile auto|rows16|skinny] "
                "[--dump DIR [--dump-tokens N]])");
    }
  }
  MOE_CHECK(dump_dir.empty() || g_quant == ExpertQuant::kNone,
            "--dump writes bf16 experts for the PyTorch script: not with --weights ",
            expert_quant_name(g_quant));
  const int64_t max_t =
      std::max(*std::max_element(tokens.begin(), tokens.end()), dump_dir.empty() ? 0 : dump_tokens);

  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t handle;
  CUBLAS_CHECK(cublasCreate(&handle));
  CUBLAS_CHECK(cublasSetStream(handle, stream));
  CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
  void* cublas_workspace = device_alloc<char>(kCublasWorkspaceBytes);
  CUBLAS_CHECK(cublasSetWorkspace(handle, cublas_workspace, kCublasWorkspaceBytes));
  std::mt19937 rng(20240611);

  std::printf("bench_cuda_moe_layer on %s (%d SMs, %.0f MB L2)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  const double copy_bw = measure_copy_bandwidth();  // backend/cuda/device_floors.h
  std::printf("device-to-device copy 1 GiB: %.1f GB/s (read + write)\n", copy_bw / 1e9);
  std::printf(
      "Qwen3-30B-A3B MoE layer: H %lld, I %lld, E %lld, K %lld, softmax top-k renormalised, %s "
      "experts; %d weight copies rotated, %d layers per graph, median of %d replays\n",
      static_cast<long long>(kH), static_cast<long long>(kI), static_cast<long long>(kE),
      static_cast<long long>(kK), expert_quant_name(g_quant), kWeightSets, kLaunchesPerGraph,
      g_replays);

  LayerWeights weights[kWeightSets];
  for (LayerWeights& w : weights) {
    w.router = device_alloc<bf16>(kE * kH);
    fill_random(w.router, kE * kH, 1.0f / std::sqrt(static_cast<float>(kH)), rng);
    if (g_quant == ExpertQuant::kNone) {
      w.gate_up = device_alloc<bf16>(kE * 2 * kI * kH);
      w.down = device_alloc<bf16>(kE * kH * kI);
      fill_random(w.gate_up, kE * 2 * kI * kH, 1.0f / std::sqrt(static_cast<float>(kH)), rng);
      fill_random(w.down, kE * kH * kI, 1.0f / std::sqrt(static_cast<float>(kI)), rng);
      continue;
    }
    // Uniform in +-sqrt(3) / sqrt(fan-in): the bf16 weights' standard deviation.
    auto quantised = [&](int64_t rows, int64_t cols) {
      auto* slabs = device_alloc<char>(kE * expert_matrix_bytes(rows, cols));
      quant_random_fill({.out = slabs,
                         .num_slabs = kE,
                         .rows = rows,
                         .cols = cols,
                         .format = g_quant,
                         .group = kQuantGroup,
                         .seed = (static_cast<uint64_t>(rng()) << 32) | rng(),
                         .scale = std::sqrt(3.0f / static_cast<float>(cols))},
                        stream);
      return reinterpret_cast<bf16*>(slabs);
    };
    w.gate_up = quantised(2 * kI, kH);
    w.down = quantised(kH, kI);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t max_m = max_t * kK;
  LayerBuffers b;
  b.x = device_alloc<bf16>(max_t * kH);
  b.logits = device_alloc<float>(max_t * kE);
  b.topk_ids = device_alloc<int32_t>(max_m);
  b.topk_weights = device_alloc<float>(max_m);
  b.expert_counts = device_alloc<int32_t>(kE);
  b.expert_offsets = device_alloc<int32_t>(kE + 1);
  b.src_row = device_alloc<int32_t>(max_m);
  b.inverse = device_alloc<int32_t>(max_m);
  // The largest T needs the most plan scratch; smaller T need less (or none).
  int64_t max_ws = 0;
  for (int64_t T : tokens) max_ws = std::max(max_ws, plan_workspace_size(T * kK, kE));
  if (!dump_dir.empty()) max_ws = std::max(max_ws, plan_workspace_size(dump_tokens * kK, kE));
  int32_t* plan_ws = device_alloc<int32_t>(max_ws);
  b.activation = device_alloc<bf16>(max_m * kI);
  b.expert_out = device_alloc<bf16>(max_m * kH);
  b.out = device_alloc<float>(max_t * kH);
  fill_random(b.x, max_t * kH, 1.0f, rng);
  // The fused path's buffers, for the T it takes.
  int64_t max_fused_t = 0;
  for (int64_t T : tokens)
    if (small_moe_supports(T, kE, kK, kH, kI, 0)) max_fused_t = std::max(max_fused_t, T);
  const int64_t fused_ws_bytes =
      max_fused_t > 0 ? small_moe_workspace_bytes(max_fused_t, kE, kK, kH, kI, 0) : 0;
  void* fused_ws = max_fused_t > 0 ? device_alloc<char>(fused_ws_bytes) : nullptr;
  if (fused_ws) CUDA_CHECK(cudaMemset(fused_ws, 0, fused_ws_bytes));
  int32_t* fused_counts = device_alloc<int32_t>(kE + 1);
  float* fused_out = device_alloc<float>(std::max<int64_t>(max_fused_t, 1) * kH);
  bool fused_ok = true;

  std::printf("\n%6s %5s %10s %10s %7s | %9s %7s %7s %8s", "T", "exp", "layer us", "floor us",
              "vs flr", "fused us", "vs flr", "gen/fus", "fus err");
  if (stages)
    std::printf("   | %8s %8s %8s %8s %8s  (each stage alone, us)", "rt gemm", "route", "plan",
                "experts", "unperm");
  std::printf("\n");
  std::vector<std::pair<int64_t, double>> results;
  for (int64_t T : tokens) {
    b.plan_workspace = plan_workspace_size(T * kK, kE) > 0 ? plan_ws : nullptr;
    // One untimed call: checks the launches and leaves a real routing for the stage timings.
    moe_layer(b, weights[0], T, handle, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<int32_t> counts(kE);
    CUDA_CHECK(cudaMemcpy(counts.data(), b.expert_counts, kE * 4, cudaMemcpyDeviceToHost));
    const int64_t touched =
        std::count_if(counts.begin(), counts.end(), [](int32_t c) { return c > 0; });

    const double layer_ms = time_graph(
        stream, [&](int i) { moe_layer(b, weights[i % kWeightSets], T, handle, stream); });
    const double expert_bytes =
        expert_matrix_read_bytes(2 * kI, kH) + expert_matrix_read_bytes(kH, kI);
    const double floor_bytes =
        touched * expert_bytes + kE * kH * 2.0 + T * kH * (2.0 + 4.0);  // experts, Wr, x, out
    const double floor_ms = floor_bytes / copy_bw * 1e3;
    std::printf("%6lld %5lld %10.1f %10.1f %7.3f", static_cast<long long>(T),
                static_cast<long long>(touched), layer_ms * 1e3, floor_ms * 1e3,
                floor_ms / layer_ms);
    if (small_moe_supports(T, kE, kK, kH, kI, 0) &&
        small_moe_supports_quant(g_quant, kQuantGroup, kH, kI)) {
      moe_layer(b, weights[0], T, handle, stream);
      small_batch_moe(small_moe_params(b, weights[0], T, fused_counts, fused_out, fused_ws),
                      stream);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const double err = relative_max_difference(fused_out, b.out, T * kH);
      if (!(err <= 2e-2)) fused_ok = false;
      const double fused_ms = time_graph(stream, [&](int i) {
        small_batch_moe(small_moe_params(b, weights[i % kWeightSets], T, fused_counts, fused_out,
                                         fused_ws),
                        stream);
      });
      std::printf(" | %9.1f %7.3f %7.2f %8.1e%s", fused_ms * 1e3, floor_ms / fused_ms,
                  layer_ms / fused_ms, err, err <= 2e-2 ? "" : " FAIL");
      // The stage timings below want the general path's routing metadata back.
      moe_layer(b, weights[0], T, handle, stream);
    } else {
      std::printf(" | %9s %7s %7s %8s", "-", "-", "-", "-");
    }
    if (stages) {
      const double gemm_ms = time_graph(stream, [&](int i) {
        router_gemm(handle, b.x, weights[i % kWeightSets].router, b.logits, T);
      });
      const double route_ms =
          time_graph(stream, [&](int) { fused_router(route_params(b, T), stream); });
      const double plan_ms = time_graph(stream, [&](int) { moe_plan(plan_params(b, T), stream); });
      const double experts_ms = time_graph(stream, [&](int i) {
        moe_experts(experts_params(b, weights[i % kWeightSets], T), stream);
      });
      const double unperm_ms =
          time_graph(stream, [&](int) { unpermute(unpermute_params(b, T), stream); });
      std::printf("   | %8.1f %8.1f %8.1f %8.1f %8.1f", gemm_ms * 1e3, route_ms * 1e3,
                  plan_ms * 1e3, experts_ms * 1e3, unperm_ms * 1e3);
    }
    std::printf("\n");
    std::fflush(stdout);
    results.emplace_back(T, layer_ms * 1e3);
  }

  if (!json_path.empty()) {
    std::ofstream f(json_path);
    MOE_CHECK(f.good(), "cannot open ", json_path, " for writing");
    f << "{";
    for (size_t i = 0; i < results.size(); ++i) {
      char item[64];
      std::snprintf(item, sizeof(item), "%s\"%lld\": %.3f", i ? ", " : "",
                    static_cast<long long>(results[i].first), results[i].second);
      f << item;
    }
    f << "}\n";
    MOE_CHECK(f.good(), "short write to ", json_path);
  }
  if (!dump_dir.empty()) {
    b.plan_workspace = plan_workspace_size(dump_tokens * kK, kE) > 0 ? plan_ws : nullptr;
    dump_layer(dump_dir, dump_tokens, b, weights[0], handle, stream);
  }

  std::string line = "bench_cuda_moe_layer: layer us";
  for (const auto& [T, us] : results) {
    char part[48];
    std::snprintf(part, sizeof(part), " T=%lld %.1f;", static_cast<long long>(T), us);
    line += part;
  }
  std::printf("\n%s\n", line.c_str());
  if (fused_ws) CUDA_CHECK(cudaFree(fused_ws));
  CUDA_CHECK(cudaFree(fused_counts));
  CUDA_CHECK(cudaFree(fused_out));
  MOE_CHECK(fused_ok, "the fused layer's output differs from the general layer's by more than 2e-2");

  for (LayerWeights& w : weights) {
    CUDA_CHECK(cudaFree(w.router));
    CUDA_CHECK(cudaFree(w.gate_up));
    CUDA_CHECK(cudaFree(w.down));
  }
  for (void* p : {static_cast<void*>(b.x), static_cast<void*>(b.logits),
                  static_cast<void*>(b.topk_ids), static_cast<void*>(b.topk_weights),
                  static_cast<void*>(b.expert_counts), static_cast<void*>(b.expert_offsets),
                  static_cast<void*>(b.src_row), static_cast<void*>(b.inverse),
                  static_cast<void*>(plan_ws), static_cast<void*>(b.activation),
                  static_cast<void*>(b.expert_out), static_cast<void*>(b.out), cublas_workspace})
    CUDA_CHECK(cudaFree(p));
  CUBLAS_CHECK(cublasDestroy(handle));
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace moeinfer::cuda

int main(int argc, char** argv) {
  try {
    return moeinfer::cuda::run(argc, argv);
  } catch (const moeinfer::Error& error) {
    std::fprintf(stderr, "bench_cuda_moe_layer: %s\n", error.what());
    return 1;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "bench_cuda_moe_layer: %s\n", error.what());
    return 1;
  }
}

#else  // !MOE_HAVE_CUDA

#include <cstdio>

int main() {
  std::printf("bench_cuda_moe_layer: built without CUDA; nothing to measure\n");
  return 0;
}

#endif
