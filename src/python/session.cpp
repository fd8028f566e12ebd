#include "python/session.h"

#include <algorithm>
#include <cstdio>
#include <unordered_map>

#include "core/error.h"
#include "kv/kv_format.h"
#include "moe/row_codec.h"
#include "offload/parse_options.h"

namespace moeinfer::python {

EngineConfig engine_config(const SessionOptions& o) {
  MOE_CHECK(o.device == "cpu" || o.device == "cuda", "device must be 'cpu' or 'cuda', got '",
            o.device, "'");
  MOE_CHECK(o.dtype == "auto" || o.dtype == "bfloat16" || o.dtype == "bf16",
            "dtype must be 'auto' or 'bfloat16', got '", o.dtype, "'");
  MOE_CHECK(o.device == "cuda" || o.dtype == "auto",
            "dtype applies to device='cuda' (the CPU computes with the checkpoint's weights as "
            "stored)");
  MOE_CHECK(o.weights.empty() || o.weights == "bf16" || o.weights == "fp8" || o.weights == "int4",
            "weights must be None, 'bf16', 'fp8' or 'int4', got '", o.weights, "'");
  MOE_CHECK(o.device == "cpu" || o.weights != "bf16",
            "weights='bf16' applies to device='cpu'; on cuda dtype='bfloat16' holds the weights "
            "in bf16");
  MOE_CHECK(o.weights_scope == "experts" || o.weights_scope == "linear",
            "weights_scope must be 'experts' or 'linear', got '", o.weights_scope, "'");
  MOE_CHECK(o.weights_scope != "linear" || o.weights == "fp8" || o.weights == "int4",
            "weights_scope='linear' quantises every Linear weight to the format of weights: "
            "pass weights='fp8' or weights='int4' with it");
  MOE_CHECK(o.gpu_memory_fraction > 0.0 && o.gpu_memory_fraction <= 1.0,
            "gpu_memory_utilization must be in (0, 1], got ", o.gpu_memory_fraction);
  MOE_CHECK(o.ep >= 1, "ep must be >= 1, got ", o.ep);
  MOE_CHECK(o.ep > 1 || o.placement.empty(), "placement needs ep > 1");
  MOE_CHECK(o.ep > 1 || o.overlap, "overlap=False needs ep > 1");
  MOE_CHECK(o.ep > 1 || o.dispatch_dtype == "f32", "dispatch_dtype='", o.dispatch_dtype,
            "' needs ep > 1");
  MOE_CHECK(o.dispatch_dtype == "f32" || o.dispatch_dtype == "bf16" || o.dispatch_dtype == "fp8",
            "dispatch_dtype must be 'f32', 'bf16' or 'fp8', got '", o.dispatch_dtype, "'");
  MOE_CHECK(o.micro_batches == 1 || o.micro_batches == 2, "micro_batches must be 1 or 2, got ",
            o.micro_batches);
  MOE_CHECK(o.ep > 1 || o.micro_batches == 1, "micro_batches=", o.micro_batches,
            " needs ep > 1: without expert parallelism nothing travels to overlap");
  MOE_CHECK(o.renorm.empty() || o.renorm == "kept" || o.renorm == "full",
            "renorm must be 'kept' or 'full', got '", o.renorm, "'");
  MOE_CHECK(o.renorm.empty() || o.active_experts != 0, "renorm='", o.renorm,
            "' needs active_experts");
  MOE_CHECK(o.overflow.empty() || o.overflow == "drop" || o.overflow == "reroute",
            "overflow must be 'drop' or 'reroute', got '", o.overflow, "'");
  MOE_CHECK(o.overflow.empty() || o.expert_capacity != 0.0, "overflow='", o.overflow,
            "' needs expert_capacity");
  MOE_CHECK(o.active_experts >= 0, "active_experts must be at least 1, got ", o.active_experts);
  EngineConfig config;
  config.routing = {
      .active_experts = o.active_experts,
      .renorm = o.renorm == "full" ? moe::KeptRenorm::kFull : moe::KeptRenorm::kKept,
      .drop_below = o.drop_below,
      .expert_capacity = o.expert_capacity,
      .overflow = o.overflow == "reroute" ? moe::CapacityOverflow::kReroute
                                          : moe::CapacityOverflow::kDrop,
      .router_temperature = o.router_temperature};
  // The values on their own; K' <= K once the model is known (the decoders check it at load).
  moe::validate(config.routing, moe::RouterOptions{.num_experts = INT32_MAX, .top_k = INT32_MAX});
  config.device = o.device;
  config.max_num_seqs = o.max_num_seqs;
  config.max_num_batched_tokens = o.max_num_batched_tokens;
  config.max_model_len = o.max_model_len;
  config.kv_cache_mb = o.kv_cache_mb;
  MOE_CHECK(o.kv_dtype == "auto" || o.kv_dtype == "f32" || o.kv_dtype == "bf16" ||
                o.kv_dtype == "fp8",
            "kv_dtype must be 'auto', 'f32', 'bf16' or 'fp8', got '", o.kv_dtype, "'");
  MOE_CHECK(o.device == "cpu" || o.kv_dtype != "f32", "kv_dtype='", o.kv_dtype,
            "' applies to device='cpu': the GPU's KV cache holds bf16 or fp8 rows");
  // auto: the device's own rows (f32 on the CPU; the engine gives the GPU bf16 for it).
  config.kv_dtype = o.kv_dtype == "auto" ? KvDType::kF32 : parse_kv_dtype(o.kv_dtype);
  config.block_size = o.block_size;
  config.gpu_memory_fraction = o.gpu_memory_fraction;
  config.weight_dtype = o.dtype == "auto" ? GpuWeightDtype::kCheckpoint : GpuWeightDtype::kBf16;
  config.cuda_graphs = !o.enforce_eager;
  config.enable_prefix_caching = o.enable_prefix_caching;
  config.deterministic = o.deterministic;
  config.generation_config = o.generation_config;
  config.profile_stages = o.profile_stages;
  config.profile_time_every = o.profile_time_every;
  config.offload = offload::parse_offload_flags(o.expert_budget, o.expert_cache, o.cold_experts,
                                                o.expert_prefetch);
  config.expert_weights = parse_weight_format(o.weights);
  config.weight_scope = parse_weight_scope(o.weights_scope);
  config.validate();
  return config;
}

Session::Session(std::unique_ptr<Engine> engine, ChatConfig chat,
                 const std::string& tool_call_parser, parallel::Communicator* ranks)
    : engine_(std::move(engine)),
      comm_(ranks && ranks->size() > 1 ? ranks : nullptr),
      ranks_(*engine_, comm_ && comm_->rank() == 0 ? comm_ : nullptr),
      chat_(std::move(chat)) {
  if (chat_.chat_template) {
    template_ = std::make_unique<ChatTemplate>(ChatTemplate::parse(*chat_.chat_template));
  }
  if (tool_call_parser.empty()) {
    tool_format_ = server::default_tool_call_format(engine_->model_config().model_type);
  } else {
    const auto format = server::tool_call_format_from_name(tool_call_parser);
    MOE_CHECK(format.has_value(), "tool_call_parser '", tool_call_parser, "' is not one of none, ",
              server::tool_call_format_names());
    tool_format_ = *format;
  }
}

Session::~Session() {
  try {
    close();
  } catch (const std::exception& e) {  // a destructor must not throw; the ranks may be gone
    std::fprintf(stderr, "moeinfer: closing the expert-parallel job: %s\n", e.what());
  }
}

std::unique_ptr<Session> Session::load(const std::filesystem::path& dir,
                                       const SessionOptions& options) {
  const EngineConfig config = engine_config(options);
  MOE_CHECK(std::filesystem::is_directory(dir), "model ", dir.string(),
            ": no such folder (a checkpoint folder holds config.json, *.safetensors and "
            "tokenizer.json)");
  if (options.ep == 1) {
    return std::make_unique<Session>(Engine::load(dir, config, LoadOptions{}),
                                     load_chat_config(dir), options.tool_call_parser);
  }
  MOE_CHECK(options.device == "cpu", "ep=", options.ep,
            " on cuda is not built yet: expert parallelism runs on CPU ranks (device='cpu')");
  parallel::Communicator& world = parallel::world();
  MOE_CHECK(world.size() == options.ep, "ep=", options.ep, " but this process is one of ",
            world.size(), " rank(s): run the script as `mpirun -np ", options.ep,
            " python SCRIPT`, every rank making the same LLM(..., ep=", options.ep, ")");
  auto engine = load_expert_parallel_engine(
      dir, config,
      {.comm = &world,
       .placement = options.placement,
       .overlap_shared_experts = options.overlap,
       .dispatch_dtype = moe::parse_dispatch_dtype(options.dispatch_dtype),
       .micro_batches = options.micro_batches});
  return std::make_unique<Session>(std::move(engine), load_chat_config(dir),
                                   options.tool_call_parser, &world);
}

void Session::follow_rank_zero() {
  MOE_CHECK(comm_ != nullptr && comm_->rank() > 0,
            "follow_rank_zero is for ranks > 0 of an expert-parallel job");
  moeinfer::follow_rank_zero(*engine_, *comm_);
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  if (comm_ && comm_->rank() == 0) ranks_.stop();
}

void Session::check_rank_zero(const char* what) const {
  MOE_CHECK(!closed_, what, ": the LLM is closed");
  MOE_CHECK(rank() == 0, what, " runs on rank 0 of an expert-parallel job; rank ", rank(),
            " follows it (its LLM(...) returns only when rank 0's closes)");
}

void Session::check_single_process(const char* what) const {
  check_rank_zero(what);
  MOE_CHECK(
      comm_ == nullptr, what,
      " is not available under ep > 1: the ranks step together "
      "only through generate() and chat() (prompt_logprobs give a prompt's log-probabilities)");
}

Session::ChatRequest Session::prepare_chat(const nlohmann::ordered_json& messages,
                                           const nlohmann::ordered_json& tools,
                                           const nlohmann::ordered_json& tool_choice,
                                           bool add_generation_prompt,
                                           const nlohmann::ordered_json& template_kwargs,
                                           GenerationParams params) const {
  MOE_CHECK(template_ != nullptr, "chat: ", engine_->model_dir().string(),
            " has no chat_template (tokenizer_config.json or chat_template.jinja); use generate()");
  MOE_CHECK(messages.is_array() && !messages.empty(),
            "chat: messages must be a non-empty list of {\"role\", \"content\"} dicts");
  MOE_CHECK(template_kwargs.is_object(), "chat: chat_template_kwargs must be a dict");
  MOE_CHECK(!template_kwargs.contains("messages"),
            "chat: chat_template_kwargs must not set 'messages'");
  const nlohmann::ordered_json normalized = server::normalize_tools(tools);
  ChatRequest request;
  request.tool_choice = server::parse_tool_choice(tool_choice, normalized);
  const std::string text = apply_chat_template(*template_, messages, add_generation_prompt, chat_,
                                               {.tools = normalized, .variables = template_kwargs});
  ChatPrompt prompt = moeinfer::chat_prompt(engine_->tokenizer(), chat_, text);
  request.prompt = std::move(prompt.ids);
  params.stop_token_ids.insert(params.stop_token_ids.end(), prompt.stop_token_ids.begin(),
                               prompt.stop_token_ids.end());
  if (server::tool_choice_is_forced(request.tool_choice)) {
    MOE_CHECK(params.grammar == nullptr,
              "chat: tool_choice \"required\" or a named function forces the output's grammar, "
              "and the sampling parameters bring one too");
    params.grammar = server::tool_choice_grammar(request.tool_choice, normalized);
    request.read_tool_calls = true;
  } else if (request.tool_choice.mode == server::ToolChoice::Mode::kAuto &&
             tool_format_ != server::ToolCallFormat::kNone) {
    // As the server's "auto": the output is parsed for the format's markers, which must survive
    // decoding where they are special tokens.
    request.read_tool_calls = true;
    if (server::tool_call_format_needs_special_tokens(tool_format_)) {
      params.skip_special_tokens = false;
    }
  }
  request.params = std::move(params);
  return request;
}

void Session::trace_routing(const std::string& path) {
  if (!path.empty()) check_single_process("trace_routing");
  engine_->set_routing_observer(nullptr);
  trace_.reset();
  if (path.empty()) return;
  MOE_CHECK(!engine_->config().routing.drops(),
            "trace_routing records all K experts of every token: leave out active_experts, "
            "drop_below and expert_capacity");
  const ModelConfig& config = engine_->model_config();
  trace_ = std::make_unique<RoutingTraceWriter>(path, config.num_layers, config.num_experts,
                                                config.num_experts_per_tok);
  engine_->set_routing_observer(
      [this](int64_t layer, const moe::Routing& routing) { trace_->record(layer, routing); });
}

std::vector<RequestOutput> Session::step() {
  const int64_t records = trace_ ? trace_->records() : 0;
  std::vector<RequestOutput> outputs = ranks_.step();
  if (trace_ && trace_->records() != records) trace_->next_step();
  return outputs;
}

void Session::score(std::span<const int32_t> ids, std::span<float> logits) {
  check_single_process("logits");
  const int64_t records = trace_ ? trace_->records() : 0;
  engine_->score(ids, logits);
  if (trace_ && trace_->records() != records) trace_->next_step();
}

void Session::abort_all(const std::vector<RequestId>& ids) {
  for (RequestId id : ids) ranks_.abort_request(id);
  while (ranks_.has_unfinished()) step();
}

std::vector<RequestResult> Session::run(const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<GenerationParams>& params,
                                        const std::function<bool()>& should_stop) {
  check_rank_zero("generate");
  MOE_CHECK(prompts.size() == params.size(), "generate: ", prompts.size(), " prompts but ",
            params.size(), " sampling parameter sets");
  for (size_t i = 0; i < prompts.size(); ++i) {
    try {
      engine_->check_request(prompts[i], params[i]);
    } catch (const Error& e) {
      if (prompts.size() == 1) throw;
      throw Error("prompt " + std::to_string(i) + ": " + e.what(), e.where());
    }
  }
  std::vector<RequestResult> results(prompts.size());
  std::vector<RequestId> ids;
  std::unordered_map<RequestId, size_t> slot_of;
  for (size_t i = 0; i < prompts.size(); ++i) {
    RequestResult& r = results[i];
    r.prompt_token_ids = prompts[i];
    r.sequences.resize(static_cast<size_t>(params[i].num_sequences));
    for (size_t s = 0; s < r.sequences.size(); ++s) r.sequences[s].index = static_cast<int64_t>(s);
    const RequestId id = ranks_.add_request(prompts[i], params[i]);
    ids.push_back(id);
    slot_of.emplace(id, i);
  }
  size_t unfinished = prompts.size();
  bool stopped = false;
  try {
    while (unfinished > 0) {
      for (RequestOutput& out : step()) {
        const auto slot = slot_of.find(out.id);
        if (slot == slot_of.end()) continue;  // not this call's (none should be)
        RequestResult& r = results[slot->second];
        SequenceResult& s = r.sequences.at(static_cast<size_t>(out.index));
        s.token_ids.insert(s.token_ids.end(), out.token_ids.begin(), out.token_ids.end());
        s.text += out.text;
        for (TokenLogprob& lp : out.logprobs) s.logprobs.push_back(std::move(lp));
        s.cumulative_logprob = out.cumulative_logprob;
        if (out.finish != FinishReason::kNone) s.finish = out.finish;
        if (!out.prompt_logprobs.empty()) r.prompt_logprobs = std::move(out.prompt_logprobs);
        if (out.index == 0) r.num_cached_tokens = out.num_cached_tokens;
        if (out.last) --unfinished;
      }
      if (unfinished > 0 && should_stop && should_stop()) {
        stopped = true;
        break;
      }
    }
  } catch (...) {
    try {
      abort_all(ids);
    } catch (...) {  // the first error is the one to report
    }
    throw;
  }
  if (stopped) {
    abort_all(ids);
    throw Stopped();
  }
  return results;
}

nlohmann::ordered_json read_tool_calls(server::ToolCallFormat format,
                                       const server::ToolChoice& choice, const std::string& output,
                                       server::ToolCallIds& ids) {
  server::ParsedToolCalls parsed;
  if (server::tool_choice_is_forced(choice)) {
    parsed.calls = server::tool_calls_from_forced_output(choice, output, ids);
    if (parsed.calls.empty()) parsed.content = output;
  } else if (choice.mode == server::ToolChoice::Mode::kAuto) {
    parsed = server::parse_tool_calls(format, output, ids);
  } else {
    parsed.content = output;
  }
  nlohmann::ordered_json calls = nlohmann::ordered_json::array();
  for (const server::ToolCall& call : parsed.calls) {
    calls.push_back(nlohmann::ordered_json::parse(server::tool_call_json(call).dump()));
  }
  return {{"content", parsed.content ? nlohmann::ordered_json(*parsed.content) : nullptr},
          {"tool_calls", calls}};
}

}  // namespace moeinfer::python
