#!/usr/bin/env bash
# Issue 18 item 4: the MLP block (Linear + bias → GELU(tanh) → Linear + bias, bf16) forward + backward on ONE GPU
# against its floor (the six GEMMs of the step alone, timed by the bench), torch eager and torch.compile of the same
# module, all in one command. The shapes are the local shards of Llama 3 8B at tp 1 and tp 4 and of 70B at tp 4; 2048
# and 8192 tokens. It is run_tp_mlp_bench.sh at NP 1 with those shapes and the peer's --block; the summary's second
# table has T / floor against the target (<= 1.05) and torch's times against the same floor.
#
#   BUILD=build-gpu bench/tp_mlp/run_mlp_block_bench.sh [OUT_DIR]
#
# Environment as run_tp_mlp_bench.sh (BUILD, ROUNDS, MPIRUN_TIMEOUT); TOKENS ("2048,8192").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shapes="--shape 8b-tp1:4096:14336 --shape 8b-tp4:4096:3584 --shape 70b-tp4:8192:7168"
NPS=1 PEER_ARGS="--block" BENCH_ARGS="$shapes --tokens ${TOKENS:-2048,8192} --variants tp" \
  exec "$here/run_tp_mlp_bench.sh" "$@"
