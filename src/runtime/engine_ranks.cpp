#include "runtime/engine_ranks.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <utility>

#include "core/error.h"
#include "io/tokenizer.h"
#include "model/model.h"
#include "parallel/placement.h"

namespace moeinfer {
namespace {

// The round's header (step 1), summed over ranks: [want, stop, bytes of orders for rank r...].
constexpr size_t kWant = 0, kStop = 1, kOrderBytes = 2;

bool any_orders_in(const std::vector<int64_t>& header) {
  return std::any_of(header.begin() + kOrderBytes, header.end(), [](int64_t b) { return b > 0; });
}

// A buffer for a side of all_to_allv that moves no bytes: some MPIs refuse a null one.
uint8_t* no_data() {
  static uint8_t byte = 0;
  return &byte;
}

uint8_t* data_or_none(std::vector<uint8_t>& bytes) {
  return bytes.empty() ? no_data() : bytes.data();
}

// Step 4's first part: every rank's report size, and whether any rank still has work.
std::pair<std::vector<int64_t>, bool> gather_sizes(parallel::Communicator& comm, int64_t size,
                                                   bool has_work) {
  const int N = comm.size();
  const int64_t mine[2] = {size, has_work ? 1 : 0};
  std::vector<int64_t> all(2 * static_cast<size_t>(N));
  comm.all_gather(mine, all.data(), sizeof(mine));
  std::vector<int64_t> sizes(N);
  bool any_work = false;
  for (int r = 0; r < N; ++r) {
    sizes[r] = all[2 * r];
    any_work = any_work || all[2 * r + 1] != 0;
  }
  return {sizes, any_work};
}

}  // namespace

void RankEngine::apply(RankOrders orders) {
  for (RankRequest& request : orders.requests) {
    try {
      const RequestId local = engine_.add_request(std::move(request.prompt), request.params);
      local_of_.emplace(request.id, local);
      link_of_.emplace(local, request.id);
      queued_.push_back(request.id);
    } catch (const std::exception& e) {
      refused_.push_back({.id = request.id, .message = e.what()});
    }
  }
  for (RequestId id : orders.aborts) {
    // Unknown ids finished (their last output is on its way) or were refused.
    if (const auto it = local_of_.find(id); it != local_of_.end())
      engine_.abort_request(it->second);
  }
}

RankReport RankEngine::step() {
  RankReport report;
  report.outputs = engine_.step();
  for (RequestOutput& out : report.outputs) {
    const auto it = link_of_.find(out.id);
    MOE_CHECK(it != link_of_.end(), "rank engine: an output for unknown request ", out.id);
    const RequestId link = it->second;
    if (out.last) {
      local_of_.erase(link);
      link_of_.erase(it);
    }
    out.id = link;
  }
  std::erase_if(queued_, [&](RequestId link) {
    const auto it = local_of_.find(link);
    if (it == local_of_.end()) return true;  // finished
    if (!engine_.has_started(it->second)) return false;
    report.started.push_back(link);
    return true;
  });
  report.refused = std::move(refused_);
  refused_.clear();
  report.load = load();
  return report;
}

RankLoad RankEngine::load() const {
  const EngineStats s = engine_.stats();
  return {.num_running = s.num_running,
          .num_waiting = s.num_waiting,
          .num_queued_tokens = engine_.num_queued_tokens(),
          .has_unfinished = engine_.has_unfinished(),
          .prompt_tokens = s.prompt_tokens,
          .generation_tokens = s.generation_tokens,
          .num_preemptions = s.num_preemptions,
          .kv_blocks = s.kv.num_blocks,
          .kv_used = s.kv.num_used,
          .kv_cached = s.kv.num_cached,
          .prefix_queries = s.kv.prefix_queries,
          .prefix_hits = s.kv.prefix_hits,
          .network_bytes = s.network_bytes};
}

EngineRanks::EngineRanks(Engine& local, parallel::Communicator* comm)
    : local_(local), comm_(comm && comm->size() > 1 ? comm : nullptr) {
  if (!comm_) return;
  MOE_CHECK(comm_->rank() == 0, "EngineRanks runs on rank 0; rank ", comm_->rank(),
            " follows it (follow_rank_zero)");
  MOE_CHECK(local.steps_collectively(),
            "serving over several ranks needs an expert-parallel decoder on each");
  rank_zero_.emplace(local);
  orders_.resize(static_cast<size_t>(comm_->size()));
  status_.resize(static_cast<size_t>(comm_->size()));
}

RequestId EngineRanks::add_request(std::vector<int32_t> prompt, const GenerationParams& params) {
  if (!comm_) return local_.add_request(std::move(prompt), params);
  local_.check_request(prompt, params);  // every rank's engine has this one's configuration
  std::vector<RankLoad> loads;
  for (const RankStatus& s : status_) loads.push_back(s.load);
  const int rank = params.grammar ? 0 : least_loaded_rank(loads);
  RankStatus& status = status_[rank];
  status.load.num_waiting += params.num_sequences;  // until its next report counts it
  status.load.num_queued_tokens += static_cast<int64_t>(prompt.size());
  ++status.num_assigned;
  const RequestId id = next_id_++;
  rank_of_.emplace(id, rank);
  orders_[rank].requests.push_back({.id = id, .prompt = std::move(prompt), .params = params});
  return id;
}

void EngineRanks::abort_request(RequestId id) {
  if (!comm_) return local_.abort_request(id);
  if (const auto it = rank_of_.find(id); it != rank_of_.end()) {
    orders_[it->second].aborts.push_back(id);
  }
}

bool EngineRanks::has_unfinished() const {
  if (!comm_) return local_.has_unfinished();
  return local_.has_unfinished() ||
         std::any_of(orders_.begin(), orders_.end(),
                     [](const RankOrders& o) { return !o.empty(); }) ||
         std::any_of(status_.begin() + 1, status_.end(),
                     [](const RankStatus& s) { return s.load.has_unfinished; });
}

bool EngineRanks::has_started(RequestId id) const {
  if (!comm_) return local_.has_started(id);
  return started_.count(id) > 0;
}

std::vector<RankRefusal> EngineRanks::take_refused() {
  std::vector<RankRefusal> refused = std::move(refused_);
  refused_.clear();
  return refused;
}

bool EngineRanks::send_orders(bool stop) {
  const int N = comm_->size();
  std::vector<int64_t> header(kOrderBytes + N, 0);
  std::vector<uint8_t> send;
  std::vector<int64_t> send_bytes(N, 0), recv_bytes(N, 0);
  bool any_orders = !orders_[0].empty();
  for (int r = 1; r < N; ++r) {
    if (orders_[r].empty()) continue;
    any_orders = true;
    const std::vector<uint8_t> bytes = encode_orders(orders_[r]);
    send.insert(send.end(), bytes.begin(), bytes.end());
    send_bytes[r] = header[kOrderBytes + r] = static_cast<int64_t>(bytes.size());
    orders_[r] = {};
  }
  header[kWant] = local_.has_unfinished() || any_orders;
  header[kStop] = stop;
  comm_->all_reduce_sum(header);
  if (any_orders_in(header))
    comm_->all_to_allv(data_or_none(send), send_bytes, no_data(), recv_bytes);
  rank_zero_->apply(std::move(orders_[0]));
  orders_[0] = {};
  return !stop && header[kWant] > 0;
}

std::vector<RequestOutput> EngineRanks::step() {
  if (!comm_) return local_.step();
  MOE_CHECK(!stopped_, "EngineRanks::step after stop()");
  if (!send_orders(/*stop=*/false)) return {};
  return gather_reports(rank_zero_->step());
}

std::vector<RequestOutput> EngineRanks::gather_reports(RankReport mine) {
  const int N = comm_->size();
  const std::vector<int64_t> sizes = gather_sizes(*comm_, 0, mine.load.has_unfinished).first;
  std::vector<int64_t> send_bytes(N, 0);
  std::vector<uint8_t> recv(
      static_cast<size_t>(std::accumulate(sizes.begin(), sizes.end(), int64_t{0})));
  comm_->all_to_allv(no_data(), send_bytes, data_or_none(recv), sizes);
  std::vector<RequestOutput> outputs;
  take_report(0, std::move(mine), outputs);
  size_t at = 0;
  for (int r = 1; r < N; ++r) {
    const auto bytes = std::span<const uint8_t>(recv).subspan(at, static_cast<size_t>(sizes[r]));
    take_report(r, decode_report(bytes), outputs);
    at += static_cast<size_t>(sizes[r]);
  }
  return outputs;
}

void EngineRanks::take_report(int rank, RankReport report, std::vector<RequestOutput>& outputs) {
  status_[rank].load = report.load;
  for (RequestId id : report.started) started_.insert(id);
  for (RankRefusal& refusal : report.refused) {
    rank_of_.erase(refusal.id);
    refused_.push_back(std::move(refusal));
  }
  for (RequestOutput& out : report.outputs) {
    if (out.last) {
      rank_of_.erase(out.id);
      started_.erase(out.id);
    }
    outputs.push_back(std::move(out));
  }
}

EngineStats EngineRanks::stats() const {
  EngineStats s = local_.stats();
  if (!comm_) return s;
  s.num_running = s.num_waiting = s.prompt_tokens = s.generation_tokens = s.num_preemptions = 0;
  s.kv = {};
  for (const RankStatus& status : status_) {
    const RankLoad& l = status.load;
    s.num_running += l.num_running;
    s.num_waiting += l.num_waiting;
    s.prompt_tokens += l.prompt_tokens;
    s.generation_tokens += l.generation_tokens;
    s.num_preemptions += l.num_preemptions;
    s.kv.num_blocks += l.kv_blocks;
    s.kv.num_used += l.kv_used;
    s.kv.num_cached += l.kv_cached;
    s.kv.prefix_queries += l.prefix_queries;
    s.kv.prefix_hits += l.prefix_hits;
  }
  return s;
}

void EngineRanks::stop() {
  if (!comm_ || stopped_) return;
  send_orders(/*stop=*/true);
  stopped_ = true;
}

void follow_rank_zero(Engine& engine, parallel::Communicator& comm) {
  const int N = comm.size(), me = comm.rank();
  MOE_CHECK(me != 0, "follow_rank_zero on rank 0");
  MOE_CHECK(engine.steps_collectively(),
            "serving over several ranks needs an expert-parallel decoder on each");
  RankEngine rank(engine);
  const std::vector<int64_t> no_bytes(N, 0);
  bool job_idle = false;  // no rank had work after the last round: rank 0 paces the next
  while (true) {
    if (job_idle) std::this_thread::sleep_for(kIdleRoundPeriod);
    std::vector<int64_t> header(kOrderBytes + N, 0);
    header[kWant] = engine.has_unfinished();
    comm.all_reduce_sum(header);
    if (any_orders_in(header)) {
      std::vector<int64_t> recv_bytes(N, 0);
      recv_bytes[0] = header[kOrderBytes + me];
      std::vector<uint8_t> recv(static_cast<size_t>(recv_bytes[0]));
      comm.all_to_allv(no_data(), no_bytes, data_or_none(recv), recv_bytes);
      if (!recv.empty()) rank.apply(decode_orders(recv));
    }
    if (header[kStop] > 0) return;
    job_idle = header[kWant] == 0;
    if (job_idle) continue;
    const RankReport step = rank.step();
    std::vector<uint8_t> report = encode_report(step);
    const int64_t size = static_cast<int64_t>(report.size());
    job_idle = !gather_sizes(comm, size, step.load.has_unfinished).second;
    std::vector<int64_t> send_bytes(N, 0);
    send_bytes[0] = size;
    comm.all_to_allv(data_or_none(report), send_bytes, no_data(), no_bytes);
  }
}

bool any_rank(parallel::Communicator& comm, bool mine) {
  int64_t flag[1] = {mine ? 1 : 0};
  comm.all_reduce_sum(flag);
  return flag[0] > 0;
}

namespace {

// The cuda half of load_expert_parallel_engine: what the GPU's dispatch does not build is
// refused by name (the CLI refuses the flags before this).
void check_gpu_rank_options(const ExpertParallelOptions& options) {
  MOE_CHECK(options.comm != nullptr && options.comm->size() > 1,
            "expert parallelism needs a job of two ranks or more");
  MOE_CHECK(options.micro_batches == 1 || options.micro_batches == 2, "--micro-batches ",
            options.micro_batches, " must be 1 or 2");
  MOE_CHECK(options.dispatch_dtype == moe::DispatchDtype::kF32,
            "--dispatch-dtype is not implemented on the CUDA backend yet (its expert parallelism "
            "sends the rows as bf16)");
}

std::unique_ptr<Engine> load_gpu_rank(const std::filesystem::path& dir, const EngineConfig& config,
                                      const ExpertParallelOptions& options) {
  check_gpu_rank_options(options);
  return Engine::load(
      dir, config, LoadOptions{},
      expert_parallel_gpu_rank(*options.comm, options.placement, options.ep_transport,
                               options.micro_batches, options.overlap_shared_experts));
}

}  // namespace

int ranks_on_device(parallel::Communicator& comm, int device) {
  // What names a GPU across the job: the host's name and the device's UUID (the device index
  // alone would not do where ranks see different CUDA_VISIBLE_DEVICES).
  struct Place {
    char host[64] = {};
    char uuid[40] = {};
  };
  Place mine;
  gethostname(mine.host, sizeof(mine.host) - 1);
  const std::string uuid = cuda_device_uuid(device);
  const std::string id = uuid.empty() ? "device " + std::to_string(device) : uuid;
  std::copy_n(id.begin(), std::min(id.size(), sizeof(mine.uuid) - 1), mine.uuid);
  std::vector<Place> all(static_cast<size_t>(comm.size()));
  comm.all_gather(&mine, all.data(), sizeof(Place));
  return static_cast<int>(std::count_if(all.begin(), all.end(), [&](const Place& p) {
    return std::strncmp(p.host, mine.host, sizeof(p.host)) == 0 &&
           std::strncmp(p.uuid, mine.uuid, sizeof(p.uuid)) == 0;
  }));
}

GpuRank expert_parallel_gpu_rank(parallel::Communicator& comm,
                                 const std::filesystem::path& placement, EpTransport ep_transport,
                                 int micro_batches, bool overlap) {
  const int count = cuda_device_count();
  MOE_CHECK(count > 0, "--ep ", comm.size(), " --device cuda: rank ", comm.rank(),
            " sees no CUDA device");
  const int device = comm.rank() % count;
  return GpuRank{.device = device,
                 .expert_parallel = &comm,
                 .placement = placement,
                 .ranks_on_device = ranks_on_device(comm, device),
                 .ep_transport = ep_transport,
                 .micro_batches = micro_batches,
                 .overlap_micro_batches = overlap};
}

std::unique_ptr<Engine> load_expert_parallel_engine(const std::filesystem::path& dir,
                                                    const EngineConfig& config,
                                                    const ExpertParallelOptions& options) {
  config.validate();
  MOE_CHECK(options.comm != nullptr && options.comm->size() > 1,
            "expert parallelism needs a job of two ranks or more");
  if (config.device == "cuda") return load_gpu_rank(dir, config, options);
  auto model = Model::load(dir, LoadOptions{.expert_weights = config.expert_weights,
                                            .weight_scope = config.weight_scope});
  Decoder& decoder = model->decoder();
  decoder.set_offload(config.offload, config.max_num_seqs);  // each rank caches what it holds
  decoder.set_routing_approximation(config.routing);
  std::optional<parallel::ExpertPlacement> placement;
  if (!options.placement.empty()) {
    placement = parallel::read_placement(options.placement, decoder.config().num_experts,
                                         options.comm->size(), decoder.moe_layers());
  }
  decoder.set_expert_parallel(options.comm, std::move(placement), options.overlap_shared_experts,
                              options.dispatch_dtype, options.micro_batches);
  return std::make_unique<Engine>(std::move(model), Tokenizer::from_dir(dir), config);
}

std::unique_ptr<Engine> load_expert_parallel_synthetic(const std::string& name, int64_t num_layers,
                                                       const SyntheticGpuOptions& synthetic,
                                                       const EngineConfig& config,
                                                       const ExpertParallelOptions& options) {
  config.validate();
  MOE_CHECK(config.device == "cuda", "synthetic models are built on the GPU: use --device cuda");
  check_gpu_rank_options(options);
  return Engine::load_synthetic(
      name, num_layers, synthetic, config,
      expert_parallel_gpu_rank(*options.comm, options.placement, options.ep_transport,
                               options.micro_batches, options.overlap_shared_experts));
}

}  // namespace moeinfer
