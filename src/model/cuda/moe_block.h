// The MoE layer on the GPU as one unit (../shared/DESIGN.md, "The MoE block"), the device twin
// of moe/moe_block.h: the block owns route and plan and delegates the two things that vary,
//   route -> runner.on_routed -> plan -> dispatcher.dispatch -> runner.run -> shared experts
//         -> runner.finish -> dispatcher.combine,
// to a TokenDispatcher (where the rows go: this GPU, or the ranks of expert parallelism,
// model/cuda/expert_parallel.h) and an ExpertRunner (where the experts live: resident, or a cache
// over pinned host memory under --expert-budget). Everything is enqueued on one stream and never
// synchronises with the host (except a device dispatcher's, under --ep), so a decode step's layers
// stay one CUDA graph; the hand-offs are device pointers in the typed structs below. Under --ep
// with two micro-batches each has a block of its own, driven in phases (start, run_experts,
// finish).
//
// Glossary letters: T tokens of the step (a graph bucket's padded count), K experts per token,
// E experts, Hp the padded hidden size, Ip the padded expert width.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/moe_stages.h"
#include "model/cuda/device_weights.h"
#include "model/layer_plan.h"
#include "moe/routing_approx.h"
#include "moe/stages.h"
#include "profile/profiler.h"

namespace moeinfer::gpu {

class CachedExperts;

// The profiler's marks (each may be empty): `stage` closes a stage of a layer, `expert_wait`
// closes the time the layer's compute waits for its experts (a cache's admission and demand
// copies, which the decoder reports as the cache's stall).
struct StageMarks {
  std::function<void(profile::Stage stage, int64_t layer)> stage;
  std::function<void(int64_t layer)> expert_wait;

  void close(profile::Stage s, int64_t layer) const {
    if (stage) stage(s, layer);
  }
  void close_expert_wait(int64_t layer) const {
    if (expert_wait) expert_wait(layer);
  }
};

// route + plan: what the strategies read (device memory).
struct RoutedTokens {
  const bf16* hidden = nullptr;          // [T, Hp] the layer's normed input
  const int32_t* topk_ids = nullptr;     // [T, K] (padding tokens: expert E)
  const float* topk_weights = nullptr;   // [T, K]
  const int32_t* expert_offsets = nullptr;  // [E + 2] plan over E + 1 experts (the last: padding)
  const int32_t* src_row = nullptr;      // [T*K] the assignment held at each plan row
  const int32_t* inverse = nullptr;      // [T*K] the plan row of each assignment
  int64_t num_tokens = 0;                // T
  int64_t top_k = 0;                     // K
  const int32_t* num_valid = nullptr;    // device scalar: the real tokens, rows [0, it)
  // Where the routing weights apply (MoeBlockOptions::weights): kInput (Llama 4) has the
  // dispatcher send rows already weighted and combine sum the outputs with weight 1.
  moe::WeightPlacement weights = moe::WeightPlacement::kOutput;
};

// What the experts stage reads: rows in expert order, expert e owning plan rows
// [expert_offsets[e], expert_offsets[e + 1]). With src_row the rows are gathered on the fly,
// plan row r reading rows[src_row[r] / top_k] (the local dispatcher copies nothing).
struct ExpertRows {
  const bf16* rows = nullptr;
  const int32_t* src_row = nullptr;
  int64_t top_k = 1;
  const int32_t* expert_offsets = nullptr;
  int64_t num_experts = 0;  // E
  int64_t num_rows = 0;     // M, the plan rows' upper bound (T*K)
};

// Where the rows go and how the outputs come back.
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  virtual ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens, cudaStream_t stream) = 0;
  // dispatch in two halves, for two micro-batches (GpuOptions::micro_batches): start enqueues
  // what needs no wait on the host (a device dispatcher's gather and the copy of the plan's
  // offsets), finish does the rest (the wait, the exchange); dispatch is the two in a row. A
  // local dispatcher does everything in finish.
  virtual void start_dispatch(int64_t /*layer*/, const RoutedTokens& /*tokens*/,
                              cudaStream_t /*stream*/) {}
  virtual ExpertRows finish_dispatch(int64_t layer, const RoutedTokens& tokens,
                                     cudaStream_t stream) {
    return dispatch(layer, tokens, stream);
  }
  // out[T, Hp] (float32) = shared[t] (when given) + sum_k weight[t, k] * expert_out[row of (t, k)].
  virtual void combine(int64_t layer, const bf16* expert_out, const RoutedTokens& tokens,
                       const bf16* shared, float* out, cudaStream_t stream) = 0;
  // Whether rows leave this GPU (expert parallelism, model/cuda/expert_parallel.h): the block
  // then closes the dispatch and combine stages for the profiler, and skips the experts when
  // dispatch hands this rank no rows.
  virtual bool moves_rows() const { return false; }
};

// Every row stays on this GPU: dispatch hands the experts the hidden rows with the plan's
// src_row (the gather is fused into the grouped GEMM), combine is the weighted unpermute. With
// the weights on the input (Llama 4) dispatch writes the weighted rows in plan order into
// weighted_rows instead (the weight must meet each row before the expert, so the gather cannot
// stay fused) and combine adds the outputs unweighted.
class LocalDispatcher final : public TokenDispatcher {
 public:
  // weighted_rows: [T*K, Hp] workspace for RoutedTokens::weights == kInput, else may be null.
  LocalDispatcher(int64_t num_experts, int64_t hidden_size, bf16* weighted_rows = nullptr)
      : num_experts_(num_experts), hidden_size_(hidden_size), weighted_rows_(weighted_rows) {}
  ExpertRows dispatch(int64_t layer, const RoutedTokens& tokens, cudaStream_t stream) override;
  void combine(int64_t layer, const bf16* expert_out, const RoutedTokens& tokens,
               const bf16* shared, float* out, cudaStream_t stream) override;
 private:
  int64_t num_experts_;
  int64_t hidden_size_;
  bf16* weighted_rows_;
};

// Predicts a later layer's routing from the rows at hand (the block runs that layer's router
// over them): what a cache prefetches from.
class RoutingPredictor {
 public:
  virtual ~RoutingPredictor() = default;
  // Layer `layer`'s top-k ids [T, K] for the tokens' hidden rows (padding tokens: expert E), in
  // device memory owned by the predictor.
  virtual const int32_t* predict(int64_t layer, const RoutedTokens& tokens,
                                 cudaStream_t stream) = 0;
};

// The experts' shape and activation, common to every runner.
struct ExpertShape {
  int64_t num_experts = 0;   // E
  int64_t hidden_size = 0;   // Hp
  int64_t expert_width = 0;  // Ip
  int64_t weight_terms = 1;  // 1, or 2 bf16 terms per weight (device_weights.h)
  // Quantised experts (DeviceWeights::expert_quant): their format and group, weight_terms 1.
  cuda::ExpertQuant quant = cuda::ExpertQuant::kNone;
  int64_t quant_group = 0;
  // SiLU(gate) * up, or GPT-OSS's clamped SwiGLU; the biases, if any, are DeviceLayer's.
  moe::ExpertActivation activation;
  // --deterministic: the grouped GEMM keeps to the mma.sync tiles, whose order of summation is
  // the same for every row (cuda::GroupedGemmParams::batch_invariant).
  bool batch_invariant = false;
  // cuda::MoeExpertsParams::one_row_blocks (GpuOptions::one_row_expert_blocks).
  bool one_row_blocks = false;
};

// The grouped GEMM's gated epilogue for an activation.
cuda::GemmEpilogue expert_epilogue(const moe::ExpertActivation& activation);

// Where the experts live and how they run.
class ExpertRunner {
 public:
  virtual ~ExpertRunner() = default;
  // The layer's routing, before the plan: where a cache admits the layer's experts and starts
  // the next layer's prefetch.
  virtual void on_routed(int64_t /*layer*/, const RoutedTokens& /*tokens*/,
                         RoutingPredictor& /*predictor*/, const StageMarks& /*marks*/,
                         cudaStream_t /*stream*/) {}
  // out[r] = expert(rows[r]) for every plan row r.
  virtual void run(int64_t layer, const ExpertRows& rows, bf16* out, cudaStream_t stream) = 0;
  // After run, before combine: outputs computed elsewhere (the host) joined into out.
  virtual void finish(int64_t /*layer*/, const RoutedTokens& /*tokens*/, bf16* /*out*/,
                      cudaStream_t /*stream*/) {}
  // The layer's experts as contiguous device stacks ([E, terms, 2 Ip, Hp] and [E, terms, Hp,
  // Ip]) when every one is resident, else null: what the small-batch fused path reads.
  virtual const DeviceLayer* resident(int64_t /*layer*/) const { return nullptr; }
};

// Workspace of fp8 x fp8 (cuda::MoeExpertsParams::fp8_codes), or nulls: never.
struct Fp8ActivationBuffers {
  uint8_t* codes = nullptr;  // [T*K, max(Hp, Ip)] e4m3
  float* scales = nullptr;   // [T*K, ceil(max(Hp, Ip) / 128)]
};

// Every expert of every layer in device memory, read through DeviceLayer's stacks.
class ResidentExperts final : public ExpertRunner {
 public:
  // layers: the model's, which must outlive this; activation: [T*K, Ip] workspace; fp8: where
  // fp8 routed experts may run fp8 x fp8 (prefill-sized steps), else nulls.
  ResidentExperts(std::span<const DeviceLayer> layers, const ExpertShape& shape,
                  bf16* activation, Fp8ActivationBuffers fp8 = {});
  void run(int64_t layer, const ExpertRows& rows, bf16* out, cudaStream_t stream) override;
  const DeviceLayer* resident(int64_t layer) const override { return &layers_[layer]; }

 private:
  std::span<const DeviceLayer> layers_;
  ExpertShape shape_;
  bf16* activation_;
  Fp8ActivationBuffers fp8_;
};

// --expert-budget: the experts read through the cache's slot tables (model/cuda/cached_experts.h:
// admission and demand copies when the layer is routed, the next layer's predicted experts
// prefetched on a copy stream, misses the cost model sends to the host joined before combine).
class CachedExpertRunner final : public ExpertRunner {
 public:
  // cache, the layers: must outlive this; activation: [T*K, Ip] workspace.
  CachedExpertRunner(CachedExperts& cache, std::span<const DeviceLayer> layers,
                     const ExpertShape& shape, bf16* activation);
  void on_routed(int64_t layer, const RoutedTokens& tokens, RoutingPredictor& predictor,
                 const StageMarks& marks, cudaStream_t stream) override;
  void run(int64_t layer, const ExpertRows& rows, bf16* out, cudaStream_t stream) override;
  void finish(int64_t layer, const RoutedTokens& tokens, bf16* out,
              cudaStream_t stream) override;

 private:
  CachedExperts& cache_;
  std::span<const DeviceLayer> layers_;
  ExpertShape shape_;
  bf16* activation_;
};

// One product y[rows, n] = x[rows, k] . w[n, k]^T with float32 or bf16 output: the decoder's
// (cuBLAS, or the fixed-order GEMM under --deterministic; two weight terms handled there).
using LinearFn = std::function<void(const bf16* x, int64_t rows, const bf16* w, int64_t n,
                                    int64_t k, void* y, bool f32_out)>;
// out[T, Hp] = down(silu(gate) * up) of x: the decoder's dense MLP (the shared experts).
using DenseMlpFn = std::function<void(const bf16* x, const bf16* gate_up, const bf16* down,
                                      int64_t width, int64_t num_tokens, bf16* out)>;

// Device workspace the block uses, carved by its owner for the largest step (T = max tokens).
struct MoeBlockBuffers {
  float* router_logits = nullptr;      // [T, E]
  int32_t* topk_ids = nullptr;         // [T, K] (unless the caller names others per layer)
  float* topk_weights = nullptr;       // [T, K]
  int32_t* expert_offsets = nullptr;   // [E + 2]
  int32_t* src_row = nullptr;          // [T*K]
  int32_t* inverse = nullptr;          // [T*K]
  int32_t* plan_workspace = nullptr;   // [cuda::plan_workspace_size(T*K, E + 1)] or null
  bf16* expert_out = nullptr;          // [T*K, Hp]
  bf16* shared_out = nullptr;          // [T, Hp] with shared experts
  float* shared_gate_logits = nullptr;  // [T] with gated shared experts
  // A later layer's predicted routing (RoutingPredictor), with a cache: [T, E], [T, K], [T, K].
  float* predict_logits = nullptr;
  int32_t* predict_ids = nullptr;
  float* predict_weights = nullptr;
  // The small-batch fused path (backend/cuda/small_batch_moe.h), or null: off.
  void* small_moe_workspace = nullptr;
  int64_t small_moe_rows = 0;  // T*K up to which it runs
  // Route and plan in one launch (backend/cuda/route_plan.h) for steps of at most
  // route_plan_tokens tokens: a device int32, zero before the first step, or null: off.
  int32_t* route_plan_ticket = nullptr;
  int64_t route_plan_tokens = 0;
};

struct MoeBlockOptions {
  moe::RouterOptions router;   // selection_bias is per layer (DeviceLayer)
  ExpertShape shape;
  int64_t top_k = 0;           // K
  // Where the routing weights apply: the experts' output, or their input (Llama 4; the
  // dispatcher must have a weighted_rows buffer, and the small-batch path is not taken).
  moe::WeightPlacement weights = moe::WeightPlacement::kOutput;
  // Applied in the route stage, as the CPU's MoeBlock does; any of them turns the small-batch
  // path off (its router is inside its kernel).
  moe::RoutingApproximation approx;
};

// One layer's call: where its input and outputs are.
struct MoeLayerIo {
  const bf16* hidden = nullptr;        // [T, Hp] normed input
  int64_t num_tokens = 0;              // T
  const int32_t* num_valid = nullptr;  // device scalar, or null: all T are real
  // [T] per-token keys of a synthetic uniform router (RouterParams::noise_keys), for the layers
  // whose DeviceLayer::router_noise is set; null: no noise
  const int32_t* noise_keys = nullptr;
  int32_t* topk_ids = nullptr;         // [T, K] where the router writes (null: the buffers')
  float* topk_weights = nullptr;       // [T, K]
  int32_t* expert_counts = nullptr;    // [E + 1] the plan's counts (kept for the profiler)
  float* out = nullptr;                // [T, Hp] the block's output, float32
};

class MoeBlock final : private RoutingPredictor {
 public:
  // layers: the model's, one LayerPlan each (plan_layers); both must outlive the block.
  MoeBlock(const MoeBlockOptions& options, std::span<const DeviceLayer> layers,
           std::span<const LayerPlan> plans, const MoeBlockBuffers& buffers,
           std::unique_ptr<TokenDispatcher> dispatcher, std::unique_ptr<ExpertRunner> runner,
           LinearFn linear, DenseMlpFn dense_mlp);

  // Replaces the routing approximations from the next enqueue (validated as at construction);
  // graphs captured before keep the old route stage, so their owner drops them.
  void set_approximation(const moe::RoutingApproximation& approx);

  // Enqueues layer `layer`'s whole MoE block on `stream`, closing each stage with `marks`:
  // start, run_experts and finish in a row (or the small-batch path).
  void enqueue(int64_t layer, const MoeLayerIo& io, cudaStream_t stream,
               const StageMarks& marks = {});

  // The block in three phases, for two micro-batches that alternate (each with a block of its
  // own, on a stream of its own): start = route, plan and the dispatch's first half (nothing
  // waits on the host); run_experts = the rest of the dispatch (under --ep the host waits for
  // the plan's offsets and the rows' exchange), the experts and the shared experts; finish =
  // combine (under --ep the outputs' exchange). Between the phases the block holds the layer in
  // flight; `io`'s buffers must stay untouched until finish. Never the small-batch path.
  void start(int64_t layer, const MoeLayerIo& io, cudaStream_t stream,
             const StageMarks& marks = {});
  void run_experts(cudaStream_t stream, const StageMarks& marks = {});
  void finish(cudaStream_t stream, const StageMarks& marks = {});

  // Whether enqueue's first read of io.hidden at T tokens is the router's product through the
  // LinearFn (the stage path's route stage), so that the caller may leave the rows unformed
  // until that product (the decoder folds the norm that forms them into it).
  bool reads_hidden_first_by_linear(int64_t layer, int64_t num_tokens) const;

  // The router of `layer` for one token as the persistent decode-layers kernel runs it
  // (backend/cuda/decode_layers.h: the plain one-warp top-k, experts read from the layer's
  // resident stacks, outputs weighted and summed), without its buffers and noise keys; nothing
  // where the layer needs what that kernel lacks: a cache or another GPU for its experts,
  // quantised, two-term or biased experts, another activation, shared experts, weights on the
  // input, a routing approximation, a selection bias or expert groups.
  std::optional<cuda::RouterParams> persistent_router(int64_t layer) const;

 private:
  // The router of `layer` over hidden: logits [T, E], ids and weights [T, K] (route stage).
  // noise_keys: MoeLayerIo's (the layer's own routing), or null (a prediction: a synthetic
  // uniform router's demand is then unknown, and the model's router guesses blind).
  void route(int64_t layer, const bf16* hidden, int64_t num_tokens, const int32_t* num_valid,
             const int32_t* noise_keys, float* logits, int32_t* topk_ids, float* topk_weights,
             cudaStream_t stream);
  // Whether `d`'s experts are SiLU-gated without biases and weighted on their outputs.
  bool plain_experts(const DeviceLayer& d) const;
  // Whether layer `layer` at T tokens takes the small-batch fused path.
  bool small_batch_takes(int64_t layer, int64_t num_tokens) const;
  // Whether T tokens take the fused route and plan (one launch for the route and plan stages).
  bool route_plan_takes(int64_t num_tokens) const;
  const int32_t* predict(int64_t layer, const RoutedTokens& tokens,
                         cudaStream_t stream) override;
  cuda::RouterParams router_params(int64_t layer, int64_t num_tokens, const int32_t* num_valid,
                                   const int32_t* noise_keys, const float* logits,
                                   int32_t* topk_ids, float* topk_weights) const;
  void small_batch(int64_t layer, const MoeLayerIo& io, int32_t* topk_ids, float* topk_weights,
                   cudaStream_t stream, const StageMarks& marks);
  // The shared experts' output [T, Hp] (bf16) per the layer's SharedExpertKind, or null.
  const bf16* shared_experts(int64_t layer, const bf16* hidden, int64_t num_tokens,
                             cudaStream_t stream);

  // The layer between start and finish.
  struct InFlight {
    int64_t layer = -1;  // -1: none
    RoutedTokens tokens;
    float* out = nullptr;
    ExpertRows rows;
    bool dispatched = false;  // run_experts has run
    const bf16* shared = nullptr;
    bool moves_rows = false;
  };

  MoeBlockOptions options_;
  InFlight in_flight_;
  std::span<const DeviceLayer> layers_;
  std::span<const LayerPlan> plans_;
  MoeBlockBuffers buffers_;
  std::unique_ptr<TokenDispatcher> dispatcher_;
  std::unique_ptr<ExpertRunner> runner_;
  LinearFn linear_;
  DenseMlpFn dense_mlp_;
};

}  // namespace moeinfer::gpu
