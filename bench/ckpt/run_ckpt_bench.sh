#!/usr/bin/env bash
# run_ckpt_bench.sh DIR [GIB] [BUILD] [DEVICE]: the disk's sequential write and read speed (dd, 16 MiB blocks,
# fdatasync; before the read the page cache is dropped when root, else the file is evicted with dd's nocache flag,
# posix_fadvise DONTNEED) and ckpt_bench's save/load GB/s and async-save stall, in one command, on the same directory.
# DEVICE (auto, cpu, cuda; default auto) is ckpt_bench's --device: cpu measures the host path on a machine without a
# GPU. Targets (issue 17): save and load >= 0.8x the disk, stall <= 1.1x the device-to-host copy.
set -euo pipefail
dir="${1:?usage: run_ckpt_bench.sh DIR [GIB] [BUILD] [DEVICE]}"
gib="${2:-4}"
build="${3:-build}"
device="${4:-auto}"
mkdir -p "$dir"
blocks=$((gib * 64))
drop() {
  sync
  if { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null; then
    echo "run_ckpt_bench: page cache dropped before the read (root)"
  else
    dd if="$1" iflag=nocache count=0 status=none
    echo "run_ckpt_bench: not root: $1 evicted with posix_fadvise DONTNEED (dd iflag=nocache) before the read"
  fi
}
echo "== dd write ${gib} GiB"
dd if=/dev/zero of="$dir/dd.bin" bs=16M count="$blocks" conv=fdatasync 2>&1 | tail -1
drop "$dir/dd.bin"
echo "== dd read ${gib} GiB"
dd if="$dir/dd.bin" of=/dev/null bs=16M 2>&1 | tail -1
rm -f "$dir/dd.bin"
echo "== ckpt_bench --device $device"
"$build/bench/ckpt/ckpt_bench" --dir "$dir/ckpt" --gb "$gib" --device "$device"
