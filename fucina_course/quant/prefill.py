"""Prefill: weight matrix x many activation rows, Y [m, n_out] = X [m, n_in] @ W.T.

Two paths, chosen by `path=` (default "auto": "gemv" below `PREFILL_MIN_ROWS` rows, else "blas"):

* **"gemv"**: the decode kernel (decode.py) once per row.  Reads the whole matrix m times.
* **"blas"**: dequantize a tile of consecutive weight rows to float32 (4M elements = 16 MB, a
  buffer reused per thread; a serial numba kernel, dequant.py) and multiply it with numpy's `@`
  (OpenBLAS sgemm, 2 threads), writing straight into the output columns of those rows.  The weights stay in their block format; only one tile is ever
  float32.

**Numerics.**  With `exact_activations=True` (the default) both paths compute what llama.cpp
computes: the activations are first rounded through the weight's `vec_dot_type` exactly as in
decode, and the "blas" path multiplies their float32 value `q_x * d_x` (activations.py,
`fake_quant`) with the float32 dequantized weights.  Every weight value and (for Q8_0/Q8_1) every
activation value is exact in float32, so the products are those of the integer kernels and only the
summation order differs (decode vs prefill agree to ~1e-6 relative; tests check 1e-5).  Two details
make that true:
  * Q8_K activations (`d_x` is a float32, not an f16) carry one rounding in `q_x * d_x` (2^-24 relative).
  * Q4_1/Q5_1: ggml adds `m_w * s_x` per block with `s_x = f16(d_x * sum q_x)` -- an f16-rounded
    sum, while the dequantized product adds `m_w * sum(q_x * d_x)`.  The path adds the difference
    back: `Y += (s_x - d_x * sum q_x) @ M_w.T`, a GEMM 32x smaller than the main one.
With `exact_activations=False` the "blas" path uses the float32 activations as they are: closer to
the infinitely precise product (it skips the ~0.4% activation quantization), but no longer equal
to decode or to llama.cpp.  The "gemv" path always quantizes.

Measured (Xeon Sapphire Rapids VM, 2 cores, numba 0.68.1, OpenBLAS 0.3.31 via numpy 2.4, 2 threads;
GFLOP/s = 2 m n_out n_in / time; numpy's own sgemm on float32 data reaches 265 GFLOP/s at
256x3072x1024 and 316 at 4096^3 here):

| Q8_0, n_in 1024 -> n_out 3072 | m=4 | m=8 | m=16 | m=64 | m=256 |
|---|---|---|---|---|---|
| gemv (m decode calls) | 42 | 44 | 44 | 43 | - |
| int8-style kernel, 4 tokens per weight load, 4x32-lane accumulators | 43 | 43 | 41 | 41 | - |
| blas, serial dequant tiles of 4M elements (**chosen**) | 11 | 23 | 35-44 | 105-128 | 195-230 |
| blas, tiles of 128 rows | 11 | 22 | 38 | 104 | 182 |
| blas, tiles of 1M elements | - | - | - | 99-104 | 191-196 |
| blas, each tile split over 2 Python threads (same run: serial 43 / 125 / 228) | - | - | 51 | 121 | 221 |
| blas, numba `parallel=True` dequant tiles | 3 | 13 | 27 | 110 | 164 |

(3072 -> 1024 behaves the same; the parallel-dequant row there drops to 5 GFLOP/s at m=16,
and the 2-thread split gives 41 / 107 / 183 vs serial 42 / 112 / 186: no gain overall.)  The
parallel-dequant row is two thread pools (numba's OpenMP, OpenBLAS's pthreads) spinning against each
other on two cores; see dequant.py.  The int8-style kernel (the "int8 GEMM in numba" alternative,
numerics identical to decode) is compute-bound at the decode kernels' in-cache rate, ~21 G
multiply-adds/s: sharing weight loads saves little when every multiply-add costs a float mul + fma.
Q4_K: blas m=16/64/256 = 46/126/222 GFLOP/s vs gemv ~40, hence `PREFILL_MIN_ROWS = 16` (to change
it, assign `fucina_course.quant.prefill.PREFILL_MIN_ROWS`, or pass `path=`).  Q4_1/Q5_1 pay ~10%
for the block-sum correction.

Not yet re-tuned for the integer (VNNI) decode kernels (decode.py), which made "gemv" 2-3x faster:
measured GFLOP/s gemv vs blas, 1024->3072, m = 16 / 32 / 64 -- Q4_K ~130 vs 44 / 70 / 125, Q5_0
~85 vs 44 / 76 / 110, Q8_0 ~80 vs 36 / 60 / 100 (gemv is flat in m; noisy, shared machine).  The
crossover moved from 16 to ~48-64 rows for these formats; raising PREFILL_MIN_ROWS per format would
speed up short prompts (the two paths agree to ~1e-6, see below).
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from ._intrinsics import f16_to_f32
from .activations import quantize_activations
from .dequant import dequantize_into
from .matrix import MultiMatrix
from .decode import matvec_quantized

PREFILL_MIN_ROWS = 16        # "auto" uses the BLAS path from this many activation rows on
_TILE_ELEMENTS = 1 << 22     # float32 elements per dequantized weight tile (16 MB, reused per thread)
_tls = threading.local()


def _tile_buffer(n: int) -> np.ndarray:
    """A float32 scratch buffer of at least n elements, kept per thread (no page faults per call)."""
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.size < n:
        buf = _tls.buf = np.empty(n, np.float32)
    return buf[:n]


def _check_out(w, m: int, out):
    if out is None:
        return np.empty((m, w.n_out), np.float32)  # [m, n_out]
    if out.shape != (m, w.n_out) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"{w.name!r}: out must be C-contiguous float32 of shape ({m}, {w.n_out})")
    return out


@njit(nogil=True, cache=True)
def _block_f16s(w, bpb, off, r0, out):
    """out f32[k, nb] = the f16 at byte `off` of every `bpb`-byte block of rows r0 .. r0+k of w."""
    for i in range(out.shape[0]):
        for b in range(out.shape[1]):
            o = b * bpb + off
            out[i, b] = f16_to_f32(np.uint16(w[r0 + i, o]) | (np.uint16(w[r0 + i, o + 1]) << np.uint16(8)))


def _q81_delta(qa) -> np.ndarray:
    """f32[m, nb]: ggml's f16-rounded block sum s_x minus the d_x * sum(q_x) the GEMM used."""
    m, n = qa.q.shape
    return qa.s - qa.d * qa.q.reshape(m, -1, 32).sum(axis=2)                 # [m, nb]


def _blas_into(w, xp: np.ndarray, qa, out: np.ndarray) -> None:
    """out [m, n_out] (may be a column slice) = xp @ W.T, tile by tile; + the Q8_1 correction if qa."""
    if w.ggml_type == T.F32:
        np.matmul(xp, w.wv.T, out=out)                                        # [m, n_out]
        return
    rows = min(w.n_out, max(16, _TILE_ELEMENTS // w.n_in))
    tile = _tile_buffer(rows * w.n_in).reshape(rows, w.n_in)                  # [rows, n_in]
    delta = None
    if qa is not None and w.ggml_type in (T.Q4_1, T.Q5_1):
        delta = _q81_delta(qa)                                                # [m, nb]
        mins = np.empty((rows, w.n_in // 32), np.float32)                     # [rows, nb]
    for r0 in range(0, w.n_out, rows):
        r1 = min(w.n_out, r0 + rows)
        t = tile[:r1 - r0]
        dequantize_into(w.raw, w.ggml_type, r0, None, t)
        np.matmul(xp, t.T, out=out[:, r0:r1])                                 # [m, r1 - r0]
        if delta is not None:
            mt = mins[:r1 - r0]
            _block_f16s(w.raw, 20 if w.ggml_type == T.Q4_1 else 24, 2, r0, mt)  # m_w of these rows
            out[:, r0:r1] += delta @ mt.T                                       # [m, r1 - r0]


def matmul_blas(w, X: np.ndarray, out: np.ndarray, exact_activations: bool = True) -> np.ndarray:
    """The "blas" path (see the module docstring); X f32[m, n_in] C-contiguous, out f32[m, n_out]."""
    qa = quantize_activations(X, w.vec_dot_type) if exact_activations else None
    xp = qa.dequantized() if qa is not None else X                            # [m, n_in]
    if isinstance(w, MultiMatrix):
        for part, (a, b) in zip(w.parts, w.bounds):
            _blas_into(part, xp, qa, out[:, a:b])                             # [m, n_out of part]
    else:
        _blas_into(w, xp, qa, out)
    return out


def matmul(w, X: np.ndarray, out: np.ndarray | None = None, *, path: str = "auto",
           exact_activations: bool = True) -> np.ndarray:
    """Y f32[m, n_out] = X f32[m, n_in] @ W.T (prefill; also fine for m = 1).

    path: "auto" (gemv below `PREFILL_MIN_ROWS` rows, else blas), "gemv" or "blas".
    exact_activations: quantize X like ggml (numerics equal to decode and llama.cpp); False only
    affects the blas path and gives float32-activation results (see the module docstring).
    `out`, if given, must be C-contiguous float32 [m, n_out]; it is returned.
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    if X.ndim != 2 or X.shape[1] != w.n_in:
        raise ValueError(f"{w.name!r}: X has shape {X.shape}, expected (m, {w.n_in})")
    m = X.shape[0]
    out = _check_out(w, m, out)
    if path == "auto":
        path = "gemv" if (exact_activations and m < PREFILL_MIN_ROWS) else "blas"
    if path == "blas":
        return matmul_blas(w, X, out, exact_activations)
    if path != "gemv":
        raise ValueError(f"path must be 'auto', 'gemv' or 'blas', not {path!r}")
    if not exact_activations:
        raise ValueError("the gemv path always quantizes the activations; use path='blas'")
    qa = quantize_activations(X, w.vec_dot_type)
    for i in range(m):
        matvec_quantized(w, qa, out[i], row=i)
    return out
