// Where the routed experts of each MoE layer live under expert parallelism: for every rank, the
// logical experts whose weights it holds (its slots). A logical expert may have several physical
// replicas on different ranks; the dispatcher then spreads that expert's rows over them. Every
// logical expert has at least one replica; a rank holds an expert at most once.
//
// File (JSON, written by `moeinfer placement`, read with --placement FILE):
//   {"format": "moeinfer-placement", "version": 1, "num_experts": E, "num_ranks": N,
//    "layers": [{"layer": L, "ranks": [[e, ...], ...N lists]}, ...]}
// L is the decoder layer index (as in routing traces). A file may instead give one table for
// every layer: {"format": ..., "version": 1, "num_experts": E, "num_ranks": N, "ranks": [...]}.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace moeinfer::parallel {

// One layer's table.
class LayerPlacement {
 public:
  LayerPlacement() = default;
  // slots[r]: rank r's logical experts; validated (see the file comment), errors name the rank
  // and the expert.
  LayerPlacement(int64_t num_experts, std::vector<std::vector<int32_t>> slots);
  // Contiguous ranges, the first E % N ranks one more; no replicas.
  static LayerPlacement contiguous(int64_t num_experts, int num_ranks);

  int num_ranks() const { return static_cast<int>(slots_.size()); }
  int64_t num_experts() const { return num_experts_; }
  // Rank r's logical experts, in the order they hold them.
  std::span<const int32_t> slots(int rank) const { return slots_[rank]; }
  // The ranks holding logical expert e, ascending.
  std::span<const int32_t> replicas(int64_t expert) const { return replicas_[expert]; }
  // Rank r's slot index of expert e, or -1 when r does not hold it.
  int32_t slot_of(int rank, int64_t expert) const;
  int64_t total_slots() const;

 private:
  int64_t num_experts_ = 0;
  std::vector<std::vector<int32_t>> slots_;     // [N][slots of r]
  std::vector<std::vector<int32_t>> replicas_;  // [E][ranks holding e]
};

// Tables of every MoE layer; a layer without its own table uses the default one.
class ExpertPlacement {
 public:
  // Every layer contiguous.
  ExpertPlacement(int64_t num_experts, int num_ranks);
  ExpertPlacement(LayerPlacement every_layer, std::map<int64_t, LayerPlacement> per_layer);

  int num_ranks() const { return default_.num_ranks(); }
  int64_t num_experts() const { return default_.num_experts(); }
  const LayerPlacement& layer(int64_t layer) const;
  const std::map<int64_t, LayerPlacement>& per_layer() const { return per_layer_; }
  const LayerPlacement& every_layer() const { return default_; }

 private:
  LayerPlacement default_;
  std::map<int64_t, LayerPlacement> per_layer_;
};

// Reads and validates a placement file; errors name the file and the field. A file with per-layer
// tables must list every layer in `moe_layers` (and no other), with num_experts and num_ranks as
// given.
ExpertPlacement read_placement(const std::filesystem::path& path, int64_t num_experts,
                               int num_ranks, std::span<const int64_t> moe_layers);
// The file for per-layer tables (layer index -> table), all of E experts over N ranks.
void write_placement(const std::filesystem::path& path,
                     const std::map<int64_t, LayerPlacement>& layers);
std::string placement_json(const std::map<int64_t, LayerPlacement>& layers);

}  // namespace moeinfer::parallel
