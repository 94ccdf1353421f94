# ckpt: distributed checkpoints (DESIGN.md §9) — save named DistTensors + JSON, load onto any mesh. Uses dist (layouts,
# meshes) and comm (the agreement collectives); zlib for crc32.
find_package(ZLIB REQUIRED)
shardline_add_library(ckpt
  ${CMAKE_CURRENT_LIST_DIR}/agree.cc
  ${CMAKE_CURRENT_LIST_DIR}/host_buffer.cc
  ${CMAKE_CURRENT_LIST_DIR}/io.cc
  ${CMAKE_CURRENT_LIST_DIR}/load.cc
  ${CMAKE_CURRENT_LIST_DIR}/metadata.cc
  ${CMAKE_CURRENT_LIST_DIR}/plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/save.cc
  ${CMAKE_CURRENT_LIST_DIR}/stream.cc)
target_link_libraries(shardline_ckpt PUBLIC shardline_dist nlohmann_json::nlohmann_json PRIVATE ZLIB::ZLIB)
install(TARGETS shardline_ckpt EXPORT shardlineTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
