"""The first start: the kernels a model's formats still need compiled; compiling them.

Every kernel compiles on first use and is cached on disk (numba's cache; _jit.py's
object files), so a second start compiles nothing.  The first one is the reader's first
impression, so the CLI compiles before the first token and says so
(`pending`, then `prepare`; cli.py).  What it costs, measured cold on 2 cores
(docs/BENCHMARKS.md#first-start): the integer kernels of a format ~0.2-0.6 s each
(LLVM only), numba's driver and activation quantizers ~2 s together (and the C
quantizers the driver calls in decode, activations.row_quantizer), the generic float
kernels 2-4 s per format (numba).

`prepare` overlaps the two compilers: the formats' LLVM modules compile in a worker
thread (LLVM runs outside Python's GIL, in its own LLVM context) while numba compiles
in the calling thread.  Meanwhile the CLI has a second process compile the rest of the
engine's prefill kernels (fucina_course/first_start.py).
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType as T

from . import _int, _jit, isa
from .activations import quantize_activations, row_quantizer_cached
from .formats import FORMATS
from .matvec import kernel_for


def _kernels(types, level):
    """[(format, kernel)] matvec runs for the quantized formats among `types`."""
    out = []
    for t in sorted({T(int(t)) for t in types}, key=int):
        if t in FORMATS and FORMATS[t].block_size > 1:
            out.append((t, kernel_for(t, level)[1]))
    return out


def pending(types, level: str | None = None) -> list[T]:
    """The quantized formats among `types` whose kernels at `level` (default:
    isa.level) are not compiled yet, in memory or on disk: the first start."""
    todo = []
    for t, k in _kernels(types, level):
        if isinstance(k, _int.IntKernels):
            ready = (k.cached and _int.numba_cached(_int.run)
                     and row_quantizer_cached(FORMATS[t].vec_dot_type))
        else:
            ready = _int.numba_cached(k)
        if not ready:
            todo.append(t)
    return todo


def prepare(types, level: str | None = None, step=None) -> None:
    """Compile (or load) the kernels `types` need at `level` before first use.

    `step(label)` is called after each part: one per format (from a worker thread for
    the integer kernels), "driver" and "activations" (the shared numba kernels)."""
    step = step or (lambda label: None)
    kernels = _kernels(types, level)
    ints = [(t, k) for t, k in kernels if isinstance(k, _int.IntKernels)]
    done = threading.Event()
    errors: list[BaseException] = []

    def llvm():
        try:
            for t, k in ints:
                k.compile()                 # LLVM only: numba compiles meanwhile
                step(t.name)
        except BaseException as e:          # re-raised in the calling thread
            errors.append(e)
        finally:
            done.set()

    if ints:
        _jit.init()                         # the JIT engine, made in this thread
        threading.Thread(target=llvm, name="fucina-llvm", daemon=True).start()
    else:
        done.set()
    for t, k in kernels:                    # the generic float kernels (numba)
        if not isinstance(k, _int.IntKernels):
            _warm_float(t, k)
            step(t.name)
    if ints:
        _int.compile_driver()
    step("driver")
    # the quantizers, for the signature the driver calls them with in decode too
    # (activations.row_quantizer)
    for kind in sorted({FORMATS[t].vec_dot_type for t, _ in kernels}, key=int):
        quantize_activations(np.zeros((1, 256), np.float32), kind)
    step("activations")
    done.wait()
    if errors:
        raise errors[0]


def _warm_float(t, kernel) -> None:
    """Run a generic float kernel once on one row of zero blocks (compiles it)."""
    from .matrix import QuantMatrix
    from .matvec import matvec_quantized

    fmt = FORMATS[t]
    n = 256
    w = QuantMatrix(np.zeros(n // fmt.block_size * fmt.block_bytes, np.uint8), t, 1, n)
    saved = isa.level
    try:
        isa.level = isa.GENERIC
        qa = quantize_activations(np.zeros(n, np.float32), fmt.vec_dot_type)
        matvec_quantized(w, qa, np.empty(1, np.float32))
    finally:
        isa.level = saved
