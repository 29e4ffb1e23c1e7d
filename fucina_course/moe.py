"""Mixture of experts: the feed-forward block of `qwen3moe` (Qwen3-30B-A3B, 235B-A22B).

A MoE layer keeps attention as it is and replaces the one SwiGLU FFN with E smaller
SwiGLU FFNs (the *experts*) and a *router*, a linear layer with E outputs.  For each
token the router scores every expert, the k best run, and their outputs are blended
with the router's softmax weights.  Capacity grows with E, the work per token with k.

    logits = h Wr                        [n, E]   the router (usually F32 in the file)
    top-k of logits                      [n, k]   one pass, ties to the lower index
    p = softmax(logits) over all E       [n, E]   max-subtracted
    w = p[top-k] / sum(p[top-k])         [n, k]   when the file says so (below)
    out = sum_s w_s * expert_{e_s}(h)    [n, hidden]   in slot order, best first

This is llama.cpp's `build_moe_ffn` as its qwen3moe graph calls it (softmax gating,
weights renormalized, no scale): the softmax sums its exponentials in float64 and
scales by the float32 reciprocal (ggml_soft_max), the renormalizing sum is a float64
sum of float32 weights (ggml_sum_rows) clamped at 2^-14, and the expert outputs are
weighted and then added in slot order (ggml_mul, then one ggml_add per slot), which
`_route_rows` and `MoeFfn.__call__` do in the same order.  One difference, on purpose:
llama.cpp ranks the softmax *probabilities*, we rank the logits.  The order is the
same, except where two logits closer than a float32 rounding of their probabilities
tie after the softmax; there llama.cpp's argsort breaks the tie, here the lower index
wins.

`expert_weights_norm` (Qwen's `norm_topk_prob`) is read from the file, default true as
in every Qwen3 MoE.  llama.cpp's qwen3moe graph renormalizes unconditionally; this
engine does what the file says, so a file that sets it to false is the one case where
the two disagree (tests/test_moe.py measures that llama.cpp ignores the key).

The experts are borrowed from the memory map: a GGUF stores each projection of all E
experts as one stacked tensor `[E, rows, cols]`, and expert e is the contiguous run of
rows e*rows ... (e+1)*rows, so each is an ordinary `LinearWeight` over a slice of the
mapped bytes (weights.py, `WeightReader.experts`), nothing copied at load.

How the experts meet the rows (`MoeFfn.__call__`): the (row, slot) pairs are grouped
by expert and each selected expert runs once on all of its rows, a matrix x matrix
product that reads its weights once per step.  One decoding token is the case of one
row per group: a matrix x vector product per selected expert, and the other E - k
experts' bytes are never touched.  With `path="rows"` every group runs the decode
kernels' numerics row by row, so prefill equals decode bit for bit (the cache oracle,
oracles.py).

Expert top-p (`MoeFfn.top_p`, `Model.expert_top_p`, CLI `--expert-top-p`) trades
quality for bytes: per token, only the best slots whose weights reach a fraction p of
the total run; the kept weights are rescaled to the original total, so the blend keeps
its scale.  p >= 1 skips the step entirely: the baseline, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from . import quant
from .errors import FucinaError
from .ffn import DenseFfn
from .ops import swiglu
from .tape import Watched
from .weights import FusedLinear

NORM_SUM_FLOOR = np.float32(6.103515625e-5)  # ggml clamps the weight sum here (2^-14)


# --- the router -----------------------------------------------------------------------

def route(logits: np.ndarray, k: int, normalize: bool = True):
    """Router logits `[n, E]` -> (experts `[n, k]` int64, weights `[n, k]` float32).

    Slot 0 holds the best expert.  `normalize`: rescale the k weights to sum to 1.
    """
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n, n_experts = logits.shape
    if not 1 <= k <= n_experts:
        raise FucinaError(f"cannot route to {k} of {n_experts} experts")
    experts = np.empty((n, k), np.int64)
    weights = np.empty((n, k), np.float32)
    _route_rows(logits, k, normalize, experts, weights)
    return experts, weights


@njit(cache=True)
def _route_rows(logits, k, normalize, experts, weights):  # pragma: no cover - compiled
    n, n_experts = logits.shape
    for r in range(n):
        row, sel, top = logits[r], experts[r], weights[r]
        # one pass: the running max, and the k best by insertion into k sorted slots
        best, filled = row[0], 0
        for i in range(n_experts):
            v = row[i]
            if v > best:
                best = v
            if filled == k and not v > top[k - 1]:
                continue                  # not better than the k-th: equal loses too
            slot = filled if filled < k else k - 1
            filled = min(filled + 1, k)
            while slot > 0 and v > top[slot - 1]:   # strict: ties keep the lower index
                top[slot], sel[slot] = top[slot - 1], sel[slot - 1]
                slot -= 1
            top[slot], sel[slot] = v, i
        # softmax over all experts, evaluated only at the winners
        total = 0.0                                            # float64, as ggml
        for i in range(n_experts):
            total += _exp32(row[i] - best)
        inv = np.float32(1.0 / total)
        for s in range(k):
            top[s] = _exp32(top[s] - best) * inv
        if normalize:
            acc = 0.0
            for s in range(k):
                acc += top[s]
            norm = max(np.float32(acc), NORM_SUM_FLOOR)
            for s in range(k):
                top[s] = top[s] / norm


@njit(cache=True, inline="always")
def _exp32(x):  # pragma: no cover - compiled
    """exp of a float32, rounded once to float32 (evaluated in float64).

    ggml's vectorised expf and a libm or SVML expf each round differently in the last
    bit; rounding the float64 exp is the same on every machine."""
    return np.float32(np.exp(np.float64(x)))


def check_top_p(p: float, name: str = "expert top-p") -> None:
    """The one check of an expert top-p value, wherever it comes from (the model's
    setter, `Model.load`, the CLI's --expert-top-p): a number above 0 (NaN fails)."""
    if not p > 0:
        raise FucinaError(f"{name} must be a number above 0, got {p}")


def expert_top_p(experts: np.ndarray, weights: np.ndarray, p: float):
    """Keep, per row, the best slots until their weights reach p of the row's total;
    drop the rest (expert -1, weight 0) and rescale the kept weights to the total.

    p >= 1 returns the inputs untouched (the bit-identical baseline).  The best slot
    always stays, so even a tiny p runs one expert per token.
    """
    check_top_p(p)
    if p >= 1.0:
        return experts, weights
    total = weights.sum(axis=1, keepdims=True, dtype=np.float64)     # [n, 1]
    before = np.cumsum(weights, axis=1, dtype=np.float64) - weights  # [n, k]
    keep = before < p * total                                        # slot 0: always
    kept = np.where(keep, weights, np.float32(0))
    scale = (total / kept.sum(axis=1, keepdims=True, dtype=np.float64))
    return (np.where(keep, experts, -1),
            (kept * scale.astype(np.float32)).astype(np.float32))


# --- the routed FFN -------------------------------------------------------------------

@dataclass
class RoutingLog:
    """What the routers decided during a run, per layer: one entry per forward call.

    Filled while `recording(model)` is active; read by the book's histograms.
    """

    layers: int
    n_experts: int
    logits: list[list[np.ndarray]] = field(default_factory=list)    # [n, E] each
    experts: list[list[np.ndarray]] = field(default_factory=list)   # [n, k] each
    weights: list[list[np.ndarray]] = field(default_factory=list)   # [n, k] each

    def __post_init__(self):
        self.logits = [[] for _ in range(self.layers)]
        self.experts = [[] for _ in range(self.layers)]
        self.weights = [[] for _ in range(self.layers)]

    def selected(self, layer: int) -> np.ndarray:
        """Every routed (token, slot) of `layer`: expert ids `[tokens, k]` (-1:
        dropped by expert top-p)."""
        return np.concatenate(self.experts[layer])

    def load(self, layer: int) -> np.ndarray:
        """How many tokens each expert of `layer` served: `[E]` counts."""
        sel = self.selected(layer)
        return np.bincount(sel[sel >= 0], minlength=self.n_experts)

    def blend_weights(self, layer: int) -> np.ndarray:
        """The blend weights of `layer`, `[tokens, k]`, best slot first."""
        return np.concatenate(self.weights[layer])

    def experts_per_call(self, layer: int) -> list[int]:
        """Distinct experts each forward call of `layer` ran (= expert weights read)."""
        return [len(np.unique(e[e >= 0])) for e in self.experts[layer]]

    def top_share(self, fraction: float = 0.2) -> float:
        """The share of the routes that each layer's `fraction` most used experts
        took, averaged over the layers: `fraction` itself for a perfectly even router,
        1 if a few experts serve every token.  How much an expert cache of that size
        could hold (chapter 15, bench/bench_expert_stream.py)."""
        shares = []
        for layer in range(self.layers):
            counts = np.sort(self.load(layer))[::-1]
            shares.append(counts[:int(len(counts) * fraction)].sum() / counts.sum())
        return float(np.mean(shares))


class MoeFfn(Watched):
    """The FFN of a MoE layer: h `[n, hidden]` -> `[n, hidden]`, like `DenseFfn`.

    `experts[e]` is itself a dense SwiGLU FFN (ffn.DenseFfn) over expert e's slice of
    the stacked tensors; the router is a `LinearWeight` with E outputs.
    """

    def __init__(self, router, experts: list, k: int, normalize: bool,
                 top_p: float = 1.0):
        if not 1 <= k <= len(experts):
            raise FucinaError(f"cannot route to {k} of {len(experts)} experts")
        self.router = router          # Wr [E, hidden]
        self.experts = experts        # E x DenseFfn
        self.k = k                    # experts per token
        self.normalize = normalize    # expert_weights_norm (Qwen's norm_topk_prob)
        self.top_p = top_p            # expert top-p (>= 1: off)
        self.log: tuple[RoutingLog, int] | None = None   # (log, layer) when recording
        self.stream = None            # expert_cache.StreamedExperts: read from disk
        # gate and up share one block format (they do in every converter's output)
        self.fused_gate_up = all(e.gate_up.fused is not None for e in experts)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's three matrices: what running it reads."""
        return self.experts[0].nbytes_per_token

    @property
    def nbytes_per_token(self) -> int:
        """Weight bytes one decoded token reads: the router and k experts."""
        return self.router.nbytes + self.k * self.expert_nbytes

    def __call__(self, h: np.ndarray, path: str = "auto", buffers=None) -> np.ndarray:
        """h `[n, hidden]` -> `[n, hidden]` (a new array: `buffers`, a step's, are not
        used; the experts' intermediates are a few k-row products)."""
        n, k = len(h), self.k
        logits = self.router(h, path)                                    # [n, E]
        experts, weights = route(logits, k, self.normalize)              # [n, k] x2
        experts, weights = expert_top_p(experts, weights, self.top_p)
        if self.log is not None:
            self._record(logits, experts, weights)
        y = np.zeros((n * k, h.shape[1]), np.float32)                    # [n*k, hidden]
        if self.stream is not None:
            self._streamed(h, experts, y, path)
        elif n == 1 and self.fused_gate_up:
            self._one_token(h, experts[0], y, self.experts)              # decode
        else:
            for e, pairs in group_by_expert(experts):   # (row, slot) pairs -> e
                y[pairs] = self.experts[e](h[pairs // k], path)  # [m, hidden]
        y = y.reshape(n, k, -1)                                      # [n, k, hidden]
        out = y[:, 0] * weights[:, :1]                                   # [n, hidden]
        for s in range(1, k):                # slot order, as llama.cpp adds them
            out += y[:, s] * weights[:, s:s + 1]
        return out

    def _streamed(self, h: np.ndarray, experts: np.ndarray, y: np.ndarray,
                  path: str) -> None:
        """The experts read into the stream's cache (expert_cache.py), the same
        kernels on the slots' bytes.  One token: its k experts at once, and while
        they are read the next layer's router on this input predicts that layer's
        experts, read ahead.  Several tokens (a prefill may route to every expert,
        more than the cache holds): one expert at a time, the next ones read ahead."""
        stream, cache, k = self.stream, self.stream.cache, self.k
        try:
            if len(h) == 1 and self.fused_gate_up:
                used = np.unique(experts[experts >= 0])

                def ahead() -> None:        # the next layers' routers on this input
                    for layer, router in stream.ahead:
                        guess, _ = route(router(h, path), k, self.normalize)
                        cache.prefetch(layer, np.unique(guess))

                slots = cache.acquire(stream.layer, used, ahead)
                ffns = dict(zip(used.tolist(), stream.views(slots)))
                self._one_token(h, experts[0], y, ffns)
                return
            groups = list(group_by_expert(experts))
            order = [e for e, _ in groups]
            for i, (e, pairs) in enumerate(groups):
                slot = cache.acquire(stream.layer, [e], lambda i=i: cache.prefetch(
                    stream.layer, order[i + 1:i + 1 + k]))
                y[pairs] = stream.views(slot)[0](h[pairs // k], path)   # [m, hidden]
                cache.release()
        finally:
            cache.release()

    def _one_token(self, h: np.ndarray, selected: np.ndarray, y: np.ndarray,
                   ffns) -> None:
        """One token's experts into y `[k, hidden]` (slot s in row s).

        The selected experts' gate and up matrices all read the same h, so they run as
        one multi-matrix kernel call; then one down projection per expert.  The numbers
        are those of one matrix x vector product per matrix (the multi-row kernels equal
        the decode kernels bit for bit), with k - 1 fewer parallel regions per layer
        (each wakes the worker threads: ~10% of a decode step on 2 busy cores).
        """
        slots = [s for s in range(len(selected)) if selected[s] >= 0]
        ffns = [ffns[selected[s]] for s in slots]
        both = quant.MultiMatrix([m for f in ffns for m in f.gate_up.fused.parts])
        gate_up = quant.matmul(both, h, path="rows")[0]                  # [2f * slots]
        for s, ffn, (gate, up) in zip(slots, ffns, gate_up.reshape(len(slots), 2, -1)):
            y[s] = ffn.down(swiglu(gate, up)[None], "rows")[0]           # [hidden]

    def _record(self, logits, experts, weights) -> None:
        log, layer = self.log
        log.logits[layer].append(np.array(logits, np.float32))
        log.experts[layer].append(experts.copy())
        log.weights[layer].append(weights.copy())


def group_by_expert(experts: np.ndarray):
    """Yield (expert, flat (row * k + slot) indices) for every expert used in `experts`
    `[n, k]`, in expert order; dropped slots (-1) are skipped."""
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")                          # [n*k]
    ids = flat[order]
    bounds = np.flatnonzero(np.diff(ids)) + 1
    for chunk in np.split(order, bounds):
        e = int(flat[chunk[0]])
        if e >= 0:
            yield e, chunk


def load_moe_ffn(w: dict, cfg, top_p: float = 1.0) -> MoeFfn:
    """A MoE layer's router and experts from its weights by role
    (weights.WeightReader.layer); the experts stay in the memory map."""
    experts = [DenseFfn(FusedLinear([g, u]), d) for g, u, d in
               zip(w["experts_gate"], w["experts_up"], w["experts_down"])]
    return MoeFfn(w["router"], experts, cfg.num_experts_used, cfg.norm_topk_prob, top_p)


class recording:
    """`with recording(model) as log:` every MoE layer logs its routing into `log`."""

    def __init__(self, model):
        self.model = model
        moe = [layer.ffn for layer in model.layers if isinstance(layer.ffn, MoeFfn)]
        if not moe:
            raise FucinaError(f"{model.path}: not a mixture-of-experts model")
        self.log = RoutingLog(len(model.layers), len(moe[0].experts))

    def __enter__(self) -> RoutingLog:
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.ffn, MoeFfn):
                layer.ffn.log = (self.log, i)
        return self.log

    def __exit__(self, *exc) -> None:
        for layer in self.model.layers:
            if isinstance(layer.ffn, MoeFfn):
                layer.ffn.log = None
