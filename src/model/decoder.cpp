#include "model/decoder.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/family.h"
#include "model/model_facts.h"
#include "moe/expert_parallel.h"
#include "offload/hot_set.h"
#include "offload/parse_options.h"
#include "profile/profiler.h"

namespace moeinfer {
namespace {

std::vector<float> to_f32(const TensorView& view) {
  if (view.empty()) return {};
  std::vector<float> out(view.numel());
  convert_to_f32(view.dtype, view.data, out.data(), out.size());
  return out;
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for rows of `width`.
void rms_norm(const float* x, int64_t num_rows, int64_t width, const float* weight, float eps,
              float* y) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* in = x + r * width;
    float* out = y + r * width;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum_sq += in[i] * in[i];
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (in[i] * inv_rms);
  }
}

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps): RMSNorm without a weight (Llama 4's q/k norm).
void rms_norm_unweighted(float* x, int64_t num_rows, int64_t width, float eps) {
  for (int64_t r = 0; r < num_rows; ++r) {
    float* row = x + r * width;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum_sq += row[i] * row[i];
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(width) + eps);
    for (int64_t i = 0; i < width; ++i) row[i] *= inv_rms;
  }
}

void silu_mul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

const float* data_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

bool interleaved(RopePairing pairing) {
  switch (pairing) {
    case RopePairing::kHalves:
      return false;
    case RopePairing::kInterleaved:
      return true;
  }
  return false;  // unreachable: every enumerator returns above
}

// Norms inside MLA use the RMSNorm default epsilon, not the config's.
constexpr float kMlaNormEps = 1e-6f;
// Gated DeltaNet L2-normalises q and k with this epsilon inside the square root.
constexpr float kLinearL2NormEps = 1e-6f;

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// torch's softplus (beta 1, threshold 20): the identity above 20.
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Zero-centred norm weights (Qwen3-Next) hold w where the norm multiplies by 1 + w.
void add_one(std::vector<float>& weight) {
  for (float& w : weight) w += 1.0f;
}

}  // namespace

float attention_softmax_scale(const ModelConfig& config) {
  const int64_t qk_dim = config.mla ? config.mla->qk_head_dim() : config.head_dim;
  double scale = 1.0 / std::sqrt(static_cast<double>(qk_dim));
  const RopeConfig& rope = config.rope;
  if (config.mla && rope.type != "default" && rope.mscale_all_dim != 0.0 && rope.factor > 1.0) {
    const double mscale = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
    scale *= mscale * mscale;
  }
  return static_cast<float>(scale);
}

void check_forward_batch(const ForwardBatch& batch, int64_t vocab_size, int64_t max_len,
                         int64_t num_blocks, int64_t block_size) {
  MOE_CHECK(!batch.sequences.empty(), "forward needs at least one sequence");
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const SequenceBatch& s = batch.sequences[i];
    MOE_CHECK(!s.tokens.empty(), "sequence ", i, " of the batch has no tokens");
    const int64_t end = s.position + static_cast<int64_t>(s.tokens.size());
    MOE_CHECK(end <= max_len, "sequence ", i, " reaches position ", end,
              " past the context limit of ", max_len);
    MOE_CHECK(static_cast<int64_t>(s.block_table.size()) * block_size >= end, "sequence ", i,
              " needs ", end, " cache slots but its block table holds ",
              s.block_table.size() * block_size);
    for (int32_t block : s.block_table) {
      MOE_CHECK(block >= 0 && block < num_blocks, "block ", block, " outside the pool of ",
                num_blocks);
    }
    for (int32_t id : s.tokens) {
      MOE_CHECK(id >= 0 && id < vocab_size, "token id ", id, " out of range [0, ", vocab_size, ")");
    }
  }
}

Decoder::Decoder(const ModelConfig& config, DecoderWeights weights)
    : config_(config),
      weights_(std::move(weights)),
      rope_(config.rope, config.rotary_dim(), config.max_position_embeddings),
      attention_scale_(attention_softmax_scale(config)) {
  params_.resize(config_.num_layers);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    const LayerWeights& lw = weights_.layers[l];
    LayerParams& p = params_[l];
    p.input_norm = to_f32(lw.input_norm);
    p.post_attention_norm = to_f32(lw.post_attention_norm);
    p.q_bias = to_f32(lw.attention.q_bias);
    p.k_bias = to_f32(lw.attention.k_bias);
    p.v_bias = to_f32(lw.attention.v_bias);
    p.o_bias = to_f32(lw.attention.o_bias);
    p.q_norm = to_f32(lw.attention.q_norm);
    p.k_norm = to_f32(lw.attention.k_norm);
    p.q_a_norm = to_f32(lw.mla.q_a_norm);
    p.kv_a_norm = to_f32(lw.mla.kv_a_norm);
    p.selection_bias = to_f32(lw.moe.selection_bias);
    const LinearAttentionWeights& lin = lw.linear_attention;
    if (!lin.conv1d.empty()) {
      p.conv = to_f32(lin.conv1d);
      p.dt_bias = to_f32(lin.dt_bias);
      p.gated_norm = to_f32(lin.norm);
      p.neg_decay = to_f32(lin.a_log);
      for (float& a : p.neg_decay) a = -std::exp(a);
    }
    if (config_.norm_weight_offset) {
      for (auto* w : {&p.input_norm, &p.post_attention_norm, &p.q_norm, &p.k_norm}) add_one(*w);
    }
    p.sinks = to_f32(lw.attention.sinks);
    p.router_bias = to_f32(lw.moe.router_bias);
    MOE_CHECK(!config_.attention_sinks || static_cast<int64_t>(p.sinks.size()) == config_.num_heads,
              "layer ", l, " has ", p.sinks.size(), " attention sinks for ", config_.num_heads,
              " query heads");
  }
  final_norm_ = to_f32(weights_.final_norm);
  if (config_.norm_weight_offset) add_one(final_norm_);
  plans_ = plan_layers(config_);
  if (config_.num_experts > 0) {
    make_moe_block(resident_experts());
  }
}

moe::LayerRouter Decoder::layer_router(int64_t layer) const {
  return {.weight = weights_.layers[layer].moe.routed.router,
          .selection_bias = data_or_null(params_[layer].selection_bias),
          .logit_bias = data_or_null(params_[layer].router_bias)};
}

std::vector<std::span<const moe::ExpertWeights>> Decoder::routed_experts() const {
  std::vector<std::span<const moe::ExpertWeights>> experts(config_.num_layers);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (weights_.layers[l].is_moe) experts[l] = weights_.layers[l].moe.routed.experts;
  }
  return experts;
}

std::unique_ptr<moe::ExpertRunner> Decoder::resident_experts() const {
  return std::make_unique<moe::ResidentExperts>(routed_experts(), config_.hidden_size,
                                                config_.moe_intermediate_size,
                                                expert_activation(config_));
}

void Decoder::make_moe_block(std::unique_ptr<moe::ExpertRunner> runner) {
  const int64_t H = config_.hidden_size;
  auto dispatcher = [&]() -> std::unique_ptr<moe::TokenDispatcher> {
    if (ep_ == nullptr) return std::make_unique<moe::LocalDispatcher>(H);
    return std::make_unique<moe::ExpertParallelDispatcher>(
        *ep_,
        placement_ ? *placement_ : parallel::ExpertPlacement(config_.num_experts, ep_->size()), H,
        dispatch_dtype_);
  };
  const moe::MoeBlockOptions options{.router = router_options(config_),
                                     .hidden_size = H,
                                     .expert_width = config_.moe_intermediate_size,
                                     .weights = config_.routing_weight_on_input
                                                    ? moe::WeightPlacement::kInput
                                                    : moe::WeightPlacement::kOutput,
                                     .approx = routing_approx_};
  moe_block_ = std::make_unique<moe::MoeBlock>(options, dispatcher(), std::move(runner));
  // Micro-batch B's block: its own routing, dispatcher buffers and runner scratch, so that both
  // micro-batches can be in flight at once (the experts' weights are the same views).
  moe_block_b_.reset();
  if (ep_ != nullptr && micro_batches_ == 2) {
    moe_block_b_ = std::make_unique<moe::MoeBlock>(options, dispatcher(), resident_experts());
  }
}

void Decoder::set_routing_approximation(const moe::RoutingApproximation& approx) {
  if (config_.num_experts == 0 || moe_block_ == nullptr) {
    MOE_CHECK(!approx.enabled(), approx.flags().front(), ": the ", config_.model_type,
              " model has no routed experts");
    return;
  }
  moe::validate(approx, router_options(config_));
  routing_approx_ = approx;
  moe_block_->set_approximation(approx);
  if (moe_block_b_ != nullptr) moe_block_b_->set_approximation(approx);
}

std::vector<int64_t> Decoder::moe_layers() const { return moe_layer_indices(config_); }

void Decoder::set_expert_parallel(parallel::Communicator* comm,
                                  std::optional<parallel::ExpertPlacement> placement, bool overlap,
                                  moe::DispatchDtype dispatch_dtype, int micro_batches) {
  MOE_CHECK(comm != nullptr || dispatch_dtype == moe::DispatchDtype::kF32, "--dispatch-dtype ",
            moe::dispatch_dtype_name(dispatch_dtype), " applies to --ep N (N > 1)");
  MOE_CHECK(micro_batches == 1 || micro_batches == 2, "--micro-batches ", micro_batches,
            ": 1 or 2");
  MOE_CHECK(micro_batches == 1 || comm != nullptr, "--micro-batches 2 needs --ep N with N > 1");
  MOE_CHECK(comm == nullptr || config_.num_experts > 0, "--ep: the ", config_.model_type,
            " model has no routed experts to shard");
  MOE_CHECK(!placement || (comm != nullptr && placement->num_ranks() == comm->size() &&
                           placement->num_experts() == config_.num_experts),
            "an expert placement needs expert parallelism over its ranks and the model's ",
            config_.num_experts, " experts");
  MOE_CHECK(micro_batches == 1 || !offload_.enabled(),
            "--micro-batches 2 with --expert-budget is not supported yet (the two micro-batches "
            "would need one expert cache between them)");
  if (config_.num_experts == 0) return;
  ep_ = comm;
  placement_ = std::move(placement);
  dispatch_dtype_ = dispatch_dtype;
  micro_batches_ = comm != nullptr ? micro_batches : 1;
  shared_schedule_ = comm != nullptr && overlap ? moe::SharedSchedule::kWhileDispatching
                                                : moe::SharedSchedule::kBeforeDispatch;
  make_moe_block(expert_runner());
}

std::vector<std::vector<uint8_t>> Decoder::held_experts() const {
  const int64_t E = config_.num_experts;
  const parallel::ExpertPlacement placement =
      placement_ ? *placement_ : parallel::ExpertPlacement(E, ep_->size());
  std::vector<std::vector<uint8_t>> held(static_cast<size_t>(config_.num_layers));
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (!weights_.layers[l].is_moe) continue;
    held[l].assign(static_cast<size_t>(E), 0);
    for (int32_t e : placement.layer(l).slots(ep_->rank())) held[l][e] = 1;
  }
  return held;
}

void Decoder::set_offload(const offload::OffloadOptions& options, int64_t max_step_tokens) {
  offload::check_offload_model(options, config_.num_experts,
                               "the " + config_.model_type + " model");
  MOE_CHECK(max_step_tokens >= 1, "set_offload: max_step_tokens must be >= 1, got ",
            max_step_tokens);
  if (config_.num_experts == 0) return;
  MOE_CHECK(!options.enabled() || micro_batches_ == 1,
            "--expert-budget with --micro-batches 2 is not supported yet (the two micro-batches "
            "would need one expert cache between them)");
  // Read the trace before building anything, so that a bad file leaves the decoder as it was.
  std::vector<int32_t> ranking;
  if (options.enabled() && !options.hot_set_file.empty()) {
    ranking =
        offload::load_expert_ranking(options.hot_set_file, config_.num_layers, config_.num_experts);
  }
  offload_ = options;
  offload_ranking_ = std::move(ranking);
  offload_step_tokens_ = max_step_tokens;
  make_moe_block(expert_runner());
}

std::unique_ptr<moe::ExpertRunner> Decoder::expert_runner() {
  cached_experts_ = nullptr;
  if (!offload_.enabled()) return resident_experts();
  const offload::OffloadOptions& options = offload_;
  const int64_t L = config_.num_layers, E = config_.num_experts;
  std::vector<std::span<const moe::ExpertWeights>> experts = routed_experts();
  std::vector<std::vector<uint8_t>> held;
  if (ep_ != nullptr) held = held_experts();
  std::vector<moe::LayerRouter> routers(L);
  int64_t num_routed = 0, expert_bytes = 0;  // num_routed: the experts this rank holds
  for (int64_t l = 0; l < L; ++l) {
    if (experts[l].empty()) continue;
    routers[l] = layer_router(l);
    num_routed += held.empty() ? static_cast<int64_t>(experts[l].size())
                               : std::count(held[l].begin(), held[l].end(), uint8_t{1});
    expert_bytes = moe::expert_nbytes(experts[l].front());
  }
  const int64_t num_slots = options.num_slots(expert_bytes, num_routed);
  // Under --ep a rank warms (and keeps hot) only the experts it holds.
  std::vector<int32_t> ranking = offload_ranking_;
  if (!held.empty()) std::erase_if(ranking, [&](int32_t g) { return held[g / E][g % E] == 0; });
  const offload::ColdCost cold =
      moe::simulated_cold_cost(options.cold, moe::experts_to_time(experts), config_.hidden_size,
                               config_.moe_intermediate_size);
  auto runner = std::make_unique<moe::CachedExperts>(
      std::move(experts), std::move(routers),
      moe::CachedExpertsOptions{.router = router_options(config_),
                                .hidden_size = config_.hidden_size,
                                .expert_width = config_.moe_intermediate_size,
                                .num_slots = num_slots,
                                .policy = options.policy,
                                .prefetch = options.prefetch,
                                .cold = cold,
                                .activation = expert_activation(config_),
                                .held = std::move(held)});
  const int64_t reserve = offload::static_reserve_slots(
      E, offload_step_tokens_ * config_.num_experts_per_tok, num_slots);
  runner->warm(ranking, num_slots - reserve);
  cached_experts_ = runner.get();
  return runner;
}

KvPoolLayout kv_pool_layout(const ModelConfig& config, int64_t num_state_slots, KvDType dtype) {
  KvPoolLayout layout;
  KvRowGroups groups = kv_row_groups(config);
  layout.dtype = dtype;
  layout.key_groups = std::move(groups.key);
  layout.value_groups = std::move(groups.value);
  if (!config.linear_attention) return layout;
  const LinearAttentionConfig& lin = *config.linear_attention;
  layout.layer_has_kv.resize(static_cast<size_t>(config.num_layers));
  layout.state.layer_has_state.resize(static_cast<size_t>(config.num_layers));
  for (int64_t l = 0; l < config.num_layers; ++l) {
    layout.layer_has_kv[l] = !config.is_linear_layer(l);
    layout.state.layer_has_state[l] = config.is_linear_layer(l);
  }
  layout.state.conv_values = lin.conv_state_values();
  layout.state.recurrent_values = lin.recurrent_state_values();
  layout.num_state_slots = num_state_slots;
  return layout;
}

KvCache Decoder::make_cache(int64_t max_tokens, KvDType dtype) const {
  const int64_t limit = config_.max_position_embeddings > 0
                            ? std::min(max_tokens, config_.max_position_embeddings)
                            : max_tokens;
  if (config_.mla) {
    return KvCache(config_.num_layers, config_.mla->cache_width(), 0, limit, 16,
                   kv_pool_layout(config_, 0, dtype));
  }
  return KvCache(config_.num_layers, config_.kv_dim(), config_.kv_dim(), limit, 16,
                 kv_pool_layout(config_, 1, dtype));
}

KvBlockPool Decoder::make_pool(int64_t block_size, int64_t num_blocks, int64_t num_state_slots,
                               KvDType dtype) const {
  if (config_.mla) {
    return KvBlockPool(config_.num_layers, config_.mla->cache_width(), 0, block_size, num_blocks,
                       kv_pool_layout(config_, 0, dtype));
  }
  return KvBlockPool(config_.num_layers, config_.kv_dim(), config_.kv_dim(), block_size, num_blocks,
                     kv_pool_layout(config_, num_state_slots, dtype));
}

void Decoder::forward(std::span<const int32_t> tokens, KvCache& cache, std::span<float> logits,
                      bool all_positions) {
  MOE_CHECK(!tokens.empty(), "forward needs at least one token");
  cache.reserve_append(static_cast<int64_t>(tokens.size()));
  ForwardBatch batch{.sequences = {SequenceBatch{.tokens = tokens,
                                                 .position = cache.length(),
                                                 .block_table = cache.block_table(),
                                                 .want_logits = true,
                                                 .state_slot = cache.state_slot()}},
                     .all_positions = all_positions};
  forward(batch, cache.pool(), logits);
  cache.advance(static_cast<int64_t>(tokens.size()));
}

int64_t Decoder::num_logit_rows(const ForwardBatch& batch) {
  int64_t rows = 0;
  for (const SequenceBatch& s : batch.sequences) {
    if (s.want_logits) rows += batch.all_positions ? static_cast<int64_t>(s.tokens.size()) : 1;
  }
  return rows;
}

Decoder::CacheSlot Decoder::cache_slot(const KvBlockPool& pool, const SequenceBatch& s,
                                       int64_t position) {
  const int64_t bs = pool.block_size();
  return {.block = s.block_table[position / bs], .slot = position % bs};
}

void Decoder::forward(const ForwardBatch& batch, KvBlockPool& pool, std::span<float> logits) {
  const int64_t H = config_.hidden_size;
  const int64_t V = config_.vocab_size;
  const int64_t key_width = config_.mla ? config_.mla->cache_width() : config_.kv_dim();
  MOE_CHECK(pool.num_layers() == config_.num_layers && pool.key_width() == key_width,
            "KV pool shape (", pool.num_layers(), " layers, width ", pool.key_width(),
            ") does not fit the model (", config_.num_layers, " layers, width ", key_width, ")");
  MOE_CHECK(pool.num_kv_layers() == config_.num_kv_layers(), "KV pool has rows for ",
            pool.num_kv_layers(), " layers, the model attends over a cache in ",
            config_.num_kv_layers());
  if (config_.linear_attention) {
    // Each sequence's recurrent state: a slot of its own, zeroed when it starts.
    RecurrentStatePool& state = pool.recurrent_state();
    std::vector<bool> seen(static_cast<size_t>(state.num_slots()), false);
    for (size_t i = 0; i < batch.sequences.size(); ++i) {
      const int32_t slot = batch.sequences[i].state_slot;
      MOE_CHECK(slot >= 0 && slot < state.num_slots(), "sequence ", i, " has state slot ", slot,
                " but the pool holds recurrent state for ", state.num_slots(), " sequences");
      MOE_CHECK(!seen[slot], "two sequences of one batch share recurrent state slot ", slot);
      seen[slot] = true;
    }
    for (const SequenceBatch& s : batch.sequences) {
      if (s.position == 0) state.reset(s.state_slot);
    }
  }

  // Under expert parallelism a rank with nothing scheduled still runs the step: zero rows go
  // through every layer, so that it joins each MoE layer's dispatch and combine.
  if (!batch.sequences.empty() || ep_ == nullptr) {
    check_forward_batch(
        batch, V, config_.max_position_embeddings > 0 ? config_.max_position_embeddings : INT64_MAX,
        pool.num_blocks(), pool.block_size());
  }
  const int64_t out_rows = num_logit_rows(batch);
  MOE_CHECK(static_cast<int64_t>(logits.size()) == out_rows * V, "logits buffer holds ",
            logits.size(), " floats, needs ", out_rows * V);
  if (moe_block_b_ != nullptr) {
    forward_micro_batches(batch, pool, logits);
    return;
  }

  Workspace& ws = workspaces_[0];
  const int64_t T = lay_out(batch, ws);
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    MOE_PROFILE_LAYER(l);
    attention_block(l, batch, pool, T, ws);
    feed_forward(l, T, ws);
    add_into(ws.x.data(), ws.block_out.data(), T * config_.hidden_size);
  }
  lm_head(batch, ws, logits);
}

void Decoder::forward_micro_batches(const ForwardBatch& batch, KvBlockPool& pool,
                                    std::span<float> logits) {
  const int64_t H = config_.hidden_size;
  // A: the first half of the sequences (the larger half when odd), B: the rest; either may be
  // empty and still joins every exchange.
  const size_t num_a = (batch.sequences.size() + 1) / 2;
  std::array<ForwardBatch, 2> parts;
  parts[0].sequences.assign(batch.sequences.begin(), batch.sequences.begin() + num_a);
  parts[1].sequences.assign(batch.sequences.begin() + num_a, batch.sequences.end());
  std::array<moe::MoeBlock*, 2> blocks = {moe_block_.get(), moe_block_b_.get()};
  std::array<int64_t, 2> T{};
  for (int m = 0; m < 2; ++m) {
    parts[m].all_positions = batch.all_positions;
    T[m] = lay_out(parts[m], workspaces_[m]);
  }
  // Per MoE layer the exchanges go out in the same order on every rank: A's dispatch, B's
  // dispatch, A's combine, B's combine; each is in flight while the other micro-batch computes.
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    MOE_PROFILE_LAYER(l);
    const bool moe = plans_[l].feed_forward == FeedForwardKind::kMoe;
    for (int m = 0; m < 2; ++m) {
      Workspace& ws = workspaces_[m];
      attention_block(l, parts[m], pool, T[m], ws);
      if (moe) {
        start_moe(l, T[m], ws, *blocks[m]);
      } else {
        feed_forward(l, T[m], ws);
        add_into(ws.x.data(), ws.block_out.data(), T[m] * H);
      }
    }
    if (!moe) continue;
    for (int m = 0; m < 2; ++m) blocks[m]->run_experts();
    for (int m = 0; m < 2; ++m) {
      Workspace& ws = workspaces_[m];
      blocks[m]->finish(ws.block_out.data());
      observe_routing(l, blocks[m]->routing());
      add_into(ws.x.data(), ws.block_out.data(), T[m] * H);
    }
  }
  const int64_t rows_a = num_logit_rows(parts[0]);
  lm_head(parts[0], workspaces_[0], logits.first(static_cast<size_t>(rows_a * config_.vocab_size)));
  lm_head(parts[1], workspaces_[1],
          logits.subspan(static_cast<size_t>(rows_a * config_.vocab_size)));
}

int64_t Decoder::lay_out(const ForwardBatch& batch, Workspace& ws) const {
  const int64_t H = config_.hidden_size;
  ws.slots.sequence.clear();
  ws.slots.position.clear();
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const SequenceBatch& s = batch.sequences[i];
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      ws.slots.sequence.push_back(static_cast<int32_t>(i));
      ws.slots.position.push_back(s.position + static_cast<int64_t>(t));
    }
  }
  const int64_t T = static_cast<int64_t>(ws.slots.sequence.size());
  ws.x.resize(T * H);
  ws.normed.resize(T * H);
  ws.block_out.resize(T * H);
  const TensorView& embed = weights_.embed_tokens;
  int64_t row = 0;
  for (const SequenceBatch& s : batch.sequences) {
    for (int32_t id : s.tokens) {
      convert_to_f32(embed.dtype, embed.row(id), ws.x.data() + row++ * H, H);
    }
  }
  return T;
}

void Decoder::attention_block(int64_t l, const ForwardBatch& batch, KvBlockPool& pool, int64_t T,
                              Workspace& ws) {
  const int64_t H = config_.hidden_size;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  rms_norm(ws.x.data(), T, H, params_[l].input_norm.data(), eps, ws.normed.data());
  {
    MOE_PROFILE_SCOPE(profile::Stage::kAttention);
    switch (plans_[l].attention) {
      case AttentionKind::kGqa:
        attention(l, batch, pool, ws);
        break;
      case AttentionKind::kMla:
        mla_attention(l, batch, pool, ws);
        break;
      case AttentionKind::kGatedDeltaNet:
        linear_attention(l, batch, pool, ws);
        break;
    }
  }
  add_into(ws.x.data(), ws.block_out.data(), T * H);
  rms_norm(ws.x.data(), T, H, params_[l].post_attention_norm.data(), eps, ws.normed.data());
}

void Decoder::lm_head(const ForwardBatch& batch, Workspace& ws, std::span<float> logits) {
  // Final norm and LM head over the rows that want logits only.
  MOE_PROFILE_SCOPE(profile::Stage::kLmHead);
  const int64_t H = config_.hidden_size;
  int64_t out = 0, row = 0;
  for (const SequenceBatch& s : batch.sequences) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    if (s.want_logits) {
      const int64_t first = batch.all_positions ? row : row + n - 1;
      const int64_t count = batch.all_positions ? n : 1;
      rms_norm(ws.x.data() + first * H, count, H, final_norm_.data(),
               static_cast<float>(config_.rms_norm_eps), ws.normed.data() + out * H);
      out += count;
    }
    row += n;
  }
  cpu::linear(ws.normed.data(), out, weights_.lm_head, nullptr, logits.data());
}

void Decoder::attention(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool,
                        Workspace& ws) {
  const AttentionWeights& w = weights_.layers[layer].attention;
  const LayerParams& p = params_[layer];
  const int64_t T = static_cast<int64_t>(ws.slots.sequence.size());
  const int64_t D = config_.head_dim;
  const int64_t Nq = config_.num_heads;
  const int64_t Nkv = config_.num_kv_heads;
  const int64_t q_dim = config_.q_dim();
  const int64_t kv_dim = config_.kv_dim();
  const float eps = static_cast<float>(config_.rms_norm_eps);
  ws.q.resize(T * q_dim);
  ws.k.resize(T * kv_dim);
  ws.v.resize(T * kv_dim);
  ws.attn.resize(T * q_dim);

  const LayerPlan& plan = plans_[layer];
  if (plan.output_gate) {
    // q_proj gives [T, Nq, 2D]: each head's query, then its gate.
    ws.gate_logits.resize(T * 2 * q_dim);
    cpu::linear(ws.normed.data(), T, w.q_proj, nullptr, ws.gate_logits.data());
    for (int64_t row = 0; row < T * Nq; ++row) {
      const float* both = ws.gate_logits.data() + row * 2 * D;
      std::copy_n(both, D, ws.q.data() + row * D);
      std::copy_n(both + D, D, ws.gate_logits.data() + row * D);  // in place: row*D <= row*2D
    }
  } else {
    cpu::linear(ws.normed.data(), T, w.q_proj, data_or_null(p.q_bias), ws.q.data());
  }
  cpu::linear(ws.normed.data(), T, w.k_proj, data_or_null(p.k_bias), ws.k.data());
  cpu::linear(ws.normed.data(), T, w.v_proj, data_or_null(p.v_bias), ws.v.data());

  switch (plan.qk_norm) {
    case QkNormKind::kNone:
    case QkNormKind::kAfterRopeWeightless:  // below, once RoPE has turned q and k
      break;
    case QkNormKind::kPerHead:
      rms_norm(ws.q.data(), T * Nq, D, p.q_norm.data(), eps, ws.q.data());
      rms_norm(ws.k.data(), T * Nkv, D, p.k_norm.data(), eps, ws.k.data());
      break;
    case QkNormKind::kWholeProjection:
      rms_norm(ws.q.data(), T, q_dim, p.q_norm.data(), eps, ws.q.data());
      rms_norm(ws.k.data(), T, kv_dim, p.k_norm.data(), eps, ws.k.data());
      break;
  }
  if (plan.clip_qkv) {
    const float c = static_cast<float>(*config_.clip_qkv);
    for (auto* buf : {&ws.q, &ws.k, &ws.v}) {
      for (float& value : *buf) value = std::clamp(value, -c, c);
    }
  }

  for (int64_t t = 0; t < T; ++t) {
    const SequenceBatch& s = batch.sequences[ws.slots.sequence[t]];
    const int64_t position = ws.slots.position[t];
    float* q = ws.q.data() + t * q_dim;
    float* k = ws.k.data() + t * kv_dim;
    switch (plan.position) {
      case PositionEncoding::kRope:
        rope_.apply(q, Nq, D, position, interleaved(plan.rope));
        rope_.apply(k, Nkv, D, position, interleaved(plan.rope));
        break;
      case PositionEncoding::kNone:
        break;
    }
    if (plan.qk_norm == QkNormKind::kAfterRopeWeightless) {
      rms_norm_unweighted(q, Nq, D, eps);
      rms_norm_unweighted(k, Nkv, D, eps);
    }
    switch (plan.query_scale) {
      case QueryScale::kNone:
        break;
      case QueryScale::kTemperature: {
        // Sharper attention far into a NoPE layer's context, in float32 as the reference.
        const AttentionTemperature& temp = *config_.attention_temperature;
        const float steps = std::floor((static_cast<float>(position) + 1.0f) /
                                       static_cast<float>(temp.floor_scale));
        const float factor = std::log1p(steps) * static_cast<float>(temp.attn_scale) + 1.0f;
        for (int64_t i = 0; i < q_dim; ++i) q[i] *= factor;
        break;
      }
    }
    const CacheSlot at = cache_slot(pool, s, position);
    pool.write_key(layer, at.block, at.slot, k);
    pool.write_value(layer, at.block, at.slot, ws.v.data() + t * kv_dim);
  }

  const int64_t group = Nq / Nkv;
  const float scale = attention_scale_;
  const int64_t window = plan.sliding_window;
  const bool sinks = plan.attention_sinks;
  const int64_t chunk = config_.attention_chunk_size;
  // The first key position a query at `position` sees.
  const auto first_visible = [&](int64_t position) -> int64_t {
    switch (plan.span) {
      case AttentionSpan::kCausal:
        return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      case AttentionSpan::kChunked:
        return position / chunk * chunk;
    }
    return 0;  // unreachable: every enumerator returns above
  };
  // One task per (token, query head): scores over the visible keys, softmax, weighted values.
  parallel_for(T * Nq, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> row(D);  // one head of a cached row as float32 (unused for f32 rows)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Nq;
      const int64_t h = task % Nq;
      const int64_t kv_head = h / group;
      const SequenceBatch& s = batch.sequences[ws.slots.sequence[t]];
      const int64_t position = ws.slots.position[t];
      const int64_t first = first_visible(position);
      const int64_t count = position - first + 1;
      const float* q = ws.q.data() + t * q_dim + h * D;
      scores.resize(count);
      // A sink is one more logit in the softmax (unscaled) whose value row is zero.
      const float sink = sinks ? p.sinks[h] : -INFINITY;
      float max_score = sink;
      for (int64_t j = 0; j < count; ++j) {
        const CacheSlot at = cache_slot(pool, s, first + j);
        const float* k = pool.read_key(layer, at.block, at.slot, kv_head * D, D, row.data());
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      float sum = sinks ? std::exp(sink - max_score) : 0.0f;
      for (int64_t j = 0; j < count; ++j) sum += scores[j] = std::exp(scores[j] - max_score);
      float* out = ws.attn.data() + t * q_dim + h * D;
      std::fill_n(out, D, 0.0f);
      for (int64_t j = 0; j < count; ++j) {
        const float weight = scores[j] / sum;
        const CacheSlot at = cache_slot(pool, s, first + j);
        const float* v = pool.read_value(layer, at.block, at.slot, kv_head * D, D, row.data());
        for (int64_t d = 0; d < D; ++d) out[d] += weight * v[d];
      }
    }
  });
  if (plan.output_gate) {
    for (int64_t i = 0; i < T * q_dim; ++i) ws.attn[i] *= sigmoid(ws.gate_logits[i]);
  }
  cpu::linear(ws.attn.data(), T, w.o_proj, data_or_null(p.o_bias), ws.block_out.data());
}

void Decoder::linear_attention(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool,
                               Workspace& ws) {
  const LinearAttentionWeights& w = weights_.layers[layer].linear_attention;
  const LayerParams& p = params_[layer];
  const LinearAttentionConfig& lin = *config_.linear_attention;
  const int64_t T = static_cast<int64_t>(ws.slots.sequence.size());
  const int64_t Nk = lin.num_key_heads, Nv = lin.num_value_heads;
  const int64_t Dk = lin.key_head_dim, Dv = lin.value_head_dim;
  const int64_t r = Nv / Nk;  // value heads per key head
  const int64_t key_dim = lin.key_dim(), value_dim = lin.value_dim();
  const int64_t C = lin.conv_dim();
  const int64_t taps = lin.conv_kernel;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  ws.mixed.resize(T * C);     // [T, q | k | v] before the conv
  ws.conv_out.resize(T * C);  // after the conv and SiLU
  ws.z.resize(T * value_dim);
  ws.b.resize(T * Nv);
  ws.a.resize(T * Nv);
  ws.core.resize(T * value_dim);
  if (!w.in_proj_qkvz.empty()) {
    // Qwen3-Next packs per key head g: [q_g | k_g | v of its r heads | z of them] and [b | a].
    const int64_t qkvz_width = 2 * key_dim + 2 * value_dim;
    const int64_t group = 2 * Dk + 2 * r * Dv;
    ws.qkvz.resize(T * qkvz_width);
    ws.ba.resize(T * 2 * Nv);
    cpu::linear(ws.normed.data(), T, w.in_proj_qkvz, nullptr, ws.qkvz.data());
    cpu::linear(ws.normed.data(), T, w.in_proj_ba, nullptr, ws.ba.data());
    for (int64_t t = 0; t < T; ++t) {
      const float* in = ws.qkvz.data() + t * qkvz_width;
      float* out = ws.mixed.data() + t * C;
      for (int64_t g = 0; g < Nk; ++g) {
        const float* src = in + g * group;
        std::copy_n(src, Dk, out + g * Dk);
        std::copy_n(src + Dk, Dk, out + key_dim + g * Dk);
        std::copy_n(src + 2 * Dk, r * Dv, out + 2 * key_dim + g * r * Dv);
        std::copy_n(src + 2 * Dk + r * Dv, r * Dv, ws.z.data() + t * value_dim + g * r * Dv);
        const float* ba = ws.ba.data() + t * 2 * Nv + g * 2 * r;
        std::copy_n(ba, r, ws.b.data() + t * Nv + g * r);
        std::copy_n(ba + r, r, ws.a.data() + t * Nv + g * r);
      }
    }
  } else {
    // Qwen3.5: [q | k | v], z, b and a each from a projection of their own.
    cpu::linear(ws.normed.data(), T, w.in_proj_qkv, nullptr, ws.mixed.data());
    cpu::linear(ws.normed.data(), T, w.in_proj_z, nullptr, ws.z.data());
    cpu::linear(ws.normed.data(), T, w.in_proj_b, nullptr, ws.b.data());
    cpu::linear(ws.normed.data(), T, w.in_proj_a, nullptr, ws.a.data());
  }

  // Causal depthwise conv per sequence over its window (the state's last taps - 1 inputs, then
  // this step's rows), SiLU, and the window's tail back into the state.
  RecurrentStatePool& state = pool.recurrent_state();
  const int64_t history = taps - 1;
  int64_t first_row = 0;
  for (const SequenceBatch& s : batch.sequences) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    float* window_state = state.conv(layer, s.state_slot);  // [C, history]
    parallel_for(C, [&](int64_t c_begin, int64_t c_end) {
      std::vector<float> window(static_cast<size_t>(history + n));
      for (int64_t c = c_begin; c < c_end; ++c) {
        std::copy_n(window_state + c * history, history, window.data());
        for (int64_t t = 0; t < n; ++t) window[history + t] = ws.mixed[(first_row + t) * C + c];
        const float* tap = p.conv.data() + c * taps;
        for (int64_t t = 0; t < n; ++t) {
          float acc = 0.0f;
          for (int64_t j = 0; j < taps; ++j) acc += tap[j] * window[t + j];
          ws.conv_out[(first_row + t) * C + c] = acc * sigmoid(acc);
        }
        std::copy_n(window.data() + n, history, window_state + c * history);
      }
    });
    first_row += n;
  }

  // The gated delta rule per value head, token by token, on the state S [Dk, Dv]:
  //   S *= exp(g);  S += k (beta (v - S^T k))^T;  out = S^T q
  // with q, k L2-normalised (q also by 1/sqrt(Dk)), g = -exp(A_log) softplus(a + dt_bias) and
  // beta = sigmoid(b). Value head h reads key head h / r.
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
  first_row = 0;
  for (const SequenceBatch& s : batch.sequences) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    float* states = state.recurrent(layer, s.state_slot);  // [Nv, Dk, Dv]
    parallel_for(Nv, [&](int64_t h_begin, int64_t h_end) {
      std::vector<float> q(Dk), k(Dk), kv_mem(Dv);
      for (int64_t h = h_begin; h < h_end; ++h) {
        const int64_t g = h / r;
        float* S = states + h * Dk * Dv;
        for (int64_t t = first_row; t < first_row + n; ++t) {
          const float* row = ws.conv_out.data() + t * C;
          const float* v = row + 2 * key_dim + h * Dv;
          float q_sq = 0.0f, k_sq = 0.0f;
          for (int64_t d = 0; d < Dk; ++d) {
            q[d] = row[g * Dk + d];
            k[d] = row[key_dim + g * Dk + d];
            q_sq += q[d] * q[d];
            k_sq += k[d] * k[d];
          }
          const float q_norm = q_scale / std::sqrt(q_sq + kLinearL2NormEps);
          const float k_norm = 1.0f / std::sqrt(k_sq + kLinearL2NormEps);
          for (int64_t d = 0; d < Dk; ++d) {
            q[d] *= q_norm;
            k[d] *= k_norm;
          }
          const float beta = sigmoid(ws.b[t * Nv + h]);
          const float decay = std::exp(p.neg_decay[h] * softplus(ws.a[t * Nv + h] + p.dt_bias[h]));
          std::fill(kv_mem.begin(), kv_mem.end(), 0.0f);
          for (int64_t i = 0; i < Dk; ++i) {
            float* S_row = S + i * Dv;
            for (int64_t j = 0; j < Dv; ++j) {
              S_row[j] *= decay;
              kv_mem[j] += S_row[j] * k[i];
            }
          }
          for (int64_t j = 0; j < Dv; ++j) kv_mem[j] = (v[j] - kv_mem[j]) * beta;  // the delta
          float* out = ws.core.data() + t * value_dim + h * Dv;
          std::fill_n(out, Dv, 0.0f);
          for (int64_t i = 0; i < Dk; ++i) {
            float* S_row = S + i * Dv;
            for (int64_t j = 0; j < Dv; ++j) {
              S_row[j] += k[i] * kv_mem[j];
              out[j] += S_row[j] * q[i];
            }
          }
        }
      }
    });
    first_row += n;
  }

  // Gated RMSNorm per value head: normed(core) * w * silu(z).
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Nv; ++h) {
      float* x = ws.core.data() + t * value_dim + h * Dv;
      const float* z = ws.z.data() + t * value_dim + h * Dv;
      rms_norm(x, 1, Dv, p.gated_norm.data(), eps, x);
      for (int64_t j = 0; j < Dv; ++j) x[j] *= z[j] * sigmoid(z[j]);
    }
  }
  cpu::linear(ws.core.data(), T, w.out_proj, nullptr, ws.block_out.data());
}

void Decoder::mla_attention(int64_t layer, const ForwardBatch& batch, KvBlockPool& pool,
                            Workspace& ws) {
  const MlaWeights& w = weights_.layers[layer].mla;
  const LayerParams& p = params_[layer];
  const MlaConfig& m = *config_.mla;
  const int64_t T = static_cast<int64_t>(ws.slots.sequence.size());
  const int64_t Nh = config_.num_heads;
  const int64_t nope = m.qk_nope_head_dim, rope_dim = m.qk_rope_head_dim, vd = m.v_head_dim;
  const int64_t L = m.kv_lora_rank;
  const int64_t qk = m.qk_head_dim();
  const int64_t width = m.cache_width();  // [latent L | rope key]
  ws.q.resize(T * Nh * qk);
  ws.latent.resize(T * width);
  ws.q_latent.resize(T * Nh * L);
  ws.o_latent.resize(Nh * T * L);
  ws.head_out.resize(T * vd);
  ws.attn.resize(T * Nh * vd);

  // Queries [T, Nh, nope + rope].
  if (m.q_lora_rank > 0) {
    ws.q_lora.resize(T * m.q_lora_rank);
    cpu::linear(ws.normed.data(), T, w.q_a_proj, nullptr, ws.q_lora.data());
    rms_norm(ws.q_lora.data(), T, m.q_lora_rank, p.q_a_norm.data(), kMlaNormEps, ws.q_lora.data());
    cpu::linear(ws.q_lora.data(), T, w.q_b_proj, nullptr, ws.q.data());
  } else {
    cpu::linear(ws.normed.data(), T, w.q_proj, nullptr, ws.q.data());
  }
  // Latent and shared rope key [T, L + rope]; the latent is normalised, the key rotated.
  cpu::linear(ws.normed.data(), T, w.kv_a_proj, nullptr, ws.latent.data());
  for (int64_t t = 0; t < T; ++t) {
    const SequenceBatch& s = batch.sequences[ws.slots.sequence[t]];
    const int64_t position = ws.slots.position[t];
    float* row = ws.latent.data() + t * width;
    rms_norm(row, 1, L, p.kv_a_norm.data(), kMlaNormEps, row);
    rope_.apply(row + L, 1, rope_dim, position, interleaved(plans_[layer].rope));
    rope_.apply(ws.q.data() + t * Nh * qk + nope, Nh, qk, position,
                interleaved(plans_[layer].rope));
    const CacheSlot at = cache_slot(pool, s, position);
    pool.write_key(layer, at.block, at.slot, row);
  }

  // Absorb the key up-projection into the query: q_latent[t, h] = W_uk[h]^T q_nope[t, h], where
  // W_uk[h] is rows [h*(nope+v), h*(nope+v) + nope) of kv_b_proj.
  const TensorView& kv_b = w.kv_b_proj;
  std::fill(ws.q_latent.begin(), ws.q_latent.end(), 0.0f);
  parallel_for(Nh, [&](int64_t h_begin, int64_t h_end) {
    std::vector<float> w_row(L);
    for (int64_t h = h_begin; h < h_end; ++h) {
      for (int64_t d = 0; d < nope; ++d) {
        convert_to_f32(kv_b.dtype, kv_b.row(h * (nope + vd) + d), w_row.data(), L);
        for (int64_t t = 0; t < T; ++t) {
          const float q = ws.q[(t * Nh + h) * qk + d];
          float* dst = ws.q_latent.data() + (t * Nh + h) * L;
          for (int64_t c = 0; c < L; ++c) dst[c] += q * w_row[c];
        }
      }
    }
  });

  // Attention over the cached rows: score = q_latent . latent_j + q_rope . key_j.
  const float scale = attention_scale_;
  parallel_for(T * Nh, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> cached(width);  // a cached row as float32 (unused for f32 rows)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Nh;
      const int64_t h = task % Nh;
      const SequenceBatch& s = batch.sequences[ws.slots.sequence[t]];
      const int64_t count = ws.slots.position[t] + 1;
      const float* q_lat = ws.q_latent.data() + (t * Nh + h) * L;
      const float* q_rope = ws.q.data() + (t * Nh + h) * qk + nope;
      scores.resize(count);
      float max_score = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        const CacheSlot at = cache_slot(pool, s, j);
        const float* row = pool.read_key(layer, at.block, at.slot, 0, width, cached.data());
        float dot = 0.0f;
        for (int64_t c = 0; c < L; ++c) dot += q_lat[c] * row[c];
        for (int64_t r = 0; r < rope_dim; ++r) dot += q_rope[r] * row[L + r];
        scores[j] = dot * scale;
        max_score = std::max(max_score, scores[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < count; ++j) sum += scores[j] = std::exp(scores[j] - max_score);
      float* out = ws.o_latent.data() + (h * T + t) * L;  // [Nh, T, L]
      std::fill_n(out, L, 0.0f);
      for (int64_t j = 0; j < count; ++j) {
        const float weight = scores[j] / sum;
        const CacheSlot at = cache_slot(pool, s, j);
        const float* row = pool.read_key(layer, at.block, at.slot, 0, L, cached.data());
        for (int64_t c = 0; c < L; ++c) out[c] += weight * row[c];
      }
    }
  });

  // Lift each head's latent output through its value rows W_uv[h] ([v, L]) of kv_b_proj.
  for (int64_t h = 0; h < Nh; ++h) {
    const TensorView w_uv{
        .dtype = kv_b.dtype, .shape = {vd, L}, .data = kv_b.row(h * (nope + vd) + nope)};
    cpu::linear(ws.o_latent.data() + h * T * L, T, w_uv, nullptr, ws.head_out.data());
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(ws.head_out.data() + t * vd, vd, ws.attn.data() + (t * Nh + h) * vd);
    }
  }
  cpu::linear(ws.attn.data(), T, w.o_proj, nullptr, ws.block_out.data());
}

void Decoder::dense_mlp(const MlpWeights& mlp, int64_t T, const float* in, float* out,
                        Workspace& ws) {
  const int64_t width = mlp.gate_proj.shape[0];
  ws.gate.resize(T * width);
  ws.up.resize(T * width);
  cpu::linear(in, T, mlp.gate_proj, nullptr, ws.gate.data());
  cpu::linear(in, T, mlp.up_proj, nullptr, ws.up.data());
  silu_mul(ws.gate.data(), ws.up.data(), T * width);
  cpu::linear(ws.gate.data(), T, mlp.down_proj, nullptr, out);
}

void Decoder::feed_forward(int64_t layer, int64_t T, Workspace& ws) {
  const LayerWeights& lw = weights_.layers[layer];
  const LayerPlan& plan = plans_[layer];
  switch (plan.feed_forward) {
    case FeedForwardKind::kDenseMlp: {
      MOE_PROFILE_SCOPE(profile::Stage::kDenseMlp);
      dense_mlp(lw.mlp, T, ws.normed.data(), ws.block_out.data(), ws);
      return;
    }
    case FeedForwardKind::kMoe:
      break;
  }
  moe_block_->forward(
      layer, ws.normed.data(), T, layer_router(layer), [&] { return shared_experts(layer, T, ws); },
      shared_schedule_, ws.block_out.data(), route_adjust(layer));
  observe_routing(layer, moe_block_->routing());
}

moe::RouteAdjust Decoder::route_adjust(int64_t layer) const {
  if (!routing_override_) return {};
  return
      [this, layer](const float* logits, const moe::RouterOptions& router, moe::Routing& routing) {
        routing_override_(layer, logits, router, routing);
      };
}

void Decoder::observe_routing(int64_t layer, const moe::Routing& routing) const {
  if (routing_observer_) routing_observer_(layer, routing);
  if (profile::Profiler* p = profile::active()) p->record_routing(layer, routing.topk_ids);
}

void Decoder::start_moe(int64_t layer, int64_t T, Workspace& ws, moe::MoeBlock& block) {
  // The lambda reads ws.normed when the block asks (start or run_experts): it stays put until
  // the layer finishes.
  block.start(
      layer, ws.normed.data(), T, layer_router(layer),
      [this, layer, T, &ws] { return shared_experts(layer, T, ws); }, shared_schedule_,
      route_adjust(layer));
}

const float* Decoder::shared_experts(int64_t layer, int64_t T, Workspace& ws) {
  const LayerWeights& lw = weights_.layers[layer];
  const int64_t H = config_.hidden_size;
  switch (plans_[layer].shared_expert) {
    case SharedExpertKind::kNone:
      return nullptr;
    case SharedExpertKind::kUngated: {
      MOE_PROFILE_SCOPE(profile::Stage::kSharedExperts);
      ws.shared.resize(T * H);
      dense_mlp(lw.moe.shared_expert, T, ws.normed.data(), ws.shared.data(), ws);
      return ws.shared.data();
    }
    case SharedExpertKind::kSigmoidGated: {
      MOE_PROFILE_SCOPE(profile::Stage::kSharedExperts);
      ws.shared.resize(T * H);
      dense_mlp(lw.moe.shared_expert, T, ws.normed.data(), ws.shared.data(), ws);
      std::vector<float> gate_logit(T);
      cpu::linear(ws.normed.data(), T, lw.moe.shared_expert_gate, nullptr, gate_logit.data());
      for (int64_t t = 0; t < T; ++t) {
        const float g = 1.0f / (1.0f + std::exp(-gate_logit[t]));
        for (int64_t h = 0; h < H; ++h) ws.shared[t * H + h] *= g;
      }
      return ws.shared.data();
    }
  }
  return nullptr;
}

}  // namespace moeinfer
