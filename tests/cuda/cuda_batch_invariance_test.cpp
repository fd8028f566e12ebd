// The kernel half of --deterministic on the GPU: each kernel the deterministic decoder runs gives
// a row bit-identical results whatever else its launch carries. (The dense GEMM has its own
// file, cuda_dense_gemm_test.cpp; the whole decoder is held to it in cuda_deterministic_test.)
//   - grouped expert GEMM, plain and SiLU*up fused: a row alone in its expert, and the same row
//     at another place among 1 to 300 rows over 6 experts, under every mma.sync tile and the
//     automatic tile under batch_invariant (the decoder's deterministic mode: every such tile
//     reduces an element in one order); the skinny kernel likewise against its own row alone
//     (it sums in another order, so kAuto leaves it out under batch_invariant);
//   - paged decode attention with fixed_chunk: a query alone and the same query among sequences
//     of other lengths (so other grid splits and max_seq_len), with and without a sliding
//     window, at lengths on both sides of the chunk, at head dims 64, 128 and (the wide kernel)
//     320 and 1024;
//   - MLA decode attention with fixed_chunk, likewise, with both kernels (a latent of 128, and
//     latents of 1024 and 520 beside rope keys of 64 and 128, past the register-resident
//     kernel's 512 + 64).
// A failure names the case and the first differing element. Registered only with a device.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "backend/cuda/attention.h"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/mla_attention.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

// The first element where two bf16 rows differ in any bit, or -1.
int64_t first_difference(const uint16_t* got, const uint16_t* want, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (got[i] != want[i]) return i;
  return -1;
}

void expect_same_row(const uint16_t* got, const uint16_t* alone, int64_t n,
                     const std::string& what) {
  const int64_t i = first_difference(got, alone, n);
  if (i < 0) return;
  ADD_FAILURE() << what << ": element " << i << " is " << bf16_to_f32(got[i]) << ", alone "
                << bf16_to_f32(alone[i]) << " (bits " << got[i] << " vs " << alone[i] << ")";
}

// ---- grouped expert GEMM ----

// rows [M, K] in expert order with offsets, one launch; output bits.
std::vector<uint16_t> grouped(const std::vector<uint16_t>& rows,
                              const std::vector<int32_t>& offsets,
                              const DeviceBuffer<uint16_t>& weights, int64_t n, int64_t k,
                              GemmEpilogue epilogue, GemmTile tile) {
  const int64_t m = static_cast<int64_t>(rows.size()) / k;
  const DeviceBuffer<uint16_t> d_rows(rows);
  const DeviceBuffer<int32_t> d_offsets(offsets);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(m * n));
  out.poison();
  grouped_gemm({.rows = d_rows.as_bf16(),
                .weights = weights.as_bf16(),
                .expert_offsets = d_offsets.get(),
                .out = out.as_bf16(),
                .num_rows = m,
                .num_experts = static_cast<int64_t>(offsets.size()) - 1,
                .n = n,
                .k = k,
                .epilogue = epilogue,
                .tile = tile,
                .batch_invariant = true},
               nullptr);
  synchronize();
  return out.download();
}

void grouped_gemm_rows_are_batch_invariant() {
  std::mt19937 rng(fresh_seed());
  constexpr int64_t E = 6, N = 256, K = 192, kExpert = 3;
  for (const GemmEpilogue epilogue : {GemmEpilogue::kNone, GemmEpilogue::kSiluMul}) {
    const int64_t weight_rows = epilogue == GemmEpilogue::kSiluMul ? 2 * N : N;
    const DeviceBuffer<uint16_t> weights(
        random_bf16(static_cast<size_t>(E * weight_rows * K), rng, 0.08f));
    const std::vector<uint16_t> probe = random_bf16(static_cast<size_t>(K), rng);
    // Alone: one row, in expert kExpert.
    std::vector<int32_t> one(E + 1, 0);
    for (int64_t e = kExpert + 1; e <= E; ++e) one[e] = 1;
    const std::vector<uint16_t> alone =
        grouped(probe, one, weights, N, K, epilogue, GemmTile::kRows16);
    // The skinny kernel sums in its own order, the same for every row.
    const std::vector<uint16_t> skinny_alone =
        grouped(probe, one, weights, N, K, epilogue, GemmTile::kSkinny);
    for (const int64_t m : {1, 2, 9, 40, 161, 300}) {
      // Random counts summing to m with at least one row in kExpert; the probe at a random
      // place of that expert's range.
      std::vector<int32_t> counts(E, 0);
      counts[kExpert] = 1;
      for (int64_t r = 1; r < m; ++r) ++counts[rng() % E];
      std::vector<int32_t> offsets(E + 1, 0);
      std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
      std::vector<uint16_t> rows = random_bf16(static_cast<size_t>(m * K), rng);
      const int64_t at = offsets[kExpert] + static_cast<int64_t>(rng() % counts[kExpert]);
      std::copy(probe.begin(), probe.end(), rows.begin() + at * K);
      for (const GemmTile tile : {GemmTile::kAuto, GemmTile::kRows16, GemmTile::kRows64,
                                  GemmTile::kRows128, GemmTile::kRows128Wide}) {
        const std::vector<uint16_t> out = grouped(rows, offsets, weights, N, K, epilogue, tile);
        expect_same_row(&out[at * N], alone.data(), N,
                        std::string(epilogue == GemmEpilogue::kSiluMul ? "gate/up" : "plain") +
                            " row " + std::to_string(at) + " of " + std::to_string(m) +
                            " (expert count " + std::to_string(counts[kExpert]) + "), tile " +
                            std::to_string(static_cast<int>(tile)));
      }
      const std::vector<uint16_t> out =
          grouped(rows, offsets, weights, N, K, epilogue, GemmTile::kSkinny);
      expect_same_row(&out[at * N], skinny_alone.data(), N,
                      std::string(epilogue == GemmEpilogue::kSiluMul ? "gate/up" : "plain") +
                          " row " + std::to_string(at) + " of " + std::to_string(m) +
                          " (expert count " + std::to_string(counts[kExpert]) + "), skinny");
    }
  }
}

// ---- paged decode attention ----

// max_blocks distinct blocks of a pool of num_blocks, shuffled.
std::vector<int32_t> shuffled_table(int64_t num_blocks, int64_t max_blocks, std::mt19937& rng) {
  std::vector<int32_t> t(static_cast<size_t>(num_blocks));
  std::iota(t.begin(), t.end(), 0);
  std::shuffle(t.begin(), t.end(), rng);
  t.resize(static_cast<size_t>(max_blocks));
  return t;
}

struct Pool {
  int64_t block_size = 16, num_blocks = 0;
  DeviceBuffer<uint16_t> k, v;  // [num_blocks, block_size, width]
  Pool(int64_t blocks, int64_t width, std::mt19937& rng)
      : num_blocks(blocks),
        k(random_bf16(static_cast<size_t>(blocks * 16 * width), rng)),
        v(random_bf16(static_cast<size_t>(blocks * 16 * width), rng)) {}
};

// Queries of `lens` sequences whose block tables are rows of `tables` ([B, max_blocks]); the
// output of each row, [B, Nq, D] bits.
std::vector<uint16_t> decode(const Pool& pool, const std::vector<uint16_t>& q,
                             const std::vector<int32_t>& tables, const std::vector<int32_t>& lens,
                             int64_t max_blocks, int64_t nq, int64_t nkv, int64_t d, int64_t window,
                             int64_t chunk) {
  const int64_t B = static_cast<int64_t>(lens.size());
  const int32_t max_len = *std::max_element(lens.begin(), lens.end());
  const DeviceBuffer<uint16_t> d_q(q);
  const DeviceBuffer<int32_t> d_tables(tables), d_lens(lens);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(B * nq * d));
  out.poison();
  PagedDecodeParams p{.q = d_q.as_bf16(),
                      .k_cache = pool.k.as_bf16(),
                      .v_cache = pool.v.as_bf16(),
                      .block_tables = d_tables.get(),
                      .seq_lens = d_lens.get(),
                      .out = out.as_bf16(),
                      .num_seqs = B,
                      .num_q_heads = nq,
                      .num_kv_heads = nkv,
                      .head_dim = d,
                      .block_size = pool.block_size,
                      .num_blocks = pool.num_blocks,
                      .max_blocks_per_seq = max_blocks,
                      .max_seq_len = max_len,
                      .scale = 0.09f,
                      .sliding_window = window,
                      .fixed_chunk = chunk};
  DeviceBuffer<float> workspace(
      static_cast<size_t>(std::max<int64_t>(paged_decode_workspace_size(p), 1)));
  p.workspace = workspace.get();
  paged_decode_attention(p, nullptr);
  synchronize();
  return out.download();
}

void paged_decode_rows_are_batch_invariant() {
  std::mt19937 rng(fresh_seed());
  constexpr int64_t kMaxLen = 1024, kBlock = 16, kMaxBlocks = kMaxLen / kBlock;
  const int64_t chunk = batch_invariant_chunk(kMaxLen);
  struct Heads {
    int64_t d, nq, nkv;
  };
  // Head dims above 256 take the wide kernel: 320 (one output tile), and 1024 (two) with a group
  // of 24 (two head tiles).
  for (const Heads& heads :
       {Heads{64, 12, 3}, Heads{128, 12, 3}, Heads{320, 12, 3}, Heads{1024, 24, 1}}) {
    const int64_t d = heads.d, nq = heads.nq, nkv = heads.nkv, width = nkv * d;
    const Pool pool(kMaxBlocks * 4, width, rng);
    auto table = [&] { return shuffled_table(pool.num_blocks, kMaxBlocks, rng); };
    for (const int64_t window : {int64_t{0}, int64_t{300}}) {
      for (const int32_t len :
           {1, 37, static_cast<int32_t>(chunk), static_cast<int32_t>(chunk + 1), 700}) {
        const std::vector<int32_t> probe_table = table();
        const std::vector<uint16_t> probe_q = random_bf16(static_cast<size_t>(nq * d), rng);
        const std::vector<uint16_t> alone =
            decode(pool, probe_q, probe_table, {len}, kMaxBlocks, nq, nkv, d, window, chunk);
        // Among 6 others of random lengths up to kMaxLen (one full), as row 4.
        std::vector<int32_t> lens, tables;
        std::vector<uint16_t> qs;
        for (int b = 0; b < 7; ++b) {
          const bool is_probe = b == 4;
          const int32_t l = is_probe ? len
                            : b == 0 ? kMaxLen
                                     : 1 + static_cast<int32_t>(rng() % kMaxLen);
          lens.push_back(l);
          const std::vector<int32_t> t = is_probe ? probe_table : table();
          tables.insert(tables.end(), t.begin(), t.end());
          const std::vector<uint16_t> q =
              is_probe ? probe_q : random_bf16(static_cast<size_t>(nq * d), rng);
          qs.insert(qs.end(), q.begin(), q.end());
        }
        const std::vector<uint16_t> batch =
            decode(pool, qs, tables, lens, kMaxBlocks, nq, nkv, d, window, chunk);
        expect_same_row(&batch[4 * nq * d], alone.data(), nq * d,
                        "D " + std::to_string(d) + " window " + std::to_string(window) + " len " +
                            std::to_string(len) + " (chunk " + std::to_string(chunk) +
                            "): row 4 of 7 vs alone");
      }
    }
  }
}

// ---- MLA decode attention ----

void mla_rows_are_batch_invariant(int64_t L, int64_t R, int64_t Nh, bool wide) {
  std::mt19937 rng(fresh_seed() ^ static_cast<uint32_t>(L * 7 + R));
  constexpr int64_t kMaxLen = 1024, kBlock = 16, kMaxBlocks = kMaxLen / kBlock;
  const int64_t W = L + R;
  const int64_t chunk = batch_invariant_chunk(kMaxLen);
  const int64_t num_blocks = kMaxBlocks * 4;
  const DeviceBuffer<uint16_t> cache(
      random_bf16(static_cast<size_t>(num_blocks * kBlock * W), rng));
  auto table = [&] { return shuffled_table(num_blocks, kMaxBlocks, rng); };
  auto run = [&](const std::vector<uint16_t>& q, const std::vector<int32_t>& tables,
                 const std::vector<int32_t>& lens) {
    const int64_t B = static_cast<int64_t>(lens.size());
    const DeviceBuffer<uint16_t> d_q(q);
    const DeviceBuffer<int32_t> d_tables(tables), d_lens(lens);
    DeviceBuffer<uint16_t> out(static_cast<size_t>(B * Nh * L));
    out.poison();
    MlaDecodeParams p{.q = d_q.as_bf16(),
                      .cache = cache.as_bf16(),
                      .block_tables = d_tables.get(),
                      .seq_lens = d_lens.get(),
                      .out = out.as_bf16(),
                      .num_seqs = B,
                      .num_heads = Nh,
                      .latent_dim = L,
                      .rope_dim = R,
                      .block_size = kBlock,
                      .num_blocks = num_blocks,
                      .max_blocks_per_seq = kMaxBlocks,
                      .max_seq_len = *std::max_element(lens.begin(), lens.end()),
                      .scale = 0.07f,
                      .fixed_chunk = chunk};
    EXPECT_EQ(mla_decode_is_wide(p), wide) << "the case does not test the kernel it claims";
    DeviceBuffer<float> workspace(
        static_cast<size_t>(std::max<int64_t>(mla_decode_workspace_size(p), 4)));
    p.workspace = workspace.get();
    mla_decode_attention(p, nullptr);
    synchronize();
    return out.download();
  };
  for (const int32_t len :
       {1, 50, static_cast<int32_t>(chunk), static_cast<int32_t>(chunk + 1), 900}) {
    const std::vector<int32_t> probe_table = table();
    const std::vector<uint16_t> probe_q = random_bf16(static_cast<size_t>(Nh * W), rng);
    const std::vector<uint16_t> alone = run(probe_q, probe_table, {len});
    std::vector<int32_t> lens, tables;
    std::vector<uint16_t> qs;
    for (int b = 0; b < 5; ++b) {
      const bool is_probe = b == 2;
      lens.push_back(is_probe ? len : b == 0 ? kMaxLen : 1 + static_cast<int32_t>(rng() % kMaxLen));
      const std::vector<int32_t> t = is_probe ? probe_table : table();
      tables.insert(tables.end(), t.begin(), t.end());
      const std::vector<uint16_t> q =
          is_probe ? probe_q : random_bf16(static_cast<size_t>(Nh * W), rng);
      qs.insert(qs.end(), q.begin(), q.end());
    }
    const std::vector<uint16_t> batch = run(qs, tables, lens);
    expect_same_row(&batch[2 * Nh * L], alone.data(), Nh * L,
                    "MLA L " + std::to_string(L) + " R " + std::to_string(R) + " len " +
                        std::to_string(len) + " (chunk " + std::to_string(chunk) +
                        "): row 2 of 5 vs alone");
  }
}

TEST(CudaBatchInvariantChunk, DependsOnTheContextOnly) {
  EXPECT_EQ(batch_invariant_chunk(64), 256);
  EXPECT_EQ(batch_invariant_chunk(4096), 256);
  EXPECT_EQ(batch_invariant_chunk(40960), 2560);
  EXPECT_EQ(batch_invariant_chunk(40961) % 64, 0);
  // At least two splits, so that every row goes through the combine kernel.
  const PagedDecodeParams p{.num_seqs = 3,
                            .num_q_heads = 4,
                            .num_kv_heads = 4,
                            .head_dim = 64,
                            .max_seq_len = 10,
                            .fixed_chunk = 256};
  EXPECT_EQ(paged_decode_split(p).num_splits, 2);
  EXPECT_EQ(paged_decode_split(p).chunk, 256);
  const MlaDecodeParams m{.num_seqs = 3,
                          .num_heads = 4,
                          .latent_dim = 64,
                          .rope_dim = 8,
                          .max_seq_len = 1000,
                          .fixed_chunk = 256};
  EXPECT_EQ(mla_decode_split(m).num_splits, 4);
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("batch invariance")) return false;
  register_kernel_test("CudaBatchInvariance", "GroupedGemmRowsAreBatchInvariant",
                       grouped_gemm_rows_are_batch_invariant, __FILE__, __LINE__);
  register_kernel_test("CudaBatchInvariance", "PagedDecodeRowsAreBatchInvariant",
                       paged_decode_rows_are_batch_invariant, __FILE__, __LINE__);
  register_kernel_test(
      "CudaBatchInvariance", "MlaRowsAreBatchInvariant",
      [] { mla_rows_are_batch_invariant(128, 32, 20, false); }, __FILE__, __LINE__);
  register_kernel_test(
      "CudaBatchInvariance", "MlaWideRowsAreBatchInvariant",
      [] { mla_rows_are_batch_invariant(1024, 64, 20, true); }, __FILE__, __LINE__);
  register_kernel_test(
      "CudaBatchInvariance", "MlaWideRowsOf128HeadsAreBatchInvariant",
      [] { mla_rows_are_batch_invariant(520, 128, 128, true); }, __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
