"""AVX-512 VNNI integer kernels, one weight row x one activation vector (`matvec`).

Why.  The float kernels (matvec.py) widen every quant to float32, ~3.5 vector
instructions per 8 weights, and top out at 7-12 GB/s for the 4/5/6-bit formats, below
what memory streams (~25 GB/s on 2 threads).  ggml multiplies the bytes themselves:
`vpdpbusd` adds 4 adjacent u8 x s8 products into each int32 lane, 64 multiply-adds per
zmm instruction.  With it, Q4_K decode went from 19 to 31 tok/s (whole model, measured
2026-11-29, docs/BENCHMARKS.md#vnni-integer-kernels).

How each format maps onto vpdpbusd (one operand must be unsigned):
* Q4_K / Q5_K: the quants are unsigned nibbles (+16 for the 5th bit).  A lane holds at
  most 4 * 31 * 127 < 2^15, so two dpbusd results are packed to int16 (vpackssdw: no
  saturation possible) and one vpdpwssd multiplies them by their 6-bit sub-block scales
  into the super-block's int32 sum.  Mins as in ggml: `m_sub * bsum_x[sub]` (vpmaddwd)
  times `dmin_w * d_x`, into a second float accumulator.  Q4_K runs on zmm with the
  activations permuted once per call to its nibble order (`_interleave_64`); Q5_K on ymm
  (its extra 5th-bit shifts lost on zmm).
* Q6_K / Q4_0 / Q5_0 / Q8_0: the quants are stored, or made (Q8_0: xor 0x80), unsigned
  as u = q + off (off = 32, 8, 16, 128).  Every dpbusd lane starts from -off * (sum of
  its 4 activations), an int32 array made once per call (`_lane_offsets`), so each lane
  ends as the exact integer sum of its 4 products q * x -- the lane integers ggml's AVX2
  code forms.  (Putting a whole block's offset into lane 0 gives the same total, but an
  all-zero Q8_0 block then came out as 1e-5 instead of 0: tests/test_quant.py's
  extreme-value test.)  The 32-element formats take two blocks per zmm iteration.
* Then per (super-)block `acc += d * float(lane)` lane-wise, d = f16(d_w) * d_x (ggml's
  `_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc)`), and one tree sum per row.
  Integer sums are exact; only the order of float additions differs from llama.cpp.

The kernels at the end (`mv_*`, table `MV_KERNELS`) run one row intrinsic per output row
inside a `prange`; matvec.py dispatches to them where `isa.AVX512VNNI` is usable.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils

from ._ir import (F16, F32, I8, I16, I32, I64, V, block_at, const_vec, dpbusd, dpwssd,
                  fma, fold16, hsum_f32, i64, load, load_f16, packssdw, pmaddwd,
                  prefetch, row_intrinsic, shuffle, splat)
from .formats import FORMATS

# --- Q4_K / Q5_K ----------------------------------------------------------------------


def _pairs(idx_list, zero_idx):
    """Byte shuffle mask of int32 lanes (byte idx, 0, 0, 0): an s16 value, a 0 word."""
    m = []
    for i in idx_list:
        m += [i, zero_idx, zero_idx, zero_idx]
    return m


def _pairs_w(idx_list, zero_idx):
    """Byte shuffle mask of int16 words (byte idx, 0)."""
    m = []
    for i in idx_list:
        m += [i, zero_idx]
    return m


def q4k_scales(b, raw16):
    """<16 x i8> sc[0..7], m[0..7] from the first 16 bytes of a Q4_K/Q5_K block (d,
    dmin, scales[12]): two byte shuffles, shifts and masks, measured faster than
    ggml's scalar `utmp` arithmetic (docs/BENCHMARKS.md#vnni-integer-kernels)."""
    z = ir.Constant(V(I8, 16), None)
    a = shuffle(b, raw16, z, [4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15])
    a = b.bitcast(a, V(I32, 4))
    a = b.and_(b.lshr(a, const_vec(I32, 4, [0, 0, 0, 4])),
               const_vec(I32, 4, [0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    h = shuffle(b, raw16, z, [16] * 4 + [4, 5, 6, 7] + [16] * 4 + [8, 9, 10, 11])
    h = b.and_(b.lshr(b.bitcast(h, V(I32, 4)), const_vec(I32, 4, 2)),
               const_vec(I32, 4, 0x30303030))
    return b.bitcast(b.or_(a, h), V(I8, 16))


def q4k_d_dmin(b, raw16):
    """<2 x f32> (d, dmin) of a Q4_K/Q5_K block from its first 16 bytes."""
    h = b.bitcast(raw16, V(F16, 8))
    return b.fpext(shuffle(b, h, ir.Constant(V(F16, 8), None), [0, 1]), V(F32, 2))


def q4k_min_words(b, sm):
    """<16 x i16> (m_s, 0) pairs: the 8 sub-block mins, for vpmaddwd with bsum32."""
    z16 = ir.Constant(V(I8, 16), None)
    return b.bitcast(shuffle(b, sm, z16, _pairs(range(8, 16), 16)), V(I16, 16))


def q5k_high_bits(b, p, width):
    """Q5_K's qh[32], repeated per 256 bits, as <n x i64> (for `q4k_quants`)."""
    qh = load(b, p, i64(FORMATS[T.Q5_K].qh_offset), V(I8, 32))
    qhh = shuffle(b, qh, qh, list(range(32)) * (width // 256))
    return b.bitcast(qhh, V(I64, width // 64))


def _shift_to_bit4(b, v64, bits):
    """<n x i64> v64 shifted per 256-bit part h: bit bits[h] of each byte to bit 4."""
    n = v64.type.count
    left = [max(0, 4 - bits[h // 4]) for h in range(n)]
    right = [max(0, bits[h // 4] - 4) for h in range(n)]
    if any(right):
        v64 = b.lshr(v64, const_vec(I64, n, right))
    if any(left):
        v64 = b.shl(v64, const_vec(I64, n, left))
    return v64


def q4k_quants(b, p, j, width, qhh):
    """Quant vector j of a Q4_K (qhh None) or Q5_K block: (lo, hi, sub_lo, sub_hi), the
    low- and high-nibble values (+16 for Q5_K's 5th bits) and their sub-blocks per
    32-byte half (zmm: 64 quant bytes = sub-blocks 4j, 4j+2 low, 4j+1, 4j+3 high)."""
    nb = width // 8
    fmt = FORMATS[T.Q4_K if qhh is None else T.Q5_K]
    q = load(b, p, i64(fmt.qs_offset + nb * j), V(I8, nb))
    m4 = const_vec(I8, nb, 0x0F)
    lo = b.and_(q, m4)
    hi = b.and_(b.lshr(q, const_vec(I8, nb, 4)), m4)
    sub_lo = [4 * j, 4 * j + 2] if width == 512 else [2 * j]
    sub_hi = [4 * j + 1, 4 * j + 3] if width == 512 else [2 * j + 1]
    if qhh is not None:
        m10 = const_vec(I8, nb, 0x10)
        h_lo = b.bitcast(_shift_to_bit4(b, qhh, sub_lo), V(I8, nb))
        lo = b.or_(lo, b.and_(h_lo, m10))
        h_hi = b.bitcast(_shift_to_bit4(b, qhh, sub_hi), V(I8, nb))
        hi = b.or_(hi, b.and_(h_hi, m10))
    return lo, hi, sub_lo, sub_hi


def q4k_scale_words(b, sm, width, sub_lo, sub_hi):
    """The sub-block scales as int16 words in the order of packssdw(dot_lo, dot_hi):
    per 128-bit lane L, 4 words of lo's sub-block then 4 of hi's."""
    idx = []
    for L in range(width // 128):
        h = (L * 4) // 8          # which 32-byte half lane L came from
        idx += [sub_lo[h]] * 4 + [sub_hi[h]] * 4
    return shuffle(b, sm, ir.Constant(V(I8, 16), None), _pairs_w(idx, 16))


def q4k_x(b, x, xo, j, width):
    """The activations matching quant vector j: (x_lo, x_hi).  zmm: x permuted per 128
    as [0:32, 64:96, 32:64, 96:128] (`_interleave_64`); ymm: natural order."""
    if width == 512:
        return (load(b, x, b.add(xo, i64(128 * j)), V(I8, 64)),
                load(b, x, b.add(xo, i64(128 * j + 64)), V(I8, 64)))
    return (load(b, x, b.add(xo, i64(64 * j)), V(I8, 32)),
            load(b, x, b.add(xo, i64(64 * j + 32)), V(I8, 32)))


def q4k_row(b, w, x, xd, xbs, nsb, pf, width, five=False):
    """Q4_K (five: Q5_K) row . Q8_K activations, on zmm (width 512) or ymm (256)."""
    bpb = FORMATS[T.Q5_K if five else T.Q4_K].block_bytes
    nl = width // 32                       # int32 lanes
    zero = ir.Constant(V(I32, nl), None)
    acc_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, nl), None))
    accm_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, 8), None))
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        p = block_at(b, w, i, bpb, pf, 3)
        xs = load(b, xd, b.mul(i, i64(4)), F32)
        qhh = q5k_high_bits(b, p, width) if five else None
        raw16 = load(b, p, None, V(I8, 16))
        dd = b.fmul(q4k_d_dmin(b, raw16), splat(b, xs, 2))
        d = b.extract_element(dd, ir.Constant(I32, 0))
        dmin = b.extract_element(dd, ir.Constant(I32, 1))
        sm = q4k_scales(b, raw16)
        # mins: sum_s m_s * bsum32_s, 8 lanes, accumulated as float with dmin
        mw = q4k_min_words(b, sm)
        bs = load(b, xbs, b.mul(i, i64(32)), V(I32, 8))
        msum = pmaddwd(b, mw, bs)
        accm = b.load(accm_p)
        b.store(fma(b, splat(b, dmin, 8), b.sitofp(msum, V(F32, 8)), accm), accm_p)
        sumi = zero
        xo = b.mul(i, i64(256))
        for j in range(1024 // width):     # quant vectors per super-block
            lo, hi, sub_lo, sub_hi = q4k_quants(b, p, j, width, qhh)
            xlo, xhi = q4k_x(b, x, xo, j, width)
            dlo = dpbusd(b, zero, lo, xlo)
            dhi = dpbusd(b, zero, hi, xhi)
            sc = q4k_scale_words(b, sm, width, sub_lo, sub_hi)
            sumi = dpwssd(b, sumi, packssdw(b, dlo, dhi), sc)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), acc), acc_p)
    acc = b.load(acc_p)
    if nl == 16:
        acc = fold16(b, acc)
    return hsum_f32(b, b.fsub(acc, b.load(accm_p)))


# --- Q6_K -----------------------------------------------------------------------------

def q6k_quants(b, p, n):
    """The 4 ymm of unsigned quants u = q + 32 of 128-element half n of a Q6_K block
    (elements 32k .. 32k+31 of the half in vector k)."""
    fmt = FORMATS[T.Q6_K]
    m4 = const_vec(I8, 32, 0x0F)
    m30 = const_vec(I8, 32, 0x30)
    c4 = const_vec(I8, 32, 4)
    ql0 = load(b, p, i64(fmt.qs_offset + 64 * n), V(I8, 32))
    ql1 = load(b, p, i64(fmt.qs_offset + 64 * n + 32), V(I8, 32))
    qh = b.bitcast(load(b, p, i64(fmt.qh_offset + 32 * n), V(I8, 32)), V(I64, 4))
    hs = [b.bitcast(v, V(I8, 32)) for v in
          (b.shl(qh, const_vec(I64, 4, 4)), b.shl(qh, const_vec(I64, 4, 2)), qh,
           b.lshr(qh, const_vec(I64, 4, 2)))]
    lows = (b.and_(ql0, m4), b.and_(ql1, m4), b.and_(b.lshr(ql0, c4), m4),
            b.and_(b.lshr(ql1, c4), m4))
    return [b.or_(lo, b.and_(h, m30)) for lo, h in zip(lows, hs)]


def q6k_scales(b, p):
    """<16 x i16>: the 16 int8 sub-block scales of a Q6_K block, sign-extended."""
    scales = load(b, p, i64(FORMATS[T.Q6_K].scales_offset), V(I8, 16))
    return b.sext(scales, V(I16, 16))


def q6k_scale_words(b, sc16, n, k):
    """Scale words for packssdw(dot k, dot k+1) of half n: per 128-bit lane L, 4 words
    of vector k's 16-element group, then 4 of vector k+1's."""
    groups = [[8 * n + 2 * kk + lane // 4 for lane in range(8)] for kk in range(4)]
    idx = []
    for L in range(2):
        idx += [groups[k][4 * L]] * 4 + [groups[k + 1][4 * L]] * 4
    return shuffle(b, sc16, ir.Constant(V(I16, 16), None), idx)


def q6k_row(b, w, x, xd, xoff, nsb, pf):
    """Q6_K row . Q8_K activations (ymm, natural order).  xoff int32[n/4] = -32 * (sum
    of the 4 activations of each lane) starts every dpbusd (module docstring)."""
    fmt = FORMATS[T.Q6_K]
    nl = 8
    zero = ir.Constant(V(I32, nl), None)
    acc_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, nl), None))
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        p = block_at(b, w, i, fmt.block_bytes, pf, 4)
        dw = load_f16(b, p, i64(fmt.d_offset))
        d = b.fmul(dw, load(b, xd, b.mul(i, i64(4)), F32))
        sc16 = q6k_scales(b, p)
        sumi = zero
        xo = b.mul(i, i64(256))
        for n in range(2):
            # xoff has one int32 per 4 activations: its byte offset equals the element's
            dots = []
            for k, u in enumerate(q6k_quants(b, p, n)):
                init = load(b, xoff, b.add(xo, i64(128 * n + 32 * k)), V(I32, nl))
                xv = load(b, x, b.add(xo, i64(128 * n + 32 * k)), V(I8, 32))
                dots.append(dpbusd(b, init, u, xv))
            for k in (0, 2):
                scw = q6k_scale_words(b, sc16, n, k)
                sumi = dpwssd(b, sumi, packssdw(b, dots[k], dots[k + 1]), scw)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), acc), acc_p)
    return hsum_f32(b, b.load(acc_p))


# --- 32-element blocks: Q8_0, Q4_0, Q5_0 ----------------------------------------------

def unsigned_offset(t) -> int:
    """off in u = q + off >= 0, the unsigned form of a quant for vpdpbusd: Q8_0's int8
    quants are made unsigned with xor 0x80 (+128); the others are stored that way."""
    return 128 if t == T.Q8_0 else FORMATS[t].zero_point


def blk32_quants(b, p, t, k):
    """<32*k x i8> unsigned quants u = q + off of k consecutive blocks at i8* p."""
    fmt = FORMATS[t]
    bpb, qo = fmt.block_bytes, fmt.qs_offset
    n = 32 * k
    if t == T.Q8_0:
        parts = [load(b, p, i64(bpb * j + qo), V(I8, 32)) for j in range(k)]
        u = parts[0] if k == 1 else shuffle(b, parts[0], parts[1], range(64))
        return b.xor(u, const_vec(I8, n, 0x80))
    parts = [load(b, p, i64(bpb * j + qo), V(I8, 16)) for j in range(k)]
    if k == 1:
        q2 = shuffle(b, parts[0], parts[0], list(range(16)) * 2)
    else:
        mask = list(range(16)) * 2 + list(range(16, 32)) * 2
        q2 = shuffle(b, parts[0], parts[1], mask)
    q2 = b.bitcast(q2, V(I64, n // 8))
    u = b.bitcast(b.lshr(q2, const_vec(I64, n // 8, [0, 0, 4, 4] * k)), V(I8, n))
    u = b.and_(u, const_vec(I8, n, 0x0F))
    if t == T.Q5_0:
        hs = [load(b, p, i64(bpb * j + fmt.qh_offset), I32) for j in range(k)]
        if k == 1:
            bits = b.bitcast(hs[0], V(ir.IntType(1), 32))
        else:
            h64 = b.or_(b.zext(hs[0], I64), b.shl(b.zext(hs[1], I64), i64(32)))
            bits = b.bitcast(h64, V(ir.IntType(1), 64))
        zero = ir.Constant(V(I8, n), None)
        u = b.or_(u, b.select(bits, const_vec(I8, n, 0x10), zero))
    return u


def blk32_pair(b, w, index, bpb, pf):
    """Pair `index` of blocks of a row: (i, p, dw) with i = 2 * index its first block,
    p an i8* to it (the pair's cache lines prefetched pf bytes ahead) and dw the
    <2 x f32> scales d_w of its two blocks."""
    i = b.mul(index, i64(2))
    o = b.mul(i, i64(bpb))
    prefetch(b, w, b.add(o, pf))
    if 2 * bpb > 64:
        prefetch(b, w, b.add(b.add(o, pf), i64(64)))
    p = b.gep(w, [o])
    dv = ir.Constant(V(I16, 2), ir.Undefined)
    for j in range(2):
        dw = load(b, p, i64(bpb * j), I16)
        dv = b.insert_element(dv, dw, ir.Constant(I32, j))
    return i, p, b.fpext(b.bitcast(dv, V(F16, 2)), V(F32, 2))


def blk32_row(b, w, x, xd, xoff, nb, pf, t):
    """Row . Q8_0 activations for t in Q8_0 / Q4_0 / Q5_0:
    y = sum_b (d_w d_x)[b] * sum_j (u_j - off) x_j, with u = q + off >= 0.  xoff
    int32[n/4] = -off * (sum of the 4 activations of each lane) starts every dpbusd.
    Two blocks per zmm iteration; an odd last block goes through ymm."""
    bpb = FORMATS[t].block_bytes
    acc_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, 8), None))
    acc2_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, 16), None))
    npair = b.sdiv(nb, i64(2))
    with cgutils.for_range(b, npair) as loop:
        i, p, dv = blk32_pair(b, w, loop.index, bpb, pf)
        dv = b.fmul(dv, load(b, xd, b.mul(i, i64(4)), V(F32, 2)))
        dv = shuffle(b, dv, dv, [0] * 8 + [1] * 8)
        u = blk32_quants(b, p, t, 2)
        init = load(b, xoff, b.mul(i, i64(32)), V(I32, 16))
        xv = load(b, x, b.mul(i, i64(32)), V(I8, 64))
        dot = dpbusd(b, init, u, xv)
        acc = b.load(acc2_p)
        b.store(fma(b, dv, b.sitofp(dot, V(F32, 16)), acc), acc2_p)
    b.store(fold16(b, b.load(acc2_p)), acc_p)
    with cgutils.for_range(b, nb, start=b.mul(npair, i64(2))) as loop:
        i = loop.index
        o = b.mul(i, i64(bpb))
        prefetch(b, w, b.add(o, pf))
        p = b.gep(w, [o])
        d = b.fmul(load_f16(b, p, None), load(b, xd, b.mul(i, i64(4)), F32))
        u = blk32_quants(b, p, t, 1)
        init = load(b, xoff, b.mul(i, i64(32)), V(I32, 8))
        xv = load(b, x, b.mul(i, i64(32)), V(I8, 32))
        dot = dpbusd(b, init, u, xv)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, 8), b.sitofp(dot, V(F32, 8)), acc), acc_p)
    return hsum_f32(b, b.load(acc_p))


# --- the row intrinsics and the parallel kernels --------------------------------------
# Q4_K on zmm, Q5_K and Q6_K on ymm: the faster form of each on this machine
# (docs/BENCHMARKS.md#vnni-integer-kernels).

q4k_row_vnni = row_intrinsic(q4k_row, width=512)
q5k_row_vnni = row_intrinsic(q4k_row, width=256, five=True)
q6k_row_vnni = row_intrinsic(q6k_row)
q8_0_row_vnni = row_intrinsic(blk32_row, T.Q8_0)
q4_0_row_vnni = row_intrinsic(blk32_row, T.Q4_0)
q5_0_row_vnni = row_intrinsic(blk32_row, T.Q5_0)

ROWS = 16          # output rows per parallel chunk
PREFETCH = 2048    # bytes ahead in the weight stream (docs/BENCHMARKS.md#prefetch)

# The mv_* kernels share the signature (w, wf, xi, xd, xs, y): w uint8[n_out, row_bytes]
# and wf the same bytes flat, xi int8[n_in] the quantized activations, xd f32 their
# block scales, xs the activations' side array (`QuantizedActivations.side`: Q8_K's
# bsum32; unused by the Q8_0-activation formats), y f32[n_out].  Their block sizes are
# FORMATS' (literals inside numba code).  They repeat one loop skeleton on purpose:
# a factory closing over the row intrinsic would not be reused from numba's disk cache
# (each process recompiles closure-made kernels), and every reader pays compile time.


@njit(inline="always")
def _interleave_64(xi, x8):
    """x8[128 g + ...] = xi[128 g + (0:32, 64:96, 32:64, 96:128)]: the order of Q4_K's
    low and high nibbles when 64 quant bytes (two 32-byte chunks) are unpacked at
    once."""
    for g in range(xi.size // 128):
        o = 128 * g
        for l in range(32):
            x8[o + l] = xi[o + l]
            x8[o + 32 + l] = xi[o + 64 + l]
            x8[o + 64 + l] = xi[o + 32 + l]
            x8[o + 96 + l] = xi[o + 96 + l]


@njit(inline="always")
def _lane_offsets(xi, off):
    """int32[n/4]: -off * (xi[4k] + ... + xi[4k+3]), the start value of dpbusd lane k
    when the weight quants are stored as u = q + off (the lane ends as sum q x)."""
    xoff = np.empty(xi.size // 4, np.int32)
    for k in range(xi.size // 4):
        xoff[k] = np.int32(-off) * (np.int32(xi[4 * k]) + np.int32(xi[4 * k + 1])
                                    + np.int32(xi[4 * k + 2]) + np.int32(xi[4 * k + 3]))
    return xoff


@njit(parallel=True, cache=True)
def mv_q4_k(w, wf, xi, xd, xs, y):
    """FORMATS[Q4_K] (144-byte blocks); xs = bsum32.  zmm rows on a copy of xi in the
    order of the nibbles."""
    n_out, rb = w.shape
    nsb = rb // 144
    x8 = np.empty(nsb * 256, np.int8)
    _interleave_64(xi, x8)
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            y[r] = q4k_row_vnni(wf, r * rb, nsb, x8, xd, xs, PREFETCH)


@njit(parallel=True, cache=True)
def mv_q5_k(w, wf, xi, xd, xs, y):
    """FORMATS[Q5_K] (176-byte blocks); xs = bsum32.  ymm, natural activation order."""
    n_out, rb = w.shape
    nsb = rb // 176
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            y[r] = q5k_row_vnni(wf, r * rb, nsb, xi, xd, xs, PREFETCH)


@njit(parallel=True, cache=True)
def mv_q6_k(w, wf, xi, xd, xs, y):
    """FORMATS[Q6_K] (210-byte blocks): u = q + 32, lanes start at -32 * (their 4 x)."""
    n_out, rb = w.shape
    nsb = rb // 210
    xoff = _lane_offsets(xi, 32)
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            y[r] = q6k_row_vnni(wf, r * rb, nsb, xi, xd, xoff, PREFETCH)


@njit(parallel=True, cache=True)
def mv_q8_0(w, wf, xi, xd, xs, y):
    """FORMATS[Q8_0] (34-byte blocks): u = q ^ 0x80 = q + 128, lanes start at
    -128 * (their 4 activations)."""
    n_out, rb = w.shape
    nb = rb // 34
    xoff = _lane_offsets(xi, 128)
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            y[r] = q8_0_row_vnni(wf, r * rb, nb, xi, xd, xoff, PREFETCH)


@njit(parallel=True, cache=True)
def mv_q4_0(w, wf, xi, xd, xs, y):
    """FORMATS[Q4_0] (18-byte blocks): the nibbles are u = q + 8 already."""
    n_out, rb = w.shape
    nb = rb // 18
    xoff = _lane_offsets(xi, 8)
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            y[r] = q4_0_row_vnni(wf, r * rb, nb, xi, xd, xoff, PREFETCH)


@njit(parallel=True, cache=True)
def mv_q5_0(w, wf, xi, xd, xs, y):
    """FORMATS[Q5_0] (22-byte blocks): nibble | 5th bit is u = q + 16 already."""
    n_out, rb = w.shape
    nb = rb // 22
    xoff = _lane_offsets(xi, 16)
    for c in prange((n_out + ROWS - 1) // ROWS):
        for r in range(c * ROWS, min(n_out, c * ROWS + ROWS)):
            y[r] = q5_0_row_vnni(wf, r * rb, nb, xi, xd, xoff, PREFETCH)


MV_KERNELS = {T.Q4_K: mv_q4_k, T.Q5_K: mv_q5_k, T.Q6_K: mv_q6_k,
              T.Q8_0: mv_q8_0, T.Q4_0: mv_q4_0, T.Q5_0: mv_q5_0}
