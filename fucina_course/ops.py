"""The small operations between the matmuls: RMSNorm, RoPE, SwiGLU.

Everything here is float32 on `[seq, ...]` arrays.  These ops move little data compared
with the weight matmuls (`quant/`) and attention (`attention.py`), so they stay short.
Where llama.cpp's arithmetic has a particular rounding (RMSNorm's float64 sum, RoPE's
float32 angle recurrence) we follow it, so our logits track llama.cpp's to the last few
bits rather than merely "closely".
"""

from __future__ import annotations

import math
import threading

import numpy as np
from numba import njit, prange

from .quant._intrinsics import f32_as_u32, u32_as_f32
from .tape import call, fresh


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float,
             out: np.ndarray | None = None) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last axis (any leading shape).

    ggml's exact recipe: each square is a float32 product, the squares are summed in
    float64 in order, the mean and the scale are float32, and y = (x * scale) * weight.
    A small numba loop does it (numpy's float64 einsum squared in float64 and summed
    pairwise: last-bit differences).  `out`: a C-contiguous float32 array of x's shape
    to write into (a step's workspace), else a new one.
    """
    if out is None:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty_like(x)
    eps32 = _as_f32.get(eps)
    if eps32 is None:       # (np.float32() alone costs ~0.5 us; a decode layer has 2-4)
        eps32 = _as_f32[eps] = np.float32(eps)
    if x.ndim == 2:                       # [rows, dim] already (decode: no reshape)
        call(_rms_norm_rows, x, weight, eps32, out)
    elif x.ndim == 3 and len(x) == 1:     # one token's heads (decode)
        call(_rms_norm_rows, x[0], weight, eps32, out[0])
    else:
        d = x.shape[-1]
        fresh()                           # (the reshape may copy)
        _rms_norm_rows(x.reshape(-1, d), weight, eps32, out.reshape(-1, d))
    return out


_as_f32: dict = {}         # eps -> np.float32(eps)


@njit(cache=True)
def _rms_norm_rows(x, weight, eps, out):  # pragma: no cover - compiled
    rows, dim = x.shape
    for r in range(rows):
        total = 0.0                                         # float64 accumulator
        for j in range(dim):
            total += x[r, j] * x[r, j]                      # float32 square, widened
        mean = np.float32(total / dim)
        scale = np.float32(1.0) / np.sqrt(mean + eps)
        for j in range(dim):
            out[r, j] = x[r, j] * scale * weight[j]


def rope_angles(positions: np.ndarray, head_dim: int,
                theta_base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, channel pair) angle: float32 `[n_pos, d/2]` x2.

    Pair i of a token at position p turns by p * base^(-2i/head_dim).  ggml builds that
    angle by repeated float32 multiplication (theta_{i+1} = theta_i * base^(-2/d)), not
    by a power, so we do the same; the angles then agree with llama.cpp to the bit.

    The step is ggml's `powf(base, -2.0f/d)`, i.e. glibc's powf: correctly rounded in
    practice (0.82 ULP bound; it returned the float32 nearest the exact power for 755 of
    756 (base, d) pairs scanned, 2026-12-05).  numpy's float32 `np.power` is not: its
    SIMD path on this AVX-512 Zen 4 was 1 ULP off for 102 of the 756, Llama's 1e4 / 64
    and SmolLM2's 1e5 / 64 among them, while aarch64 numpy was right, so x86 and ARM
    rotated by different angles and a near-tie in SmolLM2's greedy generation went two
    ways.  The power in float64 (`math.pow`) rounded once to float32 was the correctly
    rounded float32 for all 756 (checked against a 60-digit Decimal) and does not
    depend on numpy's SIMD level.
    """
    exponent = np.float32(-2.0) / np.float32(head_dim)
    step = np.float32(math.pow(float(np.float32(theta_base)), float(exponent)))
    theta = np.asarray(positions, dtype=np.float32).copy()                # [n_pos]
    angles = np.empty((theta.shape[0], head_dim // 2), dtype=np.float32)  # [n_pos, d/2]
    for i in range(head_dim // 2):
        angles[:, i] = theta
        theta = (theta * step).astype(np.float32)
    angles64 = angles.astype(np.float64)
    return np.cos(angles64).astype(np.float32), np.sin(angles64).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str,
               out: np.ndarray | None = None) -> np.ndarray:
    """Rotate channel pairs of `x` `[seq, heads, head_dim]` by per-position angles
    `[seq, head_dim/2]`.

    "neox" (Qwen, "half" layout): channel i pairs with i + d/2.  "normal" (Llama): 2i
    with 2i+1. Pair (a, b) becomes (a cos - b sin, a sin + b cos).  Only q and k are
    rotated, never v: positions matter for *matching*, not for content.  `out`: a
    C-contiguous float32 array of x's shape to write into, else a new one.
    """
    if style not in ("neox", "normal"):
        raise ValueError(f"unknown RoPE style {style!r}")
    if not x.flags.c_contiguous:    # (one layout: one compiled kernel)
        x = np.ascontiguousarray(x, dtype=np.float32)
        fresh()
    if out is None:
        out = np.empty_like(x)
    call(_rope, x, cos, sin, style == "neox", out)
    return out


class RopeTable:
    """cos and sin of every position's angles, computed once per position and kept
    (`rope_angles` rows, which depend on their position alone, so a row looked up here
    is the row computed for any set of positions, to the bit).

    Why: `rope_angles` of a single position cost ~100-180 us (a Python loop over the
    channel pairs), once per decoded token; a lookup is a slice.  The table grows in
    blocks of `BLOCK` positions."""

    BLOCK = 256

    def __init__(self, head_dim: int, theta_base: float):
        self.head_dim, self.theta_base = head_dim, theta_base
        empty = np.empty((0, head_dim // 2), np.float32)
        self._table = (empty, empty)          # cos, sin [positions, d/2], swapped whole
        self._grow = threading.Lock()

    def _cover(self, stop: int) -> tuple[np.ndarray, np.ndarray]:
        table = self._table
        if stop > len(table[0]):
            with self._grow:
                cos, sin = self._table
                have, end = len(cos), -(-stop // self.BLOCK) * self.BLOCK
                if end > have:
                    more = rope_angles(np.arange(have, end), self.head_dim,
                                       self.theta_base)
                    self._table = (np.concatenate([cos, more[0]]),
                                   np.concatenate([sin, more[1]]))
                table = self._table
        return table

    def span(self, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The angles of positions pos0 .. pos0 + n - 1: `[n, d/2]` views x2."""
        cos, sin = self._cover(pos0 + n)
        return cos[pos0:pos0 + n], sin[pos0:pos0 + n]

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The angles of any positions (a batch's streams): `[n, d/2]` copies x2."""
        cos, sin = self._cover(int(positions.max()) + 1)
        return cos[positions], sin[positions]


@njit(cache=True)
def _rope(x, cos, sin, neox, out):  # pragma: no cover - compiled
    seq, heads, d = x.shape
    half = d // 2
    for t in range(seq):
        for h in range(heads):
            for i in range(half):
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = x[t, h, ia], x[t, h, ib]
                out[t, h, ia] = a * cos[t, i] - b * sin[t, i]
                out[t, h, ib] = a * sin[t, i] + b * cos[t, i]


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up: the gate decides, per channel, how much of `up` passes.

    One parallel numba pass (`_swiglu`, with `expf`) over `[n, ffn]` arrays, which may
    be column views of one fused gate/up product: numpy's passes (a copy of each view,
    exp, add, divide, multiply) took ~2 ms a layer in a `[256, 3072]` prefill, 3% of a
    Qwen3-0.6B Q4_K pp256.  `out`: a C-contiguous float32 `[n, ffn]` to write into."""
    if (out is not None and len(out) == 1 and gate.flags.c_contiguous
            and up.flags.c_contiguous):                                  # decode
        call(_swiglu_one, gate[0], up[0], out)    # (one row of a fused product)
        return out
    fresh()
    shape = np.shape(gate)
    gate, up = _rows(gate), _rows(up)
    if out is None:
        out = np.empty(gate.shape, np.float32)
    if out.shape[0] == 1:
        _swiglu_one(_flat(gate), _flat(up), out)
    else:
        _swiglu(_flat(gate), gate.strides[0] // 4, _flat(up), up.strides[0] // 4, out)
    return out.reshape(shape)


def _rows(x: np.ndarray) -> np.ndarray:
    """x as float32 `[rows, cols]` with contiguous rows (a column view stays a view)."""
    x = np.asarray(x, dtype=np.float32)
    x = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
    return x if x.strides[1] == 4 and x.strides[0] % 4 == 0 else np.ascontiguousarray(x)


def _flat(x: np.ndarray) -> np.ndarray:
    """The memory of `_rows` array x from its first to its last element, as one 1-D
    contiguous array (row i starts at i * x.strides[0] / 4).  numba then knows the unit
    stride and vectorizes; over a 2-D view (strides known only at run time) the same
    loop stayed scalar (3.5 ms instead of 0.7 for `[256, 3072]`)."""
    if x.flags.c_contiguous:
        return x.reshape(-1)
    span = (x.shape[0] - 1) * x.strides[0] // 4 + x.shape[1]
    return np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(4,))


@njit(inline="always")
def _swiglu_row(gate, g0, up, u0, out_row):  # pragma: no cover - compiled
    n = out_row.shape[0]
    gate, up = gate[g0:g0 + n], up[u0:u0 + n]   # (an index g0 + j would block SIMD)
    for j in range(n):
        g = gate[j]
        out_row[j] = g / (np.float32(1.0) + expf(-g)) * up[j]


# error_model="numpy": without it numba guards every division against zero (Python's
# ZeroDivisionError), and that branch kept the loop scalar: 17 us instead of 2 per row.
@njit(cache=True, parallel=True, error_model="numpy")
def _swiglu(gate, gate_row, up, up_row, out):  # pragma: no cover - compiled
    """out[i, j] = silu(gate[i * gate_row + j]) * up[i * up_row + j], in parallel."""
    for i in prange(out.shape[0]):
        _swiglu_row(gate, i * gate_row, up, i * up_row, out[i])


@njit(cache=True, error_model="numpy")
def _swiglu_one(gate, up, out):  # pragma: no cover - compiled
    """One row (decode): waking the thread pool would cost more than the row (~2 us)."""
    _swiglu_row(gate, 0, up, 0, out[0])


# e^x = 2^n e^r with n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2]
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)        # 15 significant bits: n * _LN2_HI exact
_LN2_LO = np.float32(1.4286068203094172e-06)   # ln 2 - _LN2_HI
_ROUNDER = np.float32(12582912.0 + 126.0)      # 1.5 * 2^23 (+126: exponent bias - 1)


@njit(inline="always")
def expf(x):  # pragma: no cover - compiled
    """e^x for a float32, in straight-line float32 code that LLVM vectorizes inside a
    loop.  numba's `np.exp` is a libm call per element, which no loop vectorizes:
    1M elements took 3.7 ms with it, 0.57 ms with this (one thread).

    Within 1 ulp of the correctly rounded result (tests/test_ops.py checks every 61st
    float32 from -86.5 to 88.72, ~36 M values).  ggml's softmax and SiLU use a
    vectorized exp of their own (`ggml_v_expf`), not libm's, so neither is llama.cpp's
    to the bit.
    Below -86.5 (e^x < 3e-38, the float32 normal range's end) it returns 0, above
    88.72 inf; NaN stays NaN.

    Range reduction: adding 1.5 * 2^23 rounds x / ln 2 to the integer n in the low
    mantissa bits of t (no float -> int conversion, which LLVM leaves undefined for
    NaN); shifted left by 23 they are 2^(n-1)'s exponent.  e^r is its Taylor series to
    r^7 (truncation < 6e-9 relative on |r| <= ln2/2)."""
    t = x * _LOG2E + _ROUNDER
    n = t - _ROUNDER                                          # round(x / ln 2), a float
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    half_scale = u32_as_f32(f32_as_u32(t) << np.uint32(23))   # 2^(n-1)
    y = p * half_scale * np.float32(2.0)
    if x < np.float32(-86.5):
        y = np.float32(0.0)
    if x > np.float32(88.72):
        y = np.float32(np.inf)
    return y
