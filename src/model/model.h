// A loaded checkpoint: validated config, memory-mapped weights bound by name, and the forward
// pass. Weights are used in place from the map; nothing is copied to float32 but small vectors.
#pragma once

#include <filesystem>
#include <memory>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "model/decoder.h"
#include "model/weight_quant.h"
#include "model/weight_source.h"

namespace moeinfer {

struct LoadOptions {
  bool prefault = true;  // touch every page at load (with a progress bar when slow)
  // --weights: the routed experts quantised at load (model/weight_quant.h); the CPU decoder then
  // computes with the quantised values, the GPU with their codes. Refused on an already
  // quantised checkpoint (fp8, int4).
  WeightFormat expert_weights = WeightFormat::kCheckpoint;
  // --weights-scope linear: every dense Linear quantised too (quantize_linear_weights); needs
  // expert_weights fp8 or int4.
  WeightScope weight_scope = WeightScope::kExperts;
};

class Model {
 public:
  static std::unique_ptr<Model> load(const std::filesystem::path& dir, const LoadOptions& options);

  const ModelConfig& config() const { return decoder_->config(); }
  const WeightStore& store() const { return store_; }
  Decoder& decoder() { return *decoder_; }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  Model(std::filesystem::path dir, WeightStore store) : dir_(std::move(dir)), store_(std::move(store)) {}

  std::filesystem::path dir_;
  WeightStore store_;
  std::unique_ptr<WeightSource> source_;  // owns dequantised matrices and their codes
  std::unique_ptr<Decoder> decoder_;
};

}  // namespace moeinfer
