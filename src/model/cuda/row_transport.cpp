#include "model/cuda/row_transport.h"

#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "model/cuda/expert_parallel.h"
#if defined(MOE_HAVE_NCCL) && MOE_HAVE_NCCL
#include "parallel/nccl/nccl_communicator.h"
#endif

namespace moeinfer::gpu {
namespace {

int64_t sum(std::span<const int64_t> parts) {
  int64_t total = 0;
  for (const int64_t part : parts) {
    MOE_CHECK(part >= 0, "a part of ", part, " bytes; it must be >= 0");
    total += part;
  }
  return total;
}

}  // namespace

StagedDeviceCommunicator::StagedDeviceCommunicator(parallel::Communicator& host,
                                                   cudaStream_t stream)
    : host_(host), stream_(stream) {}

std::byte* StagedDeviceCommunicator::reserve(PinnedArray<std::byte>& array, size_t& capacity,
                                             size_t bytes) {
  if (bytes > capacity || !array) {
    // Every copy from or to the old block has been waited for: each operation ends synchronised.
    capacity = std::max<size_t>({bytes, capacity * 2, 4096});
    array = pinned_array<std::byte>(capacity);
  }
  return array.get();
}

void StagedDeviceCommunicator::all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                           void* recv, std::span<const int64_t> recv_bytes) {
  const int64_t out = sum(send_bytes), in = sum(recv_bytes);
  std::byte* send_host = reserve(send_host_, send_cap_, static_cast<size_t>(out));
  std::byte* recv_host = reserve(recv_host_, recv_cap_, static_cast<size_t>(in));
  if (out > 0) {
    CUDA_CHECK(cudaMemcpyAsync(send_host, send, static_cast<size_t>(out), cudaMemcpyDeviceToHost,
                               stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // also what enqueued the send rows before us
  host_.all_to_allv(send_host, send_bytes, recv_host, recv_bytes);
  if (in > 0) {
    CUDA_CHECK(
        cudaMemcpyAsync(recv, recv_host, static_cast<size_t>(in), cudaMemcpyHostToDevice, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void StagedDeviceCommunicator::all_to_all(const void* send, void* recv, int64_t bytes_per_rank) {
  MOE_CHECK(bytes_per_rank >= 0, "all_to_all: ", bytes_per_rank, " bytes per rank");
  const std::vector<int64_t> parts(static_cast<size_t>(size()), bytes_per_rank);
  all_to_allv(send, parts, recv, parts);
}

void StagedDeviceCommunicator::all_gather(const void* send, void* recv, int64_t bytes) {
  MOE_CHECK(bytes >= 0, "all_gather: ", bytes, " bytes");
  if (bytes == 0) return;  // every rank passes the same size
  const size_t all = static_cast<size_t>(bytes) * static_cast<size_t>(size());
  std::byte* send_host = reserve(send_host_, send_cap_, static_cast<size_t>(bytes));
  std::byte* recv_host = reserve(recv_host_, recv_cap_, all);
  CUDA_CHECK(cudaMemcpyAsync(send_host, send, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost,
                             stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  host_.all_gather(send_host, recv_host, bytes);
  CUDA_CHECK(cudaMemcpyAsync(recv, recv_host, all, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

bool have_nccl() {
#if defined(MOE_HAVE_NCCL) && MOE_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

const char* ep_transport_name(EpTransport transport) {
  switch (transport) {
    case EpTransport::kAuto:
      return "auto";
    case EpTransport::kNccl:
      return "nccl";
    case EpTransport::kStaged:
      return "staged";
  }
  return "?";
}

bool ranks_share_a_gpu(parallel::Communicator& host) {
  const std::vector<profile::Link> links = link_classes(host);
  int64_t shared[1] = {0};
  for (int r = 0; r < host.size(); ++r) {
    if (r != host.rank() && links[r] == profile::Link::kSameGpu) shared[0] = 1;
  }
  // A rank alone on its GPU sees no neighbour where another pair shares one: all must agree.
  host.all_reduce_sum(shared);
  return shared[0] > 0;
}

RowTransport make_row_transport(parallel::Communicator& host, EpTransport choice, int device,
                                cudaStream_t stream) {
  const bool shared = ranks_share_a_gpu(host);
  if (choice == EpTransport::kNccl) {
    MOE_CHECK(have_nccl(),
              "--ep-transport nccl: this build has no NCCL (nccl.h and libnccl beside the CUDA "
              "toolkit at configure time); use --ep-transport staged or auto");
    MOE_CHECK(!shared,
              "--ep-transport nccl: two ranks of this job share a GPU, which NCCL refuses; give "
              "each rank a GPU of its own or use --ep-transport staged or auto");
  }
  const bool nccl =
      choice == EpTransport::kNccl || (choice == EpTransport::kAuto && have_nccl() && !shared);
  RowTransport transport{.stream = stream};
#if defined(MOE_HAVE_NCCL) && MOE_HAVE_NCCL
  if (nccl) {
    if (host.size() == 1) {
      transport.comm = parallel::NcclCommunicator::single(device, stream);
    } else {
      // Every rank gets rank 0's id through the host communicator, then joins.
      const ncclUniqueId id = parallel::nccl_unique_id_via(host);
      transport.comm =
          parallel::NcclCommunicator::create(host.rank(), host.size(), id, device, stream);
    }
    transport.stream_ordered = true;
    return transport;
  }
#else
  (void)device;
  (void)nccl;
#endif
  transport.comm = std::make_unique<StagedDeviceCommunicator>(host, stream);
  return transport;
}

}  // namespace moeinfer::gpu
