// The hot set of the static cache policy and the warm-up order of every policy: experts ranked
// by how much of a routing trace (--trace-routing, profile/routing_trace.h) they took, and how
// many slots the static policy keeps for streaming the experts outside its hot set. Host code
// with no CUDA, so that both decoders size their caches by the same rule.
#pragma once

#include <cstdint>
#include <filesystem>
#include <vector>

#include "profile/routing_trace.h"

namespace moeinfer::offload {

// Slots the static policy leaves evictable (not hot): room for two layers' demands (one layer
// computing, the next one's prefetch), each at most min(E, max_assignments_per_layer) distinct
// experts, and never more than the cache has.
inline int64_t static_reserve_slots(int64_t num_experts, int64_t max_assignments_per_layer,
                                    int64_t num_slots) {
  const int64_t per_layer =
      num_experts < max_assignments_per_layer ? num_experts : max_assignments_per_layer;
  return num_slots < 2 * per_layer ? num_slots : 2 * per_layer;
}

// Global expert ids (layer * E + e) of every expert the trace routed a token to, by total load
// (assignments over all steps), highest first; ties go to the lower id. Experts the trace never
// picked are left out: nothing says they are worth a slot.
std::vector<int32_t> rank_experts_by_load(const RoutingTrace& trace);

// Reads a routing trace and ranks its experts (rank_experts_by_load) for a model of num_layers
// layers of num_experts experts; errors name the file and what does not match the model.
std::vector<int32_t> load_expert_ranking(const std::filesystem::path& path, int64_t num_layers,
                                         int64_t num_experts);

}  // namespace moeinfer::offload
