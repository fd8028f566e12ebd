// The device path of expert parallelism on the GPU (model/cuda/expert_parallel.h,
// row_transport.h) in one process:
//   MoveRows         cuda::move_rows gathering, scattering and both, against a host copy, bit
//                    for bit
//   ThreeRankLayout  rank 1 of a hand-made job of 3 ranks (replicated experts, a padding
//                    expert, counts from the other ranks made up): the packing of its plan rows
//                    by send_pos, the received rows put in logical-expert order by expert_order's
//                    row_of_recv (checked against an order built independently: expert by
//                    expert, source by source), and the outputs' way back, each on the device
//                    against the host's copies
//   OneRank*         DeviceDispatcher over a job of one rank (SelfCommunicator), through the
//                    staged transport and through NCCL (NcclCommunicator::single): the rows it
//                    hands the experts are the plan's rows, and identity experts give back
//                    each token's weighted sum of its own row
//   EpOneOver*       a fixture decoder under --ep 1 over either transport equals the local run
//                    exactly (--deterministic both): the whole path end to end on one GPU
// Registered only when a CUDA device is present (cuda_test_util.h).
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../support/model_fixtures.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/row_moves.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "model/cuda/expert_parallel.h"
#include "model/cuda/row_transport.h"
#include "model/gpu_decoder.h"
#include "model/model.h"
#include "moe/expert_parallel.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"

namespace moeinfer {
namespace {

using cuda::testing_util::DeviceBuffer;
using cuda::testing_util::fresh_seed;
using cuda::testing_util::random_bf16;
using cuda::testing_util::synchronize;

// Host reference of move_rows: dst[dst_index[i]] = src[src_index[i]] (null: identity).
void host_move_rows(const std::vector<uint16_t>& src, const int32_t* src_index,
                    std::vector<uint16_t>& dst, const int32_t* dst_index, int64_t rows, int64_t H) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t from = src_index ? src_index[i] : i;
    const int64_t to = dst_index ? dst_index[i] : i;
    std::memcpy(dst.data() + to * H, src.data() + from * H, static_cast<size_t>(H) * 2);
  }
}

// move_rows on the device over the same inputs; dst starts as `dst_start` (rows it does not
// write keep it).
std::vector<uint16_t> device_move_rows(const std::vector<uint16_t>& src,
                                       const std::vector<int32_t>* src_index,
                                       const std::vector<uint16_t>& dst_start,
                                       const std::vector<int32_t>* dst_index, int64_t rows,
                                       int64_t H) {
  const DeviceBuffer<uint16_t> src_dev(src), dst_dev(dst_start);
  const DeviceBuffer<int32_t> src_index_dev(src_index ? *src_index : std::vector<int32_t>{});
  const DeviceBuffer<int32_t> dst_index_dev(dst_index ? *dst_index : std::vector<int32_t>{});
  cuda::move_rows({.src = src_dev.as_bf16(),
                   .src_index = src_index ? src_index_dev.get() : nullptr,
                   .dst = dst_dev.as_bf16(),
                   .dst_index = dst_index ? dst_index_dev.get() : nullptr,
                   .num_rows = rows,
                   .hidden_size = H},
                  nullptr);
  synchronize();
  return dst_dev.download();
}

std::vector<int32_t> shuffled(int32_t n, std::mt19937& rng) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

void move_rows_gathers_and_scatters() {
  std::mt19937 rng(fresh_seed());
  const int64_t H = 24, rows = 37;
  const std::vector<uint16_t> src = random_bf16(static_cast<size_t>(rows * H), rng);
  const std::vector<uint16_t> poison(static_cast<size_t>(rows * H), 0xFFFF);
  const std::vector<int32_t> a = shuffled(rows, rng), b = shuffled(rows, rng);
  for (int kind = 0; kind < 3; ++kind) {  // gather, scatter, both
    const std::vector<int32_t>* from = kind != 1 ? &a : nullptr;
    const std::vector<int32_t>* to = kind != 0 ? &b : nullptr;
    std::vector<uint16_t> want = poison;
    host_move_rows(src, from ? from->data() : nullptr, want, to ? to->data() : nullptr, rows, H);
    EXPECT_EQ(device_move_rows(src, from, poison, to, rows, H), want) << "kind " << kind;
  }
  // A subset of the rows: the others keep what they held.
  std::vector<uint16_t> want = poison;
  host_move_rows(src, nullptr, want, b.data(), 5, H);
  EXPECT_EQ(device_move_rows(src, nullptr, poison, &b, 5, H), want);
  // Nothing to move launches nothing.
  cuda::move_rows({.hidden_size = H}, nullptr);
  cuda::testing_util::expect_error_naming(
      [] { cuda::move_rows({.num_rows = 1, .hidden_size = 12}, nullptr); }, "hidden_size");
}

// Rank 1 of 3 ranks over E = 6 experts: rank 0 holds {0, 1, 5}, rank 1 {2, 3, 5, 0}, rank 2
// {4, 5}: expert 5 on every rank, expert 0 on two; rank 1's slots out of expert order.
void three_rank_layout() {
  std::mt19937 rng(fresh_seed());
  constexpr int kMe = 1, kRanks = 3;
  const int64_t E = 6, H = 16;
  const parallel::LayerPlacement table(E, {{0, 1, 5}, {2, 3, 5, 0}, {4, 5}});
  // The plan over E + 1 experts (the last the padding expert): rows per expert.
  const std::vector<int32_t> counts = {3, 0, 2, 4, 1, 5, 2};
  std::vector<int32_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  const int64_t plan_rows = offsets.back(), real = offsets[E];

  moe::DispatchLayout layout;
  layout.plan_sends(table, kMe, offsets);
  ASSERT_EQ(static_cast<int64_t>(layout.send_pos.size()), real);
  const std::vector<uint16_t> plan = random_bf16(static_cast<size_t>(plan_rows * H), rng);
  const std::vector<uint16_t> poison(static_cast<size_t>(real * H), 0xFFFF);
  std::vector<uint16_t> packed = poison;
  host_move_rows(plan, nullptr, packed, layout.send_pos.data(), real, H);
  EXPECT_EQ(device_move_rows(plan, nullptr, poison, &layout.send_pos, real, H), packed)
      << "the plan's rows packed by receiver, slot and plan order";

  // What arrives at rank 1: made-up counts from ranks 0 and 2, its own from plan_sends.
  const auto slots = table.slots(kMe);
  const int64_t mine = static_cast<int64_t>(slots.size());
  layout.recv_counts = {1, 2, 0, 3,  // from rank 0, per slot of rank 1
                        0, 0, 0, 0,  // from itself, filled below
                        2, 0, 1, 1};
  for (int64_t j = 0; j < mine; ++j) {
    layout.recv_counts[kMe * mine + j] = layout.send_counts[layout.slot_base[kMe] + j];
  }
  layout.recv_num_rows.assign(kRanks, 0);
  layout.received = 0;
  for (int s = 0; s < kRanks; ++s) {
    for (int64_t j = 0; j < mine; ++j) layout.recv_num_rows[s] += layout.recv_counts[s * mine + j];
    layout.received += layout.recv_num_rows[s];
  }
  layout.merge(mine);
  const gpu::ExpertOrder order = gpu::expert_order(layout, slots, E);
  const int64_t received = layout.received;

  // Independently: the received rows come source by source, slot by slot; expert order takes
  // the logical experts in turn, each one's rows source by source.
  std::vector<int32_t> first_of(static_cast<size_t>(kRanks * mine) + 1, 0);
  std::partial_sum(layout.recv_counts.begin(), layout.recv_counts.end(), first_of.begin() + 1);
  std::vector<int32_t> want_row_of_recv(static_cast<size_t>(received), -1);
  std::vector<int32_t> want_offsets(static_cast<size_t>(E) + 1, 0);
  int32_t next = 0;
  for (int64_t e = 0; e < E; ++e) {
    want_offsets[e] = next;
    const auto at = std::find(slots.begin(), slots.end(), static_cast<int32_t>(e));
    if (at == slots.end()) continue;
    const int64_t j = at - slots.begin();
    for (int s = 0; s < kRanks; ++s) {
      for (int32_t i = 0; i < layout.recv_counts[s * mine + j]; ++i) {
        want_row_of_recv[first_of[s * mine + j] + i] = next++;
      }
    }
  }
  want_offsets[E] = next;
  ASSERT_EQ(next, received);
  EXPECT_EQ(order.offsets, want_offsets);
  EXPECT_EQ(order.row_of_recv, want_row_of_recv);

  // The received rows into expert order, and the outputs back to source order.
  const std::vector<uint16_t> recv = random_bf16(static_cast<size_t>(received * H), rng);
  const std::vector<uint16_t> poison_recv(static_cast<size_t>(received * H), 0xFFFF);
  std::vector<uint16_t> expert_rows = poison_recv;
  host_move_rows(recv, nullptr, expert_rows, order.row_of_recv.data(), received, H);
  EXPECT_EQ(device_move_rows(recv, nullptr, poison_recv, &order.row_of_recv, received, H),
            expert_rows);
  std::vector<uint16_t> back = poison_recv;
  host_move_rows(expert_rows, order.row_of_recv.data(), back, nullptr, received, H);
  EXPECT_EQ(back, recv) << "the outputs go back in the order their rows came";
  EXPECT_EQ(device_move_rows(expert_rows, &order.row_of_recv, poison_recv, nullptr, received, H),
            back);
  // The returned outputs to plan order: the packing undone.
  std::vector<uint16_t> unpacked(static_cast<size_t>(real * H), 0xFFFF);
  host_move_rows(packed, layout.send_pos.data(), unpacked, nullptr, real, H);
  EXPECT_EQ(device_move_rows(packed, &layout.send_pos, poison, nullptr, real, H), unpacked);
  EXPECT_TRUE(std::equal(unpacked.begin(), unpacked.end(), plan.begin()));
}

// One layer through DeviceDispatcher over a one-rank job and `transport`: the rows the experts
// get are the plan's rows, and identity experts return each token's weighted sum of its row.
void one_rank_dispatch(EpTransport transport) {
  std::mt19937 rng(fresh_seed());
  parallel::SelfCommunicator self;
  const int64_t T = 11, K = 2, E = 5, H = 32, padding = 3;
  std::vector<uint16_t> hidden = random_bf16(static_cast<size_t>(T * H), rng);
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<float> weights(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const bool pad = t >= T - padding;
      ids[t * K + k] = pad ? static_cast<int32_t>(E) : static_cast<int32_t>((t + 2 * k) % E);
      weights[t * K + k] = pad ? 0.0f : 1.0f / static_cast<float>(2 << k);
    }
  }
  const DeviceBuffer<uint16_t> hidden_dev(hidden);
  const DeviceBuffer<int32_t> ids_dev(ids);
  const DeviceBuffer<float> weights_dev(weights);
  const int64_t ws = cuda::plan_workspace_size(T * K, E + 1);
  const DeviceBuffer<int32_t> counts_dev(E + 1), offsets_dev(E + 2), src_dev(T * K),
      inverse_dev(T * K), ws_dev(std::max<int64_t>(ws, 1));
  const DeviceBuffer<uint16_t> plan_rows_dev(T * K * H), local_rows_dev(T * K * H);
  const DeviceBuffer<float> out_dev(T * H);
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreate(&stream));
  cuda::moe_plan({.topk_ids = ids_dev.get(),
                  .expert_counts = counts_dev.get(),
                  .expert_offsets = offsets_dev.get(),
                  .src_row = src_dev.get(),
                  .inverse = inverse_dev.get(),
                  .workspace = ws > 0 ? ws_dev.get() : nullptr,
                  .num_assignments = T * K,
                  .num_experts = E + 1},
                 stream);
  // The plan's rows as one GPU gathers them.
  cuda::permute({.hidden = hidden_dev.as_bf16(),
                 .inverse = inverse_dev.get(),
                 .rows = local_rows_dev.as_bf16(),
                 .num_tokens = T,
                 .top_k = K,
                 .hidden_size = H},
                stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  {
    gpu::RowTransport rows = gpu::make_row_transport(self, transport, 0, stream);
    const std::string name = rows.comm->name();
    gpu::DeviceDispatcher dispatcher(self, std::move(rows), parallel::ExpertPlacement(E, 1), E, H,
                                     T * K, plan_rows_dev.as_bf16());
    EXPECT_EQ(dispatcher.transport_name(), name);
    const gpu::RoutedTokens tokens{.hidden = hidden_dev.as_bf16(),
                                   .topk_ids = ids_dev.get(),
                                   .topk_weights = weights_dev.get(),
                                   .expert_offsets = offsets_dev.get(),
                                   .src_row = src_dev.get(),
                                   .inverse = inverse_dev.get(),
                                   .num_tokens = T,
                                   .top_k = K};
    const gpu::ExpertRows got = dispatcher.dispatch(0, tokens, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const int64_t real = (T - padding) * K;
    ASSERT_EQ(got.num_rows, real) << name;
    EXPECT_EQ(got.num_experts, E);
    std::vector<int32_t> got_offsets(static_cast<size_t>(E) + 1);
    CUDA_CHECK(cudaMemcpy(got_offsets.data(), got.expert_offsets,
                          got_offsets.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    std::vector<int32_t> plan_offsets = offsets_dev.download();
    plan_offsets.resize(static_cast<size_t>(E) + 1);
    EXPECT_EQ(got_offsets, plan_offsets) << name << ": one rank keeps the plan's order";
    std::vector<uint16_t> got_rows(static_cast<size_t>(real * H));
    CUDA_CHECK(cudaMemcpy(got_rows.data(), got.rows, got_rows.size() * 2, cudaMemcpyDeviceToHost));
    const std::vector<uint16_t> local = local_rows_dev.download();
    EXPECT_TRUE(std::equal(got_rows.begin(), got_rows.end(), local.begin()))
        << name << ": the rows the experts get are the plan's rows, bit for bit";
    // Identity experts: the rows are their outputs.
    dispatcher.combine(0, got.rows, tokens, nullptr, out_dev.get(), stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> out = out_dev.download();
    for (int64_t t = 0; t < T - padding; ++t) {
      const float wsum = weights[t * K] + weights[t * K + 1];
      for (int64_t h = 0; h < H; ++h) {
        ASSERT_EQ(out[t * H + h], bf16_to_f32(hidden[t * H + h]) * wsum)
            << name << " token " << t << " column " << h;
      }
    }
    const auto& sent = dispatcher.bytes_sent();
    EXPECT_EQ(std::accumulate(sent.begin(), sent.end(), int64_t{0}), 0)
        << "one rank's rows stay on its GPU";
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// The fixture's prompt (all positions) and a few greedy steps through `gpu`.
std::vector<float> run_prompt(GpuDecoder& gpu, const std::vector<int32_t>& prompt) {
  const int64_t V = gpu.config().vocab_size, n = static_cast<int64_t>(prompt.size());
  const bool slots = gpu.config().linear_attention.has_value();
  const std::vector<int32_t> blocks = {0, 1, 2, 3};
  std::vector<float> logits(static_cast<size_t>(n * V));
  gpu.forward(
      {.sequences =
           {{.tokens = prompt, .position = 0, .block_table = blocks, .state_slot = slots ? 0 : -1}},
       .all_positions = true},
      logits);
  std::vector<float> step(static_cast<size_t>(V));
  int32_t next =
      static_cast<int32_t>(std::max_element(logits.end() - V, logits.end()) - (logits.end() - V));
  for (int64_t s = 0; s < 4; ++s) {
    const int32_t token[1] = {next};
    gpu.forward({.sequences = {{.tokens = token,
                                .position = n + s,
                                .block_table = blocks,
                                .state_slot = slots ? 0 : -1}}},
                step);
    logits.insert(logits.end(), step.begin(), step.end());
    next = static_cast<int32_t>(std::max_element(step.begin(), step.end()) - step.begin());
  }
  return logits;
}

// --ep 1 over `transport` against the local run, --deterministic in both: equal.
void ep_one_equals_local(EpTransport transport) {
  for (const char* name : {"qwen3_moe_f32", "llama4_text_f32"}) {
    const auto dir = testing_support::kModelFixtures / name;
    std::ifstream in(dir / "reference.json");
    const nlohmann::json ref = nlohmann::json::parse(in);
    const std::vector<int32_t> prompt = ref["prompt_ids"].get<std::vector<int32_t>>();
    auto model = Model::load(dir, LoadOptions{.prefault = false});
    parallel::SelfCommunicator self;
    auto run = [&](parallel::Communicator* ep) {
      GpuOptions options{.gpu_memory_fraction = 0.3,
                         .max_batch_tokens = 64,
                         .max_num_seqs = 2,
                         .max_model_len = 64,
                         .num_kv_blocks = 8,
                         .quiet = true};
      options.small_batch_moe_rows = 0;  // off under --ep: off in both
      options.cuda_graphs = false;       // eager under --ep: eager in both
      options.deterministic = true;
      options.expert_parallel = ep;
      options.ep_transport = transport;
      auto gpu = GpuDecoder::create(model->config(), model->decoder().weights(), options);
      return run_prompt(*gpu, prompt);
    };
    const std::vector<float> local = run(nullptr);
    const std::vector<float> ep = run(&self);
    ASSERT_EQ(ep.size(), local.size());
    size_t differ = 0;
    for (size_t i = 0; i < local.size(); ++i) differ += ep[i] != local[i] ? 1 : 0;
    EXPECT_EQ(differ, 0u) << name << " over " << gpu::ep_transport_name(transport) << ": " << differ
                          << " of " << local.size() << " logits differ";
  }
}

const bool registered = [] {
  if (!cuda::testing_util::cuda_device_present("device dispatch")) return false;
  const struct {
    const char* name;
    void (*body)();
  } tests[] = {
      {"MoveRows", move_rows_gathers_and_scatters},
      {"ThreeRankLayout", three_rank_layout},
      {"OneRankStaged", [] { one_rank_dispatch(EpTransport::kStaged); }},
      {"EpOneOverStagedEqualsLocal", [] { ep_one_equals_local(EpTransport::kStaged); }},
#if defined(MOE_HAVE_NCCL) && MOE_HAVE_NCCL
      {"OneRankNccl", [] { one_rank_dispatch(EpTransport::kNccl); }},
      {"EpOneOverNcclEqualsLocal", [] { ep_one_equals_local(EpTransport::kNccl); }},
#endif
  };
  for (const auto& test : tests) {
    cuda::testing_util::register_kernel_test("CudaDeviceDispatch", test.name, test.body, __FILE__,
                                             __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
