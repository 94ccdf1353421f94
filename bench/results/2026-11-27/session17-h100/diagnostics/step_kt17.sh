# the CUDA Tensor tests of the final tree (shardline_kernels_tests: the strides tests' CUDA cases), then the whole binary
b=build-gpu
t0=$(date +%s)
timeout 120 $b/tests/kernels/shardline_kernels_tests --gtest_filter='Cuda/TensorOnDeviceTest.*:*CudaTensorTest*:*Transpose*:TensorTest.*' --gtest_color=no > $OUT/kt_tensor.log 2>&1; echo "kt_tensor rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/kt_tensor.log | sort | uniq | head; grep -c "OK \] Cuda/TensorOnDeviceTest.StridesFollow" $OUT/kt_tensor.log
timeout 240 $b/tests/kernels/shardline_kernels_tests --gtest_color=no > $OUT/kt_all.log 2>&1; echo "kt_all rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/kt_all.log | sort | uniq | head; grep -m3 -A8 "Failure" $OUT/kt_all.log | head -30
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
