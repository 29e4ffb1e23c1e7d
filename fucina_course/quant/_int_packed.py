"""Prefill's GEMM: weight rows repacked so that one int32 lane is one weight row
(matmul's "packed" path), for every integer format at every level.

The tiles of _int_matmul.py keep a block's 8 int32 lanes per activation row, as the
one-row kernel does, and so pay the float work per block per row on 8 lanes: convert,
scale, fma.  For Q8_0 that is one conversion and one fma per vpdpbusd, and the
conversion competes with vpdpbusd for port 0 on Intel cores, which capped the 8-row
tile's rate (measured: docs/BENCHMARKS.md#packed-gemm-over-tiles).

Here 16 weight rows are transposed once per call, 4 bytes at a time, into 8 vectors
per 32 elements: vector k, lane j = bytes 4k..4k+3 of weight row j (`transpose`).
An activation row then broadcasts its 4 bytes (the `{1to16}` memory operand of
vpdpbusd), and 8 vpdpbusd leave the exact integer total of 32 elements in each of the
16 lanes, one per weight row.  One conversion and one fma then finish those 32
elements for 16 weight rows: 8 vpdpbusd + 2 float operations per (activation row,
32 elements, 16 weight rows), against 8 + 16 in the tiles.  A block's scales are laid
out the same way, one lane per weight row (`_Blk32`, `_KQuant`).  llama.cpp's repacked
GEMMs (REPACK) do this with 4 or 8 rows, repacking once at load; here the repack is
per call (a chunk of ~20-40 KB of stack at a time) and costs a few percent at m = 64:
no second copy of the weights in memory.

The ymm levels run the same layout with 8 lanes, the 16 rows of a call as two groups
of 8.  avxvnni has vpdpbusd on ymm.  avx2 has none: each 4-byte sum is vpmaddubsw
(pairs into saturating int16) then vpmaddwd by 1, and `_Dot` keeps that exact (int16
sums of a few vpmaddubsw for the 4-, 5- and 6-bit formats, the sign trick for Q8_0).
Layer matrices at m = 256 ran faster than on the tiles at both ymm levels, for Q8_0
and Q4_K alike (measured: docs/BENCHMARKS.md#packed-gemm-over-tiles).
The generic level has no tiles and no instruction beyond the host's own
(`byte_products`).  On x86-64 it runs avx2's byte products with SSSE3's pmaddubsw
and SSE2's pmaddwd by 128-bit halves (one ymm instruction each where the host has
AVX2); on other hosts, and for Q8_0, it widens the weights to int16 in the repack
and reads an int16 copy of the activations, one pmaddwd (plain IR off x86) per 2
bytes of each lane, `madd_host`.  A chunk of fewer than 16 weight rows repeats its
last row in the missing lanes.  It replaces BLAS there: Q8_0 and Q4_K layer matrices
at m = 64 and 256 ran faster than BLAS even as int16 pairs for both, and Q4_K's bytes
then halved its time (measured: docs/BENCHMARKS.md#packed-gemm-at-generic).

The aarch64 levels run 4 lanes (a NEON register) per group: `sdot` in its indexed
form, each of 4 activation bytes against a weight vector (`_Dot._sdot`), the weights
signed (no offsets), 4 activation rows per pass (`ARM_TILE`: llvm-mca, Q8_0, 1.02-1.08x
llama.cpp's `ggml_gemm_q8_0_4x4_q8_0` on Apple M1, Neoverse N1 / V1 and Cortex-A76
with the Q8_0 family's loads as `ld1` (`_ir.ld1x`); Q4_K 1.36-1.59x its
`ggml_gemm_q4_K_8x4_q8_K`; 8 lanes or 8 rows spilled registers).  At i8mm the
integer formats use `smmla` on two activation rows at a time (_int_smmla.py: Q8_0
1.07-1.12x llama.cpp's `ggml_gemm_q8_0_4x8_q8_0` on Apple M2 and Neoverse V1; Q4_K
1.28-1.38x its `ggml_gemm_q4_K_8x8_q8_K`, where `sdot` in dotprod's loop was 0.96x on
V1).

Numerics: each block's (K-quants: each sub-block's) total is the exact integer sum_j
u_j x_j, the weights as their unsigned u = q + off and the activations signed, the
lanes started at -off * sum_j x_j (`prep_packed`); then `acc = fma(d_w * d_x,
float(total), acc)` block after block (Q4_1 / Q5_1: plus `fma(m_w, s_x, acc)`;
K-quants: d_w * sc_s per sub-block, the mins by vpdpwssd, then d_x once per
super-block).  The same totals and the same float order at every level.  The result
does not depend on m, the tile or the thread, but it is not the one-row kernel's bit
for bit, so the "rows" path stays what batch decode and per-row steps use: they must
equal a one-token step exactly.
"""

from __future__ import annotations

import llvmlite.binding as ll
from gguf import GGMLQuantizationType as T
from llvmlite import ir

from . import isa
from ._int_matvec import (ROWS, blk32_quants, blk32_signed, prep_x16, q4k_d_dmin,
                          q4k_scales, unsigned_offset)
from ._ir import (F32, I8, I16, I32, MATMUL_ARGTYS, V, _function, alloca, biased_zero,
                  call, concat, const_vec, dpbusd, dpwssd, dpwssd_ir, fma, for_range, i64,
                  ld1x, load, load_f16, madd, madd_host, maddubs, pmaddwd, prefetch, sdot,
                  shuffle, splat, unbias, UNBIAS_SCALE, x86_triple)
from .formats import FORMATS

FORMATS_PACKED = (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K)
PACKED_LEVELS = isa.X86 + isa.ARM + (isa.GENERIC,)
# the largest unsigned quant u = q + off of each format (avx2: how many vpmaddubsw
# results may be summed in int16, `_Dot`)
_UMAX = {T.Q8_0: 255, T.Q4_0: 15, T.Q4_1: 15, T.Q5_0: 31, T.Q5_1: 31, T.Q4_K: 15,
         T.Q5_K: 31, T.Q6_K: 63}
# activation rows per pass over a repacked chunk.  On ymm, whose 16 registers cannot
# hold 8 rows' accumulators beside a block's 8 quant vectors, tiles of 4 or 6 rows were
# no faster (measured: docs/BENCHMARKS.md#packed-tile-rows)
TILE = 8
ARM_TILE = 4
I8MM_TILE = 2


def tile_rows(lay) -> int:
    """Activation rows per pass of layout `lay`: TILE, or ARM_TILE on aarch64, or the
    `smmla` layouts' own (`lay.mm`, _int_smmla.py: I8MM_TILE for the 32-element
    formats, 4 for the K-quants, whose sub-block loop LLVM unrolled whole with 2 and
    then ran at a third of the rate; llvm-mca, Q4_K on Neoverse V1)."""
    if getattr(lay, "mm", False):
        return lay.tile
    return ARM_TILE if isa.is_arm(lay.level) else TILE


# the repack prefetches the next group's weight rows (`_groups`); False builds the
# kernels without it, the other side of docs/BENCHMARKS.md's A/B
PREFETCH_AHEAD = True


def has_packed(t, level) -> bool:
    """Whether (format, level) has the packed GEMM: the integer formats at every level
    (generic: where its IR kernels are built, isa.GENERIC_IR)."""
    if level == isa.GENERIC and not isa.GENERIC_IR:
        return False
    return level in PACKED_LEVELS and t in FORMATS_PACKED


def lanes(level) -> int:
    """Weight rows per packed group: the int32 lanes of a zmm (16), a ymm (8) or a
    NEON register (4: aarch64, whose 32 registers then hold a block's 8 quant vectors
    beside 8 rows' accumulators; with 8 lanes they spilled, and llvm-mca put the
    Q8_0 loop at 0.94x llama.cpp's on Cortex-A76).  `_int.run` hands each call ROWS
    = 16 rows: one group, or several after each other."""
    if isa.is_arm(level):
        return 4
    return 16 if level == isa.AVX512VNNI else 8


assert ROWS % lanes(isa.AVX512VNNI) == 0 and ROWS % lanes(isa.AVX2) == 0


def _group_sums(b, x, k, size):
    """The sum (i32) of activation bytes k * size .. k * size + size - 1 of row x."""
    v = b.sext(load(b, x, b.mul(k, i64(size)), V(I8, size)), V(I32, size))
    return call(b, f"llvm.vector.reduce.add.v{size}i32", I32, v)


def transpose(b, rows):
    """L = 16 or 8 vectors <8 x i32> (row j, dword k) -> 8 vectors <L x i32> (dword
    k, lane j).  Each of the 3 steps swaps one bit of the vector index with one bit of
    the lane index by two-source shuffles: 24 in all (zmm: vpermt2d, 16 rows; ymm:
    unpacks and 128-bit permutes, 8 rows)."""
    n = len(rows)
    if n == 4:                                  # aarch64: 8 rows' lanes 0-3
        undef = ir.Constant(rows[0].type, ir.Undefined)
        return [shuffle(b, v, v, range(4)) for v in transpose(b, [*rows, *[undef] * 4])]
    vecs = (list(rows) if n == 8
            else [shuffle(b, rows[i], rows[i + 8], range(16)) for i in range(8)])
    for bit in range(3):
        step, new = 1 << bit, list(vecs)
        lo = [lane if not lane & step else n + (lane ^ step) for lane in range(n)]
        hi = [lane | step if not lane & step else n + lane for lane in range(n)]
        for v in range(8):
            if v & step:
                continue
            new[v] = shuffle(b, vecs[v], vecs[v | step], lo)
            new[v | step] = shuffle(b, vecs[v], vecs[v | step], hi)
        vecs = new
    return vecs


def _f16_lanes(b, ptrs, off):
    """<L x f32> of the f16 at byte `off` of each of the L blocks `ptrs`."""
    n = len(ptrs)
    v = ir.Constant(V(I16, n), ir.Undefined)
    for j, p in enumerate(ptrs):
        v = b.insert_element(v, load(b, p, i64(off), I16), ir.Constant(I32, j))
    return b.fpext(b.bitcast(v, V(ir.HalfType(), n)), V(F32, n))


def _store(b, scratch, index, v):
    """Vector `v` (a slot's 4 L bytes) into slot `index` (i64) of the scratch."""
    b.store(b.bitcast(v, scratch.type.pointee), b.gep(scratch, [index]))


def _slot(b, scratch, index, ty):
    """Slot `index` (i64) of the scratch, loaded as `ty` (4 L bytes)."""
    return b.load(b.bitcast(b.gep(scratch, [index]), ty.as_pointer()))


def _bcast(b, ptr, off, n, ty=I32):
    """A scalar of `ty` at byte `off` of `ptr`, in all n lanes (zmm: LLVM folds it
    into the `{1to16}` memory operand of the instruction that uses it)."""
    return splat(b, load(b, ptr, off, ty), n)


def byte_products(t, level, triple=None) -> bool:
    """Whether the packed GEMM of format `t` at `level` multiplies the weights as
    bytes (u8 x s8: vpdpbusd, or pmaddubsw then pmaddwd) rather than as int16 pairs
    (pmaddwd, `madd_host`): at every x86 level; at the generic level for an x86-64
    target with SSSE3 (`triple`: the module's, this process's by default), but for
    Q8_0.  That is every x86 CPU the generic IR kernels run on: they need F16C
    (isa.GENERIC_IR), which came after SSSE3 at Intel and AMD alike.

    Measured at generic (docs/BENCHMARKS.md#bytes-or-int16-pairs): bytes faster than
    int16 pairs for the 4-, 5- and 6-bit formats (up to twice as fast), slower for
    Q8_0, whose sign trick costs as many instructions as the int16 pairs and a psignb
    on top.  (At avx2, on native ymm instructions, the same sign trick measured even
    with int16 pairs, so avx2 keeps it: one layout for all its formats.)  int16 pairs
    elsewhere (ARM: NEON has no pair product of bytes, only the dot product
    extension's)."""
    if level != isa.GENERIC:
        return True
    triple = triple or ll.get_process_triple()
    return (t != T.Q8_0 and x86_triple(triple)
            and "+ssse3" in isa.target(level)[1].split(","))


class _Dot:
    """tot + each lane's integer dot product of len(quants) * 4 bytes, the repacked
    weights (unsigned) with 4 broadcast activation bytes (signed) per vector.

    VNNI levels: one vpdpbusd per vector.  avx2, and generic on x86-64 but for Q8_0
    (`byte_products`: SSSE3's pmaddubsw and SSE2's pmaddwd by 128-bit halves,
    `maddubs_host`, `madd_host`): pmaddubsw (pairs into saturating int16) then
    pmaddwd by 1 into int32.  A pair is at most 2 * umax * 128, so `group` = 32767 //
    that many pmaddubsw results add up exactly in int16 before one pmaddwd: 8 for the
    4-bit formats, 4 for the 5-bit ones, 2 for Q6_K -- 1.1 to 1.5 instructions per
    vector instead of 3.  Q8_0 (umax 255) would saturate even alone: it takes ggml's
    sign trick instead (avx2), |q| as the unsigned side and x * sign(q) as the
    signed one (`signs`: the repacked q themselves), 4 instructions per vector.

    Generic elsewhere, and its Q8_0 (`int16`): no target intrinsic.  The weights are
    repacked as signed int16 (q, not u: no offsets), 2 per lane, the activations read
    from the prep's int16 copy, and each vector is one pmaddwd-shaped multiply and an
    add (`madd_host`): 2 instructions per 2 bytes of each lane, exact for every format.
    Before byte products measured faster (`byte_products`), the generic level's way for
    every format on x86 too."""

    def __init__(self, level, t, triple=None):
        self.level, self.n = level, lanes(level)
        self.arm = isa.is_arm(level)            # signed weights, `sdot`
        self.int16 = not byte_products(t, level, triple)
        self.maddubs = level in (isa.AVX2, isa.GENERIC) and not self.int16
        self.signed = self.maddubs and t == T.Q8_0
        self.group = (32767 // (2 * _UMAX[t] * 128)
                      if self.maddubs and not self.signed else 1)
        assert self.group >= 1, t

    def _widen(self, b, s16):
        """<n x i32>: the sums of adjacent int16 pairs (pmaddwd by 1)."""
        return _madd(b, self.level, s16, const_vec(I16, 2 * self.n, 1))

    def __call__(self, b, tot, quants, x, xo, signs=None):
        n = self.n
        if self.arm:
            return self._sdot(b, tot, quants, x, xo)
        xbs = [b.bitcast(_bcast(b, x, b.add(xo, i64(4 * k)), n), V(I8, 4 * n))
               for k in range(len(quants))]
        if self.int16:                          # int16 pairs: x the prep's int16 copy
            for q, xb in zip(quants, xbs):
                tot = b.add(tot, madd_host(b, q, xb))
            return tot
        if not self.maddubs:
            for q, xb in zip(quants, xbs):
                tot = dpbusd(b, tot, q, xb)
            return tot
        if self.signed:
            for q, sq, xb in zip(quants, signs, xbs):
                sx = call(b, "llvm.x86.avx2.psign.b", V(I8, 32), xb, sq)
                tot = b.add(tot, self._widen(b, maddubs(b, self.level, q, sx)))
            return tot
        for g in range(0, len(quants), self.group):
            s16 = None
            for q, xb in zip(quants[g:g + self.group], xbs[g:g + self.group]):
                p = maddubs(b, self.level, q, xb)
                s16 = p if s16 is None else b.add(s16, p)
            tot = b.add(tot, self._widen(b, s16))
        return tot


    def _sdot(self, b, tot, quants, x, xo):
        """aarch64: the weights signed, each vector's 4-byte groups by 4 activation
        bytes: x loaded 16 bytes at a time and each group's lane splat into the
        operand, which LLVM folds into `sdot`'s indexed form (`sdot v.4s, v.16b,
        v.4b[k]`, llama.cpp's `vdotq_laneq_s32`): no load per group.  A block's 32
        bytes in one `ld1` of two registers (`ld1x`: why)."""
        xvs = (ld1x(b, x, xo, 2, self.level) if len(quants) == 8      # 32 bytes
               else [load(b, x, b.add(xo, i64(16 * j)), V(I8, 16))
                     for j in range((len(quants) + 3) // 4)])
        for k, q in enumerate(quants):
            xv = b.bitcast(xvs[k // 4], V(I32, 4))
            xb = b.bitcast(shuffle(b, xv, xv, [k % 4] * 4), V(I8, 16))
            tot = sdot(b, self.level, tot, q, concat(b, [xb] * (q.type.count // 16)))
        return tot


def _madd(b, level, a16, b16):
    """Pairs of int16 products summed per int32 lane: vpmaddwd, or at the generic
    level `madd_host` (SSE2's by halves on x86-64, plain IR elsewhere)."""
    if level == isa.GENERIC:
        return madd_host(b, a16, b16)
    if isa.is_arm(level):
        return madd(b, level, a16, b16)
    return pmaddwd(b, a16, b16)


def _dpwssd(b, level, acc, a16, b16):
    """acc + pairs of int16 products per lane: vpdpwssd on the VNNI levels, vpmaddwd
    (generic: `madd_host`) and an add elsewhere."""
    if level in (isa.GENERIC, isa.AVX2):
        return b.add(acc, _madd(b, level, a16, b16))
    if isa.is_arm(level):
        return dpwssd_ir(b, acc, a16, b16)
    return dpwssd(b, acc, a16, b16)


def _lane_vectors(b, rows, wide):
    """L rows' 32 quant bytes (<32 x i8> each) -> the vectors of the packed layout:
    8 of 4 bytes per lane, or (`wide`, the generic level) 16 of 2 int16 per lane,
    the bytes sign-extended (the first 16 of each row, then the last 16)."""
    if not wide:
        return transpose(b, [b.bitcast(r, V(I32, 8)) for r in rows])
    w = [b.bitcast(b.sext(r, V(I16, 32)), V(I32, 16)) for r in rows]
    return [v for h in (0, 1)
            for v in transpose(b, [shuffle(b, r, r, range(8 * h, 8 * h + 8))
                                   for r in w])]


class _Blk32:
    """The 32-element formats: per block 8 quant vectors (u = q + off), d_w, m_w.
    Each block's lanes start at the row's -off * sum(x) (the prep's int32 per 32) and
    end with the block's exact integer total.  avx2 Q8_0 (the sign trick, `_Dot`):
    8 vectors of |q| and 8 of q instead, and no offset; generic: 16 vectors of q as
    int16 pairs, no offset."""

    CHUNK = 64          # blocks repacked at a time: 64 x 640 bytes (zmm)
    QK = 32

    def __init__(self, t, level, triple=None):
        self.t, self.fmt, self.level, self.n = t, FORMATS[t], level, lanes(level)
        self.dot = _Dot(level, t, triple)
        self.wide = self.dot.int16                   # int16 weights, signed
        self.nq = 16 if self.wide else 8             # quant vectors per block ...
        self.nsign = 8 if self.dot.signed else 0     # ... and q's, for the sign trick
        self.dslot = self.nq + self.nsign            # d_w's slot, then m_w's
        self.VECS = self.dslot + 2
        self.signed_q = self.dot.signed or self.wide or self.dot.arm   # q, not u
        self.off = 0 if self.signed_q else unsigned_offset(t)
        self.ext = 8 if self.off else None      # prep: n / 8 bytes (an i32 per 32)

    def prep_ext(self, b, x, n, out):
        oi = b.bitcast(out, I32.as_pointer())
        with for_range(b, i64(0), b.udiv(n, i64(32))) as k:
            b.store(b.mul(_group_sums(b, x, k, 32), ir.Constant(I32, -self.off)),
                    b.gep(oi, [k]))

    def repack(self, b, ptrs, scratch, base):
        quants = [blk32_quants(b, p, self.t, 1, self.level) for p in ptrs]
        if self.signed_q:
            quants = [blk32_signed(b, self.t, u) for u in quants]
        for k, v in enumerate(_lane_vectors(b, quants, self.wide)):
            if not self.dot.signed:
                _store(b, scratch, b.add(base, i64(k)), v)
                continue
            q = b.bitcast(v, V(I8, 4 * self.n))     # |q| in slots 0-7, q in 8-15
            zero = ir.Constant(q.type, None)
            aq = b.select(b.icmp_signed("<", q, zero), b.sub(zero, q), q)
            _store(b, scratch, b.add(base, i64(k)), aq)
            _store(b, scratch, b.add(base, i64(self.nq + k)), q)
        self.store_scales(b, ptrs, scratch, base)

    def store_scales(self, b, ptrs, scratch, base):
        """d_w (and m_w) of the group's blocks `ptrs`, a lane per weight row."""
        fmt = self.fmt
        for slot, off in ((self.dslot, fmt.d_offset), (self.dslot + 1, fmt.m_offset)):
            if off is not None:
                _store(b, scratch, b.add(base, i64(slot)), _f16_lanes(b, ptrs, off))

    def compute(self, b, scratch, base, blk, rows, accs):
        n = self.n
        fv = V(F32, n)
        qv = V(I16, 2 * n) if self.wide else V(I8, 4 * n)
        if self.dot.arm:                    # 8 slots of 16 bytes: two `ld1` (ld1x)
            p = b.bitcast(b.gep(scratch, [base]), I8.as_pointer())
            quants = [v for h in (0, 1) for v in ld1x(b, p, i64(64 * h), 4, self.level)]
        else:
            quants = [_slot(b, scratch, b.add(base, i64(k)), qv)
                      for k in range(self.nq)]
        signs = ([_slot(b, scratch, b.add(base, i64(self.nq + k)), qv)
                  for k in range(self.nsign)] if self.nsign else None)
        dw = _slot(b, scratch, b.add(base, i64(self.dslot)), fv)
        mw = (_slot(b, scratch, b.add(base, i64(self.dslot + 1)), fv)
              if self.fmt.m_offset is not None else None)
        for (x, xd, xs, ext), acc in zip(rows, accs):
            tot = (_bcast(b, ext, b.mul(blk, i64(4)), n) if self.off
                   else ir.Constant(V(I32, n), None))
            xo = b.mul(blk, i64(64 if self.wide else 32))
            tot = self.dot(b, tot, quants, x, xo, signs)
            d = b.fmul(dw, _bcast(b, xd, b.mul(blk, i64(4)), n, F32))
            a = fma(b, d, b.sitofp(tot, fv), b.load(acc))
            if mw is not None:
                a = fma(b, mw, _bcast(b, xs, b.mul(blk, i64(4)), n, F32), a)
            b.store(a, acc)


class _KQuant:
    """Q4_K / Q5_K (8 sub-blocks of 32, 6-bit scales and mins) and Q6_K (16 of 16,
    int8 scales, u = q + 32).  Per super-block: the quant vectors of every sub-block
    (8 per 32 elements), d_w * sc_s per sub-block as floats (exact: an f16 times a
    6- or 8-bit integer), and for Q4_K / Q5_K the mins as int16 pairs and -dmin_w.
    A row's super-block: each sub-block's exact integer total, converted and scaled
    by d_w * sc_s (one fma per sub-block for all lanes' weight rows); Q4_K / Q5_K
    subtract dmin_w * sum_s m_s bsum_s (vpdpwssd on int16 pairs: the prep packs the
    row's sums of 32 as pairs); then one fma by d_x.  Generic: the quant vectors as
    int16 pairs (16 per 32 elements), Q6_K's as q, without its offset.  aarch64: the
    sub-block totals start at the bits of 1.5 and d_w * sc_s is stored times 2**23
    (`_scale`), the same floats by one vector operation fewer (_ir.unbias)."""

    CHUNK = 8           # super-blocks repacked at a time: 8 x 4.9-5 KB (zmm)
    QK = 256
    DSC_SLOTS = 1       # scratch slots per sub-block's d_w * sc_s

    def __init__(self, t, level, triple=None):
        self.t, self.fmt, self.level, self.n = t, FORMATS[t], level, lanes(level)
        self.dot = _Dot(level, t, triple)
        self.six = t == T.Q6_K
        self.wide = self.dot.int16                   # int16 weights (Q6_K: q - 32)
        self.signed_q = self.wide or self.dot.arm    # Q6_K: q - 32, no offsets
        self.nsub = 16 if self.six else 8            # sub-blocks per super-block
        self.qvecs = 128 if self.wide else 64        # quant vectors per super-block
        self.dscs = self.nsub * self.DSC_SLOTS      # slots of the d_w * sc_s
        self.VECS = self.qvecs + self.dscs + (0 if self.six else 5)
        # prep: Q6_K -32 * (sum of 16) as i32 (n / 4 bytes; generic: none, the
        # weights are signed); Q4_K/Q5_K the sums of 32 as int16 pairs (n / 16 bytes)
        self.ext = (None if self.signed_q else 4) if self.six else 16

    def prep_ext(self, b, x, n, out):
        oi = b.bitcast(out, I32.as_pointer())
        if self.six:
            with for_range(b, i64(0), b.udiv(n, i64(16))) as k:
                b.store(b.mul(_group_sums(b, x, k, 16), ir.Constant(I32, -32)),
                        b.gep(oi, [k]))
            return
        with for_range(b, i64(0), b.udiv(n, i64(64))) as k:
            two = b.mul(k, i64(2))
            lo = _group_sums(b, x, two, 32)
            hi = _group_sums(b, x, b.add(two, i64(1)), 32)
            pair = b.or_(b.and_(lo, ir.Constant(I32, 0xFFFF)),
                         b.shl(hi, ir.Constant(I32, 16)))
            b.store(pair, b.gep(oi, [k]))

    def _sub_quants(self, b, p, v):
        """<8 x i32>: unsigned quants v * 32 .. v * 32 + 31 of block p (v an i64):
        Q4_K / Q5_K sub-block v; Q6_K sub-blocks 2v, 2v + 1.  `repack` loops over v at
        run time: unrolled, the 8 sub-blocks' transpositions tripled the LLVM compile
        time of the K-quant modules."""
        fmt = self.fmt

        def shr(vec, amount):                         # every byte by one i64 amount
            return b.lshr(vec, splat(b, b.trunc(amount, I8), 32))

        def low_bits(vec, n):
            return b.and_(vec, const_vec(I8, 32, (1 << n) - 1))

        if self.six:                                  # ggml's q6 layout, half v // 4
            half, k = b.lshr(v, i64(2)), b.and_(v, i64(3))
            ql = load(b, p, b.add(i64(fmt.qs_offset), b.add(b.mul(half, i64(64)),
                                  b.mul(b.and_(k, i64(1)), i64(32)))), V(I8, 32))
            lo = low_bits(shr(ql, b.mul(b.lshr(k, i64(1)), i64(4))), 4)
            qh = load(b, p, b.add(i64(fmt.qh_offset), b.mul(half, i64(32))), V(I8, 32))
            hi = b.shl(low_bits(shr(qh, b.mul(k, i64(2))), 2), const_vec(I8, 32, 4))
            return b.bitcast(b.or_(lo, hi), V(I32, 8))
        q = load(b, p, b.add(i64(fmt.qs_offset), b.mul(b.lshr(v, i64(1)), i64(32))),
                 V(I8, 32))
        q = low_bits(shr(q, b.mul(b.and_(v, i64(1)), i64(4))), 4)
        if self.t == T.Q5_K:
            h = low_bits(shr(load(b, p, i64(fmt.qh_offset), V(I8, 32)), v), 1)
            q = b.or_(q, b.shl(h, const_vec(I8, 32, 4)))
        return b.bitcast(q, V(I32, 8))

    def repack(self, b, ptrs, scratch, base):
        per32 = self.qvecs // 8                        # vectors per 32 elements
        with for_range(b, i64(0), i64(8)) as v:        # 32 elements at a time
            rows = [b.bitcast(self._sub_quants(b, p, v), V(I8, 32)) for p in ptrs]
            if self.signed_q and self.six:
                rows = [b.sub(r, const_vec(I8, 32, 32)) for r in rows]
            for k, vec in enumerate(self._quant_vectors(b, rows)):
                _store(b, scratch, b.add(base, b.add(b.mul(v, i64(per32)), i64(k))),
                       vec)
        q = self.qvecs
        if self.six:
            dws = [load_f16(b, p, i64(self.fmt.d_offset)) for p in ptrs]
            for g in range(2):      # scales 8g .. 8g + 7
                rows = []
                for p, dw in zip(ptrs, dws):
                    sc = load(b, p, i64(self.fmt.scales_offset + 8 * g), V(I8, 8))
                    f = self._scale(b, b.fmul(splat(b, dw, 8), b.sitofp(sc, V(F32, 8))))
                    rows.append(b.bitcast(f, V(I32, 8)))
                for k, vec in enumerate(transpose(b, rows)):
                    self._store_dsc(b, scratch, base, 8 * g + k, vec)
            return
        dsc, mins, negdmin = [], [], []
        for p in ptrs:
            raw16 = load(b, p, None, V(I8, 16))
            sm = q4k_scales(b, raw16)                       # sc[0..7], m[0..7]
            ddw = q4k_d_dmin(b, raw16)
            d = b.extract_element(ddw, ir.Constant(I32, 0))
            sc = b.uitofp(shuffle(b, sm, sm, range(8)), V(F32, 8))
            dsc.append(b.bitcast(self._scale(b, b.fmul(splat(b, d, 8), sc)), V(I32, 8)))
            m16 = b.zext(shuffle(b, sm, sm, range(8, 16)), V(I16, 8))
            m32 = b.bitcast(m16, V(I32, 4))
            mins.append(shuffle(b, m32, ir.Constant(V(I32, 4), None), range(8)))
            negdmin.append(b.fneg(b.extract_element(ddw, ir.Constant(I32, 1))))
        for k, vec in enumerate(transpose(b, dsc)):
            self._store_dsc(b, scratch, base, k, vec)
        q += self.dscs                              # the mins' slots, then -dmin_w's
        for k, vec in enumerate(transpose(b, mins)[:4]):
            _store(b, scratch, b.add(base, i64(q + k)), vec)
        nd = ir.Constant(V(F32, self.n), ir.Undefined)
        for j, v in enumerate(negdmin):
            nd = b.insert_element(nd, v, ir.Constant(I32, j))
        _store(b, scratch, b.add(base, i64(q + 4)), nd)

    def _quant_vectors(self, b, rows):
        """The scratch vectors of 32 elements of the group's rows (<32 x i8> each)."""
        return _lane_vectors(b, rows, self.wide)

    def _store_dsc(self, b, scratch, base, k, vec):
        """Sub-block k's d_w * sc_s (a lane per weight row) into its slot."""
        _store(b, scratch, b.add(base, i64(self.qvecs + k)), vec)

    def _scale(self, b, dsc):
        """d_w * sc_s as `compute` uses it: on aarch64 times 2**23, which its
        sub-block totals carry as t / 2**23 (_ir.unbias: why)."""
        if not self.dot.arm:
            return dsc
        return b.fmul(dsc, const_vec(F32, dsc.type.count, UNBIAS_SCALE))

    def compute(self, b, scratch, base, blk, rows, accs):
        n = self.n
        fv = V(F32, n)
        zero = ir.Constant(fv, None)
        sub = [alloca(b, fv) for _ in rows]         # each row's sum_s d sc_s total_s
        for a in sub:
            b.store(zero, a)
        per = self.qvecs // self.nsub               # quant vectors per sub-block
        qv = V(I16, 2 * n) if self.wide else V(I8, 4 * n)
        q, xbytes = self.qvecs, 512 if self.wide else 256     # x bytes per 256
        with for_range(b, i64(0), i64(self.nsub)) as s:
            quants = [_slot(b, scratch, b.add(base, b.add(b.mul(s, i64(per)), i64(k))),
                            qv) for k in range(per)]
            dsc = _slot(b, scratch, b.add(base, b.add(i64(q), s)), fv)
            for (x, xd, xs, ext), a in zip(rows, sub):
                if self.ext == 4:                   # lanes start at -32 * sum(x)
                    g = b.add(b.mul(blk, i64(16)), s)
                    tot = _bcast(b, ext, b.mul(g, i64(4)), n)
                elif self.dot.arm:                  # _ir.unbias: why
                    tot = biased_zero(n)
                else:
                    tot = ir.Constant(V(I32, n), None)
                xo = b.add(b.mul(blk, i64(xbytes)), b.mul(s, i64(4 * per)))
                tot = self.dot(b, tot, quants, x, xo)
                ft = unbias(b, tot) if self.dot.arm else b.sitofp(tot, fv)
                b.store(fma(b, dsc, ft, b.load(a)), a)
        if not self.six:
            pairs, negdmin = self._mins(b, scratch, base)
        for (x, xd, xs, ext), a, acc in zip(rows, sub, accs):
            total = b.load(a)
            if not self.six:
                msum = self._msum(b, blk, ext, pairs)
                total = fma(b, negdmin, b.sitofp(msum, fv), total)
            dx = _bcast(b, xd, b.mul(blk, i64(4)), n, F32)
            b.store(fma(b, total, dx, b.load(acc)), acc)

    def _mins(self, b, scratch, base):
        """Q4_K / Q5_K: the mins as int16 pairs (4 vectors), and -dmin_w."""
        q = self.qvecs + self.dscs
        pairs = [_slot(b, scratch, b.add(base, i64(q + k)), V(I16, 2 * self.n))
                 for k in range(4)]
        return pairs, _slot(b, scratch, b.add(base, i64(q + 4)), V(F32, self.n))

    def _msum(self, b, blk, ext, pairs):
        """sum_s m_s bsum_s of super-block blk, a lane per weight row (int32)."""
        n = self.n
        msum = ir.Constant(V(I32, n), None)
        for k in range(4):
            pair = b.add(b.mul(blk, i64(4)), i64(k))
            bp = _bcast(b, ext, b.mul(pair, i64(4)), n)
            msum = _dpwssd(b, self.level, msum, pairs[k], bp)
        return msum


# The i8mm layouts, by block size: _int_smmla.Blk32Pairs and KQuantPairs build on _Blk32
# and _KQuant, so they register themselves here when _int_smmla is imported (_int.py
# does) instead of this module importing it back (an import cycle).
PAIRED_LAYOUTS: dict = {}


def _layout(t, level, triple=None):
    qk = FORMATS[t].block_size
    if level == isa.I8MM:
        if qk not in PAIRED_LAYOUTS:
            raise RuntimeError("import quant._int_smmla before building i8mm kernels")
        return PAIRED_LAYOUTS[qk](t, level, triple)
    return _KQuant(t, level, triple) if qk == 256 else _Blk32(t, level, triple)


def _ext_at(b, lay, n):
    """Where a scratch row's `prep_ext` data starts: after n bytes (the tile's prep,
    if any), or after the generic level's int16 activations (2n)."""
    return b.mul(n, i64(2 if lay.wide else 1))


def prep_packed(t, level, tile_prep, triple=None):
    """The prep body of the packed path: the tile's own prep (`tile_prep`, or None) in
    s[0:n], for the chunks that fall back to the tiles (generic: the activations as
    int16 in s[0:2n]), then the layout's per-row data (`prep_ext`: n / 4 bytes at
    most; `_int.run` sizes the packed path's scratch rows for both).  None if there is
    nothing to do.  `triple`: the module's target (`byte_products`)."""
    lay = _layout(t, level, triple)
    if lay.wide:
        tile_prep = prep_x16
    if lay.ext is None and tile_prep is None:
        return None

    def body(b, x, n, s):
        if tile_prep is not None:
            tile_prep(b, x, n, s)
        if lay.ext is not None:
            lay.prep_ext(b, x, n, b.gep(s, [_ext_at(b, lay, n)]))
    return body


def define_packed(mod, name, t, level, fallback):
    """void name(w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst),
    the matmul ABI (_ir.py): ROWS = 16 weight rows r0 .. r0 + 15 by all m activation
    rows (x as quantized, signed; s the `prep_packed` rows), in groups of `lanes`
    rows (one on zmm, two after each other on ymm).  A chunk of fewer rows (a
    matrix's last rows) goes to `fallback`, the format's tile function; the generic
    level has no tiles (fallback None): its groups repeat their last row in the
    missing lanes and store only the rows that exist."""
    lay = _layout(t, level, mod.triple)
    n = lay.n
    fn, b = _function(mod, name, MATMUL_ARGTYS)
    (w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst) = fn.args
    with b.goto_entry_block():
        scratch = b.alloca(V(I8, 4 * n), size=i64(lay.CHUNK * lay.VECS))
    count = b.sub(r1, r0)
    if fallback is not None:
        with b.if_else(b.icmp_signed("==", count, i64(ROWS))) as (full, other):
            with other:
                b.call(fallback, list(fn.args))
            with full:
                _groups(b, lay, fn.args, scratch, i64(ROWS // n), partial=False)
    else:
        ngroup = b.udiv(b.add(count, i64(n - 1)), i64(n))
        _groups(b, lay, fn.args, scratch, ngroup, partial=True)
    b.ret_void()


def _groups(b, lay, args, scratch, ngroup, partial):
    """The ngroup groups of `lay.n` weight rows from r0 on: each repacked a chunk at a
    time, all activation rows passed over each chunk (`_rows`).  `partial`: the last
    group may have fewer rows (generic): its missing lanes repeat row r1 - 1.

    The repack of a block also prefetches the same block of the next group's rows: a
    prefill reads each layer's weights once, from DRAM, 16 rows' blocks side by side
    (rows 1-2 KB apart), a pattern the hardware prefetchers follow poorly.  The whole
    next group arrives while this one's blocks meet every activation row."""
    (w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst) = args
    bpb, n = lay.fmt.block_bytes, lay.n
    nblk = b.udiv(rb, i64(bpb))
    nchunk = b.udiv(b.add(nblk, i64(lay.CHUNK - 1)), i64(lay.CHUNK))
    ext = b.gep(s, [_ext_at(b, lay, b.mul(nblk, i64(lay.QK)))])  # prep_ext's data
    last = b.sub(r1, i64(1))
    with for_range(b, i64(0), ngroup) as g:
        rg = b.add(r0, b.mul(g, i64(n)))
        valid = i64(n)                            # rows of the group that exist
        if partial:
            valid = b.sub(r1, rg)
            valid = b.select(b.icmp_signed("<", valid, i64(n)), valid, i64(n))
        rows, ahead = [], []
        for j in range(n):
            r = b.add(rg, i64(j))
            # the next group's row j (past r1: the next call's rows, or past the
            # matrix's end, where a prefetch is ignored: it never faults)
            ahead.append(b.gep(w, [b.mul(b.add(r, i64(n)), rb)]))
            if partial:
                r = b.select(b.icmp_signed("<", r, r1), r, last)
            rows.append(b.gep(w, [b.mul(r, rb)]))
        with for_range(b, i64(0), nchunk) as c:
            k0 = b.mul(c, i64(lay.CHUNK))
            nb = b.sub(nblk, k0)
            nb = b.select(b.icmp_signed("<", nb, i64(lay.CHUNK)), nb, i64(lay.CHUNK))
            with for_range(b, i64(0), nb) as i:
                o = b.mul(b.add(k0, i), i64(bpb))
                lay.repack(b, [b.gep(r, [o]) for r in rows], scratch,
                           b.mul(i, i64(lay.VECS)))
                for r in ahead if PREFETCH_AHEAD else ():    # _groups: why
                    for line in range(0, bpb, 64):
                        prefetch(b, r, b.add(o, i64(line)))
            ctx = (lay, x, xst, xd, xdst, xs, xsst, s, ext, sst, y, yst,
                   b.add(col, rg), k0, nb, scratch, c, valid if partial else None)
            tile = tile_rows(lay)
            # i8mm: rows in pairs (_int_smmla.pair_rows)
            rows = lay.emit_rows if getattr(lay, "mm", False) else _rows
            ntile = b.udiv(m, i64(tile))
            with for_range(b, i64(0), ntile) as tt:
                rows(b, ctx, b.mul(tt, i64(tile)), tile)
            with for_range(b, b.mul(ntile, i64(tile)), m) as t0:
                rows(b, ctx, t0, 1)


def _rows(b, ctx, t0, count):
    """Activation rows t0 .. t0 + count - 1 against the repacked chunk: each row's
    outputs (one per lane) accumulate in one float vector, loaded from y after the
    first chunk.  With `valid` (the generic level: None elsewhere) only the group's
    first `valid` lanes are read from and written to y (all of them but in its last
    group)."""
    (lay, x, xst, xd, xdst, xs, xsst, s, ext, sst, y, yst, col, k0, nb, scratch, c,
     valid) = ctx
    fv = V(F32, lay.n)
    first = b.icmp_signed("==", c, i64(0))
    rows, accs, outs = [], [], []
    for r in range(count):
        ti = b.add(t0, i64(r))
        yp = b.bitcast(b.gep(y, [b.add(b.mul(ti, yst), b.mul(col, i64(4)))]),
                       fv.as_pointer())
        acc = alloca(b, fv)
        if valid is not None:
            _copy_lanes(b, yp, acc, valid, first)
        else:
            b.store(b.select(first, ir.Constant(fv, None), b.load(yp, align=4)), acc)
        xrow = b.gep(s, [b.mul(ti, sst)]) if lay.wide else b.gep(x, [b.mul(ti, xst)])
        rows.append((xrow, b.gep(xd, [b.mul(ti, xdst)]),
                     b.gep(xs, [b.mul(ti, xsst)]), b.gep(ext, [b.mul(ti, sst)])))
        accs.append(acc)
        outs.append(yp)
    with for_range(b, i64(0), nb) as i:
        lay.compute(b, scratch, b.mul(i, i64(lay.VECS)), b.add(k0, i), rows, accs)
    for yp, acc in zip(outs, accs):
        if valid is not None:
            _copy_lanes(b, acc, yp, valid)
        else:
            b.store(b.load(acc), yp, align=4)


def _copy_lanes(b, src, dst, valid, zero_if=None):
    """dst[0:valid] = src[0:valid] (float vectors in memory), or with `zero_if` (an
    i1) true, dst = 0.  One guarded store per lane, not a loop: LLVM would turn the
    loop into a call to memcpy."""
    fp = F32.as_pointer()
    sp, dp = b.bitcast(src, fp), b.bitcast(dst, fp)
    if zero_if is not None:
        b.store(ir.Constant(dst.type.pointee, None), dst)
        valid = b.select(zero_if, i64(0), valid)
    for j in range(dst.type.pointee.count if zero_if is not None
                   else src.type.pointee.count):
        with b.if_then(b.icmp_signed("<", i64(j), valid)):
            b.store(b.load(b.gep(sp, [i64(j)]), align=4), b.gep(dp, [i64(j)]), align=4)
