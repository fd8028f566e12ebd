// The stage profiler: wall time of every stage of every layer on the CPU (steady clock), and per
// step the rows each expert of each layer received, the bytes of expert weights the step read,
// and cache hits and misses (filled by whoever owns a cache).
//
// It is off unless a Profiler is installed on the calling thread (ActiveProfiler). Off costs one
// thread-local pointer load and one well-predicted branch per scope: no clock read, no
// allocation, no write. A Scope reads the clock when it opens and closes and adds the difference
// to its stage in the profiler's current layer (set by LayerScope) or, outside any layer, to the
// step-level row (lm_head, sampling, scheduling).
//
// Stage times can be sampled: with ProfilerOptions::time_every = N only one step in N (the first,
// then every N-th begun) times its stages; the others count rows, bytes and cache hits only and
// their scopes cost what they cost when the profiler is off. On the GPU a timed step costs an
// event per stage, so sampling is what keeps the profiler within its overhead budget there.
//
// Usage, in the code that drives the steps:
//   profile::Profiler profiler(ProfilerOptions{.num_layers = L, .num_experts = E, ...});
//   profile::ActiveProfiler on(&profiler);
//   profiler.begin_step(num_tokens); ... forward, sample ...; profiler.end_step();
// and in the code being measured:
//   { MOE_PROFILE_SCOPE(profile::Stage::kPlan); plan(...); }
//
// The profiler is an observer installed per thread rather than an argument because the stages
// it times sit below interfaces (Decoder::forward, MoeBlock::forward) that have no business
// carrying it; only the thread that drives a forward pass records (parallel_for workers run
// inside the caller's scopes).
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "offload/cache_policy.h"

namespace moeinfer::profile {

// Stages in report order. The first kNumLayerStages happen inside a layer.
enum class Stage : int {
  kAttention,      // norms excluded: QKV projections, RoPE, KV write, attention, output proj.
  kRoute,          // router GEMM and top-k selection
  kPlan,           // counting sort of the assignments by expert
  kDispatch,       // gather of the rows into expert order (all-to-allv under EP)
  kExperts,        // grouped expert GEMMs
  kCombine,        // rows back to their source (a no-op on one device)
  kUnpermute,      // weighted sum of each token's K outputs (+ shared)
  kSharedExperts,  // the dense shared expert beside the routed ones, and its gate
  kDenseMlp,       // the MLP of a layer that has no experts
  kLmHead,         // final norm and the LM head GEMM
  kSample,         // picking the next tokens from the logits
  kSchedule,       // choosing the step's work and its KV blocks
};
inline constexpr int kNumStages = 12;

// Where bytes moved: within one device (weights and KV read by the kernels), between GPUs of a
// host, between host and device (step metadata up, logits or tokens down), over the network,
// and between ranks that share one GPU (expert parallelism's rows and outputs, --ep on cuda).
enum class Link : int { kOnDevice, kPeerGpu, kHostDevice, kNetwork, kSameGpu };
inline constexpr int kNumLinks = 5;
std::string_view link_name(Link link);
inline constexpr int kNumLayerStages = 9;

std::string_view stage_name(Stage stage);
inline bool is_layer_stage(Stage stage) { return static_cast<int>(stage) < kNumLayerStages; }

struct ProfilerOptions {
  int64_t num_layers = 0;   // L
  int64_t num_experts = 0;  // E (0 for a model without experts)
  // [L] bytes of one routed expert's weights in each layer (0 for a dense layer), for the bytes
  // of expert weights read per step: distinct experts touched x these bytes.
  std::vector<int64_t> expert_bytes;
  // Which rank holds each expert ([E], the same in every layer) for the rows-per-rank counter;
  // empty: one rank holds them all.
  std::vector<int32_t> expert_rank;
  // Stage times on one step in this many (1: every step); counters on every step.
  int64_t time_every = 1;
  // false: no step times its stages (a profiler kept only for its counters, such as the expert
  // cache's under offloading).
  bool time_stages = true;

  int64_t num_ranks() const;
  void validate() const;  // throws moeinfer::Error naming the bad field
};

// One step as the profiler saw it.
struct StepRecord {
  int64_t num_tokens = 0;  // rows run through the layers
  int64_t wall_ns = 0;     // begin_step .. end_step
  bool timed = true;       // its stages were timed (see ProfilerOptions::time_every)
  // [L + 1, kNumStages] time per stage; rows 0..L-1 are the layers, row L the step-level stages
  // that ran outside any layer.
  std::vector<int64_t> stage_ns;
  std::vector<int32_t> stage_calls;  // [L + 1, kNumStages] scopes closed, same layout
  std::vector<int32_t> expert_rows;  // [L, E] assignments each expert received
  std::vector<int64_t> rank_rows;    // [ranks] assignments each rank's experts received
  int64_t expert_bytes_read = 0;     // sum over layers of distinct experts x expert bytes
  int64_t cache_hits = 0;    // expert-cache demands found resident
  int64_t cache_misses = 0;  // ... not found (copied in, or read from host memory)
  int64_t link_bytes[kNumLinks] = {};  // by Link
  // The expert cache under offloading (record_expert_cache), per layer: the counts of
  // offload::CacheCounter [L, offload::kNumCacheCounters], expert bytes host to device [L] and
  // seconds waited for demand copies [L]. All zero without offloading.
  std::vector<int64_t> expert_cache;
  std::vector<int64_t> expert_cache_bytes;
  std::vector<double> expert_cache_stall_s;

  int64_t expert_cache_count(int64_t layer, offload::CacheCounter counter) const {
    return expert_cache[layer * offload::kNumCacheCounters + counter];
  }

  int64_t ns(int64_t row, Stage stage) const {
    return stage_ns[row * kNumStages + static_cast<int>(stage)];
  }
  int32_t calls(int64_t row, Stage stage) const {
    return stage_calls[row * kNumStages + static_cast<int>(stage)];
  }
};

class Profiler {
 public:
  explicit Profiler(ProfilerOptions options);

  const ProfilerOptions& options() const { return options_; }
  int64_t num_layers() const { return options_.num_layers; }
  int64_t num_experts() const { return options_.num_experts; }

  // Starts a step: clears the step's counters, decides whether its stages are timed and reads
  // the clock.
  void begin_step(int64_t num_tokens);
  // Whether the current step times its stages; scopes and the GPU's events skip them when not.
  bool timing() const { return current_.timed; }
  // Ends it: computes the bytes read and appends the step's record to steps().
  void end_step();
  const std::vector<StepRecord>& steps() const { return steps_; }
  void clear() { steps_.clear(); }

  // Adds `ns` to `stage` in the current layer (or the step-level row outside any layer); a
  // step that does not time its stages keeps none.
  void add_time(Stage stage, int64_t ns) {
    if (!current_.timed) return;
    const int64_t index = row_ * kNumStages + static_cast<int>(stage);
    current_.stage_ns[index] += ns;
    ++current_.stage_calls[index];
  }
  // Counts a layer's routing decisions: topk_ids [T, K] expert ids.
  void record_routing(int64_t layer, std::span<const int32_t> topk_ids);
  // Adds a layer's rows per expert as counted elsewhere (the GPU's plan): counts [E].
  void record_expert_counts(int64_t layer, std::span<const int32_t> counts);
  void add_link_bytes(Link link, int64_t bytes) { current_.link_bytes[static_cast<int>(link)] += bytes; }
  void count_cache(int64_t hits, int64_t misses) {
    current_.cache_hits += hits;
    current_.cache_misses += misses;
  }
  // The expert cache's work for one layer in this step (both decoders call it, possibly several
  // times per layer and step: the counts add): `counters` holds offload::kNumCacheCounters
  // deltas (by offload::CacheCounter), host_to_device_bytes the expert bytes copied or read
  // across (also added to Link::kHostDevice, so callers do not add them again), stall_seconds
  // the time compute waited for demand copies. Hits and misses (+ unplaced) also go to
  // cache_hits and cache_misses.
  void record_expert_cache(int64_t layer, std::span<const int64_t> counters,
                           int64_t host_to_device_bytes, double stall_seconds);

  // The layer the following scopes belong to; -1 for none.
  int64_t current_layer() const { return row_ == options_.num_layers ? -1 : row_; }
  void set_current_layer(int64_t layer);

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

 private:
  ProfilerOptions options_;
  StepRecord current_;
  int64_t row_;  // index into current_.stage_ns rows
  int64_t step_start_ns_ = 0;
  int64_t steps_begun_ = 0;  // not reset by clear(), so sampling holds across an engine's steps
  std::vector<StepRecord> steps_;
};

namespace detail {
// The profiler of this thread, or null. constinit: no TLS guard on the read.
inline constinit thread_local Profiler* t_active = nullptr;
}  // namespace detail

// The profiler installed on the calling thread, or null when profiling is off.
inline Profiler* active() { return detail::t_active; }

// Installs a profiler on the calling thread for the guard's lifetime (restoring the previous
// one after). Passing null turns profiling off within the guard.
class ActiveProfiler {
 public:
  explicit ActiveProfiler(Profiler* profiler) : previous_(detail::t_active) {
    detail::t_active = profiler;
  }
  ~ActiveProfiler() { detail::t_active = previous_; }
  ActiveProfiler(const ActiveProfiler&) = delete;
  ActiveProfiler& operator=(const ActiveProfiler&) = delete;

 private:
  Profiler* previous_;
};

// Times its own lifetime under `stage` (in steps that time their stages).
class Scope {
 public:
  explicit Scope(Stage stage) : profiler_(active()), stage_(stage) {
    if (profiler_ != nullptr) [[unlikely]] {
      if (profiler_->timing()) {
        start_ns_ = Profiler::now_ns();
      } else {
        profiler_ = nullptr;
      }
    }
  }
  ~Scope() {
    if (profiler_ != nullptr) [[unlikely]]
      profiler_->add_time(stage_, Profiler::now_ns() - start_ns_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Profiler* profiler_;
  Stage stage_;
  int64_t start_ns_ = 0;
};

// Marks the scopes inside it as belonging to `layer`.
class LayerScope {
 public:
  explicit LayerScope(int64_t layer) : profiler_(active()) {
    if (profiler_ != nullptr) [[unlikely]] {
      previous_ = profiler_->current_layer();
      profiler_->set_current_layer(layer);
    }
  }
  ~LayerScope() {
    if (profiler_ != nullptr) [[unlikely]]
      profiler_->set_current_layer(previous_);
  }
  LayerScope(const LayerScope&) = delete;
  LayerScope& operator=(const LayerScope&) = delete;

 private:
  Profiler* profiler_;
  int64_t previous_ = -1;
};

}  // namespace moeinfer::profile

#define MOE_PROFILE_CONCAT_(a, b) a##b
#define MOE_PROFILE_CONCAT(a, b) MOE_PROFILE_CONCAT_(a, b)
// Times the rest of the enclosing block under `stage`.
#define MOE_PROFILE_SCOPE(stage) \
  ::moeinfer::profile::Scope MOE_PROFILE_CONCAT(moe_profile_scope_, __LINE__)(stage)
// Attributes the scopes in the rest of the enclosing block to `layer`.
#define MOE_PROFILE_LAYER(layer) \
  ::moeinfer::profile::LayerScope MOE_PROFILE_CONCAT(moe_profile_layer_, __LINE__)(layer)
