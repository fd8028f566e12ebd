// cpu::linear() and each of its paths against a float64 reference, at awkward sizes, with fresh
// random inputs each run (the seed is printed on failure) and outputs poisoned with NaN first.
//
// Tolerances, relative to the natural scale of each output, sum_k |x_k w_nk| + |b_n|:
// - every path against the exact product of the float32 activations and the stored weights:
//   float32 weights 1e-5, bf16 and f16 weights 1e-2 (the contract in CONVENTIONS.md);
// - paths that round the activations to 16 bits first, against a reference built from the same
//   rounded activations: 1e-4, so that a wrong element cannot hide inside the 1e-2 budget.
#include "backend/cpu/gemm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/gemm_internal.h"
#include "backend/cpu/gemm_parallel.h"
#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer::cpu {
namespace {

using gemm_detail::Path;

uint32_t fresh_seed() {
  static const uint32_t seed = [] {
    if (const char* env = std::getenv("MOE_TEST_SEED"))
      return static_cast<uint32_t>(std::atoll(env));
    return std::random_device{}();
  }();
  return seed;
}

struct Shape3 {
  int64_t t, k, n;
};

std::vector<Shape3> test_shapes() {
  const int64_t dims[] = {1, 16, 33, 100, 768, 2048};
  std::vector<Shape3> shapes;
  for (int64_t t : {1, 2, 7, 19})
    for (int64_t k : dims)
      for (int64_t n : dims) shapes.push_back({t, k, n});
  // Many rows: every K and N value appears, the product kept small enough for a float64
  // reference.
  for (int64_t t : {99, 513}) {
    for (auto [k, n] : {std::pair<int64_t, int64_t>{1, 16},
                        {16, 1},
                        {33, 100},
                        {100, 33},
                        {2048, 100},
                        {100, 768},
                        {768, 33}}) {
      shapes.push_back({t, k, n});
    }
  }
  return shapes;
}

// Weights in their stored dtype plus the exact float value of each element.
struct Weights {
  DType dtype;
  std::vector<uint16_t> half;  // BF16 / F16 storage
  std::vector<float> full;     // F32 storage, and the exact values for every dtype
  TensorView view(int64_t n, int64_t k) const {
    return TensorView{.dtype = dtype,
                      .shape = {n, k},
                      .data = dtype == DType::kF32 ? static_cast<const void*>(full.data())
                                                   : static_cast<const void*>(half.data())};
  }
};

Weights make_weights(DType dtype, int64_t n, int64_t k, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Weights w{.dtype = dtype};
  w.full.resize(static_cast<size_t>(n * k));
  if (dtype != DType::kF32) w.half.resize(w.full.size());
  for (size_t i = 0; i < w.full.size(); ++i) {
    const float v = dist(rng) * 0.5f;
    if (dtype == DType::kBF16) {
      w.half[i] = f32_to_bf16(v);
      w.full[i] = bf16_to_f32(w.half[i]);
    } else if (dtype == DType::kF16) {
      w.half[i] = f32_to_f16(v);
      w.full[i] = f16_to_f32(w.half[i]);
    } else {
      w.full[i] = v;
    }
  }
  return w;
}

// out[m, n] = sum_k x[m, k] w[n, k] (+ bias), and scale[m, n] = sum |x w| + |bias|, in float64.
void reference(const std::vector<float>& x, const Weights& w, const std::vector<float>* bias,
               int64_t t, int64_t k, int64_t n, std::vector<double>* out,
               std::vector<double>* scale) {
  out->assign(static_cast<size_t>(t * n), 0.0);
  scale->assign(static_cast<size_t>(t * n), 0.0);
  for (int64_t m = 0; m < t; ++m) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      const float* xr = x.data() + m * k;
      const float* wr = w.full.data() + j * k;
      for (int64_t i = 0; i < k; ++i) {
        const double p = static_cast<double>(xr[i]) * wr[i];
        sum += p;
        mag += std::fabs(p);
      }
      if (bias) {
        sum += (*bias)[j];
        mag += std::fabs((*bias)[j]);
      }
      (*out)[m * n + j] = sum;
      (*scale)[m * n + j] = mag;
    }
  }
}

// Empty string when every element is within tol * scale; else a description of the worst one.
std::string compare(const std::vector<float>& y, const std::vector<double>& ref,
                    const std::vector<double>& scale, double tol, int64_t n) {
  double worst = 0;
  int64_t worst_index = -1;
  for (size_t i = 0; i < y.size(); ++i) {
    if (!std::isfinite(y[i])) {
      std::ostringstream out;
      out << "y[" << i / n << ", " << i % n << "] = " << y[i] << " (not written or not finite)";
      return out.str();
    }
    const double err = std::fabs(y[i] - ref[i]) / (scale[i] + 1e-30);
    if (err > worst) {
      worst = err;
      worst_index = static_cast<int64_t>(i);
    }
  }
  if (worst <= tol) return "";
  std::ostringstream out;
  out << "y[" << worst_index / n << ", " << worst_index % n << "] = " << y[worst_index]
      << ", reference " << ref[worst_index] << ", error " << worst << " of scale "
      << scale[worst_index] << " > " << tol;
  return out.str();
}

using LinearFn =
    std::function<bool(const float*, int64_t, const TensorView&, const float*, float*)>;

struct PathUnderTest {
  std::string name;
  LinearFn fn;
  bool rounds_x;  // rounds activations to the weight's 16-bit type before multiplying
};

bool path_rounds_x(Path path, DType dtype) {
  return path == Path::kDnnl || (path == Path::kGemv && dtype == DType::kBF16);
}

std::vector<PathUnderTest> paths_for(DType dtype) {
  std::vector<PathUnderTest> paths;
  auto always = [](auto f) {
    return [f](const float* x, int64_t t, const TensorView& w, const float* b, float* y) {
      f(x, t, w, b, y);
      return true;
    };
  };
  paths.push_back({"linear", always(linear), false});  // rounds_x decided per shape
  if (dtype == DType::kF32) {
    paths.push_back({"sgemm", always(gemm_detail::linear_sgemm), false});
    return paths;
  }
  paths.push_back({"blocked-f32", always(gemm_detail::linear_blocked_f32), false});
  paths.push_back({"gemv-scalar", always(gemm_detail::linear_gemv_scalar), false});
  paths.push_back({"gemv-avx512", gemm_detail::linear_gemv_avx512, dtype == DType::kBF16});
  paths.push_back({"onednn", gemm_detail::linear_dnnl, true});
  paths.push_back({"onednn-openmp", gemm_detail::linear_dnnl_openmp, true});
  for (auto& p : paths) {
    if (p.name == "gemv-avx512") p.rounds_x = path_rounds_x(Path::kGemv, dtype);
  }
  return paths;
}

void run_dtype(DType dtype) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) +
               " (rerun with MOE_TEST_SEED=" + std::to_string(seed) + ")");
  std::mt19937 rng(seed ^ static_cast<uint32_t>(dtype) * 0x9e3779b9u);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const double tol_exact = dtype == DType::kF32 ? 1e-5 : 1e-2;
  const double tol_rounded = 1e-4;
  int unavailable = 0;

  for (const Shape3& s : test_shapes()) {
    const Weights w = make_weights(dtype, s.n, s.k, rng);
    std::vector<float> x(static_cast<size_t>(s.t * s.k));
    for (float& v : x) v = dist(rng);
    std::vector<float> xr(x.size());  // x rounded to the weight's 16-bit type
    for (size_t i = 0; i < x.size(); ++i) {
      xr[i] = dtype == DType::kF16 ? f16_to_f32(f32_to_f16(x[i])) : bf16_to_f32(f32_to_bf16(x[i]));
    }
    std::vector<float> bias(static_cast<size_t>(s.n));
    for (float& v : bias) v = dist(rng);

    for (bool with_bias : {false, true}) {
      const std::vector<float>* b = with_bias ? &bias : nullptr;
      std::vector<double> ref, scale, ref_r, scale_r;
      reference(x, w, b, s.t, s.k, s.n, &ref, &scale);
      bool have_rounded = false;
      for (const PathUnderTest& path : paths_for(dtype)) {
        std::vector<float> y(static_cast<size_t>(s.t * s.n),
                             std::numeric_limits<float>::quiet_NaN());
        if (!path.fn(x.data(), s.t, w.view(s.n, s.k), with_bias ? bias.data() : nullptr,
                     y.data())) {
          ++unavailable;
          continue;
        }
        const std::string where = path.name + " " + std::string(dtype_name(dtype)) +
                                  " T=" + std::to_string(s.t) + " K=" + std::to_string(s.k) +
                                  " N=" + std::to_string(s.n) + (with_bias ? " bias" : "");
        std::string bad = compare(y, ref, scale, tol_exact, s.n);
        ASSERT_EQ(bad, "") << where;
        const bool rounds_x =
            path.name == "linear"
                ? path_rounds_x(gemm_detail::choose_path(dtype, s.t, s.k, s.n, with_bias), dtype)
                : path.rounds_x;
        if (rounds_x) {
          if (!have_rounded) {
            reference(xr, w, b, s.t, s.k, s.n, &ref_r, &scale_r);
            have_rounded = true;
          }
          bad = compare(y, ref_r, scale_r, tol_rounded, s.n);
          ASSERT_EQ(bad, "") << where << " (against rounded activations)";
        }
      }
    }
  }
  if (unavailable > 0) {
    std::printf(
        "[ note     ] %s: %d path runs unavailable on this machine (no oneDNN primitive "
        "or no AVX-512 for this dtype)\n",
        std::string(dtype_name(dtype)).c_str(), unavailable);
  }
}

TEST(GemmTest, F32WeightsMatchReference) { run_dtype(DType::kF32); }
TEST(GemmTest, Bf16WeightsMatchReference) { run_dtype(DType::kBF16); }
TEST(GemmTest, F16WeightsMatchReference) { run_dtype(DType::kF16); }

TEST(GemmTest, ForcedFallbackMatchesReference) {
  gemm_detail::set_force_fallback(true);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int64_t t : {1, 19, 513}) {
      EXPECT_NE(gemm_detail::choose_path(dtype, t, 64, 64, false), Path::kDnnl);
      EXPECT_NE(gemm_detail::choose_path(dtype, t, 64, 64, false), Path::kGemv);
    }
  }
  run_dtype(DType::kBF16);
  run_dtype(DType::kF16);
  gemm_detail::set_force_fallback(false);
}

// Nested and concurrent use of the GEMM workers: every index covered exactly once, no deadlock.
TEST(GemmTest, ParallelForNestsAndCovers) {
  std::vector<std::atomic<int>> hits(1000);
  gemm_parallel_for(10, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      gemm_parallel_for(100, 7, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) hits[i * 100 + j].fetch_add(1);
      });
    }
  });
  for (const auto& h : hits) ASSERT_EQ(h.load(), 1);
  std::vector<std::thread> threads;
  std::vector<std::atomic<int>> hits2(4 * 5000);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      gemm_parallel_for(5000, 3, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) hits2[t * 5000 + j].fetch_add(1);
      });
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& h : hits2) ASSERT_EQ(h.load(), 1);
}

// Two bf16 terms widened over the workers give the serial sum bit for bit, at sizes below, at
// and past the chunk (64 Ki) and over several chunks; nothing past n is written.
TEST(GemmTest, WidenBf16TermsEqualsSerialSum) {
  std::mt19937 rng(fresh_seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{19}, int64_t{989}, int64_t{1} << 16,
                          (int64_t{1} << 16) + 1, 5 * (int64_t{1} << 16) + 99}) {
    std::vector<uint16_t> hi(static_cast<size_t>(n)), lo(hi.size());
    std::vector<float> want(hi.size());
    for (int64_t i = 0; i < n; ++i) {
      const float w = normal(rng);
      hi[i] = f32_to_bf16(w);
      lo[i] = f32_to_bf16(w - bf16_to_f32(hi[i]));
      want[i] = bf16_to_f32(hi[i]) + bf16_to_f32(lo[i]);
    }
    std::vector<float> got(hi.size() + 1, std::numeric_limits<float>::quiet_NaN());
    widen_bf16_terms(hi.data(), lo.data(), n, got.data());
    // memcmp of an empty vector would pass its null data(): bits compared only where there are.
    if (n > 0) {
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0)
          << "n " << n << " seed " << fresh_seed();
    }
    ASSERT_TRUE(std::isnan(got.back())) << "n " << n << ": wrote past the end";
  }
  EXPECT_THROW(widen_bf16_terms(nullptr, nullptr, 3, nullptr), Error);
}

TEST(GemmTest, ZeroRowsWritesNothing) {
  std::mt19937 rng(fresh_seed());
  const Weights w = make_weights(DType::kBF16, 8, 8, rng);
  float y = 1.0f;
  linear(nullptr, 0, w.view(8, 8), nullptr, &y);
  EXPECT_EQ(y, 1.0f);
}

TEST(GemmTest, RejectsBadArguments) {
  std::vector<float> x(64), y(64);
  std::vector<uint16_t> storage(64);
  TensorView rank1{.dtype = DType::kBF16, .shape = {64}, .data = storage.data()};
  EXPECT_THROW(linear(x.data(), 1, rank1, nullptr, y.data()), Error);
  TensorView int8{.dtype = DType::kI8, .shape = {8, 8}, .data = storage.data()};
  EXPECT_THROW(linear(x.data(), 1, int8, nullptr, y.data()), Error);
  TensorView empty{.dtype = DType::kBF16, .shape = {8, 8}, .data = nullptr};
  EXPECT_THROW(linear(x.data(), 1, empty, nullptr, y.data()), Error);
  TensorView ok{.dtype = DType::kBF16, .shape = {8, 8}, .data = storage.data()};
  EXPECT_THROW(linear(x.data(), -1, ok, nullptr, y.data()), Error);
  EXPECT_THROW(linear(nullptr, 1, ok, nullptr, y.data()), Error);
  EXPECT_THROW(linear(x.data(), 2, ok, nullptr, x.data() + 4), Error);  // y overlaps x
  EXPECT_NO_THROW(linear(x.data(), 2, ok, nullptr, x.data() + 16));     // adjacent is fine
  try {
    linear(x.data(), 1, int8, nullptr, y.data());
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("I8"), std::string::npos) << e.what();
  }
}

// Several threads calling linear() at once, on every path, each against its own reference.
TEST(GemmTest, ConcurrentCallsAreSafe) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  struct Case {
    DType dtype;
    int64_t t, k, n;
  };
  const std::vector<Case> cases = {{DType::kBF16, 1, 768, 256},  {DType::kBF16, 64, 512, 300},
                                   {DType::kF32, 5, 300, 200},   {DType::kF16, 3, 257, 129},
                                   {DType::kBF16, 200, 96, 130}, {DType::kF16, 77, 128, 64}};
  std::vector<std::string> failures(cases.size());
  std::vector<std::thread> threads;
  for (size_t c = 0; c < cases.size(); ++c) {
    threads.emplace_back([&, c] {
      const Case& cs = cases[c];
      std::mt19937 rng(seed + static_cast<uint32_t>(c));
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      const Weights w = make_weights(cs.dtype, cs.n, cs.k, rng);
      std::vector<float> x(static_cast<size_t>(cs.t * cs.k));
      for (float& v : x) v = dist(rng);
      std::vector<double> ref, scale;
      reference(x, w, nullptr, cs.t, cs.k, cs.n, &ref, &scale);
      for (int rep = 0; rep < 20 && failures[c].empty(); ++rep) {
        std::vector<float> y(static_cast<size_t>(cs.t * cs.n),
                             std::numeric_limits<float>::quiet_NaN());
        linear(x.data(), cs.t, w.view(cs.n, cs.k), nullptr, y.data());
        failures[c] = compare(y, ref, scale, cs.dtype == DType::kF32 ? 1e-5 : 1e-2, cs.n);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t c = 0; c < cases.size(); ++c) EXPECT_EQ(failures[c], "") << "case " << c;
}

// A group shaped like an MoE layer's experts (shared activations for gate and up, empty experts,
// mixed row counts) plus odd products of every dtype, each against its own reference.
void run_grouped(bool fallback) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + (fallback ? " (fallback)" : ""));
  gemm_detail::set_force_fallback(fallback);
  std::mt19937 rng(seed + 77);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  struct Case {
    DType dtype;
    int64_t t, k, n;
    bool bias;
    int shares_x_with;  // index of an earlier case whose x this one reads, or -1
  };
  const std::vector<Case> cases = {
      {DType::kBF16, 1, 256, 96, false, -1}, {DType::kBF16, 1, 256, 96, false, 0},
      {DType::kBF16, 0, 256, 96, false, -1}, {DType::kBF16, 37, 256, 96, true, -1},
      {DType::kBF16, 37, 256, 96, false, 3}, {DType::kBF16, 100, 33, 300, true, -1},
      {DType::kF16, 5, 100, 19, true, -1},   {DType::kF16, 64, 65, 129, false, -1},
      {DType::kF32, 3, 33, 100, true, -1},   {DType::kF32, 99, 16, 7, false, -1},
      {DType::kBF16, 513, 16, 1, false, -1}, {DType::kBF16, 2, 2048, 768, false, -1}};
  std::vector<Weights> weights;
  std::vector<std::vector<float>> xs(cases.size()), ys(cases.size()), biases(cases.size());
  std::vector<LinearProblem> problems;
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& cs = cases[c];
    weights.push_back(make_weights(cs.dtype, cs.n, cs.k, rng));
    if (cs.shares_x_with < 0) {
      xs[c].resize(static_cast<size_t>(cs.t * cs.k));
      for (float& v : xs[c]) v = dist(rng);
    } else {
      xs[c] = xs[cs.shares_x_with];
    }
    biases[c].resize(static_cast<size_t>(cs.n));
    for (float& v : biases[c]) v = dist(rng);
    ys[c].assign(static_cast<size_t>(cs.t * cs.n), std::numeric_limits<float>::quiet_NaN());
  }
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& cs = cases[c];
    const float* x = cs.shares_x_with < 0 ? xs[c].data() : xs[cs.shares_x_with].data();
    problems.push_back({.x = cs.t > 0 ? x : nullptr,
                        .num_rows = cs.t,
                        .weight = weights[c].view(cs.n, cs.k),
                        .bias = cs.bias ? biases[c].data() : nullptr,
                        .y = ys[c].data()});
  }
  linear_grouped(problems);
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& cs = cases[c];
    std::vector<double> ref, scale;
    reference(xs[c], weights[c], cs.bias ? &biases[c] : nullptr, cs.t, cs.k, cs.n, &ref, &scale);
    EXPECT_EQ(compare(ys[c], ref, scale, cs.dtype == DType::kF32 ? 1e-5 : 1e-2, cs.n), "")
        << "case " << c << " " << dtype_name(cs.dtype) << " T=" << cs.t << " K=" << cs.k
        << " N=" << cs.n;
  }
  gemm_detail::set_force_fallback(false);
}

TEST(GemmTest, GroupedMatchesReference) { run_grouped(false); }
TEST(GemmTest, GroupedFallbackMatchesReference) { run_grouped(true); }

TEST(GemmTest, GroupedEmptyAndInvalid) {
  linear_grouped({});
  std::vector<float> x(64), y(64);
  std::vector<uint16_t> storage(64);
  const LinearProblem bad{.x = x.data(),
                          .num_rows = 1,
                          .weight = {.dtype = DType::kI8, .shape = {8, 8}, .data = storage.data()},
                          .y = y.data()};
  EXPECT_THROW(linear_grouped(std::span<const LinearProblem>(&bad, 1)), Error);
}

// Several threads running groups at once.
TEST(GemmTest, ConcurrentGroupsAreSafe) {
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) threads.emplace_back([] { run_grouped(false); });
  for (auto& t : threads) t.join();
}

}  // namespace
}  // namespace moeinfer::cpu
