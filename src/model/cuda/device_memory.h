// Owning handles of CUDA resources. The decoder and its weights hold device memory, pinned host
// memory, the stream and the cuBLAS handle through these, so a constructor that throws half way
// (a KV pool or a workspace that does not fit) frees what it had already taken.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "backend/cuda/cuda_check.h"

namespace moeinfer::gpu {

struct DeviceFree {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
struct PinnedFree {
  void operator()(void* p) const noexcept { cudaFreeHost(p); }
};
struct StreamDestroy {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};
struct CublasDestroy {
  void operator()(cublasHandle_t h) const noexcept { cublasDestroy(h); }
};

template <typename T>
using DeviceArray = std::unique_ptr<T[], DeviceFree>;
template <typename T>
using PinnedArray = std::unique_ptr<T[], PinnedFree>;
using StreamHandle = std::unique_ptr<std::remove_pointer_t<cudaStream_t>, StreamDestroy>;
using CublasHandle = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, CublasDestroy>;

// `count` elements of device memory (cudaMalloc).
template <typename T>
DeviceArray<T> device_array(size_t count) {
  void* p = nullptr;
  CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
  return DeviceArray<T>(static_cast<T*>(p));
}

// `count` elements of pinned host memory (cudaHostAlloc).
template <typename T>
PinnedArray<T> pinned_array(size_t count) {
  void* p = nullptr;
  CUDA_CHECK(cudaHostAlloc(&p, count * sizeof(T), cudaHostAllocDefault));
  return PinnedArray<T>(static_cast<T*>(p));
}

// `count` elements of pinned host memory that kernels read in place (mapped into the device's
// address space; with unified addressing the host pointer is the device pointer).
template <typename T>
PinnedArray<T> mapped_pinned_array(size_t count) {
  void* p = nullptr;
  CUDA_CHECK(cudaHostAlloc(&p, count * sizeof(T), cudaHostAllocMapped | cudaHostAllocPortable));
  return PinnedArray<T>(static_cast<T*>(p));
}

// Carves one allocation into 256-byte aligned typed arrays; run once with a null base to size,
// once over the allocation to assign.
class Carver {
 public:
  explicit Carver(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    const size_t bytes =
        (static_cast<size_t>(count > 1 ? count : 1) * sizeof(T) + 255) / 256 * 256;
    T* out = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += bytes;
    return out;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace moeinfer::gpu
