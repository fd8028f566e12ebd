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

void DispatchLayout::plan_sends(const parallel::LayerPlacement& table, int me,
                                std::span<const int32_t> offsets) {
  const int N = table.num_ranks();
  const int64_t E = table.num_experts();
  MOE_CHECK(static_cast<int64_t>(offsets.size()) >= E + 1, "a plan over ",
            static_cast<int64_t>(offsets.size()) - 1, " experts for a placement of ", E);
  const int64_t num_rows = offsets[E];
  // (receiver, slot) pairs are numbered receiver by receiver; replica q of expert e is pair
  // pair_of_replica[replica_start[e] + q].
  slot_base.assign(static_cast<size_t>(N) + 1, 0);
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

  // Each plan row's pair, the rows per pair, and each row's place in the send order.
  send_counts.assign(static_cast<size_t>(slot_base[N]), 0);
  send_pos.resize(static_cast<size_t>(num_rows));
  for (int64_t e = 0; e < E; ++e) {
    const int32_t m = replica_start[e + 1] - replica_start[e];
    for (int32_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const int32_t q = (r - offsets[e] + me) % m;
      const int32_t pair = pair_of_replica[replica_start[e] + q];
      send_pos[r] = pair;
      ++send_counts[pair];
    }
  }
  std::vector<int32_t> next(send_counts.size() + 1, 0);
  for (size_t p = 0; p < send_counts.size(); ++p) next[p + 1] = next[p] + send_counts[p];
  send_num_rows.assign(N, 0);
  for (int d = 0; d < N; ++d) send_num_rows[d] = next[slot_base[d + 1]] - next[slot_base[d]];
  for (int64_t r = 0; r < num_rows; ++r) send_pos[r] = next[send_pos[r]]++;
}

void DispatchLayout::exchange_counts(parallel::Communicator& comm,
                                     const parallel::LayerPlacement& table) {
  const int N = comm.size(), me = comm.rank();
  const int64_t mine = static_cast<int64_t>(table.slots(me).size());
  // Each rank gets this rank's row count of each of its slots.
  std::vector<int64_t> count_send(N), count_recv(N, mine * static_cast<int64_t>(sizeof(int32_t)));
  for (int d = 0; d < N; ++d) {
    count_send[d] = (slot_base[d + 1] - slot_base[d]) * static_cast<int64_t>(sizeof(int32_t));
  }
  recv_counts.resize(static_cast<size_t>(N * mine));
  comm.all_to_allv(send_counts.data(), count_send, recv_counts.data(), count_recv);
  recv_num_rows.assign(N, 0);
  received = 0;
  const auto my_slots = table.slots(me);
  for (int s = 0; s < N; ++s) {
    int64_t rows = 0;
    for (int64_t j = 0; j < mine; ++j) {
      const int32_t c = recv_counts[s * mine + j];
      MOE_CHECK(c >= 0, "rank ", s, " announced ", c, " rows for expert ", my_slots[j]);
      rows += c;
    }
    recv_num_rows[s] = rows;
    received += rows;
  }
}

void DispatchLayout::merge(int64_t mine) {
  const int N = static_cast<int>(recv_num_rows.size());
  expert_offsets.assign(static_cast<size_t>(mine) + 1, 0);
  for (int s = 0; s < N; ++s) {
    for (int64_t j = 0; j < mine; ++j) expert_offsets[j + 1] += recv_counts[s * mine + j];
  }
  for (int64_t j = 0; j < mine; ++j) expert_offsets[j + 1] += expert_offsets[j];
  std::vector<int32_t> slot_next(expert_offsets.begin(), expert_offsets.end() - 1);
  expert_row_of_recv.resize(static_cast<size_t>(received));
  int64_t r = 0;
  for (int s = 0; s < N; ++s) {
    for (int64_t j = 0; j < mine; ++j) {
      for (int32_t i = 0; i < recv_counts[s * mine + j]; ++i, ++r) {
        expert_row_of_recv[r] = slot_next[j]++;
      }
    }
  }
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
  MOE_CHECK(plan.expert_offsets[E] == num_rows, "layer ", layer, ": a plan of ", num_rows,
            " rows whose experts hold ", plan.expert_offsets[E]);
  layout_.plan_sends(table, me, plan.expert_offsets);
  std::vector<int64_t> send_bytes(N);
  for (int d = 0; d < N; ++d) send_bytes[d] = layout_.send_num_rows[d] * row_bytes;
  send_rows_.resize(static_cast<size_t>(num_rows * row_bytes));
  const int64_t K = tokens.routing->top_k;
  parallel_for(
      num_rows,
      [&](int64_t begin, int64_t end) {
        std::vector<float> weighted(tokens.weights == WeightPlacement::kInput ? H : 0);  // [H]
        for (int64_t r = begin; r < end; ++r) {
          const int64_t token = plan.src_row[r] / K;
          std::byte* dst =
              send_rows_.data() + static_cast<int64_t>(layout_.send_pos[r]) * row_bytes;
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

  // Counts, then the rows.
  layout_.exchange_counts(comm_, table);
  std::vector<int64_t> recv_bytes(N);
  for (int s = 0; s < N; ++s) recv_bytes[s] = layout_.recv_num_rows[s] * row_bytes;
  recv_rows_.resize(static_cast<size_t>(layout_.received * row_bytes));
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
  const int64_t H = hidden_size_;
  const int64_t row_bytes = encoded_row_bytes(wire_, H);
  const auto my_slots = table.slots(comm_.rank());
  const int64_t received = layout_.received;
  layout_.merge(static_cast<int64_t>(my_slots.size()));
  expert_rows_.resize(static_cast<size_t>(received * H));
  parallel_for(
      received,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          decode_row(wire_, recv_rows_.data() + i * row_bytes, H,
                     expert_rows_.data() +
                         static_cast<int64_t>(layout_.expert_row_of_recv[i]) * H);
        }
      },
      64);
  slot_ids_.assign(my_slots.begin(), my_slots.end());
  return {.rows = expert_rows_.data(),
          .expert_offsets = layout_.expert_offsets,
          .expert_ids = slot_ids_};
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
  const std::vector<int32_t>& expert_row_of_recv = layout_.expert_row_of_recv;
  back_.resize(expert_row_of_recv.size() * static_cast<size_t>(H));
  for (size_t r = 0; r < expert_row_of_recv.size(); ++r) {
    std::memcpy(back_.data() + r * H, expert_out + expert_row_of_recv[r] * H, row_bytes);
  }
  returned_.resize(layout_.send_pos.size() * static_cast<size_t>(H));
  // The reverse of dispatch: what came from rank s goes back to it, in the order it came, as
  // float32.
  const int N = comm_.size();
  std::vector<int64_t> back_bytes(N), returned_bytes(N);
  for (int s = 0; s < N; ++s) {
    back_bytes[s] = layout_.recv_num_rows[s] * static_cast<int64_t>(row_bytes);
    returned_bytes[s] = layout_.send_num_rows[s] * static_cast<int64_t>(row_bytes);
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
  for (size_t r = 0; r < layout_.send_pos.size(); ++r) {
    std::memcpy(plan_out_.data() + r * H, returned_.data() + layout_.send_pos[r] * H,
                static_cast<size_t>(H) * sizeof(float));
  }
}

}  // namespace moeinfer::moe
