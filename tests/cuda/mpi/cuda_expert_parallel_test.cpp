// Expert parallelism on the GPU (--ep N --device cuda, model/cuda/expert_parallel.h), run as
// several ranks under mpirun (tests/CMakeLists.txt: cuda_mpi_np2); ranks on one machine take GPU
// rank % count, so two ranks on a one-GPU machine share it. The tests are registered only where a
// CUDA device is present (as test_cuda's are); without one (CI) the job runs none and passes.
//
// Dispatch (gpu::DeviceDispatcher, over the staged row transport, and over NCCL too where every
// rank has a GPU of its own): each rank's token rows carry their source rank and token index
// (small integers, exact in bf16); a receiver checks that every row it got is one routed to an
// expert it holds, in logical-expert order, every such row once (the replica rule splitting
// replicated experts), and an identity "expert" (the rows handed back as outputs) makes combine
// return each token's weighted sum of its own row.
//
// Decoder: for fixture models of several families, every rank runs the same routes through a
// one-process GPU decoder and through one under --ep N (the same weights, the same arithmetic:
// both without the small-batch MoE path, which --ep turns off; only the grouped GEMM's row
// counts differ). Asserted: logits within the GPU parity bound
// (relative 2e-2, as cuda_parity_test; the printed figure is expected to be far below it) and
// identical greedy continuations. Ranks also run different batches (rank r's prompt rotated by
// r, its decode steps of 3 sequences on rank 0 and 2 on the others: every rank runs the same
// number of forwards, each a collective), and a placement with replicas gives the same logits.
// Every family also runs under --deterministic over the staged transport, whose logits must
// equal the one-process run's exactly. Ranks with empty batches (padding rows that still join every
// exchange) beside rank 0 leave its logits those of one process. Two micro-batches
// (--micro-batches 2, overlapping on their streams and not) are held to the same bounds on every
// family, with one more step that mixes a prefill chunk, a decode row and a fresh prefill, and
// under --deterministic to the one-process logits exactly: a micro-batch's rows go through
// products whose per-row order does not depend on the rows beside them.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "../../support/model_fixtures.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_stages.h"
#include "core/dtype.h"
#include "model/cuda/device_memory.h"
#include "model/cuda/expert_parallel.h"
#include "model/cuda/row_transport.h"
#include "model/gpu_decoder.h"
#include "model/model.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"

namespace moeinfer {
namespace {

using parallel::Communicator;
using parallel::world;

constexpr double kMaxRelError = 2e-2;  // cuda_parity_test's bound

bool have_device() {
  int count = 0;
  const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return ok;
}

void use_rank_device(const Communicator& job) {
  CUDA_CHECK(cudaSetDevice(job.rank() % cuda_device_count()));
}

// The test's routing: token t of source s picks experts (s + 3t + 2k) mod E for k < K (K <= E/2
// keeps them distinct), weights 1/2, 1/4, ... (exact in float32 and bf16).
int32_t routed_expert(int s, int64_t t, int64_t k, int64_t E) {
  return static_cast<int32_t>((s + 3 * t + 2 * k) % E);
}

// One layer through DeviceDispatcher over `transport` with `table`: tags checked at the
// receiver, identity experts, weighted sums back. T tokens on every rank, the last padding(s) of
// rank s's padding.
void check_dispatch(const parallel::LayerPlacement& table, int64_t T,
                    const std::function<int64_t(int)>& padding, EpTransport transport) {
  Communicator& job = world();
  use_rank_device(job);
  const int me = job.rank(), N = job.size();
  const int64_t E = table.num_experts(), K = 2, H = 16;
  const auto real_of = [&](int s) { return T - padding(s); };
  const int64_t real = real_of(me);
  std::vector<uint16_t> hidden(static_cast<size_t>(T * H), 0);
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<float> weights(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    hidden[t * H + 0] = f32_to_bf16(static_cast<float>(me));
    hidden[t * H + 1] = f32_to_bf16(static_cast<float>(t));
    for (int64_t h = 2; h < H; ++h) hidden[t * H + h] = f32_to_bf16(1.0f);
    for (int64_t k = 0; k < K; ++k) {
      const bool pad = t >= real;
      ids[t * K + k] = pad ? static_cast<int32_t>(E) : routed_expert(me, t, k, E);
      weights[t * K + k] = pad ? 0.0f : 1.0f / static_cast<float>(2 << k);
    }
  }
  gpu::StreamHandle owned_stream;
  {
    cudaStream_t created = nullptr;
    CUDA_CHECK(cudaStreamCreate(&created));
    owned_stream.reset(created);
  }
  cudaStream_t stream = owned_stream.get();
  auto upload = [&](const auto& host) {
    using Elem = typename std::decay_t<decltype(host)>::value_type;
    auto array = gpu::device_array<Elem>(std::max<size_t>(host.size(), 1));
    CUDA_CHECK(cudaMemcpy(array.get(), host.data(), host.size() * sizeof(Elem),
                          cudaMemcpyHostToDevice));
    return array;
  };
  const auto hidden_dev = upload(hidden);
  const auto ids_dev = upload(ids);
  const auto weights_dev = upload(weights);
  const int64_t ws = cuda::plan_workspace_size(T * K, E + 1);
  const auto counts_dev = gpu::device_array<int32_t>(E + 1);
  const auto offsets_dev = gpu::device_array<int32_t>(E + 2);
  const auto src_dev = gpu::device_array<int32_t>(T * K);
  const auto inverse_dev = gpu::device_array<int32_t>(T * K);
  const auto ws_dev = gpu::device_array<int32_t>(std::max<int64_t>(ws, 1));
  const auto plan_rows_dev = gpu::device_array<__nv_bfloat16>(T * K * H);
  const auto out_dev = gpu::device_array<float>(T * H);
  const auto* d_hidden = reinterpret_cast<const __nv_bfloat16*>(hidden_dev.get());
  cuda::moe_plan({.topk_ids = ids_dev.get(), .expert_counts = counts_dev.get(),
                  .expert_offsets = offsets_dev.get(), .src_row = src_dev.get(),
                  .inverse = inverse_dev.get(), .workspace = ws > 0 ? ws_dev.get() : nullptr,
                  .num_assignments = T * K, .num_experts = E + 1},
                 stream);

  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const auto s = table.slots(r);
    slots[r].assign(s.begin(), s.end());
  }
  gpu::DeviceDispatcher dispatcher(
      job, gpu::make_row_transport(job, transport, job.rank() % cuda_device_count(), stream),
      parallel::ExpertPlacement(table, {}), E, H, N * T * K, plan_rows_dev.get());
  const gpu::RoutedTokens tokens{.hidden = d_hidden, .topk_ids = ids_dev.get(),
                                 .topk_weights = weights_dev.get(),
                                 .expert_offsets = offsets_dev.get(), .src_row = src_dev.get(),
                                 .inverse = inverse_dev.get(), .num_tokens = T, .top_k = K};
  const gpu::ExpertRows rows = dispatcher.dispatch(/*layer=*/0, tokens, stream);
  EXPECT_EQ(rows.num_experts, E);
  EXPECT_EQ(rows.src_row, nullptr);
  std::vector<uint16_t> got(static_cast<size_t>(rows.num_rows * H));
  std::vector<int32_t> offsets(static_cast<size_t>(E + 1));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  if (rows.num_rows > 0) {
    CUDA_CHECK(cudaMemcpy(got.data(), rows.rows, got.size() * sizeof(uint16_t),
                          cudaMemcpyDeviceToHost));
  }
  CUDA_CHECK(cudaMemcpy(offsets.data(), rows.expert_offsets, offsets.size() * sizeof(int32_t),
                        cudaMemcpyDeviceToHost));

  // What this rank must receive: for every source s, expert e's i-th row (plan order: token
  // order) goes to replica (i + s) mod m.
  std::vector<std::vector<std::pair<int, int64_t>>> want(static_cast<size_t>(E));
  for (int s = 0; s < N; ++s) {
    std::vector<std::vector<int64_t>> plan(static_cast<size_t>(E));  // tokens per expert
    for (int64_t t = 0; t < real_of(s); ++t) {
      for (int64_t k = 0; k < K; ++k) plan[routed_expert(s, t, k, E)].push_back(t);
    }
    for (int64_t e = 0; e < E; ++e) {
      const auto replicas = table.replicas(e);
      const int64_t m = static_cast<int64_t>(replicas.size());
      for (size_t i = 0; i < plan[e].size(); ++i) {
        if (replicas[(static_cast<int64_t>(i) + s) % m] == me) want[e].push_back({s, plan[e][i]});
      }
    }
  }
  // EXPECT, not ASSERT, until the last collective: a rank that fails must still take part in
  // combine, or the others wait for it.
  int64_t expected_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(offsets[e + 1] - offsets[e], static_cast<int32_t>(want[e].size()))
        << "rank " << me << " expert " << e;
    const bool in_range = offsets[e] >= 0 && offsets[e] <= offsets[e + 1] &&
                          offsets[e + 1] <= rows.num_rows;
    EXPECT_TRUE(in_range) << "rank " << me << " expert " << e << ": offsets " << offsets[e]
                          << ".." << offsets[e + 1] << " of " << rows.num_rows << " rows";
    std::vector<std::pair<int, int64_t>> seen;
    for (int32_t r = offsets[e]; in_range && r < offsets[e + 1]; ++r) {
      seen.push_back({static_cast<int>(bf16_to_f32(got[r * H + 0])),
                      static_cast<int64_t>(bf16_to_f32(got[r * H + 1]))});
      for (int64_t h = 2; h < H; ++h) {
        if (bf16_to_f32(got[r * H + h]) != 1.0f) {
          ADD_FAILURE() << "rank " << me << " row " << r << " column " << h << " changed";
          break;
        }
      }
    }
    EXPECT_EQ(seen, want[e]) << "rank " << me << " expert " << e << ": (source, token) tags";
    expected_rows += static_cast<int64_t>(want[e].size());
  }
  EXPECT_EQ(rows.num_rows, expected_rows);

  // Identity experts: each token gets back sum_k w_k * its own row.
  dispatcher.combine(0, rows.rows, tokens, /*shared=*/nullptr, out_dev.get(), stream);
  std::vector<float> out(static_cast<size_t>(T * H));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(out.data(), out_dev.get(), out.size() * sizeof(float),
                        cudaMemcpyDeviceToHost));
  for (int64_t t = 0; t < real; ++t) {
    float wsum = 0.0f;
    for (int64_t k = 0; k < K; ++k) wsum += weights[t * K + k];
    for (int64_t h = 0; h < H; ++h) {
      ASSERT_EQ(out[t * H + h], bf16_to_f32(hidden[t * H + h]) * wsum)
          << "rank " << me << " token " << t << " column " << h;
    }
  }
  // Some bytes left for the other ranks, by the link class of a shared or peer GPU.
  const auto& sent = dispatcher.bytes_sent();
  if (N > 1 && real > 0) {
    EXPECT_GT(sent[static_cast<int>(profile::Link::kSameGpu)] +
                  sent[static_cast<int>(profile::Link::kPeerGpu)] +
                  sent[static_cast<int>(profile::Link::kNetwork)],
              0);
  }
}

// The transports this job can run: staged always, and NCCL where every rank has a GPU of its
// own (auto then picks it). Collective.
std::vector<EpTransport> job_transports() {
  use_rank_device(world());
  std::vector<EpTransport> transports = {EpTransport::kStaged};
  if (gpu::have_nccl() && !gpu::ranks_share_a_gpu(world())) {
    transports.push_back(EpTransport::kNccl);
  }
  return transports;
}

void dispatch_carries_tagged_rows_to_their_experts_and_back() {
  const int N = world().size();
  for (const EpTransport transport : job_transports()) {
    SCOPED_TRACE(gpu::ep_transport_name(transport));
    check_dispatch(
        parallel::LayerPlacement::contiguous(8, N), /*T=*/13, [](int) { return 3; }, transport);
  }
}

void dispatch_splits_replicated_experts() {
  const int N = world().size();
  // Rank 0 holds every expert, in reverse order; the others the even ones.
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(N));
  for (int32_t e = 7; e >= 0; --e) slots[0].push_back(e);
  for (int r = 1; r < N; ++r) {
    for (int32_t e = 0; e < 8; e += 2) slots[r].push_back(e);
  }
  for (const EpTransport transport : job_transports()) {
    SCOPED_TRACE(gpu::ep_transport_name(transport));
    check_dispatch(
        parallel::LayerPlacement(8, slots), /*T=*/21, [](int s) { return s; }, transport);
  }
}

void rank_without_real_tokens_takes_part_in_every_exchange() {
  const int N = world().size();
  // The last rank's tokens are all padding: it still sends its (zero) counts, receives the
  // others' rows for its experts and returns their outputs.
  for (const EpTransport transport : job_transports()) {
    SCOPED_TRACE(gpu::ep_transport_name(transport));
    check_dispatch(
        parallel::LayerPlacement::contiguous(8, N), /*T=*/6,
        [N](int s) { return s == N - 1 ? 6 : 0; }, transport);
    // Every rank without real tokens: the exchanges still go round, empty.
    check_dispatch(
        parallel::LayerPlacement::contiguous(8, N), /*T=*/4, [](int) { return 4; }, transport);
  }
}

// --- the decoder ---

struct RunResult {
  std::vector<float> prefill;   // [n, V] all positions of the prompt
  std::vector<float> decode;    // [steps, S, V] S sequences decoded together
  std::vector<int32_t> greedy;  // the greedy continuation of the prompt
  std::vector<float> mixed;     // [S, V] the mixed step (run_routes' mixed_step), else empty
};

// With mixed_step, one more step after the decode steps mixes every kind of row: sequence 0
// brings a chunk of 2 tokens after its cached ones, sequence 1 (of 3) one decode token, and the
// last sequence starts again from position 0 with 3 prompt tokens (a fresh prefill). Split in
// two micro-batches, A (the first half of the sequences, the larger when odd) holds the chunk
// and the decode row, B the fresh prefill.
RunResult run_routes(GpuDecoder& gpu, const std::vector<int32_t>& prompt, int64_t greedy_steps,
                     int num_seqs, bool mixed_step = false) {
  const int64_t V = gpu.config().vocab_size;
  const int64_t n = static_cast<int64_t>(prompt.size());
  const bool slots = gpu.config().linear_attention.has_value();
  auto table = [](int32_t first) {
    std::vector<int32_t> b(4);
    std::iota(b.begin(), b.end(), first);
    return b;
  };
  RunResult result;
  result.prefill.assign(static_cast<size_t>(n * V), NAN);
  const std::vector<int32_t> t0 = table(0);
  gpu.forward({.sequences = {{.tokens = prompt, .position = 0, .block_table = t0,
                              .state_slot = slots ? 0 : -1}},
               .all_positions = true},
              result.prefill);
  // Greedy continuation of the prompt in sequence 0.
  std::vector<float> logits(static_cast<size_t>(3 * V));
  int32_t next = static_cast<int32_t>(
      std::max_element(result.prefill.end() - V, result.prefill.end()) -
      (result.prefill.end() - V));
  for (int64_t s = 0; s < greedy_steps; ++s) {
    result.greedy.push_back(next);
    const int32_t token[1] = {next};
    gpu.forward({.sequences = {{.tokens = token, .position = n + s, .block_table = t0,
                                .state_slot = slots ? 0 : -1}}},
                std::span<float>(logits).first(V));
    next = static_cast<int32_t>(std::max_element(logits.begin(), logits.begin() + V) -
                                logits.begin());
  }
  // num_seqs (<= 3) sequences decoded together, token by token over the prompt.
  std::vector<std::vector<int32_t>> tables = {table(4), table(8), table(12)};
  logits.resize(static_cast<size_t>(num_seqs * V));
  for (int64_t t = 0; t < n; ++t) {
    ForwardBatch batch;
    for (int s = 0; s < num_seqs; ++s) {
      batch.sequences.push_back({.tokens = std::span<const int32_t>(prompt).subspan(t, 1),
                                 .position = t, .block_table = tables[s],
                                 .state_slot = slots ? s + 1 : -1});
    }
    gpu.forward(batch, logits);
    result.decode.insert(result.decode.end(), logits.begin(), logits.end());
  }
  if (mixed_step) {
    const std::span<const int32_t> tokens(prompt);
    ForwardBatch batch;
    batch.sequences.push_back({.tokens = tokens.subspan(0, 2),
                               .position = n,
                               .block_table = tables[0],
                               .state_slot = slots ? 1 : -1});
    if (num_seqs == 3) {
      batch.sequences.push_back({.tokens = tokens.subspan(2, 1),
                                 .position = n,
                                 .block_table = tables[1],
                                 .state_slot = slots ? 2 : -1});
    }
    const int last = num_seqs - 1;
    batch.sequences.push_back({.tokens = tokens.subspan(0, 3),
                               .position = 0,
                               .block_table = tables[last],
                               .state_slot = slots ? last + 1 : -1});
    result.mixed.assign(static_cast<size_t>(num_seqs * V), NAN);
    gpu.forward(batch, result.mixed);
  }
  return result;
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got[i])) << "logit " << i;
    diff += std::pow(double{got[i]} - want[i], 2);
    norm += std::pow(double{want[i]}, 2);
  }
  return norm > 0 ? std::sqrt(diff / norm) : 0.0;
}

// How the --ep run splits its steps (GpuOptions::micro_batches, overlap_micro_batches).
struct MicroBatches {
  int count = 1;
  bool overlap = true;
};

std::unique_ptr<GpuDecoder> make_gpu(Model& model, Communicator* comm,
                                     std::optional<parallel::ExpertPlacement> placement,
                                     bool deterministic, EpTransport transport = EpTransport::kAuto,
                                     MicroBatches micro = {}) {
  // Two ranks may share the GPU: each takes a part of it.
  GpuOptions options{.device = world().rank() % cuda_device_count(),
                     .gpu_memory_fraction = 0.3,
                     .max_batch_tokens = 64,
                     .max_num_seqs = 4,
                     .max_model_len = 64,
                     .num_kv_blocks = 16,
                     .quiet = true};
  // The small-batch MoE path sums in another order than the grouped GEMM path that --ep runs
  // (it is off under --ep): off in the one-process run too, so that both compute alike.
  options.small_batch_moe_rows = 0;
  // Eager steps, as --ep runs them: a graph pads a decode step's rows to a bucket, which may
  // change cuBLAS's choice for the other products.
  options.cuda_graphs = false;
  options.deterministic = deterministic;
  options.expert_parallel = comm;
  options.ep_transport = transport;
  options.placement = std::move(placement);
  options.micro_batches = micro.count;
  options.overlap_micro_batches = micro.overlap;
  return GpuDecoder::create(model.config(), model.decoder().weights(), options);
}

// The fixture's prompt on this rank: rotated by r, and decoded in 3 sequences on rank 0, 2 on
// the others, so that the ranks' steps carry different rows.
double max_abs_diff(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(double{got[i]} - want[i]));
    if (std::isnan(got[i]) != std::isnan(want[i])) return INFINITY;
  }
  return worst;
}

// With `exact` (--deterministic in both runs) the logits must be equal: the rank's own tokens go
// through the same products either way, the grouped expert GEMM reduces each element in the same
// order whatever rows share its tiles, and the rows and outputs travel as the bf16 they are.
// With micro.count 2 the --ep run splits every step in two micro-batches (and both runs add the
// mixed step): under --deterministic still exactly the one-process logits, since every product
// then reduces a row in an order that does not depend on the step's other rows (the fixed-order
// GEMM, the batch-invariant expert GEMM, the per-query attention route for prompts).
void check_fixture(const std::string& name, bool replicas, bool exact = false,
                   EpTransport transport = EpTransport::kAuto, MicroBatches micro = {}) {
  Communicator& job = world();
  const auto dir = testing_support::kModelFixtures / name;
  std::ifstream in(dir / "reference.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  std::vector<int32_t> prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  std::rotate(prompt.begin(), prompt.begin() + job.rank() % prompt.size(), prompt.end());
  const int num_seqs = job.rank() == 0 ? 3 : 2;
  const int64_t greedy_steps = 6;
  const bool mixed = micro.count == 2;
  auto model = Model::load(dir, LoadOptions{.prefault = false});
  RunResult one;
  {
    auto gpu = make_gpu(*model, nullptr, std::nullopt, exact);
    one = run_routes(*gpu, prompt, greedy_steps, num_seqs, mixed);
  }
  std::optional<parallel::ExpertPlacement> placement;
  const int64_t E = model->config().num_experts;
  if (replicas) {  // rank 0 every expert; the others the odd ones
    std::vector<std::vector<int32_t>> slots(static_cast<size_t>(job.size()));
    for (int32_t e = 0; e < E; ++e) slots[0].push_back(e);
    for (int r = 1; r < job.size(); ++r) {
      for (int32_t e = 1; e < E; e += 2) slots[r].push_back(e);
    }
    placement.emplace(parallel::LayerPlacement(E, slots),
                      std::map<int64_t, parallel::LayerPlacement>{});
  }
  RunResult ep;
  std::vector<int64_t> sent;
  {
    auto gpu = make_gpu(*model, &job, placement, exact, transport, micro);
    ep = run_routes(*gpu, prompt, greedy_steps, num_seqs, mixed);
    sent = gpu->expert_parallel_bytes();
  }
  const std::string micro_name =
      micro.count == 1 ? "" : (micro.overlap ? " (2 micro-batches)" : " (2 micro-batches, serial)");
  const double prefill = rel_error(ep.prefill, one.prefill);
  const double decode = rel_error(ep.decode, one.decode);
  const double mixed_error = mixed ? rel_error(ep.mixed, one.mixed) : 0.0;
  EXPECT_LE(prefill, kMaxRelError) << name << micro_name << " rank " << job.rank();
  EXPECT_LE(decode, kMaxRelError) << name << micro_name << " rank " << job.rank();
  EXPECT_LE(mixed_error, kMaxRelError) << name << micro_name << " rank " << job.rank();
  EXPECT_EQ(ep.greedy, one.greedy) << name << micro_name << " rank " << job.rank();
  const double largest =
      std::max({max_abs_diff(ep.prefill, one.prefill), max_abs_diff(ep.decode, one.decode),
                max_abs_diff(ep.mixed, one.mixed)});
  if (exact) {
    EXPECT_EQ(largest, 0.0) << name << micro_name << " rank " << job.rank()
                            << " under --deterministic";
  }
  ASSERT_EQ(sent.size(), static_cast<size_t>(profile::kNumLinks));
  std::printf(
      "rank %d %-22s%s%s%s [%s] rel error vs one process: prefill %.2e decode %.2e mixed %.2e "
      "(max abs %.2e) | sent: same_gpu %lld peer_gpu %lld network %lld bytes\n",
      job.rank(), name.c_str(), replicas ? " (replicas)" : "", exact ? " (deterministic)" : "",
      micro_name.c_str(), gpu::ep_transport_name(transport), prefill, decode, mixed_error, largest,
      static_cast<long long>(sent[static_cast<int>(profile::Link::kSameGpu)]),
      static_cast<long long>(sent[static_cast<int>(profile::Link::kPeerGpu)]),
      static_cast<long long>(sent[static_cast<int>(profile::Link::kNetwork)]));
}

// Fixtures of several families: softmax top-k (Qwen3-MoE, OLMoE, Mixtral bf16), grouped sigmoid
// routing with a shared expert (DeepSeek-V3), a sigmoid-gated shared expert (Qwen2-MoE), expert
// biases and the clamped SwiGLU (GPT-OSS), weights on the experts' input (Llama 4).
constexpr const char* kFamilies[] = {"qwen3_moe_f32",  "mixtral_bf16",  "deepseek_v3_f32",
                                     "olmoe_f32",      "qwen2_moe_f32", "gpt_oss_f32",
                                     "llama4_text_f32"};

void replicated_placement_matches_the_one_process_gpu_run() {
  check_fixture("qwen3_moe_f32", /*replicas=*/true);
}

// Two micro-batches with replicas: qwen3 within the parity bound (overlapping), mixtral exactly
// under --deterministic (serial).
void two_micro_batches_with_replicated_placement_match_the_one_process_gpu_run() {
  check_fixture("qwen3_moe_f32", /*replicas=*/true, /*exact=*/false, EpTransport::kAuto,
                {.count = 2, .overlap = true});
  check_fixture("mixtral_bf16", /*replicas=*/true, /*exact=*/true, EpTransport::kAuto,
                {.count = 2, .overlap = false});
}

void deterministic_runs_equal_the_one_process_run_exactly() {
  for (const char* name : {"qwen3_moe_f32", "deepseek_v3_f32", "llama4_text_f32"}) {
    check_fixture(name, /*replicas=*/false, /*exact=*/true);
  }
  check_fixture("mixtral_bf16", /*replicas=*/true, /*exact=*/true);
}

// A rank with nothing scheduled (an Engine under serve or bench --ep on cuda) still runs a
// forward, of an empty batch: one padding row that joins every MoE layer's exchange and returns
// no logits. Rank 0 runs the fixture's routes while every other rank runs as many empty forwards;
// under --deterministic rank 0's logits equal the one-process run's exactly. Families whose empty
// step pads other kernels: MLA (DeepSeek-V3) and Gated DeltaNet's recurrent state (Qwen3.5-MoE).
// With micro.count 2 every forward of the --ep decoder is two micro-batches: rank 0's one
// sequence in A beside an empty B, the other ranks' empty steps two padding rows each.
void check_empty_ranks(const std::string& name, MicroBatches micro = {}) {
  Communicator& job = world();
  const auto dir = testing_support::kModelFixtures / name;
  std::ifstream in(dir / "reference.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  const std::vector<int32_t> prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
  const int64_t greedy_steps = 4;
  auto model = Model::load(dir, LoadOptions{.prefault = false});
  RunResult one;
  if (job.rank() == 0) {
    auto gpu = make_gpu(*model, nullptr, std::nullopt, /*deterministic=*/true);
    one = run_routes(*gpu, prompt, greedy_steps, /*num_seqs=*/1);
  }
  auto gpu =
      make_gpu(*model, &job, std::nullopt, /*deterministic=*/true, EpTransport::kAuto, micro);
  if (job.rank() != 0) {
    // run_routes' forwards: the prompt, the greedy steps, then the prompt token by token.
    const int64_t forwards = 1 + greedy_steps + static_cast<int64_t>(prompt.size());
    for (int64_t i = 0; i < forwards; ++i) gpu->forward(ForwardBatch{}, {});
    return;
  }
  const RunResult ep = run_routes(*gpu, prompt, greedy_steps, /*num_seqs=*/1);
  const double largest =
      std::max(max_abs_diff(ep.prefill, one.prefill), max_abs_diff(ep.decode, one.decode));
  EXPECT_EQ(largest, 0.0) << name << ": rank 0 beside ranks of empty batches, " << micro.count
                          << " micro-batch(es)";
  EXPECT_EQ(ep.greedy, one.greedy) << name;
  std::printf(
      "rank 0 %-22s (other ranks empty, %d micro-batch(es)) rel error vs one process: prefill "
      "%.2e decode %.2e (max abs %.2e)\n",
      name.c_str(), micro.count, rel_error(ep.prefill, one.prefill),
      rel_error(ep.decode, one.decode), largest);
}

void ranks_of_empty_batches_join_every_exchange() {
  for (const char* name : {"qwen3_moe_f32", "deepseek_v3_f32", "qwen3_5_moe_f32"}) {
    check_empty_ranks(name);
  }
}

void ranks_of_empty_batches_join_every_exchange_of_two_micro_batches() {
  for (const char* name : {"qwen3_moe_f32", "deepseek_v3_f32", "qwen3_5_moe_f32"}) {
    for (const bool overlap : {true, false}) {
      check_empty_ranks(name, {.count = 2, .overlap = overlap});
    }
  }
}

class BodyTest : public ::testing::Test {
 public:
  explicit BodyTest(std::function<void()> body) : body_(std::move(body)) {}
  void TestBody() override { body_(); }

 private:
  std::function<void()> body_;
};

void add(const std::string& suite, const std::string& name, std::function<void()> body) {
  ::testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                          [body]() -> ::testing::Test* { return new BodyTest(body); });
}

// Every test of this file, registered only where a CUDA device is present.
void register_tests() {
  add("CudaExpertParallel", "DispatchCarriesTaggedRowsToTheirExpertsAndBack",
      dispatch_carries_tagged_rows_to_their_experts_and_back);
  add("CudaExpertParallel", "DispatchSplitsReplicatedExperts", dispatch_splits_replicated_experts);
  add("CudaExpertParallel", "RankWithoutRealTokensTakesPartInEveryExchange",
      rank_without_real_tokens_takes_part_in_every_exchange);
  add("CudaExpertParallel", "ReplicatedPlacementMatchesTheOneProcessGpuRun",
      replicated_placement_matches_the_one_process_gpu_run);
  add("CudaExpertParallel", "DeterministicRunsEqualTheOneProcessRunExactly",
      deterministic_runs_equal_the_one_process_run_exactly);
  add("CudaExpertParallel", "RanksOfEmptyBatchesJoinEveryExchange",
      ranks_of_empty_batches_join_every_exchange);
  add("CudaExpertParallel", "RanksOfEmptyBatchesJoinEveryExchangeOfTwoMicroBatches",
      ranks_of_empty_batches_join_every_exchange_of_two_micro_batches);
  add("CudaExpertParallel", "TwoMicroBatchesWithReplicatedPlacementMatchTheOneProcessGpuRun",
      two_micro_batches_with_replicated_placement_match_the_one_process_gpu_run);
  for (const char* family : kFamilies) {
    add("Families/CudaExpertParallelFixture", std::string("MatchesTheOneProcessGpuRun/") + family,
        [family] { check_fixture(family, /*replicas=*/false); });
    // Again under --deterministic, the rows over the staged transport (what two ranks sharing
    // the GPU take under auto too): the logits equal the one-process run's exactly.
    add("Families/CudaExpertParallelFixture",
        std::string("EqualsTheOneProcessRunExactlyOverTheStagedTransport/") + family, [family] {
          check_fixture(family, /*replicas=*/false, /*exact=*/true, EpTransport::kStaged);
        });
    // Two micro-batches per step (--micro-batches 2), their streams overlapping (--overlap on)
    // and one after the other (off): within the parity bound, with the same greedy tokens. The
    // prefill and greedy steps carry one sequence (micro-batch B an empty padding row), the
    // decode steps 3 sequences on rank 0 (A 2, B 1) and 2 elsewhere, and the mixed step a
    // chunk, a decode row and a fresh prefill.
    add("Families/CudaExpertParallelFixture",
        std::string("TwoMicroBatchesMatchTheOneProcessGpuRun/") + family, [family] {
          for (const bool overlap : {true, false}) {
            check_fixture(family, /*replicas=*/false, /*exact=*/false, EpTransport::kAuto,
                          {.count = 2, .overlap = overlap});
          }
        });
    // The same under --deterministic over the staged transport: exactly the one-process logits.
    add("Families/CudaExpertParallelFixture",
        std::string("TwoMicroBatchesEqualTheOneProcessRunExactly/") + family, [family] {
          check_fixture(family, /*replicas=*/false, /*exact=*/true, EpTransport::kStaged,
                        {.count = 2, .overlap = true});
        });
  }
}

// Failures on ranks > 0 are printed with their rank (rank 0 prints as usual).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace moeinfer

int main(int argc, char** argv) {
  using namespace moeinfer::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  Communicator& job = world();  // initialises MPI once; finalised at exit
  if (moeinfer::have_device()) {
    moeinfer::register_tests();
  } else if (job.rank() == 0) {
    std::fprintf(stderr, "test_cuda_expert_parallel: no CUDA device; no test is registered\n");
  }
  if (job.rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new moeinfer::FailurePrinter(job.rank()));
  }
  const int result = RUN_ALL_TESTS();
  std::vector<int64_t> num_failed_ranks = {result != 0 ? 1 : 0};
  job.all_reduce_sum(std::span<int64_t>(num_failed_ranks));
  if (job.rank() == 0 && num_failed_ranks[0] > 0) {
    std::fprintf(stderr, "%lld of %d ranks failed\n", static_cast<long long>(num_failed_ranks[0]),
                 job.size());
  }
  return num_failed_ranks[0] > 0 ? 1 : 0;
}
