#include "model/weight_quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "io/model_config.h"
#include "model/quantized_matrix.h"
#include "model/weight_source.h"
#include "model/weights.h"

namespace moeinfer {

std::string_view weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kCheckpoint:
      return "";
    case WeightFormat::kBf16:
      return "bf16";
    case WeightFormat::kFp8:
      return "fp8";
    case WeightFormat::kInt4:
      return "int4";
  }
  return "";  // unreachable: every enumerator returns above
}

WeightFormat parse_weight_format(std::string_view text) {
  if (text.empty()) return WeightFormat::kCheckpoint;
  if (text == "bf16" || text == "bfloat16") return WeightFormat::kBf16;
  if (text == "fp8") return WeightFormat::kFp8;
  if (text == "int4") return WeightFormat::kInt4;
  MOE_FAIL("--weights ", std::string(text), ": expected bf16, fp8 or int4");
}

std::string_view weight_scope_name(WeightScope scope) {
  switch (scope) {
    case WeightScope::kExperts:
      return "experts";
    case WeightScope::kLinear:
      return "linear";
  }
  return "";  // unreachable: every enumerator returns above
}

WeightScope parse_weight_scope(std::string_view text) {
  if (text.empty() || text == "experts") return WeightScope::kExperts;
  if (text == "linear") return WeightScope::kLinear;
  MOE_FAIL("--weights-scope ", std::string(text), ": expected experts or linear");
}

void check_weight_scope(WeightFormat format, WeightScope scope) {
  if (scope == WeightScope::kExperts) return;
  MOE_CHECK(format == WeightFormat::kFp8 || format == WeightFormat::kInt4,
            "--weights-scope linear quantises every Linear weight to the format of --weights, "
            "which is ",
            format == WeightFormat::kCheckpoint
                ? std::string("not given")
                : "--weights " + std::string(weight_format_name(format)),
            "; add --weights fp8 or --weights int4 (or drop --weights-scope)");
}

void check_synthetic_weight_format(WeightFormat format, std::string_view name,
                                   bool offload_experts) {
  MOE_CHECK(format != WeightFormat::kBf16, "--weights bf16 applies to the CPU; synthetic:", name,
            " is drawn on the GPU in bf16 without it");
  MOE_CHECK(!offload_experts || (format != WeightFormat::kFp8 && format != WeightFormat::kInt4),
            "--weights ", weight_format_name(format),
            " with --expert-budget: the expert cache "
            "holds bf16 experts, and synthetic:",
            name,
            "'s quantised experts have no bf16 "
            "values; drop one of the two flags");
}

void check_weight_format(WeightFormat format, const ModelConfig& config, bool cuda) {
  MOE_CHECK(!cuda || format != WeightFormat::kBf16,
            "--weights bf16 applies to the CPU; on cuda --dtype bfloat16 holds the weights in "
            "bf16");
  if (format != WeightFormat::kFp8 && format != WeightFormat::kInt4) return;
  const std::string flag = "--weights " + std::string(weight_format_name(format));
  // Quantising values that are already a quantised format's would measure neither format.
  MOE_CHECK(!config.fp8.has_value(), flag,
            ": this checkpoint is already block-scaled fp8 (quantization_config fp8); run it "
            "without --weights, or quantise its bf16 original");
  if (const auto& packed = config.packed_int4) {
    const std::string_view method = quant_method_name(packed->packing);
    MOE_FAIL(flag, ": this checkpoint is already 4-bit ", method, " (quantization_config ", method,
             "); run it without --weights, or quantise its bf16 original");
  }
  MOE_CHECK(!config.mxfp4, flag,
            ": this checkpoint's experts are already MXFP4 (quantization_config mxfp4); run it "
            "without --weights, or quantise its bf16 original");
}

void fake_quantize_fp8_blocks(const float* w, int64_t num_rows, int64_t num_cols,
                              int64_t block_rows, int64_t block_cols, float* out, float* scales,
                              uint8_t* codes) {
  MOE_CHECK(block_rows > 0 && block_cols > 0, "fp8 blocks of ", block_rows, " x ", block_cols);
  const std::array<float, 256>& decode = f8e4m3_values();
  const int64_t scale_cols = (num_cols + block_cols - 1) / block_cols;
  for (int64_t r0 = 0; r0 < num_rows; r0 += block_rows) {
    const int64_t r1 = std::min(num_rows, r0 + block_rows);
    for (int64_t c0 = 0; c0 < num_cols; c0 += block_cols) {
      const int64_t c1 = std::min(num_cols, c0 + block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(w[r * num_cols + c]));
      }
      const float scale = f8e4m3_scale(amax);
      if (scales) scales[(r0 / block_rows) * scale_cols + c0 / block_cols] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t i = r * num_cols + c;
          const uint8_t code = f32_to_f8e4m3(w[i] / scale);
          if (codes) codes[i] = code;
          out[i] = decode[code] * scale;
        }
      }
    }
  }
}

void fake_quantize_int4_groups(const float* w, int64_t num_rows, int64_t num_cols,
                               int64_t group_size, float* out, float* scales, int32_t* zeros,
                               uint8_t* codes) {
  MOE_CHECK(group_size > 0, "int4 groups of ", group_size);
  const int64_t groups_per_row = (num_cols + group_size - 1) / group_size;
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t c0 = 0; c0 < num_cols; c0 += group_size) {
      const int64_t c1 = std::min(num_cols, c0 + group_size);
      const float* in = w + r * num_cols;
      float lo = in[c0], hi = in[c0];
      for (int64_t c = c0; c < c1; ++c) {
        lo = std::min(lo, in[c]);
        hi = std::max(hi, in[c]);
      }
      float scale;
      int32_t zero;
      if (lo == hi) {
        // A constant group: scale |c| with codes 1 - 0 (c > 0) or 0 - 1 (c < 0) is exact, where
        // (hi - lo) / 15 would leave c as 15 * (c / 15), rounded twice.
        scale = lo != 0.0f ? std::fabs(lo) : 1.0f;
        zero = lo < 0.0f ? 1 : 0;
      } else {
        // The range takes in 0 (as GPTQ's quantiser does): the zero point then lies in [0, 15]
        // and every value of the group within half a step of a code.
        lo = std::min(lo, 0.0f);
        hi = std::max(hi, 0.0f);
        scale = (hi - lo) / 15.0f;
        zero = std::clamp(static_cast<int32_t>(std::nearbyint(-lo / scale)), 0, 15);
      }
      const int64_t g = r * groups_per_row + c0 / group_size;
      if (scales) scales[g] = scale;
      if (zeros) zeros[g] = zero;
      for (int64_t c = c0; c < c1; ++c) {
        const int32_t q =
            std::clamp(static_cast<int32_t>(std::nearbyint(in[c] / scale)) + zero, 0, 15);
        if (codes) codes[r * num_cols + c] = static_cast<uint8_t>(q);
        out[r * num_cols + c] = static_cast<float>(q - zero) * scale;
      }
    }
  }
}

namespace {

// One matrix's quantised values, written to `dst` in `dtype` (bf16 or f32), and (fp8, int4) its
// codes and scales in `record` (model/quantized_matrix.h).
void quantize_matrix(WeightFormat format, const TensorView& matrix, DType dtype, void* dst,
                     QuantizedMatrix& record) {
  MOE_CHECK(matrix.shape.rank() == 2, "routed expert matrix of shape ", matrix.shape.str(),
            ": expected [N, K]");
  const int64_t rows = matrix.shape[0], cols = matrix.shape[1];
  std::vector<float> values(static_cast<size_t>(rows * cols));
  convert_to_f32(matrix.dtype, matrix.data, values.data(), values.size());
  record.rows = rows;
  record.cols = cols;
  if (format == WeightFormat::kFp8) {
    const int64_t scale_cols = (cols + kFp8BlockSize - 1) / kFp8BlockSize;
    std::vector<float> blocks(static_cast<size_t>((rows + kFp8BlockSize - 1) / kFp8BlockSize *
                                                  scale_cols));
    record.format = CodeFormat::kFp8;
    record.group = kFp8BlockSize;
    record.codes.resize(values.size());
    fake_quantize_fp8_blocks(values.data(), rows, cols, kFp8BlockSize, kFp8BlockSize,
                             values.data(), blocks.data(), record.codes.data());
    record.scales.resize(static_cast<size_t>(rows * scale_cols));
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(blocks.begin() + (r / kFp8BlockSize) * scale_cols, scale_cols,
                  record.scales.begin() + r * scale_cols);
    }
  } else if (format == WeightFormat::kInt4) {
    const int64_t groups = rows * ((cols + kInt4GroupSize - 1) / kInt4GroupSize);
    std::vector<uint8_t> codes(values.size());
    std::vector<int32_t> zeros(static_cast<size_t>(groups));
    record.format = CodeFormat::kInt4;
    record.group = kInt4GroupSize;
    record.scales.resize(static_cast<size_t>(groups));
    fake_quantize_int4_groups(values.data(), rows, cols, kInt4GroupSize, values.data(),
                              record.scales.data(), zeros.data(), codes.data());
    record.zeros.assign(zeros.begin(), zeros.end());
    record.codes.assign(static_cast<size_t>((rows * cols + 1) / 2), 0);
    for (size_t i = 0; i < codes.size(); ++i) {
      record.codes[i / 2] |= static_cast<uint8_t>(codes[i] << (4 * (i & 1)));
    }
  }
  if (dtype == DType::kF32) {
    std::copy(values.begin(), values.end(), static_cast<float*>(dst));
    return;
  }
  auto* out = static_cast<uint16_t*>(dst);
  for (size_t i = 0; i < values.size(); ++i) out[i] = f32_to_bf16(values[i]);
}

struct QuantJob {
  TensorView* view;
  DType dtype;
  void* dst;
  QuantizedMatrix record;
};

// Quantises the jobs' matrices in parallel, then points each view at its new values and records
// their codes in `source`.
void run_quant_jobs(WeightFormat format, std::vector<QuantJob>& jobs, WeightSource& source) {
  parallel_for(static_cast<int64_t>(jobs.size()), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      quantize_matrix(format, *jobs[j].view, jobs[j].dtype, jobs[j].dst, jobs[j].record);
  });
  for (QuantJob& job : jobs) {
    job.view->dtype = job.dtype;
    job.view->data = job.dst;
    if (job.record.group > 0) {
      source.quantized().add(job.dst, dtype_size(job.dtype), std::move(job.record));
    }
  }
}

}  // namespace

std::vector<TensorView*> dense_linear_views(DecoderWeights& weights) {
  std::vector<TensorView*> views;
  auto add = [&](TensorView& v) {
    if (!v.empty() && v.shape.rank() == 2 && v.shape[1] % 8 == 0) views.push_back(&v);
  };
  for (LayerWeights& layer : weights.layers) {
    AttentionWeights& a = layer.attention;
    for (TensorView* v : {&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj}) add(*v);
    MlaWeights& m = layer.mla;
    for (TensorView* v :
         {&m.q_proj, &m.q_a_proj, &m.q_b_proj, &m.kv_a_proj, &m.kv_b_proj, &m.o_proj}) {
      add(*v);
    }
    LinearAttentionWeights& lin = layer.linear_attention;
    for (TensorView* v : {&lin.in_proj_qkvz, &lin.in_proj_ba, &lin.in_proj_qkv, &lin.in_proj_z,
                          &lin.in_proj_b, &lin.in_proj_a, &lin.out_proj}) {
      add(*v);
    }
    for (MlpWeights* mlp : {&layer.mlp, &layer.moe.shared_expert}) {
      for (TensorView* v : {&mlp->gate_proj, &mlp->up_proj, &mlp->down_proj}) add(*v);
    }
  }
  return views;
}

int64_t quantize_linear_weights(WeightFormat format, DecoderWeights& weights,
                                WeightSource& source) {
  MOE_CHECK(format == WeightFormat::kFp8 || format == WeightFormat::kInt4,
            "quantize_linear_weights: --weights fp8 or int4, not '", weight_format_name(format),
            "'");
  std::vector<QuantJob> jobs;
  // A tensor bound to two views (the same data and shape) is quantised once; the second view
  // follows the first.
  std::vector<std::pair<TensorView*, TensorView*>> repeats;
  std::map<std::pair<const void*, std::string>, TensorView*> seen;
  for (TensorView* view : dense_linear_views(weights)) {
    auto [it, fresh] = seen.try_emplace({view->data, view->shape.str()}, view);
    if (!fresh) {
      repeats.emplace_back(view, it->second);
      continue;
    }
    const DType dtype = view->dtype == DType::kBF16 ? DType::kBF16 : DType::kF32;
    jobs.push_back({view, dtype, source.allocate(view->numel() * dtype_size(dtype)), {}});
  }
  run_quant_jobs(format, jobs, source);
  for (auto [view, first] : repeats) *view = *first;
  return static_cast<int64_t>(jobs.size());
}

void quantize_routed_experts(WeightFormat format, DecoderWeights& weights, WeightSource& source) {
  if (format == WeightFormat::kCheckpoint) return;
  // Buffers are taken from the source one by one (it is not thread-safe); the values in parallel.
  std::vector<QuantJob> jobs;
  for (LayerWeights& layer : weights.layers) {
    if (!layer.is_moe) continue;
    for (moe::ExpertWeights& expert : layer.moe.routed.experts) {
      for (TensorView* view : {&expert.gate, &expert.up, &expert.down}) {
        if (view->empty()) continue;
        // A bf16 checkpoint's experts stay bf16 (what its products take); others compute in f32.
        const DType dtype = format == WeightFormat::kBf16 || view->dtype == DType::kBF16
                                ? DType::kBF16
                                : DType::kF32;
        if (format == WeightFormat::kBf16 && view->dtype == DType::kBF16) continue;
        jobs.push_back({view, dtype, source.allocate(view->numel() * dtype_size(dtype)), {}});
      }
    }
  }
  run_quant_jobs(format, jobs, source);
}

}  // namespace moeinfer
