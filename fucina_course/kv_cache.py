"""The KV cache: remember every past token's keys and values instead of recomputing
them.

A token's K and V rows never change once computed: the causal mask stops later tokens
from influencing them, and RoPE rotates a key by its own absolute position only.  So
each layer keeps the K and V rows of every position seen so far, and a decode step
computes projections for its one new token and attends over the stored prefix.

Layout.  Per layer, K and V are preallocated `[capacity, kv_heads, head_dim]` arrays,
float16 by default (llama.cpp's default cache type: half the bytes of float32, widened
when read).  K is stored *after* RoPE, so past positions are never re-rotated.  The
active prefix is rows `0 .. len-1`; nothing else is ever read.

Write contract (what makes a model port correct):
1. `append_layer(layer, k, v)` writes the step's rows at `len` and does NOT advance:
   every layer of the step appends at the same base offset.
2. `advance(n)` runs once per step, after the last layer.
3. `truncate(keep)` rewinds: every reader and writer addresses rows through `len`, so
   lowering `len` is the whole operation (stale rows beyond it are overwritten by the
   next append).

q8_0 mode stores each (position, head) row as head_dim/32 blocks of 32 int8 values
sharing one float16 scale (34 bytes per 32 values instead of 64): a capacity lever.  It
reads fewer bytes per step, but its decode kernel (attention.py `_decode_q8`) sums each
block in strict order where the float16 kernel may reassociate, and at 16K positions it
measured slower than f16, at short context no faster (measured:
docs/BENCHMARKS.md#kv-cache-q8-speed).  It needs head_dim % 32 == 0, so a block never
straddles two positions and `truncate` stays one line.  This module is the only place
that writes that layout; readers get it through `read` (float32 copies, for prefill) or
`layer_view` (the arrays themselves, for the decode kernel in attention.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from . import quant
from .errors import FucinaError, KvCacheHeadDimNotBlockAligned, KvCacheOverflow
from .quant._intrinsics import f16_to_f32, f32_to_f16_bits

CACHE_TYPES = ("f16", "q8_0")
Q8_BLOCK = quant.block_geometry(T.Q8_0)[0]          # 32 values share one f16 scale


class KvView(NamedTuple):
    """What the decode kernel reads of one layer, zero-copy.

    f16 cache: `k`, `v` are the uint16 bit patterns `[capacity, kv_heads, head_dim]` and
    the scales are None.  q8_0 cache: `k`, `v` are int8 `[capacity, kv_heads, head_dim]`
    and `k_scale`, `v_scale` the f16 bits (uint16) `[capacity, kv_heads, head_dim /
    32]`. Positions `0 .. length-1` are valid."""

    k: np.ndarray
    v: np.ndarray
    k_scale: np.ndarray | None
    v_scale: np.ndarray | None
    length: int


def quantize_q8_0_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 `[..., d]` -> (int8 `[..., d]`, float16 scales `[..., d/32]`): ggml's
    q8_0 rule, the very quantizer the matmul kernels use for activations (scale = max|x|
    / 127)."""
    qa = quant.quantize_activations(x.reshape(-1, x.shape[-1]), T.Q8_0)
    return qa.qi.reshape(x.shape), qa.d.astype(np.float16).reshape(*x.shape[:-1], -1)


def dequantize_q8_0_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The inverse of `quantize_q8_0_rows` (up to its rounding): float32 `[..., d]`."""
    blocks = q.reshape(*q.shape[:-1], -1, Q8_BLOCK).astype(np.float32)  # [.., d/32, 32]
    return (blocks * scale.astype(np.float32)[..., None]).reshape(q.shape)


def store_f16(out: np.ndarray, x: np.ndarray) -> None:
    """out (a C-contiguous float16 array) = x (float32) rounded to the nearest half.

    `out[...] = x` does the same through numpy's conversion, which has no SIMD path on
    x86 without AVX512-FP16: 4 ms per million values here, against 0.3 ms for this
    loop (LLVM's `fptrunc`, `vcvtps2ph`), i.e. 1.5 ms a layer of a 256-token prefill."""
    if not out.flags.c_contiguous or out.dtype != np.float16:
        raise ValueError("store_f16 writes into a C-contiguous float16 array")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != out.shape:
        raise ValueError(f"store_f16: shapes {x.shape} and {out.shape} differ")
    _narrow(x.reshape(-1), out.reshape(-1).view(np.uint16))


def load_f16(h: np.ndarray) -> np.ndarray:
    """A float32 copy of the float16 array h (numpy's `astype`, without SIMD: see
    `store_f16`)."""
    h = np.ascontiguousarray(h)
    out = np.empty(h.shape, np.float32)
    _widen(h.reshape(-1).view(np.uint16), out.reshape(-1))
    return out


@njit(cache=True)
def _narrow(x, bits):  # pragma: no cover - compiled
    for j in range(x.shape[0]):
        bits[j] = f32_to_f16_bits(x[j])


@njit(cache=True)
def _widen(bits, out):  # pragma: no cover - compiled
    for j in range(bits.shape[0]):
        out[j] = f16_to_f32(bits[j])


class KvCache:
    """Per-layer K/V storage of one sequence (the module docstring has the contract)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 cache_type: str = "f16"):
        if cache_type not in CACHE_TYPES:
            raise FucinaError(f"unknown cache type {cache_type!r} "
                              f"(use one of {', '.join(CACHE_TYPES)})")
        if cache_type == "q8_0" and head_dim % Q8_BLOCK:
            raise KvCacheHeadDimNotBlockAligned(
                f"a q8_0 KV cache needs head_dim to be a multiple of {Q8_BLOCK}; "
                f"this model has {head_dim}")
        if capacity <= 0:
            raise FucinaError(f"KV cache capacity must be positive, got {capacity}")
        self.cache_type, self.capacity, self.len = cache_type, capacity, 0
        rows = (capacity, num_kv_heads, head_dim)
        blocks = (capacity, num_kv_heads, head_dim // Q8_BLOCK)
        element = np.float16 if cache_type == "f16" else np.int8

        def per_layer(shape, dtype):
            return [np.zeros(shape, dtype) for _ in range(num_layers)]

        quantized = cache_type == "q8_0"
        # per layer: [capacity, kv_heads, head_dim] (K after RoPE), and for q8_0 the
        # f16 scale of every 32 values, [capacity, kv_heads, head_dim / 32]
        self.k = per_layer(rows, element)
        self.v = per_layer(rows, element)
        self.k_scale = per_layer(blocks, np.float16) if quantized else None
        self.v_scale = per_layer(blocks, np.float16) if quantized else None

    @classmethod
    def for_config(cls, config, capacity: int, cache_type: str = "f16") -> "KvCache":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, capacity,
                   cache_type)

    @property
    def remaining(self) -> int:
        return self.capacity - self.len

    @property
    def nbytes(self) -> int:
        arrays = self.k + self.v + (self.k_scale + self.v_scale if self.k_scale else [])
        return sum(a.nbytes for a in arrays)

    def check_room(self, n: int) -> None:
        if self.len + n > self.capacity:
            raise KvCacheOverflow(f"KV cache overflow: {self.len} positions used + {n} "
                                  f"new > capacity {self.capacity}")

    def append_layer(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write `[n, kv_heads, head_dim]` rows at len..len+n-1 (does not advance)."""
        n = k.shape[0]
        self.check_room(n)
        rows = slice(self.len, self.len + n)
        if self.k_scale is None:
            store_f16(self.k[layer][rows], k)  # as self.k[layer][rows] = k, but faster
            store_f16(self.v[layer][rows], v)
        else:
            self.k[layer][rows], self.k_scale[layer][rows] = quantize_q8_0_rows(k)
            self.v[layer][rows], self.v_scale[layer][rows] = quantize_q8_0_rows(v)

    def read(self, layer: int, upto: int) -> tuple[np.ndarray, np.ndarray]:
        """K, V of positions 0..upto-1: float32 copies `[upto, kv_heads, head_dim]`."""
        if self.k_scale is None:
            return load_f16(self.k[layer][:upto]), load_f16(self.v[layer][:upto])
        return (dequantize_q8_0_rows(self.k[layer][:upto], self.k_scale[layer][:upto]),
                dequantize_q8_0_rows(self.v[layer][:upto], self.v_scale[layer][:upto]))

    def layer_view(self, layer: int, upto: int) -> KvView:
        """Layer `layer`'s storage as the decode kernel reads it (no copy: `KvView`)."""
        if self.k_scale is None:
            return KvView(self.k[layer].view(np.uint16), self.v[layer].view(np.uint16),
                          None, None, upto)
        return KvView(self.k[layer], self.v[layer], self.k_scale[layer].view(np.uint16),
                      self.v_scale[layer].view(np.uint16), upto)

    def advance(self, n: int) -> None:
        """Commit a step's n positions; call once, after every layer has appended."""
        self.check_room(n)
        self.len += n

    def truncate(self, keep: int) -> None:
        """Rewind to the first `keep` positions (no-op if the cache holds fewer).

        Only the length changes: the rows past `keep` keep their keys and values
        until a later append overwrites them, so `advance` can take them back.
        Speculative decoding relies on it (chat.Conversation.verify / accept): a
        verify step writes every guess, the cache is cut after the chosen token,
        and each accepted guess is re-committed without being computed again."""
        if keep < self.len:
            self.len = max(0, keep)

    def copy_from(self, other: "KvCache", n: int) -> None:
        """Hold positions 0..n-1 of `other` (same layers, heads, head_dim and cache
        type) and nothing else: one array copy per layer instead of a prefill that
        computes the same rows again (the server's n choices of one prompt).  `len`
        is 0 until every layer is copied, then `n`."""
        same = (other.cache_type == self.cache_type and len(other.k) == len(self.k)
                and other.k[0].shape[1:] == self.k[0].shape[1:])
        if not same:
            raise FucinaError("copy_from: the two KV caches differ in geometry or type")
        if not 0 <= n <= min(other.len, self.capacity):
            raise KvCacheOverflow(f"copy_from: {n} positions asked, the source holds "
                                  f"{other.len} and the capacity is {self.capacity}")
        self.len = 0
        pairs = [(self.k, other.k), (self.v, other.v)]
        if self.k_scale is not None:
            pairs += [(self.k_scale, other.k_scale), (self.v_scale, other.v_scale)]
        for mine, theirs in pairs:
            for layer in range(len(mine)):
                mine[layer][:n] = theirs[layer][:n]       # [n, kv_heads, head_dim(/32)]
        self.len = n


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two id lists: the positions of a cache
    holding `a` that a sequence `b` can keep (chat turns, server slots, draft models)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_fits(positions: int, capacity: int) -> bool:
    """Whether a prompt that fills `positions` cache positions (kept + new) leaves room
    to answer: the first answer token is chosen from the last prompt position's logits
    and needs a position of its own to be fed back, so a prompt needs one more position
    than it has tokens.  The one statement of that rule (chat turns, the scheduler's
    jobs, the server's early checks)."""
    return positions + 1 <= capacity
