# NCCL communicator tests (included by tests/dist/CMakeLists.txt). BACKEND cuda: one GPU per rank, NCCL world; without
# enough GPUs (CI) every test skips on every rank with the reason. Run on the GPU hosts with np 2 and 4.
if(SHARDLINE_WITH_NCCL)
  shardline_add_dist_test(NAME shardline_dist_comm_nccl_tests NP 2 4 BACKEND cuda TIMEOUT 180
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_nccl_collectives_test.cc)

  # Where the collectives run: the default world's blocking communicator (its host cost) and the
  # SHARDLINE_NCCL_BLOCKING=0 switch.
  shardline_add_dist_test(NAME shardline_dist_comm_nccl_blocking_tests NP 2 4 BACKEND cuda TIMEOUT 120
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_nccl_blocking_test.cc
    LIBS GTest::gmock)

  # Faults: each test sets a 5 s timeout itself (SetCommTimeout) and makes its own communicator
  # (Communicator::CreateNcclWorld).
  shardline_add_dist_test(NAME shardline_dist_comm_nccl_fault_tests NP 2 4 BACKEND cuda TIMEOUT 120
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_nccl_fault_test.cc
    LIBS GTest::gmock)
endif()
