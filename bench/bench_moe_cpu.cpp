// Question: how close does one CPU MoE layer (moe/moe_block.h, the six stages over cpu::linear)
// come to the memory bandwidth at the Qwen3-30B-A3B shape, at decode (T = 1), batched decode
// (T = 64: nearly every expert is read, about 4 rows each) and prefill (T = 512)?
//
// Shape: H = 2048, E = 128 experts, top-8 (softmax, renormalised), expert width I = 768, bf16
// weights (128 x 9.4 MiB = 1.2 GiB, far beyond the 32 MiB L3) and a bf16 router [E, H].
// Routing is random but realistic: hidden states share a common direction, so the router gives
// some experts more tokens than others (the load spread is printed); decode cycles through 64
// different tokens so that successive calls pick different experts, as successive tokens do.
//
// Bytes counted: the weights of every expert the call touches (3 x I x H x 2 bytes each) plus the
// router. FLOPs: 2 x (T x K) x 3 x H x I plus the router. Floors measured in the same run: STREAM
// triad (read + write bytes counted) and the peak vdpbf16ps rate. The last column is weight GB/s
// over triad GB/s; at T = 512 the layer is compute-bound and %peak is the column to read.
//
// Usage: bench_moe_cpu [--hugepages]   (expert weights in 2 MiB pages instead of 4 KiB ones)
// Threads: MOE_NUM_THREADS (engine and GEMM workers), OMP_NUM_THREADS (oneDNN).
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/cpu/gemm_internal.h"
#include "backend/cpu/gemm_parallel.h"
#include "backend/cpu/gemm_roofline.h"
#include "core/dtype.h"
#include "moe/moe_block.h"
#include "moe/stages.h"

namespace {

using namespace moeinfer;

constexpr int64_t kHidden = 2048;  // H
constexpr int64_t kExperts = 128;  // E
constexpr int64_t kTopK = 8;       // K
constexpr int64_t kWidth = 768;    // I

// Fills bf16 values uniform in [-scale, scale) quickly (1.2 GiB of them).
void fill_bf16(uint16_t* dst, size_t n, uint64_t seed, float scale) {
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const float u = static_cast<float>(s >> 40) / static_cast<float>(1ull << 24);  // [0, 1)
    dst[i] = f32_to_bf16((2.0f * u - 1.0f) * scale);
  }
}

// Expert weights in 4 KiB pages (as a checkpoint's memory map gives them) or, with
// --hugepages, in 2 MiB-aligned memory the kernel is asked to back with transparent huge pages.
struct WeightBuffer {
  uint16_t* ptr = nullptr;
  size_t count = 0;
  ~WeightBuffer() { std::free(ptr); }
  void allocate(size_t n, bool huge) {
    constexpr size_t kAlign = size_t{2} << 20;
    const size_t bytes = (n * sizeof(uint16_t) + kAlign - 1) / kAlign * kAlign;
    ptr = static_cast<uint16_t*>(std::aligned_alloc(huge ? kAlign : 4096, bytes));
    count = n;
    if (huge) madvise(ptr, bytes, MADV_HUGEPAGE);
  }
  uint16_t* data() { return ptr; }
  size_t size() const { return count; }
};

struct Layer {
  std::vector<uint16_t> router;  // [E, H]
  WeightBuffer weights;          // per expert: gate [I, H], up [I, H], down [H, I]
  moe::RoutedExperts views;
};

void build_layer(Layer* layer, const std::vector<float>& common, bool huge_pages) {
  const size_t per_matrix = static_cast<size_t>(kWidth * kHidden);
  layer->weights.allocate(per_matrix * 3 * kExperts, huge_pages);
  layer->router.resize(static_cast<size_t>(kExperts * kHidden));
  fill_bf16(layer->weights.data(), layer->weights.size(), 7, 0.03f);
  fill_bf16(layer->router.data(), layer->router.size(), 11, 0.05f);
  // Experts whose router row leans towards the common direction of the hidden states are
  // picked more often: the skew real routers show.
  std::mt19937 rng(5);
  std::normal_distribution<float> lean(0.0f, 0.0005f);  // logit spread about 0.5
  for (int64_t e = 0; e < kExperts; ++e) {
    const float a = lean(rng);
    for (int64_t h = 0; h < kHidden; ++h) {
      uint16_t& w = layer->router[e * kHidden + h];
      w = f32_to_bf16(bf16_to_f32(w) + a * common[h]);
    }
  }
  layer->views.router =
      TensorView{.dtype = DType::kBF16, .shape = {kExperts, kHidden}, .data = layer->router.data()};
  for (int64_t e = 0; e < kExperts; ++e) {
    const uint16_t* base = layer->weights.data() + e * 3 * per_matrix;
    layer->views.experts.push_back(moe::ExpertWeights{
        .gate = {.dtype = DType::kBF16, .shape = {kWidth, kHidden}, .data = base},
        .up = {.dtype = DType::kBF16, .shape = {kWidth, kHidden}, .data = base + per_matrix},
        .down = {
            .dtype = DType::kBF16, .shape = {kHidden, kWidth}, .data = base + 2 * per_matrix}});
  }
}

// The same layer with the experts stage written against gemm.h's grouped call: gate and up of
// every used expert in one parallel region, SiLU(gate) * up spread over the workers, then every
// down projection in a second region. The other stages are the engine's.
struct GroupedBuffers {
  std::vector<float> logits, rows, gate, up, expert_out;
  moe::Routing routing;
  moe::DispatchPlan plan;
  std::vector<cpu::LinearProblem> problems;
};

void grouped_forward(const float* hidden, int64_t num_tokens, const moe::RoutedExperts& layer,
                     const moe::MoeBlockOptions& options, float* out, GroupedBuffers* b) {
  const int64_t assignments = num_tokens * kTopK;
  b->logits.resize(static_cast<size_t>(num_tokens * kExperts));
  b->rows.resize(static_cast<size_t>(assignments * kHidden));
  b->gate.resize(static_cast<size_t>(assignments * kWidth));
  b->up.resize(b->gate.size());
  b->expert_out.resize(b->rows.size());
  cpu::linear(hidden, num_tokens, layer.router, nullptr, b->logits.data());
  moe::route(b->logits.data(), num_tokens, options.router, &b->routing);
  moe::plan(b->routing, kExperts, &b->plan);
  moe::dispatch(hidden, kHidden, b->routing, b->plan, b->rows.data());
  b->problems.clear();
  for (int64_t e = 0; e < kExperts; ++e) {
    const int64_t n = b->plan.expert_counts[e];
    if (n == 0) continue;
    const int64_t first = b->plan.expert_offsets[e];
    const float* x = b->rows.data() + first * kHidden;
    b->problems.push_back({.x = x,
                           .num_rows = n,
                           .weight = layer.experts[e].gate,
                           .y = b->gate.data() + first * kWidth});
    b->problems.push_back(
        {.x = x, .num_rows = n, .weight = layer.experts[e].up, .y = b->up.data() + first * kWidth});
  }
  cpu::linear_grouped(b->problems);
  float* gate = b->gate.data();
  const float* up = b->up.data();
  cpu::gemm_parallel_for(assignments * kWidth, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float g = gate[i];
      gate[i] = g / (1.0f + std::exp(-g)) * up[i];
    }
  });
  b->problems.clear();
  for (int64_t e = 0; e < kExperts; ++e) {
    const int64_t n = b->plan.expert_counts[e];
    if (n == 0) continue;
    const int64_t first = b->plan.expert_offsets[e];
    b->problems.push_back({.x = b->gate.data() + first * kWidth,
                           .num_rows = n,
                           .weight = layer.experts[e].down,
                           .y = b->expert_out.data() + first * kHidden});
  }
  cpu::linear_grouped(b->problems);
  moe::unpermute(b->expert_out.data(), kHidden, b->routing, b->plan, nullptr, out);
}

std::string anon_huge_pages() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return "?";
  char line[256];
  std::string out = "?";
  while (std::fgets(line, sizeof line, f) != nullptr) {
    if (std::strncmp(line, "AnonHugePages:", 14) == 0) {
      out = line + 14;
      out.erase(0, out.find_first_not_of(' '));
      out.erase(out.find_last_not_of("\n") + 1);
    }
  }
  std::fclose(f);
  return out;
}

struct Stats {
  double seconds = 0;
  double experts_touched = 0;  // mean over calls
  int max_rows = 0;            // most rows any expert got, over calls
};

}  // namespace

int main(int argc, char** argv) {
  const bool huge_pages = argc > 1 && std::strcmp(argv[1], "--hugepages") == 0;
  const int threads = cpu::gemm_num_threads();
  std::printf(
      "# bench_moe_cpu: Qwen3-30B-A3B MoE layer, H=%lld E=%lld top-%lld I=%lld, bf16, "
      "%d threads\n",
      static_cast<long long>(kHidden), static_cast<long long>(kExperts),
      static_cast<long long>(kTopK), static_cast<long long>(kWidth), threads);
  std::printf("# load average at start: %.2f (%d cores)\n", cpu::roofline::load_average(),
              static_cast<int>(std::thread::hardware_concurrency()));
  const auto bw = cpu::roofline::measure_bandwidth(threads);
  const auto peak = cpu::roofline::measure_peak_flops(threads);
  std::printf(
      "# memory: triad %.1f GB/s (read+write counted), read-only %.1f GB/s; "
      "peak bf16 %.0f GFLOP/s\n",
      bw.triad_gbs, bw.read_gbs, peak.bf16_gflops);

  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> common(kHidden);
  for (float& v : common) v = normal(rng);
  Layer layer;
  build_layer(&layer, common, huge_pages);
  if (huge_pages) {
    std::printf("# expert weights in transparent huge pages (madvise): AnonHugePages now %s\n",
                anon_huge_pages().c_str());
  }

  const moe::MoeBlockOptions options{
      .router = {.num_experts = kExperts, .top_k = kTopK, .renormalize = true},
      .hidden_size = kHidden,
      .expert_width = kWidth};
  const double expert_bytes = 3.0 * kWidth * kHidden * 2;
  const double router_bytes = static_cast<double>(kExperts * kHidden * 2);

  std::printf("%-5s %-22s %10s %8s %8s %8s %9s %6s %6s\n", "T", "variant", "us/call", "experts",
              "maxrows", "GB/s", "GFLOP/s", "%peak", "ratio");
  for (int64_t num_tokens : {int64_t{1}, int64_t{64}, int64_t{512}}) {
    // 64 batches of hidden states (decode) or 2 (prefill), each common direction + noise.
    const int num_batches = num_tokens == 1 ? 64 : num_tokens == 64 ? 8 : 2;
    std::vector<std::vector<float>> batches(num_batches);
    for (auto& batch : batches) {
      batch.resize(static_cast<size_t>(num_tokens * kHidden));
      for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t h = 0; h < kHidden; ++h)
          batch[t * kHidden + h] = 0.5f * common[h] + normal(rng);
    }
    std::vector<float> out(static_cast<size_t>(num_tokens * kHidden));
    moe::MoeBlock block = moe::single_layer_block(options, layer.views);

    GroupedBuffers grouped;
    for (int variant = 0; variant < 3; ++variant) {
      const bool fallback = variant == 1;
      const bool use_grouped = variant == 2;
      if (fallback && num_tokens > 1) continue;  // the blocked fallback at T=512 takes minutes
      cpu::gemm_detail::set_force_fallback(fallback);
      auto call = [&](int i) {
        if (use_grouped) {
          grouped_forward(batches[i % num_batches].data(), num_tokens, layer.views, options,
                          out.data(), &grouped);
        } else {
          block.forward(0, batches[i % num_batches].data(), num_tokens, layer.views.router,
                        nullptr, nullptr, out.data());
        }
      };
      const moe::DispatchPlan& used_plan = use_grouped ? grouped.plan : block.plan();
      call(0);
      call(1);
      Stats best{.seconds = 1e30};
      for (int rep = 0; rep < 3; ++rep) {
        Stats s;
        int calls = 0;
        double touched = 0;
        const double start = cpu::roofline::now_seconds();
        do {
          call(calls++);
          int used = 0;
          for (int32_t count : used_plan.expert_counts) {
            used += count > 0;
            s.max_rows = std::max<int>(s.max_rows, count);
          }
          touched += used;
        } while (cpu::roofline::now_seconds() - start < 0.5 || calls < 4);
        s.seconds = (cpu::roofline::now_seconds() - start) / calls;
        s.experts_touched = touched / calls;
        if (s.seconds < best.seconds) best = s;
      }
      const double bytes = best.experts_touched * expert_bytes + router_bytes;
      const double flops =
          2.0 * num_tokens * kTopK * 3 * kHidden * kWidth + 2.0 * num_tokens * kExperts * kHidden;
      const double gbs = bytes / best.seconds / 1e9;
      const double gflops = flops / best.seconds / 1e9;
      const std::string name = fallback      ? "moe_block (fallback)"
                               : use_grouped ? "grouped experts"
                                             : "MoeBlock::forward";
      std::printf("%-5lld %-22s %10.1f %8.1f %8d %8.1f %9.1f %5.1f%% %6.2f\n",
                  static_cast<long long>(num_tokens), name.c_str(), best.seconds * 1e6,
                  best.experts_touched, best.max_rows, gbs, gflops,
                  peak.bf16_gflops > 0 ? 100.0 * gflops / peak.bf16_gflops : 0.0,
                  gbs / bw.triad_gbs);
    }
    cpu::gemm_detail::set_force_fallback(false);
    {
      // The grouped variant must compute the same layer.
      std::vector<float> reference(out.size());
      block.forward(0, batches[0].data(), num_tokens, layer.views.router, nullptr, nullptr,
                    reference.data());
      grouped_forward(batches[0].data(), num_tokens, layer.views, options, out.data(), &grouped);
      double max_diff = 0, max_ref = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(out[i] - reference[i])));
        max_ref = std::max(max_ref, static_cast<double>(std::fabs(reference[i])));
      }
      std::printf("#   T=%lld grouped vs MoeBlock::forward: max |diff| %.3g of max |out| %.3g\n",
                  static_cast<long long>(num_tokens), max_diff, max_ref);
    }

    // Where the time goes: each stage timed on its own over the last batch.
    {
      const float* hidden = batches[0].data();
      std::vector<float> logits(static_cast<size_t>(num_tokens * kExperts));
      std::vector<float> rows(static_cast<size_t>(num_tokens * kTopK * kHidden));
      std::vector<float> expert_out(rows.size());
      moe::Routing routing;
      moe::DispatchPlan plan;
      double t_router = 1e30, t_route = 1e30, t_plan = 1e30, t_dispatch = 1e30, t_experts = 1e30,
             t_unpermute = 1e30;
      auto timed = [](double* best, auto&& fn) {
        const double start = cpu::roofline::now_seconds();
        fn();
        *best = std::min(*best, cpu::roofline::now_seconds() - start);
      };
      for (int rep = 0; rep < (num_tokens == 1 ? 50 : num_tokens == 64 ? 8 : 4); ++rep) {
        hidden = batches[rep % num_batches].data();
        timed(&t_router,
              [&] { cpu::linear(hidden, num_tokens, layer.views.router, nullptr, logits.data()); });
        timed(&t_route, [&] { moe::route(logits.data(), num_tokens, options.router, &routing); });
        timed(&t_plan, [&] { moe::plan(routing, kExperts, &plan); });
        timed(&t_dispatch, [&] { moe::dispatch(hidden, kHidden, routing, plan, rows.data()); });
        timed(&t_experts, [&] {
          moe::run_experts(rows.data(), kHidden, kWidth, plan.expert_offsets, layer.views.experts,
                           expert_out.data());
        });
        timed(&t_unpermute, [&] {
          moe::unpermute(expert_out.data(), kHidden, routing, plan, nullptr, out.data());
        });
      }
      std::printf(
          "#   T=%lld stages (best of runs, us): router %.1f, route %.1f, plan %.1f, "
          "dispatch %.1f, experts %.1f, unpermute %.1f\n",
          static_cast<long long>(num_tokens), t_router * 1e6, t_route * 1e6, t_plan * 1e6,
          t_dispatch * 1e6, t_experts * 1e6, t_unpermute * 1e6);
    }
  }
  std::printf("# load average at end: %.2f\n", cpu::roofline::load_average());
  return 0;
}
