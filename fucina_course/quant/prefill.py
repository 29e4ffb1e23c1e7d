"""Prefill: weight matrix x many activation rows, Y [m, n_out] = X [m, n_in] @ W.T.

Three paths, chosen by `path=`:

* **"rows"**: the multi-row integer kernels (_simd.py, `mm_q4_k` ...; Q4_K, Q5_K, Q6_K, Q8_0, Q4_0,
  Q5_0 where the CPU has AVX512-VNNI).  Each weight block is loaded and unpacked once per tile of 8
  activation rows and dotted with all of them, so the matrix streams from memory once per call
  (for m <= 8) instead of once per row; all parts of a MultiMatrix (q/k/v, gate/up) in one call.
  Row i of the result is bit-identical to `matvec` of row i (same integer lane sums, same float
  steps): batch decode equals sequential decode exactly.  Other formats (or decode.VNNI off, e.g.
  FUCINA_NO_VNNI=1): the "gemv" path.
* **"gemv"**: the decode kernel (decode.py) once per row.  Reads the whole matrix m times.
* **"blas"**: dequantize a tile of consecutive weight rows to float32 (4M elements = 16 MB, a
  buffer reused per thread; a serial numba kernel, dequant.py) and multiply it with numpy's `@`
  (OpenBLAS sgemm, 2 threads), writing straight into the output columns of those rows.  The
  weights stay in their block format; only one tile is ever float32.

"auto" (the default): "rows" below `ROWS_BLAS_MIN_ROWS[format]` rows for the formats that have
multi-row kernels, else "gemv" below `PREFILL_MIN_ROWS` (16) rows; "blas" from there on, and always
with `exact_activations=False`.  `ROWS_BLAS_MIN_ROWS` is 64 for every format while OpenBLAS's idle
worker threads spin (its default, see below); if the process started with OPENBLAS_THREAD_TIMEOUT
<= 20 or a single BLAS thread (`openblas_workers_spin`), it is the kernels' own crossover: 256 for
Q8_0/Q5_0, 512 for Q4_K/Q5_K/Q6_K/Q4_0.  Both are plain module attributes (assign to change them).

**Numerics.**  With `exact_activations=True` (the default) all paths compute what llama.cpp
computes: the activations are first rounded through the weight's `vec_dot_type` exactly as in
decode, and the "blas" path multiplies their float32 value `q_x * d_x` (activations.py,
`fake_quant`) with the float32 dequantized weights.  Every weight value and (for Q8_0/Q8_1) every
activation value is exact in float32, so the products are those of the integer kernels and only the
summation order differs (decode vs blas agree to ~1e-6 relative; tests check 1e-5; "rows" and
"gemv" agree with decode exactly).  Two details make that true:
  * Q8_K activations (`d_x` is a float32, not an f16) carry one rounding in `q_x * d_x` (2^-24 relative).
  * Q4_1/Q5_1: ggml adds `m_w * s_x` per block with `s_x = f16(d_x * sum q_x)` -- an f16-rounded
    sum, while the dequantized product adds `m_w * sum(q_x * d_x)`.  The path adds the difference
    back: `Y += (s_x - d_x * sum q_x) @ M_w.T`, a GEMM 32x smaller than the main one.
With `exact_activations=False` the "blas" path uses the float32 activations as they are: closer to
the infinitely precise product (it skips the ~0.4% activation quantization), but no longer equal
to decode or to llama.cpp.  The "rows" and "gemv" paths always quantize.

Measured (Xeon Sapphire Rapids VM, 2 cores, AVX-512 + VNNI, numba 0.68.1, OpenBLAS 0.3.31 via numpy
2.4, 2 threads; GFLOP/s = 2 m n_out n_in / time, n_in 1024 -> n_out 3072 called back to back (in
cache), best of 10 and of three runs of `bench/bench_matvec.py --prefill-m ...`, one format per
process, machine shared (load 0.3-1.4); numpy's own sgemm on float32 data reaches 265 GFLOP/s at
256x3072x1024 and 316 at 4096^3 here):

| 1024 -> 3072 | m=2 | 4 | 8 | 16 | 32 | 64 | 128 | 256 | 512 |
|---|---|---|---|---|---|---|---|---|---|
| Q4_K rows | 170 | 206 | 254 | 259 | 263 | 240 | 240 | 261 | 243 |
| Q4_K gemv | 124 | 137 | 147 | 145 | 148 | 144 | 133 | 130 | 134 |
| Q4_K blas | 7 | 15 | 28 | 49 | 76 | 112 | 155 | 208 | 244 |
| Q8_0 rows | 100 | 151 | 196 | 200 | 220 | 219 | 202 | 196 | 209 |
| Q8_0 gemv | 99 | 99 | 104 | 102 | 91 | 95 | 97 | 90 | 90 |
| Q8_0 blas | 6 | 11 | 22 | 40 | 64 | 98 | 148 | 194 | 222 |
| Q6_K rows | 140 | 202 | 266 | 283 | 280 | 276 | 273 | 267 | 271 |
| Q6_K blas | 7 | 14 | 27 | 47 | 78 | 120 | 163 | 210 | 236 |
| Q5_0 rows | 95 | 144 | 189 | 204 | 200 | 198 | 191 | 201 | 194 |
| Q5_0 blas | 7 | 14 | 27 | 48 | 79 | 117 | 158 | 212 | 230 |
| Q4_0 rows | 112 | 169 | 221 | 226 | 200 | 212 | 194 | 202 | 204 |
| Q4_0 blas | 4 | 9 | 17 | 32 | 56 | 89 | 124 | 167 | 200 |
| Q5_K rows | 126 | 185 | 253 | 234 | 232 | 250 | 240 | 242 | 218 |
| Q5_K blas | 6 | 13 | 24 | 44 | 73 | 108 | 155 | 203 | 235 |

(gemv for Q6_K / Q5_0 / Q4_0 / Q5_K: 108-122 / 86-101 / 100-125 / 110-130, flat in m.  3072 -> 1024
gives the same picture; at m = 512 rows vs blas there: Q4_K 235 vs 201, Q8_0 200 vs 171, Q6_K 255 vs
218.)  In cache, gemv is only ~1.5-2x below rows: its cost is the weight traffic, which this table
hides -- from DRAM (bench_matvec.py's model sweep with m rows at once, GB/s of weights), rows vs m
calls of the decode kernel: Q4_K m = 2 / 4 / 8: 13.8 / 11.3 / 7.5 vs 11.3 / 7.0 / 4.0 (m = 1: 15.2),
Q8_0: 14.5 / 13.8 / 9.8 vs 11.9 / 8.1 / 4.9 (m = 1: 17.0); Q6_K 15.3 / 13.5 / 11.4, Q5_0 12.4 / 10.0
/ 6.9, Q4_0 11.2 / 8.9 / 5.8, Q5_K 15.0 / 12.3 / 8.6 (m = 1: 16.2, 16.1, 15.5, 13.4).

**OpenBLAS's spinning workers.**  After every multi-threaded call, OpenBLAS's worker thread
busy-waits for `thread_timeout` cycles (default 2^28, ~0.1 s; it reads OPENBLAS_THREAD_TIMEOUT once,
when numpy loads it) before it sleeps; this build's wait loop stays in user space (utime grows,
stime 0).  Any numba kernel running in that window shares a core with it.  In the model, prefill
attention's sgemm (ops.causal_attention) goes multi-threaded somewhere between 32 and 48 tokens
(pp32 runs at full speed, pp48 does not), and every layer re-arms the spin: a Q4_K m=64 call right after a threaded sgemm took 3.3 ms instead of 1.6 (six
calls: 21-28 ms instead of 9.6), and pp64 with the rows kernels everywhere ran at 100-110 tok/s
(its FFN at half speed) versus 181 with OPENBLAS_THREAD_TIMEOUT=4.  pp64 / pp256 with
OPENBLAS_THREAD_TIMEOUT = 28 (default) / 24 / 20 / 16 / 10 / 4: 115 / 94 / 185 / 191 / 191 / 184 and
116 / 178 / 179 / 178 / 169 / 188 tok/s.  Load balancing does not help (_simd.py: dynamic scheduling,
rejected); the blas path is immune, its sgemm being the spinner's own work.  Hence two rules, and
the measured model-level crossovers behind them (Qwen3-0.6B geometry, `fucina bench --pp N`,
tok/s, rows-everywhere vs blas-everywhere):

| prefill tokens | 32 | 48 | 64 | 96 | 128 | 256 |
|---|---|---|---|---|---|---|
| Q4_K, default environment | 176-188 vs 68-74 | 107 vs 96 | 100-110 vs 104-115 | 108 vs 137 | 105-114 vs 135-144 | 101 vs 161 |
| Q8_0, default environment | 146 vs 59 | 88 vs 79 | 92 vs 98 | 94 vs 119 | 97 vs 126 | - |
| Q4_K, OPENBLAS_THREAD_TIMEOUT=4 | 182 vs 69 | - | 189 vs 107 | - | 183 vs 147 | 166 vs 159 |

Setting OPENBLAS_THREAD_TIMEOUT (e.g. 4) where the CLI sets OPENBLAS_NUM_THREADS, before numpy is
imported, would switch this module to the second rule; from here it is too late to change.

Earlier measurements (before the multi-row kernels; the blas path's tiling is unchanged):

| Q8_0, n_in 1024 -> n_out 3072 | m=4 | m=8 | m=16 | m=64 | m=256 |
|---|---|---|---|---|---|
| gemv with the float decode kernels (m decode calls) | 42 | 44 | 44 | 43 | - |
| float "int8-style" kernel, 4 tokens per weight load, 4x32-lane accumulators | 43 | 43 | 41 | 41 | - |
| blas, serial dequant tiles of 4M elements (**chosen**) | 11 | 23 | 35-44 | 105-128 | 195-230 |
| blas, tiles of 128 rows | 11 | 22 | 38 | 104 | 182 |
| blas, tiles of 1M elements | - | - | - | 99-104 | 191-196 |
| blas, each tile split over 2 Python threads (same run: serial 43 / 125 / 228) | - | - | 51 | 121 | 221 |
| blas, numba `parallel=True` dequant tiles | 3 | 13 | 27 | 110 | 164 |

(3072 -> 1024 behaves the same; the parallel-dequant row there drops to 5 GFLOP/s at m=16,
and the 2-thread split gives 41 / 107 / 183 vs serial 42 / 112 / 186: no gain overall.)  The
parallel-dequant row is two thread pools (numba's OpenMP, OpenBLAS's pthreads) spinning against each
other on two cores; see dequant.py.  The float "int8-style" kernel was compute-bound at ~21 G
multiply-adds/s (a float mul + fma per multiply-add); the integer multi-row kernels share the
weight unpacking and multiply bytes with vpdpbusd, 64 per instruction.  `PREFILL_MIN_ROWS = 16`
comes from the float kernels (Q4_K: blas m=16/64/256 = 46/126/222 GFLOP/s vs gemv ~40) and now
only applies to the formats without multi-row kernels (Q4_1, Q5_1, F16, BF16, F32) and to CPUs
without AVX512-VNNI.  Q4_1/Q5_1 pay ~10% for the block-sum correction.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import _simd, decode
from ._intrinsics import f16_to_f32
from .activations import quantize_activations
from .dequant import dequantize_into
from .matrix import MultiMatrix
from .decode import matvec_quantized

def openblas_workers_spin(env=os.environ) -> bool:
    """True if OpenBLAS (numpy's BLAS) keeps worker threads busy-waiting for long after each
    multi-threaded call: its default, `thread_timeout` = 2^28 cycles (~0.1 s), unless the process
    started with OPENBLAS_THREAD_TIMEOUT (or GOTO_THREAD_TIMEOUT) <= 20 or with one BLAS thread.
    OpenBLAS reads these variables once, when numpy loads it; this reads the same environment."""
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


PREFILL_MIN_ROWS = 16        # "auto": BLAS from this many rows on, for formats without multi-row kernels
# "auto": BLAS from this many rows on, for formats with multi-row kernels (measured: module docstring)
if openblas_workers_spin():
    ROWS_BLAS_MIN_ROWS = {t: 64 for t in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_0)}
else:
    ROWS_BLAS_MIN_ROWS = {T.Q4_K: 512, T.Q5_K: 512, T.Q6_K: 512, T.Q8_0: 256, T.Q4_0: 512, T.Q5_0: 256}
_MM = {int(t): k for t, k in _simd.MM_KERNELS.items()}
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
    return qa.s - qa.d * qa.q.reshape(m, n // 32, 32).sum(axis=2)             # [m, nb]


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


def has_rows_kernel(w) -> bool:
    """True if `w`'s format has a multi-row integer kernel on this CPU (and decode.VNNI is on)."""
    return decode.VNNI and _simd.HAVE_VNNI and w.ggml_type._value_ in _MM


def matmul_rows(w, X: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The "rows" path: the multi-row integer kernel of w's format (_simd.mm_*), all parts of a
    MultiMatrix in one call.  X f32[m, n_in] C-contiguous, out f32[m, n_out] C-contiguous."""
    qa = quantize_activations(X, w.vec_dot_type)
    kernel, with_bsum = _MM[w.ggml_type._value_]
    parts, rb = w.kernel_parts()
    if with_bsum:
        kernel(parts, rb, qa.qi, qa.d, qa.bsum32, out)
    else:
        kernel(parts, rb, qa.qi, qa.d, out)
    return out


def matmul(w, X: np.ndarray, out: np.ndarray | None = None, *, path: str = "auto",
           exact_activations: bool = True) -> np.ndarray:
    """Y f32[m, n_out] = X f32[m, n_in] @ W.T (prefill; also fine for m = 1).

    path: "auto" (see the module docstring), "rows", "gemv" or "blas".
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
        if not exact_activations:
            path = "blas"
        elif has_rows_kernel(w):
            path = "rows" if m < ROWS_BLAS_MIN_ROWS[w.ggml_type] else "blas"
        else:
            path = "gemv" if m < PREFILL_MIN_ROWS else "blas"
    if path == "blas":
        return matmul_blas(w, X, out, exact_activations)
    if path not in ("gemv", "rows"):
        raise ValueError(f"path must be 'auto', 'rows', 'gemv' or 'blas', not {path!r}")
    if not exact_activations:
        raise ValueError(f"the {path} path always quantizes the activations; use path='blas'")
    if path == "rows" and has_rows_kernel(w):
        return matmul_rows(w, X, out)
    qa = quantize_activations(X, w.vec_dot_type)
    for i in range(m):
        matvec_quantized(w, qa, out[i], row=i)
    return out
