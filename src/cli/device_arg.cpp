#include "cli/device_arg.h"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "cli/usage_error.h"
#include "core/error.h"
#include "offload/parse_options.h"
#include "runtime/engine_ranks.h"

namespace moeinfer::cli {

void add_device_options(CLI::App* cmd, DeviceArgs* args) {
  cmd->add_option("--device", args->device, "Where the model runs: cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--gpu-memory-fraction,--gpu-memory-utilization", args->gpu_memory_fraction,
                  "cuda: share of the GPU's memory for weights, workspace and KV cache (vLLM's "
                  "--gpu-memory-utilization)")
      ->check(CLI::Range(0.01, 1.0))
      ->capture_default_str();
  cmd->add_option(
         "--fused-moe-rows", args->fused_moe_rows,
         "cuda: MoE layers of steps with at most N rows (tokens x experts per token, at "
         "most 512) run as two fused kernels instead of the stage-by-stage pipeline; 0 "
         "never (default: -1, the decoder's threshold, which is 0 for now: measured slower)")
      ->check(CLI::Range(-1, 512));
  cmd->add_option("--dtype", args->dtype,
                  "cuda: how a float32 or float16 checkpoint's weights are held: auto keeps "
                  "them (each weight as two bf16 terms summed in float32, as the checkpoint "
                  "computes: twice the weight bytes and time of bf16), bfloat16 rounds each to "
                  "bf16 (what vLLM and SGLang run such a checkpoint as). A bf16 checkpoint is "
                  "held as it is either way")
      ->check(CLI::IsMember({"auto", "bfloat16", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--fp8-tensor-cores", args->fp8_tensor_cores,
                  "cuda: routed fp8 experts in 128x128 blocks (DeepSeek-V3, Qwen3-FP8, --weights "
                  "fp8) on a GPU of compute capability 8.9 or later: on runs prefill-sized MoE "
                  "steps fp8 x fp8 on tensor cores, the activations quantised to e4m3 per 128 "
                  "inputs; off keeps the weight-only kernel (bf16 activations). Steps with few "
                  "rows per expert (decode) are weight-only either way")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  // GPU-only flags given for the CPU would change nothing there: refused, not ignored.
  cmd->parse_complete_callback([cmd, args] {
    if (args->is_cuda()) return;
    for (const char* flag : {"--dtype", "--fused-moe-rows", "--fp8-tensor-cores"}) {
      USAGE_CHECK(cmd->count(flag) == 0, flag,
                  " applies to --device cuda (the CPU computes with "
                  "the checkpoint's weights as stored, stage by stage)");
    }
    USAGE_CHECK(cmd->count("--gpu-memory-fraction") == 0,
                "--gpu-memory-fraction applies to --device cuda (the CPU holds no GPU memory)");
  });
}

GpuWeightDtype DeviceArgs::weight_dtype() const {
  return dtype == "auto" ? GpuWeightDtype::kCheckpoint : GpuWeightDtype::kBf16;
}

offload::OffloadOptions DeviceArgs::offload() const {
  return offload::parse_offload_flags(expert_budget, expert_cache, cold_experts, expert_prefetch);
}

void add_offload_options(CLI::App* cmd, DeviceArgs* args) {
  cmd->add_option("--expert-budget", args->expert_budget,
                  "Expert offloading: bytes of routed experts kept resident (24GiB, 800MB, "
                  "1000000) or a share of them (25%); the rest live in host memory and are "
                  "copied in on demand or prefetched. Outputs do not change. On the CPU the "
                  "budget is simulated with the same cache (default: every expert resident)");
  cmd->add_option("--expert-cache", args->expert_cache,
                  "With --expert-budget: lru, lfu, or static:FILE (the busiest experts of the "
                  "routing trace FILE, from --trace-routing, stay resident); lru:FILE and "
                  "lfu:FILE warm the cache up from such a trace (default: lfu, starting empty)");
  cmd->add_option("--cold-experts", args->cold_experts,
                  "With --expert-budget, where a demanded expert that is not resident computes: "
                  "gpu (copied in over PCIe), cpu (its rows computed on the host where its "
                  "weights live, only rows and results crossing PCIe; the budget keeps the first "
                  "experts touched and evicts nothing) or auto (per miss, whichever "
                  "the link and CPU rates measured at start-up say finishes first) "
                  "(default: gpu)");
  cmd->add_option("--expert-prefetch", args->expert_prefetch,
                  "With --expert-budget: on predicts layer l+1's experts at layer l (its router "
                  "over layer l's output) and copies the missing ones while layer l computes; "
                  "off copies each miss when its layer asks; auto prefetches a layer while at "
                  "least half of its prefetches are used (default: auto)");
}

void add_routing_options(CLI::App* cmd, DeviceArgs* args) {
  cmd->add_option("--active-experts", args->active_experts,
                  "Routing approximation: of the K experts the router picks per token, run only "
                  "the K' of largest weight (1 <= K' <= K; CPU only)");
  cmd->add_option("--renorm", args->renorm,
                  "With --active-experts: kept scales the kept weights to the sum the K had "
                  "(renormalised among themselves), full keeps them as the full top-K "
                  "normalisation gave them (default: kept)")
      ->check(CLI::IsMember({"kept", "full"}));
  cmd->add_option("--drop-below", args->drop_below,
                  "Routing approximation: skip an expert whose share of its token's routed "
                  "weight is under W (0 <= W < 1), the rest scaled back to the token's sum; the "
                  "token's largest weight always runs (CPU only)");
  cmd->add_option("--expert-capacity", args->expert_capacity,
                  "Routing approximation: at most ceil(F x mean rows per expert) rows per expert "
                  "in each forward (F >= 1), admitted in token order; the overflow is dropped "
                  "or, with --overflow reroute, sent to the token's next-best expert with room. "
                  "Depends on what else is in the batch (CPU only)");
  cmd->add_option("--overflow", args->overflow,
                  "With --expert-capacity: drop (the token's other weights scaled back to its "
                  "sum) or reroute (default: drop)")
      ->check(CLI::IsMember({"drop", "reroute"}));
  cmd->add_option("--router-temperature", args->router_temperature,
                  "Routing approximation: divide the router logits by T (> 0) before the score "
                  "function (CPU only)");
}

void add_weight_options(CLI::App* cmd, DeviceArgs* args) {
  cmd->add_option("--weights", args->weights,
                  "Quantise the routed experts' gate, up and down matrices at load (attention, "
                  "the router, shared experts and dense layers keep the checkpoint's weights "
                  "unless --weights-scope linear): "
                  "fp8 (e4m3, one scale per 128x128 block, DeepSeek-V3's layout), int4 (4-bit "
                  "codes with a scale and zero point per 128 inputs of a row, as GPTQ/AWQ) or "
                  "bf16 (rounded to bf16; what an fp8 or MXFP4 checkpoint is dequantised to "
                  "anyway). On the CPU the quantised values are computed in bf16/f32 after load: "
                  "the format's numerics, not its memory saving; on cuda fp8 and int4 experts are "
                  "held as their codes and scales and dequantised in the expert GEMM (bf16 is "
                  "--dtype bfloat16 there). fp8 and int4 are refused on an fp8, MXFP4, GPTQ or "
                  "AWQ checkpoint. With synthetic:NAME, fp8 and int4 draw the routed experts as "
                  "random codes of that format on the GPU (not with --expert-budget) "
                  "(default: the checkpoint's weights)")
      ->check(CLI::IsMember({"bf16", "fp8", "int4"}));
  cmd->add_option("--weights-scope", args->weights_scope,
                  "Which Linear weights --weights fp8|int4 quantises: experts (the routed "
                  "experts only) or linear (every Linear weight of every layer but the "
                  "embeddings, the LM head, norms and the MoE router and gates: attention's q/k/"
                  "v/o and MLA's projections, Gated DeltaNet's projections, shared experts and "
                  "dense MLPs, as vLLM's fp8 quantization and llama.cpp quantise). On cuda "
                  "those matrices are then held as codes and scales too (a skinny dequantising "
                  "GEMM at decode, dequantised into a scratch for cuBLAS otherwise), so decode "
                  "reads about half (fp8) or a quarter (int4) of their bytes; MLA's kv_b stays "
                  "bf16 there (its per-head absorbed products read bf16). With synthetic:NAME, "
                  "linear draws those matrices as random codes too. Needs --weights fp8 or int4 "
                  "(default: experts)")
      ->check(CLI::IsMember({"experts", "linear"}));
}

void add_kv_options(CLI::App* cmd, DeviceArgs* args) {
  cmd->add_option("--kv-dtype", args->kv_dtype,
                  "How the CPU's KV cache stores each token's key and value rows: f32 (as "
                  "computed; what auto means on the CPU), bf16 (half the bytes) or fp8 (e4m3 "
                  "with one float32 scale per KV head, or per MLA latent and rope key: about a "
                  "quarter). Rows are rounded once when written and attention reads them back "
                  "as float32; a --kv-cache-mb budget holds correspondingly more tokens. On "
                  "--device cuda the cache holds bf16 rows (auto) or fp8 rows in the same "
                  "format (about half the bytes of bf16; MLA models too); f32 is CPU only")
      ->check(CLI::IsMember({"auto", "f32", "bf16", "fp8"}))
      ->capture_default_str();
}

KvDType DeviceArgs::kv_rows_dtype() const {
  if (is_cuda()) {
    USAGE_CHECK(kv_dtype != "f32", "--kv-dtype ", kv_dtype,
                " applies to --device cpu: the CUDA backend's KV cache holds bf16 or fp8 rows "
                "(use --kv-dtype bf16, fp8 or auto there, or run --device cpu)");
    return kv_dtype == "fp8" ? KvDType::kFP8 : KvDType::kBF16;
  }
  return kv_dtype == "auto" ? KvDType::kF32 : parse_kv_dtype(kv_dtype);
}

WeightFormat DeviceArgs::weight_format() const {
  const WeightFormat format = parse_weight_format(weights);
  if (is_cuda()) {
    USAGE_CHECK(format != WeightFormat::kBf16,
                "--weights bf16 applies to --device cpu; on cuda --dtype bfloat16 holds the "
                "weights in bf16");
  }
  return format;
}

WeightScope DeviceArgs::weight_scope() const {
  const WeightScope scope = parse_weight_scope(weights_scope);
  const WeightFormat format = parse_weight_format(weights);
  USAGE_CHECK(scope != WeightScope::kLinear || format == WeightFormat::kFp8 ||
                  format == WeightFormat::kInt4,
              "--weights-scope linear needs --weights fp8 or --weights int4 (the format it "
              "quantises every Linear weight to)",
              weights.empty() ? std::string() : "; --weights " + weights + " is not one");
  return scope;
}

moe::RoutingApproximation DeviceArgs::routing_approximation() const {
  USAGE_CHECK(renorm.empty() || active_experts.has_value(), "--renorm ", renorm,
              " needs --active-experts K'");
  USAGE_CHECK(overflow.empty() || expert_capacity.has_value(), "--overflow ", overflow,
              " needs --expert-capacity F");
  USAGE_CHECK(!active_experts || *active_experts >= 1, "--active-experts ",
              active_experts.value_or(0), " must be at least 1");
  moe::RoutingApproximation approx{
      .active_experts = active_experts.value_or(0),
      .renorm = renorm == "full" ? moe::KeptRenorm::kFull : moe::KeptRenorm::kKept,
      .drop_below = drop_below.value_or(0.0),
      .expert_capacity = expert_capacity.value_or(0.0),
      .overflow =
          overflow == "reroute" ? moe::CapacityOverflow::kReroute : moe::CapacityOverflow::kDrop,
      .router_temperature = router_temperature.value_or(1.0)};
  // The values on their own (K' <= K once the model is known:
  // Decoder::set_routing_approximation), refused as the usage errors they are.
  try {
    moe::validate(approx, moe::RouterOptions{.num_experts = INT32_MAX, .top_k = INT32_MAX});
  } catch (const Error& e) {
    throw UsageError(e.what(), e.where());
  }
  // A capacity given, even one that changes nothing, is one the GPU would have to honour; the
  // GPU's route stage runs the other three.
  USAGE_CHECK(!is_cuda() || !expert_capacity.has_value(),
              "--expert-capacity is not implemented on the CUDA backend yet (it counts every "
              "expert's rows across the step's tokens in token order): run it with --device cpu");
  return approx;
}

void add_expert_parallel_option(CLI::App* cmd, DeviceArgs* args) {
  cmd->add_option("--ep", args->ep,
                  "Expert parallelism: shard the routed experts over N ranks, launched as "
                  "`mpirun -np N moeinfer ... --ep N`; generate and logits run the sequence on "
                  "every rank, serve and bench give each rank its own requests (attention "
                  "data-parallel); rank 0 prints and serves HTTP. On cuda rank r runs on GPU r % "
                  "count, ranks may share one: the k ranks on one GPU each take "
                  "--gpu-memory-fraction / k of it for weights, workspace and KV cache")
      // Not PositiveNumber, whose refusal of 0 reads "Value 0 not in range 0 to 1.79e308".
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--placement", args->placement,
                  "Expert placement under --ep: which ranks hold which experts (replicas "
                  "allowed), a file written by `moeinfer placement` (default: contiguous ranges)");
  cmd->add_option("--overlap", args->overlap,
                  "Under --ep: on computes the shared experts while the MoE layer's rows travel "
                  "to their ranks (non-blocking MPI), off before they leave; on cuda (with "
                  "--micro-batches 2 only) on alternates the two micro-batches on streams of "
                  "their own, off runs them one after the other (default: on)")
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--dispatch-dtype", args->dispatch_dtype,
                  "Under --ep: how the MoE layers' rows travel to their experts' ranks: f32 "
                  "(exact), bf16 (half the bytes) or fp8 (e4m3 with a float32 scale per row, "
                  "about a quarter); the outputs come back float32 (default: f32)")
      ->check(CLI::IsMember({"f32", "bf16", "fp8"}));
  cmd->add_option("--micro-batches", args->micro_batches,
                  "Under --ep: 2 splits each rank's step into two micro-batches (the first half "
                  "of its sequences and the rest) that alternate per MoE layer, so that one's "
                  "rows and outputs travel while the other runs attention and experts (on cuda "
                  "each on a CUDA stream of its own, with a workspace each); 1 runs the step "
                  "whole")
      ->check(CLI::IsMember({1, 2}))
      ->capture_default_str();
  cmd->add_option("--ep-transport", args->ep_transport,
                  "Under --ep on cuda: what carries the MoE layers' rows between the ranks' GPUs: "
                  "nccl (device to device; every rank on a GPU of its own, NCCL built), staged "
                  "(through pinned host memory and MPI; ranks may share a GPU) or auto (nccl "
                  "where it can run, else staged) (default: auto)")
      ->check(CLI::IsMember({"auto", "nccl", "staged"}));
}

bool DeviceArgs::overlap_shared_experts() const { return overlap != "off"; }

EpTransport DeviceArgs::ep_rows_transport() const {
  if (ep_transport == "nccl") return EpTransport::kNccl;
  if (ep_transport == "staged") return EpTransport::kStaged;
  return EpTransport::kAuto;
}

moe::DispatchDtype DeviceArgs::dispatch_rows_dtype() const {
  return dispatch_dtype.empty() ? moe::DispatchDtype::kF32
                                : moe::parse_dispatch_dtype(dispatch_dtype);
}

std::optional<parallel::ExpertPlacement> DeviceArgs::expert_placement(
    const Decoder& decoder) const {
  if (placement.empty()) return std::nullopt;
  MOE_CHECK(ep > 1, "--placement ", placement, " needs --ep N with N > 1");
  return parallel::read_placement(placement, decoder.config().num_experts, ep,
                                  decoder.moe_layers());
}

parallel::Communicator* DeviceArgs::expert_parallel() const {
  MOE_CHECK(overlap.empty() || ep > 1, "--overlap ", overlap, " needs --ep N with N > 1");
  USAGE_CHECK(placement.empty() || ep > 1, "--placement ", placement,
              " needs --ep N with N > 1: without expert parallelism every expert is local");
  // --dispatch-dtype: the GPU's refusal first, so that it names the flag with or without --ep.
  USAGE_CHECK(dispatch_dtype.empty() || !is_cuda(), "--dispatch-dtype ", dispatch_dtype,
              " is not implemented on the CUDA backend yet (its expert parallelism sends the "
              "rows as bf16): run it with --device cpu --ep N under mpirun");
  USAGE_CHECK(dispatch_dtype.empty() || ep > 1, "--dispatch-dtype ", dispatch_dtype,
              " applies to --ep N (N > 1): without expert parallelism no rows travel");
  // On cuda --overlap says whether the two micro-batches alternate on their streams; with one
  // the GPU's expert parallelism waits for each exchange and the shared experts run after it.
  USAGE_CHECK(overlap.empty() || !is_cuda() || micro_batches == 2, "--overlap ", overlap,
              " on cuda applies to --micro-batches 2 (whether the two micro-batches overlap); "
              "with one micro-batch the GPU's expert parallelism waits for each exchange: leave "
              "it out, add --micro-batches 2, or run with --device cpu --ep N under mpirun");
  USAGE_CHECK(ep_transport.empty() || is_cuda(), "--ep-transport ", ep_transport,
              " applies to --device cuda (CPU ranks exchange their rows over MPI)");
  USAGE_CHECK(ep_transport.empty() || ep > 1, "--ep-transport ", ep_transport,
              " applies to --ep N (N > 1): without expert parallelism no rows travel");
  USAGE_CHECK(micro_batches == 1 || ep > 1, "--micro-batches ", micro_batches,
              " needs --ep N with N > 1: without expert parallelism nothing travels to overlap");
  if (ep == 1) return nullptr;
  MOE_CHECK(!is_cuda() || fused_moe_rows <= 0, "--fused-moe-rows ", fused_moe_rows,
            " with --ep on cuda: the small-batch MoE path has no dispatch stage and is off "
            "under expert parallelism");
  // generate and logits take it in SequenceRunner, bench and serve in
  // load_expert_parallel_engine (either device).
  parallel::Communicator& world = parallel::world();
  MOE_CHECK(world.size() == ep, "--ep ", ep, " but this job has ", world.size(),
            " rank(s): launch it as `mpirun -np ", ep, " moeinfer ... --ep ", ep, "`");
  return &world;
}

void end_job_on_error(bool expert_parallel, const std::function<void()>& body) {
  if (!expert_parallel) return body();
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moeinfer: error: %s\n", e.what());
    std::fflush(stderr);
    std::_Exit(1);
  }
}

namespace {

ExpertParallelOptions expert_parallel_options(const DeviceArgs& device) {
  parallel::Communicator* comm = device.expert_parallel();  // the flags checked here
  MOE_CHECK(comm != nullptr, "load_expert_parallel_engine without --ep N (N > 1)");
  return {.comm = comm,
          .placement = device.placement,
          .overlap_shared_experts = device.overlap_shared_experts(),
          .dispatch_dtype = device.dispatch_rows_dtype(),
          .micro_batches = device.micro_batches,
          .ep_transport = device.ep_rows_transport()};
}

}  // namespace

std::unique_ptr<Engine> load_expert_parallel_engine(const std::filesystem::path& dir,
                                                    const EngineConfig& config,
                                                    const DeviceArgs& device) {
  config.validate();
  return moeinfer::load_expert_parallel_engine(dir, config, expert_parallel_options(device));
}

std::unique_ptr<Engine> load_expert_parallel_synthetic(const std::string& name, int64_t layers,
                                                       const SyntheticGpuOptions& synthetic,
                                                       const EngineConfig& config,
                                                       const DeviceArgs& device) {
  config.validate();
  return moeinfer::load_expert_parallel_synthetic(name, layers, synthetic, config,
                                                  expert_parallel_options(device));
}

bool DeviceArgs::is_output_rank() const { return ep == 1 || parallel::world().rank() == 0; }

void add_synthetic_options(CLI::App* cmd, int64_t* layers, std::string* routing_skew) {
  cmd->add_option("--layers", *layers, "synthetic:NAME: keep only the first N layers");
  cmd->add_option("--routing-skew", *routing_skew,
                  "synthetic:NAME: zipf:A makes each token draw its experts by a Zipf law (the "
                  "expert of rank r with probability proportional to (r + 1)^-A); "
                  "uniform makes each token pick a uniformly random set of experts per layer");
}

RoutingSkew parse_routing_skew(const std::string& text) {
  if (text.empty()) return {};
  if (text == "uniform") return {.kind = RoutingSkew::Kind::kUniform};
  MOE_CHECK(text.starts_with("zipf:"), "--routing-skew '", text,
            "': expected zipf:A (A a number in (0, 10]) or uniform");
  size_t used = 0;
  double value = 0.0;
  try {
    value = std::stod(text.substr(5), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  MOE_CHECK(used > 0 && used == text.size() - 5 && value > 0.0 && value <= 10.0, "--routing-skew '",
            text, "': A must be a number in (0, 10]");
  return {.kind = RoutingSkew::Kind::kZipf, .exponent = value};
}

std::string routing_skew_label(const RoutingSkew& skew) {
  switch (skew.kind) {
    case RoutingSkew::Kind::kNone:
      return "synthetic";
    case RoutingSkew::Kind::kUniform:
      return "uniform";
    case RoutingSkew::Kind::kZipf: {
      char digits[64];
      const auto end = std::to_chars(digits, digits + sizeof(digits), skew.exponent).ptr;
      std::string a(digits, end);
      if (a.find_first_of(".e") == std::string::npos) a += ".0";
      return "zipf:" + a;
    }
  }
  return {};  // unreachable: every enumerator returns above
}

std::unique_ptr<Model> load_model_for(const std::filesystem::path& dir, const DeviceArgs& device) {
  const WeightFormat weights = device.weight_format();
  // A model the GPU refuses is refused from its config.json, before binding its weights, as is
  // a --kv-dtype its kernels do not read for this model (fp8 with heads past 256).
  if (device.is_cuda()) {
    const ModelConfig config = load_model_config(dir / "config.json");
    check_gpu_support(config);
    check_gpu_kv_dtype(config, device.kv_rows_dtype());
    check_gpu_offload(config, device.offload());
  }
  return Model::load(dir, LoadOptions{.prefault = !device.is_cuda(),
                                      .expert_weights = weights,
                                      .weight_scope = device.weight_scope()});
}

SequenceRunner::SequenceRunner(Model& model, const DeviceArgs& device, int64_t max_tokens,
                               int64_t max_step_tokens)
    : model_(model), kv_dtype_(device.kv_rows_dtype()) {  // f32 refused on cuda
  const ModelConfig& config = model.config();
  const int64_t native =
      config.max_position_embeddings > 0 ? config.max_position_embeddings : max_tokens;
  capacity_ = std::min(max_tokens, native);
  const offload::OffloadOptions offload = device.offload();
  // Checked on both devices, so that a flag the GPU path cannot take is refused, not ignored.
  parallel::Communicator* const expert_parallel = device.expert_parallel();
  const moe::RoutingApproximation routing = device.routing_approximation();
  if (!device.is_cuda()) {
    model.decoder().set_offload(offload, /*max_step_tokens=*/1);
    model.decoder().set_routing_approximation(routing);
    model.decoder().set_expert_parallel(expert_parallel, device.expert_placement(model.decoder()),
                                        device.overlap_shared_experts(),
                                        device.dispatch_rows_dtype(), device.micro_batches);
    cache_.emplace(model.decoder().make_cache(capacity_, kv_dtype_));
    capacity_ = cache_->max_tokens();
    return;
  }
  GpuOptions options;
  options.gpu_memory_fraction = device.gpu_memory_fraction;
  options.max_batch_tokens = std::max<int64_t>(max_step_tokens, 1);
  options.max_num_seqs = 1;
  options.max_model_len = capacity_;
  options.num_kv_blocks = (capacity_ + options.block_size - 1) / options.block_size;
  options.offload = offload;
  options.small_batch_moe_rows = device.fused_moe_rows;
  options.fp8_tensor_cores = device.fp8_tensor_cores_on();
  options.weight_dtype = device.weight_dtype();
  options.kv_dtype = kv_dtype_;
  options.routing = routing;
  if (expert_parallel != nullptr) {  // --ep N: rank r on GPU r % count (ranks may share one)
    const GpuRank rank =
        expert_parallel_gpu_rank(*expert_parallel, device.placement, device.ep_rows_transport(),
                                 device.micro_batches, device.overlap_shared_experts());
    options.device = rank.device;
    options.expert_parallel = rank.expert_parallel;
    options.ranks_on_device = rank.ranks_on_device;
    options.ep_transport = rank.ep_transport;
    options.micro_batches = rank.micro_batches;
    options.overlap_micro_batches = rank.overlap_micro_batches;
    options.placement = device.expert_placement(model.decoder());
  }
  gpu_ = GpuDecoder::create(config, model.decoder().weights(), options);
  for (int32_t b = 0; b < options.num_kv_blocks; ++b) block_table_.push_back(b);
}

std::vector<int64_t> SequenceRunner::expert_parallel_bytes() const {
  return gpu_ ? gpu_->expert_parallel_bytes() : std::vector<int64_t>{};
}

void SequenceRunner::set_routing_observer(Decoder::RoutingObserver observer) {
  if (gpu_) {
    gpu_->set_routing_observer(std::move(observer));
  } else {
    model_.decoder().set_routing_observer(std::move(observer));
  }
}

void SequenceRunner::set_routing_approximation(const moe::RoutingApproximation& approx) {
  if (gpu_) {
    gpu_->set_routing_approximation(approx);
  } else {
    model_.decoder().set_routing_approximation(approx);
  }
}

void SequenceRunner::reset() {
  // A fresh CPU cache also zeroes a linear-attention layer's recurrent state; on the GPU
  // position 0 overwrites the sequence's rows, so only the length goes back.
  if (cache_) cache_.emplace(model_.decoder().make_cache(capacity_, kv_dtype_));
  length_ = 0;
}

void SequenceRunner::forward(std::span<const int32_t> tokens, std::span<float> logits,
                             bool all_positions) {
  if (cache_) {
    model_.decoder().forward(tokens, *cache_, logits, all_positions);
    length_ = cache_->length();
    return;
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  MOE_CHECK(length_ + n <= capacity_, "sequence of ", length_ + n,
            " tokens exceeds the context limit of ", capacity_);
  ForwardBatch batch{
      .sequences = {SequenceBatch{
          .tokens = tokens, .position = length_, .block_table = block_table_, .want_logits = true,
          // The one sequence's recurrent state (linear-attention layers): slot 0.
          .state_slot = gpu_->num_state_slots() > 0 ? 0 : -1}},
      .all_positions = all_positions};
  gpu_->forward(batch, logits);
  length_ += n;
}

}  // namespace moeinfer::cli
