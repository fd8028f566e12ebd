// The GPU's routing approximations (moe_stages.h: approximate_routing, scale_logits): the
// per-token rules are backend/routing_rules.h's, which moe/routing_approx.cpp runs on the CPU,
// so equal router outputs give equal approximated routings.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"
#include "backend/routing_rules.h"

namespace moeinfer::cuda {

namespace {

constexpr int kApproxThreads = 128;

__global__ void __launch_bounds__(kApproxThreads)
    approximate_routing_kernel(const __grid_constant__ RoutingApproxParams p) {
  const int64_t token_index = static_cast<int64_t>(blockIdx.x) * kApproxThreads + threadIdx.x;
  const int64_t valid = p.num_valid_tokens ? *p.num_valid_tokens : p.num_tokens;
  if (token_index >= p.num_tokens || token_index >= valid) return;
  const routing_rules::Token token{.ids = p.topk_ids + token_index * p.top_k,
                                   .weights = p.topk_weights + token_index * p.top_k,
                                   .k = p.top_k,
                                   .dropped = static_cast<int32_t>(p.num_experts)};
  int64_t slots[kRoutingApproxMaxTopK];
  if (p.active_experts > 0 && p.active_experts < p.top_k) {
    token.keep_largest(p.active_experts, p.renorm_kept, slots);
  }
  if (p.drop_below > 0.0f) token.drop_small(p.drop_below, slots);
}

__global__ void scale_logits_kernel(float* logits, int64_t n, float factor) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    logits[i] *= factor;
  }
}

__global__ void bias_scale_logits_kernel(float* logits, const float* bias, int64_t n,
                                         int64_t width, float factor) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    logits[i] = (logits[i] + bias[i % width]) * factor;
  }
}

}  // namespace

void approximate_routing(const RoutingApproxParams& p, cudaStream_t stream) {
  MOE_CHECK(p.top_k >= 1 && p.top_k <= kRoutingApproxMaxTopK,
            "routing approximations on cuda: ", p.top_k, " experts per token is outside [1, ",
            kRoutingApproxMaxTopK, "]");
  MOE_CHECK(p.num_experts >= 1 && p.num_experts < kMaxExperts, "num_experts = ", p.num_experts,
            " is outside [1, 2^30)");
  MOE_CHECK(p.active_experts >= 0 && p.active_experts <= p.top_k,
            "active_experts = ", p.active_experts, " is outside [0, ", p.top_k, "]");
  MOE_CHECK(p.drop_below >= 0.0f && p.drop_below < 1.0f, "drop_below = ", p.drop_below,
            " is outside [0, 1)");
  MOE_CHECK(p.num_tokens >= 0 && p.num_tokens < (int64_t{1} << 31), "num_tokens = ", p.num_tokens,
            " is outside [0, 2^31)");
  if (p.num_tokens == 0) return;
  detail::check_pointer(p.topk_ids, "topk_ids");
  detail::check_pointer(p.topk_weights, "topk_weights");
  const unsigned blocks =
      static_cast<unsigned>((p.num_tokens + kApproxThreads - 1) / kApproxThreads);
  approximate_routing_kernel<<<blocks, kApproxThreads, 0, stream>>>(p);
  CUDA_CHECK(cudaGetLastError());
}

void scale_logits(float* logits, int64_t n, float factor, cudaStream_t stream) {
  MOE_CHECK(n >= 0, "scale_logits: n = ", n);
  if (n == 0 || factor == 1.0f) return;
  detail::check_pointer(logits, "logits");
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
  scale_logits_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(logits, n, factor);
  CUDA_CHECK(cudaGetLastError());
}

void bias_scale_logits(float* logits, const float* bias, int64_t rows, int64_t width, float factor,
                       cudaStream_t stream) {
  MOE_CHECK(rows >= 0 && width >= 1, "bias_scale_logits: rows = ", rows, ", width = ", width);
  const int64_t n = rows * width;
  if (n == 0) return;
  detail::check_pointer(logits, "logits");
  detail::check_pointer(bias, "bias");
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
  bias_scale_logits_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(logits, bias, n,
                                                                              width, factor);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace moeinfer::cuda
