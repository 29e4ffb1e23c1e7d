"""Checks the engine runs on itself: answers computed two ways that must agree.

`verify_cache` is the KV cache's oracle.  The cached side prefills a prompt into a cache
and then decodes greedily, one token per step, each step reading the keys and values
earlier steps left behind.  The uncached side recomputes the whole final sequence in one
pass (`Model.forward_all_logits`), remembering nothing; row p of its logits depends on
tokens 0..p only, so one pass answers every step.

Like for like.  Both sides run `per_row=True`: every row goes through the decode
kernels, one row at a time, and the uncached side rounds its keys and values exactly as
the cache stores them (f16, or q8_0 blocks) -- llama.cpp's batch evaluation rounds them
the same way.  Every operation is then the same kernel on the same numbers, so the bound
is derived, not measured: **zero**.  Any difference is a cache bug (a wrong offset, a
missed `advance`, a stale row).

Two spreads are reported beside it, never checked, because they are not the cache's
doing:

* the fast path: prefill as it normally runs (kernels chosen for the prompt's shape,
  BLAS attention) against the same decode steps.  Quantized activations amplify last-bit
  differences of summation order; llama.cpp's own prefill and decode of the same prompt
  differ by as much (tests/test_model.py, `test_real_model_within_llama_noise`).
* for a q8_0 cache, what its rounding costs: the same steps against an f16 oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class CacheCheck:
    """What `verify_cache` found per row: max |cached - uncached|, argmax agreement."""

    positions: list[int]           # the position of each compared row
    diff: np.ndarray               # [steps + 1] like for like: max |cached - uncached|
    argmax_equal: np.ndarray       # [steps + 1] bool
    fast_diff: np.ndarray | None   # [steps + 1] against the fast prefill path (if any)
    fast_argmax_equal: np.ndarray | None
    q8_diff: np.ndarray | None     # [steps + 1] q8_0 cache against an f16 oracle
    q8_argmax_equal: np.ndarray | None

    @property
    def ok(self) -> bool:
        return float(self.diff.max()) == 0.0 and bool(self.argmax_equal.all())


def verify_cache(model, ids: list[int], steps: int, cache_type: str = "f16",
                 fast: bool = True) -> CacheCheck:
    """Prefill `ids`, decode `steps` greedy tokens through a cache of `cache_type`, and
    compare each step's logits with a cacheless pass over the final sequence (module
    docstring)."""
    ids = list(ids)
    cache = model.new_cache(len(ids) + steps, cache_type)
    cached = [model.forward_step(ids, 0, cache, per_row=True)]     # [vocab] each
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(np.argmax(cached[-1])))
        cached.append(model.forward_step(seq[-1:], cache.len, cache))
    cached = np.stack(cached)                                      # [steps+1, vocab]
    first = len(ids) - 1

    def against(**options) -> tuple[np.ndarray, np.ndarray]:
        oracle = model.forward_all_logits(seq, **options)[first:]  # [steps+1, vocab]
        return (np.abs(cached - oracle).max(axis=1),
                cached.argmax(axis=1) == oracle.argmax(axis=1))

    diff, same = against(per_row=True, cache_type=cache_type)
    fast_spread = against(cache_type=cache_type) if fast else (None, None)
    q8_cost = against(per_row=True) if cache_type == "q8_0" else (None, None)
    return CacheCheck(list(range(first, len(seq))), diff, same, *fast_spread, *q8_cost)
