"""One decode step without the interpreter in between: model.py's forward pass for a
single token, run as a fixed list of kernel calls into buffers made once.

Why.  A decode step of a small model is short, and Python's share of it is not.
SmolLM2-135M at avx2 (30 layers, 2026-12-01, docs/BENCHMARKS.md): ~12 ms a token, of
which the matrix kernels take ~8; the rest, ~120 us a layer, is the Python around
them.  Each of model.py's operations checks its arguments, allocates its output,
reshapes and slices (np.empty alone ~0.7 us on this VM), and between two operations
the streamed weights evict the interpreter's working set, so each costs 3-4x its
hot-loop time.  llama.cpp, all C, pays none of it.

What it does.  `Decoder` resolves once, per layer, what model.py looks up on every
call: each matrix's kernel and its arguments (`quant.bound_matvec`), the norm weights,
the output buffers and the views into them.  `step` then makes, in model.py's order,
the same kernel calls with the same inputs: per layer RMSNorm, the q/k/v product(s)
(+ bias), the per-head q/k norms, RoPE, the cache append, decode attention, the output
projection and the residual add, then RMSNorm, the FFN and the residual add.  The RoPE
angles come from a table filled 256 positions at a time (`rope_angles` of one position
cost ~100 us, once per step).  Same-process A/B at avx2, the two paths alternating,
20 rounds of 16 tokens, model.py's time over this one: SmolLM2 1.26x, Qwen2.5-Coder
1.16x (docs/BENCHMARKS.md, "2026-12-01, Ice Lake, night").

Invariant: the logits and the cache contents are model.py's bit for bit (the same
kernels on the same numbers; an in-place residual add rounds as `x + y` does).
model.py stays the definition, the one the book reads; this is its schedule for one
token, as ggml's compute graph is llama.cpp's.  tests/test_decode.py compares the two
for every family, tied and untied output, q/k/v of mixed formats, biases, MoE, f16
and q8_0 caches and every integer level.  It talks to the cache only through the
cache contract (`append_layer`, `layer_view`, `advance`; kv_cache.py), so any cache
that honours it works, as with model.py.

No new compiled code: every kernel is one model.py already compiles, called with the
same argument types (a new numba signature would cost the first start ~0.3 s each).
Rejected: the whole layer as one numba function (numba compiles `run`'s parallel
region again inside any caller: +2.6 s on a cold start, docs/BENCHMARKS.md).

`Model.forward_step` uses it for one token, unless `fast_decode` is off, `profile` or
`check_numerics` asks for model.py's per-stage view, or another thread is using the
buffers (then model.py's path runs: the same numbers).  Prefill and batch decode
always take model.py: there one call works on many rows, and the Python is noise.
"""

from __future__ import annotations

import threading

import numpy as np

from .attention import decode_attention
from .errors import NonFiniteValues
from .moe import MoeFfn
from .ops import _rms_norm_rows, _rope, _swiglu_one, rope_angles
from .quant import bound_matvec, isa
from . import validate

ROPE_BLOCK = 256    # positions per RoPE table block


class _Linear:
    """A `FusedLinear` or `LinearWeight` as kernel calls into slices of one buffer:
    (call, output slice, bias or None) per group of parts."""

    def __init__(self, fused_or_linear, out: np.ndarray):
        groups = getattr(fused_or_linear, "groups", None)
        if groups is None:                  # one LinearWeight
            pairs = [(fused_or_linear.matrix, fused_or_linear.bias)]
        else:
            pairs = [(g.matrix, g.bias) for g in groups]
        self.calls, start = [], 0
        for matrix, bias in pairs:
            view = out[start:start + matrix.n_out]
            self.calls.append((bound_matvec(matrix), view, bias))
            start += matrix.n_out
        assert start == out.shape[0]

    def __call__(self, x: np.ndarray) -> None:
        for call, view, bias in self.calls:
            call(x, view)
            if bias is not None:
                view += bias


class _LayerPlan:
    """One layer's weights and buffers, ready for `Decoder.step`."""

    def __init__(self, layer, buf):
        self.attn_norm, self.ffn_norm = layer.attn_norm, layer.ffn_norm
        self.q_norm, self.k_norm = layer.q_norm, layer.k_norm
        self.qkv = _Linear(layer.qkv, buf.qkv)
        self.attn_out = _Linear(layer.attn_out, buf.o)
        self.moe = layer.ffn if isinstance(layer.ffn, MoeFfn) else None
        if self.moe is None:
            self.gate_up = _Linear(layer.ffn.gate_up, buf.gate_up)
            self.down = _Linear(layer.ffn.down, buf.down)


class _Buffers:
    """Every intermediate of a step, allocated once (shapes of model.py's, 1 row)."""

    def __init__(self, cfg):
        H, KVH, D, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        qd, kvd = H * D, KVH * D
        self.h = np.empty((1, hid), np.float32)             # a norm's output
        self.qkv = np.empty(qd + 2 * kvd, np.float32)       # q | k | v
        self.qk = self.qkv[:qd + kvd].reshape(1, H + KVH, D)  # q and k heads
        self.v = self.qkv[qd + kvd:].reshape(1, KVH, D)
        # qwen3's per-head norms write q's heads, then k's, into one array, so that
        # one RoPE call turns both (the same per-head arithmetic as two calls)
        self.qk_normed = np.empty((1, H + KVH, D), np.float32)
        self.q_normed, self.k_normed = self.qk_normed[0, :H], self.qk_normed[0, H:]
        self.qk_rot = np.empty((1, H + KVH, D), np.float32)  # after RoPE
        self.q_rot, self.k_rot = self.qk_rot[0, :H], self.qk_rot[:, H:]
        self.att = np.empty((H, D), np.float32)             # attention's output
        self.att_row = self.att.reshape(1, qd)
        self.o = np.empty(hid, np.float32)                  # attn_output's
        self.o_row = self.o.reshape(1, hid)
        ffn = cfg.intermediate_size
        self.gate_up = np.empty(2 * ffn, np.float32)        # gate | up
        self.gate, self.up = self.gate_up[:ffn], self.gate_up[ffn:]
        self.act = np.empty((1, ffn), np.float32)           # silu(gate) * up
        self.down = np.empty(hid, np.float32)
        self.down_row = self.down.reshape(1, hid)


class Decoder:
    """A model's one-token step as a fixed schedule of kernel calls (module docstring).
    Built for the `isa.level` current when it was made (`current`)."""

    def __init__(self, model):
        cfg = model.config
        self.model, self.cfg, self.level = model, cfg, isa.level
        self.lock = threading.Lock()        # the buffers serve one step at a time
        self.buf = _Buffers(cfg)
        self.layers = [_LayerPlan(layer, self.buf) for layer in model.layers]
        self.lm_head = bound_matvec(model.output.matrix)
        self.lm_head_bias = model.output.bias
        self.eps = np.float32(cfg.rms_norm_eps)
        self.scale = 1.0 / np.sqrt(cfg.head_dim)   # model.py's, to the bit
        self.neox = cfg.rope_style == "neox"
        self.heads = cfg.num_heads          # q's heads, then k's, in b.qk
        if cfg.rope_style not in ("neox", "normal"):
            raise ValueError(f"unknown RoPE style {cfg.rope_style!r}")
        self._rope_table: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def current(self) -> bool:
        """False once `isa.level` has changed (its kernels are the old level's)."""
        return self.level == isa.level

    def rope(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin `[1, head_dim/2]` of position pos: rows of `ops.rope_angles` over a
        block of ROPE_BLOCK positions (each row depends on its position alone)."""
        block = pos // ROPE_BLOCK
        table = self._rope_table.get(block)
        if table is None:
            first = block * ROPE_BLOCK
            table = rope_angles(np.arange(first, first + ROPE_BLOCK), self.cfg.head_dim,
                                self.cfg.rope_theta)
            self._rope_table[block] = table
        r = pos - block * ROPE_BLOCK
        return table[0][r:r + 1], table[1][r:r + 1]

    def step(self, token: int, pos0: int, cache) -> np.ndarray:
        """model.forward_step([token], pos0, cache): the logits `[vocab]`.  The caller
        has checked the token and the cache (pos0 == cache.len, room for one)."""
        stage = "embedding"
        try:
            x = self.model.embedding.rows([token])                   # [1, hidden]
            stage = "attention"
            rotation = self.rope(pos0)                               # cos, sin
            for i, layer in enumerate(self.layers):
                self._attention(layer, x, i, pos0, rotation, cache)  # x += attention
                stage = "ffn"
                self._ffn(layer, x)                                  # x += FFN
                stage = "attention"
            cache.advance(1)
            stage = "lm_head"
            b = self.buf
            _rms_norm_rows(x, self.model.output_norm, self.eps, b.h)
            logits = np.empty(self.cfg.vocab_size, np.float32)
            self.lm_head(b.h, logits)
            if self.lm_head_bias is not None:
                logits += self.lm_head_bias
        except (ZeroDivisionError, FloatingPointError):
            raise NonFiniteValues(f"{self.model.path}: the activations went non-finite "
                                  f"in the {stage} stage (broken weights or config; "
                                  "check_numerics=True names the layer)") from None
        return validate.check_logits(logits, self.model.path)

    def _attention(self, layer: _LayerPlan, x, i: int, pos0: int, rotation,
                   cache) -> None:
        """model.attention_block for one row, added to x in place."""
        b, eps = self.buf, self.eps
        _rms_norm_rows(x, layer.attn_norm, eps, b.h)
        layer.qkv(b.h)                                        # b.qk, b.v (+ bias)
        qk = b.qk
        if layer.q_norm is not None:                          # per head (qwen3)
            _rms_norm_rows(qk[0, :self.heads], layer.q_norm, eps, b.q_normed)
            _rms_norm_rows(qk[0, self.heads:], layer.k_norm, eps, b.k_normed)
            qk = b.qk_normed
        _rope(qk, *rotation, self.neox, b.qk_rot)             # b.q_rot, b.k_rot
        cache.append_layer(i, b.k_rot, b.v)
        decode_attention(b.q_rot, cache.layer_view(i, pos0 + 1), self.scale, b.att)
        layer.attn_out(b.att_row)                             # b.o
        x += b.o_row

    def _ffn(self, layer: _LayerPlan, x) -> None:
        """model.ffn_block for one row, added to x in place."""
        b = self.buf
        _rms_norm_rows(x, layer.ffn_norm, self.eps, b.h)
        if layer.moe is not None:
            x += layer.moe(b.h)                               # [1, hidden]
            return
        layer.gate_up(b.h)                                    # b.gate, b.up
        _swiglu_one(b.gate, b.up, b.act)
        layer.down(b.act)                                     # b.down
        x += b.down_row
