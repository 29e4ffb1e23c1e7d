"""The first start: compile a model's kernels before its first token, on both cores.

Every kernel compiles on first use and lands on disk (numba's cache; quant/_jit.py's
object files), so only the first run after install pays for compilation.  That run is
the reader's first impression: answering "What is the capital of France?" cold took
11-15 s on 2 cores, ~9 s of them compiling one kernel after another in one thread,
while the second core idled.  So the CLI's first start (`first_start`, called once a
command's own checks have passed) compiles before the first token, says so on a
terminal (`_Bar`), and splits the work between two processes that share numba's disk
cache:

* this process compiles numba's parallel driver of the quant kernels and the
  activation quantizers (`prepare`), then the decode path with a one-token step
  (`_decode_f16`), ~5.5 + ~5 s;
* a helper process (`start`: `python -m fucina_course.startup MODEL LEVEL`, started
  as the model loads: `start_early`) compiles the model's formats' LLVM modules
  (~0.5-1 s each) and says so on its stdout (`Helper.reached`: `prepare`'s worker
  thread waits for that line, then loads them from the disk cache), then runs a
  two-token prefill through the same model code with every weight product replaced
  by zeros, which compiles the rest: RMSNorm, RoPE, the cache's f16 stores, the
  batched attention (`_by_kv_head_f16`, `_causal_softmax_f16`), SwiGLU, ~4.5 s.
  This process finds those in the disk cache too (`join`, before its own prefill).

Measured on 2 cores, the France question cold, four pairs alternating with the
version before (docs/BENCHMARKS.md#first-start): 13.1-16.6 s against 17.5-21.3 s in a
slow hour of the VM, 10.3-12.5 s against 11.5-13.8 s in a quiet one, for about the
same CPU time.  The version before compiled the LLVM modules here, in a thread
beside numba's: three busy threads on two cores, once the packed GEMMs had tripled
the LLVM work (1.3 -> 4.0 s of CPU for the Coder's four formats).  Rejected: the
helper compiling the quantizers too (this process then waits for them, idle, after
the driver, and compiles RoPE and the decode's softmax before the helper's prefill
has: ~2 s more CPU, no faster); giving it `_decode_f16` (it became the slower of the
two processes, and the first start slower in all; measured:
docs/BENCHMARKS.md#startup-helper-split).

The helper runs the model's own forward code, not a list of kernel signatures: a
numba cache entry is only reused for exactly the argument types it was compiled for
(layouts, read-only flags), and only the real code path is sure to produce those.
tests/test_first_start.py checks that every kernel the helper compiled is then a
cache hit, never compiled again, in a real forward pass.  Why not a thread: numba
compiles under one global lock (numba.core.compiler_lock), so two threads of one
process cannot compile numba kernels at the same time.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from .quant import _int, _jit, isa
from .quant.activations import quantize_activations, row_quantizer_cached
from .quant.formats import FORMATS
from .quant.matvec import kernel_for

# How long the main process waits for the helper before compiling the rest itself.
JOIN_TIMEOUT = 60.0


# --- the quant kernels: which are still to compile, compiling them ----------------

def _types(model) -> set:
    """The block formats of `model`'s tensors."""
    return {t.ggml_type for t in model.gguf.tensors.values()}


def _kernels(types, level):
    """[(format, kernel)] matvec runs for the quantized formats among `types` (the
    same module holds the format's packed GEMM: matmul.PACKED_KERNELS)."""
    return [(t, kernel_for(t, level)[1])
            for t in sorted({T(int(t)) for t in types}, key=int)
            if t in FORMATS and FORMATS[t].block_size > 1]


def _llvm_kernels(kernels):
    """The (format, kernel) of `kernels` (`_kernels`) whose code is an LLVM module
    (`_int.IntKernels`): the part a helper can compile in its own process."""
    return [(t, k) for t, k in kernels if isinstance(k, _int.IntKernels)]


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
        if not ready and t not in todo:
            todo.append(t)
    return todo


def prepare(types, level: str | None = None, step=None, helper=None) -> None:
    """Compile (or load) the kernels `types` need at `level` before first use.

    `step(label)` is called after each part: one per format (from a worker thread for
    the integer kernels), "driver" and "activations" (the shared numba kernels).
    With a `helper` (a `Helper` compiling for the same model and level), the formats'
    LLVM modules are its share: the worker thread waits for its report, then loads
    them from the disk cache (or compiles whatever it failed to write)."""
    step = step or (lambda label: None)
    kernels = _kernels(types, level)
    ints = _llvm_kernels(kernels)
    done = threading.Event()
    errors: list[BaseException] = []

    def llvm():
        try:
            # waits, no CPU: the helper compiles.  Silent for JOIN_TIMEOUT s: killed
            if helper is not None and not helper.reached(LLVM_DONE):
                stop(helper)
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
    from .quant.matrix import QuantMatrix
    from .quant.matvec import matvec_quantized

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


# --- the helper process: the prefill kernels ---------------------------------------

def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                            # not Linux
        return os.cpu_count() or 1


# The helper's report on its stdout: the formats' LLVM modules are in the disk cache.
LLVM_DONE = "llvm"


class Helper(subprocess.Popen):
    """The helper process, and the reports it has written so far (`reached`).

    Its stdout is read by a thread of its own, so that a wait can end when the helper
    does, or after a timeout; its stderr is discarded: a helper that fails costs
    nothing but the time it ran, since this process then compiles whatever is still
    missing."""

    def __init__(self, model_path, level: str):
        super().__init__([sys.executable, "-m", "fucina_course.startup",
                          os.fspath(model_path), level],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
        self._reports: set[str] = set()
        self._ended = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="fucina-helper", daemon=True).start()

    def _read(self) -> None:
        with self.stdout:
            for line in self.stdout:
                with self._changed:
                    self._reports.add(line.strip())
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def reached(self, report: str, timeout: float = JOIN_TIMEOUT) -> bool:
        """Wait until the helper has written `report`, has ended, or `timeout` s have
        passed; True for the first."""
        with self._changed:
            self._changed.wait_for(lambda: report in self._reports or self._ended,
                                   timeout)
            return report in self._reports


def start(model_path, level: str | None = None) -> Helper | None:
    """Start the helper on `model_path` for `level` (default: isa.level), or None on
    one core (it would only compete)."""
    if cores() < 2:
        return None
    try:
        return Helper(model_path, level or isa.level)
    except OSError:
        return None


_early: Helper | None = None


def start_early(model_path) -> None:
    """Start the helper before the model loads, if the prefill kernels are not in the
    disk cache: the tokenizer's build on a first run (~1 s of Python) then overlaps
    with it too.  `take_early` hands it over; if the command fails before that, it is
    killed at exit."""
    global _early
    from . import attention

    if _early is None and not _int.numba_cached(attention._causal_softmax_f16):
        _early = start(model_path)
        if _early is not None:
            atexit.register(stop, _early)


def take_early() -> Helper | None:
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


# Stand-ins for the functions that read the weights: their signatures, zeros out.

def _zero_matvec(w, x, out=None):
    if out is not None:
        out[...] = 0.0
        return out
    return np.zeros(w.n_out, np.float32)


def _zero_matmul(w, x, out=None, *, path="auto", exact_activations=True):
    if out is not None:
        out[...] = 0.0
        return out
    return np.zeros((x.shape[0], w.n_out), np.float32)


def _zero_bound_matvec(w):
    def product(x, out):
        out[...] = 0.0
    return product


def _zero_rows(data, ggml_type, n_in, ids):
    return np.zeros((len(ids), n_in), np.float32)


def compile_prefill(model_path, level: str | None = None, report=None) -> None:
    """The helper's work: the formats' LLVM modules at `level` that `prepare` leaves
    to it, then `report(LLVM_DONE)`; then a two-token prefill of the model with zero
    weight products.

    For the prefill, quant.matvec, quant.bound_matvec, quant.matmul and
    quant.dequantize_rows (the only functions that read the weights) are replaced by
    functions that return zeros of the same shape, dtype and layout, so no numba
    kernel of quant/ is compiled here: the driver, the activation quantizers and the
    decode path are the main process's share.  Everything between the products runs
    as in a real prefill."""
    from . import quant
    from .model import Model

    report = report or (lambda what: None)
    quant.matvec, quant.bound_matvec = _zero_matvec, _zero_bound_matvec
    quant.matmul, quant.dequantize_rows = _zero_matmul, _zero_rows
    model = Model.load(model_path, tokenizer=False)
    _jit.init()
    for _, k in _llvm_kernels(_kernels(_types(model), level)):
        k.compile()
    report(LLVM_DONE)
    model.forward_step([0, 0], 0, model.new_cache(2))


# --- the CLI's first start ---------------------------------------------------------

class _Bar:
    """The first start's note on stderr, on a terminal only (never in a pipe or a log
    that expects one error line): a message at once, then, once a second has passed,
    a bar of the steps done, redrawn by a timer thread."""

    def __init__(self, message: str, total: int):
        self.total, self.done, self.drawn = total, 0, False
        self.clock = time.monotonic
        self.t0 = self.clock()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        if sys.stderr.isatty():
            print(message, file=sys.stderr, flush=True)
            threading.Thread(target=self._tick, daemon=True).start()

    def step(self, label: str = "") -> None:
        with self.lock:
            self.done += 1

    def _draw(self) -> None:
        n, width = min(self.done, self.total), 30
        fill = width * n // self.total
        sys.stderr.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {n}/{self.total} "
                         f"{self.clock() - self.t0:4.1f} s")
        sys.stderr.flush()
        self.drawn = True

    def _tick(self) -> None:
        while not self.stop.wait(0.1):
            if self.clock() - self.t0 > 1.0:
                with self.lock:
                    self._draw()

    def close(self) -> None:
        self.stop.set()
        with self.lock:
            if self.drawn:
                self._draw()
                sys.stderr.write("\n")


def first_start(model) -> None:
    """First run only (the model's kernels are not in the disk cache yet): compile
    them before the first token, and say so on a terminal (`pending`, `prepare`).
    One decode step and a 2-token prefill compile the rest of the engine; the helper
    compiles the formats' LLVM modules and the prefill's kernels meanwhile.  Call it
    once the command's own checks have passed."""
    types = _types(model)
    todo = pending(types)
    helper = take_early()
    if not todo:
        join(helper)               # it compiles what this run would compile next
        return
    quantized = [t for t in types if FORMATS[t].block_size > 1]
    bar = _Bar(f"compiling kernels for {', '.join(t.name for t in todo)} "
               f"(first run only)\u2026", len(quantized) + 4)
    helper = helper or start(model.path)
    try:
        prepare(types, step=bar.step, helper=helper)
        cache = model.new_cache(4)
        model.forward_step([0], 0, cache)
        bar.step("decode")
        join(helper)                         # its kernels are in the disk cache now
        model.forward_step([0, 0], 1, cache)
        bar.step("prefill")
    finally:
        stop(helper)
        bar.close()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m fucina_course.startup MODEL.gguf [LEVEL]",
              file=sys.stderr)
        return 2
    compile_prefill(argv[0], argv[1] if len(argv) == 2 else None,
                    report=lambda what: print(what, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
