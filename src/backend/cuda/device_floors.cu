#include "backend/cuda/device_floors.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"

namespace moeinfer::cuda {
namespace {

constexpr int kRepeats = 5;

// Best seconds per call of `work` over kRepeats timed calls, after one warm-up.
template <typename Work>
double best_seconds(cudaStream_t stream, Work&& work) {
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  work();
  float best_ms = 1e30f;
  for (int i = 0; i < kRepeats; ++i) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    work();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    best_ms = std::min(best_ms, ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best_ms * 1e-3;
}

}  // namespace

double measure_copy_bandwidth(int64_t bytes) {
  void* src = nullptr;
  void* dst = nullptr;
  CUDA_CHECK(cudaMalloc(&src, static_cast<size_t>(bytes)));
  CUDA_CHECK(cudaMalloc(&dst, static_cast<size_t>(bytes)));
  CUDA_CHECK(cudaMemset(src, 1, static_cast<size_t>(bytes)));
  const double seconds = best_seconds(nullptr, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                               nullptr));
  });
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / seconds;
}

double measure_host_to_device_bandwidth(int64_t bytes) {
  void* src = nullptr;
  void* dst = nullptr;
  CUDA_CHECK(cudaHostAlloc(&src, static_cast<size_t>(bytes), cudaHostAllocDefault));
  CUDA_CHECK(cudaMalloc(&dst, static_cast<size_t>(bytes)));
  const double seconds = best_seconds(nullptr, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyHostToDevice,
                               nullptr));
  });
  cudaFreeHost(src);
  cudaFree(dst);
  return static_cast<double>(bytes) / seconds;
}

double measure_gemm_flops(int64_t n) {
  const size_t elems = static_cast<size_t>(n * n);
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_CHECK(cudaMalloc(&a, elems * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMalloc(&b, elems * sizeof(__nv_bfloat16)));
  CUDA_CHECK(cudaMalloc(&c, elems * sizeof(__nv_bfloat16)));
  // Random operands: constant ones would draw less power and flatter the peak.
  random_fill({.out = a, .count = n * n, .seed = 1, .scale = 1.0f}, nullptr);
  random_fill({.out = b, .count = n * n, .seed = 2, .scale = 1.0f}, nullptr);
  cublasHandle_t handle = nullptr;
  CUBLAS_CHECK(cublasCreate(&handle));
  const float one = 1.0f, zero = 0.0f;
  const int dim = static_cast<int>(n);
  const double seconds = best_seconds(nullptr, [&] {
    CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, dim, dim, dim, &one, a,
                              CUDA_R_16BF, dim, b, CUDA_R_16BF, dim, &zero, c, CUDA_R_16BF, dim,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / seconds;
}

}  // namespace moeinfer::cuda
