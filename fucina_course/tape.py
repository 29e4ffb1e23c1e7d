"""A decode step recorded once from model.py's blocks, then replayed: the same kernel
calls on the same buffers, without the Python in between.

Why.  In decode every kernel call lasts tens of microseconds, and the Python around it
is a share of the step: the blocks check their arguments, look up their buffers and
bound kernels, reshape and slice, and each of those touches objects that the weights
streamed by the kernels have just pushed out of the CPU caches.  Measured in one process
against a hand-written schedule of the same calls, the blocks over their workspace took
several percent of a token more (docs/BENCHMARKS.md#decode-tape).  llama.cpp builds its
compute graph from the model's code once and then executes it; so does this, one level
up: the first one-token step of a thread *records* the kernel calls that
`attention_block` and `ffn_block` make (every argument is a buffer of the workspace, a
weight, or a bound kernel), and the next steps replay the record.  There is one
definition of the model (model.py); this is its schedule, made by running it.

How.  The ops make their kernel calls through `call(fn, *args)`, which appends
(fn, args) to the tape while one is recording.  A call whose arguments change from step
to step (the KV cache's append and the attention over it: `attention.attend`) is
recorded as one call of a function that reads the step's segment when it runs; the
tape keeps that segment list and the RoPE angles in buffers of its own and refreshes
them before each replay.  A block whose result is not one of the workspace's buffers (a
mixture of experts, which routes each token differently) is replayed by calling the
block itself.

Invariant: a replayed step computes exactly what the recorded blocks compute (the same
kernels on the same arguments in the same order; tests/test_workspace.py compares the
logits bit for bit).  Two rules keep it true:

* A tape is used only once it is complete.  A recording interrupted half-way (Ctrl-C
  during the first token, an error in a kernel) would replay its first layers only,
  and every later token would be silently wrong; so `Model._forward` publishes a
  tape as the thread's only after the recording step ran through every layer.
* A tape is valid for one thread, one workspace, one instruction-set level, one
  config and the objects it saw: `Model._tape_key` records again when the list of
  layers or one of its items, or the block functions are replaced, or when any
  attribute of a `Watched` object (a layer, its projections, its FFN, at any depth)
  is assigned; a weight changed in place needs `Model.forget_tape()`.

`Model.check_tape_every = N` (or FUCINA_CHECK_TAPE=N) checks both: every N-th replay
also runs the blocks and compares, bit for bit (`TapeMismatch`).  Profiling,
`check_numerics` and `Model.replay_decode = False` run the blocks every step.

Measured after (same process, the two alternating, 60 rounds of 8 tokens): SmolLM2 at
avx2 0.99x the hand-written schedule's speed, the blocks without a tape 0.93x.
"""

from __future__ import annotations

import threading
from typing import Callable, NamedTuple

import numpy as np

_local = threading.local()


def call(fn, *args):
    """fn(*args), appended to the tape if this thread is recording one."""
    calls = getattr(_local, "calls", None)
    if calls is not None:
        calls.append((fn, args))
    return fn(*args)


def fresh() -> None:
    """An op made a temporary array (a copy of a non-contiguous input): a replay would
    read the recording step's copy, so the block being recorded will be called again
    instead."""
    if getattr(_local, "calls", None) is not None:
        _local.fresh = True


class Watched:
    """Base of the objects a recorded step reads its arguments from (model.Layer,
    ffn.DenseFfn, moe.MoeFfn, the weights' products): assigning any attribute of one,
    at load or later (`layer.ffn.down = ...`), counts in `Watched.edits`, part of a
    tape's key, so the next decode step is recorded again.

    Rejected alternative: snapshot the identities of every layer's attributes each
    step.  It saw one level down only, and cost ~30-60 us a step on SmolLM2's 30
    layers (~1% of a token); an edit counter is one integer compared, and nothing
    assigns these attributes while decoding."""

    __slots__ = ()
    edits = 0

    def __setattr__(self, name, value):
        Watched.edits += 1
        object.__setattr__(self, name, value)


class Recorded(NamedTuple):
    """One block of a recorded step."""

    stage: str                     # "attention" or "ffn" (Step.stage while it runs)
    calls: list | None             # its kernel calls (fn, args); None: call the block
    result: np.ndarray             # the workspace buffer its result is written to
    block: Callable                # the block itself, with ...
    args: tuple                    # ... its arguments


class Tape:
    """One thread's recorded one-token step: per block, its kernel calls and the buffer
    its result is in (or the block itself, to call again)."""

    def __init__(self, key: tuple, held: tuple, workspace, config, x: np.ndarray,
                 segments: list, cos: np.ndarray, sin: np.ndarray):
        self.key = key                      # what it was recorded for: Model._tape_key
        self.held = held                    # the objects whose ids are in key, kept
        self.workspace, self.config = workspace, config   # alive (no id is reused)
        self.x = x                          # the residual stream's buffer [1, hidden]
        self.segments = segments            # the recorded attention calls read [0]
        self.cos, self.sin = cos, sin       # the RoPE angles' buffers [1, D/2]
        self.blocks: list[Recorded] = []

    def record(self, stage: str, block, *args):
        """block(*args), its kernel calls taped; returns its result."""
        calls = []
        _local.calls, _local.fresh = calls, False
        try:
            result = block(*args)
        finally:
            _local.calls = None
        buffers = vars(self.workspace.view(1)).values()
        if _local.fresh or not any(result is b for b in buffers):
            calls = None                    # call the block itself (a MoE's routing)
        self.blocks.append(Recorded(stage, calls, result, block, args))
        return result

    def replay(self, step) -> np.ndarray:
        """The recorded layers once more, on the buffers as they now are: x `[1,
        hidden]` after the last layer.  `step.stage` names the block running."""
        x = self.x
        for stage, calls, result, block, args in self.blocks:
            step.stage = stage
            if calls is None:
                x += block(*args)                             # residual add
            else:
                for fn, fn_args in calls:
                    fn(*fn_args)
                x += result                                   # residual add
        return x
