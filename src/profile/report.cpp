#include "profile/report.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <numeric>

#include "core/error.h"
#include "offload/cache_summary.h"

namespace moeinfer::profile {
namespace {

using Json = nlohmann::ordered_json;

double to_ms(int64_t ns) { return static_cast<double>(ns) * 1e-6; }
double to_us(int64_t ns) { return static_cast<double>(ns) * 1e-3; }

// max / mean of one layer's rows per expert; null when the layer received nothing.
Json imbalance(const int32_t* rows, int64_t num_experts) {
  const int64_t total = std::accumulate(rows, rows + num_experts, int64_t{0});
  if (total == 0 || num_experts == 0) return nullptr;
  const double mean = static_cast<double>(total) / static_cast<double>(num_experts);
  return *std::max_element(rows, rows + num_experts) / mean;
}

std::string format(const char* fmt, ...) {
  char buffer[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buffer, sizeof(buffer), fmt, args);
  va_end(args);
  return buffer;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return format(u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
}

}  // namespace

Json build_report(const RunInfo& run, const Profiler& profiler,
                  std::span<const LayerSummary> routing, const OverheadInfo& overhead) {
  const int64_t L = profiler.num_layers();
  const int64_t E = profiler.num_experts();
  const int64_t S = kNumStages;
  const std::vector<StepRecord>& steps = profiler.steps();
  MOE_CHECK(!steps.empty(), "profile report: the profiler recorded no steps");
  MOE_CHECK(static_cast<int64_t>(run.layer_is_moe.size()) == L,
            "profile report: ", run.layer_is_moe.size(), " layer flags for ", L, " layers");
  MOE_CHECK(routing.empty() || static_cast<int64_t>(routing.size()) == L,
            "profile report: ", routing.size(), " routing summaries for ", L, " layers");

  Json report;
  report["version"] = 1;
  const std::vector<int64_t>& expert_bytes = profiler.options().expert_bytes;
  report["run"] = {{"model", run.model},
                   {"model_type", run.model_type},
                   {"batch", run.batch},
                   {"input_len", run.input_len},
                   {"output_len", run.output_len},
                   {"seed", run.seed},
                   {"tokens", run.token_source},
                   {"threads", run.num_threads},
                   {"num_layers", L},
                   {"num_experts", E},
                   {"top_k", run.top_k},
                   {"hidden_size", run.hidden_size},
                   {"moe_layers", run.layer_is_moe},
                   {"expert_bytes", expert_bytes}};
  Json stages = Json::array();
  for (int64_t s = 0; s < S; ++s) {
    const Stage stage = static_cast<Stage>(s);
    stages.push_back(
        {{"name", stage_name(stage)}, {"scope", is_layer_stage(stage) ? "layer" : "step"}});
  }
  report["stages"] = stages;

  // Totals over the run. Stage figures come from the steps that timed their stages: all of them
  // unless the profiler sampled (ProfilerOptions::time_every). When it did, each phase's timed
  // steps stand for all of that phase's steps (prefill and decode steps differ too much for
  // one to stand for the other), so the totals estimate the whole run's.
  std::vector<int64_t> stage_calls(S, 0);  // [S]
  std::vector<int64_t> load(L * E, 0);     // [L, E]
  struct Phase {
    int64_t steps = 0, timed = 0, timed_wall = 0;
    std::vector<int64_t> stage, layer_stage;  // [S], [L, S] summed over the timed steps
  };
  Phase phases[2];  // prefill, decode
  for (Phase& p : phases) {
    p.stage.assign(S, 0);
    p.layer_stage.assign(L * S, 0);
  }
  int64_t wall_total = 0, prefill_wall = 0, decode_wall = 0, timed_steps = 0;
  int64_t prefill_tokens = 0, decode_tokens = 0, bytes_total = 0, decode_bytes = 0;
  int64_t hits = 0, misses = 0;
  // The expert cache under offloading: [L, kNumCacheCounters] counts, [L] bytes and stall.
  constexpr int64_t C = offload::kNumCacheCounters;
  std::vector<int64_t> cache_counts(L * C, 0), cache_bytes(L, 0);
  std::vector<double> cache_stall(L, 0.0);
  int64_t link_total[kNumLinks] = {};
  std::vector<int64_t> rank_total;
  Json step_list = Json::array();
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepRecord& r = steps[i];
    const bool prefill = static_cast<int64_t>(i) < run.prefill_steps;
    wall_total += r.wall_ns;
    (prefill ? prefill_wall : decode_wall) += r.wall_ns;
    (prefill ? prefill_tokens : decode_tokens) += r.num_tokens;
    Phase& phase = phases[prefill ? 0 : 1];
    ++phase.steps;
    if (r.timed) {
      phase.timed_wall += r.wall_ns;
      ++phase.timed;
      ++timed_steps;
    }
    bytes_total += r.expert_bytes_read;
    if (!prefill) decode_bytes += r.expert_bytes_read;
    hits += r.cache_hits;
    misses += r.cache_misses;
    for (int64_t i = 0; i < L * C; ++i) cache_counts[i] += r.expert_cache[i];
    for (int64_t l = 0; l < L; ++l) {
      cache_bytes[l] += r.expert_cache_bytes[l];
      cache_stall[l] += r.expert_cache_stall_s[l];
    }
    if (rank_total.size() < r.rank_rows.size()) rank_total.resize(r.rank_rows.size(), 0);
    for (size_t k = 0; k < r.rank_rows.size(); ++k) rank_total[k] += r.rank_rows[k];
    Json link_bytes = Json::object();
    for (int k = 0; k < kNumLinks; ++k) {
      link_total[k] += r.link_bytes[k];
      link_bytes[std::string(link_name(static_cast<Link>(k)))] = r.link_bytes[k];
    }

    Json stage_us = Json::object();
    std::vector<int64_t> per_stage(S, 0);
    Json layer_stage_us = Json::array();
    for (int64_t row = 0; r.timed && row <= L; ++row) {
      Json row_us = Json::array();
      for (int64_t s = 0; s < S; ++s) {
        const int64_t ns = r.stage_ns[row * S + s];
        per_stage[s] += ns;
        stage_calls[s] += r.stage_calls[row * S + s];
        if (row < L) phase.layer_stage[row * S + s] += ns;
        row_us.push_back(to_us(ns));
      }
      layer_stage_us.push_back(row_us);
    }
    for (int64_t s = 0; r.timed && s < S; ++s) {
      phase.stage[s] += per_stage[s];
      stage_us[std::string(stage_name(static_cast<Stage>(s)))] = to_us(per_stage[s]);
    }
    Json rows = Json::array(), layer_imbalance = Json::array();
    double imbalance_sum = 0.0, imbalance_max = 0.0;
    int64_t imbalance_layers = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int32_t* begin = r.expert_rows.data() + l * E;
      rows.push_back(std::vector<int32_t>(begin, begin + E));
      for (int64_t e = 0; e < E; ++e) load[l * E + e] += begin[e];
      Json x = run.layer_is_moe[l] ? imbalance(begin, E) : Json(nullptr);
      if (x.is_number()) {
        imbalance_sum += x.get<double>();
        imbalance_max = std::max(imbalance_max, x.get<double>());
        ++imbalance_layers;
      }
      layer_imbalance.push_back(x);
    }
    step_list.push_back(
        {{"step", i},
         {"phase", prefill ? "prefill" : "decode"},
         {"tokens", r.num_tokens},
         {"wall_us", to_us(r.wall_ns)},
         {"timed", r.timed},
         {"stage_us", r.timed ? stage_us : Json(nullptr)},
         {"layer_stage_us", r.timed ? layer_stage_us : Json(nullptr)},
         {"expert_rows", rows},
         {"expert_bytes_read", r.expert_bytes_read},
         {"cache_hits", r.cache_hits},
         {"cache_misses", r.cache_misses},
         {"link_bytes", link_bytes},
         {"rank_rows", r.rank_rows},
         {"imbalance", layer_imbalance},
         {"imbalance_mean",
          imbalance_layers ? Json(imbalance_sum / imbalance_layers) : Json(nullptr)},
         {"imbalance_max", imbalance_layers ? Json(imbalance_max) : Json(nullptr)}});
  }

  const int64_t num_steps = static_cast<int64_t>(steps.size());
  const int64_t decode_steps = std::max<int64_t>(0, num_steps - run.prefill_steps);
  // Scaled stage totals (ns) over the steps of the phases that had a timed step.
  std::vector<double> stage_total(S, 0.0), layer_stage_total(L * S, 0.0);
  double stage_wall = 0.0;
  int64_t stage_steps = 0;
  for (const Phase& p : phases) {
    if (p.timed == 0) continue;
    const double scale = static_cast<double>(p.steps) / static_cast<double>(p.timed);
    for (int64_t s = 0; s < S; ++s) stage_total[s] += scale * static_cast<double>(p.stage[s]);
    for (int64_t i = 0; i < L * S; ++i) {
      layer_stage_total[i] += scale * static_cast<double>(p.layer_stage[i]);
    }
    stage_wall += scale * static_cast<double>(p.timed_wall);
    stage_steps += p.steps;
  }
  const double staged = std::accumulate(stage_total.begin(), stage_total.end(), 0.0);
  const char* stage_basis = timed_steps == num_steps ? "measured on every step"
                            : stage_steps == num_steps
                                ? "scaled from the timed steps of each phase"
                                : "scaled from the timed steps; a phase without one is left out";
  report["summary"] = {
      {"steps", num_steps},
      {"timed_steps", timed_steps},
      {"time_every", profiler.options().time_every},
      {"stage_basis", stage_basis},
      {"stage_steps", stage_steps},
      {"prefill_steps", std::min(num_steps, run.prefill_steps)},
      {"decode_steps", decode_steps},
      {"total_ms", to_ms(wall_total)},
      {"prefill_ms", to_ms(prefill_wall)},
      {"decode_ms", to_ms(decode_wall)},
      {"decode_step_mean_ms", decode_steps ? to_ms(decode_wall) / decode_steps : 0.0},
      {"prefill_tokens", prefill_tokens},
      {"decode_tokens", decode_tokens},
      {"prefill_tokens_per_s", prefill_wall ? prefill_tokens / (prefill_wall * 1e-9) : 0.0},
      {"decode_tokens_per_s", decode_wall ? decode_tokens / (decode_wall * 1e-9) : 0.0},
      {"stage_wall_ms", stage_wall * 1e-6},
      {"other_ms", (stage_wall - staged) * 1e-6},
      {"expert_bytes_read", bytes_total},
      {"expert_bytes_read_per_decode_step",
       decode_steps ? static_cast<double>(decode_bytes) / decode_steps : 0.0},
      {"cache_hits", hits},
      {"cache_misses", misses}};
  for (int k = 0; k < kNumLinks; ++k) {
    report["summary"]["link_bytes"][std::string(link_name(static_cast<Link>(k)))] = link_total[k];
  }
  report["summary"]["rank_rows"] = rank_total;
  const bool offloaded = std::any_of(cache_counts.begin(), cache_counts.end(),
                                     [](int64_t c) { return c != 0; });
  const auto cache_entry = [](const offload::CacheSummary& c) {
    return Json{{"hits", c.counts[offload::kCacheHits]},
                {"misses", c.counts[offload::kCacheMisses]},
                {"unplaced", c.counts[offload::kCacheUnplaced]},
                {"prefetched", c.counts[offload::kCachePrefetched]},
                {"prefetch_used", c.counts[offload::kCachePrefetchUsed]},
                {"prefetch_wasted", c.counts[offload::kCachePrefetchWasted]},
                {"cpu_experts", c.counts[offload::kCacheOnCpu]},
                {"cpu_rows", c.counts[offload::kCacheRowsOnCpu]},
                {"prefetch_accuracy", c.prefetch_accuracy()},
                {"host_to_device_bytes", c.host_to_device_bytes},
                {"stall_ms", c.stall_seconds * 1e3}};
  };
  report["summary"]["expert_cache"] =
      offloaded ? cache_entry(offload::summarize_cache(cache_counts, cache_bytes, cache_stall))
                : Json(nullptr);

  Json totals = Json::array();
  for (int64_t s = 0; s < S; ++s) {
    totals.push_back(
        {{"stage", stage_name(static_cast<Stage>(s))},
         {"total_ms", stage_total[s] * 1e-6},
         {"calls", stage_calls[s]},
         {"mean_us_per_step", stage_steps ? stage_total[s] * 1e-3 / stage_steps : 0.0},
         {"share", stage_wall > 0 ? stage_total[s] / stage_wall : 0.0}});
  }
  // Time inside a step that no stage claims: norms, residual adds, the embedding lookup, the
  // driver's own bookkeeping.
  totals.push_back(
      {{"stage", "other"},
       {"total_ms", (stage_wall - staged) * 1e-6},
       {"calls", 0},
       {"mean_us_per_step", stage_steps ? (stage_wall - staged) * 1e-3 / stage_steps : 0.0},
       {"share", stage_wall > 0 ? (stage_wall - staged) / stage_wall : 0.0}});
  report["totals"] = totals;

  Json layers = Json::array();
  for (int64_t l = 0; l < L; ++l) {
    Json stage_ms = Json::object();
    double layer_total = 0.0;
    for (int64_t s = 0; s < kNumLayerStages; ++s) {
      stage_ms[std::string(stage_name(static_cast<Stage>(s)))] = layer_stage_total[l * S + s] * 1e-6;
      layer_total += layer_stage_total[l * S + s];
    }
    const std::vector<int64_t> layer_load(load.begin() + l * E, load.begin() + (l + 1) * E);
    const int64_t assigned = std::accumulate(layer_load.begin(), layer_load.end(), int64_t{0});
    const double mean = E ? static_cast<double>(assigned) / E : 0.0;
    Json entry = {{"layer", l},
                  {"moe", static_cast<bool>(run.layer_is_moe[l])},
                  {"total_ms", layer_total * 1e-6},
                  {"stage_ms", stage_ms},
                  {"load", layer_load},
                  {"assignments", assigned}};
    if (run.layer_is_moe[l] && mean > 0.0) {
      const auto [lo, hi] = std::minmax_element(layer_load.begin(), layer_load.end());
      entry["max_over_mean"] = *hi / mean;
      entry["min_over_mean"] = *lo / mean;
      entry["unused_experts"] = std::count(layer_load.begin(), layer_load.end(), 0);
    }
    if (!routing.empty() && run.layer_is_moe[l]) {
      const LayerSummary& r = routing[l];
      Json pairs = Json::array();
      for (const auto& [a, b, count] : r.top_pairs) pairs.push_back({a, b, count});
      entry["top_pairs"] = pairs;
      entry["mean_reuse_distance"] = r.mean_reuse_distance;
      entry["reuse_within_1_step"] =
          r.reuse_samples ? static_cast<double>(r.reuse_within_1_step) / r.reuse_samples : 0.0;
    }
    if (offloaded && run.layer_is_moe[l]) {
      entry["expert_cache"] = cache_entry(offload::summarize_cache(
          std::span<const int64_t>(cache_counts).subspan(l * C, C),
          std::span<const int64_t>(cache_bytes).subspan(l, 1),
          std::span<const double>(cache_stall).subspan(l, 1)));
    }
    layers.push_back(entry);
  }
  report["layers"] = layers;
  report["steps"] = step_list;
  report["overhead"] = {{"repeats", overhead.repeats},
                        {"off_ms", overhead.off_ms},
                        {"on_ms", overhead.on_ms},
                        {"measured", overhead.measured},
                        {"off_cpu_ms", overhead.off_cpu_ms},
                        {"on_cpu_ms", overhead.on_cpu_ms},
                        {"measured_cpu", overhead.measured_cpu},
                        {"paired_steps", overhead.paired_steps},
                        {"paired_block", overhead.paired_block},
                        {"step_off_us", overhead.step_off_us},
                        {"step_on_us", overhead.step_on_us},
                        {"measured_step", overhead.measured_step},
                        {"scope_on_ns", overhead.scope_on_ns},
                        {"scope_off_ns", overhead.scope_off_ns},
                        {"scopes_per_step", overhead.scopes_per_step},
                        {"estimated", overhead.estimated}};
  return report;
}

std::string render_text_report(const Json& report) {
  const Json& run = report["run"];
  const Json& summary = report["summary"];
  std::string out;
  out += format("moeinfer profile: %s (%s), %lld layers, %lld experts, top-%lld\n",
                run["model"].get<std::string>().c_str(),
                run["model_type"].get<std::string>().c_str(), run["num_layers"].get<long long>(),
                run["num_experts"].get<long long>(), run["top_k"].get<long long>());
  out +=
      format("workload: batch %lld, %lld %s input tokens each, %lld decode steps, %lld threads\n",
             run["batch"].get<long long>(), run["input_len"].get<long long>(),
             run["tokens"].get<std::string>().c_str(), run["output_len"].get<long long>(),
             run["threads"].get<long long>());
  out += format(
      "time: %.2f ms in %lld steps; prefill %.2f ms (%.0f tok/s); decode %.3f ms per step "
      "(%.0f tok/s)\n",
      summary["total_ms"].get<double>(), summary["steps"].get<long long>(),
      summary["prefill_ms"].get<double>(), summary["prefill_tokens_per_s"].get<double>(),
      summary["decode_step_mean_ms"].get<double>(), summary["decode_tokens_per_s"].get<double>());
  out +=
      format("expert weights read: %s in all, %s per decode step; cache hits %lld, misses %lld\n",
             human_bytes(summary["expert_bytes_read"].get<double>()).c_str(),
             human_bytes(summary["expert_bytes_read_per_decode_step"].get<double>()).c_str(),
             summary["cache_hits"].get<long long>(), summary["cache_misses"].get<long long>());
  const Json& cache = summary["expert_cache"];
  if (!cache.is_null()) {
    out += format(
        "expert cache: %lld hits, %lld misses, %lld unplaced (read from host), %lld on the CPU "
        "(%lld rows); prefetch %lld, %.1f%% used; %s host to device, %.3f ms stalled\n",
        cache["hits"].get<long long>(), cache["misses"].get<long long>(),
        cache["unplaced"].get<long long>(), cache["cpu_experts"].get<long long>(),
        cache["cpu_rows"].get<long long>(), cache["prefetched"].get<long long>(),
        100.0 * cache["prefetch_accuracy"].get<double>(),
        human_bytes(cache["host_to_device_bytes"].get<double>()).c_str(),
        cache["stall_ms"].get<double>());
  }
  const Json& overhead = report["overhead"];
  out += format(
      "profiler overhead: %.3f%% of step time estimated (%.0f scopes per step x %.1f ns; %.2f ns "
      "each when off)\n",
      100.0 * overhead["estimated"].get<double>(), overhead["scopes_per_step"].get<double>(),
      overhead["scope_on_ns"].get<double>(), overhead["scope_off_ns"].get<double>());
  if (overhead["repeats"].get<int64_t>() > 0) {
    out += format(
        "  measured, best of %lld interleaved off/on runs: wall %+.2f%% (%.2f vs %.2f ms), "
        "driver-thread CPU %+.2f%% (%.2f vs %.2f ms)\n",
        overhead["repeats"].get<long long>(), 100.0 * overhead["measured"].get<double>(),
        overhead["off_ms"].get<double>(), overhead["on_ms"].get<double>(),
        100.0 * overhead["measured_cpu"].get<double>(), overhead["off_cpu_ms"].get<double>(),
        overhead["on_cpu_ms"].get<double>());
    out += format(
        "  measured, one decode step repeated %lld times each side in blocks of %lld, off and on "
        "alternating: %+.2f%% (median %.1f vs %.1f us)\n",
        overhead["paired_steps"].get<long long>(), overhead["paired_block"].get<long long>(),
        100.0 * overhead["measured_step"].get<double>(), overhead["step_off_us"].get<double>(),
        overhead["step_on_us"].get<double>());
  }

  const int64_t timed_steps = summary["timed_steps"].get<int64_t>();
  if (timed_steps == summary["steps"].get<int64_t>()) {
    out += "\nstages (all steps)\n";
  } else {
    out += format("\nstages (timed on %lld of %lld steps, one in %lld; %s)\n",
                  static_cast<long long>(timed_steps), summary["steps"].get<long long>(),
                  summary["time_every"].get<long long>(),
                  summary["stage_basis"].get<std::string>().c_str());
  }
  out += format("%-16s %12s %14s %8s\n", "stage", "total ms", "mean us/step", "share");
  std::vector<std::string> not_run;
  for (const Json& t : report["totals"]) {
    const std::string name = t["stage"].get<std::string>();
    if (t["total_ms"].get<double>() <= 0.0 && name != "other") {
      not_run.push_back(name);
      continue;
    }
    out += format("%-16s %12.3f %14.2f %7.1f%%\n", name.c_str(), t["total_ms"].get<double>(),
                  t["mean_us_per_step"].get<double>(), 100.0 * t["share"].get<double>());
  }
  if (!not_run.empty()) {
    std::string list;
    for (const std::string& n : not_run) list += (list.empty() ? "" : ", ") + n;
    out += "not run by this model: " + list + "\n";
  }

  // Per layer: mean microseconds per step of each layer stage that ran.
  const double steps = static_cast<double>(std::max<int64_t>(summary["stage_steps"].get<int64_t>(), 1));
  std::vector<std::string> columns;
  for (const Json& s : report["stages"]) {
    if (s["scope"] != "layer") continue;
    const std::string name = s["name"].get<std::string>();
    for (const Json& l : report["layers"]) {
      if (l["stage_ms"][name].get<double>() > 0.0) {
        columns.push_back(name);
        break;
      }
    }
  }
  out += "\nper layer, mean us per step\n";
  out += format("%5s", "layer");
  for (const std::string& c : columns) out += format(" %10.10s", c.c_str());
  out += format(" %10s %9s %7s\n", "total", "max/mean", "unused");
  for (const Json& l : report["layers"]) {
    out += format("%5lld", l["layer"].get<long long>());
    for (const std::string& c : columns) {
      out += format(" %10.2f", l["stage_ms"][c].get<double>() * 1e3 / steps);
    }
    out += format(" %10.2f", l["total_ms"].get<double>() * 1e3 / steps);
    if (l.contains("max_over_mean")) {
      out += format(" %9.2f %7lld\n", l["max_over_mean"].get<double>(),
                    l["unused_experts"].get<long long>());
    } else {
      out += format(" %9s %7s\n", "-", "-");
    }
  }

  out += "\nexpert load, assignments over all steps (layer: expert 0 ..)\n";
  for (const Json& l : report["layers"]) {
    if (!l["moe"].get<bool>()) continue;
    out += format("%5lld:", l["layer"].get<long long>());
    for (const Json& c : l["load"]) out += format(" %lld", c.get<long long>());
    out += "\n";
  }
  if (!cache.is_null()) {
    out += "\nexpert cache per layer\n";
    out += format("%5s %8s %8s %8s %8s %10s %9s %12s %10s\n", "layer", "hits", "misses",
                  "unplaced", "on cpu", "prefetched", "pf used", "to device", "stall ms");
    for (const Json& l : report["layers"]) {
      if (!l.contains("expert_cache")) continue;
      const Json& c = l["expert_cache"];
      out += format("%5lld %8lld %8lld %8lld %8lld %10lld %8.1f%% %12s %10.3f\n",
                    l["layer"].get<long long>(), c["hits"].get<long long>(),
                    c["misses"].get<long long>(), c["unplaced"].get<long long>(),
                    c["cpu_experts"].get<long long>(),
                    c["prefetched"].get<long long>(), 100.0 * c["prefetch_accuracy"].get<double>(),
                    human_bytes(c["host_to_device_bytes"].get<double>()).c_str(),
                    c["stall_ms"].get<double>());
    }
  }
  bool any_reuse = false;
  for (const Json& l : report["layers"]) any_reuse |= l.contains("mean_reuse_distance");
  if (any_reuse) {
    out += "\nrouting: most frequent expert pairs, reuse distance in steps\n";
    for (const Json& l : report["layers"]) {
      if (!l.contains("mean_reuse_distance")) continue;
      std::string pairs;
      for (const Json& p : l["top_pairs"]) {
        pairs += format("%s(%d,%d)x%lld", pairs.empty() ? "" : " ", p[0].get<int>(),
                        p[1].get<int>(), p[2].get<long long>());
      }
      out += format("%5lld: reuse %.2f steps, %.0f%% within 1 step; pairs %s\n",
                    l["layer"].get<long long>(), l["mean_reuse_distance"].get<double>(),
                    100.0 * l["reuse_within_1_step"].get<double>(), pairs.c_str());
    }
  }

  out += "\nper step\n";
  out += format("%5s %8s %7s %10s %10s %10s %12s\n", "step", "phase", "tokens", "wall us",
                "imb mean", "imb max", "expert bytes");
  for (const Json& s : report["steps"]) {
    auto number = [](const Json& x) {
      return x.is_number() ? format("%.2f", x.get<double>()) : "-";
    };
    out += format("%5lld %8s %7lld %10.1f %10s %10s %12s\n", s["step"].get<long long>(),
                  s["phase"].get<std::string>().c_str(), s["tokens"].get<long long>(),
                  s["wall_us"].get<double>(), number(s["imbalance_mean"]).c_str(),
                  number(s["imbalance_max"]).c_str(),
                  human_bytes(s["expert_bytes_read"].get<double>()).c_str());
  }
  return out;
}

}  // namespace moeinfer::profile
