#!/usr/bin/env bash
# The GPU-host check (see ../shared/GPU_HOSTS.md): configures and builds shardline for Hopper, runs every CTest label
# (cpu, cuda, then whatever else the build registered: dist, package, spmd, ...), and prints the seed-002 precision
# figures and a pass/fail table last. Logs go to $OUT when set, else build-gpu/logs. Exits non-zero when the build or
# any test fails, or when no GPU is visible (the cuda tests would only skip; GPU_CHECK_ALLOW_NO_GPU=1 accepts that).
#
#   scripts/gpu_check.sh                      # from anywhere; runs in the repository root
#   GPU_CHECK_BUILD_DIR=... GPU_CHECK_JOBS=... GPU_CHECK_CTEST_JOBS=... scripts/gpu_check.sh [extra cmake args]
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
build_dir="${GPU_CHECK_BUILD_DIR:-build-gpu}"
log_dir="${OUT:-$build_dir/logs}"
jobs="${GPU_CHECK_JOBS:-$(nproc 2>/dev/null || echo 4)}"
ctest_jobs="${GPU_CHECK_CTEST_JOBS:-4}"
mkdir -p "$log_dir" || exit 2

# Keep NVLink multicast off in every process (launchers pass the environment through), as the GPU hosts require.
export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
# The hosts run as root: let mpirun (dist tests) start.
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

summary="$log_dir/summary.txt"
say() { echo "$@" | tee -a "$summary"; }
: >"$summary"

# ---------------------------------------------------------------------------------------------------------------------
# What runs where: host, GPU, toolchain, commit.
gpus="none"
gpu_count=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_list="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"
  if [[ -n "$gpu_list" ]]; then
    gpu_count="$(printf '%s\n' "$gpu_list" | wc -l | tr -d ' ')"
    gpus="$(printf '%s\n' "$gpu_list" | head -n 1) (x$gpu_count)"
  fi
fi
# The device copy of the tree may carry no .git: GPU_CHECK_COMMIT names the commit then.
commit="${GPU_CHECK_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [[ -z "${GPU_CHECK_COMMIT:-}" && -n "$(git -C "$root" status --porcelain 2>/dev/null)" ]]; then
  commit="$commit+dirty"
fi
# CUTLASS (the grouped GEMM) is not on the GPU hosts: the development machine's scripts/setup.sh downloads the
# nvidia-cutlass wheel into third_party/cutlass-wheel, which the run carries; unpack it here when that was not done.
cutlass_args=()
cutlass_state="absent (grouped GEMM: cuBLASLt loop only)"
wheel_dir="$root/third_party/cutlass-wheel"
if compgen -G "$wheel_dir/nvidia_cutlass-*.whl" >/dev/null; then
  if [[ ! -f "$wheel_dir/unpacked/cutlass_library/source/include/cutlass/cutlass.h" ]]; then
    python3 -m zipfile -e "$(compgen -G "$wheel_dir/nvidia_cutlass-*.whl" | head -n 1)" "$wheel_dir/unpacked" ||
      echo "gpu_check: could not unpack the CUTLASS wheel" >&2
  fi
  if [[ -f "$wheel_dir/unpacked/cutlass_library/source/include/cutlass/cutlass.h" ]]; then
    cutlass_args=(-DSHARDLINE_WITH_CUTLASS=ON)
    cutlass_state="$(basename "$(compgen -G "$wheel_dir/nvidia_cutlass-*.whl" | head -n 1)")"
  fi
fi
say "== shardline GPU check =="
say "host:    $(hostname 2>/dev/null || echo unknown)"
say "date:    $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
say "commit:  $commit"
say "gpu:     $gpus"
say "nvcc:    $( (nvcc --version 2>/dev/null || "${CUDACXX:-false}" --version 2>/dev/null) | grep -o 'release [0-9.]*' | head -n 1)"
say "cmake:   $(cmake --version 2>/dev/null | head -n 1)"
say "cutlass: $cutlass_state"
say "logs:    $log_dir"

# ---------------------------------------------------------------------------------------------------------------------
# Configure and build.
echo "== configure (log: $log_dir/configure.log)"
if ! cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 "${cutlass_args[@]}" "$@" \
    2>&1 | tee "$log_dir/configure.log"; then
  say "RESULT: FAIL (configure; see $log_dir/configure.log)"
  exit 2
fi
echo "== build -j$jobs (log: $log_dir/build.log)"
if ! cmake --build "$build_dir" -j "$jobs" 2>&1 | tee "$log_dir/build.log"; then
  say "RESULT: FAIL (build; see $log_dir/build.log)"
  exit 2
fi

# ---------------------------------------------------------------------------------------------------------------------
# Tests, one ctest run per label: cpu and cuda first, then the other labels, then tests that carry none.
labels=(cpu cuda)
while IFS= read -r label; do
  label="${label#"${label%%[![:space:]]*}"}"
  label="${label%"${label##*[![:space:]]}"}"
  # The format check needs the pinned clang-format from PyPI, which the GPU hosts cannot reach; CI runs it.
  [[ -z "$label" || "$label" == cpu || "$label" == cuda || "$label" == format ]] && continue
  labels+=("$label")
done < <(ctest --test-dir "$build_dir" --print-labels 2>/dev/null | sed -n '/^All Labels:/,$p' | tail -n +2)

rows=()
overall=0
cuda_skipped=0
cuda_total=0
run_label() { # $1: row name, rest: ctest selection arguments
  local name="$1"
  shift
  local log="$log_dir/ctest_${name}.log"
  echo "== ctest $name (log: $log)"
  ctest --test-dir "$build_dir" --output-on-failure -j "$ctest_jobs" --timeout 1800 "$@" 2>&1 | tee "$log"
  local rc=$?
  # Every test's full output (passing ones included) for this run, e.g. the [precision] lines.
  cp "$build_dir/Testing/Temporary/LastTest.log" "$log_dir/ctest_${name}.full.log" 2>/dev/null
  if grep -q 'No tests were found' "$log"; then
    rows+=("$(printf '%-12s %6s %7s %7s %8s  %s' "$name" 0 0 0 0 "none")")
    return
  fi
  local total failed skipped passed status
  # CMake 3.25 prints "100% tests passed, 0 tests failed out of N"; CMake 4.x drops the failed part when it is 0.
  total="$(sed -n 's/.*tests* passed.* out of \([0-9][0-9]*\).*/\1/p' "$log" | tail -n 1)"
  failed="$(sed -n 's/.*, \([0-9][0-9]*\) tests* failed out of.*/\1/p' "$log" | tail -n 1)"
  skipped="$(grep -c '\*\*\*Skipped\|Not Run' "$log")"
  total="${total:-0}"
  failed="${failed:-0}"
  passed=$((total - failed - skipped))
  ((passed < 0)) && passed=0
  if ((rc != 0 || failed > 0)) || [[ "$total" == 0 ]]; then
    status="FAIL"
    overall=1
  elif ((skipped > 0)); then
    status="PASS ($skipped skipped)"
  else
    status="PASS"
  fi
  if [[ "$name" == cuda ]]; then
    cuda_total=$total
    cuda_skipped=$skipped
  fi
  rows+=("$(printf '%-12s %6s %7s %7s %8s  %s' "$name" "$total" "$passed" "$failed" "$skipped" "$status")")
}

for label in "${labels[@]}"; do
  run_label "$label" -L "^${label}\$"
done
# Tests without any label (-LE . excludes every labelled test).
if ctest --test-dir "$build_dir" -N -LE . 2>/dev/null | grep -q '^ *Test *#'; then
  run_label unlabeled -LE .
fi

# ---------------------------------------------------------------------------------------------------------------------
# The seed-002 precision figures, from the cuda run's full log (or, if absent there, from the test run alone).
precision="$(grep -h '^\[precision\]' "$log_dir/ctest_cuda.full.log" 2>/dev/null | sort -u)"
cuda_bin="$build_dir/tests/cuda/shardline_cuda_tests"
if [[ -z "$precision" && -x "$cuda_bin" ]]; then
  "$cuda_bin" --gtest_filter='*BiasEpiloguePrecision*' 2>&1 | tee "$log_dir/precision.log" >/dev/null
  precision="$(grep -h '^\[precision\]' "$log_dir/precision.log" | sort -u)"
fi

no_gpu=0
if ((gpu_count == 0)) || ((cuda_total > 0 && cuda_skipped == cuda_total)); then
  no_gpu=1
fi

say ""
say "== seed-002 precision (mean |error| vs float64 over random cases; fused bias epilogue vs unfused)"
if [[ -n "$precision" ]]; then
  say "$precision"
else
  say "(no [precision] lines: the precision test did not run on a GPU)"
fi
say ""
say "== results ($commit, $gpus)"
say "$(printf '%-12s %6s %7s %7s %8s  %s' label total passed failed skipped result)"
for row in "${rows[@]}"; do
  say "$row"
done
if ((no_gpu)); then
  if [[ "${GPU_CHECK_ALLOW_NO_GPU:-0}" == 1 ]]; then
    say "WARNING: no GPU visible: the cuda tests only skipped (GPU_CHECK_ALLOW_NO_GPU=1)"
  else
    say "FAIL: no GPU visible: the cuda tests only skipped (set GPU_CHECK_ALLOW_NO_GPU=1 to accept)"
    overall=1
  fi
fi
if ((overall == 0)); then
  say "RESULT: PASS (logs in $log_dir)"
else
  say "RESULT: FAIL (logs in $log_dir)"
fi
exit "$overall"
