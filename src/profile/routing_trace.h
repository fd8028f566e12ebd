// Routing traces: every routing decision of a run (step, layer, token, experts, weights) in a
// compact binary file, and the summaries that caching and placement need.
//
// File layout (little-endian):
//   header  : char magic[8] = "MOETRACE", u32 version = 1, u32 num_layers, u32 num_experts,
//             u32 top_k
//   records : one per (step, MoE layer) in the order they happened:
//             u32 step, u32 layer, u32 num_tokens,
//             u16 expert_ids[num_tokens * top_k]   (token-major, best first)
//             u16 weights_bf16[num_tokens * top_k]
// A step is one forward pass; tokens are that step's rows in batch order.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moe/stages.h"

namespace moeinfer {

class RoutingTraceWriter {
 public:
  RoutingTraceWriter(const std::filesystem::path& path, int64_t num_layers, int64_t num_experts,
                     int64_t top_k);
  ~RoutingTraceWriter();
  RoutingTraceWriter(const RoutingTraceWriter&) = delete;
  RoutingTraceWriter& operator=(const RoutingTraceWriter&) = delete;

  // Records one layer's decisions within the current step.
  void record(int64_t layer, const moe::Routing& routing);
  // Marks the end of a forward pass; later records belong to the next step.
  void next_step() { ++step_; }
  int64_t records() const { return records_; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
  int64_t top_k_;
  uint32_t step_ = 0;
  int64_t records_ = 0;
  std::vector<uint16_t> buffer_;
};

// An assignment a routing approximation dropped (moe::kNoExpert), in a trace held in memory
// (`moeinfer profile`'s routing summary skips it); trace files never hold one.
inline constexpr uint16_t kDroppedTraceId = 0xFFFF;

struct TraceRecord {
  uint32_t step = 0;
  uint32_t layer = 0;
  uint32_t num_tokens = 0;
  std::vector<uint16_t> expert_ids;  // [num_tokens, top_k] (kDroppedTraceId: dropped)
  std::vector<float> weights;        // [num_tokens, top_k]
};

struct RoutingTrace {
  uint32_t num_layers = 0;
  uint32_t num_experts = 0;
  uint32_t top_k = 0;
  std::vector<TraceRecord> records;
};

// Reads and validates a trace; errors name the file and the byte offset.
RoutingTrace read_routing_trace(const std::filesystem::path& path);

struct LayerSummary {
  int64_t layer = 0;
  int64_t tokens = 0;
  std::vector<int64_t> load;            // [E] assignments per expert
  double max_over_mean = 0.0;           // imbalance: busiest expert / mean
  int64_t unused_experts = 0;
  // The most frequent pairs of experts chosen by the same token: (a, b, count), a < b.
  std::vector<std::tuple<int32_t, int32_t, int64_t>> top_pairs;
  // Reuse distance: steps between consecutive picks of the same expert in this layer.
  double mean_reuse_distance = 0.0;
  int64_t reuse_within_1_step = 0;      // picks whose expert was also picked in the previous step
  int64_t reuse_samples = 0;
};

std::vector<LayerSummary> summarize_routing_trace(const RoutingTrace& trace, int64_t top_pairs);

// `moeinfer trace summarize --json` and the Python API's summarize_routing_trace: the trace's
// shape and, per layer with records, tokens, load [E], max/mean, unused experts, the top pairs
// [[a, b, count]], mean reuse distance and the share of picks reused at the next step.
nlohmann::ordered_json routing_trace_summary_json(const RoutingTrace& trace,
                                                  const std::vector<LayerSummary>& layers);

// Assignments per expert [E] of every layer that has records, by layer index: the load that
// placement plans from (no pair counting, so it stays cheap on long traces).
std::map<int64_t, std::vector<int64_t>> expert_load_per_layer(const RoutingTrace& trace);

}  // namespace moeinfer
