// A conversation's prompt as the engine runs it, from the chat template's rendered text: one
// rule for the server's chat completions, `generate --chat` and the Python API's LLM.chat().
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "io/chat_template.h"
#include "io/tokenizer.h"

namespace moeinfer {

struct ChatPrompt {
  std::vector<int32_t> ids;             // [T] the prompt's token ids
  std::vector<int32_t> stop_token_ids;  // the template's end-of-turn token, where it has one
};

// `text` (apply_chat_template's output) tokenised without the tokenizer's special-token template:
// the template writes any BOS itself, as transformers' apply_chat_template assumes. The chat
// config's eos_token, when the vocabulary has it, ends generation besides the model's own
// end-of-sequence ids (what vLLM's chat does with the template's eos).
ChatPrompt chat_prompt(const Tokenizer& tokenizer, const ChatConfig& chat, std::string_view text);

}  // namespace moeinfer
