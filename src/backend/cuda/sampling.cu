// Launcher of token sampling (sampling_kernel.cuh): one block per row.
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/sampling_kernel.cuh"

namespace moeinfer::cuda {

void sample_tokens(const SamplingParams& p, cudaStream_t stream) {
  NvtxRange range("sample");
  MOE_CHECK(p.num_rows >= 0 && p.num_rows <= 65535 * 32768LL, "num_rows = ", p.num_rows,
            " is out of range");
  MOE_CHECK(p.vocab_size >= 1 && p.vocab_size <= (int64_t{1} << 30), "vocab_size = ", p.vocab_size,
            " must be in [1, 2^30]");
  if (p.num_rows == 0) return;
  detail::check_pointer(p.logits, "logits");
  detail::check_pointer(p.tokens, "tokens");
  if (p.temperature) {
    detail::check_pointer(p.seeds, "seeds");
    detail::check_pointer(p.steps, "steps");
  }
  MOE_CHECK(p.num_rows <= 0x7fffffff, "num_rows = ", p.num_rows, " exceeds the grid");
  sample_tokens_kernel<<<static_cast<unsigned>(p.num_rows), sampling::kThreads, 0, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
