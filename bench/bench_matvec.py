"""Benchmark the quantized matrix kernels (fucina_course.quant) at Qwen3-0.6B shapes.

    python bench/bench_matvec.py                 # Q8_0 Q4_K Q6_K Q5_0 F16, 2 threads
    python bench/bench_matvec.py --formats Q8_0,Q4_1 --repeats 20 --no-sweep
    python bench/bench_matvec.py --formats Q4_K --no-prefill     # matvec only (faster)
    python bench/bench_matvec.py --formats Q4_K,Q5_0 --no-prefill --levels all
    python bench/bench_matvec.py --formats Q4_K --prefill-m 2,8,64 --paths rows,blas
    python bench/bench_matvec.py --formats Q8_0 --no-prefill --sweep-m 1,2,4,8

Prints, per format:
  * decode (matvec) GB/s = bytes of the quantized matrix / time, best of --repeats, for
    the four Qwen3-0.6B shapes n_in -> n_out: 1024->2048 (q), 1024->3072 (gate/up),
    3072->1024 (down), 1024->151936 (output).  A matrix called back to back sits partly
    in cache (this VM reports a 480 MB shared L3), so these are optimistic;
  * prefill (matmul) GFLOP/s = 2 m n_out n_in / time for each m of --prefill-m and each
    path of --paths ("auto"; "rows": the multi-row integer kernels; "gemv": one matvec
    per row; "blas": dequantized tiles + sgemm), for the first three shapes.  After
    every BLAS measurement the bench sleeps 0.15 s, so that OpenBLAS's worker threads
    stop spinning (they busy-wait ~0.1 s after each call, quant/matmul.py) and do not
    slow the next numba measurement;
  * "sweep" GB/s: every matrix of a 28-layer Qwen3-0.6B-shaped model once
    (q,k,v,o,gate,up,down x 28 + output, 0.33-1.2 GB depending on the format): the
    traffic of one decoded token, mostly from DRAM.  Compare with llama.cpp's ~11.5 GB/s
    decoding a Q8_0 Qwen3-0.6B on this machine (DESIGN.md).  With --sweep-m 1,2,4: the
    same sweep for m activation rows at once (batch decode of m streams: `matmul`, path
    "auto"), in GB/s of weights and ms per step;
  * the time to dequantize a 151936 x 896 embedding table (Q8_0 and Q5_0 only).

--levels: the instruction-set levels to measure (quant/isa.py), comma-separated, or
"all" (every level this CPU runs); default: the dispatched one (isa.level).  With
several, each decode number is measured for each level, alternately in the same run;
prefill and sweeps use the first.

The machine has 2 cores and is shared; the load average is printed first: distrust
numbers taken while it is above ~0.5.  Timings are the best of several repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

from fucina_course.quant import QuantMatrix, dequantize, isa, matmul, matvec
from fucina_course.quant.matmul import has_rows_kernel
from fucina_course.quant.reference import random_blocks

SHAPES = [(1024, 2048), (1024, 3072), (3072, 1024), (1024, 151936)]  # (n_in, n_out)
LAYER = [(1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024), (1024, 3072),
         (1024, 3072), (3072, 1024)]


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (and compile on a cold numba cache)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make(rng, t, n_in, n_out) -> QuantMatrix:
    raw = random_blocks(rng, t, n_in * n_out, scale=0.002)
    return QuantMatrix(raw, t, n_out, n_in, name=f"{n_out}x{n_in}")


def kernel_modes(t, args) -> list[tuple[str, str]]:
    """[(label, isa.level value)] to measure for format t."""
    if len(args.levels) == 1:
        return [("", args.levels[0])]
    return [(f"{lv} ", lv) for lv in args.levels]


def best_of_modes(fn, modes, repeats: int) -> dict[str, float]:
    """Best time of fn per kernel mode, the modes alternating within each repeat."""
    best = {}
    saved = isa.level
    try:
        for label, level in modes:
            isa.level = level
            fn()  # warm-up / compile
        for _ in range(repeats):
            for label, level in modes:
                isa.level = level
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                best[label] = min(best.get(label, float("inf")), dt)
    finally:
        isa.level = saved
    return best


def bench_prefill(w, args, rng) -> None:
    """One line per path: matmul GFLOP/s for each m of --prefill-m."""
    for path in args.paths:
        if path == "rows" and not has_rows_kernel(w):
            continue
        line = f"  {'':>15} prefill {path:<4} GFLOP/s:"
        for m in args.prefill_m:
            X = rng.standard_normal((m, w.n_in)).astype(np.float32)
            out = np.empty((m, w.n_out), np.float32)
            reps = max(3, min(args.repeats, 200 // m))
            s = best_of(lambda: matmul(w, X, out=out, path=path), reps)
            line += f"  m={m} {2 * m * w.n_in * w.n_out / s / 1e9:6.1f}"
            if path in ("blas", "auto"):
                time.sleep(0.15)   # let OpenBLAS's workers stop spinning
        print(line, flush=True)


def rates(times: dict[str, float], nbytes: int) -> str:
    return "  ".join(f"{label}{nbytes / s / 1e9:6.2f} GB/s ({s * 1e6:8.1f} us)"
                     for label, s in times.items())


def bench_sweep(t, args, rng, xs, modes) -> None:
    """The model sweep: every matrix of a Qwen3-0.6B-shaped model once (m = 1: matvec),
    or with m activation rows at once (matmul)."""
    mats = [make(rng, t, n_in, n_out) for _ in range(28) for n_in, n_out in LAYER]
    mats.append(make(rng, t, 1024, 151936))
    outs = [np.empty(w.n_out, np.float32) for w in mats]
    total = sum(w.nbytes for w in mats)

    def sweep():
        for w, o in zip(mats, outs):
            matvec(w, xs[w.n_in], out=o)
    if 1 in args.sweep_m:
        times = best_of_modes(sweep, modes, max(3, args.repeats // 4))
        print(f"  sweep of a Qwen3-0.6B-shaped model ({total / 1e6:.0f} MB, "
              f"{len(mats)} matrices): " + "  ".join(
                  f"{label}{total / s / 1e9:.2f} GB/s, {s * 1e3:.1f} ms per token"
                  for label, s in times.items()), flush=True)
    for m in (m for m in args.sweep_m if m > 1):
        Xs = {n: rng.standard_normal((m, n)).astype(np.float32)
              for n in (1024, 2048, 3072)}
        outs_m = [np.empty((m, w.n_out), np.float32) for w in mats]

        def sweep_m():
            for w, o in zip(mats, outs_m):
                matmul(w, Xs[w.n_in], out=o)
        s = best_of(sweep_m, max(3, args.repeats // 4))
        print(f"  sweep, {m} activation rows (batch decode, matmul auto): "
              f"{total / s / 1e9:.2f} GB/s, {s * 1e3:.1f} ms per step", flush=True)


def bench_format(t, args, rng) -> None:
    print(f"\n== {t.name}")
    modes = kernel_modes(t, args)
    xs = {n: rng.standard_normal(n).astype(np.float32) for n in (1024, 2048, 3072)}
    for n_in, n_out in SHAPES:
        w = make(rng, t, n_in, n_out)
        x = xs[n_in]
        y = np.empty(n_out, np.float32)
        reps = max(3, args.repeats // 4) if n_out > 100_000 else args.repeats
        times = best_of_modes(lambda: matvec(w, x, out=y), modes, reps)
        print(f"  {n_in:>5} -> {n_out:<6} decode " + rates(times, w.nbytes), flush=True)
        if args.prefill and n_out < 100_000:
            bench_prefill(w, args, rng)
        w = None               # freed before the next matrix is made
    small = make(rng, t, 1024, 128)
    y = np.empty(128, np.float32)
    times = best_of_modes(lambda: matvec(small, xs[1024], out=y), modes,
                          20 * args.repeats)
    print("  small 1024 -> 128 (a K/V head group): " + "  ".join(
        f"{label}{s * 1e6:.1f} us per call" for label, s in times.items()))
    if args.sweep:
        bench_sweep(t, args, rng, xs, modes)
    if t in (T.Q8_0, T.Q5_0):
        raw = random_blocks(rng, t, 151936 * 896)
        s = best_of(lambda: dequantize(raw, t, 151936 * 896), 3)
        print(f"  dequantize a 151936 x 896 table: {s:.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q8_0,Q4_K,Q6_K,Q5_0,F16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-prefill", dest="prefill", action="store_false",
                    help="decode numbers only")
    ap.add_argument("--prefill-m", default="4,16,64,256",
                    help="activation rows of the prefill numbers")
    ap.add_argument("--paths", default="rows,gemv,blas",
                    help="matmul paths: auto, rows, gemv, blas")
    ap.add_argument("--sweep-m", default="1",
                    help="activation rows of the sweeps (1 = decode, matvec)")
    ap.add_argument("--levels", default=None,
                    help="instruction-set levels, comma-separated, or 'all' "
                         "(default: isa.level)")
    args = ap.parse_args()
    args.prefill_m = [int(m) for m in args.prefill_m.split(",")]
    args.paths = [p.strip() for p in args.paths.split(",")]
    args.sweep_m = [int(m) for m in args.sweep_m.split(",")]
    if args.levels is None:
        args.levels = [isa.level]
    elif args.levels == "all":
        args.levels = list(isa.USABLE)
    else:
        args.levels = [lv.strip() for lv in args.levels.split(",")]
        bad = [lv for lv in args.levels if lv not in isa.USABLE]
        if bad:
            raise SystemExit(f"not usable here: {bad} (usable: {isa.USABLE})")
    isa.level = args.levels[0]  # prefill and sweeps: the first level
    numba.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"numba {numba.__version__}, numpy {np.__version__}, threads={args.threads}, "
          f"levels {','.join(args.levels)}, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if load[0] > 0.5:
        print("WARNING: the machine is busy; numbers will be low and noisy")
    rng = np.random.default_rng(0)
    for name in args.formats.split(","):
        bench_format(T[name.strip()], args, rng)


if __name__ == "__main__":
    main()
