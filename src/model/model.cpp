#include "model/model.h"

#include "core/error.h"
#include "model/family.h"

namespace moeinfer {

std::unique_ptr<Model> Model::load(const std::filesystem::path& dir, const LoadOptions& options) {
  MOE_CHECK(std::filesystem::is_directory(dir), "model folder ", dir.string(), " does not exist");
  ModelConfig config = load_model_config(dir / "config.json");
  std::unique_ptr<Model> model(new Model(dir, WeightStore::open(dir)));
  check_weight_format(options.expert_weights, config, /*cuda=*/false);
  check_weight_scope(options.expert_weights, options.weight_scope);
  model->source_ = std::make_unique<WeightSource>(model->store_, config);
  DecoderWeights weights = bind_weights(config, *model->source_);
  quantize_routed_experts(options.expert_weights, weights, *model->source_);
  if (options.weight_scope == WeightScope::kLinear) {
    quantize_linear_weights(options.expert_weights, weights, *model->source_);
  }
  weights.quantized = &model->source_->quantized();
  if (options.prefault) model->store_.prefault();
  model->decoder_ = std::make_unique<Decoder>(config, std::move(weights));
  return model;
}

}  // namespace moeinfer
