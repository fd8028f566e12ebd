// world(): the job this process was launched as.
//
// With MPI built in, MPI is always initialised on the first call, even without mpirun (MPI then
// starts a singleton of one rank, and world() is an MpiCommunicator of size 1). We do not guess
// from the environment whether a launcher started us: a guess that missed a launcher would split
// one job into several jobs of one rank each, silently. Without MPI the environment is the only
// evidence, so a launch of several ranks is refused there rather than run as N lone ranks.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "parallel/communicator.h"

#if MOE_HAVE_MPI
#include "parallel/mpi/mpi_communicator.h"
#endif

namespace moeinfer::parallel {

bool have_mpi() {
#if MOE_HAVE_MPI
  return true;
#else
  return false;
#endif
}

namespace {

#if MOE_HAVE_MPI

void finalize_mpi_at_exit() {
  int initialized = 0;
  int finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

// SERIALIZED, not FUNNELED: the engine's step loop may call collectives from a thread other
// than main, though never two at once.
void init_mpi_serialized() {
  int finalized = 0;
  check_mpi(MPI_Finalized(&finalized), "MPI_Finalized");
  MOE_CHECK(!finalized, "parallel::world(): MPI was already finalised in this process");
  int initialized = 0;
  check_mpi(MPI_Initialized(&initialized), "MPI_Initialized");
  int provided = MPI_THREAD_SINGLE;
  if (initialized) {
    // Whoever initialised MPI also finalises it.
    check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread");
  } else {
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided),
              "MPI_Init_thread");
    // Registered before the world communicator exists, so it runs after that static's
    // destructor has freed the communicator.
    std::atexit(finalize_mpi_at_exit);
  }
  MOE_CHECK(provided >= MPI_THREAD_SERIALIZED, "parallel::world(): MPI provides thread level ",
            provided, ", below MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED,
            "), which the engine needs to call collectives from its step thread; use an MPI "
            "built with thread support (Debian's libopenmpi-dev is)");
}

std::unique_ptr<MpiCommunicator> open_mpi_world() {
  init_mpi_serialized();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
}

#else

// The number of ranks a launcher says this job has (Open MPI's mpirun, or a PMI launcher such as
// MPICH's hydra or Slurm), 1 when none says so.
int ranks_from_launcher_environment() {
  int ranks = 1;
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    if (const char* value = std::getenv(variable)) ranks = std::max(ranks, std::atoi(value));
  }
  return ranks;
}

#endif

}  // namespace

Communicator& world() {
#if MOE_HAVE_MPI
  static const std::unique_ptr<MpiCommunicator> mpi_world = open_mpi_world();
  return *mpi_world;
#else
  const int launched_ranks = ranks_from_launcher_environment();
  MOE_CHECK(launched_ranks <= 1, "this process is one of ", launched_ranks,
            " ranks launched by mpirun, but this build has no MPI: install libopenmpi-dev "
            "(scripts/install-deps.sh) and rebuild");
  static SelfCommunicator self;
  return self;
#endif
}

}  // namespace moeinfer::parallel
