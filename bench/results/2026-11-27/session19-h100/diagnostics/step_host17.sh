# the host rows of the final tree only (session 17: 2d9515d) (repeated, pinned), to see the step on another host
b=build-gpu
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name" | head -1
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
