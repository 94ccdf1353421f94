#!/usr/bin/env python3
"""Summarises an ncu CSV of train_char_lm (bench/char_lm/kernel_profile.sh): the kernels of the last training step
(after the previous step's AdamW launches, through the last AdamW launch), grouped by name.

    bench/char_lm/kernel_profile_summary.py CSV
"""
import collections, csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
col = {n: i for i, n in enumerate(head)}
kernels = []  # (id, name, ns) in launch order
for r in rows:
    if r[col["Metric Name"]] == "gpu__time_duration.sum":
        kernels.append((int(r[col["ID"]]), r[col["Kernel Name"]], float(r[col["Metric Value"]].replace(",", ""))))
kernels.sort()
adam = [i for i, k in enumerate(kernels) if "AdamW" in k[1]]
# the last step: after the end of the previous step's AdamW run, through the last AdamW kernel
ends = [adam[j] for j in range(len(adam)) if j + 1 == len(adam) or adam[j + 1] != adam[j] + 1]
lo, hi = ends[-2] + 1, ends[-1] + 1
step = kernels[lo:hi]
total = sum(k[2] for k in step) / 1e6
by = collections.defaultdict(lambda: [0, 0.0])
for _, name, ns in step:
    short = name.split("(")[0][:90]
    by[short][0] += 1
    by[short][1] += ns / 1e6
print(f"last step: {len(step)} kernels, {total:.3f} ms of kernel time")
print(f"{'ms':>8} {'share':>6} {'n':>4}  kernel")
for name, (n, ms) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{ms:8.3f} {100 * ms / total:5.1f}% {n:4d}  {name}")
