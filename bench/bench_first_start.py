"""Time to the first answer, cold (nothing compiled) and warm (all kernels cached).

    python bench/bench_first_start.py [--model qwen2.5-coder-0.5b] [--cold 2]
        [--warm 5] [--cpus 0,1] [--simd LEVEL]

Runs `fucina generate MODEL --chat --prompt "What is the capital of France?"` as a new
process, wall clock from start to exit, pinned to `--cpus` (default: the first two, the
2-core machine of the acceptance test).  Cold: with NUMBA_CACHE_DIR and FUCINA_CACHE
set to a new empty directory, where numba and the quant package put every compiled
kernel (quant/_jit.py keeps its object files next to numba's) and the tokenizer its
built tables, so nothing is compiled or cached yet -- what a first run after `pip
install` pays, and what fucina_course/startup.py's first start (the compilation before
the first token, a helper process on the second core) is for; the model file is
already downloaded (and passed as a path).  Warm: the same directory again, everything
cached.  Prints the wall times and the answer.

Each run starts in the cache directory, not here: `python -m` puts the working
directory first on sys.path, so in a checkout it would run the checkout's package
whatever PYTHONPATH says (an A/B of two versions via PYTHONPATH would compare one with
itself).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

QUESTION = "What is the capital of France?"


def one_run(model: str, cache_dir: str, cpus, simd: str | None) -> tuple[float, str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, FUCINA_CACHE=cache_dir)
    if simd:
        env["FUCINA_SIMD"] = simd
    cmd = [sys.executable, "-m", "fucina_course", "generate", model, "--chat",
           "--prompt", QUESTION]

    def pin():
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         preexec_fn=pin, cwd=cache_dir)
    secs = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"fucina failed:\n{out.stderr[-2000:]}")
    return secs, out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--cold", type=int, default=2, help="cold runs (each a new cache)")
    ap.add_argument("--warm", type=int, default=5, help="warm runs")
    ap.add_argument("--cpus", default="0,1", help="CPUs to pin to ('' = no pinning)")
    ap.add_argument("--simd", default=None, help="FUCINA_SIMD for the runs")
    args = ap.parse_args()
    # a path, so that the runs need no catalog: their FUCINA_CACHE is empty too
    from fucina_course.catalog import resolve
    args.model = str(resolve(args.model).resolve())
    cpus = {int(c) for c in args.cpus.split(",") if c.strip()}
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}" + ("  (busy: numbers are high)" if load > 0.5
                                        else ""))
    cold, answer = [], ""
    with tempfile.TemporaryDirectory(prefix="fucina-cold-") as root:
        for i in range(args.cold):
            cache = os.path.join(root, str(i))
            os.mkdir(cache)
            secs, answer = one_run(args.model, cache, cpus, args.simd)
            cold.append(secs)
        warm = [one_run(args.model, cache, cpus, args.simd)[0]
                for _ in range(args.warm)]
    print(f"answer: {answer!r}")
    print(f"cold (empty caches): {', '.join(f'{s:.1f}' for s in cold)} s")
    print(f"warm: median {statistics.median(warm):.2f} s "
          f"({', '.join(f'{s:.2f}' for s in warm)})")


if __name__ == "__main__":
    main()
