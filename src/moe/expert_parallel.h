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
//             slot; an all_to_allv of the per-slot row counts goes first, then the rows, started
//             non-blocking so that the block's in-flight work (the shared experts, --overlap on)
//             runs while they travel; the receiver decodes them and merges the sources' runs into
//             its slots' order. The rows travel encoded as --dispatch-dtype says (row_codec.h):
//             float32 by default, so that the outputs are those of one process; bf16 or fp8
//             (a scale per row) halve or about quarter the bytes. Under WeightPlacement::kInput
//             the weighted rows are encoded
//   run       the ExpertRunner computes the rank's slots over those rows (ExpertRows::expert_ids)
//   combine   the outputs travel back (float32 whatever --dispatch-dtype) in the order they
//             came, all_to_allv again, and return to plan order at their source, where unpermute
//             sums them as one process does
// Only what the receiver needs crosses: the rows and one count per (source, slot). Every replica
// computes the same function, so the placement changes neither routing nor outputs.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe/moe_block.h"
#include "moe/row_codec.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"

namespace moeinfer::moe {

// The bookkeeping of one layer's exchange, shared by the CPU dispatcher and the GPU's
// (model/cuda/expert_parallel.h): where each plan row goes (the replica rule above) and, once the
// counts have arrived, where each received row sits in the rank's slot order. Rows themselves
// are the caller's: it packs plan row r at send_pos[r] and reads received row i (source order)
// into row expert_row_of_recv[i] of the slots' order.
struct DispatchLayout {
  // Send side (plan_sends).
  std::vector<int32_t> send_pos;       // [rows] each plan row's place in the send order
  std::vector<int32_t> send_counts;    // rows per (receiver, its slot), receivers in rank order
  std::vector<int64_t> send_num_rows;  // [N] rows to each rank
  std::vector<int32_t> slot_base;      // [N + 1] the first (receiver, slot) pair of each rank
  // Receive side (exchange_counts, then merge).
  std::vector<int32_t> recv_counts;         // [N, slots of this rank]
  std::vector<int64_t> recv_num_rows;       // [N] rows from each rank
  int64_t received = 0;                     // their sum
  std::vector<int32_t> expert_offsets;      // [slots of this rank + 1] in slot order
  std::vector<int32_t> expert_row_of_recv;  // [received] its row in slot order

  // The plan's rows, expert e's being [expert_offsets[e], expert_offsets[e + 1]) for the
  // table's E experts (entries past E + 1 are ignored: the GPU's padding expert), assigned to
  // replicas from rank `me`.
  void plan_sends(const parallel::LayerPlacement& table, int me,
                  std::span<const int32_t> expert_offsets);
  // The all_to_allv of the per-slot counts (every rank takes part, with or without rows).
  void exchange_counts(parallel::Communicator& comm, const parallel::LayerPlacement& table);
  // The sources' runs merged into slot order: slot j's rows from source 0, then 1, ...
  void merge(int64_t slots_of_me);
};

class ExpertParallelDispatcher final : public TokenDispatcher {
 public:
  // comm must outlive this; placement.num_ranks() == comm.size(). `wire` encodes the rows
  // dispatch sends (the outputs combine returns stay float32).
  ExpertParallelDispatcher(parallel::Communicator& comm, parallel::ExpertPlacement placement,
                           int64_t hidden_size, DispatchDtype wire = DispatchDtype::kF32);
  // The rows' all_to_allv is started, `while_in_flight` runs, then it is waited for.
  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens,
                      const InFlightWork& while_in_flight) override;
  void combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
               const float* shared, float* out) override;
  // The halves (two micro-batches, each with a dispatcher of its own): start_dispatch exchanges
  // the counts, then starts the rows' all_to_allv and returns; finish_dispatch waits for them and
  // merges them into slot order; start_combine starts the outputs' all_to_allv; finish_combine
  // waits for it and unpermutes. One exchange at a time per dispatcher.
  void start_dispatch(int64_t layer, const RoutedTokens& tokens) override;
  ExpertRows finish_dispatch(int64_t layer, const RoutedTokens& tokens) override;
  void start_combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens) override;
  void finish_combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
                      const float* shared, float* out) override;

 private:
  // combine's exchange: the outputs leave in the order their rows came (started), and come back
  // into plan_out_ in plan order (waited for).
  void send_outputs(int64_t layer, const float* expert_out);
  void receive_outputs();

  parallel::Communicator& comm_;
  parallel::ExpertPlacement placement_;
  int64_t hidden_size_;
  DispatchDtype wire_;
  DispatchLayout layout_;
  std::vector<std::byte> send_rows_;  // [T*K, encoded row] by receiver, then slot, then plan order
  std::vector<std::byte> recv_rows_;  // [received, encoded row] in source order
  std::vector<float> expert_rows_;    // [received, H] in slot order
  std::vector<int32_t> slot_ids_;            // [slots of this rank] their logical experts
  std::vector<float> back_;                  // [received, H] outputs in source order
  std::vector<float> returned_;              // [T*K, H] outputs in send order
  std::vector<float> plan_out_;              // [T*K, H] outputs in plan order
  // The exchange started and not yet waited for (its buffers are those above).
  parallel::PendingOp rows_in_flight_;     // send_rows_ -> recv_rows_
  parallel::PendingOp outputs_in_flight_;  // back_ -> returned_
};

}  // namespace moeinfer::moe
