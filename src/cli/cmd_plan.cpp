// `moeinfer plan --model DIR|synthetic:NAME --gpus N --gpu-mem GiB [--dtype bf16|fp8]
// [--kv-dtype bf16|fp8|f32] [--max-seq-len L] [--json]`: weights by part, KV bytes per token,
// how much KV fits, and the layout to run, with the arithmetic shown.
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "model/capacity_plan.h"
#include "model/gpu_decoder.h"
#include "model/synthetic.h"

namespace moeinfer::cli {
namespace {

struct PlanArgs {
  std::string model;
  PlanOptions options;
  std::string dtype;     // empty: the checkpoint's own
  std::string kv_dtype = "bf16";
  bool json = false;
};

void run_plan(const PlanArgs& args) {
  const ModelConfig config = plan_model_config(
      is_synthetic_model(args.model) ? args.model : resolve_model_dir(args.model).string());
  const NamedPlan named = plan_capacity_named(config, args.options, args.dtype, args.kv_dtype);
  if (args.json) {
    std::printf("%s\n", capacity_plan_json(config, named).dump(2).c_str());
    return;
  }
  const CapacityPlan& plan = named.plan;
  const PartCounts& w = plan.weight_bytes;
  const std::string& dtype = named.weight_dtype;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::printf("%s, weights in %s, KV in %s\n", config.model_type.c_str(), dtype.c_str(),
              args.kv_dtype.c_str());
  std::printf("  %-16s %10.2f GiB\n", "attention", w.attention / gib);
  std::printf("  %-16s %10.2f GiB\n", "routed experts", w.routed_experts / gib);
  std::printf("  %-16s %10.2f GiB\n", "shared experts", w.shared_experts / gib);
  std::printf("  %-16s %10.2f GiB\n", "embeddings", w.embeddings / gib);
  std::printf("  %-16s %10.2f GiB\n", "other", w.other / gib);
  std::printf("  %-16s %10.2f GiB\n", "total", w.total() / gib);
  std::printf("KV cache: %lld bytes per token%s\n", static_cast<long long>(plan.kv_bytes_per_token),
              config.mla ? " (MLA: latent + rope key only)" : "");
  if (plan.state_bytes_per_sequence > 0) {
    std::printf("recurrent state: %lld bytes per sequence (%lld linear-attention layers)\n",
                static_cast<long long>(plan.state_bytes_per_sequence),
                static_cast<long long>(config.num_linear_layers()));
  }
  for (const std::string& step : plan.arithmetic) std::printf("  %s\n", step.c_str());
  // A model the GPU decoder refuses gets the GPU layout as sizing only (its run flags say cpu).
  const bool gpu_runs_it = !gpu_unsupported(config).has_value();
  std::printf("%s: %s", gpu_runs_it ? "recommended" : "on GPUs, once supported",
              layout_name(plan.layout).c_str());
  if (plan.layout == Layout::kExpertParallel) {
    std::printf(" over %lld GPUs", static_cast<long long>(plan.gpus_used));
  } else if (plan.layout == Layout::kOffload) {
    std::printf(" with %lld of %lld experts per layer on the GPU",
                static_cast<long long>(plan.gpu_experts_per_layer),
                static_cast<long long>(config.num_experts));
  }
  std::printf("; %lld tokens of KV fit (%lld sequences of %lld)\n",
              static_cast<long long>(plan.kv_tokens_fit),
              static_cast<long long>(plan.full_length_sequences),
              static_cast<long long>(plan.max_seq_len));
  std::printf("run with: moeinfer serve %s\n", plan.run_flags.c_str());
  if (args.options.num_gpus > plan.gpus_used) {
    std::printf("note: %lld of the %lld GPUs stay idle: GPU expert parallelism is not built; "
                "CPU ranks shard experts with `mpirun -np N moeinfer serve --ep N`\n",
                static_cast<long long>(args.options.num_gpus - plan.gpus_used),
                static_cast<long long>(args.options.num_gpus));
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "Capacity planner: memory by part, KV that fits, layout");
  auto args = std::make_shared<PlanArgs>();
  cmd->add_option("--model", args->model, "Checkpoint folder or synthetic:NAME (default: built-in)");
  cmd->add_option("--gpus", args->options.num_gpus, "GPUs")->capture_default_str();
  cmd->add_option("--gpu-mem", args->options.gpu_mem_gib, "Memory per GPU in GiB")
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Weight dtype: bf16 or fp8 (default: the checkpoint's)");
  cmd->add_option("--kv-dtype", args->kv_dtype, "KV cache dtype: bf16, fp8 or f32")
      ->capture_default_str();
  cmd->add_option("--max-seq-len", args->options.max_seq_len,
                  "Longest sequence to plan for (default: the model's context)");
  cmd->add_option("--gpu-memory-fraction", args->options.memory_fraction,
                  "Share of each GPU the engine may use")
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print JSON");
  cmd->callback([args] { run_plan(*args); });
}

}  // namespace moeinfer::cli
