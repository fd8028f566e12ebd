// What the Python module's LLM runs on: one Engine over a checkpoint, the checkpoint's chat
// template and tool-call format, and the loop that takes a batch of requests through
// Engine::step() (the continuous batching the server uses) to their ends. Plain C++, no Python
// types: module.cpp converts, this decides.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "io/chat_template.h"
#include "parallel/communicator.h"
#include "profile/routing_trace.h"
#include "runtime/chat_prompt.h"
#include "runtime/engine.h"
#include "runtime/engine_ranks.h"
#include "server/tool_calls.h"

namespace moeinfer::python {

// One sequence of a request, gathered over the steps that produced it.
struct SequenceResult {
  int64_t index = 0;
  std::string text;
  std::vector<int32_t> token_ids;      // [num_output_tokens]
  std::vector<TokenLogprob> logprobs;  // [num_output_tokens] when asked for, else empty
  double cumulative_logprob = 0.0;     // sum of the sampled tokens' logprobs (when kept)
  FinishReason finish = FinishReason::kNone;
};

struct RequestResult {
  std::vector<int32_t> prompt_token_ids;      // [T]
  std::vector<TokenLogprob> prompt_logprobs;  // [T - 1] with prompt_logprobs, else empty
  std::vector<SequenceResult> sequences;      // [num_sequences], by index
  int64_t num_cached_tokens = 0;              // prompt tokens found in the prefix cache
};

// Thrown by Session::run when `should_stop` said so, after every request was aborted.
class Stopped : public std::exception {
 public:
  const char* what() const noexcept override { return "generation stopped"; }
};

// What LLM(...) asks for: the engine's configuration as the Python arguments spell it.
struct SessionOptions {
  std::string device = "cpu";
  std::string dtype = "auto";  // "auto" or "bfloat16" (cuda)
  std::string weights;         // "", "bf16", "fp8" or "int4": moeinfer's --weights (CPU)
  std::string weights_scope = "experts";  // "experts" or "linear": moeinfer's --weights-scope
  double gpu_memory_fraction = 0.9;
  int64_t max_model_len = 0;  // 0: the model's own
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  int64_t kv_cache_mb = 0;
  std::string kv_dtype = "auto";  // moeinfer's --kv-dtype: auto, f32, bf16 or fp8 (CPU)
  int64_t block_size = 16;
  bool enable_prefix_caching = true;
  bool enforce_eager = false;
  // offload/parse_options.h; empty: the default
  std::string expert_budget, expert_cache, cold_experts, expert_prefetch;
  bool deterministic = false;
  std::string generation_config = "auto";
  bool profile_stages = false;
  int64_t profile_time_every = 0;
  // A format of server/tool_calls.h by vLLM's name, "none", or empty for the model family's
  // (default_tool_call_format).
  std::string tool_call_parser;
  // Expert parallelism: the job's MPI ranks (this process one of them), a placement file of
  // `moeinfer placement`, and whether the shared experts overlap the rows' travel.
  int ep = 1;
  std::string placement;
  bool overlap = true;
  std::string dispatch_dtype = "f32";  // how dispatch encodes the rows it sends: f32, bf16, fp8
  int micro_batches = 1;  // 2: each rank's step runs as two micro-batches alternating per MoE layer
  // Routing approximations (moe/routing_approx.h), as --active-experts, --renorm, --drop-below,
  // --expert-capacity, --overflow, --router-temperature; 0 / "" / 1: off, not given.
  int64_t active_experts = 0;
  std::string renorm;  // "kept" or "full", with active_experts
  double drop_below = 0.0;
  double expert_capacity = 0.0;
  std::string overflow;  // "drop" or "reroute", with expert_capacity
  double router_temperature = 1.0;
};

// The engine's configuration from the options; throws moeinfer::Error naming a bad one.
EngineConfig engine_config(const SessionOptions& options);

class Session {
 public:
  // `ranks`: the job's communicator under expert parallelism (null: one process); on rank 0
  // the session's requests go to every rank's engine through EngineRanks.
  Session(std::unique_ptr<Engine> engine, ChatConfig chat, const std::string& tool_call_parser,
          parallel::Communicator* ranks = nullptr);
  // Rank 0 under expert parallelism: close().
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Loads the checkpoint folder onto options.device (Engine::load) with its chat config; with
  // options.ep > 1 this process must be one of the ep ranks of an MPI job (mpirun -np ep).
  static std::unique_ptr<Session> load(const std::filesystem::path& dir,
                                       const SessionOptions& options);

  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }
  // Under expert parallelism: this process's rank and the job's ranks (else 0 and 1).
  int rank() const { return comm_ ? comm_->rank() : 0; }
  int num_ranks() const { return comm_ ? comm_->size() : 1; }
  // Ranks > 0: steps with rank 0, round after round, until rank 0's session closes.
  void follow_rank_zero();
  // Rank 0 under expert parallelism: the last round, which lets the other ranks' follow_rank_zero
  // return; the session runs nothing after it. Idempotent; a no-op without ranks.
  void close();
  // Rank 0: the engines' figures (summed over the ranks) and each rank's load.
  EngineStats stats() const { return ranks_.stats(); }
  const std::vector<RankStatus>& rank_status() const { return ranks_.ranks(); }
  server::ToolCallFormat tool_format() const { return tool_format_; }
  bool has_chat_template() const { return template_ != nullptr; }

  // A conversation as the engine runs it: `messages` (a JSON array of {role, content, ...})
  // rendered by the checkpoint's chat template with `tools` (OpenAI's tools array, or null) and
  // `template_kwargs` (more template variables, an object), tokenised as the server does it;
  // `params` gain the template's end-of-turn stop token, with tools the grammar that forces a
  // "required" or named tool_choice (null: OpenAI's default, auto with tools), and with the
  // format's markers being special tokens, skip_special_tokens off so that they can be read
  // back. Throws moeinfer::Error without a template or when the template fails,
  // server::ApiError for malformed tools or tool_choice.
  struct ChatRequest {
    std::vector<int32_t> prompt;  // [T]
    GenerationParams params;
    server::ToolChoice tool_choice;
    bool read_tool_calls = false;  // whether outputs are read for tool calls
  };
  ChatRequest prepare_chat(const nlohmann::ordered_json& messages,
                           const nlohmann::ordered_json& tools,
                           const nlohmann::ordered_json& tool_choice, bool add_generation_prompt,
                           const nlohmann::ordered_json& template_kwargs,
                           GenerationParams params) const;

  // Every prompt as one request of the engine, all queued before the first step so that they
  // share steps; runs Engine::step() until each has finished. should_stop is asked after every
  // step: when it says true, every request is aborted (their KV blocks freed) and Stopped is
  // thrown. An error of the engine aborts the requests too and reaches the caller. All requests
  // are checked before any is queued, so a bad one leaves the engine untouched.
  // Records every MoE layer's routing of every later forward pass (generate, chat, score) to
  // the routing-trace file `path` (profile/routing_trace.h; one step per engine step);
  // an empty path stops and closes the file. A trace already open is closed first.
  void trace_routing(const std::string& path);

  // Engine::score, recorded by trace_routing as one step per chunk.
  void score(std::span<const int32_t> ids, std::span<float> logits);

  std::vector<RequestResult> run(const std::vector<std::vector<int32_t>>& prompts,
                                 const std::vector<GenerationParams>& params,
                                 const std::function<bool()>& should_stop);

 private:
  // Aborts `ids` and steps until the engine has nothing left (their final outputs dropped).
  void abort_all(const std::vector<RequestId>& ids);
  // One engine step; with a trace, the records it made close one trace step.
  std::vector<RequestOutput> step();

  // Rank 0's requests, steps and aborts go through here (straight to engine_ without ranks).
  void check_rank_zero(const char* what) const;
  // What a forward pass outside Engine::step needs: every rank to run it, which only step does.
  void check_single_process(const char* what) const;

  std::unique_ptr<Engine> engine_;
  parallel::Communicator* comm_ = nullptr;
  EngineRanks ranks_;
  bool closed_ = false;
  ChatConfig chat_;
  std::unique_ptr<ChatTemplate> template_;
  server::ToolCallFormat tool_format_ = server::ToolCallFormat::kNone;
  std::unique_ptr<RoutingTraceWriter> trace_;
};

// Tool calls of one chat output, as the server reads them: with tool_choice "required" or a
// named function the forced JSON, else the format's markers (kNone: none). Returns
// {"content": text or null, "tool_calls": [OpenAI tool_call objects]}; tool_calls is empty
// when the output holds none (content is then the whole output).
nlohmann::ordered_json read_tool_calls(server::ToolCallFormat format,
                                       const server::ToolChoice& choice, const std::string& output,
                                       server::ToolCallIds& ids);

}  // namespace moeinfer::python
