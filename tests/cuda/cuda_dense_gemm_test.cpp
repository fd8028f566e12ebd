// The fixed-order dense GEMM of --deterministic (backend/cuda/dense_gemm.h), on fresh random
// inputs:
//   - against a float64 CPU reference at awkward sizes (M 1 to 99, N 1 to 200, K 5 to 320, row
//     strides that break 16-byte alignment, both weight layouts, float32 and bf16 outputs, a
//     batch of three), outputs poisoned first; float32 within 1e-4 of the output's natural
//     scale (a float32 accumulation of K bf16 products), bf16 within the bf16 contract;
//   - bit for bit, what it is for: a row's output is the same alone (M = 1, pointer moved to
//     it), among M = 2 .. 200 other rows, at another row index beside other rows, and under
//     either tile forced.
// The host-side refusals run without a device too.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cmath>
#include <cstring>

#include "backend/cuda/dense_gemm.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaDenseGemmChecks, RefusesBadShapes) {
  alignas(16) uint16_t buf[64] = {};
  const auto* in = reinterpret_cast<const __nv_bfloat16*>(buf);
  DenseGemmParams p{.a = in, .b = in, .c = buf, .m = 2, .n = 4, .k = 8};
  p.lda = 4;
  expect_error_naming([&] { dense_gemm(p, nullptr); }, "lda = 4");
  p.lda = 0;
  p.n = 0;
  expect_error_naming([&] { dense_gemm(p, nullptr); }, "n = 0");
  p.n = 4;
  p.b_layout = DenseLayout::kKN;
  p.ldb = 3;
  expect_error_naming([&] { dense_gemm(p, nullptr); }, "ldb = 3");
  p.ldb = 0;
  p.batch = 0;
  expect_error_naming([&] { dense_gemm(p, nullptr); }, "batch = 0");
  p.batch = 1;
  p.c = nullptr;
  expect_error_naming([&] { dense_gemm(p, nullptr); }, "c is null");
  // No rows: nothing to do, no pointer looked at.
  dense_gemm(DenseGemmParams{.m = 0, .n = 4, .k = 8}, nullptr);
  EXPECT_EQ(dense_gemm_auto_tile(1), DenseTile::kRows16);
  EXPECT_EQ(dense_gemm_auto_tile(17), DenseTile::kRows64);
}

struct Case {
  int64_t m, n, k, lda_pad, batch;
  DenseLayout layout;
  bool f32;
  bool two_terms = false;  // a b_lo of its own random values: c = a . op(b + b_lo)
};

// Element (r, col) of batch entry e of c = a . op(b), in float64.
double reference(const std::vector<float>& a, const std::vector<float>& b,
                 const std::vector<float>& b_lo, const Case& c, int64_t lda, int64_t ldb,
                 int64_t e, int64_t r, int64_t col, double* scale) {
  const int64_t a0 = e * c.m * lda, b0 = e * c.n * c.k;
  double sum = 0.0, squares = 0.0;
  for (int64_t i = 0; i < c.k; ++i) {
    const int64_t at = c.layout == DenseLayout::kNK ? b0 + col * ldb + i : b0 + i * ldb + col;
    const double w = double{b[at]} + (c.two_terms ? double{b_lo[at]} : 0.0);
    const double term = double{a[a0 + r * lda + i]} * w;
    sum += term;
    squares += term * term;
  }
  *scale = std::sqrt(squares);
  return sum;
}

void matches_the_reference() {
  std::mt19937 rng(fresh_seed());
  const Case cases[] = {
      {1, 64, 64, 0, 1, DenseLayout::kNK, true},    {3, 200, 320, 0, 1, DenseLayout::kNK, true},
      {19, 33, 100, 3, 1, DenseLayout::kNK, false}, {99, 130, 72, 0, 1, DenseLayout::kNK, false},
      {7, 1, 256, 0, 1, DenseLayout::kNK, true},    {64, 136, 5, 1, 1, DenseLayout::kNK, true},
      {17, 96, 64, 0, 3, DenseLayout::kNK, false},  {5, 512, 128, 0, 3, DenseLayout::kKN, false},
      {33, 72, 24, 2, 3, DenseLayout::kKN, false},  {2, 13, 40, 0, 1, DenseLayout::kKN, true},
      {3, 200, 320, 0, 1, DenseLayout::kNK, true, true},
      {19, 33, 100, 3, 3, DenseLayout::kNK, false, true},
      {99, 130, 72, 0, 1, DenseLayout::kNK, true, true},
      {5, 512, 128, 0, 3, DenseLayout::kKN, false, true},
      {33, 72, 24, 2, 1, DenseLayout::kKN, true, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "m " << c.m << " n " << c.n << " k " << c.k << " lda pad "
                                      << c.lda_pad << " batch " << c.batch << " kKN "
                                      << (c.layout == DenseLayout::kKN) << " f32 " << c.f32
                                      << " two terms " << c.two_terms);
    const int64_t lda = c.k + c.lda_pad;
    const int64_t ldb = c.layout == DenseLayout::kNK ? c.k : c.n;
    const auto a_bits = random_bf16(static_cast<size_t>(c.batch * c.m * lda), rng);
    const auto b_bits = random_bf16(static_cast<size_t>(c.batch * c.n * c.k), rng);
    const auto b_lo_bits = random_bf16(c.two_terms ? b_bits.size() : 0, rng);
    const std::vector<float> a = to_float(a_bits), b = to_float(b_bits), b_lo = to_float(b_lo_bits);
    DeviceBuffer<uint16_t> da(a_bits), db(b_bits), db_lo(b_lo_bits);
    const size_t out_count = static_cast<size_t>(c.batch * c.m * c.n);
    DeviceBuffer<float> out32(c.f32 ? out_count : 0);
    DeviceBuffer<uint16_t> out16(c.f32 ? 0 : out_count);
    out32.poison();
    out16.poison();
    dense_gemm({.a = da.as_bf16(),
                .b = db.as_bf16(),
                .b_lo = c.two_terms ? db_lo.as_bf16() : nullptr,
                .c = c.f32 ? static_cast<void*>(out32.get()) : static_cast<void*>(out16.get()),
                .m = c.m,
                .n = c.n,
                .k = c.k,
                .lda = lda,
                .ldb = ldb,
                .b_layout = c.layout,
                .c_f32 = c.f32,
                .batch = c.batch,
                .batch_stride_a = c.m * lda,
                .batch_stride_b = c.n * c.k,
                .batch_stride_c = c.m * c.n},
               nullptr);
    synchronize();
    std::vector<double> want(out_count), scale(out_count);
    for (int64_t e = 0; e < c.batch; ++e)
      for (int64_t r = 0; r < c.m; ++r)
        for (int64_t col = 0; col < c.n; ++col) {
          const size_t i = static_cast<size_t>((e * c.m + r) * c.n + col);
          want[i] = reference(a, b, b_lo, c, lda, ldb, e, r, col, &scale[i]);
        }
    if (!c.f32) {
      expect_bf16_near(out16.download(), want, scale, "dense_gemm bf16");
      continue;
    }
    const std::vector<float> got = out32.download();
    int reported = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double bound = 1e-4 * (std::fabs(want[i]) + scale[i]) + 1e-30;
      if (!(std::fabs(got[i] - want[i]) <= bound) && reported++ < 5)
        ADD_FAILURE() << "c[" << i << "] = " << got[i] << ", want " << want[i];
    }
  }
}

// c of rows [first, first + m) of `rows` ([*, K] bf16 on the device), float32.
std::vector<float> product(const DeviceBuffer<uint16_t>& rows, int64_t first, int64_t m,
                           const DeviceBuffer<uint16_t>& w, int64_t n, int64_t k, DenseTile tile) {
  DeviceBuffer<float> out(static_cast<size_t>(m * n));
  out.poison();
  dense_gemm({.a = rows.as_bf16() + first * k,
              .b = w.as_bf16(),
              .c = out.get(),
              .m = m,
              .n = n,
              .k = k,
              .c_f32 = true,
              .tile = tile},
             nullptr);
  synchronize();
  return out.download();
}

void expect_same_bits(const float* got, const float* want, int64_t n, const std::string& what) {
  if (std::memcmp(got, want, static_cast<size_t>(n) * sizeof(float)) == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << ": first differing column " << i << ": " << got[i] << " vs "
                    << want[i] << " (alone)";
      return;
    }
  }
}

void rows_are_batch_invariant() {
  std::mt19937 rng(fresh_seed());
  for (const int64_t k : {64, 200, 2048}) {
    const int64_t n = 160, rows = 256;
    const DeviceBuffer<uint16_t> a(random_bf16(static_cast<size_t>(rows * k), rng));
    const DeviceBuffer<uint16_t> w(random_bf16(static_cast<size_t>(n * k), rng, 0.05f));
    // Row 5's output alone, then inside batches of other sizes and tiles, and at another index.
    const int64_t probe = 5;
    const std::vector<float> alone = product(a, probe, 1, w, n, k, DenseTile::kAuto);
    for (const int64_t m : {2, 7, 16, 17, 64, 200}) {
      for (const DenseTile tile : {DenseTile::kAuto, DenseTile::kRows16, DenseTile::kRows64}) {
        // Rows [first, first + m) with row 5 in them: from row 0, or ending at row 5 when m is
        // too short to reach it.
        const int64_t first = m > probe ? 0 : probe - m + 1;
        const std::vector<float> batch = product(a, first, m, w, n, k, tile);
        expect_same_bits(&batch[(probe - first) * n], alone.data(), n,
                         "k " + std::to_string(k) + ": row 5 of a batch of " + std::to_string(m) +
                             " rows, tile " + std::to_string(static_cast<int>(tile)));
      }
    }
    // The same row at index 4 of rows 1..100: another place in its tile, other batch mates.
    const std::vector<float> shifted = product(a, 1, 100, w, n, k, DenseTile::kRows64);
    expect_same_bits(&shifted[(probe - 1) * n], alone.data(), n,
                     "k " + std::to_string(k) + ": row 5 as row 4 of rows 1..100");
  }
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("dense GEMM")) return false;
  register_kernel_test("CudaDenseGemm", "MatchesTheReference", matches_the_reference, __FILE__,
                       __LINE__);
  register_kernel_test("CudaDenseGemm", "RowsAreBatchInvariant", rows_are_batch_invariant, __FILE__,
                       __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
