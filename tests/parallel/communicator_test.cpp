// SelfCommunicator (a job of one rank) and world() in a process no launcher started. The MPI
// communicator's tests run as several ranks under mpirun: tests/parallel/mpi/.
#include "parallel/communicator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"

namespace moeinfer::parallel {
namespace {

std::vector<uint8_t> counting_bytes(size_t num_bytes) {
  std::vector<uint8_t> bytes(num_bytes);
  std::iota(bytes.begin(), bytes.end(), uint8_t{7});
  return bytes;
}

// poll_until calls `done` until it is true, then returns at once; with other backoff times too
// (here: sleeping from the first call, 1 us at most, so the test does not spin).
TEST(PollUntil, ReturnsOnceDoneHoldsWithAnyBackoff) {
  int calls = 0;
  poll_until([&] { return ++calls == 5; });
  EXPECT_EQ(calls, 5);
  calls = 0;
  poll_until([&] { return ++calls == 7; },
             PollBackoff{.spin = std::chrono::microseconds(0),
                         .longest_sleep = std::chrono::microseconds(1)});
  EXPECT_EQ(calls, 7);
}

TEST(SelfCommunicator, IsOneRank) {
  SelfCommunicator self;
  EXPECT_EQ(self.rank(), 0);
  EXPECT_EQ(self.size(), 1);
  EXPECT_EQ(self.name(), "self");
}

TEST(SelfCommunicator, AllToAllCopiesItsOwnPart) {
  SelfCommunicator self;
  const std::vector<uint8_t> send = counting_bytes(19);
  std::vector<uint8_t> recv(19, 0xA5);
  self.all_to_all(send.data(), recv.data(), 19);
  EXPECT_EQ(recv, send);
}

TEST(SelfCommunicator, AllToAllvCopiesItsOwnPart) {
  SelfCommunicator self;
  const std::vector<uint8_t> send = counting_bytes(99);
  std::vector<uint8_t> recv(99, 0xA5);
  const int64_t bytes[] = {99};
  self.all_to_allv(send.data(), bytes, recv.data(), bytes);
  EXPECT_EQ(recv, send);
}

TEST(SelfCommunicator, AllGatherCopiesItsOwnPart) {
  SelfCommunicator self;
  const std::vector<uint8_t> send = counting_bytes(13);
  std::vector<uint8_t> recv(13, 0xA5);
  self.all_gather(send.data(), recv.data(), 13);
  EXPECT_EQ(recv, send);
}

TEST(SelfCommunicator, ZeroLengthPartsTouchNothing) {
  SelfCommunicator self;
  const int64_t nothing[] = {0};
  // Empty parts may come without buffers at all.
  self.all_to_all(nullptr, nullptr, 0);
  self.all_to_allv(nullptr, nothing, nullptr, nothing);
  self.all_gather(nullptr, nullptr, 0);
  std::vector<int64_t> no_values;
  self.all_reduce_sum(std::span<int64_t>(no_values));
  self.barrier();
}

TEST(SelfCommunicator, AllReduceSumOfOneRankKeepsTheValues) {
  SelfCommunicator self;
  std::vector<int64_t> counts = {3, -1, int64_t{1} << 40};
  std::vector<double> sums = {0.5, -2.25};
  self.all_reduce_sum(std::span<int64_t>(counts));
  self.all_reduce_sum(std::span<double>(sums));
  EXPECT_EQ(counts, (std::vector<int64_t>{3, -1, int64_t{1} << 40}));
  EXPECT_EQ(sums, (std::vector<double>{0.5, -2.25}));
}

TEST(SelfCommunicator, RefusesBadCounts) {
  SelfCommunicator self;
  uint8_t send[8] = {};
  uint8_t recv[8] = {};
  const int64_t two_ranks[] = {4, 4};
  const int64_t four[] = {4};
  const int64_t eight[] = {8};
  const int64_t negative[] = {-1};
  EXPECT_THROW(self.all_to_allv(send, two_ranks, recv, four), Error);
  EXPECT_THROW(self.all_to_allv(send, four, recv, two_ranks), Error);
  EXPECT_THROW(self.all_to_allv(send, four, recv, eight), Error);  // sends 4, expects 8
  EXPECT_THROW(self.all_to_allv(send, negative, recv, negative), Error);
  EXPECT_THROW(self.all_to_all(send, recv, -1), Error);
  EXPECT_THROW(self.all_gather(send, recv, -1), Error);
}

TEST(World, HaveMpiSaysHowThisWasBuilt) {
#if MOE_HAVE_MPI
  EXPECT_TRUE(have_mpi());
#else
  EXPECT_FALSE(have_mpi());
#endif
}

TEST(World, WithoutALauncherIsOneRank) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"))
    GTEST_SKIP() << "launched by mpirun";
  Communicator& job = world();
  EXPECT_EQ(job.size(), 1);
  EXPECT_EQ(job.rank(), 0);
  EXPECT_EQ(job.name(), have_mpi() ? "mpi" : "self");  // MPI starts a singleton
  EXPECT_EQ(&world(), &job);
}

#if !MOE_HAVE_MPI
TEST(World, WithoutMpiRefusesALaunchOfSeveralRanks) {
  ASSERT_EQ(setenv("OMPI_COMM_WORLD_SIZE", "3", /*overwrite=*/1), 0);
  try {
    world();
    ADD_FAILURE() << "world() accepted rank 1 of 3 in a build without MPI";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("libopenmpi-dev"), std::string::npos) << error.what();
  }
  unsetenv("OMPI_COMM_WORLD_SIZE");
}
#endif

}  // namespace
}  // namespace moeinfer::parallel
