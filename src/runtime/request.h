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
#include "runtime/json_schema_grammar.h"
#include "runtime/sampler.h"

namespace moeinfer {

using RequestId = uint64_t;

// The most sequences one request may ask for (GenerationParams::num_sequences; OpenAI's n is
// at most 128).
inline constexpr int64_t kMaxSequencesPerRequest = 128;

struct GenerationParams {
  SamplingParams sampling;
  bool has_seed = false;  // false: the engine draws a seed
  // 0 only with prompt_logprobs: the prompt is scored and nothing is generated.
  int64_t max_tokens = 16;
  std::vector<std::string> stop;        // stop strings; the text ends before the first match
  std::vector<int32_t> stop_token_ids;  // besides the model's end-of-sequence ids
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  int64_t logprobs = -1;  // -1: none; else the chosen token's logprob and this many alternatives
  // -1: none; else every prompt token after the first gets its logprob under the model given the
  // tokens before it, with this many alternatives (vLLM's prompt_logprobs). Such a request runs
  // its whole prompt (no prefix-cache reuse) to see every position's logits.
  int64_t prompt_logprobs = -1;
  // Sequences generated from the prompt (OpenAI's n; best_of when the caller keeps the best of
  // them), reported as choices 0..n-1. With a seed, sequence i draws from seed + i (vLLM's rule),
  // so it gives what a single request with that seed gives. The first sequence prefills the
  // prompt; the others start when it has, taking the prompt's full blocks from the prefix cache.
  int64_t num_sequences = 1;
  // Keep RequestOutput::cumulative_logprob, to rank the sequences (best_of); like logprobs, it
  // needs the logits on the host.
  bool score_sequences = false;
  // Constrained decoding (response_format json_object / json_schema): each step only tokens the
  // grammar can take next are candidates, the end-of-sequence token only once the value is
  // complete, and the sequence stops when nothing can follow. Null: unconstrained.
  std::shared_ptr<const JsonGrammar> grammar;
};

enum class FinishReason { kNone, kStop, kLength, kAbort };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "abort" (or "")

// What one step produced for one sequence of a request.
struct RequestOutput {
  RequestId id = 0;
  int64_t index = 0;                   // the sequence (choice), 0..num_sequences-1
  std::vector<int32_t> token_ids;      // tokens sampled this step (zero or one)
  std::string text;                    // text that became final this step
  std::vector<TokenLogprob> logprobs;  // one per token, when asked for
  // With prompt_logprobs, in the sequence's first output: [num_prompt_tokens - 1], the logprob
  // of prompt token j + 1 given tokens 0..j.
  std::vector<TokenLogprob> prompt_logprobs;
  // Sum of the sampled tokens' logprobs (raw logits, as `logprobs` reports them) so far; kept
  // for requests with logprobs or more than one sequence.
  double cumulative_logprob = 0.0;
  FinishReason finish = FinishReason::kNone;  // this sequence's end, in the step it ended
  bool last = false;  // every sequence of the request has finished: nothing more comes for `id`
  int64_t num_prompt_tokens = 0;
  int64_t num_output_tokens = 0;  // so far
  int64_t num_cached_tokens = 0;  // prompt tokens found in the prefix cache (last admission)
  bool finished() const { return last; }
};

enum class RequestStatus { kWaiting, kRunning, kFinished };

// The engine's record of one request. `tokens` holds the prompt followed by every sampled token;
// the first `num_computed` of them are in the KV cache.
struct Request {
  RequestId id = 0;     // this sequence's own key
  RequestId group = 0;  // the request's id, shared by its sequences (RequestOutput::id)
  int64_t index = 0;    // sequence number within the request
  uint64_t arrival = 0;  // admission order of add_request, for picking preemption victims
  GenerationParams params;
  std::vector<int32_t> tokens;
  int64_t num_prompt_tokens = 0;
  int64_t num_computed = 0;
  int64_t num_cached_tokens = 0;
  int64_t num_preemptions = 0;
  SequenceBlocks blocks;
  // Its recurrent state slot while running (models with linear-attention layers), else -1.
  int32_t state_slot = -1;
  RequestStatus status = RequestStatus::kWaiting;
  FinishReason finish = FinishReason::kNone;

  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> detokenizer;
  std::unique_ptr<JsonMatcher> matcher;  // with params.grammar: where the output stands in it
  std::string held_text;  // decoded text held back while it could start a stop string
  std::vector<TokenLogprob> prompt_logprobs;  // gathered so far (params.prompt_logprobs >= 0)
  bool prompt_logprobs_sent = false;
  double cumulative_logprob = 0.0;

  // Still needs the logits of prompt positions, so must run its prompt in full.
  bool wants_prompt_logits() const {
    return params.prompt_logprobs >= 0 &&
           static_cast<int64_t>(prompt_logprobs.size()) + 1 < num_prompt_tokens;
  }

  int64_t num_output_tokens() const {
    return static_cast<int64_t>(tokens.size()) - num_prompt_tokens;
  }
  int64_t num_uncomputed() const { return static_cast<int64_t>(tokens.size()) - num_computed; }
};

}  // namespace moeinfer
