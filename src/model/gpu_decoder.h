// The forward pass on one NVIDIA GPU: the same model as Decoder (model/decoder.h), every stage
// on the device in bf16 with float32 accumulation (a float32 checkpoint's weights in two bf16
// terms, GpuWeightDtype), the KV cache paged in device memory, decode steps captured in CUDA
// graphs per batch-size bucket.
//
// Weights are streamed from the memory-mapped checkpoint through two pinned staging buffers
// (converted to bf16 on the way, no second full copy in host memory), or, for synthetic models,
// filled with random values directly on the device. Device memory is weights + a workspace
// sized for the largest step (at most half of what the budget leaves after the weights) + the KV
// pool, which takes what is left of gpu_memory_fraction of the card.
//
// Without CUDA support compiled in (or without a device) create() throws moeinfer::Error
// saying so. The header itself needs no CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "io/model_config.h"
#include "kv/kv_cache.h"
#include "model/attention_route.h"
#include "model/decoder.h"
#include "model/weight_quant.h"
#include "offload/offload_options.h"

namespace moeinfer {

// ProfilerOptions::time_every when the GPU decoder runs the steps. A timed step records a CUDA
// event after every stage of every layer (about 6 per layer), which costs 9-21% of a decode step
// (bench/RESULTS.md); timing one step in 16, and only counting rows and bytes on the others,
// keeps the profiler within 3% of step time.
inline constexpr int64_t kGpuProfileTimeEvery = 16;

// How a float32 or float16 checkpoint's weights are held on the GPU (a bf16 one is held as it
// is). kCheckpoint: each weight as two bf16 terms, hi = bf16(w) and lo = bf16(w - hi), summed in
// every product in float32 (gpu/device_weights.h), so the GPU computes with the checkpoint's
// weights rather than a rounding of them, as transformers does with its dtype "auto"; twice the
// weight bytes and tensor-core work of kBf16. kBf16 (--dtype bfloat16): each weight rounded to
// bf16 once, what vLLM and SGLang run a float32 checkpoint as by default.
enum class GpuWeightDtype { kCheckpoint, kBf16 };

// What carries the rows of --ep on cuda between the ranks' GPUs (--ep-transport,
// model/cuda/row_transport.h): kNccl sends device buffers GPU to GPU (every rank on a GPU of its
// own, NCCL built); kStaged copies them through pinned host memory and the job's host
// communicator (MPI), which ranks sharing a GPU need; kAuto picks kNccl where it can run.
enum class EpTransport { kAuto, kNccl, kStaged };

// GpuOptions::skinny_gemm_rows by default: one row. On an H100 a batch-1 decode step of
// Qwen3-30B-A3B took 4.55 ms with it against 4.79 ms with cuBLAS; at 4 and 8 rows the QKV and O
// projections alone run 0.6-0.8x cuBLAS (bench_cuda_stages --projections-only, bench/RESULTS.md).
inline constexpr int64_t kDefaultSkinnyGemmRows = 1;

struct GpuOptions {
  int device = 0;
  GpuWeightDtype weight_dtype = GpuWeightDtype::kCheckpoint;
  double gpu_memory_fraction = 0.9;  // of the card's memory, for weights + workspace + KV
  int64_t max_batch_tokens = 512;    // tokens one forward() may carry (sizes the workspace)
  int64_t max_num_seqs = 256;        // sequences one decode step may carry
  int64_t max_model_len = 0;         // 0: the model's max_position_embeddings
  int64_t block_size = 16;           // tokens per KV block
  int64_t num_kv_blocks = 0;         // 0: all that the memory fraction leaves
  bool cuda_graphs = true;           // capture decode steps
  // Launch the small kernels of a step as programmatic dependents of the kernel before them
  // (Hopper; backend/cuda/programmatic_launch.h): same results, shorter gaps between kernels.
  bool programmatic_launch = true;
  // Bytes of each weight row the decode GEMVs ask of L2 before waiting for the kernel before
  // them (cuda::set_weight_prefetch_bytes): same results. 0 by default: on an H100 a batch-1
  // step of Qwen3-30B-A3B took 4.70 ms with whole rows and 4.44 ms with none
  // (bench/RESULTS.md, 2026-12-07).
  int64_t weight_prefetch_bytes = 0;
  // Fold the RMSNorm before a projection into that projection's skinny GEMM (the input norm
  // into QKV, the post-attention norm into the router's or the dense MLP's product) where the
  // step takes the skinny GEMM: one launch less each, the same bits (cuda::SkinnyGemmParams::norm).
  bool fold_norms = true;
  // The tensor-core decode attention merges its splits in its last split block instead of a
  // combine launch (cuda::PagedDecodeParams::split_tickets; the same bits). Off: on an H100 a
  // batch-1 step of Qwen3-30B-A3B took 5.32 ms with it and 4.35 without (bench/RESULTS.md,
  // 2026-12-07, thirteenth session): one block merging every split serialises what the combine
  // kernel spreads over the grid.
  bool merge_attention_splits = false;
  // A step of one token runs the grouped skinny experts one row a block
  // (cuda::GroupedGemmParams::one_row_per_expert; the same bits, 59 registers instead of 96, one
  // wave): 4.13 against 4.35 ms a batch-1 step on an H100 (bench/RESULTS.md, 2026-12-07,
  // thirteenth session).
  bool one_row_expert_blocks = true;
  // A decode step of one token runs its runs of plain GQA + MoE layers in the persistent
  // decode-layers kernel (backend/cuda/decode_layers.h: one launch for the run, grid barriers
  // between the stages) instead of a dozen launches a layer; not while profiling (the stages
  // are one kernel). Off: on an H100 a batch-1 step of Qwen3-30B-A3B took 4.07 ms with it and
  // 4.08 and 4.11 without, level (bench/RESULTS.md, 2026-12-07, fifteenth session).
  bool persistent_layers = false;
  bool quiet = false;                // no progress bar or load summary on stderr
  int64_t kv_cache_bytes = 0;        // > 0: the KV pool takes at most this (0: all that is left)
  // How the device pool stores KV rows (--kv-dtype): bf16, or fp8 (e4m3 with a float32 scale
  // per token and KV head, the CPU pool's format, kv/kv_format.h), which holds about twice the
  // tokens in the same bytes. f32 is refused (gpu_kv_unsupported), as is fp8 where a kernel
  // that reads the cache has no fp8 path yet.
  KvDType kv_dtype = KvDType::kBF16;
  // Batch-invariant kernels (--deterministic): a token's logits do not depend on the step's row
  // count, the other sequences, chunking or recompute. Every product runs the fixed-order
  // dense GEMM (backend/cuda/dense_gemm.h) instead of cuBLAS, every attention row (prefill
  // rows too) the paged decode kernel with splits of a length fixed at start-up
  // (cuda::batch_invariant_chunk), combined in one order.
  bool deterministic = false;
  // MoE layers whose step has at most this many rows (T*K) run the small-batch path
  // (backend/cuda/small_batch_moe.h); 0: never; -1: the decoder's own threshold.
  int64_t small_batch_moe_rows = -1;
  // Dense projections (QKV, O, routers, shared experts; not the LM head) of steps with at most
  // this many rows (<= cuda::kSkinnyGemmMaxRows) run the skinny GEMM (backend/cuda/skinny_gemm.h:
  // a weight-streaming matrix-vector kernel that launches as a programmatic dependent) instead
  // of cuBLAS; 0: always cuBLAS; -1: kDefaultSkinnyGemmRows. Not under `deterministic`, which
  // keeps the fixed-order dense GEMM. Dense Linears held quantised (--weights-scope linear, a
  // quantised checkpoint's dense matrices) take the quantised skinny GEMM, 8 rows a launch, up
  // to 16 (fp8) or 32 (int4) rows whenever this is not 0 (their other path dequantises the
  // matrix into a bf16 scratch first).
  int64_t skinny_gemm_rows = -1;
  // MoE layers whose step has at most this many tokens run their route and plan stages in one
  // launch (backend/cuda/route_plan.h: router product, top-k and plan); 0: never; -1: the
  // decoder's own threshold. Not under `deterministic` nor with two weight terms.
  int64_t fused_route_tokens = -1;
  // Routed fp8 experts with scale blocks of 128 inputs (DeepSeek-V3's and Qwen3-FP8's layout,
  // --weights fp8) on a GPU of compute capability 8.9 or later: MoE steps with enough rows per
  // expert (prefill, large batches: cuda::fp8_tensor_core_experts) run fp8 x fp8 on tensor
  // cores, their activations quantised to e4m3 per (row, 128 inputs). false: always weight-only
  // (activations stay bf16). Off under `deterministic` and with `offload`.
  bool fp8_tensor_cores = true;
  // --expert-budget / --expert-cache: routed experts live in pinned host memory and a device
  // cache of slots holds what the budget allows (disabled: every expert resident).
  offload::OffloadOptions offload;
  // --router-temperature, --active-experts / --renorm, --drop-below in every MoE layer's route
  // stage (--expert-capacity is refused on cuda: check_routing_device).
  moe::RoutingApproximation routing;
  // --ep N (model/cuda/expert_parallel.h): the MoE layers' rows travel to the ranks of this
  // communicator (it must outlive the decoder) and back, device to device over ep_transport
  // (the counts over this communicator); null: every expert runs here. Each rank keeps every
  // expert's weights on its GPU for now and computes only those the placement gives it. Under it
  // the steps run without CUDA graphs and without the small-batch MoE path (the dispatch waits for
  // the device and exchanges with the other ranks); refused with `offload` (--expert-budget).
  parallel::Communicator* expert_parallel = nullptr;
  std::optional<parallel::ExpertPlacement> placement;  // with expert_parallel; none: contiguous
  EpTransport ep_transport = EpTransport::kAuto;       // with expert_parallel: how rows travel
  // --micro-batches 2 (with expert_parallel only): each step's sequences split in two halves, A
  // the first (the larger when odd) and B the rest, either possibly empty, each with a stream,
  // a workspace and an MoE block of its own. Per MoE layer every rank issues A's dispatch, B's
  // dispatch, A's combine and B's combine in that order. With overlap_micro_batches (--overlap
  // on) the host enqueues B's attention and routing before it waits for A's offsets and rows,
  // so one micro-batch computes while the other's rows travel; off runs A's whole step, then
  // B's (the same split, serially). The workspace is allocated twice.
  int micro_batches = 1;
  bool overlap_micro_batches = true;
  // k, the ranks of an --ep job that run on this GPU, this one included. With k > 1 the
  // decoder's budget is gpu_memory_fraction / k of the card, and only what the decoder allocates
  // itself (weights, workspace, recurrent state, KV pool) counts against it, not what is in use
  // on the device: the other ranks build at the same time, each within its own share (its CUDA
  // context and the dispatcher's staging buffers, grown on first use, sit outside it). With 1,
  // the whole fraction, and everything in use on the device counts (other processes, the CUDA
  // context). Either way the KV pool also leaves 256 MiB of the device free.
  int ranks_on_device = 1;
};

// How a synthetic model's routers choose (`--routing-skew`).
struct RoutingSkew {
  enum class Kind {
    kNone,  // the random router weights' own choice (consecutive tokens often share experts)
    // Each (token, layer) draws its top-k from a Zipf law of `exponent`: the expert of rank r
    // (ranks shuffled per layer) is drawn with probability proportional to (r + 1)^-exponent,
    // k of them without replacement, independent across tokens and steps. The router's logits
    // are replaced by Gumbel noise keyed as for kUniform plus a bias of -exponent * ln(r + 1).
    // The prefetch prediction runs the model's router with that bias: it predicts the popular
    // experts.
    kZipf,
    // Each (token, layer) picks a uniformly random top-k subset, independent across tokens,
    // layers and steps: the router's logits are replaced by hashed noise keyed by the token's KV
    // cache slot mixed with a count of the decoder's steps (cuda::RouterParams::noise_keys), so
    // neither the next step nor a sequence that reuses a slot repeats earlier picks. The expert
    // cache's prefetch prediction still runs the model's router, which then knows nothing of the
    // demand.
    kUniform,
  };
  Kind kind = Kind::kNone;
  double exponent = 0.0;  // kZipf: in (0, 10]
};

// Synthetic weights built on the device (`--model synthetic:NAME`).
struct SyntheticGpuOptions {
  uint64_t seed = 0;
  RoutingSkew routing;
  // --weights fp8|int4: the routed experts as random codes and scales of that format
  // (gpu::synthetic_weights); kCheckpoint: bf16 like every other matrix. Engine::load_synthetic
  // takes it from EngineConfig::expert_weights.
  WeightFormat expert_weights = WeightFormat::kCheckpoint;
  // --weights-scope linear (with expert_weights fp8|int4): every dense Linear (attention, MLA
  // but kv_b, Gated DeltaNet, shared experts, dense MLPs) as random codes of that format too.
  WeightScope weight_scope = WeightScope::kExperts;
};

struct GpuMemoryReport {
  std::string device_name;
  int64_t device_bytes = 0;     // the card's memory
  int64_t budget_bytes = 0;     // gpu_memory_fraction of it
  int64_t weight_bytes = 0;
  // The routed experts as the device holds them: "bf16", or the codes' format ("fp8", "int4",
  // "mxfp4"); one expert's gate_up and down in bytes (codes and scales when quantised, a bf16
  // expert's terms otherwise, padding included), and all resident ones (in weight_bytes; 0 with
  // offloaded experts, whose cache slots are counted there instead). 0 without routed experts.
  std::string expert_format = "bf16";
  // Whether MoE steps of at least cuda::kFp8MmaMinMeanRows rows per expert run fp8 x fp8 on
  // tensor cores (GpuOptions::fp8_tensor_cores; its workspace is in workspace_bytes).
  bool expert_fp8_tensor_cores = false;
  int64_t expert_bytes = 0;
  int64_t routed_expert_bytes = 0;
  // Dense Linears held quantised (--weights-scope linear, or a block-scaled fp8 / GPTQ / AWQ
  // checkpoint's dense matrices): their codes' format ("" when none), how many matrices, and
  // their bytes (codes and scales, in weight_bytes).
  std::string dense_format;
  int64_t dense_quant_matrices = 0;
  int64_t dense_quant_bytes = 0;
  int64_t dense_quant_values = 0;  // their N * K summed (what they would take in bf16 / 2)
  int64_t workspace_bytes = 0;  // activations, metadata, cuBLAS workspace
  // Layers a one-token decode step runs in the persistent decode-layers kernel
  // (GpuOptions::persistent_layers).
  int64_t persistent_layers = 0;
  std::string persistent_refusal;  // asked for but no layer runs there: why ("" otherwise)
  int64_t kv_bytes = 0;
  int64_t kv_bytes_per_token = 0;
  int64_t num_kv_blocks = 0;
  int64_t block_size = 0;
  // The recurrent state of linear-attention layers (Qwen3-Next's Gated DeltaNet): a fixed slot
  // per sequence (GpuOptions::max_num_seqs of them), taken before the KV pool; 0 without.
  int64_t state_bytes = 0;
  int64_t state_bytes_per_slot = 0;
  int64_t num_state_slots = 0;
  // Offloaded experts: their pinned host home, and the device cache (included in weight_bytes).
  int64_t expert_home_bytes = 0;
  int64_t expert_cache_bytes = 0;
  int64_t expert_cache_slots = 0;
  // --cold-experts cpu|auto: an expert's compute on the host, measured at start-up (its weights
  // read once, then each row), the rate the host's share of a step is bounded by; 0 otherwise.
  int64_t expert_host_ns = 0;
  int64_t expert_host_row_ns = 0;
  double load_seconds = 0.0;    // weight upload (0 for synthetic)
  double load_gb_per_s = 0.0;
};

// Per-row sampling parameters for forward_sample (the GPU sampler's subset: no penalties).
struct GpuSamplingRow {
  float temperature = 0.0f;  // <= 0: greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  uint64_t step = 0;  // tokens this request sampled before
};

// What the GPU decoder lacks to compute a config's model, or nullopt when it computes it (every
// family moeinfer loads, Qwen3-Next's Gated DeltaNet layers included, runs now).
std::optional<std::string> gpu_unsupported(const ModelConfig& config);
// Throws with that reason (both create functions call it first, before any device work).
void check_gpu_support(const ModelConfig& config);

// What the GPU's expert cache (--expert-budget) lacks to offload this config's experts, or
// nullopt: GPT-OSS's expert biases and clamped SwiGLU are not carried by its host compute yet,
// and models with a recurrent state (Qwen3-Next) have not been held to the CPU with it.
// Needs no device.
std::optional<std::string> gpu_offload_unsupported(const ModelConfig& config);
// Throws with that reason when `offload` is enabled (the create functions call it).
void check_gpu_offload(const ModelConfig& config, const offload::OffloadOptions& offload);

// What the GPU decoder lacks to keep this config's KV cache at `dtype`, or nullopt: f32 rows
// (the device pool holds bf16 or fp8), and fp8 for heads wider than 256 (their kernel reads
// bf16 rows only). Needs no device.
std::optional<std::string> gpu_kv_unsupported(const ModelConfig& config, KvDType dtype);
// Throws with that reason (the create functions call it beside check_gpu_support).
void check_gpu_kv_dtype(const ModelConfig& config, KvDType dtype);
// Bytes of KV rows per token the GPU pool allocates at `dtype`, fp8's scales included:
// kv_bytes_per_token (model/model_facts.h, what `moeinfer plan` counts) of the config with its
// head dim padded to the decode kernels' `padded_head_dim`, so the two agree wherever the
// model's head dim needs no padding. MLA: the latent row of `mla_cache_width` values, padded
// (Lp + Rp), in bf16, or under fp8 as that many codes plus two float32 scales (latent, rope
// key); the planner counts L + R, so the two agree when L and R are multiples of 8.
int64_t gpu_kv_bytes_per_token(const ModelConfig& config, int64_t padded_head_dim,
                               int64_t mla_cache_width, KvDType dtype);

class GpuDecoder {
 public:
  // Uploads a bound checkpoint (the host Decoder's weight views).
  static std::unique_ptr<GpuDecoder> create(const ModelConfig& config,
                                            const DecoderWeights& weights,
                                            const GpuOptions& options);
  // Random weights of the config's exact shapes, built on the device.
  static std::unique_ptr<GpuDecoder> create_synthetic(const ModelConfig& config,
                                                      const GpuOptions& options,
                                                      const SyntheticGpuOptions& synthetic);
  virtual ~GpuDecoder() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const GpuMemoryReport& memory() const = 0;
  virtual int64_t num_kv_blocks() const = 0;
  virtual int64_t block_size() const = 0;
  virtual int64_t max_model_len() const = 0;
  // Sequences whose recurrent state the device holds at once (max_num_seqs), for a model with
  // linear-attention layers; 0 otherwise. SequenceBatch::state_slot names one of them, as on the
  // CPU (the engine's StateSlots hand them out).
  virtual int64_t num_state_slots() const = 0;

  // The contract of Decoder::forward(batch, pool, logits), with block ids naming blocks of the
  // device pool. logits: Decoder::num_logit_rows(batch) rows of V floats, copied to the host.
  virtual void forward(const ForwardBatch& batch, std::span<float> logits) = 0;
  // The same forward, then one token per logits row sampled on the device; only the tokens
  // travel back. Needs batch.all_positions false.
  virtual void forward_sample(const ForwardBatch& batch, std::span<const GpuSamplingRow> rows,
                              std::span<int32_t> tokens) = 0;
  // Rows each expert received in the last forward, [num_layers, E] (zeros for dense layers;
  // both micro-batches' under GpuOptions::micro_batches 2); waits for the device.
  virtual std::vector<int32_t> expert_counts() = 0;
  // The expert cache's cumulative counters, [num_layers, offload::kNumCacheCounters] (empty
  // without --expert-budget); waits for the device.
  virtual std::vector<int64_t> expert_cache_counters() = 0;
  // As Decoder::set_routing_observer: after each forward, the observer sees every MoE layer's
  // routing of the step's tokens (in batch order), copied back from the device. While set, the
  // router writes each layer's output to a buffer of its own (graphs of their own, the same
  // logits) and one copy per step brings them back; null turns it off.
  virtual void set_routing_observer(Decoder::RoutingObserver observer) = 0;
  // As Decoder::set_routing_approximation, from the next forward (GpuOptions::routing at
  // creation); the captured graphs are dropped when it changes. --expert-capacity is refused.
  virtual void set_routing_approximation(const moe::RoutingApproximation& approx) = 0;
  // What one graph-captured decode step launches: the nodes of the last decode graph captured,
  // by kind. Zeros before the first capture (every step so far eager, or --no-cuda-graphs).
  struct GraphCounts {
    int64_t kernels = 0;
    int64_t copies = 0;  // memcpy and memset nodes
    int64_t other = 0;   // events, host callbacks, child graphs
  };
  virtual GraphCounts decode_graph_counts() const = 0;
  // Starts (on) or stops (off) an external profiler's capture: cudaProfilerStart/Stop, which
  // `ncu --profile-from-start off` and `nsys --capture-range=cudaProfilerApi` wait for.
  virtual void set_profiler_capture(bool on) = 0;
  // Under GpuOptions::expert_parallel: bytes this rank's MoE layers have sent to the other ranks
  // (rows and outputs) since creation, indexed by profile::Link (same GPU, peer GPU, network);
  // empty otherwise.
  virtual std::vector<int64_t> expert_parallel_bytes() const { return {}; }
  // GpuOptions::expert_parallel: the ranks every forward exchanges with (so that every rank must
  // run one whenever another does, an empty batch included); null in one process.
  virtual const parallel::Communicator* expert_parallel() const { return nullptr; }
  // Steps per attention route (model/attention_route.h) since creation, counted on the host
  // (with two micro-batches, per micro-batch: each takes its own route).
  virtual AttentionRouteCounts attention_route_counts() const { return {}; }
};

// CUDA devices this process sees (0 without CUDA support or a device): --ep N on cuda puts rank
// r on device r % count.
int cuda_device_count();
// The device's UUID as 32 hex digits (what tells two ranks they share a GPU whatever
// CUDA_VISIBLE_DEVICES each sees); empty without CUDA support or that device.
std::string cuda_device_uuid(int device);

// The floors GPU figures are ratios to, measured now on the current device.
struct DeviceFloors {
  double copy_bytes_per_s = 0.0;  // device-to-device copy, read + write
  double gemm_flops = 0.0;        // cuBLAS bf16 GEMM at 8192^3
  double host_to_device_bytes_per_s = 0.0;  // pinned host to device copy (PCIe)
};
DeviceFloors measure_device_floors();

}  // namespace moeinfer
