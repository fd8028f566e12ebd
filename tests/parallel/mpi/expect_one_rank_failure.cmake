# Runs the MPI test program with the test that fails on the last rank only, and passes when the
# job exits non-zero *and* the failure is that assertion: WILL_FAIL alone would also pass on a
# crash or on mpirun refusing to start.
# cmake -DMPIRUN=<mpirun and its flags, ;-separated> -DPROGRAM=<test_mpi_communicator> -P <this>
execute_process(
  COMMAND ${MPIRUN} ${PROGRAM} --gtest_also_run_disabled_tests
          --gtest_filter=MpiCommunicator.DISABLED_FailsOnTheLastRank
  RESULT_VARIABLE exit_code OUTPUT_VARIABLE output ERROR_VARIABLE output)
if(exit_code EQUAL 0)
  message(FATAL_ERROR "a failure on the last rank left mpirun's exit code 0:\n${output}")
endif()
if(NOT output MATCHES "\\[rank [1-9][0-9]*\\][^\n]*Failure" OR
   NOT output MATCHES "the failure this test exists to make")
  message(FATAL_ERROR "mpirun exited ${exit_code}, but not from the planted failure:\n${output}")
endif()
message(STATUS "mpirun exited ${exit_code} after the planted failure on the last rank")
