// The NCCL communicator (parallel/nccl/) with one rank on device 0: every operation moves device
// buffers through NCCL to itself and must bring every byte back exactly (receive buffers
// poisoned with 0xFF first, fresh random bytes each run, awkward sizes), a start_all_to_allv is
// complete once waited for, operations are ordered after work on the caller's stream, and bad
// arguments are refused with a message naming the operation before anything is enqueued.
//
// Several ranks are not tested here (the GPU machine has one GPU): the peer loop is the same
// code at any size, but no two-rank run has exercised it.
//
// Like the kernel tests, these are registered only when a CUDA device is present (see
// cuda_stages_test.cpp): every one needs a device, since creating the communicator does.
#include <gtest/gtest.h>

#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA && defined(MOE_HAVE_NCCL) && MOE_HAVE_NCCL

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "parallel/communicator.h"
#include "parallel/nccl/nccl_communicator.h"

namespace moeinfer::parallel {
namespace {

using cuda::testing_util::DeviceBuffer;
using cuda::testing_util::expect_error_naming;
using cuda::testing_util::fresh_seed;

constexpr int kDevice = 0;

std::vector<uint8_t> random_bytes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> bytes(n);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// A device buffer of `n` bytes, all 0xFF, the memset finished: the communicator's stream does not
// wait for the legacy default stream that cudaMemset runs on.
std::unique_ptr<DeviceBuffer<uint8_t>> poisoned(size_t n) {
  auto buffer = std::make_unique<DeviceBuffer<uint8_t>>(n);
  buffer->poison();
  cuda::testing_util::synchronize();
  return buffer;
}

// got[0, want.size()) == want, reported by the first differing index rather than the whole
// buffer; got may be longer, its tail is checked by the caller.
void expect_same_bytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  ASSERT_GE(got.size(), want.size());
  size_t differ = 0;
  size_t first = want.size();
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      if (differ++ == 0) first = i;
    }
  }
  EXPECT_EQ(differ, 0u) << differ << " of " << want.size() << " bytes differ, the first at "
                        << first;
}

// One rank's all_to_allv of `bytes` bytes: a single part, to itself. The receive buffer is one
// byte longer than the part, so a write past it shows.
void all_to_allv_round_trips(NcclCommunicator& comm, int64_t bytes, std::mt19937& rng,
                             bool started) {
  SCOPED_TRACE(::testing::Message() << bytes << " bytes, " << (started ? "started" : "blocking"));
  const std::vector<uint8_t> host = random_bytes(static_cast<size_t>(bytes), rng);
  DeviceBuffer<uint8_t> send(host);
  auto recv = poisoned(static_cast<size_t>(bytes) + 1);
  const int64_t parts[] = {bytes};
  if (started) {
    PendingOp op = comm.start_all_to_allv(send.get(), parts, recv->get(), parts);
    EXPECT_TRUE(op.pending());
    op.wait();
    EXPECT_FALSE(op.pending());
  } else {
    comm.all_to_allv(send.get(), parts, recv->get(), parts);
  }
  const std::vector<uint8_t> got = recv->download();
  expect_same_bytes(got, host);
  EXPECT_EQ(got.back(), 0xFF) << "a byte past the part was written";
}

void identity() {
  auto comm = NcclCommunicator::single(kDevice);
  EXPECT_EQ(comm->name(), "nccl");
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->device(), kDevice);
  EXPECT_NE(comm->stream(), nullptr) << "single() without a stream owns one";
}

void all_to_allv_ragged_and_empty() {
  std::mt19937 rng(fresh_seed());
  auto comm = NcclCommunicator::single(kDevice);
  for (const int64_t bytes : {0, 1, 19, 99, 989, 4096, (1 << 20) + 3}) {
    all_to_allv_round_trips(*comm, bytes, rng, /*started=*/false);
  }
}

void start_all_to_allv_and_wait() {
  std::mt19937 rng(fresh_seed());
  auto comm = NcclCommunicator::single(kDevice);
  for (const int64_t bytes : {0, 1, 989, (1 << 22) + 7}) {
    all_to_allv_round_trips(*comm, bytes, rng, /*started=*/true);
  }
}

// Two in flight at once, waited for in the reverse order; a third never waited for explicitly,
// whose destructor must wait.
void several_in_flight() {
  std::mt19937 rng(fresh_seed());
  auto comm = NcclCommunicator::single(kDevice);
  const int64_t sizes[] = {(1 << 20) + 1, 37, 4099};
  std::vector<std::vector<uint8_t>> hosts;
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> sends, recvs;
  for (const int64_t bytes : sizes) {
    hosts.push_back(random_bytes(static_cast<size_t>(bytes), rng));
    sends.push_back(std::make_unique<DeviceBuffer<uint8_t>>(hosts.back()));
    recvs.push_back(poisoned(static_cast<size_t>(bytes)));
  }
  {
    PendingOp first = comm->start_all_to_allv(sends[0]->get(), std::span(&sizes[0], 1),
                                              recvs[0]->get(), std::span(&sizes[0], 1));
    PendingOp second = comm->start_all_to_allv(sends[1]->get(), std::span(&sizes[1], 1),
                                               recvs[1]->get(), std::span(&sizes[1], 1));
    PendingOp third = comm->start_all_to_allv(sends[2]->get(), std::span(&sizes[2], 1),
                                              recvs[2]->get(), std::span(&sizes[2], 1));
    second.wait();
    first.wait();
  }  // third waits here
  for (size_t i = 0; i < hosts.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "operation " << i << " of " << sizes[i] << " bytes");
    expect_same_bytes(recvs[i]->download(), hosts[i]);
  }
}

void all_to_all_equal_parts() {
  std::mt19937 rng(fresh_seed());
  auto comm = NcclCommunicator::single(kDevice);
  for (const int64_t bytes : {0, 7, 4096, 65537}) {
    SCOPED_TRACE(::testing::Message() << bytes << " bytes per rank");
    const std::vector<uint8_t> host = random_bytes(static_cast<size_t>(bytes), rng);
    DeviceBuffer<uint8_t> send(host);
    auto recv = poisoned(static_cast<size_t>(bytes));
    comm->all_to_all(send.get(), recv->get(), bytes);
    expect_same_bytes(recv->download(), host);
  }
}

void all_gather_round_trips() {
  std::mt19937 rng(fresh_seed());
  auto comm = NcclCommunicator::single(kDevice);
  for (const int64_t bytes : {0, 1, 19, 989, 1 << 20}) {
    SCOPED_TRACE(::testing::Message() << bytes << " bytes");
    const std::vector<uint8_t> host = random_bytes(static_cast<size_t>(bytes), rng);
    DeviceBuffer<uint8_t> send(host);
    auto recv = poisoned(static_cast<size_t>(bytes) + 1);
    comm->all_gather(send.get(), recv->get(), bytes);
    const std::vector<uint8_t> got = recv->download();
    expect_same_bytes(got, host);
    EXPECT_EQ(got.back(), 0xFF) << "a byte past the gathered part was written";
  }
}

void all_reduce_sum_int64() {
  std::mt19937_64 rng(fresh_seed());
  auto comm = NcclCommunicator::single(kDevice);
  std::vector<int64_t> empty;
  comm->all_reduce_sum(std::span<int64_t>(empty));
  // Extremes first, then enough random values to grow the staging buffer past its first size.
  for (const size_t count : {size_t{1}, size_t{19}, size_t{100003}}) {
    std::vector<int64_t> values(count);
    for (auto& v : values) v = static_cast<int64_t>(rng());
    values[0] = std::numeric_limits<int64_t>::min();
    if (count > 1) values[1] = std::numeric_limits<int64_t>::max();
    const std::vector<int64_t> want = values;  // one rank: the sum is its own values
    comm->all_reduce_sum(std::span<int64_t>(values));
    EXPECT_EQ(values, want) << count << " values";
  }
}

void all_reduce_sum_double() {
  std::mt19937_64 rng(fresh_seed());
  std::normal_distribution<double> normal(0.0, 1e3);
  auto comm = NcclCommunicator::single(kDevice);
  for (const size_t count : {size_t{1}, size_t{99}, size_t{70001}}) {
    std::vector<double> values(count);
    for (auto& v : values) v = normal(rng);
    values[0] = std::numeric_limits<double>::denorm_min();
    if (count > 2) {
      values[1] = -0.0;
      values[2] = std::numeric_limits<double>::max();
    }
    const std::vector<double> want = values;
    comm->all_reduce_sum(std::span<double>(values));
    // Bit for bit: one rank's sum is its value, with no rounding.
    EXPECT_EQ(0, std::memcmp(values.data(), want.data(), count * sizeof(double)))
        << count << " values differ";
  }
}

void barrier_returns() {
  auto comm = NcclCommunicator::single(kDevice);
  for (int i = 0; i < 3; ++i) comm->barrier();
}

// Work enqueued on the caller's stream before an operation is seen by it: the send buffer is
// filled by a memset on that stream and never synchronised before the call.
void ordered_after_the_callers_stream() {
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    auto comm = NcclCommunicator::single(kDevice, stream);
    EXPECT_EQ(comm->stream(), stream);
    const int64_t bytes = (1 << 24) + 5;
    DeviceBuffer<uint8_t> send(static_cast<size_t>(bytes));
    auto recv = poisoned(static_cast<size_t>(bytes));
    CUDA_CHECK(cudaMemsetAsync(send.get(), 0x5A, static_cast<size_t>(bytes), stream));
    const int64_t parts[] = {bytes};
    comm->all_to_allv(send.get(), parts, recv->get(), parts);
    expect_same_bytes(recv->download(), std::vector<uint8_t>(static_cast<size_t>(bytes), 0x5A));
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
}

// create() through the unique-id path with a one-rank bootstrap, as a multi-rank job would do it
// with MPI's.
void create_through_a_bootstrap() {
  std::mt19937 rng(fresh_seed());
  SelfCommunicator bootstrap;
  const ncclUniqueId id = nccl_unique_id_via(bootstrap);
  auto comm = NcclCommunicator::create(bootstrap.rank(), bootstrap.size(), id, kDevice);
  all_to_allv_round_trips(*comm, 989, rng, /*started=*/false);
  comm->barrier();
}

void refuses_bad_arguments() {
  auto comm = NcclCommunicator::single(kDevice);
  DeviceBuffer<uint8_t> send(64);
  DeviceBuffer<uint8_t> recv(64);
  const int64_t two[] = {8, 8};
  const int64_t one[] = {8};
  const int64_t negative[] = {-1};
  const int64_t nine[] = {9};
  expect_error_naming([&] { comm->all_to_allv(send.get(), two, recv.get(), one); },
                      "all_to_allv: 2 send and 1 receive counts for 1 ranks");
  expect_error_naming([&] { comm->all_to_allv(send.get(), one, recv.get(), two); },
                      "all_to_allv: 1 send and 2 receive counts for 1 ranks");
  expect_error_naming([&] { (void)comm->start_all_to_allv(send.get(), two, recv.get(), two); },
                      "all_to_allv: 2 send and 2 receive counts");
  expect_error_naming([&] { comm->all_to_allv(send.get(), negative, recv.get(), negative); },
                      "all_to_allv: the send part of rank 0 is -1 bytes");
  expect_error_naming([&] { (void)comm->start_all_to_allv(send.get(), one, recv.get(), negative); },
                      "all_to_allv: the receive part of rank 0 is -1 bytes");
  expect_error_naming([&] { comm->all_to_allv(send.get(), one, recv.get(), nine); },
                      "all_to_allv: rank 0 sends 8 bytes to itself but expects 9");
  expect_error_naming([&] { comm->all_to_all(send.get(), recv.get(), -3); },
                      "all_to_all: bytes_per_rank is -3");
  expect_error_naming([&] { comm->all_gather(send.get(), recv.get(), -1); },
                      "all_gather: -1 bytes");
  std::vector<uint8_t> host(64);
  expect_error_naming([&] { comm->all_to_allv(host.data(), one, recv.get(), one); },
                      "all_to_allv: the send buffer is host memory");
  expect_error_naming([&] { comm->all_gather(send.get(), host.data(), 8); },
                      "all_gather: the receive buffer is host memory");
  expect_error_naming([&] { comm->all_to_allv(nullptr, one, recv.get(), one); },
                      "all_to_allv: the send buffer is null");
  expect_error_naming([] { (void)NcclCommunicator::single(-1); },
                      "NcclCommunicator::single: CUDA device -1 does not exist");
  ncclUniqueId id{};
  expect_error_naming([&] { (void)NcclCommunicator::create(2, 2, id, kDevice); },
                      "NcclCommunicator::create: rank 2 of 2 ranks");
  // Nothing was enqueued by the refusals: the communicator still works.
  std::mt19937 rng(fresh_seed());
  all_to_allv_round_trips(*comm, 64, rng, /*started=*/false);
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("NCCL communicator")) return false;
  const struct {
    const char* name;
    void (*body)();
  } tests[] = {
      {"Identity", identity},
      {"AllToAllvRaggedAndEmpty", all_to_allv_ragged_and_empty},
      {"StartAllToAllvAndWait", start_all_to_allv_and_wait},
      {"SeveralInFlight", several_in_flight},
      {"AllToAllEqualParts", all_to_all_equal_parts},
      {"AllGather", all_gather_round_trips},
      {"AllReduceSumInt64", all_reduce_sum_int64},
      {"AllReduceSumDouble", all_reduce_sum_double},
      {"Barrier", barrier_returns},
      {"OrderedAfterTheCallersStream", ordered_after_the_callers_stream},
      {"CreateThroughABootstrap", create_through_a_bootstrap},
      {"RefusesBadArguments", refuses_bad_arguments},
  };
  for (const auto& test : tests) {
    cuda::testing_util::register_kernel_test("CudaNcclCommunicator", test.name, test.body, __FILE__,
                                             __LINE__);
  }
  return true;
}();

}  // namespace
}  // namespace moeinfer::parallel

#endif  // MOE_HAVE_CUDA && MOE_HAVE_NCCL
