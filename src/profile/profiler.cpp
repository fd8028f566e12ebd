#include "profile/profiler.h"

#include <iterator>

#include <algorithm>
#include <array>

#include "core/error.h"

namespace moeinfer::profile {

std::string_view stage_name(Stage stage) {
  static constexpr std::array<std::string_view, kNumStages> kNames = {
      "attention", "route",          "plan",      "dispatch", "experts", "combine",
      "unpermute", "shared_experts", "dense_mlp", "lm_head",  "sample",  "schedule"};
  const int index = static_cast<int>(stage);
  return index >= 0 && index < kNumStages ? kNames[index] : "unknown";
}

void ProfilerOptions::validate() const {
  MOE_CHECK(num_layers >= 1, "profiler: num_layers must be >= 1, got ", num_layers);
  MOE_CHECK(num_experts >= 0, "profiler: num_experts must be >= 0, got ", num_experts);
  MOE_CHECK(expert_bytes.empty() || static_cast<int64_t>(expert_bytes.size()) == num_layers,
            "profiler: expert_bytes has ", expert_bytes.size(), " entries for ", num_layers,
            " layers");
  for (int64_t bytes : expert_bytes) {
    MOE_CHECK(bytes >= 0, "profiler: expert_bytes holds a negative entry ", bytes);
  }
  MOE_CHECK(expert_rank.empty() || static_cast<int64_t>(expert_rank.size()) == num_experts,
            "profiler: expert_rank has ", expert_rank.size(), " entries for ", num_experts,
            " experts");
  for (int32_t rank : expert_rank) {
    MOE_CHECK(rank >= 0, "profiler: expert_rank holds a negative rank ", rank);
  }
  MOE_CHECK(time_every >= 1, "profiler: time_every must be >= 1, got ", time_every);
}

int64_t ProfilerOptions::num_ranks() const {
  if (expert_rank.empty()) return 1;
  return *std::max_element(expert_rank.begin(), expert_rank.end()) + 1;
}

Profiler::Profiler(ProfilerOptions options) : options_(std::move(options)) {
  options_.validate();
  if (options_.expert_bytes.empty()) options_.expert_bytes.assign(options_.num_layers, 0);
  current_.stage_ns.assign((options_.num_layers + 1) * kNumStages, 0);
  current_.stage_calls.assign((options_.num_layers + 1) * kNumStages, 0);
  current_.expert_rows.assign(options_.num_layers * options_.num_experts, 0);
  current_.rank_rows.assign(options_.num_ranks(), 0);
  current_.expert_cache.assign(options_.num_layers * offload::kNumCacheCounters, 0);
  current_.expert_cache_bytes.assign(options_.num_layers, 0);
  current_.expert_cache_stall_s.assign(options_.num_layers, 0.0);
  row_ = options_.num_layers;
}

void Profiler::begin_step(int64_t num_tokens) {
  std::fill(current_.stage_ns.begin(), current_.stage_ns.end(), 0);
  std::fill(current_.stage_calls.begin(), current_.stage_calls.end(), 0);
  std::fill(current_.expert_rows.begin(), current_.expert_rows.end(), 0);
  current_.num_tokens = num_tokens;
  current_.expert_bytes_read = 0;
  current_.cache_hits = 0;
  current_.cache_misses = 0;
  std::fill(std::begin(current_.link_bytes), std::end(current_.link_bytes), 0);
  std::fill(current_.expert_cache.begin(), current_.expert_cache.end(), 0);
  std::fill(current_.expert_cache_bytes.begin(), current_.expert_cache_bytes.end(), 0);
  std::fill(current_.expert_cache_stall_s.begin(), current_.expert_cache_stall_s.end(), 0.0);
  row_ = options_.num_layers;
  current_.timed = options_.time_stages && steps_begun_ % options_.time_every == 0;
  ++steps_begun_;
  step_start_ns_ = now_ns();
}

void Profiler::end_step() {
  current_.wall_ns = now_ns() - step_start_ns_;
  const int64_t E = options_.num_experts;
  int64_t bytes = 0;
  for (int64_t l = 0; l < options_.num_layers; ++l) {
    const int32_t* rows = current_.expert_rows.data() + l * E;
    const int64_t touched = std::count_if(rows, rows + E, [](int32_t n) { return n > 0; });
    bytes += touched * options_.expert_bytes[l];
  }
  current_.expert_bytes_read = bytes;
  std::fill(current_.rank_rows.begin(), current_.rank_rows.end(), 0);
  for (int64_t l = 0; l < options_.num_layers; ++l) {
    for (int64_t e = 0; e < E; ++e) {
      const int32_t rank = options_.expert_rank.empty() ? 0 : options_.expert_rank[e];
      current_.rank_rows[rank] += current_.expert_rows[l * E + e];
    }
  }
  steps_.push_back(current_);
}

void Profiler::record_routing(int64_t layer, std::span<const int32_t> topk_ids) {
  const int64_t E = options_.num_experts;
  MOE_CHECK(layer >= 0 && layer < options_.num_layers, "profiler: layer ", layer, " outside [0, ",
            options_.num_layers, ")");
  int32_t* rows = current_.expert_rows.data() + layer * E;
  for (int32_t e : topk_ids) {
    if (e < 0) continue;  // an assignment a routing approximation dropped (moe::kNoExpert)
    MOE_CHECK(e >= 0 && e < E, "profiler: expert id ", e, " outside [0, ", E, ") in layer ", layer);
    ++rows[e];
  }
}

void Profiler::record_expert_counts(int64_t layer, std::span<const int32_t> counts) {
  const int64_t E = options_.num_experts;
  MOE_CHECK(layer >= 0 && layer < options_.num_layers, "profiler: layer ", layer, " outside [0, ",
            options_.num_layers, ")");
  MOE_CHECK(static_cast<int64_t>(counts.size()) == E, "profiler: ", counts.size(),
            " expert counts for ", E, " experts");
  int32_t* rows = current_.expert_rows.data() + layer * E;
  for (int64_t e = 0; e < E; ++e) rows[e] += counts[e];
}

void Profiler::record_expert_cache(int64_t layer, std::span<const int64_t> counters,
                                   int64_t host_to_device_bytes, double stall_seconds) {
  MOE_CHECK(layer >= 0 && layer < options_.num_layers, "profiler: layer ", layer, " outside [0, ",
            options_.num_layers, ")");
  MOE_CHECK(static_cast<int64_t>(counters.size()) == offload::kNumCacheCounters, "profiler: ",
            counters.size(), " expert-cache counters, expected ", offload::kNumCacheCounters);
  MOE_CHECK(host_to_device_bytes >= 0 && stall_seconds >= 0.0,
            "profiler: negative expert-cache traffic (", host_to_device_bytes, " bytes, ",
            stall_seconds, " s) in layer ", layer);
  int64_t* row = current_.expert_cache.data() + layer * offload::kNumCacheCounters;
  for (int k = 0; k < offload::kNumCacheCounters; ++k) row[k] += counters[k];
  current_.expert_cache_bytes[layer] += host_to_device_bytes;
  current_.expert_cache_stall_s[layer] += stall_seconds;
  current_.link_bytes[static_cast<int>(Link::kHostDevice)] += host_to_device_bytes;
  current_.cache_hits += counters[offload::kCacheHits];
  current_.cache_misses += counters[offload::kCacheMisses] + counters[offload::kCacheUnplaced] +
                          counters[offload::kCacheOnCpu];
}

std::string_view link_name(Link link) {
  switch (link) {
    case Link::kOnDevice:
      return "on_device";
    case Link::kPeerGpu:
      return "peer_gpu";
    case Link::kHostDevice:
      return "host_device";
    case Link::kNetwork:
      return "network";
    case Link::kSameGpu:
      return "same_gpu";
  }
  return "";
}

void Profiler::set_current_layer(int64_t layer) {
  MOE_CHECK(layer >= -1 && layer < options_.num_layers, "profiler: layer ", layer, " outside [-1, ",
            options_.num_layers, ")");
  row_ = layer < 0 ? options_.num_layers : layer;
}

}  // namespace moeinfer::profile
