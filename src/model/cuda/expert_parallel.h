// Expert parallelism on the GPU (--ep N --device cuda, issue 15): the MoE block's dispatch and
// combine stages move each rank's routed rows to the ranks that hold their experts and the
// outputs back, with the placement table and replica rule of the CPU dispatcher
// (moe/expert_parallel.h; its DispatchLayout is the bookkeeping of both).
//
// DeviceDispatcher: the rows stay in device memory from the permute to the unpermute.
//   dispatch  the plan's rows gathered on the device (cuda::permute, weighted there under
//             WeightPlacement::kInput as the local dispatcher does); only the plan's offsets
//             (E + 2 ints) come to the host, in the layer's one synchronisation, for
//             DispatchLayout to plan the sends; a kernel (cuda::move_rows) packs the rows by
//             receiver, slot and plan order while the per-slot counts go round over the host
//             communicator; the rows travel through the row transport (row_transport.h: NCCL
//             between GPUs, or staged through pinned host memory where ranks share a GPU); a
//             kernel puts the received rows in logical-expert order, with offsets over all E
//             experts (the rank's experts non-empty), so that the unchanged grouped GEMM of the
//             resident runner computes only this rank's experts
//   combine   a kernel puts the outputs back in the order their rows came, the transport
//             returns them, a kernel puts them in plan order (the padding expert's rows zero)
//             and they are unpermuted as on one GPU
// The index maps (send_pos, row_of_recv) are computed on the host and uploaded as small int
// arrays. Rows are moved, never recomputed, in the CPU dispatcher's order, so the logits equal
// those of one GPU bit for bit under --deterministic. The stream is synchronised for the offsets
// (and, staged, for each exchange), so a decode step cannot be a CUDA graph: the decoder runs
// every step eagerly under --ep. Over NCCL on the decoder's stream the exchanges are kernels in
// stream order: the host waits for one (and sees NCCL's errors) only before the next. A rank
// without tokens still takes part in every exchange. Not built yet: two micro-batches
// overlapping the exchanges.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/cuda/device_memory.h"
#include "model/cuda/moe_block.h"
#include "model/cuda/row_transport.h"
#include "moe/expert_parallel.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"
#include "profile/profiler.h"

namespace moeinfer::gpu {

// How rank r's bytes reach each rank from this one: kSameGpu when both ranks run on this GPU,
// kPeerGpu for another GPU of this host, kNetwork for another host. Collective (an all_gather of
// each rank's host name and device UUID); the current device is this rank's.
std::vector<profile::Link> link_classes(parallel::Communicator& comm);

// Where the received rows of a layer go in logical-expert order, from `layout` after merge and
// this rank's slots (slot j holds logical expert slots[j]).
struct ExpertOrder {
  std::vector<int32_t> offsets;      // [E + 1] received rows per logical expert, prefix-summed
  std::vector<int32_t> row_of_recv;  // [received] received row i's row in expert order
};
ExpertOrder expert_order(const moe::DispatchLayout& layout, std::span<const int32_t> slots,
                         int64_t num_experts);

class DeviceDispatcher final : public TokenDispatcher {
 public:
  // host: the job's communicator (the counts; link classes), which must outlive this;
  // rows: the transport over device buffers of the same job (make_row_transport), owned.
  // placement.num_ranks() == host.size(). max_rows_out: the rows this rank's experts can take in
  // one layer (the runner's workspace, N times the step's T*K); plan_rows: [T*K, Hp] device
  // workspace for the gathered rows. Collective (link_classes).
  DeviceDispatcher(parallel::Communicator& host, RowTransport rows,
                   parallel::ExpertPlacement placement, int64_t num_experts, int64_t hidden_size,
                   int64_t max_rows_out, bf16* plan_rows);
  ~DeviceDispatcher() override;
  DeviceDispatcher(const DeviceDispatcher&) = delete;
  DeviceDispatcher& operator=(const DeviceDispatcher&) = delete;

  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens, cudaStream_t stream) override;
  void combine(int64_t layer, const bf16* expert_out, const RoutedTokens& tokens,
               const bf16* shared, float* out, cudaStream_t stream) override;
  bool moves_rows() const override { return true; }
  // Bytes this rank has sent to the other ranks (rows and outputs), by profile::Link.
  const std::array<int64_t, profile::kNumLinks>& bytes_sent() const { return bytes_sent_; }
  // What carries the rows ("nccl", "staged:mpi", ...).
  std::string transport_name() const { return rows_.comm->name(); }

 private:
  // Counts `bytes` [N] sent by link class (to the profiler too, when one is active).
  void count_sent(const std::vector<int64_t>& bytes);
  // The rows' all_to_allv over the transport, after what `stream` has enqueued; what `stream`
  // enqueues next sees `recv` filled (the host waits for it here, or, on a stream-ordered
  // transport on `stream`, at the next exchange).
  void exchange(const bf16* send, std::span<const int64_t> send_bytes, bf16* recv,
                std::span<const int64_t> recv_bytes, cudaStream_t stream);

  parallel::Communicator& host_;
  RowTransport rows_;
  parallel::ExpertPlacement placement_;
  int64_t num_experts_;  // E
  int64_t hidden_size_;  // Hp
  int64_t max_rows_out_;
  bf16* plan_rows_;  // [T*K, Hp] device
  std::vector<profile::Link> links_;  // [N] by receiver
  std::array<int64_t, profile::kNumLinks> bytes_sent_{};
  // Recorded where the rows were packed, for a transport on another stream to wait on.
  cudaEvent_t packed_ = nullptr;

  moe::DispatchLayout layout_;
  int64_t plan_rows_total_ = 0;  // T*K of the layer in flight (padding rows included)
  int64_t real_rows_ = 0;        // its plan rows of real experts, [0, real_rows_)
  std::vector<int32_t> host_offsets_;  // [E + 2] the plan's offsets, downloaded
  PinnedArray<int32_t> pinned_offsets_;
  // Index maps staged for upload: send_pos [real rows]; the expert offsets [E + 1] then
  // row_of_recv [received]. Rewritten only after the next layer's synchronisation.
  PinnedArray<int32_t> send_pos_host_, recv_maps_host_;
  size_t send_pos_host_cap_ = 0, recv_maps_host_cap_ = 0;
  // Device: the maps; the rows in send order (later the outputs returned), in source order
  // (later the outputs going back), in expert order; the outputs in plan order.
  DeviceArray<int32_t> send_pos_dev_, recv_maps_dev_;
  size_t send_pos_dev_cap_ = 0, recv_maps_dev_cap_ = 0;
  DeviceArray<bf16> send_rows_, recv_rows_, expert_rows_, plan_out_;
  size_t send_rows_cap_ = 0, recv_rows_cap_ = 0, expert_rows_cap_ = 0, plan_out_cap_ = 0;
  // The last exchange on a stream-ordered transport, not yet waited for on the host. Last, so
  // that it is waited for before the buffers above are freed.
  parallel::PendingOp in_flight_;
};

}  // namespace moeinfer::gpu
