"""Integer (VNNI) row dot products for the decode kernels, emitted directly as LLVM IR.

Why.  The float decode kernels (decode.py) widen every quant to float32 -- ~3.5 vector instructions
per 8 weights -- and top out at 7-12 GB/s for the 4/5/6-bit formats, below what the memory system
streams (~25 GB/s with 2 threads).  ggml multiplies the bytes themselves: AVX512-VNNI `vpdpbusd`
multiplies 4 adjacent u8 x s8 pairs and adds them to an int32 lane, 32 (ymm) or 64 (zmm)
multiply-adds per instruction.  LLVM does not derive it from numba's scalar loops, so the row loop
of each format is built here with llvmlite's IR builder and exposed to numba as an `@intrinsic`:

    q4k_row_vnni(wf, off, n, x8, xd, xs, pf) -> float32     (also q5k_, q6k_, q8_0_, q4_0_, q5_0_)

= weight row at byte `off` of the flat matrix `wf` (n blocks) . int8 activations `x8` with scales
`xd`; `xs` is the format's activation side array (below); software prefetch `pf` bytes ahead.
The parallel kernels at the end of this file (`mv_q4_k` ..., table `KERNELS`, dispatched by
decode.py) run one call per output row inside a `prange` loop.  No bounds checks: every load
stays inside the row's blocks and the activation arrays decode.py sizes (prefetches may point past
the end; a prefetch never faults).

LLVM intrinsics used (LLVM 22 as bundled with llvmlite 0.50, whose canonical operand types are byte /
word vectors; older `<n x i32>` declarations would be auto-upgraded): `llvm.x86.avx512.vpdpbusd.256/512`
(acc <n x i32>, <4n x i8> unsigned, <4n x i8> signed), `llvm.x86.avx512.vpdpwssd.256/512`,
`llvm.x86.avx512.packssdw.512` / `llvm.x86.avx2.packssdw`, `llvm.x86.avx2.pmadd.wd`, `llvm.fma`,
`llvm.prefetch`.  Everything else is generic IR (unaligned loads, and/lshr, shufflevector, select on
`<n x i1>`) that LLVM lowers well: `vgf2p8affineqb` for the high-nibble shift, `vpermt2b`/`vpermw`
for the scale patterns, `kmovq` + masked byte moves for Q5_0's 5th bits, `vbroadcasti128` loads.
The ymm forms assemble as `{vex} vpdpbusd` (AVX-VNNI encoding) on this CPU.

How each format maps onto vpdpbusd (one operand must be unsigned):
* Q4_K / Q5_K: the quants are unsigned nibbles (+16 for the 5th bit).  64 quant bytes per zmm give
  sub-blocks 2k (low nibbles) and 2k+1 (high nibbles) of two 32-byte chunks; in the zmm form the
  activations are pre-permuted once per call so that each 64-byte load lines up
  (`_interleave_64`).  The 8 six-bit scales and mins are unpacked with xmm byte shuffles,
  shifts and masks (ggml does it with scalar `utmp` arithmetic).  A dpbusd lane holds at most
  4 * 31 * 127 < 2^15, so two dpbusd results are packed to int16 (vpackssdw: no saturation possible)
  and one vpdpwssd multiplies them by their sub-block scales (int16 words) into the super-block's
  int32 sum.  Mins as in ggml: `m_sub * bsum_x[sub]` (vpmaddwd) times `dmin_w * d_x` into a second
  float accumulator.
* Q6_K / Q4_0 / Q5_0 / Q8_0: the quants are stored, or made (Q8_0: xor 0x80), as u = q + off >= 0
  (off = 32, 8, 16, 128).  Every dpbusd lane starts from -off * (sum of its 4 activations), an int32
  array made once per call (`_lane_offsets`), so each lane ends as the exact integer sum of its
  4 products q * x -- the same lane integers ggml's AVX2 code forms with maddubs/sign tricks.  (A
  first version put the whole block's -off * sum(x) into lane 0: same total, but lanes then hold large
  values that cancel only after the float conversion, and an all-zero Q8_0 block gave 1e-5 instead
  of 0.  tests/test_quant.py's extreme-value test catches that.)  Q6_K then packs and scales as
  above (|lane| <= 4 * 32 * 127).  The 32-element formats work on two blocks per zmm iteration.
* Per super-block (K) or block (32-formats): `acc += d * float(lane)` lane-wise, with
  d = f16(d_w) * d_x -- ggml's `_mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc)` -- and one tree sum
  of the lanes per row.  Integer sums are exact; only the float additions differ in order from
  llama.cpp (tests: ggml_vec_dot via ctypes and reference.py at 1e-5 of the sum of |terms|).

CPU guard: `HAVE_VNNI` is decided at import from the feature string numba compiles for (the host's,
or NUMBA_CPU_FEATURES): AVX512-F/BW/VL/VNNI all required; `FUCINA_NO_VNNI=1` forces it off.
Without it decode.py never compiles or calls these kernels (the float kernels remain), so no
illegal instruction can be emitted.  (AVX-VNNI alone, e.g. Alder Lake, would suffice for the ymm
forms but not for the masked byte ops and zmm forms; such CPUs get the float kernels.)

numba's cache: the kernels are cached (`cache=True`); numba keys that cache on a hash of the
defining file's content (plus the kernel's own bytecode), not of the modules it calls -- which is
why the kernels are defined in this file, next to the IR they inline.

Measured (Xeon Sapphire Rapids VM, 2 cores, 2.6 GHz nominal, numba 0.68.1 / llvmlite 0.50, shared
machine: best of repeats, variants of a table measured alternately in the same run).  "1 thread"
= in-cache compute speed of one core (matrix 512x1024 / 1024x3072 / 128x8192, L2 resident, GB/s of
weights).  "Sweep" = bench/bench_matvec.py's Qwen3-0.6B-shaped sweep with 2 threads, calling the
kernels directly (activations quantized once), mostly from DRAM.

| Q4_K variant | 1 thread | 2 threads in cache 1024->3072 | sweep |
|---|---|---|---|
| float kernel (decode._mv_q4_k) | 5.9 / 5.9 / 6.0 | 10.1-10.4 (a) | 8.4 (a) |
| zmm, ggml's scalar scale unpack, one vpdpwssd per dpbusd | 19.2 / 18.2 / 22.0 | | |
| zmm + xmm scale unpack | 20.3 / 18.3 / 22.9 | | |
| zmm + vpackssdw pairs (one vpdpwssd per two dpbusd) | 22.5 / 19.6 / 25.5 | | |
| zmm + both (**chosen**) | 23.5 / 20.8 / 27.1 | 46.3, 46.2 | 13.7, 14.3 (medians 13.0, 13.3) |
| zmm, natural activation order (two ymm loads joined) instead of the permuted copy | 14.4 vs 14.9 (3072x1024, earlier code) | | |
| ymm, ggml's scalar scale unpack, one vpdpwssd per dpbusd | 17.3 / 18.0 / 21.3 | | |
| ymm + both | 21.5 / 23.7 / 27.2 | 43.8, 42.4 | 13.0, 12.9 (medians 12.3, 12.3) |

(a) through `matvec` (activation quantization per call), bench_matvec.py --kernels both.

The ymm and zmm forms tie on one core (zmm integer ops issue on ports 0/5 only, ymm on 0/1/5); with
2 threads and in the sweep zmm was ahead in both runs, so Q4_K keeps zmm.  Prefetch distance for
the zmm kernel (sweep / one cold 87 MB 1024->151936 matrix): 1 KB 13.9 / 19.8, 2 KB 14.2 / 23.0
(**kept**, as the float kernels), 4 KB 14.0 / 17.8, 8 KB 13.6 / 16.1 GB/s; 256 instead of 16 rows
per parallel chunk: no difference.  A trivial streaming kernel (xor of all bytes, same prange
shape, same prefetch) sweeps the same matrices at 17.4-17.8 GB/s and one cold 400 MB array at 25-30:
the chosen kernel streams at ~92% of what this kernel structure (197 parallel calls) allows.

| Q5_K (as Q4_K + 5th bits: per-half 64-bit shifts of the broadcast qh, then and/or) | 1 thread | 2 threads 1024->3072 | sweep |
|---|---|---|---|
| float kernel | 3.9 / 3.9 | 7.1 (a) | 6.3 (a) |
| zmm (permuted activations, xmm scales, pairs) | 20.2 / 15.7 | 46.5 | 14.2 (median 13.2) |
| ymm (**chosen**; no permuted copy either) | 26.2 / 25.7 | 48.3 | 14.0 (median 13.0) |

Q5_K's zmm form has 4 more variable 64-bit shifts per super-block than Q4_K's; zmm shifts (like
vpdpbusd, vpdpwssd and vgf2p8affineqb) issue on port 0 only, which is the likely reason it loses on
one core.

| Q6_K | 1 thread | 2 threads 1024->3072 | sweep |
|---|---|---|---|
| float kernel | 6.0 / 6.1 / 6.0 | 10.3 (a) | 9.3 (a) |
| zmm, one vpdpwssd per dpbusd | 28.8 / 20.2 / 30.7 | | |
| zmm + pairs | 31.6 / 21.2 / 33.8 | 53.7, 62.0 | 14.1, 13.6 (medians 13.5, 13.4) |
| ymm, one vpdpwssd per dpbusd | 24.6 / 20.3 / 25.8 | | |
| ymm + pairs (**chosen**) | 30.8 / 23.3 / 33.7 | 54.5, 56.7 | 14.3, 14.7 (medians 13.9, 13.7) |

(Q6_K's -32 first went in as `-32 * sum_g sc_g * bsum16_g` per super-block from per-16 activation
sums; the per-lane offsets that replaced it for exactness cost nothing: 29.7 / 24.1.)

| 32-element formats, 1 thread (512x1024 / 1024x3072) | Q5_0 | Q4_0 | Q8_0 |
|---|---|---|---|
| float kernel | 5.2 / 5.5 | 5.7 / 6.2 | 12.9 / 13.1 |
| ymm per block, offset computed per block in scalar registers | 14.2 / 12.5 | 14.8 / 13.7 | 26.3 / 20.2 |
| ymm per block, offsets from the per-call array | 16.2 / 13.6 | 14.7 / 14.7 | 29.4 / 22.3 |
| two blocks per zmm iteration (**chosen**; per-lane offsets) | 17.7 / 15.9 | 17.6 / 15.1 | 34.6 / 23.2 |

Q8_0 was already memory-bound with the float kernel, and stays close: sweep 13.2-13.8 -> 15.5-17.2
GB/s in the same runs (kept: faster everywhere, and 2-3x in cache).  The whole-`matvec` numbers
per format (with Python, activation quantization and thread launch) are in decode.py.
"""

from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType as T
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F16 = ir.HalfType()


def V(t, n):
    return ir.VectorType(t, n)


# --- CPU features -------------------------------------------------------------------------------

def numba_cpu_features() -> str:
    """The LLVM feature string numba compiles for: NUMBA_CPU_FEATURES if set, else the host's."""
    return str(config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features())


# vpdpbusd/vpdpwssd on ymm and zmm (AVX512-VNNI + VL), byte/word ops and mask registers (BW)
NEEDED_FEATURES = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512vnni"})


def vnni_usable(features: str) -> bool:
    """True if an LLVM feature string ("+avx2,-avx512f,...") enables everything these kernels emit."""
    on = {f[1:] for f in features.split(",") if f.startswith("+")}
    return NEEDED_FEATURES <= on


# Decided once, at import.  FUCINA_NO_VNNI=1 forces the float kernels.
HAVE_VNNI = vnni_usable(numba_cpu_features()) and os.environ.get("FUCINA_NO_VNNI", "") in ("", "0")


# --- IR helpers ---------------------------------------------------------------------------------

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
    """Load a value of type `ty` from i8* `base` + i64 `off` (unaligned by default)."""
    p = builder.gep(base, [off]) if off is not None else base
    return builder.load(builder.bitcast(p, ty.as_pointer()), align=align)


def load_f16(builder, base, off):
    return builder.fpext(builder.bitcast(load(builder, base, off, I16), F16), F32)


def splat(builder, v, n):
    t = v.type
    u = builder.insert_element(ir.Constant(V(t, 1), ir.Undefined), v, ir.Constant(I32, 0))
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
    return call(builder, f"llvm.x86.avx512.vpdpwssd.{32 * n}", acc.type, acc,
                builder.bitcast(a16, V(I16, 2 * n)), builder.bitcast(b16, V(I16, 2 * n)))


def pmaddwd(builder, a16, b16):
    n = a16.type.count // 2 if a16.type.element == I16 else a16.type.count
    name = "llvm.x86.avx2.pmadd.wd" if n == 8 else "llvm.x86.avx512.pmaddw.d.512"
    return call(builder, name, V(I32, n), builder.bitcast(a16, V(I16, 2 * n)), builder.bitcast(b16, V(I16, 2 * n)))


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


def fma(builder, a, b, c):
    n = a.type.count
    return call(builder, f"llvm.fma.v{n}f32", a.type, a, b, c)


def data_ptr(context, builder, aryty, ary):
    a = context.make_array(aryty)(context, builder, ary)
    return builder.bitcast(a.data, I8.as_pointer())


def _c_1d(t):
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C"


# --- Q4_K ---------------------------------------------------------------------------------------

def _q4k_scales(b, p):
    """16 bytes: sc[0..7] then m[0..7] from the 12 packed scale bytes at i8* p (ggml's utmp trick)."""
    u0 = load(b, p, ir.Constant(I64, 4), I32)
    u1 = load(b, p, ir.Constant(I64, 8), I32)
    u2 = load(b, p, ir.Constant(I64, 12), I32)
    k1 = ir.Constant(I32, 0x3F3F3F3F)
    k2 = ir.Constant(I32, 0x0F0F0F0F)
    k3 = ir.Constant(I32, 0x03030303)
    c4 = ir.Constant(I32, 4)
    c6 = ir.Constant(I32, 6)
    t3 = b.or_(b.and_(b.lshr(u2, c4), k2), b.shl(b.and_(b.lshr(u1, c6), k3), c4))
    t2 = b.and_(u1, k1)
    t1 = b.or_(b.and_(u2, k2), b.shl(b.and_(b.lshr(u0, c6), k3), c4))
    t0 = b.and_(u0, k1)
    v = ir.Constant(V(I32, 4), ir.Undefined)
    for i, t in enumerate((t0, t1, t2, t3)):
        v = b.insert_element(v, t, ir.Constant(I32, i))
    return b.bitcast(v, V(I8, 16))


def _pairs(idx_list, zero_idx):
    """Byte shuffle mask making int32 lanes (byte idx, 0, 0, 0): an (s16 value, 0) pair per lane."""
    m = []
    for i in idx_list:
        m += [i, zero_idx, zero_idx, zero_idx]
    return m


def _q4k_scales_vec(b, raw16):
    """<16 x i8> sc[0..7], m[0..7] from the first 16 bytes of a Q4_K/Q5_K block (d, dmin, scales[12]),
    in vector registers: two byte shuffles, shifts and masks instead of ggml's scalar utmp trick."""
    z = ir.Constant(V(I8, 16), None)
    a = b.bitcast(shuffle(b, raw16, z, [4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15]), V(I32, 4))
    a = b.and_(b.lshr(a, const_vec(I32, 4, [0, 0, 0, 4])),
               const_vec(I32, 4, [0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    h = b.bitcast(shuffle(b, raw16, z, [16] * 4 + [4, 5, 6, 7] + [16] * 4 + [8, 9, 10, 11]), V(I32, 4))
    h = b.and_(b.lshr(h, const_vec(I32, 4, 2)), const_vec(I32, 4, 0x30303030))
    return b.bitcast(b.or_(a, h), V(I8, 16))


def _pairs_w(idx_list, zero_idx):
    """Byte shuffle mask making int16 words (byte idx, 0)."""
    m = []
    for i in idx_list:
        m += [i, zero_idx]
    return m


def packssdw(b, a, c):
    n = a.type.count
    name = "llvm.x86.avx512.packssdw.512" if n == 16 else "llvm.x86.avx2.packssdw"
    return call(b, name, V(I16, 2 * n), a, c)


def q4k_row(b, w, x, xd, xbs, nsb, pf, width=512, permuted=False, vec_scales=True, pack=True, five=False):
    """Q4_K row . Q8_K activations.  width 512: zmm, x permuted per 128 as [0:32, 64:96, 32:64, 96:128]
    (or natural order, concatenating two ymm loads, if not `permuted`); width 256: ymm, natural x.
    vec_scales: unpack the 6-bit scales in xmm registers (else ggml's scalar utmp trick); pack: pack
    two dpbusd results to int16 (vpackssdw) and scale both with one vpdpwssd (else one each).
    five: Q5_K (176-byte blocks: qh[32] at 16, qs at 48; the 5th bit of element 32 s + l is bit s of qh[l])."""
    bpb, qs_off = (176, 48) if five else (144, 16)
    nl = width // 32                       # int32 lanes
    nb = width // 8                        # bytes per vector
    zero = ir.Constant(V(I32, nl), None)
    acc_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, nl), None))
    accm_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, 8), None))
    m4 = const_vec(I8, nb, 0x0F)
    c4 = const_vec(I8, nb, 4)
    z16 = ir.Constant(V(I8, 16), None)
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        o = b.mul(i, ir.Constant(I64, bpb))
        po = b.add(o, pf)
        for k in range(3):
            prefetch(b, w, b.add(po, ir.Constant(I64, 64 * k)))
        p = b.gep(w, [o])
        xs = load(b, xd, b.mul(i, ir.Constant(I64, 4)), F32)
        if five:
            qh = load(b, p, ir.Constant(I64, 16), V(I8, 32))
            qhh = shuffle(b, qh, qh, list(range(32)) * (width // 256))
            qhh = b.bitcast(qhh, V(I64, width // 64))
        if vec_scales:
            raw16 = load(b, p, None, V(I8, 16))
            dd = b.fpext(shuffle(b, b.bitcast(raw16, V(F16, 8)), ir.Constant(V(F16, 8), None), [0, 1]), V(F32, 2))
            dd = b.fmul(dd, splat(b, xs, 2))
            d = b.extract_element(dd, ir.Constant(I32, 0))
            dmin = b.extract_element(dd, ir.Constant(I32, 1))
            sm = _q4k_scales_vec(b, raw16)
        else:
            d = b.fmul(load_f16(b, p, None), xs)
            dmin = b.fmul(load_f16(b, p, ir.Constant(I64, 2)), xs)
            sm = _q4k_scales(b, p)  # <16 x i8>: sc[0..7], m[0..7]
        # mins: sum_j m_j * bsum32_j, 8 lanes, accumulated as float with dmin
        mw = b.bitcast(shuffle(b, sm, z16, _pairs(range(8, 16), 16)), V(I16, 16))
        bs = load(b, xbs, b.mul(i, ir.Constant(I64, 32)), V(I32, 8))
        msum = pmaddwd(b, mw, bs)
        accm = b.load(accm_p)
        b.store(fma(b, splat(b, dmin, 8), b.sitofp(msum, V(F32, 8)), accm), accm_p)
        sumi = zero
        xo = b.mul(i, ir.Constant(I64, 256))
        nvec = 128 // nb                    # quant vectors per super-block
        for j in range(nvec):
            q = load(b, p, ir.Constant(I64, qs_off + nb * j), V(I8, nb))
            lo = b.and_(q, m4)
            hi = b.and_(b.lshr(q, c4), m4)
            # sub-block of each 32-byte half of lo / hi
            sub_lo = [4 * j, 4 * j + 2] if width == 512 else [2 * j]
            sub_hi = [4 * j + 1, 4 * j + 3] if width == 512 else [2 * j + 1]
            if five:
                m10 = const_vec(I8, nb, 0x10)
                lo = b.or_(lo, b.and_(b.bitcast(_shift_to_bit4(b, qhh, sub_lo), V(I8, nb)), m10))
                hi = b.or_(hi, b.and_(b.bitcast(_shift_to_bit4(b, qhh, sub_hi), V(I8, nb)), m10))
            if width == 512 and permuted:
                xlo = load(b, x, b.add(xo, ir.Constant(I64, 128 * j)), V(I8, 64))
                xhi = load(b, x, b.add(xo, ir.Constant(I64, 128 * j + 64)), V(I8, 64))
            elif width == 512:
                xx = [load(b, x, b.add(xo, ir.Constant(I64, 128 * j + 32 * k)), V(I8, 32)) for k in range(4)]
                xlo = shuffle(b, xx[0], xx[2], range(64))
                xhi = shuffle(b, xx[1], xx[3], range(64))
            else:
                xlo = load(b, x, b.add(xo, ir.Constant(I64, 64 * j)), V(I8, 32))
                xhi = load(b, x, b.add(xo, ir.Constant(I64, 64 * j + 32)), V(I8, 32))
            dlo = dpbusd(b, zero, lo, xlo)
            dhi = dpbusd(b, zero, hi, xhi)
            if pack:
                # int16 words per 128-bit lane L: dlo[4L..4L+3], dhi[4L..4L+3]
                idx = []
                for L in range(nl // 4):
                    h = (L * 4) // 8          # which 32-byte half lane L came from
                    idx += [sub_lo[h]] * 4 + [sub_hi[h]] * 4
                sc = shuffle(b, sm, z16, _pairs_w(idx, 16))
                sumi = dpwssd(b, sumi, packssdw(b, dlo, dhi), sc)
            else:
                slo = shuffle(b, sm, z16, _pairs([sub_lo[k // 8] for k in range(nl)], 16))
                shi = shuffle(b, sm, z16, _pairs([sub_hi[k // 8] for k in range(nl)], 16))
                sumi = dpwssd(b, sumi, dlo, slo)
                sumi = dpwssd(b, sumi, dhi, shi)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), acc), acc_p)
    acc = b.load(acc_p)
    if nl == 16:
        acc = b.fadd(shuffle(b, acc, acc, range(8)), shuffle(b, acc, acc, range(8, 16)))
    return hsum_f32(b, b.fsub(acc, b.load(accm_p)))


def _shift_to_bit4(b, v64, bits):
    """<n x i64> v64 shifted per 256-bit part h so that bit bits[h] of every byte lands on bit 4."""
    n = v64.type.count
    left = [max(0, 4 - bits[h // 4]) for h in range(n)]
    right = [max(0, bits[h // 4] - 4) for h in range(n)]
    if any(right):
        v64 = b.lshr(v64, const_vec(I64, n, right))
    if any(left):
        v64 = b.shl(v64, const_vec(I64, n, left))
    return v64


# --- Q6_K ---------------------------------------------------------------------------------------

def q6k_row(b, w, x, xd, xoff, nsb, pf, width=256, pack=True):
    """Q6_K row . Q8_K activations (natural order).  The quants are u = q + 32 (0..63, unsigned for
    vpdpbusd); xoff int32[n/4] = -32 * (sum of the 4 activations of each int32 lane) starts every
    dpbusd, so each lane holds the exact sum of its 4 products (q - 32) x, as ggml's lanes do."""
    nl = width // 32
    nb = width // 8
    zero = ir.Constant(V(I32, nl), None)
    acc_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, nl), None))
    m4 = const_vec(I8, nb, 0x0F)
    m30 = const_vec(I8, nb, 0x30)
    c4 = const_vec(I8, nb, 4)
    z32 = ir.Constant(V(I8, 32), None)
    z16w = ir.Constant(V(I16, 16), None)
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        o = b.mul(i, ir.Constant(I64, 210))
        po = b.add(o, pf)
        for k in range(4):
            prefetch(b, w, b.add(po, ir.Constant(I64, 64 * k)))
        p = b.gep(w, [o])
        d = b.fmul(load_f16(b, p, ir.Constant(I64, 208)), load(b, xd, b.mul(i, ir.Constant(I64, 4)), F32))
        sc16 = b.sext(load(b, p, ir.Constant(I64, 192), V(I8, 16)), V(I16, 16))
        sc8 = b.bitcast(sc16, V(I8, 32))
        sumi = zero
        xo = b.mul(i, ir.Constant(I64, 256))
        for n in range(2):
            e0 = 128 * n
            if width == 512:
                ql = load(b, p, ir.Constant(I64, 64 * n), V(I8, 64))
                qh = load(b, p, ir.Constant(I64, 128 + 32 * n), V(I8, 32))
                qhh = b.bitcast(shuffle(b, qh, qh, list(range(32)) * 2), V(I64, 8))
                ha = b.bitcast(b.shl(qhh, const_vec(I64, 8, [4] * 4 + [2] * 4)), V(I8, 64))
                hb = b.bitcast(b.lshr(qhh, const_vec(I64, 8, [0] * 4 + [2] * 4)), V(I8, 64))
                qs = [b.or_(b.and_(ql, m4), b.and_(ha, m30)),                # elements 0..63 of this half
                      b.or_(b.and_(b.lshr(ql, c4), m4), b.and_(hb, m30))]   # elements 64..127
                # group (16 elements) of int32 lane l of qs[k]: 8n + 4k + l // 4
                groups = [[8 * n + 4 * k + l // 4 for l in range(16)] for k in range(2)]
            else:
                ql0 = load(b, p, ir.Constant(I64, 64 * n), V(I8, 32))
                ql1 = load(b, p, ir.Constant(I64, 64 * n + 32), V(I8, 32))
                qh = b.bitcast(load(b, p, ir.Constant(I64, 128 + 32 * n), V(I8, 32)), V(I64, 4))
                hs = [b.bitcast(v, V(I8, 32)) for v in
                      (b.shl(qh, const_vec(I64, 4, 4)), b.shl(qh, const_vec(I64, 4, 2)), qh,
                       b.lshr(qh, const_vec(I64, 4, 2)))]
                lows = (b.and_(ql0, m4), b.and_(ql1, m4), b.and_(b.lshr(ql0, c4), m4), b.and_(b.lshr(ql1, c4), m4))
                qs = [b.or_(lo, b.and_(h, m30)) for lo, h in zip(lows, hs)]   # elements 32k..32k+31
                groups = [[8 * n + 2 * k + l // 4 for l in range(8)] for k in range(4)]
            # xoff has one int32 per 4 activations: its byte offset equals the element index
            dots = [dpbusd(b, load(b, xoff, b.add(xo, ir.Constant(I64, e0 + nb * k)), V(I32, nl)), q,
                           load(b, x, b.add(xo, ir.Constant(I64, e0 + nb * k)), V(I8, nb)))
                    for k, q in enumerate(qs)]
            for k in range(0, len(dots), 2 if pack else 1):
                if pack:
                    idx = []
                    for L in range(nl // 4):
                        idx += [groups[k][4 * L]] * 4 + [groups[k + 1][4 * L]] * 4
                    scw = shuffle(b, sc16, z16w, idx)
                    sumi = dpwssd(b, sumi, packssdw(b, dots[k], dots[k + 1]), scw)
                else:
                    scp = shuffle(b, sc8, z32, _pairs16(groups[k], 32))
                    sumi = dpwssd(b, sumi, dots[k], scp)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), acc), acc_p)
    return hsum_f32(b, b.load(acc_p))


def _pairs16(idx_list, zero_idx):
    """Byte shuffle mask of int32 lanes (lo byte, hi byte of int16 #idx, 0, 0) from an int16 vector seen as bytes."""
    m = []
    for i in idx_list:
        m += [2 * i, 2 * i + 1, zero_idx, zero_idx]
    return m


# --- 32-element block formats: Q8_0, Q4_0, Q5_0 ---------------------------------------------------

_BLK32 = {"q8_0": (34, 2), "q4_0": (18, 2), "q5_0": (22, 6)}   # bytes per block, offset of the quants


def _blk32_quants(b, p, fmt, k):
    """<32*k x i8> unsigned quants u = q + off of k consecutive blocks starting at i8* p."""
    bpb, qo = _BLK32[fmt]
    n = 32 * k
    if fmt == "q8_0":
        parts = [load(b, p, ir.Constant(I64, bpb * j + qo), V(I8, 32)) for j in range(k)]
        u = parts[0] if k == 1 else shuffle(b, parts[0], parts[1], range(64))
        return b.xor(u, const_vec(I8, n, 0x80))
    parts = [load(b, p, ir.Constant(I64, bpb * j + qo), V(I8, 16)) for j in range(k)]
    if k == 1:
        q2 = shuffle(b, parts[0], parts[0], list(range(16)) * 2)
    else:
        q2 = shuffle(b, parts[0], parts[1], list(range(16)) * 2 + list(range(16, 32)) * 2)
    q2 = b.bitcast(q2, V(I64, n // 8))
    u = b.bitcast(b.lshr(q2, const_vec(I64, n // 8, [0, 0, 4, 4] * k)), V(I8, n))
    u = b.and_(u, const_vec(I8, n, 0x0F))
    if fmt == "q5_0":
        hs = [load(b, p, ir.Constant(I64, bpb * j + 2), I32) for j in range(k)]
        if k == 1:
            bits = b.bitcast(hs[0], V(ir.IntType(1), 32))
        else:
            h64 = b.or_(b.zext(hs[0], I64), b.shl(b.zext(hs[1], I64), ir.Constant(I64, 32)))
            bits = b.bitcast(h64, V(ir.IntType(1), 64))
        u = b.or_(u, b.select(bits, const_vec(I8, n, 0x10), ir.Constant(V(I8, n), None)))
    return u


def blk32_row(b, w, x, xd, xoff, nb, pf, fmt, pair=True):
    """Row . Q8_0 activations for fmt in Q8_0 / Q4_0 / Q5_0:
    y = sum_b (d_w d_x)[b] * sum_j (u_j - off) x_j, with u = q + off >= 0 the unsigned quants.
    xoff int32[n/4] = -off * (sum of the 4 activations of each int32 lane) starts every dpbusd, so each
    lane holds the exact sum of its 4 products q x, as ggml's lanes do before `d * float(lane)`.
    pair: two blocks per zmm iteration (else one per ymm); an odd last block goes through ymm."""
    bpb, _ = _BLK32[fmt]
    acc_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, 8), None))
    start = ir.Constant(I64, 0)
    if pair:
        acc2_p = cgutils.alloca_once_value(b, ir.Constant(V(F32, 16), None))
        npair = b.sdiv(nb, ir.Constant(I64, 2))
        with cgutils.for_range(b, npair) as loop:
            i = b.mul(loop.index, ir.Constant(I64, 2))
            o = b.mul(i, ir.Constant(I64, bpb))
            prefetch(b, w, b.add(o, pf))
            if 2 * bpb > 64:
                prefetch(b, w, b.add(b.add(o, pf), ir.Constant(I64, 64)))
            p = b.gep(w, [o])
            dw = [load(b, p, ir.Constant(I64, bpb * j), I16) for j in range(2)]
            dv = ir.Constant(V(I16, 2), ir.Undefined)
            for j in range(2):
                dv = b.insert_element(dv, dw[j], ir.Constant(I32, j))
            dv = b.fpext(b.bitcast(dv, V(F16, 2)), V(F32, 2))
            dv = b.fmul(dv, load(b, xd, b.mul(i, ir.Constant(I64, 4)), V(F32, 2)))
            dv = shuffle(b, dv, dv, [0] * 8 + [1] * 8)
            u = _blk32_quants(b, p, fmt, 2)
            init = load(b, xoff, b.mul(i, ir.Constant(I64, 32)), V(I32, 16))
            xv = load(b, x, b.mul(i, ir.Constant(I64, 32)), V(I8, 64))
            dot = dpbusd(b, init, u, xv)
            acc = b.load(acc2_p)
            b.store(fma(b, dv, b.sitofp(dot, V(F32, 16)), acc), acc2_p)
        a2 = b.load(acc2_p)
        b.store(b.fadd(shuffle(b, a2, a2, range(8)), shuffle(b, a2, a2, range(8, 16))), acc_p)
        start = b.mul(npair, ir.Constant(I64, 2))
    with cgutils.for_range(b, nb, start=start) as loop:
        i = loop.index
        o = b.mul(i, ir.Constant(I64, bpb))
        prefetch(b, w, b.add(o, pf))
        p = b.gep(w, [o])
        d = b.fmul(load_f16(b, p, None), load(b, xd, b.mul(i, ir.Constant(I64, 4)), F32))
        u = _blk32_quants(b, p, fmt, 1)
        init = load(b, xoff, b.mul(i, ir.Constant(I64, 32)), V(I32, 8))
        xv = load(b, x, b.mul(i, ir.Constant(I64, 32)), V(I8, 32))
        dot = dpbusd(b, init, u, xv)
        acc = b.load(acc_p)
        b.store(fma(b, splat(b, d, 8), b.sitofp(dot, V(F32, 8)), acc), acc_p)
    return hsum_f32(b, b.load(acc_p))


# --- the numba-callable intrinsics -----------------------------------------------------------------

def _row_intrinsic(body, *extra, **options):
    """A numba intrinsic f(wf, off, n, x8, xd, xs, pf) -> float32: `body` (a builder above) on the
    weight row at byte `off` of wf (n blocks), activations x8 int8, their scales xd float32 and the
    format's activation side array xs; prefetching pf bytes ahead.  All arrays 1-D, C-contiguous."""
    @intrinsic
    def row_dot(typingctx, wf, off, n, x8, xd, xs, pf):
        if not (_c_1d(wf) and _c_1d(x8) and _c_1d(xd) and _c_1d(xs)):
            return None
        sig = types.float32(wf, off, n, x8, xd, xs, pf)

        def codegen(context, builder, signature, args):
            a = signature.args
            ptr = [data_ptr(context, builder, a[k], args[k]) if k in (0, 3, 4, 5) else None for k in range(7)]
            w = builder.gep(ptr[0], [context.cast(builder, args[1], a[1], types.int64)])
            return body(builder, w, ptr[3], ptr[4], ptr[5], context.cast(builder, args[2], a[2], types.int64),
                        context.cast(builder, args[6], a[6], types.int64), *extra, **options)

        return sig, codegen
    return row_dot


# The kernels decode.py uses (the variant each format keeps: see the module docstring).
q4k_row_vnni = _row_intrinsic(q4k_row, width=512, permuted=True)
q5k_row_vnni = _row_intrinsic(q4k_row, width=256, five=True)
q6k_row_vnni = _row_intrinsic(q6k_row, width=256)
q8_0_row_vnni = _row_intrinsic(blk32_row, "q8_0")
q4_0_row_vnni = _row_intrinsic(blk32_row, "q4_0")
q5_0_row_vnni = _row_intrinsic(blk32_row, "q5_0")


# --- the decode kernels ------------------------------------------------------------------------------
# They live here rather than in decode.py because numba's cache (`cache=True`) is keyed on the content
# of the file that defines the cached function: next to the IR builders above, any edit of this file
# recompiles them; defined in decode.py, they would keep running stale IR after an edit here.

_ROWS = 16          # output rows per parallel chunk (as decode.py)
_PREFETCH = 2048    # bytes ahead in the weight stream (as decode.py; measured above)


@njit(inline="always")
def _interleave_64(xi, x8):
    """x8[128 g + ...] = xi[128 g + (0:32, 64:96, 32:64, 96:128)]: the order of Q4_K/Q5_K low and high
    nibbles when 64 quant bytes (two 32-byte chunks) are unpacked at once."""
    for g in range(xi.size // 128):
        o = 128 * g
        for l in range(32):
            x8[o + l] = xi[o + l]
            x8[o + 32 + l] = xi[o + 64 + l]
            x8[o + 64 + l] = xi[o + 32 + l]
            x8[o + 96 + l] = xi[o + 96 + l]


@njit(parallel=True, cache=True)
def mv_q4_k(w, wf, xi, xd, xbs, y):
    """decode._mv_q4_k, integer: w uint8[n_out, nsb*144] (wf the same bytes flat), xi int8[nsb*256],
    xd f32[nsb], xbs int32[nsb*8] -> y f32[n_out]; q4k_row_vnni (zmm) per row, on a copy of xi in
    the order of the nibbles."""
    n_out, rb = w.shape
    nsb = rb // 144
    x8 = np.empty(nsb * 256, np.int8)
    _interleave_64(xi, x8)
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            y[r] = q4k_row_vnni(wf, r * rb, nsb, x8, xd, xbs, _PREFETCH)


@njit(parallel=True, cache=True)
def mv_q5_k(w, wf, xi, xd, xbs, y):
    """decode._mv_q5_k, integer: q5k_row_vnni (ymm: activations in natural order) per row."""
    n_out, rb = w.shape
    nsb = rb // 176
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            y[r] = q5k_row_vnni(wf, r * rb, nsb, xi, xd, xbs, _PREFETCH)


@njit(parallel=True, cache=True)
def mv_q6_k(w, wf, xi, xd, y):
    """decode._mv_q6_k, integer: quants u = q + 32, lanes started at -32 * (their 4 activations)."""
    n_out, rb = w.shape
    nsb = rb // 210
    xoff = _lane_offsets(xi, 32)
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            y[r] = q6k_row_vnni(wf, r * rb, nsb, xi, xd, xoff, _PREFETCH)


@njit(inline="always")
def _lane_offsets(xi, off):
    """int32[n/4]: -off * (xi[4k] + ... + xi[4k+3]), the start value of dpbusd lane k when the weight
    quants are stored as u = q + off (so the lane ends as the exact sum of its 4 products q x)."""
    xoff = np.empty(xi.size // 4, np.int32)
    for k in range(xi.size // 4):
        xoff[k] = np.int32(-off) * (np.int32(xi[4 * k]) + np.int32(xi[4 * k + 1])
                                    + np.int32(xi[4 * k + 2]) + np.int32(xi[4 * k + 3]))
    return xoff


@njit(parallel=True, cache=True)
def mv_q8_0(w, wf, xi, xd, y):
    """decode._mv_q8_0, integer: quants u = q ^ 0x80 = q + 128, lanes started at -128 * (their 4 activations)."""
    n_out, rb = w.shape
    nb = rb // 34
    xoff = _lane_offsets(xi, 128)
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            y[r] = q8_0_row_vnni(wf, r * rb, nb, xi, xd, xoff, _PREFETCH)


@njit(parallel=True, cache=True)
def mv_q4_0(w, wf, xi, xd, y):
    """decode._mv_q4_0, integer: the nibbles are u = q + 8 already."""
    n_out, rb = w.shape
    nb = rb // 18
    xoff = _lane_offsets(xi, 8)
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            y[r] = q4_0_row_vnni(wf, r * rb, nb, xi, xd, xoff, _PREFETCH)


@njit(parallel=True, cache=True)
def mv_q5_0(w, wf, xi, xd, y):
    """decode._mv_q5_0, integer: nibble | 5th bit is u = q + 16 already."""
    n_out, rb = w.shape
    nb = rb // 22
    xoff = _lane_offsets(xi, 16)
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            y[r] = q5_0_row_vnni(wf, r * rb, nb, xi, xd, xoff, _PREFETCH)


# format -> (kernel, whether it takes the activations' per-32 sums bsum32 after qi and d)
KERNELS = {T.Q4_K: (mv_q4_k, True), T.Q5_K: (mv_q5_k, True), T.Q6_K: (mv_q6_k, False),
           T.Q8_0: (mv_q8_0, False), T.Q4_0: (mv_q4_0, False), T.Q5_0: (mv_q5_0, False)}
