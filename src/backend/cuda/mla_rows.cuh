// The MLA cache row as the decode and prefill kernels hold it in shared memory, and the fp8
// row's decoding, shared by mla_attention_kernel.cuh and mla_prefill_kernel.cuh (which are
// compiled in separate translation units, so the helpers live apart from either's kernels).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/kv_fp8.cuh"

namespace moeinfer::cuda::mla {

// 16-byte chunks of one cache row in shared memory: W / 8 rounded up to a multiple of 8.
__host__ __device__ constexpr int row_chunks(int width) { return (width / 8 + 7) / 8 * 8; }

// One fp8 cache row (MlaDecodeParams' latent_codes ... rope_scales) at its slot: where its two
// code rows start and their scales.
struct Fp8Row {
  const uint8_t* latent = nullptr;  // [L] codes
  const uint8_t* rope = nullptr;    // [R] codes
  float latent_scale = 0.f, rope_scale = 0.f;
};

// Chunk c (values [8 c, 8 c + 8)) of the row [latent | rope key], l_chunks = L / 8 of them in
// the latent, decoded to the 8 bf16 a bf16 row would hold there.
__device__ __forceinline__ uint4 fp8_chunk(const Fp8Row& row, int c, int l_chunks) {
  if (c < l_chunks) {
    return kvfp8::decode8_bf16(__ldg(reinterpret_cast<const uint2*>(row.latent) + c),
                               row.latent_scale);
  }
  return kvfp8::decode8_bf16(__ldg(reinterpret_cast<const uint2*>(row.rope) + (c - l_chunks)),
                             row.rope_scale);
}

}  // namespace moeinfer::cuda::mla
