// `moeinfer trace summarize FILE [--json] [--pairs N]`: per-layer expert load, imbalance,
// co-selection and reuse distance of a routing trace written with --trace-routing.
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "profile/routing_trace.h"

namespace moeinfer::cli {
namespace {

void print_table(const RoutingTrace& trace, const std::vector<LayerSummary>& layers) {
  std::printf("routing trace: %u layers, %u experts, top-%u, %zu records\n", trace.num_layers,
              trace.num_experts, trace.top_k, trace.records.size());
  std::printf("%5s %8s %9s %7s %10s %10s  %s\n", "layer", "tokens", "max/mean", "unused",
              "reuse dist", "reuse@+1", "most co-selected pairs");
  for (const LayerSummary& s : layers) {
    if (s.tokens == 0) continue;
    std::string pairs;
    for (const auto& [a, b, count] : s.top_pairs) {
      pairs += "(" + std::to_string(a) + "," + std::to_string(b) + ")x" + std::to_string(count) + " ";
    }
    const double next_step = s.reuse_samples ? static_cast<double>(s.reuse_within_1_step) /
                                                   static_cast<double>(s.reuse_samples)
                                             : 0.0;
    std::printf("%5lld %8lld %9.2f %7lld %10.2f %9.0f%%  %s\n", static_cast<long long>(s.layer),
                static_cast<long long>(s.tokens), s.max_over_mean,
                static_cast<long long>(s.unused_experts), s.mean_reuse_distance, 100.0 * next_step,
                pairs.c_str());
  }
}

}  // namespace

void add_trace_command(CLI::App& app) {
  auto* trace = app.add_subcommand("trace", "Routing traces written with --trace-routing");
  trace->require_subcommand(1);
  auto* summarize = trace->add_subcommand("summarize", "Per-layer load, imbalance, co-selection, reuse");
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto num_pairs = std::make_shared<int64_t>(3);
  summarize->add_option("file", *path, "Trace file")->required();
  summarize->add_flag("--json", *as_json, "Print JSON");
  summarize->add_option("--pairs", *num_pairs, "Co-selected pairs to show per layer")
      ->capture_default_str();
  summarize->callback([=] {
    const RoutingTrace t = read_routing_trace(*path);
    const auto layers = summarize_routing_trace(t, *num_pairs);
    if (*as_json) {
      std::printf("%s\n", routing_trace_summary_json(t, layers).dump(2).c_str());
    } else {
      print_table(t, layers);
    }
  });
}

}  // namespace moeinfer::cli
