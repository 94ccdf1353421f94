#!/usr/bin/env bash
# The README's GPU job against the same model in PyTorch, on one GPU, in one command (issue 14): shardline's
# examples/train_char_lm with examples/configs/char_lm_gpu.json at tp 1, then bench/peers/char_lm_peer.py in its modes
# (eager, embeddingbag, compile). Prints a table of ms/step over steps SKIP+1..STEPS (the same window for both),
# tokens/s and TFLOP/s; JSON lines go to $OUT (or bench/results) as char_lm_bench.jsonl.
#
#   bench/char_lm/run_char_lm_bench.sh [BUILD_DIR]     env: STEPS (default the config's), MODES, SKIP (10)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
build="${1:-${SHARDLINE_BUILD_DIR:-build}}"
config="${CONFIG:-examples/configs/char_lm_gpu.json}"
modes="${MODES:-eager embeddingbag compile}"
skip="${SKIP:-10}"
out_dir="${OUT:-bench/results}"
mkdir -p "$out_dir"
json="$out_dir/char_lm_bench.jsonl"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export SHARDLINE_COMMIT="${SHARDLINE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
steps_args=()
[[ -n "${STEPS:-}" ]] && steps_args=(--steps "$STEPS")

metrics="$(mktemp -d)"
(cd "$metrics" && "$root/$build/launch/shardline-run" -n 1 -- "$root/$build/examples/train_char_lm" \
   --config "$root/$config" "${steps_args[@]}") | tee "$out_dir/char_lm_shardline.log"
# The progress lines' windows open after each line and each evaluation, so the window of a line at step s holds
# s - (previous line's step) steps: weight each line's ms/step by that to get the mean over steps skip+1.. .
python3 - "$metrics/train_char_lm_metrics.jsonl" "$skip" "$json" "$config" <<'PY'
import datetime, json, os, sys
path, skip, out, config = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
recs = [json.loads(l) for l in open(path)]
total_ms, total_steps, prev = 0.0, 0, 0
for r in recs:
    steps = r["step"] - prev
    if prev >= skip:
        total_ms += r["ms_per_step"] * steps
        total_steps += steps
    prev = r["step"]
ms = total_ms / total_steps
first, last = recs[0], recs[-1]
tok = last["tokens_per_s"] * last["ms_per_step"] / ms
rec = {"impl": "shardline", "mode": "tp1", "date": datetime.date.today().isoformat(),
       "commit": os.environ.get("SHARDLINE_COMMIT"), "config": config, "ms_per_step": ms, "timed_steps": total_steps,
       "tokens_per_s": tok, "tflops": last["tflops_per_device"] * last["ms_per_step"] / ms,
       "losses": [[r["step"], r["loss"]] for r in recs], "val_loss": last.get("val_loss"),
       "peak_gpu_mem_gib": last.get("peak_gpu_mem_gib")}
print(f"shardline {'tp1':>16}: {ms:.2f} ms/step over {total_steps} steps, {tok:.0f} tok/s, {rec['tflops']:.1f} TFLOP/s,"
      f" peak {rec['peak_gpu_mem_gib'] or float('nan'):.2f} GiB, loss {first['loss']:.3f} -> {last['loss']:.3f}")
with open(out, "a") as f:
    f.write(json.dumps(rec) + "\n")
PY
rm -rf "$metrics"
for mode in $modes; do
  python3 bench/peers/char_lm_peer.py --config "$config" --mode "$mode" --skip "$skip" "${steps_args[@]}" --json "$json"
done
echo
echo "== char LM, one GPU ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)), commit $SHARDLINE_COMMIT"
python3 - "$json" "$SHARDLINE_COMMIT" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if json.loads(l).get("commit") == sys.argv[2]]
base = next((r for r in recs if r["impl"] == "shardline"), None)
print(f"{'impl':>10} {'mode':>13} {'ms/step':>8} {'tok/s':>9} {'TFLOP/s':>8} {'peak GiB':>8} {'vs shardline':>12}")
for r in recs:
    ratio = r["ms_per_step"] / base["ms_per_step"] if base else float("nan")
    peak = r.get("peak_gpu_mem_gib") or float("nan")
    print(f"{r['impl']:>10} {r['mode']:>13} {r['ms_per_step']:8.2f} {r['tokens_per_s']:9.0f} {r['tflops']:8.1f} "
          f"{peak:8.2f} {ratio:12.2f}")
PY
