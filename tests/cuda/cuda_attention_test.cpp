// Embedding gather, RoPE, paged decode attention and causal prefill attention
// (backend/cuda/attention.h) against CPU references on fresh random inputs, outputs poisoned
// first. RoPE is held to moeinfer::Rope (the CPU decoder's own, default and yarn inverse
// frequencies, rotate-half and interleaved, partial rotary dims); attention to a float64
// softmax. Awkward sizes: sequence lengths 0, 1, 17, 1000, 3000 (several splits), shuffled
// block tables, GQA groups 1, 4, 6, 8 and, past one decode block's 16 heads, 24, 32 and 40; head
// dims 64, 128, 256, and for decode the padded dims above 256 (CudaPagedDecode.Wide*: 320, 384,
// 512, 640, 1024, some with the model's 272 or 1000 dims and zeros past them; odd lengths 1, 19,
// 99, 989; windows; fixed chunks). bf16 tolerance 1e-2 of the output's natural scale. Both
// decode kernels (the tensor-core default, CudaPagedDecode.Mma_*, and the CUDA-core one) and
// both prefill kernels (mma.sync and CUDA cores, hopper off: the Hopper one has
// cuda_prefill_wgmma_test.cpp) are held to the same reference, with and without a sliding window (Win*:
// windows of 1, below, at and above the lengths, starting mid-block, split and unsplit); in the
// decode cases the cached keys before each window are NaN, so a kernel that reads them fails.
// Window cases first run on an H200 when added: all pass, memcheck and racecheck clean on the
// small ones, and kernels with the window start or the window mask removed fail them.
// Attention sinks (GPT-OSS, *Sinks_*): a random sink logit per head joins the reference's
// softmax denominator; decode single-split, split, fixed-chunk and wide cases, prefill on both
// kernels, and ChunkedPrompt_* rows that share one block table (a prompt chunk's queries over
// the sequence's earlier blocks). Written without a GPU; not yet run on one. Chunked local
// attention (Llama 4, *Chunk*): each query sees only its own block of C positions; the decode
// cases NaN the keys before each chunk's start as the window cases do; decode, prefill, a prompt
// chunk's queries over a shared table, fixed chunks and the wide kernel. Also written without a
// GPU.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "backend/cuda/attention.h"
#include "cuda_test_util.h"
#include "model/rope.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

TEST(CudaAttentionChecks, RefuseBadShapes) {
  alignas(16) uint16_t buf[64] = {};
  int32_t ids[4] = {};
  auto* b = reinterpret_cast<__nv_bfloat16*>(buf);
  expect_error_naming(
      [&] {
        embedding(EmbeddingParams{.token_ids = ids,
                                  .table = b,
                                  .out = b,
                                  .num_tokens = 1,
                                  .vocab_size = 4,
                                  .hidden_size = 12},
                  nullptr);
      },
      "hidden_size = 12");
  float inv_freq[4] = {};
  RopeParams rp{.q = b,
                .positions = ids,
                .inv_freq = inv_freq,
                .num_tokens = 1,
                .num_q_heads = 1,
                .head_dim = 8,
                .rotary_dim = 9,
                .q_stride = 8};
  expect_error_naming([&] { rope(rp, nullptr); }, "rotary_dim = 9");
  PagedDecodeParams dp{.q = b,
                       .k_cache = b,
                       .v_cache = b,
                       .block_tables = ids,
                       .seq_lens = ids,
                       .out = b,
                       .num_seqs = 1,
                       .num_q_heads = 6,
                       .num_kv_heads = 4,
                       .head_dim = 128,
                       .block_size = 16,
                       .num_blocks = 1,
                       .max_blocks_per_seq = 1,
                       .max_seq_len = 16,
                       .scale = 0.1f};
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "num_q_heads = 6");
  dp.num_q_heads = 8;
  dp.head_dim = 96;
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "head_dim = 96");
  dp.head_dim = 288;  // above 256 the head dim is padded to a multiple of 64
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "head_dim = 288");
  dp.head_dim = 128;
  dp.max_seq_len = 17;
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "max_seq_len = 17");
  dp.max_seq_len = 16;
  dp.sliding_window = -1;
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "sliding_window = -1");
  dp.sliding_window = 0;
  dp.attention_chunk = -1;
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "attention_chunk = -1");
  dp.attention_chunk = 64;
  dp.sliding_window = 32;
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "are exclusive");
  dp.attention_chunk = 0;
  dp.sliding_window = 0;
  dp.q = b + 1;  // 2 bytes off: the tensor-core default refuses it and names the way out
  expect_error_naming([&] { paged_decode_attention(dp, nullptr); }, "tensor_cores = false");
  PrefillParams pp{.q = b,
                   .k = b,
                   .v = b,
                   .cu_seqlens = ids,
                   .out = b,
                   .num_tokens = 4,
                   .num_seqs = 1,
                   .max_seq_len = 4,
                   .num_q_heads = 2,
                   .num_kv_heads = 1,
                   .head_dim = 256,
                   .scale = 0.1f};
  expect_error_naming([&] { prefill_attention(pp, nullptr); }, "head_dim = 256");
  pp.head_dim = 128;
  pp.sliding_window = -1;
  expect_error_naming([&] { prefill_attention(pp, nullptr); }, "sliding_window = -1");
  pp.sliding_window = 0;
  pp.attention_chunk = -1;
  expect_error_naming([&] { prefill_attention(pp, nullptr); }, "attention_chunk = -1");
  pp.attention_chunk = 64;
  pp.sliding_window = 32;
  expect_error_naming([&] { prefill_attention(pp, nullptr); }, "are exclusive");
}

// A chunked layer's query sees at most attention_chunk keys: its splits and workspace are
// planned as a sliding window of that width would be, never over the whole context.
TEST(CudaAttentionChecks, ChunkedAttentionPlansOverOneChunk) {
  for (const bool tensor_cores : {true, false})
    for (const int64_t fixed_chunk : {int64_t{0}, int64_t{256}}) {
      if (fixed_chunk > 0 && !tensor_cores) continue;  // the CUDA-core kernel refuses them
      PagedDecodeParams chunked{.num_seqs = 3, .num_q_heads = 40, .num_kv_heads = 8,
                                .head_dim = 128, .block_size = 16, .max_blocks_per_seq = 4096,
                                .max_seq_len = 65536, .scale = 0.1f, .attention_chunk = 8192,
                                .tensor_cores = tensor_cores, .fixed_chunk = fixed_chunk};
      PagedDecodeParams windowed = chunked;
      windowed.attention_chunk = 0;
      windowed.sliding_window = 8192;
      const DecodeSplit a = paged_decode_split(chunked), b = paged_decode_split(windowed);
      EXPECT_EQ(a.chunk, b.chunk);
      EXPECT_EQ(a.num_splits, b.num_splits);
      EXPECT_LE(a.chunk * (a.num_splits - 1), 8192) << "a split past the chunk's keys";
      EXPECT_EQ(paged_decode_workspace_size(chunked), paged_decode_workspace_size(windowed));
      EXPECT_EQ(paged_decode_workspace_bound(chunked), paged_decode_workspace_bound(windowed));
      // A context shorter than the chunk: planned over the context.
      chunked.max_seq_len = windowed.max_seq_len = 1000;
      EXPECT_EQ(paged_decode_split(chunked).num_splits, paged_decode_split(windowed).num_splits);
    }
}

TEST(CudaAttentionChecks, HeadDimsArePaddedToWhatTheDecodeKernelsTake) {
  const std::pair<int64_t, int64_t> padded[] = {{1, 64},    {64, 64},     {65, 128},   {200, 256},
                                                {256, 256}, {257, 320},   {272, 320},  {320, 320},
                                                {321, 384}, {1000, 1024}, {4096, 4096}};
  for (const auto& [dim, want] : padded) {
    EXPECT_EQ(decode_padded_head_dim(dim), want) << dim;
    EXPECT_TRUE(decode_head_dim_supported(want)) << want;
  }
  for (const int64_t dim : {32, 96, 192, 272, 288, 1000})
    EXPECT_FALSE(decode_head_dim_supported(dim)) << dim;
}

// Above 256 the decode kernel streams any chunk (as the tensor-core kernel does), so it splits
// only to fill the GPU whatever tensor_cores says; the CUDA-core kernel of D <= 256 stops at 512
// keys a split.
TEST(CudaAttentionChecks, WideHeadDimsSplitOnlyToFillTheGpu) {
  PagedDecodeParams p{.num_seqs = 1,
                      .num_q_heads = 8,
                      .num_kv_heads = 2,
                      .head_dim = 1024,
                      .block_size = 16,
                      .max_blocks_per_seq = 4096,
                      .max_seq_len = 65536,
                      .scale = 0.1f,
                      .tensor_cores = false};
  const DecodeSplit wide = paged_decode_split(p);
  EXPECT_GT(wide.chunk, 512);
  EXPECT_LE(wide.num_splits, 264 / 4);  // 2 KV heads x 2 dim tiles per split
  EXPECT_EQ(paged_decode_workspace_size(p), 8 * wide.num_splits * (1024 + 2));
  p.head_dim = 128;
  EXPECT_EQ(paged_decode_split(p).chunk, 512);
  // --deterministic's fixed chunk is taken as it is.
  p.head_dim = 320;
  p.fixed_chunk = 4096;
  EXPECT_EQ(paged_decode_split(p).chunk, 4096);
  EXPECT_EQ(paged_decode_split(p).num_splits, 16);
}

// The decoder sizes its split workspace once, by paged_decode_workspace_bound at its largest row
// count and context; every launch it makes, with fewer rows or a shorter context, must fit. The
// exact size is not monotone (with Nq = Nkv = 3 at context 64, 87 rows need more than 64 and
// 128 rows do), so every (rows, context) up to the bound's is tried.
TEST(CudaAttentionChecks, WorkspaceBoundCoversEveryLaunchUpToIt) {
  struct Shape {
    int64_t nq, nkv, d;
    bool tensor_cores;
    int64_t window, fixed_chunk;
  };
  const Shape shapes[] = {{3, 3, 128, true, 0, 0},   {32, 4, 128, true, 0, 0},
                          {32, 4, 128, false, 0, 0}, {48, 2, 256, true, 100, 0},
                          {8, 2, 320, true, 0, 0},   {24, 1, 1024, false, 0, 0},
                          {16, 8, 640, true, 37, 0}, {12, 3, 64, true, 0, 256},
                          {24, 1, 512, true, 300, 320}};
  for (const Shape& s : shapes) {
    for (const int64_t max_rows : {1, 7, 130}) {
      for (const int64_t max_len : {64, 777, 4100}) {
        PagedDecodeParams p{.num_seqs = max_rows,
                            .num_q_heads = s.nq,
                            .num_kv_heads = s.nkv,
                            .head_dim = s.d,
                            .block_size = 16,
                            .max_blocks_per_seq = (max_len + 15) / 16,
                            .max_seq_len = max_len,
                            .scale = 0.1f,
                            .sliding_window = s.window,
                            .tensor_cores = s.tensor_cores,
                            .fixed_chunk = s.fixed_chunk};
        const int64_t bound = paged_decode_workspace_bound(p);
        int64_t worst = 0;
        for (int64_t rows = 1; rows <= max_rows; ++rows)
          for (int64_t len = 1; len <= max_len; ++len) {
            p.num_seqs = rows;
            p.max_seq_len = len;
            worst = std::max(worst, paged_decode_workspace_size(p));
          }
        EXPECT_LE(worst, bound) << "Nq " << s.nq << " Nkv " << s.nkv << " D " << s.d
                                << (s.tensor_cores ? "" : " CUDA cores") << " window "
                                << s.window << " fixed_chunk " << s.fixed_chunk << ": "
                                << max_rows << " rows, context " << max_len;
        // Not far above what some launch needs: at most twice, plus one row.
        EXPECT_LE(bound, 2 * worst + s.nq * (s.d + 2) * 2) << "Nq " << s.nq << " D " << s.d;
      }
    }
  }
}

void embedding_random(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T));
  const int64_t V = 1003, H = 264;
  const auto table = random_bf16(V * H, rng);
  std::vector<int32_t> ids(T);
  for (auto& id : ids) id = std::uniform_int_distribution<int32_t>(0, V - 1)(rng);
  DeviceBuffer<uint16_t> d_table(table), d_out(T * H);
  DeviceBuffer<int32_t> d_ids(ids);
  d_out.poison();
  embedding(EmbeddingParams{.token_ids = d_ids.get(),
                            .table = d_table.as_bf16(),
                            .out = d_out.as_bf16(),
                            .num_tokens = T,
                            .vocab_size = V,
                            .hidden_size = H},
            nullptr);
  synchronize();
  const auto got = d_out.download();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      ASSERT_EQ(got[t * H + h], table[ids[t] * H + h]) << "token " << t << " dim " << h;
}

// The float32 stream from a table in two bf16 terms: row = hi + lo, summed in float32.
void embedding_two_terms(int64_t T) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 7));
  const int64_t V = 1003, H = 264;
  const auto hi = random_bf16(V * H, rng), lo = random_bf16(V * H, rng, 0.01f);
  std::vector<int32_t> ids(T);
  for (auto& id : ids) id = std::uniform_int_distribution<int32_t>(0, V - 1)(rng);
  DeviceBuffer<uint16_t> d_hi(hi), d_lo(lo);
  DeviceBuffer<float> d_out(T * H);
  DeviceBuffer<int32_t> d_ids(ids);
  d_out.poison();
  embedding(EmbeddingParams{.token_ids = d_ids.get(),
                            .table = d_hi.as_bf16(),
                            .table_lo = d_lo.as_bf16(),
                            .out_f32 = d_out.get(),
                            .num_tokens = T,
                            .vocab_size = V,
                            .hidden_size = H},
            nullptr);
  synchronize();
  const auto got = d_out.download();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t at = ids[t] * H + h;
      ASSERT_EQ(got[t * H + h], bf16_to_f32(hi[at]) + bf16_to_f32(lo[at]))
          << "token " << t << " dim " << h;
    }
}

// MLA's layout: query heads of qk = nope + rope dims, rotated from offset nope, and one shared
// rope key at the end of each latent row of width L + rope, which can be narrower than qk (the
// launcher once refused k_stride < head_dim, so kv_lora_rank < qk_nope_head_dim never ran).
void rope_mla_shared_key() {
  std::mt19937 rng(fresh_seed());
  const int64_t T = 7, Nh = 3, nope = 64, R = 16, L = 24, qk = nope + R, W = L + R;
  RopeConfig config;
  const Rope reference(config, R, 4096);
  auto q = random_bf16(T * Nh * qk, rng);
  auto latent = random_bf16(T * W, rng);
  std::vector<int32_t> positions(T);
  for (auto& p : positions) p = std::uniform_int_distribution<int32_t>(0, 4095)(rng);
  DeviceBuffer<uint16_t> d_q(q), d_latent(latent);
  DeviceBuffer<int32_t> d_pos(positions);
  DeviceBuffer<float> d_inv(reference.inv_freq());
  rope(RopeParams{.q = d_q.as_bf16() + nope, .k = d_latent.as_bf16() + L,
                  .positions = d_pos.get(), .inv_freq = d_inv.get(), .num_tokens = T,
                  .num_q_heads = Nh, .num_kv_heads = 1, .head_dim = qk, .rotary_dim = R,
                  .q_stride = Nh * qk, .k_stride = W, .interleaved = true},
       nullptr);
  synchronize();
  const auto got_q = d_q.download(), got_latent = d_latent.download();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> key = to_float(std::vector<uint16_t>(latent.begin() + t * W + L,
                                                            latent.begin() + (t + 1) * W));
    const std::vector<float> before = key;
    reference.apply(key.data(), 1, R, positions[t], /*interleaved=*/true);
    for (int64_t i = 0; i < L; ++i) ASSERT_EQ(got_latent[t * W + i], latent[t * W + i]);
    for (int64_t i = 0; i < R; ++i) {
      EXPECT_NEAR(bf16_to_f32(got_latent[t * W + L + i]), key[i],
                  1e-2 * (std::fabs(before[i]) + std::fabs(key[i]) + 1e-2))
          << "token " << t << " dim " << i;
    }
    for (int64_t h = 0; h < Nh; ++h) {
      std::vector<float> head = to_float(std::vector<uint16_t>(
          q.begin() + (t * Nh + h) * qk + nope, q.begin() + (t * Nh + h + 1) * qk));
      const std::vector<float> head_before = head;
      reference.apply(head.data(), 1, R, positions[t], /*interleaved=*/true);
      for (int64_t i = 0; i < nope; ++i)
        ASSERT_EQ(got_q[(t * Nh + h) * qk + i], q[(t * Nh + h) * qk + i]) << "nope dim changed";
      for (int64_t i = 0; i < R; ++i) {
        EXPECT_NEAR(bf16_to_f32(got_q[(t * Nh + h) * qk + nope + i]), head[i],
                    1e-2 * (std::fabs(head_before[i]) + std::fabs(head[i]) + 1e-2));
      }
    }
  }
}

void rope_random(int64_t T, bool yarn, bool interleaved, int64_t rotary_dim) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(T * 3 + yarn + 7 * interleaved));
  const int64_t Nq = 5, Nkv = 2, D = 128;
  const int64_t q_stride = (Nq + 2 * Nkv) * D;  // q, k, v of one token in one fused row
  RopeConfig config;
  config.theta = 1e6;
  if (yarn) {
    config.type = "yarn";
    config.factor = 4.0;
    config.original_max_position_embeddings = 4096;
  }
  const Rope reference(config, rotary_dim, 32768);
  auto qkv = random_bf16(T * q_stride, rng);
  std::vector<int32_t> positions(T);
  for (auto& p : positions) p = std::uniform_int_distribution<int32_t>(0, 32767)(rng);
  DeviceBuffer<uint16_t> d_qkv(qkv);
  DeviceBuffer<int32_t> d_pos(positions);
  DeviceBuffer<float> d_inv(reference.inv_freq());
  rope(RopeParams{.q = d_qkv.as_bf16(),
                  .k = d_qkv.as_bf16() + Nq * D,
                  .positions = d_pos.get(),
                  .inv_freq = d_inv.get(),
                  .num_tokens = T,
                  .num_q_heads = Nq,
                  .num_kv_heads = Nkv,
                  .head_dim = D,
                  .rotary_dim = rotary_dim,
                  .q_stride = q_stride,
                  .k_stride = q_stride,
                  .attention_scaling = reference.attention_scaling(),
                  .interleaved = interleaved},
       nullptr);
  synchronize();
  const auto got = d_qkv.download();
  std::vector<double> want(T * (Nq + Nkv) * D), scale(want.size());
  std::vector<uint16_t> got_qk(want.size());
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> row = to_float(std::vector<uint16_t>(
        qkv.begin() + t * q_stride, qkv.begin() + t * q_stride + (Nq + Nkv) * D));
    std::vector<float> before = row;
    reference.apply(row.data(), Nq + Nkv, D, positions[t], interleaved);
    for (int64_t i = 0; i < (Nq + Nkv) * D; ++i) {
      want[t * (Nq + Nkv) * D + i] = row[i];
      scale[t * (Nq + Nkv) * D + i] =
          2.0 * reference.attention_scaling() * (std::fabs(before[i]) + 1e-3);
      got_qk[t * (Nq + Nkv) * D + i] = got[t * q_stride + i];
      if (i % D >= rotary_dim) {
        ASSERT_EQ(got[t * q_stride + i], qkv[t * q_stride + i]) << "unrotated dim changed";
      }
    }
    for (int64_t i = (Nq + Nkv) * D; i < q_stride; ++i)
      ASSERT_EQ(got[t * q_stride + i], qkv[t * q_stride + i]) << "v changed";
  }
  // The pair's other element enters with the same weight: bound by both magnitudes.
  for (size_t i = 0; i < scale.size(); ++i) scale[i] = std::max(scale[i], 1e-2);
  expect_bf16_near(got_qk, want, scale, "rotated q and k");
}

struct DecodeCase {
  std::vector<int32_t> seq_lens;
  int64_t Nq, Nkv, D, block_size;  // D: the kernel's (padded) head dim
  int64_t window = 0;              // PagedDecodeParams::sliding_window
  // The model's head dim before padding: q, k and v are zero in dims [head_dim, D), as the
  // decoder's padded weights make them, and the scale is 1/sqrt(head_dim). 0: D.
  int64_t head_dim = 0;
  int64_t fixed_chunk = 0;  // PagedDecodeParams::fixed_chunk (--deterministic)
  bool sinks = false;       // a random sink logit per query head (PagedDecodeParams::sinks)
  // Every row reads row 0's block table: the queries of one chunk of a prompt against the
  // sequence's earlier keys (the decoder's per-query route), each row one position further.
  bool shared_table = false;
  int64_t attention_chunk = 0;  // PagedDecodeParams::attention_chunk (Llama 4's chunked layers)
};

DecodeCase with_sinks(DecodeCase c) {
  c.sinks = true;
  return c;
}

// Random sink logits per head, in [-1, 3]: against scores of about +-1, from negligible to
// most of the denominator at short lengths.
std::vector<float> random_sinks(int64_t heads, std::mt19937& rng) {
  std::vector<float> sinks(heads);
  for (float& x : sinks) x = std::uniform_real_distribution<float>(-1.0f, 3.0f)(rng);
  return sinks;
}

// First key the decode query (position len - 1) sees under a window of W keys (0: none), or
// under chunked attention of C keys (0: none): the start of its position's chunk, as the CPU
// decoder's first_visible.
int64_t window_first(int64_t len, int64_t window, int64_t chunk = 0) {
  if (chunk > 0) return len > 0 ? (len - 1) / chunk * chunk : 0;
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

void decode_random(const DecodeCase& c, bool tensor_cores) {
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.D * 13 + c.Nq + c.seq_lens.size() + c.window * 7919 +
                                         c.attention_chunk * 104729));
  const int64_t B = static_cast<int64_t>(c.seq_lens.size());
  const int64_t max_len =
      std::max<int64_t>(1, *std::max_element(c.seq_lens.begin(), c.seq_lens.end()));
  const int64_t max_blocks = (max_len + c.block_size - 1) / c.block_size;
  const int64_t num_blocks = B * max_blocks + 3;
  // Shuffled block ids: sequences' blocks are scattered over the pool.
  std::vector<int32_t> pool(num_blocks);
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<int32_t> tables(B * max_blocks);
  for (int64_t i = 0; i < B * max_blocks; ++i) {
    tables[i] = pool[c.shared_table ? i % max_blocks : i];
  }
  const int64_t row = c.Nkv * c.D;
  auto k = random_bf16(num_blocks * c.block_size * row, rng);
  auto v = random_bf16(num_blocks * c.block_size * row, rng);
  auto q = random_bf16(B * c.Nq * c.D, rng);
  const int64_t head_dim = c.head_dim > 0 ? c.head_dim : c.D;
  for (auto* x : {&k, &v, &q})
    for (size_t i = 0; i < x->size(); ++i)
      if (static_cast<int64_t>(i) % c.D >= head_dim) (*x)[i] = 0;
  // Keys and values before each sequence's window are NaN (bf16 0x7fc0): reading one, even
  // under a zero weight, would make the output NaN.
  auto slot = [&](int64_t b, int64_t t) {
    return (tables[b * max_blocks + t / c.block_size] * c.block_size + t % c.block_size) * row;
  };
  // With a shared table a key before one row's window may be in an earlier row's: only the
  // keys before every row's window are NaN then.
  int64_t first_of_all = std::numeric_limits<int64_t>::max();
  for (int64_t b = 0; b < B; ++b) {
    first_of_all =
        std::min(first_of_all, window_first(c.seq_lens[b], c.window, c.attention_chunk));
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t hidden = c.shared_table ? first_of_all
                                          : window_first(c.seq_lens[b], c.window,
                                                         c.attention_chunk);
    for (int64_t t = 0; t < hidden; ++t)
      for (int64_t i = 0; i < row; ++i) k[slot(b, t) + i] = v[slot(b, t) + i] = 0x7fc0;
  }
  const std::vector<float> sinks = c.sinks ? random_sinks(c.Nq, rng) : std::vector<float>{};
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  PagedDecodeParams p{.num_seqs = B,
                      .num_q_heads = c.Nq,
                      .num_kv_heads = c.Nkv,
                      .head_dim = c.D,
                      .block_size = c.block_size,
                      .num_blocks = num_blocks,
                      .max_blocks_per_seq = max_blocks,
                      .max_seq_len = max_len,
                      .scale = scale,
                      .sliding_window = c.window,
                      .attention_chunk = c.attention_chunk,
                      .tensor_cores = tensor_cores,
                      .fixed_chunk = c.fixed_chunk};
  DeviceBuffer<uint16_t> d_q(q), d_k(k), d_v(v), d_out(B * c.Nq * c.D);
  DeviceBuffer<int32_t> d_tables(tables), d_lens(c.seq_lens);
  DeviceBuffer<float> d_ws(std::max<int64_t>(1, paged_decode_workspace_size(p)));
  DeviceBuffer<float> d_sinks(c.sinks ? sinks : std::vector<float>(1, 0.0f));
  d_out.poison();
  d_ws.poison();
  if (c.sinks) p.sinks = d_sinks.get();
  p.q = d_q.as_bf16();
  p.k_cache = d_k.as_bf16();
  p.v_cache = d_v.as_bf16();
  p.block_tables = d_tables.get();
  p.seq_lens = d_lens.get();
  p.out = d_out.as_bf16();
  p.workspace = d_ws.get();
  paged_decode_attention(p, nullptr);
  synchronize();
  if (tensor_cores && c.D <= 256) {
    // The splits merged by the last split block of each head group (split_tickets) instead of
    // the combine kernel: the same bits, twice in a row (the tickets come back to zero).
    const std::vector<uint16_t> combined = d_out.download();
    DeviceBuffer<int32_t> tickets(std::vector<int32_t>(B * c.Nq, 0));
    PagedDecodeParams merged = p;
    merged.split_tickets = tickets.get();
    for (int run = 0; run < 2; ++run) {
      d_out.poison();
      paged_decode_attention(merged, nullptr);
      synchronize();
      ASSERT_EQ(d_out.download(), combined) << "merged in the kernel, run " << run;
      ASSERT_EQ(tickets.download(), std::vector<int32_t>(B * c.Nq, 0)) << "tickets, run " << run;
    }
  }
  const auto kf = to_float(k), vf = to_float(v), qf = to_float(q);
  const int64_t G = c.Nq / c.Nkv;
  // Head dims above 256 run in float32 whatever tensor_cores says (P is not rounded to bf16).
  const bool p_in_bf16 = tensor_cores && c.D <= 256;
  std::vector<double> want(B * c.Nq * c.D, 0.0), bound(want.size(), 1e-3);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = c.seq_lens[b];
    const int64_t first = window_first(len, c.window, c.attention_chunk);
    const int64_t count = len - first;  // keys the query sees: [first, len)
    for (int64_t h = 0; h < c.Nq; ++h) {
      const int64_t kvh = h / G;
      std::vector<double> s(count);
      double m = -1e300;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t base = slot(b, first + i) + kvh * c.D;
        double dot = 0;
        for (int64_t d = 0; d < c.D; ++d)
          dot += static_cast<double>(qf[(b * c.Nq + h) * c.D + d]) * kf[base + d];
        s[i] = dot * scale;
        m = std::max(m, s[i]);
      }
      // A sink is one more logit of the softmax, with no value row.
      if (c.sinks) m = std::max(m, static_cast<double>(sinks[h]));
      double z = c.sinks ? std::exp(sinks[h] - m) : 0.0;
      const double sink_term = z;
      for (auto& x : s) z += (x = std::exp(x - m));
      // The keys' share of the softmax: the output's scale shrinks with it.
      const double keys_share = z > 0 ? (z - sink_term) / z : 1.0;
      std::vector<double> magnitude(c.D, 0.0);  // sum_t p_t |v_t|
      for (int64_t i = 0; i < count; ++i) {
        const int64_t base = slot(b, first + i) + kvh * c.D;
        for (int64_t d = 0; d < c.D; ++d) {
          want[(b * c.Nq + h) * c.D + d] += s[i] / z * vf[base + d];
          magnitude[d] += std::fabs(s[i] / z * vf[base + d]);
        }
      }
      // The output is a convex mix of values of size ~1: its natural scale is at least
      // 1/sqrt(keys seen) (a spread softmax); with P rounded to bf16 (the tensor-core path) the
      // error is bounded by 2^-9 of sum_t p_t |v_t|, so the scale is the larger of the two.
      for (int64_t d = 0; d < c.D; ++d) {
        const double spread =
            count > 0 ? keys_share / std::sqrt(static_cast<double>(count)) : 1e-6;
        bound[(b * c.Nq + h) * c.D + d] = p_in_bf16 ? std::max(spread, magnitude[d]) : spread;
      }
    }
  }
  expect_bf16_near(d_out.download(), want, bound, "decode out");
}

void prefill_random(std::vector<int32_t> lens, int64_t Nq, int64_t Nkv, int64_t D,
                    bool tensor_cores, int64_t window = 0, bool with_sinks = false,
                    int64_t chunk = 0) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(D * 17 + Nq + lens.size() + window * 7919 +
                                                        chunk * 104729));
  const int64_t B = static_cast<int64_t>(lens.size());
  std::vector<int32_t> cu(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + lens[b];
  const int64_t T = cu[B];
  const int64_t max_len = *std::max_element(lens.begin(), lens.end());
  const auto q = random_bf16(T * Nq * D, rng), k = random_bf16(T * Nkv * D, rng),
             v = random_bf16(T * Nkv * D, rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  DeviceBuffer<uint16_t> d_q(q), d_k(k), d_v(v), d_out(T * Nq * D);
  DeviceBuffer<int32_t> d_cu(cu);
  const std::vector<float> sinks = with_sinks ? random_sinks(Nq, rng) : std::vector<float>{};
  DeviceBuffer<float> d_sinks(with_sinks ? sinks : std::vector<float>(1, 0.0f));
  d_out.poison();
  prefill_attention(PrefillParams{.q = d_q.as_bf16(),
                                  .k = d_k.as_bf16(),
                                  .v = d_v.as_bf16(),
                                  .cu_seqlens = d_cu.get(),
                                  .out = d_out.as_bf16(),
                                  .num_tokens = T,
                                  .num_seqs = B,
                                  .max_seq_len = max_len,
                                  .num_q_heads = Nq,
                                  .num_kv_heads = Nkv,
                                  .head_dim = D,
                                  .scale = scale,
                                  .sliding_window = window,
                                  .attention_chunk = chunk,
                                  .sinks = with_sinks ? d_sinks.get() : nullptr,
                                  .tensor_cores = tensor_cores,
                                  .hopper = false},
                    nullptr);
  synchronize();
  const auto qf = to_float(q), kf = to_float(k), vf = to_float(v);
  const int64_t G = Nq / Nkv;
  std::vector<double> want(T * Nq * D, 0.0), bound(want.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < lens[b]; ++i) {
      const int64_t ti = cu[b] + i;
      // Keys [first, i] of the sequence: the causal prefix, cut to the last W under a window,
      // to i's own block of C positions under chunked attention.
      const int64_t first = chunk > 0    ? i / chunk * chunk
                            : window > 0 ? std::max<int64_t>(0, i - window + 1)
                                         : 0;
      const int64_t count = i - first + 1;
      for (int64_t h = 0; h < Nq; ++h) {
        std::vector<double> s(count);
        double m = -1e300;
        for (int64_t j = 0; j < count; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += static_cast<double>(qf[(ti * Nq + h) * D + d]) *
                   kf[((cu[b] + first + j) * Nkv + h / G) * D + d];
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        if (with_sinks) m = std::max(m, static_cast<double>(sinks[h]));
        double z = with_sinks ? std::exp(sinks[h] - m) : 0.0;
        const double sink_term = z;
        for (auto& x : s) z += (x = std::exp(x - m));
        const double keys_share = (z - sink_term) / z;
        // Natural scale: at least 1/sqrt(keys seen) (a spread softmax of unit values), and the
        // sum of the terms' magnitudes sum_j p_j |v_j|, which bounds the tensor-core path's
        // rounding of P to bf16 (2^-9 of each term) when the softmax is peaked.
        for (int64_t d = 0; d < D; ++d) bound[(ti * Nq + h) * D + d] = 0.0;
        for (int64_t j = 0; j < count; ++j)
          for (int64_t d = 0; d < D; ++d) {
            const double term = s[j] / z * vf[((cu[b] + first + j) * Nkv + h / G) * D + d];
            want[(ti * Nq + h) * D + d] += term;
            bound[(ti * Nq + h) * D + d] += std::fabs(term);
          }
        for (int64_t d = 0; d < D; ++d)
          bound[(ti * Nq + h) * D + d] =
              std::max(bound[(ti * Nq + h) * D + d],
                       keys_share / std::sqrt(static_cast<double>(count)));
      }
    }
  }
  expect_bf16_near(d_out.download(), want, bound, "prefill out");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("attention")) return false;
  auto reg = [](const char* suite, const std::string& name, std::function<void()> body) {
    register_kernel_test(suite, name, std::move(body), __FILE__, __LINE__);
  };
  for (int64_t T : {int64_t{1}, int64_t{19}, int64_t{989}}) {
    reg("CudaEmbedding", "Gather_T" + std::to_string(T), [T] { embedding_random(T); });
    reg("CudaEmbedding", "TwoTerms_T" + std::to_string(T), [T] { embedding_two_terms(T); });
  }
  for (bool yarn : {false, true})
    for (bool interleaved : {false, true})
      for (int64_t rd : {int64_t{128}, int64_t{64}})
        for (int64_t T : {int64_t{1}, int64_t{99}}) {
          const std::string name = std::string(yarn ? "Yarn" : "Default") +
                                   (interleaved ? "Interleaved" : "RotateHalf") + "_Rotary" +
                                   std::to_string(rd) + "_T" + std::to_string(T);
          reg("CudaRope", name, [=] { rope_random(T, yarn, interleaved, rd); });
        }
  reg("CudaRope", "MlaSharedKeyNarrowerThanQueryHeads", rope_mla_shared_key);
  struct Dc {
    const char* name;
    DecodeCase c;
  };
  const Dc decode_cases[] = {
      {"B1_Len1_G8_D128", {{1}, 32, 4, 128, 16}},
      {"B1_Len1000_G8_D128", {{1000}, 32, 4, 128, 16}},
      {"B3_Mixed_G4_D64", {{17, 0, 300}, 8, 2, 64, 32}},
      {"B2_Len3000_G1_D128", {{3000, 1234}, 4, 4, 128, 16}},
      {"B5_Mixed_G8_D256", {{1, 64, 65, 511, 700}, 16, 2, 256, 8}},
      {"B64_Len1024_G8_D128", {std::vector<int32_t>(64, 1024), 32, 4, 128, 16}},
      // Groups past one block's 16 heads: two and three head tiles per KV head, the last one
      // partial (MQA with 40 query heads; 32 heads over 1 KV head at D 64).
      {"B3_Mixed_G40_D128", {{1, 300, 1000}, 80, 2, 128, 16}},
      {"B2_Len700_G32_D64", {{700, 33}, 32, 1, 64, 16}},
      {"Win50_B2_G24_D256", {{77, 130}, 48, 2, 256, 8, 50}},
      // Sliding windows. Split counts as paged_decode_split plans them for the CUDA-core kernel
      // (chunks of at most 512 keys) over min(max_len, W) keys; the tensor-core kernel's splits
      // only fill the GPU, so its Mma_ twins split less. "first" is each sequence's first
      // visible key.
      // W 20 < len: 1 split, keys 980..999 cross the block boundary at 992.
      {"Win20_B1_Len1000_G8_D128", {{1000}, 32, 4, 128, 16, 20}},
      // 4 splits of 32 from key 900 (mid-block), the last holding 4 keys.
      {"Win100_B1_Len1000_G8_D128", {{1000}, 32, 4, 128, 16, 100}},
      // W 1: each head's output is the last value row; the empty sequence gets zeros.
      {"Win1_B3_Mixed_G4_D64", {{17, 0, 300}, 8, 2, 64, 32, 1}},
      // Lengths just below, at and above W, and far above it (first 800, block-aligned); 7
      // splits, of which a length-17 sequence uses 1.
      {"Win200_B5_AroundWindow_G4_D64", {{199, 200, 201, 17, 1000}, 8, 2, 64, 16, 200}},
      // 2 splits (32 + 5 keys), firsts 0, 27, 28, 474, 663 in 8-token blocks.
      {"Win37_B5_Mixed_G8_D256", {{1, 64, 65, 511, 700}, 16, 2, 256, 8, 37}},
      // 32 splits of 32 keys from 1976 and from 210.
      {"Win1024_B2_Len3000_G1_D128", {{3000, 1234}, 4, 4, 128, 16, 1024}},
      // W above every length: the same as no window (10 splits).
      {"Win4096_B3_Mixed_G4_D64", {{17, 0, 300}, 8, 2, 64, 32, 4096}},
      // G 6 (odd rows of the 16-row mma tile): 2 splits, firsts 27 and 80.
      {"Win50_B2_G6_D128", {{77, 130}, 12, 2, 128, 16, 50}},
      // 66 x 4 blocks fill the grid: 1 split of up to 300 keys, lengths on both sides of W.
      {"Win300_B66_Mixed_G8_D128",
       {[] {
          std::vector<int32_t> lens(66);
          for (int i = 0; i < 66; ++i) lens[i] = 1 + (37 * i) % 1000;
          return lens;
        }(),
        32, 4, 128, 16, 300}},
  };
  for (const Dc& d : decode_cases) {
    reg("CudaPagedDecode", d.name, [c = d.c] { decode_random(c, false); });
    reg("CudaPagedDecode", std::string("Mma_") + d.name, [c = d.c] { decode_random(c, true); });
  }
  // Attention sinks (GPT-OSS): one split written directly, several through the combine kernel,
  // under windows, large groups (two head tiles), --deterministic's fixed chunks; and the
  // queries of a prompt chunk over the sequence's earlier blocks (one shared block table, each
  // row one position further), full and windowed, the decoder's per-query route.
  auto chunk_rows = [](int32_t first_len, int32_t rows) {
    std::vector<int32_t> lens(rows);
    std::iota(lens.begin(), lens.end(), first_len);
    return lens;
  };
  const Dc sink_cases[] = {
      {"Sinks_B3_Mixed_G4_D64", with_sinks({{1, 17, 300}, 8, 2, 64, 32})},
      {"Sinks_B2_Len3000_G1_D128", with_sinks({{3000, 1234}, 4, 4, 128, 16})},
      {"Sinks_Win4_B3_Mixed_G2_D64", with_sinks({{1, 5, 77}, 4, 2, 64, 16, 4})},
      {"Sinks_Win128_B2_Len1000_G8_D64", with_sinks({{1000, 129}, 64, 8, 64, 16, 128})},
      {"Sinks_B3_Mixed_G40_D128", with_sinks({{1, 300, 1000}, 80, 2, 128, 16})},
      {"Sinks_Win37_B5_Mixed_G8_D256", with_sinks({{1, 64, 65, 511, 700}, 16, 2, 256, 8, 37})},
      {"Sinks_Chunk256_B3_Mixed_G4_D64",
       with_sinks({{989, 1, 257}, 8, 2, 64, 16, 0, 0, 256})},
      {"Sinks_Chunk256_Win100_B2_G8_D64",
       with_sinks({{989, 300}, 64, 8, 64, 16, 100, 0, 256})},
      {"Sinks_ChunkedPrompt_Rows19_From40_G8_D64",
       with_sinks({chunk_rows(40, 19), 64, 8, 64, 16, 0, 0, 0, true, true})},
      {"Sinks_ChunkedPrompt_Win4_Rows19_From40_G8_D64",
       with_sinks({chunk_rows(40, 19), 64, 8, 64, 16, 4, 0, 0, true, true})},
      {"ChunkedPrompt_Win50_Rows33_From100_G4_D128",
       {chunk_rows(100, 33), 8, 2, 128, 16, 50, 0, 0, false, true}},
  };
  // Chunked local attention (Llama 4): each query sees its own block of C positions. The
  // keys before each query's chunk start are NaN. Chunk starts inside a KV block and inside a
  // split (C 100 over 16-token blocks; lengths 1000 -> first 900, 3000 -> 2900 with splits of
  // 32), on a chunk boundary (len 201 with C 200: one key), just before it (len 200: 200 keys),
  // an empty sequence; a chunk above every length (the same as causal); the fixed chunks of
  // --deterministic; and a prompt chunk's queries over one shared table crossing a chunk
  // boundary (rows at positions 40..58 with C 50: firsts 0 and 50).
  auto chunked = [](DecodeCase c, int64_t chunk) {
    c.attention_chunk = chunk;
    return c;
  };
  const Dc chunk_cases[] = {
      {"Chunk100_B2_Len1000_3000_G8_D128", chunked({{1000, 3000}, 32, 4, 128, 16}, 100)},
      {"Chunk200_B5_AroundBoundary_G4_D64",
       chunked({{199, 200, 201, 0, 1000}, 8, 2, 64, 16}, 200)},
      {"Chunk37_B5_Mixed_G8_D256", chunked({{1, 64, 65, 511, 700}, 16, 2, 256, 8}, 37)},
      {"Chunk1_B3_Mixed_G4_D64", chunked({{17, 0, 300}, 8, 2, 64, 32}, 1)},
      {"Chunk8192_B3_Mixed_G4_D64", chunked({{17, 0, 300}, 8, 2, 64, 32}, 8192)},
      {"Chunk1000_B2_Len2999_G1_D128", chunked({{2999, 1001}, 4, 4, 128, 16}, 1000)},
      {"Chunk300_B66_Mixed_G8_D128", chunked({[] {
                                                std::vector<int32_t> lens(66);
                                                for (int i = 0; i < 66; ++i)
                                                  lens[i] = 1 + (37 * i) % 1000;
                                                return lens;
                                              }(),
                                              32, 4, 128, 16},
                                             300)},
      {"ChunkedPrompt_Chunk50_Rows19_From40_G4_D128",
       chunked({chunk_rows(40, 19), 8, 2, 128, 16, 0, 0, 0, false, true}, 50)},
  };
  for (const Dc& d : chunk_cases) {
    reg("CudaPagedDecode", d.name, [c = d.c] { decode_random(c, false); });
    reg("CudaPagedDecode", std::string("Mma_") + d.name, [c = d.c] { decode_random(c, true); });
  }
  // --deterministic's fixed chunks of 256 keys under an attention chunk of 300: a split holds
  // at most 256 keys of a 300-key chunk (tensor cores only).
  reg("CudaPagedDecode", "Mma_FixedChunk256_Chunk300_B3_Mixed_G4_D64", [chunked] {
    decode_random(chunked({{989, 1, 601}, 8, 2, 64, 16, 0, 0, 256}, 300), true);
  });
  // Head dims above 256: the wide kernel and its combine.
  reg("CudaPagedDecode", "Wide_Chunk100_B3_Odd_G4_D320", [chunked] {
    decode_random(chunked({{989, 19, 1}, 8, 2, 320, 16}, 100), true);
  });
  for (const Dc& d : sink_cases) {
    // Fixed chunks need the tensor-core kernel (the CUDA-core one refuses them).
    if (d.c.fixed_chunk == 0) {
      reg("CudaPagedDecode", d.name, [c = d.c] { decode_random(c, false); });
    }
    reg("CudaPagedDecode", std::string("Mma_") + d.name, [c = d.c] { decode_random(c, true); });
  }
  // Head dims above 256: the wide kernel and its combine.
  reg("CudaPagedDecode", "Wide_Sinks_B3_Odd_G4_D272in320",
      [] { decode_random(with_sinks({{19, 1, 989}, 8, 2, 320, 16, 0, 272}), true); });
  reg("CudaPagedDecode", "Wide_Sinks_Win50_B2_Odd_G24_D512",
      [] { decode_random(with_sinks({{989, 7}, 24, 1, 512, 32, 50}), true); });
  // Head dims above 256 (padded to a multiple of 64; "D272in320": the model's 272 dims, zeros to
  // 320): one kernel, float32, whatever tensor_cores says, so each case runs once with the
  // decoder's default (true) and is held to the float32 bound. Odd lengths, GQA groups 1, 4, 24
  // and 32 (two head tiles), D 640 and 1024 (two 512-dim output tiles, the second partial at
  // 640), block sizes 8, 16 and 32, an empty sequence.
  const Dc wide_cases[] = {
      // One key, one split: the block writes the output directly.
      {"Wide_B1_Len1_G1_D320", {{1}, 2, 2, 320, 16}},
      {"Wide_B3_Odd_G4_D272in320", {{19, 1, 99}, 8, 2, 320, 16, 0, 272}},
      {"Wide_B4_Odd_G24_D512", {{989, 0, 19, 1}, 48, 2, 512, 32}},
      {"Wide_B3_Odd_G4_D1024", {{99, 989, 1}, 8, 2, 1024, 8}},
      {"Wide_B2_Odd_G24_D1000in1024", {{989, 19}, 24, 1, 1024, 16, 0, 1000}},
      {"Wide_B2_Odd_G32_D640", {{99, 989}, 32, 1, 640, 16}},
      // Sliding windows: the keys before each window are NaN, as above.
      {"Wide_Win50_B3_Odd_G1_D320", {{989, 99, 19}, 4, 4, 320, 16, 50}},
      {"Wide_Win100_B2_Odd_G24_D1024", {{989, 1}, 24, 1, 1024, 8, 100}},
      {"Wide_Win7_B4_Odd_G4_D512", {{19, 0, 99, 7}, 8, 2, 512, 32, 7}},
      // 66 x 4 KV heads fill the grid: one split of up to 1000 keys (16 tiles of 64 through the
      // online softmax), written directly; D 384 leaves half the second 256-dim step idle.
      {"Wide_B66_Mixed_G4_D320",
       {[] {
          std::vector<int32_t> lens(66);
          for (int i = 0; i < 66; ++i) lens[i] = 1 + (37 * i) % 1000;
          return lens;
        }(),
        16, 4, 320, 16}},
      {"Wide_Win300_B66_Mixed_G4_D384",
       {[] {
          std::vector<int32_t> lens(66);
          for (int i = 0; i < 66; ++i) lens[i] = 1 + (41 * i) % 989;
          return lens;
        }(),
        16, 4, 384, 16, 300}},
      // --deterministic's fixed chunks: every sequence through the workspace and the combine
      // kernel, 4 splits of up to 256 keys (4 tiles each); and 64-key chunks under a window.
      {"Wide_Chunk256_B3_Odd_G4_D272in320", {{989, 1, 257}, 8, 2, 320, 16, 0, 272, 256}},
      {"Wide_Chunk64_Win300_B2_Odd_G24_D1024", {{989, 300}, 24, 1, 1024, 16, 300, 0, 64}},
  };
  for (const Dc& d : wide_cases)
    reg("CudaPagedDecode", d.name, [c = d.c] { decode_random(c, true); });
  // tensor_cores = false takes the same kernel, also with fixed chunks (which the CUDA-core
  // kernel of D <= 256 refuses).
  reg("CudaPagedDecode", "WideSimtFlag_B3_Odd_G4_D272in320", [] {
    decode_random({{19, 1, 99}, 8, 2, 320, 16, 0, 272}, false);
  });
  reg("CudaPagedDecode", "WideSimtFlag_Chunk256_B3_Odd_G24_D512", [] {
    decode_random({{989, 19, 1}, 24, 1, 512, 8, 0, 0, 256}, false);
  });
  for (bool tc : {true, false}) {
    const std::string kind = tc ? "Mma_" : "Simt_";
    reg("CudaPrefill", kind + "OneSeq_T1_D128", [tc] { prefill_random({1}, 4, 2, 128, tc); });
    reg("CudaPrefill", kind + "OneSeq_T99_G8_D128", [tc] { prefill_random({99}, 16, 2, 128, tc); });
    reg("CudaPrefill", kind + "Varlen_D64", [tc] {
      prefill_random({17, 1, 64, 33, 130}, 6, 3, 64, tc);
    });
    reg("CudaPrefill", kind + "OneSeq_T700_G4_D128",
        [tc] { prefill_random({700}, 8, 2, 128, tc); });
    // Sliding windows (query tiles of 32 on CUDA cores, 64 on tensor cores; key tiles the same).
    // W 5, below a tile: later rows of a query tile are wholly masked in its first key tile.
    reg("CudaPrefill", kind + "Win5_OneSeq_T99_G8_D128",
        [tc] { prefill_random({99}, 16, 2, 128, tc, 5); });
    // W 1: each output row is its own value row.
    reg("CudaPrefill", kind + "Win1_Varlen_D128", [tc] {
      prefill_random({3, 1, 70}, 4, 2, 128, tc, 1);
    });
    // W 33 crosses the 32-key tile edge; lengths above and below it.
    reg("CudaPrefill", kind + "Win33_Varlen_D64", [tc] {
      prefill_random({200, 65, 32}, 4, 4, 64, tc, 33);
    });
    // W 64, one tile: the 130-token sequence is windowed, the others are not.
    reg("CudaPrefill", kind + "Win64_Varlen_D64", [tc] {
      prefill_random({17, 1, 64, 33, 130}, 6, 3, 64, tc, 64);
    });
    // W 100 over 700 tokens: tiles wholly before each query tile's window are skipped.
    reg("CudaPrefill", kind + "Win100_OneSeq_T700_G4_D128",
        [tc] { prefill_random({700}, 8, 2, 128, tc, 100); });
    // W above the length: the same as causal.
    reg("CudaPrefill", kind + "Win1000_OneSeq_T300_G4_D128",
        [tc] { prefill_random({300}, 8, 2, 128, tc, 1000); });
    // Attention sinks, with and without a window (GPT-OSS alternates the two), length 1 (the
    // sink against a single key) and query tiles whose rows see few keys.
    reg("CudaPrefill", kind + "Sinks_Varlen_D64", [tc] {
      prefill_random({17, 1, 64, 33, 130}, 8, 2, 64, tc, 0, true);
    });
    reg("CudaPrefill", kind + "Sinks_Win4_Varlen_D64", [tc] {
      prefill_random({17, 1, 64, 33, 130}, 8, 2, 64, tc, 4, true);
    });
    reg("CudaPrefill", kind + "Sinks_Win100_OneSeq_T700_G4_D128",
        [tc] { prefill_random({700}, 8, 2, 128, tc, 100, true); });
    // Chunked local attention (Llama 4): chunk starts inside a query tile and a key tile (C 100,
    // 50), on tile edges (C 64, 32), C 1 (each row its own value), C above the lengths (causal).
    reg("CudaPrefill", kind + "Chunk100_OneSeq_T700_G4_D128",
        [tc] { prefill_random({700}, 8, 2, 128, tc, 0, false, 100); });
    reg("CudaPrefill", kind + "Chunk50_Varlen_D64", [tc] {
      prefill_random({17, 1, 64, 33, 130, 257}, 6, 3, 64, tc, 0, false, 50);
    });
    reg("CudaPrefill", kind + "Chunk64_Varlen_D128", [tc] {
      prefill_random({200, 65, 64, 63}, 8, 2, 128, tc, 0, false, 64);
    });
    reg("CudaPrefill", kind + "Chunk32_OneSeq_T99_G8_D64",
        [tc] { prefill_random({99}, 16, 2, 64, tc, 0, false, 32); });
    reg("CudaPrefill", kind + "Chunk1_Varlen_D128", [tc] {
      prefill_random({3, 1, 70}, 4, 2, 128, tc, 0, false, 1);
    });
    reg("CudaPrefill", kind + "Chunk1000_OneSeq_T300_G4_D128",
        [tc] { prefill_random({300}, 8, 2, 128, tc, 0, false, 1000); });
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
