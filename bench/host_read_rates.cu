// How fast experts move from pinned host memory to the GPU, by each way the expert cache could
// move them: the copy engine (cudaMemcpyAsync), the SMs reading mapped host memory (the grid-stride
// kernel's shape at several grid sizes, and warp-contiguous chunks), the bulk copy unit (TMA)
// reading it, and the copy engine driven by a host thread that polls a request the GPU posts
// (what a graph-captured step needs, since its copy list is known only on the device).
//
// Standalone: nvcc -O3 -std=c++20 -arch=sm_90 bench/host_read_rates.cu -o host_read_rates
// Prints one line per way: GB/s over n experts of qwen3-30b-a3b's shape (gate_up 2x768x2048,
// down 2048x768, bf16).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
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

constexpr int64_t kGateUpBytes = int64_t{2} * 768 * 2048 * 2;
constexpr int64_t kDownBytes = int64_t{2048} * 768 * 2;
constexpr int64_t kExpertBytes = kGateUpBytes + kDownBytes;
constexpr int kExperts = 128;  // the home holds this many; copies pick spread-out ones

struct Lists {
  const char* src[16];
  char* dst[16];
  int count;
};

template <int kUnroll>
__global__ void grid_stride_copy(Lists l) {
  const int64_t vecs = kExpertBytes / 16;
  const int64_t total = l.count * vecs;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x * kUnroll;
  for (int64_t first = int64_t{blockIdx.x} * blockDim.x * kUnroll + threadIdx.x; first < total;
       first += stride) {
    uint4 v[kUnroll];
    uint4* d[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t item = first + int64_t{u} * blockDim.x;
      d[u] = nullptr;
      if (item >= total) continue;
      const int64_t c = item / vecs, x = item % vecs;
      v[u] = reinterpret_cast<const uint4*>(l.src[c])[x];
      d[u] = reinterpret_cast<uint4*>(l.dst[c]) + x;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (d[u] != nullptr) *d[u] = v[u];
  }
}

// Each block copies whole 16 KB chunks with the bulk copy unit, two buffers deep.
constexpr int kChunk = 16384;
__global__ void bulk_copy(Lists l) {
  __shared__ alignas(128) char buf[2][kChunk];
  __shared__ alignas(8) uint64_t bar[2];
  const int64_t chunks_per_expert = kExpertBytes / kChunk;
  const int64_t total = l.count * chunks_per_expert;
  if (threadIdx.x != 0) return;
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[0]));
  const uint32_t bar1 = static_cast<uint32_t>(__cvta_generic_to_shared(&bar[1]));
  asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(bar0));
  asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(bar1));
  asm volatile("fence.mbarrier_init.release.cluster;");
  uint32_t phase[2] = {0, 0};
  int it = 0;
  for (int64_t i = blockIdx.x; i < total; i += gridDim.x, ++it) {
    const int b = it & 1;
    const uint32_t bar_b = b ? bar1 : bar0;
    const uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(buf[b]));
    const int64_t c = i / chunks_per_expert, off = (i % chunks_per_expert) * kChunk;
    // The store that last read this buffer (two iterations ago) must be done reading it.
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar_b), "r"(kChunk));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem),
        "l"(l.src[c] + off), "r"(kChunk), "r"(bar_b)
        : "memory");
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(bar_b), "r"(phase[b])
          : "memory");
    }
    phase[b] ^= 1;
    asm volatile(
        "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(l.dst[c] + off),
        "r"(smem), "r"(kChunk)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void post_request(int64_t* request, int64_t seq) {
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(request) = seq;
}
__global__ void wait_done(const int64_t* done, int64_t seq) {
  while (*reinterpret_cast<const volatile int64_t*>(done) < seq) __nanosleep(200);
}

double time_ms(cudaStream_t s, auto&& body, int reps = 5) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  body();
  CHECK(cudaStreamSynchronize(s));
  float best = 1e30f;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(a, s));
    body();
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, ms);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return best;
}

}  // namespace

int main() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a killed run keeps what it printed
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  char* home = nullptr;
  CHECK(cudaHostAlloc(&home, kExperts * kExpertBytes, cudaHostAllocMapped | cudaHostAllocPortable));
  for (int64_t i = 0; i < kExperts * kExpertBytes; i += 4096) home[i] = static_cast<char>(i >> 12);
  char* home_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&home_dev), home, 0));
  char* slots = nullptr;
  CHECK(cudaMalloc(&slots, 16 * kExpertBytes));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("device %s, %d SMs; expert %.2f MB\n", prop.name, sms, kExpertBytes / 1e6);

  auto lists = [&](int n) {
    Lists l{};
    l.count = n;
    for (int i = 0; i < n; ++i) {
      l.src[i] = home_dev + int64_t{(i * 37) % kExperts} * kExpertBytes;
      l.dst[i] = slots + int64_t{i} * kExpertBytes;
    }
    return l;
  };
  auto report = [&](int n, const char* way, double ms) {
    std::printf("n=%d %-34s %8.1f us  %6.1f GB/s\n", n, way, ms * 1e3,
                double(n) * kExpertBytes / ms / 1e6);
  };
  for (int n : {1, 2, 4, 8}) {
    const Lists l = lists(n);
    report(n, "copy engine (2 memcpy/expert)", time_ms(s, [&] {
             for (int i = 0; i < n; ++i) {
               const char* h = home + (l.src[i] - home_dev);
               CHECK(cudaMemcpyAsync(l.dst[i], h, kGateUpBytes, cudaMemcpyHostToDevice, s));
               CHECK(cudaMemcpyAsync(l.dst[i] + kGateUpBytes, h + kGateUpBytes, kDownBytes,
                                     cudaMemcpyHostToDevice, s));
             }
           }));
    for (int per_sm : {1, 2, 4}) {
      for (int threads : {256, 512}) {
        char name[64];
        std::snprintf(name, sizeof name, "sm grid %dx%d/SM unroll4", per_sm, threads);
        report(n, name,
               time_ms(s, [&] { grid_stride_copy<4><<<per_sm * sms, threads, 0, s>>>(l); }));
      }
    }
    report(n, "sm grid 2x256/SM unroll8",
           time_ms(s, [&] { grid_stride_copy<8><<<2 * sms, 256, 0, s>>>(l); }));
    report(n, "sm grid 16 blocks unroll4",
           time_ms(s, [&] { grid_stride_copy<4><<<16, 256, 0, s>>>(l); }));
    report(n, "sm grid 16 blocks unroll8 x1024",
           time_ms(s, [&] { grid_stride_copy<8><<<16, 1024, 0, s>>>(l); }));
  }

  // The copy engine behind a polling host thread: 48 "layers", each posts a request from the
  // stream, the host thread copies n experts and signals, the stream waits.
  int64_t* request = nullptr;  // mapped
  CHECK(cudaHostAlloc(&request, 64, cudaHostAllocMapped));
  *reinterpret_cast<volatile int64_t*>(request) = 0;
  int64_t* request_dev = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&request_dev), request, 0));
  int64_t* done = nullptr;
  CHECK(cudaMalloc(&done, 8));
  CHECK(cudaMemset(done, 0, 8));
  cudaStream_t copy_stream;
  CHECK(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  std::atomic<bool> stop{false};
  std::atomic<int> proxy_n{1};
  int64_t* done_source = nullptr;  // pinned: the value the 8-byte copy publishes
  CHECK(cudaHostAlloc(&done_source, 2 * sizeof(int64_t), cudaHostAllocDefault));
  std::thread proxy([&] {
    CHECK(cudaSetDevice(0));
    int64_t seen = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      const int64_t r = *reinterpret_cast<volatile int64_t*>(request);
      if (r == seen) continue;
      seen = r;
      const int n = proxy_n.load();
      for (int i = 0; i < n; ++i) {
        const char* h = home + int64_t{(int(r) * 7 + i * 37) % kExperts} * kExpertBytes;
        CHECK(cudaMemcpyAsync(slots + int64_t{i} * kExpertBytes, h, kExpertBytes,
                              cudaMemcpyHostToDevice, copy_stream));
      }
      // A copy, not a kernel: launching a lazily loaded kernel while wait_done spins can hang.
      done_source[r % 2] = r;
      CHECK(cudaMemcpyAsync(done, &done_source[r % 2], sizeof(int64_t), cudaMemcpyHostToDevice,
                            copy_stream));
    }
  });
  int64_t seq = 0;
  for (int n : {0, 1, 2, 4}) {
    proxy_n = n;
    const double ms = time_ms(s, [&] {
      for (int layer = 0; layer < 48; ++layer) {
        ++seq;
        post_request<<<1, 1, 0, s>>>(request_dev, seq);
        wait_done<<<1, 1, 0, s>>>(done, seq);
      }
    });
    std::printf("proxy n=%d x48 layers: %8.1f us total, %6.1f us/layer, %6.1f GB/s\n", n, ms * 1e3,
                ms * 1e3 / 48, n > 0 ? 48.0 * n * kExpertBytes / ms / 1e6 : 0.0);
  }
  // The same through a captured graph (what the decoder replays).
  {
    proxy_n = 2;
    cudaGraph_t g;
    cudaGraphExec_t ge;
    // Sequence numbers must advance on replay: a device counter would; here one capture per
    // replay is timed instead, so the figure includes no instantiate.
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int layer = 0; layer < 48; ++layer) {
      ++seq;
      post_request<<<1, 1, 0, s>>>(request_dev, seq);
      wait_done<<<1, 1, 0, s>>>(done, seq);
    }
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaEventRecord(a, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    std::printf("proxy n=2 x48 layers, graph: %8.1f us total, %6.1f us/layer, %6.1f GB/s\n",
                ms * 1e3, ms * 1e3 / 48, 48.0 * 2 * kExpertBytes / ms / 1e6);
  }
  stop = true;
  proxy.join();
  CHECK(cudaDeviceSynchronize());
  // Last, since a bulk copy from host memory may fault where the unit cannot reach it.
  for (int n : {2, 8}) {
    const Lists l = lists(n);
    for (int per_sm : {1, 2}) {
      char name[64];
      std::snprintf(name, sizeof name, "bulk copy %d/SM 16KB", per_sm);
      report(n, name, time_ms(s, [&] { bulk_copy<<<per_sm * sms, 32, 0, s>>>(l); }));
    }
    report(n, "bulk copy 16 blocks 16KB", time_ms(s, [&] { bulk_copy<<<16, 32, 0, s>>>(l); }));
  }
  return 0;
}
