#!/usr/bin/env bash
# Runs shardline-grouped-bench and its torch peer (bench/peers/grouped_peer.py: torch._grouped_mm and a loop of
# F.linear) on one GPU in one command, ROUNDS process rounds (shardline, torch, shardline, torch ...), then prints the
# summary table (plot_grouped.py) and writes the PNG. Both sides take the case list the bench prints (--list-cases),
# so the group sizes are the same.
#
#   bench/grouped/run_grouped_bench.sh [OUT_DIR]        e.g. bench/grouped/run_grouped_bench.sh results/grouped-h100
#
# Environment: BUILD (build), ROUNDS (1), BENCH_ARGS (extra options for both sides, e.g. "--iters 10 --rounds 3"),
# SHARDLINE_ARGS (extra options for the shardline bench only, e.g. "--variants auto-device,auto-device-serial"),
# SHARDLINE_COMMIT (default: git rev-parse).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$REPO/build}
OUT=${1:-$REPO/results/grouped-$(date -u +%Y%m%dT%H%M%SZ)}
ROUNDS=${ROUNDS:-1}
BENCH_ARGS=${BENCH_ARGS:-}
EXE=$BUILD/bench/grouped/shardline-grouped-bench
PEER=$REPO/bench/peers/grouped_peer.py
export SHARDLINE_COMMIT=${SHARDLINE_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1

[[ -x $EXE ]] || { echo "run_grouped_bench.sh: $EXE not built (cmake --build $BUILD --target shardline-grouped-bench)" >&2; exit 2; }
mkdir -p "$OUT"
"$EXE" --list-cases > "$OUT/cases.json"
: > "$OUT/grouped_shardline.jsonl"
: > "$OUT/grouped_torch.jsonl"
status=0
for ((round = 1; round <= ROUNDS; ++round)); do
  echo "== round $round/$ROUNDS: shardline" >&2
  # shellcheck disable=SC2086
  "$EXE" --json "$OUT/grouped_shardline.jsonl" $BENCH_ARGS ${SHARDLINE_ARGS:-} 2>&1 | tee -a "$OUT/grouped_shardline.log" || status=1
  echo "== round $round/$ROUNDS: torch" >&2
  # shellcheck disable=SC2086
  python3 "$PEER" --cases "$OUT/cases.json" --json "$OUT/grouped_torch.jsonl" $BENCH_ARGS 2>&1 \
    | tee -a "$OUT/grouped_torch.log" || status=1
done
grep -h "GATE FAILED" "$OUT"/grouped_*.log >&2 || true
python3 "$REPO/bench/grouped/plot_grouped.py" "$OUT" --png "$OUT/grouped.png" | tee "$OUT/summary.md"
echo "JSON, logs and plots in $OUT" >&2
exit $status
