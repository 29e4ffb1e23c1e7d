# Sourced (not run) by install_llama_cpp.sh and build_llama_bench.sh, so that the Python binding
# (llama-cpp-python) and llama.cpp's own llama-bench are built from the same flags:
#
#     source "$(dirname "$0")/llama_cpp_flags.sh"     # sets LLAMA_CPP_VERSION and LLAMA_CPP_CMAKE_ARGS
#
# A native build (-DGGML_NATIVE=ON) dies with SIGILL on our machines: it enables AMX, which the CPU
# reports but the VM cannot run.  So every instruction-set extension is switched on explicitly, and
# only if /proc/cpuinfo lists it: the build never produces an illegal instruction, and the speed
# comparison is against the fastest llama.cpp this CPU can run (a generic build would flatter us).
LLAMA_CPP_VERSION=0.3.36
_llama_cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
# LLAMA_CPP_ISA=avx2: llama.cpp's x86 AVX2 level whatever this CPU has (AVX, AVX2, FMA, F16C,
# BMI2; no AVX-512, no AVX-VNNI), the witness of the emulated avx2 / generic levels of
# bench/bench_vs_llama.py (the same set as scripts/build_llama_cpp_avx2.sh's binding).
# LLAMA_CPP_ISA=avx: AVX and F16C, no AVX2, no FMA (Sandy / Ivy Bridge), the witness of the
# generic level compiled for Ivy Bridge (docs/BENCHMARKS.md, "Generic IR kernels").
if [[ "${LLAMA_CPP_ISA:-}" == avx2 ]]; then
  _llama_cpu_flags="flags : avx avx2 fma f16c bmi2"
elif [[ "${LLAMA_CPP_ISA:-}" == avx ]]; then
  _llama_cpu_flags="flags : avx f16c"
fi
_llama_has() { [[ " $_llama_cpu_flags " == *" $1 "* ]] && echo ON || echo OFF; }
LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(_llama_has avx) -DGGML_AVX2=$(_llama_has avx2)"
LLAMA_CPP_CMAKE_ARGS+=" -DGGML_FMA=$(_llama_has fma) -DGGML_F16C=$(_llama_has f16c)"
LLAMA_CPP_CMAKE_ARGS+=" -DGGML_BMI2=$(_llama_has bmi2) -DGGML_AVX512=$(_llama_has avx512f)"
LLAMA_CPP_CMAKE_ARGS+=" -DGGML_AVX512_VBMI=$(_llama_has avx512vbmi) -DGGML_AVX512_VNNI=$(_llama_has avx512_vnni)"
LLAMA_CPP_CMAKE_ARGS+=" -DGGML_AVX512_BF16=$(_llama_has avx512_bf16) -DGGML_AVX_VNNI=$(_llama_has avx_vnni)"
LLAMA_CPP_CMAKE_ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON"
LLAMA_CPP_CMAKE_ARGS+=" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
unset _llama_cpu_flags
unset -f _llama_has
