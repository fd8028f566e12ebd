// Chat templates: the Jinja program a checkpoint ships to turn a conversation into prompt text.
//
// ChatTemplate renders the subset of Jinja that published chat templates use, with the whitespace
// rules and globals of the environment transformers renders them in (trim_blocks, lstrip_blocks,
// loop controls, raise_exception, strftime_now, namespace, dict, a tojson that keeps key order and
// non-ASCII text). Output is meant to be byte-identical to transformers' apply_chat_template; the
// parity tests hold it to Python jinja2. The engine pieces live in io/jinja_*.
#pragma once

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace moeinfer {

namespace jinja {
struct Template;
}

class ChatTemplate {
 public:
  // Throws moeinfer::Error naming the template line on a syntax error, an unknown tag, or an
  // unknown filter or test outside an `if`.
  static ChatTemplate parse(std::string_view source);
  // context: the template's variables (messages, add_generation_prompt, bos_token, tools, ...).
  // Throws moeinfer::Error naming the template line on runtime errors and raise_exception().
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const jinja::Template> tmpl_;
};

// What a checkpoint folder says about chat: tokenizer_config.json's chat_template (a string, or a
// list of {name, template} where "default" is used), or a chat_template.jinja file beside it
// (newer transformers write that, and it wins), and its bos_token / eos_token (a string or an
// AddedToken object). An empty token means the checkpoint has none.
struct ChatConfig {
  std::optional<std::string> chat_template;
  std::string bos_token;
  std::string eos_token;
};
ChatConfig load_chat_config(
    const std::filesystem::path& model_dir);  // missing files -> empty fields

// What a request adds to the template's variables: the tools it offers (a JSON array; null: the
// template sees None) and further variables (an API request's chat_template_kwargs, such as
// enable_thinking), which override the others as transformers' **kwargs do. Neither may name
// `messages`; that is the caller's to refuse.
struct ChatTemplateExtras {
  nlohmann::ordered_json tools = nullptr;
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
};

// Renders messages (a JSON array of {role, content, ...}) the way transformers' apply_chat_template
// does: keys whose value is null are dropped, reasoning fields are aliased, and the template sees
// messages, tools (None unless given), documents=None, add_generation_prompt, bos_token and
// eos_token, then the extra variables.
std::string apply_chat_template(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const ChatConfig& config,
                                const ChatTemplateExtras& extras = {});

}  // namespace moeinfer
