// What travels between rank 0 (which takes HTTP) and the engines of an expert-parallel job, as
// bytes for the Communicator (runtime/engine_ranks.h moves them): rank 0's orders to one rank
// (new requests, aborts) and each rank's report of a step (its outputs, the requests that left
// the queue, refusals, its load). Plus the choice of the rank a new request goes to.
//
// Encoding: little-endian fixed-width integers and floats in field order, lengths before
// sequences; no versioning (both ends are the same binary). Decoding checks every length
// against the bytes left and throws moeinfer::Error on a short or malformed buffer.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/request.h"

namespace moeinfer {

// One rank's engine as rank 0 sees it after a step.
struct RankLoad {
  int64_t num_running = 0;        // sequences in the running batch
  int64_t num_waiting = 0;        // sequences waiting to be scheduled
  int64_t num_queued_tokens = 0;  // tokens not yet run (Engine::num_queued_tokens)
  bool has_unfinished = false;    // the engine has work for a next step
  // Counters and KV figures, summed over ranks for the server's own gauges.
  int64_t prompt_tokens = 0, generation_tokens = 0, num_preemptions = 0;
  int64_t kv_blocks = 0, kv_used = 0, kv_cached = 0, prefix_queries = 0, prefix_hits = 0;
  int64_t network_bytes = 0;  // what its MoE layers sent to other ranks (EngineStats)
  int64_t num_requests() const { return num_running + num_waiting; }
};

// The rank with the fewest running + waiting sequences, ties to the fewest queued tokens, then
// to the lowest rank. loads must not be empty.
int least_loaded_rank(std::span<const RankLoad> loads);

// A request for a rank, under the id rank 0 gave it (RequestOutput::id of its outputs).
struct RankRequest {
  RequestId id = 0;
  std::vector<int32_t> prompt;
  GenerationParams params;  // without a grammar: constrained requests stay on rank 0
};

struct RankOrders {
  std::vector<RankRequest> requests;
  std::vector<RequestId> aborts;
  bool empty() const { return requests.empty() && aborts.empty(); }
};

// A request the rank's engine refused when it was added (the message is the engine's).
struct RankRefusal {
  RequestId id = 0;
  std::string message;
};

struct RankReport {
  RankLoad load;
  std::vector<RequestOutput> outputs;  // ids are rank 0's
  std::vector<RequestId> started;      // scheduled for the first time in this step
  std::vector<RankRefusal> refused;
};

std::vector<uint8_t> encode_orders(const RankOrders& orders);
RankOrders decode_orders(std::span<const uint8_t> bytes);
std::vector<uint8_t> encode_report(const RankReport& report);
RankReport decode_report(std::span<const uint8_t> bytes);

}  // namespace moeinfer
