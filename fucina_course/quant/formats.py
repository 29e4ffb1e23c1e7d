"""Which GGML block formats the engine computes with, their block geometry, and their dot partner.

`VEC_DOT_TYPE[t]` is the format ggml converts the *activations* to before a matrix product with
weights of format `t` (ggml-cpu.c, `type_traits_cpu[t].vec_dot_type`).  The engine does the same so
its decode numerics match llama.cpp's: see quant/activations.py.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from ..errors import UnsupportedFormat

QK_K = 256  # elements of a K-quant super-block

SUPPORTED_TYPES: frozenset[T] = frozenset({
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K,
})

VEC_DOT_TYPE: dict[T, T] = {
    T.F32: T.F32,
    T.F16: T.F16,
    T.BF16: T.BF16,
    T.Q8_0: T.Q8_0,
    T.Q4_0: T.Q8_0,
    T.Q5_0: T.Q8_0,
    T.Q4_1: T.Q8_1,
    T.Q5_1: T.Q8_1,
    T.Q4_K: T.Q8_K,
    T.Q5_K: T.Q8_K,
    T.Q6_K: T.Q8_K,
}


def _names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))


def check_supported(ggml_type, tensor_name: str) -> None:
    """Raise `UnsupportedFormat` unless the engine has kernels for `ggml_type`."""
    try:
        t = T(int(ggml_type))
    except ValueError:
        raise UnsupportedFormat(
            f"tensor {tensor_name!r} is stored as unknown GGML type {int(ggml_type)}, which this engine "
            f"cannot compute with (supported: {_names()})") from None
    if t not in SUPPORTED_TYPES:
        raise UnsupportedFormat(
            f"tensor {tensor_name!r} is stored as {t.name}, which this engine cannot compute with "
            f"(supported: {_names()})")


def block_geometry(ggml_type) -> tuple[int, int]:
    """(elements per block, bytes per block).  F32/F16/BF16 count as blocks of one element."""
    return GGML_QUANT_SIZES[T(int(ggml_type))]


def row_bytes(ggml_type, row_len: int) -> int:
    """Bytes of one row of `row_len` elements; the row must hold a whole number of blocks."""
    qk, bpb = block_geometry(ggml_type)
    if row_len % qk:
        raise ValueError(f"a {T(int(ggml_type)).name} row of {row_len} elements is not a whole number "
                         f"of {qk}-element blocks")
    return row_len // qk * bpb
