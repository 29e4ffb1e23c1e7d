"""The synthetic MoE routing knobs of synth_router.py: token-spread hidden states and a
Zipf popularity, each checked against what the model then really routes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from fucina_course import moe
from fucina_course.errors import FucinaError
from fucina_course.model import Model
from fucina_course.synth import TINY_QWEN3_MOE, cached_synthetic, with_format
from fucina_course.synth_router import (capped, popularity_scales, routed_synthetic,
                                        top_k_frequencies, zipf)

SPEC = with_format(TINY_QWEN3_MOE, "Q8_0")      # 8 experts, 2 a token


def routes(path, tokens: int = 256) -> list[np.ndarray]:
    """Per layer, how many of a prefill's routes each expert took (sorted, largest
    first)."""
    model = Model.load(path)
    ids = np.random.default_rng(3).integers(300, 4000, tokens).tolist()
    with moe.recording(model) as log:
        model.forward_all_logits(ids)
    return [np.sort(log.load(i))[::-1] for i in range(len(model.layers))]


def top_share(counts: np.ndarray, n: int = 2) -> float:
    return counts[:n].sum() / counts.sum()


def test_capped_keeps_a_distribution_under_the_cap():
    p = capped(zipf(128, 1.5), 1 / 8)
    assert p.max() <= 1 / 8 + 1e-12
    assert p.sum() == pytest.approx(1.0)
    assert np.all(np.diff(p) <= 1e-15)                 # still ranked
    assert np.array_equal(capped(zipf(8, 0.0), 1 / 2), zipf(8, 0.0))


@pytest.mark.parametrize("skew", [0.3, 0.6])
def test_scales_give_the_zipf_shares_on_fresh_logits(skew):
    scales = popularity_scales(128, 8, skew, np.random.default_rng(0))
    z = np.random.default_rng(99).standard_normal((20_000, 128))   # not the fit's rows
    got = top_k_frequencies(scales, 8, z)
    want = zipf(128, skew)
    assert got[:26].sum() == pytest.approx(want[:26].sum(), abs=0.02)
    assert np.abs(got[:8] / want[:8] - 1).max() < 0.1


def test_skew_zero_leaves_the_scales_alone():
    assert np.array_equal(popularity_scales(16, 2, 0.0, np.random.default_rng(0)),
                          np.ones(16))


def test_spread_hidden_states_spread_the_routes():
    plain = routes(cached_synthetic(SPEC))
    spread = routes(routed_synthetic(SPEC, 0.0))
    # the plain file's tokens keep to few experts, the spread one's do not
    assert max(top_share(c) for c in spread) < min(top_share(c) for c in plain)
    assert all(top_share(c) < 0.45 for c in spread)    # uniform: 2 of 8 = 25%


def test_a_skew_concentrates_the_routes_as_asked():
    flat = routes(routed_synthetic(SPEC, 0.0))
    steep = routes(routed_synthetic(SPEC, 1.5))
    for a, b in zip(flat, steep):
        assert top_share(b) > top_share(a) + 0.1


def test_a_skew_only_scales_router_rows():
    base = {t.name: np.array(t.data) for t in GGUFReader(routed_synthetic(SPEC, 0.0)).tensors}
    steep = {t.name: np.array(t.data) for t in GGUFReader(routed_synthetic(SPEC, 1.5)).tensors}
    assert base.keys() == steep.keys()
    for name in base:
        if name.endswith("ffn_gate_inp.weight"):
            ratio = steep[name] / base[name]                 # one factor a row
            assert np.allclose(ratio, ratio[:, :1], rtol=1e-5)
            assert not np.allclose(ratio, 1)
        else:
            assert np.array_equal(base[name], steep[name]), name


@pytest.mark.parametrize("skew", [-0.5, float("nan"), float("inf"), 2.5])
def test_a_bad_skew_is_refused(skew):
    with pytest.raises(FucinaError, match="router skew"):
        routed_synthetic(SPEC, skew)


def test_a_dense_geometry_is_refused():
    from fucina_course.synth import TINY_QWEN3

    with pytest.raises(FucinaError, match="not a mixture-of-experts"):
        routed_synthetic(TINY_QWEN3, 0.0)
