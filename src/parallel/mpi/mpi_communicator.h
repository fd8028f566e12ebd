// The Communicator over MPI: CPU ranks launched by mpirun, on one host or several. Parts travel
// as MPI_BYTE. MPI-3 counts and displacements are `int` (Open MPI 4 has no MPI-4 large-count
// calls), so a part or a ragged buffer offset above INT_MAX bytes is refused with an error that
// names the size, rather than sent in chunks: the caller's batch is what should shrink, and the
// refusal happens on every rank alike before any byte moves.
//
// The communicator works on its own duplicate of the given MPI_Comm, with MPI_ERRORS_RETURN as its
// error handler: MPI's default handler aborts the job, which would hide the failing operation's
// name, and the duplicate keeps that choice (and our traffic) away from the caller's comm.
#pragma once

// The C API only: Open MPI's and MPICH's mpi.h otherwise pull in the deprecated C++ bindings,
// which MPI::MPI_C does not link.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <source_location>

#include "parallel/communicator.h"

namespace moeinfer::parallel {

class MpiCommunicator final : public Communicator {
 public:
  // MPI must be initialised (world() does it); `comm` stays the caller's.
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  void all_to_all(const void* send, void* recv, int64_t bytes_per_rank) override;
  void all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                   std::span<const int64_t> recv_bytes) override;
  PendingOp start_all_to_allv(const void* send, std::span<const int64_t> send_bytes, void* recv,
                              std::span<const int64_t> recv_bytes) override;
  void all_gather(const void* send, void* recv, int64_t bytes) override;
  void all_reduce_sum(std::span<int64_t> values) override;
  void all_reduce_sum(std::span<double> values) override;
  void barrier() override;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;  // our duplicate, freed in the destructor
  int rank_ = 0;
  int size_ = 1;
};

// Waits for `request` (a non-blocking operation's) without holding a core: every operation here
// is started non-blocking and waited for by this (parallel::poll_until over MPI_Test).
void wait_for(MPI_Request& request, const char* operation);

// Throws moeinfer::Error naming `operation` and MPI's text for `code` unless it is MPI_SUCCESS.
void check_mpi(int code, const char* operation,
               std::source_location where = std::source_location::current());

}  // namespace moeinfer::parallel
