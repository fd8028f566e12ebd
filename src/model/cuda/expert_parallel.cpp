#include "model/cuda/expert_parallel.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_stages.h"
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

HostStagedDispatcher::HostStagedDispatcher(parallel::Communicator& comm,
                                           parallel::ExpertPlacement placement,
                                           int64_t num_experts, int64_t hidden_size,
                                           int64_t max_rows_out, bf16* plan_rows)
    : comm_(comm),
      placement_(std::move(placement)),
      num_experts_(num_experts),
      hidden_size_(hidden_size),
      max_rows_out_(max_rows_out),
      plan_rows_(plan_rows),
      links_(link_classes(comm)) {
  MOE_CHECK(placement_.num_ranks() == comm_.size(), "a placement over ", placement_.num_ranks(),
            " ranks for a job of ", comm_.size());
  MOE_CHECK(placement_.num_experts() == num_experts_, "a placement of ",
            placement_.num_experts(), " experts for a model of ", num_experts_);
  MOE_CHECK(plan_rows_ != nullptr, "the GPU expert-parallel dispatcher needs a row workspace");
  offsets_dev_ = device_array<int32_t>(static_cast<size_t>(num_experts_) + 1);
  pinned_offsets_ = pinned_array<int32_t>(static_cast<size_t>(num_experts_) + 2);
}

void HostStagedDispatcher::count_sent(const std::vector<int64_t>& bytes) {
  profile::Profiler* p = profile::active();
  for (int r = 0; r < comm_.size(); ++r) {
    if (r == comm_.rank() || bytes[r] == 0) continue;  // a rank's own rows stay on its GPU
    bytes_sent_[static_cast<int>(links_[r])] += bytes[r];
    if (p) p->add_link_bytes(links_[r], bytes[r]);
  }
}

ExpertRows HostStagedDispatcher::dispatch(int64_t layer, const RoutedTokens& tokens,
                                          cudaStream_t stream) {
  cuda::NvtxRange range("ep_dispatch");
  const parallel::LayerPlacement& table = placement_.layer(layer);
  const int N = comm_.size(), me = comm_.rank();
  const int64_t E = num_experts_, H = hidden_size_;
  const size_t row_elems = static_cast<size_t>(H);
  const size_t row_bytes = row_elems * sizeof(bf16);
  plan_rows_total_ = tokens.num_tokens * tokens.top_k;

  // The plan's rows (weighted under kInput, as the local dispatcher's) and its offsets, to the
  // host in one synchronisation.
  cuda::permute({.hidden = tokens.hidden, .inverse = tokens.inverse, .rows = plan_rows_,
                 .num_tokens = tokens.num_tokens, .top_k = tokens.top_k, .hidden_size = H,
                 .topk_weights = tokens.weights == moe::WeightPlacement::kInput
                                     ? tokens.topk_weights
                                     : nullptr},
                stream);
  const size_t offsets_cap = static_cast<size_t>(E) + 2;  // the plan's, over E + 1 experts
  bf16* plan_host = reserve_pinned(plan_host_, plan_cap_,
                                   static_cast<size_t>(plan_rows_total_) * row_elems, stream);
  CUDA_CHECK(cudaMemcpyAsync(pinned_offsets_.get(), tokens.expert_offsets,
                             offsets_cap * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(plan_host, plan_rows_,
                             static_cast<size_t>(plan_rows_total_) * row_bytes,
                             cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  host_offsets_.assign(pinned_offsets_.get(), pinned_offsets_.get() + offsets_cap);
  real_rows_ = host_offsets_[E];  // the padding expert E's rows stay here
  MOE_CHECK(real_rows_ >= 0 && real_rows_ <= plan_rows_total_, "layer ", layer, ": a plan of ",
            real_rows_, " rows for ", plan_rows_total_, " assignments");

  // Rows packed by receiver, then its slot, then plan order (the CPU dispatcher's order).
  layout_.plan_sends(table, me, host_offsets_);
  bf16* send_host = reserve_pinned(send_host_, send_cap_,
                                   static_cast<size_t>(real_rows_) * row_elems, stream);
  for (int64_t r = 0; r < real_rows_; ++r) {
    std::memcpy(send_host + static_cast<size_t>(layout_.send_pos[r]) * row_elems,
                plan_host + static_cast<size_t>(r) * row_elems, row_bytes);
  }
  layout_.exchange_counts(comm_, table);
  const int64_t received = layout_.received;
  MOE_CHECK(received <= max_rows_out_, "layer ", layer, ": rank ", me, " received ", received,
            " rows; its experts' workspace takes ", max_rows_out_);
  std::vector<int64_t> send_bytes(N), recv_bytes(N);
  for (int r = 0; r < N; ++r) {
    send_bytes[r] = layout_.send_num_rows[r] * static_cast<int64_t>(row_bytes);
    recv_bytes[r] = layout_.recv_num_rows[r] * static_cast<int64_t>(row_bytes);
  }
  bf16* recv_host =
      reserve_pinned(recv_host_, recv_cap_, static_cast<size_t>(received) * row_elems, stream);
  comm_.all_to_allv(send_host, send_bytes, recv_host, recv_bytes);
  count_sent(send_bytes);

  // Slot order (the layout's merge), then logical-expert order: slot j holds expert
  // slots[j], whose rows sit at offsets_by_expert_[slots[j]] on.
  const auto slots = table.slots(me);
  const int64_t mine = static_cast<int64_t>(slots.size());
  layout_.merge(mine);
  offsets_by_expert_.assign(static_cast<size_t>(E) + 1, 0);
  for (int64_t j = 0; j < mine; ++j) {
    offsets_by_expert_[slots[j] + 1] = layout_.expert_offsets[j + 1] - layout_.expert_offsets[j];
  }
  for (int64_t e = 0; e < E; ++e) offsets_by_expert_[e + 1] += offsets_by_expert_[e];
  std::vector<int32_t> slot_of_row(static_cast<size_t>(received));  // slot-order row -> slot
  for (int64_t j = 0; j < mine; ++j) {
    std::fill(slot_of_row.begin() + layout_.expert_offsets[j],
              slot_of_row.begin() + layout_.expert_offsets[j + 1], static_cast<int32_t>(j));
  }
  row_of_recv_.resize(static_cast<size_t>(received));
  bf16* expert_host = reserve_pinned(expert_host_, expert_cap_,
                                     static_cast<size_t>(received) * row_elems, stream);
  for (int64_t i = 0; i < received; ++i) {
    const int32_t slot_row = layout_.expert_row_of_recv[i];
    const int32_t j = slot_of_row[slot_row];
    row_of_recv_[i] = offsets_by_expert_[slots[j]] + (slot_row - layout_.expert_offsets[j]);
    std::memcpy(expert_host + static_cast<size_t>(row_of_recv_[i]) * row_elems,
                recv_host + static_cast<size_t>(i) * row_elems, row_bytes);
  }
  int32_t* offsets_dev = offsets_dev_.get();
  // Pageable source: the copy is complete (staged) when the call returns.
  CUDA_CHECK(cudaMemcpyAsync(offsets_dev, offsets_by_expert_.data(),
                             (static_cast<size_t>(E) + 1) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream));
  bf16* rows_dev =
      reserve_device(rows_dev_, rows_dev_cap_, std::max<size_t>(received, 1) * row_elems);
  if (received > 0) {
    CUDA_CHECK(cudaMemcpyAsync(rows_dev, expert_host, static_cast<size_t>(received) * row_bytes,
                               cudaMemcpyHostToDevice, stream));
  }
  return {.rows = rows_dev,
          .src_row = nullptr,
          .top_k = 1,
          .expert_offsets = offsets_dev,
          .num_experts = E,
          .num_rows = received};
}

void HostStagedDispatcher::combine(int64_t layer, const bf16* expert_out,
                                   const RoutedTokens& tokens, const bf16* shared, float* out,
                                   cudaStream_t stream) {
  cuda::NvtxRange range("ep_combine");
  const int N = comm_.size();
  const int64_t H = hidden_size_;
  const size_t row_elems = static_cast<size_t>(H);
  const size_t row_bytes = row_elems * sizeof(bf16);
  const int64_t received = layout_.received;
  MOE_CHECK(plan_rows_total_ == tokens.num_tokens * tokens.top_k, "layer ", layer,
            ": combine of ", tokens.num_tokens * tokens.top_k, " rows after a dispatch of ",
            plan_rows_total_);

  // This rank's experts' outputs, back in the order their rows came (source order).
  if (received > 0) {
    CUDA_CHECK(cudaMemcpyAsync(expert_host_.get(), expert_out,
                               static_cast<size_t>(received) * row_bytes, cudaMemcpyDeviceToHost,
                               stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  bf16* back = recv_host_.get();  // sized for `received` rows by dispatch
  for (int64_t i = 0; i < received; ++i) {
    std::memcpy(back + static_cast<size_t>(i) * row_elems,
                expert_host_.get() + static_cast<size_t>(row_of_recv_[i]) * row_elems, row_bytes);
  }
  std::vector<int64_t> back_bytes(N), returned_bytes(N);
  for (int r = 0; r < N; ++r) {
    back_bytes[r] = layout_.recv_num_rows[r] * static_cast<int64_t>(row_bytes);
    returned_bytes[r] = layout_.send_num_rows[r] * static_cast<int64_t>(row_bytes);
  }
  bf16* returned = send_host_.get();  // the rows this rank sent, in the order it sent them
  comm_.all_to_allv(back, back_bytes, returned, returned_bytes);
  count_sent(back_bytes);

  // Plan order; the padding expert's rows are zero (their weight is 0 and unpermute skips
  // them, but they must not be NaN).
  bf16* plan_host = plan_host_.get();
  for (int64_t r = 0; r < real_rows_; ++r) {
    std::memcpy(plan_host + static_cast<size_t>(r) * row_elems,
                returned + static_cast<size_t>(layout_.send_pos[r]) * row_elems, row_bytes);
  }
  std::memset(plan_host + static_cast<size_t>(real_rows_) * row_elems, 0,
              static_cast<size_t>(plan_rows_total_ - real_rows_) * row_bytes);
  bf16* plan_out = reserve_device(plan_out_dev_, plan_out_cap_,
                                  std::max<size_t>(plan_rows_total_, 1) * row_elems);
  CUDA_CHECK(cudaMemcpyAsync(plan_out, plan_host,
                             static_cast<size_t>(plan_rows_total_) * row_bytes,
                             cudaMemcpyHostToDevice, stream));
  cuda::unpermute({.expert_out = plan_out, .topk_weights = tokens.topk_weights,
                   .inverse = tokens.inverse, .shared = shared, .out = out,
                   .num_tokens = tokens.num_tokens, .top_k = tokens.top_k,
                   .hidden_size = H,
                   .weights_on_input = tokens.weights == moe::WeightPlacement::kInput},
                  stream);
}

}  // namespace moeinfer::gpu
