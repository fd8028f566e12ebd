#include "model/cuda/moe_block.h"

#include <utility>

#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/route_plan.h"
#include "backend/cuda/small_batch_moe.h"
#include "core/error.h"
#include "model/cuda/cached_experts.h"

namespace moeinfer::gpu {
namespace {

cuda::RouterScore device_score(moe::ScoreFunction score) {
  switch (score) {
    case moe::ScoreFunction::kSoftmax:
      return cuda::RouterScore::kSoftmax;
    case moe::ScoreFunction::kSigmoid:
      return cuda::RouterScore::kSigmoid;
    case moe::ScoreFunction::kTopkSoftmax:
      return cuda::RouterScore::kTopkSoftmax;
  }
  MOE_FAIL("unknown router score function ", static_cast<int>(score));
}

}  // namespace

cuda::GemmEpilogue expert_epilogue(const moe::ExpertActivation& activation) {
  switch (activation.kind) {
    case moe::ActivationKind::kSiluGlu:
      return cuda::GemmEpilogue::kSiluMul;
    case moe::ActivationKind::kClampedSwiglu:
      return cuda::GemmEpilogue::kClampedSwiglu;
  }
  MOE_FAIL("unknown expert activation ", static_cast<int>(activation.kind));
}

ExpertRows LocalDispatcher::dispatch(int64_t /*layer*/, const RoutedTokens& tokens,
                                     cudaStream_t stream) {
  // Plan over E + 1 experts: the padding tokens' assignments sort last, past every real expert.
  switch (tokens.weights) {
    case moe::WeightPlacement::kOutput:
      break;
    case moe::WeightPlacement::kInput:
      // Each plan row weighted before its expert, as the CPU's dispatch (moe::permute): the
      // padding tokens' weight 0 leaves their rows zero.
      MOE_CHECK(weighted_rows_ != nullptr,
                "routing weights on the experts' input need the dispatcher's weighted_rows");
      cuda::permute({.hidden = tokens.hidden, .inverse = tokens.inverse, .rows = weighted_rows_,
                     .num_tokens = tokens.num_tokens, .top_k = tokens.top_k,
                     .hidden_size = hidden_size_, .topk_weights = tokens.topk_weights},
                    stream);
      return {.rows = weighted_rows_,
              .src_row = nullptr,
              .top_k = 1,
              .expert_offsets = tokens.expert_offsets,
              .num_experts = num_experts_,
              .num_rows = tokens.num_tokens * tokens.top_k};
  }
  return {.rows = tokens.hidden,
          .src_row = tokens.src_row,
          .top_k = tokens.top_k,
          .expert_offsets = tokens.expert_offsets,
          .num_experts = num_experts_,
          .num_rows = tokens.num_tokens * tokens.top_k};
}

void LocalDispatcher::combine(int64_t /*layer*/, const bf16* expert_out,
                              const RoutedTokens& tokens, const bf16* shared, float* out,
                              cudaStream_t stream) {
  cuda::unpermute({.expert_out = expert_out, .topk_weights = tokens.topk_weights,
                   .inverse = tokens.inverse, .shared = shared, .out = out,
                   .num_tokens = tokens.num_tokens, .top_k = tokens.top_k,
                   .hidden_size = hidden_size_,
                   .weights_on_input = tokens.weights == moe::WeightPlacement::kInput},
                  stream);
}

namespace {

// The experts stage over `rows` as both runners run it, less the weights: the shape, the rows and
// where the activation and the output go.
cuda::MoeExpertsParams experts_stage(const ExpertShape& shape, const ExpertRows& rows,
                                     bf16* activation, bf16* out) {
  return {.rows = rows.rows,
          .weight_terms = shape.weight_terms,
          .expert_offsets = rows.expert_offsets,
          .activation = activation,
          .out = out,
          .num_rows = rows.num_rows,
          .num_experts = shape.num_experts,
          .hidden_size = shape.hidden_size,
          .expert_width = shape.expert_width,
          .src_row = rows.src_row,
          .top_k = rows.top_k,
          .batch_invariant = shape.batch_invariant,
          .one_row_blocks = shape.one_row_blocks};
}

}  // namespace

ResidentExperts::ResidentExperts(std::span<const DeviceLayer> layers, const ExpertShape& shape,
                                 bf16* activation, Fp8ActivationBuffers fp8)
    : layers_(layers), shape_(shape), activation_(activation), fp8_(fp8) {}

void ResidentExperts::run(int64_t layer, const ExpertRows& rows, bf16* out, cudaStream_t stream) {
  const DeviceLayer& d = layers_[layer];
  cuda::MoeExpertsParams p = experts_stage(shape_, rows, activation_, out);
  p.gate_up = d.experts_gate_up;
  p.down = d.experts_down;
  p.quant = shape_.quant;
  p.quant_group = shape_.quant_group;
  p.gate_up_bias = d.experts_gate_up_bias;
  p.down_bias = d.experts_down_bias;
  p.gate_up_epilogue = expert_epilogue(shape_.activation);
  p.swiglu_alpha = shape_.activation.alpha;
  p.swiglu_limit = shape_.activation.limit;
  p.fp8_codes = fp8_.codes;
  p.fp8_scales = fp8_.scales;
  cuda::moe_experts(p, stream);
}

CachedExpertRunner::CachedExpertRunner(CachedExperts& cache, std::span<const DeviceLayer> layers,
                                       const ExpertShape& shape, bf16* activation)
    : cache_(cache), layers_(layers), shape_(shape), activation_(activation) {}

void CachedExpertRunner::on_routed(int64_t layer, const RoutedTokens& tokens,
                                   RoutingPredictor& predictor, const StageMarks& marks,
                                   cudaStream_t stream) {
  // The prefetch for this layer (issued at the previous one) reads the predictor's ids, which
  // this layer's prediction rewrites: it must be done first.
  cache_.join(stream);
  const int64_t next = layer + 1;
  const bool predict = next < static_cast<int64_t>(layers_.size()) && layers_[next].is_moe &&
                       cache_.prefetches();
  // The prediction runs before the demand's copies so that its router reads the rows before
  // anything else is queued; the prefetch then starts as soon as the demand is placed.
  const int32_t* predicted =
      predict ? predictor.predict(next, tokens, stream) : nullptr;
  marks.close(profile::Stage::kRoute, layer);  // the prediction is routing work
  const int64_t A = tokens.num_tokens * tokens.top_k;
  cache_.admit(layer, tokens.topk_ids, A, tokens.hidden, tokens.num_tokens, stream);
  marks.close_expert_wait(layer);  // the admission and the demand copies: the layer waits
  if (predict) cache_.prefetch(next, predicted, A, stream);
}

void CachedExpertRunner::run(int64_t layer, const ExpertRows& rows, bf16* out,
                             cudaStream_t stream) {
  cuda::MoeExpertsParams p = experts_stage(shape_, rows, activation_, out);
  p.gate_up_table = cache_.gate_up_table(layer);
  p.down_table = cache_.down_table(layer);
  cuda::moe_experts(p, stream);
}

void CachedExpertRunner::finish(int64_t layer, const RoutedTokens& tokens, bf16* out,
                                cudaStream_t stream) {
  cache_.merge_host_rows(layer, tokens.topk_ids, tokens.inverse, out,
                         tokens.num_tokens * tokens.top_k, stream);
}

MoeBlock::MoeBlock(const MoeBlockOptions& options, std::span<const DeviceLayer> layers,
                   std::span<const LayerPlan> plans, const MoeBlockBuffers& buffers,
                   std::unique_ptr<TokenDispatcher> dispatcher,
                   std::unique_ptr<ExpertRunner> runner, LinearFn linear, DenseMlpFn dense_mlp)
    : options_(options),
      layers_(layers),
      plans_(plans),
      buffers_(buffers),
      dispatcher_(std::move(dispatcher)),
      runner_(std::move(runner)),
      linear_(std::move(linear)),
      dense_mlp_(std::move(dense_mlp)) {
  MOE_CHECK(layers_.size() == plans_.size(), "the MoE block has ", layers_.size(),
            " layers and ", plans_.size(), " layer plans");
  MOE_CHECK(dispatcher_ && runner_ && linear_ && dense_mlp_,
            "the MoE block needs a dispatcher, an expert runner and the decoder's products");
  MOE_CHECK(options_.top_k >= 1 && options_.top_k <= options_.shape.num_experts, "top_k ",
            options_.top_k, " must be in [1, ", options_.shape.num_experts, "]");
  set_approximation(options_.approx);
}

void MoeBlock::set_approximation(const moe::RoutingApproximation& approx) {
  moe::validate(approx, options_.router);
  moe::check_routing_device(approx, /*cuda=*/true);
  MOE_CHECK(!approx.drops() || options_.top_k <= cuda::kRoutingApproxMaxTopK,
            approx.flags().front(), " on cuda takes up to ", cuda::kRoutingApproxMaxTopK,
            " experts per token; this model routes ", options_.top_k);
  options_.approx = approx;
}

cuda::RouterParams MoeBlock::router_params(int64_t layer, int64_t T, const int32_t* num_valid,
                                           const int32_t* noise_keys, const float* logits,
                                           int32_t* topk_ids, float* topk_weights) const {
  const DeviceLayer& d = layers_[layer];
  const moe::RouterOptions& r = options_.router;
  cuda::RouterParams p{.logits = logits, .topk_ids = topk_ids, .topk_weights = topk_weights,
                       .num_tokens = T, .num_experts = options_.shape.num_experts,
                       .top_k = options_.top_k,
                       .score = device_score(r.score),
                       .renormalize = r.renormalize,
                       .routed_scaling_factor = r.routed_scaling_factor};
  p.selection_bias = d.selection_bias;
  // A checkpoint's router bias (GPT-OSS), or a synthetic Zipf skew (a synthetic model's router
  // bias is all zeros, so the skew's bias stands for both).
  p.logit_bias = d.logit_bias != nullptr ? d.logit_bias : d.router_bias;
  p.group_score = r.group_score == moe::GroupScore::kMax       ? cuda::RouterGroupScore::kMax
                  : r.group_score == moe::GroupScore::kTop2Sum ? cuda::RouterGroupScore::kTop2Sum
                                                               : cuda::RouterGroupScore::kNone;
  p.num_groups = r.num_groups;
  p.topk_groups = r.topk_groups;
  p.num_valid_tokens = num_valid;
  if (d.router_noise && noise_keys != nullptr) {
    p.noise_keys = noise_keys;
    p.noise_seed = d.router_noise_seed;
  }
  return p;
}

void MoeBlock::route(int64_t layer, const bf16* hidden, int64_t T, const int32_t* num_valid,
                     const int32_t* noise_keys, float* logits, int32_t* topk_ids,
                     float* topk_weights, cudaStream_t stream) {
  const ExpertShape& s = options_.shape;
  linear_(hidden, T, layers_[layer].router, s.num_experts, s.hidden_size, logits,
          /*f32_out=*/true);
  const moe::RoutingApproximation& approx = options_.approx;
  const float inverse_temperature = static_cast<float>(1.0 / approx.router_temperature);
  cuda::RouterParams params =
      router_params(layer, T, num_valid, noise_keys, logits, topk_ids, topk_weights);
  const float* router_bias = layers_[layer].router_bias;
  if (router_bias != nullptr && inverse_temperature != 1.0f && params.logit_bias == router_bias) {
    // The CPU adds the router's bias in its product, before the temperature: (logits + bias) / T
    // here, and the router adds nothing more. At T = 1 the router's own addition is that sum.
    cuda::bias_scale_logits(logits, router_bias, T, s.num_experts, inverse_temperature, stream);
    params.logit_bias = nullptr;
  } else {
    // As moe::apply_temperature: the logits times the temperature's inverse, in float32.
    cuda::scale_logits(logits, T * s.num_experts, inverse_temperature, stream);
  }
  cuda::fused_router(params, stream);
  if (approx.active_experts != 0 || approx.drop_below != 0.0) {
    cuda::approximate_routing({.topk_ids = topk_ids, .topk_weights = topk_weights,
                               .num_tokens = T, .top_k = options_.top_k,
                               .num_experts = s.num_experts, .num_valid_tokens = num_valid,
                               .active_experts = approx.active_experts,
                               .renorm_kept = approx.renorm == moe::KeptRenorm::kKept,
                               .drop_below = static_cast<float>(approx.drop_below)},
                              stream);
  }
}

const int32_t* MoeBlock::predict(int64_t layer, const RoutedTokens& tokens,
                                 cudaStream_t stream) {
  MOE_CHECK(buffers_.predict_logits && buffers_.predict_ids && buffers_.predict_weights,
            "the MoE block has no buffers for a predicted routing");
  // Without the noise keys: under a synthetic uniform router the model's own router guesses.
  route(layer, tokens.hidden, tokens.num_tokens, tokens.num_valid, /*noise_keys=*/nullptr,
        buffers_.predict_logits, buffers_.predict_ids, buffers_.predict_weights, stream);
  return buffers_.predict_ids;
}

// SiLU-gated experts without biases, their outputs weighted: what the fused paths compute.
// GPT-OSS's layers (expert biases, the clamped SwiGLU) and Llama 4's (weights on the experts'
// input) take the stage-by-stage path, whose dispatch, grouped GEMM and combine have them.
bool MoeBlock::plain_experts(const DeviceLayer& d) const {
  return options_.weights == moe::WeightPlacement::kOutput &&
         options_.shape.activation.kind == moe::ActivationKind::kSiluGlu &&
         d.experts_gate_up_bias == nullptr && d.experts_down_bias == nullptr;
}

bool MoeBlock::small_batch_takes(int64_t layer, int64_t T) const {
  const DeviceLayer* d = runner_->resident(layer);
  const ExpertShape& s = options_.shape;
  // The small-batch kernel reads bf16, fp8, int4 and MXFP4 routed experts (dequantising them as
  // the grouped GEMM does) in one term, for the groups and sizes small_moe_supports_quant names.
  const bool readable_experts =
      s.weight_terms == 1 &&
      cuda::small_moe_supports_quant(s.quant, s.quant_group, s.hidden_size, s.expert_width);
  // Quantised shared experts (--weights-scope linear) take the stage path, whose dense MLP
  // reads them through the decoder's linear(); the small-batch kernel reads bf16 ones.
  return d != nullptr && plain_experts(*d) && readable_experts && !d->shared_quantized &&
         buffers_.small_moe_workspace != nullptr && !options_.approx.enabled() &&
         T * options_.top_k <= buffers_.small_moe_rows &&
         cuda::small_moe_supports(T, s.num_experts, options_.top_k, s.hidden_size, s.expert_width,
                                  d->shared_gate_up ? d->shared_width : 0);
}

bool MoeBlock::reads_hidden_first_by_linear(int64_t layer, int64_t T) const {
  return plans_[layer].feed_forward == FeedForwardKind::kMoe && !small_batch_takes(layer, T) &&
         !route_plan_takes(T);
}

std::optional<cuda::RouterParams> MoeBlock::persistent_router(int64_t layer) const {
  const DeviceLayer* d = runner_->resident(layer);
  const ExpertShape& s = options_.shape;
  const LayerPlan& plan = plans_[layer];
  if (d == nullptr || !plain_experts(*d) || s.weight_terms != 1 ||
      s.quant != cuda::ExpertQuant::kNone || plan.feed_forward != FeedForwardKind::kMoe ||
      plan.shared_expert != SharedExpertKind::kNone || dispatcher_->moves_rows() ||
      options_.approx.enabled()) {
    return std::nullopt;
  }
  const cuda::RouterParams p = router_params(layer, 1, nullptr, nullptr, nullptr, nullptr, nullptr);
  if (p.selection_bias != nullptr || p.group_score != cuda::RouterGroupScore::kNone)
    return std::nullopt;
  return p;
}

bool MoeBlock::route_plan_takes(int64_t T) const {
  // The routing approximations and the router temperature run between the router's product
  // and its top-k, or between the top-k and the plan: the stage path has them.
  const ExpertShape& s = options_.shape;
  return buffers_.route_plan_ticket != nullptr && T <= buffers_.route_plan_tokens &&
         !options_.approx.enabled() &&
         cuda::route_plan_supports(T, s.num_experts, options_.top_k, s.hidden_size);
}

void MoeBlock::small_batch(int64_t layer, const MoeLayerIo& io, int32_t* topk_ids,
                           float* topk_weights, cudaStream_t stream, const StageMarks& marks) {
  const DeviceLayer& d = *runner_->resident(layer);
  const ExpertShape& s = options_.shape;
  cuda::SmallMoeParams p{.hidden = io.hidden,
                         .router = d.router,
                         .route = router_params(layer, io.num_tokens, io.num_valid, io.noise_keys,
                                                buffers_.router_logits, topk_ids, topk_weights),
                         .gate_up = d.experts_gate_up,
                         .down = d.experts_down,
                         .quant = s.quant,
                         .quant_group = s.quant_group,
                         .expert_width = s.expert_width,
                         .shared_gate_up = d.shared_gate_up,
                         .shared_down = d.shared_down,
                         .shared_width = d.shared_gate_up ? d.shared_width : 0,
                         .shared_gate = d.shared_gate,
                         .expert_counts = io.expert_counts,
                         .out = io.out,
                         .workspace = buffers_.small_moe_workspace,
                         .hidden_size = s.hidden_size};
  // The profiler sees the two launches as route (router GEMV, top-k and plan) and experts
  // (routed and shared experts and their weighted sum).
  cuda::small_batch_moe_route_plan(p, stream);
  marks.close(profile::Stage::kRoute, layer);
  cuda::small_batch_moe_experts(p, stream);
  marks.close(profile::Stage::kExperts, layer);
}

const bf16* MoeBlock::shared_experts(int64_t layer, const bf16* hidden, int64_t T,
                                     cudaStream_t stream) {
  const DeviceLayer& d = layers_[layer];
  switch (plans_[layer].shared_expert) {
    case SharedExpertKind::kNone:
      return nullptr;
    case SharedExpertKind::kUngated:
      dense_mlp_(hidden, d.shared_gate_up, d.shared_down, d.shared_width, T,
                 buffers_.shared_out);
      return buffers_.shared_out;
    case SharedExpertKind::kSigmoidGated:
      dense_mlp_(hidden, d.shared_gate_up, d.shared_down, d.shared_width, T,
                 buffers_.shared_out);
      linear_(hidden, T, d.shared_gate, 1, options_.shape.hidden_size,
              buffers_.shared_gate_logits, /*f32_out=*/true);
      cuda::sigmoid_scale_rows({.x = buffers_.shared_out, .logits = buffers_.shared_gate_logits,
                                .num_tokens = T, .hidden_size = options_.shape.hidden_size},
                               stream);
      return buffers_.shared_out;
  }
  MOE_FAIL("layer ", layer, ": unknown shared expert kind");
}

void MoeBlock::enqueue(int64_t layer, const MoeLayerIo& io, cudaStream_t stream,
                       const StageMarks& marks) {
  MOE_CHECK(plans_[layer].feed_forward == FeedForwardKind::kMoe, "layer ", layer,
            " is dense, not an MoE block");
  if (small_batch_takes(layer, io.num_tokens)) {
    int32_t* const topk_ids = io.topk_ids ? io.topk_ids : buffers_.topk_ids;
    float* const topk_weights = io.topk_weights ? io.topk_weights : buffers_.topk_weights;
    small_batch(layer, io, topk_ids, topk_weights, stream, marks);
    return;
  }
  start(layer, io, stream, marks);
  run_experts(stream, marks);
  finish(stream, marks);
}

void MoeBlock::start(int64_t layer, const MoeLayerIo& io, cudaStream_t stream,
                     const StageMarks& marks) {
  MOE_CHECK(plans_[layer].feed_forward == FeedForwardKind::kMoe, "layer ", layer,
            " is dense, not an MoE block");
  MOE_CHECK(in_flight_.layer < 0, "MoE block: layer ", layer, " started while layer ",
            in_flight_.layer, " is still in flight");
  const int64_t T = io.num_tokens, K = options_.top_k, E = options_.shape.num_experts;
  int32_t* const topk_ids = io.topk_ids ? io.topk_ids : buffers_.topk_ids;
  float* const topk_weights = io.topk_weights ? io.topk_weights : buffers_.topk_weights;
  const bool fused_plan = route_plan_takes(T);
  if (fused_plan) {
    // One launch for both stages, closed as route (the profile's plan stage is then empty).
    cuda::moe_route_plan({.hidden = io.hidden,
                          .router = layers_[layer].router,
                          .hidden_size = options_.shape.hidden_size,
                          .route = router_params(layer, T, io.num_valid, io.noise_keys,
                                                 buffers_.router_logits, topk_ids, topk_weights),
                          .plan = {.expert_counts = io.expert_counts,
                                   .expert_offsets = buffers_.expert_offsets,
                                   .src_row = buffers_.src_row,
                                   .inverse = buffers_.inverse},
                          .ticket = buffers_.route_plan_ticket},
                         stream);
  } else {
    route(layer, io.hidden, T, io.num_valid, io.noise_keys, buffers_.router_logits, topk_ids,
          topk_weights, stream);
  }
  marks.close(profile::Stage::kRoute, layer);
  const RoutedTokens tokens{.hidden = io.hidden, .topk_ids = topk_ids,
                            .topk_weights = topk_weights,
                            .expert_offsets = buffers_.expert_offsets,
                            .src_row = buffers_.src_row, .inverse = buffers_.inverse,
                            .num_tokens = T, .top_k = K, .num_valid = io.num_valid,
                            .weights = options_.weights};
  runner_->on_routed(layer, tokens, *this, marks, stream);
  if (!fused_plan) {
    // Over E + 1 experts: padding tokens carry expert id E and sort past every real expert.
    cuda::moe_plan({.topk_ids = topk_ids,
                    .expert_counts = io.expert_counts,
                    .expert_offsets = buffers_.expert_offsets,
                    .src_row = buffers_.src_row,
                    .inverse = buffers_.inverse,
                    .workspace = buffers_.plan_workspace,
                    .num_assignments = T * K,
                    .num_experts = E + 1},
                   stream);
    marks.close(profile::Stage::kPlan, layer);
  }
  dispatcher_->start_dispatch(layer, tokens, stream);
  in_flight_ = {.layer = layer, .tokens = tokens, .out = io.out};
}

void MoeBlock::run_experts(cudaStream_t stream, const StageMarks& marks) {
  InFlight& f = in_flight_;
  MOE_CHECK(f.layer >= 0 && !f.dispatched, "MoE block: run_experts without a started layer");
  const int64_t layer = f.layer;
  try {
    f.rows = dispatcher_->finish_dispatch(layer, f.tokens, stream);
  } catch (...) {
    f = {};  // a failed exchange leaves no layer in flight
    throw;
  }
  f.dispatched = true;
  f.moves_rows = dispatcher_->moves_rows();  // expert parallelism
  if (f.moves_rows) marks.close(profile::Stage::kDispatch, layer);
  if (!f.moves_rows || f.rows.num_rows > 0) {
    runner_->run(layer, f.rows, buffers_.expert_out, stream);
  }
  marks.close(profile::Stage::kExperts, layer);
  f.shared = shared_experts(layer, f.tokens.hidden, f.tokens.num_tokens, stream);
  if (f.shared) marks.close(profile::Stage::kSharedExperts, layer);
}

void MoeBlock::finish(cudaStream_t stream, const StageMarks& marks) {
  InFlight& f = in_flight_;
  MOE_CHECK(f.layer >= 0 && f.dispatched, "MoE block: finish without run_experts");
  const int64_t layer = f.layer;
  const InFlight done = f;
  f = {};  // the block is free again even if combine throws
  runner_->finish(layer, done.tokens, buffers_.expert_out, stream);
  dispatcher_->combine(layer, buffers_.expert_out, done.tokens, done.shared, done.out, stream);
  marks.close(done.moves_rows ? profile::Stage::kCombine : profile::Stage::kUnpermute, layer);
}

}  // namespace moeinfer::gpu
