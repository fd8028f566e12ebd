// `moeinfer serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
// [--max-num-seqs N] [--max-queue N] [--kv-cache-mb M]`: the OpenAI-compatible HTTP server
// (server/server.h). Loopback only unless --host says otherwise. SIGTERM or SIGINT: stop taking
// requests, finish the ones in flight (abort them after --shutdown-grace seconds), exit 0; a
// second signal exits at once (128 + the signal).
//
// `mpirun -np N moeinfer serve --ep N`: expert parallelism with attention data-parallel. Every
// rank loads its engine over an expert-parallel decoder (CPU ranks, or on --device cuda a GPU
// decoder on GPU rank % count with the device dispatcher); rank 0 serves HTTP and spreads the
// requests over the ranks (runtime/engine_ranks.h), the others follow its steps until it stops.
// A SIGTERM to rank 0 drains the job as above; mpirun given one hands it to every rank (Open MPI
// 4.1: odls_base_sigkill_timeout later, SIGKILL as long again after that): rank 0 drains, the
// others keep stepping until rank 0's last round.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "io/chat_template.h"
#include "model/synthetic.h"
#include "runtime/engine.h"
#include "runtime/engine_ranks.h"
#include "server/server.h"

namespace moeinfer::cli {
namespace {

#if MOE_HAVE_HTTPLIB
std::atomic<int> g_signal{0};  // the last SIGTERM / SIGINT received
#endif

struct ServeArgs {
  std::string model;
  DeviceArgs device;
  int64_t layers = 0;        // synthetic: first N layers
  std::string routing_skew;  // synthetic: zipf:A or uniform
  bool stage_metrics = false;     // --stage-metrics
  bool no_stage_metrics = false;  // --no-stage-metrics; neither: the device's default
  std::string served_name;
  server::ServerConfig server;
  EngineConfig engine;
};

#if MOE_HAVE_HTTPLIB
// Turns the first SIGTERM / SIGINT into on_first(signal name) and exits at once on the second
// (128 + the signal), as an operator who presses Ctrl-C twice means; stops watching when it goes.
class SignalWatcher {
 public:
  explicit SignalWatcher(std::function<void(const char*)> on_first)
      : thread_([this, on_first = std::move(on_first)] {
          bool first_seen = false;
          while (!done_) {
            if (const int sig = g_signal.exchange(0); sig != 0) {
              const char* name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
              if (first_seen) {
                std::fprintf(stderr, "moeinfer serve: second %s, exiting now\n", name);
                std::_Exit(128 + sig);
              }
              first_seen = true;
              on_first(name);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
        }) {}
  ~SignalWatcher() {
    done_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// A rank > 0 of serve --ep: steps with rank 0 until rank 0 stops (after its drain).
void follow_as_rank(Engine& engine, parallel::Communicator& ranks) {
  std::fprintf(stderr,
               "moeinfer serve: rank %d of %d (pid %d), stepping with rank 0 (which serves HTTP)\n",
               ranks.rank(), ranks.size(), static_cast<int>(::getpid()));
  {
    SignalWatcher watcher([&](const char* name) {
      std::fprintf(stderr, "moeinfer serve: rank %d: %s, finishing with rank 0\n", ranks.rank(),
                   name);
    });
    follow_rank_zero(engine, ranks);
  }
  std::fprintf(stderr, "moeinfer serve: rank %d stopped\n", ranks.rank());
}

// Loads the engine and serves (rank 0, or one process) or follows rank 0 (ranks > 0 of --ep).
void serve_as_rank(const ServeArgs& args, const std::filesystem::path& dir, bool synthetic,
                   parallel::Communicator* ranks) {
  const std::string synthetic_name =
      synthetic ? args.model.substr(std::string("synthetic:").size()) : "";
  std::unique_ptr<Engine> engine;
  if (ranks && synthetic) {  // cuda only, as without --ep
    engine = load_expert_parallel_synthetic(synthetic_name, args.layers,
                                            {.routing = parse_routing_skew(args.routing_skew)},
                                            args.engine, args.device);
  } else if (ranks) {
    engine = load_expert_parallel_engine(dir, args.engine, args.device);
  } else if (synthetic) {
    engine = Engine::load_synthetic(synthetic_name, args.layers,
                                    {.routing = parse_routing_skew(args.routing_skew)},
                                    args.engine);
  } else {
    engine = Engine::load(dir, args.engine, LoadOptions{});
  }
  if (ranks && ranks->rank() != 0) {
    follow_as_rank(*engine, *ranks);
    return;
  }
  server::Server server(std::move(engine), synthetic ? ChatConfig{} : load_chat_config(dir),
                        args.server, ranks);
  server.bind();
  if (ranks) {
    std::fprintf(stderr,
                 "moeinfer serve: rank 0 of %d (pid %d) serves HTTP and spreads the requests over "
                 "the ranks; SIGTERM to it drains every rank\n",
                 ranks->size(), static_cast<int>(::getpid()));
  }
  {
    SignalWatcher watcher([&](const char* name) {
      std::fprintf(stderr, "moeinfer serve: %s, finishing requests in flight\n", name);
      server.shutdown();
    });
    server.run();
  }
  std::fprintf(stderr, "moeinfer serve: stopped\n");
}

void run_serve(ServeArgs args) {
  args.engine.validate();
  MOE_CHECK(args.server.port >= 0 && args.server.port <= 65535,
            "--port must be in [0, 65535], got ", args.server.port);
  args.engine.device = args.device.device;
  MOE_CHECK(!(args.stage_metrics && args.no_stage_metrics),
            "--stage-metrics and --no-stage-metrics contradict each other");
  args.engine.profile_stages =
      args.stage_metrics || (!args.no_stage_metrics && !args.device.is_cuda());
  MOE_CHECK(args.engine.profile_time_every == 0 || args.engine.profile_stages,
            "--time-every applies with stage metrics (--stage-metrics, or the CPU's default), "
            "which are off here");
  args.engine.gpu_memory_fraction = args.device.gpu_memory_fraction;
  args.engine.fused_moe_rows = args.device.fused_moe_rows;
  args.engine.fp8_tensor_cores = args.device.fp8_tensor_cores_on();
  args.engine.weight_dtype = args.device.weight_dtype();
  args.engine.offload = args.device.offload();
  args.engine.routing = args.device.routing_approximation();
  args.engine.expert_weights = args.device.weight_format();
  args.engine.weight_scope = args.device.weight_scope();
  args.engine.kv_dtype = args.device.kv_rows_dtype();  // f32 refused on cuda
  const bool synthetic = is_synthetic_model(args.model);
  MOE_CHECK(synthetic || (args.layers == 0 && args.routing_skew.empty()),
            "--layers and --routing-skew apply to synthetic:NAME models only");
  const std::filesystem::path dir = synthetic ? std::filesystem::path() : resolve_model_dir(args.model);
  const std::string synthetic_name = synthetic ? args.model.substr(std::string("synthetic:").size()) : "";
  args.server.model_name = !args.served_name.empty() ? args.served_name
                           : synthetic               ? synthetic_name
                                                     : dir.lexically_normal().filename().string();
  if (args.server.model_name.empty())
    args.server.model_name = dir.parent_path().filename().string();

  // SIGTERM / SIGINT only set a flag (threads started before this one, such as the compute
  // pool's, may be the ones the kernel picks); a watcher thread turns it into a shutdown. The
  // handlers before these come back when serving ends: an embedding process (moeinfer.serve()
  // in Python) gets its own Ctrl-C handling back.
  struct sigaction action {};
  action.sa_handler = [](int sig) { g_signal.store(sig); };
  sigemptyset(&action.sa_mask);
  struct sigaction previous_term {}, previous_int {}, previous_pipe {};
  sigaction(SIGTERM, &action, &previous_term);
  sigaction(SIGINT, &action, &previous_int);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;  // a client that hangs up is a failed write, not a crash
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGPIPE, &ignore, &previous_pipe);
  struct RestoreSignals {
    const struct sigaction *term, *interrupt, *pipe;
    ~RestoreSignals() {
      sigaction(SIGTERM, term, nullptr);
      sigaction(SIGINT, interrupt, nullptr);
      sigaction(SIGPIPE, pipe, nullptr);
      g_signal.store(0);
    }
  } restore{&previous_term, &previous_int, &previous_pipe};

  parallel::Communicator* ranks = args.device.expert_parallel();  // null without --ep
  end_job_on_error(ranks != nullptr, [&] { serve_as_rank(args, dir, synthetic, ranks); });
}

#else
void run_serve(ServeArgs) {
  MOE_FAIL(
      "this moeinfer was built without cpp-httplib; install libcpp-httplib-dev "
      "(scripts/install-deps.sh) and rebuild");
}
#endif

}  // namespace

void add_serve_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "Serve the model over an OpenAI-compatible HTTP API");
  auto args = std::make_shared<ServeArgs>();
  add_model_option(cmd, &args->model);
  cmd->add_option("--host", args->server.host, "Address to bind (loopback by default)")
      ->capture_default_str();
  cmd->add_option("--port", args->server.port, "Port to bind (0: any free port)")
      ->capture_default_str();
  cmd->add_option("--api-key", args->server.api_key,
                  "Require 'Authorization: Bearer KEY' on every endpoint but /health");
  cmd->add_option("--served-model-name", args->served_name,
                  "Model id in the API (default: the model folder's name)");
  cmd->add_option("--tool-call-parser", args->server.tool_call_parser,
                  "How chat outputs are parsed for tool calls (vLLM's names): hermes, mistral, "
                  "deepseek_v3 or none (default: the model family's format; docs/serving.md)");
  cmd->add_option("--max-num-seqs", args->engine.max_num_seqs,
                  "Requests in the running batch at most")
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", args->engine.max_num_batched_tokens,
                  "Tokens per engine step (prefill chunks and decodes)")
      ->capture_default_str();
  cmd->add_option("--max-queue", args->server.max_queue,
                  "Requests waiting beyond the running batch; more get 429")
      ->capture_default_str();
  cmd->add_option("--kv-cache-mb", args->engine.kv_cache_mb,
                  "KV cache size in MiB (0: cpu, room for max-num-seqs full-length requests, "
                  "<= 4 GiB; cuda, what --gpu-memory-fraction leaves)")
      ->capture_default_str();
  cmd->add_option("--block-size", args->engine.block_size, "Tokens per KV block")
      ->capture_default_str();
  cmd->add_option("--max-model-len", args->engine.max_model_len,
                  "Context length (0: the model's own)")
      ->capture_default_str();
  cmd->add_option("--generation-config", args->engine.generation_config,
                  "Sampling defaults for fields a request leaves out: auto (the checkpoint's "
                  "generation_config.json), vllm (none) or a folder holding one")
      ->capture_default_str();
  cmd->add_flag("--deterministic", args->engine.deterministic,
                "Batch-invariant kernels: a seeded request's text does not depend on what else "
                "runs (cpu and cuda; slower, see docs/serving.md)");
  cmd->add_flag("!--no-prefix-caching", args->engine.enable_prefix_caching,
                "Do not reuse KV blocks of repeated prompt prefixes");
  // Stage metrics: on by default on the CPU (a few clock reads per layer); on the GPU the CUDA
  // events cost 8-17% of a timed step, ~2% of decode steps when one in 16 is timed
  // (bench/RESULTS.md), so they are asked for there.
  cmd->add_flag("--stage-metrics", args->stage_metrics,
                "Time the MoE stages and count expert rows for /metrics and /dashboard "
                "(default: on for --device cpu, off for --device cuda)");
  cmd->add_flag("--no-stage-metrics", args->no_stage_metrics,
                "Do not time the MoE stages or count expert rows");
  cmd->add_option("--time-every", args->engine.profile_time_every,
                  "With stage metrics: time the stages of one step in N, count rows on every "
                  "step (default: 1 on the CPU, 16 on the GPU)")
      ->check(CLI::Range(1, 1 << 30));
  add_device_options(cmd, &args->device);
  add_offload_options(cmd, &args->device);
  add_routing_options(cmd, &args->device);
  add_weight_options(cmd, &args->device);
  add_kv_options(cmd, &args->device);
  add_expert_parallel_option(cmd, &args->device);
  add_synthetic_options(cmd, &args->layers, &args->routing_skew);
  cmd->add_option("--shutdown-grace", args->server.shutdown_grace_seconds,
                  "Seconds to let requests in flight finish after SIGTERM")
      ->capture_default_str();
  cmd->add_option("--header-timeout", args->server.header_timeout_seconds,
                  "Seconds a request line and its headers may take to arrive (slow senders "
                  "are answered 408)")
      ->capture_default_str();
  cmd->add_option("--body-timeout", args->server.body_timeout_seconds,
                  "Seconds a request body may take to arrive after its headers")
      ->capture_default_str();
  cmd->add_option("--min-request-rate", args->server.min_request_rate,
                  "Bytes a second a request's headers and body must average after the grace "
                  "period, else 408 (Apache mod_reqtimeout's MinRate; 0: no minimum)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--min-request-rate-grace", args->server.min_request_rate_grace_seconds,
                  "Seconds of headers or body before --min-request-rate applies")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--send-timeout", args->server.send_timeout_seconds,
                  "Seconds the client may leave written bytes untaken; a stream to a slower "
                  "reader is aborted and its connection closed (0: no bound)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("!--disable-log-requests", args->server.log_requests,
                "Do not write an access-log line per request to stderr");
  cmd->add_option("--log-interval", args->server.log_interval_seconds,
                  "Seconds between engine log lines (throughput, running, waiting, KV use) "
                  "while there is work; 0: none")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--allowed-hosts", args->server.allowed_hosts,
                  "Host header names to answer, comma-separated (others get 421; default: any)")
      ->delimiter(',');
  cmd->callback([args] { run_serve(*args); });
}

}  // namespace moeinfer::cli
