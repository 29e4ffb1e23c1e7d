"""The quantized kernels' outputs on fixed seeded inputs, one .npy per (format, kernel):
what scripts/test_aarch64.sh compares bit for bit between an x86 host and an emulated
aarch64 (qemu user mode) run.

    python scripts/aarch64_kernel_outputs.py run OUTDIR [--quick]
    python scripts/aarch64_kernel_outputs.py compare REF_DIR GOT_DIR [--quick]
    python scripts/aarch64_kernel_outputs.py levels        # isa.USABLE, one line

`run` computes, at the level the process runs (FUCINA_SIMD selects it at import; the
script records `isa.level`), for every block format:

* `matvec`  -- `quant.matvec` of one activation row (decode);
* `rows`    -- `matmul(path="rows")`, the multi-row kernels (batch decode; the gemv path
               at the generic level and for the float formats);
* `packed`  -- `matmul(path="packed")`, prefill's packed GEMM (integer formats only).

and writes OUTDIR/<FORMAT>.<kernel>.npy (float32) plus OUTDIR/manifest.json: the level,
the machine, the versions, and a sha256 of every input (weights bytes and activations),
so that a difference in the outputs is never a difference in the inputs in disguise
(the inputs come from numpy's seeded PCG64 and gguf-py's quantizer: platform-neutral,
and the manifest proves it).

`compare` checks the inputs' hashes, then every output's raw bytes (np.array_equal on a
uint32 view: -0.0 != 0.0, NaN payloads count) and prints, for a difference, how many
elements differ, the largest |difference| relative to the largest |value| and the
largest distance in float32 units in the last place.  Exit status 1 on any difference.

`--quick`: Q8_0 and Q4_K only (the CI subset of scripts/test_aarch64.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

QUICK = ("Q8_0", "Q4_K")
KERNELS = ("matvec", "rows", "packed")
N_OUT = 70          # not a multiple of the 16-row chunks: a partial chunk every time
M_ROWS = 33         # prefill rows: 4 full 8-row tiles and one row more
SEED = 20260447


def _n_in(block: int) -> int:
    # 5 super-blocks for the K-quants; an odd count of 32-element blocks (41) for the
    # others (their tail-block code); the float formats as the 32-element ones
    return 5 * 256 if block == 256 else 41 * 32


def _weights(t, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 bytes of an [n_out, n_in] matrix of format t, made as tests/test_quant.py
    makes them: gguf-py's quantizer where it has one, random valid blocks elsewhere."""
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as T

    from fucina_course.quant.reference import random_blocks
    if t in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        x = (rng.standard_normal((n_out, n_in)) * 0.02).astype(np.float32)
        x[0, :32] = 0.0                                   # an all-zero block (d = 0)
        return np.ascontiguousarray(gq.quantize(x, t)).view(np.uint8).reshape(-1)
    return random_blocks(rng, t, n_out * n_in, scale=0.02 / 8)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:20]


def run(outdir: Path, quick: bool) -> dict:
    import importlib

    import llvmlite
    import numba
    from gguf import GGMLQuantizationType as T

    from fucina_course.quant import FORMATS, QuantMatrix, isa, matvec
    matmul_mod = importlib.import_module("fucina_course.quant.matmul")

    outdir.mkdir(parents=True, exist_ok=True)
    names = [t.name for t in FORMATS]
    names = [n for n in names if n in QUICK] if quick else names
    manifest = {"level": isa.level, "usable": list(isa.USABLE),
                "generic_ir": bool(isa.GENERIC_IR), "machine": platform.machine(),
                "cpu": isa.numba_cpu_name(), "numpy": np.__version__,
                "numba": numba.__version__, "llvmlite": llvmlite.__version__,
                "inputs": {}, "outputs": {}, "seconds": {}}
    for name in names:
        t = T[name]
        fmt = FORMATS[t]
        rng = np.random.default_rng([SEED, int(t)])
        n_in = _n_in(fmt.block_size)
        raw = _weights(t, N_OUT, n_in, rng)
        X = (rng.standard_normal((M_ROWS, n_in)) * rng.random((M_ROWS, 1)) * 3 + 0.2)
        X = X.astype(np.float32)
        X[1, :32] = 0.0                                   # an all-zero activation block
        manifest["inputs"][name] = {"weights": _sha(raw), "x": _sha(X),
                                    "shape": [N_OUT, n_in, M_ROWS]}
        w = QuantMatrix(raw, t, N_OUT, n_in)
        t0 = time.perf_counter()
        got = {"matvec": matvec(w, X[3]),
               "rows": matmul_mod.matmul(w, X[:9], path="rows")}
        if matmul_mod.has_packed_kernel(w):
            got["packed"] = matmul_mod.matmul(w, X, path="packed")
        manifest["seconds"][name] = round(time.perf_counter() - t0, 2)
        for kernel, y in got.items():
            y = np.ascontiguousarray(y, dtype=np.float32)
            np.save(outdir / f"{name}.{kernel}.npy", y)
            manifest["outputs"][f"{name}.{kernel}"] = _sha(y)
        print(f"  {isa.level:10s} {name:5s} {' '.join(got):20s} "
              f"{manifest['seconds'][name]:6.1f}s", flush=True)
    (outdir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in float32 units in the last place (int64; sign-magnitude bits made
    monotonic so that it counts representable floats between a and b)."""
    def ordered(x):
        i = np.ascontiguousarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(a) - ordered(b))


def compare_arrays(a: np.ndarray, b: np.ndarray) -> str | None:
    """None if `a` and `b` are the same float32 bytes, else a one-line description of
    how they differ (count, relative size, ULPs)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {a.shape} {a.dtype} != {b.shape} {b.dtype}"
    ua = np.ascontiguousarray(a).view(np.uint8)
    ub = np.ascontiguousarray(b).view(np.uint8)
    if np.array_equal(ua, ub):
        return None
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    differ = a32.view(np.uint32) != b32.view(np.uint32)
    scale = max(float(np.max(np.abs(a32.astype(np.float64)))), 1e-30)
    rel = float(np.max(np.abs(a32.astype(np.float64) - b32.astype(np.float64)))) / scale
    return (f"{int(differ.sum())}/{differ.size} elements differ, max |diff|/max|y| "
            f"{rel:.2e}, max {int(ulp_distance(a32, b32).max())} ulp")


def compare_dirs(ref: Path, got: Path, quick: bool = False) -> list[tuple[str, str]]:
    """[(what, description)] of every difference between two `run` directories: inputs
    (by hash), missing outputs, outputs (by bytes).  Empty: identical."""
    problems: list[tuple[str, str]] = []
    mref = json.loads((ref / "manifest.json").read_text())
    mgot = json.loads((got / "manifest.json").read_text())
    for name, h in mgot["inputs"].items():
        if name not in mref["inputs"]:
            problems.append((name, f"no reference run for this format in {ref}"))
        elif mref["inputs"][name] != h:
            why = f"INPUTS differ (weights/x hashes): {mref['inputs'][name]} != {h}"
            problems.append((name, why))
    want = sorted(k for k in mref["outputs"] if not quick or k.split(".")[0] in QUICK)
    for key in want:
        if key not in mgot["outputs"]:
            problems.append((key, "missing in " + str(got)))
            continue
        diff = compare_arrays(np.load(ref / f"{key}.npy"), np.load(got / f"{key}.npy"))
        if diff:
            problems.append((key, diff))
    for key in sorted(set(mgot["outputs"]) - set(mref["outputs"])):
        problems.append((key, "missing in " + str(ref)))
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("outdir", type=Path)
    r.add_argument("--quick", action="store_true")
    c = sub.add_parser("compare")
    c.add_argument("ref", type=Path)
    c.add_argument("got", type=Path)
    c.add_argument("--quick", action="store_true")
    sub.add_parser("levels")
    a = p.parse_args(argv)
    if a.cmd == "levels":
        from fucina_course.quant import isa
        print(" ".join(isa.USABLE))
        return 0
    if a.cmd == "run":
        run(a.outdir, a.quick)
        return 0
    problems = compare_dirs(a.ref, a.got, a.quick)
    for what, why in problems:
        print(f"  DIFF {what}: {why}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    sys.exit(main())
