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
// Prefill uses the same kernel by giving each query token its own row b, its sequence's block
// table and seq_lens[b] = position + 1.
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

}  // namespace moeinfer::cuda
