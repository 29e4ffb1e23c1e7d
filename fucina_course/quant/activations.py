"""Quantize the activations once per matrix product, the way llama.cpp does on x86.

Before ggml multiplies a weight matrix of format W by activations, it converts the
activation rows to W's `vec_dot_type` (formats.py) and then only does integer dot
products per block.  Matching llama.cpp's numbers therefore starts here, and the
rounding rules matter:

| vec_dot_type (for) | block | scale | x -> q | extra |
|---|---|---|---|---|
| Q8_0 (Q8_0 Q4_0 Q5_0) | 32 | d = amax/127, f16 | rint(x * 127/amax) | |
| Q8_1 (Q4_1 Q5_1) | 32 | as Q8_0 | as Q8_0 | s = f16(d * sum q) |
| Q8_K (Q4_K Q5_K Q6_K) | 256 | d = 1/iscale, f32 | min(127, rint(iscale x)) | sums |
| F16 / BF16 | - | - | nearest even half / bf16 | |

(rint: round half to even; Q8_1's s uses the unrounded d.)

Q8_K: `iscale = -127/max`, where max is the signed value of largest magnitude; ggml
keeps the sums of q per 16 (bsums), this engine per 32 (`bsum32`), the granularity of
the K-quant sub-blocks that read them.

The Q8_0/Q8_1 rows follow ggml's **x86 AVX path** (`ggml-cpu/arch/x86/quants.c`:
`127/amax` and `_mm256_round_ps(_MM_ROUND_NEAREST)`), which is what llama.cpp runs
here.  It differs from ggml's portable reference (`quantize_row_q8_0_ref`: `1/d` and
`roundf`, half away from zero) -- and from gguf-py, which copies the reference -- in a
handful of quants per million (ties, and one-ulp differences between `127/amax` and
`1/(amax/127)`).  `reference=True` selects the portable rules; tests check that variant
bit-exact against `gguf.quants.quantize` and the default bit-exact against llama.cpp's
own `quantize_row_q8_0`.

Outputs are int8 arrays (`qi`, for the integer kernels) and, on demand, the same small
integers as float32 (`q`, for the float kernels: a product of two is exact in float32).
Scales come back as float32 already rounded through f16 where ggml stores an f16.

`fake_quant(X, vec_dot_type)` returns `q * d` as float32 -- exact for Q8_0/Q8_1 (8-bit
times 11-bit) and within one rounding for Q8_K -- which lets matmul's "blas" path use
float32 BLAS and still compute the numbers the integer kernels compute.
"""

from __future__ import annotations

import os

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, types

from ._intrinsics import (block32_amax_bits, block32_quantize, f16_to_f32,
                          f32_to_f16_bits, u32_as_f32)

_F0 = np.float32(0.0)
_F127 = np.float32(127.0)
_FM127 = np.float32(-127.0)
_F1 = np.float32(1.0)
_Q8_0, _Q8_1, _Q8_K = T.Q8_0, T.Q8_1, T.Q8_K


@njit(inline="always")
def _round_f16(v):
    return f16_to_f32(f32_to_f16_bits(v))


_NON_FINITE_BITS = np.uint32(0x7F800000)   # |x| bits at or above: infinity or NaN


@njit(inline="always")
def _row_amax(xr, amax):
    """amax[b] = the largest |x| of block b of the row xr (32 values a block), as bits
    with the sign cleared (`block32_amax_bits`).  Returns False if the row holds a
    NaN or an infinity: no scale fits them (the callers raise
    `NonFiniteActivations`)."""
    top = np.uint32(0)
    for b in range(amax.size):
        bits = block32_amax_bits(xr, b * 32)
        amax[b] = u32_as_f32(bits)
        top = max(top, bits)
    return top < _NON_FINITE_BITS


@njit(cache=True)
def _quant_q8_0_rows(x, qi, d16, s16, with_sum):
    """x f32[m, n] -> qi int8[m, n] (-127..127), d16 f32[m, n/32]; s16 f32[m, n/32]
    if with_sum.  ggml's x86 AVX path: id = 127/amax, round half to even.  Returns 0,
    or 1 if x holds a NaN or an infinity (no scale fits them; the callers raise
    `NonFiniteActivations`; what was written is then meaningless).  Per row, the
    blocks' amax first (into d16), then the quants: one vector operation a block each
    (_intrinsics.py)."""
    m, n = x.shape
    for t in range(m):
        xr, qr, dr = x[t], qi[t], d16[t]
        if not _row_amax(xr, dr):
            return 1
        for b in range(n // 32):
            amax = dr[b]
            d = amax / _F127
            idd = _F127 / amax if amax != _F0 else _F0
            total = block32_quantize(xr, b * 32, idd, qr)
            dr[b] = _round_f16(d)
            if with_sum:
                s16[t, b] = _round_f16(d * np.float32(total))
    return 0


@njit(cache=True)
def _quant_q8_0_rows_reference(x, qi, d16, s16, with_sum):
    """_quant_q8_0_rows with ggml's portable rules (quantize_row_q8_0_ref, gguf-py):
    id = 1/d, round half away from zero."""
    m, n = x.shape
    for t in range(m):
        for b in range(n // 32):
            amax = u32_as_f32(block32_amax_bits(x[t], b * 32))
            d = amax / _F127
            idd = _F1 / d if d != _F0 else _F0
            total = np.int32(0)
            for j in range(32):
                v = x[t, b * 32 + j] * idd
                # roundf: half away from zero (floor(2*frac) is exact, unlike +0.5)
                a = abs(v)
                r = np.floor(a)
                r = r + np.floor(np.float32(2.0) * (a - r))
                if v < _F0:
                    r = -r
                qi[t, b * 32 + j] = np.int8(r)
                total += np.int32(r)
            d16[t, b] = _round_f16(d)
            if with_sum:
                s16[t, b] = _round_f16(d * np.float32(total))


@njit(cache=True)
def _quant_q8_k_rows(x, qi, d, bsum32):
    """x f32[m, n] -> qi int8[m, n], d f32[m, n/256], bsum32 int32[m, n/32] (sum of qi
    per 32; ggml keeps int16 sums per 16, bsums, and adds them in pairs).

    ggml takes `max` = the first value of largest magnitude.  Found here as the largest
    |x| as an unsigned max over the bit patterns with the sign bit cleared (monotonic
    for non-NaN floats), one vector operation per 32 values (`block32_amax_bits`), then
    the first index holding it, searched in the first block of 32 that does.  Returns
    0, or 1 for a non-finite x (as `_quant_q8_0_rows`)."""
    m, n = x.shape
    nsb = n // 256
    xb = x.view(np.uint32)
    for t in range(m):
        xr, qr = x[t], qi[t]
        for b in range(nsb):
            o = b * 256
            abits = np.uint32(0)
            for g in range(8):
                abits = max(abits, block32_amax_bits(xr, o + g * 32))
            if abits >= _NON_FINITE_BITS:
                return 1
            if abits == 0:
                d[t, b] = _F0
                for j in range(256):
                    qr[o + j] = 0
                for j in range(8):
                    bsum32[t, b * 8 + j] = 0
                continue
            first = o
            while block32_amax_bits(xr, first) != abits:
                first += 32
            mx = _F0
            for j in range(first, first + 32):
                if xb[t, j] & np.uint32(0x7FFFFFFF) == abits:
                    mx = xr[j]
                    break
            iscale = _FM127 / mx
            for g in range(8):
                bsum32[t, b * 8 + g] = block32_quantize(xr, o + g * 32, iscale, qr)
            d[t, b] = _F1 / iscale
    return 0


# --- the quantizers as the integer kernels' driver calls them --------------------------
#
# A decode step quantizes one activation vector per matrix product.  From Python
# (`quantize_activations`) that is a numba call with three fresh arrays and a result
# object: 3.5-6 us a call, ~1 us of it arithmetic, 4 calls a layer.  So in decode the
# integer kernels' driver `_int.run` takes the float vector and calls the quantizer
# above itself, through a function pointer, as it calls the formats' LLVM kernels:
# numba gives every compiled function a C entry point taking the arrays by value
# (its "cfunc wrapper"), and `row_quantizer` hands out its address.
#
# Rejected: calling the quantizers from `run` as numba functions.  numba compiles a
# callee's code into its caller, and `run` is a parallel kernel whose compile time grows
# with its body: 3.4-3.5 s instead of 1.4-1.7 (docs/BENCHMARKS.md, "Tried and not
# kept").  Also rejected: numba `cfunc`s wrapping them, +0.4-0.6 s of compile each,
# on the first start's critical path.

class NonFiniteActivations(FloatingPointError):
    """Activations to quantize hold a NaN or an infinity (broken weights upstream): no
    scale represents them.  The model reports it as `NonFiniteValues`, naming the stage
    (model.py)."""


NON_FINITE = "the activations to quantize hold a NaN or an infinity"

_F32_2D = types.Array(types.float32, 2, "C")
# vec_dot_type -> (quantizer, its signature, the driver's code for it:
# fns[_int.QUANT_CODE])
_ROW_QUANTIZERS = {
    T.Q8_0: (_quant_q8_0_rows, (_F32_2D, types.Array(types.int8, 2, "C"), _F32_2D,
                                _F32_2D, types.boolean), 0),
    T.Q8_1: (_quant_q8_0_rows, (_F32_2D, types.Array(types.int8, 2, "C"), _F32_2D,
                                _F32_2D, types.boolean), 1),
    T.Q8_K: (_quant_q8_k_rows, (_F32_2D, types.Array(types.int8, 2, "C"), _F32_2D,
                                types.Array(types.int32, 2, "C")), 2),
}


def row_quantizer(kind) -> tuple[int, int]:
    """(address, code) of the quantizer of `kind` (Q8_0, Q8_1, Q8_K) as `_int.run`
    calls it: numba's C entry point of `_quant_q8_0_rows` (code 0: Q8_0, 1: Q8_1) or
    `_quant_q8_k_rows` (code 2), for 2-D C-contiguous arrays.  Compiled on first use
    (or loaded from numba's disk cache)."""
    fn, sig, code = _ROW_QUANTIZERS[T(int(kind))]
    cres = fn.overloads.get(sig)
    if cres is None:       # (`compile` waits for numba's lock even when nothing is new)
        fn.compile(sig)
        cres = fn.overloads[sig]
    return cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name), code


def row_quantizer_cached(kind) -> bool:
    """True if `row_quantizer(kind)` compiles nothing (in memory or numba's disk
    cache; assumed True where numba's internals differ from 0.68's)."""
    fn, sig, _ = _ROW_QUANTIZERS[T(int(kind))]
    if sig in fn.overloads:
        return True
    try:
        return os.path.exists(fn._cache._cache_file._index_path)
    except AttributeError:
        return True


class QuantizedActivations:
    """Activation rows converted to a weight format's `vec_dot_type`.

    `qi` int8[m, n] the quantized activations (read by the integer kernels) and `q`
    float32[m, n] the same small integers (read by the float kernels; made from `qi` on
    first use and kept; `q16` likewise as int16); `d` float32[m, n/32] (Q8_0, Q8_1) or
    [m, n/256] (Q8_K); `s` float32[m, n/32] for Q8_1 (f16-rounded `d * sum(q)`);
    `bsum32` int32[m, n/32] for Q8_K (sums of q per 32).  For F32/F16/BF16, `q` holds
    the (rounded) float activations and the other fields are None.
    """

    __slots__ = ("kind", "_q", "d", "s", "bsum32", "qi", "_side_bytes", "_q16")

    def __init__(self, kind, q, d=None, s=None, bsum32=None, qi=None):
        self.kind, self._q, self.d, self.s = kind, q, d, s
        self.bsum32, self.qi = bsum32, qi
        self._side_bytes = None
        self._q16 = None

    @property
    def q16(self) -> np.ndarray:
        """`qi` widened to int16 (made on first use and kept): what the generic integer
        kernels read (matvec._mv_q4_k), whose products LLVM then forms with vpmaddwd
        straight from memory."""
        if self._q16 is None:
            self._q16 = self.qi.astype(np.int16)  # [m, n]
        return self._q16

    @property
    def q(self) -> np.ndarray:
        if self._q is None:
            self._q = self.qi.astype(np.float32)  # [m, n]
        return self._q

    @property
    def side(self) -> np.ndarray | None:
        """The per-block array the weight kernels take after `d`: Q8_1's `s`, Q8_K's
        `bsum32`; for Q8_0, `d` again (unused there: one kernel signature for all)."""
        if self.s is not None:
            return self.s
        if self.bsum32 is not None:
            return self.bsum32
        return self.d

    @property
    def side_bytes(self) -> np.ndarray | None:
        """`side` as uint8 [m, *] (the integer kernels take it as bytes: one kernel
        signature whether it holds int32 or float32)."""
        if self._side_bytes is None and self.d is not None:
            self._side_bytes = self.side.view(np.uint8)
        return self._side_bytes

    def dequantized(self) -> np.ndarray:
        """float32[m, n]: q * d per block (F-types: the rounded activations)."""
        if self.d is None:
            return self.q
        m, n = self.q.shape
        qk = n // self.d.shape[1]
        q3 = self.q.reshape(m, n // qk, qk)                  # [m, blocks, qk]
        return (q3 * self.d[:, :, None]).reshape(m, n)      # [m, n]


def round_to_f16(x: np.ndarray) -> np.ndarray:
    """float32 copy of x rounded to the nearest half (ties to even), as ggml's
    `ggml_cpu_fp32_to_fp16`."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 copy of x rounded to bfloat16 with ggml's rule (nearest even; a NaN
    stays a quiet NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16) << 16
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = np.where(nan, ((u >> 16) | np.uint32(64)) << 16, r).astype(np.uint32)
    return r.view(np.float32)


def quantize_activations(x: np.ndarray, vec_dot_type, *,
                         reference: bool = False) -> QuantizedActivations:
    """Convert float32 activations x [n] or [m, n] to `vec_dot_type` (whole blocks)."""
    kind = vec_dot_type if type(vec_dot_type) is T else T(int(vec_dot_type))
    x2 = np.ascontiguousarray(x, dtype=np.float32)
    x2 = x2.reshape(1, -1) if x2.ndim == 1 else x2  # [m, n]
    m, n = x2.shape
    # identity tests: Enum == and hash are Python-level calls, ~0.1 us each per matvec
    if kind is _Q8_K:
        if n % 256:
            raise ValueError(f"activation rows of {n} values are not whole "
                             f"256-element super-blocks")
        qi = np.empty((m, n), np.int8)
        d = np.empty((m, n // 256), np.float32)
        bs = np.empty((m, n // 32), np.int32)
        if _quant_q8_k_rows(x2, qi, d, bs):
            raise NonFiniteActivations(NON_FINITE)
        return QuantizedActivations(kind, None, d, None, bs, qi)
    if kind is _Q8_0 or kind is _Q8_1:
        if n % 32:
            raise ValueError(f"activation rows of {n} values are not whole "
                             f"32-element blocks")
        q1 = kind is _Q8_1
        qi = np.empty((m, n), np.int8)
        d = np.empty((m, n // 32), np.float32)
        s = np.empty((m, n // 32) if q1 else (0, 0), np.float32)
        if reference:
            _quant_q8_0_rows_reference(x2, qi, d, s, q1)
        elif _quant_q8_0_rows(x2, qi, d, s, q1):
            raise NonFiniteActivations(NON_FINITE)
        return QuantizedActivations(kind, None, d, s if q1 else None, None, qi)
    if kind == T.F32:
        return QuantizedActivations(kind, x2)
    if kind == T.F16:
        return QuantizedActivations(kind, round_to_f16(x2))
    if kind == T.BF16:
        return QuantizedActivations(kind, round_to_bf16(x2))
    raise ValueError(f"{kind.name} is not an activation format")


def fake_quant(x: np.ndarray, vec_dot_type) -> np.ndarray:
    """float32[m, n]: the activations after a round trip through `vec_dot_type`
    (q * d per block)."""
    return quantize_activations(x, vec_dot_type).dequantized()
