#include "parallel/placement_planner.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <queue>
#include <tuple>

#include "core/error.h"
#include "parallel/json_file.h"

namespace moeinfer::parallel {

Topology::Topology(std::vector<int32_t> node_of_rank) : node_of_rank_(std::move(node_of_rank)) {
  MOE_CHECK(!node_of_rank_.empty(), "a topology of no ranks");
  for (size_t r = 0; r < node_of_rank_.size(); ++r) {
    MOE_CHECK(node_of_rank_[r] >= 0, "rank ", r, " is on node ", node_of_rank_[r],
              "; node ids are >= 0");
  }
  num_nodes_ = *std::max_element(node_of_rank_.begin(), node_of_rank_.end()) + 1;
  node_size_.assign(static_cast<size_t>(num_nodes_), 0);
  for (int32_t n : node_of_rank_) ++node_size_[static_cast<size_t>(n)];
  for (int n = 0; n < num_nodes_; ++n) {
    MOE_CHECK(node_size_[static_cast<size_t>(n)] > 0, "node ", n, " has no rank; nodes are ",
              "numbered 0..", num_nodes_ - 1, " without gaps");
  }
}

Topology Topology::single_node(int num_ranks) {
  MOE_CHECK(num_ranks >= 1, "a topology of ", num_ranks, " ranks");
  return Topology(std::vector<int32_t>(static_cast<size_t>(num_ranks), 0));
}

Topology Topology::contiguous_nodes(int num_ranks, int num_nodes) {
  MOE_CHECK(num_ranks >= 1, "a topology of ", num_ranks, " ranks");
  MOE_CHECK(num_nodes >= 1 && num_nodes <= num_ranks && num_ranks % num_nodes == 0, num_ranks,
            " ranks do not split into ", num_nodes, " equal nodes");
  std::vector<int32_t> node_of_rank(static_cast<size_t>(num_ranks));
  const int per_node = num_ranks / num_nodes;
  for (int r = 0; r < num_ranks; ++r) node_of_rank[static_cast<size_t>(r)] = r / per_node;
  return Topology(std::move(node_of_rank));
}

Topology read_topology(const std::filesystem::path& path, int num_ranks) {
  const std::string file = "topology file " + path.string();
  const nlohmann::json j = read_json_file(path, file);
  MOE_CHECK(j.is_object() && j.contains("node_of_rank") && j["node_of_rank"].is_array(), file,
            ": needs {\"node_of_rank\": [node of rank 0, node of rank 1, ...]}");
  for (const auto& [key, value] : j.items()) {
    MOE_CHECK(key == "node_of_rank", file, ": unknown field \"", key, "\"");
  }
  const nlohmann::json& list = j["node_of_rank"];
  MOE_CHECK(static_cast<int64_t>(list.size()) == num_ranks, file, ": \"node_of_rank\" has ",
            list.size(), " entries; the plan is for ", num_ranks, " ranks");
  // Any non-negative ids; renumbered by first appearance so that nodes are 0..K-1.
  std::map<int64_t, int32_t> renumber;
  std::vector<int32_t> node_of_rank;
  for (size_t r = 0; r < list.size(); ++r) {
    MOE_CHECK(list[r].is_number_integer() && list[r].get<int64_t>() >= 0, file, ": rank ", r,
              "'s node ", list[r].dump(), " is not a non-negative integer");
    const auto it =
        renumber.try_emplace(list[r].get<int64_t>(), static_cast<int32_t>(renumber.size())).first;
    node_of_rank.push_back(it->second);
  }
  return Topology(std::move(node_of_rank));
}

namespace {

void check_options(std::span<const int64_t> load, const PlanOptions& options) {
  const int64_t E = static_cast<int64_t>(load.size());
  MOE_CHECK(E >= 1, "a placement plan of no experts");
  MOE_CHECK(options.num_ranks >= 1, "a placement plan over ", options.num_ranks, " ranks");
  MOE_CHECK(options.slots_per_rank >= 1, "a placement plan of ", options.slots_per_rank,
            " slots per rank");
  MOE_CHECK(options.slots_per_rank * options.num_ranks >= E, options.num_ranks, " ranks of ",
            options.slots_per_rank, " slots hold ", options.slots_per_rank * options.num_ranks,
            " experts, fewer than the ", E, " experts; give at least ",
            min_slots_per_rank(E, options.num_ranks), " slots per rank");
  for (int64_t e = 0; e < E; ++e) {
    MOE_CHECK(load[static_cast<size_t>(e)] >= 0, "expert ", e, " has load ",
              load[static_cast<size_t>(e)]);
  }
}

// a's load per replica exceeds b's: load_a / m_a > load_b / m_b, exactly.
bool heavier(int64_t load_a, int64_t m_a, int64_t load_b, int64_t m_b) {
  return static_cast<__int128>(load_a) * m_b > static_cast<__int128>(load_b) * m_a;
}

// Ranks' slots while LPT fills them.
struct Fill {
  std::vector<std::vector<int32_t>> slots;   // [N][experts held]
  std::vector<std::vector<char>> holds;      // [N][E]
  std::vector<double> rank_load;             // [N] rows so far
  std::vector<std::vector<int>> node_holds;  // [num_nodes][E] replicas of e on the node

  Fill(int num_ranks, int num_nodes, int64_t num_experts)
      : slots(static_cast<size_t>(num_ranks)),
        holds(static_cast<size_t>(num_ranks), std::vector<char>(num_experts, 0)),
        rank_load(static_cast<size_t>(num_ranks), 0.0),
        node_holds(static_cast<size_t>(num_nodes), std::vector<int>(num_experts, 0)) {}

  void add(int rank, int32_t expert, double rows, const Topology& topology) {
    slots[rank].push_back(expert);
    holds[rank][expert] = 1;
    rank_load[rank] += rows;
    ++node_holds[topology.node_of(rank)][expert];
  }
  void remove(int rank, int32_t expert, double rows, const Topology& topology) {
    auto& s = slots[rank];
    s.erase(std::find(s.begin(), s.end(), expert));
    holds[rank][expert] = 0;
    rank_load[rank] -= rows;
    --node_holds[topology.node_of(rank)][expert];
  }
};

// The best rank for a replica of `expert` carrying `rows`, or -1 when every rank with a free slot
// already holds it. Order: a node without the expert, least load, most senders on the rank's own
// node (fewer inter-node rows), fewest slots used, lowest id.
int best_rank(const Fill& fill, int32_t expert, int64_t slots_per_rank, const Topology& topology) {
  int best = -1;
  auto key = [&](int r) {
    return std::make_tuple(fill.node_holds[topology.node_of(r)][expert] > 0, fill.rank_load[r],
                           -topology.ranks_on_node(topology.node_of(r)), fill.slots[r].size(), r);
  };
  for (int r = 0; r < topology.num_ranks(); ++r) {
    if (static_cast<int64_t>(fill.slots[r].size()) >= slots_per_rank || fill.holds[r][expert]) {
      continue;
    }
    if (best < 0 || key(r) < key(best)) best = r;
  }
  return best;
}

// When only ranks already holding `expert` have free slots: a full rank q without it hands one
// of its experts (one the free rank lacks) to the free rank, and takes `expert` instead. Such a
// q and expert always exist: fewer than N ranks hold `expert`, and the free rank holds fewer
// than S experts (one of them `expert`) while q holds S.
int make_room(Fill& fill, int32_t expert, std::span<const double> replica_rows,
              int64_t slots_per_rank, const Topology& topology) {
  int free_rank = -1;
  for (int r = 0; r < topology.num_ranks(); ++r) {
    if (static_cast<int64_t>(fill.slots[r].size()) < slots_per_rank &&
        (free_rank < 0 || fill.rank_load[r] < fill.rank_load[free_rank])) {
      free_rank = r;
    }
  }
  MOE_CHECK(free_rank >= 0, "placement planner: no free slot left for expert ", expert);
  for (int q = 0; q < topology.num_ranks(); ++q) {
    if (fill.holds[q][expert]) continue;
    for (int32_t moved : fill.slots[q]) {
      if (fill.holds[free_rank][moved]) continue;
      const double rows = replica_rows[moved];
      fill.remove(q, moved, rows, topology);
      fill.add(free_rank, moved, rows, topology);
      return q;
    }
  }
  MOE_FAIL("placement planner: no rank can take a replica of expert ", expert);
}

}  // namespace

int64_t min_slots_per_rank(int64_t num_experts, int num_ranks) {
  return (num_experts + num_ranks - 1) / num_ranks;
}

std::vector<int32_t> plan_replica_counts(std::span<const int64_t> load,
                                         const PlanOptions& options) {
  check_options(load, options);
  const int64_t E = static_cast<int64_t>(load.size());
  std::vector<int32_t> replicas(static_cast<size_t>(E), 1);
  int64_t extra = options.slots_per_rank * options.num_ranks - E;
  // The top is the expert with the largest load per replica, ties to the lower id.
  auto lighter = [&](int32_t a, int32_t b) {
    if (heavier(load[b], replicas[b], load[a], replicas[a])) return true;
    if (heavier(load[a], replicas[a], load[b], replicas[b])) return false;
    return a > b;
  };
  std::priority_queue<int32_t, std::vector<int32_t>, decltype(lighter)> next(lighter);
  for (int32_t e = 0; e < E; ++e) {
    if (options.num_ranks > 1) next.push(e);
  }
  while (extra > 0 && !next.empty()) {
    const int32_t e = next.top();
    next.pop();
    ++replicas[e];
    --extra;
    if (replicas[e] < options.num_ranks) next.push(e);
  }
  return replicas;
}

LayerPlacement plan_layer(std::span<const int64_t> load, const PlanOptions& options,
                          const Topology& topology) {
  MOE_CHECK(topology.num_ranks() == options.num_ranks, "a topology of ", topology.num_ranks(),
            " ranks for a plan over ", options.num_ranks);
  const std::vector<int32_t> replicas = plan_replica_counts(load, options);
  const int64_t E = static_cast<int64_t>(load.size());
  std::vector<double> replica_rows(static_cast<size_t>(E));  // [E] load / replicas
  for (int64_t e = 0; e < E; ++e) {
    replica_rows[e] = static_cast<double>(load[e]) / replicas[e];
  }
  // Experts by load per replica, descending (ties to the lower id); each expert's replicas in a
  // row.
  std::vector<int32_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    if (heavier(load[a], replicas[a], load[b], replicas[b])) return true;
    if (heavier(load[b], replicas[b], load[a], replicas[a])) return false;
    return a < b;
  });
  Fill fill(options.num_ranks, topology.num_nodes(), E);
  for (int32_t e : order) {
    for (int32_t i = 0; i < replicas[e]; ++i) {
      int rank = best_rank(fill, e, options.slots_per_rank, topology);
      if (rank < 0) rank = make_room(fill, e, replica_rows, options.slots_per_rank, topology);
      fill.add(rank, e, replica_rows[e], topology);
    }
  }
  return LayerPlacement(E, std::move(fill.slots));
}

LayerPrediction predict_layer(const LayerPlacement& placement, std::span<const int64_t> load,
                              const Topology& topology) {
  const int N = placement.num_ranks();
  MOE_CHECK(static_cast<int64_t>(load.size()) == placement.num_experts(), "loads of ", load.size(),
            " experts for a placement of ", placement.num_experts());
  MOE_CHECK(topology.num_ranks() == N, "a topology of ", topology.num_ranks(),
            " ranks for a placement over ", N);
  LayerPrediction p;
  p.rank_rows.assign(static_cast<size_t>(N), 0.0);
  for (int64_t e = 0; e < placement.num_experts(); ++e) {
    const auto holders = placement.replicas(e);
    const double per_replica = static_cast<double>(load[e]) / static_cast<double>(holders.size());
    for (int32_t r : holders) {
      p.rank_rows[r] += per_replica;
      // Each of the N source ranks sends per_replica / N rows to this replica.
      const int local = topology.ranks_on_node(topology.node_of(r));
      p.intra_node_rows += per_replica * (local - 1) / N;
      p.inter_node_rows += per_replica * (N - local) / N;
    }
  }
  p.max_rows = *std::max_element(p.rank_rows.begin(), p.rank_rows.end());
  p.mean_rows = std::accumulate(p.rank_rows.begin(), p.rank_rows.end(), 0.0) / N;
  return p;
}

TotalPrediction total_prediction(std::span<const LayerPrediction> layers) {
  TotalPrediction t;
  for (const LayerPrediction& p : layers) {
    t.max_rows += p.max_rows;
    t.mean_rows += p.mean_rows;
    t.intra_node_rows += p.intra_node_rows;
    t.inter_node_rows += p.inter_node_rows;
  }
  return t;
}

double remote_bytes(double rows, int64_t hidden_size) {
  return rows * 2.0 * static_cast<double>(hidden_size) * sizeof(float);
}

}  // namespace moeinfer::parallel
