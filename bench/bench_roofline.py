"""The machine's two ceilings: memory bandwidth (decode's wall) and matmul FLOP/s (prefill's wall).

    python bench/bench_roofline.py [--threads 2] [--json]

* bandwidth: `threads` threads each `np.sum` one slice of a 1 GiB float32 array (far larger than
  the caches): one streaming read of every byte, the way a decode step reads the weights;
  GB/s = bytes / seconds, best of 5.  (A naive numba loop measured only 6 GB/s per core: a
  reduction's add latency, not memory, was its limit; numpy's unrolled sum is not so limited.)
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
    import numpy as np

    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(2**28, np.float32)  # 1 GiB, far larger than the caches
    parts = np.array_split(data, args.threads)
    with ThreadPoolExecutor(args.threads) as pool:  # np.sum releases the GIL: one slice per thread

        def read_all():
            return sum(pool.map(np.sum, parts))

        read_all()
        best = min(_timed(read_all) for _ in range(5))
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
