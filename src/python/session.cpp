#include "python/session.h"

#include <algorithm>
#include <unordered_map>

#include "core/error.h"

namespace moeinfer::python {

Session::Session(std::unique_ptr<Engine> engine, ChatConfig chat,
                 const std::string& tool_call_parser)
    : engine_(std::move(engine)), chat_(std::move(chat)) {
  MOE_CHECK(engine_ != nullptr, "a session needs an engine");
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

std::unique_ptr<Session> Session::load(const std::filesystem::path& dir, const EngineConfig& config,
                                       const std::string& tool_call_parser) {
  MOE_CHECK(std::filesystem::is_directory(dir), "model ", dir.string(),
            ": no such folder (a checkpoint folder holds config.json, *.safetensors and "
            "tokenizer.json)");
  auto engine = Engine::load(dir, config, LoadOptions{});
  return std::make_unique<Session>(std::move(engine), load_chat_config(dir), tool_call_parser);
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
  engine_->set_routing_observer(nullptr);
  trace_.reset();
  if (path.empty()) return;
  const ModelConfig& config = engine_->model_config();
  trace_ = std::make_unique<RoutingTraceWriter>(path, config.num_layers, config.num_experts,
                                                config.num_experts_per_tok);
  engine_->set_routing_observer(
      [this](int64_t layer, const moe::Routing& routing) { trace_->record(layer, routing); });
}

std::vector<RequestOutput> Session::step() {
  const int64_t records = trace_ ? trace_->records() : 0;
  std::vector<RequestOutput> outputs = engine_->step();
  if (trace_ && trace_->records() != records) trace_->next_step();
  return outputs;
}

void Session::score(std::span<const int32_t> ids, std::span<float> logits) {
  const int64_t records = trace_ ? trace_->records() : 0;
  engine_->score(ids, logits);
  if (trace_ && trace_->records() != records) trace_->next_step();
}

void Session::abort_all(const std::vector<RequestId>& ids) {
  for (RequestId id : ids) engine_->abort_request(id);
  while (engine_->has_unfinished()) step();
}

std::vector<RequestResult> Session::run(const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<GenerationParams>& params,
                                        const std::function<bool()>& should_stop) {
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
    const RequestId id = engine_->add_request(prompts[i], params[i]);
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
