#include "offload/hot_set.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace moeinfer::offload {

std::vector<int32_t> rank_experts_by_load(const RoutingTrace& trace) {
  const int64_t E = trace.num_experts;
  std::vector<int64_t> load(static_cast<size_t>(trace.num_layers) * E, 0);  // [L*E]
  for (const TraceRecord& r : trace.records) {
    MOE_CHECK(r.layer < trace.num_layers, "routing trace: a record of layer ", r.layer,
              " in a trace of ", trace.num_layers, " layers");
    for (uint16_t e : r.expert_ids) {
      MOE_CHECK(e < E, "routing trace: expert ", e, " in layer ", r.layer, " of a trace of ", E,
                " experts");
      ++load[r.layer * E + e];
    }
  }
  std::vector<int32_t> ranking;
  for (size_t g = 0; g < load.size(); ++g) {
    if (load[g] > 0) ranking.push_back(static_cast<int32_t>(g));
  }
  // Stable on ids already in increasing order: equal loads keep the lower id first.
  std::stable_sort(ranking.begin(), ranking.end(),
                   [&](int32_t a, int32_t b) { return load[a] > load[b]; });
  return ranking;
}

std::vector<int32_t> load_expert_ranking(const std::filesystem::path& path, int64_t num_layers,
                                         int64_t num_experts) {
  const RoutingTrace trace = read_routing_trace(path);
  MOE_CHECK(trace.num_layers == num_layers, "hot-set trace ", path.string(), " has ",
            trace.num_layers, " layers but the model has ", num_layers,
            ": record it with --trace-routing on this model");
  MOE_CHECK(trace.num_experts == num_experts, "hot-set trace ", path.string(), " has ",
            trace.num_experts, " experts per layer but the model has ", num_experts,
            ": record it with --trace-routing on this model");
  return rank_experts_by_load(trace);
}

}  // namespace moeinfer::offload
