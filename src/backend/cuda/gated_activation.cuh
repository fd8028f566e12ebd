// The gated activations of the experts' gate/up products, one definition for every kernel that
// ends in them (the grouped GEMM's tiles, its Hopper kernel and the skinny kernel), so a value
// is the same whichever kernel the step takes. Float32 in and out; the caller rounds once.
#pragma once

namespace moeinfer::cuda::gated {

// SiLU(gate) * up, SiLU(x) = x / (1 + exp(-x)).
__device__ __forceinline__ float silu_mul(float gate, float up) {
  return gate / (1.0f + __expf(-gate)) * up;
}

// GPT-OSS's clamped SwiGLU, as moe::run_experts: g = min(gate, limit),
// u = clamp(up, -limit, limit), (u + 1) * (g / (1 + exp(-alpha g))).
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float alpha, float limit) {
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  return (u + 1.0f) * (g / (1.0f + __expf(-alpha * g)));
}

}  // namespace moeinfer::cuda::gated
