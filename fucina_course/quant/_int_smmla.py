"""The packed GEMM at i8mm: 32-element blocks by `smmla`, two activation rows at a time.

`smmla` (FEAT_I8MM: Apple M2+, Neoverse V1+, Graviton3+) multiplies a 2x8 byte
matrix by an 8x2 one into a 2x2 int32 tile: 32 multiply-accumulates per instruction,
twice `sdot`'s 16.  Its operands pair up rows: one 16-byte operand holds 8 bytes of
two activation rows, the other 8 bytes of two weight rows, and the result's lanes are
(row 0 . weight 0, row 0 . weight 1, row 1 . weight 0, row 1 . weight 1).  So here:

* the repack (`pair_vectors`) stores, for each 8-byte step s of a block and each pair
  p of the group's 8 weight rows, the vector [row 2p bytes 8s..8s+7, row 2p+1 the
  same]: 16 vectors per block, the 256 bytes of `sdot`'s layout in another order;
* the activation rows go two at a time (`pair_rows`): per block, 4 steps x 4 weight
  pairs = 16 `smmla` give the exact integer totals of 2 x 8 (row, weight row) pairs,
  in a 16-lane "pair layout" (lane 4p + 2i + j: activation row i, weight row 2p + j);
* the float work is the other levels' own, lane by lane: `d = d_w * d_x`, then
  `acc = fma(d, float(total), acc)` (Q4_1 / Q5_1: `+ m_w * s_x`), with d_w laid out
  per pair (`to_pairs`) and d_x as (x0, x0, x1, x1) (`row_pair`), so each output is
  bit for bit the `sdot` levels' and x86's.  The accumulators go back to rows once
  per chunk (`from_pairs`).

llama.cpp's `ggml_gemm_q8_0_4x8_q8_0` does the same with activations it repacks four
rows at a time when it quantizes them; here they are interleaved in registers (4 zips
per two rows and block, shared by the 8 weight rows), since `_int.run` preps each
activation row alone.  An odd last row runs paired with itself.
"""

from __future__ import annotations

from llvmlite import ir

from ._int_packed import PAIRED_LAYOUTS, _Blk32, _f16_lanes, _slot, _store, alloca
from ._ir import F32, I8, I32, I64, V, concat, fma, for_range, i64, load, shuffle, smmla

N = 16                                  # weight rows per group: 8 pairs


def pair_vectors(b, rows):
    """N rows' 32 signed quant bytes (<32 x i8> each) -> 4 N / 2 `smmla` operands
    <16 x i8>, vector N/2 s + p = [row 2p, row 2p + 1] bytes 8s .. 8s + 7."""
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


def from_pairs(b, v, i):
    """<N x f32>: activation row i's lanes (its weight rows) of a pair-layout vector."""
    n = v.type.count // 2
    return shuffle(b, v, v, [4 * (w // 2) + 2 * i + w % 2 for w in range(n)])


class Blk32Pairs(_Blk32):
    """_Blk32 at i8mm: the quants in `pair_vectors` order (8 slots of 32 bytes, two
    operands each), d_w and m_w as in _Blk32; `compute_pairs` for two rows."""

    mm = True

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
                v = to_pairs(b, _f16_lanes(b, ptrs, off))
                for h in (0, 1):
                    _store(b, scratch, b.add(base, i64(slot + h)),
                           shuffle(b, v, v, range(self.n * h, self.n * h + self.n)))

    def _pair_slots(self, b, scratch, base, slot):
        return concat(b, [_slot(b, scratch, b.add(base, i64(slot + h)), V(F32, self.n))
                          for h in (0, 1)])

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
        """pairs: ((x, xd, xs) of row 0, of row 1) per pair; accs: their <16 x f32>
        pair-layout accumulators."""
        n, np_ = self.n, self.n // 2
        per = n // 4                                 # operands per 4 n-byte slot
        vecs = []
        for k in range(8):
            v = _slot(b, scratch, b.add(base, i64(k)), V(I8, 4 * n))
            vecs += [shuffle(b, v, v, range(16 * h, 16 * h + 16)) for h in range(per)]
        dw = self._pair_slots(b, scratch, base, self.dslot)
        mw = (self._pair_slots(b, scratch, base, self.dslot + 2)
              if self.fmt.m_offset is not None else None)
        zero = ir.Constant(V(I32, 4), None)
        for rows, acc in zip(pairs, accs):
            xs64 = [load(b, x, b.mul(blk, i64(32)), V(I64, 4)) for x, _, _ in rows]
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
                     b.gep(xs, [b.mul(ti, xsst)])))
    pairs, accs = [], []
    for k in range(0, len(idx), 2):
        ys = [b.select(first, ir.Constant(fv, None), b.load(outs[k + i], align=4))
              for i in (0, 1)]
        acc = alloca(b, V(F32, 2 * n))
        # row i, weight row 2p + j -> lane 4p + 2i + j
        b.store(shuffle(b, ys[0], ys[1], [n * (L // 2 % 2) + 2 * (L // 4) + L % 2
                                          for L in range(2 * n)]), acc)
        pairs.append((rows[k], rows[k + 1]))
        accs.append(acc)
    with for_range(b, i64(0), nb) as i:
        lay.compute_pairs(b, scratch, b.mul(i, i64(lay.VECS)), b.add(k0, i), pairs, accs)
    for k, acc in enumerate(accs):
        v = b.load(acc)
        for i in (0, 1) if count > 1 else (0,):
            b.store(from_pairs(b, v, i), outs[2 * k + i], align=4)


Blk32Pairs.emit_rows = staticmethod(pair_rows)
PAIRED_LAYOUTS.append(Blk32Pairs)        # _int_packed._layout builds it at i8mm
