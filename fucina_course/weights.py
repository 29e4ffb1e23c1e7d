"""Weight matrices as the model sees them: `y = x @ W.T (+ b)` and embedding row lookups.

A `LinearWeight` wraps one GGUF tensor *in its own block format*: the bytes stay memory-mapped and
the `quant` kernels decode them on the fly, so loading a model costs no more memory than mapping
its file.  Two conveniences sit on top:

* **Embedding rows.**  `rows(ids)` dequantizes only the rows asked for (a prompt's tokens), never
  the whole 151,936-row table.
* **Tied output.**  Many small models reuse the embedding table as the output projection (lm_head).
  `Model.load` then hands the *same* `LinearWeight` to both roles: no copy, no second mapping.
* **Fused projections.**  q/k/v (and the FFN's gate/up) read the same input.  When their formats
  match, `FusedLinear` treats them as one `[sum n_out, n_in]` matrix (`quant.MultiMatrix`): the
  activations are quantized once and every part's kernel writes its slice of one output, with no
  weight bytes copied or concatenated.  When formats differ (the Qwen2.5-Coder file stores q/k in
  Q5_0 and v in Q8_0) it falls back to one call per part.
"""

from __future__ import annotations

import numpy as np

from . import quant
from .errors import ShapeMismatch
from .gguf_file import TensorInfo


class LinearWeight:
    """One `[n_out, n_in]` weight matrix (+ optional float32 bias) in its GGUF block format."""

    def __init__(self, info: TensorInfo, bias: np.ndarray | None = None):
        quant.check_supported(info.ggml_type, info.name)
        if len(info.shape) != 2:
            raise ShapeMismatch(f"tensor {info.name!r} should be 2-D, has shape {info.shape}")
        self.info = info
        self.n_in, self.n_out = info.shape
        self.matrix = quant.QuantMatrix.from_tensor(info)
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def type_name(self) -> str:
        return self.info.type_name

    @property
    def nbytes(self) -> int:
        return self.info.n_bytes

    def expect(self, n_out: int, n_in: int) -> "LinearWeight":
        """Check the shape against the config; a mismatch means a broken or foreign file."""
        if (self.n_out, self.n_in) != (n_out, n_in):
            raise ShapeMismatch(f"tensor {self.name!r} has shape [{self.n_out}, {self.n_in}] "
                                f"but the config implies [{n_out}, {n_in}]")
        return self

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x `[n, n_in]` -> `[n, n_out]`: matrix x vector for one row (decode), matrix x matrix otherwise."""
        if x.shape[0] == 1:
            y = quant.matvec(self.matrix, x[0])[None, :]                               # [1, n_out]
        else:
            y = quant.matmul(self.matrix, x)                                            # [n, n_out]
        if self.bias is not None:
            y += self.bias
        return y

    def rows(self, ids) -> np.ndarray:
        """Dequantize rows `ids` only (the embedding lookup): `[len(ids), n_in]` float32."""
        ids = np.asarray(ids, dtype=np.int64)
        return quant.dequantize_rows(self.info.data, self.info.ggml_type, self.n_in, ids)


class FusedLinear:
    """Several projections of the same input, run as one kernel call when their formats match."""

    def __init__(self, parts: list[LinearWeight]):
        self.parts = parts
        self.splits = np.cumsum([p.n_out for p in parts])[:-1].tolist()
        same = len({(p.info.ggml_type, p.n_in) for p in parts}) == 1
        self.fused = quant.MultiMatrix([p.matrix for p in parts]) if same else None
        biases = [p.bias if p.bias is not None else np.zeros(p.n_out, np.float32) for p in parts]
        self.bias = np.concatenate(biases) if any(p.bias is not None for p in parts) else None

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        """x `[n, n_in]` -> one `[n, n_out_i]` array per part."""
        if self.fused is None:
            return [p(x) for p in self.parts]
        if x.shape[0] == 1:
            y = quant.matvec(self.fused, x[0])[None, :]                                 # [1, sum n_out]
        else:
            y = quant.matmul(self.fused, x)                                              # [n, sum n_out]
        if self.bias is not None:
            y += self.bias
        return np.split(y, self.splits, axis=1)
