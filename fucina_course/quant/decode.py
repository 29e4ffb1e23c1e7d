"""Decode: weight matrix (still in its block format) x one activation vector.

Decode reads every weight once per token, so it is bound by memory bandwidth; the kernels' job is
to stream the blocks as fast as the memory system delivers them, doing ggml's arithmetic on the way.

Numerics (what llama.cpp computes): x is first quantized to the weight's `vec_dot_type`
(activations.py).  Then, per block b of row r,

    Q8_0 / Q4_0 / Q5_0 :  y_r += (d_w[b] * d_x[b]) * sum_j q_w[j] q_x[j]
    Q4_1 / Q5_1        :  y_r += (d_w[b] * d_x[b]) * sum_j q_w[j] q_x[j]  +  m_w[b] * s_x[b]
    Q4_K / Q5_K        :  y_r += (d_w * d_x) * sum_sub sc_sub * sum_j q_w q_x  -  (dmin_w * d_x) * sum_sub m_sub * bsum_x[sub]
    Q6_K               :  y_r += (d_w * d_x) * sum_sub sc_sub * sum_j (q_w - 32) q_x
    F16 / BF16 / F32   :  y_r += w_j * x_j   with x rounded to f16 / bf16 / kept f32

Every product q_w * q_x is an integer below 2^24, so it is exact in float32; the only differences to
llama.cpp are the order of the float additions (tests: rtol 1e-5 against a numpy transcription of
the formulas above, reference.py, and against llama.cpp's own `ggml_vec_dot_*` when installed).

Two kernel families:
* integer kernels (_simd.py: `mv_q4_k`, ... for Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0), used when
  `VNNI` is true (the default where numba's target CPU has AVX512-VNNI, _simd.HAVE_VNNI): `prange`
  over chunks of 16 output rows and one call per row of a row-dot intrinsic that multiplies the
  quant bytes with the int8 activations (`vpdpbusd`) and converts to float once per (super-)block,
  as ggml does.  Per call, before the parallel loop, a small activation-side array is made: Q4_K's
  activations permuted to its zmm nibble order, or the per-lane offsets of the formats whose quants
  are signed.  _simd.py explains the arithmetic and lists the variants measured.
* float kernels (all formats; the only ones for Q4_1, Q5_1, F16, BF16, F32, and the fallback),
  described below.

Several activation rows at once (prefill, batch decode of N streams) go through `matmul`
(prefill.py), whose multi-row integer kernels give, row for row, exactly the results of these.

Float kernel shape: `prange` over chunks of `_ROWS` output rows; per row one 32-lane float32
accumulator `acc`, to which every block adds `scale * (float(q_w) * q_x)` lane-wise; the 32 lanes are
summed once per row.  The lane loops are plain unit-stride loops over bytes of the block, which
LLVM turns into `vpmovzxbd/vcvtdq2ps/vfmadd231ps` on ymm registers.  The activation vector (q_x as
float32, 4 KB per 1024 inputs) stays in L1.  Each block also issues a software prefetch
`_PREFETCH` bytes ahead in the weight stream.  The number of threads is numba's
(`numba.set_num_threads`, set by the caller).

Small matrices: a 1024 -> 128 matrix (a K/V projection) costs 7.5-9 us per call with the integer
kernels (12-16 us with the float ones), of which ~2.5 us is the activation quantization (called
from Python: 1 us of work), ~1-2 us other Python, ~2 us starting the parallel region and the rest
streaming 74-139 KB.  Callers that multiply one vector by several matrices of the same
`vec_dot_type` (Q, K, V) can quantize it once with `quantize_activations` and call
`matvec_quantized` for each.

Measured (Xeon Sapphire Rapids VM, 2 cores, AVX-512/VNNI, numba 0.68.1 / llvmlite 0.50, 2 threads,
shared machine, best of repeats).  "Sweep" = every matrix of a Qwen3-0.6B-shaped model once (197
matrices, 633 MB as Q8_0): one decoded token's weight traffic, mostly from DRAM.  llama.cpp decodes
that Q8_0 model at ~11.5 GB/s of weights (whole forward pass).  In-cache = one 3072x1024 matrix
called back to back (3.3 MB, L2/L3 resident): the kernel's compute speed.

| Q8_0 variant | sweep | in cache |
|---|---|---|
| 32-lane acc, f16 scale converted in-kernel, no prefetch | 7.1-7.5 GB/s | 27 GB/s |
| same + software prefetch 1 KB ahead | 14.9 GB/s | 28 GB/s |
| same + prefetch 2 KB ahead (**chosen**) | 14.4-17.2 GB/s | 22-28 GB/s |
| same + prefetch 4 KB ahead | 16.0 GB/s | 28 GB/s |
| float32 side array of block scales (+ prefetch) | 16.0-16.4 GB/s vs 15.2-15.4 for the chosen one, same run | 28 GB/s |
| two rows per iteration sharing the x loads | - | 20 GB/s |
| flat 1-D indexing `w[r * row_bytes + ...]` | - | 2.2 GB/s (151936x1024) |

The side array was rejected although it is ~5% faster: +12% memory, and building it at load reads
every block's scale, i.e. faults in every page of the memory-mapped file before the first token.
The flat indexing fails because numba wraps negative indices: with an index LLVM cannot prove
non-negative, every load becomes a gather.  The 2-D `w[r, o + j]` form with `j` from `range` is
provably non-negative and vectorizes.

Per-format lessons (same machine; bench/bench_matvec.py prints the full table):
* numba types every integer expression as int64.  Unpacking nibbles with `q & 0xF` therefore ran
  on 64-bit lanes (`vpmovzxbq`/`vcvtqq2ps`, 8 per zmm): Q4_K in cache 6.7 GB/s.  Casting the
  unpacked value back to `np.uint8` before `np.float32(...)` lets LLVM work on bytes and 32-bit
  lanes: 11-12 GB/s in cache, 9.1 GB/s sweep.
* Q5_0/Q5_1 take the 5th bit of element j from bit j of a 32-bit `qh`.  `(qh >> j) & 1` (a per-lane
  variable shift on int64 lanes): 6.1 GB/s sweep.  A [256, 8] lookup table, or splitting the loop in
  8-lane groups per qh byte: LLVM gave up vectorizing, 1.8-2.3 GB/s.  `qh & _BIT[j]` with a constant
  per-lane mask and a select (**chosen**): 9.2-9.8 GB/s.  Q5_K: the same mask trick took it from
  5.3 to 7.0 GB/s.
* 512-bit vectors (`NUMBA_CPU_FEATURES=...,-prefer-256-bit`; LLVM prefers ymm on this CPU): Q4_K
  sweep 9.0 -> 9.9, Q8_0 17.2 -> 17.3 GB/s, within noise; not adopted (a process-wide setting).
* The float 4-/5-/6-bit kernels are compute-bound (their in-cache speed is close to their sweep
  speed): they widen every quant to float32, ~3.5 vector instructions per 8 weights.  ggml
  multiplies bytes directly (`vpmaddubsw` / VNNI `vpdpbusd`, 32-64 multiply-adds per instruction),
  which LLVM does not derive from numba's scalar loops -- hence the integer kernels of _simd.py,
  which emit vpdpbusd themselves.  With them every format's in-cache speed is 2-4x its sweep speed:
  the sweep is bound by memory and per-call overhead, not by arithmetic.

Integer (VNNI) vs float kernels through `matvec` (bench/bench_matvec.py --no-prefill --kernels both,
two runs, the two kernel sets alternating in each; load average 0.5-1.0, so the float numbers here
are ~10% below the ones measured earlier on a quieter machine, in __init__.py):

| format | sweep float -> VNNI (GB/s) | ms per token | 1024->3072 in cache | 1024->151936 | 1024->128 call |
|---|---|---|---|---|---|
| Q4_K | 8.4 -> 14.4-14.5 | 40 -> 23 | 10.1-10.4 -> 37-38 | 10.7 -> 30-32 | 13.7 -> 7.6 us |
| Q6_K | 9.3-9.4 -> 14.4-15.5 | 52 -> 32-34 | 10.3 -> 38-40 | 11.3-11.8 -> 27 | 15.0 -> 7.5 us |
| Q5_0 | 8.0-8.1 -> 13.7-14.0 | 51 -> 29-30 | 9.4-9.8 -> 26-30 | 9.7-9.9 -> 24-26 | 15.6 -> 8.4 us |
| Q4_0 | 8.1-9.0 -> 12.3-13.0 | 37-42 -> 26-27 | 11.0-11.2 -> 29-30 | 10.9-11.4 -> 23-28 | 13.5 -> 8.1 us |
| Q5_K | 6.3 -> 11.9-12.8 | 65 -> 32-35 | 7.1 -> 35-38 | 7.2-7.3 -> 20-21 | 18.6 -> 7.1 us |
| Q8_0 | 13.2-13.8 -> 15.5-17.2 | 46-48 -> 37-41 | 20.7-21.0 -> 38-42 | 20-21 -> 27-29 | 12.3 -> 8.1 us |

Run alone (no alternation; `python bench/bench_matvec.py --no-prefill`, five runs at load average
0.5-1.6) the VNNI sweep gave 13.0-16.7 GB/s for Q4_K (20-26 ms per token; 15.4 / 14.2 / 13.0 /
16.7 / 15.8), 14.7-15.6 for Q6_K and 14.4-15.9 for Q5_0: the sweep varies with what else the two
cores run.  The 1024->151936 column is one 87-280 MB matrix called back to back (partly
L3-resident on this VM).  Whole model (`fucina bench MODEL --pp 16 --tg 64`, FUCINA_NO_VNNI=1 vs
default, same minute): Qwen3-0.6B-geometry Q4_K decode 19.3 -> 31.3 tok/s (llama.cpp: ~32);
Qwen2.5-Coder-0.5B Q4_K_M (mostly Q5_0 and Q8_0) 18.7 -> 27.0 tok/s.
"""

from __future__ import annotations

import os

# numba's OpenMP threads (libgomp) spin ~300,000 times after each parallel region before sleeping,
# i.e. for milliseconds.  Any OpenBLAS call in that window (attention, the prefill GEMMs) then
# fights them for the two cores: a 1024x1024 matvec followed by a 256x1024x1024 sgemm took 7.6 ms
# instead of 2.1.  With 10,000 spins: 2.4 ms, and the decode sweep is unchanged (15.8 vs 16.3 GB/s,
# noise); with 1,000 the decode kernels lose 25% (slow wake-ups).  libgomp reads the variable when
# numba first starts its thread pool, so this only applies if no parallel kernel ran before this
# import; an explicit GOMP_SPINCOUNT / OMP_WAIT_POLICY from the user wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from numba import njit, prange  # noqa: E402

from . import _simd  # noqa: E402
from ._intrinsics import f16_to_f32, prefetch, u32_as_f32  # noqa: E402
from .activations import quantize_activations  # noqa: E402
from .matrix import MultiMatrix  # noqa: E402

_ROWS = 16          # output rows per parallel chunk
_PREFETCH = 2048    # bytes ahead in the weight stream
_FM = {"contract", "reassoc", "nsz"}  # FMA + re-association of the final 32-lane sum; keeps inf/nan
_BIT = (1 << np.arange(32, dtype=np.uint64)).astype(np.uint32)  # lane j tests bit j of qh: no per-lane shifts

# Integer (VNNI) kernels where the CPU numba compiles for has them; assign False to use the float
# kernels (the benchmarks and tests compare both).  Assigning True on a CPU without AVX512-VNNI
# changes nothing: the dispatcher also checks _simd.HAVE_VNNI.
VNNI = _simd.HAVE_VNNI


@njit(inline="always")
def _f16(w, r, o):
    return f16_to_f32(np.uint16(w[r, o]) | (np.uint16(w[r, o + 1]) << np.uint16(8)))


@njit(inline="always")
def _lane_sum(acc):
    t = np.float32(0.0)
    for j in range(32):
        t += acc[j]
    return t


@njit(inline="always")
def _zero(acc):
    for j in range(32):
        acc[j] = np.float32(0.0)


@njit(inline="always")
def _scale_min_k4(w, r, o, j):
    if j < 4:
        sc = np.int32(w[r, o + j] & 63)
        m = np.int32(w[r, o + j + 4] & 63)
    else:
        sc = np.int32((w[r, o + j + 4] & 0xF) | ((w[r, o + j - 4] >> 6) << 4))
        m = np.int32((w[r, o + j + 4] >> 4) | ((w[r, o + j] >> 6) << 4))
    return sc, m


# --- Q8_0-activation formats -------------------------------------------------------------------------

@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q8_0(w, wf, xq, xd, y):
    """w uint8[n_out, nb*34] (d f16 | qs int8[32]); xq f32[nb*32]; xd f32[nb] -> y f32[n_out]."""
    n_out, rb = w.shape
    nb = rb // 34
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = r * rb + _PREFETCH
            for b in range(nb):
                o = b * 34
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                for j in range(32):
                    acc[j] += s * (np.float32(np.int8(w[r, o + 2 + j])) * xq[b * 32 + j])
            y[r] = _lane_sum(acc)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q4_0(w, wf, xq, xd, y):
    """w uint8[n_out, nb*18] (d f16 | qs[16]: low nibbles = elements 0..15, high = 16..31)."""
    n_out, rb = w.shape
    nb = rb // 18
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = r * rb + _PREFETCH
            for b in range(nb):
                o = b * 18
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                for j in range(16):
                    q = w[r, o + 2 + j]
                    lo = np.float32(np.uint8(q & 0xF)) - np.float32(8.0)
                    hi = np.float32(np.uint8(q >> 4)) - np.float32(8.0)
                    acc[j] += s * (lo * xq[b * 32 + j])
                    acc[16 + j] += s * (hi * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc)


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q5_0(w, wf, xq, xd, y):
    """w uint8[n_out, nb*22] (d f16 | qh u32: 5th bits | qs[16])."""
    n_out, rb = w.shape
    nb = rb // 22
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = r * rb + _PREFETCH
            for b in range(nb):
                o = b * 22
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                qh = (np.uint32(w[r, o + 2]) | (np.uint32(w[r, o + 3]) << 8)
                      | (np.uint32(w[r, o + 4]) << 16) | (np.uint32(w[r, o + 5]) << 24))
                for j in range(16):
                    q = w[r, o + 6 + j]
                    h0 = np.uint8(16) if (qh & _BIT[j]) != 0 else np.uint8(0)
                    h1 = np.uint8(16) if (qh & _BIT[j + 16]) != 0 else np.uint8(0)
                    lo = np.float32(np.uint8((q & 0xF) | h0)) - np.float32(16.0)
                    hi = np.float32(np.uint8((q >> 4) | h1)) - np.float32(16.0)
                    acc[j] += s * (lo * xq[b * 32 + j])
                    acc[16 + j] += s * (hi * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc)


# --- Q8_1-activation formats (weights with a per-block minimum) ------------------------------------

@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q4_1(w, wf, xq, xd, xs, y):
    """w uint8[n_out, nb*20] (d f16 | m f16 | qs[16]); xs f32[nb] = f16(d_x * sum q_x)."""
    n_out, rb = w.shape
    nb = rb // 20
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + _PREFETCH
            for b in range(nb):
                o = b * 20
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                mins += _f16(w, r, o + 2) * xs[b]
                for j in range(16):
                    q = w[r, o + 4 + j]
                    acc[j] += s * (np.float32(np.uint8(q & 0xF)) * xq[b * 32 + j])
                    acc[16 + j] += s * (np.float32(np.uint8(q >> 4)) * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc) + mins


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q5_1(w, wf, xq, xd, xs, y):
    """w uint8[n_out, nb*24] (d f16 | m f16 | qh u32 | qs[16])."""
    n_out, rb = w.shape
    nb = rb // 24
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + _PREFETCH
            for b in range(nb):
                o = b * 24
                prefetch(wf, pf + o)
                s = _f16(w, r, o) * xd[b]
                mins += _f16(w, r, o + 2) * xs[b]
                qh = (np.uint32(w[r, o + 4]) | (np.uint32(w[r, o + 5]) << 8)
                      | (np.uint32(w[r, o + 6]) << 16) | (np.uint32(w[r, o + 7]) << 24))
                for j in range(16):
                    q = w[r, o + 8 + j]
                    h0 = np.uint8(16) if (qh & _BIT[j]) != 0 else np.uint8(0)
                    h1 = np.uint8(16) if (qh & _BIT[j + 16]) != 0 else np.uint8(0)
                    lo = np.float32(np.uint8((q & 0xF) | h0))
                    hi = np.float32(np.uint8((q >> 4) | h1))
                    acc[j] += s * (lo * xq[b * 32 + j])
                    acc[16 + j] += s * (hi * xq[b * 32 + 16 + j])
            y[r] = _lane_sum(acc) + mins


# --- Q8_K-activation formats (256-element super-blocks) --------------------------------------------

@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q4_k(w, wf, xq, xd, xbs, y):
    """w uint8[n_out, nsb*144] (d | dmin | scales[12] | qs[128]); xd f32[nsb]; xbs int32[nsb*8]."""
    n_out, rb = w.shape
    nsb = rb // 144
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + _PREFETCH
            for b in range(nsb):
                o = b * 144
                prefetch(wf, pf + o)
                prefetch(wf, pf + o + 64)
                prefetch(wf, pf + o + 128)
                d = _f16(w, r, o) * xd[b]
                dmin = _f16(w, r, o + 2) * xd[b]
                isum = 0
                for k in range(4):  # 64 elements: low nibbles = sub-block 2k, high nibbles = 2k+1
                    sc0, m0 = _scale_min_k4(w, r, o + 4, 2 * k)
                    sc1, m1 = _scale_min_k4(w, r, o + 4, 2 * k + 1)
                    isum += m0 * xbs[b * 8 + 2 * k] + m1 * xbs[b * 8 + 2 * k + 1]
                    s0 = d * np.float32(sc0)
                    s1 = d * np.float32(sc1)
                    e = b * 256 + k * 64
                    for l in range(32):
                        q = w[r, o + 16 + k * 32 + l]
                        lo = np.float32(np.uint8(q & 0xF))
                        hi = np.float32(np.uint8(q >> 4))
                        acc[l] += s0 * (lo * xq[e + l]) + s1 * (hi * xq[e + 32 + l])
                mins += dmin * np.float32(isum)
            y[r] = _lane_sum(acc) - mins


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q5_k(w, wf, xq, xd, xbs, y):
    """w uint8[n_out, nsb*176] (d | dmin | scales[12] | qh[32] | qs[128])."""
    n_out, rb = w.shape
    nsb = rb // 176
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            mins = np.float32(0.0)
            pf = r * rb + _PREFETCH
            for b in range(nsb):
                o = b * 176
                prefetch(wf, pf + o)
                prefetch(wf, pf + o + 64)
                prefetch(wf, pf + o + 128)
                d = _f16(w, r, o) * xd[b]
                dmin = _f16(w, r, o + 2) * xd[b]
                isum = 0
                for k in range(4):
                    sc0, m0 = _scale_min_k4(w, r, o + 4, 2 * k)
                    sc1, m1 = _scale_min_k4(w, r, o + 4, 2 * k + 1)
                    isum += m0 * xbs[b * 8 + 2 * k] + m1 * xbs[b * 8 + 2 * k + 1]
                    s0 = d * np.float32(sc0)
                    s1 = d * np.float32(sc1)
                    e = b * 256 + k * 64
                    m_lo = _BIT[2 * k]
                    m_hi = _BIT[2 * k + 1]
                    for l in range(32):
                        q = w[r, o + 48 + k * 32 + l]
                        h = w[r, o + 16 + l]
                        h0 = np.uint8(16) if (h & m_lo) != 0 else np.uint8(0)
                        h1 = np.uint8(16) if (h & m_hi) != 0 else np.uint8(0)
                        lo = np.float32(np.uint8((q & 0xF) | h0))
                        hi = np.float32(np.uint8((q >> 4) | h1))
                        acc[l] += s0 * (lo * xq[e + l]) + s1 * (hi * xq[e + 32 + l])
                mins += dmin * np.float32(isum)
            y[r] = _lane_sum(acc) - mins


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_q6_k(w, wf, xq, xd, y):
    """w uint8[n_out, nsb*210] (ql[128] | qh[64] | scales int8[16] | d f16)."""
    n_out, rb = w.shape
    nsb = rb // 210
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = r * rb + _PREFETCH
            for b in range(nsb):
                o = b * 210
                prefetch(wf, pf + o)
                prefetch(wf, pf + o + 64)
                prefetch(wf, pf + o + 128)
                prefetch(wf, pf + o + 192)
                d = _f16(w, r, o + 208) * xd[b]
                for n in range(2):  # 128-element halves
                    ql = o + 64 * n
                    qh = o + 128 + 32 * n
                    sc = o + 192 + 8 * n
                    e = b * 256 + 128 * n
                    for h in range(2):  # lanes 0..15 and 16..31 have their own four scales
                        s1 = d * np.float32(np.int8(w[r, sc + h]))
                        s2 = d * np.float32(np.int8(w[r, sc + h + 2]))
                        s3 = d * np.float32(np.int8(w[r, sc + h + 4]))
                        s4 = d * np.float32(np.int8(w[r, sc + h + 6]))
                        for l in range(16 * h, 16 * h + 16):
                            a = w[r, ql + l]
                            a2 = w[r, ql + 32 + l]
                            hh = w[r, qh + l]
                            q1 = np.float32(np.uint8((a & 0xF) | ((hh & 3) << 4))) - np.float32(32.0)
                            q2 = np.float32(np.uint8((a2 & 0xF) | (((hh >> 2) & 3) << 4))) - np.float32(32.0)
                            q3 = np.float32(np.uint8((a >> 4) | (((hh >> 4) & 3) << 4))) - np.float32(32.0)
                            q4 = np.float32(np.uint8((a2 >> 4) | (((hh >> 6) & 3) << 4))) - np.float32(32.0)
                            acc[l] += (s1 * (q1 * xq[e + l]) + s2 * (q2 * xq[e + 32 + l])
                                       + s3 * (q3 * xq[e + 64 + l]) + s4 * (q4 * xq[e + 96 + l]))
            y[r] = _lane_sum(acc)


# --- float weights -----------------------------------------------------------------------------------

@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_f16(w16, wf, x, y):
    """w16 uint16[n_out, n_in] (IEEE halves); x f32[n_in] already rounded to f16 like ggml does."""
    n_out, n_in = w16.shape
    nfull = n_in // 32
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = 2 * r * n_in + _PREFETCH
            for b in range(nfull):
                prefetch(wf, pf + 64 * b)
                for j in range(32):
                    acc[j] += f16_to_f32(w16[r, b * 32 + j]) * x[b * 32 + j]
            t = _lane_sum(acc)
            for j in range(nfull * 32, n_in):
                t += f16_to_f32(w16[r, j]) * x[j]
            y[r] = t


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_bf16(w16, wf, x, y):
    """w16 uint16[n_out, n_in] (bfloat16 bits); x f32[n_in] already rounded to bf16."""
    n_out, n_in = w16.shape
    nfull = n_in // 32
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = 2 * r * n_in + _PREFETCH
            for b in range(nfull):
                prefetch(wf, pf + 64 * b)
                for j in range(32):
                    acc[j] += u32_as_f32(np.uint32(w16[r, b * 32 + j]) << np.uint32(16)) * x[b * 32 + j]
            t = _lane_sum(acc)
            for j in range(nfull * 32, n_in):
                t += u32_as_f32(np.uint32(w16[r, j]) << np.uint32(16)) * x[j]
            y[r] = t


@njit(parallel=True, fastmath=_FM, cache=True)
def _mv_f32(w32, wf, x, y):
    """w32 f32[n_out, n_in]."""
    n_out, n_in = w32.shape
    nfull = n_in // 32
    for c in prange((n_out + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for r in range(c * _ROWS, min(n_out, c * _ROWS + _ROWS)):
            _zero(acc)
            pf = 4 * r * n_in + _PREFETCH
            for b in range(nfull):
                prefetch(wf, pf + 128 * b)
                prefetch(wf, pf + 128 * b + 64)
                for j in range(32):
                    acc[j] += w32[r, b * 32 + j] * x[b * 32 + j]
            t = _lane_sum(acc)
            for j in range(nfull * 32, n_in):
                t += w32[r, j] * x[j]
            y[r] = t


# --- dispatch ------------------------------------------------------------------------------------------

_VNNI_FORMATS = _simd.KERNELS        # format -> (integer kernel, takes bsum32)
_VNNI_KERNELS = {int(t): k for t, k in _VNNI_FORMATS.items()}


def matvec_quantized(w, qa, out: np.ndarray, row: int = 0) -> np.ndarray:
    """out f32[n_out] = W @ x for x = row `row` of activations already converted by `quantize_activations`.

    Lets a caller quantize one activation vector once and reuse it for several matrices with the
    same `vec_dot_type` (e.g. the Q, K and V projections of one layer).  Shapes are not checked.
    """
    t = w.ggml_type
    if qa.kind is not w.vec_dot_type and qa.kind != w.vec_dot_type:  # `is`: Enum == is a Python call
        raise ValueError(f"{w.name!r} ({t.name}) needs activations as {w.vec_dot_type.name}, got {qa.kind.name}")
    if isinstance(w, MultiMatrix):
        for part, (a, b) in zip(w.parts, w.bounds):
            matvec_quantized(part, qa, out[a:b], row)
        return out
    if VNNI and _simd.HAVE_VNNI:
        k = _VNNI_KERNELS.get(t._value_)  # keyed by int: an Enum's __hash__ is a Python call
        if k is not None:
            kernel, with_bsum = k
            if with_bsum:
                kernel(w.raw, w.flat, qa.qi[row], qa.d[row], qa.bsum32[row], out)
            else:
                kernel(w.raw, w.flat, qa.qi[row], qa.d[row], out)
            return out
    xq = qa.q[row]
    if t == T.Q8_0:
        _mv_q8_0(w.raw, w.flat, xq, qa.d[row], out)
    elif t == T.Q4_K:
        _mv_q4_k(w.raw, w.flat, xq, qa.d[row], qa.bsum32[row], out)
    elif t == T.Q6_K:
        _mv_q6_k(w.raw, w.flat, xq, qa.d[row], out)
    elif t == T.Q5_0:
        _mv_q5_0(w.raw, w.flat, xq, qa.d[row], out)
    elif t == T.Q4_0:
        _mv_q4_0(w.raw, w.flat, xq, qa.d[row], out)
    elif t == T.Q5_K:
        _mv_q5_k(w.raw, w.flat, xq, qa.d[row], qa.bsum32[row], out)
    elif t == T.Q4_1:
        _mv_q4_1(w.raw, w.flat, xq, qa.d[row], qa.s[row], out)
    elif t == T.Q5_1:
        _mv_q5_1(w.raw, w.flat, xq, qa.d[row], qa.s[row], out)
    elif t == T.F16:
        _mv_f16(w.wv, w.flat, xq, out)
    elif t == T.BF16:
        _mv_bf16(w.wv, w.flat, xq, out)
    elif t == T.F32:
        _mv_f32(w.wv, w.flat, xq, out)
    else:  # QuantMatrix's constructor already refused it
        raise AssertionError(t)
    return out


def matvec(w, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y f32[n_out] = W @ x for one activation vector x f32[n_in] (decode), numerics as llama.cpp.

    `out`, if given, must be a C-contiguous float32 array of n_out elements; it is returned.
    """
    x = np.asarray(x, dtype=np.float32)
    if x.shape != (w.n_in,):
        raise ValueError(f"{w.name!r}: x has shape {x.shape}, expected ({w.n_in},)")
    if out is None:
        out = np.empty(w.n_out, np.float32)  # [n_out]
    elif out.shape != (w.n_out,) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"{w.name!r}: out must be C-contiguous float32 of shape ({w.n_out},)")
    qa = quantize_activations(x, w.vec_dot_type)
    return matvec_quantized(w, qa, out)
