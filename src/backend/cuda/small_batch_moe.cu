// Launcher of the small-batch MoE layer (small_batch_moe_kernel.cuh): checks the sizes, carves
// the workspace for this step's T, and launches the route/plan kernel (the instantiation whose
// per-lane logits cover E, plain or general routing as fused_router chooses) and the persistent
// experts kernel (the instantiation for the routed experts' format).
#include <algorithm>
#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_info.h"
#include "backend/cuda/launch_checks.h"
#include "backend/cuda/small_batch_moe.h"
#include "backend/cuda/small_batch_moe_kernel.cuh"

namespace moeinfer::cuda {
namespace {

struct Sizes {
  int64_t tokens, experts, top_k, hidden, width, shared_width;
  int64_t slots() const { return std::min(experts, tokens * top_k) + 1; }
  int64_t rows() const { return tokens * top_k + (shared_width > 0 ? tokens : 0); }
  int64_t act_stride() const { return std::max(width, shared_width); }
};

// Carves the workspace for these sizes; with base null, only measures it.
struct Carver {
  char* base;
  int64_t used = 0;
  template <typename T>
  T* take(int64_t count) {
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (count * static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16;
    return p;
  }
};

SmallMoeWorkspace carve(const Sizes& s, void* base, int64_t* bytes) {
  Carver c{static_cast<char*>(base)};
  SmallMoeWorkspace ws;
  ws.counters = c.take<int32_t>(kNumCounters);
  ws.slot_expert = c.take<int32_t>(s.slots());
  ws.slot_row_begin = c.take<int32_t>(s.slots());
  ws.slot_rows = c.take<int32_t>(s.slots());
  ws.gate_up_done = c.take<int32_t>(s.slots());
  ws.row_token = c.take<int32_t>(s.rows());
  ws.row_pick = c.take<int32_t>(s.rows());
  ws.row_weight = c.take<float>(s.rows());
  ws.arrivals = c.take<int32_t>(s.tokens * (s.hidden / kSmallMoeDownColumns));
  ws.gate_logits = c.take<float>(s.tokens);
  ws.act = c.take<float>(s.rows() * s.act_stride());
  ws.contrib = c.take<float>(s.tokens * (s.top_k + 1) * s.hidden);
  if (bytes) *bytes = c.used;
  return ws;
}

template <int kPerLane, bool kGeneral>
void launch_route_plan(const SmallMoeKernelParams& k, cudaStream_t stream) {
  const size_t scratch = kGeneral ? kSmallMoeWarps * sizeof(RouterWarpScratch<kPerLane>) : 0;
  static const bool configured = [&] {
    CUDA_CHECK(cudaFuncSetAttribute(small_moe_route_plan_kernel<kPerLane, kGeneral>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(scratch)));
    return true;
  }();
  (void)configured;
  const unsigned blocks =
      static_cast<unsigned>((k.router_rows + kSmallMoeWarps - 1) / kSmallMoeWarps);
  small_moe_route_plan_kernel<kPerLane, kGeneral><<<blocks, kSmallMoeThreads, scratch, stream>>>(k);
  MOE_CUDA_CHECK_LAUNCH();
}

template <bool kGeneral>
void launch_route_plan_for(const SmallMoeKernelParams& k, cudaStream_t stream) {
  with_router_lanes(k.num_experts, [&](auto per_lane) {
    launch_route_plan<decltype(per_lane)::value, kGeneral>(k, stream);
  });
}

}  // namespace

bool small_moe_supports(int64_t num_tokens, int64_t num_experts, int64_t top_k, int64_t hidden_size,
                        int64_t expert_width, int64_t shared_width) {
  return num_tokens >= 0 && num_tokens <= kSmallMoeMaxTokens && top_k >= 1 &&
         top_k <= kRouterWarpMaxTopK && num_experts >= top_k &&
         num_experts <= kRouterWarpMaxExperts && num_tokens * top_k <= kSmallMoeMaxRows &&
         hidden_size > 0 && hidden_size % 64 == 0 && expert_width > 0 &&
         expert_width % kSmallMoeGateUpColumns == 0 && shared_width >= 0 &&
         shared_width % kSmallMoeGateUpColumns == 0;
}

bool small_moe_supports_quant(ExpertQuant quant, int64_t group, int64_t hidden_size,
                              int64_t expert_width) {
  // A lane's 16-byte vector of codes must lie inside one row of each matrix: Hp (gate_up's
  // inputs) and Ip (down's) multiples of the vector's inputs.
  auto rows_hold_vectors = [&](int64_t inputs_per_vector) {
    return hidden_size % inputs_per_vector == 0 && expert_width % inputs_per_vector == 0;
  };
  switch (quant) {
    case ExpertQuant::kNone:
      return true;
    case ExpertQuant::kFp8:
      return group > 0 && group % 8 == 0 && rows_hold_vectors(16);
    case ExpertQuant::kInt4:
      return group > 0 && group % 8 == 0 && rows_hold_vectors(32);
    case ExpertQuant::kMxfp4:
      return group == 32 && rows_hold_vectors(32);
  }
  return false;
}

int64_t small_moe_workspace_bytes(int64_t max_tokens, int64_t num_experts, int64_t top_k,
                                  int64_t hidden_size, int64_t expert_width, int64_t shared_width) {
  int64_t bytes = 0;
  carve({max_tokens, num_experts, top_k, hidden_size, expert_width, shared_width}, nullptr, &bytes);
  return bytes;
}

namespace {

template <ExpertQuant Q>
int64_t resident_blocks() {
  static const int64_t blocks = [] {
    int per_sm = 0;
    const int sms = current_multiprocessor_count();
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, small_moe_experts_kernel<Q>,
                                                             kSmallMoeThreads, 0));
    return static_cast<int64_t>(sms) * std::max(per_sm, 1);
  }();
  return blocks;
}

}  // namespace

int64_t small_moe_default_blocks(ExpertQuant quant) {
  switch (quant) {
    case ExpertQuant::kFp8:
      return resident_blocks<ExpertQuant::kFp8>();
    case ExpertQuant::kInt4:
      return resident_blocks<ExpertQuant::kInt4>();
    case ExpertQuant::kMxfp4:
      return resident_blocks<ExpertQuant::kMxfp4>();
    case ExpertQuant::kNone:
      break;
  }
  return resident_blocks<ExpertQuant::kNone>();
}

namespace {

// The checks of every launch, then the kernels' parameters for this T.
SmallMoeKernelParams kernel_params(const SmallMoeParams& params) {
  const RouterParams& route = params.route;
  const int64_t T = route.num_tokens, E = route.num_experts, K = route.top_k;
  const int64_t H = params.hidden_size, I = params.expert_width, Is = params.shared_width;
  detail::check_router_params(route);
  MOE_CHECK(small_moe_supports(T, E, K, H, I, Is), "the small-batch MoE path does not take T = ", T,
            ", E = ", E, ", K = ", K, ", hidden_size = ", H, ", expert_width = ", I,
            ", shared_width = ", Is, " (T <= ", kSmallMoeMaxTokens, ", T*K <= ", kSmallMoeMaxRows,
            ", E <= ", kRouterWarpMaxExperts, ", K <= ", kRouterWarpMaxTopK,
            ", hidden_size a multiple of 64, the widths multiples of 8)");
  MOE_CHECK(params.shared_gate == nullptr || Is > 0,
            "shared_gate is set but there is no shared expert (shared_width = 0)");
  MOE_CHECK(small_moe_supports_quant(params.quant, params.quant_group, H, I),
            "the small-batch MoE path does not read ", expert_quant_name(params.quant),
            " experts with quant_group = ", params.quant_group, ", hidden_size = ", H,
            ", expert_width = ", I,
            " (fp8: group a multiple of 8, both sizes multiples of 16; int4: group a multiple of "
            "8, both multiples of 32; mxfp4: group 32, both multiples of 32)");
  MOE_CHECK(params.experts_blocks >= 0, "experts_blocks = ", params.experts_blocks, " is negative");
  detail::check_pointer(route.logits, "route.logits");
  detail::check_pointer(route.topk_ids, "route.topk_ids");
  detail::check_pointer(route.topk_weights, "route.topk_weights");
  detail::check_pointer(params.out, "out");
  detail::check_pointer(params.workspace, "workspace");
  detail::check_aligned16(params.workspace, "workspace");
  detail::check_aligned16(params.out, "out");
  const struct {
    const void* pointer;
    const char* name;
  } matrices[] = {{params.hidden, "hidden"},
                  {params.router, "router"},
                  {params.gate_up, "gate_up"},
                  {params.down, "down"}};
  for (const auto& m : matrices) {
    detail::check_pointer(m.pointer, m.name);
    detail::check_aligned16(m.pointer, m.name);
  }
  if (Is > 0) {
    detail::check_pointer(params.shared_gate_up, "shared_gate_up");
    detail::check_pointer(params.shared_down, "shared_down");
    detail::check_aligned16(params.shared_gate_up, "shared_gate_up");
    detail::check_aligned16(params.shared_down, "shared_down");
  }
  if (params.shared_gate) detail::check_aligned16(params.shared_gate, "shared_gate");
  if (params.quant != ExpertQuant::kNone) {
    // Slabs start 256-byte aligned (expert_quant.h), as the grouped GEMM requires too.
    MOE_CHECK(reinterpret_cast<uintptr_t>(params.gate_up) % 256 == 0 &&
                  reinterpret_cast<uintptr_t>(params.down) % 256 == 0,
              "quantised gate_up and down must be 256-byte aligned");
  }

  SmallMoeKernelParams k;
  k.p = params;
  k.ws = carve({T, E, K, H, I, Is}, params.workspace, nullptr);
  k.num_tokens = static_cast<int>(T);
  k.num_experts = static_cast<int>(E);
  k.top_k = static_cast<int>(K);
  k.hidden = static_cast<int>(H);
  k.width = static_cast<int>(I);
  k.shared_width = static_cast<int>(Is);
  k.act_stride = static_cast<int>(std::max(I, Is));
  k.column_tiles = static_cast<int>(H / kSmallMoeDownColumns);
  k.router_rows = static_cast<int>(E + (params.shared_gate ? 1 : 0));
  k.gate_up_layout = quant_matrix_layout(params.quant, 2 * I, H, params.quant_group);
  k.down_layout = quant_matrix_layout(params.quant, H, I, params.quant_group);
  k.quant_group = static_cast<int>(params.quant_group);
  return k;
}

}  // namespace

void small_batch_moe_route_plan(const SmallMoeParams& params, cudaStream_t stream) {
  NvtxRange range("small_batch_moe_route_plan");
  if (params.route.num_tokens == 0) return;
  const SmallMoeKernelParams k = kernel_params(params);
  const RouterParams& route = params.route;
  const bool plain =
      route.selection_bias == nullptr && route.group_score == RouterGroupScore::kNone;
  if (plain) {
    launch_route_plan_for<false>(k, stream);
  } else {
    launch_route_plan_for<true>(k, stream);
  }
}

void small_batch_moe_experts(const SmallMoeParams& params, cudaStream_t stream) {
  NvtxRange range("small_batch_moe_experts");
  if (params.route.num_tokens == 0) return;
  const SmallMoeKernelParams k = kernel_params(params);
  const int64_t blocks =
      params.experts_blocks > 0 ? params.experts_blocks : small_moe_default_blocks(params.quant);
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (params.quant) {
    case ExpertQuant::kNone:
      small_moe_experts_kernel<ExpertQuant::kNone><<<grid, kSmallMoeThreads, 0, stream>>>(k);
      break;
    case ExpertQuant::kFp8:
      small_moe_experts_kernel<ExpertQuant::kFp8><<<grid, kSmallMoeThreads, 0, stream>>>(k);
      break;
    case ExpertQuant::kInt4:
      small_moe_experts_kernel<ExpertQuant::kInt4><<<grid, kSmallMoeThreads, 0, stream>>>(k);
      break;
    case ExpertQuant::kMxfp4:
      small_moe_experts_kernel<ExpertQuant::kMxfp4><<<grid, kSmallMoeThreads, 0, stream>>>(k);
      break;
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void small_batch_moe(const SmallMoeParams& params, cudaStream_t stream) {
  small_batch_moe_route_plan(params, stream);
  small_batch_moe_experts(params, stream);
}

}  // namespace moeinfer::cuda
