# The MPI backend of shardline_comm (CPU tensors). Included by src/CMakeLists.txt when SHARDLINE_WITH_MPI is on.
target_sources(shardline_comm PRIVATE ${CMAKE_CURRENT_LIST_DIR}/mpi_communicator.cc)
