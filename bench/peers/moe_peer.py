#!/usr/bin/env python3
"""torch peer of shardline-moe-bench: a reference MoE MLP forward + backward at ep = 1 on the same cases, with the same
timing and a JSON-lines record per case (impl "torch").

    python3 bench/peers/moe_peer.py --cases CASES.json --json OUT.jsonl [--warmup 5 --iters 10 --rounds 3]

CASES.json is what `shardline-moe-bench --list-cases` prints (run_moe_bench.sh passes it): T, E, topk, hidden, ffn, the
routing bias and the aux coefficient. The layer, as the C++ side: logits [T, E] fp32 (an input: the gate's output,
plus the routing bias) → softmax, top-k, renormalised weights, Switch aux loss (coeff·E·Σ f_e·P_e) → sort-based
permutation (a stable argsort of the expert ids, a gather of x's rows) → torch._grouped_mm fc1 → GELU (tanh) →
torch._grouped_mm fc2 → unpermute (the inverse permutation, weighted sum over the k copies); autograd backward of y
(given dy) and the aux loss through x, the logits and both weights. bf16 tokens and weights. "gemm" times the six
grouped GEMMs alone (fc1/fc2 forward and their autograd backward) on the same sizes; non-GEMM share = 1 - gemm / layer.
CUDA events around every iteration; warm-ups, then rounds of (layer, gemm); median and p90.
"""

import argparse
import datetime
import json
import sys

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


def moe_layer(x, logits, w1, w2, topk, aux_coeff):
    """y [T, H] and the aux loss of a dropless top-k MoE MLP."""
    t, e = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = probs.topk(topk, dim=-1)
    weights = top_p / top_p.sum(dim=-1, keepdim=True)
    flat = top_i.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    aux = aux_coeff * e * ((counts.to(probs.dtype) / (t * topk)) * probs.mean(dim=0)).sum()
    order = torch.argsort(flat, stable=True)  # copies in expert order, (t, j) order within an expert
    tokens = x[order // topk]
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(tokens, w1.transpose(-2, -1), offs=offs)
    o = torch._grouped_mm(F.gelu(h, approximate="tanh"), w2.transpose(-2, -1), offs=offs)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    o_tj = o[inverse].view(t, topk, -1)
    y = (o_tj * weights.unsqueeze(-1).to(o.dtype)).sum(dim=1)
    return y, aux, counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args, _ = ap.parse_known_args()
    cases = json.load(open(args.cases))
    out = open(args.json, "a") if args.json else None
    meta = {"tool": "moe_peer", "impl": "torch", "device": torch.cuda.get_device_name(0), "commit": commit(),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    print(f"# {meta['device']}, torch {torch.__version__} reference MoE MLP fwd+bwd, ep = 1, bf16")
    print(f"{'case':14s} {'layer_us':>10s} {'gemm_us':>10s} {'tokens/s':>12s} {'non-GEMM':>10s} {'max/min load':>12s}")
    status = 0
    for case in cases:
        t, e, k, hid, ffn = case["tokens"], case["experts"], case["topk"], case["hidden"], case["ffn"]
        g = torch.Generator(device="cuda").manual_seed(1)
        bias = torch.tensor(case["routing_bias"], device="cuda", dtype=torch.float32)
        x = torch.randn(t, hid, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        logits = (torch.randn(t, e, device="cuda", dtype=torch.float32, generator=g) + bias).requires_grad_()
        w1 = (torch.randn(e, ffn, hid, device="cuda", dtype=torch.bfloat16, generator=g) / hid ** 0.5).requires_grad_()
        w2 = (torch.randn(e, hid, ffn, device="cuda", dtype=torch.bfloat16, generator=g) / ffn ** 0.5).requires_grad_()
        dy = torch.randn(t, hid, device="cuda", dtype=torch.bfloat16, generator=g)
        leaves = (x, logits, w1, w2)

        def layer():
            for v in leaves:
                v.grad = None
            y, aux, _ = moe_layer(x, logits, w1, w2, k, case["aux_loss_coeff"])
            torch.autograd.backward([y, aux], [dy, torch.ones_like(aux)])
            return y

        y = layer()
        _, _, counts = moe_layer(x.detach(), logits.detach(), w1.detach(), w2.detach(), k, case["aux_loss_coeff"])
        loads = counts.tolist()
        finite = bool(torch.isfinite(y).all()) and all(bool(torch.isfinite(v.grad).all()) for v in (x, logits, w1))
        if not finite or sum(loads) != t * k:
            print(f"GATE FAILED {case['case']}: finite {finite}, rows {sum(loads)} of {t * k}", file=sys.stderr)
            status = 1
            continue
        rows = sum(loads)
        offs = counts.cumsum(0).to(torch.int32)
        tokens = torch.randn(rows, hid, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        act = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dh = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16, generator=g)
        do = torch.randn(rows, hid, device="cuda", dtype=torch.bfloat16, generator=g)

        def gemm():
            for v in (tokens, act, w1, w2):
                v.grad = None
            h = torch._grouped_mm(tokens, w1.transpose(-2, -1), offs=offs)
            o = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs)
            torch.autograd.backward([h, o], [dh, do])

        for _ in range(args.warmup):
            layer()
            gemm()
        layer_us, gemm_us = [], []
        for _ in range(args.rounds):
            layer_us += [timed(layer) for _ in range(args.iters)]
            gemm_us += [timed(gemm) for _ in range(args.iters)]
        layer_med, gemm_med = percentile(layer_us, 0.5), percentile(gemm_us, 0.5)
        tokens_per_s = t / (layer_med * 1e-6)
        non_gemm = 1.0 - gemm_med / layer_med
        print(f"{case['case']:14s} {layer_med:10.1f} {gemm_med:10.1f} {tokens_per_s:12.0f} {100 * non_gemm:9.1f}% "
              f"{max(loads):6d}/{min(loads)}")
        if out:
            rec = {"case": case["case"], "tokens": t, "experts": e, "topk": k, "hidden": hid, "ffn": ffn,
                   "loads": loads, "layer_median_us": layer_med, "layer_p90_us": percentile(layer_us, 0.9),
                   "gemm_median_us": gemm_med, "gemm_p90_us": percentile(gemm_us, 0.9),
                   "tokens_per_s": tokens_per_s, "non_gemm_share": non_gemm}
            out.write(json.dumps({**rec, **meta}) + "\n")
            out.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
