#!/usr/bin/env bash
# Runs shardline-linear-bench and its torch peer (bench/peers/linear_peer.py) on one GPU in one command, ROUNDS
# process rounds (shardline, torch, shardline, torch ...), then prints the summary tables (plot_linear.py) and writes
# the PNG. Both sides measure the case list the bench prints (--list-cases), so shapes, M and dtypes are the same.
#
#   bench/linear/run_linear_bench.sh [OUT_DIR]          e.g. bench/linear/run_linear_bench.sh results/linear-h100
#
# Environment: BUILD (build), SUITE (full | quick), REGIMES (comma list; default all of the suite), ROUNDS (1),
# BENCH_ARGS (extra options for both sides, e.g. "--iters 10 --rounds 5"), SHARDLINE_COMMIT (default: git rev-parse),
# SHARDLINE_GEMM_TUNING / _TOP_K / _FILE (passed through to the bench: gemm_tuning.h).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$REPO/build}
OUT=${1:-$REPO/results/linear-$(date -u +%Y%m%dT%H%M%SZ)}
SUITE=${SUITE:-full}
REGIMES=${REGIMES:-}
ROUNDS=${ROUNDS:-1}
BENCH_ARGS=${BENCH_ARGS:-}
EXE=$BUILD/bench/linear/shardline-linear-bench
PEER=$REPO/bench/peers/linear_peer.py
export SHARDLINE_COMMIT=${SHARDLINE_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1

[[ -x $EXE ]] || { echo "run_linear_bench.sh: $EXE not built (cmake --build $BUILD --target shardline-linear-bench)" >&2; exit 2; }
mkdir -p "$OUT"
SEL=(--suite "$SUITE")
[[ -n $REGIMES ]] && SEL+=(--regimes "$REGIMES")
# shellcheck disable=SC2086
"$EXE" --list-cases "${SEL[@]}" $BENCH_ARGS > "$OUT/cases.json"
: > "$OUT/linear_shardline.jsonl"
: > "$OUT/linear_torch.jsonl"
status=0
for ((round = 1; round <= ROUNDS; ++round)); do
  echo "== round $round/$ROUNDS: shardline" >&2
  # shellcheck disable=SC2086
  "$EXE" "${SEL[@]}" --json "$OUT/linear_shardline.jsonl" $BENCH_ARGS >> "$OUT/linear_shardline.log" 2>&1 || status=1
  echo "== round $round/$ROUNDS: torch" >&2
  HOST=()
  [[ $REGIMES == "" || $REGIMES == *host* ]] || HOST=(--no-host)
  # shellcheck disable=SC2086
  python3 "$PEER" --cases "$OUT/cases.json" --json "$OUT/linear_torch.jsonl" "${HOST[@]}" $BENCH_ARGS \
    >> "$OUT/linear_torch.log" 2>&1 || status=1
done
grep -h "GATE FAILED" "$OUT"/linear_*.log >&2 || true
python3 "$REPO/bench/linear/plot_linear.py" "$OUT" --png "$OUT/linear.png" | tee "$OUT/summary.md"
echo "JSON, logs and plots in $OUT" >&2
exit $status
