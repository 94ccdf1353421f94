#!/usr/bin/env bash
# A GPU timeline of any CUDA program without Nsight Systems, and where each training step's time goes: runs the
# command with the CUPTI tracer (cupti_trace.cc, built as libshardline-cupti-trace.so) injected through
# CUDA_INJECTION64_PATH, then bench/timeline/trace_summary.py on the trace: per step the GPU busy and idle time, the
# step's GEMM time as measured inside the run and step / GEMM, the idle gaps with the host calls in them, the kernels.
#
#   bench/timeline/trace.sh OUT_DIR -- COMMAND [ARGS...]     env: BUILD (build), STEPS (10), MARKER (AdamW)
# e.g. the README's GPU job (issue 14):
#   BUILD=build-gpu bench/timeline/trace.sh out/tl -- build-gpu/examples/train_char_lm \
#       --config examples/configs/char_lm_gpu.json --steps 30 --eval-interval 1000000 --log-interval 10 --sample-chars 0
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="${1:?usage: trace.sh OUT_DIR -- COMMAND [ARGS...]}"
shift
[[ "${1:-}" == "--" ]] && shift
build="${BUILD:-$root/build}"
[[ "$build" = /* ]] || build="$PWD/$build"
lib="$build/bench/timeline/libshardline-cupti-trace.so"
[[ -f "$lib" ]] || { echo "trace.sh: $lib not built (cmake --build $build --target shardline-cupti-trace)" >&2; exit 2; }
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export NCCL_NVLS_ENABLE=0
CUPTI_TRACE_OUT="$out/trace.csv" CUDA_INJECTION64_PATH="$lib" "$@" | tee "$out/command.log"
python3 "$root/bench/timeline/trace_summary.py" "$out/trace.csv" --steps "${STEPS:-10}" --marker "${MARKER:-AdamW}" \
  --json "$out/summary.json" | tee "$out/summary.txt"
gzip -f "$out/trace.csv"
