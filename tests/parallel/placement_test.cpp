#include "parallel/placement.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "../support/temp_path.h"

namespace moeinfer::parallel {
namespace {

TEST(LayerPlacement, ContiguousRangesTheFirstRanksOneMore) {
  const LayerPlacement p = LayerPlacement::contiguous(7, 3);
  ASSERT_EQ(p.num_ranks(), 3);
  EXPECT_EQ(std::vector<int32_t>(p.slots(0).begin(), p.slots(0).end()),
            (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(std::vector<int32_t>(p.slots(2).begin(), p.slots(2).end()),
            (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(p.replicas(4).size(), 1u);
  EXPECT_EQ(p.replicas(4)[0], 1);
  EXPECT_EQ(p.slot_of(1, 4), 1);
  EXPECT_EQ(p.slot_of(0, 4), -1);
  EXPECT_EQ(p.total_slots(), 7);
  EXPECT_THROW(LayerPlacement::contiguous(2, 3), Error);
  EXPECT_THROW(LayerPlacement::contiguous(4, 0), Error);
}

TEST(LayerPlacement, ReplicasAreListedPerExpert) {
  const LayerPlacement p(4, {{3, 0, 1}, {2, 3}});
  EXPECT_EQ(std::vector<int32_t>(p.replicas(3).begin(), p.replicas(3).end()),
            (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(p.slot_of(0, 3), 0);
  EXPECT_EQ(p.slot_of(1, 3), 1);
}

TEST(LayerPlacement, InvalidTablesAreRefused) {
  EXPECT_THROW(LayerPlacement(4, {{0, 1}, {2}}), Error);     // expert 3 nowhere
  EXPECT_THROW(LayerPlacement(4, {{0, 1, 1}, {2, 3}}), Error);  // twice on one rank
  EXPECT_THROW(LayerPlacement(4, {{0, 1, 2, 3}, {}}), Error);   // a rank without experts
  EXPECT_THROW(LayerPlacement(4, {{0, 1, 4}, {2, 3}}), Error);  // outside [0, E)
}

class PlacementFile : public ::testing::Test {
 protected:
  std::filesystem::path write(const std::string& text) {
    std::ofstream(path_) << text;
    return path_;
  }
  std::string error_of(const std::string& text, int64_t experts = 4, int ranks = 2) {
    try {
      read_placement(write(text), experts, ranks, layers_);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }
  std::filesystem::path path_ = moeinfer::testing::unique_temp_path("placement_test.json");
  std::vector<int64_t> layers_{1, 3};
  void TearDown() override { std::filesystem::remove(path_); }
};

TEST_F(PlacementFile, RoundTripsPerLayerTables) {
  std::map<int64_t, LayerPlacement> tables;
  tables.emplace(1, LayerPlacement(4, {{0, 1, 3}, {2, 3}}));
  tables.emplace(3, LayerPlacement(4, {{2}, {0, 1, 3}}));
  write_placement(path_, tables);
  const ExpertPlacement p = read_placement(path_, 4, 2, layers_);
  EXPECT_EQ(p.layer(1).replicas(3).size(), 2u);
  EXPECT_EQ(p.layer(3).slot_of(0, 2), 0);
  EXPECT_EQ(p.layer(3).slot_of(1, 3), 2);
}

TEST_F(PlacementFile, MoreRanksThanExpertsWithReplicas) {
  // Two experts over three ranks: only replicas give every rank one; no contiguous table exists.
  std::map<int64_t, LayerPlacement> tables;
  tables.emplace(1, LayerPlacement(2, {{0}, {1}, {0}}));
  tables.emplace(3, LayerPlacement(2, {{1}, {0}, {1}}));
  write_placement(path_, tables);
  const ExpertPlacement p = read_placement(path_, 2, 3, layers_);
  EXPECT_EQ(p.num_ranks(), 3);
  EXPECT_EQ(p.layer(1).replicas(0).size(), 2u);
  EXPECT_EQ(p.layer(3).replicas(1).size(), 2u);
}

TEST_F(PlacementFile, OneTableForEveryLayer) {
  const ExpertPlacement p = read_placement(
      write(R"({"format":"moeinfer-placement","version":1,"num_experts":4,"num_ranks":2,)"
            R"("ranks":[[0,1],[2,3,0]]})"),
      4, 2, layers_);
  EXPECT_EQ(p.layer(1).replicas(0).size(), 2u);
  EXPECT_EQ(p.layer(3).replicas(0).size(), 2u);
}

TEST_F(PlacementFile, ErrorsNameTheProblem) {
  const std::string head = R"({"format":"moeinfer-placement","version":1,"num_experts":4,)";
  EXPECT_NE(error_of("{not json").find("not JSON"), std::string::npos);
  EXPECT_NE(error_of(R"({"format":"x"})").find("\"format\""), std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":3,"ranks":[[0],[1],[2,3]]})").find("3 ranks"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2,"ranks":[[0],[1],[2,3]]})").find("3 entries"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2,"ranks":[[0,1],[2]]})").find("expert 3"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2,"ranks":[[0,1],[2,"x"]]})").find("not an expert"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2,"layers":[{"layer":1,"ranks":[[0,1],[2,3]]}]})")
                .find("no table for MoE layer 3"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2,"layers":[{"layer":2,"ranks":[[0,1],[2,3]]}]})")
                .find("no MoE layer 2"),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2,"ranks":[[0,1],[2,3]],"extra":1})")
                .find("unknown field \"extra\""),
            std::string::npos);
  EXPECT_NE(error_of(head + R"("num_ranks":2})").find("neither"), std::string::npos);
}

}  // namespace
}  // namespace moeinfer::parallel
