#!/usr/bin/env bash
# Where one training step's GPU time goes: runs the README's GPU job (train_char_lm, char_lm_gpu.json, tp 1) for a few
# steps under Nsight Compute, timing every kernel (gpu__time_duration, clocks left alone), and prints the kernels of
# the last step (the launches after the previous step's AdamW kernels up to the last AdamW kernel) grouped by name.
#
#   bench/char_lm/kernel_profile.sh [BUILD_DIR]      env: STEPS (4), OUT (bench/results), CONFIG, EXTRA_ARGS
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
build="${1:-${SHARDLINE_BUILD_DIR:-build}}"
config="${CONFIG:-examples/configs/char_lm_gpu.json}"
steps="${STEPS:-4}"
out_dir="${OUT:-bench/results}"
mkdir -p "$out_dir"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)"
csv="$out_dir/char_lm_kernels.csv"
work="$(mktemp -d)"
# shellcheck disable=SC2086
(cd "$work" && "$ncu_bin" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
   "$root/$build/examples/train_char_lm" --config "$root/$config" --steps "$steps" --eval-interval 1000000 \
   --log-interval "$steps" --sample-chars 0 ${EXTRA_ARGS:-}) >"$csv"
rm -rf "$work"
python3 "$root/bench/char_lm/kernel_profile_summary.py" "$csv" | tee "$out_dir/char_lm_kernels.txt"
