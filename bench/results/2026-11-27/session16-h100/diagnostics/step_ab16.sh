# A/B: old = main 8e06e5d's library (ab16.patch reverted), new = this tree (BGRADB decided warm, back to back)
b=build-gpu
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name" | head -1
cp $b/bench/linear/shardline-linear-bench /tmp/lin_new; cp $b/bench/host/shardline-host-bench /tmp/hb_new
t0=$(date +%s)
patch -R -p1 < .gl/ab16.patch > /dev/null && ninja -C $b -j16 shardline-linear-bench shardline-host-bench > $OUT/build_old.log 2>&1; echo "old build rc=$? $(( $(date +%s) - t0 )) s"
cp $b/bench/linear/shardline-linear-bench /tmp/lin_old; cp $b/bench/host/shardline-host-bench /tmp/hb_old
patch -p1 < .gl/ab16.patch > /dev/null; echo "patch re-applied rc=$?"
# decisions over the training and prefill shapes
for v in old new; do
  t1=$(date +%s)
  SHARDLINE_GEMM_TUNING_FILE=$OUT/dec_$v.json timeout 200 /tmp/lin_$v --regimes training,prefill --warmup 1 --iters 1 --rounds 1 > $OUT/dec_$v.log 2>&1; echo "dec $v rc=$? $(( $(date +%s) - t1 )) s"
done
python3 - $OUT <<'PY'
import json,sys
out=sys.argv[1]
recs={}
for v in ['old','new']:
    try: d=json.load(open(f'{out}/dec_{v}.json'))
    except Exception as e: print(v,'no file',e); continue
    for r in d['records']:
        if 'epilogue=bgradb' in r['key']:
            recs.setdefault(r['key'],{})[v]=(r.get('epilogue'),r.get('epilogue_fused_us'),r.get('epilogue_separate_us'))
nd=0
for k,v in recs.items():
    o=v.get('old'); n=v.get('new')
    diff = o and n and o[0]!=n[0]
    nd+=bool(diff)
    print(('** ' if diff else '   ')+k.split(' ld=')[0], 'old', o and '%s %.1f/%.1f'%o, 'new', n and '%s %.1f/%.1f'%n)
print('bgradb keys',len(recs),'decisions changed',nd)
PY
H="--device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 5000"
for r in 1 2 3 4 5 6 7 8; do
  for v in old new; do
    $pin /tmp/hb_$v $H --only "fwd+bwd autograd (Linear)" > $OUT/ag_${v}_$r.log 2>&1
    $pin /tmp/hb_$v $H --only "fwd+bwd kernels" > $OUT/kb_${v}_$r.log 2>&1
  done
done
for r in 1 2; do for v in old new; do $pin /tmp/lin_$v --regimes host > $OUT/host_${v}_$r.log 2>&1; echo "lin $v $r rc=$?"; done; done
python3 - $OUT <<'PY'
import re,sys,statistics,glob
out=sys.argv[1]
def val(f):
    for line in open(f):
        m=re.match(r'host (.*?)\s+([\d.]+) us per call',line)
        if m: return float(m.group(2))
for kind in ['ag','kb']:
    o=[val(f'{out}/{kind}_old_{r}.log') for r in range(1,9)]
    n=[val(f'{out}/{kind}_new_{r}.log') for r in range(1,9)]
    d=[b-a for a,b in zip(o,n)]
    print(kind,'old',' '.join('%.2f'%x for x in o))
    print(kind,'new',' '.join('%.2f'%x for x in n))
    print(kind,'median old %.2f new %.2f, paired diff median %+.2f (min %+.2f max %+.2f), new faster in %d of 8'%(statistics.median(o),statistics.median(n),statistics.median(d),min(d),max(d),sum(x<0 for x in d)))
rows={}; order=[]
for v in ['old','new']:
  for r in [1,2]:
    for line in open(f'{out}/host_{v}_{r}.log'):
      m=re.match(r'host (.*?)\s+([\d.]+) us per call(?:.*device ([\d.]+) us)?',line)
      if m:
        k=m.group(1).strip()
        if k not in order: order.append(k)
        rows.setdefault(k,{}).setdefault(v,[]).append(float(m.group(2)))
for k in order:
  print(f"{k[:52]:52s} old {' '.join('%.2f'%x for x in rows[k].get('old',[])):14s} new {' '.join('%.2f'%x for x in rows[k].get('new',[]))}")
PY
grep -h "device" $OUT/host_old_1.log $OUT/host_new_1.log | grep -i "graph" 
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/*.json $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
