#!/usr/bin/env python3
"""torch peer of shardline-moe-ep-bench: a reference expert-parallel MoE MLP (ep = the world, one GPU per rank) forward
+ backward on the same cases, with the same routing, timing and a JSON-lines record per case (impl "torch", rank 0).

    mpirun -n N python3 bench/peers/moe_ep_peer.py --case-file CASES.json --json OUT.jsonl [--cases a,b --warmup 3
        --iters 10 --rounds 3]

CASES.json is what `shardline-moe-ep-bench --list-cases` prints (run_moe_ep_bench.sh passes it); --cases selects by
name as the C++ side's option does, so that one BENCH_ARGS serves both. Launch with mpirun
(OMPI_COMM_WORLD_*; MASTER_ADDR/MASTER_PORT default to 127.0.0.1:29547) or torchrun.

The layer, as Megatron-Core's all-to-all token dispatcher does it, with torch's own ops: a stable argsort of the expert
ids (the copies in expert order), the per-expert counts exchanged with all_to_all_single and read on the host (the
splits), the rows exchanged with the differentiable torch.distributed.nn.functional.all_to_all_single, the received
rows regrouped from (source rank, local expert) to (local expert, source rank) order, torch._grouped_mm fc1 → GELU
(tanh) → torch._grouped_mm fc2 on the E/ep local experts, the inverse regrouping, the rows back, and the weighted
combine of the k copies; autograd backward of y (given dy) through x and both expert weights. bf16, no biases, no gate.
"exchange" times the same without the experts (permutation, both all-to-alls, combine; forward and backward);
a2a share = exchange / layer. Routing: the formula of moe_ep_bench.cc (token g = rank·T + t, ...), so both sides route
every token alike. tokens/s = N·T / layer.

Correctness gate before timing: y of the EP layer on every rank against a dense computation on that rank of the same
tokens through all E experts (the full weights all-gathered), within 3e-2·max(|expected|, rms(expected)).
"""

import argparse
import datetime
import json
import math
import sys

from peer_util import commit, no_nvlink_multicast, percentile, rank_env

no_nvlink_multicast("moe_ep_peer")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as dnn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def routing(case, rank):
    """indices [T, k] (int64) and weights [T, k] (float32) of this rank's tokens, as moe_ep_bench.cc computes them."""
    t, e, k, skew = case["tokens"], case["experts"], case["topk"], case["skew"]
    idx, w = [], []
    norm = k * (k + 1) / 2.0
    for i in range(t):
        g = rank * t + i
        h = (g * 2654435761 + 12345) & 0xFFFFFFFF
        u = h / 4294967296.0
        first = min(e - 1, int(math.floor(e * u ** (1.0 + skew))))
        idx.append([(first + j) % e for j in range(k)])
        w.append([(k - j) / norm for j in range(k)])
    return (torch.tensor(idx, dtype=torch.int64, device="cuda"),
            torch.tensor(w, dtype=torch.float32, device="cuda"))


class Dispatch:
    """The routing's permutation and the all-to-all splits (host lists), computed once per forward."""

    def __init__(self, indices, experts, ep, group):
        t, k = indices.shape
        self.t, self.k = t, k
        local = experts // ep
        flat = indices.reshape(-1)
        self.order = torch.argsort(flat, stable=True)  # copies in expert order
        counts = torch.bincount(flat, minlength=experts)  # [E]: rows this rank sends to each expert
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)  # [ep, local]: rows each source sends to my experts
        self.input_splits = counts.view(ep, local).sum(1).tolist()  # the host synchronisation
        recv_2d = recv.view(ep, local)
        self.output_splits = recv_2d.sum(1).tolist()
        # Received rows come in (source, local expert) order: regroup them to (local expert, source).
        chunk_sizes = recv_2d.reshape(-1)
        chunk_of_row = torch.repeat_interleave(torch.arange(ep * local, device="cuda"), chunk_sizes)
        key = (chunk_of_row % local) * ep + chunk_of_row // local
        self.regroup = torch.argsort(key, stable=True)
        self.ungroup = torch.empty_like(self.regroup)
        self.ungroup[self.regroup] = torch.arange(self.regroup.numel(), device="cuda")
        self.offs = recv_2d.sum(0).cumsum(0).to(torch.int32)
        self.group = group

    def send(self, x):
        tokens = x[self.order // self.k]
        return dnn.all_to_all_single(torch.empty(sum(self.output_splits), x.shape[1], dtype=x.dtype, device="cuda"),
                                     tokens, self.output_splits, self.input_splits, group=self.group)

    def back(self, rows, weights):
        returned = dnn.all_to_all_single(torch.empty(self.t * self.k, rows.shape[1], dtype=rows.dtype, device="cuda"),
                                         rows, self.input_splits, self.output_splits, group=self.group)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.order.numel(), device="cuda")
        o_tj = returned[inverse].view(self.t, self.k, -1)
        return (o_tj * weights.unsqueeze(-1).to(o_tj.dtype)).sum(dim=1)


def moe_layer(x, indices, weights, w1, w2, experts, ep, group):
    d = Dispatch(indices, experts, ep, group)
    rows = d.send(x)[d.regroup]
    h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=d.offs)
    o = torch._grouped_mm(F.gelu(h, approximate="tanh"), w2.transpose(-2, -1), offs=d.offs)
    return d.back(o[d.ungroup], weights)


def exchange(x, indices, weights, experts, ep, group):
    d = Dispatch(indices, experts, ep, group)
    rows = d.send(x)[d.regroup]
    return d.back(rows[d.ungroup], weights)


def dense_reference(x, indices, weights, w1_full, w2_full):
    """y of this rank's tokens through all experts, float32 (one GPU, no exchange)."""
    y = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
    xf = x.float()
    for e in range(w1_full.shape[0]):
        rows, slots = (indices == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = F.gelu(xf[rows] @ w1_full[e].float().t(), approximate="tanh").bfloat16().float()
        o = (h @ w2_full[e].float().t()).bfloat16().float()
        y.index_add_(0, rows, o * weights[rows, slots].unsqueeze(-1))
    return y


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
    ap.add_argument("--case-file", required=True)
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    ap.add_argument("--json", default="")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args, _ = ap.parse_known_args()
    rank, world, local_rank = rank_env("moe_ep_peer", "29547")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    ep = world
    wanted = {c for c in args.cases.split(",") if c}
    cases = [c for c in json.load(open(args.case_file)) if not wanted or c["case"] in wanted]
    out = open(args.json, "a") if (args.json and rank == 0) else None
    meta = {"tool": "moe_ep_peer", "impl": "torch", "device": torch.cuda.get_device_name(0), "commit": commit(),
            "torch": torch.__version__, "ep": ep,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if rank == 0:
        print(f"# {meta['device']}, torch {torch.__version__} reference EP MoE MLP fwd+bwd, ep = {ep} (NCCL), bf16, "
              f"T per rank")
        print(f"{'case':14s} {'layer_us':>10s} {'a2a_us':>10s} {'tokens/s':>12s} {'a2a':>9s}")
    status = 0
    for case in cases:
        t, e, k, hid, ffn = case["tokens"], case["experts"], case["topk"], case["hidden"], case["ffn"]
        if e % ep:
            continue
        local = e // ep
        g = torch.Generator(device="cuda").manual_seed(1 + rank)
        x = torch.randn(t, hid, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        dy = torch.randn(t, hid, device="cuda", dtype=torch.bfloat16, generator=g)
        gw = torch.Generator(device="cuda").manual_seed(100 + rank)
        w1 = (torch.randn(local, ffn, hid, device="cuda", dtype=torch.bfloat16, generator=gw) / hid ** 0.5)
        w2 = (torch.randn(local, hid, ffn, device="cuda", dtype=torch.bfloat16, generator=gw) / ffn ** 0.5)
        w1.requires_grad_()
        w2.requires_grad_()
        indices, weights = routing(case, rank)

        # Gate: the EP layer against the dense computation of this rank's tokens.
        with torch.no_grad():
            y = moe_layer(x, indices, weights, w1, w2, e, ep, group)
            w1_full = torch.empty(e, ffn, hid, dtype=w1.dtype, device="cuda")
            w2_full = torch.empty(e, hid, ffn, dtype=w2.dtype, device="cuda")
            dist.all_gather_into_tensor(w1_full, w1.detach().contiguous())
            dist.all_gather_into_tensor(w2_full, w2.detach().contiguous())
            ref = dense_reference(x.detach(), indices, weights, w1_full, w2_full)
            del w1_full, w2_full
            scale = max(ref.abs().max().item(), ref.pow(2).mean().sqrt().item())
            err = (y.float() - ref).abs().max().item()
        bad = torch.tensor([0.0 if err <= 3e-2 * scale else 1.0], device="cuda")
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() != 0.0:
            if rank == 0:
                print(f"GATE FAILED {case['case']}: max error {err:.3g} against scale {scale:.3g} on some rank",
                      file=sys.stderr)
            status = 1
            continue

        def layer():
            for v in (x, w1, w2):
                v.grad = None
            y = moe_layer(x, indices, weights, w1, w2, e, ep, group)
            y.backward(dy)

        def a2a():
            x.grad = None
            y = exchange(x, indices, weights, e, ep, group)
            y.backward(dy)

        for _ in range(args.warmup):
            layer()
            a2a()
        layer_us, a2a_us = [], []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            dist.barrier()
            layer_us += [timed(layer) for _ in range(args.iters)]
            torch.cuda.synchronize()
            dist.barrier()
            a2a_us += [timed(a2a) for _ in range(args.iters)]
        times = torch.tensor([layer_us, a2a_us], dtype=torch.float64, device="cuda")
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets each iteration's time
        layer_us, a2a_us = times[0].tolist(), times[1].tolist()
        layer_med, a2a_med = percentile(layer_us, 0.5), percentile(a2a_us, 0.5)
        tokens_per_s = ep * t / (layer_med * 1e-6)
        if rank == 0:
            print(f"{case['case']:14s} {layer_med:10.1f} {a2a_med:10.1f} {tokens_per_s:12.0f} "
                  f"{100 * a2a_med / layer_med:8.1f}%")
            sys.stdout.flush()
        if out:
            rec = {"case": case["case"], "tokens_per_rank": t, "experts": e, "topk": k, "hidden": hid, "ffn": ffn,
                   "layer_median_us": layer_med, "layer_p90_us": percentile(layer_us, 0.9),
                   "a2a_median_us": a2a_med, "a2a_p90_us": percentile(a2a_us, 0.9),
                   "tokens_per_s": tokens_per_s, "a2a_share": a2a_med / layer_med}
            out.write(json.dumps({**rec, **meta}) + "\n")
            out.flush()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
