"""AVX-512 VNNI integer kernels, one weight row x a tile of activation rows (`matmul`).

The row builders of _vnni_matvec.py dot one weight row with one activation vector.  The
builders here dot it with up to TILE (8) activation rows: each weight block is loaded
and unpacked once, then multiplied with every row of the tile, so a weight row streams
from memory once per tile instead of once per row.  That took short prefill (pp16, Q4_K)
from 40 to 165 tok/s (measured 2026-11-29, docs/BENCHMARKS.md#multi-row-kernels).

Per activation row the float work is the one-row builder's, instruction for instruction
(same lanes, same `d * float(lane)` fma per block, same final tree sum), and the integer
lane sums are equal, so row i of the result is bit-identical to `matvec` of row i
(tests/test_quant.py asserts equality): N streams decoded as one batch give exactly the
tokens of N single decodes.  What differs is where the formats with an offset
(u = q + off) correct their lanes:

    one-row:  lane = dpbusd(xoff, u, x)        xoff = -off * (sum of the lane's 4 x)
    tile:     lane = dpbusd(init, x ^ 0x80, q)  q = u - off signed, x + 128 unsigned,
              init = 512 * off - 128 * (sum of the lane's 4 u)
                   = dpbusd(512 * off, u, -128)

i.e. the correction moves from the activation side (an int32 array as large as x, read
per row) to the weight side (one extra vpdpbusd per weight vector, shared by the tile).
Both leave the exact sum_j (u_j - off) x_j in the lane.  The activations are stored once
per call as x + 128 (`_xor80`), and for Q4_K's zmm form in its nibble order.

The kernels at the end (`mm_*`, table `MM_KERNELS`) take all parts of a MultiMatrix in
one call (q/k/v: one parallel region and one activation pass instead of three), prange
over chunks of ROWS weight rows, and pass the tiles over each chunk while it sits in L1.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils

from ._ir import (F32, I8, I32, TILE, V, block_at, const_vec, dpbusd, dpwssd, fma,
                  fold16, hsum_f32, i64, ld, load, load_f16, packssdw, pmaddwd,
                  prefetch, rows_intrinsic, shuffle, splat, st)
from ._vnni_matvec import (PREFETCH, ROWS, _interleave_64, blk32_pair, blk32_quants,
                           q4k_d_dmin, q4k_min_words, q4k_quants, q4k_scale_words,
                           q4k_scales, q4k_x, q5k_high_bits, q6k_quants,
                           q6k_scale_words, q6k_scales, unsigned_offset)
from .formats import FORMATS


def q4k_rows(b, w, nsb, tile, pf, rows, width, five=False):
    """q4k_row for a tile: the quants, scales and mins of each super-block are unpacked
    once, then each row does its dpbusd / dpwssd and its two float accumulations as
    q4k_row does.  The rows' 8-lane mins accumulators live in memory (volatile): all in
    registers, LLVM spilled constants in the loop and Q4_K streamed 15.4 -> 13.3 GB/s
    at m = 2 (docs/BENCHMARKS.md#multi-row-kernels)."""
    bpb = FORMATS[T.Q5_K if five else T.Q4_K].block_bytes
    nl = width // 32
    zero = ir.Constant(V(I32, nl), None)
    acc = rows.acc(b, V(F32, nl))
    accm = rows.acc(b, V(F32, 8), memory=True)

    def init(r, k):
        b.store(ir.Constant(V(F32, nl), None), acc(b, k))
        st(b, ir.Constant(V(F32, 8), None), accm(b, k))
    rows.each(b, init)
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        p = block_at(b, w, i, bpb, pf, 3)
        qhh = q5k_high_bits(b, p, width) if five else None
        raw16 = load(b, p, None, V(I8, 16))
        ddw = q4k_d_dmin(b, raw16)
        sm = q4k_scales(b, raw16)
        mw = q4k_min_words(b, sm)
        nvec = 1024 // width
        los, his, scs = [], [], []
        for j in range(nvec):
            lo, hi, sub_lo, sub_hi = q4k_quants(b, p, j, width, qhh)
            los.append(lo)
            his.append(hi)
            scs.append(q4k_scale_words(b, sm, width, sub_lo, sub_hi))
        xo = b.mul(i, i64(256))

        def row(r, k):
            x, xd, xbs = tile.ptrs(b, r)
            xs = load(b, xd, b.mul(i, i64(4)), F32)
            dd = b.fmul(ddw, splat(b, xs, 2))
            d = b.extract_element(dd, ir.Constant(I32, 0))
            dmin = b.extract_element(dd, ir.Constant(I32, 1))
            bs = load(b, xbs, b.mul(i, i64(32)), V(I32, 8))
            msum = pmaddwd(b, mw, bs)
            pm = accm(b, k)
            st(b, fma(b, splat(b, dmin, 8), b.sitofp(msum, V(F32, 8)), ld(b, pm)), pm)
            sumi = zero
            for j in range(nvec):
                xlo, xhi = q4k_x(b, x, xo, j, width)
                dlo = dpbusd(b, zero, los[j], xlo)
                dhi = dpbusd(b, zero, his[j], xhi)
                sumi = dpwssd(b, sumi, packssdw(b, dlo, dhi), scs[j])
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), b.load(pa)), pa)
        rows.each(b, row)

    def result(r, k):
        a = b.load(acc(b, k))
        if nl == 16:
            a = fold16(b, a)
        return hsum_f32(b, b.fsub(a, ld(b, accm(b, k))))
    rows.finish(b, result)


def _offset_init(b, u, off):
    """<n/4 x i32> 512 * off - 128 * (sum of each lane's 4 unsigned quants u): the start
    of a dpbusd of (x + 128) with q = u - off that leaves the exact sum_j q_j x_j."""
    n = u.type.count // 4
    return dpbusd(b, const_vec(I32, n, 512 * off), u, const_vec(I8, 4 * n, -128))


def q6k_rows(b, w, nsb, tile, pf, rows):
    """q6k_row for a tile of activation rows stored as x + 128 (module docstring)."""
    fmt = FORMATS[T.Q6_K]
    off = unsigned_offset(T.Q6_K)
    nl = 8
    zero = ir.Constant(V(I32, nl), None)
    acc = rows.acc(b, V(F32, nl))
    rows.each(b, lambda r, k: b.store(ir.Constant(V(F32, nl), None), acc(b, k)))
    c32 = const_vec(I8, 32, off)
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        p = block_at(b, w, i, fmt.block_bytes, pf, 4)
        dw = load_f16(b, p, i64(fmt.d_offset))
        sc16 = q6k_scales(b, p)
        qv, inits, scw = [], [], []
        for n in range(2):
            for u in q6k_quants(b, p, n):
                qv.append(b.sub(u, c32))
                inits.append(_offset_init(b, u, off))
            for k in (0, 2):
                scw.append(q6k_scale_words(b, sc16, n, k))
        xo = b.mul(i, i64(256))

        def row(r, k):
            x, xd, _ = tile.ptrs(b, r)
            d = b.fmul(dw, load(b, xd, b.mul(i, i64(4)), F32))
            sumi = zero
            for v in range(0, 8, 2):
                dots = [dpbusd(b, inits[v + h],
                               load(b, x, b.add(xo, i64(32 * (v + h))), V(I8, 32)),
                               qv[v + h]) for h in range(2)]
                sumi = dpwssd(b, sumi, packssdw(b, dots[0], dots[1]), scw[v // 2])
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), b.load(pa)), pa)
        rows.each(b, row)
    rows.finish(b, lambda r, k: hsum_f32(b, b.load(acc(b, k))))


def blk32_rows(b, w, nb, tile, pf, rows, t):
    """blk32_row for a tile of activation rows stored as x + 128: two blocks per zmm
    iteration, an odd last block through ymm, each row's float work as in blk32_row."""
    bpb = FORMATS[t].block_bytes
    off = unsigned_offset(t)
    acc = rows.acc(b, V(F32, 8))
    acc2 = rows.acc(b, V(F32, 16))
    rows.each(b, lambda r, k: b.store(ir.Constant(V(F32, 16), None), acc2(b, k)))

    def signed(u, n):
        # Q8_0: u = q ^ 0x80, so the stored bytes are q; the nibble formats subtract off
        if t == T.Q8_0:
            return b.xor(u, const_vec(I8, n, 0x80))
        return b.sub(u, const_vec(I8, n, off))
    npair = b.sdiv(nb, i64(2))
    with cgutils.for_range(b, npair) as loop:
        i, p, dvw = blk32_pair(b, w, loop.index, bpb, pf)
        u = blk32_quants(b, p, t, 2)
        q = signed(u, 64)
        init = _offset_init(b, u, off)

        def row(r, k):
            x, xd, _ = tile.ptrs(b, r)
            dvr = b.fmul(dvw, load(b, xd, b.mul(i, i64(4)), V(F32, 2)))
            dvr = shuffle(b, dvr, dvr, [0] * 8 + [1] * 8)
            dot = dpbusd(b, init, load(b, x, b.mul(i, i64(32)), V(I8, 64)), q)
            pa = acc2(b, k)
            b.store(fma(b, dvr, b.sitofp(dot, V(F32, 16)), b.load(pa)), pa)
        rows.each(b, row)
    rows.each(b, lambda r, k: b.store(fold16(b, b.load(acc2(b, k))), acc(b, k)))
    with cgutils.for_range(b, nb, start=b.mul(npair, i64(2))) as loop:
        i = loop.index
        o = b.mul(i, i64(bpb))
        prefetch(b, w, b.add(o, pf))
        p = b.gep(w, [o])
        dw = load_f16(b, p, None)
        u = blk32_quants(b, p, t, 1)
        q = signed(u, 32)
        init = _offset_init(b, u, off)

        def row1(r, k):
            x, xd, _ = tile.ptrs(b, r)
            d = b.fmul(dw, load(b, xd, b.mul(i, i64(4)), F32))
            dot = dpbusd(b, init, load(b, x, b.mul(i, i64(32)), V(I8, 32)), q)
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, 8), b.sitofp(dot, V(F32, 8)), b.load(pa)), pa)
        rows.each(b, row1)
    rows.finish(b, lambda r, k: hsum_f32(b, b.load(acc(b, k))))


# one intrinsic per format, as in _vnni_matvec.py (the kernels call them as globals)
q4k_rows_vnni = rows_intrinsic(q4k_rows, width=512)
q5k_rows_vnni = rows_intrinsic(q4k_rows, width=256, five=True)
q6k_rows_vnni = rows_intrinsic(q6k_rows)
q8_0_rows_vnni = rows_intrinsic(blk32_rows, T.Q8_0)
q4_0_rows_vnni = rows_intrinsic(blk32_rows, T.Q4_0)
q5_0_rows_vnni = rows_intrinsic(blk32_rows, T.Q5_0)


# --- the parallel kernels -------------------------------------------------------------
# mm_*(parts, rb, xi, xd, xs, y): y f32[m, n_out] = X @ W.T, X given as int8 rows
# xi [m, n_in], their block scales xd and side array xs (`QuantizedActivations.side`);
# parts int64[P, 3] = (address of the weight bytes, rows, first output column) of each
# matrix of a MultiMatrix (P = 1 for a QuantMatrix), all of one format and row length
# (rb bytes).  Block sizes are FORMATS' (literals inside numba code).  The offset
# formats' builders read no side array: xd stands in for it.  The six kernels repeat
# one loop skeleton on purpose, as the mv_* kernels do (closure-made kernels are not
# reused from numba's disk cache).

@njit(inline="always")
def _chunks(parts):
    """(part, first row) of every chunk of ROWS weight rows, over all parts."""
    nch = 0
    for p in range(parts.shape[0]):
        nch += (parts[p, 1] + ROWS - 1) // ROWS
    cp = np.empty(nch, np.int64)
    cr = np.empty(nch, np.int64)
    c = 0
    for p in range(parts.shape[0]):
        for r0 in range(0, parts[p, 1], ROWS):
            cp[c] = p
            cr[c] = r0
            c += 1
    return cp, cr


@njit(inline="always")
def _xor80(xi):
    """x + 128 as bytes (x ^ 0x80): the unsigned activations of the offset formats."""
    m, n = xi.shape
    xu = np.empty((m, n), np.uint8)
    xb = xi.view(np.uint8)
    for t in range(m):
        for j in range(n):
            xu[t, j] = xb[t, j] ^ np.uint8(0x80)
    return xu


@njit(parallel=True, cache=True)
def mm_q4_k(parts, rb, xi, xd, xs, y):
    """FORMATS[Q4_K]: q4k_rows_vnni (zmm) on activations in Q4_K's nibble order."""
    m, n = xi.shape
    x8 = np.empty((m, n), np.int8)
    for t in range(m):
        _interleave_64(xi[t], x8[t])
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        for t0 in range(0, m, TILE):
            nr = min(TILE, m - t0)
            for r in range(cr[c], r1):
                q4k_rows_vnni(addr, r * rb, rb // 144, x8, xd, xs, t0, nr, y, col + r,
                              PREFETCH)


@njit(parallel=True, cache=True)
def mm_q5_k(parts, rb, xi, xd, xs, y):
    """FORMATS[Q5_K]: q5k_rows_vnni (ymm, natural activation order)."""
    m, n = xi.shape
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        for t0 in range(0, m, TILE):
            nr = min(TILE, m - t0)
            for r in range(cr[c], r1):
                q5k_rows_vnni(addr, r * rb, rb // 176, xi, xd, xs, t0, nr, y, col + r,
                              PREFETCH)


@njit(parallel=True, cache=True)
def mm_q6_k(parts, rb, xi, xd, xs, y):
    """FORMATS[Q6_K]: q6k_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        for t0 in range(0, m, TILE):
            nr = min(TILE, m - t0)
            for r in range(cr[c], r1):
                q6k_rows_vnni(addr, r * rb, rb // 210, xu, xd, xd, t0, nr, y, col + r,
                              PREFETCH)


@njit(parallel=True, cache=True)
def mm_q8_0(parts, rb, xi, xd, xs, y):
    """FORMATS[Q8_0]: q8_0_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        for t0 in range(0, m, TILE):
            nr = min(TILE, m - t0)
            for r in range(cr[c], r1):
                q8_0_rows_vnni(addr, r * rb, rb // 34, xu, xd, xd, t0, nr, y, col + r,
                               PREFETCH)


@njit(parallel=True, cache=True)
def mm_q4_0(parts, rb, xi, xd, xs, y):
    """FORMATS[Q4_0]: q4_0_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        for t0 in range(0, m, TILE):
            nr = min(TILE, m - t0)
            for r in range(cr[c], r1):
                q4_0_rows_vnni(addr, r * rb, rb // 18, xu, xd, xd, t0, nr, y, col + r,
                               PREFETCH)


@njit(parallel=True, cache=True)
def mm_q5_0(parts, rb, xi, xd, xs, y):
    """FORMATS[Q5_0]: q5_0_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + ROWS)
        for t0 in range(0, m, TILE):
            nr = min(TILE, m - t0)
            for r in range(cr[c], r1):
                q5_0_rows_vnni(addr, r * rb, rb // 22, xu, xd, xd, t0, nr, y, col + r,
                               PREFETCH)


MM_KERNELS = {T.Q4_K: mm_q4_k, T.Q5_K: mm_q5_k, T.Q6_K: mm_q6_k,
              T.Q8_0: mm_q8_0, T.Q4_0: mm_q4_0, T.Q5_0: mm_q5_0}
