"""Grouped-query causal attention: every query blends the values of the keys it may see.

For one query head: scores = q . k_t * scale for every visible position t, probabilities
= softmax(scores), output = sum_t p_t v_t.  Two rules shape the rest:

* **Causal mask.**  A token at position p sees positions 0..p only; it was trained to
  predict the next token, so looking ahead would be reading the answer.
* **Grouped-query attention (GQA).**  Query head h reads KV head h // (n_heads //
  n_kv_heads): consecutive query heads share one key/value head.  Qwen3-0.6B has 16
  query heads over 8 KV heads, which halves the KV cache and the bytes a decode step
  reads from it.

Two kernels compute the same thing for the two shapes of a step:

* `causal_attention` -- many queries (prefill): two batched matmuls (numpy/BLAS) around
  one fused numba softmax pass, a block of `QUERY_BLOCK` queries at a time.
* `decode_attention` -- one query per stream (decode): one numba kernel that reads the
  KV cache where it lies (`KvCache.layer_view`), parallel over heads.  With numpy, one
  token over a 50-position f16 cache took ~0.4 ms per layer (11 ms of a 69 ms Qwen3-0.6B
  step); the kernel takes ~25 us.

`attend` routes a step's rows to them, one sequence (`Segment`) at a time.  With
`per_row=True` it runs the decode kernel once per query row, whatever the step's shape:
every row is then computed exactly as a one-token decode step computes it, bit for bit
-- the like-for-like comparison of the cache oracle (model.py, `forward_all_logits`).

Rounding follows llama.cpp without flash attention (llama-cpp-python's default): K and V
live in a float16 cache, and ggml multiplies an f16 matrix by first rounding the other
operand to f16 -- the queries before Q.K^T, the probabilities before P.V -- and
accumulates in float32. We round the same operands.  On a one-layer float32 synthetic
Qwen3 this took max |logit diff| vs llama.cpp from 8e-4 to 1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from .kv_cache import KvCache, KvView
from .ops import expf
from .quant._intrinsics import (block16_max, f16_to_f32, f32_to_f16_bits,
                                lanes32_dot_f16, lanes32_sum_f64)
from .tape import call


@dataclass
class Segment:
    """Rows `start:stop` of a step are one sequence: its first position and its KV
    cache.

    A prefill or decode step is one segment; a batch decode of N streams is N segments
    of one row each."""

    start: int
    stop: int
    pos0: int
    cache: KvCache

    @property
    def rows(self) -> slice:
        return slice(self.start, self.stop)


def attend(q, k, v, segments: list[Segment], layer: int, scale: float,
           per_row: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """The attention of one layer for a whole step: `[n, n_heads * head_dim]` (into
    `out`, C-contiguous, if given).

    q `[n, n_heads, d]`, k and v `[n, n_kv, d]` are the step's new rows (k after RoPE).
    Each segment appends its rows to its cache (no advance: see kv_cache.py), then its
    queries attend over everything the cache holds for that sequence.
    """
    n, n_heads, d = q.shape
    if out is None:
        out = np.empty((n, n_heads * d), dtype=np.float32)                 # [n, H*D]
    if n == 1:                      # decode: one query, the cache read where it lies
        call(_attend_one, q, k, v, segments, layer, scale, out.reshape(n_heads, d))
        return out
    for s in segments:
        rows = s.stop - s.start
        s.cache.append_layer(layer, k[s.rows], v[s.rows])
        if rows == 1 or per_row:  # one query per kernel call, the cache read in place
            view = s.cache.layer_view(layer, s.pos0 + rows)
            for i in range(rows):
                seen = view if rows == 1 else view._replace(length=s.pos0 + i + 1)
                row = s.start + i                                          # keys 0..pos
                decode_attention(q[row], seen, scale, out[row].reshape(n_heads, d))
        else:  # all queries at once
            keys, values = s.cache.read(layer, s.pos0 + rows)      # [seen, KVH, D]
            out[s.rows] = causal_attention(q[s.rows], keys, values, s.pos0, scale)
    return out


def _attend_one(q, k, v, segments, layer, scale, out) -> None:
    """One token of one sequence: append its k and v, attend over the cache.  (A call
    of its own: a recorded decode step (tape.py) calls it again with the same
    arguments, and it reads the sequence's segment, its cache and position, anew.)"""
    s = segments[0]
    s.cache.append_layer(layer, k, v)
    decode_attention(q[0], s.cache.layer_view(layer, s.pos0 + 1), scale, out)


# Queries per block of `causal_attention`: each block is multiplied only by the keys its
# last query sees.  The whole prompt at once computes every score, then the mask zeroes
# nearly half of them; smaller blocks skip more but give BLAS smaller, slower products.
# Synthetic Qwen3-0.6B Q8_0, a 1,024-token prompt, attention alone (same process,
# alternating, medians of 3): 3.85 s in one block, 2.94 / 3.01 / 3.03 s in blocks of
# 256 / 512 / 128.  A prompt of up to 256 tokens is one block, as before.
QUERY_BLOCK = 256


def causal_attention(q, k, v, q_pos0: int, scale: float) -> np.ndarray:
    """Grouped-query causal attention of many queries: `[n, n_heads * d]`.

    q `[n, n_heads, d]` holds the queries at positions q_pos0 .. q_pos0 + n - 1; k, v
    `[ctx, n_kv, d]` the keys/values of positions 0 .. ctx - 1.  The query at position p
    sees keys 0..p.  Softmax normalised as ggml does (times the float64 reciprocal of
    the sum).
    """
    n, n_heads, d = q.shape
    ctx, n_kv, _ = k.shape
    g = n_heads // n_kv                                 # query heads per KV head
    qg = by_kv_head_f16(q, n_kv)   # [kv, n*g, d]: row i*g + j is query i, head kv*g + j
    kt = by_kv_head_f16(k, n_kv)                                          # [kv, ctx, d]
    vt = by_kv_head_f16(v, n_kv)                                          # [kv, ctx, d]
    out = np.empty((n_kv, n * g, d), np.float32)                          # [kv, n*g, d]
    for i in range(0, n, QUERY_BLOCK):
        end = min(n, i + QUERY_BLOCK)                 # queries i .. end - 1
        rows, seen = slice(i * g, end * g), q_pos0 + end  # seen: keys the last sees
        scores = np.matmul(qg[:, rows], kt[:, :seen].transpose(0, 2, 1))   # [kv,r,seen]
        _causal_softmax_f16(scores, g, q_pos0 + i, np.float32(scale))    # probabilities
        np.matmul(scores, vt[:, :seen], out=out[:, rows])
    out = out.reshape(n_kv, n, g, d).transpose(1, 0, 2, 3)            # [n, kv, g, d]
    return out.reshape(n, n_heads * d)                                    # [n, H*d]


def decode_attention(q: np.ndarray, view: KvView, scale: float,
                     out: np.ndarray | None = None) -> np.ndarray:
    """One query token `[n_heads, d]` against the cached positions in `view`: `[n_heads
    * d]`.

    The arithmetic of `causal_attention` (same roundings; only the summation order
    differs), in one numba kernel that reads the f16 or q8_0 cache in place.  `out`, a
    C-contiguous float32 `[n_heads, d]` buffer, receives the result if given (a row of
    `attend`'s output).
    """
    if not q.flags.c_contiguous:
        q = np.ascontiguousarray(q, dtype=np.float32)
    if out is None:
        out = np.empty(q.shape, np.float32)                               # [n_heads, d]
    if view.k_scale is None:
        _decode_f16(q, view.k, view.v, view.length, np.float32(scale), out)
    else:
        _decode_q8(q, view.k, view.k_scale, view.v, view.v_scale, view.length,
                   np.float32(scale), out)
    return out.reshape(-1)


# --- kernels --------------------------------------------------------------------------

def f16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest float16 and back: one operand of an f16 matmul."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _f16_rounded(x.reshape(-1)).reshape(x.shape)


@njit(cache=True)
def _f16_rounded(x):  # pragma: no cover - compiled
    out = np.empty(x.shape[0], np.float32)
    for j in range(x.shape[0]):
        out[j] = f16_to_f32(f32_to_f16_bits(x[j]))
    return out


@njit(cache=True, error_model="numpy")
def _softmax_f16(row, count, scale):  # pragma: no cover - compiled
    """row[:count] = f16(softmax(row[:count] * scale)) in place, in ggml's order: scale,
    max, exp, float64 sum, multiply by the reciprocal, round each probability to
    float16.  The exp is ops.expf, which vectorizes (numba's np.exp, a libm call per
    score, was 3.7 of a prefill layer's ~13 ms of attention); so do the max
    (`block16_max`) and the sum (`_sum_f64`).  With a scalar max and a strictly ordered
    sum, 2M scores in rows of 1,024 took 8.6 ms on one thread, with these 5.5."""
    for j in range(count):
        row[j] *= scale
    top = np.float32(-np.inf)
    j = 0
    while j + 16 <= count:
        top = block16_max(row, j, top)
        j += 16
    for t in range(j, count):
        top = max(top, row[t])
    for j in range(count):
        row[j] = expf(row[j] - top)
    inv = np.float32(1.0 / _sum_f64(row, count))
    for j in range(count):
        row[j] = f16_to_f32(f32_to_f16_bits(row[j] * inv))


# One order: every float sum of the decode kernel has one, whatever the SIMD width:
# 32 lane sums (lane l adds elements l, l + 32, l + 64, ... in order) combined in a
# fixed tree, written as explicit `<32 x float>` IR (quant/_intrinsics.py) that LLVM
# splits into 512-bit AVX-512, 256-bit AVX2 or 128-bit NEON registers without
# reordering a single add.  With `reassoc` LLVM chose its own partial sums, one set per
# vector width: q . k, the softmax sums and so a greedy SmolLM2 generation differed
# between x86 and aarch64 (qemu, scripts/test_aarch64.sh).  Numba loops over a 32-float
# accumulator without `reassoc` were the same order but kept it in memory: the decode
# kernel ran 2.2x slower.


@njit(cache=True)
def _sum_f64(row, count):  # pragma: no cover - compiled
    """sum(row[:count]) in float64, in 32 lane sums (`lanes32_sum_f64`; 'One order').
    ggml adds each vector's floats in float32, then those in float64 (the grouping
    differs with its SIMD width); in float64 any order moves the total by ~1e-16 of
    itself, which the float32 reciprocal rarely sees -- rarely is not never, hence one
    order.  A strictly ordered sum does not vectorize (the softmax of 2M scores took
    8.6 ms against 5.5, one thread)."""
    full = count - count % 32
    total = lanes32_sum_f64(row, full // 32)
    for j in range(full, count):
        total += row[j]
    return total


@njit(cache=True, parallel=True, error_model="numpy")
def _causal_softmax_f16(scores, group, q_pos0, scale):  # pragma: no cover - compiled
    """scores `[kv, n*g, ctx]` (row r is query r // group) -> causal f16 softmax, in
    place.

    One pass per row instead of numpy's five (scale, mask, max/exp, normalise, round):
    at n = 256 the numpy version spent ~20 of its 25 ms per layer in those passes."""
    batch, rows, ctx = scores.shape
    for br in prange(batch * rows):
        b, r = br // rows, br % rows
        visible = q_pos0 + r // group + 1                   # keys 0..q_pos0 + i
        _softmax_f16(scores[b, r], visible, scale)
        scores[b, r, visible:] = 0.0


def by_kv_head_f16(x: np.ndarray, n_kv: int) -> np.ndarray:
    """x `[n, heads, d]` -> `[n_kv, n * g, d]` rounded to float16 (g = heads // n_kv):
    the rows that read KV head h, query-major, i.e. x.reshape(n, n_kv, g, d)
    .transpose(1, 0, 2, 3), as one matrix per KV head for BLAS.  One numba pass; numpy's
    rounding and transposed copies took ~4 ms a layer at n = 256."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, heads, d = x.shape
    out = np.empty((n_kv, n * (heads // n_kv), d), np.float32)
    _by_kv_head_f16(x, out)
    return out


@njit(cache=True, parallel=True)
def _by_kv_head_f16(x, out):  # pragma: no cover - compiled
    n, heads, d = x.shape
    n_kv = out.shape[0]
    g = heads // n_kv
    for h in prange(heads):
        kv, j = h // g, h % g
        for i in range(n):
            src, dst = x[i, h], out[kv, i * g + j]
            for c in range(d):
                dst[c] = f16_to_f32(f32_to_f16_bits(src[c]))


@njit(inline="always")
def _dot_f16(qh, k_bits, t, kv):  # pragma: no cover - compiled
    """q . k_t for one cached key in 32 lane sums (`lanes32_dot_f16`; 'One order'),
    products rounded before the add (no FMA), as before.  16 heads x 1024 positions x
    128, one thread: 2.5 ms strictly left to right; 1.25 ms with `reassoc` (LLVM's own
    partial sums: a different sum per SIMD width)."""
    d = qh.shape[0]
    krow = k_bits[t, kv]                                                  # [d] f16 bits
    full = d - d % 32
    s = lanes32_dot_f16(qh, krow, full // 32)
    for j in range(full, d):
        s += qh[j] * f16_to_f32(krow[j])
    return s


@njit(cache=True, parallel=True)
def _decode_f16(q, k_bits, v_bits, ctx, scale, out):  # pragma: no cover - compiled
    """q [H, D] f32; k_bits, v_bits [capacity, KVH, D] uint16 (the f16 cache's bits)."""
    n_heads, d = q.shape
    group = n_heads // k_bits.shape[1]
    for h in prange(n_heads):
        kv = h // group
        qh = _f16_rounded(q[h])                 # q rounded to f16, as ggml does
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
def _decode_q8(q, k_q, k_scale, v_q, v_scale, ctx, scale, out):  # pragma: no cover
    """q [H, D] f32; k_q, v_q [capacity, KVH, D] int8; k_scale, v_scale [capacity, KVH,
    D/B] uint16 (f16 bits): the q8_0 layout of kv_cache.py, B values per block along
    head_dim."""
    n_heads, d = q.shape
    group = n_heads // k_q.shape[1]
    nb = k_scale.shape[2]
    blk = d // nb
    for h in prange(n_heads):
        kv = h // group
        qh = _f16_rounded(q[h])
        probs = np.empty(ctx, np.float32)
        for t in range(ctx):
            s = np.float32(0.0)
            for b in range(nb):
                part = np.float32(0.0)
                for j in range(blk):
                    part += qh[b * blk + j] * np.float32(k_q[t, kv, b * blk + j])
                s += part * f16_to_f32(k_scale[t, kv, b])
            probs[t] = s
        _softmax_f16(probs, ctx, scale)
        acc = np.zeros(d, np.float32)
        for t in range(ctx):
            for b in range(nb):
                ps = probs[t] * f16_to_f32(v_scale[t, kv, b])
                for j in range(blk):
                    acc[b * blk + j] += ps * np.float32(v_q[t, kv, b * blk + j])
        out[h, :] = acc
