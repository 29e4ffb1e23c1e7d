#!/usr/bin/env bash
# Install llama-cpp-python (the independent oracle of the tests and the speed reference of the
# benchmarks) into the current Python environment, built from source for THIS CPU.
#
# A native build (-DGGML_NATIVE=ON) dies with SIGILL on our machines: it enables AMX, which the CPU
# reports but the VM cannot run.  So every instruction-set extension is switched on explicitly, and
# only if /proc/cpuinfo lists it: the build never produces an illegal instruction, and the speed
# comparison is against the fastest llama.cpp this CPU can run (a generic build would flatter us).
# pip caches the built wheel (~15 min to build on 2 cores), so later runs take seconds.
set -euo pipefail
PY=${PYTHON:-python}
VERSION=0.3.36
if "$PY" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  exit 0
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
CMAKE_ARGS+=" -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f)"
CMAKE_ARGS+=" -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
CMAKE_ARGS+=" -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni)"
CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON"
CMAKE_ARGS+=" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
export CMAKE_ARGS
echo "building llama-cpp-python $VERSION with: $CMAKE_ARGS" >&2
echo "(first build takes ~15 minutes on 2 cores; pip caches the wheel afterwards)" >&2
"$PY" -m pip install -q "llama-cpp-python==$VERSION"
