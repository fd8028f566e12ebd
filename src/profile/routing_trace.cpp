#include "profile/routing_trace.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>

#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer {
namespace {

constexpr char kMagic[8] = {'M', 'O', 'E', 'T', 'R', 'A', 'C', 'E'};
constexpr uint32_t kVersion = 1;

void write_u32(std::FILE* f, uint32_t v) { std::fwrite(&v, sizeof v, 1, f); }

}  // namespace

RoutingTraceWriter::RoutingTraceWriter(const std::filesystem::path& path, int64_t num_layers,
                                       int64_t num_experts, int64_t top_k)
    : path_(path.string()), top_k_(top_k) {
  MOE_CHECK(num_experts <= 65536, "routing traces store expert ids in 16 bits; ", num_experts,
            " experts do not fit");
  file_ = std::fopen(path_.c_str(), "wb");
  MOE_CHECK(file_ != nullptr, "cannot open ", path_, " for writing: ", std::strerror(errno));
  std::fwrite(kMagic, 1, sizeof kMagic, file_);
  write_u32(file_, kVersion);
  write_u32(file_, static_cast<uint32_t>(num_layers));
  write_u32(file_, static_cast<uint32_t>(num_experts));
  write_u32(file_, static_cast<uint32_t>(top_k));
}

RoutingTraceWriter::~RoutingTraceWriter() {
  if (file_) std::fclose(file_);
}

void RoutingTraceWriter::record(int64_t layer, const moe::Routing& routing) {
  MOE_CHECK(routing.top_k == top_k_, "trace expects top_k ", top_k_, ", routing has ",
            routing.top_k);
  const size_t n = static_cast<size_t>(routing.num_tokens * routing.top_k);
  write_u32(file_, step_);
  write_u32(file_, static_cast<uint32_t>(layer));
  write_u32(file_, static_cast<uint32_t>(routing.num_tokens));
  buffer_.resize(2 * n);
  for (size_t i = 0; i < n; ++i) {
    MOE_CHECK(routing.topk_ids[i] >= 0,
              "a routing trace holds all K experts of every token: record it without "
              "--active-experts, --drop-below and --expert-capacity, which drop some");
    buffer_[i] = static_cast<uint16_t>(routing.topk_ids[i]);
    buffer_[n + i] = f32_to_bf16(routing.topk_weights[i]);
  }
  const size_t written = std::fwrite(buffer_.data(), sizeof(uint16_t), 2 * n, file_);
  MOE_CHECK(written == 2 * n, "failed writing routing trace ", path_);
  ++records_;
}

RoutingTrace read_routing_trace(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in, "cannot open ", path.string(), ": ", std::strerror(errno));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t offset = 0;
  const auto take = [&](void* dst, size_t n, const char* what) {
    MOE_CHECK(offset + n <= bytes.size(), path.string(), ": truncated at byte ", offset,
              " while reading ", what);
    std::memcpy(dst, bytes.data() + offset, n);
    offset += n;
  };
  char magic[8];
  take(magic, sizeof magic, "the magic");
  MOE_CHECK(std::memcmp(magic, kMagic, sizeof kMagic) == 0, path.string(),
            ": not a moeinfer routing trace");
  uint32_t version = 0;
  RoutingTrace trace;
  take(&version, 4, "the version");
  MOE_CHECK(version == kVersion, path.string(), ": trace version ", version, " is not ", kVersion);
  take(&trace.num_layers, 4, "num_layers");
  take(&trace.num_experts, 4, "num_experts");
  take(&trace.top_k, 4, "top_k");
  MOE_CHECK(trace.top_k >= 1 && trace.top_k <= trace.num_experts, path.string(), ": top_k ",
            trace.top_k, " does not fit ", trace.num_experts, " experts");
  while (offset < bytes.size()) {
    TraceRecord r;
    take(&r.step, 4, "a record's step");
    take(&r.layer, 4, "a record's layer");
    take(&r.num_tokens, 4, "a record's token count");
    MOE_CHECK(r.layer < trace.num_layers, path.string(), ": layer ", r.layer, " at byte ",
              offset, " is not below num_layers ", trace.num_layers);
    const size_t n = static_cast<size_t>(r.num_tokens) * trace.top_k;
    MOE_CHECK(n <= (bytes.size() - offset) / 4, path.string(), ": record at byte ", offset,
              " claims ", r.num_tokens, " tokens, more than the file holds");
    r.expert_ids.resize(n);
    take(r.expert_ids.data(), 2 * n, "expert ids");
    std::vector<uint16_t> weights(n);
    take(weights.data(), 2 * n, "weights");
    for (uint16_t id : r.expert_ids) {
      MOE_CHECK(id < trace.num_experts, path.string(), ": expert id ", id, " out of range");
    }
    r.weights.resize(n);
    for (size_t i = 0; i < n; ++i) r.weights[i] = bf16_to_f32(weights[i]);
    trace.records.push_back(std::move(r));
  }
  return trace;
}

std::vector<LayerSummary> summarize_routing_trace(const RoutingTrace& trace, int64_t top_pairs) {
  const int64_t E = trace.num_experts;
  const int64_t K = trace.top_k;
  std::vector<LayerSummary> layers(trace.num_layers);
  std::vector<std::map<std::pair<int32_t, int32_t>, int64_t>> pairs(trace.num_layers);
  // Last step each (layer, expert) was picked in, -1 before the first pick.
  std::vector<std::vector<int64_t>> last_step(trace.num_layers, std::vector<int64_t>(E, -1));
  std::vector<double> reuse_sum(trace.num_layers, 0.0);
  for (auto& s : layers) s.load.assign(E, 0);
  for (size_t l = 0; l < layers.size(); ++l) layers[l].layer = static_cast<int64_t>(l);

  for (const TraceRecord& r : trace.records) {
    LayerSummary& s = layers[r.layer];
    s.tokens += r.num_tokens;
    std::vector<bool> picked(E, false);
    for (uint32_t t = 0; t < r.num_tokens; ++t) {
      const uint16_t* ids = r.expert_ids.data() + t * K;
      for (int64_t a = 0; a < K; ++a) {
        if (ids[a] == kDroppedTraceId) continue;
        ++s.load[ids[a]];
        picked[ids[a]] = true;
        for (int64_t b = a + 1; b < K; ++b) {
          if (ids[b] == kDroppedTraceId) continue;
          const int32_t x = ids[a], y = ids[b];
          ++pairs[r.layer][{std::min(x, y), std::max(x, y)}];
        }
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      if (!picked[e]) continue;
      int64_t& last = last_step[r.layer][e];
      if (last >= 0 && static_cast<int64_t>(r.step) > last) {
        const int64_t distance = static_cast<int64_t>(r.step) - last;
        reuse_sum[r.layer] += static_cast<double>(distance);
        ++s.reuse_samples;
        if (distance == 1) ++s.reuse_within_1_step;
      }
      last = r.step;
    }
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    LayerSummary& s = layers[l];
    const int64_t total = std::accumulate(s.load.begin(), s.load.end(), int64_t{0});
    const double mean = static_cast<double>(total) / static_cast<double>(E);
    s.max_over_mean = total > 0 ? *std::max_element(s.load.begin(), s.load.end()) / mean : 0.0;
    s.unused_experts = std::count(s.load.begin(), s.load.end(), 0);
    s.mean_reuse_distance = s.reuse_samples > 0 ? reuse_sum[l] / s.reuse_samples : 0.0;
    std::vector<std::tuple<int32_t, int32_t, int64_t>> all;
    for (const auto& [key, count] : pairs[l]) all.emplace_back(key.first, key.second, count);
    std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) {
      return std::get<2>(a) > std::get<2>(b) ||
             (std::get<2>(a) == std::get<2>(b) && std::tie(std::get<0>(a), std::get<1>(a)) <
                                                      std::tie(std::get<0>(b), std::get<1>(b)));
    });
    if (static_cast<int64_t>(all.size()) > top_pairs) all.resize(top_pairs);
    s.top_pairs = std::move(all);
  }
  return layers;
}

std::map<int64_t, std::vector<int64_t>> expert_load_per_layer(const RoutingTrace& trace) {
  std::map<int64_t, std::vector<int64_t>> loads;
  for (const TraceRecord& r : trace.records) {
    auto& load = loads.try_emplace(r.layer, trace.num_experts, 0).first->second;
    for (uint16_t e : r.expert_ids) ++load[e];  // [num_tokens, top_k]
  }
  return loads;
}

nlohmann::ordered_json routing_trace_summary_json(const RoutingTrace& trace,
                                                  const std::vector<LayerSummary>& layers) {
  nlohmann::ordered_json out = {{"num_layers", trace.num_layers},
                                {"num_experts", trace.num_experts},
                                {"top_k", trace.top_k},
                                {"records", trace.records.size()},
                                {"layers", nlohmann::ordered_json::array()}};
  for (const LayerSummary& s : layers) {
    if (s.tokens == 0) continue;
    nlohmann::ordered_json pairs = nlohmann::ordered_json::array();
    for (const auto& [a, b, count] : s.top_pairs) pairs.push_back({a, b, count});
    out["layers"].push_back({{"layer", s.layer},
                             {"tokens", s.tokens},
                             {"load", s.load},
                             {"max_over_mean", s.max_over_mean},
                             {"unused_experts", s.unused_experts},
                             {"top_pairs", pairs},
                             {"mean_reuse_distance", s.mean_reuse_distance},
                             {"reuse_next_step_fraction",
                              s.reuse_samples ? static_cast<double>(s.reuse_within_1_step) /
                                                    static_cast<double>(s.reuse_samples)
                                              : 0.0}});
  }
  return out;
}

}  // namespace moeinfer
