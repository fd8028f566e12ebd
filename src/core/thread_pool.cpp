#include "core/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <exception>

namespace moeinfer {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < std::max(1, num_threads); ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

static void run_chunk(const std::function<void(int64_t, int64_t)>& fn, int64_t n, int chunks,
                      int index) {
  const int64_t begin = n * index / chunks;
  const int64_t end = n * (index + 1) / chunks;
  if (begin < end) fn(begin, end);
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn,
                              int64_t min_chunk) {
  if (n <= 0) return;
  const int64_t by_size = std::max<int64_t>(1, n / std::max<int64_t>(1, min_chunk));
  const int chunks = static_cast<int>(std::min<int64_t>(num_threads(), by_size));
  if (chunks <= 1) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    job_ = &fn;
    job_size_ = n;
    job_chunks_ = chunks;
    pending_ = chunks - 1;
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr error;
  try {
    run_chunk(fn, n, chunks, 0);
  } catch (...) {
    error = std::current_exception();
  }
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
  if (error) std::rethrow_exception(error);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t size;
    int chunks;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = job_;
      size = job_size_;
      chunks = job_chunks_;
    }
    if (index < chunks) {
      // Kernels report errors by value; an exception escaping a worker would be a bug.
      run_chunk(*job, size, chunks, index);
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_all();
    }
  }
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    if (const char* env = std::getenv("MOE_NUM_THREADS")) {
      const int requested = std::atoi(env);
      if (requested > 0) return requested;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }());
  return pool;
}

}  // namespace moeinfer
