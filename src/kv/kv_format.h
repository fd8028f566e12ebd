// The element type of the CPU KV cache's rows (--kv-dtype) and how one row is laid out in the
// pool's bytes. A row is written once, when its token is computed (encode_kv_row), and read by
// every later attention step (decode_kv_row), so the cache holds the rounded values and
// attention dequantises one row at a time into a small float buffer.
//
// Row layouts, `width` values in `groups` (widths summing to `width`):
//   f32   [width] float32, the values as computed
//   bf16  [width] bf16, round to nearest even
//   fp8   [G] float32 scales, then [width] e4m3 codes; group g's values are code * scale[g], with
//         scale[g] = amax(group g) / 448 (1 for an all-zero group). A GQA row has one group per
//         KV head; an MLA row two, its latent and its rope key, whose magnitudes differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace moeinfer {

enum class KvDType { kF32, kBF16, kFP8 };

// "f32", "bf16", "fp8".
std::string_view kv_dtype_name(KvDType dtype);
// Parses "f32", "bf16" or "fp8"; throws naming the accepted values otherwise.
KvDType parse_kv_dtype(std::string_view text);

// Bytes of one row of sum(groups) values at `dtype`, fp8's scales included; 0 for no groups.
int64_t kv_row_bytes(KvDType dtype, std::span<const int64_t> groups);

// row: [sum(groups)] floats; dst: kv_row_bytes(dtype, groups) bytes.
void encode_kv_row(KvDType dtype, std::span<const int64_t> groups, const float* row,
                   std::byte* dst);
// Values [offset, offset + count) of an encoded row into out ([count]); the range may span groups.
void decode_kv_row(KvDType dtype, std::span<const int64_t> groups, const std::byte* src,
                   int64_t offset, int64_t count, float* out);

}  // namespace moeinfer
