// The CUDA forward pass (model/gpu_decoder.h). One stream carries everything; the host prepares
// each step's metadata (token ids, positions, cache slots, block tables) in pinned memory, copies
// it up, and enqueues the layers. Decode steps replay a CUDA graph captured per (batch bucket,
// context bucket), so a step costs a handful of copies and one graph launch.
//
// Two micro-batches (--ep N --micro-batches 2, GpuOptions::micro_batches) are the exception to
// one stream: the step's sequences split in halves A and B, each with a Lane of its own (a
// stream, a cuBLAS handle, the workspace, an MoE block with its dispatcher). The per-stage
// functions read the lane's members by name, and LaneSwap puts B's lane in place while B's work
// is enqueued, so both micro-batches run the same code as one step. run_micro_batches
// interleaves them per MoE layer through the block's phases (start, run_experts, finish), so
// that the host waits for one micro-batch's offsets and rows while the other's stream computes.
//
// Attention per step takes one of five routes (model/attention_route.h decides):
//   decode         every sequence brings one token: paged decode attention over the block
//                  tables
//   prefill        every sequence starts at position 0: flash-style causal attention over the
//                  new tokens (the cache is written for later steps)
//   paged prefill  anything else (chunked prefill after a cached prefix, mixed steps): flash-
//                  style attention of each sequence's new tokens over its paged keys, one
//                  attention row per sequence (a sequence bringing one token is a row of one)
//   MLA prefill    an MLA model's every non-decode step: flash attention of each sequence's
//                  absorbed queries over its paged latent rows, one attention row per sequence
//                  as paged prefill (mla_attention() runs it, mla_prefill_attention)
//   per-query      what the flash kernels do not cover (head dims past 128, MLA rows past
//                  512 + 64, --deterministic): each new token is its own query row over its
//                  sequence's blocks, with length position + 1, through the paged decode kernel
//
// --deterministic (GpuOptions::deterministic) changes three things, each so that a token's
// logits depend on nothing but its sequence: products run the fixed-order dense GEMM instead
// of cuBLAS (linear(), absorbed()), prompts take the per-query route (never the flash prefill
// kernels, whose reduction order differs from a decode row's), and attention splits keys in
// chunks fixed at start-up (attention_chunk_) instead of by the batch. The grouped expert GEMM
// keeps to its mma.sync tiles (ExpertShape::batch_invariant: every one reduces an element in the
// same order, cuda-kernels.md; the Hopper wgmma kernel does not); and fp8 x fp8 is off
// (fp8_act_), as its choice and its activation rounding follow the step's rows.
#include "model/gpu_decoder.h"

#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>

#include "backend/cuda/attention.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decode_layers.h"
#include "backend/cuda/decoder_ops.h"
#include "backend/cuda/dense_gemm.h"
#include "backend/cuda/device_floors.h"
#include "backend/cuda/gated_delta_net.h"
#include "backend/cuda/grouped_gemm.h"
#include "backend/cuda/mla_attention.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/programmatic_launch.h"
#include "backend/cuda/route_plan.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/skinny_gemm.h"
#include "backend/cuda/small_batch_moe.h"
#include "core/error.h"
#include "model/cuda/cached_experts.h"
#include "model/cuda/device_weights.h"
#include "model/cuda/expert_parallel.h"
#include "model/cuda/moe_block.h"
#include "model/family.h"
#include "model/layer_plan.h"
#include "model/model_facts.h"
#include "model/rope.h"
#include "offload/parse_options.h"
#include "profile/profiler.h"

namespace moeinfer {
namespace gpu {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// The workspace (activations of the largest step) may take up to this share of what the memory
// budget leaves after the weights; the KV pool takes the rest.
constexpr double kMaxWorkspaceShare = 0.5;
// T*K up to which MoE layers take the small-batch path unless GpuOptions says otherwise. 0 (off):
// on an H200 it is slower than the stage-by-stage path at every T (bench/RESULTS.md,
// 2026-12-04); --fused-moe-rows N turns it on.
constexpr int64_t kSmallMoeDefaultRows = 0;
// Tokens up to which MoE layers route and plan in one launch unless GpuOptions says otherwise.
// 0 (off): on an H100 it saves two launches a layer but no time at batch 1 (4.762 against 4.722
// ms a step) and loses at batch 8 (12.436 against 11.879 ms): its router product runs on E / 8
// blocks, one token after another (bench/RESULTS.md, 2026-12-07). --fused-route-tokens N turns
// it on.
constexpr int64_t kDefaultFusedRouteTokens = 0;
constexpr int64_t kMinContextBucket = 256;
constexpr float kMlaNormEps = 1e-6f;
// Gated DeltaNet L2-normalises q and k with this epsilon inside the square root (as the CPU).
constexpr float kLinearL2NormEps = 1e-6f;
// Records a stage event. Under stream capture a plain cudaEventRecord only orders streams inside
// the graph; cudaEventRecordExternal makes it an event-record node that fires on every replay,
// so the events of a profiled graph can be timed (the flag is refused outside a capture).
void record_event(cudaEvent_t event, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusActive) {
    CUDA_CHECK(cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal));
  } else {
    CUDA_CHECK(cudaEventRecord(event, stream));
  }
}

int64_t next_pow2(int64_t v) {
  int64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A captured graph's nodes by kind: what replaying it launches.
GpuDecoder::GraphCounts count_graph_nodes(cudaGraph_t graph) {
  size_t num_nodes = 0;
  CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
  std::vector<cudaGraphNode_t> nodes(num_nodes);
  CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &num_nodes));
  GpuDecoder::GraphCounts counts;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel) {
      ++counts.kernels;
    } else if (type == cudaGraphNodeTypeMemcpy || type == cudaGraphNodeTypeMemset) {
      ++counts.copies;
    } else if (type != cudaGraphNodeTypeEmpty) {
      ++counts.other;
    }
  }
  return counts;
}

// Qwen3-Next / Qwen3.5-MoE: Gated DeltaNet layers, each with a recurrent state per sequence.
bool has_linear_layers(const ModelConfig& c) {
  return c.linear_attention.has_value() && c.num_linear_layers() > 0;
}

using Route = AttentionRoute;
static_assert(kPagedPrefillMaxGqaGroup == cuda::kPagedPrefillMaxGroup,
              "the route predicate and the paged prefill kernel disagree on the GQA group");
static_assert(kMlaPrefillMaxLatent == cuda::kMlaPrefillMaxLatentDim &&
                  kMlaPrefillMaxRow == cuda::kMlaPrefillMaxCacheWidth,
              "the route predicate and the MLA prefill kernel disagree on the widest row");

// Step metadata, the same layout on the host (pinned) and the device.
struct Meta {
  // [1] the step's real token rows (the rest pad a graph bucket), right before ids so that one
  // copy uploads both.
  int32_t* num_valid = nullptr;
  int32_t* ids = nullptr;          // [Tcap]
  int32_t* positions = nullptr;    // [Tcap]
  int32_t* slots = nullptr;        // [Tcap]
  int32_t* seq_lens = nullptr;     // [Tcap] per attention row
  int32_t* cu_seqlens = nullptr;   // [Tcap + 1]
  int32_t* paged_tile_starts = nullptr;  // [Tcap + 1] the paged prefill work list (per sequence)
  int32_t* logit_rows = nullptr;   // [Tcap]
  int32_t* block_tables = nullptr;  // [Tcap, max_blocks]
  float* temperature = nullptr;    // [Rcap]
  int32_t* top_k = nullptr;
  float* top_p = nullptr;
  uint64_t* seeds = nullptr;
  uint64_t* steps = nullptr;
  int32_t* tokens = nullptr;  // [Rcap] sampled
  // [Tcap] a synthetic uniform router's per-token keys (RouterParams::noise_keys): a new key for
  // every token of every step, or null when no layer routes by noise.
  int32_t* route_keys = nullptr;
  // [Tcap] per sequence, its recurrent state slot (-1: a graph bucket's padding), with models
  // that have Gated DeltaNet layers; else null.
  int32_t* state_slots = nullptr;

  void carve(Carver& c, int64_t tcap, int64_t rcap, int64_t max_blocks, bool keys,
             bool states) {
    num_valid = c.take<int32_t>(tcap + 1);
    ids = num_valid ? num_valid + 1 : nullptr;
    positions = c.take<int32_t>(tcap);
    slots = c.take<int32_t>(tcap);
    seq_lens = c.take<int32_t>(tcap);
    cu_seqlens = c.take<int32_t>(tcap + 1);
    paged_tile_starts = c.take<int32_t>(tcap + 1);
    logit_rows = c.take<int32_t>(tcap);
    block_tables = c.take<int32_t>(tcap * max_blocks);
    temperature = c.take<float>(rcap);
    top_k = c.take<int32_t>(rcap);
    top_p = c.take<float>(rcap);
    seeds = c.take<uint64_t>(rcap);
    steps = c.take<uint64_t>(rcap);
    tokens = c.take<int32_t>(rcap);
    route_keys = keys ? c.take<int32_t>(tcap) : nullptr;
    state_slots = states ? c.take<int32_t>(tcap) : nullptr;
  }
};

// What one forward() runs, decided on the host.
struct Step {
  Route route = Route::kDecode;
  int64_t num_tokens = 0;   // T, rows through the layers (padded for graphs)
  int64_t num_valid = 0;    // the real ones among them, rows [0, num_valid)
  int64_t num_rows = 0;     // attention rows (T, or sequences for prefill and paged prefill)
  int64_t num_seqs = 0;
  // Sequences the linear-attention kernels run over: num_seqs, or a graph's bucket (decode
  // rows are sequences; the padding ones have state slot -1).
  int64_t num_state_seqs = 0;
  int64_t max_seq_len = 0;  // bound for the attention grids
  int64_t paged_tiles = 0;  // paged prefill: the query tiles of all sequences (the grid)
  int64_t table_stride = 0;  // block table row width this step
  int64_t logit_rows = 0;   // rows that want logits
  bool logits_are_all_rows = false;  // rows 0..logit_rows-1 of the final hidden state
  bool graph = false;
  int64_t context_bucket = 0;
};

// What each micro-batch has of its own (GpuOptions::micro_batches): a stream and a cuBLAS handle
// (with its workspace), the device workspace with the step's metadata and activations, and an
// MoE block with its dispatcher. CudaDecoder is one lane (a base, so that every per-stage
// function reads these members by their names); with two micro-batches the second lane waits
// in CudaDecoder::lane_b_ and is swapped in (CudaDecoder::LaneSwap) while B's work is enqueued,
// so the stages run for either micro-batch unchanged. Ordered so that the MoE block goes first
// and the stream last.
struct Lane {
  StreamHandle owned_stream_;  // owners; stream_ and cublas_ are what every call passes
  CublasHandle owned_cublas_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;

  // Device workspace (allocate_workspace carves it).
  DeviceArray<char> workspace_;
  PinnedArray<char> host_meta_base_;         // pinned mirror of meta_
  PinnedArray<int32_t> host_expert_counts_;  // [L, E + 1]: the plan's counts, for the profiler
  Meta meta_, host_meta_;
  float* inv_freq_ = nullptr;
  // The residual stream and the block outputs that join it are float32 (see RmsNormParams).
  float *hidden_ = nullptr, *block_out_ = nullptr;  // [T, Hp]
  // hidden_ is where the residual stream is now. A folded norm writes the sum to hidden_spare_
  // (its blocks read all of hidden_ while they write) and the two swap (residual_norm); each
  // step starts (enqueue_embedding) with both back on their own rows, so that a step of more
  // rows than the spare holds never writes it.
  float* hidden_rows_ = nullptr;        // [T, Hp]
  float* hidden_spare_rows_ = nullptr;  // [min(T, cuda::kSkinnyGemmMaxRows), Hp]
  float* hidden_spare_ = nullptr;
  bf16 *normed_ = nullptr, *normed_gathered_ = nullptr;
  bf16 *qkv_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *attn_ = nullptr;
  // Gated DeltaNet: the in-projection [T, C + Vd + 2 Nv] (q|k|v, z, b, a), the conv's output
  // [T, C], the recurrence's [T, Vd] (float32) and the gated norm's [T, Vd] (bf16).
  float *lin_proj_ = nullptr, *lin_conv_ = nullptr, *lin_core_ = nullptr;
  bf16* lin_normed_ = nullptr;
  bf16 *mla_q_ = nullptr, *mla_q_lora_ = nullptr, *mla_latent_ = nullptr, *mla_q_full_ = nullptr,
       *mla_out_latent_ = nullptr;
  float* attn_workspace_ = nullptr;
  // [T, Nq] int32: the decode attention's split tickets (PagedDecodeParams::split_tickets),
  // zeroed once; GQA layers only (null with MLA).
  int32_t* attn_split_tickets_ = nullptr;
  int32_t* expert_counts_ = nullptr;  // [L, E + 1] the plans' counts, for the profiler
  // Two weight terms: the float32 sums of a product whose output is bf16 (LinearArgs).
  float* term_sum_ = nullptr;
  MoeBlockBuffers moe_buffers_;  // the MoE block's part of the workspace
  bf16* expert_act_ = nullptr;   // [T*K, Ip] the experts' activation
  // fp8 x fp8's quantised expert rows (GpuOptions::fp8_tensor_cores), or nulls: weight-only.
  Fp8ActivationBuffers fp8_act_;
  // [T*K, Hp] the experts' weighted inputs in plan order (Llama 4's routing weights on the
  // input, LocalDispatcher), else null
  bf16* weighted_rows_ = nullptr;
  // --ep: [T*K, Hp] the plan's rows gathered for the device dispatch, and the dispatcher
  // (owned by moe_), whose byte counts expert_parallel_bytes reports; else null.
  bf16* ep_plan_rows_ = nullptr;
  const DeviceDispatcher* ep_dispatcher_ = nullptr;
  bf16 *mlp_gate_up_ = nullptr, *mlp_act_ = nullptr;
  // [largest quantised dense N * K] a quantised dense Linear's values in bf16, for the GEMMs of
  // steps the quantised skinny GEMM does not take (linear()); null without such matrices.
  bf16* dense_scratch_ = nullptr;
  float* logits_ = nullptr;  // [rcap, V]
  void* cublas_workspace_ = nullptr;
  std::unique_ptr<MoeBlock> moe_;  // null without MoE layers
  // Where this lane's routing rows start in the routing capture buffers (set_routing_observer):
  // 0, or micro-batch A's token rows for B.
  int64_t routing_row_offset_ = 0;
};

class CudaDecoder final : public GpuDecoder, private Lane {
 public:
  CudaDecoder(const ModelConfig& config, DeviceWeights weights, const GpuOptions& options);
  ~CudaDecoder() override;

  const ModelConfig& config() const override { return config_; }
  const GpuMemoryReport& memory() const override { return report_; }
  int64_t num_kv_blocks() const override { return num_blocks_; }
  int64_t block_size() const override { return block_size_; }
  int64_t max_model_len() const override { return max_model_len_; }
  int64_t num_state_slots() const override { return num_state_slots_; }

  void forward(const ForwardBatch& batch, std::span<float> logits) override;
  void forward_sample(const ForwardBatch& batch, std::span<const GpuSamplingRow> rows,
                      std::span<int32_t> tokens) override;
  std::vector<int32_t> expert_counts() override;
  std::vector<int64_t> expert_cache_counters() override;
  void set_routing_observer(Decoder::RoutingObserver observer) override;
  void set_routing_approximation(const moe::RoutingApproximation& approx) override;
  GraphCounts decode_graph_counts() const override { return decode_graph_counts_; }
  void set_profiler_capture(bool on) override {
    CUDA_CHECK(cudaDeviceSynchronize());  // the capture holds whole steps, nothing of another
    CUDA_CHECK(on ? cudaProfilerStart() : cudaProfilerStop());
  }
  AttentionRouteCounts attention_route_counts() const override { return route_counts_; }
  std::vector<int64_t> expert_parallel_bytes() const override {
    if (ep_dispatcher_ == nullptr) return {};
    const auto& bytes = ep_dispatcher_->bytes_sent();
    std::vector<int64_t> sent(bytes.begin(), bytes.end());
    if (lane_b_.ep_dispatcher_ != nullptr) {  // micro-batch B's rows
      const auto& b = lane_b_.ep_dispatcher_->bytes_sent();
      for (size_t i = 0; i < sent.size(); ++i) sent[i] += b[i];
    }
    return sent;
  }
  const parallel::Communicator* expert_parallel() const override {
    return options_.expert_parallel;
  }

 private:
  // Device bytes counted against the budget, given what is in use on the whole device now:
  // all of it when the decoder has the card to itself, only its own allocations (weights,
  // workspace, recurrent state) when ranks of an --ep job share it (GpuOptions::ranks_on_device).
  int64_t budget_in_use(int64_t device_in_use) const;
  void allocate_workspace();
  void allocate_kv_pool();
  // The Gated DeltaNet layers' recurrent state for num_state_slots_ sequences (before the KV
  // pool, which takes what is left).
  void allocate_state_pool();
  Step prepare(const ForwardBatch& batch);
  void count_route(Route route);
  // Everything from the embedding to the logits of rows [0, step.logit_rows) of the first
  // chunk: enqueued directly or replayed from a graph.
  void run(const Step& step);
  void enqueue_layers(const Step& step);
  // The pieces of enqueue_layers: the embedding; layer l's input norm, attention and post
  // norm; the final norm and the gather of the rows that want logits.
  void enqueue_embedding(const Step& step);
  void enqueue_attention_block(int64_t layer, const Step& step);
  void enqueue_final_norm(const Step& step);
  // A residual-fused RMSNorm into normed_: left pending when `next_is_linear` (the next read
  // of normed_ is a linear() of this step) and the step's rows may take the skinny GEMM, for that
  // product to fold in (its sum then goes to hidden_spare_, which becomes hidden_); else
  // launched now.
  void residual_norm(cuda::RmsNormParams params, bool next_is_linear);
  // Launches the pending norm, if any: before anything but a folding product reads normed_.
  void flush_norm();
  // Launches `product` (a skinny GEMM's params, bf16 or quantised) with the pending norm folded
  // in, where it reads that norm's whole rows and the kernel takes the fold; whether it did.
  template <typename Params>
  bool launch_folded(const Params& product, bool (*supports)(const Params&),
                     void (*launch)(const Params&, cudaStream_t)) {
    if (!pending_norm_ || pending_norm_->out != product.x ||
        (product.ldx != 0 && product.ldx != product.k)) {
      return false;
    }
    Params folded = product;
    folded.x = nullptr;
    folded.norm = *pending_norm_;
    if (!supports(folded)) return false;
    launch(folded, stream_);
    pending_norm_.reset();
    return true;
  }

  // Two micro-batches (GpuOptions::micro_batches). LaneSwap puts lane m's members in place (m 1:
  // B's, swapped with lane_b_; m 0: nothing) until it goes out of scope.
  class LaneSwap {
   public:
    LaneSwap(CudaDecoder& decoder, int m) : decoder_(decoder), swapped_(m == 1) {
      if (swapped_) decoder_.swap_lanes();
    }
    ~LaneSwap() {
      if (swapped_) decoder_.swap_lanes();
    }
    LaneSwap(const LaneSwap&) = delete;
    LaneSwap& operator=(const LaneSwap&) = delete;

   private:
    CudaDecoder& decoder_;
    bool swapped_;
  };
  void swap_lanes() { std::swap(static_cast<Lane&>(*this), lane_b_); }
  // A new stream and cuBLAS handle for the lane in place.
  void create_stream();
  // The step's sequences split as the CPU decoder splits them: A the first half (the larger
  // when odd), B the rest; each prepared in its lane (metadata uploaded on its stream).
  std::array<Step, 2> prepare_micro_batches(const ForwardBatch& batch);
  // Both micro-batches' layers, up to their final norms, on their streams: interleaved per MoE
  // layer (overlap_micro_batches), or A's whole step, then B's.
  void run_micro_batches(const std::array<Step, 2>& steps);
  // Micro-batch m (in place) from layer `first` on: dense layers whole, up to and including
  // the start of the next MoE layer's block (returned), or to the final norm (returns L).
  int64_t advance_micro_batch(const Step& step, int64_t first);
  void forward_micro_batches(const ForwardBatch& batch, std::span<float> logits);
  void forward_sample_micro_batches(const ForwardBatch& batch, std::span<const GpuSamplingRow> rows,
                                    std::span<int32_t> tokens);
  // Enqueues the LM head over the step's first R logit rows and the sampling of `rows` (R of
  // them) into host_meta_.tokens, on the lane in place.
  void enqueue_sampling(const Step& step, std::span<const GpuSamplingRow> rows);
  // The MoE block's I/O and profiler marks for layer `layer` of a T-row step.
  MoeLayerIo moe_io(int64_t layer, int64_t num_tokens);
  StageMarks stage_marks();
  // The step-level report after both lanes' streams are done: the profiler (counts summed over
  // the lanes) and the routing observer.
  void report_micro_batches(const std::array<Step, 2>& steps);
  void enqueue_lm_head(const Step& step, int64_t first_row, int64_t rows);
  void attention(int64_t layer, const Step& step);
  void mla_attention(int64_t layer, const Step& step);
  // A Gated DeltaNet layer: in-projection, conv, delta rule, gated norm, out-projection.
  void linear_attention(int64_t layer, const Step& step);
  void qk_norm_clip_rope_write(int64_t layer, const Step& step);
  // The layer's dense MLP, or its MoE block (moe_block.h).
  void feed_forward(int64_t layer, int64_t num_tokens);
  // The MoE block over this decoder's weights, buffers and products (after the workspace).
  void build_moe_block();
  // out[num_tokens, Hp] = down(silu(gate) * up) of x, in bf16 or float32.
  void dense_mlp(const bf16* x, const bf16* gate_up, const bf16* down, int64_t width,
                 int64_t num_tokens, void* out, bool f32_out);
  void upload_meta(const Step& step);
  // Whether the layer's RoPE pairs dims (2i, 2i + 1) rather than halves (LayerPlan::rope); a
  // layer without RoPE is refused at load.
  bool interleaved_rope(int64_t layer) const;
  // The attention kernels' attention_chunk for a layer: attention_chunk_size on Llama 4's
  // chunked layers, 0 (off) elsewhere.
  int64_t attention_chunk_of(const LayerPlan& plan) const;

  // One Linear: y[rows, n] = x[rows, k] . W[n, k]^T, row strides in elements (0: n or k).
  struct LinearArgs {
    const bf16* x = nullptr;
    int64_t rows = 0;
    int64_t x_stride = 0;
    const bf16* w = nullptr;  // [n, k], followed by its lo term [n, k] with two weight terms
    int64_t n = 0;
    int64_t k = 0;
    void* y = nullptr;  // float32 (f32_out) or bf16
    int64_t y_stride = 0;
    bool f32_out = false;
    bool allow_skinny = true;  // false: cuBLAS at any row count (GpuOptions::skinny_gemm_rows)
  };
  // A quantised dense matrix (DeviceWeights::dense_quant) takes the quantised skinny GEMM or
  // is dequantised into dense_scratch_ for the bf16 paths; others go to linear_bf16.
  void linear(const LinearArgs& args);
  // The bf16 weight's product: the fixed-order GEMM (--deterministic), the skinny GEMM or cuBLAS;
  // one_term: the weight has one term whatever the model's (the dequantised scratch).
  void linear_bf16(const LinearArgs& args, bool one_term = false);
  // MLA's per-head products, one batch entry per head (cuBLAS, or the fixed-order GEMM); b_lo set
  // with two weight terms.
  void absorbed(const cuda::DenseGemmParams& product);
  // The second bf16 term of the weight at w, a matrix or norm of `elems` values (its lo matrix
  // follows it), or null when the weights have one term.
  const bf16* lo_term(const bf16* w, int64_t elems) const {
    return w_.weight_terms == 2 && w != nullptr ? w + elems : nullptr;
  }
  // A norm weight's second term (DeviceWeights::norm_terms), or null.
  const bf16* norm_lo(const bf16* w, int64_t elems) const {
    return w_.norm_terms == 2 && w != nullptr ? w + elems : nullptr;
  }

  ModelConfig config_;
  std::vector<LayerPlan> plans_;  // plan_layers(config_): what each layer runs
  DeviceWeights w_;
  // The dense Linears held as quantised slabs (DeviceWeights::dense_quant), by the pointer that
  // LinearArgs::w passes.
  std::unordered_map<const void*, const DenseQuantMatrix*> dense_quant_;
  GpuOptions options_;
  GpuMemoryReport report_;
  float attention_scale_ = 1.0f;
  int64_t rotary_dim_ = 0;
  float rope_scaling_ = 1.0f;
  int64_t max_model_len_ = 0;
  int64_t block_size_ = 16;
  int64_t num_blocks_ = 0;
  int64_t max_blocks_per_seq_ = 0;
  int64_t tcap_ = 0;  // rows one step may carry
  int64_t rcap_ = 0;  // logits rows computed at once
  // --deterministic: keys per attention split, the same for every step (0: by the batch).
  int64_t attention_chunk_ = 0;

  size_t meta_bytes_ = 0;
  int64_t qkv_width_ = 0;  // qkv_'s row: (Nq + 2 Nkv) Dp, and Nq Dp of output gates after them
  int64_t term_sum_elems_ = 0;
  // Some layer's router is a synthetic uniform or Zipf one (DeviceLayer::router_noise): each step gets
  // fresh per-token keys (Meta::route_keys); noise_step_ counts the steps.
  bool noise_routing_ = false;
  uint64_t noise_step_ = 0;
  std::unique_ptr<CachedExperts> cache_;  // --expert-budget; null: every expert resident
  // --micro-batches 2: micro-batch B's lane while A's (this decoder's own) is in use, and A's
  // while B's is swapped in (LaneSwap); empty with one micro-batch.
  Lane lane_b_;
  bool two_lanes_ = false;
  // The norm residual_norm left for the next product to fold in; empty outside a layer.
  std::optional<cuda::RmsNormParams> pending_norm_;
  // The persistent decode-layers kernel (GpuOptions::persistent_layers): which layers it can
  // run, their weights and caches as it reads them followed by its scratch (device memory),
  // and its shapes (their `layers` and `scratch` pointing there).
  std::vector<char> persistent_layer_;  // [L]
  DeviceArray<char> persistent_memory_;
  cuda::DecodeLayersParams persistent_;
  // MOE_PERSISTENT_CLOCK=1: the kernel's per-stage clock (DecodeLayersParams::stage_clock),
  // printed per layer when the decoder goes; null otherwise.
  DeviceArray<unsigned long long> persistent_clock_;
  void report_persistent_clock();
  void build_persistent_layers();
  // How many layers from `first` on this step runs in the persistent kernel (0: none).
  int64_t persistent_run(const Step& step, int64_t first) const;
  void enqueue_persistent_layers(int64_t first, int64_t count);
  // --overlap off: recorded after A's step on A's stream, waited for by B's.
  cudaEvent_t a_done_ = nullptr;

  // KV pool: per layer, keys and values (standard) or latent rows (MLA), as bf16 rows; under
  // --kv-dtype fp8 as e4m3 codes [slots, Nkv * Dp] and float32 scales [slots, Nkv] per layer and
  // plane instead (backend/cuda/kv_fp8.cuh), k_cache_ and v_cache_ then null; MLA under fp8:
  // k_codes_ / k_scales_ the latent's [slots, Lp] / [slots], v_codes_ / v_scales_ the rope
  // key's [slots, Rp] / [slots].
  DeviceArray<char> kv_pool_;
  std::vector<bf16*> k_cache_, v_cache_;
  std::vector<uint8_t*> k_codes_, v_codes_;
  std::vector<float*> k_scales_, v_scales_;
  bool kv_fp8_ = false;
  int64_t kv_width_ = 0;  // elements per cache row (Nkv * Dp, or L + R)
  // The recurrent state of Gated DeltaNet layers, float32, indexed by the host's state slots
  // (StateSlots; SequenceBatch::state_slot): per linear layer [slots, C, taps - 1] conv windows
  // and [slots, Nv, Dk, Dv] delta rule states, null for the other layers. A slot is zeroed by
  // the kernels themselves when its sequence runs from position 0.
  DeviceArray<char> state_pool_;
  std::vector<float*> conv_state_, delta_state_;
  int64_t num_state_slots_ = 0;

  // Stage timing with CUDA events, when a profiler is installed on the calling thread (see
  // profile/profiler.h): an event after each stage of each layer, recorded into the graph of a
  // profiled bucket too, read back once the step is done. Each event closes the stage named by
  // its Mark (norms count with the attention before them; the final norm with the LM head).
  struct Mark {
    profile::Stage stage;
    int64_t layer;  // -1: step level
    // The span is the layer's wait for its experts (the cache's admission and demand copies):
    // timed under `stage` and reported as the expert cache's stall as well.
    bool expert_wait = false;
  };
  struct Timeline {
    std::vector<cudaEvent_t> events;  // events[0] opens the step, events[i + 1] closes marks[i]
    std::vector<Mark> marks;
  };
  void begin_timeline(Timeline* timeline);
  void mark(profile::Stage stage, int64_t layer, bool expert_wait = false);
  // With a profiler installed: the plan's counts to pinned memory, ahead of the step's
  // synchronisation, so that counting rows costs no round trip of its own.
  void enqueue_profile_readback();
  // Stage times (of a timed step), expert rows and bytes moved of the finished step, into the
  // profiler.
  void report_step(profile::Profiler& profiler, const Step& step);
  // The expert cache's counters since the last report (read back with the plan's counts), with
  // the step's stall per layer (seconds; empty when its stages were not timed).
  void report_expert_cache(profile::Profiler& profiler, std::span<const double> stall_s);
  std::vector<int64_t> reported_cache_counters_;  // [L, kNumCacheCounters] at the last report

  struct Graph {
    cudaGraphExec_t exec = nullptr;
    Timeline timeline;  // profiled graphs only
  };
  std::map<std::tuple<int64_t, int64_t, bool, bool>, Graph> graphs_;  // (T, ctx, events, routing)
  GraphCounts decode_graph_counts_;  // of the last graph captured
  bool profiling_ = false;
  // Routing capture (set_routing_observer): the router's output of every layer, [L, Tcap + 1, K]
  // ids and weights on the device (where the router writes while capturing) and in pinned
  // memory.
  Decoder::RoutingObserver routing_observer_;
  bool tracing_ = false;  // this step copies the router's output (routing_observer_ set)
  DeviceArray<int32_t> routing_ids_;
  PinnedArray<int32_t> host_routing_ids_;
  DeviceArray<float> routing_weights_;
  PinnedArray<float> host_routing_weights_;
  void enqueue_routing_readback(const Step& step);
  void report_routing(const Step& step);
  // Rows per layer of the routing capture buffers: a step's Tcap, and one more for micro-batch
  // B's padding row when A has taken all Tcap (B's rows follow A's).
  int64_t routing_pitch() const { return tcap_ + 1; }
  void drop_graphs();  // destroys every captured graph (they are captured again on demand)
  bool graph_events_time_ = true;  // cleared if events recorded by a graph cannot be timed
  Timeline eager_timeline_;
  Timeline* timeline_ = nullptr;  // where mark() records, while profiling
  // Around the sampling kernel of a timed forward_sample, which runs after the step's graph.
  cudaEvent_t sample_events_[2] = {nullptr, nullptr};
  bool sample_timed_ = false;
  int64_t host_device_bytes_ = 0;  // this step's copies between host and device
  AttentionRouteCounts route_counts_;  // steps per attention route since creation
};

CudaDecoder::CudaDecoder(const ModelConfig& config, DeviceWeights weights,
                         const GpuOptions& options)
    : config_(config), plans_(plan_layers(config)), w_(std::move(weights)), options_(options) {
  MOE_CHECK(options.gpu_memory_fraction > 0.0 && options.gpu_memory_fraction <= 1.0,
            "--gpu-memory-fraction ", options.gpu_memory_fraction, " must be in (0, 1]");
  MOE_CHECK(options.block_size >= 8 && options.block_size <= 128,
            "block size ", options.block_size, " must be in [8, 128]");
  MOE_CHECK(options.max_batch_tokens >= 1, "max batch tokens must be >= 1");
  if (options.expert_parallel != nullptr) {  // --ep N: model/cuda/expert_parallel.h
    MOE_CHECK(!options.offload.enabled(),
              "--ep with --expert-budget is not supported yet on --device cuda (CPU ranks take "
              "both): offload or shard the experts");
    MOE_CHECK(config.num_experts > 0, "--ep: the ", config.model_type,
              " model has no routed experts to shard");
    // The dispatch waits for the plan's offsets and exchanges with the other ranks inside
    // each MoE layer: no step can be a CUDA graph, and the small-batch path (route and experts
    // in one kernel) has no dispatch stage.
    options_.cuda_graphs = false;
    options_.small_batch_moe_rows = 0;
  }
  MOE_CHECK(options.skinny_gemm_rows <= cuda::kSkinnyGemmMaxRows, "skinny GEMM rows ",
            options.skinny_gemm_rows, " must be at most ", cuda::kSkinnyGemmMaxRows);
  if (options_.skinny_gemm_rows < 0) options_.skinny_gemm_rows = kDefaultSkinnyGemmRows;
  for (const DenseQuantMatrix& m : w_.dense_quant) dense_quant_.emplace(m.data, &m);
  attention_scale_ = attention_softmax_scale(config_);
  const Rope rope(config.rope, config.rotary_dim(), config.max_position_embeddings);
  rotary_dim_ = rope.rotary_dim();
  rope_scaling_ = rope.attention_scaling();
  const int64_t native = config.max_position_embeddings > 0 ? config.max_position_embeddings : 4096;
  max_model_len_ = options.max_model_len > 0 ? std::min(options.max_model_len, native) : native;
  block_size_ = options.block_size;
  max_blocks_per_seq_ = ceil_div(max_model_len_, block_size_);
  rcap_ = std::max<int64_t>(64, next_pow2(std::max<int64_t>(options.max_num_seqs, 1)));
  tcap_ = std::max(options.max_batch_tokens, rcap_);
  attention_chunk_ = options.deterministic ? cuda::batch_invariant_chunk(max_model_len_) : 0;
  // A state slot per sequence the engine may run at once (its StateSlots hands out as many).
  num_state_slots_ = has_linear_layers(config) ? std::max<int64_t>(options.max_num_seqs, 1) : 0;

  MOE_CHECK(options.micro_batches == 1 || options.micro_batches == 2, "micro-batches ",
            options.micro_batches, " must be 1 or 2");
  MOE_CHECK(options.micro_batches == 1 || options.expert_parallel != nullptr,
            "--micro-batches 2 needs --ep N with N > 1: without expert parallelism nothing "
            "travels to overlap");
  two_lanes_ = options.micro_batches == 2;
  create_stream();

  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, options.device));
  report_.device_name = prop.name;
  report_.device_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  // --ep: the ranks on this GPU split the fraction (GpuOptions::ranks_on_device).
  MOE_CHECK(options.ranks_on_device >= 1, "ranks on one device must be >= 1, got ",
            options.ranks_on_device);
  report_.budget_bytes =
      static_cast<int64_t>(options.gpu_memory_fraction * static_cast<double>(prop.totalGlobalMem) /
                           static_cast<double>(options.ranks_on_device));
  report_.weight_bytes = w_.bytes;
  report_.expert_format = cuda::expert_quant_name(w_.expert_quant);
  report_.expert_bytes = w_.expert_bytes;
  if (!w_.dense_quant.empty()) {
    report_.dense_format = cuda::expert_quant_name(w_.dense_quant.front().format);
    report_.dense_quant_matrices = static_cast<int64_t>(w_.dense_quant.size());
    report_.dense_quant_bytes = w_.dense_quant_bytes;
    for (const DenseQuantMatrix& m : w_.dense_quant) report_.dense_quant_values += m.rows * m.cols;
  }
  if (!w_.experts_offloaded) {
    const int64_t moe_layers = std::count_if(w_.layers.begin(), w_.layers.end(),
                                             [](const gpu::DeviceLayer& d) { return d.is_moe; });
    report_.routed_expert_bytes = moe_layers * config_.num_experts * w_.expert_bytes;
  }
  report_.load_seconds = w_.upload_seconds;
  report_.load_gb_per_s =
      w_.upload_seconds > 0 ? static_cast<double>(w_.bytes) / w_.upload_seconds / 1e9 : 0.0;
  if (w_.experts_offloaded) {
    cache_ = std::make_unique<CachedExperts>(config_, w_, options.offload,
                                             options.max_num_seqs * config_.num_experts_per_tok,
                                             tcap_);
    report_.expert_home_bytes = w_.expert_home_bytes;
    report_.expert_cache_bytes = cache_->device_bytes();
    report_.expert_cache_slots = cache_->num_slots();
    report_.expert_host_ns = cache_->cold_cost().host_ns;
    report_.expert_host_row_ns = cache_->cold_cost().host_row_ns;
    report_.weight_bytes += cache_->device_bytes();
  }
  for (const DeviceLayer& d : w_.layers) noise_routing_ = noise_routing_ || d.router_noise;
  allocate_workspace();
  build_moe_block();
  const std::vector<float> inv_freq = rope.inv_freq();
  CUDA_CHECK(cudaMemcpy(inv_freq_, inv_freq.data(), inv_freq.size() * sizeof(float),
                        cudaMemcpyHostToDevice));
  if (two_lanes_) {
    // Micro-batch B's lane: a stream, a workspace and an MoE block (its dispatcher and row
    // transport: collective, so every rank builds B's after A's) of its own.
    const int64_t workspace_a = report_.workspace_bytes;
    {
      LaneSwap b(*this, 1);
      create_stream();
      allocate_workspace();
      build_moe_block();
      CUDA_CHECK(cudaMemcpy(inv_freq_, inv_freq.data(), inv_freq.size() * sizeof(float),
                            cudaMemcpyHostToDevice));
    }
    report_.workspace_bytes += workspace_a;
  }
  allocate_kv_pool();
  build_persistent_layers();
  // Everything above ran on A's stream or B's: done before either runs a step.
  if (two_lanes_) {
    CUDA_CHECK(cudaEventCreateWithFlags(&a_done_, cudaEventDisableTiming));
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  if (!options.quiet && w_.upload_seconds > 0) {
    std::fprintf(stderr, "moeinfer: %.2f GiB of weights streamed to %s in %.2f s (%.2f GB/s)\n",
                 static_cast<double>(w_.bytes) / (1024.0 * 1024.0 * 1024.0),
                 report_.device_name.c_str(), w_.upload_seconds, report_.load_gb_per_s);
  }
  if (!options.quiet && w_.expert_quant != cuda::ExpertQuant::kNone) {
    std::fprintf(stderr,
                 "moeinfer: routed experts held as %s codes with their scales (%.2f MiB an "
                 "expert), dequantised in the expert GEMM\n",
                 cuda::expert_quant_name(w_.expert_quant),
                 static_cast<double>(w_.expert_bytes) / (1024.0 * 1024.0));
  }
  if (!options.quiet && !w_.dense_quant.empty()) {
    std::fprintf(stderr,
                 "moeinfer: %lld dense Linear matrices held as %s codes with their scales (%.2f "
                 "GiB), dequantised in the skinny GEMM at decode or into a %.1f MiB bf16 scratch "
                 "for larger steps\n",
                 static_cast<long long>(w_.dense_quant.size()), report_.dense_format.c_str(),
                 static_cast<double>(w_.dense_quant_bytes) / (1024.0 * 1024.0 * 1024.0),
                 static_cast<double>(w_.dense_quant_max_elems) * 2.0 / (1024.0 * 1024.0));
  }
  if (!options.quiet && w_.expert_codes_unused != nullptr) {
    std::fprintf(stderr,
                 "moeinfer: the routed experts' %s codes are dequantised to bf16 for the expert "
                 "cache (--expert-budget holds bf16 experts; without it the GPU holds the codes)\n",
                 w_.expert_codes_unused);
  }
  if (!options.quiet && w_.weight_terms == 2) {
    std::fprintf(stderr,
                 "moeinfer: float32/float16 weights held as two bf16 terms each (the checkpoint's "
                 "values; twice the bytes and time of bf16: --dtype bfloat16 rounds them to one)\n");
  }
  if (!options.quiet && cache_) {
    const offload::ColdCost& cold = cache_->cold_cost();
    const char* mode = cold.mode == offload::ColdExperts::kGpu   ? "gpu"
                       : cold.mode == offload::ColdExperts::kCpu ? "cpu"
                                                                 : "auto";
    std::fprintf(stderr,
                 "moeinfer: expert cache of %lld slots; cold experts: %s (an expert: copy %.1f "
                 "us, on the host %.1f us + %.1f us per row)\n",
                 static_cast<long long>(cache_->num_slots()), mode, cold.copy_ns * 1e-3,
                 cold.host_ns * 1e-3, cold.host_row_ns * 1e-3);
  }
}

CudaDecoder::~CudaDecoder() {
  if (persistent_clock_) report_persistent_clock();
  drop_graphs();
  if (a_done_) cudaEventDestroy(a_done_);
  for (cudaEvent_t e : eager_timeline_.events) cudaEventDestroy(e);
  for (cudaEvent_t e : sample_events_) {
    if (e) cudaEventDestroy(e);
  }
  // The memory, the stream and the cuBLAS handle go with their owners.
}

void CudaDecoder::create_stream() {
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  owned_stream_.reset(stream_);
  CUBLAS_CHECK(cublasCreate(&cublas_));
  owned_cublas_.reset(cublas_);
  CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
}

void CudaDecoder::allocate_workspace() {
  const ModelConfig& c = config_;
  const int64_t T = tcap_, H = w_.padded_hidden_size, V = c.vocab_size;
  const int64_t E = std::max<int64_t>(c.num_experts, 1), K = std::max<int64_t>(c.num_experts_per_tok, 1);
  const int64_t Dp = w_.padded_head_dim, Ip = w_.padded_expert_width;
  int64_t mlp_width = 0, shared_width = 0;
  for (const DeviceLayer& d : w_.layers) {
    mlp_width = std::max({mlp_width, d.mlp_width, d.shared_width});
    if (d.is_moe) shared_width = std::max(shared_width, d.shared_width);
  }
  // The small-batch MoE path: off with the expert cache (its runner reads experts through a
  // slot table) and under --deterministic (its sums run in another order than the general
  // path's, so a token's result would depend on the step's row count).
  MoeBlockBuffers& mb = moe_buffers_;
  mb.small_moe_rows = 0;
  // It reads one weight term: off with two as well.
  // Llama 4 (weights on the experts' input) never takes it (MoeBlock::small_batch_takes).
  // Quantised experts it reads in the formats and groups small_moe_supports_quant names; others
  // take the grouped GEMM, which dequantises them (MoeBlock::small_batch_takes): no workspace.
  if (c.num_experts > 0 && !cache_ && !options_.deterministic && w_.weight_terms == 1 &&
      !c.routing_weight_on_input &&
      cuda::small_moe_supports_quant(w_.expert_quant, w_.expert_quant_group, H, Ip)) {
    mb.small_moe_rows = options_.small_batch_moe_rows >= 0 ? options_.small_batch_moe_rows
                                                           : kSmallMoeDefaultRows;
    mb.small_moe_rows = std::min(mb.small_moe_rows, cuda::kSmallMoeMaxRows);
  }
  // Route and plan in one launch for small steps: not under --deterministic (its router
  // product sums in another order than the fixed-order GEMM of larger steps) nor with a second
  // weight term (it reads the router's bf16 term only).
  mb.route_plan_tokens = 0;
  if (c.num_experts > 0 && !options_.deterministic && w_.weight_terms == 1) {
    mb.route_plan_tokens =
        options_.fused_route_tokens >= 0 ? options_.fused_route_tokens : kDefaultFusedRouteTokens;
    mb.route_plan_tokens = std::min(mb.route_plan_tokens, cuda::kRoutePlanMaxTokens);
  }
  const int64_t small_moe_bytes =
      mb.small_moe_rows > 0 ? cuda::small_moe_workspace_bytes(std::min(T, cuda::kSmallMoeMaxTokens),
                                                            E, K, H, Ip, shared_width)
                          : 0;

  // Split-K scratch of the attention kernels at their worst shape: the widest window any layer
  // attends over (0: a layer sees its whole context).
  // A chunked layer's query sees at most attention_chunk_size keys: a window of that width for
  // the plan.
  int64_t widest_window = 0;
  bool some_layer_full = plans_.empty();
  for (const LayerPlan& plan : plans_) {
    const int64_t span = std::max(plan.sliding_window, attention_chunk_of(plan));
    some_layer_full = some_layer_full || span == 0;
    widest_window = std::max(widest_window, span);
  }
  const int64_t workspace_window = some_layer_full ? 0 : widest_window;
  int64_t attn_ws = 0;
  for (int64_t rows = 1; rows <= next_pow2(T); rows *= 2) {
    const int64_t b = std::min(rows, T);
    if (c.mla) {
      // As below: a bound over every launch of at most b rows, not the size at (b, max len).
      cuda::MlaDecodeParams p{.num_seqs = b, .num_heads = c.num_heads,
                              .latent_dim = w_.mla.latent, .rope_dim = w_.mla.rope,
                              .block_size = block_size_, .max_blocks_per_seq = max_blocks_per_seq_,
                              .max_seq_len = max_blocks_per_seq_ * block_size_,
                              .fixed_chunk = attention_chunk_};
      attn_ws = std::max(attn_ws, cuda::mla_decode_workspace_bound(p));
    } else {
      // Every step's launch has at most b rows and a context of at most the largest bucket
      // (which rounds max_model_len up to whole blocks); the bound covers them all, where the
      // exact size at (b, max_model_len) would not (the split plan is not monotone).
      cuda::PagedDecodeParams p{.num_seqs = b, .num_q_heads = c.num_heads,
                                .num_kv_heads = c.num_kv_heads, .head_dim = Dp,
                                .block_size = block_size_,
                                .max_blocks_per_seq = max_blocks_per_seq_,
                                .max_seq_len = max_blocks_per_seq_ * block_size_,
                                .sliding_window = workspace_window,
                                .fixed_chunk = attention_chunk_};
      attn_ws = std::max(attn_ws, cuda::paged_decode_workspace_bound(p));
    }
  }

  // Two weight terms: the widest product with a bf16 output, summed in float32 first.
  term_sum_elems_ = 0;
  if (w_.weight_terms == 2) {
    int64_t widest = std::max(2 * mlp_width, H);  // dense / shared gate_up, shared down
    if (c.mla) {
      const MlaConfig& m = *c.mla;
      widest = std::max({widest, c.num_heads * m.qk_head_dim(), m.q_lora_rank,
                         w_.mla.cache_width() * c.num_heads, c.num_heads * m.v_head_dim});
    } else {
      widest = std::max(widest, (c.num_heads + 2 * c.num_kv_heads) * Dp +
                                    (c.attention_output_gate ? c.num_heads * Dp : 0));
    }
    term_sum_elems_ = T * widest;
  }

  auto carve = [&](Carver& cv) {
    inv_freq_ = cv.take<float>(std::max<int64_t>(rotary_dim_ / 2, 1));
    term_sum_ = cv.take<float>(term_sum_elems_);
    hidden_rows_ = hidden_ = cv.take<float>(T * H);
    hidden_spare_rows_ = hidden_spare_ = cv.take<float>(std::min(T, cuda::kSkinnyGemmMaxRows) * H);
    normed_ = cv.take<bf16>(T * H);
    block_out_ = cv.take<float>(T * H);
    normed_gathered_ = cv.take<bf16>(T * H);
    if (c.mla) {
      const MlaConfig& m = *c.mla;
      const int64_t Nh = c.num_heads, W = w_.mla.cache_width();
      mla_q_ = cv.take<bf16>(T * Nh * m.qk_head_dim());
      if (m.q_lora_rank > 0) mla_q_lora_ = cv.take<bf16>(T * m.q_lora_rank);
      mla_latent_ = cv.take<bf16>(T * W);
      mla_q_full_ = cv.take<bf16>(T * Nh * W);
      mla_out_latent_ = cv.take<bf16>(T * Nh * w_.mla.latent);
      attn_ = cv.take<bf16>(T * Nh * m.v_head_dim);
    } else {
      const int64_t Nq = c.num_heads, Nkv = c.num_kv_heads;
      qkv_width_ = (Nq + 2 * Nkv + (c.attention_output_gate ? Nq : 0)) * Dp;
      qkv_ = cv.take<bf16>(T * qkv_width_);
      q_ = cv.take<bf16>(T * Nq * Dp);
      k_ = cv.take<bf16>(T * Nkv * Dp);
      v_ = cv.take<bf16>(T * Nkv * Dp);
      attn_ = cv.take<bf16>(T * Nq * Dp);
      attn_split_tickets_ = cv.take<int32_t>(T * Nq);
    }
    attn_workspace_ = cv.take<float>(attn_ws);
    if (has_linear_layers(c)) {
      const LinearAttentionConfig& lin = *c.linear_attention;
      const int64_t C = lin.conv_dim(), Vd = lin.value_dim();
      lin_proj_ = cv.take<float>(T * (C + Vd + 2 * lin.num_value_heads));
      lin_conv_ = cv.take<float>(T * C);
      lin_core_ = cv.take<float>(T * Vd);
      lin_normed_ = cv.take<bf16>(T * Vd);
    }
    if (c.num_experts > 0) {
      mb.router_logits = cv.take<float>(T * E);
      mb.topk_ids = cv.take<int32_t>(T * K);
      mb.topk_weights = cv.take<float>(T * K);
      // The plan sorts over E + 1 experts: the last, a null expert, takes the padding rows of a
      // graph bucket (RouterParams::num_valid_tokens). A row of counts per layer, for reports.
      expert_counts_ = cv.take<int32_t>(c.num_layers * (E + 1));
      mb.expert_offsets = cv.take<int32_t>(E + 2);
      mb.src_row = cv.take<int32_t>(T * K);
      mb.inverse = cv.take<int32_t>(T * K);
      mb.plan_workspace = cv.take<int32_t>(cuda::plan_workspace_size(T * K, E + 1));
      // Under --ep this rank's experts may take every rank's rows of a step: N times T*K.
      const int64_t ranks = options_.expert_parallel ? options_.expert_parallel->size() : 1;
      expert_act_ = cv.take<bf16>(ranks * T * K * Ip);
      if (report_.expert_fp8_tensor_cores) {
        const int64_t widest = std::max(H, Ip);
        fp8_act_.codes = cv.take<uint8_t>(ranks * T * K * widest);
        fp8_act_.scales = cv.take<float>(ranks * T * K *
                                         ((widest + cuda::kFp8ActBlock - 1) / cuda::kFp8ActBlock));
      }
      mb.expert_out = cv.take<bf16>(ranks * T * K * H);
      if (c.routing_weight_on_input) weighted_rows_ = cv.take<bf16>(T * K * H);
      if (options_.expert_parallel) ep_plan_rows_ = cv.take<bf16>(T * K * H);
      mb.shared_gate_logits = cv.take<float>(T);
      mb.shared_out = cv.take<bf16>(T * H);
      if (small_moe_bytes > 0) mb.small_moe_workspace = cv.take<char>(small_moe_bytes);
      if (mb.route_plan_tokens > 0) mb.route_plan_ticket = cv.take<int32_t>(1);
      if (w_.experts_offloaded) {
        mb.predict_logits = cv.take<float>(T * E);
        mb.predict_ids = cv.take<int32_t>(T * K);
        mb.predict_weights = cv.take<float>(T * K);
      }
    }
    if (mlp_width > 0) {
      mlp_gate_up_ = cv.take<bf16>(T * 2 * mlp_width);
      mlp_act_ = cv.take<bf16>(T * mlp_width);
    }
    if (w_.dense_quant_max_elems > 0) dense_scratch_ = cv.take<bf16>(w_.dense_quant_max_elems);
    logits_ = cv.take<float>(rcap_ * V);
    cublas_workspace_ = cv.take<char>(static_cast<int64_t>(kCublasWorkspaceBytes));
    meta_.carve(cv, T, rcap_, max_blocks_per_seq_, noise_routing_, num_state_slots_ > 0);
  };
  // fp8 x fp8 for the routed experts: not with the cache (its slots hold bf16 experts) nor
  // under --deterministic (the path depends on the step's rows).
  report_.expert_fp8_tensor_cores =
      c.num_experts > 0 && options_.fp8_tensor_cores && !cache_ && !options_.deterministic &&
      cuda::fp8_tensor_cores_supported(w_.expert_quant, w_.expert_quant_group);
  Carver sizing(nullptr);
  carve(sizing);
  const int64_t bytes = static_cast<int64_t>(sizing.used());
  // Two micro-batches: a workspace each, within the same share.
  const int64_t allowed = static_cast<int64_t>(
      kMaxWorkspaceShare * static_cast<double>(report_.budget_bytes - report_.weight_bytes) /
      (two_lanes_ ? 2.0 : 1.0));
  MOE_CHECK(bytes <= allowed, "the GPU workspace for ", T, " tokens per step would take ",
            bytes >> 20, " MiB, more than the ", std::max<int64_t>(allowed, 0) >> 20,
            " MiB (half of what --gpu-memory-fraction leaves after the weights",
            two_lanes_ ? ", split between the two micro-batches" : "",
            ") it may take; raise --gpu-memory-fraction or lower the tokens per step "
            "(--max-num-batched-tokens "
            "of bench and serve; generate and logits take a prompt in one step)");
  workspace_ = device_array<char>(static_cast<size_t>(bytes));
  Carver assign(workspace_.get());
  carve(assign);
  report_.workspace_bytes = bytes;
  if (mb.route_plan_ticket) {  // zero before the first step; each launch leaves it so
    CUDA_CHECK(cudaMemsetAsync(mb.route_plan_ticket, 0, sizeof(int32_t), stream_));
  }
  if (attn_split_tickets_) {  // the same
    CUDA_CHECK(cudaMemsetAsync(attn_split_tickets_, 0,
                               static_cast<size_t>(T * c.num_heads) * sizeof(int32_t), stream_));
  }
  if (mb.small_moe_workspace) {  // its counters start at zero; the kernels leave them so
    CUDA_CHECK(
        cudaMemsetAsync(mb.small_moe_workspace, 0, static_cast<size_t>(small_moe_bytes), stream_));
  }
  if (c.mla) {  // q_full's rope padding [Lp + R, W) is never written: zero once
    CUDA_CHECK(cudaMemsetAsync(mla_q_full_, 0,
                               static_cast<size_t>(T * c.num_heads * w_.mla.cache_width()) *
                                   sizeof(bf16),
                               stream_));
  }
  CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));

  // The pinned host mirror of the metadata, at the same offsets.
  Carver meta_size(nullptr);
  Meta probe;
  probe.carve(meta_size, T, rcap_, max_blocks_per_seq_, noise_routing_, num_state_slots_ > 0);
  meta_bytes_ = meta_size.used();
  host_meta_base_ = pinned_array<char>(meta_bytes_);
  Carver host(host_meta_base_.get());
  host_meta_.carve(host, T, rcap_, max_blocks_per_seq_, noise_routing_, num_state_slots_ > 0);
  if (c.num_experts > 0) {
    host_expert_counts_ =
        pinned_array<int32_t>(static_cast<size_t>(c.num_layers * (c.num_experts + 1)));
  }
}

int64_t CudaDecoder::budget_in_use(int64_t device_in_use) const {
  if (options_.ranks_on_device == 1) return device_in_use;
  return report_.weight_bytes + report_.workspace_bytes + report_.state_bytes;
}

void CudaDecoder::allocate_state_pool() {
  const ModelConfig& c = config_;
  conv_state_.assign(static_cast<size_t>(c.num_layers), nullptr);
  delta_state_.assign(static_cast<size_t>(c.num_layers), nullptr);
  if (num_state_slots_ == 0) return;
  const LinearAttentionConfig& lin = *c.linear_attention;
  const int64_t S = num_state_slots_;
  const int64_t slot_bytes = state_values_per_sequence(c) * static_cast<int64_t>(sizeof(float));
  const int64_t bytes = slot_bytes * S;
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t in_use = budget_in_use(static_cast<int64_t>(total_bytes - free_bytes));
  const int64_t room = std::min<int64_t>(report_.budget_bytes - in_use,
                                         static_cast<int64_t>(free_bytes) - (int64_t{256} << 20));
  MOE_CHECK(bytes <= room, "the recurrent state of ", S, " sequences (", slot_bytes >> 10,
            " KiB each over ", c.num_linear_layers(), " linear-attention layers, ", bytes >> 20,
            " MiB) does not fit the ", std::max<int64_t>(room, 0) >> 20,
            " MiB left within --gpu-memory-fraction; lower --max-num-seqs or raise "
            "--gpu-memory-fraction");
  state_pool_ = device_array<char>(static_cast<size_t>(bytes));
  // Zeros once, so that a slot never run holds no garbage; the kernels zero a sequence's state
  // themselves when it starts (position 0).
  CUDA_CHECK(cudaMemsetAsync(state_pool_.get(), 0, static_cast<size_t>(bytes), stream_));
  float* next = reinterpret_cast<float*>(state_pool_.get());
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (!c.is_linear_layer(l)) continue;
    conv_state_[l] = next;
    next += S * lin.conv_state_values();
    delta_state_[l] = next;
    next += S * lin.recurrent_state_values();
  }
  report_.state_bytes = bytes;
  report_.state_bytes_per_slot = slot_bytes;
  report_.num_state_slots = S;
}

void CudaDecoder::allocate_kv_pool() {
  const ModelConfig& c = config_;
  allocate_state_pool();
  kv_width_ = c.mla ? w_.mla.cache_width() : c.num_kv_heads * w_.padded_head_dim;
  const int64_t planes = c.mla ? 1 : 2;
  kv_fp8_ = options_.kv_dtype == KvDType::kFP8;
  // The planner's bytes per token (kv_bytes_per_token) at the padded head dim.
  const int64_t bytes_per_token = gpu_kv_bytes_per_token(c, w_.padded_head_dim,
                                                         kv_width_, options_.kv_dtype);
  // Gated DeltaNet layers keep no rows (their state is above): only the other layers have planes.
  const int64_t kv_layers = c.num_kv_layers();
  MOE_CHECK(kv_layers > 0, c.model_type, ": no layer attends over a KV cache; the GPU decoder "
            "needs at least one");
  MOE_CHECK(kv_fp8_ || bytes_per_token == kv_layers * planes * kv_width_ * 2,
            "the KV pool's bf16 rows are ", kv_layers * planes * kv_width_ * 2,
            " bytes per token, not the ", bytes_per_token, " gpu_kv_bytes_per_token counts");
  const int64_t block_bytes = bytes_per_token * block_size_;
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const int64_t in_use = budget_in_use(static_cast<int64_t>(total_bytes - free_bytes));
  const int64_t room = std::min<int64_t>(report_.budget_bytes - in_use,
                                         static_cast<int64_t>(free_bytes) - (int64_t{256} << 20));
  int64_t blocks = room > 0 ? room / block_bytes : 0;
  if (options_.kv_cache_bytes > 0) {
    MOE_CHECK(options_.kv_cache_bytes <= room, "--kv-cache-mb ", options_.kv_cache_bytes >> 20,
              " is more than the ", std::max<int64_t>(room, 0) >> 20,
              " MiB left within --gpu-memory-fraction");
    blocks = options_.kv_cache_bytes / block_bytes;
  }
  if (options_.num_kv_blocks > 0) {
    MOE_CHECK(options_.num_kv_blocks <= blocks, options_.num_kv_blocks,
              " KV blocks need ", (options_.num_kv_blocks * block_bytes) >> 20, " MiB; only ",
              std::max<int64_t>(room, 0) >> 20, " MiB are left within --gpu-memory-fraction");
    blocks = options_.num_kv_blocks;
  }
  MOE_CHECK(blocks >= ceil_div(std::min<int64_t>(max_model_len_, 256), block_size_),
            "no room for the KV cache on ", report_.device_name, ": weights ",
            report_.weight_bytes >> 20, " MiB + workspace ", report_.workspace_bytes >> 20,
            " MiB leave ", std::max<int64_t>(room, 0) >> 20, " MiB of the ",
            report_.budget_bytes >> 20, " MiB budget (raise --gpu-memory-fraction or cut layers)");
  num_blocks_ = blocks;
  kv_pool_ = device_array<char>(static_cast<size_t>(blocks * block_bytes));
  const int64_t plane_elems = blocks * block_size_ * kv_width_;
  if (kv_fp8_ && c.mla) {
    // Per layer with rows, one after another: its latent code plane [slots, Lp], then its rope
    // code plane [slots, Rp] (Lp and Rp are multiples of 8: every plane starts 8-byte aligned);
    // after all the codes, per layer its latent and its rope scale plane, [slots] floats each:
    // L * slots * (Lp + Rp + 8) = blocks * block_bytes. k_* hold the latent, v_* the rope key.
    const int64_t slots = blocks * block_size_, Lp = w_.mla.latent, Rp = w_.mla.rope;
    auto* codes = reinterpret_cast<uint8_t*>(kv_pool_.get());
    auto* scales = reinterpret_cast<float*>(codes + kv_layers * plane_elems);
    for (int64_t l = 0, i = 0; l < c.num_layers; ++l) {
      const bool rows = !c.is_linear_layer(l);  // i: the layer's index among those with rows
      k_cache_.push_back(nullptr);
      v_cache_.push_back(nullptr);
      k_codes_.push_back(rows ? codes + i * plane_elems : nullptr);
      v_codes_.push_back(rows ? codes + i * plane_elems + slots * Lp : nullptr);
      k_scales_.push_back(rows ? scales + (i * 2) * slots : nullptr);
      v_scales_.push_back(rows ? scales + (i * 2 + 1) * slots : nullptr);
      i += rows ? 1 : 0;
    }
    MOE_CHECK(Lp + Rp == kv_width_ && bytes_per_token == kv_layers * (kv_width_ + 8),
              "the MLA fp8 pool's rows are ", kv_layers * (kv_width_ + 8),
              " bytes per token, not the ", bytes_per_token, " gpu_kv_bytes_per_token counts");
  } else if (kv_fp8_) {
    // [L, 2] code planes of plane_elems bytes (a multiple of 64: Dp is), then [L, 2] scale
    // planes of slots * Nkv floats: L * 2 * slots * (Nkv * Dp + 4 Nkv) = blocks * block_bytes.
    auto* codes = reinterpret_cast<uint8_t*>(kv_pool_.get());
    auto* scales = reinterpret_cast<float*>(codes + kv_layers * 2 * plane_elems);
    const int64_t scale_plane = blocks * block_size_ * c.num_kv_heads;
    for (int64_t l = 0, i = 0; l < c.num_layers; ++l) {
      const bool rows = !c.is_linear_layer(l);  // i: the layer's index among those with rows
      k_cache_.push_back(nullptr);
      v_cache_.push_back(nullptr);
      k_codes_.push_back(rows ? codes + (i * 2) * plane_elems : nullptr);
      v_codes_.push_back(rows ? codes + (i * 2 + 1) * plane_elems : nullptr);
      k_scales_.push_back(rows ? scales + (i * 2) * scale_plane : nullptr);
      v_scales_.push_back(rows ? scales + (i * 2 + 1) * scale_plane : nullptr);
      i += rows ? 1 : 0;
    }
  } else {
    auto* base = reinterpret_cast<bf16*>(kv_pool_.get());
    for (int64_t l = 0, i = 0; l < c.num_layers; ++l) {
      const bool rows = !c.is_linear_layer(l);
      k_cache_.push_back(rows ? base + (i * planes) * plane_elems : nullptr);
      v_cache_.push_back(rows && !c.mla ? base + (i * planes + 1) * plane_elems : nullptr);
      k_codes_.push_back(nullptr);
      v_codes_.push_back(nullptr);
      k_scales_.push_back(nullptr);
      v_scales_.push_back(nullptr);
      i += rows ? 1 : 0;
    }
  }
  report_.kv_bytes = blocks * block_bytes;
  report_.kv_bytes_per_token = bytes_per_token;
  report_.num_kv_blocks = blocks;
  report_.block_size = block_size_;
}

void CudaDecoder::linear(const LinearArgs& args) {
  // A product of other rows than the pending norm's leaves them to it.
  if (pending_norm_ && pending_norm_->out != args.x) flush_norm();
  const auto quantised = dense_quant_.find(args.w);
  if (quantised == dense_quant_.end()) return linear_bf16(args);
  // A quantised dense Linear (one term): the quantised skinny GEMM, 8 rows a launch, while those
  // launches read no more bytes than the bf16 matrix would (fp8: 2 launches, 16 rows; int4: 4,
  // 32 rows), else its values dequantised into the scratch and the bf16 path over them. Not only
  // up to skinny_gemm_rows (1 by default, where cuBLAS beats the bf16 skinny kernel from 2 rows
  // on): the other path here reads the codes, then writes and reads the matrix in bf16, 5 bytes
  // a value at fp8 against each skinny launch's 1. skinny_gemm_rows 0 (always cuBLAS) and
  // --deterministic (the fixed-order GEMM, so that a row's logits do not depend on the step's
  // rows) keep the other path.
  if (args.rows <= 0) return;  // an empty step (--ep's idle rank): nothing to dequantise
  const DenseQuantMatrix& m = *quantised->second;
  MOE_CHECK(m.rows == args.n && m.cols == args.k, "a quantised matrix of ", m.rows, " x ", m.cols,
            " multiplied as ", args.n, " x ", args.k);
  const auto* codes = static_cast<const uint8_t*>(m.data);
  const int64_t x_stride = args.x_stride > 0 ? args.x_stride : args.k;
  const int64_t y_stride = args.y_stride > 0 ? args.y_stride : args.n;
  const int64_t launches = (args.rows + cuda::kSkinnyGemmMaxRows - 1) / cuda::kSkinnyGemmMaxRows;
  const int64_t max_launches = m.format == cuda::ExpertQuant::kFp8 ? 2 : 4;
  const cuda::QuantSkinnyGemmParams skinny{.x = args.x,
                                           .w = codes,
                                           .format = m.format,
                                           .group = m.group,
                                           .y = args.y,
                                           .m = std::min(args.rows, cuda::kSkinnyGemmMaxRows),
                                           .n = args.n,
                                           .k = args.k,
                                           .ldx = x_stride,
                                           .ldy = y_stride,
                                           .y_f32 = args.f32_out};
  const bool skinny_path = !options_.deterministic && args.allow_skinny &&
                           options_.skinny_gemm_rows > 0 && launches <= max_launches &&
                           cuda::quant_skinny_gemm_supports(skinny);
  if (skinny_path && launches == 1 &&
      launch_folded(skinny, cuda::quant_skinny_gemm_supports, cuda::quant_skinny_gemm)) {
    return;
  }
  flush_norm();
  if (skinny_path) {
    const size_t y_elem = args.f32_out ? sizeof(float) : sizeof(bf16);
    for (int64_t first = 0; first < args.rows; first += cuda::kSkinnyGemmMaxRows) {
      cuda::QuantSkinnyGemmParams part = skinny;
      part.x = args.x + first * x_stride;
      part.y = static_cast<char*>(args.y) + static_cast<size_t>(first * y_stride) * y_elem;
      part.m = std::min(cuda::kSkinnyGemmMaxRows, args.rows - first);
      cuda::quant_skinny_gemm(part, stream_);
    }
    return;
  }
  MOE_CHECK(dense_scratch_ != nullptr && m.rows * m.cols <= w_.dense_quant_max_elems,
            "no scratch for a quantised matrix of ", m.rows, " x ", m.cols);
  cuda::dequantize_matrix({.w = codes,
                           .format = m.format,
                           .group = m.group,
                           .n = m.rows,
                           .k = m.cols,
                           .out = dense_scratch_},
                          stream_);
  LinearArgs bf16_args = args;
  bf16_args.w = dense_scratch_;
  linear_bf16(bf16_args, /*one_term=*/true);
}

void CudaDecoder::linear_bf16(const LinearArgs& a, bool one_term) {
  const int64_t x_stride = a.x_stride > 0 ? a.x_stride : a.k;
  const int64_t y_stride = a.y_stride > 0 ? a.y_stride : a.n;
  const bf16* w_lo = one_term ? nullptr : lo_term(a.w, a.n * a.k);
  if (options_.deterministic) {
    flush_norm();
    cuda::dense_gemm({.a = a.x, .b = a.w, .b_lo = w_lo, .c = a.y, .m = a.rows, .n = a.n,
                      .k = a.k, .lda = x_stride, .ldb = a.k, .ldc = y_stride,
                      .c_f32 = a.f32_out},
                     stream_);
    return;
  }
  const cuda::SkinnyGemmParams skinny{.x = a.x,
                                      .w = a.w,
                                      .w_lo = w_lo,
                                      .y = a.y,
                                      .m = a.rows,
                                      .n = a.n,
                                      .k = a.k,
                                      .ldx = x_stride,
                                      .ldy = y_stride,
                                      .y_f32 = a.f32_out};
  // Not the dequantised scratch (one_term): the kernel before wrote it, and the skinny GEMM loads
  // its first weights before waiting for that kernel.
  if (a.allow_skinny && !one_term && a.rows <= options_.skinny_gemm_rows &&
      cuda::skinny_gemm_supports(skinny)) {
    if (launch_folded(skinny, cuda::skinny_gemm_supports, cuda::skinny_gemm)) return;
    flush_norm();
    cuda::skinny_gemm(skinny, stream_);
    return;
  }
  flush_norm();
  auto gemm = [&](const bf16* w, void* y, int64_t ldy, bool f32, float beta) {
    const float one = 1.0f;
    CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(a.n),
                              static_cast<int>(a.rows), static_cast<int>(a.k), &one, w,
                              CUDA_R_16BF, static_cast<int>(a.k), a.x, CUDA_R_16BF,
                              static_cast<int>(x_stride), &beta, y,
                              f32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(ldy),
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  if (w_lo == nullptr) {
    gemm(a.w, a.y, y_stride, a.f32_out, 0.0f);
    return;
  }
  // Two terms: both products summed in float32 (in y itself, or in the scratch), rounded once.
  float* sum = a.f32_out ? static_cast<float*>(a.y) : term_sum_;
  const int64_t sum_stride = a.f32_out ? y_stride : a.n;
  MOE_CHECK(a.f32_out || a.rows * a.n <= term_sum_elems_, "a product of ", a.rows, " x ", a.n,
            " exceeds the two-term scratch of ", term_sum_elems_, " values");
  gemm(a.w, sum, sum_stride, true, 0.0f);
  gemm(w_lo, sum, sum_stride, true, 1.0f);
  if (!a.f32_out) {
    cuda::round_rows_to_bf16({.src = sum, .dst = static_cast<bf16*>(a.y), .rows = a.rows,
                              .width = a.n, .src_stride = a.n, .dst_stride = y_stride},
                             stream_);
  }
}

Step CudaDecoder::prepare(const ForwardBatch& batch) {
  const ModelConfig& c = config_;
  Meta& h = host_meta_;
  Step step;
  // The calling thread's device may not be this decoder's (serve's engine thread is not the
  // thread that built it; under --ep a rank's GPU is rank % count).
  CUDA_CHECK(cudaSetDevice(options_.device));
  host_device_bytes_ = 0;
  sample_timed_ = false;
  // Events only in the steps whose stages the profiler times; the others replay the plain graph.
  const profile::Profiler* profiler = profile::active();
  profiling_ = profiler != nullptr && profiler->timing();
  tracing_ = static_cast<bool>(routing_observer_);
  // An empty batch only under --ep (below), as on the CPU.
  if (!batch.sequences.empty() || options_.expert_parallel == nullptr) {
    check_forward_batch(batch, c.vocab_size, max_model_len_, num_blocks_, block_size_);
  }
  step.num_seqs = static_cast<int64_t>(batch.sequences.size());
  // An empty batch runs as one padding row on the decode route (below), whatever all_positions
  // asks of the rows it does not have (micro-batch B of a one-sequence prompt step).
  bool all_single = !batch.all_positions || batch.sequences.empty();
  bool all_fresh = true, all_want = true;
  int64_t T = 0, max_len = 0, table_stride = 1;
  for (const SequenceBatch& s : batch.sequences) {
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    const int64_t end = s.position + n;
    all_single = all_single && n == 1;
    all_fresh = all_fresh && s.position == 0;
    all_want = all_want && s.want_logits;
    T += n;
    max_len = std::max(max_len, end);
    table_stride = std::max(table_stride, ceil_div(end, block_size_));
  }
  MOE_CHECK(T <= tcap_, "a step of ", T, " tokens exceeds the ", tcap_,
            " the GPU workspace was sized for");
  if (num_state_slots_ > 0) {
    // Each sequence's recurrent state: a slot of its own (the host's StateSlots numbers).
    std::vector<bool> seen(static_cast<size_t>(num_state_slots_), false);
    for (int64_t i = 0; i < step.num_seqs; ++i) {
      const int32_t slot = batch.sequences[i].state_slot;
      MOE_CHECK(slot >= 0 && slot < num_state_slots_, "sequence ", i, " has state slot ", slot,
                " but the GPU holds recurrent state for ", num_state_slots_,
                " sequences (GpuOptions::max_num_seqs)");
      MOE_CHECK(!seen[slot], "two sequences of one batch share recurrent state slot ", slot);
      seen[slot] = true;
      h.state_slots[i] = slot;
    }
  }

  step.route =
      choose_attention_route({.one_token_each = all_single, .all_from_position_0 = all_fresh},
                             {.mla = c.mla.has_value(),
                              .deterministic = options_.deterministic,
                              .padded_head_dim = w_.padded_head_dim,
                              .gqa_group = c.num_kv_heads > 0 ? c.num_heads / c.num_kv_heads : 1,
                              .mla_latent_dim = w_.mla.latent,
                              .mla_rope_dim = w_.mla.rope});
  count_route(step.route);
  // One attention row per sequence on the flash routes, per token on the others; the paged
  // ones (GQA and MLA) read each sequence's length and block table.
  const bool paged_rows = step.route == Route::kPagedPrefill || step.route == Route::kMlaPrefill;
  const bool rows_are_sequences = step.route == Route::kPrefill || paged_rows;
  step.num_tokens = T;
  step.num_valid = T;
  step.max_seq_len = max_len;
  step.table_stride = table_stride;
  if (step.route == Route::kDecode && options_.cuda_graphs && all_want && step.num_seqs > 0 &&
      step.num_seqs <= rcap_) {
    step.graph = true;
    step.num_tokens = next_pow2(step.num_seqs);
    step.context_bucket = std::min(std::max(next_pow2(max_len), kMinContextBucket),
                                   max_blocks_per_seq_ * block_size_);
    step.max_seq_len = step.context_bucket;
    step.table_stride = ceil_div(step.context_bucket, block_size_);
  }
  // An empty batch (a rank of an --ep job with nothing scheduled: Engine::step still runs a
  // forward, so that every MoE layer's exchange meets every rank) runs as one padding row, as a
  // decode graph pads its bucket: it attends to nothing, writes no KV slot, routes to the
  // padding expert (num_valid 0) and wants no logits. Padding has the shapes of a graph step's,
  // so the kernels see nothing they do not see there.
  const bool empty = T == 0;
  if (empty) {
    step.num_tokens = 1;
    step.max_seq_len = std::min(kMinContextBucket, max_blocks_per_seq_ * block_size_);
    step.table_stride = ceil_div(step.max_seq_len, block_size_);
  }
  const int64_t stride = step.table_stride;

  // Token rows, their cache slots, and one attention row per token (per sequence for prefill
  // and paged prefill): its length and its block table.
  int64_t row = 0, logit_rows = 0;
  h.cu_seqlens[0] = 0;
  auto set_attention_row = [&](int64_t r, int64_t len, std::span<const int32_t> table) {
    h.seq_lens[r] = static_cast<int32_t>(len);
    const int64_t used = std::min<int64_t>(static_cast<int64_t>(table.size()), stride);
    std::memcpy(h.block_tables + r * stride, table.data(), used * sizeof(int32_t));
    std::fill(h.block_tables + r * stride + used, h.block_tables + (r + 1) * stride, 0);
  };
  for (int64_t i = 0; i < step.num_seqs; ++i) {
    const SequenceBatch& s = batch.sequences[i];
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    if (paged_rows) set_attention_row(i, s.position + n, s.block_table);
    for (int64_t t = 0; t < n; ++t, ++row) {
      const int64_t pos = s.position + t;
      h.ids[row] = s.tokens[t];
      h.positions[row] = static_cast<int32_t>(pos);
      h.slots[row] = static_cast<int32_t>(s.block_table[pos / block_size_] * block_size_ +
                                          pos % block_size_);
      if (!rows_are_sequences) set_attention_row(row, pos + 1, s.block_table);
      if (s.want_logits && (batch.all_positions || t == n - 1)) {
        h.logit_rows[logit_rows++] = static_cast<int32_t>(row);
      }
    }
    h.cu_seqlens[i + 1] = static_cast<int32_t>(row);
  }
  // Graph padding (decode only, so a row is a sequence): rows that attend to nothing and
  // sequences without a state slot.
  step.num_state_seqs = step.graph || empty ? step.num_tokens : step.num_seqs;
  for (; row < step.num_tokens; ++row) {
    if (num_state_slots_ > 0) {
      h.cu_seqlens[row + 1] = static_cast<int32_t>(row + 1);
      h.state_slots[row] = -1;
    }
    h.ids[row] = 0;
    h.positions[row] = 0;
    h.slots[row] = -1;
    h.seq_lens[row] = 0;
    std::fill(h.block_tables + row * stride, h.block_tables + (row + 1) * stride, 0);
  }
  if (noise_routing_) {
    // A key per token and step: the step count mixed with the token's KV slot (unique among the
    // tokens of one step), so neither a later step nor a sequence reusing a slot repeats picks.
    ++noise_step_;
    for (int64_t r = 0; r < step.num_tokens; ++r) {
      const uint64_t mixed = cuda::router_noise_mix((noise_step_ << 32) ^
                                                    static_cast<uint32_t>(h.slots[r]));
      h.route_keys[r] = static_cast<int32_t>(mixed & 0x7fffffffu);
    }
  }
  step.num_rows = rows_are_sequences ? step.num_seqs : step.num_tokens;
  if (step.route == Route::kPagedPrefill) {
    step.paged_tiles = cuda::plan_paged_prefill_tiles(h.cu_seqlens, step.num_seqs,
                                                      c.num_heads / c.num_kv_heads,
                                                      h.paged_tile_starts);
  } else if (step.route == Route::kMlaPrefill) {
    step.paged_tiles =
        cuda::plan_mla_prefill_tiles(h.cu_seqlens, step.num_seqs, c.num_heads, h.paged_tile_starts);
  }
  step.logit_rows = logit_rows;
  step.logits_are_all_rows = logit_rows == T;
  upload_meta(step);
  return step;
}

void CudaDecoder::count_route(Route route) {
  switch (route) {
    case Route::kDecode:
      ++route_counts_.decode;
      return;
    case Route::kPrefill:
      ++route_counts_.prefill;
      return;
    case Route::kPagedPrefill:
      ++route_counts_.paged_prefill;
      return;
    case Route::kMlaPrefill:
      ++route_counts_.mla_prefill;
      return;
    case Route::kPerQuery:
      ++route_counts_.per_query;
      return;
  }
}

void CudaDecoder::upload_meta(const Step& step) {
  const int64_t T = step.num_tokens;
  auto up = [&](auto* dst, const auto* src, int64_t count) {
    if (count <= 0) return;
    host_device_bytes_ += count * static_cast<int64_t>(sizeof(*src));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * sizeof(*src),
                               cudaMemcpyHostToDevice, stream_));
  };
  host_meta_.num_valid[0] = static_cast<int32_t>(step.num_valid);
  up(meta_.num_valid, host_meta_.num_valid, T + 1);  // and the ids after it
  up(meta_.positions, host_meta_.positions, T);
  up(meta_.slots, host_meta_.slots, T);
  if (noise_routing_) up(meta_.route_keys, host_meta_.route_keys, T);
  up(meta_.logit_rows, host_meta_.logit_rows, step.logit_rows);
  if (num_state_slots_ > 0) {  // the linear-attention kernels' sequences, on every route
    up(meta_.cu_seqlens, host_meta_.cu_seqlens, step.num_state_seqs + 1);
    up(meta_.state_slots, host_meta_.state_slots, step.num_state_seqs);
  } else if (step.route == Route::kPrefill || step.route == Route::kPagedPrefill ||
             step.route == Route::kMlaPrefill) {
    up(meta_.cu_seqlens, host_meta_.cu_seqlens, step.num_seqs + 1);
  }
  if (step.route == Route::kPagedPrefill || step.route == Route::kMlaPrefill) {
    up(meta_.paged_tile_starts, host_meta_.paged_tile_starts, step.num_seqs + 1);
  }
  if (step.route != Route::kPrefill) {  // per attention row: a token, or a sequence
    up(meta_.seq_lens, host_meta_.seq_lens, step.num_rows);
    up(meta_.block_tables, host_meta_.block_tables, step.num_rows * step.table_stride);
  }
}

void CudaDecoder::enqueue_layers(const Step& step) {
  enqueue_embedding(step);
  for (int64_t l = 0; l < config_.num_layers;) {
    if (const int64_t run = persistent_run(step, l); run > 0) {
      enqueue_persistent_layers(l, run);
      l += run;
      continue;
    }
    enqueue_attention_block(l, step);
    feed_forward(l, step.num_tokens);
    ++l;
  }
  enqueue_final_norm(step);
}

void CudaDecoder::build_persistent_layers() {
  const ModelConfig& c = config_;
  const int64_t L = c.num_layers, E = c.num_experts, H = w_.padded_hidden_size;
  persistent_layer_.assign(static_cast<size_t>(L), 0);
  if (!options_.persistent_layers) return;
  // Not with two micro-batches, --deterministic (the stage path's fixed orders), an fp8 KV
  // cache, MLA, weights in two terms or dense Linears held as codes.
  const char* refusal = !moe_                                        ? "no MoE layers"
                        : two_lanes_                                 ? "two micro-batches"
                        : options_.deterministic                     ? "--deterministic"
                        : kv_fp8_                                    ? "an fp8 KV cache"
                        : c.mla                                      ? "MLA attention"
                        : w_.weight_terms != 1 || w_.norm_terms != 1 ? "weights in two bf16 terms"
                        : !w_.dense_quant.empty()                    ? "dense Linears held as codes"
                                                                     : nullptr;
  if (refusal != nullptr) {
    report_.persistent_refusal = refusal;
    return;
  }
  std::vector<cuda::DecodeLayerWeights> layers(static_cast<size_t>(L));
  std::optional<cuda::RouterParams> router;
  for (int64_t l = 0; l < L; ++l) {
    const LayerPlan& plan = plans_[l];
    const DeviceLayer& d = w_.layers[l];
    const std::optional<cuda::RouterParams> layer_router = moe_->persistent_router(l);
    const bool plain_attention =
        plan.attention == AttentionKind::kGqa &&
        (plan.qk_norm == QkNormKind::kNone || plan.qk_norm == QkNormKind::kPerHead) &&
        !plan.clip_qkv && !plan.output_gate && !plan.attention_sinks &&
        plan.span == AttentionSpan::kCausal && plan.query_scale == QueryScale::kNone &&
        d.qkv_bias == nullptr && d.o_bias == nullptr && d.sinks == nullptr;
    if (!layer_router || !plain_attention) {
      report_.persistent_refusal = !layer_router ? "no MoE block the kernel takes (dense layers, "
                                                   "shared or quantised experts, an offload, a "
                                                   "routing approximation, grouped routing)"
                                                 : "attention the kernel does not take (biases, "
                                                   "q/k norms over the projection, clipping, "
                                                   "sinks, gates, chunks, NoPE temperature)";
      continue;
    }
    router = layer_router;
    persistent_layer_[l] = 1;
    layers[l] = {.input_norm = d.input_norm,
                 .post_norm = d.post_norm,
                 .qkv = d.qkv,
                 .q_norm = plan.qk_norm == QkNormKind::kPerHead ? d.q_norm : nullptr,
                 .k_norm = plan.qk_norm == QkNormKind::kPerHead ? d.k_norm : nullptr,
                 .o_proj = d.o_proj,
                 .router = d.router,
                 .logit_bias = layer_router->logit_bias,
                 .gate_up = d.experts_gate_up,
                 .down = d.experts_down,
                 .k_cache = k_cache_[l],
                 .v_cache = v_cache_[l],
                 .sliding_window = plan.sliding_window,
                 .rope = plan.position == PositionEncoding::kRope,
                 .interleaved_rope = interleaved_rope(l),
                 .router_noise = d.router_noise,
                 .noise_seed = d.router_noise_seed,
                 .expert_counts = expert_counts_ + l * (E + 1)};
  }
  if (!router) return;
  report_.persistent_refusal.clear();  // some layers run there
  persistent_ = {.hidden_size = H,
                 .norm_width = c.hidden_size,
                 .num_q_heads = c.num_heads,
                 .num_kv_heads = c.num_kv_heads,
                 .head_dim = c.head_dim,
                 .padded_head_dim = w_.padded_head_dim,
                 .rotary_dim = rotary_dim_,
                 .rope_scaling = rope_scaling_,
                 .eps = static_cast<float>(c.rms_norm_eps),
                 .attention_scale = attention_scale_,
                 .block_size = block_size_,
                 .num_cache_blocks = num_blocks_,
                 .max_blocks_per_seq = max_blocks_per_seq_,
                 .num_experts = E,
                 .top_k = c.num_experts_per_tok,
                 .expert_width = w_.padded_expert_width,
                 .router_score = router->score,
                 .renormalize = router->renormalize,
                 .routed_scaling_factor = router->routed_scaling_factor};
  if (const std::string why = cuda::decode_layers_unsupported(persistent_); !why.empty()) {
    if (!options_.quiet) {
      std::fprintf(stderr, "moeinfer: --persistent-layers is off: %s\n", why.c_str());
    }
    report_.persistent_refusal = why;
    persistent_layer_.assign(static_cast<size_t>(L), 0);
    return;
  }
  const size_t table_bytes = layers.size() * sizeof(cuda::DecodeLayerWeights);
  const size_t table_span = (table_bytes + 255) / 256 * 256;
  const auto scratch_bytes = static_cast<size_t>(cuda::decode_layers_scratch_bytes(persistent_));
  persistent_memory_ = device_array<char>(table_span + scratch_bytes);
  CUDA_CHECK(
      cudaMemcpy(persistent_memory_.get(), layers.data(), table_bytes, cudaMemcpyHostToDevice));
  // The barrier and the tickets start at zero; every launch leaves them so.
  CUDA_CHECK(cudaMemset(persistent_memory_.get() + table_span, 0, scratch_bytes));
  persistent_.layers = reinterpret_cast<const cuda::DecodeLayerWeights*>(persistent_memory_.get());
  persistent_.scratch = persistent_memory_.get() + table_span;
  report_.persistent_layers = std::count(persistent_layer_.begin(), persistent_layer_.end(), 1);
  if (const char* clock = std::getenv("MOE_PERSISTENT_CLOCK"); clock && clock[0] == '1') {
    persistent_clock_ = device_array<unsigned long long>(cuda::kDecodeLayersStageClocks);
    CUDA_CHECK(cudaMemset(persistent_clock_.get(), 0,
                          cuda::kDecodeLayersStageClocks * sizeof(unsigned long long)));
    persistent_.stage_clock = persistent_clock_.get();
  }
}

void CudaDecoder::report_persistent_clock() {
  unsigned long long clock[cuda::kDecodeLayersStageClocks] = {};
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(clock, persistent_clock_.get(), sizeof(clock), cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
    return;
  }
  // Each launch's last down stage ends with the kernel, untimed.
  const unsigned long long layers = clock[cuda::kDecodeLayersClockLayers];
  if (layers == 0) return;
  const auto layer_runs = static_cast<double>(layers);
  const char* names[cuda::kDecodeLayersStages] = {"norm+qkv",    "attention",    "o",
                                                  "norm+router", "topk+gate_up", "down"};
  std::fprintf(stderr, "moeinfer: persistent layers, us a layer over %llu layer runs:", layers);
  for (int s = 0; s < cuda::kDecodeLayersStages; ++s)
    std::fprintf(stderr, " %s %.2f", names[s], clock[s] / layer_runs / 1e3);
  std::fprintf(stderr, " (down: all but each launch's last layer)\n");
  const unsigned long long items = clock[cuda::kDecodeLayersClockItemCount];
  if (items == 0) return;
  const char* phases[cuda::kDecodeLayersItemPhases] = {"queries", "first tile", "tiles", "ticket",
                                                       "end"};
  std::fprintf(stderr,
               "moeinfer: persistent layers, attention items: %.2f a layer; us after the "
               "queries' barrier on average:",
               static_cast<double>(items) / layer_runs);
  for (int s = 0; s < cuda::kDecodeLayersItemPhases; ++s) {
    std::fprintf(stderr, " %s %.2f", phases[s],
                 static_cast<double>(clock[cuda::kDecodeLayersClockItemPhases + s]) / items / 1e3);
  }
  std::fprintf(stderr, "\n");
}

int64_t CudaDecoder::persistent_run(const Step& step, int64_t first) const {
  // One sequence's one token on the decode route; the profiler times stages the kernel does not
  // have.
  if (persistent_memory_ == nullptr || step.route != Route::kDecode || step.num_tokens != 1 ||
      step.num_valid != 1 || step.num_seqs != 1 || profiling_) {
    return 0;
  }
  int64_t last = first;
  while (last < config_.num_layers && persistent_layer_[last]) ++last;
  return last - first;
}

void CudaDecoder::enqueue_persistent_layers(int64_t first, int64_t count) {
  MOE_CHECK(!pending_norm_, "layer ", first, ": a norm was left pending before the persistent run");
  cuda::DecodeLayersParams p = persistent_;
  p.layers += first;
  p.num_layers = count;
  p.hidden = hidden_;
  p.block_out = block_out_;
  p.block_out_valid = first > 0;
  p.position = meta_.positions;
  p.slot = meta_.slots;
  p.block_table = meta_.block_tables;
  p.seq_len = meta_.seq_lens;
  p.route_key = meta_.route_keys;
  p.inv_freq = inv_freq_;
  if (tracing_) {  // each layer's picks into its rows of the capture buffers, as moe_io's
    const int64_t K = config_.num_experts_per_tok;
    const int64_t row = first * routing_pitch() + routing_row_offset_;
    p.routing_ids = routing_ids_.get() + row * K;
    p.routing_weights = routing_weights_.get() + row * K;
    p.routing_stride = routing_pitch() * K;
  }
  cuda::decode_layers(p, stream_);
}

void CudaDecoder::enqueue_embedding(const Step& step) {
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens, H = w_.padded_hidden_size;
  hidden_ = hidden_rows_;
  hidden_spare_ = hidden_spare_rows_;
  cuda::embedding({.token_ids = meta_.ids, .table = w_.embed,
                   .table_lo = lo_term(w_.embed, c.vocab_size * H), .out_f32 = hidden_,
                   .num_tokens = T, .vocab_size = c.vocab_size, .hidden_size = H},
                  stream_);
}

void CudaDecoder::enqueue_attention_block(int64_t l, const Step& step) {
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens, H = w_.padded_hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const DeviceLayer& d = w_.layers[l];
  // normed = norm(hidden + previous block output); the residual stream stays in hidden. GQA's
  // first read of normed_ is its QKV product.
  residual_norm({.x = l == 0 ? nullptr : block_out_,
                 .residual = hidden_,
                 .residual_out = l == 0 ? nullptr : hidden_,
                 .weight = d.input_norm,
                 .weight_lo = norm_lo(d.input_norm, H),
                 .out = normed_,
                 .num_rows = T,
                 .hidden_size = H,
                 .eps = eps,
                 .mean_width = c.hidden_size},
                plans_[l].attention == AttentionKind::kGqa);
  switch (plans_[l].attention) {
    case AttentionKind::kGqa:
      attention(l, step);
      break;
    case AttentionKind::kMla:
      mla_attention(l, step);
      break;
    case AttentionKind::kGatedDeltaNet:
      linear_attention(l, step);
      break;
  }
  MOE_CHECK(!pending_norm_, "layer ", l, ": the input norm was left for a product that never ran");
  // The feed-forward's first read of normed_: the dense MLP's gate/up product, or the MoE
  // block's router product where it takes the stage path.
  const bool next_is_linear = plans_[l].feed_forward == FeedForwardKind::kDenseMlp ||
                              moe_->reads_hidden_first_by_linear(l, T);
  residual_norm({.x = block_out_,
                 .x_bias = d.o_bias,
                 .residual = hidden_,
                 .residual_out = hidden_,
                 .weight = d.post_norm,
                 .weight_lo = norm_lo(d.post_norm, H),
                 .out = normed_,
                 .num_rows = T,
                 .hidden_size = H,
                 .eps = eps,
                 .mean_width = c.hidden_size},
                next_is_linear);
  mark(profile::Stage::kAttention, l);
}

void CudaDecoder::residual_norm(cuda::RmsNormParams params, bool next_is_linear) {
  const int64_t T = params.num_rows;
  // linear() folds it where its skinny GEMM takes the rows, else launches it first. Not with two
  // micro-batches (the other lane's products run in between); not past the spare's rows.
  if (next_is_linear && options_.fold_norms && !two_lanes_ && T >= 1 &&
      T <= std::min(options_.skinny_gemm_rows, cuda::kSkinnyGemmMaxRows)) {
    if (params.residual_out != nullptr) {
      params.residual_out = hidden_spare_;
      std::swap(hidden_, hidden_spare_);
    }
    pending_norm_ = params;
    return;
  }
  cuda::fused_add_rms_norm(params, stream_);
}

void CudaDecoder::flush_norm() {
  if (!pending_norm_) return;
  cuda::fused_add_rms_norm(*pending_norm_, stream_);
  pending_norm_.reset();
}

void CudaDecoder::enqueue_final_norm(const Step& step) {
  const ModelConfig& c = config_;
  const int64_t T = step.num_tokens, H = w_.padded_hidden_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  cuda::fused_add_rms_norm({.x = block_out_, .residual = hidden_, .residual_out = nullptr,
                            .weight = w_.final_norm, .weight_lo = norm_lo(w_.final_norm, H),
                            .out = normed_, .num_rows = T,
                            .hidden_size = H, .eps = eps, .mean_width = c.hidden_size},
                           stream_);
  // The rows that want logits, gathered to the front unless they are all rows.
  if (!step.logits_are_all_rows && step.logit_rows > 0) {
    cuda::embedding({.token_ids = meta_.logit_rows, .table = normed_, .out = normed_gathered_,
                     .num_tokens = step.logit_rows, .vocab_size = T, .hidden_size = H},
                    stream_);
  }
}

void CudaDecoder::enqueue_lm_head(const Step& step, int64_t first_row, int64_t rows) {
  const int64_t H = w_.padded_hidden_size;
  const bf16* source = step.logits_are_all_rows ? normed_ : normed_gathered_;
  // cuBLAS streams the LM head's [V, H] matrix faster than the skinny GEMM at every row count
  // (0.83x at one row, bench_cuda_stages --projections-only).
  linear({.x = source + first_row * H, .rows = rows, .w = w_.lm_head, .n = config_.vocab_size,
          .k = H, .y = logits_, .f32_out = true, .allow_skinny = false});
  mark(profile::Stage::kLmHead, -1);
}

void CudaDecoder::attention(int64_t layer, const Step& step) {
  const ModelConfig& c = config_;
  const DeviceLayer& d = w_.layers[layer];
  const int64_t T = step.num_tokens, H = w_.padded_hidden_size;
  const int64_t Nq = c.num_heads, Nkv = c.num_kv_heads, D = c.head_dim, Dp = w_.padded_head_dim;
  // The row: q, k and v heads, then (output gate) each query head's gate logits.
  const int64_t Nqkv = qkv_width_;
  const float eps = static_cast<float>(c.rms_norm_eps);
  linear({.x = normed_, .rows = T, .w = d.qkv, .n = Nqkv, .k = H, .y = qkv_});
  if (d.qkv_bias) {
    cuda::bias_clip({.x = qkv_, .bias = d.qkv_bias, .rows = T, .width = (Nq + 2 * Nkv) * Dp,
                     .stride = Nqkv},
                    stream_);
  }
  const int64_t slots = num_blocks_ * block_size_;
  const bool prefill = step.route == Route::kPrefill;
  const LayerPlan& plan = plans_[layer];
  const bool per_head_norm = plan.qk_norm == QkNormKind::kPerHead;
  // attention_inputs reads one term of the per-head norm weights; with two, the unfused path.
  const bool two_term_norms = per_head_norm && w_.norm_terms == 2;
  const bool rope = plan.position == PositionEncoding::kRope;
  const AttentionTemperature* temperature = nullptr;  // Llama 4's NoPE layers
  switch (plan.query_scale) {
    case QueryScale::kNone:
      break;
    case QueryScale::kTemperature:
      temperature = &*c.attention_temperature;
      break;
  }
  if (plan.qk_norm != QkNormKind::kWholeProjection && !plan.clip_qkv && !two_term_norms) {
    // One launch from the projection to the attention inputs (Llama 4's NoPE layers, its norm
    // after RoPE and its query temperature included).
    cuda::attention_inputs({.qkv = qkv_, .qkv_stride = Nqkv, .positions = meta_.positions,
                            .inv_freq = inv_freq_,
                            .q_norm = per_head_norm ? d.q_norm : nullptr,
                            .k_norm = per_head_norm ? d.k_norm : nullptr, .eps = eps,
                            .slots = meta_.slots, .k_cache = k_cache_[layer],
                            .v_cache = v_cache_[layer], .k_codes = k_codes_[layer],
                            .v_codes = v_codes_[layer], .k_scales = k_scales_[layer],
                            .v_scales = v_scales_[layer], .num_slots = slots, .q_out = q_,
                            .k_out = prefill ? k_ : nullptr, .v_out = prefill ? v_ : nullptr,
                            .num_tokens = T, .num_q_heads = Nq, .num_kv_heads = Nkv,
                            .head_dim = D, .padded_head_dim = Dp, .rotary_dim = rotary_dim_,
                            .attention_scaling = rope_scaling_,
                            .interleaved = rope && interleaved_rope(layer), .rope = rope,
                            .norm_after_rope = plan.qk_norm == QkNormKind::kAfterRopeWeightless,
                            .temperature_floor_scale = temperature ? temperature->floor_scale : 0,
                            .temperature_scale =
                                temperature ? static_cast<float>(temperature->attn_scale) : 0.0f},
                           stream_);
  } else {
    qk_norm_clip_rope_write(layer, step);
  }
  // Per layer (GPT-OSS alternates sliding and full layers); the sinks are null unless the plan
  // has them (device_weights uploads them exactly where the config does).
  const int64_t window = plan.sliding_window;
  const int64_t chunk = attention_chunk_of(plan);
  MOE_CHECK(plan.attention_sinks == (d.sinks != nullptr), "layer ", layer, ": the plan ",
            plan.attention_sinks ? "has" : "has no", " attention sinks, the device weights ",
            d.sinks ? "do" : "do not");
  if (prefill) {
    cuda::prefill_attention({.q = q_, .k = k_, .v = v_, .cu_seqlens = meta_.cu_seqlens,
                             .out = attn_, .num_tokens = T, .num_seqs = step.num_seqs,
                             .max_seq_len = step.max_seq_len, .num_q_heads = Nq,
                             .num_kv_heads = Nkv, .head_dim = Dp, .scale = attention_scale_,
                             .sliding_window = window, .attention_chunk = chunk,
                             .sinks = d.sinks},
                            stream_);
  } else if (step.route == Route::kPagedPrefill) {
    // The new tokens' keys were written to the cache above, on this stream.
    cuda::paged_prefill_attention(
        {.q = q_, .k_cache = k_cache_[layer], .v_cache = v_cache_[layer],
         .k_codes = k_codes_[layer], .v_codes = v_codes_[layer], .k_scales = k_scales_[layer],
         .v_scales = v_scales_[layer], .cu_seqlens = meta_.cu_seqlens,
         .seq_lens = meta_.seq_lens, .tile_starts = meta_.paged_tile_starts,
         .block_tables = meta_.block_tables, .out = attn_, .num_tokens = T,
         .num_seqs = step.num_seqs, .num_tiles = step.paged_tiles,
         .max_seq_len = step.max_seq_len, .num_q_heads = Nq, .num_kv_heads = Nkv,
         .head_dim = Dp, .block_size = block_size_, .num_blocks = num_blocks_,
         .max_blocks_per_seq = step.table_stride, .scale = attention_scale_,
         .sliding_window = window, .attention_chunk = chunk, .sinks = d.sinks},
        stream_);
  } else {
    cuda::paged_decode_attention(
        {.q = q_,
         .k_cache = k_cache_[layer],
         .v_cache = v_cache_[layer],
         .k_codes = k_codes_[layer],
         .v_codes = v_codes_[layer],
         .k_scales = k_scales_[layer],
         .v_scales = v_scales_[layer],
         .block_tables = meta_.block_tables,
         .seq_lens = meta_.seq_lens,
         .out = attn_,
         .workspace = attn_workspace_,
         .num_seqs = T,
         .num_q_heads = Nq,
         .num_kv_heads = Nkv,
         .head_dim = Dp,
         .block_size = block_size_,
         .num_blocks = num_blocks_,
         .max_blocks_per_seq = step.table_stride,
         .max_seq_len = step.max_seq_len,
         .scale = attention_scale_,
         .sliding_window = window,
         .attention_chunk = chunk,
         .sinks = d.sinks,
         .fixed_chunk = attention_chunk_,
         .split_tickets = options_.merge_attention_splits ? attn_split_tickets_ : nullptr},
        stream_);
  }
  if (plan.output_gate) {
    // Qwen3-Next: the output times sigmoid of the gate logits that follow v in each qkv row
    // (padded dims: zero output, so any gate).
    cuda::attention_output_gate({.x = attn_, .gate = qkv_ + (Nq + 2 * Nkv) * Dp,
                                 .gate_stride = Nqkv, .rows = T, .width = Nq * Dp},
                                stream_);
  }
  // o_proj's bias joins in the norm that adds this output to the residual stream.
  linear({.x = attn_, .rows = T, .w = d.o_proj, .n = H, .k = Nq * Dp, .y = block_out_,
          .f32_out = true});
}

void CudaDecoder::linear_attention(int64_t layer, const Step& step) {
  const ModelConfig& c = config_;
  const LinearAttentionConfig& lin = *c.linear_attention;
  const DeviceLayer& d = w_.layers[layer];
  const int64_t T = step.num_tokens, H = w_.padded_hidden_size;
  const int64_t Nv = lin.num_value_heads, Dv = lin.value_head_dim;
  const int64_t C = lin.conv_dim(), Vd = lin.value_dim();
  const int64_t width = C + Vd + 2 * Nv;  // lin_proj_'s row: [q | k | v | z | b | a]
  MOE_CHECK(conv_state_[layer] != nullptr && delta_state_[layer] != nullptr, "layer ", layer,
            " is a Gated DeltaNet layer without recurrent state on the device");
  // Float32 out of the product: the conv, beta and the decay read the projection unrounded,
  // as the CPU does.
  linear({.x = normed_, .rows = T, .w = d.lin_in, .n = width, .k = H, .y = lin_proj_,
          .f32_out = true});
  const cuda::DeltaNetSequences seqs{.cu_seqlens = meta_.cu_seqlens,
                                     .state_slots = meta_.state_slots,
                                     .positions = meta_.positions,
                                     .num_seqs = step.num_state_seqs,
                                     .num_slots = num_state_slots_};
  cuda::delta_net_conv({.seqs = seqs, .x = lin_proj_, .x_stride = width, .weight = d.lin_conv,
                        .conv_state = conv_state_[layer], .out = lin_conv_, .num_channels = C,
                        .taps = lin.conv_kernel},
                       stream_);
  cuda::delta_net_recurrence({.seqs = seqs, .qkv = lin_conv_, .qkv_stride = C,
                              .b = lin_proj_ + C + Vd, .a = lin_proj_ + C + Vd + Nv,
                              .ba_stride = width, .a_log = d.lin_a_log,
                              .dt_bias = d.lin_dt_bias, .state = delta_state_[layer],
                              .out = lin_core_, .num_key_heads = lin.num_key_heads,
                              .num_value_heads = Nv, .key_dim = lin.key_head_dim,
                              .value_dim = Dv, .l2_eps = kLinearL2NormEps},
                             stream_);
  cuda::gated_rms_norm({.x = lin_core_, .z = lin_proj_ + C, .z_stride = width, .heads = Nv,
                        .weight = d.lin_norm, .out = lin_normed_, .rows = T * Nv, .width = Dv,
                        .eps = static_cast<float>(c.rms_norm_eps)},
                       stream_);
  linear({.x = lin_normed_, .rows = T, .w = d.lin_out, .n = H, .k = Vd, .y = block_out_,
          .f32_out = true});
}

// The unfused path for what attention_inputs does not cover: OLMoE's norm over the whole
// projection, clip_qkv (norm, clip, then rope, in the reference's order) and per-head norm
// weights in two terms.
void CudaDecoder::qk_norm_clip_rope_write(int64_t layer, const Step& step) {
  const ModelConfig& c = config_;
  const DeviceLayer& d = w_.layers[layer];
  const int64_t T = step.num_tokens;
  const int64_t Nq = c.num_heads, Nkv = c.num_kv_heads, D = c.head_dim, Dp = w_.padded_head_dim;
  const int64_t Nqkv = qkv_width_;  // the row stride (output gates after v included)
  const float eps = static_cast<float>(c.rms_norm_eps);
  switch (plans_[layer].qk_norm) {
    case QkNormKind::kNone:
      break;
    case QkNormKind::kPerHead:
      cuda::strided_rms_norm({.x = qkv_, .weight = d.q_norm, .weight_lo = norm_lo(d.q_norm, D),
                              .rows = T * Nq, .width = D, .stride = Dp, .eps = eps,
                              .rows_per_token = Nq, .token_stride = Nqkv},
                             stream_);
      cuda::strided_rms_norm({.x = qkv_ + Nq * Dp, .weight = d.k_norm,
                              .weight_lo = norm_lo(d.k_norm, D), .rows = T * Nkv, .width = D,
                              .stride = Dp, .eps = eps, .rows_per_token = Nkv,
                              .token_stride = Nqkv},
                             stream_);
      break;
    case QkNormKind::kWholeProjection:
      cuda::strided_rms_norm({.x = qkv_, .weight = d.q_norm,
                              .weight_lo = norm_lo(d.q_norm, Nq * Dp), .rows = T,
                              .width = Nq * Dp, .stride = Nqkv, .eps = eps,
                              .mean_width = Nq * D},
                             stream_);
      cuda::strided_rms_norm({.x = qkv_ + Nq * Dp, .weight = d.k_norm,
                              .weight_lo = norm_lo(d.k_norm, Nkv * Dp), .rows = T,
                              .width = Nkv * Dp, .stride = Nqkv, .eps = eps,
                              .mean_width = Nkv * D},
                             stream_);
      break;
    case QkNormKind::kAfterRopeWeightless:  // Llama 4: attention_inputs does it after RoPE
      MOE_FAIL("layer ", layer,
               ": the unfused q/k path has no norm after RoPE (Llama 4 takes attention_inputs)");
  }
  MOE_CHECK(plans_[layer].query_scale == QueryScale::kNone, "layer ", layer,
            ": the unfused q/k path has no query temperature (Llama 4 takes attention_inputs)");
  if (plans_[layer].clip_qkv) {
    cuda::bias_clip({.x = qkv_, .rows = T, .width = (Nq + 2 * Nkv) * Dp, .stride = Nqkv,
                     .clip = static_cast<float>(*c.clip_qkv)},
                    stream_);
  }
  cuda::rope({.q = qkv_, .k = qkv_ + Nq * Dp, .positions = meta_.positions, .inv_freq = inv_freq_,
              .num_tokens = T, .num_q_heads = Nq, .num_kv_heads = Nkv, .head_dim = Dp,
              .rotary_dim = rotary_dim_, .q_stride = Nqkv, .k_stride = Nqkv,
              .attention_scaling = rope_scaling_, .interleaved = interleaved_rope(layer)},
             stream_);
  const int64_t slots = num_blocks_ * block_size_;
  if (kv_fp8_) {
    // Prefill's copies below then take the rows as the cache decodes them.
    const bool write_back = step.route == Route::kPrefill;
    cuda::kv_cache_write_fp8({.src = qkv_ + Nq * Dp, .codes = k_codes_[layer],
                              .scales = k_scales_[layer], .slots = meta_.slots, .num_tokens = T,
                              .num_heads = Nkv, .head_width = Dp, .src_stride = Nqkv,
                              .num_slots = slots, .write_back = write_back},
                             stream_);
    cuda::kv_cache_write_fp8({.src = qkv_ + (Nq + Nkv) * Dp, .codes = v_codes_[layer],
                              .scales = v_scales_[layer], .slots = meta_.slots, .num_tokens = T,
                              .num_heads = Nkv, .head_width = Dp, .src_stride = Nqkv,
                              .num_slots = slots, .write_back = write_back},
                             stream_);
  } else {
    cuda::kv_cache_write({.src = qkv_ + Nq * Dp, .cache = k_cache_[layer], .slots = meta_.slots,
                          .num_tokens = T, .width = Nkv * Dp, .src_stride = Nqkv,
                          .num_slots = slots},
                         stream_);
    cuda::kv_cache_write({.src = qkv_ + (Nq + Nkv) * Dp, .cache = v_cache_[layer],
                          .slots = meta_.slots, .num_tokens = T, .width = Nkv * Dp,
                          .src_stride = Nqkv, .num_slots = slots},
                         stream_);
  }
  auto copy_heads = [&](bf16* dst, int64_t offset, int64_t width) {
    CUDA_CHECK(cudaMemcpy2DAsync(dst, width * sizeof(bf16), qkv_ + offset, Nqkv * sizeof(bf16),
                                 width * sizeof(bf16), T, cudaMemcpyDeviceToDevice, stream_));
  };
  copy_heads(q_, 0, Nq * Dp);
  if (step.route == Route::kPrefill) {
    copy_heads(k_, Nq * Dp, Nkv * Dp);
    copy_heads(v_, (Nq + Nkv) * Dp, Nkv * Dp);
  }
}

void CudaDecoder::mla_attention(int64_t layer, const Step& step) {
  const ModelConfig& c = config_;
  const MlaConfig& m = *c.mla;
  const DeviceLayer& d = w_.layers[layer];
  const int64_t T = step.num_tokens, H = w_.padded_hidden_size, Nh = c.num_heads;
  const int64_t nope = m.qk_nope_head_dim, R = m.qk_rope_head_dim, vd = m.v_head_dim;
  const int64_t qk = m.qk_head_dim(), L = m.kv_lora_rank;
  // Padded (w_.mla): the latent's columns [L, Lp) and the rope key's [Lp + R, W) are zero in the
  // cache rows and in q_full.
  const int64_t Lp = w_.mla.latent, Rp = w_.mla.rope, W = w_.mla.cache_width();
  if (m.q_lora_rank > 0) {
    linear({.x = normed_, .rows = T, .w = d.q_a, .n = m.q_lora_rank, .k = H, .y = mla_q_lora_});
    cuda::strided_rms_norm({.x = mla_q_lora_, .weight = d.q_a_norm,
                            .weight_lo = norm_lo(d.q_a_norm, m.q_lora_rank), .rows = T,
                            .width = m.q_lora_rank, .stride = m.q_lora_rank, .eps = kMlaNormEps},
                           stream_);
    linear({.x = mla_q_lora_, .rows = T, .w = d.q_b, .n = Nh * qk, .k = m.q_lora_rank,
            .y = mla_q_});
  } else {
    linear({.x = normed_, .rows = T, .w = d.q_proj, .n = Nh * qk, .k = H, .y = mla_q_});
  }
  linear({.x = normed_, .rows = T, .w = d.kv_a, .n = W, .k = H, .y = mla_latent_});
  // kv_a_norm is stored Lp wide (zeros past L): its lo term starts Lp after it.
  cuda::strided_rms_norm({.x = mla_latent_, .weight = d.kv_a_norm,
                          .weight_lo = norm_lo(d.kv_a_norm, Lp), .rows = T, .width = L,
                          .stride = W, .eps = kMlaNormEps},
                         stream_);
  cuda::rope({.q = mla_q_ + nope, .k = mla_latent_ + Lp, .positions = meta_.positions,
              .inv_freq = inv_freq_, .num_tokens = T, .num_q_heads = Nh, .num_kv_heads = 1,
              .head_dim = qk, .rotary_dim = R, .q_stride = Nh * qk, .k_stride = W,
              .attention_scaling = rope_scaling_, .interleaved = interleaved_rope(layer)},
             stream_);
  const int64_t slots = num_blocks_ * block_size_;
  if (kv_fp8_) {
    // Two scale groups, as the CPU's rows (kv_row_groups): the latent and the rope key; the
    // padding is zero, so it changes no amax. Every read of the row (decode and prefill alike)
    // goes through the cache below, so mla_latent_ needs no write-back.
    cuda::kv_cache_write_fp8({.src = mla_latent_, .codes = k_codes_[layer],
                              .scales = k_scales_[layer], .slots = meta_.slots, .num_tokens = T,
                              .num_heads = 1, .head_width = Lp, .src_stride = W,
                              .num_slots = slots},
                             stream_);
    cuda::kv_cache_write_fp8({.src = mla_latent_ + Lp, .codes = v_codes_[layer],
                              .scales = v_scales_[layer], .slots = meta_.slots, .num_tokens = T,
                              .num_heads = 1, .head_width = Rp, .src_stride = W,
                              .num_slots = slots},
                             stream_);
  } else {
    cuda::kv_cache_write({.src = mla_latent_, .cache = k_cache_[layer], .slots = meta_.slots,
                          .num_tokens = T, .width = W, .src_stride = W, .num_slots = slots},
                         stream_);
  }
  // Queries into the latent space, head by head: q_full[t, h, 0:Lp] = W_uk[h]^T q_nope[t, h]
  // (kv_b[h] rows [0, nope) are W_uk[h], [nope, Lp) each).
  const bf16* kv_b_lo = lo_term(d.kv_b, Nh * (nope + vd) * Lp);
  absorbed({.a = mla_q_, .b = d.kv_b, .b_lo = kv_b_lo, .c = mla_q_full_, .m = T, .n = Lp,
            .k = nope,
            .lda = Nh * qk, .ldb = Lp, .ldc = Nh * W, .b_layout = cuda::DenseLayout::kKN,
            .batch = Nh, .batch_stride_a = qk, .batch_stride_b = (nope + vd) * Lp,
            .batch_stride_c = W});
  CUDA_CHECK(cudaMemcpy2DAsync(mla_q_full_ + Lp, W * sizeof(bf16), mla_q_ + nope,
                               qk * sizeof(bf16), R * sizeof(bf16), T * Nh,
                               cudaMemcpyDeviceToDevice, stream_));
  if (step.route == Route::kMlaPrefill) {
    // Attention rows are sequences: each one's new tokens over its paged rows at once.
    cuda::mla_prefill_attention({.q = mla_q_full_,
                                 .cache = k_cache_[layer],
                                 .latent_codes = k_codes_[layer],
                                 .rope_codes = v_codes_[layer],
                                 .latent_scales = k_scales_[layer],
                                 .rope_scales = v_scales_[layer],
                                 .cu_seqlens = meta_.cu_seqlens,
                                 .seq_lens = meta_.seq_lens,
                                 .tile_starts = meta_.paged_tile_starts,
                                 .block_tables = meta_.block_tables,
                                 .out = mla_out_latent_,
                                 .num_tokens = T,
                                 .num_seqs = step.num_seqs,
                                 .num_tiles = step.paged_tiles,
                                 .num_heads = Nh,
                                 .latent_dim = Lp,
                                 .rope_dim = Rp,
                                 .block_size = block_size_,
                                 .num_blocks = num_blocks_,
                                 .max_blocks_per_seq = step.table_stride,
                                 .max_seq_len = step.max_seq_len,
                                 .scale = attention_scale_},
                                stream_);
  } else {
    // Decode rows, or the per-query route's one row per token.
    cuda::mla_decode_attention({.q = mla_q_full_,
                                .cache = k_cache_[layer],
                                .latent_codes = k_codes_[layer],
                                .rope_codes = v_codes_[layer],
                                .latent_scales = k_scales_[layer],
                                .rope_scales = v_scales_[layer],
                                .block_tables = meta_.block_tables,
                                .seq_lens = meta_.seq_lens,
                                .out = mla_out_latent_,
                                .workspace = attn_workspace_,
                                .num_seqs = T,
                                .num_heads = Nh,
                                .latent_dim = Lp,
                                .rope_dim = Rp,
                                .block_size = block_size_,
                                .num_blocks = num_blocks_,
                                .max_blocks_per_seq = step.table_stride,
                                .max_seq_len = step.max_seq_len,
                                .scale = attention_scale_,
                                .fixed_chunk = attention_chunk_},
                               stream_);
  }
  // Each head's latent output lifted through its value rows W_uv[h] = kv_b rows after W_uk[h].
  absorbed({.a = mla_out_latent_, .b = d.kv_b + nope * Lp,
            .b_lo = kv_b_lo ? kv_b_lo + nope * Lp : nullptr, .c = attn_, .m = T, .n = vd, .k = Lp,
            .lda = Nh * Lp, .ldb = Lp, .ldc = Nh * vd, .batch = Nh, .batch_stride_a = Lp,
            .batch_stride_b = (nope + vd) * Lp, .batch_stride_c = vd});
  linear({.x = attn_, .rows = T, .w = d.mla_o, .n = H, .k = Nh * vd, .y = block_out_,
          .f32_out = true});
}

void CudaDecoder::absorbed(const cuda::DenseGemmParams& g) {
  if (options_.deterministic) {
    cuda::dense_gemm(g, stream_);
    return;
  }
  // cuBLAS is column-major: C^T[n, m] = op(B)[n, k] . A^T[k, m] per batch entry.
  const bool kn = g.b_layout == cuda::DenseLayout::kKN;
  auto gemm = [&](const bf16* b, void* c, bool f32, float beta) {
    const float one = 1.0f;
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(
        cublas_, kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(g.n),
        static_cast<int>(g.m), static_cast<int>(g.k), &one, b, CUDA_R_16BF,
        static_cast<int>(g.ldb), g.batch_stride_b, g.a, CUDA_R_16BF, static_cast<int>(g.lda),
        g.batch_stride_a, &beta, c, f32 ? CUDA_R_32F : CUDA_R_16BF, static_cast<int>(g.ldc),
        g.batch_stride_c, static_cast<int>(g.batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  if (g.b_lo == nullptr) {
    gemm(g.b, g.c, false, 0.0f);
    return;
  }
  // Two terms: summed in the float32 scratch in c's layout, then each head's n values rounded.
  MOE_CHECK(g.ldc == g.batch * g.batch_stride_c && g.m * g.ldc <= term_sum_elems_,
            "absorbed product of ", g.m, " x ", g.ldc, " does not fit the two-term scratch");
  gemm(g.b, term_sum_, true, 0.0f);
  gemm(g.b_lo, term_sum_, true, 1.0f);
  cuda::round_rows_to_bf16({.src = term_sum_, .dst = static_cast<bf16*>(g.c),
                            .rows = g.m * g.batch, .width = g.n,
                            .src_stride = g.batch_stride_c, .dst_stride = g.batch_stride_c},
                           stream_);
}

void CudaDecoder::dense_mlp(const bf16* x, const bf16* gate_up, const bf16* down, int64_t width,
                            int64_t num_tokens, void* out, bool f32_out) {
  const int64_t H = w_.padded_hidden_size;
  linear({.x = x, .rows = num_tokens, .w = gate_up, .n = 2 * width, .k = H, .y = mlp_gate_up_});
  cuda::silu_mul({.gate_up = mlp_gate_up_, .out = mlp_act_, .num_tokens = num_tokens,
                  .width = width},
                 stream_);
  linear({.x = mlp_act_, .rows = num_tokens, .w = down, .n = H, .k = width, .y = out,
          .f32_out = f32_out});
}

int64_t CudaDecoder::attention_chunk_of(const LayerPlan& plan) const {
  switch (plan.span) {
    case AttentionSpan::kCausal:
      return 0;
    case AttentionSpan::kChunked:
      return config_.attention_chunk_size;
  }
  MOE_FAIL("unknown attention span ", static_cast<int>(plan.span));
}

bool CudaDecoder::interleaved_rope(int64_t layer) const {
  // Llama 4's NoPE layers take attention_inputs with rope = false and never ask.
  MOE_CHECK(plans_[layer].position == PositionEncoding::kRope, "layer ", layer,
            " has no RoPE (NoPE): only the fused attention-input path runs such layers");
  switch (plans_[layer].rope) {
    case RopePairing::kHalves:
      return false;
    case RopePairing::kInterleaved:
      return true;
  }
  MOE_FAIL("layer ", layer, ": unknown RoPE pairing");
}

void CudaDecoder::build_moe_block() {
  if (config_.num_experts <= 0) return;
  const ExpertShape shape{
      .num_experts = config_.num_experts,
      .hidden_size = w_.padded_hidden_size,
      .expert_width = w_.padded_expert_width,
      .weight_terms = w_.expert_quant == cuda::ExpertQuant::kNone ? w_.weight_terms : 1,
      .quant = w_.expert_quant,
      .quant_group = w_.expert_quant_group,
      .activation = expert_activation(config_),
      .batch_invariant = options_.deterministic,
      .one_row_blocks = options_.one_row_expert_blocks};
  const std::span<const DeviceLayer> layers(w_.layers);
  std::unique_ptr<ExpertRunner> runner;
  if (cache_) {
    runner = std::make_unique<CachedExpertRunner>(*cache_, layers, shape, expert_act_);
  } else {
    runner = std::make_unique<ResidentExperts>(layers, shape, expert_act_, fp8_act_);
  }
  auto linear_fn = [this](const bf16* x, int64_t rows, const bf16* w, int64_t n, int64_t k,
                          void* y, bool f32_out) {
    linear({.x = x, .rows = rows, .w = w, .n = n, .k = k, .y = y, .f32_out = f32_out});
  };
  auto mlp_fn = [this](const bf16* x, const bf16* gate_up, const bf16* down, int64_t width,
                       int64_t rows, bf16* out) {
    dense_mlp(x, gate_up, down, width, rows, out, /*f32_out=*/false);
  };
  std::unique_ptr<TokenDispatcher> dispatcher;
  if (options_.expert_parallel != nullptr) {
    parallel::Communicator& comm = *options_.expert_parallel;
    // Collective, as the dispatcher's construction: every rank builds its decoder together.
    RowTransport transport =
        make_row_transport(comm, options_.ep_transport, options_.device, stream_);
    auto ep = std::make_unique<DeviceDispatcher>(
        comm, std::move(transport),
        options_.placement ? *options_.placement
                           : parallel::ExpertPlacement(config_.num_experts, comm.size()),
        config_.num_experts, w_.padded_hidden_size,
        comm.size() * tcap_ * config_.num_experts_per_tok, ep_plan_rows_);
    ep_dispatcher_ = ep.get();
    dispatcher = std::move(ep);
  } else {
    dispatcher = std::make_unique<LocalDispatcher>(config_.num_experts, w_.padded_hidden_size,
                                                   weighted_rows_);
  }
  moe_ = std::make_unique<MoeBlock>(
      MoeBlockOptions{.router = router_options(config_),
                      .shape = shape,
                      .top_k = config_.num_experts_per_tok,
                      .weights = config_.routing_weight_on_input ? moe::WeightPlacement::kInput
                                                                 : moe::WeightPlacement::kOutput,
                      .approx = options_.routing},
      layers, plans_, moe_buffers_, std::move(dispatcher), std::move(runner), linear_fn,
      mlp_fn);
}

void CudaDecoder::feed_forward(int64_t layer, int64_t T) {
  const DeviceLayer& d = w_.layers[layer];
  switch (plans_[layer].feed_forward) {
    case FeedForwardKind::kDenseMlp:
      dense_mlp(normed_, d.mlp_gate_up, d.mlp_down, d.mlp_width, T, block_out_,
                /*f32_out=*/true);
      mark(profile::Stage::kDenseMlp, layer);
      break;
    case FeedForwardKind::kMoe:
      moe_->enqueue(layer, moe_io(layer, T), stream_, stage_marks());
      break;
  }
  MOE_CHECK(!pending_norm_, "layer ", layer,
            ": the post-attention norm was left for a product that never ran");
}

MoeLayerIo CudaDecoder::moe_io(int64_t layer, int64_t T) {
  const int64_t K = config_.num_experts_per_tok, E = config_.num_experts;
  MoeLayerIo io{.hidden = normed_,
                .num_tokens = T,
                .num_valid = meta_.num_valid,
                .noise_keys = meta_.route_keys,
                .expert_counts = expert_counts_ + layer * (E + 1),
                .out = block_out_};
  if (tracing_) {
    // While routing is captured, each layer's router writes into its own rows of the capture
    // buffers, which the layer's plan and unpermute then read: no copy, no extra kernel. Micro-
    // batch B's rows follow A's.
    const int64_t first = layer * routing_pitch() + routing_row_offset_;
    io.topk_ids = routing_ids_.get() + first * K;
    io.topk_weights = routing_weights_.get() + first * K;
  }
  return io;
}

StageMarks CudaDecoder::stage_marks() {
  return {.stage = [this](profile::Stage stage, int64_t l) { mark(stage, l); },
          .expert_wait = [this](int64_t l) { mark(profile::Stage::kPlan, l, true); }};
}

void CudaDecoder::run(const Step& step) {
  cuda::set_programmatic_launch(options_.programmatic_launch);  // this decoder's, for its launches
  cuda::set_weight_prefetch_bytes(options_.weight_prefetch_bytes);
  // A profiled step replays a graph with its events only where the device times events that
  // a graph recorded; elsewhere profiled steps run eagerly.
  if (!step.graph) {
    begin_timeline(&eager_timeline_);
    enqueue_layers(step);
    return;
  }
  if (profiling_ && !graph_events_time_) {  // a graph step run eagerly, LM head included
    begin_timeline(&eager_timeline_);
    enqueue_layers(step);
    enqueue_lm_head(step, 0, step.num_tokens);
    return;
  }
  const auto key = std::make_tuple(step.num_tokens, step.context_bucket, profiling_, tracing_);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    Graph entry;
    // The first step of a bucket runs eagerly (its results are this step's), so every kernel and
    // cuBLAS heuristic is loaded before the capture records the same work for later steps.
    begin_timeline(&eager_timeline_);
    enqueue_layers(step);
    enqueue_lm_head(step, 0, step.num_tokens);
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      begin_timeline(&entry.timeline);  // the same events, recorded by the graph from now on
      enqueue_layers(step);
      enqueue_lm_head(step, 0, step.num_tokens);
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    decode_graph_counts_ = count_graph_nodes(graph);
    const cudaError_t status = cudaGraphInstantiate(&entry.exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_CHECK(status);
    graphs_.emplace(key, std::move(entry));
    timeline_ = profiling_ ? &eager_timeline_ : nullptr;  // this step ran eagerly
    return;
  }
  timeline_ = profiling_ ? &it->second.timeline : nullptr;
  CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream_));
}

void CudaDecoder::begin_timeline(Timeline* timeline) {
  timeline_ = profiling_ ? timeline : nullptr;
  if (!timeline_) return;
  timeline_->marks.clear();
  if (timeline_->events.empty()) {
    timeline_->events.emplace_back();
    CUDA_CHECK(cudaEventCreate(&timeline_->events.back()));
  }
  record_event(timeline_->events[0], stream_);
}

void CudaDecoder::mark(profile::Stage stage, int64_t layer, bool expert_wait) {
  if (!timeline_) return;
  Timeline& t = *timeline_;
  if (t.events.size() < t.marks.size() + 2) {
    t.events.emplace_back();
    CUDA_CHECK(cudaEventCreate(&t.events.back()));
  }
  t.marks.push_back({stage, layer, expert_wait});
  record_event(t.events[t.marks.size()], stream_);
}

void CudaDecoder::enqueue_profile_readback() {
  const int64_t E = config_.num_experts;
  if (E == 0 || profile::active() == nullptr) return;
  CUDA_CHECK(cudaMemcpyAsync(host_expert_counts_.get(), expert_counts_,
                             static_cast<size_t>(config_.num_layers * (E + 1)) * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream_));
  if (cache_) cache_->enqueue_counter_readback(stream_);
}

void CudaDecoder::report_expert_cache(profile::Profiler& profiler,
                                      std::span<const double> stall_s) {
  const std::span<const int64_t> now = cache_->counters();
  reported_cache_counters_.resize(now.size(), 0);
  constexpr int64_t C = offload::kNumCacheCounters;
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (!w_.layers[l].is_moe) continue;
    int64_t delta[C];
    for (int64_t k = 0; k < C; ++k) delta[k] = now[l * C + k] - reported_cache_counters_[l * C + k];
    // Every copy and every unplaced expert's read crosses PCIe once.
    const int64_t crossed =
        delta[offload::kCacheMisses] + delta[offload::kCachePrefetched] +
        delta[offload::kCacheUnplaced];
    profiler.record_expert_cache(l, delta, crossed * cache_->slot_bytes(),
                                 stall_s.empty() ? 0.0 : stall_s[l]);
  }
  reported_cache_counters_.assign(now.begin(), now.end());
}

void CudaDecoder::report_step(profile::Profiler& profiler, const Step& step) {
  const int64_t previous_layer = profiler.current_layer();
  // The expert cache's stall: the expert-wait spans of a timed step, counted for the time_every
  // steps it stands for (the untimed ones record none), so the run's total estimates every step.
  std::vector<double> stall_s;
  if (timeline_) {
    const Timeline& t = *timeline_;
    std::vector<float> ms(t.marks.size(), 0.0f);
    for (size_t i = 0; i < t.marks.size(); ++i) {
      const cudaError_t status = cudaEventElapsedTime(&ms[i], t.events[i], t.events[i + 1]);
      if (status == cudaSuccess) continue;
      cudaGetLastError();  // not sticky: clear it so later launch checks do not see it
      MOE_CHECK(timeline_ != &eager_timeline_, "profiler: ", cudaGetErrorString(status),
                " timing stage events");
      // Events a graph recorded cannot be timed here: this step's stage times are lost, and
      // later profiled steps run eagerly.
      graph_events_time_ = false;
      ms.clear();
      break;
    }
    const double sampled = static_cast<double>(std::max<int64_t>(profiler.options().time_every, 1));
    for (size_t i = 0; i < ms.size(); ++i) {
      profiler.set_current_layer(t.marks[i].layer);
      profiler.add_time(t.marks[i].stage, static_cast<int64_t>(static_cast<double>(ms[i]) * 1e6));
      if (t.marks[i].expert_wait) {
        stall_s.resize(static_cast<size_t>(config_.num_layers), 0.0);
        stall_s[t.marks[i].layer] += static_cast<double>(ms[i]) * 1e-3 * sampled;
      }
    }
  }
  profiler.set_current_layer(-1);
  if (sample_timed_) {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, sample_events_[0], sample_events_[1]));
    profiler.add_time(profile::Stage::kSample, static_cast<int64_t>(static_cast<double>(ms) * 1e6));
  }
  profiler.set_current_layer(previous_layer);
  // Rows per expert from the plan's counts (copied by enqueue_profile_readback), and the weight
  // bytes the step read: every non-expert weight and the experts some row reached.
  const int32_t* counts = host_expert_counts_.get();
  const int64_t E = config_.num_experts;
  const int64_t expert_bytes = w_.expert_bytes;
  int64_t expert_total = 0, touched = 0;  // expert_total: the routed experts in w_.bytes
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (!w_.layers[l].is_moe) continue;
    if (!w_.experts_offloaded) expert_total += E * expert_bytes;
    const std::span<const int32_t> row(counts + l * (E + 1), static_cast<size_t>(E));
    if (profiler.num_experts() == E) profiler.record_expert_counts(l, row);
    touched += std::count_if(row.begin(), row.end(), [](int32_t c) { return c > 0; });
  }
  const int64_t kv_read = static_cast<int64_t>(step.num_rows) * step.max_seq_len *
                          report_.kv_bytes_per_token;  // an upper bound: padded to the bucket
  profiler.add_link_bytes(profile::Link::kOnDevice,
                          w_.bytes - expert_total + touched * expert_bytes + kv_read);
  profiler.add_link_bytes(profile::Link::kHostDevice, host_device_bytes_);
  if (cache_) report_expert_cache(profiler, stall_s);
}

void CudaDecoder::forward(const ForwardBatch& batch, std::span<float> logits) {
  if (two_lanes_) return forward_micro_batches(batch, logits);
  const int64_t V = config_.vocab_size;
  const Step step = prepare(batch);
  MOE_CHECK(static_cast<int64_t>(logits.size()) == step.logit_rows * V, "logits buffer holds ",
            logits.size(), " floats, needs ", step.logit_rows * V);
  run(step);
  for (int64_t first = 0; first < step.logit_rows; first += rcap_) {
    const int64_t rows = std::min(rcap_, step.logit_rows - first);
    // A graph already computed the first chunk (all its rows, padding included).
    if (!(step.graph && first == 0)) enqueue_lm_head(step, first, rows);
    CUDA_CHECK(cudaMemcpyAsync(logits.data() + first * V, logits_,
                               static_cast<size_t>(rows * V) * sizeof(float),
                               cudaMemcpyDeviceToHost, stream_));
    host_device_bytes_ += rows * V * static_cast<int64_t>(sizeof(float));
  }
  enqueue_profile_readback();
  enqueue_routing_readback(step);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (profile::Profiler* profiler = profile::active()) report_step(*profiler, step);
  report_routing(step);
}

void CudaDecoder::forward_sample(const ForwardBatch& batch, std::span<const GpuSamplingRow> rows,
                                 std::span<int32_t> tokens) {
  MOE_CHECK(!batch.all_positions, "forward_sample samples the last token of each sequence only");
  if (two_lanes_) return forward_sample_micro_batches(batch, rows, tokens);
  const Step step = prepare(batch);
  MOE_CHECK(static_cast<int64_t>(rows.size()) == step.logit_rows &&
                static_cast<int64_t>(tokens.size()) == step.logit_rows,
            "forward_sample got ", rows.size(), " sampling rows and room for ", tokens.size(),
            " tokens; the batch has ", step.logit_rows, " rows that want logits");
  MOE_CHECK(step.logit_rows <= rcap_, step.logit_rows, " sampled rows exceed ", rcap_);
  run(step);
  if (step.logit_rows == 0) {
    enqueue_profile_readback();
    enqueue_routing_readback(step);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (profile::Profiler* profiler = profile::active()) report_step(*profiler, step);
    report_routing(step);
    return;
  }
  enqueue_sampling(step, rows);
  const int64_t R = step.logit_rows;
  enqueue_profile_readback();
  enqueue_routing_readback(step);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::copy_n(host_meta_.tokens, R, tokens.data());
  if (profile::Profiler* profiler = profile::active()) report_step(*profiler, step);
  report_routing(step);
}

void CudaDecoder::enqueue_sampling(const Step& step, std::span<const GpuSamplingRow> rows) {
  const int64_t R = static_cast<int64_t>(rows.size());
  if (!step.graph) enqueue_lm_head(step, 0, R);
  for (int64_t r = 0; r < R; ++r) {
    host_meta_.temperature[r] = rows[r].temperature;
    host_meta_.top_k[r] = rows[r].top_k;
    host_meta_.top_p[r] = rows[r].top_p;
    host_meta_.seeds[r] = rows[r].seed;
    host_meta_.steps[r] = rows[r].step;
  }
  auto up = [&](auto* dst, const auto* src) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(R) * sizeof(*src),
                               cudaMemcpyHostToDevice, stream_));
    host_device_bytes_ += R * static_cast<int64_t>(sizeof(*src));
  };
  up(meta_.temperature, host_meta_.temperature);
  up(meta_.top_k, host_meta_.top_k);
  up(meta_.top_p, host_meta_.top_p);
  up(meta_.seeds, host_meta_.seeds);
  up(meta_.steps, host_meta_.steps);
  if (profiling_) {
    for (cudaEvent_t& e : sample_events_) {
      if (!e) CUDA_CHECK(cudaEventCreate(&e));
    }
    CUDA_CHECK(cudaEventRecord(sample_events_[0], stream_));
  }
  cuda::sample_tokens({.logits = logits_, .temperature = meta_.temperature, .top_k = meta_.top_k,
                       .top_p = meta_.top_p, .seeds = meta_.seeds, .steps = meta_.steps,
                       .tokens = meta_.tokens, .num_rows = R, .vocab_size = config_.vocab_size},
                      stream_);
  if (profiling_) {
    CUDA_CHECK(cudaEventRecord(sample_events_[1], stream_));
    sample_timed_ = true;
  }
  CUDA_CHECK(cudaMemcpyAsync(host_meta_.tokens, meta_.tokens, static_cast<size_t>(R) * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream_));
  host_device_bytes_ += R * static_cast<int64_t>(sizeof(int32_t));
}

std::array<Step, 2> CudaDecoder::prepare_micro_batches(const ForwardBatch& batch) {
  // A: the first half of the sequences (the larger half when odd), B: the rest; either may be
  // empty and then runs as one padding row that still joins every exchange.
  const size_t num_a = (batch.sequences.size() + 1) / 2;
  std::array<ForwardBatch, 2> parts;
  parts[0].sequences.assign(batch.sequences.begin(), batch.sequences.begin() + num_a);
  parts[1].sequences.assign(batch.sequences.begin() + num_a, batch.sequences.end());
  std::array<Step, 2> steps;
  int64_t bytes = 0;
  for (int m = 0; m < 2; ++m) {
    parts[m].all_positions = batch.all_positions;
    LaneSwap lane(*this, m);
    steps[m] = prepare(parts[m]);  // resets the step's byte count: summed here
    bytes += host_device_bytes_;
  }
  host_device_bytes_ = bytes;
  // B's routing rows follow A's in the capture buffers (routing_pitch leaves room for B's
  // padding row when A fills Tcap). A's rows are all real unless the whole step is empty, so
  // the real rows of both are rows [0, A's + B's real rows).
  lane_b_.routing_row_offset_ = steps[0].num_tokens;
  // No stage times: events on two streams do not make one timeline (the counts and bytes are
  // still reported).
  profiling_ = false;
  timeline_ = nullptr;
  return steps;
}

int64_t CudaDecoder::advance_micro_batch(const Step& step, int64_t first) {
  const int64_t L = config_.num_layers;
  for (int64_t l = first; l < L; ++l) {
    enqueue_attention_block(l, step);
    if (plans_[l].feed_forward == FeedForwardKind::kMoe) {
      moe_->start(l, moe_io(l, step.num_tokens), stream_, stage_marks());
      return l;
    }
    feed_forward(l, step.num_tokens);
  }
  enqueue_final_norm(step);
  return L;
}

void CudaDecoder::run_micro_batches(const std::array<Step, 2>& steps) {
  cuda::set_programmatic_launch(options_.programmatic_launch);
  cuda::set_weight_prefetch_bytes(options_.weight_prefetch_bytes);
  const int64_t L = config_.num_layers;
  if (!options_.overlap_micro_batches) {
    // A's whole step, then B's: B's stream waits for A's last kernel, so nothing overlaps. Every
    // rank still issues A's exchanges, then B's.
    {
      LaneSwap a(*this, 0);
      enqueue_layers(steps[0]);
      CUDA_CHECK(cudaEventRecord(a_done_, stream_));
    }
    LaneSwap b(*this, 1);
    CUDA_CHECK(cudaStreamWaitEvent(stream_, a_done_, 0));
    enqueue_layers(steps[1]);
    return;
  }
  // Each micro-batch's attention and route up to its first MoE layer's dispatch, A's then B's,
  // on their streams. Then per MoE layer: A's dispatch (the host waits for A's offsets while B's
  // stream computes), B's dispatch (while A's experts run), A's combine (while B's experts
  // run) and A's next layers up to its next dispatch, B's combine (while A's next attention
  // runs) and B's next layers. Every rank issues the exchanges in this order, as the CPU
  // decoder does (Decoder::forward_micro_batches). The lanes share only the weights and the KV
  // and state pools, where their sequences' rows and slots are disjoint: no event is needed
  // between the streams within a step.
  std::array<int64_t, 2> at{};
  for (int m = 0; m < 2; ++m) {
    LaneSwap lane(*this, m);
    enqueue_embedding(steps[m]);
    at[m] = advance_micro_batch(steps[m], 0);
  }
  while (at[0] < L) {
    MOE_CHECK(at[0] == at[1], "micro-batches at MoE layers ", at[0], " and ", at[1]);
    const int64_t layer = at[0];
    for (int m = 0; m < 2; ++m) {
      LaneSwap lane(*this, m);
      moe_->run_experts(stream_, stage_marks());
    }
    for (int m = 0; m < 2; ++m) {
      LaneSwap lane(*this, m);
      moe_->finish(stream_, stage_marks());
      at[m] = advance_micro_batch(steps[m], layer + 1);
    }
  }
}

void CudaDecoder::report_micro_batches(const std::array<Step, 2>& steps) {
  // Both steps as one for the report: their rows and the longer context.
  Step whole = steps[0];
  whole.num_tokens += steps[1].num_tokens;
  whole.num_valid += steps[1].num_valid;
  whole.num_rows += steps[1].num_rows;
  whole.num_seqs += steps[1].num_seqs;
  whole.max_seq_len = std::max(steps[0].max_seq_len, steps[1].max_seq_len);
  whole.logit_rows += steps[1].logit_rows;
  if (tracing_) {  // both lanes' routers are done: the capture rows of both, on A's stream
    enqueue_routing_readback(whole);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  if (profile::Profiler* profiler = profile::active()) {
    if (config_.num_experts > 0) {  // B's plan counts (read back on B's stream) into A's
      const int64_t n = config_.num_layers * (config_.num_experts + 1);
      for (int64_t i = 0; i < n; ++i) host_expert_counts_[i] += lane_b_.host_expert_counts_[i];
    }
    report_step(*profiler, whole);
  }
  report_routing(whole);
}

void CudaDecoder::forward_micro_batches(const ForwardBatch& batch, std::span<float> logits) {
  const int64_t V = config_.vocab_size;
  const std::array<Step, 2> steps = prepare_micro_batches(batch);
  const int64_t logit_rows = steps[0].logit_rows + steps[1].logit_rows;
  MOE_CHECK(static_cast<int64_t>(logits.size()) == logit_rows * V, "logits buffer holds ",
            logits.size(), " floats, needs ", logit_rows * V);
  run_micro_batches(steps);
  // A's logits rows, then B's.
  int64_t offset = 0;
  for (int m = 0; m < 2; ++m) {
    LaneSwap lane(*this, m);
    const Step& step = steps[m];
    for (int64_t first = 0; first < step.logit_rows; first += rcap_) {
      const int64_t rows = std::min(rcap_, step.logit_rows - first);
      enqueue_lm_head(step, first, rows);
      CUDA_CHECK(cudaMemcpyAsync(logits.data() + (offset + first) * V, logits_,
                                 static_cast<size_t>(rows * V) * sizeof(float),
                                 cudaMemcpyDeviceToHost, stream_));
      host_device_bytes_ += rows * V * static_cast<int64_t>(sizeof(float));
    }
    offset += step.logit_rows;
    enqueue_profile_readback();
  }
  for (int m = 0; m < 2; ++m) {
    LaneSwap lane(*this, m);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  report_micro_batches(steps);
}

void CudaDecoder::forward_sample_micro_batches(const ForwardBatch& batch,
                                               std::span<const GpuSamplingRow> rows,
                                               std::span<int32_t> tokens) {
  const std::array<Step, 2> steps = prepare_micro_batches(batch);
  const int64_t R = steps[0].logit_rows + steps[1].logit_rows;
  MOE_CHECK(static_cast<int64_t>(rows.size()) == R && static_cast<int64_t>(tokens.size()) == R,
            "forward_sample got ", rows.size(), " sampling rows and room for ", tokens.size(),
            " tokens; the batch has ", R, " rows that want logits");
  MOE_CHECK(steps[0].logit_rows <= rcap_ && steps[1].logit_rows <= rcap_, R,
            " sampled rows exceed ", rcap_, " in a micro-batch");
  run_micro_batches(steps);
  // A's rows are the first of `rows` and `tokens`, B's the rest.
  const std::array<int64_t, 2> first = {0, steps[0].logit_rows};
  for (int m = 0; m < 2; ++m) {
    LaneSwap lane(*this, m);
    const int64_t rows_m = steps[m].logit_rows;
    if (rows_m > 0) {
      enqueue_sampling(steps[m],
                       rows.subspan(static_cast<size_t>(first[m]), static_cast<size_t>(rows_m)));
    }
    enqueue_profile_readback();
  }
  for (int m = 0; m < 2; ++m) {
    LaneSwap lane(*this, m);
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::copy_n(host_meta_.tokens, steps[m].logit_rows, tokens.data() + first[m]);
  }
  report_micro_batches(steps);
}

void CudaDecoder::drop_graphs() {
  for (auto& [key, graph] : graphs_) {
    cudaGraphExecDestroy(graph.exec);
    for (cudaEvent_t e : graph.timeline.events) cudaEventDestroy(e);
  }
  graphs_.clear();
}

void CudaDecoder::set_routing_approximation(const moe::RoutingApproximation& approx) {
  if (moe_ == nullptr) {  // no MoE layer: nothing is routed, but the values are still checked
    moe::check_routing_device(approx, /*cuda=*/true);
    options_.routing = approx;
    return;
  }
  if (approx == options_.routing) return;  // eval switches per window: keep the graphs
  moe_->set_approximation(approx);  // validates against the router
  if (lane_b_.moe_) lane_b_.moe_->set_approximation(approx);
  options_.routing = approx;
  // The graphs hold the route stage's launches as they were captured.
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  drop_graphs();
}

void CudaDecoder::set_routing_observer(Decoder::RoutingObserver observer) {
  routing_observer_ = std::move(observer);
  const int64_t K = config_.num_experts_per_tok;
  if (!routing_observer_ || routing_ids_ != nullptr || config_.num_experts == 0) return;
  const size_t count = static_cast<size_t>(config_.num_layers * routing_pitch() * K);
  routing_ids_ = device_array<int32_t>(count);
  routing_weights_ = device_array<float>(count);
  host_routing_ids_ = pinned_array<int32_t>(count);
  host_routing_weights_ = pinned_array<float>(count);
}

// The real rows of every layer's routing, [L][num_valid, K] out of [L][Tcap + 1, K], ahead of the
// step's synchronisation.
void CudaDecoder::enqueue_routing_readback(const Step& step) {
  if (!tracing_ || config_.num_experts == 0) return;
  const size_t K = static_cast<size_t>(config_.num_experts_per_tok);
  const size_t pitch = static_cast<size_t>(routing_pitch()) * K;
  const size_t width = static_cast<size_t>(step.num_valid) * K;
  const size_t layers = static_cast<size_t>(config_.num_layers);
  CUDA_CHECK(cudaMemcpy2DAsync(host_routing_ids_.get(), pitch * sizeof(int32_t), routing_ids_.get(),
                               pitch * sizeof(int32_t), width * sizeof(int32_t), layers,
                               cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaMemcpy2DAsync(host_routing_weights_.get(), pitch * sizeof(float), routing_weights_.get(),
                               pitch * sizeof(float), width * sizeof(float), layers,
                               cudaMemcpyDeviceToHost, stream_));
}

void CudaDecoder::report_routing(const Step& step) {
  if (!tracing_ || config_.num_experts == 0) return;
  const int64_t K = config_.num_experts_per_tok;
  moe::Routing routing{.num_tokens = step.num_valid, .top_k = K};
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    if (!w_.layers[l].is_moe) continue;
    const int32_t* ids = host_routing_ids_.get() + l * routing_pitch() * K;
    const float* weights = host_routing_weights_.get() + l * routing_pitch() * K;
    routing.topk_ids.assign(ids, ids + step.num_valid * K);
    // An assignment a routing approximation dropped is the null expert E on the device.
    for (int32_t& id : routing.topk_ids) {
      if (id == config_.num_experts) id = moe::kNoExpert;
    }
    routing.topk_weights.assign(weights, weights + step.num_valid * K);
    routing_observer_(l, routing);
  }
}

std::vector<int64_t> CudaDecoder::expert_cache_counters() {
  if (!cache_) return {};
  cache_->enqueue_counter_readback(stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::span<const int64_t> counters = cache_->counters();
  return {counters.begin(), counters.end()};
}

std::vector<int32_t> CudaDecoder::expert_counts() {
  const int64_t E = config_.num_experts;
  std::vector<int32_t> counts(static_cast<size_t>(config_.num_layers * E), 0);
  if (E == 0) return counts;
  std::vector<int32_t> rows(static_cast<size_t>(config_.num_layers * (E + 1)));
  for (int m = 0; m < (two_lanes_ ? 2 : 1); ++m) {  // the last step's: both micro-batches'
    LaneSwap lane(*this, m);
    CUDA_CHECK(cudaMemcpyAsync(rows.data(), expert_counts_, rows.size() * sizeof(int32_t),
                               cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (int64_t l = 0; l < config_.num_layers; ++l) {
      if (!w_.layers[l].is_moe) continue;
      for (int64_t e = 0; e < E; ++e) counts[l * E + e] += rows[l * (E + 1) + e];
    }
  }
  return counts;
}

void select_device(int device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  MOE_CHECK(status == cudaSuccess && count > 0, "--device cuda: no CUDA device is visible (",
            cudaGetErrorString(status), ")");
  MOE_CHECK(device >= 0 && device < count, "CUDA device ", device, " does not exist (", count,
            " visible)");
  CUDA_CHECK(cudaSetDevice(device));
}


}  // namespace
}  // namespace gpu

std::unique_ptr<GpuDecoder> GpuDecoder::create(const ModelConfig& config,
                                               const DecoderWeights& weights,
                                               const GpuOptions& options) {
  check_gpu_support(config);
  check_gpu_kv_dtype(config, options.kv_dtype);
  check_gpu_offload(config, options.offload);
  gpu::select_device(options.device);
  offload::check_offload_model(options.offload, config.num_experts,
                               "the " + config.model_type + " model");
  gpu::DeviceWeights device_weights =
      gpu::upload_weights(config, weights, !options.quiet, options.offload.enabled(),
                          options.weight_dtype == GpuWeightDtype::kBf16);
  return std::make_unique<gpu::CudaDecoder>(config, std::move(device_weights), options);
}

std::unique_ptr<GpuDecoder> GpuDecoder::create_synthetic(const ModelConfig& config,
                                                         const GpuOptions& options,
                                                         const SyntheticGpuOptions& synthetic) {
  check_gpu_support(config);
  check_gpu_kv_dtype(config, options.kv_dtype);
  check_gpu_offload(config, options.offload);
  gpu::select_device(options.device);
  offload::check_offload_model(options.offload, config.num_experts,
                               "the " + config.model_type + " model");
  gpu::DeviceWeights device_weights =
      gpu::synthetic_weights(config, synthetic.seed, synthetic.routing, options.offload.enabled(),
                             synthetic.expert_weights, synthetic.weight_scope);
  return std::make_unique<gpu::CudaDecoder>(config, std::move(device_weights), options);
}

int cuda_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::string cuda_device_uuid(int device) {
  cudaDeviceProp prop{};
  if (device < 0 || device >= cuda_device_count() ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    return {};
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (const char byte : prop.uuid.bytes) {
    hex += kHex[(static_cast<unsigned char>(byte) >> 4) & 15];
    hex += kHex[static_cast<unsigned char>(byte) & 15];
  }
  return hex;
}

DeviceFloors measure_device_floors() {
  return DeviceFloors{.copy_bytes_per_s = cuda::measure_copy_bandwidth(),
                      .gemm_flops = cuda::measure_gemm_flops(),
                      .host_to_device_bytes_per_s = cuda::measure_host_to_device_bandwidth()};
}


}  // namespace moeinfer
