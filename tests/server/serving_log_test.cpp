// The server's log lines: the access line's fields and the periodic engine line's figures and
// when it is written.
#include "server/serving_log.h"

#include <gtest/gtest.h>

#include <string>

namespace moeinfer::server {
namespace {

TEST(AccessLogLine, NamesEveryFieldAndDashesTheUnknown) {
  EXPECT_EQ(access_log_line({.id = "cmpl-1-2",
                             .client = "127.0.0.1:5000",
                             .method = "POST",
                             .path = "/v1/completions",
                             .status = 200,
                             .prompt_tokens = 5,
                             .output_tokens = 16,
                             .cached_tokens = 0,
                             .queue_seconds = 0.00125,
                             .ttft_seconds = 0.5,
                             .latency_seconds = 1.0,
                             .finish = "length"}),
            "moeinfer serve: access cmpl-1-2 127.0.0.1:5000 \"POST /v1/completions\" 200 "
            "prompt_tokens=5 output_tokens=16 cached_tokens=0 queue=0.0013s ttft=0.5000s "
            "latency=1.0000s finish=length");
  // Refused before its request line: nothing but the status is known.
  EXPECT_EQ(access_log_line({.status = 408}),
            "moeinfer serve: access - - \"-\" 408 prompt_tokens=- output_tokens=- "
            "cached_tokens=- queue=- ttft=- latency=- finish=-");
}

TEST(EngineLogLine, ThroughputsAndHitRateOverTheInterval) {
  const EngineSnapshot last{.uptime_seconds = 10.0,
                            .prompt_tokens = 100,
                            .generation_tokens = 50,
                            .prefix_queries = 100,
                            .prefix_hits = 10};
  const EngineSnapshot now{.uptime_seconds = 12.0,
                           .prompt_tokens = 300,
                           .generation_tokens = 75,
                           .num_running = 3,
                           .num_waiting = 1,
                           .kv_usage = 0.125,
                           .prefix_queries = 300,
                           .prefix_hits = 60};
  EXPECT_EQ(engine_log_line(now, last),
            "moeinfer serve: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: "
            "12.5 tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix "
            "cache hit rate: 25.0%");
}

TEST(EngineLogLine, WrittenWhileThereIsWorkAndOnceAfter) {
  EngineSnapshot idle{.uptime_seconds = 1.0};
  EngineSnapshot later = idle;
  later.uptime_seconds = 2.0;
  EXPECT_FALSE(engine_log_due(later, idle, /*last_had_throughput=*/false));
  EXPECT_TRUE(engine_log_due(later, idle, /*last_had_throughput=*/true));  // the drop to zero
  EngineSnapshot busy = later;
  busy.generation_tokens = 4;
  EXPECT_TRUE(engine_log_due(busy, idle, false));
  EngineSnapshot waiting = later;
  waiting.num_waiting = 2;  // queued behind a long prefill: no tokens yet, still work
  EXPECT_TRUE(engine_log_due(waiting, idle, false));
}

}  // namespace
}  // namespace moeinfer::server
