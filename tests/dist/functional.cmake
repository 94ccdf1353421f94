# The functional layer's tests (included by tests/dist/CMakeLists.txt). Every rank builds the full tensors from one seed,
# takes its shard, calls the functional API, gathers the results and compares them with a single-rank dense float64
# reference, and asserts each call's collectives from the tp group's counters. BACKEND cpu (MPI) runs in CI at np 1, 2
# and 4; BACKEND cuda (NCCL) runs on the GPU hosts at np 2 and 4 and skips on every rank without one GPU per rank.
set(_shardline_functional_sources
    ${CMAKE_CURRENT_LIST_DIR}/functional_test_util.cc
    ${CMAKE_CURRENT_LIST_DIR}/functional_column_parallel_linear_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/functional_row_parallel_linear_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/functional_linear_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/functional_linear_error_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/functional_overlap_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/functional_pipeline_test.cc)
shardline_add_dist_test(NAME shardline_dist_functional_tests_cpu SOURCES ${_shardline_functional_sources}
                        NP 1 2 4 BACKEND cpu TIMEOUT 90 LIBS shardline::functional)
if(SHARDLINE_WITH_NCCL)
  # Meshes are built once per process (NCCL splits take ~1 s on 4 ranks).
  shardline_add_dist_test(NAME shardline_dist_functional_tests_cuda SOURCES ${_shardline_functional_sources}
                          NP 2 4 BACKEND cuda TIMEOUT 180 LIBS shardline::functional)
  target_compile_definitions(shardline_dist_functional_tests_cuda PRIVATE SHARDLINE_FUNCTIONAL_TEST_CUDA=1)
endif()
