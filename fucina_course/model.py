"""The transformer: embedding -> N x (attention block + FFN block) -> final norm -> lm_head.

One forward function serves every entry point; they differ only in which rows they feed, which
KV caches they read and write, and which logits they return:

| entry                      | input                         | cache        | returns                 |
|----------------------------|-------------------------------|--------------|-------------------------|
| `forward_step`             | n tokens at pos0 (prefill/decode) | one, len == pos0 | last position's logits |
| `forward_step_all_logits`  | n tokens at pos0              | one          | logits of all n positions |
| `forward_last_logits`      | a whole sequence              | none (oracle) | last position's logits |
| `forward_step_batch`       | one token for each of N streams | N caches   | `[N, vocab]`            |

Per layer, in code order (Qwen3; the relatives differ by the config flags of `config.py`):

    h = rmsnorm(x) ; q, k, v = h Wq, h Wk, h Wv (+ bias for qwen2)
    q, k = per-head rmsnorm (qwen3) ; q, k = rope(q, k, positions)
    x = x + attention(q, K_cache, V_cache) Wo          # residual add
    h = rmsnorm(x) ; x = x + (silu(h Wgate) * h Wup) Wdown

Nothing connects the layers except the residual stream `x` `[seq, hidden]`: each block reads it
through a norm and adds its contribution back.

Where the time goes (bench/profile_step.py; docs/BENCHMARKS.md has the tables).  Decode, one
token: the matrix x vector products stream every weight byte once, ~90% of the step (Qwen3-0.6B
geometry, Q8_0: 604 MiB per token, ~53 ms at ~12 GB/s); attention over a short cache, norms and RoPE
are the rest.  Prefill multiplies matrices by `[n, hidden]` activations and is compute bound (the
FFN alone ~half of a 256-token prefill, attention ~15-20%).  `Model.profile` (a dict, off by default)
accumulates seconds per stage to show it.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import Config
from .errors import FucinaError, InvalidSequenceLength, ShapeMismatch, TokenizerError
from .gguf_file import GGUFFile
from .kv_cache import KvCache
from .ops import apply_rope, causal_attention, decode_attention, rms_norm, rope_angles, swiglu
from .weights import FusedLinear, LinearWeight


@dataclass
class Layer:
    attn_norm: np.ndarray
    qkv: FusedLinear
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    attn_out: LinearWeight
    ffn_norm: np.ndarray
    gate_up: FusedLinear
    down: LinearWeight


@dataclass
class _Segment:
    """Rows `start:stop` of a step belong to one sequence, with its cache and first position."""

    start: int
    stop: int
    pos0: int
    cache: KvCache | None


class Model:
    def __init__(self, gguf: GGUFFile, config: Config, tokenizer, embedding: LinearWeight,
                 layers: list[Layer], output_norm: np.ndarray, output: LinearWeight):
        self.gguf, self.config, self.tokenizer = gguf, config, tokenizer
        self.embedding, self.layers, self.output_norm, self.output = embedding, layers, output_norm, output
        self.profile: dict[str, float] | None = None

    # --- loading --------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, threads: int | None = None) -> "Model":
        """Open a GGUF file, read its config and tokenizer, map its weights.

        A model *name* (`"qwen2.5-coder-0.5b"`) is resolved to a path by `catalog.load_model`."""
        from .tokenizer import Tokenizer

        if threads:
            set_threads(threads)
        gguf = GGUFFile(path)
        cfg = Config.from_gguf(gguf)
        if cfg.num_experts:
            raise FucinaError(f"{gguf.path}: mixture-of-experts models ({cfg.arch}) are not supported by this engine yet")
        tokenizer = Tokenizer.from_gguf(gguf) if gguf.has("tokenizer.ggml.tokens") else None

        def vec(name: str, n: int) -> np.ndarray:
            t = gguf.tensor(name)
            if t.ggml_type.name != "F32" or t.n_elements != n:
                raise ShapeMismatch(f"tensor {name!r} should be {n} float32 values, is {t.type_name} {t.shape}")
            return t.data.view(np.float32)

        def linear(name: str, n_out: int, n_in: int, bias: bool = False) -> LinearWeight:
            b = vec(name.replace(".weight", ".bias"), n_out) if bias else None
            return LinearWeight(gguf.tensor(name), b).expect(n_out, n_in)

        h, qd, kvd = cfg.hidden_size, cfg.q_dim, cfg.kv_dim
        embedding = linear("token_embd.weight", cfg.vocab_size, h)
        # Tied output: without output.weight the embedding table is the lm_head (same object).
        output = linear("output.weight", cfg.vocab_size, h) if "output.weight" in gguf.tensors else embedding
        layers = []
        for i in range(cfg.num_layers):
            b = f"blk.{i}."
            layers.append(Layer(
                attn_norm=vec(b + "attn_norm.weight", h),
                qkv=FusedLinear([linear(b + "attn_q.weight", qd, h, cfg.qkv_bias),
                                 linear(b + "attn_k.weight", kvd, h, cfg.qkv_bias),
                                 linear(b + "attn_v.weight", kvd, h, cfg.qkv_bias)]),
                q_norm=vec(b + "attn_q_norm.weight", cfg.head_dim) if cfg.qk_norm else None,
                k_norm=vec(b + "attn_k_norm.weight", cfg.head_dim) if cfg.qk_norm else None,
                attn_out=linear(b + "attn_output.weight", h, qd),
                ffn_norm=vec(b + "ffn_norm.weight", h),
                gate_up=FusedLinear([linear(b + "ffn_gate.weight", cfg.intermediate_size, h),
                                     linear(b + "ffn_up.weight", cfg.intermediate_size, h)]),
                down=linear(b + "ffn_down.weight", h, cfg.intermediate_size),
            ))
        return cls(gguf, cfg, tokenizer, embedding, layers, vec("output_norm.weight", h), output)

    @property
    def path(self) -> Path:
        return self.gguf.path

    def new_cache(self, capacity: int | None = None, cache_type: str = "f16") -> KvCache:
        """A KV cache for one sequence (default capacity: min(context length, 4096))."""
        return KvCache.for_config(self.config, capacity or min(self.config.context_length, 4096), cache_type)

    # --- entry points ---------------------------------------------------------------------------

    def forward_step(self, ids, pos0: int, cache: KvCache) -> np.ndarray:
        """Run `ids` at positions pos0.. through the model, appending to `cache`; last logits `[vocab]`.

        With a fresh cache and pos0 == 0 this is prefill, and the result equals
        `forward_last_logits(ids)` (the cacheless oracle) up to float16 rounding of cached K/V.
        """
        return self._forward(self._ids(ids), [_Segment(0, len(ids), pos0, self._check_cache(cache, pos0, len(ids)))],
                             last_only=True)[0]

    def forward_step_all_logits(self, ids, pos0: int, cache: KvCache) -> np.ndarray:
        """Like `forward_step`, but logits for every appended position: `[n, vocab]`.

        This is the verify step of speculative decoding: n positions checked for about the
        weight traffic of one step.
        """
        return self._forward(self._ids(ids), [_Segment(0, len(ids), pos0, self._check_cache(cache, pos0, len(ids)))],
                             last_only=False)

    def forward_last_logits(self, ids) -> np.ndarray:
        """Cacheless: the whole sequence from scratch; last position's logits `[vocab]`."""
        ids = self._ids(ids)
        return self._forward(ids, [_Segment(0, len(ids), 0, None)], last_only=True)[0]

    def forward_step_batch(self, ids, caches: list[KvCache]) -> np.ndarray:
        """One new token for each of N independent streams in one pass: `[N, vocab]`.

        The weights are read once for all N rows (the batch-decode bandwidth win); RoPE positions,
        KV appends and attention are per stream.
        """
        ids = self._ids(ids)
        if len(ids) != len(caches):
            raise FucinaError(f"{len(ids)} tokens for {len(caches)} streams")
        segments = [_Segment(i, i + 1, c.len, self._check_cache(c, c.len, 1)) for i, c in enumerate(caches)]
        return self._forward(ids, segments, last_only=False)

    def generate(self, prompt_ids, max_new_tokens: int, *, stop_ids=None, cache: KvCache | None = None,
                 on_token=None) -> list[int]:
        """Greedy generation: prefill the prompt, then argmax one token at a time.

        Stops after `max_new_tokens`, at a stop id (default: the tokenizer's end-of-turn ids;
        the stop token is included in the result), or when the cache is full.
        """
        prompt_ids = list(prompt_ids)
        if stop_ids is None:
            stop_ids = set(self.tokenizer.eot_ids) if self.tokenizer else set()
        if cache is None:
            cache = self.new_cache(min(self.config.context_length, len(prompt_ids) + max_new_tokens))
        out: list[int] = []
        if max_new_tokens <= 0:
            return out
        logits = self.forward_step(prompt_ids, cache.len, cache)
        while True:
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if on_token:
                on_token(nxt)
            if nxt in stop_ids or len(out) >= max_new_tokens or cache.remaining < 1:
                return out
            logits = self.forward_step([nxt], cache.len, cache)

    # --- the forward pass -----------------------------------------------------------------------

    def _ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise FucinaError("a forward step needs at least one token")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise TokenizerError(f"token id {int(bad[0])} is outside the vocabulary (size {self.config.vocab_size})")
        return arr

    def _check_cache(self, cache: KvCache, pos0: int, n: int) -> KvCache:
        if cache.len != pos0:
            raise InvalidSequenceLength(
                f"forward step at position {pos0}, but the KV cache holds {cache.len} positions "
                "(pos0 must equal the cache length)")
        cache.check_room(n)
        return cache

    def _timed(self, stage: str):
        """A context that adds its wall time to `self.profile[stage]`; free when profiling is off."""
        return _NO_PROFILE if self.profile is None else _StageTimer(self.profile, stage)

    def _forward(self, ids: np.ndarray, segments: list[_Segment], last_only: bool) -> np.ndarray:
        cfg = self.config
        n, H, KVH, D = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, scale = cfg.rms_norm_eps, 1.0 / np.sqrt(D)
        with self._timed("embedding"):
            x = self.embedding.rows(ids)                                               # [n, hidden]
            positions = np.concatenate([np.arange(s.pos0, s.pos0 + s.stop - s.start) for s in segments])
            cos, sin = rope_angles(positions, D, cfg.rope_theta)                       # [n, D/2] each
        for li, layer in enumerate(self.layers):
            with self._timed("attn_norm+qkv"):
                h = rms_norm(x, layer.attn_norm, eps)
                q, k, v = layer.qkv(h)                                                  # [n, H*D], [n, KVH*D] x2
            with self._timed("qk_norm+rope"):
                q = q.reshape(n, H, D)                                                  # [n, H, D]
                k = k.reshape(n, KVH, D)                                                # [n, KVH, D]
                v = v.reshape(n, KVH, D)
                if layer.q_norm is not None:
                    q = rms_norm(q, layer.q_norm, eps)
                    k = rms_norm(k, layer.k_norm, eps)
                q = apply_rope(q, cos, sin, cfg.rope_style)
                k = apply_rope(k, cos, sin, cfg.rope_style)
            with self._timed("attention"):
                attn = np.empty((n, H * D), dtype=np.float32)                           # [n, H*D]
                for s in segments:
                    rows = slice(s.start, s.stop)
                    if s.cache is None:
                        attn[rows] = causal_attention(q[rows], k[rows], v[rows], s.pos0, scale)
                        continue
                    s.cache.append_layer(li, k[rows], v[rows])
                    ctx = s.pos0 + s.stop - s.start
                    if s.stop - s.start == 1:  # decode: one query, read the cache in place
                        attn[s.start] = decode_attention(q[s.start], s.cache, li, ctx, scale)
                    else:
                        keys, values = s.cache.layer_kv(li, ctx)                        # [ctx, KVH, D]
                        attn[rows] = causal_attention(q[rows], keys, values, s.pos0, scale)
            with self._timed("attn_out"):
                x = x + layer.attn_out(attn)                                            # residual add
            if last_only and li == len(self.layers) - 1 and n > 1:
                x = x[-1:]  # only the last row feeds the logits: skip the FFN for the others
            with self._timed("ffn"):
                h = rms_norm(x, layer.ffn_norm, eps)
                gate, up = layer.gate_up(h)                                             # [n, ffn] x2
                x = x + layer.down(swiglu(gate, up))                                    # residual add
        for s in segments:
            if s.cache is not None:
                s.cache.advance(s.stop - s.start)
        with self._timed("lm_head"):
            if last_only:
                x = x[-1:]
            return self.output(rms_norm(x, self.output_norm, eps))                     # [rows, vocab]


class _StageTimer:
    __slots__ = ("profile", "stage", "start")

    def __init__(self, profile: dict, stage: str):
        self.profile, self.stage = profile, stage

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.profile[self.stage] = self.profile.get(self.stage, 0.0) + time.perf_counter() - self.start


_NO_PROFILE = nullcontext()


def set_threads(threads: int) -> None:
    """Worker threads for the numba kernels (BLAS reads OPENBLAS_NUM_THREADS at import)."""
    import numba

    numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
