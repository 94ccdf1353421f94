b=build-gpu
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
command -v nm addr2line gcc | head -3
gcc -O2 -shared -fPIC -o /tmp/libsampler.so .gl/sampler.c -lrt || echo "sampler build failed"
H="$b/bench/host/shardline-host-bench --device cuda --dtype bfloat16 --m 1 --k 256 --n 256"
$pin $H --calls 5000 > $OUT/hostbench_cuda.log 2>&1; echo "hostbench rc=$?"; cat $OUT/hostbench_cuda.log | grep host
for row in "fwd+bwd autograd (Linear)" "fwd+bwd kernels (LinearBackward)" "fwd autograd (Linear, no grad)"; do
  tag=$(echo "$row" | tr -c 'a-z' '_' | cut -c1-24)
  SAMPLER_OUT=$OUT/samples_$tag.txt SAMPLER_US=${SUS:-200} LD_PRELOAD=/tmp/libsampler.so $pin $H --calls 20000 --only "$row" > $OUT/prof_$tag.log 2>&1; echo "prof $tag rc=$?"; grep host $OUT/prof_$tag.log
  python3 .gl/sampler_report.py $OUT/samples_$tag.txt --top 60 > $OUT/report_$tag.txt 2>&1; head -${RH:-70} $OUT/report_$tag.txt
done
gzip $OUT/samples_*.txt
