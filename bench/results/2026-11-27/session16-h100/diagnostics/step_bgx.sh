# Experiment: the one-token step with the wgrad's bias grad fused (BGRADB) against apart (plain GEMM + column sum),
# flipped through the tuning file; interleaved, pinned.
b=build-gpu
pin=""; command -v taskset >/dev/null && pin="taskset -c 5"
lscpu | grep -E "Model name" | head -1
T=$OUT/tun; mkdir -p $T
SHARDLINE_GEMM_TUNING_FILE=$T/sep.json $pin $b/bench/linear/shardline-linear-bench --regimes host > $OUT/warm.log 2>&1; echo "warm rc=$?"
SHARDLINE_GEMM_TUNING_FILE=$T/sep.json $pin $b/bench/host/shardline-host-bench --device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 2000 > $OUT/warm_hb.log 2>&1; echo "warm hb rc=$?"
python3 - $T <<'PY'
import json,sys
t=sys.argv[1]
d=json.load(open(f'{t}/sep.json'))
n=0
for r in d['records']:
    print(r['key'][:90], r.get('epilogue'), r.get('epilogue_fused_us'), r.get('epilogue_separate_us'), r.get('kernel'), r.get('chosen_us'))
    if 'epilogue=bgradb' in r['key']:
        r['epilogue']='fused'; n+=1
json.dump(d,open(f'{t}/fus.json','w'),indent=1)
print('flipped',n)
PY
H="--device cuda --dtype bfloat16 --m 1 --k 256 --n 256 --calls 5000"
for r in 1 2 3; do
  for v in sep fus; do
    cp $T/$v.json $T/run.json
    SHARDLINE_GEMM_TUNING_FILE=$T/run.json $pin $b/bench/linear/shardline-linear-bench --regimes host > $OUT/host_${v}_$r.log 2>&1; echo "lin $v $r rc=$?"
    cp $T/$v.json $T/run.json
    SHARDLINE_GEMM_TUNING_FILE=$T/run.json $pin $b/bench/host/shardline-host-bench $H > $OUT/hb_${v}_$r.log 2>&1; echo "hb $v $r rc=$?"
  done
done
python3 - $OUT <<'PY'
import re,sys,statistics
out=sys.argv[1]
for kind in ['host','hb']:
  rows={}; order=[]
  for v in ['sep','fus']:
    for r in [1,2,3]:
      for line in open(f'{out}/{kind}_{v}_{r}.log'):
        m=re.match(r'host (.*?)\s+([\d.]+) us per call(.*)',line)
        if m:
          k=m.group(1).strip()
          if k not in order: order.append(k)
          rows.setdefault(k,{}).setdefault(v,[]).append(float(m.group(2)))
  print('==', kind)
  for k in order:
    o=rows[k].get('sep',[]); n=rows[k].get('fus',[])
    mo=statistics.median(o) if o else float('nan'); mn=statistics.median(n) if n else float('nan')
    print(f"{k[:52]:52s} sep {' '.join('%.2f'%x for x in o):20s} fus {' '.join('%.2f'%x for x in n):20s} med {mo:.2f} -> {mn:.2f} ({mn-mo:+.2f})")
PY
grep -h "plans:" $OUT/host_sep_1.log $OUT/host_fus_1.log
mkdir -p $OUT/logs && mv $OUT/*.log $OUT/logs/ 2>/dev/null; tar czf $OUT/logs.tgz -C $OUT logs tun && rm -rf $OUT/logs
