"""Prefill and decode timing, shared by `fucina bench`, the bench/ scripts and the book.

What is measured, and how (the same protocol for this engine and for llama.cpp in bench/):
* **prefill ppN**: a fresh cache, one `forward_step` over N tokens; tokens/s = N / seconds.
* **decode tgN**: a fresh cache, N single-token `forward_step`s from position 0 (llama-bench's tg
  protocol); tokens/s = N / seconds.
* **batch decode** (`streams` > 1): N streams each decode tg tokens in lockstep with
  `forward_step_batch`; tokens/s counts every stream's tokens.
Warm numbers: the kernels are compiled and the weights paged in by a warm-up run first; each
figure is the median of `repeats` runs (the chapters take the best, through `best_of`).  Token ids are seeded random ids (content does not change
the work a transformer does).

`measure_roofline` measures the machine's two ceilings, memory read bandwidth (decode's wall)
and float32 matmul FLOP/s (prefill's wall), for bench/bench_roofline.py and the book.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import numpy as np


def _ids(model, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, min(model.config.vocab_size, 100_000), size=n).tolist()


@contextmanager
def one_thread():
    """`with one_thread():` numba's kernels *and* BLAS (numpy's OpenBLAS, which prefill
    attention and float matrices such as a MoE router use) run on one thread; both
    counts are restored after.

    Why both: a measurement "on one thread" that sets numba's count alone still runs
    every BLAS call on all cores, and on a 2-core machine with one core busy
    elsewhere (scripts/stress_book.sh) a multi-threaded call can wait for a worker
    the busy core is not running.  That is one explanation for chapter 10's
    MoE-vs-dense-total prefill ratio falling under its asserted 1.5x (measured
    3-4x quiet) in 2 of 2 stress runs on a Zen 5; it is not a measured one.  On
    another CPU, with one or two cores spinning, numba alone on one thread and
    both on one thread gave the same figures, and with both on one thread the
    stress script passed 3 of 3 (measured: docs/BENCHMARKS.md#one-thread-blas-too).
    It makes "one thread" true of the whole measurement, whatever the cause on
    that CPU.  threadpoolctl is how BLAS's count is changed at run time (OpenBLAS
    reads OPENBLAS_NUM_THREADS only when numpy loads it)."""
    import numba
    from threadpoolctl import threadpool_limits

    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        numba.set_num_threads(threads)


def best_of(fn, *, repeats: int = 5, warmup: int = 1, setup=None):
    """Shortest wall-clock seconds of `repeats` timed calls of `fn`, after `warmup`
    untimed ones: the one way the book times anything it asserts or interprets.

    Why the shortest: on a shared 2-core machine noise only ever slows a run down, so the
    minimum is the best estimate of what the code costs; a single timing is not evidence
    (in CI, chapter 10's grouped MoE path, timed once without warm-up, came out slower
    than one token at a time in one build; with a warm-up and the best of 7 it is
    faster; measured: docs/BENCHMARKS.md#best-of-n).  Why the warm-up: a first call
    compiles kernels and pages weights in.

    `fn` may be a dict of named callables: then each round calls every one of them in
    turn (interleaved), so a busy moment slows all of them alike, and the result is a
    dict of best times.  `setup()`, if given, runs untimed before each call and its
    result is passed to `fn` (a fresh cache, say)."""
    fns = fn if isinstance(fn, dict) else {None: fn}
    best = {name: float("inf") for name in fns}
    for round_ in range(warmup + repeats):
        for name, f in fns.items():
            args = () if setup is None else (setup(),)
            start = time.perf_counter()
            f(*args)
            seconds = time.perf_counter() - start
            if round_ >= warmup:
                best[name] = min(best[name], seconds)
    return best if isinstance(fn, dict) else best[None]


def time_prefill(model, n_tokens: int, *, cache_type: str = "f16",
                 repeats: int = 3, best: bool = False) -> float:
    """Seconds of one n-token prefill into a fresh cache: the median of `repeats` runs
    (`fucina bench`), or with best=True the shortest after one warm-up run (`best_of`:
    what the chapters use, since a chapter's assertion must not fail on a stall)."""
    ids = _ids(model, n_tokens, n_tokens)
    times = []

    def prefill(cache):
        model.forward_step(ids, 0, cache)

    def new_cache():
        return model.new_cache(n_tokens, cache_type)

    if best:
        return best_of(prefill, repeats=repeats, setup=new_cache)
    for _ in range(repeats):
        cache = new_cache()
        t = time.perf_counter()
        prefill(cache)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_decode(model, n_tokens: int, *, cache_type: str = "f16", repeats: int = 3,
                streams: int = 1, best: bool = False) -> float:
    """Seconds to decode n tokens one at a time from position 0 (per stream, in
    lockstep): the median of `repeats` runs, or with best=True the shortest after one
    warm-up run (see `time_prefill`)."""
    ids = _ids(model, n_tokens, 7)

    def decode(caches):
        for tok in ids:
            if streams == 1:
                model.forward_step([tok], caches[0].len, caches[0])
            else:
                model.forward_step_batch([tok] * streams, caches)

    def new_caches():
        return [model.new_cache(n_tokens, cache_type) for _ in range(streams)]

    if best:
        return best_of(decode, repeats=repeats, setup=new_caches)
    times = []
    for _ in range(repeats):
        caches = new_caches()
        t = time.perf_counter()
        decode(caches)
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


def measure_roofline(threads: int = 2, *, read_bytes: int = 2**30,
                     shapes=((4096, 4096, 4096),), read_repeats: int = 5,
                     matmul_repeats: int = 3) -> dict:
    """The machine's two ceilings: memory read bandwidth and float32 matmul FLOP/s.

    * bandwidth: `threads` threads each `np.sum` one slice of a `read_bytes` float32
      array (far larger than the caches): one streaming read of every byte, the way a
      decode step reads the weights; GB/s = bytes / seconds, best of `read_repeats`.
      (A naive numba loop measured only 6 GB/s per core: a reduction's add latency,
      not memory, was its limit; numpy's unrolled sum is not so limited.)
    * compute: numpy float32 matmul (the BLAS sgemm, with the threads BLAS was started
      with) on each (m, n, k) of `shapes`: GFLOP/s = 2 m n k / seconds, best of
      `matmul_repeats`.  `peak_gflop_s` is the best of them.
    A model's decode ceiling in tokens/s is bandwidth / bytes of weights read per token.
    """
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(read_bytes // 4, np.float32)
    parts = np.array_split(data, threads)
    with ThreadPoolExecutor(threads) as pool:  # np.sum releases the GIL

        def read_all():
            return sum(pool.map(np.sum, parts))

        read_all()
        best = min(_seconds(read_all) for _ in range(read_repeats))
    bandwidth = data.nbytes / best / 1e9
    data = parts = None        # freed before the matmuls (not `del`: read_all
                               # still names them)
    result = {"threads": threads, "bandwidth_gb_s": bandwidth, "sgemm": []}
    for m, n, k in shapes:
        a = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
        b = np.random.default_rng(1).standard_normal((k, n), dtype=np.float32)
        a @ b
        secs = min(_seconds(lambda: a @ b) for _ in range(matmul_repeats))
        result["sgemm"].append({"m": m, "n": n, "k": k,
                                "gflop_s": 2 * m * n * k / secs / 1e9})
    result["peak_gflop_s"] = max(r["gflop_s"] for r in result["sgemm"])
    return result


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
