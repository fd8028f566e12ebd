// `moeinfer generate --model DIR --prompt TEXT [--max-tokens N] [--temperature T --top-p P
// --top-k K --seed S] [--chat]`: streams the continuation to stdout. The prompt is prefilled
// once; each new token is one decode step over the KV cache.
#include <chrono>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/model_arg.h"
#include "cli/usage_error.h"
#include "core/error.h"
#include "io/chat_template.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "profile/profiler.h"
#include "profile/routing_trace.h"
#include "runtime/chat_prompt.h"
#include "runtime/sampler.h"

namespace moeinfer::cli {
namespace {

struct GenerateArgs {
  std::string model;
  std::string prompt;
  std::string system;
  int64_t max_tokens = 128;
  SamplingParams sampling;
  bool chat = false;
  bool ignore_eos = false;
  std::string trace_routing;  // routing trace file, empty = off
  DeviceArgs device;
};

std::vector<int32_t> prompt_ids(const GenerateArgs& args, const std::filesystem::path& dir,
                                const Tokenizer& tokenizer, std::set<int32_t>* stop_ids) {
  if (!args.chat) return tokenizer.encode(args.prompt, /*add_special_tokens=*/true);
  const ChatConfig chat = load_chat_config(dir);
  MOE_CHECK(chat.chat_template.has_value(), "--chat: ", dir.string(),
            " has no chat_template (tokenizer_config.json or chat_template.jinja)");
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  if (!args.system.empty()) messages.push_back({{"role", "system"}, {"content", args.system}});
  messages.push_back({{"role", "user"}, {"content", args.prompt}});
  const std::string text = apply_chat_template(ChatTemplate::parse(*chat.chat_template), messages,
                                               /*add_generation_prompt=*/true, chat);
  ChatPrompt prompt = chat_prompt(tokenizer, chat, text);
  stop_ids->insert(prompt.stop_token_ids.begin(), prompt.stop_token_ids.end());
  return std::move(prompt.ids);
}

// Under --ep every rank runs the sequence, so all must feed the same next token (rank 0's) and
// stop together.
int32_t agree_on_token(const DeviceArgs& device, int32_t token) {
  parallel::Communicator* comm = device.expert_parallel();
  if (comm == nullptr) return token;
  std::vector<int32_t> all(static_cast<size_t>(comm->size()));
  comm->all_gather(&token, all.data(), sizeof(int32_t));
  return all[0];
}

void run_generate(const GenerateArgs& args) {
  Sampler::validate(args.sampling);
  MOE_CHECK(args.max_tokens >= 1, "--max-tokens must be >= 1, got ", args.max_tokens);
  MOE_CHECK(args.chat || args.system.empty(),
            "--system applies to --chat (a plain prompt is encoded as it is)");
  const std::filesystem::path dir = resolve_model_dir(args.model);
  auto model = load_model_for(dir, args.device);
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();

  std::set<int32_t> stop_ids(config.eos_token_ids.begin(), config.eos_token_ids.end());
  const std::vector<int32_t> prompt = prompt_ids(args, dir, tokenizer, &stop_ids);
  MOE_CHECK(!prompt.empty(), "the prompt encodes to no tokens");
  for (int32_t id : prompt) {
    MOE_CHECK(id < config.vocab_size, "the tokenizer gave id ", id,
              " but the model's vocabulary has ", config.vocab_size, " entries");
  }
  USAGE_CHECK(args.trace_routing.empty() || !args.device.routing_approximation().drops(),
              "--trace-routing records all K experts of every token: leave out the routing "
              "approximations (",
              args.device.routing_approximation().flags().front(), ")");
  SequenceRunner runner(*model, args.device, static_cast<int64_t>(prompt.size()) + args.max_tokens,
                       static_cast<int64_t>(prompt.size()));
  std::unique_ptr<RoutingTraceWriter> trace;
  // Under --ep every rank routes the same tokens: rank 0 records them.
  if (!args.trace_routing.empty() && args.device.is_output_rank()) {
    trace = std::make_unique<RoutingTraceWriter>(args.trace_routing, config.num_layers,
                                                 config.num_experts, config.num_experts_per_tok);
    runner.set_routing_observer(
        [&trace](int64_t layer, const moe::Routing& routing) { trace->record(layer, routing); });
  }
  const bool output = args.device.is_output_rank();
  Sampler sampler(args.sampling);
  StreamDecoder stream(tokenizer, /*skip_special_tokens=*/true);
  std::vector<float> logits(config.vocab_size);

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  runner.forward(prompt, logits, /*all_positions=*/false);
  int64_t forwards = 1;
  if (trace) trace->next_step();
  const auto prefilled = Clock::now();
  int64_t generated = 0;
  const char* stopped_by = "max tokens";  // what ended the generation, for the stats line
  while (generated < args.max_tokens) {
    const int32_t next = [&] {
      MOE_PROFILE_SCOPE(profile::Stage::kSample);
      return agree_on_token(args.device, sampler.sample(logits));
    }();
    ++generated;
    if (!args.ignore_eos && stop_ids.count(next)) {
      stopped_by = "end of sequence";
      break;
    }
    const std::string piece = stream.push(next);
    if (output) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    if (generated == args.max_tokens) break;
    if (runner.length() >= runner.capacity()) {
      stopped_by = "the context length";  // before --max-tokens: say so
      break;
    }
    const int32_t token[1] = {next};
    runner.forward(token, logits, /*all_positions=*/false);
    ++forwards;
    if (trace) trace->next_step();
  }
  const std::string rest = stream.flush();
  const auto done = Clock::now();
  if (!output) return;
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fputc('\n', stdout);
  const double prefill_s = std::chrono::duration<double>(prefilled - start).count();
  const double decode_s = std::chrono::duration<double>(done - prefilled).count();
  std::fprintf(stderr,
               "[prompt %zu tokens, %.1f tok/s | generated %lld tokens, %.1f tok/s | stopped by "
               "%s]\n",
               prompt.size(), prompt.size() / std::max(prefill_s, 1e-9),
               static_cast<long long>(generated), generated / std::max(decode_s, 1e-9), stopped_by);
  // --ep on cuda: what this rank's (rank 0's) MoE layers sent to the others per step (forward),
  // by link class.
  const std::vector<int64_t> sent = runner.expert_parallel_bytes();
  if (!sent.empty()) {
    std::fprintf(stderr, "[ep: rank 0 sent per step (%lld steps):",
                 static_cast<long long>(forwards));
    for (const profile::Link link :
         {profile::Link::kSameGpu, profile::Link::kPeerGpu, profile::Link::kNetwork}) {
      const std::string name(profile::link_name(link));
      std::fprintf(stderr, " %s %.0f B", name.c_str(),
                   static_cast<double>(sent[static_cast<size_t>(link)]) / forwards);
    }
    std::fprintf(stderr, "]\n");
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "Generate text from a prompt, streamed to stdout");
  auto args = std::make_shared<GenerateArgs>();
  add_model_option(cmd, &args->model);
  cmd->add_option("--prompt", args->prompt, "Prompt text")->required();
  cmd->add_option("--system", args->system, "System message (with --chat)");
  cmd->add_option("--max-tokens", args->max_tokens, "Most tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", args->sampling.temperature, "0 = greedy")->capture_default_str();
  cmd->add_option("--top-p", args->sampling.top_p, "Nucleus sampling mass")->capture_default_str();
  cmd->add_option("--top-k", args->sampling.top_k, "Keep the K most likely tokens (0 = all)")
      ->capture_default_str();
  cmd->add_option("--seed", args->sampling.seed, "Random seed")->capture_default_str();
  cmd->add_flag("--chat", args->chat, "Apply the checkpoint's chat template");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Keep going past end-of-sequence tokens");
  add_device_options(cmd, &args->device);
  add_offload_options(cmd, &args->device);
  add_routing_options(cmd, &args->device);
  add_weight_options(cmd, &args->device);
  add_kv_options(cmd, &args->device);
  add_expert_parallel_option(cmd, &args->device);
  cmd->add_option("--trace-routing", args->trace_routing,
                  "Record every routing decision to FILE (see `moeinfer trace summarize`)");
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace moeinfer::cli
