// `moeinfer logits --model DIR --ids 1,2,3 --out FILE.npy`: float32 logits [n_ids, vocab] of one
// forward pass.
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/ids_arg.h"
#include "cli/model_arg.h"
#include "cli/path_arg.h"
#include "core/error.h"
#include "io/npy.h"
#include "model/model.h"

namespace moeinfer::cli {

void add_logits_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("logits", "Write the float32 logits [n_ids, vocab] of one forward pass");
  auto model_dir = std::make_shared<std::string>();
  auto ids_text = std::make_shared<std::string>();
  auto out_path = std::make_shared<std::string>();
  auto device = std::make_shared<DeviceArgs>();
  add_model_option(cmd, model_dir.get());
  cmd->add_option("--ids", *ids_text, "Comma-separated token ids")->required();
  cmd->add_option("--out", *out_path, "Output .npy file")->required()->check(writable_file());
  add_device_options(cmd, device.get());
  add_offload_options(cmd, device.get());
  add_routing_options(cmd, device.get());
  add_weight_options(cmd, device.get());
  add_kv_options(cmd, device.get());
  add_expert_parallel_option(cmd, device.get());
  cmd->callback([=] {
    const std::vector<int32_t> ids = parse_token_ids(*ids_text, "--ids");
    auto model = load_model_for(resolve_model_dir(*model_dir), *device);
    const int64_t n = static_cast<int64_t>(ids.size());
    SequenceRunner runner(*model, *device, n, n);
    const int64_t vocab = runner.config().vocab_size;
    std::vector<float> logits(ids.size() * vocab);
    runner.forward(ids, logits, /*all_positions=*/true);
    const int64_t shape[2] = {static_cast<int64_t>(ids.size()), vocab};
    if (device->is_output_rank()) write_npy_f32(*out_path, logits, shape);
  });
}

}  // namespace moeinfer::cli
