// `moeinfer eval --model DIR --text-file FILE [--window N] [--max-tokens N] [--json FILE]
//  [routing approximations] [--weights bf16|fp8|int4] [--kv-dtype bf16|fp8]`: the perplexity of a
// text, and with any routing approximation, --weights or a CPU --kv-dtype other than f32 the same
// tokens run unmodified in the same command beside it (under --weights by a second copy of the
// model with the checkpoint's weights; the unmodified run's KV cache holds float32 rows):
// perplexity of both, top-1 agreement and the KL divergence of the approximated next-token
// distribution from the unmodified one.
//
// What is computed: the text is encoded as `moeinfer tokenize` encodes it (the tokenizer's
// special tokens included) and cut, after --max-tokens, into consecutive windows of --window
// tokens (the last may be shorter). Each window is one forward pass over an empty KV cache (as
// `moeinfer logits` runs its ids), and every token of a window but its first is scored from the
// window's tokens before it: position i's logits predict token i + 1. Perplexity is
// exp(mean negative log-likelihood) over the scored tokens; KL(unmodified || modified) is
// sum_v p(v) (log p(v) - log q(v)) over the whole vocabulary at every scored position, in
// double precision from float32 logits; p99 is the nearest-rank 99th percentile (the
// ceil(0.99 n)-th smallest); top-1 agreement counts positions whose argmax (ties: lower id) is
// the same. Under --expert-capacity the capacity is per forward, so per window.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/device_arg.h"
#include "cli/model_arg.h"
#include "cli/path_arg.h"
#include "cli/usage_error.h"
#include "core/error.h"
#include "io/model_config.h"
#include "io/tokenizer.h"
#include "model/family.h"
#include "model/gpu_decoder.h"
#include "model/model.h"

namespace moeinfer::cli {
namespace {

struct EvalArgs {
  std::string model;
  std::string text_file;
  int64_t window = 0;      // 0: the model's context (at most kDefaultWindow)
  int64_t max_tokens = 0;  // 0: the whole text
  std::string json_path;
  DeviceArgs device;
};

// Long enough for a sequence's context to matter, short enough that a CPU window is quick.
constexpr int64_t kDefaultWindow = 1024;

// log-softmax of one row of logits [V], in double.
void log_softmax(const float* logits, int64_t V, std::vector<double>& out) {
  out.resize(V);
  double max_logit = -INFINITY;
  for (int64_t v = 0; v < V; ++v) max_logit = std::max<double>(max_logit, logits[v]);
  double sum = 0.0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[v] - max_logit);
  const double log_sum = max_logit + std::log(sum);
  for (int64_t v = 0; v < V; ++v) out[v] = logits[v] - log_sum;
}

int64_t argmax(const float* logits, int64_t V) {
  return std::max_element(logits, logits + V) - logits;  // the first of equal maxima
}

// What one run (unmodified or approximated) accumulates over the scored positions.
struct RunScore {
  double nll_sum = 0.0;
  double perplexity(int64_t scored) const { return std::exp(nll_sum / scored); }
};

struct Comparison {
  int64_t agree = 0;
  std::vector<double> kl;  // [scored positions]
  double kl_mean() const {
    double sum = 0.0;
    for (double k : kl) sum += k;
    return kl.empty() ? 0.0 : sum / static_cast<double>(kl.size());
  }
  double kl_p99() const {
    if (kl.empty()) return 0.0;
    std::vector<double> sorted = kl;
    std::sort(sorted.begin(), sorted.end());
    const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(sorted.size())));
    return sorted[std::max<size_t>(rank, 1) - 1];
  }
};

std::string read_text(const std::string& path) {
  // A folder opens as an ifstream on Linux and reads as empty text ("encodes to 1 token(s)").
  std::error_code ec;
  USAGE_CHECK(!std::filesystem::is_directory(path, ec), "--text-file ", path,
              " is a folder, not a text file");
  std::ifstream in(path, std::ios::binary);
  USAGE_CHECK(in.good(), "--text-file: cannot open ", path);
  std::ostringstream text;
  text << in.rdbuf();
  USAGE_CHECK(!in.bad(), "--text-file ", path, ": read error");
  return text.str();
}

std::string approximation_text(const moe::RoutingApproximation& a) {
  std::ostringstream out;
  if (a.active_experts != 0) {
    out << "--active-experts " << a.active_experts << " --renorm "
        << (a.renorm == moe::KeptRenorm::kFull ? "full" : "kept") << ' ';
  }
  if (a.drop_below != 0.0) out << "--drop-below " << a.drop_below << ' ';
  if (a.expert_capacity != 0.0) {
    out << "--expert-capacity " << a.expert_capacity << " --overflow "
        << (a.overflow == moe::CapacityOverflow::kReroute ? "reroute" : "drop") << ' ';
  }
  if (a.router_temperature != 1.0) out << "--router-temperature " << a.router_temperature << ' ';
  std::string text = out.str();
  if (!text.empty()) text.pop_back();
  return text;
}

void run_eval(const EvalArgs& args) {
  USAGE_CHECK(args.window == 0 || args.window >= 2, "--window ", args.window,
              " must be at least 2 (a window scores every token after its first)");
  USAGE_CHECK(args.max_tokens == 0 || args.max_tokens >= 2, "--max-tokens ", args.max_tokens,
              " must be at least 2");
  const moe::RoutingApproximation approx = args.device.routing_approximation();
  const WeightFormat weights = args.device.weight_format();
  const WeightScope scope = args.device.weight_scope();  // linear without fp8|int4 refused
  const bool quantised = weights != WeightFormat::kCheckpoint;
  const bool kv_rounded = args.device.kv_rows_rounded();  // f32 refused on cuda
  const bool compare = args.device.active_experts || args.device.drop_below ||
                       args.device.expert_capacity || args.device.router_temperature || quantised ||
                       kv_rounded;
  const std::filesystem::path dir = resolve_model_dir(args.model);
  // The modified run's rows on cuda (fp8 not for heads past 256 yet), refused before any model
  // is loaded.
  if (args.device.is_cuda()) {
    check_gpu_kv_dtype(load_model_config(dir / "config.json"), args.device.kv_rows_dtype());
  }
  const std::string text = read_text(args.text_file);
  std::vector<int32_t> ids = Tokenizer::from_dir(dir).encode(text);
  if (args.max_tokens > 0 && static_cast<int64_t>(ids.size()) > args.max_tokens) {
    ids.resize(args.max_tokens);
  }
  USAGE_CHECK(ids.size() >= 2, "--text-file ", args.text_file, " encodes to ", ids.size(),
              " token(s): nothing to score");

  // The unmodified run keeps the checkpoint's weights; under --weights the modified run has a
  // second model whose routed experts were quantised at load (loaded first: a checkpoint that
  // cannot take the format is refused before anything else is read).
  DeviceArgs unmodified_device = args.device;
  unmodified_device.weights.clear();
  unmodified_device.weights_scope.clear();
  unmodified_device.kv_dtype = "auto";
  std::unique_ptr<Model> quantised_model = quantised ? load_model_for(dir, args.device) : nullptr;
  auto model = load_model_for(dir, unmodified_device);
  const ModelConfig& config = model->config();
  const int64_t context =
      config.max_position_embeddings > 0 ? config.max_position_embeddings : kDefaultWindow;
  USAGE_CHECK(args.window <= context, "--window ", args.window, " exceeds the model's context of ",
              context, " tokens");
  const int64_t window = args.window > 0 ? args.window : std::min(context, kDefaultWindow);
  // The runner starts unmodified; the approximation is switched on per window for the second run.
  unmodified_device.active_experts.reset();
  unmodified_device.renorm.clear();
  unmodified_device.drop_below.reset();
  unmodified_device.expert_capacity.reset();
  unmodified_device.overflow.clear();
  unmodified_device.router_temperature.reset();
  SequenceRunner runner(*model, unmodified_device, window, window);
  // A second runner where the modified run stores or computes differently: the quantised model,
  // or the same model over a cache of --kv-dtype rows.
  DeviceArgs modified_device = unmodified_device;
  modified_device.kv_dtype = args.device.kv_dtype;
  std::optional<SequenceRunner> second_runner;
  if (quantised) {
    second_runner.emplace(*quantised_model, modified_device, window, window);
  } else if (kv_rounded) {
    second_runner.emplace(*model, modified_device, window, window);
  }
  SequenceRunner& modified_runner = second_runner ? *second_runner : runner;
  if (compare) moe::validate(approx, router_options(config));  // K' against the model's K

  const int64_t N = static_cast<int64_t>(ids.size());
  const int64_t V = config.vocab_size;
  std::vector<float> base_logits(window * V), approx_logits(window * V);
  std::vector<double> log_p, log_q;
  RunScore base, approximated;
  Comparison comparison;
  int64_t scored = 0, num_windows = 0;
  for (int64_t start = 0; start + 1 < N; start += window) {
    const int64_t n = std::min(window, N - start);
    if (n < 2) break;  // a last window of one token has nothing to score
    const std::span<const int32_t> tokens(ids.data() + start, n);
    runner.reset();
    runner.set_routing_approximation({});
    runner.forward(tokens, std::span(base_logits.data(), n * V), /*all_positions=*/true);
    if (compare) {
      modified_runner.reset();
      modified_runner.set_routing_approximation(approx);
      modified_runner.forward(tokens, std::span(approx_logits.data(), n * V),
                              /*all_positions=*/true);
    }
    for (int64_t i = 0; i + 1 < n; ++i) {
      const int32_t next = tokens[i + 1];
      log_softmax(base_logits.data() + i * V, V, log_p);
      base.nll_sum -= log_p[next];
      if (compare) {
        log_softmax(approx_logits.data() + i * V, V, log_q);
        approximated.nll_sum -= log_q[next];
        double kl = 0.0;
        for (int64_t v = 0; v < V; ++v) kl += std::exp(log_p[v]) * (log_p[v] - log_q[v]);
        comparison.kl.push_back(std::max(kl, 0.0));  // rounding may leave a tiny negative
        comparison.agree +=
            argmax(base_logits.data() + i * V, V) == argmax(approx_logits.data() + i * V, V);
      }
      ++scored;
    }
    ++num_windows;
  }

  const double ppl = base.perplexity(scored);
  std::printf("eval: %s, %lld tokens of %s in %lld window(s) of at most %lld, %lld scored\n",
              dir.filename().string().c_str(), static_cast<long long>(N), args.text_file.c_str(),
              static_cast<long long>(num_windows), static_cast<long long>(window),
              static_cast<long long>(scored));
  nlohmann::ordered_json out = {{"model", dir.string()},
                                {"text_file", args.text_file},
                                {"device", args.device.device},
                                {"tokens", N},
                                {"window", window},
                                {"windows", num_windows},
                                {"scored", scored},
                                {"perplexity", ppl},
                                {"nll_mean", base.nll_sum / scored}};
  if (!compare) {
    std::printf("  %-24s %12.4f\n", "perplexity", ppl);
  } else {
    const double ppl_mod = approximated.perplexity(scored);
    const double change = ppl_mod / ppl - 1.0;
    const double agreement = static_cast<double>(comparison.agree) / scored;
    std::string flags = approximation_text(approx);
    if (quantised) {
      flags += std::string(flags.empty() ? "" : " ") + "--weights " +
               std::string(weight_format_name(weights));
      if (scope == WeightScope::kLinear) flags += " --weights-scope linear";
    }
    if (kv_rounded)
      flags += std::string(flags.empty() ? "" : " ") + "--kv-dtype " + args.device.kv_dtype;
    std::printf("  %-24s %12s %12s\n", "", "unmodified", "modified");
    std::printf("  %-24s %12.4f %12.4f\n", "perplexity", ppl, ppl_mod);
    std::printf("  %-24s %12s %+11.3f%%\n", "perplexity change", "", 100.0 * change);
    std::printf("  %-24s %12s %12.4f\n", "top-1 agreement", "", agreement);
    std::printf("  %-24s %12s %12.3e\n", "KL mean (nats)", "", comparison.kl_mean());
    std::printf("  %-24s %12s %12.3e\n", "KL p99 (nats)", "", comparison.kl_p99());
    std::printf("  modified: %s\n", flags.c_str());
    out["modified"] = {{"flags", flags},
                       {"perplexity", ppl_mod},
                       {"nll_mean", approximated.nll_sum / scored},
                       {"perplexity_change", change},
                       {"top1_agreement", agreement},
                       {"kl_mean", comparison.kl_mean()},
                       {"kl_p99", comparison.kl_p99()}};
  }
  if (!args.json_path.empty()) {
    std::ofstream file(args.json_path);
    USAGE_CHECK(file.good(), "--json: cannot write ", args.json_path);
    file << out.dump(2) << '\n';
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "eval",
      "Perplexity of a text; with routing approximations or --weights, also against the "
      "unmodified model on the same tokens (top-1 agreement, KL divergence)");
  auto args = std::make_shared<EvalArgs>();
  add_model_option(cmd, &args->model);
  cmd->add_option("--text-file,--text", args->text_file, "The text to score")->required();
  cmd->add_option("--window", args->window,
                  "Tokens per forward pass; every token of a window after its first is scored "
                  "from the window's tokens before it (default: the model's context, at most " +
                      std::to_string(kDefaultWindow) + ")");
  cmd->add_option("--max-tokens", args->max_tokens,
                  "Score only the first N tokens of the text (default: all)");
  cmd->add_option("--json", args->json_path, "Also write the figures to FILE as JSON")
      ->check(writable_file());
  add_device_options(cmd, &args->device);
  add_offload_options(cmd, &args->device);
  add_routing_options(cmd, &args->device);
  add_weight_options(cmd, &args->device);
  add_kv_options(cmd, &args->device);
  cmd->callback([args] { run_eval(*args); });
}

}  // namespace moeinfer::cli
