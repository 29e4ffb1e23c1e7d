"""Weight matrices as the model sees them: `y = x @ W.T (+ b)` and embedding row
lookups.

A `LinearWeight` wraps one GGUF tensor *in its own block format*: the bytes stay
memory-mapped and the `quant` kernels decode them on the fly, so loading a model costs
no more memory than mapping its file.  On top of that:

* **Embedding rows.**  `rows(ids)` dequantizes only the rows asked for (a prompt's
  tokens), never the whole 151,936-row table.
* **Tied output.**  Many small models reuse the embedding table as the output projection
  (lm_head); `Model.load` then hands the *same* `LinearWeight` to both roles: no copy.
* **Fused projections.**  q/k/v (and the FFN's gate/up) read the same input.  When their
  formats match, `FusedLinear` treats them as one `[sum n_out, n_in]` matrix
  (`quant.MultiMatrix`): the activations are quantized once and every part's kernel
  writes its slice of one output, with no weight bytes copied.  When formats differ (the
  Qwen2.5-Coder file stores q/k in Q5_0 and v in Q8_0), each run of neighbouring parts
  of one format is such a matrix: q+k and v, two calls instead of three (a layer's
  decode qkv 64.5 -> 55.2 us with avx2 kernels, docs/BENCHMARKS.md).
* **Expert stacks.**  A mixture-of-experts file stores each projection of all E experts
  as one `[E, n_out, n_in]` tensor; `WeightReader.experts` hands out one `LinearWeight`
  per expert, each viewing its contiguous slice of the mapped bytes (moe.py).
* **One table.**  `WeightReader` fetches a model's tensors as its family's table lists
  them (families.py), after validate.py has checked the file against the same table.

`path` chooses how a matrix meets several activation rows (`quant.matmul`): "auto"
(fastest for the row count) or "rows", which computes every row with the decode kernels'
numerics (the cache oracle uses it: kv_cache.py, `Model.forward_last_logits`).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import groupby
from threading import get_ident
from typing import NamedTuple

import numpy as np

from . import quant
from .quant import isa
from .errors import ShapeMismatch
from .gguf_file import GGUFFile, TensorInfo
from .tape import Watched, call, fresh


_UNBOUND = (None, None)
_F32 = np.dtype(np.float32)


class _Product(Watched):
    """y = x @ W.T (+ b) for a matrix in its block format: the one multiply of
    `LinearWeight` and of each group of a `FusedLinear`.

    One row (decode) runs the matrix x vector kernel bound once per instruction-set
    level and thread (`quant.bound_matvec`: the kernel and every argument that depends
    on the matrix alone, looked up once): `quant.matvec`'s checks and lookups cost ~3 us
    a call, ~5% of a SmolLM2 decode step.  More rows run `quant.matmul`."""

    _bound: dict      # {thread id: (isa level, bound kernel)}

    matrix: quant.QuantMatrix | quant.MultiMatrix
    bias: np.ndarray | None

    def _multiply(self, x: np.ndarray, path: str = "auto",
                  out: np.ndarray | None = None) -> np.ndarray:
        """x `[n, n_in]` -> `[n, n_out]` (+ bias), into `out` (C-contiguous) if given."""
        if len(x) == 1:
            if out is None:
                out = np.empty((1, self.matrix.n_out), np.float32)          # [1, n_out]
            call(self._kernel(), _vector(x), out[0])
        else:
            out = quant.matmul(self.matrix, x, out, path=path)               # [n, n_out]
        if self.bias is not None:
            call(np.add, out, self.bias, out)
        return out

    def _kernel(self):
        """The matrix x vector kernel bound for this thread at the current level."""
        level, kernel = self._bound.get(get_ident(), _UNBOUND)
        if level is not isa.level:      # per thread: a bound kernel has its scratch
            level, kernel = self._bound[get_ident()] = (
                isa.level, quant.bound_matvec(self.matrix))
        return kernel


class LinearWeight(_Product):
    """An `[n_out, n_in]` weight matrix (+ float32 bias) in its GGUF block format."""

    def __init__(self, info: TensorInfo, bias: np.ndarray | None = None):
        quant.check_supported(info.ggml_type, info.name)
        if len(info.shape) != 2:
            raise ShapeMismatch(f"tensor {info.name!r} should be 2-D, "
                                f"has shape {info.shape}")
        self.info = info
        self.n_in, self.n_out = info.shape
        self.matrix = quant.QuantMatrix.from_tensor(info)
        self.bias = (None if bias is None
                     else np.ascontiguousarray(bias, dtype=np.float32))
        self._bound = {}

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def type_name(self) -> str:
        return self.info.type_name

    @property
    def nbytes(self) -> int:
        return self.info.n_bytes

    # x `[n, n_in]` -> `[n, n_out]` (+ bias), into `out` (C-contiguous) if given
    __call__ = _Product._multiply

    def rows(self, ids) -> np.ndarray:
        """Dequantize rows `ids` only (embedding lookup): float32 `[len(ids), n_in]`."""
        ids = np.asarray(ids, dtype=np.int64)
        info = self.info
        return quant.dequantize_rows(info.data, info.ggml_type, self.n_in, ids)


class FusedLinear(Watched):
    """Projections of the same input, one kernel call per run of parts of one format."""

    def __init__(self, parts: list[LinearWeight]):
        self.parts = parts
        self.groups = [_Group(run) for _, run in groupby(
            parts, key=lambda p: (p.info.ggml_type, p.n_in))]
        # one group: every part in one kernel call (moe.py reads its MultiMatrix)
        self.fused = self.groups[0].matrix if len(self.groups) == 1 else None
        self.n_out = sum(p.n_out for p in parts)
        self._layouts: dict[int, _Layout] = {}    # id(out) -> where what goes

    def __call__(self, x: np.ndarray, path: str = "auto", out: np.ndarray | None = None,
                 head_dim: int | None = None) -> list[np.ndarray]:
        """x `[n, n_in]` -> one `[n, n_out_i]` array per part (views of one result per
        group); with `head_dim`, `[n, n_out_i / head_dim, head_dim]` (attention's
        heads).  `out`: a flat float32 buffer of at least n * `n_out` values; group g's
        result is the C-contiguous `[n, n_out_g]` block after the previous groups'."""
        n = len(x)
        if out is None:
            parts = []
            for g in self.groups:
                y = g._multiply(x, path, None)                         # [n, n_out_g]
                # views by slicing: np.split took 5 us a call, 1 us this (2% of a
                # SmolLM2 token)
                parts += [y[:, a:b] for a, b in g.bounds]
            return parts if head_dim is None else [_heads(p, head_dim) for p in parts]
        layout = self._layout(out, n, head_dim)
        for g, y in zip(self.groups, layout.blocks):
            g._multiply(x, path, y)
        return layout.parts

    def _layout(self, out: np.ndarray, n: int, head_dim: int | None) -> "_Layout":
        """Where each group writes in `out` for n rows, and each part's view: worked
        out once per buffer and row count, since a step's workspace is the same buffer
        every time (the slicing cost ~2 us a call)."""
        got = self._layouts.get(id(out))
        if got is None or got.out is not out or got.n != n or got.head_dim != head_dim:
            blocks, start = [], 0
            for g in self.groups:
                blocks.append(out[start:start + n * g.n_out].reshape(n, g.n_out))
                start += n * g.n_out
            parts = [y[:, a:b] for g, y in zip(self.groups, blocks) for a, b in g.bounds]
            if head_dim is not None:
                parts = [_heads(p, head_dim) for p in parts]
            if len(self._layouts) >= 8:     # (a long prefill's one-off buffers)
                self._layouts.clear()
            got = self._layouts[id(out)] = _Layout(out, n, head_dim, blocks, parts)
        return got


class _Layout(NamedTuple):
    out: np.ndarray
    n: int
    head_dim: int | None
    blocks: list            # each group's [n, n_out_g] block of out
    parts: list             # each part's [n, n_out_i] view


def _heads(part: np.ndarray, head_dim: int) -> np.ndarray:
    """`[n, heads * head_dim]` -> `[n, heads, head_dim]` (a view)."""
    return part.reshape(len(part), -1, head_dim)


def _vector(x: np.ndarray) -> np.ndarray:
    """x as the bound kernels take it: float32, C-contiguous, writeable."""
    flags = x.flags
    if x.dtype is not _F32 or not (flags.c_contiguous and flags.writeable):
        x = np.array(x, np.float32)
        fresh()
    return x


class _Group(_Product):
    """Neighbouring parts of one format and row length as one `quant.MultiMatrix`, with
    their biases (zeros where a part has none) and each part's output columns."""

    def __init__(self, parts):
        parts = list(parts)
        self.matrix = (quant.MultiMatrix([p.matrix for p in parts]) if len(parts) > 1
                       else parts[0].matrix)
        self.n_out = self.matrix.n_out
        self._bound = {}
        ends = np.cumsum([p.n_out for p in parts]).tolist()
        self.bounds = list(zip([0] + ends[:-1], ends))
        self.bias = None
        if any(p.bias is not None for p in parts):
            self.bias = np.concatenate([p.bias if p.bias is not None
                                        else np.zeros(p.n_out, np.float32)
                                        for p in parts])


class WeightReader:
    """A model's tensors as its family's table lists them (families.py), one object per
    role: a float32 vector (norms), a `LinearWeight` (+ its bias), or one
    `LinearWeight` per expert of a stacked tensor.

    Only for a file that `validate.check_tensors` has passed: every tensor the table
    lists is there, with the shape the config implies and a type the engine computes
    with, so nothing is checked a second time here."""

    def __init__(self, gguf: GGUFFile, cfg):
        self.gguf, self.cfg = gguf, cfg

    def model(self) -> dict:
        """{role: weight} of the tensors outside the layers (an absent optional one:
        None)."""
        return {t.role: self.load(t) for t in self.cfg.family.model}

    def layer(self, i: int) -> dict:
        """{role: weight} of layer i's tensors."""
        return {t.role: self.load(t, f"blk.{i}.") for t in self.cfg.family.layer}

    def load(self, spec, prefix: str = ""):
        """The tensor `prefix + spec.name` as its role uses it (None if optional and
        absent)."""
        name = prefix + spec.name
        if name not in self.gguf.tensors:
            if spec.optional:
                return None
            self.gguf.tensor(name)          # raises: the file lacks it
        if len(spec.dims) == 1:
            return self.vector(name)
        bias = self.vector(prefix + spec.bias) if spec.bias else None
        if len(spec.dims) == 2:
            return LinearWeight(self.gguf.tensor(name), bias)
        return self.experts(name, spec.shape(self.cfg)[0])

    def vector(self, name: str) -> np.ndarray:
        """Tensor `name` (F32) as a float32 array, zero-copy."""
        return self.gguf.tensor(name).data.view(np.float32)

    def experts(self, name: str, n_experts: int) -> list[LinearWeight]:
        """`name`, a stack of n_experts `[n_out, n_in]` matrices (GGML shape (n_in,
        n_out, n_experts)), as one `LinearWeight` per expert.

        Expert e is rows e*n_out ... (e+1)*n_out of the stack, a contiguous run of
        bytes: each expert views its slice of the memory map, nothing is copied."""
        t = self.gguf.tensor(name)
        n_in, n_out = t.shape[:2]
        per = t.n_bytes // n_experts
        flat = t.data.reshape(-1)
        return [LinearWeight(replace(t, name=f"{t.name}[{e}]", shape=(n_in, n_out),
                                     n_bytes=per, data=flat[e * per:(e + 1) * per]))
                for e in range(n_experts)]
