b=build-gpu
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name|^CPU\(s\)|MHz" | head -4
for r in 1 2; do $pin $b/bench/linear/shardline-linear-bench --regimes host > $OUT/host_$r.log 2>&1; echo "host $r rc=$?"; grep "^host" $OUT/host_$r.log | grep -E "LinearForward  |autograd|fresh|floor|Tensor|kernels|cublasLt"; done
gzip $OUT/*.log
