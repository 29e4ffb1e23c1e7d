"""The machine's two ceilings: memory bandwidth (decode's wall) and matmul FLOP/s (prefill's wall).

    python bench/bench_roofline.py [--threads 2] [--json]

The measurement is `fucina_course.bench.measure_roofline` (shared with the book's prefill and
decode chapter): a 1 GiB streaming read with `threads` threads (GB/s, best of 5), and numpy
float32 matmul (OpenBLAS sgemm) on 4096^3 and on the shapes of a 0.6B prefill (GFLOP/s, best of
3).  A model's decode ceiling in tokens/s is bandwidth / bytes of weights read per token.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # before numpy loads OpenBLAS
    from fucina_course.bench import measure_roofline

    shapes = [(4096, 4096, 4096), (256, 3072, 1024), (256, 1024, 3072), (64, 3072, 1024),
              (16, 3072, 1024)]
    results = measure_roofline(args.threads, shapes=shapes)
    if args.json:
        print(json.dumps(results))
        return
    print(f"threads={args.threads}: memory read bandwidth {results['bandwidth_gb_s']:.1f} GB/s")
    for r in results["sgemm"]:
        print(f"  sgemm {r['m']}x{r['k']} @ {r['k']}x{r['n']}: {r['gflop_s']:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
