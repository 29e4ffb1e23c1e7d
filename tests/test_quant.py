"""Tests of fucina_course.quant: block formats, activation quantizers, matvec, matmul.

Oracles, from strongest to weakest:
* `gguf.quants` (gguf-py, maintained next to llama.cpp): dequantization must be
  bit-exact; Q8_0 activation quantization in `reference=True` mode must be bit-exact
  with `gguf.quants.quantize`.
* llama.cpp itself, when llama-cpp-python is installed: its
  `quantize_row_q8_0/q8_1/q8_K` must match ours bit for bit, and its `ggml_vec_dot_*`
  our matvec kernels to float32 rounding.
* reference.py, a plain numpy transcription of ggml's dot formulas (int64 block sums).
* float64 `W @ x` with an error bound derived from the activation quantization step.

Test data: formats gguf-py can quantize are made with `gguf.quants.quantize` from random
floats; K-quants (gguf-py cannot quantize them) are random bytes whose f16 scale fields
are overwritten with finite values (`reference.random_blocks`).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from numba import njit

from fucina_course.errors import UnsupportedFormat
from fucina_course.gguf_file import TensorInfo
from fucina_course.quant import (
    FORMATS, SUPPORTED_TYPES, VEC_DOT_TYPE, MultiMatrix, NonFiniteActivations,
    QuantMatrix, check_supported,
    dequantize, dequantize_rows, isa, matmul, matvec, matvec_quantized,
    quantize_activations,
)
from fucina_course.quant._intrinsics import f16_to_f32, f32_to_f16_bits
from fucina_course.quant import _int_packed, _jit
from fucina_course.quant._int import IntKernels
from fucina_course.quant.reference import random_blocks, reference_matvec

# the modules, not the functions `quant.matmul` / `quant.matvec` that shadow them as
# package attributes
matmul_mod = importlib.import_module("fucina_course.quant.matmul")
matvec_mod = importlib.import_module("fucina_course.quant.matvec")

ALL = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K,
       T.Q6_K]
GGUF_QUANTIZABLE = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
QK = {t: GGML_QUANT_SIZES[t][0] for t in ALL}


def bits(a: np.ndarray) -> np.ndarray:
    """The bit patterns of a float32 array: compare floats exactly."""
    return a.view(np.uint32)


def magnitude(w, qa, row: int = 0) -> np.ndarray:
    """float64[n_out]: sum_j |w_rj x_j|, the scale of row r's rounding error."""
    w64 = np.abs(w.dequantize().astype(np.float64))
    return w64 @ np.abs(qa.dequantized()[row].astype(np.float64))


def assert_close(y, ref, tol: float, mag, *what) -> None:
    """|y - ref| <= tol * mag elementwise (mag: the sum of |terms|, `magnitude`)."""
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= tol * mag + 1e-30), (*what, np.max(err / mag))


def make_weights(t, n_out: int, n_in: int, seed: int = 0,
                 scale: float = 0.02) -> np.ndarray:
    """uint8 bytes of an [n_out, n_in] matrix of format t (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if t in GGUF_QUANTIZABLE:
        x = (rng.standard_normal((n_out, n_in)) * scale).astype(np.float32)
        x[0, : min(n_in, 32)] = 0.0  # an all-zero block (d = 0)
        q = gq.quantize(x, t)
        return np.ascontiguousarray(q).view(np.uint8).reshape(-1)
    return random_blocks(rng, t, n_out * n_in, scale=scale / 8)


def row_len_for(t, n_blocks: int) -> int:
    return n_blocks * max(QK[t], 32)  # float formats: 32 at a time, comparable shapes


# formats with integer kernels at the x86 levels; the generic level's IR kernels
INT_TYPES = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]
GENERIC_IR_TYPES = INT_TYPES
x86_only = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="the integer kernels are x86 code")
INT_LEVELS = [lv for lv in isa.LEVELS if lv != isa.GENERIC]
PACKED_LEVELS = list(_int_packed.PACKED_LEVELS)


def _skip_unless_usable(level):
    if level not in isa.USABLE:
        features = isa.numba_cpu_features()
        on = {f[1:] for f in features.split(",") if f.startswith("+")}
        missing = ", ".join(sorted(isa.NEEDED[level] - on))
        pytest.skip(f"{level} kernels off: " + (f"numba's target CPU lacks {missing}"
                                               if missing else "FUCINA_SIMD caps it"))


GENERIC_FLOAT = "generic-float"   # the generic level, every format on its float kernel


@pytest.fixture(params=[*isa.LEVELS, GENERIC_FLOAT])
def kernels(request, monkeypatch):
    """Run a test once per instruction-set level this CPU runs (generic everywhere),
    and once with the float kernels: the generic level runs portable IR kernels for
    the 4- and 5-bit formats where it can (isa.GENERIC_IR), the float ones elsewhere."""
    level = request.param
    if level == GENERIC_FLOAT:
        level = isa.GENERIC
        for t, k in matvec_mod.FLOAT_KERNELS.items():
            monkeypatch.setitem(matvec_mod._BY_VALUE, (int(t), isa.GENERIC), k)
    _skip_unless_usable(level)
    monkeypatch.setattr(isa, "level", level)
    return request.param


GENERIC_INT16 = "generic-int16"   # the generic level's packed GEMM on int16 pairs


@pytest.fixture(params=[*PACKED_LEVELS, GENERIC_INT16])
def packed_level(request, monkeypatch):
    """Run a test once per level of the packed GEMM this CPU runs, and once with the
    generic level's int16 pairs for every format (what it runs off x86, and for
    Q8_0: _int_packed.byte_products), in kernels of their own name, so that neither
    the process's kernels nor the disk cache mix the two."""
    level = isa.GENERIC if request.param == GENERIC_INT16 else request.param
    _skip_unless_usable(level)
    if level == isa.GENERIC and not isa.GENERIC_IR:
        pytest.skip("no generic IR kernels here (isa.GENERIC_IR)")
    if request.param == GENERIC_INT16:
        for t in PACKED_TYPES:
            k = IntKernels(t, isa.GENERIC)
            k.name += "_int16"
            with monkeypatch.context() as only_here:    # not for the test's own kernels
                only_here.setattr(_int_packed, "byte_products",
                                  lambda t, level, triple=None: level != isa.GENERIC)
                k.compile()
            monkeypatch.setitem(matmul_mod._PACKED_BY_VALUE, (int(t), isa.GENERIC), k)
    monkeypatch.setattr(isa, "level", level)
    return request.param


@pytest.fixture(params=INT_LEVELS)
def int_level(request, monkeypatch):
    """Run a test once per integer level this CPU runs."""
    _skip_unless_usable(request.param)
    monkeypatch.setattr(isa, "level", request.param)
    return request.param


# --- formats and errors ---------------------------------------------------------------

def test_supported_set_and_vec_dot_types():
    assert SUPPORTED_TYPES == frozenset(ALL) == frozenset(FORMATS)
    assert set(VEC_DOT_TYPE) == set(ALL)
    assert VEC_DOT_TYPE[T.Q4_1] == T.Q8_1 and VEC_DOT_TYPE[T.Q6_K] == T.Q8_K
    assert VEC_DOT_TYPE[T.Q5_0] == T.Q8_0


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_format_records_match_ggml(t):
    # sizes against gguf-py's table; f16 offsets and zero points against its dequantizer
    f = FORMATS[t]
    assert (f.block_size, f.block_bytes) == GGML_QUANT_SIZES[t] and f.ggml_type == t
    if f.block_size == 1:
        return
    nb = 4
    raw = random_blocks(np.random.default_rng(0), t, nb * f.block_size).reshape(nb, -1)
    zeroed = raw.copy()
    for off in f.f16_fields:                      # d = 0 (and m / dmin = 0): all zero
        zeroed[:, off:off + 2] = 0
    assert not gq.dequantize(zeroed, t).any(), t.name
    if f.zero_point:                              # every quant = zero_point: all zero
        q = raw.copy()
        lo = f.zero_point & 0xF
        q[:, f.qs_offset:f.qs_offset + f.block_size // 2] = lo | (lo << 4)
        if t == T.Q5_0:                           # 16: the 5th bit of every element
            q[:, f.qh_offset:f.qh_offset + 4] = 0xFF
        if t == T.Q6_K:                           # 32: high 2 bits = 0b10 everywhere
            q[:, f.qh_offset:f.qh_offset + 64] = 0xAA
        assert not gq.dequantize(q, t).any(), t.name


@pytest.mark.parametrize("t", [T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ2_XXS, T.Q8_K])
def test_unsupported_formats_raise(t):
    with pytest.raises(UnsupportedFormat) as e:
        check_supported(t, "blk.0.ffn_down.weight")
    msg = str(e.value)
    assert "'blk.0.ffn_down.weight'" in msg and t.name in msg and "Q4_K" in msg
    qk, bpb = GGML_QUANT_SIZES[t]
    raw = np.zeros(bpb * 2, np.uint8)
    with pytest.raises(UnsupportedFormat):
        dequantize(raw, t, 2 * qk)
    with pytest.raises(UnsupportedFormat):
        QuantMatrix(raw, t, 2, qk)
    ti = TensorInfo(name="output.weight", ggml_type=t, shape=(qk, 2), n_bytes=raw.size,
                    data=raw)
    with pytest.raises(UnsupportedFormat, match="output.weight"):
        QuantMatrix.from_tensor(ti)
    for t_ok in ALL:
        check_supported(t_ok, "x")  # no exception


def test_bad_shapes_raise():
    raw = make_weights(T.Q8_0, 4, 64)
    with pytest.raises(ValueError):
        QuantMatrix(raw, T.Q8_0, 4, 48)       # 48 is not a whole number of blocks
    with pytest.raises(ValueError):
        QuantMatrix(raw, T.Q8_0, 5, 64)       # wrong byte count
    w = QuantMatrix(raw, T.Q8_0, 4, 64)
    with pytest.raises(ValueError):
        matvec(w, np.zeros(63, np.float32))
    with pytest.raises(ValueError):
        matvec(w, np.zeros(64, np.float32), out=np.zeros(5, np.float32))
    with pytest.raises(ValueError):
        matmul(w, np.zeros((3, 64), np.float32), out=np.zeros((3, 5), np.float32))
    with pytest.raises(ValueError):
        matmul(w, np.zeros((3, 64), np.float32), path="gemv", exact_activations=False)
    with pytest.raises(IndexError):
        dequantize_rows(raw, T.Q8_0, 64, [4])


# --- the f16 intrinsics ---------------------------------------------------------------

@njit
def _all_f16(u, out):
    for i in range(u.size):
        out[i] = f16_to_f32(u[i])


@njit
def _all_to_f16(x, out):
    for i in range(x.size):
        out[i] = f32_to_f16_bits(x[i])


def test_f16_intrinsics_exhaustive():
    u = np.arange(65536, dtype=np.uint16)
    got = np.empty(65536, np.float32)
    _all_f16(u, got)
    ref = u.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
    # float32 -> f16 rounding (ties to even, subnormals, overflow) against numpy
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_000) * 10.0 ** rng.integers(-9, 6, 200_000)
    x = x.astype(np.float32)
    edge = np.array([65504, 65519.99, 65520, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26,
                     1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -0.0, np.inf, -np.inf],
                    np.float32)
    x = np.concatenate([x, edge, ref[~nan]])
    bits = np.empty(x.size, np.uint16)
    _all_to_f16(x, bits)
    with np.errstate(over="ignore"):
        assert np.array_equal(bits, x.astype(np.float16).view(np.uint16))


# --- dequantization -------------------------------------------------------------------

SHAPES = [(1, 1), (7, 1), (5, 9), (33, 3), (2, 16)]  # (rows, blocks per row)


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_dequantize_bit_exact_against_gguf(t):
    for seed, (n_out, nb) in enumerate(SHAPES):
        n_in = row_len_for(t, nb)
        raw = make_weights(t, n_out, n_in, seed=seed)
        ref = gq.dequantize(raw.reshape(n_out, -1), t).reshape(-1).astype(np.float32)
        got = dequantize(raw, t, n_out * n_in)
        assert got.dtype == np.float32 and got.shape == (n_out * n_in,)
        assert np.array_equal(bits(got), bits(ref)), (t.name, n_out, nb)
        w = QuantMatrix(raw, t, n_out, n_in)
        assert np.array_equal(bits(w.dequantize().reshape(-1)), bits(ref))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1, T.Q5_0, T.Q4_K, T.Q5_K, T.Q6_K],
                         ids=lambda t: t.name)
def test_dequantize_subnormal_scales(t):
    # scales of ~1e-6 are f16 subnormals: the conversion must still be exact
    raw = random_blocks(np.random.default_rng(5), t, 64 * QK[t], scale=1e-6)
    ref = gq.dequantize(raw.reshape(64, -1), t).reshape(-1)
    assert np.array_equal(bits(dequantize(raw, t, 64 * QK[t])), bits(ref))


def test_dequantize_large_table_multithreaded():
    # 2^17 blocks: dequantize() splits the work over threads; each part lands in place
    raw = random_blocks(np.random.default_rng(3), T.Q5_0, (1 << 17) * 32)
    ref = gq.dequantize(raw.reshape(-1, 22 * 64), T.Q5_0).reshape(-1)
    assert np.array_equal(bits(dequantize(raw, T.Q5_0, ref.size)), bits(ref))


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_dequantize_rows_matches_full(t):
    n_out, nb = 37, 3
    n_in = row_len_for(t, nb)
    raw = make_weights(t, n_out, n_in, seed=11)
    full = gq.dequantize(raw.reshape(n_out, -1), t).reshape(n_out, n_in)
    rows = np.array([0, 36, 5, 5, -1, 17])
    got = dequantize_rows(raw, t, n_in, rows)
    assert got.shape == (6, n_in)
    assert np.array_equal(bits(got), bits(full[rows].astype(np.float32)))
    got2 = dequantize_rows(raw.reshape(n_out, -1), t, n_in, [3])  # [n_rows, row_bytes]
    assert np.array_equal(got2[0], full[3])
    assert dequantize_rows(raw, t, n_in, []).shape == (0, n_in)
    w = QuantMatrix(raw, t, n_out, n_in)
    assert np.array_equal(w.dequantize(rows), got)


def test_from_tensor_uses_ggml_shape_order_and_stays_a_view():
    n_out, n_in = 12, 64
    raw = make_weights(T.Q8_0, n_out, n_in)
    raw.flags.writeable = False  # like the memory map
    ti = TensorInfo(name="blk.0.attn_q.weight", ggml_type=T.Q8_0, shape=(n_in, n_out),
                    n_bytes=raw.size, data=raw)
    w = QuantMatrix.from_tensor(ti)
    assert (w.n_out, w.n_in) == (n_out, n_in) and w.nbytes == raw.size
    assert np.shares_memory(w.raw, raw)  # never copied or widened
    assert not w.raw.flags.writeable


# --- activation quantizers ------------------------------------------------------------

def _activations(m=8, n=1024, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, n)) * rng.random((m, 1)) * 3).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :32] = np.arange(32) - 16.0  # exact ties under 127/amax scaling
    return x


def q8_bytes(v: np.ndarray, n: int) -> np.ndarray:
    """Small integers held as floats -> their int8 bytes, n per row."""
    return v.reshape(-1, n).astype(np.int8).view(np.uint8)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 values -> the two bytes of each as an f16, one pair per row."""
    return v.reshape(-1).astype(np.float16).view(np.uint8).reshape(-1, 2)


def test_q8_0_reference_mode_matches_gguf_py():
    x = _activations()
    ref = gq.quantize(x, T.Q8_0).reshape(-1, 34)
    qa = quantize_activations(x, T.Q8_0, reference=True)
    assert np.array_equal(q8_bytes(qa.q, 32), ref[:, 2:])
    assert np.array_equal(f16_bytes(qa.d), ref[:, :2])


def test_q8_0_x86_rounding_differs_from_reference_on_ties():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 127.0, 2.5, -3.5  # amax = 127: id = 1, so 2.5 and -3.5 are ties
    x86 = quantize_activations(x, T.Q8_0).q[0]
    ref = quantize_activations(x, T.Q8_0, reference=True).q[0]
    assert (x86[1], x86[2]) == (2.0, -4.0)   # _mm256_round_ps: half to even
    assert (ref[1], ref[2]) == (3.0, -4.0)   # roundf: half away from zero
    want = gq.quantize(x, T.Q8_0)[2:5].view(np.int8).astype(np.float32)
    assert np.array_equal(ref[:3], want)


def test_q8_k_and_q8_1_properties():
    x = _activations()
    qk = quantize_activations(x, T.Q8_K)
    assert qk.q.shape == x.shape and qk.d.shape == (8, 4) and qk.bsum32.shape == (8, 32)
    assert np.all(np.abs(qk.q) <= 127) and np.all(qk.q == np.round(qk.q))
    assert np.array_equal(qk.bsum32, qk.q.reshape(8, 32, 32).sum(-1).astype(np.int32))
    assert np.all(qk.q[0, :256] == 0) and qk.d[0, 0] == 0
    err = np.abs(qk.dequantized() - x)
    assert np.all(err <= np.repeat(np.abs(qk.d), 256, axis=1) * 0.5001 + 1e-12)
    q1 = quantize_activations(x, T.Q8_1)
    q0 = quantize_activations(x, T.Q8_0)
    assert np.array_equal(q1.q, q0.q) and np.array_equal(q1.d, q0.d)
    s_exact = q1.q.reshape(8, -1, 32).sum(-1) * q1.d
    assert np.allclose(q1.s, s_exact, rtol=2 ** -10, atol=1e-6)


# --- llama.cpp as the oracle (skipped when llama-cpp-python is missing) ---------------

@pytest.fixture(scope="module")
def ggml():
    llama_cpp = pytest.importorskip("llama_cpp")
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    if not os.path.exists(path):
        pytest.skip("libggml-cpu.so not found next to llama_cpp")
    lib = ctypes.CDLL(path)
    vp, i64, sz = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
    lib.ggml_cpu_init.restype = None
    lib.ggml_cpu_init()
    for name in ("quantize_row_q8_0", "quantize_row_q8_1", "quantize_row_q8_K",
                 "ggml_cpu_fp32_to_fp16", "ggml_cpu_fp32_to_bf16"):
        getattr(lib, name).argtypes = [vp, vp, i64]
        getattr(lib, name).restype = None
    for name in ("q8_0_q8_0", "q4_0_q8_0", "q5_0_q8_0", "q4_1_q8_1", "q5_1_q8_1",
                 "q4_K_q8_K", "q5_K_q8_K", "q6_K_q8_K", "f16", "bf16", "f32"):
        f = getattr(lib, "ggml_vec_dot_" + name)
        f.argtypes = [ctypes.c_int, vp, sz, vp, sz, vp, sz, ctypes.c_int]
        f.restype = None
    return lib


# ggml's activation blocks (elements, bytes).  Not gguf-py's table: it gives Q8_1 40
# bytes (f32 d and s), ggml's block_q8_1 holds two f16 in 36.
ACT_BLOCK = {T.Q8_0: (32, 34), T.Q8_1: (32, 36), T.Q8_K: (256, 292), T.F16: (1, 2),
             T.BF16: (1, 2)}


def _ggml_quantize(lib, x: np.ndarray, kind) -> np.ndarray:
    n = x.size
    if kind == T.F32:
        return np.ascontiguousarray(x, np.float32).view(np.uint8).reshape(-1)
    qk, bpb = ACT_BLOCK[kind]
    nbytes = n // qk * bpb
    fn = {T.Q8_0: "quantize_row_q8_0", T.Q8_1: "quantize_row_q8_1",
          T.Q8_K: "quantize_row_q8_K", T.F16: "ggml_cpu_fp32_to_fp16",
          T.BF16: "ggml_cpu_fp32_to_bf16"}[kind]
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros(nbytes, np.uint8)
    getattr(lib, fn)(x.ctypes.data, out.ctypes.data, n)
    return out


def _tricky_activations(n=2048, seed=3):
    """Rows whose rounding and max choices are easy to get wrong: half-integer ties in
    every block (after scaling by 127/amax = 1), the largest magnitude twice with
    both signs in different blocks of 32 (Q8_K keeps the first: its sign sets
    iscale's), a zero block between busy ones, and tiny and huge scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, n)).astype(np.float32)
    x[0, ::32] = 127.0
    x[0, 1::32] = rng.integers(-253, 254, n // 32).astype(np.float32) / 2
    x[0, 2::32] = 126.5
    x[0, 3::32] = -0.5
    for sb in range(0, n, 256):                    # both signs of the max, either first
        first, second = (-9.0, 9.0) if sb % 512 == 0 else (9.0, -9.0)
        x[1, sb + 5 * 32 + 7] = first
        x[1, sb + 6 * 32 + 1] = second
        x[2, sb + 17] = first                      # and twice in the same block
        x[2, sb + 3] = second
    x[3, 64:96] = 0.0
    x[4] *= np.float32(1e-30)
    x[5] *= np.float32(1e30)
    return x


@pytest.mark.parametrize("which", ["random", "tricky"])
def test_activation_quantizers_bit_exact_with_llama_cpp(ggml, which):
    x = _activations(m=16, n=2048) if which == "random" else _tricky_activations()
    for kind in (T.Q8_0, T.Q8_1):
        ref = _ggml_quantize(ggml, x, kind).reshape(-1, ACT_BLOCK[kind][1])
        qa = quantize_activations(x, kind)
        off = 2 if kind == T.Q8_0 else 4
        assert np.array_equal(q8_bytes(qa.q, 32), ref[:, off:]), kind.name
        assert np.array_equal(f16_bytes(qa.d), ref[:, :2])
        if kind == T.Q8_1:
            assert np.array_equal(f16_bytes(qa.s), ref[:, 2:4])
    ref = _ggml_quantize(ggml, x, T.Q8_K).reshape(-1, ACT_BLOCK[T.Q8_K][1])
    qa = quantize_activations(x, T.Q8_K)
    assert np.array_equal(qa.d.reshape(-1), ref[:, :4].copy().view(np.float32)[:, 0])
    assert np.array_equal(qa.q.reshape(-1, 256), ref[:, 4:260].view(np.int8))
    bsums16 = ref[:, 260:].copy().view(np.int16).astype(np.int32)
    bsums16 = bsums16.reshape(-1, 8, 2).sum(-1)
    assert np.array_equal(qa.bsum32.reshape(-1, 8), bsums16)
    assert np.array_equal(qa.qi.reshape(-1, 256), ref[:, 4:260].view(np.int8))
    for kind in (T.F16, T.BF16):
        ref = _ggml_quantize(ggml, x, kind).view(np.uint16)
        got = quantize_activations(x, kind).q.reshape(-1)
        if kind == T.F16:
            ours = got.astype(np.float16).view(np.uint16)
        else:
            ours = (got.view(np.uint32) >> 16).astype(np.uint16)
        assert np.array_equal(ours, ref), kind.name


_DOT = {T.Q8_0: "q8_0_q8_0", T.Q4_0: "q4_0_q8_0", T.Q5_0: "q5_0_q8_0",
        T.Q4_1: "q4_1_q8_1", T.Q5_1: "q5_1_q8_1", T.Q4_K: "q4_K_q8_K",
        T.Q5_K: "q5_K_q8_K", T.Q6_K: "q6_K_q8_K", T.F16: "f16", T.BF16: "bf16",
        T.F32: "f32"}


@pytest.mark.parametrize("t", list(_DOT), ids=lambda t: t.name)
def test_matvec_matches_llama_cpp_vec_dot(ggml, t, kernels):
    n_out, n_in = 24, 1024
    raw = make_weights(t, n_out, n_in, seed=7)
    w = QuantMatrix(raw, t, n_out, n_in)
    x = _activations(m=3, n=n_in, seed=3)[2] + 0.1
    y = matvec(w, x)
    xq = _ggml_quantize(ggml, x, VEC_DOT_TYPE[t])
    ref = np.empty(n_out, np.float32)
    s = np.zeros(1, np.float32)
    for r in range(n_out):
        row = np.ascontiguousarray(w.raw[r])
        vec_dot = getattr(ggml, "ggml_vec_dot_" + _DOT[t])
        vec_dot(n_in, s.ctypes.data, 0, row.ctypes.data, 0, xq.ctypes.data, 0, 1)
        ref[r] = s[0]
    mag = np.abs(w.dequantize()).astype(np.float64) @ np.abs(x.astype(np.float64))
    assert np.all(np.abs(y - ref) <= 1e-5 * mag), np.max(np.abs(y - ref) / mag)


# --- matvec against the numpy transcription and float64 -------------------------------

# (n_out, blocks per row); 17 and 40 are not multiples of the 16-row chunks
MV_SHAPES = [(1, 1), (17, 4), (40, 7), (3, 12)]


def _bound(t, w64: np.ndarray, x: np.ndarray, qa) -> np.ndarray:
    """Worst-case |W x - W x~| per output row from rounding x to x~ (d/2 an element)."""
    n = x.size
    if t == T.F32:
        step = np.zeros(n)
    elif t == T.F16:
        step = np.abs(x) * 2.0 ** -11 + 2.0 ** -25
    elif t == T.BF16:
        step = np.abs(x) * 2.0 ** -8
    else:
        qk = n // qa.d.shape[1]
        step = np.repeat(np.abs(qa.d[0]).astype(np.float64), qk) * 0.5
    return np.abs(w64) @ step


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_matvec_against_reference_and_float64(t, kernels):
    rng = np.random.default_rng(1)
    for seed, (n_out, nb) in enumerate(MV_SHAPES):
        n_in = nb * QK_OR_32(t)
        w = QuantMatrix(make_weights(t, n_out, n_in, seed=seed), t, n_out, n_in)
        x = (rng.standard_normal(n_in) * 2).astype(np.float32)
        y = matvec(w, x)
        assert y.shape == (n_out,) and y.dtype == np.float32
        qa = quantize_activations(x, w.vec_dot_type)
        ref = reference_matvec(w.raw, t, qa)
        w64 = w.dequantize().astype(np.float64)
        mag = magnitude(w, qa)
        # only float32 rounding separates kernel and transcription: 1e-5 of sum |terms|
        assert_close(y, ref, 1e-5, mag, t.name)
        exact = w64 @ x.astype(np.float64)
        bound = _bound(t, w64, x, qa) * 1.001 + 1e-5 * mag + 1e-30
        assert np.all(np.abs(y - exact) <= bound), t.name
        out = np.full(n_out, np.nan, np.float32)
        assert matvec(w, x, out=out) is out and np.array_equal(out, y)


def QK_OR_32(t) -> int:
    return max(QK[t], 32)


def test_matvec_quantized_reuses_one_quantization():
    n_in = 512
    x = np.random.default_rng(2).standard_normal(n_in).astype(np.float32)
    wq = QuantMatrix(make_weights(T.Q4_K, 20, n_in, seed=1), T.Q4_K, 20, n_in)
    wk = QuantMatrix(make_weights(T.Q6_K, 9, n_in, seed=2), T.Q6_K, 9, n_in)
    qa = quantize_activations(x, T.Q8_K)
    for w in (wq, wk):
        out = np.empty(w.n_out, np.float32)
        matvec_quantized(w, qa, out)
        assert np.array_equal(out, matvec(w, x))
    w8 = QuantMatrix(make_weights(T.Q8_0, 4, n_in), T.Q8_0, 4, n_in)
    with pytest.raises(ValueError, match="Q8_0"):
        matvec_quantized(w8, qa, np.empty(4, np.float32))  # Q8_K x, a Q8_0 matrix


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_matvec_quantizing_in_the_kernel_call_is_bit_identical(t, kernels):
    # `matvec` hands integer kernels the float vector, which `_int.run` quantizes
    # through a C function (activations.row_quantizer); `matvec_quantized` gets it
    # from `quantize_activations`.  Same bits, with an all-zero block, a huge value,
    # a lone negative maximum (Q8_K's signed max) and ties, from a strided and a
    # read-only x (copied to the one signature `run` has).
    n_in, n_out = 512, 37
    rng = np.random.default_rng(5)
    x = rng.standard_normal(2 * n_in).astype(np.float32)[::2]           # strided
    x[:32] = 0.0
    x[40], x[300] = 3e4, -7.5
    x[260:268] = np.float32(0.5) * np.arange(8, dtype=np.float32)
    w = QuantMatrix(make_weights(t, n_out, n_in, seed=3), t, n_out, n_in)
    want = matvec_quantized(w, quantize_activations(x, w.vec_dot_type),
                            np.empty(n_out, np.float32))
    assert np.array_equal(bits(matvec(w, x)), bits(want))
    ro = np.ascontiguousarray(x)
    ro.flags.writeable = False
    assert np.array_equal(bits(matvec(w, ro)), bits(want))
    parts = [QuantMatrix(make_weights(t, r, n_in, seed=r), t, r, n_in) for r in (16, 5)]
    mm = MultiMatrix(parts)
    qa = quantize_activations(x, mm.vec_dot_type)
    assert np.array_equal(bits(matvec(mm, x)),
                          bits(matvec_quantized(mm, qa, np.empty(21, np.float32))))


def test_matvec_results_do_not_share_its_scratch(int_level):
    # in decode, `matvec` reuses one scratch per row length for run's quantizer: a
    # result must not change when the next call (another activation type, same n)
    # writes that scratch, and a call must not read the previous call's quants
    n_in = 512
    rng = np.random.default_rng(9)
    xa, xb = (rng.standard_normal(n_in).astype(np.float32) for _ in range(2))
    ws = [QuantMatrix(make_weights(t, 24, n_in, seed=i), t, 24, n_in)
          for i, t in enumerate((T.Q4_K, T.Q8_0, T.Q4_1))]
    first = [matvec(w, xa) for w in ws]
    kept = [y.copy() for y in first]
    for w in ws:
        matvec(w, xb)
    for w, y, k in zip(ws, first, kept):
        assert np.array_equal(bits(y), bits(k))
        assert np.array_equal(bits(matvec(w, xa)), bits(k))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_non_finite_activations_raise(t, kernels):
    # one per activation type (Q8_0, Q8_1, Q8_K): the C quantizers cannot raise, so
    # they report a NaN or an infinity and their callers raise (model.py names the
    # stage); nothing is multiplied by a garbage quantization
    w = QuantMatrix(make_weights(t, 4, 256), t, 4, 256)
    for bad in (np.inf, -np.inf, np.nan):
        x = np.ones(256, np.float32)
        x[3] = bad
        with pytest.raises(NonFiniteActivations):
            matvec(w, x)
        with pytest.raises(FloatingPointError):
            quantize_activations(np.stack([np.ones(256, np.float32), x]), w.vec_dot_type)


@pytest.mark.parametrize("t", [T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_tolerance_catches_one_wrong_quant(t, kernels):
    # the 1e-5 tolerance sees a single quant off by one step in a 512-wide row
    n_out, n_in = 4, 512
    raw = make_weights(t, n_out, n_in, seed=8)
    w = QuantMatrix(raw, t, n_out, n_in)
    x = np.random.default_rng(0).standard_normal(n_in).astype(np.float32)
    qa = quantize_activations(x, w.vec_dot_type)
    bad = raw.copy().reshape(n_out, -1)
    byte = {T.Q5_0: 10, T.Q4_K: 40, T.Q6_K: 40}[t]   # a quant byte, row 1, block 0
    bad[1, byte] ^= 0x01                              # one element's quant changes by 1
    ref_bad = reference_matvec(bad, t, qa)
    ref_ok = reference_matvec(w.raw, t, qa)
    mag = magnitude(w, qa)
    y = matvec(w, x)
    assert np.abs(y[1] - ref_ok[1]) <= 1e-5 * mag[1]
    assert np.abs(y[1] - ref_bad[1]) > 1e-5 * mag[1]


# --- the integer kernels: levels, dispatch, the code each level may contain -----------

def test_level_selection(monkeypatch):
    v3 = "+sse4.2,+ssse3,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2"
    avx512 = ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512vnni"
    epyc = v3 + ",-avx512f,-avxvnni"                        # Zen 2/3: AVX2 only
    alder = v3 + ",+avxvnni,-avx512f"                       # Alder Lake: AVX-VNNI
    spr = v3 + ",+avxvnni" + avx512                         # Sapphire Rapids
    best = isa.LEVELS[0]
    assert isa.usable_levels(spr, best) == tuple(isa.LEVELS)
    assert isa.usable_levels(alder, best) == (isa.AVXVNNI, isa.AVX2, isa.GENERIC)
    assert isa.usable_levels(epyc, best) == (isa.AVX2, isa.GENERIC)
    assert isa.usable_levels("+neon,+fp-armv8", best) == (isa.GENERIC,)
    assert isa.usable_levels(spr.replace("+bmi2", "-bmi2"), best) == (isa.GENERIC,)
    assert isa.usable_levels(spr, isa.AVX2) == (isa.AVX2, isa.GENERIC)
    assert isa.usable_levels(epyc, isa.AVXVNNI) == (isa.AVX2, isa.GENERIC)
    assert not isa.vnni_usable(v3 + ",+avx512f,+avx512bw,+avx512vl,-avx512vnni")
    assert isa.requested({}) == best
    assert isa.requested({"FUCINA_SIMD": "AVX2 "}) == isa.AVX2
    assert isa.requested({"FUCINA_NO_VNNI": "1"}) == isa.AVX2     # the older switch
    assert isa.requested({"FUCINA_NO_VNNI": "0"}) == best
    with pytest.raises(ValueError, match="avx512vnni, avxvnni, avx2, i8mm, dotprod, "
                       "neon, generic"):
        isa.requested({"FUCINA_SIMD": "sse2"})
    assert isa.USABLE == isa.usable_levels(isa.numba_cpu_features(),
                                           isa.requested(os.environ))
    assert isa.USABLE[-1] == isa.GENERIC and isa.level == isa.BEST == isa.USABLE[0]
    for lv in isa.LEVELS:    # a level this CPU lacks runs the generic kernels
        if lv in isa.USABLE:
            continue
        monkeypatch.setattr(isa, "level", lv)
        w = QuantMatrix(make_weights(T.Q4_K, 4, 256), T.Q4_K, 4, 256)
        assert matvec_mod.kernel_for(T.Q4_K)[0] == isa.GENERIC
        assert np.isfinite(matvec(w, np.ones(256, np.float32))).all()
        assert np.isfinite(matmul(w, np.ones((3, 256), np.float32), path="rows")).all()


def test_forced_levels_in_a_fresh_process():
    code = "from fucina_course.quant import isa; print(isa.level, isa.USABLE[-1])"
    for env, want in (({"FUCINA_SIMD": "generic"}, "generic"),
                      ({"FUCINA_NO_VNNI": "1"}, isa.AVX2),
                      ({"FUCINA_SIMD": "avx2"}, isa.AVX2)):
        if want not in isa.USABLE:
            continue
        env = {**os.environ, "FUCINA_SIMD": "", "FUCINA_NO_VNNI": "", **env}
        out = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                             capture_output=True, check=True).stdout.split()
        assert out == [want, isa.GENERIC], env


def test_dispatch_table_covers_every_format_and_level():
    for t in ALL:
        assert (t, isa.GENERIC) in matvec_mod.KERNELS
    for t in INT_TYPES:
        for lv in INT_LEVELS:
            k = matvec_mod.KERNELS[(t, lv)]
            assert isinstance(k, IntKernels) and matmul_mod.KERNELS[(t, lv)] is k
    by_level = matmul_mod.ROWS_BLAS_MIN_ROWS_BY_LEVEL
    assert matmul_mod.ROWS_BLAS_MIN_ROWS is by_level[isa.BEST]
    for lv in INT_LEVELS:
        assert set(by_level[lv]) == set(INT_TYPES) and min(by_level[lv].values()) >= 64
    assert by_level[isa.GENERIC] == {}                  # no tiles at the generic level


def test_every_format_record_names_its_kernels():
    # Each kernel module registers its kernels into the records as it defines them
    # (formats.registers); a format without a dequantizer, a float kernel or, at its
    # integer levels, its row and tile builders would fail only when first used.
    from fucina_course.quant.formats import registers

    for t in ALL:
        k = FORMATS[t].kernels
        assert k.missing() == [], (t.name, k.missing())
        # every family's integer levels (the other architecture's are never USABLE)
        want = ((*isa.X86, *isa.ARM, isa.GENERIC) if t in GENERIC_IR_TYPES
                else isa.X86 + isa.ARM if t in INT_TYPES else ())
        assert k.int_levels == want, t.name
        assert set(k.blas_from) == set(isa.X86 + isa.ARM if t in INT_TYPES else ())
    assert FORMATS[T.Q4_K].kernels.float_q16 and matvec_mod._X16 == {int(T.Q4_K)}
    assert FORMATS[T.Q8_0].kernels.float_matvec is matvec_mod._mv_q8_0
    with pytest.raises(ValueError, match="Q8_0: float_matvec is .*_mv_q8_0 already"):
        registers("float_matvec", T.Q8_0)(matvec_mod._mv_q4_0)
    registers("float_matvec", T.Q8_0)(matvec_mod._mv_q8_0)      # the same: no error
    with pytest.raises(AttributeError):
        registers("no_such_field", T.Q8_0)(matvec_mod._mv_q8_0)


# Registers and encodings an AVX2-only CPU (an AMD EPYC, Zen 2/3) does not have: zmm,
# mask registers, EVEX-only instructions (and their {vex} twins, AVX-VNNI).
_NOT_AVX2 = re.compile(r"%zmm|%k[0-7]\b|\{%k|vpdp|vpermb|vpermt2|vpternlog|"
                       r"vpmov[a-z]*2|vpcompress|vpexpand|\{1to|kmov|kand|kor")


@x86_only
@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_levels_emit_only_their_instructions(t):
    # The kernels are compiled for the level's features only (isa.target), whatever
    # the machine, so this holds on any x86 machine: no AVX-512 in the avx2 and
    # avxvnni kernels, and the avxvnni dot products are the VEX ones.
    for lv in INT_LEVELS:
        mod = _jit.new_module("asm")
        IntKernels(t, lv).build(mod)
        asm = _jit.assembly(mod, lv)
        code = "\n".join(line for line in asm.splitlines()
                         if line.startswith("\t") and not line.startswith("\t."))
        assert "vpmaddubsw" in code or "vpdpbusd" in code, (t.name, lv)
        if lv == isa.AVX512VNNI:
            continue
        bad = [line for line in code.splitlines() if _NOT_AVX2.search(line)
               and not (lv == isa.AVXVNNI and "{vex}" in line)]
        assert not bad, (t.name, lv, bad[:5])
        if lv == isa.AVXVNNI:
            assert "{vex}\tvpdpbusd" in code, (t.name, lv)
        else:
            assert "vpdpbusd" not in code and "%ymm" in code, (t.name, lv)


@pytest.mark.parametrize("t", GENERIC_IR_TYPES, ids=lambda t: t.name)
def test_generic_ir_kernels_are_portable(t):
    # The generic level's IR kernels name no target intrinsic, so LLVM compiles them
    # for any CPU: for 64-bit ARM they become NEON multiplies (int16 products, or
    # int16 x int16 -> int32 where x86 has pmaddwd) and native f16
    # conversions, with no call to a runtime function; for a plain x86-64 v3 CPU,
    # vpmullw / vpmaddwd and vcvtph2ps.  The exceptions, in an x86-64 module only:
    # pmaddwd and packssdw of SSE2, the x86-64 baseline (_ir.madd_host, packssdw_host),
    # and in the packed GEMM of every format but Q8_0, SSSE3's pmaddubsw
    # (_int_packed.byte_products), which every x86 CPU with F16C has.
    for triple in ("aarch64-unknown-linux-gnu", "x86_64-unknown-linux-gnu"):
        mod = _jit.new_module("generic")
        mod.triple = triple
        IntKernels(t, isa.GENERIC).build(mod)
        text = str(mod)
        assert "llvm.prefetch" in text
        assert set(re.findall(r"llvm\.x86\.[\w.]+", text)) <= {
            "llvm.x86.sse2.pmadd.wd", "llvm.x86.sse2.packssdw.128",
            "llvm.x86.ssse3.pmadd.ub.sw.128"}
        byte_products = "llvm.x86.ssse3.pmadd.ub.sw.128" in text
        assert byte_products == (triple.startswith("x86") and t != T.Q8_0), t.name
        if triple.startswith("aarch64"):
            assert "llvm.x86" not in text
            arm = _jit.assembly_for(mod, triple, "neoverse-n1")
            assert re.search(r"\b(smull2?|mul)\s+v\d+\.(8h|4s)", arm), t.name
            assert re.search(r"\bfcvtl\b|\bfcvt\s+s\d+, h\d+", arm), t.name  # f16
            assert not re.search(r"\n\s*bl\s", arm), t.name
        else:
            x86 = _jit.assembly_for(mod, triple, "haswell")
            assert "vpmaddwd" in x86 and "vcvtph2ps" in x86, t.name
            assert not re.search(r"\n\s*call", x86), t.name
            assert ("vpmaddubsw" in x86) == byte_products, t.name   # ymm on haswell
            # AVX and F16C but no FMA (Sandy / Ivy Bridge): a mul and an add, never
            # a call to libm's fmaf per lane (_ir.fma)
            ivy = _jit.assembly_for(mod, triple, "ivybridge")
            assert "vcvtph2ps" in ivy and "vfmadd" not in ivy, t.name
            assert not re.search(r"\n\s*call", ivy), t.name
            sse = _jit.assembly_for(mod, triple, "x86-64", "+ssse3")  # no AVX: xmm pmaddwd
            assert "pmaddwd" in sse and "vpmaddwd" not in sse, t.name
            assert ("pmaddubsw" in sse) == byte_products, t.name
            assert "vpmaddubsw" not in sse and "ymm" not in sse, t.name


def test_generic_level_needs_native_half():
    assert isa.native_half("+avx2,+f16c,+fma", "x86_64")
    assert not isa.native_half("+sse4.2,-f16c", "x86_64")
    assert isa.native_half("", "aarch64") and isa.native_half("+neon", "arm64")
    assert not isa.native_half("", "ppc64le")
    if isa.GENERIC_IR:
        assert isinstance(matvec_mod.KERNELS[(T.Q5_0, isa.GENERIC)], IntKernels)
    else:
        assert matvec_mod.KERNELS[(T.Q5_0, isa.GENERIC)] is matvec_mod._mv_q5_0
    assert (T.Q5_0, isa.GENERIC) not in matmul_mod.KERNELS     # no tiles: gemv path


@x86_only
def test_compiled_kernels_are_cached_on_disk(tmp_path, monkeypatch):
    # the object code of a (format, level) is stored once, under a key that changes
    # with any quant/*.py file; a newer one replaces the older
    monkeypatch.setattr(_jit, "cache_dir", lambda: str(tmp_path))
    path = _jit.object_path("q4_0", isa.AVX2)
    assert os.path.dirname(path) == str(tmp_path) and not os.path.exists(path)
    mod = _jit.new_module("t")
    IntKernels(T.Q4_0, isa.AVX2).build(mod)
    _jit._store(path, _jit.compile_module(mod, isa.AVX2))
    assert os.path.getsize(path) > 1000 and _jit.is_cached("q4_0", isa.AVX2)
    stale = tmp_path / f"_jit.q4_0.{isa.AVX2}.0123456789abcdef.o"
    stale.write_bytes(b"")
    with open(path, "rb") as f:
        _jit._store(path, f.read())
    assert not stale.exists() and os.path.exists(path)
    assert _jit.clear_cache() == [os.path.basename(path)]


def _python(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, text=True,
                          capture_output=True, check=True, timeout=600).stdout


def test_pending_and_prepare_in_a_cold_cache(tmp_path):
    # a fresh numba cache directory: every kernel is pending until `prepare`, which
    # compiles all of it itself when its helper fails (here: a missing model file)
    # before reporting anything
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = """if True:
        from gguf import GGMLQuantizationType as T
        from fucina_course import startup
        types = [T.Q4_0, T.F32, T.Q4_0]
        print([t.name for t in startup.pending(types)])
        steps = []
        helper = startup.start("missing.gguf")
        startup.prepare(types, step=steps.append, helper=helper)
        startup.join(helper)
        print(sorted(steps), [t.name for t in startup.pending(types)])
    """
    out = _python(code, env).splitlines()
    assert out == ["['Q4_0']", "['Q4_0', 'activations', 'driver'] []"]
    assert _python(code, env).splitlines()[0] == "[]"      # the next process: cached


@pytest.mark.skipif(not isa.GENERIC_IR, reason="no generic IR kernels here")
def test_pending_and_prepare_compile_decode_and_prefill_in_one_module(tmp_path):
    # at generic, Q8_0's decode and its packed GEMM (prefill) are one IR module: the
    # first start compiles it once, reports Q8_0 once, and both are then on disk
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    code = """if True:
        from gguf import GGMLQuantizationType as T
        from fucina_course import startup
        from fucina_course.quant import _jit, isa
        from fucina_course.quant.matmul import packed_kernel_for
        from fucina_course.quant.matvec import kernel_for
        types = [T.Q8_0]
        k, pk = kernel_for(T.Q8_0, isa.GENERIC)[1], packed_kernel_for(T.Q8_0, isa.GENERIC)
        print(k is pk, [t.name for t in startup.pending(types, isa.GENERIC)])
        steps = []
        startup.prepare(types, isa.GENERIC, step=steps.append)
        print(sorted(steps), [t.name for t in startup.pending(types, isa.GENERIC)],
              _jit.is_cached(pk.name, isa.GENERIC))
    """
    out = _python(code, env).splitlines()
    assert out == ["True ['Q8_0']", "['Q8_0', 'activations', 'driver'] [] True"]


def test_info_kernels_prints_the_table():
    env = {**os.environ, "FUCINA_SIMD": isa.USABLE[0]}
    out = subprocess.run([sys.executable, "-m", "fucina_course", "info", "--kernels"],
                         env=env, text=True, capture_output=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"kernels: level {isa.USABLE[0]} on {isa.cpu_family()} "
                               "(this CPU runs")
    rows = {line.split()[0]: line.split()[1] for line in lines[2:]}
    assert set(rows) == {t.name for t in ALL}
    for t in INT_TYPES:
        assert rows[t.name] == isa.USABLE[0]
    assert rows["F16"] == isa.GENERIC


def test_first_start_says_so_on_a_terminal(tmp_path):
    # the first run on a cold cache compiles before the first token and says so on
    # stderr (a terminal: a pty here); the second says nothing
    pty = pytest.importorskip("pty")
    from fucina_course.synth import TINY_QWEN3, with_format, write_synthetic

    model = write_synthetic(with_format(TINY_QWEN3, "Q4_K"), tmp_path / "m.gguf")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    argv = [sys.executable, "-m", "fucina_course", "generate", str(model), "--ids",
            "1,2,3", "--gen", "2"]
    for first in (True, False):
        pid, fd = pty.fork()
        if pid == 0:
            os.execvpe(argv[0], argv, env)
        out = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, out
        said = b"compiling kernels for Q4_K" in out and b"(first run only)" in out
        assert said == first, out[-500:]


def _extreme_weights(t, n_out: int, n_in: int, fill: int, seed: int) -> np.ndarray:
    """Blocks whose quant bytes (and 6-bit / int8 scales) are all `fill`, with finite
    f16 scales."""
    raw = random_blocks(np.random.default_rng(seed), t, n_out * n_in).reshape(n_out, -1)
    blk = raw.reshape(n_out, -1, FORMATS[t].block_bytes)
    keep = [(o, o + 2) for o in FORMATS[t].f16_fields]
    saved = [blk[:, :, a:b].copy() for a, b in keep]
    blk[:] = fill
    for (a, b), v in zip(keep, saved):
        blk[:, :, a:b] = v
    return raw.reshape(-1)


@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_int_extreme_quants_and_activations(t, int_level):
    # Largest |products|: all quant bytes 0x00 / 0xFF / 0x80 / 0x7F (q at both ends of
    # its range, the K-quant scales at 0, 63 and the Q6_K int8 scales at -128, -1, 127)
    # against activations that quantize to +-127 (and a block of zeros); the int16
    # steps (vpackssdw, vpdpwssd; avx2's vpmaddubsw pairs) must not saturate.
    n_out, n_in = 8, 3 * 256 + (0 if QK[t] == 256 else 32)
    rng = np.random.default_rng(0)
    xs = [np.where(rng.random(n_in) < 0.5, 1.0, -1.0).astype(np.float32),
          np.full(n_in, 3.0, np.float32), np.full(n_in, -3.0, np.float32)]
    xs[0][:256] = 0.0
    if QK[t] == 256:
        n_in = 3 * 256
        xs = [x[:n_in] for x in xs]
    for fill in (0x00, 0xFF, 0x80, 0x7F, 0x55):
        raw = _extreme_weights(t, n_out, n_in, fill, seed=fill)
        w = QuantMatrix(raw, t, n_out, n_in)
        for x in xs:
            qa = quantize_activations(x, w.vec_dot_type)
            assert np.abs(qa.qi).max() in (0, 127)
            ref = reference_matvec(w.raw, t, qa)
            assert_close(matvec(w, x), ref, 1e-5, magnitude(w, qa), t.name, hex(fill))


@pytest.mark.parametrize("t", [T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_k_quant_kernels_identical_at_every_int_level(t, monkeypatch):
    # Q4_K/Q5_K end each super-block in exact integer totals and do the same float
    # operations on them at every level (_int_matvec.q4k_row), so the integer levels
    # agree bit for bit, for matvec and for the multi-row kernels (full and partial
    # tiles).  A level that went back to lane-wise float work would fail here.
    levels = [lv for lv in INT_LEVELS if lv in isa.USABLE]
    if len(levels) < 2:
        pytest.skip("one integer level on this CPU")
    rng = np.random.default_rng(3)
    n_out, n_in = 45, 5 * 256
    w = QuantMatrix(make_weights(t, n_out, n_in, seed=7), t, n_out, n_in)
    X = (rng.standard_normal((19, n_in)) * 2).astype(np.float32)
    got = {}
    for lv in levels:
        monkeypatch.setattr(isa, "level", lv)
        got[lv] = (matvec(w, X[3]), matmul(w, X, path="rows"))
    for lv in levels[1:]:
        assert np.array_equal(got[lv][0], got[levels[0]][0]), (t.name, lv)
        assert np.array_equal(got[lv][1], got[levels[0]][1]), (t.name, lv)
    assert np.array_equal(got[levels[0]][1][3], got[levels[0]][0])


@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_int_and_generic_kernels_agree(t, int_level, monkeypatch):
    # model-sized rows, row counts not a multiple of the 16-row chunks, odd block counts
    rng = np.random.default_rng(12)
    for n_out, nb in ((131, 12), (33, 5), (5, 1)):
        n_in = nb * QK[t]
        w = QuantMatrix(make_weights(t, n_out, n_in, seed=nb), t, n_out, n_in)
        x = (rng.standard_normal(n_in) + 0.2).astype(np.float32)
        qa = quantize_activations(x, w.vec_dot_type)
        y1 = matvec(w, x)
        monkeypatch.setattr(isa, "level", isa.GENERIC)
        y0 = matvec(w, x)
        monkeypatch.setattr(isa, "level", int_level)
        assert_close(y1, y0, 2e-6, magnitude(w, qa), t.name, n_out, nb)


def test_int8_activation_fields():
    x = _activations(m=3, n=1024)
    for kind in (T.Q8_0, T.Q8_1, T.Q8_K):
        qa = quantize_activations(x, kind)
        assert qa.qi.dtype == np.int8 and qa.qi.shape == x.shape
        assert qa.q.dtype == np.float32
        assert np.array_equal(qa.q, qa.qi.astype(np.float32))
        if kind == T.Q8_K:
            sums = qa.qi.reshape(3, -1, 32).sum(-1, dtype=np.int64)
            assert np.array_equal(qa.bsum32, sums)


# --- matmul ---------------------------------------------------------------------------

@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_matmul_paths_agree_with_matvec(t, kernels):
    rng = np.random.default_rng(4)
    n_out, n_in = 70, 4 * QK_OR_32(t)
    w = QuantMatrix(make_weights(t, n_out, n_in, seed=9), t, n_out, n_in)
    X = (rng.standard_normal((19, n_in)) + 0.3).astype(np.float32)  # Q8_1 sums matter
    dec = np.stack([matvec(w, x) for x in X])                          # [m, n_out]
    gemv = matmul(w, X, path="gemv")
    rows = matmul(w, X, path="rows")   # multi-row integer kernel, else the gemv path
    blas = matmul(w, X, path="blas")
    auto = matmul(w, X)
    w64 = w.dequantize().astype(np.float64)
    mag = np.abs(X.astype(np.float64)) @ np.abs(w64).T                 # [m, n_out]
    assert np.array_equal(gemv, dec)
    assert np.array_equal(rows, dec)                          # bit-identical, not close
    assert_close(blas, dec, 1e-5, mag, t.name)
    if matmul_mod.has_packed_kernel(w):                   # 19 >= PACKED_MIN_ROWS
        assert 19 >= matmul_mod.PACKED_MIN_ROWS
        assert np.array_equal(auto, matmul(w, X, path="packed"))
        assert_close(auto, dec, 1e-5, mag, t.name)
    elif matmul_mod.has_rows_kernel(w):                   # 19 < rows_blas_min_rows
        assert 19 < matmul_mod.rows_blas_min_rows(t) and np.array_equal(auto, rows)
    else:                                                     # 19 >= PREFILL_MIN_ROWS
        assert np.array_equal(auto, blas)
    f32 = matmul(w, X, path="blas", exact_activations=False)
    exact = X.astype(np.float64) @ w64.T
    assert np.all(np.abs(f32 - exact) <= 1e-5 * mag + 1e-30)
    out = np.empty((19, n_out), np.float32)
    assert matmul(w, X, out=out) is out and np.array_equal(out, auto)
    one = matmul(w, X[:1])                                    # m = 1 goes through gemv
    assert np.array_equal(one[0], dec[0])


@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_rows_kernels_bit_identical_to_matvec(t, int_level):
    # every tile shape (m around the 8-row tile, more than one tile; the rows left
    # after the full tiles through each body: 8 rows guarded for 5-7, 4 for 3-4, 2
    # for 1-2), row counts that are not multiples of the 16-row chunks, odd block
    # counts (the 32-element formats' ymm tail block)
    rng = np.random.default_rng(21)
    cases = ((37, 3, (2, 5, 7, 8, 9)), (70, 5, (1, 3, 6, 13, 16, 17, 33)),
             (5, 1, (4, 10, 12)))
    for n_out, nb, ms in cases:
        nb = nb if QK[t] == 256 else 2 * nb + 1
        n_in = nb * QK[t]
        w = QuantMatrix(make_weights(t, n_out, n_in, seed=nb), t, n_out, n_in)
        for m in ms:
            X = rng.standard_normal((m, n_in)) * rng.random((m, 1)) * 3 + 0.1
            X = X.astype(np.float32)
            X[0, :QK[t]] = 0.0                            # an all-zero activation block
            dec = np.stack([matvec(w, x) for x in X])     # the level's one-row kernel
            got = np.full((m, n_out), np.nan, np.float32)
            assert matmul_mod.matmul_rows(w, X, got) is got
            assert np.array_equal(got, dec), (t.name, n_out, nb, m,
                                              np.nanmax(np.abs(got - dec)))


PACKED_TYPES = [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


def _quantized_product(raw, t, n_out, n_in, X):
    """(ref, mag) float64: gguf-py's dequantized weights times the activations as the
    kernels see them (quantized), with Q8_1's f16-rounded block sums for Q4_1 / Q5_1
    (ggml adds m_w * s_x per block); mag the sum of |terms|."""
    w64 = gq.dequantize(raw, t).reshape(n_out, n_in).astype(np.float64)
    qa = quantize_activations(X, VEC_DOT_TYPE[t])
    xq = qa.dequantized().astype(np.float64)
    ref, mag = xq @ w64.T, np.abs(xq) @ np.abs(w64).T
    if qa.s is not None:
        fmt = FORMATS[t]
        blk = raw.reshape(n_out, -1, fmt.block_bytes)
        mw = blk[:, :, fmt.m_offset:fmt.m_offset + 2].copy().view(np.float16)[..., 0]
        ref += matmul_mod._q81_delta(qa).astype(np.float64) @ mw.astype(np.float64).T
    return ref, mag


@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_packed_gemm_against_the_dequantized_product(t, packed_level):
    # _int_packed.py: 16 weight rows per call, in lane vectors of 16 (zmm) or 8 (ymm:
    # two groups), blocks repacked 64 (K-quants: 8 super-blocks) at a time.  Row
    # counts with a partial 16-row chunk (the tile fallback) and several parts; 130
    # blocks (K-quants: 17) = two full repacked chunks and a partial one; m around its
    # 8- and 4-row tiles.  Reference: float64 products of gguf-py's dequantized
    # weights with the activations as the kernel sees them (quantized), so only the
    # float order of the sums may differ; and the same for every m (one order per
    # output).
    rng = np.random.default_rng(8)
    kquant = QK[t] == 256
    for n_out, nb in ((70, 17), (32, 2), (16, 8)) if kquant else ((70, 130), (32, 3),
                                                                  (16, 64)):
        n_in = QK[t] * nb
        raw = make_weights(t, n_out, n_in, seed=nb)
        w = QuantMatrix(raw, t, n_out, n_in)
        assert matmul_mod.has_packed_kernel(w)
        X = (rng.standard_normal((33, n_in)) * rng.random((33, 1)) * 3 + 0.2)
        X = X.astype(np.float32)
        X[1, :32] = 0.0                                      # an all-zero block
        ref, mag = _quantized_product(raw, t, n_out, n_in, X)
        whole = matmul(w, X, path="packed")
        assert_close(whole, ref, 2e-6, mag, t.name, n_out, nb)
        for m in (1, 3, 4, 5, 7, 8, 9, 16, 17):
            got = np.full((m, n_out), np.nan, np.float32)
            assert matmul_mod.matmul_rows(w, X[:m], got, packed=True) is got
            assert np.array_equal(got, whole[:m]), (t.name, n_out, nb, m)
        parts = [QuantMatrix(make_weights(t, n, n_in, seed=n), t, n, n_in, name=f"p{n}")
                 for n in (48, 16, 20)]
        want = np.concatenate([matmul(p, X, path="packed") for p in parts], axis=1)
        assert np.array_equal(matmul(MultiMatrix(parts), X, path="packed"), want)


@pytest.mark.parametrize("t", PACKED_TYPES, ids=lambda t: t.name)
def test_packed_gemm_extreme_quants(t, packed_level):
    # saturating bytes: every weight byte 0x00 / 0xFF / 0x80 / 0x7F / 0x55 against
    # activations at +-127 and 0; the integer block totals must stay exact (avx2:
    # the int16 sums of vpmaddubsw, and Q8_0's sign trick with q = -128)
    n_out, n_in = 32, 3 * 256 + (0 if QK[t] == 256 else 32)
    rng = np.random.default_rng(0)
    X = np.stack([np.where(rng.random(n_in) < 0.5, 1.0, -1.0), np.full(n_in, 3.0),
                  np.full(n_in, -3.0), np.zeros(n_in)] * 5).astype(np.float32)
    for fill in (0x00, 0xFF, 0x80, 0x7F, 0x55):
        raw = _extreme_weights(t, n_out, n_in, fill, seed=fill)
        w = QuantMatrix(raw, t, n_out, n_in)
        ref, mag = _quantized_product(raw, t, n_out, n_in, X)
        assert_close(matmul(w, X, path="packed"), ref, 2e-6, mag, t.name, hex(fill))


@pytest.mark.parametrize("t", [T.F16, T.BF16], ids=lambda t: t.name)
def test_packed_path_elsewhere_is_the_rows_path(t):
    # formats without the packed GEMM (the float ones): path="packed" runs what "rows"
    # runs
    w = QuantMatrix(make_weights(t, 24, 256, seed=2), t, 24, 256)
    assert not matmul_mod.has_packed_kernel(w)
    X = np.random.default_rng(1).standard_normal((20, 256)).astype(np.float32)
    assert np.array_equal(matmul(w, X, path="packed"), matmul(w, X, path="rows"))


@pytest.mark.parametrize("t", INT_TYPES, ids=lambda t: t.name)
def test_rows_kernels_extreme_quants(t, int_level):
    # test_int_extreme_quants_and_activations for the multi-row kernels: the same
    # integer lanes (their weight-side offsets included) for saturating inputs
    n_out, n_in = 8, 3 * 256 + (0 if QK[t] == 256 else 32)
    if QK[t] == 256:
        n_in = 3 * 256
    rng = np.random.default_rng(0)
    X = np.stack([np.where(rng.random(n_in) < 0.5, 1.0, -1.0), np.full(n_in, 3.0),
                  np.full(n_in, -3.0), np.zeros(n_in)]).astype(np.float32)
    for fill in (0x00, 0xFF, 0x80, 0x7F, 0x55):
        raw = _extreme_weights(t, n_out, n_in, fill, seed=fill)
        w = QuantMatrix(raw, t, n_out, n_in)
        dec = np.stack([matvec(w, x) for x in X])
        assert np.array_equal(matmul(w, X, path="rows"), dec), (t.name, hex(fill))


def test_rows_path_at_the_generic_level_is_gemv(monkeypatch):
    # with the generic kernels (FUCINA_SIMD=generic or isa.level = GENERIC) "rows"
    # falls back to one matvec per row, and "auto" to the gemv/blas rule
    monkeypatch.setattr(isa, "level", isa.GENERIC)
    rng = np.random.default_rng(5)
    w = QuantMatrix(make_weights(T.Q4_K, 24, 512, seed=2), T.Q4_K, 24, 512)
    assert not matmul_mod.has_rows_kernel(w)
    X = rng.standard_normal((5, 512)).astype(np.float32)
    dec = np.stack([matvec(w, x) for x in X])
    assert np.array_equal(matmul(w, X, path="rows"), dec)
    assert np.array_equal(matmul(w, X), dec)          # 5 < PREFILL_MIN_ROWS: gemv


@pytest.mark.parametrize("t", [T.Q4_K, T.Q8_0, T.Q4_1, T.F32], ids=lambda t: t.name)
def test_matmul_zero_rows(t):
    n_in = 2 * QK_OR_32(t)
    w = QuantMatrix(make_weights(t, 8, n_in), t, 8, n_in)
    for path in ("auto", "rows", "gemv", "blas"):
        y = matmul(w, np.zeros((0, n_in), np.float32), path=path)
        assert y.shape == (0, 8), path


def test_openblas_spin_rule():
    spin = matmul_mod.openblas_workers_spin
    assert spin({}) and spin({"OPENBLAS_NUM_THREADS": "2"})
    assert spin({"OPENBLAS_THREAD_TIMEOUT": "28"})
    assert not spin({"OPENBLAS_THREAD_TIMEOUT": "4"})
    assert not spin({"GOTO_THREAD_TIMEOUT": "20"})
    assert not spin({"OPENBLAS_NUM_THREADS": "1"})
    assert not spin({"OMP_NUM_THREADS": "1"})
    # OpenBLAS's own variable wins
    assert spin({"OPENBLAS_NUM_THREADS": "2", "OMP_NUM_THREADS": "1"})


def test_matmul_large_tiles():
    # more rows than one dequantized tile holds, and a row count not a tile multiple
    rng = np.random.default_rng(6)
    n_out, n_in = 1000, 256
    w = QuantMatrix(make_weights(T.Q4_K, n_out, n_in, seed=3), T.Q4_K, n_out, n_in)
    X = rng.standard_normal((16, n_in)).astype(np.float32)
    old = matmul_mod._TILE_ELEMENTS
    try:
        matmul_mod._TILE_ELEMENTS = 96 * n_in
        tiled = matmul(w, X, path="blas")
    finally:
        matmul_mod._TILE_ELEMENTS = old
    whole = matmul(w, X, path="blas")
    assert np.allclose(tiled, whole, rtol=0, atol=1e-6 * np.abs(whole).max())


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K, T.F32],
                         ids=lambda t: t.name)
def test_multimatrix_equals_separate_parts(t, kernels):
    n_in = 2 * QK_OR_32(t)
    parts = [QuantMatrix(make_weights(t, n, n_in, seed=n), t, n, n_in, name=f"p{n}")
             for n in (24, 8, 8)]
    mm = MultiMatrix(parts)
    assert mm.shape == (40, n_in) and mm.bounds == [(0, 24), (24, 32), (32, 40)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n_in).astype(np.float32)
    assert np.array_equal(matvec(mm, x), np.concatenate([matvec(p, x) for p in parts]))
    X = rng.standard_normal((20, n_in)).astype(np.float32) + 0.2
    for path in ("gemv", "rows", "blas"):
        want = np.concatenate([matmul(p, X, path=path) for p in parts], axis=1)
        assert np.array_equal(matmul(mm, X, path=path), want), path
    f32 = np.concatenate([matmul(p, X, path="blas", exact_activations=False)
                          for p in parts], axis=1)
    assert np.array_equal(matmul(mm, X, exact_activations=False), f32)
    whole = np.concatenate([p.dequantize() for p in parts])
    assert np.array_equal(mm.dequantize(), whole)


def test_multimatrix_rejects_mixed_formats():
    a = QuantMatrix(make_weights(T.Q8_0, 4, 64), T.Q8_0, 4, 64, name="q")
    b = QuantMatrix(make_weights(T.Q4_0, 4, 64), T.Q4_0, 4, 64, name="v")
    with pytest.raises(ValueError, match="Q4_0"):
        MultiMatrix([a, b])
