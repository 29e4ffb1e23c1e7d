"""The KV cache's oracle: cached decode == a cacheless pass, bit for bit, like for like.

`oracles.verify_cache` compares each decode step's logits with one cacheless pass over the
final sequence, both computed row by row through the decode kernels, with keys and values
rounded as the cache stores them.  Every operation is then the same kernel on the same
numbers, so the expected difference is exactly zero: on the synthetic models in several
formats, on both real models, for prompts of 1, 8, 9, 64 and 300 tokens, for f16 and q8_0
caches, and on every kernel level this CPU can run (the lower ones forced in a subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from fucina_course.oracles import verify_cache
from fucina_course.quant import isa
from model_cases import tiny_model
from test_model import load, synth_dir  # noqa: F401  (fixture)

PROMPT_LENGTHS = [1, 8, 9, 64, 300]
TEXT = ("The history of Paris spans more than two thousand years, from a settlement of the "
        "Parisii on an island in the Seine to one of the great capitals of the world. ") * 12


def prompt(model, n: int) -> list[int]:
    ids = model.tokenizer.encode(TEXT)
    assert len(ids) >= n
    return ids[:n]


def assert_bit_identical(check):
    assert float(check.diff.max()) == 0.0, f"max |cached - uncached| = {check.diff.max():.3g}"
    assert check.argmax_equal.all()
    assert check.ok


@pytest.mark.parametrize("fmt", ["F32", "Q8_0", "Q4_K", "Q4_1"])
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_synthetic(fmt, cache_type, synth_dir):  # noqa: F811  (the fixture)
    model = load(tiny_model(fmt, synth_dir))
    rng = np.random.default_rng(7)
    for n in (1, 8, 9, 64):
        ids = rng.integers(0, 4093, size=n).tolist()
        assert_bit_identical(verify_cache(model, ids, 4, cache_type, fast=False))


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_real_models(name, cache_type, n, coder_path, smollm_path):
    model = load(coder_path if name.startswith("qwen") else smollm_path)
    assert_bit_identical(verify_cache(model, prompt(model, n), 2, cache_type, fast=False))


def test_the_fast_path_spread_is_reported_not_hidden(coder_path):
    """The fast prefill path really differs (that is why the oracle compares like for like)."""
    model = load(coder_path)
    check = verify_cache(model, prompt(model, 64), 2, "q8_0", fast=True)
    assert_bit_identical(check)
    assert check.fast_diff.max() > 0 and check.q8_diff.max() > 0


def test_a_corrupted_cache_is_caught(coder_path):
    """The oracle can fail: one flipped value in a cached key of layer 3 changes the logits."""

    class Corrupting:
        def __init__(self, model):
            self.model, self.calls = model, 0

        def __getattr__(self, name):
            return getattr(self.model, name)

        def forward_step(self, ids, pos0, cache, **kw):
            out = self.model.forward_step(ids, pos0, cache, **kw)
            self.calls += 1
            if self.calls == 1:  # after the prefill: damage position 2 of layer 3
                cache.k[3][2, 0, :8] += np.float16(0.5)
            return out

    model = load(coder_path)
    check = verify_cache(Corrupting(model), prompt(model, 9), 2, "f16", fast=False)
    assert not check.ok and check.diff[1:].min() > 0


# every kernel level below the best one (quant/isa.py), forced with FUCINA_SIMD
LOWER_LEVELS = {lv: {"FUCINA_SIMD": lv} for lv in isa.LEVELS[1:]}


@pytest.mark.parametrize("level", list(LOWER_LEVELS))
@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_cli_on_a_forced_lower_level(name, cache_type, level, coder_path, smollm_path):
    """`fucina verify-cache` exits 0 with the kernels of a CPU with fewer instructions
    (avxvnni: Alder Lake; avx2: Zen 2/3; generic: ARM)."""
    if not isa.usable(level, isa.numba_cpu_features()):
        pytest.skip(f"this CPU cannot run the {level} kernels")
    env = {**os.environ, "FUCINA_NO_VNNI": "", **LOWER_LEVELS[level]}
    cmd = [sys.executable, "-m", "fucina_course", "verify-cache", name, "--steps", "2",
           "--no-fast", "--cache-type", cache_type, "--threads", "2",
           "--prompt", TEXT[:300]]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "like for like: worst 0," in run.stdout
