#!/usr/bin/env bash
# The README's run command: sets up (installs missing packages when root), builds, and runs the main job,
# examples/train_char_lm, through shardline-run: on 2 GPUs when there are 2 or more (1 when there is one), with NCCL;
# otherwise on 2 CPU ranks with MPI. Extra arguments go to train_char_lm (e.g. --steps 100, --tp 2, --dp 1).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
bash "$root/scripts/setup.sh"
cd "$root"
build="${SHARDLINE_BUILD_DIR:-build}"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l | tr -d ' ')"
fi
# (Read the whole report first: with pipefail, grep -q leaving early would SIGPIPE shardline-info and fail the test.)
info="$("$build/tools/shardline-info" 2>/dev/null || true)"
if [[ "$gpus" -ge 1 && -x "$build/examples/train_char_lm" ]] && grep -q '"cuda": *true' <<<"$info"; then
  ranks=$(( gpus >= 2 ? 2 : 1 ))
  config="${SHARDLINE_RUN_CONFIG:-examples/configs/char_lm_gpu.json}"
else
  ranks=2
  config="${SHARDLINE_RUN_CONFIG:-examples/configs/char_lm_cpu.json}"
fi
exec "$build/launch/shardline-run" -n "$ranks" -- "$build/examples/train_char_lm" --config "$config" "$@"
