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

# CUTLASS's headers for the grouped GEMM (SHARDLINE_WITH_CUTLASS): the nvidia-cutlass wheel, downloaded once into the
# ignored third_party/cutlass-wheel and unpacked there, where CMake finds it (and which a GPU run carries: the GPU hosts
# have no package registry). Without a network the build goes on without CUTLASS (the cuBLASLt loop serves grouped GEMMs).
cutlass_wheel_dir="$root/third_party/cutlass-wheel"
if [[ -n "${CUDACXX:-}" ]] || command -v nvcc >/dev/null 2>&1; then
  if ! compgen -G "$cutlass_wheel_dir/nvidia_cutlass-4.2.0.0-*.whl" >/dev/null; then
    mkdir -p "$cutlass_wheel_dir"
    pip=(python3 -m pip)
    if ! python3 -m pip --version >/dev/null 2>&1; then
      # Debian's python3 has no pip: a virtual environment's (python3-venv, installed above) downloads the wheel.
      venv="${XDG_CACHE_HOME:-$HOME/.cache}/shardline/pip-venv"
      [[ -x "$venv/bin/pip" ]] || python3 -m venv "$venv" >/dev/null 2>&1 || true
      pip=("$venv/bin/pip")
    fi
    "${pip[@]}" download --quiet --no-deps --only-binary=:all: nvidia-cutlass==4.2.0.0 -d "$cutlass_wheel_dir" ||
      echo "setup: warning: could not download the nvidia-cutlass wheel; building without CUTLASS" >&2
  fi
  wheel="$(compgen -G "$cutlass_wheel_dir/nvidia_cutlass-4.2.0.0-*.whl" | head -n 1 || true)"
  if [[ -n "$wheel" && ! -f "$cutlass_wheel_dir/unpacked/cutlass_library/source/include/cutlass/cutlass.h" ]]; then
    python3 -m zipfile -e "$wheel" "$cutlass_wheel_dir/unpacked" ||
      echo "setup: warning: could not unpack $wheel; building without CUTLASS" >&2
  fi
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
