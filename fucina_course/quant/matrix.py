"""`QuantMatrix`: one weight matrix, memory-mapped, still in its GGUF block format."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .dequant import as_readonly_u8, dequantize_into
from .formats import FORMATS, VEC_DOT_TYPE, check_supported, row_bytes


class QuantMatrix:
    """A weight matrix W [n_out, n_in] (GGML shape (n_in, n_out)) in its block format.

    Nothing is widened or copied at construction: `raw` is a read-only uint8 view
    [n_out, row_bytes] of the (memory-mapped) tensor bytes, `flat` the same bytes as one
    row (for the kernels' prefetch), and for F16/BF16/F32 `wv` views the bytes as
    uint16/float32 [n_out, n_in].

    No side arrays are precomputed: the kernels read each block's f16 scale where it
    lies.  A float32 copy of the Q8_0 scales streamed ~5% faster but was rejected: +12%
    memory, and building it at load faults in every page of the mapped file before the
    first token (docs/BENCHMARKS.md#float-kernels).
    """

    __slots__ = ("name", "ggml_type", "n_out", "n_in", "raw", "flat", "wv",
                 "vec_dot_type", "_parts")

    def __init__(self, raw: np.ndarray, ggml_type, n_out: int, n_in: int,
                 name: str = "<matrix>"):
        t = T(int(ggml_type))
        check_supported(t, name)
        rb = row_bytes(t, n_in)
        a = as_readonly_u8(raw).reshape(-1)
        if a.size != n_out * rb:
            raise ValueError(f"tensor {name!r}: {a.size} bytes, expected {n_out} "
                             f"rows x {rb} bytes ({t.name})")
        self.name = name
        self.ggml_type = t
        self.n_out = int(n_out)
        self.n_in = int(n_in)
        self.flat = a                                   # [n_out * row_bytes]
        self.raw = a.reshape(n_out, rb)                 # [n_out, row_bytes]
        self.vec_dot_type = VEC_DOT_TYPE[t]
        if t in (T.F16, T.BF16):
            self.wv = self.raw.view(np.uint16)          # [n_out, n_in]
        elif t == T.F32:
            self.wv = self.raw.view(np.float32)         # [n_out, n_in]
        else:
            self.wv = None
        self._parts = None

    def kernel_parts(self) -> tuple[np.ndarray, int]:
        """(int64[1, 3] (address of the bytes, rows, first output column), row bytes):
        the matrix as the integer kernels (_int.run) take it.  The address
        stays valid while `self` lives."""
        if self._parts is None:
            parts = np.array([[self.flat.ctypes.data, self.n_out, 0]], np.int64)
            self._parts = (parts, row_bytes(self.ggml_type, self.n_in))
        return self._parts

    @classmethod
    def from_tensor(cls, t) -> "QuantMatrix":
        """From a `gguf_file.TensorInfo`: GGML shape (n_in, d1, d2, ...) ->
        W [d1*d2*..., n_in]."""
        check_supported(t.ggml_type, t.name)
        n_in = int(t.shape[0])
        n_out = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1
        return cls(t.data, t.ggml_type, n_out, n_in, name=t.name)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    @property
    def nbytes(self) -> int:
        return self.flat.size

    @property
    def block_size(self) -> int:
        return FORMATS[self.ggml_type].block_size

    def dequantize(self, rows=None) -> np.ndarray:
        """float32 [n_out, n_in] (or [len(rows), n_in]), bit-exact with gguf-py."""
        if rows is None:
            out = np.empty((self.n_out, self.n_in), np.float32)
            return dequantize_into(self.raw, self.ggml_type, 0, None, out)
        idx = np.asarray(rows, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -self.n_out or idx.max() >= self.n_out):
            raise IndexError(f"row index out of range for {self.name!r} with "
                             f"{self.n_out} rows")
        idx = np.where(idx < 0, idx + self.n_out, idx)
        out = np.empty((idx.size, self.n_in), np.float32)  # [len(rows), n_in]
        if idx.size:
            dequantize_into(self.raw, self.ggml_type, 0, idx, out)
        return out

    def __repr__(self) -> str:
        return (f"QuantMatrix({self.name!r}, {self.ggml_type.name}, "
                f"n_out={self.n_out}, n_in={self.n_in})")


class MultiMatrix:
    """Several matrices of one format and row length, used as one [sum n_out, n_in].

    For projections that read the same input (q/k/v, gate/up): `matvec`/`matmul`
    quantize the activations once and run each part's kernel into its slice of one
    output, in order -- except the multi-row integer kernels (matmul's path "rows"),
    which take all parts in one call.  The parts stay separate memory-mapped tensors
    (nothing is concatenated).
    """

    __slots__ = ("parts", "ggml_type", "n_in", "n_out", "vec_dot_type", "name",
                 "bounds", "_parts")

    def __init__(self, parts):
        parts = list(parts)
        if not parts:
            raise ValueError("MultiMatrix needs at least one matrix")
        kinds = {(p.ggml_type, p.n_in) for p in parts}
        if len(kinds) != 1:
            got = ", ".join(f"{p.name}: {p.ggml_type.name} x {p.n_in}" for p in parts)
            raise ValueError(f"MultiMatrix parts must share one format and one row "
                             f"length, got {got}")
        self.parts = parts
        self.ggml_type = parts[0].ggml_type
        self.n_in = parts[0].n_in
        ends = np.cumsum([p.n_out for p in parts])
        self.n_out = int(ends[-1])
        # the output slice of each part
        self.bounds = [(int(e - p.n_out), int(e)) for p, e in zip(parts, ends)]
        self.vec_dot_type = parts[0].vec_dot_type
        self.name = "+".join(p.name for p in parts)
        self._parts = None

    def kernel_parts(self) -> tuple[np.ndarray, int]:
        """(int64[P, 3], row bytes): every part as (address, rows, first output column),
        so that one multi-row kernel call covers all parts (one parallel region,
        activations prepared once)."""
        if self._parts is None:
            rows = np.array([[p.flat.ctypes.data, p.n_out, a]
                             for p, (a, _) in zip(self.parts, self.bounds)], np.int64)
            self._parts = (rows, row_bytes(self.ggml_type, self.n_in))
        return self._parts

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.n_in)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> np.ndarray:
        parts = [p.dequantize() for p in self.parts]
        return np.concatenate(parts, axis=0)                    # [n_out, n_in]

    def __repr__(self) -> str:
        return (f"MultiMatrix({self.name!r}, {self.ggml_type.name}, "
                f"n_out={self.n_out}, n_in={self.n_in})")
