"""Benchmark the quantized matrix kernels (fucina_course.quant) at Qwen3-0.6B shapes.

    python bench/bench_matvec.py                      # Q8_0 Q4_K Q6_K Q5_0 F16, 2 threads
    python bench/bench_matvec.py --formats Q8_0,Q4_1 --repeats 20 --no-sweep

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

from fucina_course.quant import QuantMatrix, dequantize, matmul, matvec
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


def bench_format(t, args, rng) -> None:
    print(f"\n== {t.name}")
    xs = {n: rng.standard_normal(n).astype(np.float32) for n in (1024, 2048, 3072)}
    for n_in, n_out in SHAPES:
        w = make(rng, t, n_in, n_out)
        x = xs[n_in]
        y = np.empty(n_out, np.float32)
        reps = max(3, args.repeats // 4) if n_out > 100_000 else args.repeats
        s = best_of(lambda: matvec(w, x, out=y), reps)
        line = f"  {n_in:>5} -> {n_out:<6} decode {w.nbytes / s / 1e9:6.2f} GB/s ({s * 1e6:8.1f} us)   prefill GFLOP/s:"
        for m in (16, 64, 256):
            X = rng.standard_normal((m, n_in)).astype(np.float32)
            out = np.empty((m, n_out), np.float32)
            s = best_of(lambda: matmul(w, X, out=out), max(2, reps // 4))
            line += f"  m={m} {2 * m * n_in * n_out / s / 1e9:6.1f}"
        print(line, flush=True)
        del w
    small = make(rng, t, 1024, 128)
    y = np.empty(128, np.float32)
    s = best_of(lambda: matvec(small, xs[1024], out=y), 20 * args.repeats)
    print(f"  small 1024 -> 128 (a K/V head group): {s * 1e6:.1f} us per call")
    if args.sweep:
        mats = [make(rng, t, n_in, n_out) for _ in range(28) for n_in, n_out in LAYER]
        mats.append(make(rng, t, 1024, 151936))
        outs = [np.empty(w.n_out, np.float32) for w in mats]
        total = sum(w.nbytes for w in mats)

        def sweep():
            for w, o in zip(mats, outs):
                matvec(w, xs[w.n_in], out=o)
        s = best_of(sweep, max(3, args.repeats // 4))
        print(f"  sweep of a Qwen3-0.6B-shaped model ({total / 1e6:.0f} MB, {len(mats)} matrices): "
              f"{total / s / 1e9:.2f} GB/s, {s * 1e3:.1f} ms per token", flush=True)
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
    args = ap.parse_args()
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
