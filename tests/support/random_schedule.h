// A scripted run of three sequences over a shared paged KV pool that takes every attention route
// a decoder has: two fresh prompts in one step (prefill), a third prompt in two chunks, the
// second chunk in a step that also carries the first two sequences' next tokens (chunked, a
// mixed step), then decode steps of three and of two sequences (graph buckets with padding).
// Tokens are drawn, not sampled (teacher forcing), so two decoders given the same steps see the
// same inputs whatever they predict.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kv/kv_cache.h"

namespace moeinfer::testing {

enum class ScheduleRoute { kPrefill, kChunked, kDecode };

inline const char* route_name(ScheduleRoute route) {
  switch (route) {
    case ScheduleRoute::kPrefill:
      return "prefill";
    case ScheduleRoute::kChunked:
      return "chunked";
    case ScheduleRoute::kDecode:
      return "decode";
  }
  return "?";
}

struct ScheduledStep {
  ScheduleRoute route;
  ForwardBatch batch;         // spans into the schedule's tokens and tables
  std::vector<int> sequence;  // [batch.sequences.size()] which of the three each one is
};

struct Schedule {
  int64_t block_size = 16;
  int64_t num_blocks = 0;
  int64_t max_len = 0;                       // the longest sequence
  std::vector<std::vector<int32_t>> tokens;  // [3] every token each sequence will see
  std::vector<std::vector<int32_t>> tables;  // [3] its blocks, shuffled over the pool
  std::vector<ScheduledStep> steps;
};

// Steps for three sequences; prompt lengths and tokens from `seed`, token ids below `vocab`.
inline Schedule make_schedule(int64_t vocab, uint64_t seed, int64_t block_size) {
  std::mt19937_64 rng(seed);
  auto between = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  constexpr int64_t kDecodeThree = 6, kDecodeTwo = 3;
  const int64_t prompt[3] = {between(1, 24), between(1, 24), between(2, 30)};
  Schedule s;
  s.block_size = block_size;
  const int64_t extra[3] = {1 + kDecodeThree + kDecodeTwo, 1 + kDecodeThree + kDecodeTwo,
                            kDecodeThree};
  std::vector<int32_t> free_blocks;
  int64_t needed = 0;
  for (int i = 0; i < 3; ++i) needed += (prompt[i] + extra[i] + block_size - 1) / block_size;
  s.num_blocks = needed + 3;  // a few never used, so ids are not simply 0..n-1
  free_blocks.resize(static_cast<size_t>(s.num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  s.tokens.resize(3);
  s.tables.resize(3);
  for (int i = 0; i < 3; ++i) {
    const int64_t len = prompt[i] + extra[i];
    s.max_len = std::max(s.max_len, len);
    for (int64_t t = 0; t < len; ++t)
      s.tokens[i].push_back(static_cast<int32_t>(between(0, vocab - 1)));
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b) {
      s.tables[i].push_back(free_blocks.back());
      free_blocks.pop_back();
    }
  }
  auto piece = [&](int i, int64_t position, int64_t count) {
    // Sequence i's recurrent state is slot i (read only by models with linear-attention layers).
    return SequenceBatch{.tokens = std::span<const int32_t>(s.tokens[i]).subspan(position, count),
                         .position = position,
                         .block_table = s.tables[i],
                         .state_slot = i};
  };
  // Prefill: the first two prompts together.
  s.steps.push_back(
      {ScheduleRoute::kPrefill,
       {.sequences = {piece(0, 0, prompt[0]), piece(1, 0, prompt[1])}, .all_positions = true},
       {0, 1}});
  // The third prompt in two chunks, the second beside the first two's next tokens.
  const int64_t first_chunk = prompt[2] / 2;
  s.steps.push_back({ScheduleRoute::kChunked,
                     {.sequences = {piece(2, 0, first_chunk)}, .all_positions = true},
                     {2}});
  s.steps.push_back(
      {ScheduleRoute::kChunked,
       {.sequences = {piece(0, prompt[0], 1), piece(2, first_chunk, prompt[2] - first_chunk),
                      piece(1, prompt[1], 1)},
        .all_positions = true},
       {0, 2, 1}});
  int64_t position[3] = {prompt[0] + 1, prompt[1] + 1, prompt[2]};
  for (int64_t step = 0; step < kDecodeThree + kDecodeTwo; ++step) {
    ScheduledStep decode{.route = ScheduleRoute::kDecode};
    for (int i = 0; i < (step < kDecodeThree ? 3 : 2); ++i) {
      decode.batch.sequences.push_back(piece(i, position[i], 1));
      decode.sequence.push_back(i);
      ++position[i];
    }
    s.steps.push_back(std::move(decode));
  }
  return s;
}

// One sequence alone: its prompt of `prompt` tokens in steps of at most `piece` (the first a
// prefill, the rest chunks after it), then `decodes` steps of one token each, the decode route
// at batch 1 (a CUDA-graph bucket of one row). Its blocks are shuffled over the pool as above.
inline Schedule make_lone_schedule(int64_t vocab, uint64_t seed, int64_t block_size, int64_t prompt,
                                   int64_t decodes, int64_t piece) {
  std::mt19937_64 rng(seed);
  Schedule s;
  s.block_size = block_size;
  const int64_t len = prompt + decodes;
  const int64_t blocks = (len + block_size - 1) / block_size;
  s.num_blocks = blocks + 3;
  s.max_len = len;
  std::vector<int32_t> free_blocks(static_cast<size_t>(s.num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  s.tokens.resize(1);
  s.tables.resize(1);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  for (int64_t t = 0; t < len; ++t) s.tokens[0].push_back(token(rng));
  s.tables[0].assign(free_blocks.begin(), free_blocks.begin() + blocks);
  auto piece_of = [&](int64_t position, int64_t count) {
    return SequenceBatch{.tokens = std::span<const int32_t>(s.tokens[0]).subspan(position, count),
                         .position = position,
                         .block_table = s.tables[0],
                         .state_slot = 0};
  };
  for (int64_t at = 0; at < prompt; at += piece) {
    s.steps.push_back(
        {at == 0 ? ScheduleRoute::kPrefill : ScheduleRoute::kChunked,
         {.sequences = {piece_of(at, std::min(piece, prompt - at))}, .all_positions = true},
         {0}});
  }
  for (int64_t d = 0; d < decodes; ++d)
    s.steps.push_back({ScheduleRoute::kDecode, {.sequences = {piece_of(prompt + d, 1)}}, {0}});
  return s;
}

// Calls fn(row, sequence, position) for each logits row of a step, in the order the decoders
// write them: every new token of every sequence (all positions), or each sequence's last.
template <typename Fn>
void for_each_logit_row(const ScheduledStep& step, Fn&& fn) {
  int64_t row = 0;
  for (size_t b = 0; b < step.batch.sequences.size(); ++b) {
    const SequenceBatch& sb = step.batch.sequences[b];
    const int64_t n = static_cast<int64_t>(sb.tokens.size());
    for (int64_t t = step.batch.all_positions ? 0 : n - 1; t < n; ++t, ++row)
      fn(row, step.sequence[b], sb.position + t);
  }
}

// Rows of logits a step produces (every new token: the steps ask for all positions, or one
// per sequence in decode steps).
inline int64_t schedule_logit_rows(const ForwardBatch& batch) {
  int64_t rows = 0;
  for (const SequenceBatch& s : batch.sequences)
    rows += batch.all_positions ? static_cast<int64_t>(s.tokens.size()) : 1;
  return rows;
}

}  // namespace moeinfer::testing
