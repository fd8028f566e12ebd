// How expert parallelism's dispatch puts token rows on the wire (--dispatch-dtype). A row of H
// float32 values is encoded into a fixed number of bytes before it is sent and decoded back to
// float32 by the receiver before the experts run:
//   f32   the values as they are, 4 bytes each: the outputs are those of one process
//   bf16  each value rounded to the nearest bfloat16 (ties to even), 2 bytes each; the error is
//         at most half a bf16 ulp, |x| * 2^-8
//   fp8   one float32 scale s = amax(|row|) / 448 (1 for a row of zeros), then each x / s as
//         float8_e4m3fn rounded to nearest even, 1 byte each: [4 + H] bytes. The error is at most
//         |x| * 2^-4 (normal range) or s * 2^-10 (the subnormals below s * 2^-6)
// Non-finite values are not meant to travel: NaN stays NaN, an infinity does not survive fp8.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moeinfer::moe {

enum class DispatchDtype : uint8_t { kF32, kBF16, kFp8 };

// "f32", "bf16", "fp8": the values of --dispatch-dtype.
std::string_view dispatch_dtype_name(DispatchDtype dtype);
// Parses a --dispatch-dtype value; throws moeinfer::Error naming the flag and the accepted values.
DispatchDtype parse_dispatch_dtype(std::string_view text);

// Bytes one encoded row of H values takes.
int64_t encoded_row_bytes(DispatchDtype dtype, int64_t H);
// row [H] float32 -> out [encoded_row_bytes(dtype, H)] bytes (no alignment needed).
void encode_row(DispatchDtype dtype, const float* row, int64_t H, std::byte* out);
// in [encoded_row_bytes(dtype, H)] bytes -> row [H] float32.
void decode_row(DispatchDtype dtype, const std::byte* in, int64_t H, float* row);

}  // namespace moeinfer::moe
