// --device and its GPU options, shared by the subcommands that run the model, and a runner for
// one sequence on either device (what `generate` and `logits` need).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/gpu_decoder.h"
#include "model/model.h"
#include "moe/routing_approx.h"
#include "offload/offload_options.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"
#include "runtime/engine.h"

namespace moeinfer::cli {

struct DeviceArgs {
  std::string device = "cpu";
  double gpu_memory_fraction = 0.9;
  int64_t fused_moe_rows = -1;  // --fused-moe-rows; -1: the decoder's own threshold
  std::string dtype = "auto";   // --dtype auto|bfloat16: a float32 checkpoint's weights on cuda
  std::string fp8_tensor_cores = "on";  // --fp8-tensor-cores on|off (cuda)
  bool fp8_tensor_cores_on() const { return fp8_tensor_cores == "on"; }
  std::string expert_budget;  // --expert-budget; empty: every expert resident
  std::string expert_cache;   // --expert-cache; empty: lru
  std::string cold_experts;   // --cold-experts; empty: gpu
  std::string expert_prefetch;  // --expert-prefetch; empty: auto
  int ep = 1;                 // --ep: ranks the routed experts are sharded over
  std::string placement;      // --placement FILE; empty: contiguous ranges
  std::string overlap;        // --overlap on|off; empty: on
  std::string dispatch_dtype;  // --dispatch-dtype f32|bf16|fp8; empty: f32
  int micro_batches = 1;       // --micro-batches 1|2 under --ep
  std::string ep_transport;    // --ep-transport auto|nccl|staged under --ep on cuda; empty: auto
  // Routing approximations as given (add_routing_options); unset: off.
  std::optional<int64_t> active_experts;     // --active-experts K'
  std::string renorm;                        // --renorm kept|full; empty: kept
  std::optional<double> drop_below;          // --drop-below W
  std::optional<double> expert_capacity;     // --expert-capacity F
  std::string overflow;                      // --overflow drop|reroute; empty: drop
  std::optional<double> router_temperature;  // --router-temperature T
  std::string weights;  // --weights bf16|fp8|int4 (add_weight_options); empty: the checkpoint's
  std::string weights_scope;  // --weights-scope experts|linear (add_weight_options); empty: experts
  std::string kv_dtype = "auto";  // --kv-dtype auto|f32|bf16|fp8 (add_kv_options)
  // Under --ep: whether the shared experts run while the dispatch's rows are in flight.
  bool overlap_shared_experts() const;
  // Under --ep: how dispatch encodes the rows it sends (checked in expert_parallel()).
  moe::DispatchDtype dispatch_rows_dtype() const;
  // Under --ep on cuda: what carries the rows between the ranks' GPUs (checked in
  // expert_parallel()).
  EpTransport ep_rows_transport() const;
  bool is_cuda() const { return device == "cuda"; }
  // --dtype as the GPU decoder's option (refused at parse time without --device cuda).
  GpuWeightDtype weight_dtype() const;
  // The job's communicator under --ep N (launched as N ranks by mpirun; checked, with the flags
  // that need --ep), else null.
  parallel::Communicator* expert_parallel() const;
  // --placement FILE read for `decoder`'s MoE layers over --ep ranks; empty without the flag.
  std::optional<parallel::ExpertPlacement> expert_placement(const Decoder& decoder) const;
  // Whether this process prints and writes the command's results: rank 0 under --ep.
  bool is_output_rank() const;
  // The routing flags as one options value, their values and combinations checked (a flag
  // that needs another, a value out of range) and refused on --device cuda, each error naming
  // the flag. K' against the model's K is checked where the model is loaded.
  moe::RoutingApproximation routing_approximation() const;
  // --weights as the load option, refused on --device cuda for fp8 and int4 (naming the flag).
  WeightFormat weight_format() const;
  // --weights-scope as the load option; linear without --weights fp8|int4 is refused, naming
  // both flags.
  WeightScope weight_scope() const;
  // --kv-dtype as the pool's row type. CPU: auto is f32, the rows as computed. On --device
  // cuda, whose KV cache holds bf16 or fp8 rows, auto is bf16 and f32 is refused, naming the flag
  // (fp8 for a model whose kernels cannot read it is refused where the model is loaded:
  // check_gpu_kv_dtype).
  KvDType kv_rows_dtype() const;
  // Whether --kv-dtype changes the rows from what the device stores by default (CPU: not f32;
  // cuda: fp8); checked as kv_rows_dtype() is, so a value cuda cannot take is refused here too.
  bool kv_rows_rounded() const {
    const KvDType dtype = kv_rows_dtype();
    return is_cuda() ? dtype == KvDType::kFP8 : dtype != KvDType::kF32;
  }
  // The offloading flags, parsed (offload/parse_options.h); disabled without a budget.
  offload::OffloadOptions offload() const;
};

// Adds --device cpu|cuda, --gpu-memory-fraction, --fused-moe-rows, --dtype and
// --fp8-tensor-cores (the last three refused without --device cuda).
void add_device_options(CLI::App* cmd, DeviceArgs* args);
// Adds --expert-budget and --expert-cache (the subcommands that run a model's experts).
void add_offload_options(CLI::App* cmd, DeviceArgs* args);
// Adds --active-experts, --renorm, --drop-below, --expert-capacity, --overflow and
// --router-temperature (the subcommands that run a model's router).
void add_routing_options(CLI::App* cmd, DeviceArgs* args);
// Adds --weights bf16|fp8|int4 (the subcommands that load a checkpoint to run it): the routed
// experts quantised at load, CPU only for fp8 and int4.
void add_weight_options(CLI::App* cmd, DeviceArgs* args);
// Adds --kv-dtype auto|f32|bf16|fp8 (the subcommands that run a model over a KV cache): how the
// CPU's KV pool stores rows, and so how many tokens its bytes hold.
void add_kv_options(CLI::App* cmd, DeviceArgs* args);
// Adds --ep N, --placement FILE, --overlap, --dispatch-dtype, --micro-batches and --ep-transport
// (generate and
// logits run one sequence on every rank; serve and bench give each rank its own engine and
// requests).
void add_expert_parallel_option(CLI::App* cmd, DeviceArgs* args);

// Runs body; under --ep (expert_parallel) an error it throws ends the process at once with
// status 1 after printing it as main does. The other ranks may be waiting for this one inside a
// collective: returning to main would finalise MPI, which waits for them forever, while a rank
// that exits without finalising makes mpirun end the whole job.
void end_job_on_error(bool expert_parallel, const std::function<void()>& body);

// This rank's engine over the checkpoint in `dir` (or `synthetic`, a synthetic:NAME model's
// name, cuda only) whose decoder is expert-parallel over the job of --ep ranks
// (DeviceArgs::expert_parallel(), checked), with --placement when given: a CPU decoder, or on
// cuda a GPU decoder on GPU rank % count (runtime/engine_ranks.h).
std::unique_ptr<Engine> load_expert_parallel_engine(const std::filesystem::path& dir,
                                                    const EngineConfig& config,
                                                    const DeviceArgs& device);
std::unique_ptr<Engine> load_expert_parallel_synthetic(const std::string& name, int64_t layers,
                                                       const SyntheticGpuOptions& synthetic,
                                                       const EngineConfig& config,
                                                       const DeviceArgs& device);

// One sequence's forward passes over its own KV cache, on the CPU or the GPU.
class SequenceRunner {
 public:
  // max_tokens: the sequence's length limit; max_step_tokens: most tokens one forward carries.
  SequenceRunner(Model& model, const DeviceArgs& device, int64_t max_tokens,
                 int64_t max_step_tokens);

  const ModelConfig& config() const { return model_.config(); }
  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  // Runs `tokens` after the cached ones; logits for the last token, or every token.
  void forward(std::span<const int32_t> tokens, std::span<float> logits, bool all_positions);
  // Every MoE layer's routing of each forward, on either device (null: off).
  void set_routing_observer(Decoder::RoutingObserver observer);
  // Routing approximations from the next forward on (CPU; refused on the GPU unless off).
  void set_routing_approximation(const moe::RoutingApproximation& approx);
  // Forgets the sequence: the next forward starts again at position 0.
  void reset();
  // --ep on cuda: bytes this rank's MoE layers sent to the other ranks, by profile::Link
  // (GpuDecoder::expert_parallel_bytes); empty otherwise.
  std::vector<int64_t> expert_parallel_bytes() const;

 private:
  Model& model_;
  KvDType kv_dtype_ = KvDType::kF32;  // CPU: how the cache stores rows
  int64_t capacity_ = 0;
  int64_t length_ = 0;
  std::optional<KvCache> cache_;      // CPU
  std::unique_ptr<GpuDecoder> gpu_;   // GPU
  std::vector<int32_t> block_table_;  // GPU: blocks 0..n-1 of its pool
};

// The synthetic:NAME model's options: --layers (keep only the first N) and --routing-skew.
void add_synthetic_options(CLI::App* cmd, int64_t* layers, std::string* routing_skew);
// --routing-skew: "zipf:A" (A in (0, 10]) or "uniform"; an empty string is kNone. Throws,
// naming the flag and the accepted forms, on anything else.
RoutingSkew parse_routing_skew(const std::string& text);
// The routing a synthetic model runs under, for reports: "synthetic" (kNone), "zipf:A" with A
// as a decimal ("zipf:1.0") or "uniform".
std::string routing_skew_label(const RoutingSkew& skew);

// Loads a checkpoint for `device`: the GPU path streams the map once instead of prefaulting it.
std::unique_ptr<Model> load_model_for(const std::filesystem::path& dir, const DeviceArgs& device);

}  // namespace moeinfer::cli
