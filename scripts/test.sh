#!/usr/bin/env bash
# The README's test command: sets up, builds, and runs every test (labels cpu, cuda, dist, package). CUDA tests
# skip with the reason when no GPU is present.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
bash "$root/scripts/setup.sh" "$@"
cd "$root"
ctest --test-dir "${SHARDLINE_BUILD_DIR:-build}" --output-on-failure -j "${SHARDLINE_JOBS:-$(nproc)}"
