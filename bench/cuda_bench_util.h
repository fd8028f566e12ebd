// Helpers shared by the CUDA benchmarks: device buffers, random bf16 fills, and the two timing
// methods they all use (a CUDA graph of many launches, median of replays; the device-to-device
// copy bandwidth that is the bytes floor).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/dtype.h"

namespace moeinfer::cuda::bench_util {

template <typename T>
T* device_alloc(size_t count) {
  T* p = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(count, 1) * sizeof(T)));
  return p;
}

// Fills with random bf16 (normal, std `scale`) by tiling a 16M-element random host block.
inline void fill_random(__nv_bfloat16* dst, size_t count, float scale, std::mt19937& rng) {
  const size_t block = std::min<size_t>(count, size_t{1} << 24);
  std::vector<uint16_t> host(block);
  std::normal_distribution<float> dist(0.0f, scale);
  for (auto& v : host) v = f32_to_bf16(dist(rng));
  for (size_t off = 0; off < count; off += block) {
    const size_t n = std::min(block, count - off);
    CUDA_CHECK(cudaMemcpy(dst + off, host.data(), n * 2, cudaMemcpyHostToDevice));
  }
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of one call of `body` (called with the call index within the graph):
// `launches` calls captured in one graph, `warmups` replays, then `replays` timed ones.
inline double time_graph(cudaStream_t stream, int launches, int replays, int warmups,
                         const std::function<void(int)>& body) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < launches; ++i) body(i);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  for (int r = 0; r < warmups; ++r) CUDA_CHECK(cudaGraphLaunch(exec, stream));
  std::vector<double> times;
  for (int r = 0; r < replays; ++r) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / launches);
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  return median(times);
}


}  // namespace moeinfer::cuda::bench_util
