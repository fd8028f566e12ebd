// What the engine tests (tests/runtime on the CPU, tests/cuda on the GPU) share: the demo model's
// folder, running an engine until it is idle while collecting each sequence's outputs, and the
// seeded sampling parameters most of them use.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "runtime/engine.h"

namespace moeinfer::testing {

inline const std::filesystem::path kDemoModel =
    std::filesystem::path(MOE_FIXTURES_DIR) / ".." / ".." / "models" / "demo";

// Everything one sequence's outputs brought, in order.
struct SequenceRun {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<TokenLogprob> logprobs;         // of the sampled tokens, when asked for
  std::vector<TokenLogprob> prompt_logprobs;  // when asked for
  double cumulative_logprob = 0.0;            // the last output's
  FinishReason finish = FinishReason::kNone;
  int num_last = 0;  // outputs marked last (the request's final one)
};

inline void add_output(SequenceRun& s, const RequestOutput& out) {
  s.tokens.insert(s.tokens.end(), out.token_ids.begin(), out.token_ids.end());
  s.text += out.text;
  s.logprobs.insert(s.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  if (!out.prompt_logprobs.empty()) s.prompt_logprobs = out.prompt_logprobs;
  s.cumulative_logprob = out.cumulative_logprob;
  if (out.finish != FinishReason::kNone) s.finish = out.finish;
  s.num_last += out.last ? 1 : 0;
}

// Steps the engine until every request is done; each sequence's run by (request id, index).
inline std::map<std::pair<RequestId, int64_t>, SequenceRun> run_sequences(Engine& engine) {
  std::map<std::pair<RequestId, int64_t>, SequenceRun> done;
  while (engine.has_unfinished()) {
    for (const RequestOutput& out : engine.step()) add_output(done[{out.id, out.index}], out);
  }
  return done;
}

// The same for requests of one sequence each, by request id.
inline std::map<RequestId, SequenceRun> run_requests(Engine& engine) {
  std::map<RequestId, SequenceRun> done;
  while (engine.has_unfinished()) {
    for (const RequestOutput& out : engine.step()) add_output(done[out.id], out);
  }
  return done;
}

// Temperature 1 with a seed, max_tokens tokens whatever EOS says.
inline GenerationParams seeded_sampling(int64_t max_tokens, uint64_t seed) {
  return {.sampling = {.temperature = 1.0f, .seed = seed},
          .has_seed = true,
          .max_tokens = max_tokens,
          .ignore_eos = true};
}

}  // namespace moeinfer::testing
