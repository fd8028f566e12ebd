// The scheduler alone, on hand-made requests: token budget, decode-first order, admission
// limits, preemption of the youngest request when blocks run out, and the recurrent state slots
// of a stateful model.
#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "core/error.h"

namespace moeinfer {
namespace {

struct Fixture {
  Fixture(int64_t num_blocks, int64_t block_size, SchedulerConfig config)
      : blocks(num_blocks, block_size), scheduler(config, blocks) {}

  Request* add(int64_t prompt_len) {
    auto r = std::make_unique<Request>();
    r->id = requests.size() + 1;
    r->arrival = requests.size();
    r->tokens.assign(prompt_len, static_cast<int32_t>(requests.size() + 1));
    r->num_prompt_tokens = prompt_len;
    scheduler.add(r.get());
    requests.push_back(std::move(r));
    return requests.back().get();
  }
  // One step as the engine runs it: schedule, "forward", then one new token per request that
  // finished its prompt.
  SchedulerOutput step() {
    SchedulerOutput out = scheduler.schedule();
    std::vector<Request*> sampling;
    for (const ScheduledChunk& c : out.chunks) {
      if (c.samples()) sampling.push_back(c.request);
    }
    scheduler.commit(out);
    for (Request* r : sampling) r->tokens.push_back(7);
    return out;
  }
  int64_t tokens_of(const SchedulerOutput& out, const Request* r) {
    for (const ScheduledChunk& c : out.chunks) {
      if (c.request == r) return c.num_tokens;
    }
    return 0;
  }

  BlockManager blocks;
  Scheduler scheduler;
  std::vector<std::unique_ptr<Request>> requests;
};

TEST(Scheduler, ChunksPrefillUnderTheTokenBudget) {
  Fixture f(64, 4, {.max_num_seqs = 8, .max_num_batched_tokens = 8});
  Request* a = f.add(10);
  Request* b = f.add(10);
  SchedulerOutput out = f.step();
  EXPECT_EQ(out.num_tokens, 8);
  EXPECT_EQ(f.tokens_of(out, a), 8);
  EXPECT_EQ(f.tokens_of(out, b), 0);
  out = f.step();  // a finishes its prompt (2), b starts (6)
  EXPECT_EQ(f.tokens_of(out, a), 2);
  EXPECT_EQ(f.tokens_of(out, b), 6);
  EXPECT_EQ(a->num_output_tokens(), 1);
  out = f.step();  // a decodes first (1), b finishes its prompt (4)
  ASSERT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(out.chunks[0].request, a);
  EXPECT_EQ(f.tokens_of(out, a), 1);
  EXPECT_EQ(f.tokens_of(out, b), 4);
  EXPECT_EQ(f.scheduler.num_running(), 2);
}

TEST(Scheduler, AdmitsNoMoreThanMaxNumSeqs) {
  Fixture f(64, 4, {.max_num_seqs = 2, .max_num_batched_tokens = 100});
  for (int i = 0; i < 5; ++i) f.add(3);
  const SchedulerOutput out = f.step();
  EXPECT_EQ(out.chunks.size(), 2u);
  EXPECT_EQ(f.scheduler.num_running(), 2);
  EXPECT_EQ(f.scheduler.num_waiting(), 3);
}

TEST(Scheduler, PreemptsTheYoungestWhenBlocksRunOut) {
  // 4 blocks of 2 tokens: two requests of 3 prompt tokens take 2 blocks each; the first decode
  // that crosses into a third block (position 4) must take one from the youngest.
  Fixture f(4, 2, {.max_num_seqs = 4, .max_num_batched_tokens = 100});
  Request* old = f.add(3);
  Request* young = f.add(3);
  f.step();  // both prefilled: 3 computed + 1 sampled
  f.step();  // position 3 still fits the second block
  EXPECT_EQ(f.blocks.num_free_blocks(), 0);
  const SchedulerOutput out = f.step();  // old needs a 3rd block for position 4
  ASSERT_EQ(out.preempted.size(), 1u);
  EXPECT_EQ(out.preempted[0], young);
  EXPECT_EQ(young->status, RequestStatus::kWaiting);
  EXPECT_EQ(young->num_computed, 0);
  EXPECT_TRUE(young->blocks.table.empty());
  EXPECT_EQ(f.tokens_of(out, old), 1);
  EXPECT_EQ(f.tokens_of(out, young), 0);
  // When the old one finishes, the young one is recomputed, prompt and sampled tokens alike,
  // except its first block: still in the prefix cache (the old one took the other, evicting it).
  f.scheduler.remove(old);
  const SchedulerOutput again = f.step();
  EXPECT_EQ(young->num_cached_tokens, 2);
  EXPECT_EQ(f.tokens_of(again, young), 3);
  f.scheduler.remove(young);
  EXPECT_EQ(f.blocks.num_used_blocks(), 0);
}

TEST(Scheduler, WaitingRequestRunsOnceBlocksAreFree) {
  Fixture f(2, 2, {.max_num_seqs = 4, .max_num_batched_tokens = 100});
  Request* r = f.add(3);
  Request* other = f.add(1);
  f.step();
  EXPECT_EQ(f.scheduler.num_running(), 1);  // `other` did not fit beside r
  f.scheduler.remove(r);
  const SchedulerOutput out = f.step();
  EXPECT_EQ(f.tokens_of(out, other), 1);
  f.scheduler.remove(other);
  EXPECT_EQ(f.blocks.num_used_blocks(), 0);
}

}  // namespace
}  // namespace moeinfer

namespace moeinfer {
namespace {

// A model with recurrent state: each running request holds a state slot, taken at admission and
// given back at preemption and at removal; a request waits while no slot is free.
TEST(SchedulerStateSlots, EveryRunningRequestHoldsItsOwnSlot) {
  BlockManager blocks(64, 4, /*enable_prefix_caching=*/false);
  StateSlots slots(2);
  Scheduler scheduler({.max_num_seqs = 8, .max_num_batched_tokens = 64}, blocks, &slots);
  std::vector<std::unique_ptr<Request>> requests;
  for (int i = 0; i < 3; ++i) {
    auto r = std::make_unique<Request>();
    r->id = i + 1;
    r->arrival = i;
    r->tokens.assign(5, 1);
    r->num_prompt_tokens = 5;
    scheduler.add(r.get());
    requests.push_back(std::move(r));
  }
  SchedulerOutput out = scheduler.schedule();
  ASSERT_EQ(out.chunks.size(), 2u);  // the third waits for a slot
  EXPECT_EQ(requests[0]->state_slot, 0);
  EXPECT_EQ(requests[1]->state_slot, 1);
  EXPECT_EQ(requests[2]->state_slot, -1);
  EXPECT_EQ(slots.num_free(), 0);
  scheduler.commit(out);

  scheduler.remove(requests[0].get());
  EXPECT_EQ(requests[0]->state_slot, -1);
  out = scheduler.schedule();
  EXPECT_EQ(requests[2]->state_slot, 0);
  EXPECT_EQ(slots.num_free(), 0);
  scheduler.remove(requests[1].get());
  scheduler.remove(requests[2].get());
  EXPECT_EQ(slots.num_free(), 2);
}

TEST(SchedulerStateSlots, PreemptionGivesTheSlotBack) {
  BlockManager blocks(4, 4, /*enable_prefix_caching=*/false);
  StateSlots slots(2);
  Scheduler scheduler({.max_num_seqs = 8, .max_num_batched_tokens = 64}, blocks, &slots);
  Request a, b;
  a.id = 1, a.arrival = 0, b.id = 2, b.arrival = 1;
  a.tokens.assign(8, 1), b.tokens.assign(8, 1);
  a.num_prompt_tokens = b.num_prompt_tokens = 8;
  scheduler.add(&a);
  scheduler.add(&b);
  SchedulerOutput out = scheduler.schedule();  // both prompts: all 4 blocks
  scheduler.commit(out);
  a.tokens.push_back(7);
  b.tokens.push_back(7);
  out = scheduler.schedule();  // a needs a fifth block: b, the youngest, is preempted
  ASSERT_EQ(out.preempted.size(), 1u);
  EXPECT_EQ(out.preempted[0], &b);
  EXPECT_EQ(b.state_slot, -1);
  EXPECT_EQ(b.num_computed, 0);
  EXPECT_EQ(slots.num_free(), 1);
  EXPECT_GE(a.state_slot, 0);
}

TEST(SchedulerStateSlots, RefusesThePrefixCacheForAStatefulModel) {
  BlockManager blocks(8, 4, /*enable_prefix_caching=*/true);
  StateSlots slots(2);
  EXPECT_THROW(Scheduler({}, blocks, &slots), Error);
}

}  // namespace
}  // namespace moeinfer
