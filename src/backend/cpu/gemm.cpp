// cpu::linear(): y[T, N] = x[T, K] . W[N, K]^T (+ bias) with checkpoint weights used in place.
//
// Why it is built this way:
// - One threading layer. Every path splits the columns of y (rows of W) over our own workers
//   (gemm_parallel.h) and runs its library single-threaded inside them: OpenBLAS is pinned to one
//   thread and oneDNN is called with an OpenMP thread count of one. oneDNN's own OpenMP team
//   took 18 to 26 ms for a 70 us product when the machine was shared (bench/RESULTS.md): its
//   barriers spin, then sleep, and every wake-up waits for a time slice. One pool that sleeps
//   when idle and yields while joining degrades only in proportion to the load.
// - F32 weights: OpenBLAS sgemm (sgemv at one row) per slice; 2x OpenBLAS's own threading at
//   T = 1.
// - BF16 weights at up to 32 rows (decode, an expert's share of a batch): a hand-written AVX-512
//   kernel (vdpbf16ps) that streams W once and reaches the memory bandwidth at one row; it beats
//   oneDNN up to about 32 rows (gemv_max_rows).
// - BF16 weights at more rows (prefill, busy experts): oneDNN matmul, bf16 x bf16 -> f32, with W
//   described in place by strides (no reorder, no copy). Up to 256 rows one primitive per exact
//   row count (oneDNN then uses its brgemm kernels, 1.1-1.2x faster; creation costs ~0.1 ms),
//   writing a dense slice that we copy into y; above, one primitive per (K, N slice, dtype, bias)
//   with the row count and y's row stride as runtime values. x is rounded to bf16 once, in a
//   thread-local buffer, and shared by the slices.
// - F16 weights: oneDNN when it has an f16 primitive on this CPU (it needs AVX512-FP16), the
//   F16C GEMV at a few rows, and the blocked float32 fallback otherwise.
// - The fallback for every 16-bit case (no oneDNN at build time, no primitive at run time, or
//   MOE_GEMM_FALLBACK=1) widens W to float32 a cache-sized block of rows at a time into a
//   thread-local scratch and runs sgemm per block, blocks split over the workers; with few rows
//   it uses a portable GEMV instead.
// - linear_grouped() runs many products (an MoE layer's experts) as one queue of (product, slice
//   of N) items, so small products need no barrier each.
#include "backend/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backend/cpu/gemm_internal.h"
#include "backend/cpu/gemm_kernels.h"
#include "backend/cpu/gemm_parallel.h"
#include "core/dtype.h"
#include "core/error.h"

#if defined(MOE_HAVE_DNNL)
#include <dlfcn.h>

#include <oneapi/dnnl/dnnl.hpp>
#endif

// Present only when the BLAS is OpenBLAS; weak so that any other CBLAS links too.
extern "C" void openblas_set_num_threads(int num_threads) __attribute__((weak));

namespace moeinfer::cpu {
namespace gemm_detail {
namespace {

// Scratch for the blocked fallback: rows of W widened to float32, about this many bytes.
constexpr int64_t kBlockBytes = 256 * 1024;
// Rows of W each worker takes at a time in the sgemm and GEMV paths.
constexpr int64_t kRowGrain = 16;
// Columns of y per oneDNN call at least (a multiple of its 64-wide blocking).
constexpr int64_t kDnnlGrain = 64;

void init_libraries() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (openblas_set_num_threads) openblas_set_num_threads(1);
  });
}

struct Dims {
  int64_t m, k, n;
};

Dims check_args(const float* x, int64_t num_rows, const TensorView& weight, float* y) {
  MOE_CHECK(weight.shape.rank() == 2, "linear: weight must be 2-D [N, K], got shape ",
            weight.shape.str());
  MOE_CHECK(
      weight.dtype == DType::kF32 || weight.dtype == DType::kBF16 || weight.dtype == DType::kF16,
      "linear: weight dtype ", dtype_name(weight.dtype), " not supported (F32, BF16, F16)");
  const Dims d{num_rows, weight.shape[1], weight.shape[0]};
  MOE_CHECK(d.n > 0 && d.k > 0, "linear: weight shape ", weight.shape.str(), " has an empty dim");
  MOE_CHECK(num_rows >= 0, "linear: num_rows ", num_rows, " is negative");
  MOE_CHECK(weight.data != nullptr, "linear: weight ", weight.shape.str(), " has no data");
  MOE_CHECK(num_rows == 0 || (x != nullptr && y != nullptr), "linear: x (", x == nullptr,
            " null) or y (", y == nullptr, " null) missing for ", num_rows, " rows");
  constexpr int64_t kIntMax = 0x7fffffff;  // BLAS takes int dimensions
  MOE_CHECK(d.m <= kIntMax && d.k <= kIntMax && d.n <= kIntMax, "linear: dims T=", d.m, " K=", d.k,
            " N=", d.n, " exceed the BLAS int range");
  if (num_rows > 0) {
    const auto x_begin = reinterpret_cast<uintptr_t>(x);
    const auto y_begin = reinterpret_cast<uintptr_t>(y);
    const uintptr_t x_end = x_begin + static_cast<uintptr_t>(d.m * d.k) * sizeof(float);
    const uintptr_t y_end = y_begin + static_cast<uintptr_t>(d.m * d.n) * sizeof(float);
    MOE_CHECK(x_end <= y_begin || y_end <= x_begin, "linear: y [", d.m, ", ", d.n, "] overlaps x [",
              d.m, ", ", d.k, "]; the product cannot be computed in place");
  }
  return d;
}

void add_bias(const float* bias, int64_t num_rows, int64_t n_begin, int64_t n_end, float* y,
              int64_t ldy) {
  if (bias == nullptr) return;
  for (int64_t m = 0; m < num_rows; ++m) {
    float* row = y + m * ldy;
    for (int64_t n = n_begin; n < n_end; ++n) row[n] += bias[n];
  }
}

std::atomic<int> g_force_fallback{-1};  // -1: not read from the environment yet
std::atomic<bool> g_batch_invariant{false};

// A thread-local buffer that only grows.
template <typename T>
T* thread_scratch(std::vector<T>& buffer, size_t count) {
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

}  // namespace

const char* path_name(Path path) {
  switch (path) {
    case Path::kSgemm:
      return "sgemm";
    case Path::kDnnl:
      return "onednn";
    case Path::kGemv:
      return "gemv-avx512";
    case Path::kGemvScalar:
      return "gemv-scalar";
    case Path::kBlockedF32:
      return "blocked-f32";
  }
  return "?";
}

bool force_fallback() {
  int value = g_force_fallback.load(std::memory_order_relaxed);
  if (value < 0) {
    const char* env = std::getenv("MOE_GEMM_FALLBACK");
    value = (env != nullptr && std::strcmp(env, "1") == 0) ? 1 : 0;
    int expected = -1;
    g_force_fallback.compare_exchange_strong(expected, value);
    value = g_force_fallback.load(std::memory_order_relaxed);
  }
  return value == 1;
}

void set_force_fallback(bool on) { g_force_fallback.store(on ? 1 : 0); }

int64_t gemv_max_rows(DType dtype) {
  // Measured on the 2-core Zen 5 (bench_gemm_cpu --rows ..., bench/RESULTS.md): the GEMV kernel
  // reads W once and beats oneDNN (exact-M brgemm) by 1.1-1.5x at up to 16 rows; the two tie at
  // 24 to 32 rows and oneDNN wins by 1.1-1.5x from 48 rows on.
  switch (dtype) {
    case DType::kBF16:
      return 32;
    case DType::kF16:
      return 32;
    default:
      return 0;
  }
}

Path choose_path(DType dtype, int64_t num_rows, int64_t in_features, int64_t out_features,
                 bool has_bias) {
  (void)in_features;
  (void)out_features;
  (void)has_bias;
  if (g_batch_invariant.load(std::memory_order_relaxed)) {
    return dtype != DType::kF32 && !force_fallback() && gemv_avx512_available(dtype)
               ? Path::kGemv
               : Path::kGemvScalar;
  }
  if (dtype == DType::kF32) return Path::kSgemm;
  const bool few_rows = num_rows <= gemv_max_rows(dtype);
  if (force_fallback()) return few_rows ? Path::kGemvScalar : Path::kBlockedF32;
  if (few_rows && gemv_avx512_available(dtype)) return Path::kGemv;
  if (dnnl_available(dtype)) return Path::kDnnl;
  return few_rows ? Path::kGemvScalar : Path::kBlockedF32;
}

// ---------------------------------------------------------------------------------------------
// F32: OpenBLAS, one slice of N per worker.

namespace {

// Columns [n0, n1) of y, F32 weights, on the calling thread.
void sgemm_range(const float* x, const Dims& d, const TensorView& weight, const float* bias,
                 float* y, int64_t n0, int64_t n1) {
  const auto* w = static_cast<const float*>(weight.data);
  if (d.m == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(n1 - n0), static_cast<int>(d.k), 1.0f,
                w + n0 * d.k, static_cast<int>(d.k), x, 1, 0.0f, y + n0, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(d.m),
                static_cast<int>(n1 - n0), static_cast<int>(d.k), 1.0f, x, static_cast<int>(d.k),
                w + n0 * d.k, static_cast<int>(d.k), 0.0f, y + n0, static_cast<int>(d.n));
  }
  add_bias(bias, d.m, n0, n1, y, d.n);
}

}  // namespace

void linear_sgemm(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
                  float* y) {
  const Dims d = check_args(x, num_rows, weight, y);
  MOE_CHECK(weight.dtype == DType::kF32, "linear_sgemm: weight dtype ", dtype_name(weight.dtype));
  if (d.m == 0) return;
  init_libraries();
  // Split N only when each slice still has enough work to pay for the hand-off.
  const int64_t grain = std::max<int64_t>(kRowGrain, (int64_t{1} << 16) / (d.m * d.k + 1));
  gemm_parallel_for(d.n, grain,
                    [&](int64_t n0, int64_t n1) { sgemm_range(x, d, weight, bias, y, n0, n1); });
}

// ---------------------------------------------------------------------------------------------
// Fallback for 16-bit weights: widen a block of rows of W, sgemm it.

namespace {

// Columns [n_begin, n_end) of y by the blocked fallback, on the calling thread.
void blocked_range(const float* x, const Dims& d, const TensorView& weight, const float* bias,
                   float* y, int64_t n_begin, int64_t n_end) {
  const size_t elem = dtype_size(weight.dtype);
  const auto* w = static_cast<const char*>(weight.data);
  const int64_t block_rows = std::max<int64_t>(1, kBlockBytes / (d.k * 4));
  thread_local std::vector<float> scratch;
  float* wf = thread_scratch(scratch, static_cast<size_t>(block_rows * d.k));
  for (int64_t n0 = n_begin; n0 < n_end; n0 += block_rows) {
    const int64_t rows = std::min(block_rows, n_end - n0);
    widen_to_f32(weight.dtype, w + n0 * d.k * elem, wf, rows * d.k);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(d.m),
                static_cast<int>(rows), static_cast<int>(d.k), 1.0f, x, static_cast<int>(d.k), wf,
                static_cast<int>(d.k), 0.0f, y + n0, static_cast<int>(d.n));
  }
  add_bias(bias, d.m, n_begin, n_end, y, d.n);
}

}  // namespace

void linear_blocked_f32(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y) {
  const Dims d = check_args(x, num_rows, weight, y);
  if (d.m == 0) return;
  if (weight.dtype == DType::kF32) return linear_sgemm(x, num_rows, weight, bias, y);
  init_libraries();
  const int64_t block_rows = std::max<int64_t>(1, kBlockBytes / (d.k * 4));
  gemm_parallel_for(d.n, block_rows, [&](int64_t n_begin, int64_t n_end) {
    blocked_range(x, d, weight, bias, y, n_begin, n_end);
  });
}

// ---------------------------------------------------------------------------------------------
// GEMV for a few rows.

namespace {

// Columns [n0, n1) of y by the portable GEMV, on the calling thread.
void gemv_scalar_range(const float* x, const Dims& d, const TensorView& weight, const float* bias,
                       float* y, int64_t n0, int64_t n1) {
  const size_t elem = dtype_size(weight.dtype);
  const auto* w = static_cast<const char*>(weight.data);
  thread_local std::vector<float> scratch;
  float* wrow = thread_scratch(scratch, static_cast<size_t>(d.k));
  for (int64_t n = n0; n < n1; ++n) {
    widen_to_f32(weight.dtype, w + n * d.k * elem, wrow, d.k);
    for (int64_t m = 0; m < d.m; ++m) {
      const float* xr = x + m * d.k;
      // Eight partial sums: shorter dependency chains, and the compiler can vectorise.
      float acc[8] = {};
      int64_t k = 0;
      for (; k + 8 <= d.k; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] += xr[k + j] * wrow[k + j];
      for (; k < d.k; ++k) acc[0] += xr[k] * wrow[k];
      const float sum =
          ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      y[m * d.n + n] = sum + (bias ? bias[n] : 0.0f);
    }
  }
}

}  // namespace

void linear_gemv_scalar(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y) {
  const Dims d = check_args(x, num_rows, weight, y);
  if (d.m == 0) return;
  gemm_parallel_for(d.n, kRowGrain, [&](int64_t n0, int64_t n1) {
    gemv_scalar_range(x, d, weight, bias, y, n0, n1);
  });
}

bool gemv_avx512_available(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return cpu_has_avx512_bf16();
    case DType::kF16:
      return cpu_has_avx512();
    default:
      return false;
  }
}

bool linear_gemv_avx512(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y) {
  const Dims d = check_args(x, num_rows, weight, y);
  if (!gemv_avx512_available(weight.dtype)) return false;
  if (d.m == 0) return true;
  const auto* w = static_cast<const uint16_t*>(weight.data);
  if (weight.dtype == DType::kBF16) {
    thread_local std::vector<uint16_t> x_scratch;
    uint16_t* xb = thread_scratch(x_scratch, static_cast<size_t>(d.m * d.k));
    round_to_bf16(x, xb, d.m * d.k);
    gemm_parallel_for(d.n, kRowGrain, [&](int64_t n0, int64_t n1) {
      gemv_bf16_avx512(xb, d.k, d.m, w, d.k, d.k, n0, n1, bias, y, d.n);
    });
  } else {
    gemm_parallel_for(d.n, kRowGrain, [&](int64_t n0, int64_t n1) {
      gemv_f16_avx512(x, d.k, d.m, w, d.k, d.k, n0, n1, bias, y, d.n);
    });
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// oneDNN matmul.

#if defined(MOE_HAVE_DNNL)
namespace {

dnnl::engine& dnnl_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct DnnlPrimitive {
  dnnl::matmul matmul;
  size_t scratchpad_bytes = 0;
};

// K, N (of the slice), dtype, bias, and the row count for a fixed-M primitive (0: runtime M).
using DnnlKey = std::tuple<int64_t, int64_t, DType, bool, int64_t>;

// Row counts up to which a primitive is made for the exact M (oneDNN then picks its brgemm
// kernels, 1.1-1.4x its runtime-M GEMM at 32 to 256 rows; creating one costs about 0.1 ms).
constexpr int64_t kFixedMaxRows = 256;

// The primitive for [M, K] x [K, N] -> [M, N] with W stored as [N, K] (the [K, N] matrix with
// strides (1, K)). With fixed_m == 0 the row count M and the row stride of y are runtime values
// (one primitive serves every M and a slice of y's columns); with fixed_m > 0 both are fixed and
// y is dense [M, N]. Null when oneDNN has no implementation for this dtype on this CPU.
std::shared_ptr<const DnnlPrimitive> make_dnnl_primitive(int64_t k, int64_t n, DType dtype,
                                                         bool has_bias, int64_t fixed_m) {
  using dt = dnnl::memory::data_type;
  const dt wdt = dtype == DType::kBF16 ? dt::bf16 : dt::f16;
  const dnnl::memory::dim runtime = DNNL_RUNTIME_DIM_VAL;
  const dnnl::memory::dim m = fixed_m > 0 ? fixed_m : runtime;
  const dnnl::memory::desc src({m, k}, wdt, {k, 1});
  const dnnl::memory::desc wei({k, n}, wdt, {1, k});
  const dnnl::memory::desc dst({m, n}, dt::f32, {fixed_m > 0 ? n : runtime, 1});
  const dnnl::memory::desc bia({1, n}, dt::f32, {n, 1});
  dnnl::primitive_attr attr;
  // Our own scratchpad per calling thread, so that concurrent calls are safe.
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  try {
    const auto desc =
        has_bias ? dnnl::matmul::desc(src, wei, bia, dst) : dnnl::matmul::desc(src, wei, dst);
    const dnnl::matmul::primitive_desc pd(desc, attr, dnnl_engine());
    auto prim = std::make_shared<DnnlPrimitive>();
    prim->matmul = dnnl::matmul(pd);
    prim->scratchpad_bytes = pd.scratchpad_desc().get_size();
    return prim;
  } catch (const dnnl::error&) {
    return nullptr;
  }
}

std::shared_ptr<const DnnlPrimitive> dnnl_primitive(int64_t k, int64_t n, DType dtype,
                                                    bool has_bias, int64_t fixed_m = 0) {
  static std::mutex mutex;
  static std::map<DnnlKey, std::shared_ptr<const DnnlPrimitive>> cache;
  const DnnlKey key{k, n, dtype, has_bias, fixed_m};
  {
    std::lock_guard lock(mutex);
    if (auto it = cache.find(key); it != cache.end()) return it->second;
  }
  auto prim = make_dnnl_primitive(k, n, dtype, has_bias, fixed_m);  // slow: outside the lock
  std::lock_guard lock(mutex);
  // Exact-M primitives are bounded by kFixedMaxRows per shape; still, never let the cache grow
  // without limit (callers hold their own references, so clearing is safe).
  constexpr size_t kMaxCached = 8192;
  if (cache.size() >= kMaxCached) cache.clear();
  return cache.emplace(key, std::move(prim)).first->second;
}

// oneDNN (the OpenMP build) sizes its team from the calling thread's OpenMP thread count. We run
// it with one thread per call, inside our own workers, so this sets that count on the calling
// thread. omp_set_num_threads is looked up at run time: libgomp comes in through libdnnl (we do
// not link it ourselves), and a TBB or sequential oneDNN has none.
void set_openmp_threads(int count) {
  using SetThreads = void (*)(int);
  static const auto set_threads =
      reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  thread_local int current = -1;
  if (set_threads != nullptr && current != count) {
    set_threads(count);
    current = count;
  }
}

// y[:, n0:n1] for rows of xh (already rounded to the weight's type), on the calling thread
// with a single-threaded (or, with team > 1, an OpenMP-team) oneDNN call. Falls back to the
// blocked path when oneDNN has no primitive for this slice.
void dnnl_range(const float* x, const uint16_t* xh, const Dims& d, const TensorView& weight,
                const float* bias, float* y, int64_t n0, int64_t n1, int team) {
  const int64_t ns = n1 - n0;
  // Exact-M primitive (brgemm) for moderate row counts on one thread; it needs a dense y, so a
  // slice of y's columns goes through a thread-local buffer.
  std::shared_ptr<const DnnlPrimitive> prim;
  const bool fixed = team == 1 && d.m <= kFixedMaxRows;
  if (fixed) prim = dnnl_primitive(d.k, ns, weight.dtype, bias != nullptr, d.m);
  const bool use_fixed = prim != nullptr;
  if (!use_fixed) prim = dnnl_primitive(d.k, ns, weight.dtype, bias != nullptr);
  if (prim == nullptr) return blocked_range(x, d, weight, bias, y, n0, n1);
  set_openmp_threads(team);
  using dt = dnnl::memory::data_type;
  const dt wdt = weight.dtype == DType::kBF16 ? dt::bf16 : dt::f16;
  thread_local std::vector<char> pad_scratch;
  thread_local std::vector<float> y_scratch;
  thread_local dnnl::stream stream(dnnl_engine());
  char* pad = thread_scratch(pad_scratch, std::max<size_t>(1, prim->scratchpad_bytes));
  const bool via_scratch = use_fixed && ns != d.n;
  float* dst_ptr = via_scratch ? thread_scratch(y_scratch, static_cast<size_t>(d.m * ns)) : y + n0;
  const int64_t ldd = use_fixed ? ns : d.n;
  auto& engine = dnnl_engine();
  const auto* w = static_cast<const uint16_t*>(weight.data) + n0 * d.k;
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, dnnl::memory({{d.m, d.k}, wdt, {d.k, 1}}, engine, const_cast<uint16_t*>(xh))},
      {DNNL_ARG_WEIGHTS,
       dnnl::memory({{d.k, ns}, wdt, {1, d.k}}, engine, const_cast<uint16_t*>(w))},
      {DNNL_ARG_DST, dnnl::memory({{d.m, ns}, dt::f32, {ldd, 1}}, engine, dst_ptr)},
      {DNNL_ARG_SCRATCHPAD,
       dnnl::memory({{static_cast<dnnl::memory::dim>(prim->scratchpad_bytes)}, dt::u8, {1}}, engine,
                    pad)}};
  if (bias != nullptr) {
    args.emplace(DNNL_ARG_BIAS,
                 dnnl::memory({{1, ns}, dt::f32, {ns, 1}}, engine, const_cast<float*>(bias + n0)));
  }
  prim->matmul.execute(stream, args);
  stream.wait();
  if (via_scratch) {
    for (int64_t m = 0; m < d.m; ++m) {
      std::memcpy(y + m * d.n + n0, dst_ptr + m * ns, static_cast<size_t>(ns) * sizeof(float));
    }
  }
}

bool linear_dnnl_impl(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
                      float* y, bool openmp_team) {
  const Dims d = check_args(x, num_rows, weight, y);
  if (!dnnl_available(weight.dtype)) return false;
  if (d.m == 0) return true;
  thread_local std::vector<uint16_t> x_scratch;
  uint16_t* xh = thread_scratch(x_scratch, static_cast<size_t>(d.m * d.k));
  if (weight.dtype == DType::kBF16) {
    round_to_bf16(x, xh, d.m * d.k);
  } else {
    round_to_f16(x, xh, d.m * d.k);
  }
  if (openmp_team) {
    dnnl_range(x, xh, d, weight, bias, y, 0, d.n, gemm_num_threads());
  } else {
    gemm_parallel_for(d.n, kDnnlGrain, [&](int64_t n0, int64_t n1) {
      dnnl_range(x, xh, d, weight, bias, y, n0, n1, 1);
    });
  }
  return true;
}

}  // namespace

bool dnnl_available(DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  // Probe once per dtype with a representative shape.
  static const bool bf16 = dnnl_primitive(64, 64, DType::kBF16, false) != nullptr;
  static const bool f16 = dnnl_primitive(64, 64, DType::kF16, false) != nullptr;
  return dtype == DType::kBF16 ? bf16 : f16;
}

bool linear_dnnl(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
                 float* y) {
  return linear_dnnl_impl(x, num_rows, weight, bias, y, false);
}

bool linear_dnnl_openmp(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y) {
  return linear_dnnl_impl(x, num_rows, weight, bias, y, true);
}

#else  // !MOE_HAVE_DNNL

namespace {
void dnnl_range(const float* x, const uint16_t*, const Dims& d, const TensorView& weight,
                const float* bias, float* y, int64_t n0, int64_t n1, int) {
  blocked_range(x, d, weight, bias, y, n0, n1);
}
}  // namespace

bool dnnl_available(DType) { return false; }
bool linear_dnnl(const float* x, int64_t num_rows, const TensorView& weight, const float*,
                 float* y) {
  check_args(x, num_rows, weight, y);
  return false;
}
bool linear_dnnl_openmp(const float* x, int64_t num_rows, const TensorView& weight,
                        const float* bias, float* y) {
  return linear_dnnl(x, num_rows, weight, bias, y);
}

#endif

}  // namespace gemm_detail

// ---------------------------------------------------------------------------------------------

void linear(const float* x, int64_t num_rows, const TensorView& weight, const float* bias,
            float* y) {
  using namespace gemm_detail;
  const Dims d = check_args(x, num_rows, weight, y);
  if (d.m == 0) return;
  switch (choose_path(weight.dtype, d.m, d.k, d.n, bias != nullptr)) {
    case Path::kSgemm:
      return linear_sgemm(x, num_rows, weight, bias, y);
    case Path::kGemv:
      if (linear_gemv_avx512(x, num_rows, weight, bias, y)) return;
      break;
    case Path::kDnnl:
      if (linear_dnnl(x, num_rows, weight, bias, y)) return;
      break;
    case Path::kGemvScalar:
      return linear_gemv_scalar(x, num_rows, weight, bias, y);
    case Path::kBlockedF32:
      break;
  }
  linear_blocked_f32(x, num_rows, weight, bias, y);
}

// ---------------------------------------------------------------------------------------------
// Groups of products: one parallel region, items (problem, slice of N) taken from a shared counter.

void linear_grouped(std::span<const LinearProblem> problems) {
  using namespace gemm_detail;
  struct Prepared {
    Dims d;
    Path path;
    int64_t x16_offset = -1;        // where x rounded to 16 bits sits in the scratch, if needed
    const uint16_t* x16 = nullptr;  // x rounded to the weight's 16-bit type (GEMV bf16, oneDNN)
  };
  struct Item {
    int32_t problem;
    int64_t n0, n1;
  };
  struct Conversion {
    const float* src;
    int64_t count;
    DType dtype;
    size_t offset;  // into x16_storage
  };
  // Plain locals: the workers read these through the lambdas' references (a thread_local here
  // would name each worker's own, empty, instance).
  std::vector<Prepared> prepared;
  std::vector<Item> items;
  std::vector<Conversion> conversions;
  thread_local std::vector<uint16_t> x16_storage;
  prepared.reserve(problems.size());

  // Validate everything before any work, pick each problem's path and plan the rounding of the
  // activations (once per distinct x: the gate and up projections of an expert share theirs).
  size_t x16_size = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    const LinearProblem& p = problems[i];
    Prepared prep{.d = check_args(p.x, p.num_rows, p.weight, p.y)};
    prep.path = choose_path(p.weight.dtype, prep.d.m, prep.d.k, prep.d.n, p.bias != nullptr);
    if (prep.path == Path::kGemv && !gemv_avx512_available(p.weight.dtype)) {
      prep.path = Path::kGemvScalar;
    }
    const bool needs_x16 =
        prep.d.m > 0 &&
        (prep.path == Path::kDnnl || (prep.path == Path::kGemv && p.weight.dtype == DType::kBF16));
    if (needs_x16) {
      const int64_t count = prep.d.m * prep.d.k;
      const DType dtype = p.weight.dtype;
      size_t offset = x16_size;
      bool shared = false;
      for (const Conversion& c : conversions) {
        if (c.src == p.x && c.count == count && c.dtype == dtype) {
          offset = c.offset;
          shared = true;
          break;
        }
      }
      if (!shared) {
        conversions.push_back({p.x, count, dtype, offset});
        x16_size += static_cast<size_t>(count);
      }
      prep.x16_offset = static_cast<int64_t>(offset);
    }
    prepared.push_back(prep);
  }
  if (prepared.empty()) return;
  init_libraries();
  uint16_t* x16_base = thread_scratch(x16_storage, std::max<size_t>(1, x16_size));
  for (Prepared& prep : prepared) {
    if (prep.x16_offset >= 0) prep.x16 = x16_base + prep.x16_offset;
  }

  // Slices of N: small enough that a group of experts spreads evenly over the workers, large
  // enough that each oneDNN or BLAS call has work to amortise its set-up.
  for (size_t i = 0; i < prepared.size(); ++i) {
    const Prepared& prep = prepared[i];
    if (prep.d.m == 0) continue;
    int64_t slice = 256;
    if (prep.path == Path::kGemv || prep.path == Path::kGemvScalar) slice = 64;
    if (prep.path == Path::kBlockedF32) {
      slice = std::max<int64_t>(1, kBlockBytes / (prep.d.k * 4));
    }
    for (int64_t n0 = 0; n0 < prep.d.n; n0 += slice) {
      items.push_back({static_cast<int32_t>(i), n0, std::min(prep.d.n, n0 + slice)});
    }
  }

  // Round the activations, in pieces spread over the workers.
  constexpr int64_t kPiece = 1 << 16;
  std::vector<std::pair<int32_t, int64_t>> pieces;  // (conversion, start)
  for (size_t c = 0; c < conversions.size(); ++c) {
    for (int64_t start = 0; start < conversions[c].count; start += kPiece) {
      pieces.push_back({static_cast<int32_t>(c), start});
    }
  }
  gemm_parallel_for(static_cast<int64_t>(pieces.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Conversion& c = conversions[pieces[i].first];
      const int64_t start = pieces[i].second;
      const int64_t count = std::min(kPiece, c.count - start);
      uint16_t* dst = x16_base + c.offset + start;
      if (c.dtype == DType::kBF16) {
        round_to_bf16(c.src + start, dst, count);
      } else {
        round_to_f16(c.src + start, dst, count);
      }
    }
  });

  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  gemm_parallel_for(gemm_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& item = items[i];
      const LinearProblem& p = problems[item.problem];
      const Prepared& prep = prepared[item.problem];
      const Dims& d = prep.d;
      switch (prep.path) {
        case Path::kSgemm:
          sgemm_range(p.x, d, p.weight, p.bias, p.y, item.n0, item.n1);
          break;
        case Path::kGemv:
          if (p.weight.dtype == DType::kBF16) {
            gemv_bf16_avx512(prep.x16, d.k, d.m, static_cast<const uint16_t*>(p.weight.data), d.k,
                             d.k, item.n0, item.n1, p.bias, p.y, d.n);
          } else {
            gemv_f16_avx512(p.x, d.k, d.m, static_cast<const uint16_t*>(p.weight.data), d.k, d.k,
                            item.n0, item.n1, p.bias, p.y, d.n);
          }
          break;
        case Path::kDnnl:
          dnnl_range(p.x, prep.x16, d, p.weight, p.bias, p.y, item.n0, item.n1, 1);
          break;
        case Path::kGemvScalar:
          gemv_scalar_range(p.x, d, p.weight, p.bias, p.y, item.n0, item.n1);
          break;
        case Path::kBlockedF32:
          blocked_range(p.x, d, p.weight, p.bias, p.y, item.n0, item.n1);
          break;
      }
    }
  });
}

void widen_bf16_terms(const uint16_t* hi, const uint16_t* lo, int64_t n, float* out) {
  MOE_CHECK(n >= 0 && (n == 0 || (hi && lo && out)), "widen_bf16_terms: ", n,
            " elements without their terms or output");
  // An expert of a large model is tens of millions of elements: a chunk of 64 Ki (256 KiB out)
  // is long enough to stream and short enough to spread one expert over every worker.
  constexpr int64_t kGrain = int64_t{1} << 16;
  gemm_parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = bf16_to_f32(hi[i]) + bf16_to_f32(lo[i]);
  });
}

void set_batch_invariant(bool on) {
  gemm_detail::g_batch_invariant.store(on, std::memory_order_relaxed);
}

bool batch_invariant() { return gemm_detail::g_batch_invariant.load(std::memory_order_relaxed); }

}  // namespace moeinfer::cpu
