"""Dequantization: GGML blocks -> float32, bit-exact against `gguf.quants.dequantize`.

Every kernel produces exactly the float32 values of ggml's `dequantize_row_*` and of
gguf-py.  That is easy because the products are exact in float32 (an f16 scale has 11
significant bits, a 6-bit sub-scale 6, a quant 4-8, so `d * sc * q` fits in 24 bits) --
except Q6_K, whose `(d * sc) * q` can need 25 bits; there the *order* `(d * sc) * q`
(one rounding, the one ggml and gguf-py do) keeps us bit-exact, and the kernels are
compiled without `fastmath` so LLVM may not re-associate it.

One kernel per format (`@registers` makes it `FORMATS[t].kernels.dequantize`), all
with the signature

    _dq_<fmt>(w: uint8[n_rows, row_bytes] (read-only), rows: int64[k], r0: int64,
              out: float32[k, row_len])

which dequantizes source row `rows[i]` (or `r0 + i` when `rows` is empty) into
`out[i]`.  The same kernel serves `dequantize` (the whole tensor, one block per row),
`dequantize_rows` (an embedding gather) and matmul's "blas" path (a tile of
consecutive weight rows, handed to BLAS right after).  Block sizes and offsets are the
`FORMATS` records' (literals inside numba code; each kernel names its record).

The kernels are **serial and release the GIL**; `dequantize` splits big tensors over
Python threads.  `parallel=True` was rejected: twice as fast alone, but before each
OpenBLAS sgemm of the prefill loop the two thread pools spin against each other on
two cores, and prefill Q8_0 (m = 256) fell from 215 to 101 GFLOP/s
(docs/BENCHMARKS.md#prefill-paths).  The 151936 x 896 token-embedding table
dequantizes in 0.08 s (Q8_0, 2 threads; gguf-py's numpy version: 0.6 s).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from ._intrinsics import f16_to_f32
from .formats import (FORMATS, block_geometry, check_supported, registers,
                      row_bytes)

_EMPTY_ROWS = np.empty(0, dtype=np.int64)
_BLOCKS_PER_THREAD = 1 << 16  # below this, one thread: a pool costs more than it saves


@njit(inline="always")
def _f16(w, i, o):
    """The f16 stored little-endian at w[i, o], w[i, o + 1], as float32."""
    return f16_to_f32(np.uint16(w[i, o]) | (np.uint16(w[i, o + 1]) << np.uint16(8)))


@njit(inline="always")
def _scale_min_k4(w, i, o, j):
    """(sc, m): the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes
    at w[i, o:o+12] (ggml's get_scale_min_k4)."""
    if j < 4:
        sc = w[i, o + j] & 63
        m = w[i, o + j + 4] & 63
    else:
        sc = (w[i, o + j + 4] & 0xF) | ((w[i, o + j - 4] >> 6) << 4)
        m = (w[i, o + j + 4] >> 4) | ((w[i, o + j] >> 6) << 4)
    return np.float32(sc), np.float32(m)


@njit(inline="always")
def _src(rows, r0, i):
    return rows[i] if rows.size > 0 else r0 + i


# --- 32-element blocks ----------------------------------------------------------------

@registers("dequantize", T.Q8_0)
@njit(nogil=True, cache=True)
def _dq_q8_0(w, rows, r0, out):
    """FORMATS[Q8_0]: 34-byte blocks, d f16 | qs int8[32]."""
    nb = w.shape[1] // 34
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 34
            d = _f16(w, s, o)
            for j in range(32):
                out[i, b * 32 + j] = np.float32(np.int8(w[s, o + 2 + j])) * d


@registers("dequantize", T.Q4_0)
@njit(nogil=True, cache=True)
def _dq_q4_0(w, rows, r0, out):
    """FORMATS[Q4_0]: 18-byte blocks, d f16 | qs[16]."""
    nb = w.shape[1] // 18
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 18
            d = _f16(w, s, o)
            for j in range(16):
                q = w[s, o + 2 + j]
                out[i, b * 32 + j] = np.float32(np.int32(q & 0xF) - 8) * d
                out[i, b * 32 + 16 + j] = np.float32(np.int32(q >> 4) - 8) * d


@registers("dequantize", T.Q4_1)
@njit(nogil=True, cache=True)
def _dq_q4_1(w, rows, r0, out):
    """FORMATS[Q4_1]: 20-byte blocks, d f16 | m f16 | qs[16]."""
    nb = w.shape[1] // 20
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 20
            d = _f16(w, s, o)
            m = _f16(w, s, o + 2)
            for j in range(16):
                q = w[s, o + 4 + j]
                out[i, b * 32 + j] = d * np.float32(q & 0xF) + m
                out[i, b * 32 + 16 + j] = d * np.float32(q >> 4) + m


@registers("dequantize", T.Q5_0)
@njit(nogil=True, cache=True)
def _dq_q5_0(w, rows, r0, out):
    """FORMATS[Q5_0]: 22-byte blocks, d f16 | qh u32 | qs[16]."""
    nb = w.shape[1] // 22
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 22
            d = _f16(w, s, o)
            qh = (np.uint32(w[s, o + 2]) | (np.uint32(w[s, o + 3]) << 8)
                  | (np.uint32(w[s, o + 4]) << 16) | (np.uint32(w[s, o + 5]) << 24))
            for j in range(16):
                q = np.uint32(w[s, o + 6 + j])
                lo = (q & 0xF) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[i, b * 32 + j] = np.float32(np.int32(lo) - 16) * d
                out[i, b * 32 + 16 + j] = np.float32(np.int32(hi) - 16) * d


@registers("dequantize", T.Q5_1)
@njit(nogil=True, cache=True)
def _dq_q5_1(w, rows, r0, out):
    """FORMATS[Q5_1]: 24-byte blocks, d f16 | m f16 | qh u32 | qs[16]."""
    nb = w.shape[1] // 24
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 24
            d = _f16(w, s, o)
            m = _f16(w, s, o + 2)
            qh = (np.uint32(w[s, o + 4]) | (np.uint32(w[s, o + 5]) << 8)
                  | (np.uint32(w[s, o + 6]) << 16) | (np.uint32(w[s, o + 7]) << 24))
            for j in range(16):
                q = np.uint32(w[s, o + 8 + j])
                lo = (q & 0xF) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                out[i, b * 32 + j] = d * np.float32(lo) + m
                out[i, b * 32 + 16 + j] = d * np.float32(hi) + m


# --- 256-element K-quant super-blocks -------------------------------------------------

@registers("dequantize", T.Q4_K)
@njit(nogil=True, cache=True)
def _dq_q4_k(w, rows, r0, out):
    """FORMATS[Q4_K]: 144-byte blocks, d f16 | dmin f16 | scales[12] | qs[128];
    sub-block j of 32 elements uses the 6-bit (sc_j, m_j)."""
    nb = w.shape[1] // 144
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 144
            d = _f16(w, s, o)
            dmin = _f16(w, s, o + 2)
            for c in range(4):  # 64 elements: low nibbles = sub-block 2c, high 2c+1
                sc0, m0 = _scale_min_k4(w, s, o + 4, 2 * c)
                sc1, m1 = _scale_min_k4(w, s, o + 4, 2 * c + 1)
                d0 = d * sc0
                dm0 = dmin * m0
                d1 = d * sc1
                dm1 = dmin * m1
                e = b * 256 + c * 64
                for l in range(32):
                    q = w[s, o + 16 + c * 32 + l]
                    out[i, e + l] = d0 * np.float32(q & 0xF) - dm0
                    out[i, e + 32 + l] = d1 * np.float32(q >> 4) - dm1


@registers("dequantize", T.Q5_K)
@njit(nogil=True, cache=True)
def _dq_q5_k(w, rows, r0, out):
    """FORMATS[Q5_K]: 176-byte blocks, d | dmin | scales[12] | qh[32] | qs[128];
    bit j of qh[l] is the 5th bit of element l of sub-block j."""
    nb = w.shape[1] // 176
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 176
            d = _f16(w, s, o)
            dmin = _f16(w, s, o + 2)
            for c in range(4):
                sc0, m0 = _scale_min_k4(w, s, o + 4, 2 * c)
                sc1, m1 = _scale_min_k4(w, s, o + 4, 2 * c + 1)
                d0 = d * sc0
                dm0 = dmin * m0
                d1 = d * sc1
                dm1 = dmin * m1
                e = b * 256 + c * 64
                for l in range(32):
                    q = w[s, o + 48 + c * 32 + l]
                    h = w[s, o + 16 + l]
                    lo = (q & 0xF) | (((h >> (2 * c)) & 1) << 4)
                    hi = (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4)
                    out[i, e + l] = d0 * np.float32(lo) - dm0
                    out[i, e + 32 + l] = d1 * np.float32(hi) - dm1


@registers("dequantize", T.Q6_K)
@njit(nogil=True, cache=True)
def _dq_q6_k(w, rows, r0, out):
    """FORMATS[Q6_K]: 210-byte blocks, ql[128] | qh[64] | scales int8[16] | d f16;
    element e uses scale e // 16."""
    nb = w.shape[1] // 210
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for b in range(nb):
            o = b * 210
            d = _f16(w, s, o + 208)
            for n in range(2):  # 128-element half
                ql = o + 64 * n
                qh = o + 128 + 32 * n
                sc = o + 192 + 8 * n
                e = b * 256 + 128 * n
                for h in range(2):  # 16-lane halves share their four scales
                    d1 = d * np.float32(np.int8(w[s, sc + h]))
                    d2 = d * np.float32(np.int8(w[s, sc + h + 2]))
                    d3 = d * np.float32(np.int8(w[s, sc + h + 4]))
                    d4 = d * np.float32(np.int8(w[s, sc + h + 6]))
                    for l in range(16 * h, 16 * h + 16):
                        a = w[s, ql + l]
                        bb = w[s, ql + 32 + l]
                        hh = w[s, qh + l]
                        q1 = np.int32((a & 0xF) | ((hh & 3) << 4)) - 32
                        q2 = np.int32((bb & 0xF) | (((hh >> 2) & 3) << 4)) - 32
                        q3 = np.int32((a >> 4) | (((hh >> 4) & 3) << 4)) - 32
                        q4 = np.int32((bb >> 4) | (((hh >> 6) & 3) << 4)) - 32
                        out[i, e + l] = d1 * np.float32(q1)
                        out[i, e + 32 + l] = d2 * np.float32(q2)
                        out[i, e + 64 + l] = d3 * np.float32(q3)
                        out[i, e + 96 + l] = d4 * np.float32(q4)


# --- plain floats (for matmul's tiles and the row gather) -----------------------------

@registers("dequantize", T.F16)
@njit(nogil=True, cache=True)
def _dq_f16(w, rows, r0, out):
    n = w.shape[1] // 2
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for j in range(n):
            out[i, j] = f16_to_f32(np.uint16(w[s, 2 * j])
                                   | (np.uint16(w[s, 2 * j + 1]) << np.uint16(8)))


@registers("dequantize", T.BF16)
@njit(nogil=True, cache=True)
def _dq_bf16(w, rows, r0, out):
    n = w.shape[1] // 2
    ou = out.view(np.uint32)
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for j in range(n):
            ou[i, j] = ((np.uint32(w[s, 2 * j]) << 16)
                        | (np.uint32(w[s, 2 * j + 1]) << 24))


@registers("dequantize", T.F32)
@njit(nogil=True, cache=True)
def _dq_f32(w, rows, r0, out):
    n = w.shape[1] // 4
    ou = out.view(np.uint32)
    for i in range(out.shape[0]):
        s = _src(rows, r0, i)
        for j in range(n):
            ou[i, j] = (np.uint32(w[s, 4 * j]) | (np.uint32(w[s, 4 * j + 1]) << 8)
                        | (np.uint32(w[s, 4 * j + 2]) << 16)
                        | (np.uint32(w[s, 4 * j + 3]) << 24))


def as_readonly_u8(raw: np.ndarray) -> np.ndarray:
    """A read-only, C-contiguous uint8 view of `raw` (one numba signature for mmap and
    RAM)."""
    a = np.asarray(raw)
    if a.dtype != np.uint8:
        a = np.ascontiguousarray(a).view(np.uint8)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    a = a.view()
    a.flags.writeable = False
    return a


def dequantize_into(w2d: np.ndarray, ggml_type, r0: int, rows: np.ndarray | None,
                    out: np.ndarray) -> np.ndarray:
    """Dequantize rows of `w2d` (read-only uint8 [n_rows, row_bytes]) into float32
    `out` [k, row_len].

    Source rows are `rows` if given, else `r0 .. r0 + k`.  No checks: callers validate.
    """
    kernel = FORMATS[T(int(ggml_type))].kernels.dequantize
    kernel(w2d, _EMPTY_ROWS if rows is None else rows, r0, out)
    return out


def _flat_bytes(raw: np.ndarray, ggml_type, n_elements: int) -> np.ndarray:
    check_supported(ggml_type, "<raw>")
    qk, bpb = block_geometry(ggml_type)
    if n_elements % qk:
        raise ValueError(f"{n_elements} elements is not a whole number of {qk}-element "
                         f"{T(int(ggml_type)).name} blocks")
    a = as_readonly_u8(raw).reshape(-1)
    need = n_elements // qk * bpb
    if a.size < need:
        raise ValueError(f"{T(int(ggml_type)).name}: {n_elements} elements need {need} "
                         f"bytes, got {a.size}")
    return a[:need]


def dequantize(raw: np.ndarray, ggml_type, n_elements: int) -> np.ndarray:
    """float32[n_elements]: the first `n_elements` values of `raw` (bytes of format
    `ggml_type`).

    Bit-exact against `gguf.quants.dequantize`.  Returns a new array (never a view of
    `raw`).
    """
    t = T(int(ggml_type))
    a = _flat_bytes(raw, t, n_elements)
    if t == T.F32:
        return a.view(np.float32).copy()
    if t == T.F16:
        return a.view(np.float16).astype(np.float32)
    if t == T.BF16:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    qk, bpb = block_geometry(t)
    out = np.empty(n_elements, dtype=np.float32)
    blocks = a.reshape(-1, bpb)           # [n_blocks, block bytes]: one block per "row"
    out2 = out.reshape(-1, qk)                  # [n_blocks, qk]
    kernel = FORMATS[t].kernels.dequantize
    n_threads = max(1, blocks.shape[0] // _BLOCKS_PER_THREAD)
    n_threads = min(numba.get_num_threads(), n_threads)
    if n_threads <= 1:
        kernel(blocks, _EMPTY_ROWS, 0, out2)
        return out
    cuts = np.linspace(0, blocks.shape[0], n_threads + 1).astype(np.int64)
    with ThreadPoolExecutor(n_threads) as pool:  # the kernels release the GIL
        jobs = [pool.submit(kernel, blocks[lo:hi], _EMPTY_ROWS, 0, out2[lo:hi])
                for lo, hi in zip(cuts[:-1], cuts[1:])]
        for j in jobs:
            j.result()
    return out


def dequantize_rows(raw: np.ndarray, ggml_type, row_len: int, rows) -> np.ndarray:
    """float32[len(rows), row_len]: the requested rows of a matrix stored row by row
    (an embedding gather).

    `raw` may be flat or already [n_rows, row_bytes]; row indices may be negative (numpy
    style).
    """
    t = T(int(ggml_type))
    check_supported(t, "<raw>")
    rb = row_bytes(t, row_len)
    a = as_readonly_u8(raw).reshape(-1)
    if a.size % rb:
        raise ValueError(f"{a.size} bytes is not a whole number of {rb}-byte {t.name} "
                         f"rows")
    w2d = a.reshape(-1, rb)  # [n_rows, row_bytes]
    idx = np.asarray(rows, dtype=np.int64).reshape(-1)
    n_rows = w2d.shape[0]
    if idx.size and (idx.min() < -n_rows or idx.max() >= n_rows):
        raise IndexError(f"row index out of range for a matrix of {n_rows} rows")
    idx = np.where(idx < 0, idx + n_rows, idx)
    out = np.empty((idx.size, row_len), dtype=np.float32)  # [len(rows), row_len]
    if idx.size:
        FORMATS[t].kernels.dequantize(w2d, idx, 0, out)
    return out
