// Host interface of the CUDA MoE-stage kernels: route (fused router + top-k), plan (counting
// sort of the assignments by expert), dispatch (permute), unpermute (weighted combine with the
// shared experts and the residual) and the residual-fused RMSNorm that precedes the block.
//
// Each launcher takes one params struct of raw device pointers and a stream, checks the sizes,
// pointers and alignment on the host (throwing moeinfer::Error that names the offending value),
// then enqueues its kernels and returns: nothing here synchronises with the host or reads
// device memory back, so every launcher can be captured into a CUDA graph. Counts and offsets
// stay on the device; grids are sized from the host-known worst case (T*K rows).
//
// The semantics are those of the CPU reference in moe/stages.h (the backend does not include
// it: dependencies point downward), and the tests hold the kernels to it exactly for ids and
// plans and to a bf16 rounding for values.
//
// Layouts (glossary letters: T tokens, E experts, K experts per token, H hidden):
//   logits        [T, E]    float32 router logits
//   topk_ids      [T, K]    int32, best first, ties to the lower expert id
//   topk_weights  [T, K]    float32
//   expert_counts [E]       int32 assignments per expert
//   expert_offsets[E + 1]   int32 exclusive prefix sum of the counts
//   src_row       [T*K]     int32 assignment t*K + k held at each sorted row
//   inverse       [T*K]     int32 sorted row of assignment t*K + k
//   hidden, rows  [T, H], [T*K, H]   bf16, rows 16-byte aligned (H a multiple of 8)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace moeinfer::cuda {

using bf16 = __nv_bfloat16;

enum class RouterScore : int32_t {
  kSoftmax,
  kSigmoid,
  // GPT-OSS (moe::ScoreFunction::kTopkSoftmax): the top-k of the (biased) logits themselves,
  // weighted by a softmax over those k logits; renormalize changes nothing.
  kTopkSoftmax,
};

// Group-limited routing (DeepSeek), as moe::GroupScore: the E experts form num_groups equal
// groups of consecutive ids, each group gets a score from its biased expert scores, and only the
// topk_groups best groups (ties to the lower group id) stay eligible for the top-k.
enum class RouterGroupScore : int32_t {
  kNone,     // no grouping; num_groups and topk_groups are ignored
  kMax,      // DeepSeek-V2 group_limited_greedy: the group's best expert score
  kTop2Sum,  // DeepSeek-V3 noaux_tc: the sum of the group's two best expert scores
};

// Expert ids are int32 and the plan sorts over E + 1 experts (the null expert E takes the
// padding rows), with block-strided loops over E: 2^30 keeps all of it inside int32. The
// logits of one token alone would be 4 GiB there, so memory binds first.
inline constexpr int64_t kMaxExperts = int64_t{1} << 30;
// The range of the one-warp-per-token router (router_kernel.cuh), the fast path; the block
// router (router_block_kernel.cuh) takes every other E and K.
inline constexpr int64_t kRouterWarpMaxExperts = 1024;  // 32 per lane: the pick mask is 32 bits
inline constexpr int64_t kRouterWarpMaxTopK = 32;       // lane k keeps the k-th pick
// The RMSNorm kernel keeps a row in registers up to this (1024 threads x 4 vectors of 8);
// longer rows are read twice instead.
inline constexpr int64_t kRmsNormMaxHidden = 32768;

// How the register kernel lays out a row of `vecs` 8-value vectors (vecs <= kRmsNormMaxHidden / 8):
// `threads` threads (a multiple of 32, at most 1024), thread t holding vectors t + j * threads
// for j < groups. Its sum of squares runs in that order (each thread's vectors in j order, then
// a block_sum), which is what a kernel that forms the same rows must repeat to get the same bits.
struct RmsNormLayout {
  int groups = 1;
  int threads = 32;
};
MOE_HOST_DEVICE RmsNormLayout rms_norm_layout(int64_t vecs) {
  const int groups = vecs <= 1024 ? 1 : vecs <= 2048 ? 2 : 4;
  const int64_t per_thread = (vecs + groups - 1) / groups;
  const int64_t threads = (per_thread + 31) / 32 * 32;
  return {groups, static_cast<int>(threads < 32 ? 32 : threads)};
}

struct RouterParams {
  const float* logits = nullptr;  // [T, E]
  int32_t* topk_ids = nullptr;    // [T, K]
  float* topk_weights = nullptr;  // [T, K]
  int64_t num_tokens = 0;         // T
  int64_t num_experts = 0;        // E, 1..kMaxExperts
  int64_t top_k = 0;              // K, 1..E
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = false;  // divide the K weights by their sum
  float routed_scaling_factor = 1.0f;
  // [E] added to the logits before the score function, or null: GPT-OSS's router bias, or the
  // synthetic models' routing skew.
  const float* logit_bias = nullptr;
  // [E] DeepSeek-V3 e_score_correction_bias, or null: added to the scores that choose the groups
  // and the experts; the weights come from the unbiased scores.
  const float* selection_bias = nullptr;
  RouterGroupScore group_score = RouterGroupScore::kNone;
  int64_t num_groups = 1;   // divides E
  int64_t topk_groups = 1;  // 1..num_groups, and topk_groups * E / num_groups >= K
  // Device scalar, or null: tokens at or past it pad a CUDA-graph bucket and get expert id E (a
  // null expert, which a plan over E + 1 experts sorts last and the expert GEMMs never read)
  // and weight 0, so they add no rows to any expert.
  const int32_t* num_valid_tokens = nullptr;
  // [T] one key per token, or null. Set: the logit of (token t, expert e) is not read but
  // replaced by router_noise(noise_seed, noise_keys[t], e), a uniform value in (0, 1) (the
  // synthetic models' `--routing-skew uniform`: each token's top-k a uniformly random k-subset,
  // independent across keys and seeds). With a logit_bias the noise is Gumbel noise instead,
  // router_gumbel(router_noise(...)), and the bias is added to it (`--routing-skew zipf:A`: the
  // top k of bias + Gumbel are k experts drawn without replacement with probabilities
  // proportional to exp(bias)). Everything after the score function is unchanged. Padding tokens
  // (past num_valid_tokens) never read their key.
  const int32_t* noise_keys = nullptr;
  uint64_t noise_seed = 0;
};

// The router noise: splitmix64's finaliser over the seed and (key, expert), its top 23 bits
// mapped to the midpoints (i + 0.5) / 2^23, so the value is exact in float32 and strictly
// inside (0, 1). Host and device compute the same bits (the tests rebuild the picks on the host).
__host__ __device__ inline uint64_t router_noise_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__host__ __device__ inline float router_noise(uint64_t seed, int32_t key, int64_t expert) {
  const uint64_t token = router_noise_mix(
      seed ^ (static_cast<uint64_t>(static_cast<uint32_t>(key)) * 0x9E3779B97F4A7C15ull));
  const uint64_t h = router_noise_mix(token ^ static_cast<uint64_t>(expert));
  return (static_cast<float>(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

// Standard Gumbel noise from a uniform value in (0, 1): -log(-log(u)). Adding it to logits and
// taking the top k draws k experts without replacement with probabilities proportional to
// exp(logit) (the Gumbel-top-k trick).
__host__ __device__ inline float router_gumbel(float u) { return -logf(-logf(u)); }

// route, as moe::route(): score = softmax or sigmoid of (logits + logit_bias) (kTopkSoftmax:
// the biased logits themselves), the logits replaced by router_noise when noise_keys is set;
// choice = score + selection_bias; with grouping, the experts outside the topk_groups best
// groups by group score of `choice` get choice -inf; top-k by choice (ties to the lower expert
// id); weight = score * ((renormalize ? 1 / (sum of the K picked scores + 1e-20) : 1) *
// routed_scaling_factor), the sum taken in pick order; kTopkSoftmax: weight = exp(score - the
// picks' max) / (their sum in pick order) * routed_scaling_factor.
// E <= kRouterWarpMaxExperts and K <= kRouterWarpMaxTopK: one warp per token, the plain case
// (no selection_bias, no grouping) in a kernel without the shared-memory group step, anything
// else in the general one. Past that range: one block per token (router_block_kernel.cuh), the
// same picks and the same float32 operations per score.
void fused_router(const RouterParams& params, cudaStream_t stream);

// The routing approximations that drop assignments (moe/routing_approx.h: --active-experts with
// --renorm, --drop-below), applied in place to fused_router's output, one thread per token, by
// the rules the CPU runs (backend/routing_rules.h): keep the active_experts largest
// weights (ties: earlier pick), rescaled to the sum before when renorm_kept; then drop every
// weight under drop_below of the token's sum but its largest, the rest rescaled to that sum. A
// dropped assignment becomes the null expert E with weight 0 (plan gives it no row, unpermute
// skips it). Tokens at or past *num_valid_tokens (graph padding) are left as they are.
inline constexpr int64_t kRoutingApproxMaxTopK = 64;
struct RoutingApproxParams {
  int32_t* topk_ids = nullptr;      // [T, K]
  float* topk_weights = nullptr;    // [T, K]
  int64_t num_tokens = 0;           // T
  int64_t top_k = 0;                // K, 1..kRoutingApproxMaxTopK
  int64_t num_experts = 0;          // E: the null expert's id
  const int32_t* num_valid_tokens = nullptr;  // device scalar, or null: all T
  int64_t active_experts = 0;       // K' in [1, K]; 0 or K: off
  bool renorm_kept = true;          // --renorm kept (else full)
  float drop_below = 0.0f;          // in [0, 1); 0: off
};
void approximate_routing(const RoutingApproxParams& params, cudaStream_t stream);

// logits [n] *= factor (--router-temperature T: factor 1 / T, as moe::apply_temperature).
void scale_logits(float* logits, int64_t n, float factor, cudaStream_t stream);
// logits [rows, width] = (logits + bias[width]) * factor: a router's logit bias joined before
// the temperature, as the CPU's router product adds it (GPT-OSS under --router-temperature).
void bias_scale_logits(float* logits, const float* bias, int64_t rows, int64_t width, float factor,
                       cudaStream_t stream);

namespace detail {
// fused_router's checks of the sizes and options (not the pointers), for the kernels that route
// inside themselves.
void check_router_params(const RouterParams& params);
}  // namespace detail

struct PlanParams {
  const int32_t* topk_ids = nullptr;  // [T*K], each in [0, E)
  int32_t* expert_counts = nullptr;   // [E]
  int32_t* expert_offsets = nullptr;  // [E + 1]
  int32_t* src_row = nullptr;         // [T*K]
  int32_t* inverse = nullptr;         // [T*K]
  int32_t* workspace = nullptr;       // [plan_workspace_size(T*K, E)] scratch, or null when 0
  int64_t num_assignments = 0;        // T*K
  int64_t num_experts = 0;            // E
};

// Up to this many assignments the plan is one kernel of one block; above it, a counting
// kernel writes per-block histograms to the workspace and a second kernel scatters. Both keep
// per-warp histograms in shared memory (96 KB a block), which holds one warp's row, the offsets
// and the earlier blocks' counts up to E = kPlanMaxSharedExperts; past it the plan keeps its
// histograms in the workspace instead, whatever the number of assignments, and sorts in five
// kernels.
inline constexpr int64_t kPlanSingleBlockMax = 2048;
inline constexpr int64_t kPlanMaxSharedExperts = 8181;

// int32 elements of scratch moe_plan() needs for up to this many assignments and experts (0
// when the single-block path serves them): a workspace sized for a step's largest count serves
// every smaller one.
int64_t plan_workspace_size(int64_t num_assignments, int64_t num_experts);

// plan: stable counting sort of the assignments by expert id, E in [1, kMaxExperts]. An expert
// id out of range traps on the device (the next CUDA call on the stream fails).
void moe_plan(const PlanParams& params, cudaStream_t stream);

struct PermuteParams {
  const bf16* hidden = nullptr;      // [T, H]
  const int32_t* inverse = nullptr;  // [T*K] sorted row of assignment t*K + k
  bf16* rows = nullptr;              // [T*K, H] expert order
  int64_t num_tokens = 0;            // T
  int64_t top_k = 0;                 // K
  int64_t hidden_size = 0;           // H, a multiple of 8
  // [T, K] or null. Given (routing weights on the experts' input, Llama 4): each copy is
  // bf16(float(hidden[t]) * topk_weights[t, k]), one rounding, and a weight of 0 (padding
  // tokens) writes a zero row.
  const float* topk_weights = nullptr;
};

// dispatch on one device: rows[inverse[t*K+k]] = hidden[t], i.e. rows[r] = hidden[src_row[r]/K]
// (times the row's routing weight when topk_weights is given).
// Token-major: each hidden row is read once and written to its K rows, so the bytes moved are
// the floor (T*H read, T*K*H written) even when hidden is larger than L2.
void permute(const PermuteParams& params, cudaStream_t stream);

// The expert-ordered rows from the token rows through the plan's src_row (expert-major; what
// the grouped GEMM's src_row gather does inside its A-tile load, written out for a GEMM that
// loads whole tiles, kHopperWgmma): rows[r] = hidden[src_row[r] / K].
struct GatherRowsParams {
  const bf16* hidden = nullptr;       // [T, H]
  const int32_t* src_row = nullptr;   // [M] the plan's assignment t*K + k of each row
  bf16* rows = nullptr;               // [M, H] expert order
  int64_t num_rows = 0;               // M = T*K
  int64_t top_k = 0;                  // K
  int64_t hidden_size = 0;            // H, a multiple of 8
};
void gather_rows(const GatherRowsParams& params, cudaStream_t stream);

struct UnpermuteParams {
  const bf16* expert_out = nullptr;     // [T*K, H] expert order
  const float* topk_weights = nullptr;  // [T, K]
  const int32_t* inverse = nullptr;     // [T*K]
  const bf16* shared = nullptr;         // [T, H] shared experts' output, or null
  const float* residual = nullptr;      // [T, H] added last, or null
  float* out = nullptr;                 // [T, H]; may alias residual
  int64_t num_tokens = 0;               // T
  int64_t top_k = 0;                    // K >= 1
  int64_t hidden_size = 0;              // H, a multiple of 8
  // The experts' inputs were already weighted (PermuteParams::topk_weights, Llama 4): each
  // assignment of non-zero weight adds its row with weight 1; weight 0 still skips the row.
  bool weights_on_input = false;
};

// unpermute: out[t] = (shared[t] + sum_k w[t,k] * expert_out[inverse[t*K+k]]) + residual[t],
// accumulated in float32 in that order and written in float32 (the block output joins the
// float32 residual stream unrounded). An assignment of weight 0 adds nothing and its row is not
// read (the padding tokens' rows are never computed).
void unpermute(const UnpermuteParams& params, cudaStream_t stream);

// The residual stream and the block outputs that join it are float32: rounding the stream to
// bf16 after every add was the largest single source of the GPU's distance from the float32
// reference on deep or sharply routed models (bench/RESULTS.md, 2026-12-02).
struct RmsNormParams {
  const float* x = nullptr;         // [T, H] a block's output, or null
  const bf16* x_bias = nullptr;     // [H] added to x (the block's output bias), or null
  const float* residual = nullptr;  // [T, H] or null; x or residual must be given
  float* residual_out = nullptr;    // [T, H] or null; may alias residual or x
  const bf16* weight = nullptr;     // [H]
  const bf16* weight_lo = nullptr;  // [H] the weight's second bf16 term (float32 checkpoints),
                                    // or null
  bf16* out = nullptr;              // [T, H]
  int64_t num_rows = 0;             // T
  int64_t hidden_size = 0;          // H, a multiple of 8
  float eps = 1e-6f;
  // Divisor of the mean, in [1, hidden_size]; 0: hidden_size. The sum of squares runs over all
  // hidden_size columns, so columns past mean_width (a hidden state padded to the GEMM tiles)
  // must be zero in x, x_bias and residual to leave it unchanged; zero weights keep them zero
  // in out.
  int64_t mean_width = 0;
};

// RMSNorm fused with the residual add, in float32: s = x + x_bias + residual (the terms given),
// residual_out = s, out = bf16(weight * (s / sqrt(sum(s^2) / mean_width + eps))), weight taken
// as weight + weight_lo in float32 when weight_lo is given.
void fused_add_rms_norm(const RmsNormParams& params, cudaStream_t stream);

}  // namespace moeinfer::cuda
