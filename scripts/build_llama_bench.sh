#!/usr/bin/env bash
# Build llama.cpp's own C++ benchmark, llama-bench, the second witness of the llama.cpp speed
# (the first is the Python binding, llama-cpp-python, that bench/bench_vs_llama.py times):
#
#     scripts/build_llama_bench.sh [DIR]         # default DIR: ~/.cache/fucina_course/llama-bench
#     python bench/bench_vs_llama.py MODEL       # picks up DIR/bin/llama-bench by itself
#
# LLAMA_CPP_ISA=avx2 builds llama.cpp's AVX2 level instead (llama_cpp_flags.sh), by default into
# ~/.cache/fucina_course/llama-bench-avx2: the second witness of bench_vs_llama.py's emulated
# levels (avxvnni, avx2, generic), beside the AVX2 binding of build_llama_cpp_avx2.sh.
# LLAMA_CPP_ISA=avx: AVX and F16C only (Sandy / Ivy Bridge), into .../llama-bench-avx.
#
# Same source as the binding: the llama.cpp that the llama-cpp-python sdist vendors
# (vendor/llama.cpp of the same version), fetched with pip download.  Same CMake flags:
# llama_cpp_flags.sh, shared with install_llama_cpp.sh (every ISA extension /proc/cpuinfo lists,
# AMX off, no -march=native, OpenMP on, no BLAS, no curl), Release, shared libraries like the
# wheel's.  Only the llama-bench target is built (~10-15 minutes on 2 cores).
#
# Everything goes to DIR, outside the repository (source in DIR/src, build tree in DIR, the
# binary and its libraries in DIR/bin); nothing of it is committed.  Run again, it exits at once
# if DIR/bin/llama-bench runs and was built from the same version with the same flags
# (DIR/build-stamp.txt).
set -euo pipefail
PY=${PYTHON:-python3}
source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_flags.sh"
VERSION=$LLAMA_CPP_VERSION
DIR=${1:-$HOME/.cache/fucina_course/llama-bench${LLAMA_CPP_ISA:+-$LLAMA_CPP_ISA}}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON"
CMAKE_ARGS+=" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF"
CMAKE_ARGS+=" -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF"
STAMP="llama-cpp-python $VERSION vendor/llama.cpp; cmake $CMAKE_ARGS"
echo "llama-bench flags: $CMAKE_ARGS" >&2

if [[ -x "$DIR/bin/llama-bench" && -f "$DIR/build-stamp.txt" ]] \
   && [[ "$(cat "$DIR/build-stamp.txt")" == "$STAMP" ]] \
   && "$DIR/bin/llama-bench" --help >/dev/null 2>&1; then
  echo "$DIR/bin/llama-bench is already built ($VERSION, same flags)" >&2
  exit 0
fi

mkdir -p "$DIR"
SRC="$DIR/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching the llama-cpp-python $VERSION sdist" >&2
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
  rm -rf "$DIR/src" && mkdir -p "$DIR/src"
  tar -xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src"
fi

rm -f "$DIR/build-stamp.txt"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
# a build tree configured with other flags or another generator starts over
if [[ -f "$DIR/CMakeCache.txt" ]] && ! grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$SRC\$" "$DIR/CMakeCache.txt"; then
  rm -rf "$DIR/CMakeCache.txt" "$DIR/CMakeFiles"
fi
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of words
cmake -S "$SRC" -B "$DIR" "${gen[@]}" $CMAKE_ARGS >"$DIR/configure.log" 2>&1 \
  || { tail -30 "$DIR/configure.log" >&2; exit 1; }
echo "building llama-bench in $DIR with $JOBS jobs (~10-15 minutes on 2 cores)" >&2
cmake --build "$DIR" --target llama-bench -j "$JOBS"
"$DIR/bin/llama-bench" --help >/dev/null
# the AVX2 witness must be one: its CPU library holds no zmm instruction
if [[ "${LLAMA_CPP_ISA:-}" == avx2 ]] && command -v objdump >/dev/null \
   && objdump -d "$DIR/bin/libggml-cpu.so" | grep -q zmm; then
  echo "error: $DIR/bin/libggml-cpu.so contains AVX-512 (zmm) instructions" >&2
  exit 1
fi
# ... and the AVX witness no FMA instruction either
if [[ "${LLAMA_CPP_ISA:-}" == avx ]] && command -v objdump >/dev/null \
   && objdump -d "$DIR/bin/libggml-cpu.so" | grep -Eq 'zmm|vfmadd'; then
  echo "error: $DIR/bin/libggml-cpu.so contains AVX-512 or FMA instructions" >&2
  exit 1
fi
echo "$STAMP" >"$DIR/build-stamp.txt"
echo "ok: $DIR/bin/llama-bench" >&2
