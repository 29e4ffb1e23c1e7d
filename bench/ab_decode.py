"""Decode speed of two commits, A/B in one process: the same model, level and threads,
the two versions alternating every few tokens.

    python bench/ab_decode.py REV_A REV_B MODEL [--level avx2] [--rounds 60] [--tokens 8]
                              [--via step|generate]

Why one process: on these VMs the speed drifts by tens of percent from minute to
minute and from process to process (memory placement, neighbours), and a separate
process per run measured the same commit 0.73-1.06x itself.  Here each commit's
`fucina_course` is copied under a name of its own (fucina_a, fucina_b: the package
imports itself only relatively), both load MODEL, and each round times `--tokens`
one-token `forward_step`s from position `--context` with A then B (B then A on odd
rounds), best of 3.  The report: the median over the rounds of B's speed over A's, with
the quartiles.  Each copy compiles its kernels once (numba's cache is per copy: the
first run of a pair is slow).  MODEL as for bench_vs_llama.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(tempfile.gettempdir()) / "fucina_ab"     # copies kept: their kernel caches

WORKER = r"""
import statistics, sys, time
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
import fucina_course                  # first: the OpenBLAS settings (fucina_course/__init__)
import fucina_a, fucina_b
from bench_vs_llama import resolve
name, level, rounds, tokens, context = sys.argv[3], sys.argv[4], *map(int, sys.argv[5:8])
via = sys.argv[8]
path = resolve(name)
models, caches = {}, {}
for key, pkg in (("a", fucina_a), ("b", fucina_b)):
    __import__(pkg.__name__ + ".model")
    if level:
        __import__(pkg.__name__ + ".quant.isa")
        sys.modules[pkg.__name__ + ".quant.isa"].level = level
    models[key] = sys.modules[pkg.__name__ + ".model"].Model.load(path)
    caches[key] = models[key].new_cache(context + tokens + 8)
    models[key].forward_step(list(range(1000, 1000 + context)), 0, caches[key])

def run(key):
    model, cache = models[key], caches[key]
    if via == "generate":            # the whole loop: one-token prompt, `tokens` steps
        cache.truncate(0)
        t = time.perf_counter()
        model.generate([7], tokens, stop_ids=set(), cache=cache)
        return (time.perf_counter() - t) / tokens
    cache.truncate(context)
    t = time.perf_counter()
    for _ in range(tokens):
        model.forward_step([7], cache.len, cache)
    return (time.perf_counter() - t) / tokens

for key in models:
    run(key); run(key)
ratios, seconds = [], {"a": [], "b": []}
for r in range(rounds):
    for key in ("a", "b") if r % 2 == 0 else ("b", "a"):
        seconds[key].append(min(run(key) for _ in range(3)))
    ratios.append(seconds["a"][-1] / seconds["b"][-1])
q = statistics.quantiles(ratios, n=4)
a, b = (statistics.median(seconds[k]) for k in "ab")
print(f"{name} level={level or 'best'} via={via}: A {1 / a:.1f} tok/s, B {1 / b:.1f} tok/s; "
      f"B/A speed {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
"""


def copy_of(rev: str, name: str) -> Path:
    """The package at `rev` as `<CACHE>/<rev>/<name>` (made once, kept with its numba
    cache)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True,
                         capture_output=True, text=True).stdout.strip()
    where = CACHE / f"{sha[:12]}-{name}"
    if not (where / name).is_dir():
        tmp = where.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "fucina_course"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        (tmp / "fucina_course").rename(tmp / name)
        tmp.rename(where)
    return where


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev_a")
    ap.add_argument("rev_b")
    ap.add_argument("model")
    ap.add_argument("--level", default="")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--via", choices=("step", "generate"), default="step",
                    help="time forward_step alone, or Model.generate's whole loop "
                         "(sampling and stop checks included) from an empty cache")
    args = ap.parse_args()
    a, b = copy_of(args.rev_a, "fucina_a"), copy_of(args.rev_b, "fucina_b")
    sys.exit(subprocess.run(
        [sys.executable, "-c", WORKER, str(a), str(b), args.model, args.level,
         str(args.rounds), str(args.tokens), str(args.context), args.via],
        cwd=ROOT / "bench").returncode)


if __name__ == "__main__":
    main()
