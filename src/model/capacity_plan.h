// The capacity planner: from a config alone, how many bytes the weights take by part at a given
// dtype, how many bytes one token of KV cache takes (MLA-aware), how many tokens of KV fit in
// the GPUs' memory, and which layout to run (one GPU, or offloading with an expert budget; expert
// parallelism over GPUs is shown but not recommended until the GPU path has it), with the
// arithmetic shown and the flags that run it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/model_config.h"
#include "model/model_facts.h"

namespace moeinfer {

enum class WeightDType { kBF16, kFP8 };

struct PlanOptions {
  int64_t num_gpus = 1;
  double gpu_mem_gib = 80.0;
  WeightDType weight_dtype = WeightDType::kBF16;
  KvDType kv_dtype = KvDType::kBF16;
  int64_t max_seq_len = 0;          // 0: the model's max_position_embeddings
  double memory_fraction = 0.9;     // of each GPU the engine may use
  double workspace_gib = 2.0;       // activations and scratch per GPU
};

enum class Layout { kSingleGpu, kExpertParallel, kOffload };

struct CapacityPlan {
  PartCounts weight_bytes;            // resident bytes by part at the weight dtype
  int64_t kv_bytes_per_token = 0;     // all layers with a KV cache
  // Linear-attention layers' recurrent state (conv windows and delta-rule states), float32, per
  // sequence whatever its length; 0 for models without such layers.
  int64_t state_bytes_per_sequence = 0;
  int64_t max_seq_len = 0;
  Layout layout = Layout::kSingleGpu;
  int64_t gpus_used = 1;
  double weight_bytes_per_gpu = 0.0;
  int64_t kv_tokens_fit = 0;          // over all GPUs used
  int64_t full_length_sequences = 0;  // sequences of max_seq_len that fit at once
  // Offload: routed experts per MoE layer that stay on the GPUs (the rest live in host memory).
  int64_t gpu_experts_per_layer = 0;
  // Offload: the bytes of routed experts each GPU's cache holds (whole experts, whole MiB), and
  // the --expert-budget value that asks for them.
  int64_t expert_budget_bytes = 0;
  std::string expert_budget_flag;
  // The flags that run this layout (`moeinfer serve|generate|bench ...`).
  std::string run_flags;
  std::vector<std::string> arithmetic;  // the steps, one line each
};

CapacityPlan plan_capacity(const ModelConfig& config, const PlanOptions& options);
std::string layout_name(Layout layout);
// Bytes per parameter of each part at a weight dtype: fp8 is every Linear matrix (dense MLP
// layers included) at a byte a value plus a float32 scale per 128 inputs of a row, what the GPU
// holds under --weights fp8 --weights-scope linear (gpu::device_weight_bytes).
PartCounts weight_bytes_by_part(const ModelConfig& config, WeightDType dtype);

// `moeinfer plan` and the Python API's moeinfer.plan(), one function each:
// The config of `model`: a checkpoint folder (its config.json) or synthetic:NAME.
ModelConfig plan_model_config(const std::string& model);
// The plan with the dtypes named: dtype "bf16" or "fp8" (empty: the checkpoint's own), kv_dtype
// "bf16", "fp8" or "f32"; throws naming a bad one.
struct NamedPlan {
  PlanOptions options;
  std::string weight_dtype, kv_dtype;
  CapacityPlan plan;
};
NamedPlan plan_capacity_named(const ModelConfig& config, PlanOptions options,
                              const std::string& dtype, const std::string& kv_dtype);
// Every figure of the plan (bytes, tokens, layout, flags, the arithmetic's lines) as JSON.
nlohmann::ordered_json capacity_plan_json(const ModelConfig& config, const NamedPlan& named);

}  // namespace moeinfer
