"""GGUF block formats: dequantization, and the matrix kernels that compute with them.

Weights stay in their GGUF block format, memory-mapped; the kernels decode the blocks on
the fly.  What lives where (data flows top to bottom):

* formats.py -- one `BlockFormat` record per format (`FORMATS`): block size and bytes,
  the offsets of its fields, its `vec_dot_type`, and `kernels` (a `FormatKernels`):
  its dequantizer, its float matvec kernel, the levels and builders of its integer
  kernels, matmul's BLAS crossovers.  Start here to add a format.
* dequant.py -- `dequantize`, `dequantize_rows`: bit-exact against gguf-py.
* activations.py -- `quantize_activations`: the activation rows rounded to Q8_0 / Q8_1 /
  Q8_K / f16 / bf16 exactly as llama.cpp does on x86, as int8 (and float32) arrays.
* matrix.py -- `QuantMatrix`: one memory-mapped weight matrix in its block format;
  `MultiMatrix`: several sharing one input (q/k/v), quantized once.
* matvec.py -- `matvec`: matrix x one vector (decode); the generic float kernels, and
  the dispatch table keyed by (format, instruction-set level).
* matmul.py -- `matmul`: matrix x many rows (prefill, batch decode); multi-row integer
  kernels, the packed GEMM, or dequantized tiles + BLAS.
* isa.py -- the instruction-set levels (avx512vnni, avxvnni, avx2, generic), which ones
  this CPU runs, `isa.level`; FUCINA_SIMD forces a lower one.
* _int_matvec.py, _int_matmul.py -- the integer kernels of matvec and matmul for the
  three x86 levels, built in LLVM IR (_ir.py: IR helpers, the kernel functions);
  _int_packed.py -- prefill's GEMM at every level, weight rows repacked per call;
  _int.py -- one format's kernels at one level, compiled on first use, and `run`, the
  numba driver that runs them in parallel; _jit.py -- LLVM compiles them for exactly
  the level's features and caches the machine code on disk.
* (the first start, outside the package: fucina_course/startup.py's `pending` /
  `prepare` find which of these kernels a model's formats still need compiled, and
  compile them before the first token.)
* _intrinsics.py -- f16 <-> f32 and prefetch for numba code; _cache.py -- the disk
  caches stamped with the whole package (a kernel inlines IR from several files).
* reference.py -- ggml's dot products in slow numpy: the kernels' test oracle.

Adding a format.  The dispatch tables (matvec.KERNELS, matmul.KERNELS and its BLAS
crossovers), SUPPORTED_TYPES, `kernel_choices` and what a first start compiles are
built from the records, so a new format is:

1. its record in formats.py: layout, `vec_dot_type`, and `kernels=_int_kernels(...)`
   if it gets integer kernels (at which levels; matmul's BLAS crossovers);
2. its dequantizer in dequant.py and its float matvec kernel in matvec.py, each
   marked `@registers("dequantize", T.<fmt>)` / `@registers("float_matvec", ...)`;
3. with integer kernels, its row builder in _int_matvec.py and tile builder in
   _int_matmul.py (or a family's), named by a spec function registered as the
   record's `int_rows` / `int_tiles`;
4. its dot product in reference.py (the tests' oracle; `random_blocks` too if gguf-py
   cannot quantize it), and its name in tests/test_quant.py (`ALL`, `INT_TYPES`,
   `GENERIC_IR_TYPES`), whose tests then run it at every level and check that the
   record is complete.

A new activation format (`vec_dot_type`) also needs its quantizer in activations.py
(`row_quantizer` for the integer kernels); synthetic models in the format, synth.py.

Numerics: matvec and matmul (with the default `exact_activations=True`) compute ggml's
formulas: the same activation rounding, the same integer block sums, the same float32
scale products; only the order of float additions differs (~1e-7 of the sum of
|terms|).  The multi-row kernels agree with matvec bit for bit, so a batch of N
streams decodes exactly as N single steps; the packed GEMM (prefill, 16 rows and more)
scales each block's exact integer total as a whole, ggml's order, not matvec's.

Speed: decode streams the weights of a whole Qwen3-0.6B-shaped model faster than
llama.cpp did on the Q8_0 model, and short prefill runs at a few hundred GFLOP/s
(measured: docs/BENCHMARKS.md#quant-speed).  Every variant measured and the choices
they led to: docs/BENCHMARKS.md#kernel-variants-quant.
"""

from . import _cache  # noqa: F401  (before any cached kernel is defined)
from .activations import (NonFiniteActivations, QuantizedActivations, fake_quant,
                          quantize_activations)
from .dequant import dequantize, dequantize_rows
from .formats import (FORMATS, QK_K, SUPPORTED_TYPES, VEC_DOT_TYPE, BlockFormat,
                      block_geometry, check_supported, row_bytes)
from .matrix import MultiMatrix, QuantMatrix
from .matvec import bound_matvec, matvec, matvec_quantized
from .matmul import (PACKED_MIN_ROWS, PREFILL_MIN_ROWS, has_packed_kernel,
                     kernel_choices, matmul)

__all__ = [
    "FORMATS", "BlockFormat", "SUPPORTED_TYPES", "VEC_DOT_TYPE", "QK_K",
    "check_supported", "block_geometry", "row_bytes", "dequantize", "dequantize_rows",
    "QuantMatrix", "MultiMatrix", "matvec", "matvec_quantized", "bound_matvec",
    "matmul",
    "PREFILL_MIN_ROWS", "PACKED_MIN_ROWS", "has_packed_kernel", "quantize_activations",
    "QuantizedActivations", "fake_quant",
    "NonFiniteActivations",
    "kernel_choices",
]
