# DistTensor's private sources: device-agnostic block copies and the execution of redistribute plans.
target_sources(shardline_dist PRIVATE ${CMAKE_CURRENT_LIST_DIR}/block_copy.cc ${CMAKE_CURRENT_LIST_DIR}/redistribute.cc)
# Ops on DistTensors: rule lookup, input redistribution, local kernels (ops.h).
target_sources(shardline_dist PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/ops/cross_entropy.cc
  ${CMAKE_CURRENT_LIST_DIR}/ops/elementwise.cc
  ${CMAKE_CURRENT_LIST_DIR}/ops/embedding.cc
  ${CMAKE_CURRENT_LIST_DIR}/ops/matmul.cc
  ${CMAKE_CURRENT_LIST_DIR}/ops/ops_util.cc
  ${CMAKE_CURRENT_LIST_DIR}/ops/reduction.cc)
