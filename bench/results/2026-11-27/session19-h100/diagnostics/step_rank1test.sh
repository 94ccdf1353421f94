# session 19: the last test change (17612b5 -> this tree): the new CUDA tuning test and the one-row LinearBackward test
b=build-gpu
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-200} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | sort | uniq | head -12; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
run tuning $b/tests/cuda/shardline_cuda_tests --gtest_filter='*GemmTuning*:*Gemv*'
run lbw $b/tests/kernels/shardline_kernels_tests --gtest_filter='Cuda/LinearBackward*:Cuda/Gemm*'
grep -E "RankOneBGradB|OneTokens" $OUT/*.log | grep -E "OK|FAILED" | head
