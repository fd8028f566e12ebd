// A small worker pool private to the GEMM kernels.
//
// Why not ThreadPool::global(): linear() may be called from several threads at once and from
// inside other parallel loops, and the global pool supports one caller at a time. Here a call
// that finds the pool busy (another caller, or a call made from one of its own workers) simply
// runs its whole range on the calling thread: the callers already provide the parallelism.
// Workers spin briefly after a job (decode calls come back to back, and a futex wake costs
// more than a small GEMV) and then sleep, so an idle pool costs no CPU.
#pragma once

#include <cstdint>
#include <functional>

namespace moeinfer::cpu {

// Calls fn(begin, end) over disjoint chunks covering [0, n), each chunk a multiple of `grain`
// except the last; the caller takes part. At most gemm_num_threads() chunks.
void gemm_parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// Threads the GEMM kernels use: MOE_NUM_THREADS when set, else the hardware's.
int gemm_num_threads();

}  // namespace moeinfer::cpu
