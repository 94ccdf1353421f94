#!/usr/bin/env python3
"""Summarises a run_linear_bench.sh result folder (linear_shardline.jsonl + linear_torch.jsonl) against the targets of
shared/BENCHMARKS.md (the project's benchmark rules, outside this repository) as markdown tables, and draws a PNG.

    bench/linear/plot_linear.py RESULT_DIR [--png OUT.png]

A case's time is the median over process rounds of each round's median. Targets:
  fwd+bwd bf16, M >= 2048: geomean >= 1.05x torch, every shape >= 0.98x; training shapes >= 0.90 of the ceiling;
  forward with bias <= 1.02x the plain GEMM; decode (M <= 32) <= 1.25x the weight-streaming floor + 3 us;
  host <= 6 us per forward call, <= 25 us per fwd+bwd, <= 3 us per op under a CUDA graph.
"""
import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "common"))
from jsonl import records  # noqa: E402  (bench/common/jsonl.py)

ES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}


def load(folder):
    times = defaultdict(list)  # (impl/provider, regime, shape, m, dtype, variant) -> [median_us]
    host = defaultdict(list)   # (impl, what) -> [record]
    plans = {}
    calib = defaultdict(list)
    meta = {}
    for r in records(folder, ("linear_shardline.jsonl", "linear_torch.jsonl")):
        kind = r.get("kind")
        if kind == "case":
            key = (r["provider"], r["regime"], r["shape"], r["m"], r["k"], r["n"], r["dtype"], r["variant"])
            times[key].append(r["median_us"])
        elif kind == "host":
            host[(r["impl"], r["what"])].append(r)
        elif kind == "plan":
            plans[r["key"]] = r
        elif kind == "calibration":
            calib[r["what"]].append(r)
        elif kind == "meta":
            meta = r
    med = {k: statistics.median(v) for k, v in times.items()}
    ceiling = statistics.median(r["tflops"] for r in calib["gemm_bf16_8192"]) if calib["gemm_bf16_8192"] else 0
    copy = statistics.median(r["tbps"] for r in calib["copy_1gib"]) if calib["copy_1gib"] else 0
    return med, host, plans, ceiling, copy, meta


def f1(v):
    return f"{v:.1f}" if v else "—"


def f3(v):
    return f"{v:.3f}" if v else "—"


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def cases(med):
    return sorted({k[1:7] for k in med}, key=lambda c: ({"decode": 0, "prefill": 1, "training": 2, "dtypes": 3,
                                                          "odd": 4}.get(c[0], 9), c[5], c[2], c[1]))


def get(med, provider, case, variant):
    return med.get((provider,) + case + (variant,))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--png")
    args = ap.parse_args()
    med, host, plans, ceiling, copy, meta = load(args.folder)
    print(f"{meta.get('device', '?')}, commit {meta.get('commit', '?')}, {meta.get('date', '?')}, "
          f"cuBLASLt {meta.get('cublaslt', '?')}, tuning {'on' if meta.get('tuning') else 'off'} "
          f"(top {meta.get('top_k', '?')}); ceiling {ceiling:.1f} TF/s (bf16 8192^3), copy {copy:.2f} TB/s\n")

    # ---- fwd / bwd / fwd+bwd against torch ------------------------------------------------------------------------
    print("| regime | shape | M | K | N | dtype | variant | shardline µs | legacy µs | torch µs | vs torch | TF/s | "
          "of ceiling |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    speedups = defaultdict(list)
    rows_png = []
    for c in cases(med):
        regime, shape, m, k, n, dtype = c
        if regime == "decode":
            continue
        for variant in ("fwd", "bwd", "fwdbwd"):
            s = get(med, "default", c, variant)
            t = get(med, "torch", c, variant)
            if s is None:
                continue
            lg = get(med, "legacy", c, variant)
            flops = 2.0 * m * n * k * {"fwd": 1, "bwd": 2, "fwdbwd": 3}[variant]
            tf = flops / (s * 1e-6) / 1e12
            sp = t / s if t else float("nan")
            if t and variant == "fwdbwd":
                speedups[(regime, dtype)].append((shape, m, sp, tf))
                rows_png.append((c, s, lg, t))
            print(f"| {regime} | {shape} | {m} | {k} | {n} | {dtype} | {variant} | {f1(s)} | {f1(lg)} | {f1(t)} | "
                  f"{f3(sp if t else None)} | {tf:.0f} | {f3(tf / ceiling if ceiling else None)} |")

    print("\n### fwd+bwd against the targets")
    big = [x for (regime, dtype), xs in speedups.items() if dtype == "bf16" and regime in ("prefill", "training")
           for x in xs]
    if big:
        g = geomean([x[2] for x in big])
        worst = min(big, key=lambda x: x[2])
        print(f"- bf16, M >= 2048 ({len(big)} cases): geomean {g:.3f}x torch (target >= 1.05), worst {worst[2]:.3f}x "
              f"({worst[0]} M={worst[1]}; target >= 0.98); cases below 0.98: "
              f"{sum(1 for x in big if x[2] < 0.98)}")
    train = [x for (regime, dtype), xs in speedups.items() if dtype == "bf16" and regime == "training" for x in xs]
    if train and ceiling:
        fr = [x[3] / ceiling for x in train]
        print(f"- training shapes, fraction of the ceiling: min {min(fr):.3f}, median {statistics.median(fr):.3f}, "
              f"max {max(fr):.3f} (target >= 0.90); {sum(1 for f in fr if f >= 0.90)} of {len(fr)} meet it")
    for (regime, dtype), xs in sorted(speedups.items()):
        print(f"- {regime} {dtype}: geomean {geomean([x[2] for x in xs]):.3f}x torch over {len(xs)} cases")

    # ---- bias epilogue, floors, tuning, main grad, side stream ----------------------------------------------------
    print("\n### forward with bias against the plain GEMM (cuBLASLt best of top 8), and the floors")
    print("| regime | shape | M | fwd+bias µs | fwd µs | plain h1 µs | plain top8 µs | bias/plain | torch's call µs | "
          "fwd+bias / torch's call | fwdbwd floor µs | fwdbwd/floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    vs_call = []
    for c in cases(med):
        fb = get(med, "default", c, "fwd")
        f0 = get(med, "default", c, "fwd_nobias")
        h1 = get(med, "cublaslt", c, "floor_fwd_h1")
        t8 = get(med, "cublaslt", c, "floor_fwd_top8")
        if fb is None or t8 is None or c[5] != "bf16":
            continue
        plain = min(t8, h1) if h1 else t8
        ratio = fb / plain
        floor3 = [get(med, "cublaslt", c, f"floor_{p}_top8") for p in ("fwd", "dgrad", "wgrad")]
        fwdbwd = get(med, "default", c, "fwdbwd")
        fl = sum(floor3) if all(floor3) else None
        # torch's call: the BIAS-epilogue GEMM with the heuristic's first pick, as F.linear makes it, in this process
        call = get(med, "cublaslt", c, "floor_fwdbias_h1")
        if c[0] != "decode":
            ratios.append(ratio)
            if call:
                vs_call.append(fb / call)
        print(f"| {c[0]} | {c[1]} | {c[2]} | {f1(fb)} | {f1(f0)} | {f1(h1)} | {f1(t8)} | {ratio:.3f} | {f1(call)} | "
              f"{f3(fb / call if call else None)} | {f1(fl)} | {f3(fwdbwd / fl if fl and fwdbwd else None)} |")
    if ratios:
        print(f"- M >= 2048: forward with bias / plain GEMM: median {statistics.median(ratios):.3f}, max "
              f"{max(ratios):.3f} (target <= 1.02)")
    if vs_call:
        print(f"- M >= 2048: forward with bias / torch's call (same process, interleaved): geomean "
              f"{geomean(vs_call):.3f}, min {min(vs_call):.3f}, max {max(vs_call):.3f}")

    print("\n### decode (forward, bf16 + bias) against the weight-streaming floor")
    print("| shape | M | shardline µs | legacy µs | torch µs | floor µs | limit 1.25·floor+3 µs | met | "
          "CUDA graph µs/call | met under a graph |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    met = [0, 0, 0, 0]  # cases, met eager, met under a graph, timed under a graph
    for c in cases(med):
        if c[0] != "decode":
            continue
        _, shape, m, k, n, dtype = c
        s = get(med, "default", c, "fwd")
        if s is None:
            continue
        es = ES[dtype]
        floor = es * (n * k + m * k + m * n + n) / (copy * 1e12) * 1e6 if copy else float("nan")
        limit = 1.25 * floor + 3.0
        lg, t = get(med, "legacy", c, "fwd"), get(med, "torch", c, "fwd")
        g = get(med, "default", c, "fwd_graph")
        met[0] += 1
        met[1] += s <= limit
        met[2] += bool(g) and g <= limit
        met[3] += bool(g)
        print(f"| {shape} | {m} | {f1(s)} | {f1(lg)} | {f1(t)} | {floor:.1f} | {limit:.1f} | "
              f"{'yes' if s <= limit else 'no'} | {f1(g)} | {('yes' if g <= limit else 'no') if g else '—'} |")
    if met[0]:
        print(f"- decode within 1.25·floor + 3 µs: {met[1]} of {met[0]} eager, {met[2]} of the {met[3]} timed under a "
              f"CUDA graph")

    print("\n### fp32 main-grad accumulation (beta = 1) against a bf16 dW, and the bias grad")
    print("| shape | M | wgrad bf16 µs | wgrad fp32 main grad µs | ratio | wgrad + db µs | bwd µs | bwd split µs | "
          "split/bwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in cases(med):
        a = get(med, "default", c, "wgrad_bf16")
        b = get(med, "default", c, "wgrad_fp32_main_grad")
        if a is None or b is None:
            continue
        wb = get(med, "default", c, "wgrad_bias")
        bw, bs = get(med, "default", c, "bwd"), get(med, "default", c, "bwd_split")
        print(f"| {c[1]} | {c[2]} | {f1(a)} | {f1(b)} | {b / a:.3f} | {f1(wb)} | {f1(bw)} | {f1(bs)} | "
              f"{f3(bs / bw if bs and bw else None)} |")

    if plans:
        tuned = [p for p in plans.values() if p["tuned"] and p["first_us"] > 0 and p["chosen_us"] > 0]
        gains = sorted(((p["first_us"] / p["chosen_us"], p["key"]) for p in tuned), reverse=True)
        changed = [g for g in gains if g[0] > 1.0001]
        small = sum(1 for p in tuned if p.get("chosen_small_workspace"))
        print(f"\n### algorithm tuning: {len(tuned)} tuned plans; {len(changed)} kept a candidate other than the "
              f"heuristic's first pick ({small} from the 1 MiB-workspace query); first pick / kept time:")
        for g, key in changed[:15]:
            print(f"- {g:.3f}x  {key}")
        # Results before the epilogue decision was generalised name its fields bgradb_*.
        def field(p, name):
            return p.get(f"epilogue_{name}", p.get(f"bgradb_{name}", 0))
        bg = [p for p in plans.values() if "epilogue=bgradb" in p["key"] and p["usable"] and field(p, "fused_us") > 0]
        sep = [p for p in bg if field(p, "separate")]
        print(f"\n### BGRADB: {len(bg)} wgrad+bias-grad plans; fused kept on {len(bg) - len(sep)}, separate column sum "
              f"on {len(sep)}")
        for p in sorted(bg, key=lambda p: p["key"]):
            print(f"- {'separate' if field(p, 'separate') else 'fused   '} fused {field(p, 'fused_us'):.1f} µs, "
                  f"GEMM + column sum {field(p, 'separate_us'):.1f} µs  ({p['key']})")

    if plans:
        gv = [p for p in plans.values() if p.get("gemv_us", 0) > 0]
        if gv:
            print(f"\n### matrix-vector products: {len(gv)} timed against CUTLASS's GEMV; GEMV kept on "
                  f"{sum(1 for p in gv if p['gemv'])} (tuning µs, cold, interleaved: cuBLASLt's kept algorithm / the "
                  f"GEMV)")
            for p in sorted(gv, key=lambda p: p["key"]):
                # Results before 2026-11-27 have no gemv_cublaslt_us: the candidates' pass (chosen_us) instead.
                lt = p.get("gemv_cublaslt_us", 0) or p["chosen_us"]
                print(f"- {'gemv    ' if p['gemv'] else 'cublaslt'} {lt:.1f} / {p['gemv_us']:.1f} µs  ({p['key']})")

    print("\n### host cost (2000 back-to-back calls, no synchronisation; M=1, K=N=256, bf16)")
    print("| impl | what | µs per call | ops | µs per op | device µs per call |")
    print("|---|---|---|---|---|---|")
    for (impl, what), rs in sorted(host.items()):
        h = statistics.median(r["host_us"] for r in rs)
        ops = rs[0]["ops"]
        d = statistics.median(r["device_us"] for r in rs)
        print(f"| {impl} | {what} | {h:.2f} | {ops} | {h / ops:.2f} | {d:.2f} |")

    if args.png and rows_png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(18, 7))
        labels = [f"{c[1]} M={c[2]} {c[5]}" for c, *_ in rows_png]
        xs = range(len(rows_png))
        for j, (name, style) in enumerate((("shardline", "o"), ("legacy", "^"), ("torch", "s"))):
            ys = []
            for c, s, lg, t in rows_png:
                us = (s, lg, t)[j]
                ys.append(2.0 * c[2] * c[3] * c[4] * 3 / (us * 1e-6) / 1e12 if us else float("nan"))
            axes[0].plot(list(xs), ys, style, label=name)
        if ceiling:
            axes[0].axhline(ceiling, color="gray", ls="--", label=f"ceiling {ceiling:.0f}")
            axes[0].axhline(0.9 * ceiling, color="gray", ls=":", label="0.90 ceiling")
        axes[0].set_title("fwd+bwd TF/s")
        axes[0].set_xticks(list(xs))
        axes[0].set_xticklabels(labels, rotation=90, fontsize=6)
        axes[0].legend(fontsize=7)
        sp = [t / s for c, s, lg, t in rows_png]
        axes[1].bar(list(xs), sp, color=["tab:green" if v >= 1.0 else "tab:red" for v in sp])
        axes[1].axhline(1.0, color="black")
        axes[1].axhline(0.98, color="gray", ls=":")
        axes[1].axhline(1.05, color="gray", ls="--")
        axes[1].set_title("fwd+bwd speedup vs torch")
        axes[1].set_xticks(list(xs))
        axes[1].set_xticklabels(labels, rotation=90, fontsize=6)
        fig.suptitle(f"shardline Linear vs torch — {meta.get('device', '')} — commit {meta.get('commit', '')} "
                     f"{meta.get('date', '')}")
        fig.tight_layout()
        fig.savefig(args.png, dpi=90)


if __name__ == "__main__":
    main()
