// Collective operations among the ranks of one job: what expert parallelism moves rows with
// (../shared/DESIGN.md, dispatch and combine as all-to-allv). Every rank calls the same
// operations in the same order; each call returns when this rank's part is done (its receive
// buffers filled, its send buffers reusable). Parts are bytes; a part may be empty.
//
// Implementations: SelfCommunicator (one rank, this file), MpiCommunicator (parallel/mpi/: CPU
// ranks launched by mpirun, on one host or several). world() picks the one this process was
// launched as.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace moeinfer::parallel {

// An operation started without waiting for it (Communicator::start_all_to_allv): its buffers
// belong to it until wait() returns, when this rank's part is done. Destroying one that was not
// waited for waits (errors then go unreported: call wait()).
class PendingOp {
 public:
  PendingOp() = default;  // nothing in flight
  explicit PendingOp(std::function<void()> wait) : wait_(std::move(wait)) {}
  PendingOp(PendingOp&& other) noexcept : wait_(std::exchange(other.wait_, nullptr)) {}
  PendingOp& operator=(PendingOp&& other) noexcept;
  ~PendingOp();
  void wait();
  bool pending() const { return static_cast<bool>(wait_); }

 private:
  std::function<void()> wait_;
};

// How poll_until waits: it calls `done` without pause for `spin`, then sleeps a tenth of the time
// waited so far, at most `longest_sleep`, between calls.
struct PollBackoff {
  std::chrono::microseconds spin{100};
  std::chrono::microseconds longest_sleep{1000};
};

// Calls `done` until it returns true: spinning 100 us while the other ranks are likely a moment
// away, then sleeping a tenth of the time waited so far (at most 1 ms) between calls. A rank that
// spins for ever on a core it shares (more ranks than cores, a CPU quota, the experts' threads)
// takes the time the rank it waits for needs; the communicators wait through this.
void poll_until(const std::function<bool()>& done);
// The same with other times (the GPU expert cache's host worker waits for the next layer).
void poll_until(const std::function<bool()>& done, const PollBackoff& backoff);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // What carries the bytes ("self", "mpi"), for messages and reports.
  virtual std::string name() const = 0;

  // Rank r's bytes [r * bytes_per_rank, (r + 1) * bytes_per_rank) of `send` arrive at rank r
  // in the part of `recv` that belongs to this rank (at rank() * bytes_per_rank). send and recv
  // hold size() * bytes_per_rank bytes and do not overlap.
  virtual void all_to_all(const void* send, void* recv, int64_t bytes_per_rank) = 0;
  // Ragged: send_bytes[r] bytes go to rank r, packed in rank order in `send`; recv_bytes[r]
  // bytes come from rank r, packed in rank order in `recv` (the caller knows them, e.g. from an
  // all_to_all of the counts). Both spans have size() entries; any entry may be 0.
  virtual void all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                           std::span<const int64_t> recv_bytes) = 0;
  // all_to_allv started: the caller computes while the rows travel, then waits. Without a
  // non-blocking transport it completes before returning.
  virtual PendingOp start_all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                      void* recv, std::span<const int64_t> recv_bytes);
  // recv[r * bytes, (r + 1) * bytes) = rank r's `send` of `bytes` bytes.
  virtual void all_gather(const void* send, void* recv, int64_t bytes) = 0;
  // values[i] = the sum over ranks of their values[i], on every rank.
  virtual void all_reduce_sum(std::span<int64_t> values) = 0;
  virtual void all_reduce_sum(std::span<double> values) = 0;
  virtual void barrier() = 0;
};

// A job of one rank: every operation is a copy to itself.
class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "self"; }
  void all_to_all(const void* send, void* recv, int64_t bytes_per_rank) override;
  void all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes) override;
  void all_gather(const void* send, void* recv, int64_t bytes) override;
  void all_reduce_sum(std::span<int64_t>) override {}
  void all_reduce_sum(std::span<double>) override {}
  void barrier() override {}
};

// The job this process belongs to: MPI's world when it was launched by mpirun with more than one
// rank (or MPI is built in and initialises), else a SelfCommunicator. Initialises MPI on first
// use and finalises it at exit. A process launched as one of several ranks by a build without MPI
// is refused with a message naming the missing package.
Communicator& world();

// Whether this build has the MPI communicator.
bool have_mpi();

}  // namespace moeinfer::parallel
