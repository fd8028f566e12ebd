// Whether the host's memory is the limit shared by the two ways a cold expert is served: host
// threads reading expert weights (--cold-experts cpu) and the GPU reading pinned host memory over
// PCIe (a copy into a slot). Measures, over buffers far larger than the host's caches:
//   host read        N threads summing a buffer, N = 1, 2, 4, 8, all cores
//   GPU read         SM kernel reading mapped pinned memory into device memory
//   both             all host threads and the GPU kernel at once, on separate buffers
// If the rates of "both" add up to about the host's alone, splitting misses between the host
// and the link gains little: every expert byte crosses the host's memory either way.
//
// Standalone: nvcc -O3 -std=c++20 -arch=sm_90 bench/host_memory_rates.cu -o host_memory_rates
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

constexpr int64_t kBufferBytes = int64_t{2} << 30;  // each of the two buffers
constexpr int64_t kGpuChunk = int64_t{256} << 20;   // one kernel's read

__global__ void read_mapped(const uint4* src, uint4* dst, int64_t vecs) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < vecs; i += stride) {
    dst[i] = src[i];
  }
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Threads summing disjoint parts of buf until `stop`; returns the bytes read.
int64_t host_read(const uint64_t* buf, int threads, const std::atomic<bool>& stop,
                  double min_seconds) {
  std::atomic<int64_t> bytes{0};
  std::vector<std::thread> pool;
  const int64_t words = kBufferBytes / 8;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const int64_t first = words * t / threads, last = words * (t + 1) / threads;
      uint64_t sum = 0;
      int64_t read = 0;
      const auto start = std::chrono::steady_clock::now();
      do {
        for (int64_t i = first; i < last; i += 4) sum += buf[i] ^ buf[i + 1] ^ buf[i + 2] ^ buf[i + 3];
        read += (last - first) * 8;
      } while (!stop.load(std::memory_order_relaxed) && seconds_since(start) < min_seconds);
      bytes += read + static_cast<int64_t>(sum & 1);  // keeps the sum alive
    });
  }
  for (auto& th : pool) th.join();
  return bytes.load();
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  char* host_buf = nullptr;
  char* mapped = nullptr;
  CHECK(cudaHostAlloc(&host_buf, kBufferBytes, cudaHostAllocPortable));
  CHECK(cudaHostAlloc(&mapped, kBufferBytes, cudaHostAllocMapped | cudaHostAllocPortable));
  for (int64_t i = 0; i < kBufferBytes; i += 8) {
    reinterpret_cast<uint64_t*>(host_buf)[i / 8] = static_cast<uint64_t>(i);
    reinterpret_cast<uint64_t*>(mapped)[i / 8] = static_cast<uint64_t>(i);
  }
  char* mapped_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_dev), mapped, 0));
  char* dst = nullptr;
  CHECK(cudaMalloc(&dst, kGpuChunk));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("device %s; host %d cores; buffers %.1f GB each\n", prop.name, cores,
              kBufferBytes / 1e9);

  const auto* words = reinterpret_cast<const uint64_t*>(host_buf);
  std::atomic<bool> never{false};
  std::vector<int> counts = {1, 2, 4, 8};
  if (cores > 8) counts.push_back(cores);
  for (int n : counts) {
    const auto start = std::chrono::steady_clock::now();
    const int64_t bytes = host_read(words, n, never, 1.0);
    std::printf("host read, %2d threads              %7.1f GB/s\n", n,
                bytes / seconds_since(start) / 1e9);
  }

  // The GPU reading mapped memory, chunk after chunk, until `stop`; returns the bytes read.
  const auto gpu_read = [&](const std::atomic<bool>& stop, double min_seconds) {
    int64_t bytes = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t off = 0; !stop.load() && (bytes == 0 || seconds_since(start) < min_seconds);
         off = (off + kGpuChunk) % kBufferBytes) {
      read_mapped<<<2 * prop.multiProcessorCount, 512, 0, s>>>(
          reinterpret_cast<const uint4*>(mapped_dev + off), reinterpret_cast<uint4*>(dst),
          kGpuChunk / 16);
      CHECK(cudaStreamSynchronize(s));
      bytes += kGpuChunk;
    }
    return bytes;
  };
  {
    const auto start = std::chrono::steady_clock::now();
    const int64_t bytes = gpu_read(never, 1.0);
    std::printf("GPU read of mapped memory           %7.1f GB/s\n",
                bytes / seconds_since(start) / 1e9);
  }
  for (int n : {cores / 2, cores}) {
    std::atomic<bool> stop{false};
    int64_t gpu_bytes = 0;
    const auto start = std::chrono::steady_clock::now();
    std::thread gpu([&] { gpu_bytes = gpu_read(stop, 1.5); });
    const int64_t host_bytes = host_read(words, n, never, 1.5);
    const double host_s = seconds_since(start);
    stop = true;
    gpu.join();
    const double gpu_s = seconds_since(start);
    std::printf("both: host %2d threads %7.1f GB/s + GPU %7.1f GB/s = %7.1f GB/s\n", n,
                host_bytes / host_s / 1e9, gpu_bytes / gpu_s / 1e9,
                host_bytes / host_s / 1e9 + gpu_bytes / gpu_s / 1e9);
  }
  return 0;
}
