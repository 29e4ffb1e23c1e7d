"""ggml's quantized dot products transcribed to plain numpy: the kernels' test oracle.

Slow and obvious on purpose: unpack every block into integer quants and integer
sub-scales, form the exact integer sums per block with int64 arithmetic, then combine
them with the float32 scale products ggml forms (`GGML_FP16_TO_FP32(x.d) * y.d` ...) and
add everything up in float64.  The kernels of matvec.py and matmul.py must agree with
this to float32 rounding (rtol ~1e-5 of the sum of |terms|).  Offsets come from the
`FORMATS` records, so this file also checks them (tests/test_quant.py).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .activations import QuantizedActivations
from .formats import FORMATS


def _f16(raw: np.ndarray, off: int) -> np.ndarray:
    """float32[n_out, nb]: the f16 at byte `off` of every block raw[r, b, :]."""
    f16 = np.ascontiguousarray(raw[:, :, off:off + 2]).view(np.float16)[..., 0]
    return f16.astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] ints: low nibbles = elements 0..15, high 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int64)


def _bits32(qh4: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, element j = bit j."""
    u = np.ascontiguousarray(qh4).view(np.uint32)[..., 0].astype(np.int64)
    return (u[..., None] >> np.arange(32)) & 1


def _scale_min_k4(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed bytes -> (sc [..., 8], m [..., 8]) 6-bit ints (ggml's
    get_scale_min_k4)."""
    q = sc12.astype(np.int64)
    sc = np.empty(q.shape[:-1] + (8,), np.int64)
    m = np.empty_like(sc)
    for j in range(8):
        if j < 4:
            sc[..., j] = q[..., j] & 63
            m[..., j] = q[..., j + 4] & 63
        else:
            sc[..., j] = (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4)
            m[..., j] = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
    return sc, m


def reference_matvec(raw2d: np.ndarray, ggml_type, qa: QuantizedActivations,
                     row: int = 0) -> np.ndarray:
    """float64[n_out]: ggml's vec_dot of every weight row with activation row `row`."""
    t = T(int(ggml_type))
    f = FORMATS[t]
    n_out = raw2d.shape[0]
    if f.block_size == 1:
        return _float_rows(raw2d, t) @ qa.q[row].astype(np.float64)
    xi = qa.q[row].astype(np.int64)
    blk = raw2d.reshape(n_out, -1, f.block_bytes)             # [n_out, nb, block bytes]
    dx = qa.d[row][None, :]                                   # [1, nb]
    if f.block_size == 32:
        return _dot32(t, f, blk, xi, dx, qa, row)
    d = (_f16(blk, f.d_offset) * dx).astype(np.float32).astype(np.float64)  # [n_out,nsb]
    if t in (T.Q4_K, T.Q5_K):
        return _dot_q45k(t, f, blk, xi, dx, d, qa.bsum32[row])
    if t == T.Q6_K:
        return _dot_q6k(f, blk, xi, d)
    raise ValueError(f"no reference for {t.name}")


def _float_rows(raw2d: np.ndarray, t) -> np.ndarray:
    """F32 / F16 / BF16 weights as float64 `[n_out, n_in]`."""
    if t == T.F32:
        wf = raw2d.view(np.float32)
    elif t == T.F16:
        wf = raw2d.view(np.float16).astype(np.float32)
    else:
        wf = (raw2d.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return wf.astype(np.float64)


def _dot32(t, f, blk, xi, dx, qa, row) -> np.ndarray:
    """The 32-value block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)."""
    n_out, nb = blk.shape[:2]
    d_w = _f16(blk, f.d_offset)                               # [n_out, nb]
    qs = blk[:, :, f.qs_offset:f.qs_offset + 16]
    if t == T.Q8_0:
        q = blk[:, :, f.qs_offset:].view(np.int8).astype(np.int64)  # [n_out, nb, 32]
    elif f.qh_offset is None:                                 # Q4_0, Q4_1
        q = _nibbles32(qs)
    else:                                                     # Q5_0, Q5_1
        q = _nibbles32(qs) | (_bits32(blk[:, :, f.qh_offset:f.qh_offset + 4]) << 4)
    q = q - f.zero_point
    sumi = np.einsum("rbj,bj->rb", q, xi.reshape(nb, 32))     # [n_out, nb] exact
    scale = (d_w * dx).astype(np.float32)                     # f32 product, as ggml
    y = (scale.astype(np.float64) * sumi).sum(axis=1)
    if f.m_offset is not None:                                # Q4_1, Q5_1: + m_w s_x
        m_w = _f16(blk, f.m_offset)
        y += (m_w * qa.s[row][None, :]).astype(np.float32).astype(np.float64).sum(1)
    return y


def _dot_q45k(t, f, blk, xi, dx, d, bsum32) -> np.ndarray:
    """Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins."""
    n_out, nb = blk.shape[:2]
    sc, m = _scale_min_k4(blk[:, :, f.scales_offset:f.scales_offset + 12])
    qs = blk[:, :, f.qs_offset:f.qs_offset + 128].reshape(n_out, nb, 4, 32)
    qs = qs.astype(np.int64)
    q = np.stack([qs & 0xF, qs >> 4], axis=3)                 # sub-block 2k: low
    q = q.reshape(n_out, nb, 8, 32)
    if t == T.Q5_K:
        qh = blk[:, :, f.qh_offset:f.qh_offset + 32].astype(np.int64)  # [.., 32]
        bit = (qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1
        q = q | (bit << 4)
    isub = np.einsum("rbsl,bsl->rbs", q, xi.reshape(nb, 8, 32))  # [n_out, nb, 8]
    sumi = (sc * isub).sum(axis=2)                            # [n_out, nb]
    bs = bsum32.astype(np.int64).reshape(nb, 8)
    summ = (m * bs[None]).sum(axis=2)                         # [n_out, nb]
    dmin_w = _f16(blk, f.m_offset)
    dm = (dmin_w * dx).astype(np.float32).astype(np.float64)
    return (d * sumi - dm * summ).sum(axis=1)


def _dot_q6k(f, blk, xi, d) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16 with int8 scales."""
    n_out, nb = blk.shape[:2]
    ql = blk[:, :, f.qs_offset:f.qs_offset + 128].reshape(n_out, nb, 2, 64)
    ql = ql.astype(np.int64)
    qh = blk[:, :, f.qh_offset:f.qh_offset + 64].reshape(n_out, nb, 2, 32)
    qh = qh.astype(np.int64)
    lo = np.concatenate([ql[..., :32] & 0xF, ql[..., 32:] & 0xF,
                         ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    q = (lo | (hi << 4)).reshape(n_out, nb, 16, 16) - f.zero_point  # 16 sub-blocks
    scales = blk[:, :, f.scales_offset:f.scales_offset + 16]
    sc = scales.view(np.int8).astype(np.int64)                # [n_out, nb, 16]
    isub = np.einsum("rbsl,bsl->rbs", q, xi.reshape(nb, 16, 16))
    sumi = (sc * isub).sum(axis=2)
    return (d * sumi).sum(axis=1)


def random_blocks(rng: np.random.Generator, ggml_type, n_elements: int,
                  scale: float = 0.05) -> np.ndarray:
    """uint8[bytes]: random but valid data of `n_elements` values in format `ggml_type`.

    Every quant byte is random; every f16 scale field is overwritten with a finite
    normal(0, scale) value (random bytes there would give infinities and NaNs).  For
    F32/F16/BF16: normal values.  The tests and benchmarks use it for the formats
    gguf-py cannot quantize (the K-quants).
    """
    t = T(int(ggml_type))
    if t == T.F32:
        return rng.standard_normal(n_elements).astype(np.float32).view(np.uint8)
    if t == T.F16:
        return rng.standard_normal(n_elements).astype(np.float16).view(np.uint8)
    if t == T.BF16:
        u = rng.standard_normal(n_elements).astype(np.float32).view(np.uint32)
        return (u >> 16).astype(np.uint16).view(np.uint8)
    f = FORMATS[t]
    if n_elements % f.block_size:
        raise ValueError(f"{n_elements} is not a whole number of "
                         f"{f.block_size}-element blocks")
    nb = n_elements // f.block_size
    raw = rng.integers(0, 256, size=(nb, f.block_bytes), dtype=np.uint8)  # [nb, bytes]
    for off in f.f16_fields:
        v = (rng.standard_normal(nb) * scale).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)
