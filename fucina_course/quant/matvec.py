"""Weight matrix (still in its block format) x one activation vector: `matvec`.

Decoding one token multiplies every weight matrix by one vector, so it reads every
weight once and is bound by memory bandwidth; the kernels' job is to stream the blocks
as fast as memory delivers them, doing ggml's arithmetic on the way.

Numerics (what llama.cpp computes): x is first quantized to the weight's `vec_dot_type`
(activations.py).  Then, per block b of row r,

    Q8_0 Q4_0 Q5_0:  y_r += (d_w d_x) * sum_j q_w q_x
    Q4_1 Q5_1:       y_r += (d_w d_x) * sum_j q_w q_x  +  m_w s_x
    Q4_K Q5_K:       y_r += (d_w d_x) * sum_s sc_s sum_j q_w q_x
                            - (dmin_w d_x) * sum_s m_s bsum_x[s]
    Q6_K:            y_r += (d_w d_x) * sum_s sc_s sum_j (q_w - 32) q_x
    F16 BF16 F32:    y_r += w_j x_j   with x rounded to f16 / bf16 / kept f32

Every product q_w q_x is an integer below 2^24, exact in float32, so the only difference
to llama.cpp is the order of float additions (tests: 1e-5 of the sum of |terms| against
reference.py, a numpy transcription of the formulas, and against llama.cpp's own
`ggml_vec_dot_*`).

Two kernel families, chosen per call from the table `KERNELS[(format, level)]`:
* integer kernels (_int_matvec.py) for the quantized formats at the x86 levels of isa.py
  (avx512vnni, avxvnni, avx2): 2-5x the float kernels in cache, 1.1-2x over a sweep;
  and, at the "generic" level, as portable vector IR on int16 activations;
* float kernels (below): every format on every CPU, what the generic level runs on a
  CPU whose LLVM has no native f16 conversion, the only ones for F16, BF16 and F32.
  (Q4_K's generic kernel is integer arithmetic in plain numba loops: its sub-block
  scales are integers, so a super-block needs one horizontal sum, not one per 32
  elements as the other formats would.)

Float kernel shape: `prange` over chunks of ROWS output rows; per row one 32-lane
float32 accumulator to which every block adds `scale * (float(q_w) * q_x)` lane-wise,
summed once per row.  An int32 sum per block with a horizontal reduction streamed Q8_0
at well under half this form's rate (measured: docs/BENCHMARKS.md#float-kernel-shape;
what was measured on it since: #prefetch, #float-kernels).  The lane loops are
unit-stride loops over the block's bytes, which LLVM turns into `vpmovzxbd / vcvtdq2ps
/ vfmadd231ps`.  Each block issues a software prefetch PREFETCH bytes ahead, which
more than doubled the sweep's rate (measured: docs/BENCHMARKS.md#software-prefetch).
Indexing is 2-D, `w[r, o + j]`: a flat `w[r * row_bytes + ...]` index that LLVM cannot
prove non-negative turns every load into a gather (numba wraps negative indices).

Small matrices: a 1024 -> 128 matrix (a K/V projection) costs 7.5-9 us per call, of
which ~2.5 us was quantizing x from Python.  So `matvec` hands an integer kernel the
float vector, and the kernel call quantizes it (`_int.run`, activations.row_quantizer):
one call from Python per matvec, not two (SmolLM2 and Qwen2.5-Coder decode ~4% faster,
avx2, docs/BENCHMARKS.md).  Callers that multiply one vector by several matrices of the
same `vec_dot_type` can still quantize it once with `quantize_activations` and call
`matvec_quantized` for each (the same bits).
"""

from __future__ import annotations

import os
import threading

# numba's OpenMP threads (libgomp) spin ~300,000 times after each parallel region before
# sleeping, i.e. for milliseconds, and an OpenBLAS call in that window fights them for
# the two cores: a 1024x1024 matvec then a 256x1024x1024 sgemm took 7.6 ms instead of
# 2.4 with 10,000 spins (decode unchanged; 1,000 spins cost it 25%).  libgomp reads the
# variable when numba starts its pool, i.e. before the first parallel kernel runs;
# an explicit GOMP_SPINCOUNT / OMP_WAIT_POLICY from the user wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from numba import njit, prange  # noqa: E402

from . import isa  # noqa: E402
from ._int import NO_FLOATS, IntKernels, run  # noqa: E402
from ._intrinsics import f16_to_f32, prefetch, u32_as_f32  # noqa: E402
from .activations import quantize_activations  # noqa: E402
from .formats import FORMATS, registers  # noqa: E402
from .matrix import MultiMatrix  # noqa: E402

ROWS = 16          # output rows per parallel chunk
PREFETCH = 2048    # bytes ahead in the weight stream
_FM = {"contract", "reassoc", "nsz"}  # FMA, re-associated 32-lane sum; keeps inf / nan
# F16 / BF16 / F32: no `reassoc`, so that the row's sum has one order on every SIMD width
# (lane j accumulates in order, then `_lane_sum`'s fixed tree).  With it LLVM reduced
# the 32 lanes in its own order per vector width: x86 (AVX-512) and aarch64 (NEON,
# qemu) differed by ~1.5e-7 relative (scripts/test_aarch64.sh).  The lane loop needs
# no `reassoc` to vectorize (its lanes are independent); FMA stays (both have it).
_FM_ORDERED = {"contract", "nsz"}
# lane j tests bit j of qh with a constant mask: per-lane variable shifts ran at
# 6.1 GB/s, the mask at 9.2-9.8 (Q5_0 sweep, docs/BENCHMARKS.md#float-kernels)
_BIT = (1 << np.arange(32, dtype=np.uint64)).astype(np.uint32)
_16 = np.float32(16.0)


@njit(inline="always")
def _f16(w, r, o):
    return f16_to_f32(np.uint16(w[r, o]) | (np.uint16(w[r, o + 1]) << np.uint16(8)))


@njit(inline="always")
def _high16(qh, bit):
    """16.0 if the 5th bit `bit` of qh is set, else 0.0: added as a float, it took the
    Q5_0 kernel from 3.3 to 4.9 GB/s (haswell code, in cache) against OR-ing it into the
    byte before the conversion."""
    return _16 if (qh & bit) != 0 else np.float32(0.0)


@njit(inline="always")
def _lane_sum(acc):
    """acc[0] + ... + acc[31] as a fixed tree (halves added lane-wise: 16, 8, 4, 2, then
    lane 0 + lane 1), the order AVX-512 reduces two 16-float registers in; one order on
    every CPU in the kernels compiled without `reassoc` (_FM_ORDERED).  Overwrites
    acc."""
    for j in range(16):
        acc[j] += acc[j + 16]
    for j in range(8):
        acc[j] += acc[j + 8]
    for j in range(4):
        acc[j] += acc[j + 4]
    return (acc[0] + acc[2]) + (acc[1] + acc[3])


@njit(inline="always")
def _zero(acc):
    for j in range(32):
        acc[j] = np.float32(0.0)


@njit(inline="always")
def _scale_min_k4(w, r, o, j):
    if j < 4:
        sc = np.int32(w[r, o + j] & 63)
        m = np.int32(w[r, o + j + 4] & 63)
    else:
        sc = np.int32((w[r, o + j + 4] & 0xF) | ((w[r, o + j - 4] >> 6) << 4))
        m = np.int32((w[r, o + j + 4] >> 4) | ((w[r, o + j] >> 6) << 4))
    return sc, m


# The float kernels.  Block formats: (w, wf, xq, xd, xs, y) with w uint8[n_out,
# row_bytes] and wf the same bytes flat (for the prefetch), xq f32[n_in] the quantized
# activations as floats, xd f32 their block scales, xs their side array
# (`QuantizedActivations.side`: Q8_1's s, Q8_K's bsum32; unused with Q8_0 activations),
# y f32[n_out].  F16 / BF16 /
# F32: (w, wf, x, y) with w the values' own view.  Block sizes and offsets are FORMATS'
# (literals inside numba code).  The kernels repeat one loop skeleton on purpose: a
# factory closing over the block body would not be reused from numba's disk cache.
# Quants are cast back to np.uint8 before np.float32: numba types integer expressions
# as int64, and 64-bit lanes ran Q4_K at 6.7 instead of 11-12 GB/s in cache.

# --- Q8_0-activation formats ----------------------------------------------------------

@registers("float_matvec", T.Q8_0)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q8_0(w, wf, xq, xd, xs, y):
    """FORMATS[Q8_0]: 34-byte blocks, d f16 | qs int8[32]."""
    n_out, rb = w.shape
    nb = rb // 34
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = r * rb + PREFETCH
            for b in range(nb):
                o = b * 34
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                for j in range(32):
                    acc[j] += s * (np.float32(np.int8(w[r, o + 2 + j]))
                                   * xq[b * 32 + j])
            y[r] = _lane_sum(acc)


@registers("float_matvec", T.Q4_0)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q4_0(w, wf, xq, xd, xs, y):
    """FORMATS[Q4_0]: 18-byte blocks, d f16 | qs[16] (low nibbles 0..15, high 16..)."""
    n_out, rb = w.shape
    nb = rb // 18
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = r * rb + PREFETCH
            for b in range(nb):
                o = b * 18
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                for j in range(16):
                    q = w[r, o + 2 + j]
                    lo = np.float32(np.uint8(q & 0xF)) - np.float32(8.0)
                    hi = np.float32(np.uint8(q >> 4)) - np.float32(8.0)
                    acc[j] += s * (lo * xq[b * 32 + j])
                    acc[16 + j] += s * (hi * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc)


@registers("float_matvec", T.Q5_0)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q5_0(w, wf, xq, xd, xs, y):
    """FORMATS[Q5_0]: 22-byte blocks, d f16 | qh u32 (5th bits) | qs[16]."""
    n_out, rb = w.shape
    nb = rb // 22
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = r * rb + PREFETCH
            for b in range(nb):
                o = b * 22
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                qh = (np.uint32(w[r, o + 2]) | (np.uint32(w[r, o + 3]) << 8)
                      | (np.uint32(w[r, o + 4]) << 16) | (np.uint32(w[r, o + 5]) << 24))
                for j in range(16):
                    q = w[r, o + 6 + j]
                    lo = np.float32(np.uint8(q & 0xF)) + _high16(qh, _BIT[j]) - _16
                    hi = np.float32(np.uint8(q >> 4)) + _high16(qh, _BIT[j + 16]) - _16
                    acc[j] += s * (lo * xq[b * 32 + j])
                    acc[16 + j] += s * (hi * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc)


# --- Q8_1-activation formats (weights with a per-block minimum) -----------------------

@registers("float_matvec", T.Q4_1)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q4_1(w, wf, xq, xd, xs, y):
    """FORMATS[Q4_1]: 20-byte blocks, d f16 | m f16 | qs[16]; xs = f16(d_x sum q_x)."""
    n_out, rb = w.shape
    nb = rb // 20
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + PREFETCH
            for b in range(nb):
                o = b * 20
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                mins += _f16(w, r, o + 2) * xs[b]
                for j in range(16):
                    q = w[r, o + 4 + j]
                    acc[j] += s * (np.float32(np.uint8(q & 0xF)) * xq[b * 32 + j])
                    acc[16 + j] += s * (np.float32(np.uint8(q >> 4))
                                        * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc) + mins


@registers("float_matvec", T.Q5_1)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q5_1(w, wf, xq, xd, xs, y):
    """FORMATS[Q5_1]: 24-byte blocks, d f16 | m f16 | qh u32 | qs[16]."""
    n_out, rb = w.shape
    nb = rb // 24
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + PREFETCH
            for b in range(nb):
                o = b * 24
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                mins += _f16(w, r, o + 2) * xs[b]
                qh = (np.uint32(w[r, o + 4]) | (np.uint32(w[r, o + 5]) << 8)
                      | (np.uint32(w[r, o + 6]) << 16) | (np.uint32(w[r, o + 7]) << 24))
                for j in range(16):
                    q = w[r, o + 8 + j]
                    lo = np.float32(np.uint8(q & 0xF)) + _high16(qh, _BIT[j])
                    hi = np.float32(np.uint8(q >> 4)) + _high16(qh, _BIT[j + 16])
                    acc[j] += s * (lo * xq[b * 32 + j])
                    acc[16 + j] += s * (hi * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc) + mins


# --- Q8_K-activation formats (256-element super-blocks) -------------------------------

@registers("float_matvec", T.Q4_K, float_q16=True)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q4_k(w, wf, x16, xd, xs, y):
    """FORMATS[Q4_K]: 144-byte blocks, d | dmin | scales[12] | qs[128]; xs = bsum32;
    x16 the quants as int16 (`QuantizedActivations.q16`), not floats.

    Integer arithmetic, as the x86 kernels do it (_int_matvec.q4k_row): each
    super-block ends in exact totals isum = sum_s sc_s (q . x)_s and msum = sum_s m_s
    bsum_s, then one float fma each.  The int16 products become vpmaddwd (x86) or
    smlal (ARM): 7.9 GB/s in cache against 5.9-6.5 for the float-lane form this
    replaces (haswell code, same process, docs/BENCHMARKS.md#generic-integer-q4_k).
    Int16 activations beat int8 (6.2-6.6 GB/s: LLVM widened each byte separately)."""
    n_out, rb = w.shape
    nsb = rb // 144
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            acc = np.float32(0.0)
            accm = np.float32(0.0)
            pf = r * rb + PREFETCH
            for b in range(nsb):
                o = b * 144
                prefetch(wf, pf + o)
                prefetch(wf, pf + o + 64)
                prefetch(wf, pf + o + 128)
                d = _f16(w, r, o) * xd[b]
                dmin = _f16(w, r, o + 2) * xd[b]
                isum = np.int32(0)
                msum = np.int32(0)
                for k in range(4):  # 64 elements: low nibbles = sub-block 2k, high 2k+1
                    sc0, m0 = _scale_min_k4(w, r, o + 4, 2 * k)
                    sc1, m1 = _scale_min_k4(w, r, o + 4, 2 * k + 1)
                    msum = np.int32(msum + m0 * xs[b * 8 + 2 * k]
                                    + m1 * xs[b * 8 + 2 * k + 1])
                    e = b * 256 + k * 64
                    s0 = np.int32(0)
                    s1 = np.int32(0)
                    for l in range(32):
                        q = w[r, o + 16 + k * 32 + l]
                        s0 = np.int32(s0 + np.int32(q & 0xF) * np.int32(x16[e + l]))
                        s1 = np.int32(s1 + np.int32(q >> 4) * np.int32(x16[e + 32 + l]))
                    isum = np.int32(isum + sc0 * s0 + sc1 * s1)
                acc += d * np.float32(isum)
                accm += dmin * np.float32(msum)
            y[r] = acc - accm


@registers("float_matvec", T.Q5_K)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q5_k(w, wf, xq, xd, xs, y):
    """FORMATS[Q5_K]: 176-byte blocks, d | dmin | scales[12] | qh[32] | qs[128]."""
    n_out, rb = w.shape
    nsb = rb // 176
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + PREFETCH
            for b in range(nsb):
                o = b * 176
                prefetch(wf, pf + o)
                prefetch(wf, pf + o + 64)
                prefetch(wf, pf + o + 128)
                d = _f16(w, r, o) * xd[b]
                dmin = _f16(w, r, o + 2) * xd[b]
                isum = 0
                for k in range(4):
                    sc0, m0 = _scale_min_k4(w, r, o + 4, 2 * k)
                    sc1, m1 = _scale_min_k4(w, r, o + 4, 2 * k + 1)
                    isum += m0 * xs[b * 8 + 2 * k] + m1 * xs[b * 8 + 2 * k + 1]
                    s0 = d * np.float32(sc0)
                    s1 = d * np.float32(sc1)
                    e = b * 256 + k * 64
                    m_lo = _BIT[2 * k]
                    m_hi = _BIT[2 * k + 1]
                    for l in range(32):
                        q = w[r, o + 48 + k * 32 + l]
                        h = w[r, o + 16 + l]
                        h0 = np.uint8(16) if (h & m_lo) != 0 else np.uint8(0)
                        h1 = np.uint8(16) if (h & m_hi) != 0 else np.uint8(0)
                        lo = np.float32(np.uint8((q & 0xF) | h0))
                        hi = np.float32(np.uint8((q >> 4) | h1))
                        acc[l] += s0 * (lo * xq[e + l]) + s1 * (hi * xq[e + 32 + l])
                mins += dmin * np.float32(isum)
            y[r] = _lane_sum(acc) - mins


@registers("float_matvec", T.Q6_K)
@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q6_k(w, wf, xq, xd, xs, y):
    """FORMATS[Q6_K]: 210-byte blocks, ql[128] | qh[64] | scales int8[16] | d f16."""
    n_out, rb = w.shape
    nsb = rb // 210
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = r * rb + PREFETCH
            for b in range(nsb):
                o = b * 210
                prefetch(wf, pf + o)
                prefetch(wf, pf + o + 64)
                prefetch(wf, pf + o + 128)
                prefetch(wf, pf + o + 192)
                d = _f16(w, r, o + 208) * xd[b]
                for n in range(2):  # 128-element halves
                    ql = o + 64 * n
                    qh = o + 128 + 32 * n
                    sc = o + 192 + 8 * n
                    e = b * 256 + 128 * n
                    for h in range(2):  # lanes 0..15 and 16..31 have their own 4 scales
                        s1 = d * np.float32(np.int8(w[r, sc + h]))
                        s2 = d * np.float32(np.int8(w[r, sc + h + 2]))
                        s3 = d * np.float32(np.int8(w[r, sc + h + 4]))
                        s4 = d * np.float32(np.int8(w[r, sc + h + 6]))
                        for l in range(16 * h, 16 * h + 16):
                            a = w[r, ql + l]
                            a2 = w[r, ql + 32 + l]
                            hh = w[r, qh + l]
                            # dequant._dq_q6_k's unpacking, kept inline: through uint8
                            # here (32-bit lanes), int32 there, different fastmath
                            u1 = np.uint8((a & 0xF) | ((hh & 3) << 4))
                            u2 = np.uint8((a2 & 0xF) | (((hh >> 2) & 3) << 4))
                            u3 = np.uint8((a >> 4) | (((hh >> 4) & 3) << 4))
                            u4 = np.uint8((a2 >> 4) | (((hh >> 6) & 3) << 4))
                            q1 = np.float32(u1) - np.float32(32.0)
                            q2 = np.float32(u2) - np.float32(32.0)
                            q3 = np.float32(u3) - np.float32(32.0)
                            q4 = np.float32(u4) - np.float32(32.0)
                            acc[l] += (s1 * (q1 * xq[e + l])
                                       + s2 * (q2 * xq[e + 32 + l])
                                       + s3 * (q3 * xq[e + 64 + l])
                                       + s4 * (q4 * xq[e + 96 + l]))
            y[r] = _lane_sum(acc)


# --- float weights --------------------------------------------------------------------

@registers("float_matvec", T.F16)
@njit(parallel=True, fastmath=_FM_ORDERED, cache=True)
def _mv_f16(w16, wf, x, y):
    """w16 uint16[n_out, n_in] (IEEE halves); x already rounded to f16 as ggml does."""
    n_out, n_in = w16.shape
    nfull = n_in // 32
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = 2 * r * n_in + PREFETCH
            for b in range(nfull):
                prefetch(wf, pf + 64 * b)
                for j in range(32):
                    acc[j] += f16_to_f32(w16[r, b * 32 + j]) * x[b * 32 + j]
            t = _lane_sum(acc)
            for j in range(nfull * 32, n_in):
                t += f16_to_f32(w16[r, j]) * x[j]
            y[r] = t


@njit(inline="always")
def _bf16(u16):
    return u32_as_f32(np.uint32(u16) << np.uint32(16))


@registers("float_matvec", T.BF16)
@njit(parallel=True, fastmath=_FM_ORDERED, cache=True)
def _mv_bf16(w16, wf, x, y):
    """w16 uint16[n_out, n_in] (bfloat16 bits); x already rounded to bf16."""
    n_out, n_in = w16.shape
    nfull = n_in // 32
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = 2 * r * n_in + PREFETCH
            for b in range(nfull):
                prefetch(wf, pf + 64 * b)
                for j in range(32):
                    acc[j] += _bf16(w16[r, b * 32 + j]) * x[b * 32 + j]
            t = _lane_sum(acc)
            for j in range(nfull * 32, n_in):
                t += _bf16(w16[r, j]) * x[j]
            y[r] = t


@registers("float_matvec", T.F32)
@njit(parallel=True, fastmath=_FM_ORDERED, cache=True)
def _mv_f32(w32, wf, x, y):
    """w32 f32[n_out, n_in]."""
    n_out, n_in = w32.shape
    nfull = n_in // 32
    for c in prange((n_out + ROWS - 1) // ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            _zero(acc)
            pf = 4 * r * n_in + PREFETCH
            for b in range(nfull):
                prefetch(wf, pf + 128 * b)
                prefetch(wf, pf + 128 * b + 64)
                for j in range(32):
                    acc[j] += w32[r, b * 32 + j] * x[b * 32 + j]
            t = _lane_sum(acc)
            for j in range(nfull * 32, n_in):
                t += w32[r, j] * x[j]
            y[r] = t


# --- dispatch -------------------------------------------------------------------------

# format -> its float kernel above (registered in its record): every format has one;
# the generic level runs them except where it has IR kernels (below).  Tests run each
# against the reference.
FLOAT_KERNELS = {t: f.kernels.float_matvec for t, f in FORMATS.items()}
# (format, instruction-set level) -> kernel, from the records' `int_levels`: an
# `IntKernels` (compiled on first use) for each quantized format at each of its integer
# levels; at the generic level its portable IR kernels where LLVM converts f16
# natively (isa.GENERIC_IR; over a sweep, haswell code, Q8_0 1.3x its float kernel,
# Q6_K 2.0x, Q5_K 3x and more: docs/BENCHMARKS.md#generic-ir-kernels), else the float
# kernels.  `fucina info --kernels` prints it.
KERNELS = {(t, isa.GENERIC): k for t, k in FLOAT_KERNELS.items()}
KERNELS.update({(t, lv): IntKernels(t, lv) for t, f in FORMATS.items()
                for lv in f.kernels.int_levels if lv != isa.GENERIC or isa.GENERIC_IR})
# What may be dispatched: only the levels this CPU runs (isa.USABLE), so no illegal
# instruction ever is.  Keyed by (int, str): an Enum's __hash__ is a Python-level call,
# ~0.1 us per matvec.
_BY_VALUE = {(int(t), lv): k for (t, lv), k in KERNELS.items() if lv in isa.USABLE}
# float kernels that take the quants as int16 (`q16`)
_X16 = {int(t) for t, f in FORMATS.items() if f.kernels.float_q16}


def kernel_for(ggml_type, level: str | None = None):
    """(level, kernel) `matvec` runs for a format at `level` (default: isa.level)."""
    lv = isa.level if level is None else level
    k = _BY_VALUE.get((int(ggml_type), lv))
    if k is None:
        lv, k = isa.GENERIC, _BY_VALUE[(int(ggml_type), isa.GENERIC)]
    return lv, k


def _dispatch(t_value: int):
    """The kernel `matvec` runs for the format numbered t_value at `isa.level`: the
    level's own, or the generic one where the level has none."""
    kernel = _BY_VALUE.get((t_value, isa.level))
    return kernel if kernel is not None else _BY_VALUE[(t_value, isa.GENERIC)]


def matvec_quantized(w, qa, out: np.ndarray, row: int = 0) -> np.ndarray:
    """out f32[n_out] = W @ x, x = row `row` of activations from `quantize_activations`.

    Lets a caller quantize one activation vector once and reuse it for several matrices
    with the same `vec_dot_type` (e.g. the Q, K and V projections of one layer).
    Shapes are not checked.
    """
    t = w.ggml_type
    if qa.kind is not w.vec_dot_type and qa.kind != w.vec_dot_type:  # `is`: == is slow
        raise ValueError(f"{w.name!r} ({t.name}) needs activations as "
                         f"{w.vec_dot_type.name}, got {qa.kind.name}")
    kernel = _dispatch(t._value_)
    if type(kernel) is IntKernels:       # every part of a MultiMatrix in one call
        fns = kernel.fns if kernel.fns is not None else kernel.load()
        parts, rb = w.kernel_parts()
        run(fns, parts, rb, qa.qi, qa.d, qa.side_bytes, row, out, 0, NO_FLOATS)
    elif isinstance(w, MultiMatrix):
        for part, (a, b) in zip(w.parts, w.bounds):
            matvec_quantized(part, qa, out[a:b], row)
    elif qa.d is None:                   # F32 / F16 / BF16: plain numbers on both sides
        kernel(w.wv, w.flat, qa.q[row], out)
    elif t._value_ in _X16:              # generic integer kernels: int16 quants
        kernel(w.raw, w.flat, qa.q16[row], qa.d[row], qa.side[row], out)
    else:                                # the float kernels read the quants as floats
        kernel(w.raw, w.flat, qa.q[row], qa.d[row], qa.side[row], out)
    return out


def matvec(w, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y f32[n_out] = W @ x for one activation vector x f32[n_in], as llama.cpp does.

    `out`, if given, must be a C-contiguous float32 array of n_out elements; it is
    returned.  With an integer kernel, x goes to the kernel call as floats and is
    quantized there (`_int.run`); else through `quantize_activations` first.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape != (w.n_in,):
        raise ValueError(f"{w.name!r}: x has shape {x.shape}, expected ({w.n_in},)")
    if out is None:
        out = np.empty(w.n_out, np.float32)  # [n_out]
    elif (out.shape != (w.n_out,) or out.dtype != np.float32
          or not out.flags.c_contiguous):
        raise ValueError(f"{w.name!r}: out must be C-contiguous float32 of shape "
                         f"({w.n_out},)")
    kernel = _dispatch(w.ggml_type._value_)
    if type(kernel) is not IntKernels:
        return matvec_quantized(w, quantize_activations(x, w.vec_dot_type), out)
    flags = x.flags
    if not (flags.c_contiguous and flags.writeable):  # run has one signature
        x = x.copy()
    run(*_run_args(kernel, w), 0, out, 0, x.reshape(1, w.n_in))
    return out


def bound_matvec(w):
    """`matvec(w, x, out)` with all that depends on w alone looked up once, at the
    current `isa.level`: a function f(x, out) of x f32[1, n_in] (a C-contiguous,
    writeable buffer: nothing is checked) and out f32[n_out], for a caller that runs
    the same matrices again and again with buffers of its own (weights.py).  An integer
    kernel is then one `run` call with every argument ready: matvec's checks, dispatch
    and lookups cost ~3 us a call on this VM, ~5% of a SmolLM2 decode step.  The
    function quantizes x into this thread's scratch: call it from the thread that
    bound it."""
    kernel = _dispatch(w.ggml_type._value_)
    if type(kernel) is not IntKernels:
        return lambda x, out: matvec(w, x[0], out)
    fns, parts, rb, qi, d, side = _run_args(kernel, w)
    return lambda x, out: run(fns, parts, rb, qi, d, side, 0, out, 0, x)


def _run_args(kernel, w) -> tuple:
    """`run`'s leading arguments for a decode matvec of w with the integer kernel:
    fns, the weight parts, the row bytes, and the scratch the vector is quantized
    into (quants, scales, the side array as bytes)."""
    fns = kernel.fns if kernel.fns is not None else kernel.load()
    parts, rb = w.kernel_parts()
    qi, d, s_bytes, d_bytes = _scratch(w.n_in)
    return fns, parts, rb, qi, d, s_bytes if kernel.own_side else d_bytes


def _scratch(n: int) -> tuple:
    """What `run`'s quantizer fills in decode, for an n-value vector: quants int8[1, n],
    scales f32[1, n/32] (Q8_K: n/256 of them) and the side array as bytes (Q8_1's s or
    Q8_K's bsum32, a float32[1, n/32] of their own; Q8_0's is d itself).  Reused from
    call to call: fresh arrays and their byte views cost ~2.6 us a matvec on this VM
    (np.empty ~0.7 us).  One set per thread: `run`'s parallel region lets another
    Python thread run, and two decodes quantizing into one scratch gave wrong logits
    (tests/test_workspace.py, two threads decoding at once)."""
    per_thread = getattr(_tls, "scratch", None)
    if per_thread is None:
        per_thread = _tls.scratch = {}
    got = per_thread.get(n)
    if got is None:
        d = np.empty((1, n // 32), np.float32)
        side = np.empty((1, n // 32), np.float32)
        got = per_thread[n] = (np.empty((1, n), np.int8), d, side.view(np.uint8),
                               d.view(np.uint8))
    return got


_tls = threading.local()
