#!/usr/bin/env bash
# Build a second llama-cpp-python with AVX-512 off, into its own directory, so that the
# AVX2 kernels (FUCINA_SIMD=avx2) can be compared with llama.cpp's AVX2 path on a CPU
# that has AVX-512:
#
#     scripts/build_llama_cpp_avx2.sh [DIR]          # default DIR: /work/llama-avx2
#     python bench/bench_vs_llama.py MODEL --simd avx2 --llama-path DIR
#
# The build is llama.cpp's x86 AVX2 level (AVX, AVX2, FMA, F16C, BMI2; no AVX-512, no
# AVX-VNNI, no AMX), the ISA of the AMD EPYC our CI sometimes gets.  It goes to DIR with
# `pip install --target` (no dependencies: numpy etc. come from the environment) and
# never into the environment itself.  --no-cache-dir: pip keys its wheel cache by the
# source archive, not by CMAKE_ARGS, so it would otherwise hand back the AVX-512 wheel.
# ~15 minutes on 2 cores.  Nothing of it is committed.
set -euo pipefail
PY=${PYTHON:-python}
VERSION=0.3.36
DIR=${1:-/work/llama-avx2}
if PYTHONPATH="$DIR" "$PY" -c "import llama_cpp, os, sys
here = os.path.realpath(llama_cpp.__file__).startswith(os.path.realpath('$DIR'))
sys.exit(0 if here and llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  echo "$DIR already holds llama-cpp-python $VERSION" >&2
  exit 0
fi
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
CMAKE_ARGS+=" -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF"
CMAKE_ARGS+=" -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF"
CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS+=" -DGGML_BLAS=OFF -DGGML_OPENMP=ON"
CMAKE_ARGS+=" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
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
