// Expert parallelism on the CPU (../shared/DESIGN.md, "The MoE block"): the routed experts are
// sharded over the ranks of a parallel::Communicator and the MoE block's dispatcher moves rows
// to the rank of their expert and the outputs back. Attention stays data-parallel (each rank
// runs its own tokens); every rank enters every MoE layer's dispatch and combine together, a
// rank without tokens too.
//
// Per MoE layer, with the layer's placement table (parallel/placement.h: each rank's slots, any
// logical experts, some with replicas on several ranks):
//   dispatch  each assignment picks one replica of its expert: the i-th row of expert e (in plan
//             order) goes to replica (i + source rank) mod m of its m, so the rows of a replicated
//             expert spread evenly. The rows are sent grouped by receiver, then by the receiver's
//             slot; an all_to_allv of the per-slot row counts goes first, then the rows (float32,
//             so that the outputs are those of one process), started non-blocking so that the
//             block's in-flight work (the shared experts, --overlap on) runs while they travel;
//             the receiver merges the sources' runs into its slots' order
//   run       the ExpertRunner computes the rank's slots over those rows (ExpertRows::expert_ids)
//   combine   the outputs travel back in the order they came, all_to_allv again, and return to
//             plan order at their source, where unpermute sums them as one process does
// Only what the receiver needs crosses: the rows and one count per (source, slot). Every replica
// computes the same function, so the placement changes neither routing nor outputs.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/moe_block.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"

namespace moeinfer::moe {

class ExpertParallelDispatcher final : public TokenDispatcher {
 public:
  // comm must outlive this; placement.num_ranks() == comm.size().
  ExpertParallelDispatcher(parallel::Communicator& comm, parallel::ExpertPlacement placement,
                           int64_t hidden_size);
  // The rows' all_to_allv is started, `while_in_flight` runs, then it is waited for.
  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens,
                      const InFlightWork& while_in_flight) override;
  void combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
               const float* shared, float* out) override;

 private:
  parallel::Communicator& comm_;
  parallel::ExpertPlacement placement_;
  int64_t hidden_size_;
  // Send side.
  std::vector<int32_t> send_pos_;     // [T*K] each plan row's place in send_rows_
  std::vector<int32_t> send_counts_;  // rows per (receiver, its slot), receivers in rank order
  std::vector<float> send_rows_;      // [T*K, H] by receiver, then slot, then plan order
  std::vector<int64_t> send_bytes_;   // [N] rows' bytes to each rank
  // Receive side.
  std::vector<int32_t> recv_counts_;         // [N, slots of this rank]
  std::vector<float> recv_rows_;             // [received, H] in source order
  std::vector<int64_t> recv_bytes_;          // [N]
  std::vector<int32_t> expert_row_of_recv_;  // [received] its row in slot order
  std::vector<float> expert_rows_;           // [received, H] in slot order
  std::vector<int32_t> expert_offsets_;      // [slots of this rank + 1]
  std::vector<int32_t> slot_ids_;            // [slots of this rank] their logical experts
  std::vector<float> back_;                  // [received, H] outputs in source order
  std::vector<float> returned_;              // [T*K, H] outputs in send order
  std::vector<float> plan_out_;              // [T*K, H] outputs in plan order
};

}  // namespace moeinfer::moe
