// Question: how close does cpu::linear() come to the machine's floors at the Qwen3-30B-A3B
// shapes, at decode (T = 1, a memory-bound GEMV) and prefill (T = 512, compute-bound), and
// which of its paths wins where?
//
// Floors measured in the same run: STREAM-triad and read-only memory bandwidth over buffers far
// larger than the cache, and the peak vdpbf16ps / FMA rate of all cores. Each weight matrix is
// replicated until the copies fill 512 MiB and the calls rotate through them, so every call
// reads its weights from memory, not from the 32 MiB L3.
//
// Columns: time per call, weight bytes read per second, GFLOP/s, the fraction of peak FLOP/s,
// and last the ratio of weight GB/s to the triad bandwidth.
//
// Usage: bench_gemm_cpu [--sweep] [--only SUBSTRING] [--rows 1,4,16]
//   --sweep adds T = 2..64 (the GEMV / oneDNN crossover); --only keeps shapes whose name contains
//   SUBSTRING and the BF16 rows only.
// Threads: MOE_NUM_THREADS (our workers), OMP_NUM_THREADS (oneDNN); both default to all cores.
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/cpu/gemm_internal.h"
#include "backend/cpu/gemm_kernels.h"
#include "backend/cpu/gemm_parallel.h"
#include "backend/cpu/gemm_roofline.h"
#include "core/dtype.h"
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));

namespace {

using namespace moeinfer;
using namespace moeinfer::cpu;

struct LinearShape {
  const char* name;
  int64_t n, k;
};

// Qwen3-30B-A3B: H = 2048, I = 768, 32 x 128 query heads, 4 x 128 KV heads.
constexpr LinearShape kShapes[] = {
    {"expert gate/up", 768, 2048}, {"expert down", 2048, 768},      {"q_proj", 4096, 2048},
    {"o_proj", 2048, 4096},        {"lm_head/8", 151936 / 8, 2048},
};

using Fn = std::function<bool(const float*, int64_t, const TensorView&, float*)>;

// Seconds per call: best of 10 batches, each at least 40 ms (or 3 calls). The machine is shared,
// so the best batch is the one least disturbed by other processes.
double time_call(const std::function<void(int)>& call) {
  int index = 0;  // keeps rotating through the weight copies across batches
  call(index++);
  call(index++);
  double best = 1e30;
  for (int batch = 0; batch < 10; ++batch) {
    int calls = 0;
    const double start = roofline::now_seconds();
    double elapsed = 0;
    do {
      call(index++);
      ++calls;
      elapsed = roofline::now_seconds() - start;
    } while (elapsed < 0.04 || calls < 3);
    best = std::min(best, elapsed / calls);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  bool sweep = false;
  const char* only = nullptr;
  const char* rows_arg = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sweep") == 0) sweep = true;
    if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc) rows_arg = argv[++i];
  }
  const int threads = gemm_num_threads();
  std::printf("# bench_gemm_cpu: %d threads (MOE_NUM_THREADS), oneDNN %s\n", threads,
#if defined(MOE_HAVE_DNNL)
              "on"
#else
              "off"
#endif
  );
  std::printf("# load average at start: %.2f (%d cores)\n", roofline::load_average(),
              static_cast<int>(std::thread::hardware_concurrency()));
  const auto bw = roofline::measure_bandwidth(threads);
  const auto peak = roofline::measure_peak_flops(threads);
  std::printf(
      "# memory: triad %.1f GB/s (read+write counted), read-only %.1f GB/s, buffers %lld MiB\n",
      bw.triad_gbs, bw.read_gbs, static_cast<long long>(bw.buffer_bytes >> 20));
  std::printf("# peak: bf16 vdpbf16ps %.0f GFLOP/s, f32 FMA %.0f GFLOP/s\n", peak.bf16_gflops,
              peak.f32_gflops);
  std::printf("%-15s %-5s %4s %-16s %10s %8s %9s %6s %6s\n", "shape", "dtype", "T", "path",
              "us/call", "GB/s", "GFLOP/s", "%peak", "ratio");

  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<int64_t> row_counts = {1, 512};
  if (sweep) row_counts = {1, 2, 4, 8, 12, 16, 24, 32, 64, 512};
  if (rows_arg != nullptr) {
    row_counts.clear();
    for (const char* p = rows_arg; *p;) {
      char* end = nullptr;
      row_counts.push_back(std::strtoll(p, &end, 10));
      p = *end == ',' ? end + 1 : end;
    }
  }

  for (const LinearShape& s : kShapes) {
    if (only != nullptr && std::strstr(s.name, only) == nullptr) continue;
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      if (only != nullptr && dtype != DType::kBF16) continue;
      const size_t bytes = static_cast<size_t>(s.n * s.k) * dtype_size(dtype);
      const int copies = static_cast<int>(std::max<size_t>(1, (size_t{512} << 20) / bytes));
      std::vector<char> storage(bytes * copies);
      {
        std::vector<float> wf(static_cast<size_t>(s.n * s.k));
        for (float& v : wf) v = dist(rng) * 0.05f;
        for (int c = 0; c < copies; ++c) {
          char* dst = storage.data() + c * bytes;
          if (dtype == DType::kF32) {
            std::memcpy(dst, wf.data(), bytes);
          } else {
            auto* h = reinterpret_cast<uint16_t*>(dst);
            for (size_t i = 0; i < wf.size(); ++i) h[i] = f32_to_bf16(wf[i]);
          }
        }
      }
      auto weight = [&](int call) {
        return TensorView{
            .dtype = dtype, .shape = {s.n, s.k}, .data = storage.data() + (call % copies) * bytes};
      };
      for (int64_t t : row_counts) {
        std::vector<float> x(static_cast<size_t>(t * s.k)), y(static_cast<size_t>(t * s.n));
        for (float& v : x) v = dist(rng);
        struct Candidate {
          std::string name;
          std::function<void(int)> call;
        };
        std::vector<Candidate> candidates;
        const std::string chosen =
            gemm_detail::path_name(gemm_detail::choose_path(dtype, t, s.k, s.n, false));
        candidates.push_back({"linear:" + chosen,
                              [&](int c) { linear(x.data(), t, weight(c), nullptr, y.data()); }});
        if (dtype == DType::kF32) {
          if (openblas_set_num_threads) {
            candidates.push_back(
                {"openblas-own-thr", [&](int c) {
                   // OpenBLAS threading itself, as most programs run it.
                   openblas_set_num_threads(threads);
                   const TensorView w = weight(c);
                   cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t, s.n, s.k, 1.0f, x.data(),
                               s.k, static_cast<const float*>(w.data), s.k, 0.0f, y.data(), s.n);
                   openblas_set_num_threads(1);
                 }});
          }
        } else {
          if (gemm_detail::gemv_avx512_available(dtype) && t <= 128) {
            candidates.push_back({"gemv-avx512", [&](int c) {
                                    gemm_detail::linear_gemv_avx512(x.data(), t, weight(c), nullptr,
                                                                    y.data());
                                  }});
          }
          if (gemm_detail::dnnl_available(dtype)) {
            candidates.push_back({"onednn-workers", [&](int c) {
                                    gemm_detail::linear_dnnl(x.data(), t, weight(c), nullptr,
                                                             y.data());
                                  }});
            candidates.push_back({"onednn-openmp", [&](int c) {
                                    gemm_detail::linear_dnnl_openmp(x.data(), t, weight(c), nullptr,
                                                                    y.data());
                                  }});
          }
          candidates.push_back({"blocked-f32", [&](int c) {
                                  gemm_detail::linear_blocked_f32(x.data(), t, weight(c), nullptr,
                                                                  y.data());
                                }});
          if (t <= 16) {
            candidates.push_back({"gemv-scalar", [&](int c) {
                                    gemm_detail::linear_gemv_scalar(x.data(), t, weight(c), nullptr,
                                                                    y.data());
                                  }});
          }
        }
        for (const Candidate& cand : candidates) {
          const double sec = time_call(cand.call);
          const double gbs = bytes / sec / 1e9;
          const double gflops = 2.0 * t * s.n * s.k / sec / 1e9;
          const double peak_gflops = dtype == DType::kF32 ? peak.f32_gflops : peak.bf16_gflops;
          std::printf("%-15s %-5s %4lld %-16s %10.1f %8.1f %9.1f %5.1f%% %6.2f\n", s.name,
                      std::string(dtype_name(dtype)).c_str(), static_cast<long long>(t),
                      cand.name.c_str(), sec * 1e6, gbs, gflops,
                      peak_gflops > 0 ? 100.0 * gflops / peak_gflops : 0.0, gbs / bw.triad_gbs);
        }
      }
    }
  }
  std::printf("# load average at end: %.2f\n", roofline::load_average());
  return 0;
}
