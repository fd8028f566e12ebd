// Floors for the CPU benchmarks, measured in the same run as the thing they judge: the memory
// bandwidth (a multi-threaded STREAM triad and a read-only sweep over buffers far larger than
// the last-level cache) and the peak multiply-add rate of the cores (bf16 vdpbf16ps and f32
// FMA chains that never touch memory). Header-only; the engine does not use it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "backend/cpu/gemm_kernels.h"
#include "backend/cpu/gemm_parallel.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

namespace moeinfer::cpu::roofline {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs fn(thread_index) on num_threads threads at once (the caller is thread 0); returns the
// wall time from a common start to the last finish.
inline double run_on_threads(int num_threads, const std::function<void(int)>& fn) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 1; i < num_threads; ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      fn(i);
    });
  }
  while (ready.load() != num_threads - 1) {
  }
  const double start = now_seconds();
  go.store(true, std::memory_order_release);
  fn(0);
  for (auto& t : threads) t.join();
  return now_seconds() - start;
}

// The 1-minute load average (-1 where unknown): other processes on the machine skew every figure.
inline double load_average() {
  double load[1] = {-1.0};
  return getloadavg(load, 1) == 1 ? load[0] : -1.0;
}

struct Bandwidth {
  double triad_gbs = 0;  // a[i] = b[i] + s * c[i]: 2 reads + 1 write counted, 12 bytes/element
  double read_gbs = 0;   // sum of a[i]: 4 bytes/element
  int64_t buffer_bytes = 0;
};

// Best of `reps` passes with every thread sweeping its own slice of buffers of buffer_bytes each.
inline Bandwidth measure_bandwidth(int num_threads, int64_t buffer_bytes = int64_t{256} << 20,
                                   int reps = 10) {
  const int64_t n = buffer_bytes / 4;
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  // First touch by the threads that use each slice.
  run_on_threads(num_threads, [&](int t) {
    const int64_t lo = n * t / num_threads, hi = n * (t + 1) / num_threads;
    for (int64_t i = lo; i < hi; ++i) {
      a[i] = 0.0f;
      b[i] = 1.0f;
      c[i] = 2.0f;
    }
  });
  Bandwidth out{.buffer_bytes = buffer_bytes};
  std::vector<double> sums(num_threads);
  for (int rep = 0; rep < reps; ++rep) {
    const double triad = run_on_threads(num_threads, [&](int t) {
      const int64_t lo = n * t / num_threads, hi = n * (t + 1) / num_threads;
      float* __restrict pa = a.get();
      const float* __restrict pb = b.get();
      const float* __restrict pc = c.get();
      for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i] + 0.5f * pc[i];
    });
    out.triad_gbs = std::max(out.triad_gbs, 3.0 * n * 4 / triad / 1e9);
    const double read = run_on_threads(num_threads, [&](int t) {
      const int64_t lo = n * t / num_threads, hi = n * (t + 1) / num_threads;
      float acc[16] = {};
      for (int64_t i = lo; i + 16 <= hi; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j];
      float s = 0;
      for (float v : acc) s += v;
      sums[t] = s;
    });
    out.read_gbs = std::max(out.read_gbs, 1.0 * n * 4 / read / 1e9);
  }
  volatile double sink = sums[0];
  (void)sink;
  return out;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx512f,avx512bf16"))) inline float bf16_chain(int64_t iters) {
  __m512 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(0.0f);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3a83);  // ~0.001
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  float s = 0;
  for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(acc[j]);
  return s;
}
__attribute__((target("avx512f,fma"))) inline float f32_chain(int64_t iters) {
  __m512 acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = _mm512_set1_ps(0.0f);
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-3f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 12; ++j) acc[j] = _mm512_fmadd_ps(a, b, acc[j]);
  float s = 0;
  for (int j = 0; j < 12; ++j) s += _mm512_reduce_add_ps(acc[j]);
  return s;
}
#endif

struct PeakFlops {
  double bf16_gflops = 0;  // vdpbf16ps, 64 flops per instruction; 0 when the CPU lacks it
  double f32_gflops = 0;   // vfmadd 512-bit, 32 flops per instruction; 0 without AVX-512
};

inline PeakFlops measure_peak_flops(int num_threads) {
  PeakFlops out;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const int64_t iters = 1'000'000;
  std::vector<float> sink(num_threads);
  for (int rep = 0; rep < 10; ++rep) {
    if (gemm_detail::cpu_has_avx512_bf16()) {
      const double t = run_on_threads(num_threads, [&](int i) { sink[i] = bf16_chain(iters); });
      out.bf16_gflops = std::max(out.bf16_gflops, num_threads * iters * 12.0 * 64 / t / 1e9);
    }
    if (gemm_detail::cpu_has_avx512()) {
      const double t = run_on_threads(num_threads, [&](int i) { sink[i] = f32_chain(iters); });
      out.f32_gflops = std::max(out.f32_gflops, num_threads * iters * 12.0 * 32 / t / 1e9);
    }
  }
  volatile float keep = sink[0];
  (void)keep;
#endif
  (void)num_threads;
  return out;
}

}  // namespace moeinfer::cpu::roofline
