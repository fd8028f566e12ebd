// The command line's spelling of OffloadOptions (offload_options.h), shared by every subcommand
// that runs a model and by `moeinfer plan`, which prints a budget in the same spelling.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "offload/offload_options.h"

namespace moeinfer::offload {

// --expert-budget: "50%" or "12.5%" (of all routed experts' bytes, 0 to 100), or bytes:
// "1000000", "800MB", "1.5GB" (powers of 1000), "24GiB", "512MiB" (powers of 1024); units
// B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, in any case. Sets budget_bytes or budget_fraction;
// throws moeinfer::Error naming the text for anything else (empty, negative, over 100%, an
// unknown unit).
void parse_expert_budget(std::string_view text, OffloadOptions* options);

// --expert-cache: "lru", "lfu" or "static:FILE" (FILE a routing trace whose busiest experts
// are the hot set); "lru:FILE" and "lfu:FILE" warm the cache up from such a trace. Sets policy
// and hot_set_file.
void parse_expert_cache(std::string_view text, OffloadOptions* options);

// --cold-experts: "gpu" (a miss is copied in), "cpu" (its rows are computed on the host) or
// "auto" (per miss, by the measured cost of each). Sets cold.
void parse_cold_experts(std::string_view text, OffloadOptions* options);

// --expert-prefetch: "on", "off" or "auto". Sets prefetch.
void parse_expert_prefetch(std::string_view text, OffloadOptions* options);

// The four flags at once; an empty budget leaves offloading off (then the others must be left at
// their defaults, else it is an error: without a budget they mean nothing).
OffloadOptions parse_offload_flags(std::string_view budget, std::string_view cache,
                                   std::string_view cold = {}, std::string_view prefetch = {});

// The budget as --expert-budget spells it: whole MiB when it is a multiple, else bytes.
std::string format_expert_budget(int64_t bytes);

// Refuses a budget for a model without routed experts; `model` names it in the error.
void check_offload_model(const OffloadOptions& options, int64_t num_experts,
                         std::string_view model);

}  // namespace moeinfer::offload
