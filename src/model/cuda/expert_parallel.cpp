#include "model/cuda/expert_parallel.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_stages.h"
#include "backend/cuda/row_moves.h"
#include "core/error.h"

namespace moeinfer::gpu {
namespace {

// Pinned host memory of at least `count` elements; the stream is synchronised first when it
// must grow, as a copy in flight may still read the old block.
template <typename T>
T* reserve_pinned(PinnedArray<T>& array, size_t& capacity, size_t count, cudaStream_t stream) {
  if (count > capacity || !array) {
    CUDA_CHECK(cudaStreamSynchronize(stream));
    capacity = std::max<size_t>({count, capacity * 2, 1});
    array = pinned_array<T>(capacity);
  }
  return array.get();
}

// The same on the device (cudaFree waits for the device).
template <typename T>
T* reserve_device(DeviceArray<T>& array, size_t& capacity, size_t count) {
  if (count > capacity || !array) {
    capacity = std::max<size_t>({count, capacity * 2, 1});
    array.reset();
    array = device_array<T>(capacity);
  }
  return array.get();
}

// What identifies this rank's machine and GPU for link_classes.
struct RankPlace {
  char host[64] = {};
  char gpu_uuid[16] = {};
};

}  // namespace

std::vector<profile::Link> link_classes(parallel::Communicator& comm) {
  RankPlace mine;
  gethostname(mine.host, sizeof(mine.host) - 1);
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  static_assert(sizeof(prop.uuid.bytes) == sizeof(mine.gpu_uuid));
  std::memcpy(mine.gpu_uuid, prop.uuid.bytes, sizeof(mine.gpu_uuid));
  const int N = comm.size();
  std::vector<RankPlace> all(static_cast<size_t>(N));
  comm.all_gather(&mine, all.data(), sizeof(RankPlace));
  std::vector<profile::Link> links(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const bool same_host = std::strncmp(all[r].host, mine.host, sizeof(mine.host)) == 0;
    const bool same_gpu =
        same_host && std::memcmp(all[r].gpu_uuid, mine.gpu_uuid, sizeof(mine.gpu_uuid)) == 0;
    links[r] = same_gpu    ? profile::Link::kSameGpu
               : same_host ? profile::Link::kPeerGpu
                           : profile::Link::kNetwork;
  }
  return links;
}

ExpertOrder expert_order(const moe::DispatchLayout& layout, std::span<const int32_t> slots,
                         int64_t num_experts) {
  const int64_t E = num_experts, mine = static_cast<int64_t>(slots.size());
  const int64_t received = layout.received;
  MOE_CHECK(static_cast<int64_t>(layout.expert_offsets.size()) == mine + 1 &&
                static_cast<int64_t>(layout.expert_row_of_recv.size()) == received,
            "expert_order: a layout merged over ", layout.expert_offsets.size() - 1,
            " slots for a rank of ", mine);
  // Slot j holds expert slots[j], whose rows sit at offsets[slots[j]] on.
  ExpertOrder order;
  order.offsets.assign(static_cast<size_t>(E) + 1, 0);
  for (int64_t j = 0; j < mine; ++j) {
    order.offsets[slots[j] + 1] = layout.expert_offsets[j + 1] - layout.expert_offsets[j];
  }
  for (int64_t e = 0; e < E; ++e) order.offsets[e + 1] += order.offsets[e];
  std::vector<int32_t> slot_of_row(static_cast<size_t>(received));  // slot-order row -> slot
  for (int64_t j = 0; j < mine; ++j) {
    std::fill(slot_of_row.begin() + layout.expert_offsets[j],
              slot_of_row.begin() + layout.expert_offsets[j + 1], static_cast<int32_t>(j));
  }
  order.row_of_recv.resize(static_cast<size_t>(received));
  for (int64_t i = 0; i < received; ++i) {
    const int32_t slot_row = layout.expert_row_of_recv[i];
    const int32_t j = slot_of_row[slot_row];
    order.row_of_recv[i] = order.offsets[slots[j]] + (slot_row - layout.expert_offsets[j]);
  }
  return order;
}

DeviceDispatcher::DeviceDispatcher(parallel::Communicator& host, RowTransport rows,
                                   parallel::ExpertPlacement placement, int64_t num_experts,
                                   int64_t hidden_size, int64_t max_rows_out, bf16* plan_rows)
    : host_(host),
      rows_(std::move(rows)),
      placement_(std::move(placement)),
      num_experts_(num_experts),
      hidden_size_(hidden_size),
      max_rows_out_(max_rows_out),
      plan_rows_(plan_rows),
      links_(link_classes(host)) {
  MOE_CHECK(rows_.comm != nullptr && rows_.comm->size() == host_.size() &&
                rows_.comm->rank() == host_.rank(),
            "the GPU expert-parallel dispatcher needs a row transport over the same ranks as "
            "its host communicator");
  MOE_CHECK(placement_.num_ranks() == host_.size(), "a placement over ", placement_.num_ranks(),
            " ranks for a job of ", host_.size());
  MOE_CHECK(placement_.num_experts() == num_experts_, "a placement of ",
            placement_.num_experts(), " experts for a model of ", num_experts_);
  MOE_CHECK(plan_rows_ != nullptr, "the GPU expert-parallel dispatcher needs a row workspace");
  pinned_offsets_ = pinned_array<int32_t>(static_cast<size_t>(num_experts_) + 2);
  CUDA_CHECK(cudaEventCreateWithFlags(&packed_, cudaEventDisableTiming));
}

DeviceDispatcher::~DeviceDispatcher() {
  if (packed_) cudaEventDestroy(packed_);
}

void DeviceDispatcher::count_sent(const std::vector<int64_t>& bytes) {
  profile::Profiler* p = profile::active();
  for (int r = 0; r < host_.size(); ++r) {
    if (r == host_.rank() || bytes[r] == 0) continue;  // a rank's own rows stay on its GPU
    bytes_sent_[static_cast<int>(links_[r])] += bytes[r];
    if (p) p->add_link_bytes(links_[r], bytes[r]);
  }
}

void DeviceDispatcher::exchange(const bf16* send, std::span<const int64_t> send_bytes, bf16* recv,
                                std::span<const int64_t> recv_bytes, cudaStream_t stream) {
  in_flight_.wait();  // one exchange at a time; its errors surface here
  if (rows_.stream_ordered && rows_.stream == stream) {
    in_flight_ = rows_.comm->start_all_to_allv(send, send_bytes, recv, recv_bytes);
    return;
  }
  if (rows_.stream != stream) {  // the transport sees only its own stream's earlier work
    CUDA_CHECK(cudaEventRecord(packed_, stream));
    CUDA_CHECK(cudaStreamWaitEvent(rows_.stream, packed_, 0));
  }
  // Returns with `recv` filled in device memory, readable from any stream.
  rows_.comm->all_to_allv(send, send_bytes, recv, recv_bytes);
}

ExpertRows DeviceDispatcher::dispatch(int64_t layer, const RoutedTokens& tokens,
                                      cudaStream_t stream) {
  cuda::NvtxRange range("ep_dispatch");
  const parallel::LayerPlacement& table = placement_.layer(layer);
  const int N = host_.size(), me = host_.rank();
  const int64_t E = num_experts_, H = hidden_size_;
  const size_t row_elems = static_cast<size_t>(H);
  const int64_t row_bytes = H * static_cast<int64_t>(sizeof(bf16));
  plan_rows_total_ = tokens.num_tokens * tokens.top_k;

  // The plan's rows (weighted under kInput, as the local dispatcher's) stay on the device; its
  // offsets come to the host in the layer's one synchronisation.
  cuda::permute({.hidden = tokens.hidden, .inverse = tokens.inverse, .rows = plan_rows_,
                 .num_tokens = tokens.num_tokens, .top_k = tokens.top_k, .hidden_size = H,
                 .topk_weights = tokens.weights == moe::WeightPlacement::kInput
                                     ? tokens.topk_weights
                                     : nullptr},
                stream);
  const size_t offsets_cap = static_cast<size_t>(E) + 2;  // the plan's, over E + 1 experts
  CUDA_CHECK(cudaMemcpyAsync(pinned_offsets_.get(), tokens.expert_offsets,
                             offsets_cap * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  host_offsets_.assign(pinned_offsets_.get(), pinned_offsets_.get() + offsets_cap);
  real_rows_ = host_offsets_[E];  // the padding expert E's rows stay here
  MOE_CHECK(real_rows_ >= 0 && real_rows_ <= plan_rows_total_, "layer ", layer, ": a plan of ",
            real_rows_, " rows for ", plan_rows_total_, " assignments");

  // Rows packed by receiver, then its slot, then plan order (the CPU dispatcher's order), on
  // the device while the counts go round.
  layout_.plan_sends(table, me, host_offsets_);
  const size_t real = static_cast<size_t>(real_rows_);
  int32_t* send_pos_host = reserve_pinned(send_pos_host_, send_pos_host_cap_, real, stream);
  std::copy(layout_.send_pos.begin(), layout_.send_pos.end(), send_pos_host);
  int32_t* send_pos = reserve_device(send_pos_dev_, send_pos_dev_cap_, real);
  bf16* send_rows =
      reserve_device(send_rows_, send_rows_cap_, std::max<size_t>(real, 1) * row_elems);
  if (real_rows_ > 0) {
    CUDA_CHECK(cudaMemcpyAsync(send_pos, send_pos_host, real * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream));
    cuda::move_rows({.src = plan_rows_,
                     .dst = send_rows,
                     .dst_index = send_pos,
                     .num_rows = real_rows_,
                     .hidden_size = H},
                    stream);
  }
  layout_.exchange_counts(host_, table);
  const int64_t received = layout_.received;
  MOE_CHECK(received <= max_rows_out_, "layer ", layer, ": rank ", me, " received ", received,
            " rows; its experts' workspace takes ", max_rows_out_);
  const auto slots = table.slots(me);
  layout_.merge(static_cast<int64_t>(slots.size()));
  const ExpertOrder order = expert_order(layout_, slots, E);

  // The maps the received rows need: the expert offsets the runner reads, then row_of_recv.
  const size_t maps = static_cast<size_t>(E) + 1 + static_cast<size_t>(received);
  int32_t* maps_host = reserve_pinned(recv_maps_host_, recv_maps_host_cap_, maps, stream);
  std::copy(order.offsets.begin(), order.offsets.end(), maps_host);
  std::copy(order.row_of_recv.begin(), order.row_of_recv.end(), maps_host + E + 1);
  int32_t* maps_dev = reserve_device(recv_maps_dev_, recv_maps_dev_cap_, maps);
  CUDA_CHECK(
      cudaMemcpyAsync(maps_dev, maps_host, maps * sizeof(int32_t), cudaMemcpyHostToDevice, stream));

  std::vector<int64_t> send_bytes(N), recv_bytes(N);
  for (int r = 0; r < N; ++r) {
    send_bytes[r] = layout_.send_num_rows[r] * row_bytes;
    recv_bytes[r] = layout_.recv_num_rows[r] * row_bytes;
  }
  const size_t recv_rows_needed = std::max<size_t>(static_cast<size_t>(received), 1) * row_elems;
  bf16* recv_rows = reserve_device(recv_rows_, recv_rows_cap_, recv_rows_needed);
  exchange(send_rows, send_bytes, recv_rows, recv_bytes, stream);
  count_sent(send_bytes);

  // Source order to logical-expert order.
  bf16* expert_rows = reserve_device(expert_rows_, expert_rows_cap_, recv_rows_needed);
  cuda::move_rows({.src = recv_rows,
                   .dst = expert_rows,
                   .dst_index = maps_dev + E + 1,
                   .num_rows = received,
                   .hidden_size = H},
                  stream);
  return {.rows = expert_rows,
          .src_row = nullptr,
          .top_k = 1,
          .expert_offsets = maps_dev,
          .num_experts = E,
          .num_rows = received};
}

void DeviceDispatcher::combine(int64_t layer, const bf16* expert_out, const RoutedTokens& tokens,
                               const bf16* shared, float* out, cudaStream_t stream) {
  cuda::NvtxRange range("ep_combine");
  const int N = host_.size();
  const int64_t E = num_experts_, H = hidden_size_;
  const int64_t row_bytes = H * static_cast<int64_t>(sizeof(bf16));
  const int64_t received = layout_.received;
  MOE_CHECK(plan_rows_total_ == tokens.num_tokens * tokens.top_k, "layer ", layer,
            ": combine of ", tokens.num_tokens * tokens.top_k, " rows after a dispatch of ",
            plan_rows_total_);

  // This rank's experts' outputs, back in the order their rows came (source order), into the
  // buffer the rows came in; the returned outputs land where this rank's rows left from.
  bf16* back = recv_rows_.get();
  cuda::move_rows({.src = expert_out,
                   .src_index = recv_maps_dev_.get() + E + 1,
                   .dst = back,
                   .num_rows = received,
                   .hidden_size = H},
                  stream);
  std::vector<int64_t> back_bytes(N), returned_bytes(N);
  for (int r = 0; r < N; ++r) {
    back_bytes[r] = layout_.recv_num_rows[r] * row_bytes;
    returned_bytes[r] = layout_.send_num_rows[r] * row_bytes;
  }
  bf16* returned = send_rows_.get();
  exchange(back, back_bytes, returned, returned_bytes, stream);
  count_sent(back_bytes);

  // Plan order; the padding expert's rows are zero (their weight is 0 and unpermute skips
  // them, but they must not be NaN).
  bf16* plan_out = reserve_device(plan_out_, plan_out_cap_,
                                  std::max<size_t>(plan_rows_total_, 1) * static_cast<size_t>(H));
  cuda::move_rows({.src = returned,
                   .src_index = send_pos_dev_.get(),
                   .dst = plan_out,
                   .num_rows = real_rows_,
                   .hidden_size = H},
                  stream);
  if (plan_rows_total_ > real_rows_) {
    CUDA_CHECK(cudaMemsetAsync(plan_out + real_rows_ * H, 0,
                               static_cast<size_t>((plan_rows_total_ - real_rows_) * row_bytes),
                               stream));
  }
  cuda::unpermute({.expert_out = plan_out, .topk_weights = tokens.topk_weights,
                   .inverse = tokens.inverse, .shared = shared, .out = out,
                   .num_tokens = tokens.num_tokens, .top_k = tokens.top_k,
                   .hidden_size = H,
                   .weights_on_input = tokens.weights == moe::WeightPlacement::kInput},
                  stream);
}

}  // namespace moeinfer::gpu
