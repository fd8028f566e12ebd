// config.json -> ModelConfig. The defaults and derived values follow transformers 5.x
// (configuration_<family>.py and modeling_<family>.py); where the two disagree the modeling code
// wins, because it is what produced the published weights. An absent field takes the family's
// transformers default (save_pretrained omits default values); only model_type and the RoPE keys
// transformers itself requires must be present. Every error names the file and the field.
#include "io/model_config.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace moeinfer {

std::string_view family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::kQwen3Moe:
      return "qwen3_moe";
    case ModelFamily::kMixtral:
      return "mixtral";
    case ModelFamily::kOlmoe:
      return "olmoe";
    case ModelFamily::kQwen2Moe:
      return "qwen2_moe";
    case ModelFamily::kDeepseekV2:
      return "deepseek_v2";
    case ModelFamily::kDeepseekV3:
      return "deepseek_v3";
    case ModelFamily::kKimiK2:
      return "kimi_k2";
    case ModelFamily::kGlm4Moe:
      return "glm4_moe";
    case ModelFamily::kErnie45Moe:
      return "ernie4_5_moe";
    case ModelFamily::kQwen3Next:
      return "qwen3_next";
    case ModelFamily::kQwen35Moe:
      return "qwen3_5_moe";
    case ModelFamily::kGptOss:
      return "gpt_oss";
    case ModelFamily::kLlama4:
      return "llama4";
  }
  return "?";
}

namespace {

using json = nlohmann::json;

constexpr ModelFamily kFamilies[] = {
    ModelFamily::kQwen3Moe,  ModelFamily::kMixtral,    ModelFamily::kOlmoe,
    ModelFamily::kQwen2Moe,  ModelFamily::kDeepseekV2, ModelFamily::kDeepseekV3,
    ModelFamily::kKimiK2,    ModelFamily::kGlm4Moe,    ModelFamily::kErnie45Moe,
    ModelFamily::kQwen3Next, ModelFamily::kQwen35Moe,  ModelFamily::kLlama4,
    ModelFamily::kGptOss};

// Llama 4's text-only model_type (Llama4ForCausalLM); "llama4" nests the same fields in
// text_config beside a vision_config.
constexpr std::string_view kLlama4TextModelType = "llama4_text";

// Upper bounds that keep later size arithmetic (products of two or three of these) in int64.
constexpr int64_t kMaxDim = int64_t{1} << 31;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxExperts = int64_t{1} << 16;
constexpr int64_t kMaxHeads = int64_t{1} << 16;

// The transformers 5 defaults of each family (configuration_<family>.py). transformers'
// save_pretrained writes only the values that differ from these, so every field but model_type
// may be absent from a genuine config.json.
struct FamilyDefaults {
  int64_t vocab_size;
  int64_t hidden_size;
  int64_t intermediate_size;
  int64_t num_hidden_layers;
  int64_t num_attention_heads;
  std::optional<int64_t> num_key_value_heads;  // nullopt: same as num_attention_heads
  int64_t max_position_embeddings;
  double rms_norm_eps;
  int64_t num_experts;
  int64_t num_experts_per_tok;
  int64_t moe_intermediate_size;            // qwen families; mixtral / olmoe use intermediate_size
  int64_t shared_expert_intermediate_size;  // qwen2_moe
  double rope_theta;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;
  bool tie_word_embeddings = false;
  // The family's partial_rotary_factor when the config gives none; nullopt: the family's
  // modeling code rotates whole heads, so any other value is refused.
  std::optional<double> partial_rotary_factor = std::nullopt;
  // head_dim when the config gives none; nullopt: hidden_size / num_attention_heads.
  std::optional<int64_t> head_dim = std::nullopt;
};

FamilyDefaults defaults_for(ModelFamily family) {
  switch (family) {
    case ModelFamily::kQwen3Moe:
      return {.vocab_size = 151936,
              .hidden_size = 2048,
              .intermediate_size = 6144,
              .num_hidden_layers = 24,
              .num_attention_heads = 32,
              .num_key_value_heads = 4,
              .max_position_embeddings = 32768,
              .rms_norm_eps = 1e-6,
              .num_experts = 128,
              .num_experts_per_tok = 8,
              .moe_intermediate_size = 768,
              .shared_expert_intermediate_size = 0,
              .rope_theta = 10000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = std::nullopt};
    case ModelFamily::kMixtral:
      return {.vocab_size = 32000,
              .hidden_size = 4096,
              .intermediate_size = 14336,
              .num_hidden_layers = 32,
              .num_attention_heads = 32,
              .num_key_value_heads = 8,
              .max_position_embeddings = 4096 * 32,
              .rms_norm_eps = 1e-5,
              .num_experts = 8,
              .num_experts_per_tok = 2,
              .moe_intermediate_size = 0,
              .shared_expert_intermediate_size = 0,
              .rope_theta = 1e6,
              .bos_token_id = 1,
              .eos_token_id = 2};
    case ModelFamily::kOlmoe:
      return {.vocab_size = 50304,
              .hidden_size = 2048,
              .intermediate_size = 2048,
              .num_hidden_layers = 16,
              .num_attention_heads = 16,
              .num_key_value_heads = std::nullopt,
              .max_position_embeddings = 4096,
              .rms_norm_eps = 1e-5,
              .num_experts = 64,
              .num_experts_per_tok = 8,
              .moe_intermediate_size = 0,
              .shared_expert_intermediate_size = 0,
              .rope_theta = 10000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = 50279};
    case ModelFamily::kQwen2Moe:
      return {.vocab_size = 151936,
              .hidden_size = 2048,
              .intermediate_size = 5632,
              .num_hidden_layers = 24,
              .num_attention_heads = 16,
              .num_key_value_heads = 16,
              .max_position_embeddings = 32768,
              .rms_norm_eps = 1e-6,
              .num_experts = 60,
              .num_experts_per_tok = 4,
              .moe_intermediate_size = 1408,
              .shared_expert_intermediate_size = 5632,
              .rope_theta = 10000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = std::nullopt};
    case ModelFamily::kDeepseekV2:
      return {.vocab_size = 102400,
              .hidden_size = 4096,
              .intermediate_size = 11008,
              .num_hidden_layers = 32,
              .num_attention_heads = 32,
              .num_key_value_heads = std::nullopt,
              .max_position_embeddings = 2048,
              .rms_norm_eps = 1e-6,
              .num_experts = 64,
              .num_experts_per_tok = 0,  // no default: the config must say
              .moe_intermediate_size = 1407,
              .shared_expert_intermediate_size = 0,  // n_shared_experts * moe_intermediate_size
              .rope_theta = 10000.0,
              .bos_token_id = 1,
              .eos_token_id = 2};
    case ModelFamily::kDeepseekV3:
    case ModelFamily::kKimiK2:  // its configuration class is DeepSeek-V3's (auto_map)
      return {.vocab_size = 129280,
              .hidden_size = 7168,
              .intermediate_size = 18432,
              .num_hidden_layers = 61,
              .num_attention_heads = 128,
              .num_key_value_heads = 128,
              .max_position_embeddings = 4096,
              .rms_norm_eps = 1e-6,
              .num_experts = 256,
              .num_experts_per_tok = 8,
              .moe_intermediate_size = 2048,
              .shared_expert_intermediate_size = 0,
              .rope_theta = 10000.0,
              .bos_token_id = 0,
              .eos_token_id = 1};
    case ModelFamily::kGlm4Moe:
      return {.vocab_size = 151552,
              .hidden_size = 4096,
              .intermediate_size = 10944,
              .num_hidden_layers = 46,
              .num_attention_heads = 96,
              .num_key_value_heads = 8,
              .max_position_embeddings = 131072,
              .rms_norm_eps = 1e-5,
              .num_experts = 128,
              .num_experts_per_tok = 8,
              .moe_intermediate_size = 1408,
              .shared_expert_intermediate_size = 0,  // n_shared_experts * moe_intermediate_size
              .rope_theta = 10000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = std::nullopt,
              .partial_rotary_factor = 0.5};
    case ModelFamily::kErnie45Moe:
      return {
          .vocab_size = 103424,
          .hidden_size = 2560,
          .intermediate_size = 12288,
          .num_hidden_layers = 28,
          .num_attention_heads = 20,
          .num_key_value_heads = 4,
          .max_position_embeddings = 131072,
          .rms_norm_eps = 1e-5,
          .num_experts = 64,
          .num_experts_per_tok = 6,
          .moe_intermediate_size = 1536,
          .shared_expert_intermediate_size = 0,  // moe_num_shared_experts * moe_intermediate_size
          .rope_theta = 500000.0,
          .bos_token_id = 1,
          .eos_token_id = 2,
          .tie_word_embeddings = true};
    case ModelFamily::kQwen3Next:
      return {.vocab_size = 151936,
              .hidden_size = 2048,
              .intermediate_size = 5632,
              .num_hidden_layers = 48,
              .num_attention_heads = 16,
              .num_key_value_heads = 2,
              .max_position_embeddings = 32768,
              .rms_norm_eps = 1e-6,
              .num_experts = 512,
              .num_experts_per_tok = 10,
              .moe_intermediate_size = 512,
              .shared_expert_intermediate_size = 512,
              .rope_theta = 10000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = std::nullopt,
              .partial_rotary_factor = 0.25,
              .head_dim = 256};
    case ModelFamily::kQwen35Moe:  // Qwen3_5MoeTextConfig: no dense layers (intermediate_size 0)
      return {.vocab_size = 248320,
              .hidden_size = 2048,
              .intermediate_size = 0,
              .num_hidden_layers = 40,
              .num_attention_heads = 16,
              .num_key_value_heads = 2,
              .max_position_embeddings = 32768,
              .rms_norm_eps = 1e-6,
              .num_experts = 256,
              .num_experts_per_tok = 8,
              .moe_intermediate_size = 512,
              .shared_expert_intermediate_size = 512,
              .rope_theta = 10000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = std::nullopt,
              .partial_rotary_factor = 0.25,
              .head_dim = 256};
    case ModelFamily::kGptOss:
      return {.vocab_size = 201088,
              .hidden_size = 2880,
              .intermediate_size = 2880,
              .num_hidden_layers = 36,
              .num_attention_heads = 64,
              .num_key_value_heads = 8,
              .max_position_embeddings = 131072,
              .rms_norm_eps = 1e-5,
              .num_experts = 128,
              .num_experts_per_tok = 4,
              .moe_intermediate_size = 0,  // the experts' width is intermediate_size
              .shared_expert_intermediate_size = 0,
              .rope_theta = 150000.0,
              .bos_token_id = std::nullopt,
              .eos_token_id = std::nullopt};
    case ModelFamily::kLlama4:  // Llama4TextConfig; intermediate_size is the experts' width
      return {.vocab_size = 202048,
              .hidden_size = 5120,
              .intermediate_size = 16384,  // intermediate_size_mlp, the dense layers
              .num_hidden_layers = 48,
              .num_attention_heads = 40,
              .num_key_value_heads = 8,
              .max_position_embeddings = 4096 * 32,
              .rms_norm_eps = 1e-5,
              .num_experts = 16,
              .num_experts_per_tok = 1,
              .moe_intermediate_size = 8192,
              .shared_expert_intermediate_size = 0,  // one shared expert as wide as a routed one
              .rope_theta = 500000.0,
              .bos_token_id = 1,
              .eos_token_id = 2};
  }
  MOE_FAIL("unknown family");
}

// Typed access to one JSON object; `prefix` ("", "rope_parameters.") qualifies field names.
class Fields {
 public:
  Fields(const json& object, const std::string& source, std::string prefix = "")
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  template <typename... Args>
  [[noreturn]] void fail(std::string_view key, const Args&... parts) const {
    MOE_FAIL(source_, ": field '", prefix_, key, "': ", parts...);
  }

  // Present and not null (transformers treats an explicit null like an absent key almost always).
  bool has(const char* key) const { return find(key) != nullptr; }
  bool contains_key(const char* key) const { return object_.contains(key); }
  const json* find(const char* key) const {
    const auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }

  int64_t to_int(const char* key, const json& value) const {
    if (value.is_number_unsigned()) {
      const uint64_t v = value.get<uint64_t>();
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(key, "value ", v, " is out of range");
      return static_cast<int64_t>(v);
    }
    if (value.is_number_integer()) return value.get<int64_t>();
    if (value.is_number_float()) {
      const double v = value.get<double>();
      if (std::isfinite(v) && std::floor(v) == v && std::fabs(v) < 9.0e15)
        return static_cast<int64_t>(v);
      fail(key, "must be an integer, found ", v);
    }
    fail(key, "must be an integer, found ", value.type_name());
  }
  int64_t integer(const char* key) const {
    const json* v = find(key);
    if (!v) fail(key, "is missing");
    return to_int(key, *v);
  }
  int64_t integer(const char* key, int64_t fallback) const {
    const json* v = find(key);
    return v ? to_int(key, *v) : fallback;
  }
  std::optional<int64_t> opt_integer(const char* key) const {
    const json* v = find(key);
    return v ? std::optional<int64_t>(to_int(key, *v)) : std::nullopt;
  }
  // A size: required, in [1, limit].
  int64_t size(const char* key, int64_t limit = kMaxDim) const {
    return check_size(key, integer(key), limit);
  }
  // Absent: `fallback`; an explicit null is refused (transformers would fail later on it).
  int64_t size(const char* key, int64_t fallback, int64_t limit) const {
    if (contains_key(key) && !has(key)) fail(key, "must be an integer, found null");
    return check_size(key, integer(key, fallback), limit);
  }
  int64_t check_size(const char* key, int64_t value, int64_t limit) const {
    if (value <= 0) fail(key, "must be positive, found ", value);
    if (value > limit) fail(key, "value ", value, " exceeds the supported limit ", limit);
    return value;
  }

  double to_number(const char* key, const json& value) const {
    if (!value.is_number()) fail(key, "must be a number, found ", value.type_name());
    const double v = value.get<double>();
    if (!std::isfinite(v)) fail(key, "must be finite");
    return v;
  }
  double number(const char* key) const {
    const json* v = find(key);
    if (!v) fail(key, "is missing");
    return to_number(key, *v);
  }
  double number(const char* key, double fallback) const {
    const json* v = find(key);
    return v ? to_number(key, *v) : fallback;
  }
  std::optional<double> opt_number(const char* key) const {
    const json* v = find(key);
    return v ? std::optional<double>(to_number(key, *v)) : std::nullopt;
  }
  double positive_number(const char* key, double value) const {
    if (!(value > 0)) fail(key, "must be positive, found ", value);
    return value;
  }

  bool boolean(const char* key, bool fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(key, "must be true or false, found ", v->type_name());
    return v->get<bool>();
  }

  std::string string(const char* key) const {
    const json* v = find(key);
    if (!v) fail(key, "is missing");
    if (!v->is_string()) fail(key, "must be a string, found ", v->type_name());
    return v->get<std::string>();
  }
  std::optional<std::string> opt_string(const char* key) const {
    const json* v = find(key);
    if (!v) return std::nullopt;
    if (!v->is_string()) fail(key, "must be a string, found ", v->type_name());
    return v->get<std::string>();
  }

  // An integer or a list of integers (eos_token_id); absent/null gives `fallback`.
  std::vector<int64_t> int_or_list(const char* key, std::vector<int64_t> fallback) const {
    const json* v = find(key);
    if (!v) return fallback;
    std::vector<int64_t> out;
    if (v->is_array()) {
      for (const json& item : *v) out.push_back(to_int(key, item));
    } else {
      out.push_back(to_int(key, *v));
    }
    return out;
  }
  std::vector<int64_t> int_list(const char* key) const {
    const json* v = find(key);
    if (!v) return {};
    if (!v->is_array()) fail(key, "must be a list of integers, found ", v->type_name());
    std::vector<int64_t> out;
    for (const json& item : *v) out.push_back(to_int(key, item));
    return out;
  }

  const json& object() const { return object_; }
  const std::string& source() const { return source_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const json& object_;
  const std::string& source_;
  std::string prefix_;
};

std::string supported_list() {
  std::string out;
  for (ModelFamily f : kFamilies)
    out += std::string(out.empty() ? "" : ", ") + std::string(family_name(f));
  return out + ", " + std::string(kLlama4TextModelType);
}

// The number of routed experts; transformers aliases num_experts and num_local_experts for
// qwen3_moe, mixtral and olmoe (attribute_map), qwen2_moe reads only num_experts.
// A count the family names `canonical` that transformers' attribute_map also reads as `alias`:
// both present must agree.
int64_t aliased_size(const Fields& f, const char* canonical, const char* alias, int64_t fallback,
                     int64_t limit) {
  if (f.has(alias) && f.has(canonical) && f.integer(alias) != f.integer(canonical))
    f.fail(alias, "is ", f.integer(alias), " but ", canonical, " is ", f.integer(canonical),
           "; they must agree");
  if (f.has(alias)) return f.size(alias, limit);
  return f.size(canonical, fallback, limit);
}

int64_t read_num_experts(const Fields& f, ModelFamily family, int64_t fallback) {
  switch (family) {
    case ModelFamily::kDeepseekV2:  // n_routed_experts, aliased as num_experts
      return aliased_size(f, "n_routed_experts", "num_experts", fallback, kMaxExperts);
    case ModelFamily::kDeepseekV3:  // n_routed_experts, aliased as num_local_experts
    case ModelFamily::kKimiK2:
    case ModelFamily::kGlm4Moe:
      return aliased_size(f, "n_routed_experts", "num_local_experts", fallback, kMaxExperts);
    case ModelFamily::kErnie45Moe:  // moe_num_experts, aliased as num_experts
      return aliased_size(f, "moe_num_experts", "num_experts", fallback, kMaxExperts);
    case ModelFamily::kGptOss:  // num_local_experts, aliased as num_experts
      return aliased_size(f, "num_local_experts", "num_experts", fallback, kMaxExperts);
    case ModelFamily::kLlama4:  // num_local_experts only (no attribute_map)
      return f.size("num_local_experts", fallback, kMaxExperts);
    case ModelFamily::kQwen3Moe:
    case ModelFamily::kMixtral:
    case ModelFamily::kOlmoe:
    case ModelFamily::kQwen2Moe:
    case ModelFamily::kQwen3Next:
    case ModelFamily::kQwen35Moe:
      break;
  }
  const bool aliased = family != ModelFamily::kQwen2Moe && family != ModelFamily::kQwen3Next &&
                       family != ModelFamily::kQwen35Moe;
  const bool has_experts = f.has("num_experts");
  const bool has_local = aliased && f.has("num_local_experts");
  if (has_experts && has_local) {
    const int64_t a = f.integer("num_experts"), b = f.integer("num_local_experts");
    if (a != b)
      f.fail("num_local_experts", "is ", b, " but num_experts is ", a, "; they must agree");
  }
  if (has_local) return f.size("num_local_experts", kMaxExperts);
  return f.size("num_experts", fallback, kMaxExperts);
}

// Qwen2-MoE / Qwen3-MoE: layer i has routed experts iff it is not in mlp_only_layers and
// (i + 1) % decoder_sparse_step == 0 (num_experts > 0 is checked by read_num_experts).
std::vector<bool> qwen_sparse_layers(const Fields& f, int64_t num_layers) {
  const int64_t step = f.integer("decoder_sparse_step", 1);
  if (step <= 0) f.fail("decoder_sparse_step", "must be positive, found ", step);
  std::vector<bool> is_moe(static_cast<size_t>(num_layers));
  for (int64_t i = 0; i < num_layers; ++i) is_moe[i] = (i + 1) % step == 0;
  for (int64_t layer : f.int_list("mlp_only_layers")) {
    if (layer < 0 || layer >= num_layers)
      f.fail("mlp_only_layers", "layer ", layer, " is outside [0, ", num_layers, ")");
    is_moe[layer] = false;
  }
  return is_moe;
}

// RoPE settings, in either layout. transformers (convert_rope_params_to_dict) takes a non-empty
// `rope_scaling` over `rope_parameters`, and `rope_theta` from inside the dict before the top
// level.
RopeConfig read_rope(const Fields& top, const FamilyDefaults& defaults,
                     int64_t max_position_embeddings) {
  RopeConfig rope;
  const json* params = nullptr;
  std::string where;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    const json* v = top.find(key);
    if (!v) continue;
    if (!v->is_object()) top.fail(key, "must be an object or null, found ", v->type_name());
    if (v->empty()) continue;
    params = v;
    where = key;
    break;
  }
  // partial_rotary_factor: the dict's value, then the top level's, then the family's default
  // (convert_rope_params_to_dict). A family whose modeling code rotates whole heads would fail
  // on any other value, so it is refused there.
  const Fields* partial_from = &top;
  std::optional<Fields> in_params;
  if (params) {
    in_params.emplace(*params, top.source(), top.prefix() + where + ".");
    if (in_params->has("partial_rotary_factor")) partial_from = &*in_params;
  }
  if (partial_from->has("partial_rotary_factor")) {
    rope.partial_rotary_factor = partial_from->number("partial_rotary_factor");
    if (!defaults.partial_rotary_factor && rope.partial_rotary_factor != 1.0)
      partial_from->fail("partial_rotary_factor",
                         "partial rotary embeddings are not supported for this model_type");
    if (!(rope.partial_rotary_factor > 0.0 && rope.partial_rotary_factor <= 1.0))
      partial_from->fail("partial_rotary_factor", "must be in (0, 1], found ",
                         rope.partial_rotary_factor);
  } else {
    rope.partial_rotary_factor = defaults.partial_rotary_factor.value_or(1.0);
  }

  rope.theta = top.number("rope_theta", defaults.rope_theta);
  if (!params) {
    top.positive_number("rope_theta", rope.theta);
    return rope;
  }
  const Fields& p = *in_params;
  for (const auto& [key, value] : params->items())
    if (value.is_object()) p.fail(key.c_str(), "per-layer-type RoPE parameters are not supported");
  rope.theta = p.positive_number("rope_theta", p.number("rope_theta", rope.theta));
  if (p.has("rope_type"))
    rope.type = p.string("rope_type");
  else if (p.has("type"))
    rope.type = p.string("type");
  const char* type_key = p.has("rope_type") ? "rope_type" : "type";

  // original_max_position_embeddings: a top-level value wins (standardize_rope_params), then the
  // dict's, then max_position_embeddings.
  auto original_max = [&]() -> int64_t {
    if (top.has("original_max_position_embeddings"))
      return top.size("original_max_position_embeddings");
    return p.size("original_max_position_embeddings", max_position_embeddings, kMaxDim);
  };

  if (rope.type == "default") {
    // Nothing else is read.
  } else if (rope.type == "linear" || rope.type == "dynamic") {
    rope.factor = p.positive_number("factor", p.number("factor"));
    if (rope.type == "dynamic") rope.original_max_position_embeddings = max_position_embeddings;
  } else if (rope.type == "yarn") {
    if (!p.contains_key("factor")) p.fail("factor", "is missing");
    rope.original_max_position_embeddings = original_max();
    rope.factor = p.has("factor") ? p.number("factor")
                                  : static_cast<double>(max_position_embeddings) /
                                        static_cast<double>(rope.original_max_position_embeddings);
    p.positive_number("factor", rope.factor);
    rope.attention_factor = p.opt_number("attention_factor");
    if (rope.attention_factor && *rope.attention_factor < 0)
      p.fail("attention_factor", "must not be negative, found ", *rope.attention_factor);
    // transformers reads these with `or`: null or 0 falls back to the default.
    const double beta_fast = p.number("beta_fast", 0.0), beta_slow = p.number("beta_slow", 0.0);
    rope.beta_fast = beta_fast != 0.0 ? beta_fast : 32.0;
    rope.beta_slow = beta_slow != 0.0 ? beta_slow : 1.0;
    rope.mscale = p.number("mscale", 0.0);
    rope.mscale_all_dim = p.number("mscale_all_dim", 0.0);
    rope.truncate = p.boolean("truncate", true);
  } else if (rope.type == "llama3") {
    rope.factor = p.positive_number("factor", p.number("factor"));
    rope.low_freq_factor = p.positive_number("low_freq_factor", p.number("low_freq_factor"));
    rope.high_freq_factor = p.positive_number("high_freq_factor", p.number("high_freq_factor"));
    // Equal factors leave no band to smooth (Llama 4 Scout publishes 1.0 and 1.0).
    if (rope.high_freq_factor < rope.low_freq_factor)
      p.fail("high_freq_factor", "must not be below low_freq_factor (", rope.low_freq_factor,
             "), found ", rope.high_freq_factor);
    rope.original_max_position_embeddings = original_max();
  } else {
    p.fail(type_key, "unsupported RoPE type '", rope.type,
           "'; supported: default, linear, dynamic, yarn, llama3");
  }
  return rope;
}

// n_group / topk_group of a grouped router (group_limited_greedy or noaux_tc).
void read_groups(const Fields& f, int64_t default_groups, int64_t default_topk_groups,
                 ModelConfig* cfg) {
  cfg->num_groups = f.size("n_group", default_groups, kMaxExperts);
  cfg->topk_groups = f.size("topk_group", default_topk_groups, kMaxExperts);
  if (cfg->num_experts % cfg->num_groups != 0)
    f.fail("n_group", cfg->num_groups, " does not divide the ", cfg->num_experts, " experts");
  if (cfg->topk_groups > cfg->num_groups)
    f.fail("topk_group", cfg->topk_groups, " exceeds n_group (", cfg->num_groups, ")");
  if (cfg->topk_groups * (cfg->num_experts / cfg->num_groups) < cfg->num_experts_per_tok)
    f.fail("topk_group", cfg->topk_groups, " groups of ", cfg->num_experts / cfg->num_groups,
           " experts cannot supply num_experts_per_tok=", cfg->num_experts_per_tok);
  if (cfg->topk_method == TopkMethod::kNoauxTc && cfg->num_experts / cfg->num_groups < 2)
    f.fail("n_group", "noaux_tc needs at least 2 experts per group");
}

// DeepSeek-V2 / V3 (and Kimi K2, V3 under its own model_type): MLA sizes, shared experts, dense
// first layers and the routing method. The router follows transformers' modeling code: V2
// scores with softmax (greedy or group_limited_greedy top-k, scaled by routed_scaling_factor,
// never renormalised); V3 always uses sigmoid scores with e_score_correction_bias and top-2-sum
// groups (noaux_tc). A config that asks for another combination would be run differently by the
// reference, so it is refused.
void read_deepseek(const Fields& f, const FamilyDefaults& defaults, ModelConfig* cfg) {
  const bool v3 = cfg->family != ModelFamily::kDeepseekV2;
  MlaConfig mla;
  const json* q_lora = f.find("q_lora_rank");
  if (f.contains_key("q_lora_rank") && !q_lora) {
    mla.q_lora_rank = 0;  // explicit null: no query bottleneck (V2-Lite)
  } else {
    mla.q_lora_rank = f.size("q_lora_rank", 1536, kMaxDim);
  }
  mla.kv_lora_rank = f.size("kv_lora_rank", 512, kMaxDim);
  mla.qk_nope_head_dim = f.size("qk_nope_head_dim", 128, kMaxHeads);
  mla.qk_rope_head_dim = f.size("qk_rope_head_dim", 64, kMaxHeads);
  mla.v_head_dim = f.size("v_head_dim", 128, kMaxHeads);
  mla.rope_interleave = v3 ? f.boolean("rope_interleave", true) : true;
  if (mla.qk_rope_head_dim % 2 != 0)
    f.fail("qk_rope_head_dim", "RoPE needs an even size, found ", mla.qk_rope_head_dim);
  cfg->mla = mla;
  if (cfg->num_kv_heads != cfg->num_heads)
    f.fail("num_key_value_heads", "MLA attention needs as many key/value heads as query heads (",
           cfg->num_heads, "), found ", cfg->num_kv_heads);
  if (f.boolean("mlp_bias", false)) f.fail("mlp_bias", "MLP biases are not supported");
  cfg->attention_bias = f.boolean("attention_bias", false);
  if (cfg->attention_bias)
    f.fail("attention_bias", "attention biases are not supported for MLA checkpoints");

  cfg->moe_intermediate_size =
      f.size("moe_intermediate_size", defaults.moe_intermediate_size, kMaxDim);
  const int64_t num_shared = f.integer("n_shared_experts", v3 ? 1 : 2);
  if (num_shared < 0) f.fail("n_shared_experts", "must not be negative, found ", num_shared);
  cfg->shared_expert_intermediate_size = num_shared * cfg->moe_intermediate_size;
  cfg->routed_scaling_factor = f.number("routed_scaling_factor", v3 ? 2.5 : 1.0);
  f.positive_number("routed_scaling_factor", cfg->routed_scaling_factor);

  const int64_t first_dense = f.integer("first_k_dense_replace", v3 ? 3 : 0);
  if (first_dense < 0 || first_dense > cfg->num_layers)
    f.fail("first_k_dense_replace", first_dense, " is outside [0, ", cfg->num_layers, "]");
  cfg->layer_is_moe.assign(static_cast<size_t>(cfg->num_layers), true);
  for (int64_t i = 0; i < first_dense; ++i) cfg->layer_is_moe[i] = false;
  if (f.integer("moe_layer_freq", 1) != 1)
    f.fail("moe_layer_freq", "only 1 is supported (every layer from first_k_dense_replace on)");

  const std::string scoring = f.opt_string("scoring_func").value_or(v3 ? "sigmoid" : "softmax");
  const std::string method = f.opt_string("topk_method").value_or(v3 ? "noaux_tc" : "greedy");
  if (v3) {
    if (method != "noaux_tc")
      f.fail("topk_method", cfg->model_type, " routing is noaux_tc, found '", method, "'");
    if (scoring != "sigmoid")
      f.fail("scoring_func", cfg->model_type, " routing scores with sigmoid, found '", scoring,
             "'");
    cfg->topk_method = TopkMethod::kNoauxTc;
    cfg->sigmoid_scores = true;
    cfg->router_selection_bias = true;
    cfg->norm_topk_prob = f.boolean("norm_topk_prob", true);
  } else {
    if (method == "greedy") {
      cfg->topk_method = TopkMethod::kGreedy;
    } else if (method == "group_limited_greedy") {
      cfg->topk_method = TopkMethod::kGroupLimitedGreedy;
    } else {
      f.fail("topk_method", "deepseek_v2 supports greedy and group_limited_greedy, found '", method,
             "'");
    }
    if (scoring != "softmax")
      f.fail("scoring_func", "deepseek_v2 routing scores with softmax, found '", scoring, "'");
    if (f.boolean("norm_topk_prob", false))
      f.fail("norm_topk_prob",
             "renormalised deepseek_v2 routing is not supported (the reference "
             "implementation does not renormalise)");
  }
  if (cfg->topk_method != TopkMethod::kGreedy) read_groups(f, v3 ? 8 : 1, v3 ? 4 : 1, cfg);
}

// GLM's dense first layers: layers [0, first_k_dense_replace) are dense, the rest routed (a value
// past the last layer makes every layer dense, as the reference's
// layer_idx >= first_k_dense_replace does).
std::vector<bool> first_dense_layers(const Fields& f, int64_t fallback, int64_t num_layers) {
  const int64_t first_dense = f.integer("first_k_dense_replace", fallback);
  if (first_dense < 0) f.fail("first_k_dense_replace", "must not be negative, found ", first_dense);
  std::vector<bool> is_moe(static_cast<size_t>(num_layers));
  for (int64_t l = 0; l < num_layers; ++l) is_moe[l] = l >= first_dense;
  return is_moe;
}

// GLM-4.5 (transformers' Glm4Moe*): standard attention with q/k/v biases when attention_bias
// (o_proj never has one), per-head q/k RMSNorm when use_qk_norm, RoPE over the first
// partial_rotary_factor of each head (0.5 unless the config says otherwise, rotate-half pairs
// within it); first_k_dense_replace dense layers, then routed experts chosen as DeepSeek-V3
// chooses them (sigmoid scores plus e_score_correction_bias, top-2-sum groups, the unbiased
// scores renormalised when norm_topk_prob, times routed_scaling_factor) beside n_shared_experts
// ungated shared experts. The reference always routes that way and never reads topk_method or
// scoring_func, so neither is read here; the MTP layers (num_nextn_predict_layers) are not part
// of its forward pass and their tensors are left unread.
void read_glm4_moe(const Fields& f, const FamilyDefaults& defaults, ModelConfig* cfg) {
  cfg->moe_intermediate_size =
      f.size("moe_intermediate_size", defaults.moe_intermediate_size, kMaxDim);
  const int64_t num_shared = f.integer("n_shared_experts", 1);
  if (num_shared < 0) f.fail("n_shared_experts", "must not be negative, found ", num_shared);
  cfg->shared_expert_intermediate_size = num_shared * cfg->moe_intermediate_size;
  cfg->attention_bias = f.boolean("attention_bias", false);
  cfg->attention_out_bias = false;
  cfg->qk_norm_per_head = f.boolean("use_qk_norm", false);
  cfg->routed_scaling_factor = f.number("routed_scaling_factor", 1.0);
  f.positive_number("routed_scaling_factor", cfg->routed_scaling_factor);
  cfg->norm_topk_prob = f.boolean("norm_topk_prob", true);
  cfg->topk_method = TopkMethod::kNoauxTc;
  cfg->sigmoid_scores = true;
  cfg->router_selection_bias = true;
  cfg->layer_is_moe = first_dense_layers(f, 1, cfg->num_layers);
  read_groups(f, 1, 1, cfg);
}

// The largest moe_norm_min taken (the published value). The reference divides the K picked
// scores by max(their sum, moe_norm_min), the engine's router by their sum + 1e-20: the same
// float unless the picks' softmax scores sum below moe_norm_min, so a larger floor, which could
// take effect, is refused rather than run differently.
constexpr double kErnieMaxNormMin = 1e-12;

// ERNIE 4.5 MoE, the text model (transformers' Ernie4_5_Moe*): standard attention without
// biases, RoPE over adjacent pairs (2i, 2i + 1); routed experts chosen by softmax scores plus
// e_score_correction_bias (its moe_statics), weighted by the unbiased scores renormalised over
// the K picks (no scaling factor), beside moe_num_shared_experts ungated shared experts of
// moe_intermediate_size each; layer l is routed iff (l + 1) % moe_layer_interval == 0 and
// moe_layer_start_index <= l <= moe_layer_end_index (-1: the last layer), dense otherwise. The
// MTP block (num_nextn_predict_layers) is not part of the reference's forward pass.
void read_ernie4_5_moe(const Fields& f, const FamilyDefaults& defaults, ModelConfig* cfg) {
  cfg->moe_intermediate_size =
      f.size("moe_intermediate_size", defaults.moe_intermediate_size, kMaxDim);
  const int64_t num_shared = f.integer("moe_num_shared_experts", 2);
  if (num_shared < 0) f.fail("moe_num_shared_experts", "must not be negative, found ", num_shared);
  cfg->shared_expert_intermediate_size = num_shared * cfg->moe_intermediate_size;
  if (f.boolean("use_bias", false))
    f.fail("use_bias",
           "biases on the attention and MLP projections are not supported (the published "
           "ERNIE 4.5 checkpoints have none)");
  cfg->rope_interleaved = true;
  cfg->topk_method = TopkMethod::kGreedy;
  cfg->sigmoid_scores = false;
  cfg->norm_topk_prob = true;
  cfg->router_selection_bias = true;
  const double norm_min = f.number("moe_norm_min", 1e-12);
  if (norm_min < 0.0 || norm_min > kErnieMaxNormMin)
    f.fail("moe_norm_min", "only floors up to ", kErnieMaxNormMin,
           " are supported (the renormalisation adds 1e-20 instead), found ", norm_min);

  const int64_t L = cfg->num_layers;
  const int64_t interval = f.integer("moe_layer_interval", 1);
  if (interval <= 0) f.fail("moe_layer_interval", "must be positive, found ", interval);
  const int64_t first = f.integer("moe_layer_start_index", 1);
  int64_t last = f.integer("moe_layer_end_index", -1);
  if (last == -1) last = L - 1;
  cfg->layer_is_moe.assign(static_cast<size_t>(L), false);
  for (int64_t l = 0; l < L; ++l)
    cfg->layer_is_moe[l] = (l + 1) % interval == 0 && l >= first && l <= last;
}

// Qwen3-Next's layer_types: "linear_attention" or "full_attention" per layer; without the list,
// every full_attention_interval-th layer (1-based) is full attention and the rest linear.
std::vector<bool> qwen3_next_linear_layers(const Fields& f, int64_t num_layers) {
  std::vector<bool> is_linear(static_cast<size_t>(num_layers));
  if (const json* types = f.find("layer_types")) {
    if (!types->is_array()) f.fail("layer_types", "must be a list, found ", types->type_name());
    if (static_cast<int64_t>(types->size()) != num_layers)
      f.fail("layer_types", "has ", types->size(), " entries for ", num_layers, " layers");
    for (int64_t l = 0; l < num_layers; ++l) {
      const json& t = (*types)[static_cast<size_t>(l)];
      const std::string type = t.is_string() ? t.get<std::string>() : t.type_name();
      if (type != "linear_attention" && type != "full_attention")
        f.fail("layer_types", "layer ", l, " is '", type,
               "'; supported: linear_attention, full_attention");
      is_linear[static_cast<size_t>(l)] = type == "linear_attention";
    }
    return is_linear;
  }
  const int64_t interval = f.integer("full_attention_interval", 4);
  if (interval <= 0) f.fail("full_attention_interval", "must be positive, found ", interval);
  for (int64_t l = 0; l < num_layers; ++l) is_linear[static_cast<size_t>(l)] = (l + 1) % interval;
  return is_linear;
}

// Qwen3-Next (transformers' Qwen3Next*): Gated DeltaNet layers (linear_*) and gated full
// attention layers (q_proj doubled for a per-head sigmoid gate, per-head q/k RMSNorm, RoPE over
// partial_rotary_factor of each head, 0.25 by default); every RMSNorm but the gated one in the
// linear layers is zero-centred (1 + w); Qwen2-MoE's sigmoid-gated shared expert beside softmax
// top-k experts (norm_topk_prob), dense layers by mlp_only_layers and decoder_sparse_step. The
// MTP head (mtp.* tensors) is not part of the reference's forward pass and is not read.
//
// Qwen3.5-MoE's text model (Qwen3_5MoeTextConfig, under text_config) computes the same; its
// configuration has no dense layers (every layer routed, no mlp_only_layers, decoder_sparse_step
// or intermediate_size), its router always renormalises, and its RoPE is M-RoPE, which for text
// (one position for all three sections) is the 1-D RoPE above, so mrope_section must cover the
// rotary dims exactly.
void read_qwen3_next(const Fields& f, const FamilyDefaults& defaults, ModelConfig* cfg) {
  const bool qwen35 = cfg->family == ModelFamily::kQwen35Moe;
  cfg->moe_intermediate_size =
      f.size("moe_intermediate_size", defaults.moe_intermediate_size, kMaxDim);
  cfg->shared_expert_intermediate_size =
      f.size("shared_expert_intermediate_size", defaults.shared_expert_intermediate_size, kMaxDim);
  cfg->norm_topk_prob = qwen35 || f.boolean("norm_topk_prob", true);
  if (f.boolean("attention_bias", false))
    f.fail("attention_bias", "attention biases are not supported for ", cfg->model_type,
           " (the published checkpoints have none)");
  if (f.boolean("use_sliding_window", false))
    f.fail("use_sliding_window", "sliding-window attention is not supported for ", cfg->model_type);
  cfg->qk_norm_per_head = true;
  cfg->shared_expert_gated = true;
  cfg->attention_output_gate = true;
  cfg->norm_weight_offset = true;
  cfg->layer_is_moe = qwen35 ? std::vector<bool>(static_cast<size_t>(cfg->num_layers), true)
                             : qwen_sparse_layers(f, cfg->num_layers);
  cfg->layer_is_linear = qwen3_next_linear_layers(f, cfg->num_layers);
  if (cfg->num_kv_layers() == 0)
    f.fail(f.has("layer_types") ? "layer_types" : "full_attention_interval",
           "no layer is full_attention; a model of linear-attention layers only is not supported");
  if (const json* rope = f.find("rope_parameters"); rope && rope->is_object()) {
    const Fields p(*rope, f.source(), f.prefix() + "rope_parameters.");
    if (p.has("mrope_section")) {
      int64_t sections = 0;
      for (int64_t n : p.int_list("mrope_section")) sections += n;
      if (sections * 2 != cfg->rotary_dim())
        p.fail("mrope_section", "covers ", sections * 2, " rotary dims, the heads rotate ",
               cfg->rotary_dim());
    }
  }
  LinearAttentionConfig lin;
  lin.num_key_heads = f.size("linear_num_key_heads", 16, kMaxHeads);
  lin.num_value_heads = f.size("linear_num_value_heads", 32, kMaxHeads);
  lin.key_head_dim = f.size("linear_key_head_dim", 128, kMaxHeads);
  lin.value_head_dim = f.size("linear_value_head_dim", 128, kMaxHeads);
  lin.conv_kernel = f.size("linear_conv_kernel_dim", 4, 64);
  if (lin.num_value_heads % lin.num_key_heads != 0)
    f.fail("linear_num_value_heads", lin.num_value_heads,
           " is not a multiple of linear_num_key_heads (", lin.num_key_heads, ")");
  if (cfg->num_linear_layers() > 0) cfg->linear_attention = lin;
}

// GPT-OSS's RoPE when the config gives none (GptOssConfig.__post_init__): YaRN over a 4096-token
// training context, factor 32, beta_fast 32, beta_slow 1, untruncated correction range.
RopeConfig gpt_oss_default_rope(double theta) {
  RopeConfig rope;
  rope.type = "yarn";
  rope.theta = theta;
  rope.factor = 32.0;
  rope.original_max_position_embeddings = 4096;
  rope.beta_fast = 32.0;
  rope.beta_slow = 1.0;
  rope.truncate = false;
  return rope;
}

// GPT-OSS (transformers' GptOss*): attention with biases on q/k/v/o (attention_bias, true by
// default) and a learned sink logit per head, RoPE over whole heads (YaRN by default), layers
// that attend over sliding_window keys or over all keys as layer_types says (alternating from a
// sliding first layer when absent); every layer routed: the router's logits carry a bias, the
// top num_experts_per_tok logits are picked and softmaxed among themselves; each expert is
// intermediate_size wide, with biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit). The
// fields transformers keeps but never reads (experts_per_token, initial_context_length,
// router_aux_loss_coef, output_router_logits) are not read either.
void read_gpt_oss(const Fields& f, ModelConfig* cfg) {
  cfg->moe_intermediate_size = cfg->intermediate_size;
  cfg->attention_bias = f.boolean("attention_bias", true);
  cfg->attention_out_bias = cfg->attention_bias;
  cfg->attention_sinks = true;
  cfg->router_bias = true;
  cfg->router_topk_softmax = true;
  cfg->norm_topk_prob = true;  // the softmax over the picks sums to 1
  cfg->expert_bias = true;
  cfg->layer_is_moe.assign(static_cast<size_t>(cfg->num_layers), true);
  ClampedSwiglu swiglu;
  swiglu.alpha = f.positive_number("swiglu_alpha", f.number("swiglu_alpha", 1.702));
  swiglu.limit = f.positive_number("swiglu_limit", f.number("swiglu_limit", 7.0));
  cfg->clamped_swiglu = swiglu;

  // Absent: the class default 128; null: no window.
  if (f.has("sliding_window") || !f.contains_key("sliding_window"))
    cfg->sliding_window = f.size("sliding_window", 128, kMaxDim);
  cfg->layer_sliding.assign(static_cast<size_t>(cfg->num_layers), false);
  if (const json* types = f.find("layer_types")) {
    if (!types->is_array()) f.fail("layer_types", "must be a list, found ", types->type_name());
    if (static_cast<int64_t>(types->size()) != cfg->num_layers)
      f.fail("layer_types", "has ", types->size(), " entries for ", cfg->num_layers, " layers");
    for (size_t l = 0; l < types->size(); ++l) {
      const json& t = (*types)[l];
      const std::string type = t.is_string() ? t.get<std::string>() : std::string(t.type_name());
      if (type == "sliding_attention") {
        cfg->layer_sliding[l] = true;
      } else if (type != "full_attention") {
        f.fail("layer_types", "entry ", l, " is '", type,
               "'; supported: sliding_attention, full_attention");
      }
    }
  } else {
    for (int64_t l = 0; l < cfg->num_layers; ++l) cfg->layer_sliding[l] = (l + 1) % 2 == 1;
  }
  const bool any_sliding = std::find(cfg->layer_sliding.begin(), cfg->layer_sliding.end(), true) !=
                           cfg->layer_sliding.end();
  if (any_sliding && !cfg->sliding_window)
    f.fail("sliding_window", "is null but layer_types has sliding_attention layers");
}

// A flag transformers tests for truth: true/false, or a number (nonzero is on). The published
// Llama 4 configs write attn_temperature_tuning as 4.
bool truthy(const Fields& f, const char* key, bool fallback) {
  const json* v = f.find(key);
  if (!v) return fallback;
  if (v->is_boolean()) return v->get<bool>();
  if (v->is_number()) return f.to_number(key, *v) != 0.0;
  f.fail(key, "must be true, false or a number, found ", v->type_name());
}

// Llama 4 text (transformers' Llama4Text*): attention with RoPE on adjacent pairs (the complex
// form) on the layers no_rope_layers marks 1 and none on those it marks 0 (NoPE; absent or
// empty: every no_rope_layer_interval-th layer), chunked local attention on the layers
// layer_types marks chunked_attention (by default the RoPE layers, when attention_chunk_size is
// set), a weightless RMSNorm of q and k after RoPE on RoPE layers (use_qk_norm), a query
// temperature on NoPE layers (attn_temperature_tuning, floor_scale, attn_scale); routed layers
// by moe_layers (default every interleave_moe_layer_step-th) with experts of intermediate_size,
// dense layers of intermediate_size_mlp; the router takes the top-k logits, their sigmoid
// multiplies the token before the expert, and one ungated shared expert as wide as a routed one
// joins every token.
void read_llama4(const Fields& f, const FamilyDefaults& defaults, ModelConfig* cfg) {
  const int64_t L = cfg->num_layers;
  cfg->moe_intermediate_size = f.size("intermediate_size", defaults.moe_intermediate_size, kMaxDim);
  cfg->intermediate_size = f.size("intermediate_size_mlp", defaults.intermediate_size, kMaxDim);
  cfg->shared_expert_intermediate_size = cfg->moe_intermediate_size;
  cfg->shared_expert_gated = false;
  cfg->attention_bias = f.boolean("attention_bias", false);
  cfg->attention_out_bias = cfg->attention_bias;  // one flag for q, k, v and o
  cfg->qk_norm_after_rope = f.boolean("use_qk_norm", true);
  cfg->rope_interleaved = true;
  cfg->topk_method = TopkMethod::kGreedy;
  cfg->sigmoid_scores = true;
  cfg->norm_topk_prob = false;
  cfg->routed_scaling_factor = 1.0;
  cfg->routing_weight_on_input = true;

  // no_rope_layers: 1 = RoPE, 0 = NoPE; at least one entry per layer (extra ones are unread).
  std::vector<int64_t> rope_flags = f.int_list("no_rope_layers");
  if (rope_flags.empty()) {
    const int64_t interval = f.integer("no_rope_layer_interval", 4);
    if (interval <= 0) f.fail("no_rope_layer_interval", "must be positive, found ", interval);
    for (int64_t l = 0; l < L; ++l) rope_flags.push_back((l + 1) % interval != 0 ? 1 : 0);
  }
  if (static_cast<int64_t>(rope_flags.size()) < L)
    f.fail("no_rope_layers", "has ", rope_flags.size(), " entries for ", L, " layers");
  cfg->layer_uses_rope.assign(static_cast<size_t>(L), true);
  for (int64_t l = 0; l < L; ++l) {
    if (rope_flags[l] != 0 && rope_flags[l] != 1)
      f.fail("no_rope_layers", "entries must be 1 (RoPE) or 0 (NoPE), found ", rope_flags[l]);
    cfg->layer_uses_rope[l] = rope_flags[l] == 1;
  }

  const std::optional<int64_t> chunk = f.opt_integer("attention_chunk_size");
  const bool chunk_given = chunk.has_value() || !f.contains_key("attention_chunk_size");
  const int64_t chunk_size = chunk_given ? chunk.value_or(8192) : 0;
  if (chunk_given && chunk_size <= 0)
    f.fail("attention_chunk_size", "must be positive or null, found ", chunk_size);
  cfg->layer_is_chunked.assign(static_cast<size_t>(L), false);
  if (const json* types = f.find("layer_types")) {
    if (!types->is_array()) f.fail("layer_types", "must be a list, found ", types->type_name());
    if (static_cast<int64_t>(types->size()) != L)
      f.fail("layer_types", "has ", types->size(), " entries for ", L, " layers");
    for (int64_t l = 0; l < L; ++l) {
      const json& t = (*types)[l];
      const std::string kind = t.is_string() ? t.get<std::string>() : t.type_name();
      if (kind == "chunked_attention") {
        cfg->layer_is_chunked[l] = true;
      } else if (kind != "full_attention") {
        f.fail("layer_types", "supported: chunked_attention, full_attention; found '", kind, "'");
      }
    }
  } else {
    for (int64_t l = 0; l < L; ++l)
      cfg->layer_is_chunked[l] = chunk_given && cfg->layer_uses_rope[l];
  }
  const bool any_chunked = std::find(cfg->layer_is_chunked.begin(), cfg->layer_is_chunked.end(),
                                     true) != cfg->layer_is_chunked.end();
  if (any_chunked && !chunk_given)
    f.fail("attention_chunk_size", "is null but layer_types has chunked_attention layers");
  cfg->attention_chunk_size = any_chunked ? chunk_size : 0;

  if (truthy(f, "attn_temperature_tuning", true)) {
    AttentionTemperature t;
    t.floor_scale = f.integer("floor_scale", 8192);
    if (t.floor_scale <= 0) f.fail("floor_scale", "must be positive, found ", t.floor_scale);
    t.attn_scale = f.number("attn_scale", 0.1);
    cfg->attention_temperature = t;
  }

  cfg->layer_is_moe.assign(static_cast<size_t>(L), false);
  if (f.has("moe_layers")) {
    // An index past the last layer names no layer, as in the reference (a config cut to fewer
    // layers keeps its list).
    for (int64_t layer : f.int_list("moe_layers")) {
      if (layer < 0) f.fail("moe_layers", "layer ", layer, " is negative");
      if (layer < L) cfg->layer_is_moe[layer] = true;
    }
  } else {
    const int64_t step = f.integer("interleave_moe_layer_step", 1);
    if (step <= 0) f.fail("interleave_moe_layer_step", "must be positive, found ", step);
    for (int64_t l = step - 1; l < L; l += step) cfg->layer_is_moe[l] = true;
  }
}

// bits and group_size, shared by GPTQ and AWQ.
void read_int4_groups(const Fields& p, std::string_view method, PackedInt4Quantization* q) {
  const int64_t bits = p.integer("bits");
  if (bits != 4) p.fail("bits", "only 4-bit ", method, " is supported, found ", bits);
  const int64_t group_size = p.integer("group_size", 128);
  // -1: one group over all of a row's inputs.
  q->group_size = group_size == -1 ? 0 : p.check_size("group_size", group_size, kMaxDim);
}

// modules_to_not_convert: null or a list of names. The tensors say which modules are quantised.
void check_module_list(const Fields& p, const char* key) {
  const json* list = p.find(key);
  if (!list) return;
  if (!list->is_array()) p.fail(key, "must be a list of module names, found ", list->type_name());
  for (const json& name : *list) {
    if (!name.is_string()) p.fail(key, "must hold module names, found ", name.type_name());
  }
}

// quant_method gptq as AutoGPTQ, GPTQModel and transformers' GPTQConfig write it.
PackedInt4Quantization read_gptq(const Fields& p) {
  PackedInt4Quantization q{.packing = Int4Packing::kGptq};
  read_int4_groups(p, "gptq", &q);
  q.desc_act = p.boolean("desc_act", false);
  q.sym = p.boolean("sym", true);
  // transformers and AutoGPTQ name the layout checkpoint_format, GPTQModel also format.
  const std::optional<std::string> checkpoint_format = p.opt_string("checkpoint_format");
  const std::optional<std::string> format = p.opt_string("format");
  if (checkpoint_format && format && *checkpoint_format != *format)
    p.fail("format", "is '", *format, "' but checkpoint_format is '", *checkpoint_format, "'");
  const std::string layout = checkpoint_format.value_or(format.value_or("gptq"));
  if (layout == "gptq") {
    q.zero_minus_one = true;
  } else if (layout != "gptq_v2") {
    p.fail(checkpoint_format ? "checkpoint_format" : "format", "unsupported GPTQ layout '", layout,
           "'; supported: gptq, gptq_v2 (re-save the checkpoint in one of them)");
  }
  const std::string pack_dtype = p.opt_string("pack_dtype").value_or("int32");
  if (pack_dtype != "int32")
    p.fail("pack_dtype", "codes packed in ", pack_dtype, " are not supported; supported: int32");
  // GPTQModel's per-module overrides can change bits or groups module by module.
  if (const json* dynamic = p.find("dynamic"); dynamic && !dynamic->empty())
    p.fail("dynamic", "per-module overrides are not supported");
  check_module_list(p, "modules_to_not_convert");
  return q;
}

// quant_method awq in AutoAWQ's gemm layout (what transformers' AwqConfig calls version gemm).
PackedInt4Quantization read_awq(const Fields& p) {
  PackedInt4Quantization q{.packing = Int4Packing::kAwq};
  read_int4_groups(p, "awq", &q);
  std::string version = p.opt_string("version").value_or("gemm");
  std::transform(version.begin(), version.end(), version.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (version != "gemm")
    p.fail("version", "unsupported AWQ version '", version,
           "'; supported: gemm (the others pack the codes for their own kernels)");
  const std::string backend = p.opt_string("backend").value_or("autoawq");
  if (backend != "autoawq")
    p.fail("backend", "unsupported AWQ backend '", backend, "'; supported: autoawq");
  if (!p.boolean("zero_point", true))
    p.fail("zero_point", "is false; only AWQ with zero points (the gemm layout) is supported");
  q.sym = false;
  check_module_list(p, "modules_to_not_convert");
  return q;
}

// quantization_config: DeepSeek-V3's block-scaled fp8 (e4m3) format, GPT-OSS's MXFP4 experts,
// and GPTQ / AWQ 4-bit linears.
void read_quantization(const Fields& f, ModelConfig* cfg) {
  const json* q = f.find("quantization_config");
  if (!q) return;
  if (!q->is_object()) f.fail("quantization_config", "must be an object, found ", q->type_name());
  const Fields p(*q, f.source(), "quantization_config.");
  const std::string method = p.string("quant_method");
  if (cfg->family == ModelFamily::kGptOss) {
    if (method != "mxfp4")
      p.fail("quant_method", "unsupported quantization '", method,
             "' for gpt_oss; supported: mxfp4",
             method == "gptq" || method == "awq"
                 ? " (gptq and awq quantise one linear per expert; gpt_oss stores its experts "
                   "fused)"
                 : "");
    // Which experts are stored as blocks the binder reads from the tensors themselves, so
    // modules_to_not_convert needs no interpretation here.
    cfg->mxfp4 = true;
    return;
  }
  if (method == "gptq" || method == "awq") {
    if (cfg->family == ModelFamily::kLlama4)
      p.fail("quant_method", method, " checkpoints of ", cfg->model_type,
             " are not supported: ", method,
             " quantises one linear per expert and llama4 stores its experts fused");
    cfg->packed_int4 = method == "gptq" ? read_gptq(p) : read_awq(p);
    return;
  }
  if (method != "fp8")
    p.fail("quant_method", "unsupported quantization '", method, "'; supported: fp8, gptq, awq",
           method == "mxfp4" ? " (mxfp4 is read for gpt_oss checkpoints only)" : "");
  const std::string fmt = p.opt_string("fmt").value_or("e4m3");
  if (fmt != "e4m3") p.fail("fmt", "unsupported fp8 format '", fmt, "'; supported: e4m3");
  Fp8Quantization fp8;
  if (const json* block = p.find("weight_block_size")) {
    if (!block->is_array() || block->size() != 2)
      p.fail("weight_block_size", "must be a list of two integers");
    fp8.block_rows =
        p.check_size("weight_block_size", p.to_int("weight_block_size", (*block)[0]), kMaxDim);
    fp8.block_cols =
        p.check_size("weight_block_size", p.to_int("weight_block_size", (*block)[1]), kMaxDim);
  } else {
    p.fail("weight_block_size", "is missing; only block-scaled fp8 is supported");
  }
  cfg->fp8 = fp8;
}

}  // namespace

ModelConfig parse_model_config(std::string_view json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    MOE_FAIL(source, ": not valid JSON: ", e.what());
  }
  MOE_CHECK(root.is_object(), source, ": must be a JSON object, found ", root.type_name());
  const Fields top(root, source);

  ModelConfig cfg;
  cfg.source = source;
  cfg.model_type = top.string("model_type");
  const auto family =
      std::find_if(std::begin(kFamilies), std::end(kFamilies),
                   [&](ModelFamily fam) { return family_name(fam) == cfg.model_type; });
  if (cfg.model_type == kLlama4TextModelType) {
    cfg.family = ModelFamily::kLlama4;
  } else if (family == std::end(kFamilies)) {
    top.fail("model_type", "unsupported model_type '", cfg.model_type,
             "'; supported: ", supported_list());
  } else {
    cfg.family = *family;
  }
  const FamilyDefaults defaults = defaults_for(cfg.family);

  // Llama 4 as published (Llama4ForConditionalGeneration): the text model's fields sit in
  // text_config (absent: transformers' defaults), the vision tower's in vision_config, which is
  // not read: only the text model is loaded.
  const json empty_text_config = json::object();
  std::optional<Fields> text_fields;
  if (cfg.model_type == "llama4") {
    const json* text = top.find("text_config");
    if (text && !text->is_object())
      top.fail("text_config", "must be an object, found ", text->type_name());
    text_fields.emplace(text ? *text : empty_text_config, source, "text_config.");
    const std::string inner =
        text_fields->opt_string("model_type").value_or(std::string(kLlama4TextModelType));
    if (inner != kLlama4TextModelType)
      text_fields->fail("model_type", "must be ", kLlama4TextModelType, ", found '", inner, "'");
    cfg.has_vision_tower = top.has("vision_config");
    if (top.boolean("tie_word_embeddings", false) &&
        !text_fields->boolean("tie_word_embeddings", false))
      top.fail("tie_word_embeddings",
               "is true but text_config.tie_word_embeddings is not; only "
               "the text model's setting is read");
  }
  // Qwen3.5-MoE as published (Qwen3_5MoeForConditionalGeneration): the same, text_config
  // required; the wrapper's tie_word_embeddings ties the language model's head.
  if (cfg.model_type == "qwen3_5_moe") {
    const json* text = top.find("text_config");
    if (!text) top.fail("text_config", "is missing");
    if (!text->is_object()) top.fail("text_config", "must be an object, found ", text->type_name());
    text_fields.emplace(*text, source, "text_config.");
    const std::string inner = text_fields->opt_string("model_type").value_or("qwen3_5_moe_text");
    if (inner != "qwen3_5_moe_text")
      text_fields->fail("model_type", "must be qwen3_5_moe_text, found '", inner, "'");
    cfg.has_vision_tower = top.has("vision_config");
  }
  const Fields& f = text_fields ? *text_fields : top;

  // Shared by all four families.
  cfg.vocab_size = f.size("vocab_size", defaults.vocab_size, kMaxDim);
  cfg.hidden_size = f.size("hidden_size", defaults.hidden_size, kMaxDim);
  cfg.num_layers = f.size("num_hidden_layers", defaults.num_hidden_layers, kMaxLayers);
  cfg.num_heads = f.size("num_attention_heads", defaults.num_attention_heads, kMaxHeads);
  // An explicit null means "as many as the query heads" (mixtral, olmoe __post_init__).
  cfg.num_kv_heads = f.has("num_key_value_heads") ? f.size("num_key_value_heads", kMaxHeads)
                     : f.contains_key("num_key_value_heads")
                         ? cfg.num_heads
                         : defaults.num_key_value_heads.value_or(cfg.num_heads);
  if (cfg.num_heads % cfg.num_kv_heads != 0)
    f.fail("num_key_value_heads", cfg.num_kv_heads, " does not divide num_attention_heads (",
           cfg.num_heads, ")");
  const bool is_deepseek = cfg.family == ModelFamily::kDeepseekV2 ||
                           cfg.family == ModelFamily::kDeepseekV3 ||
                           cfg.family == ModelFamily::kKimiK2;
  if (is_deepseek) {
    // transformers sets head_dim = qk_rope_head_dim for both DeepSeek families; it sizes RoPE.
    cfg.head_dim = f.size("qk_rope_head_dim", 64, kMaxHeads);
  } else if (f.has("head_dim")) {
    cfg.head_dim = f.size("head_dim", kMaxHeads);
  } else if (defaults.head_dim) {
    cfg.head_dim = *defaults.head_dim;
  } else if (cfg.family == ModelFamily::kGptOss) {
    cfg.head_dim = 64;  // GptOssConfig's default, not hidden_size / num_attention_heads
  } else if (cfg.family == ModelFamily::kLlama4 && !f.contains_key("head_dim")) {
    cfg.head_dim = 128;  // Llama4TextConfig's default; an explicit null means hidden / heads
  } else {
    cfg.head_dim = cfg.hidden_size / cfg.num_heads;
    if (cfg.head_dim <= 0)
      f.fail("num_attention_heads", cfg.num_heads, " exceeds hidden_size (", cfg.hidden_size,
             ") and no head_dim is given");
  }
  if (cfg.head_dim % 2 != 0)
    f.fail("head_dim", "RoPE needs an even head_dim, found ", cfg.head_dim);
  // Families without dense layers (qwen3_5_moe) have no intermediate_size.
  cfg.intermediate_size = defaults.intermediate_size > 0
                              ? f.size("intermediate_size", defaults.intermediate_size, kMaxDim)
                              : 0;
  cfg.num_experts = read_num_experts(f, cfg.family, defaults.num_experts);
  if (cfg.family == ModelFamily::kErnie45Moe) {  // moe_k, aliased as num_experts_per_tok
    cfg.num_experts_per_tok =
        aliased_size(f, "moe_k", "num_experts_per_tok", defaults.num_experts_per_tok, kMaxExperts);
  } else {
    cfg.num_experts_per_tok =
        defaults.num_experts_per_tok > 0
            ? f.size("num_experts_per_tok", defaults.num_experts_per_tok, kMaxExperts)
            : f.size("num_experts_per_tok", kMaxExperts);
  }
  if (cfg.num_experts_per_tok > cfg.num_experts)
    f.fail("num_experts_per_tok", cfg.num_experts_per_tok, " exceeds the number of experts (",
           cfg.num_experts, ")");

  // GPT-OSS's experts always apply their clamped SwiGLU; its modeling code never reads hidden_act.
  const std::string act = f.opt_string("hidden_act").value_or("silu");
  if (act != "silu" && cfg.family != ModelFamily::kGptOss)
    f.fail("hidden_act", "unsupported activation '", act, "'; only silu is supported");
  cfg.rms_norm_eps = f.number("rms_norm_eps", defaults.rms_norm_eps);
  f.positive_number("rms_norm_eps", cfg.rms_norm_eps);
  cfg.max_position_embeddings =
      f.size("max_position_embeddings", defaults.max_position_embeddings, kMaxDim);
  // The vision-language wrapper's own flag ties the language model's head (Qwen3_5MoeConfig).
  cfg.tie_word_embeddings = cfg.family == ModelFamily::kQwen35Moe
                                ? top.boolean("tie_word_embeddings", false)
                                : f.boolean("tie_word_embeddings", defaults.tie_word_embeddings);
  cfg.bos_token_id =
      f.contains_key("bos_token_id") ? f.opt_integer("bos_token_id") : defaults.bos_token_id;
  if (f.contains_key("eos_token_id")) {
    cfg.eos_token_ids = f.int_or_list("eos_token_id", {});
  } else if (defaults.eos_token_id) {
    cfg.eos_token_ids = {*defaults.eos_token_id};
  }
  // Token ids are int32 wherever they are compared with sampled tokens: a wider or negative id
  // would wrap onto a real token (4294971389 stops at 4093) instead of never matching.
  const auto check_token_id = [&](const char* key, int64_t id) {
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      f.fail(key, "token id ", id, " is outside [0, ", std::numeric_limits<int32_t>::max(), "]");
  };
  for (int64_t id : cfg.eos_token_ids) check_token_id("eos_token_id", id);
  if (cfg.bos_token_id) check_token_id("bos_token_id", *cfg.bos_token_id);
  const auto declared_dtype = [](const Fields& fields) {
    return fields.opt_string("dtype").value_or(fields.opt_string("torch_dtype").value_or(""));
  };
  cfg.dtype = declared_dtype(f);
  if (cfg.dtype.empty()) cfg.dtype = declared_dtype(top);  // a nested text_config may omit it
  cfg.rope = read_rope(f, defaults, cfg.max_position_embeddings);
  if (cfg.family == ModelFamily::kGptOss) {
    const auto given = [&](const char* key) {
      const json* v = f.find(key);
      return v != nullptr && !v->empty();
    };
    if (!given("rope_scaling") && !given("rope_parameters"))
      cfg.rope = gpt_oss_default_rope(cfg.rope.theta);
  }
  if (!is_deepseek) {
    const int64_t rotary = cfg.rotary_dim();
    if (rotary <= 0 || rotary % 2 != 0)
      f.fail("partial_rotary_factor", "rotates ", rotary, " of the ", cfg.head_dim,
             " head dims; RoPE needs a positive even count");
  }

  switch (cfg.family) {
    case ModelFamily::kQwen3Moe: {
      cfg.moe_intermediate_size =
          f.size("moe_intermediate_size", defaults.moe_intermediate_size, kMaxDim);
      cfg.norm_topk_prob = f.boolean("norm_topk_prob", false);
      cfg.attention_bias = f.boolean("attention_bias", false);
      cfg.attention_out_bias = cfg.attention_bias;  // o_proj shares the flag
      cfg.qk_norm_per_head = true;
      cfg.layer_is_moe = qwen_sparse_layers(f, cfg.num_layers);
      // sliding_window only counts when use_sliding_window is set, and then on every layer.
      // Absent means the class default 4096; null means full attention.
      if (f.boolean("use_sliding_window", false) &&
          (f.has("sliding_window") || !f.contains_key("sliding_window")))
        cfg.sliding_window = f.size("sliding_window", 4096, kMaxDim);
      break;
    }
    case ModelFamily::kMixtral: {
      cfg.moe_intermediate_size = cfg.intermediate_size;  // experts use intermediate_size
      cfg.norm_topk_prob = true;  // the router always renormalises its top-k softmax weights
      if (f.has("sliding_window")) cfg.sliding_window = f.size("sliding_window");
      cfg.layer_is_moe.assign(static_cast<size_t>(cfg.num_layers), true);
      break;
    }
    case ModelFamily::kOlmoe: {
      cfg.moe_intermediate_size = cfg.intermediate_size;
      cfg.norm_topk_prob = f.boolean("norm_topk_prob", false);
      cfg.attention_bias = f.boolean("attention_bias", false);
      cfg.attention_out_bias = cfg.attention_bias;
      cfg.qk_norm_full = true;
      // q_norm spans hidden_size and k_norm (hidden_size / heads) * kv_heads, so the projection
      // widths must be exactly those.
      if (cfg.num_heads * cfg.head_dim != cfg.hidden_size)
        f.fail("head_dim", "olmoe needs num_attention_heads * head_dim == hidden_size (",
               cfg.num_heads, " * ", cfg.head_dim, " != ", cfg.hidden_size, ")");
      cfg.clip_qkv = f.opt_number("clip_qkv");
      if (cfg.clip_qkv && !(*cfg.clip_qkv > 0))
        f.fail("clip_qkv", "must be positive, found ", *cfg.clip_qkv);
      if (f.has("sliding_window"))
        f.fail("sliding_window", "sliding-window attention is not supported for olmoe");
      cfg.layer_is_moe.assign(static_cast<size_t>(cfg.num_layers), true);
      break;
    }
    case ModelFamily::kQwen2Moe: {
      cfg.moe_intermediate_size =
          f.size("moe_intermediate_size", defaults.moe_intermediate_size, kMaxDim);
      cfg.shared_expert_intermediate_size = f.size(
          "shared_expert_intermediate_size", defaults.shared_expert_intermediate_size, kMaxDim);
      cfg.norm_topk_prob = f.boolean("norm_topk_prob", false);
      cfg.attention_bias = f.boolean("qkv_bias", true);  // q/k/v only; o_proj never has a bias
      cfg.attention_out_bias = false;
      cfg.shared_expert_gated = true;
      cfg.layer_is_moe = qwen_sparse_layers(f, cfg.num_layers);
      if (f.boolean("use_sliding_window", false))
        f.fail("use_sliding_window",
               "qwen2_moe's per-layer sliding-window attention is not supported");
      if (const json* types = f.find("layer_types")) {
        if (!types->is_array()) f.fail("layer_types", "must be a list, found ", types->type_name());
        if (static_cast<int64_t>(types->size()) != cfg.num_layers)
          f.fail("layer_types", "has ", types->size(), " entries for ", cfg.num_layers, " layers");
        for (const json& t : *types)
          if (!t.is_string() || t.get<std::string>() != "full_attention")
            f.fail("layer_types", "only full_attention layers are supported, found ",
                   t.is_string() ? t.get<std::string>() : std::string(t.type_name()));
      }
      break;
    }
    case ModelFamily::kDeepseekV2:
    case ModelFamily::kDeepseekV3:
    case ModelFamily::kKimiK2:
      read_deepseek(f, defaults, &cfg);
      break;
    case ModelFamily::kGlm4Moe:
      read_glm4_moe(f, defaults, &cfg);
      break;
    case ModelFamily::kErnie45Moe:
      read_ernie4_5_moe(f, defaults, &cfg);
      break;
    case ModelFamily::kQwen3Next:
    case ModelFamily::kQwen35Moe:
      read_qwen3_next(f, defaults, &cfg);
      break;
    case ModelFamily::kGptOss:
      read_gpt_oss(f, &cfg);
      break;
    case ModelFamily::kLlama4:
      read_llama4(f, defaults, &cfg);
      break;
  }
  read_quantization(top, &cfg);
  if (cfg.fp8 && (cfg.family == ModelFamily::kQwen3Next || cfg.family == ModelFamily::kQwen35Moe))
    top.fail("quantization_config", "fp8 checkpoints of ", cfg.model_type, " are not supported");
  return cfg;
}

ModelConfig load_model_config(const std::filesystem::path& path) {
  std::error_code ec;
  const std::filesystem::path file =
      std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
  std::ifstream in(file, std::ios::binary);
  MOE_CHECK(in, file.string(), ": cannot open: ", std::strerror(errno));
  std::stringstream buffer;
  buffer << in.rdbuf();
  MOE_CHECK(!in.bad(), file.string(), ": read error");
  return parse_model_config(buffer.str(), file.string());
}

}  // namespace moeinfer
