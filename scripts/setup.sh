#!/usr/bin/env bash
# Sets up and builds shardline: installs the Debian/Ubuntu packages it needs when some are missing and we are
# root, then configures and builds into ${SHARDLINE_BUILD_DIR:-build}. Extra arguments go to the CMake configure.
# CUDA code is built when a CUDA toolkit is found (nvcc on PATH or in /usr/local/cuda), and runs when a GPU is
# present; the CUDA toolkit itself is not installed by this script.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

packages=(build-essential cmake ninja-build libgtest-dev libgmock-dev openmpi-bin libopenmpi-dev
          nlohmann-json3-dev zlib1g-dev libcli11-dev libspdlog-dev libfmt-dev libopenblas-dev
          python3-venv)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  for p in "${packages[@]}"; do
    # A tool already on PATH counts (the GPU hosts carry their own CMake).
    case "$p" in
      cmake) command -v cmake >/dev/null 2>&1 && continue ;;
      ninja-build) command -v ninja >/dev/null 2>&1 && continue ;;
      build-essential) command -v c++ >/dev/null 2>&1 && command -v make >/dev/null 2>&1 && continue ;;
      python3-venv) python3 -c "import ensurepip, venv" >/dev/null 2>&1 && continue ;;
    esac
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
fi
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
      echo "setup: warning: apt-get could not install ${missing[*]}; the build will say what is missing" >&2
  else
    echo "setup: warning: missing packages ${missing[*]} (run as root to install them)" >&2
  fi
fi

if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi

build_dir="${SHARDLINE_BUILD_DIR:-build}"
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
elif (($#)); then
  cmake -S . -B "$build_dir" "$@"
fi
jobs="${SHARDLINE_JOBS:-$(nproc)}"
cmake --build "$build_dir" -j "$jobs"
