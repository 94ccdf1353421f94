#!/usr/bin/env bash
# Runs shardline-moe-bench and its torch peer (bench/peers/moe_peer.py: softmax top-k router, sort-based permutation,
# torch._grouped_mm experts) on one GPU in one command, ROUNDS process rounds (shardline, torch, ...), then prints per
# case the tokens/s of both, their ratio, the ratio's ceiling (shardline's non-GEMM time at zero), the non-GEMM share
# of both, shardline's byte floor of that share, and shardline's tokens/s and share with both steps replayed from CUDA
# graphs (summary.md). Both sides take the case list the
# bench prints (--list-cases).
#
#   bench/moe/run_moe_bench.sh [OUT_DIR]        e.g. bench/moe/run_moe_bench.sh results/moe-h100
#
# Environment: BUILD (build), ROUNDS (1), BENCH_ARGS (extra options for both sides, e.g. "--iters 10 --rounds 3"),
# SHARDLINE_COMMIT (default: git rev-parse). Targets (issue 16): >= 1.2x the torch reference, non-GEMM share <= 15 %.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$REPO/build}
OUT=${1:-$REPO/results/moe-$(date -u +%Y%m%dT%H%M%SZ)}
ROUNDS=${ROUNDS:-1}
BENCH_ARGS=${BENCH_ARGS:-}
EXE=$BUILD/bench/moe/shardline-moe-bench
PEER=$REPO/bench/peers/moe_peer.py
export SHARDLINE_COMMIT=${SHARDLINE_COMMIT:-$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1

[[ -x $EXE ]] || { echo "run_moe_bench.sh: $EXE not built (cmake --build $BUILD --target shardline-moe-bench)" >&2; exit 2; }
mkdir -p "$OUT"
"$EXE" --list-cases > "$OUT/cases.json"
: > "$OUT/moe_shardline.jsonl"
: > "$OUT/moe_torch.jsonl"
status=0
for ((round = 1; round <= ROUNDS; ++round)); do
  echo "== round $round/$ROUNDS: shardline" >&2
  # shellcheck disable=SC2086
  "$EXE" --json "$OUT/moe_shardline.jsonl" $BENCH_ARGS 2>&1 | tee -a "$OUT/moe_shardline.log" || status=1
  echo "== round $round/$ROUNDS: torch" >&2
  # shellcheck disable=SC2086
  python3 "$PEER" --cases "$OUT/cases.json" --json "$OUT/moe_torch.jsonl" $BENCH_ARGS 2>&1 \
    | tee -a "$OUT/moe_torch.log" || status=1
done
grep -h "GATE FAILED" "$OUT"/moe_*.log >&2 || true
python3 - "$OUT" <<'PY' | tee "$OUT/summary.md"
import json, statistics, sys
out = sys.argv[1]
def load(name):
    recs = {}
    for line in open(f"{out}/{name}"):
        r = json.loads(line)
        recs.setdefault(r["case"], []).append(r)
    return recs
sl, th = load("moe_shardline.jsonl"), load("moe_torch.jsonl")
med = lambda rs, key: statistics.median(r[key] for r in rs)
print("| case | shardline tokens/s | torch tokens/s | ratio | ratio ceiling | shardline non-GEMM | floor | "
      "torch non-GEMM | shardline tokens/s, CUDA graph | shardline non-GEMM, CUDA graph |")
print("|---|---|---|---|---|---|---|---|---|---|")
for case in sl:
    s = med(sl[case], "tokens_per_s")
    t = med(th[case], "tokens_per_s") if case in th else float("nan")
    # ratio ceiling: shardline's tokens/s if only its six grouped GEMMs took time, over torch's
    ceiling = sl[case][0]["tokens"] / (med(sl[case], "gemm_median_us") * 1e-6) / t
    floor = 100 * med(sl[case], "floor_share") if "floor_share" in sl[case][0] else float("nan")
    graphed = "non_gemm_share_graph" in sl[case][0]
    graph_tps = med(sl[case], "tokens_per_s_graph") if graphed else float("nan")
    graph_share = 100 * med(sl[case], "non_gemm_share_graph") if graphed else float("nan")
    print(f"| {case} | {s:,.0f} | {t:,.0f} | {s / t:.2f}x | {ceiling:.2f}x | "
          f"{100 * med(sl[case], 'non_gemm_share'):.1f} % | {floor:.1f} % | "
          f"{100 * med(th[case], 'non_gemm_share') if case in th else float('nan'):.1f} % | "
          f"{graph_tps:,.0f} | {graph_share:.1f} % |")
print()
print("ratio ceiling: shardline's tokens/s with its non-GEMM time at zero (the six grouped GEMMs alone), over "
      "torch's; floor: the non-GEMM share if the permutation, combine and GELU kernels moved their bytes at the "
      "device's copy bandwidth and nothing else took time (bench/moe/moe_bench.cc); CUDA graph: the layer step and "
      "the six GEMMs each replayed from a captured graph (no launch gaps; torch's layer reads its loads on the host "
      "and stays eager)")
PY
echo "JSON and logs in $OUT" >&2
exit $status
