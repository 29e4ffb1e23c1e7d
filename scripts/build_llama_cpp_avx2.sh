#!/usr/bin/env bash
# Build a second llama-cpp-python with AVX-512 off, into its own directory, so that the
# AVX2 kernels (FUCINA_SIMD=avx2) can be compared with llama.cpp's AVX2 path on a CPU
# that has AVX-512:
#
#     scripts/build_llama_cpp_avx2.sh [DIR]  # default: ~/.cache/fucina_course/llama-avx2
#     python bench/bench_vs_llama.py MODEL --levels avx2     # finds it there
#
# The build is llama.cpp's x86 AVX2 level (AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no
# AVX-VNNI, no AMX), the ISA of the AMD EPYC our CI sometimes gets.  It goes to DIR with
# `pip install --target` (no dependencies: numpy etc. come from the environment) and
# never into the environment itself.  --no-cache-dir: pip keys its wheel cache by the
# source archive, not by CMAKE_ARGS, so it would otherwise hand back the AVX-512 wheel.
# ~15 minutes on 2 cores.  Nothing of it is committed.
set -euo pipefail
PY=${PYTHON:-python}
# llama.cpp's AVX2 level, the flags llama-bench's AVX2 witness is built with too
LLAMA_CPP_ISA=avx2 source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_flags.sh"
VERSION=$LLAMA_CPP_VERSION
DIR=${1:-$HOME/.cache/fucina_course/llama-avx2}
if PYTHONPATH="$DIR" "$PY" -c "import llama_cpp, os, sys
here = os.path.realpath(llama_cpp.__file__).startswith(os.path.realpath('$DIR'))
sys.exit(0 if here and llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  echo "$DIR already holds llama-cpp-python $VERSION" >&2
  exit 0
fi
CMAKE_ARGS=$LLAMA_CPP_CMAKE_ARGS
export CMAKE_ARGS
echo "building llama-cpp-python $VERSION into $DIR with: $CMAKE_ARGS" >&2
"$PY" -m pip install -q --no-cache-dir --no-deps --target "$DIR" \
  "llama-cpp-python==$VERSION"
# prove it: the library must hold no zmm instruction
lib=$(ls "$DIR"/llama_cpp/lib/libggml-cpu.so* | head -1)
if command -v objdump >/dev/null && objdump -d "$lib" | grep -q zmm; then
  echo "error: $lib contains AVX-512 (zmm) instructions" >&2
  exit 1
fi
echo "ok: $DIR (AVX2, no AVX-512)" >&2
