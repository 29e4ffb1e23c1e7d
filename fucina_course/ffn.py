"""The dense feed-forward network of a layer: SwiGLU, `(silu(h Wgate) * h Wup) Wdown`.

Its own module because two others build on it: model.py runs it as a dense layer's FFN,
and moe.py runs E of them as experts (each over its slice of the stacked tensors).
"""

from __future__ import annotations

import numpy as np

from .ops import swiglu
from .tape import Watched
from .weights import FusedLinear, LinearWeight


class DenseFfn(Watched):
    """The SwiGLU feed-forward network: h `[n, hidden]` -> `[n, hidden]`."""

    def __init__(self, gate_up: FusedLinear, down: LinearWeight):
        self.gate_up = gate_up   # Wgate, Wup [ffn, hidden]
        self.down = down         # Wdown [hidden, ffn]

    @classmethod
    def from_weights(cls, w: dict) -> "DenseFfn":
        """From a layer's weights by role (weights.WeightReader.layer)."""
        return cls(FusedLinear([w["w_gate"], w["w_up"]]), w["w_down"])

    def __call__(self, h: np.ndarray, path: str = "auto", buffers=None) -> np.ndarray:
        """h `[n, hidden]` -> `[n, hidden]`; with `buffers` (a step's, model.Step) every
        intermediate goes into them instead of new arrays."""
        if buffers is None:
            gate, up = self.gate_up(h, path)                    # [n, ffn] each
            return self.down(swiglu(gate, up), path)            # [n, hidden]
        gate, up = self.gate_up(h, path, out=buffers.gate_up)   # [n, ffn] each
        act = swiglu(gate, up, out=buffers.act)                 # silu(gate) * up
        return self.down(act, path, out=buffers.down)           # [n, hidden]

    @property
    def nbytes_per_token(self) -> int:
        """Weight bytes one decoded token reads: all of them."""
        return sum(p.nbytes for p in self.gate_up.parts) + self.down.nbytes
