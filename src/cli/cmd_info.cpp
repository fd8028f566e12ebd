// `moeinfer info --model DIR [--json] [--device cuda]`: total, active-per-token and resident
// sizes by part; with --device cuda also the GPU memory the model takes there (weights as
// uploaded, workspace, and the KV pool that the rest of --gpu-memory-fraction holds).
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/model_arg.h"
#include "model/gpu_decoder.h"
#include "model/family.h"
#include "model/model_facts.h"

namespace moeinfer::cli {
namespace {

std::string human(double value, const char* unit) {
  const char* prefixes[] = {"", "K", "M", "G", "T"};
  int i = 0;
  while (value >= 1000.0 && i < 4) {
    value /= 1000.0;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s%s", value, prefixes[i], unit);
  return buf;
}

void print_table(const ModelConfig& config, const ModelFacts& f) {
  std::printf("model_type %s: %lld layers, %lld experts, top-%lld, hidden %lld, vocab %lld\n",
              config.model_type.c_str(), static_cast<long long>(config.num_layers),
              static_cast<long long>(config.num_experts),
              static_cast<long long>(config.num_experts_per_tok),
              static_cast<long long>(config.hidden_size),
              static_cast<long long>(config.vocab_size));
  if (config.has_vision_tower) {
    std::printf("vision tower: not loaded (%s of checkpoint tensors unread); text inputs only\n",
                human(f.checkpoint_tensor_bytes - f.resident_bytes.total(), "B").c_str());
  }
  std::printf("%-16s %16s %16s %16s\n", "part", "params total", "params active", "resident");
  const struct {
    const char* name;
    int64_t PartCounts::*field;
  } rows[] = {{"attention", &PartCounts::attention},
              {"routed experts", &PartCounts::routed_experts},
              {"shared experts", &PartCounts::shared_experts},
              {"embeddings", &PartCounts::embeddings},
              {"other", &PartCounts::other}};
  for (const auto& row : rows) {
    std::printf("%-16s %16s %16s %16s\n", row.name, human(f.total_params.*row.field, "").c_str(),
                human(f.active_params.*row.field, "").c_str(),
                human(f.resident_bytes.*row.field, "B").c_str());
  }
  std::printf("%-16s %16s %16s %16s\n", "total", human(f.total_params.total(), "").c_str(),
              human(f.active_params.total(), "").c_str(),
              human(f.resident_bytes.total(), "B").c_str());
  std::printf("KV cache per token: %s (float32), %s (bf16), %s (fp8 with a scale per head)\n",
              human(f.kv_bytes_per_token_f32, "B").c_str(),
              human(f.kv_bytes_per_token_bf16, "B").c_str(),
              human(f.kv_bytes_per_token_fp8, "B").c_str());
}

nlohmann::ordered_json gpu_memory_json(const GpuMemoryReport& m) {
  return {{"device", m.device_name},          {"device_bytes", m.device_bytes},
          {"budget_bytes", m.budget_bytes},   {"weight_bytes", m.weight_bytes},
          {"workspace_bytes", m.workspace_bytes}, {"kv_bytes", m.kv_bytes},
          {"kv_bytes_per_token", m.kv_bytes_per_token}, {"num_kv_blocks", m.num_kv_blocks},
          {"block_size", m.block_size},
          {"kv_tokens", m.num_kv_blocks * m.block_size},
          {"state_bytes", m.state_bytes}, {"num_state_slots", m.num_state_slots}};
}

void print_gpu_memory(const GpuMemoryReport& m) {
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  std::printf("GPU %s: %.2f GiB, budget %.2f GiB\n", m.device_name.c_str(), m.device_bytes / GiB,
              m.budget_bytes / GiB);
  std::printf("  weights    %10.3f GiB\n", m.weight_bytes / GiB);
  std::printf("  workspace  %10.3f GiB\n", m.workspace_bytes / GiB);
  std::printf("  KV pool    %10.3f GiB  (%lld blocks x %lld tokens = %lld tokens, %lld B/token)\n",
              m.kv_bytes / GiB, static_cast<long long>(m.num_kv_blocks),
              static_cast<long long>(m.block_size),
              static_cast<long long>(m.num_kv_blocks * m.block_size),
              static_cast<long long>(m.kv_bytes_per_token));
  if (m.num_state_slots > 0) {  // linear-attention layers' recurrent state, a slot per sequence
    std::printf("  state      %10.3f GiB  (%lld sequences x %lld B)\n", m.state_bytes / GiB,
                static_cast<long long>(m.num_state_slots),
                static_cast<long long>(m.state_bytes_per_slot));
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Parameters (total, active per token) and resident bytes");
  auto model = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto device = std::make_shared<DeviceArgs>();
  add_model_option(cmd, model.get());
  cmd->add_flag("--json", *as_json, "Print JSON");
  add_device_options(cmd, device.get());
  cmd->callback([=] {
    const auto dir = resolve_model_dir(*model);
    const ModelConfig config = load_model_config(dir / "config.json");
    const WeightStore store = WeightStore::open(dir);
    WeightSource source(store, config);
    DecoderWeights weights = bind_weights(config, source);
    weights.quantized = &source.quantized();  // the GPU's report counts quantised experts
    const ModelFacts facts =
        model_facts(config, weights, static_cast<int64_t>(store.total_bytes()));
    std::unique_ptr<GpuDecoder> gpu;
    if (device->is_cuda()) {
      gpu = GpuDecoder::create(config, weights,
                               GpuOptions{.weight_dtype = device->weight_dtype(),
                                          .gpu_memory_fraction = device->gpu_memory_fraction});
    }
    if (*as_json) {
      nlohmann::ordered_json out = facts_to_json(config, facts);
      if (gpu) out["gpu_memory"] = gpu_memory_json(gpu->memory());
      std::printf("%s\n", out.dump(2).c_str());
    } else {
      print_table(config, facts);
      if (gpu) print_gpu_memory(gpu->memory());
    }
  });
}

}  // namespace moeinfer::cli
