#include "parallel/placement_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>

#include "core/error.h"
#include "../support/temp_path.h"

namespace moeinfer::parallel {
namespace {

// Zipf-like loads [E]: a few hot experts, a long cold tail, shuffled so that the hot ones are
// not all in the first contiguous range.
std::vector<int64_t> skewed_loads(int64_t num_experts, uint64_t seed) {
  std::vector<int64_t> load(static_cast<size_t>(num_experts));
  for (int64_t e = 0; e < num_experts; ++e) load[e] = static_cast<int64_t>(10000.0 / (e + 1)) + 3;
  std::mt19937_64 rng(seed);
  std::shuffle(load.begin(), load.end(), rng);
  return load;
}

// max(total / N, max_e load_e / most replicas e can have): no placement does better.
double lower_bound(const std::vector<int64_t>& load, int num_ranks, int64_t slots_per_rank) {
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  const int64_t E = static_cast<int64_t>(load.size());
  const int64_t most_replicas = std::min<int64_t>(num_ranks, slots_per_rank * num_ranks - E + 1);
  const double hottest = static_cast<double>(*std::max_element(load.begin(), load.end()));
  return std::max(total / num_ranks, hottest / static_cast<double>(most_replicas));
}

void expect_valid(const LayerPlacement& p, int num_ranks, int64_t slots_per_rank) {
  ASSERT_EQ(p.num_ranks(), num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const auto s = p.slots(r);
    EXPECT_LE(static_cast<int64_t>(s.size()), slots_per_rank) << "rank " << r;
    EXPECT_EQ(std::set<int32_t>(s.begin(), s.end()).size(), s.size())
        << "rank " << r << " holds an expert twice";
  }
  for (int64_t e = 0; e < p.num_experts(); ++e) EXPECT_GE(p.replicas(e).size(), 1u) << e;
}

TEST(PlanReplicaCounts, ExtraSlotsGoToTheLargestLoadPerReplica) {
  const std::vector<int64_t> load{100, 10, 40, 1};
  // 3 ranks x 2 slots = 6 = 4 experts + 2 extra: 100 -> 2 (50 each), then 50 > 40 -> 3.
  const auto replicas = plan_replica_counts(load, {.num_ranks = 3, .slots_per_rank = 2});
  EXPECT_EQ(replicas, (std::vector<int32_t>{3, 1, 1, 1}));
  // Never more replicas than ranks: the rest spills to the next expert.
  const auto capped = plan_replica_counts(load, {.num_ranks = 2, .slots_per_rank = 4});
  EXPECT_EQ(capped, (std::vector<int32_t>{2, 2, 2, 2}));
  EXPECT_EQ(plan_replica_counts(load, {.num_ranks = 1, .slots_per_rank = 4}),
            (std::vector<int32_t>{1, 1, 1, 1}));
}

TEST(PlanReplicaCounts, TooFewSlotsAreRefusedByName) {
  const std::vector<int64_t> load(10, 1);
  try {
    plan_replica_counts(load, {.num_ranks = 3, .slots_per_rank = 3});
    FAIL() << "9 slots for 10 experts accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("give at least 4 slots per rank"), std::string::npos)
        << e.what();
  }
}

TEST(PlanLayer, SkewedLoadsBeatContiguousNearTheLowerBound) {
  for (const auto& [E, N, extra] : std::vector<std::tuple<int64_t, int, int64_t>>{
           {64, 8, 0}, {64, 8, 2}, {60, 7, 1}, {128, 16, 2}, {19, 4, 3}, {8, 8, 1}}) {
    const auto load = skewed_loads(E, static_cast<uint64_t>(E * 31 + N));
    const int64_t S = min_slots_per_rank(E, N) + extra;
    const Topology one_node = Topology::single_node(N);
    const LayerPlacement planned =
        plan_layer(load, {.num_ranks = N, .slots_per_rank = S}, one_node);
    SCOPED_TRACE("E " + std::to_string(E) + " N " + std::to_string(N) + " S " + std::to_string(S));
    expect_valid(planned, N, S);
    const double planned_max = predict_layer(planned, load, one_node).max_rows;
    const double contiguous_max =
        predict_layer(LayerPlacement::contiguous(E, N), load, one_node).max_rows;
    const double bound = lower_bound(load, N, S);
    EXPECT_LE(planned_max, contiguous_max + 1e-9);
    EXPECT_GE(planned_max, bound - 1e-9);
    // LPT is within 4/3 of the optimum; with replicas it gets much closer on these loads.
    EXPECT_LE(planned_max, (extra > 0 ? 1.15 : 4.0 / 3.0) * bound)
        << "planned " << planned_max << " bound " << bound;
  }
}

TEST(PlanLayer, EverySlotIsUsedWhenAnExpertCanTakeIt) {
  const auto load = skewed_loads(12, 5);
  const LayerPlacement p =
      plan_layer(load, {.num_ranks = 4, .slots_per_rank = 5}, Topology::single_node(4));
  expect_valid(p, 4, 5);
  EXPECT_EQ(p.total_slots(), 20);
  // More slots than experts: every rank holds every expert once, no more.
  const LayerPlacement all =
      plan_layer(load, {.num_ranks = 3, .slots_per_rank = 20}, Topology::single_node(3));
  expect_valid(all, 3, 20);
  EXPECT_EQ(all.total_slots(), 36);
}

TEST(PlanLayer, UniformAndZeroLoadsStillPlaceEveryExpert) {
  const std::vector<int64_t> zero(10, 0);
  const LayerPlacement p =
      plan_layer(zero, {.num_ranks = 4, .slots_per_rank = 3}, Topology::single_node(4));
  expect_valid(p, 4, 3);
  const std::vector<int64_t> one_hot{0, 0, 0, 0, 0, 1000, 0, 0};
  const LayerPlacement q =
      plan_layer(one_hot, {.num_ranks = 4, .slots_per_rank = 3}, Topology::single_node(4));
  expect_valid(q, 4, 3);
  EXPECT_EQ(q.replicas(5).size(), 4u);  // the hot expert on every rank
  EXPECT_NEAR(predict_layer(q, one_hot, Topology::single_node(4)).max_over_mean(), 1.0, 1e-12);
}

TEST(PlanLayer, ReplicasSpreadOverDistinctNodes) {
  const auto load = skewed_loads(32, 11);
  const Topology nodes = Topology::contiguous_nodes(8, 4);  // 4 nodes of 2 ranks
  const LayerPlacement p = plan_layer(load, {.num_ranks = 8, .slots_per_rank = 6}, nodes);
  expect_valid(p, 8, 6);
  bool some_replicated = false;
  for (int64_t e = 0; e < 32; ++e) {
    const auto holders = p.replicas(e);
    std::set<int32_t> on_nodes;
    for (int32_t r : holders) on_nodes.insert(nodes.node_of(r));
    // Distinct nodes first: an expert repeats a node only once it is on all of them.
    EXPECT_EQ(on_nodes.size(), std::min<size_t>(holders.size(), 4)) << "expert " << e;
    some_replicated |= holders.size() > 1;
  }
  EXPECT_TRUE(some_replicated);
}

TEST(PlanLayer, AFullRankMakesRoomWhenOnlyHoldersHaveFreeSlots) {
  // 6 ranks in 2 nodes, 2 slots each, 3 experts: LPT leaves the last replica of an expert only
  // slots on ranks that already hold it, so another rank hands over one of its experts.
  const std::vector<int64_t> load{78, 62, 31};
  const Topology nodes = Topology::contiguous_nodes(6, 2);
  const LayerPlacement p = plan_layer(load, {.num_ranks = 6, .slots_per_rank = 2}, nodes);
  expect_valid(p, 6, 2);
  EXPECT_EQ(p.total_slots(), 12);
}

TEST(PlanLayer, RandomSmallCasesAlwaysPlace) {
  // Small shapes reach the corner where only ranks already holding an expert have free slots.
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 2000; ++trial) {
    const int N = 1 + static_cast<int>(rng() % 6);
    const int64_t E = 1 + static_cast<int64_t>(rng() % 12);
    const int64_t S = min_slots_per_rank(E, N) + static_cast<int64_t>(rng() % 4);
    std::vector<int64_t> load(static_cast<size_t>(E));
    for (auto& l : load) l = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % 100);
    const int nodes = N % 2 == 0 && rng() % 2 ? 2 : 1;
    SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
    const LayerPlacement p = plan_layer(load, {.num_ranks = N, .slots_per_rank = S},
                                        Topology::contiguous_nodes(N, nodes));
    expect_valid(p, N, S);
    EXPECT_EQ(p.total_slots(), std::min(S * N, E * N));
  }
}

TEST(PredictLayer, RowsAndBytesFollowTheDispatcher) {
  // 2 nodes of 2 ranks; expert 0 (load 80) on ranks 0 and 2, expert 1 (load 40) on rank 1,
  // expert 2 (load 8) on rank 3.
  const Topology nodes = Topology::contiguous_nodes(4, 2);
  const LayerPlacement p(3, {{0}, {1}, {0}, {2}});
  const std::vector<int64_t> load{80, 40, 8};
  const LayerPrediction got = predict_layer(p, load, nodes);
  EXPECT_EQ(got.rank_rows, (std::vector<double>{40, 40, 40, 8}));
  EXPECT_DOUBLE_EQ(got.max_rows, 40);
  EXPECT_DOUBLE_EQ(got.mean_rows, 32);
  // Each serving rank gets a quarter of its rows from itself, a quarter from its node's other
  // rank and half from the other node.
  EXPECT_DOUBLE_EQ(got.intra_node_rows, 128.0 / 4);
  EXPECT_DOUBLE_EQ(got.inter_node_rows, 128.0 / 2);
  EXPECT_DOUBLE_EQ(remote_bytes(got.inter_node_rows, 16), 64.0 * 2 * 16 * 4);
  const TotalPrediction total = total_prediction(std::vector<LayerPrediction>{got, got});
  EXPECT_DOUBLE_EQ(total.max_over_mean(), 40.0 / 32.0);
  EXPECT_DOUBLE_EQ(total.inter_node_rows, 128.0);
}

TEST(Topology, BadSpecsAreRefused) {
  EXPECT_THROW(Topology::contiguous_nodes(6, 4), Error);
  EXPECT_THROW(Topology::contiguous_nodes(4, 0), Error);
  EXPECT_THROW(Topology({0, 2}), Error);  // node 1 has no rank
  EXPECT_THROW(Topology({0, -1}), Error);
  const Topology t = Topology::contiguous_nodes(6, 3);
  EXPECT_EQ(t.num_nodes(), 3);
  EXPECT_EQ(t.node_of(3), 1);
  EXPECT_EQ(t.ranks_on_node(2), 2);
}

class PlannerFiles : public ::testing::Test {
 protected:
  std::filesystem::path path(const std::string& name) {
    const auto p = moeinfer::testing::unique_temp_path("placement_planner_test_" + name);
    written_.push_back(p);
    return p;
  }
  void TearDown() override {
    for (const auto& p : written_) std::filesystem::remove(p);
  }
  std::vector<std::filesystem::path> written_;
};

TEST_F(PlannerFiles, TopologyFileMapsRanksToNodes) {
  const auto file = path("topology.json");
  std::ofstream(file) << R"({"node_of_rank": [7, 7, 3, 3, 3]})";
  const Topology t = read_topology(file, 5);
  EXPECT_EQ(t.num_nodes(), 2);
  EXPECT_EQ(t.node_of(1), 0);
  EXPECT_EQ(t.node_of(4), 1);
  EXPECT_EQ(t.ranks_on_node(1), 3);
  try {
    read_topology(file, 4);
    FAIL() << "5 entries for 4 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("has 5 entries; the plan is for 4 ranks"),
              std::string::npos)
        << e.what();
  }
  std::ofstream(file) << R"({"nodes": [0, 1]})";
  EXPECT_THROW(read_topology(file, 2), Error);
}

TEST_F(PlannerFiles, PlannedTablesReadBackWithAPredictedField) {
  const std::vector<int64_t> layers{1, 3};
  std::map<int64_t, LayerPlacement> tables;
  for (int64_t l : layers) {
    tables.emplace(
        l, plan_layer(skewed_loads(16, static_cast<uint64_t>(l)),
                      {.num_ranks = 4, .slots_per_rank = 5}, Topology::contiguous_nodes(4, 2)));
  }
  // The file `moeinfer placement --output` writes: the tables plus its figures.
  auto j = nlohmann::ordered_json::parse(placement_json(tables));
  j["predicted"] = {{"planned", {{"max_over_mean", 1.01}}}, {"layers", nlohmann::json::array()}};
  const auto file = path("placement.json");
  std::ofstream(file) << j.dump(1);
  const ExpertPlacement read = read_placement(file, 16, 4, layers);
  for (int64_t l : layers) {
    for (int r = 0; r < 4; ++r) {
      const auto want = tables.at(l).slots(r), got = read.layer(l).slots(r);
      EXPECT_EQ(std::vector<int32_t>(got.begin(), got.end()),
                std::vector<int32_t>(want.begin(), want.end()))
          << "layer " << l << " rank " << r;
    }
  }
  // Only that field is tolerated.
  j["predicted_too"] = 1;
  std::ofstream(file) << j.dump(1);
  EXPECT_THROW(read_placement(file, 16, 4, layers), Error);
}

}  // namespace
}  // namespace moeinfer::parallel
