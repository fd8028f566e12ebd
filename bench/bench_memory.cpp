// Peak resident memory of a loaded model against what it should be: the checkpoint's tensor
// bytes (used in place from the memory map, bf16 staying bf16) plus the KV cache. Measured for
// the largest parity fixture and for a synthetic Qwen3-MoE-shaped bf16 checkpoint written here.
//
//   bench_memory [--fixtures DIR] [--scratch DIR]
//
// Prints one row per model; the last column is peak RSS growth / (tensor bytes + KV bytes).
#include <sys/resource.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/model.h"

namespace fs = std::filesystem;
using namespace moeinfer;

namespace {

double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}

double current_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return static_cast<double>(pages_resident) * 4096.0;
}

struct SyntheticShape {
  int64_t vocab = 32000, hidden = 1024, layers = 4, heads = 16, kv_heads = 4, head_dim = 64;
  int64_t experts = 32, top_k = 4, expert_width = 512;
};

// Writes config.json and a bf16 model.safetensors of random weights with the Qwen3-MoE layout.
void write_synthetic_checkpoint(const fs::path& dir, const SyntheticShape& s) {
  fs::create_directories(dir);
  nlohmann::ordered_json config = {{"model_type", "qwen3_moe"},
                                   {"vocab_size", s.vocab},
                                   {"hidden_size", s.hidden},
                                   {"intermediate_size", 4 * s.hidden},
                                   {"moe_intermediate_size", s.expert_width},
                                   {"num_hidden_layers", s.layers},
                                   {"num_attention_heads", s.heads},
                                   {"num_key_value_heads", s.kv_heads},
                                   {"head_dim", s.head_dim},
                                   {"num_experts", s.experts},
                                   {"num_experts_per_tok", s.top_k},
                                   {"norm_topk_prob", true},
                                   {"decoder_sparse_step", 1},
                                   {"mlp_only_layers", nlohmann::json::array()},
                                   {"max_position_embeddings", 4096},
                                   {"rms_norm_eps", 1e-6},
                                   {"rope_theta", 1000000.0},
                                   {"tie_word_embeddings", false},
                                   {"hidden_act", "silu"},
                                   {"torch_dtype", "bfloat16"}};
  std::ofstream(dir / "config.json") << config.dump(2);

  std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"model.embed_tokens.weight", {s.vocab, s.hidden}},
      {"model.norm.weight", {s.hidden}},
      {"lm_head.weight", {s.vocab, s.hidden}}};
  const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  for (int64_t l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    tensors.push_back({p + "input_layernorm.weight", {s.hidden}});
    tensors.push_back({p + "post_attention_layernorm.weight", {s.hidden}});
    tensors.push_back({p + "self_attn.q_proj.weight", {q, s.hidden}});
    tensors.push_back({p + "self_attn.k_proj.weight", {kv, s.hidden}});
    tensors.push_back({p + "self_attn.v_proj.weight", {kv, s.hidden}});
    tensors.push_back({p + "self_attn.o_proj.weight", {s.hidden, q}});
    tensors.push_back({p + "self_attn.q_norm.weight", {s.head_dim}});
    tensors.push_back({p + "self_attn.k_norm.weight", {s.head_dim}});
    tensors.push_back({p + "mlp.gate.weight", {s.experts, s.hidden}});
    for (int64_t e = 0; e < s.experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      tensors.push_back({x + "gate_proj.weight", {s.expert_width, s.hidden}});
      tensors.push_back({x + "up_proj.weight", {s.expert_width, s.hidden}});
      tensors.push_back({x + "down_proj.weight", {s.hidden, s.expert_width}});
    }
  }
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  uint64_t offset = 0;
  for (const auto& [name, shape] : tensors) {
    uint64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    header[name] = {
        {"dtype", "BF16"}, {"shape", shape}, {"data_offsets", {offset, offset + 2 * numel}}};
    offset += 2 * numel;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::ofstream out(dir / "model.safetensors", std::ios::binary);
  const uint64_t header_len = text.size();
  out.write(reinterpret_cast<const char*>(&header_len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<uint16_t> chunk(1 << 20);
  uint64_t remaining = offset / 2;
  while (remaining > 0) {
    const uint64_t n = std::min<uint64_t>(remaining, chunk.size());
    for (uint64_t i = 0; i < n; ++i) chunk[i] = f32_to_bf16(normal(rng));
    out.write(reinterpret_cast<const char*>(chunk.data()), static_cast<std::streamsize>(2 * n));
    remaining -= n;
  }
}

void measure(const std::string& label, const fs::path& dir, int64_t prompt_tokens,
             int64_t decode_tokens) {
  const double rss_before = current_rss_bytes();
  auto model = Model::load(dir, LoadOptions{.prefault = true});
  Decoder& decoder = model->decoder();
  const ModelConfig& config = decoder.config();
  KvCache cache = decoder.make_cache(prompt_tokens + decode_tokens);
  std::vector<int32_t> prompt(prompt_tokens);
  for (int64_t i = 0; i < prompt_tokens; ++i)
    prompt[i] = static_cast<int32_t>((i * 7919) % config.vocab_size);
  std::vector<float> logits(config.vocab_size);
  decoder.forward(prompt, cache, logits, false);
  for (int64_t i = 0; i < decode_tokens; ++i) {
    const int32_t token[1] = {static_cast<int32_t>(i % config.vocab_size)};
    decoder.forward(token, cache, logits, false);
  }
  const double tensor_bytes = static_cast<double>(model->store().total_bytes());
  const double kv_bytes = static_cast<double>(cache.bytes_per_token() * cache.length());
  const double peak = peak_rss_bytes();
  const double growth = peak - rss_before;
  std::printf("%-22s %12.1f %10.2f %14.1f %14.1f %8.3f\n", label.c_str(), tensor_bytes / 1e6,
              kv_bytes / 1e6, rss_before / 1e6, growth / 1e6, growth / (tensor_bytes + kv_bytes));
}

}  // namespace

int main(int argc, char** argv) {
  fs::path fixtures = "tests/fixtures/models";
  fs::path scratch = fs::temp_directory_path() / "moeinfer-bench-memory";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--fixtures") == 0) fixtures = argv[i + 1];
    if (std::strcmp(argv[i], "--scratch") == 0) scratch = argv[i + 1];
  }
  try {
    fs::path largest;
    uintmax_t largest_bytes = 0;
    for (const auto& entry : fs::directory_iterator(fixtures)) {
      uintmax_t bytes = 0;
      for (const auto& file : fs::directory_iterator(entry.path())) {
        if (file.path().extension() == ".safetensors") bytes += file.file_size();
      }
      if (bytes > largest_bytes) largest_bytes = bytes, largest = entry.path();
    }
    std::printf("%-22s %12s %10s %14s %14s %8s\n", "model", "tensors MB", "KV MB", "RSS before MB",
                "RSS growth MB", "ratio");
    // Each model in its own process would isolate the peaks; the fixture is tiny, so run it
    // first and the synthetic model's growth dominates the second row.
    measure("fixture:" + largest.filename().string(), largest, 12, 16);
    write_synthetic_checkpoint(scratch, SyntheticShape{});
    measure("synthetic qwen3_moe bf16", scratch, 256, 32);
    fs::remove_all(scratch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_memory: %s\n", e.what());
    return 1;
  }
  return 0;
}
