# Autograd and training on the CPU/MPI backend (included by tests/dist/CMakeLists.txt), on 1, 2 and 4 ranks (the
# vocab-parallel tests also on 3).
# Vocab-parallel cross-entropy and embedding gradients against the same Functions on local Variables; np 3 splits the
# vocabularies unevenly (torch.chunk).
shardline_add_dist_test(NAME shardline_autograd_vocab_parallel_tests_cpu
                        SOURCES ${CMAKE_CURRENT_LIST_DIR}/autograd_vocab_parallel_test.cc
                        NP 1 2 3 4 BACKEND cpu TIMEOUT 120)
# The 20-step SGD loss curve of ParallelMLP against a dense single-process run: TP = the world size, and in the same
# job every TP size that divides it.
shardline_add_dist_test(NAME shardline_nn_loss_curve_tests_cpu SOURCES ${CMAKE_CURRENT_LIST_DIR}/nn_loss_curve_test.cc
                        NP 1 2 4 BACKEND cpu TIMEOUT 120)
# autograd::Column/RowParallelLinear below the modules: inputs in another layout, Partial parameter gradients on a
# dp×tp mesh without GradSync, main grads beside plain gradients, skip_bias_add, errors before any collective; Add,
# BiasAdd and Mean keep only their operands' specs (and a wrong spec raises before any collective).
shardline_add_dist_test(NAME shardline_autograd_parallel_linear_tests_cpu
                        SOURCES ${CMAKE_CURRENT_LIST_DIR}/autograd_parallel_linear_test.cc
                        NP 1 2 4 BACKEND cpu TIMEOUT 120)
# autograd::ParallelMLP (the GELU in fc1's GEMM epilogue, its gradient in fc2's dgrad): float64 finite differences,
# bit-for-bit agreement with the unfused column -> Gelu -> row composition, the kernels / collectives / saved tensors of
# every subset of needed gradients, errors before any collective.
shardline_add_dist_test(NAME shardline_autograd_parallel_mlp_tests_cpu
                        SOURCES ${CMAKE_CURRENT_LIST_DIR}/autograd_parallel_mlp_test.cc
                        NP 1 2 4 BACKEND cpu TIMEOUT 120)
# autograd::ParallelMLPWithResidual (x + MLP(x), the add in fc2's GEMM and x's pass-through grad in fc1's dgrad):
# float64 finite differences, bit-for-bit agreement with Add(x, ParallelMLP(x)) for every subset of needed gradients,
# the same collectives, errors before any collective.
shardline_add_dist_test(NAME shardline_autograd_parallel_mlp_residual_tests_cpu
                        SOURCES ${CMAKE_CURRENT_LIST_DIR}/autograd_parallel_mlp_residual_test.cc
                        NP 1 2 4 BACKEND cpu TIMEOUT 120 LIBS GTest::gmock)
