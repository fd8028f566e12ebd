// Host interface of Multi-head Latent Attention (DeepSeek-V2/V3) decode in the absorbed form,
// over the paged latent cache. The CPU reference is Decoder::mla_attention.
//
// The key up-projection is absorbed into the query and the value up-projection into the output
// (by the caller), so every head attends over the same cached rows, one per token:
//   row_j = [latent c_j (L) | rope key k_r,j (R)]                     W = L + R values
//   q[h]  = [q_latent (L)   | q_rope (R)]
//   score_j = scale * q[h] . row_j,   p = softmax_j over j in [0, seq_len)
//   out[h]  = sum_j p_j row_j[0:L]
// i.e. multi-query attention with key width W and value width L (the value is the key's prefix).
//
// Glossary: B sequences (or query rows), Nh heads, L latent dim (kv_lora_rank), R rope dim
// (qk_rope_head_dim), W = L + R.
//
// Paged layout (the block manager owns the blocks; the kernel only reads):
//   cache         [num_blocks, block_size, W]    bf16
//   block_tables  [B, max_blocks_per_seq]        int32, position t of row b lives in block
//                                                block_tables[b, t / block_size], slot
//                                                t % block_size
//   seq_lens      [B]                            int32 cached tokens, each in [0, max_seq_len]
// or, under --kv-dtype fp8 (backend/cuda/kv_fp8.cuh, the CPU pool's format: two scale groups a
// row), instead of `cache`, with slot = block * block_size + offset as above:
//   latent_codes  [num_blocks * block_size, L]   e4m3 codes of the latent
//   rope_codes    [num_blocks * block_size, R]   e4m3 codes of the rope key
//   latent_scales [num_blocks * block_size]      float32, the latent's amax / 448
//   rope_scales   [num_blocks * block_size]      float32, the rope key's amax / 448
// The kernels decode each row to bf16 (code * scale, rounded) as they load it into shared
// memory, so they compute exactly what they would over a bf16 cache holding those values.
// The per-query route runs prefill through the same kernel by giving each query token its own
// row b, its sequence's block table and seq_lens[b] = position + 1; mla_prefill_attention below
// runs it as flash attention instead, every sequence's new tokens over its paged rows at once.
//
// As the other launchers (attention.h): a params struct of raw device pointers and a stream;
// sizes, pointers and alignment are checked on the host, naming the offending value; nothing is
// read back from the device, so the launch can be captured in a CUDA graph; the grid is sized
// from max_seq_len, and the kernel range-checks the block ids it reads (a device trap).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeinfer::cuda {

// Largest latent dim and cache row of the register-resident kernel (DeepSeek-V2/V3: 512 + 64; a
// smaller latent leaves room for a wider rope key). Wider ones take the streaming kernel
// (mla_decode_is_wide), which has no limit but the ints it indexes a row with.
inline constexpr int64_t kMlaMaxLatentDim = 512;
inline constexpr int64_t kMlaMaxCacheWidth = 576;
inline constexpr int64_t kMlaMaxRowWidth = int64_t{1} << 30;

struct MlaDecodeParams {
  const __nv_bfloat16* q = nullptr;       // [B, Nh, W], 16-byte aligned
  const __nv_bfloat16* cache = nullptr;   // [num_blocks, block_size, W], 16-byte aligned; or
  // fp8 rows (all four set, `cache` null): codes 8-byte aligned, scales 4-byte aligned
  const uint8_t* latent_codes = nullptr;  // [num_blocks * block_size, L]
  const uint8_t* rope_codes = nullptr;    // [num_blocks * block_size, R]
  const float* latent_scales = nullptr;   // [num_blocks * block_size]
  const float* rope_scales = nullptr;     // [num_blocks * block_size]
  const int32_t* block_tables = nullptr;  // [B, max_blocks_per_seq]
  const int32_t* seq_lens = nullptr;      // [B], each in [0, max_seq_len]; 0 -> zeros
  __nv_bfloat16* out = nullptr;           // [B, Nh, L], 16-byte aligned
  float* workspace = nullptr;  // [mla_decode_workspace_size(...)] floats when split, 16-byte
                               // aligned; unused (may be null) when the plan has one split
  int64_t num_seqs = 0;        // B, at most 65535
  int64_t num_heads = 0;       // Nh >= 1
  int64_t latent_dim = 0;      // L, a positive multiple of 8
  int64_t rope_dim = 0;        // R, a positive multiple of 8; L + R at most kMlaMaxRowWidth
  int64_t block_size = 0;      // tokens per cache block
  int64_t num_blocks = 0;      // blocks in the pool (for the device range check)
  int64_t max_blocks_per_seq = 0;
  int64_t max_seq_len = 0;  // host-known bound on seq_lens: sizes the split grid
  float scale = 0.0f;       // softmax scale (DeepSeek: mscale^2 / sqrt(qk_head_dim))
  // > 0 (--deterministic): splits of this many keys (a multiple of 64) for every row whatever
  // the batch, always through the workspace and the combine kernel, so that a row's reduction
  // order depends on its own length alone (batch_invariant_chunk in attention.h). 0: splits
  // sized to fill the GPU for this batch.
  int64_t fixed_chunk = 0;
};

// Whether the launch takes the streaming kernel: L > kMlaMaxLatentDim or L + R >
// kMlaMaxCacheWidth. Same plan, workspace and results (to rounding); it recomputes the scores
// once per 512 output dims, so it is slower per byte of cache.
bool mla_decode_is_wide(const MlaDecodeParams& params);

// Keys per split (a multiple of 64) and the split count, planned over max_seq_len so that
// B x ceil(Nh / 16) x splits fills the GPU; one split (no workspace) once B x ceil(Nh / 16)
// alone does. With fixed_chunk: that chunk, and at least two splits.
struct MlaDecodeSplit {
  int64_t chunk = 0;
  int64_t num_splits = 0;
};
MlaDecodeSplit mla_decode_split(const MlaDecodeParams& params);

// Floats of workspace mla_decode_attention() needs: B * Nh * splits * (L + 2) when the plan has
// several splits, else 0.
int64_t mla_decode_workspace_size(const MlaDecodeParams& params);

// Floats of workspace that cover every launch of at most params.num_seqs sequences over at most
// params.max_seq_len keys (the split plan is not monotone in either: 65 sequences may need more
// than 64 and than 128, a shorter context more splits than a longer one), for a decoder that
// sizes its workspace once.
int64_t mla_decode_workspace_bound(const MlaDecodeParams& params);

// out[b, h] = sum_j softmax_j(scale * q[b, h] . row_j) row_j[0:L] over the rows j <
// seq_lens[b] of sequence b, read through its block table. Float32 scores and online softmax
// on tensor cores (P rounded to bf16 for the P.V product, as the GQA decode kernel does), bf16
// out. One block per (split, tile of 16 heads, sequence) reads each cache row once (wide rows:
// one block per 512 output dims as well); long contexts are cut into splits that a second
// kernel combines.
void mla_decode_attention(const MlaDecodeParams& params, cudaStream_t stream);

// ---- Prefill: a step's new tokens over the paged latent rows (mla_prefill_kernel.cuh) ----
//
// Each sequence b brings n_b >= 1 tokens after a cached prefix of any length (0 included), and
// their rows are already in the cache. Query i of sequence b sits at position
// p_b = seq_lens[b] - n_b + i and attends keys [0, p_b + i] (causal). Same cache layouts, q
// and out rows as MlaDecodeParams, with rows = the step's T tokens instead of B decode rows.
//
// The widest latent and cache row the prefill kernel holds: its [64 rows, L] float32 output in
// registers, the queries and two key tiles of W in shared memory. Wider ones keep the
// per-query route (model/attention_route.h's kMlaPrefillMaxLatent / kMlaPrefillMaxRow).
inline constexpr int64_t kMlaPrefillMaxLatentDim = 512;
inline constexpr int64_t kMlaPrefillMaxCacheWidth = 576;
// (query, head) rows of one prefill block: the mma rows.
inline constexpr int64_t kMlaPrefillTileRows = 64;

struct MlaPrefillParams {
  const __nv_bfloat16* q = nullptr;      // [T, Nh, W] absorbed queries, 16-byte aligned
  const __nv_bfloat16* cache = nullptr;  // [num_blocks, block_size, W], 16-byte aligned; or
  // fp8 rows (all four set, `cache` null), as MlaDecodeParams
  const uint8_t* latent_codes = nullptr;  // [num_blocks * block_size, L]
  const uint8_t* rope_codes = nullptr;    // [num_blocks * block_size, R]
  const float* latent_scales = nullptr;   // [num_blocks * block_size]
  const float* rope_scales = nullptr;     // [num_blocks * block_size]
  const int32_t* cu_seqlens = nullptr;    // [B + 1] token offsets of the sequences' queries
  const int32_t* seq_lens = nullptr;      // [B] cached rows after this step (prefix + n_b)
  // [B + 1] the work list, plan_mla_prefill_tiles' output uploaded: sequence b's query tiles are
  // blocks [tile_starts[b], tile_starts[b + 1]) of each head tile.
  const int32_t* tile_starts = nullptr;
  const int32_t* block_tables = nullptr;  // [B, max_blocks_per_seq]
  __nv_bfloat16* out = nullptr;           // [T, Nh, L], 16-byte aligned
  int64_t num_tokens = 0;                 // T
  int64_t num_seqs = 0;                   // B
  int64_t num_tiles = 0;                  // tile_starts[B]
  int64_t num_heads = 0;                  // Nh
  int64_t latent_dim = 0;  // L, a positive multiple of 8, at most kMlaPrefillMaxLatentDim
  int64_t rope_dim = 0;    // R, a positive multiple of 8; L + R at most kMlaPrefillMaxCacheWidth
  int64_t block_size = 0;  // tokens per cache block
  int64_t num_blocks = 0;  // blocks in the pool (for the device range check)
  int64_t max_blocks_per_seq = 0;
  int64_t max_seq_len = 0;  // host-known bound on seq_lens
  float scale = 0.0f;       // softmax scale, as MlaDecodeParams::scale
};

// How a launch cuts the heads: up to 64 heads share a block's rows with 64 / heads queries
// (Nh = 16: 4 queries of 16 heads; Nh = 4: 16 of 4); past 64 the heads are split into
// ceil(Nh / 64) even tiles (Nh = 128: 2 of 64, one query each), the grid's second dimension.
struct MlaPrefillTiling {
  int64_t heads_per_tile = 0;
  int64_t head_tiles = 0;
  int64_t queries_per_tile = 0;
};
MlaPrefillTiling mla_prefill_tiling(int64_t num_heads);

// Whether the prefill kernel takes this latent and rope key (else the per-query route).
bool mla_prefill_supports(int64_t latent_dim, int64_t rope_dim);

// The work list of a launch from the sequences' query offsets cu_seqlens [B + 1] (host memory):
// tile_starts[b] = the query tiles of the sequences before b (ceil(n_b / queries_per_tile)
// each), tile_starts[B] their total, which it returns (num_tiles). Writes B + 1 values.
int64_t plan_mla_prefill_tiles(const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_heads,
                               int32_t* tile_starts);

// out[t, h] = sum_j softmax_j(scale * q[t, h] . row_j) row_j[0:L] over the rows j <= the
// token's position of its sequence, read through its block table: flash attention on tensor
// cores, each key tile loaded once for the block's 64 (query, head) rows and used for both
// products. Float32 scores, online softmax and accumulators, P rounded to bf16 for the P.V
// product (as the decode kernel), bf16 out. No workspace; not graph-captured (prefill steps).
void mla_prefill_attention(const MlaPrefillParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
