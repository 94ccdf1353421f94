# A/B: old = 660c423 (ab20.patch reverted), new = this tree (c1bf426); the GPU tests ran before, in step_tests20.sh
b=build-gpu
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name" | head -1
t0=$(date +%s)
run() { name=$1; shift; timeout ${T:-200} "$@" --gtest_color=no > $OUT/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" $OUT/$name.log | sort | uniq | head -8; grep -m3 -A10 "Failure\|what()" $OUT/$name.log | head -30; }
cp $b/bench/linear/shardline-linear-bench /tmp/lin_new; cp $b/bench/host/shardline-host-bench /tmp/hb_new
t1=$(date +%s)
patch -R -p1 < .gl/ab20.patch > /dev/null && ninja -C $b -j16 shardline-linear-bench shardline-host-bench > $OUT/build_old.log 2>&1; echo "old build rc=$? $(( $(date +%s) - t1 )) s"
cp $b/bench/linear/shardline-linear-bench /tmp/lin_old; cp $b/bench/host/shardline-host-bench /tmp/hb_old
patch -p1 < .gl/ab20.patch > /dev/null; echo "patch re-applied rc=$?"
H="--device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 5000"
for r in 1 2 3 4 5 6 7 8; do
  for v in old new; do
    $pin /tmp/hb_$v $H --only "fwd+bwd autograd (Linear)" > $OUT/ag_${v}_$r.log 2>&1
    $pin /tmp/hb_$v $H --only "no grad" > $OUT/ng_${v}_$r.log 2>&1
  done
done
for r in 1 2 3; do for v in old new; do $pin /tmp/lin_$v --regimes host > $OUT/host_${v}_$r.log 2>&1; echo "lin $v $r rc=$?"; done; done
python3 - $OUT <<'PY'
import re,sys,statistics
out=sys.argv[1]
def val(f):
    for line in open(f):
        m=re.match(r'host (.*?)\s+([\d.]+) us per call(?:,\s+([\d.]+) heap)?',line)
        if m: return float(m.group(2)), m.group(3)
for kind in ['ag','ng']:
    o=[val(f'{out}/{kind}_old_{r}.log') for r in range(1,9)]
    n=[val(f'{out}/{kind}_new_{r}.log') for r in range(1,9)]
    d=[b[0]-a[0] for a,b in zip(o,n)]
    print(kind,'old',' '.join('%.2f'%x[0] for x in o),'allocs',o[0][1])
    print(kind,'new',' '.join('%.2f'%x[0] for x in n),'allocs',n[0][1])
    print(kind,'median old %.2f new %.2f, paired diff median %+.2f (min %+.2f max %+.2f), new faster in %d of 8'%(statistics.median([x[0] for x in o]),statistics.median([x[0] for x in n]),statistics.median(d),min(d),max(d),sum(x<0 for x in d)))
rows={}; order=[]
for v in ['old','new']:
  for r in [1,2,3]:
    for line in open(f'{out}/host_{v}_{r}.log'):
      m=re.match(r'host (.*?)\s+([\d.]+) us per call',line)
      if m:
        k=m.group(1).strip()
        if k not in order: order.append(k)
        rows.setdefault(k,{}).setdefault(v,[]).append(float(m.group(2)))
for k in order:
  o=rows[k].get('old',[]); n=rows[k].get('new',[])
  print(f"{k[:52]:52s} old {' '.join('%.2f'%x for x in o):20s} new {' '.join('%.2f'%x for x in n):20s} med {statistics.median(o):.2f} -> {statistics.median(n):.2f}")
PY
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
