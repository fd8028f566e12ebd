// What carries the rows of expert parallelism on the GPU between ranks (--ep-transport,
// GpuOptions::ep_transport): a parallel::Communicator whose buffers are device pointers on this
// rank's GPU, with the interface's contract (a call returns when this rank's receive buffers
// hold their bytes in device memory and its send buffers may be overwritten).
//   nccl    NcclCommunicator (parallel/nccl/): GPU to GPU, one process per GPU; NCCL refuses
//           two ranks on one device
//   staged  StagedDeviceCommunicator below: device to pinned host memory, the job's host
//           communicator (MPI), back to the device; any placement of ranks, ranks sharing a GPU
//           included (what lets two ranks on the one GPU of a test machine run the device
//           dispatcher)
// Either enqueues on a stream given at creation, so work enqueued earlier on that stream (the
// dispatcher's packing kernel) is what it sees; work on another stream must be waited for.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "model/cuda/device_memory.h"
#include "model/gpu_decoder.h"
#include "parallel/communicator.h"

namespace moeinfer::gpu {

// A Communicator over device buffers that stages them through pinned host memory and `host`
// (whose buffers are host memory). Every operation copies what it sends to the host on its
// stream, waits, runs host's operation, copies what arrived to the device and waits again.
class StagedDeviceCommunicator final : public parallel::Communicator {
 public:
  // host must outlive this; stream: where the copies are enqueued (the caller's).
  StagedDeviceCommunicator(parallel::Communicator& host, cudaStream_t stream);
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  std::string name() const override { return "staged:" + host_.name(); }
  void all_to_all(const void* send, void* recv, int64_t bytes_per_rank) override;
  void all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes) override;
  void all_gather(const void* send, void* recv, int64_t bytes) override;
  // Values on the host, as the interface has them: host's own.
  void all_reduce_sum(std::span<int64_t> values) override { host_.all_reduce_sum(values); }
  void all_reduce_sum(std::span<double> values) override { host_.all_reduce_sum(values); }
  void barrier() override { host_.barrier(); }

 private:
  // Pinned host memory of at least `bytes` for the outgoing and incoming sides.
  std::byte* reserve(PinnedArray<std::byte>& array, size_t& capacity, size_t bytes);

  parallel::Communicator& host_;
  cudaStream_t stream_;
  PinnedArray<std::byte> send_host_, recv_host_;
  size_t send_cap_ = 0, recv_cap_ = 0;
};

// A row transport and the stream it enqueues on.
struct RowTransport {
  std::unique_ptr<parallel::Communicator> comm;  // device buffers; comm->size() == host's
  cudaStream_t stream = nullptr;
  // Whether work enqueued on `stream` after a start_all_to_allv sees the received bytes and may
  // overwrite the sent ones (NCCL: the exchange is a kernel on that stream), so that the host
  // need wait for it only before the next exchange.
  bool stream_ordered = false;
};

// Whether some GPU of the job runs two ranks or more (link_classes' kSameGpu between two
// distinct ranks, seen by either of them). Collective: every rank gets the same answer.
bool ranks_share_a_gpu(parallel::Communicator& host);

// The transport `choice` names for the job of `host` on CUDA device `device` (the current one),
// enqueuing on `stream`. kAuto: NCCL when it is built and no two ranks share a GPU, else staged.
// kNccl is refused, naming --ep-transport, when ranks share a GPU or NCCL was not built. One
// rank: NcclCommunicator::single. Collective (every rank of host calls it with the same choice).
RowTransport make_row_transport(parallel::Communicator& host, EpTransport choice, int device,
                                cudaStream_t stream);

// Whether this build has the NCCL communicator.
bool have_nccl();

// "auto", "nccl" or "staged".
const char* ep_transport_name(EpTransport transport);

}  // namespace moeinfer::gpu
