// StateSlots hands each running sequence its own recurrent state slot and takes it back;
// RecurrentStatePool::reset zeros a slot's every layer and nothing else.
#include "kv/state_pool.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace moeinfer {
namespace {

TEST(StateSlots, HandsOutEachSlotOnceAndTakesItBack) {
  StateSlots slots(3);
  EXPECT_EQ(slots.acquire(), 0);
  EXPECT_EQ(slots.acquire(), 1);
  EXPECT_EQ(slots.acquire(), 2);
  EXPECT_EQ(slots.acquire(), std::nullopt);
  EXPECT_EQ(slots.num_free(), 0);
  slots.release(1);
  EXPECT_EQ(slots.num_free(), 1);
  EXPECT_EQ(slots.acquire(), 1);
}

TEST(StateSlots, RefusesToReleaseASlotItDoesNotHold) {
  StateSlots slots(2);
  EXPECT_THROW(slots.release(0), Error);
  const auto slot = slots.acquire();
  ASSERT_TRUE(slot);
  slots.release(*slot);
  EXPECT_THROW(slots.release(*slot), Error);
  EXPECT_THROW(slots.release(5), Error);
  EXPECT_THROW(slots.release(-1), Error);
}

TEST(RecurrentStatePool, ResetZerosOneSlotOfEveryStatefulLayer) {
  RecurrentStatePool pool(
      RecurrentStateShape{
          .layer_has_state = {true, false, true}, .conv_values = 3, .recurrent_values = 5},
      2);
  EXPECT_TRUE(pool.has_state(0));
  EXPECT_FALSE(pool.has_state(1));
  for (int64_t layer : {0, 2}) {
    for (int64_t slot : {0, 1}) {
      std::fill_n(pool.conv(layer, slot), 3, 7.0f);
      std::fill_n(pool.recurrent(layer, slot), 5, 7.0f);
    }
  }
  pool.reset(1);
  for (int64_t layer : {0, 2}) {
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(pool.conv(layer, 0)[i], 7.0f);
      EXPECT_EQ(pool.conv(layer, 1)[i], 0.0f);
    }
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(pool.recurrent(layer, 0)[i], 7.0f);
      EXPECT_EQ(pool.recurrent(layer, 1)[i], 0.0f);
    }
  }
  EXPECT_THROW(pool.reset(2), Error);
  EXPECT_EQ(pool.shape().bytes_per_slot(), 2 * (3 + 5) * sizeof(float));
}

}  // namespace
}  // namespace moeinfer
