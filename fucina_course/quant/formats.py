"""The GGML block formats the engine computes with: one record per format.

A GGUF weight matrix W [n_out, n_in] is stored row by row; each row is a sequence of
fixed-size *blocks*, and each block holds a few scales plus small integer quants.  A
value is recovered as `d * q` (or `d * q + m`, `d * sc * q - dmin * m`, ...).  Every
size and byte offset the rest of the package needs comes from the `FORMATS` records
below, and so does every kernel: `FORMATS[t].kernels` (a `FormatKernels`) names the
format's dequantizer, its float matvec kernel, the levels of its integer kernels and
their builders, and matmul's BLAS crossovers.  A new format is one record here plus its
kernels (the package docstring, "Adding a format", lists where they go).

`vec_dot_type` is the format ggml converts the *activations* to before a dot product
with weights of this format (ggml-cpu.c, `type_traits_cpu[t].vec_dot_type`).  The engine
does the same, so that its numbers are llama.cpp's (activations.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as T

from ..errors import UnsupportedFormat
from . import isa

QK_K = 256  # elements of a K-quant super-block


@dataclass(slots=True)
class FormatKernels:
    """What computes with one block format: `FORMATS[t].kernels`.

    Stated in the `FORMATS` records (choices, measured, that no code can derive):

    * `int_levels`: the isa levels with integer kernels (LLVM IR).  At the x86 levels
      they do matvec and matmul's tiles; at "generic" matvec only, and only where
      LLVM converts f16 natively (isa.GENERIC_IR).  Elsewhere matvec runs
      `float_matvec`, and matmul a matvec per row or BLAS.
    * `blas_from`: level -> the number of activation rows from which matmul's "auto"
      path leaves the tiles for BLAS (while OpenBLAS's workers spin, matmul.py uses
      64 for all).

    Registered by the module that defines each kernel, with `@registers` on its
    definition (dequant.py, matvec.py, _int_matvec.py, _int_matmul.py):

    * `dequantize`: `_dq_<fmt>(w, rows, r0, out)`, bit-exact against gguf-py;
    * `float_matvec`: `_mv_<fmt>`, the numba kernel every CPU runs; `float_q16`: it
      reads the quants as int16 (`QuantizedActivations.q16`), not as floats;
    * `int_rows`: (t, level) -> the RowSpec of the integer matvec kernel's row;
    * `int_tiles`: (t, level) -> the TileSpec of matmul's tile kernel.

    Why registration: the kernel modules import this one (for their block sizes and
    offsets), so it cannot import them back.  Names resolved lazily (strings) were
    the alternative: a typo would surface at the first call of that format at that
    level, and a kernel's definition would not say which format it serves; the
    decorator says it where the kernel is written, and tests/test_quant.py checks at
    once that every record is complete.  The dispatch tables (matvec.KERNELS,
    matmul.KERNELS, the thresholds) are built from these records at import.
    """

    int_levels: tuple[str, ...] = ()
    blas_from: dict[str, int] = field(default_factory=dict)
    dequantize: Callable | None = None
    float_matvec: Callable | None = None
    float_q16: bool = False
    int_rows: Callable | None = None
    int_tiles: Callable | None = None

    def missing(self) -> list[str]:
        """The fields no module has registered yet, of those this format needs."""
        need = ["dequantize", "float_matvec"]
        if self.int_levels:
            need.append("int_rows")
        if any(lv != isa.GENERIC for lv in self.int_levels):
            need.append("int_tiles")
        return [name for name in need if getattr(self, name) is None]


@dataclass(frozen=True)
class BlockFormat:
    """The layout of one GGML block format (little-endian; offsets in bytes).

    `d_offset` / `m_offset` are the f16 fields: the scale d, and the per-block minimum
    (m of Q4_1/Q5_1, dmin of the K-quants).  `zero_point` is what ggml subtracts from an
    unsigned stored quant (value = d * (q - zero_point)): Q4_0 8, Q5_0 16, Q6_K 32.
    `kernels`: what computes with the format (`FormatKernels`).
    """

    ggml_type: T
    block_size: int                  # elements per block (1 for F32 / F16 / BF16)
    block_bytes: int
    vec_dot_type: T
    d_offset: int | None = None
    m_offset: int | None = None
    qs_offset: int | None = None     # the packed low bits of the quants
    qh_offset: int | None = None     # the high bits (Q5_*: 5th bits, Q6_K: top 2 bits)
    scales_offset: int | None = None  # K-quants: the packed sub-block scales
    zero_point: int = 0
    kernels: FormatKernels = field(default_factory=FormatKernels, compare=False,
                                   repr=False)

    @property
    def f16_fields(self) -> tuple[int, ...]:
        """Byte offsets of the block's f16 scale fields (d, then m / dmin)."""
        return tuple(o for o in (self.d_offset, self.m_offset) if o is not None)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size


def _formats(*records: BlockFormat) -> dict[T, BlockFormat]:
    return {f.ggml_type: f for f in records}


def _int_kernels(blas_vnni: int, blas_avx2: int):
    """Integer kernels at the three x86 levels, the three aarch64 ones and generic,
    and their
    tiles' BLAS crossovers: `blas_vnni` rows at avx512vnni, `blas_avx2` at avx2 and
    avxvnni (avx2's until measured).

    The crossovers are the kernels' own, measured without OpenBLAS's spinning workers
    (docs/BENCHMARKS.md#prefill-paths, #instruction-set-levels): on avx2 the
    32-element formats' tiles (~45-52 GFLOP/s per core, indicative) fall behind an
    AVX2 sgemm (~58-65 at m = 256) from ~128 rows, the K-quants' (~80-90) not below
    512.  The generic level: every quantized format, whose IR kernels on int16
    activations beat the float ones (_int_matvec.py,
    docs/BENCHMARKS.md#generic-ir-kernels)."""
    arm = dict.fromkeys(isa.ARM, blas_avx2)       # not measured: packed GEMM from 16
    return FormatKernels(isa.X86 + isa.ARM + (isa.GENERIC,),
                         {isa.AVX512VNNI: blas_vnni, isa.AVXVNNI: blas_avx2,
                          isa.AVX2: blas_avx2, **arm})


FORMATS: dict[T, BlockFormat] = _formats(
    BlockFormat(T.F32, 1, 4, T.F32),
    BlockFormat(T.F16, 1, 2, T.F16),                 # IEEE half
    BlockFormat(T.BF16, 1, 2, T.BF16),               # the top half of a float32
    # d * q: qs int8[32]
    BlockFormat(T.Q8_0, 32, 34, T.Q8_0, d_offset=0, qs_offset=2,
                kernels=_int_kernels(blas_vnni=256, blas_avx2=128)),
    # d * (q - 8): element j in the low nibble of qs[j], j + 16 in its high nibble
    BlockFormat(T.Q4_0, 32, 18, T.Q8_0, d_offset=0, qs_offset=2, zero_point=8,
                kernels=_int_kernels(blas_vnni=512, blas_avx2=128)),
    # d * q + m: qs as Q4_0
    BlockFormat(T.Q4_1, 32, 20, T.Q8_1, d_offset=0, m_offset=2, qs_offset=4,
                kernels=_int_kernels(blas_vnni=256, blas_avx2=128)),
    # d * (q - 16): bit j of the u32 qh is the 5th bit of element j, qs as Q4_0
    BlockFormat(T.Q5_0, 32, 22, T.Q8_0, d_offset=0, qh_offset=2, qs_offset=6,
                zero_point=16,
                kernels=_int_kernels(blas_vnni=256, blas_avx2=128)),
    # d * q + m: qh and qs as Q5_0
    BlockFormat(T.Q5_1, 32, 24, T.Q8_1, d_offset=0, m_offset=2, qh_offset=4,
                qs_offset=8,
                kernels=_int_kernels(blas_vnni=256, blas_avx2=128)),
    # d * sc_s * q - dmin * m_s over 8 sub-blocks of 32: 8 six-bit (sc, m) pairs packed
    # in 12 bytes (ggml's get_scale_min_k4); qs: 4 chunks of 32 bytes, low nibbles =
    # sub-block 2k, high nibbles = 2k + 1
    BlockFormat(T.Q4_K, QK_K, 144, T.Q8_K, d_offset=0, m_offset=2, scales_offset=4,
                qs_offset=16,
                kernels=_int_kernels(blas_vnni=512, blas_avx2=512)),
    # as Q4_K, plus qh[32]: bit s of qh[l] is the 5th bit of element 32 s + l
    BlockFormat(T.Q5_K, QK_K, 176, T.Q8_K, d_offset=0, m_offset=2, scales_offset=4,
                qh_offset=16, qs_offset=48,
                kernels=_int_kernels(blas_vnni=512, blas_avx2=512)),
    # d * sc_s * (q - 32) over 16 sub-blocks of 16: ql[128] low 4 bits, qh[64] top 2
    # bits, scales int8[16], then d
    BlockFormat(T.Q6_K, QK_K, 210, T.Q8_K, d_offset=208, qs_offset=0, qh_offset=128,
                scales_offset=192, zero_point=32,
                kernels=_int_kernels(blas_vnni=512, blas_avx2=512)),
)

SUPPORTED_TYPES: frozenset[T] = frozenset(FORMATS)
VEC_DOT_TYPE: dict[T, T] = {t: f.vec_dot_type for t, f in FORMATS.items()}


def registers(name: str, *types: T, **facts):
    """Decorator: the function is the `name` field of each format's `FormatKernels`
    (with `facts`, other fields, set alongside), e.g. `@registers("dequantize",
    T.Q8_0)` over `_dq_q8_0`.  Returns the function unchanged (a numba dispatcher
    stays one: same signatures, same disk cache).  A second, different function for
    the same field is an error (two kernels claiming one format); the same one again
    is not (a module reloaded)."""
    def register(fn):
        for t in types:
            k = FORMATS[t].kernels
            old = getattr(k, name)
            if old is not None and _qualname(old) != _qualname(fn):
                raise ValueError(f"{t.name}: {name} is {_qualname(old)} already, "
                                 f"not {_qualname(fn)}")
            setattr(k, name, fn)
            for fact, value in facts.items():
                setattr(k, fact, value)
        return fn
    return register


def _qualname(fn) -> str:
    fn = getattr(fn, "py_func", fn)          # a numba dispatcher: its Python function
    return f"{fn.__module__}.{fn.__qualname__}"


def _names() -> str:
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))


def check_supported(ggml_type, tensor_name: str) -> None:
    """Raise `UnsupportedFormat` unless the engine has kernels for `ggml_type`."""
    try:
        t = T(int(ggml_type))
    except ValueError:
        raise UnsupportedFormat(
            f"tensor {tensor_name!r} is stored as unknown GGML type {int(ggml_type)}, "
            f"which this engine cannot compute with (supported: {_names()})") from None
    if t not in SUPPORTED_TYPES:
        raise UnsupportedFormat(
            f"tensor {tensor_name!r} is stored as {t.name}, which this engine cannot "
            f"compute with (supported: {_names()})")


def block_geometry(ggml_type) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported format."""
    f = FORMATS[T(int(ggml_type))]
    return f.block_size, f.block_bytes


def row_bytes(ggml_type, row_len: int) -> int:
    """Bytes of one row of `row_len` elements; the row must hold whole blocks."""
    qk, bpb = block_geometry(ggml_type)
    if row_len % qk:
        raise ValueError(f"a {T(int(ggml_type)).name} row of {row_len} elements is not "
                         f"a whole number of {qk}-element blocks")
    return row_len // qk * bpb
