#!/usr/bin/env python3
"""Summary of a run_grouped_bench.sh directory: per case, fwd+bwd TF/s of each shardline variant and of
torch._grouped_mm / the F.linear loop, the speedup of the best shardline variant (and of `auto-device`, what a user
gets) over torch._grouped_mm, the geomean, and the fraction of the measured ceiling; forward, dgrad and wgrad µs;
host µs per forward. Losses are printed as they are. With --png, a bar chart of fwd+bwd TF/s.

    python3 bench/grouped/plot_grouped.py OUT_DIR [--png OUT_DIR/grouped.png]
"""

import argparse
import json
import math
import os
import sys


def load(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--png", default="")
    args = ap.parse_args()
    ours = load(os.path.join(args.dir, "grouped_shardline.jsonl"))
    tuning = [r for r in ours if r.get("variant") == "tuning"]  # per tuned shape class: candidates µs, winner
    ours = [r for r in ours if r.get("variant") != "tuning"]
    torch_recs = load(os.path.join(args.dir, "grouped_torch.jsonl"))
    ceiling = max((r["tflops"] for r in ours if r.get("case") == "calibration"), default=0.0)
    table = {}  # (case, impl/variant, phase) -> best median over process rounds
    for r in ours + torch_recs:
        if r.get("case") == "calibration":
            continue
        key = (r["case"], ("torch:" if r.get("impl") == "torch" else "") + r["variant"], r["phase"])
        table[key] = min(table.get(key, float("inf")), r["median_us"])
    flops = {}
    for r in ours + torch_recs:
        if r.get("case") != "calibration":
            flops[r["case"]] = 6.0 * r["rows"] * r["k"] * r["n"]
    cases = list(dict.fromkeys(r["case"] for r in ours + torch_recs if r.get("case") != "calibration"))
    variants = sorted({v for (_, v, _) in table if not v.startswith("torch:")})
    print(f"fwd+bwd bf16 TF/s (ceiling {ceiling:.0f} TF/s); speedup = torch._grouped_mm µs / shardline µs\n")
    header = ["case"] + variants + ["torch:grouped_mm", "torch:loop", "best/torch", "auto-device/torch",
                                    "auto-device-serial/torch", "best/ceiling"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    best_ratios, auto_ratios, serial_ratios = [], [], []
    for c in cases:
        row = [c]
        us = {v: table.get((c, v, "fwdbwd")) for v in variants + ["torch:grouped_mm", "torch:loop"]}
        for v in variants + ["torch:grouped_mm", "torch:loop"]:
            row.append(f"{flops[c] / us[v] * 1e-6:.0f}" if us[v] else "–")
        ours_us = [us[v] for v in variants if us[v]]
        torch_us = us["torch:grouped_mm"]
        best = min(ours_us) if ours_us else None
        if best and torch_us:
            best_ratios.append(torch_us / best)
            row.append(f"{torch_us / best:.2f}×")
        else:
            row.append("–")
        # auto-device: the backward's wgrad beside its dgrad (the default); -serial: one after the other.
        for name, ratios in (("auto-device", auto_ratios), ("auto-device-serial", serial_ratios)):
            if us.get(name) and torch_us:
                ratios.append(torch_us / us[name])
                row.append(f"{torch_us / us[name]:.2f}×")
            else:
                row.append("–")
        row.append(f"{flops[c] / best * 1e-6 / ceiling:.2f}" if best and ceiling else "–")
        print("| " + " | ".join(row) + " |")

    def geomean(v):
        return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")

    print(f"\ngeomean speedup vs torch._grouped_mm: best variant {geomean(best_ratios):.3f}×, "
          f"auto-device {geomean(auto_ratios):.3f}× (concurrent backward), auto-device-serial "
          f"{geomean(serial_ratios):.3f}×; worst case best {min(best_ratios, default=float('nan')):.3f}×")
    print("\nper phase µs (fwd / dgrad / wgrad), and host µs per forward:\n")
    for c in cases:
        for v in variants + ["torch:grouped_mm", "torch:loop"]:
            ph = [table.get((c, v, p)) for p in ("fwd", "dgrad", "wgrad")]
            if all(ph):
                host = [r.get("host_us_per_fwd") for r in ours + torch_recs
                        if r.get("case") == c and (("torch:" if r.get("impl") == "torch" else "") + r["variant"]) == v]
                print(f"  {c:18s} {v:18s} {ph[0]:9.1f} {ph[1]:9.1f} {ph[2]:9.1f}   host {min(host):.2f}")
    chosen = {}  # (case, variant) -> what ran per phase (the last process round's)
    for r in ours:
        if r.get("variant", "").startswith("auto") and r.get("phase") == "fwdbwd" and r.get("config"):
            chosen[(r["case"], r["variant"])] = r["config"]
    if chosen:
        print("\nwhat auto ran (fwd | dgrad | wgrad):\n")
        for (c, v), config in chosen.items():
            print(f"  {c:18s} {v:12s} {config}")
    if tuning:
        print("\ntuned shape classes (candidate µs per call; winner):\n")
        for r in tuning:
            times = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["candidates_us"].items(), key=lambda kv: kv[1]))
            print(f"  {r['case']:18s} {r['key']}: {r['winner']}  [{times}]")
    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("plot_grouped.py: no matplotlib, no PNG", file=sys.stderr)
            return 0
        names = variants + ["torch:grouped_mm", "torch:loop"]
        fig, ax = plt.subplots(figsize=(12, 5))
        width = 0.8 / len(names)
        for i, v in enumerate(names):
            vals = [flops[c] / table[(c, v, "fwdbwd")] * 1e-6 if table.get((c, v, "fwdbwd")) else 0 for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=v)
        if ceiling:
            ax.axhline(ceiling, color="k", linestyle="--", linewidth=0.8, label="ceiling")
        ax.set_xticks([j + 0.4 for j in range(len(cases))])
        ax.set_xticklabels(cases, rotation=20, ha="right")
        ax.set_ylabel("fwd+bwd TF/s (bf16)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
