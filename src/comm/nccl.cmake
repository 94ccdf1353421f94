# NCCL backend of shardline_comm (CUDA tensors): a non-blocking communicator for creation and splits and a blocking
# split of it for the collectives (enqueue_watch.h: the watchdog releases a call blocked inside NCCL), a communication
# stream per communicator ordered against the compute stream by events, a watchdog thread per communicator. Included
# by src/CMakeLists.txt when SHARDLINE_WITH_NCCL (which links NCCL::NCCL; CUDA::cudart and the thread library come
# through shardline_core and spdlog).
#   nccl_state.cc         op descriptions, the phase-1 wait, the watchdog, work handles
#   nccl_check.cc         the debug agreement check (SHARDLINE_COMM_CHECK)
#   nccl_collectives.cc   the issue engine (streams, events, graph capture) and the collectives
#   nccl_communicator.cc  creation, destruction, abort
#   nccl_world.cc         Split, CreateNcclWorld, FromNcclComm, the blocking split, the NVLS guard
#   enqueue_watch.h       a thread blocked inside NCCL and the watchdog's abort that releases it (header-only)
target_sources(shardline_comm PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/nccl_state.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_check.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_collectives.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_communicator.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_world.cc)
