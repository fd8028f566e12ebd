#include "parallel/placement.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "parallel/json_file.h"

namespace moeinfer::parallel {

LayerPlacement::LayerPlacement(int64_t num_experts, std::vector<std::vector<int32_t>> slots)
    : num_experts_(num_experts), slots_(std::move(slots)) {
  MOE_CHECK(num_experts >= 1, "a placement of ", num_experts, " experts");
  MOE_CHECK(!slots_.empty(), "a placement over no ranks");
  replicas_.assign(static_cast<size_t>(num_experts), {});
  for (size_t r = 0; r < slots_.size(); ++r) {
    MOE_CHECK(!slots_[r].empty(), "rank ", r, " holds no expert; every rank needs one at least");
    for (int32_t e : slots_[r]) {
      MOE_CHECK(e >= 0 && e < num_experts, "rank ", r, " holds expert ", e, ", outside [0, ",
                num_experts, ")");
      auto& holders = replicas_[static_cast<size_t>(e)];
      MOE_CHECK(holders.empty() || holders.back() != static_cast<int32_t>(r), "rank ", r,
                " holds expert ", e, " twice");
      holders.push_back(static_cast<int32_t>(r));
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    MOE_CHECK(!replicas_[static_cast<size_t>(e)].empty(), "expert ", e,
              " is on no rank; every expert needs one replica at least");
  }
}

LayerPlacement LayerPlacement::contiguous(int64_t num_experts, int num_ranks) {
  MOE_CHECK(num_ranks >= 1, "expert placement over ", num_ranks, " ranks");
  MOE_CHECK(num_experts >= num_ranks, "expert parallelism over ", num_ranks, " ranks needs at ",
            "least one routed expert per rank; the model has ", num_experts);
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(num_ranks));
  const int64_t base = num_experts / num_ranks, extra = num_experts % num_ranks;
  int32_t next = 0;
  for (int r = 0; r < num_ranks; ++r) {
    for (int64_t i = 0; i < base + (r < extra ? 1 : 0); ++i) slots[r].push_back(next++);
  }
  return LayerPlacement(num_experts, std::move(slots));
}

int32_t LayerPlacement::slot_of(int rank, int64_t expert) const {
  const auto& s = slots_[static_cast<size_t>(rank)];
  const auto it = std::find(s.begin(), s.end(), static_cast<int32_t>(expert));
  return it == s.end() ? -1 : static_cast<int32_t>(it - s.begin());
}

int64_t LayerPlacement::total_slots() const {
  int64_t n = 0;
  for (const auto& s : slots_) n += static_cast<int64_t>(s.size());
  return n;
}

ExpertPlacement::ExpertPlacement(int64_t num_experts, int num_ranks)
    : default_(LayerPlacement::contiguous(num_experts, num_ranks)) {}

ExpertPlacement::ExpertPlacement(LayerPlacement every_layer,
                                 std::map<int64_t, LayerPlacement> per_layer)
    : default_(std::move(every_layer)), per_layer_(std::move(per_layer)) {
  for (const auto& [l, p] : per_layer_) {
    MOE_CHECK(p.num_ranks() == default_.num_ranks() && p.num_experts() == default_.num_experts(),
              "layer ", l, "'s placement is of ", p.num_experts(), " experts over ", p.num_ranks(),
              " ranks, the others' of ", default_.num_experts(), " over ", default_.num_ranks());
  }
}

const LayerPlacement& ExpertPlacement::layer(int64_t layer) const {
  const auto it = per_layer_.find(layer);
  return it == per_layer_.end() ? default_ : it->second;
}

namespace {

constexpr const char* kFormat = "moeinfer-placement";

LayerPlacement parse_table(const nlohmann::json& ranks, int64_t num_experts, int num_ranks,
                           const std::string& where) {
  MOE_CHECK(ranks.is_array(), where, ": \"ranks\" must be an array of ", num_ranks,
            " arrays of expert ids");
  MOE_CHECK(static_cast<int64_t>(ranks.size()) == num_ranks, where, ": \"ranks\" has ",
            ranks.size(), " entries; the job has ", num_ranks, " ranks");
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) {
    const nlohmann::json& list = ranks[static_cast<size_t>(r)];
    MOE_CHECK(list.is_array(), where, ": rank ", r, "'s entry must be an array of expert ids");
    for (const nlohmann::json& e : list) {
      MOE_CHECK(e.is_number_integer(), where, ": rank ", r, " lists ", e.dump(),
                ", not an expert id");
      const int64_t id = e.get<int64_t>();
      MOE_CHECK(id >= 0 && id < num_experts, where, ": rank ", r, " lists expert ", id,
                "; the model's experts are [0, ", num_experts, ")");
      slots[r].push_back(static_cast<int32_t>(id));
    }
  }
  try {
    return LayerPlacement(num_experts, std::move(slots));
  } catch (const Error& e) {
    MOE_CHECK(false, where, ": ", e.what());
  }
  return {};
}

int64_t integer_field(const nlohmann::json& j, const char* key, const std::string& file) {
  MOE_CHECK(j.contains(key) && j[key].is_number_integer(), file, ": needs an integer \"", key,
            "\"");
  return j[key].get<int64_t>();
}

}  // namespace

ExpertPlacement read_placement(const std::filesystem::path& path, int64_t num_experts,
                               int num_ranks, std::span<const int64_t> moe_layers) {
  const std::string file = "placement file " + path.string();
  const nlohmann::json j = read_json_file(path, file);
  MOE_CHECK(j.is_object(), file, ": must be a JSON object");
  MOE_CHECK(j.contains("format") && j["format"] == kFormat, file, ": \"format\" must be \"",
            kFormat, "\"");
  MOE_CHECK(integer_field(j, "version", file) == 1, file, ": version ", j["version"].dump(),
            " is not supported (1 is)");
  const int64_t experts = integer_field(j, "num_experts", file);
  MOE_CHECK(experts == num_experts, file, ": is for ", experts,
            " experts per layer; the model has ", num_experts);
  const int64_t ranks = integer_field(j, "num_ranks", file);
  MOE_CHECK(ranks == num_ranks, file, ": is for ", ranks, " ranks; the job has ", num_ranks);
  for (const auto& [key, value] : j.items()) {
    MOE_CHECK(key == "format" || key == "version" || key == "num_experts" || key == "num_ranks" ||
                  key == "ranks" || key == "layers" || key == "predicted",
              file, ": unknown field \"", key, "\"");
  }
  MOE_CHECK(j.contains("ranks") != j.contains("layers"), file,
            ": needs either \"ranks\" (one table for every layer) or \"layers\", not ",
            j.contains("ranks") ? "both" : "neither");
  if (j.contains("ranks")) {
    return ExpertPlacement(parse_table(j["ranks"], num_experts, num_ranks, file), {});
  }
  const nlohmann::json& layers = j["layers"];
  MOE_CHECK(layers.is_array(), file, ": \"layers\" must be an array");
  std::map<int64_t, LayerPlacement> tables;
  for (const nlohmann::json& entry : layers) {
    MOE_CHECK(entry.is_object(), file, ": each entry of \"layers\" must be an object");
    const int64_t l = integer_field(entry, "layer", file);
    const std::string where = file + " layer " + std::to_string(l);
    MOE_CHECK(std::find(moe_layers.begin(), moe_layers.end(), l) != moe_layers.end(), where,
              ": the model has no MoE layer ", l);
    MOE_CHECK(!tables.contains(l), where, ": listed twice");
    MOE_CHECK(entry.contains("ranks"), where, ": needs \"ranks\"");
    tables.emplace(l, parse_table(entry["ranks"], num_experts, num_ranks, where));
  }
  for (int64_t l : moe_layers) {
    MOE_CHECK(tables.contains(l), file, ": has no table for MoE layer ", l);
  }
  MOE_CHECK(!tables.empty(), file, ": \"layers\" lists no layer");
  // Every MoE layer has its table; the default serves no layer, and a contiguous one would
  // need at least as many experts as ranks, which replicas do not.
  LayerPlacement every_layer = tables.begin()->second;
  return ExpertPlacement(std::move(every_layer), std::move(tables));
}

std::string placement_json(const std::map<int64_t, LayerPlacement>& layers) {
  MOE_CHECK(!layers.empty(), "a placement file of no layers");
  const LayerPlacement& first = layers.begin()->second;
  nlohmann::ordered_json j;
  j["format"] = kFormat;
  j["version"] = 1;
  j["num_experts"] = first.num_experts();
  j["num_ranks"] = first.num_ranks();
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const auto& [l, p] : layers) {
    MOE_CHECK(p.num_experts() == first.num_experts() && p.num_ranks() == first.num_ranks(),
              "layer ", l, "'s placement differs in experts or ranks from the others'");
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (int r = 0; r < p.num_ranks(); ++r) {
      const auto s = p.slots(r);
      ranks.push_back(std::vector<int32_t>(s.begin(), s.end()));
    }
    list.push_back({{"layer", l}, {"ranks", std::move(ranks)}});
  }
  j["layers"] = std::move(list);
  return j.dump(1) + "\n";
}

void write_placement(const std::filesystem::path& path,
                     const std::map<int64_t, LayerPlacement>& layers) {
  const std::string text = placement_json(layers);
  std::ofstream out(path);
  MOE_CHECK(out.good(), "cannot write the placement file ", path.string());
  out << text;
  MOE_CHECK(out.good(), "writing the placement file ", path.string(), " failed");
}

}  // namespace moeinfer::parallel
