#include "offload/parse_options.h"

#include <array>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <utility>

#include "core/error.h"

namespace moeinfer::offload {
namespace {

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The number at the start of `text` (digits with at most one point, no sign, no exponent) and
// the rest; false when there is none.
bool leading_number(std::string_view text, double* value, std::string_view* rest) {
  size_t n = 0;
  bool digits = false, point = false;
  while (n < text.size()) {
    const char c = text[n];
    if (std::isdigit(static_cast<unsigned char>(c))) {
      digits = true;
    } else if (c == '.' && !point) {
      point = true;
    } else {
      break;
    }
    ++n;
  }
  if (!digits) return false;
  *value = std::strtod(std::string(text.substr(0, n)).c_str(), nullptr);
  *rest = text.substr(n);
  return true;
}

}  // namespace

void parse_expert_budget(std::string_view text, OffloadOptions* options) {
  const std::string quoted = "--expert-budget '" + std::string(text) + "'";
  MOE_CHECK(!text.empty(),
            "--expert-budget: empty; give bytes (24GiB, 800MB, 1000000) or a "
            "percentage of the routed experts' bytes (50%)");
  MOE_CHECK(text.front() != '-', quoted, ": a budget cannot be negative");
  double value = 0.0;
  std::string_view rest;
  MOE_CHECK(leading_number(text, &value, &rest), quoted,
            ": expected a number of bytes with an optional unit, or a percentage");
  if (rest == "%") {
    MOE_CHECK(value <= 100.0, quoted, ": a percentage must be within 0 to 100%");
    options->budget_fraction = value / 100.0;
    options->budget_bytes = -1;
    return;
  }
  static constexpr std::array<std::pair<std::string_view, double>, 10> kUnits = {{
      {"", 1.0},
      {"b", 1.0},
      {"kb", 1e3},
      {"mb", 1e6},
      {"gb", 1e9},
      {"tb", 1e12},
      {"kib", 1024.0},
      {"mib", 1024.0 * 1024.0},
      {"gib", 1024.0 * 1024.0 * 1024.0},
      {"tib", 1024.0 * 1024.0 * 1024.0 * 1024.0},
  }};
  const std::string unit = lower(rest);
  for (const auto& [name, scale] : kUnits) {
    if (unit != name) continue;
    const double bytes = std::floor(value * scale);
    MOE_CHECK(bytes < 9.0e18, quoted, ": too many bytes");
    options->budget_bytes = static_cast<int64_t>(bytes);
    options->budget_fraction = -1.0;
    return;
  }
  MOE_FAIL(quoted, ": unknown unit '", rest,
           "' (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or % of the routed experts' bytes)");
}

void parse_expert_cache(std::string_view text, OffloadOptions* options) {
  const size_t colon = text.find(':');
  const std::string policy = lower(text.substr(0, colon));
  const std::string file =
      colon == std::string_view::npos ? "" : std::string(text.substr(colon + 1));
  MOE_CHECK(colon == std::string_view::npos || !file.empty(), "--expert-cache '", text,
            "': no file after the colon");
  if (policy == "lru") {
    options->policy = CachePolicy::kLru;
  } else if (policy == "lfu") {
    options->policy = CachePolicy::kLfu;
  } else if (policy == "static") {
    MOE_CHECK(!file.empty(),
              "--expert-cache static needs a routing trace: static:FILE (record "
              "one with --trace-routing FILE)");
    options->policy = CachePolicy::kStatic;
  } else {
    MOE_FAIL("--expert-cache '", text, "': expected lru, lfu or static:FILE");
  }
  options->hot_set_file = file;
}

void parse_cold_experts(std::string_view text, OffloadOptions* options) {
  const std::string mode = lower(text);
  if (mode == "gpu") {
    options->cold = ColdExperts::kGpu;
  } else if (mode == "cpu") {
    options->cold = ColdExperts::kCpu;
  } else if (mode == "auto") {
    options->cold = ColdExperts::kAuto;
  } else {
    MOE_FAIL("--cold-experts '", text, "': expected gpu, cpu or auto");
  }
}

void parse_expert_prefetch(std::string_view text, OffloadOptions* options) {
  const std::string mode = lower(text);
  if (mode == "on") {
    options->prefetch = PrefetchMode::kOn;
  } else if (mode == "off") {
    options->prefetch = PrefetchMode::kOff;
  } else if (mode == "auto") {
    options->prefetch = PrefetchMode::kAuto;
  } else {
    MOE_FAIL("--expert-prefetch '", text, "': expected on, off or auto");
  }
}

OffloadOptions parse_offload_flags(std::string_view budget, std::string_view cache,
                                   std::string_view cold, std::string_view prefetch) {
  OffloadOptions options;
  if (budget.empty()) {
    MOE_CHECK(cache.empty(), "--expert-cache ", cache,
              " needs --expert-budget (without a budget every expert is resident)");
    MOE_CHECK(cold.empty(), "--cold-experts ", cold,
              " needs --expert-budget (without a budget no expert is cold)");
    MOE_CHECK(prefetch.empty(), "--expert-prefetch ", prefetch,
              " needs --expert-budget (without a budget nothing is prefetched)");
    return options;
  }
  parse_expert_budget(budget, &options);
  if (!cache.empty()) parse_expert_cache(cache, &options);
  if (!cold.empty()) parse_cold_experts(cold, &options);
  if (!prefetch.empty()) parse_expert_prefetch(prefetch, &options);
  return options;
}

std::string format_expert_budget(int64_t bytes) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  if (bytes > 0 && bytes % kMiB == 0) return std::to_string(bytes / kMiB) + "MiB";
  return std::to_string(bytes);
}

void check_offload_model(const OffloadOptions& options, int64_t num_experts,
                         std::string_view model) {
  MOE_CHECK(!options.enabled() || num_experts > 0, "--expert-budget: ", model,
            " has no routed experts to offload (a dense model keeps every weight resident)");
}

}  // namespace moeinfer::offload
