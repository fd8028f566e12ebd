#include "moe/cached_experts.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "profile/profiler.h"

namespace moeinfer::moe {
namespace {

constexpr size_t kSlotAlign = 64;  // each tensor of a slot starts on a cache line

size_t round_up(size_t n) { return (n + kSlotAlign - 1) / kSlotAlign * kSlotAlign; }

bool same_layout(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape;
}

}  // namespace

void CachedExperts::SlotFree::operator()(std::byte* p) const { std::free(p); }

CachedExperts::CachedExperts(std::vector<std::span<const ExpertWeights>> experts,
                             std::vector<LayerRouter> routers, const CachedExpertsOptions& options)
    : experts_(std::move(experts)),
      routers_(std::move(routers)),
      options_(options),
      cache_(static_cast<int64_t>(experts_.size()), options.router.num_experts, options.num_slots,
             options.policy) {
  const int64_t L = static_cast<int64_t>(experts_.size());
  const int64_t E = options_.router.num_experts;
  MOE_CHECK(static_cast<int64_t>(routers_.size()) == L, "cached experts: ", routers_.size(),
            " routers for ", L, " layers");
  MOE_CHECK(options_.router.selection_bias == nullptr,
            "cached experts: the selection bias comes per layer (LayerRouter), not in the options");
  const ExpertWeights* first = nullptr;
  for (int64_t l = 0; l < L; ++l) {
    if (experts_[l].empty()) continue;
    MOE_CHECK(static_cast<int64_t>(experts_[l].size()) == E, "cached experts: layer ", l, " has ",
              experts_[l].size(), " experts, the router ", E);
    MOE_CHECK(!routers_[l].weight.empty(), "cached experts: MoE layer ", l, " has no router");
    for (const ExpertWeights& w : experts_[l]) {
      if (first == nullptr) first = &w;
      MOE_CHECK(same_layout(w.gate, first->gate) && same_layout(w.up, first->up) &&
                    same_layout(w.down, first->down),
                "cached experts: an expert of layer ", l,
                " differs in shape or dtype from the first; slots hold one layout");
    }
  }
  MOE_CHECK(first != nullptr, "cached experts: the model has no routed experts");
  expert_bytes_ = expert_nbytes(*first);
  up_offset_ = round_up(first->gate.nbytes());
  down_offset_ = up_offset_ + round_up(first->up.nbytes());
  slot_stride_ = down_offset_ + round_up(first->down.nbytes());
  const int64_t S = cache_.num_slots();
  if (S > 0) {
    void* memory = std::aligned_alloc(kSlotAlign, slot_stride_ * static_cast<size_t>(S));
    MOE_CHECK(memory != nullptr, "cached experts: cannot allocate ", S, " slots of ", slot_stride_,
              " bytes");
    slots_.reset(static_cast<std::byte*>(memory));
  }
  slot_views_.resize(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    std::byte* base = slots_.get() + static_cast<size_t>(s) * slot_stride_;
    ExpertWeights& v = slot_views_[s];
    v = *first;
    v.gate.data = base;
    v.up.data = base + up_offset_;
    v.down.data = base + down_offset_;
  }
  bytes_.assign(static_cast<size_t>(L), 0);
  stall_.assign(static_cast<size_t>(L), 0.0);
  rows_.resize(static_cast<size_t>(E));
  pending_rows_.resize(static_cast<size_t>(E));
  if (!options_.held.empty()) {
    MOE_CHECK(static_cast<int64_t>(options_.held.size()) == L, "cached experts: held experts of ",
              options_.held.size(), " layers for ", L);
    for (int64_t l = 0; l < L; ++l) {
      MOE_CHECK(experts_[l].empty() || static_cast<int64_t>(options_.held[l].size()) == E,
                "cached experts: layer ", l, " holds ", options_.held[l].size(), " flags for ", E,
                " experts");
    }
  }
  copies_.resize(static_cast<size_t>(E));
  on_cpu_.resize(static_cast<size_t>(E));
  views_.resize(static_cast<size_t>(E));
}

void CachedExperts::warm(std::span<const int32_t> ranking, int64_t num_hot) {
  if (options_.policy == offload::CachePolicy::kStatic) cache_.set_hot_set(ranking, num_hot);
  const int64_t E = options_.router.num_experts;
  for (int32_t g : ranking) {
    MOE_CHECK(g >= 0 && g < cache_.num_layers() * E && !experts_[g / E].empty(),
              "cached experts: warm-up expert ", g, " is not a routed expert of an MoE layer");
  }
  for (const offload::SlotCopy& c : cache_.warm(ranking)) copy_to_slot(c);
}

void CachedExperts::copy_to_slot(const offload::SlotCopy& c) {
  const int64_t E = options_.router.num_experts;
  const ExpertWeights& home = experts_[c.expert / E][c.expert % E];
  const ExpertWeights& slot = slot_views_[c.slot];
  std::memcpy(const_cast<void*>(slot.gate.data), home.gate.data, home.gate.nbytes());
  std::memcpy(const_cast<void*>(slot.up.data), home.up.data, home.up.nbytes());
  std::memcpy(const_cast<void*>(slot.down.data), home.down.data, home.down.nbytes());
}

void CachedExperts::admit(const offload::Admission& a, LayerStep& step) {
  constexpr int64_t C = offload::kNumCacheCounters;
  const std::span<const int64_t> all = cache_.all_counters();
  counters_before_.assign(all.begin(), all.end());
  const int64_t n = cache_.admit(a, rows_.data(), options_.cold, copies_, on_cpu_).num_copies;
  const auto copy_start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) copy_to_slot(copies_[i]);
  if (!a.prefetch) {
    step.stall +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
  }
  // The admission's own layer goes into `step`; an eviction of another layer's unused prefetch
  // counts in that layer, reported here.
  for (int64_t l = 0; l < cache_.num_layers(); ++l) {
    LayerStep other;
    LayerStep& into = l == a.layer ? step : other;
    bool changed = false;
    for (int64_t k = 0; k < C; ++k) {
      const int64_t delta = all[l * C + k] - counters_before_[l * C + k];
      into.counters[k] += delta;
      changed = changed || delta != 0;
    }
    if (l != a.layer && changed) report(l, other);
  }
  // Every copy crosses once; an unplaced expert's weights are read from home by its rows.
  const int64_t unplaced = all[a.layer * C + offload::kCacheUnplaced] -
                           counters_before_[a.layer * C + offload::kCacheUnplaced];
  step.bytes += (n + unplaced) * expert_bytes_;
}

void CachedExperts::predict(int64_t layer, const RoutedTokens& tokens) {
  const int64_t T = tokens.num_tokens;
  const int64_t E = options_.router.num_experts;
  RouterOptions router = options_.router;
  router.selection_bias = routers_[layer].selection_bias;
  logits_.resize(static_cast<size_t>(T * E));
  cpu::linear(tokens.hidden, T, routers_[layer].weight, routers_[layer].logit_bias, logits_.data());
  route(logits_.data(), T, router, &predicted_);
  std::fill(rows_.begin(), rows_.end(), 0);
  for (int32_t e : predicted_.topk_ids) rows_[e] += 1;
}

int64_t CachedExperts::admit_demand(int64_t layer) {
  const int64_t tick = cache_.next_tick();
  LayerStep demand;
  admit({.layer = layer,
         .num_experts = options_.router.num_experts,
         .tick = tick,
         .protect_from = tick},
        demand);
  bytes_[layer] += demand.bytes;
  stall_[layer] += demand.stall;
  report(layer, demand);
  return tick;
}

bool CachedExperts::prefetches(int64_t next, int64_t tick, int64_t num_tokens) const {
  // Under kCpu no miss is ever copied, so a prefetch would only move bytes nobody reads.
  if (options_.prefetch == offload::PrefetchMode::kOff ||
      options_.cold.mode == offload::ColdExperts::kCpu || next >= cache_.num_layers() ||
      experts_[next].empty() || num_tokens == 0)
    return false;
  return options_.prefetch != offload::PrefetchMode::kAuto ||
         offload::prefetch_pays(cache_.counters(next).data(), tick);
}

void CachedExperts::admit_prefetch(int64_t next, int64_t tick) {
  LayerStep prefetch;
  admit({.layer = next,
         .num_experts = options_.router.num_experts,
         .tick = cache_.next_tick(),
         .protect_from = tick,
         .prefetch = true},
        prefetch);
  bytes_[next] += prefetch.bytes;
  report(next, prefetch);
}

void CachedExperts::on_routed(int64_t layer, const RoutedTokens& tokens) {
  const int64_t L = cache_.num_layers();
  const int64_t E = options_.router.num_experts;
  MOE_CHECK(layer >= 0 && layer < L && !experts_[layer].empty(), "cached experts: layer ", layer,
            " is not an MoE layer of the ", L);
  const int64_t next = layer + 1;
  if (!options_.held.empty()) {
    // Expert parallel: the demand arrives with run()'s rows. Predict the next layer's held
    // experts from this rank's tokens now, while their hidden rows are at hand. Whether it pays
    // is asked at the tick run()'s demand will take.
    pending_next_ = -1;
    if (!prefetches(next, cache_.tick() + 1, tokens.num_tokens)) return;
    predict(next, tokens);
    for (int64_t e = 0; e < E; ++e) {
      pending_rows_[e] = options_.held[next][e] != 0 ? rows_[e] : 0;
    }
    pending_next_ = next;
    return;
  }
  std::fill(rows_.begin(), rows_.end(), 0);
  for (int32_t e : tokens.routing->topk_ids) {
    if (e == kNoExpert) continue;  // dropped by a routing approximation: no row to compute
    MOE_CHECK(e >= 0 && e < E, "cached experts: expert id ", e, " outside [0, ", E, ")");
    rows_[e] += 1;
  }
  const int64_t tick = admit_demand(layer);
  if (!prefetches(next, tick, tokens.num_tokens)) return;
  predict(next, tokens);
  admit_prefetch(next, tick);
}

void CachedExperts::report(int64_t layer, const LayerStep& step) {
  if (profile::Profiler* p = profile::active()) {
    p->record_expert_cache(layer, step.counters, step.bytes, step.stall);
  }
}

void CachedExperts::run(int64_t layer, const ExpertRows& rows, float* out) {
  const int64_t E = options_.router.num_experts;
  MOE_CHECK(layer >= 0 && layer < cache_.num_layers() && !experts_[layer].empty(),
            "cached experts: layer ", layer, " is not an MoE layer");
  const int64_t count = rows.num_experts();
  MOE_CHECK(count >= 0 && count <= E, count, " experts' rows for layer ", layer, "'s ", E);
  if (!options_.held.empty()) {
    // Expert parallel: the rows every rank sent here are this layer's demand.
    std::fill(rows_.begin(), rows_.end(), 0);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t e = rows.expert(i);
      MOE_CHECK(e >= 0 && e < E && options_.held[layer][e] != 0, "expert ", e, " of layer ", layer,
                " is not held by this rank");
      rows_[e] += rows.expert_offsets[i + 1] - rows.expert_offsets[i];
    }
    const int64_t tick = admit_demand(layer);
    if (pending_next_ == layer + 1) {
      std::copy(pending_rows_.begin(), pending_rows_.end(), rows_.begin());
      admit_prefetch(pending_next_, tick);
    }
    pending_next_ = -1;
  }
  for (int64_t i = 0; i < count; ++i) {
    const int64_t e = rows.expert(i);
    MOE_CHECK(e >= 0 && e < E, "expert ", e, " outside layer ", layer, "'s ", E);
    const int32_t slot = cache_.slot_of(static_cast<int32_t>(layer * E + e));
    const ExpertWeights& home = experts_[layer][e];
    views_[i] = home;
    if (slot >= 0) {  // the matrices from the slot; the biases stay at home (expert_nbytes)
      views_[i].gate = slot_views_[slot].gate;
      views_[i].up = slot_views_[slot].up;
      views_[i].down = slot_views_[slot].down;
    }
  }
  run_experts(rows.rows, options_.hidden_size, options_.expert_width, rows.expert_offsets,
              std::span<const ExpertWeights>(views_.data(), static_cast<size_t>(count)), out,
              options_.activation);
}

HostExpertRate measure_host_expert_rate(std::span<const ExpertWeights> experts, int64_t hidden_size,
                                        int64_t expert_width) {
  MOE_CHECK(!experts.empty(), "measure_host_expert_rate: no experts to time");
  constexpr int64_t kRows = 8;
  constexpr int kRepeats = 3;
  std::vector<float> rows(static_cast<size_t>(kRows * hidden_size), 0.5f);
  std::vector<float> out(rows.size());
  size_t next = 0;
  // Each timed run takes the next expert, so that with enough of them no run finds its weights
  // in the host's caches: a cold expert comes from memory, and timing one expert again and again
  // would price every miss at cache speed.
  const auto best_ns = [&](int64_t n) {
    const std::vector<int32_t> offsets = {0, static_cast<int32_t>(n)};
    int64_t best = INT64_MAX;
    for (int r = 0; r < kRepeats; ++r) {
      const ExpertWeights& expert = experts[next++ % experts.size()];
      const auto start = std::chrono::steady_clock::now();
      run_experts(rows.data(), hidden_size, expert_width, offsets,
                  std::span<const ExpertWeights>(&expert, 1), out.data());
      best = std::min<int64_t>(best, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now() - start)
                                         .count());
    }
    return best;
  };
  const int64_t one = best_ns(1), many = best_ns(kRows);
  return {.first_row_ns = one, .row_ns = std::max<int64_t>(0, (many - one) / (kRows - 1))};
}

std::vector<ExpertWeights> experts_to_time(std::span<const std::span<const ExpertWeights>> layers) {
  constexpr size_t kWanted = 6;  // two timings of three runs each, each on its own expert
  std::vector<ExpertWeights> picked;
  for (size_t e = 0; picked.size() < kWanted; ++e) {
    const size_t before = picked.size();
    for (auto layer = layers.rbegin(); layer != layers.rend() && picked.size() < kWanted; ++layer) {
      if (e < layer->size()) picked.push_back((*layer)[e]);
    }
    if (picked.size() == before) break;  // every layer's experts taken
  }
  return picked;
}

offload::ColdCost simulated_cold_cost(offload::ColdExperts mode,
                                      std::span<const ExpertWeights> experts, int64_t hidden_size,
                                      int64_t expert_width) {
  if (mode != offload::ColdExperts::kAuto) return {.mode = mode};
  const HostExpertRate host = measure_host_expert_rate(experts, hidden_size, expert_width);
  const ExpertWeights& expert = experts.front();
  std::vector<std::byte> slot(static_cast<size_t>(expert_nbytes(expert)));
  int64_t copy_ns = INT64_MAX;
  for (int r = 0; r < 3; ++r) {
    const auto start = std::chrono::steady_clock::now();
    std::byte* at = slot.data();
    for (const TensorView* t : {&expert.gate, &expert.up, &expert.down}) {
      std::memcpy(at, t->data, t->nbytes());
      at += t->nbytes();
    }
    copy_ns = std::min<int64_t>(copy_ns, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::steady_clock::now() - start)
                                             .count());
  }
  return {.mode = mode,
          .copy_ns = copy_ns,
          .host_ns = std::max<int64_t>(0, host.first_row_ns - host.row_ns),
          .host_row_ns = host.row_ns};
}

}  // namespace moeinfer::moe
