#!/usr/bin/env python3
"""Turns a run_comm_bench.sh result folder (comm_shardline.jsonl + comm_torch.jsonl) into a PNG (bus bandwidth and
latency against message size, shardline vs torch.distributed) and prints a markdown table at chosen sizes.

    bench/comm/plot_comm.py RESULT_DIR [--png OUT.png] [--sizes 8,65536,16777216,67108864,1073741824]

Each JSON line is one round of one (op, bytes); the median over rounds is reported, as run_comm_bench.sh does.
"""
import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def load(folder):
    runs = defaultdict(list)  # (impl, op, bytes) -> [record]
    meta = {}
    for name in ("comm_shardline.jsonl", "comm_torch.jsonl"):
        for line in (Path(folder) / name).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                runs[(r["impl"], r["op"], r["bytes"])].append(r)
                if r["impl"] == "shardline":
                    meta = {k: r[k] for k in ("device", "ranks", "commit", "date", "dtype")}
    med = {k: (statistics.median(x["median_us"] for x in v), statistics.median(x["busbw"] for x in v))
           for k, v in runs.items()}
    return med, meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--png")
    ap.add_argument("--sizes", default="8,65536,16777216,67108864,1073741824")
    args = ap.parse_args()
    med, meta = load(args.folder)
    ops = sorted({op for (_, op, _) in med})
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{meta['ranks']} x {meta['device']}, {meta['dtype']}, commit {meta['commit']}, {meta['date']}")
    print("| op | bytes | shardline µs | torch µs | shardline busbw GB/s | torch busbw GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for op in ops:
        for b in sizes:
            if ("shardline", op, b) in med and ("torch", op, b) in med:
                (su, sb), (tu, tb) = med[("shardline", op, b)], med[("torch", op, b)]
                ratio = sb / tb if tb > 0 else float("nan")
                print(f"| {op} | {b} | {su:.1f} | {tu:.1f} | {sb:.1f} | {tb:.1f} | {ratio:.3f} |")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(2, len(ops), figsize=(5 * len(ops), 7), squeeze=False)
        for i, op in enumerate(ops):
            for impl, style in (("shardline", "o-"), ("torch", "s--")):
                pts = sorted((b, v) for (im, o, b), v in med.items() if im == impl and o == op)
                xs = [b for b, _ in pts]
                axes[0][i].plot(xs, [v[1] for _, v in pts], style, label=impl, markersize=3)
                axes[1][i].plot(xs, [v[0] for _, v in pts], style, label=impl, markersize=3)
            axes[0][i].set_title(f"{op} busbw (GB/s)")
            axes[1][i].set_title(f"{op} median time (µs)")
            for row in (0, 1):
                axes[row][i].set_xscale("log", base=2)
                axes[row][i].set_xlabel("bytes")
                axes[row][i].legend()
            axes[1][i].set_yscale("log")
        fig.suptitle(f"{meta['ranks']} x {meta['device']} {meta['dtype']} — commit {meta['commit']} {meta['date']}")
        fig.tight_layout()
        fig.savefig(args.png, dpi=90)


if __name__ == "__main__":
    main()
