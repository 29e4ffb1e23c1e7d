"""Synthetic MoE models whose tokens spread over the experts as a trained model's do.

The synthetic files (synth.py) route badly in a way that matters for an expert cache.
Their embeddings are small (std 0.05, |e| ~ 2 in 2,048 dimensions) next to what a
random attention layer adds (|a| ~ 45: near-uniform attention averages the context's
values), so every position of a sequence carries nearly the same hidden state, the
running average of its context, and the routers see nearly the same input at every
token.  Measured on the 30B-A3B geometry in Q4_K, 4 layers, 257 random tokens in one
prefill: the 26 most used of 128 experts (20%) carried 53-85% of the routes, layer by
layer, and one expert served 250 of the 257 tokens of the last layer.  A cache looks far
better on that than it would on a real model.

A trained Qwen3 MoE is trained with a load-balancing loss (Qwen's "global-batch load
balance", 2025), and what has been measured on real traces is close to uniform.  The one
published measure found here, a llama.cpp residency policy for Qwen3.6-35B-A3B built
from SciCode and Terminal-Bench traces (huggingface.co/datasets/sjakek/
qwen36-moe-coding-expert-saliency, `combined_top_20pct_global_experts`), gives the 20%
of experts it keeps 24.8% of all activations (uniform routing: 20%).

`routed_synthetic(spec, skew)` writes the same geometry with

* **token-dominated hidden states**: embeddings of std 2.0 instead of 0.05, so a
  token's own embedding outweighs the context average.  Measured the same way: the top
  20% of experts carry 30-33% of the routes and every layer uses all 128 experts (the
  finite-sample floor of uniform routing for 257 tokens is ~26%);
* with `skew` > 0, **a popularity**: expert e (in a seeded random order, rank r = 1..E)
  should be chosen in proportion to r^-skew, a Zipf law, for what-ifs (a skew of 0 is
  the measured near-uniform case, not a claim about any model).  A router row's scale
  sets how often its expert wins (a larger scale spreads its logit, more often into
  the top k), so each router row is scaled by a factor fitted on Gaussian logits to
  give the Zipf frequencies (`popularity_scales`); the benchmark then measures the
  popularity the model really shows.

Rejected: drawing the routes from a distribution at run time (a trace replay).  It
makes the lookahead (the next layer's router on this layer's input) either useless or
perfect, depending on how the trace is drawn, where a real router's prediction is in
between; here the routers are real linear maps and the lookahead meets them as it
would meet a model's.  Also rejected: removing the hidden states' common direction from
each router (tried: that direction is the average of one sequence's context, a
different one for every prompt, so routers fitted on one prompt spread no other).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .errors import FucinaError

EMBEDDING_STD = 2.0
FIT_TOKENS = 4096            # Gaussian logit rows the scales are fitted on
FIT_ROUNDS = 60


def zipf(n: int, skew: float) -> np.ndarray:
    """Probabilities proportional to rank^-skew, ranks 1..n."""
    p = np.arange(1, n + 1, dtype=np.float64) ** -skew
    return p / p.sum()


def capped(p: np.ndarray, cap: float) -> np.ndarray:
    """`p` with no share above `cap`, the excess spread over the rest in proportion:
    an expert serves a token at most once, so it holds at most 1/k of the slots."""
    p = p.copy()
    while p.max() > cap * (1 + 1e-12):
        over = p >= cap
        free = p[~over].sum()
        p[~over] *= (1 - cap * over.sum()) / free
        p[over] = cap
    return p


def top_k_frequencies(scales: np.ndarray, k: int, z: np.ndarray) -> np.ndarray:
    """How often each expert is among the k largest of `scales * z` (z: [n, E])."""
    logits = z * scales
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    return np.bincount(top.ravel(), minlength=len(scales)) / (len(z) * k)


def popularity_scales(n_experts: int, k: int, skew: float,
                      rng: np.random.Generator) -> np.ndarray:
    """Row scales that make expert i (i = 0..E-1 in rank order) win a share of the
    top-k slots proportional to (i + 1)^-skew (capped at 1/k, `capped`), when the
    unscaled logits are i.i.d. Gaussian (a multiplicative fixed point, fitted on
    `FIT_TOKENS` rows)."""
    target = capped(zipf(n_experts, skew), 1 / k)
    z = rng.standard_normal((FIT_TOKENS, n_experts))
    scales = np.ones(n_experts)
    if skew == 0:
        return scales
    for _ in range(FIT_ROUNDS):
        got = top_k_frequencies(scales, k, z)
        scales *= (target / np.maximum(got, 1e-6)) ** 0.25
        scales /= scales.mean()
    return scales


def skew_routers(path: str | Path, skew: float, seed: int = 0) -> None:
    """Scale the routers of the MoE file `path` in place for a Zipf popularity of
    steepness `skew` (module docstring); each layer gets its own order of experts."""
    from gguf import GGUFReader

    from .families import FAMILIES
    from .gguf_file import GGUFFile

    meta = GGUFFile(path)
    arch = meta.get_str("general.architecture")
    router = "." + FAMILIES[arch].tensor("router").name        # blk.N.<this>
    k = meta.get_int(f"{arch}.expert_used_count")
    del meta                                  # its read-only map, before the writable one
    reader = GGUFReader(str(path), "r+")
    routers = [t for t in reader.tensors if t.name.endswith(router)]
    rng = np.random.default_rng(seed)
    for t in routers:
        w = t.data                                                       # [E, hidden]
        scales = popularity_scales(len(w), k, skew, rng)
        order = rng.permutation(len(w))                  # expert order[i] has rank i
        w[order] = (w[order] * scales[:, None]).astype(np.float32)
    reader.data.flush()


def routed_synthetic(spec, skew: float = 0.0) -> Path:
    """`spec` (a MoE) with token-dominated hidden states and, if `skew` > 0, a Zipf
    popularity, in the cache dir (written on first use; the name says the skew)."""
    if not (math.isfinite(skew) and 0 <= skew <= 2):
        raise FucinaError(f"router skew must be a number from 0 to 2, got {skew}")
    if not spec.num_experts:
        raise FucinaError(f"{spec.name}: not a mixture-of-experts geometry")
    from .synth import cached_path_for, write_synthetic

    path = cached_path_for(spec, f"spread-skew{skew:g}")
    if not path.is_file():
        tmp = path.with_suffix(".writing")
        write_synthetic(spec, tmp, embedding_std=EMBEDDING_STD)
        if skew > 0:
            skew_routers(tmp, skew, spec.seed)
        tmp.replace(path)
    return path
