#!/usr/bin/env python3
"""Where a host-bound loop's time goes, from a CUPTI trace (bench/timeline/cupti_trace.cc, CUPTI_TRACE_DRIVER=1 for the
driver calls that cuBLASLt makes): the main thread's API records split at every synchronisation call into segments;
for each segment of at least --min-records records: its wall time, the API calls by name and count, the time covered
by API calls (the union of their intervals, runtime and driver) and the rest (host work outside CUDA: the library's
own bookkeeping, cuBLASLt's host logic). Divided by --iters, the calls of the timed loop per segment.

  CUPTI_TRACE_DRIVER=1 CUPTI_TRACE_OUT=t.csv CUDA_INJECTION64_PATH=build-gpu/bench/timeline/libshardline-cupti-trace.so \\
      build-gpu/bench/linear/shardline-linear-bench --regimes host --host-calls 200
  python3 bench/timeline/host_segments.py t.csv --iters 200

CUPTI makes every API call slower (~5.5 us per launch on an H100 host against ~2-3 without it), so read the API
column as counts and relative cost; the non-API column is closer to the untraced figure. Launches count the runtime's
cudaLaunchKernel and the driver's cuLaunchKernel* (cuBLASLt's); CUPTI does not report a runtime launch's driver call.
"""
import argparse
import collections
import csv
import gzip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="trace.csv or trace.csv.gz")
    ap.add_argument("--iters", type=int, default=1, help="iterations of the timed loop in each segment")
    ap.add_argument("--min-records", type=int, default=400, help="skip shorter segments")
    ap.add_argument("--calls", type=int, default=0, help="also list the N most frequent API calls per segment")
    a = ap.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    recs = []
    with opener(a.trace, "rt") as f:
        for kind, start, end, tid, name in csv.reader(f):
            if kind in ("R", "D"):
                recs.append((int(start), int(end), kind, int(tid), name))
    if not recs:
        raise SystemExit("no API records in the trace")
    recs.sort()
    main_tid = collections.Counter(r[3] for r in recs).most_common(1)[0][0]
    segments, cur = [], []
    for r in recs:
        if r[3] != main_tid:
            continue
        cur.append(r)
        if "Synchronize" in r[4]:
            segments.append(cur)
            cur = []
    segments.append(cur)
    n = a.iters
    print(f"per iteration (--iters {n}): wall, API (union of the call intervals) and non-API µs; calls per iteration")
    print(f"{'seg':>4} {'records':>8} {'wall':>8} {'API':>7} {'non-API':>8}  launches  mallocAsync  freeAsync  "
          "eventRecord  streamWait")
    for i, seg in enumerate(segments):
        if len(seg) < a.min_records:
            continue
        wall = (seg[-1][1] - seg[0][0]) / 1e3
        spans = sorted((r[0], r[1]) for r in seg)
        covered, (cs, ce) = 0, spans[0]
        for s, e in spans[1:]:
            if s > ce:
                covered += ce - cs
                cs, ce = s, e
            else:
                ce = max(ce, e)
        covered = (covered + ce - cs) / 1e3

        def count(*prefixes):
            return sum(1 for r in seg if r[4].startswith(prefixes)) / n

        print(f"{i:4d} {len(seg):8d} {wall / n:8.2f} {covered / n:7.2f} {(wall - covered) / n:8.2f}  "
              f"{count('cuLaunchKernel', 'cudaLaunchKernel'):8.2f}  {count('cudaMallocAsync'):11.2f}  {count('cudaFreeAsync'):9.2f}  "
              f"{count('cudaEventRecord'):11.2f}  {count('cudaStreamWaitEvent'):10.2f}")
        if a.calls:
            c, t = collections.Counter(), collections.Counter()
            for r in seg:
                c[(r[2], r[4])] += 1
                t[(r[2], r[4])] += (r[1] - r[0]) / 1e3
            for key, cnt in c.most_common(a.calls):
                print(f"       {key[0]} {key[1]:42s} {cnt / n:7.2f} per iter, {t[key] / cnt:6.2f} µs each")


if __name__ == "__main__":
    main()
