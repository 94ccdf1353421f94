#!/usr/bin/env bash
# Runs shardline-tp-mlp-bench and its torch DTensor peer (bench/peers/tp_mlp_peer.py) on NP = 2 and 4 GPUs in one
# command (per NP: shardline, then torch, ROUNDS times), then prints the summary table (plot_tp_mlp.py) and writes the
# PNG. Both sides measure the case list the bench prints (--list-cases): same shapes, tokens, variants, iterations.
#
#   bench/tp_mlp/run_tp_mlp_bench.sh [OUT_DIR]         e.g. BUILD=build-gpu bench/tp_mlp/run_tp_mlp_bench.sh out/tpmlp
#
# Environment: BUILD (build), NPS ("2 4"), QUICK (0; 1: the 8b shape at 128 and 8192 tokens, 3 warm-ups, 2 rounds
# x 5 iterations), ROUNDS (1 process round per side and NP; the bench interleaves its variants in 5 rounds itself),
# BENCH_ARGS (extra options for the bench, e.g. "--shapes 70b --tokens 8192" or "--chunks 4"), PEER (1; 0: shardline
# only, no torch DTensor run: e.g. a second --chunks setting beside a first run that had it), PEER_ARGS (extra options
# for the peer, e.g. --block: run_mlp_block_bench.sh), MPIRUN_TIMEOUT (600 s per
# launch), SHARDLINE_COMMIT (default: git rev-parse --short HEAD). NVLink multicast stays off in every process.
# Output in OUT_DIR: cases.json, tp_mlp_{shardline,torch}.jsonl (every NP; records carry "tp"), one log per side and
# NP, summary.md, tp_mlp.png (when matplotlib is installed).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$REPO/build}
[[ $BUILD == /* ]] || BUILD=$REPO/$BUILD
OUT=${1:-$REPO/results/tp_mlp-$(date -u +%Y%m%dT%H%M%SZ)}
NPS=${NPS:-2 4}
QUICK=${QUICK:-0}
ROUNDS=${ROUNDS:-1}
BENCH_ARGS=${BENCH_ARGS:-}
PEER_ARGS=${PEER_ARGS:-}
RUN_PEER=${PEER:-1}
MPIRUN_TIMEOUT=${MPIRUN_TIMEOUT:-600}
EXE=$BUILD/bench/tp_mlp/shardline-tp-mlp-bench
PEER_PY=$REPO/bench/peers/tp_mlp_peer.py

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONUNBUFFERED=1
export SHARDLINE_COMMIT=${SHARDLINE_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}

if [[ ! -x $EXE ]]; then
  echo "run_tp_mlp_bench.sh: $EXE not built (cmake --build $BUILD --target shardline-tp-mlp-bench)" >&2
  exit 2
fi
command -v mpirun >/dev/null || { echo "run_tp_mlp_bench.sh: mpirun not found" >&2; exit 2; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

SEL=(--suite full)
[[ $QUICK == 1 ]] && SEL=(--suite quick)
mkdir -p "$OUT"
# shellcheck disable=SC2086
"$EXE" --list-cases "${SEL[@]}" $BENCH_ARGS > "$OUT/cases.json"
: > "$OUT/tp_mlp_shardline.jsonl"
: > "$OUT/tp_mlp_torch.jsonl"

ROOT_FLAGS=()
[[ $(id -u) == 0 ]] && ROOT_FLAGS=(--allow-run-as-root)
status=0
start=$SECONDS
for NP in $NPS; do
  if (( GPUS < NP )); then
    echo "run_tp_mlp_bench.sh: NP=$NP needs $NP GPUs, $GPUS visible: skipped" >&2
    status=1
    continue
  fi
  MPIRUN=(mpirun -n "$NP" "${ROOT_FLAGS[@]}" --bind-to none --timeout "$MPIRUN_TIMEOUT"
          -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x SHARDLINE_COMMIT
          -x PYTHONUNBUFFERED)
  for ((round = 1; round <= ROUNDS; ++round)); do
    echo "== np $NP round $round/$ROUNDS: shardline ($((SECONDS - start)) s)" >&2
    # shellcheck disable=SC2086
    "${MPIRUN[@]}" "$EXE" "${SEL[@]}" --json "$OUT/tp_mlp_shardline.jsonl" $BENCH_ARGS 2>&1 \
      | tee -a "$OUT/tp_mlp_shardline_np$NP.log" || status=1
    [[ $RUN_PEER == 1 ]] || continue
    echo "== np $NP round $round/$ROUNDS: torch DTensor ($((SECONDS - start)) s)" >&2
    "${MPIRUN[@]}" -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$((29500 + RANDOM % 1000)) \
      python3 "$PEER_PY" --cases "$OUT/cases.json" --json "$OUT/tp_mlp_torch.jsonl" $PEER_ARGS 2>&1 \
      | tee -a "$OUT/tp_mlp_torch_np$NP.log" || status=1
  done
done
echo "== done in $((SECONDS - start)) s" >&2
grep -h "GATE FAILED" "$OUT"/tp_mlp_*.log >&2 && status=1
python3 "$REPO/bench/tp_mlp/plot_tp_mlp.py" "$OUT" --png "$OUT/tp_mlp.png" | tee "$OUT/summary.md" || status=1
echo "JSON, logs, summary.md and the plot in $OUT" >&2
exit $status
