#!/usr/bin/env bash
# Runs shardline-moe-ep-bench and its torch peer (bench/peers/moe_ep_peer.py: all_to_all_single + torch._grouped_mm, as
# Megatron's all-to-all dispatcher) with ep = NP ranks, one GPU each, in one command, for each NP of NPS that fits the
# GPUs; then prints per (case, ep) the tokens/s of both, their ratio and the all-to-all share of both (summary.md).
#
#   BUILD=build-gpu bench/moe/run_moe_ep_bench.sh [OUT_DIR]
#
# Environment: BUILD (build), NPS ("2 4"), ROUNDS (1), BENCH_ARGS (extra options for both sides, e.g. "--cases
# mixtral-8x7b --iters 5"), MPIRUN_TIMEOUT (600 s per mpirun), SHARDLINE_COMMIT. NVLink multicast stays off.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$REPO/build}
[[ $BUILD == /* ]] || BUILD=$REPO/$BUILD
OUT=${1:-$REPO/results/moe-ep-$(date -u +%Y%m%dT%H%M%SZ)}
NPS=${NPS:-2 4}
ROUNDS=${ROUNDS:-1}
BENCH_ARGS=${BENCH_ARGS:-}
MPIRUN_TIMEOUT=${MPIRUN_TIMEOUT:-600}
EXE=$BUILD/bench/moe/shardline-moe-ep-bench
PEER=$REPO/bench/peers/moe_ep_peer.py
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SHARDLINE_COMMIT=${SHARDLINE_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}

[[ -x $EXE ]] || { echo "run_moe_ep_bench.sh: $EXE not built (cmake --build $BUILD --target shardline-moe-ep-bench)" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "run_moe_ep_bench.sh: mpirun not found" >&2; exit 2; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
mkdir -p "$OUT"
"$EXE" --list-cases > "$OUT/cases.json"
: > "$OUT/moe_ep_shardline.jsonl"
: > "$OUT/moe_ep_torch.jsonl"
ROOT_FLAGS=()
[[ $(id -u) == 0 ]] && ROOT_FLAGS=(--allow-run-as-root)
status=0
for NP in $NPS; do
  if (( GPUS < NP )); then
    echo "run_moe_ep_bench.sh: NP=$NP needs $NP GPUs, $GPUS visible: skipped" >&2
    continue
  fi
  MPIRUN=(mpirun -n "$NP" "${ROOT_FLAGS[@]}" --bind-to none --timeout "$MPIRUN_TIMEOUT"
          -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x SHARDLINE_COMMIT
          -x PYTHONUNBUFFERED)
  for ((round = 1; round <= ROUNDS; ++round)); do
    echo "== ep $NP round $round/$ROUNDS: shardline" >&2
    # shellcheck disable=SC2086
    "${MPIRUN[@]}" "$EXE" --json "$OUT/moe_ep_shardline.jsonl" $BENCH_ARGS 2>&1 | tee -a "$OUT/moe_ep_shardline_np$NP.log" \
      || status=1
    echo "== ep $NP round $round/$ROUNDS: torch" >&2
    # shellcheck disable=SC2086
    "${MPIRUN[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$((29500 + RANDOM % 1000)) \
      python3 "$PEER" --case-file "$OUT/cases.json" --json "$OUT/moe_ep_torch.jsonl" $BENCH_ARGS 2>&1 \
      | tee -a "$OUT/moe_ep_torch_np$NP.log" || status=1
  done
done
grep -h "GATE FAILED" "$OUT"/moe_ep_*.log >&2 && status=1
python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
out = sys.argv[1]
def load(name):
    recs = {}
    for line in open(f"{out}/{name}"):
        r = json.loads(line)
        recs.setdefault((r["case"], r["ep"]), []).append(r)
    return recs
sl, th = load("moe_ep_shardline.jsonl"), load("moe_ep_torch.jsonl")
med = lambda rs, key: statistics.median(r[key] for r in rs)
print("| case | ep | shardline tokens/s | torch tokens/s | ratio | shardline a2a share | torch a2a share |")
print("|---|---|---|---|---|---|---|")
for key in sl:
    s = med(sl[key], "tokens_per_s")
    t = med(th[key], "tokens_per_s") if key in th else float("nan")
    ta = 100 * med(th[key], "a2a_share") if key in th else float("nan")
    print(f"| {key[0]} | {key[1]} | {s:,.0f} | {t:,.0f} | {s / t:.2f}x | {100 * med(sl[key], 'a2a_share'):.1f} % | "
          f"{ta:.1f} % |")
PY
echo "JSON and logs in $OUT" >&2
exit $status
