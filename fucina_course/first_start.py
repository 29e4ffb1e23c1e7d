"""The first start on two cores: a second process compiles the prefill kernels.

Every kernel compiles on first use and lands in numba's disk cache, so only the first
run after install pays for compilation.  That run is the reader's first impression:
answering "What is the capital of France?" cold took 11-15 s on 2 cores, ~9 s of them
compiling, one kernel after another in one thread (the LLVM modules of the integer
kernels already compile in a worker thread: quant/first_start.py).  The second core
idled most of that time.

So the CLI's first start splits the work between two processes that share numba's
disk cache (`start_early` as the model loads, `cli._first_start`):

* this process compiles the quant kernels (`quant.prepare`: the driver, the activation
  quantizers, the formats' LLVM modules) and then the decode path (a one-token step:
  `_decode_f16`), ~4.5 + ~2 s;
* a helper process (`start`: `python -m fucina_course.first_start MODEL`) runs a
  two-token prefill through the same model code with every weight product replaced by
  zeros, which compiles the rest: RMSNorm, RoPE, the cache's f16 stores, the batched
  attention (`_by_kv_head_f16`, `_causal_softmax_f16`), SwiGLU, ~4 s.  It writes
  them to the disk cache, where this process then finds them (`join`, before its own
  prefill step).

Measured on 2 cores, alternating with the one-process version: 8.1-9.7 s against
11.1-15.0 s (docs/BENCHMARKS.md#first-start).  Giving `_decode_f16` to the helper as
well made the helper the slower of the two (10.9-11.4 s in all).

The helper runs the model's own forward code, not a list of kernel signatures: a
numba cache entry is only reused for exactly the argument types it was compiled for
(layouts, read-only flags), and only the real code path is sure to produce those.
tests/test_first_start.py checks that every kernel the helper compiled is then a
cache hit, never compiled again, in a real forward pass.

Why not a thread: numba compiles under one global lock (numba.core.compiler_lock), so
two threads of one process cannot compile numba kernels at the same time.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys

import numpy as np

# How long the main process waits for the helper before compiling the rest itself.
JOIN_TIMEOUT = 60.0


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                            # not Linux
        return os.cpu_count() or 1


def start(model_path) -> subprocess.Popen | None:
    """Start the helper on `model_path`, or None on one core (it would only compete).

    Its output is discarded: a helper that fails costs nothing but the time it ran,
    since this process compiles whatever is still missing."""
    if cores() < 2:
        return None
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "fucina_course.first_start", os.fspath(model_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
    except OSError:
        return None


_early: subprocess.Popen | None = None


def start_early(model_path) -> None:
    """Start the helper before the model loads, if the prefill kernels are not in the
    disk cache: the tokenizer's build on a first run (~1 s of Python) then overlaps
    with it too.  `take_early` hands it over; if the command fails before that, it is
    killed at exit."""
    global _early
    from . import attention
    from .quant._int import numba_cached

    if _early is None and not numba_cached(attention._causal_softmax_f16):
        _early = start(model_path)
        if _early is not None:
            atexit.register(stop, _early)


def take_early() -> subprocess.Popen | None:
    """The helper `start_early` started, if any (once)."""
    global _early
    helper, _early = _early, None
    return helper


def join(helper: subprocess.Popen | None, timeout: float = JOIN_TIMEOUT) -> None:
    """Wait for the helper to finish (at most `timeout` s); then stop it if needed."""
    if helper is None:
        return
    try:
        helper.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    stop(helper)


def stop(helper: subprocess.Popen | None) -> None:
    """Kill the helper if it still runs.  numba writes each cache file to a temporary
    name and renames it, so a kill never leaves a broken entry behind."""
    if helper is not None and helper.poll() is None:
        helper.kill()
        helper.wait()


def _zero_matvec(w, x, out=None):
    return np.zeros(w.n_out, np.float32)


def _zero_matmul(w, x, path="auto", out=None):
    return np.zeros((x.shape[0], w.n_out), np.float32)


def _zero_rows(data, ggml_type, n_in, ids):
    return np.zeros((len(ids), n_in), np.float32)


def compile_prefill(model_path) -> None:
    """The helper's work: a two-token prefill of the model with zero weight products.

    quant.matvec, quant.matmul and quant.dequantize_rows (the only functions that
    read the weights) are replaced by functions that return zeros of the same shape,
    dtype and layout, so no quant kernel is compiled here: those are the main
    process's share.  Everything between the products runs as in a real prefill."""
    from . import quant
    from .model import Model

    quant.matvec, quant.matmul, quant.dequantize_rows = (_zero_matvec, _zero_matmul,
                                                         _zero_rows)
    model = Model.load(model_path, tokenizer=False)
    model.forward_step([0, 0], 0, model.new_cache(2))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m fucina_course.first_start MODEL.gguf", file=sys.stderr)
        return 2
    compile_prefill(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
