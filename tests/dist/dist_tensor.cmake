# DeviceMesh and DistTensor tests (included by tests/dist/CMakeLists.txt). Each executable runs on 2 and 4 ranks:
# BACKEND cpu moves CPU tensors over MPI (CI); BACKEND cuda moves CUDA tensors over NCCL on the GPU hosts (skips
# without GPUs).
foreach(_shardline_backend IN ITEMS cpu cuda)
  if(_shardline_backend STREQUAL "cuda" AND NOT SHARDLINE_WITH_NCCL)
    continue()
  endif()
  # Every test builds its own mesh, and NCCL communicator splits take ~1 s on 4 ranks (78 cases: ~80 s on 4xH200).
  if(_shardline_backend STREQUAL "cuda")
    set(_shardline_timeout 300)
  else()
    set(_shardline_timeout 180)
  endif()
  shardline_add_dist_test(NAME shardline_dist_mesh_tests_${_shardline_backend}
                          SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_device_mesh_test.cc
                          NP 2 4 BACKEND ${_shardline_backend} TIMEOUT 120)
  shardline_add_dist_test(NAME shardline_dist_tensor_tests_${_shardline_backend}
                          SOURCES ${CMAKE_CURRENT_LIST_DIR}/dist_redistribute_test.cc
                                  ${CMAKE_CURRENT_LIST_DIR}/dist_tensor_test.cc
                          NP 2 4 BACKEND ${_shardline_backend} TIMEOUT ${_shardline_timeout})
  if(_shardline_backend STREQUAL "cuda")
    target_compile_definitions(shardline_dist_mesh_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
    target_compile_definitions(shardline_dist_tensor_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
  endif()
endforeach()

# Autograd and the parallel modules.
shardline_add_dist_test(NAME shardline_nn_smoke_tests_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/nn_smoke_test.cc
                        NP 1 2 4 BACKEND cpu TIMEOUT 120)
# The gradient-consistency matrix (issue 5): every module's output and gradients gathered and compared with a dense
# reference, and every phase's collectives counted. CPU/MPI at np 1, 2, 4 in CI; CUDA/NCCL at np 2 and 4 on the GPU
# hosts, which adds bf16 and fp16 cases and skips on every rank without one GPU per rank.
set(_shardline_nn_gradient_sources
    ${CMAKE_CURRENT_LIST_DIR}/nn_column_parallel_linear_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/nn_row_parallel_linear_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/nn_parallel_mlp_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/nn_grouped_mlp_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/nn_data_parallel_test.cc
    ${CMAKE_CURRENT_LIST_DIR}/nn_parallel_linear_init_test.cc)
shardline_add_dist_test(NAME shardline_nn_gradient_consistency_tests_cpu SOURCES ${_shardline_nn_gradient_sources}
                        NP 1 2 4 BACKEND cpu TIMEOUT 120)
if(SHARDLINE_WITH_NCCL)
  # Meshes are built once per process; the cases themselves are small.
  shardline_add_dist_test(NAME shardline_nn_gradient_consistency_tests_cuda SOURCES ${_shardline_nn_gradient_sources}
                          NP 1 2 4 BACKEND cuda TIMEOUT 300)
  target_compile_definitions(shardline_nn_gradient_consistency_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
endif()
# Uneven shards (issue 19): the modules with a feature size tp does not divide (22 over tp 3: 8, 8, 6), against the
# dense reference, bitwise for integer operands. np 3 is the uneven run CI makes (np 4: 6, 6, 6, 4).
shardline_add_dist_test(NAME shardline_nn_uneven_tests_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/nn_uneven_test.cc
                        NP 1 2 3 4 BACKEND cpu TIMEOUT 120)
if(SHARDLINE_WITH_NCCL)
  shardline_add_dist_test(NAME shardline_nn_uneven_tests_cuda SOURCES ${CMAKE_CURRENT_LIST_DIR}/nn_uneven_test.cc
                          NP 2 3 4 BACKEND cuda TIMEOUT 300)
  target_compile_definitions(shardline_nn_uneven_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
endif()
if(SHARDLINE_WITH_NCCL)
  # A ParallelMLP fwd+bwd step captured into a CUDA graph and replayed, collectives included (issue 7); np 1 has no
  # collectives, np 2 and 4 capture NCCL's.
  shardline_add_dist_test(NAME shardline_nn_cuda_graph_tests_cuda
                          SOURCES ${CMAKE_CURRENT_LIST_DIR}/nn_cuda_graph_test.cc
                          NP 1 2 4 BACKEND cuda TIMEOUT 300)
  target_compile_definitions(shardline_nn_cuda_graph_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
endif()
# Mixture of experts (issue 16): the expert-parallel token exchange (and LocalPart) and nn::MoEMLP on (dp, ep, tp) meshes — ep 1, 2, 4
# and etp 1, 2 — against a single-rank float64 dense reference, with the exact all-to-all counts; and the moe_dispatch /
# moe_combine SPMD rules against those counts (nn_moe_spmd_test.cc).
# np 1 is the single-GPU run of the layer (ep = tp = 1) on the GPU hosts.
set(_shardline_moe_sources ${CMAKE_CURRENT_LIST_DIR}/autograd_moe_dispatch_test.cc
                           ${CMAKE_CURRENT_LIST_DIR}/nn_moe_test.cc
                           ${CMAKE_CURRENT_LIST_DIR}/nn_moe_etp_test.cc
                           ${CMAKE_CURRENT_LIST_DIR}/nn_moe_spmd_test.cc)
shardline_add_dist_test(NAME shardline_nn_moe_tests_cpu SOURCES ${_shardline_moe_sources} NP 1 2 4 BACKEND cpu
                        TIMEOUT 120)
if(SHARDLINE_WITH_NCCL)
  shardline_add_dist_test(NAME shardline_nn_moe_tests_cuda SOURCES ${_shardline_moe_sources} NP 1 2 4 BACKEND cuda
                          TIMEOUT 300)
  target_compile_definitions(shardline_nn_moe_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
endif()
