"""LLVM IR for the integer kernels: vector helpers, and the functions they are built as.

numba compiles Python loops to LLVM IR, and LLVM does not turn them into the byte dot
products (`vpdpbusd`, `vpmaddubsw`) that make ggml fast.  So the integer kernels are
written here directly in LLVM IR with llvmlite's builder, as plain functions that
_jit.py compiles for one instruction-set level and numba's parallel driver (_int.run)
calls through their addresses.  Two kinds per format and level:

* `define_matvec`: rows r0 .. r1 of a weight matrix . one activation vector (`matvec`),
  one row builder call per row (_int_matvec.py);
* `define_matmul`: rows r0 .. r1 . a batch of activation rows, in tiles of up to TILE
  rows per pass over a weight row (`matmul`'s "rows" path, _int_matmul.py);
* `define_prep`: what a kernel needs from the activations once per call (a permuted
  copy, x + 128, or per-lane offsets), into a scratch row as long as the activations.

The vector helpers name the LLVM intrinsics by their x86 instruction (LLVM 22 as bundled
with llvmlite 0.50 takes byte / word vector operands): `vpdpbusd` (4 adjacent u8 x s8
products added to each int32 lane), `vpdpwssd` (2 s16 x s16), `vpmaddubsw` (2 u8 x s8
into a saturating int16), `vpmaddwd`, `vpackssdw`, `llvm.fmuladd`, `llvm.prefetch`.  The
rest is generic IR (unaligned loads, shifts, shuffles, selects) that LLVM lowers well
for any level; the generic level's helpers (`madd`, `madd_host`, `packssdw_host`,
`maddubs_host`) use no target intrinsic but SSE2's and SSSE3's on x86-64
hosts.  No bounds checks: the builders stay inside the row's blocks and the arrays the
drivers size; a prefetch may point past the end, which never faults.
"""

from __future__ import annotations

from llvmlite import ir
from llvmlite.ir import IRBuilder

from . import isa

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F16 = ir.HalfType()
I8P = I8.as_pointer()

# activation rows per pass over a weight row (docs/BENCHMARKS.md#multi-row-kernels), and
# the smaller bodies that take the rows left after the full tiles (`define_matmul`)
TILE = 8
SMALL_TILES = (4, 2)


def V(t, n):
    return ir.VectorType(t, n)


def i64(v):
    return ir.Constant(I64, v)


# --- vector helpers -------------------------------------------------------------------

def _fn(builder, name, ret, argtys):
    mod = builder.module
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ret, argtys), name=name)
    return fn


def call(builder, name, ret, *args):
    return builder.call(_fn(builder, name, ret, [a.type for a in args]), list(args))


def const_vec(t, n, values):
    if not isinstance(values, (list, tuple)):
        values = [values] * n
    return ir.Constant(V(t, n), list(values))


def load(builder, base, off, ty, align=1):
    """Load a `ty` from i8* `base` + i64 `off` (unaligned by default)."""
    p = builder.gep(base, [off]) if off is not None else base
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=align)


def load_f16(builder, base, off):
    return builder.fpext(builder.bitcast(load(builder, base, off, I16), F16), F32)


def splat(builder, v, n):
    t = v.type
    u = ir.Constant(V(t, 1), ir.Undefined)
    u = builder.insert_element(u, v, ir.Constant(I32, 0))
    return builder.shuffle_vector(u, u, ir.Constant(V(I32, n), [0] * n))


def shuffle(builder, a, b, mask):
    return builder.shuffle_vector(a, b, ir.Constant(V(I32, len(mask)), list(mask)))


def prefetch(builder, base, off):
    i8p = I8.as_pointer()
    p = builder.bitcast(builder.gep(base, [off]), i8p)
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [i8p, I32, I32, I32])
    builder.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def dpbusd(builder, acc, u8, s8):
    """acc <n x i32> += sum of 4 adjacent u8 x s8 products per lane (vpdpbusd)."""
    n = acc.type.count
    return call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", acc.type, acc,
                builder.bitcast(u8, V(I8, 4 * n)), builder.bitcast(s8, V(I8, 4 * n)))


def dpwssd(builder, acc, a16, b16):
    """acc <n x i32> += sum of 2 adjacent s16 x s16 products per lane (vpdpwssd)."""
    n = acc.type.count
    a16 = builder.bitcast(a16, V(I16, 2 * n))
    b16 = builder.bitcast(b16, V(I16, 2 * n))
    return call(builder, f"llvm.x86.avx512.vpdpwssd.{32 * n}", acc.type, acc, a16, b16)


def pmaddwd(builder, a16, b16):
    """<n x i32>: sum of 2 adjacent s16 x s16 products per lane (vpmaddwd)."""
    n = a16.type.count // 2 if a16.type.element == I16 else a16.type.count
    name = "llvm.x86.avx2.pmadd.wd" if n == 8 else "llvm.x86.avx512.pmaddw.d.512"
    return call(builder, name, V(I32, n), builder.bitcast(a16, V(I16, 2 * n)),
                builder.bitcast(b16, V(I16, 2 * n)))


def pmaddubsw(builder, u8, s8):
    """<16 x i16>: sum of 2 adjacent u8 x s8 products per word, saturated to int16
    (vpmaddubsw, ymm).  Exact while no pair exceeds 2^15 - 1: the callers keep
    u * |s| * 2 below it."""
    return call(builder, "llvm.x86.avx2.pmadd.ub.sw", V(I16, 16),
                builder.bitcast(u8, V(I8, 32)), builder.bitcast(s8, V(I8, 32)))


def half(builder, v, h):
    """Half h (0: low, 1: high) of vector v."""
    n = v.type.count // 2
    return shuffle(builder, v, v, range(h * n, h * n + n))


def by_halves(builder, fn, *args):
    """fn applied to the low and the high halves of its vector arguments (None stays
    None), the two results joined: a 512-bit operation on a level with 256-bit
    registers."""
    lo = fn(*[None if a is None else half(builder, a, 0) for a in args])
    hi = fn(*[None if a is None else half(builder, a, 1) for a in args])
    return shuffle(builder, lo, hi, range(2 * lo.type.count))


def dot4(builder, level, acc, u8, s8):
    """acc <n x i32> (None: zero) + the sum of each lane's 4 u8 x s8 products: vpdpbusd
    on the VNNI levels; vpmaddubsw, then vpmaddwd by 1, on avx2 (exact only while the
    pairs do not saturate: u * |s| * 2 < 2^15).  64 bytes on a ymm level: per half.
    The x86 levels only: the generic level multiplies int16 activations (`madd_host`:
    widening the activation bytes for every weight row, as a plain-IR byte product
    had to, and summing with vphaddw ran its kernels at half the speed,
    docs/BENCHMARKS.md#generic-ir-kernels)."""
    assert level != isa.GENERIC, "the generic level multiplies int16 (madd_host)"
    if u8.type.count == 64 and level != isa.AVX512VNNI:
        return by_halves(builder, lambda a, u, s: dot4(builder, level, a, u, s),
                         acc, u8, s8)
    if level != isa.AVX2:
        if acc is None:
            acc = ir.Constant(V(I32, u8.type.count // 4), None)
        return dpbusd(builder, acc, u8, s8)
    s = pmaddwd(builder, pmaddubsw(builder, u8, s8), const_vec(I16, 16, 1))
    return s if acc is None else builder.add(acc, s)


# True: the aarch64 levels' `sdot` and `smmla` as plain IR, so that their kernels
# compile for x86 and run there (tests/test_quant_aarch64.py checks them against the
# VNNI levels bit for bit on this machine; qemu checks the real instructions)
PORTABLE_ARM = False


def sdot(builder, level, acc, q, x):
    """acc <n/4 x i32> (None: zero) + the sum of each lane's 4 adjacent s8 x s8
    products q x: the aarch64 levels' dot product, the lanes of x86's `dot4` with q
    signed (no offsets: ARM multiplies signed by signed).  dotprod / i8mm: `sdot`
    (llvm.aarch64.neon.sdot) per 16 bytes; neon: the same lanes in plain IR,
    int16 products (`smull`) summed pairwise in int32 (|q x| <= 128 * 127)."""
    n = q.type.count
    if acc is None:
        acc = ir.Constant(V(I32, n // 4), None)
    if level == isa.NEON or PORTABLE_ARM:
        p = builder.sext(builder.mul(builder.sext(q, V(I16, n)),
                                     builder.sext(x, V(I16, n))), V(I32, n))
        p = _add_picks(builder, p, p, range(0, n, 2), range(1, n, 2))
        p = _add_picks(builder, p, p, range(0, n // 2, 2), range(1, n // 2, 2))
        return builder.add(acc, p)
    assert isa.is_arm(level), level
    parts = []
    for k in range(n // 16):
        qk, xk = (shuffle(builder, v, v, range(16 * k, 16 * k + 16)) for v in (q, x))
        ak = shuffle(builder, acc, acc, range(4 * k, 4 * k + 4)) if n > 16 else acc
        parts.append(call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", V(I32, 4),
                          ak, qk, xk))
    return concat(builder, parts)


# aarch64: a dot product's exact int32 total t as a float in one vector operation, not
# `scvtf`'s two on Neoverse N1 / V1 (llvm-mca: the K-quants' packed GEMM at dotprod,
# 48 vector micro-ops per 4 rows x 4 weight rows x 32 elements -> 44; Q4_K against
# llama.cpp's `sdot` kernel, N1 1.46x -> 1.59x, V1 1.33x -> 1.45x, Cortex-A76 1.37x ->
# 1.43x, Apple M1 unchanged; docs/BENCHMARKS.md, the aarch64 levels).  The dot product
# starts at the bits of the float 1.5 (`biased_zero`: one `fmov v.4s, #1.5`, as cheap
# as the `movi` of a zero) and ends at their integer sum, the bits of the float 1.5 +
# t / 2**23 exactly while |t| < 2**22 (one ulp is 2**-23 in [1, 2)); `unbias`
# subtracts 1.5, exactly, leaving t / 2**23, and the caller's scale carries the 2**23
# (`UNBIAS_SCALE`): fma(s * 2**23, t / 2**23, acc) is fma(s, float(t), acc) bit for
# bit, as long as s * 2**23 is exact.  So only the K-quants use it (`sdot` and
# `smmla` alike), whose s = d_w * sc_s (an f16 times a 6- or 8-bit integer) is far
# from float32's limits; the 32-element formats' d_w * d_x could underflow.  A start
# at the bits of 1.5 * 2**23 (no scale to carry) saved the same on V1 but cost Apple
# M1, whose `scvtf` is one micro-op: `movi` cannot make that constant, and LLVM,
# short of registers, rebuilt it in the loop (14.8 -> 16.1 cycles).  Every sub-block
# total fits: |t| <= 32 x 31 x 128 (Q5_K).
BIAS = 1.5
BIAS_BITS = 0x3FC00000
UNBIAS_SCALE = 2.0 ** 23


def biased_zero(n):
    """<n x i32>: where a dot product that `unbias` converts starts."""
    return const_vec(I32, n, BIAS_BITS)


def unbias(builder, tot):
    """t / 2**23 of a total t started at `biased_zero` (exact for |t| < 2**22)."""
    n = tot.type.count
    return builder.fsub(builder.bitcast(tot, V(F32, n)), const_vec(F32, n, BIAS))


def smmla(builder, acc, a, c):
    """<4 x i32> acc + the 2x2 int32 products of two 2x8 byte matrices (signed):
    lane 2i + j += row i of a (bytes 8i .. 8i+7) . row j of c (`smmla`, i8mm)."""
    if PORTABLE_ARM:
        r = range(8)
        a32 = builder.sext(shuffle(builder, a, a, [*r, *r, *range(8, 16), *range(8, 16)]),
                           V(I32, 32))
        c32 = builder.sext(shuffle(builder, c, c, [*r, *range(8, 16)] * 2), V(I32, 32))
        p = builder.mul(a32, c32)
        for _ in range(3):                      # 8 products per lane, pairwise
            n = p.type.count
            p = _add_picks(builder, p, p, range(0, n, 2), range(1, n, 2))
        return builder.add(acc, p)
    return call(builder, "llvm.aarch64.neon.smmla.v4i32.v16i8", V(I32, 4), acc, a, c)


def ld1x(builder, base, off, count, level):
    """`count` (2 or 4) consecutive <16 x i8> at i8* `base` + i64 `off`, in one
    multi-register `ld1 {v.16b, ...}` (llvm.aarch64.neon.ld1xN) at the aarch64
    levels, plain loads with PORTABLE_ARM (or off ARM).  Why not LLVM's own `ldp q`
    pairs: on the Cortex-A76 model (LLVM's Cortex-A57 one) an `ldp q` is 3-4 micro-ops
    for 32 bytes, `ld1` of 2 registers 2 and of 4 registers 4-5, and that loop is
    bound by the 3-wide dispatch: the Q8_0 packed GEMM's 93 micro-ops per iteration
    (llama.cpp's: 89, its loads `ld1` of 4 registers) went to 89, 33.1 -> 31.1 cycles,
    0.96x -> 1.02x llama.cpp on Cortex-A76, and Q4_K's 32.1 -> 28.4 (llvm-mca).
    Neoverse N1 / V1 did not move; Apple M1's model, whose `ldp q` is cheap, went
    1.04x -> 1.02x (16.1 -> 16.4 cycles): kept, every model above 1.0x."""
    ty = V(I8, 16)
    if PORTABLE_ARM or not isa.is_arm(level):
        return [load(builder, base, builder.add(off, i64(16 * k)), ty)
                for k in range(count)]
    p = builder.gep(base, [off])
    fn = _fn(builder, f"llvm.aarch64.neon.ld1x{count}.v16i8.p0i8",
             ir.LiteralStructType([ty] * count), [I8P])
    r = builder.call(fn, [p])
    return [builder.extract_value(r, k) for k in range(count)]


def concat(builder, parts):
    """The vectors `parts` (all of one type) joined end to end."""
    while len(parts) > 1:
        n = parts[0].type.count
        parts = [shuffle(builder, parts[i], parts[i + 1], range(2 * n))
                 for i in range(0, len(parts), 2)]
    return parts[0]


def dpwssd_ir(builder, acc, a16, b16):
    """acc + pairs of s16 x s16 products per lane, vpdpwssd's result in plain IR (the
    aarch64 levels: `smlal`, pairwise adds)."""
    return builder.add(acc, madd(builder, isa.GENERIC, a16, b16))


def maddubs(builder, level, u8, s8):
    """<n/2 x i16>: the sum of each pair of adjacent u8 x s8 products: vpmaddubsw
    (saturating; the callers keep the pairs within int16); at the generic level,
    x86-64 hosts only (_int_packed.byte_products), SSSE3's by halves (`maddubs_host`)."""
    if level == isa.GENERIC:
        return maddubs_host(builder, u8, s8)
    return pmaddubsw(builder, u8, s8)


def madd(builder, level, a16, b16):
    """<n/2 x i32>: the sum of each pair of adjacent s16 x s16 products: vpmaddwd on
    x86, in plain IR at the generic level (the pattern LLVM selects vpmaddwd for) and
    the aarch64 levels (`smull` / `smlal` and pairwise adds)."""
    if level != isa.GENERIC and not isa.is_arm(level):
        return pmaddwd(builder, a16, b16)
    n = a16.type.count // 2 if a16.type.element == I16 else a16.type.count
    a16 = builder.bitcast(a16, V(I16, 2 * n))
    b16 = builder.bitcast(b16, V(I16, 2 * n))

    def half(v, k):
        return builder.sext(shuffle(builder, v, v, range(k, 2 * n, 2)), V(I32, n))
    return builder.add(builder.mul(half(a16, 0), half(b16, 0)),
                       builder.mul(half(a16, 1), half(b16, 1)))


def x86_triple(triple) -> bool:
    """True if an LLVM target triple names an x86-64 CPU."""
    return str(triple).startswith(("x86_64", "amd64"))


def _x86_host(builder) -> bool:
    """True if the module is for an x86-64 host (its triple: _jit.new_module)."""
    return x86_triple(builder.module.triple)


def madd_host(b, a16, b16):
    """<8 x i32>: the generic level's pairs of int16 products.  For an x86-64 module
    pmaddwd of SSE2, which every x86-64 CPU has, by halves (LLVM joins them into one
    ymm vpmaddwd where the target has AVX2); elsewhere `madd`'s plain IR (NEON on
    ARM).  Not `madd` on x86: with one operand a broadcast, LLVM folds the splat into
    its pattern and no longer sees a vpmaddwd (vpmulld, vpshufb and blends instead),
    and the packed GEMM ran at about a third of its speed with this (measured:
    docs/BENCHMARKS.md#pair-products-on-x86)."""
    if not _x86_host(b):
        return madd(b, isa.GENERIC, a16, b16)
    a16, b16 = b.bitcast(a16, V(I16, 16)), b.bitcast(b16, V(I16, 16))

    def sse2(x, y):
        return call(b, "llvm.x86.sse2.pmadd.wd", V(I32, 4), x, y)
    return by_halves(b, sse2, a16, b16)


def packssdw_host(b, a, c):
    """<16 x i16>: two <8 x i32> packed to words in vpackssdw's order, per 128-bit
    half 4 of a's lanes then 4 of c's, at the generic level: SSE2's packssdw by halves
    on x86-64, a truncation elsewhere (the callers' lanes fit int16, so saturating and
    truncating agree)."""
    if _x86_host(b):
        return by_halves(b, lambda x, y: call(b, "llvm.x86.sse2.packssdw.128",
                                              V(I16, 8), x, y), a, c)
    return pack_words(b, a, c)


def pack_words(b, a, c):
    """<16 x i16>: two <8 x i32> as words in vpackssdw's order (per 128-bit half 4 of
    a's lanes, then 4 of c's), by truncation: exact for lanes that fit int16, as the
    callers' do.  Plain IR (`uzp1` on aarch64): the generic level off x86 and the
    aarch64 levels, which must order their words as the VNNI levels do."""
    a16, c16 = b.trunc(a, V(I16, 8)), b.trunc(c, V(I16, 8))
    return shuffle(b, a16, c16, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


def maddubs_host(b, u8, s8):
    """<16 x i16>: the generic level's pairs of u8 x s8 products on an x86-64 host
    (_int_packed.byte_products): SSSE3's pmaddubsw by halves, saturating as
    vpmaddubsw does (the callers keep the pairs within int16); LLVM joins the halves
    into one ymm vpmaddubsw where the target has AVX2."""
    def ssse3(x, y):
        return call(b, "llvm.x86.ssse3.pmadd.ub.sw.128", V(I16, 8), x, y)
    return by_halves(b, ssse3, u8, s8)


def abs_sign(builder, q, x):
    """(|q|, x * sign(q)) byte vectors (ymm): ggml's AVX2 trick for a signed x signed
    dot product with vpmaddubsw (|q| <= 128 and |x| <= 127, so a pair is at most
    32512): vpabsb, vpsignb."""
    if q.type.count == 64:
        parts = [abs_sign(builder, half(builder, q, h), half(builder, x, h))
                 for h in (0, 1)]
        return tuple(shuffle(builder, parts[0][i], parts[1][i], range(64))
                     for i in (0, 1))
    zero = ir.Constant(V(I8, 32), None)
    aq = builder.select(builder.icmp_signed("<", q, zero), builder.sub(zero, q), q)
    return aq, call(builder, "llvm.x86.avx2.psign.b", V(I8, 32), x, q)


def packssdw(b, a, c):
    n = a.type.count
    name = "llvm.x86.avx512.packssdw.512" if n == 16 else "llvm.x86.avx2.packssdw"
    return call(b, name, V(I16, 2 * n), a, c)


def hsum_f32(builder, v):
    """Tree sum of a float vector (halving shuffles)."""
    n = v.type.count
    while n > 1:
        h = n // 2
        lo = shuffle(builder, v, v, list(range(h)))
        hi = shuffle(builder, v, v, list(range(h, n)))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(I32, 0))


def fold16(builder, v):
    """<16 x f32> -> <8 x f32>: the two halves added lane by lane."""
    lo = shuffle(builder, v, v, range(8))
    return builder.fadd(lo, shuffle(builder, v, v, range(8, 16)))


def _hadd_i32(builder, x, y):
    """<8 x i32>: neighbouring lanes of x and y added, per 128-bit half (vphaddd's
    pattern: [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7])."""
    return builder.add(shuffle(builder, x, y, [0, 2, 8, 10, 4, 6, 12, 14]),
                       shuffle(builder, x, y, [1, 3, 9, 11, 5, 7, 13, 15]))


def totals4(builder, d01, d23):
    """<8 x i32> [A, B, C, D | A, B, C, D] for two block pairs' lanes (<16 x i32>, 8
    lanes per block: blocks A, B in d01, C, D in d23): each block's lanes 0-3 summed in
    the low 128 bits, 4-7 in the high, by three vphaddd-like steps.  The sums are
    exact, so their order is free; the float work that follows is then one
    conversion and one fma per four blocks instead of four (avx2 blk32 kernels)."""
    def half(v, k):
        return shuffle(builder, v, v, range(8 * k, 8 * k + 8))
    return _hadd_i32(builder, _hadd_i32(builder, half(d01, 0), half(d01, 1)),
                     _hadd_i32(builder, half(d23, 0), half(d23, 1)))


def sum_pair(builder, a, c):
    """<2 x i32>: (sum of a's lanes, sum of c's lanes), for <8 x i32> (a may be <16 x
    i32>: folded to 8 first).  The sums are exact, so their order is free:
    neighbouring lanes pairwise (two vphaddd-like steps), then the 128-bit halves."""
    if a.type.count == 16:
        a = builder.add(shuffle(builder, a, a, range(8)),
                        shuffle(builder, a, a, range(8, 16)))
    h = _hadd_i32(builder, a, c)
    h = _hadd_i32(builder, h, h)
    return _add_picks(builder, h, h, [0, 1], [4, 5])


def _add_picks(builder, x, y, lo, hi):
    return builder.add(shuffle(builder, x, y, lo), shuffle(builder, x, y, hi))


def sum_rows(builder, vecs):
    """<8 x i32>: lane k = the sum of the lanes of vecs[k], for 8 vectors of 8 or 16
    int32 lanes (a tile's 8 rows).  A transposing tree: each step adds two picks of
    two vectors, halving every vector's partial sums and pairing the vectors up, so
    8 rows cost 14 shuffles on ymm and 16 on zmm, where vphaddd trees took 26 and 34
    (shuffles all go to one port on AVX-512 cores: it was the kernel's bottleneck,
    llvm-mca, docs/BENCHMARKS.md#per-block-totals)."""
    n = vecs[0].type.count
    r = range
    if n == 16:
        v = [_add_picks(builder, vecs[k], vecs[k + 1], [*r(8), *r(16, 24)],
                        [*r(8, 16), *r(24, 32)]) for k in (0, 2, 4, 6)]
        # [row k (8) | row k+1 (8)] -> [k, k+1, k+2, k+3] (4 each)
        lo = [*r(4), *r(8, 12), *r(16, 20), *r(24, 28)]
        v = [_add_picks(builder, v[k], v[k + 1], lo, [i + 4 for i in lo])
             for k in (0, 2)]
        # -> per 128 bits [row g (2), row g+4 (2)]
        lo = [i for g in r(4) for i in (4 * g, 4 * g + 1, 16 + 4 * g, 17 + 4 * g)]
        z = _add_picks(builder, v[0], v[1], lo, [i + 2 for i in lo])
        return _add_picks(builder, z, z, [0, 4, 8, 12, 2, 6, 10, 14],
                          [1, 5, 9, 13, 3, 7, 11, 15])
    assert n == 8, n
    # the network leaves input j in lane (0, 4, 1, 5, 2, 6, 3, 7)[j]: feed it so
    vs = [vecs[k] for k in (0, 4, 1, 5, 2, 6, 3, 7)]
    v = [_add_picks(builder, vs[k], vs[k + 1], [*r(4), *r(8, 12)],
                    [*r(4, 8), *r(12, 16)]) for k in (0, 2, 4, 6)]
    v = [_add_picks(builder, v[k], v[k + 1], [0, 1, 8, 9, 4, 5, 12, 13],
                    [2, 3, 10, 11, 6, 7, 14, 15]) for k in (0, 2)]
    return _add_picks(builder, v[0], v[1], [0, 2, 8, 10, 4, 6, 12, 14],
                      [1, 3, 9, 11, 5, 7, 13, 15])


def fma(builder, a, b, c):
    """a * b + c per lane: `llvm.fmuladd`, fused where the target has FMA (every x86
    level's target, ARMv8), so the same bits as `llvm.fma` there.  Not `llvm.fma`,
    whose single rounding is a promise: on a CPU without FMA (the generic level on
    Sandy / Ivy Bridge) LLVM keeps it with a call to libm's fmaf per lane -- 216
    calls in Q4_K's packed GEMM, which ran several times slower than a mul and an
    add (measured: docs/BENCHMARKS.md#fmuladd-not-fma)."""
    n = a.type.count
    return call(builder, f"llvm.fmuladd.v{n}f32", a.type, a, b, c)


def block_at(builder, w, i, bpb, pf, lines):
    """i8* to block i (of bpb bytes) of the weight row at w, after prefetching `lines`
    cache lines of the block pf bytes ahead."""
    o = builder.mul(i, i64(bpb))
    po = builder.add(o, pf)
    for k in range(lines):
        prefetch(builder, w, builder.add(po, i64(64 * k)))
    return builder.gep(w, [o])


# --- the functions a level's kernels are made of --------------------------------------
# Kernel ABI (all pointers i8*, all integers i64; _int.run calls these):
#   prep(x, n, s)         activations x (n int8) -> the scratch row s
#   matvec(w, r0, r1, col, rb, x, xd, xs, s, y)
#                         y[col + r] (f32) for the weight rows r0 .. r1 - 1 at w (rb
#                         bytes each), activations x (int8), their block scales xd
#                         (f32), their side array xs, the scratch row s
#   matmul(w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst)
#                         y[t, col + r] for all m activation rows t (row strides in
#                         bytes) and the weight rows r0 .. r1 - 1

# the matmul ABI's argument types (above): define_matmul, _int_packed.define_packed
MATMUL_ARGTYS = [I8P, I64, I64, I64, I64, I64] + [I8P, I64] * 5


def _function(mod, name, argtys):
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), argtys), name=name)
    fn.attributes.add("nounwind")
    return fn, IRBuilder(fn.append_basic_block("entry"))


def define_prep(mod, name, body):
    """void name(i8* x, i64 n, i8* s): `body(b, x, n, s)` fills the scratch row."""
    fn, b = _function(mod, name, [I8P, I64, I8P])
    body(b, *fn.args)
    b.ret_void()


def define_matvec(mod, name, row, bpb, pf):
    """void name(w, r0, r1, col, rb, x, xd, xs, s, y): for each weight row r,
    y[col + r] = `row(b, w_r, x, xd, xs, s, nblk, pf)` (a float), nblk = rb / bpb."""
    argtys = [I8P, I64, I64, I64, I64, I8P, I8P, I8P, I8P, I8P]
    fn, b = _function(mod, name, argtys)
    w, r0, r1, col, rb, x, xd, xs, s, y = fn.args
    nblk = b.udiv(rb, i64(bpb))
    yf = b.gep(b.bitcast(y, F32.as_pointer()), [col])
    with for_range(b, r0, r1) as r:
        v = row(b, b.gep(w, [b.mul(r, rb)]), x, xd, xs, s, nblk, i64(pf))
        b.store(v, b.gep(yf, [r]))
    b.ret_void()


def define_matmul(mod, name, tile_body, bpb, pf, tile_side=None):
    """void name(w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst):
    for each tile of up to TILE activation rows and each weight row r in r0 .. r1,
    `tile_body(b, w_r, nblk, tile, pf, rows)` stores y[t, col + r] for the tile's rows.
    The tile loop is outside the row loop: a chunk of weight rows (a few KB) stays in
    L1 while the tiles pass over it.  (avx2, whose 16 ymm registers spill with 8 rows'
    accumulators, ran no faster with tiles of 4 or 6 on long prompts:
    docs/BENCHMARKS.md#instruction-set-levels.)

    The rows left after the full tiles (all of them in batch decode and in a
    speculative verify step of 2-7 rows) go through the smallest of three bodies that
    holds them: 8, 4 or 2 rows (`SMALL_TILES`).  The 8-row body with guarded rows keeps
    all 8 rows' accumulators live even when 2 rows run, and at avx2 they spill: on the
    default model (Zen 2, avx2) 2 rows of the lm_head (Q8_0, from memory) took 13.1 ms
    against 5.3 for one row, 4 rows of gate+up (Q5_0) 1.09 ms against 0.30; with the
    small bodies 5.8 and 0.85 ms, and 4 streams decode 79.5 tok/s instead of 51-64
    (docs/BENCHMARKS.md#multi-row-kernels).  Each row's work is the same in every body,
    so results do not change.  Cost: LLVM compiles three bodies instead of one
    (all seven formats, avx2: 1.4 -> 2.1 s of a cold first start's worker thread; the
    France question's cold first start 8.8-8.9 -> 9.1-9.5 s; warm: unchanged).

    With `tile_side(b, nblk)` (Q4_K / Q5_K), full tiles run a copy of the body without
    the per-row `k < nr` branches (only a last partial tile needs them): fewer
    instructions and free registers (~5-10% on Q4_K), and `tile_side` returns a
    `fill(b, tile, rows)` that runs once per tile before its weight rows and sets
    `tile.side` (data all weight rows share, e.g. the rows' scales transposed).  The
    other formats keep one branch-guarded body: a second copy doubled their LLVM
    compile time (0.17 -> 0.3 s per format, a first start's cost)."""
    fn, b = _function(mod, name, MATMUL_ARGTYS)
    (w, r0, r1, col, rb, m, x, xst, xd, xdst, xs, xsst, s, sst, y, yst) = fn.args
    nblk = b.udiv(rb, i64(bpb))
    fill = tile_side(b, nblk) if tile_side is not None else None

    def tile_rows(t0, nr, full, n=TILE):
        tile = Tile(x, xst, xd, xdst, xs, xsst, s, sst, y, yst, t0, nr, None)
        if fill is not None and full:
            fill(b, tile, Rows(tile, n, full=True))
        with for_range(b, r0, r1) as r:
            tile.col = b.add(col, r)
            tile_body(b, b.gep(w, [b.mul(r, rb)]), nblk, tile, i64(pf),
                      Rows(tile, n, full=full))

    # tiles of up to TILE rows while more than SMALL_TILES[0] rows are left, then
    # the rest (if any) in the smallest body that holds it
    nbig = b.udiv(b.add(m, i64(TILE - SMALL_TILES[0] - 1)), i64(TILE))
    if fill is None:                  # every big tile through the guarded body
        with for_range(b, i64(0), nbig) as k:
            t0 = b.mul(k, i64(TILE))
            nr = b.sub(m, t0)
            tile_rows(t0, b.select(b.icmp_signed("<", nr, i64(TILE)), nr, i64(TILE)),
                      False)
    else:                             # full tiles unguarded, a last one of 5-7 guarded
        nfull = b.udiv(m, i64(TILE))
        with for_range(b, i64(0), nfull) as k:
            tile_rows(b.mul(k, i64(TILE)), i64(TILE), True)
        with b.if_then(b.icmp_signed("<", nfull, nbig)):
            t0 = b.mul(nfull, i64(TILE))
            tile_rows(t0, b.sub(m, t0), False)
    t0 = b.mul(nbig, i64(TILE))
    rest = b.sub(m, t0)
    with b.if_then(b.icmp_signed(">", rest, i64(0))):
        _smallest_body(b, rest, lambda n: tile_rows(t0, rest, False, n))
    b.ret_void()


def _smallest_body(b, nr, emit, sizes=SMALL_TILES):
    """emit(n) for the smallest n of `sizes` (descending) that holds nr rows."""
    n, smaller = sizes[0], sizes[1:]
    if not smaller:
        emit(n)
        return
    with b.if_else(b.icmp_signed(">", nr, i64(smaller[0]))) as (big, small):
        with big:
            emit(n)
        with small:
            _smallest_body(b, nr, emit, smaller)


class for_range:
    """`with for_range(b, start, stop) as i:` a counted loop over i64 values."""

    def __init__(self, b, start, stop):
        self.b, self.start, self.stop = b, start, stop

    def __enter__(self):
        b = self.b
        self.pre = b.block
        self.head = b.append_basic_block("loop.head")
        self.body = b.append_basic_block("loop.body")
        self.end = b.append_basic_block("loop.end")
        b.branch(self.head)
        b.position_at_end(self.head)
        self.i = b.phi(I64)
        self.i.add_incoming(self.start, self.pre)
        b.cbranch(b.icmp_signed("<", self.i, self.stop), self.body, self.end)
        b.position_at_end(self.body)
        return self.i

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        b = self.b
        nxt = b.add(self.i, i64(1))
        self.i.add_incoming(nxt, b.block)
        b.branch(self.head)
        b.position_at_end(self.end)
        return False


def alloca(b, ty, init=None):
    """A stack slot in the function's entry block (LLVM promotes it to a register)."""
    with b.goto_entry_block():
        p = b.alloca(ty)
    if init is not None:
        b.store(init, p)
    return p


# --- one weight row . a tile of activation rows ---------------------------------------

class Tile:
    """Activation rows t0 .. t0+nr of x [m, n] (int8), xd [m, nblk] (f32), xs [m, *]
    (the side array), the scratch s [m, *] (`define_prep`'s rows) and the output y
    [m, ldy] (f32, column `col`), as i8* pointers and byte strides."""

    def __init__(self, x, xst, xd, xdst, xs, xsst, s, sst, y, yst, t0, nr, col):
        self.x, self.xst, self.xd, self.xdst = x, xst, xd, xdst
        self.xs, self.xsst, self.s, self.sst = xs, xsst, s, sst
        self.y, self.yst, self.t0, self.nr, self.col = y, yst, t0, nr, col
        self.side = None

    def ptrs(self, b, r):
        """(x, xd, xs, s) i8* of tile row r (an i64 value)."""
        i = b.add(self.t0, r)
        return (b.gep(self.x, [b.mul(i, self.xst)]),
                b.gep(self.xd, [b.mul(i, self.xdst)]),
                b.gep(self.xs, [b.mul(i, self.xsst)]),
                b.gep(self.s, [b.mul(i, self.sst)]))

    def store(self, b, r, v):
        i = b.add(self.t0, r)
        off = b.add(b.mul(i, self.yst), b.mul(self.col, i64(4)))
        b.store(v, b.bitcast(b.gep(self.y, [off]), F32.as_pointer()))


class Rows:
    """The n rows of a tile (TILE, or one of SMALL_TILES) in straight-line code, each
    behind a `k < nr` branch (row 0 always runs: nr >= 1), with per-row accumulators.
    Only rows < nr are stored.  Why unrolled and branch-guarded:
    docs/BENCHMARKS.md#multi-row-kernels."""

    def __init__(self, tile, n=TILE, full=False):
        self.tile, self.n, self.full = tile, n, full

    def each(self, b, fn):
        """fn(r, k): r the tile row (an i64 constant), k its index (an int)."""
        for k in range(self.n):
            kc = i64(k)
            if k == 0 or self.full:
                fn(kc, k)
            else:
                with b.if_then(b.icmp_signed("<", kc, self.tile.nr), likely=True):
                    fn(kc, k)

    def acc(self, b, ty):
        """Accumulator slots, acc(b, k) -> pointer: allocas that LLVM promotes to
        registers.  (Until the Q4_K tile kept its mins per row, those lived in
        volatile memory slots: with them in registers LLVM spilled constants in the
        loop; docs/BENCHMARKS.md#multi-row-kernels.)"""
        slots = [alloca(b, ty) for _ in range(self.n)]
        return lambda b, k: slots[k]

    def finish(self, b, fn):
        """fn(r, k) -> f32 result of row r; stored for the rows < nr."""
        for k in range(self.n):
            kc = i64(k)
            v = fn(kc, k)
            with b.if_then(b.icmp_signed("<", kc, self.tile.nr), likely=True):
                self.tile.store(b, kc, v)
