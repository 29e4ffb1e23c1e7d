"""The small operations between the matmuls: RMSNorm, RoPE, SwiGLU.

Everything here is float32 on `[seq, ...]` arrays.  These ops move little data compared
with the weight matmuls (`quant/`) and attention (`attention.py`), so they stay short.
Where llama.cpp's arithmetic has a particular rounding (RMSNorm's float64 sum, RoPE's
float32 angle recurrence) we follow it, so our logits track llama.cpp's to the last few
bits rather than merely "closely".
"""

from __future__ import annotations

import numpy as np
from numba import njit


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last axis (any leading shape).

    ggml's exact recipe: each square is a float32 product, the squares are summed in
    float64 in order, the mean and the scale are float32, and y = (x * scale) * weight.
    A small numba loop does it (numpy's float64 einsum squared in float64 and summed
    pairwise: last-bit differences).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])                                     # [.., dim]
    _rms_norm_rows(rows, weight, np.float32(eps), out.reshape(rows.shape))
    return out


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
    """
    exponent = np.float32(-2.0) / np.float32(head_dim)
    step = np.float32(np.power(np.float32(theta_base), exponent))
    theta = np.asarray(positions, dtype=np.float32).copy()                # [n_pos]
    angles = np.empty((theta.shape[0], head_dim // 2), dtype=np.float32)  # [n_pos, d/2]
    for i in range(head_dim // 2):
        angles[:, i] = theta
        theta = (theta * step).astype(np.float32)
    angles64 = angles.astype(np.float64)
    return np.cos(angles64).astype(np.float32), np.sin(angles64).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray,
               style: str) -> np.ndarray:
    """Rotate channel pairs of `x` `[seq, heads, head_dim]` by per-position angles
    `[seq, head_dim/2]`.

    "neox" (Qwen, "half" layout): channel i pairs with i + d/2.  "normal" (Llama): 2i
    with 2i+1. Pair (a, b) becomes (a cos - b sin, a sin + b cos).  Only q and k are
    rotated, never v: positions matter for *matching*, not for content.
    """
    if style not in ("neox", "normal"):
        raise ValueError(f"unknown RoPE style {style!r}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _rope(x, cos, sin, style == "neox", out)
    return out


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


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up: the gate decides, per channel, how much of `up` passes."""
    return silu(gate) * up
