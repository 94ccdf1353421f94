#!/usr/bin/env python3
"""torch peer of shardline-linear-bench: F.linear forward and autograd backward on the same cases, with the same timing
and the same JSON-lines schema (impl "torch").

    python3 bench/peers/linear_peer.py --cases CASES.json --json OUT.jsonl [--warmup 10 --iters 10 --rounds 5]

CASES.json is what `shardline-linear-bench --list-cases --suite S` prints (run_linear_bench.sh passes it), so both sides
measure the same (shape, M, dtype) list. Per case: fwd (F.linear with bias, no autograd), bwd (torch.autograd.grad of
y with respect to x, weight and bias, on a retained graph), fwdbwd (both). CUDA events around every iteration on the
current stream; warm-ups, then rounds in which the variants take turns; median and p90 over all timed iterations.
Inputs are random normal; when one set of operands fits in 3x the L2 cache, iterations rotate over enough sets.
Host cost: 2000 back-to-back calls without synchronising, for F.linear and for a fwd+bwd step (M=1, K=N=256, bf16).
"""

import argparse
import datetime
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from peer_util import commit, percentile

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


def cublaslt_in_use():
    """The libcublasLt this process loaded (after a matmul) and its version: torch's wheel brings its own."""
    import ctypes
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(a, a, a[0])
    torch.cuda.synchronize()
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
    if not paths:
        return "?", 0
    try:
        return paths[0], ctypes.CDLL(paths[0]).cublasLtGetVersion()
    except OSError:
        return paths[0], 0


class Sink:
    def __init__(self, path):
        self.f = open(path, "a") if path else None
        self.meta = {"impl": "torch", "device": torch.cuda.get_device_name(0), "commit": commit(),
                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "torch": torch.__version__}
        self.meta["cublaslt_path"], self.meta["cublaslt"] = cublaslt_in_use()

    def emit(self, rec):
        if self.f:
            self.f.write(json.dumps({**rec, **self.meta}) + "\n")
            self.f.flush()


def operand_sets(case, dtype, l2_bytes):
    m, k, n = case["m"], case["k"], case["n"]
    es = torch.tensor([], dtype=dtype).element_size()
    backward = case["backward"]
    set_bytes = es * (m * k + n * k + n + (2 * m * n + m * k + n * k if backward else m * n))
    sets = min(16, math.ceil(3 * l2_bytes / set_bytes)) if set_bytes < 3 * l2_bytes else 1
    out = []
    for s in range(sets):
        g = torch.Generator(device="cuda").manual_seed(1000 + s)
        x = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / math.sqrt(k)
        b = torch.randn(n, device="cuda", dtype=dtype, generator=g)
        dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) if backward else None
        out.append({"x": x, "w": w, "b": b, "dy": dy})
    return out


def gate(case, s, y, grads, dtype_name):
    """Sampled outputs against float64 sums (the same gate as the C++ side)."""
    tol = {"bf16": 3e-2, "fp16": 4e-3, "tf32": 1e-2, "fp32": 1e-4}[dtype_name]
    g = torch.Generator().manual_seed(9)
    m, k, n = case["m"], case["k"], case["n"]
    rows = torch.randint(0, m, (8,), generator=g).tolist()
    cols = torch.randint(0, n, (8,), generator=g).tolist()
    ks = torch.randint(0, k, (8,), generator=g).tolist()
    pairs = []
    x, w, b = s["x"].detach(), s["w"].detach(), s["b"].detach()
    if y is not None:
        for i, j in zip(rows, cols):
            pairs.append((y[i, j].item(), (x[i].double() @ w[j].double() + b[j].double()).item()))
    if grads is not None:
        dx, dw, db = grads
        dy = s["dy"]
        for i, j, kk in zip(rows, cols, ks):
            pairs.append((dx[i, kk].item(), (dy[i].double() @ w[:, kk].double()).item()))
            pairs.append((dw[j, kk].item(), (dy[:, j].double() @ x[:, kk].double()).item()))
            pairs.append((db[j].item(), dy[:, j].double().sum().item()))
    rms = math.sqrt(sum(e * e for _, e in pairs) / max(len(pairs), 1))
    for a, e in pairs:
        if not abs(a - e) <= tol * max(abs(e), rms):
            return f"{a} against {e}"
    return ""


def run_case(case, args, sink, l2_bytes):
    dtype_name = case["dtype"]
    dtype = DTYPES[dtype_name]
    torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
    sets = operand_sets(case, dtype, l2_bytes)
    for s in sets:
        for t in ("x", "w", "b"):
            s[t].requires_grad_(True)
    graphs = []
    if case["backward"]:
        for s in sets:
            graphs.append(F.linear(s["x"], s["w"], s["b"]))

    def fwd(i):
        s = sets[i]
        with torch.no_grad():
            return F.linear(s["x"], s["w"], s["b"])

    def bwd(i):
        s = sets[i]
        return torch.autograd.grad(graphs[i], (s["x"], s["w"], s["b"]), s["dy"], retain_graph=True)

    def fwdbwd(i):
        s = sets[i]
        y = F.linear(s["x"], s["w"], s["b"])
        return torch.autograd.grad(y, (s["x"], s["w"], s["b"]), s["dy"])

    f = 2.0 * case["m"] * case["n"] * case["k"]
    variants = [("fwd", f, fwd)]
    if case["backward"]:
        variants += [("bwd", 2 * f, bwd), ("fwdbwd", 3 * f, fwdbwd)]
    failures = 0
    live = []
    for name, flops, fn in variants:
        out = fn(0)
        torch.cuda.synchronize()
        err = gate(case, sets[0], out, None, dtype_name) if name == "fwd" else gate(case, sets[0], None, out,
                                                                                        dtype_name)
        if err:
            print(f"GATE FAILED torch {case['shape']} {dtype_name} {name}: {err}", file=sys.stderr)
            failures += 1
            continue
        live.append([name, flops, fn, []])
    scale = 5 if dtype_name == "fp32" else 1
    warmup = max(1, args.warmup // scale)
    iters = max(2, args.iters // scale)
    rounds = max(1, args.rounds // 2) if scale > 1 else args.rounds
    stream = torch.cuda.current_stream()
    rotation = 0
    for _, _, fn, _ in live:
        for _ in range(warmup):
            fn(rotation % len(sets))
            rotation += 1
    for _ in range(rounds):
        for v in live:
            _, _, fn, samples = v
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
            for i in range(iters):
                ev[i][0].record(stream)
                fn(rotation % len(sets))
                rotation += 1
                ev[i][1].record(stream)
            torch.cuda.synchronize()
            samples.extend(1000.0 * a.elapsed_time(b) for a, b in ev)
    for name, flops, _, samples in live:
        med = percentile(samples, 0.5)
        rec = {k: case[k] for k in ("regime", "shape", "m", "k", "n", "dtype", "backward")}
        rec.update({"kind": "case", "provider": "torch", "variant": name, "median_us": med,
                    "p90_us": percentile(samples, 0.9), "iterations": len(samples),
                    "tflops": flops / (med * 1e-6) / 1e12, "operand_sets": len(sets)})
        sink.emit(rec)
        print(f"{case['regime']:9s} {case['shape']:16s} {case['m']:6d} {case['k']:6d} {case['n']:6d} "
              f"{dtype_name:5s} torch     {name:22s} {med:10.1f}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    return failures


def host_cost(args, sink):
    m, k, n = 1, 256, 256
    dt = torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=dt)

    def forward():
        with torch.no_grad():
            F.linear(x, w, b)

    def step():
        y = F.linear(x, w, b)
        torch.autograd.grad(y, (x, w, b), dy)

    for what, ops, fn in (("F.linear", 1, forward), ("fwd+bwd autograd", 2, step)):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        host, device = [], []
        for _ in range(5):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(args.host_calls):
                fn()
            t1 = time.perf_counter()
            stop.record()
            stop.synchronize()
            host.append((t1 - t0) * 1e6 / args.host_calls)
            device.append(1000.0 * start.elapsed_time(stop) / args.host_calls)
        h, d = percentile(host, 0.5), percentile(device, 0.5)
        sink.emit({"kind": "host", "what": what, "m": m, "k": k, "n": n, "dtype": "bf16", "calls": args.host_calls,
                   "ops": ops, "host_us": h, "host_us_per_op": h / ops, "device_us": d})
        print(f"host torch {what:30s} {h:8.2f} us per call (device {d:.2f} us per call)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON list from shardline-linear-bench --list-cases")
    ap.add_argument("--json")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--host-calls", type=int, default=2000)
    ap.add_argument("--no-host", action="store_true")
    ap.add_argument("--shapes", help="accepted for symmetry with the bench; the case list is already filtered")
    args = ap.parse_args()
    with open(args.cases) as f:
        cases = json.load(f)
    sink = Sink(args.json)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    print(f"# torch {torch.__version__} peer: {props.name}, L2 {l2 >> 20} MiB, commit {sink.meta['commit']}, "
          f"cuBLASLt {sink.meta['cublaslt']} ({sink.meta['cublaslt_path']})", flush=True)
    if not args.no_host:
        host_cost(args, sink)
    failures = 0
    for case in cases:
        failures += run_case(case, args, sink, l2)
        torch.cuda.empty_cache()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
