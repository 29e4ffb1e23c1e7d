"""The small ops, each against an independent statement of what it must compute."""

from __future__ import annotations

import numpy as np
import pytest

from fucina_course import attention, ops
from fucina_course.kv_cache import KvCache

rng = np.random.default_rng(0)


def test_rms_norm_matches_the_formula():
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), want, rtol=2e-6, atol=1e-6)


def test_rope_position_zero_is_identity_and_one_turns_pair_zero_by_one_radian():
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    cos, sin = ops.rope_angles(np.array([0, 1]), 8, 10000.0)
    y = ops.apply_rope(x, cos, sin, "neox")
    np.testing.assert_array_equal(y[0], x[0])
    a, b = x[1, 0, 0], x[1, 0, 4]  # neox: channel 0 pairs with channel d/2
    np.testing.assert_allclose([y[1, 0, 0], y[1, 0, 4]],
                               [a * np.cos(1) - b * np.sin(1), a * np.sin(1) + b * np.cos(1)], rtol=1e-6)


@pytest.mark.parametrize("style", ["neox", "normal"])
def test_rope_scores_depend_only_on_relative_position(style):
    """q at p and k at p - 3 give the same dot product for every p: rotations cancel."""
    q = rng.standard_normal((1, 1, 64)).astype(np.float32).repeat(40, 0)
    k = rng.standard_normal((1, 1, 64)).astype(np.float32).repeat(40, 0)
    pos = np.arange(40)
    cos, sin = ops.rope_angles(pos, 64, 10000.0)
    qr, kr = ops.apply_rope(q, cos, sin, style), ops.apply_rope(k, cos, sin, style)
    scores = np.array([qr[p, 0] @ kr[p - 3, 0] for p in range(3, 40)])
    np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
    assert abs(qr[10, 0] @ kr[7, 0] - qr[10, 0] @ kr[5, 0]) > 1e-3  # another gap, another score


def test_attention_over_one_position_returns_v():
    q = rng.standard_normal((1, 4, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 32)).astype(np.float32)
    out = attention.causal_attention(q, rng.standard_normal((1, 2, 32)).astype(np.float32), v, 0, 0.2)
    want = attention.f16_round(v)[0, [0, 0, 1, 1]].reshape(-1)  # heads 0,1 read KV head 0; 2,3 read 1
    np.testing.assert_array_equal(out[0], want)


def test_causal_mask_and_head_grouping_against_a_plain_loop():
    n, H, KV, D = 7, 6, 2, 16
    q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32) for h in (H, KV, KV))
    out = attention.causal_attention(q, k, v, 0, 0.25).reshape(n, H, D)
    q16, k16, v16 = (attention.f16_round(a).astype(np.float64) for a in (q, k, v))
    for i in range(n):
        for h in range(H):
            kv = h // (H // KV)
            s = k16[: i + 1, kv] @ q16[i, h] * 0.25
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[i, h], p @ v16[: i + 1, kv], rtol=2e-3, atol=2e-3)


def test_future_keys_do_not_leak():
    q, k, v = (rng.standard_normal((5, 2, 32)).astype(np.float32) for _ in range(3))
    a = attention.causal_attention(q, k, v, 0, 0.2)
    k2, v2 = k.copy(), v.copy()
    k2[3:], v2[3:] = 99.0, -99.0
    b = attention.causal_attention(q, k2, v2, 0, 0.2)
    np.testing.assert_array_equal(a[:3], b[:3])


@pytest.mark.parametrize("cache_type,atol", [("f16", 2e-3), ("q8_0", 1e-2)])
def test_decode_kernel_equals_prefill_attention(cache_type, atol):
    n, H, KV, D = 20, 8, 2, 64
    q, k, v = (rng.standard_normal((n, h, D)).astype(np.float32) for h in (H, KV, KV))
    cache = KvCache(1, KV, D, 32, cache_type)
    cache.append_layer(0, k, v)
    keys, values = cache.read(0, n)
    full = attention.causal_attention(q, keys, values, 0, 0.125)
    rows = np.stack([attention.decode_attention(q[i], cache.layer_view(0, i + 1), 0.125) for i in range(n)])
    np.testing.assert_allclose(rows, full, atol=atol)


def test_kv_cache_contract():
    from fucina_course import KvCacheHeadDimNotBlockAligned, KvCacheOverflow

    c = KvCache(2, 1, 32, 4)
    c.append_layer(0, np.ones((3, 1, 32), np.float32), np.ones((3, 1, 32), np.float32))
    assert c.len == 0          # append does not advance...
    c.advance(3)
    assert c.len == 3          # ...advance does, once per step
    with pytest.raises(KvCacheOverflow):
        c.append_layer(0, np.ones((2, 1, 32), np.float32), np.ones((2, 1, 32), np.float32))
    c.truncate(1)
    assert c.len == 1 and c.remaining == 3
    with pytest.raises(KvCacheHeadDimNotBlockAligned):
        KvCache(1, 1, 48, 4, "q8_0")
