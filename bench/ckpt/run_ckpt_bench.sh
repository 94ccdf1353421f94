#!/usr/bin/env bash
# run_ckpt_bench.sh DIR [GIB] [BUILD]: the disk's sequential write and read speed (dd, 16 MiB blocks, fdatasync; the
# page cache dropped before the read when root) and ckpt_bench's save/load GB/s and async-save stall, in one command,
# on the same directory. Targets (issue 17): save and load >= 0.8x the disk, stall <= 1.1x the device-to-host copy.
set -euo pipefail
dir="${1:?usage: run_ckpt_bench.sh DIR [GIB] [BUILD]}"
gib="${2:-4}"
build="${3:-build}"
mkdir -p "$dir"
blocks=$((gib * 64))
drop() { sync; { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null || echo "run_ckpt_bench: cannot drop the page cache (not root): the read may come from memory" >&2; }
echo "== dd write ${gib} GiB"
dd if=/dev/zero of="$dir/dd.bin" bs=16M count="$blocks" conv=fdatasync 2>&1 | tail -1
drop
echo "== dd read ${gib} GiB"
dd if="$dir/dd.bin" of=/dev/null bs=16M 2>&1 | tail -1
rm -f "$dir/dd.bin"
echo "== ckpt_bench"
"$build/bench/ckpt/ckpt_bench" --dir "$dir/ckpt" --gb "$gib"
