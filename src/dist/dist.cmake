# DistTensor's private sources: device-agnostic block copies and the execution of redistribute plans.
target_sources(shardline_dist PRIVATE ${CMAKE_CURRENT_LIST_DIR}/block_copy.cc ${CMAKE_CURRENT_LIST_DIR}/redistribute.cc)
