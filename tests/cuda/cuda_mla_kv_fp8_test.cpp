// MLA's latent cache in fp8 on the GPU (--kv-dtype fp8 on cuda for DeepSeek-V2/V3 and Kimi K2),
// held to the CPU pool's format (kv/kv_format.h: an MLA row has two scale groups, its latent of
// L values and its rope key of R, each scale amax / 448, codes e4m3), the CPU encoder being the
// oracle:
//   write    the decoder's two kv_cache_write_fp8 calls over padded rows [latent, zeros to Lp,
//            rope key, zeros to Lp + Rp] (num_heads 1, head widths Lp then Rp, stride W) store
//            exactly the codes (byte for byte) and scales (bit for bit) encode_kv_row gives for
//            the row's L + R values with groups {L, R}; padding codes are zero; slots skipped
//            (negative) and slots not written stay poisoned
//   decode   mla_decode_attention over fp8 planes against the same launcher over a bf16 cache
//            holding the rows decode_kv_row gives, rounded to bf16: the fp8 kernels decode each
//            row into the same shared-memory tile the bf16 kernels copy (bf16 of code * scale,
//            the same float product, round to nearest even) and then run the same instructions,
//            so the outputs must be bit-identical (bound: 0), and finite (slots no sequence may
//            read hold the NaN code and a NaN scale, the bf16 twin NaN: reading one shows). At
//            DeepSeek's 512 + 64 (register kernel) and at wide latents (streaming kernel), batch
//            1 to 40, lengths 0 to 3000, split, unsplit, fixed-chunk and prefill-layout plans.
// Host-side (no GPU): the launcher refuses mixed or incomplete fp8 arguments by name. The decoder
// against the CPU with --kv-dtype fp8 is in cuda_kv_fp8_test.cpp (CudaMlaKvFp8Decoder).
// Kernel tests are registered only where a CUDA device is visible; seeds are printed.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/mla_attention.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "kv/kv_format.h"

namespace moeinfer::cuda {
namespace {

using testing_util::DeviceBuffer;
using testing_util::fresh_seed;

constexpr uint32_t kPoisonScale = 0xFFFFFFFFu;  // a NaN, as DeviceBuffer::poison leaves it
constexpr uint8_t kPoisonCode = 0xFF;
constexpr uint8_t kNanCode = 0x7f;  // e4m3's NaN
constexpr uint16_t kNanBf16 = 0x7fc0;

template <typename T>
T* fake(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// ---- host-side refusals -------------------------------------------------------------------

TEST(CudaMlaKvFp8Checks, RefusesMixedIncompleteAndMisalignedRows) {
  const MlaDecodeParams good{.q = fake<const __nv_bfloat16>(0x1000),
                             .latent_codes = fake<const uint8_t>(0x2000),
                             .rope_codes = fake<const uint8_t>(0x3000),
                             .latent_scales = fake<const float>(0x4000),
                             .rope_scales = fake<const float>(0x5000),
                             .block_tables = fake<const int32_t>(0x6000),
                             .seq_lens = fake<const int32_t>(0x7000),
                             .out = fake<__nv_bfloat16>(0x8000),
                             .num_seqs = 300,  // one split: no workspace
                             .num_heads = 16,
                             .latent_dim = 512,
                             .rope_dim = 64,
                             .block_size = 16,
                             .num_blocks = 4,
                             .max_blocks_per_seq = 4,
                             .max_seq_len = 64,
                             .scale = 0.1f};
  auto refuse = [&](auto edit, const std::string& needle) {
    MlaDecodeParams p = good;
    edit(p);
    testing_util::expect_error_naming([&] { mla_decode_attention(p, nullptr); }, needle);
  };
  refuse([](MlaDecodeParams& p) { p.cache = fake<const __nv_bfloat16>(0x9000); }, "exclusive");
  refuse([](MlaDecodeParams& p) { p.rope_scales = nullptr; }, "rope_scales");
  refuse([](MlaDecodeParams& p) { p.latent_codes = nullptr; }, "latent_codes");
  refuse([](MlaDecodeParams& p) { p.latent_codes = fake<const uint8_t>(0x2004); }, "latent_codes");
  refuse([](MlaDecodeParams& p) { p.rope_codes = fake<const uint8_t>(0x3002); }, "rope_codes");
  refuse([](MlaDecodeParams& p) { p.latent_scales = fake<const float>(0x4002); }, "latent_scales");
  // Neither form: the bf16 cache is asked for.
  refuse(
      [](MlaDecodeParams& p) {
        p.latent_codes = p.rope_codes = nullptr;
        p.latent_scales = p.rope_scales = nullptr;
      },
      "cache is null");
}

// ---- the CPU oracle -------------------------------------------------------------------------

// One MLA row (L latent values, R rope values) encoded by the CPU pool's encoder.
struct CpuMlaRow {
  float latent_scale = 0.0f, rope_scale = 0.0f;
  std::vector<uint8_t> codes;  // [L + R]
  std::vector<float> decoded;  // [L + R], decode_kv_row of the encoding
};

CpuMlaRow cpu_encode(const float* values, int64_t L, int64_t R) {
  const int64_t groups[] = {L, R};
  std::vector<std::byte> bytes(static_cast<size_t>(kv_row_bytes(KvDType::kFP8, groups)));
  encode_kv_row(KvDType::kFP8, groups, values, bytes.data());
  CpuMlaRow row;
  std::memcpy(&row.latent_scale, bytes.data(), sizeof(float));
  std::memcpy(&row.rope_scale, bytes.data() + sizeof(float), sizeof(float));
  row.codes.resize(L + R);
  std::memcpy(row.codes.data(), bytes.data() + 2 * sizeof(float), static_cast<size_t>(L + R));
  row.decoded.resize(L + R);
  decode_kv_row(KvDType::kFP8, groups, bytes.data(), 0, L + R, row.decoded.data());
  return row;
}

// ---- quantise on write ----------------------------------------------------------------------

// The decoder's write of T padded rows [T, W] (W = Lp + Rp) into the fp8 planes, against
// encode_kv_row. The latent and the rope key of each row get sizes 2^[-8, 6] apart, so their
// scales differ; token 0's latent is all zeros (scale 1, codes 0).
void mla_write_encodes_as_cpu(int64_t T, int64_t L, int64_t R) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7 + L * 3 + R));
  const int64_t Lp = (L + 7) / 8 * 8, Rp = (R + 7) / 8 * 8, W = Lp + Rp;
  const int64_t num_slots = 2 * T + 5;
  std::vector<uint16_t> src(T * W, 0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-8, 6);
  for (int64_t t = 0; t < T; ++t) {
    const float latent_size = std::ldexp(1.0f, exponent(rng));
    const float rope_size = std::ldexp(1.0f, exponent(rng));
    for (int64_t d = 0; d < L; ++d)
      src[t * W + d] = t == 0 ? 0 : f32_to_bf16(normal(rng) * latent_size);
    for (int64_t d = 0; d < R; ++d) src[t * W + Lp + d] = f32_to_bf16(normal(rng) * rope_size);
  }
  std::vector<int32_t> slots(T);
  for (int64_t t = 0; t < T; ++t) slots[t] = t % 4 == 2 ? -1 : static_cast<int32_t>(2 * t + 3);
  DeviceBuffer<uint16_t> d_src(src);
  DeviceBuffer<int32_t> d_slots(slots);
  DeviceBuffer<uint8_t> latent_codes(num_slots * Lp), rope_codes(num_slots * Rp);
  DeviceBuffer<float> latent_scales(num_slots), rope_scales(num_slots);
  latent_codes.poison();
  rope_codes.poison();
  latent_scales.poison();
  rope_scales.poison();
  // As CudaDecoder::mla_attention writes them.
  kv_cache_write_fp8({.src = d_src.as_bf16(),
                      .codes = latent_codes.get(),
                      .scales = latent_scales.get(),
                      .slots = d_slots.get(),
                      .num_tokens = T,
                      .num_heads = 1,
                      .head_width = Lp,
                      .src_stride = W,
                      .num_slots = num_slots},
                     nullptr);
  kv_cache_write_fp8({.src = d_src.as_bf16() + Lp,
                      .codes = rope_codes.get(),
                      .scales = rope_scales.get(),
                      .slots = d_slots.get(),
                      .num_tokens = T,
                      .num_heads = 1,
                      .head_width = Rp,
                      .src_stride = W,
                      .num_slots = num_slots},
                     nullptr);
  testing_util::synchronize();
  const auto lc = latent_codes.download(), rc = rope_codes.download();
  const auto ls = latent_scales.download(), rs = rope_scales.download();
  EXPECT_EQ(d_src.download(), src) << "the source rows were rewritten (no write-back for MLA)";

  int64_t scale_diffs = 0, code_diffs = 0, touched = 0;
  std::string first;
  auto note = [&](const std::string& what) {
    if (first.empty()) first = what;
  };
  std::vector<bool> written(num_slots, false);
  std::vector<float> row(L + R);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    const int64_t s = slots[t];
    written[s] = true;
    for (int64_t d = 0; d < L; ++d) row[d] = bf16_to_f32(src[t * W + d]);
    for (int64_t d = 0; d < R; ++d) row[L + d] = bf16_to_f32(src[t * W + Lp + d]);
    const CpuMlaRow want = cpu_encode(row.data(), L, R);
    if (t == 0) EXPECT_EQ(want.latent_scale, 1.0f) << "an all-zero latent's scale";
    const std::string where = "token " + std::to_string(t);
    if (bits_of(ls[s]) != bits_of(want.latent_scale)) {
      ++scale_diffs;
      note(where + ": latent scale " + std::to_string(ls[s]) + ", want " +
           std::to_string(want.latent_scale));
    }
    if (bits_of(rs[s]) != bits_of(want.rope_scale)) {
      ++scale_diffs;
      note(where + ": rope scale " + std::to_string(rs[s]) + ", want " +
           std::to_string(want.rope_scale));
    }
    for (int64_t d = 0; d < Lp; ++d) {
      const uint8_t expect = d < L ? want.codes[d] : 0;
      if (lc[s * Lp + d] != expect) {
        ++code_diffs;
        note(where + " latent dim " + std::to_string(d) + ": code " +
             std::to_string(lc[s * Lp + d]) + ", want " + std::to_string(expect));
      }
    }
    for (int64_t d = 0; d < Rp; ++d) {
      const uint8_t expect = d < R ? want.codes[L + d] : 0;
      if (rc[s * Rp + d] != expect) {
        ++code_diffs;
        note(where + " rope dim " + std::to_string(d) + ": code " + std::to_string(rc[s * Rp + d]) +
             ", want " + std::to_string(expect));
      }
    }
  }
  for (int64_t s = 0; s < num_slots; ++s) {
    if (written[s]) continue;
    for (int64_t d = 0; d < Lp; ++d) touched += lc[s * Lp + d] != kPoisonCode;
    for (int64_t d = 0; d < Rp; ++d) touched += rc[s * Rp + d] != kPoisonCode;
    touched += (bits_of(ls[s]) != kPoisonScale) + (bits_of(rs[s]) != kPoisonScale);
  }
  EXPECT_EQ(scale_diffs, 0) << "scales that differ from encode_kv_row's; first: " << first;
  EXPECT_EQ(code_diffs, 0) << "codes that differ from encode_kv_row's; first: " << first;
  EXPECT_EQ(touched, 0) << "codes or scales written outside the rows' slots";
}

// ---- decode over an fp8 cache ---------------------------------------------------------------

struct MlaFp8Case {
  std::vector<int32_t> seq_lens;
  int64_t L, R, Nh, block_size;
  bool expect_split;
  bool expect_wide;
  int64_t fixed_chunk = 0;       // > 0: --deterministic's fixed splits
  bool shared_sequence = false;  // prefill layout: every row reads one sequence's blocks
};

void mla_decode_over_fp8(const MlaFp8Case& c) {
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.L * 131 + c.R * 17 + c.Nh * 7 + c.block_size +
                                         c.seq_lens.size() * 1009 + c.fixed_chunk * 3));
  const int64_t B = static_cast<int64_t>(c.seq_lens.size());
  const int64_t L = c.L, R = c.R, W = L + R, bs = c.block_size;
  const int64_t max_len =
      std::max<int64_t>(0, *std::max_element(c.seq_lens.begin(), c.seq_lens.end()));
  const int64_t max_blocks = std::max<int64_t>(1, (max_len + bs - 1) / bs);
  auto blocks_of = [&](int64_t len) { return (len + bs - 1) / bs; };
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
  const int32_t spare = pool[used];  // fills the table entries past each sequence's last block
  std::vector<int32_t> tables(B * max_blocks, spare);
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t own = c.shared_sequence ? blocks_of(max_len) : blocks_of(c.seq_lens[b]);
    if (c.shared_sequence) next = 0;
    for (int64_t i = 0; i < own; ++i) tables[b * max_blocks + i] = pool[next++];
  }
  // Every slot NaN (codes, scales and the bf16 twin), then the slots a sequence may read: rows
  // of normal values, the latent and the rope key each of its own size (2^[-3, 2]), encoded by
  // the CPU encoder; the bf16 cache gets bf16 of the decoded values.
  const int64_t slots = num_blocks * bs;
  std::vector<uint8_t> latent_codes(slots * L, kNanCode), rope_codes(slots * R, kNanCode);
  std::vector<float> latent_scales(slots, NAN), rope_scales(slots, NAN);
  std::vector<uint16_t> cache(slots * W, kNanBf16);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-3, 2);
  std::vector<float> row(W);
  auto slot_of = [&](int64_t b, int64_t t) {
    return static_cast<int64_t>(tables[b * max_blocks + t / bs]) * bs + t % bs;
  };
  for (int64_t b = 0; b < (c.shared_sequence ? 1 : B); ++b) {
    const int64_t len = c.shared_sequence ? max_len : c.seq_lens[b];
    for (int64_t t = 0; t < len; ++t) {
      const float latent_size = std::ldexp(1.0f, exponent(rng));
      const float rope_size = std::ldexp(1.0f, exponent(rng));
      for (int64_t d = 0; d < L; ++d) row[d] = normal(rng) * latent_size;
      for (int64_t d = 0; d < R; ++d) row[L + d] = normal(rng) * rope_size;
      const CpuMlaRow enc = cpu_encode(row.data(), L, R);
      const int64_t s = slot_of(b, t);
      std::copy_n(enc.codes.begin(), L, latent_codes.begin() + s * L);
      std::copy_n(enc.codes.begin() + L, R, rope_codes.begin() + s * R);
      latent_scales[s] = enc.latent_scale;
      rope_scales[s] = enc.rope_scale;
      for (int64_t i = 0; i < W; ++i) cache[s * W + i] = f32_to_bf16(enc.decoded[i]);
    }
  }
  const auto q = testing_util::random_bf16(B * c.Nh * W, rng);
  const float scale = 1.5f / std::sqrt(static_cast<float>(W));  // DeepSeek's peakier softmax

  MlaDecodeParams p{.num_seqs = B,
                    .num_heads = c.Nh,
                    .latent_dim = L,
                    .rope_dim = R,
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
  DeviceBuffer<uint16_t> d_q(q), d_cache(cache);
  DeviceBuffer<uint16_t> out_bf16(B * c.Nh * L), out_fp8(B * c.Nh * L);
  DeviceBuffer<uint8_t> d_lc(latent_codes), d_rc(rope_codes);
  DeviceBuffer<float> d_ls(latent_scales), d_rs(rope_scales);
  DeviceBuffer<int32_t> d_tables(tables), d_lens(c.seq_lens);
  DeviceBuffer<float> d_ws(std::max<int64_t>(1, mla_decode_workspace_size(p)));
  out_bf16.poison();
  out_fp8.poison();
  d_ws.poison();
  p.q = d_q.as_bf16();
  p.block_tables = d_tables.get();
  p.seq_lens = d_lens.get();
  p.workspace = d_ws.get();
  MlaDecodeParams bf16_rows = p;
  bf16_rows.cache = d_cache.as_bf16();
  bf16_rows.out = out_bf16.as_bf16();
  mla_decode_attention(bf16_rows, nullptr);
  testing_util::synchronize();
  d_ws.poison();
  MlaDecodeParams fp8_rows = p;
  fp8_rows.latent_codes = d_lc.get();
  fp8_rows.rope_codes = d_rc.get();
  fp8_rows.latent_scales = d_ls.get();
  fp8_rows.rope_scales = d_rs.get();
  fp8_rows.out = out_fp8.as_bf16();
  mla_decode_attention(fp8_rows, nullptr);
  testing_util::synchronize();

  const auto want = out_bf16.download(), got = out_fp8.download();
  int64_t not_finite = 0, differ = 0, first = -1;
  double max_rel = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = bf16_to_f32(got[i]), w = bf16_to_f32(want[i]);
    if (!std::isfinite(g) || !std::isfinite(w)) ++not_finite;
    if (got[i] != want[i]) {
      ++differ;
      if (first < 0) first = static_cast<int64_t>(i);
      max_rel = std::max(max_rel, std::fabs(double{g} - w) / std::max(1e-6, std::fabs(double{w})));
    }
  }
  EXPECT_EQ(not_finite, 0) << "outputs that are not finite (a slot no sequence may read was "
                              "read, or the output was not written)";
  EXPECT_EQ(differ, 0) << "outputs over fp8 rows that differ from those over the decoded bf16 "
                          "rows; first at "
                       << first << " (row " << (first >= 0 ? first / (c.Nh * L) : -1)
                       << "), largest relative difference " << max_rel;
}

std::vector<int32_t> lengths(std::vector<int32_t> head, int64_t count, int32_t modulus) {
  for (int64_t i = static_cast<int64_t>(head.size()); i < count; ++i)
    head.push_back(static_cast<int32_t>((i * 37 + 11) % modulus));
  return head;
}

std::vector<int32_t> positions_plus_one(int64_t count) {
  std::vector<int32_t> v(count);
  std::iota(v.begin(), v.end(), 1);
  return v;
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!testing_util::cuda_device_present("MLA fp8 KV")) return false;
  struct WriteShape {
    int64_t T, L, R;
  };
  for (const WriteShape& w :
       {WriteShape{1, 512, 64}, WriteShape{37, 512, 64}, WriteShape{19, 36, 12},
        WriteShape{5, 1024, 64}, WriteShape{99, 8, 576}}) {
    const std::string name =
        "Write_T" + std::to_string(w.T) + "_L" + std::to_string(w.L) + "_R" + std::to_string(w.R);
    testing_util::register_kernel_test(
        "CudaMlaKvFp8Write", name, [w] { mla_write_encodes_as_cpu(w.T, w.L, w.R); }, __FILE__,
        __LINE__);
  }
  const std::vector<int32_t> odd = {1, 19, 99, 989};
  const std::vector<int32_t> odd_and_empty = {1, 0, 19, 99, 989};
  struct Named {
    const char* name;
    MlaFp8Case c;
  };
  const Named cases[] = {
      // DeepSeek's 512 + 64 (the register kernel): batch 1 (many splits), a few rows (some
      // splits), 40 rows of 16 heads, one split of 264 x 1 tile, 128 heads, block sizes 1 to 64.
      {"L512_R64_H16_B1_Len1", {{1}, 512, 64, 16, 16, false, false}},
      {"L512_R64_H16_B1_Len3000_Split", {{3000}, 512, 64, 16, 64, true, false}},
      {"L512_R64_H16_Odd_Split", {odd_and_empty, 512, 64, 16, 16, true, false}},
      {"L512_R64_H128_Odd_Block8_Split", {odd, 512, 64, 128, 8, true, false}},
      {"L512_R64_H16_B40_Split", {lengths(odd, 40, 300), 512, 64, 16, 16, true, false}},
      {"L512_R64_H16_B264_Unsplit", {lengths(odd, 264, 65), 512, 64, 16, 16, false, false}},
      {"L512_R64_H20_Odd_Block1_Unsplit", {{19, 7, 33}, 512, 64, 20, 1, false, false}},
      {"L512_R64_H16_Fixed256", {odd_and_empty, 512, 64, 16, 16, true, false, 256}},
      {"L512_R64_H16_Prefill_T100",
       {positions_plus_one(100), 512, 64, 16, 16, true, false, 0, true}},
      // The padded fixture's 40 + 16 (L / 16 not whole) and a small latent.
      {"L40_R16_H20_Odd_Split", {odd_and_empty, 40, 16, 20, 16, true, false}},
      {"L32_R8_H4_B3", {{17, 300, 5}, 32, 8, 4, 48, true, false}},
      // Wide latents and rows (the streaming kernel).
      {"Wide_L1024_R64_H16_Odd_Split", {odd_and_empty, 1024, 64, 16, 16, true, true}},
      {"Wide_L1000_R64_H20_Split", {odd, 1000, 64, 20, 16, true, true}},
      {"Wide_L512_R72_H16_Split", {odd, 512, 72, 16, 16, true, true}},
      {"Wide_L8_R576_H4_Block24", {odd, 8, 576, 4, 24, true, true}},
      {"Wide_L768_R128_H128_Unsplit", {lengths(odd, 33, 65), 768, 128, 128, 16, false, true}},
      {"Wide_L1024_R64_H16_Fixed64", {odd_and_empty, 1024, 64, 16, 16, true, true, 64}},
      {"Wide_Prefill_L1024_R64_H16_T99",
       {positions_plus_one(99), 1024, 64, 16, 16, true, true, 0, true}},
  };
  for (const Named& n : cases) {
    testing_util::register_kernel_test(
        "CudaMlaKvFp8Decode", n.name, [c = n.c] { mla_decode_over_fp8(c); }, __FILE__, __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
