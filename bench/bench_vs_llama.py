"""fucina vs llama.cpp on the same GGUF, same thread count, one after the other (never at once).

    python bench/bench_vs_llama.py MODEL [MODEL ...] [--threads 2] [--pp 16,64,256] [--tg 128]
                                  [--repeats 3] [--markdown]

MODEL is a path, a named model (see `fucina models list`), or a synthetic spec
`synth:GEOMETRY:FORMAT` (written into the cache dir on first use), GEOMETRY one of:
  qwen3-0.6b                  the dense Qwen3-0.6B geometry
  qwen3-moe-1gb               Qwen3-30B-A3B's routing (128 experts, 8 per token) at
                              hidden 1024, 4 layers, ~1 GB in Q8_0
  qwen3-moe-1gb-dense-active  the same with a dense FFN of 8 experts' width: the MoE's
                              parameters per token, run densely
  qwen3-moe-1gb-dense-total   ... of all 128 experts' width: the MoE's total parameters
The last three are the "parameters you do not pay for" comparison:

    python bench/bench_vs_llama.py synth:qwen3-moe-1gb:Q8_0 \
        synth:qwen3-moe-1gb-dense-active:Q8_0 synth:qwen3-moe-1gb-dense-total:Q8_0

Protocol (identical for both engines; see fucina_course/bench.py): warm-up, then for each ppN a
fresh context and one N-token evaluation, and tgN single-token evaluations from position 0; median
of `--repeats`.  llama.cpp runs through llama-cpp-python (`Llama.eval`), f16 KV cache, n_batch 512,
the same thread count; its per-call Python overhead is ~0.1 ms, under 1% of a decode step here.
Each engine runs in its own subprocess, sequentially, so neither disturbs the other's timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def resolve(model: str) -> str:
    if model.startswith("synth:"):
        from fucina_course.synth import (QWEN3_0_6B, QWEN3_MOE_1GB, cached_synthetic,
                                         dense_twin, with_format)

        moe = QWEN3_MOE_1GB
        geometries = {"qwen3-0.6b": QWEN3_0_6B, "qwen3-moe-1gb": moe,
                      "qwen3-moe-1gb-dense-active": dense_twin(moe, moe.num_experts_used),
                      "qwen3-moe-1gb-dense-total": dense_twin(moe, moe.num_experts)}
        _, geometry, fmt = model.split(":")
        if geometry not in geometries:
            raise SystemExit(f"unknown synthetic geometry {geometry!r} "
                             f"(known: {', '.join(geometries)})")
        return str(cached_synthetic(with_format(geometries[geometry], fmt)))
    from fucina_course.catalog import resolve as resolve_model

    return str(resolve_model(model))


def llama_bench(path: str, threads: int, pp: list[int], tg: int, repeats: int) -> dict:
    """Runs inside a subprocess (see main): llama.cpp's numbers under our protocol."""
    import numpy as np
    import llama_cpp

    n_ctx = max(pp + [tg]) + 16
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    vocab = min(llm.n_vocab(), 100_000)

    def ids(n, seed):
        return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()

    def timed_prefill(n):
        toks = ids(n, n)
        out = []
        for _ in range(repeats):
            llm.reset()
            llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
            t = time.perf_counter()
            llm.eval(toks)
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    def timed_decode(n):
        toks = ids(n, 7)
        out = []
        for _ in range(repeats):
            llm.reset()
            t = time.perf_counter()
            for tok in toks:
                llm.eval([tok])
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    timed_prefill(min(16, max(pp or [16])))  # warm-up
    llm.reset()
    for tok in ids(4, 1):
        llm.eval([tok])
    result = {"model": path, "threads": threads, "prefill": []}
    for n in pp:
        result["prefill"].append({"tokens": n, "tok_s": n / timed_prefill(n)})
    if tg:
        result["decode"] = {"tokens": tg, "tok_s": tg / timed_decode(tg)}
    return result


def run_sub(args: list[str], threads: int) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"benchmark subprocess failed: {' '.join(args)}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", default="16,64,256")
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--markdown", action="store_true", help="print a docs/BENCHMARKS.md table")
    ap.add_argument("--llama-worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_worker:
        path, threads, pp, tg, repeats = args.llama_worker
        print(json.dumps(llama_bench(path, int(threads), [int(x) for x in pp.split(",") if x], int(tg), int(repeats))))
        return

    rows = []
    for model in args.models:
        path = resolve(model)
        print(f"== {model}: {path}", file=sys.stderr)
        ours = run_sub(["-m", "fucina_course", "bench", path, "--threads", str(args.threads), "--pp", args.pp,
                        "--tg", str(args.tg), "--repeats", str(args.repeats), "--json"], args.threads)
        theirs = run_sub([__file__, "x", "--llama-worker", path, str(args.threads), args.pp, str(args.tg),
                          str(args.repeats)], args.threads)
        for a, b in zip(ours["prefill"], theirs["prefill"]):
            rows.append((model, f"pp{a['tokens']}", a["tok_s"], b["tok_s"]))
        if "decode" in ours:
            rows.append((model, f"tg{ours['decode']['tokens']}", ours["decode"]["tok_s"], theirs["decode"]["tok_s"]))
        for r in rows[-(len(ours["prefill"]) + ("decode" in ours)):]:
            print(f"  {r[1]:>6}: fucina {r[2]:9.1f} tok/s   llama.cpp {r[3]:9.1f} tok/s   ratio {r[2] / r[3]:.2f}",
                  file=sys.stderr)
    if args.markdown:
        cpu = "?"
        try:
            cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        print(f"\n{datetime.date.today()} — {cpu}, {os.cpu_count()} cores, threads={args.threads}, "
              f"Python {platform.python_version()}, median of {args.repeats}\n")
        print("| model | test | fucina tok/s | llama.cpp tok/s | ratio |")
        print("|---|---|---:|---:|---:|")
        for model, test, a, b in rows:
            print(f"| {model} | {test} | {a:.1f} | {b:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
