"""The machine's two ceilings: memory bandwidth (decode's wall) and matmul FLOP/s (prefill's wall).

    python bench/bench_roofline.py [--threads 2] [--json]

* bandwidth: a numba `prange` reduction that reads a 1 GiB array (far larger than the caches), the
  way a decode step reads the weights: GB/s = bytes / seconds, best of 5.
* compute: numpy float32 matmul (OpenBLAS sgemm) on 4096^3 and on the shapes of a 0.6B prefill:
  GFLOP/s = 2 m n k / seconds, best of 3.
A model's decode ceiling in tokens/s is bandwidth / bytes of weights read per token.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    import numba
    import numpy as np

    numba.set_num_threads(args.threads)

    @numba.njit(parallel=True, fastmath=True, cache=True)
    def read_all(a):  # int32 words, summed in per-thread chunks
        n = a.shape[0]
        chunks = 64
        step = (n + chunks - 1) // chunks
        acc = np.zeros(chunks, np.int64)
        for c in numba.prange(chunks):
            s = 0
            for i in range(c * step, min(n, (c + 1) * step)):
                s += a[i]
            acc[c] = s
        return acc.sum()

    data = np.ones(2**28, np.int32)  # 1 GiB
    read_all(data[:1024])
    best = min(_timed(lambda: read_all(data)) for _ in range(5))
    bandwidth = data.nbytes / best / 1e9

    results = {"threads": args.threads, "bandwidth_gb_s": bandwidth, "sgemm": []}
    for m, n, k in [(4096, 4096, 4096), (256, 3072, 1024), (256, 1024, 3072), (64, 3072, 1024), (16, 3072, 1024)]:
        a = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
        b = np.random.default_rng(1).standard_normal((k, n), dtype=np.float32)
        a @ b
        secs = min(_timed(lambda: a @ b) for _ in range(3))
        results["sgemm"].append({"m": m, "n": n, "k": k, "gflop_s": 2 * m * n * k / secs / 1e9})
    if args.json:
        print(json.dumps(results))
        return
    print(f"threads={args.threads}: memory read bandwidth {bandwidth:.1f} GB/s")
    for r in results["sgemm"]:
        print(f"  sgemm {r['m']}x{r['k']} @ {r['k']}x{r['n']}: {r['gflop_s']:.0f} GFLOP/s")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
