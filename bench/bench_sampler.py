"""Sampling overhead per token, next to the time of the decode step it follows.

    python bench/bench_sampler.py [MODEL] [--tokens 64] [--repeats 5] [--json]

A decode step ends with a [vocab] row of logits; the sampler turns it into one id.
This script measures both on the same model (default: the default named model):

* the decode step: `Model.forward_step` of one token at the end of a 64-token
  prompt (median of `--tokens` steps, after a warm-up);
* `Sampler.next` on the logits those steps produced, for a set of configurations:
  greedy, llama.cpp's defaults, the Qwen3 card's, penalties on (64-token window),
  top-k off (a 256-candidate window) and the whole vocabulary (max_candidates=0);
* llama.cpp's own chain (penalties, top-k, top-p, min-p, temp, dist) on the same
  logits through the `llama_sampler_*` C API, when llama-cpp-python is installed
  (its timing includes building the 151,936-entry candidate array in numpy and the
  ctypes call, which llama.cpp itself does in C: an upper bound).

Each sampler figure is the median over all logit rows, repeated `--repeats` times
(best repeat kept), in microseconds per token, with its share of a decode step.
The CPU's instruction-set level is printed with the results (see docs/BENCHMARKS.md
for the conventions); run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time

PROMPT = ("Write a long story about a lighthouse keeper who finds a message in a "
          "bottle, with many characters and places. ") * 4


def isa_level() -> str:
    from fucina_course.quant.isa import cpu_flags

    flags = cpu_flags()
    if not flags:
        return platform.machine()
    for level, needed in (("AVX-512", "avx512f"), ("AVX2", "avx2"), ("AVX", "avx")):
        if needed in flags:
            return level
    return "SSE"


def decode_rows(model, n_tokens: int):
    """Logit rows of n greedy decode steps, and the per-step times."""
    import numpy as np

    ids = model.tokenizer.encode(PROMPT)[:64]
    cache = model.new_cache(len(ids) + n_tokens + 1)
    logits = model.forward_step(ids, 0, cache)
    rows, times = [], []
    for _ in range(n_tokens):
        nxt = int(np.argmax(logits))
        t0 = time.perf_counter()
        logits = model.forward_step([nxt], cache.len, cache)
        times.append(time.perf_counter() - t0)
        rows.append(logits.copy())
        ids.append(nxt)
    return rows, times[1:] or times, ids


def time_ours(config, rows, history, repeats: int) -> float:
    from fucina_course.sampler import Sampler

    best = float("inf")
    for _ in range(repeats):
        s = Sampler(config)
        per = []
        for x in rows:
            t0 = time.perf_counter()
            s.next(x, history)
            per.append(time.perf_counter() - t0)
        best = min(best, statistics.median(per))
    return best


def time_llama(rows, history, repeats: int) -> float | None:
    try:
        import llama_cpp as L
    except ImportError:
        return None
    import numpy as np

    vocab = rows[0].shape[0]
    dtype = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for s in (L.llama_sampler_init_penalties(vocab, 64, 1.0, 0.0, 0.0),
              L.llama_sampler_init_top_k(40), L.llama_sampler_init_top_p(0.95, 1),
              L.llama_sampler_init_min_p(0.05, 1), L.llama_sampler_init_temp(0.8),
              L.llama_sampler_init_dist(1)):
        L.llama_sampler_chain_add(chain, s)
    ids = np.arange(vocab, dtype=np.int32)
    best = float("inf")
    try:
        for _ in range(repeats):
            per = []
            for x in rows:
                t0 = time.perf_counter()
                a = np.empty(vocab, dtype)
                a["id"], a["logit"], a["p"] = ids, x, 0
                cur = L.llama_token_data_array(
                    data=a.ctypes.data_as(L.llama_token_data_p), size=vocab,
                    selected=-1, sorted=False)
                L.llama_sampler_apply(chain, ctypes.byref(cur))
                per.append(time.perf_counter() - t0)
            best = min(best, statistics.median(per))
    finally:
        L.llama_sampler_free(chain)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from fucina_course.catalog import load_model
    from fucina_course.sampler import SamplerConfig

    model = load_model(args.model, threads=args.threads)
    rows, step_times, history = decode_rows(model, args.tokens)
    step = statistics.median(step_times)
    configs = {
        "greedy": SamplerConfig.greedy(),
        "llama.cpp defaults": SamplerConfig(seed=1),
        "Qwen3 card": SamplerConfig.qwen3(seed=1),
        "penalties on": SamplerConfig(repeat_penalty=1.1, presence_penalty=0.5, seed=1),
        "top-k off (256 window)": SamplerConfig(top_k=0, seed=1),
        "whole vocabulary": SamplerConfig(top_k=0, max_candidates=0, seed=1),
    }
    result = {
        "model": model.path.name, "isa": isa_level(), "cpu": platform.processor(),
        "threads": args.threads or os.cpu_count(), "vocab": int(rows[0].shape[0]),
        "decode_step_ms": step * 1e3,
        "sampler_us": {name: time_ours(c, rows, history, args.repeats) * 1e6
                       for name, c in configs.items()},
    }
    theirs = time_llama(rows, history, args.repeats)
    if theirs is not None:
        result["llama_cpp_chain_us"] = theirs * 1e6
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}  {result['isa']}  threads={result['threads']}  "
          f"vocab={result['vocab']:,}")
    print(f"  decode step (median of {len(step_times)}): {step * 1e3:8.2f} ms")
    for name, us in result["sampler_us"].items():
        print(f"  {name:24s} {us:8.1f} us/token  ({us / (step * 1e6):6.2%} of a step)")
    if theirs is not None:
        us = result["llama_cpp_chain_us"]
        print(f"  {'llama.cpp chain (ctypes)':24s} {us:8.1f} us/token  "
              f"({us / (step * 1e6):6.2%} of a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
