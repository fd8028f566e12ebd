// The decoder's glue kernels (backend/cuda/decoder_ops.h) against CPU loops: fresh random inputs
// every run (MOE_TEST_SEED replays one), whole buffers compared so that a write outside the rows
// (row padding, guard elements past the end, skipped cache slots) fails as surely as a wrong
// value, outputs that are not in place poisoned with 0xFF bytes (NaN in bf16) first, odd widths
// and misaligned sub-rows that take the element-wise paths beside the 16-byte-vector ones.
//
// Tolerances:
// - kv_cache_write, bias_clip, random_fill: bit-exact. They copy, or do one float32 add and a
//   clamp, or the documented hash and one fma, before a round-to-nearest-even bf16 store, which
//   the CPU reproduces operation for operation.
// - strided_rms_norm, silu_mul, sigmoid_scale_rows against a float64 reference:
//   |got - want| <= (2^-8 + 2e-5) |want| + FLT_MIN: half a bf16 unit (the rounding itself) plus
//   float32 error in exp, sqrt and the sum of squares. None of the three cancels, so the bound is
//   relative to each element, far inside the 1e-2 bf16 contract of CONVENTIONS.md.
// Elements a kernel must not touch are compared bit for bit.
//
// Host-side argument checks are ordinary TESTs that run without a GPU; the kernel tests are
// registered only when a device is present (cuda_stages_test.cpp explains the pattern). A slot
// past num_slots traps on the device (MOE_DEVICE_CHECK), which would end the CUDA context of
// the whole test binary, so that path is not exercised here.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decoder_ops.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using bf16 = __nv_bfloat16;
using testing_util::cuda_device_present;
using testing_util::DeviceBuffer;
using testing_util::expect_error_naming;
using testing_util::fresh_seed;
using testing_util::random_bf16;
using testing_util::register_kernel_test;
using testing_util::synchronize;

constexpr uint16_t kPoison = 0xFFFF;  // cudaMemset(0xFF) in bf16: a NaN

// ---------------------------------------------------------------------------------------------
// Host-side checks: always registered, need no device. Each refusal happens before any CUDA
// call, and a call with nothing to do returns without looking at its pointers.

TEST(CudaDecoderOpsChecks, KvCacheWriteRefusesBadArguments) {
  alignas(16) uint16_t rows[64] = {};
  int32_t slots[4] = {};
  KvWriteParams p{.src = reinterpret_cast<const bf16*>(rows),
                  .cache = reinterpret_cast<bf16*>(rows),
                  .slots = slots,
                  .num_tokens = 2,
                  .width = 12,
                  .src_stride = 16,
                  .num_slots = 4};
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "width = 12");
  p.width = 0;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "width = 0");
  p.width = 16;
  p.src_stride = 8;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "src_stride = 8");
  p.src_stride = 20;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "src_stride = 20");
  p.src_stride = 16;
  p.num_tokens = -1;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "num_tokens = -1");
  p.num_tokens = std::numeric_limits<int32_t>::max();
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "does not fit in 32 bits");
  p.num_tokens = 2;
  p.num_slots = -3;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "num_slots = -3");
  p.num_slots = 4;
  p.slots = nullptr;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "slots is null");
  p.slots = slots;
  p.src = nullptr;
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "src is null");
  p.src = reinterpret_cast<const bf16*>(rows + 4);
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "src (");
  p.src = reinterpret_cast<const bf16*>(rows);
  p.cache = reinterpret_cast<bf16*>(rows + 1);
  expect_error_naming([&] { kv_cache_write(p, nullptr); }, "cache (");
  kv_cache_write(KvWriteParams{.num_tokens = 0, .width = 8, .src_stride = 8}, nullptr);
}

TEST(CudaDecoderOpsChecks, BiasClipRefusesBadArguments) {
  alignas(16) uint16_t rows[64] = {};
  BiasClipParams p{.x = reinterpret_cast<bf16*>(rows),
                   .bias = reinterpret_cast<const bf16*>(rows),
                   .rows = 2,
                   .width = 0,
                   .stride = 16};
  expect_error_naming([&] { bias_clip(p, nullptr); }, "width = 0");
  p.width = 24;
  expect_error_naming([&] { bias_clip(p, nullptr); }, "stride = 16");
  p.width = 16;
  p.rows = -2;
  expect_error_naming([&] { bias_clip(p, nullptr); }, "rows = -2");
  p.rows = std::numeric_limits<int32_t>::max();
  expect_error_naming([&] { bias_clip(p, nullptr); }, "rows * width");
  p.rows = 2;
  p.clip = std::nanf("");
  expect_error_naming([&] { bias_clip(p, nullptr); }, "clip is NaN");
  p.clip = 0.0f;
  p.x = nullptr;
  expect_error_naming([&] { bias_clip(p, nullptr); }, "x is null");
  bias_clip(BiasClipParams{.rows = 0, .width = 24, .stride = 24}, nullptr);
}

TEST(CudaDecoderOpsChecks, StridedRmsNormRefusesBadArguments) {
  alignas(16) uint16_t rows[64] = {};
  StridedRmsNormParams p{.x = reinterpret_cast<bf16*>(rows),
                         .weight = reinterpret_cast<const bf16*>(rows),
                         .rows = 4,
                         .width = 0,
                         .stride = 8};
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "width = 0");
  p.width = 12;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "stride = 8");
  p.width = 8;
  p.rows = -4;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "rows = -4");
  p.rows = 4;
  p.eps = -1.0f;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "eps = -1");
  p.eps = 1e-6f;
  p.rows_per_token = 0;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "rows_per_token = 0");
  p.rows_per_token = 3;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "rows = 4");
  p.rows_per_token = 2;
  p.token_stride = 15;  // the second row of a token ends at 8 + 8 = 16
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "token_stride = 15");
  p.token_stride = 0;
  p.mean_width = 9;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "mean_width = 9");
  p.mean_width = -1;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "mean_width = -1");
  p.mean_width = 0;
  p.weight = nullptr;
  expect_error_naming([&] { strided_rms_norm(p, nullptr); }, "weight is null");
  strided_rms_norm(StridedRmsNormParams{.rows = 0, .width = 128, .stride = 128}, nullptr);
}

TEST(CudaDecoderOpsChecks, SiluMulRefusesBadArguments) {
  alignas(16) uint16_t rows[64] = {};
  SiluMulParams p{.gate_up = reinterpret_cast<const bf16*>(rows),
                  .out = reinterpret_cast<bf16*>(rows),
                  .num_tokens = 2,
                  .width = 0};
  expect_error_naming([&] { silu_mul(p, nullptr); }, "width = 0");
  p.width = 8;
  p.num_tokens = -7;
  expect_error_naming([&] { silu_mul(p, nullptr); }, "num_tokens = -7");
  p.num_tokens = std::numeric_limits<int32_t>::max();
  expect_error_naming([&] { silu_mul(p, nullptr); }, "num_tokens * width");
  p.num_tokens = 2;
  p.out = nullptr;
  expect_error_naming([&] { silu_mul(p, nullptr); }, "out is null");
  silu_mul(SiluMulParams{.num_tokens = 0, .width = 13}, nullptr);
}

TEST(CudaDecoderOpsChecks, SigmoidScaleRowsRefusesBadArguments) {
  alignas(16) uint16_t rows[64] = {};
  float logits[2] = {};
  SigmoidScaleParams p{
      .x = reinterpret_cast<bf16*>(rows), .logits = logits, .num_tokens = 2, .hidden_size = 0};
  expect_error_naming([&] { sigmoid_scale_rows(p, nullptr); }, "hidden_size = 0");
  p.hidden_size = 8;
  p.num_tokens = -1;
  expect_error_naming([&] { sigmoid_scale_rows(p, nullptr); }, "num_tokens = -1");
  p.num_tokens = 2;
  p.logits = nullptr;
  expect_error_naming([&] { sigmoid_scale_rows(p, nullptr); }, "logits is null");
  sigmoid_scale_rows(SigmoidScaleParams{.num_tokens = 0, .hidden_size = 8}, nullptr);
}

TEST(CudaDecoderOpsChecks, RandomFillRefusesBadArguments) {
  alignas(16) uint16_t rows[64] = {};
  RandomFillParams p{.out = reinterpret_cast<bf16*>(rows), .count = -5};
  expect_error_naming([&] { random_fill(p, nullptr); }, "count = -5");
  p.count = 8;
  p.scale = -1.0f;
  expect_error_naming([&] { random_fill(p, nullptr); }, "scale = -1");
  p.scale = std::numeric_limits<float>::infinity();
  expect_error_naming([&] { random_fill(p, nullptr); }, "scale = inf");
  p.scale = 1.0f;
  p.offset = std::nanf("");
  expect_error_naming([&] { random_fill(p, nullptr); }, "offset = nan");
  p.offset = 0.0f;
  p.out = reinterpret_cast<bf16*>(reinterpret_cast<char*>(rows) + 1);
  expect_error_naming([&] { random_fill(p, nullptr); }, "2-byte aligned");
  p.out = nullptr;
  expect_error_naming([&] { random_fill(p, nullptr); }, "out is null");
  random_fill(RandomFillParams{.count = 0}, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Kernel tests: registered only when a device is present.

uint32_t case_seed(std::initializer_list<int64_t> values) {
  uint32_t seed = fresh_seed();
  for (int64_t v : values) seed = seed * 1000003u ^ static_cast<uint32_t>(v * 2654435761u);
  return seed;
}

// Bit-exact comparison of whole buffers.
void expect_bits_equal(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                       const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ++mismatches;
      if (reported++ < 5)
        ADD_FAILURE() << what << "[" << i << "] = 0x" << std::hex << got[i] << " ("
                      << bf16_to_f32(got[i]) << "), want 0x" << want[i] << " ("
                      << bf16_to_f32(want[i]) << ")" << std::dec;
    }
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << got.size();
}

// A whole buffer after an in-place or output kernel: where `touched` is set, within
// (2^-8 + 2e-5) |want| of the float64 reference, plus FLT_MIN for results that underflow float32
// (silu(-100) = -100 / (1 + inf) = 0 there); NaN fails. Elsewhere bit-identical to `before`.
void expect_written_near(const std::vector<uint16_t>& got, const std::vector<uint16_t>& before,
                         const std::vector<double>& want, const std::vector<char>& touched,
                         const char* what) {
  ASSERT_EQ(got.size(), before.size()) << what;
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(got.size(), touched.size()) << what;
  int reported = 0;
  size_t mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    bool ok;
    double bound = 0.0;
    if (touched[i]) {
      bound = (std::ldexp(1.0, -8) + 2e-5) * std::fabs(want[i]) + std::numeric_limits<float>::min();
      ok = std::fabs(static_cast<double>(bf16_to_f32(got[i])) - want[i]) <= bound;
    } else {
      ok = got[i] == before[i];
    }
    if (!ok) {
      ++mismatches;
      if (reported++ < 5) {
        if (touched[i]) {
          ADD_FAILURE() << what << "[" << i << "] = " << bf16_to_f32(got[i]) << ", want " << want[i]
                        << " (bound " << bound << ")";
        } else {
          ADD_FAILURE() << what << "[" << i << "] = 0x" << std::hex << got[i]
                        << " was written; it must stay 0x" << before[i] << std::dec;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0u) << what << ": " << mismatches << " of " << got.size();
}

// ---- kv_cache_write

// T source rows at src_offset + t * src_stride; slots a random injective map into
// [0, num_slots) with every fifth token padding (a negative slot).
void kv_write_case(int64_t T, int64_t width, int64_t src_stride, int64_t src_offset,
                   int64_t num_slots) {
  SCOPED_TRACE(::testing::Message()
               << "T=" << T << " width=" << width << " src_stride=" << src_stride
               << " src_offset=" << src_offset << " num_slots=" << num_slots);
  ASSERT_GE(num_slots, T);
  std::mt19937 rng(case_seed({T, width, src_stride, src_offset, num_slots}));
  const std::vector<uint16_t> src = random_bf16(src_offset + T * src_stride + 8, rng);
  std::vector<int32_t> free_slots(num_slots);
  std::iota(free_slots.begin(), free_slots.end(), 0);
  std::shuffle(free_slots.begin(), free_slots.end(), rng);
  std::vector<int32_t> slots(T);
  for (int64_t t = 0; t < T; ++t)
    slots[t] = t % 5 == 3 ? -1 - static_cast<int32_t>(t) : free_slots[t];
  const int64_t cache_elems = num_slots * width + 8;  // 8 guard elements past the last slot
  std::vector<uint16_t> want(cache_elems, kPoison);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    std::copy_n(src.begin() + src_offset + t * src_stride, width,
                want.begin() + static_cast<int64_t>(slots[t]) * width);
  }

  DeviceBuffer<uint16_t> d_src(src), d_cache(cache_elems);
  DeviceBuffer<int32_t> d_slots(slots);
  d_cache.poison();
  kv_cache_write({.src = d_src.as_bf16() + src_offset,
                  .cache = d_cache.as_bf16(),
                  .slots = d_slots.get(),
                  .num_tokens = T,
                  .width = width,
                  .src_stride = src_stride,
                  .num_slots = num_slots},
                 nullptr);
  synchronize();
  expect_bits_equal(d_cache.download(), want, "cache");
}

void kv_write_all() {
  kv_write_case(1, 8, 8, 0, 4);
  kv_write_case(19, 40, 64, 8, 64);            // a sub-row of a wider projection
  kv_write_case(99, 576, 576, 0, 256);         // MLA: latent + rope key, one row per token
  kv_write_case(989, 1024, 3072, 2048, 1024);  // GQA: the V third of a fused qkv row
  kv_write_case(4096, 128, 640, 128, 8192);
}

// ---- bias_clip

void bias_clip_case(int64_t rows, int64_t width, int64_t stride, int64_t offset, bool with_bias,
                    float clip) {
  SCOPED_TRACE(::testing::Message()
               << "rows=" << rows << " width=" << width << " stride=" << stride
               << " offset=" << offset << " bias=" << with_bias << " clip=" << clip);
  std::mt19937 rng(case_seed({rows, width, stride, offset, with_bias, static_cast<int64_t>(clip)}));
  const std::vector<uint16_t> x = random_bf16(offset + rows * stride + 8, rng, 2.0f);
  const std::vector<uint16_t> bias = random_bf16(width + 1, rng);
  const int64_t bias_offset = offset % 2;  // misaligned x comes with misaligned bias
  std::vector<uint16_t> want = x;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const int64_t i = offset + r * stride + c;
      float v = bf16_to_f32(x[i]);
      if (with_bias) v += bf16_to_f32(bias[bias_offset + c]);
      if (clip > 0.0f) v = std::clamp(v, -clip, clip);
      want[i] = f32_to_bf16(v);
    }
  }

  DeviceBuffer<uint16_t> d_x(x), d_bias(bias);
  bias_clip({.x = d_x.as_bf16() + offset,
             .bias = with_bias ? d_bias.as_bf16() + bias_offset : nullptr,
             .rows = rows,
             .width = width,
             .stride = stride,
             .clip = clip},
            nullptr);
  synchronize();
  expect_bits_equal(d_x.download(), want, "x");
}

void bias_clip_all() {
  for (int64_t width : {24, 32, 40, 64}) {
    bias_clip_case(19, width, width, 0, true, 0.0f);
    bias_clip_case(19, width, width, 0, false, 1.0f);
    bias_clip_case(19, width, width + 16, 8, true, 1.5f);
  }
  bias_clip_case(1, 8, 8, 0, true, 0.5f);
  bias_clip_case(99, 7, 7, 0, true, 1.0f);  // odd width: element-wise
  bias_clip_case(19, 13, 20, 3, true, 0.0f);
  bias_clip_case(19, 32, 40, 1, true, 1.0f);  // misaligned rows: element-wise
  bias_clip_case(989, 4096, 4096, 0, true, 0.0f);
  bias_clip_case(4, 2560, 2560, 0, false, 8.0f);  // clip only, most values inside
}

// ---- strided_rms_norm

struct NormCase {
  int64_t tokens;
  int64_t rows_per_token;
  int64_t width;
  int64_t stride;
  int64_t token_stride;  // 0: the launcher's default, rows_per_token * stride
  int64_t offset;        // elements from the buffer's (aligned) start to x
  int64_t head_dim = 0;  // > 0: padded heads of head_dim real columns per `pad_to`; the rest
  int64_t pad_to = 0;    //   zero and mean_width = (width / pad_to) * head_dim
  bool weight_lo = false;  // a second weight term of its own random values (added to weight)
};

void strided_rms_norm_case(const NormCase& nc) {
  SCOPED_TRACE(::testing::Message()
               << "tokens=" << nc.tokens << " rows_per_token=" << nc.rows_per_token
               << " width=" << nc.width << " stride=" << nc.stride
               << " token_stride=" << nc.token_stride << " offset=" << nc.offset
               << " head_dim=" << nc.head_dim << " pad_to=" << nc.pad_to
               << " weight_lo=" << nc.weight_lo);
  std::mt19937 rng(case_seed({nc.tokens, nc.rows_per_token, nc.width, nc.stride, nc.token_stride,
                              nc.offset, nc.head_dim}));
  const int64_t rows = nc.tokens * nc.rows_per_token;
  const int64_t token_stride = nc.token_stride ? nc.token_stride : nc.rows_per_token * nc.stride;
  const int64_t mean_width = nc.head_dim ? nc.width / nc.pad_to * nc.head_dim : nc.width;
  const float eps = 1e-6f;
  auto row_start = [&](int64_t r) {
    return nc.offset + (r / nc.rows_per_token) * token_stride + (r % nc.rows_per_token) * nc.stride;
  };
  const int64_t size = row_start(rows - 1) + nc.width + 8;
  std::vector<uint16_t> x = random_bf16(size, rng, 1.5f);
  const std::vector<uint16_t> weight_bits = random_bf16(nc.width + 1, rng, 0.5f);
  const std::vector<uint16_t> lo_bits =
      nc.weight_lo ? random_bf16(nc.width + 1, rng, 0.5f) : std::vector<uint16_t>{};
  const int64_t weight_offset = nc.offset % 2;  // misaligned x comes with a misaligned weight
  if (nc.head_dim) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < nc.width; ++c)
        if (c % nc.pad_to >= nc.head_dim) x[row_start(r) + c] = 0;
  }
  std::vector<double> want(size, 0.0);
  std::vector<char> touched(size, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = row_start(r);
    double sum_sq = 0.0;
    for (int64_t c = 0; c < nc.width; ++c) {
      const double v = bf16_to_f32(x[s + c]);
      sum_sq += v * v;
    }
    const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(mean_width) + eps);
    for (int64_t c = 0; c < nc.width; ++c) {
      ASSERT_FALSE(touched[s + c]) << "rows overlap at " << s + c;
      touched[s + c] = 1;
      const double w =
          static_cast<double>(bf16_to_f32(weight_bits[weight_offset + c])) +
          (nc.weight_lo ? static_cast<double>(bf16_to_f32(lo_bits[weight_offset + c])) : 0.0);
      want[s + c] = w * bf16_to_f32(x[s + c]) * inv_rms;
    }
  }

  DeviceBuffer<uint16_t> d_x(x), d_weight(weight_bits), d_lo(lo_bits);
  strided_rms_norm({.x = d_x.as_bf16() + nc.offset,
                    .weight = d_weight.as_bf16() + weight_offset,
                    .weight_lo = nc.weight_lo ? d_lo.as_bf16() + weight_offset : nullptr,
                    .rows = rows,
                    .width = nc.width,
                    .stride = nc.stride,
                    .eps = eps,
                    .rows_per_token = nc.rows_per_token,
                    .token_stride = nc.token_stride,
                    .mean_width = nc.head_dim ? mean_width : 0},
                   nullptr);
  synchronize();
  expect_written_near(d_x.download(), x, want, touched, "x");
}

void strided_rms_norm_short_rows() {
  // Plain rows, one warp each: the fixtures' widths, then odd ones (element-wise loads).
  for (int64_t width : {8, 16, 24, 32, 128, 1024})
    strided_rms_norm_case({.tokens = 19,
                           .rows_per_token = 1,
                           .width = width,
                           .stride = width,
                           .token_stride = 0,
                           .offset = 0});
  for (int64_t width : {1, 7, 33, 100, 1023})
    strided_rms_norm_case({.tokens = 19,
                           .rows_per_token = 1,
                           .width = width,
                           .stride = width + 3,
                           .token_stride = 0,
                           .offset = 0});
  // Per-head q and k norms inside a fused qkv row of (4 + 2 * 2) heads of 128.
  for (int64_t tokens : {1, 19, 989}) {
    strided_rms_norm_case({.tokens = tokens,
                           .rows_per_token = 4,
                           .width = 128,
                           .stride = 128,
                           .token_stride = 1024,
                           .offset = 0});
    strided_rms_norm_case({.tokens = tokens,
                           .rows_per_token = 2,
                           .width = 128,
                           .stride = 128,
                           .token_stride = 1024,
                           .offset = 512});
  }
  // Heads padded from 64 to 72 columns, the padding left alone; 4096 tokens * 16 heads.
  strided_rms_norm_case({.tokens = 4096,
                         .rows_per_token = 16,
                         .width = 64,
                         .stride = 72,
                         .token_stride = 16 * 72 + 8,
                         .offset = 8});
  // MLA's latent norm: 512 of each 576-wide cache row.
  strided_rms_norm_case({.tokens = 99,
                         .rows_per_token = 1,
                         .width = 512,
                         .stride = 576,
                         .token_stride = 0,
                         .offset = 0});
  // Weights in two terms: per-head rows (vectors), a misaligned sub-row (elements), and a row
  // long enough for a block.
  strided_rms_norm_case({.tokens = 19, .rows_per_token = 4, .width = 128, .stride = 128,
                         .token_stride = 1024, .offset = 0, .weight_lo = true});
  strided_rms_norm_case({.tokens = 19, .rows_per_token = 3, .width = 100, .stride = 128,
                         .token_stride = 512, .offset = 1, .weight_lo = true});
  strided_rms_norm_case({.tokens = 7, .rows_per_token = 1, .width = 2056, .stride = 2056,
                         .token_stride = 0, .offset = 0, .weight_lo = true});
  // A misaligned sub-row: element-wise path at a vector-friendly width.
  strided_rms_norm_case({.tokens = 19,
                         .rows_per_token = 3,
                         .width = 128,
                         .stride = 128,
                         .token_stride = 512,
                         .offset = 1});
}

void strided_rms_norm_long_rows() {
  // One block per row: q_lora, odd widths, the widest rows, and more than 1024 vectors.
  for (int64_t width : {1032, 1536, 8192, 12288})
    strided_rms_norm_case({.tokens = 19,
                           .rows_per_token = 1,
                           .width = width,
                           .stride = width,
                           .token_stride = 0,
                           .offset = 0});
  strided_rms_norm_case({.tokens = 1,
                         .rows_per_token = 1,
                         .width = 1536,
                         .stride = 1536,
                         .token_stride = 0,
                         .offset = 0});
  for (int64_t width : {1025, 4099, 40000})
    strided_rms_norm_case({.tokens = 5,
                           .rows_per_token = 1,
                           .width = width,
                           .stride = width + 1,
                           .token_stride = 0,
                           .offset = 3});
  // Whole-projection q norm over 16 heads padded from 120 to 128 columns (mean over 1920).
  strided_rms_norm_case({.tokens = 19,
                         .rows_per_token = 1,
                         .width = 2048,
                         .stride = 3072,
                         .token_stride = 0,
                         .offset = 0,
                         .head_dim = 120,
                         .pad_to = 128});
  // The same below the warp limit: 4 heads, width 512, mean over 480.
  strided_rms_norm_case({.tokens = 99,
                         .rows_per_token = 1,
                         .width = 512,
                         .stride = 768,
                         .token_stride = 0,
                         .offset = 0,
                         .head_dim = 120,
                         .pad_to = 128});
}

// ---- silu_mul

void silu_mul_case(int64_t T, int64_t I, int64_t offset) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " I=" << I << " offset=" << offset);
  std::mt19937 rng(case_seed({T, I, offset}));
  std::vector<uint16_t> gate_up = random_bf16(offset + T * 2 * I, rng, 3.0f);
  // A few extreme gates: exp(-g) overflows or underflows.
  for (int64_t k = 0; k < std::min<int64_t>(T * I, 16); ++k) {
    const int64_t t = static_cast<int64_t>(rng() % T), i = static_cast<int64_t>(rng() % I);
    gate_up[offset + t * 2 * I + i] = f32_to_bf16(k % 2 ? 100.0f : -100.0f);
  }
  const int64_t out_elems = T * I + 8;
  std::vector<uint16_t> before(out_elems, kPoison);
  std::vector<double> want(out_elems, 0.0);
  std::vector<char> touched(out_elems, 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; ++i) {
      const double g = bf16_to_f32(gate_up[offset + t * 2 * I + i]);
      const double u = bf16_to_f32(gate_up[offset + t * 2 * I + I + i]);
      want[t * I + i] = g / (1.0 + std::exp(-g)) * u;
      touched[t * I + i] = 1;
    }
  }

  DeviceBuffer<uint16_t> d_gate_up(gate_up), d_out(out_elems + offset);
  d_out.poison();
  silu_mul({.gate_up = d_gate_up.as_bf16() + offset,
            .out = d_out.as_bf16() + offset,
            .num_tokens = T,
            .width = I},
           nullptr);
  synchronize();
  std::vector<uint16_t> got = d_out.download();
  for (int64_t k = 0; k < offset; ++k) EXPECT_EQ(got[k], kPoison) << "written before out";
  got.erase(got.begin(), got.begin() + offset);
  expect_written_near(got, before, want, touched, "out");
}

void silu_mul_all() {
  for (int64_t T : {1, 19, 99})
    for (int64_t I : {8, 24, 7, 13, 768, 1408}) silu_mul_case(T, I, 0);
  silu_mul_case(19, 64, 1);  // misaligned: element-wise
  silu_mul_case(989, 1536, 0);
}

// ---- sigmoid_scale_rows

void sigmoid_scale_case(int64_t T, int64_t H, int64_t offset) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " H=" << H << " offset=" << offset);
  std::mt19937 rng(case_seed({T, H, offset}));
  const std::vector<uint16_t> x = random_bf16(offset + T * H + 8, rng);
  std::normal_distribution<float> logit_dist(0.0f, 4.0f);
  std::vector<float> logits(T);
  for (auto& l : logits) l = logit_dist(rng);
  if (T > 2) {  // saturated gates
    logits[0] = 60.0f;
    logits[1] = -60.0f;
  }
  std::vector<double> want(x.size(), 0.0);
  std::vector<char> touched(x.size(), 0);
  for (int64_t t = 0; t < T; ++t) {
    const double gate = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[t])));
    for (int64_t h = 0; h < H; ++h) {
      const int64_t i = offset + t * H + h;
      want[i] = bf16_to_f32(x[i]) * gate;
      touched[i] = 1;
    }
  }

  DeviceBuffer<uint16_t> d_x(x);
  DeviceBuffer<float> d_logits(logits);
  sigmoid_scale_rows(
      {.x = d_x.as_bf16() + offset, .logits = d_logits.get(), .num_tokens = T, .hidden_size = H},
      nullptr);
  synchronize();
  expect_written_near(d_x.download(), x, want, touched, "x");
}

void sigmoid_scale_all() {
  for (int64_t T : {1, 19, 99})
    for (int64_t H : {8, 2048, 13, 1000}) sigmoid_scale_case(T, H, 0);
  sigmoid_scale_case(19, 2048, 1);  // misaligned: element-wise
  sigmoid_scale_case(989, 3584, 0);
}

// ---- random_fill

uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The formula written out in decoder_ops_kernel.cuh.
uint16_t random_fill_reference(uint64_t seed, int64_t i, float scale, float offset) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  const uint64_t key = splitmix64_mix(seed + kGolden);
  const uint64_t h = splitmix64_mix(key + (static_cast<uint64_t>(i >> 1) + 1) * kGolden);
  const uint32_t bits = (i & 1) ? static_cast<uint32_t>(h >> 32) : static_cast<uint32_t>(h);
  const float u = static_cast<float>(bits >> 8) * 0x1p-24f;
  return f32_to_bf16(std::fma(2.0f * u - 1.0f, scale, offset));
}

// Every start alignment (0..7 elements past a 16-byte boundary) and counts around the vector
// size: the head, body and tail of the kernel against the formula, guards untouched.
void random_fill_exact() {
  const uint64_t seed = fresh_seed() * 1000003ull + 17;
  for (int64_t count : {1, 5, 7, 8, 9, 100, 1000003}) {
    for (int64_t start = 0; start < 8; ++start) {
      SCOPED_TRACE(::testing::Message() << "count=" << count << " start=" << start);
      const float scale = start % 2 ? 0.02f : 1.0f;
      const float offset = start % 3 == 0 ? 1.0f : 0.0f;
      const int64_t size = start + count + 16;
      std::vector<uint16_t> want(size, kPoison);
      for (int64_t i = 0; i < count; ++i)
        want[start + i] = random_fill_reference(seed, i, scale, offset);
      DeviceBuffer<uint16_t> d_out(size);
      d_out.poison();
      random_fill({.out = d_out.as_bf16() + start,
                   .count = count,
                   .seed = seed,
                   .scale = scale,
                   .offset = offset},
                  nullptr);
      synchronize();
      expect_bits_equal(d_out.download(), want, "out");
    }
  }
}

// A fill much larger than one grid-stride pass: in range, mean and variance of a uniform
// distribution, and another seed gives other values.
void random_fill_statistics() {
  const int64_t count = (int64_t{3} << 24) + 5;
  const uint64_t seed = fresh_seed();
  const float scale = 0.5f, offset = 1.0f;
  DeviceBuffer<uint16_t> d_a(count), d_b(count);
  random_fill(
      {.out = d_a.as_bf16(), .count = count, .seed = seed, .scale = scale, .offset = offset},
      nullptr);
  random_fill(
      {.out = d_b.as_bf16(), .count = count, .seed = seed + 1, .scale = scale, .offset = offset},
      nullptr);
  synchronize();
  const std::vector<uint16_t> a = d_a.download(), b = d_b.download();
  double sum = 0.0, sum_sq = 0.0, lo = 1e30, hi = -1e30;
  int64_t same = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double v = bf16_to_f32(a[i]) - offset;
    sum += v;
    sum_sq += v * v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
    same += a[i] == b[i];
  }
  const double mean = sum / count, var = sum_sq / count - mean * mean;
  // Rounding to bf16 around 1.0 (spacing 2^-7) can move a value by 2^-8 either way.
  EXPECT_GE(lo, -scale - 0x1p-8);
  EXPECT_LE(hi, scale + 0x1p-8);
  EXPECT_LT(lo, -0.99 * scale);
  EXPECT_GT(hi, 0.99 * scale);
  EXPECT_NEAR(mean, 0.0, 1e-3 * scale);
  EXPECT_NEAR(var, scale * scale / 3.0, 0.01 * scale * scale / 3.0);
  EXPECT_LT(static_cast<double>(same) / count, 0.05) << "seeds " << seed << " and " << seed + 1;
  // Spot-check the formula far into the buffer (the grid-stride iterations).
  for (int64_t i : {count - 1, count / 2 + 3, int64_t{8} * 4096 * 256 + 1})
    EXPECT_EQ(a[i], random_fill_reference(seed, i, scale, offset)) << "index " << i;
}

// ---- all six in a CUDA graph

// The launchers enqueue only kernels: captured in global mode (which refuses any call that
// would synchronise with the host) and replayed, they give the eager results bit for bit.
void captured_in_graph() {
  const int64_t T = 19, heads = 4, D = 128, row = 8 * D, I = 96, slots = 64;
  std::mt19937 rng(case_seed({T, 7}));
  std::vector<int32_t> slot_ids(T);
  for (int64_t t = 0; t < T; ++t) slot_ids[t] = t % 4 == 1 ? -1 : static_cast<int32_t>(3 * t);
  std::vector<float> logits(T);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (auto& l : logits) l = dist(rng);
  const std::vector<uint16_t> bias = random_bf16(row, rng);
  const std::vector<uint16_t> norm_weight = random_bf16(D, rng);
  DeviceBuffer<int32_t> d_slots(slot_ids);
  DeviceBuffer<float> d_logits(logits);
  DeviceBuffer<uint16_t> d_bias(bias), d_norm_weight(norm_weight);

  struct Outputs {
    std::vector<uint16_t> qkv, cache, act;
  };
  auto run = [&](bool in_graph) {
    DeviceBuffer<uint16_t> qkv(T * row), cache(slots * 2 * D), gate_up(T * 2 * I), act(T * I);
    cache.poison();
    act.poison();
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    if (in_graph) CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    random_fill({.out = qkv.as_bf16(), .count = T * row, .seed = 5, .scale = 2.0f}, stream);
    random_fill({.out = gate_up.as_bf16(), .count = T * 2 * I, .seed = 6, .scale = 3.0f}, stream);
    bias_clip(
        {.x = qkv.as_bf16(), .bias = d_bias.as_bf16(), .rows = T, .width = row, .stride = row},
        stream);
    strided_rms_norm({.x = qkv.as_bf16(),
                      .weight = d_norm_weight.as_bf16(),
                      .rows = T * heads,
                      .width = D,
                      .stride = D,
                      .rows_per_token = heads,
                      .token_stride = row},
                     stream);
    bias_clip({.x = qkv.as_bf16(), .rows = T, .width = row, .stride = row, .clip = 1.0f}, stream);
    kv_cache_write({.src = qkv.as_bf16() + heads * D,
                    .cache = cache.as_bf16(),
                    .slots = d_slots.get(),
                    .num_tokens = T,
                    .width = 2 * D,
                    .src_stride = row,
                    .num_slots = slots},
                   stream);
    silu_mul({.gate_up = gate_up.as_bf16(), .out = act.as_bf16(), .num_tokens = T, .width = I},
             stream);
    sigmoid_scale_rows(
        {.x = act.as_bf16(), .logits = d_logits.get(), .num_tokens = T, .hidden_size = I}, stream);
    if (in_graph) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      CUDA_CHECK(cudaGraphExecDestroy(exec));
      CUDA_CHECK(cudaGraphDestroy(graph));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));
    CUDA_CHECK(cudaStreamDestroy(stream));
    return Outputs{qkv.download(), cache.download(), act.download()};
  };
  const Outputs eager = run(false);
  const Outputs graph = run(true);
  expect_bits_equal(graph.qkv, eager.qkv, "qkv");
  expect_bits_equal(graph.cache, eager.cache, "cache");
  expect_bits_equal(graph.act, eager.act, "act");
  // The chain did something: no NaN left in the activations, written cache rows not poison.
  for (uint16_t v : eager.act) ASSERT_FALSE(std::isnan(bf16_to_f32(v)));
  EXPECT_NE(eager.cache[0], kPoison);          // token 0 -> slot 0
  EXPECT_EQ(eager.cache[3 * 2 * D], kPoison);  // token 1 is padding; slot 3 stays unwritten
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("decoder ops")) return false;
  auto reg = [](const char* suite, const std::string& name, std::function<void()> body) {
    register_kernel_test(suite, name, std::move(body), __FILE__, __LINE__);
  };
  reg("CudaKvCacheWrite", "MatchesCopyWithSkippedSlots", [] { kv_write_all(); });
  reg("CudaBiasClip", "MatchesFloat32", [] { bias_clip_all(); });
  reg("CudaStridedRmsNorm", "ShortRowsMatchFloat64", [] { strided_rms_norm_short_rows(); });
  reg("CudaStridedRmsNorm", "LongRowsMatchFloat64", [] { strided_rms_norm_long_rows(); });
  reg("CudaSiluMul", "MatchesFloat64", [] { silu_mul_all(); });
  reg("CudaSigmoidScaleRows", "MatchesFloat64", [] { sigmoid_scale_all(); });
  reg("CudaRandomFill", "MatchesFormulaAtEveryAlignment", [] { random_fill_exact(); });
  reg("CudaRandomFill", "UniformAndSeeded", [] { random_fill_statistics(); });
  reg("CudaDecoderOps", "CapturedInGraph", [] { captured_in_graph(); });
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
