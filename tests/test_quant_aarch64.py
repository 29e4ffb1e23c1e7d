"""The aarch64 levels (isa.ARM: neon, dotprod, i8mm) without an ARM machine.

* Their kernels are built for an aarch64 module and compiled by llvmlite's own LLVM
  (it has the AArch64 back end) to assembly, which must hold the level's dot product
  and nothing of a higher level: `sdot` from dotprod on, `smmla` at i8mm only (in the
  packed GEMM of the 32-element formats), neither at neon.
* Their arithmetic runs here: with `_ir.PORTABLE_ARM` the two aarch64 intrinsics are
  built as plain IR, so each level's kernels compile for this x86 CPU, and matvec,
  the multi-row tiles and the packed GEMM must equal the VNNI levels' bit for bit
  (the design: same int32 lanes, same float operations, isa.py).  The instructions
  themselves run under qemu: scripts/test_aarch64.sh.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from llvmlite import ir

from fucina_course.quant import _ir, _jit, isa
from fucina_course.quant._int import IntKernels
from fucina_course.quant.matmul import matmul
from fucina_course.quant.matrix import QuantMatrix
from fucina_course.quant.matvec import matvec
from test_quant import INT_TYPES, QK, make_weights, matmul_mod, matvec_mod

ARM_TRIPLE = isa.TRIPLES["aarch64"]


def arm_assembly(t, level) -> str:
    mod = ir.Module("arm")
    mod.triple = ARM_TRIPLE
    IntKernels(t, level).build(mod)
    cpu, features, _ = isa.target(level)
    return _jit.assembly_for(mod, ARM_TRIPLE, cpu, features)


def ops(asm: str) -> set[str]:
    return {line.split()[0] for line in asm.splitlines()
            if line.startswith("\t") and not line.startswith("\t.")}


def test_arm_levels_and_their_targets():
    assert isa.ARM == (isa.I8MM, isa.DOTPROD, isa.NEON) and isa.is_arm(isa.DOTPROD)
    assert isa.target(isa.DOTPROD)[:2] == ("generic", "+dotprod,+neon")
    assert isa.target(isa.I8MM)[:2] == ("generic", "+dotprod,+i8mm,+neon")
    apple_m2 = "+neon,+fp-armv8,+dotprod,+i8mm"
    assert isa.usable_levels(apple_m2, isa.I8MM, "aarch64") == (*isa.ARM, isa.GENERIC)
    assert isa.usable_levels("+neon,+dotprod", isa.I8MM, "aarch64") == (
        isa.DOTPROD, isa.NEON, isa.GENERIC)
    assert isa.usable_levels("+neon,+dotprod", isa.NEON, "aarch64") == (
        isa.NEON, isa.GENERIC)
    # a level of the other family caps at generic (with the usual warning at import)
    assert isa.usable_levels(apple_m2, isa.AVX2, "aarch64") == (isa.GENERIC,)
    assert isa.usable_levels("+avx2,+fma", isa.DOTPROD, "x86_64") == (isa.GENERIC,)
    assert isa.requested({"FUCINA_SIMD": "i8mm"}) == isa.I8MM
    with pytest.raises(ValueError, match="i8mm, dotprod, neon, generic"):
        isa.requested({"FUCINA_SIMD": "sve"})
    assert isa.arch_of("arm64-apple-darwin23") == "aarch64"
    assert isa.triple(isa.DOTPROD) in (ARM_TRIPLE, isa.ll.get_process_triple())


def test_arm_host_features():
    # Linux: LLVM's string is kept; "+neon" is added if missing, and what
    # /proc/cpuinfo's Features list has (qemu -cpu max: LLVM 22's string lacked both)
    assert isa.arm_host_features("+neon,+dotprod", "Linux", cpuinfo="") == (
        "+neon,+dotprod")
    assert isa.arm_host_features("+fp-armv8", "Linux", cpuinfo="") == "+fp-armv8,+neon"
    qemu_max = "processor\t: 0\nFeatures\t: fp asimd asimddp sve i8mm bf16\n"
    assert isa.arm_host_features("+neon,+sve", "Linux", cpuinfo=qemu_max) == (
        "+neon,+sve,+dotprod,+i8mm")
    assert isa.arm_host_features("+neon,-i8mm", "Linux", cpuinfo=qemu_max) == (
        "+neon,-i8mm,+dotprod")
    # macOS: sysctl hw.optional.arm.FEAT_* fills in what LLVM's string lacks
    m2 = {"hw.optional.arm.FEAT_DotProd": "1", "hw.optional.arm.FEAT_I8MM": "1"}
    got = isa.arm_host_features("", "Darwin", lambda k: m2.get(k, "0"))
    assert got == "+neon,+dotprod,+i8mm"
    m1 = {"hw.optional.arm.FEAT_DotProd": "1", "hw.optional.arm.FEAT_I8MM": "0"}
    got = isa.arm_host_features("+neon", "Darwin", lambda k: m1.get(k, ""))
    assert got == "+neon,+dotprod"
    assert isa.arm_host_features("+neon,-i8mm", "Darwin", lambda k: "1") == (
        "+neon,-i8mm,+dotprod")


@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_arm_levels_emit_their_instructions(t):
    code = {lv: ops(arm_assembly(t, lv)) for lv in isa.ARM}
    assert "sdot" not in code[isa.NEON] and "smmla" not in code[isa.NEON], t.name
    assert "sdot" in code[isa.DOTPROD] and "smmla" not in code[isa.DOTPROD], t.name
    assert "sdot" in code[isa.I8MM], t.name
    assert "smmla" in code[isa.I8MM], t.name             # the packed GEMM's
    for lv in isa.ARM:
        assert "bl" not in code[lv], (t.name, lv)        # no runtime call
        assert not any(re.match(r"^[a-z]+v?$", op) is None for op in code[lv]
                       if op.startswith("v")), (t.name, lv)   # no x86 left


VNNI = [lv for lv in (isa.AVX512VNNI, isa.AVXVNNI) if lv in isa.USABLE]


@pytest.fixture
def portable_arm(monkeypatch):
    """Run an aarch64 level here: its intrinsics as plain IR, compiled for this CPU's
    avx2 target, in kernels of their own name (no disk cache mixing)."""
    if not VNNI or isa.AVX2 not in isa.USABLE:
        pytest.skip("needs a VNNI level on this CPU to compare with")
    monkeypatch.setattr(_ir, "PORTABLE_ARM", True)
    x86_target = isa.target(isa.AVX2)
    real_target = isa.target
    monkeypatch.setattr(isa, "target", lambda lv: x86_target if isa.is_arm(lv)
                        else real_target(lv))
    monkeypatch.setattr(isa, "USABLE", isa.USABLE + isa.ARM)

    def use(level):
        for t in INT_TYPES:
            k = IntKernels(t, level)
            k.name += "_portable"
            monkeypatch.setitem(matvec_mod._BY_VALUE, (int(t), level), k)
            monkeypatch.setitem(matmul_mod._BY_VALUE, (int(t), level), k)
            monkeypatch.setitem(matmul_mod._PACKED_BY_VALUE, (int(t), level), k)
            monkeypatch.setitem(matmul_mod.ROWS_BLAS_MIN_ROWS_BY_LEVEL, level,
                                matmul_mod.ROWS_BLAS_MIN_ROWS_BY_LEVEL[isa.AVX2])
        monkeypatch.setattr(isa, "level", level)
    return use


@pytest.mark.parametrize("level", isa.ARM)
@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_arm_levels_equal_the_vnni_levels(t, level, portable_arm, monkeypatch):
    rng = np.random.default_rng(5)
    n_out, n_in = 45, 5 * 256 if QK[t] == 256 else 9 * 32
    w = QuantMatrix(make_weights(t, n_out, n_in, seed=11), t, n_out, n_in)
    X = (rng.standard_normal((21, n_in)) * 2).astype(np.float32)

    def run():
        return (matvec(w, X[3]), matmul(w, X[:7], path="rows"),
                matmul(w, X, path="packed"), matmul(w, X[:17], path="packed"))
    monkeypatch.setattr(isa, "level", VNNI[0])
    want = run()
    portable_arm(level)
    got = run()
    for i, (g, e) in enumerate(zip(got, want)):
        assert np.array_equal(g.view(np.uint32), e.view(np.uint32)), (t.name, level, i)


def test_arm_packed_gemm_tiles_and_loads():
    # the K-quants at i8mm pass over 4 activation rows (2 pairs), the 32-element
    # formats over 2 (_int_packed.tile_rows: why); the Q8_0 family's blocks and
    # activations load by multi-register `ld1` (_ir.ld1x: the Cortex-A76 model's
    # dispatch), and the generic level keeps LLVM's own loads
    from fucina_course.quant import _int_packed as P
    from gguf import GGMLQuantizationType as T
    assert P.tile_rows(P._layout(T.Q4_K, isa.I8MM)) == 4
    assert P.tile_rows(P._layout(T.Q8_0, isa.I8MM)) == P.I8MM_TILE
    assert P.tile_rows(P._layout(T.Q8_0, isa.DOTPROD)) == P.ARM_TILE
    asm = arm_assembly(T.Q8_0, isa.DOTPROD)
    packed = asm[asm.index("q8_0_dotprod_packed:"):]
    assert re.search(r"\tld1\t\{ v\d+\.16b, v\d+\.16b, v\d+\.16b, v\d+\.16b \}", packed)
