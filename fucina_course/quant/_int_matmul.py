"""Integer kernels, one weight row x a tile of activation rows (`matmul`), every level.

The row builders of _int_matvec.py dot one weight row with one activation vector.  The
builders here dot it with up to TILE (8) activation rows: each weight block is loaded
and unpacked once, then multiplied with every row of the tile, so a weight row streams
from memory once per tile instead of once per row.  That made short prefill (pp16, Q4_K)
about four times as fast (measured: docs/BENCHMARKS.md#multi-row-tiles).

Per activation row the float work is the one-row builder's, operation for operation
(same lanes, same `d * float(lane)` fma per block, same final tree sum; at avx2 the
same fma per four blocks on their per-block integer totals, `totals4`; for Q4_K / Q5_K
the same fma on each super-block's integer totals, done for the 8 rows as the 8 lanes
of one vector), and the integer sums are equal, so row i of the result is bit-identical
to `matvec` of row i at the same level (tests/test_quant.py asserts equality): N streams
decoded as one batch give exactly the tokens of N single decodes.  What differs is
where the formats with an offset (u = q + off) correct their lanes:

    one-row:  lane = dpbusd(xoff, u, x)        xoff = -off * (sum of the lane's 4 x)
    tile:     lane = dpbusd(init, x ^ 0x80, q)  q = u - off signed, x + 128 unsigned,
              init = 512 * off - 128 * (sum of the lane's 4 u)
                   = dpbusd(512 * off, u, -128)

i.e. the correction moves from the activation side (an int32 array as large as x, read
per row) to the weight side (one extra vpdpbusd per weight vector, shared by the tile).
avx2 does the same with int16 pairs, `vpmaddubsw(x + 128, q) - vpmaddubsw(128, q)`
(|q| <= 32, so no pair saturates), except Q8_0 (|q| up to 128: ggml's sign trick per
row).  Both leave the exact sum_j (u_j - off) x_j in the lane.  The aarch64 levels need
neither: `sdot` multiplies the signed q by x directly ("sdot" form).  The activations are
stored once per call as x + 128 (`prep_xor80`), and for Q4_K's zmm form in its nibble
order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from gguf import GGMLQuantizationType as T
from llvmlite import ir

from . import isa
from ._int_matvec import (blk32_pair, blk32_quants, blk32_scales, blk32_signed,
                          prep_interleave, prep_xor80, q4k_block_floats, q4k_d_dmin,
                          q4k_dot, q4k_min_words, q4k_quants, q4k_result,
                          q4k_scale_words, q4k_scales, q4k_x, q5k_high_bits,
                          q6k_pair_scales, q6k_quants, q6k_scale_words, q6k_scales,
                          quad_scales, row_spec, unsigned_offset)
from ._ir import (F32, I8, I16, I32, V, abs_sign, alloca, block_at, by_halves,
                  const_vec, dot4, dpbusd, dpwssd, dpwssd_ir, fma, fold16, for_range,
                  hsum_f32, i64, load, load_f16, madd, pack_words, packssdw, pmaddubsw,
                  pmaddwd, prefetch, sdot, shuffle, splat, sum_rows, totals4)
from .formats import FORMATS, registers


def q4k_tile_side(b, nblk):
    """Once per full tile, for `define_matmul`: the 8 rows' Q8_K scales d_x and
    bsum32 pairs transposed to lane = row, dx[i] <8 x f32> and bs[i][p] <8 x i32> =
    (bsum_2p, bsum_2p+1) as int16 words (|bsum32| <= 32 * 128), so q4k_rows loads each
    with one instruction instead of gathering 8 rows (on the stack: 160 bytes per
    super-block)."""
    dxt = b.alloca(F32, size=b.mul(nblk, i64(8)))
    bst = b.alloca(I32, size=b.mul(nblk, i64(32)))

    def fill(b, tile, rows):
        if not rows.full:             # partial tiles do their float work row by row
            return
        for k in range(rows.n):
            _, xd, xbs, _ = tile.ptrs(b, i64(k))
            with for_range(b, i64(0), nblk) as i:
                b.store(load(b, xd, b.mul(i, i64(4)), F32),
                        b.gep(dxt, [b.add(b.mul(i, i64(8)), i64(k))]))
                bs = load(b, xbs, b.mul(i, i64(32)), V(I32, 8))
                pairs = b.bitcast(b.trunc(bs, V(I16, 8)), V(I32, 4))
                for p in range(4):
                    b.store(b.extract_element(pairs, ir.Constant(I32, p)),
                            b.gep(bst, [b.add(b.mul(i, i64(32)), i64(8 * p + k))]))
        tile.side = (dxt, bst)
    return fill


def q4k_rows(b, w, nsb, tile, pf, rows, level, width, five=False):
    """q4k_row for a tile: the quants, scales and mins of each super-block are unpacked
    once, then each row does its integer dot products (lanes as in q4k_row).  In a
    full tile the rows' per-block totals are then made lane k = row k (isum by
    `sum_rows`, msum from the transposed bsums of `q4k_tile_side`), so q4k_row's float
    work is done for the 8 rows at once: lane k does exactly row k's q4k_row
    operations, in order.  A partial tile (batch decode of 2-7 streams, a prompt's
    last rows) does q4k_row's float work row by row instead: the 8-lane form cost it
    for rows it does not have (batch-decode sweep, m = 2 / 4: 0.71-0.91 / 0.73-0.94
    of before)."""
    assert rows.n == 8 or not rows.full, rows.n
    bpb = FORMATS[T.Q5_K if five else T.Q4_K].block_bytes
    nl = width // 32
    zero = ir.Constant(V(I32, nl), None)
    sums = rows.acc(b, V(I32, nl))
    full = rows.full
    if full:
        acc_i = alloca(b, V(F32, 8), ir.Constant(V(F32, 8), None))
        acc_m = alloca(b, V(F32, 8), ir.Constant(V(F32, 8), None))
        dxt, bst = tile.side
    else:
        acc2 = rows.acc(b, V(F32, 2))
        for k in range(rows.n):
            b.store(ir.Constant(V(F32, 2), None), acc2(b, k))
    with for_range(b, i64(0), nsb) as i:
        p = block_at(b, w, i, bpb, pf, 3)
        qhh = q5k_high_bits(b, p, width) if five else None
        raw16 = load(b, p, None, V(I8, 16))
        ddw = q4k_d_dmin(b, raw16)
        sm = q4k_scales(b, raw16)
        nvec = 1024 // width
        los, his, scs = [], [], []
        for j in range(nvec):
            lo, hi, sub_lo, sub_hi = q4k_quants(b, p, j, width, qhh)
            los.append(lo)
            his.append(hi)
            scs.append(q4k_scale_words(b, level, sm, width, sub_lo, sub_hi))
        xo = b.mul(i, i64(256))

        def xrow(r):
            x, _, _, s = tile.ptrs(b, r)
            return s if width == 512 else x   # zmm: the nibble-ordered copy

        # one quant vector pair at a time across the rows (fewer live registers than
        # row by row: the same on avx512vnni, ~3% faster on avx2's 16 ymm registers)
        for j in range(nvec):
            def dot(r, k, j=j):
                xlo, xhi = q4k_x(b, xrow(r), xo, j, width)
                prev = zero if j == 0 else b.load(sums(b, k))
                b.store(q4k_dot(b, level, prev, los[j], his[j], xlo, xhi, scs[j]),
                        sums(b, k))
            rows.each(b, dot)

        if full:
            _tile_floats(b, i, sm, ddw, sums, dxt, bst, acc_i, acc_m, level)
        else:                             # q4k_row's float work, row by row
            mw = q4k_min_words(b, sm)

            def one_row(r, k):
                _, xd, xbs, _ = tile.ptrs(b, r)
                q4k_block_floats(b, i, ddw, mw, b.load(sums(b, k)), xd, xbs, acc2(b, k),
                                 level)
            rows.each(b, one_row)

    if full:
        y = b.fsub(b.load(acc_i), b.load(acc_m))
        rows.finish(b, lambda r, k: b.extract_element(y, ir.Constant(I32, k)))
    else:
        rows.finish(b, lambda r, k: q4k_result(b, b.load(acc2(b, k))))


def _tile_floats(b, i, sm, ddw, sums, dxt, bst, acc_i, acc_m, level):
    """A full tile's float work for super-block i: the 8 rows' totals as the lanes of
    one vector each, then q4k_row's fma for all 8 (lane k = row k)."""
    isum = sum_rows(b, [b.load(sums(b, k)) for k in range(8)])
    mins = b.bitcast(b.zext(shuffle(b, sm, sm, range(8, 16)), V(I16, 8)), V(I32, 4))
    msum = None
    for q in range(4):                # mins (m_2q, m_2q+1) . the rows' bsum pairs
        mq = b.bitcast(splat(b, b.extract_element(mins, ir.Constant(I32, q)), 8),
                       V(I16, 16))
        bq = load(b, b.bitcast(bst, I8.as_pointer()),
                  b.mul(b.add(b.mul(i, i64(4)), i64(q)), i64(32)), V(I16, 16))
        t = madd(b, level, mq, bq)
        msum = t if msum is None else b.add(msum, t)
    dx = load(b, b.bitcast(dxt, I8.as_pointer()), b.mul(i, i64(32)), V(F32, 8))
    d = b.fmul(splat(b, b.extract_element(ddw, ir.Constant(I32, 0)), 8), dx)
    dmin = b.fmul(splat(b, b.extract_element(ddw, ir.Constant(I32, 1)), 8), dx)
    b.store(fma(b, d, b.sitofp(isum, V(F32, 8)), b.load(acc_i)), acc_i)
    b.store(fma(b, dmin, b.sitofp(msum, V(F32, 8)), b.load(acc_m)), acc_m)


def _offset_init(b, u, off, level):
    """<n/4 x i32> 512 * off - 128 * (sum of each lane's 4 unsigned quants u): the start
    of a dpbusd of (x + 128) with q = u - off that leaves the exact sum_j q_j x_j."""
    n = u.type.count // 4
    return dot4(b, level, const_vec(I32, n, 512 * off), u, const_vec(I8, 4 * n, -128))


def _pair_correction(b, q):
    """avx2: <16 x i16> 128 * (q_2i + q_2i+1), what vpmaddubsw(x + 128, q) adds to the
    int16 pairs of x . q (vpmaddubsw(128, q))."""
    return pmaddubsw(b, const_vec(I8, 32, 0x80), q)


def q6k_rows(b, w, nsb, tile, pf, rows, level):
    """q6k_row for a tile of activation rows stored as x + 128 (module docstring)."""
    fmt = FORMATS[T.Q6_K]
    off = unsigned_offset(T.Q6_K)
    nl = 8
    zero = ir.Constant(V(I32, nl), None)
    acc = rows.acc(b, V(F32, nl))
    rows.each(b, lambda r, k: b.store(ir.Constant(V(F32, nl), None), acc(b, k)))
    c32 = const_vec(I8, 32, off)
    avx2 = level == isa.AVX2
    arm = isa.is_arm(level)                 # q signed, x as it is: no offsets
    with for_range(b, i64(0), nsb) as i:
        p = block_at(b, w, i, fmt.block_bytes, pf, 4)
        dw = load_f16(b, p, i64(fmt.d_offset))
        sc16 = q6k_scales(b, p)
        qv, inits, scw = [], [], []
        for n in range(2):
            for k, u in enumerate(q6k_quants(b, p, n)):
                qv.append(b.sub(u, c32))
                if arm:
                    continue
                if avx2:
                    inits.append(_pair_correction(b, qv[-1]))
                    scw.append(q6k_pair_scales(b, sc16, n, k))
                else:
                    inits.append(_offset_init(b, u, off, level))
            if not avx2:
                for k in (0, 2):
                    scw.append(q6k_scale_words(b, sc16, n, k))
        # (arm: qv and scw as the VNNI levels', inits unused)
        xo = b.mul(i, i64(256))

        def row(r, k):
            x, xd, _, xu = tile.ptrs(b, r)
            d = b.fmul(dw, load(b, xd, b.mul(i, i64(4)), F32))
            sumi = zero
            xv = [load(b, x if arm else xu, b.add(xo, i64(32 * v)), V(I8, 32))
                  for v in range(8)]
            if arm:
                for v in range(0, 8, 2):
                    dots = [sdot(b, level, None, qv[v + h], xv[v + h]) for h in range(2)]
                    sumi = dpwssd_ir(b, sumi, pack_words(b, dots[0], dots[1]),
                                     scw[v // 2])
            elif avx2:
                for v in range(8):
                    p16 = b.sub(pmaddubsw(b, xv[v], qv[v]), inits[v])
                    sumi = b.add(sumi, pmaddwd(b, p16, scw[v]))
            else:
                for v in range(0, 8, 2):
                    dots = [dpbusd(b, inits[v + h], xv[v + h], qv[v + h])
                            for h in range(2)]
                    sumi = dpwssd(b, sumi, packssdw(b, dots[0], dots[1]), scw[v // 2])
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), b.load(pa)), pa)
        rows.each(b, row)
    rows.finish(b, lambda r, k: hsum_f32(b, b.load(acc(b, k))))


def _blk32_form(level, t):
    """How a tile dots 32-element blocks: "vnni-offset" (x + 128 . q, weight-side
    init), "avx2-offset" (the same in int16 pairs), "sign" (avx2 Q8_0: |q| . x sign(q)),
    "plain" (Q4_1 / Q5_1: u . x), or on aarch64 "sdot" (q . x, both signed)."""
    if isa.is_arm(level):
        return "sdot"
    if not unsigned_offset(t):
        return "plain"
    if level != isa.AVX2:
        return "vnni-offset"
    return "sign" if t == T.Q8_0 else "avx2-offset"


def blk32_rows(b, w, nb, tile, pf, rows, level, t):
    """blk32_row for a tile of activation rows (x + 128 for the offset forms): two
    blocks per iteration (a zmm at avx512vnni) and an odd last block alone, or at avx2
    four blocks per iteration and the last nb % 4 alone (as blk32_row_quads); each
    row's float work as in the one-row kernel."""
    bpb = FORMATS[t].block_bytes
    off = unsigned_offset(t)
    form = _blk32_form(level, t)
    with_min = FORMATS[t].m_offset is not None
    acc = rows.acc(b, V(F32, 8))
    accm = rows.acc(b, V(F32, 2)) if with_min else None
    accm1 = rows.acc(b, V(F32, 1)) if with_min else None

    def init(r, k):
        b.store(ir.Constant(V(F32, 8), None), acc(b, k))
        if with_min:
            b.store(ir.Constant(V(F32, 2), None), accm(b, k))
            b.store(ir.Constant(V(F32, 1), None), accm1(b, k))
    rows.each(b, init)

    def weights(u):
        """The weight-side operands of a block (pair) for `lanes`."""
        if form == "vnni-offset":
            return blk32_signed(b, t, u), _offset_init(b, u, off, level)
        if form == "avx2-offset":
            q = blk32_signed(b, t, u)
            if q.type.count == 64:
                return q, by_halves(b, lambda qh: _pair_correction(b, qh), q)
            return q, _pair_correction(b, q)
        if form in ("sign", "sdot"):
            return blk32_signed(b, t, u), None
        return u, None

    def lanes(wq, corr, x, xu, n):
        if form == "vnni-offset":
            return dot4(b, level, corr, load(b, xu[0], xu[1], V(I8, n)), wq)
        xv = load(b, x[0], x[1], V(I8, n))
        if form == "sdot":
            return sdot(b, level, None, wq, xv)
        if form == "avx2-offset":
            xuv = load(b, xu[0], xu[1], V(I8, n))

            def pairs(xh, qh, ch):
                p16 = b.sub(pmaddubsw(b, xh, qh), ch)
                return pmaddwd(b, p16, const_vec(I16, 16, 1))
            return pairs(xuv, wq, corr) if n == 32 else by_halves(b, pairs, xuv, wq,
                                                                  corr)
        if form == "sign":
            return dot4(b, level, None, *abs_sign(b, wq, xv))
        return dot4(b, level, None, wq, xv)

    if level == isa.AVX2:
        start = _blk32_quads(b, w, nb, tile, pf, rows, level, t, weights, lanes, acc,
                             accm)
    else:
        start = _blk32_pairs(b, w, nb, tile, pf, rows, level, t, weights, lanes, acc,
                             accm)
    with for_range(b, start, nb) as i:
        o = b.mul(i, i64(bpb))
        prefetch(b, w, b.add(o, pf))
        p = b.gep(w, [o])
        dvw, mvw = blk32_scales(b, p, t, 1)
        dw = b.extract_element(dvw, ir.Constant(I32, 0))
        wq, corr = weights(blk32_quants(b, p, t, 1, level))

        def row1(r, k):
            x, xd, xs, s = tile.ptrs(b, r)
            d = b.fmul(dw, load(b, xd, b.mul(i, i64(4)), F32))
            xo = b.mul(i, i64(32))
            dot = lanes(wq, corr, (x, xo), (s, xo), 32)
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, 8), b.sitofp(dot, V(F32, 8)), b.load(pa)), pa)
            if with_min:
                xm = load(b, xs, b.mul(i, i64(4)), V(F32, 1))
                pm = accm1(b, k)
                b.store(fma(b, mvw, xm, b.load(pm)), pm)
        rows.each(b, row1)

    def result(r, k):
        total = hsum_f32(b, b.load(acc(b, k)))
        if with_min:
            mins = b.fadd(hsum_f32(b, b.load(accm(b, k))),
                          b.extract_element(b.load(accm1(b, k)), ir.Constant(I32, 0)))
            total = b.fadd(total, mins)
        return total
    rows.finish(b, result)


def _blk32_pairs(b, w, nb, tile, pf, rows, level, t, weights, lanes, acc, accm):
    """blk32_rows' block pairs (the VNNI levels): as blk32_row, 16 float lanes per row,
    folded into acc at the end.  Returns the first block left."""
    bpb = FORMATS[t].block_bytes
    with_min = FORMATS[t].m_offset is not None
    acc2 = rows.acc(b, V(F32, 16))
    rows.each(b, lambda r, k: b.store(ir.Constant(V(F32, 16), None), acc2(b, k)))
    npair = b.sdiv(nb, i64(2))
    with for_range(b, i64(0), npair) as index:
        i, p = blk32_pair(b, w, index, bpb, pf)
        dvw, mvw = blk32_scales(b, p, t, 2)
        wq, corr = weights(blk32_quants(b, p, t, 2, level))

        def row(r, k):
            x, xd, xs, s = tile.ptrs(b, r)
            dvr = b.fmul(dvw, load(b, xd, b.mul(i, i64(4)), V(F32, 2)))
            dvr = shuffle(b, dvr, dvr, [0] * 8 + [1] * 8)
            o = b.mul(i, i64(32))
            dot = lanes(wq, corr, (x, o), (s, o), 64)
            pa = acc2(b, k)
            b.store(fma(b, dvr, b.sitofp(dot, V(F32, 16)), b.load(pa)), pa)
            if with_min:
                xm = load(b, xs, b.mul(i, i64(4)), V(F32, 2))
                pm = accm(b, k)
                b.store(fma(b, mvw, xm, b.load(pm)), pm)
        rows.each(b, row)
    rows.each(b, lambda r, k: b.store(fold16(b, b.load(acc2(b, k))), acc(b, k)))
    return b.mul(npair, i64(2))


def _blk32_quads(b, w, nb, tile, pf, rows, level, t, weights, lanes, acc, accm):
    """blk32_rows' blocks four at a time (avx2), as blk32_row_quads does them for one
    row: each row's integer lanes summed per block (`totals4`), then one conversion
    and one fma per four blocks.  Returns the first block left."""
    bpb = FORMATS[t].block_bytes
    with_min = FORMATS[t].m_offset is not None
    nquad = b.sdiv(nb, i64(4))
    with for_range(b, i64(0), nquad) as q:
        side = []
        for h in range(2):
            i, p = blk32_pair(b, w, b.add(b.mul(q, i64(2)), i64(h)), bpb, pf)
            dvw, mvw = blk32_scales(b, p, t, 2)
            side.append((i, dvw, mvw, *weights(blk32_quants(b, p, t, 2, level))))
        dw4 = shuffle(b, side[0][1], side[1][1], [0, 1, 2, 3])

        def row(r, k):
            x, xd, xs, s = tile.ptrs(b, r)
            dots = []
            for i, _, mvw, wq, corr in side:
                o = b.mul(i, i64(32))
                dots.append(lanes(wq, corr, (x, o), (s, o), 64))
                if with_min:
                    xm = load(b, xs, b.mul(i, i64(4)), V(F32, 2))
                    pm = accm(b, k)
                    b.store(fma(b, mvw, xm, b.load(pm)), pm)
            scale = quad_scales(b, dw4, load(b, xd, b.mul(q, i64(16)), V(F32, 4)))
            tot = b.sitofp(totals4(b, dots[0], dots[1]), V(F32, 8))
            pa = acc(b, k)
            b.store(fma(b, scale, tot, b.load(pa)), pa)
        rows.each(b, row)
    return b.mul(nquad, i64(4))


# --- which builder each (format, level) uses ------------------------------------------
# Registered per format (`FORMATS[t].kernels.int_tiles`): (t, level) -> TileSpec, at
# the x86 levels of the format's `int_levels` (the generic level has no tiles).


class TileSpec(NamedTuple):
    """How the tile kernel of one format is built at one level, with the same lanes as
    its row kernel (_int_matvec.row_spec): `body(b, w, nblk, tile, pf, rows)` for
    define_matmul, its `side` (`tile_side`: once per tile, or None) and `prep`, the
    define_prep body each activation row of a call needs (or None)."""

    body: Callable
    side: Callable | None
    prep: Callable | None


@registers("int_tiles", T.Q4_K, T.Q5_K)
def _kquant_tile_spec(t, level) -> TileSpec:
    """q4k_rows with the row kernel's width; its zmm form reads the nibble-ordered
    activations, the ymm one the activations as they are."""
    _, opts, prep = row_spec(t, level)
    return TileSpec(lambda b, w, n, tile, pf, rows: q4k_rows(b, w, n, tile, pf, rows,
                                                             level, **opts),
                    q4k_tile_side, prep_interleave if prep == "interleave" else None)


@registers("int_tiles", T.Q6_K)
def _q6k_tile_spec(t, level) -> TileSpec:
    """Activation rows as x + 128 (module docstring); as they are on aarch64."""
    return TileSpec(lambda b, w, n, tile, pf, rows: q6k_rows(b, w, n, tile, pf, rows,
                                                             level),
                    None, None if isa.is_arm(level) else prep_xor80)


@registers("int_tiles", T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1)
def _blk32_tile_spec(t, level) -> TileSpec:
    """Activation rows as x + 128 for the offset forms (`_blk32_form`)."""
    offsets = _blk32_form(level, t) in ("vnni-offset", "avx2-offset")
    return TileSpec(lambda b, w, n, tile, pf, rows: blk32_rows(b, w, n, tile, pf, rows,
                                                               level, t),
                    None, prep_xor80 if offsets else None)


def tile_spec(t, level) -> TileSpec:
    """The TileSpec of (t, level), an x86 level among the format's `int_levels`."""
    kernels = FORMATS[t].kernels
    if level == isa.GENERIC or level not in kernels.int_levels:
        raise KeyError(f"{t.name} has no tile kernels at {level}")
    return kernels.int_tiles(t, level)
