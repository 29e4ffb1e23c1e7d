"""The small ops, each against an independent statement of what it must compute."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

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


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in float32 units in the last place (a, b finite and of one sign)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_expf_is_within_one_ulp_of_the_correctly_rounded_exp():
    from numba import njit

    @njit
    def exp_all(x, out):
        for j in range(x.shape[0]):
            out[j] = ops.expf(x[j])

    # every 61st float32 from -0 down to -86.5 and from 0 up to 88.72: ~36 M values
    neg = np.arange(np.float32(-0.0).view(np.uint32), np.float32(-86.5).view(np.uint32),
                    61, dtype=np.uint32).view(np.float32)
    pos = np.arange(0, np.float32(88.72).view(np.uint32), 61,
                    dtype=np.uint32).view(np.float32)
    x = np.concatenate([neg, pos])
    got = np.empty_like(x)
    exp_all(x, got)
    want = np.exp(x.astype(np.float64)).astype(np.float32)  # correctly rounded
    ulps = _ulps(got, want)
    assert ulps.max() <= 1
    assert (ulps > 0).mean() < 0.02
    special = np.array([np.nan, -np.inf, np.inf, -100.0, -86.6, 88.8, 0.0], np.float32)
    out = np.empty_like(special)
    exp_all(special, out)
    assert np.isnan(out[0])
    np.testing.assert_array_equal(out[1:], [0.0, np.inf, 0.0, 0.0, np.inf, 1.0])


@pytest.mark.parametrize("rows", [1, 3, 256])
def test_swiglu_on_the_column_views_of_a_fused_product(rows):
    y = (rng.standard_normal((rows, 2 * 96)) * 6).astype(np.float32)
    gate, up = np.split(y, [96], axis=1)            # views, as FusedLinear returns them
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    np.testing.assert_allclose(ops.swiglu(gate, up), want, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(ops.swiglu(gate[0], up[0]), want[0], rtol=1e-6)  # 1-D


def test_f16_store_and_load_equal_numpys_conversion():
    from fucina_course.kv_cache import load_f16, store_f16

    x = np.concatenate([rng.standard_normal(4088) * 10.0 ** rng.integers(-9, 6, 4088),
                        [65504.0, 65520.0, -1e6, 6e-8, 2e-8, -0.0, np.inf, np.nan]]
                       ).astype(np.float32).reshape(-1, 4, 8)
    out = np.zeros(x.shape, np.float16)
    store_f16(out, x)
    with np.errstate(over="ignore"):                 # 65520 and -1e6 round to inf
        want = x.astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(load_f16(out), out.astype(np.float32))
    with pytest.raises(ValueError):
        store_f16(out[:, ::2], x[:, ::2])


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


@pytest.mark.parametrize("q_pos0", [0, 4])
def test_causal_attention_in_query_blocks(monkeypatch, q_pos0):
    # a block of queries is multiplied only by the keys its last query sees: blocks of
    # 5 must give what one block gives, and what the plain loop gives, for queries
    # that start at 0 and later (a chunked prompt)
    n, H, KV, D = 23, 4, 2, 16
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    k, v = (rng.standard_normal((q_pos0 + n, KV, D)).astype(np.float32) for _ in range(2))
    whole = attention.causal_attention(q, k, v, q_pos0, 0.25)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 5)
    blocks = attention.causal_attention(q, k, v, q_pos0, 0.25)
    np.testing.assert_allclose(blocks, whole, rtol=0, atol=1e-6)
    q16, k16, v16 = (attention.f16_round(a).astype(np.float64) for a in (q, k, v))
    out = blocks.reshape(n, H, D)
    for i in (0, 4, 5, 9, 10, 22):                  # each side of a block's edge
        for h in range(H):
            s = k16[: q_pos0 + i + 1, h // 2] @ q16[i, h] * 0.25
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ v16[: q_pos0 + i + 1, h // 2]
            np.testing.assert_allclose(out[i, h], want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("count", [1, 15, 16, 17, 41, 1000])
def test_softmax_row_max_sees_every_score(count):
    # the row max is taken 16 scores at a time, then the tail: a wrong max (a score
    # left out) makes exp overflow to inf and the probabilities NaN, or all zero
    from fucina_course.quant._intrinsics import block16_max

    for where in {0, count // 2, count - 1}:
        row = np.zeros(1000, np.float32)
        row[where] = 500.0
        attention._softmax_f16(row, count, np.float32(1.0))
        want = np.zeros(count)
        want[where] = 1.0
        np.testing.assert_array_equal(row[:count], want)
    max16 = njit(lambda x, o, top: block16_max(x, o, top))     # an intrinsic: compiled
    x = rng.standard_normal(64).astype(np.float32)
    x[[3, 40]] = [np.inf, -np.inf]
    assert max16(x, 0, np.float32(-np.inf)) == np.inf
    assert max16(x, 16, np.float32(-7.0)) == x[16:32].max()
    assert max16(x, 32, np.float32(9.0)) == 9.0
    assert max16(x, 48, np.float32(-np.inf)) == x[48:].max()


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
