// Launcher of the persistent decode-layers kernel (decode_layers_kernel.cuh): the shapes' checks,
// the scratch's layout, and one cooperative launch of one block per SM, the instantiation whose
// per-lane router logits cover E.
#include <algorithm>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/decode_layers.h"
#include "backend/cuda/decode_layers_kernel.cuh"
#include "backend/cuda/device_info.h"
#include "backend/cuda/launch_checks.h"
#include "core/error.h"

namespace moeinfer::cuda {
namespace {

using persistent_layers::Scratch;

constexpr int64_t kScratchAlign = 256;

int64_t align_up(int64_t bytes) {
  return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

int64_t group_of(const DecodeLayersParams& p) {
  return p.num_kv_heads > 0 ? p.num_q_heads / p.num_kv_heads : 0;
}

// Splits of a KV head: a block each over the grid (one block per SM), at most what the merge
// takes.
int64_t max_splits(const DecodeLayersParams& p) {
  const int64_t per_head = current_multiprocessor_count() / std::max<int64_t>(1, p.num_kv_heads);
  return std::clamp<int64_t>(per_head, 1,
                             persistent_layers::kMergeSplitsPerLane * device::kWarpSize);
}

// The dynamic shared memory: the larger of the GEMVs' input (bf16) and the attention's tiles,
// which share its start. It stays small: the rest of the SM's 256 KiB is L1, which holds the
// weight loads in flight.
size_t shared_bytes(const DecodeLayersParams& p) {
  const int64_t inputs =
      std::max({p.hidden_size, p.num_q_heads * p.padded_head_dim, p.top_k * p.expert_width});
  const int64_t attention =
      persistent_layers::attention_shared_floats(group_of(p), p.padded_head_dim) * 4;
  return static_cast<size_t>((std::max(inputs * 2, attention) + 15) / 16 * 16);
}

// The scratch's pieces in order, each at a 256-byte boundary; with base null only the size.
Scratch carve(const DecodeLayersParams& p, char* base, int64_t* bytes) {
  const int64_t G = group_of(p), S = max_splits(p), Dp = p.padded_head_dim;
  int64_t at = 0;
  auto take = [&](int64_t size) {
    char* where = base ? base + at : nullptr;
    at += align_up(size);
    return where;
  };
  Scratch s;
  s.barrier = reinterpret_cast<unsigned*>(take(sizeof(unsigned)));
  s.tickets = reinterpret_cast<int32_t*>(take(p.num_kv_heads * sizeof(int32_t)));
  s.qkv = reinterpret_cast<__nv_bfloat16*>(take((p.num_q_heads + 2 * p.num_kv_heads) * Dp * 2));
  s.partial_stats = reinterpret_cast<float*>(take(p.num_kv_heads * S * G * 2 * sizeof(float)));
  s.partial_out = reinterpret_cast<float*>(take(p.num_kv_heads * S * G * Dp * sizeof(float)));
  s.attn = reinterpret_cast<__nv_bfloat16*>(take(p.num_q_heads * Dp * 2));
  s.logits = reinterpret_cast<float*>(take(p.num_experts * sizeof(float)));
  s.act = reinterpret_cast<__nv_bfloat16*>(take(p.top_k * p.expert_width * 2));
  s.max_splits = static_cast<int>(S);
  *bytes = at;
  return s;
}

int device_attribute(cudaDeviceAttr attribute) {
  int device = 0, value = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

template <int kPerLane>
const void* kernel_for() {
  return reinterpret_cast<const void*>(persistent_layers::decode_layers_kernel<kPerLane>);
}

const void* kernel_of(int64_t num_experts) {
  const void* kernel = nullptr;
  with_router_lanes(num_experts,
                    [&](auto per_lane) { kernel = kernel_for<decltype(per_lane)::value>(); });
  return kernel;
}

}  // namespace

int64_t decode_layers_scratch_bytes(const DecodeLayersParams& shapes) {
  int64_t bytes = 0;
  carve(shapes, nullptr, &bytes);
  return bytes;
}

namespace {

// The shapes the kernel takes, checked on the host alone, each refusal naming its value.
void check_shapes(const DecodeLayersParams& p) {
  const int64_t group = group_of(p);
  MOE_CHECK(p.num_kv_heads >= 1 && p.num_q_heads >= 1 && p.num_q_heads % p.num_kv_heads == 0,
            "decode_layers: num_q_heads = ", p.num_q_heads, " is not a positive multiple of ",
            "num_kv_heads = ", p.num_kv_heads);
  MOE_CHECK(group <= kDecodeLayersMaxGroup, "decode_layers: ", group,
            " query heads a KV head (num_q_heads / num_kv_heads), past ", kDecodeLayersMaxGroup);
  MOE_CHECK(p.padded_head_dim >= 8 && p.padded_head_dim <= kDecodeLayersMaxHeadDim &&
                p.padded_head_dim % 8 == 0 && p.head_dim >= 1 && p.head_dim <= p.padded_head_dim,
            "decode_layers: head_dim = ", p.head_dim, " padded to ", p.padded_head_dim,
            " (a multiple of 8 up to ", kDecodeLayersMaxHeadDim, ")");
  MOE_CHECK(p.rotary_dim >= 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
            "decode_layers: rotary_dim = ", p.rotary_dim, " (even, at most head_dim = ", p.head_dim,
            ")");
  MOE_CHECK(p.hidden_size > 0 && p.hidden_size % 8 == 0 && p.hidden_size <= kDecodeLayersMaxHidden,
            "decode_layers: hidden_size = ", p.hidden_size, " (a multiple of 8 up to ",
            kDecodeLayersMaxHidden, ")");
  MOE_CHECK(p.norm_width >= 1 && p.norm_width <= p.hidden_size,
            "decode_layers: norm_width = ", p.norm_width, " (1 to hidden_size = ", p.hidden_size,
            ")");
  MOE_CHECK(p.expert_width > 0 && p.expert_width % 8 == 0,
            "decode_layers: expert_width = ", p.expert_width, " (a positive multiple of 8)");
  MOE_CHECK(p.top_k >= 1 && p.top_k <= kRouterWarpMaxTopK && p.num_experts >= p.top_k &&
                p.num_experts <= kRouterWarpMaxExperts,
            "decode_layers: top_k = ", p.top_k, " of num_experts = ", p.num_experts,
            " (the one-warp router: K <= ", kRouterWarpMaxTopK, ", E <= ", kRouterWarpMaxExperts,
            ")");
  MOE_CHECK(p.block_size >= 1 && p.num_cache_blocks >= 1 && p.max_blocks_per_seq >= 1,
            "decode_layers: block_size = ", p.block_size,
            ", num_cache_blocks = ", p.num_cache_blocks,
            ", max_blocks_per_seq = ", p.max_blocks_per_seq, " (each at least 1)");
}

}  // namespace

std::string decode_layers_unsupported(const DecodeLayersParams& p) {
  try {
    check_shapes(p);
  } catch (const Error& e) {
    return e.what();
  }
  // The merge's shares [splits, G] live over the staged key tile.
  if (max_splits(p) * group_of(p) > persistent_layers::kKeyTile * p.padded_head_dim)
    return "more attention splits than the merge holds";
  if (!device_attribute(cudaDevAttrCooperativeLaunch))
    return "the device has no cooperative launch";
  const size_t bytes = shared_bytes(p);
  if (bytes > static_cast<size_t>(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)))
    return "more shared memory (" + std::to_string(bytes) + " bytes) than a block may have";
  const void* kernel = kernel_of(p.num_experts);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
  int blocks_per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                           kDecodeLayersThreads, bytes));
  if (blocks_per_sm < 1) return "no room for a block on an SM";
  return "";
}

void decode_layers(const DecodeLayersParams& params, cudaStream_t stream) {
  NvtxRange range("decode_layers");
  // The host's checks only (the device's are decode_layers_unsupported's, which the caller asked
  // once): nothing here but the launch touches the device, so a graph capture records it alone.
  check_shapes(params);
  MOE_CHECK(params.num_layers >= 1, "decode_layers: num_layers = ", params.num_layers);
  const struct {
    const void* pointer;
    const char* name;
  } required[] = {{params.layers, "layers"},       {params.hidden, "hidden"},
                  {params.block_out, "block_out"}, {params.position, "position"},
                  {params.slot, "slot"},           {params.block_table, "block_table"},
                  {params.seq_len, "seq_len"},     {params.scratch, "scratch"}};
  for (const auto& r : required) detail::check_pointer(r.pointer, r.name);
  detail::check_aligned16(params.hidden, "hidden");
  detail::check_aligned16(params.block_out, "block_out");
  MOE_CHECK(params.rotary_dim == 0 || params.inv_freq != nullptr,
            "decode_layers: rotary_dim = ", params.rotary_dim, " without inv_freq");
  MOE_CHECK(params.routing_ids == nullptr ||
                (params.routing_weights != nullptr && params.routing_stride >= params.top_k),
            "decode_layers: routing_ids without routing_weights, or routing_stride = ",
            params.routing_stride, " below top_k = ", params.top_k);
  int64_t bytes = 0;
  const Scratch scratch = carve(params, static_cast<char*>(params.scratch), &bytes);
  const size_t shared = shared_bytes(params);
  const int blocks = current_multiprocessor_count();
  CUDA_CHECK(cudaFuncSetAttribute(kernel_of(params.num_experts),
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(shared)));

  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kDecodeLayersThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  with_router_lanes(params.num_experts, [&](auto per_lane) {
    CUDA_CHECK(cudaLaunchKernelEx(
        &config, persistent_layers::decode_layers_kernel<decltype(per_lane)::value>, params,
        scratch));
  });
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moeinfer::cuda
