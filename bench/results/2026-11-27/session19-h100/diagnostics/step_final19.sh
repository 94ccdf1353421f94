# session 19, the final tree: the GPU tests the rank-1 kernel reaches, the README job, then the host rows (as step_host17)
b=build-gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
lscpu | grep -E "Model name" | head -1
git log --oneline -1 2>/dev/null
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-200} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | sort | uniq | head -12; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
T=300 run kernels_cuda $b/tests/kernels/shardline_kernels_tests --gtest_filter='Cuda/*Gemm*:Cuda/*Linear*:Cuda/*Outer*:Cuda/*Matmul*:Cuda/*Moe*:Cuda/*MoE*'
T=300 run cuda_all $b/tests/cuda/shardline_cuda_tests
run cuda_nn $b/tests/cuda/shardline_cuda_nn_tests
run graph_np1 mpirun --allow-run-as-root -n 1 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_nn_cuda_graph_tests_cuda
run moe_np1 mpirun --allow-run-as-root -n 1 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_nn_moe_tests_cuda
timeout 120 $b/launch/shardline-run -n 1 -- $b/examples/train_char_lm --config examples/configs/char_lm_gpu.json --steps 60 > $OUT/charlm_np1.log 2>&1; echo "charlm np1 rc=$? $(( $(date +%s) - t0 )) s"; grep -iE "step|loss" $OUT/charlm_np1.log | tail -2
mkdir -p $OUT/tlogs && mv $OUT/*.log $OUT/tlogs/ 2>/dev/null; tar czf $OUT/tests.tgz -C $OUT tlogs && rm -rf $OUT/tlogs
bash .gl/step_host17.sh
