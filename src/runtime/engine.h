// The engine: owns the model, the tokenizer, the paged KV pool, the block manager and the
// scheduler, and advances every live request by one step() at a time. Requests join and leave
// the running batch between steps. Not thread-safe: one thread drives it (the server's engine
// thread, or a benchmark loop); see server/server.h for how HTTP threads talk to it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "io/generation_config.h"
#include "io/tokenizer.h"
#include "kv/block_manager.h"
#include "kv/kv_cache.h"
#include "model/gpu_decoder.h"
#include "model/model.h"
#include "moe/routing_approx.h"
#include "offload/offload_options.h"
#include "profile/profiler.h"
#include "runtime/request.h"
#include "runtime/scheduler.h"

namespace moeinfer {

struct EngineConfig {
  int64_t max_num_seqs = 64;             // requests in the running batch at most
  int64_t max_num_batched_tokens = 512;  // per-step token budget (prefill chunks + decodes)
  int64_t block_size = 16;               // tokens per KV block
  int64_t num_kv_blocks = 0;             // 0: from kv_cache_mb
  // 0: room for max_num_seqs requests of max_model_len, at most 4 GiB (cpu), or what the weights
  // and workspace leave of gpu_memory_fraction (cuda; bf16 rows there).
  int64_t kv_cache_mb = 0;
  int64_t max_model_len = 0;  // 0: the model's max_position_embeddings
  bool enable_prefix_caching = true;
  // Times every MoE stage and counts each expert's rows (profile/profiler.h), summed into
  // EngineStats; costs a few clock reads per layer on the CPU, an event per stage on the GPU.
  bool profile_stages = false;
  // With profile_stages: stages are timed on one step in this many (rows are counted on every
  // step); 0: every step on the CPU, one in kGpuProfileTimeEvery on the GPU.
  int64_t profile_time_every = 0;
  // "cpu", or "cuda": the forward pass, the KV pool and sampling (for requests without
  // penalties, min-p or logprobs) on the GPU.
  std::string device = "cpu";
  int64_t fused_moe_rows = -1;  // cuda: GpuOptions::small_batch_moe_rows
  int64_t skinny_gemm_rows = -1;  // cuda: GpuOptions::skinny_gemm_rows (-1: its default)
  int64_t fused_route_tokens = -1;  // cuda: GpuOptions::fused_route_tokens (-1: its default)
  bool fp8_tensor_cores = true;  // cuda: GpuOptions::fp8_tensor_cores
  GpuWeightDtype weight_dtype = GpuWeightDtype::kCheckpoint;  // cuda: GpuOptions::weight_dtype
  double gpu_memory_fraction = 0.9;  // cuda: weights + workspace + KV pool within this share
  bool cuda_graphs = true;           // cuda: decode steps replay captured graphs
  bool programmatic_launch = true;   // cuda: GpuOptions::programmatic_launch
  int64_t weight_prefetch_bytes = 0;  // cuda: GpuOptions::weight_prefetch_bytes
  bool fold_norms = true;             // cuda: GpuOptions::fold_norms
  bool merge_attention_splits = false;  // cuda: GpuOptions::merge_attention_splits
  bool one_row_expert_blocks = true;    // cuda: GpuOptions::one_row_expert_blocks
  bool persistent_layers = false;       // cuda: GpuOptions::persistent_layers
  // Sampling defaults for requests that leave a field out (vLLM's --generation-config): "auto",
  // the checkpoint's generation_config.json; "vllm", none; or a folder holding one.
  std::string generation_config = "auto";
  // Batch-invariant kernels (cpu::set_batch_invariant; GpuOptions::deterministic on cuda): a
  // token's logits do not depend on the step's row count, chunking or preemption, so a seeded
  // request's text never depends on what else runs. On cuda every row is then sampled on the
  // host, so that the sampler a request meets does not depend on its batch mates either.
  bool deterministic = false;
  // --expert-budget / --expert-cache: routed experts behind a cache of what the budget holds
  // (a device cache on cuda, a simulated one on the CPU); their counters reach EngineStats.
  offload::OffloadOptions offload;
  // --active-experts, --drop-below, --expert-capacity, --router-temperature: the MoE layers'
  // routing approximations (moe/routing_approx.h); off by default. The GPU refuses
  // --expert-capacity (moe::check_routing_device).
  moe::RoutingApproximation routing;
  // --weights: the routed experts quantised at load (model/weight_quant.h), CPU only for now.
  WeightFormat expert_weights = WeightFormat::kCheckpoint;
  // --weights-scope: linear quantises every dense Linear too (model/weight_quant.h; needs
  // expert_weights fp8 or int4); on cuda those matrices are held as their codes.
  WeightScope weight_scope = WeightScope::kExperts;
  // --kv-dtype: how the pool stores KV rows (kv/kv_format.h) and so how many blocks
  // kv_cache_mb buys; f32 (the default) as computed. On cuda fp8 gives the device pool fp8 rows
  // (GpuOptions::kv_dtype) and anything else its bf16 rows.
  KvDType kv_dtype = KvDType::kF32;

  void validate() const;  // throws moeinfer::Error naming the bad field
};

struct EngineStats {
  int64_t num_running = 0;
  int64_t num_waiting = 0;
  BlockManagerStats kv;
  int64_t num_preemptions = 0;
  int64_t prompt_tokens = 0;      // prompt tokens of every added request
  int64_t computed_tokens = 0;    // tokens run through the model (prefill, recompute, decode)
  int64_t generation_tokens = 0;  // tokens sampled
  int64_t num_steps = 0;
  double schedule_seconds = 0.0;  // time in the scheduler, over all steps
  double forward_seconds = 0.0;   // time in Decoder::forward
  double sample_seconds = 0.0;    // sampling, detokenising, stop checks
  // With EngineConfig::profile_stages: time per profiler stage summed over layers and steps
  // ([profile::kNumStages], by profile::Stage), and rows each expert received ([L, E]).
  std::vector<double> stage_seconds;
  std::vector<int64_t> expert_rows;
  // With profile_stages: the steps whose stages were timed (EngineConfig::profile_time_every).
  int64_t timed_steps = 0;
  // With profile_stages: bytes this rank sent to other ranks (under --ep, the MoE layers'
  // dispatched rows as encoded by --dispatch-dtype and the outputs sent back), over all steps; 0
  // in one process. Every link between ranks: profile::Link::kNetwork on CPU ranks, and on GPU
  // ranks also kPeerGpu and kSameGpu (NCCL or staged through host memory: --ep-transport).
  int64_t network_bytes = 0;
  // With profile_stages, per kind of step (kPromptStep: it ran prompt tokens; kDecodeStep: one
  // new token per request): the steps, the timed ones, and their step time (schedule + forward
  // + sample) and stage times. The estimates scale each kind's timed steps to all of its steps,
  // so that under sampled timing one timed prefill does not stand for many decode steps.
  struct StageSample {
    int64_t steps = 0;
    int64_t timed_steps = 0;
    double timed_step_seconds = 0.0;
    std::vector<double> timed_stage_seconds;  // [profile::kNumStages]
  };
  static constexpr int kPromptStep = 0, kDecodeStep = 1;
  StageSample stage_samples[2];
  // Stage seconds ([profile::kNumStages]) and step seconds over the steps of the kinds that had
  // a timed step, estimated from the timed ones.
  std::vector<double> estimated_stage_seconds() const;
  double estimated_step_seconds() const;
  // With profile_stages: the latest timed step's time per stage ([profile::kNumStages], summed
  // over layers), for per-step histograms; a change in timed_steps says it is a new one.
  std::vector<double> last_step_stage_seconds;
  int64_t num_layers = 0;
  int64_t num_experts = 0;
  // With EngineConfig::offload: the expert cache's counts per layer since the start
  // ([L, offload::kNumCacheCounters], by offload::CacheCounter), expert bytes host to device
  // ([L]) and seconds waited for demand copies ([L]); empty without offloading.
  std::vector<int64_t> expert_cache;
  std::vector<int64_t> expert_cache_bytes;
  std::vector<double> expert_cache_stall_seconds;
  bool expert_offload() const { return !expert_cache.empty(); }
};

// Where a GPU engine's decoder runs and whom its MoE layers exchange with: one rank of an
// expert-parallel job on cuda (load_expert_parallel_engine in engine_ranks.h sets it per rank);
// the default is one process on device 0, every expert local.
struct GpuRank {
  int device = 0;                                     // GpuOptions::device
  parallel::Communicator* expert_parallel = nullptr;  // GpuOptions::expert_parallel
  std::filesystem::path placement;                    // --placement FILE; empty: contiguous ranges
  int ranks_on_device = 1;                            // GpuOptions::ranks_on_device
  EpTransport ep_transport = EpTransport::kAuto;      // GpuOptions::ep_transport
  int micro_batches = 1;                              // GpuOptions::micro_batches
  bool overlap_micro_batches = true;                  // GpuOptions::overlap_micro_batches
};

class Engine {
 public:
  Engine(std::unique_ptr<Model> model, Tokenizer tokenizer, const EngineConfig& config);
  // A GPU engine: `model` (the host checkpoint, may be null for synthetic weights) stays for
  // its metadata, `gpu` runs every step.
  Engine(std::unique_ptr<Model> model, std::unique_ptr<GpuDecoder> gpu, Tokenizer tokenizer,
         const EngineConfig& config);
  // Loads the checkpoint folder (config.json, safetensors, tokenizer.json), onto config.device;
  // on cuda the decoder runs as `rank` says.
  static std::unique_ptr<Engine> load(const std::filesystem::path& dir, const EngineConfig& config,
                                      const LoadOptions& options = {}, const GpuRank& rank = {});
  // A synthetic model ("qwen3-30b-a3b", ...) with random weights built on the GPU, cut to
  // `num_layers` when > 0, and a generated tokenizer of the model's vocabulary size. The routed
  // experts take config.expert_weights (--weights fp8|int4: random codes of that format; the
  // synthetic options' own expert_weights is overridden).
  static std::unique_ptr<Engine> load_synthetic(const std::string& name, int64_t num_layers,
                                                const SyntheticGpuOptions& synthetic,
                                                const EngineConfig& config,
                                                const GpuRank& rank = {});

  const ModelConfig& model_config() const { return model_config_; }
  // The checkpoint's folder; empty for synthetic models.
  std::filesystem::path model_dir() const { return model_ ? model_->dir() : std::filesystem::path(); }
  // The GPU decoder, or null on the CPU.
  const GpuDecoder* gpu() const { return gpu_.get(); }
  GpuDecoder* gpu_decoder() { return gpu_.get(); }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  const EngineConfig& config() const { return config_; }
  int64_t max_model_len() const { return max_model_len_; }
  int64_t num_kv_blocks() const { return blocks_.num_blocks(); }
  // Whether prompts may start from cached blocks: the config's choice, off for a model with
  // recurrent state (a cached prefix has no saved state to resume from).
  bool prefix_caching() const { return blocks_.prefix_caching(); }
  // From config.generation_config (io/generation_config.h); empty when there is none.
  const GenerationDefaults& generation_defaults() const { return generation_defaults_; }

  // Queues a request of params.num_sequences sequences. Throws moeinfer::Error for an empty
  // prompt, ids outside the vocabulary (prompt or logit_bias), a prompt that leaves no room in
  // the context, bad sampling parameters, or a sequence that could not fit the KV pool even
  // alone. Generation stops at max_tokens or at the context's end.
  RequestId add_request(std::vector<int32_t> prompt, const GenerationParams& params);
  // The checks add_request makes, without queueing anything: throws what it would throw.
  void check_request(std::span<const int32_t> prompt, const GenerationParams& params) const;
  // Ends every sequence of a request; their last outputs (finish reason abort) come from the
  // next step(). Unknown or finished ids are ignored.
  void abort_request(RequestId id);
  // One scheduling decision, one batched forward pass, one sampled token per sequence that
  // finished its prefill. Outputs only for sequences that produced something or finished; the
  // output with `last` set is the request's final one. Under expert parallelism
  // (steps_collectively()) every step runs one forward, of zero tokens when nothing is
  // scheduled: each MoE layer's dispatch and combine need every rank.
  std::vector<RequestOutput> step();
  // Logits of every position of `ids` run as one sequence, between steps: logits holds
  // [n, V] floats, row i the model's scores for the token after ids[0..i]. Its KV blocks come
  // from the engine's pool for the call and go back after it (nothing enters the prefix cache);
  // it runs in chunks of at most max_num_batched_tokens. Throws moeinfer::Error for no ids, ids
  // outside the vocabulary, more ids than max_model_len, or a pool without room for them now.
  void score(std::span<const int32_t> ids, std::span<float> logits);
  // Every MoE layer's routing of every forward pass from now on (null: off), on either device;
  // what --trace-routing records, for the Python API's LLM(trace_routing=...).
  void set_routing_observer(Decoder::RoutingObserver observer);
  // Whether the decoder's MoE layers are collective over ranks (Decoder::set_expert_parallel,
  // or GpuOptions::expert_parallel on cuda), so that every rank's engine must step whenever one
  // does.
  bool steps_collectively() const;

  // Whether a sequence of request `id` has been scheduled at least once (it left the waiting
  // queue: vLLM's end of queue time); false for unknown and finished ids.
  bool has_started(RequestId id) const;
  bool has_unfinished() const { return !requests_.empty() || !aborted_.empty(); }
  int64_t num_unfinished() const { return static_cast<int64_t>(groups_.size()); }
  // Tokens of live sequences not yet run through the model (prompts waiting, chunks left).
  int64_t num_queued_tokens() const;
  EngineStats stats() const;

 private:
  void run_model(const SchedulerOutput& scheduled);
  void sample(const SchedulerOutput& scheduled, std::vector<RequestOutput>& outputs);
  // Logprobs of the prompt tokens that the chunk's logits rows ([num_tokens, V], one per
  // position the chunk ran) predict.
  void gather_prompt_logprobs(Request& r, int64_t first_position, std::span<const float> rows);
  // The sequences of r's request that waited for its prompt's prefill join the queue.
  void release_siblings(const Request& r);
  // Moves decoded text that can no longer be part of a stop string into `out`; true when a stop
  // string was found.
  bool release_text(Request& r, bool final, std::string& out) const;
  void finish(Request& r, FinishReason reason, RequestOutput& out);
  // The logits row with every token the request's grammar cannot take next at -inf (end of
  // sequence and stop tokens only when the value is complete); false when no token is left.
  bool mask_logits(Request& r, std::span<const float> logits);

  // Whether a request's sampling can run on the GPU sampler.
  static bool samples_on_gpu(const Request& r);

  std::unique_ptr<Model> model_;
  std::unique_ptr<GpuDecoder> gpu_;
  ModelConfig model_config_;
  Tokenizer tokenizer_;
  EngineConfig config_;
  GenerationDefaults generation_defaults_;
  int64_t max_model_len_;
  KvBlockPool pool_;
  BlockManager blocks_;
  // The recurrent state slots of a model with linear-attention layers (none otherwise): one per
  // running sequence, max_num_seqs in all, in pool_.recurrent_state().
  StateSlots state_slots_;
  Scheduler scheduler_;
  std::unordered_set<int32_t> eos_ids_;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;  // by Request::id
  // A request's sequences by its id: those not finished, and of them those that wait for the
  // first one's prefill before they join the scheduler's queue.
  struct Group {
    std::vector<RequestId> live;
    std::vector<RequestId> deferred;
  };
  std::unordered_map<RequestId, Group> groups_;
  std::vector<RequestOutput> aborted_;  // reported by the next step()
  RequestId next_id_ = 1;
  uint64_t next_arrival_ = 0;
  std::mt19937_64 seed_source_;
  std::vector<float> logits_;                    // [rows, V]
  std::vector<int64_t> logit_row_start_;         // [chunks] first logits row of each chunk
  std::vector<int32_t> gpu_tokens_;              // sampled on the GPU this step, by row
  std::vector<GpuSamplingRow> gpu_rows_;
  // Constrained decoding: the vocabulary's bytes, built at the first constrained request; the
  // step's masked logits row and token mask ([V]).
  std::unique_ptr<TokenTrie> token_trie_;
  std::vector<float> masked_logits_;
  std::vector<uint8_t> token_mask_;
  bool sampled_on_gpu_ = false;
  std::unique_ptr<profile::Profiler> profiler_;  // with config.profile_stages
  EngineStats totals_;
};

}  // namespace moeinfer
