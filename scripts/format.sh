#!/usr/bin/env bash
# Formats the project's C++/CUDA sources with the pinned clang-format (the version below; .clang-format is its
# config). Usage:
#   scripts/format.sh              format every tracked source in place
#   scripts/format.sh --check      exit 1 and list the files that differ (nothing is written)
#   scripts/format.sh [--check] FILE...   only these files (.h, .cc, .cu, .cuh; others are skipped)
# The formatter: $CLANG_FORMAT, else clang-format on PATH when it is the pinned version, else a virtual environment
# under ${XDG_CACHE_HOME:-~/.cache}/shardline made with pip (PyPI's clang-format wheel). When it cannot be had (no
# python3-venv, no network) the script exits 77, which CTest reports as skipped, unless SHARDLINE_REQUIRE_FORMAT=1
# (CI), where that is a failure.
set -euo pipefail
version=18.1.8
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

unavailable() {
  echo "format: clang-format $version is not available: $1" >&2
  [[ "${SHARDLINE_REQUIRE_FORMAT:-0}" == 1 ]] && exit 1
  exit 77
}

is_pinned() { [[ -x "$1" ]] && "$1" --version 2>/dev/null | grep -q "version $version\b"; }

find_formatter() {
  if [[ -n "${CLANG_FORMAT:-}" ]]; then
    is_pinned "$CLANG_FORMAT" || unavailable "CLANG_FORMAT=$CLANG_FORMAT is not version $version"
    echo "$CLANG_FORMAT"; return
  fi
  local on_path venv
  on_path="$(command -v clang-format || true)"
  if [[ -n "$on_path" ]] && is_pinned "$on_path"; then echo "$on_path"; return; fi
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/shardline/clang-format-$version"
  if ! is_pinned "$venv/bin/clang-format"; then
    command -v python3 >/dev/null 2>&1 || unavailable "no python3 to install it with"
    echo "format: installing clang-format $version into $venv" >&2
    rm -rf "$venv"
    python3 -m venv "$venv" >&2 || unavailable "python3 -m venv failed (install python3-venv)"
    "$venv/bin/pip" install -q --disable-pip-version-check --timeout 20 --retries 1 "clang-format==$version" >&2 ||
      unavailable "pip could not install clang-format==$version"
  fi
  echo "$venv/bin/clang-format"
}

check=0
if [[ "${1:-}" == "--check" ]]; then check=1; shift; fi
cf="$(find_formatter)"
cd "$root"
if (($#)); then
  # Only C++/CUDA sources: clang-format would rewrite a Markdown or CMake file as if it were C++.
  files=()
  for f in "$@"; do
    case "$f" in
      *.h | *.cc | *.cu | *.cuh) files+=("$f") ;;
      *) echo "format: skipping $f (not a C++/CUDA source)" >&2 ;;
    esac
  done
  ((${#files[@]})) || exit 0
else
  mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu' '*.cuh' 2>/dev/null ||
                       find include src spmd launch tests examples bench tools \
                         \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \))
fi
style="--style=file:$root/.clang-format"
if ((check == 0)); then
  "$cf" "$style" -i "${files[@]}"
  exit 0
fi
differ=()
for f in "${files[@]}"; do
  "$cf" "$style" --dry-run -Werror "$f" >/dev/null 2>&1 || differ+=("$f")
done
if ((${#differ[@]})); then
  printf 'format: %d of %d files differ from clang-format %s (run scripts/format.sh):\n' "${#differ[@]}" "${#files[@]}" "$version"
  printf '  %s\n' "${differ[@]}"
  exit 1
fi
echo "format: ${#files[@]} files match clang-format $version"
