#include "io/generation_config.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace moeinfer {
namespace {

using json = nlohmann::json;

// A number field, or nothing when absent or null; `lo`/`hi` bound it (inclusive).
std::optional<double> number(const json& body, const char* key, const std::string& source,
                             double lo, double hi) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  MOE_CHECK(it->is_number(), source, ": '", key, "' must be a number, got ", it->dump());
  const double v = it->get<double>();
  MOE_CHECK(std::isfinite(v) && v >= lo && v <= hi, source, ": '", key, "' must be in [", lo, ", ",
            hi, "], got ", it->dump());
  return v;
}

std::optional<int64_t> integer(const json& body, const char* key, const std::string& source,
                               int64_t lo) {
  const std::optional<double> v = number(body, key, source, static_cast<double>(lo), 9e15);
  if (!v) return std::nullopt;
  MOE_CHECK(*v == std::floor(*v), source, ": '", key, "' must be an integer, got ", *v);
  return static_cast<int64_t>(*v);
}

}  // namespace

std::string GenerationDefaults::describe() const {
  if (empty()) return "none";
  std::ostringstream out;
  const char* sep = "";
  const auto put = [&](const char* name, const auto& value) {
    if (!value) return;
    out << sep << name << "=" << *value;
    sep = " ";
  };
  put("temperature", temperature);
  put("top_p", top_p);
  put("top_k", top_k);
  put("min_p", min_p);
  put("repetition_penalty", repetition_penalty);
  put("max_tokens", max_tokens);
  return out.str();
}

GenerationDefaults GenerationDefaults::parse(const std::string& text, const std::string& source) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {
    MOE_CHECK(false, source, " is not valid JSON: ", e.what());
  }
  MOE_CHECK(body.is_object(), source, " must hold a JSON object");
  GenerationDefaults d;
  // transformers' GenerationConfig defaults, which to_diff_dict() leaves out.
  if (auto v = number(body, "temperature", source, 0.0, 1e6); v && *v != 1.0) d.temperature = *v;
  if (auto v = number(body, "top_p", source, 0.0, 1.0); v && *v != 1.0) {
    MOE_CHECK(*v > 0.0, source, ": 'top_p' must be in (0, 1], got ", *v);
    d.top_p = static_cast<float>(*v);
  }
  if (auto v = integer(body, "top_k", source, 0); v && *v != 50) d.top_k = *v;
  if (auto v = number(body, "min_p", source, 0.0, 1.0)) d.min_p = static_cast<float>(*v);
  if (auto v = number(body, "repetition_penalty", source, 0.0, 1e6); v && *v != 1.0) {
    MOE_CHECK(*v > 0.0, source, ": 'repetition_penalty' must be > 0, got ", *v);
    d.repetition_penalty = static_cast<float>(*v);
  }
  if (auto v = integer(body, "max_new_tokens", source, 1)) d.max_tokens = *v;
  return d;
}

GenerationDefaults GenerationDefaults::load(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "generation_config.json";
  if (dir.empty() || !std::filesystem::exists(path)) return {};
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in, "cannot read ", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return parse(text.str(), path.string());
}

}  // namespace moeinfer
