// Helpers shared by the CUDA kernel tests of the experts, attention and sampling kernels:
// device buffers that poison themselves, fresh random inputs with a replayable seed, bf16
// comparisons, and registration of kernel tests only when a CUDA device is present (the
// pattern cuda_stages_test.cpp explains: without a device the kernel tests do not exist, the
// host-side launcher checks still run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer::cuda::testing_util {

inline uint32_t fresh_seed() {
  static const uint32_t seed = [] {
    if (const char* env = std::getenv("MOE_TEST_SEED"))
      return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
    return std::random_device{}();
  }();
  return seed;
}

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count_ * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (count_ > 0)
      CUDA_CHECK(cudaMemcpy(data_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  __nv_bfloat16* as_bf16() const { return reinterpret_cast<__nv_bfloat16*>(data_); }
  void poison() {
    if (count_ > 0) CUDA_CHECK(cudaMemset(data_, 0xFF, count_ * sizeof(T)));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0)
      CUDA_CHECK(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  size_t count_ = 0;
  T* data_ = nullptr;
};

inline void synchronize() {
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
}

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = f32_to_bf16(dist(rng));
  return out;
}

inline std::vector<float> to_float(const std::vector<uint16_t>& bits) {
  std::vector<float> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = bf16_to_f32(bits[i]);
  return out;
}

// bf16 outputs against a float64 reference: |got - want| <= 1e-2 * (|want| + scale[i]), the
// bf16 contract of CONVENTIONS.md, where scale[i] is the output's natural size (for a dot
// product the root of the sum of its squared terms), so cancellation does not make the
// relative bound meaningless. NaN (a poisoned, unwritten element) fails.
inline void expect_bf16_near(const std::vector<uint16_t>& got, const std::vector<double>& want,
                             const std::vector<double>& scale, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(scale.size(), want.size()) << what;
  int reported = 0;
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_f32(got[i]);
    const double bound = 1e-2 * (std::fabs(want[i]) + scale[i]) + 1e-30;
    if (!(std::fabs(g - want[i]) <= bound)) {
      ++mismatches;
      if (reported++ < 5)
        ADD_FAILURE() << what << "[" << i << "] = " << g << ", want " << want[i] << " (bound "
                      << bound << ")";
    }
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << got.size();
}

template <typename Fn>
void expect_error_naming(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected moeinfer::Error mentioning '" << needle << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(needle), std::string::npos)
        << "message '" << error.what() << "' does not name '" << needle << "'";
  }
}

class KernelTest : public ::testing::Test {
 public:
  explicit KernelTest(std::function<void()> body) : body_(std::move(body)) {}
  void TestBody() override {
    SCOPED_TRACE(::testing::Message()
                 << "seed " << fresh_seed() << " (set MOE_TEST_SEED to replay)");
    body_();
  }

 private:
  std::function<void()> body_;
};

inline void register_kernel_test(const char* suite, const std::string& name,
                                 std::function<void()> body, const char* file, int line) {
  ::testing::RegisterTest(suite, name.c_str(), nullptr, nullptr, file, line,
                          [body]() -> ::testing::Test* { return new KernelTest(body); });
}

inline bool cuda_device_present(const char* what) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "test_cuda: no CUDA device; the %s kernel tests are not registered\n",
                 what);
    cudaGetLastError();
    return false;
  }
  return true;
}

// |got[i] - want[i]| <= bound(i) for every element (NaN fails), reporting the first mismatches.
template <typename Want, typename Bound>
void expect_within(const std::vector<float>& got, const std::vector<Want>& want, Bound bound,
                   const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(got[i] - want[i]) <= bound(i))) {
      ++mismatches;
      if (reported++ < 5)
        ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i] << " (bound "
                      << bound(i) << ")";
    }
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << got.size();
}

}  // namespace moeinfer::cuda::testing_util
