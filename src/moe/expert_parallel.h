// Expert parallelism on the CPU (../shared/DESIGN.md, "The MoE block"): the routed experts are
// sharded over the ranks of a parallel::Communicator and the MoE block's dispatcher moves rows
// to the rank of their expert and the outputs back. Attention stays data-parallel (each rank
// runs its own tokens); every rank enters every MoE layer's dispatch and combine together, a
// rank without tokens too.
//
// Per MoE layer, with the local plan (assignments sorted by expert) and rank r holding the
// contiguous experts [first(r), first(r + 1)), rank r's rows are a contiguous run of the plan:
//   dispatch  all_to_allv of the per-expert row counts (only the receiver's experts), then of the
//             rows themselves (float32, so that the outputs are those of one process); the
//             receiver merges the sources' runs into its experts' order
//   run       the ExpertRunner computes the rank's experts over those rows (first_expert =
//             first(r))
//   combine   the outputs travel back in the order they came, all_to_allv again, and land in
//             plan order at their source, where unpermute sums them as one process does
// Only what the receiver needs crosses: the rows and one count per (source, expert).
#pragma once

#include <cstdint>
#include <vector>

#include "moe/moe_block.h"
#include "parallel/communicator.h"

namespace moeinfer::moe {

// Which rank holds each routed expert: contiguous ranges, the first E % N ranks one more.
class ExpertPlacement {
 public:
  ExpertPlacement(int64_t num_experts, int num_ranks);
  int num_ranks() const { return static_cast<int>(starts_.size()) - 1; }
  int64_t first(int rank) const { return starts_[rank]; }
  int64_t count(int rank) const { return starts_[rank + 1] - starts_[rank]; }
  int rank_of(int64_t expert) const;

 private:
  std::vector<int64_t> starts_;  // [N + 1]
};

class ExpertParallelDispatcher final : public TokenDispatcher {
 public:
  // comm must outlive this; placement.num_ranks() == comm.size().
  ExpertParallelDispatcher(parallel::Communicator& comm, ExpertPlacement placement,
                           int64_t hidden_size);
  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens) override;
  void combine(int64_t layer, const float* expert_out, const RoutedTokens& tokens,
               const float* shared, float* out) override;

 private:
  parallel::Communicator& comm_;
  ExpertPlacement placement_;
  int64_t hidden_size_;
  // Send side, in plan order.
  std::vector<float> send_rows_;     // [T*K, H]
  std::vector<int64_t> send_bytes_;  // [N] rows' bytes to each rank
  // Receive side.
  std::vector<int32_t> recv_counts_;         // [N, experts of this rank]
  std::vector<float> recv_rows_;             // [received, H] in source order
  std::vector<int64_t> recv_bytes_;          // [N]
  std::vector<int32_t> expert_row_of_recv_;  // [received] its row in expert order
  std::vector<float> expert_rows_;           // [received, H] in expert order
  std::vector<int32_t> expert_offsets_;      // [experts of this rank + 1]
  std::vector<float> back_;                  // [received, H] outputs in source order
  std::vector<float> returned_;              // [T*K, H] outputs in plan order
};

}  // namespace moeinfer::moe
