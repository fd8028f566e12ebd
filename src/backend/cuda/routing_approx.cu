// The GPU's routing approximations (moe_stages.h: approximate_routing, scale_logits), the same
// float32 operations in the same order as moe/routing_approx.cpp, so that equal router outputs
// give equal approximated routings.
#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/moe_stages.h"

namespace moeinfer::cuda {

namespace {

constexpr int kApproxThreads = 128;

struct TokenRouting {
  int32_t* ids;
  float* weights;
  int k;
  int32_t null_expert;

  __device__ bool live(int i) const { return ids[i] != null_expert; }
  __device__ float live_sum() const {
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) {
      if (live(i)) sum += weights[i];
    }
    return sum;
  }
  __device__ void rescale(float target) const {
    const float sum = live_sum();
    if (sum <= 0.0f) return;
    const float scale = target / sum;
    for (int i = 0; i < k; ++i) {
      if (live(i)) weights[i] *= scale;
    }
  }
  __device__ void drop(int i) const {
    ids[i] = null_expert;
    weights[i] = 0.0f;
  }
  // The live slots by weight, largest first, equal weights in pick order (a stable insertion
  // sort, as std::stable_sort orders them); returns how many.
  __device__ int by_weight(int (&slots)[kRoutingApproxMaxTopK]) const {
    int n = 0;
    for (int i = 0; i < k; ++i) {
      if (!live(i)) continue;
      int j = n++;
      while (j > 0 && weights[slots[j - 1]] < weights[i]) {
        slots[j] = slots[j - 1];
        --j;
      }
      slots[j] = i;
    }
    return n;
  }
};

__global__ void __launch_bounds__(kApproxThreads)
    approximate_routing_kernel(const __grid_constant__ RoutingApproxParams p) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kApproxThreads + threadIdx.x;
  const int64_t valid = p.num_valid_tokens ? *p.num_valid_tokens : p.num_tokens;
  if (token >= p.num_tokens || token >= valid) return;
  const int K = static_cast<int>(p.top_k);
  const TokenRouting r{p.topk_ids + token * K, p.topk_weights + token * K, K,
                       static_cast<int32_t>(p.num_experts)};
  int slots[kRoutingApproxMaxTopK];
  if (p.active_experts > 0 && p.active_experts < K) {
    const float before = r.live_sum();
    const int n = r.by_weight(slots);
    for (int i = static_cast<int>(p.active_experts); i < n; ++i) r.drop(slots[i]);
    if (p.renorm_kept) r.rescale(before);
  }
  if (p.drop_below > 0.0f) {
    const float before = r.live_sum();
    if (before <= 0.0f) return;
    const int n = r.by_weight(slots);
    bool dropped = false;
    for (int i = 1; i < n; ++i) {  // slots[0], the largest weight, always stays
      if (r.weights[slots[i]] / before < p.drop_below) {
        r.drop(slots[i]);
        dropped = true;
      }
    }
    if (dropped) r.rescale(before);
  }
}

__global__ void scale_logits_kernel(float* logits, int64_t n, float factor) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    logits[i] *= factor;
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

}  // namespace moeinfer::cuda
