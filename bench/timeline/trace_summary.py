#!/usr/bin/env python3
"""Summarises a cupti_trace CSV (bench/timeline/cupti_trace.cc) of a training run, per step. A step ends with the last
of a run of consecutive kernels whose name matches the regular expression MARKER (default AdamW: the optimizer closes
every training step).
For the last STEPS steps it prints the step time (marker end to marker end), the GPU busy time (the union of kernels,
memcpys and memsets), the GEMM time (the union of GEMM kernels: names with gemm, nvjet, xmma or cutlass Gemm in them),
step / GEMM (the step against the floor of its own GEMMs, as measured inside the run), the idle gaps and the host API
calls that overlap them, and the kernels by time.

    trace_summary.py CSV [--steps 10] [--marker AdamW] [--json OUT.json]
"""
import argparse, collections, csv, json, re, shutil, statistics, subprocess

GEMM = re.compile(r"gemm|nvjet|xmma|GemmUniversal", re.IGNORECASE)


def short(name, n=70):
    name = name.replace("(anonymous namespace)::", "").replace("void ", "", 1)
    return name.split("(")[0][:n]


def union(intervals, lo, hi):
    """Total length of the union of [s, e) clipped to [lo, hi)."""
    total, cur = 0, lo
    for s, e in sorted(intervals):
        s, e = max(s, cur), min(e, hi)
        if e > s:
            total += e - s
            cur = e
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--marker", default="AdamW", help="a regular expression on kernel names")
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu, api = [], []
    for row in csv.reader(open(a.csv)):
        if len(row) < 5:
            continue
        kind, s, e, name = row[0], int(row[1]), int(row[2]), row[4]
        (gpu if kind in "KCS" else api).append((s, e, kind, name))
    gpu.sort()
    api.sort()
    # CUPTI hands kernel names over mangled: demangle them once (c++filt, where installed).
    if shutil.which("c++filt"):
        names = sorted({n for s, e, k, n in gpu if k == "K"})
        plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        if len(plain) >= len(names):
            table = dict(zip(names, plain))
            gpu = [(s, e, k, table.get(n, n)) for s, e, k, n in gpu]
    marker = re.compile(a.marker)
    ends = [e for i, (s, e, k, n) in enumerate(gpu)
            if k == "K" and marker.search(n) and (i + 1 == len(gpu) or not marker.search(gpu[i + 1][3]))]
    windows = list(zip(ends[:-1], ends[1:]))[-a.steps:]
    print(f"{len(gpu)} GPU records, {len(api)} API records, {len(ends)} step ends ({a.marker}); last {len(windows)} steps")
    if not windows:
        return
    gaps_by_site = collections.defaultdict(lambda: [0, 0.0])
    api_in_gaps = collections.defaultdict(lambda: [0, 0.0])
    kernels = collections.defaultdict(lambda: [0, 0.0])
    rows = []
    for t0, t1 in windows:
        recs = [r for r in gpu if r[1] > t0 and r[0] < t1]
        busy = union([(s, e) for s, e, k, n in recs], t0, t1)
        gemm = union([(s, e) for s, e, k, n in recs if k == "K" and GEMM.search(n)], t0, t1)
        prev_end, prev = t0, "[step start]"
        for s, e, k, n in recs:
            if k == "K":
                kernels[short(n)][0] += 1
                kernels[short(n)][1] += (min(e, t1) - max(s, t0)) / 1e3
            if s > prev_end:
                gaps_by_site[(short(prev, 50), short(n, 50))][0] += 1
                gaps_by_site[(short(prev, 50), short(n, 50))][1] += (s - prev_end) / 1e3
                for s2, e2, k2, n2 in api:
                    if e2 > prev_end and s2 < s:
                        api_in_gaps[n2][0] += 1
                        api_in_gaps[n2][1] += (min(e2, s) - max(s2, prev_end)) / 1e3
            if e > prev_end:
                prev_end, prev = e, n
        rows.append({"step_ms": (t1 - t0) / 1e6, "busy_ms": busy / 1e6, "gemm_ms": gemm / 1e6})
    n = len(rows)
    print(f"{'step ms':>8} {'busy ms':>8} {'idle ms':>8} {'GEMM ms':>8} {'other ms':>8} {'step/GEMM':>9}")
    for r in rows:
        print(f"{r['step_ms']:8.3f} {r['busy_ms']:8.3f} {r['step_ms'] - r['busy_ms']:8.3f} {r['gemm_ms']:8.3f} "
              f"{r['busy_ms'] - r['gemm_ms']:8.3f} {r['step_ms'] / r['gemm_ms']:9.3f}")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"median: step {med['step_ms']:.3f} ms, busy {med['busy_ms']:.3f}, GEMM {med['gemm_ms']:.3f}, "
          f"step / GEMM {med['step_ms'] / med['gemm_ms']:.3f}")
    print("\nidle per step by site (previous -> next), µs per step, top 15:")
    for (p, q), (c, us) in sorted(gaps_by_site.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{us / n:9.1f} {c / n:6.1f}x  {p}  ->  {q}")
    print("\nhost API time overlapping those gaps, µs per step, top 10:")
    for name, (c, us) in sorted(api_in_gaps.items(), key=lambda kv: -kv[1][1])[:10]:
        print(f"{us / n:9.1f} {c / n:6.1f}x  {name}")
    print("\nkernels, µs per step (G = counted as GEMM):")
    for name, (c, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{us / n:9.1f} {c / n:6.1f}x {'G' if GEMM.search(name) else ' '} {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"steps": rows, "median": med, "marker": a.marker,
                       "kernels_us_per_step": {k: v[1] / n for k, v in kernels.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
