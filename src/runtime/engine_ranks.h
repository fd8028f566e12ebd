// Serving under expert parallelism with attention data-parallel: every rank of the job has its
// own Engine (scheduler, KV cache) over a decoder whose MoE layers are collective
// (Decoder::set_expert_parallel), and rank 0, which takes HTTP, spreads the requests over them.
//
// Each engine step is a round that every rank enters together:
//   1. all_reduce_sum of [has work, stop, bytes of rank 0's orders for each rank]: an idle job
//      runs no round at all (rank 0 starts one only when some rank has work or it has orders);
//   2. all_to_allv of rank 0's orders (new requests, aborts; rank_link.h) to their ranks;
//   3. every rank's Engine::step(), one forward each (of zero tokens on a rank with nothing
//      scheduled), so that every MoE layer's dispatch and combine meet on every rank;
//   4. all_gather of the reports' sizes and of whether each rank still has work, all_to_allv of
//      the reports (outputs, requests that started, refusals, load) to rank 0.
// A rank with work never waits for one without: the next round starts at once whenever some
// rank still has work. An idle job runs a round of step 1 alone every kIdleRoundPeriod rather
// than back to back, every rank sleeping between idle rounds, so an idle server costs next to no
// CPU; a request arriving at an idle job waits at most that period for the others to join. Rank 0
// sends a new request to the least-loaded rank (rank_link.h); a constrained request
// (response_format) stays on rank 0, whose engine holds its compiled grammar. Request ids are rank
// 0's; each rank maps them to its engine's.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "moe/row_codec.h"
#include "parallel/communicator.h"
#include "runtime/engine.h"
#include "runtime/rank_link.h"

namespace moeinfer {

inline constexpr std::chrono::milliseconds kIdleRoundPeriod{10};

// One rank's engine under rank 0's request ids: takes orders, steps, reports.
class RankEngine {
 public:
  explicit RankEngine(Engine& engine) : engine_(engine) {}
  // Adds and aborts; a request the engine refuses is reported by the next step().
  void apply(RankOrders orders);
  // One Engine::step(); its outputs under rank 0's ids.
  RankReport step();
  RankLoad load() const;

 private:
  Engine& engine_;
  std::unordered_map<RequestId, RequestId> local_of_;  // rank 0's id -> the engine's
  std::unordered_map<RequestId, RequestId> link_of_;   // the engine's id -> rank 0's
  std::vector<RequestId> queued_;                      // rank 0's ids not yet scheduled
  std::vector<RankRefusal> refused_;
};

// What rank 0 knows of each rank, for /metrics and the dashboard.
struct RankStatus {
  RankLoad load;             // as of its latest report, plus what was sent to it since
  int64_t num_assigned = 0;  // requests sent to it since the start
};

// Rank 0's side: the engines of every rank behind the calls of one Engine. Without a
// communicator (one process) every call goes straight to the local engine.
class EngineRanks {
 public:
  EngineRanks(Engine& local, parallel::Communicator* comm);

  bool distributed() const { return comm_ != nullptr; }
  int num_ranks() const { return comm_ ? comm_->size() : 1; }
  // Checks the request as the engine would (throws the same errors), then queues it for the
  // least-loaded rank; it reaches that rank at the next step().
  RequestId add_request(std::vector<int32_t> prompt, const GenerationParams& params);
  void abort_request(RequestId id);
  // One round (above); the outputs of every rank. When no rank has work, only step 1 runs: call
  // it every kIdleRoundPeriod while idle, as the other ranks join one that often.
  std::vector<RequestOutput> step();
  // Requests a rank's engine refused when they arrived, since the last call.
  std::vector<RankRefusal> take_refused();
  bool has_unfinished() const;
  bool has_started(RequestId id) const;
  // The local engine's figures, with requests, tokens and KV blocks summed over the ranks.
  EngineStats stats() const;
  const std::vector<RankStatus>& ranks() const { return status_; }
  // The last round: the other ranks return from follow_rank_zero(). Once, when no request is
  // left.
  void stop();

 private:
  // Steps 1-2 of a round; false when no rank steps.
  bool send_orders(bool stop);
  std::vector<RequestOutput> gather_reports(RankReport mine);
  void take_report(int rank, RankReport report, std::vector<RequestOutput>& outputs);

  Engine& local_;
  parallel::Communicator* comm_;
  std::optional<RankEngine> rank_zero_;
  std::vector<RankOrders> orders_;              // [N] for the next round
  std::vector<RankStatus> status_;              // [N]
  std::unordered_map<RequestId, int> rank_of_;  // live requests
  std::unordered_set<RequestId> started_;
  std::vector<RankRefusal> refused_;
  RequestId next_id_ = 1;
  bool stopped_ = false;
};

// How one rank of an expert-parallel job holds its model's experts.
struct ExpertParallelOptions {
  parallel::Communicator* comm = nullptr;  // the job's ranks (size > 1)
  std::filesystem::path placement;         // `moeinfer placement`'s file; empty: contiguous ranges
  bool overlap_shared_experts = true;      // the shared experts run while the rows travel
  moe::DispatchDtype dispatch_dtype = moe::DispatchDtype::kF32;  // the dispatched rows' encoding
  int micro_batches = 1;  // 2: two micro-batches alternate per MoE layer (--micro-batches)
  EpTransport ep_transport = EpTransport::kAuto;  // cuda: how the rows travel (--ep-transport)
};

// This rank's engine of an expert-parallel job over the checkpoint folder: its decoder's MoE
// layers are collective over options.comm (offloading is refused there). On CPU ranks
// (config.device "cpu") the CPU decoder's dispatcher; on cuda a GpuDecoder on this rank's GPU
// with the device dispatcher over options.ep_transport (expert_parallel_gpu_rank;
// options.overlap_shared_experts does not apply, other dispatch dtypes and two micro-batches are
// refused). Collective on cuda.
std::unique_ptr<Engine> load_expert_parallel_engine(const std::filesystem::path& dir,
                                                    const EngineConfig& config,
                                                    const ExpertParallelOptions& options);
// The same over a synthetic model (Engine::load_synthetic; cuda only): every rank builds the
// same weights from synthetic.seed.
std::unique_ptr<Engine> load_expert_parallel_synthetic(const std::string& name, int64_t num_layers,
                                                       const SyntheticGpuOptions& synthetic,
                                                       const EngineConfig& config,
                                                       const ExpertParallelOptions& options);

// k, the ranks of the job that run on `device` of this host, this rank included: GPUs are told
// apart by host name and device UUID. Collective (an all_gather).
int ranks_on_device(parallel::Communicator& comm, int device);
// Rank r of an --ep job on cuda: GPU r % the devices it sees, so ranks may share one, and then
// they split --gpu-memory-fraction among them (GpuOptions::ranks_on_device: each rank's weights,
// workspace and KV pool within fraction / k of the card). Collective (ranks_on_device).
GpuRank expert_parallel_gpu_rank(parallel::Communicator& comm,
                                 const std::filesystem::path& placement,
                                 EpTransport ep_transport = EpTransport::kAuto);

// Ranks > 0: takes rank 0's orders and steps with it, round after round, until rank 0 stops.
void follow_rank_zero(Engine& engine, parallel::Communicator& comm);

// Whether any rank passes true (one all_reduce_sum); for loops that every rank runs together.
bool any_rank(parallel::Communicator& comm, bool mine);

}  // namespace moeinfer
