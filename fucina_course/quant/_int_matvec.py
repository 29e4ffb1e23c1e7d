"""Integer kernels, one weight row x one activation vector (`matvec`), every level.

Why.  The float kernels (matvec.py) widen every quant to float32, ~3.5 vector
instructions per 8 weights, and top out at 7-12 GB/s for the 4/5/6-bit formats, below
what memory streams (~25 GB/s on 2 threads).  ggml multiplies the bytes themselves.
With `vpdpbusd` (4 adjacent u8 x s8 products into each int32 lane), Q4_K decode got
over 1.5 times as fast (measured: docs/BENCHMARKS.md#integer-dot-products).

One integer operation per level (_ir.py `dot4`): the two VNNI levels add 4 products per
int32 lane with `vpdpbusd` (avx512vnni on zmm or ymm, avxvnni on ymm); avx2 does it in
two steps, `vpmaddubsw` (2 u8 x s8 products into a *saturating* int16) then `vpmaddwd`
by 1 -- ggml's AVX2 path.  One operand must be unsigned, and on avx2 no int16 pair may
exceed 2^15 - 1, which decides how each format is fed:

* Q4_K / Q5_K: the quants are unsigned nibbles (+16 for the 5th bit), at most 31.  VNNI:
  a lane holds at most 4 * 31 * 127 < 2^15, so two dpbusd results are packed to int16
  (vpackssdw, no saturation possible) and one vpdpwssd multiplies them by their 6-bit
  sub-block scales.  avx2: vpmaddubsw, then vpmaddwd by the sub-block's scale directly.
  Mins as in ggml: `m_sub * bsum_x[sub]` (vpmaddwd) times `dmin_w * d_x`, in a second
  float accumulator.  Q4_K at avx512vnni runs on zmm with the activations permuted once
  per call to its nibble order (`prep_interleave`); everything else on ymm.
* Q6_K / Q4_0 / Q5_0: the quants are stored unsigned, u = q + off (off = 32, 8, 16).
  Every lane starts from -off * (sum of its 4 activations), an int32 array made once
  per call (`prep_lane_offsets`), so each lane ends as the exact integer sum of its 4
  products q * x.  (Putting a whole block's offset into lane 0 gives the same total, but
  an all-zero Q8_0 block then came out as 1e-5 instead of 0: tests/test_quant.py's
  extreme-value test.)  avx2 Q6_K subtracts `vpmaddubsw(32, x)` from each int16 pair
  instead, as ggml does (a pair then holds sum q x, at most 8128 in magnitude).
* Q8_0: VNNI makes the quants unsigned with xor 0x80 (u = q + 128, offsets as above).
  That is too large for vpmaddubsw (255 * 127 * 2 > 2^15), so avx2 uses ggml's sign
  trick: |q| times x with q's sign (`abs_sign`; at most 128 * 127 * 2 = 32512).
* Q4_1 / Q5_1: unsigned quants and no offset: lane = the dot product; `m_w * s_x` per
  block into a second float accumulator.
* Then, for the 32-element formats and Q6_K, per (super-)block `acc += d * float(lane)`
  lane-wise, d = f16(d_w) * d_x (ggml's `_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi),
  acc)`), and one tree sum per row.  Integer sums are exact; only the order of float
  additions differs from llama.cpp (and from one level to another: the lanes group the
  products differently).  Q4_K / Q5_K instead sum each super-block's lanes to exact
  integer totals first (`q4k_row`): their float work is the same at every level, and a
  tile of rows does it for 8 rows in one vector.

The generic level builds every format with the same code, compiled for the host as
numba compiles its own code.  It has no byte multiply to rely on, so it reads an int16
copy of the activations made once per call (`prep_x16`) and multiplies with pmaddwd,
the one integer multiply every x86-64 CPU has (SSE2; plain IR elsewhere): the quants
as signed int16 (q itself: no offsets), 8 lanes of 4 products per 32 elements
(`blk32_lanes16`); Q4_K / Q5_K and Q6_K then pack their sub-blocks' lanes to int16
and scale them with one more pmaddwd, as the VNNI levels do with vpdpwssd
(`q4k_lanes16`, `q6k_lanes16`).

The aarch64 levels (isa.ARM) run the VNNI levels' builders with ARM's signed x signed
dot product (_ir.py `sdot`: `sdot` at dotprod / i8mm, the same lanes in plain IR at
neon): the quants signed (q, not u: no lane offsets, no prep), each lane the same
exact sum of 4 adjacent products, then the VNNI levels' steps (packssdw and vpdpwssd
as `pack_words` and `dpwssd_ir`, plain IR) and float work, so their rows equal
avx512vnni's and avxvnni's bit for bit (tests/test_quant_aarch64.py).

Which builder each (format, level) uses is registered in the format's record
(`FORMATS[t].kernels.int_rows`, end of file); _int.py turns them into kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from gguf import GGMLQuantizationType as T
from llvmlite import ir

from . import isa
from ._ir import (F16, F32, I8, I16, I32, I64, V, abs_sign, alloca, block_at, const_vec,
                  dot4, dpbusd, dpwssd, dpwssd_ir, fma, fold16, for_range, half, hsum_f32,
                  i64, load, load_f16, madd, madd_host, maddubs, pack_words, packssdw,
                  packssdw_host, prefetch, sdot, shuffle, splat, sum_pair, totals4)
from .formats import FORMATS, registers

ROWS = 16          # output rows per parallel chunk (_int.run)
PREFETCH = 2048    # bytes ahead in the weight stream (docs/BENCHMARKS.md#prefetch)

# --- activation preparation, once per call (define_prep bodies) -----------------------


def prep_interleave(b, x, n, s):
    """s[128 g + ...] = x[128 g + (0:32, 64:96, 32:64, 96:128)]: the order of Q4_K's
    low and high nibbles when 64 quant bytes (two 32-byte chunks) are unpacked at
    once (zmm)."""
    with for_range(b, i64(0), b.udiv(n, i64(128))) as g:
        o = b.mul(g, i64(128))
        for dst, src in ((0, 0), (32, 64), (64, 32), (96, 96)):
            v = load(b, x, b.add(o, i64(src)), V(I8, 32))
            p = b.gep(s, [b.add(o, i64(dst))])
            b.store(v, b.bitcast(p, V(I8, 32).as_pointer()), align=1)


def prep_lane_offsets(off):
    """A prep body: s int32[n/4] = -off * (x[4k] + ... + x[4k+3]), the start value of
    lane k when the weight quants are stored as u = q + off (the lane ends as sum q x).
    """
    def body(b, x, n, s):
        with for_range(b, i64(0), b.udiv(n, i64(32))) as k:
            v = b.sext(load(b, x, b.mul(k, i64(32)), V(I8, 32)), V(I32, 32))
            t = shuffle(b, v, v, range(0, 32, 4))
            for j in (1, 2, 3):
                t = b.add(t, shuffle(b, v, v, range(j, 32, 4)))
            t = b.mul(t, const_vec(I32, 8, -off))
            p = b.gep(s, [b.mul(k, i64(32))])
            b.store(t, b.bitcast(p, V(I32, 8).as_pointer()), align=1)
    return body


def prep_xor80(b, x, n, s):
    """s = x + 128 as bytes (x ^ 0x80): unsigned activations (_int_matmul's tiles)."""
    with for_range(b, i64(0), b.udiv(n, i64(32))) as k:
        o = b.mul(k, i64(32))
        v = b.xor(load(b, x, o, V(I8, 32)), const_vec(I8, 32, 0x80))
        b.store(v, b.bitcast(b.gep(s, [o]), V(I8, 32).as_pointer()), align=1)


# --- Q4_K / Q5_K ----------------------------------------------------------------------


def prep_x16(b, x, n, s):
    """The activations as int16, s[0:2n]: the generic level's Q4_K / Q5_K rows
    (`q4k_x16`) and its packed GEMM (_int_packed._Dot) read them."""
    s16 = b.bitcast(s, V(I16, 32).as_pointer())
    with for_range(b, i64(0), b.udiv(n, i64(32))) as k:
        v = load(b, x, b.mul(k, i64(32)), V(I8, 32))
        b.store(b.sext(v, V(I16, 32)), b.gep(s16, [k]), align=1)


def x16_at(b, s, e, n):
    """<n x i16>: the int16 activations from element e on, in the prep's copy in s
    (`prep_x16`)."""
    return load(b, s, b.mul(e, i64(2)), V(I16, n))


def lanes16(b, q16, x16):
    """<8 x i32>: 32 int16 quants by their 32 int16 activations, 4 products a lane
    (lane k: elements 2k, 2k+1, 16+2k, 17+2k): two pmaddwd (`madd_host`) and an
    add, the generic level's dot product."""
    return b.add(madd_host(b, half(b, q16, 0), half(b, x16, 0)),
                 madd_host(b, half(b, q16, 1), half(b, x16, 1)))


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


def q4k_scale_words(b, level, sm, width, sub_lo, sub_hi):
    """The sub-block scales as int16 words, for `q4k_dot`.  VNNI and generic: in the
    order of packssdw(dot_lo, dot_hi), per 128-bit lane L 4 words of lo's sub-block
    then 4 of hi's.  avx2: a pair (lo's scale in every word, hi's)."""
    undef = ir.Constant(V(I8, 16), None)
    if level == isa.AVX2:
        return tuple(b.bitcast(shuffle(b, sm, undef, _pairs_w([s] * 16, 16)),
                               V(I16, 16)) for s in (sub_lo[0], sub_hi[0]))
    idx = []
    for L in range(width // 128):
        h = (L * 4) // 8          # which 32-byte half lane L came from
        idx += [sub_lo[h]] * 4 + [sub_hi[h]] * 4
    return shuffle(b, sm, undef, _pairs_w(idx, 16))


def q4k_dot(b, level, sumi, lo, hi, xlo, xhi, sc):
    """sumi + the scaled products of one quant vector pair (lo, hi) with (xlo, xhi)
    (generic: int16 activations, `q4k_x16`)."""
    if level == isa.GENERIC:
        return b.add(sumi, madd_host(b, packssdw_host(b, q4k_lanes16(b, lo, xlo),
                                                      q4k_lanes16(b, hi, xhi)), sc))
    if isa.is_arm(level):         # the VNNI levels' steps, the nibbles as s8 (<= 31)
        return dpwssd_ir(b, sumi, pack_words(b, sdot(b, level, None, lo, xlo),
                                             sdot(b, level, None, hi, xhi)), sc)
    if level == isa.AVX2:
        plo = madd(b, level, maddubs(b, level, lo, xlo), sc[0])
        phi = madd(b, level, maddubs(b, level, hi, xhi), sc[1])
        return b.add(sumi, b.add(plo, phi))
    zero = ir.Constant(V(I32, lo.type.count // 4), None)
    dlo = dpbusd(b, zero, lo, xlo)
    dhi = dpbusd(b, zero, hi, xhi)
    return dpwssd(b, sumi, packssdw(b, dlo, dhi), sc)


def q4k_lanes16(b, q, x16):
    """<8 x i32>: the generic level's sub-block lanes, 4 products q x each (32 nibbles,
    +16 for Q5_K's 5th bit, by 32 int16 activations): two pmaddwd (`madd_host`) and
    an add.  |lane| <= 4 * 31 * 128 < 2^15, so `packssdw_host` keeps them exact, and
    one more pmaddwd multiplies them by the sub-block scales, as vpdpwssd does at the
    VNNI levels.  Why not `maddubs` as avx2: in plain IR it is a vpmovsxbw of x per
    row, a vpmullw and a horizontal add per 16 products (LLVM has no vpmaddubsw
    pattern); the int16 copy of x is made once per call (`prep_x16`)."""
    return lanes16(b, b.zext(q, V(I16, 32)), x16)


def q4k_x16(b, s, xo, j):
    """The int16 activations matching quant vector j (ymm), from the prep's copy in s
    (`prep_x16`): (x_lo, x_hi) as <32 x i16>."""
    e = b.add(xo, i64(64 * j))                       # element index
    return x16_at(b, s, e, 32), x16_at(b, s, b.add(e, i64(32)), 32)


def q4k_x(b, x, xo, j, width):
    """The activations matching quant vector j: (x_lo, x_hi).  zmm: x permuted per 128
    as [0:32, 64:96, 32:64, 96:128] (`prep_interleave`); ymm: natural order."""
    if width == 512:
        return (load(b, x, b.add(xo, i64(128 * j)), V(I8, 64)),
                load(b, x, b.add(xo, i64(128 * j + 64)), V(I8, 64)))
    return (load(b, x, b.add(xo, i64(64 * j)), V(I8, 32)),
            load(b, x, b.add(xo, i64(64 * j + 32)), V(I8, 32)))


def q4k_row(b, w, x, xd, xbs, s, nsb, pf, level, width, five=False):
    """Q4_K (five: Q5_K) row . Q8_K activations, on zmm (width 512: x is the permuted
    copy in s) or ymm (256).

    Per super-block the integer work ends in two exact totals, isum = sum_s sc_s *
    (q_s . x_s) and msum = sum_s m_s * bsum_s, and the float work is one fma on the
    pair: (acc, accm) += (d_w, dmin_w) * d_x * (isum, msum); the row is acc - accm.
    Why totals and not lanes (ggml's `acc += d * float(sumi)` on 8 lanes): a tile of
    activation rows (_int_matmul.q4k_rows) can then do its float work for 8 rows in
    one vector, where per-row lane-wise float work had cost as much as the integer
    products (Q4_K prefill at m = 256, same process, old -> new: avx512vnni
    1.12-1.21x, avxvnni 1.28-1.36x, avx2 1.20-1.24x;
    docs/BENCHMARKS.md#per-block-totals).  Decode pays a horizontal sum per
    super-block: 5-12% slower with the matrix in cache, the same within noise over a
    whole model's weights (the sweep, mostly from DRAM).  Both kernels do the same
    float operations per output, so a row of a matmul equals its matvec bit for bit,
    and every integer level gives the same result.  |isum| < 256 * 31 * 127 * 63 <
    2^26: exact in int32; its float rounds alike in both."""
    bpb = FORMATS[T.Q5_K if five else T.Q4_K].block_bytes
    if width == 512:
        x = s
    nl = width // 32                       # int32 lanes
    zero = ir.Constant(V(I32, nl), None)
    acc_p = alloca(b, V(F32, 2), ir.Constant(V(F32, 2), None))
    with for_range(b, i64(0), nsb) as i:
        p = block_at(b, w, i, bpb, pf, 3)
        qhh = q5k_high_bits(b, p, width) if five else None
        raw16 = load(b, p, None, V(I8, 16))
        ddw = q4k_d_dmin(b, raw16)
        sm = q4k_scales(b, raw16)
        mw = q4k_min_words(b, sm)
        sumi = zero
        xo = b.mul(i, i64(256))
        for j in range(1024 // width):     # quant vectors per super-block
            lo, hi, sub_lo, sub_hi = q4k_quants(b, p, j, width, qhh)
            if level == isa.GENERIC:
                xlo, xhi = q4k_x16(b, s, xo, j)
            else:
                xlo, xhi = q4k_x(b, x, xo, j, width)
            sc = q4k_scale_words(b, level, sm, width, sub_lo, sub_hi)
            sumi = q4k_dot(b, level, sumi, lo, hi, xlo, xhi, sc)
        q4k_block_floats(b, i, ddw, mw, sumi, xd, xbs, acc_p, level)
    return q4k_result(b, b.load(acc_p))


def q4k_block_floats(b, i, ddw, mw, sumi, xd, xbs, acc_p, level):
    """One row's float work for super-block i, the same in `q4k_row` and in a partial
    tile of `_int_matmul.q4k_rows` (so their rows agree bit for bit): the exact totals
    (isum, msum), then (acc, accm) += (d_w, dmin_w) * d_x * (isum, msum) in acc_p."""
    dd = b.fmul(ddw, splat(b, load(b, xd, b.mul(i, i64(4)), F32), 2))
    msum = madd(b, level, mw, load(b, xbs, b.mul(i, i64(32)), V(I32, 8)))  # m_s bsum_s
    totals = b.sitofp(sum_pair(b, sumi, msum), V(F32, 2))
    b.store(fma(b, dd, totals, b.load(acc_p)), acc_p)


def q4k_result(b, acc):
    """The row from its (acc, accm) pair: acc - accm."""
    return b.fsub(b.extract_element(acc, ir.Constant(I32, 0)),
                  b.extract_element(acc, ir.Constant(I32, 1)))


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
    """VNNI: scale words for packssdw(dot k, dot k+1) of half n: per 128-bit lane L, 4
    words of vector k's 16-element group, then 4 of vector k+1's."""
    groups = [[8 * n + 2 * kk + lane // 4 for lane in range(8)] for kk in range(4)]
    idx = []
    for L in range(2):
        idx += [groups[k][4 * L]] * 4 + [groups[k + 1][4 * L]] * 4
    return shuffle(b, sc16, ir.Constant(V(I16, 16), None), idx)


def q6k_pair_scales(b, sc16, n, k):
    """avx2: the scale of each int16 pair of vector k of half n (words 0-7: its first
    16 elements, 8-15: the next 16)."""
    g = 8 * n + 2 * k
    return shuffle(b, sc16, ir.Constant(V(I16, 16), None), [g] * 8 + [g + 1] * 8)


def q6k_lanes16(b, u, x16, sc16, n, k):
    """<8 x i32>: the generic level's scaled lanes of vector k of half n (two 16-element
    sub-blocks): q = u - 32 in int16 times the int16 activations by pmaddwd
    (`madd_host`), each sub-block's 8 lanes apart (not `lanes16`, which adds them);
    |lane| <= 2 * 32 * 128 < 2^15, so `packssdw_host` packs the two exactly, and one
    more pmaddwd multiplies them by their scales (`q4k_lanes16` does the same for
    Q4_K)."""
    q16 = b.sub(b.zext(u, V(I16, 32)), const_vec(I16, 32, 32))
    lo = madd_host(b, half(b, q16, 0), half(b, x16, 0))
    hi = madd_host(b, half(b, q16, 1), half(b, x16, 1))
    g = 8 * n + 2 * k
    scw = shuffle(b, sc16, ir.Constant(V(I16, 16), None),
                  ([g] * 4 + [g + 1] * 4) * 2)
    return madd_host(b, packssdw_host(b, lo, hi), scw)


def q6k_row(b, w, x, xd, xs, xoff, nsb, pf, level):
    """Q6_K row . Q8_K activations (ymm, natural order).  VNNI: xoff int32[n/4] =
    -32 * (sum of the 4 activations of each lane) starts every dpbusd; avx2: int16
    pairs of (q + 32) x minus pairs of 32 x (module docstring)."""
    fmt = FORMATS[T.Q6_K]
    nl = 8
    zero = ir.Constant(V(I32, nl), None)
    c32 = const_vec(I8, 32, 32)
    acc_p = alloca(b, V(F32, nl), ir.Constant(V(F32, nl), None))
    with for_range(b, i64(0), nsb) as i:
        p = block_at(b, w, i, fmt.block_bytes, pf, 4)
        dw = load_f16(b, p, i64(fmt.d_offset))
        d = b.fmul(dw, load(b, xd, b.mul(i, i64(4)), F32))
        sc16 = q6k_scales(b, p)
        sumi = zero
        xo = b.mul(i, i64(256))
        for n in range(2):
            us = q6k_quants(b, p, n)
            if level == isa.GENERIC:
                for k in range(4):
                    x16 = x16_at(b, xoff, b.add(xo, i64(128 * n + 32 * k)), 32)
                    sumi = b.add(sumi, q6k_lanes16(b, us[k], x16, sc16, n, k))
                continue
            xvs = [load(b, x, b.add(xo, i64(128 * n + 32 * k)), V(I8, 32))
                   for k in range(4)]
            if isa.is_arm(level):     # the VNNI levels' lanes and steps, q signed
                dots = [sdot(b, level, None, b.sub(us[k], c32), xvs[k]) for k in range(4)]
                for k in (0, 2):
                    scw = q6k_scale_words(b, sc16, n, k)
                    sumi = dpwssd_ir(b, sumi, pack_words(b, dots[k], dots[k + 1]), scw)
                continue
            if level == isa.AVX2:     # int16 pairs (`maddubs`), then int32 (`madd`)
                for k in range(4):
                    p16 = b.sub(maddubs(b, level, us[k], xvs[k]),
                                maddubs(b, level, c32, xvs[k]))
                    scw = q6k_pair_scales(b, sc16, n, k)
                    sumi = b.add(sumi, madd(b, level, p16, scw))
                continue
            # xoff has one int32 per 4 activations: its byte offset equals the element's
            dots = []
            for k in range(4):
                init = load(b, xoff, b.add(xo, i64(128 * n + 32 * k)), V(I32, nl))
                dots.append(dpbusd(b, init, us[k], xvs[k]))
            for k in (0, 2):
                scw = q6k_scale_words(b, sc16, n, k)
                sumi = dpwssd(b, sumi, packssdw(b, dots[k], dots[k + 1]), scw)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), acc), acc_p)
    return hsum_f32(b, b.load(acc_p))


# --- 32-element blocks: Q8_0, Q4_0, Q5_0, Q4_1, Q5_1 ----------------------------------

def unsigned_offset(t) -> int:
    """off in u = q + off >= 0, the unsigned form of a quant for vpdpbusd: Q8_0's int8
    quants are made unsigned with xor 0x80 (+128); the others are stored that way (0
    for Q4_1 / Q5_1, whose quants are unsigned values)."""
    return 128 if t == T.Q8_0 else FORMATS[t].zero_point


def bits_to_bytes(b, h32, level):
    """<32 x i8>: 0x10 where bit j of the i32 h32 is set, else 0 (byte j).  avx512vnni:
    a mask register and a select; the ymm levels as ggml's bytes_from_bits_32: each
    byte gets its qh byte (broadcast + vpshufb), ORed with all bits but its own, then
    compared with 0xFF (a select on 32 bits cost LLVM ~3x more instructions there)."""
    zero = ir.Constant(V(I8, 32), None)
    if level == isa.AVX512VNNI:
        return b.select(b.bitcast(h32, V(ir.IntType(1), 32)), const_vec(I8, 32, 0x10),
                        zero)
    v = b.bitcast(splat(b, h32, 8), V(I8, 32))
    v = shuffle(b, v, v, [j // 8 for j in range(32)])
    others = [0xFF ^ (1 << (j % 8)) for j in range(32)]
    v = b.or_(v, ir.Constant(V(I8, 32), others))
    on = b.icmp_unsigned("==", v, const_vec(I8, 32, 0xFF))
    return b.select(on, const_vec(I8, 32, 0x10), zero)


def blk32_quants(b, p, t, k, level=isa.AVX512VNNI):
    """<32*k x i8> unsigned quants u = q + off of k consecutive blocks at i8* p (Q8_0:
    the stored q ^ 0x80)."""
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
    if fmt.qh_offset is not None:               # Q5_0, Q5_1: the 5th bits
        hs = [load(b, p, i64(bpb * j + fmt.qh_offset), I32) for j in range(k)]
        if k == 1 or level != isa.AVX512VNNI:
            h = [bits_to_bytes(b, h32, level) for h32 in hs]
            h = h[0] if k == 1 else shuffle(b, h[0], h[1], range(64))
        else:
            h64 = b.or_(b.zext(hs[0], I64), b.shl(b.zext(hs[1], I64), i64(32)))
            bits = b.bitcast(h64, V(ir.IntType(1), 64))
            h = b.select(bits, const_vec(I8, n, 0x10), ir.Constant(V(I8, n), None))
        u = b.or_(u, h)
    return u


def blk32_signed(b, t, u):
    """q = u - off as signed bytes (Q8_0: u ^ 0x80, the stored bytes)."""
    n = u.type.count
    if t == T.Q8_0:
        return b.xor(u, const_vec(I8, n, 0x80))
    return b.sub(u, const_vec(I8, n, unsigned_offset(t)))


def blk32_scales(b, p, t, k):
    """(<k x f32> the blocks' d_w, <k x f32> their m_w: Q4_1 / Q5_1; else None)."""
    fmt = FORMATS[t]
    out = []
    for off in (fmt.d_offset, fmt.m_offset):
        if off is None:
            out.append(None)
            continue
        dv = ir.Constant(V(I16, k), ir.Undefined)
        for j in range(k):
            dw = load(b, p, i64(fmt.block_bytes * j + off), I16)
            dv = b.insert_element(dv, dw, ir.Constant(I32, j))
        out.append(b.fpext(b.bitcast(dv, V(F16, k)), V(F32, k)))
    return out


def blk32_dm_pair(b, p, t):
    """<4 x f32> (d0, m0, d1, m1) of the block pair at i8* p (Q4_1 / Q5_1): d and m are
    adjacent f16 fields, so one 32-bit load per block and one conversion bring all four
    (a 16-bit load, insert and conversion per value had been 17 of the pair's ~30
    instructions on avx512vnni)."""
    fmt = FORMATS[t]
    v = ir.Constant(V(I32, 2), ir.Undefined)
    for j in range(2):
        dm = load(b, p, i64(fmt.block_bytes * j + fmt.d_offset), I32)
        v = b.insert_element(v, dm, ir.Constant(I32, j))
    return b.fpext(b.bitcast(v, V(F16, 4)), V(F32, 4))


def blk32_pair(b, w, index, bpb, pf):
    """Pair `index` of blocks of a row: (i, p) with i = 2 * index its first block and p
    an i8* to it, the pair's cache lines prefetched pf bytes ahead."""
    i = b.mul(index, i64(2))
    o = b.mul(i, i64(bpb))
    prefetch(b, w, b.add(o, pf))
    if 2 * bpb > 64:
        prefetch(b, w, b.add(b.add(o, pf), i64(64)))
    return i, b.gep(w, [o])


def blk32_lane_offsets(t, level) -> bool:
    """Whether blk32_row's lanes start from per-lane offsets (xoff,
    `prep_lane_offsets`): the formats stored with an offset, except avx2 Q8_0, which
    uses the sign trick, and the generic level, which multiplies q itself (int16)."""
    return (bool(unsigned_offset(t)) and level != isa.GENERIC and not isa.is_arm(level)
            and not (level == isa.AVX2 and t == T.Q8_0))


def blk32_x(b, x, s, i, k, level):
    """The activations of blocks i .. i+k-1: <32k x i8> from x, or at the generic
    level <32k x i16> from the prep's int16 copy in s (`prep_x16`)."""
    if level == isa.GENERIC:
        return x16_at(b, s, b.mul(i, i64(32)), 32 * k)
    return load(b, x, b.mul(i, i64(32)), V(I8, 32 * k))


def blk32_lanes(b, level, t, u, xv, init):
    """The int32 lanes sum_j q_j x_j (4 products each) of one or two blocks: u the
    unsigned quants, xv the activations, init the lane offsets (None without)."""
    if level == isa.GENERIC:
        return blk32_lanes16(b, t, u, xv)
    if isa.is_arm(level):         # ARM multiplies signed by signed: q itself
        return sdot(b, level, None, blk32_signed(b, t, u), xv)
    if level == isa.AVX2 and t == T.Q8_0:
        return dot4(b, level, None, *abs_sign(b, blk32_signed(b, t, u), xv))
    return dot4(b, level, init, u, xv)


def blk32_lanes16(b, t, u, x16):
    """The generic level's lanes of one or two blocks: q = u - off widened to int16
    (no offsets to add back: |q| <= 128 is exact there), then per block two pmaddwd
    by its int16 activations and an add (`lanes16`), 8 lanes of 4 products each.
    Why not byte products in plain IR (what this level ran before: each
    product in int16, pairs and quads summed in int32): LLVM widened the activation
    bytes again for every row, multiplied with vpmullw and summed with vphaddw, and
    the lanes needed their offsets added back; the int16 copy of x is made once per
    call.  Over a sweep, haswell code, the two alternated: Q8_0 10.9-11.8 GB/s
    against 8.7-8.8 (then the float kernel), Q5_0 7.6-8.4 against 4.9-6.1, Q4_1
    8.4-10.3 against 6.8-7.1 (docs/BENCHMARKS.md#generic-ir-kernels)."""
    n = u.type.count
    q16 = b.sext(blk32_signed(b, t, u), V(I16, n))
    lanes = []
    for j in range(n // 32):
        q, x = (shuffle(b, v, v, range(32 * j, 32 * j + 32)) for v in (q16, x16))
        lanes.append(lanes16(b, q, x))
    return lanes[0] if len(lanes) == 1 else shuffle(b, lanes[0], lanes[1], range(16))


def blk32_row(b, w, x, xd, xs, xoff, nb, pf, level, t):
    """Row . Q8_0 / Q8_1 activations for t in Q8_0 / Q4_0 / Q5_0 / Q4_1 / Q5_1:
    y = sum_b (d_w d_x)[b] * sum_j (u_j - off) x_j  (+ m_w s_x for Q4_1 / Q5_1).
    VNNI lanes start from xoff (int32[n/4], -off * the sum of their 4 activations);
    avx2 Q8_0 uses the sign trick instead.  Two blocks per iteration (a zmm, or two
    ymm: two float chains, not one), an odd last block alone; at avx2,
    blk32_row_quads."""
    if level == isa.AVX2:
        return blk32_row_quads(b, w, x, xd, xs, xoff, nb, pf, level, t)
    bpb = FORMATS[t].block_bytes
    with_min = FORMATS[t].m_offset is not None
    offsets = blk32_lane_offsets(t, level)
    acc_p = alloca(b, V(F32, 8), ir.Constant(V(F32, 8), None))
    accm_p = alloca(b, V(F32, 4), ir.Constant(V(F32, 4), None))    # block pairs
    accm1_p = alloca(b, V(F32, 1), ir.Constant(V(F32, 1), None))   # single blocks
    acc2_p = alloca(b, V(F32, 16), ir.Constant(V(F32, 16), None))
    npair = b.sdiv(nb, i64(2))
    with for_range(b, i64(0), npair) as index:
        i, p = blk32_pair(b, w, index, bpb, pf)
        xdv = load(b, xd, b.mul(i, i64(4)), V(F32, 2))
        if with_min:        # (d0, m0, d1, m1) * (xd0, xs0, xd1, xs1): D in lanes 0, 2
            dm = blk32_dm_pair(b, p, t)
            xm = load(b, xs, b.mul(i, i64(4)), V(F32, 2))
            xdxs = shuffle(b, xdv, xm, [0, 2, 1, 3])
            dv = b.fmul(dm, xdxs)
            dv = shuffle(b, dv, dv, [0] * 8 + [2] * 8)
            b.store(fma(b, dm, xdxs, b.load(accm_p)), accm_p)   # mins: lanes 1, 3
        else:
            dv = b.fmul(blk32_scales(b, p, t, 2)[0], xdv)
            dv = shuffle(b, dv, dv, [0] * 8 + [1] * 8)
        u = blk32_quants(b, p, t, 2, level)
        init = (load(b, xoff, b.mul(i, i64(32)), V(I32, 16)) if offsets
                else None)
        xv = blk32_x(b, x, xoff, i, 2, level)
        dot = blk32_lanes(b, level, t, u, xv, init)
        acc = b.load(acc2_p)
        b.store(fma(b, dv, b.sitofp(dot, V(F32, 16)), acc), acc2_p)
    b.store(fold16(b, b.load(acc2_p)), acc_p)
    start = b.mul(npair, i64(2))
    return _blk32_singles_and_total(b, w, x, xd, xs, xoff, start, nb, pf, level, t,
                                    offsets, acc_p, accm_p, accm1_p)


def _blk32_singles_and_total(b, w, x, xd, xs, xoff, start, nb, pf, level, t, offsets,
                             acc_p, accm_p, accm1_p):
    """The end of blk32_row and blk32_row_quads: blocks start .. nb one at a time
    into acc_p (8 lanes; the mins into accm1_p), then the row's total: the tree sum
    of acc_p, plus for Q4_1 / Q5_1 the pairs' mins (lanes 1, 3 of accm_p) and the
    single blocks' (_int_matmul.blk32_rows ends the same way per row)."""
    bpb = FORMATS[t].block_bytes
    with_min = FORMATS[t].m_offset is not None
    with for_range(b, start, nb) as i:
        o = b.mul(i, i64(bpb))
        prefetch(b, w, b.add(o, pf))
        p = b.gep(w, [o])
        dv, mv = blk32_scales(b, p, t, 1)
        d = b.fmul(b.extract_element(dv, ir.Constant(I32, 0)),
                   load(b, xd, b.mul(i, i64(4)), F32))
        u = blk32_quants(b, p, t, 1, level)
        init = load(b, xoff, b.mul(i, i64(32)), V(I32, 8)) if offsets else None
        xv = blk32_x(b, x, xoff, i, 1, level)
        dot = blk32_lanes(b, level, t, u, xv, init)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, 8), b.sitofp(dot, V(F32, 8)), acc), acc_p)
        if with_min:
            xm = load(b, xs, b.mul(i, i64(4)), V(F32, 1))
            b.store(fma(b, mv, xm, b.load(accm1_p)), accm1_p)
    total = hsum_f32(b, b.load(acc_p))
    if with_min:
        accm = b.load(accm_p)
        pairs = b.fadd(b.extract_element(accm, ir.Constant(I32, 1)),
                       b.extract_element(accm, ir.Constant(I32, 3)))
        mins = b.fadd(pairs, b.extract_element(b.load(accm1_p), ir.Constant(I32, 0)))
        total = b.fadd(total, mins)
    return total


def quad_scales(b, dw4, xd4):
    """<8 x f32> [sA, sB, sC, sD | sA, sB, sC, sD], s = d_w d_x of four blocks, in
    `totals4`'s lane order."""
    s = b.fmul(dw4, xd4)
    return shuffle(b, s, s, [0, 1, 2, 3, 0, 1, 2, 3])


def blk32_row_quads(b, w, x, xd, xs, xoff, nb, pf, level, t):
    """blk32_row at avx2: four blocks per iteration, their integer lanes summed per
    block before the float work (`totals4`: one conversion and one fma per four blocks
    where blk32_row does four of each), then the last nb % 4 blocks one at a time.
    The multi-row tile (_int_matmul.blk32_rows) does the same per row, so rows stay
    bit-identical to this.  Why: at avx2 that per-block float work was ~40% of a 4-row
    tile's time (docs/BENCHMARKS.md#multi-row-kernels)."""
    bpb = FORMATS[t].block_bytes
    offsets = blk32_lane_offsets(t, level)
    with_min = FORMATS[t].m_offset is not None
    acc_p = alloca(b, V(F32, 8), ir.Constant(V(F32, 8), None))
    accm_p = alloca(b, V(F32, 4), ir.Constant(V(F32, 4), None))    # block pairs
    accm1_p = alloca(b, V(F32, 1), ir.Constant(V(F32, 1), None))   # single blocks
    nquad = b.sdiv(nb, i64(4))
    with for_range(b, i64(0), nquad) as q:
        dots, dws = [], []
        for h in range(2):
            i, p = blk32_pair(b, w, b.add(b.mul(q, i64(2)), i64(h)), bpb, pf)
            if with_min:  # (d0, m0, d1, m1) * (xd0, xs0, xd1, xs1): mins in lanes 1, 3
                dm = blk32_dm_pair(b, p, t)
                xdxs = shuffle(b, load(b, xd, b.mul(i, i64(4)), V(F32, 2)),
                               load(b, xs, b.mul(i, i64(4)), V(F32, 2)), [0, 2, 1, 3])
                b.store(fma(b, dm, xdxs, b.load(accm_p)), accm_p)
                dws.append(shuffle(b, dm, dm, [0, 2]))
            else:
                dws.append(blk32_scales(b, p, t, 2)[0])
            u = blk32_quants(b, p, t, 2, level)
            init = (load(b, xoff, b.mul(i, i64(32)), V(I32, 16)) if offsets
                    else None)
            xv = load(b, x, b.mul(i, i64(32)), V(I8, 64))
            dots.append(blk32_lanes(b, level, t, u, xv, init))
        xd4 = load(b, xd, b.mul(q, i64(16)), V(F32, 4))
        scale = quad_scales(b, shuffle(b, dws[0], dws[1], [0, 1, 2, 3]), xd4)
        tot = b.sitofp(totals4(b, dots[0], dots[1]), V(F32, 8))
        b.store(fma(b, scale, tot, b.load(acc_p)), acc_p)
    return _blk32_singles_and_total(b, w, x, xd, xs, xoff, b.mul(nquad, i64(4)), nb,
                                    pf, level, t, offsets, acc_p, accm_p, accm1_p)


# --- which builder each (format, level) uses ------------------------------------------
# Registered per format (`FORMATS[t].kernels.int_rows`): (t, level) -> RowSpec, at the
# levels of the format's `int_levels`.  The generic level's IR kernels (matvec only)
# multiply int16 activations (`prep_x16`) with pmaddwd: `blk32_lanes16`,
# `q4k_lanes16`, `q6k_lanes16`.  Against the kernels they replaced, over a sweep
# (haswell code, alternated, docs/BENCHMARKS.md#generic-ir-kernels): 1.2-1.7x for
# the 32-element formats, 2.0x for Q6_K, 1.5x for Q4_K / Q5_K.


class RowSpec(NamedTuple):
    """How the integer matvec kernel of one format is built at one level: `builder`
    (q4k_row, q6k_row or blk32_row) with the keyword arguments `opts`, and what it
    reads from its prep scratch, `prep`: None, "interleave" (the activations in Q4_K's
    nibble order, `prep_interleave`), "offsets" (`prep_lane_offsets`) or "x16" (the
    activations as int16, `prep_x16`)."""

    builder: Callable
    opts: dict
    prep: str | None


@registers("int_rows", T.Q4_K, T.Q5_K)
def _kquant_row_spec(t, level) -> RowSpec:
    """Q4_K on zmm at avx512vnni (activations in its nibble order), Q5_K and the other
    levels on ymm: the faster form of each there
    (docs/BENCHMARKS.md#vnni-integer-kernels)."""
    width = 512 if (t == T.Q4_K and level == isa.AVX512VNNI) else 256
    prep = ("interleave" if width == 512 else "x16" if level == isa.GENERIC
            else None)
    return RowSpec(q4k_row, dict(width=width, five=t == T.Q5_K), prep)


@registers("int_rows", T.Q6_K)
def _q6k_row_spec(t, level) -> RowSpec:
    """ymm; lane offsets at the VNNI levels, int16 pairs at avx2 (module docstring),
    int16 activations at generic (`q6k_lanes16`), signed quants (no offsets) on
    aarch64."""
    prep = ("x16" if level == isa.GENERIC
            else None if level == isa.AVX2 or isa.is_arm(level) else "offsets")
    return RowSpec(q6k_row, {}, prep)


@registers("int_rows", T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1)
def _blk32_row_spec(t, level) -> RowSpec:
    """Lane offsets where `blk32_lane_offsets` says; int16 activations at generic."""
    prep = ("x16" if level == isa.GENERIC
            else "offsets" if blk32_lane_offsets(t, level) else None)
    return RowSpec(blk32_row, dict(t=t), prep)


def row_spec(t, level) -> RowSpec:
    """The RowSpec of (t, level), a level among the format's `int_levels`."""
    kernels = FORMATS[t].kernels
    if level not in kernels.int_levels:
        raise KeyError(f"{t.name} has no integer kernels at {level}")
    return kernels.int_rows(t, level)


def row_function(t, level):
    """row(b, w, x, xd, xs, s, nblk, pf) -> f32 for `define_matvec` (the builders read
    their lane offsets or permuted activations, if any, from the scratch row s)."""
    builder, opts, _ = row_spec(t, level)
    return lambda b, w, x, xd, xs, s, n, pf: builder(b, w, x, xd, xs, s, n, pf, level,
                                                     **opts)


def prep_function(t, level):
    """The define_prep body the row kernel needs, or None."""
    prep = row_spec(t, level).prep
    if prep == "interleave":
        return prep_interleave
    if prep == "offsets":
        return prep_lane_offsets(unsigned_offset(t))
    if prep == "x16":
        return prep_x16
    return None
