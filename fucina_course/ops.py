"""The small operations between the matmuls: RMSNorm, RoPE, SwiGLU, softmax, causal attention.

Everything here is float32 numpy on `[seq, ...]` arrays.  These ops move little data compared with
the weight matmuls (`quant/`), so plain vectorized numpy is enough -- with one exception: decode
attention.  Done with numpy, one token's attention over a 50-position f16 cache took ~0.4 ms per
layer (widening the cache to float32, ten small array ops), 11 ms of a 69 ms Qwen3-0.6B decode step;
`decode_attention` does the same arithmetic in one numba kernel that reads the float16 cache in
place, in ~25 us.  Where llama.cpp's arithmetic has a particular rounding (RMSNorm's float64 sum,
RoPE's float32 angle recurrence, float16 attention operands) we follow it, so that our logits track
llama.cpp's to the last few bits rather than merely "closely".
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .quant._intrinsics import f16_to_f32, f32_to_f16_bits


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last axis (any leading shape).

    ggml's exact recipe: each square is a float32 product, the squares are summed in float64 in
    order, the mean and the scale are float32, and y = (x * scale) * weight.  A small numba loop
    does it (numpy's float64 einsum squared in float64 and summed pairwise: last-bit differences).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _rms_norm_rows(x.reshape(-1, x.shape[-1]), weight, np.float32(eps), out.reshape(-1, x.shape[-1]))
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
    Pair (a, b) becomes (a cos - b sin, a sin + b cos).  Only q and k are rotated, never v:
    positions matter for *matching*, not for content.
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
    scores = np.matmul(qg, k.transpose(1, 2, 0))                                            # [kv, g*n, ctx]
    _causal_softmax_f16(scores, n, q_pos0, np.float32(scale))  # in place: scores -> probabilities
    probs = scores
    out = np.matmul(probs, v.transpose(1, 0, 2))                                            # [kv, g*n, d]
    out = out.reshape(n_kv, group, n, d).transpose(2, 0, 1, 3)                              # [n, kv, g, d]
    return np.ascontiguousarray(out.reshape(n, n_heads * d), dtype=np.float32)


def _f16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest float16 (and back): one operand of an f16 matmul."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _f16_rounded(x.reshape(-1)).reshape(x.shape)


@njit(cache=True)
def _softmax_f16(row, count, scale):  # pragma: no cover - compiled
    """row[:count] = f16(softmax(row[:count] * scale)), in place, with ggml's order of operations:
    scale, max, exp, float64 sum, multiply by the reciprocal, round the probability to float16."""
    top = np.float32(-np.inf)
    for j in range(count):
        row[j] *= scale
        top = max(top, row[j])
    total = 0.0
    for j in range(count):
        row[j] = np.exp(row[j] - top)
        total += row[j]
    inv = np.float32(1.0 / total)
    for j in range(count):
        row[j] = f16_to_f32(f32_to_f16_bits(row[j] * inv))


@njit(cache=True, parallel=True)
def _causal_softmax_f16(scores, n, q_pos0, scale):  # pragma: no cover - compiled
    """scores `[batch, rows, ctx]` (row r is query r % n) -> causal softmax, rounded to f16, in place.

    One pass per row instead of numpy's five (scale, mask, max/exp, normalise, round): at n = 256
    the numpy version spent ~20 of its 25 ms per layer in those passes.
    """
    batch, rows, ctx = scores.shape
    for br in prange(batch * rows):
        b, r = br // rows, br % rows
        visible = q_pos0 + r % n + 1                        # keys 0..q_pos0 + i
        _softmax_f16(scores[b, r], visible, scale)
        scores[b, r, visible:] = 0.0


@njit(cache=True)
def _f16_rounded(x):  # pragma: no cover - compiled
    out = np.empty(x.shape[0], np.float32)
    for j in range(x.shape[0]):
        out[j] = f16_to_f32(f32_to_f16_bits(x[j]))
    return out


@njit(cache=True, fastmath={"reassoc"})
def _dot_f16(qh, k_bits, t, kv):  # pragma: no cover - compiled
    """q . k_t for one cached key, with the additions free to reassociate.

    A strict left-to-right float sum is one dependent add per element (4-cycle latency) and
    cannot be vectorized; allowing reassociation (only that: no FMA contraction, no other fast
    math) lets LLVM keep vector partial sums.  Measured, 16 heads x 1024 cached positions x 128,
    one thread: the whole attention took 2.5 ms strict, 1.25 ms with this.
    """
    s = np.float32(0.0)
    for j in range(qh.shape[0]):
        s += qh[j] * f16_to_f32(k_bits[t, kv, j])
    return s


@njit(cache=True, parallel=True)
def _decode_attention_f16(q, k_bits, v_bits, ctx, scale, out):  # pragma: no cover - compiled
    n_heads, d = q.shape
    group = n_heads // k_bits.shape[1]
    for h in prange(n_heads):
        kv = h // group
        qh = _f16_rounded(q[h])                             # q rounded to f16, as ggml does
        probs = np.empty(ctx, np.float32)
        for t in range(ctx):
            probs[t] = _dot_f16(qh, k_bits, t, kv)
        _softmax_f16(probs, ctx, scale)
        acc = np.zeros(d, np.float32)
        for t in range(ctx):
            for j in range(d):
                acc[j] += probs[t] * f16_to_f32(v_bits[t, kv, j])
        out[h, :] = acc


@njit(cache=True, parallel=True)
def _decode_attention_q8(q, k_q, k_scale_bits, v_q, v_scale_bits, ctx, scale, out):  # pragma: no cover
    n_heads, d = q.shape
    group = n_heads // k_q.shape[1]
    for h in prange(n_heads):
        kv = h // group
        qh = _f16_rounded(q[h])
        probs = np.empty(ctx, np.float32)
        for t in range(ctx):
            s = np.float32(0.0)
            for b in range(d // 32):
                part = np.float32(0.0)
                for j in range(32):
                    part += qh[b * 32 + j] * np.float32(k_q[t, kv, b * 32 + j])
                s += part * f16_to_f32(k_scale_bits[t, kv, b])
            probs[t] = s
        _softmax_f16(probs, ctx, scale)
        acc = np.zeros(d, np.float32)
        for t in range(ctx):
            for b in range(d // 32):
                ps = probs[t] * f16_to_f32(v_scale_bits[t, kv, b])
                for j in range(32):
                    acc[b * 32 + j] += ps * np.float32(v_q[t, kv, b * 32 + j])
        out[h, :] = acc


def decode_attention(q: np.ndarray, cache, layer: int, ctx: int, scale: float) -> np.ndarray:
    """One query token `[n_heads, d]` against positions 0..ctx-1 of a KV cache layer: `[n_heads * d]`.

    The arithmetic of `causal_attention` (same roundings; only summation order differs), run by a
    numba kernel that reads the float16 (or q8_0) cache where it lies, parallel over heads.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty(q.shape, np.float32)                                            # [n_heads, d]
    if cache.cache_type == "f16":
        _decode_attention_f16(q, cache.k[layer].view(np.uint16), cache.v[layer].view(np.uint16),
                              ctx, np.float32(scale), out)
    else:
        _decode_attention_q8(q, cache.k[layer], cache.k_scale[layer].view(np.uint16), cache.v[layer],
                             cache.v_scale[layer].view(np.uint16), ctx, np.float32(scale), out)
    return out.reshape(-1)
