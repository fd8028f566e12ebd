#include <atomic>

#include "backend/cuda/programmatic_launch.h"

namespace moeinfer::cuda {
namespace {

// -1: not decided yet (the device is queried at the first launch), 0: off, 1: on.
std::atomic<int> programmatic_launch_state{-1};

bool device_supports_programmatic_launch() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return false;
  }
  return major >= 9;
}

// Asked once per process: every GPU of one host is the same architecture here.
bool supported() {
  static const bool yes = device_supports_programmatic_launch();
  return yes;
}

}  // namespace

void set_programmatic_launch(bool on) {
  programmatic_launch_state.store(on && supported() ? 1 : 0, std::memory_order_relaxed);
}

namespace {
std::atomic<int64_t> weight_prefetch_bytes_state{0};
}  // namespace

void set_weight_prefetch_bytes(int64_t bytes) {
  weight_prefetch_bytes_state.store(bytes > 0 ? bytes : 0, std::memory_order_relaxed);
}

int64_t weight_prefetch_bytes() {
  return weight_prefetch_bytes_state.load(std::memory_order_relaxed);
}

bool programmatic_launch() {
  const int state = programmatic_launch_state.load(std::memory_order_relaxed);
  return state < 0 ? supported() : state == 1;
}

bool follows_kernels_only(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* dependencies = nullptr;
  size_t count = 0;
  CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &dependencies, nullptr,
                                      &count));
  if (status != cudaStreamCaptureStatusActive) return true;
  for (size_t i = 0; i < count; ++i) {
    cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
    CUDA_CHECK(cudaGraphNodeGetType(dependencies[i], &type));
    if (type != cudaGraphNodeTypeKernel) return false;
  }
  return count > 0;
}

}  // namespace moeinfer::cuda
