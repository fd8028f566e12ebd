// `moeinfer bench [--model DIR] [--batch B] [--input-len I] [--output-len O]`: the engine's
// ceiling without HTTP. B requests of I random prompt tokens each are added at once and run to O
// generated tokens each (ignoring end-of-sequence), through the same Engine::step() the server
// drives. Reports prefill throughput (until every request has its first token), decode
// throughput (the rest), and the scheduler's share of the step time.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "cli/commands.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "runtime/engine.h"

namespace moeinfer::cli {
namespace {

struct BenchArgs {
  std::string model;
  int64_t batch = 8;
  int64_t input_len = 128;
  int64_t output_len = 128;
  int64_t max_num_batched_tokens = 0;  // 0: the whole batch's prompts in one step
  uint64_t seed = 0;
  std::string json_file;
  bool profile = false;
};

void run_bench(const BenchArgs& args) {
  MOE_CHECK(args.batch >= 1, "--batch must be >= 1");
  MOE_CHECK(args.input_len >= 1 && args.output_len >= 1,
            "--input-len and --output-len must be >= 1");
  const std::filesystem::path dir = resolve_model_dir(args.model);
  const EngineConfig config{
      .max_num_seqs = args.batch,
      .max_num_batched_tokens = args.max_num_batched_tokens > 0
                                    ? args.max_num_batched_tokens
                                    : std::max<int64_t>(args.batch * args.input_len, 512),
      .enable_prefix_caching = false,
      .profile_stages = args.profile};
  auto engine = Engine::load(dir, config, LoadOptions{});
  MOE_CHECK(args.input_len + args.output_len <= engine->max_model_len(),
            "--input-len + --output-len (", args.input_len + args.output_len,
            ") exceeds the context of ", engine->max_model_len());

  std::mt19937_64 rng(args.seed);
  const int64_t vocab = engine->model_config().vocab_size;
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  for (int64_t b = 0; b < args.batch; ++b) {
    std::vector<int32_t> prompt(args.input_len);
    for (auto& id : prompt) id = token(rng);
    engine->add_request(std::move(prompt), {.max_tokens = args.output_len, .ignore_eos = true});
  }

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto prefilled = start;
  int64_t first_tokens = 0, generated = 0;
  while (engine->has_unfinished()) {
    for (const RequestOutput& out : engine->step()) {
      generated += static_cast<int64_t>(out.token_ids.size());
      if (out.num_output_tokens == 1 && !out.token_ids.empty()) ++first_tokens;
    }
    if (first_tokens == args.batch && prefilled == start) prefilled = Clock::now();
  }
  const auto done = Clock::now();
  const double prefill_s = std::chrono::duration<double>(prefilled - start).count();
  const double decode_s = std::chrono::duration<double>(done - prefilled).count();
  const double total_s = std::chrono::duration<double>(done - start).count();
  const EngineStats stats = engine->stats();
  const double step_s = stats.schedule_seconds + stats.forward_seconds + stats.sample_seconds;
  const double prefill_tps = args.batch * args.input_len / std::max(prefill_s, 1e-9);
  const double decode_tps = (generated - args.batch) / std::max(decode_s, 1e-9);
  const double output_tps = generated / std::max(total_s, 1e-9);

  std::printf("bench: %s, batch %lld, input %lld, output %lld, %lld steps\n",
              dir.filename().c_str(), static_cast<long long>(args.batch),
              static_cast<long long>(args.input_len), static_cast<long long>(args.output_len),
              static_cast<long long>(stats.num_steps));
  std::printf("%-34s %12.2f\n", "Prefill time (s):", prefill_s);
  std::printf("%-34s %12.1f\n", "Prefill throughput (tok/s):", prefill_tps);
  std::printf("%-34s %12.2f\n", "Decode time (s):", decode_s);
  std::printf("%-34s %12.1f\n", "Decode throughput (tok/s):", decode_tps);
  std::printf("%-34s %12.1f\n", "Output token throughput (tok/s):", output_tps);
  std::printf("%-34s %12.4f\n",
              "Scheduler share of step time:", stats.schedule_seconds / std::max(step_s, 1e-12));
  std::printf("%-34s %12.4f\n",
              "Sampling share of step time:", stats.sample_seconds / std::max(step_s, 1e-12));
  nlohmann::json stages = nlohmann::json::object();
  if (args.profile) {
    // The stage profiler's view: each stage's share of the summed step time.
    std::printf("%-16s %12s %10s\n", "stage", "seconds", "share");
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      const double seconds = stats.stage_seconds[stage];
      if (seconds == 0.0) continue;
      const std::string name(profile::stage_name(static_cast<profile::Stage>(stage)));
      std::printf("%-16s %12.4f %10.4f\n", name.c_str(), seconds,
                  seconds / std::max(step_s, 1e-12));
      stages[name] = seconds;
    }
  }
  if (!args.json_file.empty()) {
    std::ofstream out(args.json_file);
    MOE_CHECK(out.good(), "cannot write ", args.json_file);
    out << nlohmann::json{{"batch", args.batch},
                          {"input_len", args.input_len},
                          {"output_len", args.output_len},
                          {"prefill_seconds", prefill_s},
                          {"prefill_throughput", prefill_tps},
                          {"decode_seconds", decode_s},
                          {"decode_throughput", decode_tps},
                          {"output_throughput", output_tps},
                          {"steps", stats.num_steps},
                          {"schedule_seconds", stats.schedule_seconds},
                          {"forward_seconds", stats.forward_seconds},
                          {"sample_seconds", stats.sample_seconds},
                          {"stage_seconds", stages}}
               .dump(2)
        << "\n";
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("bench", "Offline engine throughput (prefill and decode), no HTTP");
  auto args = std::make_shared<BenchArgs>();
  add_model_option(cmd, &args->model);
  cmd->add_option("--batch", args->batch, "Requests run together")->capture_default_str();
  cmd->add_option("--input-len", args->input_len, "Prompt tokens per request")
      ->capture_default_str();
  cmd->add_option("--output-len", args->output_len, "Tokens generated per request")
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", args->max_num_batched_tokens,
                  "Per-step token budget (0: every prompt in one step)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Random seed for the prompts")->capture_default_str();
  cmd->add_option("--json", args->json_file, "Write the results as JSON to FILE");
  cmd->add_flag("--profile", args->profile,
                "Time every stage with the stage profiler and print each one's share");
  cmd->callback([args] { run_bench(*args); });
}

}  // namespace moeinfer::cli
