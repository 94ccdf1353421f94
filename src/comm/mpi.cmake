# The MPI backend of shardline_comm (CPU tensors). Included by src/CMakeLists.txt when SHARDLINE_WITH_MPI is on.
#   mpi_communicator.cc  state, work handles, collectives, split, FromMpiComm / CreateMpiWorld
#   mpi_check.cc         the debug agreement check (SHARDLINE_COMM_CHECK)
target_sources(shardline_comm PRIVATE ${CMAKE_CURRENT_LIST_DIR}/mpi_communicator.cc
                                     ${CMAKE_CURRENT_LIST_DIR}/mpi_check.cc)
