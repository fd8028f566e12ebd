#include "model/packed_int4.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace moeinfer {

namespace {

// The code of weight (n, k): GPTQ packs input 8i + j into nibble j of qweight[i, n], AWQ packs
// along the outputs as it packs its zeros.
uint32_t weight_code(const PackedInt4Linear& linear, Int4Packing packing, int64_t n, int64_t k) {
  const int64_t N = linear.num_rows;
  if (packing == Int4Packing::kAwq)
    return output_code(linear.qweight[k * (N / 8) + n / 8], n, packing);
  const auto word = static_cast<uint32_t>(linear.qweight[(k / 8) * N + n]);
  return (word >> (4 * (k % 8))) & 0xfu;
}

}  // namespace

void dequantize_packed_int4(const PackedInt4Linear& linear, Int4Packing packing,
                            bool zero_minus_one, uint16_t* out_bf16) {
  const int64_t N = linear.num_rows, K = linear.num_cols;
  const float offset = zero_minus_one ? 1.0f : 0.0f;
  parallel_for(
      N,
      [&](int64_t begin, int64_t end) {
        // Inputs outer and the chunk's outputs inner: GPTQ's words for neighbouring outputs are
        // neighbours in memory.
        for (int64_t k = 0; k < K; ++k) {
          const int64_t g = linear.g_idx ? linear.g_idx[k] : k / linear.group_size;
          const int32_t* zeros = linear.qzeros + g * (N / 8);
          const float* scales = linear.scales + g * N;
          for (int64_t n = begin; n < end; ++n) {
            const float zero = static_cast<float>(output_code(zeros[n / 8], n, packing)) + offset;
            const float q = static_cast<float>(weight_code(linear, packing, n, k));
            out_bf16[n * K + k] = f32_to_bf16((q - zero) * scales[n]);
          }
        }
      },
      16);
}

bool packed_int4_groups_contiguous(const int32_t* g_idx, int64_t num_cols, int64_t group_size) {
  if (g_idx == nullptr) return true;
  for (int64_t k = 0; k < num_cols; ++k) {
    if (g_idx[k] != k / group_size) return false;
  }
  return true;
}

QuantizedMatrix packed_int4_codes(const PackedInt4Linear& linear, Int4Packing packing,
                                  bool zero_minus_one) {
  const int64_t N = linear.num_rows, K = linear.num_cols, G = (K + linear.group_size - 1) /
                                                                 linear.group_size;
  MOE_CHECK(packed_int4_groups_contiguous(linear.g_idx, K, linear.group_size) && K % 2 == 0,
            "int4 codes need contiguous groups (no act-order) and an even row of ", K, " inputs");
  QuantizedMatrix out{.format = CodeFormat::kInt4, .rows = N, .cols = K,
                      .group = linear.group_size};
  out.codes.assign(static_cast<size_t>(N * K / 2), 0);
  out.scales.resize(static_cast<size_t>(N * G));
  out.zeros.resize(static_cast<size_t>(N * G));
  const float offset = zero_minus_one ? 1.0f : 0.0f;
  parallel_for(
      N,
      [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
          for (int64_t g = 0; g < G; ++g) {
            const int32_t* zeros = linear.qzeros + g * (N / 8);
            out.zeros[n * G + g] = static_cast<float>(output_code(zeros[n / 8], n, packing)) +
                                   offset;
            out.scales[n * G + g] = linear.scales[g * N + n];
          }
          for (int64_t k = 0; k < K; ++k) {
            out.codes[(n * K + k) / 2] |=
                static_cast<uint8_t>(weight_code(linear, packing, n, k) << (4 * (k & 1)));
          }
        }
      },
      16);
  return out;
}

}  // namespace moeinfer
