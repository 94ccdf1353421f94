# DeviceMesh: an N-d mesh over the world communicator, one sub-communicator per mesh dim (created on first use).
target_sources(shardline_comm PRIVATE ${CMAKE_CURRENT_LIST_DIR}/device_mesh.cc)
