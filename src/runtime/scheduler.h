// Decides what runs in the next step, under a per-step token budget:
//   1. every running request that is decoding gets its one token (oldest first);
//   2. running requests still in prefill get chunks of what is left of the budget;
//   3. waiting requests are admitted in arrival order while the budget, the sequence limit and
//      the free blocks allow, each first taking whatever prefix the cache already holds (but a
//      request that still needs its prompt's logits, for prompt logprobs).
// When a running request needs a block and none is free, the youngest running request is
// preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
// (its full blocks usually still sit in the prefix cache, so recompute is cheap).
// For a model with recurrent state (linear-attention layers) every running request also holds a
// state slot: taken at admission (a request waits while none is free), given back when it
// finishes or is preempted; a preempted request recomputes from position 0, where its new slot
// starts from zeros.
// The scheduler owns no tensors; it moves requests between its queues and asks the block manager
// (and the state slots).
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "kv/block_manager.h"
#include "kv/state_pool.h"
#include "runtime/request.h"

namespace moeinfer {

struct SchedulerConfig {
  int64_t max_num_seqs = 64;             // requests in the running batch at most
  int64_t max_num_batched_tokens = 512;  // tokens per step (prefill chunks + decodes)
};

struct ScheduledChunk {
  Request* request = nullptr;
  int64_t num_tokens = 0;  // tokens [num_computed, num_computed + num_tokens) run this step
  bool samples() const {
    return request->num_computed + num_tokens == static_cast<int64_t>(request->tokens.size());
  }
};

struct SchedulerOutput {
  std::vector<ScheduledChunk> chunks;  // in batch order
  std::vector<Request*> preempted;     // sent back to the queue this step
  int64_t num_tokens = 0;
  bool empty() const { return chunks.empty(); }
};

class Scheduler {
 public:
  // `states`: the recurrent state slots of a model with linear-attention layers, else null.
  Scheduler(const SchedulerConfig& config, BlockManager& blocks, StateSlots* states = nullptr);

  void add(Request* request);     // to the back of the queue
  void remove(Request* request);  // finished or aborted: frees its blocks
  SchedulerOutput schedule();
  // After the forward pass: the chunks' tokens are in the cache.
  void commit(const SchedulerOutput& out);

  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  bool has_work() const { return !running_.empty() || !waiting_.empty(); }

 private:
  void preempt(Request* victim);
  void release_state(Request* request);
  Request* youngest_running() const;

  SchedulerConfig config_;
  BlockManager& blocks_;
  StateSlots* states_;
  std::vector<Request*> running_;  // in admission order
  std::deque<Request*> waiting_;
  int64_t num_preemptions_ = 0;
};

}  // namespace moeinfer
