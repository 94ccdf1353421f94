#!/usr/bin/env bash
# driver for one device call: build (unless BUILD_SKIP), then the steps named in STEPS
set -uo pipefail
export NCCL_NVLS_ENABLE=0
root=$(pwd)
w=third_party/cutlass-wheel
if [[ ! -f $w/unpacked/cutlass_library/source/include/cutlass/cutlass.h ]]; then
  python3 -m zipfile -e $(ls $w/*.whl | head -1) $w/unpacked
fi
mkdir -p $OUT
t0=$(date +%s)
if [[ -z "${BUILD_SKIP:-}" ]]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 -DSHARDLINE_WITH_CUTLASS=ON > $OUT/cmake.log 2>&1 || { tail -30 $OUT/cmake.log; exit 1; }
  ninja -C build-gpu -j16 ${TARGETS:-} > $OUT/build.log 2>&1 || { grep -B5 -A20 "error" $OUT/build.log | head -80; exit 1; }
  echo "build $(( $(date +%s) - t0 )) s"
fi
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
for s in ${STEPS}; do
  echo "=== step $s $(date -u +%T)"
  bash .gl/step_$s.sh 2>&1 | tail -${TAIL:-40}
done
echo "total $(( $(date +%s) - t0 )) s"
