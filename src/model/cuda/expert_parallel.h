// Expert parallelism on the GPU (--ep N --device cuda, issue 15): the MoE block's dispatch and
// combine stages move each rank's routed rows to the ranks that hold their experts and the
// outputs back, through a parallel::Communicator, with the placement table and replica rule of
// the CPU dispatcher (moe/expert_parallel.h; its DispatchLayout is the bookkeeping of both).
//
// This first version is host-staged, so that it runs over any Communicator (MPI between
// processes, two of which may share one GPU):
//   dispatch  the plan's rows gathered on the device (cuda::permute, weighted there under
//             WeightPlacement::kInput as the local dispatcher does) and copied with the plan's
//             offsets to pinned host memory; the per-slot counts and the bf16 rows go out by
//             all_to_allv; the received rows are uploaded in logical-expert order with offsets
//             over all E experts (the rank's experts non-empty), so that the unchanged grouped
//             GEMM of the resident runner computes only this rank's experts
//   combine   the outputs downloaded, returned by all_to_allv in the order they came, put back
//             in plan order, uploaded and unpermuted as on one GPU
// The stream is synchronised twice per layer (before each exchange), so a decode step cannot be
// a CUDA graph: the decoder runs every step eagerly under --ep. A rank without tokens still takes
// part in every exchange. Not built yet: device buffers straight through NcclCommunicator, and
// two micro-batches overlapping the exchanges.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <vector>

#include "model/cuda/device_memory.h"
#include "model/cuda/moe_block.h"
#include "moe/expert_parallel.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"
#include "profile/profiler.h"

namespace moeinfer::gpu {

// How rank r's bytes reach each rank from this one: kSameGpu when both ranks run on this GPU,
// kPeerGpu for another GPU of this host, kNetwork for another host. Collective (an all_gather of
// each rank's host name and device UUID); the current device is this rank's.
std::vector<profile::Link> link_classes(parallel::Communicator& comm);

class HostStagedDispatcher final : public TokenDispatcher {
 public:
  // comm must outlive this; placement.num_ranks() == comm.size(). max_rows_out: the rows this
  // rank's experts can take in one layer (the runner's workspace, N times the step's T*K);
  // plan_rows: [T*K, Hp] device workspace for the gathered rows. Collective (link_classes).
  HostStagedDispatcher(parallel::Communicator& comm, parallel::ExpertPlacement placement,
                       int64_t num_experts, int64_t hidden_size, int64_t max_rows_out,
                       bf16* plan_rows);
  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens, cudaStream_t stream) override;
  void combine(int64_t layer, const bf16* expert_out, const RoutedTokens& tokens,
               const bf16* shared, float* out, cudaStream_t stream) override;
  bool moves_rows() const override { return true; }
  // Bytes this rank has sent to the other ranks (rows and outputs), by profile::Link.
  const std::array<int64_t, profile::kNumLinks>& bytes_sent() const { return bytes_sent_; }

 private:
  // Counts `bytes` [N] sent by link class (to the profiler too, when one is active).
  void count_sent(const std::vector<int64_t>& bytes);

  parallel::Communicator& comm_;
  parallel::ExpertPlacement placement_;
  int64_t num_experts_;  // E
  int64_t hidden_size_;  // Hp
  int64_t max_rows_out_;
  bf16* plan_rows_;  // [T*K, Hp] device
  std::vector<profile::Link> links_;  // [N] by receiver
  std::array<int64_t, profile::kNumLinks> bytes_sent_{};

  moe::DispatchLayout layout_;
  int64_t plan_rows_total_ = 0;  // T*K of the layer in flight (padding rows included)
  int64_t real_rows_ = 0;        // its plan rows of real experts, [0, real_rows_)
  std::vector<int32_t> host_offsets_;     // [E + 2] the plan's offsets, downloaded
  std::vector<int32_t> offsets_by_expert_;  // [E + 1] received rows per logical expert
  std::vector<int32_t> row_of_recv_;      // [received] its row in expert order
  // Pinned host staging (grown as needed), bf16 rows of Hp.
  PinnedArray<int32_t> pinned_offsets_;
  PinnedArray<bf16> plan_host_;    // [T*K, Hp] the gathered rows; later the outputs, plan order
  PinnedArray<bf16> send_host_;    // [rows, Hp] in send order; later the outputs returned
  PinnedArray<bf16> recv_host_;    // [received, Hp] in source order; later outputs back
  PinnedArray<bf16> expert_host_;  // [received, Hp] in expert order (rows, then outputs)
  size_t plan_cap_ = 0, send_cap_ = 0, recv_cap_ = 0, expert_cap_ = 0;
  // Device: the received rows in expert order and their offsets; the outputs in plan order.
  DeviceArray<bf16> rows_dev_;
  DeviceArray<int32_t> offsets_dev_;
  DeviceArray<bf16> plan_out_dev_;
  size_t rows_dev_cap_ = 0, plan_out_cap_ = 0;
};

}  // namespace moeinfer::gpu
