// ChatTemplate, the checkpoint's chat settings, and transformers' apply_chat_template.
#include "io/chat_template.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "io/jinja_ast.h"

namespace moeinfer {

ChatTemplate ChatTemplate::parse(std::string_view source) {
  ChatTemplate t;
  t.tmpl_ = jinja::parse_template(source);
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  MOE_CHECK(tmpl_ != nullptr, "chat template used before parse()");
  MOE_CHECK(context.is_object(), "chat template context must be a JSON object, got ",
            context.type_name());
  jinja::Value ctx;
  try {
    ctx = jinja::Value::from_json(context);
  } catch (const jinja::JinjaError& e) {
    MOE_FAIL("chat template context: ", e.what());
  }
  try {
    return jinja::render_template(*tmpl_, ctx);
  } catch (const jinja::JinjaError& e) {
    MOE_FAIL("chat template: ", e.what());
  }
}

namespace {

std::optional<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// A special token is a string or an AddedToken object {"content": ..., ...}.
std::string token_text(const nlohmann::ordered_json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  MOE_FAIL("tokenizer_config.json: ", key, " must be a string or an AddedToken object");
}

}  // namespace

ChatConfig load_chat_config(const std::filesystem::path& model_dir) {
  ChatConfig config;
  auto path = model_dir / "tokenizer_config.json";
  if (auto text = read_file(path)) {
    nlohmann::ordered_json j;
    try {
      j = nlohmann::ordered_json::parse(*text);
    } catch (const nlohmann::json::exception& e) {
      MOE_FAIL(path.string(), ": ", e.what());
    }
    MOE_CHECK(j.is_object(), path.string(), ": expected a JSON object");
    config.bos_token = token_text(j, "bos_token");
    config.eos_token = token_text(j, "eos_token");
    if (auto it = j.find("chat_template"); it != j.end() && !it->is_null()) {
      if (it->is_string()) {
        config.chat_template = it->get<std::string>();
      } else if (it->is_array()) {
        for (const auto& entry : *it) {
          MOE_CHECK(entry.is_object() && entry.contains("name") && entry.contains("template"),
                    path.string(), ": chat_template list entries need name and template");
          if (entry["name"] == "default")
            config.chat_template = entry["template"].get<std::string>();
        }
      } else {
        MOE_FAIL(path.string(), ": chat_template must be a string or a list of {name, template}");
      }
    }
  }
  if (auto text = read_file(model_dir / "chat_template.jinja")) {
    config.chat_template = *text;
  } else if (!config.chat_template) {
    if (auto json_text = read_file(model_dir / "chat_template.json")) {
      auto j = nlohmann::ordered_json::parse(*json_text, nullptr, false);
      if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string()) {
        config.chat_template = j["chat_template"].get<std::string>();
      }
    }
  }
  return config;
}

std::string apply_chat_template(const ChatTemplate& tmpl, const nlohmann::ordered_json& messages,
                                bool add_generation_prompt, const ChatConfig& config,
                                const ChatTemplateExtras& extras) {
  MOE_CHECK(messages.is_array(), "messages must be a JSON array, got ", messages.type_name());
  MOE_CHECK(!messages.empty(), "cannot apply a chat template to an empty conversation");
  nlohmann::ordered_json chat = nlohmann::ordered_json::array();
  for (const auto& message : messages) {
    MOE_CHECK(message.is_object(), "chat messages must be JSON objects, got ", message.type_name());
    // Keys whose value is null are dropped, as transformers does.
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : message.items()) {
      if (!v.is_null()) m[k] = v;
    }
    // The reasoning is offered as `thinking` (first) and `reasoning_content` too.
    const nlohmann::ordered_json* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      if (m.contains(key)) {
        reasoning = &m[key];
        break;
      }
    }
    if (reasoning) {
      nlohmann::ordered_json value = *reasoning;
      nlohmann::ordered_json aliased = nlohmann::ordered_json::object();
      aliased["thinking"] = value;
      for (const auto& [k, v] : m.items()) {
        if (k != "thinking") aliased[k] = v;
      }
      aliased["reasoning_content"] = value;
      m = std::move(aliased);
    }
    chat.push_back(std::move(m));
  }
  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  if (!config.bos_token.empty()) context["bos_token"] = config.bos_token;
  if (!config.eos_token.empty()) context["eos_token"] = config.eos_token;
  context["messages"] = std::move(chat);
  MOE_CHECK(extras.tools.is_null() || extras.tools.is_array(), "tools must be a JSON array, got ",
            extras.tools.type_name());
  MOE_CHECK(extras.variables.is_object(), "extra template variables must be a JSON object");
  MOE_CHECK(!extras.variables.contains("messages"),
            "extra template variables cannot replace the messages");
  context["tools"] = extras.tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [key, value] : extras.variables.items()) context[key] = value;
  return tmpl.render(context);
}

}  // namespace moeinfer
