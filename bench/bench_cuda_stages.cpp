// How close are the CUDA MoE-stage kernels (backend/cuda/moe_stages.h) to the memory floor?
//
// For each stage and shape: the fewest bytes the stage must move (each input read once, each
// output written once), the median time of one launch, the achieved GB/s and its ratio to a
// device-to-device copy measured in the same run (bytes read + written). Shapes: Qwen3-30B-A3B
// (H 2048, E 128, K 8) at decode (T 1, 64) and prefill (T 4096), a DeepSeek-V3-sized layer
// (H 7168, E 256, K 8, T 4096), and shapes past the kernels' fast paths, which no published
// model has: E 4099 with K 64 (the block router) at T 1 and 1024, and E 12000 with K 36 (the
// block router without its shared-memory cache, the plan's histograms in the workspace).
//
// Method: inputs are random (never zeros); the metadata each stage reads comes from the stages
// before it (router -> plan -> permute/unpermute), so the ids are a real routing. Each
// measurement captures 20 launches in a CUDA graph and times graph replays with events (3
// warm-up replays, then the median of 25), so launch gaps stay out of the per-launch time.
// Successive launches rotate over as many buffer sets as fit in 256 MB, so at prefill sizes
// the inputs are not served from L2 by the previous launch; decode shapes live in L2 anyway,
// as they do in a real step where the previous kernel just wrote them.
//
// Then decode's dense projections (Qwen3-30B-A3B's QKV, O and router, its LM head) at M = 1 to
// 8 rows: the skinny GEMM (backend/cuda/skinny_gemm.h) against the cuBLAS call the decoder
// makes, each launch reading another copy of the weights (as many as fit in 256 MB) so that
// they come from HBM, as in a step whose 48 layers' weights never fit in L2; the floor is the
// weights' bytes (and x's and y's) at the copy rate.
//
// Then the same QKV and O projections held quantised (--weights fp8|int4 --weights-scope linear):
// the quantised skinny GEMM (quant_skinny_gemm, 8 rows a launch) at M = 1 to 16 or 32, and the
// decoder's other path (dequantize_matrix into a bf16 scratch, then cuBLAS), against the bf16
// skinny GEMM at M = 1 measured in the same run; the floor is the codes' and scales' bytes.
//
// Usage: bench_cuda_stages [--quick] [--projections-only]   (--quick: fewer replays)
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/expert_quant.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/skinny_gemm.h"
#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer::cuda {
namespace {

int g_replays = 25;
constexpr int kLaunchesPerGraph = 20;
constexpr int kWarmupReplays = 3;
constexpr size_t kRotateBytes = size_t{256} << 20;

struct DeviceMemory {
  explicit DeviceMemory(size_t bytes) : bytes(bytes) {
    CUDA_CHECK(cudaMalloc(&data, std::max<size_t>(bytes, 16)));
  }
  ~DeviceMemory() { cudaFree(data); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  void* data = nullptr;
  size_t bytes = 0;
};

// Fills device memory with a random pattern of bf16 values (or float32) of unit scale.
void fill_random_bf16(void* dst, size_t count, std::mt19937& rng) {
  const size_t pattern_len = std::min<size_t>(count, size_t{1} << 20);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> pattern(pattern_len);
  for (auto& v : pattern) v = f32_to_bf16(dist(rng));
  for (size_t done = 0; done < count; done += pattern_len) {
    const size_t n = std::min(pattern_len, count - done);
    CUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(dst) + done, pattern.data(), n * 2,
                          cudaMemcpyHostToDevice));
  }
}

void fill_random_f32(void* dst, size_t count, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> host(count);
  for (auto& v : host) v = dist(rng);
  CUDA_CHECK(cudaMemcpy(dst, host.data(), count * 4, cudaMemcpyHostToDevice));
}

// Median time of one launch of `launch(i)` (i = launch index within the graph), in ms.
double time_launch(cudaStream_t stream, const std::function<void(int)>& launch) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kLaunchesPerGraph; ++i) launch(i);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int r = 0; r < kWarmupReplays; ++r) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  std::vector<float> times;
  for (int r = 0; r < g_replays; ++r) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2] / kLaunchesPerGraph;
}

// Copy bandwidth: bytes read + written per second by cudaMemcpyAsync device to device, 1 GiB,
// issued on the stream with events around each copy, median of 20 after 3 warm-ups. Not a
// captured memcpy node: the first run here timed one at 2.7 TB/s, below what the row kernels
// below reached, so it is no floor; graph_copy_bandwidth() prints it for comparison.
double copy_bandwidth(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  DeviceMemory src(bytes), dst(bytes);
  CUDA_CHECK(cudaMemset(src.data, 0x5a, bytes));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int r = 0; r < 23; ++r) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, bytes, cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (r >= 3) times.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return 2.0 * static_cast<double>(bytes) / (times[times.size() / 2] * 1e-3);
}

double graph_copy_bandwidth(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  DeviceMemory src(bytes), dst(bytes);
  CUDA_CHECK(cudaMemset(src.data, 0x5a, bytes));
  const double ms = time_launch(stream, [&](int) {
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3);
}

struct Shape {
  const char* name;
  int64_t T, E, K, H;
  bool shared;  // the layer has shared experts (their output joins in unpermute)
};

struct Row {
  std::string stage, shape;
  double us, bytes, gbps, ratio;
};

std::vector<Row> g_rows;

void report(const std::string& stage, const Shape& s, double ms, double bytes, double copy_bw) {
  char shape[96];
  std::snprintf(shape, sizeof(shape), "%s T=%lld", s.name, static_cast<long long>(s.T));
  const double bw = bytes / (ms * 1e-3);
  g_rows.push_back({stage, shape, ms * 1e3, bytes, bw / 1e9, bw / copy_bw});
  std::printf("%-10s %-22s %10.2f us %10.2f MB %9.1f GB/s %7.3f\n", stage.c_str(), shape, ms * 1e3,
              bytes / 1e6, bw / 1e9, bw / copy_bw);
  std::fflush(stdout);
}

void bench_shape(const Shape& s, double copy_bw, cudaStream_t stream, std::mt19937& rng) {
  const int64_t T = s.T, E = s.E, K = s.K, H = s.H, N = T * K;
  // One buffer set per rotation slot; decode sizes get the full 20, prefill sizes fewer.
  const size_t set_bytes = T * E * 4 + N * 8 + N * H * 2 + 3 * T * H * 2 + 2 * T * H * 4;
  const int sets = static_cast<int>(
      std::clamp<size_t>(kRotateBytes / std::max<size_t>(set_bytes, 1), 1, kLaunchesPerGraph));
  struct Set {
    std::unique_ptr<DeviceMemory> logits, ids, weights, counts, offsets, src_row, inverse, ws;
    std::unique_ptr<DeviceMemory> hidden, rows, out, residual, shared, norm_out;
  };
  std::vector<Set> set(sets);
  for (Set& b : set) {
    b.logits = std::make_unique<DeviceMemory>(T * E * 4);
    b.ids = std::make_unique<DeviceMemory>(N * 4);
    b.weights = std::make_unique<DeviceMemory>(N * 4);
    b.counts = std::make_unique<DeviceMemory>(E * 4);
    b.offsets = std::make_unique<DeviceMemory>((E + 1) * 4);
    b.src_row = std::make_unique<DeviceMemory>(N * 4);
    b.ws = std::make_unique<DeviceMemory>(plan_workspace_size(N, E) * 4);
    b.inverse = std::make_unique<DeviceMemory>(N * 4);
    b.hidden = std::make_unique<DeviceMemory>(T * H * 2);
    b.rows = std::make_unique<DeviceMemory>(N * H * 2);
    b.out = std::make_unique<DeviceMemory>(T * H * 4);       // float32 block output
    b.residual = std::make_unique<DeviceMemory>(T * H * 4);  // float32 residual stream
    b.shared = std::make_unique<DeviceMemory>(T * H * 2);
    b.norm_out = std::make_unique<DeviceMemory>(T * H * 2);
    fill_random_f32(b.logits->data, T * E, rng);
    fill_random_bf16(b.hidden->data, T * H, rng);
    fill_random_bf16(b.rows->data, N * H, rng);
    fill_random_f32(b.residual->data, T * H, rng);
    fill_random_bf16(b.shared->data, T * H, rng);
  }
  DeviceMemory norm_weight(H * 2);
  fill_random_bf16(norm_weight.data, H, rng);

  auto router_params = [&](int i) {
    const Set& b = set[i % sets];
    return RouterParams{.logits = b.logits->as<float>(),
                        .topk_ids = b.ids->as<int32_t>(),
                        .topk_weights = b.weights->as<float>(),
                        .num_tokens = T,
                        .num_experts = E,
                        .top_k = K,
                        .renormalize = true};
  };
  auto plan_params = [&](int i) {
    const Set& b = set[i % sets];
    return PlanParams{.topk_ids = b.ids->as<int32_t>(),
                      .expert_counts = b.counts->as<int32_t>(),
                      .expert_offsets = b.offsets->as<int32_t>(),
                      .src_row = b.src_row->as<int32_t>(),
                      .inverse = b.inverse->as<int32_t>(),
                      .workspace = b.ws->as<int32_t>(),
                      .num_assignments = N,
                      .num_experts = E};
  };
  // Real metadata first: every set's routing and plan.
  for (int i = 0; i < sets; ++i) {
    fused_router(router_params(i), stream);
    moe_plan(plan_params(i), stream);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));

  report("route", s, time_launch(stream, [&](int i) { fused_router(router_params(i), stream); }),
         static_cast<double>(T * E * 4 + N * 8), copy_bw);
  report("plan", s, time_launch(stream, [&](int i) { moe_plan(plan_params(i), stream); }),
         static_cast<double>(N * 4 + (2 * E + 1) * 4 + N * 8), copy_bw);
  report("permute", s,
         time_launch(stream,
                     [&](int i) {
                       const Set& b = set[i % sets];
                       permute(PermuteParams{.hidden = b.hidden->as<bf16>(),
                                             .inverse = b.inverse->as<int32_t>(),
                                             .rows = b.rows->as<bf16>(),
                                             .num_tokens = T,
                                             .top_k = K,
                                             .hidden_size = H},
                               stream);
                     }),
         static_cast<double>(T * H * 2 + N * H * 2 + N * 4), copy_bw);
  report("unpermute", s,
         time_launch(stream,
                     [&](int i) {
                       const Set& b = set[i % sets];
                       unpermute(
                           UnpermuteParams{.expert_out = b.rows->as<bf16>(),
                                           .topk_weights = b.weights->as<float>(),
                                           .inverse = b.inverse->as<int32_t>(),
                                           .shared = s.shared ? b.shared->as<bf16>() : nullptr,
                                           .residual = b.residual->as<float>(),
                                           .out = b.out->as<float>(),
                                           .num_tokens = T,
                                           .top_k = K,
                                           .hidden_size = H},
                           stream);
                     }),
         static_cast<double>(N * H * 2 + N * 8 + T * H * (s.shared ? 2 : 0) + T * H * 4 * 2),
         copy_bw);
  report("rms_norm", s,
         time_launch(stream,
                     [&](int i) {
                       const Set& b = set[i % sets];
                       // In place, as the decoder: the stream read and written back.
                       fused_add_rms_norm(RmsNormParams{.x = b.out->as<float>(),
                                                        .residual = b.residual->as<float>(),
                                                        .residual_out = b.residual->as<float>(),
                                                        .weight = norm_weight.as<bf16>(),
                                                        .out = b.norm_out->as<bf16>(),
                                                        .num_rows = T,
                                                        .hidden_size = H},
                                          stream);
                     }),
         static_cast<double>(3 * T * H * 4 + T * H * 2 + H * 2), copy_bw);
}

struct Projection {
  const char* name;
  int64_t n, k;
  bool f32_out;  // as the decoder asks for it (O and the LM head in float32)
};

#define CUBLAS_OK(call) MOE_CHECK((call) == CUBLAS_STATUS_SUCCESS, #call " failed")

// y[M, N] = x[M, K] . w[N, K]^T by the skinny GEMM and by cuBLAS (the decoder's call), M 1..8.
void bench_projections(double copy_bw, cudaStream_t stream, std::mt19937& rng) {
  cublasHandle_t cublas = nullptr;
  CUBLAS_OK(cublasCreate(&cublas));
  CUBLAS_OK(cublasSetStream(cublas, stream));
  DeviceMemory cublas_workspace(size_t{32} << 20);
  CUBLAS_OK(cublasSetWorkspace(cublas, cublas_workspace.data, cublas_workspace.bytes));
  const Projection projections[] = {{"qkv 2048->5120", 5120, 2048, false},
                                    {"o 4096->2048", 2048, 4096, true},
                                    {"router 2048->128", 128, 2048, true},
                                    {"lm_head 2048->151936", 151936, 2048, true}};
  std::printf("\n%-22s %3s %12s %12s %9s %9s %8s\n", "projection", "M", "skinny us", "cuBLAS us",
              "skinny/fl", "cuBLAS/fl", "speedup");
  for (const Projection& pr : projections) {
    const size_t weight_bytes = static_cast<size_t>(pr.n * pr.k) * 2;
    const int copies =
        static_cast<int>(std::clamp<size_t>(kRotateBytes / weight_bytes, 1, kLaunchesPerGraph));
    DeviceMemory weights(weight_bytes * copies);
    fill_random_bf16(weights.data, weight_bytes / 2 * copies, rng);
    DeviceMemory x(static_cast<size_t>(8 * pr.k) * 2), y(static_cast<size_t>(8 * pr.n) * 4);
    fill_random_bf16(x.data, static_cast<size_t>(8 * pr.k), rng);
    auto weight = [&](int i) {
      return reinterpret_cast<const __nv_bfloat16*>(weights.as<char>() +
                                                    (i % copies) * weight_bytes);
    };
    for (int64_t m = 1; m <= kSkinnyGemmMaxRows; m *= 2) {
      const double skinny_ms = time_launch(stream, [&](int i) {
        skinny_gemm({.x = x.as<__nv_bfloat16>(),
                     .w = weight(i),
                     .y = y.data,
                     .m = m,
                     .n = pr.n,
                     .k = pr.k,
                     .y_f32 = pr.f32_out},
                    stream);
      });
      const double cublas_ms = time_launch(stream, [&](int i) {
        const float one = 1.0f, zero = 0.0f;
        CUBLAS_OK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(pr.n),
                               static_cast<int>(m), static_cast<int>(pr.k), &one, weight(i),
                               CUDA_R_16BF, static_cast<int>(pr.k), x.data, CUDA_R_16BF,
                               static_cast<int>(pr.k), &zero, y.data,
                               pr.f32_out ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(pr.n),
                               CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      });
      const double bytes =
          static_cast<double>(weight_bytes) + m * pr.k * 2.0 + m * pr.n * (pr.f32_out ? 4.0 : 2.0);
      const double floor_ms = bytes / copy_bw * 1e3;
      std::printf("%-22s %3lld %12.2f %12.2f %9.3f %9.3f %8.2f\n", pr.name,
                  static_cast<long long>(m), skinny_ms * 1e3, cublas_ms * 1e3, floor_ms / skinny_ms,
                  floor_ms / cublas_ms, cublas_ms / skinny_ms);
      std::fflush(stdout);
    }
  }
  CUBLAS_OK(cublasDestroy(cublas));
}

// The QKV and O projections as quantised slabs (random codes, scales giving the bf16 weights'
// range): the quantised skinny GEMM and dequantise + cuBLAS, against the bf16 skinny GEMM at one
// row (the decoder's bf16 path at batch 1).
void bench_quant_projections(double copy_bw, cudaStream_t stream, std::mt19937& rng) {
  cublasHandle_t cublas = nullptr;
  CUBLAS_OK(cublasCreate(&cublas));
  CUBLAS_OK(cublasSetStream(cublas, stream));
  DeviceMemory cublas_workspace(size_t{32} << 20);
  CUBLAS_OK(cublasSetWorkspace(cublas, cublas_workspace.data, cublas_workspace.bytes));
  const Projection projections[] = {{"qkv 2048->5120", 5120, 2048, false},
                                    {"o 4096->2048", 2048, 4096, true}};
  std::printf("\n%-22s %-5s %3s %10s %10s %10s %9s %9s %10s\n", "projection", "codes", "M",
              "skinny us", "deq+cuBLAS", "bf16 M=1", "skinny/fl", "deq/fl", "bf16/skinny");
  for (const Projection& pr : projections) {
    // The bf16 skinny GEMM at one row, over rotated copies of bf16 weights.
    const size_t bf16_bytes = static_cast<size_t>(pr.n * pr.k) * 2;
    const int bf16_copies =
        static_cast<int>(std::clamp<size_t>(kRotateBytes / bf16_bytes, 1, kLaunchesPerGraph));
    DeviceMemory bf16_weights(bf16_bytes * bf16_copies);
    fill_random_bf16(bf16_weights.data, bf16_bytes / 2 * bf16_copies, rng);
    DeviceMemory x(static_cast<size_t>(32 * pr.k) * 2), y(static_cast<size_t>(32 * pr.n) * 4);
    fill_random_bf16(x.data, static_cast<size_t>(32 * pr.k), rng);
    const double bf16_ms = time_launch(stream, [&](int i) {
      skinny_gemm({.x = x.as<__nv_bfloat16>(),
                   .w = reinterpret_cast<const __nv_bfloat16*>(bf16_weights.as<char>() +
                                                               (i % bf16_copies) * bf16_bytes),
                   .y = y.data,
                   .m = 1,
                   .n = pr.n,
                   .k = pr.k,
                   .y_f32 = pr.f32_out},
                  stream);
    });
    DeviceMemory scratch(bf16_bytes);
    for (const ExpertQuant format : {ExpertQuant::kFp8, ExpertQuant::kInt4}) {
      const QuantMatrixLayout layout = quant_matrix_layout(format, pr.n, pr.k, 128);
      const size_t slab_bytes = static_cast<size_t>(layout.bytes);
      const int copies =
          static_cast<int>(std::clamp<size_t>(kRotateBytes / slab_bytes, 1, kLaunchesPerGraph));
      DeviceMemory slabs(slab_bytes * copies);
      CUDA_CHECK(cudaMemset(slabs.data, 0, slab_bytes * copies));
      quant_random_fill({.out = slabs.data,
                         .num_slabs = copies,
                         .rows = pr.n,
                         .cols = pr.k,
                         .format = format,
                         .group = 128,
                         .seed = rng(),
                         .scale = 1.0f / std::sqrt(static_cast<float>(pr.k))},
                        stream);
      auto slab = [&](int i) { return slabs.as<uint8_t>() + (i % copies) * slab_bytes; };
      const int64_t max_rows = format == ExpertQuant::kFp8 ? 16 : 32;
      for (int64_t m = 1; m <= max_rows; m *= 2) {
        const double skinny_ms = time_launch(stream, [&](int i) {
          for (int64_t first = 0; first < m; first += kSkinnyGemmMaxRows) {
            quant_skinny_gemm({.x = x.as<__nv_bfloat16>() + first * pr.k,
                               .w = slab(i),
                               .format = format,
                               .group = 128,
                               .y = y.as<char>() + first * pr.n * (pr.f32_out ? 4 : 2),
                               .m = std::min(kSkinnyGemmMaxRows, m - first),
                               .n = pr.n,
                               .k = pr.k,
                               .y_f32 = pr.f32_out},
                              stream);
          }
        });
        const double dequant_ms = time_launch(stream, [&](int i) {
          dequantize_matrix({.w = slab(i),
                             .format = format,
                             .group = 128,
                             .n = pr.n,
                             .k = pr.k,
                             .out = scratch.as<__nv_bfloat16>()},
                            stream);
          const float one = 1.0f, zero = 0.0f;
          CUBLAS_OK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(pr.n),
                                 static_cast<int>(m), static_cast<int>(pr.k), &one, scratch.data,
                                 CUDA_R_16BF, static_cast<int>(pr.k), x.data, CUDA_R_16BF,
                                 static_cast<int>(pr.k), &zero, y.data,
                                 pr.f32_out ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(pr.n),
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        });
        const double launches = static_cast<double>((m + 7) / 8);
        const double io = m * pr.k * 2.0 + m * pr.n * (pr.f32_out ? 4.0 : 2.0);
        const double floor_ms = (static_cast<double>(slab_bytes) + io) / copy_bw * 1e3;
        // dequantise + cuBLAS must read the codes, write and read the bf16 matrix.
        const double deq_floor_ms =
            (static_cast<double>(slab_bytes) + 2.0 * static_cast<double>(bf16_bytes) + io) /
            copy_bw * 1e3;
        std::printf("%-22s %-5s %3lld %10.2f %10.2f %10.2f %9.3f %9.3f %10.2f\n", pr.name,
                    expert_quant_name(format), static_cast<long long>(m), skinny_ms * 1e3,
                    dequant_ms * 1e3, bf16_ms * 1e3, launches * floor_ms / skinny_ms,
                    deq_floor_ms / dequant_ms, bf16_ms / skinny_ms);
        std::fflush(stdout);
      }
    }
  }
  CUBLAS_OK(cublasDestroy(cublas));
}

int run(int argc, char** argv) {
  bool projections_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) g_replays = 7;
    if (std::strcmp(argv[i], "--projections-only") == 0) projections_only = true;
  }
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("bench_cuda_stages on %s (%d SMs, %.0f MB L2)\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1e6);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937 rng(12345);
  const double copy_bw = copy_bandwidth(stream);
  std::printf("device-to-device copy, 1 GiB: %.1f GB/s (read + write; as a graph node: %.1f)\n\n",
              copy_bw / 1e9, graph_copy_bandwidth(stream) / 1e9);
  if (projections_only) {
    bench_projections(copy_bw, stream, rng);
    bench_quant_projections(copy_bw, stream, rng);
    CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
  }
  std::printf("%-10s %-22s %13s %13s %14s %7s\n", "stage", "shape", "time", "floor bytes",
              "achieved", "vs copy");
  const Shape shapes[] = {
      {"qwen3-30b", 1, 128, 8, 2048, false},      {"qwen3-30b", 64, 128, 8, 2048, false},
      {"qwen3-30b", 4096, 128, 8, 2048, false},   {"deepseek-v3", 4096, 256, 8, 7168, true},
      {"e4099-k64", 1, 4099, 64, 2048, false},    {"e4099-k64", 1024, 4099, 64, 1024, false},
      {"e12000-k36", 256, 12000, 36, 1024, false}};
  for (const Shape& s : shapes) bench_shape(s, copy_bw, stream, rng);
  bench_projections(copy_bw, stream, rng);
  bench_quant_projections(copy_bw, stream, rng);
  CUDA_CHECK(cudaStreamDestroy(stream));

  // One-line summary: the prefill Qwen3 shape's times and ratios, and the decode latencies.
  auto find = [&](const char* stage, const char* shape) -> const Row* {
    for (const Row& r : g_rows)
      if (r.stage == stage && r.shape == shape) return &r;
    return nullptr;
  };
  std::string line =
      "bench_cuda_stages: copy " + std::to_string(static_cast<int>(copy_bw / 1e9)) + " GB/s;";
  for (const char* stage : {"route", "plan", "permute", "unpermute", "rms_norm"}) {
    const Row* prefill = find(stage, "qwen3-30b T=4096");
    const Row* decode = find(stage, "qwen3-30b T=1");
    char part[128];
    std::snprintf(part, sizeof(part), " %s %.1fus(%.2fx copy)/T=1 %.1fus;", stage,
                  prefill ? prefill->us : -1.0, prefill ? prefill->ratio : -1.0,
                  decode ? decode->us : -1.0);
    line += part;
  }
  std::printf("\n%s\n", line.c_str());
  return 0;
}

}  // namespace
}  // namespace moeinfer::cuda

int main(int argc, char** argv) {
  try {
    return moeinfer::cuda::run(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "bench_cuda_stages: %s\n", error.what());
    return 1;
  }
}

#else  // !MOE_HAVE_CUDA

#include <cstdio>

int main() {
  std::printf("bench_cuda_stages: built without CUDA; nothing to measure\n");
  return 0;
}

#endif  // MOE_HAVE_CUDA
