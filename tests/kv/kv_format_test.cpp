// The KV pool's row formats (--kv-dtype): f32 rows come back exactly, bf16 within half a bf16 ulp,
// fp8 within e4m3's half-ulp of each group's amax-derived scale; an all-zero group stays zero;
// MLA's latent and rope key keep separate scales; bytes per token count fp8's scales.
#include "kv/kv_format.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kv/kv_cache.h"

namespace moeinfer {
namespace {

std::vector<float> random_row(std::mt19937& rng, int64_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> row(n);
  for (float& v : row) v = dist(rng);
  return row;
}

// A pool of GQA shape: 3 layers (the middle one without rows), 5 heads of 19, blocks of 7.
KvBlockPool gqa_pool(KvDType dtype, int64_t num_blocks) {
  constexpr int64_t kHeads = 5, kD = 19;
  const std::vector<int64_t> heads(kHeads, kD);
  return KvBlockPool(3, kHeads * kD, kHeads * kD, 7, num_blocks,
                     KvPoolLayout{.layer_has_kv = {true, false, true},
                                  .dtype = dtype,
                                  .key_groups = heads,
                                  .value_groups = heads});
}

TEST(KvFormat, ParsesAndNamesEachDtype) {
  for (KvDType d : {KvDType::kF32, KvDType::kBF16, KvDType::kFP8}) {
    EXPECT_EQ(parse_kv_dtype(kv_dtype_name(d)), d);
  }
  EXPECT_THROW(parse_kv_dtype("fp16"), Error);
}

TEST(KvFormat, RowBytesCountScalesForFp8Only) {
  const std::vector<int64_t> groups = {4, 4, 4};
  EXPECT_EQ(kv_row_bytes(KvDType::kF32, groups), 48);
  EXPECT_EQ(kv_row_bytes(KvDType::kBF16, groups), 24);
  EXPECT_EQ(kv_row_bytes(KvDType::kFP8, groups), 12 + 3 * 4);
  EXPECT_EQ(kv_row_bytes(KvDType::kFP8, std::vector<int64_t>{}), 0);
}

TEST(KvBlockPool, RoundTripPerDtype) {
  const unsigned seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  constexpr int64_t kHeads = 5, kD = 19, kW = kHeads * kD, kBlocks = 3;
  for (KvDType dtype : {KvDType::kF32, KvDType::kBF16, KvDType::kFP8}) {
    KvBlockPool pool = gqa_pool(dtype, kBlocks);
    EXPECT_EQ(pool.dtype(), dtype);
    // Per (layer, block, slot): a row whose heads have very different magnitudes; head 2 of
    // every value row is zero.
    std::vector<std::vector<float>> keys, values;
    for (int64_t l : {0, 2}) {
      for (int64_t b = 0; b < kBlocks; ++b) {
        for (int64_t s = 0; s < pool.block_size(); ++s) {
          std::vector<float> k = random_row(rng, kW, 1.0f), v = random_row(rng, kW, 1.0f);
          for (int64_t h = 0; h < kHeads; ++h) {
            const float mag = std::pow(10.0f, static_cast<float>(h) - 2.0f);
            for (int64_t d = 0; d < kD; ++d) k[h * kD + d] *= mag, v[h * kD + d] *= mag;
          }
          std::fill_n(v.begin() + 2 * kD, kD, 0.0f);
          pool.write_key(l, b, s, k.data());
          pool.write_value(l, b, s, v.data());
          keys.push_back(std::move(k));
          values.push_back(std::move(v));
        }
      }
    }
    size_t i = 0;
    std::vector<float> scratch(kW, NAN);
    for (int64_t l : {0, 2}) {
      for (int64_t b = 0; b < kBlocks; ++b) {
        for (int64_t s = 0; s < pool.block_size(); ++s, ++i) {
          for (int64_t h = 0; h < kHeads; ++h) {
            for (bool is_key : {true, false}) {
              const std::vector<float>& want = is_key ? keys[i] : values[i];
              std::fill(scratch.begin(), scratch.end(), NAN);  // poisoned
              const float* got = is_key ? pool.read_key(l, b, s, h * kD, kD, scratch.data())
                                        : pool.read_value(l, b, s, h * kD, kD, scratch.data());
              float amax = 0.0f;
              for (int64_t d = 0; d < kD; ++d) amax = std::max(amax, std::fabs(want[h * kD + d]));
              for (int64_t d = 0; d < kD; ++d) {
                const float x = want[h * kD + d], y = got[d];
                switch (dtype) {
                  case KvDType::kF32:
                    ASSERT_EQ(x, y);
                    break;
                  case KvDType::kBF16:  // half an ulp of 8 significant bits
                    ASSERT_LE(std::fabs(x - y), std::fabs(x) * std::ldexp(1.0f, -8));
                    break;
                  case KvDType::kFP8:
                    // Half an e4m3 ulp (3 mantissa bits) of the value, or of the smallest normal
                    // times the head's scale where the value falls below it.
                    ASSERT_LE(std::fabs(x - y),
                              std::max(std::fabs(x) * 0.0625f,
                                       amax / kF8E4M3Max * std::ldexp(1.0f, -10)) *
                                  1.0001f)
                        << "head " << h << " amax " << amax;
                    break;
                }
                if (amax == 0.0f) ASSERT_EQ(y, 0.0f);  // the zero head decodes to exact zeros
              }
            }
          }
        }
      }
    }
  }
}

TEST(KvBlockPool, Fp8ReadsARangeAcrossGroups) {
  // MLA's row: a latent of 11 near 1 and a rope key of 5 near 100, each with its own scale, read
  // whole and in a range that straddles the two.
  const std::vector<int64_t> groups = {11, 5};
  KvBlockPool pool(1, 16, 0, 4, 1, KvPoolLayout{.dtype = KvDType::kFP8, .key_groups = groups});
  std::vector<float> row(16);
  for (int i = 0; i < 11; ++i) row[i] = 0.01f * static_cast<float>(i + 1);
  for (int i = 11; i < 16; ++i) row[i] = -100.0f * static_cast<float>(i - 10);
  pool.write_key(0, 0, 3, row.data());
  std::vector<float> whole(16), part(6);
  pool.read_key(0, 0, 3, 0, 16, whole.data());
  pool.read_key(0, 0, 3, 8, 6, part.data());
  for (int i = 0; i < 16; ++i) {
    EXPECT_NEAR(whole[i], row[i], std::fabs(row[i]) * 0.0625f) << i;
    if (i >= 8 && i < 14) EXPECT_EQ(part[i - 8], whole[i]) << i;
  }
  // The relative bound above holds for the latent's 0.01 only because it has its own scale: one
  // shared with the rope key (amax 500) would put it among e4m3's subnormals, 9% off.
  EXPECT_EQ(pool.bytes_per_token(), static_cast<size_t>(16 + 2 * 4));
}

TEST(KvBlockPool, BytesPerTokenPerDtype) {
  // 2 layers with rows of 5 heads of 19, keys and values.
  EXPECT_EQ(gqa_pool(KvDType::kF32, 1).bytes_per_token(), size_t{2 * 2 * 95 * 4});
  EXPECT_EQ(gqa_pool(KvDType::kBF16, 1).bytes_per_token(), size_t{2 * 2 * 95 * 2});
  EXPECT_EQ(gqa_pool(KvDType::kFP8, 1).bytes_per_token(), size_t{2 * 2 * (95 + 5 * 4)});
}

TEST(KvBlockPool, RefusesScaleGroupsThatDoNotCoverTheRow) {
  EXPECT_THROW(
      KvBlockPool(1, 16, 16, 4, 1, KvPoolLayout{.dtype = KvDType::kFP8, .key_groups = {8, 4}}),
      Error);
}

}  // namespace
}  // namespace moeinfer
