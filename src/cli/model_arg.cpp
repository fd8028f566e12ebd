#include "cli/model_arg.h"

#include <cstdlib>
#include <unistd.h>

#include "core/error.h"

namespace moeinfer::cli {
namespace {

// The folder of the running executable, to find the default model relative to the build.
std::filesystem::path executable_dir() {
  std::error_code error;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::filesystem::current_path() : self.parent_path();
}

}  // namespace

void add_model_option(CLI::App* cmd, std::string* model) {
  // Also positional, as `vllm serve MODEL` takes it.
  cmd->add_option("model,--model", *model,
                  "Checkpoint folder (config.json, *.safetensors, tokenizer.json); default: the "
                  "built-in model, or $MOEINFER_MODEL");
}

std::filesystem::path resolve_model_dir(const std::string& model) {
  if (!model.empty()) return model;
  if (const char* env = std::getenv("MOEINFER_MODEL"); env && *env) return env;
  // The built-in default: the small fortune-cookie Qwen3-MoE model trained by
  // tools/train_demo.py and shipped in the repository (models/demo/README.md).
  const std::filesystem::path relative = "models/demo";
  for (auto dir = executable_dir(); !dir.empty(); dir = dir.parent_path()) {
    if (std::filesystem::exists(dir / relative / "config.json")) return dir / relative;
    if (dir == dir.parent_path()) break;
  }
  MOE_FAIL("no --model given and the built-in model (", relative.string(),
           ") was not found beside the executable");
}

}  // namespace moeinfer::cli
