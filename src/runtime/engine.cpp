#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <optional>
#include <span>

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "model/layer_plan.h"
#include "model/model_facts.h"
#include "model/synthetic.h"

namespace moeinfer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int64_t context_limit(const ModelConfig& model, const EngineConfig& config) {
  const int64_t native = model.max_position_embeddings > 0 ? model.max_position_embeddings : 4096;
  // Longer than the model was trained for is refused, not clamped: a user who asks for it
  // should learn that they do not get it.
  MOE_CHECK(config.max_model_len <= native, "--max-model-len ", config.max_model_len,
            " exceeds the model's context of ", native, " (max_position_embeddings)");
  return config.max_model_len > 0 ? config.max_model_len : native;
}

// Bytes of KV rows per token at --kv-dtype, fp8's scales included (linear-attention layers have
// none; their fixed per-sequence state is apart from this budget): the planner's figure.
size_t bytes_per_token(const ModelConfig& model, KvDType dtype) {
  return static_cast<size_t>(kv_bytes_per_token(model, dtype));
}

// Prefix caching as asked, unless the model carries recurrent state: a cached prefix's blocks
// hold its keys and values but not the state of the linear layers after it, so it could not be
// resumed from. Said once at load when it is turned off.
bool prefix_caching_for(const ModelConfig& model, const EngineConfig& config) {
  if (!config.enable_prefix_caching || !model.linear_attention) return config.enable_prefix_caching;
  std::fprintf(stderr,
               "moeinfer: %s has linear-attention layers with a recurrent state: prefix caching "
               "is off\n",
               model.model_type.c_str());
  return false;
}

int64_t pool_blocks(const ModelConfig& model, const EngineConfig& config, int64_t max_model_len) {
  if (config.num_kv_blocks > 0) return config.num_kv_blocks;
  const size_t token_bytes = bytes_per_token(model, config.kv_dtype);
  const size_t block_bytes = token_bytes * static_cast<size_t>(config.block_size);
  size_t bytes = static_cast<size_t>(config.kv_cache_mb) << 20;
  if (config.kv_cache_mb == 0) {
    bytes = std::min(static_cast<size_t>(config.max_num_seqs * max_model_len) * token_bytes,
                     size_t{4} << 30);
  }
  return std::max<int64_t>(1, static_cast<int64_t>(bytes / block_bytes));
}

}  // namespace

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kNone:
      break;
  }
  return "";
}

std::vector<double> EngineStats::estimated_stage_seconds() const {
  std::vector<double> total(profile::kNumStages, 0.0);
  for (const StageSample& s : stage_samples) {
    if (s.timed_steps == 0) continue;
    const double scale = static_cast<double>(s.steps) / static_cast<double>(s.timed_steps);
    for (size_t i = 0; i < total.size() && i < s.timed_stage_seconds.size(); ++i) {
      total[i] += scale * s.timed_stage_seconds[i];
    }
  }
  return total;
}

double EngineStats::estimated_step_seconds() const {
  double total = 0.0;
  for (const StageSample& s : stage_samples) {
    if (s.timed_steps == 0) continue;
    total += static_cast<double>(s.steps) / static_cast<double>(s.timed_steps) *
             s.timed_step_seconds;
  }
  return total;
}

void EngineConfig::validate() const {
  MOE_CHECK(max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", max_num_seqs);
  MOE_CHECK(max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1, got ",
            max_num_batched_tokens);
  MOE_CHECK(block_size >= 1, "block_size must be >= 1, got ", block_size);
  MOE_CHECK(num_kv_blocks >= 0, "num_kv_blocks must be >= 0, got ", num_kv_blocks);
  MOE_CHECK(kv_cache_mb >= 0, "kv_cache_mb must be >= 0, got ", kv_cache_mb);
  MOE_CHECK(max_model_len >= 0, "max_model_len must be >= 0, got ", max_model_len);
  MOE_CHECK(device == "cpu" || device == "cuda", "device must be cpu or cuda, got '", device,
            "'");
  MOE_CHECK(gpu_memory_fraction > 0.0 && gpu_memory_fraction <= 1.0,
            "gpu_memory_fraction must be in (0, 1], got ", gpu_memory_fraction);
  MOE_CHECK(profile_time_every >= 0, "profile_time_every must be >= 0, got ",
            profile_time_every);
  MOE_CHECK(!generation_config.empty(),
            "generation_config must be auto, vllm or a folder holding generation_config.json");
}

namespace {

GpuOptions gpu_options(const ModelConfig& model, const EngineConfig& config) {
  return GpuOptions{.weight_dtype = config.weight_dtype,
                    .gpu_memory_fraction = config.gpu_memory_fraction,
                    .max_batch_tokens = config.max_num_batched_tokens,
                    .max_num_seqs = config.max_num_seqs,
                    .max_model_len = context_limit(model, config),
                    .block_size = config.block_size,
                    .num_kv_blocks = config.num_kv_blocks,
                    .cuda_graphs = config.cuda_graphs,
                    .programmatic_launch = config.programmatic_launch,
                    .weight_prefetch_bytes = config.weight_prefetch_bytes,
                    .fold_norms = config.fold_norms,
                    .merge_attention_splits = config.merge_attention_splits,
                    .one_row_expert_blocks = config.one_row_expert_blocks,
                    .persistent_layers = config.persistent_layers,
                    .kv_cache_bytes = config.kv_cache_mb << 20,
                    // f32, the default, is the CPU's own rows: the device's own are bf16.
                    .kv_dtype = config.kv_dtype == KvDType::kFP8 ? KvDType::kFP8 : KvDType::kBF16,
                    .deterministic = config.deterministic,
                    .small_batch_moe_rows = config.fused_moe_rows,
                    .skinny_gemm_rows = config.skinny_gemm_rows,
                    .fused_route_tokens = config.fused_route_tokens,
                    .fp8_tensor_cores = config.fp8_tensor_cores,
                    .offload = config.offload,
                    .routing = config.routing};
}

// The GPU decoder's options for `rank`, with its placement file read for `moe_layers`.
GpuOptions gpu_rank_options(const ModelConfig& model, const EngineConfig& config,
                            const GpuRank& rank, std::span<const int64_t> moe_layers) {
  GpuOptions options = gpu_options(model, config);
  options.device = rank.device;
  options.expert_parallel = rank.expert_parallel;
  options.ranks_on_device = rank.ranks_on_device;
  options.ep_transport = rank.ep_transport;
  options.micro_batches = rank.micro_batches;
  options.overlap_micro_batches = rank.overlap_micro_batches;
  if (!rank.placement.empty()) {
    MOE_CHECK(rank.expert_parallel != nullptr, "--placement ", rank.placement.string(),
              " needs expert parallelism (--ep N with N > 1)");
    options.placement = parallel::read_placement(rank.placement, model.num_experts,
                                                 rank.expert_parallel->size(), moe_layers);
  }
  return options;
}

}  // namespace

std::unique_ptr<Engine> Engine::load(const std::filesystem::path& dir, const EngineConfig& config,
                                     const LoadOptions& options, const GpuRank& rank) {
  config.validate();
  moe::check_routing_device(config.routing, config.device == "cuda");
  if (config.device == "cuda") {
    // A model the GPU refuses is refused from its config.json, before binding its weights.
    const ModelConfig model_config = load_model_config(dir / "config.json");
    check_weight_format(config.expert_weights, model_config, /*cuda=*/true);
    check_weight_scope(config.expert_weights, config.weight_scope);
    check_gpu_support(model_config);
    check_gpu_kv_dtype(model_config, gpu_options(model_config, config).kv_dtype);
    check_gpu_offload(model_config, config.offload);
    // The GPU reads the map once while uploading; prefaulting it first would read it twice.
    // --weights fp8|int4: the GPU holds the codes the loader keeps (model/quantized_matrix.h).
    auto model = Model::load(dir, LoadOptions{.prefault = false,
                                              .expert_weights = config.expert_weights,
                                              .weight_scope = config.weight_scope});
    Tokenizer tokenizer = Tokenizer::from_dir(dir);
    auto gpu = GpuDecoder::create(
        model->config(), model->decoder().weights(),
        gpu_rank_options(model->config(), config, rank, moe_layer_indices(model->config())));
    return std::make_unique<Engine>(std::move(model), std::move(gpu), std::move(tokenizer),
                                    config);
  }
  LoadOptions cpu_options = options;
  cpu_options.expert_weights = config.expert_weights;
  cpu_options.weight_scope = config.weight_scope;
  auto model = Model::load(dir, cpu_options);
  // A decode step carries at most max_num_seqs tokens: the static policy's streaming slots.
  model->decoder().set_offload(config.offload, config.max_num_seqs);
  model->decoder().set_routing_approximation(config.routing);
  Tokenizer tokenizer = Tokenizer::from_dir(dir);
  return std::make_unique<Engine>(std::move(model), std::move(tokenizer), config);
}

std::unique_ptr<Engine> Engine::load_synthetic(const std::string& name, int64_t num_layers,
                                               const SyntheticGpuOptions& synthetic,
                                               const EngineConfig& config, const GpuRank& rank) {
  config.validate();
  MOE_CHECK(config.device == "cuda", "synthetic models are built on the GPU: use --device cuda");
  check_synthetic_weight_format(config.expert_weights, name, config.offload.enabled());
  check_weight_scope(config.expert_weights, config.weight_scope);
  moe::check_routing_device(config.routing, /*cuda=*/true);
  const ModelConfig model_config = synthetic_model_config(name, num_layers);
  Tokenizer tokenizer = Tokenizer::from_json(synthetic_tokenizer_json(model_config.vocab_size),
                                             "synthetic:" + name);
  // --weights fp8|int4: the experts' codes (one source of the flag: the engine's config).
  SyntheticGpuOptions options = synthetic;
  options.expert_weights = config.expert_weights;
  options.weight_scope = config.weight_scope;
  auto gpu = GpuDecoder::create_synthetic(
      model_config, gpu_rank_options(model_config, config, rank, moe_layer_indices(model_config)),
      options);
  return std::make_unique<Engine>(nullptr, std::move(gpu), std::move(tokenizer), config);
}

Engine::Engine(std::unique_ptr<Model> model, Tokenizer tokenizer, const EngineConfig& config)
    : Engine(std::move(model), nullptr, std::move(tokenizer), config) {}

Engine::Engine(std::unique_ptr<Model> model, std::unique_ptr<GpuDecoder> gpu, Tokenizer tokenizer,
               const EngineConfig& config)
    : model_(std::move(model)),
      gpu_(std::move(gpu)),
      model_config_(gpu_ ? gpu_->config() : model_->config()),
      tokenizer_(std::move(tokenizer)),
      config_((config.validate(), config)),
      max_model_len_(gpu_ ? gpu_->max_model_len() : context_limit(model_config_, config)),
      // On the GPU the pool lives on the device; the host pool is a placeholder of one block.
      pool_(model_config_.num_layers,
            model_config_.mla ? model_config_.mla->cache_width() : model_config_.kv_dim(),
            model_config_.mla ? 0 : model_config_.kv_dim(), config.block_size,
            gpu_ ? 1 : pool_blocks(model_config_, config, max_model_len_),
            kv_pool_layout(model_config_, gpu_ ? 0 : config.max_num_seqs, config.kv_dtype)),
      blocks_(gpu_ ? gpu_->num_kv_blocks() : pool_.num_blocks(),
              gpu_ ? gpu_->block_size() : config.block_size,
              prefix_caching_for(model_config_, config)),
      // Recurrent state slots (linear-attention layers): the device's on cuda, as many as the
      // host pool holds otherwise.
      state_slots_(gpu_ ? gpu_->num_state_slots() : pool_.recurrent_state().num_slots()),
      scheduler_({.max_num_seqs = config.max_num_seqs,
                  .max_num_batched_tokens = config.max_num_batched_tokens},
                 blocks_, state_slots_.num_slots() > 0 ? &state_slots_ : nullptr),
      seed_source_(std::random_device{}()) {
  MOE_CHECK(model_ || gpu_, "an engine needs a model");
  // On cuda the GPU decoder has its own deterministic path (GpuOptions::deterministic).
  if (config.deterministic && !gpu_) cpu::set_batch_invariant(true);
  if (config.generation_config == "auto") {
    generation_defaults_ = GenerationDefaults::load(model_dir());
  } else if (config.generation_config != "vllm") {
    const std::filesystem::path dir = config.generation_config;
    MOE_CHECK(std::filesystem::exists(dir / "generation_config.json"), "--generation-config ",
              dir.string(), ": no generation_config.json there (auto, vllm or a folder)");
    generation_defaults_ = GenerationDefaults::load(dir);
  }
  for (int64_t id : model_config_.eos_token_ids) eos_ids_.insert(static_cast<int32_t>(id));
  if (config.profile_stages || config.offload.enabled() || steps_collectively()) {
    // Offloading or expert parallelism alone keeps a profiler for its counters (the expert
    // cache's, the bytes on the network), timing no stage.
    const ModelConfig& m = model_config_;
    const int64_t time_every = config.profile_time_every > 0 ? config.profile_time_every
                               : gpu_                         ? kGpuProfileTimeEvery
                                                              : 1;
    profiler_ = std::make_unique<profile::Profiler>(
        profile::ProfilerOptions{.num_layers = m.num_layers,
                                 .num_experts = m.num_experts,
                                 .time_every = time_every,
                                 .time_stages = config.profile_stages});
    totals_.num_layers = m.num_layers;
    totals_.num_experts = m.num_experts;
  }
  if (config.offload.enabled()) {
    const int64_t L = model_config_.num_layers;
    totals_.expert_cache.assign(static_cast<size_t>(L * offload::kNumCacheCounters), 0);
    totals_.expert_cache_bytes.assign(static_cast<size_t>(L), 0);
    totals_.expert_cache_stall_seconds.assign(static_cast<size_t>(L), 0.0);
  }
  if (config.profile_stages) {
    const ModelConfig& m = model_config_;
    totals_.stage_seconds.assign(profile::kNumStages, 0.0);
    for (EngineStats::StageSample& s : totals_.stage_samples) {
      s.timed_stage_seconds.assign(profile::kNumStages, 0.0);
    }
    totals_.last_step_stage_seconds.assign(profile::kNumStages, 0.0);
    totals_.expert_rows.assign(static_cast<size_t>(m.num_layers * m.num_experts), 0);
  }
}

void Engine::check_request(std::span<const int32_t> prompt, const GenerationParams& params) const {
  const int64_t n = static_cast<int64_t>(prompt.size());
  MOE_CHECK(n > 0, "the prompt has no tokens");
  MOE_CHECK(n < max_model_len_, "the prompt has ", n, " tokens but the context holds ",
            max_model_len_, " (prompt and at least one generated token)");
  const int64_t V = model_config().vocab_size;
  for (int32_t id : prompt) {
    MOE_CHECK(id >= 0 && id < V, "token id ", id, " outside the vocabulary of ", V);
  }
  MOE_CHECK(params.max_tokens >= 1 || (params.max_tokens == 0 && params.prompt_logprobs >= 0),
            "max_tokens must be >= 1 (0 only to score the prompt), got ", params.max_tokens);
  MOE_CHECK(params.logprobs <= 20, "logprobs must be <= 20, got ", params.logprobs);
  MOE_CHECK(params.prompt_logprobs <= 20, "prompt_logprobs must be <= 20, got ",
            params.prompt_logprobs);
  MOE_CHECK(params.num_sequences >= 1 && params.num_sequences <= kMaxSequencesPerRequest,
            "a request takes 1 to ", kMaxSequencesPerRequest, " sequences, got ",
            params.num_sequences);
  for (const std::string& s : params.stop) MOE_CHECK(!s.empty(), "stop strings must not be empty");
  Sampler::validate(params.sampling);
  for (const auto& [token, bias] : params.sampling.logit_bias) {
    MOE_CHECK(token < V, "logit_bias token id ", token, " outside the vocabulary of ", V);
  }
  const int64_t longest = std::min(n + params.max_tokens, max_model_len_);
  MOE_CHECK(blocks_.blocks_for(longest) <= blocks_.num_blocks(), "a request of ", longest,
            " tokens needs ", blocks_.blocks_for(longest), " KV blocks but the pool has ",
            blocks_.num_blocks());
}

RequestId Engine::add_request(std::vector<int32_t> prompt, const GenerationParams& params) {
  check_request(prompt, params);
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (params.grammar && !token_trie_) {
    token_trie_ = std::make_unique<TokenTrie>(TokenTrie::from_tokenizer(tokenizer_));
  }

  const RequestId group = next_id_;
  Group& g = groups_[group];
  for (int64_t i = 0; i < params.num_sequences; ++i) {
    auto r = std::make_unique<Request>();
    r->id = next_id_++;
    r->group = group;
    r->index = i;
    r->arrival = next_arrival_++;
    r->params = params;
    r->params.sampling.seed =
        params.has_seed ? params.sampling.seed + static_cast<uint64_t>(i) : seed_source_();
    // Only the first sequence scores the prompt; the others reuse its KV blocks.
    if (i > 0) r->params.prompt_logprobs = -1;
    r->tokens = prompt;
    r->num_prompt_tokens = n;
    r->sampler = std::make_unique<Sampler>(r->params.sampling);
    r->detokenizer = std::make_unique<StreamDecoder>(tokenizer_, params.skip_special_tokens);
    if (params.grammar) r->matcher = std::make_unique<JsonMatcher>(params.grammar);
    // Later sequences wait for the first one's prefill, then find its blocks in the prefix
    // cache; without the cache there is nothing to wait for.
    if (i == 0 || !blocks_.prefix_caching()) {
      scheduler_.add(r.get());
    } else {
      g.deferred.push_back(r->id);
    }
    g.live.push_back(r->id);
    requests_.emplace(r->id, std::move(r));
  }
  totals_.prompt_tokens += n;
  return group;
}

void Engine::abort_request(RequestId id) {
  const auto g = groups_.find(id);
  if (g == groups_.end()) return;
  const std::vector<RequestId> live = g->second.live;  // finish() edits the group
  for (RequestId key : live) {
    RequestOutput out;
    finish(*requests_.at(key), FinishReason::kAbort, out);
    aborted_.push_back(std::move(out));
  }
}

bool Engine::has_started(RequestId id) const {
  const auto g = groups_.find(id);
  if (g == groups_.end()) return false;
  return std::any_of(g->second.live.begin(), g->second.live.end(), [&](RequestId key) {
    const Request& r = *requests_.at(key);
    return r.status == RequestStatus::kRunning || r.num_computed > 0;
  });
}

void Engine::score(std::span<const int32_t> ids, std::span<float> logits) {
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t V = model_config().vocab_size;
  MOE_CHECK(n > 0, "score: no token ids given");
  MOE_CHECK(n <= max_model_len_, "score: ", n, " ids but the context holds ", max_model_len_);
  MOE_CHECK(static_cast<int64_t>(logits.size()) == n * V, "score: logits hold ", logits.size(),
            " floats, ", n, " ids need ", n * V);
  for (int32_t id : ids) {
    MOE_CHECK(id >= 0 && id < V, "token id ", id, " outside the vocabulary of ", V);
  }
  MOE_CHECK(!steps_collectively(), "score: not under expert parallelism (every rank would have "
            "to run it)");
  SequenceBlocks seq;
  MOE_CHECK(blocks_.allocate(seq, n), "score: ", n, " tokens need ", blocks_.blocks_for(n),
            " KV blocks but ", blocks_.num_free_blocks(), " of ", blocks_.num_blocks(),
            " are free now");
  // A model with recurrent state runs the ids in a state slot of their own.
  std::optional<int32_t> state_slot;
  if (state_slots_.num_slots() > 0) {
    state_slot = state_slots_.acquire();
    MOE_CHECK(state_slot, "score: every recurrent state slot (", state_slots_.num_slots(),
              ") is held by a running request");
  }
  struct Release {
    BlockManager& blocks;
    SequenceBlocks& seq;
    StateSlots& states;
    std::optional<int32_t> slot;
    ~Release() {
      blocks.free(seq);
      if (slot) states.release(*slot);
    }
  } release{blocks_, seq, state_slots_, state_slot};
  // The profiler is not watching: this is not a step, and nothing of it reaches the stats.
  const int64_t chunk = config_.max_num_batched_tokens;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t count = std::min(chunk, n - start);
    ForwardBatch batch{.sequences = {SequenceBatch{.tokens = ids.subspan(start, count),
                                                   .position = start,
                                                   .block_table = seq.table,
                                                   .want_logits = true,
                                                   .state_slot = state_slot.value_or(-1)}},
                       .all_positions = true};
    const std::span<float> rows = logits.subspan(start * V, count * V);
    if (gpu_) {
      gpu_->forward(batch, rows);
    } else {
      model_->decoder().forward(batch, pool_, rows);
    }
  }
}

void Engine::set_routing_observer(Decoder::RoutingObserver observer) {
  if (gpu_) {
    gpu_->set_routing_observer(std::move(observer));
  } else {
    model_->decoder().set_routing_observer(std::move(observer));
  }
}

bool Engine::steps_collectively() const {
  if (gpu_) return gpu_->expert_parallel() != nullptr;
  return model_ && model_->decoder().expert_parallel() != nullptr;
}

int64_t Engine::num_queued_tokens() const {
  int64_t tokens = 0;
  for (const auto& [id, r] : requests_) tokens += r->num_uncomputed();
  return tokens;
}

EngineStats Engine::stats() const {
  EngineStats s = totals_;
  s.num_running = scheduler_.num_running();
  s.num_waiting = scheduler_.num_waiting();
  s.kv = blocks_.stats();
  s.num_preemptions = scheduler_.num_preemptions();
  return s;
}

std::vector<RequestOutput> Engine::step() {
  std::vector<RequestOutput> outputs = std::move(aborted_);
  aborted_.clear();
  // The profiler, when on, watches this thread for the step (the stages below report to it).
  std::optional<profile::ActiveProfiler> watch;
  if (profiler_) watch.emplace(profiler_.get());
  auto start = Clock::now();
  const SchedulerOutput scheduled = scheduler_.schedule();
  const double schedule_seconds = seconds_since(start);
  totals_.schedule_seconds += schedule_seconds;
  if (scheduled.empty()) {
    // The other ranks' tokens still pass through this rank's experts.
    if (steps_collectively()) {
      if (gpu_) {
        gpu_->forward(ForwardBatch{}, {});
      } else {
        model_->decoder().forward(ForwardBatch{}, pool_, {});
      }
    }
    return outputs;
  }
  if (profiler_) {
    profiler_->begin_step(scheduled.num_tokens);
    profiler_->add_time(profile::Stage::kSchedule, static_cast<int64_t>(schedule_seconds * 1e9));
  }
  start = Clock::now();
  run_model(scheduled);
  const double forward_seconds = seconds_since(start);
  totals_.forward_seconds += forward_seconds;
  scheduler_.commit(scheduled);
  start = Clock::now();
  {
    MOE_PROFILE_SCOPE(profile::Stage::kSample);
    sample(scheduled, outputs);
  }
  const double sample_seconds = seconds_since(start);
  totals_.sample_seconds += sample_seconds;
  totals_.computed_tokens += scheduled.num_tokens;
  ++totals_.num_steps;
  if (profiler_) {
    profiler_->end_step();
    const profile::StepRecord& step = profiler_->steps().back();
    for (size_t i = 0; i < totals_.expert_cache.size(); ++i) {
      totals_.expert_cache[i] += step.expert_cache[i];
    }
    for (size_t l = 0; l < totals_.expert_cache_bytes.size(); ++l) {
      totals_.expert_cache_bytes[l] += step.expert_cache_bytes[l];
      totals_.expert_cache_stall_seconds[l] += step.expert_cache_stall_s[l];
    }
    for (const profile::Link link :
         {profile::Link::kNetwork, profile::Link::kPeerGpu, profile::Link::kSameGpu}) {
      totals_.network_bytes += step.link_bytes[static_cast<int>(link)];
    }
    for (size_t i = 0; i < step.expert_rows.size() && i < totals_.expert_rows.size(); ++i) {
      totals_.expert_rows[i] += step.expert_rows[i];
    }
    const bool prompt_step = scheduled.num_tokens > static_cast<int64_t>(scheduled.chunks.size());
    EngineStats::StageSample& sample =
        totals_.stage_samples[prompt_step ? EngineStats::kPromptStep : EngineStats::kDecodeStep];
    ++sample.steps;
    if (step.timed) {
      ++totals_.timed_steps;
      ++sample.timed_steps;
      sample.timed_step_seconds += schedule_seconds + forward_seconds + sample_seconds;
      std::vector<double>& last = totals_.last_step_stage_seconds;
      std::fill(last.begin(), last.end(), 0.0);
      for (int64_t row = 0; row <= totals_.num_layers; ++row) {
        for (int stage = 0; stage < profile::kNumStages; ++stage) {
          last[stage] += step.stage_ns[row * profile::kNumStages + stage] * 1e-9;
        }
      }
      for (int stage = 0; stage < profile::kNumStages; ++stage) {
        totals_.stage_seconds[stage] += last[stage];
        sample.timed_stage_seconds[stage] += last[stage];
      }
    }
    profiler_->clear();  // the totals above are all a long-running engine keeps
  }
  return outputs;
}

void Engine::run_model(const SchedulerOutput& scheduled) {
  ForwardBatch batch;
  // A request that scores its prompt needs the logits of every position its chunk runs; the
  // batch then gives every chunk that wants logits all its rows, and sample() takes the last.
  for (const ScheduledChunk& c : scheduled.chunks) {
    batch.all_positions = batch.all_positions || c.request->wants_prompt_logits();
  }
  logit_row_start_.clear();
  int64_t rows = 0;
  for (const ScheduledChunk& c : scheduled.chunks) {
    const Request& r = *c.request;
    const bool want = c.samples() || r.wants_prompt_logits();
    batch.sequences.push_back(
        {.tokens = std::span<const int32_t>(r.tokens).subspan(r.num_computed, c.num_tokens),
         .position = r.num_computed,
         .block_table = r.blocks.table,
         .want_logits = want,
         .state_slot = r.state_slot});
    logit_row_start_.push_back(rows);
    if (want) rows += batch.all_positions ? c.num_tokens : 1;
  }
  logit_row_start_.push_back(rows);
  MOE_CHECK(rows == Decoder::num_logit_rows(batch), "logits rows: ", rows, " counted, ",
            Decoder::num_logit_rows(batch), " by the decoder");
  sampled_on_gpu_ = false;
  if (gpu_) {
    gpu_rows_.clear();
    // --deterministic samples every row here: which sampler a request meets (the GPU's draws
    // differ from the host's) must not depend on its batch mates' fields.
    bool all_on_gpu = !batch.all_positions && !config_.deterministic;
    for (const ScheduledChunk& c : scheduled.chunks) {
      if (!c.samples()) continue;
      const Request& r = *c.request;
      all_on_gpu = all_on_gpu && samples_on_gpu(r);
      const SamplingParams& sp = r.params.sampling;
      gpu_rows_.push_back({.temperature = sp.temperature,
                           .top_k = static_cast<int32_t>(sp.top_k),
                           .top_p = sp.top_p,
                           .seed = sp.seed,
                           .step = static_cast<uint64_t>(r.num_output_tokens())});
    }
    if (all_on_gpu) {
      gpu_tokens_.resize(static_cast<size_t>(rows));
      gpu_->forward_sample(batch, gpu_rows_, gpu_tokens_);
      sampled_on_gpu_ = true;
      return;
    }
    logits_.resize(static_cast<size_t>(rows * model_config().vocab_size));
    gpu_->forward(batch, logits_);
    return;
  }
  logits_.resize(static_cast<size_t>(rows * model_config().vocab_size));
  model_->decoder().forward(batch, pool_, logits_);
}

bool Engine::samples_on_gpu(const Request& r) {
  // The GPU sampler has no penalties, min-p, logit bias or logprobs: such rows bring their logits
  // back and are sampled here, by the same Sampler as on the CPU.
  const SamplingParams& sp = r.params.sampling;
  return r.params.logprobs < 0 && !r.params.score_sequences && sp.min_p <= 0.0f &&
         sp.repetition_penalty == 1.0f && sp.presence_penalty == 0.0f &&
         sp.frequency_penalty == 0.0f && sp.logit_bias.empty() && !r.params.grammar;
}

bool Engine::mask_logits(Request& r, std::span<const float> logits) {
  const int64_t V = static_cast<int64_t>(logits.size());
  token_mask_.resize(static_cast<size_t>(std::max(V, token_trie_->vocab_size())));
  r.matcher->allowed_tokens(*token_trie_, token_mask_);
  if (r.matcher->can_finish()) {
    for (int32_t id : eos_ids_) {
      if (id < static_cast<int64_t>(token_mask_.size())) token_mask_[id] = 1;
    }
    for (int32_t id : r.params.stop_token_ids) {
      if (id >= 0 && id < static_cast<int64_t>(token_mask_.size())) token_mask_[id] = 1;
    }
  }
  masked_logits_.assign(logits.begin(), logits.end());
  bool any = false;
  for (int64_t t = 0; t < V; ++t) {
    if (token_mask_[t]) {
      any = true;
    } else {
      masked_logits_[t] = -std::numeric_limits<float>::infinity();
    }
  }
  return any;
}

void Engine::gather_prompt_logprobs(Request& r, int64_t first_position,
                                    std::span<const float> rows) {
  const int64_t V = model_config().vocab_size;
  const int64_t num_rows = static_cast<int64_t>(rows.size()) / V;
  for (int64_t j = 0; j < num_rows; ++j) {
    // The row of position p predicts token p + 1; entries already gathered (before a
    // preemption) are not taken twice.
    const int64_t target = first_position + j + 1;
    if (target >= r.num_prompt_tokens) break;
    if (target != static_cast<int64_t>(r.prompt_logprobs.size()) + 1) continue;
    r.prompt_logprobs.push_back(Sampler::logprobs(rows.subspan(j * V, V), r.tokens[target],
                                                  r.params.prompt_logprobs));
  }
}

void Engine::release_siblings(const Request& r) {
  const auto g = groups_.find(r.group);
  if (g == groups_.end()) return;
  for (RequestId key : g->second.deferred) scheduler_.add(requests_.at(key).get());
  g->second.deferred.clear();
}

void Engine::sample(const SchedulerOutput& scheduled, std::vector<RequestOutput>& outputs) {
  const int64_t V = model_config().vocab_size;
  for (size_t chunk = 0; chunk < scheduled.chunks.size(); ++chunk) {
    const ScheduledChunk& c = scheduled.chunks[chunk];
    Request& r = *c.request;
    // After commit, num_computed counts this chunk's tokens.
    const int64_t first_position = r.num_computed - c.num_tokens;
    const int64_t row_start = logit_row_start_[chunk];
    const int64_t num_rows = logit_row_start_[chunk + 1] - row_start;
    // Rows for every position of the chunk: run_model asked for them because the request still
    // scores its prompt.
    if (r.params.prompt_logprobs >= 0 && num_rows == c.num_tokens && num_rows > 0 &&
        !sampled_on_gpu_ && r.wants_prompt_logits()) {
      gather_prompt_logprobs(
          r, first_position, std::span<const float>(logits_.data() + row_start * V, num_rows * V));
    }
    // A request that samples has every token computed.
    if (r.num_uncomputed() != 0) continue;
    if (r.num_output_tokens() == 0) release_siblings(r);
    RequestOutput out{.id = r.group, .index = r.index};
    if (r.params.prompt_logprobs >= 0 && !r.prompt_logprobs_sent) {
      out.prompt_logprobs = r.prompt_logprobs;
      r.prompt_logprobs_sent = true;
    }
    if (r.params.max_tokens == 0) {  // the prompt only was asked for: nothing is sampled
      finish(r, FinishReason::kLength, out);
      outputs.push_back(std::move(out));
      continue;
    }
    // The chunk's last logits row is the one to sample from (all its rows when the batch
    // wanted every position). Rows the GPU sampled bring no logits back.
    const int64_t this_row = row_start + num_rows - 1;
    const std::span<const float> logits =
        sampled_on_gpu_ ? std::span<const float>()
                        : std::span<const float>(logits_.data() + this_row * V, V);
    const std::span<const int32_t> all(r.tokens);
    // A constrained request draws from its masked row (the logprobs stay the raw row's); with
    // no token left (a vocabulary without the bytes the grammar needs) it stops.
    std::span<const float> candidates = logits;
    if (r.matcher) {
      if (!mask_logits(r, logits)) {
        r.held_text += r.detokenizer->flush();
        release_text(r, /*final=*/true, out.text);
        finish(r, FinishReason::kStop, out);
        outputs.push_back(std::move(out));
        continue;
      }
      candidates = masked_logits_;
    }
    const int32_t token =
        sampled_on_gpu_ ? gpu_tokens_[this_row]
                        : r.sampler->sample(candidates,
                                            {.prompt = all.first(r.num_prompt_tokens),
                                             .output = all.subspan(r.num_prompt_tokens)});
    r.tokens.push_back(token);
    ++totals_.generation_tokens;

    out.token_ids = {token};
    if (r.params.logprobs >= 0 || r.params.score_sequences) {
      TokenLogprob lp = Sampler::logprobs(logits, token, std::max<int64_t>(r.params.logprobs, 0));
      r.cumulative_logprob += lp.logprob;
      if (r.params.logprobs >= 0) out.logprobs.push_back(std::move(lp));
    }
    out.cumulative_logprob = r.cumulative_logprob;
    // A constrained request's end-of-sequence token came because the value is complete: it
    // stops even with ignore_eos.
    const bool stop_token =
        ((!r.params.ignore_eos || r.matcher) && eos_ids_.count(token)) ||
        std::find(r.params.stop_token_ids.begin(), r.params.stop_token_ids.end(), token) !=
            r.params.stop_token_ids.end();
    bool grammar_closed = false;
    if (r.matcher && !stop_token) {
      MOE_CHECK(r.matcher->advance(token_trie_->bytes(token)), "token ", token,
                " was allowed by the grammar but does not advance it");
      grammar_closed = r.matcher->closed();
    }
    if (stop_token) {
      r.held_text += r.detokenizer->flush();
      release_text(r, /*final=*/true, out.text);
      finish(r, FinishReason::kStop, out);
    } else {
      r.held_text += r.detokenizer->push(token);
      if (release_text(r, /*final=*/false, out.text)) {
        finish(r, FinishReason::kStop, out);
      } else if (grammar_closed) {  // the value is complete and nothing can follow it
        r.held_text += r.detokenizer->flush();
        release_text(r, /*final=*/true, out.text);
        finish(r, FinishReason::kStop, out);
      } else if (r.num_output_tokens() >= r.params.max_tokens ||
                 static_cast<int64_t>(r.tokens.size()) >= max_model_len_) {
        r.held_text += r.detokenizer->flush();
        const bool stopped = release_text(r, /*final=*/true, out.text);
        finish(r, stopped ? FinishReason::kStop : FinishReason::kLength, out);
      }
    }
    if (out.finish == FinishReason::kNone) {
      out.num_prompt_tokens = r.num_prompt_tokens;
      out.num_output_tokens = r.num_output_tokens();
      out.num_cached_tokens = r.num_cached_tokens;
    }
    outputs.push_back(std::move(out));
  }
}

bool Engine::release_text(Request& r, bool final, std::string& out) const {
  std::string& held = r.held_text;
  size_t best = std::string::npos, best_len = 0;
  for (const std::string& s : r.params.stop) {
    const size_t at = held.find(s);
    if (at < best) best = at, best_len = s.size();
  }
  if (best != std::string::npos) {
    out += held.substr(0, best + (r.params.include_stop_str_in_output ? best_len : 0));
    held.clear();
    return true;
  }
  size_t hold = 0;  // the longest end of `held` that begins some stop string
  if (!final) {
    for (const std::string& s : r.params.stop) {
      for (size_t k = std::min(s.size() - 1, held.size()); k > hold; --k) {
        if (held.compare(held.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
      }
    }
  }
  out += held.substr(0, held.size() - hold);
  held.erase(0, held.size() - hold);
  return false;
}

void Engine::finish(Request& r, FinishReason reason, RequestOutput& out) {
  scheduler_.remove(&r);
  r.finish = reason;
  out.id = r.group;
  out.index = r.index;
  out.finish = reason;
  out.cumulative_logprob = r.cumulative_logprob;
  out.num_prompt_tokens = r.num_prompt_tokens;
  out.num_output_tokens = r.num_output_tokens();
  out.num_cached_tokens = r.num_cached_tokens;
  const auto g = groups_.find(r.group);
  if (g != groups_.end()) {
    std::erase(g->second.live, r.id);
    std::erase(g->second.deferred, r.id);
    if (g->second.live.empty()) {
      out.last = true;
      groups_.erase(g);
    }
  }
  requests_.erase(r.id);  // destroys r
}

}  // namespace moeinfer
