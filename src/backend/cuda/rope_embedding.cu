// Launchers of the embedding gather and RoPE (rope_embedding_kernel.cuh).
#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/rope_embedding_kernel.cuh"

namespace moeinfer::cuda {

void embedding(const EmbeddingParams& p, cudaStream_t stream) {
  NvtxRange range("embedding");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  detail::check_hidden_size(p.hidden_size);
  MOE_CHECK(p.vocab_size >= 1, "vocab_size = ", p.vocab_size, " must be at least 1");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.token_ids, "token_ids");
  detail::check_pointer(p.table, "table");
  MOE_CHECK((p.out != nullptr) != (p.out_f32 != nullptr),
            "embedding: exactly one of out and out_f32 must be given");
  detail::check_aligned16(p.table, "table");
  MOE_CHECK(p.table_lo == nullptr || p.out_f32 != nullptr,
            "embedding: table_lo needs out_f32 (a bf16 row cannot hold hi + lo)");
  if (p.table_lo) detail::check_aligned16(p.table_lo, "table_lo");
  if (p.out) detail::check_aligned16(p.out, "out");
  if (p.out_f32) detail::check_aligned16(p.out_f32, "out_f32");
  const int64_t threads = p.num_tokens * (p.hidden_size / device::kBf16PerVec);
  embedding_kernel<<<static_cast<unsigned>((threads + kEmbeddingThreads - 1) / kEmbeddingThreads),
                     kEmbeddingThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

void rope(const RopeParams& p, cudaStream_t stream) {
  NvtxRange range("rope");
  detail::check_int32_range(p.num_tokens, "num_tokens");
  MOE_CHECK(p.head_dim > 0, "head_dim = ", p.head_dim, " must be positive");
  MOE_CHECK(p.rotary_dim >= 2 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
            "rotary_dim = ", p.rotary_dim, " must be even and in [2, head_dim = ", p.head_dim, "]");
  MOE_CHECK(p.num_q_heads >= 1, "num_q_heads = ", p.num_q_heads, " must be at least 1");
  // A token's heads sit head_dim apart and only the first rotary_dim of each is touched, so a
  // row must reach the last head's rotary part (MLA's shared rope key is one head of rotary_dim
  // at the end of the latent row, narrower than the query heads' head_dim).
  const auto row_extent = [&](int64_t heads) { return (heads - 1) * p.head_dim + p.rotary_dim; };
  MOE_CHECK(p.q_stride >= row_extent(p.num_q_heads), "q_stride = ", p.q_stride,
            " is shorter than (num_q_heads - 1) * head_dim + rotary_dim = ",
            row_extent(p.num_q_heads));
  if (p.k) {
    MOE_CHECK(p.num_kv_heads >= 1, "num_kv_heads = ", p.num_kv_heads, " must be at least 1");
    MOE_CHECK(p.k_stride >= row_extent(p.num_kv_heads), "k_stride = ", p.k_stride,
              " is shorter than (num_kv_heads - 1) * head_dim + rotary_dim = ",
              row_extent(p.num_kv_heads));
  }
  const int64_t heads = p.num_q_heads + (p.k ? p.num_kv_heads : 0);
  const int64_t threads = p.num_tokens * heads * (p.rotary_dim / 2);
  MOE_CHECK(threads < (int64_t{1} << 40), "rope of ", threads, " pairs is too large");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.q, "q");
  detail::check_pointer(p.positions, "positions");
  detail::check_pointer(p.inv_freq, "inv_freq");
  rope_kernel<<<static_cast<unsigned>((threads + kRopeThreads - 1) / kRopeThreads), kRopeThreads, 0,
                stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
