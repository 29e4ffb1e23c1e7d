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
decode.py) run one call per output row inside a `prange` loop; the multi-row kernels (`mm_q4_k` ...,
table `MM_KERNELS`, dispatched by prefill.py) one call per output row and tile of 8 activation rows.  No bounds checks: every load
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

Multi-row kernels (`matmul`, prefill.py's path "rows").  `q4k_rows_vnni` ...  `q5_0_rows_vnni` dot one
weight row with up to 8 activation rows (a *tile*): each (super-)block is loaded and unpacked once,
then each row does its own dpbusd / scale / float steps -- the one-row builder's, instruction for
instruction, so every result is bit-identical to the decode kernel's (section comment above
`_Tile`).  The parallel kernels `mm_q4_k` ...  (table `MM_KERNELS`) take a MultiMatrix's parts in one
call (weight addresses as int64), prange over chunks of 16 weight rows of all parts, and pass the
tiles of 8 activation rows over each chunk while it sits in L1/L2 (one call for q/k/v, 2048 + 1024 +
1024 rows x 1024, vs one call per part: Q4_K m = 4 / 16 160 / 480 vs 196 / 543 us, Q8_0 209 / 595 vs
275 / 695 us: one parallel region and one activation pass instead of three).  The formats with an
offset move it to the weight side (the activations stored once as x + 128): one extra dpbusd per
weight vector shared by the tile, instead of a second activation-side load per row (the one-row
kernels' `xoff`).

Measured as above (GFLOP/s = 2 m n_out n_in / time, 1024->3072 called back to back, 2 threads,
best of repeats, variants alternating in one run; "sweep" = the model sweep with m rows at once, GB/s
of weights).  The tile structure, Q4_K / Q8_0:

| variant | Q4_K m=2 / 4 / 8 / 16 / 64 | Q8_0 m=2 / 4 / 8 / 16 / 64 |
|---|---|---|
| run-time loop over the rows, accumulators in memory, tile 8 | 158 / 209 / 223 / 240 / 239 | 123 / 133 / 154 / 187 / 161 |
| same, tile 4 / tile 16 (m=64) | 207 / 252 | 138 / 184 |
| 4 rows unrolled, missing rows recomputed (m < 4) | 117 / 228 / 230 / 235 / 222 | 97 / 188 / 203 / 207 / 206 |
| 8 rows unrolled, missing rows recomputed | 67 / 143 / 233-263 / 266-280 / 246-261 | 59 / 107 / 205-218 / 218-225 / 219-232 |
| 8 rows unrolled, row k's work behind a `k < nr` branch (**chosen**) | 176 / 226 / 258 / 283 / 218-267 | 105 / 161 / 203 / 221 / 205 |
| same, 16 rows (registers spill) | 84 / 133 / 181 / 258 / 203 | 78 / 136 / 180 / 206 / 204 |

Per format, branch-guarded 8 rows vs the run-time loop (m = 2 / 4 / 8 / 64): Q6_K 158 / 224 / 293 /
286 vs 124 / 177 / 227 / 242, Q5_0 98 / 147 / 186 / 186 vs 98 / 138 / 169 / 149, Q4_0 111 / 168 /
210 / 209 vs 118 / 144 / 173 / 167, Q5_K 136 / 205 / 233 / 257 vs 124 / 184 / 217 / 232.  A
branch-guarded 4-row form was 3-16% ahead at m <= 4 and 4-17% behind from m = 8 (same four
formats).  Q4_K/Q5_K keep their 8-lane mins accumulators in memory on purpose (volatile load/store
once per super-block, `_Slot`): with all 16 accumulators in registers LLVM spilled constants inside
the loop, and the kernel streamed worse from DRAM -- Q4_K sweep, m = 1 / 2 / 4: the one-row decode
kernel once per activation row 16.5 / 11.3 / 7.0 GB/s; tile kernel, all in registers 12.3 / 13.3 /
11.1; mins in memory (**chosen**) 12.4 / 15.4 / 12.8; the 4-row form 14.9 / 14.8 / 12.9.  (4 streams
of the Q4_K model: 86-89 tok/s all in registers, 94-96 with 4 rows.) In cache the two tie (m = 8:
255 vs 259, m = 64: 268 vs 268).  (m = 1 stays with the one-row kernels.)

Rejected:
* 32-element formats with the two blocks of a zmm interleaved by 4-byte groups (lane 2l = block i,
  2l + 1 = block i + 1: the same lane integers), so that the per-lane scale is a 64-bit broadcast of
  the row's two activation scales rather than a multiply + lane permute per row.  LLVM narrowed the
  broadcast back into a register shuffle; with the scales pre-broadcast in a side array (one 64-byte
  load per row and pair) it was no faster either: Q8_0 m = 8 / 16 / 64: 194 / 214 / 207 vs 209 /
  210 / 206, Q5_0 m = 64: 145 vs 176.  These kernels are not bound by that permute.
* Software prefetch distance (Q4_K sweep, m = 2 / 4): 1 KB 11.4 / 10.9, 2 KB 12.0 / 11.1 (**kept**),
  4 KB 12.3 / 11.2, 8 KB 12.7 / 12.4 GB/s: within the sweep's noise.  Chunks of 8 or 4 weight rows
  instead of 16 (3072->1024, m = 64, where a chunk and a tile together overflow L1): 300 / 301 vs 301.
* Dynamic scheduling (one prange iteration per thread taking chunks from an atomic counter): no
  faster alone, and no help against the slowdown OpenBLAS's spinning worker threads cause (prefill.py):
  6 calls of Q4_K m=64 right after a threaded sgemm, 20-30 ms vs 21-28 static (9.6 static without the
  sgemm); in the model, pp64 95 vs 98-105 tok/s.
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


# --- multi-row kernels: one weight row . a tile of activation rows --------------------------------
# The row builders above dot one weight row with one activation vector.  The builders below dot one
# weight row with `nr` activation rows (a tile of a [m, n] matrix): every weight block is loaded and
# unpacked once and then multiplied with each activation row in turn, so a weight row streams from
# memory once per tile instead of once per activation row.  Per activation row, the float work is
# the one-row builder's, instruction for instruction (same lane layout, same `d * float(lane)` fma
# per (super-)block, same final tree sum), and the integer lane sums are equal -- so row i of the
# result is bit-identical to the one-row kernel on activation row i (tests/test_quant.py asserts
# equality).  What differs is how the formats with an offset (u = q + off) form their lanes:
#
#   one-row:  lane = dpbusd(xoff, u, x)     xoff = -off * (sum of the lane's 4 activations), per call
#   tile:     lane = dpbusd(init, x ^ 0x80, q)   with q = u - off (signed), x + 128 (unsigned), and
#             init = 512 * off - 128 * (sum of the lane's 4 u) = dpbusd(512 * off, u, -128)
#
# i.e. the correction moves from the activation side (an int32 array as large as x, loaded per
# activation row) to the weight side (one extra vpdpbusd per weight vector, shared by the tile).
# Both give the exact integer sum_j (u_j - off) x_j per lane.  The activations are stored once per
# call as x + 128 (`_xor80`), and, for Q4_K's zmm form, in its nibble order (`_interleave_64`).


class _Tile:
    """Activation rows t0 .. t0+nr of 2-D C arrays x8 [m, n] (int8), xd [m, nblk] (f32), xs [m, *]
    (the side array), and the output y [m, ldy] (f32, column `col`), as i8* pointers and byte strides."""

    def __init__(self, b, x, xst, xd, xdst, xs, xsst, y, yst, t0, nr, col):
        self.x, self.xst, self.xd, self.xdst, self.xs, self.xsst = x, xst, xd, xdst, xs, xsst
        self.y, self.yst, self.t0, self.nr, self.col = y, yst, t0, nr, col

    def ptrs(self, b, r):
        """(x, xd, xs) i8* of tile row r (an i64 value)."""
        i = b.add(self.t0, r)
        return (b.gep(self.x, [b.mul(i, self.xst)]), b.gep(self.xd, [b.mul(i, self.xdst)]),
                b.gep(self.xs, [b.mul(i, self.xsst)]))

    def store(self, b, r, v):
        i = b.add(self.t0, r)
        off = b.add(b.mul(i, self.yst), b.mul(self.col, ir.Constant(I64, 4)))
        b.store(v, b.bitcast(b.gep(self.y, [off]), F32.as_pointer()))


class _Rows:
    """Iteration over the rows of a tile and per-row accumulators.

    unroll=0: a run-time loop over the nr rows (any nr <= rmax); accumulators in an alloca'd array,
    loaded and stored once per (super-)block and row.  unroll=R: R rows in straight-line code,
    accumulators promoted to registers; with guard, row k's work is skipped by a branch when k >= nr,
    else rows >= nr repeat row nr-1; either way only rows < nr are stored."""

    def __init__(self, b, tile, rmax, unroll=0, guard=True):
        self.tile, self.rmax, self.unroll, self.guard = tile, rmax, unroll, guard

    def each(self, b, fn):
        """fn(r, k): r the tile row (i64 value), k the accumulator key."""
        t = self.tile
        if not self.unroll:
            with cgutils.for_range(b, t.nr) as loop:
                fn(loop.index, loop.index)
            return
        last = b.sub(t.nr, ir.Constant(I64, 1))
        for k in range(self.unroll):
            kc = ir.Constant(I64, k)
            if not self.guard:
                fn(b.select(b.icmp_signed("<", kc, t.nr), kc, last), k)
            elif k == 0:
                fn(kc, k)          # nr >= 1
            else:
                with b.if_then(b.icmp_signed("<", kc, t.nr), likely=True):
                    fn(kc, k)

    def acc(self, b, ty, memory=False):
        """Accumulator slots: acc(b, k) -> pointer.  memory=True keeps them in memory even when
        unrolled (see `_Slot`): fewer registers for rows touched once per super-block."""
        n = self.unroll or self.rmax
        if self.unroll and not memory:
            slots = [cgutils.alloca_once(b, ty) for _ in range(n)]
            return lambda b, k: slots[k]
        arr = cgutils.alloca_once(b, ir.ArrayType(ty, n))
        if memory:
            def slot(b, k):
                return _Slot(b.gep(arr, [ir.Constant(I32, 0), ir.Constant(I32, k) if isinstance(k, int) else k]))
            return slot
        return lambda b, k: b.gep(arr, [ir.Constant(I32, 0), k])

    def finish(self, b, fn):
        """fn(r, k) -> f32 result of row r; stored for the rows < nr."""
        t = self.tile
        if not self.unroll:
            with cgutils.for_range(b, t.nr) as loop:
                t.store(b, loop.index, fn(loop.index, loop.index))
            return
        for k in range(self.unroll):
            kc = ir.Constant(I64, k)
            v = fn(kc, k)
            with cgutils.if_likely(b, b.icmp_signed("<", kc, t.nr)):
                t.store(b, kc, v)


class _Slot:
    """An accumulator kept in memory on purpose: loads and stores through `_ld`/`_st` are volatile,
    so LLVM neither promotes it to a register nor drops the traffic."""

    def __init__(self, ptr):
        self.ptr = ptr


class _VolatileLoad(ir.instructions.LoadInstr):
    def descr(self, buf):
        [ptr] = self.operands
        buf.append(f"load volatile {self.type}, {ptr.type} {ptr.get_reference()}, align {self.align}\n")


class _VolatileStore(ir.instructions.StoreInstr):
    def descr(self, buf):
        val, ptr = self.operands
        buf.append(f"store volatile {val.type} {val.get_reference()}, {ptr.type} {ptr.get_reference()}, "
                   f"align {self.align}\n")


def _ld(b, p):
    if not isinstance(p, _Slot):
        return b.load(p)
    ins = _VolatileLoad(b.block, p.ptr, typ=p.ptr.type.pointee)
    ins.align = 1
    b._insert(ins)
    return ins


def _st(b, v, p):
    if not isinstance(p, _Slot):
        return b.store(v, p)
    ins = _VolatileStore(b.block, v, p.ptr)
    ins.align = 1
    b._insert(ins)
    return ins


def q4k_rows(b, w, nsb, tile, pf, rows, width=512, permuted=True, five=False, mins_in_memory=False):
    """q4k_row (vec_scales=True, pack=True) for a tile of activation rows: the quants, scales and
    mins of each super-block are unpacked once, then each row does its dpbusd/dpwssd and its two
    float accumulations exactly as q4k_row does.  mins_in_memory: the rows' 8-lane mins
    accumulators live in memory (volatile), leaving the registers to the rest."""
    bpb, qs_off = (176, 48) if five else (144, 16)
    nl = width // 32
    nb = width // 8
    zero = ir.Constant(V(I32, nl), None)
    acc = rows.acc(b, V(F32, nl))
    accm = rows.acc(b, V(F32, 8), memory=mins_in_memory)

    def init(r, k):
        b.store(ir.Constant(V(F32, nl), None), acc(b, k))
        _st(b, ir.Constant(V(F32, 8), None), accm(b, k))
    rows.each(b, init)
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
        if five:
            qh = load(b, p, ir.Constant(I64, 16), V(I8, 32))
            qhh = b.bitcast(shuffle(b, qh, qh, list(range(32)) * (width // 256)), V(I64, width // 64))
        raw16 = load(b, p, None, V(I8, 16))
        ddw = b.fpext(shuffle(b, b.bitcast(raw16, V(F16, 8)), ir.Constant(V(F16, 8), None), [0, 1]), V(F32, 2))
        sm = _q4k_scales_vec(b, raw16)
        mw = b.bitcast(shuffle(b, sm, z16, _pairs(range(8, 16), 16)), V(I16, 16))
        nvec = 128 // nb
        los, his, scs = [], [], []
        for j in range(nvec):
            q = load(b, p, ir.Constant(I64, qs_off + nb * j), V(I8, nb))
            lo = b.and_(q, m4)
            hi = b.and_(b.lshr(q, c4), m4)
            sub_lo = [4 * j, 4 * j + 2] if width == 512 else [2 * j]
            sub_hi = [4 * j + 1, 4 * j + 3] if width == 512 else [2 * j + 1]
            if five:
                m10 = const_vec(I8, nb, 0x10)
                lo = b.or_(lo, b.and_(b.bitcast(_shift_to_bit4(b, qhh, sub_lo), V(I8, nb)), m10))
                hi = b.or_(hi, b.and_(b.bitcast(_shift_to_bit4(b, qhh, sub_hi), V(I8, nb)), m10))
            idx = []
            for L in range(nl // 4):
                h = (L * 4) // 8
                idx += [sub_lo[h]] * 4 + [sub_hi[h]] * 4
            los.append(lo)
            his.append(hi)
            scs.append(shuffle(b, sm, z16, _pairs_w(idx, 16)))
        xo = b.mul(i, ir.Constant(I64, 256))

        def row(r, k):
            x, xd, xbs = tile.ptrs(b, r)
            xs = load(b, xd, b.mul(i, ir.Constant(I64, 4)), F32)
            dd = b.fmul(ddw, splat(b, xs, 2))
            d = b.extract_element(dd, ir.Constant(I32, 0))
            dmin = b.extract_element(dd, ir.Constant(I32, 1))
            bs = load(b, xbs, b.mul(i, ir.Constant(I64, 32)), V(I32, 8))
            msum = pmaddwd(b, mw, bs)
            pm = accm(b, k)
            _st(b, fma(b, splat(b, dmin, 8), b.sitofp(msum, V(F32, 8)), _ld(b, pm)), pm)
            sumi = zero
            for j in range(nvec):
                if width == 512 and permuted:
                    xlo = load(b, x, b.add(xo, ir.Constant(I64, 128 * j)), V(I8, 64))
                    xhi = load(b, x, b.add(xo, ir.Constant(I64, 128 * j + 64)), V(I8, 64))
                else:
                    assert width == 256
                    xlo = load(b, x, b.add(xo, ir.Constant(I64, 64 * j)), V(I8, 32))
                    xhi = load(b, x, b.add(xo, ir.Constant(I64, 64 * j + 32)), V(I8, 32))
                dlo = dpbusd(b, zero, los[j], xlo)
                dhi = dpbusd(b, zero, his[j], xhi)
                sumi = dpwssd(b, sumi, packssdw(b, dlo, dhi), scs[j])
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), b.load(pa)), pa)
        rows.each(b, row)

    def result(r, k):
        a = b.load(acc(b, k))
        if nl == 16:
            a = b.fadd(shuffle(b, a, a, range(8)), shuffle(b, a, a, range(8, 16)))
        return hsum_f32(b, b.fsub(a, _ld(b, accm(b, k))))
    rows.finish(b, result)


def _offset_init(b, u, off):
    """<n/4 x i32> 512 * off - 128 * (sum of each lane's 4 unsigned quants u): the start value of a
    dpbusd of (x + 128) with q = u - off that leaves the exact sum_j q_j x_j in the lane."""
    n = u.type.count // 4
    return dpbusd(b, const_vec(I32, n, 512 * off), u, const_vec(I8, 4 * n, -128))


def q6k_rows(b, w, nsb, tile, pf, rows):
    """q6k_row (ymm, pack=True) for a tile of activation rows stored as x + 128 (see above)."""
    nl, nb = 8, 32
    zero = ir.Constant(V(I32, nl), None)
    acc = rows.acc(b, V(F32, nl))
    rows.each(b, lambda r, k: b.store(ir.Constant(V(F32, nl), None), acc(b, k)))
    m4 = const_vec(I8, nb, 0x0F)
    m30 = const_vec(I8, nb, 0x30)
    c4 = const_vec(I8, nb, 4)
    c32 = const_vec(I8, nb, 32)
    z16w = ir.Constant(V(I16, 16), None)
    with cgutils.for_range(b, nsb) as loop:
        i = loop.index
        o = b.mul(i, ir.Constant(I64, 210))
        po = b.add(o, pf)
        for k in range(4):
            prefetch(b, w, b.add(po, ir.Constant(I64, 64 * k)))
        p = b.gep(w, [o])
        dw = load_f16(b, p, ir.Constant(I64, 208))
        sc16 = b.sext(load(b, p, ir.Constant(I64, 192), V(I8, 16)), V(I16, 16))
        qv, inits, scw = [], [], []
        for n in range(2):
            ql0 = load(b, p, ir.Constant(I64, 64 * n), V(I8, 32))
            ql1 = load(b, p, ir.Constant(I64, 64 * n + 32), V(I8, 32))
            qh = b.bitcast(load(b, p, ir.Constant(I64, 128 + 32 * n), V(I8, 32)), V(I64, 4))
            hs = [b.bitcast(v, V(I8, 32)) for v in
                  (b.shl(qh, const_vec(I64, 4, 4)), b.shl(qh, const_vec(I64, 4, 2)), qh,
                   b.lshr(qh, const_vec(I64, 4, 2)))]
            lows = (b.and_(ql0, m4), b.and_(ql1, m4), b.and_(b.lshr(ql0, c4), m4), b.and_(b.lshr(ql1, c4), m4))
            us = [b.or_(lo, b.and_(h, m30)) for lo, h in zip(lows, hs)]
            groups = [[8 * n + 2 * k + l // 4 for l in range(8)] for k in range(4)]
            for u in us:
                qv.append(b.sub(u, c32))
                inits.append(_offset_init(b, u, 32))
            for k in range(0, 4, 2):
                idx = []
                for L in range(nl // 4):
                    idx += [groups[k][4 * L]] * 4 + [groups[k + 1][4 * L]] * 4
                scw.append(shuffle(b, sc16, z16w, idx))
        xo = b.mul(i, ir.Constant(I64, 256))

        def row(r, k):
            x, xd, _ = tile.ptrs(b, r)
            d = b.fmul(dw, load(b, xd, b.mul(i, ir.Constant(I64, 4)), F32))
            sumi = zero
            for v in range(0, 8, 2):
                dots = [dpbusd(b, inits[v + h], load(b, x, b.add(xo, ir.Constant(I64, 32 * (v + h))), V(I8, nb)),
                               qv[v + h]) for h in range(2)]
                sumi = dpwssd(b, sumi, packssdw(b, dots[0], dots[1]), scw[v // 2])
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, nl), b.sitofp(sumi, V(F32, nl)), b.load(pa)), pa)
        rows.each(b, row)
    rows.finish(b, lambda r, k: hsum_f32(b, b.load(acc(b, k))))


_OFF32 = {"q8_0": 128, "q4_0": 8, "q5_0": 16}


def blk32_rows(b, w, nb, tile, pf, rows, fmt):
    """blk32_row (pair=True) for a tile of activation rows stored as x + 128: two blocks per zmm
    iteration, an odd last block through ymm, each row's float work as in blk32_row."""
    bpb, _ = _BLK32[fmt]
    off = _OFF32[fmt]
    acc = rows.acc(b, V(F32, 8))
    acc2 = rows.acc(b, V(F32, 16))
    rows.each(b, lambda r, k: b.store(ir.Constant(V(F32, 16), None), acc2(b, k)))

    def signed(u, n):
        # Q8_0: u = q ^ 0x80, so the stored bytes are q; the nibble formats subtract their offset
        return b.xor(u, const_vec(I8, n, 0x80)) if fmt == "q8_0" else b.sub(u, const_vec(I8, n, off))
    npair = b.sdiv(nb, ir.Constant(I64, 2))
    with cgutils.for_range(b, npair) as loop:
        i = b.mul(loop.index, ir.Constant(I64, 2))
        o = b.mul(i, ir.Constant(I64, bpb))
        prefetch(b, w, b.add(o, pf))
        if 2 * bpb > 64:
            prefetch(b, w, b.add(b.add(o, pf), ir.Constant(I64, 64)))
        p = b.gep(w, [o])
        dv = ir.Constant(V(I16, 2), ir.Undefined)
        for j in range(2):
            dv = b.insert_element(dv, load(b, p, ir.Constant(I64, bpb * j), I16), ir.Constant(I32, j))
        dvw = b.fpext(b.bitcast(dv, V(F16, 2)), V(F32, 2))
        u = _blk32_quants(b, p, fmt, 2)
        q = signed(u, 64)
        init = _offset_init(b, u, off)

        def row(r, k):
            x, xd, _ = tile.ptrs(b, r)
            dvr = b.fmul(dvw, load(b, xd, b.mul(i, ir.Constant(I64, 4)), V(F32, 2)))
            dvr = shuffle(b, dvr, dvr, [0] * 8 + [1] * 8)
            dot = dpbusd(b, init, load(b, x, b.mul(i, ir.Constant(I64, 32)), V(I8, 64)), q)
            pa = acc2(b, k)
            b.store(fma(b, dvr, b.sitofp(dot, V(F32, 16)), b.load(pa)), pa)
        rows.each(b, row)

    def fold(r, k):
        a2 = b.load(acc2(b, k))
        b.store(b.fadd(shuffle(b, a2, a2, range(8)), shuffle(b, a2, a2, range(8, 16))), acc(b, k))
    rows.each(b, fold)
    with cgutils.for_range(b, nb, start=b.mul(npair, ir.Constant(I64, 2))) as loop:
        i = loop.index
        o = b.mul(i, ir.Constant(I64, bpb))
        prefetch(b, w, b.add(o, pf))
        p = b.gep(w, [o])
        dw = load_f16(b, p, None)
        u = _blk32_quants(b, p, fmt, 1)
        q = signed(u, 32)
        init = _offset_init(b, u, off)

        def row1(r, k):
            x, xd, _ = tile.ptrs(b, r)
            d = b.fmul(dw, load(b, xd, b.mul(i, ir.Constant(I64, 4)), F32))
            dot = dpbusd(b, init, load(b, x, b.mul(i, ir.Constant(I64, 32)), V(I8, 32)), q)
            pa = acc(b, k)
            b.store(fma(b, splat(b, d, 8), b.sitofp(dot, V(F32, 8)), b.load(pa)), pa)
        rows.each(b, row1)
    rows.finish(b, lambda r, k: hsum_f32(b, b.load(acc(b, k))))


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


def _c_2d(t):
    return isinstance(t, types.Array) and t.ndim == 2 and t.layout == "C"


def _rows_intrinsic(body, *extra, rmax=8, unroll=0, guard=True, **options):
    """A numba intrinsic f(addr, off, n, x8, xd, xs, t0, nr, y, col, pf) -> None: `body` (a tile
    builder above) on the weight row at address addr + off (n blocks) and activation rows t0 .. t0+nr
    (nr <= rmax) of x8 [m, n_in] int8, xd [m, *] f32 and the side array xs [m, *]; result of row t0+i
    to y[t0 + i, col].  All arrays 2-D, C-contiguous; `addr` is the address of a weight matrix's
    bytes (an int64, so that one kernel call can cover several matrices: MultiMatrix)."""
    @intrinsic
    def rows_dot(typingctx, addr, off, n, x8, xd, xs, t0, nr, y, col, pf):
        if not (_c_2d(x8) and _c_2d(xd) and _c_2d(xs) and _c_2d(y)):
            return None
        sig = types.void(addr, off, n, x8, xd, xs, t0, nr, y, col, pf)

        def codegen(context, builder, signature, args):
            a = signature.args
            i64 = [context.cast(builder, args[k], a[k], types.int64) if k in (0, 1, 2, 6, 7, 9, 10) else None
                   for k in range(11)]
            w = builder.gep(builder.inttoptr(i64[0], I8.as_pointer()), [i64[1]])
            arrs = {}
            for k in (3, 4, 5, 8):
                ary = context.make_array(a[k])(context, builder, args[k])
                stride = cgutils.unpack_tuple(builder, ary.strides, 2)[0]
                arrs[k] = (builder.bitcast(ary.data, I8.as_pointer()), stride)
            tile = _Tile(builder, *arrs[3], *arrs[4], *arrs[5], *arrs[8], i64[6], i64[7], i64[9])
            rows = _Rows(builder, tile, rmax, unroll, guard)
            body(builder, w, i64[2], tile, i64[10], rows, *extra, **options)
            return context.get_dummy_value()

        return sig, codegen
    return rows_dot


_TILE = 8           # activation rows per pass over a weight row (multi-row kernels; see the module docstring)

q4k_rows_vnni = _rows_intrinsic(q4k_rows, rmax=_TILE, unroll=_TILE, width=512, permuted=True, mins_in_memory=True)
q5k_rows_vnni = _rows_intrinsic(q4k_rows, rmax=_TILE, unroll=_TILE, width=256, five=True, mins_in_memory=True)
q6k_rows_vnni = _rows_intrinsic(q6k_rows, rmax=_TILE, unroll=_TILE)
q8_0_rows_vnni = _rows_intrinsic(blk32_rows, "q8_0", rmax=_TILE, unroll=_TILE)
q4_0_rows_vnni = _rows_intrinsic(blk32_rows, "q4_0", rmax=_TILE, unroll=_TILE)
q5_0_rows_vnni = _rows_intrinsic(blk32_rows, "q5_0", rmax=_TILE, unroll=_TILE)


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


# --- the multi-row (matmul) kernels ------------------------------------------------------------------
# parts int64[P, 3]: (address of the weight bytes, rows, first output column) of each matrix of a
# MultiMatrix (P = 1 for a QuantMatrix); all parts share the format and the row length (rb bytes).
# y f32[m, n_out] = X @ W.T with X given as int8 rows xi [m, n_in] and their scales (quantize_activations).
# prange over chunks of _ROWS weight rows (of all parts); per chunk, tiles of _TILE activation rows;
# per weight row of the chunk, one multi-row call.  The chunk's weight rows (<= 16 x 3.3 KB) stay in
# L1/L2 while the tiles pass over them.

@njit(inline="always")
def _chunks(parts):
    """(part, first row) of every chunk of _ROWS weight rows, over all parts."""
    nch = 0
    for p in range(parts.shape[0]):
        nch += (parts[p, 1] + _ROWS - 1) // _ROWS
    cp = np.empty(nch, np.int64)
    cr = np.empty(nch, np.int64)
    c = 0
    for p in range(parts.shape[0]):
        for r0 in range(0, parts[p, 1], _ROWS):
            cp[c] = p
            cr[c] = r0
            c += 1
    return cp, cr


@njit(inline="always")
def _xor80(xi):
    """x + 128 as bytes (x ^ 0x80): the unsigned activations of the multi-row offset formats."""
    m, n = xi.shape
    xu = np.empty((m, n), np.uint8)
    xb = xi.view(np.uint8)
    for t in range(m):
        for j in range(n):
            xu[t, j] = xb[t, j] ^ np.uint8(0x80)
    return xu


@njit(parallel=True, cache=True)
def mm_q4_k(parts, rb, xi, xd, xbs, y):
    """y[m, n_out] = X @ W.T for Q4_K: q4k_rows_vnni (zmm) on activations in Q4_K's nibble order."""
    m, n = xi.shape
    x8 = np.empty((m, n), np.int8)
    for t in range(m):
        _interleave_64(xi[t], x8[t])
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + _ROWS)
        for t0 in range(0, m, _TILE):
            nr = min(_TILE, m - t0)
            for r in range(cr[c], r1):
                q4k_rows_vnni(addr, r * rb, rb // 144, x8, xd, xbs, t0, nr, y, col + r, _PREFETCH)


@njit(parallel=True, cache=True)
def mm_q5_k(parts, rb, xi, xd, xbs, y):
    """Q5_K: q5k_rows_vnni (ymm, natural activation order)."""
    m, n = xi.shape
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + _ROWS)
        for t0 in range(0, m, _TILE):
            nr = min(_TILE, m - t0)
            for r in range(cr[c], r1):
                q5k_rows_vnni(addr, r * rb, rb // 176, xi, xd, xbs, t0, nr, y, col + r, _PREFETCH)


@njit(parallel=True, cache=True)
def mm_q6_k(parts, rb, xi, xd, y):
    """Q6_K: q6k_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + _ROWS)
        for t0 in range(0, m, _TILE):
            nr = min(_TILE, m - t0)
            for r in range(cr[c], r1):
                q6k_rows_vnni(addr, r * rb, rb // 210, xu, xd, xd, t0, nr, y, col + r, _PREFETCH)


@njit(parallel=True, cache=True)
def mm_q8_0(parts, rb, xi, xd, y):
    """Q8_0: q8_0_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + _ROWS)
        for t0 in range(0, m, _TILE):
            nr = min(_TILE, m - t0)
            for r in range(cr[c], r1):
                q8_0_rows_vnni(addr, r * rb, rb // 34, xu, xd, xd, t0, nr, y, col + r, _PREFETCH)


@njit(parallel=True, cache=True)
def mm_q4_0(parts, rb, xi, xd, y):
    """Q4_0: q4_0_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + _ROWS)
        for t0 in range(0, m, _TILE):
            nr = min(_TILE, m - t0)
            for r in range(cr[c], r1):
                q4_0_rows_vnni(addr, r * rb, rb // 18, xu, xd, xd, t0, nr, y, col + r, _PREFETCH)


@njit(parallel=True, cache=True)
def mm_q5_0(parts, rb, xi, xd, y):
    """Q5_0: q5_0_rows_vnni on x + 128."""
    m, n = xi.shape
    xu = _xor80(xi)
    cp, cr = _chunks(parts)
    for c in prange(cp.size):
        p = cp[c]
        addr, col = parts[p, 0], parts[p, 2]
        r1 = min(parts[p, 1], cr[c] + _ROWS)
        for t0 in range(0, m, _TILE):
            nr = min(_TILE, m - t0)
            for r in range(cr[c], r1):
                q5_0_rows_vnni(addr, r * rb, rb // 22, xu, xd, xd, t0, nr, y, col + r, _PREFETCH)


# The six mm_* kernels repeat one loop skeleton on purpose.  A factory that closes over the row
# intrinsic would write it once, but numba's on-disk cache does not reuse closure-made kernels across
# processes (checked with numba 0.68: each new process compiles them again and appends another
# cache entry), and compile time is paid by every reader at every start.
# format -> (multi-row kernel, whether it takes bsum32)
MM_KERNELS = {T.Q4_K: (mm_q4_k, True), T.Q5_K: (mm_q5_k, True), T.Q6_K: (mm_q6_k, False),
              T.Q8_0: (mm_q8_0, False), T.Q4_0: (mm_q4_0, False), T.Q5_0: (mm_q5_0, False)}
