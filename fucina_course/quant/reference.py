"""Plain-numpy transcription of ggml's quantized dot products (the oracle for the numba kernels).

Slow and obvious on purpose: unpack every block into integer quants and integer sub-scales, form the
exact integer sums per block with int64 arithmetic, then combine them with the float32 scale
products ggml forms (`GGML_FP16_TO_FP32(x.d) * y.d` ...) and add everything up in float64.  The
kernels in decode.py must agree with this to float32 rounding (rtol ~1e-5 of the sum of |terms|).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from .activations import QuantizedActivations


def _f16(raw: np.ndarray, off: int) -> np.ndarray:
    """[n_out, nb] float32 from the f16 at byte `off` of every block of raw [n_out, nb, block_bytes]."""
    return np.ascontiguousarray(raw[:, :, off:off + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] ints: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int64)


def _bits32(qh4: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, element j = bit j."""
    u = np.ascontiguousarray(qh4).view(np.uint32)[..., 0].astype(np.int64)
    return (u[..., None] >> np.arange(32)) & 1


def _scale_min_k4(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed bytes -> (sc [..., 8], m [..., 8]) 6-bit ints (ggml get_scale_min_k4)."""
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


def reference_matvec(raw2d: np.ndarray, ggml_type, qa: QuantizedActivations, row: int = 0) -> np.ndarray:
    """float64[n_out]: ggml's vec_dot of every weight row with activation row `row` of `qa`."""
    t = T(int(ggml_type))
    n_out = raw2d.shape[0]
    xq = qa.q[row].astype(np.float64)
    if t in (T.F32, T.F16, T.BF16):
        if t == T.F32:
            wf = raw2d.view(np.float32)
        elif t == T.F16:
            wf = raw2d.view(np.float16).astype(np.float32)
        else:
            wf = (raw2d.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return wf.astype(np.float64) @ xq
    xi = qa.q[row].astype(np.int64)
    if t in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1):
        bpb = {T.Q8_0: 34, T.Q4_0: 18, T.Q5_0: 22, T.Q4_1: 20, T.Q5_1: 24}[t]
        blk = raw2d.reshape(n_out, -1, bpb)                       # [n_out, nb, bpb]
        nb = blk.shape[1]
        d_w = _f16(blk, 0)                                        # [n_out, nb]
        if t == T.Q8_0:
            q = blk[:, :, 2:].view(np.int8).astype(np.int64)      # [n_out, nb, 32]
        elif t == T.Q4_0:
            q = _nibbles32(blk[:, :, 2:]) - 8
        elif t == T.Q5_0:
            q = (_nibbles32(blk[:, :, 6:]) | (_bits32(blk[:, :, 2:6]) << 4)) - 16
        elif t == T.Q4_1:
            q = _nibbles32(blk[:, :, 4:])
        else:
            q = _nibbles32(blk[:, :, 8:]) | (_bits32(blk[:, :, 4:8]) << 4)
        sumi = np.einsum("rbj,bj->rb", q, xi.reshape(nb, 32))     # [n_out, nb] exact ints
        scale = (d_w * qa.d[row][None, :]).astype(np.float32)     # f32 product, as ggml
        y = (scale.astype(np.float64) * sumi).sum(axis=1)
        if t in (T.Q4_1, T.Q5_1):
            m_w = _f16(blk, 2)
            y += (m_w * qa.s[row][None, :]).astype(np.float32).astype(np.float64).sum(axis=1)
        return y
    if t in (T.Q4_K, T.Q5_K):
        bpb = 144 if t == T.Q4_K else 176
        blk = raw2d.reshape(n_out, -1, bpb)                       # [n_out, nsb, bpb]
        nsb = blk.shape[1]
        d_w, dmin_w = _f16(blk, 0), _f16(blk, 2)
        sc, m = _scale_min_k4(blk[:, :, 4:16])                    # [n_out, nsb, 8]
        qs = blk[:, :, -128:].reshape(n_out, nsb, 4, 32).astype(np.int64)
        q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n_out, nsb, 8, 32)  # sub-block 2k = low nibbles
        if t == T.Q5_K:
            qh = blk[:, :, 16:48].astype(np.int64)                # [n_out, nsb, 32]
            q = q | (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4)
        isub = np.einsum("rbsl,bsl->rbs", q, xi.reshape(nsb, 8, 32))  # [n_out, nsb, 8]
        sumi = (sc * isub).sum(axis=2)                            # [n_out, nsb]
        bs = qa.bsum32[row].astype(np.int64).reshape(nsb, 8)
        summ = (m * bs[None]).sum(axis=2)                         # [n_out, nsb]
        dx = qa.d[row][None, :]
        d = (d_w * dx).astype(np.float32).astype(np.float64)
        dm = (dmin_w * dx).astype(np.float32).astype(np.float64)
        return (d * sumi - dm * summ).sum(axis=1)
    if t == T.Q6_K:
        blk = raw2d.reshape(n_out, -1, 210)                       # [n_out, nsb, 210]
        nsb = blk.shape[1]
        d_w = _f16(blk, 208)
        ql = blk[:, :, :128].reshape(n_out, nsb, 2, 64).astype(np.int64)
        qh = blk[:, :, 128:192].reshape(n_out, nsb, 2, 32).astype(np.int64)
        lo = np.concatenate([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
        hi = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
        q = (lo | (hi << 4)).reshape(n_out, nsb, 16, 16) - 32     # [n_out, nsb, 16 sub-blocks, 16]
        sc = blk[:, :, 192:208].view(np.int8).astype(np.int64)   # [n_out, nsb, 16]
        isub = np.einsum("rbsl,bsl->rbs", q, xi.reshape(nsb, 16, 16))
        sumi = (sc * isub).sum(axis=2)
        d = (d_w * qa.d[row][None, :]).astype(np.float32).astype(np.float64)
        return (d * sumi).sum(axis=1)
    raise ValueError(f"no reference for {t.name}")


def random_blocks(rng: np.random.Generator, ggml_type, n_elements: int, scale: float = 0.05) -> np.ndarray:
    """uint8[bytes]: random but valid data of `n_elements` values in format `ggml_type`.

    Every quant byte is random; every f16 scale field is overwritten with a finite normal(0, scale)
    value (random bytes there would give infinities and NaNs).  For F32/F16/BF16: normal values.
    Used by the tests and the benchmarks for the formats gguf-py cannot quantize (the K-quants).
    """
    t = T(int(ggml_type))
    if t == T.F32:
        return rng.standard_normal(n_elements).astype(np.float32).view(np.uint8)
    if t == T.F16:
        return rng.standard_normal(n_elements).astype(np.float16).view(np.uint8)
    if t == T.BF16:
        u = rng.standard_normal(n_elements).astype(np.float32).view(np.uint32)
        return (u >> 16).astype(np.uint16).view(np.uint8)
    from gguf.constants import GGML_QUANT_SIZES
    qk, bpb = GGML_QUANT_SIZES[t]
    if n_elements % qk:
        raise ValueError(f"{n_elements} is not a whole number of {qk}-element blocks")
    nb = n_elements // qk
    raw = rng.integers(0, 256, size=(nb, bpb), dtype=np.uint8)  # [n_blocks, bytes per block]
    f16_fields = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_1: (0, 2), T.Q5_1: (0, 2),
                  T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[t]
    for off in f16_fields:
        v = (rng.standard_normal(nb) * scale).astype(np.float16)
        raw[:, off:off + 2] = v.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)
