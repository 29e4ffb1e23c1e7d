"""The small operations between the matmuls: RMSNorm, RoPE, SwiGLU, softmax, causal attention.

Everything here is float32 numpy on `[seq, ...]` arrays.  These ops move little data compared with
the weight matmuls (`quant.py`), so plain vectorized numpy is enough; where llama.cpp's arithmetic
has a particular rounding (RMSNorm's float64 sum, RoPE's float32 angle recurrence) we follow it, so
that our logits track llama.cpp's to the last few bits rather than merely "closely".
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last axis.

    The mean of squares is accumulated in float64, as ggml does (its `ggml_float` is a double);
    the scale is then rounded to float32 before it multiplies x.
    """
    x = np.asarray(x, dtype=np.float32)
    mean_sq = np.einsum("...i,...i->...", x, x, dtype=np.float64) / x.shape[-1]   # [...]
    scale = (1.0 / np.sqrt((mean_sq + eps).astype(np.float32))).astype(np.float32)
    return (x * scale[..., None]) * weight


def rope_angles(positions: np.ndarray, head_dim: int, theta_base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, channel pair) angle: two float32 `[n_pos, head_dim // 2]`.

    Pair i of a token at position p turns by p * base^(-2i/head_dim).  ggml builds that angle by
    repeated float32 multiplication (theta_{i+1} = theta_i * base^(-2/d)), not by a power, so we do
    the same; the angles then agree with llama.cpp to the bit.
    """
    step = np.float32(np.power(np.float32(theta_base), np.float32(-2.0) / np.float32(head_dim)))
    theta = np.asarray(positions, dtype=np.float32).copy()                          # [n_pos]
    angles = np.empty((theta.shape[0], head_dim // 2), dtype=np.float32)           # [n_pos, d/2]
    for i in range(head_dim // 2):
        angles[:, i] = theta
        theta = (theta * step).astype(np.float32)
    angles64 = angles.astype(np.float64)
    return np.cos(angles64).astype(np.float32), np.sin(angles64).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """Rotate channel pairs of `x` `[seq, heads, head_dim]` by per-position angles `[seq, head_dim/2]`.

    "neox" (Qwen, "half" layout): channel i pairs with i + d/2.  "normal" (Llama): 2i with 2i+1.
    Only q and k are rotated, never v: positions matter for *matching*, not for content.
    """
    c = cos[:, None, :]                                                             # [seq, 1, d/2]
    s = sin[:, None, :]
    out = np.empty_like(x)
    if style == "neox":
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * c - b * s
        out[..., half:] = a * s + b * c
    elif style == "normal":
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
    else:
        raise ValueError(f"unknown RoPE style {style!r}")
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up: the gate decides, per channel, how much of `up` passes."""
    return silu(gate) * up


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x - max) times the reciprocal of its float64 sum (ggml's order of operations)."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e * (1.0 / np.sum(e, axis=axis, keepdims=True, dtype=np.float64)).astype(np.float32)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos0: int, scale: float) -> np.ndarray:
    """Grouped-query causal attention.

    q: `[n, n_heads, d]` for the queries at absolute positions q_pos0 .. q_pos0 + n - 1.
    k, v: `[ctx, n_kv_heads, d]` for keys/values at positions 0 .. ctx - 1 (ctx = q_pos0 + n when a
    cache supplies the past).  Query head h reads KV head h // (n_heads // n_kv_heads): consecutive
    query heads share one KV head, which is what makes the KV cache small.
    Query at position p sees keys 0..p only (the causal mask).  Returns `[n, n_heads * d]`.

    Rounding follows llama.cpp's attention without flash attention (llama-cpp-python's default):
    its K/V live in a float16 cache, and ggml multiplies a float16 matrix by first rounding the other
    operand to float16 -- the queries before Q.K^T, the softmax probabilities before P.V -- then
    accumulates in float32.  We round the same operands (q, k, v and the probabilities), and
    normalise the softmax as ggml does (multiply by the float64 reciprocal of the sum).  Measured on
    a one-layer float32 synthetic Qwen3, max |logit diff| vs llama.cpp fell from 8e-4 to 1e-6 with
    these casts.  What remains is the last bit of `exp`: when it lands a probability on the other
    side of a float16 rounding boundary, that position differs by ~1e-4 relative; quantized
    activations downstream can amplify such a flip (tests hold quantized formats to 2% of the
    logit range and argmax equality).
    """
    n, n_heads, d = q.shape
    ctx, n_kv, _ = k.shape
    group = n_heads // n_kv
    q, k, v = _f16_round(q), _f16_round(k), _f16_round(v)
    qg = q.reshape(n, n_kv, group, d).transpose(1, 2, 0, 3).reshape(n_kv, group * n, d)  # [kv, g*n, d]
    scores = np.matmul(qg, k.transpose(1, 2, 0)) * np.float32(scale)                       # [kv, g*n, ctx]
    scores = scores.reshape(n_kv, group, n, ctx)                                            # [kv, g, n, ctx]
    allowed = np.arange(ctx)[None, :] <= (q_pos0 + np.arange(n))[:, None]                  # [n, ctx]
    scores = np.where(allowed, scores, np.float32(-np.inf))
    probs = _f16_round(softmax(scores, axis=-1)).reshape(n_kv, group * n, ctx)             # [kv, g*n, ctx]
    out = np.matmul(probs, v.transpose(1, 0, 2))                                            # [kv, g*n, d]
    out = out.reshape(n_kv, group, n, d).transpose(2, 0, 1, 3)                              # [n, kv, g, d]
    return np.ascontiguousarray(out.reshape(n, n_heads * d), dtype=np.float32)


def _f16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest float16 (and back): one operand of an f16 matmul."""
    return x.astype(np.float16).astype(np.float32)
