// See gemm_parallel.h for why the GEMM kernels keep their own workers.
#include "backend/cpu/gemm_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MOE_CPU_RELAX() _mm_pause()
#else
#define MOE_CPU_RELAX() ((void)0)
#endif

namespace moeinfer::cpu {
namespace {

// How long an idle worker polls for the next job before it sleeps.
constexpr auto kSpinTime = std::chrono::microseconds(50);
// How long the caller polls for its workers to finish before it yields its core between polls.
constexpr auto kJoinSpinTime = std::chrono::microseconds(20);

class GemmPool {
 public:
  explicit GemmPool(int num_threads) : num_threads_(std::max(1, num_threads)) {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  }
  ~GemmPool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int num_threads() const { return num_threads_; }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    grain = std::max<int64_t>(1, grain);
    const int64_t num_grains = (n + grain - 1) / grain;
    const int chunks = static_cast<int>(std::min<int64_t>(num_threads_, num_grains));
    // A call made from inside a job (by a worker, or by the caller while it runs its own chunk)
    // runs inline; checked before try_lock, which the mutex's owner must not call.
    if (chunks <= 1 || in_job_) {
      fn(0, n);
      return;
    }
    std::unique_lock busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
      fn(0, n);
      return;
    }
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    job_chunks_ = chunks;
    error_ = nullptr;
    // Every worker reports back, even one with no chunk, so none can read a later job's fields
    // while still handling this one.
    pending_.store(num_threads_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    std::exception_ptr error;
    in_job_ = true;
    try {
      run_chunk(0);
    } catch (...) {
      error = std::current_exception();
    }
    in_job_ = false;
    // Poll briefly, then yield: on a machine shared with other work a worker may be waiting for
    // a core, and spinning on ours would keep it from running.
    const auto spin_until = std::chrono::steady_clock::now() + kJoinSpinTime;
    while (pending_.load(std::memory_order_acquire) != 0) {
      if (std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 16; ++i) MOE_CPU_RELAX();
      } else {
        std::this_thread::yield();
      }
    }
    job_ = nullptr;
    if (error) std::rethrow_exception(error);
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run_chunk(int index) {
    const int64_t num_grains = (job_n_ + job_grain_ - 1) / job_grain_;
    const int64_t begin = std::min(job_n_, num_grains * index / job_chunks_ * job_grain_);
    const int64_t end = std::min(job_n_, num_grains * (index + 1) / job_chunks_ * job_grain_);
    if (begin < end) (*job_)(begin, end);
  }

  void worker_loop(int index) {
    in_job_ = true;
    uint64_t seen = 0;
    while (true) {
      // Poll for a while, then sleep until the next job.
      const auto spin_until = std::chrono::steady_clock::now() + kSpinTime;
      uint64_t now = generation_.load(std::memory_order_acquire);
      while (now == seen && std::chrono::steady_clock::now() < spin_until) {
        for (int i = 0; i < 64; ++i) MOE_CPU_RELAX();
        now = generation_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stopping_) return;
      if (index < job_chunks_) {
        try {
          run_chunk(index);
        } catch (...) {
          std::lock_guard lock(mutex_);
          error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the one caller the workers serve
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_grain_ = 1;
  int job_chunks_ = 0;
  std::exception_ptr error_;
  bool stopping_ = false;
  static thread_local bool in_job_;  // a worker, or a caller inside its chunk
};

thread_local bool GemmPool::in_job_ = false;

GemmPool& pool() {
  static GemmPool instance(gemm_num_threads());
  return instance;
}

}  // namespace

int gemm_num_threads() {
  static const int count = [] {
    if (const char* env = std::getenv("MOE_NUM_THREADS")) {
      const int requested = std::atoi(env);
      if (requested > 0) return requested;
    }
    return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return count;
}

void gemm_parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  pool().run(n, grain, fn);
}

}  // namespace moeinfer::cpu
