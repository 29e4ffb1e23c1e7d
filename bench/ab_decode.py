"""Decode speed of two commits, A/B: the same model, level and threads, one process per
run, the two commits alternating (the VM's speed drifts by tens of percent between
minutes; alternating pairs see the same drift).

    python bench/ab_decode.py REV_A REV_B MODEL [--level avx2] [--rounds 10] [--tokens 32]

Each commit is checked out once into a temporary worktree (its numba cache warms in a
first, uncounted run).  Each run loads MODEL, warms up, then times `--tokens` one-token
`forward_step`s from position `--context`, best of 3; the report is the median over the
rounds of B's tokens/s over A's, with the quartiles.  MODEL as for bench_vs_llama.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["AB_BENCH"])
from bench_vs_llama import resolve
from fucina_course.model import Model
model = Model.load(resolve(sys.argv[1]), threads=int(sys.argv[2]))
context, tokens = int(sys.argv[3]), int(sys.argv[4])
cache = model.new_cache(context + tokens + 8)
model.forward_step(list(range(1000, 1000 + context)), 0, cache)
best = float("inf")
for _ in range(4):                       # the first: warm-up
    cache.truncate(context)
    t = time.perf_counter()
    for _ in range(tokens):
        model.forward_step([7], cache.len, cache)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"tok_s": tokens / best}))
"""


def run(tree: Path, args) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree), AB_BENCH=str(ROOT / "bench"),
               OPENBLAS_NUM_THREADS=str(args.threads))
    if args.level:
        env["FUCINA_SIMD"] = args.level
    out = subprocess.run([sys.executable, "-c", WORKER, args.model, str(args.threads),
                          str(args.context), str(args.tokens)], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("model")
    ap.add_argument("--level", default="")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for i, rev in enumerate((args.rev_a, args.rev_b)):
            tree = Path(tmp) / f"tree{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                            str(tree), rev], check=True)
            trees.append(tree)
        try:
            for tree in trees:
                run(tree, args)                      # compiles, fills its caches
            ratios, rates = [], {0: [], 1: []}
            for r in range(args.rounds):
                order = (0, 1) if r % 2 == 0 else (1, 0)
                got = {i: run(trees[i], args) for i in order}
                rates[0].append(got[0])
                rates[1].append(got[1])
                ratios.append(got[1] / got[0])
                print(f"round {r + 1}: A {got[0]:.1f}  B {got[1]:.1f} tok/s  "
                      f"B/A {ratios[-1]:.3f}", flush=True)
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(tree)], check=False)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    print(f"{args.model} level={args.level or 'best'} threads={args.threads}: "
          f"A {statistics.median(rates[0]):.1f}, B {statistics.median(rates[1]):.1f} tok/s; "
          f"B/A median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
