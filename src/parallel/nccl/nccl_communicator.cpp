#include "parallel/nccl/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace moeinfer::parallel {

void check_nccl(ncclResult_t result, const char* operation, std::source_location where) {
  if (result == ncclSuccess) [[likely]]
    return;
  // NCCL's last error is a sentence about this thread's last failure (which peer, which
  // transport), more than the result code's generic text.
  const char* last = ncclGetLastError(nullptr);
  const std::string says = last && *last ? std::string("; NCCL: ") + last : std::string();
  detail::throw_error(where, operation, " failed: ", ncclGetErrorString(result), " (NCCL error ",
                      static_cast<int>(result), ")", says);
}

void check_cuda(cudaError_t status, const char* operation, std::source_location where) {
  if (status == cudaSuccess) [[likely]]
    return;
  // Clears a non-sticky error, so that the next launch check elsewhere does not report ours.
  cudaGetLastError();
  detail::throw_error(where, operation, " failed: ", cudaGetErrorName(status), ": ",
                      cudaGetErrorString(status));
}

namespace {

// Makes `device` current for a scope and restores the caller's: a process that drives one GPU
// through us may still touch others.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* operation) {
    check_cuda(cudaGetDevice(&previous_), operation);
    if (previous_ != device) check_cuda(cudaSetDevice(device), operation);
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

struct EventDeleter {
  void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
};
using EventHandle = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;

EventHandle make_event(const char* operation) {
  cudaEvent_t event = nullptr;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), operation);
  return EventHandle(event);
}

void check_device_index(int device, const char* operation) {
  int devices = 0;
  check_cuda(cudaGetDeviceCount(&devices), operation);
  MOE_CHECK(device >= 0 && device < devices, operation, ": CUDA device ", device,
            " does not exist (this process sees ", devices, " devices)");
}

// NCCL reads and writes device memory: a plain host pointer would fault inside a kernel, far
// from the call that passed it, so it is refused here, as is another device's memory.
void check_device_buffer(const void* buffer, int64_t bytes, int device, const char* operation,
                         const char* what) {
  if (bytes == 0) return;
  MOE_CHECK(buffer != nullptr, operation, ": ", what, " is null but holds ", bytes, " bytes");
  cudaPointerAttributes attributes{};
  check_cuda(cudaPointerGetAttributes(&attributes, buffer), operation);
  MOE_CHECK(attributes.type != cudaMemoryTypeUnregistered, operation, ": ", what,
            " is host memory; the NCCL communicator moves device buffers (host buffers go "
            "through the MPI communicator)");
  MOE_CHECK(attributes.type != cudaMemoryTypeDevice || attributes.device == device, operation, ": ",
            what, " is memory of CUDA device ", attributes.device,
            "; this communicator's device is ", device);
}

// The packed length of one side of an all_to_allv, each part checked.
int64_t checked_total(std::span<const int64_t> parts, const char* operation, const char* side) {
  int64_t total = 0;
  for (size_t r = 0; r < parts.size(); ++r) {
    MOE_CHECK(parts[r] >= 0, operation, ": the ", side, " part of rank ", r, " is ", parts[r],
              " bytes; it must be >= 0");
    total += parts[r];
  }
  return total;
}

// ncclGroupStart for a scope: end() closes the group and reports its result; leaving the scope by
// an exception (a failed ncclSend) still closes it, so the next group does not nest inside.
class NcclGroup {
 public:
  explicit NcclGroup(const char* operation) {
    check_nccl(ncclGroupStart(), operation);
    open_ = true;
  }
  void end(const char* operation) {
    open_ = false;
    check_nccl(ncclGroupEnd(), operation);
  }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

 private:
  bool open_ = false;
};

}  // namespace

// Owns every handle the communicator acquires. It is made before the first acquisition and frees
// whatever is non-null, so a failure half-way through create() releases what was taken so far.
struct NcclCommunicator::Handles {
  int device = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t owned_stream = nullptr;  // null when the caller gave the stream
  EventHandle done;                     // recorded after each blocking operation
  void* staging = nullptr;              // all_reduce_sum's values on the device
  size_t staging_bytes = 0;
  bool failed = false;  // NCCL reported an asynchronous error: abort instead of a clean destroy

  Handles() = default;
  Handles(const Handles&) = delete;
  Handles& operator=(const Handles&) = delete;
  ~Handles() {
    int previous = device;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device &&
                          cudaSetDevice(device) == cudaSuccess;
    if (comm) {
      ncclResult_t async = ncclSuccess;
      if (!failed && ncclCommGetAsyncError(comm, &async) == ncclSuccess && async == ncclSuccess) {
        ncclCommDestroy(comm);  // finalises first: what was enqueued completes
      } else {
        ncclCommAbort(comm);  // a failed peer would make a clean destroy wait for ever
      }
    }
    done.reset();
    if (staging) cudaFree(staging);
    if (owned_stream) cudaStreamDestroy(owned_stream);
    if (switched) cudaSetDevice(previous);
  }

  // Waits on the host until `event` has completed (parallel::poll_until), watching for NCCL's
  // asynchronous errors (a peer gone, a network failure) meanwhile, which would otherwise leave
  // the event pending for ever.
  void wait_for(cudaEvent_t event, const char* operation) {
    poll_until([&] {
      const cudaError_t status = cudaEventQuery(event);
      if (status == cudaSuccess) return true;
      if (status != cudaErrorNotReady) check_cuda(status, operation);
      ncclResult_t async = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm, &async), operation);
      if (async != ncclSuccess && async != ncclInProgress) {
        failed = true;
        MOE_FAIL(operation, " failed while in flight: ", ncclGetErrorString(async), " (NCCL error ",
                 static_cast<int>(async), "); this communicator cannot be used again");
      }
      return false;
    });
  }

  // What every communicator needs before its NCCL communicator: a stream unless the caller gave
  // one, and the completion event.
  void open_stream_and_event(cudaStream_t stream, const char* operation) {
    if (!stream) {
      check_cuda(cudaStreamCreateWithFlags(&owned_stream, cudaStreamNonBlocking), operation);
    }
    done = make_event(operation);
  }

  void reserve_staging(size_t bytes, const char* operation) {
    if (bytes <= staging_bytes) return;
    const size_t rounded = std::max<size_t>(bytes, 4096);
    if (staging) {
      check_cuda(cudaFree(staging), operation);
      staging = nullptr;
      staging_bytes = 0;
    }
    check_cuda(cudaMalloc(&staging, rounded), operation);
    staging_bytes = rounded;
  }
};

NcclCommunicator::NcclCommunicator(int rank, int size, int device, std::shared_ptr<Handles> handles,
                                   cudaStream_t stream)
    : rank_(rank),
      size_(size),
      device_(device),
      handles_(std::move(handles)),
      stream_(stream ? stream : handles_->owned_stream) {}

NcclCommunicator::~NcclCommunicator() = default;

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(int rank, int size,
                                                           const ncclUniqueId& unique_id,
                                                           int device, cudaStream_t stream) {
  constexpr const char* kOperation = "NcclCommunicator::create";
  MOE_CHECK(size >= 1 && rank >= 0 && rank < size, kOperation, ": rank ", rank, " of ", size,
            " ranks; a rank must be in [0, size) and size >= 1");
  check_device_index(device, kOperation);
  const DeviceGuard guard(device, kOperation);
  auto handles = std::make_shared<Handles>();
  handles->device = device;
  handles->open_stream_and_event(stream, kOperation);
  // Blocks until every rank of the job has called it with the same id.
  check_nccl(ncclCommInitRank(&handles->comm, size, unique_id, rank),
             "ncclCommInitRank (NcclCommunicator::create)");
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(rank, size, device, std::move(handles), stream));
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::single(int device, cudaStream_t stream) {
  constexpr const char* kOperation = "NcclCommunicator::single";
  check_device_index(device, kOperation);
  const DeviceGuard guard(device, kOperation);
  auto handles = std::make_shared<Handles>();
  handles->device = device;
  handles->open_stream_and_event(stream, kOperation);
  // One process, one device: no unique id, so no bootstrap socket.
  check_nccl(ncclCommInitAll(&handles->comm, 1, &device),
             "ncclCommInitAll (NcclCommunicator::single)");
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(0, 1, device, std::move(handles), stream));
}

void NcclCommunicator::wait_for_stream(const char* operation) {
  check_cuda(cudaEventRecord(handles_->done.get(), stream_), operation);
  handles_->wait_for(handles_->done.get(), operation);
}

void NcclCommunicator::enqueue_all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                           void* recv, std::span<const int64_t> recv_bytes,
                                           const char* operation) {
  MOE_CHECK(send_bytes.size() == static_cast<size_t>(size_) &&
                recv_bytes.size() == static_cast<size_t>(size_),
            operation, ": ", send_bytes.size(), " send and ", recv_bytes.size(),
            " receive counts for ", size_, " ranks");
  const int64_t send_total = checked_total(send_bytes, operation, "send");
  const int64_t recv_total = checked_total(recv_bytes, operation, "receive");
  MOE_CHECK(send_bytes[rank_] == recv_bytes[rank_], operation, ": rank ", rank_, " sends ",
            send_bytes[rank_], " bytes to itself but expects ", recv_bytes[rank_]);
  check_device_buffer(send, send_total, device_, operation, "the send buffer");
  check_device_buffer(recv, recv_total, device_, operation, "the receive buffer");

  const auto* send_base = static_cast<const std::byte*>(send);
  auto* recv_base = static_cast<std::byte*>(recv);
  // One group, so that every peer's send and receive progress together (NCCL's all-to-all).
  NcclGroup group("ncclGroupStart (all_to_allv)");
  int64_t send_offset = 0;
  int64_t recv_offset = 0;
  for (int peer = 0; peer < size_; ++peer) {
    const int64_t out = send_bytes[peer];
    const int64_t in = recv_bytes[peer];
    if (out > 0) {
      check_nccl(ncclSend(send_base + send_offset, static_cast<size_t>(out), ncclUint8, peer,
                          handles_->comm, stream_),
                 "ncclSend (all_to_allv)");
    }
    if (in > 0) {
      check_nccl(ncclRecv(recv_base + recv_offset, static_cast<size_t>(in), ncclUint8, peer,
                          handles_->comm, stream_),
                 "ncclRecv (all_to_allv)");
    }
    send_offset += out;
    recv_offset += in;
  }
  group.end("ncclGroupEnd (all_to_allv)");
}

void NcclCommunicator::all_to_all(const void* send, void* recv, int64_t bytes_per_rank) {
  const cuda::NvtxRange range("nccl all_to_all");
  MOE_CHECK(bytes_per_rank >= 0, "all_to_all: bytes_per_rank is ", bytes_per_rank,
            "; it must be >= 0");
  const DeviceGuard guard(device_, "all_to_all");
  const std::vector<int64_t> parts(static_cast<size_t>(size_), bytes_per_rank);
  enqueue_all_to_allv(send, parts, recv, parts, "all_to_all");
  wait_for_stream("all_to_all");
}

void NcclCommunicator::all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                   void* recv, std::span<const int64_t> recv_bytes) {
  const cuda::NvtxRange range("nccl all_to_allv");
  const DeviceGuard guard(device_, "all_to_allv");
  enqueue_all_to_allv(send, send_bytes, recv, recv_bytes, "all_to_allv");
  wait_for_stream("all_to_allv");
}

PendingOp NcclCommunicator::start_all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                              void* recv, std::span<const int64_t> recv_bytes) {
  const cuda::NvtxRange range("nccl start_all_to_allv");
  const DeviceGuard guard(device_, "start_all_to_allv");
  // Its own event: several may be in flight, and the blocking operations keep theirs.
  auto done = std::make_shared<EventHandle>(make_event("start_all_to_allv"));
  enqueue_all_to_allv(send, send_bytes, recv, recv_bytes, "all_to_allv");
  check_cuda(cudaEventRecord(done->get(), stream_), "start_all_to_allv");
  return PendingOp([handles = handles_, done] {
    handles->wait_for(done->get(), "all_to_allv (PendingOp::wait)");
  });
}

void NcclCommunicator::all_gather(const void* send, void* recv, int64_t bytes) {
  const cuda::NvtxRange range("nccl all_gather");
  MOE_CHECK(bytes >= 0, "all_gather: ", bytes, " bytes; it must be >= 0");
  if (bytes == 0) return;  // every rank passes the same size, so every rank skips
  const DeviceGuard guard(device_, "all_gather");
  check_device_buffer(send, bytes, device_, "all_gather", "the send buffer");
  check_device_buffer(recv, bytes * size_, device_, "all_gather", "the receive buffer");
  check_nccl(
      ncclAllGather(send, recv, static_cast<size_t>(bytes), ncclUint8, handles_->comm, stream_),
      "ncclAllGather (all_gather)");
  wait_for_stream("all_gather");
}

void NcclCommunicator::all_reduce_host(void* values, size_t count, size_t element_bytes,
                                       ncclDataType_t type, const char* operation) {
  if (count == 0) return;  // every rank passes the same count, so every rank skips
  const DeviceGuard guard(device_, operation);
  const size_t bytes = count * element_bytes;
  handles_->reserve_staging(bytes, operation);
  void* staged = handles_->staging;
  check_cuda(cudaMemcpyAsync(staged, values, bytes, cudaMemcpyHostToDevice, stream_), operation);
  check_nccl(ncclAllReduce(staged, staged, count, type, ncclSum, handles_->comm, stream_),
             operation);
  // Waited for before the copy back: a copy to pageable memory blocks inside CUDA until the
  // stream reaches it, where a failed peer would hang it unseen; wait_for watches NCCL's errors.
  wait_for_stream(operation);
  check_cuda(cudaMemcpyAsync(values, staged, bytes, cudaMemcpyDeviceToHost, stream_), operation);
  wait_for_stream(operation);
}

void NcclCommunicator::all_reduce_sum(std::span<int64_t> values) {
  const cuda::NvtxRange range("nccl all_reduce_sum");
  all_reduce_host(values.data(), values.size(), sizeof(int64_t), ncclInt64,
                  "ncclAllReduce (all_reduce_sum of int64)");
}

void NcclCommunicator::all_reduce_sum(std::span<double> values) {
  const cuda::NvtxRange range("nccl all_reduce_sum");
  all_reduce_host(values.data(), values.size(), sizeof(double), ncclFloat64,
                  "ncclAllReduce (all_reduce_sum of double)");
}

void NcclCommunicator::barrier() {
  const cuda::NvtxRange range("nccl barrier");
  // Each rank adds one: the sum is the number of ranks that reached the barrier.
  int64_t arrived = 1;
  all_reduce_host(&arrived, 1, sizeof(int64_t), ncclInt64, "ncclAllReduce (barrier)");
  MOE_CHECK(arrived == size_, "barrier: ", arrived, " of ", size_, " ranks arrived");
}

ncclUniqueId nccl_unique_id_via(Communicator& bootstrap) {
  // Rank 0's part: a flag saying whether it has an id, then the id. A failure on rank 0 still
  // takes part in the all_gather, so the other ranks fail with it instead of waiting for ever.
  struct Offer {
    int64_t ok = 0;
    ncclUniqueId id{};
  };
  Offer mine;
  std::string rank0_error;
  if (bootstrap.rank() == 0) {
    try {
      check_nccl(ncclGetUniqueId(&mine.id), "ncclGetUniqueId (nccl_unique_id_via)");
      mine.ok = 1;
    } catch (const Error& error) {
      rank0_error = error.what();
    }
  }
  std::vector<Offer> offers(static_cast<size_t>(bootstrap.size()));
  bootstrap.all_gather(&mine, offers.data(), static_cast<int64_t>(sizeof(Offer)));
  MOE_CHECK(rank0_error.empty(), rank0_error);
  MOE_CHECK(offers[0].ok == 1, "nccl_unique_id_via: rank 0 of the ", bootstrap.name(),
            " communicator could not make an NCCL unique id (its log says why)");
  return offers[0].id;
}

}  // namespace moeinfer::parallel
