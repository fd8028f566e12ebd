#include "model/capacity_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "model/gpu_decoder.h"
#include "model/synthetic.h"
#include "offload/parse_options.h"

namespace moeinfer {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / kGiB);
  return buf;
}

template <typename... Args>
std::string line(const char* format, Args... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, format, args...);
  return buf;
}

}  // namespace

std::string layout_name(Layout layout) {
  switch (layout) {
    case Layout::kSingleGpu:
      return "one GPU";
    case Layout::kExpertParallel:
      return "expert parallel";
    case Layout::kOffload:
      return "offload";
  }
  return "?";
}

PartCounts weight_bytes_by_part(const ModelConfig& config, WeightDType dtype) {
  const PartCounts params = count_params(config, /*active_only=*/false);
  // fp8 stores the Linear matrices (attention, experts, shared experts, dense MLP layers) in one
  // byte plus a float32 scale per 128 inputs of a row, as the GPU holds them (a 128x128 block's
  // scale repeated on its rows: backend/cuda/expert_quant.h; `--weights fp8 --weights-scope
  // linear`, or a block-scaled fp8 checkpoint); embeddings, norms and routers stay in bf16.
  const double matrix_bytes = dtype == WeightDType::kFP8 ? 1.0 + 4.0 / 128.0 : 2.0;
  int64_t dense_mlp = 0;  // the dense layers' MLPs, counted in `other`
  for (int64_t l = 0; l < config.num_layers; ++l) {
    if (!config.layer_is_moe[l]) dense_mlp += 3 * config.hidden_size * config.intermediate_size;
  }
  PartCounts bytes;
  bytes.attention = static_cast<int64_t>(std::ceil(params.attention * matrix_bytes));
  bytes.routed_experts = static_cast<int64_t>(std::ceil(params.routed_experts * matrix_bytes));
  bytes.shared_experts = static_cast<int64_t>(std::ceil(params.shared_experts * matrix_bytes));
  bytes.embeddings = params.embeddings * 2;
  bytes.other = (params.other - dense_mlp) * 2 +
                static_cast<int64_t>(std::ceil(static_cast<double>(dense_mlp) * matrix_bytes));
  return bytes;
}

// Whether the GPU decoder can shard experts over GPUs: not yet, so no plan recommends it.
constexpr bool kGpuExpertParallelBuilt = false;

// The planner's input bounds: far past any machine, small enough for exact int64 arithmetic.
constexpr int64_t kMaxPlanGpus = 4096;
constexpr double kMaxPlanGpuMemGib = 1 << 20;  // 1 PiB per GPU

namespace {

// The layout on the GPU decoder: one GPU, expert parallel, or offload.
CapacityPlan plan_on_gpus(const ModelConfig& config, const PlanOptions& o) {
  // Bounded so that tokens = free bytes / bytes per token x GPUs stays well inside int64 (an
  // infinite --gpu-mem printed a negative token count).
  MOE_CHECK(o.num_gpus >= 1 && o.num_gpus <= kMaxPlanGpus, "--gpus must be in [1, ", kMaxPlanGpus,
            "], got ", o.num_gpus);
  MOE_CHECK(o.gpu_mem_gib > 0 && o.gpu_mem_gib <= kMaxPlanGpuMemGib, "--gpu-mem must be in (0, ",
            kMaxPlanGpuMemGib, "] GiB, got ", o.gpu_mem_gib);
  MOE_CHECK(o.memory_fraction > 0 && o.memory_fraction <= 1,
            "--gpu-memory-fraction must be in (0, 1], got ", o.memory_fraction);
  MOE_CHECK(o.max_seq_len >= 0, "--max-seq-len must be >= 1 (or 0: the model's context), got ",
            o.max_seq_len);
  CapacityPlan plan;
  plan.weight_bytes = weight_bytes_by_part(config, o.weight_dtype);
  // The same bytes as the CPU pool allocates per token (fp8's per-head scales included).
  plan.kv_bytes_per_token = kv_bytes_per_token(config, o.kv_dtype);
  plan.max_seq_len = o.max_seq_len > 0 ? o.max_seq_len : config.max_position_embeddings;
  plan.state_bytes_per_sequence = state_values_per_sequence(config) * 4;
  auto& a = plan.arithmetic;

  const double usable = o.gpu_mem_gib * kGiB * o.memory_fraction - o.workspace_gib * kGiB;
  const double weights = static_cast<double>(plan.weight_bytes.total());
  const double routed = static_cast<double>(plan.weight_bytes.routed_experts);
  const double replicated = weights - routed;
  // One full-length sequence's cache: its KV rows and, for linear-attention layers, its state.
  const double one_sequence_kv = static_cast<double>(plan.kv_bytes_per_token) * plan.max_seq_len +
                                 static_cast<double>(plan.state_bytes_per_sequence);
  a.push_back(line("weights: %s (routed experts %s, the rest %s)", gib(weights).c_str(),
                   gib(routed).c_str(), gib(replicated).c_str()));
  {
    const KvRowGroups groups = kv_row_groups(config);
    const int64_t values = kv_values_per_token(config);
    const int64_t scales =
        o.kv_dtype == KvDType::kFP8
            ? config.num_kv_layers() * static_cast<int64_t>(groups.key.size() + groups.value.size())
            : 0;
    a.push_back(line(
        "KV per token: %lld values x %lld B%s = %lld B; one %lld-token sequence: %s",
        static_cast<long long>(values),
        static_cast<long long>((plan.kv_bytes_per_token - 4 * scales) / values),
        scales > 0 ? line(" + %lld fp8 scales x 4 B", static_cast<long long>(scales)).c_str() : "",
        static_cast<long long>(plan.kv_bytes_per_token), static_cast<long long>(plan.max_seq_len),
        gib(one_sequence_kv).c_str()));
  }
  if (plan.state_bytes_per_sequence > 0) {
    a.push_back(
        line("recurrent state per sequence: %lld linear layers x %lld values x 4 B = %lld "
             "B, whatever its length; one %lld-token sequence with it: %s",
             static_cast<long long>(config.num_linear_layers()),
             static_cast<long long>(state_values_per_sequence(config) / config.num_linear_layers()),
             static_cast<long long>(plan.state_bytes_per_sequence),
             static_cast<long long>(plan.max_seq_len), gib(one_sequence_kv).c_str()));
  }
  a.push_back(line("usable per GPU: %.1f GiB x %.2f - %.1f GiB workspace = %s", o.gpu_mem_gib,
                   o.memory_fraction, o.workspace_gib, gib(usable).c_str()));
  MOE_CHECK(usable > 0, "--gpu-mem ", o.gpu_mem_gib, " GiB leaves nothing after the workspace");

  const auto fill_kv = [&](double free_per_gpu, int64_t gpus) {
    plan.gpus_used = gpus;
    plan.kv_tokens_fit = static_cast<int64_t>(free_per_gpu / plan.kv_bytes_per_token) * gpus;
    plan.full_length_sequences =
        plan.state_bytes_per_sequence == 0
            ? plan.kv_tokens_fit / std::max<int64_t>(1, plan.max_seq_len)
            : static_cast<int64_t>(free_per_gpu / one_sequence_kv) * gpus;  // rows and state
    a.push_back(
        line("KV: (%s free per GPU / %lld B) x %lld GPUs = %lld tokens = %lld "
             "sequences of %lld tokens",
             gib(free_per_gpu).c_str(), static_cast<long long>(plan.kv_bytes_per_token),
             static_cast<long long>(gpus), static_cast<long long>(plan.kv_tokens_fit),
             static_cast<long long>(plan.full_length_sequences),
             static_cast<long long>(plan.max_seq_len)));
  };

  // 1. Everything on one GPU, with room for at least one full-length sequence.
  if (weights + one_sequence_kv <= usable) {
    plan.layout = Layout::kSingleGpu;
    plan.weight_bytes_per_gpu = weights;
    a.push_back(line("one GPU: %s weights + %s KV <= %s", gib(weights).c_str(),
                     gib(one_sequence_kv).c_str(), gib(usable).c_str()));
    fill_kv(usable - weights, 1);
    plan.run_flags = "--device cuda";
    return plan;
  }
  a.push_back(line("one GPU: %s weights + %s KV > %s: does not fit", gib(weights).c_str(),
                   gib(one_sequence_kv).c_str(), gib(usable).c_str()));

  // 2. Expert parallel: routed experts split over the GPUs, everything else replicated. The GPU
  //    path runs one GPU per job until its expert parallelism is built, so the layout is shown
  //    and the plan goes on for one GPU.
  const int64_t asked = o.num_gpus;
  const double per_gpu = replicated + routed / static_cast<double>(asked);
  if (asked > 1 && !kGpuExpertParallelBuilt) {
    a.push_back(
        line("expert parallel over %lld GPUs: %s per GPU + %s KV %s %s, but the GPU path "
             "runs one GPU per job (--ep runs CPU ranks): planning for one GPU",
             static_cast<long long>(asked), gib(per_gpu).c_str(), gib(one_sequence_kv).c_str(),
             per_gpu + one_sequence_kv <= usable ? "<=" : ">", gib(usable).c_str()));
  }
  const int64_t n = kGpuExpertParallelBuilt ? asked : 1;
  if (n > 1 && per_gpu + one_sequence_kv <= usable) {
    plan.layout = Layout::kExpertParallel;
    plan.weight_bytes_per_gpu = per_gpu;
    a.push_back(line("expert parallel over %lld: %s replicated + %s / %lld = %s per GPU",
                     static_cast<long long>(n), gib(replicated).c_str(), gib(routed).c_str(),
                     static_cast<long long>(n), gib(per_gpu).c_str()));
    fill_kv(usable - per_gpu, n);
    plan.run_flags = "--device cuda --ep " + std::to_string(n);
    return plan;
  }
  if (n > 1) {
    a.push_back(line("expert parallel over %lld: %s per GPU + %s KV > %s: does not fit",
                     static_cast<long long>(n), gib(per_gpu).c_str(), gib(one_sequence_kv).c_str(),
                     gib(usable).c_str()));
  }

  // 3. Offload: keep the replicated weights and one sequence's KV on each GPU, give the rest to
  //    a cache of routed experts; the others live in pinned host memory.
  int64_t moe_layers = 0;
  for (bool is_moe : config.layer_is_moe) moe_layers += is_moe;
  const double expert_bytes =
      moe_layers > 0 ? routed / static_cast<double>(moe_layers * config.num_experts) : 0.0;
  const double for_experts = usable - replicated - one_sequence_kv;
  MOE_CHECK(replicated < usable, "even without routed experts the model needs ", gib(replicated),
            " per GPU; ", gib(usable), " is usable");
  MOE_CHECK(for_experts > 0, "one sequence of ", plan.max_seq_len, " tokens needs ",
            gib(one_sequence_kv), " of KV beside the ", gib(replicated),
            " every GPU holds without routed experts, more than the ", gib(usable),
            " usable; plan a shorter context with --max-seq-len");
  const int64_t total_slots = static_cast<int64_t>(for_experts / expert_bytes) * n;
  plan.layout = Layout::kOffload;
  plan.gpu_experts_per_layer = std::min(config.num_experts, total_slots / moe_layers);
  plan.weight_bytes_per_gpu =
      replicated + plan.gpu_experts_per_layer * moe_layers * expert_bytes / static_cast<double>(n);
  a.push_back(
      line("offload: (%s usable - %s replicated - %s KV) / %.1f MiB per expert = %lld "
           "expert slots per GPU",
           gib(usable).c_str(), gib(replicated).c_str(), gib(one_sequence_kv).c_str(),
           expert_bytes / (1024.0 * 1024.0), static_cast<long long>(for_experts / expert_bytes)));
  a.push_back(
      line("expert budget: %lld of %lld experts per MoE layer on the GPUs (top-%lld "
           "needed per token); the rest in host memory",
           static_cast<long long>(plan.gpu_experts_per_layer),
           static_cast<long long>(config.num_experts),
           static_cast<long long>(config.num_experts_per_tok)));
  // What one GPU's cache may hold: the experts counted in its weights above, in whole MiB so
  // the flag reads plainly (the rest of the slots' room stays with the KV cache).
  const double slots_per_gpu = std::floor(
      static_cast<double>(plan.gpu_experts_per_layer * moe_layers) / static_cast<double>(n));
  plan.expert_budget_bytes =
      static_cast<int64_t>(slots_per_gpu * expert_bytes) / (int64_t{1} << 20) * (int64_t{1} << 20);
  plan.expert_budget_flag = offload::format_expert_budget(plan.expert_budget_bytes);
  a.push_back(
      line("expert budget per GPU: %.0f slots x %.1f MiB = %s (%.1f%% of the routed "
           "experts): --expert-budget %s",
           slots_per_gpu, expert_bytes / (1024.0 * 1024.0),
           gib(static_cast<double>(plan.expert_budget_bytes)).c_str(),
           100.0 * static_cast<double>(plan.expert_budget_bytes) / routed,
           plan.expert_budget_flag.c_str()));
  fill_kv(usable - plan.weight_bytes_per_gpu, n);
  plan.run_flags = "--device cuda --expert-budget " + plan.expert_budget_flag;
  return plan;
}

}  // namespace

CapacityPlan plan_capacity(const ModelConfig& config, const PlanOptions& o) {
  CapacityPlan plan = plan_on_gpus(config, o);
  // The counts hold on any device, the layout only on the GPU: a model the GPU decoder does not
  // run says so first and is run on the CPU.
  if (const std::optional<std::string> reason = gpu_unsupported(config)) {
    plan.arithmetic.insert(plan.arithmetic.begin(), "note: " + *reason);
    plan.run_flags = "--device cpu";
  } else if (plan.run_flags.find("--expert-budget") != std::string::npos) {
    // It needs the expert cache, which cannot offload this model's experts on the GPU yet.
    if (const std::optional<std::string> reason = gpu_offload_unsupported(config)) {
      plan.arithmetic.insert(plan.arithmetic.begin(), "note: " + *reason);
      plan.run_flags = "--device cpu";
    }
  }
  return plan;
}

}  // namespace moeinfer

namespace moeinfer {

ModelConfig plan_model_config(const std::string& model) {
  if (is_synthetic_model(model)) {
    return synthetic_model_config(model.substr(std::string("synthetic:").size()));
  }
  return load_model_config(std::filesystem::path(model) / "config.json");
}

NamedPlan plan_capacity_named(const ModelConfig& config, PlanOptions options,
                              const std::string& dtype, const std::string& kv_dtype) {
  NamedPlan named{.weight_dtype = !dtype.empty() ? dtype
                                  : config.fp8   ? "fp8"
                                                 : "bf16",
                  .kv_dtype = kv_dtype};
  MOE_CHECK(named.weight_dtype == "bf16" || named.weight_dtype == "fp8",
            "dtype must be bf16 or fp8, got '", named.weight_dtype, "'");
  options.weight_dtype = named.weight_dtype == "fp8" ? WeightDType::kFP8 : WeightDType::kBF16;
  options.kv_dtype = parse_kv_dtype(kv_dtype);
  named.options = options;
  named.plan = plan_capacity(config, options);
  return named;
}

nlohmann::ordered_json capacity_plan_json(const ModelConfig& config, const NamedPlan& named) {
  const CapacityPlan& plan = named.plan;
  const PartCounts& w = plan.weight_bytes;
  return {{"model_type", config.model_type},
          {"weight_dtype", named.weight_dtype},
          {"kv_dtype", named.kv_dtype},
          {"weight_bytes",
           {{"total", w.total()},
            {"attention", w.attention},
            {"routed_experts", w.routed_experts},
            {"shared_experts", w.shared_experts},
            {"embeddings", w.embeddings},
            {"other", w.other}}},
          {"kv_bytes_per_token", plan.kv_bytes_per_token},
          {"state_bytes_per_sequence", plan.state_bytes_per_sequence},
          {"max_seq_len", plan.max_seq_len},
          {"layout", layout_name(plan.layout)},
          {"gpus_used", plan.gpus_used},
          {"weight_bytes_per_gpu", plan.weight_bytes_per_gpu},
          {"kv_tokens_fit", plan.kv_tokens_fit},
          {"full_length_sequences", plan.full_length_sequences},
          {"gpu_experts_per_layer", plan.gpu_experts_per_layer},
          {"expert_budget_bytes", plan.expert_budget_bytes},
          {"expert_budget", plan.expert_budget_flag},
          {"run_flags", plan.run_flags},
          {"arithmetic", plan.arithmetic}};
}

}  // namespace moeinfer
