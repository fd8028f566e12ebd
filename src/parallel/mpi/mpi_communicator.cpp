#include "parallel/mpi/mpi_communicator.h"

#include <climits>
#include <memory>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace moeinfer::parallel {

void check_mpi(int code, const char* operation, std::source_location where) {
  if (code == MPI_SUCCESS) [[likely]]
    return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  detail::throw_error(where, operation, " failed: ", std::string_view(text, length),
                      " (MPI error code ", code, ")");
}

namespace {

// MPI-3 counts are int: a byte count above INT_MAX cannot be passed and is refused here.
int to_mpi_count(int64_t bytes, const char* operation, const char* what) {
  MOE_CHECK(bytes >= 0, operation, ": ", what, " is ", bytes, " bytes; it must be >= 0");
  MOE_CHECK(bytes <= INT_MAX, operation, ": ", what, " is ", bytes,
            " bytes, above MPI's count limit of ", INT_MAX,
            " bytes (2 GiB); split the batch into smaller steps");
  return static_cast<int>(bytes);
}

// Counts and their packed offsets (prefix sums) in MPI's int form, for one side of all_to_allv.
struct MpiLayout {
  std::vector<int> counts;         // [size] bytes to or from rank r
  std::vector<int> displacements;  // [size] where rank r's part starts in the buffer
};

MpiLayout to_mpi_layout(std::span<const int64_t> bytes, const char* side) {
  MpiLayout layout;
  layout.counts.reserve(bytes.size());
  layout.displacements.reserve(bytes.size());
  int64_t offset = 0;
  for (int64_t part : bytes) {
    layout.counts.push_back(to_mpi_count(part, "all_to_allv", side));
    layout.displacements.push_back(to_mpi_count(offset, "all_to_allv", "a part's offset"));
    offset += part;
  }
  return layout;
}

}  // namespace

void wait_for(MPI_Request& request, const char* operation) {
  poll_until([&] {
    int done = 0;
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), operation);
    return done != 0;
  });
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm) {
  check_mpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

MpiCommunicator::~MpiCommunicator() {
  // After MPI_Finalize no MPI call is allowed, and the duplicate went with it.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::all_to_all(const void* send, void* recv, int64_t bytes_per_rank) {
  const int count = to_mpi_count(bytes_per_rank, "all_to_all", "bytes_per_rank");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ialltoall(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_, &request),
            "MPI_Ialltoall (all_to_all)");
  wait_for(request, "MPI_Ialltoall (all_to_all)");
}

void MpiCommunicator::all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                                  std::span<const int64_t> recv_bytes) {
  start_all_to_allv(send, send_bytes, recv, recv_bytes).wait();
}

PendingOp MpiCommunicator::start_all_to_allv(const void* send, std::span<const int64_t> send_bytes,
                                             void* recv, std::span<const int64_t> recv_bytes) {
  MOE_CHECK(send_bytes.size() == static_cast<size_t>(size_) &&
                recv_bytes.size() == static_cast<size_t>(size_),
            "all_to_allv: ", send_bytes.size(), " send and ", recv_bytes.size(),
            " receive counts for ", size_, " ranks");
  // A non-blocking collective reads its count arrays until it completes: they live with it.
  struct InFlight {
    MpiLayout sends, recvs;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  auto op =
      std::make_shared<InFlight>(InFlight{.sends = to_mpi_layout(send_bytes, "a send part"),
                                          .recvs = to_mpi_layout(recv_bytes, "a receive part")});
  check_mpi(MPI_Ialltoallv(send, op->sends.counts.data(), op->sends.displacements.data(), MPI_BYTE,
                           recv, op->recvs.counts.data(), op->recvs.displacements.data(), MPI_BYTE,
                           comm_, &op->request),
            "MPI_Ialltoallv (all_to_allv)");
  return PendingOp([op] { wait_for(op->request, "MPI_Ialltoallv (all_to_allv)"); });
}

void MpiCommunicator::all_gather(const void* send, void* recv, int64_t bytes) {
  const int count = to_mpi_count(bytes, "all_gather", "bytes");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_, &request),
            "MPI_Iallgather (all_gather)");
  wait_for(request, "MPI_Iallgather (all_gather)");
}

void MpiCommunicator::all_reduce_sum(std::span<int64_t> values) {
  MOE_CHECK(values.size() <= INT_MAX, "all_reduce_sum: ", values.size(),
            " values, above MPI's count limit of ", INT_MAX);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()),
                           MPI_INT64_T, MPI_SUM, comm_, &request),
            "MPI_Iallreduce (all_reduce_sum of int64)");
  wait_for(request, "MPI_Iallreduce (all_reduce_sum of int64)");
}

void MpiCommunicator::all_reduce_sum(std::span<double> values) {
  MOE_CHECK(values.size() <= INT_MAX, "all_reduce_sum: ", values.size(),
            " values, above MPI's count limit of ", INT_MAX);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE,
                           MPI_SUM, comm_, &request),
            "MPI_Iallreduce (all_reduce_sum of double)");
  wait_for(request, "MPI_Iallreduce (all_reduce_sum of double)");
}

void MpiCommunicator::barrier() {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier (barrier)");
  wait_for(request, "MPI_Ibarrier (barrier)");
}

}  // namespace moeinfer::parallel
