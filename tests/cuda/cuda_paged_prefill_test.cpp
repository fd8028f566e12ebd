// Paged prefill attention (backend/cuda/attention.h, paged_prefill_attention: query chunks after
// a cached prefix, read through the block tables, on tensor cores) against the paged decode
// kernel run one query row per new token, the decoder's per-query route and the oracle this
// kernel replaces (itself held to a float64 softmax in cuda_attention_test.cpp). Fresh random
// inputs each run, outputs poisoned first, printed seed.
//
// Every case carries sequences of mixed shapes in one launch: prefixes 0, 5, 37 (not a multiple
// of the block size), 300 and 1000 (many blocks, several 64-key tiles), chunks of 1, 7, 64, 70
// and 200 queries (one row, a partial tile, exactly one tile, several tiles with a partial
// last), block tables shuffled over the pool. Head dims 64 and 128, GQA groups 1 and 4 (and 6,
// which leaves 4 of the 64 packed rows empty, and 8 at Qwen3-30B-A3B's shape), with and
// without a sliding window (50: cuts through tiles and through chunks), attention sinks,
// Llama 4's chunked attention (48, not a multiple of the 64-key tile) and fp8 KV rows. Keys no
// query of a sequence may see (before its first query's window or chunk, and every slot past
// its last key) are NaN, so a kernel that reads one, even under a zero weight, fails.
//
// Tolerance: |got - want| <= 1e-2 * (|want| + rms), rms the root mean square of the oracle's
// output row (the head's D values). Both kernels form the same float32 scores, keep the softmax
// in float32 and round P to bf16 for the P.V product; they differ in where the running max sits
// when P is rounded (a relative error of 2^-9 per weight either way, random over the keys, so
// about 1e-3 of the row's scale) and in the bf16 rounding of the output (2^-9 relative each):
// the bf16 bound of CONVENTIONS.md, on the output's natural scale so that outputs near zero
// (many keys averaging) do not make a relative bound meaningless.
//
// Written without a GPU; not yet run on one.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/attention.h"
#include "core/dtype.h"
#include "cuda_test_util.h"

namespace moeinfer::cuda {
namespace {

using namespace testing_util;

struct PagedPrefillCase {
  int64_t head_dim = 128;  // D
  int64_t num_kv_heads = 2;
  int64_t group = 1;  // G = Nq / Nkv
  int64_t block_size = 16;
  int64_t window = 0;  // sliding_window
  int64_t chunk = 0;   // attention_chunk
  bool sinks = false;
  bool fp8 = false;
  // (cached prefix, new tokens) per sequence.
  std::vector<std::pair<int32_t, int32_t>> seqs = {
      {0, 7}, {37, 64}, {300, 200}, {5, 1}, {1000, 70}};
};

// The first key the query at position pos sees (attn::first_visible_key on the host).
int64_t first_visible(int64_t pos, int64_t window, int64_t chunk) {
  if (chunk > 0) return pos / chunk * chunk;
  if (window > 0) return std::max<int64_t>(0, pos - window + 1);
  return 0;
}

constexpr uint16_t kBf16NaN = 0x7fc0;
constexpr uint8_t kF8NaN = 0x7f;

// The pool's K and V: bf16 rows, or fp8 codes with a scale per (slot, KV head).
struct Pool {
  std::vector<uint16_t> k, v;
  std::vector<uint8_t> k_codes, v_codes;
  std::vector<float> k_scales, v_scales;
};

// Random rows where a sequence's queries may look, NaN elsewhere.
Pool fill_pool(const PagedPrefillCase& c, int64_t num_blocks, const std::vector<int32_t>& tables,
               int64_t max_blocks, std::mt19937& rng) {
  const int64_t D = c.head_dim, slots = num_blocks * c.block_size;
  const int64_t rows = slots * c.num_kv_heads;  // (slot, KV head) rows
  Pool pool;
  std::vector<bool> visible(static_cast<size_t>(slots), false);
  for (size_t b = 0; b < c.seqs.size(); ++b) {
    const auto [prefix, n] = c.seqs[b];
    for (int64_t key = first_visible(prefix, c.window, c.chunk); key < prefix + n; ++key) {
      const int64_t block = tables[b * max_blocks + key / c.block_size];
      visible[block * c.block_size + key % c.block_size] = true;
    }
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill_bf16 = [&](std::vector<uint16_t>& plane) {
    plane.assign(rows * D, kBf16NaN);
    for (int64_t r = 0; r < rows; ++r) {
      if (!visible[r / c.num_kv_heads]) continue;
      for (int64_t d = 0; d < D; ++d) plane[r * D + d] = f32_to_bf16(normal(rng));
    }
  };
  auto fill_fp8 = [&](std::vector<uint8_t>& codes, std::vector<float>& scales) {
    codes.assign(rows * D, kF8NaN);
    scales.assign(rows, 1.0f);
    std::vector<float> x(D);
    for (int64_t r = 0; r < rows; ++r) {
      if (!visible[r / c.num_kv_heads]) continue;
      for (float& value : x) value = normal(rng);
      scales[r] = encode_f8e4m3_scaled(x.data(), D, codes.data() + r * D);
    }
  };
  if (c.fp8) {
    fill_fp8(pool.k_codes, pool.k_scales);
    fill_fp8(pool.v_codes, pool.v_scales);
  } else {
    fill_bf16(pool.k);
    fill_bf16(pool.v);
  }
  return pool;
}

void paged_prefill_matches_per_query_decode(const PagedPrefillCase& c) {
  std::mt19937 rng(fresh_seed() ^
                   static_cast<uint32_t>(c.head_dim * 31 + c.group * 7 + c.window * 101 +
                                         c.chunk * 1009 + (c.sinks ? 3 : 0) + (c.fp8 ? 5 : 0)));
  const int64_t D = c.head_dim, Nkv = c.num_kv_heads, Nq = Nkv * c.group;
  const int64_t B = static_cast<int64_t>(c.seqs.size());
  int64_t T = 0, max_len = 1;
  for (const auto& [prefix, n] : c.seqs) {
    T += n;
    max_len = std::max<int64_t>(max_len, prefix + n);
  }
  const int64_t max_blocks = (max_len + c.block_size - 1) / c.block_size;
  const int64_t num_blocks = B * max_blocks + 3;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(B * max_blocks);
  for (int64_t i = 0; i < B * max_blocks; ++i) tables[i] = ids[i];
  const Pool pool = fill_pool(c, num_blocks, tables, max_blocks, rng);

  // The launch's metadata: per sequence, and per token for the oracle (each new token a row of
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
  const int64_t num_tiles =
      plan_paged_prefill_tiles(cu_seqlens.data(), B, c.group, tile_starts.data());
  const auto q = random_bf16(T * Nq * D, rng);
  std::vector<float> sinks(Nq);
  for (float& s : sinks) s = std::uniform_real_distribution<float>(-1.0f, 3.0f)(rng);

  DeviceBuffer<uint16_t> d_q(q), d_k(pool.k), d_v(pool.v), got(T * Nq * D), want(T * Nq * D);
  DeviceBuffer<uint8_t> d_k_codes(pool.k_codes), d_v_codes(pool.v_codes);
  DeviceBuffer<float> d_k_scales(pool.k_scales), d_v_scales(pool.v_scales), d_sinks(sinks);
  DeviceBuffer<int32_t> d_cu(cu_seqlens), d_lens(seq_lens), d_tables(tables);
  DeviceBuffer<int32_t> d_tile_starts(tile_starts);
  DeviceBuffer<int32_t> d_row_lens(row_lens), d_row_tables(row_tables);
  got.poison();
  want.poison();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* sink_ptr = c.sinks ? d_sinks.get() : nullptr;

  PagedDecodeParams oracle{.q = d_q.as_bf16(),
                           .k_cache = c.fp8 ? nullptr : d_k.as_bf16(),
                           .v_cache = c.fp8 ? nullptr : d_v.as_bf16(),
                           .k_codes = c.fp8 ? d_k_codes.get() : nullptr,
                           .v_codes = c.fp8 ? d_v_codes.get() : nullptr,
                           .k_scales = c.fp8 ? d_k_scales.get() : nullptr,
                           .v_scales = c.fp8 ? d_v_scales.get() : nullptr,
                           .block_tables = d_row_tables.get(),
                           .seq_lens = d_row_lens.get(),
                           .out = want.as_bf16(),
                           .num_seqs = T,
                           .num_q_heads = Nq,
                           .num_kv_heads = Nkv,
                           .head_dim = D,
                           .block_size = c.block_size,
                           .num_blocks = num_blocks,
                           .max_blocks_per_seq = max_blocks,
                           .max_seq_len = max_len,
                           .scale = scale,
                           .sliding_window = c.window,
                           .attention_chunk = c.chunk,
                           .sinks = sink_ptr};
  DeviceBuffer<float> workspace(std::max<int64_t>(1, paged_decode_workspace_size(oracle)));
  oracle.workspace = workspace.get();
  paged_decode_attention(oracle, nullptr);

  paged_prefill_attention({.q = d_q.as_bf16(),
                           .k_cache = oracle.k_cache,
                           .v_cache = oracle.v_cache,
                           .k_codes = oracle.k_codes,
                           .v_codes = oracle.v_codes,
                           .k_scales = oracle.k_scales,
                           .v_scales = oracle.v_scales,
                           .cu_seqlens = d_cu.get(),
                           .seq_lens = d_lens.get(),
                           .tile_starts = d_tile_starts.get(),
                           .block_tables = d_tables.get(),
                           .out = got.as_bf16(),
                           .num_tokens = T,
                           .num_seqs = B,
                           .num_tiles = num_tiles,
                           .max_seq_len = max_len,
                           .num_q_heads = Nq,
                           .num_kv_heads = Nkv,
                           .head_dim = D,
                           .block_size = c.block_size,
                           .num_blocks = num_blocks,
                           .max_blocks_per_seq = max_blocks,
                           .scale = scale,
                           .sliding_window = c.window,
                           .attention_chunk = c.chunk,
                           .sinks = sink_ptr},
                          nullptr);
  synchronize();

  const auto want_host = to_float(want.download());
  std::vector<double> reference(want_host.begin(), want_host.end()), row_scale(want_host.size());
  for (int64_t r = 0; r < T * Nq; ++r) {  // (token, head) rows
    double squares = 0.0;
    for (int64_t d = 0; d < D; ++d) squares += reference[r * D + d] * reference[r * D + d];
    ASSERT_TRUE(std::isfinite(squares)) << "the oracle's row " << r << " is not finite";
    std::fill_n(row_scale.begin() + r * D, D, std::sqrt(squares / static_cast<double>(D)));
  }
  expect_bf16_near(got.download(), reference, row_scale, "paged prefill vs per-query decode");
}

std::string case_name(const PagedPrefillCase& c) {
  std::string name = "D" + std::to_string(c.head_dim) + "_G" + std::to_string(c.group);
  if (c.block_size != 16) name += "_Block" + std::to_string(c.block_size);
  if (c.window > 0) name += "_Win" + std::to_string(c.window);
  if (c.chunk > 0) name += "_Chunk" + std::to_string(c.chunk);
  if (c.sinks) name += "_Sinks";
  if (c.fp8) name += "_Fp8";
  return name;
}

std::vector<PagedPrefillCase> cases() {
  std::vector<PagedPrefillCase> out;
  for (int64_t D : {64, 128}) {
    for (int64_t G : {1, 4}) {
      const PagedPrefillCase base{.head_dim = D, .group = G};
      auto with = [&](int64_t window, int64_t chunk, bool sinks, bool fp8) {
        PagedPrefillCase c = base;
        c.window = window;
        c.chunk = chunk;
        c.sinks = sinks;
        c.fp8 = fp8;
        out.push_back(c);
      };
      with(0, 0, false, false);
      with(50, 0, false, false);
      with(0, 0, true, false);
      with(50, 0, true, false);   // GPT-OSS's sliding layers
      with(0, 48, false, false);  // Llama 4's chunked layers
      with(0, 0, false, true);
      with(50, 0, true, true);
    }
  }
  // G 6: 10 queries of 6 heads per tile, 4 rows empty.
  out.push_back({.head_dim = 128, .group = 6, .window = 50, .sinks = true});
  out.push_back({.head_dim = 64, .group = 6, .chunk = 48});
  // Qwen3-30B-A3B's heads (32 query heads over 4 KV heads, D 128): a 512-token chunk after a
  // prefix of 2048 and a 2048-token one from 0, blocks of 64 tokens.
  out.push_back({.head_dim = 128,
                 .num_kv_heads = 4,
                 .group = 8,
                 .block_size = 64,
                 .seqs = {{2048, 512}, {0, 2048}, {3000, 1}}});
  return out;
}

TEST(CudaPagedPrefillChecks, RefuseBadShapes) {
  alignas(16) uint16_t buf[64] = {};
  int32_t ints[4] = {0, 4, 4, 4};
  auto* b = reinterpret_cast<__nv_bfloat16*>(buf);
  PagedPrefillParams p{.q = b,
                       .k_cache = b,
                       .v_cache = b,
                       .cu_seqlens = ints,
                       .seq_lens = ints,
                       .tile_starts = ints,
                       .block_tables = ints,
                       .out = b,
                       .num_tokens = 4,
                       .num_seqs = 1,
                       .num_tiles = 1,
                       .max_seq_len = 4,
                       .num_q_heads = 2,
                       .num_kv_heads = 1,
                       .head_dim = 256,
                       .block_size = 16,
                       .num_blocks = 1,
                       .max_blocks_per_seq = 1,
                       .scale = 0.1f};
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "head_dim = 256");
  p.head_dim = 128;
  p.num_q_heads = 3;
  p.num_kv_heads = 2;
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "num_q_heads = 3");
  p.num_q_heads = 130;  // a group of 65 past the 64 rows of a tile
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "num_q_heads = 130");
  p.num_q_heads = 2;
  p.num_kv_heads = 1;
  p.max_seq_len = 17;  // one block of 16
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "max_seq_len = 17");
  p.max_seq_len = 4;
  p.num_tiles = 5;  // more tiles than tokens
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "num_tiles = 5");
  p.num_tiles = 1;
  p.sliding_window = 8;
  p.attention_chunk = 8;
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "are exclusive");
  p.attention_chunk = 0;
  p.k_codes = reinterpret_cast<const uint8_t*>(buf);
  expect_error_naming([&] { paged_prefill_attention(p, nullptr); }, "are exclusive");
}

// The host's work list: 64 / G queries a tile, a sequence of no tokens gets no tile.
TEST(CudaPagedPrefillChecks, PlanGivesEachSequenceItsQueryTiles) {
  const int32_t cu_seqlens[] = {0, 7, 7, 71, 72};
  int32_t starts[5] = {-1, -1, -1, -1, -1};
  EXPECT_EQ(plan_paged_prefill_tiles(cu_seqlens, 4, 4, starts), 6);  // 16 queries a tile
  EXPECT_EQ(std::vector<int32_t>(starts, starts + 5), (std::vector<int32_t>{0, 1, 1, 5, 6}));
  EXPECT_EQ(plan_paged_prefill_tiles(cu_seqlens, 4, 6, starts), 9);  // 10 queries a tile
  EXPECT_EQ(std::vector<int32_t>(starts, starts + 5), (std::vector<int32_t>{0, 1, 1, 8, 9}));
  expect_error_naming([&] { plan_paged_prefill_tiles(cu_seqlens, 4, 65, starts); },
                      "GQA group 65");
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda_device_present("paged prefill attention")) return false;
  for (const PagedPrefillCase& c : cases()) {
    std::string name = case_name(c);
    if (c.seqs.size() == 3) name = "Qwen3MoeHeads_Chunk512After2048_" + name;
    register_kernel_test(
        "CudaPagedPrefill", name, [c] { paged_prefill_matches_per_query_decode(c); }, __FILE__,
        __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::cuda

#endif  // MOE_HAVE_CUDA
