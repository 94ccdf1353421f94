#!/usr/bin/env python3
"""torch peer of shardline-grouped-bench: torch._grouped_mm and a loop of F.linear on the same MoE cases, with the same
timing and JSON-lines schema (impl "torch").

    python3 bench/peers/grouped_peer.py --cases CASES.json --json OUT.jsonl [--warmup 10 --iters 20 --rounds 5]

CASES.json is what `shardline-grouped-bench --list-cases` prints (run_grouped_bench.sh passes it): per case K, N, E and
the group sizes. Y_e = X_e·W_eᵀ with W [E, N, K], bf16. Phases as the C++ side: fwd, dgrad (dX = dY·W per group),
wgrad (dW = dYᵀ·X per group), fwdbwd (forward + autograd backward for X and W). Variants: grouped_mm (offsets on the
device, as torch takes them) and loop (F.linear per expert over its slice; autograd for the backward). CUDA events
around every iteration; warm-ups, then rounds in which the variants take turns; median and p90. A correctness gate
(the grouped forward against the loop's) runs first. Host µs per forward: 2000 calls without synchronising.
"""

import argparse
import datetime
import json
import sys
import time

import torch
import torch.nn.functional as F

from peer_util import commit, percentile


def timed(fn):
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1000.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host-calls", type=int, default=2000)
    args, _ = ap.parse_known_args()
    cases = json.load(open(args.cases))
    out = open(args.json, "a") if args.json else None
    meta = {"impl": "torch", "device": torch.cuda.get_device_name(0), "commit": commit(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    print(f"# {meta['device']}, torch {torch.__version__}")
    print(f"{'case':18s} {'variant':12s} {'fwd_us':>10s} {'dgrad_us':>10s} {'wgrad_us':>10s} {'fwdbwd_us':>10s} "
          f"{'TF/s':>8s} {'host_us':>8s}")
    status = 0
    for case in cases:
        k, n, sizes = case["k"], case["n"], case["sizes"]
        e = len(sizes)
        m = sum(sizes)
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
        offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        xg = x.detach().requires_grad_()
        wg = w.detach().requires_grad_()

        def gmm_fwd():
            with torch.no_grad():
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

        def gmm_dgrad():
            return torch._grouped_mm(dy, w, offs=offs)

        def gmm_wgrad():
            return torch._grouped_mm(dy.t(), x, offs=offs)

        # Each fwd+bwd starts with no .grad, as a training step after zero_grad(set_to_none=True): otherwise autograd
        # adds every new gradient into the previous one (an extra read-modify-write of dW per call, which the C++
        # side does not do, and a training step would not either).
        def gmm_fwdbwd():
            xg.grad = None
            wg.grad = None
            y = torch._grouped_mm(xg, wg.transpose(-2, -1), offs=offs)
            torch.autograd.backward(y, dy)

        def loop_fwd():
            with torch.no_grad():
                return torch.cat([F.linear(x[bounds[i]:bounds[i + 1]], w[i]) for i in range(e)])

        def loop_dgrad():
            return torch.cat([dy[bounds[i]:bounds[i + 1]] @ w[i] for i in range(e)])

        def loop_wgrad():
            return torch.stack([dy[bounds[i]:bounds[i + 1]].t() @ x[bounds[i]:bounds[i + 1]] for i in range(e)])

        def loop_fwdbwd():
            xg.grad = None
            wg.grad = None
            y = torch.cat([F.linear(xg[bounds[i]:bounds[i + 1]], wg[i]) for i in range(e)])
            torch.autograd.backward(y, dy)

        variants = {"grouped_mm": (gmm_fwd, gmm_dgrad, gmm_wgrad, gmm_fwdbwd),
                    "loop": (loop_fwd, loop_dgrad, loop_wgrad, loop_fwdbwd)}
        ref = loop_fwd().float()
        got = gmm_fwd().float()
        if not torch.allclose(got, ref, atol=2e-2 * ref.abs().max().item(), rtol=0):
            print(f"GATE FAILED {case['case']} grouped_mm", file=sys.stderr)
            status = 1
            variants.pop("grouped_mm")
        for fns in variants.values():
            for _ in range(args.warmup):
                for fn in fns:
                    fn()
        samples = {v: {p: [] for p in ("fwd", "dgrad", "wgrad", "fwdbwd")} for v in variants}
        for _ in range(args.rounds):
            for v, fns in variants.items():
                for _ in range(args.iters):
                    for phase, fn in zip(("fwd", "dgrad", "wgrad", "fwdbwd"), fns):
                        samples[v][phase].append(timed(fn))
        flops = 2.0 * m * k * n
        for v, fns in variants.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.host_calls):
                fns[0]()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host_us = (t1 - t0) * 1e6 / args.host_calls
            med = {}
            for phase in ("fwd", "dgrad", "wgrad", "fwdbwd"):
                med[phase] = percentile(samples[v][phase], 0.5)
                pf = 3 * flops if phase == "fwdbwd" else flops
                rec = {"case": case["case"], "variant": v, "phase": phase, "rows": m, "experts": e, "k": k, "n": n,
                       "median_us": med[phase], "p90_us": percentile(samples[v][phase], 0.9),
                       "tflops": pf / med[phase] * 1e-6, "host_us_per_fwd": host_us}
                if out:
                    out.write(json.dumps({**rec, **meta}) + "\n")
                    out.flush()
            print(f"{case['case']:18s} {v:12s} {med['fwd']:10.1f} {med['dgrad']:10.1f} {med['wgrad']:10.1f} "
                  f"{med['fwdbwd']:10.1f} {3 * flops / med['fwdbwd'] * 1e-6:8.1f} {host_us:8.2f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
