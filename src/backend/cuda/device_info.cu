#include "backend/cuda/device_info.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <utility>

#include "backend/cuda/cuda_check.h"

namespace moeinfer::cuda {
namespace {

// `attribute` of the current device, cached per (device, attribute).
int cached_attribute(cudaDeviceAttr attribute) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> known;
  const std::lock_guard lock(mutex);
  const std::pair<int, int> key{device, static_cast<int>(attribute)};
  if (const auto it = known.find(key); it != known.end()) return it->second;
  int value = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return known[key] = value;
}

}  // namespace

int current_compute_capability() {
  return cached_attribute(cudaDevAttrComputeCapabilityMajor) * 10 +
         cached_attribute(cudaDevAttrComputeCapabilityMinor);
}

int current_multiprocessor_count() { return cached_attribute(cudaDevAttrMultiProcessorCount); }

}  // namespace moeinfer::cuda
