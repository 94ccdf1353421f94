#!/usr/bin/env python3
"""torch.distributed (NCCL) peer of shardline-comm-bench: all_reduce, all_gather_into_tensor, reduce_scatter_tensor at
the same sizes, with the same timing and the same JSON-lines schema (impl "torch").

Launch with torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or mpirun (OMPI_COMM_WORLD_*; MASTER_ADDR/MASTER_PORT default to
127.0.0.1:29533). bytes is the larger buffer, as in nccl-tests; algbw = bytes / t, busbw = algbw * 2(n-1)/n for
all_reduce and (n-1)/n for all_gather and reduce_scatter. Each iteration is timed with CUDA events on the current
stream around the (synchronous-to-the-stream) call; the per-iteration time is the max over ranks; median and p90.
shardline-comm-bench times its calls the same way (events around the call and its Wait(host=False), no host sync in
between), so the two "us per call" compare like for like; when the host path is slower than the kernel, that time is
host path + kernel. --mode back_to_back instead times --iters calls back to back plus one synchronize on the host
clock (per call, max over ranks; median = p90 = that number): the throughput view, as shardline-comm-host-bench's e2e_us.
"""

import argparse
import datetime
import json
import os
import time

from peer_util import commit, no_nvlink_multicast, percentile, rank_env

no_nvlink_multicast("comm_peer")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def bus_factor(op, n):
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def measure(op, nbytes, n, dtype, warmup, iters, device, mode="events"):
    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(nbytes // elem, n)
    count = count // n * n
    big = torch.randn(count, dtype=dtype, device=device)
    small = torch.randn(count // n, dtype=dtype, device=device)

    if op == "all_reduce":
        def run():
            dist.all_reduce(big, op=dist.ReduceOp.SUM)
    elif op == "all_gather":
        def run():
            dist.all_gather_into_tensor(big, small)
    elif op == "reduce_scatter":
        def run():
            dist.reduce_scatter_tensor(small, big, op=dist.ReduceOp.SUM)
    else:
        raise ValueError(f"unknown op {op}")

    for _ in range(warmup):
        run()
    torch.cuda.synchronize(device)
    if mode == "back_to_back":
        dist.barrier(device_ids=[device.index])
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(iters):
            run()
        torch.cuda.synchronize(device)
        per_call = torch.tensor([(time.perf_counter() - start) * 1e6 / iters], dtype=torch.float64, device=device)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        return per_call.item(), per_call.item()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)
    for start, stop in events:
        start.record()
        run()
        stop.record()
    torch.cuda.synchronize(device)
    times = torch.tensor([s.elapsed_time(e) * 1000.0 for s, e in events], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets each iteration's time
    times = times.cpu().tolist()
    return percentile(times, 0.5), percentile(times, 0.9)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--min-bytes", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=1 << 30)
    parser.add_argument("--factor", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--json", default="")
    parser.add_argument("--mode", default="events", choices=["events", "back_to_back"],
                        help="events: per-call CUDA events (as shardline-comm-bench); back_to_back: N calls + 1 sync")
    args = parser.parse_args()

    rank, size, local = rank_env("comm_peer.py")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=device)
    dtype = DTYPES[args.dtype]
    dtype_name = str(dtype).replace("torch.", "")
    name = torch.cuda.get_device_name(device)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    rev = commit()
    out = open(args.json, "a") if (rank == 0 and args.json) else None
    if rank == 0:
        print(f"# torch {torch.__version__} NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, {size} ranks, "
              f"{name}, {dtype_name}, commit {rev}, {date}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
        print(f"{'op':15s} {'bytes':>12s} {'median_us':>12s} {'p90_us':>12s} {'algbw':>10s} {'busbw':>10s}")
    for op in [o for o in args.ops.split(",") if o]:
        nbytes = args.min_bytes
        while nbytes <= args.max_bytes:
            median, p90 = measure(op, nbytes, size, dtype, args.warmup, args.iters, device, args.mode)
            algbw = nbytes / (median * 1e-6) / 1e9
            busbw = algbw * bus_factor(op, size)
            if rank == 0:
                print(f"{op:15s} {nbytes:12d} {median:12.2f} {p90:12.2f} {algbw:10.2f} {busbw:10.2f}", flush=True)
                if out:
                    out.write(json.dumps({"impl": "torch", "device": name, "date": date, "commit": rev,
                                          "ranks": size, "dtype": dtype_name, "op": op, "bytes": nbytes,
                                          "median_us": median, "p90_us": p90, "algbw": algbw,
                                          "busbw": busbw, "mode": args.mode}) + "\n")
                    out.flush()
            nbytes *= args.factor
    if out:
        out.close()
    dist.barrier(device_ids=[device.index])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
