# NCCL backend of shardline_comm (CUDA tensors): non-blocking communicators, a communication stream per communicator
# ordered against the compute stream by events, a watchdog thread per communicator. Included by src/CMakeLists.txt
# when SHARDLINE_WITH_NCCL (which links NCCL::NCCL; CUDA::cudart and the thread library come through shardline_core
# and spdlog).
target_sources(shardline_comm PRIVATE ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator.cc)
