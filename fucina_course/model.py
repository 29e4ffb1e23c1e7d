"""The transformer: embedding -> N x (attention + FFN block) -> final norm -> lm_head.

Per layer, in code order (`attention_block`, `ffn_block`):

    h = rmsnorm(x) ; q, k, v = h Wq, h Wk, h Wv            (+ bias: qwen2)
    q, k = per-head rmsnorm(q), rmsnorm(k)                  (qwen3)
    q, k = rope(q, positions), rope(k, positions)
    x = x + attention(q, K_cache + k, V_cache + v) Wo       # residual add
    h = rmsnorm(x) ; x = x + ffn(h)                         # residual add

where `ffn` is decided once, at load, by the family: a dense SwiGLU
`(silu(h Wgate) * h Wup) Wdown` (`DenseFfn`), or a router choosing k of E such FFNs per
token (`moe.MoeFfn`, qwen3moe).  Both are called the same way, so `ffn_block` does not
know which it runs.

Nothing connects the layers except the residual stream `x` `[seq, hidden]`: each block
reads it through a norm and adds its contribution back.  Which tensors a layer has (so
which steps run: q/k norms, biases, experts) is the family's table (families.py).

The blocks write every intermediate into a workspace of buffers made once
(workspace.py), for a prompt as for a single decoded token: there is one forward pass.
A decode step's kernel calls are recorded from the blocks once and replayed (tape.py),
so decode pays neither allocation nor interpretation between its kernels (chapter 07
measures both).

One forward function serves every entry point; they differ in which rows they feed,
which KV caches they read and write, and which logits they return:

| entry                     | input                | cache        | returns         |
|---------------------------|----------------------|--------------|-----------------|
| `forward_step`            | n tokens at pos0     | one, len==p0 | last logits     |
| `forward_step_all_logits` | n tokens at pos0     | one          | logits of all n |
| `forward_last_logits`     | a whole sequence     | scratch      | last logits     |
| `forward_all_logits`      | a whole sequence     | scratch      | logits of all n |
| `forward_step_batch`      | 1 token per stream   | N caches     | `[N, vocab]`    |

`per_row=True` computes every row exactly as a one-token decode step would (the decode
kernels, one row at a time): slower for long prompts, but bit-identical to decode.  That
is the cache oracle's like-for-like comparison (oracles.py, `fucina verify-cache`).
Without it, prefill takes the fastest kernels for its shape and differs from decode in
the last bits, which quantized activations amplify (llama.cpp's prefill and decode
differ the same way).

Where the time goes (bench/profile_step.py; tables in docs/BENCHMARKS.md): a decode step
is ~90% matrix x vector products that stream every weight byte once (Qwen3-0.6B
geometry, Q8_0: 604 MiB per token, ~53 ms at ~12 GB/s); prefill multiplies matrices by
`[n, hidden]` rows and is compute bound (the FFN alone ~half of a 256-token prefill,
attention ~15-20%).  `Model.profile` (a dict, off by default) accumulates seconds per
block to show it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from pathlib import Path

import numpy as np

from .attention import Segment, attend
from .config import Config
from .errors import (FucinaError, InvalidSequenceLength, NonFiniteValues, TapeMismatch,
                     TokenizerError)
from .gguf_file import GGUFFile
from .kv_cache import KvCache
from .ffn import DenseFfn
from .moe import MoeFfn, check_top_p, load_moe_ffn
from .ops import RopeTable, apply_rope, rms_norm
from . import generation, validate
from .quant import isa
from .tape import Tape, Watched
from .weights import FusedLinear, LinearWeight, WeightReader
from .workspace import NO_WORKSPACE, Workspace


@dataclass
class Layer(Watched):
    """One block's weights, GGUF tensors `blk.{i}.*`; matrices are [out, in].
    (`Watched`: assigning an attribute makes a recorded decode step stale.)"""

    attn_norm: np.ndarray        # [hidden]
    qkv: FusedLinear             # Wq [H*D, hidden]; Wk, Wv [KVH*D, hidden]
    q_norm: np.ndarray | None    # [D] (qwen3 only)
    k_norm: np.ndarray | None    # [D] (qwen3 only)
    attn_out: LinearWeight       # Wo [hidden, H*D]
    ffn_norm: np.ndarray         # [hidden]
    ffn: DenseFfn | MoeFfn       # h [n, hidden] -> [n, hidden]


@dataclass
class Step:
    """What one forward call needs besides the weights."""

    segments: list[Segment]      # which rows are which sequence, with its cache
    cos: np.ndarray              # [n, D/2] RoPE angles of each row's position
    sin: np.ndarray              # [n, D/2]
    per_row: bool = False        # compute each row exactly as a decode step would
    workspace: Workspace | None = None   # buffers for up to n rows (workspace.py)
    buffers: SimpleNamespace = field(default_factory=lambda: NO_WORKSPACE)  # the n rows'
    scale: float | None = None   # attention's 1 / sqrt(head_dim) (None: from q)
    matmul_path: str = field(init=False)  # how a matrix meets several rows (weights.py)
    stage: str = "embedding"     # what is running (named if it fails)

    def __post_init__(self):
        self.matmul_path = "rows" if self.per_row else "auto"  # as decode would, or fastest

    def keep_last_row(self) -> None:
        """From here on the step computes its last row only: its buffers' first row."""
        if self.workspace is not None:
            self.buffers = self.workspace.view(1)


def attention_block(layer: Layer, x: np.ndarray, cfg: Config, step: Step, index: int):
    """x `[n, hidden]` -> the attention block's contribution `[n, hidden]`."""
    ws, eps, D = step.buffers, cfg.rms_norm_eps, cfg.head_dim  # ws: buffers made once
    h = rms_norm(x, layer.attn_norm, eps, out=ws.h)             # [n, hidden]
    q, k, v = layer.qkv(h, step.matmul_path, out=ws.qkv, head_dim=D)  # [n, H|KVH, D]
    if layer.q_norm is not None:                                # per head
        q = rms_norm(q, layer.q_norm, eps, out=ws.q_normed)     # [n, H, D]
        k = rms_norm(k, layer.k_norm, eps, out=ws.k_normed)     # [n, KVH, D]
    q = apply_rope(q, step.cos, step.sin, cfg.rope_style, out=ws.q_rot)  # (v: no RoPE)
    k = apply_rope(k, step.cos, step.sin, cfg.rope_style, out=ws.k_rot)
    scale = step.scale or 1.0 / np.sqrt(D)
    out = attend(q, k, v, step.segments, index, scale, step.per_row, out=ws.att)
    return layer.attn_out(out, step.matmul_path, out=ws.o)      # [n, hidden]


def ffn_block(layer: Layer, x: np.ndarray, cfg: Config, step: Step):
    """x `[n, hidden]` -> the feed-forward block's contribution `[n, hidden]`."""
    h = rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps, out=step.buffers.h)  # [n, hidden]
    return layer.ffn(h, step.matmul_path, step.buffers)         # dense or experts


def load_layer(w: WeightReader, i: int, expert_top_p: float = 1.0) -> Layer:
    """Layer i's weights, as its family's table lists them (families.py); a family
    without q/k norms has None there, and the FFN is dense or a mixture of experts as
    the table says."""
    t = w.layer(i)
    ffn = (load_moe_ffn(t, w.cfg, expert_top_p) if w.cfg.family.moe
           else DenseFfn.from_weights(t))
    return Layer(attn_norm=t["attention_norm"],
                 qkv=FusedLinear([t["wq"], t["wk"], t["wv"]]),
                 q_norm=t.get("q_norm"), k_norm=t.get("k_norm"), attn_out=t["wo"],
                 ffn_norm=t["feed_forward_norm"], ffn=ffn)


class Model:
    KEEP_ROWS = 64   # steps up to this many rows reuse their thread's workspace

    def __init__(self, gguf: GGUFFile, config: Config, tokenizer,
                 embedding: LinearWeight, layers: list[Layer], output_norm: np.ndarray,
                 output: LinearWeight):
        self.gguf, self.config, self.tokenizer = gguf, config, tokenizer
        self.embedding = embedding      # [vocab, hidden]: one row per token id
        self.layers = layers
        self.output_norm = output_norm  # [hidden]
        self.output = output            # lm_head [vocab, hidden] (maybe the embedding)
        self.profile: dict[str, float] | None = None
        self.check_numerics = False     # check each layer's output: name the first bad
        self.rope = RopeTable(config.head_dim, config.rope_theta)  # angles by position
        self.reuse_buffers = True       # False: every op allocates (the reference)
        self.replay_decode = True       # False: no tape, the blocks run every step
        self._local = threading.local()  # this thread's workspace and tape
        self._tape_epoch = 0            # forget_tape
        # Debug: every N-th replayed decode step also runs the blocks and compares
        # (TapeMismatch); 0 = off.  FUCINA_CHECK_TAPE=N sets it for every model.
        self.check_tape_every = _env_int("FUCINA_CHECK_TAPE")
        self._replays = 0

    # --- loading ----------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike, *, threads: int | None = None,
             expert_top_p: float = 1.0, tokenizer: bool = True,
             tokenizer_cache: str | os.PathLike | None = None) -> "Model":
        """Open a GGUF file, read its config and tokenizer, map its weights.

        A model *name* ("qwen2.5-coder-0.5b") becomes a path in `catalog.load_model`.
        `expert_top_p` (MoE only; see moe.py): below 1, drop low-weight experts.
        `tokenizer=False` skips building the tokenizer (a forward pass on ids does not
        need it: startup.py's helper).  `tokenizer_cache`: a directory where the tokenizer's
        built tables are kept between runs (tokenizer_cache.py; `catalog.load_model`
        passes the cache directory), else they are built each time."""
        from .tokenizer import Tokenizer

        check_top_p(expert_top_p)
        if threads:
            set_threads(threads)
        gguf = GGUFFile(path)
        cfg = Config.from_gguf(gguf)
        has_vocab = tokenizer and gguf.has("tokenizer.ggml.tokens")
        vocab = (Tokenizer.from_gguf(gguf, cache_dir=tokenizer_cache) if has_vocab
                 else None)
        validate.check_model_file(gguf, cfg, vocab)     # a file is untrusted input
        w = WeightReader(gguf, cfg)
        top = w.model()
        # Tied: without its own output matrix the embedding is the lm_head (the same
        # object, no copy).
        output = top["lm_head"] if top["lm_head"] is not None else top["embedding"]
        layers = [load_layer(w, i, expert_top_p) for i in range(cfg.num_layers)]
        return cls(gguf, cfg, vocab, top["embedding"], layers, top["final_norm"],
                   output)

    @property
    def path(self) -> Path:
        return self.gguf.path

    @property
    def expert_top_p(self) -> float:
        """MoE models: the experts' top-p (>= 1: every routed expert runs)."""
        return next((layer.ffn.top_p for layer in self.layers
                     if isinstance(layer.ffn, MoeFfn)), 1.0)

    @expert_top_p.setter
    def expert_top_p(self, p: float) -> None:
        check_top_p(p)
        for layer in self.layers:
            if isinstance(layer.ffn, MoeFfn):
                layer.ffn.top_p = float(p)

    def new_cache(self, capacity: int | None = None,
                  cache_type: str = "f16") -> KvCache:
        """A KV cache for one sequence (default capacity: min(context, 4096))."""
        capacity = capacity or min(self.config.context_length, 4096)
        return KvCache.for_config(self.config, capacity, cache_type)

    # --- entry points -----------------------------------------------------------------

    def forward_step(self, ids, pos0: int, cache: KvCache, *,
                     per_row: bool = False) -> np.ndarray:
        """Run `ids` at positions pos0.. appending to `cache`; last logits `[vocab]`.

        With a fresh cache and pos0 == 0 this is prefill, and the result equals the
        cacheless `forward_last_logits(ids)`.
        """
        ids = self._ids(ids)
        segment = Segment(0, len(ids), pos0, self._check_cache(cache, pos0, len(ids)))
        return self._forward(ids, [segment], last_only=True, per_row=per_row)[0]

    def forward_step_all_logits(self, ids, pos0: int, cache: KvCache, *,
                                per_row: bool = False) -> np.ndarray:
        """Like `forward_step`, but logits for every appended position: `[n, vocab]`.

        The verify step of speculative decoding: n positions checked for about the
        weight traffic of one step.
        """
        ids = self._ids(ids)
        segment = Segment(0, len(ids), pos0, self._check_cache(cache, pos0, len(ids)))
        return self._forward(ids, [segment], last_only=False, per_row=per_row)

    def forward_last_logits(self, ids, *, per_row: bool = False,
                            cache_type: str = "f16") -> np.ndarray:
        """Cacheless: the whole sequence from scratch; last logits `[vocab]`."""
        return self._from_scratch(ids, per_row, cache_type, last_only=True)[0]

    def forward_all_logits(self, ids, *, per_row: bool = False,
                           cache_type: str = "f16") -> np.ndarray:
        """Cacheless, every position's logits `[n, vocab]`: row p depends on ids[:p+1]
        only (the causal mask), so one pass is the oracle of a whole generation."""
        return self._from_scratch(ids, per_row, cache_type, last_only=False)

    def _from_scratch(self, ids, per_row: bool, cache_type: str, last_only: bool):
        """One pass over a whole sequence, remembering nothing from earlier calls.  Its
        keys and values still pass through a scratch cache of `cache_type`, so they are
        rounded exactly as a cache rounds them (as in llama.cpp's batch evaluation)."""
        ids = self._ids(ids)
        scratch = KvCache.for_config(self.config, len(ids), cache_type)
        segment = Segment(0, len(ids), 0, scratch)
        return self._forward(ids, [segment], last_only=last_only, per_row=per_row)

    def forward_step_batch(self, ids, caches: list[KvCache]) -> np.ndarray:
        """One new token for each of N independent streams in one pass: `[N, vocab]`.

        The weights are read once for all N rows (the batch-decode bandwidth win); RoPE
        positions, KV appends and attention are per stream.
        """
        ids = self._ids(ids)
        if len(ids) != len(caches):
            raise FucinaError(f"{len(ids)} tokens for {len(caches)} streams")
        segments = [Segment(i, i + 1, c.len, self._check_cache(c, c.len, 1))
                    for i, c in enumerate(caches)]
        return self._forward(ids, segments, last_only=False)

    def generate(self, prompt_ids, max_new_tokens: int, *, stop_ids=None,
                 cache: KvCache | None = None, on_token=None,
                 speculator=None) -> list[int]:
        """Greedy generation: prefill the prompt, then argmax one token at a time
        (generation.py: the one decode loop, which chat and the server drive too).

        Stops after `max_new_tokens`, at a stop id (default: the tokenizer's end-of-turn
        ids; the stop token is included in the result), or when the cache is full.
        With a `speculator` (speculative.py): the same tokens in fewer steps."""
        return generation.generate(self, prompt_ids, max_new_tokens, stop_ids=stop_ids,
                                   cache=cache, on_token=on_token,
                                   speculator=speculator)

    # --- the forward pass -------------------------------------------------------------

    def _forward(self, ids: np.ndarray, segments: list[Segment], last_only: bool,
                 per_row: bool = False) -> np.ndarray:
        """The one forward pass.  All or nothing: the caches advance (their new rows
        become part of the sequence) only once the logits are computed and finite,
        so a step that raises anywhere -- a kernel, non-finite logits, Ctrl-C --
        leaves every cache as it was, and a caller's list of ids stays the cache's."""
        step, tape = self._step(segments, len(ids), per_row)
        try:
            x = self._timed("embedding", self._embed, ids, tape)          # [n, hidden]
            if tape is not None and tape.blocks:   # a decode step, recorded before:
                x = self._replay(tape, step, ids)  # its kernel calls again (tape.py)
            else:
                x = self._layers(x, step, last_only, tape)
                if tape is not None:   # recorded to the end: now later steps use it
                    self._local.tape = tape
            step.stage = "lm_head"
            logits = self._timed(step.stage, self._logits, x, step)   # [rows, vocab]
        except (ZeroDivisionError, FloatingPointError):
            raise self._non_finite(step.stage) from None
        logits = validate.check_logits(logits, self.path)
        for s in segments:
            s.cache.advance(s.stop - s.start)
        return logits

    def _replay(self, tape: Tape, step: Step, ids: np.ndarray) -> np.ndarray:
        """The tape's layers; every `check_tape_every`-th replay also runs the blocks
        on the same input and compares the two, bit for bit (`TapeMismatch`)."""
        x = tape.replay(step)                                          # [1, hidden]
        every = self.check_tape_every
        if not every:
            return x
        self._replays += 1
        if self._replays % every:
            return x
        replayed = x.copy()
        # The blocks write the same K/V rows (the cache has not advanced) and the
        # same workspace buffers; only the residual stream is a fresh array.
        x = self._layers(self._embed(ids, None), step, True, None)
        if not np.array_equal(x, replayed):
            self._local.tape = None       # recorded again at the next step
            worst = float(np.max(np.abs(x - replayed)))
            raise TapeMismatch(f"{self.path.name}: the replayed decode step differs "
                               f"from the blocks (max |diff| {worst:.3g} in the "
                               "residual stream): the tape was stale; it is dropped")
        return x

    def _layers(self, x: np.ndarray, step: Step, last_only: bool,
                tape: Tape | None) -> np.ndarray:
        """N x (attention block + FFN block), each adding its contribution to x."""
        cfg, last = self.config, len(self.layers) - 1
        attention, ffn = self._blocks(tape)
        for i, layer in enumerate(self.layers):
            step.stage = "attention"
            x += attention(layer, x, cfg, step, i)                        # residual add
            if last_only and i == last and len(x) > 1:
                x = x[-1:]  # only the last row reaches the logits: skip others' FFN
                step.keep_last_row()
            step.stage = "ffn"
            x += ffn(layer, x, cfg, step)                                 # residual add
            if self.check_numerics:
                validate.check_finite(x, f"{self.path.name}: layer {i}'s output")
        return x

    def _step(self, segments: list[Segment], n: int,
              per_row: bool) -> tuple[Step, Tape | None]:
        """The step's RoPE angles (each row's position) and its workspace; for a decode
        step, this thread's tape (tape.py), its buffers refreshed for this step."""
        ws = self._workspace(n)
        tape = (self._tape(ws) if n == 1 and len(segments) == 1 and not per_row
                else None)
        if tape is not None:
            cos, sin = self.rope.span(segments[0].pos0, 1)
            np.copyto(tape.cos, cos)
            np.copyto(tape.sin, sin)
            tape.segments[0] = segments[0]
            cos, sin, segments = tape.cos, tape.sin, tape.segments
        elif len(segments) == 1:
            cos, sin = self.rope.span(segments[0].pos0, n)            # [n, D/2] x2
        else:
            cos, sin = self.rope.at(np.concatenate(
                [np.arange(s.pos0, s.pos0 + s.stop - s.start) for s in segments]))
        step = Step(segments, cos, sin, per_row, ws,
                    NO_WORKSPACE if ws is None else ws.view(n),
                    1.0 / np.sqrt(self.config.head_dim))
        return step, tape

    def _embed(self, ids: np.ndarray, tape: Tape | None) -> np.ndarray:
        """The ids' embedding rows `[n, hidden]` (in the tape's buffer if taping)."""
        rows = self.embedding.rows(ids)
        if tape is None:
            return rows
        np.copyto(tape.x, rows)
        return tape.x

    def _tape(self, ws: Workspace | None) -> Tape | None:
        """This thread's recorded decode step, if still valid (`_tape_key`), else a
        new one for this step to record: `_forward` publishes it (makes it this
        thread's) only once the recording ran to the end, so a step interrupted
        half-way (Ctrl-C, an error in a kernel) leaves no half a tape for the next
        steps to replay.  None when the blocks must run as they are (`replay_decode`
        off, profiling, check_numerics, no workspace)."""
        if (ws is None or not self.replay_decode or self.profile is not None
                or self.check_numerics):
            return None
        key, held = self._tape_key(ws)
        tape = getattr(self._local, "tape", None)
        if tape is not None and tape.key == key:
            return tape
        cfg = self.config
        return Tape(key, held, ws, cfg, np.empty((1, cfg.hidden_size), np.float32),
                    [None], np.empty((1, cfg.head_dim // 2), np.float32),
                    np.empty((1, cfg.head_dim // 2), np.float32))

    def _tape_key(self, ws: Workspace) -> tuple[tuple, tuple]:
        """What a recorded step depends on, and the objects behind its ids: the
        level, the edits of every `Watched` object (a layer, its projections and
        FFN, at any depth: tape.py), `forget_tape`'s epoch, and the identities of
        the workspace, the config, the block functions, the list of layers and each
        layer in it.  So dropping or swapping layers (`model.layers[:-1]`), assigning
        `layer.ffn.down`, or replacing the module's `attention_block` records the
        step again; only a weight changed in place needs `forget_tape()`.  The tape
        keeps `held` alive, so an id in its key is never a freed object's, reused."""
        held = (ws, self.config, attention_block, ffn_block, self.layers)
        key = (isa.level, Watched.edits, self._tape_epoch, *map(id, held),
               *map(id, self.layers))
        return key, held

    def forget_tape(self) -> None:
        """Record the decode step again (after changing weights in place: the tape
        holds the arrays it saw)."""
        self._tape_epoch += 1

    def _non_finite(self, stage: str) -> NonFiniteValues:
        """A non-finite activation stops the int8 quantizers (quant.NonFiniteActivations,
        a FloatingPointError; a float division by zero in a kernel means the same)."""
        return NonFiniteValues(f"{self.path}: the activations went non-finite in the "
                               f"{stage} stage (broken weights or config; "
                               "check_numerics=True names the layer)")

    def _logits(self, x: np.ndarray, step: Step) -> np.ndarray:
        """The final norm and the lm_head: `[rows, vocab]` (a new array)."""
        h = rms_norm(x, self.output_norm, self.config.rms_norm_eps,
                     out=step.buffers.h)                             # [rows, hidden]
        return self.output(h, step.matmul_path)                      # [rows, vocab]

    def _workspace(self, n: int) -> Workspace | None:
        """This thread's workspace if it holds n rows (grown to n up to KEEP_ROWS), else
        a fresh one for this step; None if `reuse_buffers` is off."""
        if not self.reuse_buffers:
            return None
        ws = getattr(self._local, "workspace", None)
        if ws is not None and n <= ws.rows:
            return ws
        if n > self.KEEP_ROWS:
            return Workspace(self.config, n)
        self._local.workspace = Workspace(self.config, n)
        return self._local.workspace

    def _blocks(self, tape: Tape | None = None):
        """The two block functions: recording into `tape` (a decode step's first run),
        or timed per stage into `profile` when profiling."""
        if tape is not None:
            return (partial(tape.record, "attention", attention_block),
                    partial(tape.record, "ffn", ffn_block))
        if self.profile is None:
            return attention_block, ffn_block
        return (lambda *a: self._timed("attention", attention_block, *a),
                lambda *a: self._timed("ffn", ffn_block, *a))

    def _timed(self, name: str, fn, *args):
        """fn(*args); its wall time goes to `self.profile[name]` when profiling."""
        if self.profile is None:
            return fn(*args)
        start = time.perf_counter()
        result = fn(*args)
        spent = time.perf_counter() - start
        self.profile[name] = self.profile.get(name, 0.0) + spent
        return result

    def _ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size == 0:
            raise FucinaError("a forward step needs at least one token")
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise TokenizerError(f"token id {int(bad[0])} is outside the vocabulary "
                                 f"(size {self.config.vocab_size})")
        return arr

    def _check_cache(self, cache: KvCache, pos0: int, n: int) -> KvCache:
        if cache.len != pos0:
            raise InvalidSequenceLength(
                f"forward step at position {pos0}, but the KV cache holds {cache.len} "
                "positions (pos0 must equal the cache length)")
        cache.check_room(n)
        return cache


def _env_int(name: str) -> int:
    """A non-negative integer from the environment (unset or empty: 0)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise FucinaError(f"{name} must be a non-negative integer below 10**9, got "
                          f"{raw[:20]!r}")
    return int(raw)


def set_threads(threads: int) -> None:
    """Threads for the numba kernels (BLAS reads OPENBLAS_NUM_THREADS at import)."""
    import numba

    numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
