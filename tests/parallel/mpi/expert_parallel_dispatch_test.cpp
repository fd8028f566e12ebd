// ExpertParallelDispatcher across real ranks (built into test_mpi_communicator, run under mpirun
// -np 2 and 3). Each rank's token rows carry their source rank and token index, so a receiver
// can tell where every row came from; every rank can rebuild every rank's routing from the seed.
// With --dispatch-dtype bf16 and fp8 the rows arrive within their encoding's bound, and the bytes
// the profiler counts on the network shrink to what was sent (fp8: under 0.3x of float32).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "moe/expert_parallel.h"
#include "moe/row_codec.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"
#include "profile/profiler.h"

namespace moeinfer::moe {
namespace {

constexpr int64_t kHidden = 4, kExperts = 7, kTopK = 3;

// Rank `rank`'s tokens: a fresh routing per rank (distinct experts per token), T from 0 to 9.
Routing routing_of(int rank, uint32_t seed) {
  std::mt19937 rng(seed * 131u + static_cast<uint32_t>(rank));
  Routing routing;
  routing.num_tokens = static_cast<int64_t>(rng() % 10);
  if (rank == 1) routing.num_tokens = 0;  // a rank without tokens still takes part
  routing.top_k = kTopK;
  std::vector<int32_t> experts(kExperts);
  for (int64_t t = 0; t < routing.num_tokens; ++t) {
    for (int32_t e = 0; e < kExperts; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    // Skew towards expert 0, which the placement below replicates on every rank.
    if (rng() % 2 == 0)
      std::iter_swap(experts.begin(), std::find(experts.begin(), experts.end(), 0));
    for (int64_t k = 0; k < kTopK; ++k) {
      routing.topk_ids.push_back(experts[k]);
      routing.topk_weights.push_back(0.25f + 0.25f * static_cast<float>(k));
    }
  }
  return routing;
}

// Expert 0 on every rank, expert e > 0 on rank e % N, and expert 1 on the last rank too.
parallel::LayerPlacement replicated_table(int num_ranks) {
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) slots[r].push_back(0);
  for (int32_t e = 1; e < kExperts; ++e) slots[e % num_ranks].push_back(e);
  if (1 % num_ranks != num_ranks - 1) slots[num_ranks - 1].push_back(1);
  return parallel::LayerPlacement(kExperts, std::move(slots));
}

TEST(ExpertParallelDispatch, EveryRowReachesOneReplicaOfItsExpertAndComesBack) {
  parallel::Communicator& job = parallel::world();
  const int N = job.size(), me = job.rank();
  uint32_t seed = std::random_device{}();
  std::vector<uint32_t> seeds(N);
  job.all_gather(&seed, seeds.data(), sizeof(seed));
  seed = seeds[0];  // rank 0's seed for everyone
  SCOPED_TRACE("seed " + std::to_string(seed));

  const parallel::LayerPlacement table = replicated_table(N);
  ExpertParallelDispatcher dispatcher(job, parallel::ExpertPlacement(table, {}), kHidden);
  const Routing routing = routing_of(me, seed);
  const int64_t T = routing.num_tokens;
  DispatchPlan plan;
  moe::plan(routing, kExperts, &plan);
  std::vector<float> hidden(static_cast<size_t>(std::max<int64_t>(T, 1) * kHidden));
  for (int64_t t = 0; t < T; ++t) {
    hidden[t * kHidden + 0] = static_cast<float>(me);
    hidden[t * kHidden + 1] = static_cast<float>(t);
    hidden[t * kHidden + 2] = static_cast<float>(me * 100 + t) * 0.5f;
    hidden[t * kHidden + 3] = 1.0f;
  }
  const RoutedTokens tokens{
      .hidden = hidden.data(), .num_tokens = T, .routing = &routing, .plan = &plan};
  int in_flight_calls = 0;
  const ExpertRows rows = dispatcher.dispatch(0, tokens, [&] { ++in_flight_calls; });
  EXPECT_EQ(in_flight_calls, 1) << "the work beside the rows' transfer runs once";

  // Every received row is a token of its source that chose the slot's expert; count them.
  ASSERT_EQ(rows.num_experts(), static_cast<int64_t>(table.slots(me).size()));
  std::vector<int64_t> received(static_cast<size_t>(N * 10 * kExperts), 0);  // [source, t, e]
  std::vector<int64_t> per_slot(static_cast<size_t>(rows.num_experts()), 0);
  for (int64_t j = 0; j < rows.num_experts(); ++j) {
    const int64_t e = rows.expert(j);
    EXPECT_EQ(e, table.slots(me)[j]);
    for (int32_t r = rows.expert_offsets[j]; r < rows.expert_offsets[j + 1]; ++r) {
      const float* row = rows.rows + r * kHidden;
      const int source = static_cast<int>(row[0]);
      const int64_t t = static_cast<int64_t>(row[1]);
      ASSERT_TRUE(source >= 0 && source < N) << row[0];
      const Routing theirs = routing_of(source, seed);
      ASSERT_LT(t, theirs.num_tokens) << "a row of rank " << source;
      const auto chosen = std::span(theirs.topk_ids).subspan(t * kTopK, kTopK);
      EXPECT_NE(std::find(chosen.begin(), chosen.end(), e), chosen.end())
          << "rank " << source << " token " << t << " did not choose expert " << e;
      EXPECT_EQ(row[2], static_cast<float>(source * 100 + t) * 0.5f);
      ++received[(source * 10 + t) * kExperts + e];
      ++per_slot[j];
    }
  }
  // Over all ranks, each (source, token, expert) arrives exactly once.
  job.all_reduce_sum(std::span<int64_t>(received));
  for (int s = 0; s < N; ++s) {
    const Routing theirs = routing_of(s, seed);
    for (int64_t t = 0; t < 10; ++t) {
      for (int64_t e = 0; e < kExperts; ++e) {
        const bool chose =
            t < theirs.num_tokens && std::find(theirs.topk_ids.begin() + t * kTopK,
                                               theirs.topk_ids.begin() + (t + 1) * kTopK,
                                               e) != theirs.topk_ids.begin() + (t + 1) * kTopK;
        EXPECT_EQ(received[(s * 10 + t) * kExperts + e], chose ? 1 : 0)
            << "rank " << s << " token " << t << " expert " << e;
      }
    }
  }
  // Expert 0's replicas share its rows: from each source, their counts differ by one at most, so
  // over N sources by N at most.
  std::vector<int64_t> expert0(static_cast<size_t>(N), 0);
  expert0[me] = per_slot[0];
  job.all_reduce_sum(std::span<int64_t>(expert0));
  const auto [lo, hi] = std::minmax_element(expert0.begin(), expert0.end());
  EXPECT_LE(*hi - *lo, N);

  // An "expert" that scales its rows by (expert + 1): combine must give each token
  // shared + sum_k weight_k * (e_k + 1) * hidden.
  std::vector<float> expert_out(static_cast<size_t>(rows.expert_offsets.back() * kHidden));
  for (int64_t j = 0; j < rows.num_experts(); ++j) {
    for (int32_t r = rows.expert_offsets[j]; r < rows.expert_offsets[j + 1]; ++r) {
      for (int64_t h = 0; h < kHidden; ++h) {
        expert_out[r * kHidden + h] =
            static_cast<float>(rows.expert(j) + 1) * rows.rows[r * kHidden + h];
      }
    }
  }
  std::vector<float> shared(hidden.size(), 2.0f), out(hidden.size(), -1.0f);
  dispatcher.combine(0, expert_out.data(), tokens, shared.data(), out.data());
  for (int64_t t = 0; t < T; ++t) {
    float scale = 0.0f;
    for (int64_t k = 0; k < kTopK; ++k) {
      scale += routing.topk_weights[t * kTopK + k] *
               static_cast<float>(routing.topk_ids[t * kTopK + k] + 1);
    }
    for (int64_t h = 0; h < kHidden; ++h) {
      EXPECT_FLOAT_EQ(out[t * kHidden + h], 2.0f + scale * hidden[t * kHidden + h])
          << "token " << t << " column " << h;
    }
  }
  job.barrier();
}

// The encoded test's rows: H = 64 (the fp8 scale's 4 bytes a row are then 1/16 of the values),
// and every rank has tokens, so every rank sends.
constexpr int64_t kWideHidden = 64, kWideTokens = 6;

Routing wide_routing(int rank) {
  Routing routing{.num_tokens = kWideTokens, .top_k = kTopK};
  for (int64_t t = 0; t < kWideTokens; ++t) {
    for (const int64_t step : {0, 1, 3}) {
      routing.topk_ids.push_back(static_cast<int32_t>((t + rank + step) % kExperts));
      routing.topk_weights.push_back(0.5f + 0.125f * static_cast<float>(step));
    }
  }
  return routing;
}

// Row (source, token): its source and token in columns 0 and 1 and 448 in column 2, so that the
// fp8 scale is 1 and the tags arrive exactly in every encoding; then values over 16 octaves.
float wide_value(int source, int64_t t, int64_t h) {
  if (h == 0) return static_cast<float>(source);
  if (h == 1) return static_cast<float>(t);
  if (h == 2) return 448.0f;
  const uint32_t mixed = static_cast<uint32_t>((source * 131 + t) * 977 + h) * 2654435761u;
  const float unit = static_cast<float>(mixed >> 8) / 16777216.0f;  // [0, 1)
  return (mixed & 1u ? -1.0f : 1.0f) * (1.0f + unit) * std::exp2(static_cast<float>(h % 16) - 8);
}

// The codec's bound on one value (row_codec.h), the fp8 scale being 1 here.
float value_bound(DispatchDtype wire, float x) {
  switch (wire) {
    case DispatchDtype::kF32:
      return 0.0f;
    case DispatchDtype::kBF16:
      return std::ldexp(std::fabs(x), -8);
    case DispatchDtype::kFp8:
      return std::max(std::ldexp(std::fabs(x), -4), std::ldexp(1.0f, -10)) * (1.0f + 1e-5f);
  }
  return 0.0f;
}

TEST(ExpertParallelDispatch, EncodedRowsArriveWithinTheirBoundAndShrinkTheBytesSent) {
  parallel::Communicator& job = parallel::world();
  const int N = job.size(), me = job.rank();
  const int64_t H = kWideHidden, T = kWideTokens;
  const parallel::LayerPlacement table = replicated_table(N);
  const Routing routing = wide_routing(me);
  DispatchPlan plan;
  moe::plan(routing, kExperts, &plan);
  std::vector<float> hidden(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) hidden[t * H + h] = wide_value(me, t, h);
  }
  const RoutedTokens tokens{
      .hidden = hidden.data(), .num_tokens = T, .routing = &routing, .plan = &plan};

  int64_t dispatch_bytes[3] = {}, combine_bytes[3] = {};  // this rank's, by DispatchDtype
  int64_t remote_rows = 0;  // rows this rank sends to other ranks (the same in every encoding)
  for (const DispatchDtype wire :
       {DispatchDtype::kF32, DispatchDtype::kBF16, DispatchDtype::kFp8}) {
    SCOPED_TRACE(std::string("--dispatch-dtype ") + std::string(dispatch_dtype_name(wire)));
    ExpertParallelDispatcher dispatcher(job, parallel::ExpertPlacement(table, {}), H, wire);
    profile::Profiler profiler(profile::ProfilerOptions{.num_layers = 1, .num_experts = kExperts});
    ExpertRows rows;
    {
      profile::ActiveProfiler on(&profiler);
      profiler.begin_step(T);
      rows = dispatcher.dispatch(0, tokens, {});
      profiler.end_step();
    }
    dispatch_bytes[static_cast<int>(wire)] =
        profiler.steps().back().link_bytes[static_cast<int>(profile::Link::kNetwork)];

    // Each received row: its tags exact, every value within the encoding's bound.
    int64_t from_others = 0;
    for (int64_t j = 0; j < rows.num_experts(); ++j) {
      for (int32_t r = rows.expert_offsets[j]; r < rows.expert_offsets[j + 1]; ++r) {
        const float* row = rows.rows + r * H;
        const int source = static_cast<int>(row[0]);
        const int64_t t = static_cast<int64_t>(row[1]);
        ASSERT_TRUE(source >= 0 && source < N && row[0] == static_cast<float>(source)) << row[0];
        ASSERT_TRUE(t >= 0 && t < T && row[1] == static_cast<float>(t)) << row[1];
        from_others += source != me;
        for (int64_t h = 0; h < H; ++h) {
          const float want = wide_value(source, t, h);
          ASSERT_LE(std::fabs(row[h] - want), value_bound(wire, want))
              << "rank " << source << " token " << t << " column " << h;
        }
      }
    }

    // The scaling "expert" again; the outputs come back float32, so the error is the rows'.
    std::vector<float> expert_out(static_cast<size_t>(rows.expert_offsets.back() * H));
    for (int64_t j = 0; j < rows.num_experts(); ++j) {
      for (int32_t r = rows.expert_offsets[j]; r < rows.expert_offsets[j + 1]; ++r) {
        for (int64_t h = 0; h < H; ++h) {
          expert_out[r * H + h] = static_cast<float>(rows.expert(j) + 1) * rows.rows[r * H + h];
        }
      }
    }
    std::vector<float> shared(hidden.size(), 2.0f), out(hidden.size(), -1.0f);
    {
      profile::ActiveProfiler on(&profiler);
      profiler.begin_step(T);
      dispatcher.combine(0, expert_out.data(), tokens, shared.data(), out.data());
      profiler.end_step();
    }
    combine_bytes[static_cast<int>(wire)] =
        profiler.steps().back().link_bytes[static_cast<int>(profile::Link::kNetwork)];
    for (int64_t t = 0; t < T; ++t) {
      float scale = 0.0f;
      for (int64_t k = 0; k < kTopK; ++k) {
        scale += routing.topk_weights[t * kTopK + k] *
                 static_cast<float>(routing.topk_ids[t * kTopK + k] + 1);
      }
      for (int64_t h = 0; h < H; ++h) {
        const float x = hidden[t * H + h];
        EXPECT_NEAR(out[t * H + h], 2.0f + scale * x,
                    scale * value_bound(wire, x) + 1e-5f * (2.0f + scale * std::fabs(x)))
            << "token " << t << " column " << h;
      }
    }
    // Rows sent to others = rows received from others, summed over ranks.
    std::vector<int64_t> counts = {from_others, 0};
    job.all_reduce_sum(std::span<int64_t>(counts));
    if (wire == DispatchDtype::kF32) {
      remote_rows = dispatch_bytes[0] / (H * static_cast<int64_t>(sizeof(float)));
      std::vector<int64_t> sent = {remote_rows};
      job.all_reduce_sum(std::span<int64_t>(sent));
      EXPECT_EQ(sent[0], counts[0]) << "the profiler counted other rows than arrived";
    }
  }
  // The bytes counted are those sent: f32 4H a row, bf16 2H, fp8 H + 4; combine stays float32.
  EXPECT_GT(remote_rows, 0) << "every rank has tokens for another rank's experts";
  EXPECT_EQ(dispatch_bytes[0], remote_rows * H * 4);
  EXPECT_EQ(dispatch_bytes[1], remote_rows * H * 2);
  EXPECT_EQ(dispatch_bytes[2], remote_rows * (H + 4));
  EXPECT_LT(static_cast<double>(dispatch_bytes[2]), 0.3 * static_cast<double>(dispatch_bytes[0]));
  EXPECT_EQ(combine_bytes[1], combine_bytes[0]);
  EXPECT_EQ(combine_bytes[2], combine_bytes[0]);
  job.barrier();
}

}  // namespace
}  // namespace moeinfer::moe
