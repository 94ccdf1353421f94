#!/usr/bin/env python3
"""Summarises a run_tp_mlp_bench.sh result folder (tp_mlp_shardline.jsonl + tp_mlp_torch.jsonl, every TP size) as a
markdown table against the targets of shared/BENCHMARKS.md (the project's benchmark rules, outside this repository),
and draws a PNG when matplotlib is there (tables only otherwise).

    bench/tp_mlp/plot_tp_mlp.py RESULT_DIR [--png OUT.png]

Per (TP, shape, tokens, variant tp | sp): T (shardline's step, median, and p90), T_compute (the local shard's kernels
on one GPU), T_comm (the step's collectives through shardline's communicator), LB_serial = T_compute + T_comm,
LB_overlap = max(T_compute, T_comm), T / LB_serial, TF/GPU = 12·T·h·ff / tp / T and its fraction of the 8192³ GEMM
ceiling, torch DTensor's T and shardline's speedup over it, and torch.distributed's time for the same collectives
against ours. A value is the median over process rounds of each round's median.

With a one-rank run whose peer had --block (run_mlp_block_bench.sh), a second table: the MLP block against its floor
(the six GEMMs alone), torch eager and torch.compile of the same module (issue 18 item 4, target T / floor <= 1.05).

Targets: T / LB_serial <= 1.05 at 8192 tokens; >= 3x faster than DTensor at <= 2048 tokens. A missed speedup is
marked "beyond reach" where DTensor's T / LB_overlap is itself below 3 (the local compute alone takes more than a third
of DTensor's step, as at 2048 tokens on the larger shapes).
"""
import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from jsonl import records  # noqa: E402  (bench/common/jsonl.py)

FILES = ("tp_mlp_shardline.jsonl", "tp_mlp_torch.jsonl")
STEP_FIELDS = ("median_us", "p90_us", "tflops", "frac_ceiling", "t_compute_us", "t_comm_us", "t_gemm_us",
               "lb_serial_us", "lb_overlap_us", "t_over_lb_serial", "t_over_lb_overlap")
LB_TARGET = 1.05
SPEEDUP_TARGET = 3.0


def load(folder):
    """{(impl, tp, shape, tokens, variant): {field: median over rounds}}, the shapes' (h, ff), and run metadata."""
    rounds = defaultdict(lambda: defaultdict(list))
    dims = {}
    meta = {}
    for r in records(folder, FILES):
        if r.get("kind") != "case":
            continue
        key = (r["impl"], r["tp"], r["shape"], r["tokens"], r["variant"])
        for field in STEP_FIELDS:
            if isinstance(r.get(field), (int, float)):
                rounds[key][field].append(r[field])
        dims[r["shape"]] = (r["hidden"], r["ffn"])
        m = meta.setdefault(r["impl"], {})
        for field in ("device", "commit", "date", "dtype", "torch", "nccl"):
            if field in r:
                m.setdefault(field, set()).add(str(r[field]))
    med = {k: {f: statistics.median(v) for f, v in fields.items()} for k, fields in rounds.items()}
    return med, dims, meta


def fmt(v, digits=1):
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and v == v and v != 0 else "—"


def rows(med):
    """The shardline step cases (and torch-only ones), in a stable order."""
    keys = {(tp, shape, tokens, var) for (impl, tp, shape, tokens, var) in med if var in ("tp", "sp")}
    order = {"8b": 0, "70b": 1}
    return sorted(keys, key=lambda k: (k[0], order.get(k[1], 9), k[1], k[2], k[3] != "tp"))


def table(med, dims):
    """The markdown lines and the target verdicts [(case text, what, value, ok, note)]."""
    lines = [
        "| TP | shape (h/ff) | tokens | variant | T µs (p90) | T_compute | T_comm | LB_serial | LB_overlap | "
        "T/LB_serial | TF/GPU | of ceiling | DTensor T µs | speedup vs DTensor | torch comm µs | torch/ours comm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for tp, shape, tokens, var in rows(med):
        sl = med.get(("shardline", tp, shape, tokens, var), {})
        th = med.get(("torch", tp, shape, tokens, var), {})
        sl_comm = med.get(("shardline", tp, shape, tokens, "comm_" + var), {}).get("median_us")
        th_comm = med.get(("torch", tp, shape, tokens, "comm_" + var), {}).get("median_us")
        t = sl.get("median_us")
        speedup = th["median_us"] / t if t and th.get("median_us") else None
        comm_ratio = th_comm / sl_comm if th_comm and sl_comm else None
        ratio = sl.get("t_over_lb_serial")
        h, ff = dims.get(shape, (0, 0))
        lines.append(
            f"| {tp} | {shape} ({h}/{ff}) | {tokens} | {var} | {fmt(t)} ({fmt(sl.get('p90_us'))}) | "
            f"{fmt(sl.get('t_compute_us'))} | {fmt(sl.get('t_comm_us'))} | {fmt(sl.get('lb_serial_us'))} | "
            f"{fmt(sl.get('lb_overlap_us'))} | {fmt(ratio, 3)} | {fmt(sl.get('tflops'))} | "
            f"{fmt(sl.get('frac_ceiling'), 3)} | {fmt(th.get('median_us'))} | {fmt(speedup, 2)} | {fmt(th_comm)} | "
            f"{fmt(comm_ratio, 3)} |")
        case = f"tp {tp} {shape} {tokens} tokens {var}"
        if tokens >= 8192:
            verdicts.append((case, "T/LB_serial", ratio, ratio is not None and ratio <= LB_TARGET, ""))
        if tokens <= 2048:
            # Where even LB_overlap is above DTensor's T / 3, no schedule of these kernels and collectives can meet it.
            lb = sl.get("lb_overlap_us")
            note = ""
            if speedup is not None and lb and th["median_us"] / lb < SPEEDUP_TARGET:
                note = f"beyond reach: DTensor T / LB_overlap = {th['median_us'] / lb:.2f}"
            verdicts.append((case, "speedup vs DTensor", speedup, speedup is not None and speedup >= SPEEDUP_TARGET,
                             note))
    return lines, verdicts


BLOCK_TARGET = 1.05


def block_table(med, dims):
    """Issue 18 item 4, from a one-rank run with the peer's --block: the MLP block's fwd+bwd against its floor (the six
    GEMMs alone, t_gemm_us), with torch eager and torch.compile of the same module. [] when there is no such run."""
    keys = sorted({(shape, tokens) for (impl, tp, shape, tokens, var) in med
                   if impl == "torch" and tp == 1 and var in ("eager", "compile")})
    if not keys:
        return [], []
    lines = ["| shape (h/ff) | tokens | floor: six GEMMs µs | shardline T µs | T/floor | torch eager µs | eager/floor | "
             "torch.compile µs | compile/floor | shardline vs eager | vs compile |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for shape, tokens in keys:
        sl = med.get(("shardline", 1, shape, tokens, "tp"), {})
        eager = med.get(("torch", 1, shape, tokens, "eager"), {}).get("median_us")
        comp = med.get(("torch", 1, shape, tokens, "compile"), {}).get("median_us")
        t, floor = sl.get("median_us"), sl.get("t_gemm_us")
        r = (lambda a: a / floor if a and floor else None)
        s = (lambda a: a / t if a and t else None)
        h, ff = dims.get(shape, (0, 0))
        lines.append(f"| {shape} ({h}/{ff}) | {tokens} | {fmt(floor)} | {fmt(t)} | {fmt(r(t), 3)} | {fmt(eager)} | "
                     f"{fmt(r(eager), 3)} | {fmt(comp)} | {fmt(r(comp), 3)} | {fmt(s(eager), 2)} | {fmt(s(comp), 2)} |")
        verdicts.append((f"{shape} {tokens} tokens", r(t)))
    return lines, verdicts


def plot(med, dims, meta, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no PNG written to {png})", file=sys.stderr)
        return False
    cases = rows(med)
    panels = sorted({(tp, shape) for tp, shape, _, _ in cases}, key=lambda p: (p[0], {"8b": 0, "70b": 1}.get(p[1], 9)))
    if not panels:
        return False
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 8), squeeze=False)
    series = (("T shardline", "shardline", "median_us"), ("LB_serial", "shardline", "lb_serial_us"),
              ("LB_overlap", "shardline", "lb_overlap_us"), ("T DTensor", "torch", "median_us"))
    for col, (tp, shape) in enumerate(panels):
        mine = [c for c in cases if c[0] == tp and c[1] == shape]
        labels = [f"{c[2]}\n{c[3]}" for c in mine]
        width = 0.8 / len(series)
        for s, (label, impl, field) in enumerate(series):
            ys = [med.get((impl,) + c, {}).get(field, 0.0) for c in mine]
            axes[0][col].bar([i + s * width for i in range(len(mine))], ys, width, label=label)
        for s, (label, impl) in enumerate((("shardline", "shardline"), ("DTensor", "torch"))):
            ys = [med.get((impl,) + c, {}).get("tflops", 0.0) for c in mine]
            axes[1][col].bar([i + s * 0.4 for i in range(len(mine))], ys, 0.4, label=label)
        h, ff = dims.get(shape, (0, 0))
        axes[0][col].set_title(f"TP {tp}, {shape} (h {h}, ff {ff}): step time (µs)")
        axes[0][col].set_yscale("log")
        axes[1][col].set_title(f"TP {tp}, {shape}: TF/s per GPU")
        for row, centre in ((0, 0.4 - width / 2), (1, 0.2)):
            axes[row][col].set_xticks([i + centre for i in range(len(mine))])
            axes[row][col].set_xticklabels(labels, fontsize=8)
            axes[row][col].set_xlabel("tokens / variant")
            axes[row][col].legend(fontsize=7)
    sl = meta.get("shardline", {})
    fig.suptitle(f"ParallelMLP fwd+bwd bf16 — {', '.join(sorted(sl.get('device', {'?'})))} — commit "
                 f"{', '.join(sorted(sl.get('commit', {'?'})))} {', '.join(sorted(sl.get('date', {'?'})))}")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--png")
    args = ap.parse_args()
    med, dims, meta = load(args.folder)
    if not med:
        sys.exit(f"plot_tp_mlp.py: no case records in {args.folder}/{{{','.join(FILES)}}}")
    for impl in ("shardline", "torch"):
        m = meta.get(impl)
        if m:
            print(f"- {impl}: " + "; ".join(f"{k} {', '.join(sorted(v))}" for k, v in sorted(m.items())))
    print("- TF/GPU = 12·tokens·h·ff / tp / T (fwd 2·T·h·ff + bwd 4·T·h·ff per Linear, two Linears); T_compute: the "
          "local shard's kernels without collectives; T_comm: the step's collectives at its sizes "
          "(tp: 2 all-reduce of [T, h]; sp: 2 × (all-gather + reduce-scatter) of [T, h]).")
    print()
    lines, verdicts = table(med, dims)
    print("\n".join(lines))
    print()
    for what, target in (("T/LB_serial", f"<= {LB_TARGET} at 8192 tokens"),
                         ("speedup vs DTensor", f">= {SPEEDUP_TARGET}x at <= 2048 tokens")):
        vs = [v for v in verdicts if v[1] == what and v[2] is not None]
        no_data = sum(1 for v in verdicts if v[1] == what and v[2] is None)
        if not vs and not no_data:
            continue
        missed = [v for v in vs if not v[3]]
        print(f"- target {what} {target}: {len(vs) - len(missed)}/{len(vs)} cases met"
              + ("" if not missed else "; missed: " + ", ".join(
                  f"{c} ({fmt(x, 3)}{'; ' + note if note else ''})" for c, _, x, _, note in missed))
              + (f"; {no_data} case(s) without data" if no_data else ""))
    block, block_verdicts = block_table(med, dims)
    if block:
        print("\n### The MLP block on one GPU against its floor (issue 18 item 4)\n")
        print("\n".join(block))
        print()
        missed = [(c, x) for c, x in block_verdicts if x is None or x > BLOCK_TARGET]
        print(f"- target T/floor <= {BLOCK_TARGET}: {len(block_verdicts) - len(missed)}/{len(block_verdicts)} cases "
              "met" + ("" if not missed else "; missed: " + ", ".join(f"{c} ({fmt(x, 3)})" for c, x in missed)))
    if args.png and plot(med, dims, meta, args.png):
        print(f"\n![tp_mlp]({Path(args.png).name})")


if __name__ == "__main__":
    main()
