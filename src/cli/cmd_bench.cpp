// `moeinfer bench [--model DIR|synthetic:NAME] [--batch B] [--input-len I] [--output-len O]
// [--device cuda]`: the engine's ceiling without HTTP. B requests of I random prompt tokens each
// are added at once and run to O generated tokens each (ignoring end-of-sequence), through the
// same Engine::step() the server drives. Reports prefill throughput (until every request has its
// first token), decode throughput (the rest), and the scheduler's share of the step time.
//
// On the GPU it first runs the same workload briefly (module loading, cuBLAS heuristics, graph
// capture happen there), then measures the two floors in the same run and reports each phase as
// a ratio to its floor: decode as (bytes the step must read / copy bandwidth) / step time, the
// bytes being every non-expert weight, the distinct experts the step's routing touched (read
// back from the device) at the bytes the device holds for one (codes and scales for quantised
// experts, `--weights fp8|int4` or a quantised checkpoint), the LM head and the KV rows; prefill
// as (matrix FLOPs / GEMM peak) / prefill time.
//
// `mpirun -np N moeinfer bench --ep N`: every rank has its own engine over an expert-parallel
// decoder and runs its share of the B requests (B split as evenly as possible; the prompts are
// one process's, dealt out in order), all ranks stepping together; rank 0 prints the combined
// throughput (tokens of every rank over the slowest rank's times). On --device cuda each rank's
// decoder is a GpuDecoder on GPU rank % count (runtime/engine_ranks.h), the warm-up runs every
// rank's share together, and rank 0 prints its own GPU's figures against the job's batch.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/model_arg.h"
#include "cli/path_arg.h"
#include "core/error.h"
#include "model/model_facts.h"
#include "model/synthetic.h"
#include "offload/cache_summary.h"
#include "runtime/engine.h"
#include "runtime/engine_ranks.h"

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
  int64_t time_every = 0;  // --profile: stages timed on one step in N (0: the device's default)
  int64_t profiler_steps = 0;  // cuda: decode steps an external profiler captures (0: none)
  DeviceArgs device;
  int64_t layers = 0;            // synthetic: cut to this many layers
  std::string routing_skew;      // synthetic: "zipf:A" or "uniform"
  bool no_cuda_graphs = false;
  bool no_programmatic_launch = false;
  bool no_fold_norms = false;
  bool merge_attention_splits = false;
  bool no_one_row_expert_blocks = false;
  bool persistent_layers = false;
  int64_t weight_prefetch_bytes = 0;
  int64_t skinny_gemm_rows = -1;  // cuda: GpuOptions::skinny_gemm_rows (-1: its default)
  int64_t fused_route_tokens = -1;  // cuda: GpuOptions::fused_route_tokens (-1: its default)
  bool deterministic = false;
  float temperature = 0.0f;  // of the generated tokens; 0: greedy
  // --sweep: decode at each of these batches (--input-len then --output-len tokens each), then
  // one prompt of each prefill length, in one process; a table with each row's floor ratio.
  bool sweep = false;
  bool batch_given = false;  // --batch on the command line (the sweep names its own batches)
  bool sweep_lists_given = false;  // --sweep-batches or --sweep-prefill on the command line
  std::vector<int64_t> sweep_batches = {1, 8, 64, 256};
  std::vector<int64_t> sweep_prefill = {2048, 4096};
};

std::unique_ptr<Engine> load_engine(const BenchArgs& args, const EngineConfig& config) {
  if (is_synthetic_model(args.model) && args.device.ep > 1) {  // cuda only, as without --ep
    return load_expert_parallel_synthetic(
        args.model.substr(std::string("synthetic:").size()), args.layers,
        {.seed = args.seed, .routing = parse_routing_skew(args.routing_skew)}, config, args.device);
  }
  if (is_synthetic_model(args.model)) {
    return Engine::load_synthetic(
        args.model.substr(std::string("synthetic:").size()), args.layers,
        {.seed = args.seed, .routing = parse_routing_skew(args.routing_skew)}, config);
  }
  MOE_CHECK(args.layers == 0 && args.routing_skew.empty(),
            "--layers and --routing-skew apply to synthetic:NAME models only");
  if (args.device.ep > 1) {
    return load_expert_parallel_engine(resolve_model_dir(args.model), config, args.device);
  }
  return Engine::load(resolve_model_dir(args.model), config, LoadOptions{});
}

// The requests rank r of N runs: [first, first + count) of the B, the first B % N ranks one more.
struct RequestShare {
  int64_t first = 0, count = 0;
};

RequestShare share_of(int64_t batch, int64_t rank, int64_t num_ranks) {
  const int64_t base = batch / num_ranks, extra = batch % num_ranks;
  return {rank * base + std::min(rank, extra), base + (rank < extra ? 1 : 0)};
}

// Adds B random prompts and runs them to the end; the observer sees each step's outputs.
struct RunTimes {
  double prefill_s = 0.0, decode_s = 0.0, total_s = 0.0;
  int64_t generated = 0, decode_steps = 0;
  std::vector<int32_t> expert_counts;  // GPU: [L, E] of a mid-run decode step
};

// comm: under --ep every rank runs its share and steps until every rank is done.
RunTimes run_workload(Engine& engine, const BenchArgs& args, int64_t output_len, uint64_t seed,
                      parallel::Communicator* comm = nullptr) {
  std::mt19937_64 rng(seed);
  const int64_t vocab = engine.model_config().vocab_size;
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  const RequestShare share =
      comm ? share_of(args.batch, comm->rank(), comm->size()) : RequestShare{0, args.batch};
  for (int64_t b = 0; b < share.first + share.count; ++b) {
    std::vector<int32_t> prompt(args.input_len);
    for (auto& id : prompt) id = token(rng);
    if (b < share.first) continue;  // another rank's
    GenerationParams params{.max_tokens = output_len, .ignore_eos = true};
    params.sampling.temperature = args.temperature;
    params.sampling.seed = seed + static_cast<uint64_t>(b);
    params.has_seed = true;
    engine.add_request(std::move(prompt), params);
  }
  using Clock = std::chrono::steady_clock;
  RunTimes times;
  if (comm) comm->barrier();  // one start for every rank's clock
  const auto start = Clock::now();
  auto prefilled = start;
  int64_t first_tokens = 0;
  bool counted = false;
  const auto more_steps = [&] {
    return comm ? any_rank(*comm, engine.has_unfinished()) : engine.has_unfinished();
  };
  // --profiler-steps N: the N decode steps from the middle of the run.
  const int64_t capture_first = std::max<int64_t>(1, output_len / 2);
  const int64_t capture_end = capture_first + args.profiler_steps;
  bool capturing = false;
  const auto set_capture = [&](bool on) {
    if (on == capturing) return;
    engine.gpu_decoder()->set_profiler_capture(on);
    capturing = on;
  };
  while (more_steps()) {
    if (engine.gpu() && args.profiler_steps > 0 && prefilled != start) {
      if (times.decode_steps == capture_first) set_capture(true);
      if (times.decode_steps == capture_end) set_capture(false);
    }
    for (const RequestOutput& out : engine.step()) {
      times.generated += static_cast<int64_t>(out.token_ids.size());
      if (out.num_output_tokens == 1 && !out.token_ids.empty()) ++first_tokens;
    }
    if (prefilled != start) ++times.decode_steps;
    if (first_tokens == share.count && prefilled == start) prefilled = Clock::now();
    if (!counted && engine.gpu() && times.decode_steps == std::max<int64_t>(1, output_len / 2)) {
      times.expert_counts = engine.gpu_decoder()->expert_counts();
      counted = true;
    }
  }
  if (capturing) set_capture(false);  // the run ended inside the captured steps
  const auto done = Clock::now();
  times.prefill_s = std::chrono::duration<double>(prefilled - start).count();
  times.decode_s = std::chrono::duration<double>(done - prefilled).count();
  times.total_s = std::chrono::duration<double>(done - start).count();
  return times;
}

// The warm-up's arguments: the measured run's, but no external profiler capture, which brackets
// the measured run's steps only (a capture in the warm-up too gave ncu two steps for one).
BenchArgs warm_up_args(const BenchArgs& args) {
  BenchArgs warm = args;
  warm.profiler_steps = 0;
  return warm;
}

// Every rank's run as one: tokens summed, times the slowest rank's (the ranks step together, so
// the job is done when its last rank is). Identity without --ep.
RunTimes combine_ranks(const RunTimes& mine, parallel::Communicator* comm) {
  if (comm == nullptr) return mine;
  const double figures[3] = {mine.prefill_s, mine.total_s, static_cast<double>(mine.generated)};
  std::vector<double> all(3 * static_cast<size_t>(comm->size()));
  comm->all_gather(figures, all.data(), sizeof(figures));
  RunTimes job = mine;
  job.generated = 0;
  for (int r = 0; r < comm->size(); ++r) {
    job.prefill_s = std::max(job.prefill_s, all[3 * r]);
    job.total_s = std::max(job.total_s, all[3 * r + 1]);
    job.generated += static_cast<int64_t>(all[3 * r + 2]);
  }
  job.decode_s = job.total_s - job.prefill_s;
  return job;
}

// Distinct experts a step touched, summed over layers, from [L, E] row counts.
int64_t distinct_experts(const std::vector<int32_t>& counts) {
  return std::count_if(counts.begin(), counts.end(), [](int32_t c) { return c > 0; });
}

// The bytes one decode step of `batch` sequences at mean context `mean_context` must read:
// every non-expert weight, the distinct experts the step's routing touched (`touched`, summed
// over layers) at the bytes the device holds for one, the LM head and the KV rows.
double decode_step_bytes(const Engine& engine, int64_t batch, double mean_context,
                         int64_t touched) {
  const ModelConfig& c = engine.model_config();
  const GpuMemoryReport& mem = engine.gpu()->memory();
  const PartCounts active = count_params(c, /*active_only=*/true);
  // One expert's bytes as the device holds it (quantised: its codes and scales); bf16 values of
  // its parameters where the decoder reports none.
  const int64_t expert_params = 3 * c.hidden_size * c.moe_intermediate_size;
  const double expert_bytes =
      mem.expert_bytes > 0 ? static_cast<double>(mem.expert_bytes) : 2.0 * expert_params;
  const double non_expert = static_cast<double>(active.attention + active.shared_experts +
                                                active.other) +
                            static_cast<double>(c.vocab_size * c.hidden_size);  // LM head
  // Dense Linears held quantised (--weights-scope linear): their codes and scales instead of
  // their values' bf16 bytes.
  const double dense = static_cast<double>(mem.dense_quant_bytes) -
                       2.0 * static_cast<double>(mem.dense_quant_values);
  return 2.0 * non_expert + dense + static_cast<double>(touched) * expert_bytes +
         static_cast<double>(batch) * mean_context * mem.kv_bytes_per_token;
}

// Matrix FLOPs of `batch` prompts of `prompt_len` tokens: every token through the attention
// projections, K experts, shared experts and routers; causal attention scores and values; the
// LM head once per request.
double prefill_flops(const ModelConfig& c, int64_t batch, int64_t prompt_len) {
  const PartCounts active = count_params(c, /*active_only=*/true);
  const double T = static_cast<double>(prompt_len);
  const double per_token = 2.0 * static_cast<double>(active.attention + active.routed_experts +
                                                     active.shared_experts + active.other);
  const int64_t qk = c.mla ? c.mla->qk_head_dim() : c.head_dim;
  const int64_t vd = c.mla ? c.mla->v_head_dim : c.head_dim;
  const double attention = 2.0 * c.num_heads * (qk + vd) * (T * (T + 1) / 2.0) * c.num_layers;
  return static_cast<double>(batch) *
         (T * per_token + attention + 2.0 * static_cast<double>(c.vocab_size * c.hidden_size));
}

// cache: the expert cache over the measured run (--expert-budget), or null; num_steps: that
// run's steps.
void print_gpu_figures(Engine& engine, const BenchArgs& args, const RunTimes& t,
                       const offload::CacheSummary* cache, int64_t num_steps,
                       nlohmann::json& json) {
  const ModelConfig& c = engine.model_config();
  const GpuMemoryReport& mem = engine.gpu()->memory();
  const DeviceFloors floors = measure_device_floors();
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  std::printf("GPU: %s, budget %.1f GiB of %.1f: weights %.2f GiB, workspace %.2f GiB, "
              "KV %.2f GiB (%lld blocks of %lld tokens)\n",
              mem.device_name.c_str(), mem.budget_bytes / GiB, mem.device_bytes / GiB,
              mem.weight_bytes / GiB, mem.workspace_bytes / GiB, mem.kv_bytes / GiB,
              static_cast<long long>(mem.num_kv_blocks), static_cast<long long>(mem.block_size));
  if (mem.expert_bytes > 0) {  // offloaded: the cache's slots are in the weights above
    std::printf("Routed experts: %s, %.2f MiB an expert", mem.expert_format.c_str(),
                mem.expert_bytes / (1024.0 * 1024.0));
    if (mem.routed_expert_bytes > 0) {
      std::printf(", %.2f GiB of the weights", mem.routed_expert_bytes / GiB);
    }
    if (mem.expert_fp8_tensor_cores) std::printf("; prefill on fp8 tensor cores");
    std::printf("\n");
  }
  if (args.persistent_layers) {
    std::printf(
        "Persistent decode layers: %lld of %lld layers in one launch a step of one token%s%s\n",
        static_cast<long long>(mem.persistent_layers), static_cast<long long>(c.num_layers),
        mem.persistent_refusal.empty() ? "" : "; the rest on the stage path: ",
        mem.persistent_refusal.c_str());
  }
  if (mem.dense_quant_matrices > 0) {
    std::printf("Dense Linears: %lld held as %s codes and scales, %.2f GiB of the weights\n",
                static_cast<long long>(mem.dense_quant_matrices), mem.dense_format.c_str(),
                mem.dense_quant_bytes / GiB);
  }
  if (args.device.ep > 1) {
    std::printf(
        "--ep %d: rank 0's GPU (its share of the budget above), its floors against the "
        "job's whole batch; ranks sharing a GPU share its floors\n",
        args.device.ep);
  }
  std::printf("%-34s %12.1f\n", "Copy bandwidth floor (GB/s):", floors.copy_bytes_per_s / 1e9);
  std::printf("%-34s %12.1f\n", "bf16 GEMM peak (TFLOP/s):", floors.gemm_flops / 1e12);

  // Decode: what one step must read.
  const int64_t touched = distinct_experts(t.expert_counts);
  const double mean_context = args.input_len + args.output_len / 2.0;
  const double step_bytes = decode_step_bytes(engine, args.batch, mean_context, touched);
  const double step_s = t.decode_s / std::max<int64_t>(t.decode_steps, 1);
  const double decode_floor_s = step_bytes / floors.copy_bytes_per_s;
  const GpuDecoder::GraphCounts graph = engine.gpu_decoder()->decode_graph_counts();
  std::printf("%-34s %12.3f\n", "Decode step (ms):", step_s * 1e3);
  std::printf("%-34s %12.3f\n", "Decode bytes per step (GB):", step_bytes / 1e9);
  std::printf("%-34s %12.1f\n", "Distinct experts per layer:",
              static_cast<double>(touched) / std::max<int64_t>(1, c.num_layers));
  std::printf("%-34s %12.3f\n", "Decode floor (ms):", decode_floor_s * 1e3);
  std::printf("%-34s %12.3f\n", "Decode: floor / step time:", decode_floor_s / step_s);
  if (graph.kernels > 0) {  // launches of one graph-captured decode step (issue 16, item 2)
    std::printf("%-34s %12lld\n", "Decode graph kernels/step:",
                static_cast<long long>(graph.kernels));
    std::printf("%-34s %12.1f\n", "Decode graph kernels/layer:",
                static_cast<double>(graph.kernels) / std::max<int64_t>(1, c.num_layers));
    std::printf("%-34s %12lld\n", "Decode graph copies/step:",
                static_cast<long long>(graph.copies));
  }
  double offload_floor_s = 0.0;
  if (cache) {
    // The floor of a budget: the experts that crossed PCIe (copies and reads from host, the
    // run's mean per step: a short prompt makes the prefill one more step of the same shape) at
    // the measured host-to-device rate, the device reads as above, or the experts computed on
    // the host at its rate measured at start-up, whichever is longest.
    const double steps = static_cast<double>(std::max<int64_t>(num_steps, 1));
    const double pcie_bytes = static_cast<double>(cache->host_to_device_bytes) / steps;
    const double host_s =
        (static_cast<double>(cache->counts[offload::kCacheOnCpu]) * mem.expert_host_ns +
         static_cast<double>(cache->counts[offload::kCacheRowsOnCpu]) * mem.expert_host_row_ns) *
        1e-9 / steps;
    offload_floor_s =
        std::max({pcie_bytes / floors.host_to_device_bytes_per_s, decode_floor_s, host_s});
    std::printf("%-34s %12.1f\n", "Host-to-device bandwidth (GB/s):",
                floors.host_to_device_bytes_per_s / 1e9);
    std::printf("%-34s %12.3f\n", "Expert bytes over PCIe/step (GB):", pcie_bytes / 1e9);
    std::printf("%-34s %12.3f\n", "Host expert work/step (ms):", host_s * 1e3);
    std::printf("%-34s %12.3f\n", "Offload floor (ms):", offload_floor_s * 1e3);
    std::printf("%-34s %12.3f\n", "Decode: offload floor / step:", offload_floor_s / step_s);
  }

  const double flops = prefill_flops(c, args.batch, args.input_len);
  const double prefill_floor_s = flops / floors.gemm_flops;
  std::printf("%-34s %12.3f\n", "Prefill (ms):", t.prefill_s * 1e3);
  std::printf("%-34s %12.1f\n", "Prefill TFLOP/s:", flops / t.prefill_s / 1e12);
  std::printf("%-34s %12.3f\n", "Prefill: FLOP/s / GEMM peak:", prefill_floor_s / t.prefill_s);
  json["gpu"] = {{"device", mem.device_name},
                 {"weight_bytes", mem.weight_bytes},
                 {"expert_format", mem.expert_format},
                 {"expert_bytes", mem.expert_bytes},
                 {"expert_fp8_tensor_cores", mem.expert_fp8_tensor_cores},
                 {"routed_expert_bytes", mem.routed_expert_bytes},
                 {"dense_format", mem.dense_format},
                 {"dense_quant_bytes", mem.dense_quant_bytes},
                 {"workspace_bytes", mem.workspace_bytes},
                 {"kv_bytes", mem.kv_bytes},
                 {"persistent_layers", mem.persistent_layers},
                 {"copy_bytes_per_s", floors.copy_bytes_per_s},
                 {"gemm_flops", floors.gemm_flops},
                 {"host_to_device_bytes_per_s", floors.host_to_device_bytes_per_s},
                 {"offload_floor_ratio", cache ? offload_floor_s / step_s : 0.0},
                 {"decode_step_seconds", step_s},
                 {"decode_bytes_per_step", step_bytes},
                 {"decode_floor_ratio", decode_floor_s / step_s},
                 {"decode_graph_kernels", graph.kernels},
                 {"decode_graph_copies", graph.copies},
                 {"prefill_flops", flops},
                 {"prefill_peak_ratio", prefill_floor_s / t.prefill_s}};
}

// The engine a run needs: room for its largest batch and prompt (a sweep's largest row).
EngineConfig engine_config(const BenchArgs& args) {
  const bool synthetic = is_synthetic_model(args.model);
  int64_t max_seqs = args.batch, longest_prompt = args.input_len;
  int64_t longest_sequence = args.input_len + args.output_len;
  if (args.sweep) {
    max_seqs = *std::max_element(args.sweep_batches.begin(), args.sweep_batches.end());
    const int64_t longest_prefill =
        *std::max_element(args.sweep_prefill.begin(), args.sweep_prefill.end());
    longest_prompt = std::max(longest_prompt, longest_prefill);
    longest_sequence = std::max(longest_sequence, longest_prefill + 1);
  }
  // Every prompt in one step, except that a GPU step carries at most 8192 tokens or one whole
  // prompt (the workspace is sized for the largest step): a prompt that starts a step attends
  // through the prefill kernel, a chunk after a cached prefix through the paged prefill kernel
  // (both flash-style on tensor cores; model/attention_route.h decides).
  const int64_t all_prompts = std::max(max_seqs * args.input_len, longest_prompt);
  const int64_t batched_tokens =
      args.max_num_batched_tokens > 0
          ? args.max_num_batched_tokens
          : std::max<int64_t>(args.device.is_cuda()
                                  ? std::min(all_prompts, std::max<int64_t>(8192, longest_prompt))
                                  : all_prompts,
                              512);
  return EngineConfig{.max_num_seqs = max_seqs,
                      .max_num_batched_tokens = batched_tokens,
                      .max_model_len = synthetic ? longest_sequence : 0,
                      .enable_prefix_caching = false,
                      .profile_stages = args.profile,
                      .profile_time_every = args.time_every,
                      .device = args.device.device,
                      .fused_moe_rows = args.device.fused_moe_rows,
                      .skinny_gemm_rows = args.skinny_gemm_rows,
                      .fused_route_tokens = args.fused_route_tokens,
                      .fp8_tensor_cores = args.device.fp8_tensor_cores_on(),
                      .weight_dtype = args.device.weight_dtype(),
                      .gpu_memory_fraction = args.device.gpu_memory_fraction,
                      .cuda_graphs = !args.no_cuda_graphs,
                      .programmatic_launch = !args.no_programmatic_launch,
                      .weight_prefetch_bytes = args.weight_prefetch_bytes,
                      .fold_norms = !args.no_fold_norms,
                      .merge_attention_splits = args.merge_attention_splits,
                      .one_row_expert_blocks = !args.no_one_row_expert_blocks,
                      .persistent_layers = args.persistent_layers,
                      .deterministic = args.deterministic,
                      .offload = args.device.offload(),
                      .routing = args.device.routing_approximation(),
                      .expert_weights = args.device.weight_format(),
                      .weight_scope = args.device.weight_scope(),
                      .kv_dtype = args.device.kv_rows_dtype()};
}

// One row of --sweep's table.
struct SweepRow {
  bool decode = true;  // else one prompt's prefill
  int64_t batch = 0, input_len = 0, output_len = 0;
  double seconds = 0.0;  // decode: per step; prefill: the prompt
  double tokens_per_s = 0.0;
  double floor_s = 0.0;  // GPU: the row's floor (bytes / copy bandwidth, FLOPs / GEMM peak)
  int64_t graph_kernels = 0;  // GPU decode: kernels of one graph-captured step
};

void check_sweep_args(const BenchArgs& args) {
  MOE_CHECK(!args.batch_given, "--sweep runs its own batches (--sweep-batches); drop --batch");
  MOE_CHECK(args.device.ep == 1, "--sweep runs one process; drop --ep");
  MOE_CHECK(!args.device.offload().enabled(),
            "--sweep measures against the all-resident floors; drop --expert-budget");
  MOE_CHECK(!args.profile, "--sweep does not time stages; run one workload with --profile");
  MOE_CHECK(!args.sweep_batches.empty() && !args.sweep_prefill.empty(),
            "--sweep-batches and --sweep-prefill need at least one value each");
  for (int64_t b : args.sweep_batches) MOE_CHECK(b >= 1, "--sweep-batches: ", b, " is not >= 1");
  for (int64_t p : args.sweep_prefill) MOE_CHECK(p >= 1, "--sweep-prefill: ", p, " is not >= 1");
}

// The sweep's rows, each with a warm-up of its shapes on the GPU, as run_bench does.
std::vector<SweepRow> run_sweep_rows(Engine& engine, const BenchArgs& args,
                                     const DeviceFloors* floors) {
  std::vector<SweepRow> rows;
  const auto measure = [&](BenchArgs row_args, bool decode) {
    if (engine.gpu()) {
      run_workload(engine, warm_up_args(row_args), std::min<int64_t>(row_args.output_len, 3),
                   args.seed + 1);
    }
    const RunTimes t = run_workload(engine, row_args, row_args.output_len, args.seed);
    SweepRow row{.decode = decode, .batch = row_args.batch, .input_len = row_args.input_len,
                 .output_len = row_args.output_len};
    if (decode) {
      row.seconds = t.decode_s / std::max<int64_t>(t.decode_steps, 1);
      row.tokens_per_s = (t.generated - row_args.batch) / std::max(t.decode_s, 1e-9);
      if (floors) {
        const double mean_context = row_args.input_len + row_args.output_len / 2.0;
        row.floor_s = decode_step_bytes(engine, row_args.batch, mean_context,
                                        distinct_experts(t.expert_counts)) /
                      floors->copy_bytes_per_s;
        row.graph_kernels = engine.gpu_decoder()->decode_graph_counts().kernels;
      }
    } else {
      row.seconds = t.prefill_s;
      row.tokens_per_s = row_args.input_len / std::max(t.prefill_s, 1e-9);
      if (floors) {
        row.floor_s = prefill_flops(engine.model_config(), 1, row_args.input_len) /
                      floors->gemm_flops;
      }
    }
    rows.push_back(row);
  };
  for (int64_t batch : args.sweep_batches) {
    BenchArgs row_args = args;
    row_args.batch = batch;
    measure(row_args, /*decode=*/true);
  }
  for (int64_t prompt : args.sweep_prefill) {
    BenchArgs row_args = args;
    row_args.batch = 1;
    row_args.input_len = prompt;
    row_args.output_len = 1;
    measure(row_args, /*decode=*/false);
  }
  return rows;
}

// `bench --sweep`: issue 16's table in one call.
void run_sweep(const BenchArgs& args) {
  check_sweep_args(args);
  auto engine = load_engine(args, engine_config(args));
  const int64_t context = engine->max_model_len();
  MOE_CHECK(args.input_len + args.output_len <= context, "--input-len + --output-len (",
            args.input_len + args.output_len, ") exceeds the context of ", context);
  for (int64_t p : args.sweep_prefill) {
    MOE_CHECK(p + 1 <= context, "--sweep-prefill ", p, " (and its one generated token) exceeds "
              "the context of ", context);
  }
  std::optional<DeviceFloors> floors;
  if (engine->gpu()) floors = measure_device_floors();
  const std::vector<SweepRow> rows = run_sweep_rows(*engine, args, floors ? &*floors : nullptr);

  const std::string name = is_synthetic_model(args.model)
                               ? args.model
                               : engine->model_dir().filename().string();
  std::printf("bench --sweep: %s on %s; decode rows: %lld prompt tokens, then %lld generated\n",
              name.c_str(), args.device.device.c_str(), static_cast<long long>(args.input_len),
              static_cast<long long>(args.output_len));
  if (floors) {
    std::printf("floors measured now: copy %.1f GB/s (decode: bytes a step reads / that), bf16 "
                "GEMM %.1f TFLOP/s (prefill: matrix FLOPs / that)\n",
                floors->copy_bytes_per_s / 1e9, floors->gemm_flops / 1e12);
  } else {
    std::printf("ratio: measured on the GPU only (its floors are measured on the device)\n");
  }
  std::printf("%-16s %6s %7s %7s %12s %12s %8s %9s\n", "workload", "batch", "prompt", "output",
              "ms", "tok/s", "ratio", "kernels");
  nlohmann::json json_rows = nlohmann::json::array();
  for (const SweepRow& row : rows) {
    const std::string workload = row.decode ? "decode b" + std::to_string(row.batch)
                                            : "prefill " + std::to_string(row.input_len);
    const double ratio = row.floor_s > 0.0 ? row.floor_s / row.seconds : 0.0;
    std::printf("%-16s %6lld %7lld %7lld %12.3f %12.1f ", workload.c_str(),
                static_cast<long long>(row.batch), static_cast<long long>(row.input_len),
                static_cast<long long>(row.output_len), row.seconds * 1e3, row.tokens_per_s);
    if (floors) {
      std::printf("%8.3f ", ratio);
    } else {
      std::printf("%8s ", "-");
    }
    if (row.graph_kernels > 0) {
      std::printf("%9lld\n", static_cast<long long>(row.graph_kernels));
    } else {
      std::printf("%9s\n", "-");
    }
    json_rows.push_back({{"workload", row.decode ? "decode" : "prefill"},
                         {"batch", row.batch},
                         {"input_len", row.input_len},
                         {"output_len", row.output_len},
                         {row.decode ? "step_seconds" : "prefill_seconds", row.seconds},
                         {"tokens_per_second", row.tokens_per_s},
                         {"floor_seconds", row.floor_s},
                         {"floor_ratio", floors ? nlohmann::json(ratio) : nlohmann::json()},
                         {"graph_kernels", row.graph_kernels}});
  }
  std::printf("decode ms is per step; prefill ms the whole prompt; kernels: launches of one "
              "graph-captured decode step\n");
  if (!args.json_file.empty()) {
    std::ofstream out(args.json_file);
    MOE_CHECK(out.good(), "cannot write ", args.json_file);
    nlohmann::json gpu = nullptr;
    if (floors) {
      gpu = {{"device", engine->gpu()->memory().device_name},
             {"copy_bytes_per_s", floors->copy_bytes_per_s},
             {"gemm_flops", floors->gemm_flops}};
    }
    out << nlohmann::json{{"model", name}, {"device", args.device.device}, {"gpu", gpu},
                          {"sweep", json_rows}}
               .dump(2)
        << "\n";
  }
}

void run_bench(const BenchArgs& args) {
  MOE_CHECK(args.device.is_cuda() ||
                !(args.no_cuda_graphs || args.no_programmatic_launch || args.no_fold_norms ||
                  args.merge_attention_splits || args.no_one_row_expert_blocks ||
                  args.persistent_layers || args.weight_prefetch_bytes > 0),
            args.no_cuda_graphs             ? "--no-cuda-graphs"
            : args.no_programmatic_launch   ? "--no-programmatic-launch"
            : args.no_fold_norms            ? "--no-fold-norms"
            : args.merge_attention_splits   ? "--merge-attention-splits"
            : args.no_one_row_expert_blocks ? "--no-one-row-expert-blocks"
            : args.persistent_layers        ? "--persistent-layers"
                                            : "--weight-prefetch-bytes",
            " applies to --device cuda (the CPU launches no kernels)");
  MOE_CHECK(args.device.is_cuda() || args.skinny_gemm_rows < 0,
            "--skinny-gemm-rows applies to --device cuda (a GPU kernel)");
  MOE_CHECK(!args.deterministic || args.skinny_gemm_rows <= 0,
            "--skinny-gemm-rows does not apply with --deterministic (its products run the "
            "fixed-order dense GEMM)");
  MOE_CHECK(args.device.is_cuda() || args.fused_route_tokens < 0,
            "--fused-route-tokens applies to --device cuda (a GPU kernel)");
  MOE_CHECK(!args.deterministic || args.fused_route_tokens <= 0,
            "--fused-route-tokens does not apply with --deterministic (its router product sums "
            "in another order than the fixed-order GEMM of larger steps)");
  MOE_CHECK(args.profiler_steps == 0 || args.device.device == "cuda",
            "--profiler-steps brackets GPU decode steps: it needs --device cuda");
  MOE_CHECK(args.time_every == 0 || args.profile,
            "--time-every applies to --profile (without it no stage is timed)");
  MOE_CHECK(args.batch >= 1, "--batch must be >= 1");
  MOE_CHECK(args.input_len >= 1 && args.output_len >= 1,
            "--input-len and --output-len must be >= 1");
  MOE_CHECK(args.max_num_batched_tokens >= 0, "--max-num-batched-tokens must be >= 0 (0: every ",
            "prompt in one step), got ", args.max_num_batched_tokens);
  if (args.sweep) {
    run_sweep(args);
    return;
  }
  MOE_CHECK(!args.sweep_lists_given, "--sweep-batches and --sweep-prefill apply to --sweep only");
  const bool synthetic = is_synthetic_model(args.model);
  const EngineConfig config = engine_config(args);
  parallel::Communicator* ranks = args.device.expert_parallel();  // null without --ep
  auto engine = load_engine(args, config);
  MOE_CHECK(args.input_len + args.output_len <= engine->max_model_len(),
            "--input-len + --output-len (", args.input_len + args.output_len,
            ") exceeds the context of ", engine->max_model_len());
  const std::string name =
      synthetic ? args.model : engine->model_dir().filename().string();

  if (engine->gpu()) {  // warm-up: the same shapes, a few steps (every rank's share under --ep)
    run_workload(*engine, warm_up_args(args), std::min<int64_t>(args.output_len, 3), args.seed + 1,
                 ranks);
  }
  const EngineStats before = engine->stats();
  const RunTimes times =
      combine_ranks(run_workload(*engine, args, args.output_len, args.seed, ranks), ranks);
  if (!args.device.is_output_rank()) return;
  EngineStats stats = engine->stats();
  stats.num_steps -= before.num_steps;
  stats.schedule_seconds -= before.schedule_seconds;
  stats.forward_seconds -= before.forward_seconds;
  stats.sample_seconds -= before.sample_seconds;
  stats.timed_steps -= before.timed_steps;
  stats.network_bytes -= before.network_bytes;
  for (int kind = 0; kind < 2; ++kind) {  // the measured run's samples only
    EngineStats::StageSample& s = stats.stage_samples[kind];
    const EngineStats::StageSample& b = before.stage_samples[kind];
    s.steps -= b.steps;
    s.timed_steps -= b.timed_steps;
    s.timed_step_seconds -= b.timed_step_seconds;
    for (size_t i = 0; i < s.timed_stage_seconds.size() && i < b.timed_stage_seconds.size(); ++i) {
      s.timed_stage_seconds[i] -= b.timed_stage_seconds[i];
    }
  }
  for (size_t i = 0; i < stats.stage_seconds.size() && i < before.stage_seconds.size(); ++i) {
    stats.stage_seconds[i] -= before.stage_seconds[i];
  }
  const double prefill_s = times.prefill_s, decode_s = times.decode_s, total_s = times.total_s;
  const int64_t generated = times.generated;
  const double step_s = stats.schedule_seconds + stats.forward_seconds + stats.sample_seconds;
  const double prefill_tps = args.batch * args.input_len / std::max(prefill_s, 1e-9);
  const double decode_tps = (generated - args.batch) / std::max(decode_s, 1e-9);
  const double output_tps = generated / std::max(total_s, 1e-9);

  std::printf("bench: %s on %s, batch %lld, input %lld, output %lld, %lld steps\n", name.c_str(),
              args.device.device.c_str(), static_cast<long long>(args.batch),
              static_cast<long long>(args.input_len), static_cast<long long>(args.output_len),
              static_cast<long long>(stats.num_steps));
  nlohmann::json requests_per_rank = nlohmann::json::array();
  if (ranks) {
    std::string shares;
    for (int r = 0; r < ranks->size(); ++r) {
      const int64_t count = share_of(args.batch, r, ranks->size()).count;
      requests_per_rank.push_back(count);
      shares += (r ? " / " : "") + std::to_string(count);
    }
    std::printf(
        "expert parallel over %d ranks, requests per rank %s: throughput is the job's, "
        "step shares are rank 0's\n",
        ranks->size(), shares.c_str());
  }
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
    // The stage profiler's view: each stage's share of the step time, from the timed steps of
    // each kind (prompt, decode) scaled to all steps of that kind.
    std::printf("stages timed on %lld of %lld steps (scaled to all steps per kind: prompt, "
                "decode)\n",
                static_cast<long long>(stats.timed_steps), static_cast<long long>(stats.num_steps));
    std::printf("%-16s %12s %10s\n", "stage", "seconds", "share");
    const std::vector<double> estimated = stats.estimated_stage_seconds();
    const double estimated_step = stats.estimated_step_seconds();
    for (int stage = 0; stage < profile::kNumStages; ++stage) {
      const double seconds = estimated[stage];
      if (seconds == 0.0) continue;
      const std::string name(profile::stage_name(static_cast<profile::Stage>(stage)));
      std::printf("%-16s %12.4f %10.4f\n", name.c_str(), seconds,
                  seconds / std::max(estimated_step, 1e-12));
      stages[name] = seconds;
    }
    if (args.device.ep > 1) {  // this rank's (rank 0's) rows and outputs sent to the others
      std::printf("%-34s %12lld\n",
                  "Network bytes sent (rank 0):", static_cast<long long>(stats.network_bytes));
    }
  }
  // --expert-budget: the expert cache over the measured run.
  nlohmann::json cache_json = nullptr;
  std::optional<offload::CacheSummary> cache_summary;
  if (stats.expert_offload() && before.expert_cache.size() == stats.expert_cache.size()) {
    std::vector<int64_t> counters = stats.expert_cache, bytes_by_layer = stats.expert_cache_bytes;
    std::vector<double> stall_by_layer = stats.expert_cache_stall_seconds;
    for (size_t i = 0; i < counters.size(); ++i) counters[i] -= before.expert_cache[i];
    for (size_t l = 0; l < bytes_by_layer.size(); ++l) {
      bytes_by_layer[l] -= before.expert_cache_bytes[l];
      stall_by_layer[l] -= before.expert_cache_stall_seconds[l];
    }
    const offload::CacheSummary cache =
        offload::summarize_cache(counters, bytes_by_layer, stall_by_layer);
    cache_summary = cache;
    const int64_t* counts = cache.counts;
    const int64_t bytes = cache.host_to_device_bytes;
    const double stall = cache.stall_seconds;
    const int64_t prefetched = counts[offload::kCachePrefetched];
    std::printf("%-34s %12.4f\n", "Expert cache hit rate:", cache.hit_rate());
    std::printf("%-34s %12lld\n", "Expert demands read from host:",
                static_cast<long long>(counts[offload::kCacheUnplaced]));
    std::printf("%-34s %12.4f\n", "Expert prefetch accuracy:", cache.prefetch_accuracy());
    std::printf("%-34s %12.1f\n", "Expert bytes host to device (MiB):", bytes / 1048576.0);
    // On the GPU the wait is inside the step's graph: only a --profile step's events time it.
    const bool stall_timed = !engine->gpu() || args.profile;
    if (stall_timed) {
      std::printf("%-34s %12.4f\n", "Expert copy stall (s):", stall);
    } else {
      std::printf("%-34s %12s\n", "Expert copy stall (s):", "untimed (--profile times it)");
    }
    cache_json = {{"hits", counts[offload::kCacheHits]},
                  {"misses", counts[offload::kCacheMisses]},
                  {"unplaced", counts[offload::kCacheUnplaced]},
                  {"prefetched", prefetched},
                  {"prefetch_used", counts[offload::kCachePrefetchUsed]},
                  {"prefetch_wasted", counts[offload::kCachePrefetchWasted]},
                  {"host_to_device_bytes", bytes},
                  {"stall_seconds", stall_timed ? nlohmann::json(stall) : nlohmann::json()}};
  }
  nlohmann::json gpu_json = nlohmann::json::object();
  if (engine->gpu()) {
    print_gpu_figures(*engine, args, times, cache_summary ? &*cache_summary : nullptr,
                      stats.num_steps, gpu_json);
  }
  if (!args.json_file.empty()) {
    std::ofstream out(args.json_file);
    MOE_CHECK(out.good(), "cannot write ", args.json_file);
    // Which routing was measured: a checkpoint's own router, or a synthetic model's.
    const std::string routing = is_synthetic_model(args.model)
                                    ? routing_skew_label(parse_routing_skew(args.routing_skew))
                                    : "checkpoint";
    out << nlohmann::json{{"model", name},
                          {"routing", routing},
                          {"device", args.device.device},
                          {"gpu", gpu_json.value("gpu", nlohmann::json())},
                          {"batch", args.batch},
                          {"ep", args.device.ep},
                          {"requests_per_rank", requests_per_rank},
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
                          {"stage_seconds", stages},
                          {"timed_steps", stats.timed_steps},
                          {"network_bytes", stats.network_bytes},
                          {"expert_cache", cache_json}}
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
  auto* batch = cmd->add_option("--batch", args->batch, "Requests run together")
                    ->capture_default_str();
  cmd->add_option("--input-len", args->input_len, "Prompt tokens per request")
      ->capture_default_str();
  cmd->add_option("--output-len", args->output_len, "Tokens generated per request")
      ->capture_default_str();
  cmd->add_option("--temperature", args->temperature,
                  "Sampling temperature of the generated tokens (0: greedy). On a synthetic "
                  "model 1 draws near-uniform tokens, so each step routes afresh instead of "
                  "repeating a greedy loop's experts")
      ->check(CLI::Range(0.0, 2.0))
      ->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", args->max_num_batched_tokens,
                  "Per-step token budget (0: every prompt in one step)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "Random seed for the prompts")->capture_default_str();
  cmd->add_option("--json", args->json_file, "Write the results as JSON to FILE")
      ->check(writable_file());
  cmd->add_flag("--profile", args->profile,
                "Time every stage with the stage profiler and print each one's share");
  cmd->add_option("--time-every", args->time_every,
                  "--profile: time the stages of one step in N, count rows on every step "
                  "(default: 1 on the CPU, 16 on the GPU)")
      ->check(CLI::Range(1, 1 << 30));
  cmd->add_option("--profiler-steps", args->profiler_steps,
                  "cuda: bracket N decode steps from the middle of the run with "
                  "cudaProfilerStart/Stop, which Nsight Compute and Nsight Systems can wait for "
                  "(docs/profiling.md)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  add_device_options(cmd, &args->device);
  add_offload_options(cmd, &args->device);
  add_routing_options(cmd, &args->device);
  add_weight_options(cmd, &args->device);
  add_kv_options(cmd, &args->device);
  add_expert_parallel_option(cmd, &args->device);
  add_synthetic_options(cmd, &args->layers, &args->routing_skew);
  cmd->add_flag("--deterministic", args->deterministic,
                "Batch-invariant kernels, as serve --deterministic (cpu and cuda), to measure "
                "their cost");
  cmd->add_flag("--no-programmatic-launch", args->no_programmatic_launch,
                "cuda: launch every kernel after the previous one has finished, instead of "
                "letting the small ones start during its tail (programmatic dependent launch), "
                "to measure what that saves");
  cmd->add_flag("--no-fold-norms", args->no_fold_norms,
                "cuda: launch each RMSNorm alone instead of folding it into the skinny GEMM of "
                "the projection after it, to measure what the fold saves");
  cmd->add_flag("--merge-attention-splits", args->merge_attention_splits,
                "cuda: the decode attention's last split block merges the splits instead of a "
                "combine launch (same results; off: slower at batch 1 on an H100), to measure it");
  cmd->add_flag("--no-one-row-expert-blocks", args->no_one_row_expert_blocks,
                "cuda: a step of one token runs the decode experts' kernel up to four rows a "
                "block, as larger steps do, instead of one (same results), to measure what one "
                "row saves");
  cmd->add_flag("--persistent-layers", args->persistent_layers,
                "cuda: a step of one token runs its GQA + MoE layers in one persistent kernel "
                "(grid barriers between the stages) instead of a dozen launches a layer (same "
                "model, other rounding order; off: not faster so far), to measure it");
  cmd->add_option("--weight-prefetch-bytes", args->weight_prefetch_bytes,
                  "cuda: bytes of each weight row the decode GEMVs ask of L2 before the kernel "
                  "before them has finished (default 0, none: whole rows were slower at batch 1 "
                  "on an H100), to measure it")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_option("--skinny-gemm-rows", args->skinny_gemm_rows,
                  "cuda: dense projections of at most N rows (0 to 8) run the skinny GEMM, a "
                  "weight-streaming kernel, instead of cuBLAS (default 1; 0: cuBLAS always)")
      ->check(CLI::Range(0, 8));
  cmd->add_option("--fused-route-tokens", args->fused_route_tokens,
                  "cuda: MoE layers of steps with at most N tokens (0 to 64) run their route and "
                  "plan stages (router product, top-k, plan) as one kernel (default 0: the "
                  "stage kernels; measured no faster yet)")
      ->check(CLI::Range(0, 64));
  cmd->add_flag("--no-cuda-graphs,--enforce-eager", args->no_cuda_graphs,
                "cuda: launch every decode step's kernels instead of replaying graphs (vLLM's "
                "--enforce-eager)");
  cmd->add_flag("--sweep", args->sweep,
                "Run the speed table in one call: decode at each of --sweep-batches (--input-len "
                "prompt tokens, then --output-len generated) and one prompt of each of "
                "--sweep-prefill tokens; prints each row's time, tokens/s and, on the GPU, its "
                "ratio to the floor measured in the same run");
  auto* sweep_batches =
      cmd->add_option("--sweep-batches", args->sweep_batches, "--sweep: the decode batches")
      ->delimiter(',')
      ->capture_default_str();
  auto* sweep_prefill =
      cmd->add_option("--sweep-prefill", args->sweep_prefill, "--sweep: the prefill prompt lengths")
      ->delimiter(',')
      ->capture_default_str();
  cmd->callback([args, batch, sweep_batches, sweep_prefill] {
    args->batch_given = batch->count() > 0;
    args->sweep_lists_given = sweep_batches->count() + sweep_prefill->count() > 0;
    end_job_on_error(args->device.ep > 1, [&] { run_bench(*args); });
  });
}

}  // namespace moeinfer::cli
