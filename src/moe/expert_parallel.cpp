#include "moe/expert_parallel.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "profile/profiler.h"

namespace moeinfer::moe {

ExpertPlacement::ExpertPlacement(int64_t num_experts, int num_ranks) {
  MOE_CHECK(num_ranks >= 1, "expert placement over ", num_ranks, " ranks");
  MOE_CHECK(num_experts >= num_ranks, "expert parallelism over ", num_ranks, " ranks needs at ",
            "least one routed expert per rank; the model has ", num_experts);
  starts_.resize(static_cast<size_t>(num_ranks) + 1, 0);
  const int64_t base = num_experts / num_ranks, extra = num_experts % num_ranks;
  for (int r = 0; r < num_ranks; ++r) starts_[r + 1] = starts_[r] + base + (r < extra ? 1 : 0);
}

int ExpertPlacement::rank_of(int64_t expert) const {
  MOE_CHECK(expert >= 0 && expert < starts_.back(), "expert ", expert, " outside [0, ",
            starts_.back(), ")");
  return static_cast<int>(std::upper_bound(starts_.begin(), starts_.end(), expert) -
                          starts_.begin()) -
         1;
}

ExpertParallelDispatcher::ExpertParallelDispatcher(parallel::Communicator& comm,
                                                   ExpertPlacement placement, int64_t hidden_size)
    : comm_(comm), placement_(std::move(placement)), hidden_size_(hidden_size) {
  MOE_CHECK(placement_.num_ranks() == comm_.size(), "a placement over ", placement_.num_ranks(),
            " ranks for a job of ", comm_.size());
}

ExpertRows ExpertParallelDispatcher::dispatch(int64_t /*layer*/, const RoutedTokens& tokens) {
  const DispatchPlan& plan = *tokens.plan;
  const int N = comm_.size(), me = comm_.rank();
  const int64_t H = hidden_size_, mine = placement_.count(me);
  const int64_t row_bytes = H * static_cast<int64_t>(sizeof(float));
  send_rows_.resize(plan.src_row.size() * static_cast<size_t>(H));
  moe::dispatch(tokens.hidden, H, *tokens.routing, plan, send_rows_.data());

  // Counts: each rank gets this rank's row count of each of its experts.
  std::vector<int32_t> send_counts(plan.expert_counts.begin(), plan.expert_counts.end());
  std::vector<int64_t> count_send(N), count_recv(N, mine * static_cast<int64_t>(sizeof(int32_t)));
  send_bytes_.assign(N, 0);
  for (int r = 0; r < N; ++r) {
    count_send[r] = placement_.count(r) * static_cast<int64_t>(sizeof(int32_t));
    const int64_t rows = plan.expert_offsets[placement_.first(r) + placement_.count(r)] -
                         plan.expert_offsets[placement_.first(r)];
    send_bytes_[r] = rows * row_bytes;
  }
  recv_counts_.resize(static_cast<size_t>(N * mine));
  comm_.all_to_allv(send_counts.data(), count_send, recv_counts_.data(), count_recv);

  // Rows.
  recv_bytes_.assign(N, 0);
  int64_t received = 0;
  for (int s = 0; s < N; ++s) {
    int64_t rows = 0;
    for (int64_t j = 0; j < mine; ++j) {
      const int32_t c = recv_counts_[s * mine + j];
      MOE_CHECK(c >= 0, "rank ", s, " announced ", c, " rows for expert ",
                placement_.first(me) + j);
      rows += c;
    }
    recv_bytes_[s] = rows * row_bytes;
    received += rows;
  }
  recv_rows_.resize(static_cast<size_t>(received * H));
  comm_.all_to_allv(send_rows_.data(), send_bytes_, recv_rows_.data(), recv_bytes_);
  if (profile::Profiler* p = profile::active()) {
    int64_t remote = 0;
    for (int r = 0; r < N; ++r) remote += r == me ? 0 : send_bytes_[r];
    p->add_link_bytes(profile::Link::kNetwork, remote);
  }

  // Merge the sources' runs into expert order: expert j's rows from source 0, then 1, ...
  expert_offsets_.assign(static_cast<size_t>(mine) + 1, 0);
  for (int s = 0; s < N; ++s) {
    for (int64_t j = 0; j < mine; ++j) expert_offsets_[j + 1] += recv_counts_[s * mine + j];
  }
  for (int64_t j = 0; j < mine; ++j) expert_offsets_[j + 1] += expert_offsets_[j];
  std::vector<int32_t> next(expert_offsets_.begin(), expert_offsets_.end() - 1);
  expert_row_of_recv_.resize(static_cast<size_t>(received));
  expert_rows_.resize(recv_rows_.size());
  int64_t r = 0;
  for (int s = 0; s < N; ++s) {
    for (int64_t j = 0; j < mine; ++j) {
      for (int32_t i = 0; i < recv_counts_[s * mine + j]; ++i, ++r) {
        const int32_t dst = next[j]++;
        expert_row_of_recv_[r] = dst;
        std::memcpy(expert_rows_.data() + dst * H, recv_rows_.data() + r * H,
                    static_cast<size_t>(row_bytes));
      }
    }
  }
  return {.rows = expert_rows_.data(),
          .expert_offsets = expert_offsets_,
          .first_expert = placement_.first(me)};
}

void ExpertParallelDispatcher::combine(int64_t /*layer*/, const float* expert_out,
                                       const RoutedTokens& tokens, const float* shared,
                                       float* out) {
  const int64_t H = hidden_size_;
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(float);
  {
    MOE_PROFILE_SCOPE(profile::Stage::kCombine);
    back_.resize(expert_row_of_recv_.size() * static_cast<size_t>(H));
    for (size_t r = 0; r < expert_row_of_recv_.size(); ++r) {
      std::memcpy(back_.data() + r * H, expert_out + expert_row_of_recv_[r] * H, row_bytes);
    }
    returned_.resize(send_rows_.size());
    // The reverse of dispatch: what came from rank s goes back to it, in the order it came.
    comm_.all_to_allv(back_.data(), recv_bytes_, returned_.data(), send_bytes_);
    if (profile::Profiler* p = profile::active()) {
      int64_t remote = 0;
      for (int s = 0; s < comm_.size(); ++s) remote += s == comm_.rank() ? 0 : recv_bytes_[s];
      p->add_link_bytes(profile::Link::kNetwork, remote);
    }
  }
  MOE_PROFILE_SCOPE(profile::Stage::kUnpermute);
  unpermute(returned_.data(), H, *tokens.routing, *tokens.plan, shared, out);
}

}  // namespace moeinfer::moe
