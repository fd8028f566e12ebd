// The forward pass shared by every family: embedding, then per layer
//   x += attention(rms_norm(x)); x += moe_or_mlp(rms_norm(x)),
// then the final norm and the LM head. Family quirks arrive as ModelConfig flags and as
// optional tensors in DecoderWeights.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "io/model_config.h"
#include "kv/kv_cache.h"
#include "model/layer_plan.h"
#include "model/rope.h"
#include "model/weights.h"
#include "moe/cached_experts.h"
#include "moe/moe_block.h"
#include "moe/row_codec.h"
#include "offload/offload_options.h"
#include "parallel/communicator.h"
#include "parallel/placement.h"

namespace moeinfer {

// The attention softmax scale: 1/sqrt(query-key dim), and for MLA under yarn the squared mscale
// of mscale_all_dim (the DeepSeek recipe).
float attention_softmax_scale(const ModelConfig& config);

// The checks every forward pass makes of a batch, on any device: each sequence has tokens, ids
// in the vocabulary, positions within `max_len`, and a block table that covers them with block
// ids inside a pool of `num_blocks` blocks of `block_size`. Throws moeinfer::Error naming the
// sequence and the value.
void check_forward_batch(const ForwardBatch& batch, int64_t vocab_size, int64_t max_len,
                         int64_t num_blocks, int64_t block_size);

// The pool layout of a model: no key/value rows for linear-attention layers, and their recurrent
// state for `num_state_slots` sequences (none for a model without such layers), rows stored at
// `dtype` with one fp8 scale per KV head (MLA: per latent and rope key; kv_row_groups).
KvPoolLayout kv_pool_layout(const ModelConfig& config, int64_t num_state_slots,
                            KvDType dtype = KvDType::kF32);

class Decoder {
 public:
  Decoder(const ModelConfig& config, DecoderWeights weights);

  const ModelConfig& config() const { return config_; }
  const DecoderWeights& weights() const { return weights_; }

  // One sequence's cache of rows stored at `dtype` (--kv-dtype; f32 as computed).
  KvCache make_cache(int64_t max_tokens, KvDType dtype = KvDType::kF32) const;
  // A shared pool for batched steps: `num_blocks` blocks of `block_size` rows, and recurrent
  // state slots for `num_state_slots` sequences where the model has linear-attention layers.
  KvBlockPool make_pool(int64_t block_size, int64_t num_blocks, int64_t num_state_slots,
                        KvDType dtype = KvDType::kF32) const;

  // Expert offloading (--expert-budget, --expert-cache) with a simulated budget: the MoE
  // layers' experts run behind a cache of as many slots as the budget holds
  // (moe/cached_experts.h), warmed up from options.hot_set_file when one is given (the static
  // policy's hot set). max_step_tokens: the most tokens one decode step carries, which sizes
  // the static policy's streaming slots (offload::static_reserve_slots). Disabled options put
  // every expert back in place. Outputs are the same at every budget. Throws for a model
  // without routed experts and for a trace that does not match the model.
  void set_offload(const offload::OffloadOptions& options, int64_t max_step_tokens = 1);
  // The cache and its counters, or null when every expert is resident.
  const moe::CachedExperts* cached_experts() const { return cached_experts_; }

  // Expert parallelism (--ep N, moe/expert_parallel.h): the routed experts are sharded over the
  // ranks of `comm` by `placement` (default: contiguous ranges, no replicas) and every MoE
  // layer's rows travel to their expert's ranks and back; each rank runs its own tokens through
  // attention. Every rank must call forward() the same number of times. Null puts every expert
  // back in this process. With offloading (set_offload, either order) each rank's cache holds
  // the experts it is placed, under a budget of their bytes; not with micro_batches 2 (refused).
  // With `overlap` (--overlap
  // on) the shared experts run while the dispatch's rows are in flight, else before dispatch.
  // `dispatch_dtype` (--dispatch-dtype) encodes the rows dispatch sends (moe/row_codec.h);
  // anything but f32 needs comm.
  // `micro_batches` (--micro-batches 1|2, 2 needs comm): with 2 each step's sequences are split
  // in two micro-batches (the first half and the rest, either possibly empty) that alternate per
  // layer, so that one's rows or outputs travel while the other runs attention and experts:
  //   attention(A), route(A), start dispatch(A); attention(B), route(B), start dispatch(B);
  //   experts(A), start combine(A); experts(B), start combine(B); finish(A); finish(B).
  // The routing observer then sees each MoE layer twice a step, A's tokens and then B's.
  void set_expert_parallel(parallel::Communicator* comm,
                           std::optional<parallel::ExpertPlacement> placement = std::nullopt,
                           bool overlap = true,
                           moe::DispatchDtype dispatch_dtype = moe::DispatchDtype::kF32,
                           int micro_batches = 1);
  // Routing approximations (--active-experts, --drop-below, --expert-capacity,
  // --router-temperature; moe/routing_approx.h) in every MoE layer's route stage from the next
  // forward on; default options turn them off. Checked against the model's router (K' <= K);
  // a model without routed experts takes only the defaults.
  void set_routing_approximation(const moe::RoutingApproximation& approx);
  const moe::RoutingApproximation& routing_approximation() const { return routing_approx_; }
  // The decoder layers with routed experts, ascending.
  std::vector<int64_t> moe_layers() const;
  const parallel::Communicator* expert_parallel() const { return ep_; }

  // Called after every MoE layer's route stage with the layer index and its decisions; used by
  // expert-load reports and routing traces. Off (empty) by default.
  using RoutingObserver = std::function<void(int64_t layer, const moe::Routing& routing)>;
  void set_routing_observer(RoutingObserver observer) { routing_observer_ = std::move(observer); }
  // Called in every MoE layer between route and plan with the router logits [T, E]; it may
  // change the routing (a test replaying another device's choices). Off (empty) by default.
  using RoutingOverride =
      std::function<void(int64_t layer, const float* logits, const moe::RouterOptions& options,
                         moe::Routing& routing)>;
  void set_routing_override(RoutingOverride override_fn) {
    routing_override_ = std::move(override_fn);
  }

  // Runs tokens [T] at positions cache.length() .. + T - 1 and appends them to the cache.
  // logits: [T, V] when all_positions, else [1, V] for the last token.
  void forward(std::span<const int32_t> tokens, KvCache& cache, std::span<float> logits,
               bool all_positions);

  // One step for several sequences at once: every sequence's new tokens run through the layers
  // together (so each expert sees the rows of all sequences), each attending over its own blocks
  // in `pool`. logits: one row per sequence that wants logits (its last token), or with
  // batch.all_positions one row per new token of those sequences, in batch order. Under expert
  // parallelism the batch may be empty (no sequences, no logits): the rank then only serves the
  // other ranks' rows in every MoE layer.
  void forward(const ForwardBatch& batch, KvBlockPool& pool, std::span<float> logits);
  // Rows of logits that forward(batch, ...) writes.
  static int64_t num_logit_rows(const ForwardBatch& batch);

 private:
  // Small per-layer parameters (norm weights, biases) converted once to float32.
  struct LayerParams {
    std::vector<float> input_norm, post_attention_norm;
    std::vector<float> q_bias, k_bias, v_bias, o_bias, q_norm, k_norm;
    std::vector<float> q_a_norm, kv_a_norm;  // MLA
    std::vector<float> selection_bias;       // [E] DeepSeek-V3 router bias
    // Gated DeltaNet.
    std::vector<float> conv;         // [conv_dim, conv_kernel]
    std::vector<float> neg_decay;    // [Nv] -exp(A_log)
    std::vector<float> dt_bias;      // [Nv]
    std::vector<float> gated_norm;   // [Dv]
    std::vector<float> sinks;        // [Nq] GPT-OSS attention sinks
    std::vector<float> router_bias;  // [E] GPT-OSS router logit bias
  };
  // The layer's router as the MoE block takes it.
  moe::LayerRouter layer_router(int64_t layer) const;
  // Where each of the step's token rows belongs.
  struct TokenSlots {
    std::vector<int32_t> sequence;  // [T] index into the batch
    std::vector<int64_t> position;  // [T] absolute position in its sequence
  };
  // Buffers reused across steps, one set per micro-batch.
  struct Workspace {
    TokenSlots slots;
    std::vector<float> x, normed, q, k, v, attn, block_out, shared, gate, up;
    std::vector<float> q_lora, latent, q_latent, o_latent, head_out;  // MLA
    std::vector<float> gate_logits;                                   // attention output gate
    std::vector<float> qkvz, ba, mixed, conv_out, z, b, a, core;      // Gated DeltaNet
  };

  // Where the cache row of `position` in sequence `s` of the batch lives in the pool.
  struct CacheSlot {
    int64_t block = 0, slot = 0;
  };
  static CacheSlot cache_slot(const KvBlockPool& pool, const SequenceBatch& s, int64_t position);

  // The step's token rows of `batch` laid out in ws (slots, embedded x); returns T.
  int64_t lay_out(const ForwardBatch& batch, Workspace& ws) const;
  // x += attention(rms_norm(x)), then ws.normed = the post-attention norm of x.
  void attention_block(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool, int64_t T,
                       Workspace& ws);
  // The final norm and LM head of the rows that want logits.
  void lm_head(const ForwardBatch& batch, Workspace& ws, std::span<float> logits);
  // forward with --micro-batches 2 (set_expert_parallel).
  void forward_micro_batches(const ForwardBatch& batch, KvBlockPool& pool, std::span<float> logits);
  // The MoE layer's start phase over ws.normed on `block` (its later phases: MoeBlock).
  void start_moe(int64_t layer, int64_t T, Workspace& ws, moe::MoeBlock& block);
  moe::RouteAdjust route_adjust(int64_t layer) const;
  void observe_routing(int64_t layer, const moe::Routing& routing) const;

  void attention(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool, Workspace& ws);
  // MLA in the absorbed form: the cache holds [latent | rope key] per token, the query is
  // projected into the latent space and attention output is lifted back per head, so no full
  // per-head key or value is ever built.
  void mla_attention(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool, Workspace& ws);
  // Gated DeltaNet: conv over [q | k | v] and the delta-rule recurrence, token by token within
  // each sequence from the state in its slot, then the gated norm and out_proj.
  void linear_attention(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool, Workspace& ws);
  void feed_forward(int64_t layer, int64_t num_tokens, Workspace& ws);
  // The layer's shared experts over ws.normed into ws.shared (gated where the model gates
  // them); null when the layer has none.
  const float* shared_experts(int64_t layer, int64_t num_tokens, Workspace& ws);
  void dense_mlp(const MlpWeights& mlp, int64_t num_tokens, const float* in, float* out,
                 Workspace& ws);

  ModelConfig config_;
  DecoderWeights weights_;
  Rope rope_;
  float attention_scale_;
  std::vector<LayerParams> params_;
  std::vector<float> final_norm_;
  std::vector<LayerPlan> plans_;
  // Builds moe_block_ over `runner`.
  void make_moe_block(std::unique_ptr<moe::ExpertRunner> runner);
  // Every layer's routed experts (empty spans for dense layers).
  std::vector<std::span<const moe::ExpertWeights>> routed_experts() const;
  // Every layer's routed experts computed in place, with the config's activation.
  std::unique_ptr<moe::ExpertRunner> resident_experts() const;
  // What runs the experts under the current offload and expert-parallel settings: the resident
  // experts, or a cache over the experts this rank holds (sets cached_experts_).
  std::unique_ptr<moe::ExpertRunner> expert_runner();
  // Under --ep: held[l][e] = 1 for the experts of MoE layer l this rank holds.
  std::vector<std::vector<uint8_t>> held_experts() const;

  std::unique_ptr<moe::MoeBlock> moe_block_;            // null without MoE layers
  moe::CachedExperts* cached_experts_ = nullptr;        // moe_block_'s runner when offloading
  offload::OffloadOptions offload_;                     // set_offload's
  int64_t offload_step_tokens_ = 1;                     // set_offload's max_step_tokens
  std::vector<int32_t> offload_ranking_;  // the hot-set trace's ranking, read once by set_offload
  std::optional<parallel::ExpertPlacement> placement_;  // ep_'s, when given
  parallel::Communicator* ep_ = nullptr;                // moe_block_'s dispatcher's, under --ep
  moe::DispatchDtype dispatch_dtype_ = moe::DispatchDtype::kF32;  // its rows' encoding
  moe::SharedSchedule shared_schedule_ = moe::SharedSchedule::kBeforeDispatch;
  moe::RoutingApproximation routing_approx_;    // moe_block_'s
  std::unique_ptr<moe::MoeBlock> moe_block_b_;  // micro-batch B's, with --micro-batches 2
  int micro_batches_ = 1;
  std::array<Workspace, 2> workspaces_;  // [0]: the step's, or micro-batch A's; [1]: B's
  RoutingObserver routing_observer_;
  RoutingOverride routing_override_;
};

}  // namespace moeinfer
