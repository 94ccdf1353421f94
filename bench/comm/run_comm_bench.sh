#!/usr/bin/env bash
# Runs shardline-comm-bench and its torch.distributed peer on N GPUs in one command, ROUNDS interleaved rounds
# (A B A B ...), and prints the side-by-side table (median over rounds; ratio = busbw shardline / torch).
#
#   bench/comm/run_comm_bench.sh N [OUT_DIR]        e.g. bench/comm/run_comm_bench.sh 4 results/comm-4xh200
#
# Environment: BUILD (build), ROUNDS (3), BENCH_ARGS (extra options for both, e.g. "--max-bytes 67108864"),
# SHARDLINE_COMMIT (default: git rev-parse --short HEAD). NCCL_NVLS_ENABLE=0 is kept (and forced) for every rank.
set -euo pipefail

N=${1:?usage: run_comm_bench.sh N [OUT_DIR]}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$REPO/build}
OUT=${2:-$REPO/results/comm-$(date -u +%Y%m%dT%H%M%SZ)-np$N}
ROUNDS=${ROUNDS:-3}
BENCH_ARGS=${BENCH_ARGS:-}
EXE=$BUILD/bench/comm/shardline-comm-bench
PEER=$REPO/bench/peers/comm_peer.py

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export SHARDLINE_COMMIT=${SHARDLINE_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}

[[ -x $EXE ]] || { echo "run_comm_bench.sh: $EXE not built (cmake --build $BUILD --target shardline-comm-bench)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "run_comm_bench.sh: mpirun not found" >&2; exit 2; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
(( GPUS >= N )) || { echo "run_comm_bench.sh: $N ranks need $N GPUs, $GPUS visible" >&2; exit 2; }

ROOT_FLAGS=()
[[ $(id -u) == 0 ]] && ROOT_FLAGS=(--allow-run-as-root)
MPIRUN=(mpirun -n "$N" "${ROOT_FLAGS[@]}" --bind-to none -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST
        -x NVSHMEM_DISABLE_NVLS -x SHARDLINE_COMMIT)

mkdir -p "$OUT"
: > "$OUT/comm_shardline.jsonl"
: > "$OUT/comm_torch.jsonl"
for ((round = 1; round <= ROUNDS; ++round)); do
  echo "== round $round/$ROUNDS: shardline" >&2
  # shellcheck disable=SC2086
  "${MPIRUN[@]}" "$EXE" --json "$OUT/comm_shardline.jsonl" $BENCH_ARGS >> "$OUT/comm_shardline.log" 2>&1
  echo "== round $round/$ROUNDS: torch" >&2
  # shellcheck disable=SC2086
  "${MPIRUN[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$((29500 + RANDOM % 1000)) \
    python3 "$PEER" --json "$OUT/comm_torch.jsonl" $BENCH_ARGS >> "$OUT/comm_torch.log" 2>&1
done

python3 - "$OUT" <<'PY'
import collections, json, statistics, sys
out = sys.argv[1]
rows = collections.defaultdict(lambda: collections.defaultdict(list))
meta = {}
for impl in ("shardline", "torch"):
    with open(f"{out}/comm_{impl}.jsonl") as f:
        for line in f:
            r = json.loads(line)
            rows[(r["op"], r["bytes"])][impl].append(r)
            meta = meta or r
def med(rs, key):
    return statistics.median(r[key] for r in rs) if rs else float("nan")
print(f"# {meta.get('ranks')} x {meta.get('device')}, {meta.get('dtype')}, commit {meta.get('commit')}, "
      f"{meta.get('date')}; median over rounds; ratio = busbw shardline / torch")
print(f"{'op':15s} {'bytes':>11s} {'sl_us':>10s} {'torch_us':>10s} {'sl_busbw':>9s} {'t_busbw':>9s} {'ratio':>6s}")
summary = []
for (op, nbytes) in sorted(rows, key=lambda k: (k[0], k[1])):
    sl, th = rows[(op, nbytes)]["shardline"], rows[(op, nbytes)]["torch"]
    sb, tb = med(sl, "busbw"), med(th, "busbw")
    ratio = sb / tb if tb and tb == tb and tb > 0 else float("nan")
    print(f"{op:15s} {nbytes:11d} {med(sl, 'median_us'):10.2f} {med(th, 'median_us'):10.2f} {sb:9.2f} {tb:9.2f} "
          f"{ratio:6.3f}")
    if nbytes >= 64 << 20:
        summary.append((op, nbytes, ratio))
    if nbytes <= 1 << 16:
        summary.append((op, nbytes, med(sl, "median_us")))
big = [r for (_, b, r) in summary if b >= 64 << 20]
small = [r for (_, b, r) in summary if b <= 1 << 16]
if big:
    print(f"# >= 64 MiB: busbw ratio min {min(big):.3f}, median {statistics.median(big):.3f} (target >= 0.95)")
if small:
    print(f"# <= 64 KiB: shardline median latency max {max(small):.2f} us (target <= 20 us)")
PY
echo "JSON and logs in $OUT" >&2
