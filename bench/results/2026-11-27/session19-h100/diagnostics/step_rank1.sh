# session 19: the rank-1 kernel for k = 1 GEMMs (one-token wgrad + its bias grad in one launch). GPU tests of it, the
# README job, then A/B: old = 3457b6e (ab21.patch reverted), new = this tree: host rows (one token, K = N = 256) and
# GPU-bound one-token steps at 8B shapes.
b=build-gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name" | head -1
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-200} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | sort | uniq | head -12; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
run kernels_gemm $b/tests/kernels/shardline_kernels_tests --gtest_filter='Cuda/*Gemm*:Cuda/*Linear*:Cuda/*Outer*:Cuda/*Matmul*'
run cuda_gemm $b/tests/cuda/shardline_cuda_tests --gtest_filter='*Gemm*:*Gemv*:*Linear*:*Outer*:*Graph*'
run cuda_nn $b/tests/cuda/shardline_cuda_nn_tests
run graph_np1 mpirun --allow-run-as-root -n 1 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_nn_cuda_graph_tests_cuda
run gradcons_np1 mpirun --allow-run-as-root -n 1 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_nn_gradient_consistency_tests_cuda
timeout 120 $b/launch/shardline-run -n 1 -- $b/examples/train_char_lm --config examples/configs/char_lm_gpu.json --steps 60 > $OUT/charlm_np1.log 2>&1; echo "charlm np1 rc=$? $(( $(date +%s) - t0 )) s"; grep -iE "step|loss" $OUT/charlm_np1.log | tail -2
cp $b/bench/linear/shardline-linear-bench /tmp/lin_new; cp $b/bench/host/shardline-host-bench /tmp/hb_new
t1=$(date +%s)
patch -R -p1 < .gl/ab21.patch > /dev/null && ninja -C $b -j16 shardline-linear-bench shardline-host-bench > $OUT/build_old.log 2>&1; echo "old build rc=$? $(( $(date +%s) - t1 )) s"
cp $b/bench/linear/shardline-linear-bench /tmp/lin_old; cp $b/bench/host/shardline-host-bench /tmp/hb_old
patch -p1 < .gl/ab21.patch > /dev/null; echo "patch re-applied rc=$?"
H="--device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 5000"
for r in 1 2 3 4 5 6 7 8; do
  for v in old new; do
    $pin /tmp/hb_$v $H --only "fwd+bwd autograd (Linear" > $OUT/ag_${v}_$r.log 2>&1
  done
done
# GPU-bound one-token steps (the step's GPU time exceeds its host time): 8B tp1 up (K 4096, N 14336) and o (4096²)
for r in 1 2 3; do for v in old new; do for s in "4096 14336" "4096 4096"; do set -- $s
  $pin /tmp/hb_$v --device cuda --dtype bfloat16 --m 1 --k $1 --n $2 --calls 500 --only "fwd+bwd" > $OUT/big_${v}_${1}x${2}_$r.log 2>&1
done; done; done
for r in 1 2 3; do for v in old new; do $pin /tmp/lin_$v --regimes host > $OUT/host_${v}_$r.log 2>&1; echo "lin $v $r rc=$?"; done; done
python3 .gl/rank1_report.py $OUT
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
