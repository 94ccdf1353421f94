# A/B of the host regime, interleaved, pinned: old = main fb59c40's library (ab15.patch reverted), new = this tree;
# the benches' own code is the same in both
b=build-gpu
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
gcc -O2 -shared -fPIC -o /tmp/libsampler.so .gl/sampler.c -lrt || echo "sampler build failed"
lscpu | grep -E "Model name" | head -1
cp $b/bench/linear/shardline-linear-bench /tmp/lin_new; cp $b/bench/host/shardline-host-bench /tmp/hb_new
t0=$(date +%s)
patch -R -p1 < .gl/ab15.patch > /dev/null && ninja -C $b -j16 shardline-linear-bench shardline-host-bench > $OUT/build_old.log 2>&1; echo "old build rc=$? $(( $(date +%s) - t0 )) s"
cp $b/bench/linear/shardline-linear-bench /tmp/lin_old; cp $b/bench/host/shardline-host-bench /tmp/hb_old
patch -p1 < .gl/ab15.patch > /dev/null; echo "patch re-applied rc=$?"
H="--device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 5000"
for r in 1 2 3; do
  for v in old new; do
    $pin /tmp/lin_$v --regimes host > $OUT/host_${v}_$r.log 2>&1; echo "lin $v $r rc=$?"
    $pin /tmp/hb_$v $H > $OUT/hb_${v}_$r.log 2>&1; echo "hb $v $r rc=$?"
  done
done
python3 - $OUT <<'PY'
import re,sys,statistics
out=sys.argv[1]
for kind in ['host','hb']:
  rows={}; order=[]
  for v in ['old','new']:
    for r in [1,2,3]:
      for line in open(f'{out}/{kind}_{v}_{r}.log'):
        m=re.match(r'host (.*?)\s+([\d.]+) us per call(?:,\s+([\d.]+) heap)?',line)
        if m:
          k=m.group(1).strip()
          if k not in order: order.append(k)
          rows.setdefault(k,{}).setdefault(v,[]).append(float(m.group(2)) if True else 0)
  print('==', kind)
  for k in order:
    o=rows[k].get('old',[]); n=rows[k].get('new',[])
    mo=statistics.median(o) if o else float('nan'); mn=statistics.median(n) if n else float('nan')
    print(f"{k[:50]:50s} old {' '.join('%.2f'%x for x in o):20s} new {' '.join('%.2f'%x for x in n):20s} med {mo:.2f} -> {mn:.2f} ({mn-mo:+.2f})")
PY
grep "heap" $OUT/hb_old_1.log $OUT/hb_new_1.log | sed 's/.*host //'
SAMPLER_OUT=$OUT/samples_new.txt SAMPLER_US=200 LD_PRELOAD=/tmp/libsampler.so $pin /tmp/hb_new --device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 20000 --only "fwd+bwd autograd (Linear)" > $OUT/prof_new.log 2>&1
SAMPLER_OUT=$OUT/samples_old.txt SAMPLER_US=200 LD_PRELOAD=/tmp/libsampler.so $pin /tmp/hb_old --device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 20000 --only "fwd+bwd autograd (Linear)" > $OUT/prof_old.log 2>&1
for v in old new; do python3 .gl/sampler_report.py $OUT/samples_$v.txt --top 40 > $OUT/report_$v.txt 2>&1; echo "== prof $v"; grep host $OUT/prof_$v.log; sed -n '/== leaf library/,/== self/p' $OUT/report_$v.txt | head -8; sed -n '/== callers/,$p' $OUT/report_$v.txt | head -40; done
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/*.txt $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
