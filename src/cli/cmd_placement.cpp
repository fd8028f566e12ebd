// `moeinfer placement --trace FILE --ranks N (--slots S | --slots +R) [--topology nodes:K | FILE]
//  [--hidden-size H] [--output FILE] [--json] [--simulate N1,N2,...]`: an expert placement
// planned from a routing trace's load (parallel/placement_planner.h), with the rows and bytes it
// is predicted to cost per rank against contiguous ranges, and the file `--placement` reads.
//
// Every bad input (flags, trace, topology) is a UsageError: exit 2, the problem named.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/usage_error.h"
#include "parallel/placement.h"
#include "parallel/placement_planner.h"
#include "profile/routing_trace.h"

namespace moeinfer::cli {
namespace {

constexpr int kMaxRanks = 256;

// The flags as typed; parsed here rather than by CLI11 so that every refusal exits 2 and names
// the flag.
struct PlacementArgs {
  std::string trace, ranks, slots, topology, hidden_size, output, simulate;
  bool json = false;
};

// --slots: S per rank, or "+R" replicas per rank beyond ceil(E / N).
struct SlotsSpec {
  bool extra = false;
  int64_t value = 0;
  int64_t per_rank(int64_t num_experts, int num_ranks) const {
    return extra ? parallel::min_slots_per_rank(num_experts, num_ranks) + value : value;
  }
};

// --topology: none (one node), nodes:K, or a file.
struct TopologySpec {
  int num_nodes = 0;  // nodes:K; 0 when not given that way
  std::string file;
  parallel::Topology for_ranks(int num_ranks) const {
    if (num_nodes > 0) return parallel::Topology::contiguous_nodes(num_ranks, num_nodes);
    if (!file.empty()) return parallel::read_topology(file, num_ranks);
    return parallel::Topology::single_node(num_ranks);
  }
};

struct PlacementRequest {
  std::string trace;
  int num_ranks = 0;
  SlotsSpec slots;
  TopologySpec topology;
  int64_t hidden_size = 0;  // 0: report remote rows, not bytes
  std::string output;
  bool json = false;
  std::vector<int> simulate;
};

int64_t parse_integer(const std::string& text, const char* flag) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  USAGE_CHECK(ec == std::errc() && ptr == end && !text.empty(), flag, " takes an integer, not \"",
              text, "\"");
  return value;
}

int parse_rank_count(const std::string& text, const char* flag) {
  const int64_t n = parse_integer(text, flag);
  USAGE_CHECK(n >= 1 && n <= kMaxRanks, flag, " ", text, ": rank counts are 1 to ", kMaxRanks);
  return static_cast<int>(n);
}

SlotsSpec parse_slots(const std::string& text) {
  USAGE_CHECK(!text.empty(), "--slots is required: S slots per rank, or +R replicas per rank");
  SlotsSpec spec;
  spec.extra = text.front() == '+';
  spec.value = parse_integer(spec.extra ? text.substr(1) : text, "--slots");
  USAGE_CHECK(spec.extra ? spec.value >= 0 : spec.value >= 1, "--slots ", text,
              ": S must be >= 1 and +R >= +0");
  return spec;
}

TopologySpec parse_topology(const std::string& text) {
  TopologySpec spec;
  if (text.empty()) return spec;
  if (text.starts_with("nodes:")) {
    const int64_t k = parse_integer(text.substr(6), "--topology nodes:K");
    USAGE_CHECK(k >= 1 && k <= kMaxRanks, "--topology ", text, ": K must be 1 to ", kMaxRanks);
    spec.num_nodes = static_cast<int>(k);
    return spec;
  }
  USAGE_CHECK(std::filesystem::is_regular_file(text), "--topology ", text,
              " is neither nodes:K nor a readable file");
  spec.file = text;
  return spec;
}

std::vector<int> parse_simulate(const std::string& text) {
  std::vector<int> counts;
  if (text.empty()) return counts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    counts.push_back(parse_rank_count(text.substr(start, comma - start), "--simulate"));
    start = comma + 1;
  }
  return counts;
}

PlacementRequest parse_request(const PlacementArgs& args) {
  PlacementRequest r;
  USAGE_CHECK(!args.trace.empty(),
              "--trace FILE is required (a routing trace from "
              "`moeinfer generate --trace-routing FILE`)");
  r.trace = args.trace;
  USAGE_CHECK(!args.ranks.empty(), "--ranks N is required");
  r.num_ranks = parse_rank_count(args.ranks, "--ranks");
  r.slots = parse_slots(args.slots);
  r.topology = parse_topology(args.topology);
  if (!args.hidden_size.empty()) {
    r.hidden_size = parse_integer(args.hidden_size, "--hidden-size");
    USAGE_CHECK(r.hidden_size >= 1, "--hidden-size ", args.hidden_size, " must be >= 1");
  }
  r.output = args.output;
  r.json = args.json;
  r.simulate = parse_simulate(args.simulate);
  return r;
}

// The trace's load per MoE layer [E]; a trace that does not read is a usage error.
std::map<int64_t, std::vector<int64_t>> load_trace(const std::string& path) {
  USAGE_CHECK(std::filesystem::is_regular_file(path), "--trace ", path, ": no such file");
  RoutingTrace trace;
  try {
    trace = read_routing_trace(path);
  } catch (const Error& e) {
    throw UsageError(std::string("--trace: ") + e.what(), e.where());
  }
  auto loads = expert_load_per_layer(trace);
  USAGE_CHECK(!loads.empty(), "--trace ", path, ": holds no routing records");
  return loads;
}

// One placement for every layer of the trace and its predicted cost, beside contiguous ranges
// (which need E >= N).
struct Plan {
  int num_ranks = 0;
  int64_t slots_per_rank = 0;
  int num_nodes = 1;
  std::map<int64_t, parallel::LayerPlacement> layers;
  std::vector<int64_t> layer_ids;
  std::vector<parallel::LayerPrediction> planned;
  std::vector<parallel::LayerPrediction> contiguous;  // empty when E < N
};

Plan make_plan(const std::map<int64_t, std::vector<int64_t>>& loads, int num_ranks,
               const SlotsSpec& slots, const TopologySpec& topology_spec) {
  const int64_t E = static_cast<int64_t>(loads.begin()->second.size());
  Plan plan;
  plan.num_ranks = num_ranks;
  plan.slots_per_rank = slots.per_rank(E, num_ranks);
  USAGE_CHECK(plan.slots_per_rank * num_ranks >= E, "--slots ", plan.slots_per_rank, " x ",
              num_ranks, " ranks = ", plan.slots_per_rank * num_ranks, " slots, fewer than the ", E,
              " experts; give --slots ", parallel::min_slots_per_rank(E, num_ranks),
              " or more (or --slots +R)");
  parallel::Topology topology = parallel::Topology::single_node(num_ranks);
  try {
    topology = topology_spec.for_ranks(num_ranks);
  } catch (const Error& e) {
    throw UsageError(std::string("--topology: ") + e.what(), e.where());
  }
  plan.num_nodes = topology.num_nodes();
  const parallel::PlanOptions options{.num_ranks = num_ranks,
                                      .slots_per_rank = plan.slots_per_rank};
  for (const auto& [layer, load] : loads) {
    const parallel::LayerPlacement placed = parallel::plan_layer(load, options, topology);
    plan.planned.push_back(parallel::predict_layer(placed, load, topology));
    if (E >= num_ranks) {
      plan.contiguous.push_back(parallel::predict_layer(
          parallel::LayerPlacement::contiguous(E, num_ranks), load, topology));
    }
    plan.layers.emplace(layer, placed);
    plan.layer_ids.push_back(layer);
  }
  return plan;
}

nlohmann::ordered_json figures_json(double max_rows, double mean_rows, double intra_rows,
                                    double inter_rows, int64_t hidden_size) {
  nlohmann::ordered_json j = {{"max_over_mean", mean_rows > 0 ? max_rows / mean_rows : 1.0},
                              {"max_rows", max_rows},
                              {"mean_rows", mean_rows},
                              {"intra_node_rows", intra_rows},
                              {"inter_node_rows", inter_rows}};
  if (hidden_size > 0) {
    j["intra_node_bytes"] = parallel::remote_bytes(intra_rows, hidden_size);
    j["inter_node_bytes"] = parallel::remote_bytes(inter_rows, hidden_size);
  }
  return j;
}

nlohmann::ordered_json layer_json(const parallel::LayerPrediction& p, int64_t hidden_size) {
  nlohmann::ordered_json j =
      figures_json(p.max_rows, p.mean_rows, p.intra_node_rows, p.inter_node_rows, hidden_size);
  j["rank_rows"] = p.rank_rows;
  return j;
}

nlohmann::ordered_json total_json(std::span<const parallel::LayerPrediction> layers,
                                  int64_t hidden_size) {
  if (layers.empty()) return nullptr;
  const parallel::TotalPrediction t = parallel::total_prediction(layers);
  return figures_json(t.max_rows, t.mean_rows, t.intra_node_rows, t.inter_node_rows, hidden_size);
}

// The placement file's "predicted" field (and --json's).
nlohmann::ordered_json predicted_json(const Plan& plan, int64_t hidden_size) {
  nlohmann::ordered_json j = {{"num_ranks", plan.num_ranks},
                              {"slots_per_rank", plan.slots_per_rank},
                              {"num_nodes", plan.num_nodes}};
  if (hidden_size > 0) j["hidden_size"] = hidden_size;
  j["planned"] = total_json(plan.planned, hidden_size);
  j["contiguous"] = total_json(plan.contiguous, hidden_size);
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  for (size_t i = 0; i < plan.layer_ids.size(); ++i) {
    layers.push_back(
        {{"layer", plan.layer_ids[i]},
         {"planned", layer_json(plan.planned[i], hidden_size)},
         {"contiguous", plan.contiguous.empty() ? nlohmann::ordered_json(nullptr)
                                                : layer_json(plan.contiguous[i], hidden_size)}});
  }
  j["layers"] = std::move(layers);
  return j;
}

void write_output(const std::string& path, const Plan& plan, int64_t hidden_size) {
  nlohmann::ordered_json file =
      nlohmann::ordered_json::parse(parallel::placement_json(plan.layers));
  file["predicted"] = predicted_json(plan, hidden_size);
  std::ofstream out(path);
  MOE_CHECK(out.good(), "--output: cannot write ", path);
  out << file.dump(1) << "\n";
  MOE_CHECK(out.good(), "--output: writing ", path, " failed");
}

// Remote traffic as one column: megabytes with --hidden-size, else thousands of rows.
std::string traffic(double rows, int64_t hidden_size) {
  char text[32];
  if (hidden_size > 0) {
    std::snprintf(text, sizeof text, "%.2f", parallel::remote_bytes(rows, hidden_size) / 1e6);
  } else {
    std::snprintf(text, sizeof text, "%.2f", rows / 1e3);
  }
  return text;
}

struct Figures {
  double max_over_mean, max_rows, intra_rows, inter_rows;
};

void print_figures_row(const std::string& label, const Figures& planned,
                       const std::optional<Figures>& contiguous, int64_t hidden_size) {
  std::printf("%6s  %8.3f %10.1f %9s %9s |", label.c_str(), planned.max_over_mean, planned.max_rows,
              traffic(planned.intra_rows, hidden_size).c_str(),
              traffic(planned.inter_rows, hidden_size).c_str());
  if (contiguous) {
    std::printf(" %8.3f %10.1f %9s %9s | %6.3fx\n", contiguous->max_over_mean, contiguous->max_rows,
                traffic(contiguous->intra_rows, hidden_size).c_str(),
                traffic(contiguous->inter_rows, hidden_size).c_str(),
                planned.max_rows / std::max(contiguous->max_rows, 1e-30));
  } else {
    std::printf(" %8s %10s %9s %9s | %7s\n", "-", "-", "-", "-", "-");
  }
}

Figures figures_of(const parallel::LayerPrediction& p) {
  return {p.max_over_mean(), p.max_rows, p.intra_node_rows, p.inter_node_rows};
}

Figures figures_of(const parallel::TotalPrediction& t) {
  return {t.max_over_mean(), t.max_rows, t.intra_node_rows, t.inter_node_rows};
}

void print_plan(const PlacementRequest& request, const Plan& plan, int64_t num_experts) {
  std::printf(
      "placement of %lld experts over %d ranks x %lld slots (%lld replicas beyond one "
      "each), %d node(s), from %s\n",
      static_cast<long long>(num_experts), plan.num_ranks,
      static_cast<long long>(plan.slots_per_rank),
      static_cast<long long>(plan.slots_per_rank * plan.num_ranks - num_experts), plan.num_nodes,
      request.trace.c_str());
  const char* unit = request.hidden_size > 0 ? "MB" : "k rows";
  std::printf(
      "remote traffic in %s (dispatch + combine%s); last column: planned max rows / "
      "contiguous\n\n",
      unit, request.hidden_size > 0 ? ", float32" : "; --hidden-size H gives bytes");
  std::printf("%6s  %-39s | %-39s |\n", "", "planned", "contiguous");
  std::printf("%6s  %8s %10s %9s %9s | %8s %10s %9s %9s | %7s\n", "layer", "max/mean", "max rows",
              "intra", "inter", "max/mean", "max rows", "intra", "inter", "ratio");
  for (size_t i = 0; i < plan.layer_ids.size(); ++i) {
    std::optional<Figures> baseline;
    if (!plan.contiguous.empty()) baseline = figures_of(plan.contiguous[i]);
    print_figures_row(std::to_string(plan.layer_ids[i]), figures_of(plan.planned[i]), baseline,
                      request.hidden_size);
  }
  std::optional<Figures> baseline;
  if (!plan.contiguous.empty()) baseline = figures_of(parallel::total_prediction(plan.contiguous));
  print_figures_row("total", figures_of(parallel::total_prediction(plan.planned)), baseline,
                    request.hidden_size);
  if (plan.contiguous.empty()) {
    std::printf("(no contiguous baseline: %lld experts cannot cover %d ranks once each)\n",
                static_cast<long long>(num_experts), plan.num_ranks);
  }
}

void print_simulation(const std::vector<Plan>& plans, int64_t hidden_size) {
  std::printf("\nsimulated rank counts (same trace, same --slots and --topology)\n");
  std::printf("%6s %6s  %-39s | %-39s |\n", "", "", "planned", "contiguous");
  std::printf("%6s %6s  %8s %10s %9s %9s | %8s %10s %9s %9s | %7s\n", "ranks", "slots", "max/mean",
              "max rows", "intra", "inter", "max/mean", "max rows", "intra", "inter", "ratio");
  for (const Plan& plan : plans) {
    std::printf("%6d ", plan.num_ranks);
    std::optional<Figures> baseline;
    if (!plan.contiguous.empty()) {
      baseline = figures_of(parallel::total_prediction(plan.contiguous));
    }
    print_figures_row(std::to_string(plan.slots_per_rank),
                      figures_of(parallel::total_prediction(plan.planned)), baseline, hidden_size);
  }
}

void run_placement(const PlacementArgs& args, const std::vector<std::string>& extras) {
  USAGE_CHECK(extras.empty(), "placement: unknown argument \"", extras.empty() ? "" : extras[0],
              "\" (see `moeinfer placement --help`)");
  const PlacementRequest request = parse_request(args);
  const auto loads = load_trace(request.trace);
  const int64_t E = static_cast<int64_t>(loads.begin()->second.size());
  const Plan plan = make_plan(loads, request.num_ranks, request.slots, request.topology);
  std::vector<Plan> simulated;
  for (int n : request.simulate) {
    try {
      simulated.push_back(make_plan(loads, n, request.slots, request.topology));
    } catch (const Error& e) {
      throw UsageError(std::string("--simulate ") + std::to_string(n) + ": " + e.what(), e.where());
    }
  }

  if (!request.output.empty()) write_output(request.output, plan, request.hidden_size);
  if (request.json) {
    nlohmann::ordered_json out = {{"trace", request.trace}, {"num_experts", E}};
    out["predicted"] = predicted_json(plan, request.hidden_size);
    if (!simulated.empty()) {
      nlohmann::ordered_json rows = nlohmann::ordered_json::array();
      for (const Plan& p : simulated) {
        rows.push_back({{"num_ranks", p.num_ranks},
                        {"slots_per_rank", p.slots_per_rank},
                        {"num_nodes", p.num_nodes},
                        {"planned", total_json(p.planned, request.hidden_size)},
                        {"contiguous", total_json(p.contiguous, request.hidden_size)}});
      }
      out["simulate"] = std::move(rows);
    }
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  print_plan(request, plan, E);
  if (!simulated.empty()) print_simulation(simulated, request.hidden_size);
  if (!request.output.empty()) std::printf("\nwrote %s\n", request.output.c_str());
}

}  // namespace

void add_placement_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "placement", "Plan an expert placement (replicas, ranks) from a routing trace's load");
  auto args = std::make_shared<PlacementArgs>();
  cmd->add_option("--trace", args->trace, "Routing trace (generate --trace-routing FILE)");
  cmd->add_option("--ranks", args->ranks, "Expert-parallel ranks N (1 to 256)");
  cmd->add_option("--slots", args->slots,
                  "Expert slots per rank S (S*N >= E), or +R: R replicas per rank beyond "
                  "ceil(E/N)");
  cmd->add_option("--topology", args->topology,
                  "nodes:K (N ranks in K equal contiguous nodes) or a JSON file "
                  "{\"node_of_rank\": [...]}");
  cmd->add_option("--hidden-size", args->hidden_size,
                  "Hidden size H: remote traffic in bytes (2*H*4 per row) instead of rows");
  cmd->add_option("--output", args->output, "Write the placement file (--placement FILE)");
  cmd->add_flag("--json", args->json, "Print JSON instead of a table");
  cmd->add_option("--simulate", args->simulate,
                  "Also predict these rank counts, comma-separated (e.g. 2,4,8)");
  cmd->allow_extras();  // refused in run_placement, with exit 2 like every bad input here
  cmd->callback([args, cmd] { run_placement(*args, cmd->remaining()); });
}

}  // namespace moeinfer::cli
