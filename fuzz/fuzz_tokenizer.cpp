// libFuzzer target: Tokenizer::from_json on arbitrary text, then encoding a fixed string that
// exercises added tokens, whitespace, digits, punctuation and multi-byte UTF-8. A moeinfer::Error
// is the expected answer to a bad tokenizer.json; any other exception or a sanitizer report is
// a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "io/tokenizer.h"

namespace {
constexpr std::string_view kText =
    "<|im_start|>user\nHello, World!  It's 2024-06-01:\t3.14 cafe\xcc\x81 caf\xc3\xa9 "
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80 </s><s> [INST] x<|im_end|>\n";
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  try {
    const Tokenizer tokenizer =
        Tokenizer::from_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    const std::vector<int32_t> ids = tokenizer.encode(kText);
    (void)ids;
  } catch (const Error&) {
  }
  return 0;
}
