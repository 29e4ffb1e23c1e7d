"""A static witness for CPUs we cannot run on: the Q8_0 prefill inner loops of fucina and
of llama.cpp, through LLVM's machine-code analyzer (`llvm-mca`), per CPU model.

    python bench/mca_prefill.py [--cpus znver4,sapphirerapids,icelake-server]
        [--mca llvm-mca-19] [--llama-build ~/.cache/fucina_course/llama-bench]

Issue 27 asks for Q8_0 prefill >= 1.0x llama.cpp on AMD Zen 4, where no session has had a
machine since the issue was filed (its 0.69x was measured before the packed GEMM existed).
Until one does, this predicts how the two inner loops fare there, from the same scheduling
models LLVM compiles with:

* fucina's: the innermost loop of the avx512vnni packed GEMM (quant/_int_packed.py), 8
  activation rows x 16 weight rows x 32 elements, compiled as the engine compiles it
  (`_jit.assembly`) with the scheduling ("tune-cpu") of each CPU model in turn;
* llama.cpp's: the loop over blocks of `tinyBLAS_Q0_AVX<block_q8_0, block_q8_0>::
  gemm4xN<4>` (ggml-cpu/llamafile/sgemm.cpp, its largest Q8_0 tile: 4 weight rows x 4
  activation rows, one 256-bit vpdpbusd per 32-element dot product, two vpsignb before
  it), compiled by this machine's C++ compiler with the exact command that built our
  llama-bench (its compile_commands.json; scripts/build_llama_bench.sh).  On x86, Q8_0
  has no REPACK kernel in that llama.cpp, so tinyBLAS is what its prefill runs.

Each loop goes through `llvm-mca -mcpu=CPU` (300 iterations); the multiply-accumulates
per iteration come from the loop's own `vpdpbusd` (64 per zmm, 32 per ymm).  The result is
MACs per cycle in L1, one core: the kernels' ceiling, not a prefill speed (no cache
misses, no repack, no activation quantization, no attention; a prefill is ~1/3 GEMM
kernel on Sapphire Rapids class, docs/BENCHMARKS.md).  llvm-mca is LLVM's, not the CPU's:
its models are approximations (Debian's `llvm-19` package has the Zen 4 one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ITERATIONS = 300


def innermost_loop(asm: str, func: str, key: str = "vpdpbusd") -> list[str]:
    """The instructions of the innermost loop of `func` (in `asm`) that holds the most
    `key` instructions: of the backward-jump regions that contain no other one."""
    lines = asm.splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith(func + ":"))
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("\t.size") or lines[i].startswith(".Lfunc_end")),
               len(lines))
    body = lines[start:end]
    labels = {s.split(":")[0]: i for i, s in enumerate(body)
              if re.match(r"^\.L\w+:", s)}
    spans = []
    for i, s in enumerate(body):
        m = re.match(r"^\s*j\w+\s+(\.L\w+)", s)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            spans.append((labels[m.group(1)], i))
    loops = []
    for a, z in spans:
        if any(a <= a2 and z2 <= z and (a2, z2) != (a, z) for a2, z2 in spans):
            continue                                    # an outer loop
        ins = [t for t in body[a:z + 1] if t.startswith("\t") and not t.startswith("\t.")]
        loops.append((sum(key in t for t in ins), ins))
    if not loops:
        raise SystemExit(f"no loop found in {func}")
    return max(loops, key=lambda kv: kv[0])[1]


def macs(loop: list[str]) -> int:
    """Multiply-accumulates per iteration: 4 bytes per int32 lane of each vpdpbusd."""
    n = 0
    for s in loop:
        if "vpdpbusd" in s:
            n += 64 if "zmm" in s else 32 if "ymm" in s else 16
    return n


def mca_cycles(mca: str, loop: list[str], cpu: str) -> float:
    """llvm-mca's cycles per iteration of `loop` on `cpu`."""
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(loop) + "\n")
    try:
        out = subprocess.run([mca, f"-mcpu={cpu}", f"-iterations={ITERATIONS}", f.name],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    total = int(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    return total / ITERATIONS


def fucina_loop(cpu: str) -> list[str]:
    """The avx512vnni Q8_0 packed GEMM's inner loop, scheduled for `cpu`."""
    from gguf import GGMLQuantizationType as T
    from numba.core import config

    from fucina_course.quant import _jit, isa
    from fucina_course.quant._int import IntKernels

    saved, config.CPU_NAME = config.CPU_NAME, cpu   # the kernels' "tune-cpu" (isa.target)
    try:
        mod = _jit.new_module("mca")
        IntKernels(T.Q8_0, isa.AVX512VNNI).build(mod)
        asm = _jit.assembly(mod, isa.AVX512VNNI)
    finally:
        config.CPU_NAME = saved
    return innermost_loop(asm, "q8_0_avx512vnni_packed")


def llama_loop(build: str) -> list[str]:
    """tinyBLAS's Q8_0 gemm4xN<4> block loop, compiled as llama-bench's was."""
    with open(os.path.join(build, "compile_commands.json")) as f:
        entry = next(c for c in json.load(f) if c["file"].endswith("llamafile/sgemm.cpp"))
    cmd = entry["command"].split()
    i = cmd.index("-o")
    del cmd[i:i + 2]
    cmd.remove("-c")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sgemm.s")
        subprocess.run(cmd + ["-w", "-S", "-o", out], cwd=entry["directory"], check=True)
        with open(out) as f:
            asm = f.read()
    func = next(s[:-1] for s in asm.splitlines() if s.endswith(":")
                and "tinyBLAS_Q0_AVX" in s and "block_q8_0S1_" in s and "gemm4xNILi4E" in s)
    return innermost_loop(asm, func)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default="znver4,sapphirerapids,icelake-server")
    ap.add_argument("--mca", default=shutil.which("llvm-mca-19") or "llvm-mca")
    ap.add_argument("--llama-build", default=os.path.expanduser(
        "~/.cache/fucina_course/llama-bench"))
    args = ap.parse_args()
    if not shutil.which(args.mca):
        sys.exit(f"{args.mca} not found: `apt-get install llvm-19` (Debian 12) has "
                 "llvm-mca-19, with the Zen 4 model")
    if not os.path.exists(os.path.join(args.llama_build, "compile_commands.json")):
        sys.exit(f"no llama-bench build in {args.llama_build}: run "
                 "scripts/build_llama_bench.sh first")
    theirs = llama_loop(args.llama_build)
    version = subprocess.run([args.mca, "--version"], capture_output=True, text=True).stdout
    print(re.search(r"LLVM version \S+", version).group(0), "(llvm-mca), 1 core, in L1")
    print("| CPU model | fucina packed GEMM, cycles / MACs per cycle | "
          "llama.cpp tinyBLAS gemm4xN<4> | fucina / llama.cpp |")
    print("|---|---:|---:|---:|")
    for cpu in args.cpus.split(","):
        ours = fucina_loop(cpu)
        c_ours, c_theirs = mca_cycles(args.mca, ours, cpu), mca_cycles(args.mca, theirs, cpu)
        r_ours, r_theirs = macs(ours) / c_ours, macs(theirs) / c_theirs
        print(f"| {cpu} | {c_ours:.1f} / {r_ours:.1f} ({macs(ours)} MACs) | "
              f"{c_theirs:.1f} / {r_theirs:.1f} ({macs(theirs)} MACs) | "
              f"{r_ours / r_theirs:.2f}x |")


if __name__ == "__main__":
    main()
