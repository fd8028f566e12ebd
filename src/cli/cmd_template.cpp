// `moeinfer template`: renders a chat template, either a template file on a JSON context or a
// checkpoint's own template on a list of messages. Prints the rendering exactly, with no newline.
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "cli/commands.h"
#include "core/error.h"
#include "io/chat_template.h"

namespace moeinfer::cli {
namespace {

struct TemplateOptions {
  std::string template_path;
  std::string context_path;
  std::string model_dir;
  std::string messages_path;
  bool add_generation_prompt = false;
};

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in, "cannot open ", path);
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

nlohmann::ordered_json read_json(const std::string& path) {
  try {
    return nlohmann::ordered_json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    MOE_FAIL(path, ": ", e.what());
  }
}

void run_template(const TemplateOptions& o) {
  std::string out;
  if (!o.template_path.empty()) {
    MOE_CHECK(!o.context_path.empty(), "--template needs --context");
    ChatTemplate tmpl = ChatTemplate::parse(read_text(o.template_path));
    out = tmpl.render(read_json(o.context_path));
  } else {
    MOE_CHECK(!o.model_dir.empty(),
              "give --template FILE --context FILE or --model DIR --messages FILE");
    MOE_CHECK(!o.messages_path.empty(), "--model needs --messages");
    ChatConfig config = load_chat_config(o.model_dir);
    MOE_CHECK(config.chat_template.has_value(), o.model_dir, " has no chat template");
    ChatTemplate tmpl = ChatTemplate::parse(*config.chat_template);
    out = apply_chat_template(tmpl, read_json(o.messages_path), o.add_generation_prompt, config);
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

void add_template_command(CLI::App& app) {
  auto opts = std::make_shared<TemplateOptions>();
  CLI::App* cmd = app.add_subcommand("template", "Render a chat template");
  auto* tmpl = cmd->add_option("--template", opts->template_path, "Jinja template file");
  cmd->add_option("--context", opts->context_path, "JSON object of template variables")
      ->needs(tmpl);
  auto* model = cmd->add_option("--model", opts->model_dir, "checkpoint folder");
  cmd->add_option("--messages", opts->messages_path, "JSON array of chat messages")->needs(model);
  cmd->add_flag("--add-generation-prompt", opts->add_generation_prompt,
                "end with the assistant turn's header");
  tmpl->excludes(model);
  cmd->callback([opts]() { run_template(*opts); });
}

}  // namespace moeinfer::cli
