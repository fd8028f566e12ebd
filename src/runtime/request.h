// What a caller asks of the engine (GenerationParams), what the engine tells back each step
// (RequestOutput), and the engine's own record of a live request (Request).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "kv/block_manager.h"
#include "runtime/sampler.h"

namespace moeinfer {

using RequestId = uint64_t;

struct GenerationParams {
  SamplingParams sampling;
  bool has_seed = false;  // false: the engine draws a seed
  int64_t max_tokens = 16;
  std::vector<std::string> stop;        // stop strings; the text ends before the first match
  std::vector<int32_t> stop_token_ids;  // besides the model's end-of-sequence ids
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  int64_t logprobs = -1;  // -1: none; else the chosen token's logprob and this many alternatives
};

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "abort" (or "")

// What one step produced for one request.
struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> token_ids;      // tokens sampled this step (zero or one)
  std::string text;                    // text that became final this step
  std::vector<TokenLogprob> logprobs;  // one per token, when asked for
  FinishReason finish = FinishReason::kNone;
  int64_t num_prompt_tokens = 0;
  int64_t num_output_tokens = 0;  // so far
  int64_t num_cached_tokens = 0;  // prompt tokens found in the prefix cache (last admission)
  bool finished() const { return finish != FinishReason::kNone; }
};

enum class RequestStatus { kWaiting, kRunning, kFinished };

// The engine's record of one request. `tokens` holds the prompt followed by every sampled token;
// the first `num_computed` of them are in the KV cache.
struct Request {
  RequestId id = 0;
  uint64_t arrival = 0;  // admission order of add_request, for picking preemption victims
  GenerationParams params;
  std::vector<int32_t> tokens;
  int64_t num_prompt_tokens = 0;
  int64_t num_computed = 0;
  int64_t num_cached_tokens = 0;
  int64_t num_preemptions = 0;
  SequenceBlocks blocks;
  RequestStatus status = RequestStatus::kWaiting;
  FinishReason finish = FinishReason::kNone;

  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> detokenizer;
  std::string held_text;  // decoded text held back while it could start a stop string

  int64_t num_output_tokens() const {
    return static_cast<int64_t>(tokens.size()) - num_prompt_tokens;
  }
  int64_t num_uncomputed() const { return static_cast<int64_t>(tokens.size()) - num_computed; }
};

}  // namespace moeinfer
