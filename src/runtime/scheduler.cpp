#include "runtime/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace moeinfer {

Scheduler::Scheduler(const SchedulerConfig& config, BlockManager& blocks, StateSlots* states)
    : config_(config), blocks_(blocks), states_(states) {
  MOE_CHECK(config.max_num_seqs >= 1, "max_num_seqs must be >= 1, got ", config.max_num_seqs);
  // A cached prefix's blocks say nothing of the recurrent state after it, so a stateful model
  // cannot skip a prefix's prefill.
  MOE_CHECK(states == nullptr || !blocks.prefix_caching(),
            "a model with recurrent state needs the prefix cache off");
  MOE_CHECK(config.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1, got ",
            config.max_num_batched_tokens);
}

void Scheduler::add(Request* request) {
  request->status = RequestStatus::kWaiting;
  waiting_.push_back(request);
}

void Scheduler::remove(Request* request) {
  if (auto it = std::find(running_.begin(), running_.end(), request); it != running_.end()) {
    running_.erase(it);
  }
  if (auto it = std::find(waiting_.begin(), waiting_.end(), request); it != waiting_.end()) {
    waiting_.erase(it);
  }
  blocks_.free(request->blocks);
  release_state(request);
  request->status = RequestStatus::kFinished;
}

void Scheduler::release_state(Request* request) {
  if (request->state_slot < 0) return;
  states_->release(request->state_slot);
  request->state_slot = -1;
}

Request* Scheduler::youngest_running() const {
  Request* youngest = nullptr;
  for (Request* r : running_) {
    if (!youngest || r->arrival > youngest->arrival) youngest = r;
  }
  return youngest;
}

void Scheduler::preempt(Request* victim) {
  running_.erase(std::find(running_.begin(), running_.end(), victim));
  blocks_.free(victim->blocks);
  release_state(victim);  // the recompute starts at position 0 from a zeroed slot
  victim->num_computed = 0;
  victim->num_preemptions += 1;
  victim->status = RequestStatus::kWaiting;
  waiting_.push_front(victim);
  ++num_preemptions_;
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int64_t budget = config_.max_num_batched_tokens;

  // Gives `r` up to `budget` tokens, preempting the youngest running requests for blocks.
  const auto schedule_running = [&](Request* r) {
    const int64_t n = std::min(r->num_uncomputed(), budget);
    if (n <= 0) return;
    while (!blocks_.allocate(r->blocks, r->num_computed + n)) {
      Request* victim = youngest_running();
      // A victim already in this step's batch gives its tokens back.
      auto chunk = std::find_if(out.chunks.begin(), out.chunks.end(),
                                [&](const ScheduledChunk& c) { return c.request == victim; });
      if (chunk != out.chunks.end()) {
        budget += chunk->num_tokens;
        out.chunks.erase(chunk);
      }
      preempt(victim);
      out.preempted.push_back(victim);
      if (victim == r) return;
    }
    out.chunks.push_back({.request = r, .num_tokens = n});
    budget -= n;
  };

  // Decodes first (one token each, latency-bound), then prefill chunks of running requests.
  const std::vector<Request*> snapshot = running_;
  for (Request* r : snapshot) {
    if (budget > 0 && r->status == RequestStatus::kRunning && r->num_uncomputed() == 1) {
      schedule_running(r);
    }
  }
  for (Request* r : snapshot) {
    if (budget > 0 && r->status == RequestStatus::kRunning && r->num_uncomputed() > 1) {
      schedule_running(r);
    }
  }

  // Admit waiting requests, unless this step already ran out of blocks (or state slots).
  while (out.preempted.empty() && budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs &&
         (states_ == nullptr || states_->num_free() > 0)) {
    Request* r = waiting_.front();
    // A request that scores its prompt must see the logits of every prompt position.
    if (r->blocks.table.empty() && !r->wants_prompt_logits()) {
      r->num_cached_tokens = blocks_.match_prefix(r->tokens, r->blocks);
      r->num_computed = r->num_cached_tokens;
    }
    const int64_t n = std::min(r->num_uncomputed(), budget);
    if (!blocks_.allocate(r->blocks, r->num_computed + n)) {
      blocks_.free(r->blocks);  // let go of the cached prefix until it can run
      r->num_computed = 0;
      break;
    }
    waiting_.pop_front();
    if (states_ != nullptr) r->state_slot = *states_->acquire();
    r->status = RequestStatus::kRunning;
    running_.push_back(r);
    out.chunks.push_back({.request = r, .num_tokens = n});
    budget -= n;
  }
  for (const ScheduledChunk& c : out.chunks) out.num_tokens += c.num_tokens;
  return out;
}

void Scheduler::commit(const SchedulerOutput& out) {
  for (const ScheduledChunk& c : out.chunks) {
    Request* r = c.request;
    r->num_computed += c.num_tokens;
    blocks_.register_full_blocks(r->blocks, r->tokens, r->num_computed);
  }
}

}  // namespace moeinfer
