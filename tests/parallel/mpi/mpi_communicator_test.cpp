// MpiCommunicator as several ranks: CTest runs this program under `mpirun -np 2` and `-np 3`.
// Every rank runs the same tests in the same order, since each one calls collectives. Tests
// check with EXPECT, not ASSERT, after the collectives, so a rank that fails still takes part in
// the next call rather than leaving the others waiting. main() sums the failures over the ranks
// and every rank exits non-zero when any rank failed.
//
// Payload bytes are a hash of (source rank, destination rank, index): the receiver recomputes
// each byte, so a part from the wrong rank, at the wrong offset or of the wrong length shows.
#include "parallel/mpi/mpi_communicator.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "parallel/communicator.h"

namespace moeinfer::parallel {
namespace {

constexpr uint8_t kPoison = 0xA5;
constexpr int64_t kGuardBytes = 16;  // poisoned bytes past the end of each receive buffer

uint8_t pattern_byte(int source, int destination, int64_t index) {
  uint64_t x = (uint64_t(source) << 48) ^ (uint64_t(destination) << 32) ^ uint64_t(index);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint8_t(x);
}

// The bytes rank `source` sends to `destination`: rank 1 sends nothing at all, some pairs are
// empty (to and from several ranks), the rest have awkward sizes, and rank 0's part to the last
// rank is large enough for MPI's rendezvous protocol rather than its eager one.
int64_t part_bytes(int source, int destination, int num_ranks) {
  if (source == 1) return 0;
  if (source == 0 && destination == num_ranks - 1) return 99'989;
  if ((source + 2 * destination) % 3 == 0 && source != destination) return 0;
  return 1 + (source * 19 + destination * 7) % 99;
}

std::string error_text(const auto& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "(no error)";
}

TEST(MpiWorld, IsTheJobMpirunLaunched) {
  Communicator& job = world();
  EXPECT_TRUE(have_mpi());
  EXPECT_EQ(job.name(), "mpi");
  const char* launched_size = std::getenv("OMPI_COMM_WORLD_SIZE");
  const char* launched_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (launched_size && launched_rank) {
    EXPECT_EQ(job.size(), std::atoi(launched_size));
    EXPECT_EQ(job.rank(), std::atoi(launched_rank));
  }
  EXPECT_GE(job.size(), 2) << "run this test under mpirun -np 2 or more";
}

TEST(MpiCommunicator, AllToAllExchangesCounts) {
  Communicator& job = world();
  const int me = job.rank();
  const int n = job.size();
  std::vector<int64_t> send_counts(n);
  for (int r = 0; r < n; ++r) send_counts[r] = part_bytes(me, r, n);
  std::vector<int64_t> recv_counts(n, -7);
  job.all_to_all(send_counts.data(), recv_counts.data(), sizeof(int64_t));
  for (int r = 0; r < n; ++r) EXPECT_EQ(recv_counts[r], part_bytes(r, me, n)) << "from rank " << r;
}

TEST(MpiCommunicator, AllToAllOfNothing) { world().all_to_all(nullptr, nullptr, 0); }

TEST(MpiCommunicator, AllToAllvDeliversEveryRaggedPartFromItsSender) {
  Communicator& job = world();
  const int me = job.rank();
  const int n = job.size();

  // [n] bytes to each rank, packed in rank order.
  std::vector<int64_t> send_bytes(n);
  std::vector<uint8_t> send;
  for (int r = 0; r < n; ++r) {
    send_bytes[r] = part_bytes(me, r, n);
    for (int64_t i = 0; i < send_bytes[r]; ++i) send.push_back(pattern_byte(me, r, i));
  }
  // The receive counts come the way the engine will get them: an all_to_all of the counts.
  std::vector<int64_t> recv_bytes(n);
  job.all_to_all(send_bytes.data(), recv_bytes.data(), sizeof(int64_t));
  int64_t total_recv = 0;
  for (int64_t bytes : recv_bytes) total_recv += bytes;
  std::vector<uint8_t> recv(total_recv + kGuardBytes, kPoison);

  job.all_to_allv(send.data(), send_bytes, recv.data(), recv_bytes);

  int64_t offset = 0;
  for (int source = 0; source < n; ++source) {
    EXPECT_EQ(recv_bytes[source], part_bytes(source, me, n)) << "count from rank " << source;
    int64_t num_wrong = 0;
    int64_t first_wrong = -1;
    for (int64_t i = 0; i < recv_bytes[source]; ++i) {
      if (recv[offset + i] != pattern_byte(source, me, i)) {
        if (num_wrong++ == 0) first_wrong = i;
      }
    }
    EXPECT_EQ(num_wrong, 0) << "rank " << me << ": " << num_wrong << " of the "
                            << recv_bytes[source] << " bytes from rank " << source
                            << " are wrong, the first at index " << first_wrong;
    offset += recv_bytes[source];
  }
  for (int64_t i = 0; i < kGuardBytes; ++i)
    EXPECT_EQ(recv[total_recv + i], kPoison) << "written past the end, at guard byte " << i;
}

TEST(MpiCommunicator, AllToAllvOfNothingAtAll) {
  Communicator& job = world();
  const std::vector<int64_t> none(job.size(), 0);
  job.all_to_allv(nullptr, none, nullptr, none);
}

TEST(MpiCommunicator, AllGatherPutsEachRanksBytesInItsPlace) {
  Communicator& job = world();
  const int me = job.rank();
  const int n = job.size();
  constexpr int64_t kBytes = 13;
  std::vector<uint8_t> send(kBytes);
  for (int64_t i = 0; i < kBytes; ++i) send[i] = pattern_byte(me, n, i);  // n: to every rank
  std::vector<uint8_t> recv(n * kBytes + kGuardBytes, kPoison);

  job.all_gather(send.data(), recv.data(), kBytes);
  job.all_gather(nullptr, nullptr, 0);

  for (int source = 0; source < n; ++source) {
    for (int64_t i = 0; i < kBytes; ++i)
      EXPECT_EQ(recv[source * kBytes + i], pattern_byte(source, n, i))
          << "byte " << i << " from rank " << source;
  }
  for (int64_t i = 0; i < kGuardBytes; ++i) EXPECT_EQ(recv[n * kBytes + i], kPoison);
}

TEST(MpiCommunicator, AllReduceSumOfInt64) {
  Communicator& job = world();
  const int64_t me = job.rank();
  const int64_t n = job.size();
  constexpr int64_t kLarge = int64_t{1} << 40;  // beyond 32 bits, so int64 must travel whole
  std::vector<int64_t> values = {me, 1, kLarge * (me + 1), -me};
  job.all_reduce_sum(std::span<int64_t>(values));
  const int64_t rank_sum = n * (n - 1) / 2;
  EXPECT_EQ(values, (std::vector<int64_t>{rank_sum, n, kLarge * (rank_sum + n), -rank_sum}));

  std::vector<int64_t> none;
  job.all_reduce_sum(std::span<int64_t>(none));
}

TEST(MpiCommunicator, AllReduceSumOfDouble) {
  Communicator& job = world();
  const double me = job.rank();
  const double n = job.size();
  // Sums of halves and of integers below 2^53 are exact in any order.
  std::vector<double> values = {0.5 * me, 1.0, 1e15 + me};
  job.all_reduce_sum(std::span<double>(values));
  const double rank_sum = n * (n - 1) / 2;
  EXPECT_EQ(values[0], 0.5 * rank_sum);
  EXPECT_EQ(values[1], n);
  EXPECT_EQ(values[2], 1e15 * n + rank_sum);
}

TEST(MpiCommunicator, CollectivesFromAnotherThread) {
  // MPI_THREAD_SERIALIZED: the engine's step thread, not main, may call the collectives.
  Communicator& job = world();
  std::vector<int64_t> values = {1};
  std::thread step_thread([&] { job.all_reduce_sum(std::span<int64_t>(values)); });
  step_thread.join();
  EXPECT_EQ(values[0], job.size());
}

TEST(MpiCommunicator, Barrier) {
  Communicator& job = world();
  for (int i = 0; i < 3; ++i) job.barrier();
}

// Every rank passes the same bad arguments, so every rank refuses before any byte moves.
TEST(MpiCommunicator, RefusesMismatchedSpansAndBadCounts) {
  Communicator& job = world();
  const int n = job.size();
  const std::vector<int64_t> too_many(n + 1, 0);
  const std::vector<int64_t> too_few(n - 1, 0);
  const std::vector<int64_t> right(n, 0);
  std::vector<int64_t> negative(n, 0);
  negative[n - 1] = -1;
  std::vector<int64_t> too_large(n, 0);
  too_large[0] = int64_t{INT_MAX} + 1;

  EXPECT_THROW(job.all_to_allv(nullptr, too_many, nullptr, right), Error);
  EXPECT_THROW(job.all_to_allv(nullptr, right, nullptr, too_few), Error);
  EXPECT_THROW(job.all_to_allv(nullptr, negative, nullptr, right), Error);
  EXPECT_THROW(job.all_to_allv(nullptr, right, nullptr, negative), Error);
  EXPECT_THROW(job.all_to_all(nullptr, nullptr, -1), Error);
  EXPECT_THROW(job.all_gather(nullptr, nullptr, -1), Error);

  // Above INT_MAX bytes MPI-3 cannot count: refused, naming the size.
  const std::string large_part =
      error_text([&] { job.all_to_allv(nullptr, too_large, nullptr, right); });
  EXPECT_NE(large_part.find("2147483648"), std::string::npos) << large_part;
  const std::string large_all_to_all =
      error_text([&] { job.all_to_all(nullptr, nullptr, int64_t{INT_MAX} + 1); });
  EXPECT_NE(large_all_to_all.find("2147483648"), std::string::npos) << large_all_to_all;
  EXPECT_THROW(job.all_gather(nullptr, nullptr, int64_t{3} << 31), Error);
  // An offset past INT_MAX though each part fits: the third part's, so it takes 3 ranks.
  if (n >= 3) {
    const std::vector<int64_t> large_offsets(n, int64_t{INT_MAX} / 2 + 1);
    EXPECT_THROW(job.all_to_allv(nullptr, large_offsets, nullptr, right), Error);
  }

  job.barrier();  // all ranks are still in step
}

TEST(MpiCommunicator, AFailedMpiCallNamesTheOperationAndMpisText) {
  char mpi_text[MPI_MAX_ERROR_STRING];
  int length = 0;
  ASSERT_EQ(MPI_Error_string(MPI_ERR_TRUNCATE, mpi_text, &length), MPI_SUCCESS);
  const std::string message = error_text([] { check_mpi(MPI_ERR_TRUNCATE, "MPI_Alltoallv"); });
  EXPECT_NE(message.find("MPI_Alltoallv"), std::string::npos) << message;
  EXPECT_NE(message.find(std::string(mpi_text, length)), std::string::npos) << message;
  EXPECT_NO_THROW(check_mpi(MPI_SUCCESS, "MPI_Barrier"));
}

TEST(MpiCommunicator, ATruncatedReceiveIsAnErrorNotAnAbort) {
  // Every rank sends 8 bytes to each rank but expects 4: MPI calls the program erroneous, and
  // Open MPI reports MPI_ERR_TRUNCATE on every receiver. Our duplicate communicator returns that
  // code instead of aborting the job, and the job can go on afterwards.
  Communicator& job = world();
  const int n = job.size();
  std::vector<uint8_t> send(8 * n, 1);
  std::vector<uint8_t> recv(8 * n, 0);
  const std::vector<int64_t> send_bytes(n, 8);
  const std::vector<int64_t> recv_bytes(n, 4);
  const std::string message =
      error_text([&] { job.all_to_allv(send.data(), send_bytes, recv.data(), recv_bytes); });
  EXPECT_NE(message.find("MPI_Ialltoallv (all_to_allv) failed: MPI_ERR_TRUNCATE"), std::string::npos)
      << message;
  job.barrier();
}

// Run only by the CTest test that checks a failure on one rank makes mpirun exit non-zero.
TEST(MpiCommunicator, DISABLED_FailsOnTheLastRank) {
  Communicator& job = world();
  EXPECT_NE(job.rank(), job.size() - 1) << "the failure this test exists to make";
}

// On ranks other than 0, prints only failures, marked with the rank, instead of gtest's report.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.message());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace moeinfer::parallel

int main(int argc, char** argv) {
  using namespace moeinfer::parallel;
  ::testing::InitGoogleTest(&argc, argv);
  // world() initialises MPI once; it is finalised at exit.
  Communicator& job = world();
  if (job.rank() != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(job.rank()));
  }
  const int result = RUN_ALL_TESTS();
  std::vector<int64_t> num_failed_ranks = {result != 0 ? 1 : 0};
  job.all_reduce_sum(std::span<int64_t>(num_failed_ranks));
  if (job.rank() == 0 && num_failed_ranks[0] > 0)
    std::fprintf(stderr, "%lld of %d ranks failed\n", static_cast<long long>(num_failed_ranks[0]),
                 job.size());
  return num_failed_ranks[0] > 0 ? 1 : 0;
}
