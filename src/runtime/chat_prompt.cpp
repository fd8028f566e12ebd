#include "runtime/chat_prompt.h"

namespace moeinfer {

ChatPrompt chat_prompt(const Tokenizer& tokenizer, const ChatConfig& chat, std::string_view text) {
  ChatPrompt prompt{.ids = tokenizer.encode(text, /*add_special_tokens=*/false)};
  if (!chat.eos_token.empty()) {
    if (auto eos = tokenizer.token_to_id(chat.eos_token)) prompt.stop_token_ids.push_back(*eos);
  }
  return prompt;
}

}  // namespace moeinfer
