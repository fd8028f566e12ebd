#include "python/reports.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "model/capacity_plan.h"
#include "model/model.h"
#include "parallel/placement.h"
#include "parallel/placement_planner.h"
#include "profile/routing_trace.h"
#include "runtime/expert_load.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace moeinfer::python {
namespace {

template <typename T>
nb::ndarray<nb::numpy, T> owned_array(std::vector<T>&& values,
                                      std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

std::string plan(const std::string& model, int64_t gpus, double gpu_mem_gib,
                 const std::string& dtype, const std::string& kv_dtype, int64_t max_seq_len,
                 double gpu_memory_fraction) {
  const ModelConfig config = plan_model_config(model);
  const PlanOptions options{.num_gpus = gpus,
                            .gpu_mem_gib = gpu_mem_gib,
                            .max_seq_len = max_seq_len,
                            .memory_fraction = gpu_memory_fraction};
  return capacity_plan_json(config, plan_capacity_named(config, options, dtype, kv_dtype)).dump();
}

// The report's JSON (layers without their counts) and the counts [num_moe_layers, E].
nb::tuple expert_load(const std::string& model, const std::string& text, int64_t draws,
                      uint64_t seed, int64_t chunk_tokens) {
  ExpertLoadReport report;
  {
    nb::gil_scoped_release release;
    const std::filesystem::path dir = model;
    auto loaded = Model::load(dir, LoadOptions{});
    const Tokenizer tokenizer = Tokenizer::from_dir(dir);
    const std::vector<int32_t> ids = tokenizer.encode(text, /*add_special_tokens=*/true);
    report = measure_expert_load(loaded->decoder(), ids,
                                 {.draws = draws, .seed = seed, .chunk_tokens = chunk_tokens});
  }
  nlohmann::ordered_json json = expert_load_json(report);
  std::vector<int64_t> counts;
  for (auto& layer : json["layers"]) layer.erase("counts");
  for (const ExpertLoadLayer& l : report.layers) {
    counts.insert(counts.end(), l.counts.begin(), l.counts.end());
  }
  return nb::make_tuple(
      json.dump(), owned_array(std::move(counts),
                               {report.layers.size(), static_cast<size_t>(report.num_experts)}));
}

// Rows each rank's experts would compute per layer ([L, N]) for expert loads counts [L, E] of
// the MoE layers `layers`: contiguous ranges, or the placement file's tables, a replicated
// expert's rows shared evenly by its replicas (as `moeinfer placement` predicts them).
nb::ndarray<nb::numpy, double> rank_rows(
    nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> counts,
    const std::vector<int64_t>& layers, int ranks, const std::string& placement_file) {
  const int64_t L = static_cast<int64_t>(counts.shape(0)),
                E = static_cast<int64_t>(counts.shape(1));
  MOE_CHECK(static_cast<int64_t>(layers.size()) == L, "rank_rows: ", layers.size(),
            " layer ids for ", L, " rows of counts");
  MOE_CHECK(ranks >= 1, "ranks must be >= 1, got ", ranks);
  MOE_CHECK(!placement_file.empty() || E >= ranks, E, " experts cannot cover ", ranks,
            " ranks in contiguous ranges; give a placement with replicas");
  const parallel::ExpertPlacement placement =
      placement_file.empty() ? parallel::ExpertPlacement(E, ranks)
                             : parallel::read_placement(placement_file, E, ranks, layers);
  const parallel::Topology topology = parallel::Topology::single_node(ranks);
  std::vector<double> rows;
  rows.reserve(static_cast<size_t>(L * ranks));
  for (int64_t i = 0; i < L; ++i) {
    const std::span<const int64_t> load(counts.data() + i * E, static_cast<size_t>(E));
    const parallel::LayerPrediction p =
        parallel::predict_layer(placement.layer(layers[i]), load, topology);
    rows.insert(rows.end(), p.rank_rows.begin(), p.rank_rows.end());
  }
  return owned_array(std::move(rows), {static_cast<size_t>(L), static_cast<size_t>(ranks)});
}

nb::dict read_trace(const std::string& path) {
  RoutingTrace trace;
  {
    nb::gil_scoped_release release;
    trace = read_routing_trace(path);
  }
  const size_t R = trace.records.size(), K = trace.top_k;
  std::vector<int64_t> step(R), layer(R), offsets(R + 1, 0);
  size_t tokens = 0;
  for (size_t i = 0; i < R; ++i) tokens += trace.records[i].num_tokens;
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;
  expert_ids.reserve(tokens * K);
  weights.reserve(tokens * K);
  for (size_t i = 0; i < R; ++i) {
    const TraceRecord& r = trace.records[i];
    step[i] = r.step;
    layer[i] = r.layer;
    offsets[i + 1] = offsets[i] + r.num_tokens;
    expert_ids.insert(expert_ids.end(), r.expert_ids.begin(), r.expert_ids.end());
    weights.insert(weights.end(), r.weights.begin(), r.weights.end());
  }
  nb::dict d;
  d["num_layers"] = trace.num_layers;
  d["num_experts"] = trace.num_experts;
  d["top_k"] = trace.top_k;
  d["step"] = owned_array(std::move(step), {R});
  d["layer"] = owned_array(std::move(layer), {R});
  d["token_offsets"] = owned_array(std::move(offsets), {R + 1});
  d["expert_ids"] = owned_array(std::move(expert_ids), {tokens, K});
  d["weights"] = owned_array(std::move(weights), {tokens, K});
  return d;
}

std::string summarize_trace(const std::string& path, int64_t pairs) {
  nb::gil_scoped_release release;
  const RoutingTrace trace = read_routing_trace(path);
  return routing_trace_summary_json(trace, summarize_routing_trace(trace, pairs)).dump();
}

}  // namespace

void bind_reports(nb::module_& m) {
  m.def("plan", &plan, "model"_a, "gpus"_a, "gpu_mem_gib"_a, "dtype"_a, "kv_dtype"_a,
        "max_seq_len"_a, "gpu_memory_fraction"_a,
        "The capacity plan of `moeinfer plan --json`, as JSON text");
  m.def("expert_load", &expert_load, "model"_a, "text"_a, "draws"_a, "seed"_a, "chunk_tokens"_a,
        "`moeinfer expert-load --json` of a text: (JSON text without the layers' counts, "
        "counts int64 [num_moe_layers, num_experts])");
  m.def("rank_rows", &rank_rows, "counts"_a, "layers"_a, "ranks"_a, "placement"_a,
        "Rows each rank's experts compute per layer, float64 [L, ranks], for counts [L, E]");
  m.def("read_routing_trace", &read_trace, "path"_a,
        "A --trace-routing file's records as NumPy arrays");
  m.def("summarize_routing_trace", &summarize_trace, "path"_a, "pairs"_a,
        "`moeinfer trace summarize --json` of a trace file, as JSON text");
}

}  // namespace moeinfer::python
