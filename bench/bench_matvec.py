"""Benchmark the quantized matrix kernels (fucina_course.quant) at Qwen3-0.6B shapes.

    python bench/bench_matvec.py                      # Q8_0 Q4_K Q6_K Q5_0 F16, 2 threads
    python bench/bench_matvec.py --formats Q8_0,Q4_1 --repeats 20 --no-sweep
    python bench/bench_matvec.py --formats Q4_K --no-prefill        # decode only (faster)
    python bench/bench_matvec.py --formats Q4_K,Q5_0 --no-prefill --kernels both   # VNNI vs float kernels

Prints, per format:
  * decode (matvec) GB/s = bytes of the quantized matrix / time, best of --repeats, for the four
    Qwen3-0.6B shapes n_in -> n_out: 1024->2048 (q), 1024->3072 (gate/up), 3072->1024 (down),
    1024->151936 (output).  A matrix called back to back sits partly in cache (this VM reports a
    480 MB shared L3), so these are optimistic;
  * "sweep" GB/s: every matrix of a 28-layer Qwen3-0.6B-shaped model once (q,k,v,o,gate,up,down x 28 +
    output, 0.33-1.2 GB depending on the format): the traffic of one decoded token, mostly from DRAM.
    Compare with llama.cpp's ~11.5 GB/s decoding a Q8_0 Qwen3-0.6B on this machine (DESIGN.md);
  * prefill (matmul) GFLOP/s = 2 m n_out n_in / time for m = 16, 64, 256 (path "auto");
  * the time to dequantize a 151936 x 896 embedding table (Q8_0 and Q5_0 only).

--kernels: "auto" (the integer VNNI kernels where the CPU has them, decode.VNNI), "float" (the
float kernels), or "both" (each decode number for both, measured alternately in the same run).

The machine has 2 cores and is shared; the load average is printed first: distrust numbers taken
while it is above ~0.5.  Timings are the best of several repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType as T

from fucina_course.quant import QuantMatrix, decode, dequantize, matmul, matvec
from fucina_course.quant.reference import random_blocks

SHAPES = [(1024, 2048), (1024, 3072), (3072, 1024), (1024, 151936)]  # (n_in, n_out)
LAYER = [(1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024), (1024, 3072), (1024, 3072), (3072, 1024)]


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (and compile on a cold numba cache)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make(rng, t, n_in, n_out) -> QuantMatrix:
    return QuantMatrix(random_blocks(rng, t, n_in * n_out, scale=0.002), t, n_out, n_in, name=f"{n_out}x{n_in}")


def kernel_modes(t, args) -> list[tuple[str, bool]]:
    """[(label, decode.VNNI value)] to measure for format t."""
    has = decode.VNNI and t in decode._VNNI_FORMATS
    if args.kernels == "float" or not has:
        return [("" if args.kernels == "auto" else "float ", False)]
    if args.kernels == "both":
        return [("float ", False), ("vnni ", True)]
    return [("", True)]


def best_of_modes(fn, modes, repeats: int) -> dict[str, float]:
    """Best time of fn per kernel mode, the modes alternating within each repeat."""
    best = {}
    saved = decode.VNNI
    try:
        for label, vnni in modes:
            decode.VNNI = vnni
            fn()  # warm-up / compile
        for _ in range(repeats):
            for label, vnni in modes:
                decode.VNNI = vnni
                t0 = time.perf_counter()
                fn()
                best[label] = min(best.get(label, float("inf")), time.perf_counter() - t0)
    finally:
        decode.VNNI = saved
    return best


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
        line = f"  {n_in:>5} -> {n_out:<6} decode " + "  ".join(
            f"{label}{w.nbytes / s / 1e9:6.2f} GB/s ({s * 1e6:8.1f} us)" for label, s in times.items())
        for m in (16, 64, 256) if args.prefill else ():
            line += "   prefill GFLOP/s:" if m == 16 else ""
            X = rng.standard_normal((m, n_in)).astype(np.float32)
            out = np.empty((m, n_out), np.float32)
            s = best_of(lambda: matmul(w, X, out=out), max(2, reps // 4))
            line += f"  m={m} {2 * m * n_in * n_out / s / 1e9:6.1f}"
        print(line, flush=True)
        del w
    small = make(rng, t, 1024, 128)
    y = np.empty(128, np.float32)
    times = best_of_modes(lambda: matvec(small, xs[1024], out=y), modes, 20 * args.repeats)
    print("  small 1024 -> 128 (a K/V head group): " + "  ".join(
        f"{label}{s * 1e6:.1f} us per call" for label, s in times.items()))
    if args.sweep:
        mats = [make(rng, t, n_in, n_out) for _ in range(28) for n_in, n_out in LAYER]
        mats.append(make(rng, t, 1024, 151936))
        outs = [np.empty(w.n_out, np.float32) for w in mats]
        total = sum(w.nbytes for w in mats)

        def sweep():
            for w, o in zip(mats, outs):
                matvec(w, xs[w.n_in], out=o)
        times = best_of_modes(sweep, modes, max(3, args.repeats // 4))
        print(f"  sweep of a Qwen3-0.6B-shaped model ({total / 1e6:.0f} MB, {len(mats)} matrices): " + "  ".join(
            f"{label}{total / s / 1e9:.2f} GB/s, {s * 1e3:.1f} ms per token" for label, s in times.items()), flush=True)
        del mats
    if t in (T.Q8_0, T.Q5_0):
        raw = random_blocks(rng, t, 151936 * 896)
        s = best_of(lambda: dequantize(raw, t, 151936 * 896), 3)
        print(f"  dequantize a 151936 x 896 table: {s:.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q8_0,Q4_K,Q6_K,Q5_0,F16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-prefill", dest="prefill", action="store_false", help="decode numbers only")
    ap.add_argument("--kernels", choices=("auto", "float", "both"), default="auto",
                    help="decode kernels: VNNI where available (auto), float, or both")
    args = ap.parse_args()
    if args.kernels == "float":
        decode.VNNI = False  # also for the prefill "gemv" path
    numba.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, numba {numba.__version__}, "
          f"numpy {np.__version__}, threads={args.threads}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if load[0] > 0.5:
        print("WARNING: the machine is busy; numbers will be low and noisy")
    rng = np.random.default_rng(0)
    for name in args.formats.split(","):
        bench_format(T[name.strip()], args, rng)


if __name__ == "__main__":
    main()
