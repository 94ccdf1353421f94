# Distributed checkpoints (issue 17; included by tests/dist/CMakeLists.txt). One executable per backend: saves on
# 1×1, 1×2, 2×2 loaded on 1×1, 1×4, 2×1 (the meshes that fit the job, on sub-worlds of its first ranks), async
# saves, crash before commit, keep_last, and every corruption error on every rank. BACKEND cuda saves from and loads
# into CUDA tensors (NCCL world; np 1 needs one GPU) and skips on every rank without a GPU per rank.
foreach(_shardline_backend IN ITEMS cpu cuda)
  if(_shardline_backend STREQUAL "cuda" AND NOT SHARDLINE_WITH_NCCL)
    continue()
  endif()
  # NCCL splits cost ~1 s each on 4 ranks and the reshard case makes a sub-world per mesh.
  if(_shardline_backend STREQUAL "cuda")
    set(_shardline_ckpt_timeout 300)
  else()
    set(_shardline_ckpt_timeout 180)
  endif()
  shardline_add_dist_test(NAME shardline_dist_ckpt_tests_${_shardline_backend}
                          SOURCES ${CMAKE_CURRENT_LIST_DIR}/ckpt_checkpoint_test.cc
                                  ${CMAKE_CURRENT_LIST_DIR}/ckpt_errors_test.cc
                          NP 1 2 4 BACKEND ${_shardline_backend} TIMEOUT ${_shardline_ckpt_timeout} LIBS GTest::gmock)
  if(_shardline_backend STREQUAL "cuda")
    target_compile_definitions(shardline_dist_ckpt_tests_cuda PRIVATE SHARDLINE_DIST_TENSOR_TEST_CUDA=1)
  endif()
endforeach()

# MoE checkpoints (issues 16/17): an nn::MoEMLP with its AdamW state saved on every (dp, ep, tp) mesh of the world and
# loaded on every other, bitwise after the load and within rtol 1e-5 over the next training steps.
shardline_add_dist_test(NAME shardline_dist_ckpt_moe_tests_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/ckpt_moe_test.cc
                        NP 2 4 BACKEND cpu TIMEOUT 180)
