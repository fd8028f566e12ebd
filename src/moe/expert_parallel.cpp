#include "moe/expert_parallel.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "profile/profiler.h"

namespace moeinfer::moe {

ExpertParallelDispatcher::ExpertParallelDispatcher(parallel::Communicator& comm,
                                                   parallel::ExpertPlacement placement,
                                                   int64_t hidden_size, DispatchDtype wire)
    : comm_(comm), placement_(std::move(placement)), hidden_size_(hidden_size), wire_(wire) {
  MOE_CHECK(placement_.num_ranks() == comm_.size(), "a placement over ", placement_.num_ranks(),
            " ranks for a job of ", comm_.size());
}

ExpertRows ExpertParallelDispatcher::dispatch(int64_t layer, const RoutedTokens& tokens,
                                              const InFlightWork& while_in_flight) {
  start_dispatch(layer, tokens);
  if (while_in_flight) while_in_flight();
  return finish_dispatch(layer, tokens);
}

void ExpertParallelDispatcher::start_dispatch(int64_t layer, const RoutedTokens& tokens) {
  MOE_CHECK(!rows_in_flight_.pending() && !outputs_in_flight_.pending(), "layer ", layer,
            ": dispatch started while this dispatcher's last exchange is in flight");
  const DispatchPlan& plan = *tokens.plan;
  const parallel::LayerPlacement& table = placement_.layer(layer);
  const int N = comm_.size(), me = comm_.rank();
  const int64_t H = hidden_size_, E = table.num_experts();
  const int64_t row_bytes = encoded_row_bytes(wire_, H);  // on the wire
  const int64_t num_rows = static_cast<int64_t>(plan.src_row.size());
  MOE_CHECK(static_cast<int64_t>(plan.expert_offsets.size()) == E + 1, "layer ", layer,
            " routes over ", plan.expert_offsets.size() - 1, " experts; its placement has ", E);
  const int64_t mine = static_cast<int64_t>(table.slots(me).size());

  // (receiver, slot) pairs are numbered receiver by receiver; replica q of expert e is pair
  // pair_of_replica[replica_start[e] + q].
  std::vector<int32_t> slot_base(static_cast<size_t>(N) + 1, 0);
  for (int d = 0; d < N; ++d) {
    slot_base[d + 1] = slot_base[d] + static_cast<int32_t>(table.slots(d).size());
  }
  std::vector<int32_t> replica_start(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    replica_start[e + 1] = replica_start[e] + static_cast<int32_t>(table.replicas(e).size());
  }
  std::vector<int32_t> pair_of_replica(static_cast<size_t>(replica_start[E]));
  std::vector<int32_t> filled(static_cast<size_t>(E), 0);
  for (int d = 0; d < N; ++d) {  // replicas(e) is in rank order, as this walk
    const auto slots = table.slots(d);
    for (size_t j = 0; j < slots.size(); ++j) {
      const int32_t e = slots[j];
      pair_of_replica[replica_start[e] + filled[e]++] = slot_base[d] + static_cast<int32_t>(j);
    }
  }

  // Each plan row's pair, the rows per pair, and each row's place in the send buffer.
  send_counts_.assign(static_cast<size_t>(slot_base[N]), 0);
  send_pos_.resize(static_cast<size_t>(num_rows));
  for (int64_t e = 0; e < E; ++e) {
    const int32_t m = replica_start[e + 1] - replica_start[e];
    for (int32_t r = plan.expert_offsets[e]; r < plan.expert_offsets[e + 1]; ++r) {
      const int32_t q = (r - plan.expert_offsets[e] + me) % m;
      const int32_t pair = pair_of_replica[replica_start[e] + q];
      send_pos_[r] = pair;
      ++send_counts_[pair];
    }
  }
  std::vector<int32_t> next(send_counts_.size() + 1, 0);
  for (size_t p = 0; p < send_counts_.size(); ++p) next[p + 1] = next[p] + send_counts_[p];
  send_num_rows_.assign(N, 0);
  std::vector<int64_t> send_bytes(N);
  for (int d = 0; d < N; ++d) {
    send_num_rows_[d] = next[slot_base[d + 1]] - next[slot_base[d]];
    send_bytes[d] = send_num_rows_[d] * row_bytes;
  }
  for (int64_t r = 0; r < num_rows; ++r) send_pos_[r] = next[send_pos_[r]]++;
  send_rows_.resize(static_cast<size_t>(num_rows * row_bytes));
  const int64_t K = tokens.routing->top_k;
  parallel_for(
      num_rows,
      [&](int64_t begin, int64_t end) {
        std::vector<float> weighted(tokens.weights == WeightPlacement::kInput ? H : 0);  // [H]
        for (int64_t r = begin; r < end; ++r) {
          const int64_t token = plan.src_row[r] / K;
          std::byte* dst = send_rows_.data() + static_cast<int64_t>(send_pos_[r]) * row_bytes;
          switch (tokens.weights) {
            case WeightPlacement::kOutput:
              encode_row(wire_, tokens.hidden + token * H, H, dst);
              break;
            case WeightPlacement::kInput: {  // the row leaves already weighted (Llama 4)
              const float weight = tokens.routing->topk_weights[plan.src_row[r]];
              for (int64_t h = 0; h < H; ++h) weighted[h] = tokens.hidden[token * H + h] * weight;
              encode_row(wire_, weighted.data(), H, dst);
              break;
            }
          }
        }
      },
      64);

  // Counts: each rank gets this rank's row count of each of its slots.
  std::vector<int64_t> count_send(N), count_recv(N, mine * static_cast<int64_t>(sizeof(int32_t)));
  for (int d = 0; d < N; ++d) {
    count_send[d] = (slot_base[d + 1] - slot_base[d]) * static_cast<int64_t>(sizeof(int32_t));
  }
  recv_counts_.resize(static_cast<size_t>(N * mine));
  comm_.all_to_allv(send_counts_.data(), count_send, recv_counts_.data(), count_recv);

  // Rows.
  recv_num_rows_.assign(N, 0);
  std::vector<int64_t> recv_bytes(N);
  int64_t received = 0;
  const auto my_slots = table.slots(me);
  for (int s = 0; s < N; ++s) {
    int64_t rows = 0;
    for (int64_t j = 0; j < mine; ++j) {
      const int32_t c = recv_counts_[s * mine + j];
      MOE_CHECK(c >= 0, "rank ", s, " announced ", c, " rows for expert ", my_slots[j]);
      rows += c;
    }
    recv_num_rows_[s] = rows;
    recv_bytes[s] = rows * row_bytes;
    received += rows;
  }
  recv_rows_.resize(static_cast<size_t>(received * row_bytes));
  rows_in_flight_ =
      comm_.start_all_to_allv(send_rows_.data(), send_bytes, recv_rows_.data(), recv_bytes);
  if (profile::Profiler* p = profile::active()) {  // the encoded bytes, as they are sent
    int64_t remote = 0;
    for (int r = 0; r < N; ++r) remote += r == me ? 0 : send_bytes[r];
    p->add_link_bytes(profile::Link::kNetwork, remote);
  }
}

ExpertRows ExpertParallelDispatcher::finish_dispatch(int64_t layer,
                                                     const RoutedTokens& /*tokens*/) {
  rows_in_flight_.wait();
  const parallel::LayerPlacement& table = placement_.layer(layer);
  const int N = comm_.size(), me = comm_.rank();
  const int64_t H = hidden_size_;
  const int64_t row_bytes = encoded_row_bytes(wire_, H);
  const int64_t mine = static_cast<int64_t>(table.slots(me).size());
  const auto my_slots = table.slots(me);
  int64_t received = 0;
  for (int64_t n : recv_num_rows_) received += n;

  // Merge the sources' runs into slot order: slot j's rows from source 0, then 1, ...
  expert_offsets_.assign(static_cast<size_t>(mine) + 1, 0);
  for (int s = 0; s < N; ++s) {
    for (int64_t j = 0; j < mine; ++j) expert_offsets_[j + 1] += recv_counts_[s * mine + j];
  }
  for (int64_t j = 0; j < mine; ++j) expert_offsets_[j + 1] += expert_offsets_[j];
  std::vector<int32_t> slot_next(expert_offsets_.begin(), expert_offsets_.end() - 1);
  expert_row_of_recv_.resize(static_cast<size_t>(received));
  int64_t r = 0;
  for (int s = 0; s < N; ++s) {
    for (int64_t j = 0; j < mine; ++j) {
      for (int32_t i = 0; i < recv_counts_[s * mine + j]; ++i, ++r) {
        expert_row_of_recv_[r] = slot_next[j]++;
      }
    }
  }
  expert_rows_.resize(static_cast<size_t>(received * H));
  parallel_for(
      received,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          decode_row(wire_, recv_rows_.data() + i * row_bytes, H,
                     expert_rows_.data() + static_cast<int64_t>(expert_row_of_recv_[i]) * H);
        }
      },
      64);
  slot_ids_.assign(my_slots.begin(), my_slots.end());
  return {.rows = expert_rows_.data(), .expert_offsets = expert_offsets_, .expert_ids = slot_ids_};
}

void ExpertParallelDispatcher::combine(int64_t layer, const float* expert_out,
                                       const RoutedTokens& tokens, const float* shared,
                                       float* out) {
  {
    MOE_PROFILE_SCOPE(profile::Stage::kCombine);
    send_outputs(layer, expert_out);
    receive_outputs();
  }
  MOE_PROFILE_SCOPE(profile::Stage::kUnpermute);
  unpermute(plan_out_.data(), hidden_size_, *tokens.routing, *tokens.plan, shared, out,
            tokens.weights);
}

void ExpertParallelDispatcher::start_combine(int64_t layer, const float* expert_out,
                                             const RoutedTokens& /*tokens*/) {
  MOE_PROFILE_SCOPE(profile::Stage::kCombine);
  send_outputs(layer, expert_out);
}

void ExpertParallelDispatcher::finish_combine(int64_t /*layer*/, const float* /*expert_out*/,
                                              const RoutedTokens& tokens, const float* shared,
                                              float* out) {
  {
    MOE_PROFILE_SCOPE(profile::Stage::kCombine);
    receive_outputs();
  }
  MOE_PROFILE_SCOPE(profile::Stage::kUnpermute);
  unpermute(plan_out_.data(), hidden_size_, *tokens.routing, *tokens.plan, shared, out,
            tokens.weights);
}

void ExpertParallelDispatcher::send_outputs(int64_t layer, const float* expert_out) {
  MOE_CHECK(!rows_in_flight_.pending() && !outputs_in_flight_.pending(), "layer ", layer,
            ": combine started before this dispatcher's dispatch finished");
  const int64_t H = hidden_size_;
  const size_t row_bytes = static_cast<size_t>(H) * sizeof(float);
  back_.resize(expert_row_of_recv_.size() * static_cast<size_t>(H));
  for (size_t r = 0; r < expert_row_of_recv_.size(); ++r) {
    std::memcpy(back_.data() + r * H, expert_out + expert_row_of_recv_[r] * H, row_bytes);
  }
  returned_.resize(send_pos_.size() * static_cast<size_t>(H));
  // The reverse of dispatch: what came from rank s goes back to it, in the order it came, as
  // float32.
  const int N = comm_.size();
  std::vector<int64_t> back_bytes(N), returned_bytes(N);
  for (int s = 0; s < N; ++s) {
    back_bytes[s] = recv_num_rows_[s] * static_cast<int64_t>(row_bytes);
    returned_bytes[s] = send_num_rows_[s] * static_cast<int64_t>(row_bytes);
  }
  outputs_in_flight_ =
      comm_.start_all_to_allv(back_.data(), back_bytes, returned_.data(), returned_bytes);
  if (profile::Profiler* p = profile::active()) {
    int64_t remote = 0;
    for (int s = 0; s < N; ++s) remote += s == comm_.rank() ? 0 : back_bytes[s];
    p->add_link_bytes(profile::Link::kNetwork, remote);
  }
}

void ExpertParallelDispatcher::receive_outputs() {
  const int64_t H = hidden_size_;
  outputs_in_flight_.wait();
  plan_out_.resize(returned_.size());
  for (size_t r = 0; r < send_pos_.size(); ++r) {
    std::memcpy(plan_out_.data() + r * H, returned_.data() + send_pos_[r] * H,
                static_cast<size_t>(H) * sizeof(float));
  }
}

}  // namespace moeinfer::moe
