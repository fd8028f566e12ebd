// `moeinfer profile [--model DIR|synthetic:NAME] [--batch B] [--input-len I] [--output-len O]
// --out DIR [--seed S] [--text-file FILE] [--repeats R] [--time-every N] [--device cuda]`: runs a
// fixed workload with the stage profiler on and writes DIR/report.txt, DIR/report.json and
// DIR/report.html (see docs/profiling.md). Synthetic models (random weights of a published
// shape, built on the GPU) need --device cuda.
//
// The workload: B sequences of I tokens (seeded random ids, or windows of a text file) are
// prefilled together in one batched step, then O decode steps each advance all B sequences by
// one sampled token. Every step goes through Decoder::forward(ForwardBatch, KvBlockPool) (or the
// GPU decoder's forward_sample, whose stages are timed with CUDA events and which samples on the
// device as the engine does) with blocks from a
// BlockManager, as the engine does; the block bookkeeping and batch assembly are
// the "schedule" stage, sampling the "sample" stage.
//
// Before the profiled run the same workload runs R times with the profiler off and R times on,
// interleaved, after one warm-up; the best times give the profiler's measured overhead, and so
// do blocks of one decode step repeated with the profiler off and on alternating. The
// cost of one scope (on and off) is measured in a loop and, times the scopes per step, gives an
// estimate that does not depend on how noisy the machine is.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/model_arg.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/tokenizer.h"
#include "kv/block_manager.h"
#include "kv/kv_cache.h"
#include "model/model.h"
#include "model/synthetic.h"
#include "profile/profiler.h"
#include "profile/report.h"
#include "profile/routing_trace.h"
#include "runtime/sampler.h"

namespace moeinfer::cli {
namespace {

// Decode steps per side in the paired A/B of the overhead measurement.
constexpr int64_t kPairedSteps = 200;

struct ProfileArgs {
  std::string model;
  int64_t batch = 4;
  int64_t input_len = 64;
  int64_t output_len = 32;
  std::string out;
  uint64_t seed = 0;
  std::string text_file;  // empty: random token ids
  int64_t repeats = 3;    // off/on pairs for the overhead measurement; 0 skips it
  int64_t time_every = 0;  // stages timed on one step in N; 0: 1 on the CPU, 16 on the GPU
  DeviceArgs device;
  int64_t layers = 0;        // synthetic: first N layers
  std::string routing_skew;  // synthetic: zipf:A or uniform
};

// Bytes of one routed expert's weights (gate, up, down) in each layer; 0 for dense layers.
std::vector<int64_t> checkpoint_expert_bytes(const Decoder& decoder) {
  std::vector<int64_t> bytes;
  for (const LayerWeights& lw : decoder.weights().layers) {
    const auto& experts = lw.moe.routed.experts;
    if (!lw.is_moe || experts.empty()) {
      bytes.push_back(0);
      continue;
    }
    bytes.push_back(moe::expert_nbytes(experts.front()));
  }
  return bytes;
}

// The same for a synthetic model, whose weights are bf16 on the device.
std::vector<int64_t> synthetic_expert_bytes(const ModelConfig& config) {
  std::vector<int64_t> bytes;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const bool moe = config.layer_is_moe[l] && config.num_experts > 0;
    bytes.push_back(moe ? 3 * config.hidden_size * config.moe_intermediate_size * 2 : 0);
  }
  return bytes;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), "cannot open --text-file ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// [B][I] prompt ids.
// Random ids need no tokenizer, which is how synthetic models (dir empty) get their prompts.
std::vector<std::vector<int32_t>> make_prompts(const ProfileArgs& args,
                                               const std::filesystem::path& dir,
                                               const ModelConfig& config) {
  std::vector<std::vector<int32_t>> prompts(args.batch);
  if (args.text_file.empty()) {
    std::mt19937_64 rng(args.seed);
    std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(config.vocab_size - 1));
    for (auto& p : prompts) {
      p.resize(args.input_len);
      for (int32_t& t : p) t = id(rng);
    }
    return prompts;
  }
  const Tokenizer tokenizer = Tokenizer::from_dir(dir);
  const std::vector<int32_t> ids =
      tokenizer.encode(read_text(args.text_file), /*add_special_tokens=*/false);
  const int64_t n = static_cast<int64_t>(ids.size());
  MOE_CHECK(n >= args.input_len, args.text_file, " encodes to ", n,
            " tokens, fewer than --input-len ", args.input_len);
  // Sequence b starts b * (n - I) / B tokens in: spread over the text, overlapping when short.
  for (int64_t b = 0; b < args.batch; ++b) {
    const int64_t start = args.batch > 1 ? b * (n - args.input_len) / (args.batch - 1) : 0;
    prompts[b].assign(ids.begin() + start, ids.begin() + start + args.input_len);
    for (int32_t id : prompts[b]) {
      MOE_CHECK(id >= 0 && id < config.vocab_size, "the tokenizer gave id ", id,
                " but the model's vocabulary has ", config.vocab_size, " entries");
    }
  }
  return prompts;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double best(const std::vector<double>& values) {
  return *std::min_element(values.begin(), values.end());
}

struct RunTime {
  double wall_s = 0.0;
  double cpu_s = 0.0;  // CPU time of the thread that drives the steps
};

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

class Workload {
 public:
  // `decoder`: the checkpoint's CPU decoder (its weights go to the GPU under --device cuda), or
  // null for a synthetic model, which is built on the GPU.
  Workload(const ModelConfig& config, Decoder* decoder, const ProfileArgs& args,
           std::vector<std::vector<int32_t>> prompts)
      : config_(config), decoder_(decoder), args_(args), prompts_(std::move(prompts)) {
    const int64_t per_seq = (args.input_len + args.output_len + kBlockSize - 1) / kBlockSize;
    num_blocks_ = per_seq * args.batch;
    const moe::RoutingApproximation routing = args.device.routing_approximation();
    if (args.device.is_cuda()) {
      // The same workload on the GPU decoder: its own device pool of the same blocks.
      const GpuOptions options{.weight_dtype = args.device.weight_dtype(),
                               .gpu_memory_fraction = args.device.gpu_memory_fraction,
                               .max_batch_tokens = args.batch * args.input_len,
                               .max_num_seqs = args.batch,
                               .max_model_len = args.input_len + args.output_len,
                               .block_size = kBlockSize,
                               .num_kv_blocks = num_blocks_,
                               // refuses --kv-dtype f32: the GPU cache is bf16 or fp8
                               .kv_dtype = args.device.kv_rows_dtype(),
                               .small_batch_moe_rows = args.device.fused_moe_rows,
                               .fp8_tensor_cores = args.device.fp8_tensor_cores_on(),
                               .offload = args.device.offload(),
                               .routing = routing};
      gpu_ = decoder
                 ? GpuDecoder::create(config, decoder->weights(), options)
                 : GpuDecoder::create_synthetic(config, options,
                                                {.seed = args.seed,
                                                 .routing = parse_routing_skew(args.routing_skew),
                                                 .expert_weights = args.device.weight_format(),
                                                 .weight_scope = args.device.weight_scope()});
    } else {
      MOE_CHECK(decoder != nullptr, "synthetic models run on the GPU: use --device cuda");
      decoder->set_offload(args.device.offload(), /*max_step_tokens=*/args.batch);
      decoder->set_routing_approximation(routing);
      // Linear-attention models also get a recurrent state slot per sequence (slot b for b).
      pool_ = std::make_unique<KvBlockPool>(decoder->make_pool(kBlockSize, num_blocks_, args.batch,
                                                               args.device.kv_rows_dtype()));
    }
    logits_.resize(args.batch * config.vocab_size);
  }

  // Every MoE layer's routing of each forward pass, on either device (null: off).
  void set_routing_observer(Decoder::RoutingObserver observer) {
    if (gpu_) {
      gpu_->set_routing_observer(std::move(observer));
    } else {
      decoder_->set_routing_observer(std::move(observer));
    }
  }

  // Sequence b's recurrent state slot (models with linear-attention layers), else -1: the host
  // pool's on the CPU, the device's on cuda (max_num_seqs = batch slots either way).
  int32_t state_slot(int64_t b) const {
    return config_.linear_attention ? static_cast<int32_t>(b) : -1;
  }

  // One forward pass on the chosen device (stages time themselves when a profiler is active:
  // steady clock on the CPU, CUDA events on the GPU).
  void forward(const ForwardBatch& batch) {
    if (gpu_) {
      gpu_->forward(batch, logits_);
    } else {
      decoder_->forward(batch, *pool_, logits_);
    }
  }

  // Runs prefill and the decode steps; returns the wall time and the calling thread's CPU time.
  // With a profiler, each forward pass is one profiler step.
  RunTime run(profile::Profiler* profiler) {
    const int64_t B = args_.batch;
    const int64_t V = config_.vocab_size;
    profile::ActiveProfiler guard(profiler);
    BlockManager blocks(num_blocks_, kBlockSize, /*enable_prefix_caching=*/false);
    std::vector<SequenceBlocks> seqs(B);
    std::vector<int64_t> length(B, 0);
    std::vector<int32_t> next(B, 0);
    std::vector<Sampler> samplers;
    for (int64_t b = 0; b < B; ++b) {
      samplers.emplace_back(SamplingParams{
          .temperature = 0.8f, .top_p = 0.95f, .seed = args_.seed + static_cast<uint64_t>(b)});
    }
    const double cpu_start = thread_cpu_seconds();
    const auto start = std::chrono::steady_clock::now();
    for (int64_t step = 0; step <= args_.output_len; ++step) {
      const bool prefill = step == 0;
      if (profiler) profiler->begin_step(prefill ? B * args_.input_len : B);
      ForwardBatch batch;
      {
        MOE_PROFILE_SCOPE(profile::Stage::kSchedule);
        batch.sequences.reserve(B);
        for (int64_t b = 0; b < B; ++b) {
          const int64_t count = prefill ? args_.input_len : 1;
          MOE_CHECK(blocks.allocate(seqs[b], length[b] + count), "profile: the KV pool of ",
                    num_blocks_, " blocks ran out at step ", step);
          batch.sequences.push_back(
              SequenceBatch{.tokens = prefill ? std::span<const int32_t>(prompts_[b])
                                              : std::span<const int32_t>(&next[b], 1),
                            .position = length[b],
                            .block_table = seqs[b].table,
                            .want_logits = true,
                            .state_slot = state_slot(b)});
        }
      }
      if (gpu_) {
        // As the engine does on the GPU: the same sampling on the device, only the tokens back.
        std::vector<GpuSamplingRow> rows(B);
        for (int64_t b = 0; b < B; ++b) {
          rows[b] = {.temperature = 0.8f, .top_p = 0.95f,
                     .seed = args_.seed + static_cast<uint64_t>(b), .step = static_cast<uint64_t>(step)};
        }
        gpu_->forward_sample(batch, rows, next);
      } else {
        forward(batch);
      }
      {
        MOE_PROFILE_SCOPE(profile::Stage::kSample);
        for (int64_t b = 0; b < B; ++b) {
          length[b] += static_cast<int64_t>(batch.sequences[b].tokens.size());
          if (!gpu_) next[b] = samplers[b].sample(std::span<const float>(logits_.data() + b * V, V));
        }
      }
      if (profiler) profiler->end_step();
    }
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu = thread_cpu_seconds() - cpu_start;
    for (SequenceBlocks& s : seqs) blocks.free(s);
    return {wall, cpu};
  }

  // Paired A/B of one decode step: after a prefill, the same decode batch (same tokens, same
  // positions, so every run does the same work) runs in blocks of time_every steps, alternating
  // profiler off and on in the order off-on, on-off, ... so that drifts in machine load fall on
  // both. An on block holds exactly one step whose stages are timed, so its mean is what the
  // profiler costs per step when it samples. Returns the median block means in microseconds
  // (the on side includes begin_step/end_step) and the steps each side ran.
  struct PairedSteps {
    double off_us = 0.0, on_us = 0.0;
    int64_t steps_per_side = 0;
  };
  PairedSteps paired_decode_steps(int64_t min_steps_per_side,
                                  const profile::ProfilerOptions& options) {
    const int64_t B = args_.batch;
    BlockManager blocks(num_blocks_, kBlockSize, /*enable_prefix_caching=*/false);
    std::vector<SequenceBlocks> seqs(B);
    ForwardBatch prefill, decode;
    std::vector<int32_t> next(B);
    for (int64_t b = 0; b < B; ++b) {
      MOE_CHECK(blocks.allocate(seqs[b], args_.input_len + 1), "profile: the KV pool ran out");
      next[b] = prompts_[b].back();
    }
    for (int64_t b = 0; b < B; ++b) {
      prefill.sequences.push_back(SequenceBatch{.tokens = prompts_[b],
                                                .position = 0,
                                                .block_table = seqs[b].table,
                                                .state_slot = state_slot(b)});
      decode.sequences.push_back(SequenceBatch{.tokens = std::span<const int32_t>(&next[b], 1),
                                               .position = args_.input_len,
                                               .block_table = seqs[b].table,
                                               .state_slot = state_slot(b)});
    }
    profile::Profiler profiler(options);
    const int64_t block = options.time_every;
    auto run_block = [&](bool profiled) {
      profile::ActiveProfiler guard(profiled ? &profiler : nullptr);
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < block; ++i) {
        if (profiled) profiler.begin_step(B);
        forward(decode);
        if (profiled) profiler.end_step();
      }
      return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                 .count() /
             static_cast<double>(block);
    };
    forward(prefill);
    run_block(false);  // warm: the GPU captures the step's graph, with and without events
    run_block(true);
    profiler.clear();
    const int64_t num_blocks = std::max<int64_t>(2, (min_steps_per_side + block - 1) / block);
    std::vector<double> off, on;
    for (int64_t i = 0; i < 2 * num_blocks; ++i) {
      const bool profiled = (i % 4 == 1) || (i % 4 == 2);
      (profiled ? on : off).push_back(run_block(profiled));
    }
    for (SequenceBlocks& s : seqs) blocks.free(s);
    return {median(off), median(on), num_blocks * block};
  }

 private:
  static constexpr int64_t kBlockSize = 16;
  const ModelConfig& config_;
  Decoder* decoder_;  // CPU decoder of a checkpoint; null for a synthetic model
  const ProfileArgs& args_;
  std::vector<std::vector<int32_t>> prompts_;
  int64_t num_blocks_ = 0;
  std::unique_ptr<KvBlockPool> pool_;  // CPU
  std::unique_ptr<GpuDecoder> gpu_;    // --device cuda
  std::vector<float> logits_;  // [B, V]
};

// Nanoseconds per scope, on (a profiler installed) and off, over many scopes in a loop. The
// compiler barrier makes each iteration reload the thread's profiler pointer, as real code does.
void measure_scope_cost(int64_t num_layers, double* on_ns, double* off_ns) {
  constexpr int kIterations = 200000;
  auto loop = [] {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kIterations; ++i) {
      MOE_PROFILE_SCOPE(profile::Stage::kPlan);
      asm volatile("" ::: "memory");
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
               .count() /
           kIterations;
  };
  profile::Profiler scratch(profile::ProfilerOptions{.num_layers = num_layers});
  std::vector<double> on, off;
  for (int r = 0; r < 5; ++r) {
    {
      profile::ActiveProfiler guard(&scratch);
      scratch.begin_step(0);
      on.push_back(loop());
    }
    off.push_back(loop());
  }
  *on_ns = *std::min_element(on.begin(), on.end());
  *off_ns = *std::min_element(off.begin(), off.end());
}

void write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  MOE_CHECK(out.good(), "cannot write ", path.string());
  out << text;
  MOE_CHECK(out.good(), "failed writing ", path.string());
}

void run_profile(const ProfileArgs& args) {
  MOE_CHECK(args.batch >= 1, "--batch must be >= 1, got ", args.batch);
  MOE_CHECK(args.input_len >= 1, "--input-len must be >= 1, got ", args.input_len);
  MOE_CHECK(args.output_len >= 0, "--output-len must be >= 0, got ", args.output_len);
  MOE_CHECK(args.repeats >= 0, "--repeats must be >= 0, got ", args.repeats);
  const bool synthetic = is_synthetic_model(args.model);
  MOE_CHECK(synthetic || (args.layers == 0 && args.routing_skew.empty()),
            "--layers and --routing-skew apply to synthetic:NAME models only");
  MOE_CHECK(!synthetic || args.device.is_cuda(),
            "synthetic models are built on the GPU: use --device cuda");
  MOE_CHECK(!synthetic || args.text_file.empty(),
            "--text-file needs a checkpoint's tokenizer; synthetic models take random ids");
  const std::string synthetic_name =
      synthetic ? args.model.substr(std::string("synthetic:").size()) : std::string();
  if (synthetic) {
    check_synthetic_weight_format(args.device.weight_format(), synthetic_name,
                                  args.device.offload().enabled());
    args.device.weight_scope();  // linear without --weights fp8|int4 refused here
  }
  const std::filesystem::path dir = synthetic ? std::filesystem::path()
                                              : resolve_model_dir(args.model);
  std::unique_ptr<Model> model = synthetic ? nullptr : load_model_for(dir, args.device);
  Decoder* decoder = model ? &model->decoder() : nullptr;
  const ModelConfig config =
      synthetic ? synthetic_model_config(synthetic_name, args.layers) : decoder->config();
  const int64_t L = config.num_layers;
  const int64_t E = config.num_experts;
  MOE_CHECK(config.max_position_embeddings <= 0 ||
                args.input_len + args.output_len <= config.max_position_embeddings,
            "--input-len ", args.input_len, " + --output-len ", args.output_len,
            " exceeds the model's context of ", config.max_position_embeddings, " tokens");
  std::filesystem::create_directories(args.out);

  Workload workload(config, decoder, args, make_prompts(args, dir, config));
  const int64_t time_every =
      args.time_every > 0 ? args.time_every : args.device.is_cuda() ? kGpuProfileTimeEvery : 1;
  const profile::ProfilerOptions options{
      .num_layers = L,
      .num_experts = E,
      .expert_bytes = decoder ? checkpoint_expert_bytes(*decoder) : synthetic_expert_bytes(config),
      .time_every = time_every};

  // Overhead: one warm-up, then off/on pairs in alternating order. Noise from other processes
  // only ever adds time, so the best run of each side is compared.
  profile::OverheadInfo overhead;
  workload.run(nullptr);
  if (args.repeats > 0) {
    std::vector<double> off_wall, on_wall, off_cpu, on_cpu;
    auto record = [](const RunTime& t, std::vector<double>& wall, std::vector<double>& cpu) {
      wall.push_back(t.wall_s);
      cpu.push_back(t.cpu_s);
    };
    for (int64_t r = 0; r < args.repeats; ++r) {
      profile::Profiler scratch(options);
      if (r % 2 == 0) {
        record(workload.run(nullptr), off_wall, off_cpu);
        record(workload.run(&scratch), on_wall, on_cpu);
      } else {
        record(workload.run(&scratch), on_wall, on_cpu);
        record(workload.run(nullptr), off_wall, off_cpu);
      }
    }
    overhead.repeats = args.repeats;
    overhead.off_ms = best(off_wall) * 1e3;
    overhead.on_ms = best(on_wall) * 1e3;
    overhead.measured = overhead.on_ms / overhead.off_ms - 1.0;
    overhead.off_cpu_ms = best(off_cpu) * 1e3;
    overhead.on_cpu_ms = best(on_cpu) * 1e3;
    overhead.measured_cpu = overhead.on_cpu_ms / overhead.off_cpu_ms - 1.0;
    const auto [off_us, on_us, paired_steps] = workload.paired_decode_steps(kPairedSteps, options);
    overhead.paired_steps = paired_steps;
    overhead.paired_block = options.time_every;
    overhead.step_off_us = off_us;
    overhead.step_on_us = on_us;
    overhead.measured_step = on_us / off_us - 1.0;
  }
  measure_scope_cost(L, &overhead.scope_on_ns, &overhead.scope_off_ns);

  // The profiled run, with the routing of every (step, layer) kept for the routing summary.
  profile::Profiler profiler(options);
  RoutingTrace trace{.num_layers = static_cast<uint32_t>(L),
                     .num_experts = static_cast<uint32_t>(E),
                     .top_k = static_cast<uint32_t>(config.num_experts_per_tok)};
  workload.set_routing_observer([&](int64_t layer, const moe::Routing& routing) {
    TraceRecord record{.step = static_cast<uint32_t>(profiler.steps().size()),
                       .layer = static_cast<uint32_t>(layer),
                       .num_tokens = static_cast<uint32_t>(routing.num_tokens)};
    record.expert_ids.reserve(routing.topk_ids.size());
    for (int32_t e : routing.topk_ids) {
      record.expert_ids.push_back(e == moe::kNoExpert ? kDroppedTraceId : static_cast<uint16_t>(e));
    }
    trace.records.push_back(std::move(record));
  });
  workload.run(&profiler);
  workload.set_routing_observer(nullptr);

  int64_t scopes = 0, wall_ns = 0;
  for (const profile::StepRecord& r : profiler.steps()) {
    for (int32_t c : r.stage_calls) scopes += c;
    wall_ns += r.wall_ns;
  }
  const double num_steps = static_cast<double>(profiler.steps().size());
  overhead.scopes_per_step = scopes / num_steps;
  overhead.estimated = overhead.scopes_per_step * overhead.scope_on_ns / (wall_ns / num_steps);

  const std::vector<LayerSummary> routing =
      E > 0 ? summarize_routing_trace(trace, /*top_pairs=*/3) : std::vector<LayerSummary>{};
  profile::RunInfo run{
      .model = synthetic ? args.model : dir.filename().string(),
      .model_type = config.model_type,
      .batch = args.batch,
      .input_len = args.input_len,
      .output_len = args.output_len,
      .seed = args.seed,
      .token_source = args.text_file.empty()
                          ? std::string("random")
                          : std::filesystem::path(args.text_file).filename().string(),
      .num_threads = ThreadPool::global().num_threads(),
      .top_k = config.num_experts_per_tok,
      .hidden_size = config.hidden_size,
      .layer_is_moe = config.layer_is_moe,
      .prefill_steps = 1};
  const nlohmann::ordered_json report = profile::build_report(run, profiler, routing, overhead);
  const std::filesystem::path out(args.out);
  const std::string text = profile::render_text_report(report);
  write_file(out / "report.txt", text);
  write_file(out / "report.json", report.dump(1) + "\n");
  write_file(out / "report.html", profile::render_html_report(report));
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::printf("\nwrote %s, %s and %s\n", (out / "report.txt").string().c_str(),
              (out / "report.json").string().c_str(), (out / "report.html").string().c_str());
}

}  // namespace

void add_profile_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "profile", "Run a batched workload with the stage profiler on and write a report");
  auto args = std::make_shared<ProfileArgs>();
  add_model_option(cmd, &args->model);
  cmd->add_option("--batch", args->batch, "Sequences run together (B)")->capture_default_str();
  cmd->add_option("--input-len", args->input_len, "Prompt tokens per sequence (I)")
      ->capture_default_str();
  cmd->add_option("--output-len", args->output_len, "Decode steps after the prefill (O)")
      ->capture_default_str();
  cmd->add_option("--out", args->out, "Folder for report.txt, report.json, report.html")
      ->required();
  cmd->add_option("--seed", args->seed, "Seed for the random prompts and the sampler")
      ->capture_default_str();
  cmd->add_option("--text-file", args->text_file,
                  "Take the prompts from this text instead of random ids")
      ->check(CLI::ExistingFile);
  cmd->add_option("--repeats", args->repeats, "Off/on runs for the overhead measurement (0 = skip)")
      ->capture_default_str();
  cmd->add_option("--time-every", args->time_every,
                  "Time the stages of one step in N, count rows on every step (default: 1 on "
                  "the CPU, 16 on the GPU)")
      ->check(CLI::Range(1, 1 << 30));
  add_device_options(cmd, &args->device);
  add_offload_options(cmd, &args->device);
  add_routing_options(cmd, &args->device);
  add_weight_options(cmd, &args->device);
  add_kv_options(cmd, &args->device);
  add_synthetic_options(cmd, &args->layers, &args->routing_skew);
  cmd->callback([args] { run_profile(*args); });
}

}  // namespace moeinfer::cli
