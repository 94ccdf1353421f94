# shardline-spmd: one JSON request in (stdin or a file), one JSON answer out. Included from tools/CMakeLists.txt.

add_executable(shardline-spmd ${CMAKE_CURRENT_LIST_DIR}/shardline_spmd.cc)
target_link_libraries(shardline-spmd PRIVATE shardline::spmd CLI11::CLI11 nlohmann_json::nlohmann_json
                                             $<BUILD_INTERFACE:shardline_warnings>)
install(TARGETS shardline-spmd EXPORT shardlineTargets RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
