#!/usr/bin/env python3
"""torch DTensor peer of shardline-tp-mlp-bench: the same tensor-parallel MLP (Linear up → GELU(tanh) → Linear down,
bf16, with bias) forward + backward, and torch.distributed collectives at the step's sizes, with the same timing and
the same JSON-lines schema (impl "torch").

    mpirun -n N python3 bench/peers/tp_mlp_peer.py --cases CASES.json --json OUT.jsonl

CASES.json is what `shardline-tp-mlp-bench --list-cases` prints (run_tp_mlp_bench.sh passes it): the same shapes,
token counts, variants and iteration counts. Launch with mpirun (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK; MASTER_ADDR and
MASTER_PORT default to 127.0.0.1:29541) or torchrun. TP = world size, on a 1-d mesh init_device_mesh("cuda", (N,)).

Variants (per case):
  tp       parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}): x [T, h] a plain
           tensor, replicated; forward all-reduce of y, backward all-reduce of dX.
  sp       Megatron-style sequence parallelism, as torch's TP tutorial writes it for a feed-forward block without its
           norm: {"up": ColwiseParallel(input_layouts=Shard(0)), "down": RowwiseParallel(output_layouts=Shard(0))}: x is
           this rank's [T/tp, h] rows; the input is all-gathered and the output reduce-scattered on the token dim
           (backward: all-gather dY, reduce-scatter dX).
  eager    (--block, one rank only) the same MLP as a plain module, no DTensor: issue 18 item 4's "torch eager".
  compile  (--block, one rank only) torch.compile of that plain module (default mode, compiled before the gate).
  comm_tp  dist.all_reduce of [T, h] twice.
  comm_sp  (dist.all_gather_into_tensor [T/tp, h] → [T, h], dist.reduce_scatter_tensor [T, h] → [T/tp, h]) twice.

Timing as the C++ side: grads set to None before each step (outside the timed region), CUDA events around every
iteration on the current stream, back to back; a barrier before each batch; warm-ups, then rounds in which the
variants take turns; per iteration the max over ranks; median and p90 over all timed iterations. x and dY are normal
(0, 1); the weights are nn.Linear's own init. TF/GPU = 12·T·h·ff / tp / t.

Correctness gate before timing (every case and step variant): the first step's y, dX, dW1, db1, dW2 and db2, gathered
to full tensors, against a dense float32 computation of the same step on one GPU from the same bf16 values; every
element within rtol·max(|expected|, rms(expected)), rtol = 1.6e-2·(tp + 3) (the C++ gate's). A failed gate skips that
variant's timing and fails the exit code.
"""

import argparse
import datetime
import json
import sys

from peer_util import commit, no_nvlink_multicast, percentile, rank_env

no_nvlink_multicast("tp_mlp_peer")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class MLP(nn.Module):
    def __init__(self, hidden, ffn, dtype, device):
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=True, dtype=dtype, device=device)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(ffn, hidden, bias=True, dtype=dtype, device=device)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def plan(variant):
    if variant == "tp":
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {"up": ColwiseParallel(input_layouts=Shard(0)), "down": RowwiseParallel(output_layouts=Shard(0))}


PLAN_TEXT = {
    "tp": '{"up": ColwiseParallel(), "down": RowwiseParallel()}',
    "sp": '{"up": ColwiseParallel(input_layouts=Shard(0)), "down": RowwiseParallel(output_layouts=Shard(0))}',
}


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_rows(local, tp):
    out = torch.empty((local.shape[0] * tp,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(out, local.contiguous())
    return out


def gate(mlp, x_full, dy_full, y, x_grad, variant, tp):
    """The first step's results against a dense float32 step on one GPU (every rank, same verdict)."""
    sp = variant == "sp"
    # Collectives first, in one order on every rank.
    got = {
        "y": gather_rows(y, tp) if sp else y,
        "dX": gather_rows(x_grad, tp) if sp else x_grad,
        "dW1": full(mlp.up.weight.grad), "db1": full(mlp.up.bias.grad),
        "dW2": full(mlp.down.weight.grad), "db2": full(mlp.down.bias.grad),
    }
    w1 = full(mlp.up.weight.detach()).float().requires_grad_()
    b1 = full(mlp.up.bias.detach()).float().requires_grad_()
    w2 = full(mlp.down.weight.detach()).float().requires_grad_()
    b2 = full(mlp.down.bias.detach()).float().requires_grad_()
    x = x_full.float().requires_grad_()
    y_ref = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    y_ref.backward(dy_full.float())
    want = {"y": y_ref.detach(), "dX": x.grad, "dW1": w1.grad, "db1": b1.grad, "dW2": w2.grad, "db2": b2.grad}
    rtol = 1.6e-2 * (tp + 3) if y.dtype != torch.float32 else 1e-4
    for name, e in want.items():
        a = got[name]
        if a is None or a.shape != e.shape:
            return f"{name}: got {None if a is None else tuple(a.shape)}, expected {tuple(e.shape)}"
        a = a.float()
        rms = e.pow(2).mean().sqrt()
        allowed = rtol * torch.maximum(e.abs(), rms)
        bad = (a - e).abs() > allowed
        if bool(bad.any()) or not bool(torch.isfinite(a).all()):
            i = int(bad.flatten().nonzero()[0]) if bool(bad.any()) else 0
            return (f"{name}: element {i} is {a.flatten()[i].item()} against {e.flatten()[i].item()} "
                    f"(allowed {allowed.flatten()[i].item()}, {int(bad.sum())} bad)")
    return ""


class Case:
    """The variants of one (shape, tokens) case, each a (prepare, run) pair, timed in interleaved rounds."""

    def __init__(self, c, variants, dtype, tp, rank, mesh, device, block=False):
        self.c, self.dtype, self.tp, self.rank, self.device = c, dtype, tp, rank, device
        h, ff, t = c["hidden"], c["ffn"], c["tokens"]
        g = torch.Generator(device=device).manual_seed(21)
        self.x_full = torch.randn(t, h, device=device, dtype=dtype, generator=g)
        self.dy_full = torch.randn(t, h, device=device, dtype=dtype, generator=g)
        self.flops = 12.0 * t * h * ff / tp
        self.variants = {}  # name -> (prepare, run) or None when the gate failed
        self.gate_failures = 0
        self.extra = {}
        for v in variants:
            self.add_step(v, mesh)
        if block:
            for v in ("eager", "compile"):
                self.add_step(v, mesh)
        for v in variants:
            self.add_comm(v)

    def add_step(self, v, mesh):
        c, tp = self.c, self.tp
        torch.manual_seed(5)  # the same full module on every rank before it is sharded
        mlp = MLP(c["hidden"], c["ffn"], self.dtype, self.device)
        if v in ("tp", "sp"):
            mlp = parallelize_module(mlp, mesh, plan(v))
        module = torch.compile(mlp) if v == "compile" else mlp
        if v == "sp":
            x = self.x_full.chunk(tp, dim=0)[self.rank].clone().requires_grad_()
            dy = self.dy_full.chunk(tp, dim=0)[self.rank].contiguous()
        else:
            x = self.x_full.clone().requires_grad_()
            dy = self.dy_full

        def prepare():
            mlp.zero_grad(set_to_none=True)
            x.grad = None

        def run():
            module(x).backward(dy)

        prepare()
        y = module(x)
        y.backward(dy)
        err = gate(mlp, self.x_full, self.dy_full, y.detach(), x.grad, v, tp)
        failed = torch.tensor([1.0 if err else 0.0], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if err:
            print(f"[rank {self.rank}/{tp}] GATE FAILED torch {c['shape']} tokens {c['tokens']} {v}: {err}",
                  file=sys.stderr)
        if failed.item() > 0:
            self.gate_failures += 1
            self.variants[v] = None
        else:
            if self.rank == 0:
                print(f"# gate {c['shape']} tokens {c['tokens']} {v}: ok", flush=True)
            self.variants[v] = (prepare, run)
        self.extra[v] = {"plan": PLAN_TEXT.get(v, "plain module" + (", torch.compile" if v == "compile" else ""))}

    def add_comm(self, v):
        t, h, tp = self.c["tokens"], self.c["hidden"], self.tp
        g = torch.Generator(device=self.device).manual_seed(23)

        def rnd(*shape):
            return torch.randn(*shape, device=self.device, dtype=self.dtype, generator=g)

        if v == "sp":
            bufs = [(rnd(t // tp, h), rnd(t, h), rnd(t // tp, h)) for _ in range(2)]

            def run():
                for small, big, out in bufs:
                    dist.all_gather_into_tensor(big, small)
                    dist.reduce_scatter_tensor(out, big, op=dist.ReduceOp.SUM)
        else:
            bufs = [rnd(t, h) for _ in range(2)]

            def run():
                for b in bufs:
                    dist.all_reduce(b, op=dist.ReduceOp.SUM)
        self.variants["comm_" + v] = (lambda: None, run)
        self.extra["comm_" + v] = {"bytes": t * h * self.x_full.element_size(),
                                   "collectives": "2 x (all_gather + reduce_scatter)" if v == "sp" else
                                   "2 x all_reduce"}

    def time(self, warmup, iters, rounds):
        live = {k: fns for k, fns in self.variants.items() if fns is not None}
        for prepare, run in live.values():
            for _ in range(warmup):
                prepare()
                run()
        samples = {k: [] for k in live}
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for _ in range(rounds):
            for name, (prepare, run) in live.items():
                torch.cuda.synchronize(self.device)
                dist.barrier(device_ids=[self.device.index])
                torch.cuda.synchronize(self.device)
                for start, stop in events:
                    prepare()
                    start.record()
                    run()
                    stop.record()
                torch.cuda.synchronize(self.device)
                us = torch.tensor([s.elapsed_time(e) * 1000.0 for s, e in events], dtype=torch.float64,
                                  device=self.device)
                dist.all_reduce(us, op=dist.ReduceOp.MAX)  # the slowest rank sets each iteration's time
                samples[name] += us.cpu().tolist()
        return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True, help="the JSON of shardline-tp-mlp-bench --list-cases")
    parser.add_argument("--json", default="")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--block", action="store_true",
                        help="one rank only: also time the plain module eager and under torch.compile (issue 18 item 4)")
    args, _ = parser.parse_known_args()  # the C++ bench's other options (BENCH_ARGS) are ignored

    with open(args.cases) as f:
        spec = json.load(f)
    warmup = args.warmup if args.warmup is not None else spec["warmup"]
    iters = args.iters if args.iters is not None else spec["iters"]
    rounds = args.rounds if args.rounds is not None else spec["rounds"]
    dtype_name = spec.get("dtype", "bf16")
    dtype = DTYPES[dtype_name]

    rank, size, local = rank_env("tp_mlp_peer.py", default_port="29541")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=device)
    mesh = init_device_mesh("cuda", (size,), mesh_dim_names=("tp",))
    name = torch.cuda.get_device_name(device)
    meta = {"impl": "torch", "device": name, "commit": commit(), "ranks": size, "tp": size, "dtype": dtype_name,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    out = open(args.json, "a") if (rank == 0 and args.json) else None
    if rank == 0:
        print(f"# torch {meta['torch']} DTensor MLP fwd+bwd, NCCL {meta['nccl']}, tp {size}, {name}, {dtype_name}, "
              f"commit {meta['commit']}, {meta['date']}, warmup {warmup}, {rounds} rounds x {iters} iters")
        print(f"{'shape':8s} {'tokens':>6s} {'var':8s} {'median_us':>11s} {'p90_us':>11s} {'TF/GPU':>8s}", flush=True)
    failures = 0
    for c in spec["cases"]:
        case = Case(c, spec["variants"], dtype, size, rank, mesh, device, block=args.block and size == 1)
        failures += case.gate_failures
        samples = case.time(warmup, iters, rounds)
        for v, s in samples.items():
            med, p90 = percentile(s, 0.5), percentile(s, 0.9)
            rec = {**meta, "kind": "case", "shape": c["shape"], "hidden": c["hidden"], "ffn": c["ffn"],
                   "tokens": c["tokens"], "variant": v, "median_us": med, "p90_us": p90, "iterations": len(s),
                   **case.extra.get(v, {})}
            if not v.startswith("comm_"):
                rec["flops_per_gpu"] = case.flops
                rec["tflops"] = case.flops / (med * 1e-6) / 1e12
            if rank == 0:
                print(f"{c['shape']:8s} {c['tokens']:6d} {v:8s} {med:11.1f} {p90:11.1f} {rec.get('tflops', 0.0):8.1f}",
                      flush=True)
                if out:
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
        del case
        torch.cuda.empty_cache()
    if out:
        out.close()
    dist.barrier(device_ids=[device.index])
    dist.destroy_process_group()
    if failures and rank == 0:
        print(f"tp_mlp_peer: {failures} gate failure(s): those variants were not timed", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
