// Tensor views over memory someone else owns (a checkpoint's memory map, a workspace buffer).
// Dimension letters used across the code: T tokens, H hidden, E experts, K experts per token,
// I expert width, V vocabulary, D head dim, Nq / Nkv query and key-value heads.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace moeinfer {

class Shape {
 public:
  // 5: vision-language checkpoints (Qwen3.5) store a Conv3d patch embedding [out, in, t, h, w].
  static constexpr int kMaxRank = 5;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    MOE_CHECK(dims.size() <= kMaxRank, "rank ", dims.size(), " exceeds ", kMaxRank);
    for (int64_t d : dims) dims_[rank_++] = d;
  }
  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  void push_back(int64_t d) {
    MOE_CHECK(rank_ < kMaxRank, "rank exceeds ", kMaxRank);
    dims_[rank_++] = d;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  bool operator==(const Shape& other) const {
    if (rank_ != other.rank_) return false;
    for (int i = 0; i < rank_; ++i)
      if (dims_[i] != other.dims_[i]) return false;
    return true;
  }
  std::string str() const {
    std::string out = "[";
    for (int i = 0; i < rank_; ++i) out += (i ? ", " : "") + std::to_string(dims_[i]);
    return out + "]";
  }

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

// A read-only tensor in its stored dtype; row-major and contiguous.
struct TensorView {
  DType dtype = DType::kF32;
  Shape shape;
  const void* data = nullptr;

  bool empty() const { return data == nullptr; }
  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  // Row r of a 2-D view (or of the leading dim of any view), still in the stored dtype.
  const void* row(int64_t r) const {
    const int64_t row_elems = shape.rank() > 0 ? numel() / shape[0] : 1;
    return static_cast<const char*>(data) + r * row_elems * static_cast<int64_t>(dtype_size(dtype));
  }
  // The i-th slice along dim 0 (an expert of a stacked [E, ...] tensor), one rank lower.
  TensorView slice0(int64_t i) const {
    TensorView out{.dtype = dtype, .data = row(i)};
    for (int d = 1; d < shape.rank(); ++d) out.shape.push_back(shape[d]);
    return out;
  }
};

}  // namespace moeinfer
