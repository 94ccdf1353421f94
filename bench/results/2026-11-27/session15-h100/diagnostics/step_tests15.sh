b=build-gpu
export NCCL_NVLS_ENABLE=0
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-240} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | head -12; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
run pool $b/tests/cuda/shardline_cuda_pool_tests
SHARDLINE_CUDA_BLOCK_CACHE=0 run pool_nocache $b/tests/cuda/shardline_cuda_pool_tests
run cuda $b/tests/cuda/shardline_cuda_tests
run cuda_nn $b/tests/cuda/shardline_cuda_nn_tests
run graph_np1 mpirun --allow-run-as-root -n 1 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_nn_cuda_graph_tests_cuda
run gradcons_np1 mpirun --allow-run-as-root -n 1 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_nn_gradient_consistency_tests_cuda
T=300 run kernels $b/tests/kernels/shardline_kernels_tests
for r in 1 2; do $pin $b/bench/linear/shardline-linear-bench --regimes host > $OUT/host_new_$r.log 2>&1; echo "host $r rc=$?"; grep "^host" $OUT/host_new_$r.log | grep -E "LinearForward  |autograd|fresh|floor|Tensor|kernels \(|cublasLt"; done
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
