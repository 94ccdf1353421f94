b=build-gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-200} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | sort | uniq | head -8; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
run pool $b/tests/cuda/shardline_cuda_pool_tests
SHARDLINE_CUDA_BLOCK_CACHE=0 run pool_nocache $b/tests/cuda/shardline_cuda_pool_tests
run cuda_nn $b/tests/cuda/shardline_cuda_nn_tests
run kernels_sub $b/tests/kernels/shardline_kernels_tests --gtest_filter='*Linear*:*Dispatch*:*Provider*:*BiasGrad*'
run cuda $b/tests/cuda/shardline_cuda_tests
for t in nn_cuda_graph nn_gradient_consistency; do run ${t}_np2 mpirun --allow-run-as-root -n 2 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_${t}_tests_cuda; done
timeout 120 $b/launch/shardline-run -n 2 -- $b/examples/train_char_lm --config examples/configs/char_lm_gpu.json --steps 60 > $OUT/charlm_np2.log 2>&1; echo "charlm np2 rc=$? $(( $(date +%s) - t0 )) s"; grep -iE "step|loss" $OUT/charlm_np2.log | tail -3
$pin $b/bench/linear/shardline-linear-bench --regimes host > $OUT/host_final.log 2>&1; echo "host rc=$?"; grep "^host" $OUT/host_final.log | grep -E "LinearForward  |autograd|fresh|floor: empty|Tensor|cublasLt"
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
