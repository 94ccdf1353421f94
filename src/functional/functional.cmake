# functional: column- and row-parallel Linear forward/backward on caller-owned memory — the one parallel-Linear core,
# which autograd's parallel Functions and the nn modules call, and trainers with their own tensors and autograd too
# (docs/functional.md). It sits between dist and autograd/nn: it uses core, kernels, comm, dist and spmd, nothing above.
shardline_add_library(functional
  ${CMAKE_CURRENT_LIST_DIR}/checks.cc
  ${CMAKE_CURRENT_LIST_DIR}/linear_plan.cc
  ${CMAKE_CURRENT_LIST_DIR}/parallel_linear.cc
  ${CMAKE_CURRENT_LIST_DIR}/pipeline.cc
  ${CMAKE_CURRENT_LIST_DIR}/views.cc)
target_link_libraries(shardline_functional PUBLIC shardline_dist shardline_kernels shardline_comm shardline_spmd)
install(TARGETS shardline_functional EXPORT shardlineTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
