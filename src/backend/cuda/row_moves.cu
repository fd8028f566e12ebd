// move_rows (row_moves.h): one thread per 16-byte vector of a row, as permute's kernels.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/row_moves.h"

namespace moeinfer::cuda {
namespace {

constexpr int kMoveRowsThreads = 256;

__global__ void __launch_bounds__(kMoveRowsThreads)
    move_rows_kernel(const __grid_constant__ MoveRowsParams p) {
  const int vecs = static_cast<int>(p.hidden_size / device::kBf16PerVec);
  const int idx = blockIdx.x * kMoveRowsThreads + threadIdx.x;  // row * vecs + v
  if (idx >= static_cast<int>(p.num_rows) * vecs) return;
  const int row = idx / vecs;
  const int v = idx - row * vecs;
  const int64_t from = p.src_index ? __ldg(p.src_index + row) : row;
  const int64_t to = p.dst_index ? __ldg(p.dst_index + row) : row;
  reinterpret_cast<uint4*>(p.dst)[to * vecs + v] =
      __ldg(reinterpret_cast<const uint4*>(p.src) + from * vecs + v);
}

}  // namespace

void move_rows(const MoveRowsParams& params, cudaStream_t stream) {
  NvtxRange range("move_rows");
  detail::check_hidden_size(params.hidden_size);
  detail::check_int32_range(params.num_rows, "num_rows");
  // The thread index is an int: rows times vectors per row must fit.
  detail::check_int32_range(params.num_rows * (params.hidden_size / device::kBf16PerVec),
                            "num_rows * hidden_size / 8");
  if (params.num_rows == 0) return;
  detail::check_pointer(params.src, "src");
  detail::check_pointer(params.dst, "dst");
  detail::check_aligned16(params.src, "src");
  detail::check_aligned16(params.dst, "dst");
  const int64_t threads = params.num_rows * (params.hidden_size / device::kBf16PerVec);
  const auto blocks = static_cast<unsigned>((threads + kMoveRowsThreads - 1) / kMoveRowsThreads);
  move_rows_kernel<<<blocks, kMoveRowsThreads, 0, stream>>>(params);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
