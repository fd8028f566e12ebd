// A fixed pool of worker threads for the CPU kernels that are not inside a BLAS call
// (attention, norms, the MoE stages). parallel_for splits [0, n) into contiguous chunks.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moeinfer {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Calls fn(begin, end) over disjoint chunks covering [0, n); the caller thread takes part.
  // Chunks are at least min_chunk long so that tiny loops stay on one thread.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                    int64_t min_chunk = 1);

  // The process-wide pool, sized to the hardware (or MOE_NUM_THREADS).
  static ThreadPool& global();

 private:
  void worker_loop(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_size_ = 0;
  int job_chunks_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
};

inline void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                         int64_t min_chunk = 1) {
  ThreadPool::global().parallel_for(n, fn, min_chunk);
}

}  // namespace moeinfer
