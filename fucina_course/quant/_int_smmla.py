"""The packed GEMM at i8mm: every integer format by `smmla`, two activation rows at once.

`smmla` (FEAT_I8MM: Apple M2+, Neoverse V1+, Graviton3+) multiplies a 2x8 byte
matrix by an 8x2 one into a 2x2 int32 tile: 32 multiply-accumulates per instruction,
twice `sdot`'s 16.  Its operands pair up rows: one 16-byte operand holds 8 bytes of
two activation rows, the other 8 bytes of two weight rows, and the result's lanes are
(row 0 . weight 0, row 0 . weight 1, row 1 . weight 0, row 1 . weight 1).  So here:

* the repack (`pair_vectors`) stores, for each 8-byte step s of 32 elements and each
  pair p of the group's weight rows, the vector [row 2p bytes 8s..8s+7, row 2p+1 the
  same]: the bytes of `sdot`'s layout in another order;
* the activation rows go two at a time (`pair_rows`): 4 steps x the group's weight
  pairs give the exact integer totals of every (row, weight row) pair of 32 elements
  in a "pair layout" (lane 4p + 2i + j: activation row i, weight row 2p + j);
* the float work is the other levels' own, lane by lane, with the weights' scales laid
  out per pair (`to_pairs`) and the activations' as (x0, x0, x1, x1) (`row_pair`), so
  each output is bit for bit the `sdot` levels' and x86's.  The accumulators go back
  to rows once per chunk (`from_pairs`).

Two layouts.  `Blk32Pairs`, the 32-element formats: groups of N = 16 weight rows (8
pairs, 32 `smmla` per block and row pair), `d = d_w * d_x`, `acc = fma(d,
float(total), acc)` (Q4_1 / Q5_1: `+ m_w * s_x`).  `KQuantPairs`, Q4_K / Q5_K / Q6_K:
dotprod's groups of 4 weight rows, 4 activation rows a pass, each sub-block's total
through `_ir.unbias` and its own scale, the mins and d_x once per super-block.

llama.cpp's `ggml_gemm_q8_0_4x8_q8_0` and `ggml_gemm_q4_K_8x8_q8_K` do the same with
activations they repack four rows at a time when they quantize them; here they are
interleaved in registers (4 zips per two rows and 32 elements, shared by the group's
weight pairs), since `_int.run` preps each activation row alone.  An odd last row runs
paired with itself.
"""

from __future__ import annotations

from llvmlite import ir

from ._int_packed import (I8MM_TILE, PAIRED_LAYOUTS, _Blk32, _f16_lanes, _KQuant, _slot,
                          _store, alloca)
from ._ir import (F32, I8, I32, I64, V, biased_zero, concat, fma, for_range, i64, load,
                  shuffle, smmla, unbias)

N = 16                                  # weight rows per group: 8 pairs


def pair_vectors(b, rows):
    """L rows' 32 signed quant bytes (<32 x i8> each) -> 4 L / 2 `smmla` operands
    <16 x i8>, vector L/2 s + p = [row 2p, row 2p + 1] bytes 8s .. 8s + 7."""
    r64 = [b.bitcast(r, V(I64, 4)) for r in rows]
    return [b.bitcast(shuffle(b, r64[2 * p], r64[2 * p + 1], [s, 4 + s]), V(I8, 16))
            for s in range(4) for p in range(len(rows) // 2)]


def to_pairs(b, v):
    """<N x T> lane = weight row -> <2N x T> in the pair layout (lane 4p + 2i + j:
    weight row 2p + j)."""
    return shuffle(b, v, v, [2 * (k // 4) + k % 2 for k in range(2 * v.type.count)])


def row_pair(b, a, c, n=N):
    """Scalars of activation rows 0 and 1 -> <2n x T> (a, a, c, c) repeated."""
    u = ir.Constant(V(a.type, 2), ir.Undefined)
    v = b.insert_element(b.insert_element(u, a, ir.Constant(I32, 0)), c,
                         ir.Constant(I32, 1))
    return shuffle(b, v, v, [0, 0, 1, 1] * (n // 2))


def rows_to_pairs(b, v0, v1):
    """<n x T> of activation rows 0 and 1 (lane = weight row) -> <2n x T> in the
    pair layout."""
    n = v0.type.count
    return shuffle(b, v0, v1, [n * (L // 2 % 2) + 2 * (L // 4) + L % 2
                               for L in range(2 * n)])


def store_pairs(b, scratch, index, v):
    """A <2n x T> pair-layout vector into two scratch slots from `index` (i64)."""
    n = v.type.count // 2
    for h in (0, 1):
        _store(b, scratch, b.add(index, i64(h)), shuffle(b, v, v, range(n * h, n * h + n)))


def load_pairs(b, scratch, index, n):
    """<2n x f32>: the two slots from `index` (i64) that `store_pairs` filled."""
    return concat(b, [_slot(b, scratch, b.add(index, i64(h)), V(F32, n)) for h in (0, 1)])


def from_pairs(b, v, i):
    """<N x f32>: activation row i's lanes (its weight rows) of a pair-layout vector."""
    n = v.type.count // 2
    return shuffle(b, v, v, [4 * (w // 2) + 2 * i + w % 2 for w in range(n)])


class Blk32Pairs(_Blk32):
    """_Blk32 at i8mm: the quants in `pair_vectors` order (8 slots of 32 bytes, two
    operands each), d_w and m_w as in _Blk32; `compute_pairs` for two rows."""

    mm = True
    tile = I8MM_TILE

    def __init__(self, t, level, triple=None):
        super().__init__(t, level, triple)
        self.n = N
        self.VECS = self.dslot + 4                   # d_w, m_w in the pair layout

    def store_scales(self, b, ptrs, scratch, base):
        """d_w and m_w already in the pair layout (`to_pairs`), two slots each: done
        per block and group here, not per block and row pair (8 `dup`s each)."""
        for slot, off in ((self.dslot, self.fmt.d_offset),
                          (self.dslot + 2, self.fmt.m_offset)):
            if off is not None:
                store_pairs(b, scratch, b.add(base, i64(slot)),
                            to_pairs(b, _f16_lanes(b, ptrs, off)))

    def repack(self, b, ptrs, scratch, base):
        from ._int_matvec import blk32_quants, blk32_signed
        quants = [blk32_signed(b, self.t, blk32_quants(b, p, self.t, 1, self.level))
                  for p in ptrs]
        vecs = pair_vectors(b, quants)
        per = self.n // 4                            # operands per slot
        for k in range(8):
            _store(b, scratch, b.add(base, i64(k)), concat(b, vecs[per * k:per * k + per]))
        self.store_scales(b, ptrs, scratch, base)

    def compute_pairs(self, b, scratch, base, blk, pairs, accs):
        """pairs: ((x, xd, xs, ext) of row 0, of row 1) per pair (ext unused here);
        accs: their <2N x f32> pair-layout accumulators."""
        n, np_ = self.n, self.n // 2
        per = n // 4                                 # operands per 4 n-byte slot
        vecs = []
        for k in range(8):
            v = _slot(b, scratch, b.add(base, i64(k)), V(I8, 4 * n))
            vecs += [shuffle(b, v, v, range(16 * h, 16 * h + 16)) for h in range(per)]
        dw = load_pairs(b, scratch, b.add(base, i64(self.dslot)), n)
        mw = (load_pairs(b, scratch, b.add(base, i64(self.dslot + 2)), n)
              if self.fmt.m_offset is not None else None)
        zero = ir.Constant(V(I32, 4), None)
        for rows, acc in zip(pairs, accs):
            xs64 = [load(b, x, b.mul(blk, i64(32)), V(I64, 4)) for x, *_ in rows]
            tots = [zero] * np_
            for s in range(4):
                a = b.bitcast(shuffle(b, xs64[0], xs64[1], [s, 4 + s]), V(I8, 16))
                tots = [smmla(b, tots[p], a, vecs[np_ * s + p]) for p in range(np_)]
            tot = concat(b, tots)

            def scalar(k):
                return row_pair(b, *[load(b, r[k], b.mul(blk, i64(4)), F32)
                                     for r in rows])
            d = b.fmul(dw, scalar(1))
            a = fma(b, d, b.sitofp(tot, V(F32, 2 * n)), b.load(acc))
            if mw is not None:
                a = fma(b, mw, scalar(2), a)
            b.store(a, acc)


def pair_rows(b, ctx, t0, count):
    """Activation rows t0 .. t0 + count - 1 (count even; 1: the row paired with
    itself) against the repacked chunk, as _int_packed._rows does them one by one."""
    (lay, x, xst, xd, xdst, xs, xsst, s, ext, sst, y, yst, col, k0, nb, scratch, c,
     valid) = ctx
    assert valid is None
    n = lay.n
    fv = V(F32, n)
    first = b.icmp_signed("==", c, i64(0))
    idx = list(range(count)) if count > 1 else [0, 0]
    rows, outs = [], []
    for r in idx:
        ti = b.add(t0, i64(r))
        outs.append(b.bitcast(b.gep(y, [b.add(b.mul(ti, yst), b.mul(col, i64(4)))]),
                              fv.as_pointer()))
        rows.append((b.gep(x, [b.mul(ti, xst)]), b.gep(xd, [b.mul(ti, xdst)]),
                     b.gep(xs, [b.mul(ti, xsst)]), b.gep(ext, [b.mul(ti, sst)])))
    pairs, accs = [], []
    for k in range(0, len(idx), 2):
        ys = [b.select(first, ir.Constant(fv, None), b.load(outs[k + i], align=4))
              for i in (0, 1)]
        acc = alloca(b, V(F32, 2 * n))
        b.store(rows_to_pairs(b, *ys), acc)
        pairs.append((rows[k], rows[k + 1]))
        accs.append(acc)
    with for_range(b, i64(0), nb) as i:
        lay.compute_pairs(b, scratch, b.mul(i, i64(lay.VECS)), b.add(k0, i), pairs, accs)
    for k, acc in enumerate(accs):
        v = b.load(acc)
        for i in (0, 1) if count > 1 else (0,):
            b.store(from_pairs(b, v, i), outs[2 * k + i], align=4)


class KQuantPairs(_KQuant):
    """_KQuant at i8mm: Q4_K / Q5_K / Q6_K by `smmla`, two activation rows at a time.

    The group stays dotprod's 4 weight rows (2 pairs), and each 32 elements' 8 scratch
    vectors hold the same bytes as there in `pair_vectors` order: a sub-block of 32
    (Q6_K: 16) is 4 (2) steps of 8 bytes x 2 weight pairs, 8 (4) `smmla` for 2 x 4
    (activation row, weight row) totals, where `sdot` needs 16 (8).  d_w * sc_s is
    stored per sub-block in the pair layout (`to_pairs`: two slots), so the float work
    stays lane by lane the `sdot` levels' own: each sub-block's total by `unbias` and
    one fma into the row pair's accumulator; per super-block the mins (computed per
    row as at dotprod, then `rows_to_pairs`) and d_x (`row_pair`).

    Why: at i8mm the K-quants ran dotprod's `sdot` loop, bound on Neoverse V1 by its
    four vector pipes, 44 micro-ops per 4 rows x 4 weight rows x 32 elements (32
    `sdot`); here the same work is 16 `smmla`, 8 zips of the activations (4 per row
    pair and sub-block, shared by the group's 2 weight pairs) and 12 float or start
    operations, 36 (llvm-mca, Q4_K against llama.cpp's `smmla` kernel: Neoverse V1
    1.05x -> 1.28x, Apple M2 1.13x -> 1.38x; docs/BENCHMARKS.md).  4 activation rows
    (`tile`) share each loaded quant vector between two row pairs."""

    mm = True
    tile = 4
    DSC_SLOTS = 2                                   # d_w * sc_s in the pair layout

    def __init__(self, t, level, triple=None):
        super().__init__(t, level, triple)
        assert self.dot.arm and not self.wide

    def _quant_vectors(self, b, rows):
        return pair_vectors(b, rows)

    def _store_dsc(self, b, scratch, base, k, vec):
        store_pairs(b, scratch, b.add(base, i64(self.qvecs + 2 * k)), to_pairs(b, vec))

    def compute_pairs(self, b, scratch, base, blk, pairs, accs):
        """pairs: ((x, xd, xs, ext) of row 0, of row 1) per pair; accs: their
        <2n x f32> pair-layout accumulators."""
        n, np_ = self.n, self.n // 2
        fv2 = V(F32, 2 * n)
        per = self.qvecs // self.nsub               # scratch vectors per sub-block
        xbytes = 4 * per                            # activation bytes per sub-block
        xq = xbytes // 8                            # ... as i64
        subs = [alloca(b, fv2) for _ in pairs]      # sum_s d sc_s total_s, per pair
        for a in subs:
            b.store(ir.Constant(fv2, None), a)
        with for_range(b, i64(0), i64(self.nsub)) as s:
            sb = b.add(base, b.mul(s, i64(per)))
            vecs = [_slot(b, scratch, b.add(sb, i64(k)), V(I8, 16)) for k in range(per)]
            dsc = load_pairs(b, scratch, b.add(base, b.add(i64(self.qvecs),
                                                           b.mul(s, i64(2)))), n)
            xo = b.add(b.mul(blk, i64(256)), b.mul(s, i64(xbytes)))
            for rows, a in zip(pairs, subs):
                xs64 = [load(b, r[0], xo, V(I64, xq)) for r in rows]
                tots = [biased_zero(4)] * np_
                for st in range(per // np_):
                    x2 = b.bitcast(shuffle(b, xs64[0], xs64[1], [st, xq + st]),
                                   V(I8, 16))
                    tots = [smmla(b, tots[p], x2, vecs[np_ * st + p])
                            for p in range(np_)]
                b.store(fma(b, dsc, unbias(b, concat(b, tots)), b.load(a)), a)
        if not self.six:
            mins, negdmin = self._mins(b, scratch, base)
            negdmin = to_pairs(b, negdmin)
        for rows, a, acc in zip(pairs, subs, accs):
            total = b.load(a)
            if not self.six:
                msum = rows_to_pairs(b, *[self._msum(b, blk, r[3], mins) for r in rows])
                total = fma(b, negdmin, b.sitofp(msum, fv2), total)
            dx = row_pair(b, *[load(b, r[1], b.mul(blk, i64(4)), F32) for r in rows], n)
            b.store(fma(b, total, dx, b.load(acc)), acc)


def _emit_rows(self, b, ctx, t0, count):
    """_int_packed._groups' pass over rows t0 .. t0 + count - 1: `pair_rows`, looked up
    when called (bench/mca_prefill.py replaces it to leave the one-row pass out)."""
    return pair_rows(b, ctx, t0, count)


for _lay in (Blk32Pairs, KQuantPairs):      # _int_packed._layout builds them at i8mm
    _lay.emit_rows = _emit_rows
    PAIRED_LAYOUTS[_lay.QK] = _lay
