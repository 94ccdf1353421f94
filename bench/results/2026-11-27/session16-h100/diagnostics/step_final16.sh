# final: the GPU tests of autograd on 2 GPUs, the README's GPU job on 2, and the host rows of the final tree (repeated)
b=build-gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name" | head -1
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-200} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | sort | uniq | head -8; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
run cuda_nn $b/tests/cuda/shardline_cuda_nn_tests
for t in nn_cuda_graph nn_gradient_consistency; do run ${t}_np2 mpirun --allow-run-as-root -n 2 -x NCCL_NVLS_ENABLE $b/tests/dist/shardline_${t}_tests_cuda; done
timeout 120 $b/launch/shardline-run -n 2 -- $b/examples/train_char_lm --config examples/configs/char_lm_gpu.json --steps 60 > $OUT/charlm_np2.log 2>&1; echo "charlm np2 rc=$? $(( $(date +%s) - t0 )) s"; grep -iE "step|loss" $OUT/charlm_np2.log | tail -3
H="--device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 5000"
for r in 1 2 3 4 5 6; do $pin $b/bench/host/shardline-host-bench $H > $OUT/hb_$r.log 2>&1; done
for r in 1 2 3 4; do $pin $b/bench/linear/shardline-linear-bench --regimes host > $OUT/host_$r.log 2>&1; echo "host $r rc=$?"; done
python3 - $OUT <<'PY'
import re,sys,statistics
out=sys.argv[1]
for kind,n in [('hb',6),('host',4)]:
  rows={}; order=[]
  for r in range(1,n+1):
    for line in open(f'{out}/{kind}_{r}.log'):
      m=re.match(r'host (.*?)\s+([\d.]+) us per call',line)
      if m:
        k=m.group(1).strip()
        if k not in order: order.append(k)
        rows.setdefault(k,[]).append(float(m.group(2)))
  print('==',kind)
  for k in order:
    v=rows[k]; print(f"{k[:52]:52s} {' '.join('%.2f'%x for x in v):40s} median {statistics.median(v):.2f} min {min(v):.2f}")
PY
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
