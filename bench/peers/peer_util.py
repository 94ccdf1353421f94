"""Helpers the torch peers share (no torch import here): run metadata, percentiles, the rank from torchrun or mpirun,
and the NVLink-multicast guard that must run before torch is imported."""

import os
import subprocess
import sys


def no_nvlink_multicast(prog):
    """NVLink multicast can put shared GPUs out of service (GPU_HOSTS.md): never let NCCL, torch symmetric memory or
    NVSHMEM use it, whatever the environment says. Call before importing torch."""
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        if "NCCL_NVLS_ENABLE" in os.environ:
            print(f"{prog}: NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} overridden to 0", file=sys.stderr)
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def rank_env(prog, default_port="29533"):
    """(rank, world size, local rank) from torchrun (RANK, WORLD_SIZE, LOCAL_RANK) or mpirun (OMPI_COMM_WORLD_*; then
    MASTER_ADDR/MASTER_PORT default to 127.0.0.1:default_port)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        size = int(os.environ["OMPI_COMM_WORLD_SIZE"])
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", default_port)
        return rank, size, local
    sys.exit(f"{prog}: launch with torchrun or mpirun (no RANK / OMPI_COMM_WORLD_RANK in the environment)")


def commit():
    """SHARDLINE_COMMIT when set (the run scripts export it), else `git rev-parse --short HEAD`, else "unknown"."""
    if os.environ.get("SHARDLINE_COMMIT"):
        return os.environ["SHARDLINE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - no git, no repository: still a benchmark
        return "unknown"


def percentile(values, q):
    """The q-quantile with linear interpolation (numpy's default; bench/common/bench_util.h's Percentile)."""
    v = sorted(values)
    if not v:
        return 0.0
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
