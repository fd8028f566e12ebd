#include "model/quantized_matrix.h"

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer {

const char* code_format_name(CodeFormat format) {
  switch (format) {
    case CodeFormat::kFp8:
      return "fp8";
    case CodeFormat::kInt4:
      return "int4";
    case CodeFormat::kMxfp4:
      return "mxfp4";
  }
  return "";  // unreachable: every enumerator returns above
}

float e2m1_value(uint32_t code) {
  static constexpr float kValues[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValues[code & 0xfu];
}

float QuantizedMatrix::value(int64_t r, int64_t c) const {
  const uint32_t q = code(r, c);
  switch (format) {
    case CodeFormat::kFp8:
      return f8e4m3_to_f32(static_cast<uint8_t>(q)) * scales[r * groups_per_row() + c / group];
    case CodeFormat::kInt4: {
      const int64_t g = r * groups_per_row() + c / group;
      return (static_cast<float>(q) - zeros[g]) * scales[g];
    }
    case CodeFormat::kMxfp4:
      return std::ldexp(e2m1_value(q), static_cast<int>(exponents[r * (cols / 32) + c / 32]) - 127);
  }
  return 0.0f;  // unreachable: every enumerator returns above
}

void QuantizedMatrices::add(const void* data, size_t elem_bytes, QuantizedMatrix matrix) {
  MOE_CHECK(data != nullptr && matrix.rows > 0 && matrix.cols > 0 && matrix.group > 0,
            "a quantised matrix record of ", matrix.rows, " x ", matrix.cols, " in groups of ",
            matrix.group);
  entries_[static_cast<const char*>(data)] =
      Entry{.elem_bytes = elem_bytes, .matrix = std::move(matrix)};
}

const QuantizedMatrix* QuantizedMatrices::find(const TensorView& view, int64_t* first_row) const {
  if (view.empty() || view.shape.rank() != 2 || entries_.empty()) return nullptr;
  const auto* at = static_cast<const char*>(view.data);
  auto it = entries_.upper_bound(at);
  if (it == entries_.begin()) return nullptr;
  --it;
  const Entry& entry = it->second;
  const QuantizedMatrix& m = entry.matrix;
  const size_t row_bytes = static_cast<size_t>(m.cols) * entry.elem_bytes;
  const auto offset = static_cast<size_t>(at - it->first);
  if (offset % row_bytes != 0 || dtype_size(view.dtype) != entry.elem_bytes ||
      view.shape[1] != m.cols) {
    return nullptr;
  }
  const auto row = static_cast<int64_t>(offset / row_bytes);
  if (row + view.shape[0] > m.rows) return nullptr;
  *first_row = row;
  return &m;
}

}  // namespace moeinfer
