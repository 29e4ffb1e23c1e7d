"""The buffers of a forward step, made once: where every intermediate of a layer goes.

Why.  A decode step of a small model is short, and the Python between its kernels is
not: SmolLM2-135M at avx2 spent about a third of a token outside the matrix kernels
(measured: docs/BENCHMARKS.md#workspace-buffers).  Much of the rest was each operation
allocating its output and checking and reshaping its arguments.  So model.py's blocks
write into buffers made once per row count, as llama2.c's `run.c` computes one forward
pass over buffers allocated at start, and every op takes `out=`.  The numbers do not
change: an op writes the same values into a buffer as into a fresh array.

A `Workspace` holds buffers for up to `rows` rows; `view(n)` is the first n rows of
each (cached, so a block pays one dict lookup).  model.py keeps one per thread (two
threads never share buffers) for steps of up to `Model.KEEP_ROWS` rows, and makes a
fresh one for a longer prefill, whose arithmetic dwarfs an allocation.
`NO_WORKSPACE` is the same names, all None: the ops then allocate (a MoE's experts, the
book's calls of a single block).  With the buffers fixed, a decode step's kernel calls
have fixed arguments, so the step can be recorded once and replayed (tape.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class Workspace:
    """Every intermediate of a forward step over at most `rows` rows."""

    def __init__(self, cfg, rows: int):
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hidden, ffn = cfg.hidden_size, cfg.intermediate_size
        qkv = cfg.q_dim + 2 * cfg.kv_dim
        self.rows = rows
        self._full = SimpleNamespace(
            h=np.empty((rows, hidden), np.float32),       # a norm's output
            qkv=np.empty(rows * qkv, np.float32),         # q|k|v (weights.FusedLinear)
            q_normed=np.empty((rows, H, D), np.float32),  # per-head norms (qwen3)
            k_normed=np.empty((rows, KVH, D), np.float32),
            q_rot=np.empty((rows, H, D), np.float32),     # after RoPE
            k_rot=np.empty((rows, KVH, D), np.float32),
            att=np.empty((rows, H * D), np.float32),      # attention's output
            o=np.empty((rows, hidden), np.float32),       # its projection
            gate_up=np.empty(rows * 2 * ffn, np.float32),  # gate|up (dense FFN)
            act=np.empty((rows, ffn), np.float32),        # silu(gate) * up
            down=np.empty((rows, hidden), np.float32))    # the FFN's output
        self._views: dict[int, SimpleNamespace] = {}

    def view(self, n: int) -> SimpleNamespace:
        """The buffers for an n-row step (n <= rows): the first n rows of each; the
        flat ones (qkv, gate_up) whole, since their users lay out n rows in them."""
        v = self._views.get(n)
        if v is None:
            if n > self.rows:
                raise ValueError(f"a {self.rows}-row workspace cannot hold {n} rows")
            v = self._views[n] = SimpleNamespace(**{
                name: a if a.ndim == 1 else a[:n]
                for name, a in vars(self._full).items()})
        return v


NO_WORKSPACE = SimpleNamespace(h=None, qkv=None, q_normed=None, k_normed=None,
                               q_rot=None, k_rot=None, att=None, o=None, gate_up=None,
                               act=None, down=None)
