"""Weight matrix x many activation rows: Y [m, n_out] = X [m, n_in] @ W.T (`matmul`).

Prefill (a prompt of m tokens) and batch decode (m streams) multiply each weight matrix
by m rows at once.  Three paths, chosen by `path=`:

* **"rows"**: the multi-row integer kernels (_int_matmul.py; the quantized formats, at
  the integer levels of isa.py).  Each weight block is unpacked once per
  tile of 8 activation rows, so the matrix streams from memory once per 8 rows; all
  parts of a MultiMatrix (q/k/v, gate/up) go in one call.  Row i of the result is
  bit-identical to `matvec` of row i: batch decode equals sequential decode exactly.
  Float formats, or `isa.level` = GENERIC: the "gemv" path.
* **"packed"**: the integer formats (_int_packed.py): 16 weight rows repacked per call
  so that one int32 lane is one weight row (8 per ymm), and each block's float work is
  done once for a vector of weight rows instead of once per 8 lanes: at avx512vnni ~3x
  the tiles' GFLOP/s (Q8_0 at m = 256: 736-758 against 225, and BLAS 200-220), at avx2
  1.3-1.6x.  At the generic level, where there are no tiles, it replaces BLAS.  Not
  bit-identical to matvec (each block's integer total is scaled as a whole): batch
  decode and per-row steps keep "rows".  Elsewhere (float formats; generic without
  isa.GENERIC_IR) "packed" is "rows".
* **"gemv"**: `matvec_quantized` once per row.  Reads the whole matrix m times.
* **"blas"**: dequantize a tile of consecutive weight rows to float32 (4M elements =
  16 MB, a buffer reused per thread; a serial numba kernel, dequant.py) and multiply it
  with numpy's `@` (OpenBLAS sgemm), straight into the output columns of those rows.
  The weights stay in their block format; only one tile is ever float32.

"auto" (the default): "packed" from `PACKED_MIN_ROWS` (16) rows where it exists, which
is every integer format at every level but a generic one without isa.GENERIC_IR (up to
15 rows stay on "rows": a batch decode of up to 15 streams, or a speculative verify
step, equals its one-token steps bit for bit); "rows" below `rows_blas_min_rows(format)`
rows for any other format with multi-row kernels, else "gemv" below
`PREFILL_MIN_ROWS` (16) rows; "blas" from there on (the float formats), and always
with `exact_activations=False`.

**Numerics.**  With `exact_activations=True` (the default) all paths compute what
llama.cpp computes: the activations are first rounded through the weight's
`vec_dot_type` exactly as in decode, and the "blas" path multiplies their float32 value
`q_x * d_x` (activations.py, `fake_quant`) with the float32 dequantized weights.  Every
weight value and (for Q8_0/Q8_1) every activation value is exact in float32, so the
products are those of the integer kernels and only the summation order differs (blas
agrees with decode to ~1e-6 relative; tests check 1e-5).  Two details make that true:
  * Q8_K activations (`d_x` a float32, not an f16) carry one rounding in `q_x * d_x`
    (2^-24 relative).
  * Q4_1/Q5_1: ggml adds `m_w * s_x` per block with `s_x = f16(d_x * sum q_x)`, an
    f16-rounded sum, while the dequantized product adds `m_w * sum(q_x * d_x)`.  The
    path adds the difference back: `Y += (s_x - d_x * sum q_x) @ M_w.T`, a GEMM 32x
    smaller than the main one (it costs Q4_1/Q5_1 ~10%).
With `exact_activations=False` the "blas" path uses the float32 activations as they
are: closer to the infinitely precise product (it skips the ~0.4% activation
quantization), but no longer equal to decode or to llama.cpp.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import isa
from ._int import NO_FLOATS, IntKernels, run
from ._int_packed import byte_products, has_packed
from ._intrinsics import f16_to_f32
from ._ir import TILE as _TILE_ROWS
from .activations import quantize_activations
from .dequant import dequantize_into
from .formats import FORMATS
from .matrix import MultiMatrix
from .matvec import KERNELS as _MV_KERNELS
from .matvec import kernel_for, matvec_quantized


def openblas_workers_spin(env=os.environ) -> bool:
    """True if OpenBLAS (numpy's BLAS) keeps its worker threads busy-waiting after each
    multi-threaded call: its default, `thread_timeout` = 2^28 cycles (~0.1 s), unless
    the process started with OPENBLAS_THREAD_TIMEOUT (or GOTO_THREAD_TIMEOUT) <= 20 or
    with one BLAS thread.  OpenBLAS reads these once, when numpy loads it.

    A numba kernel running in that window shares a core with the spinner: a Q4_K m=64
    call right after a threaded sgemm took 3.3 ms instead of 1.6, and pp64 with the rows
    kernels ran at 100-110 tok/s instead of 181 (docs/BENCHMARKS.md#openblas-spin).
    """
    for name in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        v = env.get(name, "").strip()
        if v:
            if v.isdigit() and int(v) == 1:
                return False
            break
    for name in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"):
        v = env.get(name, "").strip()
        if v.isdigit():
            return int(v) > 20
    return True


# "auto": BLAS from this many rows on, for formats without multi-row kernels.  From the
# float kernels: blas Q4_K at m = 16 / 64 / 256 ran 46 / 126 / 222 GFLOP/s, gemv ~40.
PREFILL_MIN_ROWS = 16
# "auto": BLAS from this many rows on, for formats with multi-row kernels: level ->
# {format: rows} (generic: none, it has no tiles).  While OpenBLAS's workers spin, the
# model-level crossover is ~64 prompt tokens for all (Q4_K pp64: rows 100-110 vs blas
# 104-115 tok/s); without the spin, the kernels' own crossovers, each format's
# `kernels.blas_from` (formats.py).  `ROWS_BLAS_MIN_ROWS` is the best level's table.
_SPIN = openblas_workers_spin()
ROWS_BLAS_MIN_ROWS_BY_LEVEL = {
    lv: {t: 64 if _SPIN else f.kernels.blas_from[lv] for t, f in FORMATS.items()
         if lv in f.kernels.blas_from}
    for lv in isa.LEVELS}
ROWS_BLAS_MIN_ROWS = ROWS_BLAS_MIN_ROWS_BY_LEVEL[isa.BEST]


def rows_blas_min_rows(ggml_type) -> int:
    """From how many rows "auto" uses BLAS for a format with tiles, at isa.level."""
    if isa.level == isa.BEST:
        return ROWS_BLAS_MIN_ROWS[ggml_type]
    return ROWS_BLAS_MIN_ROWS_BY_LEVEL[isa.level][ggml_type]

# (format, instruction-set level) -> multi-row kernel: the tile kernels of each integer
# level (the same `IntKernels` as matvec's, one compiled module per format and level).
# The generic level has none (its IR kernels are matvec's only): "rows" is then the
# "gemv" path.
KERNELS = {(t, lv): k for (t, lv), k in _MV_KERNELS.items()
           if isinstance(k, IntKernels) and lv != isa.GENERIC}
_BY_VALUE = {(int(t), lv): k for (t, lv), k in KERNELS.items() if lv in isa.USABLE}
# (format, level) -> the kernels with the packed GEMM (_int_packed.py): the tiles' at
# the x86 levels, matvec's IR kernels at generic (one module per format and level)
PACKED_KERNELS = {(t, lv): k for (t, lv), k in KERNELS.items() if k.has_packed}
PACKED_KERNELS.update({(t, isa.GENERIC): _MV_KERNELS[(t, isa.GENERIC)]
                       for t in FORMATS if has_packed(t, isa.GENERIC)})
_PACKED_BY_VALUE = {(int(t), lv): k for (t, lv), k in PACKED_KERNELS.items()
                    if lv in isa.USABLE}


def packed_kernel_for(ggml_type, level: str | None = None):
    """The `IntKernels` whose packed GEMM "auto" runs for a format at `level`
    (default: isa.level), or None (startup.py compiles it on the first start)."""
    lv = isa.level if level is None else level
    return _PACKED_BY_VALUE.get((int(ggml_type), lv))

# "auto": the packed GEMM (_int_packed.py) from this many rows on, where it exists
PACKED_MIN_ROWS = 16
# float32 elements per dequantized weight tile (16 MB, reused per thread): faster than
# tiles of 1M elements or of 128 rows at m = 64-256 (docs/BENCHMARKS.md#prefill-paths)
_TILE_ELEMENTS = 1 << 22
_tls = threading.local()


def _tile_buffer(n: int) -> np.ndarray:
    """A float32 scratch buffer of >= n elements, kept per thread (no page faults)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.size < n:
        buf = _tls.buf = np.empty(n, np.float32)
    return buf[:n]


def _check_out(w, m: int, out):
    if out is None:
        return np.empty((m, w.n_out), np.float32)  # [m, n_out]
    if (out.shape != (m, w.n_out) or out.dtype != np.float32
            or not out.flags.c_contiguous):
        raise ValueError(f"{w.name!r}: out must be C-contiguous float32 of shape "
                         f"({m}, {w.n_out})")
    return out


@njit(nogil=True, cache=True)
def _block_f16s(w, bpb, off, r0, out):
    """out f32[k, nb] = the f16 at byte `off` of every `bpb`-byte block of rows
    r0 .. r0+k of w."""
    for i in range(out.shape[0]):
        for b in range(out.shape[1]):
            o = b * bpb + off
            out[i, b] = f16_to_f32(np.uint16(w[r0 + i, o])
                                   | (np.uint16(w[r0 + i, o + 1]) << np.uint16(8)))


def _q81_delta(qa) -> np.ndarray:
    """f32[m, nb]: ggml's f16-rounded block sum s_x minus the d_x * sum(q_x) the GEMM
    used."""
    m, n = qa.q.shape
    return qa.s - qa.d * qa.q.reshape(m, n // 32, 32).sum(axis=2)             # [m, nb]


def _blas_into(w, xp: np.ndarray, qa, out: np.ndarray) -> None:
    """out [m, n_out] (may be a column slice) = xp @ W.T, tile by tile; + the Q8_1
    correction if qa."""
    if w.ggml_type == T.F32:
        np.matmul(xp, w.wv.T, out=out)                                   # [m, n_out]
        return
    rows = min(w.n_out, max(16, _TILE_ELEMENTS // w.n_in))
    tile = _tile_buffer(rows * w.n_in).reshape(rows, w.n_in)             # [rows, n_in]
    fmt = FORMATS[w.ggml_type]
    delta = None
    if qa is not None and qa.s is not None:             # Q8_1 activations: Q4_1, Q5_1
        delta = _q81_delta(qa)                                           # [m, nb]
        mins = np.empty((rows, w.n_in // fmt.block_size), np.float32)    # [rows, nb]
    for r0 in range(0, w.n_out, rows):
        r1 = min(w.n_out, r0 + rows)
        t = tile[:r1 - r0]
        dequantize_into(w.raw, w.ggml_type, r0, None, t)
        np.matmul(xp, t.T, out=out[:, r0:r1])                            # [m, r1 - r0]
        if delta is not None:
            mt = mins[:r1 - r0]
            _block_f16s(w.raw, fmt.block_bytes, fmt.m_offset, r0, mt)    # the rows' m_w
            out[:, r0:r1] += delta @ mt.T                                # [m, r1 - r0]


def matmul_blas(w, X: np.ndarray, out: np.ndarray, exact_activations: bool = True):
    """The "blas" path; X f32[m, n_in] C-contiguous, out f32[m, n_out]."""
    qa = quantize_activations(X, w.vec_dot_type) if exact_activations else None
    xp = qa.dequantized() if qa is not None else X                       # [m, n_in]
    if isinstance(w, MultiMatrix):
        for part, (a, b) in zip(w.parts, w.bounds):
            _blas_into(part, xp, qa, out[:, a:b])                  # [m, part's n_out]
    else:
        _blas_into(w, xp, qa, out)
    return out


def has_rows_kernel(w) -> bool:
    """True if `w`'s format has a multi-row kernel at the current `isa.level`."""
    return (w.ggml_type._value_, isa.level) in _BY_VALUE


def has_packed_kernel(w) -> bool:
    """True if `w`'s format has the packed GEMM at the current `isa.level`
    (_int_packed.py)."""
    return (w.ggml_type._value_, isa.level) in _PACKED_BY_VALUE


def matmul_rows(w, X: np.ndarray, out: np.ndarray, packed: bool = False) -> np.ndarray:
    """The "rows" path (or with `packed`, the "packed" path): the multi-row kernel of
    w's format, all parts of a MultiMatrix in one call.  X f32[m, n_in] C-contiguous,
    out f32[m, n_out] C-contiguous."""
    qa = quantize_activations(X, w.vec_dot_type)
    kernel = (_PACKED_BY_VALUE if packed else _BY_VALUE)[(w.ggml_type._value_,
                                                          isa.level)]
    fns = kernel.fns if kernel.fns is not None else kernel.load()
    parts, rb = w.kernel_parts()
    run(fns, parts, rb, qa.qi, qa.d, qa.side_bytes, -2 if packed else -1,
        out.reshape(-1), out.shape[1], NO_FLOATS)
    return out


def matmul(w, X: np.ndarray, out: np.ndarray | None = None, *, path: str = "auto",
           exact_activations: bool = True) -> np.ndarray:
    """Y f32[m, n_out] = X f32[m, n_in] @ W.T (prefill; also fine for m = 1).

    path: "auto" (see the module docstring), "rows", "gemv" or "blas".
    exact_activations: quantize X like ggml (numerics equal to decode and llama.cpp);
    False only affects the blas path and gives float32-activation results.
    `out`, if given, must be C-contiguous float32 [m, n_out]; it is returned.
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != w.n_in:
        raise ValueError(f"{w.name!r}: X has shape {X.shape}, expected (m, {w.n_in})")
    m = X.shape[0]
    out = _check_out(w, m, out)
    if path == "auto":
        if not exact_activations:
            path = "blas"
        elif m >= PACKED_MIN_ROWS and has_packed_kernel(w):
            path = "packed"     # ahead of the tiles and BLAS at every m measured
        elif has_rows_kernel(w):
            path = "rows" if m < rows_blas_min_rows(w.ggml_type) else "blas"
        else:
            path = "gemv" if m < PREFILL_MIN_ROWS else "blas"
    if path == "blas":
        return matmul_blas(w, X, out, exact_activations)
    if path == "packed" and has_packed_kernel(w):
        return matmul_rows(w, X, out, packed=True)
    if path == "packed":
        path = "rows"           # the formats and levels without it: the tiles
    if path not in ("gemv", "rows"):
        raise ValueError("path must be 'auto', 'rows', 'packed', 'gemv' or 'blas', "
                         f"not {path!r}")
    if not exact_activations:
        raise ValueError(f"the {path} path always quantizes the activations; "
                         f"use path='blas'")
    if path == "rows" and has_rows_kernel(w):
        return matmul_rows(w, X, out)
    qa = quantize_activations(X, w.vec_dot_type)
    for i in range(m):
        matvec_quantized(w, qa, out[i], row=i)
    return out


def kernel_choices(types=None, level: str | None = None) -> list[tuple[str, ...]]:
    """[(format, level used, matvec kernel, matmul paths)] for `types` (default: every
    format) at `level` (default: isa.level): what `fucina info --kernels` prints."""
    rows = []
    types = sorted(FORMATS if types is None else {T(int(t)) for t in types}, key=int)
    for t in types:
        lv, k = kernel_for(t, level)
        mv = k.describe() if isinstance(k, IntKernels) else "float32 lanes (numba)"
        if (t, lv) in PACKED_KERNELS:
            below = (f"{_TILE_ROWS}-row tiles" if (t, lv) in KERNELS
                     else "matvec per row")
            mm = f"{below} < {PACKED_MIN_ROWS} rows, packed GEMM above"
            if lv == isa.GENERIC:
                mm += " (pmaddubsw)" if byte_products(t, lv) else " (int16 pairs)"
        elif (t, lv) in KERNELS:
            n = ROWS_BLAS_MIN_ROWS_BY_LEVEL[lv][t]
            mm = f"{_TILE_ROWS}-row tiles < {n} rows, BLAS above"
        else:
            mm = f"matvec per row < {PREFILL_MIN_ROWS} rows, BLAS above"
        rows.append((t.name, lv, mv, mm))
    return rows
