// Row reorderings of expert parallelism on the GPU (model/cuda/expert_parallel.h): the rows a
// rank sends packed by receiver, the rows it receives put in its experts' order, and the
// outputs back the same ways. Each is one kernel that copies bf16 rows through an index map on
// either side; the bytes are moved, never computed on, so the rows arrive bit for bit.
//
// As the MoE-stage launchers (moe_stages.h): raw device pointers and a stream, sizes and
// pointers checked on the host, nothing synchronised.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace moeinfer::cuda {

// dst[dst_index[i]] = src[src_index[i]] for each row i < num_rows; a null index is the
// identity, so a null dst_index gathers (dst[i] = src[src_index[i]]) and a null src_index
// scatters (dst[dst_index[i]] = src[i]). The destinations must be distinct rows.
struct MoveRowsParams {
  const __nv_bfloat16* src = nullptr;  // [source rows, H], 16-byte aligned
  const int32_t* src_index = nullptr;  // [num_rows] or null
  __nv_bfloat16* dst = nullptr;        // [destination rows, H], 16-byte aligned
  const int32_t* dst_index = nullptr;  // [num_rows] or null
  int64_t num_rows = 0;
  int64_t hidden_size = 0;  // H, a multiple of 8
};
void move_rows(const MoveRowsParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
