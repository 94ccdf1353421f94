#!/usr/bin/env bash
# The README's run command: sets up, builds, and runs the main job. Until the mpirun training example exists
# (step 5), the main job is the single-process fused-Linear demo: on the GPU when one is present, else the CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
bash "$root/scripts/setup.sh"
cd "$root"
exec "${SHARDLINE_BUILD_DIR:-build}/examples/linear_demo" "$@"
