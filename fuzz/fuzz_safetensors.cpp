// libFuzzer target: parse_safetensors_header on arbitrary bytes (a whole "file" in memory).
// A moeinfer::Error is the expected answer to a bad file; any other exception, a sanitizer
// report, or an accepted header that breaks the documented invariants is a bug.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moeinfer;
  try {
    uint64_t data_offset = 0;
    const std::vector<TensorEntry> entries =
        parse_safetensors_header(data, size, "fuzz", &data_offset);
    if (data_offset < 8 || data_offset > size) __builtin_trap();
    const uint64_t data_size = size - data_offset;
    uint64_t last_end = 0;
    for (const TensorEntry& e : entries) {
      if (e.begin > e.end || e.end > data_size) __builtin_trap();
      const uint64_t nbytes = static_cast<uint64_t>(e.shape.numel()) * dtype_size(e.dtype);
      if (e.end - e.begin != nbytes) __builtin_trap();
      if (e.begin != e.end) {
        if (e.begin < last_end) __builtin_trap();  // entries come back in data order
        last_end = e.end;
      }
      // Read the first and last byte, as a consumer would: ASan checks they are in bounds.
      if (e.begin != e.end) {
        volatile uint8_t first = data[data_offset + e.begin];
        volatile uint8_t last = data[data_offset + e.end - 1];
        (void)first;
        (void)last;
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
