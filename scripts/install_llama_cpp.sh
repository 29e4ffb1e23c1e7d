#!/usr/bin/env bash
# Install llama-cpp-python (the independent oracle of the tests and the speed reference of the
# benchmarks) into the current Python environment, built from source for THIS CPU.
#
# The CMake flags come from llama_cpp_flags.sh (shared with build_llama_bench.sh, which builds
# llama.cpp's own llama-bench from the same source and flags): every instruction-set extension
# the CPU lists in /proc/cpuinfo, AMX off, no -march=native (see that file for why).
# pip caches the built wheel (~15 min to build on 2 cores), so later runs take seconds.
set -euo pipefail
PY=${PYTHON:-python}
source "$(dirname "${BASH_SOURCE[0]}")/llama_cpp_flags.sh"
VERSION=$LLAMA_CPP_VERSION
if "$PY" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
  exit 0
fi
CMAKE_ARGS=$LLAMA_CPP_CMAKE_ARGS
export CMAKE_ARGS
echo "building llama-cpp-python $VERSION with: $CMAKE_ARGS" >&2
echo "(first build takes ~15 minutes on 2 cores; pip caches the wheel afterwards)" >&2
"$PY" -m pip install -q "llama-cpp-python==$VERSION"
