// A comma-separated list of token ids on the command line (logits --ids, tokenize --decode).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace moeinfer::cli {

// "1,2,3" as ids, each in [0, INT32_MAX]. An empty list, an empty item ("1,,2", "1,2,") or an
// item that is not a whole non-negative integer is refused with a message naming `flag`.
// Whether an id is in the vocabulary is for the model to say.
std::vector<int32_t> parse_token_ids(std::string_view text, std::string_view flag);

}  // namespace moeinfer::cli
