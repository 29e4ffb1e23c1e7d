"""Prefill and decode timing, shared by `fucina bench`, the bench/ scripts and the book.

What is measured, and how (the same protocol for this engine and for llama.cpp in bench/):
* **prefill ppN**: a fresh cache, one `forward_step` over N tokens; tokens/s = N / seconds.
* **decode tgN**: a fresh cache, N single-token `forward_step`s from position 0 (llama-bench's tg
  protocol); tokens/s = N / seconds.
* **batch decode** (`streams` > 1): N streams each decode tg tokens in lockstep with
  `forward_step_batch`; tokens/s counts every stream's tokens.
Warm numbers: the kernels are compiled and the weights paged in by a warm-up run first; each
figure is the median of `repeats` runs.  Token ids are seeded random ids (content does not change
the work a transformer does).
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def _ids(model, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, min(model.config.vocab_size, 100_000), size=n).tolist()


def time_prefill(model, n_tokens: int, *, cache_type: str = "f16", repeats: int = 3) -> float:
    """Median seconds of one n-token prefill into a fresh cache."""
    ids = _ids(model, n_tokens, n_tokens)
    times = []
    for _ in range(repeats):
        cache = model.new_cache(n_tokens, cache_type)
        t = time.perf_counter()
        model.forward_step(ids, 0, cache)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_decode(model, n_tokens: int, *, cache_type: str = "f16", repeats: int = 3, streams: int = 1) -> float:
    """Median seconds to decode n tokens one at a time from position 0 (per stream, in lockstep)."""
    ids = _ids(model, n_tokens, 7)
    times = []
    for _ in range(repeats):
        caches = [model.new_cache(n_tokens, cache_type) for _ in range(streams)]
        t = time.perf_counter()
        for tok in ids:
            if streams == 1:
                model.forward_step([tok], caches[0].len, caches[0])
            else:
                model.forward_step_batch([tok] * streams, caches)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(model, *, pp=(16, 64, 256), tg: int = 128, cache_type: str = "f16", repeats: int = 3,
        streams: int = 1, threads: int | None = None, progress=None) -> dict:
    """The `fucina bench` measurement as one dict (the `--json` schema)."""
    say = progress or (lambda msg: None)
    say("warm-up (compiles kernels, pages in the weights)")
    time_prefill(model, min(16, max(pp or (16,))), cache_type=cache_type, repeats=1)
    time_decode(model, 4, cache_type=cache_type, repeats=1, streams=streams)
    result = {"model": str(model.path), "threads": threads, "cache_type": cache_type, "prefill": []}
    for n in pp:
        say(f"prefill pp{n}")
        secs = time_prefill(model, n, cache_type=cache_type, repeats=repeats)
        result["prefill"].append({"tokens": n, "tok_s": n / secs})
    if tg:
        say(f"decode tg{tg}" + (f" x {streams} streams" if streams > 1 else ""))
        secs = time_decode(model, tg, cache_type=cache_type, repeats=repeats, streams=streams)
        result["decode"] = {"tokens": tg, "streams": streams, "tok_s": tg * streams / secs}
    return result
