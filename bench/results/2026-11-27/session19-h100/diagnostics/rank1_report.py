import re, sys, statistics, glob
out = sys.argv[1]
def rows(f):
    r = {}
    for line in open(f):
        m = re.match(r'host (.*?)\s+([\d.]+) us per call(?:,\s+([\d.]+) heap)?', line)
        if m: r[m.group(1).strip()] = (float(m.group(2)), m.group(3))
    return r
def paired(prefix, n, label):
    o = [rows(f'{out}/{prefix}_old_{r}.log') for r in range(1, n + 1)]
    w = [rows(f'{out}/{prefix}_new_{r}.log') for r in range(1, n + 1)]
    for k in o[0]:
        ov = [x[k][0] for x in o]; nv = [x[k][0] for x in w if k in x]
        if len(nv) != len(ov): continue
        d = [b - a for a, b in zip(ov, nv)]
        print(f"{label} {k}: old {' '.join('%.2f' % x for x in ov)} (allocs {o[0][k][1]})")
        print(f"{label} {k}: new {' '.join('%.2f' % x for x in nv)} (allocs {w[0][k][1]})")
        print(f"{label} {k}: median {statistics.median(ov):.2f} -> {statistics.median(nv):.2f}, paired diff median {statistics.median(d):+.2f} ({min(d):+.2f}..{max(d):+.2f}), new faster in {sum(x < 0 for x in d)} of {len(d)}")
paired('ag', 8, 'k256')
for s in ['4096x14336', '4096x4096']:
    o = [rows(f) for f in sorted(glob.glob(f'{out}/big_old_{s}_*.log'))]
    w = [rows(f) for f in sorted(glob.glob(f'{out}/big_new_{s}_*.log'))]
    for k in o[0]:
        ov = [x[k][0] for x in o if k in x]; nv = [x[k][0] for x in w if k in x]
        print(f"{s} {k[:44]:44s} old {' '.join('%.1f' % x for x in ov):24s} new {' '.join('%.1f' % x for x in nv):24s} median {statistics.median(ov):.1f} -> {statistics.median(nv):.1f}")
order = []; table = {}
for v in ['old', 'new']:
    for r in [1, 2, 3]:
        for k, (val, _) in rows(f'{out}/host_{v}_{r}.log').items():
            if k not in order: order.append(k)
            table.setdefault(k, {}).setdefault(v, []).append(val)
for k in order:
    o = table[k].get('old', []); n = table[k].get('new', [])
    if o and n:
        print(f"{k[:52]:52s} old {' '.join('%.2f' % x for x in o):20s} new {' '.join('%.2f' % x for x in n):20s} med {statistics.median(o):.2f} -> {statistics.median(n):.2f}")
