// Plans an expert placement from measured load: how many replicas each logical expert gets and
// which ranks hold them, and what that placement is predicted to cost against contiguous ranges.
//
// Replicas: every expert starts with one; each further slot goes to the expert with the largest
// load per replica (ties to the lower id), never more replicas than ranks. Placement is LPT
// (longest processing time first): replicas in order of load per replica, descending, each to the
// least-loaded rank with a free slot that does not already hold the expert. With several nodes an
// expert's replicas go to distinct nodes first, and among equally loaded ranks the one whose
// node already holds more of the senders wins, keeping bytes off the inter-node links.
//
// The prediction is the dispatcher's arithmetic (moe/expert_parallel.h): attention is
// data-parallel, so each source rank sends load/N of an expert's rows, and the i-th row of an
// expert goes to replica (i + source rank) mod m, i.e. load/m rows per replica. Every row that
// leaves its source rank crosses twice (dispatch and combine), H float32 values each way.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <vector>

#include "parallel/placement.h"

namespace moeinfer::parallel {

// Which node each rank is on; nodes are numbered 0..num_nodes-1.
class Topology {
 public:
  // node_of_rank[r]: rank r's node; validated (every node id in [0, num_nodes) is used).
  explicit Topology(std::vector<int32_t> node_of_rank);
  // All N ranks on one node.
  static Topology single_node(int num_ranks);
  // N ranks split into K equal contiguous nodes (N % K == 0).
  static Topology contiguous_nodes(int num_ranks, int num_nodes);

  int num_ranks() const { return static_cast<int>(node_of_rank_.size()); }
  int num_nodes() const { return num_nodes_; }
  int32_t node_of(int rank) const { return node_of_rank_[static_cast<size_t>(rank)]; }
  int ranks_on_node(int32_t node) const { return node_size_[static_cast<size_t>(node)]; }

 private:
  std::vector<int32_t> node_of_rank_;  // [N]
  std::vector<int> node_size_;         // [num_nodes] ranks per node
  int num_nodes_ = 0;
};

// A topology file: {"node_of_rank": [n0, n1, ...]}, one node id per rank (any non-negative ids;
// they are renumbered in order of first appearance). Errors name the file and the field.
Topology read_topology(const std::filesystem::path& path, int num_ranks);

struct PlanOptions {
  int num_ranks = 1;           // N
  int64_t slots_per_rank = 1;  // S, physical expert slots per rank; S * N >= E
};

// Replicas per expert [E] for loads [E]: 1 each, then the S*N - E further slots by largest
// load per replica, each count capped at N.
std::vector<int32_t> plan_replica_counts(std::span<const int64_t> load, const PlanOptions& options);

// One layer's placement for loads [E] (rows routed to each expert).
LayerPlacement plan_layer(std::span<const int64_t> load, const PlanOptions& options,
                          const Topology& topology);

// What a placement costs for loads [E]. Rows are assignments; remote rows left their source rank
// (counted once; the bytes count both directions).
struct LayerPrediction {
  std::vector<double> rank_rows;  // [N] rows each rank's experts compute
  double max_rows = 0.0;
  double mean_rows = 0.0;
  double intra_node_rows = 0.0;  // remote rows between ranks of one node
  double inter_node_rows = 0.0;  // remote rows between nodes
  double max_over_mean() const { return mean_rows > 0.0 ? max_rows / mean_rows : 1.0; }
};

LayerPrediction predict_layer(const LayerPlacement& placement, std::span<const int64_t> load,
                              const Topology& topology);

// Layers together: every layer waits for its busiest rank, so the total's imbalance is the sum
// of the layers' maxima over the sum of their means.
struct TotalPrediction {
  double max_rows = 0.0;   // sum over layers of each layer's busiest rank
  double mean_rows = 0.0;  // sum over layers of the mean
  double intra_node_rows = 0.0;
  double inter_node_rows = 0.0;
  double max_over_mean() const { return mean_rows > 0.0 ? max_rows / mean_rows : 1.0; }
};

TotalPrediction total_prediction(std::span<const LayerPrediction> layers);

// Bytes on the wire for `rows` remote rows of H values: float32, dispatch and combine.
double remote_bytes(double rows, int64_t hidden_size);

// The smallest S with which N ranks hold E experts once: ceil(E / N).
int64_t min_slots_per_rank(int64_t num_experts, int num_ranks);

}  // namespace moeinfer::parallel
