// MLA prefill attention (backend/cuda/mla_attention.h, mla_prefill_attention: each sequence's
// absorbed queries over its paged latent rows, on tensor cores) against the MLA decode kernel
// run one query row per new token, the decoder's per-query route and the oracle this kernel
// replaces (itself held to a float64 softmax in cuda_mla_attention_test.cpp). Fresh random
// inputs each run, outputs poisoned first, printed seed.
//
// Every case carries sequences of mixed shapes in one launch: prefixes 0, 5, 37 (not a multiple
// of the block size) and 300 (many blocks, many 32-key tiles), chunks of 1, 7, 64, 70 and 200
// queries, block tables shuffled over the pool. Heads 1 (64 queries a tile), 16 (4 a tile,
// DeepSeek-V2-Lite), 128 (two head tiles of 64, one query each: DeepSeek-V3, Kimi K2) and 100
// (two tiles of 50 heads, 14 rows of each empty); latent + rope key 512 + 64, the
// fixtures' padded 32 + 8 (W = 40: a half k-step of padding) and 40 + 16 (L / 8 odd: the last
// output group's second chunk is a rope chunk), 64 + 8; bf16 and fp8 rows. A long case at
// DeepSeek-V3's shape: a 512-token chunk after 2048 cached tokens, a 1024-token prompt from 0
// and a one-token row after 3000, blocks of 64. Slots no query of a sequence may see (every slot
// past its last key, and the pool's spare blocks) hold NaN (bf16 NaN rows; fp8 NaN codes and
// NaN scales), so a kernel that reads one, even under a zero weight, fails.
//
// Tolerance: |got - want| <= 1e-2 * (|want| + rms), rms the root mean square of the oracle's
// output row (the head's L values). Both kernels form float32 scores on tensor cores (summed in
// different orders: the decode kernel's 8 warps' partials, the prefill kernel's two halves; a
// relative difference of about 1e-6), keep the softmax in float32 and round P to bf16 for the
// P.V product; they differ in where the running max sits when P is rounded (2^-9 relative per
// weight either way, random over the keys, so about 1e-3 of the row's scale), in the decode
// kernel's float32 combine of its splits, and in the bf16 rounding of the output (2^-9
// relative each): the bf16 bound of CONVENTIONS.md, on the output's natural scale so that
// outputs near zero (many keys averaging) do not make a relative bound meaningless.
//
// Host-side (no GPU): the head tiling, the work list, the launcher's refusals and its agreement
// with the decoder's route predicate.
// Written without a GPU; not yet run on one.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/mla_attention.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "model/attention_route.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

struct MlaPrefillCase {
  int64_t latent_dim = 512;  // L
  int64_t rope_dim = 64;     // R
  int64_t num_heads = 16;
  int64_t block_size = 16;
  bool fp8 = false;
  // (cached prefix, new tokens) per sequence.
  std::vector<std::pair<int32_t, int32_t>> seqs = {{0, 7}, {37, 64}, {300, 200}, {5, 1}, {0, 70}};
};

constexpr uint16_t kBf16NaN = 0x7fc0;
constexpr uint8_t kF8NaN = 0x7f;

// The pool's rows: bf16 [slots, W], or fp8 latent [slots, L] and rope [slots, R] codes with a
// scale each per slot.
struct MlaPool {
  std::vector<uint16_t> rows;
  std::vector<uint8_t> latent_codes, rope_codes;
  std::vector<float> latent_scales, rope_scales;
};

// Random rows at the slots a sequence's queries may see (its keys [0, prefix + n)), NaN elsewhere.
MlaPool fill_pool(const MlaPrefillCase& c, int64_t num_blocks, const std::vector<int32_t>& tables,
                  int64_t max_blocks, std::mt19937& rng) {
  const int64_t L = c.latent_dim, R = c.rope_dim, W = L + R;
  const int64_t slots = num_blocks * c.block_size;
  std::vector<bool> visible(static_cast<size_t>(slots), false);
  for (size_t b = 0; b < c.seqs.size(); ++b) {
    const auto [prefix, n] = c.seqs[b];
    for (int64_t key = 0; key < prefix + n; ++key) {
      const int64_t block = tables[b * max_blocks + key / c.block_size];
      visible[block * c.block_size + key % c.block_size] = true;
    }
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  MlaPool pool;
  if (!c.fp8) {
    pool.rows.assign(slots * W, kBf16NaN);
    for (int64_t s = 0; s < slots; ++s) {
      if (!visible[s]) continue;
      for (int64_t d = 0; d < W; ++d) pool.rows[s * W + d] = f32_to_bf16(normal(rng));
    }
    return pool;
  }
  pool.latent_codes.assign(slots * L, kF8NaN);
  pool.rope_codes.assign(slots * R, kF8NaN);
  pool.latent_scales.assign(slots, NAN);
  pool.rope_scales.assign(slots, NAN);
  std::vector<float> latent(L), rope(R);
  for (int64_t s = 0; s < slots; ++s) {
    if (!visible[s]) continue;
    for (float& v : latent) v = normal(rng);
    for (float& v : rope) v = normal(rng);
    pool.latent_scales[s] =
        encode_f8e4m3_scaled(latent.data(), L, pool.latent_codes.data() + s * L);
    pool.rope_scales[s] = encode_f8e4m3_scaled(rope.data(), R, pool.rope_codes.data() + s * R);
  }
  return pool;
}

void mla_prefill_matches_per_query_decode(const MlaPrefillCase& c) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(c.latent_dim * 31 + c.rope_dim * 7 +
                                                        c.num_heads * 101 + (c.fp8 ? 5 : 0)));
  const int64_t L = c.latent_dim, R = c.rope_dim, W = L + R, Nh = c.num_heads;
  const int64_t B = static_cast<int64_t>(c.seqs.size());
  int64_t T = 0, max_len = 1;
  for (const auto& [prefix, n] : c.seqs) {
    T += n;
    max_len = std::max<int64_t>(max_len, prefix + n);
  }
  const int64_t max_blocks = (max_len + c.block_size - 1) / c.block_size;
  const int64_t num_blocks = B * max_blocks + 3;  // three spare blocks, all NaN
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(B * max_blocks);
  for (int64_t i = 0; i < B * max_blocks; ++i) tables[i] = ids[i];
  const MlaPool pool = fill_pool(c, num_blocks, tables, max_blocks, rng);

  // Per sequence for the prefill launch; per token for the oracle (each new token a row of
  // length position + 1 over its sequence's table).
  std::vector<int32_t> cu_seqlens(c.seqs.size() + 1, 0), seq_lens(c.seqs.size());
  std::vector<int32_t> row_lens, row_tables;
  for (int64_t b = 0; b < B; ++b) {
    const auto [prefix, n] = c.seqs[b];
    cu_seqlens[b + 1] = cu_seqlens[b] + n;
    seq_lens[b] = prefix + n;
    for (int32_t i = 0; i < n; ++i) {
      row_lens.push_back(prefix + i + 1);
      row_tables.insert(row_tables.end(), tables.begin() + b * max_blocks,
                        tables.begin() + (b + 1) * max_blocks);
    }
  }
  std::vector<int32_t> tile_starts(c.seqs.size() + 1);
  const int64_t num_tiles = plan_mla_prefill_tiles(cu_seqlens.data(), B, Nh, tile_starts.data());
  const auto q = random_bf16(T * Nh * W, rng);

  DeviceBuffer<uint16_t> d_q(q), d_rows(pool.rows), got(T * Nh * L), want(T * Nh * L);
  DeviceBuffer<uint8_t> d_latent_codes(pool.latent_codes), d_rope_codes(pool.rope_codes);
  DeviceBuffer<float> d_latent_scales(pool.latent_scales), d_rope_scales(pool.rope_scales);
  DeviceBuffer<int32_t> d_cu(cu_seqlens), d_lens(seq_lens), d_tables(tables);
  DeviceBuffer<int32_t> d_tile_starts(tile_starts), d_row_lens(row_lens), d_row_tables(row_tables);
  got.poison();
  want.poison();
  // DeepSeek's 1 / sqrt(qk_head_dim = 192) scaled up for the smaller rows, so the softmax is
  // neither flat nor one-hot at every width.
  const float scale = 1.5f / std::sqrt(static_cast<float>(W));

  MlaDecodeParams oracle{.q = d_q.as_bf16(),
                         .cache = c.fp8 ? nullptr : d_rows.as_bf16(),
                         .latent_codes = c.fp8 ? d_latent_codes.get() : nullptr,
                         .rope_codes = c.fp8 ? d_rope_codes.get() : nullptr,
                         .latent_scales = c.fp8 ? d_latent_scales.get() : nullptr,
                         .rope_scales = c.fp8 ? d_rope_scales.get() : nullptr,
                         .block_tables = d_row_tables.get(),
                         .seq_lens = d_row_lens.get(),
                         .out = want.as_bf16(),
                         .num_seqs = T,
                         .num_heads = Nh,
                         .latent_dim = L,
                         .rope_dim = R,
                         .block_size = c.block_size,
                         .num_blocks = num_blocks,
                         .max_blocks_per_seq = max_blocks,
                         .max_seq_len = max_len,
                         .scale = scale};
  DeviceBuffer<float> workspace(std::max<int64_t>(1, mla_decode_workspace_size(oracle)));
  oracle.workspace = workspace.get();
  mla_decode_attention(oracle, nullptr);

  mla_prefill_attention({.q = d_q.as_bf16(),
                         .cache = oracle.cache,
                         .latent_codes = oracle.latent_codes,
                         .rope_codes = oracle.rope_codes,
                         .latent_scales = oracle.latent_scales,
                         .rope_scales = oracle.rope_scales,
                         .cu_seqlens = d_cu.get(),
                         .seq_lens = d_lens.get(),
                         .tile_starts = d_tile_starts.get(),
                         .block_tables = d_tables.get(),
                         .out = got.as_bf16(),
                         .num_tokens = T,
                         .num_seqs = B,
                         .num_tiles = num_tiles,
                         .num_heads = Nh,
                         .latent_dim = L,
                         .rope_dim = R,
                         .block_size = c.block_size,
                         .num_blocks = num_blocks,
                         .max_blocks_per_seq = max_blocks,
                         .max_seq_len = max_len,
                         .scale = scale},
                        nullptr);
  synchronize();

  const auto want_host = to_float(want.download());
  std::vector<double> reference(want_host.begin(), want_host.end()), row_scale(want_host.size());
  for (int64_t r = 0; r < T * Nh; ++r) {  // (token, head) rows
    double squares = 0.0;
    for (int64_t d = 0; d < L; ++d) squares += reference[r * L + d] * reference[r * L + d];
    ASSERT_TRUE(std::isfinite(squares)) << "the oracle's row " << r << " is not finite";
    std::fill_n(row_scale.begin() + r * L, L, std::sqrt(squares / static_cast<double>(L)));
  }
  expect_bf16_near(got.download(), reference, row_scale, "MLA prefill vs per-query decode");
}

std::string case_name(const MlaPrefillCase& c) {
  std::string name = "L" + std::to_string(c.latent_dim) + "_R" + std::to_string(c.rope_dim) +
                     "_Heads" + std::to_string(c.num_heads);
  if (c.block_size != 16) name += "_Block" + std::to_string(c.block_size);
  if (c.fp8) name += "_Fp8";
  return name;
}

std::vector<MlaPrefillCase> cases() {
  std::vector<MlaPrefillCase> out;
  for (bool fp8 : {false, true}) {
    for (const auto& [L, R] :
         std::vector<std::pair<int64_t, int64_t>>{{512, 64}, {32, 8}, {40, 16}}) {
      for (int64_t heads : {1, 16, 128}) {
        out.push_back({.latent_dim = L, .rope_dim = R, .num_heads = heads, .fp8 = fp8});
      }
    }
  }
  out.push_back({.latent_dim = 64, .rope_dim = 8, .num_heads = 100, .block_size = 64});
  // DeepSeek-V3 / Kimi K2: long prefixes and prompts.
  const std::vector<std::pair<int32_t, int32_t>> long_seqs = {{2048, 512}, {0, 1024}, {3000, 1}};
  out.push_back({.num_heads = 128, .block_size = 64, .seqs = long_seqs});
  out.push_back({.num_heads = 128, .block_size = 64, .fp8 = true, .seqs = long_seqs});
  return out;
}

// ---- host-side: tiling, work list, refusals (no GPU) --------------------------------------

TEST(CudaMlaPrefillChecks, HeadTilesFillTheSixtyFourRows) {
  auto tiling = [](int64_t heads) {
    const MlaPrefillTiling t = mla_prefill_tiling(heads);
    return std::vector<int64_t>{t.heads_per_tile, t.head_tiles, t.queries_per_tile};
  };
  EXPECT_EQ(tiling(1), (std::vector<int64_t>{1, 1, 64}));
  EXPECT_EQ(tiling(4), (std::vector<int64_t>{4, 1, 16}));   // the fixtures
  EXPECT_EQ(tiling(16), (std::vector<int64_t>{16, 1, 4}));  // DeepSeek-V2-Lite
  EXPECT_EQ(tiling(64), (std::vector<int64_t>{64, 1, 1}));
  EXPECT_EQ(tiling(65), (std::vector<int64_t>{33, 2, 1}));  // even tiles, never 64 + 1
  EXPECT_EQ(tiling(100), (std::vector<int64_t>{50, 2, 1}));
  EXPECT_EQ(tiling(128), (std::vector<int64_t>{64, 2, 1}));  // DeepSeek-V3, Kimi K2
  EXPECT_EQ(tiling(24), (std::vector<int64_t>{24, 1, 2}));   // 16 of the 64 rows empty
  expect_error_naming([] { mla_prefill_tiling(0); }, "num_heads = 0");
}

TEST(CudaMlaPrefillChecks, PlanGivesEachSequenceItsQueryTiles) {
  const int32_t cu_seqlens[] = {0, 7, 7, 71, 72};
  int32_t starts[5] = {-1, -1, -1, -1, -1};
  EXPECT_EQ(plan_mla_prefill_tiles(cu_seqlens, 4, 16, starts), 19);  // 4 queries a tile
  EXPECT_EQ(std::vector<int32_t>(starts, starts + 5), (std::vector<int32_t>{0, 2, 2, 18, 19}));
  EXPECT_EQ(plan_mla_prefill_tiles(cu_seqlens, 4, 128, starts), 72);  // 1 query a tile
  EXPECT_EQ(std::vector<int32_t>(starts, starts + 5), (std::vector<int32_t>{0, 7, 7, 71, 72}));
  EXPECT_EQ(plan_mla_prefill_tiles(cu_seqlens, 4, 1, starts), 3);  // 64 queries a tile
  EXPECT_EQ(std::vector<int32_t>(starts, starts + 5), (std::vector<int32_t>{0, 1, 1, 2, 3}));
}

TEST(CudaMlaPrefillChecks, SupportsTheDecodeKernelsRegisterRowsOnly) {
  EXPECT_TRUE(mla_prefill_supports(512, 64));
  EXPECT_TRUE(mla_prefill_supports(32, 8));
  EXPECT_TRUE(mla_prefill_supports(40, 16));
  EXPECT_FALSE(mla_prefill_supports(520, 8));   // the latent past 512
  EXPECT_FALSE(mla_prefill_supports(512, 72));  // the row past 576
  EXPECT_FALSE(mla_prefill_supports(36, 8));    // not a multiple of 8
  EXPECT_FALSE(mla_prefill_supports(32, 0));
}

// The decoder's route predicate (CUDA-free, model/attention_route.h) and the launcher agree on
// every latent and rope key up to past the limits, so the route never picks a launch that the
// launcher refuses, nor leaves a supported model on the per-query route.
TEST(CudaMlaPrefillChecks, RoutePredicateAgreesWithTheLauncher) {
  for (int64_t L = 0; L <= 1040; L += 4) {
    for (int64_t R = 0; R <= 600; R += 4) {
      const AttentionModelFacts facts{.mla = true, .mla_latent_dim = L, .mla_rope_dim = R};
      ASSERT_EQ(mla_prefill_kernel_applies(facts), mla_prefill_supports(L, R))
          << "L " << L << " R " << R;
    }
  }
}

template <typename T>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

TEST(CudaMlaPrefillChecks, RefusesBadShapesByName) {
  const MlaPrefillParams good{.q = fake<const __nv_bfloat16>(0x1000),
                              .cache = fake<const __nv_bfloat16>(0x2000),
                              .cu_seqlens = fake<const int32_t>(0x3000),
                              .seq_lens = fake<const int32_t>(0x4000),
                              .tile_starts = fake<const int32_t>(0x5000),
                              .block_tables = fake<const int32_t>(0x6000),
                              .out = fake<__nv_bfloat16>(0x7000),
                              .num_tokens = 4,
                              .num_seqs = 1,
                              .num_tiles = 1,
                              .num_heads = 16,
                              .latent_dim = 512,
                              .rope_dim = 64,
                              .block_size = 16,
                              .num_blocks = 1,
                              .max_blocks_per_seq = 1,
                              .max_seq_len = 4,
                              .scale = 0.1f};
  auto refuse = [&](auto edit, const std::string& needle) {
    MlaPrefillParams p = good;
    edit(p);
    expect_error_naming([&] { mla_prefill_attention(p, nullptr); }, needle);
  };
  refuse([](MlaPrefillParams& p) { p.latent_dim = 1024; }, "latent_dim = 1024");
  refuse([](MlaPrefillParams& p) { p.rope_dim = 72; }, "rope_dim = 72");
  refuse([](MlaPrefillParams& p) { p.num_heads = 0; }, "num_heads = 0");
  refuse([](MlaPrefillParams& p) { p.num_tiles = 5; }, "num_tiles = 5");
  refuse([](MlaPrefillParams& p) { p.num_seqs = 5; }, "num_seqs = 5");
  refuse([](MlaPrefillParams& p) { p.max_seq_len = 17; }, "max_seq_len = 17");
  refuse([](MlaPrefillParams& p) { p.scale = 0.0f; }, "scale = 0");
  refuse([](MlaPrefillParams& p) { p.q = fake<const __nv_bfloat16>(0x1002); },
         "not 16-byte aligned");
  refuse([](MlaPrefillParams& p) { p.latent_codes = fake<const uint8_t>(0x8000); }, "exclusive");
  refuse(
      [](MlaPrefillParams& p) {
        p.cache = nullptr;
        p.latent_codes = fake<const uint8_t>(0x8000);
        p.rope_codes = fake<const uint8_t>(0x9000);
        p.latent_scales = fake<const float>(0xa000);
      },
      "rope_scales");
  refuse([](MlaPrefillParams& p) { p.tile_starts = nullptr; }, "tile_starts");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("MLA prefill attention")) return false;
  for (const MlaPrefillCase& c : cases()) {
    std::string name = case_name(c);
    if (c.seqs.size() == 3) name = "DeepSeekV3_Chunk512After2048_" + name;
    register_kernel_test(
        "CudaMlaPrefill", name, [c] { mla_prefill_matches_per_query_decode(c); }, __FILE__,
        __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
