"""bench.measure_roofline: the two ceilings the book's prefill/decode chapter plots."""

from __future__ import annotations

import math
import platform

import pytest

from fucina_course.bench import measure_roofline


def test_measure_roofline_reports_both_ceilings():
    shapes = ((64, 96, 128), (32, 32, 32))
    r = measure_roofline(2, read_bytes=2**22, shapes=shapes, read_repeats=2,
                         matmul_repeats=1)
    assert r["threads"] == 2
    assert math.isfinite(r["bandwidth_gb_s"]) and r["bandwidth_gb_s"] > 0
    assert [(s["m"], s["n"], s["k"]) for s in r["sgemm"]] == list(shapes)
    assert all(math.isfinite(s["gflop_s"]) and s["gflop_s"] > 0 for s in r["sgemm"])
    assert r["peak_gflop_s"] == max(s["gflop_s"] for s in r["sgemm"])


def _bench_script(name: str):
    """bench/<name>.py, a script, loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_bench_json_is_read_per_test():
    """llama-bench's `-o json` (issue 27's second llama.cpp witness): one figure per
    test, the median of the repetitions."""
    import json

    bvl = _bench_script("bench_vs_llama")
    text = json.dumps([
        {"build_commit": "0c1e570", "build_number": 1, "n_prompt": 64, "n_gen": 0,
         "avg_ts": 200.0, "samples_ts": [100.0, 300.0, 210.0]},
        {"build_commit": "0c1e570", "build_number": 1, "n_prompt": 0, "n_gen": 16,
         "avg_ts": 50.0},
        {"build_commit": "0c1e570", "build_number": 1, "n_prompt": 8, "n_gen": 8,
         "avg_ts": 1.0, "samples_ts": [1.0]},          # a pp+tg test: not ours
    ])
    got = bvl.parse_llama_bench(text)
    assert got == {"pp64": 210.0, "tg16": 50.0, "build": "commit 0c1e570 build 1"}
    cmd = bvl.llama_bench_cmd("lb", "m.gguf", 2, "16,64", 16, 3)
    assert cmd[:11] == ["lb", "-m", "m.gguf", "-p", "16,64", "-n", "16", "-t", "2",
                        "-r", "3"]
    assert cmd[cmd.index("-fa") + 1] == "off" and cmd[cmd.index("-b") + 1] == "512"
    assert bvl.llama_bench_cmd("lb", "m", 2, "", 16, 1)[4] == "0"
    assert abs(bvl.disagreement(110.0, 100.0) - 0.10) < 1e-12


def test_each_llama_cpp_build_has_its_llama_bench(tmp_path, capsys):
    """The emulated levels' second witness: LLAMA_CPP_ISA=avx2 gives llama.cpp's AVX2
    level's flags on any CPU (the same set as the AVX2 binding's script), and a
    llama-bench that is not there costs its column, with a note, not the run."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    flags = subprocess.run(
        ["bash", "-c", "source scripts/llama_cpp_flags.sh; echo $LLAMA_CPP_CMAKE_ARGS"],
        cwd=root, env={"LLAMA_CPP_ISA": "avx2", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True).stdout.split()
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2"):
        assert f"-DGGML_{on}=ON" in flags
    for off in ("AVX512", "AVX512_VNNI", "AVX512_VBMI", "AVX512_BF16", "AVX_VNNI"):
        assert f"-DGGML_{off}=OFF" in flags
    script = (root / "scripts" / "build_llama_cpp_avx2.sh").read_text()
    assert 'LLAMA_CPP_ISA=avx2 source "$(dirname' in script   # the binding: same flags
    assert "CMAKE_ARGS=$LLAMA_CPP_CMAKE_ARGS" in script and "-DGGML_" not in script

    bvl = _bench_script("bench_vs_llama")
    exe = tmp_path / "llama-bench"
    assert bvl.usable_llama_bench(None, str(exe), "LLAMA_CPP_ISA=avx2 ") == ""
    assert "LLAMA_CPP_ISA=avx2 scripts/build_llama_bench.sh" in capsys.readouterr().err
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert bvl.usable_llama_bench(None, str(exe), "") == str(exe)
    assert bvl.usable_llama_bench("", str(exe), "") == ""


def test_the_avx2_binding_is_found_in_its_default_directory(tmp_path, monkeypatch,
                                                           capsys):
    """The emulated levels' llama.cpp: scripts/build_llama_cpp_avx2.sh builds into the
    directory bench_vs_llama.py looks in, which is used only when it holds a llama_cpp
    and a level below avx512vnni runs; otherwise a note says whom they are compared
    with."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "build_llama_cpp_avx2.sh").read_text()
    bvl = _bench_script("bench_vs_llama")
    assert bvl.DEFAULT_LLAMA_AVX2.endswith("/.cache/fucina_course/llama-avx2")
    assert "DIR=${1:-$HOME/.cache/fucina_course/llama-avx2}" in script
    monkeypatch.setattr(bvl, "DEFAULT_LLAMA_AVX2", str(tmp_path))
    assert bvl.avx2_binding(None, ["avx512vnni"]) is None         # not needed
    assert bvl.avx2_binding(None, ["avx2"]) is None               # not built
    assert "the levels below avx512vnni are compared" in capsys.readouterr().err
    (tmp_path / "llama_cpp").mkdir()
    assert bvl.avx2_binding(None, ["", "generic"]) == str(tmp_path)
    assert bvl.avx2_binding("/x", ["avx2"]) == "/x"
    assert bvl.avx2_binding("", ["avx2"]) is None


def test_steal_time_is_the_share_of_ticks_the_hypervisor_took(monkeypatch, tmp_path):
    """bench_vs_llama's steal column: Linux's /proc/stat "steal" ticks over all ticks
    between two readings, None where it cannot be read."""
    import builtins

    bvl = _bench_script("bench_vs_llama")
    stat = tmp_path / "stat"
    real_open = builtins.open

    def fake_open(path, *a, **k):
        return real_open(stat if path == "/proc/stat" else path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 20 800 0 0 0 80 0 0\ncpu0 50 0 10 400 0 0 0 40 0 0\n")
    before = bvl.cpu_times()
    assert before == (80, 1000)
    stat.write_text("cpu  160 0 20 830 0 0 0 170 0 0\n")
    after = bvl.cpu_times()
    assert abs(bvl.steal_share(before, after) - 90 / 180) < 1e-12
    assert bvl.steal_share(after, after) is None and bvl.steal_share(None, after) is None
    stat.unlink()
    assert bvl.cpu_times() is None


def test_mca_picks_the_innermost_loop_with_the_most_dot_products():
    # bench/mca_prefill.py's static witness must time the loop the kernel spends its
    # time in: an outer loop holds more vpdpbusd (the inner's and its own) but is not it
    mca = _bench_script("mca_prefill")
    asm = "\n".join([
        "f:", "\tnop", ".L1:", "\tvpdpbusd\t(%rax), %zmm1, %zmm2",
        ".LBB0_2:", "\tvpdpbusd\t(%rax), %ymm1, %ymm2", "\tvpdpbusd\t4(%rax), %ymm1, %ymm3",
        "\tjne\t.LBB0_2", ".L3:", "\tvpdpbusd\t(%rcx), %ymm4, %ymm5", "\tjne\t.L3",
        "\taddq\t$1, %rax", "\tjne\t.L1", "\tret", "\t.size\tf, .-f", "g:",
        ".L9:", "\tvpdpbusd\t(%rax), %zmm1, %zmm2", "\tvpdpbusd\t(%rax), %zmm1, %zmm3",
        "\tvpdpbusd\t(%rax), %zmm1, %zmm4", "\tjne\t.L9"])
    loop = mca.innermost_loop(asm, "f")
    assert loop == ["\tvpdpbusd\t(%rax), %ymm1, %ymm2", "\tvpdpbusd\t4(%rax), %ymm1, %ymm3",
                    "\tjne\t.LBB0_2"]
    assert mca.macs(loop) == 64                       # two ymm: 8 lanes x 4 bytes each
    assert mca.macs(mca.innermost_loop(asm, "g")) == 3 * 64


def test_mca_reads_aarch64_loops_and_their_dot_products():
    # --arm: aarch64's backward branches (b.ne, cbnz with a register) delimit the
    # loops, and each dot-product instruction counts its own multiply-accumulates
    mca = _bench_script("mca_prefill")
    asm = "\n".join([
        "f:", ".LBB1_1:", "\tsdot\tv0.4s, v1.16b, v2.16b", ".LBB1_2:",
        "\tsmlal\tv3.4s, v4.4h, v5.4h", "\tsmlal2\tv3.4s, v4.8h, v5.8h",
        "\tsmull\tv6.8h, v7.8b, v8.8b", "\tsubs\tx9, x9, #1",
        "\tcbnz\tx9, .LBB1_2  // loop", "\tb.ne\t.LBB1_1", "\tret", ".Lfunc_end1:",
        "g:", ".LBB2_1:", "\tsmmla\tv0.4s, v1.16b, v2.16b", "\tsdot\tv3.4s, v1.16b, v2.16b",
        "\ttbnz\tw8, #0, .LBB2_1", ".Lfunc_end2:"])
    loop = mca.innermost_loop(asm, "f", mca.ARM_DOT)
    assert loop[0] == "\tsmlal\tv3.4s, v4.4h, v5.4h" and len(loop) == 5
    assert mca.macs(loop) == 4 + 4 + 8
    assert mca.macs(mca.innermost_loop(asm, "g", mca.ARM_DOT)) == 32 + 16
    with pytest.raises(ValueError):                 # f has no smmla loop: not a guess
        mca.innermost_loop(asm, "f", "smmla")


def _arm_mca():
    """bench/mca_prefill.py, or a skip where this llvmlite has no AArch64 back end."""
    import llvmlite.binding as ll

    ll.initialize_all_targets()
    try:
        ll.Target.from_triple("aarch64-unknown-linux-gnu")
    except RuntimeError:
        pytest.skip("this llvmlite has no AArch64 target")
    return _bench_script("mca_prefill")


def test_mca_compiles_the_generic_packed_gemm_for_aarch64():
    # the generic level's tile loop as LLVM compiles it for an Apple M1: 8 activation
    # rows x 8 weight rows x 32 elements, on NEON's widening multiply-adds (no x86
    # intrinsic leaks into an aarch64 module)
    from fucina_course.quant import isa
    from fucina_course.quant._int_packed import TILE, lanes

    mca = _arm_mca()
    loop = mca.fucina_loop_arm("apple-m1")
    assert mca.macs(loop) == TILE * lanes(isa.GENERIC) * 32 == 2048
    assert not any("pmadd" in t for t in loop)


def test_mca_compiles_the_arm_levels_packed_gemm():
    # --arm at the aarch64 levels: Q8_0's loop is `sdot` at dotprod (4 activation rows
    # x 4 weight rows x 32 elements, no smmla) and `smmla` at i8mm (2 rows x 16 weight
    # rows x 32); each CPU model has its levels, and llama.cpp's kernel per level
    from fucina_course.quant import isa
    from fucina_course.quant._int_packed import ARM_TILE, I8MM_TILE, lanes
    from fucina_course.quant._int_smmla import N

    mca = _arm_mca()
    loop = mca.fucina_loop_arm("neoverse-n1", isa.DOTPROD)
    assert mca.macs(loop) == ARM_TILE * lanes(isa.DOTPROD) * 32 == 512
    assert any(t.split()[0] == "sdot" for t in loop)
    assert not any(t.split()[0] in ("smmla", "smull", "smlal") for t in loop)
    loop = mca.fucina_loop_arm("neoverse-v1", isa.I8MM)
    assert mca.macs(loop) == I8MM_TILE * N * 32 == 1024
    assert sum(t.split()[0] == "smmla" for t in loop) == 32
    assert set(mca.ARM_LEVELS["apple-m2"]) == {isa.DOTPROD, isa.I8MM}
    assert mca.LLAMA_ARM[("Q8_0", isa.I8MM)] == ("ggml_gemm_q8_0_4x8_q8_0", "smmla")
    # Q4_K: `smmla` at i8mm (4 activation rows x 4 weight rows, _int_smmla.KQuantPairs)
    # and `sdot` at dotprod; each sub-block's total leaves the integers without
    # `scvtf` (two micro-ops on V1): it starts at the bits of 1.5 (`_ir.unbias`)
    for level, dot, count in ((isa.I8MM, "smmla", 16), (isa.DOTPROD, "sdot", 32)):
        loop = mca.fucina_loop_arm("neoverse-v1", level, "Q4_K")
        names = [t.split()[0] for t in loop]
        assert mca.macs(loop) == 4 * 4 * 32, (level, names)
        assert names.count(dot) == count and "scvtf" not in names, (level, names)
        assert any(n == "fmov" and "#1.5" in t for n, t in zip(names, loop)), loop


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the x86 kernels' assembly")
def test_mca_finds_the_packed_gemm_tile_loop():
    # the real kernel: 8 activation rows x 16 weight rows x 32 elements per iteration,
    # for the Zen 4 model's tuning; the process's numba target is left as it was
    from numba.core import config

    from fucina_course.quant import isa
    from fucina_course.quant._int_packed import TILE, lanes

    before = config.CPU_NAME
    mca = _bench_script("mca_prefill")
    loop = mca.fucina_loop("znver4")
    assert config.CPU_NAME == before
    assert mca.macs(loop) == TILE * lanes(isa.AVX512VNNI) * 32 == 4096
