// Launcher of the Hopper prefill attention (attention_prefill_wgmma_kernel.cuh). Built for
// sm_90a only (src/CMakeLists.txt compiles backend/cuda/sm90/ alone with that target): builds
// the three TMA tensor maps on the host and launches one CTA per (query head, 128-query tile,
// sequence). Two instantiations: D = 64 and 128.
#include "backend/cuda/attention_prefill_wgmma.h"
#include "backend/cuda/attention_prefill_wgmma_kernel.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/sm90/tensor_map.h"

namespace moeinfer::cuda {

namespace {

template <int D>
void launch(const PrefillParams& p, cudaStream_t stream) {
  using Cfg = attn_wgmma::Config<D>;
  static const bool attribute_set = [] {
    CUDA_CHECK(cudaFuncSetAttribute(prefill_attention_wgmma_kernel<D>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    return true;
  }();
  (void)attribute_set;
  attn_wgmma::Params kp;
  kp.q_map = wgmma::tensor_map(p.q, p.num_q_heads * D, p.num_tokens, attn_wgmma::kBM, "q");
  kp.k_map = wgmma::tensor_map(p.k, p.num_kv_heads * D, p.num_tokens, attn_wgmma::kBN, "k");
  kp.v_map = wgmma::tensor_map(p.v, p.num_kv_heads * D, p.num_tokens, attn_wgmma::kBN, "v");
  kp.cu_seqlens = p.cu_seqlens;
  kp.out = p.out;
  kp.num_q_heads = static_cast<int32_t>(p.num_q_heads);
  kp.group = static_cast<int32_t>(p.num_q_heads / p.num_kv_heads);
  kp.scale_log2 = p.scale * 1.4426950408889634f;
  const dim3 grid(static_cast<unsigned>(p.num_q_heads),
                  static_cast<unsigned>((p.max_seq_len + attn_wgmma::kBM - 1) / attn_wgmma::kBM),
                  static_cast<unsigned>(p.num_seqs));
  prefill_attention_wgmma_kernel<D><<<grid, attn_wgmma::kThreads, Cfg::kSmemBytes, stream>>>(kp);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void prefill_attention_wgmma(const PrefillParams& p, cudaStream_t stream) {
  if (p.head_dim == 64) {
    launch<64>(p, stream);
  } else {
    launch<128>(p, stream);
  }
}

}  // namespace moeinfer::cuda
