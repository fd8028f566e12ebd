// MLA decode attention (backend/cuda/mla_attention.h) against a float64 CPU reference of the
// absorbed form (Decoder::mla_attention's math): score_j = scale * q[h] . row_j over all W
// values, out[h] = softmax . row[0:L]. Fresh random inputs each run, outputs and workspace
// poisoned first; every cache slot that no sequence may read (positions at or past each length,
// spare blocks, the block-table entries past a sequence's last block) is NaN, so a kernel that
// reads one, even under a zero weight, fails. Shapes (L, R, Nh) = (32, 8, 4), (512, 64, 16),
// (512, 64, 128) and an odd (40, 16, 20) (L / 16 not whole, a partial head tile, W = 56);
// lengths 0, 1, 17, 300, 5000; shuffled block tables with block sizes 8, 16, 48 and 128; plans
// with several splits (the combine kernel, up to the most the plan makes) and with one; the prefill
// layout (every row reads one sequence's blocks, seq_len = position + 1). The wide cases take the
// streaming kernel (L > 512 or W > 576): latents 520, 768, 1000, 1024 and 1536 with rope keys 64
// and 128, a 512-wide latent with a rope key past 64, a latent of 8 beside a rope key of 576;
// 1, 16, 20 and 128 heads; lengths 1, 19, 99, 989 (and 0); block sizes 8, 16, 24, 48, 128;
// split, unsplit and fixed-chunk (--deterministic) plans. Each case asserts the plan and the
// kernel it claims to test. bf16 tolerance 1e-2 of the output's natural scale. The argument
// checks run without a GPU.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cuda/mla_attention.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

// Host-side checks: every case fails before anything touches the (fake, host) pointers.
TEST(CudaMlaChecks, RefuseBadArguments) {
  alignas(16) static uint16_t buf[1024] = {};
  alignas(16) static float ws[16] = {};
  static int32_t ids[4] = {};
  auto* b = reinterpret_cast<__nv_bfloat16*>(buf);
  const MlaDecodeParams good{.q = b,
                             .cache = b,
                             .block_tables = ids,
                             .seq_lens = ids,
                             .out = b,
                             .workspace = ws,
                             .num_seqs = 300,  // 300 rows x 1 head tile: one split, no workspace
                             .num_heads = 4,
                             .latent_dim = 32,
                             .rope_dim = 8,
                             .block_size = 16,
                             .num_blocks = 1,
                             .max_blocks_per_seq = 1,
                             .max_seq_len = 16,
                             .scale = 0.1f};
  auto refuse = [&](auto edit, const std::string& needle) {
    MlaDecodeParams p = good;
    edit(p);
    expect_error_naming([&] { mla_decode_attention(p, nullptr); }, needle);
  };
  refuse([](MlaDecodeParams& p) { p.num_seqs = -1; }, "num_seqs = -1");
  refuse([](MlaDecodeParams& p) { p.num_seqs = 70000; }, "num_seqs = 70000");
  refuse([](MlaDecodeParams& p) { p.num_heads = 0; }, "num_heads = 0");
  refuse([](MlaDecodeParams& p) { p.latent_dim = 36; }, "latent_dim = 36");
  refuse([](MlaDecodeParams& p) { p.latent_dim = 0; }, "latent_dim = 0");
  refuse([](MlaDecodeParams& p) { p.latent_dim = 1028; }, "latent_dim = 1028");
  refuse([](MlaDecodeParams& p) { p.rope_dim = 4; }, "rope_dim = 4");
  refuse([](MlaDecodeParams& p) { p.rope_dim = 0; }, "rope_dim = 0");
  refuse([](MlaDecodeParams& p) { p.rope_dim = 68; }, "rope_dim = 68");
  // Past the ints the kernels index a row with.
  refuse(
      [](MlaDecodeParams& p) {
        p.latent_dim = kMlaMaxRowWidth;
        p.rope_dim = 8;
      },
      "latent_dim + rope_dim = 1073741832");
  refuse([](MlaDecodeParams& p) { p.block_size = 0; }, "block_size = 0");
  refuse([](MlaDecodeParams& p) { p.num_blocks = 0; }, "num_blocks = 0");
  refuse([](MlaDecodeParams& p) { p.max_seq_len = 17; }, "max_seq_len = 17");
  refuse([](MlaDecodeParams& p) { p.max_seq_len = -1; }, "max_seq_len = -1");
  refuse([](MlaDecodeParams& p) { p.scale = 0.0f; }, "scale = 0");
  refuse([](MlaDecodeParams& p) { p.scale = INFINITY; }, "scale = inf");
  refuse([](MlaDecodeParams& p) { p.q = nullptr; }, "q is null");
  refuse([](MlaDecodeParams& p) { p.cache = nullptr; }, "cache is null");
  refuse([](MlaDecodeParams& p) { p.block_tables = nullptr; }, "block_tables is null");
  refuse([](MlaDecodeParams& p) { p.seq_lens = nullptr; }, "seq_lens is null");
  refuse([](MlaDecodeParams& p) { p.out = nullptr; }, "out is null");
  refuse([b](MlaDecodeParams& p) { p.q = b + 1; }, "q (");
  refuse([b](MlaDecodeParams& p) { p.cache = b + 4; }, "cache (");
  refuse([b](MlaDecodeParams& p) { p.out = b + 2; }, "out (");
  // One row of 1000 keys: the plan splits, so the workspace is needed.
  auto split = [](MlaDecodeParams& p) {
    p.num_seqs = 1;
    p.max_blocks_per_seq = 63;
    p.max_seq_len = 1000;
  };
  refuse(
      [&](MlaDecodeParams& p) {
        split(p);
        p.workspace = nullptr;
      },
      "workspace is null");
  refuse(
      [&](MlaDecodeParams& p) {
        split(p);
        p.workspace = ws + 1;
      },
      "workspace (");
}

TEST(CudaMlaChecks, NoRowsIsANoOp) {
  MlaDecodeParams p{.num_seqs = 0,
                    .num_heads = 16,
                    .latent_dim = 512,
                    .rope_dim = 64,
                    .block_size = 16,
                    .num_blocks = 1,
                    .max_blocks_per_seq = 1,
                    .max_seq_len = 16,
                    .scale = 0.1f};
  EXPECT_NO_THROW(mla_decode_attention(p, nullptr));  // null pointers are never looked at
  // Latents and rows of any width pass the checks.
  const std::pair<int64_t, int64_t> wide_shapes[] = {{520, 64},  {512, 72}, {1024, 128},
                                                     {1536, 64}, {8, 4096}, {65536, 64}};
  for (const auto& [L, R] : wide_shapes) {
    p.latent_dim = L;
    p.rope_dim = R;
    EXPECT_NO_THROW(mla_decode_attention(p, nullptr)) << L << " + " << R;
  }
}

// The register-resident kernel keeps every shape up to DeepSeek's 512 + 64 (and a wider rope key
// beside a narrower latent up to the same 576-wide row); past either limit the streaming one.
TEST(CudaMlaChecks, WideShapesTakeTheStreamingKernel) {
  auto wide = [](int64_t L, int64_t R) {
    return mla_decode_is_wide(MlaDecodeParams{.latent_dim = L, .rope_dim = R});
  };
  EXPECT_FALSE(wide(512, 64));
  EXPECT_FALSE(wide(448, 128));
  EXPECT_FALSE(wide(8, 568));
  EXPECT_FALSE(wide(32, 8));
  EXPECT_TRUE(wide(520, 8));  // the latent past 512, the row within 576
  EXPECT_TRUE(wide(520, 64));
  EXPECT_TRUE(wide(512, 72));  // the row past 576, the latent within 512
  EXPECT_TRUE(wide(8, 576));
  EXPECT_TRUE(wide(1024, 64));
  EXPECT_TRUE(wide(1536, 128));
}

// The wide kernel uses the same plan and workspace layout: [B, Nh, splits, L] outputs and
// [B, Nh, splits, 2] (max, sum) pairs, so GpuDecoder sizes its scratch through the same call.
TEST(CudaMlaChecks, WideSplitPlanAndWorkspace) {
  MlaDecodeParams p{.num_seqs = 1,
                    .num_heads = 16,
                    .latent_dim = 1024,
                    .rope_dim = 64,
                    .block_size = 16,
                    .num_blocks = 1,
                    .max_blocks_per_seq = 63,
                    .max_seq_len = 1000,
                    .scale = 0.1f};
  EXPECT_EQ(mla_decode_split(p).chunk, 64);
  EXPECT_EQ(mla_decode_split(p).num_splits, 16);
  EXPECT_EQ(mla_decode_workspace_size(p), 1 * 16 * 16 * (1024 + 2));
  p.fixed_chunk = 256;
  EXPECT_EQ(mla_decode_split(p).num_splits, 4);
  EXPECT_EQ(mla_decode_workspace_size(p), 1 * 16 * 4 * (1024 + 2));
  p.num_heads = 128;
  p.num_seqs = 33;
  p.fixed_chunk = 0;
  EXPECT_EQ(mla_decode_workspace_size(p), 0);
}

// The decoder sizes its split workspace once, by mla_decode_workspace_bound at its largest row
// count and context; every launch with fewer rows or a shorter context must fit. The exact size
// is not monotone (at 1 head tile, 65 rows split into 5 where 64 and 128 rows need 320 and 384
// split rows, but 132 rows need 396), so every (rows, context) up to the bound's is tried.
TEST(CudaMlaChecks, WorkspaceBoundCoversEveryLaunchUpToIt) {
  for (const int64_t heads : {1, 16, 20, 128}) {
    for (const int64_t fixed_chunk : {0, 256}) {
      for (const int64_t max_rows : {1, 7, 140}) {
        for (const int64_t max_len : {64, 777, 3000}) {
          MlaDecodeParams p{.num_seqs = max_rows,
                            .num_heads = heads,
                            .latent_dim = 512,
                            .rope_dim = 64,
                            .block_size = 16,
                            .num_blocks = 1,
                            .max_blocks_per_seq = (max_len + 15) / 16,
                            .max_seq_len = max_len,
                            .scale = 0.1f,
                            .fixed_chunk = fixed_chunk};
          const int64_t bound = mla_decode_workspace_bound(p);
          int64_t worst = 0;
          for (int64_t rows = 1; rows <= max_rows; ++rows)
            for (int64_t len = 1; len <= max_len; len += len < 300 ? 1 : 7) {
              p.num_seqs = rows;
              p.max_seq_len = len;
              worst = std::max(worst, mla_decode_workspace_size(p));
            }
          EXPECT_LE(worst, bound) << heads << " heads, fixed_chunk " << fixed_chunk << ": "
                                  << max_rows << " rows, context " << max_len;
          // Not far above what some launch needs: at most twice, plus one row.
          EXPECT_LE(bound, 2 * worst + heads * (512 + 2) * 2) << heads << " heads";
        }
      }
    }
  }
}

TEST(CudaMlaChecks, SplitPlanAndWorkspace) {
  MlaDecodeParams p{.num_seqs = 1,
                    .num_heads = 16,
                    .latent_dim = 512,
                    .rope_dim = 64,
                    .block_size = 16,
                    .num_blocks = 1,
                    .max_blocks_per_seq = 63,
                    .max_seq_len = 1000,
                    .scale = 0.1f};
  // One unit (row x head tile) wants 264 splits: chunks of 64 keys, 16 of them.
  MlaDecodeSplit s = mla_decode_split(p);
  EXPECT_EQ(s.chunk, 64);
  EXPECT_EQ(s.num_splits, 16);
  EXPECT_EQ(mla_decode_workspace_size(p), 1 * 16 * 16 * (512 + 2));
  // 128 heads are 8 tiles: 33 splits wanted, chunk ceil(1000 / 33) = 31 -> 64.
  p.num_heads = 128;
  EXPECT_EQ(mla_decode_split(p).num_splits, 16);
  // 33 rows x 8 tiles fill the GPU: one split of the whole length, no workspace.
  p.num_seqs = 33;
  s = mla_decode_split(p);
  EXPECT_EQ(s.num_splits, 1);
  EXPECT_GE(s.chunk, 1000);
  EXPECT_EQ(mla_decode_workspace_size(p), 0);
  // Empty rows: one split.
  p.num_seqs = 1;
  p.max_seq_len = 0;
  EXPECT_EQ(mla_decode_split(p).num_splits, 1);
  EXPECT_EQ(mla_decode_workspace_size(p), 0);
}

struct MlaCase {
  std::vector<int32_t> seq_lens;
  int64_t L, R, Nh, block_size;
  bool expect_split;
  // Prefill layout: every row reads the same sequence's blocks (one block table for all).
  bool shared_sequence = false;
  int64_t fixed_chunk = 0;   // > 0: --deterministic's fixed splits
  bool expect_wide = false;  // the streaming kernel (L > 512 or W > 576)
};

constexpr uint16_t kNanBf16 = 0x7fc0;

void mla_random(const MlaCase& c) {
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.L * 131 + c.R * 17 + c.Nh * 7 + c.block_size +
                                         c.seq_lens.size() * 1009 + c.fixed_chunk * 3));
  const int64_t B = static_cast<int64_t>(c.seq_lens.size());
  const int64_t W = c.L + c.R, bs = c.block_size;
  const int64_t max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int64_t max_blocks = std::max<int64_t>(1, (max_len + bs - 1) / bs);
  auto blocks_of = [&](int64_t len) { return (len + bs - 1) / bs; };
  // Blocks in use: each sequence's own, or the one shared sequence's; plus 3 spare blocks, the
  // first of which fills the table entries past each sequence's last block.
  int64_t used = 0;
  if (c.shared_sequence) {
    used = blocks_of(max_len);
  } else {
    for (int32_t len : c.seq_lens) used += blocks_of(len);
  }
  const int64_t num_blocks = used + 3;
  std::vector<int32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  const int32_t spare = pool[used];
  std::vector<int32_t> tables(B * max_blocks, spare);
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t own = c.shared_sequence ? blocks_of(max_len) : blocks_of(c.seq_lens[b]);
    if (c.shared_sequence) next = 0;
    for (int64_t i = 0; i < own; ++i) tables[b * max_blocks + i] = pool[next++];
  }
  // Everything NaN, then random values in the slots a sequence may read.
  std::vector<uint16_t> cache(num_blocks * bs * W, kNanBf16);
  auto slot = [&](int64_t b, int64_t t) {
    return (static_cast<int64_t>(tables[b * max_blocks + t / bs]) * bs + t % bs) * W;
  };
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t b = 0; b < (c.shared_sequence ? 1 : B); ++b) {
    const int64_t len = c.shared_sequence ? max_len : c.seq_lens[b];
    for (int64_t t = 0; t < len; ++t)
      for (int64_t i = 0; i < W; ++i) cache[slot(b, t) + i] = f32_to_bf16(normal(rng));
  }
  const auto q = random_bf16(B * c.Nh * W, rng);
  // A peakier softmax than 1/sqrt(W) (score std ~1.5), as DeepSeek's mscale makes it.
  const float scale = 1.5f / std::sqrt(static_cast<float>(W));

  MlaDecodeParams p{.num_seqs = B,
                    .num_heads = c.Nh,
                    .latent_dim = c.L,
                    .rope_dim = c.R,
                    .block_size = bs,
                    .num_blocks = num_blocks,
                    .max_blocks_per_seq = max_blocks,
                    .max_seq_len = max_len,
                    .scale = scale,
                    .fixed_chunk = c.fixed_chunk};
  ASSERT_EQ(mla_decode_split(p).num_splits > 1, c.expect_split)
      << "the case does not test the plan it claims (" << mla_decode_split(p).num_splits
      << " splits)";
  ASSERT_EQ(mla_decode_is_wide(p), c.expect_wide) << "the case does not test the kernel it claims";
  DeviceBuffer<uint16_t> d_q(q), d_cache(cache), d_out(B * c.Nh * c.L);
  DeviceBuffer<int32_t> d_tables(tables), d_lens(c.seq_lens);
  DeviceBuffer<float> d_ws(std::max<int64_t>(1, mla_decode_workspace_size(p)));
  d_out.poison();
  d_ws.poison();
  p.q = d_q.as_bf16();
  p.cache = d_cache.as_bf16();
  p.block_tables = d_tables.get();
  p.seq_lens = d_lens.get();
  p.out = d_out.as_bf16();
  p.workspace = d_ws.get();
  mla_decode_attention(p, nullptr);
  synchronize();

  const auto qf = to_float(q);
  std::vector<double> want(B * c.Nh * c.L, 0.0), bound(want.size(), 1e-6);
  std::vector<double> rows, s;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = c.seq_lens[b];
    if (len == 0) continue;  // zeros, to within 1e-8
    rows.resize(len * W);
    for (int64_t t = 0; t < len; ++t)
      for (int64_t i = 0; i < W; ++i) rows[t * W + i] = bf16_to_f32(cache[slot(b, t) + i]);
    s.resize(len);
    for (int64_t h = 0; h < c.Nh; ++h) {
      const float* qh = qf.data() + (b * c.Nh + h) * W;
      double m = -1e300;
      for (int64_t t = 0; t < len; ++t) {
        double dot = 0;
        for (int64_t i = 0; i < W; ++i) dot += static_cast<double>(qh[i]) * rows[t * W + i];
        s[t] = dot * scale;
        m = std::max(m, s[t]);
      }
      double z = 0;
      for (int64_t t = 0; t < len; ++t) z += (s[t] = std::exp(s[t] - m));
      double* w = want.data() + (b * c.Nh + h) * c.L;
      double* bd = bound.data() + (b * c.Nh + h) * c.L;
      std::fill_n(bd, c.L, 0.0);
      for (int64_t t = 0; t < len; ++t) {
        const double pt = s[t] / z;
        for (int64_t d = 0; d < c.L; ++d) {
          w[d] += pt * rows[t * W + d];
          bd[d] += std::fabs(pt * rows[t * W + d]);
        }
      }
      // Natural scale: at least 1/sqrt(keys) (a spread softmax of unit values), and
      // sum_t p_t |v_t|, which bounds the rounding of P to bf16 when the softmax is peaked.
      for (int64_t d = 0; d < c.L; ++d)
        bd[d] = std::max(bd[d], 1.0 / std::sqrt(static_cast<double>(len)));
    }
  }
  expect_bf16_near(d_out.download(), want, bound, "mla out");
}

std::vector<int32_t> lengths(std::vector<int32_t> head, int64_t count, int32_t modulus) {
  for (int64_t i = static_cast<int64_t>(head.size()); i < count; ++i)
    head.push_back(static_cast<int32_t>((37 * i) % modulus));
  return head;
}

std::vector<int32_t> positions_plus_one(int64_t count) {
  std::vector<int32_t> lens(count);
  std::iota(lens.begin(), lens.end(), 1);
  return lens;
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("MLA attention")) return false;
  struct Named {
    const char* name;
    MlaCase c;
  };
  const std::vector<int32_t> awkward = {0, 1, 17, 300, 5000};
  const Named cases[] = {
      // Split plans: 5 rows x 1 or 8 head tiles want many splits (5000 keys: 40, 40 and 7).
      {"L32_R8_H4_Split", {awkward, 32, 8, 4, 16, true}},
      {"L512_R64_H16_Split", {awkward, 512, 64, 16, 16, true}},
      {"L512_R64_H128_Split", {awkward, 512, 64, 128, 16, true}},
      // The most splits the plan makes: 264 of 64 keys (more than the combine's 256 threads).
      {"L32_R8_H4_Len16896_264Splits", {{16896}, 32, 8, 4, 16, true}},
      // 9 rows x 128 heads: 4 splits, combined with one block per (row, head) for all dims.
      {"L512_R64_H128_B9_Split", {{0, 1, 17, 300, 2000, 5, 64, 65, 129}, 512, 64, 128, 16, true}},
      // One split: 264 rows x 1 tile, 33 rows x 8 tiles.
      {"L32_R8_H4_Unsplit", {lengths(awkward, 264, 301), 32, 8, 4, 16, false}},
      {"L512_R64_H16_Unsplit", {lengths(awkward, 264, 65), 512, 64, 16, 16, false}},
      {"L512_R64_H128_Unsplit", {lengths(awkward, 33, 65), 512, 64, 128, 16, false}},
      // Block sizes 8, 48 (not a power of two) and 128.
      {"L512_R64_H16_Block8", {{17, 300, 1000}, 512, 64, 16, 8, true}},
      {"L32_R8_H4_Block48", {awkward, 32, 8, 4, 48, true}},
      {"L512_R64_H128_Block128", {awkward, 512, 64, 128, 128, true}},
      // L / 16 not whole (the last 16-dim group half rope), W = 56, heads 16..19 a partial tile.
      {"L40_R16_H20_Block24", {{1, 17, 300, 777, 0}, 40, 16, 20, 24, true}},
      // A rope key wider than DeepSeek's 64 where the latent leaves room in the 576-wide row
      // (and a latent of 8, one 16-dim group half rope).
      {"L256_R128_H16_Split", {awkward, 256, 128, 16, 16, true}},
      {"L448_R128_H8_Unsplit", {lengths(awkward, 264, 65), 448, 128, 8, 16, false}},
      {"L8_R64_H4_Block24", {{1, 17, 300, 777, 0}, 8, 64, 4, 24, true}},
      // Only empty rows, and a single row of one key.
      {"L512_R64_H16_AllEmpty", {{0, 0, 0}, 512, 64, 16, 16, false}},
      {"L512_R64_H128_Len1", {{1}, 512, 64, 128, 16, false}},
      // Prefill layout: row i is position i of one sequence (seq_len i + 1).
      {"Prefill_L32_R8_H4_T600", {positions_plus_one(600), 32, 8, 4, 16, false, true}},
      {"Prefill_L512_R64_H16_T100", {positions_plus_one(100), 512, 64, 16, 16, true, true}},
  };
  // The streaming kernel: latents past 512 (one, two or three slices of 512 output dims, the
  // last partial) or rows past 576. Split plans: 4 or 5 rows x 1 or 8 head tiles want many
  // splits (989 keys: 16 splits of 64, or 8 of 128 with 128 heads).
  const std::vector<int32_t> odd = {1, 19, 99, 989};
  const std::vector<int32_t> odd_and_empty = {1, 19, 0, 99, 989};
  auto wide = [](std::vector<int32_t> lens, int64_t L, int64_t R, int64_t Nh, int64_t block_size,
                 bool split, int64_t fixed_chunk = 0) {
    return MlaCase{.seq_lens = std::move(lens),
                   .L = L,
                   .R = R,
                   .Nh = Nh,
                   .block_size = block_size,
                   .expect_split = split,
                   .fixed_chunk = fixed_chunk,
                   .expect_wide = true};
  };
  const Named wide_cases[] = {
      {"Wide_L520_R64_H16_Split", wide(odd_and_empty, 520, 64, 16, 16, true)},
      {"Wide_L520_R64_H1_Block8", wide(odd, 520, 64, 1, 8, true)},
      {"Wide_L520_R128_H128_Block48", wide(odd, 520, 128, 128, 48, true)},
      {"Wide_L520_R128_H16_Split", wide(odd_and_empty, 520, 128, 16, 16, true)},
      {"Wide_L768_R64_H16_Block128", wide(odd_and_empty, 768, 64, 16, 128, true)},
      {"Wide_L768_R128_H1_Split", wide(odd, 768, 128, 1, 16, true)},
      {"Wide_L1024_R64_H128_Split", wide(odd, 1024, 64, 128, 16, true)},
      {"Wide_L1024_R128_H16_Block24", wide(odd_and_empty, 1024, 128, 16, 24, true)},
      {"Wide_L1024_R64_H1_Block48", wide(odd, 1024, 64, 1, 48, true)},
      // L / 16 not whole (the last group of each slice half past L), W / 16 not whole (a
      // half-empty k-step), a partial head tile; three slices; a rope key of 128 beside them.
      {"Wide_L1000_R64_H20_Split", wide(odd_and_empty, 1000, 64, 20, 16, true)},
      {"Wide_L1536_R128_H16_Split", wide(odd, 1536, 128, 16, 16, true)},
      // Rows past 576 with a latent of at most 512: one slice, the rope key past 64.
      {"Wide_L512_R72_H16_Split", wide(odd_and_empty, 512, 72, 16, 16, true)},
      {"Wide_L512_R128_H128_Block8", wide(odd, 512, 128, 128, 8, true)},
      {"Wide_L8_R576_H4_Block24", wide(odd, 8, 576, 4, 24, true)},
      // One split: 264 rows x 1 tile, 33 rows x 8 tiles.
      {"Wide_L1024_R64_H16_Unsplit", wide(lengths(odd, 264, 65), 1024, 64, 16, 16, false)},
      {"Wide_L768_R128_H128_Unsplit", wide(lengths(odd, 33, 65), 768, 128, 128, 16, false)},
      {"Wide_L520_R64_H16_AllEmpty", wide({0, 0, 0}, 520, 64, 16, 16, false)},
      {"Wide_L1024_R64_H128_Len1", wide({1}, 1024, 64, 128, 16, false)},
      // Fixed chunks (--deterministic): always through the workspace, whatever the batch; chunks
      // of 64 (16 splits at 989 keys), 256, and 1024 (each row one chunk, the second split empty).
      {"Wide_L1024_R64_H16_Fixed64", wide(odd_and_empty, 1024, 64, 16, 16, true, 64)},
      {"Wide_L520_R64_H128_Fixed256", wide(odd, 520, 64, 128, 16, true, 256)},
      {"Wide_L768_R128_H1_Fixed256_Block48", wide(odd, 768, 128, 1, 48, true, 256)},
      {"Wide_L1024_R128_H128_Fixed256", wide(odd, 1024, 128, 128, 16, true, 256)},
      {"Wide_L1000_R64_H20_Fixed1024", wide(odd_and_empty, 1000, 64, 20, 8, true, 1024)},
      {"Wide_L512_R72_H16_Fixed64_EmptyRows", wide({0, 5, 0}, 512, 72, 16, 16, true, 64)},
      // Prefill layout: row i is position i of one sequence (seq_len i + 1).
      {"Wide_Prefill_L1024_R64_H16_T100",
       {positions_plus_one(100), 1024, 64, 16, 16, true, true, 0, true}},
      {"Wide_Prefill_L768_R64_H16_T99_Fixed64",
       {positions_plus_one(99), 768, 64, 16, 16, true, true, 64, true}},
  };
  for (const Named& n : cases)
    register_kernel_test(
        "CudaMlaDecode", n.name, [c = n.c] { mla_random(c); }, __FILE__, __LINE__);
  for (const Named& n : wide_cases)
    register_kernel_test(
        "CudaMlaDecode", n.name, [c = n.c] { mla_random(c); }, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
