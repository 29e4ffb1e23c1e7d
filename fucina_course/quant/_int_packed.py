"""Prefill's GEMM for the 32-element formats at avx512vnni: weight rows repacked so that
one vpdpbusd lane is one weight row (matmul's "packed" path).

The tiles of _int_matmul.py keep a block's 8 int32 lanes per activation row, as the
one-row kernel does, and so pay the float work per block per row on 8 lanes: convert,
scale, fma.  For Q8_0 that is one conversion and one fma per vpdpbusd, and the
conversion shares port 0 with vpdpbusd on Intel cores: the 8-row tile ran ~116
GFLOP/s per core, the port-0 bound of that mix (Sapphire Rapids class, 2026-12-02).

Here 16 weight rows are transposed once per call, 4 bytes at a time, into 8 vectors
per block: vector k, lane j = bytes 4k..4k+3 of weight row j's block.  An activation
row then broadcasts its 4 bytes (the `{1to16}` memory operand of vpdpbusd) and 8
vpdpbusd leave the exact integer total of the block in each of the 16 lanes, one per
weight row.  One conversion and one fma then finish the block for 16 weight rows:
8 vpdpbusd + 2 float operations per (activation row, block, 16 weight rows), against
8 + 16 in the tiles.  llama.cpp's repacked GEMMs (REPACK) do the same with 4 or 8
rows, repacking once at load; here the repack is per call (16 rows x 64 blocks at a
time, 40 KB of stack) and costs a few percent at m = 64: no second copy of the
weights in memory.

Numerics: each block's total is the exact integer sum_j q_j x_j (the weights as the
unsigned u = q + off, the activations signed; the lane starts at -off * sum_j x_j,
`prep_packed`), then `acc = fma(d_w * d_x, float(total), acc)` block after
block (Q4_1 / Q5_1: plus `fma(m_w, s_x, acc)`), ggml's own order per block.  The
result does not depend on m, the tile or the thread, but it is not the one-row
kernel's (8 lanes per block, summed at the end), so the "rows" path stays what
batch decode and per-row steps use: they must equal a one-token step bit for bit.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T
from llvmlite import ir

from . import isa
from ._int_matvec import ROWS, blk32_quants, unsigned_offset
from ._ir import (F32, I8, I16, I32, I64, I8P, V, _function, alloca, dpbusd, fma,
                  for_range, i64, load, load_f16, shuffle, splat)
from .formats import FORMATS

LANES = 16          # weight rows per packed group: the int32 lanes of a zmm
CHUNK = 64          # blocks repacked at a time: 64 x 640 bytes of stack
assert ROWS == LANES, "_int.run hands each call one chunk of ROWS weight rows"
FORMATS_PACKED = (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1)
_VECS = 10          # per block in the scratch: 8 quant vectors, d_w, m_w


def has_packed(t, level) -> bool:
    """Whether (format, level) has the packed GEMM (zmm VNNI only: 16 lanes)."""
    return level == isa.AVX512VNNI and t in FORMATS_PACKED


def prep_packed(t, tile_prep):
    """The prep body of the packed path: the tile's own prep (`tile_prep`, or None) in
    s[0:n], for the chunks that fall back to the tiles, then from s[n] on int32[n / 32]
    = -off * (the sum of block k's 32 activations), the lanes' start (none for off =
    0: Q4_1 / Q5_1).  `_int.run` gives the packed path's scratch rows n + n / 8
    bytes.  None if there is nothing to do."""
    off = unsigned_offset(t)
    if not off and tile_prep is None:
        return None

    def body(b, x, n, s):
        if tile_prep is not None:
            tile_prep(b, x, n, s)
        if not off:
            return
        si = b.bitcast(b.gep(s, [n]), I32.as_pointer())
        with for_range(b, i64(0), b.udiv(n, i64(32))) as k:
            v = b.sext(load(b, x, b.mul(k, i64(32)), V(I8, 32)), V(I32, 32))
            total = b.call(_reduce_add(b), [v])
            b.store(b.mul(total, ir.Constant(I32, -off)), b.gep(si, [k]))
    return body


def _reduce_add(b):
    name = "llvm.vector.reduce.add.v32i32"
    fn = b.module.globals.get(name)
    if fn is None:
        fn = ir.Function(b.module, ir.FunctionType(I32, [V(I32, 32)]), name=name)
    return fn


def transpose16x8(b, rows):
    """16 vectors <8 x i32> (row j, dword k) -> 8 vectors <16 x i32> (dword k, lane
    j).  Each of the 3 steps swaps one bit of the vector index with one bit of the lane
    index by two-source shuffles (24 vpermt2d in all)."""
    vecs = [shuffle(b, rows[i], rows[i + 8], range(16)) for i in range(8)]
    for bit in range(3):
        step, new = 1 << bit, list(vecs)
        lo = [lane if not lane & step else 16 + (lane ^ step) for lane in range(16)]
        hi = [lane | step if not lane & step else 16 + lane for lane in range(16)]
        for v in range(8):
            if v & step:
                continue
            new[v] = shuffle(b, vecs[v], vecs[v | step], lo)
            new[v | step] = shuffle(b, vecs[v], vecs[v | step], hi)
        vecs = new
    return vecs


def _f16_lanes(b, ptrs, off):
    """<16 x f32> of the f16 at byte `off` of each of the 16 blocks `ptrs`."""
    v = ir.Constant(V(I16, LANES), ir.Undefined)
    for j, p in enumerate(ptrs):
        v = b.insert_element(v, load(b, p, i64(off), I16), ir.Constant(I32, j))
    return b.fpext(b.bitcast(v, V(ir.HalfType(), LANES)), V(F32, LANES))


def define_packed(mod, name, t, fallback):
    """void name(w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst),
    the matmul ABI (_ir.py): 16 weight rows r0 .. r0 + 15 by all m activation rows
    (x as quantized, signed; s the `prep_packed` rows); a chunk of another size (a
    matrix's last rows) goes to `fallback`, the format's tile function."""
    fmt = FORMATS[t]
    bpb = fmt.block_bytes
    with_min = fmt.m_offset is not None
    with_off = bool(unsigned_offset(t))
    argtys = [I8P, I64, I64, I64, I64, I64] + [I8P, I64] * 5
    fn, b = _function(mod, name, argtys)
    (w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst) = fn.args
    vec = V(I8, 64)
    with b.goto_entry_block():
        scratch = b.alloca(vec, size=i64(CHUNK * _VECS))
    with b.if_else(b.icmp_signed("==", b.sub(r1, r0), i64(LANES))) as (full, other):
        with other:
            b.call(fallback, list(fn.args))
        with full:
            nblk = b.udiv(rb, i64(bpb))
            nchunk = b.udiv(b.add(nblk, i64(CHUNK - 1)), i64(CHUNK))
            rows = [b.gep(w, [b.mul(b.add(r0, i64(j)), rb)]) for j in range(LANES)]
            with for_range(b, i64(0), nchunk) as c:
                k0 = b.mul(c, i64(CHUNK))
                nb = b.sub(nblk, k0)
                nb = b.select(b.icmp_signed("<", nb, i64(CHUNK)), nb, i64(CHUNK))
                _repack(b, t, rows, k0, nb, scratch)
                offs = b.gep(s, [b.mul(nblk, i64(32))])     # prep_packed's offsets
                ctx = (t, x, xst, xd, xdst, xs, xsst, offs, sst, y, yst, b.add(col, r0),
                       k0, nb, scratch, with_min, with_off, c)
                ntile = b.udiv(m, i64(8))
                with for_range(b, i64(0), ntile) as tt:
                    _rows(b, ctx, b.mul(tt, i64(8)), 8)
                with for_range(b, b.mul(ntile, i64(8)), m) as t0:
                    _rows(b, ctx, t0, 1)
    b.ret_void()


def _repack(b, t, rows, k0, nb, scratch):
    """Blocks k0 .. k0 + nb - 1 of the 16 weight rows into the scratch, _VECS vectors
    per block: the 8 transposed quant vectors (unsigned u), d_w, m_w."""
    fmt = FORMATS[t]
    bpb = fmt.block_bytes
    with for_range(b, i64(0), nb) as i:
        o = b.mul(b.add(k0, i), i64(bpb))
        ptrs = [b.gep(r, [o]) for r in rows]
        quants = [b.bitcast(blk32_quants(b, p, t, 1, isa.AVX512VNNI), V(I32, 8))
                  for p in ptrs]
        base = b.mul(i, i64(_VECS))
        for k, v in enumerate(transpose16x8(b, quants)):
            b.store(b.bitcast(v, V(I8, 64)), b.gep(scratch, [b.add(base, i64(k))]))
        for slot, off in ((8, fmt.d_offset), (9, fmt.m_offset)):
            if off is not None:
                ptr = b.bitcast(b.gep(scratch, [b.add(base, i64(slot))]),
                                V(F32, LANES).as_pointer())
                b.store(_f16_lanes(b, ptrs, off), ptr)


def _rows(b, ctx, t0, n):
    """Activation rows t0 .. t0 + n - 1 against the repacked chunk: each row's 16
    outputs accumulate in one float vector, loaded from y after the first chunk."""
    (t, x, xst, xd, xdst, xs, xsst, s, sst, y, yst, col, k0, nb, scratch, with_min,
     with_off, c) = ctx
    f16 = V(F32, LANES)
    first = b.icmp_signed("==", c, i64(0))
    rows, accs = [], []
    for r in range(n):
        ti = b.add(t0, i64(r))
        yp = b.bitcast(b.gep(y, [b.add(b.mul(ti, yst), b.mul(col, i64(4)))]),
                       f16.as_pointer())
        acc = alloca(b, f16)
        b.store(b.select(first, ir.Constant(f16, None), b.load(yp, align=4)), acc)
        rows.append((b.gep(x, [b.mul(ti, xst)]), b.gep(xd, [b.mul(ti, xdst)]),
                     b.gep(xs, [b.mul(ti, xsst)]), b.gep(s, [b.mul(ti, sst)]), yp))
        accs.append(acc)
    with for_range(b, i64(0), nb) as i:
        base = b.mul(i, i64(_VECS))
        quants = [b.load(b.gep(scratch, [b.add(base, i64(k))])) for k in range(8)]

        def lanes(slot):
            p = b.gep(scratch, [b.add(base, i64(slot))])
            return b.load(b.bitcast(p, f16.as_pointer()))
        dw = lanes(8)
        mw = lanes(9) if with_min else None
        blk = b.add(k0, i)
        for (xr, xdr, xsr, sr, _), acc in zip(rows, accs):
            if with_off:
                tot = splat(b, load(b, sr, b.mul(blk, i64(4)), I32), LANES)
            else:
                tot = ir.Constant(V(I32, LANES), None)
            xo = b.mul(blk, i64(32))
            for k in range(8):
                xb = splat(b, load(b, xr, b.add(xo, i64(4 * k)), I32), LANES)
                tot = dpbusd(b, tot, quants[k], xb)
            d = b.fmul(dw, splat(b, load(b, xdr, b.mul(blk, i64(4)), F32), LANES))
            a = fma(b, d, b.sitofp(tot, f16), b.load(acc))
            if with_min:
                a = fma(b, mw, splat(b, load(b, xsr, b.mul(blk, i64(4)), F32), LANES), a)
            b.store(a, acc)
    for (_, _, _, _, yp), acc in zip(rows, accs):
        b.store(b.load(acc), yp, align=4)
