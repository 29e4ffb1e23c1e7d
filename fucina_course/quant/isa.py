"""Which instruction-set level the kernels use on this CPU.

A *level* names a family of kernels, best first:

| level | integer dot product | CPUs |
|---|---|---|
| avx512vnni | `vpdpbusd` on zmm / ymm (EVEX) | Intel Ice Lake+ (servers), Zen 4+ |
| avxvnni | `{vex} vpdpbusd` on ymm | Intel Alder Lake+ (most laptops since 2021) |
| avx2 | `vpmaddubsw` + `vpmaddwd` on ymm | Haswell+, every Zen |
| i8mm | `smmla` (2x8 by 8x2 bytes) in prefill, `sdot` elsewhere | Apple M2+, Neoverse V1+ / Graviton3+ |
| dotprod | `sdot` (4 s8 x s8 products per int32 lane) | Apple M1, Neoverse N1 / Graviton2, Cortex-A76+ (Raspberry Pi 5) |
| neon | none: `sdot`'s lanes in portable IR (`smull`, pairwise adds) | every 64-bit ARM |
| generic | none: portable IR or float loops | anything numba runs on |

Two families, one per architecture: the x86 levels (`X86`) and the aarch64 ones (`ARM`);
a process uses the family of the target numba compiles for (`ARCH`, from LLVM's process
triple) and "generic".  The aarch64 levels compute the same int32 lanes as the VNNI levels
(4 adjacent products each; ARM multiplies signed by signed, so the quants stay signed and
no offsets are needed) and do the same float operations on them, so their results equal
avx512vnni's and avxvnni's bit for bit (the packed GEMM's equal every level's), and one set
of golden files serves both architectures (scripts/test_aarch64.sh checks it under qemu).
"neon" is not the generic level compiled for ARM: the generic kernels group their int16
products differently (`_ir.madd_host`), which changes the float sums in the last bits.
On aarch64 the features come from LLVM's host string (Linux: /proc/cpuinfo's `asimddp`,
`i8mm`), and on macOS, whose string may lack them, from `sysctl hw.optional.arm.FEAT_*`.

The three x86 levels are integer kernels written in LLVM IR (_int_matvec.py,
_int_matmul.py) and compiled by LLVM for the level's features only (`target`, _jit.py):
the avx2 kernels are compiled for a CPU that has no AVX-512, so LLVM cannot emit a zmm
register, an EVEX encoding or a mask register in them, even on a machine that has all
three (tests/test_quant.py reads their assembly to be sure).  "generic" is portable
code compiled for whatever CPU numba compiles for: every quantized format (their
records' `kernels.int_levels`) as the same IR kernels, their dot products written on
int16 activations in plain LLVM vector operations (`_ir.madd_host`: int16 products,
int32 sums; no target intrinsic but SSE2's pmaddwd, which every x86-64 CPU has, so
LLVM picks the host's instructions, NEON on ARM; prefill's packed GEMM multiplies bytes
on x86 with SSSE3's pmaddubsw, _int_packed.byte_products), where LLVM converts f16
natively (`GENERIC_IR`); F16 / BF16 / F32, and every format on a CPU without, as the
float kernels of matvec.py.

The choice is made once, at import: the best level whose `NEEDED` features are all in
the feature string numba compiles for (the host's, or NUMBA_CPU_FEATURES).
FUCINA_SIMD=avx512vnni|avxvnni|avx2|i8mm|dotprod|neon|generic caps it (a level this
CPU lacks gives the best one below it, with a warning; a level of the other
architecture's family gives generic); FUCINA_NO_VNNI=1 is the older spelling of "no VNNI
instruction", i.e. avx2 where the CPU has it.  `level` may be reassigned at run time
(tests, benchmarks); a level outside `USABLE` dispatches the generic kernels, never an
instruction the CPU lacks.  The dispatch tables (matvec.KERNELS, matmul.KERNELS) are
keyed by (format, level) and built from the formats' records: a new level is a name and
its features here, its kernels (_ir.py, _int_matvec.py, _int_matmul.py), and its name
in the records of the formats that have them (formats.py: `int_levels`, `blas_from`).
"""

from __future__ import annotations

import os
import platform
import subprocess
import warnings

import llvmlite.binding as ll
from numba.core import config
from numba.core.codegen import get_host_cpu_features

AVX512VNNI = "avx512vnni"
AVXVNNI = "avxvnni"
AVX2 = "avx2"
I8MM = "i8mm"
DOTPROD = "dotprod"
NEON = "neon"
GENERIC = "generic"
FLOAT = GENERIC          # the generic level's name before the integer levels for AVX2
X86: tuple[str, ...] = (AVX512VNNI, AVXVNNI, AVX2)       # each family best first
ARM: tuple[str, ...] = (I8MM, DOTPROD, NEON)
FAMILIES: dict[str, tuple[str, ...]] = {"x86_64": X86, "aarch64": ARM}
ALL_LEVELS: tuple[str, ...] = X86 + ARM + (GENERIC,)
# an LLVM triple for each family, to build and compile its kernels on another machine
# (tests, bench/mca_prefill.py)
TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-unknown-linux-gnu"}


def arch_of(triple: str) -> str:
    """"x86_64", "aarch64" or the triple's first part, for an LLVM target triple."""
    first = str(triple).split("-")[0].lower()
    if first in ("x86_64", "amd64"):
        return "x86_64"
    if first in ("aarch64", "arm64", "aarch64_be"):
        return "aarch64"
    return first


def family(level: str) -> str | None:
    """The architecture whose family has `level` (None: generic, anywhere)."""
    return next((arch for arch, levels in FAMILIES.items() if level in levels), None)


def is_arm(level: str) -> bool:
    """True for the aarch64 levels (neon, dotprod, i8mm)."""
    return level in ARM


# the architecture numba compiles for, and this process's levels, best first
ARCH = arch_of(ll.get_process_triple())
LEVELS: tuple[str, ...] = FAMILIES.get(ARCH, ()) + (GENERIC,)

# The x86-64-v3 set (Haswell, every Zen): what the avx2 kernels are compiled for.
_V3 = ("sse4.2", "ssse3", "popcnt", "avx", "avx2", "fma", "f16c", "bmi", "bmi2")

# level -> the LLVM features its kernels may use; they are compiled for exactly these
# (`target`), so a CPU with all of them runs every instruction in them.
NEEDED: dict[str, frozenset[str]] = {
    AVX512VNNI: frozenset(_V3 + ("avx512f", "avx512bw", "avx512vl", "avx512dq",
                                 "avx512vnni")),
    AVXVNNI: frozenset(_V3 + ("avxvnni",)),
    AVX2: frozenset(_V3),
    # aarch64: AdvSIMD, then the dot product (ARMv8.2's FEAT_DotProd, ARMv8.4+) and the
    # int8 matrix multiply (FEAT_I8MM, ARMv8.6+) that llama.cpp's repack kernels use
    NEON: frozenset(("neon",)),
    DOTPROD: frozenset(("neon", "dotprod")),
    I8MM: frozenset(("neon", "dotprod", "i8mm")),
    GENERIC: frozenset(),
}
NEEDED_FEATURES = NEEDED   # the older name


def numba_cpu_name() -> str:
    """The LLVM CPU name numba compiles for: NUMBA_CPU_NAME or the host's."""
    return str(config.CPU_NAME or ll.get_host_cpu_name())


def target(level: str) -> tuple[str, str, str]:
    """(cpu, features, tune-cpu) the integer kernels of `level` are compiled for: the
    baseline x86-64 CPU plus exactly the level's features, scheduled for this CPU
    (tuning orders instructions, it never adds any; without it one run was 5-8% slower
    in cache, docs/BENCHMARKS.md#instruction-set-levels)."""
    if level == GENERIC:            # portable IR: compiled as numba compiles its code
        return numba_cpu_name(), numba_cpu_features(), numba_cpu_name()
    features = ",".join("+" + f for f in sorted(NEEDED[level]))
    if is_arm(level):               # aarch64: LLVM's baseline CPU, "generic"
        tune = numba_cpu_name() if ARCH == "aarch64" else "generic"
        return "generic", features, tune
    return "x86-64", features, numba_cpu_name()


def triple(level: str) -> str:
    """The LLVM target triple `level`'s kernels are compiled for: this process's own
    for its family (and generic), else the other family's (`TRIPLES`)."""
    arch = family(level)
    if arch is None or arch == ARCH:
        return ll.get_process_triple()
    return TRIPLES[arch]


def native_half(features: str, arch: str) -> bool:
    """True if LLVM converts f16 to f32 with an instruction on this target: x86 with
    F16C, or 64-bit ARM (base ARMv8).  Elsewhere it calls a runtime function that the
    kernels' JIT linker may not find, so the generic level keeps its float kernels."""
    arch = arch.lower()
    if arch in ("x86_64", "amd64"):
        return "+f16c" in features.split(",")
    return arch in ("aarch64", "arm64")


def numba_cpu_features() -> str:
    """The LLVM feature string numba compiles for: NUMBA_CPU_FEATURES or the host's
    (on aarch64 completed by `arm_host_features`)."""
    if config.CPU_FEATURES is not None:
        return str(config.CPU_FEATURES)
    features = str(get_host_cpu_features())
    if ARCH == "aarch64":
        features = arm_host_features(features)
    return features


# macOS names of the aarch64 features the levels need (sysctl hw.optional.arm.<name>),
# and Linux's (/proc/cpuinfo "Features")
_DARWIN_FEATURES = {"dotprod": "FEAT_DotProd", "i8mm": "FEAT_I8MM"}
_LINUX_FEATURES = {"dotprod": "asimddp", "i8mm": "i8mm"}


def arm_host_features(features: str, system: str | None = None, sysctl=None,
                      cpuinfo: str | None = None) -> str:
    """An aarch64 host's LLVM feature string with what the levels need added when the
    host has it but the string does not say so: "+neon" (AdvSIMD, in every aarch64
    CPU Linux and macOS run on), and "+dotprod" / "+i8mm" from `sysctl
    hw.optional.arm.FEAT_DotProd / FEAT_I8MM` on macOS (older LLVMs return nothing
    there) or /proc/cpuinfo's Features `asimddp` / `i8mm` on Linux (`cpuinfo`: its
    text, tests).  Why the latter: the LLVM 22 of llvmlite 0.50 left both out under
    qemu's `-cpu max`, whose cpuinfo lists them (scripts/test_aarch64.sh, 2026-12-05).
    A feature the string turns off ("-i8mm") stays off."""
    system = platform.system() if system is None else system
    sysctl = _sysctl if sysctl is None else sysctl
    parts = [f for f in features.split(",") if f]
    named = {f[1:] for f in parts}
    add = [] if "neon" in named else ["neon"]
    if system == "Darwin":
        add += [f for f, key in _DARWIN_FEATURES.items()
                if f not in named and sysctl(f"hw.optional.arm.{key}") == "1"]
    elif system == "Linux":
        text = _proc_cpuinfo() if cpuinfo is None else cpuinfo
        line = next((ln for ln in text.splitlines() if ln.lower().startswith("features")),
                    "")
        have = set(line.partition(":")[2].split())
        add += [f for f, key in _LINUX_FEATURES.items()
                if f not in named and key in have]
    return ",".join(parts + ["+" + f for f in add])


def _proc_cpuinfo() -> str:
    """/proc/cpuinfo's text, or "" (read at import: before the readers below)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _sysctl(name: str) -> str:
    """`sysctl -n name` (macOS), or "" if it fails."""
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def usable(level: str, features: str) -> bool:
    """True if an LLVM feature string ("+avx2,-avx512f,...") has all `level` needs."""
    on = {f[1:] for f in features.split(",") if f.startswith("+")}
    return NEEDED[level] <= on


def vnni_usable(features: str) -> bool:
    return usable(AVX512VNNI, features)


def requested(env=os.environ) -> str:
    """The level FUCINA_SIMD (or FUCINA_NO_VNNI=1) asks for; the best one if neither."""
    name = env.get("FUCINA_SIMD", "").strip().lower()
    if name:
        if name not in ALL_LEVELS:
            raise ValueError(f"FUCINA_SIMD={name!r}: expected one of "
                             f"{', '.join(ALL_LEVELS)}")
        return name
    if env.get("FUCINA_NO_VNNI", "") not in ("", "0"):
        return AVX2 if ARCH == "x86_64" else LEVELS[0]
    return LEVELS[0]


def usable_levels(features: str, cap: str, arch: str | None = None) -> tuple[str, ...]:
    """The levels at or below `cap` that a CPU of `arch` (default: this process's)
    with `features` runs, best first: its family's and generic.  A cap from another
    family leaves generic alone."""
    levels = FAMILIES.get(ARCH if arch is None else arch, ()) + (GENERIC,)
    below = levels[levels.index(cap):] if cap in levels else (GENERIC,)
    return tuple(lv for lv in below if usable(lv, features))


# The levels this process may run, best first (always ends with GENERIC).
_CAP = requested()
USABLE: tuple[str, ...] = usable_levels(numba_cpu_features(), _CAP)
BEST = USABLE[0]
HAVE_VNNI = AVX512VNNI in USABLE
# The generic level's quantized formats run as portable IR kernels (else float loops).
GENERIC_IR = native_half(numba_cpu_features(), platform.machine())
if _CAP != BEST and os.environ.get("FUCINA_SIMD"):
    warnings.warn(f"FUCINA_SIMD={_CAP}: this CPU lacks "
                  f"{', '.join(sorted(NEEDED[_CAP] - NEEDED[BEST]))}; using {BEST}",
                  stacklevel=2)

# The level the dispatchers (matvec, matmul) use.  Assign another name from USABLE to
# run its kernels (tests, benchmarks); a level missing from USABLE runs the generic
# kernels.
level = BEST


# Intel family 6 model numbers -> microarchitecture
# (Linux: arch/x86/include/asm/intel-family.h)
_INTEL_FAMILY6 = {
    42: "Sandy Bridge", 45: "Sandy Bridge-EP", 58: "Ivy Bridge", 62: "Ivy Bridge-EP",
    60: "Haswell", 63: "Haswell-EP", 69: "Haswell", 70: "Haswell",
    61: "Broadwell", 71: "Broadwell", 79: "Broadwell-EP", 86: "Broadwell-DE",
    78: "Skylake", 94: "Skylake", 85: "Skylake-SP", 102: "Cannon Lake",
    142: "Kaby Lake", 158: "Coffee Lake", 165: "Comet Lake", 166: "Comet Lake",
    106: "Ice Lake-SP", 108: "Ice Lake-D", 125: "Ice Lake", 126: "Ice Lake",
    140: "Tiger Lake", 141: "Tiger Lake", 167: "Rocket Lake",
    151: "Alder Lake", 154: "Alder Lake", 183: "Raptor Lake", 186: "Raptor Lake",
    191: "Raptor Lake", 170: "Meteor Lake", 172: "Meteor Lake", 189: "Lunar Lake",
    197: "Arrow Lake", 198: "Arrow Lake",
    143: "Sapphire Rapids", 207: "Emerald Rapids", 173: "Granite Rapids",
    174: "Granite Rapids-D", 175: "Sierra Forest",
}
# the families above whose cores have AMX (Sapphire Rapids was the first)
_INTEL_AMX = {"Sapphire Rapids", "Emerald Rapids", "Granite Rapids", "Granite Rapids-D"}


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key : value` lines of a /proc/cpuinfo text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break           # end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _read_cpuinfo() -> str:
    return _proc_cpuinfo()


def cpu_name(text: str | None = None) -> str:
    """The first processor's "model name" from /proc/cpuinfo (or `text`), else
    platform.processor() or "?".  (The benchmarks' one reader of it.)"""
    name = _cpuinfo_fields(_read_cpuinfo() if text is None else text).get("model name")
    return name or (platform.processor() if text is None else "") or "?"


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The first processor's cpuinfo flags: x86's "flags", ARM's "Features" (empty
    where there is no /proc/cpuinfo)."""
    fields = _cpuinfo_fields(_read_cpuinfo() if text is None else text)
    return frozenset((fields.get("flags") or fields.get("features", "")).split())


def cpu_family(text: str | None = None) -> str:
    """A short name of this CPU's microarchitecture family, e.g. "Intel Sapphire Rapids",
    "AMD Zen 4", read from /proc/cpuinfo (or from `text`, a cpuinfo text: tests).

    Why not the level alone: the same level runs differently on different cores.  Zen 4
    has avx512vnni but executes each 512-bit instruction as two 256-bit halves, so the
    avx512vnni kernels gain less over avx2 there than on an Intel server core with full
    512-bit units; a benchmark line has to say which family it ran on to be read
    (bench/bench_vs_llama.py prints it).  Never raises: an unknown CPU gives
    "Intel (family F model M)", "AMD (family F model M)", platform.processor() or
    "unknown".
    """
    try:
        fallback = text is None
        if text is None:
            text = _read_cpuinfo()
        fields = _cpuinfo_fields(text)
        vendor = fields.get("vendor_id", "")
        flags = cpu_flags(text)
        try:
            family = int(fields.get("cpu family", ""))
            model = int(fields.get("model", ""))
        except ValueError:
            family = model = -1
        if vendor == "GenuineIntel" and family >= 0:
            name = _INTEL_FAMILY6.get(model) if family == 6 else None
            if model == 85 and family == 6:      # one model number, three generations
                try:
                    stepping = int(fields.get("stepping", ""))
                except ValueError:
                    stepping = -1
                name = ("Cooper Lake" if stepping >= 10 else "Cascade Lake"
                        if stepping >= 5 else "Skylake-SP")
            if "amx_tile" in flags and name not in _INTEL_AMX:
                # a hypervisor may report another model number than the host's (seen:
                # model 167, Rocket Lake, beside AMX and AVX512-FP16): the flags win
                return f"Intel Sapphire Rapids+ (AMX; reported model {model})"
            return f"Intel {name}" if name else f"Intel (family {family} model {model})"
        if vendor in ("AuthenticAMD", "HygonGenuine") and family >= 0:
            if vendor == "HygonGenuine":
                return "Hygon Dhyana (Zen 1)" if family == 24 else \
                    f"Hygon (family {family} model {model})"
            if family == 23:
                zen1 = model < 0x30 or 0x50 <= model < 0x60
                return "AMD Zen 1" if zen1 else "AMD Zen 2"
            if family == 25:    # Zen 3 and Zen 4 share it; Zen 4 has AVX-512
                return "AMD Zen 4" if "avx512f" in flags else "AMD Zen 3"
            if family == 26:
                return "AMD Zen 5"
            return f"AMD (family {family} model {model})"
        machine = platform.machine().lower() if fallback else ""
        if "cpu implementer" in fields or machine in ("arm64", "aarch64"):
            return "Apple/ARM"
        if fallback:
            return platform.processor() or platform.machine() or "unknown"
        return "unknown"
    except Exception:       # a benchmark label must never stop a benchmark
        return "unknown"
