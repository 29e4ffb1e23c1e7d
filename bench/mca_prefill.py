"""A static witness for CPUs we cannot run on: the Q8_0 prefill inner loops of fucina and
of llama.cpp, through LLVM's machine-code analyzer (`llvm-mca`), per CPU model.

    python bench/mca_prefill.py [--cpus znver4,sapphirerapids,icelake-server]
        [--mca llvm-mca-19] [--llama-build ~/.cache/fucina_course/llama-bench]
    python bench/mca_prefill.py --arm [--cpus apple-m1,apple-m2,neoverse-n1,...]

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

`--arm` asks the same of the CPUs no session runs on at all, ARM's (Apple M-series,
Graviton / Neoverse, Raspberry Pi 5's Cortex-A76), at each aarch64 level a CPU model
has (isa.ARM: dotprod everywhere listed, i8mm on apple-m2 and neoverse-v1):

* fucina's: the level's packed GEMM (Q8_0, and Q4_K with --q4k): `sdot` on 4 weight rows
  x 4 activation rows at dotprod, `smmla` at i8mm (Q8_0: 16 weight rows x 2 activation
  rows; Q4_K: 4 x 4, _int_smmla.KQuantPairs), its IR built for an aarch64 module and
  compiled by llvmlite's own LLVM for the level's target (`isa.target`: "generic" +
  its features) with each CPU model's scheduling, as the engine's JIT would there;
  the loop of its full tiles, the one a prompt's rows run through (`full_tiles_only`;
  for Q4_K one sub-block of 32, the super-block's mins and d_x outside it, as
  llama.cpp's loop is one pair of sub-blocks with its super-block's scales outside);
* llama.cpp's: on ARM, weights are repacked (ggml-cpu/repack.cpp), and the prefill runs
  `ggml_gemm_q8_0_4x8_q8_0` (i8mm: `smmla`, 32 MACs) or `ggml_gemm_q8_0_4x4_q8_0`
  (dotprod: `sdot`, 16 MACs); Q4_K `ggml_gemm_q4_K_8x8_q8_K` / `_8x4_`; from
  ggml-cpu/arch/arm/repack.cpp of the same vendored source, cross-compiled by
  `clang++-19 --target=aarch64-linux-gnu -mcpu=CPU -O3` (`apt-get install clang-19
  g++-aarch64-linux-gnu`: the compiler and the aarch64 C library headers).
`--arm --level generic` gives the generic level's old row instead (int16 products).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ITERATIONS = 300


# a backward branch to a local label: x86's jcc / jmp, aarch64's b.cond, b, cbz / cbnz
# and tbz / tbnz (register and bit operands before the label)
_BRANCH = re.compile(r"^\s*(?:j\w+|b\.\w+|b|cbn?z|tbn?z)\s+"
                     r"(?:[^,\s]+,\s*)*(\.L\w+)\s*(?:[#/].*)?$")
# the instructions that do a loop's multiply-accumulates, per architecture
DOT = ("vpdpbusd",)
ARM_DOT = ("sdot", "smmla", "smlal", "smull")


def innermost_loop(asm: str, func: str, key=DOT) -> list[str]:
    """The instructions of the innermost loop of `func` (in `asm`) that holds the most
    instructions named in `key` (a string or a tuple of them): of the backward-branch
    regions that contain no other one."""
    keys = (key,) if isinstance(key, str) else tuple(key)
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
        m = _BRANCH.match(s)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            spans.append((labels[m.group(1)], i))
    loops = []
    for a, z in spans:
        if any(a <= a2 and z2 <= z and (a2, z2) != (a, z) for a2, z2 in spans):
            continue                                    # an outer loop
        ins = [t for t in body[a:z + 1] if t.startswith("\t") and not t.startswith("\t.")]
        loops.append((sum(any(k in t for k in keys) for t in ins), ins))
    if not loops or not max(n for n, _ in loops):
        raise ValueError(f"no loop with {' / '.join(keys)} in {func}")
    return max(loops, key=lambda kv: kv[0])[1]


def macs(loop: list[str]) -> int:
    """Multiply-accumulates per iteration: 4 bytes per int32 lane of each vpdpbusd; on
    aarch64 16 per `sdot` (4 lanes x 4 bytes), 32 per `smmla` (a 2x8 by 8x2 byte
    product), and one per lane of the widening `smlal` / `smull` (4 on .4s, 8 on .8h)."""
    n = 0
    for s in loop:
        words = s.replace("{vex}", "").split()       # AVX-VNNI's `{vex} vpdpbusd`
        op = words[0] if words else ""
        if op == "vpdpbusd":
            n += 64 if "zmm" in s else 32 if "ymm" in s else 16
        elif op == "sdot":
            n += 16
        elif op == "smmla":
            n += 32
        elif op in ("smlal", "smlal2", "smull", "smull2"):
            n += 4 if ".4s" in s else 8 if ".8h" in s else 2
    return n


def mca_cycles(mca: str, loop: list[str], cpu: str, triple: str = "x86_64") -> float:
    """llvm-mca's cycles per iteration of `loop` on `cpu`."""
    with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
        f.write("\n".join(loop) + "\n")
    try:
        out = subprocess.run([mca, f"-mtriple={triple}", f"-mcpu={cpu}",
                              f"-iterations={ITERATIONS}", f.name],
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


ARM_TRIPLE = "aarch64-unknown-linux-gnu"


@contextlib.contextmanager
def full_tiles_only():
    """Build the packed GEMM without its loop over the m % tile rows left after the
    full tiles (`_int_packed._groups`: one row at a time), which a prefill runs for
    at most 3 of its rows.  LLVM unrolls that one-row body completely where it is
    small (Q4_K: all 8 sub-blocks, 64 `sdot`), and `innermost_loop`, which takes the
    loop with the most dot products, then measured it instead of the full tiles' loop
    (Q4_K: 1056 MACs per iteration, 0.37-0.84x, where the 4-row loop that runs the
    prompt was above 1.0x)."""
    from fucina_course.quant import _int_packed, _int_smmla

    saved = _int_packed._rows, _int_smmla.pair_rows

    def skip_single(rows):
        return lambda b, ctx, t0, count: None if count == 1 else rows(b, ctx, t0, count)
    _int_packed._rows, _int_smmla.pair_rows = (skip_single(f) for f in saved)
    try:
        yield
    finally:
        _int_packed._rows, _int_smmla.pair_rows = saved


def fucina_loop_arm(cpu: str, level: str = "generic", fmt: str = "Q8_0") -> list[str]:
    """The packed GEMM loop of `fmt` at an aarch64 `level` as LLVM compiles it for
    `cpu`: the level's own target (isa.target) with `cpu`'s scheduling, or at generic
    `cpu` itself (the module's triple is what makes the IR helpers leave x86's SSE2 /
    SSSE3 intrinsics out: _ir.madd_host)."""
    from gguf import GGMLQuantizationType as T
    from llvmlite import ir

    from fucina_course.quant import _jit, isa
    from fucina_course.quant._int import IntKernels

    mod = ir.Module("mca_arm")
    mod.triple = ARM_TRIPLE
    with full_tiles_only():
        IntKernels(T[fmt], level).build(mod)
    if level == isa.GENERIC:
        asm = _jit.assembly_for(mod, ARM_TRIPLE, cpu)
    else:
        target_cpu, features, _ = isa.target(level)
        asm = _jit.assembly_for(mod, ARM_TRIPLE, target_cpu, features, tune=cpu)
    return innermost_loop(asm, f"{fmt.lower()}_{level}_packed", ARM_DOT)


# llama.cpp's repack GEMM for a (format, level), and the instruction of its loop
LLAMA_ARM = {("Q8_0", "i8mm"): ("ggml_gemm_q8_0_4x8_q8_0", "smmla"),
             ("Q8_0", "dotprod"): ("ggml_gemm_q8_0_4x4_q8_0", "sdot"),
             ("Q4_K", "i8mm"): ("ggml_gemm_q4_K_8x8_q8_K", "smmla"),
             ("Q4_K", "dotprod"): ("ggml_gemm_q4_K_8x4_q8_K", "sdot")}
# the aarch64 levels of the CPU models (LLVM's: i8mm from ARMv8.6 / Neoverse V1)
ARM_LEVELS = {"apple-m1": ("dotprod",), "apple-m2": ("dotprod", "i8mm"),
              "neoverse-n1": ("dotprod",), "neoverse-v1": ("dotprod", "i8mm"),
              "cortex-a76": ("dotprod",)}


def llama_asm_arm(build: str, cpu: str, clang: str) -> str:
    """llama.cpp's ARM repack kernels (ggml-cpu/arch/arm/repack.cpp) cross-compiled for
    an aarch64 `cpu` from the source of our llama-bench build, with its -D / -I flags
    (the x86 ones dropped): the assembly."""
    with open(os.path.join(build, "compile_commands.json")) as f:
        entry = next(c for c in json.load(f) if c["file"].endswith("ggml-cpu/repack.cpp"))
    src = os.path.join(os.path.dirname(entry["file"]), "arch", "arm", "repack.cpp")
    flags = [a for a in entry["command"].split()
             if a.startswith("-I") or (a.startswith("-D") and not a.startswith(
                 ("-DGGML_AVX", "-DGGML_SSE", "-DGGML_F16C", "-DGGML_FMA", "-DGGML_BMI")))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "repack.s")
        subprocess.run([clang, "--target=aarch64-linux-gnu", f"-mcpu={cpu}", "-O3",
                        "-std=gnu++17", "-w", *flags, "-S", "-o", out, src],
                       cwd=entry["directory"], check=True)
        with open(out) as f:
            return f.read()


def llama_loop_arm(build: str, cpu: str, clang: str, fmt: str = "Q8_0",
                   level: str | None = None) -> tuple[str, list[str]]:
    """(kernel, loop): llama.cpp's repack GEMM of `fmt` for `level` on `cpu` (default:
    the best the CPU has, 4x8 `smmla` with i8mm, else 4x4 `sdot`)."""
    asm = llama_asm_arm(build, cpu, clang)
    levels = [level] if level else ["i8mm", "dotprod"]
    for lv in levels:
        kernel, key = LLAMA_ARM[(fmt, lv)]
        try:
            return kernel, innermost_loop(asm, kernel, key)
        except ValueError:          # no such loop: the CPU lacks the instruction
            continue
    raise SystemExit(f"no {fmt} repack GEMM loop for {cpu} ({levels})")


def print_table(args, triple: str, ours_name: str, theirs_name: str, loops) -> None:
    """One markdown row per CPU model; `loops(cpu)` gives (fucina's loop, llama.cpp's
    loop, a note on llama.cpp's)."""
    version = subprocess.run([args.mca, "--version"], capture_output=True, text=True).stdout
    print(re.search(r"LLVM version \S+", version).group(0), "(llvm-mca), 1 core, in L1")
    print(f"| CPU model | fucina {ours_name}, cycles / MACs per cycle | llama.cpp "
          f"{theirs_name}, cycles / MACs per cycle | fucina / llama.cpp |")
    print("|---|---:|---:|---:|")
    for row in args.cpus.split(","):
        cpu = row.split(":")[0]                  # "cpu:level": one level of that CPU
        ours, theirs, note = loops(row)
        c_ours = mca_cycles(args.mca, ours, cpu, triple)
        c_theirs = mca_cycles(args.mca, theirs, cpu, triple)
        r_ours, r_theirs = macs(ours) / c_ours, macs(theirs) / c_theirs
        print(f"| {row} | {c_ours:.1f} / {r_ours:.1f} ({macs(ours)} MACs) | "
              f"{c_theirs:.1f} / {r_theirs:.1f} ({macs(theirs)} MACs{note}) | "
              f"{r_ours / r_theirs:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpus", default=None, help="LLVM CPU models (default: "
                    "znver4,sapphirerapids,icelake-server; with --arm "
                    "apple-m1,apple-m2,neoverse-n1,neoverse-v1,cortex-a76)")
    ap.add_argument("--arm", action="store_true",
                    help="aarch64 CPU models: the generic level against llama.cpp's "
                    "ARM repack kernels")
    ap.add_argument("--clang", default="clang++-19", help="for --arm")
    ap.add_argument("--level", default=None, help="for --arm: generic (the old "
                    "comparison), or one aarch64 level (default: each the CPU has)")
    ap.add_argument("--q4k", action="store_true", help="for --arm: Q4_K, not Q8_0")
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
    if args.arm:
        clang = shutil.which(args.clang)
        if clang is None:
            sys.exit(f"{args.clang} not found: `apt-get install clang-19 "
                     "g++-aarch64-linux-gnu` (the compiler and aarch64 headers)")
        args.cpus = args.cpus or ",".join(ARM_LEVELS)
        fmt = "Q4_K" if args.q4k else "Q8_0"
        if args.level == "generic":
            def arm_loops(cpu):
                kernel, theirs = llama_loop_arm(args.llama_build, cpu, clang, fmt)
                return (fucina_loop_arm(cpu, "generic", fmt), theirs,
                        ", " + kernel.split("_")[4])
            print_table(args, "aarch64", f"generic {fmt} packed GEMM", "repack GEMM",
                        arm_loops)
            return
        args.cpus = ",".join(f"{cpu}:{lv}" for cpu in args.cpus.split(",")
                             for lv in ARM_LEVELS.get(cpu, ("dotprod",))
                             if args.level in (None, lv))

        def level_loops(row):
            cpu, lv = row.split(":")
            kernel, theirs = llama_loop_arm(args.llama_build, cpu, clang, fmt, lv)
            return (fucina_loop_arm(cpu, lv, fmt), theirs,
                    ", " + "_".join(kernel.split("_")[3:5]))
        print_table(args, "aarch64", f"{fmt} packed GEMM at the level", "repack GEMM",
                    level_loops)
        return
    args.cpus = args.cpus or "znver4,sapphirerapids,icelake-server"
    theirs = llama_loop(args.llama_build)
    print_table(args, "x86_64", "packed GEMM", "tinyBLAS gemm4xN<4>",
                lambda cpu: (fucina_loop(cpu), theirs, ""))


if __name__ == "__main__":
    main()
