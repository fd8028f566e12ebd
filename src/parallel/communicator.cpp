#include "parallel/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace moeinfer::parallel {

void poll_until(const std::function<bool()>& done) { poll_until(done, PollBackoff{}); }

void poll_until(const std::function<bool()>& done, const PollBackoff& backoff) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  while (!done()) {
    const auto waited = Clock::now() - start;
    if (waited > backoff.spin) {
      std::this_thread::sleep_for(std::min<Clock::duration>(waited / 10, backoff.longest_sleep));
    }
  }
}

PendingOp& PendingOp::operator=(PendingOp&& other) noexcept {
  if (this != &other) {
    try {
      wait();
    } catch (...) {  // the one being replaced failed; its error has nowhere to go
    }
    wait_ = std::exchange(other.wait_, nullptr);
  }
  return *this;
}

PendingOp::~PendingOp() {
  try {
    wait();
  } catch (...) {  // a destructor must not throw; wait() explicitly to see the error
  }
}

void PendingOp::wait() {
  if (std::function<void()> wait = std::exchange(wait_, nullptr)) wait();
}

PendingOp Communicator::start_all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                          void* recv, std::span<const int64_t> recv_bytes) {
  all_to_allv(send, send_bytes, recv, recv_bytes);
  return PendingOp();
}

void SelfCommunicator::all_to_all(const void* send, void* recv, int64_t bytes_per_rank) {
  MOE_CHECK(bytes_per_rank >= 0, "all_to_all: ", bytes_per_rank, " bytes per rank");
  if (bytes_per_rank > 0) std::memcpy(recv, send, static_cast<size_t>(bytes_per_rank));
}

void SelfCommunicator::all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                   void* recv, std::span<const int64_t> recv_bytes) {
  MOE_CHECK(send_bytes.size() == 1 && recv_bytes.size() == 1, "all_to_allv: ", send_bytes.size(),
            " send and ", recv_bytes.size(), " receive counts for 1 rank");
  MOE_CHECK(send_bytes[0] == recv_bytes[0] && send_bytes[0] >= 0, "all_to_allv: sends ",
            send_bytes[0], " bytes to itself but expects ", recv_bytes[0]);
  if (send_bytes[0] > 0) std::memcpy(recv, send, static_cast<size_t>(send_bytes[0]));
}

void SelfCommunicator::all_gather(const void* send, void* recv, int64_t bytes) {
  MOE_CHECK(bytes >= 0, "all_gather: ", bytes, " bytes");
  if (bytes > 0) std::memcpy(recv, send, static_cast<size_t>(bytes));
}

}  // namespace moeinfer::parallel
