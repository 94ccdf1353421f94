#!/usr/bin/env python3
"""Resolves sampler.c's output: self (leaf) and inclusive shares per function, and the leaf's library.
usage: sampler_report.py SAMPLES [--top N] [--under FUNC_SUBSTRING]"""
import bisect, collections, re, subprocess, sys

path = sys.argv[1]
top = int(sys.argv[sys.argv.index('--top') + 1]) if '--top' in sys.argv else 45
under = sys.argv[sys.argv.index('--under') + 1] if '--under' in sys.argv else None
maps, samples = [], []
for line in open(path):
    if line.startswith('M '):
        f = line[2:].split()
        if len(f) >= 6 and 'x' in f[1]:
            lo, hi = (int(x, 16) for x in f[0].split('-'))
            maps.append((lo, hi, int(f[2], 16), f[5]))
    elif line.startswith('S'):
        samples.append([int(x, 16) for x in line.split()[1:]])
maps.sort()
syms = {}
def symbols(lib):
    if lib in syms:
        return syms[lib]
    table = []
    for flags in (['-C', '--defined-only'], ['-C', '-D', '--defined-only']):
        try:
            out = subprocess.run(['nm'] + flags + [lib], capture_output=True, text=True).stdout
        except OSError:
            out = ''
        for l in out.splitlines():
            m = re.match(r'([0-9a-f]+) [tTwWiI] (.*)', l)
            if m:
                table.append((int(m.group(1), 16), m.group(2)))
    table.sort()
    syms[lib] = ([a for a, _ in table], [n for _, n in table])
    return syms[lib]
def resolve(addr):
    i = bisect.bisect_right(maps, (addr, 1 << 64)) - 1
    if i < 0 or not (maps[i][0] <= addr < maps[i][1]):
        return '?', '?'
    lo, hi, off, lib = maps[i]
    vaddr = addr - lo + off
    addrs, names = symbols(lib)
    j = bisect.bisect_right(addrs, vaddr) - 1
    name = names[j] if j >= 0 else '?'
    name = re.sub(r'\(.*', '', name)
    short = lib.rsplit('/', 1)[-1]
    return short, name if j >= 0 else short + '+?'
cache = {}
def R(a):
    if a not in cache:
        cache[a] = resolve(a)
    return cache[a]
self_c, incl_c, lib_c = collections.Counter(), collections.Counter(), collections.Counter()
callers = collections.defaultdict(collections.Counter)  # leaf function -> its nearest caller in the main binary
main_bin = maps[0][3].rsplit('/', 1)[-1] if maps else ''
WATCH = ('pthread_mutex_lock', 'pthread_mutex_unlock', 'malloc', 'free', 'operator new', '__nss_database_lookup',
         '__default_morecore', 'memcpy', 'cuVDPAUCtxCreate', 'cuMemGetAttribute_v2', 'cuEGLApiInit')
n = 0
for st in samples:
    frames = [R(a if k == 0 else a - 1) for k, a in enumerate(st)]
    frames = frames[2:]  # the handler and the signal trampoline
    if not frames:
        continue
    if under and not any(under in f[1] for f in frames):
        continue
    n += 1
    lib, fn = frames[0]
    self_c[(lib, fn)] += 1
    lib_c[lib] += 1
    for f in set(frames):
        incl_c[f] += 1
    w = next((x for x in WATCH if fn.startswith(x)), None)
    if w:
        ours = [f[1] for f in frames[1:] if f[0] == main_bin and not f[1].startswith(('operator new', 'std::'))]
        callers[w][' <- '.join(x[:70] for x in ours[:2]) if ours else '(none)'] += 1
print(f'{n} samples' + (f' under {under}' if under else ''))
print('\n== leaf library')
for (lib), c in lib_c.most_common(12):
    print(f'{100*c/n:6.1f}%  {lib}')
print('\n== self (leaf function)')
for (lib, fn), c in self_c.most_common(top):
    print(f'{100*c/n:6.1f}%  {fn[:110]}  [{lib}]')
print('\n== inclusive')
for (lib, fn), c in incl_c.most_common(top):
    print(f'{100*c/n:6.1f}%  {fn[:110]}  [{lib}]')

print('\n== callers (first two frames in the main binary) of the watched leaves')
for w, c in sorted(callers.items(), key=lambda kv: -sum(kv[1].values())):
    tot = sum(c.values())
    print(f'-- {w}: {100*tot/n:.1f}%')
    for k, v in c.most_common(8):
        print(f'   {100*v/n:5.1f}%  {k}')
