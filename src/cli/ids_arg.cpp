#include "cli/ids_arg.h"

#include <charconv>
#include <string>

#include "core/error.h"

namespace moeinfer::cli {

std::vector<int32_t> parse_token_ids(std::string_view text, std::string_view flag) {
  MOE_CHECK(!text.empty(), flag, ": no token ids given");
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (true) {  // every item up to the end, the one after a trailing comma too
    const size_t end = std::min(text.find(',', pos), text.size());
    const std::string_view item = text.substr(pos, end - pos);
    int32_t value = -1;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    MOE_CHECK(!item.empty() && ec == std::errc() && ptr == item.data() + item.size() && value >= 0,
              flag, ": '", std::string(item), "' is not a token id (an integer in [0, 2^31 - 1])");
    ids.push_back(value);
    if (end == text.size()) break;
    pos = end + 1;
  }
  return ids;
}

}  // namespace moeinfer::cli
