"""GGUF block formats: dequantization and the matrix kernels that compute with them.

A GGUF weight matrix W [n_out, n_in] is stored row by row; each row is a sequence of fixed-size
*blocks*, and each block holds a few scales plus small integer quants.  A value is recovered as
`d * q` (or `d * q - m`, `d * sc * q - dmin * m` ...).  The formats this engine computes with:

| format | elements / block | bytes / block | bits / weight | block layout (little-endian) | value |
|---|---|---|---|---|---|
| F32  | 1   | 4   | 32   | float32 | x |
| F16  | 1   | 2   | 16   | IEEE half | x |
| BF16 | 1   | 2   | 16   | bfloat16 (top half of a float32) | x |
| Q8_0 | 32  | 34  | 8.5  | d f16, qs int8[32] | d * q |
| Q4_0 | 32  | 18  | 4.5  | d f16, qs[16]: element j in the low nibble of byte j, j+16 in the high nibble | d * (q - 8) |
| Q4_1 | 32  | 20  | 5.0  | d f16, m f16, qs[16] (as Q4_0) | d * q + m |
| Q5_0 | 32  | 22  | 5.5  | d f16, qh u32 (bit j = 5th bit of element j), qs[16] | d * (q - 16) |
| Q5_1 | 32  | 24  | 6.0  | d f16, m f16, qh u32, qs[16] | d * q + m |
| Q4_K | 256 | 144 | 4.5  | d f16, dmin f16, scales[12] (8 x 6-bit sc + 8 x 6-bit m), qs[128]: 4 chunks of 32 bytes, low nibbles = sub-block 2k, high = 2k+1 | d * sc_s * q - dmin * m_s |
| Q5_K | 256 | 176 | 5.5  | d, dmin, scales[12] as Q4_K, qh[32] (bit s of byte l = 5th bit of element 32 s + l), qs[128] | d * sc_s * q - dmin * m_s |
| Q6_K | 256 | 210 | 6.56 | ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16] (one per 16 elements), d f16 | d * sc_s * (q - 32) |

(K-quant sub-blocks: 8 of 32 elements in Q4_K/Q5_K, 16 of 16 in Q6_K; the 6-bit scale packing is
ggml's `get_scale_min_k4`.)

What lives where:

* formats.py -- `SUPPORTED_TYPES`, `check_supported`, block geometry, each format's `vec_dot_type`.
* dequant.py -- `dequantize`, `dequantize_rows`: bit-exact against `gguf.quants.dequantize`.
* activations.py -- `quantize_activations`: the activation vector rounded to Q8_0 / Q8_1 / Q8_K /
  f16 / bf16 exactly as llama.cpp does on x86 (bit-exact against llama.cpp's `quantize_row_q8_*`),
  as int8 (and, on demand, the same integers as float32).
* decode.py -- decode kernels (`matvec`): integer-exact block products.  Integer VNNI kernels for
  Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q5_0 where the CPU has AVX512-VNNI; float kernels (32 float lanes per
  row) for the other formats and as the fallback.
* _simd.py -- the VNNI row dot products, emitted as LLVM IR through numba intrinsics: one weight row
  x one activation vector (decode), and one weight row x a tile of up to 8 activation rows (the
  multi-row kernels of `matmul`, bit-identical per row to the decode kernels).
* prefill.py -- prefill and batch decode (`matmul`): the multi-row integer kernels for the VNNI formats
  below `ROWS_BLAS_MIN_ROWS` rows (64, or 256-512 when OpenBLAS's workers do not spin), the decode
  kernel per row for the other formats below 16 rows, else dequantized tiles + BLAS.
* matrix.py -- `QuantMatrix`: a memory-mapped weight matrix in its block format; `MultiMatrix`:
  several of them sharing one input (q/k/v), quantized once, one output (one multi-row kernel call
  for all parts).
* reference.py -- slow numpy transcription of ggml's dot products (the kernels' test oracle).

Numerics: decode and prefill (with the default `exact_activations=True`) compute ggml's
formulas: same activation rounding, same integer block sums, same float32 scale products; only the
order of float additions differs (agreement ~1e-7 of the sum of |terms|).  The multi-row kernels
and the decode kernels agree bit for bit, so a batch of N streams decodes exactly as N single steps.

Performance (Xeon Sapphire Rapids, 2 cores, AVX-512 + VNNI, numba 0.68.1, numpy 2.4 / OpenBLAS
0.3.31, 2 threads; bench/bench_matvec.py, best of repeats; load average 0.5-1 while measuring: the
machine was shared with other work, so treat differences below ~10% as noise; the sweep varies by
~15% from run to run).  "Sweep" is every matrix of a Qwen3-0.6B-shaped model once, i.e. one decoded
token's weight traffic, mostly from DRAM; llama.cpp decodes the Q8_0 model at ~11.5 GB/s of weights
here.  The first six rows are the VNNI kernels, "was" the float kernels they replace (same bench,
earlier, quieter machine).  Prefill for those six: the multi-row kernels (path "rows") at m = 16 /
64 / 256, "was" the BLAS path then used from 16 rows on; "sweep x4" = ms per step of the model sweep
with 4 activation rows at once (batch decode of 4 streams; 4 decode calls per matrix took 35-37 ms
for Q4_K and 58 ms for Q8_0).  Details in prefill.py.

| format | decode GB/s, 1024->3072 (in cache) | decode GB/s, model sweep | ms per token, sweep | ms per step, sweep x4 | prefill GFLOP/s m=16 / 64 / 256 (1024->3072) | 1024->128 call |
|---|---|---|---|---|---|---|
| Q8_0 | 42-50 (was 21) | 15.5-17.6 (was 14.4) | 36-41 (was 44) | 46-51 | 200 / 219 / 196 (was 36 / 105 / 195) | 8 us (was 12) |
| Q4_K | 34-40 (was 10.4) | 13.0-16.7 (was 9.1) | 20-26 (was 37) | 29-33 | 259 / 240 / 261 (was 46 / 126 / 222) | 7-8 us (was 14) |
| Q6_K | 38-43 (was 11.5) | 14.4-15.6 (was 9.9) | 31-34 (was 50) | 36-37 | 283 / 276 / 267 (was 45 / 121 / 212) | 7.5 us (was 16) |
| Q5_0 | 26-30 (was 9.6) | 13.7-15.9 (was 9.2) | 26-30 (was 45) | 41-42 | 204 / 198 / 201 (was 42 / 120 / 202) | 8-9 us (was 17) |
| Q4_0 | 29-30 (was 11.9) | 12.3-15.1 (was 9.6) | 22-27 (was 35) | 38-39 | 226 / 212 / 202 (was 32 / 99 / 193) | 8 us (was 13) |
| Q5_K | 35-38 (was 7.7) | 11.9-13.2 (was 7.0) | 31-35 (was 59) | 33-34 | 234 / 250 / 242 (was 44 / 125 / 223) | 7 us (was 19) |
| Q4_1 | 12.4 | 10.6 | 35 | - | 27 / 86 / 168 | 14 us |
| Q5_1 | 11.4 | 9.8 | 46 | - | 38 / 106 / 194 | 16 us |
| F16  | 36 | 16.1 | 74 | - | 46 / 126 / 212 | 14 us |
| BF16 | 32 | 17.6 | 68 | - | 46 / 127 / 219 | 21 us |
| F32  | 30 | 18.6 | 128 | - | 81 / 192 / 285 | 19 us |

Threads: the decode and multi-row kernels run on numba's thread pool (`numba.set_num_threads`,
chosen by the caller); the BLAS prefill path runs serial numba tiles plus OpenBLAS's own threads.
OpenBLAS's idle workers spin ~0.1 s after each threaded call and halve the numba kernels' speed
meanwhile (prefill.py: measured, and why "auto" switches to BLAS at 64 rows unless the process
started with OPENBLAS_THREAD_TIMEOUT <= 20).  Importing this
package sets `GOMP_SPINCOUNT=10000` unless the user set it (or OMP_WAIT_POLICY): numba's OpenMP
threads otherwise spin for milliseconds after every kernel and starve the next OpenBLAS call
(matvec + sgemm back to back: 7.6 ms instead of 2.4 ms; under load from another process the
default made back-to-back matvecs 10x slower).  See decode.py.

The weight-streaming kernels are memory-bound (sweep well below in-cache speed) for the VNNI
formats and F16/BF16/F32; the float kernels of Q4_1/Q5_1 (and of every format on CPUs without
AVX512-VNNI) unpack every quant to float32 and are compute-bound (decode.py and _simd.py tell what
was tried).  The activation quantization the VNNI kernels need costs ~2.5 us per call from Python.  Dequantizing a 151936 x 896 embedding table: 0.08 s (Q8_0), 0.07 s (Q5_0) with 2 threads.
"""

from .activations import QuantizedActivations, fake_quant, quantize_activations
from .dequant import dequantize, dequantize_rows
from .formats import QK_K, SUPPORTED_TYPES, VEC_DOT_TYPE, block_geometry, check_supported, row_bytes
from .prefill import PREFILL_MIN_ROWS, matmul
from .matrix import MultiMatrix, QuantMatrix
from .decode import matvec, matvec_quantized

__all__ = [
    "SUPPORTED_TYPES", "VEC_DOT_TYPE", "QK_K", "check_supported", "block_geometry", "row_bytes",
    "dequantize", "dequantize_rows", "QuantMatrix", "MultiMatrix", "matvec", "matvec_quantized", "matmul",
    "PREFILL_MIN_ROWS", "quantize_activations", "QuantizedActivations", "fake_quant",
]
