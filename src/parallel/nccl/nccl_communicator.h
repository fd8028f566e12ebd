// The Communicator over NCCL, for GPU buffers: one process per GPU, every buffer it is given is
// a device pointer on that GPU (all_reduce_sum's values are the exception: the interface gives
// them as host spans, and they are staged through a small device buffer of the communicator's).
//
// Streams and what "done" means. Every operation is enqueued on the communicator's stream (the
// caller's, given to create(), or one it owns). A blocking operation then waits on the host for
// an event recorded after it, so when it returns this rank's receive buffers hold their bytes in
// device memory, readable by any stream or a copy, and its send buffers may be overwritten: the
// interface's contract, as for host buffers. Stream order is the only ordering on the way in:
// the operation sees what work enqueued earlier on the same stream wrote, and nothing else, so a
// send buffer written on another stream must be finished (or that stream waited for with
// cudaStreamWaitEvent on stream()) before the call. start_all_to_allv enqueues the same way and
// returns at once; its PendingOp's wait() waits on an event recorded after the NCCL group.
//
// all_to_allv is a group of ncclSend/ncclRecv, one pair per peer with a non-empty part (empty
// parts post nothing), written for any number of ranks; all_to_all is the same with
// equal parts. Parts are bytes (ncclUint8), counted in size_t: no 2 GiB limit as under MPI.
//
// Tested with one rank only (one GPU on the machine we have): every operation against itself,
// through NCCL's own paths (tests/cuda/cuda_nccl_communicator_test.cpp). Several ranks are
// untested.
//
// One operation at a time, as for MPI: calls from several threads must not overlap.
//
// Waiting: the host polls the event (spinning 100 us, then sleeping, as parallel::wait_for does
// for MPI) and NCCL's asynchronous error between polls, so a peer or link that fails mid-flight
// throws instead of hanging; the communicator is then unusable and is aborted when destroyed. A
// peer that never makes the call still hangs the others, as under MPI.
//
// Errors: every NCCL and CUDA call is checked; a failure throws moeinfer::Error naming our
// operation, the library call and its error text (with ncclGetLastError's detail). Argument
// checks (counts, negative sizes, null, host or another device's pointers) run before anything
// is enqueued.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <source_location>

#include "parallel/communicator.h"

namespace moeinfer::parallel {

class NcclCommunicator final : public Communicator {
 public:
  // Joins the NCCL job of `size` ranks named by `unique_id` (rank 0's ncclGetUniqueId, shared
  // with every rank, e.g. by nccl_unique_id_via) as `rank`, on CUDA device `device`. Every rank
  // must call it: it returns when all have. `stream` stays the caller's and must belong to
  // `device`; nullptr makes the communicator create and own a non-blocking stream.
  static std::unique_ptr<NcclCommunicator> create(int rank, int size, const ncclUniqueId& unique_id,
                                                  int device, cudaStream_t stream = nullptr);
  // A job of one rank on `device`, for tests: every operation goes through NCCL to itself.
  static std::unique_ptr<NcclCommunicator> single(int device, cudaStream_t stream = nullptr);

  // The NCCL communicator is destroyed (after NCCL has flushed what was enqueued) when this and
  // every PendingOp it returned are gone: a PendingOp keeps what it waits on alive.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  int device() const { return device_; }
  // Where the operations are enqueued: make it wait for a producer stream's event before a call.
  cudaStream_t stream() const { return stream_; }

  void all_to_all(const void* send, void* recv, int64_t bytes_per_rank) override;
  void all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes) override;
  PendingOp start_all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                              std::span<const int64_t> recv_bytes) override;
  void all_gather(const void* send, void* recv, int64_t bytes) override;
  // `values` live on the host: copied to a device buffer, reduced there, copied back.
  void all_reduce_sum(std::span<int64_t> values) override;
  void all_reduce_sum(std::span<double> values) override;
  // An all-reduce of one value, waited for.
  void barrier() override;

 private:
  // The NCCL communicator, the stream if owned, the completion event, the staging buffer; shared
  // with the PendingOps in flight.
  struct Handles;
  NcclCommunicator(int rank, int size, int device, std::shared_ptr<Handles> handles,
                   cudaStream_t stream);

  // Enqueues the group of sends and receives of an all_to_allv (arguments checked).
  void enqueue_all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                           std::span<const int64_t> recv_bytes, const char* operation);
  // Records the completion event after what was enqueued and waits for it on the host.
  void wait_for_stream(const char* operation);
  // values[i] = the sum over ranks, for `count` host values of `element_bytes` each, staged
  // through the device buffer.
  void all_reduce_host(void* values, size_t count, size_t element_bytes, ncclDataType_t type,
                       const char* operation);

  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  std::shared_ptr<Handles> handles_;
  cudaStream_t stream_ = nullptr;  // handles_'s or the caller's
};

// Rank 0's ncclGetUniqueId, handed to every rank of `bootstrap` (an MPI communicator, one rank
// per GPU) by an all_gather of host bytes in which only rank 0's part is kept (only rank 0 calls
// ncclGetUniqueId: it starts NCCL's bootstrap listener, which the others must not).
// Call it on every rank of bootstrap, then NcclCommunicator::create(bootstrap.rank(),
// bootstrap.size(), id, device).
ncclUniqueId nccl_unique_id_via(Communicator& bootstrap);

// Throws moeinfer::Error naming `operation` and NCCL's text for `result` unless it is
// ncclSuccess.
void check_nccl(ncclResult_t result, const char* operation,
                std::source_location where = std::source_location::current());

// Throws moeinfer::Error naming `operation` and CUDA's name and text for `status` unless it is
// cudaSuccess.
void check_cuda(cudaError_t status, const char* operation,
                std::source_location where = std::source_location::current());

}  // namespace moeinfer::parallel
